//! `monitoring`: a training run's memory timeline (rebuilt from the allocator's trace), the
//! summary table, device-level used memory next to the allocator's own figure, and what
//! makes the peak.
//!
//! The steps run layer by layer with a mark before each phase (each layer's forward, the
//! loss, each layer's backward, the optimizer step), as PyTorch's module hooks or
//! `record_function` ranges would give a profiler. Two instruments then say where the peak
//! is, independently: `max_memory_allocated` read at every mark (the phase after which it
//! last rose), and the trace replayed to the peak event (the phase of that event). The
//! blocks alive at that event, each attributed to the phase that allocated it, say what
//! makes the peak; they must add up to `max_memory_allocated`.

use super::common::{device, gpt, small_gpt_tag, timed_steps};
use super::{Experiment, Sweep};
use crate::models::Model;
use crate::plots::{MIB, Mark, lines_with_marks};
use crate::techniques::Technique;
use crate::trainer::adamw;
use crate::{Claim, Context, ExperimentError, Verdict, human_bytes};
use serde::Serialize;
use serde_json::json;
use std::collections::HashMap;
use vram_accum::{ForwardCtx, Mode};
use vram_alloc::TraceAction;
use vram_amp::Optimizer;
use vram_kernels::{DType, Device};

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
    expected_secs: [0.1, 0.9],
};

/// The training run's timeline and figures.
#[derive(Serialize)]
pub(super) struct Measured {
    /// Allocated and reserved bytes, each point the maximum of its window of events.
    timeline_allocated_reserved: Vec<[i64; 2]>,
    timeline_events_per_point: usize,
    /// When each timeline point's last event happened, in ms since the run's first event
    /// (the trace's `time_us`).
    timeline_ms: Vec<f64>,
    step_starts_event_index: Vec<usize>,
    /// When each step started, in ms since the run's first event.
    step_starts_ms: Vec<f64>,
    peak_event_index: usize,
    /// When the peak happened, in ms since the run's first event.
    peak_ms: f64,
    /// The phase the trace puts the peak in, and the one `max_memory_allocated` does.
    peak_phase_from_trace: String,
    peak_phase_from_counter: String,
    /// Bytes alive at the peak by the phase that allocated them, largest first.
    live_at_peak_by_phase: Vec<(String, u64)>,
    largest_live_tensor_bytes: u64,
    largest_live_tensor_phase: String,
    device_used_bytes: u64,
    reserved_bytes: u64,
    memory_summary: String,
}

/// At most this many timeline points are kept (each the maximum of its window).
const POINTS: usize = 400;

/// What the cuBLAS workspace is called among the blocks alive at the peak.
const WORKSPACE: &str = "cuBLAS workspace (kept from the first matrix product on)";

/// The phase of the run: where it starts in the trace and its label.
struct Phase {
    start: usize,
    label: String,
}

/// The phase containing trace event `index`.
fn phase_of(phases: &[Phase], index: usize) -> &str {
    let k = phases.partition_point(|p| p.start <= index).saturating_sub(1);
    phases.get(k).map_or("?", |p| p.label.as_str())
}

/// A phase label without its step, for grouping what earlier steps left alive.
fn kind_of(label: &str) -> String {
    match label.split_once(": ") {
        Some((_, rest)) if rest.starts_with("optimizer") => "optimizer steps".into(),
        _ => label.to_string(),
    }
}

fn run(ctx: &Context) -> Result<Sweep<Measured>, ExperimentError> {
    let (arch, data) = gpt(ctx);
    let (warmup, timed) = timed_steps(ctx);
    let dev = device(ctx, "")?;
    measure(ctx, &dev, arch, data, warmup + timed)
}

