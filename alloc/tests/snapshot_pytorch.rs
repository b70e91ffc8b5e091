//! Snapshots from real allocator runs, read back as PyTorch's tools read them: the pickle is
//! loaded by Python's `pickle` and checked by `check_snapshot.py` (byte-identical to what
//! Python's pickler writes, PyTorch's keys and types, blocks tiling segments, every `alloc`
//! paired with its `free_completed`, the peak of live requested bytes over the trace equal to
//! `requested_bytes.all.peak`, `device_free` on OOMs). Skipped, with a visible line, where
//! `python3` is absent.
//!
//! Expectations come from the allocator's own statistics, not from a fixed layout, so these
//! tests hold whatever the policy decides.

use std::path::{Path, PathBuf};
use std::process::Command;
use vram_alloc::{
    AllocError, Allocation, AllocatorConfig, CachingAllocator, Snapshot, Stream, TraceAction,
    VirtualMemory,
};

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A request size: mostly small and medium, sometimes 2 to 6 GiB.
fn size(rng: &mut Rng) -> usize {
    match rng.below(20) {
        0..=7 => 1 + rng.below(MIB as u64) as usize,
        8..=16 => MIB + rng.below(100 * MIB as u64) as usize,
        17 | 18 => 10 * MIB + rng.below(900 * MIB as u64) as usize,
        _ => 2 * GIB + rng.below(4 * GIB as u64) as usize,
    }
}

/// Random allocations and frees, keeping at most `budget` requested bytes live.
fn churn(
    cache: &CachingAllocator<VirtualMemory>,
    rng: &mut Rng,
    steps: usize,
    budget: usize,
    live: &mut Vec<Allocation<VirtualMemory>>,
) {
    for _ in 0..steps {
        let held: usize = live.iter().map(|a| a.len()).sum();
        if !live.is_empty() && rng.below(5) < 2 {
            live.swap_remove(rng.below(live.len() as u64) as usize);
            continue;
        }
        let n = size(rng);
        if held + n > budget {
            continue;
        }
        let stream = if rng.below(8) == 0 { Stream(2) } else { Stream::DEFAULT };
        match cache.allocate_on(n, stream) {
            Ok(a) => live.push(a),
            Err(e) => assert!(e.is_out_of_memory(), "{e}"),
        }
    }
}

/// Where the files go: `VRAM_SNAPSHOT_DIR` (kept, e.g. to open them in PyTorch's memory
/// visualizer) or a temporary directory (removed).
fn out_dir() -> (PathBuf, bool) {
    let (dir, keep) = match std::env::var_os("VRAM_SNAPSHOT_DIR") {
        Some(d) => (PathBuf::from(d), true),
        None => (std::env::temp_dir().join(format!("vram-snapshot-{}", std::process::id())), false),
    };
    std::fs::create_dir_all(&dir).unwrap();
    (dir, keep)
}

/// Checks on the Rust side, then with Python's `pickle` (see `check_snapshot.py`).
fn check(name: &str, cache: &CachingAllocator<VirtualMemory>, flags: &[&str]) -> Snapshot {
    let snap = cache.snapshot();
    let stats = cache.memory_stats();
    assert_eq!(snap.reserved_bytes(), stats.reserved_bytes.all.current as u64);
    assert_eq!(snap.allocated_bytes(), stats.allocated_bytes.all.current as u64);
    let pickle = snap.to_pickle();
    let json = snap.to_json();
    assert_eq!(&pickle[..2], b"\x80\x04", "protocol 4, as pickle.dump writes");
    let from_pickle: serde_json::Value =
        serde_pickle::from_slice(&pickle, Default::default()).expect("a valid pickle");
    let from_json: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(from_pickle, from_json, "the pickle and the JSON hold the same dict");
    let back: Snapshot = serde_json::from_str(&json).unwrap();
    assert_eq!(back.segments, snap.segments);
    assert_eq!(back.device_traces, snap.device_traces);

    let (dir, keep) = out_dir();
    let pickle_path = dir.join(format!("{name}.pickle"));
    let json_path = dir.join(format!("{name}.json"));
    std::fs::write(&pickle_path, &pickle).unwrap();
    std::fs::write(&json_path, &json).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/check_snapshot.py");
    let peak = stats.requested_bytes.all.peak.to_string();
    let mut cmd = Command::new("python3");
    cmd.arg(&script).arg(&pickle_path).args(["--peak-requested", &peak]);
    cmd.arg("--json").arg(&json_path).args(flags);
    match cmd.output() {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            println!("skipped: python3 not found ({name}: Rust-side checks only)");
        }
        Err(e) => panic!("running python3: {e}"),
        Ok(out) => {
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            println!("{text}");
            assert!(out.status.success(), "check_snapshot.py failed on {name}:\n{text}");
        }
    }
    if !keep {
        std::fs::remove_file(&pickle_path).ok();
        std::fs::remove_file(&json_path).ok();
    }
    snap
}

