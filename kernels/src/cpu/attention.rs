//! Scaled dot-product attention without a `seq x seq` buffer: FlashAttention's algorithm
//! on the host (Dao et al. 2022; FlashAttention-2, Dao 2023).
//!
//! The forward takes a head's queries in blocks of [`QUERY_BLOCK`] (one rayon task each) and
//! visits their keys in blocks of [`KEY_BLOCK`] with the online softmax: a running maximum
//! `m` and sum `l` of `exp(s - m)` per row, the output accumulator rescaled by
//! `exp(m_old - m_new)` whenever the maximum grows. A block is two products (`S = scale q
//! k^T`, `acc += P v`, by the `gemm` crate on the calling thread). It keeps the output and
//! each row's logsumexp `m + ln l`. The backward recomputes each probability from the
//! logsumexp, `p = exp(s - lse)`, and uses `D_i = dO_i . O_i` (= `sum_j p_ij dP_ij`,
//! dropout included) for the softmax's gradient `dS = P (dP - D)`. It runs one task per
//! key/value head, over the blocks of its (group's) query heads: five products per block
//! pair (`S`, `dP = dO v^T`, `dV += P^T dO`, `dK += dS^T q`, `dQ += dS k`) into f32
//! accumulators of that head's rows only, so every gradient row has one writer and nothing
//! is computed twice (the CUDA kernels split dK/dV and dQ instead, for parallelism).
//! Scratch memory is two blocks of scores per task and f32 copies of the inputs and
//! gradients: linear in the sequence length. Measured (`cargo bench -p vram-kernels --bench
//! attention`, 8 heads x 512 tokens x 64, f32, causal, 2-core host): forward 2.7 ms and
//! backward 4.5 ms (4.1 and 6.0 with dropout 0.1), against 14.2 and 54.5 ms (18.3 and
//! 61.2) for the row-at-a-time dot products this replaced; PyTorch 2.15's CPU SDPA on the
//! same host: 3.0 and 23.3 ms.
//!
//! Dropout masks the probabilities `P V` multiplies (the normalizer `l` sums the undropped
//! ones), drawing element `(h, i, j)` of a `[heads, seq, seq]` tensor from the stream
//! `(seed, offset)` exactly as [`dropout`](super::random::dropout) would
//! ([`AttentionParams`]).
//!
//! Tokens-major operands (`[batch, seq, heads, dim]`, [`AttentionDims::heads_per_token`]
//! above 1) are gathered into heads-major f32 copies and the results scattered back: the
//! arithmetic, and so every bit of the result, is the heads-major one. Grouped-query
//! attention ([`AttentionDims::kv_group`] above 1) reads key/value head `h / group` for
//! query head `h`, and sums each key/value head's gradients over its group's query heads in
//! f32 before rounding them once.

use super::{check_len, widen_f32};
use crate::cpu::fastmath::exp;
use crate::cpu::matmul::gemm_serial;
use crate::cpu::random::for_each_uniform;
use crate::dtype::Element;
use crate::error::Result;
use crate::params::{AttentionDims, AttentionParams, MatmulSpec};
use rayon::prelude::*;
use std::borrow::Cow;

/// Keys per block of the forward's online softmax.
pub const KEY_BLOCK: usize = 64;

/// Query rows per block: the forward's unit of work, and the backward's rows per product.
pub const QUERY_BLOCK: usize = 64;

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The dropout of one call: which probabilities survive and the factor on those that do.
#[derive(Clone, Copy)]
struct Dropping {
    p: f32,
    seed: u64,
    offset: u64,
    keep_scale: f32,
}

impl Dropping {
    fn of(params: &AttentionParams) -> Option<Dropping> {
        (params.dropout > 0.0).then(|| Dropping {
            p: params.dropout,
            seed: params.seed,
            offset: params.offset,
            keep_scale: 1.0 / (1.0 - params.dropout),
        })
    }

    /// The factors of probabilities `(h, i, j0 .. j0 + out.len())` into `out`, one Philox
    /// block per four of them (all 1 without dropout).
    fn fill_factors(
        drop: Option<Dropping>,
        dims: &AttentionDims,
        (h, i, j0): (usize, usize, usize),
        out: &mut [f32],
    ) {
        match drop {
            None => out.fill(1.0),
            Some(d) => {
                let start = d.offset.wrapping_add(dims.prob_index(h, i, j0));
                for_each_uniform(d.seed, start, out.len(), |j, u| {
                    out[j] = if u >= d.p { d.keep_scale } else { 0.0 };
                });
            }
        }
    }
}

/// The keys query `i` sees: `0..=i` when causal, else all.
fn key_end(causal: bool, i: usize, seq: usize) -> usize {
    if causal { (i + 1).min(seq) } else { seq }
}

