//! `mixed-precision`: fp32 against fp16 with dynamic loss scaling and against bf16, both with
//! f32 master weights (the trainer drives vram-amp's scaler): peak memory split into weights,
//! master weights, gradients, optimizer state and activations; step time; loss agreement;
//! steps the scaler skipped.

use super::Sweep;
use super::common::{device, gpt, median};
use crate::models::Model;
use crate::trainer::{NoHooks, Precision, TrainConfig, Trainer};
use crate::{Backend, Claim, Context, ExperimentResult, Verdict, human_bytes};
use serde_json::json;
use vram_amp::ScalerConfig;

struct Run {
    peak: u64,
    reserved: u64,
    step_ms: f64,
    losses: Vec<f32>,
    weights: u64,
    master: u64,
    grads: u64,
    optimizer: u64,
    skipped: u64,
    final_scale: f32,
}

fn train(ctx: &Context, precision: Precision, steps: usize, batch: usize) -> Result<Run, String> {
    let (arch, data) = gpt(ctx);
    let dev = device(ctx, "")?;
    let model = Model::new(&dev, arch, ctx.seed, precision.dtype()).map_err(|e| e.to_string())?;
    let cfg = TrainConfig { batch, precision, ..TrainConfig::default() };
    let mut trainer = Trainer::new(model, data, ctx.seed, cfg).map_err(|e| e.to_string())?;
    let ends = trainer.run(steps, &mut NoHooks).map_err(|e| e.to_string())?;
    let mut times: Vec<f64> = ends[1..].iter().map(|e| e.step_ms).collect();
    let state = trainer.state_bytes();
    Ok(Run {
        peak: dev.max_memory_allocated(),
        reserved: dev.max_memory_reserved(),
        step_ms: median(&mut times),
        losses: ends.iter().map(|e| e.loss).collect(),
        weights: state.weights,
        master: state.master,
        grads: state.grads,
        optimizer: state.optimizer,
        skipped: trainer.scaler().map_or(0, |s| s.counters().steps_skipped),
        final_scale: trainer.scaler().map_or(1.0, |s| s.scale()),
    })
}

pub fn run(ctx: &Context) -> Result<ExperimentResult, String> {
    let (steps, batch) = if ctx.quick { (8, 16) } else { (30, 8) };
    let (arch, _) = gpt(ctx);
    let mut sweep = Sweep::new(
        ctx,
        "mixed-precision",
        json!({ "model": format!("{arch:?}"), "batch_size": batch, "steps": steps, "optimizer": "AdamW" }),
    );
    let runs = [
        ("fp32", train(ctx, Precision::F32, steps, batch)?),
        (
            "fp16 + dynamic loss scaling, f32 master weights",
            train(ctx, Precision::F16(ScalerConfig::default()), steps, batch)?,
        ),
        ("bf16, f32 master weights", train(ctx, Precision::Bf16, steps, batch)?),
    ];
    let params: u64 = runs[0].1.weights / 4;
    for (name, r) in &runs {
        let state = r.weights + r.master + r.grads + r.optimizer;
        let mut v = sweep.variant(name, r.peak, r.reserved, Some(r.step_ms));
        for (k, val) in [
            ("weights_bytes", json!(r.weights)),
            ("master_weights_bytes", json!(r.master)),
            ("grads_bytes", json!(r.grads)),
            ("optimizer_state_bytes", json!(r.optimizer)),
            ("activations_and_temporaries_bytes", json!(r.peak.saturating_sub(state))),
            ("state_bytes_per_parameter", json!(state as f64 / params as f64)),
            ("losses", json!(r.losses)),
            ("scaler_steps_skipped", json!(r.skipped)),
            ("final_loss_scale", json!(r.final_scale)),
        ] {
            v.extra.insert(k.into(), val);
        }
        sweep.push(v);
    }
    let f32r = &runs[0].1;
    let saving = |r: &Run| 1.0 - r.peak as f64 / f32r.peak as f64;
    let (fp16, bf16) = (&runs[1].1, &runs[2].1);
    let best = saving(fp16).max(saving(bf16));
    sweep.claim(Claim {
        claim: "mixed precision uses about 50% less memory".into(),
        measured: format!(
            "peak {} fp32, {} fp16 ({:.0}% less), {} bf16 ({:.0}% less)",
            human_bytes(f32r.peak),
            human_bytes(fp16.peak),
            100.0 * saving(fp16),
            human_bytes(bf16.peak),
            100.0 * saving(bf16)
        ),
        verdict: if best >= 0.4 {
            Verdict::Holds
        } else if best >= 0.15 {
            Verdict::Partly
        } else {
            Verdict::DoesNotHold
        },
    });
    let speed = format!(
        "memory {:.0}% / {:.0}% less; step {:.1} ms fp32, {:.1} ms fp16, {:.1} ms bf16",
        100.0 * saving(fp16),
        100.0 * saving(bf16),
        f32r.step_ms,
        fp16.step_ms,
        bf16.step_ms
    );
    let (measured, verdict) = match ctx.backend {
        Backend::Cpu => (
            format!(
                "{speed}: host timings, where 16-bit math is emulated in f32; the speed claim is about GPU tensor cores"
            ),
            Verdict::NotApplicable,
        ),
        Backend::Cuda { .. } => {
            let faster = f32r.step_ms / fp16.step_ms.min(bf16.step_ms) - 1.0;
            (
                speed,
                if best >= 0.3 && faster >= 0.2 {
                    Verdict::Holds
                } else if best >= 0.3 || faster >= 0.2 {
                    Verdict::Partly
                } else {
                    Verdict::DoesNotHold
                },
            )
        }
    };
    sweep.claim(Claim { claim: "30%+ less memory and 20%+ faster".into(), measured, verdict });
    let per_param = |r: &Run| (r.weights + r.master + r.grads + r.optimizer) as f64 / params as f64;
    let acts = |r: &Run| r.peak.saturating_sub(r.weights + r.master + r.grads + r.optimizer);
    sweep.claim(Claim {
        claim: "Micikevicius et al.: the saving is in 16-bit activations; weights + grads + Adam state stay ~16 B/parameter with f32 masters".into(),
        measured: format!(
            "state {:.1} B/param fp32, {:.1} fp16, {:.1} bf16; activations and temporaries {} fp32, {} fp16, {} bf16",
            per_param(f32r), per_param(fp16), per_param(bf16), human_bytes(acts(f32r)), human_bytes(acts(fp16)), human_bytes(acts(bf16))
        ),
        verdict: if (per_param(fp16) - per_param(f32r)).abs() <= 1.0 && acts(fp16) < acts(f32r) { Verdict::Holds } else { Verdict::Partly },
    });
    let diff = |r: &Run| {
        r.losses.iter().zip(&f32r.losses).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max)
    };
    sweep.claim(Claim {
        claim: "mixed precision trains like fp32 (loss curves agree; the scaler skips only overflowing steps)".into(),
        measured: format!(
            "largest loss difference to fp32 over {steps} steps: {:.4} fp16, {:.4} bf16; fp16 scaler skipped {} steps (final scale {})",
            diff(fp16), diff(bf16), fp16.skipped, fp16.final_scale
        ),
        verdict: if diff(fp16).max(diff(bf16)) < 0.05 * f32r.losses[0] { Verdict::Holds } else { Verdict::Partly },
    });
    Ok(sweep.finish())
}
