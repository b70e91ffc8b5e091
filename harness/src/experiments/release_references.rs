//! `release-references`: a loop that keeps references to past outputs (and so their saved
//! activations, as `losses.append(loss)` keeps autograd graphs) against one that drops them,
//! with a leak detector on allocated memory per iteration.

use super::common::{cnn, cnn_side, device, fit_line, stripes};
use super::{Experiment, Sweep};
use crate::models::Model;
use crate::techniques::Technique;
use crate::{Claim, Context, ExperimentError, Verdict, human_bytes};
use serde::Serialize;
use serde_json::json;
use vram_kernels::DType;

pub(super) static EXPERIMENT: Experiment<Measured> = Experiment {
    technique: Technique {
        id: "release-references",
        name: "dropping references (del)",
        claim: "one del can save you; leaks show as steadily growing memory",
        source: "000_cc24938f7d0f0079.txt, 001_eb115694b312c654.txt (loss.item()), 003_9fc4b5f809544d8d.txt",
    },
    run,
    plot: None,
    host_capacity_limit: None,
    expected_secs: [0.6, 4.0],
};

/// One loop's allocation series.
#[derive(Serialize)]
pub(super) struct Measured {
    allocated_per_iteration: Vec<u64>,
    growth_bytes_per_iteration: f64,
    leak_flagged: bool,
}

/// Flags steady growth: the fitted slope is over 1% of the first iteration's allocation per
/// iteration and the line explains the series (r^2 > 0.9).
fn leaking(series: &[u64]) -> (bool, f64) {
    let xs: Vec<f64> = (0..series.len()).map(|i| i as f64).collect();
    let ys: Vec<f64> = series.iter().map(|&v| v as f64).collect();
    let (_, slope, r2) = fit_line(&xs, &ys);
    (slope > 0.01 * series[0] as f64 && r2 > 0.9, slope)
}

fn run(ctx: &Context) -> Result<Sweep<Measured>, ExperimentError> {
    let iterations = if ctx.quick { 8 } else { 20 };
    let (side, batch) = (cnn_side(ctx), 8);
    let arch = cnn(ctx, false);
    let data = stripes(side);
    let mut sweep = Sweep::new(
        ctx,
        json!({ "model": format!("{arch:?}"), "iterations": iterations, "batch_size": batch }),
    );
    let mut results = Vec::new();
    for keep in [true, false] {
        let dev = device(ctx, "")?;
        let mut model = Model::new(&dev, arch.clone(), ctx.seed, DType::F32)?;
        let mut history = Vec::new();
        let mut losses = Vec::new();
        let mut allocated = Vec::new();
        for i in 0..iterations {
            let (loss, graph) =
                model.forward_graph(&data.batch(ctx.seed, i as u64, batch), i as u64)?;
            losses.push(loss);
            if keep {
                history.push(graph);
            }
            allocated.push(dev.memory_allocated());
        }
        let (flagged, slope) = leaking(&allocated);
        let name = if keep {
            "keeps past outputs (losses.append(loss))"
        } else {
            "drops them (loss.item())"
        };
        let measured = Measured {
            allocated_per_iteration: allocated.clone(),
            growth_bytes_per_iteration: slope,
            leak_flagged: flagged,
        };
        let (peak, reserved) = (dev.max_memory_allocated(), dev.max_memory_reserved());
        sweep.push(name, peak, reserved, None, measured);
        results.push((allocated, flagged, slope, dev.max_memory_allocated()));
        drop(history);
    }
    let (leak, fixed) = (&results[0], &results[1]);
    sweep.claim(Claim {
        claim: "leaks show as steadily growing memory (and a detector can flag them)".into(),
        measured: format!(
            "keeping outputs: +{} per iteration, flagged {}; dropping them: +{} per iteration, flagged {}",
            human_bytes(leak.2.max(0.0) as u64), leak.1, human_bytes(fixed.2.max(0.0) as u64), fixed.1
        ),
        verdict: if leak.1 && !fixed.1 { Verdict::Holds } else { Verdict::DoesNotHold },
    });
    sweep.claim(Claim {
        claim: "one del can save you: dropping references to past outputs frees their memory".into(),
        measured: format!(
            "after {iterations} iterations: {} allocated when keeping, {} when dropping (peak {} vs {})",
            human_bytes(*leak.0.last().unwrap_or(&0)), human_bytes(*fixed.0.last().unwrap_or(&0)),
            human_bytes(leak.3), human_bytes(fixed.3)
        ),
        verdict: if fixed.3 * 2 < leak.3 { Verdict::Holds } else if fixed.3 < leak.3 { Verdict::Partly } else { Verdict::DoesNotHold },
    });
    sweep.reading(format!(
        "keeping each iteration's output with what its backward would need grew memory by {} per iteration; keeping only the number (loss.item()) grew it by {}",
        human_bytes(leak.2.max(0.0) as u64),
        human_bytes(fixed.2.max(0.0) as u64)
    ));
    Ok(sweep)
}
