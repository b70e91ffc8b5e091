//! `mixed-precision`: fp32 against two mixed-precision recipes, each in fp16 (with dynamic
//! loss scaling, vram-amp's scaler) and bf16:
//!
//! - full 16-bit: weights and activations in 16 bits, f32 master weights in the optimizer;
//! - autocast, as `torch.autocast` / `torch.cuda.amp` does it: f32 weights (no master copy),
//!   matmuls in 16 bits through a per-step cache of 16-bit weight copies, layer norms,
//!   softmax, the loss and the residual stream in f32.
//!
//! Peak memory split into weights, 16-bit weight copies, master weights, gradients, optimizer
//! state and activations, executed on a small GPT and at real size (GPT-2 small, virtual
//! device) over a batch sweep; step time; loss agreement; steps the scaler skipped. On a GPU
//! GPT-2 small also runs at batch 8 in every recipe, and its step times decide the speed
//! claim (the small GPT is launch-bound there).

use super::common::{REAL_CAPACITY, REAL_SIZE_CAVEAT, device, gpt, gpt_name, real_model};
use super::{Experiment, Sweep};
use crate::models::{Arch, Attention};
use crate::models::{Model, PeakGrads};
use crate::plan::{ModelOverrides, PlanModel};
use crate::plots::{MIB, stacked_with_totals};
use crate::techniques::Technique;
use crate::timing::{Timing, interleaved};
use crate::trainer::{NoHooks, Precision, TrainConfig, Trainer};
use crate::{Backend, Claim, Context, ExperimentError, Verdict, human_bytes};
use serde::Serialize;
use serde_json::json;
use vram_accum::{ForwardCtx, Mode, Schedule};
use vram_amp::{AdamW, LossScaler, ScalerConfig};
use vram_kernels::{AdamWConfig, DType, Device};

pub(super) static EXPERIMENT: Experiment<Measured> = Experiment {
    technique: Technique {
        id: "mixed-precision",
        name: "mixed precision (full 16-bit with f32 masters; autocast)",
        claim: "about 50% less memory; 30%+ less memory and 20%+ faster",
        source: "002_07a140921eef9482.txt (about 50%), 003_9fc4b5f809544d8d.txt (30%+ less, 20%+ faster), 000_cc24938f7d0f0079.txt",
    },
    run,
    plot: Some(plot),
    host_capacity_limit: None,
    expected_secs: [2.2, 23.7],
};

/// One precision's measurements: where its peak goes.
#[derive(Serialize)]
pub(super) struct Measured {
    part: &'static str,
    batch_size: usize,
    recipe: &'static str,
    weights_bytes: u64,
    weight_copies_16bit_bytes: u64,
    master_weights_bytes: u64,
    /// The parameters' gradients once backward made them all.
    grads_bytes: u64,
    /// The parameters' gradients that existed when the phase (the forward, the loss, a
    /// layer's backward, the optimizer step) in which the peak was reached began
    /// (`zero_grad` frees them each step, so a transformer, whose peak comes as backward
    /// begins, holds few of them then; the phase's own gradients, made during it, count as
    /// temporaries).
    grads_at_peak_bytes: u64,
    optimizer_state_bytes: u64,
    /// The peak less the states alive at it: weights, 16-bit copies, master weights,
    /// optimizer state and the gradients at the peak.
    activations_and_temporaries_bytes: u64,
    state_bytes_per_parameter: f64,
    losses: Vec<f32>,
    /// Steps the loss scaler skipped; `None` (null) where no scaler ran on values: a recipe
    /// without loss scaling, or a virtual-device row (no gradients to check).
    scaler_steps_skipped: Option<u64>,
    /// The loss scale after the last step; `None` (null) as for `scaler_steps_skipped`.
    final_loss_scale: Option<f32>,
}

const SMALL: &str = "small (executed)";
const REAL: &str = super::common::REAL_VIRTUAL;
const EXECUTED: &str = super::common::EXECUTED;

/// The executed real-size runs (CUDA only): GPT-2 small at this batch (13.5 GiB in fp32 on
/// an H100), timed over this many steps after a warm-up step.
const EXECUTED_BATCH: usize = 8;
const EXECUTED_TIMED_STEPS: u64 = 5;

/// The scaler that overflows on purpose: it starts at 2^28 (f16 gradients overflow) and
/// backs off 16x per overflow, so that it reaches a finite scale within a few steps.
fn overflowing_scaler() -> ScalerConfig {
    ScalerConfig {
        init_scale: (1u64 << 28) as f32,
        backoff_factor: 0.0625,
        ..ScalerConfig::default()
    }
}

/// One small executed run: its peaks and their split, step times, losses.
struct Run {
    split: Split,
    step: Timing,
    losses: Vec<f32>,
    /// `(steps skipped, final scale)` of an enabled loss scaler.
    scaler: Option<(u64, f32)>,
}

