//! The caching policy: PyTorch's rules, written once for every backend.
//!
//! Each step follows the function of `c10/cuda/CUDACachingAllocator.cpp` named in its doc
//! comment (`DeviceCachingAllocator::malloc`, `get_free_block`, `alloc_block`, ...), in the
//! same order and with the same statistics, so that every figure is the one PyTorch gives
//! for the same sequence of requests. All methods run under the allocator's lock and take
//! the raw memory as an argument.

use crate::block::{Arena, Block, BlockId, BlockState, MempoolId, Pool, PrivatePool, Segment};
use crate::config::AllocatorConfig;
use crate::error::{AllocError, OutOfMemoryError};
use crate::index::FreeKey;
use crate::memory::{DeviceMemory, DevicePtr, RawError, Stream};
use crate::policy::{self, PoolKind, PoolRef};
use crate::stats::{Counters, MemoryStats};
use crate::trace::{Trace, TraceAction};
use std::collections::{BTreeMap, HashMap, VecDeque};

/// Requests of this size or more fail at once, before the cache is touched, as PyTorch's
/// `NativeCachingAllocator::allocate` refuses them ("more than 1EB memory").
pub(crate) const ONE_EXA_BYTE: usize = 1 << 60;

/// Reserved memory never passes this, whatever the device's size, so that no statistic
/// (each bounded by reserved memory) can pass `i64::MAX`: past it, allocations fail with
/// out-of-memory. (An expandable segment may map up to one 20 MiB page past a request.)
pub(crate) const MAX_RESERVED: u64 = i64::MAX as u64 - (1 << 31);

pub(crate) struct State<M: DeviceMemory> {
    pub config: AllocatorConfig,
    /// `config.rounds_to_power2_divisions()`, computed once.
    power2_rounding: bool,
    /// `config.max_split_size()`, computed once.
    max_split: usize,
    /// How far an oversize block may exceed an oversize request and still serve it.
    max_non_split_rounding: usize,
    /// `config.expandable_segments()`, computed once.
    expandable: bool,
    /// Whether garbage collection is on (see [`Self::gc_enabled`]), kept up to date.
    gc_on: bool,
    /// Expandable segments that exist: while none does, best fit skips their special case.
    pub expandable_live: usize,
    /// Reserved memory may not exceed this (from the memory fraction).
    pub cap: Option<u64>,
    pub arena: Arena,
    /// The default pools of free blocks (PyTorch's `small_blocks`, `large_blocks`).
    pub small: Pool,
    pub large: Pool,
    /// The private pools' pools of free blocks, two per slot (small, large), by
    /// [`PoolRef::index`] less 2.
    pub private_pools: Vec<Pool>,
    /// Private pools by slot (PyTorch's `graph_pools`); `None` once deleted.
    pub private: Vec<Option<PrivatePool>>,
    /// The pools being allocated to (PyTorch's `captures_underway`): the private pool's slot
    /// and the stream whose allocations go there (`None`: every stream, as
    /// `torch.cuda.use_mem_pool` routes a thread's allocations).
    pub captures: Vec<(usize, Option<Stream>)>,
    /// Freed blocks used on other streams while a capture was underway, whose events wait
    /// until none is (PyTorch's `needs_events_deferred_until_no_capture`).
    deferred_events: Vec<BlockId>,
    /// Segments by base address.
    pub segments: BTreeMap<DevicePtr, Segment>,
    /// The statistics (reported as [`MemoryStats`] by [`Counters::stats`]).
    pub stats: Counters,
    /// Other streams that used allocated blocks (from `record_stream`), kept apart from the
    /// blocks because it is rare: the hot path only checks that this is empty.
    stream_uses: HashMap<BlockId, Vec<Stream>>,
    /// Events that pending frees wait for, oldest first.
    pending: VecDeque<(M::Event, BlockId)>,
    pub trace: Trace,
    /// Statistics of the enclosing scopes, outermost first (see [`crate::StatsScope`]).
    pub scopes: Vec<MemoryStats>,
    /// Handles and live allocations that hold the cache (see [`crate::CachingAllocator`]).
    pub holders: usize,
}

