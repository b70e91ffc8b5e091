//! A bounded trace of allocator actions.

use crate::memory::{DevicePtr, Stream};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// What happened, with PyTorch's action names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceAction {
    /// A block was handed out.
    Alloc,
    /// Its owner freed it (it may still wait for other streams).
    FreeRequested,
    /// The block went back to the cache.
    FreeCompleted,
    /// A segment was obtained from the device.
    SegmentAlloc,
    /// A segment was returned to the device.
    SegmentFree,
    /// Pages were mapped into an expandable segment.
    SegmentMap,
    /// Pages were unmapped from an expandable segment.
    SegmentUnmap,
    /// An allocation failed.
    Oom,
}

/// One traced action, recorded where PyTorch's `record_trace` records it.
///
/// `alloc`, `free_requested` and `free_completed` carry the block's own address and size
/// (before any coalescing) and the bytes its owner asked for; PyTorch's trace reports the
/// latter as `size`. Segment actions carry the segment's (or mapped range's) address and
/// size. `oom` carries the rounded request as `size`, the original request as `requested`
/// and the device's free bytes as `device_free` (PyTorch stores that in `addr`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceEntry {
    /// What happened.
    pub action: TraceAction,
    /// Address of the block or segment (0 for an OOM).
    pub addr: DevicePtr,
    /// Bytes: the block's or segment's size; the rounded request for OOMs.
    pub size: usize,
    /// Bytes the caller asked for (`alloc`, `free_*` and `oom` entries; 0 otherwise).
    pub requested: usize,
    /// The stream.
    pub stream: u64,
    /// Microseconds since the Unix epoch.
    pub time_us: u64,
    /// Free device memory when an `oom` happened (0 otherwise).
    #[serde(default)]
    pub device_free: u64,
}

/// Ring buffer of the most recent actions; off by default.
#[derive(Debug, Default)]
pub(crate) struct Trace {
    max_entries: usize,
    entries: VecDeque<TraceEntry>,
}

impl Trace {
    pub fn set_max_entries(&mut self, max: usize) {
        self.max_entries = max;
        while self.entries.len() > max {
            self.entries.pop_front();
        }
    }

    #[inline]
    pub fn record(&mut self, action: TraceAction, addr: DevicePtr, size: usize, stream: Stream) {
        if self.max_entries > 0 {
            self.push(action, addr, size, 0, stream);
        }
    }

    /// Records a block action (`alloc`, `free_requested`, `free_completed`) or an `oom`.
    #[inline]
    pub fn record_block(
        &mut self,
        action: TraceAction,
        addr: DevicePtr,
        size: usize,
        requested: usize,
        stream: Stream,
    ) {
        if self.max_entries > 0 {
            self.push(action, addr, size, requested, stream);
        }
    }

    /// Records an `oom` with the device's free bytes.
    pub fn record_oom(&mut self, size: usize, requested: usize, device_free: u64, stream: Stream) {
        if self.max_entries > 0 {
            self.push(TraceAction::Oom, 0, size, requested, stream);
            if let Some(last) = self.entries.back_mut() {
                last.device_free = device_free;
            }
        }
    }

    #[cold]
    fn push(
        &mut self,
        action: TraceAction,
        addr: DevicePtr,
        size: usize,
        requested: usize,
        stream: Stream,
    ) {
        if self.entries.len() == self.max_entries {
            self.entries.pop_front();
        }
        let time_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        self.entries.push_back(TraceEntry {
            action,
            addr,
            size,
            requested,
            stream: stream.0,
            time_us,
            device_free: 0,
        });
    }

    pub fn entries(&self) -> Vec<TraceEntry> {
        self.entries.iter().copied().collect()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }
}
