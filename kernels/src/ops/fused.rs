//! Fused epilogues: `gelu(x + bias)` (a GPT MLP's first linear layer without its bias, then
//! the bias and the activation) in one pass forward and one pass backward, the backward
//! also summing the bias gradient's partials per chunk of rows (then one small launch adds
//! them). Unfused, the same work is bias_add + gelu forward (two launches, the sum stored
//! and read again) and gelu_bwd + the bias gradient's column sums and cast backward (three
//! or four launches).
//!
//! [`add_layer_norm`] is a transformer block's residual add and the layer norm after it in
//! one launch per row block instead of two (the sum is still stored: the residual stream
//! continues from it); its backward is layer norm's plus the residual's gradient, as before.
//! [`dropout_add_layer_norm`] is the same with dropout on the branch (PyTorch's eager block
//! runs three kernels: `native_dropout`, which also writes a bool mask it keeps for the
//! backward (aten/src/ATen/native/cuda/Dropout.cu), the add and the layer norm), and
//! [`dropout_add`] the block's second residual, `residual + dropout(branch)`, in one
//! elementwise pass instead of dropout, a cast of the branch to the residual's dtype under
//! autocast, and the add. Both draw the mask of [`dropout`](super::dropout) with the same
//! seed and offset and store no mask: [`dropout_add_backward`] regenerates it, casting and
//! masking the branch's gradient in one pass. With a 16-bit branch and an f32 residual
//! (autocast) the branch's f32 copy the unfused add needs is never made.
//! [`layer_norm_backward_residual`] is the backward of the sum and its norm together: layer
//! norm's input gradient plus the gradient arriving at the sum by the shortcut, and the
//! branch's (masked) gradient of that, in the two launches of
//! [`layer_norm_backward`](super::layer_norm_backward) instead of its two, an `add_assign`
//! and [`dropout_add_backward`]'s.
//!
//! Each result is the unfused ops' bit for bit on the host (the sum `x + bias` rounded to
//! the dtype as `bias_add` stores it, the gradient rounded as `gelu_backward` stores it and
//! summed in `bias_add_backward`'s order; the dropped branch rounded as `dropout` stores it
//! before the add); the kernels follow the same steps (emulated in the tests; on a GPU within
//! FMA contraction, GELU's `exp` being the host's polynomial on both). The dropout kernels and the layer norm backward
//! with a residual have not yet run on a GPU.

use super::dispatch::{Buffers, Op, OutputSpec, Plan, run};
use super::elementwise::param_dims;
use super::norm::{
    LayerNormOutput, backward_dims as norm_backward_dims, param_chunks, plan_partials,
};
use super::{expect_shape, same_device, same_layout};
use crate::cpu::{activation as act, elementwise as ew, norm, random as rnd};
use crate::device::Device;
use crate::dtype::{DType, Element, with_dtype};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// The gradients of [`bias_gelu`].
#[derive(Debug)]
pub struct BiasGeluGrads {
    /// Of `x` (and of `x + bias`): `dy * gelu'(x + bias)`.
    pub dx: Tensor,
    /// Of the bias: the column sums of `dx`.
    pub dbias: Tensor,
}

/// `gelu(x + bias)` (tanh approximation) with `bias: [d]` broadcast over the rows of
/// `x: [.., d]`, in one pass.
///
/// # Errors
///
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) if `bias` is not `[d]`; dtype and
/// device mismatches; [`Error::OutOfMemory`](crate::Error::OutOfMemory).
pub fn bias_gelu(x: &Tensor, bias: &Tensor) -> Result<Tensor> {
    run(BiasGelu { x, bias })
}

/// The backward of [`bias_gelu`] from its input `x`, `bias` and the output gradient `dy`
/// (the sum is recomputed, not saved), in one pass plus the bias gradient's final sums.
///
/// # Errors
///
/// As [`bias_gelu`], and for a `dy` not of `x`'s layout.
pub fn bias_gelu_backward(x: &Tensor, bias: &Tensor, dy: &Tensor) -> Result<BiasGeluGrads> {
    run(BiasGeluBackward { x, bias, dy, partials: None })
}

/// The result of [`add_layer_norm`]: the sum and its layer norm.
#[derive(Debug)]
pub struct AddLayerNorm {
    /// `a + b`, the residual stream after the add.
    pub sum: Tensor,
    /// `layer_norm(a + b)`, with the statistics its backward needs.
    pub norm: LayerNormOutput,
}

/// `s = a + b` and `layer_norm(s, gamma, beta, eps)` over the last dimension, in one pass:
/// [`add`](super::add) then [`layer_norm`](super::layer_norm) in one launch;
/// [`dropout_add_layer_norm`] with no dropout (so `b` may also be 16-bit with an f32 `a`).
///
/// # Errors
///
/// As [`dropout_add_layer_norm`].
pub fn add_layer_norm(
    a: &Tensor,
    b: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    eps: f32,
) -> Result<AddLayerNorm> {
    dropout_add_layer_norm(a, b, gamma, beta, eps, 0.0, 0, 0)
}

/// A transformer block's residual add with dropout on its branch and the layer norm after
/// it, in one launch per row block: `s = residual + dropout(branch, p, seed, offset)` and
/// `layer_norm(s, gamma, beta, eps)` over the last dimension. The branch is dropped exactly
/// as [`dropout`](super::dropout) with the same `(p, seed, offset)` drops it (the mask is
/// not stored: the backward regenerates it), and the result is bit for bit
/// [`dropout`](super::dropout), a cast of its result to the residual's dtype, [`add`](super::add)
/// and [`layer_norm`](super::layer_norm) on the host. `p == 0` is no dropout.
///
/// The residual, the sum, `gamma`, `beta` and the output share a dtype; the branch has it
/// too, or is 16-bit with an f32 residual (a block's residual stream under autocast).
///
/// The backward is [`layer_norm_backward`](super::layer_norm_backward) on the sum, the
/// residual's gradient added, then [`dropout_add_backward`] for the branch.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) unless `0 <= p < 1` or for an
/// empty last dimension; [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) and
/// [`Error::DTypeMismatch`](crate::Error::DTypeMismatch) for a branch not of the residual's
/// shape and an allowed dtype, or parameters not `[d]` of the residual's dtype; device
/// mismatches; out of memory.
#[allow(clippy::too_many_arguments)]
pub fn dropout_add_layer_norm(
    residual: &Tensor,
    branch: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    eps: f32,
    p: f32,
    seed: u64,
    offset: u64,
) -> Result<AddLayerNorm> {
    let drop = BranchDropout { p, seed, offset };
    run(AddLayerNormOp { a: residual, b: branch, gamma, beta, eps, drop })
}

/// `residual + dropout(branch, p, seed, offset)` in one pass, in the residual's dtype: the
/// branch dropped exactly as [`dropout`](super::dropout) with the same arguments drops it
/// (no mask stored), then added as [`add`](super::add) adds; bit for bit that composition
/// (with a cast of the dropped branch to the residual's dtype) on the host. `p == 0` is a
/// plain add. The branch has the residual's dtype, or is 16-bit with an f32 residual
/// (autocast's promotion: the sum is f32, no f32 copy of the branch is made).
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) unless `0 <= p < 1`;
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) and
/// [`Error::DTypeMismatch`](crate::Error::DTypeMismatch) for a branch not of the residual's
/// shape and an allowed dtype; device mismatches; out of memory.
pub fn dropout_add(
    residual: &Tensor,
    branch: &Tensor,
    p: f32,
    seed: u64,
    offset: u64,
) -> Result<Tensor> {
    run(DropoutAdd { a: residual, b: branch, drop: BranchDropout { p, seed, offset } })
}

/// The branch's gradient of [`dropout_add`] (and of [`dropout_add_layer_norm`]'s sum) from
/// the sum's gradient `dy`: `dy` in `branch_dtype`, masked and scaled with the forward's
/// `(p, seed, offset)`, in one pass: bit for bit a cast to `branch_dtype` then
/// [`dropout_backward`](super::dropout_backward). The residual's gradient is `dy` itself.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) unless `0 <= p < 1`;
/// [`Error::DTypeMismatch`](crate::Error::DTypeMismatch) for a 16-bit `dy` with another
/// `branch_dtype` (the forward takes no such pair); out of memory.
pub fn dropout_add_backward(
    dy: &Tensor,
    branch_dtype: DType,
    p: f32,
    seed: u64,
    offset: u64,
) -> Result<Tensor> {
    run(DropoutAddBackward { dy, branch_dtype, drop: BranchDropout { p, seed, offset } })
}

/// A residual branch whose gradient [`layer_norm_backward_residual`] also gives: its dtype
/// and the forward's dropout on it (`p == 0` for none), as [`dropout_add_backward`] takes
/// them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ResidualBranch {
    /// The branch's dtype: the stream's, or 16-bit with an f32 stream.
    pub dtype: DType,
    /// The drop probability, `0 <= p < 1`.
    pub p: f32,
    /// The dropout's seed.
    pub seed: u64,
    /// The dropout's offset in its random stream.
    pub offset: u64,
}

