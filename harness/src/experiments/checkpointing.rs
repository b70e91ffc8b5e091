//! `checkpointing`: activation checkpointing plans on a GPT (none, every k, sqrt(n), and the
//! fastest plan within a memory budget): peak memory against extra time, the executor's
//! predicted peak next to the measured one, and gradients compared bit for bit with the plain
//! run.

use super::common::{
    REAL_SIZE_CAVEAT, device, fit_power, gradients, real_model, real_params, real_peak, sync,
};
use super::{Experiment, Sweep};
use crate::data::Dataset;
use crate::models::{Arch, Model};
use crate::plan::{ModelOverrides, PlanKind, Precision};
use crate::plots::{MIB, scatter};
use crate::techniques::Technique;
use crate::timing::{Timing, interleaved};
use crate::{Backend, Claim, Context, ExperimentError, Verdict, human_bytes};
use serde::Serialize;
use serde_json::json;
use std::time::Instant;
use vram_accum::{CheckpointPlan, ForwardCtx, Mode, Schedule};
use vram_kernels::{DType, Device};

pub(super) static EXPERIMENT: Experiment<Measured> = Experiment {
    technique: Technique {
        id: "checkpointing",
        name: "activation checkpointing",
        claim: "needed for large models; trades compute for memory",
        source: "004_4a0e2eb70881fd56.txt, 002_07a140921eef9482.txt",
    },
    run,
    plot: Some(plot),
    host_capacity_limit: None,
    expected_secs: [2.6, 18.0],
};

/// One plan's measurements.
#[derive(Serialize)]
pub(super) struct Measured {
    checkpointed_segments: usize,
    predicted_activation_peak_bytes: u64,
    predicted_recompute_fraction: f64,
    gradients_bit_identical_to_plain: bool,
}

/// One plan while it runs.
struct Plan {
    schedule: Schedule,
    dev: Device,
    model: Model,
    step: usize,
    first_gradients: Vec<Vec<f32>>,
}

