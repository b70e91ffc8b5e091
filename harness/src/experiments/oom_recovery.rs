//! `oom-recovery`: catch an out-of-memory error and retry the step, as a 2x2 of the recipe's
//! two parts (empty the cache before the retry or not; retry as two half-batches or with the
//! full batch again). Each cell: recovery rate, whether the live tensors survived every
//! caught OOM, steps completed.
//!
//! The verdicts come from the post's setup at real size, on the virtual device (it allocates
//! without computing): GPT-2 small trained with a loader of each of the posts' batch sizes on
//! cards of real sizes, nothing sized to the model, so which batches run out of memory and
//! whether half of one fits is measured. A small MLP executed on the backend, on a device
//! sized between its half-batch and full-batch need, checks the mechanism (weights bit for
//! bit after each caught OOM): its outcome is fixed by that sizing, so it is a consistency
//! check, not a verdict.

use super::common::{
    EXECUTED, REAL_SIZE_CAVEAT, device, fingerprint, gpu_usable, real_model, real_tag, sized_device,
};
use super::{Experiment, Sweep};
use crate::data::{Batch, Dataset};
use crate::models::{Arch, Model};
use crate::plan::ModelOverrides;
use crate::techniques::Technique;
use crate::trainer::adamw;
use crate::{Claim, Context, ExperimentError, Verdict, human_bytes};
use serde::Serialize;
use serde_json::json;
use vram_accum::{ForwardCtx, Mode};
use vram_amp::Optimizer;
use vram_kernels::{DType, Device};

pub(super) static EXPERIMENT: Experiment<Measured> = Experiment {
    technique: Technique {
        id: "oom-recovery",
        name: "OOM recovery",
        claim: "catch OOM, empty the cache, retry with half the batch: recovery success +50%",
        source: "004_4a0e2eb70881fd56.txt (recovery success +50%)",
    },
    run,
    plot: None,
    host_capacity_limit: None,
    expected_secs: [0.5, 1.0],
};

/// One cell of the 2x2.
#[derive(Serialize, Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct Measured {
    /// Whether `empty_cache` ran between the caught OOM and the retry.
    empty_cache: bool,
    /// Whether the retry split the batch in two halves (else: the full batch again).
    half_batch: bool,
    /// Steps whose first attempt ran out of memory.
    ooms: usize,
    /// Of those, steps whose retry succeeded.
    recovered: usize,
    /// `recovered / ooms` (1 when nothing ran out of memory).
    recovery_rate: f64,
    /// Optimizer steps taken (a step whose retry failed is skipped).
    steps_completed: usize,
    /// After every caught OOM (and `zero_grad`), the allocated bytes were those before the
    /// step (the failed step's tensors all returned) and, where values exist, the weights
    /// bit-identical.
    live_tensors_intact: bool,
    /// The largest difference of allocated bytes after a caught OOM (and `zero_grad`) from
    /// before the step (0: everything the failed step allocated came back).
    max_leftover_bytes: i64,
    /// Times the allocator itself released its cache and retried an allocation.
    allocator_retries: u64,
}