/// Trains one model per precision, their steps interleaved (the first is a warm-up).
fn train(
    ctx: &Context,
    precisions: &[Precision],
    steps: usize,
    batch: usize,
) -> Result<Vec<Run>, ExperimentError> {
    let (arch, data) = gpt(ctx);
    let mut states: Vec<(Trainer, Device, Vec<f32>)> = Vec::new();
    for precision in precisions {
        let dev = device(ctx, "")?;
        let model = Model::new(&dev, arch.clone(), ctx.seed, precision.dtype())?;
        let cfg = TrainConfig { batch, precision: precision.clone(), ..TrainConfig::default() };
        states.push((Trainer::new(model, data.clone(), ctx.seed, cfg)?, dev, Vec::new()));
    }
    let samples = interleaved(&mut states, 1, steps - 1, |(trainer, _, losses)| {
        let end = trainer.step(&mut NoHooks)?;
        losses.push(end.loss);
        Ok::<_, ExperimentError>(end.step_ms)
    })?;
    states
        .into_iter()
        .zip(samples)
        .map(|((trainer, dev, losses), times)| {
            let state = trainer.state_bytes();
            Ok(Run {
                split: Split {
                    peak: dev.max_memory_allocated(),
                    reserved: dev.max_memory_reserved(),
                    weights: state.weights,
                    copies: state.weight_copies,
                    master: state.master,
                    grads: state.grads,
                    grads_at_peak: state.grads_at_peak,
                    optimizer: state.optimizer,
                },
                step: Timing::from_samples(&times).ok_or_else(|| {
                    ExperimentError::Setup("mixed-precision needs 2 steps or more".into())
                })?,
                losses,
                scaler: trainer
                    .scaler()
                    .filter(|s| s.is_enabled())
                    .map(|s| (s.counters().steps_skipped, s.scale())),
            })
        })
        .collect()
}

/// A run's peaks and where they go.
struct Split {
    peak: u64,
    reserved: u64,
    weights: u64,
    copies: u64,
    master: u64,
    /// The gradients after backward.
    grads: u64,
    /// The gradients that existed at the peak ([`grads_at_peak`]).
    grads_at_peak: u64,
    optimizer: u64,
}

impl Split {
    /// The row of a real-size run (`recipe` its family, weights of `dtype`) at `batch`.
    fn measured(&self, recipe: &'static str, dtype: DType, batch: usize) -> Measured {
        Measured {
            part: REAL,
            recipe,
            batch_size: batch,
            weights_bytes: self.weights,
            weight_copies_16bit_bytes: self.copies,
            master_weights_bytes: self.master,
            grads_bytes: self.grads,
            grads_at_peak_bytes: self.grads_at_peak,
            optimizer_state_bytes: self.optimizer,
            activations_and_temporaries_bytes: self.activations(),
            state_bytes_per_parameter: self.state() as f64
                / (self.weights / dtype.size_in_bytes() as u64) as f64,
            losses: Vec::new(),
            scaler_steps_skipped: None,
            final_loss_scale: None,
        }
    }

    fn state(&self) -> u64 {
        self.weights + self.copies + self.master + self.grads + self.optimizer
    }

    /// The peak less the states alive at it (the gradients made by then, not all).
    fn activations(&self) -> u64 {
        self.peak.saturating_sub(self.state() - self.grads + self.grads_at_peak)
    }
}

/// Two AdamW steps of `batch` samples of `pm` in `precision` on a virtual device, as the
/// planner measures a candidate (`plan::measure`: the same steps, scale and optimizer), with
/// the state split read from the model and the optimizer.
fn real_split(
    pm: &PlanModel,
    precision: crate::plan::Precision,
    batch: usize,
) -> Result<Split, ExperimentError> {
    let dev = Device::virtual_device(REAL_CAPACITY);
    Ok(real_run(&dev, pm, precision, batch, 2)?.split)
}

/// What [`real_run`] measured: the peaks and their split, each step's time after the first
/// (between two synchronizations) and each step's loss (none on a virtual device).
struct RealRun {
    split: Split,
    step_ms: Vec<f64>,
    losses: Vec<f32>,
    /// `(steps skipped, final scale)` of the loss scaler, when one ran on computed values.
    scaler: Option<(u64, f32)>,
}

