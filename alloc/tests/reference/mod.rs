//! A reference model of PyTorch's CUDA caching allocator, written from
//! `c10/cuda/CUDACachingAllocator.cpp` (`DeviceCachingAllocator`, PyTorch main), not from
//! vram's code. It keeps PyTorch's own data structures: heap blocks linked by `prev`/`next`,
//! pools as ordered sets by (stream, size, address), an event queue, and statistics as a map
//! with PyTorch's key names, and expandable segments as `ExpandableSegment` keeps them. Each
//! method names the C++ function it follows. CUDA graph pools are outside the model.
//!
//! The simulated device hands out fresh addresses the way `vram_alloc::VirtualMemory` does
//! (from 0x7000_0000_0000, spans rounded up to 2 MiB), so layouts compare address for address;
//! its streams complete events as `vram_alloc`'s simulated streams do (immediately unless the
//! stream is held). Where PyTorch's order is unspecified (events of different streams are kept
//! in a hash map), the model takes events in the order they were recorded.

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

const K_MIN_BLOCK_SIZE: usize = 512;
const K_SMALL_SIZE: usize = 1 << 20;
const K_SMALL_BUFFER: usize = 2 << 20;
const K_LARGE_BUFFER: usize = 20 << 20;
const K_MIN_LARGE_ALLOC: usize = 10 << 20;
const K_ROUND_LARGE: usize = 2 << 20;
const ONE_EXA_BYTES: usize = 1 << 60;

/// The settings the model understands.
pub struct RefConfig {
    /// `max_split_size` in bytes (`usize::MAX` when unset).
    pub max_split_size: usize,
    /// `max_non_split_rounding_size` in bytes.
    pub max_non_split_rounding: usize,
    /// `roundup_power2_divisions(size)`: divisions for a size (0 or 1: none).
    pub divisions: Box<dyn Fn(usize) -> usize>,
    /// `garbage_collection_threshold` (0 when unset).
    pub gc_threshold: f64,
    /// `per_process_memory_fraction` (None when unset).
    pub fraction: Option<f64>,
    /// `expandable_segments`.
    pub expandable: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum PoolId {
    Small,
    Large,
}

#[derive(Debug)]
struct Block {
    stream: u64,
    stream_uses: BTreeSet<u64>,
    size: usize,
    requested_size: usize,
    pool: PoolId,
    ptr: u64,
    allocated: bool,
    prev: Option<usize>,
    next: Option<usize>,
    event_count: u32,
    gc_count_base: i64,
    /// Whether memory is behind the block (always, outside expandable segments).
    mapped: bool,
    /// The expandable segment the block lies in.
    expandable_segment: Option<usize>,
}

#[derive(Default)]
struct BlockPool {
    /// (stream, size, ptr) -> block: `BlockComparatorSize`.
    blocks: BTreeSet<(u64, usize, u64, usize)>,
    /// (stream, ptr) -> unmapped block: `BlockComparatorAddress`.
    unmapped: BTreeSet<(u64, u64, usize)>,
    get_free_blocks_call_count: i64,
}

/// `ExpandableSegment`: reserved address space in pages of `segment_size`.
struct ExpandableSegment {
    ptr: u64,
    segment_size: usize,
    max_handles: usize,
}

/// The outcome of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A block at this address (0 for a 0-byte request).
    Ptr(u64),
    /// `OutOfMemoryError` from `malloc` (counted in `num_ooms`).
    Oom,
    /// Refused before `malloc` (1 EiB or more; nothing counted).
    TooLarge,
}

/// A segment as `snapshot()` shows it: address, size, stream, small or large, and its blocks
/// as (address, size, state).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefSegment {
    pub address: u64,
    pub total_size: u64,
    pub stream: u64,
    pub is_large: bool,
    pub blocks: Vec<(u64, u64, &'static str)>,
}

/// Simulated device: capacity, fresh addresses, stream progress.
struct Device {
    total: u64,
    used: u64,
    next_address: u64,
    /// stream -> (submitted, completed, held)
    streams: HashMap<u64, (u64, u64, bool)>,
}

impl Device {
    fn malloc(&mut self, size: usize) -> Option<u64> {
        let size = size as u64;
        if self.used.checked_add(size).is_none_or(|u| u > self.total) {
            return None;
        }
        self.used += size;
        let ptr = self.next_address;
        self.next_address += size.div_ceil(2 << 20) * (2 << 20);
        Some(ptr)
    }

    fn free(&mut self, size: usize) {
        self.used -= size as u64;
    }

    /// `cuMemAddressReserve`: addresses only.
    fn reserve(&mut self, size: usize) -> u64 {
        let ptr = self.next_address;
        self.next_address += (size as u64).div_ceil(2 << 20) * (2 << 20);
        ptr
    }

    /// `cuMemCreate` + `cuMemMap` of `size` bytes; false when the device is full.
    fn map(&mut self, size: usize) -> bool {
        let size = size as u64;
        if self.used.checked_add(size).is_none_or(|u| u > self.total) {
            return false;
        }
        self.used += size;
        true
    }

