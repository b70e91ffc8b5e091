//! What the training experiments share: devices, standard models, a measured training run,
//! and small statistics.

use crate::data::Dataset;
use crate::models::{Arch, Attention, Model};
use crate::trainer::{NoHooks, TrainConfig, Trainer};
use crate::{Backend, Context, ExperimentError, Timing};
use vram_alloc::AllocatorConfig;
use vram_kernels::{DType, Device};

/// A fresh device for one variant (fresh cache, so peaks are per variant).
pub fn device(ctx: &Context, conf: &str) -> Result<Device, ExperimentError> {
    let config = AllocatorConfig::parse(conf)?;
    Ok(match &ctx.backend {
        Backend::Cpu => Device::host_with_config(ctx.device_memory, config)?,
        Backend::Cuda { .. } => Device::cuda_with_config(0, config)?,
    })
}

/// A device of `capacity` bytes for experiments that size the device: host memory of that
/// capacity, or the CUDA device capped by a memory fraction.
pub fn sized_device(ctx: &Context, capacity: u64) -> Result<Device, ExperimentError> {
    match &ctx.backend {
        Backend::Cpu => Ok(Device::host_with_config(capacity, AllocatorConfig::default())?),
        Backend::Cuda { total_bytes, .. } => {
            let dev = Device::cuda(0)?;
            dev.set_memory_fraction((capacity as f64 / *total_bytes as f64).min(1.0))?;
            Ok(dev)
        }
    }
}

/// Waits for the device's queued work, so that a clock read after it measures the work.
pub fn sync(dev: &Device) -> Result<(), ExperimentError> {
    Ok(dev.synchronize()?)
}

/// The CNN input side and models used by the CNN experiments.
pub fn cnn(ctx: &Context, depthwise: bool) -> Arch {
    let (width, blocks) = if ctx.quick { (32, vec![1, 1]) } else { (32, vec![2, 2]) };
    let classes = 10;
    if depthwise {
        Arch::MobileNet { width, blocks, classes }
    } else {
        Arch::ResNet { width, blocks, classes }
    }
}

/// CNN image side.
pub fn cnn_side(ctx: &Context) -> usize {
    if ctx.quick { 32 } else { 48 }
}

/// The stripes data set for the CNNs.
pub fn stripes(side: usize) -> Dataset {
    Dataset::Stripes { side, classes: 10 }
}

/// The GPT used by transformer experiments, and its data.
pub fn gpt(ctx: &Context) -> (Arch, Dataset) {
    let (d, layers, seq) = if ctx.quick { (64, 2, 32) } else { (96, 4, 64) };
    (
        Arch::Gpt { vocab: 64, d, layers, heads: 1, seq, dropout: 0.1, tied: false },
        Dataset::Sequences { vocab: 64, seq },
    )
}

/// How a figure names a GPT: `name` with its dropout and attention form (inside `name`'s
/// closing parenthesis if it ends with one); any other model is `name` alone.
pub fn gpt_name(name: &str, arch: &Arch, attention: Attention) -> String {
    match arch {
        Arch::Gpt { dropout, .. } => {
            let form = match attention {
                Attention::Fused => "fused",
                Attention::Explicit => "explicit",
            };
            let what = format!("dropout {dropout}, {form} attention");
            match name.strip_suffix(')') {
                Some(open) => format!("{open}, {what})"),
                None => format!("{name} ({what})"),
            }
        }
        _ => name.to_string(),
    }
}

/// [`gpt_name`] then `, precision`: what [`super::unlabelled_gpt`] asks of every GPT
/// figure (any other model: `name` alone).
pub fn gpt_tag(name: &str, arch: &Arch, attention: Attention, precision: &str) -> String {
    match arch {
        Arch::Gpt { .. } => format!("{}, {precision}", gpt_name(name, arch, attention)),
        _ => name.to_string(),
    }
}

/// The small executed GPT of [`gpt`] as figures name it, with `precision`.
pub fn small_gpt_tag(ctx: &Context, precision: &str) -> String {
    let (arch, _) = gpt(ctx);
    let name = match &arch {
        Arch::Gpt { d, layers, seq, .. } => {
            format!("small GPT (d {d}, {layers} layers, {seq} tokens)")
        }
        _ => "small GPT".to_string(),
    };
    gpt_tag(&name, &arch, Attention::Fused, precision)
}

