//! The LM head and its cross-entropy fused ([`linear_cross_entropy`]): the mean loss of
//! `hidden * weight^T` against class targets, and its gradients with respect to `hidden`
//! and `weight`, computed over chunks of rows so that the `[rows, vocab]` logits never exist
//! whole. For GPT-2 small at 8192 tokens the logits alone are 8192 x 50257 f32 = 1.53 GiB,
//! their gradient as much again; the fused op holds one chunk of them (25 MiB by the default
//! rule below) and the gradients of `hidden` and `weight`, whose sizes the model has anyway.
//!
//! # Design: gradients in the forward (Liger-Kernel's)
//!
//! Liger-Kernel's `FusedLinearCrossEntropy` (`src/liger_kernel/ops/fused_linear_cross_entropy.py`,
//! `fused_linear_cross_entropy_forward`) computes, per chunk of rows, the logits, the loss of
//! each row and the gradient of the logits (`softmax - onehot`, scaled by 1 over the rows not
//! ignored), then `grad_input[chunk] = grad_logits * W` and `grad_weight += grad_logits^T *
//! input[chunk]`, all in the forward; its backward only multiplies the saved gradients by
//! the upstream gradient (skipped when it is 1). Apple's Cut Cross-Entropy
//! (`apple/ml-cross-entropy`, `cce.py` / `cce_lse_forward.py`, `cce_backward.py`) saves only
//! the per-row log-sum-exp in the forward and recomputes the logits block by block in the
//! backward: nothing of the gradients exists before backward, for one more product of the
//! size of the head (4 products in all instead of 3).
//!
//! This op takes Liger's design. A language model's loss is its last op and its backward
//! runs at once, so gradients computed in the forward cost no memory that the backward would
//! not hold anyway, and the head's products are a large share of a GPT's work (GPT-2 small:
//! 768 x 50257 = 38.6M multiply-adds per token and product, against about 85M for the body's
//! whole forward), so saving one of four matters. Unlike Liger, the upstream gradient of the loss
//! (`dloss`: 1, the loss scale under f16, an accumulation factor) is a parameter of the
//! forward ([`LinearCrossEntropyParams::dloss`]), so that the gradients are scaled before
//! they are rounded to 16 bits (an f16 gradient computed unscaled and scaled afterwards
//! would underflow first, which is what loss scaling prevents). A caller that needs only the
//! loss (evaluation) uses [`linear`](super::linear) and [`cross_entropy`](super::cross_entropy)
//! in chunks of its own, or this op and drops the gradients.
//!
//! # Exactness
//!
//! The loss is the unchunked one: each row's log-sum-exp and loss are
//! [`cross_entropy`](super::cross_entropy)'s (the same host code, the same CUDA kernels), the
//! per-row losses are kept for all rows and summed in row order once at the end, and the
//! mean divides by the rows not ignored over *all* chunks (known from the host targets
//! before anything runs), which also scales every chunk's gradient. Logits are products of
//! the storage-dtype operands accumulated and kept in f32 (what autocast's f32
//! cross-entropy reads, without the 16-bit rounding of the logits a plain `linear` makes);
//! their gradient is rounded to the storage dtype for the two gradient products, as the
//! plain path's `cross_entropy_backward` output is cast before `linear_backward`. The weight
//! gradient adds the chunks' products in f32 and is rounded once.
//!
//! # Chunk size
//!
//! [`LossChunk::Auto`] is Liger's rule: `inc_factor = ceil(vocab / d)`, `chunk_rows =
//! next_power_of_two(ceil(rows / inc_factor))`, so one chunk's logits have about as many
//! elements as `hidden` (8192 x 768 hidden, vocab 50257: 128 rows). [`LossChunk::Bytes`]
//! takes the most rows whose chunk buffer fits a byte budget ([`chunk_bytes_per_row`]: the
//! f32 logits, and for 16-bit inputs their gradient in the storage dtype), and
//! [`LossChunk::Rows`] names the rows; every choice is clamped to `1..=rows`. The chunk
//! buffer is a preference, not a need: when it does not fit, the dispatcher halves its rows
//! down to one, as for a convolution's workspace, and the op works in the smaller chunks.
//!
//! # Memory
//!
//! Outputs: `grad_hidden` (`hidden`'s shape and dtype) and `grad_weight` (`weight`'s shape,
//! its dtype or [`LinearCrossEntropyParams::grad_weight_dtype`]). Workspaces: the targets,
//! the per-row log-sum-exp and loss (`4 rows` bytes each), the loss's two-pass sum, the f32
//! accumulator of the weight gradient when that gradient is 16-bit (`4 vocab d` bytes; an
//! f32 gradient accumulates in the output itself), and the chunk buffer. Every backend
//! allocates exactly these, so the host's and a virtual device's figures are a GPU's.
//!
//! GPT-2 small's head at 8192 tokens on a virtual device (`tests/linear_cross_entropy.rs`,
//! peak above the operands): the plain `linear` + `cross_entropy` + backward, 3.10 GiB in f32
//! and in bf16 (the logits and their gradient in f32); fused, 195.9 MiB in f32, 269.8 MiB in
//! bf16, 196.1 MiB in bf16 with an f32 weight gradient.
//!
//! Under autocast the weight is a 16-bit copy of an f32 parameter (a tied head's token
//! embedding), whose gradient goes back to f32: asking for it in f32
//! (`grad_weight_dtype(DType::F32)`) returns the accumulator itself, so that neither the
//! 16-bit gradient nor its f32 cast is made (GPT-2 small: 74 MiB and 147 MiB fewer), and the
//! gradient is rounded once, to f32.

