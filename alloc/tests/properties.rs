//! Property tests: random sequences of allocations, frees, cross-stream uses, held streams
//! and `empty_cache`, on the virtual and host backends under several configurations. After
//! every step the cache is checked against its own snapshot and a small reference model.

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::strategy::ValueTree;
use proptest::test_runner::{TestCaseError, TestRunner};
use std::collections::BTreeSet;
use vram_alloc::memory::SimStreams;
use vram_alloc::{
    AllocError, Allocation, AllocatorConfig, BlockInfo, CachingAllocator, DeviceMemory, HostMemory,
    Snapshot, Stat, StatArray, Stream, VirtualMemory,
};

const MIB: usize = 1 << 20;
const PAGE: u64 = 2 << 20;
const STREAMS: u64 = 3;
const VIRTUAL_CAPACITY: u64 = 256 << 20;
const HOST_CAPACITY: u64 = 64 << 20;

// ---- operations ------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        size: usize,
        stream: u64,
    },
    /// Drops the live handle at this index.
    Free(Index),
    RecordStream(Index, u64),
    Hold(u64),
    Release(u64),
    EmptyCache,
}

fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        3 => 1..=4096usize,
        3 => 4097..=MIB,
        3 => MIB + 1..=48 * MIB,
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => (size(), 0..STREAMS).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        4 => any::<Index>().prop_map(Op::Free),
        3 => (any::<Index>(), 0..STREAMS).prop_map(|(i, s)| Op::RecordStream(i, s)),
        1 => (0..STREAMS).prop_map(Op::Hold),
        1 => (0..STREAMS).prop_map(Op::Release),
        1 => Just(Op::EmptyCache),
    ]
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(op(), 1..100)
}

// ---- backends ----------------------------------------------------------------------------

/// A backend with simulated streams; the host one also has bytes to stamp.
trait SimBackend: DeviceMemory + Sized {
    fn sim(&self) -> &SimStreams;

    /// Writes `tag` at both ends of the allocation (where there are bytes).
    fn stamp(_a: &mut Allocation<Self>, _tag: u8) {}

    /// Whether the bytes written by `stamp` are still there.
    fn stamp_intact(_a: &Allocation<Self>, _tag: u8) -> bool {
        true
    }
}

impl SimBackend for VirtualMemory {
    fn sim(&self) -> &SimStreams {
        self.streams()
    }
}

impl SimBackend for HostMemory {
    fn sim(&self) -> &SimStreams {
        self.streams()
    }

    fn stamp(a: &mut Allocation<Self>, tag: u8) {
        let bytes = a.as_bytes_mut();
        let n = bytes.len().min(64);
        let len = bytes.len();
        bytes[..n].fill(tag);
        bytes[len - n..].fill(tag);
    }

    fn stamp_intact(a: &Allocation<Self>, tag: u8) -> bool {
        let bytes = a.as_bytes();
        let n = bytes.len().min(64);
        bytes[..n].iter().chain(&bytes[bytes.len() - n..]).all(|&b| b == tag)
    }
}

// ---- reference model ---------------------------------------------------------------------

struct Live<B: SimBackend> {
    handle: Allocation<B>,
    /// Streams other than the handle's own that were declared with `record_stream`.
    recorded: BTreeSet<u64>,
    tag: u8,
}

/// A freed block whose events wait on held streams: it must not be handed out again.
struct Pending {
    ptr: u64,
    size: u64,
    waiting: BTreeSet<u64>,
}

struct Model<B: SimBackend> {
    live: Vec<Live<B>>,
    pending: Vec<Pending>,
    held: BTreeSet<u64>,
    next_tag: u8,
}

impl<B: SimBackend> Model<B> {
    fn new() -> Self {
        Model { live: Vec::new(), pending: Vec::new(), held: BTreeSet::new(), next_tag: 1 }
    }
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.0 + b.1 && b.0 < a.0 + a.1
}

fn blocks(snap: &Snapshot) -> impl Iterator<Item = &BlockInfo> {
    snap.segments.iter().flat_map(|s| &s.blocks)
}

fn block_at(snap: &Snapshot, ptr: u64) -> Option<&BlockInfo> {
    blocks(snap).find(|b| b.address == ptr)
}

