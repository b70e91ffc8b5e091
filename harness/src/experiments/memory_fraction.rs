//! `memory-fraction`: cap a process at a fraction of device memory, with another user on the
//! same device.
//!
//! Two processes share one device (two caching allocators over one capacity, as in
//! `multi-task`). Process A trains: 10% of the device in weights, then each step 20
//! activations of 1.75% of the device (35% in all), and every third step an evaluation of 6
//! tensors of 5% (30%) after the training step has freed its activations. Each of these
//! tensors is a segment of its own (over 10 MiB), and the training blocks cannot serve the
//! larger evaluation ones, so A's cache holds both sets: it reserves about 75% of the device
//! while it never has more than 45% allocated. After A's first evaluation process B (an
//! inference server, say) asks for 20% of the device, what the source's 0.8 cap promises to
//! leave to others, and holds it while A trains on. A runs
//! uncapped and capped at 0.8 (the source's value), 0.6 and 0.3 (below A's own need).
//!
//! What can fail: whether a cap is what lets B in (it is not when A's cache stays small on
//! its own); whether A still trains under a cap that holds its allocated working set but not
//! its cache (the allocator must free cached blocks and retry instead of failing); whether a
//! cap below the need fails with an error that names the cap.
//!
//! Two processes are simulated on virtual memory of the context's capacity on every backend
//! (the allocator's policy is the same on all of them, so the figures are exact).

use super::common::SharedMemory;
use super::{Experiment, Sweep};
use crate::techniques::Technique;
use crate::{Claim, Context, ExperimentError, Verdict};
use serde::Serialize;
use serde_json::json;
use vram_alloc::{AllocError, AllocatorConfig, CachingAllocator, DeviceMemory, human_bytes};

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
    a_steps_completed: usize,
    a_steps: usize,
    /// A's peak allocated and reserved bytes.
    a_peak_allocated: u64,
    a_peak_reserved: u64,
    /// Segments A obtained from and returned to the device (the cap's cost: cache freed and
    /// obtained again).
    a_device_allocations: u64,
    a_device_frees: u64,
    /// A's first error, if any.
    a_error: Option<String>,
    /// Whether B got its memory, and its error otherwise.
    b_fits: bool,
    b_error: Option<String>,
}

/// Process B's request, in percent of the device: what the source's cap (0.8) leaves, so
/// that the setup is the source's and the outcome is not fixed by the sizes.
const B_SHARE_PERCENT: u64 = 20;

/// Where every row ran: two allocators over one shared virtual memory on every backend,
/// their requests synthetic (no tensors, nothing computed).
const SIMULATED: &str = "simulated (two allocators over one virtual memory, synthetic requests)";

const FRACTIONS: [Option<f64>; 4] = [None, Some(0.8), Some(0.6), Some(0.3)];
/// Steps of A before B arrives.
const B_ARRIVES_AFTER: usize = 3;

/// What one run of the two processes did.
struct Outcome {
    cap: Option<u64>,
    a_done: usize,
    a_peak: (u64, u64),
    a_device: (u64, u64),
    a_error: Option<AllocError>,
    b_error: Option<AllocError>,
}

/// A's training with B arriving after [`B_ARRIVES_AFTER`] steps; stops at A's first error.
fn two_processes<M: DeviceMemory>(
    a: &CachingAllocator<M>,
    b: &CachingAllocator<M>,
    total: u64,
    steps: usize,
    seed: u64,
) -> Outcome {
    let _ = seed;
    let mut out = Outcome {
        cap: a.memory_cap(),
        a_done: 0,
        a_peak: (0, 0),
        a_device: (0, 0),
        a_error: None,
        b_error: None,
    };
    let mut b_holds = None;
    match a.allocate((total / 10) as usize) {
        Err(e) => out.a_error = Some(e),
        Ok(weights) => {
            'steps: for step in 0..steps {
                if step == B_ARRIVES_AFTER {
                    match b.allocate((total * B_SHARE_PERCENT / 100) as usize) {
                        Ok(block) => b_holds = Some(block),
                        Err(e) => out.b_error = Some(e),
                    }
                }
                let phase = |count: usize, size: u64| -> Result<(), AllocError> {
                    let mut held = Vec::with_capacity(count);
                    for _ in 0..count {
                        held.push(a.allocate(size as usize)?);
                    }
                    Ok(())
                };
                let evaluation = step % 3 == 2;
                let done = phase(20, total * 35 / 2000)
                    .and_then(|()| if evaluation { phase(6, total / 20) } else { Ok(()) });
                if let Err(e) = done {
                    out.a_error = Some(e);
                    break 'steps;
                }
                out.a_done += 1;
            }
            drop(weights);
        }
    }
    drop(b_holds);
    out.a_peak = (a.max_memory_allocated(), a.max_memory_reserved());
    let stats = a.memory_stats();
    out.a_device = (stats.num_device_alloc, stats.num_device_free);
    out
}

