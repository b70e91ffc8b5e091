//! One test per policy rule, on the virtual and host backends.

use vram_alloc::{
    AllocError, AllocatorConfig, CachingAllocator, HostMemory, Stream, TraceAction, VirtualMemory,
    replay::Recording,
};

const MIB: usize = 1 << 20;
const GIB: u64 = 1 << 30;

fn virt(capacity: u64) -> CachingAllocator<VirtualMemory> {
    CachingAllocator::new(VirtualMemory::new(capacity))
}

fn virt_with(capacity: u64, conf: &str) -> CachingAllocator<VirtualMemory> {
    CachingAllocator::with_config(
        VirtualMemory::new(capacity),
        AllocatorConfig::parse(conf).unwrap(),
    )
    .unwrap()
}

#[test]
fn requests_round_to_512_bytes_and_pools_split_at_1_mib() {
    let c = virt(GIB);
    let a = c.allocate(1).unwrap();
    let s = c.memory_stats();
    assert_eq!(s.allocated_bytes.small_pool.current, 512);
    assert_eq!(s.requested_bytes.small_pool.current, 1);
    assert_eq!(s.reserved_bytes.small_pool.current, 2 << 20, "small pool segments are 2 MiB");
    let b = c.allocate(MIB + 1).unwrap();
    let s = c.memory_stats();
    assert_eq!(s.allocated_bytes.large_pool.current as usize, MIB + 512);
    assert_eq!(
        s.reserved_bytes.large_pool.current as usize,
        20 * MIB,
        "under 10 MiB: 20 MiB segment"
    );
    // 10 MiB + 1 rounds to 10 MiB + 512: the cached 19 MiB remainder is the best fit.
    let d = c.allocate(10 * MIB + 1).unwrap();
    assert_eq!(c.memory_stats().reserved_bytes.large_pool.current as usize, 20 * MIB);
    // On a fresh cache it gets a segment of its own size, rounded to 2 MiB.
    let fresh = virt(GIB);
    let _e = fresh.allocate(10 * MIB + 1).unwrap();
    assert_eq!(fresh.memory_reserved() as usize, 12 * MIB);
    assert_eq!(a.ptr() % 512, 0);
    assert_eq!(b.ptr() % 512, 0);
    assert_eq!(d.ptr() % 512, 0);
}

#[test]
fn freed_blocks_are_reused_without_device_calls() {
    let c = virt(GIB);
    let first = c.allocate(4 * MIB).unwrap().ptr();
    let again = c.allocate(4 * MIB).unwrap().ptr();
    assert_eq!(first, again);
    assert_eq!(c.memory_stats().num_device_alloc, 1);
}

#[test]
fn best_fit_picks_the_smallest_free_block_that_fits() {
    let c = virt(GIB);
    // Three segments of 12, 16 and 14 MiB (each request >= 10 MiB gets its own size).
    let a = c.allocate(12 * MIB).unwrap();
    let b = c.allocate(16 * MIB).unwrap();
    let d = c.allocate(14 * MIB).unwrap();
    let (pa, pb, pd) = (a.ptr(), b.ptr(), d.ptr());
    drop((a, b, d));
    assert_eq!(c.allocate(13 * MIB).unwrap().ptr(), pd, "14 MiB is the best fit for 13 MiB");
    assert_eq!(c.allocate(15 * MIB).unwrap().ptr(), pb);
    assert_eq!(c.allocate(11 * MIB).unwrap().ptr(), pa);
}

#[test]
fn large_blocks_split_only_when_more_than_1_mib_remains() {
    let c = virt(GIB);
    // 19.5 MiB from a 20 MiB segment: 0.5 MiB would remain, so the whole block is handed out.
    let a = c.allocate(19 * MIB + MIB / 2).unwrap();
    assert_eq!(c.memory_stats().allocated_bytes.all.current as usize, 20 * MIB);
    drop(a);
    // 18 MiB: 2 MiB remains, so it is split off and cached as an inactive split block.
    let _b = c.allocate(18 * MIB).unwrap();
    let s = c.memory_stats();
    assert_eq!(s.allocated_bytes.all.current as usize, 18 * MIB);
    assert_eq!(s.inactive_split_bytes.all.current as usize, 2 * MIB);
    assert_eq!(s.inactive_split.all.current, 1);
}