/// The gradients of [`layer_norm_backward_residual`].
#[derive(Debug)]
pub struct ResidualNormGrads {
    /// Of the norm's input (the residual stream): layer norm's input gradient plus `dres`.
    pub dx: Tensor,
    /// Of the scale, `[d]`.
    pub dgamma: Tensor,
    /// Of the shift, `[d]`.
    pub dbeta: Tensor,
    /// Of the branch, when one was given: `dx` in its dtype through its dropout.
    pub dbranch: Option<Tensor>,
}

/// The backward of a residual stream's layer norm, `h = layer_norm(s)` with `s` also read by
/// a shortcut (`s = residual + dropout(branch)`, [`dropout_add_layer_norm`]'s sum, or any
/// input whose gradient has a second term), in one pass plus the parameter gradients' final
/// sums: from the saved `x` (`s`), `gamma`, `mean` and `rstd`, the norm's output gradient
/// `dy` and the gradient `dres` arriving at `x` by the shortcut,
///
/// - `dx = layer_norm_dx + dres`, layer norm's input gradient rounded to `x`'s dtype as
///   [`layer_norm_backward`](super::layer_norm_backward) stores it, then `dres` added as
///   [`add_assign`](super::add_assign) adds it (f32 math, rounded again);
/// - `dgamma` and `dbeta` as [`layer_norm_backward`](super::layer_norm_backward)'s;
/// - with a `branch`, its gradient: `dx` in the branch's dtype, masked and scaled with the
///   forward's dropout, as [`dropout_add_backward`] gives it from `dx`.
///
/// Bit for bit [`layer_norm_backward`](super::layer_norm_backward),
/// [`add_assign`](super::add_assign) and [`dropout_add_backward`] on the host; on a GPU the
/// two launches of [`layer_norm_backward`](super::layer_norm_backward) (the first also adds
/// `dres` and writes the branch's gradient) instead of those and two more. The CUDA kernel
/// has not yet run on a GPU.
///
/// # Errors
///
/// Shape, dtype and device mismatches (`dy` and `dres` of `x`'s layout, `gamma` `[d]` of its
/// dtype, `mean` and `rstd` `[rows]` f32); an empty last dimension;
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) unless the branch's
/// `0 <= p < 1`; [`Error::DTypeMismatch`](crate::Error::DTypeMismatch) for a branch dtype
/// [`dropout_add_backward`] does not take; out of memory.
pub fn layer_norm_backward_residual(
    x: &Tensor,
    gamma: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    dy: &Tensor,
    dres: &Tensor,
    branch: Option<ResidualBranch>,
) -> Result<ResidualNormGrads> {
    run(LayerNormBackwardResidual { x, gamma, mean, rstd, dy, dres, branch, acc: None })
}

/// Dropout on a residual branch: [`dropout`](super::dropout)'s arguments.
#[derive(Clone, Copy, Debug)]
struct BranchDropout {
    p: f32,
    seed: u64,
    offset: u64,
}

impl BranchDropout {
    /// `p`, the scale of kept elements, the seed and offset as the kernels take them.
    #[cfg(feature = "cuda")]
    fn args(&self) -> [crate::cuda::Arg; 4] {
        use crate::cuda::Arg;
        let scale = 1.0 / (1.0 - self.p);
        [Arg::F32(self.p), Arg::F32(scale), Arg::U64(self.seed), Arg::U64(self.offset)]
    }
}

/// Checks a residual and its branch: one device, one shape, and the same dtype or an f32
/// residual (the sum's dtype) with a 16-bit branch.
fn residual_and_branch(op: &'static str, residual: &Tensor, branch: &Tensor) -> Result<()> {
    same_device(op, residual, branch)?;
    branch_dtype_allowed(op, residual.dtype(), branch.dtype())?;
    expect_shape(op, residual.shape(), branch)
}

fn branch_dtype_allowed(op: &'static str, residual: DType, branch: DType) -> Result<()> {
    if residual == branch || residual == DType::F32 {
        Ok(())
    } else {
        Err(Error::DTypeMismatch { op, lhs: residual, rhs: branch })
    }
}

struct DropoutAdd<'a> {
    a: &'a Tensor,
    b: &'a Tensor,
    drop: BranchDropout,
}

impl Op for DropoutAdd<'_> {
    const NAME: &'static str = "dropout_add";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.a.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        rnd::check_probability(Self::NAME, self.drop.p)?;
        residual_and_branch(Self::NAME, self.a, self.b)?;
        Ok(Plan::one(self.a.shape(), self.a.dtype()))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let BranchDropout { p, seed, offset } = self.drop;
        with_dtype!(self.a.dtype(), R => with_dtype!(self.b.dtype(), B => rnd::dropout_add(
            self.a.as_slice::<R>()?,
            self.b.as_slice::<B>()?,
            bufs.out().out_slice::<R>(Self::NAME)?,
            p,
            seed,
            offset,
        )))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::{Arg, helpers::ptr, launch::elementwise as grid, registry::DROPOUT_ADD};
        let y = bufs.out();
        let n = y.numel();
        if n == 0 {
            return Ok(());
        }
        let [p, scale, seed, offset] = self.drop.args();
        // SAFETY: dropout_add_R_B(const R* a, const B* b, R* y, u64 n, float p, float scale,
        // u64 seed, u64 offset); a, b and y hold n elements (`plan`).
        unsafe {
            gpu.launch(
                DROPOUT_ADD.of_pair(self.a.dtype(), self.b.dtype()),
                grid(n),
                &[ptr(self.a)?, ptr(self.b)?, ptr(y)?, Arg::count(n), p, scale, seed, offset],
            )
        }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

struct DropoutAddBackward<'a> {
    dy: &'a Tensor,
    branch_dtype: DType,
    drop: BranchDropout,
}

impl Op for DropoutAddBackward<'_> {
    const NAME: &'static str = "dropout_add_backward";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.dy.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        rnd::check_probability(Self::NAME, self.drop.p)?;
        branch_dtype_allowed(Self::NAME, self.dy.dtype(), self.branch_dtype)?;
        Ok(Plan::one(self.dy.shape(), self.branch_dtype))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let BranchDropout { p, seed, offset } = self.drop;
        with_dtype!(self.dy.dtype(), R => with_dtype!(self.branch_dtype, B => {
            rnd::dropout_add_backward(
                self.dy.as_slice::<R>()?,
                bufs.out().out_slice::<B>(Self::NAME)?,
                p,
                seed,
                offset,
            )
        }))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::{
            Arg, helpers::ptr, launch::elementwise as grid, registry::DROPOUT_ADD_BWD,
        };
        let db = bufs.out();
        let n = db.numel();
        if n == 0 {
            return Ok(());
        }
        let [p, scale, seed, offset] = self.drop.args();
        // SAFETY: dropout_add_bwd_R_B(const R* dy, B* db, u64 n, float p, float scale, u64
        // seed, u64 offset); dy and db hold n elements (`plan`).
        unsafe {
            gpu.launch(
                DROPOUT_ADD_BWD.of_pair(self.dy.dtype(), self.branch_dtype),
                grid(n),
                &[ptr(self.dy)?, ptr(db)?, Arg::count(n), p, scale, seed, offset],
            )
        }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

struct LayerNormBackwardResidual<'a> {
    x: &'a Tensor,
    gamma: &'a Tensor,
    mean: &'a Tensor,
    rstd: &'a Tensor,
    dy: &'a Tensor,
    dres: &'a Tensor,
    branch: Option<ResidualBranch>,
    /// The f32 partial sums of dgamma, then of dbeta (`[param_chunks(rows), d]` each).
    acc: Option<usize>,
}

