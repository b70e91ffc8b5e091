//! `empty-cache`: what returning cached blocks does to reserved memory, what calling it
//! never / every N / every batch costs, and whether a second task needs it.

use super::common::{EXECUTED, cnn, cnn_side, device, gpt_tag, stripes, sync};
use crate::models::{Arch, Attention};

const SMALL: &str = "small (executed)";

/// GPT-2 small's batch when the experiment runs on a GPU.
const REAL_BATCH: usize = 4;
use super::{Experiment, Sweep};
use crate::models::Model;
use crate::plots::{Mark, lines_with_marks};
use crate::techniques::Technique;
use crate::timing::{Timing, interleaved};
use crate::trainer::adamw;
use crate::{Backend, Claim, Context, ExperimentError, Verdict, human_bytes};
use serde::Serialize;
use serde_json::json;
use std::time::Instant;
use vram_accum::{ForwardCtx, Mode};
use vram_amp::{AdamW, Optimizer};
use vram_kernels::{DType, Device};

const EVERY_N: usize = 100;

pub(super) static EXPERIMENT: Experiment<Measured> = Experiment {
    technique: Technique {
        id: "empty-cache",
        name: "empty_cache",
        claim: "helps with fragmentation; every batch costs 5-10% speed; lets a second task fit",
        source: "004_4a0e2eb70881fd56.txt (5-10% per batch, scenarios), 000_cc24938f7d0f0079.txt",
    },
    run,
    plot: Some(plot),
    host_capacity_limit: None,
    expected_secs: [21.5, 95.4],
};

/// One calling policy's measurements.
#[derive(Serialize)]
pub(super) struct Measured {
    allocated_at_end: u64,
    reserved_at_end: u64,
    reserved_after_empty_cache: u64,
    device_allocs: u64,
    /// Each timed step's wall time (ms), in order.
    step_ms_each: Vec<f64>,
    /// Each timed step's device allocations (cudaMalloc calls on a GPU).
    device_allocs_each: Vec<u64>,
    /// Timed steps (0-based) that began with an empty_cache call.
    called_at: Vec<usize>,
    /// Whether the times are host times.
    host_timings: bool,
}

/// One calling policy while it trains.
struct Policy {
    every: Option<usize>,
    dev: Device,
    model: Model,
    opt: AdamW,
    step: usize,
    /// The device allocations so far after each step (warm-up included).
    device_allocs: Vec<u64>,
}