    fn record(&mut self, stream: u64) -> (u64, u64) {
        let s = self.streams.entry(stream).or_insert((0, 0, false));
        s.0 += 1;
        if !s.2 {
            s.1 = s.0;
        }
        (stream, s.0)
    }

    fn query(&self, event: (u64, u64)) -> bool {
        self.streams.get(&event.0).is_none_or(|s| s.1 >= event.1)
    }

    fn synchronize(&mut self, event: (u64, u64)) {
        let s = self.streams.entry(event.0).or_insert((0, 0, false));
        s.1 = s.1.max(event.1);
    }
}

/// The model.
pub struct Reference {
    cfg: RefConfig,
    blocks: HashMap<usize, Block>,
    next_id: usize,
    small_blocks: BlockPool,
    large_blocks: BlockPool,
    active_blocks: BTreeSet<usize>,
    /// Outstanding events, in the order they were recorded: ((stream, ticket), block).
    cuda_events: VecDeque<((u64, u64), usize)>,
    total_allocated_memory: u64,
    allowed_memory_maximum: Option<u64>,
    /// Statistics by PyTorch's key names (`allocated_bytes.all.current`, ...).
    pub stats: BTreeMap<String, i64>,
    device: Device,
    /// Live blocks by address (`NativeCachingAllocator::allocated_blocks`).
    allocated_blocks: HashMap<u64, usize>,
    expandable_segments: HashMap<usize, ExpandableSegment>,
    next_segment: usize,
}

const ARRAYS: [&str; 9] = [
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
];

impl Reference {
    /// A model of an allocator on a device of `total` bytes.
    pub fn new(cfg: RefConfig, total: u64) -> Self {
        let mut stats = BTreeMap::new();
        for name in ARRAYS {
            for pool in ["all", "small_pool", "large_pool"] {
                for field in ["current", "peak", "allocated", "freed"] {
                    stats.insert(format!("{name}.{pool}.{field}"), 0);
                }
            }
        }
        for name in ["oversize_allocations", "oversize_segments"] {
            for field in ["current", "peak", "allocated", "freed"] {
                stats.insert(format!("{name}.{field}"), 0);
            }
        }
        for name in [
            "num_alloc_retries",
            "num_ooms",
            "num_sync_all_streams",
            "num_device_alloc",
            "num_device_free",
        ] {
            stats.insert(name.to_string(), 0);
        }
        let max_split = i64::try_from(cfg.max_split_size).unwrap_or(-1);
        stats.insert("max_split_size".to_string(), max_split);
        // `setMemoryFraction`: static_cast<size_t>(fraction * total).
        let allowed_memory_maximum = cfg.fraction.map(|f| (f * total as f64) as u64);
        Reference {
            cfg,
            blocks: HashMap::new(),
            next_id: 0,
            small_blocks: BlockPool::default(),
            large_blocks: BlockPool::default(),
            active_blocks: BTreeSet::new(),
            cuda_events: VecDeque::new(),
            total_allocated_memory: 0,
            allowed_memory_maximum,
            stats,
            device: Device {
                total,
                used: 0,
                next_address: 0x7000_0000_0000,
                streams: HashMap::new(),
            },
            allocated_blocks: HashMap::new(),
            expandable_segments: HashMap::new(),
            next_segment: 0,
        }
    }

    // ---- statistics -----------------------------------------------------------------

    fn bump(&mut self, key: &str, delta: i64) {
        *self.stats.get_mut(key).expect("known key") += delta;
    }

    fn increase_stat(&mut self, prefix: &str, amount: usize) {
        let amount = amount as i64;
        self.bump(&format!("{prefix}.current"), amount);
        let current = self.stats[&format!("{prefix}.current")];
        let peak = self.stats.get_mut(&format!("{prefix}.peak")).expect("known key");
        *peak = (*peak).max(current);
        self.bump(&format!("{prefix}.allocated"), amount);
    }

    fn decrease_stat(&mut self, prefix: &str, amount: usize) {
        self.bump(&format!("{prefix}.current"), -(amount as i64));
        self.bump(&format!("{prefix}.freed"), amount as i64);
    }

    /// `for_each_selected_stat_type(get_stat_types_for_pool(pool), increase_stat)`.
    fn increase_array(&mut self, name: &str, pool: PoolId, amount: usize) {
        self.increase_stat(&format!("{name}.all"), amount);
        self.increase_stat(&format!("{name}.{}", pool_key(pool)), amount);
    }

    fn decrease_array(&mut self, name: &str, pool: PoolId, amount: usize) {
        self.decrease_stat(&format!("{name}.all"), amount);
        self.decrease_stat(&format!("{name}.{}", pool_key(pool)), amount);
    }

    fn pool(&mut self, pool: PoolId) -> &mut BlockPool {
        match pool {
            PoolId::Small => &mut self.small_blocks,
            PoolId::Large => &mut self.large_blocks,
        }
    }