/// Sizes of the blocks that pass `keep`.
fn sizes<'a>(
    snap: &'a Snapshot,
    keep: impl Fn(&BlockInfo) -> bool + 'a,
) -> impl Iterator<Item = u64> + 'a {
    blocks(snap).filter(move |b| keep(b)).map(|b| b.size)
}

/// Allocated blocks as (address, size, requested).
fn allocated_blocks(snap: &Snapshot) -> Vec<(u64, u64, u64)> {
    blocks(snap)
        .filter(|b| b.state == "active_allocated")
        .map(|b| (b.address, b.size, b.requested_size))
        .collect()
}

/// An upper bound of the bytes one more allocation of `size` needs from the device: a new
/// segment (or, with expandable segments, the pages mapped) under any tested configuration.
fn device_need_bound(size: usize) -> u64 {
    let rounded = (size + size / 4 + 512) as u64;
    // Expandable segments map the large pool in 20 MiB pages.
    (rounded.next_multiple_of(20 << 20) + PAGE).max(20 << 20)
}

// ---- invariants --------------------------------------------------------------------------

fn check_stat(name: &str, s: &Stat) -> Result<(), TestCaseError> {
    // Every peak is at least the current value, which is never negative.
    prop_assert!(s.current >= 0, "{name}: current {} < 0", s.current);
    prop_assert!(s.peak >= s.current, "{name}: peak {} < current {}", s.peak, s.current);
    Ok(())
}

fn check_array(name: &str, a: &StatArray) -> Result<(), TestCaseError> {
    check_stat(name, &a.all)?;
    check_stat(name, &a.small_pool)?;
    check_stat(name, &a.large_pool)?;
    // The pools partition the total.
    prop_assert_eq!(a.all.current, a.small_pool.current + a.large_pool.current, "{}", name);
    Ok(())
}

