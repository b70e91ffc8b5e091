//! `input-size`: peak memory against image side, with the quadratic trend fitted.

use super::common::{cnn, fit_line, increasing, stripes, train_fresh_interleaved};
use super::{Experiment, Sweep};
use crate::plots::{MIB, lines};
use crate::techniques::Technique;
use crate::{Claim, Context, ExperimentError, Verdict, human_bytes};
use serde::Serialize;
use serde_json::json;

pub(super) static EXPERIMENT: Experiment<Measured> = Experiment {
    technique: Technique {
        id: "input-size",
        name: "smaller input resolution",
        claim: "memory grows with resolution",
        source: "003_9fc4b5f809544d8d.txt",
    },
    run,
    plot: Some(plot),
    host_capacity_limit: None,
    expected_secs: [3.0, 16.0],
};

/// One input side's measurements.
#[derive(Serialize)]
pub(super) struct Measured {
    side: usize,
    samples_per_s: f64,
}

fn run(ctx: &Context) -> Result<Sweep<Measured>, ExperimentError> {
    let sides: &[usize] = if ctx.quick { &[16, 32, 64] } else { &[16, 32, 64, 96] };
    let batch = 8;
    let arch = cnn(ctx, false);
    let mut sweep = Sweep::new(
        ctx,
        json!({ "model": format!("{arch:?}"), "batch_size": batch, "sides": sides }),
    );
    let mut peaks = Vec::new();
    let runs = sides.iter().map(|&side| (arch.clone(), stripes(side), batch)).collect();
    for (&side, m) in sides.iter().zip(train_fresh_interleaved(ctx, runs)?) {
        let measured = Measured { side, samples_per_s: m.samples_per_s };
        let name = format!("{side}x{side}");
        sweep.push(&name, m.peak_allocated, m.peak_reserved, Some(m.step), measured);
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
    Ok(sweep)
}

/// Peak memory against the input side.
fn plot(sweep: &Sweep<Measured>) -> Option<String> {
    let pts = |f: fn(&crate::Variant) -> u64| -> Vec<(f64, f64)> {
        sweep.variants().iter().map(|(v, m)| (m.side as f64, f(v) as f64 / MIB)).collect()
    };
    let series = vec![
        ("peak allocated".to_string(), pts(|v| v.peak_allocated_bytes)),
        ("peak reserved".to_string(), pts(|v| v.peak_reserved_bytes)),
    ];
    lines("Peak memory vs input side", "image side (pixels)", "MiB", &series, true)
}