fn run(ctx: &Context) -> Result<Sweep<Measured>, ExperimentError> {
    let (d, layers, seq, batch, steps) =
        if ctx.quick { (64, 8, 32, 8, 6) } else { (96, 12, 64, 8, 12) };
    let arch = Arch::Gpt { vocab: 64, d, layers, heads: 1, seq, dropout: 0.1, tied: false };
    let data = Dataset::Sequences { vocab: 64, seq };
    let first = data.batch(ctx.seed, 0, batch);

    // Profile the chain once to predict every plan.
    let dev = device(ctx, "")?;
    let mut model = Model::new(&dev, arch.clone(), ctx.seed, DType::F32)?;
    let profile = model.profile(&first, ctx.seed)?;
    let n = model.chain_len();
    let plain_peak = profile.predict(&Schedule::none(n)?)?.peak_bytes;
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
        json!({ "model": format!("{arch:?}"), "batch_size": batch, "chain_layers": n, "budget_bytes": budget, "steps": steps }),
    );
    let mut states = Vec::new();
    let mut predictions = Vec::new();
    for (_, plan) in &plans {
        let schedule = plan.schedule(&profile)?;
        predictions.push(profile.predict(&schedule)?);
        let dev = device(ctx, "")?;
        let model = Model::new(&dev, arch.clone(), ctx.seed, DType::F32)?;
        states.push(Plan { schedule, dev, model, step: 0, first_gradients: Vec::new() });
    }
    // Every plan trains the same batches; their steps interleave, the first is a warm-up.
    let samples = interleaved(&mut states, 1, steps - 1, |p| {
        let b = data.batch(ctx.seed, p.step as u64, batch);
        let started = Instant::now();
        let mut fctx = ForwardCtx::new(Mode::Train, ctx.seed + p.step as u64);
        p.model.train_step_with(&b, &mut fctx, 1.0, &p.schedule)?;
        sync(&p.dev)?;
        let ms = started.elapsed().as_secs_f64() * 1e3;
        if p.step == 0 {
            p.first_gradients = gradients(&p.model);
        }
        p.model.zero_grad();
        p.step += 1;
        Ok::<_, ExperimentError>(ms)
    })?;
    let bits = |g: &[Vec<f32>]| g.iter().flatten().map(|v| v.to_bits()).collect::<Vec<_>>();
    let reference = bits(&states[0].first_gradients);
    let mut rows = Vec::new();
    for (((name, _), p), (times, predicted)) in
        plans.iter().zip(&states).zip(samples.iter().zip(&predictions))
    {
        let step = Timing::from_samples(times)
            .ok_or_else(|| ExperimentError::Setup("checkpointing needs 2 steps or more".into()))?;
        let identical = bits(&p.first_gradients) == reference;
        let measured = Measured {
            checkpointed_segments: p.schedule.segments().iter().filter(|s| s.checkpointed).count(),
            predicted_activation_peak_bytes: predicted.peak_bytes,
            predicted_recompute_fraction: predicted.overhead,
            gradients_bit_identical_to_plain: identical,
        };
        let (peak, reserved) = (p.dev.max_memory_allocated(), p.dev.max_memory_reserved());
        sweep.push(name, peak, reserved, Some(step), measured);
        rows.push((*name, peak, step, identical, predicted.peak_bytes));
    }
    let plain = rows[0];
    let sqrt = rows.iter().find(|r| r.0 == "sqrt(n)").copied().unwrap_or(plain);
    let best = rows.iter().min_by_key(|r| r.1).copied().unwrap_or(plain);
    let less = |r: (&str, u64, Timing, bool, u64)| 100.0 * (1.0 - r.1 as f64 / plain.1 as f64);
    sweep.claim(Claim {
        claim: "checkpointing lowers peak memory".into(),
        measured: format!(
            "{n}-layer chain: plain {}; sqrt(n) {} ({:.0}% less); lowest {} ({}, {:.0}% less)",
            human_bytes(plain.1),
            human_bytes(sqrt.1),
            less(sqrt),
            human_bytes(best.1),
            best.0,
            less(best)
        ),
        verdict: if sqrt.1 < plain.1 { Verdict::Holds } else { Verdict::DoesNotHold },
    });
    let overhead = 100.0 * (sqrt.2.mean_ms / plain.2.mean_ms - 1.0);
    let times = format!(
        "step time plain {}, sqrt(n) {} ({overhead:+.0}%)",
        plain.2.describe(),
        sqrt.2.describe()
    );
    let host = matches!(ctx.backend, Backend::Cpu);
    let na = |m: String| {
        (
            format!(
                "{m}: host timings, not applicable on the host: the claim is about GPU step time"
            ),
            Verdict::NotApplicable,
        )
    };
    let (measured, verdict) = if host {
        na(times.clone())
    } else {
        let v = if sqrt.2.clearly_above(&plain.2) { Verdict::Holds } else { Verdict::DoesNotHold };
        (times.clone(), v)
    };
    sweep.claim(Claim {
        claim: "checkpointing costs compute: steps take longer".into(),
        measured,
        verdict,
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
    let chen = format!(
        "sqrt(n) plan: activation peak predicted {} vs {} plain; {times}",
        human_bytes(sqrt.4),
        human_bytes(plain.4)
    );
    let (measured, verdict) = if host {
        na(chen)
    } else {
        // The interval of the overhead must lie within 10-60%.
        let lo = 100.0
            * ((sqrt.2.mean_ms - sqrt.2.half_width()) / (plain.2.mean_ms + plain.2.half_width())
                - 1.0);
        let hi = 100.0
            * ((sqrt.2.mean_ms + sqrt.2.half_width()) / (plain.2.mean_ms - plain.2.half_width())
                - 1.0);
        let v = if sqrt.4 < plain.4 && lo >= 10.0 && hi <= 60.0 {
            Verdict::Holds
        } else if sqrt.4 < plain.4 {
            Verdict::Partly
        } else {
            Verdict::DoesNotHold
        };
        (chen, v)
    };
    sweep.claim(Claim {
        claim: "Chen et al.: sqrt(n) memory for about one extra forward pass (~30% more time)"
            .into(),
        measured,
        verdict,
    });
    // Depth sweep at real width (GPT-2 small, 1024 tokens, batch 1, AdamW) on the virtual
    // device: the activation part (peak minus the 16 B/param of weights, grads and AdamW
    // state) of each plan against the number of blocks.
    let depths: &[usize] = &[4, 8, 16, 32];
    let kinds = [PlanKind::None, PlanKind::EveryK(1), PlanKind::Sqrt];
    let mut acts: Vec<Vec<f64>> = vec![Vec::new(); kinds.len()];
    for &n in depths {
        let model =
            real_model("gpt2-small", &ModelOverrides { depth: Some(n), ..Default::default() })?;
        let states = 16 * real_params(&model)?;
        for (k, kind) in kinds.iter().enumerate() {
            let (alloc, _) = real_peak(&model, Precision::Fp32, *kind, 1, 1)?;
            acts[k].push(alloc.saturating_sub(states) as f64);
        }
    }
    let xs: Vec<f64> = depths.iter().map(|&n| n as f64).collect();
    let fits: Vec<(f64, f64, f64)> = acts.iter().map(|a| fit_power(&xs, a)).collect();
    let list = |a: &[f64]| a.iter().map(|&b| human_bytes(b as u64)).collect::<Vec<_>>().join(", ");
    let e_sqrt = fits[2].1;
    sweep.claim(Claim {
        claim: "Chen et al.: with sqrt(n) segments the activation memory grows as sqrt(n) (exponent ~0.5), without checkpointing as n".into(),
        measured: format!(
            "real size (virtual): GPT-2 small width, 1024 tokens, batch 1, fp32 + AdamW, blocks {depths:?}; peak above 16 B/param of states: none {} (exponent {:.2}), every layer {} (exponent {:.2}), sqrt(n) {} (exponent {:.2}, r^2 {:.3}); {REAL_SIZE_CAVEAT}",
            list(&acts[0]), fits[0].1, list(&acts[1]), fits[1].1, list(&acts[2]), e_sqrt, fits[2].2
        ),
        verdict: if (0.35..=0.65).contains(&e_sqrt) && fits[0].1 > e_sqrt {
            Verdict::Holds
        } else if e_sqrt < fits[0].1 {
            Verdict::Partly
        } else {
            Verdict::DoesNotHold
        },
    });
    sweep.reading(format!(
        "Checkpointing trades recompute for activations: at GPT-2 small width and 32 blocks the activation part falls from {} to {} with sqrt(n) segments, and it grows as n^{e_sqrt:.2} instead of n^{:.2}; the gradients stay bit-identical.",
        human_bytes(acts[0][acts[0].len() - 1] as u64),
        human_bytes(acts[2][acts[2].len() - 1] as u64),
        fits[0].1
    ));
    Ok(sweep)
}

/// Peak memory against the time overhead of each plan.
fn plot(sweep: &Sweep<Measured>) -> Option<String> {
    let base = sweep.variants().first()?.0.step_ms?;
    let pts: Vec<(String, f64, f64)> = sweep
        .variants()
        .iter()
        .filter_map(|(v, _)| {
            Some((
                v.name.clone(),
                100.0 * (v.step_ms? / base - 1.0),
                v.peak_allocated_bytes as f64 / MIB,
            ))
        })
        .collect();
    scatter(
        "Checkpointing: peak memory vs time overhead",
        "time overhead vs no checkpointing (%)",
        "peak allocated (MiB)",
        &pts,
    )
}
