//! `release-references`: a loop that keeps references to past outputs (and so their saved
//! activations, as `losses.append(loss)` keeps autograd graphs) against one that drops them,
//! with a leak detector on allocated memory per iteration.

use super::Sweep;
use super::common::{cnn, cnn_side, device, fit_line, stripes};
use crate::models::Model;
use crate::{Claim, Context, ExperimentResult, Verdict, human_bytes};
use serde_json::json;
use vram_kernels::DType;

/// Flags steady growth: the fitted slope is over 1% of the first iteration's allocation per
/// iteration and the line explains the series (r^2 > 0.9).
fn leaking(series: &[u64]) -> (bool, f64) {
    let xs: Vec<f64> = (0..series.len()).map(|i| i as f64).collect();
    let ys: Vec<f64> = series.iter().map(|&v| v as f64).collect();
    let (_, slope, r2) = fit_line(&xs, &ys);
    (slope > 0.01 * series[0] as f64 && r2 > 0.9, slope)
}

pub fn run(ctx: &Context) -> Result<ExperimentResult, String> {
    let iterations = if ctx.quick { 8 } else { 20 };
    let (side, batch) = (cnn_side(ctx), 8);
    let arch = cnn(ctx, false);
    let data = stripes(side);
    let mut sweep = Sweep::new(
        ctx,
        "release-references",
        json!({ "model": format!("{arch:?}"), "iterations": iterations, "batch_size": batch }),
    );
    let mut results = Vec::new();
    for keep in [true, false] {
        let dev = device(ctx, "")?;
        let mut model =
            Model::new(&dev, arch.clone(), ctx.seed, DType::F32).map_err(|e| e.to_string())?;
        let mut history = Vec::new();
        let mut losses = Vec::new();
        let mut allocated = Vec::new();
        for i in 0..iterations {
            let (loss, graph) = model
                .forward_graph(&data.batch(ctx.seed, i as u64, batch), i as u64)
                .map_err(|e| e.to_string())?;
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
        let mut v =
            sweep.variant(name, dev.max_memory_allocated(), dev.max_memory_reserved(), None);
        v.extra.insert("allocated_per_iteration".into(), json!(allocated));
        v.extra.insert("growth_bytes_per_iteration".into(), json!(slope));
        v.extra.insert("leak_flagged".into(), json!(flagged));
        sweep.push(v);
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
    Ok(sweep.finish())
}
