//! `monitoring`: a training run's memory timeline (rebuilt from the allocator's trace), the
//! summary table, and device-level used memory next to the allocator's own figure.

use super::Sweep;
use super::common::{device, gpt, timed_steps};
use crate::models::Model;
use crate::optim::Optimizer;
use crate::{Claim, Context, ExperimentResult, Verdict, human_bytes};
use serde_json::json;
use vram_accum::{ForwardCtx, Mode};
use vram_alloc::TraceAction;
use vram_kernels::DType;

/// At most this many timeline points are kept (each the maximum of its window).
const POINTS: usize = 400;

pub fn run(ctx: &Context) -> Result<ExperimentResult, String> {
    let (arch, data) = gpt(ctx);
    let batch = 8;
    let (warmup, timed) = timed_steps(ctx);
    let steps = warmup + timed;
    let dev = device(ctx, "")?;
    dev.record_history(Some(1 << 22));
    let mut model =
        Model::new(&dev, arch.clone(), ctx.seed, DType::F32).map_err(|e| e.to_string())?;
    let mut opt = Optimizer::adamw(1e-3);
    let mut step_starts = Vec::new();
    for step in 0..steps {
        step_starts.push(dev.trace().len());
        let mut fctx = ForwardCtx::new(Mode::Train, step as u64);
        model
            .train_step(&data.batch(ctx.seed, step as u64, batch), &mut fctx, 1.0)
            .map_err(|e| e.to_string())?;
        opt.step(model.params_mut()).map_err(|e| e.to_string())?;
        model.zero_grad();
    }
    let trace = dev.trace();
    dev.record_history(None);
    // Replay the trace into running totals.
    let (mut allocated, mut reserved) = (0i64, 0i64);
    let mut series = Vec::with_capacity(trace.len());
    for e in &trace {
        match e.action {
            TraceAction::Alloc => allocated += e.size as i64,
            TraceAction::FreeRequested => allocated -= e.size as i64,
            TraceAction::SegmentAlloc | TraceAction::SegmentMap => reserved += e.size as i64,
            TraceAction::SegmentFree | TraceAction::SegmentUnmap => reserved -= e.size as i64,
            _ => {}
        }
        series.push((allocated, reserved));
    }
    let (peak_index, peak) = series
        .iter()
        .enumerate()
        .map(|(i, &(a, _))| (i, a))
        .max_by_key(|&(_, a)| a)
        .unwrap_or((0, 0));
    let peak_step = step_starts.iter().rposition(|&s| s <= peak_index).unwrap_or(0);
    let window = series.len().div_ceil(POINTS).max(1);
    let timeline: Vec<[i64; 2]> = series
        .chunks(window)
        .map(|c| {
            [c.iter().map(|p| p.0).max().unwrap_or(0), c.iter().map(|p| p.1).max().unwrap_or(0)]
        })
        .collect();
    let info = dev.mem_info();
    let device_used = info.total - info.free;
    let mut sweep = Sweep::new(
        ctx,
        "monitoring",
        json!({ "model": format!("{arch:?}"), "steps": steps, "batch_size": batch }),
    );
    let mut v = sweep.variant(
        "GPT training run",
        dev.max_memory_allocated(),
        dev.max_memory_reserved(),
        None,
    );
    v.extra.insert("timeline_allocated_reserved".into(), json!(timeline));
    v.extra.insert("timeline_events_per_point".into(), json!(window));
    v.extra.insert("step_starts_event_index".into(), json!(step_starts));
    v.extra.insert("device_used_bytes".into(), json!(device_used));
    v.extra.insert("reserved_bytes".into(), json!(dev.memory_reserved()));
    v.extra.insert("memory_summary".into(), json!(dev.memory_summary()));
    sweep.push(v);
    let consistent =
        peak as u64 == dev.max_memory_allocated() && device_used == dev.memory_reserved();
    sweep.claim(Claim {
        claim: "memory_allocated / memory_reserved / max_memory_allocated / memory_summary / device-level used memory find the bottleneck".into(),
        measured: format!(
            "timeline of {} events: peak {} allocated in step {} of {steps} (max_memory_allocated {}); device-level used {} vs reserved {}",
            trace.len(), human_bytes(peak as u64), peak_step + 1, human_bytes(dev.max_memory_allocated()), human_bytes(device_used), human_bytes(dev.memory_reserved())
        ),
        verdict: if consistent { Verdict::Holds } else { Verdict::Partly },
    });
    Ok(sweep.finish())
}