impl Op for LayerNormBackwardResidual<'_> {
    const NAME: &'static str = "layer_norm_backward_residual";
    /// `dx`, `dgamma`, `dbeta`, and the branch's gradient.
    type Outs = ([Tensor; 3], Option<Tensor>);
    type Output = ResidualNormGrads;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        let (x, saved) = (self.x, [self.mean, self.rstd]);
        let (rows, d) = norm_backward_dims(Self::NAME, x, self.gamma, saved, self.dy)?;
        same_layout(Self::NAME, self.x, self.dres)?;
        let (shape, dt) = (self.x.shape(), self.x.dtype());
        let branch = match self.branch {
            Some(b) => {
                rnd::check_probability(Self::NAME, b.p)?;
                branch_dtype_allowed(Self::NAME, dt, b.dtype)?;
                Some(OutputSpec::new(shape, b.dtype))
            }
            None => None,
        };
        let grads =
            [OutputSpec::new(shape, dt), OutputSpec::new(&[d], dt), OutputSpec::new(&[d], dt)];
        let mut plan = Plan::new((grads, branch));
        self.acc = plan_partials(Self::NAME, &mut plan, rows, d)?;
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let ([dx, dgamma, dbeta], dbranch) = bufs.outputs_mut();
        with_dtype!(self.x.dtype(), T => {
            let dx = dx.out_slice::<T>(Self::NAME)?;
            norm::layer_norm_backward_residual(
                self.x.as_slice::<T>()?,
                self.gamma.as_slice::<T>()?,
                self.mean.as_slice::<f32>()?,
                self.rstd.as_slice::<f32>()?,
                self.dy.as_slice::<T>()?,
                self.dres.as_slice::<T>()?,
                dx,
                dgamma.out_slice::<T>(Self::NAME)?,
                dbeta.out_slice::<T>(Self::NAME)?,
            )?;
            match (dbranch, self.branch) {
                (Some(db), Some(b)) => with_dtype!(b.dtype, B => rnd::dropout_add_backward(
                    &*dx,
                    db.out_slice::<B>(Self::NAME)?,
                    b.p,
                    b.seed,
                    b.offset,
                )),
                _ => Ok(()),
            }
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let partials = bufs.ws(self.acc)?;
        let ([dx, dgamma, dbeta], dbranch) = bufs.outputs_mut();
        let at = ResidualNormAddresses {
            norm: super::norm::BackwardAddresses {
                x: self.x.cuda_ptr()?,
                gamma: self.gamma.cuda_ptr()?,
                mean: self.mean.cuda_ptr()?,
                rstd: self.rstd.cuda_ptr()?,
                dy: self.dy.cuda_ptr()?,
                dx: dx.cuda_ptr()?,
                dgamma: dgamma.cuda_ptr()?,
                dbeta: dbeta.cuda_ptr()?,
                partials,
            },
            dres: self.dres.cuda_ptr()?,
            dbranch: match dbranch {
                Some(t) => t.cuda_ptr()?,
                None => 0,
            },
        };
        let (branch, (rows, d)) = (self.branch, (self.mean.numel(), self.gamma.numel()));
        // SAFETY: the tensors hold what `plan` checked (x, dy, dres, dx and the branch's
        // gradient: rows * d elements; gamma, dgamma, dbeta: d; mean, rstd: rows floats) and
        // the workspace the partials.
        unsafe { residual_norm_backward_launches(gpu, &at, rows, d, self.x.dtype(), branch) }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<ResidualNormGrads> {
        let ([dx, dgamma, dbeta], dbranch) = bufs.into_outputs();
        Ok(ResidualNormGrads { dx, dgamma, dbeta, dbranch })
    }
}

/// The device addresses [`residual_norm_backward_launches`] works on.
#[cfg(feature = "cuda")]
pub(crate) struct ResidualNormAddresses {
    /// What layer norm's own backward works on.
    pub(crate) norm: super::norm::BackwardAddresses,
    /// The residual's gradient, added into dx.
    pub(crate) dres: u64,
    /// The branch's gradient (0 without a branch: never written).
    pub(crate) dbranch: u64,
}

/// [`layer_norm_backward_residual`]'s two launches over `[rows, d]` of `dtype`:
/// `layer_norm_bwd_residual` (dx with the residual's gradient added and, with a `branch`,
/// the branch's gradient in its dtype, one block per row; the partial sums of dgamma and
/// dbeta in the blocks after, as `layer_norm_bwd_fused`), then `layer_norm_bwd_finish`.
/// Written against [`Exec`](crate::cuda::Exec) so that the tests run it whole in the
/// emulation.
///
/// # Safety
///
/// The addresses hold what [`ResidualNormAddresses`] says for `rows` and `d` (the branch's
/// gradient `rows * d` elements of its dtype when `branch` is given).
#[cfg(feature = "cuda")]
pub(crate) unsafe fn residual_norm_backward_launches(
    gpu: &impl crate::cuda::Exec,
    at: &ResidualNormAddresses,
    rows: usize,
    d: usize,
    dtype: DType,
    branch: Option<ResidualBranch>,
) -> Result<()> {
    use crate::cuda::Arg;
    use crate::cuda::registry::LAYER_NORM_BWD_RESIDUAL;
    let grid = super::norm::BackwardGrid::new("layer_norm_backward_residual", rows, d)?;
    let n = &at.norm;
    // Without a branch the kernel writes none: its pair is the stream's dtype twice.
    let (bdt, has, drop) = match branch {
        Some(b) => (b.dtype, 1, BranchDropout { p: b.p, seed: b.seed, offset: b.offset }),
        None => (dtype, 0, BranchDropout { p: 0.0, seed: 0, offset: 0 }),
    };
    let [p, scale, seed, offset] = drop.args();
    // SAFETY: layer_norm_bwd_residual_R_B(const R* x, const R* g, const float* m, const float*
    // r, const R* dy, const R* dres, R* dx, B* db, u32 has_branch, float p, float scale, u64
    // seed, u64 offset, float* dg, float* dbp, u64 rows, u64 d, u64 chunk, u32 col_blocks,
    // u32 chunk_blocks); the caller's contract covers the sizes, `BackwardGrid` the grid.
    unsafe {
        gpu.launch(
            LAYER_NORM_BWD_RESIDUAL.of_pair(dtype, bdt),
            grid.cfg,
            &[
                Arg::Ptr(n.x),
                Arg::Ptr(n.gamma),
                Arg::Ptr(n.mean),
                Arg::Ptr(n.rstd),
                Arg::Ptr(n.dy),
                Arg::Ptr(at.dres),
                Arg::Ptr(n.dx),
                Arg::Ptr(at.dbranch),
                Arg::U32(has),
                p,
                scale,
                seed,
                offset,
                Arg::Ptr(n.partials),
                Arg::Ptr(grid.dbeta_partials(n.partials)),
                Arg::count(rows),
                Arg::count(d),
                Arg::count(crate::cpu::elementwise::COLUMN_SUM_ROWS),
                Arg::U32(grid.col_blocks),
                Arg::U32(grid.chunk_blocks),
            ],
        )?;
        grid.finish(gpu, n.partials, n.dgamma, n.dbeta, dtype)
    }
}

struct AddLayerNormOp<'a> {
    a: &'a Tensor,
    b: &'a Tensor,
    gamma: &'a Tensor,
    beta: &'a Tensor,
    eps: f32,
    drop: BranchDropout,
}

impl Op for AddLayerNormOp<'_> {
    const NAME: &'static str = "add_layer_norm";
    /// `sum`, `y`, `mean` and `rstd`.
    type Outs = (Tensor, Tensor, [Tensor; 2]);
    type Output = AddLayerNorm;

    fn device(&self) -> &Device {
        self.a.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        rnd::check_probability(Self::NAME, self.drop.p)?;
        residual_and_branch(Self::NAME, self.a, self.b)?;
        let (rows, d) = param_dims(Self::NAME, self.a, self.gamma)?;
        param_dims(Self::NAME, self.a, self.beta)?;
        if d == 0 {
            return Err(super::invalid(Self::NAME, "the last dimension is empty"));
        }
        let (shape, dt) = (self.a.shape(), self.a.dtype());
        let stat = || OutputSpec::new(&[rows], crate::DType::F32);
        Ok(Plan::new((OutputSpec::new(shape, dt), OutputSpec::new(shape, dt), [stat(), stat()])))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let (sum, y, [mean, rstd]) = bufs.outputs_mut();
        let BranchDropout { p, seed, offset } = self.drop;
        with_dtype!(self.a.dtype(), R => with_dtype!(self.b.dtype(), B => {
            let s = sum.out_slice::<R>(Self::NAME)?;
            rnd::dropout_add(self.a.as_slice::<R>()?, self.b.as_slice::<B>()?, s, p, seed, offset)?;
            norm::layer_norm(
                s,
                self.gamma.as_slice::<R>()?,
                self.beta.as_slice::<R>()?,
                self.eps,
                y.out_slice::<R>(Self::NAME)?,
                mean.out_slice::<f32>(Self::NAME)?,
                rstd.out_slice::<f32>(Self::NAME)?,
            )
        }))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::helpers::{check_rows, ptr};
        use crate::cuda::{Arg, launch, registry::ADD_LAYER_NORM};
        let (sum, y, [mean, rstd]) = bufs.outputs_mut();
        let rows = mean.numel();
        check_rows(Self::NAME, rows)?;
        let [p, scale, seed, offset] = self.drop.args();
        // SAFETY: add_layer_norm_R_B(const R* a, const B* b, const R* g, const R* beta, float
        // eps, float p, float scale, u64 seed, u64 offset, R* s, R* y, float* m, float* r,
        // u64 d), one block per row; a, b, s and y hold rows * d elements, gamma and beta d,
        // mean and rstd rows floats.
        unsafe {
            gpu.launch(
                ADD_LAYER_NORM.of_pair(self.a.dtype(), self.b.dtype()),
                launch::per_row(rows),
                &[
                    ptr(self.a)?,
                    ptr(self.b)?,
                    ptr(self.gamma)?,
                    ptr(self.beta)?,
                    Arg::F32(self.eps),
                    p,
                    scale,
                    seed,
                    offset,
                    ptr(sum)?,
                    ptr(y)?,
                    ptr(mean)?,
                    ptr(rstd)?,
                    Arg::count(self.gamma.numel()),
                ],
            )
        }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<AddLayerNorm> {
        let (sum, y, [mean, rstd]) = bufs.into_outputs();
        Ok(AddLayerNorm { sum, norm: LayerNormOutput { y, mean, rstd } })
    }
}

