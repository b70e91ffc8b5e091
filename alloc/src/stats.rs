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

impl Stat {
    /// Adds `n`. `current` never passes `i64::MAX`: requests are under 1 EiB and the cache
    /// keeps reserved memory (which bounds every current value) under
    /// `MAX_RESERVED` (in `state.rs`); the totals saturate instead of wrapping.
    #[inline]
    pub(crate) fn increase(&mut self, n: u64) {
        self.current += n as i64;
        self.allocated = self.allocated.saturating_add(n);
        if self.current > self.peak {
            self.peak = self.current;
        }
    }

    /// Removes `n` (never more than `current`); the total saturates instead of wrapping.
    #[inline]
    pub(crate) fn decrease(&mut self, n: u64) {
        self.current -= n as i64;
        self.freed = self.freed.saturating_add(n);
    }
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
    #[inline]
    pub(crate) fn increase(&mut self, pool: impl Into<PoolKind>, n: u64) {
        self.all.increase(n);
        self.pool_mut(pool.into()).increase(n);
    }

    #[inline]
    pub(crate) fn decrease(&mut self, pool: impl Into<PoolKind>, n: u64) {
        self.all.decrease(n);
        self.pool_mut(pool.into()).decrease(n);
    }

    /// One net change, up or down (PyTorch's `free_block` applies the inactive-split change
    /// this way); none when `delta` is 0.
    #[inline]
    pub(crate) fn apply(&mut self, pool: impl Into<PoolKind>, delta: i64) {
        let pool = pool.into();
        if delta > 0 {
            self.increase(pool, delta.unsigned_abs());
        } else if delta < 0 {
            self.decrease(pool, delta.unsigned_abs());
        }
    }

    #[inline]
    fn pool_mut(&mut self, pool: PoolKind) -> &mut Stat {
        match pool {
            PoolKind::Small => &mut self.small_pool,
            PoolKind::Large => &mut self.large_pool,
        }
    }

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

    /// Ends a scope: every peak becomes the larger of the enclosing scope's peak before the
    /// scope (`outer`) and the peak reached inside it, as if the scope had never reset it.
    pub(crate) fn restore_peaks(&mut self, outer: &MemoryStats) {
        self.zip_stats(outer, |mine, before| mine.peak = mine.peak.max(before.peak));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_use_pytorch_names() {
        let mut s = MemoryStats::default();
        s.allocated_bytes.increase(PoolKind::Small, 512);
        s.allocated_bytes.decrease(PoolKind::Small, 512);
        s.allocated_bytes.increase(PoolKind::Large, 2048);
        let m = s.to_map();
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
        let mut s = MemoryStats::default();
        s.reserved_bytes.increase(PoolKind::Large, 100);
        s.reserved_bytes.decrease(PoolKind::Large, 60);
        s.num_ooms = 3;
        s.reset_peak();
        assert_eq!(s.reserved_bytes.all.peak, 40);
        s.reset_accumulated();
        assert_eq!(
            (s.reserved_bytes.all.allocated, s.reserved_bytes.all.freed, s.num_ooms),
            (0, 0, 0)
        );
        assert_eq!(s.reserved_bytes.all.current, 40);
    }
}