    fn key(&self, id: usize) -> (u64, usize, u64, usize) {
        let b = &self.blocks[&id];
        (b.stream, b.size, b.ptr, id)
    }

    /// `BlockPool::insert_into_blocks`.
    fn insert_into_blocks(&mut self, id: usize) {
        let pool = self.blocks[&id].pool;
        let count = self.pool(pool).get_free_blocks_call_count;
        self.blocks.get_mut(&id).unwrap().gc_count_base = count;
        let key = self.key(id);
        assert!(self.pool(pool).blocks.insert(key));
    }

    fn erase_from_blocks(&mut self, id: usize) {
        let pool = self.blocks[&id].pool;
        let key = self.key(id);
        assert!(self.pool(pool).blocks.remove(&key));
    }

    fn new_block(&mut self, b: Block) -> usize {
        let id = self.next_id;
        self.next_id += 1;
        self.blocks.insert(id, b);
        id
    }

    fn is_split(&self, id: usize) -> bool {
        let b = &self.blocks[&id];
        b.prev.is_some() || b.next.is_some()
    }

    fn gc_on(&self) -> bool {
        self.allowed_memory_maximum.is_some() && self.cfg.gc_threshold > 0.0
    }

    // ---- the public operations --------------------------------------------------------

    /// `NativeCachingAllocator::allocate` on `stream`.
    pub fn allocate(&mut self, size: usize, stream: u64) -> Outcome {
        if size >= ONE_EXA_BYTES {
            return Outcome::TooLarge;
        }
        if size == 0 {
            return Outcome::Ptr(0);
        }
        match self.malloc(size, stream) {
            Some(id) => {
                let ptr = self.blocks[&id].ptr;
                self.allocated_blocks.insert(ptr, id);
                Outcome::Ptr(ptr)
            }
            None => Outcome::Oom,
        }
    }

    /// `NativeCachingAllocator::free`.
    pub fn free(&mut self, ptr: u64) {
        if ptr == 0 {
            return;
        }
        let id = self.allocated_blocks.remove(&ptr).expect("a live block");
        self.device_free(id);
    }

    /// `recordStream`.
    pub fn record_stream(&mut self, ptr: u64, stream: u64) {
        if ptr == 0 {
            return;
        }
        let id = self.allocated_blocks[&ptr];
        let b = self.blocks.get_mut(&id).unwrap();
        if stream != b.stream {
            b.stream_uses.insert(stream);
        }
    }

    /// `emptyCache`.
    pub fn empty_cache(&mut self) {
        self.release_cached_blocks();
    }

    /// Keeps events recorded on `stream` pending.
    pub fn hold(&mut self, stream: u64) {
        self.device.streams.entry(stream).or_insert((0, 0, false)).2 = true;
    }

    /// Completes the work of `stream`.
    pub fn release(&mut self, stream: u64) {
        let s = self.device.streams.entry(stream).or_insert((0, 0, false));
        s.2 = false;
        s.1 = s.0;
    }

    // ---- DeviceCachingAllocator --------------------------------------------------------

    /// `DeviceCachingAllocator::malloc`.
    fn malloc(&mut self, orig_size: usize, stream: u64) -> Option<usize> {
        self.process_events();
        let size = self.round_size(orig_size);
        let pool = if size <= K_SMALL_SIZE { PoolId::Small } else { PoolId::Large };
        let alloc_size = get_allocation_size(size);
        let mut block = self.get_free_block(pool, stream, size);
        if block.is_none() {
            if self.gc_on() {
                self.garbage_collect_cached_blocks();
            }
            block = self.alloc_block(pool, stream, alloc_size, size, false);
            if block.is_none() && self.release_available_cached_blocks(pool, stream, size) {
                block = self.alloc_block(pool, stream, alloc_size, size, false);
            }
            if block.is_none() && self.release_cached_blocks() {
                block = self.alloc_block(pool, stream, alloc_size, size, true);
            }
        }
        let Some(block) = block else {
            self.bump("num_ooms", 1);
            return None;
        };
        let split = self.should_split(block, size);
        Some(self.alloc_found_block(block, size, orig_size, split))
    }

    /// `round_size` and `roundup_power2_next_division`.
    fn round_size(&self, size: usize) -> usize {
        if size < K_MIN_BLOCK_SIZE {
            return K_MIN_BLOCK_SIZE;
        }
        let divisions = (self.cfg.divisions)(size);
        if divisions > 1 && size > K_MIN_BLOCK_SIZE * divisions {
            if size.is_power_of_two() {
                return size;
            }
            let power2_floor = 1usize << (63 - size.leading_zeros());
            let power2_division = power2_floor >> (63 - divisions.leading_zeros());
            if power2_division == 0 {
                return power2_floor << 1;
            }
            let round_size_floor = size & !(power2_division - 1);
            if round_size_floor == size { size } else { round_size_floor + power2_division }
        } else {
            K_MIN_BLOCK_SIZE * size.div_ceil(K_MIN_BLOCK_SIZE)
        }
    }

