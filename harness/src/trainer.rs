//! The trainer: a model, its optimizer and data, composed with vram-amp (precision, loss
//! scaling, f32 master weights) and vram-accum (gradient accumulation, checkpoint plan), with
//! hooks on batch end and epoch end.

use crate::ExperimentError;
use crate::data::{Dataset, Loader};
use crate::models::{Model, PeakGrads};
use std::time::Instant;
use vram_accum::{CheckpointPlan, ForwardCtx, GradAccumulator, Mode, Normalization, Schedule};
use vram_amp::{AdamW, LossScaler, Optimizer, ScalerConfig, Sgd, StepOutcome};
use vram_kernels::{AdamWConfig, DType, SgdConfig};

/// `Result` with the trainer's error, which keeps where an error came from (a layer, the
/// scaler, the optimizer), so that [`ExperimentError::is_out_of_memory`] holds for an
/// out-of-memory error raised anywhere in a step.
pub type Result<T, E = ExperimentError> = std::result::Result<T, E>;

/// vram-amp's AdamW with PyTorch's defaults (betas 0.9 / 0.999, eps 1e-8, weight decay 0.01)
/// at learning rate `lr`. Its state is created at each parameter's first step; 16-bit
/// parameters get an f32 master copy, f32 parameters none.
pub fn adamw(lr: f32) -> AdamW {
    AdamW::new(AdamWConfig { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 })
}

/// vram-amp's SGD with momentum 0.9 at learning rate `lr`.
pub fn sgd(lr: f32) -> Sgd {
    Sgd::new(SgdConfig { lr, momentum: 0.9, dampening: 0.0, weight_decay: 0.0, nesterov: false })
}

/// The numeric precision of a run.
#[derive(Clone, Debug)]
pub enum Precision {
    /// Everything in f32.
    F32,
    /// Full 16-bit: f16 weights and activations, f32 master weights, dynamic loss scaling.
    F16(ScalerConfig),
    /// Full 16-bit: bf16 weights and activations, f32 master weights, no loss scaling.
    Bf16,
    /// Autocast, as `torch.autocast` / `torch.cuda.amp`: f32 parameters (no master copy, f32
    /// gradients and optimizer state), linear and matmul in `low`, layer norm, softmax and
    /// the loss in f32, with the loss scaler when `scaler` is set (f16: yes, bf16: no).
    Autocast {
        /// The low dtype (f16 or bf16).
        low: DType,
        /// Dynamic loss scaling, if any.
        scaler: Option<ScalerConfig>,
    },
}

impl Precision {
    /// The dtype of the model's parameters (f32 under autocast).
    pub fn dtype(&self) -> DType {
        match self {
            Precision::F32 | Precision::Autocast { .. } => DType::F32,
            Precision::F16(_) => DType::F16,
            Precision::Bf16 => DType::BF16,
        }
    }

    /// The low dtype of autocast, `None` for the other precisions.
    pub fn autocast(&self) -> Option<DType> {
        match self {
            Precision::Autocast { low, .. } => Some(*low),
            _ => None,
        }
    }

    /// The loss scaler's settings, if the run scales its loss.
    pub fn scaler(&self) -> Option<&ScalerConfig> {
        match self {
            Precision::F16(c) => Some(c),
            Precision::Autocast { scaler, .. } => scaler.as_ref(),
            _ => None,
        }
    }
}

/// How to train.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    /// Samples per optimizer step (the effective batch).
    pub batch: usize,
    /// Micro-batches per optimizer step (gradient accumulation; 1 = none).
    pub accumulation: usize,
    /// Activation checkpointing plan for the model's chain.
    pub checkpoint: CheckpointPlan,
    /// Precision.
    pub precision: Precision,
    /// AdamW learning rate.
    pub lr: f32,
    /// Optimizer steps per epoch (for the epoch-end hook).
    pub steps_per_epoch: usize,
    /// Batches the loader prepares ahead on its worker thread.
    pub prefetch: usize,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            batch: 16,
            accumulation: 1,
            checkpoint: CheckpointPlan::None,
            precision: Precision::F32,
            lr: 1e-3,
            steps_per_epoch: 100,
            prefetch: 2,
        }
    }
}