/// A real-size model as figures name it: its preset name and, for a GPT, its dropout,
/// attention form and `precision`.
pub fn real_tag(model: &crate::plan::PlanModel, precision: &str) -> String {
    let name = model.name.split(" (").next().unwrap_or(&model.name);
    gpt_tag(name, &model.arch, model.attention, precision)
}

/// Where an allocator-level experiment's rows ran: the caching allocator over virtual
/// memory on the host backend, over the GPU's memory on CUDA (requests only, nothing
/// computed).
pub fn allocator_only(ctx: &Context) -> &'static str {
    match ctx.backend {
        Backend::Cpu => "allocator only (virtual memory, synthetic requests)",
        Backend::Cuda { .. } => "allocator only (GPU memory, synthetic requests)",
    }
}

/// Timed steps after warm-up.
pub fn timed_steps(ctx: &Context) -> (usize, usize) {
    if ctx.quick { (1, 5) } else { (2, 10) }
}

/// Measurements of a training run.
#[derive(Clone, Debug)]
pub struct TrainMeasure {
    /// Peak allocated bytes over the run.
    pub peak_allocated: u64,
    /// Peak reserved bytes over the run.
    pub peak_reserved: u64,
    /// Step time over the timed steps.
    pub step: Timing,
    /// Samples per second at the mean step time.
    pub samples_per_s: f64,
    /// Bytes of parameters.
    pub param_bytes: u64,
    /// Bytes of gradients after a step.
    pub grad_bytes: u64,
    /// Bytes of optimizer state.
    pub optimizer_bytes: u64,
    /// Loss of the last step.
    pub last_loss: f32,
}

/// Trains `model` with vram-harness's [`Trainer`] for `warmup + timed` steps of `cfg`; the
/// step time is over the last `timed`.
pub fn train(
    model: Model,
    data: &Dataset,
    seed: u64,
    cfg: TrainConfig,
    warmup: usize,
    timed: usize,
) -> Result<TrainMeasure, ExperimentError> {
    let mut runs = train_interleaved(vec![(model, data.clone(), cfg)], seed, warmup, timed)?;
    Ok(runs.remove(0))
}

/// Trains every `(model, data, cfg)` with its own [`Trainer`], the steps interleaved (one step
/// of each in turn, `warmup` rounds then `timed` timed ones), so that their step times are
/// comparable; each model should live on its own device, so that its peaks are its own.
pub fn train_interleaved(
    runs: Vec<(Model, Dataset, TrainConfig)>,
    seed: u64,
    warmup: usize,
    timed: usize,
) -> Result<Vec<TrainMeasure>, ExperimentError> {
    let mut trainers = Vec::with_capacity(runs.len());
    for (model, data, cfg) in runs {
        let batch = cfg.batch;
        trainers.push((Trainer::new(model, data, seed, cfg)?, batch, f32::NAN));
    }
    let samples = crate::timing::interleaved(&mut trainers, warmup, timed, |(t, _, loss)| {
        let end = t.step(&mut NoHooks)?;
        *loss = end.loss;
        Ok::<_, ExperimentError>(end.step_ms)
    })?;
    trainers
        .into_iter()
        .zip(samples)
        .map(|((trainer, batch, last_loss), times)| measure(&trainer, batch, &times, last_loss))
        .collect()
}

fn measure(
    trainer: &Trainer,
    batch: usize,
    times: &[f64],
    last_loss: f32,
) -> Result<TrainMeasure, ExperimentError> {
    let device = trainer.model().device();
    let step = Timing::from_samples(times)
        .ok_or_else(|| ExperimentError::Setup("a timed training run needs timed steps".into()))?;
    let state = trainer.state_bytes();
    Ok(TrainMeasure {
        peak_allocated: device.max_memory_allocated(),
        peak_reserved: device.max_memory_reserved(),
        step,
        samples_per_s: batch as f64 / (step.mean_ms / 1e3),
        param_bytes: state.weights,
        grad_bytes: state.grads,
        optimizer_bytes: state.optimizer,
        last_loss,
    })
}

/// Builds each `(arch, data, batch)` on a fresh device and trains them in f32 with AdamW,
/// interleaved (see [`train_interleaved`]).
pub fn train_fresh_interleaved(
    ctx: &Context,
    runs: Vec<(Arch, Dataset, usize)>,
) -> Result<Vec<TrainMeasure>, ExperimentError> {
    let mut built = Vec::with_capacity(runs.len());
    for (arch, data, batch) in runs {
        let model = Model::new(&device(ctx, "")?, arch, ctx.seed, DType::F32)?;
        built.push((model, data, TrainConfig { batch, ..TrainConfig::default() }));
    }
    let (warmup, timed) = timed_steps(ctx);
    train_interleaved(built, ctx.seed, warmup, timed)
}

