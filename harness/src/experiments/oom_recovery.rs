//! `oom-recovery`: catch an out-of-memory error and retry the step, as a 2x2 of the recipe's
//! two parts (empty the cache before the retry or not; retry as two half-batches or with the
//! full batch again), on a device sized so that the full batch does not fit but half of it
//! does. Each cell: recovery rate, whether the live tensors survived every caught OOM, steps
//! completed. Two parts: a small MLP executed (weights checked bit for bit), and GPT-2 small (seq 1024) at real
//! size on a virtual device.

use super::common::{device, fingerprint, sized_device};
use super::{Experiment, Sweep};
use crate::data::{Batch, Dataset};
use crate::models::{Arch, Model};
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

fn run(ctx: &Context) -> Result<Sweep<Measured>, ExperimentError> {
    let steps = if ctx.quick { 4 } else { 10 };
    // At 2048 samples the step's largest tensors take 20 MiB segments of their own, at 1024
    // they share 2 MiB ones: the two needs are far enough apart (24 vs 6 MiB) for a device
    // between them. (At 1024 vs 512 they are one 2 MiB segment apart.)
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

    // Real size: GPT-2 small at seq 1024 on a virtual device between the needs of batch 8
    // and batch 16 (each measured by one training step and optimizer step on a roomy one).
    let (big_steps, big_batch) = (if ctx.quick { 2 } else { 4 }, 16);
    let gpt = Arch::preset("gpt2-small")?.with_seq(1024)?;
    let gpt_data = gpt.dataset();
    let need = |n: usize| -> Result<u64, ExperimentError> {
        let dev = Device::virtual_device(80 << 30);
        let mut model = Model::new(&dev, gpt.clone(), ctx.seed, DType::F32)?;
        let probe = |i: u64| gpt_data.batch_without_values(ctx.seed, i, n);
        cell(&dev, &mut model, &probe, n, 1, (false, false), false)?;
        Ok(dev.max_memory_reserved())
    };
    let (big_half, big_full) = (need(big_batch / 2)?, need(big_batch)?);
    let big_capacity = ((big_half + big_full) / 2).next_multiple_of(2 << 20).min(big_full - 1);

    let mut sweep = Sweep::new(
        ctx,
        json!({
            "small (executed)": { "model": format!("{arch:?}"), "batch_size": batch, "device_capacity": capacity, "steps": steps },
            "real size (virtual)": { "model": "gpt2-small, seq 1024, f32, AdamW", "batch_size": big_batch, "device_capacity": big_capacity, "steps": big_steps },
        }),
    );
    let mut small = [Measured::default(); 4];
    for (k, policy) in CELLS.into_iter().enumerate() {
        let dev = sized_device(ctx, capacity)?;
        let mut model = Model::new(&dev, arch.clone(), ctx.seed, DType::F32)?;
        let batches = |i: u64| data.batch(ctx.seed, i, batch);
        small[k] = cell(&dev, &mut model, &batches, batch, steps, policy, true)?;
        let name = cell_name("small (executed)", policy);
        sweep.push(&name, dev.max_memory_allocated(), dev.max_memory_reserved(), None, small[k]);
    }
    let mut big = [Measured::default(); 4];
    for (k, policy) in CELLS.into_iter().enumerate() {
        let dev = Device::virtual_device(big_capacity);
        let mut model = Model::new(&dev, gpt.clone(), ctx.seed, DType::F32)?;
        let batches = |i: u64| gpt_data.batch_without_values(ctx.seed, i, big_batch);
        big[k] = cell(&dev, &mut model, &batches, big_batch, big_steps, policy, false)?;
        let name = cell_name("real size (virtual)", policy);
        sweep.push(&name, dev.max_memory_allocated(), dev.max_memory_reserved(), None, big[k]);
    }

    let describe = |c: &[Measured; 4]| {
        CELLS
            .iter()
            .zip(c)
            .map(|(&(e, h), m)| {
                format!(
                    "[{} / {}] {}/{} recovered, {} steps, intact {}, allocator retries {}",
                    if e { "empty" } else { "kept" },
                    if h { "half" } else { "full" },
                    m.recovered,
                    m.ooms,
                    m.steps_completed,
                    m.live_tensors_intact,
                    m.allocator_retries
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    };
    let (es, eb) = (effects(&small), effects(&big));
    let any_oom = small.iter().chain(&big).all(|m| m.ooms > 0);
    sweep.claim(Claim {
        claim: "catching OOM, emptying the cache and retrying with half the batch raises recovery success by 50 points or more over a plain retry".into(),
        measured: format!(
            "small: device {} (batch {batch} needs {}, batch {} needs {}), {steps} steps: {}; recipe vs plain retry {:+.0} points. Real size (GPT-2 small, seq 1024; leaves out the CUDA context and cuDNN/cuBLAS workspaces beyond the first): device {} (batch {big_batch} needs {}, batch {} needs {}), {big_steps} steps: {}; {:+.0} points",
            human_bytes(capacity), human_bytes(full), batch / 2, human_bytes(half), describe(&small), es[4],
            human_bytes(big_capacity), human_bytes(big_full), big_batch / 2, human_bytes(big_half), describe(&big), eb[4],
        ),
        verdict: if !any_oom {
            Verdict::NotApplicable
        } else if es[4] >= 50.0 && eb[4] >= 50.0 {
            Verdict::Holds
        } else if es[4] > 0.0 || eb[4] > 0.0 {
            Verdict::Partly
        } else {
            Verdict::DoesNotHold
        },
    });
    let empty_gain = es[0].max(es[1]).max(eb[0]).max(eb[1]);
    sweep.claim(Claim {
        claim: "emptying the cache is part of what recovers (the recipe's first half)".into(),
        measured: format!(
            "empty_cache's effect on the recovery rate: small {:+.0} points with a full retry, {:+.0} with a half retry; real size {:+.0} / {:+.0}. The half batch's effect: small {:+.0} / {:+.0} points (cache kept / emptied), real size {:+.0} / {:+.0}",
            es[0], es[1], eb[0], eb[1], es[2], es[3], eb[2], eb[3]
        ),
        verdict: if !any_oom {
            Verdict::NotApplicable
        } else if empty_gain > 0.0 {
            Verdict::Holds
        } else {
            Verdict::DoesNotHold
        },
    });
    let intact = small.iter().chain(&big).all(|m| m.live_tensors_intact);
    sweep.claim(Claim {
        claim: "after a caught OOM the live tensors are intact and the failed step's memory comes back".into(),
        measured: format!(
            "over {} caught OOMs in 8 cells: allocated bytes back to their value before the step and (small part) weights bit-identical every time: {intact}",
            small.iter().chain(&big).map(|m| m.ooms).sum::<usize>()
        ),
        verdict: if !any_oom {
            Verdict::NotApplicable
        } else if intact {
            Verdict::Holds
        } else {
            Verdict::DoesNotHold
        },
    });
    let retries = small[2].allocator_retries + big[2].allocator_retries;
    sweep.reading(format!(
        "Retrying with half the batch is what recovers ({:+.0} / {:+.0} points, small / real size); empty_cache before the retry changes the rate by {:+.0} / {:+.0} points, because the allocator already frees its cache and retries before it raises OOM ({retries} such retries without empty_cache): catch the OOM, drop the failed step's tensors, and retry smaller.",
        es[2], eb[2], es[1], eb[1]
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
}
