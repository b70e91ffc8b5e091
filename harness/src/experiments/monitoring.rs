//! `monitoring`: a training run's memory timeline (rebuilt from the allocator's trace), the
//! summary table, and device-level used memory next to the allocator's own figure.

use super::common::{device, gpt, timed_steps};
use super::{Experiment, Sweep};
use crate::models::Model;
use crate::plots::{MIB, lines};
use crate::techniques::Technique;
use crate::trainer::adamw;
use crate::{Claim, Context, ExperimentError, Verdict, human_bytes};
use serde::Serialize;
use serde_json::json;
use vram_accum::{ForwardCtx, Mode};
use vram_alloc::TraceAction;
use vram_amp::Optimizer;
use vram_kernels::DType;

pub(super) static EXPERIMENT: Experiment<Measured> = Experiment {
    technique: Technique {
        id: "monitoring",
        name: "memory monitoring",
        claim: "memory_allocated / memory_reserved / memory_summary find the bottleneck",
        source: "002_07a140921eef9482.txt, 004_4a0e2eb70881fd56.txt",
    },
    run,
    plot: Some(plot),
    host_capacity_limit: None,
    expected_secs: [0.2, 0.6],
};

/// The training run's timeline and figures.
#[derive(Serialize)]
pub(super) struct Measured {
    /// Allocated and reserved bytes, each point the maximum of its window of events.
    timeline_allocated_reserved: Vec<[i64; 2]>,
    timeline_events_per_point: usize,
    step_starts_event_index: Vec<usize>,
    device_used_bytes: u64,
    reserved_bytes: u64,
    memory_summary: String,
}

/// At most this many timeline points are kept (each the maximum of its window).
const POINTS: usize = 400;

fn run(ctx: &Context) -> Result<Sweep<Measured>, ExperimentError> {
    let (arch, data) = gpt(ctx);
    let batch = 8;
    let (warmup, timed) = timed_steps(ctx);
    let steps = warmup + timed;
    let dev = device(ctx, "")?;
    dev.record_history(Some(1 << 22));
    let mut model = Model::new(&dev, arch.clone(), ctx.seed, DType::F32)?;
    let mut opt = adamw(1e-3);
    let mut step_starts = Vec::new();
    for step in 0..steps {
        step_starts.push(dev.trace().len());
        let mut fctx = ForwardCtx::new(Mode::Train, step as u64);
        model.train_step(&data.batch(ctx.seed, step as u64, batch), &mut fctx, 1.0)?;
        opt.step(&mut model)?;
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
        json!({ "model": format!("{arch:?}"), "steps": steps, "batch_size": batch }),
    );
    let measured = Measured {
        timeline_allocated_reserved: timeline,
        timeline_events_per_point: window,
        step_starts_event_index: step_starts,
        device_used_bytes: device_used,
        reserved_bytes: dev.memory_reserved(),
        memory_summary: dev.memory_summary(),
    };
    let (max_allocated, max_reserved) = (dev.max_memory_allocated(), dev.max_memory_reserved());
    sweep.push("GPT training run", max_allocated, max_reserved, None, measured);
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
    sweep.reading(format!(
        "the timeline shows where the peak is (step {} of {steps}, {} allocated) and that the device holds {} for this process (reserved, what nvidia-smi would show beyond the CUDA context); the layer that makes the peak is not yet singled out",
        peak_step + 1,
        human_bytes(peak as u64),
        human_bytes(dev.memory_reserved())
    ));
    Ok(sweep)
}

/// Allocated and reserved memory over the run's allocator events.
fn plot(sweep: &Sweep<Measured>) -> Option<String> {
    let (_, m) = sweep.variants().first()?;
    let per = m.timeline_events_per_point as f64;
    let at = |i: usize| -> Vec<(f64, f64)> {
        m.timeline_allocated_reserved
            .iter()
            .enumerate()
            .map(|(n, p)| (n as f64 * per, p[i] as f64 / MIB))
            .collect()
    };
    let series = vec![("allocated".to_string(), at(0)), ("reserved".to_string(), at(1))];
    lines("Memory timeline of a training run", "allocator event", "MiB", &series, false)
}
