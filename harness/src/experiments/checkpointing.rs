//! `checkpointing`: activation checkpointing plans on a GPT (none, every k, sqrt(n), and the
//! fastest plan within a memory budget): peak memory against extra time, the executor's
//! predicted peak next to the measured one, and gradients compared bit for bit with the plain
//! run.

use super::Sweep;
use super::common::{device, gradients, median, sync};
use crate::data::Dataset;
use crate::models::{Arch, Model};
use crate::{Claim, Context, ExperimentResult, Verdict, human_bytes};
use serde_json::json;
use std::time::Instant;
use vram_accum::{CheckpointPlan, ForwardCtx, Mode, Schedule};
use vram_kernels::DType;

pub fn run(ctx: &Context) -> Result<ExperimentResult, String> {
    let (d, layers, seq, batch, steps) =
        if ctx.quick { (64, 8, 32, 8, 6) } else { (96, 12, 64, 8, 6) };
    let arch = Arch::Gpt { vocab: 64, d, layers, heads: 1, seq, dropout: 0.1, tied: false };
    let data = Dataset::Sequences { vocab: 64, seq };
    let first = data.batch(ctx.seed, 0, batch);

    // Profile the chain once to predict every plan.
    let dev = device(ctx, "")?;
    let mut model =
        Model::new(&dev, arch.clone(), ctx.seed, DType::F32).map_err(|e| e.to_string())?;
    let profile = model.profile(&first, ctx.seed).map_err(|e| e.to_string())?;
    let n = model.chain_len();
    let plain_peak = profile
        .predict(&Schedule::none(n).map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?
        .peak_bytes;
    let budget = (profile.min_peak_bytes() + plain_peak) / 2;
    drop(model);

    let plans = [
        ("none", CheckpointPlan::None),
        ("every 2", CheckpointPlan::EveryK(2)),
        ("every 4", CheckpointPlan::EveryK(4)),
        ("sqrt(n)", CheckpointPlan::Sqrt),
        ("budget (halfway between minimum and plain)", CheckpointPlan::Budget { bytes: budget }),
    ];
    let mut sweep = Sweep::new(
        ctx,
        "checkpointing",
        json!({ "model": format!("{arch:?}"), "batch_size": batch, "chain_layers": n, "budget_bytes": budget }),
    );
    let mut rows = Vec::new();
    let mut reference = Vec::new();
    for (name, plan) in plans {
        let schedule = plan.schedule(&profile).map_err(|e| e.to_string())?;
        let predicted = profile.predict(&schedule).map_err(|e| e.to_string())?;
        let dev = device(ctx, "")?;
        let mut model =
            Model::new(&dev, arch.clone(), ctx.seed, DType::F32).map_err(|e| e.to_string())?;
        let mut times = Vec::new();
        let mut identical = true;
        for step in 0..steps {
            let b = data.batch(ctx.seed, step as u64, batch);
            let started = Instant::now();
            let mut fctx = ForwardCtx::new(Mode::Train, ctx.seed + step as u64);
            model.train_step_with(&b, &mut fctx, 1.0, &schedule).map_err(|e| e.to_string())?;
            sync(&dev)?;
            if step > 0 {
                times.push(started.elapsed().as_secs_f64() * 1e3);
            }
            if step == 0 {
                let g = gradients(&model);
                if reference.is_empty() {
                    reference = g;
                } else {
                    identical = g
                        .iter()
                        .flatten()
                        .map(|v| v.to_bits())
                        .eq(reference.iter().flatten().map(|v| v.to_bits()));
                }
            }
            model.zero_grad();
        }
        let step_ms = median(&mut times);
        let segments = schedule.segments().iter().filter(|s| s.checkpointed).count();
        let mut v = sweep.variant(
            name,
            dev.max_memory_allocated(),
            dev.max_memory_reserved(),
            Some(step_ms),
        );
        for (k, val) in [
            ("checkpointed_segments", json!(segments)),
            ("predicted_activation_peak_bytes", json!(predicted.peak_bytes)),
            ("predicted_recompute_fraction", json!(predicted.overhead)),
            ("gradients_bit_identical_to_plain", json!(identical)),
        ] {
            v.extra.insert(k.into(), val);
        }
        sweep.push(v);
        rows.push((name, dev.max_memory_allocated(), step_ms, identical, predicted.peak_bytes));
    }
    let plain = rows[0];
    let sqrt = rows.iter().find(|r| r.0 == "sqrt(n)").copied().unwrap_or(plain);
    let best = rows.iter().min_by_key(|r| r.1).copied().unwrap_or(plain);
    let saves = sqrt.1 < plain.1 && sqrt.2 > plain.2;
    sweep.claim(Claim {
        claim: "checkpointing trades compute for memory".into(),
        measured: format!(
            "{n}-layer chain: plain {} at {:.1} ms/step; sqrt(n) {} ({:.0}% less) at {:+.0}% time; lowest {} ({}) (host timings)",
            human_bytes(plain.1), plain.2, human_bytes(sqrt.1), 100.0 * (1.0 - sqrt.1 as f64 / plain.1 as f64),
            100.0 * (sqrt.2 / plain.2 - 1.0), human_bytes(best.1), best.0
        ),
        verdict: if saves { Verdict::Holds } else if sqrt.1 < plain.1 { Verdict::Partly } else { Verdict::DoesNotHold },
    });
    let all_identical = rows.iter().all(|r| r.3);
    sweep.claim(Claim {
        claim: "gradients are bit-identical to no checkpointing (dropout masks reproduced)".into(),
        measured: format!(
            "{} of {} plans gave bit-identical gradients on the first step",
            rows.iter().filter(|r| r.3).count(),
            rows.len()
        ),
        verdict: if all_identical { Verdict::Holds } else { Verdict::DoesNotHold },
    });
    sweep.claim(Claim {
        claim: "Chen et al.: sqrt(n) memory for about one extra forward pass (~30% more time)".into(),
        measured: format!(
            "sqrt(n) plan: activation peak predicted {} vs {} plain; measured step time {:+.0}% (host timings)",
            human_bytes(sqrt.4), human_bytes(plain.4), 100.0 * (sqrt.2 / plain.2 - 1.0)
        ),
        verdict: if sqrt.4 < plain.4 && (0.1..=0.6).contains(&(sqrt.2 / plain.2 - 1.0)) { Verdict::Holds } else { Verdict::Partly },
    });
    Ok(sweep.finish())
}
