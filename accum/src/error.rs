//! The crate's error type: one enum, structured variants, messages that say what was asked,
//! what was available and what to do.

/// Everything the executor, the planner and the accumulator can fail with.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// A tensor op failed (shape, dtype or device mismatch, out of memory, ...).
    #[error(transparent)]
    Kernel(#[from] vram_kernels::Error),
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

impl Error {
    /// Whether this is the allocator's out-of-memory error (the one a training loop may
    /// recover from: inputs and parameters are left intact).
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, Error::Kernel(e) if e.is_out_of_memory())
    }
}
