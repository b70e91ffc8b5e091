//! The caching policy: PyTorch's rules, written once for every backend.
//!
//! All methods run under the allocator's lock and take the raw memory as an argument.

use crate::block::{Arena, Block, BlockId, BlockState, Pool, Segment};
use crate::config::AllocatorConfig;
use crate::error::{AllocError, OutOfMemoryError};
use crate::index::FreeKey;
use crate::memory::{DeviceMemory, DevicePtr, RawError, Stream};
use crate::policy::{self, LARGE_BUFFER, PoolKind};
use crate::stats::MemoryStats;
use crate::trace::{Trace, TraceAction};
use std::collections::{BTreeMap, HashMap, VecDeque};

pub(crate) struct State<M: DeviceMemory> {
    pub config: AllocatorConfig,
    /// `config.rounds_to_power2_divisions()`, computed once.
    power2_rounding: bool,
    /// `config.max_split_size()`, computed once.
    max_split: usize,
    /// Reserved memory may not exceed this (from the memory fraction).
    pub cap: Option<u64>,
    pub arena: Arena,
    pub small: Pool,
    pub large: Pool,
    /// Segments by base address.
    pub segments: BTreeMap<DevicePtr, Segment>,
    pub stats: MemoryStats,
    /// Other streams that used allocated blocks (from `record_stream`), kept apart from the
    /// blocks because it is rare: the hot path only checks that this is empty.
    stream_uses: HashMap<BlockId, Vec<Stream>>,
    /// Events that pending frees wait for, oldest first.
    pending: VecDeque<(M::Event, BlockId)>,
    pub trace: Trace,
    clock: u64,
    /// Statistics of the enclosing scopes, outermost first (see [`crate::StatsScope`]).
    pub scopes: Vec<MemoryStats>,
}

impl<M: DeviceMemory> State<M> {
    pub fn new(config: AllocatorConfig, total: u64) -> Self {
        let stats = MemoryStats {
            max_split_size: config.max_split_size().try_into().unwrap_or(-1),
            ..MemoryStats::default()
        };
        let cap = config.memory_fraction().map(|f| cap_bytes(f, total));
        State {
            power2_rounding: config.rounds_to_power2_divisions(),
            max_split: config.max_split_size(),
            config,
            cap,
            arena: Arena::default(),
            small: Pool::default(),
            large: Pool::default(),
            segments: BTreeMap::new(),
            stats,
            stream_uses: HashMap::new(),
            pending: VecDeque::new(),
            trace: Trace::default(),
            clock: 0,
            scopes: Vec::new(),
        }
    }

    #[inline]
    pub fn pool(&self, kind: PoolKind) -> &Pool {
        match kind {
            PoolKind::Small => &self.small,
            PoolKind::Large => &self.large,
        }
    }

    #[inline]
    pub fn pool_mut(&mut self, kind: PoolKind) -> &mut Pool {
        match kind {
            PoolKind::Small => &mut self.small,
            PoolKind::Large => &mut self.large,
        }
    }

    // ---- allocation -------------------------------------------------------------------

    pub fn malloc(
        &mut self,
        mem: &M,
        requested: usize,
        stream: Stream,
    ) -> Result<BlockId, AllocError> {
        if !self.pending.is_empty() {
            self.process_events(mem);
        }
        let Some(size) = policy::round_size_with(requested, &self.config, self.power2_rounding)
        else {
            return Err(self.out_of_memory(mem, requested, stream));
        };
        let pool = PoolKind::for_size(size);
        let id = match self.find_free_block(pool, stream, size) {
            Some((key, id, pos)) => {
                self.hand_out(id, size, requested, Some((key, pos)));
                id
            }
            None => {
                let id = self.allocate_new(mem, pool, stream, size, requested)?;
                self.hand_out(id, size, requested, None);
                id
            }
        };
        Ok(id)
    }

    /// Best fit within the stream, with PyTorch's rules for oversize blocks. The block stays
    /// in its pool; [`Self::hand_out`] takes it out.
    #[inline]
    fn find_free_block(
        &self,
        pool: PoolKind,
        stream: Stream,
        size: usize,
    ) -> Option<(FreeKey, BlockId, usize)> {
        let max_split = self.max_split;
        let (key, id, pos) = self.pool(pool).free.first_at_or_after(&(stream, size, 0))?;
        let (block_stream, block_size, _) = key;
        if block_stream != stream {
            return None;
        }
        // An oversize block (never split) serves only oversize requests within 20 MiB of it.
        if size < max_split && block_size >= max_split {
            return None;
        }
        if size >= max_split && block_size >= size.saturating_add(LARGE_BUFFER) {
            return None;
        }
        Some((key, id, pos))
    }

