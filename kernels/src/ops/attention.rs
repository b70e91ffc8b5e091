//! Fused scaled dot-product attention, as PyTorch's SDPA flash backend computes it
//! (`F.scaled_dot_product_attention` with `is_causal`, `dropout_p`, `scale`), forward and
//! backward, without a `seq x seq` buffer on any backend.
//!
//! The forward ([`attention`]) saves what FlashAttention-2 saves (Dao 2023, "FlashAttention-2:
//! Faster Attention with Better Parallelism and Work Partitioning"): the output and each
//! query row's logsumexp (f32), plus the dropout stream's `(seed, offset)` in the
//! [`AttentionParams`] the caller keeps. The backward ([`attention_backward`]) recomputes
//! the probabilities tile by tile from the logsumexp, with one f32 per query row of
//! workspace (`D = rowsum(dO * O)`). Memory is linear in the sequence length: the op plans
//! the output and the logsumexp forward, the three gradients and `D` backward, identically
//! on the host, a virtual device and a GPU.
//!
//! q, k and v are of one shape and dtype, in one of two layouts ([`AttentionLayout`], from
//! the params): heads-major `[.., seq, head_dim]` (`[batch * heads, seq, head_dim]` as a
//! transformer's head split gives them, or `[batch, heads, seq, head_dim]`; every leading
//! index an independent head), or tokens-major `[batch, seq, heads, head_dim]`, a linear
//! projection's `[batch * seq, heads * head_dim]` output as it is (FlashAttention's layout,
//! and the memory PyTorch's flash and memory-efficient SDPA backends use: the output is the
//! next projection's input without a copy). The logsumexp is `[.., seq]` heads-major and
//! `[batch, heads, seq]` tokens-major. With [`AttentionParams::grouped`] (PyTorch's
//! `enable_gqa`), k and v may have fewer heads than q (grouped-query attention, as Llama 3,
//! Mistral and Qwen2 attend): each key/value head serves consecutive query heads where they
//! are, with no repeated copy, and the backward sums each key/value head's gradient over
//! its group. Arithmetic is in f32 whatever the storage dtype. With dropout, the op drops
//! exactly the elements `ops::dropout(probs, p, seed, offset)` drops on the explicit
//! `[.., seq, seq]` probabilities (see [`AttentionParams`]).
//!
//! On a GPU the kernels (`cuda/kernels/attention.cu`) take head dims up to 128 and any
//! sequence length; f16 and bf16 with head dims a multiple of 16 (64, 128, ...) run forward
//! and backward on tensor cores (`mma.sync`, f32 accumulate; the probabilities and their
//! gradients rounded to 16 bits as operands, as FlashAttention does), f32 and other widths
//! on f32 FMAs. The backward splits the work as FlashAttention-2 does, one block per key
//! tile for dK and dV and one per query tile for dQ, without its atomics. The tensor-core
//! kernels come in two instances, for heads up to 64 (GPT-2, ViT-B, Llama 3.2 1B) and up to
//! 128, their register fragments sized for each; the 128-wide dK/dV kernel reads its key
//! tile's K and V from (dynamic) shared memory rather than holding them as fragments. On
//! sm_90 none of them spills (158-254 registers a thread; `nvrtc_check` compiles them and
//! checks). The host takes any head dim.

use super::dispatch::{Buffers, Op, OutputSpec, Plan, run};
use super::{expect_shape, invalid, same_layout};
use crate::cpu::attention as cpu;
use crate::device::Device;
use crate::dtype::{DType, with_dtype};
use crate::error::Result;
use crate::params::{AttentionDims, AttentionLayout, AttentionParams};
use crate::tensor::Tensor;

/// What [`attention`] returns and its backward reads: the output (q's shape and dtype) and
/// each query row's logsumexp of the scaled, masked scores (`[.., seq]`, f32).
#[derive(Debug)]
pub struct AttentionOutput {
    /// `softmax(scale * q k^T) v`, with dropout on the probabilities.
    pub out: Tensor,
    /// `logsumexp_j(scale * q_i . k_j)` over the keys row `i` sees.
    pub lse: Tensor,
}