/// `x + bias` on the host, rounded as `bias_add` stores it.
fn pre_activation<T: Element>(x: &Tensor, bias: &Tensor) -> Result<Vec<T>> {
    let mut pre = vec![T::default(); x.numel()];
    ew::bias_add(x.as_slice::<T>()?, bias.as_slice::<T>()?, &mut pre)?;
    Ok(pre)
}

struct BiasGelu<'a> {
    x: &'a Tensor,
    bias: &'a Tensor,
}

impl Op for BiasGelu<'_> {
    const NAME: &'static str = "bias_gelu";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        param_dims(Self::NAME, self.x, self.bias)?;
        Ok(Plan::one(self.x.shape(), self.x.dtype()))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        with_dtype!(self.x.dtype(), T => {
            let pre = pre_activation::<T>(self.x, self.bias)?;
            act::gelu(&pre, bufs.out().out_slice::<T>(Self::NAME)?)
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let kernel = crate::cuda::registry::BIAS_GELU.of(self.x.dtype());
        super::elementwise::launch_bias_rows(gpu, kernel, self.x, self.bias, bufs.out())
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

struct BiasGeluBackward<'a> {
    x: &'a Tensor,
    bias: &'a Tensor,
    dy: &'a Tensor,
    /// The bias gradient's f32 partial sums, `[chunks, d]`.
    partials: Option<usize>,
}

impl Op for BiasGeluBackward<'_> {
    const NAME: &'static str = "bias_gelu_backward";
    /// `dx` and `dbias`.
    type Outs = [Tensor; 2];
    type Output = BiasGeluGrads;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        let (rows, d) = param_dims(Self::NAME, self.x, self.bias)?;
        same_layout(Self::NAME, self.x, self.dy)?;
        let mut plan = Plan::new([
            OutputSpec::new(self.x.shape(), self.x.dtype()),
            OutputSpec::new(&[d], self.x.dtype()),
        ]);
        let floats = crate::params::mul(Self::NAME, "the partial sums", param_chunks(rows), d)?;
        self.partials =
            plan.workspace(crate::params::mul(Self::NAME, "the partial sums", floats, 4)?);
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let [dx, dbias] = bufs.outputs_mut();
        with_dtype!(self.x.dtype(), T => {
            let pre = pre_activation::<T>(self.x, self.bias)?;
            let dx = dx.out_slice::<T>(Self::NAME)?;
            act::gelu_backward(&pre, self.dy.as_slice::<T>()?, dx)?;
            ew::bias_add_backward(dx, dbias.out_slice::<T>(Self::NAME)?)
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let partials = bufs.ws(self.partials)?;
        let [dx, dbias] = bufs.outputs_mut();
        let at = BiasGeluBackwardAddresses {
            x: self.x.cuda_ptr()?,
            bias: self.bias.cuda_ptr()?,
            dy: self.dy.cuda_ptr()?,
            dx: dx.cuda_ptr()?,
            dbias: dbias.cuda_ptr()?,
            partials,
        };
        let rows = self.x.numel() / self.bias.numel().max(1);
        // SAFETY: x, dy, dx hold rows * d elements, bias and dbias d, the workspace the
        // partials (`plan`).
        unsafe { backward_launches(gpu, &at, rows, self.bias.numel(), self.x.dtype()) }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<BiasGeluGrads> {
        let [dx, dbias] = bufs.into_outputs();
        Ok(BiasGeluGrads { dx, dbias })
    }
}

/// The device addresses [`backward_launches`] works on.
#[cfg(feature = "cuda")]
pub(crate) struct BiasGeluBackwardAddresses {
    pub(crate) x: u64,
    pub(crate) bias: u64,
    pub(crate) dy: u64,
    pub(crate) dx: u64,
    pub(crate) dbias: u64,
    /// `param_chunks(rows) * d` floats.
    pub(crate) partials: u64,
}

/// The backward's launches over `[rows, d]` of `dtype`: `bias_gelu_bwd` (dx and the bias
/// gradient's partials, a thread per column and chunk of rows), then `column_finish`.
/// Written against [`Exec`](crate::cuda::Exec) so that the tests run it in the emulation.
///
/// # Safety
///
/// The addresses hold what [`BiasGeluBackwardAddresses`] says for `rows` and `d`.
#[cfg(feature = "cuda")]
pub(crate) unsafe fn backward_launches(
    gpu: &impl crate::cuda::Exec,
    at: &BiasGeluBackwardAddresses,
    rows: usize,
    d: usize,
    dtype: crate::DType,
) -> Result<()> {
    use crate::cuda::registry::{BIAS_GELU_BWD, COLUMN_FINISH};
    use crate::cuda::{Arg, launch};
    if d == 0 {
        return Ok(());
    }
    let (cfg, chunk) = launch::columns(rows, d);
    // SAFETY: bias_gelu_bwd_T(const T* x, const T* b, const T* dy, T* dx, float* part, u64
    // rows, u64 d, u64 chunk), grid (column blocks, chunks); then column_finish_T(const
    // float* part, T* out, u64 chunks, u64 d) over the d columns. Sizes: the caller's
    // contract.
    unsafe {
        gpu.launch(
            BIAS_GELU_BWD.of(dtype),
            cfg,
            &[
                Arg::Ptr(at.x),
                Arg::Ptr(at.bias),
                Arg::Ptr(at.dy),
                Arg::Ptr(at.dx),
                Arg::Ptr(at.partials),
                Arg::count(rows),
                Arg::count(d),
                Arg::count(chunk),
            ],
        )?;
        gpu.launch(
            COLUMN_FINISH.of(dtype),
            launch::elementwise(d),
            &[
                Arg::Ptr(at.partials),
                Arg::Ptr(at.dbias),
                Arg::count(param_chunks(rows)),
                Arg::count(d),
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;
    use crate::ops;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u64 * 2_654_435_761 + seed * 97) % 2001) as f32 / 500.0) - 2.0)
            .collect()
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.to_f32_vec().unwrap().iter().map(|v| v.to_bits()).collect()
    }

    /// Forward and backward are the unfused ops' (bias_add, gelu, gelu_backward,
    /// bias_add_backward) bit for bit on the host, in every dtype, over one chunk of rows
    /// and several.
    #[test]
    fn bias_gelu_is_the_unfused_ops_bit_for_bit() {
        let dev = Device::host(64 << 20);
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for (rows, d) in [(3, 5), (130, 33), (0, 4)] {
                let t = |v: &[f32], s: &[usize]| Tensor::from_f32_slice(&dev, s, v, dtype).unwrap();
                let x = t(&values(rows * d, 1), &[rows, d]);
                let b = t(&values(d, 2), &[d]);
                let dy = t(&values(rows * d, 3), &[rows, d]);
                let pre = ops::bias_add(&x, &b).unwrap();
                let y = bias_gelu(&x, &b).unwrap();
                assert_eq!(bits(&y), bits(&ops::gelu(&pre).unwrap()), "{dtype:?} {rows}x{d}");
                let g = bias_gelu_backward(&x, &b, &dy).unwrap();
                let dx = ops::gelu_backward(&pre, &dy).unwrap();
                assert_eq!(bits(&g.dx), bits(&dx), "{dtype:?} {rows}x{d} dx");
                assert_eq!(bits(&g.dbias), bits(&ops::bias_add_backward(&dx).unwrap()));
            }
        }
        let x = Tensor::zeros(&dev, &[2, 3], DType::F32).unwrap();
        assert!(bias_gelu(&x, &Tensor::zeros(&dev, &[2], DType::F32).unwrap()).is_err());
        assert!(bias_gelu(&x, &Tensor::zeros(&dev, &[3], DType::F16).unwrap()).is_err());
        let b = Tensor::zeros(&dev, &[3], DType::F32).unwrap();
        assert!(
            bias_gelu_backward(&x, &b, &Tensor::zeros(&dev, &[3, 3], DType::F32).unwrap()).is_err()
        );
    }

    /// The residual add + layer norm is `add` then `layer_norm`, bit for bit on the host.
    #[test]
    fn add_layer_norm_is_add_then_layer_norm_bit_for_bit() {
        let dev = Device::host(64 << 20);
        for dtype in [DType::F32, DType::BF16] {
            let t = |v: &[f32], s: &[usize]| Tensor::from_f32_slice(&dev, s, v, dtype).unwrap();
            let (rows, d) = (7, 40);
            let (a, b) = (t(&values(rows * d, 4), &[rows, d]), t(&values(rows * d, 5), &[rows, d]));
            let (g, be) = (t(&values(d, 6), &[d]), t(&values(d, 7), &[d]));
            let got = add_layer_norm(&a, &b, &g, &be, 1e-5).unwrap();
            let sum = ops::add(&a, &b).unwrap();
            let want = ops::layer_norm(&sum, &g, &be, 1e-5).unwrap();
            assert_eq!(bits(&got.sum), bits(&sum));
            assert_eq!(bits(&got.norm.y), bits(&want.y));
            assert_eq!(bits(&got.norm.rstd), bits(&want.rstd));
            assert!(add_layer_norm(&a, &g, &g, &be, 1e-5).is_err());
        }
    }

    /// The host and a virtual device (the GPU's plan) make the same requests: the outputs
    /// and one workspace of the bias gradient's partials, `ceil(rows / 64) * d` floats; the
    /// same for layer norm's backward (its dgamma and dbeta partials, twice that).
    #[test]
    fn host_and_virtual_devices_allocate_the_same_partials() {
        let (rows, d) = (130, 48);
        let mut traces = Vec::new();
        for dev in [Device::host(64 << 20), Device::virtual_device(64 << 20)] {
            let z = |s: &[usize]| Tensor::zeros(&dev, s, DType::BF16).unwrap();
            let (x, b, dy) = (z(&[rows, d]), z(&[d]), z(&[rows, d]));
            let ln = ops::layer_norm(&x, &b, &b, 1e-5).unwrap();
            dev.record_history(Some(100));
            drop(bias_gelu_backward(&x, &b, &dy).unwrap());
            drop(ops::layer_norm_backward(&x, &b, &ln.mean, &ln.rstd, &dy).unwrap());
            let allocs: Vec<usize> = dev
                .trace()
                .iter()
                .filter(|e| e.action == vram_alloc::TraceAction::Alloc)
                .map(|e| e.requested)
                .collect();
            traces.push(allocs);
        }
        let (x, p) = (rows * d * 2, 3 * d * 4);
        assert_eq!(traces[0], [x, d * 2, p, x, d * 2, d * 2, 2 * p]);
        assert_eq!(traces[0], traces[1]);
    }

    /// The residual add + layer norm kernel, emulated, against the host: the sum bit for bit,
    /// the norm within rounding (the block adds the row's statistics in another order).
    #[cfg(feature = "cuda")]
    #[test]
    fn add_layer_norm_kernel_matches_the_host() {
        use crate::cuda::emulate::launch;
        use crate::cuda::registry::ADD_LAYER_NORM;
        use crate::cuda::{Arg, launch as grid};
        let dev = Device::host(64 << 20);
        for dtype in [DType::F32, DType::BF16] {
            let t = |v: &[f32], s: &[usize]| Tensor::from_f32_slice(&dev, s, v, dtype).unwrap();
            let (rows, d) = (3, 300);
            let (a, b) = (t(&values(rows * d, 4), &[rows, d]), t(&values(rows * d, 5), &[rows, d]));
            let (g, be) = (t(&values(d, 6), &[d]), t(&values(d, 7), &[d]));
            let want = add_layer_norm(&a, &b, &g, &be, 1e-5).unwrap();
            let (s, y) = (
                t(&vec![f32::NAN; rows * d], &[rows, d]),
                t(&vec![f32::NAN; rows * d], &[rows, d]),
            );
            let (mut m, mut r) = (vec![f32::NAN; rows], vec![f32::NAN; rows]);
            let at = |t: &Tensor| Arg::Ptr(t.storage().address());
            let args = [
                at(&a),
                at(&b),
                at(&g),
                at(&be),
                Arg::F32(1e-5),
                Arg::F32(0.0),
                Arg::F32(1.0),
                Arg::U64(0),
                Arg::U64(0),
                at(&s),
                at(&y),
                Arg::Ptr(m.as_mut_ptr() as u64),
                Arg::Ptr(r.as_mut_ptr() as u64),
                Arg::count(d),
            ];
            if !launch(ADD_LAYER_NORM.of_pair(dtype, dtype), grid::per_row(rows), &args) {
                return;
            }
            assert_eq!(bits(&s), bits(&want.sum), "{dtype:?} sum");
            let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
            let close = |what: &str, got: &[f32], want: &[f32]| {
                for (i, (g, w)) in got.iter().zip(want).enumerate() {
                    assert!((g - w).abs() <= tol * w.abs().max(1.0), "{what} {i}: {g} vs {w}");
                }
            };
            close("y", &y.to_f32_vec().unwrap(), &want.norm.y.to_f32_vec().unwrap());
            close("mean", &m, &want.norm.mean.to_f32_vec().unwrap());
            close("rstd", &r, &want.norm.rstd.to_f32_vec().unwrap());
        }
    }

    /// The kernels, emulated on the host through the op's own launch code, against the host
    /// op: bit for bit (the kernels' `vram_exp` is the host's `exp`; no contraction).
    #[cfg(feature = "cuda")]
    #[test]
    fn bias_gelu_kernels_match_the_host_bit_for_bit() {
        use crate::cuda::emulate::{Emulator, launch};
        use crate::cuda::registry::{BIAS_GELU, BIAS_GELU_BWD};
        use crate::cuda::{Arg, launch as grid};
        let Some(e) = Emulator::new(BIAS_GELU_BWD.of(DType::F32)) else { return };
        let dev = Device::host(64 << 20);
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for (rows, d) in [(3, 300), (130, 33)] {
                let t = |v: &[f32], s: &[usize]| Tensor::from_f32_slice(&dev, s, v, dtype).unwrap();
                let (x, b) = (t(&values(rows * d, 1), &[rows, d]), t(&values(d, 2), &[d]));
                let dy = t(&values(rows * d, 3), &[rows, d]);
                let want_y = bias_gelu(&x, &b).unwrap();
                let want = bias_gelu_backward(&x, &b, &dy).unwrap();
                let nan = |s: &[usize]| t(&vec![f32::NAN; s.iter().product()], s);
                let (y, dx, db) = (nan(&[rows, d]), nan(&[rows, d]), nan(&[d]));
                let mut partials = vec![f32::NAN; param_chunks(rows) * d];
                let a = |t: &Tensor| t.storage().address();
                let n = rows * d;
                let args =
                    [Arg::Ptr(a(&x)), Arg::Ptr(a(&b)), Arg::Ptr(a(&y)), Arg::count(n), Arg::div(d)];
                assert!(launch(BIAS_GELU.of(dtype), grid::elementwise(n), &args));
                let at = BiasGeluBackwardAddresses {
                    x: a(&x),
                    bias: a(&b),
                    dy: a(&dy),
                    dx: a(&dx),
                    dbias: a(&db),
                    partials: partials.as_mut_ptr() as u64,
                };
                // SAFETY: host buffers of the sizes the launches address.
                unsafe { backward_launches(&e, &at, rows, d, dtype) }.unwrap();
                let what = format!("{dtype:?} {rows}x{d}");
                assert_eq!(bits(&y), bits(&want_y), "{what} y");
                assert_eq!(bits(&dx), bits(&want.dx), "{what} dx");
                assert_eq!(bits(&db), bits(&want.dbias), "{what} dbias");
            }
        }
    }
}

