//! Expandable segments (PyTorch's `expandable_segments:True`): one reserved address range per
//! stream and pool that grows by mapping pages, so a growing workload tiles one range instead
//! of leaving stranded segments behind.
//!
//! Follows PyTorch's `ExpandableSegment` and the allocator's `find_expandable_block`,
//! `try_allocate_expandable_block`, `map_block`, `unmap_block` and
//! `release_expandable_segment`: pages of 2 MiB in the small pool and 20 MiB in the large
//! pool, address space for 9/8 of the device's memory, mapping at the lowest address that
//! fits, unmapping whole free pages on `empty_cache`. Blocks tile the whole range; ranges
//! with no memory behind them are `Unmapped` blocks, kept in their pool's `unmapped` set.
//! Expandable segments count in `reserved_bytes` (mapped bytes) but not in `segment`, and
//! stay out of `inactive_split`, as in PyTorch.

use crate::block::{Block, BlockId, BlockState, Segment};
use crate::error::AllocError;
use crate::memory::{DeviceMemory, RawError, Stream};
use crate::policy::{LARGE_BUFFER, PoolKind, PoolRef, SMALL_BUFFER};
use crate::state::State;
use crate::trace::TraceAction;

/// Mapping granularity of an expandable segment of `pool` (PyTorch's `segment_size_`).
pub(crate) fn page_size(pool: PoolRef) -> usize {
    match pool.kind() {
        PoolKind::Small => SMALL_BUFFER,
        PoolKind::Large => LARGE_BUFFER,
    }
}

impl<M: DeviceMemory> State<M> {
    /// `try_allocate_expandable_block`: a free block of at least `size` bytes (taken out of
    /// its pool), mapping pages as needed; `None` when the device has no room.
    pub(crate) fn try_allocate_expandable_block(
        &mut self,
        mem: &M,
        pool: PoolRef,
        stream: Stream,
        size: usize,
    ) -> Result<Option<BlockId>, AllocError> {
        let Some(mut candidate) = self.find_expandable_block(mem, pool, stream, size)? else {
            return Ok(None);
        };
        if self.arena[candidate].state == BlockState::Unmapped {
            let want = self.arena[candidate].size.min(size);
            match self.map_block(mem, candidate, want)? {
                Some(id) => candidate = id,
                None => return Ok(None),
            }
        }
        while self.arena[candidate].size < size {
            let remaining = size - self.arena[candidate].size;
            let next = self.arena[candidate].next.expect("the range found has room");
            let want = remaining.min(self.arena[next].size);
            match self.map_block(mem, next, want)? {
                Some(id) => candidate = id,
                None => return Ok(None),
            }
        }
        let key = self.key_of(candidate);
        self.pool_mut(pool).free.remove(&key);
        Ok(Some(candidate))
    }

    /// `find_expandable_block`: the lowest address of the stream's expandable segments where
    /// free and unmapped blocks in a row give `size` bytes, else a new segment.
    fn find_expandable_block(
        &mut self,
        mem: &M,
        pool: PoolRef,
        stream: Stream,
        size: usize,
    ) -> Result<Option<BlockId>, AllocError> {
        let allocatable = |s: &Self, id: Option<BlockId>| {
            id.filter(|&b| matches!(s.arena[b].state, BlockState::Free | BlockState::Unmapped))
        };
        let has_room = |s: &Self, start: BlockId| {
            let (mut bytes, mut cursor) = (0usize, Some(start));
            while bytes < size {
                let Some(b) = allocatable(s, cursor) else { break };
                bytes += s.arena[b].size;
                cursor = s.arena[b].next;
            }
            bytes >= size
        };
        let unmapped = self.pool(pool).unmapped.range((stream, 0)..);
        for (&(s, _), &u) in unmapped {
            if s != stream {
                break;
            }
            let c = allocatable(self, self.arena[u].prev).unwrap_or(u);
            if has_room(self, c) {
                return Ok(Some(c));
            }
        }
        self.reserve_segment(mem, pool, stream)
    }

