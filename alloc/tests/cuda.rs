//! The caching allocator on a real CUDA device. Every test first probes device 0 and, when
//! there is none, prints `skipped: no CUDA device (<reason>)` and passes, so the file builds
//! and runs everywhere. Tests of expandable segments also print a skip line and pass on a
//! device without virtual memory management.
#![cfg(feature = "cuda")]

use cudarc::driver::{result, sys};
use std::error::Error;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Instant;
use vram_alloc::cuda::{CudaMemory, MAX_IDLE_EVENTS, probe};
use vram_alloc::memory::PAGE_SIZE;
use vram_alloc::{
    AllocError, Allocation, AllocatorConfig, CachingAllocator, DeviceMemory, LARGE_BUFFER,
    RawError, Snapshot, Stream, VirtualMemory,
};

type TestResult = Result<(), Box<dyn Error>>;

const MIB: usize = 1 << 20;

/// Device 0 for one test, shared with the other tests of this binary (which run in parallel),
/// or `None` after printing `skipped: no CUDA device (<reason>)`. The line goes straight to
/// stderr (not through `eprintln!`, which the test harness captures) so that it shows in a
/// plain `cargo test` run.
fn device() -> Option<RwLockReadGuard<'static, ()>> {
    match probe(0) {
        Ok(_) => Some(DEVICE.read().unwrap_or_else(|e| e.into_inner())),
        Err(reason) => {
            skip(&format!("no CUDA device ({reason})"));
            None
        }
    }
}

/// Device 0 for one test alone (one that fills the device), or `None` as [`device`].
fn device_alone() -> Option<RwLockWriteGuard<'static, ()>> {
    match probe(0) {
        Ok(_) => Some(DEVICE.write().unwrap_or_else(|e| e.into_inner())),
        Err(reason) => {
            skip(&format!("no CUDA device ({reason})"));
            None
        }
    }
}

/// Taken shared by every test, and exclusively by those that exhaust device memory.
static DEVICE: RwLock<()> = RwLock::new(());

/// Prints `skipped: <reason>` straight to stderr.
fn skip(reason: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "skipped: {reason}");
}

fn cache() -> Result<CachingAllocator<CudaMemory>, Box<dyn Error>> {
    Ok(CachingAllocator::new(CudaMemory::new(0)?))
}

/// Device 0's primary context, retained and current on this thread for as long as it lives.
///
/// `CudaMemory` binds the context only inside its own calls (segment allocation, events,
/// `mem_info`); a block reused from the cache involves no driver call, so tests that call the
/// driver themselves (copies, streams) make the context current here.
struct PrimaryContext {
    device: sys::CUdevice,
}

impl PrimaryContext {
    fn bind() -> Result<Self, Box<dyn Error>> {
        let device = result::device::get(0)?;
        // SAFETY: `device` was returned by cuDeviceGet; the reference is released in drop.
        let context = unsafe { result::primary_ctx::retain(device) }?;
        // SAFETY: `context` is a primary context retained above and alive until drop.
        unsafe { result::ctx::set_current(context) }?;
        Ok(PrimaryContext { device })
    }
}

impl Drop for PrimaryContext {
    fn drop(&mut self) {
        // SAFETY: releases the reference taken in `bind`, on the device it came from.
        let _ = unsafe { result::primary_ctx::release(self.device) };
    }
}

