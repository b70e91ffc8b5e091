//! Raw CUDA memory: `cuMemAlloc`/`cuMemFree`, events and `cuMemGetInfo` on a device's primary
//! context, through cudarc's driver API (loaded at run time).

use super::probe::probe;
use crate::memory::{DeviceMemory, DevicePtr, MemInfo, RawError, Stream};
use crate::util::human_bytes;
use cudarc::driver::{DriverError, result, sys};

/// Raw memory of one CUDA device, in its primary context (the one cudarc's `CudaContext`
/// and the CUDA runtime use, so pointers are interchangeable with theirs).
///
/// Every segment is one `cuMemAlloc`, not one `CudaSlice` per block: blocks are ranges of
/// segments, handed out as raw `CUdeviceptr`s by [`crate::Allocation::ptr`]. Streams are raw
/// `CUstream` handles (`Stream(stream as u64)`; [`Stream::DEFAULT`] is the legacy default
/// stream).
#[derive(Debug)]
pub struct CudaMemory {
    device: sys::CUdevice,
    context: sys::CUcontext,
    name: String,
    total: u64,
}

// SAFETY: a primary context may be made current on any thread; every call below binds it
// first, and the handle itself is never mutated after construction.
unsafe impl Send for CudaMemory {}
// SAFETY: as above; the driver API is thread-safe.
unsafe impl Sync for CudaMemory {}

/// A CUDA event (created without timing).
#[derive(Debug)]
pub struct CudaEvent(sys::CUevent);

// SAFETY: CUDA events may be used and destroyed from any thread.
unsafe impl Send for CudaEvent {}

fn device_error(what: &str, e: DriverError) -> RawError {
    RawError::Device(format!("{what}: {e}"))
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
        Ok(CudaMemory { device, context, name: info.name, total: info.total_bytes as u64 })
    }

    fn bind(&self) {
        // SAFETY: `context` is a retained primary context, alive until drop.
        let bound = unsafe { result::ctx::set_current(self.context) };
        debug_assert!(bound.is_ok(), "cuCtxSetCurrent failed: {bound:?}");
    }
}

impl Drop for CudaMemory {
    fn drop(&mut self) {
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
        let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| device_error("cuEventCreate", e))?;
        // SAFETY: `event` was just created; `stream` is a CUstream handle of this context
        // given by the caller (0 is the legacy default stream).
        let recorded = unsafe { result::event::record(event, stream.0 as sys::CUstream) };
        if let Err(e) = recorded {
            // SAFETY: the event was created above and is not used elsewhere.
            let _ = unsafe { result::event::destroy(event) };
            return Err(device_error("cuEventRecord", e));
        }
        Ok(CudaEvent(event))
    }

    fn event_completed(&self, event: &CudaEvent) -> bool {
        // SAFETY: the event is live (destroyed only through `destroy_event`).
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
        // SAFETY: the event is live and owned by the caller, who gives it up.
        let _ = unsafe { result::event::destroy(event.0) };
    }

    fn synchronize_all(&self) {
        self.bind();
        let _ = result::ctx::synchronize();
    }
}
