//! Statistics with PyTorch's key names and semantics.

use crate::policy::PoolKind;
use serde::Serialize;
use std::collections::BTreeMap;

/// One statistic: its current value, its peak since the last [`MemoryStats::reset_peak`], and
/// the totals added and removed since the last [`MemoryStats::reset_accumulated`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Stat {
    /// Current value.
    pub current: i64,
    /// Highest value seen.
    pub peak: i64,
    /// Total increase.
    pub allocated: u64,
    /// Total decrease.
    pub freed: u64,
}

/// A statistic for all pools and for each pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StatArray {
    /// Both pools.
    pub all: Stat,
    /// The small pool (requests up to 1 MiB).
    pub small_pool: Stat,
    /// The large pool.
    pub large_pool: Stat,
}

impl StatArray {
    fn each(&mut self, f: impl Fn(&mut Stat)) {
        f(&mut self.all);
        f(&mut self.small_pool);
        f(&mut self.large_pool);
    }

    fn zip(&mut self, other: &StatArray, f: impl Fn(&mut Stat, &Stat)) {
        f(&mut self.all, &other.all);
        f(&mut self.small_pool, &other.small_pool);
        f(&mut self.large_pool, &other.large_pool);
    }
}

/// The allocator's statistics, as `torch.cuda.memory_stats()` reports them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MemoryStats {
    /// Live allocations (count).
    pub allocation: StatArray,
    /// Segments obtained from the device (count).
    pub segment: StatArray,
    /// Allocated blocks plus freed blocks still waiting for other streams (count).
    pub active: StatArray,
    /// Free blocks that are part of a split segment (count).
    pub inactive_split: StatArray,
    /// Bytes in allocated blocks (rounded sizes).
    pub allocated_bytes: StatArray,
    /// Bytes in segments.
    pub reserved_bytes: StatArray,
    /// Bytes in active blocks.
    pub active_bytes: StatArray,
    /// Bytes in inactive split blocks.
    pub inactive_split_bytes: StatArray,
    /// Bytes requested by callers (before rounding).
    pub requested_bytes: StatArray,
    /// Allocations that had to release the whole cache and retry.
    pub num_alloc_retries: u64,
    /// Allocations that failed with out-of-memory.
    pub num_ooms: u64,
    /// Times every pending event was synchronised.
    pub num_sync_all_streams: u64,
    /// Calls to the device's allocate (or map).
    pub num_device_alloc: u64,
    /// Calls to the device's free (or unmap).
    pub num_device_free: u64,
    /// Live allocations of at least `max_split_size`.
    pub oversize_allocations: Stat,
    /// Segments of at least `max_split_size`.
    pub oversize_segments: Stat,
    /// The `max_split_size` setting in bytes (-1 when unlimited, as PyTorch reports it).
    pub max_split_size: i64,
}

impl MemoryStats {
    fn arrays(&self) -> [(&'static str, &StatArray); 9] {
        [
            ("allocation", &self.allocation),
            ("segment", &self.segment),
            ("active", &self.active),
            ("inactive_split", &self.inactive_split),
            ("allocated_bytes", &self.allocated_bytes),
            ("reserved_bytes", &self.reserved_bytes),
            ("active_bytes", &self.active_bytes),
            ("inactive_split_bytes", &self.inactive_split_bytes),
            ("requested_bytes", &self.requested_bytes),
        ]
    }

    fn arrays_mut(&mut self) -> [&mut StatArray; 9] {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ]
    }

    /// Every statistic by its PyTorch key, e.g. `allocated_bytes.all.peak` or `num_ooms`.
    pub fn to_map(&self) -> BTreeMap<String, i64> {
        let mut map = BTreeMap::new();
        let mut put = |prefix: &str, s: &Stat| {
            map.insert(format!("{prefix}.current"), s.current);
            map.insert(format!("{prefix}.peak"), s.peak);
            map.insert(format!("{prefix}.allocated"), s.allocated as i64);
            map.insert(format!("{prefix}.freed"), s.freed as i64);
        };
        for (name, a) in self.arrays() {
            put(&format!("{name}.all"), &a.all);
            put(&format!("{name}.small_pool"), &a.small_pool);
            put(&format!("{name}.large_pool"), &a.large_pool);
        }
        put("oversize_allocations", &self.oversize_allocations);
        put("oversize_segments", &self.oversize_segments);
        map.insert("num_alloc_retries".into(), self.num_alloc_retries as i64);
        map.insert("num_ooms".into(), self.num_ooms as i64);
        map.insert("num_sync_all_streams".into(), self.num_sync_all_streams as i64);
        map.insert("num_device_alloc".into(), self.num_device_alloc as i64);
        map.insert("num_device_free".into(), self.num_device_free as i64);
        map.insert("max_split_size".into(), self.max_split_size);
        map
    }

