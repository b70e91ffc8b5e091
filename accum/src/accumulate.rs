//! Gradient accumulation: several micro-batches per optimizer step.
//!
//! An epoch of micro-batches is cut into windows of `k` (the last may be shorter); each
//! window ends in one optimizer step. Every micro-batch's backward is started with a loss
//! gradient `dloss = factor * multiplier`: the `factor` normalizes the window's summed
//! gradient ([`Normalization`]), the `multiplier` is the hooks' (a loss scale, fixed for the
//! whole window). Because the window is known before its first backward, every factor is
//! final when it is used, and no gradient has to be rescaled afterwards.
//!
//! [`GradAccumulator::run_epoch`] lends the model (a [`Chain`](crate::Chain), or anything
//! else) to the micro-batch closure and to the hooks in turn, so neither has to capture it
//! and no `RefCell` is needed. [`StepHooks`] are the hooks of a usual loop: loss scale at the
//! window's start; unscale, optional clipping, optimizer step, scale update and `zero_grad`
//! at its end.

use crate::error::{Error, Result};
use vram_amp::{LossScaler, Optimizer, Params, StepOutcome, clip_grad_norm};

/// How the gradients of a window's micro-batches are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Normalization {
    /// Each micro-batch loss is a mean over its items; the window's gradient is the mean
    /// over its micro-batches (`factor = 1 / micro-batches in the window`). Equals the
    /// full-batch mean only when every micro-batch holds as many items.
    Mean,
    /// Each micro-batch loss is a sum over its items; the gradients add up (`factor = 1`).
    Sum,
    /// Each micro-batch loss is a sum over its items; the window's gradient is divided by the
    /// number of items in the whole window (`factor = 1 / items in the window`): the
    /// full-batch per-item mean, also when micro-batches hold different numbers of items
    /// (tokens).
    GlobalCount,
}

/// One optimizer step's worth of micro-batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    /// Index of the window in the epoch.
    pub index: usize,
    /// Index of its first micro-batch in the epoch.
    pub first: usize,
    /// Number of micro-batches (`k`, or fewer for the last window of an epoch).
    pub len: usize,
    /// Number of items (rows, tokens) in all of its micro-batches.
    pub items: u64,
}

impl Window {
    /// The micro-batch indices of the window.
    pub fn micro_batches(&self) -> std::ops::Range<usize> {
        self.first..self.first + self.len
    }

    /// The factor a micro-batch's loss gradient is multiplied by under `norm`, for the loss
    /// as that normalization defines it (a mean for [`Normalization::Mean`], a sum
    /// otherwise).
    pub fn factor(&self, norm: Normalization) -> f32 {
        match norm {
            Normalization::Mean => 1.0 / self.len as f32,
            Normalization::Sum => 1.0,
            Normalization::GlobalCount => 1.0 / self.items.max(1) as f32,
        }
    }
}

/// Hooks around each window, given the model `M` the epoch runs on: e.g. a dynamic loss
/// scaler reads the scale once at the window's start, then unscales, checks for overflow
/// and steps (or skips) only at its end.
pub trait WindowHooks<M: ?Sized> {
    /// Called before the window's first micro-batch; returns the loss multiplier used for
    /// every micro-batch of the window (the loss scale, or 1).
    ///
    /// # Errors
    ///
    /// Whatever the hook fails with; the epoch stops.
    fn on_window_start(&mut self, model: &mut M, window: &Window) -> Result<f32> {
        let _ = (model, window);
        Ok(1.0)
    }

    /// Called after the window's last micro-batch: the optimizer step, unscaling, scale
    /// update, `zero_grad`.
    ///
    /// # Errors
    ///
    /// Whatever the hook fails with; the epoch stops.
    fn on_window_end(&mut self, model: &mut M, window: &Window) -> Result<()>;
}

/// Closures as [`WindowHooks`]: `start` returns the window's loss multiplier, `end` steps.
pub struct FnHooks<S, E> {
    /// Called at each window start.
    pub start: S,
    /// Called at each window end.
    pub end: E,
}

impl<M, S, E> WindowHooks<M> for FnHooks<S, E>
where
    M: ?Sized,
    S: FnMut(&mut M, &Window) -> Result<f32>,
    E: FnMut(&mut M, &Window) -> Result<()>,
{
    fn on_window_start(&mut self, model: &mut M, window: &Window) -> Result<f32> {
        (self.start)(model, window)
    }

    fn on_window_end(&mut self, model: &mut M, window: &Window) -> Result<()> {
        (self.end)(model, window)
    }
}

/// What the last window's end did, as [`StepHooks`] report it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// Whether the optimizer stepped or the scaler skipped the step (inf/NaN gradients).
    pub outcome: StepOutcome,
    /// The scale the window's losses were multiplied by.
    pub scale: f32,
    /// The global gradient norm before clipping, when clipping.
    pub grad_norm: Option<f32>,
}

