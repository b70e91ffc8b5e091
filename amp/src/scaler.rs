//! The dynamic loss scaler, with the semantics of `torch.amp.GradScaler`.
//!
//! Per iteration: multiply the loss (or its upstream gradient) by [`LossScaler::scale`],
//! run backward, optionally [`unscale`](LossScaler::unscale) (e.g. to clip), then
//! [`step`](LossScaler::step) each optimizer (skipped when its gradients hold inf/NaN) and
//! [`update`](LossScaler::update) once. The update rule is PyTorch's
//! `_amp_update_scale_`: on overflow `scale *= backoff` and the growth tracker resets; else
//! the tracker counts up and on reaching the growth interval `scale *= growth` (kept only if
//! finite) and the tracker resets. Two extensions: hysteresis (the number of consecutive
//! overflowing iterations before a backoff, as in DeepSpeed; off by default) and the clamps
//! `[min_scale, max_scale]`, which the scale never leaves. Their defaults (the smallest normal
//! f32 and the largest finite one) change nothing PyTorch would do short of underflowing the
//! scale to zero after ~150 overflows in a row, where `1 / scale` becomes infinite.
//!
//! The scaler works on any [`Params`]: the optimizer and its parameters are passed side by
//! side, so the parameters can stay in the layers of a chain.

use crate::error::{Error, Result};
use crate::optim::{Optimizer, OptimizerId};
use crate::param::Params;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use vram_kernels::{Tensor, ops};

/// The scaler's settings. [`Default`] gives PyTorch's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScalerConfig {
    /// The initial scale (PyTorch: 2^16).
    pub init_scale: f32,
    /// Factor applied after `growth_interval` finite iterations in a row (PyTorch: 2.0).
    pub growth_factor: f64,
    /// Factor applied on an overflowing iteration (PyTorch: 0.5).
    pub backoff_factor: f64,
    /// Finite iterations in a row before the scale grows (PyTorch: 2000).
    pub growth_interval: u32,
    /// Overflowing iterations in a row needed before a backoff (1, PyTorch's behaviour,
    /// backs off on every overflow).
    pub hysteresis: u32,
    /// The scale never backs off below this (default: `f32::MIN_POSITIVE`, 2^-126, so that
    /// `1 / scale` stays finite).
    pub min_scale: f32,
    /// The scale never grows above this (default: `f32::MAX`).
    pub max_scale: f32,
    /// A disabled scaler is a transparent pass-through (for bf16 or f32 training).
    pub enabled: bool,
}

impl Default for ScalerConfig {
    fn default() -> ScalerConfig {
        ScalerConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            hysteresis: 1,
            min_scale: f32::MIN_POSITIVE,
            max_scale: f32::MAX,
            enabled: true,
        }
    }
}

impl ScalerConfig {
    /// Checks every setting's domain.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the first setting outside its domain.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &'static str, reason: String| Err(Error::InvalidConfig { what, reason });
        let positive = |v: f32| v.is_finite() && v > 0.0;
        if !positive(self.init_scale) {
            return bad("init_scale", format!("must be finite and > 0, got {}", self.init_scale));
        }
        if !(self.growth_factor.is_finite() && self.growth_factor > 1.0) {
            return bad("growth_factor", format!("must be > 1, got {}", self.growth_factor));
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return bad(
                "backoff_factor",
                format!("must be in (0, 1), got {}", self.backoff_factor),
            );
        }
        if self.growth_interval == 0 {
            return bad("growth_interval", "must be at least 1".into());
        }
        if self.hysteresis == 0 {
            return bad("hysteresis", "must be at least 1 (1 backs off on every overflow)".into());
        }
        let (lo, hi) = (self.min_scale, self.max_scale);
        if !(positive(lo) && inverse(lo).is_finite()) {
            return bad(
                "min_scale",
                format!("must be finite, > 0 and have a finite inverse in f32, got {lo}"),
            );
        }
        if !(positive(hi) && lo <= self.init_scale && self.init_scale <= hi) {
            return bad(
                "min_scale/max_scale",
                format!(
                    "need min_scale <= init_scale <= max_scale, all finite, got {lo} <= {} <= {hi}",
                    self.init_scale
                ),
            );
        }
        Ok(())
    }

    /// Whether `scale` lies in `[min_scale, max_scale]`.
    fn admits(&self, scale: f32) -> bool {
        (self.min_scale..=self.max_scale).contains(&scale)
    }
}