/// Runs `steps` steps of `model` on batches of `samples` from `batch`, catching OOM with one cell's
/// policy; `values` says whether the weights can be read (not on a virtual device).
fn cell(
    dev: &Device,
    model: &mut Model,
    batch: &dyn Fn(u64) -> Batch,
    samples: usize,
    steps: usize,
    (empty_cache, half_batch): (bool, bool),
    values: bool,
) -> Result<Measured, ExperimentError> {
    let mut opt = adamw(1e-3);
    let mut m =
        Measured { empty_cache, half_batch, live_tensors_intact: true, ..Measured::default() };
    // One inference forward of one sample first, so that one-time allocations (the cuBLAS
    // workspace at the first product) are not counted as a failed step's leftovers.
    let one = batch(u64::MAX).split(samples).remove(0);
    model.eval_loss(&one, Mode::Inference)?;
    let retries_before = dev.memory_stats().num_alloc_retries;
    for step in 0..steps as u64 {
        let b = batch(step);
        let allocated_before = dev.memory_allocated();
        let weights_before = if values { fingerprint(model) } else { 0 };
        let mut fctx = ForwardCtx::new(Mode::Train, step);
        match model.train_step(&b, &mut fctx, 1.0) {
            Ok(_) => {}
            Err(e) if e.is_out_of_memory() => {
                m.ooms += 1;
                model.zero_grad();
                let leftover = dev.memory_allocated() as i64 - allocated_before as i64;
                m.max_leftover_bytes = m.max_leftover_bytes.max(leftover);
                m.live_tensors_intact &=
                    leftover == 0 && (!values || fingerprint(model) == weights_before);
                if empty_cache {
                    dev.empty_cache();
                }
                let parts = if half_batch { b.split(2) } else { vec![b] };
                let scale = 1.0 / parts.len() as f32;
                let mut ok = true;
                for part in &parts {
                    let mut fctx = ForwardCtx::new(Mode::Train, step);
                    match model.train_step(part, &mut fctx, scale) {
                        Ok(_) => {}
                        Err(e) if e.is_out_of_memory() => {
                            ok = false;
                            break;
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
                if !ok {
                    model.zero_grad();
                    continue;
                }
                m.recovered += 1;
            }
            Err(e) => return Err(e.into()),
        }
        opt.step(model)?;
        model.zero_grad();
        m.steps_completed += 1;
    }
    m.recovery_rate = if m.ooms == 0 { 1.0 } else { m.recovered as f64 / m.ooms as f64 };
    m.allocator_retries = dev.memory_stats().num_alloc_retries - retries_before;
    Ok(m)
}

const SMALL: &str = "small (executed)";
const REAL: &str = super::common::REAL_VIRTUAL;

/// The four cells, in the order (empty_cache, half_batch) = ff, tf, ft, tt.
const CELLS: [(bool, bool); 4] = [(false, false), (true, false), (false, true), (true, true)];

fn cell_name(part: &str, (empty, half): (bool, bool)) -> String {
    format!(
        "{part}: {} + retry {}",
        if empty { "empty_cache" } else { "cache kept" },
        if half { "as 2 half-batches" } else { "full batch" }
    )
}

/// Percentage-point effects of each part of the recipe, from the four cells (ordered as
/// [`CELLS`]): (empty_cache's effect with a full retry, with a half retry, the half batch's
/// effect without empty_cache, with it, the whole recipe against a plain retry).
pub(crate) fn effects(cells: &[Measured; 4]) -> [f64; 5] {
    let r = |i: usize| 100.0 * cells[i].recovery_rate;
    [r(1) - r(0), r(3) - r(2), r(2) - r(0), r(3) - r(1), r(3) - r(0)]
}

/// The post's setup at real size: GPT-2 small (1024 tokens, dropout 0.1, fused attention),
/// fp32 + AdamW, trained with a loader of each power-of-two batch from 003's 8 to 256 on
/// virtual cards of real cards' sizes (24 GiB: an RTX 3090/4090; 80 GiB: an A100/H100).
/// Nothing is sized to the model: which loader batches run out of memory, and whether half
/// of one fits, is what the run finds.
const CARDS: [u64; 2] = [24 << 30, 80 << 30];
const LOADER_BATCHES: [usize; 6] = [8, 16, 32, 64, 128, 256];

/// The four cells' recovery rates pooled over every (card, loader batch) that ran out of
/// memory: recovered over caught OOMs, per cell in [`CELLS`]' order (1 where none ran out).
pub(crate) fn pooled(runs: &[[Measured; 4]]) -> [Measured; 4] {
    let mut out = [Measured::default(); 4];
    for (k, o) in out.iter_mut().enumerate() {
        let (empty_cache, half_batch) = CELLS[k];
        *o = Measured { empty_cache, half_batch, live_tensors_intact: true, ..Measured::default() };
        for r in runs {
            let m = &r[k];
            o.ooms += m.ooms;
            o.recovered += m.recovered;
            o.steps_completed += m.steps_completed;
            o.live_tensors_intact &= m.live_tensors_intact;
            o.max_leftover_bytes = o.max_leftover_bytes.max(m.max_leftover_bytes);
            o.allocator_retries += m.allocator_retries;
        }
        o.recovery_rate = if o.ooms == 0 { 1.0 } else { o.recovered as f64 / o.ooms as f64 };
    }
    out
}

/// The verdict on the post's "+50%": the points empty_cache adds to the recovery rate of the
/// post's retry (half the batch), and whether anything ran out of memory at all.
pub(crate) fn empty_cache_verdict(points: f64, any_oom: bool) -> Verdict {
    if !any_oom {
        Verdict::NotApplicable
    } else if points >= 50.0 {
        Verdict::Holds
    } else if points > 0.0 {
        Verdict::Partly
    } else {
        Verdict::DoesNotHold
    }
}

fn run(ctx: &Context) -> Result<Sweep<Measured>, ExperimentError> {
    let steps = if ctx.quick { 4 } else { 10 };
    // The executed part checks the mechanism on the backend: a device sized between the
    // half-batch and the full-batch need, so that every step runs out of memory and half of
    // it fits (by construction: a consistency check, not a verdict). At 2048 samples the
    // step's largest tensors take 20 MiB segments of their own, at 1024 they share 2 MiB
    // ones: the two needs are far enough apart (24 vs 6 MiB) for a device between them.
    let batch = 2048;
    let data = Dataset::Clusters { dim: 64, classes: 8 };
    let arch = Arch::Mlp { dims: vec![64, 256, 256, 256], classes: 8 };
    // Each batch size's need: one training step and optimizer step on a roomy device.
    let small_need = |n: usize| -> Result<u64, ExperimentError> {
        let dev = device(ctx, "")?;
        let mut model = Model::new(&dev, arch.clone(), ctx.seed, DType::F32)?;
        let probe = |i: u64| data.batch(ctx.seed, i, n);
        cell(&dev, &mut model, &probe, n, 1, (false, false), true)?;
        Ok(dev.max_memory_reserved())
    };
    let (half, full) = (small_need(batch / 2)?, small_need(batch)?);
    let capacity = ((half + full) / 2).next_multiple_of(2 << 20).min(full - 1);

    let real_steps = 2;
    let pm = real_model("gpt2-small", &ModelOverrides::default())?;
    let gpt_data = pm.arch.dataset();
    let gpt_label = format!("{}, fp32 + AdamW", pm.name);
    let gpt_row = real_tag(&pm, "fp32");

    let mut sweep = Sweep::new(
        ctx,
        json!({
            "small (executed)": { "model": format!("{arch:?}"), "batch_size": batch, "device_capacity": capacity, "steps": steps },
            "real size": { "model": gpt_label, "loader_batches": LOADER_BATCHES, "cards": CARDS, "steps": real_steps },
        }),
    );
    let mut small = [Measured::default(); 4];
    for (k, policy) in CELLS.into_iter().enumerate() {
        let dev = sized_device(ctx, capacity)?;
        let mut model = Model::new(&dev, arch.clone(), ctx.seed, DType::F32)?;
        let batches = |i: u64| data.batch(ctx.seed, i, batch);
        small[k] = cell(&dev, &mut model, &batches, batch, steps, policy, true)?;
        let name =
            cell_name(&format!("{SMALL}, batch {batch} on {}", human_bytes(capacity)), policy);
        sweep.push(&name, dev.max_memory_allocated(), dev.max_memory_reserved(), None, small[k]);
    }

    // Real size: every (card, loader batch) in each cell, from a fresh card: on a GPU that
    // holds the card (its size plus room for the CUDA context), the GPU capped at the card's
    // size, with values (then the weights are checked bit for bit after each OOM too); else
    // a virtual card.
    let on_gpu = |card: u64| gpu_usable(ctx).is_some_and(|usable| card <= usable);
    let part = |card: u64| if on_gpu(card) { EXECUTED } else { REAL };
    let mut runs: Vec<[Measured; 4]> = Vec::new();
    let mut outcomes = Vec::new();
    for card in CARDS {
        for loader in LOADER_BATCHES {
            let mut run = [Measured::default(); 4];
            for (k, policy) in CELLS.into_iter().enumerate() {
                let gpu = on_gpu(card);
                let dev = if gpu { sized_device(ctx, card)? } else { Device::virtual_device(card) };
                let mut model = Model::with_attention(
                    &dev,
                    pm.arch.clone(),
                    ctx.seed,
                    DType::F32,
                    pm.attention,
                )?;
                let batches = |i: u64| {
                    if gpu {
                        gpt_data.batch(ctx.seed, i, loader)
                    } else {
                        gpt_data.batch_without_values(ctx.seed, i, loader)
                    }
                };
                run[k] = cell(&dev, &mut model, &batches, loader, real_steps, policy, gpu)?;
                let name = cell_name(
                    &format!(
                        "{}, {gpt_row} batch {loader} on a {} card",
                        part(card),
                        human_bytes(card)
                    ),
                    policy,
                );
                sweep.push(
                    &name,
                    dev.max_memory_allocated(),
                    dev.max_memory_reserved(),
                    None,
                    run[k],
                );
            }
            let [_, _, kept_half, recipe] = run;
            outcomes.push(format!(
                "{} card, batch {loader}: {}",
                human_bytes(card),
                if recipe.ooms == 0 {
                    "fits".to_string()
                } else {
                    format!(
                        "OOM, half ({}) {} with empty_cache, {} without",
                        loader / 2,
                        if recipe.recovered == recipe.ooms { "fits" } else { "fails" },
                        if kept_half.recovered == kept_half.ooms { "fits" } else { "fails" }
                    )
                }
            ));
            runs.push(run);
        }
    }
    let big = pooled(&runs);
    // Where the real-size runs ran, for the claims: one place, or each card's.
    let real_where = if CARDS.iter().all(|&c| part(c) == part(CARDS[0])) {
        part(CARDS[0]).to_string()
    } else {
        format!(
            "real size ({})",
            CARDS
                .iter()
                .map(|&c| format!(
                    "{} card {}",
                    human_bytes(c),
                    if on_gpu(c) { "executed on the GPU" } else { "virtual" }
                ))
                .collect::<Vec<_>>()
                .join(", ")
        )
    };

    let describe = |c: &[Measured; 4]| {
        CELLS
            .iter()
            .zip(c)
            .map(|(&(e, h), m)| {
                format!(
                    "[{} / {}] {}/{} recovered, {} steps, allocator retries {}",
                    if e { "empty" } else { "kept" },
                    if h { "half" } else { "full" },
                    m.recovered,
                    m.ooms,
                    m.steps_completed,
                    m.allocator_retries
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    };
    let eb = effects(&big);
    let any_oom = big.iter().all(|m| m.ooms > 0);
    let setup = format!(
        "{real_where}: {gpt_label}, loader batches {LOADER_BATCHES:?} on {} and {} cards, {real_steps} steps each from a fresh card: {}",
        human_bytes(CARDS[0]),
        human_bytes(CARDS[1]),
        outcomes.join("; ")
    );
    sweep.claim(Claim {
        claim: "calling empty_cache when recovering from a caught OOM (then retrying with half the batch) raises recovery success by 50% (004's table)".into(),
        measured: format!(
            "{setup}. Pooled over the OOMs: {}; empty_cache's effect on the half retry {:+.0} points, on a full retry {:+.0}; {REAL_SIZE_CAVEAT}",
            describe(&big), eb[1], eb[0]
        ),
        verdict: empty_cache_verdict(eb[1], any_oom),
    });
    let (recipe, plain) = (big[3].recovery_rate, big[1].recovery_rate);
    sweep.claim(Claim {
        claim: "catching the OOM and retrying with half the batch recovers the step (004's recovery code)".into(),
        measured: format!(
            "{real_where}: of {} steps that ran out of memory (every card and loader batch above), the half retry recovered {} ({:.0}%), retrying the full batch {} ({:.0}%): half fits only where the loader batch was at most about twice what fits",
            big[3].ooms,
            big[3].recovered,
            100.0 * recipe,
            big[1].recovered,
            100.0 * plain
        ),
        verdict: if !any_oom {
            Verdict::NotApplicable
        } else if big[3].recovered == big[3].ooms {
            Verdict::Holds
        } else if big[3].recovered > 0 {
            Verdict::Partly
        } else {
            Verdict::DoesNotHold
        },
    });
    // The executed part's device sits between the two needs: the half retry recovers by
    // construction. What it checks is the mechanism on the backend, and that live tensors
    // survive.
    let es = effects(&small);
    sweep.check(
        "on a device between the half-batch and the full-batch need (by construction), every step runs out of memory, the OOM is caught and the half retry recovers it",
        format!(
            "{SMALL}: device {} (batch {batch} needs {}, batch {} needs {}), {steps} steps per cell: {}; half retry vs full retry {:+.0} points",
            human_bytes(capacity),
            human_bytes(full),
            batch / 2,
            human_bytes(half),
            describe(&small),
            es[3]
        ),
        small.iter().all(|m| m.ooms == steps) && small[3].recovered == steps && small[2].recovered == steps,
    );
    let intact = small.iter().chain(&big).all(|m| m.live_tensors_intact);
    let leftover = small.iter().chain(&big).map(|m| m.max_leftover_bytes).max().unwrap_or(0);
    sweep.check(
        "after a caught OOM the live tensors are intact and the failed step's memory comes back (vram's error path frees what the step allocated)",
        format!(
            "over {} caught OOMs ({SMALL} and {real_where}): allocated bytes back to their value before the step (largest difference {leftover} B) and (where computed) weights bit-identical every time: {intact}",
            small.iter().chain(&big).map(|m| m.ooms).sum::<usize>()
        ),
        intact,
    );
    let retries = big[2].allocator_retries;
    sweep.reading(format!(
        "{real_where}: on the post's setup ({gpt_label} on 24 and 80 GiB cards, loader batches {LOADER_BATCHES:?}) the half retry recovers {:.0}% of the OOMs with empty_cache and {:.0}% without: empty_cache adds {:+.0} points, because the allocator already frees its cache and retries before it raises OOM ({retries} such retries in the runs without empty_cache). Halving recovers only a batch at most about twice what fits; a loader batch 4x too big needs a halving loop (or gradient accumulation).",
        100.0 * big[3].recovery_rate,
        100.0 * big[2].recovery_rate,
        eb[1]
    ));
    Ok(sweep)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn effects_are_differences_of_cells() {
        let rate = |r: f64| Measured { recovery_rate: r, ..Measured::default() };
        let cells = [rate(0.0), rate(0.25), rate(1.0), rate(1.0)];
        assert_eq!(effects(&cells), [25.0, 0.0, 100.0, 75.0, 100.0]);
    }

    #[test]
    fn pooled_rates_count_only_the_runs_that_ran_out_of_memory() {
        let run = |ooms: usize, recovered: [usize; 4]| {
            let mut r = [Measured::default(); 4];
            for (k, m) in r.iter_mut().enumerate() {
                *m = Measured { ooms, recovered: recovered[k], live_tensors_intact: true, ..*m };
            }
            r
        };
        // A batch that fits (no OOM) does not count; one half retry fails, one recovers.
        let p = pooled(&[run(0, [0; 4]), run(2, [0, 0, 2, 2]), run(2, [0, 0, 0, 0])]);
        assert_eq!(p.map(|m| m.ooms), [4; 4]);
        assert_eq!(p.map(|m| m.recovery_rate), [0.0, 0.0, 0.5, 0.5]);
        assert_eq!(p.map(|m| (m.empty_cache, m.half_batch)), CELLS);
        // empty_cache's effect on the half retry: 0 points here, so "+50%" does not hold.
        assert_eq!(effects(&p)[1], 0.0);
        assert_eq!(empty_cache_verdict(effects(&p)[1], true), Verdict::DoesNotHold);
        assert_eq!(empty_cache_verdict(50.0, true), Verdict::Holds);
        assert_eq!(empty_cache_verdict(10.0, true), Verdict::Partly);
        assert_eq!(empty_cache_verdict(50.0, false), Verdict::NotApplicable);
        // Nothing ran out of memory: every rate is 1.
        assert_eq!(pooled(&[run(0, [0; 4])]).map(|m| m.recovery_rate), [1.0; 4]);
    }
}