    /// `get_free_block` (without expandable segments).
    fn get_free_block(&mut self, pool: PoolId, stream: u64, size: usize) -> Option<usize> {
        if self.gc_on() {
            self.pool(pool).get_free_blocks_call_count += 1;
        }
        let ordered: Vec<(u64, usize, u64, usize)> =
            self.pool(pool).blocks.range((stream, size, 0, 0)..).copied().collect();
        let mut it = 0;
        let &(s, _, _, id) = ordered.first()?;
        if s != stream {
            return None;
        }
        if self.blocks[&id].expandable_segment.is_some() {
            if self.cfg.expandable {
                let expandable_size = |r: &Self, id: usize| {
                    let b = &r.blocks[&id];
                    b.size + b.next.filter(|n| !r.blocks[n].mapped).map_or(0, |n| r.blocks[&n].size)
                };
                while self.blocks[&ordered[it].3].expandable_segment.is_some()
                    && it + 1 < ordered.len()
                    && ordered[it + 1].0 == stream
                    && expandable_size(self, ordered[it + 1].3)
                        < expandable_size(self, ordered[it].3)
                {
                    it += 1;
                }
            } else {
                loop {
                    it += 1;
                    if !(it < ordered.len()
                        && self.blocks[&ordered[it].3].expandable_segment.is_some()
                        && ordered[it].0 == stream)
                    {
                        break;
                    }
                }
                if it == ordered.len() || ordered[it].0 != stream {
                    return None;
                }
            }
        }
        let (s, bsize, ptr, id) = ordered[it];
        let max_split = self.cfg.max_split_size;
        if size < max_split && bsize >= max_split {
            return None;
        }
        if size >= max_split && bsize >= size + self.cfg.max_non_split_rounding {
            return None;
        }
        self.pool(pool).blocks.remove(&(s, bsize, ptr, id));
        Some(id)
    }

    /// `alloc_block`.
    fn alloc_block(
        &mut self,
        pool: PoolId,
        stream: u64,
        size: usize,
        request: usize,
        is_retry: bool,
    ) -> Option<usize> {
        if is_retry {
            self.bump("num_alloc_retries", 1);
        }
        if let Some(max) = self.allowed_memory_maximum
            && self.total_allocated_memory + size as u64 > max
        {
            return None;
        }
        if self.cfg.expandable {
            return self.try_allocate_expandable_block(pool, stream, request);
        }
        let ptr = self.device.malloc(size)?;
        self.total_allocated_memory += size as u64;
        let id = self.new_block(Block {
            stream,
            stream_uses: BTreeSet::new(),
            size,
            requested_size: 0,
            pool,
            ptr,
            allocated: false,
            prev: None,
            next: None,
            event_count: 0,
            gc_count_base: 0,
            mapped: true,
            expandable_segment: None,
        });
        self.increase_array("segment", pool, 1);
        self.increase_array("reserved_bytes", pool, size);
        if size >= self.cfg.max_split_size {
            self.increase_stat("oversize_segments", 1);
        }
        self.bump("num_device_alloc", 1);
        Some(id)
    }

    /// `should_split` (without expandable segments).
    fn should_split(&self, id: usize, size: usize) -> bool {
        let b = &self.blocks[&id];
        let remaining = b.size - size;
        if b.pool == PoolId::Small || self.cfg.expandable {
            remaining >= K_MIN_BLOCK_SIZE
        } else {
            size < self.cfg.max_split_size && remaining > K_SMALL_SIZE
        }
    }

    /// `alloc_found_block`.
    fn alloc_found_block(
        &mut self,
        id: usize,
        size: usize,
        orig_size: usize,
        split_remainder: bool,
    ) -> usize {
        let pool = self.blocks[&id].pool;
        let already_split = self.is_split(id);
        let expandable = self.blocks[&id].expandable_segment;
        let mut block = id;
        if split_remainder {
            let remaining = id;
            let (stream, ptr, prev) = {
                let r = &self.blocks[&remaining];
                (r.stream, r.ptr, r.prev)
            };
            block = self.new_block(Block {
                stream,
                stream_uses: BTreeSet::new(),
                size,
                requested_size: 0,
                pool,
                ptr,
                allocated: false,
                prev,
                next: Some(remaining),
                event_count: 0,
                gc_count_base: 0,
                mapped: true,
                expandable_segment: expandable,
            });
            if let Some(p) = prev {
                self.blocks.get_mut(&p).unwrap().next = Some(block);
            }
            let r = self.blocks.get_mut(&remaining).unwrap();
            r.prev = Some(block);
            r.ptr += size as u64;
            r.size -= size;
            let remaining_size = r.size;
            self.insert_into_blocks(remaining);
            if expandable.is_some() {
                // Expandable segments stay out of `inactive_split`.
            } else if already_split {
                self.decrease_stat_pair("inactive_split_bytes", pool, size);
            } else {
                self.increase_array("inactive_split_bytes", pool, remaining_size);
                self.increase_array("inactive_split", pool, 1);
            }
        } else if already_split && expandable.is_none() {
            let bsize = self.blocks[&block].size;
            self.decrease_array("inactive_split_bytes", pool, bsize);
            self.decrease_array("inactive_split", pool, 1);
        }
        let b = self.blocks.get_mut(&block).unwrap();
        b.allocated = true;
        b.requested_size = orig_size;
        let bsize = b.size;
        self.active_blocks.insert(block);
        self.increase_array("allocation", pool, 1);
        self.increase_array("allocated_bytes", pool, bsize);
        self.increase_array("active", pool, 1);
        self.increase_array("active_bytes", pool, bsize);
        self.increase_array("requested_bytes", pool, orig_size);
        if bsize >= self.cfg.max_split_size {
            self.increase_stat("oversize_allocations", 1);
        }
        block
    }

