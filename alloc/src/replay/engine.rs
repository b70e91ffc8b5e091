//! Running a recording through a cache.

use super::snapshot::parse_trace;
use super::{Action, Recording};
use crate::block::MempoolId;
use crate::caching::{Allocation, CachingAllocator};
use crate::error::AllocError;
use crate::memory::{DeviceMemory, SimStreams, Stream};
use crate::policy::{SMALL_BUFFER, SMALL_SIZE};
use std::collections::{HashMap, HashSet};

/// Reserved and allocated bytes after one trace entry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sample {
    /// Bytes in segments.
    pub reserved: u64,
    /// Bytes in allocated blocks.
    pub allocated: u64,
}

/// A segment action, with the allocator call that made it: calls are numbered in trace
/// order, one per `alloc` or `oom` entry and one per `empty_cache()` (see
/// [`super::RecordedFigures::calls`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentAction {
    /// The call's number.
    pub call: usize,
    /// `segment_alloc`, `segment_free`, `segment_map` or `segment_unmap`.
    pub action: Action,
    /// Bytes.
    pub size: u64,
}

/// The outcome of replaying a recording under one setting.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReplayReport {
    /// The settings (`VRAM_ALLOC_CONF` syntax; empty for the defaults).
    pub config: String,
    /// Capacity of the device replayed on.
    pub capacity: u64,
    /// `alloc` entries replayed successfully.
    pub allocations: usize,
    /// `alloc` entries that failed: out-of-memory errors the recording did not have.
    pub failed_allocations: usize,
    /// Frees replayed.
    pub frees: usize,
    /// Frees of addresses neither the trace nor the snapshot's segments allocated.
    pub unmatched_frees: usize,
    /// Frees of allocations that had failed in the replay.
    pub skipped_frees: usize,
    /// Allocations still live (or waiting for other streams) at the end of the trace; freed
    /// when the replay returns.
    pub still_live: usize,
    /// Blocks from before the trace, allocated first (see [`Recording::prior_blocks`]).
    pub prior_blocks: usize,
    /// Prior blocks and pieces of prior segments (see [`Recording::prior_segments`]) that did
    /// not fit.
    pub prior_failed: usize,
    /// `empty_cache()` calls replayed.
    pub empty_cache_calls: usize,
    /// `oom` entries in the recording.
    pub recorded_ooms: usize,
    /// Of those, the ones that fail in the replay too.
    pub ooms_reproduced: usize,
    /// Of those, the ones that fit in the replay.
    pub ooms_avoided: usize,
    /// Peak allocated bytes.
    pub peak_allocated: u64,
    /// Peak reserved bytes.
    pub peak_reserved: u64,
    /// The trace entry after which reserved bytes first reach their peak.
    pub peak_step: usize,
    /// `(reserved - allocated) / reserved` after that entry.
    pub fragmentation_at_peak: f64,
    /// Segments allocated and ranges mapped.
    pub device_allocs: u64,
    /// Segments freed and ranges unmapped.
    pub device_frees: u64,
    /// Reserved bytes when the trace's first entry replays (after the prior blocks).
    pub reserved_at_start: u64,
    /// Reserved and allocated bytes after each trace entry.
    pub timeline: Vec<Sample>,
    /// Whether the segment actions were recorded (by [`Recording::replay_with`]).
    pub recorded_segments: bool,
    /// The segment actions of the replay, in order.
    pub segment_actions: Vec<SegmentAction>,
    /// The calls that failed with out-of-memory, in order.
    pub failed_calls: Vec<usize>,
    /// The trace entries (`alloc` or `oom`) whose allocation failed, in order.
    pub failed_entries: Vec<usize>,
    /// Where the replay called `empty_cache()` of its own (a what-if): before this entry.
    pub empty_cache_before: Option<usize>,
    /// What stopped the replay early or left the report incomplete, if anything did (a
    /// device error, the replay's own trace overflowing).
    pub error: Option<ReplayError>,
}

/// What stopped a replay early, or left its report incomplete. The allocator's errors keep
/// their type, so [`ReplayError::is_out_of_memory`] tells an out-of-memory error from the
/// others (a replay counts the out-of-memory errors of its allocations in the report; one
/// that stops it came from elsewhere).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ReplayError {
    /// The allocator failed (a device error, settings the backend cannot honour).
    #[error(transparent)]
    Alloc(#[from] AllocError),
    /// The replay's own trace ran past its ring buffer: the segment actions are incomplete.
    #[error("the replay's own trace overflowed {limit} entries; segment actions are incomplete")]
    TraceOverflow {
        /// The ring buffer's size.
        limit: usize,
    },
    /// The replay's own trace could not be read back through PyTorch's snapshot layout.
    #[error("could not read the replay's trace: {reason}")]
    TraceUnreadable {
        /// What the pickle writer or the snapshot reader said.
        reason: String,
    },
}

