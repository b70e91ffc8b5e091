//! `max-batch-search`: find the largest batch that fits a fixed device, in one process: the
//! source's linear search (start at 2, add 2 until an OOM is caught) against an exponential
//! then binary search. Every trial is a real training step; every OOM is caught, the cache
//! emptied, and the search goes on. The size found then trains.
//!
//! The ground truth is exhaustive: every batch from 1 to twice the largest found, each on a
//! fresh device (a fresh process: nothing cached, nothing fragmented by earlier trials), two
//! training steps each. The same batches on an unlimited virtual device give the memory each
//! takes with room, which grows in steps, not smoothly: the allocator rounds and pools by
//! size, and the largest step comes where a tensor passes one of its size boundaries (1 MiB:
//! small to large pool; 10 MiB: its own segment instead of a share of a 20 MiB one). With
//! room, a convolution takes its im2col buffer for many images at once; where memory is
//! short it works in fewer, so a batch can fit a device smaller than what it takes with room,
//! and whether it fits depends on which blocks are free: fitting need not be monotone.

use super::common::{
    EXECUTED, REAL_SIZE_CAVEAT, cnn, cnn_side, gpu_usable, real_model, sized_device, stripes, sync,
};
use super::{Experiment, Sweep};
use crate::Backend;
use crate::models::{Arch, Model};
use crate::plan::ModelOverrides;
use crate::plots::{MIB, Mark, lines_with_marks};
use crate::techniques::Technique;
use crate::trainer::adamw;
use crate::{Claim, Context, ExperimentError, Verdict, human_bytes};
use serde::Serialize;
use serde_json::json;
use std::time::Instant;
use vram_accum::{ForwardCtx, Mode};
use vram_alloc::{AllocatorConfig, MIN_LARGE_ALLOC, SMALL_SIZE, TraceAction};
use vram_amp::{AdamW, Optimizer};
use vram_kernels::{DType, Device};

const SMALL: &str = "small (executed)";
const REAL: &str = super::common::REAL_VIRTUAL;
const CLAIM: &str = "the search (start at 2, add 2 until an OOM is caught, empty_cache) finds the largest batch without restarting the process";

pub(super) static EXPERIMENT: Experiment<Measured> = Experiment {
    technique: Technique {
        id: "max-batch-search",
        name: "largest batch that fits",
        claim: "the search (start at 2, add 2 until OOM) works without restarting the process",
        source: "001_eb115694b312c654.txt",
    },
    run,
    plot: Some(plot),
    host_capacity_limit: None,
    expected_secs: [8.1, 54.9],
};

/// One search strategy's measurements; the exhaustive one also keeps every probe.
#[derive(Serialize)]
pub(super) struct Measured {
    /// Where it ran: `small (executed)` or `real size (virtual)`.
    part: &'static str,
    /// The model searched.
    model: String,
    batch_found: usize,
    trials: usize,
    ooms_caught: usize,
    /// Wall time of the search (executed part only: the virtual device computes nothing).
    #[serde(skip_serializing_if = "Option::is_none")]
    seconds: Option<f64>,
    found_size_trains: bool,
    /// Device capacity, for the plot.
    capacity_bytes: u64,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    probes: Vec<Probe>,
}

/// One batch of the exhaustive sweep.
#[derive(Clone, Copy, Serialize)]
pub(super) struct Probe {
    batch: usize,
    /// Whether two training steps ran on a fresh device of the capacity.
    fits: bool,
    /// What two steps need (unlimited virtual device): peak allocated and reserved.
    needs_allocated_bytes: u64,
    needs_reserved_bytes: u64,
    /// The largest single request of the step.
    largest_request_bytes: u64,
}

struct Search {
    found: usize,
    trials: usize,
    ooms: usize,
    seconds: f64,
    trains: bool,
    peak_reserved: u64,
    peak_allocated: u64,
}

