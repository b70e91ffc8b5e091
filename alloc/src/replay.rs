//! Replaying recorded allocation traces: PyTorch memory snapshots or vram's own, under the
//! settings they were recorded with and under any others.
//!
//! A trace recorded on an 80 GB GPU replays on [`crate::VirtualMemory`] of the same capacity
//! in milliseconds, because the policy is the same on every backend. Replayed under the
//! recorded settings, it should reproduce the recorded segment actions; replayed under other
//! settings (expandable segments, a split limit, a memory cap), it shows what they would have
//! changed: peak reserved memory, fragmentation, device calls, out-of-memory errors.
//!
//! # From a PyTorch snapshot
//!
//! In PyTorch, record and dump:
//!
//! ```python
//! torch.cuda.memory._record_memory_history(max_entries=100_000)
//! train()                                                  # the workload
//! torch.cuda.memory._dump_snapshot("snapshot.pickle")
//! ```
//!
//! then replay it, from code or with `cargo xtask replay snapshot.pickle --conf ...`:
//!
//! ```no_run
//! use vram_alloc::AllocatorConfig;
//! use vram_alloc::replay::PyTorchSnapshot;
//!
//! let snapshot = PyTorchSnapshot::load("snapshot.pickle")?;
//! let recording = snapshot.recording(None)?;         // the first device with a trace
//! let recorded = recording.recorded_config()?;       // from `allocator_settings`
//! let expandable = AllocatorConfig::parse("expandable_segments:True")?;
//! let what_if = recording.what_if(recorded, &[expandable], recording.infer_capacity())?;
//! println!("{}", what_if.reproduction);               // matches, or where it diverges
//! println!("{}", what_if.table());                    // peak reserved, fragmentation, OOMs
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # How a trace replays
//!
//! Each `alloc` entry becomes [`CachingAllocator::allocate_on`] of the requested size on the
//! recorded stream; the allocation is remembered under the recorded address, which later
//! entries use to name it. Segment entries are not replayed: creating and releasing segments
//! is the policy's decision, and what the check compares.
//!
//! Frees: PyTorch records `free_requested` when the program frees a block and
//! `free_completed` when the block is back in the cache. Without `record_stream` the two are
//! adjacent, and the replay drops the allocation at `free_requested`. When they are apart,
//! other streams were still using the block (`Tensor.record_stream`): the replay frees the
//! allocation at `free_requested` after [`Allocation::record_stream`](crate::Allocation::record_stream) on a held simulated
//! stream, so allocated bytes fall there while the block stays unusable, and releases that
//! stream at `free_completed`, so the block returns to the cache where it did in the
//! recording (at the start of the next allocation, or earlier if the policy synchronizes,
//! as an out-of-memory retry does). Frees of addresses the trace never allocated are
//! counted, never errors.
//!
//! Private pools (a CUDA graph's, a `torch.cuda.MemPool`'s): the snapshot's segments name
//! their pool (`segment_pool_id`), and each `alloc` is given the pool of the segment that held
//! its block (see [`Event::pool`]). A run of allocations to one private pool replays between
//! [`CachingAllocator::begin_allocate_to_pool`] and
//! [`CachingAllocator::end_allocate_to_pool`], so it uses that pool's blocks only, with
//! PyTorch's rules while a capture is underway; pools are never released (graph resets
//! and `MemPool` deletions are not recorded), so `empty_cache()` keeps their segments.
//!
//! Segment releases are replayed only where the program asked for them: a run of
//! `segment_free`/`segment_unmap` entries is `torch.cuda.empty_cache()`, and the replay calls
//! [`CachingAllocator::empty_cache`] there, unless an allocation needed it: the run is
//! followed by an `oom`, or by a new segment that would not have fitted next to what was
//! reserved (on the capacity replayed on, under a recorded memory fraction), or garbage
//! collection would have released it: the recorded settings collect garbage (a threshold
//! and a memory fraction), reserved bytes were above the threshold's share of the cap, and
//! the run frees only large-pool segments. (PyTorch releases cached segments inside an
//! allocation only after the device refused a new one, or to collect garbage, and always
//! right before the new segment or the `oom`.) An `oom` entry replays the failed request: under settings
//! where it fits, it is an out-of-memory error avoided, and the block is freed again at once
//! (the program never got it).
//!
//! The trace is a ring buffer started by `_record_memory_history`: blocks and segments from
//! before it began appear in the snapshot's `segments`, or are freed in the trace without
//! having been allocated there. The replay recreates them first: each such segment (see
//! [`Recording::prior_segments`]) by allocating its size and freeing it again, which leaves
//! it cached, then each such block (see [`Recording::prior_blocks`]), largest first, which
//! the policy places in those segments. Where blocks sat inside their segments is not
//! recorded, so a truncated trace replays approximately, and the check compares changes of
//! reserved bytes rather than their absolute values.
//! Give the recorded device's size as the capacity when it is known: it decides which
//! releases were `empty_cache()` calls (see above).

