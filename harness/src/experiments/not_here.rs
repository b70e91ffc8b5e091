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
use vram_kernels::{DType, Device, Tensor, ops};

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

/// A host-to-device copy's rate, or the stall it adds to a compute burst.
#[derive(Serialize)]
pub(super) struct Transfer {
    /// The copy alone: GiB/s.
    copy_gib_per_s: Option<f64>,
    /// Copy and compute launched together: how much longer the pair took than the compute
    /// burst alone, in ms (`both - compute`, at least 0): the time the training loop stalls
    /// on the copy.
    stall_ms: Option<f64>,
}

/// An evaluation's loss.
#[derive(Serialize)]
pub(super) struct Evaluation {
    eval_loss: f32,
}

/// Copies timed per kind, interleaved.
const COPIES: usize = 5;

/// The side of the square f32 matmuls of the compute burst.
const BURST_SIDE: usize = 2048;

/// What one timed round does.
#[derive(Clone, Copy, PartialEq)]
enum Work {
    /// The 64 MiB copy alone (page-locked or not).
    Copy(bool),
    /// The compute burst alone.
    Compute,
    /// The copy launched, then the burst, then both awaited.
    Both(bool),
}

/// `pinned-memory`: page-locked host buffers and copies on a side stream. On CUDA, times
/// 64 MiB host-to-device copies from pageable memory and from page-locked memory on the
/// transfer stream, a compute burst (square f32 matmuls sized to last about as long as the
/// page-locked copy) alone, and each copy launched together with the burst: how much of
/// the copy the compute hides. Every kind of round is interleaved with the others.
fn pinned_memory(ctx: &Context) -> Result<Sweep<Transfer>, ExperimentError> {
    let mut sweep = Sweep::new(ctx, json!({ "bytes": 64u64 << 20, "repeats": COPIES }));
    if matches!(ctx.backend, Backend::Cpu) {
        sweep.claim(Claim {
            claim: "pinned memory gives faster transfers and fewer stalls".into(),
            measured: "not measured: the host backend has no host-to-device transfers: tensors already live in host memory".into(),
            verdict: Verdict::NotApplicable,
        });
        sweep.reading("needs a GPU: `cargo xtask bench --backend cuda --only pinned-memory` times 64 MiB host-to-device copies from pageable and page-locked memory, and each alongside compute");
        return Ok(sweep);
    }
    let dev = device(ctx, "")?;
    let n = (64usize << 20) / 4;
    let values: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 - 500.0).collect();
    let mut pinned = vram_kernels::PinnedBuffer::new(&dev, n * 4)?;
    pinned.write_f32(&values, DType::F32)?;
    let square: Vec<f32> =
        (0..BURST_SIDE * BURST_SIDE).map(|i| ((i % 97) as f32 - 48.0) / 64.0).collect();
    let a = Tensor::from_f32_slice(&dev, &[BURST_SIDE, BURST_SIDE], &square, DType::F32)?;
    let timed = |f: &mut dyn FnMut() -> Result<(), ExperimentError>| {
        sync(&dev)?;
        let started = std::time::Instant::now();
        f()?;
        sync(&dev)?;
        Ok::<_, ExperimentError>(started.elapsed().as_secs_f64() * 1e3)
    };
    let copy = |page_locked: bool| -> Result<Tensor, ExperimentError> {
        Ok(if page_locked {
            dev.upload_async(&pinned, &[n], DType::F32).and_then(|u| u.wait())?
        } else {
            Tensor::from_f32_slice(&dev, &[n], &values, DType::F32)?
        })
    };
    // The burst's length: as many matmuls as one page-locked copy takes (at least one).
    let mut one_copy = f64::INFINITY;
    let mut one_mm = f64::INFINITY;
    for _ in 0..3 {
        one_copy = one_copy.min(timed(&mut || copy(true).map(drop))?);
        one_mm = one_mm
            .min(timed(&mut || ops::matmul(&a, &a, false, false).map(drop).map_err(Into::into))?);
    }
    let burst = ((one_copy / one_mm.max(1e-6)).round() as usize).clamp(1, 10_000);
    let compute = || -> Result<(), ExperimentError> {
        for _ in 0..burst {
            drop(ops::matmul(&a, &a, false, false)?);
        }
        Ok(())
    };
    let mut kinds =
        [Work::Copy(false), Work::Copy(true), Work::Compute, Work::Both(false), Work::Both(true)];
    let samples = interleaved(&mut kinds, 1, COPIES, |work| {
        let work = *work;
        timed(&mut || match work {
            Work::Copy(locked) => copy(locked).map(drop),
            Work::Compute => compute(),
            Work::Both(true) => {
                // The copy goes first on the transfer stream; the burst queues behind it on
                // the compute stream; `wait` joins them.
                let upload = dev.upload_async(&pinned, &[n], DType::F32)?;
                compute()?;
                drop(upload.wait()?);
                Ok(())
            }
            Work::Both(false) => {
                // The burst is queued first; a pageable copy cannot start before the host
                // has staged it, and it runs on the compute stream.
                compute()?;
                copy(false).map(drop)
            }
        })
    })?;
    let mut mean = Vec::new();
    for times in &samples {
        mean.push(
            Timing::from_samples(times)
                .ok_or_else(|| ExperimentError::Setup("pinned-memory needs timed rounds".into()))?,
        );
    }
    let bytes = (n * 4) as f64;
    let rate = |t: &Timing| bytes / (t.mean_ms / 1e3) / (1u64 << 30) as f64;
    // The stall: what the copy adds to the compute it runs beside.
    let stall = |both: &Timing| (both.mean_ms - mean[2].mean_ms).max(0.0);
    let (slow_rate, fast_rate) = (rate(&mean[0]), rate(&mean[1]));
    let (stall_pageable, stall_locked) = (stall(&mean[3]), stall(&mean[4]));
    let (peak, reserved) = (dev.max_memory_allocated(), dev.max_memory_reserved());
    let rows = [
        ("pageable copy", Some(slow_rate), None),
        ("page-locked copy, transfer stream", Some(fast_rate), None),
        ("compute burst alone", None, None),
        ("pageable copy + compute", None, Some(stall_pageable)),
        ("page-locked copy + compute", None, Some(stall_locked)),
    ];
    for ((name, copy_gib_per_s, stall_ms), t) in rows.into_iter().zip(&mean) {
        sweep.push(name, peak, reserved, Some(*t), Transfer { copy_gib_per_s, stall_ms });
    }
    let faster = mean[0].clearly_above(&mean[1]) && fast_rate > 1.2 * slow_rate;
    // Fewer stalls: the page-locked pair is measurably shorter than the pageable one, and
    // its stall at most half the pageable stall.
    let fewer_stalls = mean[3].clearly_above(&mean[4]) && stall_locked <= 0.5 * stall_pageable;
    sweep.claim(Claim {
        claim: "pinned memory gives faster transfers and fewer stalls".into(),
        measured: format!(
            "64 MiB host-to-device: {slow_rate:.1} GiB/s pageable ({}), {fast_rate:.1} GiB/s page-locked ({}); beside a compute burst of {burst} matmuls {BURST_SIDE}^3 f32 ({}), the copy stalls it by {stall_locked:.2} ms page-locked ({}) against {stall_pageable:.2} ms pageable ({})",
            mean[0].describe(),
            mean[1].describe(),
            mean[2].describe(),
            mean[4].describe(),
            mean[3].describe(),
        ),
        verdict: match (faster, fewer_stalls) {
            (true, true) => Verdict::Holds,
            (false, false) => Verdict::DoesNotHold,
            _ => Verdict::Partly,
        },
    });
    sweep.reading(format!(
        "page-locked memory copied at {fast_rate:.1} GiB/s against {slow_rate:.1} GiB/s pageable, and stalled the compute beside it by {stall_locked:.2} ms against {stall_pageable:.2} ms: copy the next batch from pinned memory on a side stream while this one computes"
    ));
    Ok(sweep)
}