    /// A new expandable segment of `stream` and `pool` with address space for 9/8 of the
    /// device's memory, all unmapped (PyTorch's `ExpandableSegment` constructor).
    fn reserve_segment(
        &mut self,
        mem: &M,
        pool: PoolRef,
        stream: Stream,
    ) -> Result<Option<BlockId>, AllocError> {
        let page = page_size(pool) as u64;
        let total = mem.mem_info().total;
        let pages = total.saturating_add(total / 8).div_ceil(page);
        let Some(range) = pages.checked_mul(page).and_then(|r| usize::try_from(r).ok()) else {
            return Ok(None);
        };
        let base = match mem.reserve(range) {
            Ok(base) => base,
            Err(RawError::OutOfMemory { .. }) => return Ok(None),
            Err(e) => return Err(AllocError::Unsupported(format!("expandable segments: {e}"))),
        };
        let id = self.arena.insert(Block {
            ptr: base,
            size: range,
            requested: 0,
            stream,
            pool,
            prev: None,
            next: None,
            state: BlockState::Unmapped,
            segment: base,
            expandable: true,
            pending_events: 0,
            gc_base: 0,
        });
        self.segments.insert(base, Segment { mapped: 0, stream, pool, expandable: true, head: id });
        self.pool_mut(pool).unmapped.insert((stream, base), id);
        self.expandable_live += 1;
        Ok(Some(id))
    }

    /// `map_block`: maps whole pages for the first `size` bytes of unmapped block `id`; the
    /// mapped part becomes a free block (in its pool), merged with free neighbours. Returns
    /// the merged block, or `None` when the device has no room.
    fn map_block(
        &mut self,
        mem: &M,
        id: BlockId,
        size: usize,
    ) -> Result<Option<BlockId>, AllocError> {
        let b = &self.arena[id];
        debug_assert!(b.state == BlockState::Unmapped && size <= b.size);
        let (ptr, pool, stream, segment) = (b.ptr, b.pool, b.stream, b.segment);
        let map_size = size.next_multiple_of(page_size(pool)).min(b.size);
        // SAFETY: `[ptr, ptr + map_size)` starts at a page boundary of the segment (unmapped
        // blocks start and end on pages) and lies in the unmapped block `id` of a range this
        // allocator reserved.
        match unsafe { mem.map(ptr, map_size) } {
            Ok(()) => {}
            Err(RawError::OutOfMemory { .. }) => return Ok(None),
            Err(e) => return Err(AllocError::Device(e.to_string())),
        }
        self.pool_mut(pool).unmapped.remove(&(stream, ptr));
        if self.arena[id].size > map_size {
            let rest = self.split_off(id, map_size, BlockState::Unmapped);
            let rest_ptr = self.arena[rest].ptr;
            self.pool_mut(pool).unmapped.insert((stream, rest_ptr), rest);
        }
        self.arena[id].state = BlockState::Free;
        let mut merged = id;
        if let Some(p) = self.free_neighbour(self.arena[id].prev) {
            let key = self.key_of(p);
            self.pool_mut(pool).free.remove(&key);
            self.absorb_next(p);
            merged = p;
        }
        if let Some(n) = self.free_neighbour(self.arena[merged].next) {
            let key = self.key_of(n);
            self.pool_mut(pool).free.remove(&key);
            self.absorb_next(merged);
        }
        let gc_base = self.pool(pool).gc_calls;
        self.arena[merged].gc_base = gc_base;
        let key = self.key_of(merged);
        self.pool_mut(pool).free.insert(key, merged);
        self.stats.reserved_bytes.increase(pool, map_size as u64);
        self.stats.num_device_alloc += 1;
        self.segments.get_mut(&segment).expect("block's segment exists").mapped += map_size;
        self.trace.record(TraceAction::SegmentMap, ptr, map_size, stream);
        Ok(Some(merged))
    }

    fn free_neighbour(&self, id: Option<BlockId>) -> Option<BlockId> {
        id.filter(|&n| self.arena[n].state == BlockState::Free)
    }

