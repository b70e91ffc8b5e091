//! `batch-size`: peak memory and throughput over a sweep of batch sizes, with the fixed part
//! (weights, gradients, optimizer state) and the per-sample part (activations) fitted as a
//! line.

use super::common::{
    EXECUTED, REAL_SIZE_CAVEAT, REAL_VIRTUAL, RealCase, bytes_list, cnn, cnn_side, fit_line,
    increasing, note_not_executed, push_real_rows, real_allocs, real_case, real_model, real_part,
    real_tag, stripes, train_fresh_interleaved,
};
use super::{Experiment, Sweep};
use crate::plan::{ModelOverrides, PlanKind, Precision};

/// The batches the fixed and per-sample parts are fitted over, as the claims quote them.
const FOOTPRINT: &str = "1-16";
use crate::plots::{FittedSeries, measured_and_fit};
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
    expected_secs: [2.2, 30.0],
};

/// One batch size's measurements: the small executed run has every field, the real-size
/// part (virtual device, nothing computed) the model and batch only.
#[derive(Serialize)]
pub(super) struct Measured {
    part: &'static str,
    model: String,
    batch_size: usize,
    samples_per_s: Option<f64>,
    last_loss: Option<f32>,
    params_bytes: Option<u64>,
    grads_bytes: Option<u64>,
    optimizer_state_bytes: Option<u64>,
    activation_bytes_estimate: Option<u64>,
    /// Real size: the model's fixed part ([`crate::advice::footprint`], the advice table's).
    #[serde(skip_serializing_if = "Option::is_none")]
    fixed_bytes: Option<u64>,
    /// Real size: the model's per-sample part (the same footprint).
    #[serde(skip_serializing_if = "Option::is_none")]
    per_sample_bytes: Option<u64>,
}

const SMALL: &str = "small (executed)";
const REAL: &str = REAL_VIRTUAL;

