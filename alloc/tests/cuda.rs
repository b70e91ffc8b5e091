//! The caching allocator on a real CUDA device. Every test first probes device 0 and, when
//! there is none, prints `skipped: no CUDA device (<reason>)` and passes, so the file builds
//! and runs everywhere.
#![cfg(feature = "cuda")]

use cudarc::driver::{result, sys};
use std::error::Error;
use std::time::Instant;
use vram_alloc::cuda::{CudaMemory, probe};
use vram_alloc::{AllocError, CachingAllocator, Snapshot, Stream};

type TestResult = Result<(), Box<dyn Error>>;

const MIB: usize = 1 << 20;

/// Whether device 0 can be used; prints the skip line when it cannot. The line goes straight
/// to stderr (not through `eprintln!`, which the test harness captures) so that it shows in a
/// plain `cargo test` run.
fn have_device() -> bool {
    match probe(0) {
        Ok(_) => true,
        Err(reason) => {
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "skipped: no CUDA device ({reason})");
            false
        }
    }
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
    if !have_device() {
        return Ok(());
    }
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
    if !have_device() {
        return Ok(());
    }
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
    if !have_device() {
        return Ok(());
    }
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
    if !have_device() {
        return Ok(());
    }
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
    if !have_device() {
        return Ok(());
    }
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
    if !have_device() {
        return Ok(());
    }
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
    if !have_device() {
        return Ok(());
    }
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
