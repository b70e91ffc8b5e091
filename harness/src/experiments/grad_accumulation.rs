//! `grad-accumulation`: k micro-batches of B/k with the loss divided by k and one optimizer
//! step, for k = 1, 2, 4, 8 at the same effective batch; gradients compared with the full
//! batch.

use super::common::{
    EXECUTED, REAL_SIZE_CAVEAT, REAL_VIRTUAL, RealCase, bytes_list, cnn, cnn_side, device,
    gradients, max_relative_difference, note_not_executed, push_real_rows, real_allocs, real_case,
    real_model, real_part, real_tag, stripes,
};
use super::{Experiment, Sweep};
use crate::models::Model;
use crate::plan::{ModelOverrides, PlanKind, Precision};
use crate::plots::{Mark, lines_with_marks};
use crate::techniques::Technique;
use crate::timing::{Timing, interleaved};
use crate::trainer::{Hooks, TrainConfig, Trainer};
use crate::{Backend, Claim, Context, ExperimentError, Verdict, human_bytes};
use serde::Serialize;
use serde_json::json;
use vram_kernels::{DType, Device};

pub(super) static EXPERIMENT: Experiment<Measured> = Experiment {
    technique: Technique {
        id: "grad-accumulation",
        name: "gradient accumulation",
        claim: "same effective batch, lower memory",
        source: "000_cc24938f7d0f0079.txt, 002_07a140921eef9482.txt, 003_9fc4b5f809544d8d.txt",
    },
    run,
    plot: Some(plot),
    host_capacity_limit: None,
    expected_secs: [4.5, 56.5],
};

/// One micro-batch count's measurements.
#[derive(Serialize)]
pub(super) struct Measured {
    part: &'static str,
    model: String,
    k: usize,
    micro_batch: usize,
    samples_per_s: Option<f64>,
    grad_max_relative_difference_vs_full_batch: Option<f64>,
}

const SMALL: &str = "small (executed)";
const REAL: &str = REAL_VIRTUAL;

/// The real-size models and their effective batches.
const REAL_RUNS: &[(&str, usize)] = &[("resnet50", 32), ("gpt2-small", 8)];

/// Keeps the accumulated gradients of the first step.
struct FirstGradients(Vec<Vec<f32>>);

impl Hooks for FirstGradients {
    fn on_backward_end(&mut self, step: usize, model: &Model) {
        if step == 0 {
            self.0 = gradients(model);
        }
    }
}

