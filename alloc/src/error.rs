//! The allocator's error type.

use crate::config::ConfigError;
use crate::util::human_bytes;
use std::fmt;

/// Everything the allocator can fail with.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AllocError {
    /// The request could not be satisfied even after releasing the cache.
    #[error(transparent)]
    OutOfMemory(Box<OutOfMemoryError>),
    /// An invalid setting.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The device reported an error other than out-of-memory.
    #[error("device error: {0}")]
    Device(String),
    /// The backend cannot do what the configuration asks.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A private pool was used in a way PyTorch refuses (allocating to it twice at once,
    /// ending or releasing a pool not in use).
    #[error("private pool: {0}")]
    Pool(String),
}

impl AllocError {
    /// Whether this is an out-of-memory error (the one a training loop may recover from).
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, AllocError::OutOfMemory(_))
    }
}

/// A failed allocation, with what was asked and what was available.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutOfMemoryError {
    /// Bytes requested.
    pub requested: usize,
    /// The device, in words.
    pub device: String,
    /// The device's capacity.
    pub device_total: u64,
    /// Free device memory at the time of failure.
    pub device_free: u64,
    /// Bytes in live allocations.
    pub allocated: u64,
    /// Bytes held in segments (allocated plus cached).
    pub reserved: u64,
    /// The memory cap from the memory fraction, if any.
    pub cap: Option<u64>,
    /// Whether expandable segments were on.
    pub expandable_segments: bool,
}

impl fmt::Display for OutOfMemoryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let unallocated = self.reserved.saturating_sub(self.allocated);
        write!(
            f,
            "out of memory: tried to allocate {} on {}, which has a total capacity of {} of which {} is free. \
             Of the memory in use, {} is allocated and {} is reserved by the cache but unallocated.",
            human_bytes(self.requested as u64),
            self.device,
            human_bytes(self.device_total),
            human_bytes(self.device_free),
            human_bytes(self.allocated),
            human_bytes(unallocated),
        )?;
        if let Some(cap) = self.cap {
            write!(f, " The process is capped at {} by its memory fraction.", human_bytes(cap))?;
        }
        if !self.expandable_segments && unallocated > self.reserved / 4 && unallocated >= 20 << 20 {
            write!(
                f,
                " Reserved but unallocated memory is large: set VRAM_ALLOC_CONF=expandable_segments:True \
                 to avoid fragmentation."
            )
        } else {
            write!(
                f,
                " Reduce the batch size or input size, or use gradient accumulation, mixed precision or \
                 activation checkpointing."
            )
        }
    }
}

impl std::error::Error for OutOfMemoryError {}