impl ReplayError {
    /// Whether this is the allocator's out-of-memory error.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, ReplayError::Alloc(e) if e.is_out_of_memory())
    }
}

impl ReplayReport {
    /// The settings, for people: `defaults` when empty, and the `empty_cache()` the replay
    /// added, if any.
    pub fn label(&self) -> String {
        let config = if self.config.is_empty() { "defaults" } else { &self.config };
        match self.empty_cache_before {
            Some(e) => format!("{config} + empty_cache() at entry {e}"),
            None => config.to_string(),
        }
    }

    /// Whether every allocation of the trace succeeded (recorded OOMs included).
    pub fn ran_without_oom(&self) -> bool {
        self.failed_calls.is_empty() && self.error.is_none()
    }

    /// Out-of-memory errors that the recording did not have.
    pub fn new_ooms(&self) -> usize {
        self.failed_allocations
    }
}

/// The replay's handles on recorded addresses.
struct Live<'s, M: DeviceMemory> {
    streams: Option<&'s SimStreams>,
    live: HashMap<u64, Allocation<M>>,
    /// Freed, waiting for the held stream to be released at `free_completed`.
    deferred: HashMap<u64, Stream>,
    /// Without simulated streams: kept allocated until `free_completed`.
    pending_drop: HashMap<u64, Allocation<M>>,
    failed: HashSet<u64>,
    unmatched: HashSet<u64>,
    next_stream: u64,
}

impl<M: DeviceMemory> Live<'_, M> {
    /// Frees `a` so that its block returns to the cache only at the recorded
    /// `free_completed` of `addr`.
    fn defer(&mut self, addr: u64, a: Allocation<M>) {
        match self.streams {
            Some(streams) => {
                // A stream of its own, far from any real `cudaStream_t`, held until then.
                let s = Stream(self.next_stream);
                self.next_stream -= 1;
                streams.hold(s);
                a.record_stream(s);
                drop(a);
                if let Some(old) = self.deferred.insert(addr, s) {
                    streams.release(old);
                }
            }
            None => {
                self.pending_drop.insert(addr, a);
            }
        }
    }
}

/// Sends the next allocations to `pool`: the run of allocations to the private pool that is
/// open (`open`) ends (`end_allocate_to_pool`) when one goes elsewhere, and a run to a
/// private pool begins (`begin_allocate_to_pool`, every stream: within a run, every
/// allocation went to that pool, as under `torch.cuda.use_mem_pool` or a graph capture).
fn route<M: DeviceMemory>(
    cache: &CachingAllocator<M>,
    open: &mut Option<MempoolId>,
    pool: MempoolId,
) -> Result<(), AllocError> {
    if *open == Some(pool) || (open.is_none() && !pool.is_private()) {
        return Ok(());
    }
    if let Some(p) = open.take() {
        cache.end_allocate_to_pool(p)?;
    }
    if pool.is_private() {
        cache.begin_allocate_to_pool(pool, None)?;
        *open = Some(pool);
    }
    Ok(())
}

/// How [`run`] replays.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Options {
    /// Turn the cache's history on to collect the segment actions (for a cache of the
    /// replay's own).
    pub record: bool,
    /// The capacity of the device replayed on (0: the cache's memory's).
    pub capacity: u64,
    /// The capacity of the recorded device, which decides which releases were the
    /// program's `empty_cache()` (0: `capacity`).
    pub recorded_capacity: u64,
    /// Call `empty_cache()` before this entry (a what-if).
    pub empty_cache_before: Option<usize>,
    /// Leave out the timeline (when only the outcome counts).
    pub no_timeline: bool,
}