#[test]
fn small_blocks_split_down_to_512_bytes() {
    let c = virt(GIB);
    let blocks: Vec<_> = (0..4096).map(|_| c.allocate(512).unwrap()).collect();
    assert_eq!(c.memory_stats().segment.all.current, 1, "4096 x 512 B fill one 2 MiB segment");
    assert_eq!(c.memory_stats().inactive_split_bytes.all.current, 0);
    drop(blocks);
    assert_eq!(c.memory_stats().inactive_split.all.current, 0, "all coalesced into one block");
}

#[test]
fn free_neighbours_coalesce_and_whole_segments_are_released() {
    let c = virt(GIB);
    let a = c.allocate(4 * MIB).unwrap();
    let b = c.allocate(4 * MIB).unwrap();
    let d = c.allocate(4 * MIB).unwrap();
    assert_eq!(c.memory_stats().segment.all.current, 1);
    drop(a);
    drop(d);
    c.empty_cache();
    assert_eq!(c.memory_reserved() as usize, 20 * MIB, "a live block pins its segment");
    drop(b);
    let snap = c.snapshot();
    assert_eq!(snap.segments[0].blocks.len(), 1, "three free neighbours coalesced into one");
    c.empty_cache();
    assert_eq!(c.memory_reserved(), 0);
    assert_eq!(c.memory_stats().num_device_free, 1);
}

#[test]
fn oversize_blocks_serve_only_oversize_requests_within_20_mib() {
    let c = virt_with(4 * GIB, "max_split_size_mb:40");
    let big = c.allocate(50 * MIB).unwrap();
    let ptr = big.ptr();
    assert_eq!(c.memory_stats().oversize_allocations.current, 1);
    drop(big);
    let small = c.allocate(12 * MIB).unwrap();
    assert_ne!(small.ptr(), ptr, "a non-oversize request never takes an oversize block");
    let near = c.allocate(45 * MIB).unwrap();
    assert_eq!(near.ptr(), ptr, "45 MiB is within 20 MiB of the 50 MiB block");
    assert_eq!(
        c.memory_stats().allocated_bytes.all.current as usize,
        12 * MIB + 50 * MIB,
        "not split"
    );
    drop(near);
    let far = c.allocate(41 * MIB).unwrap();
    assert_eq!(far.ptr(), ptr, "41 + 20 > 50: still served");
    drop(far);
    let c2 = virt_with(4 * GIB, "max_split_size_mb:40");
    let huge = c2.allocate(100 * MIB).unwrap();
    let hp = huge.ptr();
    drop(huge);
    assert_ne!(c2.allocate(60 * MIB).unwrap().ptr(), hp, "100 >= 60 + 20: not served");
}

#[test]
fn blocks_are_never_shared_across_streams() {
    let c = virt(GIB);
    let a = c.allocate_on(4 * MIB, Stream(1)).unwrap();
    let p = a.ptr();
    drop(a);
    let b = c.allocate_on(4 * MIB, Stream(2)).unwrap();
    assert_ne!(b.ptr(), p);
    assert_eq!(c.memory_stats().segment.all.current, 2);
    assert_eq!(c.allocate_on(4 * MIB, Stream(1)).unwrap().ptr(), p);
}

#[test]
fn record_stream_delays_reuse_until_the_other_stream_completes() {
    let c = virt(GIB);
    let other = Stream(7);
    c.memory().streams().hold(other);
    let a = c.allocate(4 * MIB).unwrap();
    let p = a.ptr();
    a.record_stream(other);
    drop(a);
    let s = c.memory_stats();
    assert_eq!(s.allocated_bytes.all.current, 0);
    assert_eq!(s.active_bytes.all.current as usize, 4 * MIB, "pending free stays active");
    assert_eq!(c.snapshot().segments[0].blocks[0].state, "active_pending_free");
    let b = c.allocate(4 * MIB).unwrap();
    assert_ne!(b.ptr(), p, "not reused while stream 7 may still use it");
    drop(b);
    c.memory().streams().release(other);
    let d = c.allocate(4 * MIB).unwrap();
    assert_eq!(d.ptr(), p, "reused once the event completed");
}

