//! Fused attention (`ops::attention`) against the explicit composition a transformer block
//! runs (`q k^T` product, scale, softmax or causal softmax, dropout on the probabilities,
//! `p v` product, and their backwards), forward and every gradient; and its memory: no
//! backend allocates `seq x seq`, and the virtual device allocates what the host does.

use proptest::prelude::*;
use vram_kernels::ops::{self, AttentionOutput, AttentionParams};
use vram_kernels::{DType, Device, Tensor, TraceAction};

fn host() -> Device {
    Device::host(4 << 30)
}

/// Deterministic values in `[-2, 2)` (xorshift).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            -2.0 + 4.0 * ((s >> 40) as f32 / (1u64 << 24) as f32)
        })
        .collect()
}

fn tensor(d: &Device, shape: &[usize], seed: u64, dtype: DType) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_f32_slice(d, shape, &values(n, seed), dtype).unwrap()
}

/// The explicit forward and backward: `(out, dq, dk, dv)`, every product and softmax in the
/// inputs' dtype.
fn explicit(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dout: &Tensor,
    p: &AttentionParams,
) -> [Vec<f32>; 4] {
    let scale = p.scale_for(q.shape()[q.rank() - 1]);
    let scores = ops::scale(&ops::matmul(q, k, false, true).unwrap(), scale).unwrap();
    let probs =
        if p.causal { ops::causal_softmax(&scores) } else { ops::softmax(&scores) }.unwrap();
    let dropped = if p.dropout > 0.0 {
        ops::dropout(&probs, p.dropout, p.seed, p.offset).unwrap()
    } else {
        probs.clone()
    };
    let out = ops::matmul(&dropped, v, false, false).unwrap();
    let (ddropped, dv) = ops::matmul_backward(&dropped, v, dout, false, false).unwrap();
    let dprobs = if p.dropout > 0.0 {
        ops::dropout_backward(&ddropped, p.dropout, p.seed, p.offset).unwrap()
    } else {
        ddropped
    };
    let dscores = if p.causal {
        ops::causal_softmax_backward(&probs, &dprobs)
    } else {
        ops::softmax_backward(&probs, &dprobs)
    }
    .unwrap();
    let scaled = ops::scale(&dscores, scale).unwrap();
    let (dq, dk) = ops::matmul_backward(q, k, &scaled, false, true).unwrap();
    [out, dq, dk, dv].map(|t| t.to_f32_vec().unwrap())
}

/// The fused forward and backward: `(out, dq, dk, dv)`.
fn fused(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dout: &Tensor,
    p: &AttentionParams,
) -> ([Vec<f32>; 4], AttentionOutput) {
    let fwd = ops::attention(q, k, v, p).unwrap();
    let g = ops::attention_backward(q, k, v, &fwd, dout, p).unwrap();
    ([&fwd.out, &g.dq, &g.dk, &g.dv].map(|t| t.to_f32_vec().unwrap()), fwd)
}

/// `got` within `rel` of `want` elementwise, with an absolute floor of `rel` times the
/// largest `|want|`, at least 1 (the inputs' scale): sums that cancel lose relative
/// precision, never absolute (with one token, dq is exactly 0 explicitly and a rounding
/// residue of `p (dp - D)` fused).
fn close(what: &str, got: &[f32], want: &[f32], rel: f32) -> std::result::Result<(), String> {
    assert_eq!(got.len(), want.len());
    let floor = want.iter().fold(0.0f32, |m, w| m.max(w.abs())).max(1.0);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = (g - w).abs() <= rel * (w.abs() + floor);
        if !ok {
            return Err(format!("{what}[{i}]: fused {g}, explicit {w} (largest {floor})"));
        }
    }
    Ok(())
}

const NAMES: [&str; 4] = ["out", "dq", "dk", "dv"];

/// Runs both forms on `[heads, seq, dim]` inputs of `dtype` and compares; 16-bit inputs are
/// compared against the explicit form in f32 on the same (rounded) values.
fn compare(heads: usize, seq: usize, dim: usize, dtype: DType, p: &AttentionParams, seed: u64) {
    let d = host();
    let shape = [heads, seq, dim];
    let [q, k, v, dout] = [1, 2, 3, 4].map(|i| tensor(&d, &shape, seed * 8 + i, dtype));
    let (got, fwd) = fused(&q, &k, &v, &dout, p);
    assert_eq!(fwd.lse.shape(), &[heads, seq]);
    assert_eq!(fwd.lse.dtype(), DType::F32);
    let widened = [&q, &k, &v, &dout].map(|t| t.to_dtype(DType::F32).unwrap());
    let want = explicit(&widened[0], &widened[1], &widened[2], &widened[3], p);
    // f32: 1e-5 relative; 16 bits: the output's rounding (2^-8 for bf16, 2^-11 for f16)
    // on each result and on the saved output D reads, with a few ulps to spare.
    let rel = match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 4.0 / 2048.0,
        DType::BF16 => 4.0 / 256.0,
    };
    for (i, name) in NAMES.iter().enumerate() {
        let what = format!("{name} {dtype:?} heads {heads} seq {seq} dim {dim} {p:?}");
        close(&what, &got[i], &want[i], rel).unwrap();
    }
}

