//! The crate's error type: one enum, structured variants, messages that say what was asked,
//! what was available and what to do. Layers return it too, so a layer's out-of-memory error
//! reaches the training loop as [`Error::Kernel`] and [`Error::is_out_of_memory`] holds.

use crate::chain::ChainId;

/// Everything layers, the executor, the planner and the accumulator can fail with.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// A tensor op failed (shape, dtype or device mismatch, out of memory, ...).
    #[error(transparent)]
    Kernel(#[from] vram_kernels::Error),
    /// The optimizer, the loss scaler or gradient clipping failed (their tensor errors arrive
    /// as [`Error::Kernel`] instead).
    #[error(transparent)]
    Amp(vram_amp::Error),
    /// A tape was given to the backward of a chain other than the one that recorded it.
    #[error(
        "backward on chain {chain} was given a tape recorded by chain {tape}; pass each \
         chain the tape its own forward returned"
    )]
    ForeignTape {
        /// The chain whose backward was called.
        chain: ChainId,
        /// The chain that recorded the tape.
        tape: ChainId,
    },
    /// A tape was recorded before its chain's layers changed ([`Chain::push`],
    /// [`Chain::layers_mut`]).
    ///
    /// [`Chain::push`]: crate::Chain::push
    /// [`Chain::layers_mut`]: crate::Chain::layers_mut
    #[error("the tape was recorded by chain {chain} before its layers changed; run forward again")]
    StaleTape {
        /// The chain.
        chain: ChainId,
    },
    /// A layer's backward was given saved state another layer's forward produced.
    #[error(
        "layer {layer}: backward was given state saved by {saved_by}; pass each layer what \
         its own forward saved"
    )]
    ForeignSavedState {
        /// The layer whose backward was called.
        layer: String,
        /// The layer whose forward saved the state.
        saved_by: String,
    },
    /// The counters of a forward's random stream would run past `u64::MAX`.
    #[error(
        "random stream exhausted: {requested} counters asked at offset {offset} would pass \
         u64::MAX; start the forward from a lower ForwardCtx::offset"
    )]
    RandomStreamExhausted {
        /// The offset the counters were asked at.
        offset: u64,
        /// How many counters were asked.
        requested: u64,
    },
    /// The items of a window's micro-batches add up past `u64::MAX`.
    #[error(
        "window {window}: the item counts of micro-batches {first}.. add up past u64::MAX; \
         check the counts passed to the accumulator"
    )]
    ItemCountOverflow {
        /// Index of the window.
        window: usize,
        /// Index of its first micro-batch.
        first: usize,
    },
    /// A schedule or profile does not fit the chain it is used with.
    #[error("{what} covers {got} layers but the chain has {expected}; build it for this chain")]
    LengthMismatch {
        /// What was given (a schedule, a profile).
        what: &'static str,
        /// Layers the chain has.
        expected: usize,
        /// Layers the given object covers.
        got: usize,
    },
    /// Segments that do not tile `0..n` in order with non-empty ranges.
    #[error("invalid segmentation: {reason}")]
    InvalidSegments {
        /// What was wrong, in words.
        reason: String,
    },
    /// A parameter outside its domain (k = 0, an empty chain, ...).
    #[error("{what}: {reason}")]
    InvalidArgument {
        /// The function or setting that was given the argument.
        what: &'static str,
        /// What was wrong, in words.
        reason: String,
    },
    /// No checkpoint plan fits the requested activation-memory budget.
    #[error(
        "no checkpoint plan keeps activation memory within {budget} bytes; the smallest \
         predicted peak of any plan is {minimum} bytes: raise the budget or shrink the micro-batch"
    )]
    BudgetTooSmall {
        /// The requested budget in bytes.
        budget: u64,
        /// The smallest predicted peak any segmentation reaches, in bytes.
        minimum: u64,
    },
    /// Backward was asked of a tape recorded in inference mode, which saves nothing.
    #[error("backward called on a tape recorded in inference mode; run forward with Mode::Train")]
    InferenceTape,
    /// A layer that has no autocast rule was run under autocast
    /// ([`ForwardCtx::with_autocast`](crate::ForwardCtx::with_autocast)): rather than compute
    /// in a dtype PyTorch would not, it refuses.
    #[error(
        "layer {layer} does not support autocast; run it without autocast (full f32 or a \
         16-bit model with f32 master weights)"
    )]
    AutocastUnsupported {
        /// The layer's name.
        layer: String,
    },
    /// A [`LayerHooks`](crate::LayerHooks) callback failed (the hooks keep their own error
    /// to return in its place).
    #[error("hook {pass} of layer {index} failed: {reason}")]
    Hook {
        /// Where: before or after, forward or backward.
        pass: String,
        /// Position of the layer in the chain.
        index: usize,
        /// The hook's error.
        reason: String,
    },
    /// A layer broke the [`Layer`](crate::Layer) contract (e.g. saved nothing in training).
    #[error("layer {index} ({name}): {reason}")]
    LayerContract {
        /// Position of the layer in the chain.
        index: usize,
        /// The layer's name.
        name: String,
        /// What it did wrong.
        reason: String,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<vram_amp::Error> for Error {
    /// Keeps a tensor error a tensor error ([`Error::Kernel`]), so an out-of-memory error in
    /// an optimizer step stays recognisable.
    fn from(e: vram_amp::Error) -> Self {
        match e {
            vram_amp::Error::Kernel(k) => Error::Kernel(k),
            other => Error::Amp(other),
        }
    }
}

impl Error {
    /// Whether this is the allocator's out-of-memory error (the one a training loop may
    /// recover from: inputs and parameters are left intact).
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            Error::Kernel(e) => e.is_out_of_memory(),
            Error::Amp(e) => e.is_out_of_memory(),
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::LinearConfig;
    use crate::{Chain, ForwardCtx, Mode, Schedule};
    use vram_kernels::{DType, Device, Tensor};

    #[test]
    fn an_out_of_memory_error_stays_one_through_amp_layers_and_the_chain() {
        let dev = Device::host(32 << 20);
        let oom = Tensor::zeros(&dev, &[16 << 20], DType::F32).unwrap_err();
        assert!(oom.is_out_of_memory());
        let via_amp = Error::from(vram_amp::Error::from(oom));
        assert!(matches!(via_amp, Error::Kernel(_)) && via_amp.is_out_of_memory(), "{via_amp}");
        let misuse = Error::from(vram_amp::Error::NoInfChecks);
        assert!(matches!(misuse, Error::Amp(vram_amp::Error::NoInfChecks)));
        assert!(!misuse.is_out_of_memory());

        // A layer's out-of-memory error reaches the caller of the chain as one: the output of
        // [2048, 512] x [512 -> 4096] needs 32 MiB.
        let mut chain = Chain::default();
        chain.push(LinearConfig::new(512, 4096).init(&dev).unwrap());
        let x = Tensor::zeros(&dev, &[2048, 512], DType::F32).unwrap();
        let mut ctx = ForwardCtx::new(Mode::Train, 0);
        let err = chain.forward(&x, &mut ctx, &Schedule::none(1).unwrap()).unwrap_err();
        assert!(err.is_out_of_memory(), "{err}");
    }
}
