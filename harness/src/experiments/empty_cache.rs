//! `empty-cache`: what returning cached blocks does to reserved memory, what calling it
//! never / every N / every batch costs, and whether a second task needs it.

use super::common::{cnn, cnn_side, device, median, stripes, sync};
use super::{Sweep, multi_task};
use crate::models::Model;
use crate::optim::Optimizer;
use crate::{Claim, Context, ExperimentResult, Verdict, human_bytes};
use serde_json::json;
use std::time::Instant;
use vram_accum::{ForwardCtx, Mode};
use vram_kernels::DType;

const EVERY_N: usize = 10;

pub fn run(ctx: &Context) -> Result<ExperimentResult, String> {
    let steps = if ctx.quick { 12 } else { 40 };
    let (side, batch) = (cnn_side(ctx), 16);
    let data = stripes(side);
    let arch = cnn(ctx, false);
    let mut sweep = Sweep::new(
        ctx,
        "empty-cache",
        json!({ "model": format!("{arch:?}"), "steps": steps, "batch_size": batch, "every_n": EVERY_N }),
    );
    let mut runs = Vec::new();
    for (name, every) in
        [("never", None), ("every 10 batches", Some(EVERY_N)), ("every batch", Some(1))]
    {
        let dev = device(ctx, "")?;
        let mut model =
            Model::new(&dev, arch.clone(), ctx.seed, DType::F32).map_err(|e| e.to_string())?;
        let mut opt = Optimizer::adamw(1e-3);
        let mut times = Vec::new();
        for step in 0..steps {
            let b = data.batch(ctx.seed, step as u64, batch);
            let started = Instant::now();
            let mut fctx = ForwardCtx::new(Mode::Train, step as u64);
            model.train_step(&b, &mut fctx, 1.0).map_err(|e| e.to_string())?;
            opt.step(model.params_mut()).map_err(|e| e.to_string())?;
            model.zero_grad();
            if every.is_some_and(|n| (step + 1) % n == 0) {
                dev.empty_cache();
            }
            sync(&dev)?;
            if step > 0 {
                times.push(started.elapsed().as_secs_f64() * 1e3);
            }
        }
        let (allocated, reserved) = (dev.memory_allocated(), dev.memory_reserved());
        dev.empty_cache();
        let reserved_after = dev.memory_reserved();
        let step_ms = median(&mut times);
        let mut v = sweep.variant(
            &format!("empty_cache {name}"),
            dev.max_memory_allocated(),
            dev.max_memory_reserved(),
            Some(step_ms),
        );
        v.extra.insert("allocated_at_end".into(), json!(allocated));
        v.extra.insert("reserved_at_end".into(), json!(reserved));
        v.extra.insert("reserved_after_empty_cache".into(), json!(reserved_after));
        v.extra.insert("device_allocs".into(), json!(dev.memory_stats().num_device_alloc));
        sweep.push(v);
        runs.push((
            step_ms,
            allocated,
            reserved,
            reserved_after,
            dev.memory_stats().num_device_alloc,
        ));
    }
    let never = runs[0];
    let cached_before = never.2 - never.1;
    let cached_after = never.3.saturating_sub(never.1);
    sweep.claim(Claim {
        claim: "empty_cache returns cached (reserved but unallocated) memory to the device".into(),
        measured: format!(
            "after training: {} allocated, {} reserved ({} cached); after empty_cache: {} reserved ({} cached)",
            human_bytes(never.1), human_bytes(never.2), human_bytes(cached_before), human_bytes(never.3), human_bytes(cached_after)
        ),
        verdict: if cached_after * 10 <= cached_before { Verdict::Holds } else { Verdict::DoesNotHold },
    });
    let slow = |r: (f64, u64, u64, u64, u64)| 100.0 * (r.0 / never.0 - 1.0);
    let (every_n, every_batch) = (slow(runs[1]), slow(runs[2]));
    // As claimed: every batch within 5-10%, every N under 5%.
    let verdict = match ((5.0..=10.0).contains(&every_batch), every_n < 5.0) {
        (true, true) => Verdict::Holds,
        (false, false) => Verdict::DoesNotHold,
        _ => Verdict::Partly,
    };
    sweep.claim(Claim {
        claim: "calling empty_cache every batch costs 5-10% speed, every N batches under 5%".into(),
        measured: format!(
            "median step {:.2} ms never, {:.2} ms every {EVERY_N} ({every_n:+.1}%), {:.2} ms every batch ({every_batch:+.1}%); device allocations {} / {} / {} (host timings)",
            never.0, runs[1].0, runs[2].0, never.4, runs[1].4, runs[2].4
        ),
        verdict,
    });
    let kept = multi_task::two_model_scenario(ctx, false)?;
    let emptied = multi_task::two_model_scenario(ctx, true)?;
    sweep.claim(multi_task::claim(&kept, &emptied));
    Ok(sweep.finish())
}