#[test]
fn head_dims_64_and_128_match_the_explicit_form_in_every_dtype() {
    for dim in [64, 128] {
        // 150: three blocks of 64 queries and keys on the host, the last one partial.
        for seq in [1, 17, 33, 150] {
            for causal in [false, true] {
                for dtype in [DType::F32, DType::BF16, DType::F16] {
                    let p = AttentionParams::new(causal);
                    compare(2, seq, dim, dtype, &p, seq as u64);
                    compare(2, seq, dim, dtype, &p.with_dropout(0.2, 7, 1000), seq as u64);
                }
            }
        }
    }
}

#[test]
fn rank_four_inputs_are_heads_of_a_batch() {
    let d = host();
    let p = AttentionParams::new(true);
    let [q, k, v] = [1, 2, 3].map(|i| tensor(&d, &[2, 3, 5, 8], i, DType::F32));
    let four = ops::attention(&q, &k, &v, &p).unwrap();
    assert_eq!(four.out.shape(), &[2, 3, 5, 8]);
    assert_eq!(four.lse.shape(), &[2, 3, 5]);
    let flat = |t: &Tensor| t.clone().reshape(&[6, 5, 8]).unwrap();
    let three = ops::attention(&flat(&q), &flat(&k), &flat(&v), &p).unwrap();
    assert_eq!(four.out.to_f32_vec().unwrap(), three.out.to_f32_vec().unwrap());
}

// Tokens-major operands ([batch, seq, heads, dim], a projection's output as it is) give
// what the heads-major op gives on the permuted operands, bit for bit, forward and every
// gradient, with dropout: the head index (b * heads + h) and so the mask are the same.
#[test]
fn tokens_major_operands_are_the_permuted_heads_major_ones() {
    let d = host();
    let (b, s, h, dim) = (2, 37, 3, 16);
    for dtype in [DType::F32, DType::BF16] {
        for causal in [false, true] {
            let p = AttentionParams::new(causal).with_dropout(0.2, 9, 1 << 20);
            let [q, k, v, dout] = [1, 2, 3, 4].map(|i| tensor(&d, &[b, s, h, dim], i, dtype));
            // [b, s, h, dim] -> [b, h, s, dim] and back.
            let heads = |t: &Tensor| ops::permute(t, &[0, 2, 1, 3]).unwrap();
            let tm = p.tokens_major();
            let fwd = ops::attention(&q, &k, &v, &tm).unwrap();
            assert_eq!(fwd.out.shape(), &[b, s, h, dim]);
            assert_eq!(fwd.lse.shape(), &[b, h, s]);
            let g = ops::attention_backward(&q, &k, &v, &fwd, &dout, &tm).unwrap();
            let (hq, hk, hv, hd) = (heads(&q), heads(&k), heads(&v), heads(&dout));
            let want = ops::attention(&hq, &hk, &hv, &p).unwrap();
            let wg = ops::attention_backward(&hq, &hk, &hv, &want, &hd, &p).unwrap();
            let bits = |t: &Tensor| t.to_f32_vec().unwrap();
            let what = format!("{dtype:?} causal {causal}");
            assert_eq!(bits(&heads(&fwd.out)), bits(&want.out), "out {what}");
            assert_eq!(bits(&fwd.lse), bits(&want.lse), "lse {what}");
            for (name, (got, want)) in
                ["dq", "dk", "dv"].iter().zip([(&g.dq, &wg.dq), (&g.dk, &wg.dk), (&g.dv, &wg.dv)])
            {
                assert_eq!(bits(&heads(got)), bits(want), "{name} {what}");
            }
        }
    }
    // Tokens-major operands are rank 4; the backward checks the logsumexp's shape.
    let tm = AttentionParams::new(true).tokens_major();
    let three = tensor(&d, &[2, 5, 8], 1, DType::F32);
    let err = ops::attention(&three, &three, &three, &tm).unwrap_err().to_string();
    assert!(err.contains("[batch, seq, heads, head_dim]"), "{err}");
    let q = tensor(&d, &[2, 5, 3, 8], 1, DType::F32);
    let heads_major = ops::attention(&q, &q, &q, &AttentionParams::new(true)).unwrap();
    assert_eq!(heads_major.lse.shape(), &[2, 5, 3]);
    assert!(ops::attention_backward(&q, &q, &q, &heads_major, &q, &tm).is_err());
}