/// A fingerprint of every parameter's bits: equal fingerprints mean untouched weights.
pub fn fingerprint(model: &Model) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in model.params() {
        for v in
            p.value.to_f32_vec().expect("experiments read their weights from the host or a GPU")
        {
            h = (h ^ u64::from(v.to_bits())).wrapping_mul(0x100_0000_01b3);
        }
    }
    h
}

/// Every gradient, flattened to f32, in parameter order.
pub fn gradients(model: &Model) -> Vec<Vec<f32>> {
    model
        .params()
        .iter()
        .map(|p| {
            let read = |g: &vram_kernels::Tensor| {
                g.to_f32_vec().expect("experiments read their gradients from the host or a GPU")
            };
            p.grad.as_ref().map(read).unwrap_or_default()
        })
        .collect()
}

/// The largest element-wise difference between two gradient sets, relative to the largest
/// magnitude of the reference.
pub fn max_relative_difference(reference: &[Vec<f32>], other: &[Vec<f32>]) -> f64 {
    let scale = reference
        .iter()
        .flatten()
        .fold(0f64, |m, &v| m.max(f64::from(v).abs()))
        .max(f64::MIN_POSITIVE);
    let diff =
        reference.iter().zip(other).flat_map(|(a, b)| a.iter().zip(b)).fold(0f64, |m, (&a, &b)| {
            let d = (f64::from(a) - f64::from(b)).abs();
            if d.is_nan() { f64::INFINITY } else { m.max(d) }
        });
    diff / scale
}

/// Least-squares line `y = a + b x`; returns (a, b, r^2).
pub fn fit_line(xs: &[f64], ys: &[f64]) -> (f64, f64, f64) {
    let n = xs.len() as f64;
    let (mx, my) = (xs.iter().sum::<f64>() / n, ys.iter().sum::<f64>() / n);
    let sxy: f64 = xs.iter().zip(ys).map(|(x, y)| (x - mx) * (y - my)).sum();
    let sxx: f64 = xs.iter().map(|x| (x - mx).powi(2)).sum();
    let b = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    let a = my - b * mx;
    let ss_tot: f64 = ys.iter().map(|y| (y - my).powi(2)).sum();
    let ss_res: f64 = xs.iter().zip(ys).map(|(x, y)| (y - a - b * x).powi(2)).sum();
    let r2 = if ss_tot > 0.0 { 1.0 - ss_res / ss_tot } else { 1.0 };
    (a, b, r2)
}

/// Whether each value is larger than the one before.
pub fn increasing(v: &[u64]) -> bool {
    v.windows(2).all(|w| w[1] > w[0])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpt_tag_says_dropout_attention_and_precision_and_passes_the_guard() {
        let (arch, _) = (
            Arch::Gpt { vocab: 64, d: 64, layers: 2, heads: 1, seq: 32, dropout: 0.1, tied: false },
            (),
        );
        assert_eq!(
            gpt_tag("small GPT (d 64)", &arch, Attention::Explicit, "fp32"),
            "small GPT (d 64, dropout 0.1, explicit attention), fp32"
        );
        assert_eq!(
            gpt_tag("gpt2-small", &arch, Attention::Fused, "bf16"),
            "gpt2-small (dropout 0.1, fused attention), bf16"
        );
        assert_eq!(
            super::super::unlabelled_gpt(&gpt_tag("gpt2", &arch, Attention::Fused, "fp16")),
            None
        );
        let cnn = Arch::ResNet { width: 8, blocks: vec![1], classes: 10 };
        assert_eq!(gpt_tag("resnet50", &cnn, Attention::Fused, "fp32"), "resnet50");
    }

    #[test]
    fn a_real_size_model_that_does_not_exist_is_the_planners_typed_error() {
        let err = real_model("gpt5", &crate::plan::ModelOverrides::default()).unwrap_err();
        assert!(
            matches!(&err, ExperimentError::Plan(crate::plan::PlanError::UnknownModel { name, .. }) if name == "gpt5"),
            "{err:?}"
        );
        assert!(err.to_string().contains("gpt2-medium"), "{err}");
        assert!(!err.is_out_of_memory());
    }

    #[test]
    fn fit_line_recovers_an_exact_line() {
        let (a, b, r2) = fit_line(&[1.0, 2.0, 4.0], &[5.0, 7.0, 11.0]);
        assert!((a - 3.0).abs() < 1e-12 && (b - 2.0).abs() < 1e-12 && (r2 - 1.0).abs() < 1e-12);
    }
}

