//! CUDA throughput of the kernels on this machine's GPU, printed as a table:
//!
//! - device-to-device copy bandwidth (`try_clone` of 64M elements: one read, one write),
//! - elementwise `add` on 64M elements as a fraction of that copy bandwidth,
//! - `matmul` at 8192^3 in f16, bf16 and f32 (TFLOP/s).
//!
//! Ends with one JSON line (`{"kernels": [...]}`) that `xtask/gpu/torch_bench.py` reads to
//! put PyTorch's figures from the same run beside these.
//!
//! Timing: warm-up first, then a device synchronize around each timed loop. On a machine
//! without a usable CUDA device it prints `skipped: no CUDA device (...)` and exits 0.
//!
//! `cargo run --release -p vram-kernels --example cuda_bench`

mod common;

use common::{cuda_or_skip, time, values};
use vram_kernels::{DType, Result, Tensor, ops};

const ELEMENTS: usize = 64 << 20;
const MATMUL: usize = 8192;

fn main() -> Result<()> {
    let Some(dev) = cuda_or_skip() else { return Ok(()) };
    println!("device: {}", dev.name());
    println!("| measurement | dtype | time (ms) | throughput | fraction |");
    println!("|---|---|---:|---:|---:|");
    let data = values(ELEMENTS, 1);
    let data2 = values(ELEMENTS, 2);
    let mut copy_gbs = 0.0;
    let mut json = Vec::new();
    let mut record = |op: &str, dtype: DType, ms: f64, rate: f64| {
        json.push(format!(
            "{{\"op\": \"{op}\", \"dtype\": \"{dtype}\", \"ms\": {ms:.4}, \"rate\": {rate:.2}}}"
        ));
    };
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let a = Tensor::from_f32_slice(&dev, &[ELEMENTS], &data, dtype)?;
        let b = Tensor::from_f32_slice(&dev, &[ELEMENTS], &data2, dtype)?;
        let bytes = a.size_in_bytes() as f64;
        let t_copy = time(&dev, 3, 20, || a.try_clone().map(drop))?;
        let t_add = time(&dev, 3, 20, || ops::add(&a, &b).map(drop))?;
        let (copy, add) = (2.0 * bytes / t_copy / 1e9, 3.0 * bytes / t_add / 1e9);
        if dtype == DType::F32 {
            copy_gbs = copy;
        }
        record("copy", dtype, t_copy * 1e3, copy);
        record("add", dtype, t_add * 1e3, add);
        println!("| d2d copy 64M | {dtype} | {:.3} | {copy:.0} GB/s | 1.00 |", t_copy * 1e3);
        println!(
            "| add 64M | {dtype} | {:.3} | {add:.0} GB/s | {:.2} of copy |",
            t_add * 1e3,
            add / copy
        );
    }
    let square = values(MATMUL * MATMUL, 3);
    let square2 = values(MATMUL * MATMUL, 4);
    for dtype in [DType::F16, DType::BF16, DType::F32] {
        let a = Tensor::from_f32_slice(&dev, &[MATMUL, MATMUL], &square, dtype)?;
        let b = Tensor::from_f32_slice(&dev, &[MATMUL, MATMUL], &square2, dtype)?;
        let iters = if dtype == DType::F32 { 5 } else { 20 };
        let t = time(&dev, 2, iters, || ops::matmul(&a, &b, false, false).map(drop))?;
        let tflops = 2.0 * (MATMUL as f64).powi(3) / t / 1e12;
        record("matmul", dtype, t * 1e3, tflops);
        println!("| matmul 8192^3 | {dtype} | {:.3} | {tflops:.1} TFLOP/s | |", t * 1e3);
    }
    println!("(copy bandwidth reference: f32 d2d copy {copy_gbs:.0} GB/s)");
    println!("{{\"kernels\": [{}]}}", json.join(", "));
    Ok(())
}
