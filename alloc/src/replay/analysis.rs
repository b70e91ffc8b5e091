//! What a recording says by itself, whether a replay reproduces it, and what-if tables.

use super::engine::{ReplayReport, SegmentAction};
use super::{Action, Event, Fit, Recording, Scenario};
use crate::config::AllocatorConfig;
use crate::error::AllocError;
use crate::policy::SMALL_BUFFER;
use crate::util::human_bytes;
use serde::Serialize;
use std::collections::BTreeSet;
use std::fmt;

/// The capacity assumed when nothing says otherwise: an 80 GB GPU (A100/H100).
pub const DEFAULT_CAPACITY: u64 = 80 << 30;

/// An allocator call that a trace records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallKind {
    /// An allocation that succeeded (`alloc` entry).
    Alloc,
    /// An allocation that failed (`oom` entry).
    Oom,
    /// `torch.cuda.empty_cache()` (a run of segment releases that no allocation follows).
    EmptyCache,
}

/// Where an allocator call is in the trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallSite {
    /// The `alloc` or `oom` entry, or the first release of an `empty_cache()`.
    pub entry: usize,
    /// What the call was.
    pub kind: CallKind,
}

pub(crate) struct CallSites {
    pub sites: Vec<CallSite>,
    /// Whether entry `i` starts the releases of an `empty_cache()`.
    pub empty_cache_start: Vec<bool>,
    /// The call each segment entry belongs to (`sites.len()` for none).
    pub call_of: Vec<usize>,
}

/// Numbers the allocator calls of a trace and assigns its segment actions to them: the
/// releases of an `empty_cache()` to it, every other segment action to the allocation it
/// precedes. `reserved` holds the reserved bytes after each entry.
///
/// The trace does not record `empty_cache()`; a run of releases is the allocator's own only
/// where PyTorch's `DeviceCachingAllocator::malloc` releases cached segments itself:
/// - after `alloc_block` failed (`release_available_cached_blocks`, then
///   `release_cached_blocks`): the run is followed by an `oom`, or by a new segment that
///   would not have fitted under `limit` (the device, or the memory fraction's cap:
///   `alloc_block` refuses when `total_allocated_memory + size > allowed_memory_maximum`)
///   next to what was reserved before the run;
/// - garbage collection (`garbage_collect_cached_blocks`, on only with a memory fraction and
///   a threshold: `gc_threshold` is `threshold * cap`): it releases nothing unless reserved
///   bytes (`total_allocated_memory`) exceed the threshold, and it releases only unsplit
///   blocks of the large pool, never a 2 MiB small-pool segment.
///
/// Every other run of releases is the program's `empty_cache()`.
pub(crate) fn call_sites(
    entries: &[Event],
    reserved: &[u64],
    reserved_before: u64,
    limit: u64,
    gc_threshold: Option<u64>,
) -> CallSites {
    let n = entries.len();
    let mut sites = Vec::new();
    let mut empty_cache_start = vec![false; n];
    let mut call_of = vec![usize::MAX; n];
    let mut i = 0;
    while i < n {
        let a = entries[i].action;
        if a.shrinks() {
            let mut end = i;
            while end < n && entries[end].action.shrinks() {
                end += 1;
            }
            let before = if i == 0 { reserved_before } else { reserved[i - 1] };
            let run = &entries[i..end];
            // Garbage collection frees whole segments (`release_block`, never an unmap) of the
            // large pool: never a 2 MiB segment, which is a small-pool one (large-pool
            // segments are 20 MiB, or 2 MiB multiples of at least 10 MiB).
            let collectable = run
                .iter()
                .all(|e| e.action == Action::SegmentFree && e.size != SMALL_BUFFER as u64);
            let collected = collectable && gc_threshold.is_some_and(|t| before > t);
            let inside_malloc = match entries.get(end) {
                Some(e) if e.action == Action::Oom => true,
                Some(e) if e.action.grows() => collected || before.saturating_add(e.size) > limit,
                _ => false,
            };
            if !inside_malloc {
                empty_cache_start[i] = true;
                let call = sites.len();
                sites.push(CallSite { entry: i, kind: CallKind::EmptyCache });
                call_of[i..end].fill(call);
            }
            i = end;
            continue;
        }
        if matches!(a, Action::Alloc | Action::Oom) {
            let kind = if a == Action::Oom { CallKind::Oom } else { CallKind::Alloc };
            call_of[i] = sites.len();
            sites.push(CallSite { entry: i, kind });
        }
        i += 1;
    }
    // Segment actions outside `empty_cache()` belong to the next allocation.
    let mut next = sites.len();
    for i in (0..n).rev() {
        let a = entries[i].action;
        if matches!(a, Action::Alloc | Action::Oom) {
            next = call_of[i];
        } else if a.is_segment() && call_of[i] == usize::MAX {
            call_of[i] = next;
        }
    }
    CallSites { sites, empty_cache_start, call_of }
}

