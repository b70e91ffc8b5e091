//! `fragmentation`: watch reserved - allocated, and see whether fragmentation causes OOMs
//! although enough memory is free in total.
//!
//! The workload is the classic one: each step allocates activations of mixed sizes
//! (1-9 MiB, sharing 20 MiB segments), keeps one in sixteen alive for a few steps (a logged
//! tensor, a cached output), frees the rest, and every tenth step asks for one large buffer
//! (40% of the device, e.g. an evaluation batch). The long-lived tensors pin partly used
//! segments. Variants: the plain cache; the threshold rule (`empty_cache` when reserved -
//! allocated passes 1e9 bytes, the source's `reserved - allocated > 1e9`); expandable
//! segments.

use super::common::allocator_only;
use super::{Experiment, Sweep, allocator_variant};
use crate::plots::{Mark, lines_with_marks};
use crate::rng::Rng;
use crate::techniques::Technique;
use crate::timing::Timing;
use crate::{Backend, Claim, Context, ExperimentError, Verdict};
use serde::Serialize;
use serde_json::json;
use std::collections::VecDeque;
use std::time::Instant;
use vram_alloc::{Allocation, CachingAllocator, DeviceMemory, human_bytes};

/// The largest device the host simulates: the workload makes about 0.35 x capacity / 5 MiB
/// allocations per step (18 000 at 256 GiB), so host time and memory grow with the capacity.
const HOST_LIMIT: u64 = 256 << 30;

pub(super) static EXPERIMENT: Experiment<Measured> = Experiment {
    technique: Technique {
        id: "fragmentation",
        name: "fragmentation watch",
        claim: "fragmentation can cause OOM although enough memory is free in total",
        source: "004_4a0e2eb70881fd56.txt (reserved - allocated > 1 GB)",
    },
    run,
    plot: Some(plot),
    host_capacity_limit: Some((
        HOST_LIMIT,
        "its workload allocates about 0.35 x the capacity in 1-9 MiB tensors every step, so host time and memory grow with the simulated capacity",
    )),
    expected_secs: [0.1, 0.2],
};

/// One allocator setting's measurements.
#[derive(Serialize)]
pub(super) struct Measured {
    fragmentation_peak: f64,
    fragmentation_mean: f64,
    /// 1 - allocated / reserved after each step's forward pass.
    fragmentation_timeline: Vec<f64>,
    big_requests: usize,
    ooms: usize,
    fragmentation_ooms: usize,
    /// Steps whose large request failed.
    oom_steps: Vec<usize>,
    empty_cache_calls: usize,
    /// Mean time of one `empty_cache` call and its 95% interval (ms), when it was called.
    empty_cache_ms: Option<f64>,
    empty_cache_ms_ci95: Option<[f64; 2]>,
    /// Time of the threshold check itself (`memory_reserved() - memory_allocated()`), mean ns.
    threshold_check_ns: Option<f64>,
    /// Segments obtained from and returned to the device (cudaMalloc / cudaFree, or page
    /// maps and unmaps for expandable segments).
    device_allocations: u64,
    device_frees: u64,
}

const MIB: usize = 1 << 20;
const KEEP_ONE_IN: u64 = 16;
const KEEP_STEPS: usize = 8;
const BIG_EVERY: usize = 10;

#[derive(Default)]
struct Outcome {
    peak_allocated: u64,
    peak_reserved: u64,
    /// 1 - allocated/reserved after each step's forward pass.
    timeline: Vec<f64>,
    big_requests: usize,
    ooms: usize,
    /// OOMs where device free + cached-but-unallocated memory was at least the request.
    fragmentation_ooms: usize,
    oom_steps: Vec<usize>,
    empty_cache_calls: usize,
    /// Duration of each `empty_cache` call, ms.
    empty_cache_ms: Vec<f64>,
    /// Total time of the threshold checks, and how many.
    check_seconds: f64,
    checks: usize,
    device_allocations: u64,
    device_frees: u64,
}

impl Outcome {
    /// Mean of the fragmentation timeline.
    fn mean_fragmentation(&self) -> f64 {
        self.timeline.iter().sum::<f64>() / self.timeline.len().max(1) as f64
    }
}