/// The hooks of a usual training loop on any [`Params`] model: each window's loss
/// multiplier is the scaler's scale; at its end the gradients are unscaled, optionally
/// clipped, the optimizer steps (or the scaler skips the step), the scale is updated and the
/// gradients are dropped. Use a [`LossScaler::disabled`] scaler for f32 or bf16.
#[derive(Debug)]
pub struct StepHooks<O> {
    /// The update rule.
    pub optimizer: O,
    /// The loss scaler.
    pub scaler: LossScaler,
    max_grad_norm: Option<f32>,
    last: Option<StepReport>,
}

impl<O: Optimizer> StepHooks<O> {
    /// Hooks stepping `optimizer` under `scaler`, without clipping.
    pub fn new(optimizer: O, scaler: LossScaler) -> Self {
        StepHooks { optimizer, scaler, max_grad_norm: None, last: None }
    }

    /// Clips the global gradient norm to `max_norm` (after unscaling) before each step.
    ///
    /// # Errors
    ///
    /// [`vram_amp::Error::InvalidMaxNorm`] (as [`Error::Amp`]) for a negative or NaN bound.
    pub fn with_max_grad_norm(mut self, max_norm: f32) -> Result<Self> {
        if max_norm.is_nan() || max_norm < 0.0 {
            return Err(vram_amp::Error::InvalidMaxNorm { max_norm }.into());
        }
        self.max_grad_norm = Some(max_norm);
        Ok(self)
    }

    /// What the last window's end did (`None` before the first).
    pub fn last_step(&self) -> Option<StepReport> {
        self.last
    }
}

impl<M: Params, O: Optimizer> WindowHooks<M> for StepHooks<O> {
    fn on_window_start(&mut self, _model: &mut M, _window: &Window) -> Result<f32> {
        Ok(self.scaler.scale())
    }

    fn on_window_end(&mut self, model: &mut M, _window: &Window) -> Result<()> {
        let scale = self.scaler.scale();
        let grad_norm = match self.max_grad_norm {
            Some(max) => {
                self.scaler.unscale(&self.optimizer, model)?;
                Some(clip_grad_norm(model, max)?)
            }
            None => None,
        };
        let outcome = self.scaler.step(&mut self.optimizer, model)?;
        self.scaler.update()?;
        model.zero_grad();
        self.last = Some(StepReport { outcome, scale, grad_norm });
        Ok(())
    }
}

/// What one micro-batch is told: where it is and the loss gradient to start backward with.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MicroStep {
    /// Index of the micro-batch in the epoch.
    pub micro_batch: usize,
    /// The window it belongs to.
    pub window: Window,
    /// The gradient of the micro-batch's loss (mean or sum, per the normalization) to
    /// backpropagate: `window.factor(norm) * multiplier`.
    pub dloss: f32,
}

/// Cuts epochs into windows of `k` micro-batches and drives them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GradAccumulator {
    k: usize,
    norm: Normalization,
}

impl GradAccumulator {
    /// An accumulator of `k` micro-batches per optimizer step.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if `k == 0`.
    pub fn new(k: usize, norm: Normalization) -> Result<Self> {
        if k == 0 {
            return Err(Error::InvalidArgument {
                what: "GradAccumulator::new",
                reason: "k = 0 micro-batches per step; use k >= 1".into(),
            });
        }
        Ok(GradAccumulator { k, norm })
    }

    /// Micro-batches per optimizer step.
    pub fn k(&self) -> usize {
        self.k
    }

    /// The normalization.
    pub fn normalization(&self) -> Normalization {
        self.norm
    }

    /// The windows of an epoch whose micro-batches hold `items[i]` items each: windows of
    /// `k`, the last one shorter when `k` does not divide the epoch.
    ///
    /// # Errors
    ///
    /// [`Error::ItemCountOverflow`] if a window's items add up past `u64::MAX`.
    pub fn windows(&self, items: &[u64]) -> Result<Vec<Window>> {
        items
            .chunks(self.k)
            .enumerate()
            .map(|(index, chunk)| {
                let first = index * self.k;
                let items = chunk
                    .iter()
                    .try_fold(0u64, |sum, &n| sum.checked_add(n))
                    .ok_or(Error::ItemCountOverflow { window: index, first })?;
                Ok(Window { index, first, len: chunk.len(), items })
            })
            .collect()
    }