    /// `unmap_block`: unmaps the whole pages inside free block `id` (in its pool); partial
    /// pages at either end stay free blocks. Returns the block that now holds the unmapped
    /// range (merged with unmapped neighbours), or `id` when no whole page was inside.
    pub(crate) fn unmap_block(&mut self, mem: &M, id: BlockId) -> BlockId {
        let b = &self.arena[id];
        let (ptr, size, pool, stream, segment) = (b.ptr, b.size, b.pool, b.stream, b.segment);
        let page = page_size(pool) as u64;
        let offset = ptr - segment;
        let lo = segment + offset.next_multiple_of(page);
        let hi = segment + (offset + size as u64) / page * page;
        if hi <= lo {
            return id;
        }
        self.pool_mut(pool).free.remove(&(stream, size, ptr));
        // `id` keeps the lowest piece, so a segment's head never changes.
        let mut mid = id;
        if lo > ptr {
            mid = self.split_off(id, (lo - ptr) as usize, BlockState::Free);
            let gc_base = self.pool(pool).gc_calls;
            self.arena[id].gc_base = gc_base;
            self.pool_mut(pool).free.insert((stream, (lo - ptr) as usize, ptr), id);
        }
        if hi < ptr + size as u64 {
            let tail = self.split_off(mid, (hi - lo) as usize, BlockState::Free);
            let gc_base = self.pool(pool).gc_calls;
            self.arena[tail].gc_base = gc_base;
            let tail_size = self.arena[tail].size;
            self.pool_mut(pool).free.insert((stream, tail_size, hi), tail);
        }
        let bytes = (hi - lo) as usize;
        self.arena[mid].state = BlockState::Unmapped;
        let mut merged = mid;
        if let Some(p) =
            self.arena[mid].prev.filter(|&p| self.arena[p].state == BlockState::Unmapped)
        {
            let pptr = self.arena[p].ptr;
            self.pool_mut(pool).unmapped.remove(&(stream, pptr));
            self.absorb_next(p);
            merged = p;
        }
        if let Some(n) =
            self.arena[merged].next.filter(|&n| self.arena[n].state == BlockState::Unmapped)
        {
            let nptr = self.arena[n].ptr;
            self.pool_mut(pool).unmapped.remove(&(stream, nptr));
            self.absorb_next(merged);
        }
        let mptr = self.arena[merged].ptr;
        self.pool_mut(pool).unmapped.insert((stream, mptr), merged);
        // SAFETY: `[lo, hi)` is whole pages of the segment, mapped, and inside a free block
        // with no pending events, so no work uses it.
        unsafe { mem.unmap(lo, bytes) };
        self.stats.reserved_bytes.decrease(pool, bytes as u64);
        self.count_private_malloc(pool, false);
        self.stats.num_device_free += 1;
        self.segments.get_mut(&segment).expect("block's segment exists").mapped -= bytes;
        self.trace.record(TraceAction::SegmentUnmap, lo, bytes, stream);
        merged
    }

    /// `release_expandable_segment`: gives back the address space of a segment whose only
    /// block is unmapped.
    pub(crate) fn release_expandable_segment(&mut self, mem: &M, id: BlockId) {
        let b = &self.arena[id];
        debug_assert!(b.state == BlockState::Unmapped && !b.is_split());
        let (base, size, pool, stream) = (b.ptr, b.size, b.pool, b.stream);
        self.pool_mut(pool).unmapped.remove(&(stream, base));
        self.arena.remove(id);
        self.segments.remove(&base);
        self.expandable_live -= 1;
        // SAFETY: the range was reserved by `mem.reserve(size)` at `base` and nothing in it
        // is mapped any more.
        unsafe { mem.release(base, size) };
    }

    /// Splits block `id` at `offset`: `id` keeps the front, a new block of state `state`
    /// takes the rest and is returned. Pool membership is the caller's business.
    fn split_off(&mut self, id: BlockId, offset: usize, state: BlockState) -> BlockId {
        let b = &self.arena[id];
        debug_assert!(offset > 0 && offset < b.size);
        let rest = Block {
            ptr: b.ptr + offset as u64,
            size: b.size - offset,
            requested: 0,
            stream: b.stream,
            pool: b.pool,
            prev: Some(id),
            next: b.next,
            state,
            segment: b.segment,
            expandable: b.expandable,
            pending_events: 0,
            gc_base: b.gc_base,
        };
        let next = rest.next;
        let rid = self.arena.insert(rest);
        if let Some(n) = next {
            self.arena[n].prev = Some(rid);
        }
        let b = &mut self.arena[id];
        b.next = Some(rid);
        b.size = offset;
        rid
    }
}
