//! `multi-task`: train model A, then evaluate model B in the same process, with and without
//! emptying the cache between. The device is sized so that A's cached memory plus B's need
//! exceed it: B must get memory A's cache holds. Then the same two tasks as two processes on
//! one device: two caching allocators over one shared virtual capacity ([`SharedMemory`]),
//! each replaying its task's recorded allocation trace; the first keeps its cache (or
//! empties it) while the second runs.

use super::common::{
    SharedMemory, cnn, cnn_side, device, replay_trace, sized_device, stripes, timed_steps, train,
};
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
    expected_secs: [2.1, 12.7],
};

/// One run of A then B.
#[derive(Serialize)]
pub(super) struct Measured {
    /// Whether A and B are two processes (two allocators sharing the device).
    two_processes: bool,
    reserved_after_a: u64,
    /// Free device memory when B started.
    device_free_when_b_starts: u64,
    b_fitted: bool,
    /// In one process: times the allocator released its own cache and retried during B.
    alloc_retries_during_b: u64,
    device_capacity: u64,
}

/// What the roomy calibration runs give: A's cache, B's need, the device size, and both
/// tasks' allocation traces.
struct Calibration {
    cached_a: u64,
    need_b: u64,
    capacity: u64,
    trace_a: Vec<vram_alloc::TraceEntry>,
    trace_b: Vec<vram_alloc::TraceEntry>,
}

/// Two processes on one device of the calibrated capacity: the first replays A's trace and
/// keeps its allocator (its cache) alive, emptied if `empty`; the second replays B's.
fn two_processes(cal: &Calibration, empty: bool) -> Result<Switch, ExperimentError> {
    let mem = SharedMemory::new(cal.capacity);
    let first = vram_alloc::CachingAllocator::new(mem.clone());
    if !replay_trace(&first, &cal.trace_a)? {
        return Err(ExperimentError::Setup("task A alone ran out of memory in replay".into()));
    }
    let reserved_after_a = first.memory_reserved();
    if empty {
        first.empty_cache();
    }
    let free = vram_alloc::DeviceMemory::mem_info(&mem).free;
    let second = vram_alloc::CachingAllocator::new(mem.clone());
    let b_fitted = replay_trace(&second, &cal.trace_b)?;
    let stats = second.memory_stats();
    drop(first);
    Ok(Switch {
        reserved_after_a,
        free_when_b_starts: free,
        peak_allocated_b: second.max_memory_allocated(),
        peak_reserved_b: second.max_memory_reserved(),
        b_fitted,
        retries_during_b: stats.num_alloc_retries,
        capacity: cal.capacity,
    })
}