#[test]
fn out_of_memory_frees_the_cache_and_retries() {
    let c = virt(64 << 20);
    let a = c.allocate(30 * MIB).unwrap();
    let b = c.allocate(30 * MIB).unwrap();
    drop((a, b));
    // 60 MiB cached; a 40 MiB request fits only after the cached segments are released.
    let big = c.allocate(40 * MIB).unwrap();
    assert_eq!(c.memory_reserved() as usize, 40 * MIB);
    let s = c.memory_stats();
    assert_eq!(s.num_ooms, 0);
    assert!(s.num_device_free >= 2);
    drop(big);
}

#[test]
fn out_of_memory_error_reports_and_changes_no_live_state() {
    let c = virt(100 << 20);
    let keep = c.allocate(60 * MIB).unwrap();
    let before = c.snapshot();
    let err = c.allocate(60 * MIB).unwrap_err();
    let AllocError::OutOfMemory(oom) = &err else { panic!("expected OOM, got {err}") };
    assert_eq!(oom.requested, 60 * MIB);
    assert_eq!(oom.device_total, 100 << 20);
    assert_eq!(oom.allocated as usize, 60 * MIB);
    let text = err.to_string();
    for needle in ["60.00 MiB", "100.00 MiB", "allocated", "reserved", "batch size"] {
        assert!(text.contains(needle), "{text} lacks {needle}");
    }
    assert_eq!(c.snapshot(), before, "a failed allocation changes no live state");
    assert_eq!(c.memory_stats().num_ooms, 1);
    assert_eq!(c.memory_stats().num_alloc_retries, 1);
    drop(keep);
}

#[test]
fn memory_fraction_caps_reserved_memory_though_the_device_has_room() {
    let c = virt(GIB);
    c.set_memory_fraction(0.25).unwrap();
    assert_eq!(c.memory_cap(), Some(GIB / 4));
    let a = c.allocate(200 * MIB).unwrap();
    let err = c.allocate(100 * MIB).unwrap_err();
    assert!(err.is_out_of_memory());
    assert!(err.to_string().contains("memory fraction"), "{err}");
    assert!(c.mem_info().free > 500 << 20, "the device itself had room");
    assert!(c.max_memory_reserved() <= GIB / 4);
    assert!(c.set_memory_fraction(1.5).is_err());
    drop(a);
}

#[test]
fn empty_cache_is_idempotent_and_keeps_live_blocks() {
    let c = virt(GIB);
    let live = c.allocate(3 * MIB).unwrap();
    let gone = c.allocate(30 * MIB).unwrap();
    drop(gone);
    c.empty_cache();
    let once = c.snapshot();
    c.empty_cache();
    assert_eq!(c.snapshot(), once);
    assert_eq!(once.segments.len(), 1);
    assert_eq!(once.segments[0].blocks[0].address, live.ptr());
    assert_eq!(once.segments[0].blocks[0].state, "active_allocated");
}

#[test]
fn roundup_power2_divisions_round_large_requests() {
    let c = virt_with(8 * GIB, "roundup_power2_divisions:4");
    let _a = c.allocate(1200 * MIB).unwrap();
    assert_eq!(c.memory_stats().allocated_bytes.all.current as usize, 1280 * MIB);
}

#[test]
fn garbage_collection_frees_old_cached_segments_past_the_threshold() {
    let c = virt_with(GIB, "per_process_memory_fraction:0.5,garbage_collection_threshold:0.5");
    // Cap 512 MiB, threshold 256 MiB. Cache 300 MiB, then ask for more.
    let old: Vec<_> = (0..3).map(|_| c.allocate(100 * MIB).unwrap()).collect();
    drop(old);
    assert_eq!(c.memory_reserved() as usize, 300 * MIB);
    let _new = c.allocate(150 * MIB).unwrap();
    assert!(
        c.memory_reserved() as usize <= 256 * MIB + 150 * MIB,
        "cached segments beyond the threshold were collected: {}",
        c.memory_reserved()
    );
    assert_eq!(c.memory_stats().num_ooms, 0);
}

