//! Raw CUDA memory on a device's primary context, through cudarc's driver API (loaded at run
//! time): segments (each a `cuMemCreate` mapped at increasing addresses where the driver has
//! virtual memory management, else a `cuMemAlloc`), pooled events, `cuMemGetInfo`, and
//! expandable segments on the driver's virtual memory management (`cuMemAddressReserve`, `cuMemCreate`,
//! `cuMemMap`, `cuMemSetAccess`, `cuMemUnmap`, `cuMemRelease`, `cuMemAddressFree`), as
//! PyTorch's `ExpandableSegment` in `c10/cuda/CUDACachingAllocator.cpp` uses them.

use super::probe::probe;
use crate::memory::{DeviceMemory, DevicePtr, MemInfo, PAGE_SIZE, RawError, Stream};
use crate::util::human_bytes;
use cudarc::driver::{DriverError, result, sys};
use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

/// Idle events kept for reuse; events past this many are destroyed when given back.
pub const MAX_IDLE_EVENTS: usize = 1024;

/// Raw memory of one CUDA device, in its primary context (the one cudarc's `CudaContext`
/// and the CUDA runtime use, so pointers are interchangeable with theirs).
///
/// Every segment is one `cuMemAlloc`, not one `CudaSlice` per block: blocks are ranges of
/// segments, handed out as raw `CUdeviceptr`s by [`crate::Allocation::ptr`]. Streams are raw
/// `CUstream` handles (`Stream(stream as u64)`; [`Stream::DEFAULT`] is the legacy default
/// stream).
///
/// Expandable segments work where the driver supports virtual memory management and its
/// allocation granularity divides [`PAGE_SIZE`]: a reservation is `cuMemAddressReserve`d,
/// and every mapped [`PAGE_SIZE`] page is backed by a physical allocation of its own, so that
/// any page-aligned sub-range of earlier mappings can be unmapped (`cuMemUnmap` only takes
/// whole mappings).
///
/// Segments ([`DeviceMemory::allocate`]) get increasing addresses, in the order they are
/// allocated, where the driver has virtual memory management: each is one physical
/// allocation (`cuMemCreate`) mapped at the next free address of a large reserved range,
/// which is never reused. The caching policy breaks ties between cached blocks of one size
/// by address, as PyTorch's does; on `cuMemAlloc`'s addresses, which come in no fixed order,
/// two runs of one program could pick different blocks and end with different figures. In
/// allocation order they pick what [`crate::VirtualMemory`] (which hands out addresses the
/// same way) picks, so a virtual device predicts a CUDA run's memory to the byte. Without
/// virtual memory management, segments are plain `cuMemAlloc`s.
///
/// Events for pending frees come from a pool (PyTorch's `EventPool`): an event given back
/// with [`DeviceMemory::destroy_event`] is kept, up to [`MAX_IDLE_EVENTS`], and recorded again
/// instead of creating a new one; the pool is destroyed with the `CudaMemory`, and so are the
/// pages and reservations of expandable segments still held then.
#[derive(Debug)]
pub struct CudaMemory {
    device: sys::CUdevice,
    context: sys::CUcontext,
    name: String,
    total: u64,
    /// The physical allocation granularity when expandable segments work, else `None`.
    granularity: Option<usize>,
    /// Address ranges reserved for expandable segments: start -> size.
    reservations: Mutex<BTreeMap<DevicePtr, usize>>,
    /// The physical allocation behind every mapped page, by the page's address.
    pages: Mutex<BTreeMap<DevicePtr, sys::CUmemGenericAllocationHandle>>,
    /// Events given back, ready to be recorded again.
    idle_events: Mutex<Vec<sys::CUevent>>,
    /// Segments at increasing addresses (with virtual memory management).
    ordered: Mutex<Ordered>,
}