mod analysis;
mod engine;
mod scan;
mod snapshot;

pub use analysis::{
    Analysis, CallKind, CallSite, CapacityChoice, CapacitySource, DEFAULT_CAPACITY, Divergence,
    OomVerdict, Origin, RecordedFigures, Reproduction, Row, TABLE_LEGEND, WhatIf, signed_bytes,
};
pub use engine::{ReplayError, ReplayReport, Sample, SegmentAction};
pub use snapshot::{
    PyTorchSnapshot, RecordedSettings, SnapshotBlock, SnapshotError, SnapshotSegment,
};

use crate::block::MempoolId;
use crate::caching::CachingAllocator;
use crate::config::{AllocatorConfig, ConfigError};
use crate::error::AllocError;
use crate::memory::{DeviceMemory, VirtualMemory};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::Path;

/// What a trace entry records, with PyTorch's action names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// A block was handed out (`size`: the bytes requested).
    Alloc,
    /// The program freed a block (it may still wait for other streams).
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
    /// An allocation failed (`size`: the rounded request).
    Oom,
    /// A snapshot was taken (a marker).
    Snapshot,
}

impl Action {
    /// Every action, in declaration order.
    pub const ALL: [Action; 9] = [
        Action::Alloc,
        Action::FreeRequested,
        Action::FreeCompleted,
        Action::SegmentAlloc,
        Action::SegmentFree,
        Action::SegmentMap,
        Action::SegmentUnmap,
        Action::Oom,
        Action::Snapshot,
    ];

    /// PyTorch's name for the action (`"free_requested"`).
    pub fn name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
            Action::Oom => "oom",
            Action::Snapshot => "snapshot",
        }
    }

    /// The action PyTorch names `name`.
    pub fn from_name(name: &str) -> Option<Action> {
        Action::ALL.into_iter().find(|a| a.name() == name)
    }

    /// Whether the action changes reserved memory (segment and mapping actions).
    pub fn is_segment(self) -> bool {
        matches!(
            self,
            Action::SegmentAlloc | Action::SegmentFree | Action::SegmentMap | Action::SegmentUnmap
        )
    }

    /// Whether the action adds reserved memory (`segment_alloc`, `segment_map`).
    pub fn grows(self) -> bool {
        matches!(self, Action::SegmentAlloc | Action::SegmentMap)
    }

    /// Whether the action returns reserved memory (`segment_free`, `segment_unmap`).
    pub fn shrinks(self) -> bool {
        matches!(self, Action::SegmentFree | Action::SegmentUnmap)
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One trace entry, as PyTorch records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// What happened.
    pub action: Action,
    /// The block's address (`alloc`, `free_*`), the segment's or mapped range's (segment
    /// actions); 0 for `oom` and `snapshot`.
    pub addr: u64,
    /// Bytes: requested (`alloc`, `free_*`), of the segment or range (segment actions), the
    /// rounded request (`oom`).
    pub size: u64,
    /// The stream (a `cudaStream_t` value; 0 is the default stream).
    pub stream: u64,
    /// When, in microseconds (0 if not recorded).
    #[serde(default)]
    pub time_us: u64,
    /// The device's free bytes when an `oom` happened (0 otherwise).
    #[serde(default)]
    pub device_free: u64,
    /// The memory pool of an `alloc` (and of an `oom` during a run of a private pool's
    /// allocations): PyTorch's trace entries do not record it; the reader takes it from the
    /// snapshot's segments (`segment_pool_id` of the segment that held the block). (0, 0)
    /// for the default pools and for every other entry.
    #[serde(default)]
    pub pool: MempoolId,
}