/// `[b, s, kv, d]` with each key/value head repeated `group` times in a row (Hugging Face's
/// `repeat_kv`, tokens-major): `[b, s, kv * group, d]`.
fn repeat_kv(t: &Tensor, group: usize) -> Tensor {
    let &[b, s, kv, d] = t.shape() else { panic!("rank 4") };
    let x = t.to_f32_vec().unwrap();
    let mut out = Vec::with_capacity(x.len() * group);
    for row in x.chunks(kv * d) {
        for head in row.chunks(d) {
            for _ in 0..group {
                out.extend_from_slice(head);
            }
        }
    }
    Tensor::from_f32_slice(t.device(), &[b, s, kv * group, d], &out, t.dtype()).unwrap()
}

/// The gradient of [`repeat_kv`]: each key/value head's copies summed (in f64).
fn sum_groups(g: &[f32], kv: usize, group: usize, d: usize) -> Vec<f32> {
    g.chunks(kv * group * d)
        .flat_map(|row| {
            (0..kv * d).map(move |e| {
                let (h, c) = (e / d, e % d);
                (0..group).map(|r| f64::from(row[((h * group) + r) * d + c])).sum::<f64>() as f32
            })
        })
        .collect()
}

// Grouped-query attention (Llama 3's 4 query heads a key/value head, here 6 over 2) equals
// attention on the keys and values repeated to every query head: the output, logsumexp and
// dq bit for bit (each query head reads the same rows), dk and dv within f32 rounding (the
// group's sum in another order), with dropout, tokens-major; and grouping is refused unless
// asked for or where the heads do not divide.
#[test]
fn grouped_query_attention_equals_attention_on_repeated_keys_and_values() {
    let d = host();
    // 70 tokens: two blocks of queries and of keys on the host.
    let (b, s, h, kv, dim) = (2, 70, 6, 2, 16);
    for causal in [false, true] {
        let p = AttentionParams::new(causal).with_dropout(0.2, 3, 99).tokens_major();
        let q = tensor(&d, &[b, s, h, dim], 1, DType::F32);
        let [k, v] = [2, 3].map(|i| tensor(&d, &[b, s, kv, dim], i, DType::F32));
        let dout = tensor(&d, &[b, s, h, dim], 4, DType::F32);
        let gqa = p.grouped();
        let fwd = ops::attention(&q, &k, &v, &gqa).unwrap();
        let g = ops::attention_backward(&q, &k, &v, &fwd, &dout, &gqa).unwrap();
        assert_eq!(g.dk.shape(), &[b, s, kv, dim]);
        let (kr, vr) = (repeat_kv(&k, h / kv), repeat_kv(&v, h / kv));
        let want = ops::attention(&q, &kr, &vr, &p).unwrap();
        let wg = ops::attention_backward(&q, &kr, &vr, &want, &dout, &p).unwrap();
        let bits = |t: &Tensor| t.to_f32_vec().unwrap();
        assert_eq!(bits(&fwd.out), bits(&want.out), "out, causal {causal}");
        assert_eq!(bits(&fwd.lse), bits(&want.lse), "lse, causal {causal}");
        assert_eq!(bits(&g.dq), bits(&wg.dq), "dq, causal {causal}");
        for (name, got, rep) in [("dk", &g.dk, &wg.dk), ("dv", &g.dv, &wg.dv)] {
            let want = sum_groups(&bits(rep), kv, h / kv, dim);
            close(&format!("{name}, causal {causal}"), &bits(got), &want, 1e-5).unwrap();
        }
    }
    // Grouping must be asked for, and q's heads must be a multiple of k's.
    let q = tensor(&d, &[b, s, h, dim], 1, DType::F32);
    let k = tensor(&d, &[b, s, kv, dim], 2, DType::F32);
    let p = AttentionParams::new(true).tokens_major();
    assert!(ops::attention(&q, &k, &k, &p).is_err());
    let k4 = tensor(&d, &[b, s, 4, dim], 2, DType::F32);
    let err = ops::attention(&q, &k4, &k4, &p.grouped()).unwrap_err().to_string();
    assert!(err.contains("grouped-query attention"), "{err}");
    let k_seq = tensor(&d, &[b, s + 1, kv, dim], 2, DType::F32);
    assert!(ops::attention(&q, &k_seq, &k_seq, &p.grouped()).is_err());
    // Heads-major: [b, heads, s, d] against [b, kv, s, d].
    let hq = ops::permute(&q, &[0, 2, 1, 3]).unwrap();
    let hk = ops::permute(&k, &[0, 2, 1, 3]).unwrap();
    let heads_major = AttentionParams::new(true).grouped();
    let out = ops::attention(&hq, &hk, &hk, &heads_major).unwrap();
    let tokens = ops::attention(&q, &k, &k, &p.grouped()).unwrap();
    let back = ops::permute(&tokens.out, &[0, 2, 1, 3]).unwrap();
    assert_eq!(out.out.to_f32_vec().unwrap(), back.to_f32_vec().unwrap());
}

