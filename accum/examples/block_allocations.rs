//! What one GPT-2 small block's training step asks of the allocator: allocations per forward
//! and backward, the bytes they allocate, what the forward saves, the ops the backward runs
//! and its peak.
//!
//! `cargo run -p vram-accum --example block_allocations -- [virtual|host] [fused|unfused]
//! [batch] [seq]` (default: virtual, fused, 8 x 1024 tokens): one block of width 768 with
//! 12 heads, MLP ratio 4, dropout 0.1, f32 parameters under bf16 autocast. A virtual device
//! makes the requests the host and a GPU make without computing anything, so the figures
//! come in a second; the host computes them (slowly in a debug build) and gives the same.
//! The step runs twice; the second is the steady state (the first also allocates the
//! parameters' gradients and, on a virtual device, the first product's cuBLAS workspace of an
//! H100, 32 MiB, which the host has no use for: the hosts' and virtual devices' first steps
//! differ by it, their second steps not at all).

use vram_accum::layers::TransformerBlockConfig;
use vram_accum::{ForwardCtx, Layer, Mode};
use vram_kernels::{DType, Device, Tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, default: &str| args.get(i).cloned().unwrap_or_else(|| default.into());
    let dev = match arg(0, "virtual").as_str() {
        "host" => Device::host(64 << 30),
        _ => Device::virtual_device(1 << 40),
    };
    let fused = arg(1, "fused") == "fused";
    let (batch, seq): (usize, usize) = (arg(2, "8").parse()?, arg(3, "1024").parse()?);
    let d = 768;
    let mut block = TransformerBlockConfig::new(d, 12, seq)
        .with_dropout(0.1)
        .with_fused_residual(fused)
        .init(&dev)?;
    let x = Tensor::zeros(&dev, &[batch * seq, d], DType::F32)?;
    println!(
        "{}, {batch} x {seq} tokens, bf16 autocast, dropout 0.1, {} residual ops, {:?}",
        block.name(),
        if fused { "fused" } else { "unfused" },
        dev.name(),
    );
    for step in 1..=2 {
        let mut ctx = ForwardCtx::new(Mode::Train, step).with_autocast(DType::BF16)?;
        let base = dev.memory_stats();
        let (y, saved) = block.forward(&x, &mut ctx)?;
        let (shape, dtype) = (y.shape().to_vec(), y.dtype());
        drop(y);
        let saved_bytes =
            dev.memory_stats().allocated_bytes.all.current - base.allocated_bytes.all.current;
        let dy = Tensor::zeros(&dev, &shape, dtype)?;
        dev.reset_peak_stats();
        let before_backward = dev.memory_stats();
        dev.start_op_profile();
        let dx = block.backward(saved.ok_or("no saved state in training")?, dy, true)?;
        let ops: u64 = dev.stop_op_profile().iter().map(|o| o.calls).sum();
        drop(dx);
        let end = dev.memory_stats();
        let allocs = end.allocation.all.allocated - base.allocation.all.allocated;
        let bytes = end.allocated_bytes.all.allocated - base.allocated_bytes.all.allocated;
        let start = before_backward.allocated_bytes.all.current;
        let bwd_peak = end.allocated_bytes.all.peak;
        let mib = |b: i64| b as f64 / (1 << 20) as f64;
        println!(
            "step {step}: {allocs} allocations per forward + backward (dy included), {:.1} MiB \
             allocated, forward saves {:.1} MiB, backward: {ops} ops, peak {:.1} MiB ({:.1} MiB \
             above its start)",
            mib(bytes as i64),
            mib(saved_bytes),
            mib(bwd_peak),
            mib(bwd_peak - start),
        );
    }
    Ok(())
}
