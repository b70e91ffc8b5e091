//! `batch-size`: peak memory and throughput over a sweep of batch sizes, with the fixed part
//! (weights, gradients, optimizer state) and the per-sample part (activations) fitted as a
//! line.

use super::Sweep;
use super::common::{cnn, cnn_side, fit_line, increasing, stripes, train_fresh};
use crate::{Claim, Context, ExperimentResult, Verdict, human_bytes};
use serde_json::json;

pub fn run(ctx: &Context) -> Result<ExperimentResult, String> {
    let batches: &[usize] = if ctx.quick { &[4, 8, 16, 32] } else { &[4, 8, 16, 32, 64] };
    let side = cnn_side(ctx);
    let arch = cnn(ctx, false);
    let data = stripes(side);
    let mut sweep = Sweep::new(
        ctx,
        "batch-size",
        json!({ "model": format!("{arch:?}"), "image_side": side, "batch_sizes": batches, "optimizer": "AdamW" }),
    );
    let mut peaks = Vec::new();
    let mut fixed_analytic = 0;
    for &b in batches {
        let m = train_fresh(ctx, arch.clone(), &data, b, "")?;
        fixed_analytic = m.param_bytes + m.grad_bytes + m.optimizer_bytes;
        let mut v = sweep.variant(
            &format!("batch {b}"),
            m.peak_allocated,
            m.peak_reserved,
            Some(m.step_ms),
        );
        v.extra.insert("batch_size".into(), json!(b));
        v.extra.insert("samples_per_s".into(), json!(m.samples_per_s));
        v.extra.insert("last_loss".into(), json!(m.last_loss));
        v.extra.insert("params_bytes".into(), json!(m.param_bytes));
        v.extra.insert("grads_bytes".into(), json!(m.grad_bytes));
        v.extra.insert("optimizer_state_bytes".into(), json!(m.optimizer_bytes));
        v.extra.insert(
            "activation_bytes_estimate".into(),
            json!(
                m.peak_allocated.saturating_sub(m.param_bytes + m.grad_bytes + m.optimizer_bytes)
            ),
        );
        sweep.push(v);
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
    Ok(sweep.finish())
}
