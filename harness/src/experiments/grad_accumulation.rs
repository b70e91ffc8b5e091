//! `grad-accumulation`: k micro-batches of B/k with the loss divided by k and one optimizer
//! step, for k = 1, 2, 4, 8 at the same effective batch; gradients compared with the full
//! batch.

use super::Sweep;
use super::common::{cnn, cnn_side, device, gradients, max_relative_difference, median, stripes};
use crate::models::Model;
use crate::trainer::{Hooks, TrainConfig, Trainer};
use crate::{Claim, Context, ExperimentResult, Verdict, human_bytes};
use serde_json::json;
use vram_kernels::DType;

/// Keeps the accumulated gradients of the first step.
struct FirstGradients(Vec<Vec<f32>>);

impl Hooks for FirstGradients {
    fn on_backward_end(&mut self, step: usize, model: &Model) {
        if step == 0 {
            self.0 = gradients(model);
        }
    }
}

pub fn run(ctx: &Context) -> Result<ExperimentResult, String> {
    let batch = if ctx.quick { 32 } else { 64 };
    let steps = if ctx.quick { 3 } else { 6 };
    let (side, arch) = (cnn_side(ctx), cnn(ctx, false));
    let data = stripes(side);
    let mut sweep = Sweep::new(
        ctx,
        "grad-accumulation",
        json!({ "model": format!("{arch:?}"), "effective_batch": batch, "normalization": "mean", "steps": steps }),
    );
    let mut reference = Vec::new();
    let mut rows = Vec::new();
    for k in [1usize, 2, 4, 8] {
        let dev = device(ctx, "")?;
        let model =
            Model::new(&dev, arch.clone(), ctx.seed, DType::F32).map_err(|e| e.to_string())?;
        let cfg = TrainConfig { batch, accumulation: k, ..TrainConfig::default() };
        let mut trainer =
            Trainer::new(model, data.clone(), ctx.seed, cfg).map_err(|e| e.to_string())?;
        let mut first = FirstGradients(Vec::new());
        let ends = trainer.run(steps, &mut first).map_err(|e| e.to_string())?;
        let difference = if k == 1 {
            reference = first.0;
            0.0
        } else {
            max_relative_difference(&reference, &first.0)
        };
        let mut times: Vec<f64> = ends[1..].iter().map(|e| e.step_ms).collect();
        let step_ms = median(&mut times);
        let mut v = sweep.variant(
            &format!("k = {k} (micro-batch {})", batch / k),
            dev.max_memory_allocated(),
            dev.max_memory_reserved(),
            Some(step_ms),
        );
        v.extra.insert("k".into(), json!(k));
        v.extra.insert("samples_per_s".into(), json!(batch as f64 / (step_ms / 1e3)));
        v.extra.insert("grad_max_relative_difference_vs_full_batch".into(), json!(difference));
        sweep.push(v);
        rows.push((k, dev.max_memory_allocated(), step_ms, difference));
    }
    let peaks: Vec<u64> = rows.iter().map(|r| r.1).collect();
    let falls = peaks.windows(2).all(|w| w[1] < w[0]);
    let (first, last) = (rows[0], rows[rows.len() - 1]);
    sweep.claim(Claim {
        claim: "same effective batch, lower memory".into(),
        measured: format!(
            "peak {} for k = 1, 2, 4, 8; k = 8 uses {:.0}% less than k = 1 and takes {:+.0}% time per step (host timings)",
            peaks.iter().map(|&p| human_bytes(p)).collect::<Vec<_>>().join(", "),
            100.0 * (1.0 - last.1 as f64 / first.1 as f64),
            100.0 * (last.2 / first.2 - 1.0)
        ),
        verdict: if falls { Verdict::Holds } else { Verdict::Partly },
    });
    let worst = rows.iter().map(|r| r.3).fold(0.0, f64::max);
    sweep.claim(Claim {
        claim: "accumulated gradients equal the full-batch gradients".into(),
        measured: format!("largest relative difference over k = 2, 4, 8: {worst:.2e} (f32)"),
        verdict: if worst <= 1e-5 {
            Verdict::Holds
        } else if worst <= 1e-3 {
            Verdict::Partly
        } else {
            Verdict::DoesNotHold
        },
    });
    Ok(sweep.finish())
}