/// The snapshot and the statistics agree: blocks tile segments, the byte counts match and
/// requested <= allocated <= active <= reserved, peaks included.
fn assert_consistent(cache: &CachingAllocator<CudaMemory>) -> Snapshot {
    let snap = cache.snapshot();
    let stats = cache.memory_stats();
    for seg in &snap.segments {
        let mut end = seg.address;
        for b in &seg.blocks {
            assert_eq!(b.address, end, "blocks of {:#x} are contiguous", seg.address);
            end += b.size;
        }
        assert_eq!(end - seg.address, seg.total_size, "blocks tile segment {:#x}", seg.address);
        assert!(
            seg.blocks.windows(2).all(|w| w[0].state != "inactive" || w[1].state != "inactive"),
            "free neighbours coalesced in {:#x}",
            seg.address
        );
    }
    let reserved = stats.reserved_bytes.all.current as u64;
    let allocated = stats.allocated_bytes.all.current as u64;
    let active = stats.active_bytes.all.current as u64;
    let requested = stats.requested_bytes.all.current as u64;
    assert_eq!(reserved, snap.reserved_bytes());
    assert_eq!(allocated, snap.allocated_bytes());
    assert!(requested <= allocated && allocated <= active && active <= reserved);
    assert!(stats.reserved_bytes.all.peak >= stats.reserved_bytes.all.current);
    assert!(stats.allocated_bytes.all.peak >= stats.allocated_bytes.all.current);
    snap
}

#[test]
fn cuda_freed_blocks_are_reused_without_device_calls() -> TestResult {
    let Some(_device) = device() else { return Ok(()) };
    let cache = cache()?;
    let first = cache.allocate(4 * MIB)?;
    let ptr = first.ptr();
    assert_ne!(ptr, 0);
    assert_eq!(ptr % 512, 0);
    drop(first);
    let again = cache.allocate(4 * MIB)?;
    assert_eq!(again.ptr(), ptr, "the cached block is handed out again");
    assert_eq!(cache.memory_stats().num_device_alloc, 1);
    assert_eq!(cache.memory_allocated() as usize, 4 * MIB);
    assert_eq!(cache.memory_reserved() as usize, 20 * MIB);
    Ok(())
}

#[test]
fn cuda_cached_and_raw_allocation_timings_are_reported() -> TestResult {
    let Some(_device) = device() else { return Ok(()) };
    const PAIRS: u32 = 1000;
    let cache = cache()?;
    drop(cache.allocate(MIB)?);
    let start = Instant::now();
    for _ in 0..PAIRS {
        drop(cache.allocate(MIB)?);
    }
    let cached = start.elapsed() / PAIRS;

    let _context = PrimaryContext::bind()?;
    let start = Instant::now();
    for _ in 0..PAIRS {
        // SAFETY: the primary context is current; the memory is freed right away and used
        // by no work.
        let ptr = unsafe { result::malloc_sync(MIB) }?;
        // SAFETY: `ptr` came from cuMemAlloc above and nothing uses it.
        unsafe { result::free_sync(ptr) }?;
    }
    let raw = start.elapsed() / PAIRS;
    println!("1 MiB allocate+free: cached {cached:?}, cuMemAlloc+cuMemFree {raw:?}");
    assert_eq!(cache.memory_stats().num_device_alloc, 1, "the cached loop stayed in the cache");
    Ok(())
}

#[test]
fn cuda_memory_fraction_caps_reserved_memory_though_the_device_has_room() -> TestResult {
    let Some(_device) = device() else { return Ok(()) };
    let cache = cache()?;
    cache.set_memory_fraction(0.01)?;
    let cap = cache.memory_cap().expect("a fraction was set");
    assert_eq!(cap, (0.01 * cache.mem_info().total as f64).floor() as u64);
    let within = cache.allocate(cap as usize / 2)?;
    let over = cap as usize + MIB;
    assert!(cache.mem_info().free > over as u64, "the device itself has room");
    match cache.allocate(over) {
        Err(AllocError::OutOfMemory(oom)) => assert_eq!(oom.cap, Some(cap)),
        other => panic!("expected out-of-memory past the cap, got {other:?}"),
    }
    let stats = cache.memory_stats();
    assert_eq!(stats.num_ooms, 1);
    assert!(stats.reserved_bytes.all.peak as u64 <= cap);
    assert_consistent(&cache);
    drop(within);
    Ok(())
}

