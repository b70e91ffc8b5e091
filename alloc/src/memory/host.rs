//! Host memory with a capacity cap: real, page-aligned bytes the CPU backend computes on.

use super::{Capacity, DeviceMemory, DevicePtr, MemInfo, PAGE_SIZE, RawError, SimStreams, Stream};
use crate::util::human_bytes;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Host memory that behaves like a device of a given capacity: allocations over the cap fail
/// as a device out-of-memory would. Memory comes from anonymous `mmap`, so it is zeroed,
/// page-aligned, and returned to the OS on free. Supports expandable segments.
///
/// Addresses are handed out as [`super::VirtualMemory`] hands them out: increasing, each
/// segment or reservation starting [`PAGE_SIZE`]-aligned after the last, never reused. The
/// caching allocator breaks ties between free blocks of one size by address (as PyTorch's
/// does), so the same order of addresses makes the same decisions: the host measures what the
/// virtual device predicts, to the byte. The addresses come from one address range reserved
/// up front (inaccessible until mapped, no memory committed); when it is used up, segments
/// come from plain `mmap` at addresses of the kernel's choosing.
///
/// Streams are simulated ([`HostMemory::streams`]): work is synchronous, so events complete
/// immediately unless a stream is held.
#[derive(Debug)]
pub struct HostMemory {
    capacity: Capacity,
    streams: SimStreams,
    arena: Option<Arena>,
}

/// The reserved address range and the next unused address in it.
#[derive(Debug)]
struct Arena {
    /// The reservation as mapped (to unmap it whole).
    mapping: (usize, usize),
    base: usize,
    len: usize,
    next: AtomicUsize,
}

/// Address space reserved per [`HostMemory`]: 16 times its capacity, at least 64 GiB and at
/// most 4 TiB (x86-64 user space has 128 TiB). Reserving costs no memory.
fn arena_len(capacity: u64) -> usize {
    let want = capacity.saturating_mul(16).clamp(64 << 30, 4 << 40);
    (want as usize).next_multiple_of(PAGE_SIZE)
}

impl HostMemory {
    /// Host memory capped at `capacity` bytes.
    pub fn new(capacity: u64) -> Self {
        let len = arena_len(capacity);
        let arena = Self::mmap(len + PAGE_SIZE, libc::PROT_NONE).ok().map(|p| {
            // Align the start to a page of ours, as the virtual device's addresses are.
            let base = (p as usize).next_multiple_of(PAGE_SIZE);
            Arena {
                mapping: (p as usize, len + PAGE_SIZE),
                base,
                len: len + PAGE_SIZE - (base - p as usize),
                next: AtomicUsize::new(base),
            }
        });
        HostMemory { capacity: Capacity::new(capacity), streams: SimStreams::default(), arena }
    }

    /// The next `size` bytes (rounded up to [`PAGE_SIZE`]) of the arena, if any are left.
    fn take_addresses(&self, size: usize) -> Option<usize> {
        let arena = self.arena.as_ref()?;
        let span = size.next_multiple_of(PAGE_SIZE);
        let end = arena.base + arena.len;
        arena
            .next
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n.checked_add(span)? <= end).then_some(n + span)
            })
            .ok()
    }

    /// Whether `ptr` lies in the arena.
    fn in_arena(&self, ptr: DevicePtr) -> bool {
        self.arena.as_ref().is_some_and(|a| (a.base..a.base + a.len).contains(&(ptr as usize)))
    }

    /// Maps `size` bytes with `prot` at `addr` of the arena, over what was there.
    fn map_fixed(addr: usize, size: usize, prot: libc::c_int) -> Result<DevicePtr, RawError> {
        // SAFETY: `addr..addr + size` lies in our arena and holds no live segment (addresses
        // are never handed out twice); MAP_FIXED replaces the reservation there.
        let p = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                size,
                prot,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(RawError::OutOfMemory { requested: size });
        }
        Ok(p as DevicePtr)
    }

    /// A fresh mapping of `size` bytes with `prot`: the arena's next addresses, else
    /// anywhere.
    fn map_new(&self, size: usize, prot: libc::c_int) -> Result<DevicePtr, RawError> {
        match self.take_addresses(size) {
            Some(addr) => Self::map_fixed(addr, size, prot),
            None => Self::mmap(size, prot),
        }
    }

    /// Gives `ptr..ptr + size` back: to the arena's reservation (inaccessible, no memory,
    /// never handed out again) or, outside it, to the OS.
    fn unmap_range(&self, ptr: DevicePtr, size: usize) {
        if self.in_arena(ptr) {
            let rc = Self::map_fixed(ptr as usize, size, libc::PROT_NONE);
            debug_assert!(rc.is_ok(), "re-reserving a segment's range failed");
        } else {
            // SAFETY: the caller guarantees `ptr`/`size` are one live mapping of ours.
            let rc = unsafe { libc::munmap(ptr as *mut libc::c_void, size) };
            debug_assert_eq!(rc, 0, "munmap of a segment failed");
        }
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
        self.map_new(size, libc::PROT_READ | libc::PROT_WRITE)
            .inspect_err(|_| self.capacity.give(size))
    }

    unsafe fn deallocate(&self, ptr: DevicePtr, size: usize) {
        // The caller guarantees `ptr`/`size` are one live mapping from `allocate`.
        self.unmap_range(ptr, size);
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
        self.map_new(size, libc::PROT_NONE)
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
        // The caller guarantees this is exactly one reservation of ours.
        self.unmap_range(ptr, size);
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        if let Some(a) = &self.arena {
            // SAFETY: the arena is ours; every segment in it belonged to a cache that is
            // gone (the cache owns this memory and frees its segments before dropping it).
            unsafe { libc::munmap(a.mapping.0 as *mut libc::c_void, a.mapping.1) };
        }
    }
}
