//! Gradient accumulation: several micro-batches per optimizer step.
//!
//! An epoch of micro-batches is cut into windows of `k` (the last may be shorter); each
//! window ends in one optimizer step. Every micro-batch's backward is started with a loss
//! gradient `dloss = factor * multiplier`: the `factor` normalizes the window's summed
//! gradient ([`Normalization`]), the `multiplier` is the hooks' (a loss scale, fixed for the
//! whole window). Because the window is known before its first backward, every factor is
//! final when it is used, and no gradient has to be rescaled afterwards.

use crate::error::{Error, Result};

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

/// Hooks around each window, e.g. for a dynamic loss scaler: read the scale once at the
/// window's start, unscale, check for overflow and step (or skip) only at its end.
pub trait WindowHooks {
    /// Called before the window's first micro-batch; returns the loss multiplier used for
    /// every micro-batch of the window (the loss scale, or 1).
    fn on_window_start(&mut self, window: &Window) -> Result<f32> {
        let _ = window;
        Ok(1.0)
    }

    /// Called after the window's last micro-batch: the optimizer step, unscaling, scale
    /// update, `zero_grad`.
    fn on_window_end(&mut self, window: &Window) -> Result<()>;
}

/// Closures as [`WindowHooks`]: `start` returns the window's loss multiplier, `end` steps.
pub struct FnHooks<S, E> {
    /// Called at each window start.
    pub start: S,
    /// Called at each window end.
    pub end: E,
}

impl<S, E> WindowHooks for FnHooks<S, E>
where
    S: FnMut(&Window) -> Result<f32>,
    E: FnMut(&Window) -> Result<()>,
{
    fn on_window_start(&mut self, window: &Window) -> Result<f32> {
        (self.start)(window)
    }

    fn on_window_end(&mut self, window: &Window) -> Result<()> {
        (self.end)(window)
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
    pub fn windows(&self, items: &[u64]) -> Vec<Window> {
        items
            .chunks(self.k)
            .enumerate()
            .map(|(index, chunk)| Window {
                index,
                first: index * self.k,
                len: chunk.len(),
                items: chunk.iter().sum(),
            })
            .collect()
    }

    /// Runs an epoch: for each window, `hooks.on_window_start` (once: its multiplier holds
    /// for the whole window), then `micro(step)` for each micro-batch (forward, loss,
    /// backward with `step.dloss`), then `hooks.on_window_end`. Returns the number of
    /// optimizer steps.
    ///
    /// # Errors
    ///
    /// The first error of a hook or a micro-batch, which stops the epoch;
    /// [`Error::InvalidArgument`] if a window of [`Normalization::GlobalCount`] holds no
    /// item.
    pub fn run_epoch(
        &self,
        items: &[u64],
        hooks: &mut dyn WindowHooks,
        mut micro: impl FnMut(MicroStep) -> Result<()>,
    ) -> Result<usize> {
        let windows = self.windows(items);
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
            let multiplier = hooks.on_window_start(window)?;
            let dloss = window.factor(self.norm) * multiplier;
            for micro_batch in window.micro_batches() {
                micro(MicroStep { micro_batch, window: *window, dloss })?;
            }
            hooks.on_window_end(window)?;
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
        let w = acc.windows(&[1; 10]);
        assert_eq!(w.iter().map(|w| w.len).collect::<Vec<_>>(), [4, 4, 2]);
        assert_eq!(w[2].micro_batches(), 8..10);
        assert_eq!(w[2].factor(Normalization::Mean), 0.5);
        assert_eq!(w[0].factor(Normalization::Mean), 0.25);
    }

    #[test]
    fn global_count_factor_is_one_over_the_window_items() {
        let acc = GradAccumulator::new(2, Normalization::GlobalCount).unwrap();
        let w = acc.windows(&[3, 5, 7]);
        assert_eq!((w[0].items, w[1].items), (8, 7));
        assert_eq!(w[0].factor(Normalization::GlobalCount), 1.0 / 8.0);
        assert_eq!(w[1].factor(Normalization::Sum), 1.0);
    }

    #[test]
    fn zero_k_and_empty_global_count_windows_are_errors() {
        assert!(GradAccumulator::new(0, Normalization::Sum).is_err());
        let acc = GradAccumulator::new(2, Normalization::GlobalCount).unwrap();
        let mut hooks = FnHooks { start: |_: &Window| Ok(1.0), end: |_: &Window| Ok(()) };
        assert!(acc.run_epoch(&[0, 0], &mut hooks, |_| Ok(())).is_err());
    }

    /// A loss scaler sees one start and one end per window, and every micro-batch of a
    /// window gets the scale read at its start.
    #[test]
    fn hooks_fix_one_multiplier_per_window_and_step_at_its_boundary() {
        let acc = GradAccumulator::new(3, Normalization::Mean).unwrap();
        let log = std::cell::RefCell::new(Vec::new());
        let mut scale = 1024.0;
        let mut hooks = FnHooks {
            start: |w: &Window| {
                log.borrow_mut().push(format!("start {}", w.index));
                scale /= 2.0;
                Ok(scale)
            },
            end: |w: &Window| {
                log.borrow_mut().push(format!("step {}", w.index));
                Ok(())
            },
        };
        let mut dlosses = Vec::new();
        let steps = acc
            .run_epoch(&[1; 7], &mut hooks, |s| {
                log.borrow_mut().push(format!("mb {}", s.micro_batch));
                dlosses.push(s.dloss);
                Ok(())
            })
            .unwrap();
        assert_eq!(steps, 3);
        let log = log.into_inner();
        assert_eq!(log[..5], ["start 0", "mb 0", "mb 1", "mb 2", "step 0"]);
        assert_eq!(log.last().map(String::as_str), Some("step 2"));
        assert_eq!(dlosses[..3], [512.0 / 3.0; 3]);
        assert_eq!(dlosses[6], 128.0);
    }
}