/// Checks the head dim and each slice's length: `queries` of q's size, `keys` of k's (fewer
/// heads when grouped), `lse` of one per query row.
fn check(
    op: &'static str,
    dims: &AttentionDims,
    queries: &[(&str, usize)],
    keys: &[(&str, usize)],
    lse: usize,
) -> Result<()> {
    if dims.dim == 0 && dims.rows() > 0 {
        return Err(crate::error::Error::InvalidArgument {
            op,
            reason: format!("head dim 0 with {} rows", dims.rows()),
        });
    }
    for (tensors, want) in [(queries, dims.len()), (keys, dims.kv().len())] {
        for &(what, len) in tensors {
            check_len(op, what, len, want)?;
        }
    }
    check_len(op, "the logsumexp", lse, dims.rows())
}

/// Attention forward: `out = dropout(softmax(scale * q k^T [+ causal mask])) v` for each of
/// `dims.heads` heads, and `lse[h, i]` the logsumexp of row `i`'s scaled scores (f32). q, k,
/// v and out are `[heads, seq, dim]`.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for lengths that do not match
/// `dims`, or invalid `params`.
pub fn attention<T: Element>(
    q: &[T],
    k: &[T],
    v: &[T],
    out: &mut [T],
    lse: &mut [f32],
    dims: AttentionDims,
    params: &AttentionParams,
) -> Result<()> {
    const OP: &str = "cpu::attention";
    params.validate(OP)?;
    let (queries, keys) =
        ([("q", q.len()), ("the output", out.len())], [("k", k.len()), ("v", v.len())]);
    check(OP, &dims, &queries, &keys, lse.len())?;
    if dims.is_empty() {
        return Ok(());
    }
    let kv = dims.kv();
    let (q, k, v) = (heads_major(q, &dims), heads_major(k, &kv), heads_major(v, &kv));
    if dims.heads_per_token <= 1 {
        return forward(&q, &k, &v, out, lse, dims, params);
    }
    let mut o = vec![T::from_f32(0.0); out.len()];
    forward(&q, &k, &v, &mut o, lse, dims, params)?;
    scatter(&o, out, &dims);
    Ok(())
}

/// `x` (of `dims`' layout) as heads-major f32.
fn heads_major<'a, T: Element>(x: &'a [T], dims: &AttentionDims) -> Cow<'a, [f32]> {
    let wide = widen_f32(x);
    if dims.heads_per_token <= 1 {
        return wide;
    }
    let dim = dims.dim;
    let mut out = Vec::with_capacity(x.len());
    for h in 0..dims.heads {
        for i in 0..dims.seq {
            let at = dims.row_start(h, i);
            out.extend_from_slice(&wide[at..at + dim]);
        }
    }
    Cow::Owned(out)
}

/// Heads-major `x` into `out` of `dims`' (tokens-major) layout.
fn scatter<T: Copy>(x: &[T], out: &mut [T], dims: &AttentionDims) {
    let dim = dims.dim;
    for (r, row) in x.chunks(dim.max(1)).enumerate() {
        let at = dims.row_start(r / dims.seq, r % dims.seq);
        out[at..at + dim].copy_from_slice(row);
    }
}