#[test]
fn cuda_empty_cache_returns_reserved_to_zero() -> TestResult {
    let Some(_device) = device() else { return Ok(()) };
    let cache = cache()?;
    // A 20 MiB segment holds the live block and, split off it, the 3 MiB one.
    let live = cache.allocate(5 * MIB)?;
    let blocks = [512, 3 * MIB, 25 * MIB]
        .into_iter()
        .map(|size| cache.allocate(size))
        .collect::<Result<Vec<_>, _>>()?;
    drop(blocks);
    assert!(cache.memory_reserved() > 0);
    cache.empty_cache();
    let snap = assert_consistent(&cache);
    assert_eq!(snap.segments.len(), 1, "only the live block's segment is kept");
    assert_eq!(snap.segments[0].blocks[0].address, live.ptr());
    drop(live);
    cache.empty_cache();
    let stats = cache.memory_stats();
    assert_eq!(cache.memory_reserved(), 0);
    assert_eq!(stats.num_device_free, stats.num_device_alloc, "every segment was freed");
    Ok(())
}

#[test]
fn cuda_statistics_match_the_snapshot() -> TestResult {
    let Some(_device) = device() else { return Ok(()) };
    let cache = cache()?;
    let mut live = Vec::new();
    for (i, size) in [100, 4096, 700_000, 2 * MIB + 1, 12 * MIB, 30 * MIB].iter().enumerate() {
        live.push(cache.allocate(*size)?);
        if i % 2 == 1 {
            live.remove(0);
        }
        assert_consistent(&cache);
    }
    let snap = assert_consistent(&cache);
    for a in &live {
        let block = snap.segments.iter().flat_map(|s| &s.blocks).find(|b| b.address == a.ptr());
        assert!(block.is_some_and(|b| b.state == "active_allocated"), "{a:?}: {block:?}");
    }
    drop(live);
    let stats = cache.memory_stats();
    assert_eq!(stats.allocated_bytes.all.current, 0);
    assert_eq!(stats.active_bytes.all.current, 0);
    Ok(())
}

#[test]
fn cuda_record_stream_returns_the_block_after_the_stream_synchronizes() -> TestResult {
    let Some(_device) = device() else { return Ok(()) };
    let cache = cache()?;
    let _context = PrimaryContext::bind()?;
    let stream = result::stream::create(result::stream::StreamKind::NonBlocking)?;
    let a = cache.allocate(4 * MIB)?;
    let ptr = a.ptr();
    a.record_stream(Stream(stream as u64));
    drop(a);
    let snap = cache.snapshot();
    assert_eq!(snap.segments[0].blocks[0].state, "active_pending_free", "waits for the event");
    assert_eq!(cache.memory_stats().active_bytes.all.current as usize, 4 * MIB);
    // SAFETY: `stream` was created above and is not destroyed yet.
    unsafe { result::stream::synchronize(stream) }?;
    let b = cache.allocate(4 * MIB)?;
    assert_eq!(b.ptr(), ptr, "reused once the stream's work completed");
    assert_eq!(cache.memory_stats().num_device_alloc, 1);
    drop(b);
    assert_consistent(&cache);
    // SAFETY: `stream` was created above; no work is queued on it any more.
    unsafe { result::stream::destroy(stream) }?;
    Ok(())
}

#[test]
fn cuda_allocations_hold_the_bytes_written_to_them() -> TestResult {
    let Some(_device) = device() else { return Ok(()) };
    let cache = cache()?;
    let _context = PrimaryContext::bind()?;
    let a = cache.allocate(MIB + 123)?;
    let b = cache.allocate(3000)?;
    let pattern_a: Vec<u8> = (0..a.len()).map(|i| (i % 251) as u8).collect();
    let pattern_b = vec![0xa5u8; b.len()];
    // SAFETY: `a` and `b` are live allocations of at least the patterns' lengths in the
    // current primary context; the copies are synchronous.
    unsafe {
        result::memcpy_htod_sync(a.ptr(), &pattern_a)?;
        result::memcpy_htod_sync(b.ptr(), &pattern_b)?;
    }
    let mut back_a = vec![0u8; a.len()];
    let mut back_b = vec![0u8; b.len()];
    // SAFETY: as above; the host buffers have the allocations' lengths.
    unsafe {
        result::memcpy_dtoh_sync(&mut back_a, a.ptr())?;
        result::memcpy_dtoh_sync(&mut back_b, b.ptr())?;
    }
    assert_eq!(back_a, pattern_a);
    assert_eq!(back_b, pattern_b, "writing one block left its neighbour alone");
    Ok(())
}

