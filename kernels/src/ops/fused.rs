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
//! (autocast) the branch's f32 copy the unfused add needs is never made. The layer norm's
//! backward is not fused with the residual's: it stays
//! [`layer_norm_backward`](super::layer_norm_backward), then the residual's gradient is added.
//!
//! Each result is the unfused ops' bit for bit on the host (the sum `x + bias` rounded to
//! the dtype as `bias_add` stores it, the gradient rounded as `gelu_backward` stores it and
//! summed in `bias_add_backward`'s order; the dropped branch rounded as `dropout` stores it
//! before the add); the kernels follow the same steps (emulated in the tests; on a GPU within
//! the device's `tanhf` and contraction). The dropout kernels have never run on a GPU.

use super::dispatch::{Buffers, Op, OutputSpec, Plan, run};
use super::elementwise::param_dims;
use super::norm::{LayerNormOutput, param_chunks};
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
    /// op: bit for bit (the emulation's `tanhf` is the host's; no contraction).
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