/// The gradients [`attention_backward`] returns, each of its input's shape and dtype.
#[derive(Debug)]
pub struct AttentionGrads {
    /// Gradient of the queries.
    pub dq: Tensor,
    /// Gradient of the keys.
    pub dk: Tensor,
    /// Gradient of the values.
    pub dv: Tensor,
}

/// Scaled dot-product attention of `q`, `k`, `v` (`[.., seq, head_dim]`, one shape and
/// dtype): `dropout(softmax(scale * q k^T + mask)) v` per head, without materializing the
/// scores. Saves nothing of size `seq x seq`; see the module docs.
///
/// # Errors
///
/// Shape, dtype and device mismatches; a rank below 2 or a head dim of 0; an invalid
/// dropout probability or scale; out of memory.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    params: &AttentionParams,
) -> Result<AttentionOutput> {
    let dims = dims_of("attention", q, k, v, params)?;
    run(Forward { q, k, v, params: *params, dims })
}

/// Gradients of [`attention`] with respect to `q`, `k` and `v`, from its inputs, what it
/// returned (`fwd`), the output's gradient `dout` and the forward's `params` (the same
/// dropout `(seed, offset)` regenerates the same mask).
///
/// # Errors
///
/// As [`attention`], and mismatches of `fwd` and `dout` with the inputs.
pub fn attention_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    fwd: &AttentionOutput,
    dout: &Tensor,
    params: &AttentionParams,
) -> Result<AttentionGrads> {
    let dims = dims_of("attention_backward", q, k, v, params)?;
    run(Backward { q, k, v, fwd, dout, params: *params, dims, dsum: None })
}

/// Checks q, k and v against the params' layout and grouping and returns the sizes of the
/// call.
fn dims_of(
    op: &'static str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    params: &AttentionParams,
) -> Result<AttentionDims> {
    same_layout(op, k, v)?;
    let group = if params.grouped {
        super::same_kind(op, q, k)?;
        kv_group(op, q.shape(), k.shape(), params.layout)?
    } else {
        same_layout(op, q, k)?;
        1
    };
    let shape = q.shape();
    let dims = match params.layout {
        AttentionLayout::HeadsMajor => {
            let [lead @ .., seq, dim] = shape else {
                return Err(invalid(op, format!("expected [.., seq, head_dim], got {shape:?}")));
            };
            AttentionDims::heads_major(lead.iter().product(), *seq, *dim)
        }
        AttentionLayout::TokensMajor => {
            let &[batch, seq, heads, dim] = shape else {
                return Err(invalid(
                    op,
                    format!(
                        "tokens-major operands are [batch, seq, heads, head_dim], got {shape:?}"
                    ),
                ));
            };
            AttentionDims {
                heads: batch * heads,
                seq,
                dim,
                heads_per_token: heads.max(1),
                kv_group: 1,
            }
        }
    };
    if dims.dim == 0 {
        return Err(invalid(op, format!("head dim 0 in {shape:?}")));
    }
    Ok(AttentionDims { kv_group: group, ..dims })
}

/// The query heads per key/value head of grouped operands: q and k alike but for the heads
/// axis (heads-major `[.., heads, seq, dim]`: the axis before seq; tokens-major `[batch,
/// seq, heads, dim]`: the third), whose q size is a multiple of k's.
fn kv_group(op: &'static str, q: &[usize], k: &[usize], layout: AttentionLayout) -> Result<usize> {
    let axis = match layout {
        AttentionLayout::HeadsMajor => q.len().checked_sub(3),
        AttentionLayout::TokensMajor => (q.len() == 4).then_some(2),
    };
    let mismatch = || {
        invalid(
            op,
            format!(
                "grouped-query attention: k {k:?} must be q {q:?} with fewer heads (a divisor of \
                 q's) on the heads axis"
            ),
        )
    };
    let Some(axis) = axis else {
        return if q == k { Ok(1) } else { Err(mismatch()) };
    };
    let others_agree =
        q.len() == k.len() && q.iter().zip(k).enumerate().all(|(i, (a, b))| i == axis || a == b);
    let (qh, kh) = (q[axis], k.get(axis).copied().unwrap_or(0));
    if !others_agree || kh == 0 || !qh.is_multiple_of(kh) {
        return Err(mismatch());
    }
    Ok(qh / kh)
}

