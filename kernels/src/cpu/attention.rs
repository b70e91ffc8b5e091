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
//! dropout included) for the softmax's gradient `dS = P (dP - D)`: per block pair the
//! products `S`, `dP = dO v^T`, `dV += P^T dO`, `dK += dS^T q`, `dQ += dS k` into f32
//! accumulators, every gradient row with one writer. With at least twice as many key/value
//! heads as threads it runs one task per head (over its group's query heads), computing
//! every score once; with fewer, one task per key block for dK/dV and one per query block
//! for dQ (the CUDA kernels' split), computing S and dP twice but keeping every core busy
//! (one head of 2048 tokens: 12.8 ms against 16.4). Both add the same products in the same
//! order, so the bits do not depend on the machine's thread count (tested).
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
use std::ops::Range;

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

    /// The factors of probabilities `(h, i, j0 .. j0 + out.len())` into `out`: `1 / (1 - p)`
    /// where kept, else 0; one Philox block per four of them.
    fn fill(self, dims: &AttentionDims, (h, i, j0): (usize, usize, usize), out: &mut [f32]) {
        let start = self.offset.wrapping_add(dims.prob_index(h, i, j0));
        for_each_uniform(self.seed, start, out.len(), |j, u| {
            out[j] = if u >= self.p { self.keep_scale } else { 0.0 };
        });
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
                // Passes of their own, so that the exponentials vectorize (a running sum would
                // not).
                row.iter_mut().for_each(|x| *x = exp(*x - m_new));
                let sum: f32 = row.iter().sum();
                if let Some(d) = drop {
                    d.fill(&dims, (h, i, j0), &mut factors[..keys]);
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

/// How the backward shares its work out ([`backward`]).
#[derive(Clone, Copy, PartialEq, Debug)]
enum Split {
    /// One task per key/value head: every score computed once.
    PerHead,
    /// One task per key block for dK and dV, and one per query block for dQ (the CUDA
    /// kernels' split): S and dP computed twice, but as many tasks as blocks.
    PerBlock,
}

/// The backward on heads-major f32 `[q, k, v, out, dout]` into heads-major gradients. Per
/// pair of a block of [`QUERY_BLOCK`] queries and one of [`KEY_BLOCK`] keys: `S = scale q
/// k^T` and `dP = dO v^T`, then the products into f32 accumulators (`dV += P^T dO`, `dK +=
/// dS^T q`, `dQ += dS k`) rounded once at the end; every gradient row has one writer. With
/// as many key/value heads as twice the threads, one task per head ([`Split::PerHead`]);
/// with fewer, one task per block ([`Split::PerBlock`]), so that a single head still uses
/// every core. Both add the same products in the same order: the results are the same bit
/// for bit, whatever the machine.
fn backward<T: Element>(
    ins: [&[f32]; 5],
    lse: &[f32],
    grads: [&mut [T]; 3],
    dims: AttentionDims,
    params: &AttentionParams,
) -> Result<()> {
    let kv_heads = dims.heads / dims.kv_group.max(1);
    let split =
        if kv_heads >= 2 * rayon::current_num_threads() { Split::PerHead } else { Split::PerBlock };
    backward_split(ins, lse, grads, dims, params, split);
    Ok(())
}

/// What every block pair of a backward reads.
struct Pairs<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    d_o: &'a [f32],
    lse: &'a [f32],
    /// `D_i = dO_i . O_i` per query row.
    dsum: Vec<f32>,
    dims: AttentionDims,
    params: &'a AttentionParams,
    scale: f32,
    drop: Option<Dropping>,
    group: usize,
}

impl Pairs<'_> {
    /// The rows of query block `i0` of head `h` (indices of heads-major rows).
    fn query_rows(&self, h: usize, i0: usize) -> Range<usize> {
        let seq = self.dims.seq;
        h * seq + i0..h * seq + (i0 + QUERY_BLOCK).min(seq)
    }

    /// The keys of block `j0` that query block `i0` sees (empty when it sees none).
    fn keys(&self, i0: usize, j0: usize) -> Range<usize> {
        let seq = self.dims.seq;
        let end = if self.params.causal { (i0 + QUERY_BLOCK).min(seq) } else { seq };
        j0..(j0 + KEY_BLOCK).min(end).max(j0)
    }

    /// `rows` of `t` (`dim` wide).
    fn rows<'t>(&self, t: &'t [f32], rows: Range<usize>) -> &'t [f32] {
        &t[rows.start * self.dims.dim..rows.end * self.dims.dim]
    }

    /// P~ (dropout applied) and dS / scale of query block `i0` of head `h` against `keys`
    /// of its key/value head, into `p` and `ds` (`[rows, keys]`; masked entries 0).
    fn pair(&self, h: usize, i0: usize, keys: Range<usize>, p: &mut [f32], ds: &mut [f32]) {
        let AttentionDims { seq, .. } = self.dims;
        let qr = self.query_rows(h, i0);
        let kh = h / self.group * seq;
        let kr = kh + keys.start..kh + keys.end;
        let (j0, j1, n) = (keys.start, keys.end, keys.len());
        let scores = MatmulSpec::new(qr.len(), n, self.dims.dim).transpose(false, true);
        let (qb, kb) = (self.rows(self.q, qr.clone()), self.rows(self.k, kr.clone()));
        gemm_serial(&scores.scaled(self.scale, 0.0), qb, kb, p);
        gemm_serial(&scores, self.rows(self.d_o, qr.clone()), self.rows(self.v, kr), ds);
        // All 1 without dropout.
        let mut factors = [1.0f32; KEY_BLOCK];
        for (r, (p, ds)) in p.chunks_mut(n).zip(ds.chunks_mut(n)).enumerate() {
            let (i, row) = (i0 + r, qr.start + r);
            let seen = key_end(self.params.causal, i, seq).clamp(j0, j1) - j0;
            if let Some(d) = self.drop {
                d.fill(&self.dims, (h, i, j0), &mut factors[..n]);
            }
            let (lse_i, d_i) = (self.lse[row], self.dsum[row]);
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
    }

    /// `dv += P~^T dO` and `dk += dS^T q` for a pair's `p` and `ds` (`[rows, keys]`), `dk`
    /// and `dv` the `[keys, dim]` rows of those keys.
    fn add_key_grads(
        &self,
        h: usize,
        i0: usize,
        (p, ds): (&[f32], &[f32]),
        [dk, dv]: [&mut [f32]; 2],
    ) {
        let qr = self.query_rows(h, i0);
        let keys = p.len() / qr.len();
        let spec =
            MatmulSpec::new(keys, self.dims.dim, qr.len()).transpose(true, false).scaled(1.0, 1.0);
        gemm_serial(&spec, p, self.rows(self.d_o, qr.clone()), dv);
        gemm_serial(&spec, ds, self.rows(self.q, qr), dk);
    }

    /// `dq += dS k` for a pair's `ds` (`[rows, keys]`) against `keys` of head `h`'s key/value
    /// head, `dq` the `[rows, dim]` rows of the query block.
    fn add_query_grads(&self, h: usize, keys: Range<usize>, ds: &[f32], dq: &mut [f32]) {
        let kh = h / self.group * self.dims.seq;
        let kb = self.rows(self.k, kh + keys.start..kh + keys.end);
        let spec = MatmulSpec::new(ds.len() / keys.len(), self.dims.dim, keys.len());
        gemm_serial(&spec.scaled(1.0, 1.0), ds, kb, dq);
    }
}