    /// Gets memory from the device, releasing cached blocks and retrying when it fails.
    fn allocate_new(
        &mut self,
        mem: &M,
        pool: PoolKind,
        stream: Stream,
        size: usize,
        requested: usize,
    ) -> Result<BlockId, AllocError> {
        if self.cap.is_some() && self.config.garbage_collection_threshold().is_some() {
            self.garbage_collect(mem);
        }
        let Some(segment_size) = policy::segment_size(size) else {
            return Err(self.out_of_memory(mem, requested, stream));
        };
        if let Some(id) = self.grow(mem, pool, stream, size, segment_size)? {
            return Ok(id);
        }
        if self.release_available_cached_blocks(mem, pool, segment_size)
            && let Some(id) = self.grow(mem, pool, stream, size, segment_size)?
        {
            return Ok(id);
        }
        self.stats.num_alloc_retries += 1;
        self.release_cached_blocks(mem);
        if let Some(id) = self.grow(mem, pool, stream, size, segment_size)? {
            return Ok(id);
        }
        Err(self.out_of_memory(mem, requested, stream))
    }

    /// A new free block of at least `size` (not in any pool), or `None` when the device or the
    /// cap has no room.
    fn grow(
        &mut self,
        mem: &M,
        pool: PoolKind,
        stream: Stream,
        size: usize,
        segment_size: usize,
    ) -> Result<Option<BlockId>, AllocError> {
        if self.config.expandable_segments() {
            self.grow_expandable(mem, pool, stream, size)
        } else {
            self.allocate_segment(mem, pool, stream, segment_size)
        }
    }

    pub fn fits_cap(&self, extra: usize) -> bool {
        self.cap.is_none_or(|cap| {
            (self.stats.reserved_bytes.all.current as u64).saturating_add(extra as u64) <= cap
        })
    }

    fn allocate_segment(
        &mut self,
        mem: &M,
        pool: PoolKind,
        stream: Stream,
        size: usize,
    ) -> Result<Option<BlockId>, AllocError> {
        if !self.fits_cap(size) {
            return Ok(None);
        }
        let ptr = match mem.allocate(size) {
            Ok(ptr) => ptr,
            Err(RawError::OutOfMemory { .. }) => return Ok(None),
            Err(e) => return Err(AllocError::Device(e.to_string())),
        };
        self.stats.num_device_alloc += 1;
        self.stats.segment.increase(pool, 1);
        self.stats.reserved_bytes.increase(pool, size as u64);
        if size >= self.max_split {
            self.stats.oversize_segments.increase(1);
        }
        let id = self.arena.insert(Block {
            ptr,
            size,
            requested: 0,
            stream,
            pool,
            prev: None,
            next: None,
            state: BlockState::Free,
            segment: ptr,
            expandable: false,
            pending_events: 0,
            freed_at: 0,
        });
        self.segments
            .insert(ptr, Segment { size, mapped: size, stream, pool, expandable: false, head: id });
        self.trace.record(TraceAction::SegmentAlloc, ptr, size, stream);
        Ok(Some(id))
    }

