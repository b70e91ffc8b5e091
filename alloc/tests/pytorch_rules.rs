//! The places where vram's policy once diverged from PyTorch's `CUDACachingAllocator.cpp`,
//! each pinned by the figures PyTorch's source gives for the same requests (the function
//! followed is named in each test).

use vram_alloc::{AllocatorConfig, CachingAllocator, Stream, TraceAction, VirtualMemory};

const MIB: usize = 1 << 20;
const GIB: u64 = 1 << 30;

fn virt_with(capacity: u64, conf: &str) -> CachingAllocator<VirtualMemory> {
    CachingAllocator::with_config(
        VirtualMemory::new(capacity),
        AllocatorConfig::parse(conf).unwrap(),
    )
    .unwrap()
}

/// `malloc` without max_split_size: `release_available_cached_blocks` releases nothing, the
/// whole cache goes in `release_cached_blocks`, and the retry counts.
#[test]
fn oom_without_max_split_size_releases_the_whole_cache_and_counts_one_retry() {
    let c = virt_with(72 << 20, "");
    let mut blocks: Vec<_> = (0..4).map(|_| Some(c.allocate(16 * MIB).unwrap())).collect();
    for i in [0, 1, 3] {
        blocks[i] = None;
    }
    let big = c.allocate(24 * MIB).unwrap();
    let s = c.memory_stats();
    assert_eq!(c.memory_reserved() as usize, 40 * MIB);
    assert_eq!(s.num_device_free, 3);
    assert_eq!(s.num_alloc_retries, 1);
    assert_eq!(s.num_ooms, 0);
    drop((big, blocks));
}

/// `release_available_cached_blocks` with max_split_size: the smallest cached oversize block
/// of the requesting stream that covers `max(request, max_split_size)` is released alone,
/// without a retry.
#[test]
fn oom_with_max_split_size_releases_one_oversize_block_of_the_stream() {
    let c = virt_with(200 << 20, "max_split_size_mb:32");
    let a = c.allocate(40 * MIB).unwrap();
    let b = c.allocate(60 * MIB).unwrap();
    let other = c.allocate_on(80 * MIB, Stream(1)).unwrap();
    drop((a, b, other));
    // 180 MiB cached, all oversize: a 30 MiB request may not take them (`get_free_block`)
    // and does not fit beside them. The smallest oversize block of stream 0 of at least
    // 32 MiB (40 MiB) is released; 60 + 80 + 30 fits.
    let req = c.allocate(30 * MIB).unwrap();
    let s = c.memory_stats();
    assert_eq!(s.num_device_free, 1);
    assert_eq!(s.num_alloc_retries, 0);
    assert_eq!(c.memory_reserved() as usize, (60 + 80 + 30) * MIB);
    drop(req);
}

/// A partial release (not enough oversize blocks) falls through to `release_cached_blocks`
/// and counts a retry; the blocks released on the way stay released.
#[test]
fn oom_with_a_partial_oversize_release_falls_through_to_the_full_release() {
    let c = virt_with(120 << 20, "max_split_size_mb:32");
    let a = c.allocate(34 * MIB).unwrap();
    let small = c.allocate(20 * MIB).unwrap();
    let other = c.allocate_on(34 * MIB, Stream(1)).unwrap();
    drop((a, small, other));
    // Cached: 34 MiB (stream 0, oversize), 20 MiB (stream 0, not oversize), 34 MiB
    // (stream 1). 60 MiB needs room: the one oversize block of stream 0 is released (34 <
    // 60), which is not enough, so everything goes and the retry counts.
    let big = c.allocate(60 * MIB).unwrap();
    let s = c.memory_stats();
    assert_eq!(s.num_device_free, 3);
    assert_eq!(s.num_alloc_retries, 1);
    assert_eq!(c.memory_reserved() as usize, 60 * MIB);
    drop(big);
}

