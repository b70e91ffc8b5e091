//! Records a small workload and writes its snapshot as the pickle
//! `torch.cuda.memory._dump_snapshot()` writes (same dict, same bytes as Python's pickler), which
//! PyTorch's memory visualizer (<https://pytorch.org/memory_viz>) and
//! `python -m torch.cuda._memory_viz trace|segments|memory|stats snapshot.pickle` open, plus the
//! same dict as JSON; prints `memory_summary()` in `torch.cuda.memory_summary()`'s layout.
//!
//! `cargo run -p vram-alloc --example snapshot -- [OUT_DIR]`

use vram_alloc::{CachingAllocator, VirtualMemory};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::path::PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| ".".into()));
    std::fs::create_dir_all(&out)?;
    let cache = CachingAllocator::new(VirtualMemory::new(16 << 30));
    cache.record_history(Some(10_000));
    let mut live = Vec::new();
    for i in 0..64usize {
        live.push(cache.allocate((i % 7 + 1) * (3 << 20) + i * 4096)?);
        if i % 3 == 0 {
            live.swap_remove(i % live.len());
        }
    }
    // A block of more than 2 GiB, and a request the device cannot hold (an `oom` entry).
    live.push(cache.allocate(5 << 29)?);
    assert!(cache.allocate(32 << 30).is_err());
    let snapshot = cache.snapshot();
    std::fs::write(out.join("snapshot.pickle"), snapshot.to_pickle())?;
    std::fs::write(out.join("snapshot.json"), snapshot.to_json())?;
    println!("{}", cache.memory_summary());
    println!("wrote {}/snapshot.pickle (open it at https://pytorch.org/memory_viz)", out.display());
    Ok(())
}
