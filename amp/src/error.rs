//! The crate's one error type: misuse of the scaler's state machine, bad configurations and
//! the tensor layer's errors, each with a message that says what to do.

use crate::optim::OptimizerId;

/// Everything a call into this crate can fail with. Misuse of the loss scaler (unscaling
/// twice, stepping twice) is reported here, never by a panic.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// An op of the tensor layer failed (shape, dtype, device, out of memory).
    #[error(transparent)]
    Kernel(#[from] vram_kernels::Error),
    /// `unscale` was called twice for one optimizer in one iteration.
    #[error(
        "unscale: already called for optimizer {optimizer} since the last update(); \
         unscale once per optimizer per iteration"
    )]
    AlreadyUnscaled {
        /// The optimizer unscaled twice.
        optimizer: OptimizerId,
    },
    /// `unscale` was called after `step` for one optimizer in one iteration.
    #[error(
        "unscale: called after step() for optimizer {optimizer}; unscale before stepping, \
         and call update() to start the next iteration"
    )]
    UnscaleAfterStep {
        /// The optimizer already stepped.
        optimizer: OptimizerId,
    },
    /// `step` was called twice for one optimizer in one iteration.
    #[error(
        "step: already called for optimizer {optimizer} since the last update(); call \
         update() once per iteration before stepping again"
    )]
    AlreadyStepped {
        /// The optimizer stepped twice.
        optimizer: OptimizerId,
    },
    /// `update` was called although no optimizer was unscaled or stepped since the last one.
    #[error(
        "update: no inf/NaN check was recorded since the last update(); call unscale() or \
         step() for at least one optimizer first"
    )]
    NoInfChecks,
    /// A configuration value is outside its domain.
    #[error("{what}: {reason}")]
    InvalidConfig {
        /// The setting or call that was rejected.
        what: &'static str,
        /// What was wrong and what is allowed.
        reason: String,
    },
    /// Gradient clipping was asked for a bound that is negative or NaN.
    #[error("clip_grad_norm: max_norm must be >= 0 (inf only measures the norm), got {max_norm}")]
    InvalidMaxNorm {
        /// The bound that was given.
        max_norm: f32,
    },
    /// A parameter index is out of range, or a gradient does not fit its parameter.
    #[error("{op}: {reason}")]
    InvalidArgument {
        /// The call that was rejected.
        op: &'static str,
        /// What was wrong, in words.
        reason: String,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Whether this is the allocator's out-of-memory error (inputs and parameters are left
    /// intact, so a training loop may retry with less memory).
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, Error::Kernel(e) if e.is_out_of_memory())
    }
}
