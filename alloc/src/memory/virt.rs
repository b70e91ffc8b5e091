//! Virtual memory: addresses and accounting only, no bytes.

use super::{Capacity, DeviceMemory, DevicePtr, MemInfo, PAGE_SIZE, RawError, SimStreams, Stream};
use crate::util::human_bytes;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// A device of any capacity that hands out addresses but no bytes: replays the allocation
/// pattern of an 80 GB GPU on a laptop, exactly, in microseconds. Supports expandable
/// segments; streams are simulated as on [`super::HostMemory`].
#[derive(Debug)]
pub struct VirtualMemory {
    capacity: Capacity,
    next_address: AtomicU64,
    streams: SimStreams,
    /// Addresses to hand out, from a recording ([`VirtualMemory::with_addresses`]).
    script: Option<Mutex<Script>>,
}

/// Recorded segment addresses by size, in recorded order, and the segments live now.
#[derive(Debug, Default)]
struct Script {
    by_size: HashMap<usize, VecDeque<DevicePtr>>,
    live: BTreeMap<DevicePtr, usize>,
}

impl Script {
    /// The next recorded address for a segment of `size`, if it overlaps no live segment.
    fn take(&mut self, size: usize) -> Option<DevicePtr> {
        let addr = self.by_size.get_mut(&size)?.pop_front()?;
        let end = addr.checked_add(size as u64)?;
        let before = self.live.range(..end).next_back();
        if before.is_some_and(|(&a, &s)| a + s as u64 > addr) {
            return None;
        }
        Some(addr)
    }
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
            script: None,
        }
    }

    /// A virtual device of `capacity` bytes whose segments get the addresses a recording
    /// gave them: `segments` lists each recorded `segment_alloc` as (size, address), in
    /// recorded order, and the n-th segment of a size gets the n-th recorded address of that
    /// size (while it overlaps no live segment; a fresh address above all of them
    /// otherwise).
    ///
    /// The policy breaks ties between cached blocks of one size by address (PyTorch's
    /// `BlockComparatorSize`), and a CUDA driver hands out addresses in no fixed order: a
    /// replay on increasing addresses can pick another block than the recorded run did, and
    /// drift from it. With the recorded addresses it picks the same.
    pub fn with_addresses(capacity: u64, segments: &[(usize, DevicePtr)]) -> Self {
        let mut script = Script::default();
        let mut top = BASE_ADDRESS;
        for &(size, addr) in segments {
            script.by_size.entry(size).or_default().push_back(addr);
            top = top.max(addr.saturating_add(size as u64));
        }
        let page = PAGE_SIZE as u64;
        VirtualMemory {
            next_address: AtomicU64::new(top.div_ceil(page) * page),
            script: Some(Mutex::new(script)),
            ..VirtualMemory::new(capacity)
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
        let Some(script) = &self.script else { return Ok(self.addresses(size)) };
        let mut script = script.lock().unwrap_or_else(|e| e.into_inner());
        let addr = script.take(size).unwrap_or_else(|| self.addresses(size));
        script.live.insert(addr, size);
        Ok(addr)
    }

    unsafe fn deallocate(&self, ptr: DevicePtr, size: usize) {
        self.capacity.give(size);
        if let Some(script) = &self.script {
            script.lock().unwrap_or_else(|e| e.into_inner()).live.remove(&ptr);
        }
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
