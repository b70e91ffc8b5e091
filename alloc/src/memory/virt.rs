//! Virtual memory: addresses and accounting only, no bytes.

use super::{Capacity, DeviceMemory, DevicePtr, MemInfo, PAGE_SIZE, RawError, SimStreams, Stream};
use crate::util::human_bytes;
use std::sync::atomic::{AtomicU64, Ordering};

/// A device of any capacity that hands out addresses but no bytes: replays the allocation
/// pattern of an 80 GB GPU on a laptop, exactly, in microseconds. Supports expandable
/// segments; streams are simulated as on [`super::HostMemory`].
#[derive(Debug)]
pub struct VirtualMemory {
    capacity: Capacity,
    next_address: AtomicU64,
    streams: SimStreams,
}

/// Where virtual addresses start: far from 0 so that a null pointer is never handed out.
const BASE_ADDRESS: u64 = 0x7000_0000_0000;

impl VirtualMemory {
    /// A virtual device of `capacity` bytes.
    pub fn new(capacity: u64) -> Self {
        VirtualMemory {
            capacity: Capacity::new(capacity),
            next_address: AtomicU64::new(BASE_ADDRESS),
            streams: SimStreams::default(),
        }
    }

    /// The simulated streams, to hold or release them in tests.
    pub fn streams(&self) -> &SimStreams {
        &self.streams
    }

    /// Fresh addresses; never reused, so a stale address can never alias a new block.
    fn addresses(&self, size: usize) -> DevicePtr {
        let span = (size as u64).div_ceil(PAGE_SIZE as u64) * PAGE_SIZE as u64;
        self.next_address.fetch_add(span, Ordering::Relaxed)
    }
}

impl DeviceMemory for VirtualMemory {
    type Event = super::sim::SimEvent;

    fn name(&self) -> String {
        format!("virtual memory ({})", human_bytes(self.capacity.info().total))
    }

    fn allocate(&self, size: usize) -> Result<DevicePtr, RawError> {
        self.capacity.take(size)?;
        Ok(self.addresses(size))
    }

    unsafe fn deallocate(&self, _ptr: DevicePtr, size: usize) {
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
        Ok(self.addresses(size))
    }

    unsafe fn map(&self, _ptr: DevicePtr, size: usize) -> Result<(), RawError> {
        self.capacity.take(size)
    }

    unsafe fn unmap(&self, _ptr: DevicePtr, size: usize) {
        self.capacity.give(size);
    }

    unsafe fn release(&self, _ptr: DevicePtr, _size: usize) {}
}
