//! `release-references`: what holding on to tensors across iterations costs, in the loops
//! people write.
//!
//! Training loops (forward, backward, AdamW step per iteration) on the small GPT, executed:
//! - `losses.append(loss)`: the loss tensor is kept. Backward has already freed its graph
//!   (`retain_graph=False`), so what stays is the loss itself: a 0-d f32 tensor, one 512-byte
//!   block per iteration. vram returns the loss to the host, so this loop keeps the tensor
//!   PyTorch's `loss` is, a 4-byte device tensor, per iteration.
//! - `losses.append(loss.item())`: only a number is kept.
//! - a validation forward in the loop without `torch.no_grad()` whose loss is kept
//!   (`val_losses.append(val_loss)`): each keeps its whole graph, the activations backward
//!   would need.
//!
//! Inference loops (`with torch.no_grad(): out = model(x)`), the source's `del out` snippet:
//! without `del`, the previous iteration's output is alive while the next forward runs
//! (Python rebinds `out` only after the call returns); with it, it is not. Run executed and at
//! real size (GPT-2 small, whose logits are `batch x 1024 x 50257` floats) on the virtual
//! device.
//!
//! A leak detector reads the allocated bytes after each iteration: after the first (which
//! creates the optimizer state), a line with positive slope that explains the series.

use super::common::{
    EXECUTED, REAL_CAPACITY, REAL_SIZE_CAVEAT, device, fit_line, gpt, real_model, real_tag,
    small_gpt_tag,
};
use super::{Experiment, Sweep};
use crate::models::{Arch, Model};
use crate::plan::ModelOverrides;
use crate::plots::{MIB, lines};
use crate::techniques::Technique;
use crate::trainer::adamw;
use crate::{Backend, Claim, Context, ExperimentError, Verdict, human_bytes};
use serde::Serialize;
use serde_json::json;
use vram_accum::{ForwardCtx, Mode};
use vram_amp::Optimizer;
use vram_kernels::{DType, Device, Tensor};

pub(super) static EXPERIMENT: Experiment<Measured> = Experiment {
    technique: Technique {
        id: "release-references",
        name: "dropping references (del)",
        claim: "one del can save you; leaks show as steadily growing memory",
        source: "000_cc24938f7d0f0079.txt, 001_eb115694b312c654.txt (loss.item()), 003_9fc4b5f809544d8d.txt (del out)",
    },
    run,
    plot: Some(plot),
    host_capacity_limit: None,
    expected_secs: [0.5, 5.1],
};

/// One loop's measurements.
#[derive(Serialize)]
pub(super) struct Measured {
    part: &'static str,
    /// Allocated bytes after each iteration.
    allocated_per_iteration: Vec<u64>,
    /// Fitted growth after the first iteration, bytes per iteration.
    growth_bytes_per_iteration: f64,
    leak_flagged: bool,
    /// Whether this loop keeps something on purpose (what the detector should flag).
    keeps_references: bool,
}

const SMALL: &str = "small (executed)";
const REAL: &str = super::common::REAL_VIRTUAL;

/// Flags steady growth after the first iteration: a positive fitted slope that explains the
/// series (r^2 > 0.9), however small.
fn leaking(series: &[u64]) -> (bool, f64) {
    let tail = series.get(1..).unwrap_or_default();
    if tail.len() < 3 {
        return (false, 0.0);
    }
    let xs: Vec<f64> = (0..tail.len()).map(|i| i as f64).collect();
    let ys: Vec<f64> = tail.iter().map(|&v| v as f64).collect();
    let (_, slope, r2) = fit_line(&xs, &ys);
    let grows = tail.windows(2).any(|w| w[1] > w[0]);
    (grows && slope > 0.0 && r2 > 0.9, slope)
}

/// The loops.
#[derive(Clone, Copy, PartialEq)]
enum Loop {
    AppendLoss,
    AppendItem,
    ValidationKeepsGraph,
    InferNoDel,
    InferDel,
}

impl Loop {
    fn name(self) -> &'static str {
        match self {
            Loop::AppendLoss => "train: losses.append(loss)",
            Loop::AppendItem => "train: losses.append(loss.item())",
            Loop::ValidationKeepsGraph => "train + validation without no_grad, val loss kept",
            Loop::InferNoDel => "no_grad inference: out = model(x)",
            Loop::InferDel => "no_grad inference: out = model(x); del out",
        }
    }

    fn keeps(self) -> bool {
        matches!(self, Loop::AppendLoss | Loop::ValidationKeepsGraph)
    }
}