use super::dispatch::{Buffers, Op, OutputSpec, Plan, run};
use super::reduce::sum_workspaces;
use super::{expect_rank, rows_cols, same_kind};
use crate::cpu::loss as cpu;
use crate::device::Device;
use crate::dtype::{DType, with_dtype};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// How many rows [`linear_cross_entropy`] computes at a time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LossChunk {
    /// Liger-Kernel's rule: `next_power_of_two(ceil(rows / ceil(vocab / d)))` rows, so that a
    /// chunk's logits have about as many elements as the hidden states.
    #[default]
    Auto,
    /// The most rows whose chunk buffer ([`chunk_bytes_per_row`] each) fits this many bytes.
    Bytes(usize),
    /// This many rows.
    Rows(usize),
}

/// What [`linear_cross_entropy`] takes besides its tensors.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinearCrossEntropyParams {
    /// Rows whose target is this index count neither in the loss nor in its mean, and get
    /// zero gradients (PyTorch's `ignore_index`).
    pub ignore_index: Option<u32>,
    /// The upstream gradient of the (scalar, mean) loss the gradients are computed for: 1
    /// for a plain loss, the loss scale under mixed precision, a factor under accumulation.
    pub dloss: f32,
    /// The rows per chunk.
    pub chunk: LossChunk,
    /// The dtype of the weight's gradient; `None`: the weight's. An f32 gradient of 16-bit
    /// operands is the f32 accumulator itself (no 16-bit rounding, no extra buffer).
    pub grad_weight_dtype: Option<DType>,
}

impl Default for LinearCrossEntropyParams {
    /// No ignored index, `dloss = 1`, Liger's chunk rule.
    fn default() -> Self {
        LinearCrossEntropyParams {
            ignore_index: None,
            dloss: 1.0,
            chunk: LossChunk::Auto,
            grad_weight_dtype: None,
        }
    }
}

impl LinearCrossEntropyParams {
    /// These parameters with `ignore_index`.
    #[must_use]
    pub fn ignore_index(mut self, ignore_index: Option<u32>) -> Self {
        self.ignore_index = ignore_index;
        self
    }

    /// These parameters with the upstream gradient `dloss`.
    #[must_use]
    pub fn dloss(mut self, dloss: f32) -> Self {
        self.dloss = dloss;
        self
    }