impl<M: DeviceMemory> State<M> {
    pub fn new(config: AllocatorConfig, total: u64) -> Self {
        let stats = Counters {
            max_split_size: config.max_split_size().try_into().unwrap_or(-1),
            ..Counters::default()
        };
        let cap = config.memory_fraction().map(|f| cap_bytes(f, total));
        State {
            power2_rounding: config.rounds_to_power2_divisions(),
            max_split: config.max_split_size(),
            max_non_split_rounding: config.max_non_split_rounding_size(),
            expandable: config.expandable_segments(),
            gc_on: cap.is_some() && config.garbage_collection_threshold().is_some(),
            expandable_live: 0,
            config,
            cap,
            arena: Arena::default(),
            small: Pool::default(),
            large: Pool::default(),
            private_pools: Vec::new(),
            private: Vec::new(),
            captures: Vec::new(),
            deferred_events: Vec::new(),
            segments: BTreeMap::new(),
            stats,
            stream_uses: HashMap::new(),
            pending: VecDeque::new(),
            trace: Trace::default(),
            scopes: Vec::new(),
            holders: 0,
        }
    }

    #[inline]
    pub fn pool(&self, pool: PoolRef) -> &Pool {
        match pool.index() {
            0 => &self.small,
            1 => &self.large,
            i => &self.private_pools[i - 2],
        }
    }

    #[inline]
    pub fn pool_mut(&mut self, pool: PoolRef) -> &mut Pool {
        match pool.index() {
            0 => &mut self.small,
            1 => &mut self.large,
            i => &mut self.private_pools[i - 2],
        }
    }

    /// `get_pool`: the pool for a rounded size requested on `stream`: a private pool's when
    /// a capture (or `use_mem_pool`) is allocating to it for that stream, else the default.
    #[inline(always)]
    fn get_pool(&self, size: usize, stream: Stream) -> PoolRef {
        let kind = PoolKind::for_size(size);
        if !self.captures.is_empty()
            && let Some(&(slot, _)) =
                self.captures.iter().find(|(_, filter)| filter.is_none_or(|s| s == stream))
        {
            return PoolRef::new(Some(slot), kind);
        }
        PoolRef::new(None, kind)
    }

    /// PyTorch's `set_fraction && garbage_collection_threshold() > 0`: garbage collection and
    /// the block ages it needs are on.
    #[inline]
    fn gc_enabled(&self) -> bool {
        self.gc_on
    }

    // ---- allocation -------------------------------------------------------------------

    /// `DeviceCachingAllocator::malloc`: process completed events, look for a cached block,
    /// else garbage-collect (when on) and get a new one, releasing cached blocks and retrying
    /// as PyTorch does when the device is full. `requested` is not 0 (PyTorch hands out no
    /// block for 0 bytes; [`crate::CachingAllocator`] does the same before calling this).
    pub fn malloc(
        &mut self,
        mem: &M,
        requested: usize,
        stream: Stream,
    ) -> Result<BlockId, AllocError> {
        if requested >= ONE_EXA_BYTE {
            return Err(self.too_large(mem, requested));
        }
        // No event queries while a capture is underway (they are illegal in capture): the
        // frees wait until none is.
        if (!self.pending.is_empty() || !self.deferred_events.is_empty())
            && self.captures.is_empty()
        {
            self.process_events(mem);
        }
        let size = policy::round_size_with(requested, &self.config, self.power2_rounding)
            .ok_or_else(|| self.too_large(mem, requested))?;
        let pool = self.get_pool(size, stream);
        if let Some((key, id, pos)) = self.get_free_block(pool, stream, size) {
            self.hand_out(id, size, requested, Some((key, pos)));
            return Ok(id);
        }
        self.malloc_new_block(mem, requested, size, pool, stream)
    }

    /// The rest of [`Self::malloc`] when no cached block fits: garbage collection (when on),
    /// a new segment, releasing cached blocks and retrying as PyTorch does when the device
    /// is full. Kept out of line so that the cached path stays small.
    #[inline(never)]
    fn malloc_new_block(
        &mut self,
        mem: &M,
        requested: usize,
        size: usize,
        pool: PoolRef,
        stream: Stream,
    ) -> Result<BlockId, AllocError> {
        if self.gc_enabled() {
            self.garbage_collect_cached_blocks(mem);
        }
        let alloc_size =
            policy::segment_size(size).ok_or_else(|| self.too_large(mem, requested))?;
        let found = match self.alloc_block(mem, pool, stream, size, alloc_size, false)? {
            Some(id) => Some(id),
            None if self.release_available_cached_blocks(mem, pool, stream, size) => {
                self.alloc_block(mem, pool, stream, size, alloc_size, false)?
            }
            None => None,
        };
        let id = match found {
            Some(id) => id,
            // Releasing the whole cache synchronizes, which a capture forbids.
            None if self.captures.is_empty() => {
                self.release_cached_blocks(mem);
                match self.alloc_block(mem, pool, stream, size, alloc_size, true)? {
                    Some(id) => id,
                    None => return Err(self.out_of_memory(mem, requested, size, stream)),
                }
            }
            None => return Err(self.out_of_memory(mem, requested, size, stream)),
        };
        self.hand_out(id, size, requested, None);
        Ok(id)
    }