#[test]
fn expandable_segments_grow_one_range_instead_of_stranding_segments() {
    // Growing requests: without expandable segments each gets a new segment and the old
    // ones stay cached; with them, one range grows and reserved stays close to the need.
    let sizes: Vec<usize> = (1..=8).map(|i| i * 12 * MIB).collect();
    let run = |conf: &str| {
        let c = virt_with(4 * GIB, conf);
        for &s in &sizes {
            drop(c.allocate(s).unwrap());
        }
        let segments = c.snapshot().segments.len();
        (c.max_memory_reserved() as usize, c.memory_stats().segment.all.current, segments)
    };
    let (plain_peak, plain_segments, _) = run("");
    let (exp_peak, exp_segments, exp_ranges) = run("expandable_segments:True");
    assert_eq!(plain_segments, 8);
    // PyTorch leaves expandable segments out of the `segment` statistic.
    assert_eq!(exp_segments, 0);
    assert_eq!(exp_ranges, 1, "one mapped range");
    // The large pool maps 20 MiB pages: 96 MiB needs five.
    assert_eq!(exp_peak, 100 * MIB, "reserved grows to the largest request's pages");
    assert!(plain_peak > 3 * exp_peak, "plain {plain_peak} vs expandable {exp_peak}");
}

#[test]
fn expandable_segments_unmap_free_pages_on_empty_cache() {
    let c = virt_with(4 * GIB, "expandable_segments:True");
    // Each takes one 20 MiB page of the large pool.
    let a = c.allocate(20 * MIB).unwrap();
    let b = c.allocate(20 * MIB).unwrap();
    assert_eq!(c.memory_reserved() as usize, 40 * MIB);
    let stats = c.memory_stats();
    assert_eq!((stats.num_device_alloc, stats.segment.all.current), (2, 0));
    drop(a);
    c.empty_cache();
    assert_eq!(c.memory_reserved() as usize, 20 * MIB, "a's page was unmapped, b's kept");
    let snap = c.snapshot();
    assert_eq!(snap.reserved_bytes(), c.memory_reserved());
    // A free part of a page stays mapped.
    let d = c.allocate(10 * MIB).unwrap();
    drop(b);
    c.empty_cache();
    assert_eq!(c.memory_reserved() as usize, 20 * MIB, "d's page is partly in use");
    drop(d);
    c.empty_cache();
    assert_eq!(c.memory_reserved(), 0);
    assert!(c.snapshot().segments.is_empty(), "the empty range was released");
    assert_eq!(c.mem_info().free, 4 * GIB);
}

#[test]
fn expandable_segments_are_rejected_where_unsupported() {
    // The error names the setting to drop.
    struct NoExpand(VirtualMemory);
    impl vram_alloc::DeviceMemory for NoExpand {
        type Event = <VirtualMemory as vram_alloc::DeviceMemory>::Event;
        fn name(&self) -> String {
            "no-expand".into()
        }
        fn allocate(&self, size: usize) -> Result<u64, vram_alloc::RawError> {
            self.0.allocate(size)
        }
        unsafe fn deallocate(&self, ptr: u64, size: usize) {
            // SAFETY: forwarded unchanged from the caller.
            unsafe { self.0.deallocate(ptr, size) }
        }
        fn mem_info(&self) -> vram_alloc::MemInfo {
            self.0.mem_info()
        }
        fn record_event(&self, s: Stream) -> Result<Self::Event, vram_alloc::RawError> {
            self.0.record_event(s)
        }
        fn event_completed(&self, e: &Self::Event) -> bool {
            self.0.event_completed(e)
        }
        fn synchronize_event(&self, e: &Self::Event) {
            self.0.synchronize_event(e)
        }
        fn destroy_event(&self, e: Self::Event) {
            self.0.destroy_event(e)
        }
    }
    let err = CachingAllocator::with_config(
        NoExpand(VirtualMemory::new(GIB)),
        AllocatorConfig::default().with_expandable_segments(true),
    )
    .unwrap_err();
    assert!(err.to_string().contains("expandable_segments"), "{err}");
}

#[test]
fn statistics_track_peaks_and_resets() {
    let c = virt(GIB);
    let a = c.allocate(30 * MIB).unwrap();
    drop(a);
    assert_eq!(c.max_memory_allocated() as usize, 30 * MIB);
    c.reset_peak_stats();
    assert_eq!(c.max_memory_allocated(), 0);
    assert_eq!(c.max_memory_reserved() as usize, 30 * MIB, "reserved peak resets to current");
    let s = c.memory_stats();
    assert_eq!(s.get("allocated_bytes.all.allocated"), Some(30 << 20));
    c.reset_accumulated_stats();
    assert_eq!(c.memory_stats().get("allocated_bytes.all.allocated"), Some(0));
}