/// `steps` AdamW steps of `batch` samples of `pm` in `precision` on `dev` (the planner's
/// steps: its scale, optimizer and batch), each timed between two synchronizations; the
/// first (kernels loaded, segments reserved) is left out of the times.
fn real_run(
    dev: &Device,
    pm: &PlanModel,
    precision: crate::plan::Precision,
    batch: usize,
    steps: u64,
) -> Result<RealRun, ExperimentError> {
    let mut model = Model::new(dev, pm.arch.clone(), 1, precision.dtype())?;
    model.set_autocast(precision.autocast())?;
    let mut opt = AdamW::new(AdamWConfig::default());
    let mut scaler = if precision.scales_loss() {
        LossScaler::new(ScalerConfig { init_scale: 256.0, ..Default::default() })?
    } else {
        LossScaler::disabled()
    };
    let input = pm.batch(batch, None);
    let (mut grads, mut step_ms, mut losses) = (0, Vec::new(), Vec::new());
    // Before each phase of every step (the optimizer's included): the peak so far and the
    // gradients that exist.
    let plain = Schedule::none(model.chain_len())?;
    let mut peaks = PeakGrads::default();
    for step in 0..steps {
        dev.synchronize()?;
        let start = std::time::Instant::now();
        let mut ctx = ForwardCtx::new(Mode::Train, step);
        let out = model.train_step_tracked(&input, &mut ctx, scaler.scale(), &plain, &mut peaks)?;
        grads = model.grad_bytes();
        scaler.step(&mut opt, &mut model)?;
        scaler.update()?;
        model.zero_grad();
        dev.synchronize()?;
        if step > 0 {
            step_ms.push(start.elapsed().as_secs_f64() * 1e3);
        }
        if !dev.is_virtual() {
            losses.push(out.loss);
        }
    }
    let peak = dev.max_memory_allocated();
    peaks.mark(peak, 0);
    Ok(RealRun {
        split: Split {
            peak,
            reserved: dev.max_memory_reserved(),
            weights: model.param_bytes(),
            copies: model.cast_cache_bytes(),
            master: opt.master_bytes(),
            grads,
            grads_at_peak: peaks.grads_at_peak(),
            optimizer: opt.state_bytes(),
        },
        step_ms,
        losses,
        scaler: (scaler.is_enabled() && !dev.is_virtual())
            .then(|| (scaler.counters().steps_skipped, scaler.scale())),
    })
}

const FULL: &str = "full 16-bit, f32 master weights";
const AUTOCAST: &str = "autocast (f32 weights)";

fn pct(x: f64) -> String {
    format!("{:.0}%", 100.0 * x)
}

/// A saving `x` (a fraction of the baseline) in words: "24% less", or "1% more" where the
/// recipe takes more than the baseline.
fn less(x: f64) -> String {
    if x >= -0.005 {
        format!("{:.0}% less", 100.0 * x.max(0.0))
    } else {
        format!("{:.0}% more", -100.0 * x)
    }
}