/// The capacity of the virtual device for real-size measurements: large enough never to run
/// out (1 PiB), so that the peaks are what the step needs.
pub const REAL_CAPACITY: u64 = 1 << 50;

/// What the real-size parts leave out, for claims and readings.
pub const REAL_SIZE_CAVEAT: &str = "real-size figures are vram's own allocations on the virtual device; a GPU adds the CUDA context (~0.5 GiB) and cuDNN/cuBLAS workspaces beyond cuBLAS's default";

/// A real-size model by preset name with `overrides` (see [`crate::plan::model_from_args`]).
pub fn real_model(
    name: &str,
    overrides: &crate::plan::ModelOverrides,
) -> Result<crate::plan::PlanModel, ExperimentError> {
    Ok(crate::plan::model_from_args(name, overrides)?)
}

/// The planner's candidate the real-size parts run: AdamW, default allocator settings.
fn adamw_candidate(
    precision: crate::plan::Precision,
    plan: crate::plan::PlanKind,
    micro: usize,
    accum: usize,
) -> crate::plan::Candidate {
    crate::plan::Candidate {
        precision,
        plan,
        alloc_conf: String::new(),
        optimizer: crate::plan::OptimizerKind::AdamW,
        micro,
        accum,
    }
}

/// Peak allocated and reserved bytes of a real-size training step (two optimizer steps of
/// `accum` micro-batches of `micro` samples) on the virtual device.
pub fn real_peak(
    model: &crate::plan::PlanModel,
    precision: crate::plan::Precision,
    plan: crate::plan::PlanKind,
    micro: usize,
    accum: usize,
) -> Result<(u64, u64), ExperimentError> {
    let c = adamw_candidate(precision, plan, micro, accum);
    crate::plan::measure(model, &c, crate::plan::Target::Virtual(REAL_CAPACITY))?.ok_or_else(|| {
        ExperimentError::Setup(format!("real-size {} ran out of the virtual device", model.name))
    })
}

/// Where a real-size row ran on a GPU: executed there (peaks measured on the card, steps
/// timed), with the virtual device's prediction in the row beside it.
pub const EXECUTED: &str = "real size (executed on the GPU)";

/// Optimizer steps of an executed real-size case: a warm-up step (kernels loaded, segments
/// reserved, optimizer state created) and three timed.
pub const EXECUTED_STEPS: u64 = 4;

/// Room left on the card for the CUDA context and libraries' own memory when deciding
/// whether a real-size case fits it.
const CARD_HEADROOM: u64 = 2 << 30;

/// What a real-size case may take on this backend's GPU: the card's memory less room for
/// the CUDA context and libraries; `None` on the host.
pub fn gpu_usable(ctx: &Context) -> Option<u64> {
    match ctx.backend {
        Backend::Cuda { total_bytes, .. } => Some(total_bytes.saturating_sub(CARD_HEADROOM)),
        Backend::Cpu => None,
    }
}

/// A real-size case's run on the GPU, beside the virtual device's prediction.
#[derive(Clone, Debug, PartialEq)]
pub enum Executed {
    /// The host backend: real sizes are the virtual device's alone.
    NotOnGpu,
    /// The prediction does not fit the card (reserved bytes and the card's size): not run.
    TooLarge {
        /// The virtual device's peak reserved bytes.
        need: u64,
        /// The card's memory less the room kept for the CUDA context.
        usable: u64,
    },
    /// It ran out of the card's memory although the prediction fits.
    OutOfMemory,
    /// It ran: the card's peaks, the timed steps and the losses.
    Ran(crate::plan::TimedRun),
}

impl Executed {
    /// The run's figures when it ran.
    pub fn ran(&self) -> Option<&crate::plan::TimedRun> {
        match self {
            Executed::Ran(r) => Some(r),
            _ => None,
        }
    }

    /// Its timed steps (`None` with fewer than two).
    pub fn step(&self) -> Option<Timing> {
        self.ran().and_then(|r| Timing::from_samples(&r.step_ms))
    }

    /// Why a real-size case did not run on the GPU, for the readings; `None` when it ran or
    /// on the host.
    pub fn why_not(&self) -> Option<String> {
        match self {
            Executed::TooLarge { need, usable } => Some(format!(
                "not executed: needs {} reserved, the card has {} usable",
                crate::human_bytes(*need),
                crate::human_bytes(*usable)
            )),
            Executed::OutOfMemory => {
                Some("ran out of the card's memory although predicted to fit".into())
            }
            _ => None,
        }
    }
}

