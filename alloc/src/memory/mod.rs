//! Raw memory: the small trait a backend implements, separate from the caching policy.
//!
//! A backend hands out and takes back whole segments, reports free/total memory, and
//! provides the stream-ordered events the cache needs for safe reuse. Backends that can
//! reserve address ranges and map pages into them also support expandable segments.

#[cfg(unix)]
mod host;
mod sim;
mod virt;

#[cfg(unix)]
pub use host::HostMemory;
pub use sim::SimStreams;
pub use virt::VirtualMemory;

use std::fmt;

/// A device address (`CUdeviceptr` on CUDA, a host address on the host backend).
pub type DevicePtr = u64;

/// Granularity of expandable-segment mappings: 2 MiB, as on CUDA.
pub const PAGE_SIZE: usize = 2 << 20;

/// A stream of work on a device, by its raw handle. [`Stream::DEFAULT`] is stream 0 (the
/// legacy default stream on CUDA).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Stream(pub u64);

impl Stream {
    /// The default stream.
    pub const DEFAULT: Stream = Stream(0);
}

impl fmt::Display for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// Free and total memory of a device, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemInfo {
    /// Bytes the device could still hand out.
    pub free: u64,
    /// The device's capacity.
    pub total: u64,
}

/// An error from a raw backend.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RawError {
    /// The device has no room for the request.
    #[error("the device cannot provide {requested} more bytes")]
    OutOfMemory {
        /// The bytes asked for.
        requested: usize,
    },
    /// The backend cannot do this (e.g. expandable segments on a backend without them).
    #[error("{0} is not supported by this backend")]
    Unsupported(&'static str),
    /// The driver reported an error.
    #[error("device error: {0}")]
    Device(String),
}

/// Raw device memory: what the caching allocator sits on.
///
/// Implementations: [`HostMemory`] (real bytes, capacity cap), [`VirtualMemory`] (addresses
/// and accounting only) and, with the `cuda` feature, `CudaMemory`.
pub trait DeviceMemory: Send + Sync + 'static {
    /// A completion marker recorded on a stream.
    type Event: Send + 'static;

    /// The device, in words (e.g. "host memory (4.00 GiB cap)").
    fn name(&self) -> String;

    /// Allocates `size` bytes, aligned to at least 512 bytes.
    fn allocate(&self, size: usize) -> Result<DevicePtr, RawError>;

    /// Returns memory obtained from [`DeviceMemory::allocate`].
    ///
    /// # Safety
    /// `ptr` and `size` must come from one earlier `allocate` call, not yet deallocated, and no
    /// pending device work may still use the memory.
    unsafe fn deallocate(&self, ptr: DevicePtr, size: usize);

    /// Free and total device memory.
    fn mem_info(&self) -> MemInfo;

    /// Records an event that completes when the work submitted to `stream` so far completes.
    fn record_event(&self, stream: Stream) -> Result<Self::Event, RawError>;

    /// Whether `event` has completed (never blocks).
    fn event_completed(&self, event: &Self::Event) -> bool;

    /// Blocks until `event` has completed.
    fn synchronize_event(&self, event: &Self::Event);

    /// Destroys an event.
    fn destroy_event(&self, event: Self::Event);

    /// Waits for all work on the device (the fallback when an event cannot be recorded).
    fn synchronize_all(&self) {}

    /// Whether [`reserve`](Self::reserve), [`map`](Self::map), [`unmap`](Self::unmap) and
    /// [`release`](Self::release) work (needed for expandable segments).
    fn supports_expandable(&self) -> bool {
        false
    }

    /// Reserves `size` bytes of address space (a multiple of [`PAGE_SIZE`]), no memory.
    fn reserve(&self, size: usize) -> Result<DevicePtr, RawError> {
        let _ = size;
        Err(RawError::Unsupported("reserving address space"))
    }

    /// Backs `[ptr, ptr + size)` (page-aligned, inside a reserved range) with memory.
    ///
    /// # Safety
    /// The range must lie inside a range from [`reserve`](Self::reserve) and not be mapped.
    unsafe fn map(&self, ptr: DevicePtr, size: usize) -> Result<(), RawError> {
        let _ = (ptr, size);
        Err(RawError::Unsupported("mapping memory"))
    }

    /// Returns the memory behind a mapped, page-aligned range.
    ///
    /// # Safety
    /// The range must be mapped and unused by any pending device work.
    unsafe fn unmap(&self, ptr: DevicePtr, size: usize) {
        let _ = (ptr, size);
    }

    /// Gives back a reserved range (all of it unmapped).
    ///
    /// # Safety
    /// `ptr` and `size` must be exactly one earlier reservation with nothing mapped in it.
    unsafe fn release(&self, ptr: DevicePtr, size: usize) {
        let _ = (ptr, size);
    }
}

/// Capacity accounting shared by the host and virtual backends.
#[derive(Debug)]
pub(crate) struct Capacity {
    total: u64,
    used: std::sync::atomic::AtomicU64,
}

impl Capacity {
    pub(crate) fn new(total: u64) -> Self {
        Capacity { total, used: std::sync::atomic::AtomicU64::new(0) }
    }

    /// Takes `size` bytes if they fit under the capacity.
    pub(crate) fn take(&self, size: usize) -> Result<(), RawError> {
        use std::sync::atomic::Ordering::Relaxed;
        let size64 = size as u64;
        self.used
            .fetch_update(Relaxed, Relaxed, |used| {
                used.checked_add(size64).filter(|&n| n <= self.total)
            })
            .map(|_| ())
            .map_err(|_| RawError::OutOfMemory { requested: size })
    }

    pub(crate) fn give(&self, size: usize) {
        self.used.fetch_sub(size as u64, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn info(&self) -> MemInfo {
        let used = self.used.load(std::sync::atomic::Ordering::Relaxed);
        MemInfo { free: self.total - used, total: self.total }
    }
}