/// The forward on heads-major f32 operands into heads-major `out`: one task per block of
/// [`QUERY_BLOCK`] query rows of a head, each visiting its keys in blocks of [`KEY_BLOCK`]
/// with two products per block (`S = scale q k^T`, `acc += P v`).
fn forward<T: Element>(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [T],
    lse: &mut [f32],
    dims: AttentionDims,
    params: &AttentionParams,
) -> Result<()> {
    let AttentionDims { seq, dim, .. } = dims;
    let scale = params.scale_for(dim);
    let drop = Dropping::of(params);
    let group = dims.kv_group.max(1);
    let mut tasks = Vec::with_capacity(dims.heads * seq.div_ceil(QUERY_BLOCK));
    for (h, (o, l)) in out.chunks_mut(seq * dim).zip(lse.chunks_mut(seq)).enumerate() {
        for (b, (o, l)) in
            o.chunks_mut(QUERY_BLOCK * dim).zip(l.chunks_mut(QUERY_BLOCK)).enumerate()
        {
            tasks.push((h, b * QUERY_BLOCK, o, l));
        }
    }
    tasks.into_par_iter().for_each(|(h, i0, o, lse)| {
        let rows = lse.len();
        let i1 = i0 + rows;
        let qb = &q[(h * seq + i0) * dim..(h * seq + i1) * dim];
        let head = h / group * seq * dim;
        let mut scores = vec![0.0f32; rows * KEY_BLOCK];
        let mut acc = vec![0.0f32; rows * dim];
        let (mut m, mut l) = (vec![f32::NEG_INFINITY; rows], vec![0.0f32; rows]);
        let mut factors = [1.0f32; KEY_BLOCK];
        let end = if params.causal { i1 } else { seq };
        for j0 in (0..end).step_by(KEY_BLOCK) {
            let j1 = (j0 + KEY_BLOCK).min(end);
            let keys = j1 - j0;
            let s = &mut scores[..rows * keys];
            let spec = MatmulSpec::new(rows, keys, dim).transpose(false, true).scaled(scale, 0.0);
            gemm_serial(&spec, qb, &k[head + j0 * dim..head + j1 * dim], s);
            for (r, row) in s.chunks_mut(keys).enumerate() {
                let i = i0 + r;
                // Keys past the query are masked (causal); key 0 is never, so the first block
                // makes every row's maximum finite.
                let seen = key_end(params.causal, i, seq).clamp(j0, j1) - j0;
                row[seen..].fill(f32::NEG_INFINITY);
                let block_max = row[..seen].iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let m_new = m[r].max(block_max);
                let alpha = if m_new == f32::NEG_INFINITY { 1.0 } else { exp(m[r] - m_new) };
                Dropping::fill_factors(drop, &dims, (h, i, j0), &mut factors[..keys]);
                // Three passes, so that the exponentials vectorize (a running sum would not).
                row.iter_mut().for_each(|x| *x = exp(*x - m_new));
                let sum: f32 = row.iter().sum();
                if drop.is_some() {
                    row.iter_mut().zip(&factors[..keys]).for_each(|(x, &f)| *x *= f);
                }
                l[r] = l[r] * alpha + sum;
                m[r] = m_new;
                acc[r * dim..(r + 1) * dim].iter_mut().for_each(|a| *a *= alpha);
            }
            let spec = MatmulSpec::new(rows, dim, keys).scaled(1.0, 1.0);
            gemm_serial(&spec, s, &v[head + j0 * dim..head + j1 * dim], &mut acc);
        }
        for (r, (o, a)) in o.chunks_mut(dim).zip(acc.chunks(dim)).enumerate() {
            o.iter_mut().zip(a).for_each(|(o, a)| *o = T::from_f32(a / l[r]));
            lse[r] = m[r] + l[r].ln();
        }
    });
    Ok(())
}

/// The tensors an attention backward reads.
#[derive(Clone, Copy)]
pub struct AttentionSaved<'a, T> {
    /// The queries.
    pub q: &'a [T],
    /// The keys.
    pub k: &'a [T],
    /// The values.
    pub v: &'a [T],
    /// The forward's output.
    pub out: &'a [T],
    /// The forward's logsumexp per row.
    pub lse: &'a [f32],
}

/// Attention backward: the gradients of q, k and v from the forward's inputs, output and
/// logsumexp ([`AttentionSaved`]) and the output's gradient `dout`, with the forward's
/// `params`. Recomputes the probabilities; allocates only per-row scratch and f32 copies.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for lengths that do not match
/// `dims`, or invalid `params`.
pub fn attention_backward<T: Element>(
    saved: AttentionSaved<'_, T>,
    dout: &[T],
    [dq, dk, dv]: [&mut [T]; 3],
    dims: AttentionDims,
    params: &AttentionParams,
) -> Result<()> {
    const OP: &str = "cpu::attention_backward";
    params.validate(OP)?;
    let queries = [
        ("q", saved.q.len()),
        ("the output", saved.out.len()),
        ("the output's gradient", dout.len()),
        ("dq", dq.len()),
    ];
    let keys = [("k", saved.k.len()), ("v", saved.v.len()), ("dk", dk.len()), ("dv", dv.len())];
    check(OP, &dims, &queries, &keys, saved.lse.len())?;
    if dims.is_empty() {
        return Ok(());
    }
    let kv = dims.kv();
    let (hm, hm_kv) = (|x| heads_major(x, &dims), |x| heads_major(x, &kv));
    let ins = [hm(saved.q), hm_kv(saved.k), hm_kv(saved.v), hm(saved.out), hm(dout)];
    let ins = [&*ins[0], &*ins[1], &*ins[2], &*ins[3], &*ins[4]];
    if dims.heads_per_token <= 1 {
        return backward(ins, saved.lse, [dq, dk, dv], dims, params);
    }
    let zeros = |n| vec![T::from_f32(0.0); n];
    let mut grads = [zeros(dims.len()), zeros(kv.len()), zeros(kv.len())];
    {
        let [a, b, c] = &mut grads;
        backward(ins, saved.lse, [a, b, c], dims, params)?;
    }
    let [gq, gk, gv] = &grads;
    scatter(gq, dq, &dims);
    scatter(gk, dk, &kv);
    scatter(gv, dv, &kv);
    Ok(())
}