/// `garbage_collect_cached_blocks`: ages count `get_free_block` calls of the large pool; one
/// pass frees every unsplit cached block at least as old as the mean, past the target.
#[test]
fn garbage_collection_frees_blocks_at_or_above_the_mean_age_in_one_pass() {
    // Cap 200 MiB, threshold 0.5: collection starts above 100 MiB reserved.
    let c =
        virt_with(GIB, "per_process_memory_fraction:0.1953125,garbage_collection_threshold:0.5");
    assert_eq!(c.memory_cap(), Some(200 << 20));
    // A ticker: 1.5 MiB requests served from a split 20 MiB segment count a large-pool call
    // each without reserving memory (split blocks are never collected).
    let _pin = c.allocate(3 * MIB / 2).unwrap(); // call 1
    let tick = || drop(c.allocate(3 * MIB / 2).unwrap());
    let a = c.allocate(40 * MIB).unwrap(); // call 2
    let b = c.allocate(30 * MIB).unwrap(); // call 3
    let d = c.allocate(30 * MIB).unwrap(); // call 4; reserved 120 MiB
    drop(a); // cached at 4
    tick(); // call 5
    drop(b); // cached at 5
    tick(); // call 6
    drop(d); // cached at 6
    // Call 7 misses the cache: ages 3, 2, 1 (mean 2); `a` and `b` go (70 MiB, past the
    // 20 MiB excess), `d` stays.
    let _z = c.allocate(50 * MIB).unwrap();
    let s = c.memory_stats();
    assert_eq!(s.num_device_free, 2);
    assert_eq!(c.memory_reserved() as usize, (20 + 30 + 50) * MIB);
}

/// `free_block`: a block freed while another stream still uses it keeps its requested bytes
/// until its events complete.
#[test]
fn requested_bytes_of_a_pending_free_count_until_its_events_complete() {
    let c = virt_with(GIB, "");
    let other = Stream(3);
    c.memory().streams().hold(other);
    let a = c.allocate(1000).unwrap();
    a.record_stream(other);
    drop(a);
    let s = c.memory_stats();
    assert_eq!(s.allocated_bytes.all.current, 0);
    assert_eq!(s.requested_bytes.all.current, 1000);
    c.memory().streams().release(other);
    drop(c.allocate(4 * MIB).unwrap()); // processes the completed event
    assert_eq!(c.memory_stats().requested_bytes.all.current, 0);
}

/// `alloc_found_block` and `free_block`: one net change of `inactive_split` per split and per
/// free, so the totals count blocks, not intermediate steps.
#[test]
fn inactive_split_totals_change_once_per_split_and_free() {
    let c = virt_with(GIB, "");
    let a = c.allocate(1000).unwrap(); // splits a new 2 MiB segment: +1 block
    let b = c.allocate(1000).unwrap(); // shrinks the remainder: no count change
    let s = c.memory_stats();
    assert_eq!(s.inactive_split.all.allocated, 1);
    assert_eq!(s.inactive_split.all.freed, 0);
    assert_eq!(s.inactive_split.all.current, 1);
    drop(b); // merges with the remainder: net 0 blocks
    let s = c.memory_stats();
    assert_eq!((s.inactive_split.all.allocated, s.inactive_split.all.freed), (1, 0));
    assert_eq!(s.inactive_split_bytes.all.current as usize, 2 * MIB - 1024);
    drop(a); // the segment is whole again: -1
    let s = c.memory_stats();
    assert_eq!((s.inactive_split.all.allocated, s.inactive_split.all.freed), (1, 1));
    assert_eq!(s.inactive_split_bytes.all.current, 0);
    // Bytes as net changes: +(2 MiB - 1 KiB) (split), -1 KiB (b), +1 KiB (b back),
    // -(2 MiB - 1 KiB) (whole again).
    assert_eq!(s.inactive_split_bytes.all.allocated, 2 * MIB as u64);
    assert_eq!(s.inactive_split_bytes.all.freed, 2 * MIB as u64);
}

/// `NativeCachingAllocator::allocate`: 0 bytes get a null pointer and touch nothing.
#[test]
fn zero_byte_requests_get_no_block_and_change_no_statistic() {
    let c = virt_with(GIB, "");
    c.record_history(Some(100));
    let before = c.memory_stats();
    let z = c.allocate(0).unwrap();
    assert_eq!((z.ptr(), z.len()), (0, 0));
    z.record_stream(Stream(5));
    drop(z);
    assert_eq!(c.memory_stats(), before);
    assert!(c.snapshot().segments.is_empty());
    assert!(c.trace().is_empty());
}