fn has_trace(snap: &Snapshot, action: TraceAction) -> bool {
    snap.device_traces[0].iter().any(|e| e.action == action)
}

#[test]
fn random_workload_with_huge_blocks_an_oom_and_another_stream() {
    let cache = CachingAllocator::new(VirtualMemory::new(80 << 30));
    cache.record_history(Some(1 << 20));
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let mut live = Vec::new();
    churn(&cache, &mut rng, 600, 60 * GIB, &mut live);
    // Keep two blocks of at least 2 GiB in the snapshot.
    let huge = [cache.allocate(3 * GIB + 12345).unwrap(), cache.allocate(2 * GIB).unwrap()];
    // More than the device holds: an OOM, recorded with the device's free bytes.
    let err = cache.allocate(100 * GIB).unwrap_err();
    assert!(matches!(err, AllocError::OutOfMemory(_)), "{err}");
    // Free most of the rest, then let blocks wait for another stream (far below the peak).
    live.truncate(3);
    let other = Stream(7);
    cache.memory().streams().hold(other);
    for n in [MIB, 3 * MIB + 1, 40 * MIB] {
        let a = cache.allocate(n).unwrap();
        a.record_stream(other);
        drop(a);
    }
    let snap = check("random", &cache, &["--expect-oom", "--expect-pending"]);
    let blocks = || snap.segments.iter().flat_map(|s| &s.blocks);
    assert!(
        blocks().any(|b| b.state == "active_allocated" && b.size >= 3 << 30),
        "a live block of 3 GiB or more"
    );
    assert!(blocks().any(|b| b.state == "active_pending_free"));
    assert!(snap.segments.iter().any(|s| s.stream == 2), "a segment of another stream");
    let oom = snap.device_traces[0].iter().find(|e| e.action == TraceAction::Oom).unwrap();
    assert!(oom.addr.is_none() && oom.device_free.is_some() && oom.size >= 100 << 30);
    cache.memory().streams().release(other);
    drop((live, huge));
}

#[test]
fn expandable_segments_map_and_unmap() {
    let cache = CachingAllocator::with_config(
        VirtualMemory::new(80 << 30),
        AllocatorConfig::parse("expandable_segments:True").unwrap(),
    )
    .unwrap();
    cache.record_history(Some(1 << 20));
    let mut rng = Rng(0x0dd_ba11_cafe_f00d);
    let mut live = Vec::new();
    churn(&cache, &mut rng, 300, 50 * GIB, &mut live);
    live.truncate(live.len() / 2);
    cache.empty_cache();
    churn(&cache, &mut rng, 300, 50 * GIB, &mut live);
    live.push(cache.allocate(4 * GIB).unwrap());
    assert!(cache.allocate(200 * GIB).is_err());
    let snap = check("expandable", &cache, &["--expect-oom", "--expect-expandable"]);
    assert!(snap.allocator_settings.expandable_segments);
    assert!(snap.segments.iter().all(|s| s.is_expandable));
    assert!(
        has_trace(&snap, TraceAction::SegmentMap) && has_trace(&snap, TraceAction::SegmentUnmap)
    );
    assert!(
        snap.device_traces[0]
            .iter()
            .all(|e| !matches!(e.action, TraceAction::SegmentAlloc | TraceAction::SegmentFree)),
        "PyTorch traces no segment_alloc/segment_free for expandable segments"
    );
    drop(live);
}

#[test]
fn an_empty_cache_gives_pytorchs_empty_snapshot() {
    let cache = CachingAllocator::new(VirtualMemory::new(8 << 30));
    let snap = check("empty", &cache, &[]);
    assert!(snap.segments.is_empty() && snap.device_traces == vec![vec![]]);
}