#[test]
fn mismatched_or_invalid_inputs_are_errors() {
    let d = host();
    let q = tensor(&d, &[2, 4, 8], 1, DType::F32);
    let k = tensor(&d, &[2, 5, 8], 2, DType::F32);
    let p = AttentionParams::new(false);
    assert!(ops::attention(&q, &k, &q, &p).is_err());
    assert!(ops::attention(&q, &q, &q, &p.with_dropout(1.0, 0, 0)).is_err());
    let kb = tensor(&d, &[2, 4, 8], 2, DType::BF16);
    assert!(ops::attention(&q, &kb, &q, &p).is_err());
    let flat = tensor(&d, &[8], 3, DType::F32);
    assert!(ops::attention(&flat, &flat, &flat, &p).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    // The fused op equals the explicit composition in f32 (1e-5 relative), forward and each
    // gradient, causal or not, with or without dropout (the same seed and offset drop the
    // same probabilities), for any sequence length (1, and lengths that are no multiple of
    // a tile) and head width.
    #[test]
    fn fused_attention_equals_the_explicit_form(
        heads in 1usize..4,
        seq in 1usize..80,
        dim in prop::sample::select(vec![1usize, 3, 8, 24, 64, 128]),
        causal in any::<bool>(),
        drop in prop::sample::select(vec![0.0f32, 0.1, 0.5]),
        seed in any::<u64>(),
        offset in 0u64..1 << 40,
    ) {
        let p = AttentionParams::new(causal).with_dropout(drop, seed, offset);
        compare(heads, seq, dim, DType::F32, &p, seed % 1000);
    }
}

/// The peak of a forward and backward at `seq` on `d` (the inputs allocated before the
/// peak is reset) and the allocator's trace of the two calls.
fn attention_peak(d: &Device, seq: usize) -> (u64, Vec<(TraceAction, usize, usize)>) {
    let (heads, dim) = (1, 8);
    let shape = [heads, seq, dim];
    let [q, k, v, dout] = [1, 2, 3, 4].map(|i| tensor(d, &shape, i, DType::BF16));
    let p = AttentionParams::new(true).with_dropout(0.1, 3, 0);
    d.reset_peak_stats();
    let base = d.memory_allocated();
    d.record_history(Some(1 << 16));
    let fwd = ops::attention(&q, &k, &v, &p).unwrap();
    let grads = ops::attention_backward(&q, &k, &v, &fwd, &dout, &p).unwrap();
    drop((fwd, grads));
    let trace = d.trace().iter().map(|e| (e.action, e.size, e.requested)).collect();
    d.record_history(None);
    (d.max_memory_allocated() - base, trace)
}

// No backend allocates seq x seq: the peak of a forward and backward grows 4x from 1024 to
// 4096 tokens (it would grow 16x with a [heads, seq, seq] buffer, 8 MiB per head at 4096
// in f32), and is a few bytes per token, far below one seq x seq buffer. The virtual device
// makes the same requests as the host, so its figures are the host's (and a GPU's).
#[test]
fn peak_memory_is_linear_in_the_sequence_on_host_and_virtual_device() {
    let (host_dev, virt) = (host(), Device::virtual_device(4 << 30));
    let (small, small_trace) = attention_peak(&host_dev, 1024);
    let (large, large_trace) = attention_peak(&host_dev, 4096);
    eprintln!("attention peak (1 head, dim 8, bf16): s=1024 {small} B, s=4096 {large} B");
    assert_eq!(large, 4 * small, "peak {small} B at 1024 tokens, {large} B at 4096");
    assert!(large < 2 * 4096 * 4096, "a seq x seq buffer would take {} B", 2 * 4096 * 4096 * 4);
    let (v_small, v_small_trace) = attention_peak(&virt, 1024);
    let (v_large, v_large_trace) = attention_peak(&virt, 4096);
    assert_eq!((v_small, v_large), (small, large));
    assert_eq!(v_small_trace, small_trace);
    assert_eq!(v_large_trace, large_trace);
}