/// Requests of 1 EiB or more fail before the cache is touched: no release, no retry, no OOM
/// count; statistics never wrap, even on a device of 16 EiB.
#[test]
fn exabyte_requests_fail_before_touching_the_cache() {
    let c = virt_with(u64::MAX, "");
    let keep = c.allocate(64 * MIB).unwrap();
    drop(c.allocate(32 * MIB).unwrap());
    let before = c.memory_stats();
    for size in [1usize << 60, 4 << 60, usize::MAX] {
        let err = c.allocate(size).unwrap_err();
        assert!(err.is_out_of_memory(), "{err}");
    }
    assert_eq!(c.memory_stats(), before, "no flush, no retry, no OOM counted");
    // Just under 1 EiB is an ordinary request: it may succeed on this device.
    let huge = c.allocate((1 << 60) - 512).unwrap();
    let huge2 = c.allocate((1 << 60) - 512).unwrap();
    assert_eq!(c.memory_stats().reserved_bytes.all.peak as u64, (2 << 60) + (96 << 20));
    drop((huge, huge2, keep));
    assert_eq!(c.memory_stats().allocated_bytes.all.current, 0);
}

/// `should_split` with expandable segments: a block splits whenever 512 bytes or more would
/// remain, in the large pool too.
#[test]
fn expandable_segments_split_whenever_512_bytes_remain() {
    let c = virt_with(GIB, "expandable_segments:True");
    let a = c.allocate(19 * MIB + 512).unwrap(); // maps one 20 MiB page, 1 MiB - 512 remain
    let b = c.allocate(256 << 10).unwrap(); // small pool: its own 2 MiB page
    // Large pool: the remainder and a newly mapped page serve it, 19 MiB - 512 remain.
    let d = c.allocate(2 * MIB).unwrap();
    let s = c.memory_stats();
    assert_eq!(s.reserved_bytes.large_pool.current as usize, 40 * MIB);
    assert_eq!(s.reserved_bytes.small_pool.current as usize, 2 * MIB);
    assert_eq!(s.segment.all.current, 0, "expandable segments are not counted");
    assert_eq!(s.inactive_split.all.current, 0, "nor in inactive_split");
    let snap = c.snapshot();
    let large = snap.segments.iter().find(|s| s.segment_type == "large").unwrap();
    assert_eq!(large.blocks.len(), 3, "{:?}", large.blocks);
    drop((a, b, d));
}

/// A configuration that once panicked: expandable segments with max_split_size, through an
/// OOM.
#[test]
fn expandable_segments_with_max_split_size_survive_out_of_memory() {
    let c = virt_with(200 << 20, "expandable_segments:True,max_split_size_mb:64");
    let a = c.allocate(100 * MIB).unwrap(); // five pages
    let b = c.allocate(30 * MIB).unwrap(); // two more pages, 10 MiB of them free
    drop(a);
    // The segment has address space for 9/8 of 200 MiB (12 pages): 150 MiB fits in none of
    // its free ranges, so a second segment maps eight pages, which fit only after `a`'s
    // pages are unmapped. (PyTorch would hit an internal assert releasing an expandable
    // block as oversize; vram releases none there and goes on to the full release.)
    let big = c.allocate(150 * MIB).unwrap();
    let s = c.memory_stats();
    assert_eq!(s.num_alloc_retries, 1);
    assert_eq!(c.memory_reserved() as usize, 200 * MIB);
    assert_eq!(c.snapshot().segments.len(), 2);
    assert!(c.allocate(90 * MIB).unwrap_err().is_out_of_memory());
    drop((b, big));
    c.empty_cache();
    assert_eq!(c.memory_reserved(), 0);
    assert_eq!(c.mem_info().free, 200 << 20);
}

/// The trace records blocks as PyTorch does: `free_completed` with the freed block's own
/// address and size, before it merges with its neighbours.
#[test]
fn free_completed_records_the_block_before_merging() {
    let c = virt_with(GIB, "");
    c.record_history(Some(100));
    let a = c.allocate(1000).unwrap();
    let b = c.allocate(3000).unwrap();
    let (pa, pb) = (a.ptr(), b.ptr());
    drop(a);
    drop(b); // merges with a and the remainder
    let frees: Vec<_> = c
        .trace()
        .into_iter()
        .filter(|e| e.action == TraceAction::FreeCompleted)
        .map(|e| (e.addr, e.size, e.requested))
        .collect();
    assert_eq!(frees, [(pa, 1024, 1000), (pb, 3072, 3000)]);
}