    fn decrease_stat_pair(&mut self, name: &str, pool: PoolId, amount: usize) {
        self.decrease_array(name, pool, amount);
    }

    /// `DeviceCachingAllocator::free`.
    fn device_free(&mut self, id: usize) {
        let (pool, size) = {
            let b = self.blocks.get_mut(&id).unwrap();
            b.allocated = false;
            (b.pool, b.size)
        };
        self.decrease_array("allocation", pool, 1);
        self.decrease_array("allocated_bytes", pool, size);
        if size >= self.cfg.max_split_size {
            self.decrease_stat("oversize_allocations", 1);
        }
        if !self.blocks[&id].stream_uses.is_empty() {
            self.insert_events(id);
        } else {
            self.free_block(id);
        }
    }

    /// `insert_events`.
    fn insert_events(&mut self, id: usize) {
        let streams = std::mem::take(&mut self.blocks.get_mut(&id).unwrap().stream_uses);
        for stream in streams {
            let event = self.device.record(stream);
            self.blocks.get_mut(&id).unwrap().event_count += 1;
            self.cuda_events.push_back((event, id));
        }
    }

    /// `free_block`.
    fn free_block(&mut self, id: usize) {
        let (pool, original_block_size, requested_size, prev, next) = {
            let b = &self.blocks[&id];
            assert!(!b.allocated && b.event_count == 0 && b.stream_uses.is_empty());
            (b.pool, b.size, b.requested_size, b.prev, b.next)
        };
        let mut net_blocks: i64 = 0;
        let mut net_size: i64 = 0;
        for candidate in [prev, next] {
            let subsumed = self.try_merge_blocks(id, candidate);
            if subsumed > 0 {
                net_blocks -= 1;
                net_size -= subsumed as i64;
            }
        }
        self.active_blocks.remove(&id);
        self.insert_into_blocks(id);
        if self.is_split(id) {
            net_blocks += 1;
            net_size += self.blocks[&id].size as i64;
        }
        let expandable = self.blocks[&id].expandable_segment.is_some();
        for (name, net) in [("inactive_split", net_blocks), ("inactive_split_bytes", net_size)] {
            if expandable {
                // Expandable segments stay out of `inactive_split`.
            } else if net > 0 {
                self.increase_array(name, pool, net as usize);
            } else if net < 0 {
                self.decrease_array(name, pool, (-net) as usize);
            }
        }
        self.decrease_array("active", pool, 1);
        self.decrease_array("active_bytes", pool, original_block_size);
        self.decrease_array("requested_bytes", pool, requested_size);
    }

    /// `try_merge_blocks`: returns the subsumed size, 0 when `src` cannot merge.
    fn try_merge_blocks(&mut self, dst: usize, src: Option<usize>) -> usize {
        let Some(src) = src else { return 0 };
        {
            let s = &self.blocks[&src];
            if s.allocated
                || s.event_count > 0
                || !s.stream_uses.is_empty()
                || s.mapped != self.blocks[&dst].mapped
            {
                return 0;
            }
        }
        if self.blocks[&src].mapped {
            self.erase_from_blocks(src);
        } else {
            let (pool, key) = self.unmapped_key(src);
            assert!(self.pool(pool).unmapped.remove(&key));
        }
        let s = self.blocks.remove(&src).unwrap();
        let d_prev = self.blocks[&dst].prev;
        if d_prev == Some(src) {
            let d = self.blocks.get_mut(&dst).unwrap();
            d.ptr = s.ptr;
            d.prev = s.prev;
            if let Some(p) = s.prev {
                self.blocks.get_mut(&p).unwrap().next = Some(dst);
            }
        } else {
            let d = self.blocks.get_mut(&dst).unwrap();
            d.next = s.next;
            if let Some(n) = s.next {
                self.blocks.get_mut(&n).unwrap().prev = Some(dst);
            }
        }
        self.blocks.get_mut(&dst).unwrap().size += s.size;
        s.size
    }

    /// `process_events`.
    fn process_events(&mut self) {
        let mut i = 0;
        while i < self.cuda_events.len() {
            let (event, id) = self.cuda_events[i];
            if self.device.query(event) {
                self.cuda_events.remove(i);
                self.event_done(id);
            } else {
                i += 1;
            }
        }
    }