    /// One statistic by its PyTorch key.
    pub fn get(&self, key: &str) -> Option<i64> {
        self.to_map().get(key).copied()
    }

    /// Sets every peak to its current value (`torch.cuda.reset_peak_memory_stats`).
    pub fn reset_peak(&mut self) {
        for a in self.arrays_mut() {
            a.each(|s| s.peak = s.current);
        }
        self.oversize_allocations.peak = self.oversize_allocations.current;
        self.oversize_segments.peak = self.oversize_segments.current;
    }

    /// Pairs every [`Stat`] of `self` with the same one of `other`.
    fn zip_stats(&mut self, other: &MemoryStats, f: impl Fn(&mut Stat, &Stat) + Copy) {
        let theirs = other.arrays().map(|(_, a)| a);
        for (mine, theirs) in self.arrays_mut().into_iter().zip(theirs) {
            mine.zip(theirs, f);
        }
        f(&mut self.oversize_allocations, &other.oversize_allocations);
        f(&mut self.oversize_segments, &other.oversize_segments);
    }

    /// The statistics of a scope that began when the enclosing statistics were `outer`:
    /// current values as now, peaks since the scope began (`self`'s peaks, which were reset
    /// when it began), totals and counters added since it began.
    pub(crate) fn since(&self, outer: &MemoryStats) -> MemoryStats {
        let mut s = self.clone();
        s.zip_stats(outer, |mine, before| {
            mine.allocated = mine.allocated.saturating_sub(before.allocated);
            mine.freed = mine.freed.saturating_sub(before.freed);
        });
        s.num_alloc_retries = s.num_alloc_retries.saturating_sub(outer.num_alloc_retries);
        s.num_ooms = s.num_ooms.saturating_sub(outer.num_ooms);
        s.num_sync_all_streams = s.num_sync_all_streams.saturating_sub(outer.num_sync_all_streams);
        s.num_device_alloc = s.num_device_alloc.saturating_sub(outer.num_device_alloc);
        s.num_device_free = s.num_device_free.saturating_sub(outer.num_device_free);
        s
    }

    /// Zeroes the `allocated`/`freed` totals and the event counters
    /// (`torch.cuda.reset_accumulated_memory_stats`).
    pub fn reset_accumulated(&mut self) {
        for a in self.arrays_mut() {
            a.each(|s| {
                s.allocated = 0;
                s.freed = 0;
            });
        }
        for s in [&mut self.oversize_allocations, &mut self.oversize_segments] {
            s.allocated = 0;
            s.freed = 0;
        }
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_sync_all_streams = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
    }
}

/// One statistic as the cache keeps it between reads: the hot path only adds to `current`
/// and `added` and checks the peak, or takes from `current`; [`Tally::stat`] makes the
/// [`Stat`] PyTorch reports. What was removed since the last reset of totals is
/// `added - (current - base)`, so a decrease is one subtraction; `added` is exact (a `u128`
/// cannot overflow), and the reported totals saturate at `u64::MAX` as before.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Tally {
    current: i64,
    peak: i64,
    /// Everything added since the last [`Tally::reset_accumulated`].
    added: u128,
    /// `current` at the last [`Tally::reset_accumulated`].
    base: i64,
}

impl Tally {
    /// Adds `n`. `current` never passes `i64::MAX`: requests are under 1 EiB and the cache
    /// keeps reserved memory (which bounds every current value) under `MAX_RESERVED` (in
    /// `state.rs`).
    #[inline(always)]
    pub(crate) fn increase(&mut self, n: u64) {
        self.current += n as i64;
        self.added += n as u128;
        if self.current > self.peak {
            self.peak = self.current;
        }
    }

    /// Removes `n` (never more than `current`).
    #[inline(always)]
    pub(crate) fn decrease(&mut self, n: u64) {
        self.current -= n as i64;
    }

    /// The total removed since the last reset of totals, exact.
    fn removed(&self) -> u128 {
        (self.added as i128 + self.base as i128 - self.current as i128) as u128
    }

    /// The statistic as reported: totals saturate instead of wrapping.
    fn stat(&self) -> Stat {
        Stat {
            current: self.current,
            peak: self.peak,
            allocated: saturate(self.added),
            freed: saturate(self.removed()),
        }
    }

    fn reset_peak(&mut self) {
        self.peak = self.current;
    }

    fn reset_accumulated(&mut self) {
        self.added = 0;
        self.base = self.current;
    }
}

fn saturate(n: u128) -> u64 {
    n.try_into().unwrap_or(u64::MAX)
}