/// On a GPU, runs a real-size case ([`EXECUTED_STEPS`] optimizer steps of `accum`
/// micro-batches of `micro` samples, fresh device, the whole card) when the virtual
/// device's `predicted_reserved` fits the card; on the host, [`Executed::NotOnGpu`].
pub fn real_executed(
    ctx: &Context,
    model: &crate::plan::PlanModel,
    precision: crate::plan::Precision,
    plan: crate::plan::PlanKind,
    (micro, accum): (usize, usize),
    predicted_reserved: u64,
) -> Result<Executed, ExperimentError> {
    let Some(usable) = gpu_usable(ctx) else {
        return Ok(Executed::NotOnGpu);
    };
    if predicted_reserved > usable {
        return Ok(Executed::TooLarge { need: predicted_reserved, usable });
    }
    // The whole card (a cap of at least its size).
    let target = crate::plan::Target::Cuda(usable + CARD_HEADROOM);
    execute(model, precision, plan, (micro, accum), target)
}

/// A real-size case: the virtual device's prediction and, on a GPU, its run there.
#[derive(Clone, Debug, PartialEq)]
pub struct RealCase {
    /// Peak allocated and reserved bytes on the virtual device.
    pub predicted: (u64, u64),
    /// The run on the GPU.
    pub executed: Executed,
    /// Where the GPU ran it through cuDNN: the virtual device's peaks replaying that run's
    /// record of cuDNN's choices ([`vram_kernels::Device::set_cudnn_choices`]), which by
    /// design equal the GPU's (a consistency check, [`push_real_rows`]).
    pub replayed: Option<(u64, u64)>,
}

impl RealCase {
    /// The peaks a verdict uses: the GPU's where the case ran there, else the prediction.
    pub fn peaks(&self) -> (u64, u64) {
        self.executed.ran().map_or(self.predicted, |r| (r.allocated, r.reserved))
    }
}

/// Where a real-size row ran on the host: the virtual device, nothing computed.
pub const REAL_VIRTUAL: &str = "real size (virtual)";

/// A real-size case ([`real_peak`]'s prediction, then [`real_executed`] on a GPU).
pub fn real_case(
    ctx: &Context,
    model: &crate::plan::PlanModel,
    precision: crate::plan::Precision,
    plan: crate::plan::PlanKind,
    (micro, accum): (usize, usize),
) -> Result<RealCase, ExperimentError> {
    let predicted = real_peak(model, precision, plan, micro, accum)?;
    let executed = real_executed(ctx, model, precision, plan, (micro, accum), predicted.1)?;
    let replayed = match executed.ran().and_then(|r| r.cudnn.clone()) {
        Some(record) => {
            let mut replaying = model.clone();
            replaying.set_cudnn_choices(Some(record));
            Some(real_peak(&replaying, precision, plan, micro, accum)?)
        }
        None => None,
    };
    Ok(RealCase { predicted, executed, replayed })
}

/// The `part` of a set of real-size rows a figure comes from: [`EXECUTED`] when every case
/// ran on the GPU, else `real size (virtual)` (then the figure is the prediction for all of
/// them, so that one figure never mixes the two).
pub fn real_part(cases: &[&RealCase]) -> &'static str {
    if !cases.is_empty() && cases.iter().all(|c| c.executed.ran().is_some()) {
        EXECUTED
    } else {
        REAL_VIRTUAL
    }
}

/// `cases`' peak allocated bytes from [`real_part`]'s source: all executed or all predicted.
pub fn real_allocs(cases: &[&RealCase]) -> Vec<u64> {
    let executed = real_part(cases) == EXECUTED;
    cases.iter().map(|c| if executed { c.peaks().0 } else { c.predicted.0 }).collect()
}