    /// Marks a free block allocated, splitting off the remainder. `in_pool` is the block's key
    /// and index position if it is in its pool: the remainder then takes its place.
    #[inline]
    fn hand_out(
        &mut self,
        id: BlockId,
        size: usize,
        requested: usize,
        in_pool: Option<(FreeKey, usize)>,
    ) {
        let max_split = self.max_split;
        self.unaccount_split(id);
        let b = &self.arena[id];
        let pool = b.pool;
        if policy::should_split(pool, b.size, size, max_split) {
            let rest = Block {
                ptr: b.ptr + size as u64,
                size: b.size - size,
                requested: 0,
                stream: b.stream,
                pool,
                prev: Some(id),
                next: b.next,
                state: BlockState::Free,
                segment: b.segment,
                expandable: b.expandable,
                pending_events: 0,
                freed_at: b.freed_at,
            };
            let key = (rest.stream, rest.size, rest.ptr);
            let next = rest.next;
            let rid = self.arena.insert(rest);
            if let Some(n) = next {
                self.arena[n].prev = Some(rid);
            }
            let b = &mut self.arena[id];
            b.next = Some(rid);
            b.size = size;
            match in_pool {
                Some((_, pos)) => self.pool_mut(pool).free.replace_at(pos, key, rid),
                None => self.pool_mut(pool).free.insert(key, rid),
            }
            self.account_split(rid);
        } else if let Some((_, pos)) = in_pool {
            self.pool_mut(pool).free.remove_at(pos);
        }
        let b = &mut self.arena[id];
        b.state = BlockState::Allocated;
        b.requested = requested;
        let (bsize, ptr, stream) = (b.size as u64, b.ptr, b.stream);
        let s = &mut self.stats;
        s.allocation.increase(pool, 1);
        s.allocated_bytes.increase(pool, bsize);
        s.requested_bytes.increase(pool, requested as u64);
        s.active.increase(pool, 1);
        s.active_bytes.increase(pool, bsize);
        if bsize as usize >= max_split {
            s.oversize_allocations.increase(1);
        }
        self.trace.record_block(TraceAction::Alloc, ptr, bsize as usize, requested, stream);
    }

    // ---- freeing ----------------------------------------------------------------------

    pub fn free(&mut self, mem: &M, id: BlockId) {
        let max_split = self.max_split;
        let b = &mut self.arena[id];
        debug_assert_eq!(b.state, BlockState::Allocated);
        let (pool, size, requested, ptr, stream) =
            (b.pool, b.size as u64, b.requested, b.ptr, b.stream);
        let uses = if self.stream_uses.is_empty() {
            Vec::new()
        } else {
            self.stream_uses.remove(&id).unwrap_or_default()
        };
        let s = &mut self.stats;
        s.allocation.decrease(pool, 1);
        s.allocated_bytes.decrease(pool, size);
        s.requested_bytes.decrease(pool, requested as u64);
        if size as usize >= max_split {
            s.oversize_allocations.decrease(1);
        }
        self.trace.record_block(TraceAction::FreeRequested, ptr, size as usize, requested, stream);
        if !uses.is_empty() {
            let mut events = 0;
            for other in uses {
                match mem.record_event(other) {
                    Ok(e) => {
                        self.pending.push_back((e, id));
                        events += 1;
                    }
                    // Without an event the block cannot be tracked: wait for the work now.
                    Err(_) => mem.synchronize_all(),
                }
            }
            if events > 0 {
                let b = &mut self.arena[id];
                b.pending_events = events;
                b.state = BlockState::PendingFree;
                return;
            }
        }
        self.free_block(id);
    }

    /// Returns a block to its pool, coalescing it with free neighbours.
    fn free_block(&mut self, id: BlockId) {
        self.clock += 1;
        let b = &mut self.arena[id];
        let (pool, size, prev, next) = (b.pool, b.size as u64, b.prev, b.next);
        b.state = BlockState::Free;
        b.freed_at = self.clock;
        // As PyTorch's `free_block`: the block's own address and size, before any merge.
        let (ptr, requested, stream) = (b.ptr, b.requested, b.stream);
        self.trace.record_block(TraceAction::FreeCompleted, ptr, size as usize, requested, stream);
        self.stats.active.decrease(pool, 1);
        self.stats.active_bytes.decrease(pool, size);

        let free = |a: &Arena, n: Option<BlockId>| n.filter(|&n| a[n].state == BlockState::Free);
        let (prev, next) = (free(&self.arena, prev), free(&self.arena, next));
        // The index entry the merged block will take over (a neighbour's), if any.
        let mut reuse: Option<FreeKey> = None;
        let mut survivor = id;
        if let Some(n) = next {
            self.unaccount_split(n);
            reuse = Some(self.key_of(n));
            self.absorb_next(id);
        }
        if let Some(p) = prev {
            self.unaccount_split(p);
            if let Some(k) = reuse.replace(self.key_of(p)) {
                self.pool_mut(pool).free.remove(&k);
            }
            self.absorb_next(p);
            survivor = p;
        }
        self.account_split(survivor);
        let key = self.key_of(survivor);
        match reuse {
            Some(old) => self.pool_mut(pool).free.replace(&old, key, survivor),
            None => self.pool_mut(pool).free.insert(key, survivor),
        }
    }

