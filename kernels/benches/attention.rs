//! Host throughput of the fused attention (FlashAttention's algorithm on the CPU), forward
//! and backward, f32, causal, with and without dropout; criterion reports the matmul FLOP/s
//! of the pass as elements/s (causal: half of the `seq x seq` products).

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;
use vram_kernels::cpu::attention::{AttentionSaved, attention, attention_backward};
use vram_kernels::{AttentionDims, AttentionParams};

/// Deterministic values in [-1, 1) so every run attends over the same tensors.
fn values(len: usize, salt: usize) -> Vec<f32> {
    (0..len).map(|i| (((i + salt) * 7919) % 2003) as f32 / 1001.5 - 1.0).collect()
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("attention_f32");
    group.sample_size(10);
    // GPT-2's head width; 8 heads (batch x heads) of 512 tokens, with and without dropout,
    // and one head of 2048 (the backward then splits by blocks instead of by heads).
    let causal = AttentionParams::new(true);
    let dropout = ("causal_dropout", causal.with_dropout(0.1, 7, 0));
    let eight_heads = AttentionDims::heads_major(8, 512, 64);
    passes(&mut group, eight_heads, &[("causal", causal), dropout]);
    let one_head = AttentionDims::heads_major(1, 2048, 64);
    passes(&mut group, one_head, &[("one_head_2048_causal", causal)]);
    group.finish();
}

fn passes(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    dims: AttentionDims,
    cases: &[(&str, AttentionParams)],
) {
    let (q, k, v, d_o) = (
        values(dims.len(), 1),
        values(dims.len(), 2),
        values(dims.len(), 3),
        values(dims.len(), 4),
    );
    let (mut out, mut lse) = (vec![0.0f32; dims.len()], vec![0.0f32; dims.rows()]);
    let grads = || [vec![0.0f32; dims.len()], vec![0.0f32; dims.len()], vec![0.0f32; dims.len()]];
    let mut g = grads();
    // Causal: each of q k^T and P V is half of heads * seq^2 * dim multiply-adds.
    let pass = (dims.heads * dims.seq * dims.seq * dims.dim) as u64;
    for &(name, params) in cases {
        group.throughput(Throughput::Elements(2 * pass));
        group.bench_function(BenchmarkId::new("forward", name), |b| {
            b.iter(|| attention(black_box(&q), &k, &v, &mut out, &mut lse, dims, &params).unwrap())
        });
        attention(&q, &k, &v, &mut out, &mut lse, dims, &params).unwrap();
        // Backward: q k^T, dO v^T, P^T dO, dS^T q and dS k.
        group.throughput(Throughput::Elements(5 * pass));
        group.bench_function(BenchmarkId::new("backward", name), |b| {
            b.iter(|| {
                let saved = AttentionSaved { q: &q, k: &k, v: &v, out: &out, lse: &lse };
                let [dq, dk, dv] = &mut g;
                attention_backward(saved, black_box(&d_o), [dq, dk, dv], dims, &params).unwrap()
            })
        });
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