    /// These parameters with the weight's gradient in `dtype`.
    #[must_use]
    pub fn grad_weight_dtype(mut self, dtype: DType) -> Self {
        self.grad_weight_dtype = Some(dtype);
        self
    }

    /// These parameters with the chunk rule `chunk`.
    #[must_use]
    pub fn chunk(mut self, chunk: LossChunk) -> Self {
        self.chunk = chunk;
        self
    }

    /// The rows per chunk for `rows` rows of width `d`, `vocab` classes, inputs of `dtype`
    /// (before any halving for memory): see [`LossChunk`]; at least 1, at most `rows`
    /// (1 when `rows` is 0).
    pub fn chunk_rows(&self, rows: usize, vocab: usize, d: usize, dtype: DType) -> usize {
        let want = match self.chunk {
            LossChunk::Auto => {
                let inc_factor = vocab.div_ceil(d.max(1)).max(1);
                rows.div_ceil(inc_factor).next_power_of_two()
            }
            LossChunk::Bytes(bytes) => bytes / chunk_bytes_per_row(vocab, dtype).max(1),
            LossChunk::Rows(r) => r,
        };
        want.clamp(1, rows.max(1))
    }
}

/// Bytes of the chunk buffer per row for `vocab` classes and inputs of `dtype`: the f32
/// logits, and for 16-bit inputs their gradient in `dtype` (f32's is written over its
/// logits).
pub fn chunk_bytes_per_row(vocab: usize, dtype: DType) -> usize {
    let grad = if dtype == DType::F32 { 0 } else { dtype.size_in_bytes() };
    vocab * (4 + grad)
}

/// The result of [`linear_cross_entropy`].
#[derive(Debug)]
pub struct LinearCrossEntropy {
    /// The mean loss over the rows not ignored (NaN if every row is ignored or there are no
    /// rows, and on a virtual device, which computes nothing).
    pub loss: f32,
    /// The gradient of `dloss * loss` with respect to `hidden` (its shape and dtype).
    pub grad_hidden: Tensor,
    /// The gradient of `dloss * loss` with respect to `weight` (its shape; its dtype unless
    /// [`LinearCrossEntropyParams::grad_weight_dtype`] names another).
    pub grad_weight: Tensor,
}

/// The LM head `logits = hidden * weight^T` and the mean softmax cross-entropy of the
/// logits against `targets`, fused, with the gradients of `params.dloss * loss` with respect
/// to `hidden` and `weight`, computed chunk by chunk of rows so that the whole logits never
/// exist (the design, the chunk rule and the memory are set out in the docs of
/// `kernels/src/ops/linear_cross_entropy.rs`).
/// `hidden: [.., d]` (its leading dimensions are the rows, `targets.len()` of them),
/// `weight: [vocab, d]`, both of one dtype and device; the loss is that of
/// [`cross_entropy`](super::cross_entropy) on `linear(hidden, weight)` computed in f32.
///
/// # Errors
///
/// [`Error::ShapeMismatch`] if `weight` does not fit `hidden` or `targets.len()` is not the
/// rows; [`Error::IndexOutOfRange`] for a target not below `vocab` and not ignored; dtype
/// and device mismatches; out of memory. Nothing is allocated on an error of the operands.
pub fn linear_cross_entropy(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &[u32],
    params: &LinearCrossEntropyParams,
) -> Result<LinearCrossEntropy> {
    run(LinearCrossEntropyOp {
        hidden,
        weight,
        targets,
        params: *params,
        dims: Dims::default(),
        ws: Workspaces::default(),
        loss: f32::NAN,
    })
}

/// Rows, width, classes and planned rows per chunk.
#[derive(Clone, Copy, Debug, Default)]
struct Dims {
    rows: usize,
    d: usize,
    vocab: usize,
    chunk: usize,
}

/// Indices of the op's workspaces in its plan.
#[derive(Clone, Copy, Debug, Default)]
struct Workspaces {
    targets: Option<usize>,
    lse: Option<usize>,
    losses: Option<usize>,
    partial: Option<usize>,
    total: Option<usize>,
    /// The f32 weight-gradient accumulator (16-bit weight gradients).
    acc: Option<usize>,
    chunk: Option<usize>,
}

