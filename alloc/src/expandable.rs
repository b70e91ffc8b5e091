//! Expandable segments: one reserved address range per stream and pool that grows by
//! mapping pages at its end, so a growing workload reuses one range instead of leaving
//! stranded segments behind (PyTorch's `expandable_segments:True`).
//!
//! Blocks tile the whole reserved range; ranges with no memory behind them are `Unmapped`
//! blocks, kept in their pool's `unmapped` set. Mapping and unmapping happen in whole
//! [`PAGE_SIZE`] pages, so mapped/unmapped boundaries are page-aligned.

use crate::block::{Block, BlockId, BlockState, Segment};
use crate::error::AllocError;
use crate::memory::{DeviceMemory, PAGE_SIZE, RawError, Stream};
use crate::policy::PoolKind;
use crate::state::State;
use crate::trace::TraceAction;

impl<M: DeviceMemory> State<M> {
    /// A free block of at least `size` bytes (not in any pool) made by mapping pages into an
    /// expandable segment, or `None` when the device or the cap has no room.
    pub(crate) fn grow_expandable(
        &mut self,
        mem: &M,
        pool: PoolKind,
        stream: Stream,
        size: usize,
    ) -> Result<Option<BlockId>, AllocError> {
        // First fit by address: an unmapped range, together with the free block before it.
        let found = self
            .pool(pool)
            .unmapped
            .range((stream, 0)..)
            .take_while(|((s, _), _)| *s == stream)
            .map(|(_, &id)| id)
            .collect::<Vec<_>>()
            .into_iter()
            .find_map(|u| {
                let before =
                    self.arena[u].prev.filter(|&p| self.arena[p].state == BlockState::Free);
                let available = self.arena[u].size + before.map_or(0, |p| self.arena[p].size);
                (available >= size).then_some((u, before))
            });
        let (u, before) = match found {
            Some(f) => f,
            None => match self.reserve_segment(mem, pool, stream, size)? {
                Some(u) => (u, None),
                None => return Ok(None),
            },
        };
        let have = before.map_or(0, |p| self.arena[p].size);
        let map_size = (size - have).next_multiple_of(PAGE_SIZE).min(self.arena[u].size);
        if !self.fits_cap(map_size) {
            return Ok(None);
        }
        let ptr = self.arena[u].ptr;
        // SAFETY: `[ptr, ptr + map_size)` is page-aligned and lies in the unmapped block `u` of
        // a range this allocator reserved.
        match unsafe { mem.map(ptr, map_size) } {
            Ok(()) => {}
            Err(RawError::OutOfMemory { .. }) => return Ok(None),
            Err(e) => return Err(AllocError::Device(e.to_string())),
        }
        self.stats.num_device_alloc += 1;
        self.stats.reserved_bytes.increase(pool, map_size as u64);
        let segment = self.arena[u].segment;
        self.segments.get_mut(&segment).expect("block's segment exists").mapped += map_size;
        self.trace.record(TraceAction::SegmentMap, ptr, map_size, stream);

        // The mapped front of `u` becomes a free block; the rest stays unmapped.
        self.pool_mut(pool).unmapped.remove(&(stream, ptr));
        if self.arena[u].size > map_size {
            let rest = self.split_off(u, map_size, BlockState::Unmapped);
            let rest_ptr = self.arena[rest].ptr;
            self.pool_mut(pool).unmapped.insert((stream, rest_ptr), rest);
        }
        self.arena[u].state = BlockState::Free;
        // Merge with free neighbours so that free space stays coalesced.
        let mut id = u;
        if let Some(n) = self.arena[u].next.filter(|&n| self.arena[n].state == BlockState::Free) {
            let nb = &self.arena[n];
            let key = (nb.stream, nb.size, nb.ptr);
            self.pool_mut(pool).free.remove(&key);
            self.absorb_next(u);
        }
        if let Some(p) = before {
            let pb = &self.arena[p];
            let key = (pb.stream, pb.size, pb.ptr);
            self.pool_mut(pool).free.remove(&key);
            self.absorb_next(p);
            id = p;
        }
        debug_assert!(self.arena[id].size >= size);
        Ok(Some(id))
    }

