//! `batch-size`: peak memory and throughput over a sweep of batch sizes, with the fixed part
//! (weights, gradients, optimizer state) and the per-sample part (activations) fitted as a
//! line.

use super::common::{cnn, cnn_side, fit_line, increasing, stripes, train_fresh_interleaved};
use super::{Experiment, Sweep};
use crate::plots::{MIB, lines};
use crate::techniques::Technique;
use crate::{Claim, Context, ExperimentError, Verdict, human_bytes};
use serde::Serialize;
use serde_json::json;

pub(super) static EXPERIMENT: Experiment<Measured> = Experiment {
    technique: Technique {
        id: "batch-size",
        name: "smaller batch size",
        claim: "32 -> 8 often relieves memory pressure noticeably; memory falls with batch size",
        source: "003_9fc4b5f809544d8d.txt (32 -> 8), 001_eb115694b312c654.txt, 002_07a140921eef9482.txt",
    },
    run,
    plot: Some(plot),
    host_capacity_limit: None,
    expected_secs: [3.0, 50.0],
};

/// One batch size's measurements.
#[derive(Serialize)]
pub(super) struct Measured {
    batch_size: usize,
    samples_per_s: f64,
    last_loss: f32,
    params_bytes: u64,
    grads_bytes: u64,
    optimizer_state_bytes: u64,
    activation_bytes_estimate: u64,
}

fn run(ctx: &Context) -> Result<Sweep<Measured>, ExperimentError> {
    let batches: &[usize] = if ctx.quick { &[4, 8, 16, 32] } else { &[4, 8, 16, 32, 64] };
    let side = cnn_side(ctx);
    let arch = cnn(ctx, false);
    let data = stripes(side);
    let mut sweep = Sweep::new(
        ctx,
        json!({ "model": format!("{arch:?}"), "image_side": side, "batch_sizes": batches, "optimizer": "AdamW" }),
    );
    let mut peaks = Vec::new();
    let mut fixed_analytic = 0;
    let runs = batches.iter().map(|&b| (arch.clone(), data.clone(), b)).collect();
    for (&b, m) in batches.iter().zip(train_fresh_interleaved(ctx, runs)?) {
        fixed_analytic = m.param_bytes + m.grad_bytes + m.optimizer_bytes;
        let measured = Measured {
            batch_size: b,
            samples_per_s: m.samples_per_s,
            last_loss: m.last_loss,
            params_bytes: m.param_bytes,
            grads_bytes: m.grad_bytes,
            optimizer_state_bytes: m.optimizer_bytes,
            activation_bytes_estimate: m.peak_allocated.saturating_sub(fixed_analytic),
        };
        sweep.push(
            &format!("batch {b}"),
            m.peak_allocated,
            m.peak_reserved,
            Some(m.step),
            measured,
        );
        peaks.push((b, m.peak_allocated));
    }
    let xs: Vec<f64> = peaks.iter().map(|&(b, _)| b as f64).collect();
    let ys: Vec<f64> = peaks.iter().map(|&(_, p)| p as f64).collect();
    let (fixed, per_sample, r2) = fit_line(&xs, &ys);
    let only_peaks: Vec<u64> = peaks.iter().map(|&(_, p)| p).collect();
    let grows = increasing(&only_peaks);
    sweep.claim(Claim {
        claim: "memory falls with batch size (peak = fixed part + per-sample part x batch)".into(),
        measured: format!(
            "peak allocated {} over batches {:?}; fitted fixed part {} (weights + grads + AdamW state: {}), per sample {}, r^2 {r2:.4}",
            only_peaks.iter().map(|&p| human_bytes(p)).collect::<Vec<_>>().join(", "),
            batches,
            human_bytes(fixed.max(0.0) as u64),
            human_bytes(fixed_analytic),
            human_bytes(per_sample.max(0.0) as u64),
        ),
        verdict: if grows && r2 > 0.98 { Verdict::Holds } else if grows { Verdict::Partly } else { Verdict::DoesNotHold },
    });
    let at = |b: usize| peaks.iter().find(|&&(x, _)| x == b).map(|&(_, p)| p);
    if let (Some(p32), Some(p8)) = (at(32), at(8)) {
        let saving = 1.0 - p8 as f64 / p32 as f64;
        sweep.claim(Claim {
            claim: "32 -> 8 often relieves memory pressure noticeably".into(),
            measured: format!(
                "batch 32: {}, batch 8: {}: {:.0}% less (the fixed part {} does not shrink)",
                human_bytes(p32),
                human_bytes(p8),
                100.0 * saving,
                human_bytes(fixed_analytic)
            ),
            verdict: if saving >= 0.25 {
                Verdict::Holds
            } else if saving >= 0.10 {
                Verdict::Partly
            } else {
                Verdict::DoesNotHold
            },
        });
    }
    Ok(sweep)
}

/// Peak memory against batch size.
fn plot(sweep: &Sweep<Measured>) -> Option<String> {
    let pts = |f: fn(&crate::Variant) -> u64| -> Vec<(f64, f64)> {
        sweep.variants().iter().map(|(v, m)| (m.batch_size as f64, f(v) as f64 / MIB)).collect()
    };
    let series = vec![
        ("peak allocated".to_string(), pts(|v| v.peak_allocated_bytes)),
        ("peak reserved".to_string(), pts(|v| v.peak_reserved_bytes)),
    ];
    lines("Peak memory vs batch size", "batch size", "MiB", &series, true)
}