fn check_invariants<B: SimBackend>(
    cache: &CachingAllocator<B>,
    model: &Model<B>,
    limit: u64,
    expandable: bool,
) -> Result<Snapshot, TestCaseError> {
    let snap = cache.snapshot();
    let stats = cache.memory_stats();

    // Blocks tile each segment without gaps or overlap, start at its base, agree with its
    // per-segment totals; free neighbours are always coalesced.
    for seg in &snap.segments {
        prop_assert!(!seg.blocks.is_empty(), "empty segment at {:#x}", seg.address);
        prop_assert_eq!(seg.blocks[0].address, seg.address);
        let mut end = seg.address;
        let (mut allocated, mut active, mut requested) = (0, 0, 0);
        for (i, b) in seg.blocks.iter().enumerate() {
            prop_assert_eq!(b.address, end, "blocks of segment {:#x} not contiguous", seg.address);
            prop_assert!(b.size > 0 && b.size % 512 == 0, "block size {}", b.size);
            end += b.size;
            match b.state.as_str() {
                "active_allocated" => {
                    allocated += b.size;
                    active += b.size;
                    requested += b.requested_size;
                    prop_assert!(b.requested_size <= b.size);
                }
                // As PyTorch's snapshot: a block waiting for other streams still counts its
                // requested bytes.
                "active_pending_free" => {
                    active += b.size;
                    requested += b.requested_size;
                    prop_assert!(b.requested_size <= b.size);
                }
                "inactive" => {
                    let next_free = seg.blocks.get(i + 1).is_some_and(|n| n.state == "inactive");
                    prop_assert!(!next_free, "uncoalesced free blocks at {:#x}", b.address);
                }
                other => prop_assert!(false, "unknown block state {}", other),
            }
        }
        prop_assert_eq!(end - seg.address, seg.total_size, "blocks do not sum to the segment");
        prop_assert_eq!(seg.allocated_size, allocated);
        prop_assert_eq!(seg.active_size, active);
        prop_assert_eq!(seg.requested_size, requested);
        prop_assert!(seg.segment_type == "small" || seg.segment_type == "large");
    }
    // Segments do not overlap each other.
    let mut spans: Vec<(u64, u64)> =
        snap.segments.iter().map(|s| (s.address, s.total_size)).collect();
    spans.sort_unstable();
    for w in spans.windows(2) {
        prop_assert!(w[0].0 + w[0].1 <= w[1].0, "segments {:#x?} and {:#x?} overlap", w[0], w[1]);
    }

    // Live allocations are 512-byte aligned, never overlap, each is an allocated block at its
    // address with its requested size, in a segment of its own stream (blocks never cross
    // streams), and every allocated block belongs to a live handle.
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    for live in &model.live {
        let h = &live.handle;
        let range = (h.ptr(), h.len().max(1) as u64);
        prop_assert_eq!(h.ptr() % 512, 0, "unaligned {:?}", h);
        prop_assert!(ranges.iter().all(|&r| !overlaps(r, range)), "{:?} overlaps", h);
        ranges.push(range);
        let seg = snap
            .segments
            .iter()
            .find(|s| s.address <= h.ptr() && h.ptr() < s.address + s.total_size);
        prop_assert!(seg.is_some(), "{:?} lies in no segment", h);
        let seg = seg.unwrap();
        prop_assert_eq!(seg.stream, h.stream().0, "{:?} in a segment of another stream", h);
        let b = seg.blocks.iter().find(|b| b.address == h.ptr());
        prop_assert!(b.is_some_and(|b| b.state == "active_allocated"), "{:?}: {:?}", h, b);
        let b = b.unwrap();
        prop_assert!(b.size >= h.len() as u64);
        prop_assert_eq!(b.requested_size, h.len() as u64);
        prop_assert!(B::stamp_intact(h, live.tag), "bytes of {:?} were overwritten", h);
    }
    prop_assert_eq!(allocated_blocks(&snap).len(), model.live.len(), "allocated blocks vs handles");

    // Blocks freed while a recorded stream is held stay pending (unavailable for reuse).
    for p in &model.pending {
        let b = block_at(&snap, p.ptr);
        prop_assert!(
            b.is_some_and(|b| b.state == "active_pending_free" && b.size == p.size),
            "block {:#x} should wait for streams {:?}: {:?}",
            p.ptr,
            p.waiting,
            b
        );
    }

    // The statistics equal what the snapshot shows, and requested, allocated <= active <=
    // reserved.
    let reserved = stats.reserved_bytes.all.current as u64;
    let allocated = stats.allocated_bytes.all.current as u64;
    let active = stats.active_bytes.all.current as u64;
    let requested = stats.requested_bytes.all.current as u64;
    prop_assert_eq!(reserved, snap.reserved_bytes());
    prop_assert_eq!(allocated, sizes(&snap, |b| b.state == "active_allocated").sum::<u64>());
    prop_assert_eq!(allocated, snap.allocated_bytes());
    prop_assert_eq!(active, sizes(&snap, |b| b.state != "inactive").sum::<u64>());
    // Requested bytes of a freed block count until its events complete (as PyTorch's
    // `free_block` takes them off), so they equal the live handles' only when none waits.
    let live_requested = model.live.iter().map(|l| l.handle.len() as u64).sum::<u64>();
    if sizes(&snap, |b| b.state == "active_pending_free").count() == 0 {
        prop_assert_eq!(requested, live_requested);
    } else {
        prop_assert!(requested >= live_requested);
    }
    prop_assert!(requested <= active && allocated <= active && active <= reserved);
    prop_assert_eq!(stats.allocation.all.current as usize, model.live.len());
    prop_assert_eq!(
        stats.active.all.current as usize,
        sizes(&snap, |b| b.state != "inactive").count()
    );
    let small: u64 =
        snap.segments.iter().filter(|s| s.segment_type == "small").map(|s| s.total_size).sum();
    prop_assert_eq!(stats.reserved_bytes.small_pool.current as u64, small);
    if !expandable {
        prop_assert_eq!(stats.segment.all.current as usize, snap.segments.len());
        // PyTorch's inactive split blocks: the free blocks of segments with several blocks.
        let split = snap.segments.iter().filter(|s| s.blocks.len() > 1).flat_map(|s| &s.blocks);
        let split: Vec<u64> = split.filter(|b| b.state == "inactive").map(|b| b.size).collect();
        prop_assert_eq!(stats.inactive_split.all.current as usize, split.len());
        prop_assert_eq!(stats.inactive_split_bytes.all.current as u64, split.iter().sum::<u64>());
    }
    for (name, a) in [
        ("allocation", &stats.allocation),
        ("segment", &stats.segment),
        ("active", &stats.active),
        ("inactive_split", &stats.inactive_split),
        ("allocated_bytes", &stats.allocated_bytes),
        ("reserved_bytes", &stats.reserved_bytes),
        ("active_bytes", &stats.active_bytes),
        ("inactive_split_bytes", &stats.inactive_split_bytes),
        ("requested_bytes", &stats.requested_bytes),
    ] {
        check_array(name, a)?;
    }
    check_stat("oversize_allocations", &stats.oversize_allocations)?;
    check_stat("oversize_segments", &stats.oversize_segments)?;

    // Reserved memory, peak included, never exceeds the cap, and the device agrees on how
    // much the cache holds.
    prop_assert!(
        stats.reserved_bytes.all.peak as u64 <= limit,
        "peak reserved {} over the limit {}",
        stats.reserved_bytes.all.peak,
        limit
    );
    let info = cache.mem_info();
    prop_assert_eq!(info.total - info.free, reserved, "device usage vs reserved");
    Ok(snap)
}