/// Trains `steps` steps of `arch` on `dev`, recording the allocator's trace, and reads the
/// peak from it.
fn measure(
    ctx: &Context,
    dev: &Device,
    arch: crate::models::Arch,
    data: crate::data::Dataset,
    steps: usize,
) -> Result<Sweep<Measured>, ExperimentError> {
    let batch = 8;
    let run_name =
        format!("{} training run, batch {batch} (executed)", small_gpt_tag(ctx, "fp32 + AdamW"));
    dev.record_history(Some(1 << 22));
    let mut phases = vec![Phase { start: 0, label: "building the model".into() }];
    // max_memory_allocated at the start of each phase, and at the end.
    let mut counter = vec![0u64];
    let mut model = Model::new(dev, arch.clone(), ctx.seed, DType::F32)?;
    let mut opt = adamw(1e-3);
    let mut step_starts = Vec::new();
    // What a user who prints memory_allocated() after every step sees.
    let mut between_steps = Vec::new();
    for step in 0..steps {
        between_steps.push(dev.memory_allocated());
        let mut enter = |label: String| {
            phases.push(Phase { start: dev.trace_len(), label });
            counter.push(dev.max_memory_allocated());
        };
        step_starts.push(dev.trace_len());
        enter(format!("step {}: input batch", step + 1));
        let mut fctx = ForwardCtx::new(Mode::Train, step as u64);
        let b = data.batch(ctx.seed, step as u64, batch);
        model
            .train_step_marked(&b, &mut fctx, &mut |p| enter(format!("step {}: {p}", step + 1)))?;
        enter(format!("step {}: optimizer step", step + 1));
        opt.step(&mut model)?;
        enter(format!("step {}: zero_grad", step + 1));
        model.zero_grad();
    }
    counter.push(dev.max_memory_allocated());
    between_steps.push(dev.memory_allocated());
    let trace = dev.trace();
    dev.record_history(None);
    // Replay the trace into running totals, keeping the blocks alive at the peak.
    let (mut allocated, mut reserved) = (0i64, 0i64);
    let mut series = Vec::with_capacity(trace.len());
    let mut live: HashMap<u64, (u64, usize)> = HashMap::new();
    let (mut peak, mut peak_index, mut at_peak) = (0i64, 0usize, HashMap::new());
    for (i, e) in trace.iter().enumerate() {
        match e.action {
            TraceAction::Alloc => {
                allocated += e.size as i64;
                live.insert(e.addr, (e.size as u64, i));
            }
            TraceAction::FreeRequested => {
                allocated -= e.size as i64;
                live.remove(&e.addr);
            }
            TraceAction::SegmentAlloc | TraceAction::SegmentMap => reserved += e.size as i64,
            TraceAction::SegmentFree | TraceAction::SegmentUnmap => reserved -= e.size as i64,
            _ => {}
        }
        if allocated > peak {
            (peak, peak_index) = (allocated, i);
            at_peak.clone_from(&live);
        }
        series.push((allocated, reserved));
    }
    let peak_step = step_starts.iter().rposition(|&s| s <= peak_index).unwrap_or(0);
    let from_trace = phase_of(&phases, peak_index).to_string();
    // The counter: the last phase during which max_memory_allocated rose.
    let from_counter = (0..phases.len())
        .rev()
        .find(|&k| counter[k + 1] > counter[k])
        .map_or("?".to_string(), |k| phases[k].label.clone());
    // The cuBLAS workspace is a block of the cache too, allocated at the first matrix
    // product (in the first step's forward) and kept: named as what it is, not as a tensor of
    // the phase that happened to allocate it.
    let workspace = dev.blas_workspace_block().map(|(addr, _)| addr);
    let mut groups: HashMap<String, u64> = HashMap::new();
    for (addr, &(size, index)) in &at_peak {
        let kind = if Some(*addr) == workspace {
            WORKSPACE.to_string()
        } else {
            kind_of(phase_of(&phases, index))
        };
        *groups.entry(kind).or_default() += size;
    }
    let mut by_phase: Vec<(String, u64)> = groups.into_iter().collect();
    by_phase.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let live_sum: u64 = at_peak.values().map(|v| v.0).sum();
    let (largest_bytes, largest_phase) = at_peak
        .iter()
        .filter(|(addr, _)| Some(**addr) != workspace)
        .map(|(_, v)| v)
        .max_by_key(|v| (v.0, std::cmp::Reverse(v.1)))
        .map_or((0, "?".to_string()), |&(size, index)| {
            (size, phase_of(&phases, index).to_string())
        });

    let window = series.len().div_ceil(POINTS).max(1);
    let t0 = trace.first().map_or(0, |e| e.time_us);
    let ms_at = |i: usize| {
        trace
            .get(i.min(trace.len().saturating_sub(1)))
            .map_or(0.0, |e| e.time_us.saturating_sub(t0) as f64 / 1e3)
    };
    let timeline_ms: Vec<f64> = (0..series.len())
        .step_by(window)
        .map(|i| ms_at((i + window - 1).min(series.len() - 1)))
        .collect();
    let step_starts_ms: Vec<f64> = step_starts.iter().map(|&i| ms_at(i)).collect();
    let peak_ms = ms_at(peak_index);
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
    let max_allocated = dev.max_memory_allocated();
    let top: Vec<String> = by_phase
        .iter()
        .take(4)
        .map(|(label, bytes)| format!("{label} {}", human_bytes(*bytes)))
        .collect();
    let measured = Measured {
        timeline_allocated_reserved: timeline,
        timeline_events_per_point: window,
        timeline_ms,
        step_starts_event_index: step_starts,
        step_starts_ms,
        peak_event_index: peak_index,
        peak_ms,
        peak_phase_from_trace: from_trace.clone(),
        peak_phase_from_counter: from_counter.clone(),
        live_at_peak_by_phase: by_phase.clone(),
        largest_live_tensor_bytes: largest_bytes,
        largest_live_tensor_phase: largest_phase.clone(),
        device_used_bytes: device_used,
        reserved_bytes: dev.memory_reserved(),
        memory_summary: dev.memory_summary(),
    };
    sweep.push(&run_name, max_allocated, dev.max_memory_reserved(), None, measured);
    let same_phase = from_trace == from_counter;
    let adds_up = live_sum == max_allocated && peak as u64 == max_allocated;
    // The post's tools as people use them: memory_allocated() printed between steps, and
    // memory_summary()'s peak (max_memory_allocated). Between steps the activations are gone:
    // whether such a reading shows the bottleneck depends on where the peak falls.
    let seen = between_steps.iter().copied().max().unwrap_or(0);
    let share = seen as f64 / max_allocated.max(1) as f64;
    sweep.claim(Claim {
        claim: "memory_allocated / memory_reserved / memory_summary find the bottleneck".into(),
        measured: format!(
            "memory_allocated() printed between steps shows at most {} ({:.0}% of the peak {}); memory_summary() and max_memory_allocated() give the peak's size ({}) but not what makes it; the allocator's trace (torch.cuda.memory._record_memory_history) puts it in \"{from_trace}\", mostly {}",
            human_bytes(seen),
            100.0 * share,
            human_bytes(max_allocated),
            human_bytes(max_allocated),
            top.iter().take(2).cloned().collect::<Vec<_>>().join(" and ")
        ),
        verdict: if share >= 0.9 { Verdict::Holds } else { Verdict::Partly },
    });
    // The trace and the counter are two views of the same allocations.
    sweep.check(
        "the allocator's trace and max_memory_allocated agree on the peak: its size, its phase, and the blocks alive then",
        format!(
            "peak {} allocated in step {} of {steps}: the trace puts it in \"{from_trace}\", max_memory_allocated read at every phase in \"{from_counter}\"; the {} blocks alive then add up to {} (max_memory_allocated {}); by the phase that allocated them: {}; largest tensor {} from \"{largest_phase}\"",
            human_bytes(peak as u64), peak_step + 1, at_peak.len(), human_bytes(live_sum), human_bytes(max_allocated), top.join(", "), human_bytes(largest_bytes)
        ),
        same_phase && adds_up,
    );
    sweep.reading(format!(
        "the peak ({} in step {} of {steps}) comes in the {}; what is alive then is mostly {}; the device holds {} for this process (reserved, what nvidia-smi shows beyond the CUDA context)",
        human_bytes(peak as u64),
        peak_step + 1,
        from_trace.split_once(": ").map_or(from_trace.as_str(), |(_, p)| p),
        top.iter().take(2).cloned().collect::<Vec<_>>().join(" and "),
        human_bytes(dev.memory_reserved())
    ));
    Ok(sweep)
}