/// `1 / scale` computed in f64 and rounded to f32 (PyTorch's
/// `scale.double().reciprocal().float()`).
fn inverse(scale: f32) -> f32 {
    (1.0 / f64::from(scale)) as f32
}

/// When the scale changed.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScaleChange {
    /// The number of updates done when the scale took this value (0: the initial scale).
    pub update: u64,
    /// The new scale.
    pub scale: f32,
}

/// Counters users want to plot.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ScalerCounters {
    /// Calls of [`LossScaler::update`] (and `update_to`).
    pub updates: u64,
    /// Optimizer steps taken.
    pub steps_taken: u64,
    /// Optimizer steps skipped because of inf/NaN gradients.
    pub steps_skipped: u64,
    /// Updates of an iteration in which some optimizer found inf/NaN.
    pub overflow_updates: u64,
    /// Every scale the scaler has had, with the update that set it.
    pub scale_history: Vec<ScaleChange>,
}

/// Everything that persists across iterations; serializes and restores exactly.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScalerState {
    /// The settings.
    pub config: ScalerConfig,
    /// The current scale.
    pub scale: f32,
    /// Finite iterations in a row since the last growth or overflow.
    pub growth_tracker: u32,
    /// Overflowing iterations in a row (for hysteresis).
    pub consecutive_overflows: u32,
    /// The counters.
    pub counters: ScalerCounters,
}

/// Where an optimizer is in the current iteration (PyTorch's `OptState`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptState {
    /// Neither unscaled nor stepped since the last update.
    Ready,
    /// Gradients unscaled; not stepped yet.
    Unscaled,
    /// Stepped (or skipped) since the last update.
    Stepped,
}

/// What [`LossScaler::step`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepOutcome {
    /// The optimizer updated its parameters.
    Stepped,
    /// Gradients held inf/NaN; nothing was updated.
    Skipped,
}

#[derive(Clone, Copy, Debug)]
struct PerOptimizer {
    stage: OptState,
    found_inf: bool,
}

/// The dynamic loss scaler. See the [module documentation](self) for the protocol.
#[derive(Debug)]
pub struct LossScaler {
    state: ScalerState,
    per_optimizer: HashMap<OptimizerId, PerOptimizer>,
}

impl Default for LossScaler {
    /// PyTorch's defaults: init 2^16, growth 2, backoff 0.5, interval 2000.
    fn default() -> LossScaler {
        LossScaler::from_valid(ScalerConfig::default())
    }
}

impl LossScaler {
    fn from_valid(config: ScalerConfig) -> LossScaler {
        let scale = config.init_scale;
        let counters = ScalerCounters {
            scale_history: vec![ScaleChange { update: 0, scale }],
            ..ScalerCounters::default()
        };
        let state =
            ScalerState { config, scale, growth_tracker: 0, consecutive_overflows: 0, counters };
        LossScaler { state, per_optimizer: HashMap::new() }
    }

    /// A scaler with `config`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] (see [`ScalerConfig::validate`]).
    pub fn new(config: ScalerConfig) -> Result<LossScaler> {
        config.validate()?;
        Ok(LossScaler::from_valid(config))
    }

    /// A pass-through scaler: scale 1, no unscaling, every step taken, updates do nothing.
    pub fn disabled() -> LossScaler {
        LossScaler::from_valid(ScalerConfig { enabled: false, ..ScalerConfig::default() })
    }

    /// Whether the scaler is enabled.
    pub fn is_enabled(&self) -> bool {
        self.state.config.enabled
    }

    /// The settings.
    pub fn config(&self) -> &ScalerConfig {
        &self.state.config
    }

    /// The current scale (1 when disabled, as PyTorch's `get_scale`).
    pub fn scale(&self) -> f32 {
        if self.is_enabled() { self.state.scale } else { 1.0 }
    }

