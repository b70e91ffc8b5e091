//! `input-size`: peak memory against image side, with the quadratic trend fitted.

use super::Sweep;
use super::common::{cnn, fit_line, increasing, stripes, train_fresh};
use crate::{Claim, Context, ExperimentResult, Verdict, human_bytes};
use serde_json::json;

pub fn run(ctx: &Context) -> Result<ExperimentResult, String> {
    let sides: &[usize] = if ctx.quick { &[16, 32, 64] } else { &[16, 32, 64, 96] };
    let batch = 8;
    let arch = cnn(ctx, false);
    let mut sweep = Sweep::new(
        ctx,
        "input-size",
        json!({ "model": format!("{arch:?}"), "batch_size": batch, "sides": sides }),
    );
    let mut peaks = Vec::new();
    for &side in sides {
        let m = train_fresh(ctx, arch.clone(), &stripes(side), batch, "")?;
        let mut v = sweep.variant(
            &format!("{side}x{side}"),
            m.peak_allocated,
            m.peak_reserved,
            Some(m.step_ms),
        );
        v.extra.insert("side".into(), json!(side));
        v.extra.insert("samples_per_s".into(), json!(m.samples_per_s));
        sweep.push(v);
        peaks.push(m.peak_allocated);
    }
    let xs: Vec<f64> = sides.iter().map(|&s| (s * s) as f64).collect();
    let ys: Vec<f64> = peaks.iter().map(|&p| p as f64).collect();
    let (fixed, per_pixel, r2) = fit_line(&xs, &ys);
    let grows = increasing(&peaks);
    sweep.claim(Claim {
        claim: "memory grows with input resolution (quadratically in the side)".into(),
        measured: format!(
            "peak {} for sides {:?}; fit peak = {} + {} x side^2, r^2 {r2:.4}",
            peaks.iter().map(|&p| human_bytes(p)).collect::<Vec<_>>().join(", "),
            sides,
            human_bytes(fixed.max(0.0) as u64),
            human_bytes(per_pixel.max(0.0) as u64),
        ),
        verdict: if grows && r2 > 0.98 {
            Verdict::Holds
        } else if grows {
            Verdict::Partly
        } else {
            Verdict::DoesNotHold
        },
    });
    Ok(sweep.finish())
}