/// After `empty_cache` nothing waits for streams and no cached memory could be released.
fn check_emptied(snap: &Snapshot, expandable: bool) -> Result<(), TestCaseError> {
    for seg in &snap.segments {
        for b in &seg.blocks {
            prop_assert!(
                b.state != "active_pending_free",
                "pending block {:#x} survived",
                b.address
            );
            if expandable && b.state == "inactive" {
                // Pages are 2 MiB (small pool) or 20 MiB (large pool) from the start of a
                // mapped run, which starts on a page.
                let page = if seg.segment_type == "small" { 2 << 20 } else { 20 << 20 };
                let offset = b.address - seg.address;
                let whole_page = offset.next_multiple_of(page) + page <= offset + b.size;
                prop_assert!(!whole_page, "free page left mapped in {:#x}+{}", b.address, b.size);
            }
        }
        if !expandable {
            prop_assert!(
                seg.blocks.iter().any(|b| b.state != "inactive"),
                "free segment {:#x} kept",
                seg.address
            );
        }
    }
    Ok(())
}

// ---- the driver --------------------------------------------------------------------------

/// How often a sequence took the branches that matter.
#[derive(Debug, Default)]
struct Coverage {
    ooms: usize,
    pending_frees: usize,
    allocs_while_pending: usize,
}