struct LinearCrossEntropyOp<'a> {
    hidden: &'a Tensor,
    weight: &'a Tensor,
    targets: &'a [u32],
    params: LinearCrossEntropyParams,
    dims: Dims,
    ws: Workspaces,
    loss: f32,
}

impl LinearCrossEntropyOp<'_> {
    /// Whether there is nothing to compute (no rows or no classes): zero gradients, NaN.
    fn empty(&self) -> bool {
        self.dims.rows == 0 || self.dims.vocab == 0
    }

    /// The dtype of the weight's gradient.
    fn grad_weight_dtype(&self) -> DType {
        self.params.grad_weight_dtype.unwrap_or(self.weight.dtype())
    }
}

impl Op for LinearCrossEntropyOp<'_> {
    const NAME: &'static str = "linear_cross_entropy";
    /// `grad_hidden`, `grad_weight`.
    type Outs = [Tensor; 2];
    type Output = LinearCrossEntropy;

    fn device(&self) -> &Device {
        self.hidden.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        const OP: &str = LinearCrossEntropyOp::NAME;
        let (h, w) = (self.hidden, self.weight);
        same_kind(OP, h, w)?;
        expect_rank(OP, w, 2, "weight [vocab, d]")?;
        let (rows, d) = rows_cols(OP, h.shape())?;
        let vocab = w.shape()[0];
        if w.shape()[1] != d {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: h.shape().to_vec(),
                rhs: w.shape().to_vec(),
            });
        }
        if rows != self.targets.len() {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: h.shape().to_vec(),
                rhs: vec![self.targets.len()],
            });
        }
        cpu::validate(OP, self.targets, vocab, self.params.ignore_index)?;
        let dtype = h.dtype();
        let chunk = self.params.chunk_rows(rows, vocab, d, dtype);
        self.dims = Dims { rows, d, vocab, chunk };
        let empty = self.empty();
        let gw_dtype = self.grad_weight_dtype();
        let mut plan = Plan::new([
            OutputSpec::zeroed_if(empty, h.shape(), dtype),
            OutputSpec::zeroed_if(empty, w.shape(), gw_dtype),
        ]);
        if empty {
            return Ok(plan);
        }
        self.ws.targets = plan.workspace(rows * 4);
        self.ws.lse = plan.workspace(rows * 4);
        self.ws.losses = plan.workspace(rows * 4);
        let (partial, total) = sum_workspaces(rows);
        self.ws.partial = plan.workspace(partial);
        self.ws.total = plan.workspace(total);
        if gw_dtype != DType::F32 {
            self.ws.acc = plan.workspace(vocab * d * 4);
        }
        self.ws.chunk = plan.chunked_workspace(chunk_bytes_per_row(vocab, dtype), chunk);
        plan.blas();
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let Dims { d, vocab, chunk, .. } = self.dims;
        let chunk = bufs.chunks(self.ws.chunk).unwrap_or(chunk);
        let [gh, gw] = bufs.outputs_mut();
        let p = self.params;
        self.loss = with_dtype!(self.hidden.dtype(), T => with_dtype!(gw.dtype(), G => {
            cpu::linear_cross_entropy::<T, G>(
                self.hidden.as_slice::<T>()?,
                self.weight.as_slice::<T>()?,
                self.targets,
                p.ignore_index,
                p.dloss,
                (vocab, d),
                chunk,
                gh.out_slice::<T>(Self::NAME)?,
                gw.out_slice::<G>(Self::NAME)?,
            )
        }))?;
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::helpers::{check_rows, sum, upload_u32};
        if self.empty() {
            return Ok(());
        }
        let Dims { rows, d, vocab, .. } = self.dims;
        let chunk = bufs.chunks(self.ws.chunk).unwrap_or(1);
        check_rows(Self::NAME, chunk)?;
        let ws = self.ws;
        let targets = bufs.ws(ws.targets)?;
        upload_u32(gpu, self.targets, targets)?;
        let (losses, partial, total) =
            (bufs.ws(ws.losses)?, bufs.ws(ws.partial)?, bufs.ws(ws.total)?);
        let ignore = self.params.ignore_index;
        let count = cpu::counted(self.targets, ignore);
        let geometry = cuda::Geometry {
            rows,
            d,
            vocab,
            chunk,
            dtype: self.hidden.dtype(),
            grad_weight_dtype: self.grad_weight_dtype(),
            ignore,
            g: self.params.dloss / count as f32,
        };
        let (lse, acc, chunk_ws) = (bufs.ws(ws.lse)?, bufs.ws(ws.acc)?, bufs.ws(ws.chunk)?);
        let [gh, gw] = bufs.outputs_mut();
        let at = cuda::Addresses {
            hidden: self.hidden.cuda_ptr()?,
            weight: self.weight.cuda_ptr()?,
            targets,
            lse,
            losses,
            acc,
            chunk: chunk_ws,
            grad_hidden: gh.cuda_ptr()?,
            grad_weight: gw.cuda_ptr()?,
        };
        cuda::forward(gpu, &geometry, &at)?;
        let blocks = sum_workspaces(rows).0 / 4;
        self.loss = sum(gpu, losses, DType::F32, rows, (partial, blocks), total)? / count as f32;
        Ok(())
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<LinearCrossEntropy> {
        let [grad_hidden, grad_weight] = bufs.into_outputs();
        Ok(LinearCrossEntropy { loss: self.loss, grad_hidden, grad_weight })
    }
}