    /// Runs an epoch on `model`: for each window, `hooks.on_window_start` (once: its
    /// multiplier holds for the whole window), then `micro(model, step)` for each micro-batch
    /// (forward, loss, backward with `step.dloss`), then `hooks.on_window_end`. Returns the
    /// number of optimizer steps.
    ///
    /// # Errors
    ///
    /// The first error of a hook or a micro-batch, which stops the epoch;
    /// [`Error::ItemCountOverflow`] (before any micro-batch runs); [`Error::InvalidArgument`]
    /// if a window of [`Normalization::GlobalCount`] holds no item.
    pub fn run_epoch<M, H>(
        &self,
        items: &[u64],
        model: &mut M,
        hooks: &mut H,
        mut micro: impl FnMut(&mut M, MicroStep) -> Result<()>,
    ) -> Result<usize>
    where
        M: ?Sized,
        H: WindowHooks<M> + ?Sized,
    {
        let windows = self.windows(items)?;
        for window in &windows {
            if self.norm == Normalization::GlobalCount && window.items == 0 {
                return Err(Error::InvalidArgument {
                    what: "GradAccumulator::run_epoch",
                    reason: format!(
                        "window {} holds no item, so its per-item mean is undefined",
                        window.index
                    ),
                });
            }
            let multiplier = hooks.on_window_start(model, window)?;
            let dloss = window.factor(self.norm) * multiplier;
            for micro_batch in window.micro_batches() {
                micro(model, MicroStep { micro_batch, window: *window, dloss })?;
            }
            hooks.on_window_end(model, window)?;
        }
        Ok(windows.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_window_of_an_epoch_is_shorter_and_normalized_by_its_own_length() {
        let acc = GradAccumulator::new(4, Normalization::Mean).unwrap();
        let w = acc.windows(&[1; 10]).unwrap();
        assert_eq!(w.iter().map(|w| w.len).collect::<Vec<_>>(), [4, 4, 2]);
        assert_eq!(w[2].micro_batches(), 8..10);
        assert_eq!(w[2].factor(Normalization::Mean), 0.5);
        assert_eq!(w[0].factor(Normalization::Mean), 0.25);
    }

    #[test]
    fn global_count_factor_is_one_over_the_window_items() {
        let acc = GradAccumulator::new(2, Normalization::GlobalCount).unwrap();
        let w = acc.windows(&[3, 5, 7]).unwrap();
        assert_eq!((w[0].items, w[1].items), (8, 7));
        assert_eq!(w[0].factor(Normalization::GlobalCount), 1.0 / 8.0);
        assert_eq!(w[1].factor(Normalization::Sum), 1.0);
    }

    #[test]
    fn zero_k_and_empty_global_count_windows_are_errors() {
        assert!(GradAccumulator::new(0, Normalization::Sum).is_err());
        let acc = GradAccumulator::new(2, Normalization::GlobalCount).unwrap();
        let mut hooks = FnHooks {
            start: |_: &mut (), _: &Window| Ok(1.0),
            end: |_: &mut (), _: &Window| Ok(()),
        };
        assert!(acc.run_epoch(&[0, 0], &mut (), &mut hooks, |_, _| Ok(())).is_err());
    }

    /// Regression: item counts that add up past `u64::MAX` used to overflow (a panic in debug
    /// builds, a wrapped count and a wrong factor in release).
    #[test]
    fn item_counts_that_overflow_are_an_error_before_any_micro_batch_runs() {
        let acc = GradAccumulator::new(2, Normalization::GlobalCount).unwrap();
        let e = acc.windows(&[5, 6, u64::MAX, 1]).unwrap_err();
        assert!(matches!(e, Error::ItemCountOverflow { window: 1, first: 2 }), "{e}");
        assert_eq!(acc.windows(&[u64::MAX, 0]).unwrap()[0].items, u64::MAX);
        let mut hooks = FnHooks {
            start: |_: &mut u32, _: &Window| Ok(1.0),
            end: |_: &mut u32, _: &Window| Ok(()),
        };
        let mut calls = 0u32;
        let r = acc.run_epoch(&[u64::MAX, 1], &mut calls, &mut hooks, |calls, _| {
            *calls += 1;
            Ok(())
        });
        assert!(matches!(r, Err(Error::ItemCountOverflow { window: 0, first: 0 })));
        assert_eq!(calls, 0);
    }

    /// A loss scaler sees one start and one end per window, and every micro-batch of a
    /// window gets the scale read at its start.
    #[test]
    fn hooks_fix_one_multiplier_per_window_and_step_at_its_boundary() {
        let acc = GradAccumulator::new(3, Normalization::Mean).unwrap();
        // The model here is the log: the micro-batches and both hooks write to it in turn.
        let mut log: Vec<String> = Vec::new();
        let mut scale = 1024.0;
        let mut hooks = FnHooks {
            start: |log: &mut Vec<String>, w: &Window| {
                log.push(format!("start {}", w.index));
                scale /= 2.0;
                Ok(scale)
            },
            end: |log: &mut Vec<String>, w: &Window| {
                log.push(format!("step {}", w.index));
                Ok(())
            },
        };
        let mut dlosses = Vec::new();
        let steps = acc
            .run_epoch(&[1; 7], &mut log, &mut hooks, |log, s| {
                log.push(format!("mb {}", s.micro_batch));
                dlosses.push(s.dloss);
                Ok(())
            })
            .unwrap();
        assert_eq!(steps, 3);
        assert_eq!(log[..5], ["start 0", "mb 0", "mb 1", "mb 2", "step 0"]);
        assert_eq!(log.last().map(String::as_str), Some("step 2"));
        assert_eq!(dlosses[..3], [512.0 / 3.0; 3]);
        assert_eq!(dlosses[6], 128.0);
    }
}