/// What one optimizer step did.
#[derive(Clone, Debug)]
pub struct BatchEnd {
    /// Step number, from 0.
    pub step: usize,
    /// Mean loss over the step's samples.
    pub loss: f32,
    /// Wall time of the step in milliseconds (device synchronised).
    pub step_ms: f64,
    /// Whether the loss scaler skipped the update (inf/NaN gradients).
    pub skipped: bool,
    /// Bytes allocated at the end of the step.
    pub allocated: u64,
    /// Bytes reserved at the end of the step.
    pub reserved: u64,
}

/// Callbacks during training. Every method has an empty default.
pub trait Hooks {
    /// After backward, before the optimizer step: the accumulated gradients are in the
    /// model's parameters.
    fn on_backward_end(&mut self, _step: usize, _model: &Model) {}
    /// After each optimizer step.
    fn on_batch_end(&mut self, _end: &BatchEnd) {}
    /// After every `steps_per_epoch` steps.
    fn on_epoch_end(&mut self, _epoch: usize) {}
}

/// Hooks that do nothing.
pub struct NoHooks;

impl Hooks for NoHooks {}

/// Bytes by category, for memory breakdowns.
#[derive(Clone, Copy, Debug, Default)]
pub struct StateBytes {
    /// Model weights (in the compute dtype; f32 under autocast).
    pub weights: u64,
    /// Autocast's 16-bit copies of the weights, as cached when the last forward ended (0
    /// without autocast).
    pub weight_copies: u64,
    /// f32 master weights (0 in f32 runs).
    pub master: u64,
    /// Gradients after the last backward.
    pub grads: u64,
    /// Gradients that existed when the run's peak allocation was reached (at the start of
    /// the phase it rose in: [`PeakGrads`]); `zero_grad` frees them each step, so a model
    /// that peaks as backward begins holds few of them then.
    pub grads_at_peak: u64,
    /// Optimizer state.
    pub optimizer: u64,
}

/// A model being trained.
pub struct Trainer {
    model: Model,
    cfg: TrainConfig,
    /// vram-amp's AdamW: f32 masters of 16-bit weights, none for f32 ones.
    optimizer: AdamW,
    scaler: Option<LossScaler>,
    schedule: Schedule,
    accumulator: GradAccumulator,
    loader: Loader,
    seed: u64,
    step: usize,
    grad_bytes: u64,
    peaks: PeakGrads,
}

fn invalid(reason: String) -> ExperimentError {
    ExperimentError::Setup(format!("Trainer: {reason}"))
}

impl Trainer {
    /// A trainer for `model` (built in `cfg.precision`'s dtype; under autocast the trainer
    /// puts the model under it) on `dataset`.
    pub fn new(mut model: Model, dataset: Dataset, seed: u64, cfg: TrainConfig) -> Result<Self> {
        if cfg.batch == 0 || cfg.accumulation == 0 || !cfg.batch.is_multiple_of(cfg.accumulation) {
            return Err(invalid(format!(
                "the batch ({}) must be a positive multiple of the micro-batches per step ({})",
                cfg.batch, cfg.accumulation
            )));
        }
        let dtype = cfg.precision.dtype();
        if model.params().first().is_some_and(|p| p.value.dtype() != dtype) {
            return Err(invalid(format!("the model is not in {dtype}, the run's precision")));
        }
        model.set_autocast(cfg.precision.autocast())?;
        let optimizer = adamw(cfg.lr);
        let scaler = match cfg.precision.scaler() {
            Some(c) => Some(LossScaler::new(c.clone())?),
            None => None,
        };
        let micro = cfg.batch / cfg.accumulation;
        let schedule = match &cfg.checkpoint {
            CheckpointPlan::None => Schedule::none(model.chain_len())?,
            plan => {
                let first = dataset.batch(seed, 0, micro);
                let profile = model.profile(&first, seed)?;
                plan.schedule(&profile)?
            }
        };
        let accumulator = GradAccumulator::new(cfg.accumulation, Normalization::Mean)?;
        let loader = Loader::new(dataset, seed, cfg.batch, 0, cfg.prefetch);
        Ok(Trainer {
            model,
            cfg,
            optimizer,
            scaler,
            schedule,
            accumulator,
            loader,
            seed,
            step: 0,
            grad_bytes: 0,
            peaks: PeakGrads::default(),
        })
    }

