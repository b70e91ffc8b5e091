//! The allocator's speed on a CUDA device: an allocate + free pair served from the cache
//! against the raw pair it saves (`cuMemAlloc` + `cuMemFree`), at the sizes of the host
//! criterion bench (`benches/alloc.rs`). Prints a Markdown table and one JSON line
//! (`{"pairs": [...]}`) for scripts; `xtask/gpu/torch_bench.py` times PyTorch's caching
//! allocator on the same sizes in the same run.
//!
//! On a machine without a usable CUDA device it prints `skipped: no CUDA device (...)` and
//! exits 0.
//!
//! `cargo run --release -p vram-alloc --example cuda_pairs`

use cudarc::driver::result;
use std::hint::black_box;
use std::time::Instant;
use vram_alloc::cuda::CudaMemory;
use vram_alloc::{CachingAllocator, DeviceMemory};

const SIZES: [(usize, &str); 4] =
    [(512, "512B"), (64 << 10, "64KiB"), (4 << 20, "4MiB"), (64 << 20, "64MiB")];

/// Nanoseconds per call of `f`, the best of `rounds` rounds of `iters` calls (after one
/// warm-up round): the least disturbed measurement.
fn ns_per_pair(rounds: usize, iters: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..iters {
        f();
    }
    (0..rounds)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..iters {
                f();
            }
            start.elapsed().as_nanos() as f64 / iters as f64
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    let raw = match CudaMemory::new(0) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            return;
        }
    };
    println!("device: {}", raw.name());
    println!(
        "| size | cached pair (ns) | raw cuMemAlloc + cuMemFree (ns) | raw / cached | \
         vram segment pair, ordered addresses (ns) |"
    );
    println!("|---|---:|---:|---:|---:|");
    let cache = CachingAllocator::new(CudaMemory::new(0).expect("opened above"));
    let mut rows = Vec::new();
    for (size, label) in SIZES {
        drop(cache.allocate(size).expect("the first allocation fits"));
        let before = cache.memory_stats().num_device_alloc;
        let cached = ns_per_pair(5, 100_000, || {
            drop(black_box(cache.allocate(black_box(size)).expect("served from the cache")));
        });
        let device_calls = cache.memory_stats().num_device_alloc - before;
        // `mem_info` makes the device's primary context current on this thread.
        let _ = raw.mem_info();
        let raw_ns = ns_per_pair(5, 200, || {
            // SAFETY: the primary context is current; the memory is freed right away.
            let p = unsafe { result::malloc_sync(black_box(size)) }.expect("cuMemAlloc");
            // SAFETY: `p` was just allocated and nothing uses it.
            unsafe { result::free_sync(p) }.expect("cuMemFree");
        });
        // The segments vram's cache asks for: cuMemCreate + cuMemMap at increasing addresses.
        let ordered_ns = ns_per_pair(5, 200, || {
            let p = raw.allocate(black_box(size)).expect("a segment");
            // SAFETY: `p` was just allocated with `size` and nothing uses it.
            unsafe { raw.deallocate(p, size) };
        });
        println!(
            "| {label} | {cached:.1} | {raw_ns:.0} | {:.0}x | {ordered_ns:.0} |",
            raw_ns / cached
        );
        rows.push(serde_json::json!({
            "size": size, "cached_ns": cached, "raw_ns": raw_ns, "ordered_ns": ordered_ns,
            "device_allocs_during_cached": device_calls,
        }));
        assert_eq!(device_calls, 0, "every timed pair was served from the cache");
    }
    println!("{}", serde_json::json!({ "pairs": rows }));
}