/// The CUDA side, on raw addresses against [`Exec`](crate::cuda::Exec), so that the host
/// emulation runs it whole: per chunk, a cuBLAS product into f32 logits, the plain
/// cross-entropy's `ce_fwd` and `ce_bwd` kernels (the latter in place), a cast to the storage
/// dtype for 16-bit inputs, and two cuBLAS products for the gradients.
#[cfg(feature = "cuda")]
mod cuda {
    use crate::cuda::helpers::cast;
    use crate::cuda::launch::{elementwise as grid, per_row};
    use crate::cuda::registry::{CE_BWD, CE_FWD};
    use crate::cuda::{Arg, Exec};
    use crate::dtype::DType;
    use crate::error::Result;
    use crate::params::MatmulSpec;

    /// The problem: `rows` rows of width `d`, `vocab` classes, `chunk` rows at a time, inputs
    /// of `dtype`, the weight's gradient in `grad_weight_dtype`; `g` is `dloss` over the
    /// rows not ignored.
    pub(super) struct Geometry {
        pub(super) rows: usize,
        pub(super) d: usize,
        pub(super) vocab: usize,
        pub(super) chunk: usize,
        pub(super) dtype: DType,
        pub(super) grad_weight_dtype: DType,
        pub(super) ignore: Option<u32>,
        pub(super) g: f32,
    }

    /// Device addresses: the operands, the workspaces (targets, lse and losses of every row,
    /// the f32 weight-gradient accumulator for a 16-bit gradient, the chunk buffer of `chunk`
    /// rows of [`chunk_bytes_per_row`](super::chunk_bytes_per_row)) and the outputs.
    pub(super) struct Addresses {
        pub(super) hidden: u64,
        pub(super) weight: u64,
        pub(super) targets: u64,
        pub(super) lse: u64,
        pub(super) losses: u64,
        pub(super) acc: u64,
        pub(super) chunk: u64,
        pub(super) grad_hidden: u64,
        pub(super) grad_weight: u64,
    }