fn run(ctx: &Context) -> Result<Sweep<Measured>, ExperimentError> {
    let steps = if ctx.quick { 12 } else { 40 };
    let total = ctx.device_memory;
    let mut sweep = Sweep::new(
        ctx,
        json!({ "steps": steps, "weights_fraction": 0.1, "activations": "20 x 1.75% per step",
                "evaluation": "6 x 5% every third step", "second_process_fraction": B_SHARE_PERCENT as f64 / 100.0,
                "second_process_arrives_after_steps": B_ARRIVES_AFTER }),
    );
    let mut outcomes = Vec::new();
    for fraction in FRACTIONS {
        let mem = SharedMemory::new(total);
        let a = CachingAllocator::with_config(mem.clone(), AllocatorConfig::default())?;
        let b = CachingAllocator::with_config(mem, AllocatorConfig::default())?;
        if let Some(f) = fraction {
            a.set_memory_fraction(f)?;
        }
        let o = two_processes(&a, &b, total, steps, ctx.seed);
        let name = match fraction {
            None => "A uncapped".to_string(),
            Some(f) => format!("A capped at {f}"),
        };
        sweep.push(
            &format!("{SIMULATED}: {name}"),
            o.a_peak.0,
            o.a_peak.1,
            None,
            Measured {
                cap_bytes: o.cap,
                a_steps_completed: o.a_done,
                a_steps: steps,
                a_peak_allocated: o.a_peak.0,
                a_peak_reserved: o.a_peak.1,
                a_device_allocations: o.a_device.0,
                a_device_frees: o.a_device.1,
                a_error: o.a_error.as_ref().map(ToString::to_string),
                b_fits: o.b_error.is_none(),
                b_error: o.b_error.as_ref().map(ToString::to_string),
            },
        );
        outcomes.push((fraction, o));
    }
    let find = |f: Option<f64>| outcomes.iter().find(|(x, _)| *x == f).map(|(_, o)| o);
    let (Some(free), Some(c80), Some(c50), Some(c30)) =
        (find(None), find(Some(0.8)), find(Some(0.6)), find(Some(0.3)))
    else {
        return Err(ExperimentError::Setup("memory-fraction: a cap did not run".into()));
    };
    let b_text = |o: &Outcome| if o.b_error.is_none() { "fits" } else { "out of memory" };
    let a_text = |o: &Outcome| {
        format!(
            "A {}/{steps} steps, reserved {} (allocated {})",
            o.a_done,
            human_bytes(o.a_peak.1),
            human_bytes(o.a_peak.0)
        )
    };
    // 1. The cap is what lets B in.
    sweep.claim(Claim {
        claim: "a memory fraction limits a process's usage so that another user of the device gets its memory".into(),
        measured: format!(
            "{SIMULATED}: B asks for {} after A's step {B_ARRIVES_AFTER}: A uncapped: {}, B {}; cap 0.8: {}, B {}; cap 0.6: {}, B {}",
            human_bytes(total * B_SHARE_PERCENT / 100),
            a_text(free), b_text(free), a_text(c80), b_text(c80), a_text(c50), b_text(c50)
        ),
        verdict: match (free.b_error.is_some(), c50.b_error.is_none()) {
            (true, true) => Verdict::Holds,
            (false, true) => Verdict::NotApplicable,
            _ => Verdict::DoesNotHold,
        },
    });
    // 2. Under a cap that holds A's allocated working set but not its cache, A still trains.
    let need = free.a_peak.0;
    let holds_need = |o: &Outcome| o.cap.is_some_and(|c| c >= need);
    let squeezed: Vec<&Outcome> = [c80, c50]
        .into_iter()
        .filter(|o| holds_need(o) && o.cap.is_some_and(|c| c < free.a_peak.1))
        .collect();
    let squeezed_ok = squeezed.iter().all(|o| o.a_error.is_none());
    sweep.claim(Claim {
        claim: "under a cap that holds the allocated working set, training goes on: the allocator frees its cache and retries instead of failing".into(),
        measured: format!(
            "{SIMULATED}: A needs {} allocated and reserves {} uncapped ({} device allocations); {}",
            human_bytes(need),
            human_bytes(free.a_peak.1),
            free.a_device.0,
            [c80, c50]
                .iter()
                .map(|o| format!(
                    "cap {}: {}/{steps} steps, reserved {}, {} device allocations{}",
                    o.cap.map_or("-".into(), human_bytes),
                    o.a_done,
                    human_bytes(o.a_peak.1),
                    o.a_device.0,
                    o.a_error.as_ref().map_or(String::new(), |e| format!(", failed: {e}"))
                ))
                .collect::<Vec<_>>()
                .join("; ")
        ),
        verdict: if squeezed.is_empty() {
            Verdict::NotApplicable
        } else if squeezed_ok {
            Verdict::Holds
        } else {
            Verdict::DoesNotHold
        },
    });
    // 3. A cap below the need fails clearly.
    let names_cap = c30
        .a_error
        .as_ref()
        .is_some_and(|e| e.is_out_of_memory() && e.to_string().contains("memory fraction"));
    sweep.claim(Claim {
        claim: "a cap below what the run needs fails with an out-of-memory error that names the cap, although the device has room".into(),
        measured: format!(
            "{SIMULATED}: cap 0.3 ({}): A {}/{steps} steps; {}",
            c30.cap.map_or("-".into(), human_bytes),
            c30.a_done,
            c30.a_error.as_ref().map_or("no error".into(), |e| e.to_string())
        ),
        verdict: if names_cap { Verdict::Holds } else { Verdict::DoesNotHold },
    });
    sweep.reading(format!(
        "a fraction caps what a process reserves, cache included, not what it needs: uncapped, A's cache grew to {} and B {}; capped at 0.6, A trained on within {} (its cache freed and obtained again: {} device allocations instead of {}) and B {}; the source's 0.8 {} B; a cap below the need (0.3) fails the run although the device has room",
        human_bytes(free.a_peak.1),
        if free.b_error.is_some() { "could not get its memory" } else { "still fit" },
        human_bytes(c50.a_peak.1),
        c50.a_device.0,
        free.a_device.0,
        b_text(c50),
        if c80.b_error.is_none() { "also let in" } else { "was too high to let in" }
    ));
    Ok(sweep)
}