    /// `get_free_block`: the smallest cached block of the stream that fits, with PyTorch's
    /// rules for expandable and oversize blocks. The block stays in its pool;
    /// [`Self::hand_out`] takes it out.
    #[inline(always)]
    fn get_free_block(
        &mut self,
        pool: PoolRef,
        stream: Stream,
        size: usize,
    ) -> Option<(FreeKey, BlockId, usize)> {
        if self.gc_enabled() {
            self.pool_mut(pool).gc_calls += 1;
        }
        let (mut key, mut id, mut pos) =
            self.pool(pool).free.first_at_or_after(&(stream, size, 0))?;
        if key.0 != stream {
            return None;
        }
        if self.expandable_live > 0 && self.arena[id].expandable {
            (key, id, pos) = self.expandable_fit(pool, stream, pos)?;
        }
        let max_split = self.max_split;
        // An oversize block (never split) serves no request under max_split_size ...
        if size < max_split && key.1 >= max_split {
            return None;
        }
        // ... and oversize requests only within `max_non_split_rounding` of its size.
        if size >= max_split && key.1 >= size.saturating_add(self.max_non_split_rounding) {
            return None;
        }
        Some((key, id, pos))
    }

    /// The expandable-segment branch of `get_free_block`, from the best-fit position `pos`.
    #[cold]
    fn expandable_fit(
        &self,
        pool: PoolRef,
        stream: Stream,
        mut pos: usize,
    ) -> Option<(FreeKey, BlockId, usize)> {
        let free = &self.pool(pool).free;
        if self.expandable {
            // A block that can grow into the unmapped range after it counts as that big, so
            // a later block may fit better.
            let grown = |id: BlockId| {
                let b = &self.arena[id];
                b.size
                    + b.next
                        .filter(|&n| self.arena[n].state == BlockState::Unmapped)
                        .map_or(0, |n| self.arena[n].size)
            };
            while let Some(&(next_key, next_id)) = free.get(pos + 1) {
                let (_, id) = free.get(pos).copied()?;
                if !self.arena[id].expandable || next_key.0 != stream || grown(next_id) >= grown(id)
                {
                    break;
                }
                pos += 1;
            }
        } else {
            // Expandable segments were turned off: only ordinary blocks serve.
            loop {
                pos += 1;
                match free.get(pos) {
                    Some(&(k, id)) if k.0 == stream && self.arena[id].expandable => continue,
                    Some(&(k, _)) if k.0 == stream => break,
                    _ => return None,
                }
            }
        }
        free.get(pos).map(|&(k, id)| (k, id, pos))
    }

    /// `alloc_block`: a new free block of at least `size` (not in any pool) from the device,
    /// or `None` when the device or the memory fraction has no room for `alloc_size`. Counts
    /// `num_alloc_retries` on the retry after the whole cache was released.
    fn alloc_block(
        &mut self,
        mem: &M,
        pool: PoolRef,
        stream: Stream,
        size: usize,
        alloc_size: usize,
        is_retry: bool,
    ) -> Result<Option<BlockId>, AllocError> {
        if is_retry {
            self.stats.num_alloc_retries += 1;
        }
        let limit = self.cap.map_or(MAX_RESERVED, |cap| cap.min(MAX_RESERVED));
        if (self.stats.reserved_bytes.current() as u64).saturating_add(alloc_size as u64) > limit {
            return Ok(None);
        }
        if self.expandable {
            let found = self.try_allocate_expandable_block(mem, pool, stream, size)?;
            if found.is_some() {
                self.count_private_malloc(pool, true);
            }
            return Ok(found);
        }
        let ptr = match mem.allocate(alloc_size) {
            Ok(ptr) => ptr,
            Err(RawError::OutOfMemory { .. }) => return Ok(None),
            Err(e) => return Err(AllocError::Device(e.to_string())),
        };
        self.count_private_malloc(pool, true);
        self.stats.num_device_alloc += 1;
        self.stats.segment.increase(pool, 1);
        self.stats.reserved_bytes.increase(pool, alloc_size as u64);
        if alloc_size >= self.max_split {
            self.stats.oversize_segments.increase(1);
        }
        let id = self.arena.insert(Block {
            ptr,
            size: alloc_size,
            requested: 0,
            stream,
            pool,
            prev: None,
            next: None,
            state: BlockState::Free,
            segment: ptr,
            expandable: false,
            pending_events: 0,
            gc_base: 0,
        });
        self.segments
            .insert(ptr, Segment { mapped: alloc_size, stream, pool, expandable: false, head: id });
        self.trace.record(TraceAction::SegmentAlloc, ptr, alloc_size, stream);
        Ok(Some(id))
    }