/// One trial: a training step at `batch`; `Ok(false)` on a caught OOM. On a virtual device
/// the batch has no values (nothing is computed).
fn trial(
    model: &mut Model,
    opt: &mut AdamW,
    dev: &Device,
    data: &crate::data::Dataset,
    seed: u64,
    batch: usize,
) -> Result<bool, ExperimentError> {
    let b = if dev.is_virtual() {
        data.batch_without_values(seed, batch as u64, batch)
    } else {
        data.batch(seed, batch as u64, batch)
    };
    let mut fctx = ForwardCtx::new(Mode::Train, seed);
    let fits = match model.train_step(&b, &mut fctx, 1.0) {
        Ok(_) => match opt.step(model) {
            Ok(()) => true,
            Err(e) if e.is_out_of_memory() => false,
            Err(e) => return Err(e.into()),
        },
        Err(e) if e.is_out_of_memory() => false,
        Err(e) => return Err(e.into()),
    };
    model.zero_grad();
    if !fits {
        dev.empty_cache();
    }
    Ok(fits)
}

fn search(ctx: &Context, capacity: u64, exponential: bool) -> Result<Search, ExperimentError> {
    let (arch, data) = (cnn(ctx, false), stripes(cnn_side(ctx)));
    let dev = sized_device(ctx, capacity)?;
    let model = Model::new(&dev, arch, ctx.seed, DType::F32)?;
    search_on(&dev, model, &data, ctx.seed, exponential)
}

/// The search on `dev` with `model`, in one process: the source's linear search (2, 4, 6,
/// ... until an OOM is caught) or exponential then binary; then two more steps at the size
/// found (does it train?).
fn search_on(
    dev: &Device,
    mut model: Model,
    data: &crate::data::Dataset,
    seed: u64,
    exponential: bool,
) -> Result<Search, ExperimentError> {
    let mut opt = adamw(1e-3);
    let (mut trials, mut ooms) = (0, 0);
    let started = Instant::now();
    let mut attempt =
        |b: usize, trials: &mut usize, ooms: &mut usize| -> Result<bool, ExperimentError> {
            *trials += 1;
            let ok = trial(&mut model, &mut opt, dev, data, seed, b)?;
            *ooms += usize::from(!ok);
            Ok(ok)
        };
    let found = if exponential {
        let (mut good, mut bad) = (0, 1);
        while attempt(bad, &mut trials, &mut ooms)? {
            good = bad;
            bad *= 2;
        }
        while bad - good > 1 {
            let mid = (good + bad) / 2;
            if attempt(mid, &mut trials, &mut ooms)? { good = mid } else { bad = mid }
        }
        good
    } else {
        let mut b = 2;
        while attempt(b, &mut trials, &mut ooms)? {
            b += 2;
        }
        b - 2
    };
    sync(dev)?;
    let seconds = started.elapsed().as_secs_f64();
    let mut trains = found > 0;
    for _ in 0..2 {
        trains = trains && trial(&mut model, &mut opt, dev, data, seed, found)?;
    }
    Ok(Search {
        found,
        trials,
        ooms,
        seconds,
        trains,
        peak_reserved: dev.max_memory_reserved(),
        peak_allocated: dev.max_memory_allocated(),
    })
}

/// Two training steps at `batch` on a fresh `dev`: whether they ran, the peaks, and, when
/// `traced`, the largest single request (from the allocator's trace; 0 otherwise).
fn probe_on(
    ctx: &Context,
    dev: &Device,
    arch: &Arch,
    data: &crate::data::Dataset,
    batch: usize,
    traced: bool,
) -> Result<(bool, u64, u64, u64), ExperimentError> {
    if traced {
        dev.record_history(Some(1 << 20));
    }
    let mut model = Model::new(dev, arch.clone(), ctx.seed, DType::F32)?;
    let mut opt = adamw(1e-3);
    let fits = trial(&mut model, &mut opt, dev, data, ctx.seed, batch)?
        && trial(&mut model, &mut opt, dev, data, ctx.seed, batch)?;
    let largest = dev
        .trace()
        .iter()
        .filter(|e| e.action == TraceAction::Alloc)
        .map(|e| e.requested as u64)
        .max()
        .unwrap_or(0);
    dev.record_history(None);
    Ok((fits, dev.max_memory_allocated(), dev.max_memory_reserved(), largest))
}