    fn event_done(&mut self, id: usize) {
        let b = self.blocks.get_mut(&id).unwrap();
        b.event_count -= 1;
        if b.event_count == 0 {
            self.free_block(id);
        }
    }

    /// `synchronize_and_free_events`.
    fn synchronize_and_free_events(&mut self) {
        self.bump("num_sync_all_streams", 1);
        while let Some((event, id)) = self.cuda_events.pop_front() {
            self.device.synchronize(event);
            self.event_done(id);
        }
    }

    /// `release_available_cached_blocks`.
    fn release_available_cached_blocks(&mut self, pool: PoolId, stream: u64, size: usize) -> bool {
        let max_split = self.cfg.max_split_size;
        if max_split == usize::MAX {
            return false;
        }
        let key_size = size.max(max_split);
        let ordered: Vec<(u64, usize, u64, usize)> =
            self.pool(pool).blocks.iter().copied().collect();
        let at = ordered.partition_point(|k| (k.0, k.1, k.2, k.3) < (stream, key_size, 0, 0));
        if at == ordered.len() || ordered[at].0 != stream {
            if at == 0 {
                return false;
            }
            let mut total_released = 0;
            let mut i = at - 1;
            loop {
                let k = ordered[i];
                if !(total_released < key_size && k.1 >= max_split && k.0 == stream) {
                    break;
                }
                total_released += k.1;
                self.release_block(k.3);
                if i == 0 {
                    break;
                }
                i -= 1;
            }
            if total_released < key_size {
                return false;
            }
        } else {
            self.release_block(ordered[at].3);
        }
        true
    }

    /// `release_cached_blocks`.
    fn release_cached_blocks(&mut self) -> bool {
        self.synchronize_and_free_events();
        self.release_blocks(PoolId::Large);
        self.release_blocks(PoolId::Small);
        true
    }

    /// `release_blocks` (without expandable segments).
    fn release_blocks(&mut self, pool: PoolId) {
        let ordered: Vec<usize> = self.pool(pool).blocks.iter().map(|k| k.3).collect();
        let mut to_unmap = Vec::new();
        for id in ordered {
            if self.blocks[&id].expandable_segment.is_some() {
                to_unmap.push(id);
            } else if !self.is_split(id) {
                self.release_block(id);
            }
        }
        for id in to_unmap {
            self.unmap_block(id);
            if !self.is_split(id) {
                self.release_expandable_segment(id);
            }
        }
    }

    /// `release_block`.
    fn release_block(&mut self, id: usize) {
        self.bump("num_device_free", 1);
        let (pool, size) = (self.blocks[&id].pool, self.blocks[&id].size);
        self.device.free(size);
        self.total_allocated_memory -= size as u64;
        self.decrease_array("segment", pool, 1);
        self.decrease_array("reserved_bytes", pool, size);
        if size >= self.cfg.max_split_size {
            self.decrease_stat("oversize_segments", 1);
        }
        self.erase_from_blocks(id);
        self.blocks.remove(&id);
    }

    /// `garbage_collect_cached_blocks`.
    fn garbage_collect_cached_blocks(&mut self) {
        let allowed = self.allowed_memory_maximum.expect("gc needs a fraction");
        let gc_threshold = (self.cfg.gc_threshold * allowed as f64) as u64;
        if self.total_allocated_memory <= gc_threshold {
            return;
        }
        let target_size = self.total_allocated_memory - gc_threshold;
        let mut gc_reclaimed = 0u64;
        let now = self.large_blocks.get_free_blocks_call_count;
        let gc_count = |b: &Block| (now - b.gc_count_base) as u64;
        let mut total_age = 0u64;
        let mut freeable_block_count = 0u64;
        for k in &self.large_blocks.blocks {
            if !self.is_split(k.3) {
                total_age += gc_count(&self.blocks[&k.3]);
                freeable_block_count += 1;
            }
        }
        if freeable_block_count == 0 {
            return;
        }
        let mut block_freed = true;
        while gc_reclaimed < target_size && block_freed && freeable_block_count > 0 {
            let age_threshold = total_age as f64 / freeable_block_count as f64;
            block_freed = false;
            let ordered: Vec<usize> = self.large_blocks.blocks.iter().map(|k| k.3).collect();
            for id in ordered {
                if !self.is_split(id) && gc_count(&self.blocks[&id]) as f64 >= age_threshold {
                    block_freed = true;
                    gc_reclaimed += self.blocks[&id].size as u64;
                    total_age -= gc_count(&self.blocks[&id]);
                    freeable_block_count -= 1;
                    self.release_block(id);
                }
            }
        }
    }

    // ---- expandable segments ------------------------------------------------------------

    fn unmapped_key(&self, id: usize) -> (PoolId, (u64, u64, usize)) {
        let b = &self.blocks[&id];
        (b.pool, (b.stream, b.ptr, id))
    }