/// Runs `kind` for `iterations` on a fresh model on `dev`; the allocated bytes after each.
fn run_loop(
    kind: Loop,
    dev: &Device,
    arch: &Arch,
    seed: u64,
    batch: usize,
    iterations: usize,
) -> Result<Vec<u64>, ExperimentError> {
    let data = arch.dataset();
    let get = |i: usize| {
        if dev.is_virtual() {
            data.batch_without_values(seed, i as u64, batch)
        } else {
            data.batch(seed, i as u64, batch)
        }
    };
    let mut model = Model::new(dev, arch.clone(), seed, DType::F32)?;
    let mut opt = adamw(1e-3);
    let mut kept_losses: Vec<Tensor> = Vec::new();
    let mut numbers: Vec<f32> = Vec::new();
    let mut graphs = Vec::new();
    let mut out: Option<Tensor> = None;
    let mut allocated = Vec::with_capacity(iterations);
    for i in 0..iterations {
        match kind {
            Loop::InferNoDel => out = Some(model.infer(&get(i))?),
            Loop::InferDel => drop(model.infer(&get(i))?),
            _ => {
                let mut fctx = ForwardCtx::new(Mode::Train, i as u64);
                let loss = model.train_step(&get(i), &mut fctx, 1.0)?.loss;
                opt.step(&mut model)?;
                model.zero_grad();
                match kind {
                    Loop::AppendLoss => {
                        kept_losses.push(Tensor::from_f32_slice(dev, &[1], &[loss], DType::F32)?)
                    }
                    Loop::ValidationKeepsGraph => {
                        let (val, graph) = model.forward_graph(&get(1000 + i), i as u64)?;
                        numbers.push(val);
                        graphs.push(graph);
                    }
                    _ => numbers.push(loss),
                }
            }
        }
        allocated.push(dev.memory_allocated());
    }
    drop((out, graphs, kept_losses));
    Ok(allocated)
}