/// The logsumexp's shape: q's without the head dim (heads-major), `[batch, heads, seq]`
/// (tokens-major).
fn lse_shape(q: &Tensor, layout: AttentionLayout) -> Vec<usize> {
    match (layout, q.shape()) {
        (AttentionLayout::TokensMajor, &[batch, seq, heads, _]) => vec![batch, heads, seq],
        _ => q.shape()[..q.rank() - 1].to_vec(),
    }
}

struct Forward<'a> {
    q: &'a Tensor,
    k: &'a Tensor,
    v: &'a Tensor,
    params: AttentionParams,
    /// The sizes, from the checked operands.
    dims: AttentionDims,
}

impl Op for Forward<'_> {
    const NAME: &'static str = "attention";
    type Outs = [Tensor; 2];
    type Output = AttentionOutput;

    fn device(&self) -> &Device {
        self.q.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        self.params.validate(Self::NAME)?;
        Ok(Plan::new([
            OutputSpec::new(self.q.shape(), self.q.dtype()),
            OutputSpec::new(&lse_shape(self.q, self.params.layout), DType::F32),
        ]))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let dims = self.dims;
        let [out, lse] = bufs.outputs_mut();
        let lse = lse.out_slice::<f32>(Self::NAME)?;
        with_dtype!(self.q.dtype(), T => {
            let (q, k, v) =
                (self.q.as_slice::<T>()?, self.k.as_slice::<T>()?, self.v.as_slice::<T>()?);
            cpu::attention(q, k, v, out.out_slice::<T>(Self::NAME)?, lse, dims, &self.params)
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let [out, lse] = bufs.outputs_mut();
        let ptrs = [self.q.cuda_ptr()?, self.k.cuda_ptr()?, self.v.cuda_ptr()?];
        let io = [ptrs[0], ptrs[1], ptrs[2], out.cuda_ptr()?, lse.cuda_ptr()?];
        launches::forward(gpu, self.q.dtype(), self.dims, &self.params, io)
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<AttentionOutput> {
        let [out, lse] = bufs.into_outputs();
        Ok(AttentionOutput { out, lse })
    }
}

struct Backward<'a> {
    q: &'a Tensor,
    k: &'a Tensor,
    v: &'a Tensor,
    fwd: &'a AttentionOutput,
    dout: &'a Tensor,
    params: AttentionParams,
    /// The sizes, from the checked operands.
    dims: AttentionDims,
    /// The workspace of `D = rowsum(dO * O)`.
    dsum: Option<usize>,
}

impl Op for Backward<'_> {
    const NAME: &'static str = "attention_backward";
    type Outs = [Tensor; 3];
    type Output = AttentionGrads;

    fn device(&self) -> &Device {
        self.q.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        const OP: &str = "attention_backward";
        self.params.validate(OP)?;
        same_layout(OP, self.q, &self.fwd.out)?;
        same_layout(OP, self.q, self.dout)?;
        expect_shape(OP, &lse_shape(self.q, self.params.layout), &self.fwd.lse)?;
        super::expect_dtype(OP, DType::F32, &self.fwd.lse)?;
        super::same_device(OP, self.q, &self.fwd.lse)?;
        let spec = |t: &Tensor| OutputSpec::new(t.shape(), t.dtype());
        let mut plan = Plan::new([spec(self.q), spec(self.k), spec(self.k)]);
        self.dsum = plan.workspace(self.dims.rows() * std::mem::size_of::<f32>());
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let dims = self.dims;
        let [dq, dk, dv] = bufs.outputs_mut();
        let lse = self.fwd.lse.as_slice::<f32>()?;
        with_dtype!(self.q.dtype(), T => {
            let saved = cpu::AttentionSaved {
                q: self.q.as_slice::<T>()?,
                k: self.k.as_slice::<T>()?,
                v: self.v.as_slice::<T>()?,
                out: self.fwd.out.as_slice::<T>()?,
                lse,
            };
            let grads = [
                dq.out_slice::<T>(Self::NAME)?,
                dk.out_slice::<T>(Self::NAME)?,
                dv.out_slice::<T>(Self::NAME)?,
            ];
            cpu::attention_backward(saved, self.dout.as_slice::<T>()?, grads, dims, &self.params)
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let dsum = bufs.ws(self.dsum)?;
        let [dq, dk, dv] = bufs.outputs_mut();
        let inputs = [
            self.q.cuda_ptr()?,
            self.k.cuda_ptr()?,
            self.v.cuda_ptr()?,
            self.fwd.out.cuda_ptr()?,
            self.fwd.lse.cuda_ptr()?,
            self.dout.cuda_ptr()?,
            dsum,
        ];
        let grads = [dq.cuda_ptr()?, dk.cuda_ptr()?, dv.cuda_ptr()?];
        let dims = self.dims;
        launches::backward(gpu, self.q.dtype(), dims, &self.params, inputs, grads)
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<AttentionGrads> {
        let [dq, dk, dv] = bufs.into_outputs();
        Ok(AttentionGrads { dq, dk, dv })
    }
}

/// The CUDA launches on raw addresses, written against [`Exec`](crate::cuda::Exec) so that
/// the tests run them whole on the host emulation.
#[cfg(feature = "cuda")]
mod launches {
    use crate::cuda::registry::{
        ATTENTION_BWD_DKDV, ATTENTION_BWD_DKDV_MMA_BF16, ATTENTION_BWD_DKDV_MMA_D64_BF16,
        ATTENTION_BWD_DKDV_MMA_D64_F16, ATTENTION_BWD_DKDV_MMA_F16, ATTENTION_BWD_DOT,
        ATTENTION_BWD_DQ, ATTENTION_BWD_DQ_MMA_BF16, ATTENTION_BWD_DQ_MMA_D64_BF16,
        ATTENTION_BWD_DQ_MMA_D64_F16, ATTENTION_BWD_DQ_MMA_F16, ATTENTION_FWD,
        ATTENTION_FWD_MMA_BF16, ATTENTION_FWD_MMA_D64_BF16, ATTENTION_FWD_MMA_D64_F16,
        ATTENTION_FWD_MMA_F16, Instance,
    };
    use crate::cuda::{Arg, Exec, launch};
    use crate::dtype::DType;
    use crate::error::{Error, Result};
    use crate::params::{AttentionDims, AttentionParams};
    use cudarc::driver::LaunchConfig;

    /// Rows of a query tile and of a key tile (`ATT_BQ`, `ATT_BK` in `attention.cu`).
    const TILE: usize = 16;
    /// Query rows of a tensor-core forward block (`ATT_MQ`).
    const MMA_TILE: usize = 64;
    /// The widest head the kernels take (`ATT_DMAX`).
    pub(super) const MAX_DIM: usize = 128;
    /// Threads per block (`ATT_THREADS`).
    const THREADS: u32 = 128;
    /// The largest grid.y (heads).
    const MAX_HEADS: usize = 65535;

    /// Head dims up to which the `_d64` tensor-core instances serve (their registers sized
    /// for 64; the others are sized for [`MAX_DIM`]).
    const MMA_NARROW: usize = 64;

    /// The dynamic shared memory of the wide tensor-core dK/dV kernel: its key tile's K and
    /// V, 64 rows of `MAX_DIM + 8` 16-bit elements each (`ATT_KV_DYN_BYTES`).
    pub(super) const WIDE_DKDV_SHARED: u32 = (2 * MMA_TILE * (MAX_DIM + 8) * 2) as u32;

    /// The dynamic shared memory of the wide tensor-core dQ kernel: its dO tile.
    pub(super) const WIDE_DQ_SHARED: u32 = WIDE_DKDV_SHARED / 2;

    /// The tensor-core kernels (forward, dK/dV, dQ) for `dtype` and heads of `dim`, where
    /// there are: 16-bit inputs, head dims a multiple of 16 (the f32 path and other widths
    /// run on f32 FMAs); heads of at most 64 get the instances sized for 64.
    pub(super) fn tensor_cores(dtype: DType, dim: usize) -> Option<[Instance; 3]> {
        if !dim.is_multiple_of(16) || dim > MAX_DIM {
            return None;
        }
        let narrow = dim <= MMA_NARROW;
        let kernels = match (dtype, narrow) {
            (DType::F16, true) => [
                &ATTENTION_FWD_MMA_D64_F16,
                &ATTENTION_BWD_DKDV_MMA_D64_F16,
                &ATTENTION_BWD_DQ_MMA_D64_F16,
            ],
            (DType::F16, false) => {
                [&ATTENTION_FWD_MMA_F16, &ATTENTION_BWD_DKDV_MMA_F16, &ATTENTION_BWD_DQ_MMA_F16]
            }
            (DType::BF16, true) => [
                &ATTENTION_FWD_MMA_D64_BF16,
                &ATTENTION_BWD_DKDV_MMA_D64_BF16,
                &ATTENTION_BWD_DQ_MMA_D64_BF16,
            ],
            (DType::BF16, false) => {
                [&ATTENTION_FWD_MMA_BF16, &ATTENTION_BWD_DKDV_MMA_BF16, &ATTENTION_BWD_DQ_MMA_BF16]
            }
            (DType::F32, _) => return None,
        };
        Some(kernels.map(|k| k.of(dtype)))
    }

    fn tiles(dims: &AttentionDims, op: &'static str) -> Result<LaunchConfig> {
        tiles_of(dims, op, TILE)
    }

    fn tiles_of(dims: &AttentionDims, op: &'static str, tile: usize) -> Result<LaunchConfig> {
        let refuse = |reason: String| Err(Error::InvalidArgument { op, reason });
        if dims.dim > MAX_DIM {
            return refuse(format!(
                "head dim {} exceeds the CUDA kernels' {MAX_DIM}; the host takes any",
                dims.dim
            ));
        }
        if dims.heads > MAX_HEADS || !launch::fits_grid(dims.seq.div_ceil(tile)) {
            return refuse(format!(
                "{} heads of {} tokens exceed a CUDA grid",
                dims.heads, dims.seq
            ));
        }
        Ok(LaunchConfig {
            grid_dim: (dims.seq.div_ceil(tile) as u32, dims.heads as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        })
    }

    /// The arguments every tile kernel ends with.
    fn tail(dims: &AttentionDims, p: &AttentionParams) -> [Arg; 10] {
        [
            Arg::count(dims.seq),
            Arg::count(dims.dim),
            Arg::count(dims.heads_per_token),
            Arg::count(dims.kv().heads_per_token),
            Arg::count(dims.kv_group.max(1)),
            Arg::F32(p.scale_for(dims.dim)),
            Arg::U32(u32::from(p.causal)),
            Arg::F32(p.dropout),
            Arg::U64(p.seed),
            Arg::U64(p.offset),
        ]
    }

    /// The forward from `[q, k, v, out, lse]`.
    pub(super) fn forward(
        exec: &impl Exec,
        dtype: DType,
        dims: AttentionDims,
        p: &AttentionParams,
        [q, k, v, o, lse]: [u64; 5],
    ) -> Result<()> {
        if dims.is_empty() {
            return Ok(());
        }
        let (kernel, cfg) = match tensor_cores(dtype, dims.dim) {
            Some([kernel, ..]) => (kernel, tiles_of(&dims, "attention", MMA_TILE)?),
            None => (ATTENTION_FWD.of(dtype), tiles(&dims, "attention")?),
        };
        let mut args = vec![Arg::Ptr(q), Arg::Ptr(k), Arg::Ptr(v), Arg::Ptr(o), Arg::Ptr(lse)];
        args.extend(tail(&dims, p));
        // SAFETY: attention_fwd_T and attention_fwd_mma_T(q, k, v, o, lse, seq, d, nh, ...):
        // q, k, v and o hold heads * seq * d elements of `dtype` (nh, which divides heads,
        // of them side by side in a token row), lse heads * seq f32 (the op's plan); the grid
        // covers the kernel's query tiles of every head; the tensor-core kernel gets only
        // head dims it takes (a multiple of 16, at most 128).
        unsafe { exec.launch(kernel, cfg, &args) }
    }

    /// The backward from `[q, k, v, out, lse, dout, dsum]` (`dsum`: a workspace of
    /// `heads * seq` f32) into `[dq, dk, dv]`.
    pub(super) fn backward(
        exec: &impl Exec,
        dtype: DType,
        dims: AttentionDims,
        p: &AttentionParams,
        [q, k, v, o, lse, dout, dsum]: [u64; 7],
        [dq, dk, dv]: [u64; 3],
    ) -> Result<()> {
        if dims.is_empty() {
            return Ok(());
        }
        const OP: &str = "attention_backward";
        let cores = tensor_cores(dtype, dims.dim);
        // One dK/dV block per key tile of each key/value head; the wide tensor-core dK/dV
        // kernel keeps K and V in dynamic shared memory, the wide dQ kernel dO.
        let wide = cores.is_some() && dims.dim > MMA_NARROW;
        let (dkdv, dq_kernel, cfg) = match cores {
            Some([_, dkdv, dq]) => (dkdv, dq, tiles_of(&dims, OP, MMA_TILE)?),
            None => (ATTENTION_BWD_DKDV.of(dtype), ATTENTION_BWD_DQ.of(dtype), tiles(&dims, OP)?),
        };
        let dkdv_cfg = LaunchConfig {
            grid_dim: (cfg.grid_dim.0, dims.kv().heads as u32, 1),
            shared_mem_bytes: if wide { WIDE_DKDV_SHARED } else { 0 },
            ..cfg
        };
        let dq_cfg =
            LaunchConfig { shared_mem_bytes: if wide { WIDE_DQ_SHARED } else { 0 }, ..cfg };
        let rows = dims.rows();
        // SAFETY: attention_bwd_dot_T(o, dout, dsum, rows, seq, d, nh): o and dout hold
        // rows * d elements (heads * seq rows of d, nh heads a token row), dsum rows f32.
        unsafe {
            exec.launch(
                ATTENTION_BWD_DOT.of(dtype),
                launch::elementwise(rows),
                &[
                    Arg::Ptr(o),
                    Arg::Ptr(dout),
                    Arg::Ptr(dsum),
                    Arg::count(rows),
                    Arg::count(dims.seq),
                    Arg::count(dims.dim),
                    Arg::count(dims.heads_per_token),
                ],
            )?;
        }
        let head =
            [Arg::Ptr(q), Arg::Ptr(k), Arg::Ptr(v), Arg::Ptr(dout), Arg::Ptr(lse), Arg::Ptr(dsum)];
        let mut args = head.to_vec();
        args.extend([Arg::Ptr(dk), Arg::Ptr(dv)]);
        args.extend(tail(&dims, p));
        // SAFETY: attention_bwd_dkdv[_mma]_T(q, k, v, dout, lse, dsum, dk, dv, seq, d, ...):
        // every [heads, seq, d] array holds heads * seq * d elements of `dtype`, lse and
        // dsum heads * seq f32; the grid covers the key tiles of every head (key tiles are
        // as long as query tiles); the tensor-core kernels get only head dims they take, the
        // wide dK/dV kernel the dynamic shared memory its K and V tiles take.
        unsafe { exec.launch(dkdv, dkdv_cfg, &args)? };
        let mut args = head.to_vec();
        args.push(Arg::Ptr(dq));
        args.extend(tail(&dims, p));
        // SAFETY: attention_bwd_dq[_mma]_T(q, k, v, dout, lse, dsum, dq, seq, d, ...): as
        // above, the grid over the query tiles of every query head.
        unsafe { exec.launch(dq_kernel, dq_cfg, &args) }
    }
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::launches;
    use crate::cpu::attention as cpu;
    use crate::cuda::emulate::Emulator;
    use crate::cuda::emulated_kernels::values;
    use crate::cuda::registry::ATTENTION_FWD;
    use crate::dtype::{DType, Element};
    use crate::params::{AttentionDims, AttentionParams};
    use half::{bf16, f16};

    fn addr<T>(v: &mut [T]) -> u64 {
        v.as_mut_ptr() as u64
    }

    /// `got` within `ulps` units of the dtype's last place of `want` (relative), with a floor
    /// of the largest `|want|`, at least 1: both sides sum in f32 in different orders and
    /// round once to `T`.
    fn close<T: Element>(what: &str, got: &[T], want: &[T], ulps: f32) {
        let eps = match T::DTYPE {
            DType::F32 => 1e-6,
            DType::F16 => 1.0 / 1024.0,
            DType::BF16 => 1.0 / 128.0,
        };
        let floor = want.iter().fold(1.0f32, |m, w| m.max(w.to_f32().abs()));
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let (g, w) = (g.to_f32(), w.to_f32());
            let ok = (g - w).abs() <= ulps * eps * (w.abs() + floor);
            assert!(ok, "{what}[{i}]: emulated {g}, host {w}");
        }
    }

    /// The CUDA forward and backward (`launches`, every kernel emulated) against the host
    /// reference on inputs of `T` of `heads` query heads of `seq` tokens of `dim`, `nh` of
    /// them side by side in a token row (1: heads-major), `group` of them to a key/value
    /// head.
    fn case<T: Element>(
        e: &Emulator,
        (heads, nh, group): (usize, usize, usize),
        seq: usize,
        dim: usize,
        p: AttentionParams,
    ) {
        let dims = AttentionDims { heads, seq, dim, heads_per_token: nh, kv_group: group };
        let (n, nkv) = (dims.len(), dims.kv().len());
        let input = |n: usize, s: u64| -> Vec<T> {
            values(n, s, -2.0, 2.0).into_iter().map(T::from_f32).collect()
        };
        let (mut q, mut k, mut v, mut dout) =
            (input(n, 1), input(nkv, 2), input(nkv, 3), input(n, 4));
        let (mut out, mut lse) = (vec![T::from_f32(0.0); n], vec![0.0f32; dims.rows()]);
        cpu::attention(&q, &k, &v, &mut out, &mut lse, dims, &p).unwrap();
        let mut want = [n, nkv, nkv].map(|n| vec![T::from_f32(0.0); n]);
        {
            let saved = cpu::AttentionSaved { q: &q, k: &k, v: &v, out: &out, lse: &lse };
            let [a, b, c] = &mut want;
            cpu::attention_backward(saved, &dout, [a, b, c], dims, &p).unwrap();
        }
        let (mut e_out, mut e_lse) = (vec![T::from_f32(9.0); n], vec![9.0f32; dims.rows()]);
        let io = [addr(&mut q), addr(&mut k), addr(&mut v), addr(&mut e_out), addr(&mut e_lse)];
        launches::forward(e, T::DTYPE, dims, &p, io).unwrap();
        let what = format!(
            "{:?} heads {heads} ({nh} a row, {group} a key) seq {seq} dim {dim} {p:?}",
            T::DTYPE
        );
        close(&format!("out {what}"), &e_out, &out, 2.0);
        close(&format!("lse {what}"), &e_lse, &lse, 2.0);
        // The backward reads the host's output, so that both sides start from the same.
        let mut dsum = vec![0.0f32; dims.rows()];
        let mut got = [n, nkv, nkv].map(|n| vec![T::from_f32(9.0); n]);
        let inputs = [
            addr(&mut q),
            addr(&mut k),
            addr(&mut v),
            addr(&mut out),
            addr(&mut lse),
            addr(&mut dout),
            addr(&mut dsum),
        ];
        let [a, b, c] = &mut got;
        launches::backward(e, T::DTYPE, dims, &p, inputs, [addr(a), addr(b), addr(c)]).unwrap();
        for (name, (g, w)) in ["dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
            close(&format!("{name} {what}"), g, w, 4.0);
        }
    }

    /// [`case`] in every dtype.
    fn every_dtype(
        e: &Emulator,
        heads: (usize, usize, usize),
        seq: usize,
        dim: usize,
        p: AttentionParams,
    ) {
        case::<f32>(e, heads, seq, dim, p);
        case::<bf16>(e, heads, seq, dim, p);
        case::<f16>(e, heads, seq, dim, p);
    }

    // The kernels compute what the host computes: every query and key tile (sequences of 1,
    // of a tile and a part, of two tiles and a part), head dims 64 and 128 and one below a
    // warp, causal or not, with dropout drawing the host's mask, in every dtype.
    #[test]
    fn emulated_kernels_match_the_host_reference() {
        let Some(e) = Emulator::new(ATTENTION_FWD.of(DType::F32)) else { return };
        for (seq, dim) in [(1, 64), (19, 64), (33, 128), (21, 24), (70, 32), (9, 96)] {
            for causal in [false, true] {
                for drop in [0.0, 0.25] {
                    let p = AttentionParams::new(causal).with_dropout(drop, 11, 1 << 33);
                    case::<f32>(&e, (2, 1, 1), seq, dim, p);
                    case::<bf16>(&e, (1, 1, 1), seq, dim, p);
                    case::<f16>(&e, (1, 1, 1), seq, dim, p);
                }
            }
        }
    }

    // Tokens-major operands ([batch, seq, heads, dim]): 2 batches of 3 heads, so that a
    // head's rows are strided and its first element is neither 0 nor a multiple of seq * d,
    // on the FMA path (f32, dim 24) and both tensor-core instances (32, 128).
    #[test]
    fn emulated_kernels_take_tokens_major_operands() {
        let Some(e) = Emulator::new(ATTENTION_FWD.of(DType::F32)) else { return };
        for (seq, dim) in [(19, 24), (70, 32), (33, 128)] {
            for causal in [false, true] {
                let p = AttentionParams::new(causal).with_dropout(0.25, 5, 7).tokens_major();
                every_dtype(&e, (6, 3, 1), seq, dim, p);
            }
        }
    }

    // Grouped-query attention: 2 batches of 6 query heads over 2 key/value heads (3 query
    // heads a key), tokens-major and heads-major, on the FMA path (f32, dim 24) and both
    // tensor-core instances (32, 128): each key/value head read by its group, its gradient
    // summed over the group.
    #[test]
    fn emulated_kernels_attend_grouped() {
        let Some(e) = Emulator::new(ATTENTION_FWD.of(DType::F32)) else { return };
        for (seq, dim) in [(19, 24), (70, 32), (33, 128)] {
            let p = AttentionParams::new(true).with_dropout(0.25, 5, 7).grouped();
            for (p, nh) in [(p, 1), (p.tokens_major(), 6)] {
                every_dtype(&e, (12, nh, 3), seq, dim, p);
            }
        }
    }

    #[test]
    fn sixteen_bit_heads_of_multiples_of_16_run_on_tensor_cores() {
        let names = |dtype, dim| launches::tensor_cores(dtype, dim).map(|k| k.map(|i| i.name));
        assert_eq!(
            names(DType::BF16, 64),
            Some([
                "attention_fwd_mma_d64_bf16",
                "attention_bwd_dkdv_mma_d64_bf16",
                "attention_bwd_dq_mma_d64_bf16"
            ])
        );
        assert_eq!(names(DType::F16, 32).map(|n| n[0]), Some("attention_fwd_mma_d64_f16"));
        assert_eq!(
            names(DType::F16, 128),
            Some([
                "attention_fwd_mma_f16",
                "attention_bwd_dkdv_mma_f16",
                "attention_bwd_dq_mma_f16"
            ])
        );
        assert_eq!(names(DType::BF16, 80).map(|n| n[2]), Some("attention_bwd_dq_mma_bf16"));
        assert!(launches::tensor_cores(DType::BF16, 24).is_none());
        assert!(launches::tensor_cores(DType::F32, 64).is_none());
    }

    #[test]
    fn heads_wider_than_the_kernels_are_refused_on_cuda() {
        let Some(e) = Emulator::new(ATTENTION_FWD.of(DType::F32)) else { return };
        let dims = AttentionDims::heads_major(1, 4, launches::MAX_DIM + 1);
        let err = launches::forward(&e, DType::F32, dims, &AttentionParams::new(true), [0; 5]);
        assert!(err.is_err());
    }
}