/// The residual ops with dropout on the branch against their unfused compositions.
#[cfg(test)]
mod residual_tests {
    use super::*;
    use crate::ops;
    use proptest::prelude::*;

    /// Every (residual, branch) dtype pair the ops take: equal, or f32 with 16 bits.
    const PAIRS: [(DType, DType); 5] = [
        (DType::F32, DType::F32),
        (DType::F32, DType::F16),
        (DType::F32, DType::BF16),
        (DType::F16, DType::F16),
        (DType::BF16, DType::BF16),
    ];

    fn values(n: usize, seed: u64) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u64 * 2_654_435_761 + seed * 97) % 2001) as f32 / 500.0) - 2.0)
            .collect()
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.to_f32_vec().unwrap().iter().map(|v| v.to_bits()).collect()
    }

    /// The unfused block's branch: `ops::dropout` (none at p = 0), cast to the residual's
    /// dtype.
    fn unfused_branch(r: DType, b: &Tensor, p: f32, seed: u64, offset: u64) -> Tensor {
        let dropped = if p > 0.0 { ops::dropout(b, p, seed, offset).unwrap() } else { b.clone() };
        dropped.to_dtype(r).unwrap()
    }

    /// Checks the three ops against the unfused ones bit for bit on `[rows, d]`.
    fn check(rows: usize, d: usize, p: f32, seed: u64, offset: u64, salt: u64) {
        let dev = Device::host(256 << 20);
        for (r, b) in PAIRS {
            let what = format!("{r:?}+{b:?} {rows}x{d} p {p} seed {seed} offset {offset}");
            let t = |v: &[f32], s: &[usize], dt| Tensor::from_f32_slice(&dev, s, v, dt).unwrap();
            let x = t(&values(rows * d, salt), &[rows, d], r);
            let o = t(&values(rows * d, salt + 1), &[rows, d], b);
            let (g, be) = (t(&values(d, salt + 2), &[d], r), t(&values(d, salt + 3), &[d], r));
            let dy = t(&values(rows * d, salt + 4), &[rows, d], r);
            let sum = ops::add(&x, &unfused_branch(r, &o, p, seed, offset)).unwrap();
            let y = dropout_add(&x, &o, p, seed, offset).unwrap();
            assert_eq!((y.dtype(), y.shape()), (r, x.shape()), "{what}");
            assert_eq!(bits(&y), bits(&sum), "{what}: dropout_add");
            let got = dropout_add_layer_norm(&x, &o, &g, &be, 1e-5, p, seed, offset).unwrap();
            let want = ops::layer_norm(&sum, &g, &be, 1e-5).unwrap();
            assert_eq!(bits(&got.sum), bits(&sum), "{what}: sum");
            assert_eq!(bits(&got.norm.y), bits(&want.y), "{what}: norm");
            assert_eq!(bits(&got.norm.mean), bits(&want.mean), "{what}: mean");
            assert_eq!(bits(&got.norm.rstd), bits(&want.rstd), "{what}: rstd");
            let db = dropout_add_backward(&dy, b, p, seed, offset).unwrap();
            let cast = dy.to_dtype(b).unwrap();
            let want_db =
                if p > 0.0 { ops::dropout_backward(&cast, p, seed, offset).unwrap() } else { cast };
            assert_eq!((db.dtype(), db.shape()), (b, dy.shape()), "{what}");
            assert_eq!(bits(&db), bits(&want_db), "{what}: backward");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// Fused == unfused bit for bit on the host, every dtype pair, p in {0, 0.1, 0.5},
        /// any seed and offset (a mask that started elsewhere in the stream would differ).
        #[test]
        fn fused_residual_ops_are_the_unfused_ones_bit_for_bit(
            rows in 1usize..24,
            d in 1usize..70,
            p in prop::sample::select(vec![0.0f32, 0.1, 0.5]),
            seed in any::<u64>(),
            offset in 0u64..1 << 40,
            salt in 0u64..1000,
        ) {
            check(rows, d, p, seed, offset, salt);
        }
    }

    /// The same above the host's parallel threshold (the mask drawn in chunks) and for no
    /// rows (a sum and norm of nothing).
    #[test]
    fn large_and_empty_inputs_are_the_unfused_ones() {
        check(130, 768, 0.1, 7, 12_345, 3);
        let dev = Device::host(64 << 20);
        let z = |s: &[usize]| Tensor::zeros(&dev, s, DType::F32).unwrap();
        assert_eq!(dropout_add(&z(&[0, 4]), &z(&[0, 4]), 0.5, 1, 2).unwrap().numel(), 0);
        let n =
            dropout_add_layer_norm(&z(&[0, 4]), &z(&[0, 4]), &z(&[4]), &z(&[4]), 1e-5, 0.5, 1, 2);
        assert_eq!(n.unwrap().norm.mean.numel(), 0);
    }

    /// Dropout actually drops (a mask of zeros at p = 0.5 differs from p = 0), and a sum that
    /// kept every branch element would fail the comparison above.
    #[test]
    fn the_branch_is_dropped_and_scaled() {
        let dev = Device::host(64 << 20);
        let n = 4000;
        let x = Tensor::zeros(&dev, &[n], DType::F32).unwrap();
        let o = Tensor::full(&dev, &[n], DType::BF16, 1.0).unwrap();
        let y = dropout_add(&x, &o, 0.5, 3, 0).unwrap().to_f32_vec().unwrap();
        let kept = y.iter().filter(|&&v| v == 2.0).count();
        assert_eq!(kept + y.iter().filter(|&&v| v == 0.0).count(), n);
        assert!((kept as f32 / n as f32 - 0.5).abs() < 0.05, "{kept} of {n} kept");
    }

    /// Bad input is a clear error, never a panic: p outside [0, 1), shapes, dtype pairs the
    /// ops do not take, parameters not `[d]`.
    #[test]
    fn bad_input_is_an_error() {
        let dev = Device::host(64 << 20);
        let z = |s: &[usize], dt| Tensor::zeros(&dev, s, dt).unwrap();
        let (x, o) = (z(&[2, 3], DType::F32), z(&[2, 3], DType::BF16));
        let (g, b) = (z(&[3], DType::F32), z(&[3], DType::F32));
        for p in [1.0, -0.1, 1.5, f32::NAN] {
            let e = dropout_add(&x, &o, p, 0, 0).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument { .. }), "p {p}: {e}");
            assert!(e.to_string().contains("probability"), "{e}");
            assert!(dropout_add_layer_norm(&x, &o, &g, &b, 1e-5, p, 0, 0).is_err());
            assert!(dropout_add_backward(&x, DType::BF16, p, 0, 0).is_err());
        }
        let wrong = z(&[3, 2], DType::BF16);
        let e = dropout_add(&x, &wrong, 0.1, 0, 0).unwrap_err();
        assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
        let e = dropout_add_layer_norm(&x, &wrong, &g, &b, 1e-5, 0.1, 0, 0).unwrap_err();
        assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
        // A 16-bit residual takes only its own dtype; an f32 branch never has a 16-bit sum.
        let (h, f) = (z(&[2, 3], DType::BF16), z(&[2, 3], DType::F16));
        for (r, br) in [(&h, &x), (&h, &f), (&f, &h)] {
            let e = dropout_add(r, br, 0.1, 0, 0).unwrap_err();
            assert!(matches!(e, Error::DTypeMismatch { .. }), "{e}");
        }
        let e = dropout_add_backward(&h, DType::F32, 0.1, 0, 0).unwrap_err();
        assert!(matches!(e, Error::DTypeMismatch { .. }), "{e}");
        // Parameters not [d] or not of the residual's dtype; an empty last dimension.
        assert!(dropout_add_layer_norm(&x, &o, &z(&[2], DType::F32), &b, 1e-5, 0.1, 0, 0).is_err());
        assert!(
            dropout_add_layer_norm(&x, &o, &g, &z(&[3], DType::BF16), 1e-5, 0.1, 0, 0).is_err()
        );
        let e0 = z(&[2, 0], DType::F32);
        let g0 = z(&[0], DType::F32);
        assert!(dropout_add_layer_norm(&e0, &e0, &g0, &g0, 1e-5, 0.1, 0, 0).is_err());
    }

    /// The host and a virtual device (the GPU's plan) allocate the same: each op its outputs
    /// and nothing else (no mask, no f32 copy of a 16-bit branch).
    #[test]
    fn host_and_virtual_devices_allocate_only_the_outputs() {
        let (rows, d) = (16, 48);
        let mut traces = Vec::new();
        for dev in [Device::host(64 << 20), Device::virtual_device(64 << 20)] {
            let x = Tensor::zeros(&dev, &[rows, d], DType::F32).unwrap();
            let o = Tensor::zeros(&dev, &[rows, d], DType::BF16).unwrap();
            let g = Tensor::zeros(&dev, &[d], DType::F32).unwrap();
            dev.record_history(Some(100));
            drop(dropout_add(&x, &o, 0.1, 1, 0).unwrap());
            drop(dropout_add_layer_norm(&x, &o, &g, &g, 1e-5, 0.1, 1, 0).unwrap());
            drop(dropout_add_backward(&x, DType::BF16, 0.1, 1, 0).unwrap());
            let allocs: Vec<usize> = dev
                .trace()
                .iter()
                .filter(|e| e.action == vram_alloc::TraceAction::Alloc)
                .map(|e| e.requested)
                .collect();
            traces.push(allocs);
        }
        let (f, h) = (rows * d * 4, rows * d * 2);
        assert_eq!(traces[0], [f, f, f, rows * 4, rows * 4, h]);
        assert_eq!(traces[0], traces[1]);
    }

    /// The three kernels, emulated on the host, against the host ops: bit for bit for the
    /// elementwise ones and the sum; the norm within rounding (the block adds the row's
    /// statistics in another order). Every dtype pair, p in {0, 0.1, 0.5}.
    #[cfg(feature = "cuda")]
    #[test]
    fn residual_kernels_match_the_host() {
        use crate::cuda::emulate::launch;
        use crate::cuda::registry::{ADD_LAYER_NORM, DROPOUT_ADD, DROPOUT_ADD_BWD};
        use crate::cuda::{Arg, launch as grid};
        let dev = Device::host(64 << 20);
        let (rows, d, seed, offset) = (5, 300, 0x1234_5678_9abc, 77);
        let n = rows * d;
        for (r, b) in PAIRS {
            for p in [0.0f32, 0.1, 0.5] {
                let what = format!("{r:?}+{b:?} p {p}");
                let t =
                    |v: &[f32], s: &[usize], dt| Tensor::from_f32_slice(&dev, s, v, dt).unwrap();
                let x = t(&values(n, 1), &[rows, d], r);
                let o = t(&values(n, 2), &[rows, d], b);
                let (g, be) = (t(&values(d, 3), &[d], r), t(&values(d, 4), &[d], r));
                let dy = t(&values(n, 5), &[rows, d], r);
                let nan = |dt| t(&vec![f32::NAN; n], &[rows, d], dt);
                let at = |t: &Tensor| Arg::Ptr(t.storage().address());
                let drop = BranchDropout { p, seed, offset }.args();
                let [dp, scale, dseed, doff] = drop;
                // dropout_add
                let y = nan(r);
                let args = [at(&x), at(&o), at(&y), Arg::count(n), dp, scale, dseed, doff];
                if !launch(DROPOUT_ADD.of_pair(r, b), grid::elementwise(n), &args) {
                    return;
                }
                assert_eq!(
                    bits(&y),
                    bits(&dropout_add(&x, &o, p, seed, offset).unwrap()),
                    "{what}"
                );
                // its backward
                let db = nan(b);
                let args = [at(&dy), at(&db), Arg::count(n), dp, scale, dseed, doff];
                assert!(launch(DROPOUT_ADD_BWD.of_pair(r, b), grid::elementwise(n), &args));
                let want = dropout_add_backward(&dy, b, p, seed, offset).unwrap();
                assert_eq!(bits(&db), bits(&want), "{what} backward");
                // dropout + add + layer norm
                let want = dropout_add_layer_norm(&x, &o, &g, &be, 1e-5, p, seed, offset).unwrap();
                let (s, y) = (nan(r), nan(r));
                let (mut m, mut rs) = (vec![f32::NAN; rows], vec![f32::NAN; rows]);
                let args = [
                    at(&x),
                    at(&o),
                    at(&g),
                    at(&be),
                    Arg::F32(1e-5),
                    dp,
                    scale,
                    dseed,
                    doff,
                    at(&s),
                    at(&y),
                    Arg::Ptr(m.as_mut_ptr() as u64),
                    Arg::Ptr(rs.as_mut_ptr() as u64),
                    Arg::count(d),
                ];
                assert!(launch(ADD_LAYER_NORM.of_pair(r, b), grid::per_row(rows), &args));
                assert_eq!(bits(&s), bits(&want.sum), "{what} sum");
                let tol = if r == DType::F32 { 1e-5 } else { 1e-2 };
                let close = |which: &str, got: &[f32], want: &[f32]| {
                    for (i, (g, w)) in got.iter().zip(want).enumerate() {
                        let ok = (g - w).abs() <= tol * w.abs().max(1.0);
                        assert!(ok, "{what} {which} {i}: {g} vs {w}");
                    }
                };
                close("y", &y.to_f32_vec().unwrap(), &want.norm.y.to_f32_vec().unwrap());
                close("mean", &m, &want.norm.mean.to_f32_vec().unwrap());
                close("rstd", &rs, &want.norm.rstd.to_f32_vec().unwrap());
            }
        }
    }
}