/// Every batch from 1 to `hi`: on a fresh device of `capacity` (does it fit?) and on an
/// unlimited virtual device (what does it need?). On the host backend the capacity device is
/// virtual too: the same allocator on the same capacity with the host's cuBLAS workspace
/// (none), nothing computed (its figures equal the host device's byte for byte, which the
/// plan tests check), so the sweep stays cheap.
/// An unlimited virtual device with the backend's cuBLAS workspace: what a batch takes with
/// room.
fn roomy(workspace: usize) -> Device {
    let dev = Device::virtual_device(crate::plan::UNLIMITED);
    dev.set_blas_workspace_size(workspace);
    dev
}

fn exhaustive(ctx: &Context, capacity: u64, hi: usize) -> Result<Vec<Probe>, ExperimentError> {
    let (arch, data) = (cnn(ctx, false), stripes(cnn_side(ctx)));
    let workspace = sized_device(ctx, capacity)?.blas_workspace_size();
    (1..=hi)
        .map(|batch| {
            let dev = match ctx.backend {
                Backend::Cpu => {
                    let dev = Device::virtual_with_config(capacity, AllocatorConfig::default())?;
                    dev.set_blas_workspace_size(workspace);
                    dev
                }
                Backend::Cuda { .. } => sized_device(ctx, capacity)?,
            };
            let (fits, ..) = probe_on(ctx, &dev, &arch, &data, batch, false)?;
            drop(dev);
            let (_, alloc, reserved, largest) =
                probe_on(ctx, &roomy(workspace), &arch, &data, batch, true)?;
            Ok(Probe {
                batch,
                fits,
                needs_allocated_bytes: alloc,
                needs_reserved_bytes: reserved,
                largest_request_bytes: largest,
            })
        })
        .collect()
}

/// The allocator's size boundaries a request crosses going from `a` to `b` bytes.
fn boundary_crossed(a: u64, b: u64) -> Option<&'static str> {
    let crosses = |limit: usize| a <= limit as u64 && b > limit as u64;
    if crosses(MIN_LARGE_ALLOC) {
        Some("past 10 MiB: it gets its own segment instead of a share of a 20 MiB one")
    } else if crosses(SMALL_SIZE) {
        Some("past 1 MiB: from the small pool's 2 MiB segments to the large pool's 20 MiB ones")
    } else {
        None
    }
}

/// The device's capacity: what two training steps at `target` reserve from a fresh start
/// with room (on the virtual device with the backend's cuBLAS workspace: its
/// allocator does what the backend's does, nothing is computed), so the target fits. Larger
/// batches may fit too: under pressure convolutions work in fewer images per im2col buffer.
fn capacity_for(ctx: &Context, target: usize) -> Result<u64, ExperimentError> {
    let (arch, data) = (cnn(ctx, false), stripes(cnn_side(ctx)));
    let workspace = sized_device(ctx, 2 << 20)?.blas_workspace_size();
    let (_, _, reserved, _) = probe_on(ctx, &roomy(workspace), &arch, &data, target, false)?;
    Ok(reserved.next_multiple_of(2 << 20))
}

/// The real-size searches: a zoo model at its real size (GPT-2 small: 1024 tokens, dropout
/// 0.1, fused attention; ResNet-50: 224 px), fp32 + AdamW, on a virtual card of a real
/// card's size (24 GiB: an RTX 3090/4090; 80 GiB: an A100/H100), the whole card (a GPU's
/// CUDA context comes off it).
fn real_runs(quick: bool) -> &'static [(&'static str, u64)] {
    if quick {
        &[("gpt2-small", 24 << 30)]
    } else {
        &[("gpt2-small", 24 << 30), ("gpt2-small", 80 << 30), ("resnet50", 24 << 30)]
    }
}

