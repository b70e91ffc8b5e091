//! A driver for instruction counts of the cached pair: `N` allocate + free pairs of one
//! size, served from the cache, on host memory (as `benches/alloc.rs`'s `cached_pair`).
//! Run it under `valgrind --tool=cachegrind` twice, with `N` and with 0 pairs: the
//! difference over `N` is the instructions per pair, free of start-up costs.
//!
//! `cargo build --profile bench -p vram-alloc --example host_pairs`, then
//! `valgrind --tool=cachegrind target/release/examples/host_pairs 65536 100000`.

use std::hint::black_box;
use vram_alloc::{CachingAllocator, HostMemory};

fn main() {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<usize>().expect("a number"));
    let size = args.next().unwrap_or(512);
    let pairs = args.next().unwrap_or(100_000);
    let cache = CachingAllocator::new(HostMemory::new(1 << 30));
    drop(cache.allocate(size).unwrap());
    for _ in 0..pairs {
        drop(black_box(cache.allocate(black_box(size)).unwrap()));
    }
    assert_eq!(cache.memory_stats().num_device_alloc, 1, "every pair was served from the cache");
}
