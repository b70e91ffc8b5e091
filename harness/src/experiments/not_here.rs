//! Experiments whose main measurement needs hardware this run does not have. Each says why,
//! and measures what can be measured here.

use super::Sweep;
use super::common::{cnn, cnn_side, stripes, train_fresh};
use crate::{Backend, Claim, Context, ExperimentResult, Verdict};
use serde_json::json;

fn single_device_baseline(ctx: &Context, sweep: &mut Sweep, name: &str) -> Result<(), String> {
    let m = train_fresh(ctx, cnn(ctx, false), &stripes(cnn_side(ctx)), 16, "")?;
    let mut v = sweep.variant(name, m.peak_allocated, m.peak_reserved, Some(m.step_ms));
    v.extra.insert("samples_per_s".into(), json!(m.samples_per_s));
    sweep.push(v);
    Ok(())
}

/// `pinned-memory`: page-locked host buffers and copies overlapped on a side stream.
pub fn pinned_memory(ctx: &Context) -> Result<ExperimentResult, String> {
    let mut sweep = Sweep::new(ctx, "pinned-memory", json!({}));
    let reason = match &ctx.backend {
        Backend::Cpu => {
            "the host backend has no host-to-device transfers: tensors already live in host memory"
        }
        Backend::Cuda { .. } => {
            "pinned buffers and side-stream copies are not implemented in vram-kernels yet"
        }
    };
    sweep.claim(Claim {
        claim: "pinned memory gives faster transfers and fewer stalls".into(),
        measured: format!("not measured: {reason}"),
        verdict: Verdict::NotApplicable,
    });
    Ok(sweep.finish())
}

/// `data-parallel`: several GPUs with NCCL all-reduce.
pub fn data_parallel(ctx: &Context) -> Result<ExperimentResult, String> {
    let mut sweep = Sweep::new(ctx, "data-parallel", json!({ "devices": 1 }));
    single_device_baseline(ctx, &mut sweep, "1 device (baseline)")?;
    sweep.claim(Claim {
        claim: "data parallel training over several GPUs spreads memory and work".into(),
        measured: "not measured: needs more than one GPU; only the single-device baseline ran"
            .into(),
        verdict: Verdict::NotApplicable,
    });
    Ok(sweep.finish())
}

/// `cpu-fallback`: inference on the CPU when the GPU cannot hold it.
pub fn cpu_fallback(ctx: &Context) -> Result<ExperimentResult, String> {
    let mut sweep = Sweep::new(ctx, "cpu-fallback", json!({}));
    sweep.claim(Claim {
        claim: "falling back to the CPU keeps inference working, with the same outputs".into(),
        measured: "not measured: comparing host and device outputs needs a CUDA device and vram-kernels' CUDA kernels".into(),
        verdict: Verdict::NotApplicable,
    });
    Ok(sweep.finish())
}