fn run(ctx: &Context) -> Result<Sweep<Measured>, ExperimentError> {
    let (steps, batch) = if ctx.quick { (8, 16) } else { (30, 8) };
    let (arch, _) = gpt(ctx);
    let mut sweep = Sweep::new(
        ctx,
        json!({ "model": format!("{arch:?}"), "batch_size": batch, "steps": steps, "optimizer": "AdamW" }),
    );
    let recipes = [
        ("fp32", "fp32", Precision::F32),
        (
            "fp16 + dynamic loss scaling, f32 master weights",
            FULL,
            Precision::F16(ScalerConfig::default()),
        ),
        ("bf16, f32 master weights", FULL, Precision::Bf16),
        ("bf16 autocast", AUTOCAST, Precision::Autocast { low: DType::BF16, scaler: None }),
        (
            "fp16 autocast + dynamic loss scaling",
            AUTOCAST,
            Precision::Autocast { low: DType::F16, scaler: Some(ScalerConfig::default()) },
        ),
        (
            "fp16 + loss scaling from 2^28 (overflow injected)",
            FULL,
            Precision::F16(overflowing_scaler()),
        ),
    ];
    let precisions: Vec<Precision> = recipes.iter().map(|r| r.2.clone()).collect();
    let runs: Vec<(&str, &str, Run)> = recipes
        .iter()
        .map(|r| (r.0, r.1))
        .zip(train(ctx, &precisions, steps, batch)?)
        .map(|((n, k), r)| (n, k, r))
        .collect();
    let params: u64 = runs[0].2.split.weights / 4;
    let small_gpt = {
        let Arch::Gpt { d, layers, seq, .. } = &arch else {
            return Err(ExperimentError::Setup("mixed-precision: the small model is a GPT".into()));
        };
        gpt_name(
            &format!("small GPT (d {d}, {layers} layers, {seq} tokens)"),
            &arch,
            Attention::Fused,
        )
    };
    for ((name, recipe, r), precision) in runs.iter().zip(&precisions) {
        let mut measured = r.split.measured(recipe, precision.dtype(), batch);
        measured.part = SMALL;
        measured.losses = r.losses.clone();
        (measured.scaler_steps_skipped, measured.final_loss_scale) = r.scaler.unzip();
        sweep.push(
            &format!("{SMALL}: {small_gpt}, {name}"),
            r.split.peak,
            r.split.reserved,
            Some(r.step),
            measured,
        );
    }
    let f32r = &runs[0].2;
    let saving = |r: &Run| 1.0 - r.split.peak as f64 / f32r.split.peak as f64;
    let (fp16, bf16, ac_bf16, ac_fp16) = (&runs[1].2, &runs[2].2, &runs[3].2, &runs[4].2);
    let best_full = saving(fp16).max(saving(bf16));
    let best_ac = saving(ac_bf16).max(saving(ac_fp16));
    let best = best_full.max(best_ac);

    // Real size: GPT-2 small (1024 tokens) over a batch sweep, each recipe.
    use crate::plan::Precision as P;
    let real_batches: &[usize] = if ctx.quick { &[1, 4, 16, 32] } else { &[1, 2, 4, 8, 16, 32] };
    let gpt2 = real_model("gpt2-small", &ModelOverrides::default())?;
    let g2 = gpt_name("GPT-2 small (1024 tokens)", &gpt2.arch, gpt2.attention);
    let g2_row = gpt_name("gpt2-small", &gpt2.arch, gpt2.attention);
    let kinds = [P::Fp32, P::Bf16, P::Fp16, P::AutocastBf16, P::AutocastFp16];
    let recipe_of = |p: P| match p {
        P::Fp32 => "fp32",
        P::Bf16 | P::Fp16 => FULL,
        P::AutocastBf16 | P::AutocastFp16 => AUTOCAST,
    };
    let mut real: Vec<(usize, Vec<Split>)> = Vec::new();
    for &b in real_batches {
        let mut row = Vec::new();
        for p in kinds {
            let s = real_split(&gpt2, p, b)?;
            let measured = s.measured(recipe_of(p), p.dtype(), b);
            sweep.push(
                &format!("{REAL}: {g2_row}, batch {b}, {}", p.label()),
                s.peak,
                s.reserved,
                None,
                measured,
            );
            row.push(s);
        }
        real.push((b, row));
    }
    // Savings against fp32, per batch: index into `kinds`.
    let real_saving = |row: &[Split], k: usize| 1.0 - row[k].peak as f64 / row[0].peak as f64;
    let per_batch = |ks: &[usize]| {
        real.iter()
            .map(|(b, row)| {
                let parts: Vec<String> = ks
                    .iter()
                    .map(|&k| {
                        format!(
                            "{} {} ({})",
                            kinds[k].label(),
                            human_bytes(row[k].peak),
                            less(real_saving(row, k))
                        )
                    })
                    .collect();
                format!("batch {b}: fp32 {}, {}", human_bytes(row[0].peak), parts.join(", "))
            })
            .collect::<Vec<_>>()
            .join("; ")
    };
    let (small_b, large_b) = (&real[0], &real[real.len() - 1]);
    let (s_small, s_large) = (real_saving(&small_b.1, 1), real_saving(&large_b.1, 1));
    sweep.claim(Claim {
        claim: "full 16-bit with f32 masters: at real size the saving approaches 50% when activations dominate (large batches) and not when the 16 B/param states dominate (small batches)".into(),
        measured: format!("{REAL}, {g2}, AdamW: {} ({REAL_SIZE_CAVEAT})", per_batch(&[1, 2])),
        verdict: if s_large >= 0.4 && s_small < s_large - 0.1 {
            Verdict::Holds
        } else if s_large >= 0.3 {
            Verdict::Partly
        } else {
            Verdict::DoesNotHold
        },
    });
    // Autocast: where (if anywhere) its saving approaches 50%, for both recipes.
    let near_half = |k: usize| -> Vec<usize> {
        real.iter().filter(|(_, row)| real_saving(row, k) >= 0.4).map(|(b, _)| *b).collect()
    };
    let ac_best = real
        .iter()
        .flat_map(|(_, row)| [real_saving(row, 3), real_saving(row, 4)])
        .fold(f64::MIN, f64::max);
    let ac_large = real_saving(&large_b.1, 3);
    let ac_small = real_saving(&small_b.1, 3);
    let full_large = s_large;
    let where_half = |k: usize| {
        let b = near_half(k);
        if b.is_empty() { "at no batch".to_string() } else { format!("at batch {b:?}") }
    };
    let row_large = &large_b.1;
    let act = Split::activations;
    sweep.claim(Claim {
        claim: "autocast (torch.cuda.amp: f32 weights, 16-bit matmuls) uses about 50% less memory".into(),
        measured: format!(
            "{REAL}, {g2}: {}. Saving of 40% or more: bf16 autocast {}, fp16 autocast {} (full bf16 {}). Autocast's state is {:.1} B/param (f32 weights, gradients and AdamW moments, plus {:.1} B/param of cached 16-bit weight copies) against full 16-bit's {:.1}; its activations at batch {} are {} against fp32's {} and full bf16's {} (the residual stream, the layer norms and the loss stay f32, and each matmul also keeps the 16-bit cast of its input)",
            per_batch(&[3, 4]),
            where_half(3),
            where_half(4),
            where_half(1),
            row_large[3].state() as f64 * 4.0 / row_large[3].weights as f64,
            row_large[3].copies as f64 * 4.0 / row_large[3].weights as f64,
            row_large[1].state() as f64 * 2.0 / row_large[1].weights as f64,
            large_b.0,
            human_bytes(act(&row_large[3])),
            human_bytes(act(&row_large[0])),
            human_bytes(act(&row_large[1])),
        ),
        verdict: saving_verdict(ac_best),
    });
    // A CNN under autocast: ResNet-50 (batch norms included) at a batch where activations
    // dominate; convolutions run in 16 bits, batch norms on 16-bit inputs.
    let resnet = real_model("resnet50", &ModelOverrides::default())?;
    let cnn_batch = 64;
    let cnn: Vec<(P, Split)> = [P::Fp32, P::Bf16, P::AutocastBf16]
        .into_iter()
        .map(|p| real_split(&resnet, p, cnn_batch).map(|s| (p, s)))
        .collect::<Result<_, _>>()?;
    for (p, s) in &cnn {
        let measured = s.measured(recipe_of(*p), p.dtype(), cnn_batch);
        let name = format!("{REAL}: resnet50, batch {cnn_batch}, {}", p.label());
        sweep.push(&name, s.peak, s.reserved, None, measured);
    }
    let cnn_saving = |k: usize| 1.0 - cnn[k].1.peak as f64 / cnn[0].1.peak as f64;
    let cnn_reading = format!(
        "On ResNet-50 (224 px, batch {cnn_batch}, batch norms included), where activations dominate, the peak goes from {} (fp32) to {} with full bf16 ({} less) and {} with bf16 autocast ({} less): convolutions, their saved inputs and the batch norms' inputs are 16-bit under autocast, while weights, gradients and AdamW state stay f32.",
        human_bytes(cnn[0].1.peak),
        human_bytes(cnn[1].1.peak),
        pct(cnn_saving(1)),
        human_bytes(cnn[2].1.peak),
        pct(cnn_saving(2)),
    );
    // Where the peak falls: the gradients it holds, of all those backward makes.
    let at_peak = |(b, row): &(usize, Vec<Split>)| {
        format!("batch {b}: {} of {}", human_bytes(row[0].grads_at_peak), human_bytes(row[0].grads))
    };
    sweep.reading(format!(
        "{REAL}: on {g2}, full bf16 with f32 masters takes {} at batch {} but {} at batch {}; bf16 autocast (torch.autocast's recipe) {} and {}: its weights, gradients and AdamW state stay f32 (16 B/param, plus 2 B/param of 16-bit weight copies) and only part of the activations halve, so pick full bf16 for memory and autocast for f32 weights and norms. Gradients made before the fp32 peak's phase: {} ({}): zero_grad frees them each step (PyTorch's set_to_none, its default), so where the peak comes as backward begins they are mostly not there yet. {cnn_reading}",
        less(full_large), large_b.0, less(s_small), small_b.0, less(ac_large), less(ac_small),
        at_peak(small_b),
        at_peak(large_b),
    ));
    sweep.claim(Claim {
        claim: "mixed precision uses about 50% less memory".into(),
        measured: format!(
            "{SMALL}: peak {} fp32; full 16-bit: {} fp16 ({} less), {} bf16 ({} less); autocast: {} bf16 ({} less), {} fp16 ({} less); {REAL}, {g2}, bf16: full {} at batch {} and {} at batch {}, autocast {} and {}",
            human_bytes(f32r.split.peak),
            human_bytes(fp16.split.peak),
            pct(saving(fp16)),
            human_bytes(bf16.split.peak),
            pct(saving(bf16)),
            human_bytes(ac_bf16.split.peak),
            pct(saving(ac_bf16)),
            human_bytes(ac_fp16.split.peak),
            pct(saving(ac_fp16)),
            less(s_large),
            large_b.0,
            less(s_small),
            small_b.0,
            less(ac_large),
            less(ac_small),
        ),
        verdict: saving_verdict(best),
    });
    // Real size executed on a GPU, for the speed claim (the small model is launch-bound
    // there): GPT-2 small at EXECUTED_BATCH, each recipe on a fresh device, one after the
    // other.
    let executed: Vec<(P, RealRun)> = match ctx.backend {
        Backend::Cpu => Vec::new(),
        Backend::Cuda { .. } => kinds
            .iter()
            .map(|&p| {
                let dev = device(ctx, "")?;
                Ok((p, real_run(&dev, &gpt2, p, EXECUTED_BATCH, 1 + EXECUTED_TIMED_STEPS)?))
            })
            .collect::<Result<_, ExperimentError>>()?,
    };
    let mut executed_steps: Vec<(P, Timing)> = Vec::new();
    for (p, r) in &executed {
        let mut measured = r.split.measured(recipe_of(*p), p.dtype(), EXECUTED_BATCH);
        measured.part = EXECUTED;
        measured.losses = r.losses.clone();
        (measured.scaler_steps_skipped, measured.final_loss_scale) = r.scaler.unzip();
        let step = Timing::from_samples(&r.step_ms);
        let name = format!("{EXECUTED}: {g2_row}, batch {EXECUTED_BATCH}, {}", p.label());
        sweep.push(&name, r.split.peak, r.split.reserved, step, measured);
        executed_steps.extend(step.map(|t| (*p, t)));
    }
    let speed = format!(
        "{SMALL}: memory {} / {} less (full fp16 / bf16), {} / {} (autocast bf16 / fp16); step {} fp32, {} fp16, {} bf16, {} bf16 autocast, {} fp16 autocast",
        pct(saving(fp16)),
        pct(saving(bf16)),
        pct(saving(ac_bf16)),
        pct(saving(ac_fp16)),
        f32r.step.describe(),
        fp16.step.describe(),
        bf16.step.describe(),
        ac_bf16.step.describe(),
        ac_fp16.step.describe()
    );
    let (measured, verdict) = match ctx.backend {
        Backend::Cpu => (
            format!(
                "{speed}: host timings, where 16-bit math is emulated in f32; not applicable on the host: the speed claim is about GPU tensor cores"
            ),
            Verdict::NotApplicable,
        ),
        Backend::Cuda { .. } => {
            // 20%+ faster with the intervals: fp32's lower bound over the best 16-bit upper
            // bound, at real size where it ran (the small model's launches hide the math).
            let upper = |t: &Timing| t.upper();
            let (f32_step, sixteen): (Timing, Vec<Timing>) = match executed_steps.split_first() {
                Some(((P::Fp32, t), rest)) if !rest.is_empty() => {
                    (*t, rest.iter().map(|(_, t)| *t).collect())
                }
                _ => (f32r.step, [fp16, bf16, ac_bf16, ac_fp16].iter().map(|r| r.step).collect()),
            };
            let lower = f32_step.lower();
            let fastest = sixteen.iter().map(upper).fold(f64::MAX, f64::min);
            let faster = lower / fastest - 1.0;
            let real_speed = if executed_steps.is_empty() {
                String::new()
            } else {
                let steps: Vec<String> = executed_steps
                    .iter()
                    .map(|(p, t)| format!("{} {}", t.describe(), p.label()))
                    .collect();
                format!(
                    "; {EXECUTED}, {g2}, batch {EXECUTED_BATCH}, AdamW, {EXECUTED_TIMED_STEPS} timed steps: step {} (fp32 {:.0}% slower than the fastest 16-bit recipe, bounds included)",
                    steps.join(", "),
                    100.0 * faster
                )
            };
            (
                format!("{speed}{real_speed}"),
                if best >= 0.3 && faster >= 0.2 {
                    Verdict::Holds
                } else if best >= 0.3 || faster >= 0.2 {
                    Verdict::Partly
                } else {
                    Verdict::DoesNotHold
                },
            )
        }
    };
    sweep.claim(Claim { claim: "30%+ less memory and 20%+ faster".into(), measured, verdict });
    let per_param = |r: &Run| r.split.state() as f64 / params as f64;
    let acts = |r: &Run| r.split.activations();
    sweep.claim(Claim {
        claim: "Micikevicius et al.: the saving is in 16-bit activations; weights + grads + Adam state stay ~16 B/parameter with f32 masters".into(),
        measured: format!(
            "{SMALL}: state {:.1} B/param fp32, {:.1} fp16, {:.1} bf16 (full 16-bit); activations and temporaries (the peak less the states alive at it) {} fp32, {} fp16, {} bf16",
            per_param(f32r), per_param(fp16), per_param(bf16), human_bytes(acts(f32r)), human_bytes(acts(fp16)), human_bytes(acts(bf16))
        ),
        verdict: if (per_param(fp16) - per_param(f32r)).abs() <= 1.0 && acts(fp16) < acts(f32r) { Verdict::Holds } else { Verdict::Partly },
    });
    // Autocast's state: f32 weights, gradients and moments (16 B/param) and no master copy,
    // plus one 16-bit copy per cast weight (2 B/param for the weights that go through a
    // matmul: all but the embeddings and the norms).
    let copies_per_param = |r: &Run| r.split.copies as f64 / params as f64;
    let ac_ok = |r: &Run| {
        let s = &r.split;
        s.master == 0
            && s.grads == s.weights
            && s.optimizer == 2 * s.weights
            && s.copies > 0
            && copies_per_param(r) <= 2.0
    };
    sweep.claim(Claim {
        claim: "autocast keeps f32 weights, gradients and Adam state (16 B/param, no master copy) plus a cached 16-bit copy of each matmul weight (at most 2 B/param)".into(),
        measured: format!(
            "{SMALL}: state {:.1} B/param bf16 autocast ({:.2} B/param of 16-bit copies, master {}), {:.1} fp16 autocast ({:.2}, master {}); fp32 {:.1}; activations and temporaries (the peak less the states alive at it) {} bf16 autocast, {} fp16 autocast, {} fp32, {} full bf16",
            per_param(ac_bf16), copies_per_param(ac_bf16), human_bytes(ac_bf16.split.master),
            per_param(ac_fp16), copies_per_param(ac_fp16), human_bytes(ac_fp16.split.master),
            per_param(f32r),
            human_bytes(acts(ac_bf16)), human_bytes(acts(ac_fp16)), human_bytes(acts(f32r)), human_bytes(acts(bf16))
        ),
        verdict: if ac_ok(ac_bf16) && ac_ok(ac_fp16) { Verdict::Holds } else { Verdict::DoesNotHold },
    });
    let diff = |r: &Run| {
        r.losses.iter().zip(&f32r.losses).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max)
    };
    let tolerance = 0.05 * f32r.losses[0];
    let scaled = |r: &Run| match r.scaler {
        Some((skipped, scale)) => format!("skipped {skipped} steps (final scale {scale})"),
        None => "no scaler".into(),
    };
    let worst = [fp16, bf16, ac_bf16, ac_fp16].iter().map(|r| diff(r)).fold(0f32, f32::max);
    sweep.claim(Claim {
        claim: "mixed precision trains like fp32 (loss curves agree within 5% of fp32's first loss)".into(),
        measured: format!(
            "{SMALL}, {small_gpt}: largest loss difference to fp32 over {steps} steps: full {:.4} fp16, {:.4} bf16; autocast {:.4} bf16, {:.4} fp16 (tolerance {tolerance:.4} = 5% of fp32's first loss {:.4}); loss scaler: full fp16 {}, fp16 autocast {}",
            diff(fp16), diff(bf16), diff(ac_bf16), diff(ac_fp16), f32r.losses[0], scaled(fp16), scaled(ac_fp16)
        ),
        verdict: if worst < tolerance { Verdict::Holds } else { Verdict::Partly },
    });
    let inj = &runs[5].2;
    let finite = inj.losses.iter().all(|l| l.is_finite());
    // The overflowing recipe has an enabled scaler; without one nothing was skipped.
    let (inj_skipped, inj_scale) = inj.scaler.unwrap_or((0, f32::NAN));
    sweep.claim(Claim {
        claim: "the loss scaler skips overflowing f16 steps, backs off, and training goes on".into(),
        measured: format!(
            "{SMALL}, {small_gpt}: scale starting at 2^28 (backoff 1/16): {} of {} steps skipped, final scale {}, losses {} (fp32 {}); all finite: {finite}",
            inj_skipped,
            steps,
            inj_scale,
            inj.losses.iter().map(|l| format!("{l:.3}")).collect::<Vec<_>>().join(", "),
            f32r.losses.iter().map(|l| format!("{l:.3}")).collect::<Vec<_>>().join(", "),
        ),
        verdict: if inj_skipped >= 1 && (inj_skipped as usize) < steps && finite && inj_scale < (1u64 << 28) as f32 {
            Verdict::Holds
        } else {
            Verdict::DoesNotHold
        },
    });
    Ok(sweep)
}