#[test]
fn memory_summary_has_pytorchs_rows() {
    let c = virt(GIB);
    let _a = c.allocate(3 * MIB).unwrap();
    let text = c.memory_summary();
    for row in [
        "Allocated memory",
        "Active memory",
        "Requested memory",
        "GPU reserved memory",
        "Non-releasable memory",
        "Allocations",
        "from large pool",
        "from small pool",
        "Oversize allocations",
        "OOMs: 0",
    ] {
        assert!(text.contains(row), "summary lacks {row}:\n{text}");
    }
    // PyTorch's unit rule: the unit steps up only past 768 of it, so 20 MiB shows in KiB.
    assert!(text.contains("20480 KiB"), "reserved 20 MiB shown:\n{text}");
    assert!(text.lines().all(|l| l.chars().count() == 77), "every line is 77 wide:\n{text}");
}

#[test]
fn trace_is_bounded_and_names_pytorch_actions() {
    let c = virt(GIB);
    c.record_history(Some(5));
    for _ in 0..10 {
        drop(c.allocate(MIB).unwrap());
    }
    let t = c.trace();
    assert_eq!(t.len(), 5);
    assert!(t.iter().all(|e| matches!(
        e.action,
        TraceAction::Alloc | TraceAction::FreeRequested | TraceAction::FreeCompleted
    )));
    let json = serde_json::to_string(&t[0]).unwrap();
    assert!(json.contains("\"action\":\"") && json.contains("time_us"));
    c.record_history(None);
    drop(c.allocate(MIB).unwrap());
    assert_eq!(c.trace().len(), 0);
}

#[test]
fn snapshot_exports_json_and_a_pickle_of_the_same_dict() {
    let c = virt(GIB);
    c.record_history(Some(100));
    let _a = c.allocate(3 * MIB).unwrap();
    let snap = c.snapshot();
    let json: serde_json::Value = serde_json::from_str(&snap.to_json()).unwrap();
    assert_eq!(json["segments"][0]["blocks"][0]["state"], "active_allocated");
    assert_eq!(json["device_traces"][0][0]["action"], "segment_alloc");
    let pickle = snap.to_pickle();
    assert_eq!(pickle[0], 0x80, "pickle protocol header");
    let back: serde_json::Value = serde_pickle::from_slice(&pickle, Default::default()).unwrap();
    assert_eq!(back["segments"][0]["total_size"], json["segments"][0]["total_size"]);
}

#[test]
fn a_recorded_trace_replays_to_the_same_figures_on_another_backend() {
    let recorded = virt(80 * GIB);
    recorded.record_history(Some(1 << 20));
    let mut live = Vec::new();
    for i in 0..200usize {
        live.push(recorded.allocate((i * 7919) % (64 * MIB) + 1).unwrap());
        if i % 3 == 0 {
            live.swap_remove(i % live.len());
        }
    }
    drop(live);
    let rec = Recording::capture(&recorded);
    let path = std::env::temp_dir().join(format!("vram-replay-{}.json", std::process::id()));
    rec.save(&path).unwrap();
    let loaded = Recording::load(&path).unwrap();
    std::fs::remove_file(&path).ok();
    assert_eq!(loaded, rec);
    let replayed = virt(80 * GIB);
    let report = loaded.replay(&replayed);
    assert_eq!(report.failed_allocations, 0);
    assert_eq!(report.allocations, 200);
    assert_eq!(report.peak_allocated, recorded.max_memory_allocated());
    assert_eq!(report.peak_reserved, recorded.max_memory_reserved());
    // Replayed on a host device of 1 GiB, it fits too, with identical figures.
    let host = CachingAllocator::new(HostMemory::new(GIB));
    let report = loaded.replay(&host);
    assert_eq!(report.peak_reserved, recorded.max_memory_reserved());
}