    /// Reserves a new expandable segment for `stream` and `pool`, large enough for `size`:
    /// the device's whole capacity, as PyTorch does, so that it never needs a second one.
    fn reserve_segment(
        &mut self,
        mem: &M,
        pool: PoolKind,
        stream: Stream,
        size: usize,
    ) -> Result<Option<BlockId>, AllocError> {
        let total = usize::try_from(mem.mem_info().total).unwrap_or(usize::MAX);
        let Some(range) = total.max(size).checked_next_multiple_of(PAGE_SIZE) else {
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
            freed_at: 0,
        });
        self.segments.insert(
            base,
            Segment { size: range, mapped: 0, stream, pool, expandable: true, head: id },
        );
        self.stats.segment.increase(pool, 1);
        self.pool_mut(pool).unmapped.insert((stream, base), id);
        self.trace.record(TraceAction::SegmentAlloc, base, 0, stream);
        Ok(Some(id))
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
            freed_at: b.freed_at,
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

    /// Unmaps every whole page inside free blocks of expandable segments, and releases
    /// segments left with nothing mapped.
    pub(crate) fn release_expandable_pages(&mut self, mem: &M) {
        let expandable: Vec<_> = self
            .segments
            .iter()
            .filter(|(_, s)| s.expandable)
            .map(|(&base, s)| (base, s.head))
            .collect();
        for (base, head) in expandable {
            let mut free = Vec::new();
            let mut cursor = Some(head);
            while let Some(id) = cursor {
                if self.arena[id].state == BlockState::Free {
                    free.push(id);
                }
                cursor = self.arena[id].next;
            }
            for id in free {
                self.unmap_free_block(mem, id);
            }
            let segment = &self.segments[&base];
            if segment.mapped == 0 {
                let (size, pool, stream, head) =
                    (segment.size, segment.pool, segment.stream, segment.head);
                debug_assert!(self.arena[head].size == size && self.arena[head].next.is_none());
                self.pool_mut(pool).unmapped.remove(&(stream, base));
                self.arena.remove(head);
                self.segments.remove(&base);
                self.stats.segment.decrease(pool, 1);
                // SAFETY: the range was reserved by `mem.reserve(size)` at `base` and nothing
                // in it is mapped any more.
                unsafe { mem.release(base, size) };
                self.trace.record(TraceAction::SegmentFree, base, 0, stream);
            }
        }
    }

    /// Unmaps the whole pages inside free block `id` (in its pool), leaving any partial pages
    /// at either end as free blocks.
    fn unmap_free_block(&mut self, mem: &M, id: BlockId) {
        let b = &self.arena[id];
        let (ptr, size, pool, stream, segment) = (b.ptr, b.size, b.pool, b.stream, b.segment);
        let page = PAGE_SIZE as u64;
        let lo = ptr.next_multiple_of(page);
        let hi = (ptr + size as u64) / page * page;
        if hi <= lo {
            return;
        }
        self.pool_mut(pool).free.remove(&(stream, size, ptr));
        // Carve [lo, hi) out as its own block `mid`; free ends go back to the pool.
        let mut mid = id;
        if lo > ptr {
            mid = self.split_off(id, (lo - ptr) as usize, BlockState::Free);
            self.pool_mut(pool).free.insert((stream, (lo - ptr) as usize, ptr), id);
        }
        if hi < ptr + size as u64 {
            let tail = self.split_off(mid, (hi - lo) as usize, BlockState::Free);
            let tail_size = self.arena[tail].size;
            self.pool_mut(pool).free.insert((stream, tail_size, hi), tail);
        }
        let bytes = (hi - lo) as usize;
        // SAFETY: `[lo, hi)` is page-aligned, mapped, and inside a free block with no pending
        // events, so no work uses it.
        unsafe { mem.unmap(lo, bytes) };
        self.stats.num_device_free += 1;
        self.stats.reserved_bytes.decrease(pool, bytes as u64);
        self.segments.get_mut(&segment).expect("block's segment exists").mapped -= bytes;
        self.trace.record(TraceAction::SegmentUnmap, lo, bytes, stream);

        // Join neighbouring unmapped ranges.
        self.arena[mid].state = BlockState::Unmapped;
        if let Some(n) =
            self.arena[mid].next.filter(|&n| self.arena[n].state == BlockState::Unmapped)
        {
            let nptr = self.arena[n].ptr;
            self.pool_mut(pool).unmapped.remove(&(stream, nptr));
            self.absorb_next(mid);
        }
        match self.arena[mid].prev.filter(|&p| self.arena[p].state == BlockState::Unmapped) {
            Some(p) => self.absorb_next(p),
            None => {
                let mptr = self.arena[mid].ptr;
                self.pool_mut(pool).unmapped.insert((stream, mptr), mid);
            }
        }
    }
}