/// What a recording says by itself.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RecordedFigures {
    /// Reserved bytes after each entry: [`Recording::reserved_before`] plus the segment
    /// actions so far.
    pub reserved: Vec<u64>,
    /// Peak of those.
    pub peak_reserved: u64,
    /// `alloc` entries.
    pub allocs: usize,
    /// `free_requested` entries.
    pub frees: usize,
    /// Segments allocated and ranges mapped.
    pub device_allocs: u64,
    /// Segments freed and ranges unmapped.
    pub device_frees: u64,
    /// `oom` entries.
    pub ooms: usize,
    /// The streams the trace uses, in increasing order.
    pub streams: Vec<u64>,
    /// The allocator calls, in order (their index is the call's number).
    pub calls: Vec<CallSite>,
    /// The segment actions with the call they belong to (zero-size ones left out).
    pub segment_actions: Vec<SegmentAction>,
}

/// Where the capacity of the replayed device comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CapacitySource {
    /// Given by the user.
    Given,
    /// The recording states the device's size (vram's own recordings).
    Recorded,
    /// From an out-of-memory entry: the bytes reserved then plus the device's free bytes.
    OutOfMemory {
        /// The `oom` entry.
        entry: usize,
        /// Reserved bytes at that entry.
        reserved: u64,
        /// The device's free bytes it records.
        device_free: u64,
    },
    /// Nothing says: [`DEFAULT_CAPACITY`].
    Default,
    /// Nothing says, and the trace reserves more than [`DEFAULT_CAPACITY`]: its peak,
    /// rounded up to a GiB.
    RecordedPeak,
}

/// The capacity of the device a replay runs on, and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CapacityChoice {
    /// Bytes.
    pub bytes: u64,
    /// Why.
    pub source: CapacitySource,
}

impl CapacityChoice {
    /// A capacity the user chose.
    pub fn given(bytes: u64) -> Self {
        CapacityChoice { bytes, source: CapacitySource::Given }
    }
}

impl fmt::Display for CapacityChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (", human_bytes(self.bytes))?;
        match self.source {
            CapacitySource::Given => write!(f, "given"),
            CapacitySource::Recorded => write!(f, "the recorded device's size"),
            CapacitySource::OutOfMemory { entry, reserved, device_free } => write!(
                f,
                "inferred from the oom at entry {entry}: {} reserved + {} free on the device",
                human_bytes(reserved),
                human_bytes(device_free)
            ),
            CapacitySource::Default => {
                write!(f, "default: the snapshot records neither the device's size nor an oom")
            }
            CapacitySource::RecordedPeak => {
                write!(f, "the recorded peak reserved, rounded up: the snapshot records no size")
            }
        }?;
        write!(f, ")")
    }
}

/// Whether a replay under the recorded settings reproduces the recording.
#[derive(Clone, Debug, PartialEq)]
pub struct Reproduction {
    /// Whether the replay recorded its segment actions (else nothing was compared).
    pub checked: bool,
    /// Segment actions compared.
    pub segment_actions: usize,
    /// Allocator calls compared.
    pub calls: usize,
    /// Whether the trace starts from an empty cache; if not, the replay starts from the
    /// blocks live then only, and reserved bytes are compared as changes from the start.
    pub exact_start: bool,
    /// Reserved bytes when the trace began: recorded, and in the replay.
    pub start_reserved: (u64, u64),
    /// The first difference, if any.
    pub divergence: Option<Divergence>,
}

impl Reproduction {
    /// Whether the replay reproduces the recording.
    pub fn matches(&self) -> bool {
        self.checked && self.divergence.is_none()
    }
}

/// The first place a replay differs from its recording.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Divergence {
    /// The trace entry.
    pub entry: usize,
    /// What happened there, e.g. `alloc of 12.00 MiB on stream 0x0`.
    pub what: String,
    /// What the recording has.
    pub expected: String,
    /// What the replay did.
    pub got: String,
}

impl fmt::Display for Reproduction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.checked {
            return write!(f, "not checked (the replay did not record its segment actions)");
        }
        match &self.divergence {
            None => write!(
                f,
                "matches the recording: the same {} segment actions in {} allocator calls, and \
                 the same reserved bytes after every entry",
                self.segment_actions, self.calls
            )?,
            Some(d) => write!(
                f,
                "DIVERGES at trace entry {} ({}): expected {}, got {}",
                d.entry, d.what, d.expected, d.got
            )?,
        }
        if !self.exact_start {
            write!(
                f,
                " [approximate: the trace began with {} reserved and the replay with {}, \
                 recreating the blocks and segments of that time but not where the blocks sat \
                 in the segments; reserved bytes are compared as changes from the start]",
                human_bytes(self.start_reserved.0),
                human_bytes(self.start_reserved.1)
            )?;
        }
        Ok(())
    }
}