#[test]
fn host_memory_gives_real_bytes_and_fails_over_its_cap() {
    let c = CachingAllocator::new(HostMemory::new(64 << 20));
    let mut a = c.allocate(1000).unwrap();
    assert!(a.as_bytes().iter().all(|&b| b == 0), "fresh segments are zeroed");
    a.as_bytes_mut().fill(7);
    assert_eq!(a.as_bytes()[999], 7);
    let err = c.allocate(80 * MIB).unwrap_err();
    assert!(err.is_out_of_memory());
    assert_eq!(a.as_bytes()[0], 7, "the live allocation is intact after the OOM");
}

#[test]
fn concurrent_threads_allocate_and_free_consistently() {
    let c = virt(4 * GIB);
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let c = c.clone();
            s.spawn(move || {
                let mut live = Vec::new();
                for i in 0..2000usize {
                    live.push(c.allocate_on((i * 4099) % (3 * MIB) + 1, Stream(t)).unwrap());
                    if i % 2 == 0 || live.len() > 64 {
                        live.remove(0);
                    }
                }
            });
        }
    });
    assert_eq!(c.memory_allocated(), 0);
    assert_eq!(c.memory_stats().active_bytes.all.current, 0);
    c.empty_cache();
    assert_eq!(c.memory_reserved(), 0);
}

/// Virtual memory that counts what the cache holds of it: segments allocated, bytes mapped
/// and address ranges reserved, in counters the test keeps after the cache is gone.
struct Counted {
    inner: VirtualMemory,
    held: std::sync::Arc<[std::sync::atomic::AtomicI64; 3]>,
}

impl Counted {
    fn add(&self, which: usize, bytes: usize, sign: i64) {
        self.held[which].fetch_add(sign * bytes as i64, std::sync::atomic::Ordering::Relaxed);
    }
}

impl vram_alloc::DeviceMemory for Counted {
    type Event = <VirtualMemory as vram_alloc::DeviceMemory>::Event;
    fn name(&self) -> String {
        self.inner.name()
    }
    fn allocate(&self, size: usize) -> Result<vram_alloc::DevicePtr, vram_alloc::RawError> {
        let p = self.inner.allocate(size)?;
        self.add(0, size, 1);
        Ok(p)
    }
    unsafe fn deallocate(&self, ptr: vram_alloc::DevicePtr, size: usize) {
        self.add(0, size, -1);
        // SAFETY: forwarded from the caller.
        unsafe { self.inner.deallocate(ptr, size) }
    }
    fn mem_info(&self) -> vram_alloc::MemInfo {
        self.inner.mem_info()
    }
    fn record_event(&self, stream: Stream) -> Result<Self::Event, vram_alloc::RawError> {
        self.inner.record_event(stream)
    }
    fn event_completed(&self, event: &Self::Event) -> bool {
        self.inner.event_completed(event)
    }
    fn synchronize_event(&self, event: &Self::Event) {
        self.inner.synchronize_event(event);
    }
    fn destroy_event(&self, event: Self::Event) {
        self.inner.destroy_event(event);
    }
    fn supports_expandable(&self) -> bool {
        true
    }
    fn reserve(&self, size: usize) -> Result<vram_alloc::DevicePtr, vram_alloc::RawError> {
        let p = self.inner.reserve(size)?;
        self.add(2, size, 1);
        Ok(p)
    }
    unsafe fn map(
        &self,
        ptr: vram_alloc::DevicePtr,
        size: usize,
    ) -> Result<(), vram_alloc::RawError> {
        // SAFETY: forwarded from the caller.
        unsafe { self.inner.map(ptr, size) }?;
        self.add(1, size, 1);
        Ok(())
    }
    unsafe fn unmap(&self, ptr: vram_alloc::DevicePtr, size: usize) {
        self.add(1, size, -1);
        // SAFETY: forwarded from the caller.
        unsafe { self.inner.unmap(ptr, size) }
    }
    unsafe fn release(&self, ptr: vram_alloc::DevicePtr, size: usize) {
        self.add(2, size, -1);
        // SAFETY: forwarded from the caller.
        unsafe { self.inner.release(ptr, size) }
    }
}