fn run(ctx: &Context) -> Result<Sweep<Measured>, ExperimentError> {
    let iterations = if ctx.quick { 8 } else { 20 };
    let batch = 8;
    let (arch, _) = gpt(ctx);
    let real_batch = if ctx.quick { 4 } else { 8 };
    let real = real_model("gpt2-small", &ModelOverrides::default())?;
    let mut sweep = Sweep::new(
        ctx,
        json!({ "model": format!("{arch:?}"), "iterations": iterations, "batch_size": batch,
                "real_size_model": real.name, "real_size_batch": real_batch, "real_size_iterations": 3 }),
    );
    let loops = [
        Loop::AppendLoss,
        Loop::AppendItem,
        Loop::ValidationKeepsGraph,
        Loop::InferNoDel,
        Loop::InferDel,
    ];
    let small_gpt = small_gpt_tag(ctx, "fp32 + AdamW");
    let real_gpt = real_tag(&real, "fp32");
    let mut small = Vec::new();
    for kind in loops {
        let dev = device(ctx, "")?;
        let allocated = run_loop(kind, &dev, &arch, ctx.seed, batch, iterations)?;
        let (flagged, slope) = leaking(&allocated);
        let (peak, reserved) = (dev.max_memory_allocated(), dev.max_memory_reserved());
        sweep.push(
            &format!("{} ({SMALL}, {small_gpt})", kind.name()),
            peak,
            reserved,
            None,
            Measured {
                part: SMALL,
                allocated_per_iteration: allocated,
                growth_bytes_per_iteration: slope,
                leak_flagged: flagged,
                keeps_references: kind.keeps(),
            },
        );
        small.push((kind, flagged, slope, peak));
    }
    // The del snippet at real size: the logits of GPT-2 small are what `out` holds. On the
    // virtual device, and on a GPU executed there too (then the claim quotes the GPU's peaks).
    let mut real_peaks = Vec::new();
    let mut executed_peaks = Vec::new();
    for kind in [Loop::InferNoDel, Loop::InferDel] {
        let mut places = vec![(Device::virtual_device(REAL_CAPACITY), REAL)];
        if matches!(ctx.backend, Backend::Cuda { .. }) {
            places.push((device(ctx, "")?, EXECUTED));
        }
        for (dev, part) in places {
            let allocated = run_loop(kind, &dev, &real.arch, ctx.seed, real_batch, 3)?;
            let (peak, reserved) = (dev.max_memory_allocated(), dev.max_memory_reserved());
            sweep.push(
                &format!("{} ({part}, {real_gpt}, batch {real_batch})", kind.name()),
                peak,
                reserved,
                None,
                Measured {
                    part,
                    allocated_per_iteration: allocated,
                    growth_bytes_per_iteration: 0.0,
                    leak_flagged: false,
                    keeps_references: false,
                },
            );
            if part == REAL { real_peaks.push(peak) } else { executed_peaks.push(peak) }
        }
    }
    // One figure, one source: the GPU's where both loops ran there.
    let real_part = if executed_peaks.len() == 2 {
        real_peaks = executed_peaks;
        EXECUTED
    } else {
        REAL
    };
    let get = |k: Loop| small.iter().find(|s| s.0 == k).copied();
    let (Some(append), Some(item), Some(val), Some(nodel), Some(del)) = (
        get(Loop::AppendLoss),
        get(Loop::AppendItem),
        get(Loop::ValidationKeepsGraph),
        get(Loop::InferNoDel),
        get(Loop::InferDel),
    ) else {
        return Err(ExperimentError::Setup("release-references: a loop did not run".into()));
    };
    let rate = |s: f64| human_bytes(s.max(0.0).round() as u64);
    let right = small.iter().all(|s| s.1 == s.0.keeps());
    sweep.claim(Claim {
        claim: "leaks show as steadily growing memory (and a detector can flag them)".into(),
        measured: format!(
            "growth after the first iteration: losses.append(loss) {} per iteration (flagged {}), loss.item() {} (flagged {}), validation graphs kept {} (flagged {}), inference without / with del {} / {} (flagged {} / {}); the detector flagged exactly the loops that keep references: {right}",
            rate(append.2), append.1, rate(item.2), item.1, rate(val.2), val.1, rate(nodel.2), rate(del.2), nodel.1, del.1
        ),
        verdict: if right { Verdict::Holds } else { Verdict::DoesNotHold },
    });
    let logits_bytes = |b: usize, seq: usize, vocab: usize| (b * seq * vocab * 4) as u64;
    let (real_saving, real_logits) = (
        real_peaks[0].saturating_sub(real_peaks[1]),
        match real.arch {
            Arch::Gpt { seq, vocab, .. } => logits_bytes(real_batch, seq, vocab),
            _ => 0,
        },
    );
    let small_saving = nodel.3.saturating_sub(del.3);
    sweep.claim(Claim {
        claim: "one del can save you: `del out` in a no_grad loop lowers the peak by one output".into(),
        measured: format!(
            "peak without / with del: {SMALL}, {small_gpt}: {} / {} ({} less); {real_part}, {real_gpt} batch {real_batch} (logits {}): {} / {} ({} less); {REAL_SIZE_CAVEAT}",
            human_bytes(nodel.3), human_bytes(del.3), human_bytes(small_saving),
            human_bytes(real_logits), human_bytes(real_peaks[0]), human_bytes(real_peaks[1]), human_bytes(real_saving)
        ),
        verdict: if real_logits > 0 && real_saving >= real_logits && small_saving > 0 {
            Verdict::Holds
        } else if real_saving > 0 || small_saving > 0 {
            Verdict::Partly
        } else {
            Verdict::DoesNotHold
        },
    });
    sweep.reading(format!(
        "in a training loop backward frees the graph, so losses.append(loss) keeps only the loss tensor ({} per iteration, {} after 100,000 steps), while keeping a validation loss computed without no_grad keeps its graph ({} per iteration); in a no_grad loop, del out saves one output from the peak ({} at {real_gpt} batch {real_batch}, {real_part}), which matters when the output is large logits",
        rate(append.2),
        human_bytes((append.2.max(0.0) * 1e5) as u64),
        rate(val.2),
        human_bytes(real_saving)
    ));
    Ok(sweep)
}

/// Allocated memory growth over the iterations of each executed loop.
fn plot(sweep: &Sweep<Measured>) -> Option<String> {
    let series: Vec<(String, Vec<(f64, f64)>)> = sweep
        .variants()
        .iter()
        .filter(|(_, m)| m.part == SMALL)
        .map(|(v, m)| {
            let base = *m.allocated_per_iteration.first()? as f64;
            let pts = m
                .allocated_per_iteration
                .iter()
                .enumerate()
                .map(|(i, &a)| ((i + 1) as f64, (a as f64 - base) / MIB))
                .collect();
            let name = v.name.trim_end_matches(&format!(" ({SMALL})"));
            let rate = human_bytes(m.growth_bytes_per_iteration.max(0.0).round() as u64);
            Some((format!("{name}: +{rate}/iteration"), pts))
        })
        .collect::<Option<_>>()?;
    lines(
        "Leak growth: allocated memory after each iteration",
        "iteration (index)",
        "allocated, more than after the first (MiB)",
        &series,
        true,
    )
}
