//! vram-alloc: a caching device-memory allocator of PyTorch's class, on host, virtual and
//! CUDA memory.
//!
//! The policy ([`CachingAllocator`]) is written once and runs on any raw backend that
//! implements [`DeviceMemory`]: [`HostMemory`] (real bytes under a capacity cap),
//! [`VirtualMemory`] (addresses only: replays an 80 GB GPU's allocation pattern anywhere) and,
//! with the `cuda` feature, `cuda::CudaMemory`. Because the policy is the same everywhere,
//! memory figures measured on the host are the figures the same allocations give on a GPU.
//!
//! It follows PyTorch's CUDA caching allocator: 512-byte rounding, a small pool (requests up
//! to 1 MiB, 2 MiB segments) and a large pool (20 MiB segments, or 2 MiB multiples), best fit
//! per stream, splitting and coalescing, stream-safe reuse with events, free-and-retry on
//! out-of-memory, a per-process memory cap, `empty_cache`, expandable segments, PyTorch's
//! statistic names, `memory_summary`, snapshots for memory_viz, and traces that can be
//! replayed.
//!
//! ```
//! use vram_alloc::{CachingAllocator, VirtualMemory};
//!
//! let cache = CachingAllocator::new(VirtualMemory::new(8 << 30));
//! let a = cache.allocate(3 << 20)?;           // a 20 MiB segment is reserved
//! assert_eq!(cache.memory_allocated(), 3 << 20);
//! assert_eq!(cache.memory_reserved(), 20 << 20);
//! drop(a);                                    // the block goes back to the cache ...
//! assert_eq!(cache.memory_reserved(), 20 << 20);
//! let b = cache.allocate(3 << 20)?;           // ... and is reused without a device call
//! assert_eq!(cache.memory_stats().num_device_alloc, 1);
//! drop(b);
//! cache.empty_cache();                        // give cached memory back
//! assert_eq!(cache.memory_reserved(), 0);
//! # Ok::<(), vram_alloc::AllocError>(())
//! ```

mod block;
mod caching;
mod config;
mod error;
mod expandable;
mod index;
pub mod memory;
mod pickle;
mod policy;
pub mod replay;
mod snapshot;
mod state;
mod stats;
mod summary;
mod trace;
mod util;

#[cfg(feature = "cuda")]
pub mod cuda;

pub use block::MempoolId;
pub use caching::{Allocation, CachingAllocator, StatsScope};
pub use config::{AllocatorConfig, ConfigError, ENV_VAR};
pub use error::{AllocError, OutOfMemoryError};
#[cfg(unix)]
pub use memory::HostMemory;
pub use memory::{DeviceMemory, DevicePtr, MemInfo, RawError, Stream, VirtualMemory};
pub use policy::{
    LARGE_BUFFER, MIN_BLOCK_SIZE, MIN_LARGE_ALLOC, PoolKind, ROUND_LARGE, SMALL_BUFFER, SMALL_SIZE,
};
pub use snapshot::{AllocatorSettings, BlockInfo, Frame, SegmentInfo, Snapshot, TraceInfo};
pub use stats::{MemoryStats, Stat, StatArray};
pub use trace::{TraceAction, TraceEntry};
pub use util::human_bytes;