/// The outcome of one A-then-B run.
pub struct Switch {
    /// Reserved bytes after A finished and was dropped.
    pub reserved_after_a: u64,
    /// Free device memory when B started.
    pub free_when_b_starts: u64,
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

type Task<'a> = Box<dyn Fn(&Device) -> Result<(), ExperimentError> + 'a>;

/// Task A (train the ResNet-like CNN at batch 16) and task B (evaluate the MobileNet-like
/// one at batch 64).
fn tasks(ctx: &Context) -> (Task<'_>, Task<'_>) {
    let data = stripes(cnn_side(ctx));
    let (batch_a, batch_b) = (16, 64);
    let (warmup, timed) = timed_steps(ctx);
    let data_a = data.clone();
    let run_a = move |dev: &Device| -> Result<(), ExperimentError> {
        let a = Model::new(dev, cnn(ctx, false), ctx.seed, DType::F32)?;
        let cfg = TrainConfig { batch: batch_a, ..TrainConfig::default() };
        train(a, &data_a, ctx.seed, cfg, warmup, timed).map(|_| ())
    };
    let run_b = move |dev: &Device| -> Result<(), ExperimentError> {
        let mut b = Model::new(dev, cnn(ctx, true), ctx.seed + 1, DType::F32)?;
        b.eval_loss(&data.batch(ctx.seed, 1 << 30, batch_b), Mode::Inference)?;
        Ok(())
    };
    (Box::new(run_a), Box::new(run_b))
}

/// Calibrates on roomy devices: A's cache and B's peak, and the device size between.
fn calibrate(ctx: &Context) -> Result<Calibration, ExperimentError> {
    let (run_a, run_b) = tasks(ctx);
    let roomy = device(ctx, "")?;
    roomy.record_history(Some(1 << 24));
    run_a(&roomy)?;
    let cached_a = roomy.memory_reserved();
    let roomy_b = device(ctx, "")?;
    roomy_b.record_history(Some(1 << 24));
    run_b(&roomy_b)?;
    let need_b = roomy_b.max_memory_reserved();
    let capacity = (cached_a.max(need_b) + need_b.min(cached_a) / 2).next_multiple_of(2 << 20);
    Ok(Calibration { cached_a, need_b, capacity, trace_a: roomy.trace(), trace_b: roomy_b.trace() })
}

/// Runs A (training) then B (evaluation at 4x the batch) in one process on a device just too
/// small to hold A's cache and B together; `empty` calls `empty_cache` between the two.
fn in_process(ctx: &Context, cal: &Calibration, empty: bool) -> Result<Switch, ExperimentError> {
    let (run_a, run_b) = tasks(ctx);
    let capacity = cal.capacity;

    let dev = sized_device(ctx, capacity)?;
    run_a(&dev)?;
    let reserved_after_a = dev.memory_reserved();
    if empty {
        dev.empty_cache();
    }
    let free_when_b_starts = capacity.saturating_sub(dev.memory_reserved());
    dev.reset_peak_stats();
    let retries_before = dev.memory_stats().num_alloc_retries;
    let b_fitted = match run_b(&dev) {
        Ok(_) => true,
        Err(e) if e.is_out_of_memory() => false,
        Err(e) => return Err(e),
    };
    Ok(Switch {
        reserved_after_a,
        free_when_b_starts,
        peak_allocated_b: dev.max_memory_allocated(),
        peak_reserved_b: dev.max_memory_reserved(),
        b_fitted,
        retries_during_b: dev.memory_stats().num_alloc_retries - retries_before,
        capacity,
    })
}

/// The claim about emptying the cache between tasks, from the two runs.
fn claim(kept: &Switch, emptied: &Switch) -> Claim {
    // Emptying the cache matters only where B fails without it and fits with it; where B
    // fits either way, empty_cache changed nothing for B.
    let verdict = match (kept.b_fitted, emptied.b_fitted) {
        (false, true) => Verdict::Holds,
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
        claim:
            "emptying the cache between two tasks in one process lets the second one get the memory"
                .into(),
        measured: format!(
            "small (executed), one process: device {}: A leaves {} reserved; B {} with the cache kept, {} after empty_cache{why}",
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
        json!({ "task_a": "train ResNet-like, batch 16", "task_b": "evaluate MobileNet-like, batch 64", "two_processes": "two caching allocators over one shared virtual capacity, each replaying its task's recorded allocation trace" }),
    );
    let cal = calibrate(ctx)?;
    let kept = in_process(ctx, &cal, false)?;
    let emptied = in_process(ctx, &cal, true)?;
    let p_kept = two_processes(&cal, false)?;
    let p_emptied = two_processes(&cal, true)?;
    for (name, two, s) in [
        ("small (executed), one process: cache kept between tasks", false, &kept),
        ("small (executed), one process: empty_cache between tasks", false, &emptied),
        (
            "simulated (replayed allocation traces), two processes: A's process keeps its cache",
            true,
            &p_kept,
        ),
        (
            "simulated (replayed allocation traces), two processes: A's process calls empty_cache",
            true,
            &p_emptied,
        ),
    ] {
        let measured = Measured {
            two_processes: two,
            reserved_after_a: s.reserved_after_a,
            device_free_when_b_starts: s.free_when_b_starts,
            b_fitted: s.b_fitted,
            alloc_retries_during_b: s.retries_during_b,
            device_capacity: s.capacity,
        };
        sweep.push(name, s.peak_allocated_b, s.peak_reserved_b, None, measured);
    }
    sweep.claim(claim(&kept, &emptied));
    let fits = |b: bool| if b { "fits" } else { "runs out of memory" };
    sweep.claim(Claim {
        claim: "where another process uses the device, emptying the first one's cache lets the second get the memory".into(),
        measured: format!(
            "simulated (two allocators over one virtual memory, each replaying its task's recorded trace), two processes: device {}: A's process holds {} after A (in one process: {}, the replay's check); B needs {}; with A's cache kept B sees {} free and {}; after A's empty_cache {} free and B {}",
            human_bytes(cal.capacity),
            human_bytes(p_kept.reserved_after_a),
            human_bytes(cal.cached_a),
            human_bytes(cal.need_b),
            human_bytes(p_kept.free_when_b_starts),
            fits(p_kept.b_fitted),
            human_bytes(p_emptied.free_when_b_starts),
            fits(p_emptied.b_fitted),
        ),
        verdict: match (p_kept.b_fitted, p_emptied.b_fitted) {
            (false, true) => Verdict::Holds,
            (true, true) => Verdict::Partly,
            _ => Verdict::DoesNotHold,
        },
    });
    sweep.reading(format!(
        "In one process, empty_cache between tasks {} (B {} with the cache kept: the allocator reuses A's cached blocks); it matters when another process shares the device: there B {} while A's process keeps {} cached and {} after A's empty_cache.",
        if kept.b_fitted == emptied.b_fitted { "changes nothing" } else { "changes the outcome" },
        fits(kept.b_fitted),
        fits(p_kept.b_fitted),
        human_bytes(p_kept.reserved_after_a),
        fits(p_emptied.b_fitted),
    ));
    Ok(sweep)
}