    #[inline]
    pub fn key_of(&self, id: BlockId) -> FreeKey {
        let b = &self.arena[id];
        (b.stream, b.size, b.ptr)
    }

    /// Merges `id`'s next block into `id` and frees the next block's slot.
    pub fn absorb_next(&mut self, id: BlockId) {
        let n = self.arena[id].next.expect("absorb_next needs a next block");
        let (nsize, nnext, nfreed) =
            (self.arena[n].size, self.arena[n].next, self.arena[n].freed_at);
        let b = &mut self.arena[id];
        b.size += nsize;
        b.next = nnext;
        b.freed_at = b.freed_at.max(nfreed);
        if let Some(nn) = nnext {
            self.arena[nn].prev = Some(id);
        }
        self.arena.remove(n);
    }

    /// Frees blocks whose pending events have completed.
    fn process_events(&mut self, mem: &M) {
        let mut i = 0;
        while i < self.pending.len() {
            if mem.event_completed(&self.pending[i].0) {
                let (event, id) = self.pending.remove(i).expect("index checked");
                mem.destroy_event(event);
                self.event_done(id);
            } else {
                i += 1;
            }
        }
    }

    fn event_done(&mut self, id: BlockId) {
        let b = &mut self.arena[id];
        b.pending_events -= 1;
        if b.pending_events == 0 {
            self.free_block(id);
        }
    }

    /// Waits for every pending event and frees the blocks waiting on them.
    fn synchronize_and_free_events(&mut self, mem: &M) {
        self.stats.num_sync_all_streams += 1;
        while let Some((event, id)) = self.pending.pop_front() {
            mem.synchronize_event(&event);
            mem.destroy_event(event);
            self.event_done(id);
        }
    }

    pub fn record_stream(&mut self, id: BlockId, stream: Stream) {
        let b = &self.arena[id];
        if stream == b.stream {
            return;
        }
        let uses = self.stream_uses.entry(id).or_default();
        if !uses.contains(&stream) {
            uses.push(stream);
        }
    }

    // ---- releasing cached memory ------------------------------------------------------

    /// `empty_cache`: waits for pending frees, then returns every whole free segment and every
    /// free page of expandable segments to the device.
    pub fn release_cached_blocks(&mut self, mem: &M) {
        self.synchronize_and_free_events(mem);
        for pool in [PoolKind::Small, PoolKind::Large] {
            let whole: Vec<BlockId> =
                self.pool(pool).free.values().filter(|&id| self.is_whole_segment(id)).collect();
            for id in whole {
                self.release_segment(mem, id);
            }
        }
        self.release_expandable_pages(mem);
    }

    fn is_whole_segment(&self, id: BlockId) -> bool {
        let b = &self.arena[id];
        !b.expandable && !b.is_split()
    }

    /// Releases cached whole segments of `pool` that could make room for `size` bytes: the
    /// smallest one big enough, else the largest ones until `size` is covered.
    fn release_available_cached_blocks(&mut self, mem: &M, pool: PoolKind, size: usize) -> bool {
        let mut whole: Vec<(usize, BlockId)> = self
            .pool(pool)
            .free
            .iter()
            .filter(|&&(_, id)| self.is_whole_segment(id))
            .map(|&((_, s, _), id)| (s, id))
            .collect();
        if whole.is_empty() {
            return false;
        }
        whole.sort_unstable();
        if let Some(&(_, id)) = whole.iter().find(|(s, _)| *s >= size) {
            self.release_segment(mem, id);
            return true;
        }
        let mut released = 0;
        for &(s, id) in whole.iter().rev() {
            if released >= size {
                break;
            }
            self.release_segment(mem, id);
            released += s;
        }
        true
    }

    /// Returns a free block that spans its whole (non-expandable) segment to the device.
    fn release_segment(&mut self, mem: &M, id: BlockId) {
        let b = &self.arena[id];
        debug_assert!(b.state == BlockState::Free && !b.is_split() && !b.expandable);
        let (ptr, size, pool, stream) = (b.ptr, b.size, b.pool, b.stream);
        self.pool_mut(pool).free.remove(&(stream, size, ptr));
        self.arena.remove(id);
        self.segments.remove(&ptr);
        // SAFETY: the segment came from `mem.allocate(size)` at `ptr`, and its only block is
        // free with no pending events, so nothing uses the memory.
        unsafe { mem.deallocate(ptr, size) };
        self.stats.num_device_free += 1;
        self.stats.segment.decrease(pool, 1);
        self.stats.reserved_bytes.decrease(pool, size as u64);
        if size >= self.max_split {
            self.stats.oversize_segments.decrease(1);
        }
        self.trace.record(TraceAction::SegmentFree, ptr, size, stream);
    }

