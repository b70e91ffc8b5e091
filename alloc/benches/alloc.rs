//! Allocator speed: a cached malloc+free pair, the raw backend's pair for comparison, and
//! RMM's random-allocations pattern (which also reports fragmentation with and without
//! expandable segments).

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use std::hint::black_box;
use vram_alloc::{AllocatorConfig, CachingAllocator, DeviceMemory, HostMemory, VirtualMemory};

const SIZES: [(usize, &str); 4] =
    [(512, "512B"), (64 << 10, "64KiB"), (4 << 20, "4MiB"), (64 << 20, "64MiB")];

fn cached_pair(c: &mut Criterion) {
    let mut group = c.benchmark_group("cached_pair");
    for (size, label) in SIZES {
        let cache = CachingAllocator::new(HostMemory::new(1 << 30));
        drop(cache.allocate(size).unwrap());
        group.bench_function(BenchmarkId::from_parameter(label), |b| {
            b.iter(|| drop(black_box(cache.allocate(black_box(size)).unwrap())))
        });
        assert_eq!(
            cache.memory_stats().num_device_alloc,
            1,
            "every pair was served from the cache"
        );
    }
    group.finish();
}

fn raw_pair(c: &mut Criterion) {
    let mut group = c.benchmark_group("raw_pair");
    let mem = HostMemory::new(1 << 30);
    for (size, label) in SIZES {
        group.bench_function(BenchmarkId::from_parameter(label), |b| {
            b.iter(|| {
                let p = mem.allocate(black_box(size)).unwrap();
                // SAFETY: `p` was just allocated with `size` and is unused.
                unsafe { mem.deallocate(p, size) };
            })
        });
    }
    group.finish();
}

/// RMM's random_allocations: each step allocates (73%) a size uniform in [1, max] or frees a
/// random live allocation.
fn pattern(ops: usize, max: usize, seed: u64) -> Vec<Option<usize>> {
    let mut x = seed;
    let mut next = move || {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        x >> 11
    };
    (0..ops)
        .map(|_| if next() % 100 < 73 { Some(1 + next() as usize % max) } else { None })
        .collect()
}

/// Runs the pattern; returns fragmentation (1 - allocated/reserved) at the peak of reserved.
fn run(cache: &CachingAllocator<VirtualMemory>, steps: &[Option<usize>], seed: u64) -> f64 {
    let mut live = Vec::new();
    let mut pick = seed | 1;
    let (mut peak_reserved, mut allocated_at_peak) = (0, 0);
    for s in steps {
        match s {
            Some(size) => live.push(cache.allocate(*size).unwrap()),
            None if !live.is_empty() => {
                pick = pick.wrapping_mul(6364136223846793005).wrapping_add(1);
                let i = (pick >> 33) as usize % live.len();
                live.swap_remove(i);
            }
            None => {}
        }
        let reserved = cache.memory_reserved();
        if reserved > peak_reserved {
            peak_reserved = reserved;
            allocated_at_peak = cache.memory_allocated();
        }
    }
    1.0 - allocated_at_peak as f64 / peak_reserved.max(1) as f64
}

fn random_mix(c: &mut Criterion) {
    let mut group = c.benchmark_group("random_mix");
    for ops in [1000, 10000] {
        for max_mib in [1, 4, 64] {
            let steps = pattern(ops, max_mib << 20, 42);
            for (conf, tag) in [("", "plain"), ("expandable_segments:True", "expandable")] {
                let config = AllocatorConfig::parse(conf).unwrap();
                let make = || {
                    CachingAllocator::with_config(VirtualMemory::new(1 << 40), config.clone())
                        .unwrap()
                };
                let frag = run(&make(), &steps, 7);
                eprintln!(
                    "random_mix/{ops}/{max_mib}MiB/{tag}: fragmentation at peak reserved {:.1}%",
                    frag * 100.0
                );
                group.bench_function(format!("{ops}/{max_mib}MiB/{tag}"), |b| {
                    b.iter_batched(
                        make,
                        |cache| run(&cache, &steps, 7),
                        criterion::BatchSize::LargeInput,
                    )
                });
            }
        }
    }
    group.finish();
}

criterion_group!(benches, cached_pair, raw_pair, random_mix);
criterion_main!(benches);
