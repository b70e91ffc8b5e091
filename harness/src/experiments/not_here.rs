//! Experiments whose main measurement needs hardware this run does not have. Each says why,
//! and measures what can be measured here.

use super::common::{cnn, cnn_side, device, stripes, sync};
use super::{Experiment, Sweep};
use crate::models::Model;
use crate::techniques::Technique;
use crate::timing::{Timing, interleaved};
use crate::{Backend, Claim, Context, ExperimentError, Verdict};
use serde::Serialize;
use serde_json::json;
use vram_accum::Mode;
use vram_kernels::{DType, Device, Tensor};

pub(super) static PINNED_MEMORY: Experiment<Transfer> = Experiment {
    technique: Technique {
        id: "pinned-memory",
        name: "pinned host memory",
        claim: "faster transfers, fewer stalls",
        source: "000_cc24938f7d0f0079.txt",
    },
    run: pinned_memory,
    plot: None,
    host_capacity_limit: None,
    expected_secs: [0.1, 0.1],
};

pub(super) static CPU_FALLBACK: Experiment<Evaluation> = Experiment {
    technique: Technique {
        id: "cpu-fallback",
        name: "CPU fallback for inference",
        claim: "keeps working",
        source: "002_07a140921eef9482.txt, 003_9fc4b5f809544d8d.txt",
    },
    run: cpu_fallback,
    plot: None,
    host_capacity_limit: None,
    expected_secs: [0.1, 0.1],
};

/// A host-to-device copy's rate.
#[derive(Serialize)]
pub(super) struct Transfer {
    copy_gib_per_s: f64,
}

/// An evaluation's loss.
#[derive(Serialize)]
pub(super) struct Evaluation {
    eval_loss: f32,
}

/// Copies timed per kind, interleaved.
const COPIES: usize = 5;

/// `pinned-memory`: page-locked host buffers and copies on a side stream. On CUDA, measures
/// host-to-device copy bandwidth from pageable memory against page-locked memory uploaded on
/// the transfer stream, the copies interleaved. The overlap of copies with compute is not
/// measured yet.
fn pinned_memory(ctx: &Context) -> Result<Sweep<Transfer>, ExperimentError> {
    let mut sweep = Sweep::new(ctx, json!({ "bytes": 64u64 << 20, "repeats": COPIES }));
    if matches!(ctx.backend, Backend::Cpu) {
        sweep.claim(Claim {
            claim: "pinned memory gives faster transfers and fewer stalls".into(),
            measured: "not measured: the host backend has no host-to-device transfers: tensors already live in host memory".into(),
            verdict: Verdict::NotApplicable,
        });
        sweep.reading("needs a GPU: `cargo xtask bench --backend cuda --only pinned-memory` times 64 MiB host-to-device copies from pageable and page-locked memory");
        return Ok(sweep);
    }
    let dev = device(ctx, "")?;
    let n = (64usize << 20) / 4;
    let values: Vec<f32> = (0..n).map(|i| (i % 1000) as f32).collect();
    let mut pinned = vram_kernels::PinnedBuffer::new(&dev, n * 4)?;
    pinned.write_f32(&values, DType::F32)?;
    let mut kinds = [false, true];
    let samples = interleaved(&mut kinds, 1, COPIES, |page_locked| {
        sync(&dev)?;
        let started = std::time::Instant::now();
        let t = if *page_locked {
            dev.upload_async(&pinned, &[n], DType::F32).and_then(|u| u.wait())?
        } else {
            Tensor::from_f32_slice(&dev, &[n], &values, DType::F32)?
        };
        sync(&dev)?;
        drop(t);
        Ok::<_, ExperimentError>(started.elapsed().as_secs_f64() * 1e3)
    })?;
    let mut timings = Vec::new();
    for (page_locked, times) in kinds.iter().zip(&samples) {
        let step = Timing::from_samples(times)
            .ok_or_else(|| ExperimentError::Setup("pinned-memory needs timed copies".into()))?;
        let gib_s = (n * 4) as f64 / (step.mean_ms / 1e3) / (1u64 << 30) as f64;
        let name = if *page_locked { "page-locked, transfer stream" } else { "pageable" };
        let (peak, reserved) = (dev.max_memory_allocated(), dev.max_memory_reserved());
        sweep.push(name, peak, reserved, Some(step), Transfer { copy_gib_per_s: gib_s });
        timings.push((step, gib_s));
    }
    let ((pageable, slow_rate), (locked, fast_rate)) = (timings[0], timings[1]);
    sweep.claim(Claim {
        claim: "pinned memory gives faster transfers and fewer stalls".into(),
        measured: format!(
            "64 MiB host-to-device: {slow_rate:.1} GiB/s pageable ({}), {fast_rate:.1} GiB/s page-locked ({}); overlap with compute not measured yet",
            pageable.describe(),
            locked.describe()
        ),
        verdict: if pageable.clearly_above(&locked) && fast_rate > 1.2 * slow_rate {
            Verdict::Partly
        } else {
            Verdict::DoesNotHold
        },
    });
    sweep.reading(format!(
        "page-locked memory copied at {fast_rate:.1} GiB/s against {slow_rate:.1} GiB/s pageable; whether it also hides copies behind compute is not measured yet"
    ));
    Ok(sweep)
}

/// Timed evaluations per device, interleaved.
const EVALUATIONS: usize = 3;

/// `cpu-fallback`: inference on the CPU when the GPU cannot hold it: the same model (same
/// seed) evaluated on the CUDA device and on the host gives the same loss.
fn cpu_fallback(ctx: &Context) -> Result<Sweep<Evaluation>, ExperimentError> {
    let mut sweep = Sweep::new(ctx, json!({ "model": "ResNet-like CNN", "batch_size": 16 }));
    if matches!(ctx.backend, Backend::Cpu) {
        sweep.claim(Claim {
            claim: "falling back to the CPU keeps inference working, with the same outputs".into(),
            measured: "not measured: there is no CUDA device to fall back from; comparing outputs needs one".into(),
            verdict: Verdict::NotApplicable,
        });
        sweep.reading("needs a GPU: with one, the same model (same seed) is evaluated on the GPU and on the host and their losses compared");
        return Ok(sweep);
    }
    let batch = stripes(cnn_side(ctx)).batch(ctx.seed, 0, 16);
    let mut states = Vec::new();
    for dev in [device(ctx, "")?, Device::host(ctx.device_memory)] {
        let model = Model::new(&dev, cnn(ctx, false), ctx.seed, DType::F32)?;
        states.push((dev, model, f32::NAN));
    }
    let samples = interleaved(&mut states, 0, EVALUATIONS, |(dev, model, loss)| {
        let started = std::time::Instant::now();
        *loss = model.eval_loss(&batch, Mode::Inference)?;
        sync(dev)?;
        Ok::<_, ExperimentError>(started.elapsed().as_secs_f64() * 1e3)
    })?;
    let mut losses = Vec::new();
    for ((name, (dev, _, loss)), times) in
        ["CUDA device", "host fallback"].iter().zip(&states).zip(&samples)
    {
        let (peak, reserved) = (dev.max_memory_allocated(), dev.max_memory_reserved());
        let step = Timing::from_samples(times);
        sweep.push(name, peak, reserved, step, Evaluation { eval_loss: *loss });
        losses.push(*loss);
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
    sweep.reading(format!(
        "the host gave the GPU's evaluation loss to a relative {rel:.1e}; it keeps inference working, at the host's speed (see the step times)"
    ));
    Ok(sweep)
}