    /// Frees the least recently freed whole segments until reserved memory is under the
    /// garbage-collection threshold of the cap.
    fn garbage_collect(&mut self, mem: &M) {
        let (Some(cap), Some(threshold)) = (self.cap, self.config.garbage_collection_threshold())
        else {
            return;
        };
        let limit = (cap as f64 * threshold) as u64;
        if self.stats.reserved_bytes.all.current as u64 <= limit {
            return;
        }
        let mut candidates: Vec<(u64, BlockId)> = [PoolKind::Small, PoolKind::Large]
            .into_iter()
            .flat_map(|p| self.pool(p).free.values())
            .filter(|&id| self.is_whole_segment(id))
            .map(|id| (self.arena[id].freed_at, id))
            .collect();
        candidates.sort_unstable();
        for (_, id) in candidates {
            if self.stats.reserved_bytes.all.current as u64 <= limit {
                break;
            }
            self.release_segment(mem, id);
        }
    }

    // ---- statistics helpers ---------------------------------------------------------

    /// Opens a statistics scope; returns its depth.
    pub fn begin_scope(&mut self) -> usize {
        self.scopes.push(self.stats.clone());
        self.stats.reset_peak();
        self.scopes.len() - 1
    }

    /// The statistics of the scope at `depth` so far.
    pub fn scope_stats(&self, depth: usize) -> MemoryStats {
        match self.scopes.get(depth) {
            Some(outer) => self.stats.since(outer),
            None => self.stats.clone(),
        }
    }

    /// Closes the scope at `depth` (and any scope opened inside it and still open) and returns
    /// its statistics.
    pub fn end_scope(&mut self, depth: usize) -> MemoryStats {
        let mut result = None;
        while self.scopes.len() > depth {
            let outer = self.scopes.pop().expect("length checked");
            let inner = self.stats.since(&outer);
            self.stats.restore_peaks(&outer);
            result = Some(inner);
        }
        result.unwrap_or_else(|| self.stats.clone())
    }

    /// PyTorch's "inactive split" blocks: free blocks of split, non-expandable segments.
    fn split_contribution(&self, id: BlockId) -> Option<(PoolKind, u64)> {
        let b = &self.arena[id];
        (b.state == BlockState::Free && b.is_split() && !b.expandable)
            .then_some((b.pool, b.size as u64))
    }

    #[inline]
    pub fn unaccount_split(&mut self, id: BlockId) {
        if let Some((pool, size)) = self.split_contribution(id) {
            self.stats.inactive_split.decrease(pool, 1);
            self.stats.inactive_split_bytes.decrease(pool, size);
        }
    }

    #[inline]
    pub fn account_split(&mut self, id: BlockId) {
        if let Some((pool, size)) = self.split_contribution(id) {
            self.stats.inactive_split.increase(pool, 1);
            self.stats.inactive_split_bytes.increase(pool, size);
        }
    }

    pub fn set_memory_fraction(&mut self, fraction: f64, total: u64) {
        self.cap = Some(cap_bytes(fraction, total));
    }

    fn out_of_memory(&mut self, mem: &M, requested: usize, stream: Stream) -> AllocError {
        self.stats.num_ooms += 1;
        let info = mem.mem_info();
        let rounded = policy::round_size_with(requested, &self.config, self.power2_rounding)
            .unwrap_or(requested);
        self.trace.record_oom(rounded, requested, info.free, stream);
        AllocError::OutOfMemory(Box::new(OutOfMemoryError {
            requested,
            device: mem.name(),
            device_total: info.total,
            device_free: info.free,
            allocated: self.stats.allocated_bytes.all.current as u64,
            reserved: self.stats.reserved_bytes.all.current as u64,
            cap: self.cap,
            expandable_segments: self.config.expandable_segments(),
        }))
    }
}

fn cap_bytes(fraction: f64, total: u64) -> u64 {
    (fraction * total as f64).floor() as u64
}