fn workload<M: DeviceMemory>(
    cache: &CachingAllocator<M>,
    total: u64,
    steps: usize,
    seed: u64,
    threshold: Option<u64>,
) -> Result<Outcome, ExperimentError> {
    let mut rng = Rng::new(seed);
    let mut out = Outcome::default();
    let weights = cache.allocate((total / 10) as usize)?;
    let activation_budget = total * 35 / 100;
    let mut kept: VecDeque<Vec<Allocation<M>>> = VecDeque::new();
    for step in 0..steps {
        let mut acts = Vec::new();
        let mut keep = Vec::new();
        let mut used = 0u64;
        while used < activation_budget {
            let size = MIB + (rng.next_u64() % (8 * MIB as u64)) as usize;
            let Ok(a) = cache.allocate(size) else { break };
            used += size as u64;
            if rng.next_u64().is_multiple_of(KEEP_ONE_IN) { keep.push(a) } else { acts.push(a) }
        }
        let (alloc, reserved) = (cache.memory_allocated(), cache.memory_reserved());
        out.timeline.push(1.0 - alloc as f64 / reserved.max(1) as f64);
        drop(acts);
        kept.push_back(keep);
        if kept.len() > KEEP_STEPS {
            kept.pop_front();
        }
        if step % BIG_EVERY == BIG_EVERY - 1 {
            let size = (total * 4 / 10) as usize;
            out.big_requests += 1;
            if let Err(e) = cache.allocate(size) {
                if !e.is_out_of_memory() {
                    return Err(e.into());
                }
                out.ooms += 1;
                out.oom_steps.push(step);
                let free_in_total =
                    cache.mem_info().free + cache.memory_reserved() - cache.memory_allocated();
                if free_in_total >= size as u64 {
                    out.fragmentation_ooms += 1;
                }
            }
        }
        if let Some(t) = threshold {
            let started = Instant::now();
            let over = cache.memory_reserved() - cache.memory_allocated() > t;
            out.check_seconds += started.elapsed().as_secs_f64();
            out.checks += 1;
            if over {
                let started = Instant::now();
                cache.empty_cache();
                out.empty_cache_ms.push(started.elapsed().as_secs_f64() * 1e3);
                out.empty_cache_calls += 1;
            }
        }
    }
    drop(kept);
    drop(weights);
    out.peak_allocated = cache.max_memory_allocated();
    out.peak_reserved = cache.max_memory_reserved();
    let stats = cache.memory_stats();
    (out.device_allocations, out.device_frees) = (stats.num_device_alloc, stats.num_device_free);
    Ok(out)
}