    /// Every chunk's logits, per-row losses and gradients; the loss's sum is the caller's.
    /// `rows`, `vocab` and `chunk` are positive.
    pub(super) fn forward(e: &impl Exec, g: &Geometry, at: &Addresses) -> Result<()> {
        let Geometry { rows, d, vocab, chunk, dtype, grad_weight_dtype, ignore, .. } = *g;
        let size = dtype.size_in_bytes();
        let logits = at.chunk;
        // The logits' gradient as the products take it: over the f32 logits for f32, in the
        // chunk buffer after the logits in the storage dtype for 16-bit inputs.
        let half = dtype != DType::F32;
        let dlogits = if half { at.chunk + (chunk * vocab * 4) as u64 } else { logits };
        // The weight's gradient adds up in f32: in the output itself when it is f32.
        let in_output = grad_weight_dtype == DType::F32;
        let acc = if in_output { at.grad_weight } else { at.acc };
        let (ig, has_ig) = (Arg::U32(ignore.unwrap_or(0)), Arg::U32(ignore.is_some() as u32));
        for (i, r0) in (0..rows).step_by(chunk).enumerate() {
            let c = chunk.min(rows - r0);
            let h = at.hidden + (r0 * d * size) as u64;
            let [t, lse, losses] = [at.targets, at.lse, at.losses].map(|p| p + (r0 * 4) as u64);
            let spec = MatmulSpec::new(c, vocab, d).transpose(false, true);
            // SAFETY: hidden[r0..r0 + c] is [c, d], weight [vocab, d] of `dtype`; the chunk
            // buffer holds `chunk >= c` rows of vocab f32 logits first.
            unsafe { e.gemm(&spec, h, at.weight, logits, dtype, DType::F32)? };
            // SAFETY: ce_fwd_f32(const float* x, const u32* t, u64 c, u32 ignore, u32
            // has_ignore, float* lse, float* loss), one block per row: the logits hold c
            // rows of vocab, targets (checked below vocab unless ignored), lse and losses c
            // from r0 on.
            unsafe {
                e.launch(
                    CE_FWD.of(DType::F32),
                    per_row(c),
                    &[
                        Arg::Ptr(logits),
                        Arg::Ptr(t),
                        Arg::count(vocab),
                        ig,
                        has_ig,
                        Arg::Ptr(lse),
                        Arg::Ptr(losses),
                    ],
                )?;
            }
            let n = c * vocab;
            // SAFETY: ce_bwd_f32(const float* x, const u32* t, const float* lse, float g, Div
            // c, u32 ignore, u32 has_ignore, float* dx, u64 n) over the c * vocab logits, in
            // place: each element is read and then written by the same thread only.
            unsafe {
                e.launch(
                    CE_BWD.of(DType::F32),
                    grid(n),
                    &[
                        Arg::Ptr(logits),
                        Arg::Ptr(t),
                        Arg::Ptr(lse),
                        Arg::F32(g.g),
                        Arg::div(vocab),
                        ig,
                        has_ig,
                        Arg::Ptr(logits),
                        Arg::count(n),
                    ],
                )?;
            }
            if half {
                cast(e, logits, DType::F32, dlogits, dtype, n)?;
            }
            let gh = at.grad_hidden + (r0 * d * size) as u64;
            // SAFETY: dlogits [c, vocab] * weight [vocab, d] -> grad_hidden[r0..r0 + c].
            unsafe { e.gemm(&MatmulSpec::new(c, d, vocab), dlogits, at.weight, gh, dtype, dtype)? };
            let beta = if i == 0 { 0.0 } else { 1.0 };
            let spec = MatmulSpec::new(vocab, d, c).transpose(true, false).scaled(1.0, beta);
            // SAFETY: dlogits^T ([c, vocab] stored) * hidden[r0..r0 + c] ([c, d]) added into
            // the f32 [vocab, d] accumulator (the output itself for an f32 gradient).
            unsafe { e.gemm(&spec, dlogits, h, acc, dtype, DType::F32)? };
        }
        if !in_output {
            cast(e, acc, DType::F32, at.grad_weight, grad_weight_dtype, vocab * d)?;
        }
        Ok(())
    }

    /// The code above on the host emulation, against the host reference.
    #[cfg(test)]
    mod tests {
        use super::*;
        use crate::cpu::loss as cpu;
        use crate::cuda::emulate::Emulator;
        use crate::dtype::Element;
        use half::{bf16, f16};

