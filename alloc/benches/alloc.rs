//! Allocator speed: a cached malloc+free pair, the same pair in a naive best-fit cache and
//! the raw backend's pair for comparison (the ratio of the cached pair to the naive one,
//! measured in the same run, is printed), and RMM's random-allocations pattern (which also
//! reports fragmentation with and without expandable segments).

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use std::collections::{BTreeMap, BTreeSet};
use std::hint::black_box;
use std::sync::Mutex;
use std::time::{Duration, Instant};
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

/// A naive best-fit cache, as one first writes it: one lock; free blocks in a sorted set by
/// (size, address); every block in an address-ordered map; the remainder split off on
/// allocation and free neighbours of the same segment merged on free; 2 MiB segments at
/// least, never given back. No streams, statistics or PyTorch rules: the floor a caching
/// allocator's bookkeeping is measured against.
struct NaiveCache {
    mem: HostMemory,
    state: Mutex<NaiveState>,
}

#[derive(Default)]
struct NaiveState {
    free: BTreeSet<(usize, u64)>,
    /// address -> (size, free, segment base)
    blocks: BTreeMap<u64, (usize, bool, u64)>,
}

impl NaiveCache {
    fn new(mem: HostMemory) -> Self {
        NaiveCache { mem, state: Mutex::new(NaiveState::default()) }
    }

    fn allocate(&self, size: usize) -> u64 {
        let size = size.max(1).next_multiple_of(512);
        let mut s = self.state.lock().unwrap();
        let found = s.free.range((size, 0)..).next().copied();
        let (bsize, addr, seg) = match found {
            Some((bsize, addr)) => {
                s.free.remove(&(bsize, addr));
                (bsize, addr, s.blocks[&addr].2)
            }
            None => {
                let bsize = size.max(2 << 20);
                let addr = self.mem.allocate(bsize).expect("host memory");
                (bsize, addr, addr)
            }
        };
        if bsize > size {
            s.free.insert((bsize - size, addr + size as u64));
            s.blocks.insert(addr + size as u64, (bsize - size, true, seg));
        }
        s.blocks.insert(addr, (size, false, seg));
        addr
    }

    fn free(&self, addr: u64) {
        let mut s = self.state.lock().unwrap();
        let (mut size, _, seg) = s.blocks[&addr];
        let mut start = addr;
        let next = addr + size as u64;
        if let Some(&(nsize, true, nseg)) = s.blocks.get(&next)
            && nseg == seg
        {
            s.free.remove(&(nsize, next));
            s.blocks.remove(&next);
            size += nsize;
        }
        if let Some((&paddr, &(psize, true, pseg))) = s.blocks.range(..addr).next_back()
            && pseg == seg
            && paddr + psize as u64 == addr
        {
            s.free.remove(&(psize, paddr));
            s.blocks.remove(&addr);
            start = paddr;
            size += psize;
        }
        s.blocks.insert(start, (size, true, seg));
        s.free.insert((size, start));
    }
}

fn naive_pair(c: &mut Criterion) {
    let mut group = c.benchmark_group("naive_pair");
    for (size, label) in SIZES {
        let cache = NaiveCache::new(HostMemory::new(1 << 30));
        cache.free(cache.allocate(size));
        group.bench_function(BenchmarkId::from_parameter(label), |b| {
            b.iter(|| cache.free(black_box(cache.allocate(black_box(size)))))
        });
    }
    group.finish();
}

/// The cached pair's time over the naive cache's, measured here in alternating rounds (the
/// best of each), for each size: the figure the allocator's speed goal is stated in.
fn ratio_to_naive(_: &mut Criterion) {
    const PAIRS: u32 = 200_000;
    for (size, label) in SIZES {
        let cache = CachingAllocator::new(HostMemory::new(1 << 30));
        drop(cache.allocate(size).unwrap());
        let naive = NaiveCache::new(HostMemory::new(1 << 30));
        naive.free(naive.allocate(size));
        let (mut ours, mut theirs) = (Duration::MAX, Duration::MAX);
        for _ in 0..15 {
            let t = Instant::now();
            for _ in 0..PAIRS {
                drop(black_box(cache.allocate(black_box(size)).unwrap()));
            }
            ours = ours.min(t.elapsed());
            let t = Instant::now();
            for _ in 0..PAIRS {
                naive.free(black_box(naive.allocate(black_box(size))));
            }
            theirs = theirs.min(t.elapsed());
        }
        let per = |d: Duration| d.as_secs_f64() * 1e9 / PAIRS as f64;
        eprintln!(
            "cached_pair/{label}: {:.1} ns, naive best-fit cache {:.1} ns: ratio {:.2}x",
            per(ours),
            per(theirs),
            per(ours) / per(theirs)
        );
    }
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

criterion_group!(benches, cached_pair, naive_pair, ratio_to_naive, raw_pair, random_mix);
criterion_main!(benches);