/// The address ranges segments are placed in, and the segments placed there.
#[derive(Debug, Default)]
struct Ordered {
    /// Reserved ranges (start, size), in the order they were reserved.
    arenas: Vec<(DevicePtr, usize)>,
    /// The next free address of the last arena, and that arena's end.
    next: DevicePtr,
    end: DevicePtr,
    /// Every live segment: its physical allocation and mapped size, by address.
    segments: BTreeMap<DevicePtr, (sys::CUmemGenericAllocationHandle, usize)>,
}

// SAFETY: a primary context may be made current on any thread; every call below binds it
// first. The device, context and granularity are never mutated after construction; the page
// handles and idle events are plain driver handles, usable from any thread, behind mutexes.
unsafe impl Send for CudaMemory {}
// SAFETY: as above; the driver API is thread-safe and the mutable parts are behind mutexes.
unsafe impl Sync for CudaMemory {}

/// A CUDA event (created without timing), from the memory's event pool.
#[derive(Debug)]
pub struct CudaEvent(sys::CUevent);

// SAFETY: CUDA events may be used and destroyed from any thread.
unsafe impl Send for CudaEvent {}

impl CudaEvent {
    /// The raw `CUevent` handle (pooled events come back with the same handle).
    pub fn raw(&self) -> sys::CUevent {
        self.0
    }
}

fn device_error(what: &str, e: DriverError) -> RawError {
    RawError::Device(format!("{what}: {e}"))
}