/// A block that was live when the trace began (allocated before history was recorded).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PriorBlock {
    /// Its recorded address.
    pub addr: u64,
    /// The bytes requested for it.
    pub size: u64,
    /// Its stream.
    pub stream: u64,
    /// Whether it was already freed and waiting for other streams when the trace began.
    pub pending_free: bool,
    /// Its memory pool ((0, 0) for the default pools).
    #[serde(default)]
    pub pool: MempoolId,
}

/// A segment that existed when the trace began.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PriorSegment {
    /// Its recorded address.
    pub addr: u64,
    /// Bytes.
    pub size: u64,
    /// Its stream.
    pub stream: u64,
    /// Its memory pool ((0, 0) for the default pools).
    #[serde(default)]
    pub pool: MempoolId,
}

/// The resolution of [`Recording::smallest_capacity`]: 2 MiB, the unit of every segment
/// and mapping (a capacity between two multiples fits what the lower one fits).
pub const FIT_STEP: u64 = 2 << 20;

/// The largest device [`Recording::smallest_capacity`] tries: 256 TiB.
pub const FIT_LIMIT: u64 = 1 << 48;

/// The smallest device that runs a trace without an out-of-memory error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Fit {
    /// Bytes (a multiple of [`FIT_STEP`]; one step less fails).
    Bytes(u64),
    /// Not even this many bytes are enough.
    Beyond(u64),
}

/// What a replay runs: allocator settings, and optionally an `empty_cache()` call the
/// program did not make.
#[derive(Clone, Debug, PartialEq)]
pub struct Scenario {
    /// The settings.
    pub config: AllocatorConfig,
    /// Call `empty_cache()` before this trace entry.
    pub empty_cache_before: Option<usize>,
}

impl Scenario {
    /// Just settings.
    pub fn settings(config: AllocatorConfig) -> Scenario {
        Scenario { config, empty_cache_before: None }
    }
}