/// Timed evaluations per device, interleaved, after one untimed warm-up each (a CUDA
/// device compiles its kernels on first use).
const EVALUATIONS: usize = 5;

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
    let samples = interleaved(&mut states, 1, EVALUATIONS, |(dev, model, loss)| {
        let started = std::time::Instant::now();
        *loss = model.eval_loss(&batch, Mode::Inference)?;
        sync(dev)?;
        Ok::<_, ExperimentError>(started.elapsed().as_secs_f64() * 1e3)
    })?;
    let (mut losses, mut steps) = (Vec::new(), Vec::new());
    for ((name, (dev, _, loss)), times) in
        ["CUDA device", "host fallback"].iter().zip(&states).zip(&samples)
    {
        let (peak, reserved) = (dev.max_memory_allocated(), dev.max_memory_reserved());
        let step = Timing::from_samples(times);
        sweep.push(name, peak, reserved, step, Evaluation { eval_loss: *loss });
        losses.push(*loss);
        steps.extend(step);
    }
    let rel = (losses[0] - losses[1]).abs() / losses[1].abs().max(f32::MIN_POSITIVE);
    sweep.claim(Claim {
        claim: "falling back to the CPU keeps inference working, with the same outputs".into(),
        measured: format!(
            "eval loss {} on CUDA, {} on the host: relative difference {rel:.2e} (TECHNIQUES.md's test: vram's CUDA kernels and its host reference compute the same math, so this agreement checks vram more than the technique; what falling back costs is the speed in the reading)",
            losses[0], losses[1]
        ),
        verdict: if rel <= 1e-4 { Verdict::Holds } else { Verdict::DoesNotHold },
    });
    let speed = match steps.as_slice() {
        [gpu, host] if host.clearly_above(gpu) => format!(
            "{:.1}x slower than the GPU ({} against {})",
            host.mean_ms / gpu.mean_ms,
            host.describe(),
            gpu.describe()
        ),
        [gpu, host] if gpu.clearly_above(host) => format!(
            "faster than the GPU at this small size ({} against {}: the GPU's launches dominate)",
            host.describe(),
            gpu.describe()
        ),
        [gpu, host] => format!(
            "at no speed the samples can tell from the GPU's ({} against {})",
            host.describe(),
            gpu.describe()
        ),
        _ => "with no timed evaluations".into(),
    };
    sweep.reading(format!(
        "the host gave the GPU's evaluation loss to a relative {rel:.1e}: it keeps inference working, {speed}"
    ));
    Ok(sweep)
}