fn run(ctx: &Context) -> Result<Sweep<Measured>, ExperimentError> {
    let batch = if ctx.quick { 32 } else { 64 };
    let steps = if ctx.quick { 6 } else { 12 };
    let (side, arch) = (cnn_side(ctx), cnn(ctx, false));
    let data = stripes(side);
    let mut sweep = Sweep::new(
        ctx,
        json!({ "model": format!("{arch:?}"), "effective_batch": batch, "normalization": "mean", "steps": steps }),
    );
    let ks = [1usize, 2, 4, 8];
    let mut states: Vec<(Trainer, FirstGradients, Device)> = Vec::new();
    for k in ks {
        let dev = device(ctx, "")?;
        let model = Model::new(&dev, arch.clone(), ctx.seed, DType::F32)?;
        let cfg = TrainConfig { batch, accumulation: k, ..TrainConfig::default() };
        states.push((
            Trainer::new(model, data.clone(), ctx.seed, cfg)?,
            FirstGradients(Vec::new()),
            dev,
        ));
    }
    let samples = interleaved(&mut states, 1, steps - 1, |(trainer, first, _)| {
        Ok::<_, ExperimentError>(trainer.step(first)?.step_ms)
    })?;
    let reference = states[0].1.0.clone();
    let mut rows = Vec::new();
    for ((k, (_, first, dev)), times) in ks.iter().zip(&states).zip(&samples) {
        let difference = if *k == 1 { 0.0 } else { max_relative_difference(&reference, &first.0) };
        let step = Timing::from_samples(times).ok_or_else(|| {
            ExperimentError::Setup("grad-accumulation needs 2 steps or more".into())
        })?;
        let measured = Measured {
            part: SMALL,
            model: format!("{arch:?}"),
            k: *k,
            micro_batch: batch / k,
            samples_per_s: Some(batch as f64 / (step.mean_ms / 1e3)),
            grad_max_relative_difference_vs_full_batch: Some(difference),
        };
        let name = format!("{SMALL}: k = {k} (micro-batch {})", batch / k);
        let (peak, reserved) = (dev.max_memory_allocated(), dev.max_memory_reserved());
        sweep.push(&name, peak, reserved, Some(step), measured);
        rows.push((*k, peak, step, difference));
    }
    let peaks: Vec<u64> = rows.iter().map(|r| r.1).collect();
    let falls = peaks.windows(2).all(|w| w[1] < w[0]);
    // Real size: the same k at each model's effective batch, fp32 + AdamW, on the virtual
    // device and, on a GPU, executed there (then the figures are the GPU's and the step
    // times real-size ones).
    let mut real = Vec::new();
    let mut not_run = Vec::new();
    for &(name, eff) in REAL_RUNS {
        let model = real_model(name, &ModelOverrides::default())?;
        let tag = real_tag(&model, "fp32");
        let mut cases = Vec::new();
        for k in ks {
            let case = real_case(ctx, &model, Precision::Fp32, PlanKind::None, (eff / k, k))?;
            let what = format!("{tag}, batch {eff}, k = {k} (micro-batch {})", eff / k);
            not_run.extend(push_real_rows(&mut sweep, &what, &case, eff, |part, per_s, _| {
                Measured {
                    part,
                    model: tag.clone(),
                    k,
                    micro_batch: eff / k,
                    samples_per_s: per_s,
                    grad_max_relative_difference_vs_full_batch: None,
                }
            }));
            cases.push(case);
        }
        let refs: Vec<&RealCase> = cases.iter().collect();
        let steps: Vec<Option<Timing>> = cases.iter().map(|c| c.executed.step()).collect();
        real.push((tag, eff, real_allocs(&refs), real_part(&refs), steps));
    }
    note_not_executed(&mut sweep, &not_run);
    let real_falls = real.iter().all(|r| r.2.windows(2).all(|w| w[1] < w[0]));
    let real_text = real
        .iter()
        .map(|(name, eff, pk, part, steps)| {
            let times = if steps.iter().all(Option::is_some) {
                format!(
                    "; step {} at k = 1, {} at k = 8 (real size on the GPU)",
                    steps[0].map_or_else(String::new, |t| t.describe()),
                    steps[steps.len() - 1].map_or_else(String::new, |t| t.describe())
                )
            } else {
                String::new()
            };
            format!(
                "{part}: {name} at batch {eff}: {} ({:.0}% less at k = 8){times}",
                bytes_list(pk),
                100.0 * (1.0 - pk[pk.len() - 1] as f64 / pk[0] as f64)
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    let (first, last) = (rows[0], rows[rows.len() - 1]);
    let host = if matches!(ctx.backend, Backend::Cpu) { " (host timings)" } else { "" };
    sweep.claim(Claim {
        claim: "same effective batch, lower memory".into(),
        measured: format!(
            "{SMALL}: peak {} for k = 1, 2, 4, 8; k = 8 uses {:.0}% less than k = 1; step {} for k = 1, {} for k = 8{host}. Real size for k = 1, 2, 4, 8, fp32 + AdamW: {real_text} ({REAL_SIZE_CAVEAT})",
            peaks.iter().map(|&p| human_bytes(p)).collect::<Vec<_>>().join(", "),
            100.0 * (1.0 - last.1 as f64 / first.1 as f64),
            first.2.describe(),
            last.2.describe(),
        ),
        verdict: if falls && real_falls {
            Verdict::Holds
        } else if falls || real_falls {
            Verdict::Partly
        } else {
            Verdict::DoesNotHold
        },
    });
    let worst = rows.iter().map(|r| r.3).fold(0.0, f64::max);
    // Equal up to f32 rounding: summing the batch's n per-sample terms in another order
    // moves the result by at most about (n - 1) u times the sum of their sizes (Higham's
    // bound for recursive summation, u = 2^-24); with terms up to a few times the sum's
    // largest entry, 4 n eps relative to it. A real difference (a missing 1/k, batch
    // statistics per micro-batch) is orders of magnitude above.
    let tolerance = 4.0 * batch as f64 * f64::from(f32::EPSILON);
    sweep.claim(Claim {
        claim: "accumulated gradients equal the full-batch gradients".into(),
        measured: format!(
            "largest difference over k = 2, 4, 8, relative to the largest gradient entry: {worst:.2e} (f32), against f32's rounding bound for {batch} terms summed in another order, 4 n eps = {tolerance:.1e}"
        ),
        verdict: if worst <= tolerance {
            Verdict::Holds
        } else if worst <= 100.0 * tolerance {
            Verdict::Partly
        } else {
            Verdict::DoesNotHold
        },
    });
    if let [(rn, re, rp, ..), (gn, ge, gp, ..), ..] = real.as_slice() {
        let floor = |pk: &[u64]| pk[pk.len() - 1];
        sweep.reading(format!(
            "Accumulating 8 micro-batches keeps the effective batch and cuts the peak from {} to {} ({rn}, batch {re}) and from {} to {} ({gn}, batch {ge}); what stays is the fixed part (weights, gradients, AdamW state), so the saving shrinks as k grows; the gradients of the small executed models match the full batch to {worst:.0e} (relative, f32). They have no batch norm: with it ({rn} has), each micro-batch is normalized with its own statistics, so accumulated gradients are not the full batch's, in PyTorch as here.",
            human_bytes(rp[0]),
            human_bytes(floor(rp)),
            human_bytes(gp[0]),
            human_bytes(floor(gp)),
        ));
    }
    Ok(sweep)
}

/// Real-size peak against the number of micro-batches, one line per model.
fn plot(sweep: &Sweep<Measured>) -> Option<String> {
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    // The GPU's rows where every real-size case ran there, else the virtual device's.
    let count = |part: &str| sweep.variants().iter().filter(|(_, m)| m.part == part).count();
    let (part, source) = if count(EXECUTED) > 0 && count(EXECUTED) == count(REAL) {
        (EXECUTED, "executed on the GPU")
    } else {
        (REAL, "virtual device")
    };
    for (v, m) in sweep.variants().iter().filter(|(_, m)| m.part == part) {
        let name = format!("{}, batch {} ({source})", m.model, m.k * m.micro_batch);
        let y = v.peak_allocated_bytes as f64 / (1024.0 * 1024.0 * 1024.0);
        match series.iter_mut().find(|s| s.0 == name) {
            Some(s) => s.1.push((m.k as f64, y)),
            None => series.push((name, vec![(m.k as f64, y)])),
        }
    }
    let top = series.iter().flat_map(|s| s.1.iter().map(|p| p.1)).fold(0.0, f64::max);
    let cards: Vec<Mark> =
        crate::plots::cards_near(top).into_iter().map(|(n, g)| Mark::Capacity(n, g)).collect();
    lines_with_marks(
        "Real size: peak vs micro-batches k at a fixed effective batch",
        "k (micro-batches per optimizer step)",
        "peak allocated (GiB)",
        &series,
        true,
        &cards,
    )
}