/// Replays `rec` on `cache`.
pub(crate) fn run<M: DeviceMemory>(
    rec: &Recording,
    cache: &CachingAllocator<M>,
    streams: Option<&SimStreams>,
    opts: Options,
) -> Result<ReplayReport, AllocError> {
    let entries = &rec.entries;
    let record = opts.record;
    let mut r = ReplayReport {
        config: cache.config().to_string(),
        capacity: if opts.capacity > 0 { opts.capacity } else { cache.mem_info().total },
        recorded_ooms: entries.iter().filter(|e| e.action == Action::Oom).count(),
        recorded_segments: record,
        timeline: Vec::with_capacity(if opts.no_timeline { 0 } else { entries.len() }),
        empty_cache_before: opts.empty_cache_before,
        ..ReplayReport::default()
    };
    let recorded_capacity =
        if opts.recorded_capacity > 0 { opts.recorded_capacity } else { r.capacity };
    let mut st = Live {
        streams,
        live: HashMap::new(),
        deferred: HashMap::new(),
        pending_drop: HashMap::new(),
        failed: HashSet::new(),
        unmatched: HashSet::new(),
        next_stream: u64::MAX,
    };
    // The segments from before the trace, as cached free segments: allocated whole (a small
    // one as requests of the largest small size), then freed.
    let mut fillers = Vec::new();
    let mut open: Option<MempoolId> = None;
    for seg in &rec.prior_segments {
        route(cache, &mut open, seg.pool)?;
        let pieces: Vec<usize> = if seg.size as usize <= SMALL_BUFFER {
            vec![SMALL_SIZE; (seg.size as usize).div_ceil(SMALL_SIZE)]
        } else {
            vec![seg.size as usize]
        };
        for size in pieces {
            match cache.allocate_on(size, Stream(seg.stream)) {
                Ok(a) => fillers.push(a),
                Err(e) if e.is_out_of_memory() => r.prior_failed += 1,
                Err(e) => return Err(e),
            }
        }
    }
    drop(fillers);
    // Then the blocks from before the trace, largest first, which best fit places in them.
    let mut prior: Vec<_> = rec.prior_blocks.iter().collect();
    prior.sort_by_key(|b| (std::cmp::Reverse(b.size), b.addr));
    for b in prior {
        route(cache, &mut open, b.pool)?;
        match cache.allocate_on(b.size as usize, Stream(b.stream)) {
            Ok(a) if b.pending_free => {
                r.prior_blocks += 1;
                st.defer(b.addr, a);
            }
            Ok(a) => {
                r.prior_blocks += 1;
                st.live.insert(b.addr, a);
            }
            Err(e) if e.is_out_of_memory() => r.prior_failed += 1,
            Err(e) => return Err(e),
        }
    }
    // Peaks count from the trace's start (the fillers above were never all live at once).
    cache.reset_peak_stats();
    r.reserved_at_start = cache.memory_reserved();
    let stats_before = cache.memory_stats();
    let sites = rec.call_sites(&rec.reserved_series(), recorded_capacity);
    let max_trace = entries.len().saturating_mul(8).saturating_add(1 << 16);
    if record {
        cache.record_history(Some(max_trace));
    }
    let mut call = 0usize;
    let mut malloc_calls: Vec<usize> = Vec::new();
    // Each `empty_cache()` call: its number, the allocations before it, the bytes it released.
    let mut empty_calls: Vec<(usize, usize, u64)> = Vec::new();
    let mut skip_next = false;
    let mut transient: Option<Allocation<M>> = None;
    for (i, e) in entries.iter().enumerate() {
        drop(transient.take());
        if opts.empty_cache_before == Some(i) {
            route(cache, &mut open, MempoolId::DEFAULT)?;
            cache.empty_cache();
        }
        if skip_next {
            // The `free_completed` right after a `free_requested`: already freed.
            skip_next = false;
        } else {
            match e.action {
                Action::Alloc => {
                    malloc_calls.push(call);
                    if st.live.remove(&e.addr).is_some() {
                        // The address was live: the trace missed a free. Count it.
                        r.unmatched_frees += 1;
                    }
                    st.failed.remove(&e.addr);
                    st.unmatched.remove(&e.addr);
                    route(cache, &mut open, e.pool)?;
                    match cache.allocate_on(e.size as usize, Stream(e.stream)) {
                        Ok(a) => {
                            r.allocations += 1;
                            st.live.insert(e.addr, a);
                        }
                        Err(err) if err.is_out_of_memory() => {
                            r.failed_allocations += 1;
                            r.failed_calls.push(call);
                            r.failed_entries.push(i);
                            st.failed.insert(e.addr);
                        }
                        Err(err) => return Err(err),
                    }
                    call += 1;
                }
                Action::Oom => {
                    malloc_calls.push(call);
                    route(cache, &mut open, e.pool)?;
                    match cache.allocate_on(e.size as usize, Stream(e.stream)) {
                        Ok(a) => {
                            r.ooms_avoided += 1;
                            transient = Some(a);
                        }
                        Err(err) if err.is_out_of_memory() => {
                            r.ooms_reproduced += 1;
                            r.failed_calls.push(call);
                            r.failed_entries.push(i);
                        }
                        Err(err) => return Err(err),
                    }
                    call += 1;
                }
                Action::FreeRequested => {
                    let immediate = entries
                        .get(i + 1)
                        .is_some_and(|n| n.action == Action::FreeCompleted && n.addr == e.addr);
                    if let Some(a) = st.live.remove(&e.addr) {
                        r.frees += 1;
                        if immediate {
                            drop(a);
                            skip_next = true;
                        } else {
                            st.defer(e.addr, a);
                        }
                    } else if st.failed.contains(&e.addr) {
                        r.skipped_frees += 1;
                        if immediate {
                            st.failed.remove(&e.addr);
                            skip_next = true;
                        }
                    } else {
                        r.unmatched_frees += 1;
                        if immediate {
                            skip_next = true;
                        } else {
                            st.unmatched.insert(e.addr);
                        }
                    }
                }
                Action::FreeCompleted => {
                    if let Some(s) = st.deferred.remove(&e.addr) {
                        if let Some(streams) = streams {
                            streams.release(s);
                        }
                    } else if let Some(a) = st.pending_drop.remove(&e.addr) {
                        drop(a);
                    } else if let Some(a) = st.live.remove(&e.addr) {
                        // Its `free_requested` is missing: free it now.
                        r.frees += 1;
                        drop(a);
                    } else if !st.failed.remove(&e.addr) && !st.unmatched.remove(&e.addr) {
                        r.unmatched_frees += 1;
                    }
                }
                Action::SegmentFree | Action::SegmentUnmap if sites.empty_cache_start[i] => {
                    // No capture is underway at an `empty_cache()` (PyTorch asserts it).
                    route(cache, &mut open, MempoolId::DEFAULT)?;
                    let before = cache.memory_reserved();
                    cache.empty_cache();
                    let released = before.saturating_sub(cache.memory_reserved());
                    empty_calls.push((call, malloc_calls.len(), released));
                    r.empty_cache_calls += 1;
                    call += 1;
                }
                _ => {}
            }
        }
        if !opts.no_timeline {
            r.timeline.push(Sample {
                reserved: cache.memory_reserved(),
                allocated: cache.memory_allocated(),
            });
        }
    }
    drop(transient);
    route(cache, &mut open, MempoolId::DEFAULT)?;

    if record {
        let trace = cache.trace();
        cache.record_history(None);
        if trace.len() >= max_trace {
            r.error = Some(ReplayError::TraceOverflow { limit: max_trace });
        }
        // Through PyTorch's layout, as a snapshot would carry it.
        let parsed = serde_pickle::to_value(&trace)
            .map_err(|e| e.to_string())
            .and_then(|v| parse_trace(&v, 0).map_err(|e| e.to_string()));
        match parsed {
            Ok(events) => {
                let total_calls = call;
                // An `empty_cache()` made the releases that follow the allocation before it,
                // up to the bytes it released; other segment actions belong to the next
                // allocation.
                let (mut anchors, mut next_empty) = (0usize, 0usize);
                let mut releasing: Option<(usize, u64)> = None;
                for ev in &events {
                    if matches!(ev.action, Action::Alloc | Action::Oom) {
                        anchors += 1;
                        continue;
                    }
                    if !ev.action.is_segment() || ev.size == 0 {
                        continue;
                    }
                    if ev.action.grows() {
                        r.device_allocs += 1;
                    } else {
                        r.device_frees += 1;
                    }
                    while releasing.is_none()
                        && next_empty < empty_calls.len()
                        && empty_calls[next_empty].1 == anchors
                    {
                        let (c, _, released) = empty_calls[next_empty];
                        next_empty += 1;
                        if released > 0 {
                            releasing = Some((c, released));
                        }
                    }
                    let call = match releasing {
                        Some((c, left)) if ev.action.shrinks() => {
                            let left = left.saturating_sub(ev.size);
                            releasing = (left > 0).then_some((c, left));
                            c
                        }
                        _ => malloc_calls.get(anchors).copied().unwrap_or(total_calls),
                    };
                    r.segment_actions.push(SegmentAction {
                        call,
                        action: ev.action,
                        size: ev.size,
                    });
                }
            }
            Err(reason) => r.error = Some(ReplayError::TraceUnreadable { reason }),
        }
    } else {
        let s = cache.memory_stats();
        r.device_allocs = s.num_device_alloc.saturating_sub(stats_before.num_device_alloc);
        r.device_frees = s.num_device_free.saturating_sub(stats_before.num_device_free);
    }

    r.peak_reserved = cache.max_memory_reserved();
    r.peak_allocated = cache.max_memory_allocated();
    if let Some((step, s)) = r
        .timeline
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.reserved.cmp(&b.1.reserved).then(b.0.cmp(&a.0)))
    {
        r.peak_step = step;
        if s.reserved > 0 {
            r.fragmentation_at_peak =
                s.reserved.saturating_sub(s.allocated) as f64 / s.reserved as f64;
        }
    }
    r.still_live = st.live.len() + st.pending_drop.len() + st.deferred.len();
    if let Some(streams) = streams {
        for (_, s) in st.deferred.drain() {
            streams.release(s);
        }
    }
    Ok(r)
}