/// `segment_free 2 x 2.00 MiB, 24.00 MiB; segment_alloc 20.00 MiB` (sorted input).
fn list_actions(actions: &[(Action, u64)]) -> String {
    let mut groups: Vec<(Action, Vec<(u64, usize)>)> = Vec::new();
    for &(a, size) in actions {
        match groups.last_mut() {
            Some((last, sizes)) if *last == a => match sizes.last_mut() {
                Some((s, n)) if *s == size => *n += 1,
                _ => sizes.push((size, 1)),
            },
            _ => groups.push((a, vec![(size, 1)])),
        }
    }
    let parts: Vec<String> = groups
        .iter()
        .map(|(a, sizes)| {
            let sizes: Vec<String> = sizes
                .iter()
                .map(
                    |&(s, n)| {
                        if n == 1 { human_bytes(s) } else { format!("{n} x {}", human_bytes(s)) }
                    },
                )
                .collect();
            format!("{a} {}", sizes.join(", "))
        })
        .collect();
    parts.join("; ")
}

/// What one side did in a call, and what it lacks compared with the other.
fn describe_actions(actions: &[(Action, u64)], failed: bool, other: &[(Action, u64)]) -> String {
    let mut text =
        if actions.is_empty() { "no segment action".to_string() } else { list_actions(actions) };
    // Multiset difference of two sorted lists.
    let mut missing = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < other.len() {
        if j < actions.len() && actions[j] < other[i] {
            j += 1;
        } else if j < actions.len() && actions[j] == other[i] {
            i += 1;
            j += 1;
        } else {
            missing.push(other[i]);
            i += 1;
        }
    }
    if !missing.is_empty() && !actions.is_empty() {
        text.push_str(&format!(" (without {})", list_actions(&missing)));
    }
    if failed {
        text.push_str(", then out of memory");
    }
    text
}

fn grouped(actions: &[SegmentAction], calls: usize) -> Vec<Vec<(Action, u64)>> {
    let mut out = vec![Vec::new(); calls + 1];
    for a in actions {
        out[a.call.min(calls)].push((a.action, a.size));
    }
    for g in &mut out {
        g.sort_unstable();
    }
    out
}

impl Recording {
    /// Reserved bytes after each entry: [`Recording::reserved_before`] plus the segment
    /// actions so far.
    pub fn reserved_series(&self) -> Vec<u64> {
        let mut reserved = self.reserved_before as i128;
        self.entries
            .iter()
            .map(|e| {
                if e.action.grows() {
                    reserved += e.size as i128;
                } else if e.action.shrinks() {
                    reserved -= e.size as i128;
                }
                reserved.clamp(0, u64::MAX as i128) as u64
            })
            .collect()
    }

    /// The trace's allocator calls when replayed on `capacity` bytes (see the
    /// [module documentation](super) on `empty_cache()`).
    pub(crate) fn call_sites(&self, reserved: &[u64], capacity: u64) -> CallSites {
        let config = self.recorded_config().ok();
        let cap = config
            .as_ref()
            .and_then(AllocatorConfig::memory_fraction)
            .map(|f| (f * capacity as f64) as u64);
        let limit = cap.unwrap_or(capacity);
        // As `State`: the threshold's share of the cap, garbage collection only with a cap.
        let gc_threshold =
            match (cap, config.as_ref().and_then(AllocatorConfig::garbage_collection_threshold)) {
                (Some(cap), Some(t)) => Some((t * cap as f64) as u64),
                _ => None,
            };
        call_sites(&self.entries, reserved, self.reserved_before, limit, gc_threshold)
    }

    /// The figures the trace itself gives: reserved bytes after each entry, counts, and the
    /// allocator calls when replayed on `capacity` bytes.
    pub fn figures(&self, capacity: u64) -> RecordedFigures {
        let reserved = self.reserved_series();
        let sites = self.call_sites(&reserved, capacity);
        let mut f = RecordedFigures {
            peak_reserved: reserved.iter().copied().fold(self.reserved_before, u64::max),
            ..RecordedFigures::default()
        };
        let mut streams = BTreeSet::new();
        for (i, e) in self.entries.iter().enumerate() {
            match e.action {
                Action::Alloc => f.allocs += 1,
                Action::FreeRequested => f.frees += 1,
                Action::Oom => f.ooms += 1,
                a if a.is_segment() && e.size > 0 => {
                    if a.grows() {
                        f.device_allocs += 1;
                    } else {
                        f.device_frees += 1;
                    }
                    f.segment_actions.push(SegmentAction {
                        call: sites.call_of[i],
                        action: a,
                        size: e.size,
                    });
                }
                _ => {}
            }
            if e.action != Action::Snapshot {
                streams.insert(e.stream);
            }
        }
        f.reserved = reserved;
        f.streams = streams.into_iter().collect();
        f.calls = sites.sites;
        f
    }

