//! `multi-task`: train model A, then evaluate model B in the same process, with and without
//! emptying the cache between. The device is sized so that A's cached memory plus B's need
//! exceed it: B must get memory A's cache holds.

use super::common::{cnn, cnn_side, device, sized_device, stripes, timed_steps, train};
use super::{Experiment, Sweep};
use crate::models::Model;
use crate::techniques::Technique;
use crate::trainer::TrainConfig;
use crate::{Claim, Context, ExperimentError, Verdict, human_bytes};
use serde::Serialize;
use serde_json::json;
use vram_accum::Mode;
use vram_kernels::{DType, Device};

pub(super) static EXPERIMENT: Experiment<Measured> = Experiment {
    technique: Technique {
        id: "multi-task",
        name: "two models in one process",
        claim: "emptying the cache between tasks lets B get the memory",
        source: "004_4a0e2eb70881fd56.txt",
    },
    run,
    plot: None,
    host_capacity_limit: None,
    expected_secs: [3.0, 17.0],
};

/// One run of A then B.
#[derive(Serialize)]
pub(super) struct Measured {
    reserved_after_a: u64,
    b_fitted: bool,
    alloc_retries_during_b: u64,
    device_capacity: u64,
}

/// The outcome of one A-then-B run.
pub struct Switch {
    /// Reserved bytes after A finished and was dropped.
    pub reserved_after_a: u64,
    /// Peak allocated while B ran.
    pub peak_allocated_b: u64,
    /// Peak reserved while B ran.
    pub peak_reserved_b: u64,
    /// Whether B's evaluation succeeded.
    pub b_fitted: bool,
    /// Times the allocator had to release its cache and retry during B.
    pub retries_during_b: u64,
    /// The device capacity used.
    pub capacity: u64,
}

/// Runs A (training) then B (evaluation at 4x the batch) on a device just too small to hold
/// A's cache and B together; `empty` calls `empty_cache` between the two.
pub fn two_model_scenario(ctx: &Context, empty: bool) -> Result<Switch, ExperimentError> {
    let side = cnn_side(ctx);
    let data = stripes(side);
    let (batch_a, batch_b) = (16, 64);
    let (warmup, timed) = timed_steps(ctx);
    let run_a = |dev: &Device| -> Result<(), ExperimentError> {
        let a = Model::new(dev, cnn(ctx, false), ctx.seed, DType::F32)?;
        let cfg = TrainConfig { batch: batch_a, ..TrainConfig::default() };
        train(a, &data, ctx.seed, cfg, warmup, timed).map(|_| ())
    };
    let run_b = |dev: &Device| -> Result<f32, ExperimentError> {
        let mut b = Model::new(dev, cnn(ctx, true), ctx.seed + 1, DType::F32)?;
        Ok(b.eval_loss(&data.batch(ctx.seed, 1 << 30, batch_b), Mode::Inference)?)
    };
    // Calibrate on a roomy device: A's cache and B's peak.
    let roomy = device(ctx, "")?;
    run_a(&roomy)?;
    let cached_a = roomy.memory_reserved();
    let roomy_b = device(ctx, "")?;
    run_b(&roomy_b)?;
    let need_b = roomy_b.max_memory_reserved();
    let capacity = (cached_a.max(need_b) + need_b.min(cached_a) / 2).next_multiple_of(2 << 20);

    let dev = sized_device(ctx, capacity)?;
    run_a(&dev)?;
    let reserved_after_a = dev.memory_reserved();
    if empty {
        dev.empty_cache();
    }
    dev.reset_peak_stats();
    let retries_before = dev.memory_stats().num_alloc_retries;
    let b_fitted = match run_b(&dev) {
        Ok(_) => true,
        Err(e) if e.is_out_of_memory() => false,
        Err(e) => return Err(e),
    };
    Ok(Switch {
        reserved_after_a,
        peak_allocated_b: dev.max_memory_allocated(),
        peak_reserved_b: dev.max_memory_reserved(),
        b_fitted,
        retries_during_b: dev.memory_stats().num_alloc_retries - retries_before,
        capacity,
    })
}

/// The claim about emptying the cache between tasks, from the two runs.
pub fn claim(kept: &Switch, emptied: &Switch) -> Claim {
    let verdict = match (kept.b_fitted, emptied.b_fitted) {
        (false, true) => Verdict::Holds,
        (true, true) => Verdict::Partly,
        _ => Verdict::DoesNotHold,
    };
    let why = match (kept.b_fitted && emptied.b_fitted, kept.retries_during_b) {
        (false, _) => String::new(),
        (true, 0) => {
            "; B fits without it too: its tensors reuse the blocks A left in the cache".into()
        }
        (true, n) => format!(
            "; B fits without it too: the allocator released A's cache itself and retried ({n} retries)"
        ),
    };
    Claim {
        claim: "emptying the cache between two tasks lets the second one get the memory".into(),
        measured: format!(
            "device {}: A leaves {} reserved; B {} with the cache kept, {} after empty_cache{why}",
            human_bytes(kept.capacity),
            human_bytes(kept.reserved_after_a),
            if kept.b_fitted { "fits" } else { "runs out of memory" },
            if emptied.b_fitted { "fits" } else { "runs out of memory" },
        ),
        verdict,
    }
}

fn run(ctx: &Context) -> Result<Sweep<Measured>, ExperimentError> {
    let mut sweep = Sweep::new(
        ctx,
        json!({ "task_a": "train ResNet-like, batch 16", "task_b": "evaluate MobileNet-like, batch 64" }),
    );
    let kept = two_model_scenario(ctx, false)?;
    let emptied = two_model_scenario(ctx, true)?;
    for (name, s) in [("cache kept between tasks", &kept), ("empty_cache between tasks", &emptied)]
    {
        let measured = Measured {
            reserved_after_a: s.reserved_after_a,
            b_fitted: s.b_fitted,
            alloc_retries_during_b: s.retries_during_b,
            device_capacity: s.capacity,
        };
        sweep.push(name, s.peak_allocated_b, s.peak_reserved_b, None, measured);
    }
    sweep.claim(claim(&kept, &emptied));
    Ok(sweep)
}