    /// `try_allocate_expandable_block`.
    fn try_allocate_expandable_block(
        &mut self,
        pool: PoolId,
        stream: u64,
        size: usize,
    ) -> Option<usize> {
        let mut candidate = self.find_expandable_block(pool, stream, size);
        if !self.blocks[&candidate].mapped {
            let want = self.blocks[&candidate].size.min(size);
            if !self.map_block(candidate, want) {
                return None;
            }
        }
        while self.blocks[&candidate].size < size {
            let remaining = size - self.blocks[&candidate].size;
            let new_candidate = self.blocks[&candidate].next.expect("room was found");
            let want = remaining.min(self.blocks[&new_candidate].size);
            if !self.map_block(new_candidate, want) {
                return None;
            }
            candidate = new_candidate;
        }
        self.erase_from_blocks(candidate);
        Some(candidate)
    }

    fn allocatable(&self, id: Option<usize>) -> bool {
        id.is_some_and(|id| {
            let b = &self.blocks[&id];
            !b.allocated && b.event_count == 0 && b.stream_uses.is_empty()
        })
    }

    /// `find_expandable_block`.
    fn find_expandable_block(&mut self, pool: PoolId, stream: u64, size: usize) -> usize {
        let unmapped: Vec<usize> = self
            .pool(pool)
            .unmapped
            .range((stream, 0, 0)..)
            .take_while(|k| k.0 == stream)
            .map(|k| k.2)
            .collect();
        for mut c in unmapped {
            let prev = self.blocks[&c].prev;
            if self.allocatable(prev) {
                c = prev.unwrap();
            }
            let (mut bytes, mut b) = (0, Some(c));
            while bytes < size && self.allocatable(b) {
                bytes += self.blocks[&b.unwrap()].size;
                b = self.blocks[&b.unwrap()].next;
            }
            if bytes >= size {
                return c;
            }
        }
        let segment_size = if pool == PoolId::Small { K_SMALL_BUFFER } else { K_LARGE_BUFFER };
        let total = self.device.total as usize;
        let max_handles = (total + total / 8).div_ceil(segment_size);
        let es_size = max_handles * segment_size;
        let ptr = self.device.reserve(es_size);
        let es = self.next_segment;
        self.next_segment += 1;
        self.expandable_segments.insert(es, ExpandableSegment { ptr, segment_size, max_handles });
        let id = self.new_block(Block {
            stream,
            stream_uses: BTreeSet::new(),
            size: es_size,
            requested_size: 0,
            pool,
            ptr,
            allocated: false,
            prev: None,
            next: None,
            event_count: 0,
            gc_count_base: 0,
            mapped: false,
            expandable_segment: Some(es),
        });
        let (pool, key) = self.unmapped_key(id);
        self.pool(pool).unmapped.insert(key);
        id
    }

    /// `map_block`.
    fn map_block(&mut self, to_map: usize, size: usize) -> bool {
        let (es, ptr, stream, pool, block_size) = {
            let b = &self.blocks[&to_map];
            (b.expandable_segment.unwrap(), b.ptr, b.stream, b.pool, b.size)
        };
        // `ExpandableSegment::map`: pages from segmentLeft(ptr) to segmentRight(ptr + size).
        let seg = &self.expandable_segments[&es];
        let begin = ((ptr - seg.ptr) as usize) / seg.segment_size;
        let end = ((ptr - seg.ptr) as usize + size).div_ceil(seg.segment_size);
        let mapped_size = (end - begin) * seg.segment_size;
        if !self.device.map(mapped_size) {
            return false;
        }
        let (p, key) = self.unmapped_key(to_map);
        assert!(self.pool(p).unmapped.remove(&key));
        self.blocks.get_mut(&to_map).unwrap().mapped = true;
        if mapped_size < block_size {
            let next = self.blocks[&to_map].next;
            let remaining = self.new_block(Block {
                stream,
                stream_uses: BTreeSet::new(),
                size: block_size - mapped_size,
                requested_size: 0,
                pool,
                ptr: ptr + mapped_size as u64,
                allocated: false,
                prev: Some(to_map),
                next,
                event_count: 0,
                gc_count_base: 0,
                mapped: false,
                expandable_segment: Some(es),
            });
            if let Some(n) = next {
                self.blocks.get_mut(&n).unwrap().prev = Some(remaining);
            }
            self.blocks.get_mut(&to_map).unwrap().next = Some(remaining);
            let (p, key) = self.unmapped_key(remaining);
            self.pool(p).unmapped.insert(key);
            self.blocks.get_mut(&to_map).unwrap().size = mapped_size;
        }
        let prev = self.blocks[&to_map].prev;
        self.try_merge_blocks(to_map, prev);
        let next = self.blocks[&to_map].next;
        self.try_merge_blocks(to_map, next);
        self.insert_into_blocks(to_map);
        self.total_allocated_memory += mapped_size as u64;
        self.increase_array("reserved_bytes", pool, mapped_size);
        self.bump("num_device_alloc", 1);
        true
    }