/// Pushes a real-size case's rows: `real size (virtual)` with the prediction, then, where it
/// ran on the GPU, `real size (executed on the GPU)` with the card's peaks and timed steps.
/// `row(part, samples_per_s, last_loss)` builds a row's measurements (`samples` per step
/// give the samples per second; both `None` on the virtual row). Returns "what: why" when
/// the case did not run on the GPU (for [`note_not_executed`]).
pub fn push_real_rows<M: serde::Serialize>(
    sweep: &mut super::Sweep<M>,
    what: &str,
    case: &RealCase,
    samples: usize,
    row: impl Fn(&'static str, Option<f64>, Option<f32>) -> M,
) -> Option<String> {
    let (alloc, reserved) = case.predicted;
    sweep.push(
        &format!("{REAL_VIRTUAL}: {what}"),
        alloc,
        reserved,
        None,
        row(REAL_VIRTUAL, None, None),
    );
    if let Some(r) = case.executed.ran() {
        let step = case.executed.step();
        let per_s = step.map(|t| samples as f64 * 1e3 / t.mean_ms);
        let m = row(EXECUTED, per_s, r.losses.last().copied());
        sweep.push(&format!("{EXECUTED}: {what}"), r.allocated, r.reserved, step, m);
        if let Some((a, res)) = case.replayed {
            let human = vram_alloc::human_bytes;
            sweep.check(
                format!(
                    "{what}: the virtual device replaying this GPU's cuDNN choices allocates \
                     what the GPU allocated (both run vram's caching allocator over the same \
                     requests)"
                ),
                format!(
                    "peak allocated {} replayed vs {} on the GPU, reserved {} vs {}",
                    human(a),
                    human(r.allocated),
                    human(res),
                    human(r.reserved)
                ),
                (a, res) == (r.allocated, r.reserved),
            );
        }
    }
    case.executed.why_not().map(|w| format!("{what}: {w}"))
}

/// Adds a reading listing the real-size cases that did not run on the GPU (`not_run`: one
/// "what: why" each); nothing when all ran or on the host.
pub fn note_not_executed<M: serde::Serialize>(sweep: &mut super::Sweep<M>, not_run: &[String]) {
    if !not_run.is_empty() {
        sweep.reading(format!(
            "Real-size cases not executed on the GPU (their figures are the virtual device's): {}",
            not_run.join("; ")
        ));
    }
}

/// [`real_executed`]'s run on `target` (the tests run it on the host).
fn execute(
    model: &crate::plan::PlanModel,
    precision: crate::plan::Precision,
    plan: crate::plan::PlanKind,
    (micro, accum): (usize, usize),
    target: crate::plan::Target,
) -> Result<Executed, ExperimentError> {
    let c = adamw_candidate(precision, plan, micro, accum);
    Ok(match crate::plan::measure_timed(model, &c, target, EXECUTED_STEPS)? {
        Some(run) => Executed::Ran(run),
        None => Executed::OutOfMemory,
    })
}

/// Parameters of a real-size model (built on the virtual device: nothing is drawn).
pub fn real_params(model: &crate::plan::PlanModel) -> Result<u64, ExperimentError> {
    let device = Device::virtual_device(REAL_CAPACITY);
    Ok(Model::new(&device, model.arch.clone(), 1, DType::F32)?.param_count())
}

/// Least-squares power law `y = c x^e` (a line in log-log); returns (c, e, r^2 of the
/// log-log line). Points with a non-positive coordinate are left out.
pub fn fit_power(xs: &[f64], ys: &[f64]) -> (f64, f64, f64) {
    let (lx, ly): (Vec<f64>, Vec<f64>) = xs
        .iter()
        .zip(ys)
        .filter(|(x, y)| **x > 0.0 && **y > 0.0)
        .map(|(x, y)| (x.ln(), y.ln()))
        .unzip();
    let (a, e, r2) = fit_line(&lx, &ly);
    (a.exp(), e, r2)
}

/// Human bytes of each value, comma-separated.
pub fn bytes_list(v: &[u64]) -> String {
    v.iter().map(|&b| vram_alloc::human_bytes(b)).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod power_tests {
    use super::*;

    #[test]
    fn fit_power_recovers_an_exact_power_law() {
        let xs = [4.0, 8.0, 16.0, 32.0];
        let ys: Vec<f64> = xs.iter().map(|x: &f64| 3.0 * x.powf(0.5)).collect();
        let (c, e, r2) = fit_power(&xs, &ys);
        assert!((c - 3.0).abs() < 1e-9 && (e - 0.5).abs() < 1e-12 && (r2 - 1.0).abs() < 1e-12);
    }

    #[test]
    fn fit_power_tells_a_line_from_a_square_root() {
        let xs = [4.0, 8.0, 16.0, 32.0];
        let (_, e, _) = fit_power(&xs, &xs);
        assert!((e - 1.0).abs() < 1e-12);
    }
}

/// Virtual device memory shared by several caching allocators: each allocator is one process
/// (or one other user) of the same device, and a segment one of them holds, cached or not,
/// is capacity the others cannot get. Addresses and accounting only, as [`VirtualMemory`].
///
/// [`VirtualMemory`]: vram_alloc::VirtualMemory
#[derive(Clone, Debug)]
pub struct SharedMemory(pub std::sync::Arc<vram_alloc::VirtualMemory>);

impl SharedMemory {
    /// A device of `capacity` bytes to share.
    pub fn new(capacity: u64) -> Self {
        SharedMemory(std::sync::Arc::new(vram_alloc::VirtualMemory::new(capacity)))
    }
}

impl vram_alloc::DeviceMemory for SharedMemory {
    type Event = <vram_alloc::VirtualMemory as vram_alloc::DeviceMemory>::Event;

    fn name(&self) -> String {
        format!("shared {}", self.0.name())
    }

    fn allocate(&self, size: usize) -> Result<vram_alloc::DevicePtr, vram_alloc::RawError> {
        self.0.allocate(size)
    }

    unsafe fn deallocate(&self, ptr: vram_alloc::DevicePtr, size: usize) {
        // SAFETY: the caller's contract is the inner memory's.
        unsafe { self.0.deallocate(ptr, size) }
    }

    fn mem_info(&self) -> vram_alloc::MemInfo {
        self.0.mem_info()
    }

    fn record_event(
        &self,
        stream: vram_alloc::Stream,
    ) -> Result<Self::Event, vram_alloc::RawError> {
        self.0.record_event(stream)
    }

    fn event_completed(&self, event: &Self::Event) -> bool {
        self.0.event_completed(event)
    }

    fn synchronize_event(&self, event: &Self::Event) {
        self.0.synchronize_event(event)
    }

    fn destroy_event(&self, event: Self::Event) {
        self.0.destroy_event(event)
    }
}

/// Replays the allocations and frees of a recorded trace (a device's
/// [`trace`](vram_kernels::Device::trace)) on `cache`: each `alloc` allocates its block size,
/// each free drops it (what is still live at the end is dropped then). Returns whether every
/// allocation succeeded (it stops at the first out-of-memory error).
pub fn replay_trace<M: vram_alloc::DeviceMemory>(
    cache: &vram_alloc::CachingAllocator<M>,
    trace: &[vram_alloc::TraceEntry],
) -> Result<bool, ExperimentError> {
    use vram_alloc::TraceAction;
    let mut live = std::collections::HashMap::new();
    for e in trace {
        match e.action {
            TraceAction::Alloc => match cache.allocate(e.size) {
                Ok(a) => {
                    live.insert(e.addr, a);
                }
                Err(vram_alloc::AllocError::OutOfMemory(_)) => return Ok(false),
                Err(err) => return Err(err.into()),
            },
            TraceAction::FreeRequested | TraceAction::FreeCompleted => {
                live.remove(&e.addr);
            }
            _ => {}
        }
    }
    Ok(true)
}

#[cfg(test)]
mod shared_memory_tests {
    use super::*;
    use vram_alloc::CachingAllocator;

    #[test]
    fn a_cache_held_by_one_allocator_is_capacity_the_other_cannot_get() {
        let mem = SharedMemory::new(24 << 20);
        let (first, second) = (CachingAllocator::new(mem.clone()), CachingAllocator::new(mem));
        drop(first.allocate(16 << 20).unwrap());
        assert_eq!(first.memory_reserved(), 16 << 20);
        assert!(second.allocate(16 << 20).is_err());
        first.empty_cache();
        assert!(second.allocate(16 << 20).is_ok());
    }

    #[test]
    fn replaying_a_trace_reproduces_its_reserved_bytes_and_reports_oom() {
        let mem = SharedMemory::new(64 << 20);
        let recorded = CachingAllocator::new(mem);
        recorded.record_history(Some(1000));
        let a = recorded.allocate(12 << 20).unwrap();
        drop(recorded.allocate(30 << 20).unwrap());
        drop(a);
        let trace = recorded.trace();
        let roomy = CachingAllocator::new(SharedMemory::new(64 << 20));
        assert!(replay_trace(&roomy, &trace).unwrap());
        assert_eq!(roomy.max_memory_reserved(), recorded.max_memory_reserved());
        let small = CachingAllocator::new(SharedMemory::new(32 << 20));
        assert!(!replay_trace(&small, &trace).unwrap());
    }
}

/// GPT-2 small shrunk to run in milliseconds (width 64, one block, 16 tokens, vocabulary
/// 100), for tests of the real-size paths.
#[cfg(test)]
pub(crate) fn tiny_gpt2() -> crate::plan::PlanModel {
    let small = crate::plan::ModelOverrides {
        width: Some(64),
        depth: Some(1),
        seq: Some(16),
        vocab: Some(100),
        ..crate::plan::ModelOverrides::default()
    };
    real_model("gpt2-small", &small).unwrap()
}

#[cfg(test)]
mod executed_tests {
    use super::*;
    use crate::plan::{PlanKind, Precision, Target};

    /// The executed path (what runs on a GPU), on the host: the peaks are the virtual
    /// device's prediction (vram's own allocations are the same on every backend), every
    /// step but the first is timed, every micro-batch has a finite loss.
    #[test]
    fn an_executed_real_size_case_times_its_steps_and_matches_the_prediction() {
        let pm = tiny_gpt2();
        for (p, accum) in [(Precision::Fp32, 1), (Precision::AutocastBf16, 2)] {
            let predicted = real_peak(&pm, p, PlanKind::None, 2, accum).unwrap();
            let e = execute(&pm, p, PlanKind::None, (2, accum), Target::Host(1 << 30)).unwrap();
            let r = e.ran().expect("it fits the host");
            assert_eq!((r.allocated, r.reserved), predicted, "{p:?}");
            assert_eq!(r.step_ms.len(), EXECUTED_STEPS as usize - 1, "{p:?}");
            assert!(r.step_ms.iter().all(|&t| t > 0.0), "{p:?}: {:?}", r.step_ms);
            assert_eq!(r.losses.len(), EXECUTED_STEPS as usize * accum, "{p:?}");
            assert!(r.losses.iter().all(|l| l.is_finite() && *l > 0.0), "{r:?}");
            assert!(e.step().is_some() && e.why_not().is_none());
        }
        // A card too small for the step runs out, and says so.
        let e = execute(&pm, Precision::Fp32, PlanKind::None, (2, 1), Target::Host(64 << 10));
        assert_eq!(e.unwrap(), Executed::OutOfMemory);
    }

    #[test]
    fn real_sizes_run_on_the_gpu_only_and_only_where_the_card_holds_them() {
        let pm = tiny_gpt2();
        let host = Context { backend: Backend::Cpu, quick: true, seed: 1, device_memory: 1 << 30 };
        let e = real_executed(&host, &pm, Precision::Fp32, PlanKind::None, (2, 1), 1).unwrap();
        assert_eq!(e, Executed::NotOnGpu);
        assert_eq!((e.step(), e.why_not()), (None, None));
        // A prediction over the card's memory less the context's room is not run (no GPU
        // is touched: the check comes first).
        let card = Backend::Cuda { name: "card".into(), total_bytes: 8 << 30 };
        let gpu = Context { backend: card, quick: true, seed: 1, device_memory: 8 << 30 };
        let need = 7 << 30;
        let e = real_executed(&gpu, &pm, Precision::Fp32, PlanKind::None, (2, 1), need).unwrap();
        assert_eq!(e, Executed::TooLarge { need, usable: 6 << 30 });
        assert!(e.why_not().unwrap().contains("6.00 GiB usable"), "{:?}", e.why_not());
    }
    /// A case the GPU ran through cuDNN, replayed from its record on the virtual device: a
    /// consistency check beside the rows, passed where the peaks agree, failed where not; a
    /// case without a replay adds none.
    #[test]
    fn a_replayed_cuda_case_is_a_consistency_check_beside_its_rows() {
        let host = Context { backend: Backend::Cpu, quick: true, seed: 1, device_memory: 1 << 30 };
        let ran = |allocated, reserved| crate::plan::TimedRun {
            allocated,
            reserved,
            step_ms: vec![1.0],
            losses: vec![1.0],
            cudnn_misses: 0,
            cudnn: None,
        };
        let mut sweep = super::super::Sweep::<()>::new(&host, serde_json::Value::Null);
        for (replayed, gpu) in
            [(Some((10, 20)), (10, 20)), (Some((10, 20)), (11, 20)), (None, (5, 5))]
        {
            let case = RealCase {
                predicted: (1, 2),
                executed: Executed::Ran(ran(gpu.0, gpu.1)),
                replayed,
            };
            push_real_rows(&mut sweep, "case", &case, 8, |_, _, _| ());
        }
        let checks = &sweep.checks;
        assert_eq!(checks.len(), 2, "one per replayed case");
        assert!(checks[0].passed && !checks[1].passed, "{checks:?}");
        assert!(checks[1].measured.contains("11 B on the GPU"), "{}", checks[1].measured);
    }
}