/// Statistics scopes: a profiler inside a scope sees its own peak, and the caller's peak
/// survives.
#[test]
fn statistics_scopes_nest_without_resetting_the_callers_peak() {
    let c = virt_with(GIB, "");
    drop(c.allocate(100 * MIB).unwrap());
    let keep = c.allocate(10 * MIB).unwrap();
    let outer = c.stats_scope();
    drop(c.allocate(30 * MIB).unwrap());
    let inner = c.stats_scope();
    drop(c.allocate(20 * MIB).unwrap());
    let inner_stats = inner.finish();
    assert_eq!(inner_stats.allocated_bytes.all.peak as usize, 30 * MIB);
    assert_eq!(inner_stats.allocation.all.allocated, 1);
    let outer_stats = outer.stats();
    assert_eq!(outer_stats.allocated_bytes.all.peak as usize, 40 * MIB);
    assert_eq!(outer_stats.allocation.all.allocated, 2);
    drop(outer);
    assert_eq!(c.max_memory_allocated() as usize, 100 * MIB);
    drop(keep);
}

/// On a 16 EiB virtual device, statistics never wrap: reserved memory stops short of
/// `i64::MAX` with a clear out-of-memory, and every current value and peak stays positive.
#[test]
fn statistics_never_wrap_on_a_16_eib_device() {
    let c = virt_with(u64::MAX, "");
    let mut live = Vec::new();
    let err = loop {
        match c.allocate((1 << 60) - 512) {
            Ok(a) => live.push(a),
            Err(e) => break e,
        }
        assert!(live.len() < 16, "reserved passed i64::MAX without an error");
    };
    assert!(err.is_out_of_memory(), "{err}");
    let s = c.memory_stats();
    assert_eq!(live.len(), 7);
    assert!(s.reserved_bytes.all.current > 0 && s.reserved_bytes.all.peak > 0);
    // Each request takes its whole 1 EiB segment (the 512 B rest is not worth a split).
    assert_eq!(s.allocated_bytes.all.current as u64, 7 << 60);
    drop(live);
    c.empty_cache();
    let s = c.memory_stats();
    assert_eq!((s.reserved_bytes.all.current, s.allocated_bytes.all.current), (0, 0));
    assert_eq!(s.allocated_bytes.all.allocated, s.allocated_bytes.all.freed);
}

// ---- private pools (CUDA graphs, torch.cuda.MemPool) -------------------------------------

use vram_alloc::{AllocError, MempoolId};

const GRAPH: MempoolId = MempoolId(1, 0);
const MEMPOOL: MempoolId = MempoolId(0, 1);

/// `get_pool`: while allocating to a private pool (`beginAllocateToPool`), requests on the
/// filtered stream use the pool's own blocks, never the default pools' (and the default
/// pools never use its blocks); other streams keep the default pools.
#[test]
fn a_private_pool_keeps_its_blocks_to_itself() {
    let c = virt_with(GIB, "");
    let default = c.allocate(512).unwrap(); // a 2 MiB default small segment, mostly free
    c.begin_allocate_to_pool(GRAPH, Some(Stream(0))).unwrap();
    let in_pool = c.allocate(512).unwrap();
    assert_eq!(c.memory_reserved() as usize, 4 * MIB, "a small segment of the pool's own");
    let other_stream = c.allocate_on(512, Stream(7)).unwrap();
    assert_eq!(c.memory_reserved() as usize, 6 * MIB, "stream 7 is not captured");
    c.end_allocate_to_pool(GRAPH).unwrap();
    drop(in_pool);
    let after = c.allocate(1 << 20).unwrap();
    assert_eq!(c.memory_reserved() as usize, 6 * MIB, "the default segment serves it");
    let snap = c.snapshot();
    let pools: Vec<(i64, i64)> = snap.segments.iter().map(|s| s.segment_pool_id).collect();
    assert_eq!(pools.iter().filter(|&&p| p == (1, 0)).count(), 1, "{pools:?}");
    assert_eq!(pools.iter().filter(|&&p| p == (0, 0)).count(), 2, "{pools:?}");
    drop((default, other_stream, after));
}