fn run<B: SimBackend>(mem: B, conf: &str, ops: &[Op]) -> Result<Coverage, TestCaseError> {
    let config = AllocatorConfig::parse(conf).expect("test configurations parse");
    let expandable = config.expandable_segments();
    let cache = CachingAllocator::with_config(mem, config).expect("backend supports config");
    let total = cache.mem_info().total;
    let limit = cache.memory_cap().map_or(total, |cap| cap.min(total));
    let mut model = Model::<B>::new();
    let mut coverage = Coverage::default();
    let mut snap = check_invariants(&cache, &model, limit, expandable)?;

    for op in ops {
        let before = cache.memory_stats();
        match *op {
            Op::Alloc { size, stream } => {
                match cache.allocate_on(size, Stream(stream)) {
                    Ok(mut handle) => {
                        let after = cache.memory_stats();
                        prop_assert_eq!(after.num_ooms, before.num_ooms, "success counted as OOM");
                        // A block is never reused before its events complete (unless this
                        // allocation waited for every stream: the retry after a failure does).
                        if after.num_sync_all_streams == before.num_sync_all_streams {
                            coverage.allocs_while_pending += usize::from(!model.pending.is_empty());
                            let range = (handle.ptr(), handle.len().max(1) as u64);
                            for p in &model.pending {
                                prop_assert!(
                                    !overlaps(range, (p.ptr, p.size)),
                                    "{:?} reuses {:#x} before streams {:?} completed",
                                    handle,
                                    p.ptr,
                                    p.waiting
                                );
                            }
                        }
                        let tag = model.next_tag;
                        model.next_tag = model.next_tag.wrapping_add(1).max(1);
                        B::stamp(&mut handle, tag);
                        model.live.push(Live { handle, recorded: BTreeSet::new(), tag });
                    }
                    Err(AllocError::OutOfMemory(_)) => {
                        coverage.ooms += 1;
                        let after_snap = cache.snapshot();
                        let after = cache.memory_stats();
                        // An OOM counts once and leaves live state unchanged.
                        prop_assert_eq!(after.num_ooms, before.num_ooms + 1);
                        prop_assert_eq!(
                            after.allocated_bytes.all.current,
                            before.allocated_bytes.all.current
                        );
                        prop_assert_eq!(allocated_blocks(&after_snap), allocated_blocks(&snap));
                        // An OOM is real: after freeing the cache, what the request needs
                        // does not fit under the limit.
                        let reserved = after.reserved_bytes.all.current as u64;
                        prop_assert!(
                            reserved + device_need_bound(size) > limit,
                            "OOM for {} B with {} B reserved of {} B",
                            size,
                            reserved,
                            limit
                        );
                        if !expandable {
                            check_emptied(&after_snap, expandable)?;
                        }
                    }
                    Err(e) => prop_assert!(false, "unexpected error {}", e),
                }
                if cache.memory_stats().num_sync_all_streams != before.num_sync_all_streams {
                    model.pending.clear();
                }
            }
            Op::Free(i) => {
                if !model.live.is_empty() {
                    let live = model.live.swap_remove(i.index(model.live.len()));
                    let ptr = live.handle.ptr();
                    let size = block_at(&snap, ptr).expect("live block in snapshot").size;
                    drop(live.handle);
                    let waiting: BTreeSet<u64> =
                        live.recorded.intersection(&model.held).copied().collect();
                    let after = cache.snapshot();
                    let b = block_at(&after, ptr);
                    if live.recorded.is_empty() {
                        // Without other streams the block is free at once.
                        prop_assert!(
                            b.is_none_or(|b| b.state == "inactive"),
                            "freed {:#x}: {:?}",
                            ptr,
                            b
                        );
                    } else {
                        prop_assert!(
                            b.is_some_and(|b| b.state == "active_pending_free"),
                            "freed {:#x} after use on {:?}: {:?}",
                            ptr,
                            live.recorded,
                            b
                        );
                    }
                    if !waiting.is_empty() {
                        coverage.pending_frees += 1;
                        model.pending.push(Pending { ptr, size, waiting });
                    }
                }
            }
            Op::RecordStream(i, stream) => {
                if !model.live.is_empty() {
                    let n = model.live.len();
                    let live = &mut model.live[i.index(n)];
                    live.handle.record_stream(Stream(stream));
                    if live.handle.stream() != Stream(stream) {
                        live.recorded.insert(stream);
                    }
                }
            }
            Op::Hold(stream) => {
                cache.memory().sim().hold(Stream(stream));
                model.held.insert(stream);
            }
            Op::Release(stream) => {
                cache.memory().sim().release(Stream(stream));
                model.held.remove(&stream);
                for p in &mut model.pending {
                    p.waiting.remove(&stream);
                }
                model.pending.retain(|p| !p.waiting.is_empty());
            }
            Op::EmptyCache => {
                cache.empty_cache();
                model.pending.clear();
                let once = cache.snapshot();
                // empty_cache is idempotent.
                cache.empty_cache();
                prop_assert_eq!(&cache.snapshot(), &once, "a second empty_cache changed the cache");
                check_emptied(&once, expandable)?;
            }
        }
        // empty_cache and every other step touch no live block: checked here, as every
        // live handle must still be an allocated block at its address.
        snap = check_invariants(&cache, &model, limit, expandable)?;
    }

    // Dropping every handle and releasing every stream returns allocated (and, once the
    // pending frees are processed, active) bytes to 0; empty_cache then returns everything.
    for stream in std::mem::take(&mut model.held) {
        cache.memory().sim().release(Stream(stream));
    }
    model.pending.clear();
    model.live.clear();
    let snap = check_invariants(&cache, &model, limit, expandable)?;
    let stats = cache.memory_stats();
    prop_assert_eq!(stats.allocated_bytes.all.current, 0);
    let pending: u64 = sizes(&snap, |b| b.state == "active_pending_free").sum();
    prop_assert_eq!(stats.active_bytes.all.current as u64, pending);
    if pending == 0 {
        prop_assert_eq!(stats.requested_bytes.all.current, 0);
    }
    cache.empty_cache();
    let stats = cache.memory_stats();
    prop_assert_eq!(stats.active_bytes.all.current, 0);
    prop_assert_eq!(stats.requested_bytes.all.current, 0);
    prop_assert_eq!(stats.reserved_bytes.all.current, 0);
    prop_assert_eq!(stats.segment.all.current, 0);
    prop_assert!(cache.snapshot().segments.is_empty());
    let info = cache.mem_info();
    prop_assert_eq!(info.free, info.total, "the device got every byte back");
    Ok(coverage)
}

