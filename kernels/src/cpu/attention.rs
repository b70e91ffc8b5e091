//! Scaled dot-product attention without a `seq x seq` buffer: FlashAttention's algorithm
//! on the host (Dao et al. 2022; FlashAttention-2, Dao 2023).
//!
//! The forward visits a query's keys in blocks of [`KEY_BLOCK`] with the online softmax: a
//! running maximum `m` and sum `l` of `exp(s - m)`, the output accumulator rescaled by
//! `exp(m_old - m_new)` whenever the maximum grows. It keeps the output and each row's
//! logsumexp `m + ln l`. The backward recomputes each probability from the logsumexp,
//! `p = exp(s - lse)`, and uses `D_i = dO_i . O_i` (= `sum_j p_ij dP_ij`, dropout
//! included) for the softmax's gradient `dS = P (dP - D)`: key rows' `dK`, `dV` in one pass,
//! query rows' `dQ` in another, so every output has a single writer (no atomics, the same
//! split as the CUDA kernels). Scratch memory is a block of scores per row and f32 copies of
//! the inputs: linear in the sequence length.
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
use crate::cpu::random::uniform_at;
use crate::dtype::Element;
use crate::error::Result;
use crate::params::{AttentionDims, AttentionParams};
use rayon::prelude::*;
use std::borrow::Cow;

/// Keys per block of the forward's online softmax.
pub const KEY_BLOCK: usize = 64;

/// Rows handed to one rayon task at least.
const MIN_ROWS_PER_TASK: usize = 8;

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

    /// The factor on probability `(h, i, j)`: `1 / (1 - p)` when kept, else 0.
    fn factor(drop: Option<Dropping>, dims: &AttentionDims, h: usize, i: usize, j: usize) -> f32 {
        match drop {
            None => 1.0,
            Some(d) => {
                let u = uniform_at(d.seed, d.offset.wrapping_add(dims.prob_index(h, i, j)));
                if u >= d.p { d.keep_scale } else { 0.0 }
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

/// The forward on heads-major f32 operands into heads-major `out`.
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
    out.par_chunks_mut(dim)
        .zip(lse.par_iter_mut())
        .enumerate()
        .with_min_len(MIN_ROWS_PER_TASK)
        .for_each(|(row, (o, lse))| {
            let (h, i) = (row / seq, row % seq);
            let head = h / dims.kv_group.max(1) * seq * dim;
            let qi = &q[row * dim..(row + 1) * dim];
            let mut acc = vec![0.0f32; dim];
            let mut scores = [0.0f32; KEY_BLOCK];
            let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
            let end = key_end(params.causal, i, seq);
            for j0 in (0..end).step_by(KEY_BLOCK) {
                let j1 = (j0 + KEY_BLOCK).min(end);
                let mut block_max = f32::NEG_INFINITY;
                for j in j0..j1 {
                    let kj = &k[head + j * dim..head + (j + 1) * dim];
                    let s = scale * dot(qi, kj);
                    scores[j - j0] = s;
                    block_max = block_max.max(s);
                }
                let m_new = m.max(block_max);
                let alpha = (m - m_new).exp();
                l *= alpha;
                acc.iter_mut().for_each(|a| *a *= alpha);
                for j in j0..j1 {
                    let e = (scores[j - j0] - m_new).exp();
                    l += e;
                    let w = e * Dropping::factor(drop, &dims, h, i, j);
                    if w != 0.0 {
                        let vj = &v[head + j * dim..head + (j + 1) * dim];
                        acc.iter_mut().zip(vj).for_each(|(a, &x)| *a += w * x);
                    }
                }
                m = m_new;
            }
            for (o, a) in o.iter_mut().zip(&acc) {
                *o = T::from_f32(a / l);
            }
            *lse = m + l.ln();
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

/// The backward on heads-major f32 `[q, k, v, out, dout]` into heads-major gradients.
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
    let causal = params.causal;
    fn row_of(t: &[f32], r: usize, dim: usize) -> &[f32] {
        &t[r * dim..(r + 1) * dim]
    }
    let row = |t, r| row_of(t, r, dim);
    // D_i = dO_i . O_i.
    let dsum: Vec<f32> = (0..dims.rows()).map(|r| dot(row(d_o, r), row(o, r))).collect();
    let group = dims.kv_group.max(1);
    // (P_ij, dS_ij / scale) for query row `qr` of head `h`, key row `kr` of its key/value
    // head.
    let grad = |h: usize, i: usize, j: usize| -> (f32, f32) {
        let (qr, kr) = (h * seq + i, h / group * seq + j);
        let p = (scale * dot(row(q, qr), row(k, kr)) - lse[qr]).exp();
        let f = Dropping::factor(drop, &dims, h, i, j);
        let dp = if f == 0.0 { 0.0 } else { f * dot(row(d_o, qr), row(v, kr)) };
        (p * f, p * (dp - dsum[qr]))
    };
    // Key rows of each key/value head: dK_j = scale * sum_i dS_ij q_i, dV_j = sum_i P~_ij
    // dO_i over the rows i of every query head of its group.
    dk.par_chunks_mut(dim)
        .zip(dv.par_chunks_mut(dim))
        .enumerate()
        .with_min_len(MIN_ROWS_PER_TASK)
        .for_each(|(kr, (dk_j, dv_j))| {
            let (kh, j) = (kr / seq, kr % seq);
            let (mut gk, mut gv) = (vec![0.0f32; dim], vec![0.0f32; dim]);
            let first = if causal { j } else { 0 };
            for h in kh * group..(kh + 1) * group {
                for i in first..seq {
                    let (pd, ds) = grad(h, i, j);
                    let qr = h * seq + i;
                    gv.iter_mut().zip(row(d_o, qr)).for_each(|(g, &x)| *g += pd * x);
                    gk.iter_mut().zip(row(q, qr)).for_each(|(g, &x)| *g += ds * x);
                }
            }
            dk_j.iter_mut().zip(&gk).for_each(|(d, &g)| *d = T::from_f32(scale * g));
            dv_j.iter_mut().zip(&gv).for_each(|(d, &g)| *d = T::from_f32(g));
        });
    // Query rows: dQ_i = scale * sum_j dS_ij k_j.
    dq.par_chunks_mut(dim).enumerate().with_min_len(MIN_ROWS_PER_TASK).for_each(|(qr, dq_i)| {
        let (h, i) = (qr / seq, qr % seq);
        let mut g = vec![0.0f32; dim];
        for j in 0..key_end(causal, i, seq) {
            let (_, ds) = grad(h, i, j);
            g.iter_mut().zip(row(k, h / group * seq + j)).for_each(|(g, &x)| *g += ds * x);
        }
        dq_i.iter_mut().zip(&g).for_each(|(d, &g)| *d = T::from_f32(scale * g));
    });
    Ok(())
}