/// The real-size batch the plot shows: small enough that the states are visible beside the
/// activations, large enough that activations matter.
const PLOT_BATCH: usize = 4;

/// Where each precision's peak goes at real size (GPT-2 small at [`PLOT_BATCH`], or the
/// sweep's smallest batch), stacked: the two recipes side by side.
fn plot(sweep: &Sweep<Measured>) -> Option<String> {
    let parts = [
        "weights",
        "16-bit weight copies",
        "master weights",
        "gradients made before the peak's phase",
        "optimizer state",
        "activations + temporaries",
    ];
    let real: Vec<_> = sweep.variants().iter().filter(|(_, m)| m.part == REAL).collect();
    // On a GPU the real-size recipes also ran there: show that batch, with each recipe's
    // measured step time under its bar.
    let executed: Vec<_> = sweep.variants().iter().filter(|(_, m)| m.part == EXECUTED).collect();
    let shown = if !executed.is_empty() && real.iter().any(|(_, m)| m.batch_size == EXECUTED_BATCH)
    {
        EXECUTED_BATCH
    } else if real.iter().any(|(_, m)| m.batch_size == PLOT_BATCH) {
        PLOT_BATCH
    } else {
        real.iter().map(|(_, m)| m.batch_size).min()?
    };
    let gib = MIB * 1024.0;
    let g2 = real_model("gpt2-small", &ModelOverrides::default())
        .map(|m| gpt_name("GPT-2 small (1024 tokens)", &m.arch, m.attention))
        .ok()?;
    let bars: Vec<(String, Vec<f64>)> = real
        .iter()
        .filter(|(_, m)| m.batch_size == shown)
        .map(|(v, m)| {
            let bytes = [
                m.weights_bytes,
                m.weight_copies_16bit_bytes,
                m.master_weights_bytes,
                m.grads_at_peak_bytes,
                m.optimizer_state_bytes,
                m.activations_and_temporaries_bytes,
            ];
            let label = v.name.rsplit(", ").next().unwrap_or(&v.name);
            let mut label = match m.recipe {
                FULL => format!("{label} (full)"),
                _ => label.to_string(),
            };
            let precision = v.name.rsplit(", ").next().unwrap_or(&v.name);
            let ran = executed.iter().find(|(e, _)| e.name.rsplit(", ").next() == Some(precision));
            if let Some(ms) = ran.and_then(|(e, _)| e.step_ms) {
                label.push_str(&format!(": {ms:.1} ms/step"));
            }
            (label, bytes.iter().map(|&b| b as f64 / gib).collect())
        })
        .collect();
    stacked_with_totals(
        &if executed.is_empty() {
            format!("{g2}, batch {shown} (virtual device): where peak memory goes")
        } else {
            format!("{g2}, b{shown}: peak (virtual), step time (GPU)")
        },
        "peak allocated (GiB)",
        "GiB",
        &parts,
        &bars,
    )
}