/// A statistic for each pool as the cache keeps it: the two pools' [`Tally`]s and the peak
/// of their sum; the `all` statistic is made from them when read (its totals are the pools'
/// totals added up, exactly as if kept apart, since every change goes to both).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct TallyArray {
    /// Small, large (by [`PoolKind`] as an index).
    pools: [Tally; 2],
    /// The peak of both pools together.
    all_peak: i64,
}

impl TallyArray {
    #[inline(always)]
    pub(crate) fn increase(&mut self, pool: impl Into<PoolKind>, n: u64) {
        self.pools[pool.into() as usize].increase(n);
        let all = self.current();
        if all > self.all_peak {
            self.all_peak = all;
        }
    }

    #[inline(always)]
    pub(crate) fn decrease(&mut self, pool: impl Into<PoolKind>, n: u64) {
        self.pools[pool.into() as usize].decrease(n);
    }

    /// One net change, up or down (PyTorch's `free_block` applies the inactive-split change
    /// this way); none when `delta` is 0.
    #[inline(always)]
    pub(crate) fn apply(&mut self, pool: impl Into<PoolKind>, delta: i64) {
        let pool = pool.into();
        if delta > 0 {
            self.increase(pool, delta.unsigned_abs());
        } else if delta < 0 {
            self.decrease(pool, delta.unsigned_abs());
        }
    }

    /// Both pools' current value (`all.current`).
    #[inline]
    pub(crate) fn current(&self) -> i64 {
        self.pools[0].current + self.pools[1].current
    }

    /// The peak of both pools together (`all.peak`).
    pub(crate) fn peak(&self) -> i64 {
        self.all_peak
    }

    fn stats(&self) -> StatArray {
        let [small, large] = &self.pools;
        StatArray {
            all: Stat {
                current: self.current(),
                peak: self.all_peak,
                allocated: saturate(small.added + large.added),
                freed: saturate(small.removed() + large.removed()),
            },
            small_pool: small.stat(),
            large_pool: large.stat(),
        }
    }

    fn reset_peak(&mut self) {
        self.pools.iter_mut().for_each(Tally::reset_peak);
        self.all_peak = self.current();
    }

    fn reset_accumulated(&mut self) {
        self.pools.iter_mut().for_each(Tally::reset_accumulated);
    }

    fn restore_peaks(&mut self, outer: &StatArray) {
        let [small, large] = &mut self.pools;
        small.peak = small.peak.max(outer.small_pool.peak);
        large.peak = large.peak.max(outer.large_pool.peak);
        self.all_peak = self.all_peak.max(outer.all.peak);
    }
}

/// The statistics as the cache keeps them (see [`Tally`]); [`Counters::stats`] reports them
/// as [`MemoryStats`].
#[derive(Clone, Debug, Default)]
pub(crate) struct Counters {
    pub allocation: TallyArray,
    pub segment: TallyArray,
    pub active: TallyArray,
    pub inactive_split: TallyArray,
    pub allocated_bytes: TallyArray,
    pub reserved_bytes: TallyArray,
    pub active_bytes: TallyArray,
    pub inactive_split_bytes: TallyArray,
    pub requested_bytes: TallyArray,
    pub num_alloc_retries: u64,
    pub num_ooms: u64,
    pub num_sync_all_streams: u64,
    pub num_device_alloc: u64,
    pub num_device_free: u64,
    pub oversize_allocations: Tally,
    pub oversize_segments: Tally,
    pub max_split_size: i64,
}