/// One real-size model's searches and their ground truth.
struct RealSearch {
    /// Where they ran: on the GPU capped at the card's size, or on virtual cards.
    part: &'static str,
    /// The model as the report names it (sizes, dropout, attention form), with precision.
    label: String,
    lin: Search,
    exp: Search,
    /// The largest batch that trains two steps from a fresh start, among those checked.
    truth: usize,
    /// The batches checked from a fresh start: every one from the first to the last.
    checked: (usize, usize),
    /// What two steps at `truth` need on an unlimited virtual device (allocated, reserved).
    truth_needs: (u64, u64),
}

/// The source's search and exponential + binary, each in one process on a virtual card of
/// `card` bytes, then the truth: every batch from two below the smaller size found up to
/// the first failure above the larger, each on a fresh virtual card.
fn real_search(ctx: &Context, name: &str, card: u64) -> Result<RealSearch, ExperimentError> {
    let pm = real_model(name, &ModelOverrides::default())?;
    let data = pm.arch.dataset();
    // On a GPU that holds the card (its size plus room for the CUDA context), the searches and
    // the ground truth run there, capped at the card's size; else on virtual cards.
    let on_gpu = gpu_usable(ctx).is_some_and(|usable| card <= usable);
    let fresh = |capacity: u64| -> Result<(Device, Model), ExperimentError> {
        let dev = if on_gpu && capacity <= card {
            sized_device(ctx, capacity)?
        } else {
            Device::virtual_device(capacity)
        };
        let model =
            Model::with_attention(&dev, pm.arch.clone(), ctx.seed, DType::F32, pm.attention)?;
        Ok((dev, model))
    };
    let searched = |exponential: bool| -> Result<Search, ExperimentError> {
        let (dev, model) = fresh(card)?;
        search_on(&dev, model, &data, ctx.seed, exponential)
    };
    let (lin, exp) = (searched(false)?, searched(true)?);
    let two_steps = |capacity: u64, batch: usize| -> Result<(bool, Device), ExperimentError> {
        let (dev, mut model) = fresh(capacity)?;
        let mut opt = adamw(1e-3);
        let fits = trial(&mut model, &mut opt, &dev, &data, ctx.seed, batch)?
            && trial(&mut model, &mut opt, &dev, &data, ctx.seed, batch)?;
        Ok((fits, dev))
    };
    let first = lin.found.min(exp.found).saturating_sub(2).max(1);
    let top = lin.found.max(exp.found) + 1;
    let (mut batch, mut truth) = (first, 0);
    loop {
        let (fits, _) = two_steps(card, batch)?;
        if fits {
            truth = batch;
        } else if batch >= top {
            break;
        }
        if batch >= 1 << 16 {
            return Err(ExperimentError::Setup(format!(
                "max-batch-search: {name} fits every batch up to {batch} on {}",
                human_bytes(card)
            )));
        }
        batch += 1;
    }
    let (_, roomy) = two_steps(crate::plan::UNLIMITED, truth.max(1))?;
    Ok(RealSearch {
        part: if on_gpu { EXECUTED } else { REAL },
        label: format!("{}, fp32 + AdamW", pm.name),
        lin,
        exp,
        truth,
        checked: (first, batch),
        truth_needs: (roomy.max_memory_allocated(), roomy.max_memory_reserved()),
    })
}

/// The source's claim on one search: the size found trains again in the same process
/// (after the caught OOMs) and is the largest batch (within the search's step) that a fresh
/// start trains. A size that trains on in the process but is above what a fresh start
/// trains (the cache the trials left fits it) holds only partly: a restarted run with it
/// runs out of memory.
fn judge(s: &Search, step: usize, truth: usize) -> Verdict {
    if !s.trains {
        Verdict::DoesNotHold
    } else if s.found > truth {
        Verdict::Partly
    } else if s.found + step > truth {
        Verdict::Holds
    } else {
        Verdict::Partly
    }
}