/// `release_cached_blocks`: a private pool in use keeps its cached segments through
/// `empty_cache`; once every user released it (`releasePool`, `graph_pools_freeable`), they
/// go, and the pool is deleted when it has none left (a new capture makes a fresh one).
#[test]
fn empty_cache_spares_private_pools_until_they_are_released() {
    let c = virt_with(GIB, "");
    c.begin_allocate_to_pool(MEMPOOL, None).unwrap();
    let a = c.allocate_on(30 * MIB, Stream(3)).unwrap();
    c.end_allocate_to_pool(MEMPOOL).unwrap();
    c.begin_allocate_to_pool(MEMPOOL, None).unwrap(); // a second user of the same pool
    c.end_allocate_to_pool(MEMPOOL).unwrap();
    drop(a);
    c.empty_cache();
    assert_eq!(c.memory_reserved() as usize, 30 * MIB);
    c.release_pool(MEMPOOL).unwrap();
    c.empty_cache();
    assert_eq!(c.memory_reserved() as usize, 30 * MIB, "one user left");
    c.release_pool(MEMPOOL).unwrap();
    c.empty_cache();
    assert_eq!(c.memory_reserved(), 0);
    assert!(c.release_pool(MEMPOOL).is_err(), "deleted");
    c.begin_allocate_to_pool(MEMPOOL, None).unwrap();
    c.end_allocate_to_pool(MEMPOOL).unwrap();
}

/// `malloc`: while a capture is underway, an allocation that does not fit fails without
/// `release_cached_blocks` (it synchronizes), so no retry is counted and the default pools'
/// cached segments stay.
#[test]
fn an_oom_during_a_capture_releases_nothing() {
    let c = virt_with(64 << 20, "");
    drop(c.allocate(40 * MIB).unwrap());
    c.begin_allocate_to_pool(GRAPH, None).unwrap();
    let err = c.allocate(40 * MIB).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    let s = c.memory_stats();
    assert_eq!((s.num_alloc_retries, s.num_device_free, s.num_ooms), (0, 0, 1));
    assert_eq!(c.memory_reserved() as usize, 40 * MIB);
    c.empty_cache(); // refused during a capture
    assert_eq!(c.memory_reserved() as usize, 40 * MIB);
    c.end_allocate_to_pool(GRAPH).unwrap();
    let ok = c.allocate(40 * MIB).unwrap();
    assert_eq!(c.memory_stats().num_alloc_retries, 0, "the cached block fits");
    drop(ok);
}

/// `free` during a capture: a block used on another stream gets its events only once no
/// capture is underway (`needs_events_deferred_until_no_capture`, processed by the next
/// `malloc`'s `process_events` outside a capture).
#[test]
fn frees_used_on_other_streams_wait_for_the_capture_to_end() {
    let c = virt_with(GIB, "");
    let a = c.allocate(12 * MIB).unwrap(); // a 12 MiB segment of its own
    a.record_stream(Stream(9));
    c.begin_allocate_to_pool(GRAPH, Some(Stream(5))).unwrap();
    drop(a);
    assert_eq!(c.memory_allocated(), 0);
    let b = c.allocate(12 * MIB).unwrap(); // default pool: the block is not back yet
    assert_eq!(c.memory_reserved() as usize, 24 * MIB);
    c.end_allocate_to_pool(GRAPH).unwrap();
    drop(b);
    // The deferred events are recorded now; stream 9 is idle, so the block comes back.
    let d = c.allocate(12 * MIB).unwrap();
    let e = c.allocate(12 * MIB).unwrap();
    assert_eq!(c.memory_reserved() as usize, 24 * MIB);
    drop((d, e));
}

/// What PyTorch refuses: allocating to a pool twice at once, ending or releasing a pool not
/// in use, the default pools as a private one.
#[test]
fn private_pool_misuse_is_an_error() {
    let c = virt_with(GIB, "");
    assert!(matches!(c.begin_allocate_to_pool(MempoolId::DEFAULT, None), Err(AllocError::Pool(_))));
    assert!(matches!(c.end_allocate_to_pool(GRAPH), Err(AllocError::Pool(_))));
    assert!(matches!(c.release_pool(GRAPH), Err(AllocError::Pool(_))));
    c.begin_allocate_to_pool(GRAPH, None).unwrap();
    let e = c.begin_allocate_to_pool(GRAPH, None).unwrap_err();
    assert!(e.to_string().contains("already allocating to pool (1, 0)"), "{e}");
}