impl Counters {
    fn arrays_mut(&mut self) -> [&mut TallyArray; 9] {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ]
    }

    /// Every statistic, as `torch.cuda.memory_stats()` reports them.
    pub(crate) fn stats(&self) -> MemoryStats {
        MemoryStats {
            allocation: self.allocation.stats(),
            segment: self.segment.stats(),
            active: self.active.stats(),
            inactive_split: self.inactive_split.stats(),
            allocated_bytes: self.allocated_bytes.stats(),
            reserved_bytes: self.reserved_bytes.stats(),
            active_bytes: self.active_bytes.stats(),
            inactive_split_bytes: self.inactive_split_bytes.stats(),
            requested_bytes: self.requested_bytes.stats(),
            num_alloc_retries: self.num_alloc_retries,
            num_ooms: self.num_ooms,
            num_sync_all_streams: self.num_sync_all_streams,
            num_device_alloc: self.num_device_alloc,
            num_device_free: self.num_device_free,
            oversize_allocations: self.oversize_allocations.stat(),
            oversize_segments: self.oversize_segments.stat(),
            max_split_size: self.max_split_size,
        }
    }

    /// Sets every peak to its current value (`torch.cuda.reset_peak_memory_stats`).
    pub(crate) fn reset_peak(&mut self) {
        for a in self.arrays_mut() {
            a.reset_peak();
        }
        self.oversize_allocations.reset_peak();
        self.oversize_segments.reset_peak();
    }

    /// Zeroes the totals and the event counters
    /// (`torch.cuda.reset_accumulated_memory_stats`).
    pub(crate) fn reset_accumulated(&mut self) {
        for a in self.arrays_mut() {
            a.reset_accumulated();
        }
        self.oversize_allocations.reset_accumulated();
        self.oversize_segments.reset_accumulated();
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_sync_all_streams = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
    }

    /// Ends a scope: every peak becomes the larger of the enclosing scope's peak before the
    /// scope (`outer`) and the peak reached inside it, as if the scope had never reset it.
    pub(crate) fn restore_peaks(&mut self, outer: &MemoryStats) {
        let theirs = outer.arrays().map(|(_, a)| a);
        for (mine, theirs) in self.arrays_mut().into_iter().zip(theirs) {
            mine.restore_peaks(theirs);
        }
        let o = &mut self.oversize_allocations;
        o.peak = o.peak.max(outer.oversize_allocations.peak);
        let o = &mut self.oversize_segments;
        o.peak = o.peak.max(outer.oversize_segments.peak);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_use_pytorch_names() {
        let mut c = Counters::default();
        c.allocated_bytes.increase(PoolKind::Small, 512);
        c.allocated_bytes.decrease(PoolKind::Small, 512);
        c.allocated_bytes.increase(PoolKind::Large, 2048);
        let m = c.stats().to_map();
        assert_eq!(m["allocated_bytes.all.current"], 2048);
        assert_eq!(m["allocated_bytes.all.peak"], 2048);
        assert_eq!(m["allocated_bytes.all.allocated"], 2560);
        assert_eq!(m["allocated_bytes.all.freed"], 512);
        assert_eq!(m["allocated_bytes.small_pool.peak"], 512);
        assert_eq!(m["allocated_bytes.large_pool.current"], 2048);
        for key in [
            "num_alloc_retries",
            "num_ooms",
            "num_device_alloc",
            "num_device_free",
            "reserved_bytes.all.current",
            "inactive_split_bytes.all.peak",
            "requested_bytes.all.current",
            "segment.large_pool.current",
            "oversize_allocations.current",
            "max_split_size",
        ] {
            assert!(m.contains_key(key), "missing {key}");
        }
    }

    #[test]
    fn reset_peak_and_accumulated() {
        let mut c = Counters::default();
        c.reserved_bytes.increase(PoolKind::Large, 100);
        c.reserved_bytes.decrease(PoolKind::Large, 60);
        c.num_ooms = 3;
        c.reset_peak();
        assert_eq!(c.stats().reserved_bytes.all.peak, 40);
        c.reset_accumulated();
        let s = c.stats();
        assert_eq!(
            (s.reserved_bytes.all.allocated, s.reserved_bytes.all.freed, s.num_ooms),
            (0, 0, 0)
        );
        assert_eq!(s.reserved_bytes.all.current, 40);
        // What is removed after a reset counts from the value at the reset.
        c.reserved_bytes.decrease(PoolKind::Large, 30);
        c.reserved_bytes.increase(PoolKind::Small, 5);
        let s = c.stats().reserved_bytes;
        assert_eq!((s.all.current, s.all.allocated, s.all.freed), (15, 5, 30));
        assert_eq!((s.large_pool.freed, s.small_pool.allocated, s.all.peak), (30, 5, 40));

        let mut s = c.stats();
        s.reset_peak();
        assert_eq!(s.reserved_bytes.all.peak, 15);
        s.reset_accumulated();
        assert_eq!((s.reserved_bytes.all.allocated, s.reserved_bytes.all.freed), (0, 0));
    }

    #[test]
    fn totals_saturate_instead_of_wrapping() {
        let mut c = Counters::default();
        let big = 1u64 << 62;
        for _ in 0..5 {
            c.allocated_bytes.increase(PoolKind::Large, big);
            c.allocated_bytes.decrease(PoolKind::Large, big);
        }
        c.allocated_bytes.increase(PoolKind::Small, 7);
        let s = c.stats().allocated_bytes;
        assert_eq!((s.all.allocated, s.all.freed, s.all.current), (u64::MAX, u64::MAX, 7));
        assert_eq!((s.large_pool.allocated, s.large_pool.freed), (u64::MAX, u64::MAX));
        assert_eq!((s.small_pool.allocated, s.small_pool.freed), (7, 0));
    }
}
