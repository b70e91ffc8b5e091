//! Experiments whose main measurement needs hardware this run does not have. Each says why,
//! and measures what can be measured here.

use super::Sweep;
use super::common::{cnn, cnn_side, device, median, stripes, sync};
use crate::models::Model;
use crate::{Backend, Claim, Context, ExperimentResult, Verdict};
use serde_json::json;
use vram_accum::Mode;
use vram_kernels::{DType, Device, Tensor};

/// `pinned-memory`: page-locked host buffers and copies on a side stream. On CUDA, measures
/// host-to-device copy bandwidth from pageable memory against page-locked memory uploaded on
/// the transfer stream. The overlap of copies with compute is not measured yet.
pub fn pinned_memory(ctx: &Context) -> Result<ExperimentResult, String> {
    let mut sweep = Sweep::new(ctx, "pinned-memory", json!({ "bytes": 64u64 << 20, "repeats": 5 }));
    if matches!(ctx.backend, Backend::Cpu) {
        sweep.claim(Claim {
            claim: "pinned memory gives faster transfers and fewer stalls".into(),
            measured: "not measured: the host backend has no host-to-device transfers: tensors already live in host memory".into(),
            verdict: Verdict::NotApplicable,
        });
        return Ok(sweep.finish());
    }
    let dev = device(ctx, "")?;
    let n = (64usize << 20) / 4;
    let values: Vec<f32> = (0..n).map(|i| (i % 1000) as f32).collect();
    let mut pinned = vram_kernels::PinnedBuffer::new(&dev, n * 4).map_err(|e| e.to_string())?;
    pinned.write_f32(&values, DType::F32).map_err(|e| e.to_string())?;
    let mut rates = Vec::new();
    for page_locked in [false, true] {
        let mut times = Vec::new();
        for _ in 0..5 {
            sync(&dev)?;
            let started = std::time::Instant::now();
            let t = if page_locked {
                dev.upload_async(&pinned, &[n], DType::F32)
                    .and_then(|u| u.wait())
                    .map_err(|e| e.to_string())?
            } else {
                Tensor::from_f32_slice(&dev, &[n], &values, DType::F32)
                    .map_err(|e| e.to_string())?
            };
            sync(&dev)?;
            times.push(started.elapsed().as_secs_f64());
            drop(t);
        }
        let secs = median(&mut times);
        let gib_s = (n * 4) as f64 / secs / (1u64 << 30) as f64;
        let name = if page_locked { "page-locked, transfer stream" } else { "pageable" };
        let mut v = sweep.variant(
            name,
            dev.max_memory_allocated(),
            dev.max_memory_reserved(),
            Some(secs * 1e3),
        );
        v.extra.insert("copy_gib_per_s".into(), json!(gib_s));
        sweep.push(v);
        rates.push(gib_s);
    }
    sweep.claim(Claim {
        claim: "pinned memory gives faster transfers and fewer stalls".into(),
        measured: format!(
            "64 MiB host-to-device: {:.1} GiB/s pageable, {:.1} GiB/s page-locked; overlap with compute not measured yet",
            rates[0], rates[1]
        ),
        verdict: if rates[1] > 1.2 * rates[0] { Verdict::Partly } else { Verdict::DoesNotHold },
    });
    Ok(sweep.finish())
}

/// `cpu-fallback`: inference on the CPU when the GPU cannot hold it: the same model (same
/// seed) evaluated on the CUDA device and on the host gives the same loss.
pub fn cpu_fallback(ctx: &Context) -> Result<ExperimentResult, String> {
    let mut sweep =
        Sweep::new(ctx, "cpu-fallback", json!({ "model": "ResNet-like CNN", "batch_size": 16 }));
    if matches!(ctx.backend, Backend::Cpu) {
        sweep.claim(Claim {
            claim: "falling back to the CPU keeps inference working, with the same outputs".into(),
            measured: "not measured: there is no CUDA device to fall back from; comparing outputs needs one".into(),
            verdict: Verdict::NotApplicable,
        });
        return Ok(sweep.finish());
    }
    let batch = stripes(cnn_side(ctx)).batch(ctx.seed, 0, 16);
    let mut losses = Vec::new();
    for (name, dev) in
        [("CUDA device", device(ctx, "")?), ("host fallback", Device::host(ctx.device_memory))]
    {
        let mut model =
            Model::new(&dev, cnn(ctx, false), ctx.seed, DType::F32).map_err(|e| e.to_string())?;
        let started = std::time::Instant::now();
        let loss = model.eval_loss(&batch, Mode::Inference).map_err(|e| e.to_string())?;
        let ms = started.elapsed().as_secs_f64() * 1e3;
        let mut v =
            sweep.variant(name, dev.max_memory_allocated(), dev.max_memory_reserved(), Some(ms));
        v.extra.insert("eval_loss".into(), json!(loss));
        sweep.push(v);
        losses.push(loss);
    }
    let rel = (losses[0] - losses[1]).abs() / losses[1].abs().max(f32::MIN_POSITIVE);
    sweep.claim(Claim {
        claim: "falling back to the CPU keeps inference working, with the same outputs".into(),
        measured: format!(
            "eval loss {} on CUDA, {} on the host: relative difference {rel:.2e}",
            losses[0], losses[1]
        ),
        verdict: if rel <= 1e-4 { Verdict::Holds } else { Verdict::DoesNotHold },
    });
    Ok(sweep.finish())
}