fn run(ctx: &Context) -> Result<Sweep<Measured>, ExperimentError> {
    let steps = if ctx.quick { 60 } else { 300 };
    let total = ctx.device_memory;
    // The post's rule as written: `if reserved - allocated > 1e9: torch.cuda.empty_cache()`.
    let threshold = 1_000_000_000;
    let variants: [(&str, &str, Option<u64>); 3] = [
        ("plain cache", "", None),
        ("empty_cache past threshold", "", Some(threshold)),
        ("expandable segments", "expandable_segments:True", None),
    ];
    let mut sweep = Sweep::new(
        ctx,
        json!({ "steps": steps, "seed": ctx.seed, "activation_sizes_mib": [1, 9],
                "activation_budget_fraction": 0.35, "keep_one_in": KEEP_ONE_IN, "keep_steps": KEEP_STEPS,
                "big_request_fraction": 0.4, "big_request_every": BIG_EVERY, "threshold_bytes": threshold }),
    );
    let mut outcomes = Vec::new();
    for (name, conf, th) in variants {
        let o =
            allocator_variant!(ctx, conf, |cache| workload(&cache, total, steps, ctx.seed, th)?);
        let measured = Measured {
            fragmentation_peak: o.timeline.iter().copied().fold(0.0, f64::max),
            fragmentation_mean: o.mean_fragmentation(),
            fragmentation_timeline: o.timeline.clone(),
            big_requests: o.big_requests,
            ooms: o.ooms,
            fragmentation_ooms: o.fragmentation_ooms,
            oom_steps: o.oom_steps.clone(),
            empty_cache_calls: o.empty_cache_calls,
            empty_cache_ms: Timing::from_samples(&o.empty_cache_ms).map(|t| t.mean_ms),
            empty_cache_ms_ci95: Timing::from_samples(&o.empty_cache_ms).and_then(|t| t.ci95_ms),
            threshold_check_ns: (o.checks > 0).then(|| o.check_seconds * 1e9 / o.checks as f64),
            device_allocations: o.device_allocations,
            device_frees: o.device_frees,
        };
        sweep.push(
            &format!("{}: {name}", allocator_only(ctx)),
            o.peak_allocated,
            o.peak_reserved,
            None,
            measured,
        );
        outcomes.push((name, o));
    }
    let plain = &outcomes[0].1;
    let summary = |o: &Outcome| {
        format!(
            "{}/{} large requests failed ({} with enough memory free in total), mean fragmentation {:.0}%",
            o.ooms,
            o.big_requests,
            o.fragmentation_ooms,
            100.0 * o.mean_fragmentation()
        )
    };
    sweep.claim(Claim {
        claim: "fragmentation can cause OOM although enough memory is free in total".into(),
        measured: format!("{}: plain cache: {}", allocator_only(ctx), summary(plain)),
        verdict: if plain.fragmentation_ooms > 0 { Verdict::Holds } else { Verdict::DoesNotHold },
    });
    let host = matches!(ctx.backend, Backend::Cpu);
    for (name, o) in &outcomes[1..] {
        let verdict = if plain.fragmentation_ooms == 0 {
            Verdict::NotApplicable
        } else if o.fragmentation_ooms == 0 {
            Verdict::Holds
        } else if o.fragmentation_ooms < plain.fragmentation_ooms {
            Verdict::Partly
        } else {
            Verdict::DoesNotHold
        };
        let cost = if o.empty_cache_calls > 0 {
            let t = Timing::from_samples(&o.empty_cache_ms).map_or("-".into(), |t| {
                format!(
                    "{:.1} +- {:.1} us (n = {})",
                    t.mean_ms * 1e3,
                    t.half_width() * 1e3,
                    t.samples
                )
            });
            format!(
                "; the rule fired {} times in {steps} steps (one check costs {:.0} ns), each empty_cache {t}{}",
                o.empty_cache_calls,
                o.check_seconds * 1e9 / o.checks.max(1) as f64,
                if host {
                    " (host: virtual-memory bookkeeping; on a GPU each returned segment is a cudaFree)"
                } else {
                    ""
                }
            )
        } else {
            String::new()
        };
        sweep.claim(Claim {
            claim: format!("{name} avoids the OOMs fragmentation causes"),
            measured: format!(
                "{}: {}; peak reserved {} vs {} plain; device allocations / frees {} / {} vs {} / {} plain{cost}",
                allocator_only(ctx),
                summary(o),
                human_bytes(o.peak_reserved),
                human_bytes(plain.peak_reserved),
                o.device_allocations,
                o.device_frees,
                plain.device_allocations,
                plain.device_frees,
            ),
            verdict,
        });
    }
    // The recommendation: fewest such OOMs, then fewest trips to the device (each a
    // cudaMalloc/cudaFree or a map/unmap on a GPU), then least reserved.
    let best = outcomes[1..]
        .iter()
        .min_by_key(|(_, o)| {
            (o.fragmentation_ooms, o.device_allocations + o.device_frees, o.peak_reserved)
        })
        .map(|(name, o)| (*name, o));
    let threshold_rule = &outcomes[1].1;
    let mut reading = match best {
        Some((name, o)) => format!(
            "with the plain cache {} of {} large requests failed although the memory was free in total; {name} does best here ({} such failures, {} device allocations and frees, {} reserved at peak); the threshold rule fired on {} of {steps} steps and cost {} device allocations and frees",
            plain.fragmentation_ooms,
            plain.big_requests,
            o.fragmentation_ooms,
            o.device_allocations + o.device_frees,
            human_bytes(o.peak_reserved),
            threshold_rule.empty_cache_calls,
            threshold_rule.device_allocations + threshold_rule.device_frees
        ),
        None => "no remedy ran".into(),
    };
    if let Some((_, expandable)) = outcomes.iter().find(|(n, _)| *n == "expandable segments")
        && expandable.fragmentation_ooms == 0
        && expandable.mean_fragmentation() > plain.mean_fragmentation()
    {
        reading.push_str(&format!(
            "; the watched figure misleads here: 1 - allocated / reserved averaged {:.0}% with expandable segments, which never failed, against {:.0}% for the plain cache: their free pages serve any size",
            100.0 * expandable.mean_fragmentation(),
            100.0 * plain.mean_fragmentation()
        ));
    }
    sweep.reading(reading);
    Ok(sweep)
}

/// Fragmentation over the steps, one line per setting, each failed large request marked.
fn plot(sweep: &Sweep<Measured>) -> Option<String> {
    let series: Vec<(String, Vec<(f64, f64)>)> = sweep
        .variants()
        .iter()
        .map(|(v, m)| {
            let pts = m
                .fragmentation_timeline
                .iter()
                .enumerate()
                .map(|(i, f)| (i as f64, 100.0 * f))
                .collect();
            (v.name.rsplit(": ").next().unwrap_or(&v.name).to_string(), pts)
        })
        .collect();
    let marks: Vec<Mark> = sweep
        .variants()
        .iter()
        .enumerate()
        .filter(|(_, (_, m))| !m.oom_steps.is_empty())
        .map(|(i, (v, m))| {
            let at = m
                .oom_steps
                .iter()
                .map(|&s| {
                    (s as f64, 100.0 * m.fragmentation_timeline.get(s).copied().unwrap_or(0.0))
                })
                .collect();
            Mark::Crosses(
                format!("large request OOM ({})", v.name.rsplit(": ").next().unwrap_or(&v.name)),
                at,
                Some(i),
            )
        })
        .collect();
    lines_with_marks(
        "Fragmentation (1 - allocated / reserved) per step",
        "training step (index)",
        "fragmentation: 1 - allocated / reserved (%)",
        &series,
        false,
        &marks,
    )
}