/// The real-size models and the batches swept (GPT-2 at 1024 tokens, ResNet-50 at 224 px).
fn real_sweeps(quick: bool) -> Vec<(&'static str, Vec<usize>)> {
    if quick {
        vec![
            ("gpt2-small", vec![1, 2, 4, 8, 16, 32]),
            ("resnet50", vec![8, 16, 32, 64]),
            ("gpt2-medium", vec![1, 2, 4, 8]),
        ]
    } else {
        vec![
            ("gpt2-small", vec![1, 2, 4, 8, 16, 32]),
            ("resnet50", vec![8, 16, 32, 64, 128, 256]),
            ("gpt2-medium", vec![1, 2, 4, 8, 16]),
        ]
    }
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
            part: SMALL,
            model: format!("{arch:?}"),
            batch_size: b,
            samples_per_s: Some(m.samples_per_s),
            last_loss: Some(m.last_loss),
            params_bytes: Some(m.param_bytes),
            grads_bytes: Some(m.grad_bytes),
            optimizer_state_bytes: Some(m.optimizer_bytes),
            activation_bytes_estimate: Some(m.peak_allocated.saturating_sub(fixed_analytic)),
            fixed_bytes: None,
            per_sample_bytes: None,
        };
        sweep.push(
            &format!("{SMALL}: batch {b}"),
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

    // Real size: every model's peak over its batches on the virtual device, fp32 + AdamW,
    // and on a GPU each batch the card holds executed there (the figures then come from the
    // GPU, the virtual device's prediction beside them).
    let mut real = Vec::new();
    let mut not_run = Vec::new();
    for (name, batches) in real_sweeps(ctx.quick) {
        let model = real_model(name, &ModelOverrides::default())?;
        let fp = crate::advice::footprint(&model)?;
        let label = real_tag(&model, "fp32");
        let mut cases = Vec::new();
        for &b in &batches {
            let case = real_case(ctx, &model, Precision::Fp32, PlanKind::None, (b, 1))?;
            let what = format!("{label}, batch {b}");
            not_run.extend(push_real_rows(&mut sweep, &what, &case, b, |part, per_s, loss| {
                Measured {
                    part,
                    model: label.clone(),
                    batch_size: b,
                    samples_per_s: per_s,
                    last_loss: loss,
                    params_bytes: None,
                    grads_bytes: None,
                    optimizer_state_bytes: None,
                    activation_bytes_estimate: None,
                    fixed_bytes: Some(fp.fixed),
                    per_sample_bytes: Some(fp.per_sample),
                }
            }));
            cases.push(case);
        }
        let refs: Vec<&RealCase> = cases.iter().collect();
        let part = real_part(&refs);
        let pts: Vec<(usize, u64)> = batches.iter().copied().zip(real_allocs(&refs)).collect();
        let xs: Vec<f64> = pts.iter().map(|&(b, _)| b as f64).collect();
        let ys: Vec<f64> = pts.iter().map(|&(_, p)| p as f64).collect();
        // Linearity over this sweep; the fixed and per-sample figures are the footprint's.
        let (_, _, r2) = fit_line(&xs, &ys);
        real.push((name, label, pts, fp.fixed as f64, fp.per_sample as f64, r2, part));
    }
    note_not_executed(&mut sweep, &not_run);
    let all_linear =
        real.iter().all(|r| r.5 > 0.99 && increasing(&r.2.iter().map(|p| p.1).collect::<Vec<_>>()));
    let real_fits = real
        .iter()
        .map(|(_, label, pts, a, b, r2, part)| {
            format!(
                "{part}: {label}: {} over batches {:?}, linear to r^2 {r2:.4}; fixed part {} + {} x batch (the line through batches {FOOTPRINT}, as in the advice table)",
                bytes_list(&pts.iter().map(|p| p.1).collect::<Vec<_>>()),
                pts.iter().map(|p| p.0).collect::<Vec<_>>(),
                human_bytes(a.max(0.0) as u64),
                human_bytes(b.max(0.0) as u64)
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    sweep.claim(Claim {
        claim: "memory falls with batch size (peak = fixed part + per-sample part x batch)".into(),
        measured: format!(
            "{SMALL}: peak allocated {} over batches {:?}; fitted fixed part {} (weights + grads + AdamW state: {}), per sample {}, r^2 {r2:.4}. Real size, fp32 + AdamW: {real_fits}",
            bytes_list(&only_peaks),
            batches,
            human_bytes(fixed.max(0.0) as u64),
            human_bytes(fixed_analytic),
            human_bytes(per_sample.max(0.0) as u64),
        ),
        verdict: if grows && r2 > 0.98 && all_linear {
            Verdict::Holds
        } else if grows {
            Verdict::Partly
        } else {
            Verdict::DoesNotHold
        },
    });
    let at = |pts: &[(usize, u64)], b: usize| pts.iter().find(|&&(x, _)| x == b).map(|&(_, p)| p);
    let mut savings = Vec::new();
    if let (Some(p32), Some(p8)) = (at(&peaks, 32), at(&peaks, 8)) {
        savings.push((format!("{SMALL} CNN"), p32, p8));
    }
    for (_, label, pts, .., part) in &real {
        if let (Some(p32), Some(p8)) = (at(pts, 32), at(pts, 8)) {
            savings.push((format!("{part}: {label}"), p32, p8));
        }
    }
    let saving = |&(_, p32, p8): &(String, u64, u64)| 1.0 - p8 as f64 / p32 as f64;
    let least = savings.iter().map(saving).fold(f64::INFINITY, f64::min);
    sweep.claim(Claim {
        claim: "32 -> 8 often relieves memory pressure noticeably".into(),
        measured: format!(
            "{} (the fixed part does not shrink; the small run's weights + gradients + AdamW state: {}; {REAL_SIZE_CAVEAT})",
            savings
                .iter()
                .map(|s| format!(
                    "{}: batch 32 {} -> batch 8 {} ({:.0}% less, {} freed)",
                    s.0,
                    human_bytes(s.1),
                    human_bytes(s.2),
                    100.0 * saving(s),
                    human_bytes(s.1 - s.2.min(s.1))
                ))
                .collect::<Vec<_>>()
                .join("; "),
            human_bytes(fixed_analytic)
        ),
        verdict: if savings.is_empty() {
            Verdict::NotApplicable
        } else if least >= 0.25 {
            Verdict::Holds
        } else if least >= 0.10 {
            Verdict::Partly
        } else {
            Verdict::DoesNotHold
        },
    });
    // Where the fixed part dominates: its share of the peak at batch 1 and 4.
    let share = |a: f64, b: f64, n: f64| a / (a + b * n);
    let shares = real
        .iter()
        .map(|(name, label, _, a, b, ..)| {
            (*name, label.as_str(), share(*a, *b, 1.0), share(*a, *b, 4.0), (a / b).max(0.0))
        })
        .collect::<Vec<_>>();
    if let Some(&(_, medium, s1, s4, even)) = shares.iter().find(|s| s.0 == "gpt2-medium") {
        sweep.claim(Claim {
            claim: "at small batches the fixed part (weights, gradients, AdamW state) dominates a large model's peak, so a smaller batch relieves little (GPT-2 medium)".into(),
            measured: format!(
                "fixed and per-sample parts from the footprint at real size (virtual): {}; per-sample part equals the fixed part at batch {even:.1} for {medium}",
                shares
                    .iter()
                    .map(|(_, n, s1, s4, _)| format!("{n}: fixed part {:.0}% of the peak at batch 1, {:.0}% at batch 4", 100.0 * s1, 100.0 * s4))
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
            verdict: if s1 >= 0.5 && s4 >= 0.5 {
                Verdict::Holds
            } else if s1 >= 0.5 {
                Verdict::Partly
            } else {
                Verdict::DoesNotHold
            },
        });
    }
    let gpt = real.iter().find(|r| r.0 == "gpt2-small");
    let resnet = real.iter().find(|r| r.0 == "resnet50");
    if let (Some(g), Some(r)) = (gpt, resnet) {
        let fits =
            |pts: &[(usize, u64)], cap: u64| pts.iter().filter(|p| p.1 <= cap).map(|p| p.0).max();
        let cap = 24u64 << 30;
        sweep.reading(format!(
            "{}: each sample costs {} in {} (1024 tokens) and {} in ResNet-50 (224 px, fp32) on top of a fixed {} / {}; on a 24 GiB card the largest batch measured that fits is {} / {} (before the CUDA context and workspaces). Halving the batch frees per-sample x half the batch, never the fixed part.",
            if g.6 == r.6 { g.6 } else { "real size (executed and virtual)" },
            human_bytes(g.4.max(0.0) as u64),
            g.1,
            human_bytes(r.4.max(0.0) as u64),
            human_bytes(g.3.max(0.0) as u64),
            human_bytes(r.3.max(0.0) as u64),
            fits(&g.2, cap).map_or("none".into(), |b| b.to_string()),
            fits(&r.2, cap).map_or("none".into(), |b| b.to_string()),
        ));
    }
    Ok(sweep)
}

/// Real-size peak memory against batch size with each model's fitted line.
fn plot(sweep: &Sweep<Measured>) -> Option<String> {
    let mut series: Vec<FittedSeries> = Vec::new();
    let mut models: Vec<&str> = Vec::new();
    for (_, m) in sweep.variants() {
        if m.part == REAL && !models.contains(&m.model.as_str()) {
            models.push(&m.model);
        }
    }
    for model in models {
        // The GPU's rows where the model's batches ran there, else the virtual device's.
        let of = |part: &str| -> Vec<_> {
            sweep.variants().iter().filter(|(_, m)| m.part == part && m.model == model).collect()
        };
        let (rows, source) = match of(EXECUTED) {
            r if !r.is_empty() && r.len() == of(REAL).len() => (r, "executed on the GPU"),
            _ => (of(REAL), "virtual device"),
        };
        let pts: Vec<(f64, f64)> = rows
            .iter()
            .map(|(v, m)| (m.batch_size as f64, v.peak_allocated_bytes as f64 / GIB))
            .collect();
        let top = pts.iter().map(|p| p.0).fold(0.0, f64::max);
        let (a, b) = rows.first().map_or((0.0, 0.0), |(_, m)| {
            (m.fixed_bytes.unwrap_or(0) as f64 / GIB, m.per_sample_bytes.unwrap_or(0) as f64 / GIB)
        });
        series.push((
            format!("{model} ({source})"),
            pts,
            format!("fixed {a:.2} + {b:.3} x batch GiB (line through batches {FOOTPRINT})"),
            vec![(0.0, a), (top, a + b * top)],
        ));
    }
    let top = series.iter().flat_map(|s| s.1.iter().map(|p| p.1)).fold(0.0, f64::max);
    measured_and_fit(
        "Real size: peak vs batch, fp32 + AdamW",
        "batch size (samples)",
        "peak allocated (GiB)",
        &series,
        &crate::plots::cards_near(top),
    )
}

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