/// The verdict on "about 50% less memory" for the best saving measured: holds from 40%,
/// partly from 15%.
fn saving_verdict(best: f64) -> Verdict {
    if best >= 0.4 {
        Verdict::Holds
    } else if best >= 0.15 {
        Verdict::Partly
    } else {
        Verdict::DoesNotHold
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Precision as P;

    /// The executed real-size path (what runs on a GPU) on the host, with GPT-2 small shrunk:
    /// every step but the first timed, a finite loss per step, and the peaks the virtual
    /// device predicts (vram's own allocations are the same on every backend).
    #[test]
    fn a_saving_below_zero_reads_as_more() {
        assert_eq!(less(0.24), "24% less");
        assert_eq!(less(-0.013), "1% more");
        assert_eq!(less(-0.001), "0% less");
    }

    #[test]
    fn the_gradients_at_the_peak_are_those_before_the_phase_it_rose_in() {
        let run = |marks: &[(u64, u64)]| {
            let mut p = PeakGrads::default();
            marks.iter().for_each(|&(peak, grads)| p.mark(peak, grads));
            p.grads_at_peak()
        };
        // The peak (50) is reached in the phase that starts at the second mark.
        assert_eq!(run(&[(10, 0), (20, 4), (50, 8), (50, 9), (50, 0)]), 4);
        // Reached in the last phase (the optimizer step, all gradients there).
        assert_eq!(run(&[(10, 0), (20, 4), (30, 9), (60, 0)]), 9);
        // A later step that only equals the peak does not move it.
        assert_eq!(run(&[(10, 0), (40, 2), (40, 9), (40, 0), (40, 3), (40, 0)]), 0);
    }

    /// GPT-2 small in fp32 peaks as backward begins: of its gradients only the tied LM
    /// head's (the token table, made by the fused loss) exist then, and the bar's
    /// activations are the peak less the states alive at it.
    #[test]
    fn gpt2_smalls_peak_holds_the_head_gradient_only() {
        let pm = real_model("gpt2-small", &ModelOverrides::default()).unwrap();
        let s = real_split(&pm, P::Fp32, 4).unwrap();
        let table = 50257 * 768 * 4;
        assert_eq!(s.grads, s.weights, "fp32 gradients: one per weight");
        assert!(
            s.grads_at_peak >= table && s.grads_at_peak < table + s.grads / 10,
            "{}",
            s.grads_at_peak
        );
        assert_eq!(
            s.activations() + s.weights + s.optimizer + s.grads_at_peak + s.copies + s.master,
            s.peak
        );
    }

    #[test]
    fn real_runs_time_every_step_but_the_first_and_match_the_virtual_device() {
        let pm = super::super::common::tiny_gpt2();
        for p in [P::Fp32, P::AutocastBf16, P::Fp16] {
            // The virtual device counts an H100's cuBLAS workspace; the host, told its size.
            let host = Device::host(1 << 30);
            host.set_blas_workspace_size(Device::virtual_device(1).blas_workspace_size());
            let r = real_run(&host, &pm, p, 2, 3).unwrap();
            assert_eq!(r.step_ms.len(), 2, "{p:?}");
            assert!(r.step_ms.iter().all(|&t| t > 0.0), "{p:?}: {:?}", r.step_ms);
            assert_eq!(r.losses.len(), 3, "{p:?}");
            assert!(r.losses.iter().all(|l| l.is_finite() && *l > 0.0), "{p:?}: {:?}", r.losses);
            // The loss scale is the scaler's (fp16 from 256, grown or backed off), never a
            // placeholder; none without a scaler or without values.
            match p {
                P::Fp16 => {
                    let (skipped, scale) = r.scaler.expect("fp16 scales the loss");
                    assert!(skipped <= 3 && scale > 0.0 && scale.is_finite(), "{:?}", r.scaler);
                    assert_eq!(scale, 256.0 / 2f32.powi(skipped as i32), "backoff 0.5 per skip");
                }
                _ => assert_eq!(r.scaler, None, "{p:?}"),
            }
            let v = real_run(&Device::virtual_device(REAL_CAPACITY), &pm, p, 2, 3).unwrap();
            assert!(v.losses.is_empty(), "{p:?}");
            assert_eq!(v.scaler, None, "{p:?}: nothing computed, nothing scaled");
            assert_eq!(
                (r.split.peak, r.split.reserved),
                (v.split.peak, v.split.reserved),
                "{p:?}: host against virtual"
            );
            assert!(r.split.peak > r.split.state() && r.split.grads > 0, "{p:?}");
        }
    }
}