    /// `should_split`: whether the rest of a block after `size` bytes becomes a block of its
    /// own.
    #[inline]
    fn should_split(&self, pool: PoolRef, block_size: usize, size: usize) -> bool {
        let remaining = block_size - size;
        if pool.kind() == PoolKind::Small || self.expandable {
            remaining >= policy::MIN_BLOCK_SIZE
        } else {
            size < self.max_split && remaining > policy::SMALL_SIZE
        }
    }

    /// `alloc_found_block`: marks a free block allocated, splitting off the remainder, with
    /// PyTorch's net change of the inactive-split statistics. `in_pool` is the block's key
    /// and index position if it is in its pool: the remainder then takes its place.
    #[inline(always)]
    fn hand_out(
        &mut self,
        id: BlockId,
        size: usize,
        requested: usize,
        in_pool: Option<(FreeKey, usize)>,
    ) {
        let max_split = self.max_split;
        let b = &self.arena[id];
        let (pool, block_size, already_split, expandable) =
            (b.pool, b.size, b.is_split(), b.expandable);
        if self.should_split(pool, block_size, size) {
            let b = &self.arena[id];
            let rest = Block {
                ptr: b.ptr + size as u64,
                size: block_size - size,
                requested: 0,
                stream: b.stream,
                pool,
                prev: Some(id),
                next: b.next,
                state: BlockState::Free,
                segment: b.segment,
                expandable,
                pending_events: 0,
                gc_base: self.pool(pool).gc_calls,
            };
            let key = (rest.stream, rest.size, rest.ptr);
            let (next, rest_size) = (rest.next, rest.size as u64);
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
            if !expandable {
                if already_split {
                    // An inactive split block shrinks by `size`.
                    self.stats.inactive_split_bytes.decrease(pool, size as u64);
                } else {
                    // An unsplit block leaves a new inactive split block behind.
                    self.stats.inactive_split.increase(pool, 1);
                    self.stats.inactive_split_bytes.increase(pool, rest_size);
                }
            }
        } else {
            if let Some((_, pos)) = in_pool {
                self.pool_mut(pool).free.remove_at(pos);
            }
            if already_split && !expandable {
                self.stats.inactive_split.decrease(pool, 1);
                self.stats.inactive_split_bytes.decrease(pool, block_size as u64);
            }
        }
        let b = &mut self.arena[id];
        b.state = BlockState::Allocated;
        b.requested = requested;
        let (bsize, ptr, stream) = (b.size as u64, b.ptr, b.stream);
        self.trace.record_block(TraceAction::Alloc, ptr, bsize as usize, requested, stream);
        let s = &mut self.stats;
        s.allocation.increase(pool, 1);
        s.allocated_bytes.increase(pool, bsize);
        s.active.increase(pool, 1);
        s.active_bytes.increase(pool, bsize);
        s.requested_bytes.increase(pool, requested as u64);
        if bsize as usize >= max_split {
            s.oversize_allocations.increase(1);
        }
    }

    // ---- freeing ----------------------------------------------------------------------

    /// `DeviceCachingAllocator::free`: the block stops counting as allocated at once; it goes
    /// back to the cache now, or when the other streams that used it are done.
    pub fn free(&mut self, mem: &M, id: BlockId) {
        let max_split = self.max_split;
        let b = &mut self.arena[id];
        debug_assert_eq!(b.state, BlockState::Allocated);
        let (pool, size, requested, ptr, stream) =
            (b.pool, b.size as u64, b.requested, b.ptr, b.stream);
        let s = &mut self.stats;
        s.allocation.decrease(pool, 1);
        s.allocated_bytes.decrease(pool, size);
        self.trace.record_block(TraceAction::FreeRequested, ptr, size as usize, requested, stream);
        if size as usize >= max_split {
            self.stats.oversize_allocations.decrease(1);
        }
        if !self.stream_uses.is_empty() && self.stream_uses.contains_key(&id) {
            if !self.captures.is_empty() {
                // No events may be recorded for a capture's queries: they wait until no
                // capture is underway (`needs_events_deferred_until_no_capture`).
                self.arena[id].state = BlockState::PendingFree;
                self.deferred_events.push(id);
                return;
            }
            if self.insert_events(mem, id) > 0 {
                return;
            }
        }
        self.free_block(id);
    }