    /// The capacity to replay on: the recorded device's size if known, else what the first
    /// `oom` entry implies (reserved bytes then plus the device's free bytes), else
    /// [`DEFAULT_CAPACITY`] (or the recorded peak, if larger). An out-of-memory caused by a
    /// memory fraction cap records the device's free bytes, not the cap's: pass the fraction
    /// in the settings (`per_process_memory_fraction`) to reproduce it.
    pub fn infer_capacity(&self) -> CapacityChoice {
        if self.device_total > 0 {
            return CapacityChoice { bytes: self.device_total, source: CapacitySource::Recorded };
        }
        let reserved = self.reserved_series();
        let peak_reserved = reserved.iter().copied().fold(self.reserved_before, u64::max);
        if let Some((i, e)) = self
            .entries
            .iter()
            .enumerate()
            .find(|(_, e)| e.action == Action::Oom && e.device_free > 0)
        {
            let reserved = reserved[i];
            let bytes = reserved.saturating_add(e.device_free).max(peak_reserved);
            let source =
                CapacitySource::OutOfMemory { entry: i, reserved, device_free: e.device_free };
            return CapacityChoice { bytes, source };
        }
        if peak_reserved > DEFAULT_CAPACITY {
            let gib = 1u64 << 30;
            let bytes = peak_reserved.div_ceil(gib).saturating_mul(gib);
            return CapacityChoice { bytes, source: CapacitySource::RecordedPeak };
        }
        CapacityChoice { bytes: DEFAULT_CAPACITY, source: CapacitySource::Default }
    }

    /// Compares a replay (by [`Recording::replay_with`] under the recorded settings) with
    /// the recording: for each allocator call in order, the segment actions it made (sizes;
    /// their order within one call is not compared) and whether it failed; and the reserved
    /// bytes after every entry that is not itself a segment action. Segment actions of size
    /// 0 (address reservations) are left out.
    pub fn check(&self, report: &ReplayReport) -> Reproduction {
        let f = self.figures(report.capacity);
        let mut out = Reproduction {
            checked: report.recorded_segments,
            segment_actions: f.segment_actions.len(),
            calls: f.calls.len(),
            exact_start: self.starts_empty(),
            start_reserved: (self.reserved_before, report.reserved_at_start),
            divergence: None,
        };
        if !out.checked {
            return out;
        }
        let n = f.calls.len();
        let expected = grouped(&f.segment_actions, n);
        let got = grouped(&report.segment_actions, n);
        let failed: BTreeSet<usize> = report.failed_calls.iter().copied().collect();
        let mut first: Option<Divergence> = None;
        for c in 0..=n {
            let exp_failed = c < n && f.calls[c].kind == CallKind::Oom;
            let got_failed = failed.contains(&c);
            if expected[c] == got[c] && exp_failed == got_failed {
                continue;
            }
            let (entry, what) = match f.calls.get(c) {
                Some(site) => (site.entry, self.describe_call(site)),
                None => (self.entries.len().saturating_sub(1), "after the last call".into()),
            };
            first = Some(Divergence {
                entry,
                what,
                expected: describe_actions(&expected[c], exp_failed, &got[c]),
                got: describe_actions(&got[c], got_failed, &expected[c]),
            });
            break;
        }
        if report.timeline.len() == self.entries.len() {
            let start = (self.reserved_before as i128, report.reserved_at_start as i128);
            for (i, e) in self.entries.iter().enumerate() {
                if first.as_ref().is_some_and(|d| d.entry <= i) {
                    break;
                }
                if e.action.is_segment() {
                    continue;
                }
                let exp = f.reserved[i] as i128 - start.0;
                let got = report.timeline[i].reserved as i128 - start.1;
                if exp != got {
                    let shown = |delta: i128, base: i128| {
                        human_bytes((base + delta).clamp(0, u64::MAX as i128) as u64)
                    };
                    first = Some(Divergence {
                        entry: i,
                        what: format!("reserved bytes after {}", self.describe_entry(e)),
                        expected: shown(exp, start.0),
                        got: shown(got, start.0),
                    });
                    break;
                }
            }
        }
        out.divergence = first;
        out
    }