    /// `unmap_block`.
    fn unmap_block(&mut self, id: usize) {
        let (es, ptr, size, stream, pool, prev) = {
            let b = &self.blocks[&id];
            (b.expandable_segment.unwrap(), b.ptr, b.size, b.stream, b.pool, b.prev)
        };
        // `ExpandableSegment::unmap`: whole pages from segmentRight(ptr) to
        // segmentLeft(ptr + size).
        let seg = &self.expandable_segments[&es];
        let offset = (ptr - seg.ptr) as usize;
        let begin = offset.div_ceil(seg.segment_size);
        let end = (offset + size) / seg.segment_size;
        if begin >= end {
            return;
        }
        let unmapped_ptr = seg.ptr + (begin * seg.segment_size) as u64;
        let unmapped_size = (end - begin) * seg.segment_size;
        self.device.free(unmapped_size);
        self.erase_from_blocks(id);
        let before_size = (unmapped_ptr - ptr) as usize;
        let new_free = |r: &mut Self, at: u64, len: usize, p: Option<usize>, n: Option<usize>| {
            let f = r.new_block(Block {
                stream,
                stream_uses: BTreeSet::new(),
                size: len,
                requested_size: 0,
                pool,
                ptr: at,
                allocated: false,
                prev: p,
                next: n,
                event_count: 0,
                gc_count_base: 0,
                mapped: true,
                expandable_segment: Some(es),
            });
            if let Some(p) = p {
                r.blocks.get_mut(&p).unwrap().next = Some(f);
            }
            if let Some(n) = n {
                r.blocks.get_mut(&n).unwrap().prev = Some(f);
            }
            r.insert_into_blocks(f);
        };
        if before_size > 0 {
            new_free(self, ptr, before_size, prev, Some(id));
        }
        let after_size = size - (before_size + unmapped_size);
        if after_size > 0 {
            let next = self.blocks[&id].next;
            new_free(self, unmapped_ptr + unmapped_size as u64, after_size, Some(id), next);
        }
        let b = self.blocks.get_mut(&id).unwrap();
        b.ptr = unmapped_ptr;
        b.size = unmapped_size;
        b.mapped = false;
        let prev = self.blocks[&id].prev;
        self.try_merge_blocks(id, prev);
        let next = self.blocks[&id].next;
        self.try_merge_blocks(id, next);
        let (p, key) = self.unmapped_key(id);
        self.pool(p).unmapped.insert(key);
        self.total_allocated_memory -= unmapped_size as u64;
        self.decrease_array("reserved_bytes", pool, unmapped_size);
        self.bump("num_device_free", 1);
    }

    /// `release_expandable_segment`.
    fn release_expandable_segment(&mut self, id: usize) {
        let b = &self.blocks[&id];
        let es = b.expandable_segment.unwrap();
        let seg = &self.expandable_segments[&es];
        assert_eq!(b.size, seg.max_handles * seg.segment_size, "block disagrees with segment");
        assert!(!b.mapped);
        let (p, key) = self.unmapped_key(id);
        assert!(self.pool(p).unmapped.remove(&key));
        self.expandable_segments.remove(&es);
        self.blocks.remove(&id);
    }

    // ---- observation ------------------------------------------------------------------

    /// `snapshot()`: segments by address with their blocks.
    pub fn segments(&self) -> Vec<RefSegment> {
        let mut heads: Vec<usize> = self
            .blocks
            .iter()
            .filter(|(_, b)| b.mapped && b.prev.is_none_or(|p| !self.blocks[&p].mapped))
            .map(|(&id, _)| id)
            .collect();
        heads.sort_by_key(|id| self.blocks[id].ptr);
        heads
            .into_iter()
            .map(|head| {
                let h = &self.blocks[&head];
                let mut seg = RefSegment {
                    address: h.ptr,
                    total_size: 0,
                    stream: h.stream,
                    is_large: h.pool == PoolId::Large,
                    blocks: Vec::new(),
                };
                let mut cursor = Some(head);
                while let Some(id) = cursor.filter(|c| self.blocks[c].mapped) {
                    let b = &self.blocks[&id];
                    let state = if b.allocated {
                        "active_allocated"
                    } else if b.event_count > 0 {
                        "active_pending_free"
                    } else {
                        "inactive"
                    };
                    seg.blocks.push((b.ptr, b.size as u64, state));
                    seg.total_size += b.size as u64;
                    cursor = b.next;
                }
                seg
            })
            .collect()
    }
}

fn pool_key(pool: PoolId) -> &'static str {
    match pool {
        PoolId::Small => "small_pool",
        PoolId::Large => "large_pool",
    }
}

/// `get_allocation_size`.
fn get_allocation_size(size: usize) -> usize {
    if size <= K_SMALL_SIZE {
        K_SMALL_BUFFER
    } else if size < K_MIN_LARGE_ALLOC {
        K_LARGE_BUFFER
    } else {
        K_ROUND_LARGE * size.div_ceil(K_ROUND_LARGE)
    }
}