fn check(what: &str, code: sys::CUresult) -> Result<(), RawError> {
    match code {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        e => Err(device_error(what, DriverError(e))),
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The guarded data are handle lists that a panic cannot leave half-updated.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Pinned device memory on `device`, with no shareable handle (PyTorch's `ExpandableSegment`
/// also asks for pinned device memory; vram does not share it between processes).
fn allocation_prop(device: sys::CUdevice) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device,
        },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

impl CudaMemory {
    /// Opens device `ordinal`. Fails with the reason (no driver, no such device) instead of
    /// panicking.
    pub fn new(ordinal: usize) -> Result<Self, RawError> {
        let info = probe(ordinal).map_err(RawError::Device)?;
        let device =
            result::device::get(ordinal as i32).map_err(|e| device_error("cuDeviceGet", e))?;
        // SAFETY: `device` was returned by cuDeviceGet.
        let context = unsafe { result::primary_ctx::retain(device) }
            .map_err(|e| device_error("cuDevicePrimaryCtxRetain", e))?;
        let mut memory = CudaMemory {
            device,
            context,
            name: info.name,
            total: info.total_bytes as u64,
            granularity: None,
            reservations: Mutex::new(BTreeMap::new()),
            pages: Mutex::new(BTreeMap::new()),
            idle_events: Mutex::new(Vec::new()),
            ordered: Mutex::new(Ordered::default()),
        };
        memory.granularity = memory.expandable_granularity();
        Ok(memory)
    }

    /// The device's minimum physical allocation granularity, if the driver supports virtual
    /// memory management on it and the granularity divides [`PAGE_SIZE`].
    fn expandable_granularity(&self) -> Option<usize> {
        self.bind();
        let attribute =
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED;
        // SAFETY: `device` was returned by cuDeviceGet.
        let supported = unsafe { result::device::get_attribute(self.device, attribute) };
        if supported.ok()? == 0 {
            return None;
        }
        let prop = allocation_prop(self.device);
        let mut granularity = 0usize;
        // SAFETY: both pointers are to live locals of the types the call expects.
        let code = unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        };
        (code == sys::CUresult::CUDA_SUCCESS
            && granularity > 0
            && PAGE_SIZE.is_multiple_of(granularity))
        .then_some(granularity)
    }

    /// The physical allocation granularity used for expandable segments (`None` when they are
    /// not supported on this device).
    pub fn granularity(&self) -> Option<usize> {
        self.granularity
    }

    /// Bytes mapped into expandable segments right now.
    pub fn mapped_bytes(&self) -> usize {
        lock(&self.pages).len() * PAGE_SIZE
    }

    /// Events in the pool, waiting to be recorded again.
    pub fn idle_events(&self) -> usize {
        lock(&self.idle_events).len()
    }

    fn bind(&self) {
        // SAFETY: `context` is a retained primary context, alive until drop.
        let bound = unsafe { result::ctx::set_current(self.context) };
        debug_assert!(bound.is_ok(), "cuCtxSetCurrent failed: {bound:?}");
    }

    /// Bytes of the range an arena reserves for segments: four times the device, so that
    /// one arena serves a long run (addresses are never reused); more for a larger segment.
    fn arena_size(&self, segment: usize) -> usize {
        let total = usize::try_from(self.total).unwrap_or(usize::MAX / 8);
        total.saturating_mul(4).max(segment).next_multiple_of(PAGE_SIZE)
    }

    /// A segment of `size` bytes (rounded up to whole pages) at the next free address:
    /// `cuMemCreate`, `cuMemMap`, `cuMemSetAccess`. `None` when no address range could be
    /// reserved for it (the caller falls back to `cuMemAlloc`).
    fn allocate_ordered(&self, size: usize) -> Result<Option<DevicePtr>, RawError> {
        let size = size.max(1).next_multiple_of(PAGE_SIZE);
        let mut ordered = lock(&self.ordered);
        if ordered.end - ordered.next < size as u64 {
            let arena = self.arena_size(size);
            let mut base: sys::CUdeviceptr = 0;
            // SAFETY: `base` is a live local; the driver picks the address; the range is
            // freed with cuMemAddressFree when this memory is dropped.
            let code = unsafe { sys::cuMemAddressReserve(&mut base, arena, 0, 0, 0) };
            if code != sys::CUresult::CUDA_SUCCESS {
                return Ok(None);
            }
            ordered.arenas.push((base, arena));
            ordered.next = base;
            ordered.end = base + arena as u64;
        }
        let at = ordered.next;
        let prop = allocation_prop(self.device);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: `handle` and `prop` are live locals; `size` is a multiple of PAGE_SIZE, which
        // the granularity divides (checked when the device was opened).
        let code = unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) };
        match code {
            sys::CUresult::CUDA_SUCCESS => {}
            sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                return Err(RawError::OutOfMemory { requested: size });
            }
            e => return Err(device_error("cuMemCreate", DriverError(e))),
        }
        // SAFETY: `[at, at + size)` is unused space of an arena of ours; `handle` is a fresh
        // allocation of `size` bytes.
        let code = unsafe { sys::cuMemMap(at, size, 0, handle, 0) };
        if let Err(e) = check("cuMemMap", code) {
            // SAFETY: `handle` is mapped nowhere.
            let _ = unsafe { sys::cuMemRelease(handle) };
            return Err(e);
        }
        // SAFETY: `[at, at + size)` was just mapped.
        if let Err(e) = unsafe { self.grant_access(at, size) } {
            // SAFETY: mapped just above and used by nothing; then mapped nowhere.
            let _ = unsafe { sys::cuMemUnmap(at, size) };
            // SAFETY: as above.
            let _ = unsafe { sys::cuMemRelease(handle) };
            return Err(e);
        }
        ordered.next = at + size as u64;
        ordered.segments.insert(at, (handle, size));
        Ok(Some(at))
    }

    /// Makes `[ptr, ptr + size)` readable and writable by the device (`cuMemSetAccess`).
    ///
    /// # Safety
    /// The range must be mapped in full, in a reservation of ours.
    unsafe fn grant_access(&self, ptr: DevicePtr, size: usize) -> Result<(), RawError> {
        let access = sys::CUmemAccessDesc {
            location: allocation_prop(self.device).location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the range is mapped (the caller's contract); `access` is a live local.
        check("cuMemSetAccess", unsafe { sys::cuMemSetAccess(ptr, size, &access, 1) })
    }

    /// Unmaps and releases pages that were created and mapped by a `map` that is being undone:
    /// nothing has used them, so no synchronization is needed.
    fn undo_pages(pages: &[(DevicePtr, sys::CUmemGenericAllocationHandle, bool)]) {
        for &(page, handle, mapped) in pages {
            if mapped {
                // SAFETY: `page` was mapped to `handle` by this `map` call and is unused.
                let code = unsafe { sys::cuMemUnmap(page, PAGE_SIZE) };
                debug_assert_eq!(code, sys::CUresult::CUDA_SUCCESS, "cuMemUnmap on undo");
            }
            // SAFETY: `handle` came from cuMemCreate in this `map` call and is mapped nowhere.
            let code = unsafe { sys::cuMemRelease(handle) };
            debug_assert_eq!(code, sys::CUresult::CUDA_SUCCESS, "cuMemRelease on undo");
        }
    }
}

impl Drop for CudaMemory {
    fn drop(&mut self) {
        self.bind();
        // The cache is gone (it owns this memory), so no block uses these pages any more;
        // wait for queued work, then give back what expandable segments still hold.
        let pages = std::mem::take(&mut *lock(&self.pages));
        let reservations = std::mem::take(&mut *lock(&self.reservations));
        let ordered = std::mem::take(&mut *lock(&self.ordered));
        if !pages.is_empty() || !ordered.segments.is_empty() {
            let _ = result::ctx::synchronize();
        }
        for (at, (handle, size)) in ordered.segments {
            // SAFETY: a segment of ours that the gone cache never gave back; no work uses it
            // (the device was synchronized above).
            let _ = unsafe { sys::cuMemUnmap(at, size) };
            // SAFETY: `handle` is mapped nowhere any more.
            let _ = unsafe { sys::cuMemRelease(handle) };
        }
        for (base, size) in ordered.arenas {
            // SAFETY: an arena of ours, with every segment in it unmapped above.
            let _ = unsafe { sys::cuMemAddressFree(base, size) };
        }
        for (at, handle) in pages {
            // SAFETY: `at` is a page this memory mapped to `handle`, used by no work (the
            // device was synchronized above and its cache is gone).
            let _ = unsafe { sys::cuMemUnmap(at, PAGE_SIZE) };
            // SAFETY: `handle` is mapped nowhere any more.
            let _ = unsafe { sys::cuMemRelease(handle) };
        }
        for (base, size) in reservations {
            // SAFETY: a reservation of ours, with every page in it unmapped above.
            let _ = unsafe { sys::cuMemAddressFree(base, size) };
        }
        for event in lock(&self.idle_events).drain(..) {
            // SAFETY: idle events are live, owned by the pool, and used by nothing.
            let _ = unsafe { result::event::destroy(event) };
        }
        // SAFETY: releases the reference taken in `new`, on the device it came from.
        let _ = unsafe { result::primary_ctx::release(self.device) };
    }
}

impl DeviceMemory for CudaMemory {
    type Event = CudaEvent;

    fn name(&self) -> String {
        format!("{} ({})", self.name, human_bytes(self.total))
    }

    fn allocate(&self, size: usize) -> Result<DevicePtr, RawError> {
        self.bind();
        if self.granularity.is_some()
            && let Some(ptr) = self.allocate_ordered(size)?
        {
            return Ok(ptr);
        }
        // SAFETY: the context is current; the memory is owned by the cache until deallocate.
        match unsafe { result::malloc_sync(size) } {
            Ok(ptr) => Ok(ptr),
            Err(DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY)) => {
                Err(RawError::OutOfMemory { requested: size })
            }
            Err(e) => Err(device_error("cuMemAlloc", e)),
        }
    }

    unsafe fn deallocate(&self, ptr: DevicePtr, _size: usize) {
        self.bind();
        let segment = lock(&self.ordered).segments.remove(&ptr);
        if let Some((handle, size)) = segment {
            // As cuMemFree, which waits for the device: cuMemUnmap does not, and the block's
            // stream may still be using the memory.
            let _ = result::ctx::synchronize();
            // SAFETY: `ptr` is a segment of ours, mapped to `handle`, that no work uses (the
            // caller's contract, and the synchronization above).
            let code = unsafe { sys::cuMemUnmap(ptr, size) };
            debug_assert_eq!(code, sys::CUresult::CUDA_SUCCESS, "cuMemUnmap failed");
            // SAFETY: `handle` is mapped nowhere any more.
            let code = unsafe { sys::cuMemRelease(handle) };
            debug_assert_eq!(code, sys::CUresult::CUDA_SUCCESS, "cuMemRelease failed");
            return;
        }
        // SAFETY: the caller guarantees `ptr` came from `allocate` and no work uses it.
        let freed = unsafe { result::free_sync(ptr) };
        debug_assert!(freed.is_ok(), "cuMemFree failed: {freed:?}");
    }

    fn mem_info(&self) -> MemInfo {
        self.bind();
        match result::mem_get_info() {
            Ok((free, total)) => MemInfo { free: free as u64, total: total as u64 },
            Err(_) => MemInfo { free: 0, total: self.total },
        }
    }

    fn record_event(&self, stream: Stream) -> Result<CudaEvent, RawError> {
        self.bind();
        let pooled = lock(&self.idle_events).pop();
        let event = match pooled {
            Some(event) => event,
            None => result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(|e| device_error("cuEventCreate", e))?,
        };
        // SAFETY: `event` is live (new, or idle in the pool and used by nothing); `stream` is a
        // CUstream handle of this context given by the caller (0 is the legacy default stream).
        let recorded = unsafe { result::event::record(event, stream.0 as sys::CUstream) };
        if let Err(e) = recorded {
            // SAFETY: the event is ours alone; after a failed record it is not pooled again.
            let _ = unsafe { result::event::destroy(event) };
            return Err(device_error("cuEventRecord", e));
        }
        Ok(CudaEvent(event))
    }

    fn event_completed(&self, event: &CudaEvent) -> bool {
        // SAFETY: the event is live (given back only through `destroy_event`).
        match unsafe { result::event::query(event.0) } {
            Ok(()) => true,
            Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => false,
            // An errored context will never complete the event; treat it as done rather
            // than keep the block forever (the context is unusable anyway).
            Err(_) => true,
        }
    }

    fn synchronize_event(&self, event: &CudaEvent) {
        // SAFETY: the event is live.
        let _ = unsafe { result::event::synchronize(event.0) };
    }

    fn destroy_event(&self, event: CudaEvent) {
        let mut idle = lock(&self.idle_events);
        if idle.len() < MAX_IDLE_EVENTS {
            idle.push(event.0);
            return;
        }
        drop(idle);
        self.bind();
        // SAFETY: the event is live and owned by the caller, who gives it up.
        let _ = unsafe { result::event::destroy(event.0) };
    }

    fn synchronize_all(&self) {
        self.bind();
        let _ = result::ctx::synchronize();
    }

    fn supports_expandable(&self) -> bool {
        self.granularity.is_some()
    }

    fn reserve(&self, size: usize) -> Result<DevicePtr, RawError> {
        if self.granularity.is_none() {
            return Err(RawError::Unsupported("virtual memory management on this device"));
        }
        debug_assert!(size.is_multiple_of(PAGE_SIZE));
        self.bind();
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a live local; alignment 0 and address 0 let the driver choose, and
        // the range is returned with cuMemAddressFree in `release`.
        let code = unsafe { sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0) };
        match code {
            sys::CUresult::CUDA_SUCCESS => {
                lock(&self.reservations).insert(ptr, size);
                Ok(ptr)
            }
            sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                Err(RawError::OutOfMemory { requested: size })
            }
            e => Err(device_error("cuMemAddressReserve", DriverError(e))),
        }
    }

    unsafe fn map(&self, ptr: DevicePtr, size: usize) -> Result<(), RawError> {
        if self.granularity.is_none() {
            return Err(RawError::Unsupported("virtual memory management on this device"));
        }
        let page = PAGE_SIZE as u64;
        debug_assert!(ptr.is_multiple_of(page) && size.is_multiple_of(PAGE_SIZE));
        self.bind();
        let prop = allocation_prop(self.device);
        // (page address, physical handle, mapped yet) for every page of this call, so that a
        // failure part-way gives back exactly what this call created.
        let mut created = Vec::with_capacity(size / PAGE_SIZE);
        // As PyTorch's `ExpandableSegment::map`: first create every page's memory, so that
        // running out of memory maps nothing ...
        for i in 0..(size / PAGE_SIZE) as u64 {
            let mut handle: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: `handle` and `prop` are live locals; PAGE_SIZE is a multiple of the
            // granularity (checked when the device was opened).
            let code = unsafe { sys::cuMemCreate(&mut handle, PAGE_SIZE, &prop, 0) };
            match code {
                sys::CUresult::CUDA_SUCCESS => created.push((ptr + i * page, handle, false)),
                e => {
                    Self::undo_pages(&created);
                    return Err(match e {
                        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                            RawError::OutOfMemory { requested: size }
                        }
                        e => device_error("cuMemCreate", DriverError(e)),
                    });
                }
            }
        }
        // ... then map each page to its memory ...
        for i in 0..created.len() {
            let (at, handle, _) = created[i];
            // SAFETY: the caller guarantees `[ptr, ptr + size)` lies in a reservation of ours
            // and is not mapped; `handle` is a fresh PAGE_SIZE allocation.
            let code = unsafe { sys::cuMemMap(at, PAGE_SIZE, 0, handle, 0) };
            if let Err(e) = check("cuMemMap", code) {
                Self::undo_pages(&created);
                return Err(e);
            }
            created[i].2 = true;
        }
        // ... and make the whole range readable and writable by the device.
        // SAFETY: `[ptr, ptr + size)` was just mapped in full.
        if let Err(e) = unsafe { self.grant_access(ptr, size) } {
            Self::undo_pages(&created);
            return Err(e);
        }
        lock(&self.pages).extend(created.into_iter().map(|(at, handle, _)| (at, handle)));
        Ok(())
    }

    unsafe fn unmap(&self, ptr: DevicePtr, size: usize) {
        let page = PAGE_SIZE as u64;
        debug_assert!(ptr.is_multiple_of(page) && size.is_multiple_of(PAGE_SIZE));
        self.bind();
        // As PyTorch's `ExpandableSegment::unmapHandles`: cuMemUnmap and cuMemRelease do not
        // wait for work still queued on the memory (cuMemFree does), and a freed block's own
        // stream may still be using it, so wait for the device first.
        let _ = result::ctx::synchronize();
        let mut pages = lock(&self.pages);
        for at in (ptr..ptr + size as u64).step_by(PAGE_SIZE) {
            let Some(handle) = pages.remove(&at) else {
                debug_assert!(false, "unmapping page {at:#x}, which is not mapped");
                continue;
            };
            // SAFETY: `at` is a page this memory mapped to `handle`; the caller guarantees no
            // work uses it, and the device was synchronized above.
            let code = unsafe { sys::cuMemUnmap(at, PAGE_SIZE) };
            debug_assert_eq!(code, sys::CUresult::CUDA_SUCCESS, "cuMemUnmap failed");
            // SAFETY: `handle` is mapped nowhere any more.
            let code = unsafe { sys::cuMemRelease(handle) };
            debug_assert_eq!(code, sys::CUresult::CUDA_SUCCESS, "cuMemRelease failed");
        }
    }

    unsafe fn release(&self, ptr: DevicePtr, size: usize) {
        debug_assert!(
            lock(&self.pages).range(ptr..ptr + size as u64).next().is_none(),
            "releasing a reservation with pages still mapped"
        );
        let known = lock(&self.reservations).remove(&ptr);
        debug_assert_eq!(known, Some(size), "releasing {ptr:#x}, which is not a reservation");
        self.bind();
        // SAFETY: the caller guarantees this is exactly one reservation of ours, with nothing
        // mapped in it.
        let code = unsafe { sys::cuMemAddressFree(ptr, size) };
        debug_assert_eq!(code, sys::CUresult::CUDA_SUCCESS, "cuMemAddressFree failed");
    }
}