// ---- the tests ---------------------------------------------------------------------------

// Properties checked after every operation of every random sequence (see `check_invariants`,
// `check_emptied` and `run`): blocks tile segments and free neighbours are coalesced;
// segments and live allocations never overlap and allocations are 512-byte aligned; the
// statistics equal the snapshot and requested <= allocated <= active <= reserved <= cap,
// peaks included; a block is never reused while a stream it was recorded on is held, nor
// handed to another stream; empty_cache is idempotent and keeps live blocks; an OOM counts
// once, changes no live block and is real; at the end every byte comes back.
macro_rules! invariant_tests {
    ($backend:ident, $capacity:expr, $cases:expr; $($name:ident => $conf:expr),* $(,)?) => {
        proptest! {
            #![proptest_config(ProptestConfig::with_cases($cases))]
            $(
                #[test]
                fn $name(ops in ops()) {
                    run($backend::new($capacity), $conf, &ops)?;
                }
            )*
        }
    };
}

invariant_tests! {
    VirtualMemory, VIRTUAL_CAPACITY, 256;
    virtual_memory_keeps_every_invariant_with_default_config => "",
    virtual_memory_keeps_every_invariant_with_max_split_size => "max_split_size_mb:40",
    virtual_memory_keeps_every_invariant_with_expandable_segments => "expandable_segments:True",
    virtual_memory_keeps_every_invariant_under_a_memory_fraction =>
        "per_process_memory_fraction:0.5",
    virtual_memory_keeps_every_invariant_with_power2_rounding => "roundup_power2_divisions:4",
    virtual_memory_keeps_every_invariant_with_garbage_collection =>
        "per_process_memory_fraction:0.6,garbage_collection_threshold:0.5",
}

invariant_tests! {
    HostMemory, HOST_CAPACITY, 32;
    host_memory_keeps_every_invariant_with_default_config => "",
    host_memory_keeps_every_invariant_with_max_split_size => "max_split_size_mb:40",
    host_memory_keeps_every_invariant_with_expandable_segments => "expandable_segments:True",
    host_memory_keeps_every_invariant_under_a_memory_fraction =>
        "per_process_memory_fraction:0.5",
    host_memory_keeps_every_invariant_with_power2_rounding => "roundup_power2_divisions:4",
    host_memory_keeps_every_invariant_with_garbage_collection =>
        "per_process_memory_fraction:0.6,garbage_collection_threshold:0.5",
}

/// The generated sequences reach the interesting branches (out-of-memory, frees waiting on
/// held streams, allocations while blocks are pending): a property whose branches never run
/// proves little.
#[test]
fn random_sequences_reach_out_of_memory_and_pending_frees() {
    let mut runner = TestRunner::deterministic();
    let mut total = Coverage::default();
    for _ in 0..64 {
        let ops = ops().new_tree(&mut runner).expect("strategy generates").current();
        let c = run(VirtualMemory::new(VIRTUAL_CAPACITY), "", &ops).expect("invariants hold");
        total.ooms += c.ooms;
        total.pending_frees += c.pending_frees;
        total.allocs_while_pending += c.allocs_while_pending;
    }
    assert!(total.ooms > 0, "{total:?}");
    assert!(total.pending_frees > 0, "{total:?}");
    assert!(total.allocs_while_pending > 0, "{total:?}");
}