fn run(ctx: &Context) -> Result<Sweep<Measured>, ExperimentError> {
    // A device on which the sizing batch fits with room; under pressure about twice as many
    // fit, so the searches and the exhaustive sweep stay short.
    let target = if ctx.quick { 24 } else { 28 };
    let capacity = capacity_for(ctx, target)?;
    let small_model = match cnn(ctx, false) {
        Arch::ResNet { width, blocks, .. } => format!(
            "ResNet-like CNN (width {width}, blocks {blocks:?}, {} px), fp32 + AdamW",
            cnn_side(ctx)
        ),
        other => format!("{other:?}"),
    };
    let mut sweep = Sweep::new(
        ctx,
        json!({ "device_capacity": capacity, "model": "ResNet-like CNN", "sized_for_batch_with_room": target }),
    );
    let mut results = Vec::new();
    for (name, exponential) in
        [("linear: 2, 4, 6, ... until OOM", false), ("exponential then binary", true)]
    {
        let s = search(ctx, capacity, exponential)?;
        let measured = Measured {
            part: SMALL,
            model: small_model.clone(),
            batch_found: s.found,
            trials: s.trials,
            ooms_caught: s.ooms,
            seconds: Some(s.seconds),
            found_size_trains: s.trains,
            capacity_bytes: capacity,
            probes: Vec::new(),
        };
        sweep.push(&format!("{SMALL}: {name}"), s.peak_allocated, s.peak_reserved, None, measured);
        results.push(s);
    }
    let (lin, exp) = (&results[0], &results[1]);

    // Ground truth: every batch up to twice the largest found, each from a fresh start.
    let hi = 2 * lin.found.max(exp.found).max(4);
    let started = Instant::now();
    let probes = exhaustive(ctx, capacity, hi)?;
    let seconds = started.elapsed().as_secs_f64();
    let truth = probes.iter().filter(|p| p.fits).map(|p| p.batch).max().unwrap_or(0);
    let first_failure = probes.iter().find(|p| !p.fits).map(|p| p.batch);
    let monotone = first_failure.is_none_or(|f| truth < f);
    let at = |b: usize| probes.iter().find(|p| p.batch == b);
    let (peak_alloc, peak_reserved) =
        at(truth.max(1)).map_or((0, 0), |p| (p.needs_allocated_bytes, p.needs_reserved_bytes));
    sweep.push(
        &format!("{SMALL}: exhaustive, every batch on a fresh device (ground truth)"),
        peak_alloc,
        peak_reserved,
        None,
        Measured {
            part: SMALL,
            model: small_model.clone(),
            batch_found: truth,
            trials: probes.len(),
            ooms_caught: probes.iter().filter(|p| !p.fits).count(),
            seconds: Some(seconds),
            found_size_trains: truth > 0,
            capacity_bytes: capacity,
            probes: probes.clone(),
        },
    );

    // What each batch needs does not grow smoothly: where the largest tensor crosses an
    // allocator size boundary, and the largest step.
    let mib = |b: u64| human_bytes(b);
    let crossings: Vec<String> = probes
        .windows(3)
        .filter_map(|w| {
            let what = boundary_crossed(w[0].largest_request_bytes, w[1].largest_request_bytes)?;
            Some(format!(
                "from batch {} to {} the largest tensor goes {what} and reserved goes {} -> {} (then {} at batch {})",
                w[0].batch,
                w[1].batch,
                mib(w[0].needs_reserved_bytes),
                mib(w[1].needs_reserved_bytes),
                mib(w[2].needs_reserved_bytes),
                w[2].batch
            ))
        })
        .collect();
    let jump = probes
        .windows(2)
        .map(|w| (w[1].needs_reserved_bytes.saturating_sub(w[0].needs_reserved_bytes), w[0], w[1]))
        .max_by_key(|j| j.0);
    let span = probes.len().saturating_sub(1).max(1) as f64;
    let mean_step = probes.last().map_or(0.0, |l| {
        (l.needs_reserved_bytes as f64 - probes[0].needs_reserved_bytes as f64) / span
    });
    let jump_text = match jump {
        Some((bytes, a, b)) => format!(
            "reserved grows by {} per sample on average, by {} from batch {} to {}{}",
            mib(mean_step.max(0.0) as u64),
            mib(bytes),
            a.batch,
            b.batch,
            if crossings.is_empty() {
                String::new()
            } else {
                format!("; {}", crossings.join("; "))
            }
        ),
        None => "one batch only".into(),
    };
    let refits: Vec<String> = probes
        .iter()
        .filter(|p| p.fits && first_failure.is_some_and(|f| p.batch > f))
        .map(|p| p.batch.to_string())
        .collect();

    // Does each search find the truth? Linear steps by 2, so it can only find even sizes.
    // The claim is the source's (linear) search's; exponential + binary is the comparison.
    let vl = judge(lin, 2, truth);
    sweep.claim(Claim {
        claim: CLAIM.into(),
        measured: format!(
            "{SMALL}: {small_model}, device {}: true largest batch {truth} (every batch 1..{hi} from a fresh start{}); linear found {} in {} trials ({} OOM caught), exponential + binary {} in {} trials ({} caught); found sizes train again: {} / {}",
            human_bytes(capacity),
            if monotone { String::new() } else { format!("; not monotone: {} fails but {} fit", first_failure.unwrap_or(0), refits.join(", ")) },
            lin.found, lin.trials, lin.ooms, exp.found, exp.trials, exp.ooms, lin.trains, exp.trains
        ),
        verdict: vl,
    });
    // The shortcut of sizing a batch from two small ones, against the truth.
    let predicted = match (at(4), at(8)) {
        (Some(a), Some(b)) if b.needs_reserved_bytes > a.needs_reserved_bytes => {
            let per = (b.needs_reserved_bytes - a.needs_reserved_bytes) as f64 / 4.0;
            let fixed = a.needs_reserved_bytes as f64 - 4.0 * per;
            Some(((capacity as f64 - fixed) / per).floor().max(0.0) as usize)
        }
        _ => None,
    };
    if let Some(predicted) = predicted {
        let off = 100.0 * (predicted as f64 / truth.max(1) as f64 - 1.0);
        sweep.claim(Claim {
            claim: "a shortcut: the largest batch follows from two measured batches (fixed + per-sample memory)".into(),
            measured: format!(
                "{SMALL}: {small_model}, from batches 4 and 8: predicted {predicted}, true {truth} ({off:+.0}%); {jump_text}"
            ),
            verdict: if predicted == truth {
                Verdict::Holds
            } else if off.abs() <= 10.0 {
                Verdict::Partly
            } else {
                Verdict::DoesNotHold
            },
        });
    }
    let shape = if monotone {
        "every batch up to it fits and none above it".to_string()
    } else {
        format!(
            "but fitting is not monotone: batch {} fails while {} fit, so a search that stops at its first OOM can stop below the largest batch",
            first_failure.unwrap_or(0),
            refits.join(", ")
        )
    };
    // A size a search found that did not train again fit only once, in a cache that the
    // earlier trials had shaped (where memory is short, a convolution's im2col chunks
    // depend on which blocks are free).
    let once: Vec<String> = [("the linear search's", lin), ("the exponential search's", exp)]
        .iter()
        .filter(|(_, s)| s.found > 0 && !s.trains)
        .map(|(name, s)| {
            let fresh = at(s.found).is_some_and(|p| p.fits);
            format!(
                "{name} {} fit once in that process, after its earlier trials, but not in the two steps after the search{}",
                s.found,
                if fresh { "" } else { " nor from a fresh start" }
            )
        })
        .collect();
    let once = if once.is_empty() { String::new() } else { format!("; {}", once.join("; ")) };

    // Real size: the same searches on a virtual card of a real card's size.
    let mut real_text = Vec::new();
    for &(name, card) in real_runs(ctx.quick) {
        let r = real_search(ctx, name, card)?;
        for (what, s) in
            [("linear: 2, 4, 6, ... until OOM", &r.lin), ("exponential then binary", &r.exp)]
        {
            sweep.push(
                &format!("{}: {}, {} card: {what}", r.part, r.label, human_bytes(card)),
                s.peak_allocated,
                s.peak_reserved,
                None,
                Measured {
                    part: r.part,
                    model: r.label.clone(),
                    batch_found: s.found,
                    trials: s.trials,
                    ooms_caught: s.ooms,
                    seconds: (r.part == EXECUTED).then_some(s.seconds),
                    found_size_trains: s.trains,
                    capacity_bytes: card,
                    probes: Vec::new(),
                },
            );
        }
        sweep.push(
            &format!(
                "{}: {}, {} card: every batch {}..{} on a fresh card (ground truth; peaks: {} with room, virtual)",
                r.part,
                r.label,
                human_bytes(card),
                r.checked.0,
                r.checked.1,
                r.truth.max(1)
            ),
            r.truth_needs.0,
            r.truth_needs.1,
            None,
            Measured {
                part: r.part,
                model: r.label.clone(),
                batch_found: r.truth,
                trials: r.checked.1 + 1 - r.checked.0,
                ooms_caught: 0,
                seconds: None,
                found_size_trains: r.truth > 0,
                capacity_bytes: card,
                probes: Vec::new(),
            },
        );
        // The claim is the source's search's; exponential + binary is the comparison.
        let verdict = judge(&r.lin, 2, r.truth);
        sweep.claim(Claim {
            claim: CLAIM.into(),
            measured: format!(
                "{}: {} on a {} card: true largest batch {} (two steps from a fresh card, every batch {}..{} checked: {} fits, {} does not); linear found {} in {} trials ({} OOM caught), exponential + binary {} in {} trials ({} caught); found sizes train two more steps in the same process: {} / {}{}; {REAL_SIZE_CAVEAT}",
                r.part,
                r.label,
                human_bytes(card),
                r.truth,
                r.checked.0,
                r.checked.1,
                r.truth,
                r.checked.1,
                r.lin.found,
                r.lin.trials,
                r.lin.ooms,
                r.exp.found,
                r.exp.trials,
                r.exp.ooms,
                r.lin.trains,
                r.exp.trains,
                if [&r.lin, &r.exp].iter().any(|s| s.found > r.truth) {
                    " (a size above the true largest fits in the cache the search's trials left, not from a fresh start: a restarted run with it runs out of memory)"
                } else {
                    ""
                }
            ),
            verdict,
        });
        let once: Vec<String> = [("linear", &r.lin), ("exponential + binary", &r.exp)]
            .iter()
            .filter(|(_, s)| s.found > r.truth || !s.trains)
            .map(|(what, s)| {
                let after = if s.trains {
                    "and in the two steps after it"
                } else {
                    "but not in the two steps after it"
                };
                let fresh = if s.found > r.truth { ", not from a fresh card" } else { "" };
                format!(
                    "the {what} search's {} fit in that process after its earlier trials {after}{fresh}",
                    s.found
                )
            })
            .collect();
        real_text.push(format!(
            "{}: {} on a {} card: largest batch {}; linear search {} (trains on: {}), exponential + binary {} (trains on: {}){}",
            r.part,
            r.label,
            human_bytes(card),
            r.truth,
            r.lin.found,
            r.lin.trains,
            r.exp.found,
            r.exp.trains,
            if once.is_empty() { String::new() } else { format!(": {}", once.join("; ")) }
        ));
    }
    sweep.reading(format!(
        "{SMALL}: the true largest batch is {truth}, {shape}; exponential then binary search found {} in {} trials, the source's linear search {} in {} (even sizes only), both in one process{once}; {jump_text}. Real size: {}",
        exp.found,
        exp.trials,
        lin.found,
        lin.trials,
        real_text.join("; ")
    ));
    Ok(sweep)
}