/// Allocated and reserved memory over the run's allocator events, with the step boundaries
/// and the peak.
fn plot(sweep: &Sweep<Measured>) -> Option<String> {
    let (v, m) = sweep.variants().first()?;
    let at = |i: usize| -> Vec<(f64, f64)> {
        m.timeline_ms
            .iter()
            .zip(&m.timeline_allocated_reserved)
            .map(|(&t, p)| (t, p[i] as f64 / MIB))
            .collect()
    };
    let series = vec![
        ("allocated (max over each point's events)".to_string(), at(0)),
        ("reserved".to_string(), at(1)),
    ];
    let peak = v.peak_allocated_bytes as f64 / MIB;
    let marks = [
        Mark::Vertical("step starts".into(), m.step_starts_ms.clone()),
        Mark::Crosses(format!("peak: {}", m.peak_phase_from_trace), vec![(m.peak_ms, peak)], None),
    ];
    let host = if sweep.backend == "cpu" { " (host timings)" } else { "" };
    lines_with_marks(
        &format!("Memory timeline of {}{host}", v.name),
        "time since the first allocation (ms)",
        "memory (MiB)",
        &series,
        false,
        &marks,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Backend;

    /// With a cuBLAS workspace (a GPU's 32 MiB, given to the host), the blocks alive at the
    /// peak name it as the workspace, and the largest tensor is a tensor.
    #[test]
    fn the_cublas_workspace_is_named_not_taken_for_a_tensor() {
        let ctx = Context { backend: Backend::Cpu, quick: true, seed: 1, device_memory: 1 << 30 };
        let dev = device(&ctx, "").unwrap();
        dev.set_blas_workspace_size(32 << 20);
        let (arch, data) = gpt(&ctx);
        let sweep = measure(&ctx, &dev, arch, data, 2).unwrap();
        let (_, m) = sweep.variants().first().unwrap();
        let workspace = m.live_at_peak_by_phase.iter().find(|(kind, _)| kind == WORKSPACE);
        assert_eq!(workspace.map(|w| w.1), Some(32 << 20), "{:?}", m.live_at_peak_by_phase);
        assert!(m.largest_live_tensor_bytes < 32 << 20, "{}", m.largest_live_tensor_bytes);
        assert!(!m.largest_live_tensor_phase.is_empty());
    }
}
