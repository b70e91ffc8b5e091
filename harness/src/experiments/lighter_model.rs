//! `lighter-model`: a full-convolution CNN against a depthwise-separable one of the same
//! depth and widths on the same input.

use super::common::{
    REAL_SIZE_CAVEAT, REAL_VIRTUAL, RealCase, cnn, cnn_side, device, note_not_executed,
    push_real_rows, real_allocs, real_case, real_model, real_params, real_part, stripes,
    timed_steps, train_interleaved,
};
use super::{Experiment, Sweep};
use crate::models::Model;
use crate::plan::{ModelOverrides, PlanKind, Precision};
use crate::plots::stacked_with_totals;
use crate::techniques::Technique;
use crate::trainer::TrainConfig;
use crate::{Backend, Claim, Context, ExperimentError, Verdict, human_bytes};
use serde::Serialize;
use serde_json::json;
use vram_kernels::DType;

pub(super) static EXPERIMENT: Experiment<Measured> = Experiment {
    technique: Technique {
        id: "lighter-model",
        name: "lighter architecture",
        claim: "e.g. ResNet50 -> MobileNetV3 to fit",
        source: "003_9fc4b5f809544d8d.txt (ResNet50 -> MobileNetV3)",
    },
    run,
    plot: Some(plot),
    host_capacity_limit: None,
    expected_secs: [0.9, 10.5],
};

/// One architecture's measurements.
#[derive(Serialize)]
pub(super) struct Measured {
    part: &'static str,
    parameters: u64,
    samples_per_s: Option<f64>,
    architecture: String,
    batch_size: usize,
    /// Real size: the fitted intercept (weights, AdamW state, the gradients made by the
    /// time of the peak, workspaces).
    fixed_bytes: Option<u64>,
    /// Real size: the fitted slope (activations per sample).
    per_sample_bytes: Option<u64>,
}

const SMALL: &str = "small (executed)";
const REAL: &str = REAL_VIRTUAL;

/// The real-size comparison: label, preset, width override (first-stage channels).
const REAL_MODELS: &[(&str, &str, Option<usize>)] = &[
    ("ResNet-50", "resnet50", None),
    ("MobileNetV3-like", "mobilenetv3-like", None),
    ("ResNet-50 x0.5 width", "resnet50", Some(32)),
];
/// The batch of the real-size comparison. The fixed and per-sample parts are each model's
/// [`crate::advice::footprint`].
const REAL_BATCH: usize = 64;