    /// `1 / scale`, computed in f64 and rounded to f32 (PyTorch's
    /// `scale.double().reciprocal().float()`).
    pub fn inv_scale(&self) -> f32 {
        inverse(self.scale())
    }

    /// Finite iterations in a row since the last growth or overflow.
    pub fn growth_tracker(&self) -> u32 {
        self.state.growth_tracker
    }

    /// The counters: steps taken and skipped, scale history.
    pub fn counters(&self) -> &ScalerCounters {
        &self.state.counters
    }

    /// `loss * scale` (the loss unchanged when disabled).
    pub fn scale_loss(&self, loss: f32) -> f32 {
        if self.is_enabled() { loss * self.state.scale } else { loss }
    }

    /// `t * scale` as a new tensor (a copy of `t` when disabled).
    ///
    /// # Errors
    ///
    /// Out of memory.
    pub fn scale_tensor(&self, t: &Tensor) -> Result<Tensor> {
        if self.is_enabled() { Ok(ops::scale(t, self.state.scale)?) } else { Ok(t.clone()) }
    }

    /// `optimizer`'s stage in the current iteration.
    pub fn stage(&self, optimizer: OptimizerId) -> OptState {
        self.per_optimizer.get(&optimizer).map_or(OptState::Ready, |s| s.stage)
    }

    /// Whether `optimizer`'s gradients held inf/NaN this iteration, once unscaled.
    pub fn found_inf(&self, optimizer: OptimizerId) -> Option<bool> {
        self.per_optimizer
            .get(&optimizer)
            .filter(|s| s.stage != OptState::Ready)
            .map(|s| s.found_inf)
    }

    /// Divides the gradients of `params`, which `optimizer` will step, by the scale in place
    /// (one fused pass that also detects inf/NaN) and returns whether any was non-finite. Use
    /// it before clipping or inspecting gradients; [`step`](Self::step) calls it when it was
    /// not called. A no-op returning `false` when disabled.
    ///
    /// # Errors
    ///
    /// [`Error::AlreadyUnscaled`], [`Error::UnscaleAfterStep`]; tensor errors (gradients
    /// left partly unscaled then).
    pub fn unscale<O: Optimizer + ?Sized>(
        &mut self,
        optimizer: &O,
        params: &mut dyn Params,
    ) -> Result<bool> {
        if !self.is_enabled() {
            return Ok(false);
        }
        let id = optimizer.id();
        match self.stage(id) {
            OptState::Unscaled => return Err(Error::AlreadyUnscaled { optimizer: id }),
            OptState::Stepped => return Err(Error::UnscaleAfterStep { optimizer: id }),
            OptState::Ready => {}
        }
        let inv_scale = self.inv_scale();
        let found_inf = ops::unscale_and_check_finite(&mut params.grads_mut(), inv_scale)?;
        self.per_optimizer.insert(id, PerOptimizer { stage: OptState::Unscaled, found_inf });
        Ok(found_inf)
    }

    /// Steps `optimizer` on `params` unless their gradients hold inf/NaN, unscaling them
    /// first if [`unscale`](Self::unscale) was not called. When disabled, steps
    /// unconditionally.
    ///
    /// # Errors
    ///
    /// [`Error::AlreadyStepped`]; errors of `unscale` and of the optimizer's step.
    pub fn step<O: Optimizer + ?Sized>(
        &mut self,
        optimizer: &mut O,
        params: &mut dyn Params,
    ) -> Result<StepOutcome> {
        if !self.is_enabled() {
            optimizer.step(params)?;
            self.state.counters.steps_taken += 1;
            return Ok(StepOutcome::Stepped);
        }
        let id = optimizer.id();
        match self.stage(id) {
            OptState::Stepped => return Err(Error::AlreadyStepped { optimizer: id }),
            OptState::Ready => {
                self.unscale(optimizer, params)?;
            }
            OptState::Unscaled => {}
        }
        let found_inf = self.per_optimizer.get(&id).is_some_and(|e| e.found_inf);
        let outcome = if found_inf {
            self.state.counters.steps_skipped += 1;
            StepOutcome::Skipped
        } else {
            optimizer.step(params)?;
            self.state.counters.steps_taken += 1;
            StepOutcome::Stepped
        };
        self.per_optimizer.insert(id, PerOptimizer { stage: OptState::Stepped, found_inf });
        Ok(outcome)
    }