    fn describe_entry(&self, e: &Event) -> String {
        match e.action {
            Action::Oom => format!("oom of {} on stream {:#x}", human_bytes(e.size), e.stream),
            a => {
                format!("{a} of {} at {:#x} on stream {:#x}", human_bytes(e.size), e.addr, e.stream)
            }
        }
    }

    fn describe_call(&self, site: &CallSite) -> String {
        match site.kind {
            CallKind::EmptyCache => "empty_cache()".into(),
            _ => self.describe_entry(&self.entries[site.entry]),
        }
    }

    /// Replays the trace under the recorded settings (`baseline`) and under each of
    /// `settings`, on virtual memory of `capacity`, and checks the baseline against the
    /// recording (a shorthand for [`Recording::analyse`] with the recorded device replayed
    /// on, no suggestions and no search for the smallest device).
    pub fn what_if(
        &self,
        baseline: AllocatorConfig,
        settings: &[AllocatorConfig],
        capacity: CapacityChoice,
    ) -> Result<WhatIf, AllocError> {
        self.analyse(&Analysis {
            recorded: baseline,
            settings: settings.iter().cloned().map(Scenario::settings).collect(),
            recorded_capacity: capacity,
            capacity: None,
            suggest: false,
            fits: false,
        })
    }

    /// The replay's answer: the recorded settings replayed on the recorded device and
    /// checked against the recording; then the recorded settings and each scenario asked
    /// for replayed on the device of [`Analysis::capacity`] (a what-if: a smaller device
    /// is no divergence); with [`Analysis::suggest`], when the replay there runs out of
    /// memory, the changes [`Recording::suggestions`] gives; with [`Analysis::fits`], the
    /// smallest device each row runs on without an out-of-memory error.
    pub fn analyse(&self, a: &Analysis) -> Result<WhatIf, AllocError> {
        let recorded_cap = a.recorded_capacity.bytes;
        let capacity = a.capacity.unwrap_or(a.recorded_capacity);
        let check = self.replay_scenario(
            &Scenario::settings(a.recorded.clone()),
            recorded_cap,
            recorded_cap,
        )?;
        let reproduction = self.check(&check);
        let base_scenario = Scenario::settings(a.recorded.clone());
        let baseline = if capacity.bytes == recorded_cap {
            check.clone()
        } else {
            self.replay_scenario(&base_scenario, capacity.bytes, recorded_cap)?
        };
        let mut scenarios: Vec<(Scenario, Origin, Option<String>)> =
            vec![(base_scenario, Origin::Recorded, None)];
        scenarios.extend(a.settings.iter().cloned().map(|s| (s, Origin::Given, None)));
        if a.suggest && !baseline.ran_without_oom() {
            let taken: Vec<Scenario> = scenarios.iter().map(|(s, _, _)| s.clone()).collect();
            for (s, change) in self.suggestions(&a.recorded, &baseline, &taken) {
                scenarios.push((s, Origin::Suggested, Some(change)));
            }
        }
        let mut reports = vec![baseline];
        let mut rows = vec![Row {
            origin: Origin::Recorded,
            change: None,
            no_effect: None,
            inert: a.recorded.inert(),
            fit: None,
        }];
        for (i, (s, origin, change)) in scenarios.iter().enumerate().skip(1) {
            let same = scenarios[..i].iter().position(|(t, _, _)| {
                t.empty_cache_before == s.empty_cache_before
                    && t.config.effective() == s.config.effective()
            });
            let inert = s.config.inert();
            let report = match same {
                // The same figures as that row: not replayed again.
                Some(j) => ReplayReport {
                    config: s.config.to_string(),
                    empty_cache_before: s.empty_cache_before,
                    ..reports[j].clone()
                },
                None => self.replay_scenario(s, capacity.bytes, recorded_cap)?,
            };
            let no_effect = same.map(|j| {
                let why = if inert.is_empty() {
                    "the same settings".to_string()
                } else {
                    inert.join("; ")
                };
                format!("{why}; the same as {}", reports[j].label())
            });
            reports.push(report);
            rows.push(Row { origin: *origin, change: change.clone(), no_effect, inert, fit: None });
        }
        if a.fits {
            for (i, (s, _, _)) in scenarios.iter().enumerate() {
                let fit = match rows[i].no_effect {
                    Some(_) => None,
                    None => Some(self.smallest_capacity(s, recorded_cap, capacity.bytes)?),
                };
                rows[i].fit = fit;
            }
            // Rows with no effect share their twin's device.
            for i in 0..rows.len() {
                if rows[i].fit.is_none() {
                    let s = &scenarios[i].0;
                    rows[i].fit = scenarios[..i]
                        .iter()
                        .position(|(t, _, _)| {
                            t.empty_cache_before == s.empty_cache_before
                                && t.config.effective() == s.config.effective()
                        })
                        .and_then(|j| rows[j].fit);
                }
            }
        }
        let recorded = self.figures(recorded_cap);
        let mut reports = reports.into_iter();
        let baseline = reports.next().expect("the recorded settings' row");
        Ok(WhatIf {
            capacity,
            recorded_capacity: a.recorded_capacity,
            recorded,
            check: (capacity.bytes != recorded_cap).then_some(check),
            baseline,
            reproduction,
            variants: reports.collect(),
            rows,
        })
    }