    /// The model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The model, mutably (evaluation between steps).
    pub fn model_mut(&mut self) -> &mut Model {
        &mut self.model
    }

    /// The checkpoint schedule in use.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The loss scaler, in runs that scale their loss.
    pub fn scaler(&self) -> Option<&LossScaler> {
        self.scaler.as_ref()
    }

    /// Bytes of weights, master weights, gradients and optimizer state.
    pub fn state_bytes(&self) -> StateBytes {
        StateBytes {
            weights: self.model.param_bytes(),
            weight_copies: self.model.cast_cache_bytes(),
            master: self.optimizer.master_bytes(),
            grads: self.grad_bytes,
            grads_at_peak: self.peaks.grads_at_peak(),
            optimizer: self.optimizer.state_bytes(),
        }
    }

    /// One optimizer step: `accumulation` micro-batches, then the update.
    pub fn step(&mut self, hooks: &mut dyn Hooks) -> Result<BatchEnd> {
        let device = self.model.device().clone();
        let batch = self.loader.next_batch();
        let started = Instant::now();
        let micro = batch.split(self.cfg.accumulation);
        let items: Vec<u64> = micro.iter().map(|m| m.targets.len() as u64).collect();
        let scale = self.scaler.as_ref().map_or(1.0, LossScaler::scale);
        let mut loss = 0.0;
        for window in self.accumulator.windows(&items)? {
            let factor = window.factor(Normalization::Mean);
            for i in window.micro_batches() {
                let mut ctx = ForwardCtx::new(Mode::Train, self.seed ^ self.step as u64);
                let out = self.model.train_step_tracked(
                    &micro[i],
                    &mut ctx,
                    factor * scale,
                    &self.schedule,
                    &mut self.peaks,
                )?;
                loss += out.loss * micro[i].targets.len() as f32 / batch.targets.len() as f32;
            }
        }
        self.grad_bytes = self
            .model
            .params()
            .iter()
            .filter_map(|p| p.grad.as_ref())
            .map(|g| g.size_in_bytes() as u64)
            .sum();
        hooks.on_backward_end(self.step, &self.model);
        let mut skipped = false;
        match &mut self.scaler {
            Some(s) => {
                skipped = s.step(&mut self.optimizer, &mut self.model)? == StepOutcome::Skipped;
                s.update()?;
            }
            None => self.optimizer.step(&mut self.model)?,
        }
        self.model.zero_grad();
        device.synchronize()?;
        // The optimizer's phase ends.
        self.peaks.mark(device.max_memory_allocated(), 0);
        let end = BatchEnd {
            step: self.step,
            loss,
            step_ms: started.elapsed().as_secs_f64() * 1e3,
            skipped,
            allocated: device.memory_allocated(),
            reserved: device.memory_reserved(),
        };
        hooks.on_batch_end(&end);
        self.step += 1;
        if self.step.is_multiple_of(self.cfg.steps_per_epoch.max(1)) {
            hooks.on_epoch_end(self.step / self.cfg.steps_per_epoch.max(1) - 1);
        }
        Ok(end)
    }

    /// `steps` optimizer steps.
    pub fn run(&mut self, steps: usize, hooks: &mut dyn Hooks) -> Result<Vec<BatchEnd>> {
        (0..steps).map(|_| self.step(hooks)).collect()
    }
}
