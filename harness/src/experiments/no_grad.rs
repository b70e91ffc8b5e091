//! `no-grad-inference`: evaluation with and without recording what backward needs.

use super::Sweep;
use super::common::{cnn, cnn_side, device, stripes, sync};
use crate::models::Model;
use crate::{Claim, Context, ExperimentResult, Verdict, human_bytes};
use serde_json::json;
use vram_accum::Mode;
use vram_kernels::DType;

pub fn run(ctx: &Context) -> Result<ExperimentResult, String> {
    let batches: &[usize] = if ctx.quick { &[8, 16, 32] } else { &[16, 32, 64] };
    let side = cnn_side(ctx);
    let arch = cnn(ctx, false);
    let data = stripes(side);
    let mut sweep = Sweep::new(
        ctx,
        "no-grad-inference",
        json!({ "model": format!("{arch:?}"), "image_side": side, "batch_sizes": batches }),
    );
    let mut ratios = Vec::new();
    for &b in batches {
        let mut peaks = [0u64; 2];
        for (i, (mode, label)) in
            [(Mode::Train, "saving activations"), (Mode::Inference, "inference mode")]
                .into_iter()
                .enumerate()
        {
            let dev = device(ctx, "")?;
            let mut model =
                Model::new(&dev, arch.clone(), ctx.seed, DType::F32).map_err(|e| e.to_string())?;
            let batch = data.batch(ctx.seed, 0, b);
            model.eval_loss(&batch, mode).map_err(|e| e.to_string())?;
            dev.reset_peak_stats();
            let started = std::time::Instant::now();
            model.eval_loss(&batch, mode).map_err(|e| e.to_string())?;
            sync(&dev)?;
            let ms = started.elapsed().as_secs_f64() * 1e3;
            let mut v = sweep.variant(
                &format!("batch {b}, {label}"),
                dev.max_memory_allocated(),
                dev.max_memory_reserved(),
                Some(ms),
            );
            v.extra.insert("batch_size".into(), json!(b));
            v.extra.insert("weights_bytes".into(), json!(model.param_bytes()));
            sweep.push(v);
            peaks[i] = dev.max_memory_allocated() - model.param_bytes();
        }
        ratios.push((b, peaks[0], peaks[1]));
    }
    let all_less = ratios.iter().all(|&(_, train, inf)| inf < train);
    sweep.claim(Claim {
        claim: "evaluating without saving activations (no_grad) saves memory".into(),
        measured: ratios
            .iter()
            .map(|&(b, t, i)| {
                format!(
                    "batch {b}: {} -> {} above the weights ({:.1}x less)",
                    human_bytes(t),
                    human_bytes(i),
                    t as f64 / i.max(1) as f64
                )
            })
            .collect::<Vec<_>>()
            .join("; "),
        verdict: if all_less { Verdict::Holds } else { Verdict::DoesNotHold },
    });
    Ok(sweep.finish())
}