    /// Changes worth trying when `baseline` (the recorded settings, replayed) runs out of
    /// memory, each on top of the recorded settings and none already in `taken`:
    /// expandable segments; `max_split_size_mb` of 64, 128, 256 and 512; a round-up twice as
    /// fine (when the recorded settings round); and an `empty_cache()` at the start of the
    /// climb to the first out-of-memory error (after the last entry before it where
    /// allocated bytes were as low as they would be until then).
    pub fn suggestions(
        &self,
        recorded: &AllocatorConfig,
        baseline: &ReplayReport,
        taken: &[Scenario],
    ) -> Vec<(Scenario, String)> {
        let mut out: Vec<(Scenario, String)> = Vec::new();
        let mut add = |s: Scenario, change: String| {
            let seen = |t: &Scenario| {
                t.empty_cache_before == s.empty_cache_before
                    && t.config.effective() == s.config.effective()
            };
            if !taken.iter().any(seen) && !out.iter().any(|(t, _)| seen(t)) {
                out.push((s, change));
            }
        };
        if !recorded.expandable_segments() {
            let c = recorded.clone().with_expandable_segments(true);
            add(Scenario::settings(c), "expandable_segments:True".into());
        }
        for mb in [64, 128, 256, 512] {
            if let Ok(c) = recorded.clone().with_max_split_size(Some(mb << 20)) {
                add(Scenario::settings(c), format!("max_split_size_mb:{mb}"));
            }
        }
        if let Some(c) = recorded.finer_roundup() {
            let change = format!("a finer round-up ({c})");
            add(Scenario::settings(c), change);
        }
        if let Some(at) = self.climb_start(baseline) {
            add(
                Scenario { config: recorded.clone(), empty_cache_before: Some(at) },
                format!("empty_cache() at entry {at}"),
            );
        }
        out
    }

    /// Where the step that runs out of memory starts: the last entry before the first
    /// failed allocation of `report` at which allocated bytes were at their low (the
    /// lowest of the half of the trace before the failure, within 1% of its highest), as
    /// between the steps of a training loop. Returns the entry after it (an
    /// `empty_cache()` there gives back what the step before left cached); `None` without
    /// a failure or a timeline.
    pub fn climb_start(&self, report: &ReplayReport) -> Option<usize> {
        let failed = *report.failed_entries.first()?;
        let t = report.timeline.get(..failed).filter(|t| !t.is_empty())?;
        let half = &t[t.len() / 2..];
        let low = half.iter().map(|s| s.allocated).min()?;
        let high = half.iter().map(|s| s.allocated).max()?;
        let at = t.iter().rposition(|s| s.allocated <= low.saturating_add(high / 100))?;
        Some(at + 1)
    }
}

/// What [`Recording::analyse`] replays.
#[derive(Clone, Debug)]
pub struct Analysis {
    /// The settings the trace was recorded with.
    pub recorded: AllocatorConfig,
    /// The scenarios asked for.
    pub settings: Vec<Scenario>,
    /// The device the trace was recorded on: where the recorded settings are checked.
    pub recorded_capacity: CapacityChoice,
    /// The device to replay on (`None`: the recorded one).
    pub capacity: Option<CapacityChoice>,
    /// Add [`Recording::suggestions`] when the recorded settings run out of memory there.
    pub suggest: bool,
    /// Search each row's smallest device ([`Recording::smallest_capacity`]).
    pub fits: bool,
}

/// Where a row of a [`WhatIf`] comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Origin {
    /// The recorded settings.
    Recorded,
    /// Asked for.
    Given,
    /// Added by the replay to answer an out-of-memory error.
    Suggested,
}