fn run(ctx: &Context) -> Result<Sweep<Measured>, ExperimentError> {
    let side = cnn_side(ctx);
    let batch = if ctx.quick { 16 } else { 32 };
    let data = stripes(side);
    let mut sweep = Sweep::new(ctx, json!({ "image_side": side, "batch_size": batch }));
    let mut runs = Vec::new();
    let mut about = Vec::new();
    for depthwise in [false, true] {
        let arch = cnn(ctx, depthwise);
        let model = Model::new(&device(ctx, "")?, arch.clone(), ctx.seed, DType::F32)?;
        about.push((model.name.clone(), model.param_count(), format!("{arch:?}")));
        runs.push((model, data.clone(), TrainConfig { batch, ..TrainConfig::default() }));
    }
    let (warmup, timed) = timed_steps(ctx);
    let mut m = Vec::new();
    for ((name, params, architecture), r) in
        about.into_iter().zip(train_interleaved(runs, ctx.seed, warmup, timed)?)
    {
        let measured = Measured {
            part: SMALL,
            parameters: params,
            samples_per_s: Some(r.samples_per_s),
            architecture,
            batch_size: batch,
            fixed_bytes: None,
            per_sample_bytes: None,
        };
        sweep.push(
            &format!("{SMALL}: {name}"),
            r.peak_allocated,
            r.peak_reserved,
            Some(r.step),
            measured,
        );
        m.push((name, params, r));
    }
    let (full, light) = (&m[0], &m[1]);
    // Real size at the largest batch, fp32 + AdamW: the virtual device's peak and, on a GPU,
    // the same step executed there (then the verdicts use the GPU's peaks); the fixed and
    // per-sample parts are the advice table's footprint.
    let b = REAL_BATCH;
    let (mut cases, mut not_run) = (Vec::new(), Vec::new());
    let mut real = Vec::new();
    for &(label, preset, width) in REAL_MODELS {
        let model = real_model(preset, &ModelOverrides { width, ..Default::default() })?;
        let params = real_params(&model)?;
        let case = real_case(ctx, &model, Precision::Fp32, PlanKind::None, (b, 1))?;
        let fp = crate::advice::footprint(&model)?;
        let (fixed, per) = (fp.fixed, fp.per_sample);
        let what = format!("{label}, batch {b}");
        not_run.extend(push_real_rows(&mut sweep, &what, &case, b, |part, per_s, _| Measured {
            part,
            parameters: params,
            samples_per_s: per_s,
            architecture: model.name.clone(),
            batch_size: b,
            fixed_bytes: Some(fixed),
            per_sample_bytes: Some(per),
        }));
        real.push((label, params, 0, fixed, per));
        cases.push(case);
    }
    note_not_executed(&mut sweep, &not_run);
    let refs: Vec<&RealCase> = cases.iter().collect();
    let part = real_part(&refs);
    for (r, alloc) in real.iter_mut().zip(real_allocs(&refs)) {
        r.2 = alloc;
    }
    let saving = 1.0 - light.2.peak_allocated as f64 / full.2.peak_allocated as f64;
    let host = if matches!(ctx.backend, Backend::Cpu) { " (host timings)" } else { "" };
    sweep.claim(Claim {
        claim: "a lighter architecture (depthwise-separable convolutions, as ResNet50 -> MobileNetV3) needs less memory".into(),
        measured: format!(
            "small (executed): {}: {} params, peak {}, step {}; {}: {} params, peak {}, step {}{host}: {:.0}% less memory, {:.1}x the parameters removed",
            full.0, full.1, human_bytes(full.2.peak_allocated), full.2.step.describe(),
            light.0, light.1, human_bytes(light.2.peak_allocated), light.2.step.describe(),
            100.0 * saving, full.1 as f64 / light.1.max(1) as f64
        ),
        verdict: if saving >= 0.2 { Verdict::Holds } else if saving > 0.0 { Verdict::Partly } else { Verdict::DoesNotHold },
    });
    let describe = |r: &(&str, u64, u64, u64, u64)| {
        format!(
            "{}: {:.1} M params, peak {} = fixed {} + {} per sample",
            r.0,
            r.1 as f64 / 1e6,
            human_bytes(r.2),
            human_bytes(r.3),
            human_bytes(r.4)
        )
    };
    let less = |r: &(&str, u64, u64, u64, u64)| 1.0 - r.2 as f64 / real[0].2 as f64;
    let (resnet, mobile, half) = (&real[0], &real[1], &real[2]);
    // ResNet-50 against a lighter model: the claim, with `prefix` and `suffix` around the
    // comparison.
    let against = |lighter: &(&str, u64, u64, u64, u64),
                   claim: &str,
                   prefix: &str,
                   suffix: &str| {
        Claim {
            claim: claim.into(),
            measured: format!(
                "{prefix}: {}; {}: {:.0}% less ({:.1}x fewer parameters, {:.1}x less per sample){suffix}",
                describe(resnet),
                describe(lighter),
                100.0 * less(lighter),
                resnet.1 as f64 / lighter.1.max(1) as f64,
                resnet.4 as f64 / lighter.4.max(1) as f64,
            ),
            verdict: if less(lighter) >= 0.2 {
                Verdict::Holds
            } else if less(lighter) > 0.0 {
                Verdict::Partly
            } else {
                Verdict::DoesNotHold
            },
        }
    };
    sweep.claim(against(
        mobile,
        "ResNet50 -> MobileNetV3 needs less memory at real size (224 px)",
        &format!("{part}, batch {b}, fp32 + AdamW"),
        &format!(
            "; {REAL_SIZE_CAVEAT}; vram's MobileNetV3-like is torchvision's MobileNetV3-Large less the classifier's dropout"
        ),
    ));
    sweep.claim(against(
        half,
        "fewer channels (ResNet-50 at half width) needs less memory",
        &format!("{part}, batch {b}"),
        "",
    ));
    let act_share = |r: &(&str, u64, u64, u64, u64)| (r.4 * b as u64) as f64 / r.2 as f64;
    sweep.reading(format!(
        "At batch {b} and 224 px most of a CNN's peak is activations ({:.0}% for ResNet-50, {:.0}% for MobileNetV3-like), so a lighter model helps by its per-sample memory ({} vs {} per sample), not by its parameter count; halving ResNet-50's channels saves {:.0}%.",
        100.0 * act_share(resnet).min(1.0),
        100.0 * act_share(mobile).min(1.0),
        human_bytes(resnet.4),
        human_bytes(mobile.4),
        100.0 * less(half),
    ));
    Ok(sweep)
}

/// Real-size peaks split into the fixed part and the per-sample part at the batch.
fn plot(sweep: &Sweep<Measured>) -> Option<String> {
    let gib = 1024.0 * 1024.0 * 1024.0;
    let bars: Vec<(String, Vec<f64>)> = sweep
        .variants()
        .iter()
        .filter(|(_, m)| m.part == REAL)
        .map(|(v, m)| {
            let fixed = m.fixed_bytes.unwrap_or(0) as f64 / gib;
            let label = v.name.trim_start_matches(REAL).trim_start_matches(": ");
            let label = label.split(", batch").next().unwrap_or(label).to_string();
            (label, vec![fixed, v.peak_allocated_bytes as f64 / gib - fixed])
        })
        .collect();
    let b = sweep.variants().iter().find(|(_, m)| m.part == REAL).map(|(_, m)| m.batch_size)?;
    stacked_with_totals(
        &format!("Real size (virtual device): peak at batch {b}, 224 px, fp32 + AdamW"),
        "peak allocated (GiB)",
        "GiB",
        &[
            "fixed (intercept of the line through batches 1-16: weights, grads, AdamW state)",
            "activations (per sample x batch)",
        ],
        &bars,
    )
}