fn run(ctx: &Context) -> Result<Sweep<Measured>, ExperimentError> {
    // One warm-up step, then whole periods of EVERY_N steps: the mean over a period is the
    // cost of calling every N steps (one call in N steps). On the host the speed claim is
    // not applicable (a device allocation's cost is a GPU figure) and one period shows the
    // allocations each policy causes, so only a GPU runs three.
    let host = matches!(ctx.backend, Backend::Cpu);
    let periods = if ctx.quick || host { 1 } else { 3 };
    let timed = periods * EVERY_N;
    // On a GPU the cost of a device allocation is only meaningful against a real step:
    // GPT-2 small (fp32 + AdamW, batch REAL_BATCH) executed on the card; on the host the
    // small CNN (its device allocations are the figure there, exact on every backend).
    let (arch, data, batch, part) = match ctx.backend {
        Backend::Cpu => (cnn(ctx, false), stripes(cnn_side(ctx)), 16, SMALL.to_string()),
        Backend::Cuda { .. } => {
            let arch = Arch::preset("gpt2-small")?;
            let tag = gpt_tag("GPT-2 small", &arch, Attention::Fused, "fp32 + AdamW");
            let data = arch.dataset();
            (arch, data, REAL_BATCH, format!("{EXECUTED}, {tag}, batch {REAL_BATCH}"))
        }
    };
    let mut sweep = Sweep::new(
        ctx,
        json!({ "model": format!("{arch:?}"), "steps": timed + 1, "timed_steps": timed, "batch_size": batch, "every_n": EVERY_N }),
    );
    let policies = [
        ("never", None),
        ("every 100 batches (the post's `batch_idx % 100 == 0`)", Some(EVERY_N)),
        ("every batch", Some(1)),
    ];
    let mut states = Vec::new();
    for (_, every) in policies {
        let dev = device(ctx, "")?;
        let model = Model::new(&dev, arch.clone(), ctx.seed, DType::F32)?;
        states.push(Policy {
            every,
            dev,
            model,
            opt: adamw(1e-3),
            step: 0,
            device_allocs: Vec::new(),
        });
    }
    let samples = interleaved(&mut states, 1, timed, |p| {
        let b = data.batch(ctx.seed, p.step as u64, batch);
        let started = Instant::now();
        // At the start of the first step of each period (the warm-up step 0 is not in one):
        // each period holds the call and the device allocations it causes.
        if p.every.is_some_and(|n| p.step >= 1 && (p.step - 1) % n == 0) {
            p.dev.empty_cache();
        }
        let mut fctx = ForwardCtx::new(Mode::Train, p.step as u64);
        p.model.train_step(&b, &mut fctx, 1.0)?;
        p.opt.step(&mut p.model)?;
        p.model.zero_grad();
        sync(&p.dev)?;
        p.step += 1;
        let ms = started.elapsed().as_secs_f64() * 1e3;
        p.device_allocs.push(p.dev.memory_stats().num_device_alloc);
        Ok::<_, ExperimentError>(ms)
    })?;
    let mut runs = Vec::new();
    for (((name, _), p), times) in policies.iter().zip(&states).zip(&samples) {
        let dev = &p.dev;
        let (allocated, reserved) = (dev.memory_allocated(), dev.memory_reserved());
        dev.empty_cache();
        let reserved_after = dev.memory_reserved();
        let step = Timing::from_samples(times)
            .ok_or_else(|| ExperimentError::Setup("empty-cache needs timed steps".into()))?;
        let allocs = dev.memory_stats().num_device_alloc;
        let measured = Measured {
            allocated_at_end: allocated,
            reserved_at_end: reserved,
            reserved_after_empty_cache: reserved_after,
            device_allocs: allocs,
            step_ms_each: times.clone(),
            device_allocs_each: p.device_allocs.windows(2).map(|w| w[1] - w[0]).collect(),
            // Timed step k is step k + 1 (step 0 is the warm-up).
            called_at: (0..timed).filter(|k| p.every.is_some_and(|n| k % n == 0)).collect(),
            host_timings: matches!(ctx.backend, Backend::Cpu),
        };
        let (peak, peak_reserved) = (dev.max_memory_allocated(), dev.max_memory_reserved());
        sweep.push(
            &format!("{part}: empty_cache {name}"),
            peak,
            peak_reserved,
            Some(step),
            measured,
        );
        runs.push((step, allocated, reserved, reserved_after, allocs));
    }
    let never = runs[0];
    let cached_before = never.2 - never.1;
    let cached_after = never.3.saturating_sub(never.1);
    sweep.claim(Claim {
        claim: "empty_cache returns cached (reserved but unallocated) memory to the device".into(),
        measured: format!(
            "{part}: after training: {} allocated, {} reserved ({} cached); after empty_cache: {} reserved ({} cached)",
            human_bytes(never.1), human_bytes(never.2), human_bytes(cached_before), human_bytes(never.3), human_bytes(cached_after)
        ),
        verdict: if cached_after * 10 <= cached_before { Verdict::Holds } else { Verdict::DoesNotHold },
    });
    let slow = |t: &Timing| 100.0 * (t.mean_ms / never.0.mean_ms - 1.0);
    let (every_n, every_batch) = (slow(&runs[1].0), slow(&runs[2].0));
    let measured = format!(
        "{part}: mean step {} never, {} every {EVERY_N} ({every_n:+.1}%, mean over whole periods), {} every batch ({every_batch:+.1}%); device allocations {} / {} / {}",
        never.0.describe(),
        runs[1].0.describe(),
        runs[2].0.describe(),
        never.4,
        runs[1].4,
        runs[2].4
    );
    let (measured, verdict) = match ctx.backend {
        Backend::Cpu => (
            format!(
                "{measured}: host timings, not applicable on the host: the cost of a device allocation (cudaMalloc) is a GPU figure"
            ),
            Verdict::NotApplicable,
        ),
        Backend::Cuda { .. } => {
            // As claimed: every batch within 5-10%, every N under 5%.
            let v = match ((5.0..=10.0).contains(&every_batch), every_n < 5.0) {
                (true, true) => Verdict::Holds,
                (false, false) => Verdict::DoesNotHold,
                _ => Verdict::Partly,
            };
            (measured, v)
        }
    };
    sweep.claim(Claim {
        claim: "calling empty_cache every batch costs 5-10% speed, every N batches under 5%".into(),
        measured,
        verdict,
    });
    // The third claim (a second task gets the memory) is measured once, by `multi-task`.
    let every_batch = runs[2];
    sweep.reading(format!(
        "empty_cache gives back only cached memory ({} here; allocated stays {}), and calling it every batch made the allocator go to the device {} times instead of {}: on a GPU each of those is a cudaMalloc; whether a second task then fits is measured by multi-task",
        human_bytes(cached_before),
        human_bytes(never.1),
        every_batch.4,
        never.4
    ));
    Ok(sweep)
}

/// Each policy's cost per step over the timed steps, with the calls of the every-N policy:
/// the step time on a GPU; on the host, where a device allocation costs nothing like a
/// cudaMalloc, the device allocations each step makes (exact on every backend).
fn plot(sweep: &Sweep<Measured>) -> Option<String> {
    let host = sweep.variants().first()?.1.host_timings;
    let series: Vec<(String, Vec<(f64, f64)>)> = sweep
        .variants()
        .iter()
        .map(|(v, m)| {
            let pts = if host {
                m.device_allocs_each
                    .iter()
                    .enumerate()
                    .map(|(i, &a)| (i as f64, a as f64))
                    .collect()
            } else {
                m.step_ms_each.iter().enumerate().map(|(i, &t)| (i as f64, t)).collect()
            };
            (v.name.rsplit(": ").next().unwrap_or(&v.name).to_string(), pts)
        })
        .collect();
    // "never" drawn last, so that its flat line is not hidden under every-100's.
    let mut series = series;
    series.reverse();
    let steps = sweep.variants().first()?.1.step_ms_each.len();
    let every_n = sweep
        .variants()
        .iter()
        .map(|(_, m)| &m.called_at)
        .find(|c| !c.is_empty() && c.len() < steps)?;
    let marks = [Mark::Vertical(
        format!("empty_cache calls (every {EVERY_N})"),
        every_n.iter().map(|&k| k as f64).collect(),
    )];
    let (title, y) = if host {
        (
            "Device allocations per step (cudaMalloc calls on a GPU)",
            "device allocations (count per step)",
        )
    } else {
        ("Step time per step", "step time (ms)")
    };
    lines_with_marks(title, "timed step (index)", y, &series, true, &marks)
}
