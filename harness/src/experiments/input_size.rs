//! `input-size`: peak memory against image side, with the quadratic trend fitted.

use super::common::{
    EXECUTED, REAL_SIZE_CAVEAT, REAL_VIRTUAL, RealCase, bytes_list, cnn, fit_line, increasing,
    note_not_executed, push_real_rows, real_allocs, real_case, real_model, real_part, stripes,
    train_fresh_interleaved,
};
use super::{Experiment, Sweep};
use crate::plan::{ModelOverrides, PlanKind, Precision};
use crate::plots::{FittedSeries, measured_and_fit};
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
    expected_secs: [1.6, 16.6],
};

/// One input side's measurements.
#[derive(Serialize)]
pub(super) struct Measured {
    part: &'static str,
    model: String,
    batch_size: usize,
    side: usize,
    samples_per_s: Option<f64>,
}

const SMALL: &str = "small (executed)";
const REAL: &str = REAL_VIRTUAL;

/// ResNet-50's sides and batch at real size.
const REAL_SIDES: &[usize] = &[112, 160, 224, 320];
const REAL_BATCH: usize = 32;

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
        let measured = Measured {
            part: SMALL,
            model: format!("{arch:?}"),
            batch_size: batch,
            side,
            samples_per_s: Some(m.samples_per_s),
        };
        let name = format!("{SMALL}: {side}x{side}");
        sweep.push(&name, m.peak_allocated, m.peak_reserved, Some(m.step), measured);
        peaks.push(m.peak_allocated);
    }
    let xs: Vec<f64> = sides.iter().map(|&s| (s * s) as f64).collect();
    let ys: Vec<f64> = peaks.iter().map(|&p| p as f64).collect();
    let (fixed, per_pixel, r2) = fit_line(&xs, &ys);
    let grows = increasing(&peaks);
    let (mut cases, mut not_run) = (Vec::new(), Vec::new());
    for &side in REAL_SIDES {
        let model =
            real_model("resnet50", &ModelOverrides { side: Some(side), ..Default::default() })?;
        let case = real_case(ctx, &model, Precision::Fp32, PlanKind::None, (REAL_BATCH, 1))?;
        let what = format!("resnet50, batch {REAL_BATCH}, {side}x{side}");
        not_run.extend(push_real_rows(&mut sweep, &what, &case, REAL_BATCH, |part, per_s, _| {
            Measured {
                part,
                model: "resnet50".into(),
                batch_size: REAL_BATCH,
                side,
                samples_per_s: per_s,
            }
        }));
        cases.push(case);
    }
    note_not_executed(&mut sweep, &not_run);
    let refs: Vec<&RealCase> = cases.iter().collect();
    let (real, part) = (real_allocs(&refs), real_part(&refs));
    let rx: Vec<f64> = REAL_SIDES.iter().map(|&s| (s * s) as f64).collect();
    let ry: Vec<f64> = real.iter().map(|&p| p as f64).collect();
    let (rfixed, rper, rr2) = fit_line(&rx, &ry);
    let real_grows = increasing(&real);
    sweep.claim(Claim {
        claim: "memory grows with input resolution (quadratically in the side)".into(),
        measured: format!(
            "{SMALL}: peak {} for sides {:?}; fit peak = {} + {} x side^2, r^2 {r2:.4}. {part}, ResNet-50 batch {REAL_BATCH}, fp32 + AdamW: peak {} for sides {:?}; fit {} + {} x side^2, r^2 {rr2:.4} ({REAL_SIZE_CAVEAT})",
            peaks.iter().map(|&p| human_bytes(p)).collect::<Vec<_>>().join(", "),
            sides,
            human_bytes(fixed.max(0.0) as u64),
            human_bytes(per_pixel.max(0.0) as u64),
            bytes_list(&real),
            REAL_SIDES,
            human_bytes(rfixed.max(0.0) as u64),
            human_bytes(rper.max(0.0) as u64),
        ),
        verdict: if grows && r2 > 0.98 && real_grows && rr2 > 0.98 {
            Verdict::Holds
        } else if grows {
            Verdict::Partly
        } else {
            Verdict::DoesNotHold
        },
    });
    let at = |side: usize| REAL_SIDES.iter().position(|&s| s == side).map(|i| real[i]);
    if let (Some(p224), Some(p160), Some(p112)) = (at(224), at(160), at(112)) {
        sweep.reading(format!(
            "Activation memory scales with the pixel count ({part}): ResNet-50 at batch {REAL_BATCH} needs {} at 224 px, {} at 160 px ({:.0}% less) and {} at 112 px ({:.0}% less); each extra pixel per side costs about {} at this batch (2 x side x the per-side^2 slope {}).",
            human_bytes(p224),
            human_bytes(p160),
            100.0 * (1.0 - p160 as f64 / p224 as f64),
            human_bytes(p112),
            100.0 * (1.0 - p112 as f64 / p224 as f64),
            human_bytes((2.0 * 224.0 * rper).max(0.0) as u64),
            human_bytes(rper.max(0.0) as u64),
        ));
    }
    Ok(sweep)
}

/// Real-size peak memory against the input side, measured points with the side^2 fit (the
/// small run's fit is in the claim).
fn plot(sweep: &Sweep<Measured>) -> Option<String> {
    const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
    let series: Vec<FittedSeries> = [(REAL, GIB, "GiB"), (EXECUTED, GIB, "GiB")]
        .iter()
        .filter_map(|&(part, unit, label)| {
            let pts: Vec<(f64, f64)> = sweep
                .variants()
                .iter()
                .filter(|(_, m)| m.part == part)
                .map(|(v, m)| (m.side as f64, v.peak_allocated_bytes as f64 / unit))
                .collect();
            let (_, m) = sweep.variants().iter().find(|(_, m)| m.part == part)?;
            let xs: Vec<f64> = pts.iter().map(|p| p.0 * p.0).collect();
            let ys: Vec<f64> = pts.iter().map(|p| p.1).collect();
            let (a, b, r2) = fit_line(&xs, &ys);
            let top = pts.iter().map(|p| p.0).fold(0.0, f64::max);
            let curve =
                (0..=40).map(|i| top * i as f64 / 40.0).map(|x| (x, a + b * x * x)).collect();
            let model = m.model.split(" {").next().unwrap_or(&m.model).to_string();
            Some((
                format!("{part}: {model}, batch {} ({label})", m.batch_size),
                pts,
                format!("fit {a:.2} + {b:.2e} x side^2 (r^2 {r2:.3})"),
                curve,
            ))
        })
        .collect();
    let top = series.iter().flat_map(|s| s.1.iter().map(|p| p.1)).fold(0.0, f64::max);
    measured_and_fit(
        "Real size: peak vs input side, side^2 fit (fp32 + AdamW)",
        "image side (pixels)",
        "peak allocated (GiB)",
        &series,
        &crate::plots::cards_near(top),
    )
}
