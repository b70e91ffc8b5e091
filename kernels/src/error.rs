//! The error type of the tensor layer: one enum, structured variants, messages that name the
//! op and what did not fit.

use crate::dtype::DType;
use vram_alloc::AllocError;

/// Everything a device, tensor, op or host reference call can fail with.
///
/// An op checks shapes, dtypes and devices before it allocates, and allocates its outputs
/// before it writes anything, so on any error its inputs are unchanged.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// Two operands whose shapes had to agree do not.
    #[error("{op}: shape mismatch between {lhs:?} and {rhs:?}")]
    ShapeMismatch {
        /// The op that was called.
        op: &'static str,
        /// The first operand's shape (or the shape expected).
        lhs: Vec<usize>,
        /// The second operand's shape (or the shape given).
        rhs: Vec<usize>,
    },
    /// Two operands whose dtypes had to agree do not.
    #[error("{op}: dtype mismatch between {lhs} and {rhs}; convert one with `to_dtype`")]
    DTypeMismatch {
        /// The op that was called.
        op: &'static str,
        /// The first operand's dtype (or the dtype expected).
        lhs: DType,
        /// The second operand's dtype (or the dtype given).
        rhs: DType,
    },
    /// Operands live on different devices.
    #[error("{op}: operands live on different devices; create them on one device")]
    DeviceMismatch {
        /// The op that was called.
        op: &'static str,
    },
    /// An argument outside the op's domain (a rank, a probability, a window size, ...).
    #[error("{op}: {reason}")]
    InvalidArgument {
        /// The op that was called.
        op: &'static str,
        /// What was wrong, in words.
        reason: String,
    },
    /// An index (token id, class target) is not below its bound.
    #[error("{op}: index {index} is out of range; indices must be below {bound}")]
    IndexOutOfRange {
        /// The op that was called.
        op: &'static str,
        /// The offending index.
        index: usize,
        /// The exclusive upper bound.
        bound: usize,
    },
    /// The device's allocator could not provide the memory, even after releasing its cache.
    #[error(transparent)]
    OutOfMemory(AllocError),
    /// The allocator failed for a reason other than out-of-memory (a bad configuration, a
    /// device error).
    #[error("allocator: {0}")]
    Allocator(AllocError),
    /// The request is valid but not implemented on this build or device.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// Values were asked of a tensor on a virtual device, which has shapes, dtypes and
    /// memory but no values.
    #[error(
        "{op}: the tensor lives on a virtual device, which counts memory but holds no values; \
         run on the host or a CUDA device to read them"
    )]
    NoValues {
        /// The call that wanted values.
        op: &'static str,
    },
    /// The device, its driver or a library on it (NVRTC, cuBLAS) reported an error.
    #[error("{op}: device error: {reason}")]
    Device {
        /// The call that failed.
        op: &'static str,
        /// What the driver or library said.
        reason: String,
    },
}

impl Error {
    /// Whether this is an out-of-memory error (the one a training loop may recover from, by
    /// a smaller batch or more checkpointing).
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, Error::OutOfMemory(_))
    }
}

impl From<AllocError> for Error {
    fn from(e: AllocError) -> Self {
        if e.is_out_of_memory() { Error::OutOfMemory(e) } else { Error::Allocator(e) }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
