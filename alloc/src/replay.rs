//! Recording a trace to a file and replaying it on any backend.
//!
//! A trace recorded on an 80 GB GPU replays on [`crate::VirtualMemory`] of the same capacity
//! in microseconds, with the same segments and statistics, because the policy is the same on
//! every backend. Replaying under other settings (expandable segments, a memory cap) shows
//! what they would have changed.

use crate::caching::{Allocation, CachingAllocator};
use crate::memory::{DeviceMemory, DevicePtr, Stream};
use crate::trace::{TraceAction, TraceEntry};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;

/// A trace with the context needed to replay it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Recording {
    /// Capacity of the device it was recorded on.
    pub device_total: u64,
    /// The allocator settings it was recorded with (`VRAM_ALLOC_CONF` syntax).
    pub config: String,
    /// The actions, oldest first.
    pub entries: Vec<TraceEntry>,
}

/// What can go wrong reading or writing a recording.
#[derive(Debug, thiserror::Error)]
pub enum RecordingError {
    /// The file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not a recording.
    #[error("{path} is not a vram-alloc recording: {source}")]
    Format {
        /// The file.
        path: String,
        /// The parse error.
        source: serde_json::Error,
    },
}

impl Recording {
    /// Captures the trace `cache` has recorded so far (see
    /// [`CachingAllocator::record_history`]).
    pub fn capture<M: DeviceMemory>(cache: &CachingAllocator<M>) -> Recording {
        Recording {
            device_total: cache.mem_info().total,
            config: cache.config().to_string(),
            entries: cache.trace(),
        }
    }

    /// Writes the recording as JSON.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), RecordingError> {
        let path = path.as_ref();
        let text = serde_json::to_string(self).expect("recordings serialize");
        std::fs::write(path, text)
            .map_err(|source| RecordingError::Io { path: path.display().to_string(), source })
    }

    /// Reads a recording written by [`Recording::save`].
    pub fn load(path: impl AsRef<Path>) -> Result<Recording, RecordingError> {
        let path = path.as_ref();
        let shown = || path.display().to_string();
        let text = std::fs::read_to_string(path)
            .map_err(|source| RecordingError::Io { path: shown(), source })?;
        serde_json::from_str(&text)
            .map_err(|source| RecordingError::Format { path: shown(), source })
    }

    /// Replays the allocations and frees on `cache`. Allocations that fail are counted and
    /// their later frees skipped; frees of blocks allocated before the trace began are
    /// skipped too.
    pub fn replay<M: DeviceMemory>(&self, cache: &CachingAllocator<M>) -> ReplayReport {
        let mut live: HashMap<DevicePtr, Allocation<M>> = HashMap::new();
        let mut report = ReplayReport::default();
        for e in &self.entries {
            match e.action {
                TraceAction::Alloc => match cache.allocate_on(e.requested, Stream(e.stream)) {
                    Ok(a) => {
                        report.allocations += 1;
                        live.insert(e.addr, a);
                    }
                    Err(_) => report.failed_allocations += 1,
                },
                TraceAction::FreeRequested => {
                    if live.remove(&e.addr).is_some() {
                        report.frees += 1;
                    } else {
                        report.unmatched_frees += 1;
                    }
                }
                _ => {}
            }
        }
        report.peak_allocated = cache.max_memory_allocated();
        report.peak_reserved = cache.max_memory_reserved();
        report.still_live = live.len();
        report
    }
}

/// The outcome of a replay.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReplayReport {
    /// Allocations replayed.
    pub allocations: usize,
    /// Allocations that failed (out of memory under the replay's settings).
    pub failed_allocations: usize,
    /// Frees replayed.
    pub frees: usize,
    /// Frees of allocations not in the trace (or that failed).
    pub unmatched_frees: usize,
    /// Allocations still live at the end of the trace (freed when the replay returns).
    pub still_live: usize,
    /// Peak allocated bytes during the replay.
    pub peak_allocated: u64,
    /// Peak reserved bytes during the replay.
    pub peak_reserved: u64,
}
