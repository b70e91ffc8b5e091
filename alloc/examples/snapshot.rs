//! Records a small workload and writes its snapshot as a pickle that PyTorch's memory
//! visualizer (<https://pytorch.org/memory_viz>) opens, plus the same data as JSON.
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
    let snapshot = cache.snapshot();
    std::fs::write(out.join("snapshot.pickle"), snapshot.to_pickle())?;
    std::fs::write(out.join("snapshot.json"), snapshot.to_json())?;
    println!("{}", cache.memory_summary());
    println!("wrote {}/snapshot.pickle (open it at https://pytorch.org/memory_viz)", out.display());
    Ok(())
}