        fn addr<T>(v: &mut [T]) -> u64 {
            v.as_mut_ptr() as u64
        }

        use crate::cpu::elementwise::testing::seeded as values;

        fn close<T: Element>(what: &str, got: &[T], want: &[T], tol: f32) {
            let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.to_f32().abs()));
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                let (g, w) = (g.to_f32(), w.to_f32());
                assert!((g - w).abs() <= tol * scale, "{what}[{i}]: got {g}, want {w}");
            }
        }

        fn run<T: Element, G: Element>(
            e: &Emulator,
            (rows, d, vocab): (usize, usize, usize),
            chunk: usize,
            tol: f32,
        ) {
            let dtype = T::DTYPE;
            let round = |v: Vec<f32>| v.into_iter().map(T::from_f32).collect::<Vec<T>>();
            let mut hidden = round(values(rows * d, 1 + rows as u64));
            let mut weight = round(values(vocab * d, 7 + vocab as u64));
            let ignore = Some(vocab as u32 + 3);
            let mut targets: Vec<u32> = (0..rows)
                .map(|i| if i % 5 == 3 { vocab as u32 + 3 } else { (i * 7 % vocab) as u32 })
                .collect();
            let dloss = 3.0;
            let (mut want_gh, mut want_gw) =
                (vec![T::from_f32(0.0); rows * d], vec![G::from_f32(0.0); vocab * d]);
            let want = cpu::linear_cross_entropy(
                &hidden,
                &weight,
                &targets,
                ignore,
                dloss,
                (vocab, d),
                chunk,
                &mut want_gh,
                &mut want_gw,
            )
            .unwrap();
            let nan = T::from_f32(f32::NAN);
            let (mut gh, mut gw) = (vec![nan; rows * d], vec![G::from_f32(f32::NAN); vocab * d]);
            let (mut lse, mut losses) = (vec![f32::NAN; rows], vec![f32::NAN; rows]);
            let mut acc = vec![f32::NAN; vocab * d];
            let per_row = super::super::chunk_bytes_per_row(vocab, dtype);
            let mut chunk_ws = vec![u32::MAX; (chunk * per_row).div_ceil(4)];
            let count = cpu::counted(&targets, ignore);
            let g = Geometry {
                rows,
                d,
                vocab,
                chunk,
                dtype,
                grad_weight_dtype: G::DTYPE,
                ignore,
                g: dloss / count as f32,
            };
            let at = Addresses {
                hidden: addr(&mut hidden),
                weight: addr(&mut weight),
                targets: addr(&mut targets),
                lse: addr(&mut lse),
                losses: addr(&mut losses),
                acc: addr(&mut acc),
                chunk: addr(&mut chunk_ws),
                grad_hidden: addr(&mut gh),
                grad_weight: addr(&mut gw),
            };
            forward(e, &g, &at).unwrap();
            let loss = losses.iter().sum::<f32>() / count as f32;
            let what = format!(
                "{dtype:?} (weight gradient {:?}) rows {rows} d {d} vocab {vocab} chunk {chunk}",
                G::DTYPE
            );
            assert!(
                (loss - want).abs() <= 1e-5 * want.abs().max(1.0),
                "{what}: loss {loss}, want {want}"
            );
            close(&format!("grad_hidden {what}"), &gh, &want_gh, tol);
            close(&format!("grad_weight {what}"), &gw, &want_gw, tol);
        }

        #[test]
        fn the_cuda_code_matches_the_host_in_every_chunking() {
            let Some(e) = Emulator::new(CE_FWD.of(DType::F32)) else { return };
            for dims in [(7, 5, 11), (9, 8, 37), (4, 3, 2)] {
                for chunk in [1, 2, 3, dims.0] {
                    run::<f32, f32>(&e, dims, chunk, 1e-5);
                }
                run::<bf16, bf16>(&e, dims, 2, 1e-2);
                run::<bf16, f32>(&e, dims, 3, 1e-2);
                run::<f16, f16>(&e, dims, 4, 2e-3);
            }
        }
    }
}