/// What a [`WhatIf`] says about one row beyond its replay.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// Where the row comes from.
    pub origin: Origin,
    /// For a suggested row, what it changes on top of the recorded settings.
    pub change: Option<String>,
    /// Why the row changes nothing (its settings do nothing, or repeat an earlier row's):
    /// its figures are that row's.
    pub no_effect: Option<String>,
    /// Settings of the row that have no effect in PyTorch ([`AllocatorConfig::inert`]).
    pub inert: Vec<String>,
    /// The smallest device that runs the row without an out-of-memory error, if searched.
    pub fit: Option<Fit>,
}

impl Row {
    /// The device it runs on without an out-of-memory error, in bytes (`None` beyond the
    /// search, or not searched).
    pub fn fits_in(&self) -> Option<u64> {
        match self.fit {
            Some(Fit::Bytes(b)) => Some(b),
            _ => None,
        }
    }
}

/// A recording replayed under its own settings and others.
#[derive(Clone, Debug, PartialEq)]
pub struct WhatIf {
    /// The device replayed on.
    pub capacity: CapacityChoice,
    /// The device the trace was recorded on, where the recorded settings were checked.
    pub recorded_capacity: CapacityChoice,
    /// The recording's own figures.
    pub recorded: RecordedFigures,
    /// The replay under the recorded settings on the recorded device, when the rows were
    /// replayed on another one (else it is [`WhatIf::baseline`]).
    pub check: Option<ReplayReport>,
    /// The replay under the recorded settings on [`WhatIf::capacity`].
    pub baseline: ReplayReport,
    /// Whether the recorded settings reproduce the recording on the recorded device.
    pub reproduction: Reproduction,
    /// The replays under the other settings, in the order asked, then the suggested ones.
    pub variants: Vec<ReplayReport>,
    /// One per report ([`WhatIf::reports`] order).
    pub rows: Vec<Row>,
}

fn ooms_cell(r: &ReplayReport) -> String {
    let mut s = if r.recorded_ooms > 0 {
        let mut s = format!("{} of {} recorded", r.ooms_reproduced, r.recorded_ooms);
        if r.ooms_avoided > 0 {
            s.push_str(&format!(" ({} avoided)", r.ooms_avoided));
        }
        s
    } else {
        String::new()
    };
    if r.new_ooms() > 0 || s.is_empty() {
        if !s.is_empty() {
            s.push_str(", ");
        }
        if r.new_ooms() > 0 {
            s.push_str(&format!("{} new", r.new_ooms()));
        } else {
            s.push_str("none");
        }
    }
    s
}

/// `+1.20 GiB` / `-300.00 MiB`.
pub fn signed_bytes(delta: i128) -> String {
    let sign = if delta < 0 { "-" } else { "+" };
    format!("{sign}{}", human_bytes(delta.unsigned_abs().min(u64::MAX as u128) as u64))
}

/// The legend printed under [`WhatIf::table`].
pub const TABLE_LEGEND: &str = "\
peak reserved   the most memory the cache held from the device (torch.cuda.max_memory_reserved)
saving          the recorded peak reserved less this row's (negative: more memory)
peak allocated  the most memory live tensors held (torch.cuda.max_memory_allocated)
frag. at peak   (reserved - allocated) / reserved, at the entry where reserved bytes peak: the
                share of the cache's memory no live tensor used then (free blocks PyTorch keeps
                for reuse; a high figure is fragmentation or cached memory, not an error)
OOMs            the recorded out-of-memory errors that still happen (or are avoided), and new ones
fits in         the smallest device on which the row runs the whole trace without an OOM (by
                bisection: it runs, 2 MiB less does not); `*` marks rows the replay added to
                answer an OOM";

impl WhatIf {
    /// The baseline, then the variants.
    pub fn reports(&self) -> impl Iterator<Item = &ReplayReport> {
        std::iter::once(&self.baseline).chain(&self.variants)
    }

    /// The rows' labels, as the table shows them.
    pub fn labels(&self) -> Vec<String> {
        self.reports()
            .zip(&self.rows)
            .map(|(r, row)| match row.origin {
                Origin::Recorded => format!("{} (recorded settings)", r.label()),
                Origin::Given => r.label(),
                Origin::Suggested => match &row.change {
                    Some(change) => format!("* recorded + {change}"),
                    None => format!("* {}", r.label()),
                },
            })
            .collect()
    }