/// A cache with `expandable_segments:True` on device 0, and a twin on virtual memory of the
/// same capacity: the policy is the same, so both must reserve the same bytes after the same
/// calls. `None` (after a skip line) when the device lacks virtual memory management.
type Twins = (CachingAllocator<CudaMemory>, CachingAllocator<VirtualMemory>);
fn expandable_twins() -> Result<Option<Twins>, Box<dyn Error>> {
    let mem = CudaMemory::new(0)?;
    if !mem.supports_expandable() {
        skip("CUDA device 0 lacks virtual memory management (expandable segments)");
        return Ok(None);
    }
    let config = AllocatorConfig::parse("expandable_segments:True")?;
    let total = mem.mem_info().total;
    let cuda = CachingAllocator::with_config(mem, config.clone())?;
    let twin = CachingAllocator::with_config(VirtualMemory::new(total), config)?;
    Ok(Some((cuda, twin)))
}

/// Reserved bytes, segment count and allocated bytes agree between the CUDA cache and its
/// virtual twin, and the CUDA memory has exactly the reserved bytes mapped.
fn assert_twins_agree(cuda: &CachingAllocator<CudaMemory>, twin: &CachingAllocator<VirtualMemory>) {
    assert_eq!(cuda.memory_reserved(), twin.memory_reserved(), "reserved bytes");
    assert_eq!(cuda.memory_allocated(), twin.memory_allocated(), "allocated bytes");
    assert_eq!(cuda.snapshot().segments.len(), twin.snapshot().segments.len(), "segments");
    assert_eq!(cuda.memory().mapped_bytes() as u64, cuda.memory_reserved(), "mapped = reserved");
    assert_eq!(cuda.memory_reserved() % PAGE_SIZE as u64, 0, "whole pages");
    assert_consistent(cuda);
}

/// Fills `a` with `byte` on the device (cuMemsetD8) and checks every byte reads back.
fn fill_and_check(a: &Allocation<CudaMemory>, byte: u8) -> TestResult {
    // SAFETY: `a` is a live allocation of `a.len()` bytes in the current primary context.
    unsafe { result::memset_d8_sync(a.ptr(), byte, a.len()) }?;
    assert_eq!(read(a)?, vec![byte; a.len()], "{a:?} holds what was set");
    Ok(())
}

/// Copies an allocation's bytes to the host.
fn read(a: &Allocation<CudaMemory>) -> Result<Vec<u8>, Box<dyn Error>> {
    let mut back = vec![0u8; a.len()];
    // SAFETY: `a` is a live allocation of `back.len()` bytes; the copy is synchronous.
    unsafe { result::memcpy_dtoh_sync(&mut back, a.ptr()) }?;
    Ok(back)
}