    /// Ends the iteration: backs off if any optimizer found inf/NaN (after `hysteresis`
    /// overflowing iterations in a row, never below `min_scale`), otherwise counts towards
    /// growth (never above `max_scale`); then every optimizer is ready again. A no-op when
    /// disabled.
    ///
    /// # Errors
    ///
    /// [`Error::NoInfChecks`] if no optimizer was unscaled or stepped since the last update.
    pub fn update(&mut self) -> Result<()> {
        if !self.is_enabled() {
            return Ok(());
        }
        if self.per_optimizer.is_empty() {
            return Err(Error::NoInfChecks);
        }
        let found_inf = self.per_optimizer.values().any(|s| s.found_inf);
        self.per_optimizer.clear();
        let s = &mut self.state;
        let cfg = &s.config;
        let old = s.scale;
        if found_inf {
            s.growth_tracker = 0;
            s.consecutive_overflows = s.consecutive_overflows.saturating_add(1);
            if s.consecutive_overflows >= cfg.hysteresis {
                let backed = (f64::from(s.scale) * cfg.backoff_factor) as f32;
                s.scale = backed.max(cfg.min_scale);
            }
            s.counters.overflow_updates += 1;
        } else {
            s.consecutive_overflows = 0;
            let successful = s.growth_tracker + 1;
            if successful == cfg.growth_interval {
                let grown = (f64::from(s.scale) * cfg.growth_factor) as f32;
                if grown.is_finite() {
                    s.scale = grown.min(cfg.max_scale);
                }
                s.growth_tracker = 0;
            } else {
                s.growth_tracker = successful;
            }
        }
        self.finish_update(old);
        Ok(())
    }

    /// Ends the iteration setting the scale to `new_scale` (PyTorch's
    /// `update(new_scale)`); the growth tracker is kept. A no-op when disabled.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] unless `new_scale` lies in `[min_scale, max_scale]`.
    pub fn update_to(&mut self, new_scale: f32) -> Result<()> {
        if !self.is_enabled() {
            return Ok(());
        }
        let cfg = &self.state.config;
        if !cfg.admits(new_scale) {
            return Err(Error::InvalidConfig {
                what: "update_to",
                reason: format!(
                    "the new scale must lie in [min_scale, max_scale] = [{}, {}], got {new_scale}",
                    cfg.min_scale, cfg.max_scale
                ),
            });
        }
        self.per_optimizer.clear();
        let old = self.state.scale;
        self.state.scale = new_scale;
        self.finish_update(old);
        Ok(())
    }

    fn finish_update(&mut self, old: f32) {
        let c = &mut self.state.counters;
        c.updates += 1;
        if self.state.scale.to_bits() != old.to_bits() {
            c.scale_history.push(ScaleChange { update: c.updates, scale: self.state.scale });
        }
    }

    /// The persistent state (PyTorch's `state_dict`), for checkpoints.
    pub fn state(&self) -> &ScalerState {
        &self.state
    }

    /// A scaler restored from `state`; every optimizer starts ready. Every state a scaler
    /// reaches restores.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for invalid settings, a scale outside
    /// `[min_scale, max_scale]`, or a growth tracker not below the interval.
    pub fn from_state(state: ScalerState) -> Result<LossScaler> {
        state.config.validate()?;
        if !state.config.admits(state.scale) {
            return Err(Error::InvalidConfig {
                what: "ScalerState::scale",
                reason: format!(
                    "must lie in [min_scale, max_scale] = [{}, {}], got {}",
                    state.config.min_scale, state.config.max_scale, state.scale
                ),
            });
        }
        if state.growth_tracker >= state.config.growth_interval {
            return Err(Error::InvalidConfig {
                what: "ScalerState::growth_tracker",
                reason: format!(
                    "must be below growth_interval {}, got {}",
                    state.config.growth_interval, state.growth_tracker
                ),
            });
        }
        Ok(LossScaler { state, per_optimizer: HashMap::new() })
    }
}
