//! `lighter-model`: a full-convolution CNN against a depthwise-separable one of the same
//! depth and widths on the same input.

use super::Sweep;
use super::common::{cnn, cnn_side, device, stripes, timed_steps, train};
use crate::models::Model;
use crate::trainer::TrainConfig;
use crate::{Claim, Context, ExperimentResult, Verdict, human_bytes};
use serde_json::json;
use vram_kernels::DType;

pub fn run(ctx: &Context) -> Result<ExperimentResult, String> {
    let side = cnn_side(ctx);
    let batch = if ctx.quick { 16 } else { 32 };
    let data = stripes(side);
    let mut sweep =
        Sweep::new(ctx, "lighter-model", json!({ "image_side": side, "batch_size": batch }));
    let mut m = Vec::new();
    for depthwise in [false, true] {
        let arch = cnn(ctx, depthwise);
        let dev = device(ctx, "")?;
        let model =
            Model::new(&dev, arch.clone(), ctx.seed, DType::F32).map_err(|e| e.to_string())?;
        let (name, params) = (model.name.clone(), model.param_count());
        let (warmup, timed) = timed_steps(ctx);
        let r = train(
            model,
            &data,
            ctx.seed,
            TrainConfig { batch, ..TrainConfig::default() },
            warmup,
            timed,
        )?;
        let mut v = sweep.variant(&name, r.peak_allocated, r.peak_reserved, Some(r.step_ms));
        v.extra.insert("parameters".into(), json!(params));
        v.extra.insert("samples_per_s".into(), json!(r.samples_per_s));
        v.extra.insert("architecture".into(), json!(format!("{arch:?}")));
        sweep.push(v);
        m.push((name.clone(), params, r));
    }
    let (full, light) = (&m[0], &m[1]);
    let saving = 1.0 - light.2.peak_allocated as f64 / full.2.peak_allocated as f64;
    sweep.claim(Claim {
        claim: "a lighter architecture (depthwise-separable convolutions, as ResNet50 -> MobileNetV3) needs less memory".into(),
        measured: format!(
            "{}: {} params, peak {}, {:.1} ms/step; {}: {} params, peak {}, {:.1} ms/step: {:.0}% less memory, {:.1}x the parameters removed",
            full.0, full.1, human_bytes(full.2.peak_allocated), full.2.step_ms,
            light.0, light.1, human_bytes(light.2.peak_allocated), light.2.step_ms,
            100.0 * saving, full.1 as f64 / light.1.max(1) as f64
        ),
        verdict: if saving >= 0.2 { Verdict::Holds } else if saving > 0.0 { Verdict::Partly } else { Verdict::DoesNotHold },
    });
    Ok(sweep.finish())
}