#[test]
fn cuda_expandable_segments_map_pages_on_demand_and_empty_cache_unmaps_them() -> TestResult {
    let Some(_device) = device() else { return Ok(()) };
    let Some((cuda, twin)) = expandable_twins()? else { return Ok(()) };
    let sizes = [5 * MIB, 4096, 3 * MIB + 1, 30 * MIB, 700_000];
    let mut live = Vec::new();
    for &size in &sizes {
        live.push((cuda.allocate(size)?, twin.allocate(size)?));
        assert_twins_agree(&cuda, &twin);
    }
    assert!(cuda.memory_reserved() >= cuda.memory_allocated());
    assert!(cuda.snapshot().segments.iter().all(|s| s.is_expandable), "only expandable segments");
    // Free every other block, give free pages back, then the rest.
    let mut i = 0;
    live.retain(|_| {
        i += 1;
        i % 2 == 0
    });
    cuda.empty_cache();
    twin.empty_cache();
    assert_twins_agree(&cuda, &twin);
    drop(live);
    cuda.empty_cache();
    twin.empty_cache();
    assert_twins_agree(&cuda, &twin);
    assert_eq!(cuda.memory_reserved(), 0);
    assert_eq!(cuda.memory().mapped_bytes(), 0);
    assert!(cuda.snapshot().segments.is_empty(), "nothing is mapped");
    assert_eq!(cuda.memory_stats().segment.all.current, 0, "every reservation was released");
    let stats = cuda.memory_stats();
    assert_eq!(stats.num_device_alloc, twin.memory_stats().num_device_alloc, "map calls");
    assert_eq!(stats.num_device_free, twin.memory_stats().num_device_free, "unmap calls");
    Ok(())
}

#[test]
fn cuda_expandable_memory_is_readable_and_writable() -> TestResult {
    let Some(_device) = device() else { return Ok(()) };
    let Some((cuda, _twin)) = expandable_twins()? else { return Ok(()) };
    let _context = PrimaryContext::bind()?;
    // Four pages, then more pages mapped behind them in the same reservation.
    let a = cuda.allocate(7 * MIB + 123)?;
    fill_and_check(&a, 0x5a)?;
    let b = cuda.allocate(9 * MIB)?;
    let segments = cuda.snapshot().segments;
    assert_eq!(segments.len(), 1, "b grew a's segment");
    let pattern: Vec<u8> = (0..b.len()).map(|i| (i % 251) as u8).collect();
    // SAFETY: `b` is a live allocation of `pattern.len()` bytes; the copy is synchronous.
    unsafe { result::memcpy_htod_sync(b.ptr(), &pattern) }?;
    assert_eq!(read(&b)?, pattern);
    assert_eq!(read(&a)?, vec![0x5a; a.len()], "growing the segment left a alone");
    // Unmapped and mapped again: still usable.
    drop((a, b));
    cuda.empty_cache();
    assert_eq!(cuda.memory().mapped_bytes(), 0);
    let c = cuda.allocate(11 * MIB)?;
    fill_and_check(&c, 0xc3)?;
    Ok(())
}

#[test]
fn cuda_expandable_unmapping_part_of_one_mapping_keeps_the_rest() -> TestResult {
    let Some(_device) = device() else { return Ok(()) };
    let Some((cuda, twin)) = expandable_twins()? else { return Ok(()) };
    let _context = PrimaryContext::bind()?;
    // The large pool maps pages of 20 MiB (PyTorch's `segment_size_`), each backed by
    // 2 MiB physical pages of the CUDA memory. One map call of four pages ...
    let page = LARGE_BUFFER;
    drop((cuda.allocate(4 * page)?, twin.allocate(4 * page)?));
    assert_eq!(cuda.memory_stats().num_device_alloc, 1, "one map call");
    assert_eq!(cuda.memory().mapped_bytes(), 4 * page);
    // ... carved into pages 0, 1 and 2; page 1 is freed, page 3 never used.
    let x = cuda.allocate(page)?;
    let y = cuda.allocate(page)?;
    let z = cuda.allocate(page)?;
    let mut twins: Vec<_> = (0..3).map(|_| twin.allocate(page)).collect::<Result<_, _>>()?;
    assert_eq!(y.ptr(), x.ptr() + page as u64);
    assert_eq!(z.ptr(), y.ptr() + page as u64);
    fill_and_check(&x, 0x11)?;
    fill_and_check(&z, 0x33)?;
    drop(y);
    drop(twins.remove(1));
    // Pages 1 and 3 are unmapped: sub-ranges of the one earlier mapping.
    cuda.empty_cache();
    twin.empty_cache();
    assert_twins_agree(&cuda, &twin);
    assert_eq!(cuda.memory().mapped_bytes(), 2 * page);
    assert_eq!(read(&x)?, vec![0x11; x.len()], "page 0 survived");
    assert_eq!(read(&z)?, vec![0x33; z.len()], "page 2 survived");
    // The hole is mapped again on demand.
    let w = cuda.allocate(page)?;
    fill_and_check(&w, 0x77)?;
    assert_eq!(read(&x)?, vec![0x11; x.len()]);
    assert_eq!(read(&z)?, vec![0x33; z.len()]);
    Ok(())
}