    /// `insert_events`: one event per other stream that used block `id`; the block waits for
    /// all of them (pending free). Returns how many were recorded.
    fn insert_events(&mut self, mem: &M, id: BlockId) -> u32 {
        let uses = self.stream_uses.remove(&id).unwrap_or_default();
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
        }
        events
    }

    /// `insert_events_deferred_until_no_capture`: the events of blocks freed during a
    /// capture, now that none is underway; blocks with none left are freed.
    fn insert_events_deferred_until_no_capture(&mut self, mem: &M) {
        for id in std::mem::take(&mut self.deferred_events) {
            if self.insert_events(mem, id) == 0 {
                self.free_block(id);
            }
        }
    }

    /// `free_block`: returns a block to its pool, merging it with free neighbours, and ends
    /// its time as an active block (`active`, `active_bytes`, `requested_bytes`).
    #[inline(always)]
    fn free_block(&mut self, id: BlockId) {
        let b = &mut self.arena[id];
        let (pool, size, requested, ptr, stream, prev, next, expandable) =
            (b.pool, b.size, b.requested, b.ptr, b.stream, b.prev, b.next, b.expandable);
        b.state = BlockState::Free;
        // As PyTorch: the block's own address and size, before any merge.
        self.trace.record_block(TraceAction::FreeCompleted, ptr, size, requested, stream);

        let free = |a: &Arena, n: Option<BlockId>| n.filter(|&n| a[n].state == BlockState::Free);
        let (prev, next) = (free(&self.arena, prev), free(&self.arena, next));
        let mut net_blocks: i64 = 0;
        let mut net_bytes: i64 = 0;
        // The index entry the merged block takes over (a neighbour's), if any.
        let mut reuse: Option<FreeKey> = None;
        let mut survivor = id;
        if let Some(p) = prev {
            net_blocks -= 1;
            net_bytes -= self.arena[p].size as i64;
            reuse = Some(self.key_of(p));
            self.absorb_next(p);
            survivor = p;
        }
        if let Some(n) = next {
            net_blocks -= 1;
            net_bytes -= self.arena[n].size as i64;
            if let Some(k) = reuse.replace(self.key_of(n)) {
                self.pool_mut(pool).free.remove(&k);
            }
            self.absorb_next(survivor);
        }
        let gc_base = self.pool(pool).gc_calls;
        let b = &mut self.arena[survivor];
        b.gc_base = gc_base;
        if b.is_split() {
            net_blocks += 1;
            net_bytes += b.size as i64;
        }
        let key = (b.stream, b.size, b.ptr);
        match reuse {
            Some(old) => self.pool_mut(pool).free.replace(&old, key, survivor),
            None => self.pool_mut(pool).free.insert(key, survivor),
        }
        let s = &mut self.stats;
        if !expandable {
            // Expandable segments stay out of `inactive_split`: their free pages can always
            // be given back.
            s.inactive_split.apply(pool, net_blocks);
            s.inactive_split_bytes.apply(pool, net_bytes);
        }
        s.active.decrease(pool, 1);
        s.active_bytes.decrease(pool, size as u64);
        s.requested_bytes.decrease(pool, requested as u64);
    }

    #[inline]
    pub fn key_of(&self, id: BlockId) -> FreeKey {
        let b = &self.arena[id];
        (b.stream, b.size, b.ptr)
    }

    /// Merges `id`'s next block into `id` and frees the next block's slot.
    pub fn absorb_next(&mut self, id: BlockId) {
        let n = self.arena[id].next.expect("absorb_next needs a next block");
        let (nsize, nnext) = (self.arena[n].size, self.arena[n].next);
        let b = &mut self.arena[id];
        b.size += nsize;
        b.next = nnext;
        if let Some(nn) = nnext {
            self.arena[nn].prev = Some(id);
        }
        self.arena.remove(n);
    }

    /// `process_events`: frees blocks whose pending events have completed.
    fn process_events(&mut self, mem: &M) {
        if !self.deferred_events.is_empty() {
            self.insert_events_deferred_until_no_capture(mem);
        }
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

    /// `synchronize_and_free_events`: waits for every pending event and frees the blocks
    /// waiting on them.
    fn synchronize_and_free_events(&mut self, mem: &M) {
        self.stats.num_sync_all_streams += 1;
        if !self.deferred_events.is_empty() {
            self.insert_events_deferred_until_no_capture(mem);
        }
        while let Some((event, id)) = self.pending.pop_front() {
            mem.synchronize_event(&event);
            mem.destroy_event(event);
            self.event_done(id);
        }
    }

    /// `recordStream`: uses on the allocation stream need no synchronisation.
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

    /// `release_cached_blocks` (`empty_cache`): waits for pending frees, then returns every
    /// unsplit cached block of the large pool and then of the small pool to the device, and
    /// unmaps the free pages of expandable segments; then does the same for the private
    /// pools no longer in use (`graph_pools_freeable`: released by every capture and
    /// `MemPool` that used them), small then large, deleting those left with no segment.
    /// Private pools in use keep their cached blocks.
    pub fn release_cached_blocks(&mut self, mem: &M) {
        self.synchronize_and_free_events(mem);
        self.release_blocks(mem, PoolRef::LARGE);
        self.release_blocks(mem, PoolRef::SMALL);
        for slot in 0..self.private.len() {
            if self.private[slot].as_ref().is_none_or(|p| p.use_count != 0) {
                continue;
            }
            self.release_blocks(mem, PoolRef::new(Some(slot), PoolKind::Small));
            self.release_blocks(mem, PoolRef::new(Some(slot), PoolKind::Large));
            if self.private[slot].as_ref().is_some_and(|p| p.malloc_count == 0) {
                self.private[slot] = None;
            }
        }
    }

    /// Gives every cached segment back, private pools' included (the allocator is going
    /// away: no capture or pool can use them any more).
    pub fn release_everything(&mut self, mem: &M) {
        self.captures.clear();
        for p in self.private.iter_mut().flatten() {
            p.use_count = 0;
        }
        self.release_cached_blocks(mem);
    }

    /// Counts a segment obtained (`true`) or given back for a private pool (PyTorch's
    /// `cudaMalloc_count`, which decides when an unused private pool can be deleted).
    #[inline]
    pub(crate) fn count_private_malloc(&mut self, pool: PoolRef, obtained: bool) {
        if let Some(slot) = pool.private_slot()
            && let Some(p) = self.private.get_mut(slot).and_then(Option::as_mut)
        {
            p.malloc_count = if obtained {
                p.malloc_count.saturating_add(1)
            } else {
                p.malloc_count.saturating_sub(1)
            };
        }
    }

    // ---- private pools ------------------------------------------------------------------

    /// The slot of the live private pool `id`.
    fn private_slot(&self, id: MempoolId) -> Option<usize> {
        self.private.iter().position(|p| p.as_ref().is_some_and(|p| p.id == id))
    }

    /// The id of the pool `pool` belongs to ((0, 0) for the default pools).
    pub fn mempool_id(&self, pool: PoolRef) -> MempoolId {
        pool.private_slot()
            .and_then(|slot| self.private.get(slot).and_then(Option::as_ref))
            .map_or(MempoolId::DEFAULT, |p| p.id)
    }

    /// `beginAllocateToPool`: allocations on `stream` (`None`: on every stream) go to the
    /// private pool `id` until [`Self::end_allocate_to_pool`]; the pool is created, or, if it
    /// exists, gains a user (`use_count`).
    pub fn begin_allocate_to_pool(
        &mut self,
        id: MempoolId,
        stream: Option<Stream>,
    ) -> Result<(), AllocError> {
        if id == MempoolId::DEFAULT {
            return Err(AllocError::Pool(format!("{id} is the default pool, not a private one")));
        }
        let slot = match self.private_slot(id) {
            Some(slot) => {
                if self.captures.iter().any(|&(s, _)| s == slot) {
                    return Err(AllocError::Pool(format!("already allocating to pool {id}")));
                }
                let p = self.private[slot].as_mut().expect("live slot");
                if p.use_count == 0 {
                    return Err(AllocError::Pool(format!(
                        "pool {id} was released by every user; it cannot be used again"
                    )));
                }
                p.use_count += 1;
                slot
            }
            None => {
                self.private.push(Some(PrivatePool { id, use_count: 1, malloc_count: 0 }));
                self.private_pools.push(Pool::default());
                self.private_pools.push(Pool::default());
                self.private.len() - 1
            }
        };
        self.captures.push((slot, stream));
        Ok(())
    }

    /// `endAllocateToPool`: allocations stop going to pool `id`.
    pub fn end_allocate_to_pool(&mut self, id: MempoolId) -> Result<(), AllocError> {
        let at = self
            .private_slot(id)
            .and_then(|slot| self.captures.iter().position(|&(s, _)| s == slot))
            .ok_or_else(|| AllocError::Pool(format!("not allocating to pool {id}")))?;
        self.captures.remove(at);
        Ok(())
    }

    /// `releasePool`: one user of pool `id` (a graph, a `MemPool`) is gone; when none is
    /// left, `empty_cache` may give its cached segments back (`graph_pools_freeable`).
    pub fn release_pool(&mut self, id: MempoolId) -> Result<(), AllocError> {
        let p = self
            .private_slot(id)
            .and_then(|slot| self.private[slot].as_mut())
            .filter(|p| p.use_count > 0)
            .ok_or_else(|| AllocError::Pool(format!("no pool {id} in use")))?;
        p.use_count -= 1;
        Ok(())
    }

    /// `release_blocks`: in best-fit order, releases unsplit blocks; then unmaps the free
    /// blocks of expandable segments and gives back segments left with nothing mapped.
    fn release_blocks(&mut self, mem: &M, pool: PoolRef) {
        let blocks: Vec<BlockId> = self.pool(pool).free.values().collect();
        let mut to_unmap = Vec::new();
        for id in blocks {
            let b = &self.arena[id];
            if b.expandable {
                to_unmap.push(id);
            } else if !b.is_split() {
                self.release_block(mem, id);
            }
        }
        for id in to_unmap {
            let id = self.unmap_block(mem, id);
            let b = &self.arena[id];
            if !b.is_split() && b.state == BlockState::Unmapped {
                self.release_expandable_segment(mem, id);
            }
        }
    }

    /// `release_available_cached_blocks`: with `max_split_size` set, releases cached
    /// oversize blocks of the requesting stream: the smallest one of at least
    /// `max(size, max_split_size)`, else the largest ones down to max_split_size until that
    /// much is released. `false` (with whatever was released still released) when that is
    /// not enough, or without `max_split_size`.
    fn release_available_cached_blocks(
        &mut self,
        mem: &M,
        pool: PoolRef,
        stream: Stream,
        size: usize,
    ) -> bool {
        let max_split = self.max_split;
        if max_split == usize::MAX {
            return false;
        }
        let target = size.max(max_split);
        let free = &self.pool(pool).free;
        let at = free.position_at_or_after(&(stream, target, 0));
        match free.get(at) {
            Some(&(k, id)) if k.0 == stream => {
                if self.arena[id].expandable {
                    // PyTorch's `release_block` asserts on expandable blocks; vram releases
                    // nothing instead.
                    return false;
                }
                self.release_block(mem, id);
                true
            }
            _ => {
                let mut released = 0usize;
                let mut i = at;
                while released < target && i > 0 {
                    i -= 1;
                    let &(k, id) = self.pool(pool).free.get(i).expect("position in range");
                    if k.1 < max_split || k.0 != stream || self.arena[id].expandable {
                        break;
                    }
                    released += k.1;
                    self.release_block(mem, id);
                }
                released >= target
            }
        }
    }

    /// `release_block`: returns a cached block that spans its whole (non-expandable) segment
    /// to the device.
    fn release_block(&mut self, mem: &M, id: BlockId) {
        let b = &self.arena[id];
        debug_assert!(b.state == BlockState::Free && !b.is_split() && !b.expandable);
        let (ptr, size, pool, stream) = (b.ptr, b.size, b.pool, b.stream);
        self.stats.num_device_free += 1;
        self.trace.record(TraceAction::SegmentFree, ptr, size, stream);
        self.pool_mut(pool).free.remove(&(stream, size, ptr));
        self.arena.remove(id);
        self.segments.remove(&ptr);
        self.count_private_malloc(pool, false);
        // SAFETY: the segment came from `mem.allocate(size)` at `ptr`, and its only block is
        // free with no pending events, so nothing uses the memory.
        unsafe { mem.deallocate(ptr, size) };
        self.stats.segment.decrease(pool, 1);
        self.stats.reserved_bytes.decrease(pool, size as u64);
        if size >= self.max_split {
            self.stats.oversize_segments.decrease(1);
        }
    }

    /// `garbage_collect_cached_blocks`: when reserved memory is above the threshold's share
    /// of the cap, releases unsplit cached blocks of the large pool whose age (in
    /// `get_free_block` calls since they were cached) is at least the mean age, pass after
    /// pass, until at least the excess was reclaimed. A pass does not stop at the target.
    fn garbage_collect_cached_blocks(&mut self, mem: &M) {
        let (Some(cap), Some(threshold)) = (self.cap, self.config.garbage_collection_threshold())
        else {
            return;
        };
        let gc_threshold = (threshold * cap as f64) as u64;
        let reserved = self.stats.reserved_bytes.current() as u64;
        if reserved <= gc_threshold {
            return;
        }
        let target = reserved - gc_threshold;
        let large = PoolRef::LARGE;
        let now = self.pool(large).gc_calls;
        let age = |b: &Block| now - b.gc_base;
        let freeable = |s: &Self, id: BlockId| {
            let b = &s.arena[id];
            !b.is_split() && !b.expandable
        };
        let (mut total_age, mut count) = (0u64, 0u64);
        for id in self.pool(large).free.values() {
            if freeable(self, id) {
                total_age += age(&self.arena[id]);
                count += 1;
            }
        }
        let mut reclaimed = 0u64;
        let mut block_freed = true;
        while reclaimed < target && block_freed && count > 0 {
            let age_threshold = total_age as f64 / count as f64;
            block_freed = false;
            let blocks: Vec<BlockId> = self.pool(large).free.values().collect();
            for id in blocks {
                if freeable(self, id) && age(&self.arena[id]) as f64 >= age_threshold {
                    block_freed = true;
                    reclaimed += self.arena[id].size as u64;
                    total_age -= age(&self.arena[id]);
                    count -= 1;
                    self.release_block(mem, id);
                }
            }
        }
    }

    // ---- statistics helpers ---------------------------------------------------------

    /// Opens a statistics scope; returns its depth.
    pub fn begin_scope(&mut self) -> usize {
        self.scopes.push(self.stats.stats());
        self.stats.reset_peak();
        self.scopes.len() - 1
    }

    /// The statistics of the scope at `depth` so far.
    pub fn scope_stats(&self, depth: usize) -> MemoryStats {
        match self.scopes.get(depth) {
            Some(outer) => self.stats.stats().since(outer),
            None => self.stats.stats(),
        }
    }

    /// Closes the scope at `depth` (and any scope opened inside it and still open) and returns
    /// its statistics.
    pub fn end_scope(&mut self, depth: usize) -> MemoryStats {
        let mut result = None;
        while self.scopes.len() > depth {
            let outer = self.scopes.pop().expect("length checked");
            let inner = self.stats.stats().since(&outer);
            self.stats.restore_peaks(&outer);
            result = Some(inner);
        }
        result.unwrap_or_else(|| self.stats.stats())
    }

    pub fn set_memory_fraction(&mut self, fraction: f64, total: u64) {
        self.cap = Some(cap_bytes(fraction, total));
        self.gc_on = self.config.garbage_collection_threshold().is_some();
    }

    /// The error for a request PyTorch refuses before touching the cache (1 EiB or more):
    /// no statistic and no trace entry changes.
    fn too_large(&self, mem: &M, requested: usize) -> AllocError {
        self.oom_error(mem, requested)
    }

    fn out_of_memory(
        &mut self,
        mem: &M,
        requested: usize,
        rounded: usize,
        stream: Stream,
    ) -> AllocError {
        self.stats.num_ooms += 1;
        let err = self.oom_error(mem, requested);
        if let AllocError::OutOfMemory(e) = &err {
            self.trace.record_oom(rounded, requested, e.device_free, stream);
        }
        err
    }

    fn oom_error(&self, mem: &M, requested: usize) -> AllocError {
        let info = mem.mem_info();
        AllocError::OutOfMemory(Box::new(OutOfMemoryError {
            requested,
            device: mem.name(),
            device_total: info.total,
            device_free: info.free,
            allocated: self.stats.allocated_bytes.current() as u64,
            reserved: self.stats.reserved_bytes.current() as u64,
            cap: self.cap,
            expandable_segments: self.expandable,
        }))
    }
}

fn cap_bytes(fraction: f64, total: u64) -> u64 {
    (fraction * total as f64) as u64
}
