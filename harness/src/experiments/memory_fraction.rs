//! `memory-fraction`: cap the process at a fraction of device memory.
//!
//! A training-like working set (weights kept, activations allocated and freed each step) runs
//! on a device of the configured capacity, uncapped and capped at 0.8 and 0.5. The working
//! set is 60% of the device, so the 0.5 cap must refuse it although the device has room,
//! while 0.8 must hold it; reserved memory must never pass a cap.

use super::{Experiment, Sweep, allocator_variant};
use crate::techniques::Technique;
use crate::{Claim, Context, ExperimentError, Verdict};
use serde::Serialize;
use serde_json::json;
use vram_alloc::{AllocError, CachingAllocator, DeviceMemory, human_bytes};

pub(super) static EXPERIMENT: Experiment<Measured> = Experiment {
    technique: Technique {
        id: "memory-fraction",
        name: "per-process memory fraction cap",
        claim: "limits usage",
        source: "000_cc24938f7d0f0079.txt (set_per_process_memory_fraction(0.8))",
    },
    run,
    plot: None,
    host_capacity_limit: Some((
        1 << 60,
        "the virtual device hands out 64-bit addresses and does not reuse them, so segments of a tenth of a larger device run out of address space",
    )),
    expected_secs: [0.1, 0.1],
};

/// One cap's measurements.
#[derive(Serialize)]
pub(super) struct Measured {
    cap_bytes: Option<u64>,
    steps_completed: usize,
    oom: Option<Refusal>,
}

/// The first allocation the cap refused.
#[derive(Serialize)]
pub(super) struct Refusal {
    requested_bytes: usize,
    device_free_bytes: u64,
    message: String,
}

const FRACTIONS: [Option<f64>; 3] = [None, Some(0.8), Some(0.5)];

struct Outcome {
    peak_reserved: u64,
    peak_allocated: u64,
    cap: Option<u64>,
    failed: Option<(usize, u64, String)>,
    steps_done: usize,
}

fn workload<M: DeviceMemory>(cache: &CachingAllocator<M>, total: u64, steps: usize) -> Outcome {
    // 10% weights (kept), 50% activations per step in 25 tensors of 2% each.
    let weights_bytes = (total / 10) as usize;
    let act = (total / 50) as usize;
    let mut failed = None;
    let mut steps_done = 0;
    let mut on_err = |e: AllocError, size: usize, cache: &CachingAllocator<M>| {
        if failed.is_none() {
            failed = Some((size, cache.mem_info().free, e.to_string()));
        }
    };
    let weights = match cache.allocate(weights_bytes) {
        Ok(w) => Some(w),
        Err(e) => {
            on_err(e, weights_bytes, cache);
            None
        }
    };
    if weights.is_some() {
        'steps: for _ in 0..steps {
            let mut acts = Vec::with_capacity(25);
            for _ in 0..25 {
                match cache.allocate(act) {
                    Ok(a) => acts.push(a),
                    Err(e) => {
                        on_err(e, act, cache);
                        break 'steps;
                    }
                }
            }
            steps_done += 1;
        }
    }
    drop(weights);
    Outcome {
        peak_reserved: cache.max_memory_reserved(),
        peak_allocated: cache.max_memory_allocated(),
        cap: cache.memory_cap(),
        failed,
        steps_done,
    }
}

fn run(ctx: &Context) -> Result<Sweep<Measured>, ExperimentError> {
    let steps = if ctx.quick { 3 } else { 20 };
    let total = ctx.device_memory;
    let mut sweep = Sweep::new(ctx, json!({ "steps": steps, "working_set_fraction": 0.6 }));
    let mut outcomes = Vec::new();
    for fraction in FRACTIONS {
        let name = match fraction {
            None => "no cap".to_string(),
            Some(f) => format!("fraction {f}"),
        };
        let o = allocator_variant!(ctx, "", |cache| {
            if let Some(f) = fraction {
                cache.set_memory_fraction(f)?;
            }
            workload(&cache, total, steps)
        });
        let measured = Measured {
            cap_bytes: o.cap,
            steps_completed: o.steps_done,
            oom: o.failed.as_ref().map(|(size, free, msg)| Refusal {
                requested_bytes: *size,
                device_free_bytes: *free,
                message: msg.clone(),
            }),
        };
        sweep.push(&name, o.peak_allocated, o.peak_reserved, None, measured);
        outcomes.push((fraction, o));
    }
    let within_cap = outcomes.iter().all(|(_, o)| o.cap.is_none_or(|c| o.peak_reserved <= c));
    let half = &outcomes[2].1;
    let refused_with_room = half
        .failed
        .as_ref()
        .is_some_and(|(size, free, msg)| *free >= *size as u64 && msg.contains("memory fraction"));
    let uncapped_ok = outcomes[0].1.failed.is_none() && outcomes[1].1.failed.is_none();
    let peaks: Vec<String> = outcomes
        .iter()
        .map(|(f, o)| {
            format!(
                "{}: peak reserved {} (cap {})",
                f.map_or("none".into(), |f| f.to_string()),
                human_bytes(o.peak_reserved),
                o.cap.map_or("-".into(), human_bytes)
            )
        })
        .collect();
    let verdict = match (within_cap, refused_with_room, uncapped_ok) {
        (true, true, true) => Verdict::Holds,
        (true, _, _) => Verdict::Partly,
        _ => Verdict::DoesNotHold,
    };
    let refusal = half.failed.as_ref().map_or("no refusal".into(), |(size, free, _)| {
        format!(
            "cap 0.5 refused {} with {} free on the device",
            human_bytes(*size as u64),
            human_bytes(*free)
        )
    });
    sweep.claim(Claim {
        claim: "a memory fraction limits usage: reserved never passes the cap; over it, a clear OOM although the device has room; under it, all works".into(),
        measured: format!("{}; {refusal}", peaks.join("; ")),
        verdict,
    });
    sweep.reading(format!(
        "a fraction caps this process's reserved memory, not its need: past the cap an allocation fails as out of memory ({refusal}) even with the device free, so it protects other users of the device, not this run"
    ));
    Ok(sweep)
}