/// What each batch needs (allocated, reserved) against the capacity, with the batches where
/// the largest tensor crosses an allocator size boundary.
fn plot(sweep: &Sweep<Measured>) -> Option<String> {
    let (_, m) = sweep.variants().iter().find(|(_, m)| !m.probes.is_empty())?;
    let xy = |f: fn(&Probe) -> u64| -> Vec<(f64, f64)> {
        m.probes.iter().map(|p| (p.batch as f64, f(p) as f64 / MIB)).collect()
    };
    let (first, last) = (m.probes.first()?.batch as f64, m.probes.last()?.batch as f64);
    let cap = m.capacity_bytes as f64 / MIB;
    let mut series = vec![
        ("with room: peak reserved".to_string(), xy(|p| p.needs_reserved_bytes)),
        ("with room: peak allocated".to_string(), xy(|p| p.needs_allocated_bytes)),
        ("device capacity".to_string(), vec![(first, cap), (last, cap)]),
    ];
    let top = m.probes.iter().map(|p| p.needs_reserved_bytes).max()? as f64 / MIB;
    for w in m.probes.windows(2) {
        let (a, b) = (w[0].largest_request_bytes, w[1].largest_request_bytes);
        if let Some(what) = boundary_crossed(a, b) {
            let x = w[1].batch as f64 - 0.5;
            let label = what.split(':').next().unwrap_or(what);
            series.push((format!("largest tensor {label}"), vec![(x, 0.0), (x, top)]));
        }
    }
    if m.batch_found > 0 {
        let x = m.batch_found as f64;
        series.push((format!("true largest batch ({})", m.batch_found), vec![(x, 0.0), (x, cap)]));
    }
    // Where memory is short a convolution works in smaller im2col chunks, so a batch can fit
    // the device although it takes more than the device with room: the crosses say which
    // batches failed on it.
    let failed: Vec<(f64, f64)> =
        m.probes.iter().filter(|p| !p.fits).map(|p| (p.batch as f64, cap)).collect();
    let marks = [Mark::Crosses("fails on the device".into(), failed, None)];
    lines_with_marks(
        &format!(
            "{SMALL}, {}: memory each batch takes with room, and where it fails (fresh device, 2 steps)",
            m.model
        ),
        "batch size (samples)",
        "memory (MiB)",
        &series,
        false,
        &marks,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn searched(found: usize, trains: bool) -> Search {
        Search {
            found,
            trials: 0,
            ooms: 1,
            seconds: 0.0,
            trains,
            peak_reserved: 0,
            peak_allocated: 0,
        }
    }

    #[test]
    fn the_verdict_can_come_out_either_way() {
        // Linear search steps by 2: one below the truth is the truth for it.
        assert_eq!(judge(&searched(10, true), 2, 11), Verdict::Holds);
        assert_eq!(judge(&searched(11, true), 1, 11), Verdict::Holds);
        assert_eq!(judge(&searched(8, true), 2, 11), Verdict::Partly);
        // Trains on in the process, but a fresh start with it runs out of memory.
        assert_eq!(judge(&searched(12, true), 2, 11), Verdict::Partly);
        assert_eq!(judge(&searched(10, false), 2, 11), Verdict::DoesNotHold);
    }

    #[test]
    fn the_real_size_search_finds_gpt2_smalls_largest_batch_on_a_24_gib_card() {
        let ctx = Context { backend: Backend::Cpu, quick: true, seed: 1, device_memory: 1 << 30 };
        let r = real_search(&ctx, "gpt2-small", 24 << 30).unwrap();
        // GPT-2 small (1024 tokens, fp32 + AdamW, fused attention and loss) takes well under
        // 1 GiB per sample over a fixed 1.4 GiB: tens of samples fit 24 GiB, not hundreds.
        assert!((8..=64).contains(&r.truth), "truth {}", r.truth);
        // Every batch of the window was checked from a fresh card, the last one failing.
        assert!(r.checked.0 <= r.truth && r.checked.1 > r.truth, "{:?} {}", r.checked, r.truth);
        for s in [&r.lin, &r.exp] {
            assert!(s.found > 0 && s.ooms >= 1, "found {} after {} OOMs", s.found, s.ooms);
            // A size above the truth fit only in a cache shaped by the search's trials.
            if s.found > r.truth {
                assert_ne!(judge(s, 1, r.truth), Verdict::Holds);
            }
        }
        // With room the step may reserve more than the card (under pressure the allocator
        // frees its cache and retries), but what it allocates fits.
        assert!(r.truth_needs.0 <= 24 << 30, "{:?}", r.truth_needs);
        assert!(r.label.contains("fused attention") && r.label.contains("fp32"), "{}", r.label);
    }
}
