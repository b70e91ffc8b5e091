//! `lighter-model`: a full-convolution CNN against a depthwise-separable one of the same
//! depth and widths on the same input.

use super::common::{cnn, cnn_side, device, stripes, timed_steps, train_interleaved};
use super::{Experiment, Sweep};
use crate::models::Model;
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
    plot: None,
    host_capacity_limit: None,
    expected_secs: [1.5, 10.0],
};

/// One architecture's measurements.
#[derive(Serialize)]
pub(super) struct Measured {
    parameters: u64,
    samples_per_s: f64,
    architecture: String,
}

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
        let measured =
            Measured { parameters: params, samples_per_s: r.samples_per_s, architecture };
        sweep.push(&name, r.peak_allocated, r.peak_reserved, Some(r.step), measured);
        m.push((name, params, r));
    }
    let (full, light) = (&m[0], &m[1]);
    let saving = 1.0 - light.2.peak_allocated as f64 / full.2.peak_allocated as f64;
    let host = if matches!(ctx.backend, Backend::Cpu) { " (host timings)" } else { "" };
    sweep.claim(Claim {
        claim: "a lighter architecture (depthwise-separable convolutions, as ResNet50 -> MobileNetV3) needs less memory".into(),
        measured: format!(
            "{}: {} params, peak {}, step {}; {}: {} params, peak {}, step {}{host}: {:.0}% less memory, {:.1}x the parameters removed",
            full.0, full.1, human_bytes(full.2.peak_allocated), full.2.step.describe(),
            light.0, light.1, human_bytes(light.2.peak_allocated), light.2.step.describe(),
            100.0 * saving, full.1 as f64 / light.1.max(1) as f64
        ),
        verdict: if saving >= 0.2 { Verdict::Holds } else if saving > 0.0 { Verdict::Partly } else { Verdict::DoesNotHold },
    });
    Ok(sweep)
}
