//! What the CUDA timing examples share: a timed loop and their operands' values.

use std::io::Write as _;
use std::time::Instant;
use vram_kernels::{Device, Result};

/// CUDA device 0, or None after printing `skipped: no CUDA device (...)` on stderr.
pub fn cuda_or_skip() -> Option<Device> {
    match Device::cuda(0) {
        Ok(dev) => Some(dev),
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "skipped: no CUDA device ({e})");
            None
        }
    }
}

/// Seconds per call of `f`, after `warmup` untimed calls, the timed ones between two device
/// synchronizations.
pub fn time(
    dev: &Device,
    warmup: usize,
    iters: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    for _ in 0..warmup {
        f()?;
    }
    dev.synchronize()?;
    let start = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    dev.synchronize()?;
    Ok(start.elapsed().as_secs_f64() / iters as f64)
}

/// Non-zero pseudo-random values in [-1, 1).
pub fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let h = (i as u32).wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(0x9E37_79B9);
            ((h >> 8) as f32 / (1u32 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}