    /// A table: one row for the recording's own figures, one per replay, with peak
    /// reserved, the saving against the recording, peak allocated, fragmentation at peak
    /// reserved, device allocations and frees, out-of-memory errors (recorded ones that
    /// still happen or are avoided, and new ones) and, when searched, the smallest device
    /// without one. A row whose settings change nothing says so instead of repeating
    /// figures. [`TABLE_LEGEND`] explains the columns.
    pub fn table(&self) -> String {
        let header = [
            "setting",
            "peak reserved",
            "saving",
            "peak allocated",
            "frag. at peak",
            "device allocs",
            "device frees",
            "fits in",
            "OOMs",
        ];
        const N: usize = 9;
        let mut rows: Vec<[String; N]> = vec![header.map(String::from)];
        let mut notes: Vec<(usize, String)> = Vec::new();
        let rec = &self.recorded;
        let fits = self.rows.iter().any(|r| r.fit.is_some());
        rows.push([
            "recorded trace".into(),
            human_bytes(rec.peak_reserved),
            "-".into(),
            "-".into(),
            "-".into(),
            rec.device_allocs.to_string(),
            rec.device_frees.to_string(),
            "-".into(),
            rec.ooms.to_string(),
        ]);
        for ((r, row), label) in self.reports().zip(&self.rows).zip(self.labels()) {
            if let Some(why) = &row.no_effect {
                notes.push((rows.len(), format!("no effect: {why}")));
                let mut cells: [String; N] = Default::default();
                cells[0] = label;
                rows.push(cells);
                continue;
            }
            let fit = match row.fit {
                Some(Fit::Bytes(b)) => human_bytes(b),
                Some(Fit::Beyond(b)) => format!("> {}", human_bytes(b)),
                None => "-".into(),
            };
            rows.push([
                label,
                human_bytes(r.peak_reserved),
                signed_bytes(rec.peak_reserved as i128 - r.peak_reserved as i128),
                human_bytes(r.peak_allocated),
                format!("{:.1}%", 100.0 * r.fragmentation_at_peak),
                r.device_allocs.to_string(),
                r.device_frees.to_string(),
                fit,
                ooms_cell(r),
            ]);
        }
        let shown: Vec<usize> = (0..N).filter(|&k| fits || k != 7).collect();
        let mut widths = [0usize; N];
        for (i, row) in rows.iter().enumerate() {
            if notes.iter().any(|(n, _)| *n == i) {
                widths[0] = widths[0].max(row[0].chars().count());
                continue;
            }
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let mut out = String::new();
        for (n, row) in rows.iter().enumerate() {
            let mut line = String::new();
            for &k in &shown {
                let (cell, w) = (&row[k], widths[k]);
                if k == 0 {
                    line.push_str(&format!("{cell:<w$}"));
                } else if k == N - 1 {
                    line.push_str(&format!("  {cell}"));
                } else {
                    line.push_str(&format!("  {cell:>w$}"));
                }
            }
            if let Some((_, note)) = notes.iter().find(|(i, _)| *i == n) {
                line = format!("{:<w$}  ({note})", row[0], w = widths[0]);
            }
            out.push_str(line.trim_end());
            out.push('\n');
            if n == 0 {
                let total: usize =
                    shown.iter().map(|&k| widths[k]).sum::<usize>() + 2 * (shown.len() - 1);
                out.push_str(&"-".repeat(total));
                out.push('\n');
            }
        }
        out
    }

    /// Whether the recording, replayed on [`WhatIf::capacity`] under the recorded settings,
    /// runs out of memory (recorded errors or new ones).
    pub fn has_oom(&self) -> bool {
        !self.baseline.ran_without_oom()
    }

    /// For a replay that runs out of memory: which rows run without one on
    /// [`WhatIf::capacity`], and each row's margin there (the capacity less the smallest
    /// device it runs on: negative, the bytes missing), best first; `None` when nothing runs
    /// out of memory.
    pub fn oom_answer(&self) -> Option<Vec<OomVerdict>> {
        if !self.has_oom() {
            return None;
        }
        let mut out: Vec<OomVerdict> = self
            .reports()
            .zip(&self.rows)
            .zip(self.labels())
            .filter(|((_, row), _)| row.no_effect.is_none())
            .map(|((r, row), label)| OomVerdict {
                label,
                avoided: r.ran_without_oom(),
                failures: r.failed_entries.len(),
                margin: row.fits_in().map(|b| self.capacity.bytes as i128 - b as i128),
                fits_in: row.fit,
            })
            .collect();
        out.sort_by_key(|v| (!v.avoided, std::cmp::Reverse(v.margin.unwrap_or(i128::MIN))));
        Some(out)
    }
}

/// One row's answer to "would it have avoided the out-of-memory error?".
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OomVerdict {
    /// The row, as the table labels it.
    pub label: String,
    /// Whether it runs the whole trace without an out-of-memory error on the device.
    pub avoided: bool,
    /// How many allocations fail.
    pub failures: usize,
    /// Capacity less the smallest device that runs it (bytes; negative: missing).
    pub margin: Option<i128>,
    /// The smallest device that runs it.
    pub fits_in: Option<Fit>,
}
