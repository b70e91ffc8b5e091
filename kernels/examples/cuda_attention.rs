//! CUDA time and memory of vram's fused attention ([`ops::attention`] forward and
//! [`ops::attention_backward`]) at GPT-2 small's head shape, bf16, causal, no dropout: batch 8,
//! 12 heads, head dim 64, at 1024 and 4096 tokens. `xtask/gpu/torch_attention.py` times
//! PyTorch's `F.scaled_dot_product_attention` (flash backend) on the same shapes and prints
//! the same lines (`measure.sh attention` runs both).
//!
//! Per shape and operand layout (heads-major `[b, h, s, d]`, as the PyTorch script passes
//! them, and tokens-major `[b, s, h, d]`, as a GPT block hands its projections over): the
//! forward alone and forward + backward, in milliseconds per call (three
//! warm-up calls, then twenty between two device synchronizations), and the memory the call
//! adds above its inputs (`max_memory_allocated` after a reset, less the inputs): the output
//! and logsumexp forward, plus the three gradients and the backward's workspace.
//! On a machine without a usable CUDA device it prints `skipped: no CUDA device (...)` and
//! exits 0.
//!
//! `cargo run --release -p vram-kernels --example cuda_attention [seq ...]`

mod common;

use common::{cuda_or_skip, time, values};
use vram_kernels::ops::{self, AttentionLayout, AttentionParams};
use vram_kernels::{DType, Result, Tensor};

const BATCH: usize = 8;
const HEADS: usize = 12;
const HEAD_DIM: usize = 64;

fn main() -> Result<()> {
    let Some(dev) = cuda_or_skip() else { return Ok(()) };
    let mut seqs: Vec<usize> = std::env::args().skip(1).filter_map(|v| v.parse().ok()).collect();
    if seqs.is_empty() {
        seqs = vec![1024, 4096];
    }
    println!("# vram fused attention on {}: bf16, causal, no dropout", dev.name());
    let layouts = [AttentionLayout::HeadsMajor, AttentionLayout::TokensMajor];
    for (seq, layout) in seqs.into_iter().flat_map(|s| layouts.map(|l| (s, l))) {
        let params = AttentionParams { layout, ..AttentionParams::new(true) };
        let (shape, tag) = match layout {
            AttentionLayout::HeadsMajor => ([BATCH, HEADS, seq, HEAD_DIM], ""),
            AttentionLayout::TokensMajor => ([BATCH, seq, HEADS, HEAD_DIM], " tokens-major"),
        };
        let n = shape.iter().product();
        let tensor = |seed| Tensor::from_f32_slice(&dev, &shape, &values(n, seed), DType::BF16);
        let (q, k, v, dout) = (tensor(1)?, tensor(2)?, tensor(3)?, tensor(4)?);
        dev.synchronize()?;
        let inputs = dev.memory_allocated();
        dev.reset_peak_stats();
        let fwd = time(&dev, 3, 20, || ops::attention(&q, &k, &v, &params).map(drop))?;
        let fwd_peak = dev.max_memory_allocated() - inputs;
        dev.reset_peak_stats();
        let both = time(&dev, 3, 20, || {
            let out = ops::attention(&q, &k, &v, &params)?;
            ops::attention_backward(&q, &k, &v, &out, &dout, &params).map(drop)
        })?;
        let both_peak = dev.max_memory_allocated() - inputs;
        println!(
            "attention b{BATCH} h{HEADS} s{seq} d{HEAD_DIM} bf16 causal{tag}: forward {:.3} ms, forward+backward {:.3} ms, memory above the inputs forward {} B, forward+backward {} B",
            fwd * 1e3,
            both * 1e3,
            fwd_peak,
            both_peak
        );
    }
    Ok(())
}
