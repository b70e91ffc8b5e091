//! Host memory with a capacity cap: real, page-aligned bytes the CPU backend computes on.

use super::{Capacity, DeviceMemory, DevicePtr, MemInfo, PAGE_SIZE, RawError, SimStreams, Stream};
use crate::util::human_bytes;

/// Host memory that behaves like a device of a given capacity: allocations over the cap fail
/// as a device out-of-memory would. Memory comes from anonymous `mmap`, so it is zeroed,
/// page-aligned, and returned to the OS on free. Supports expandable segments.
///
/// Streams are simulated ([`HostMemory::streams`]): work is synchronous, so events complete
/// immediately unless a stream is held.
#[derive(Debug)]
pub struct HostMemory {
    capacity: Capacity,
    streams: SimStreams,
}

impl HostMemory {
    /// Host memory capped at `capacity` bytes.
    pub fn new(capacity: u64) -> Self {
        HostMemory { capacity: Capacity::new(capacity), streams: SimStreams::default() }
    }

    /// The simulated streams, to hold or release them in tests.
    pub fn streams(&self) -> &SimStreams {
        &self.streams
    }

    fn mmap(size: usize, prot: libc::c_int) -> Result<DevicePtr, RawError> {
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing touches
        // no existing memory; the result is checked against MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                prot,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(RawError::OutOfMemory { requested: size });
        }
        Ok(p as DevicePtr)
    }
}

impl DeviceMemory for HostMemory {
    type Event = super::sim::SimEvent;

    fn name(&self) -> String {
        format!("host memory ({} cap)", human_bytes(self.capacity.info().total))
    }

    fn allocate(&self, size: usize) -> Result<DevicePtr, RawError> {
        self.capacity.take(size)?;
        Self::mmap(size, libc::PROT_READ | libc::PROT_WRITE)
            .inspect_err(|_| self.capacity.give(size))
    }

    unsafe fn deallocate(&self, ptr: DevicePtr, size: usize) {
        // SAFETY: the caller guarantees `ptr`/`size` are one live mapping from `allocate`.
        let rc = unsafe { libc::munmap(ptr as *mut libc::c_void, size) };
        debug_assert_eq!(rc, 0, "munmap of a segment failed");
        self.capacity.give(size);
    }

    fn mem_info(&self) -> MemInfo {
        self.capacity.info()
    }

    fn record_event(&self, stream: Stream) -> Result<Self::Event, RawError> {
        Ok(self.streams.record(stream))
    }

    fn event_completed(&self, event: &Self::Event) -> bool {
        self.streams.completed(event)
    }

    fn synchronize_event(&self, event: &Self::Event) {
        self.streams.synchronize(event);
    }

    fn destroy_event(&self, _event: Self::Event) {}

    fn supports_expandable(&self) -> bool {
        true
    }

    fn reserve(&self, size: usize) -> Result<DevicePtr, RawError> {
        debug_assert_eq!(size % PAGE_SIZE, 0);
        Self::mmap(size, libc::PROT_NONE)
    }

    unsafe fn map(&self, ptr: DevicePtr, size: usize) -> Result<(), RawError> {
        self.capacity.take(size)?;
        // SAFETY: the caller guarantees the range lies in a reservation of ours.
        let rc = unsafe {
            libc::mprotect(ptr as *mut libc::c_void, size, libc::PROT_READ | libc::PROT_WRITE)
        };
        if rc != 0 {
            self.capacity.give(size);
            return Err(RawError::OutOfMemory { requested: size });
        }
        Ok(())
    }

    unsafe fn unmap(&self, ptr: DevicePtr, size: usize) {
        // SAFETY: the caller guarantees the range is mapped and unused; MADV_DONTNEED returns
        // the pages (a later map sees zeroes) and PROT_NONE makes stray accesses fault.
        unsafe {
            libc::madvise(ptr as *mut libc::c_void, size, libc::MADV_DONTNEED);
            libc::mprotect(ptr as *mut libc::c_void, size, libc::PROT_NONE);
        }
        self.capacity.give(size);
    }

    unsafe fn release(&self, ptr: DevicePtr, size: usize) {
        // SAFETY: the caller guarantees this is exactly one reservation of ours.
        unsafe { libc::munmap(ptr as *mut libc::c_void, size) };
    }
}