/// The backward on heads-major f32 `[q, k, v, out, dout]` into heads-major gradients: one
/// task per key/value head (with its group's query heads), so that every gradient row has
/// one writer; per block of [`QUERY_BLOCK`] queries and [`KEY_BLOCK`] keys, five products
/// (`S = scale q k^T`, `dP = dO v^T`, `dV += P^T dO`, `dK += dS^T q`, `dQ += dS k`) in f32
/// accumulators rounded once at the end.
fn backward<T: Element>(
    [q, k, v, o, d_o]: [&[f32]; 5],
    lse: &[f32],
    [dq, dk, dv]: [&mut [T]; 3],
    dims: AttentionDims,
    params: &AttentionParams,
) -> Result<()> {
    let AttentionDims { seq, dim, .. } = dims;
    let scale = params.scale_for(dim);
    let drop = Dropping::of(params);
    let group = dims.kv_group.max(1);
    let head_len = seq * dim;
    // D_i = dO_i . O_i.
    let dsum: Vec<f32> =
        d_o.par_chunks(dim).zip(o.par_chunks(dim)).map(|(a, b)| dot(a, b)).collect();
    let blocks = dq.par_chunks_mut(group * head_len).zip(dk.par_chunks_mut(head_len));
    blocks.zip(dv.par_chunks_mut(head_len)).enumerate().for_each(|(kh, ((dq, dk), dv))| {
        let (kb, vb) = (&k[kh * head_len..][..head_len], &v[kh * head_len..][..head_len]);
        let (mut gq, mut gk, mut gv) =
            (vec![0.0f32; group * head_len], vec![0.0f32; head_len], vec![0.0f32; head_len]);
        let mut probs = vec![0.0f32; QUERY_BLOCK * KEY_BLOCK];
        let mut dprobs = vec![0.0f32; QUERY_BLOCK * KEY_BLOCK];
        let mut factors = [1.0f32; KEY_BLOCK];
        for h in kh * group..(kh + 1) * group {
            for i0 in (0..seq).step_by(QUERY_BLOCK) {
                let i1 = (i0 + QUERY_BLOCK).min(seq);
                let rows = i1 - i0;
                let at = (h * seq + i0) * dim..(h * seq + i1) * dim;
                let (qb, dob) = (&q[at.clone()], &d_o[at]);
                let gq = &mut gq[((h - kh * group) * seq + i0) * dim..][..rows * dim];
                let end = if params.causal { i1 } else { seq };
                for j0 in (0..end).step_by(KEY_BLOCK) {
                    let j1 = (j0 + KEY_BLOCK).min(end);
                    let keys = j1 - j0;
                    let (p, ds) = (&mut probs[..rows * keys], &mut dprobs[..rows * keys]);
                    let (kj, vj) = (&kb[j0 * dim..j1 * dim], &vb[j0 * dim..j1 * dim]);
                    let scores = MatmulSpec::new(rows, keys, dim).transpose(false, true);
                    gemm_serial(&scores.scaled(scale, 0.0), qb, kj, p);
                    gemm_serial(&scores, dob, vj, ds);
                    for (r, (p, ds)) in p.chunks_mut(keys).zip(ds.chunks_mut(keys)).enumerate() {
                        let (i, qr) = (i0 + r, h * seq + i0 + r);
                        let seen = key_end(params.causal, i, seq).clamp(j0, j1) - j0;
                        Dropping::fill_factors(drop, &dims, (h, i, j0), &mut factors[..keys]);
                        let (lse_i, d_i) = (lse[qr], dsum[qr]);
                        let (f, (p, p_masked), (ds, ds_masked)) =
                            (&factors[..seen], p.split_at_mut(seen), ds.split_at_mut(seen));
                        for ((p, ds), &f) in p.iter_mut().zip(ds.iter_mut()).zip(f) {
                            // P_ij, then P~_ij = P_ij * f; dS_ij / scale = P_ij (f dP~_ij - D_i).
                            let prob = exp(*p - lse_i);
                            let dp = if f == 0.0 { 0.0 } else { f * *ds };
                            *ds = prob * (dp - d_i);
                            *p = prob * f;
                        }
                        p_masked.fill(0.0);
                        ds_masked.fill(0.0);
                    }
                    let rows_k = MatmulSpec::new(keys, dim, rows).transpose(true, false);
                    gemm_serial(&rows_k.scaled(1.0, 1.0), p, dob, &mut gv[j0 * dim..j1 * dim]);
                    gemm_serial(&rows_k.scaled(1.0, 1.0), ds, qb, &mut gk[j0 * dim..j1 * dim]);
                    gemm_serial(&MatmulSpec::new(rows, dim, keys).scaled(1.0, 1.0), ds, kj, gq);
                }
            }
        }
        let round = |out: &mut [T], g: &[f32], by: f32| {
            out.iter_mut().zip(g).for_each(|(d, &g)| *d = T::from_f32(by * g));
        };
        round(dq, &gq, scale);
        round(dk, &gk, scale);
        round(dv, &gv, 1.0);
    });
    Ok(())
}