/// [`layer_norm_backward_residual`] against the unfused ops it replaces.
#[cfg(test)]
mod residual_norm_tests {
    use super::*;
    use crate::ops;
    use proptest::prelude::*;

    /// The (stream, branch) dtype pairs a block takes.
    const PAIRS: [(DType, DType); 5] = [
        (DType::F32, DType::F32),
        (DType::BF16, DType::BF16),
        (DType::F16, DType::F16),
        (DType::F32, DType::BF16),
        (DType::F32, DType::F16),
    ];

    fn values(n: usize, seed: u64) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u64 * 2_654_435_761 + seed * 97) % 2001) as f32 / 500.0) - 2.0)
            .collect()
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.to_f32_vec().unwrap().iter().map(|v| v.to_bits()).collect()
    }

    /// The saved state of a layer norm over `[rows, d]` of `dtype` and the two incoming
    /// gradients: `(x, gamma, mean, rstd, dy, dres)`.
    fn inputs(
        dev: &Device,
        rows: usize,
        d: usize,
        dtype: DType,
        salt: u64,
    ) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor) {
        let t = |v: &[f32], s: &[usize]| Tensor::from_f32_slice(dev, s, v, dtype).unwrap();
        let x = t(&values(rows * d, salt), &[rows, d]);
        let g = t(&values(d, salt + 1), &[d]);
        let fwd = ops::layer_norm(&x, &g, &t(&values(d, salt + 2), &[d]), 1e-5).unwrap();
        let dy = t(&values(rows * d, salt + 3), &[rows, d]);
        let dres = t(&values(rows * d, salt + 4), &[rows, d]);
        (x, g, fwd.mean, fwd.rstd, dy, dres)
    }

    /// The fused op against layer_norm_backward, add_assign and dropout_add_backward, bit for
    /// bit, with and without a branch.
    fn check(rows: usize, d: usize, p: f32, seed: u64, offset: u64, salt: u64) {
        let dev = Device::host(256 << 20);
        for (r, b) in PAIRS {
            let what = format!("{r:?}+{b:?} {rows}x{d} p {p} seed {seed} offset {offset}");
            let (x, g, mean, rstd, dy, dres) = inputs(&dev, rows, d, r, salt);
            let want = ops::layer_norm_backward(&x, &g, &mean, &rstd, &dy).unwrap();
            let mut want_dx = want.dx;
            ops::add_assign(&mut want_dx, &dres).unwrap();
            let want_db = dropout_add_backward(&want_dx, b, p, seed, offset).unwrap();
            let branch = ResidualBranch { dtype: b, p, seed, offset };
            for with_branch in [true, false] {
                let got = layer_norm_backward_residual(
                    &x,
                    &g,
                    &mean,
                    &rstd,
                    &dy,
                    &dres,
                    with_branch.then_some(branch),
                )
                .unwrap();
                assert_eq!(bits(&got.dx), bits(&want_dx), "{what}: dx");
                assert_eq!(bits(&got.dgamma), bits(&want.dgamma), "{what}: dgamma");
                assert_eq!(bits(&got.dbeta), bits(&want.dbeta), "{what}: dbeta");
                assert_eq!(got.dx.dtype(), r, "{what}");
                match got.dbranch {
                    Some(db) => {
                        assert!(with_branch, "{what}: a branch gradient nobody asked for");
                        assert_eq!((db.dtype(), db.shape()), (b, x.shape()), "{what}");
                        assert_eq!(bits(&db), bits(&want_db), "{what}: branch");
                    }
                    None => assert!(!with_branch, "{what}: no branch gradient"),
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// Fused == unfused bit for bit on the host: every pair a block uses, p in
        /// {0, 0.1, 0.5}, any seed and offset, odd sizes.
        #[test]
        fn the_fused_norm_backward_is_the_unfused_ops_bit_for_bit(
            rows in 1usize..24,
            d in 1usize..70,
            p in prop::sample::select(vec![0.0f32, 0.1, 0.5]),
            seed in any::<u64>(),
            offset in 0u64..1 << 40,
            salt in 0u64..1000,
        ) {
            check(rows, d, p, seed, offset, salt);
        }
    }

    /// Above the host's parallel threshold and over several chunks of rows of the parameter
    /// gradients' sums; no rows at all.
    #[test]
    fn large_and_empty_inputs_are_the_unfused_ops() {
        check(130, 768, 0.1, 7, 12_345, 3);
        let dev = Device::host(64 << 20);
        let z = |s: &[usize]| Tensor::zeros(&dev, s, DType::F32).unwrap();
        let b = ResidualBranch { dtype: DType::BF16, p: 0.5, seed: 1, offset: 2 };
        let (x, g, m) = (z(&[0, 4]), z(&[4]), z(&[0]));
        let got = layer_norm_backward_residual(&x, &g, &m, &m, &x, &x, Some(b)).unwrap();
        assert_eq!(got.dbranch.unwrap().numel(), 0);
        assert_eq!(bits(&got.dgamma), [0; 4]);
    }

    /// The branch's gradient is masked (a p = 0.5 mask zeroes about half of it) and the
    /// shortcut's gradient is added (a zero `dres` gives layer norm's dx alone, another
    /// `dres` does not).
    #[test]
    fn the_shortcut_is_added_and_the_branch_masked() {
        let dev = Device::host(64 << 20);
        let (rows, d) = (40, 100);
        let (x, g, mean, rstd, dy, dres) = inputs(&dev, rows, d, DType::F32, 5);
        let zero = Tensor::zeros(&dev, &[rows, d], DType::F32).unwrap();
        let alone = ops::layer_norm_backward(&x, &g, &mean, &rstd, &dy).unwrap().dx;
        let b = ResidualBranch { dtype: DType::F32, p: 0.5, seed: 9, offset: 0 };
        let got = layer_norm_backward_residual(&x, &g, &mean, &rstd, &dy, &zero, Some(b)).unwrap();
        assert_eq!(bits(&got.dx), bits(&alone));
        let db = got.dbranch.unwrap().to_f32_vec().unwrap();
        let dropped = db.iter().filter(|&&v| v == 0.0).count();
        assert!((dropped as f32 / db.len() as f32 - 0.5).abs() < 0.05, "{dropped} dropped");
        let got = layer_norm_backward_residual(&x, &g, &mean, &rstd, &dy, &dres, None).unwrap();
        assert_ne!(bits(&got.dx), bits(&alone));
    }

    /// Bad input is a clear error, never a panic: shapes, dtypes, devices, saved statistics,
    /// p outside [0, 1), a branch dtype the residual ops do not take.
    #[test]
    fn bad_input_is_an_error() {
        let dev = Device::host(64 << 20);
        let other = Device::host(64 << 20);
        let (x, g, m, r, dy, dres) = inputs(&dev, 3, 8, DType::F32, 1);
        let z = |s: &[usize], dt| Tensor::zeros(&dev, s, dt).unwrap();
        let ok = ResidualBranch { dtype: DType::BF16, p: 0.1, seed: 0, offset: 0 };
        #[allow(clippy::too_many_arguments)]
        fn run(
            x: &Tensor,
            g: &Tensor,
            m: &Tensor,
            r: &Tensor,
            dy: &Tensor,
            dres: &Tensor,
            b: Option<ResidualBranch>,
        ) -> Error {
            layer_norm_backward_residual(x, g, m, r, dy, dres, b).unwrap_err()
        }
        let shape = |e: &Error| matches!(e, Error::ShapeMismatch { .. });
        let dtype = |e: &Error| matches!(e, Error::DTypeMismatch { .. });
        let wrong = z(&[8, 3], DType::F32);
        assert!(shape(&run(&x, &g, &m, &r, &wrong, &dres, None)));
        assert!(shape(&run(&x, &g, &m, &r, &dy, &wrong, None)));
        assert!(shape(&run(&x, &z(&[3], DType::F32), &m, &r, &dy, &dres, None)));
        assert!(shape(&run(&x, &g, &z(&[8], DType::F32), &r, &dy, &dres, None)));
        let half = z(&[3, 8], DType::BF16);
        assert!(dtype(&run(&x, &g, &m, &r, &dy, &half, None)));
        assert!(dtype(&run(&x, &g, &m, &r, &half, &dres, None)));
        assert!(dtype(&run(&x, &g, &z(&[3], DType::BF16), &r, &dy, &dres, None)));
        let far = Tensor::zeros(&other, &[3, 8], DType::F32).unwrap();
        let e = run(&x, &g, &m, &r, &dy, &far, None);
        assert!(matches!(e, Error::DeviceMismatch { .. }), "{e}");
        for p in [1.0, -0.1, f32::NAN] {
            let e = run(&x, &g, &m, &r, &dy, &dres, Some(ResidualBranch { p, ..ok }));
            assert!(matches!(e, Error::InvalidArgument { .. }), "p {p}: {e}");
        }
        // A 16-bit stream takes only its own dtype for the branch.
        let (h, hg, hm, hr, hdy, hres) = inputs(&dev, 3, 8, DType::BF16, 1);
        for bdt in [DType::F32, DType::F16] {
            let b = Some(ResidualBranch { dtype: bdt, ..ok });
            assert!(dtype(&run(&h, &hg, &hm, &hr, &hdy, &hres, b)));
        }
        let (e0, g0) = (z(&[2, 0], DType::F32), z(&[0], DType::F32));
        let m2 = z(&[2], DType::F32);
        assert!(layer_norm_backward_residual(&e0, &g0, &m2, &m2, &e0, &e0, None).is_err());
    }

    /// Out of memory part-way through the outputs: an error, every byte given back, the
    /// inputs intact.
    #[test]
    fn out_of_memory_leaves_the_inputs_as_they_were() {
        // Three 10 MiB inputs (segments of their size) and the small ones (a 2 MiB segment)
        // fit, and dx; the branch's 5 MiB gradient (a 20 MiB segment) does not.
        let dev = Device::host(44 << 20);
        let (x, g, m, r, dy, dres) = inputs(&dev, 2560, 1024, DType::F32, 2);
        let all = [&x, &g, &m, &r, &dy, &dres];
        let before: Vec<_> = all.iter().map(|t| bits(t)).collect();
        let used = dev.memory_stats().allocated_bytes.all.current;
        let b = ResidualBranch { dtype: DType::BF16, p: 0.1, seed: 3, offset: 0 };
        let e = layer_norm_backward_residual(&x, &g, &m, &r, &dy, &dres, Some(b)).unwrap_err();
        assert!(e.is_out_of_memory(), "{e}");
        assert_eq!(dev.memory_stats().allocated_bytes.all.current, used);
        let after: Vec<_> = all.iter().map(|t| bits(t)).collect();
        assert_eq!(after, before);
        // Without the branch's gradient the outputs fit.
        assert!(layer_norm_backward_residual(&x, &g, &m, &r, &dy, &dres, None).is_ok());
    }

    /// The host and a virtual device (the GPU's plan) allocate the same: the outputs (the
    /// branch's only when asked for) and the partials' workspace.
    #[test]
    fn host_and_virtual_devices_allocate_the_same() {
        let (rows, d) = (130, 48);
        let mut traces = Vec::new();
        for dev in [Device::host(64 << 20), Device::virtual_device(64 << 20)] {
            let z = |s: &[usize]| Tensor::zeros(&dev, s, DType::F32).unwrap();
            let (x, g, m) = (z(&[rows, d]), z(&[d]), z(&[rows]));
            let b = ResidualBranch { dtype: DType::BF16, p: 0.1, seed: 1, offset: 0 };
            dev.record_history(Some(100));
            drop(layer_norm_backward_residual(&x, &g, &m, &m, &x, &x, Some(b)).unwrap());
            drop(layer_norm_backward_residual(&x, &g, &m, &m, &x, &x, None).unwrap());
            let allocs: Vec<usize> = dev
                .trace()
                .iter()
                .filter(|e| e.action == vram_alloc::TraceAction::Alloc)
                .map(|e| e.requested)
                .collect();
            traces.push(allocs);
        }
        let (f, h, p) = (rows * d * 4, rows * d * 2, 2 * param_chunks(rows) * d * 4);
        assert_eq!(traces[0], [f, d * 4, d * 4, h, p, f, d * 4, d * 4, p]);
        assert_eq!(traces[0], traces[1]);
    }

    /// The kernel, emulated on the host through the op's own launch code, against the host
    /// op: dx within rounding (the block adds the row's sums in another order), dgamma and
    /// dbeta in the host's order, and the branch's gradient bit for bit what
    /// `dropout_add_backward` makes of the emulated dx. Every pair, p in {0, 0.1, 0.5}, with
    /// and without a branch, one chunk of rows and three.
    #[cfg(feature = "cuda")]
    #[test]
    fn the_kernel_matches_the_host() {
        use crate::cuda::emulate::Emulator;
        use crate::cuda::registry::LAYER_NORM_BWD_RESIDUAL;
        let Some(e) = Emulator::new(LAYER_NORM_BWD_RESIDUAL.of_pair(DType::F32, DType::F32)) else {
            return;
        };
        let dev = Device::host(64 << 20);
        let d = 300;
        for (r, b) in PAIRS {
            for (rows, p) in [(5, 0.0f32), (5, 0.1), (130, 0.5)] {
                for with_branch in [true, false] {
                    let what = format!("{r:?}+{b:?} {rows} rows p {p} branch {with_branch}");
                    let (x, g, mean, rstd, dy, dres) = inputs(&dev, rows, d, r, 7);
                    let branch = ResidualBranch { dtype: b, p, seed: 0x1234_5678_9abc, offset: 77 };
                    let branch = with_branch.then_some(branch);
                    let want =
                        layer_norm_backward_residual(&x, &g, &mean, &rstd, &dy, &dres, branch)
                            .unwrap();
                    let nan = |s: &[usize], dt| {
                        let n = s.iter().product();
                        Tensor::from_f32_slice(&dev, s, &vec![f32::NAN; n], dt).unwrap()
                    };
                    let (dx, dg, dbe) = (nan(&[rows, d], r), nan(&[d], r), nan(&[d], r));
                    let db = nan(&[rows, d], b);
                    let mut partials = vec![f32::NAN; 2 * param_chunks(rows) * d];
                    let a = |t: &Tensor| t.storage().address();
                    let at = ResidualNormAddresses {
                        norm: crate::ops::norm::BackwardAddresses {
                            x: a(&x),
                            gamma: a(&g),
                            mean: a(&mean),
                            rstd: a(&rstd),
                            dy: a(&dy),
                            dx: a(&dx),
                            dgamma: a(&dg),
                            dbeta: a(&dbe),
                            partials: partials.as_mut_ptr() as u64,
                        },
                        dres: a(&dres),
                        dbranch: if with_branch { a(&db) } else { 0 },
                    };
                    // SAFETY: host buffers of the sizes the launches address.
                    unsafe { residual_norm_backward_launches(&e, &at, rows, d, r, branch) }
                        .unwrap();
                    let tol = if r == DType::F32 { 1e-5 } else { 1e-2 };
                    let (got, exp) = (dx.to_f32_vec().unwrap(), want.dx.to_f32_vec().unwrap());
                    for (i, (g, w)) in got.iter().zip(&exp).enumerate() {
                        let ok = (g - w).abs() <= tol * w.abs().max(1.0);
                        assert!(ok, "{what} dx {i}: {g} vs {w}");
                    }
                    assert_eq!(bits(&dbe), bits(&want.dbeta), "{what} dbeta");
                    let (got, exp) = (dg.to_f32_vec().unwrap(), want.dgamma.to_f32_vec().unwrap());
                    for (i, (g, w)) in got.iter().zip(&exp).enumerate() {
                        let ok = (g - w).abs() <= tol * w.abs().max(1.0);
                        assert!(ok, "{what} dgamma {i}: {g} vs {w}");
                    }
                    if let Some(br) = branch {
                        let of_dx = dropout_add_backward(&dx, b, br.p, br.seed, br.offset).unwrap();
                        assert_eq!(bits(&db), bits(&of_dx), "{what} branch");
                    } else {
                        assert!(bits(&db).iter().all(|&v| f32::from_bits(v).is_nan()), "{what}");
                    }
                }
            }
        }
    }
}