/// Dropping the cache (its last handle, after its last allocation) gives every segment,
/// mapped page and reserved range back to the device, frees pending on another stream
/// included: a CUDA cache dropped with memory cached used to keep its segments allocated
/// until the process exited (seen on the H100, one model after another in one process).
#[test]
fn dropping_the_cache_gives_every_segment_back() {
    for conf in ["", "expandable_segments:True", "max_split_size_mb:40"] {
        let held =
            std::sync::Arc::new(std::array::from_fn(|_| std::sync::atomic::AtomicI64::new(0)));
        let mem = Counted { inner: VirtualMemory::new(GIB), held: held.clone() };
        let cache =
            CachingAllocator::with_config(mem, AllocatorConfig::parse(conf).unwrap()).unwrap();
        let sizes = [512, 3 * MIB / 2, 7 * MIB, 30 * MIB, 100 * MIB, 5000];
        let mut live: Vec<_> = sizes.iter().map(|&s| cache.allocate(s).unwrap()).collect();
        live[3].record_stream(Stream(7));
        let kept = live.split_off(3);
        drop(live);
        let held_now = |i: usize| held[i].load(std::sync::atomic::Ordering::Relaxed);
        assert!(held_now(0) + held_now(1) > 0, "{conf:?}: memory is held while cached");
        let second = cache.clone();
        drop(cache);
        assert!(held_now(0) + held_now(1) > 0, "{conf:?}: a handle and allocations remain");
        drop(kept);
        assert!(held_now(0) + held_now(1) > 0, "{conf:?}: a handle remains");
        drop(second);
        assert_eq!([held_now(0), held_now(1), held_now(2)], [0, 0, 0], "{conf:?}: all given back");
    }
}

/// The cache outlives its last handle while allocations (empty ones and statistics scopes
/// included) hold it, from any thread, and is given back when the last of them goes.
#[test]
fn allocations_hold_the_cache_after_its_last_handle() {
    let held = std::sync::Arc::new(std::array::from_fn(|_| std::sync::atomic::AtomicI64::new(0)));
    let mem = Counted { inner: VirtualMemory::new(GIB), held: held.clone() };
    let cache = CachingAllocator::new(mem);
    let a = cache.allocate(7 * MIB).unwrap();
    let empty = cache.allocate(0).unwrap();
    let scope = cache.stats_scope();
    drop(cache);
    let held_now = |i: usize| held[i].load(std::sync::atomic::Ordering::Relaxed);
    let b = a.allocator().allocate(512).unwrap();
    let other = std::thread::spawn(move || drop(b));
    other.join().unwrap();
    drop(a);
    assert!(held_now(0) + held_now(1) > 0, "the empty allocation and the scope hold it");
    assert_eq!(scope.finish().allocation.all.allocated, 1, "b, after the scope began");
    assert!(held_now(0) + held_now(1) > 0, "the empty allocation holds it");
    drop(empty);
    assert_eq!([held_now(0), held_now(1), held_now(2)], [0, 0, 0], "all given back");
}

/// PyTorch's `cacheInfo` (what cuDNN's timed search sizes its workspace by): the device's
/// free memory, or the largest cached free block in any pool when larger.
#[test]
fn cache_info_is_the_larger_of_free_memory_and_the_largest_cached_block() {
    let c = virt(100 * MIB as u64);
    assert_eq!(c.cache_info(), 100 * MIB as u64, "an empty cache: the device's free memory");
    let (a, b) = (c.allocate(30 * MIB).unwrap(), c.allocate(8 * MIB).unwrap());
    drop((a, b));
    // 30 MiB and a 20 MiB segment cached, 50 MiB free on the device.
    assert_eq!(c.cache_info(), 50 * MIB as u64);
    let big = c.allocate(45 * MIB).unwrap();
    // 5 MiB free on the device; the 30 MiB block is the largest free one.
    assert_eq!(c.cache_info(), 30 * MIB as u64);
    drop(big);
    c.empty_cache();
    assert_eq!(c.cache_info(), 100 * MIB as u64);

    // A private pool's free blocks count too (PyTorch scans its graph pools).
    let pool = vram_alloc::MempoolId(0, 1);
    let fill = c.allocate(70 * MIB).unwrap();
    c.begin_allocate_to_pool(pool, None).unwrap();
    let p = c.allocate(24 * MIB).unwrap();
    c.end_allocate_to_pool(pool).unwrap();
    drop(p);
    // 6 MiB free on the device; the pool's 24 MiB block is cached.
    assert_eq!(c.cache_info(), 24 * MIB as u64);
    drop(fill);
}