/// A trace with the context needed to replay it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Recording {
    /// Capacity of the device it was recorded on; 0 when unknown (PyTorch snapshots do not
    /// record it; see [`Recording::infer_capacity`]).
    pub device_total: u64,
    /// The allocator settings it was recorded with (`VRAM_ALLOC_CONF` syntax).
    pub config: String,
    /// The actions, oldest first.
    pub entries: Vec<Event>,
    /// Blocks live when the trace began, by address: freed in the trace without having been
    /// allocated there, or live at the end in the snapshot's segments and not allocated in
    /// the trace. The replay allocates them first.
    #[serde(default)]
    pub prior_blocks: Vec<PriorBlock>,
    /// Segments that existed when the trace began, by address: freed in the trace without
    /// having been allocated there, or in the snapshot's segments and not allocated in the
    /// trace. The replay creates them first, as cached free segments, then allocates
    /// [`Recording::prior_blocks`] into them.
    #[serde(default)]
    pub prior_segments: Vec<PriorSegment>,
    /// Bytes reserved when the trace began (the snapshot's segments less what the trace's
    /// segment actions added); 0 for a trace that starts from an empty cache.
    #[serde(default)]
    pub reserved_before: u64,
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
    /// Captures what `cache` has recorded so far (see [`CachingAllocator::record_history`]),
    /// through its snapshot in PyTorch's layout, so that a capture and a PyTorch snapshot
    /// replay alike.
    pub fn capture<M: DeviceMemory>(cache: &CachingAllocator<M>) -> Recording {
        let pickle = cache.snapshot().to_pickle();
        let snapshot = PyTorchSnapshot::from_pickle(&pickle)
            .expect("vram's snapshots are in PyTorch's layout, which PyTorchSnapshot reads");
        let mut rec = snapshot.recording_of(0);
        rec.device_total = cache.mem_info().total;
        rec.config = cache.config().to_string();
        rec
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

    /// The settings the trace was recorded with.
    pub fn recorded_config(&self) -> Result<AllocatorConfig, ConfigError> {
        AllocatorConfig::parse(&self.config)
    }

    /// Whether the trace starts from an empty cache (no block or segment before it), so that
    /// a replay can reproduce it exactly.
    pub fn starts_empty(&self) -> bool {
        self.prior_blocks.is_empty() && self.prior_segments.is_empty() && self.reserved_before == 0
    }

    /// Replays the trace on `cache`, whatever its memory: allocations, frees and
    /// `empty_cache` calls (see the [module documentation](self)). Allocations that fail
    /// are counted and their frees skipped. The cache's history setting is left alone, so
    /// the report has no segment actions; frees delayed by other streams happen at
    /// `free_completed`. Peak statistics are reset where the trace starts (after the blocks
    /// from before it). Allocations still live at the end are freed when this returns.
    pub fn replay<M: DeviceMemory>(&self, cache: &CachingAllocator<M>) -> ReplayReport {
        engine::run(self, cache, None, engine::Options::default())
            .unwrap_or_else(|e| ReplayReport { error: Some(e.into()), ..ReplayReport::default() })
    }

    /// Replays the trace on a fresh [`VirtualMemory`] of `capacity` bytes under `config`,
    /// recording the segment actions (for [`Recording::check`]) and the memory after every
    /// entry. Segments get the addresses the recording gave segments of their size
    /// ([`VirtualMemory::with_addresses`]): the policy breaks ties between equal blocks by
    /// address. Fails only if the settings cannot be honoured; out-of-memory errors are
    /// counted in the report.
    pub fn replay_with(
        &self,
        config: AllocatorConfig,
        capacity: u64,
    ) -> Result<ReplayReport, AllocError> {
        self.replay_scenario(&Scenario::settings(config), capacity, capacity)
    }

    /// Replays the trace as [`Recording::replay_with`] does, under `scenario`, on a device of
    /// `capacity` bytes; the trace is read as recorded on a device of `recorded_capacity`
    /// (which decides which releases were the program's `empty_cache()`).
    pub fn replay_scenario(
        &self,
        scenario: &Scenario,
        capacity: u64,
        recorded_capacity: u64,
    ) -> Result<ReplayReport, AllocError> {
        self.replay_on_virtual(scenario, capacity, recorded_capacity, true)
    }

    fn replay_on_virtual(
        &self,
        scenario: &Scenario,
        capacity: u64,
        recorded_capacity: u64,
        full: bool,
    ) -> Result<ReplayReport, AllocError> {
        let segments: Vec<(usize, u64)> = self
            .entries
            .iter()
            .filter(|e| e.action == Action::SegmentAlloc)
            .map(|e| (e.size as usize, e.addr))
            .collect();
        let memory = VirtualMemory::with_addresses(capacity, &segments);
        let cache = CachingAllocator::with_config(memory, scenario.config.clone())?;
        let opts = engine::Options {
            record: full,
            capacity,
            recorded_capacity,
            empty_cache_before: scenario.empty_cache_before,
            no_timeline: !full,
        };
        engine::run(self, &cache, Some(cache.memory().streams()), opts)
    }

    /// The smallest device on which `scenario` replays the whole trace without an
    /// out-of-memory error, to [`FIT_STEP`] (segments and mappings are whole multiples of
    /// it), searched by doubling from `start` and then bisection; the trace is read as
    /// recorded on `recorded_capacity`. [`Fit::Beyond`] when even [`FIT_LIMIT`] is not
    /// enough (a request of an exabyte always fails).
    pub fn smallest_capacity(
        &self,
        scenario: &Scenario,
        recorded_capacity: u64,
        start: u64,
    ) -> Result<Fit, AllocError> {
        let fits = |cap: u64| -> Result<bool, AllocError> {
            Ok(self.replay_on_virtual(scenario, cap, recorded_capacity, false)?.ran_without_oom())
        };
        let mut hi = start.max(FIT_STEP).next_multiple_of(FIT_STEP);
        let mut lo = 0;
        while !fits(hi)? {
            lo = hi;
            if hi >= FIT_LIMIT {
                return Ok(Fit::Beyond(FIT_LIMIT));
            }
            hi = hi.saturating_mul(2).min(FIT_LIMIT);
        }
        while hi - lo > FIT_STEP {
            let mid = (lo + (hi - lo) / 2) / FIT_STEP * FIT_STEP;
            let mid = if mid <= lo { lo + FIT_STEP } else { mid };
            if fits(mid)? {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        Ok(Fit::Bytes(hi))
    }
}