#[test]
fn cuda_mapping_more_than_the_device_has_fails_with_out_of_memory_and_leaks_nothing() -> TestResult
{
    let Some(_device) = device_alone() else { return Ok(()) };
    let mem = CudaMemory::new(0)?;
    if !mem.supports_expandable() {
        skip("CUDA device 0 lacks virtual memory management (expandable segments)");
        return Ok(());
    }
    let size = (mem.mem_info().total as usize + 4 * PAGE_SIZE).next_multiple_of(PAGE_SIZE);
    let base = mem.reserve(size)?;
    let free_before = mem.mem_info().free;
    // SAFETY: `[base, base + size)` is a fresh reservation with nothing mapped.
    match unsafe { mem.map(base, size) } {
        Err(RawError::OutOfMemory { requested }) => assert_eq!(requested, size),
        other => panic!("mapping more than the device holds gave {other:?}"),
    }
    assert_eq!(mem.mapped_bytes(), 0, "nothing stays mapped");
    let free_after = mem.mem_info().free;
    assert!(
        free_after + 64 * MIB as u64 >= free_before,
        "the pages created before running out were released: {free_before} -> {free_after}"
    );
    // The reservation is still usable.
    // SAFETY: as above; the failed call mapped nothing.
    unsafe { mem.map(base, PAGE_SIZE) }?;
    assert_eq!(mem.mapped_bytes(), PAGE_SIZE);
    // SAFETY: the page was just mapped and no work uses it; then nothing is mapped.
    unsafe {
        mem.unmap(base, PAGE_SIZE);
        mem.release(base, size);
    }
    assert_eq!(mem.mapped_bytes(), 0);
    Ok(())
}

#[test]
fn cuda_events_for_pending_frees_are_pooled_and_reused() -> TestResult {
    let Some(_device) = device() else { return Ok(()) };
    let mem = CudaMemory::new(0)?;
    let first = mem.record_event(Stream::DEFAULT)?;
    let raw = first.raw();
    mem.synchronize_event(&first);
    assert!(mem.event_completed(&first));
    mem.destroy_event(first);
    assert_eq!(mem.idle_events(), 1, "the event went back to the pool");
    let again = mem.record_event(Stream::DEFAULT)?;
    assert_eq!(again.raw(), raw, "the pooled event is recorded again");
    assert_eq!(mem.idle_events(), 0);
    mem.synchronize_event(&again);
    mem.destroy_event(again);
    // The pool is bounded.
    let many = (0..MAX_IDLE_EVENTS + 5)
        .map(|_| mem.record_event(Stream::DEFAULT))
        .collect::<Result<Vec<_>, _>>()?;
    mem.synchronize_all();
    for e in many {
        mem.destroy_event(e);
    }
    assert_eq!(mem.idle_events(), MAX_IDLE_EVENTS);

    // Through the cache: a cross-stream free takes an event, and the next one reuses it.
    let cache = cache()?;
    let _context = PrimaryContext::bind()?;
    let stream = result::stream::create(result::stream::StreamKind::NonBlocking)?;
    for round in 0..3 {
        let a = cache.allocate(4 * MIB)?;
        a.record_stream(Stream(stream as u64));
        drop(a);
        // SAFETY: `stream` was created above and is not destroyed yet.
        unsafe { result::stream::synchronize(stream) }?;
        drop(cache.allocate(4 * MIB)?); // processes the completed event
        assert_eq!(cache.memory().idle_events(), 1, "round {round}: one event, reused");
    }
    assert_eq!(cache.memory_stats().num_device_alloc, 1);
    // SAFETY: `stream` was created above; no work is queued on it any more.
    unsafe { result::stream::destroy(stream) }?;
    Ok(())
}