/// `out = by * g`, rounded to `T`.
fn round_into<T: Element>(out: &mut [T], g: &[f32], by: f32) {
    out.iter_mut().zip(g).for_each(|(d, &g)| *d = T::from_f32(by * g));
}

/// [`backward`] with the split given.
fn backward_split<T: Element>(
    [q, k, v, o, d_o]: [&[f32]; 5],
    lse: &[f32],
    [dq, dk, dv]: [&mut [T]; 3],
    dims: AttentionDims,
    params: &AttentionParams,
    split: Split,
) {
    let AttentionDims { seq, dim, .. } = dims;
    let dsum = d_o.par_chunks(dim).zip(o.par_chunks(dim)).map(|(a, b)| dot(a, b)).collect();
    let (scale, drop, group) = (params.scale_for(dim), Dropping::of(params), dims.kv_group.max(1));
    let pairs = Pairs { q, k, v, d_o, lse, dsum, dims, params, scale, drop, group };
    let pairs = &pairs;
    let head_len = seq * dim;
    let scratch = || (vec![0.0f32; QUERY_BLOCK * KEY_BLOCK], vec![0.0f32; QUERY_BLOCK * KEY_BLOCK]);
    if split == Split::PerHead {
        let blocks = dq.par_chunks_mut(group * head_len).zip(dk.par_chunks_mut(head_len));
        blocks.zip(dv.par_chunks_mut(head_len)).enumerate().for_each(|(kh, ((dq, dk), dv))| {
            let (mut gq, mut gk, mut gv) =
                (vec![0.0f32; group * head_len], vec![0.0f32; head_len], vec![0.0f32; head_len]);
            let (mut probs, mut dprobs) = scratch();
            for h in kh * group..(kh + 1) * group {
                for i0 in (0..seq).step_by(QUERY_BLOCK) {
                    let qr = pairs.query_rows(h, i0);
                    let at = qr.start - kh * group * seq;
                    let gq = &mut gq[at * dim..(at + qr.len()) * dim];
                    for j0 in (0..seq).step_by(KEY_BLOCK) {
                        let keys = pairs.keys(i0, j0);
                        if keys.is_empty() {
                            break;
                        }
                        let n = qr.len() * keys.len();
                        let (p, ds) = (&mut probs[..n], &mut dprobs[..n]);
                        pairs.pair(h, i0, keys.clone(), p, ds);
                        let at = keys.start * dim..keys.end * dim;
                        let grads = [&mut gk[at.clone()], &mut gv[at]];
                        pairs.add_key_grads(h, i0, (p, ds), grads);
                        pairs.add_query_grads(h, keys, ds, gq);
                    }
                }
            }
            round_into(dq, &gq, scale);
            round_into(dk, &gk, scale);
            round_into(dv, &gv, 1.0);
        });
        return;
    }
    // dK and dV: one task per key block of a key/value head, over its group's query heads.
    let mut tasks = Vec::new();
    for (kh, (dk, dv)) in dk.chunks_mut(head_len).zip(dv.chunks_mut(head_len)).enumerate() {
        let blocks = dk.chunks_mut(KEY_BLOCK * dim).zip(dv.chunks_mut(KEY_BLOCK * dim));
        for (b, (dk, dv)) in blocks.enumerate() {
            tasks.push((kh, b * KEY_BLOCK, dk, dv));
        }
    }
    tasks.into_par_iter().for_each(|(kh, j0, dk, dv)| {
        let (mut gk, mut gv) = (vec![0.0f32; dk.len()], vec![0.0f32; dv.len()]);
        let (mut probs, mut dprobs) = scratch();
        for h in kh * group..(kh + 1) * group {
            for i0 in (0..seq).step_by(QUERY_BLOCK) {
                let keys = pairs.keys(i0, j0);
                if keys.is_empty() {
                    continue;
                }
                let n = pairs.query_rows(h, i0).len() * keys.len();
                let (p, ds) = (&mut probs[..n], &mut dprobs[..n]);
                let at = 0..keys.len() * dim;
                pairs.pair(h, i0, keys, p, ds);
                pairs.add_key_grads(h, i0, (p, ds), [&mut gk[at.clone()], &mut gv[at]]);
            }
        }
        round_into(dk, &gk, scale);
        round_into(dv, &gv, 1.0);
    });
    // dQ: one task per query block of a head.
    let mut tasks = Vec::new();
    for (h, dq) in dq.chunks_mut(head_len).enumerate() {
        for (b, dq) in dq.chunks_mut(QUERY_BLOCK * dim).enumerate() {
            tasks.push((h, b * QUERY_BLOCK, dq));
        }
    }
    tasks.into_par_iter().for_each(|(h, i0, dq)| {
        let mut gq = vec![0.0f32; dq.len()];
        let (mut probs, mut dprobs) = scratch();
        let rows = pairs.query_rows(h, i0).len();
        for j0 in (0..seq).step_by(KEY_BLOCK) {
            let keys = pairs.keys(i0, j0);
            if keys.is_empty() {
                break;
            }
            let n = rows * keys.len();
            let (p, ds) = (&mut probs[..n], &mut dprobs[..n]);
            pairs.pair(h, i0, keys.clone(), p, ds);
            pairs.add_query_grads(h, keys, ds, &mut gq);
        }
        round_into(dq, &gq, scale);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::elementwise::testing::seeded as values;
    use half::bf16;

    /// Both splits of the backward, on `T`: every gradient bit for bit, whatever the
    /// machine's thread count picks.
    fn splits_agree<T: Element + PartialEq + std::fmt::Debug>() {
        // 150 tokens: three blocks, the last partial; 6 query heads over 2 key/value heads.
        let dims = AttentionDims { heads: 6, seq: 150, dim: 24, heads_per_token: 1, kv_group: 3 };
        let kv = dims.kv();
        let wide = |n, salt| values(n, salt).iter().map(|&x| T::from_f32(x).to_f32()).collect();
        let (q, k, v, d_o): (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) =
            (wide(dims.len(), 1), wide(kv.len(), 2), wide(kv.len(), 3), wide(dims.len(), 4));
        for causal in [false, true] {
            for params in [
                AttentionParams::new(causal),
                AttentionParams::new(causal).with_dropout(0.2, 5, 77),
            ] {
                let (mut o, mut lse) = (vec![0.0f32; dims.len()], vec![0.0f32; dims.rows()]);
                forward(&q, &k, &v, &mut o, &mut lse, dims, &params).unwrap();
                let run = |split| {
                    let zeros = |n| vec![T::from_f32(0.0); n];
                    let mut g = [zeros(dims.len()), zeros(kv.len()), zeros(kv.len())];
                    let [a, b, c] = &mut g;
                    backward_split([&q, &k, &v, &o, &d_o], &lse, [a, b, c], dims, &params, split);
                    g
                };
                let (per_head, per_block) = (run(Split::PerHead), run(Split::PerBlock));
                assert!(per_head[0].iter().any(|x| x.to_f32() != 0.0), "dq is not all zeros");
                assert_eq!(per_head, per_block, "{params:?}");
            }
        }
    }

    #[test]
    fn the_backward_splits_give_the_same_bits() {
        splits_agree::<f32>();
        splits_agree::<bf16>();
    }
}