/// A cache dropped with a gigabyte cached gives it back to the device (its `cuMemAlloc`
/// segments are freed), as `empty_cache` would.
#[test]
fn cuda_dropping_the_cache_frees_its_segments() -> TestResult {
    let Some(_device) = device_alone() else { return Ok(()) };
    let _context = PrimaryContext::bind()?;
    let cache = cache()?;
    let before = cache.mem_info().free;
    let blocks: Vec<_> = (0..4).map(|_| cache.allocate(256 * MIB)).collect::<Result<_, _>>()?;
    assert!(before - cache.mem_info().free >= 1 << 30, "a gigabyte is held");
    drop(blocks);
    assert!(before - cache.mem_info().free >= 1 << 30, "and stays cached");
    drop(cache);
    let after = CudaMemory::new(0)?.mem_info().free;
    assert!(
        after + (64 * MIB) as u64 >= before,
        "free {after} B after the drop, {before} B before"
    );
    Ok(())
}

/// With virtual memory management, segments come at increasing addresses in the order they
/// are allocated (as on `VirtualMemory`), whatever their sizes and pools, and after a
/// segment is freed: the policy's ties between equal blocks then go as on a virtual device.
#[test]
fn cuda_segments_come_in_allocation_order() -> TestResult {
    let Some(_device) = device() else { return Ok(()) };
    let mem = CudaMemory::new(0)?;
    if mem.granularity().is_none() {
        skip("CUDA device 0 lacks virtual memory management (ordered segment addresses)");
        return Ok(());
    }
    let total = mem.mem_info().total;
    let cuda = CachingAllocator::new(mem);
    let twin = CachingAllocator::new(VirtualMemory::new(total));
    /// The workload's segment addresses, in the order they were allocated.
    fn segments<M: DeviceMemory>(
        cache: &CachingAllocator<M>,
        check: impl Fn(&Allocation<M>) -> TestResult,
    ) -> Result<Vec<u64>, Box<dyn Error>> {
        cache.record_history(Some(1000));
        let mut live = Vec::new();
        for size in [30 * MIB, 512, 3 * MIB, 100 * MIB, 2 * MIB, 5000, 21 * MIB] {
            let a = cache.allocate(size)?;
            check(&a)?;
            live.push(a);
        }
        live.swap_remove(3);
        cache.empty_cache();
        live.push(cache.allocate(100 * MIB)?);
        for a in &live {
            check(a)?;
        }
        let trace = cache.trace();
        let allocs = trace.iter().filter(|e| e.action == vram_alloc::TraceAction::SegmentAlloc);
        Ok(allocs.map(|e| e.addr).collect())
    }
    let on_cuda = segments(&cuda, |a| fill_and_check(a, 0x42))?;
    let on_twin = segments(&twin, |_| Ok(()))?;
    assert_eq!(on_cuda.len(), on_twin.len(), "{on_cuda:x?}");
    assert!(on_cuda.len() >= 5, "{on_cuda:x?}");
    assert!(on_cuda.windows(2).all(|w| w[0] < w[1]), "increasing: {on_cuda:x?}");
    let offsets = |v: &[u64]| v.iter().map(|a| a - v[0]).collect::<Vec<_>>();
    assert_eq!(offsets(&on_cuda), offsets(&on_twin), "laid out as on the virtual device");
    Ok(())
}
