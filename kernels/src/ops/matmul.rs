//! Batched matrix products and the linear layer, forward and backward: the host's gemm
//! crate or cuBLAS (`cublasGemmEx` / `cublasGemmStridedBatchedEx`, f32 accumulation), which
//! runs in the device's cuBLAS workspace; a linear layer with a bias, a GELU or both
//! ([`linear_act`]) is one cuBLASLt call with those as its epilogue, and its weight
//! gradient's product sums the bias gradient too (falling back to cuBLAS and the crate's
//! kernels where cuBLASLt cannot).

use super::dispatch::{Buffers, Op, OutputSpec, Plan, run};
use super::{expect_rank, expect_shape, rows_cols, same_kind};
use crate::cpu::matmul as cpu;
use crate::device::Device;
use crate::dtype::{DType, Element, with_dtype};
use crate::error::{Error, Result};
use crate::params::MatmulSpec;
use crate::tensor::Tensor;

/// The product spec and output shape of `op(A) * op(B)` for stored shapes `a: [.., r, c]`
/// and `b: [.., r, c]` (see [`matmul`] for the layouts and broadcasting rules).
///
/// # Errors
///
/// As [`MatmulSpec::for_shapes`].
pub fn matmul_spec(
    a: &[usize],
    b: &[usize],
    trans_a: bool,
    trans_b: bool,
) -> Result<(MatmulSpec, Vec<usize>)> {
    MatmulSpec::for_shapes(a, b, trans_a, trans_b)
}

/// Whether a product of `spec` multiplies anything (cuBLAS runs only then).
fn multiplies(spec: &MatmulSpec) -> bool {
    spec.batch > 0 && spec.m > 0 && spec.n > 0 && spec.k > 0
}

/// Batched matrix product `op(a) * op(b)`.
///
/// `a` is stored `[.., m, k]`, or `[.., k, m]` with `trans_a`; `b` is stored `[.., k, n]`,
/// or `[.., n, k]` with `trans_b`; the result is `[.., m, n]`. The batch dimensions (all but
/// the last two) must be equal, or one operand must have rank 2 and is then used for every
/// batch (a weight shared by all rows, for instance).
///
/// # Errors
///
/// As [`matmul_spec`]; dtype and device mismatches; out of memory.
pub fn matmul(a: &Tensor, b: &Tensor, trans_a: bool, trans_b: bool) -> Result<Tensor> {
    let (spec, shape) = matmul_spec(a.shape(), b.shape(), trans_a, trans_b)?;
    run(Matmul { spec, shape, a, b })
}

struct Matmul<'a> {
    spec: MatmulSpec,
    shape: Vec<usize>,
    a: &'a Tensor,
    b: &'a Tensor,
}

impl Op for Matmul<'_> {
    const NAME: &'static str = "matmul";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.a.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        same_kind(Self::NAME, self.a, self.b)?;
        let mut plan = Plan::one(&self.shape, self.a.dtype());
        if multiplies(&self.spec) {
            plan.blas();
        }
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        with_dtype!(self.a.dtype(), T => cpu::matmul(
            &self.spec,
            self.a.as_slice::<T>()?,
            self.b.as_slice::<T>()?,
            bufs.out().out_slice::<T>(Self::NAME)?,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let t = self.a.dtype();
        let (a, b, c) = (self.a.cuda_ptr()?, self.b.cuda_ptr()?, bufs.out().cuda_ptr()?);
        // SAFETY: the spec was derived from the tensors' shapes, so a, b and c hold a_len(),
        // b_len() and c_len() elements of t; c is a fresh output and stride_c = m * n.
        unsafe { gpu.gemm(&self.spec, a, b, c, t, t) }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

/// Gradients `(da, db)` of [`matmul`] (same transpose flags) for the upstream `dc`; `da` and
/// `db` have the shapes of `a` and `b`. A broadcast operand receives the sum over batches.
///
/// # Errors
///
/// As [`matmul`], and [`Error::ShapeMismatch`] if `dc` is not the product's shape.
pub fn matmul_backward(
    a: &Tensor,
    b: &Tensor,
    dc: &Tensor,
    trans_a: bool,
    trans_b: bool,
) -> Result<(Tensor, Tensor)> {
    let (spec, shape) = matmul_spec(a.shape(), b.shape(), trans_a, trans_b)?;
    run(MatmulBackward { spec, shape, a, b, dc, acc: [None, None] })
}

struct MatmulBackward<'a> {
    spec: MatmulSpec,
    shape: Vec<usize>,
    a: &'a Tensor,
    b: &'a Tensor,
    dc: &'a Tensor,
    /// f32 accumulators for the gradient of a broadcast `a` and `b`.
    acc: [Option<usize>; 2],
}

impl Op for MatmulBackward<'_> {
    const NAME: &'static str = "matmul_backward";
    /// `da` and `db`.
    type Outs = [Tensor; 2];
    type Output = (Tensor, Tensor);

    fn device(&self) -> &Device {
        self.a.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        let (s, a, b, dc) = (self.spec, self.a, self.b, self.dc);
        same_kind(Self::NAME, a, b)?;
        same_kind(Self::NAME, a, dc)?;
        expect_shape(Self::NAME, &self.shape, dc)?;
        // With no product formed, nothing flows back.
        let zeroed = dc.numel() == 0;
        let mut plan = Plan::new([
            OutputSpec::zeroed_if(zeroed, a.shape(), a.dtype()),
            OutputSpec::zeroed_if(zeroed, b.shape(), b.dtype()),
        ]);
        if zeroed {
            return Ok(plan);
        }
        // A broadcast operand's gradient sums the batches in f32, rounded once: in place for
        // f32 operands, in an f32 buffer for 16-bit ones.
        let f32_acc = s.batch > 1 && a.dtype() != DType::F32;
        if f32_acc && s.stride_a == 0 {
            self.acc[0] = plan.zeroed_workspace(s.m * s.k * 4);
        }
        if f32_acc && s.stride_b == 0 {
            self.acc[1] = plan.zeroed_workspace(s.k * s.n * 4);
        }
        if s.k > 0 {
            plan.blas();
        }
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let [da, db] = bufs.outputs_mut();
        with_dtype!(self.a.dtype(), T => cpu::matmul_backward(
            &self.spec,
            self.a.as_slice::<T>()?,
            self.b.as_slice::<T>()?,
            self.dc.as_slice::<T>()?,
            Some(da.out_slice::<T>(Self::NAME)?),
            Some(db.out_slice::<T>(Self::NAME)?),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        if self.dc.numel() == 0 {
            return Ok(());
        }
        let s = self.spec;
        let (pa, pb, pc) = (self.a.cuda_ptr()?, self.b.cuda_ptr()?, self.dc.cuda_ptr()?);
        let acc = [bufs.ws(self.acc[0])?, bufs.ws(self.acc[1])?];
        let [da, db] = bufs.outputs_mut();
        // dA = dC * op(B)^T, or its transpose op(B) * dC^T (the host's formulation).
        let grad = if s.trans_a {
            MatmulSpec::new(s.k, s.m, s.n).transpose(s.trans_b, true)
        } else {
            MatmulSpec::new(s.m, s.k, s.n).transpose(false, !s.trans_b)
        };
        let operands = if s.trans_a {
            (pb, pc, s.stride_b, s.stride_c)
        } else {
            (pc, pb, s.stride_c, s.stride_b)
        };
        let out = (da, s.stride_a, acc[0]);
        cuda::grad_batches(gpu, &s, grad.scaled(s.alpha, 0.0), operands, out)?;
        // dB = op(A)^T * dC, or its transpose dC^T * op(A).
        let grad = if s.trans_b {
            MatmulSpec::new(s.n, s.k, s.m).transpose(true, s.trans_a)
        } else {
            MatmulSpec::new(s.k, s.n, s.m).transpose(!s.trans_a, false)
        };
        let operands = if s.trans_b {
            (pc, pa, s.stride_c, s.stride_a)
        } else {
            (pa, pc, s.stride_a, s.stride_c)
        };
        let out = (db, s.stride_b, acc[1]);
        cuda::grad_batches(gpu, &s, grad.scaled(s.alpha, 0.0), operands, out)
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<(Tensor, Tensor)> {
        let [da, db] = bufs.into_outputs();
        Ok((da, db))
    }
}

/// Checks a linear layer's operands; returns `(rows, d_in, d_out)`.
fn linear_dims(op: &'static str, x: &Tensor, w: &Tensor) -> Result<(usize, usize, usize)> {
    same_kind(op, x, w)?;
    expect_rank(op, w, 2, "weight [out_features, in_features]")?;
    let (rows, d_in) = rows_cols(op, x.shape())?;
    let (d_out, w_in) = (w.shape()[0], w.shape()[1]);
    if w_in != d_in {
        return Err(Error::ShapeMismatch { op, lhs: x.shape().to_vec(), rhs: w.shape().to_vec() });
    }
    Ok((rows, d_in, d_out))
}

/// [`linear_dims`] for a backward: also checks that `dy` is of `x`'s kind and of the
/// output's shape.
fn backward_dims(
    op: &'static str,
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
) -> Result<(usize, usize, usize)> {
    let (rows, d_in, d_out) = linear_dims(op, x, w)?;
    same_kind(op, x, dy)?;
    expect_shape(op, &with_last(x.shape(), d_out), dy)?;
    Ok((rows, d_in, d_out))
}

/// The output shape of a linear layer: `x`'s with the last dimension replaced by `d_out`.
fn with_last(shape: &[usize], last: usize) -> Vec<usize> {
    let mut out = shape.to_vec();
    if let Some(l) = out.last_mut() {
        *l = last;
    }
    out
}

/// A linear layer `y = x * w^T + bias`: `x: [.., in]`, `w: [out, in]`, `bias: [out]`,
/// `y: [.., out]`. On a GPU with a bias: one cuBLASLt call, the bias its epilogue (see
/// [`linear_act`]).
///
/// # Errors
///
/// [`Error::ShapeMismatch`] if `w` or `bias` does not fit `x`; dtype and device
/// mismatches; out of memory.
pub fn linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    Ok(linear_act(x, w, bias, None, false)?.y)
}

/// The activation [`linear_act`] fuses after a linear layer's product and bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinearActivation {
    /// GELU, tanh approximation ([`gelu`](super::gelu)'s, GPT-2's and cuBLASLt's).
    Gelu,
}

/// What [`linear_act`] returns.
#[derive(Debug)]
pub struct LinearActOutput {
    /// `act(x * w^T + bias)`.
    pub y: Tensor,
    /// The pre-activation `x * w^T + bias`, when asked for with an activation (what the
    /// activation's backward reads; [`linear_act_backward`]).
    pub pre: Option<Tensor>,
}

/// A linear layer and its activation in one call: `y = act(x * w^T + bias)` (shapes as
/// [`linear`]); with `keep_pre` and an activation, the pre-activation is returned too, for
/// backward. Without an activation it is [`linear`].
///
/// Host: [`linear`] then [`gelu`](super::gelu), bit for bit (the pre-activation is rounded
/// to the dtype, then activated). On a GPU, one cuBLASLt call (`cublasLtMatmul` with the
/// epilogue `GELU_AUX_BIAS`, or `GELU_BIAS` without `keep_pre`; `BIAS` without an
/// activation), f16/bf16 on tensor cores with f32 accumulation, f32 in FP32 unless
/// [`Device::allow_tf32_matmul`]; cuBLASLt activates the f32 sum before rounding it, so `y`
/// may differ from the host's by a rounding of the dtype. The kept pre-activation needs
/// `out % 8 == 0` (cuBLASLt's leading-dimension rule for it); otherwise, where cuBLASLt has
/// no algorithm, or where libcublasLt is absent ([`Device::linear_path`]), the unfused path
/// runs: cuBLAS with the bias broadcast into C, then the GELU kernel. Every path allocates the
/// same: `pre` (when kept), then `y`, then the cuBLAS workspace on first use, which cuBLASLt
/// shares (see [`crate::device`]). **The cuBLASLt path has not yet run on a GPU.**
///
/// # Errors
///
/// As [`linear`].
pub fn linear_act(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    act: Option<LinearActivation>,
    keep_pre: bool,
) -> Result<LinearActOutput> {
    run(Linear { x, w, bias, act, keep_pre: keep_pre && act.is_some(), dims: (0, 0, 0) })
}

/// The gradients of [`linear_act`] from the forward input `x`, the weight `w`, the kept
/// pre-activation `pre` (required with an activation) and the upstream `dy`; `dbias` when
/// `with_bias`. `pre` and `dy` are taken by value and dropped once the activation's
/// gradient is formed, before the product's gradients are allocated, so the peak is that of
/// the unfused ops run in sequence: [`gelu_backward`](super::gelu_backward), then
/// [`linear_backward`] (whose weight-gradient product sums the bias gradient in the same
/// cuBLASLt call on a GPU).
///
/// # Errors
///
/// As [`linear_backward`] (checked before anything is computed); [`Error::InvalidArgument`]
/// for an activation without `pre`; [`Error::ShapeMismatch`] for a `pre` not of `dy`'s
/// shape.
pub fn linear_act_backward(
    x: &Tensor,
    w: &Tensor,
    pre: Option<Tensor>,
    dy: Tensor,
    act: Option<LinearActivation>,
    with_bias: bool,
) -> Result<LinearGrads> {
    const OP: &str = "linear_act_backward";
    // Checked before anything runs, so that bad operands leave the caller's tensors as
    // they were (`pre` and `dy` are only consumed by a call that can succeed).
    let (_, _, d_out) = linear_dims(OP, x, w)?;
    same_kind(OP, x, &dy)?;
    expect_shape(OP, &with_last(x.shape(), d_out), &dy)?;
    let dz = match act {
        None => dy,
        Some(LinearActivation::Gelu) => {
            let pre = pre.ok_or_else(|| {
                super::invalid(OP, "GELU's gradient needs the kept pre-activation")
            })?;
            expect_shape(OP, dy.shape(), &pre)?;
            let dz = super::gelu_backward(&pre, &dy)?;
            drop((pre, dy));
            dz
        }
    };
    linear_backward(x, w, &dz, with_bias)
}

struct Linear<'a> {
    x: &'a Tensor,
    w: &'a Tensor,
    bias: Option<&'a Tensor>,
    act: Option<LinearActivation>,
    keep_pre: bool,
    /// `(rows, d_in, d_out)`.
    dims: (usize, usize, usize),
}

impl Op for Linear<'_> {
    const NAME: &'static str = "linear";
    /// The kept pre-activation and `y`.
    type Outs = (Option<Tensor>, Tensor);
    type Output = LinearActOutput;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        let (rows, d_in, d_out) = linear_dims(Self::NAME, self.x, self.w)?;
        self.dims = (rows, d_in, d_out);
        if let Some(bias) = self.bias {
            same_kind(Self::NAME, self.x, bias)?;
            expect_shape(Self::NAME, &[d_out], bias)?;
        }
        let (shape, dtype) = (with_last(self.x.shape(), d_out), self.x.dtype());
        let mut plan = Plan::new((
            self.keep_pre.then(|| OutputSpec::new(&shape, dtype)),
            OutputSpec::new(&shape, dtype),
        ));
        if rows > 0 && d_in > 0 && d_out > 0 {
            plan.blas();
        }
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let (_, d_in, d_out) = self.dims;
        let (pre, y) = bufs.outputs_mut();
        with_dtype!(self.x.dtype(), T => {
            let (x, w) = (self.x.as_slice::<T>()?, self.w.as_slice::<T>()?);
            let bias = self.bias.map(|b| b.as_slice::<T>()).transpose()?;
            let y = y.out_slice::<T>(Self::NAME)?;
            match (self.act, pre) {
                (None, _) => cpu::linear(x, w, bias, y, d_in, d_out),
                (Some(LinearActivation::Gelu), Some(pre)) => {
                    let pre = pre.out_slice::<T>(Self::NAME)?;
                    cpu::linear(x, w, bias, pre, d_in, d_out)?;
                    crate::cpu::activation::gelu(pre, y)
                }
                (Some(LinearActivation::Gelu), None) => {
                    // Host scratch: the GPU's epilogue keeps it in registers.
                    let mut pre = vec![T::default(); y.len()];
                    cpu::linear(x, w, bias, &mut pre, d_in, d_out)?;
                    crate::cpu::activation::gelu(&pre, y)
                }
            }
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::blaslt::{Epilogue, LtGemm};
        let (rows, d_in, d_out) = self.dims;
        let t = self.x.dtype();
        let (pre, y) = bufs.outputs_mut();
        let bias = self.bias.map(Tensor::cuda_ptr).transpose()?;
        let aux = pre.as_ref().map(Tensor::cuda_ptr).transpose()?;
        let epilogue = match self.act {
            None => bias.map(|bias| Epilogue::Bias { bias }),
            // The kept pre-activation's leading dimension must be a multiple of 8.
            Some(LinearActivation::Gelu) if aux.is_some() && !d_out.is_multiple_of(8) => None,
            Some(LinearActivation::Gelu) => {
                Some(Epilogue::Gelu { bias: bias.unwrap_or(0), aux: aux.unwrap_or(0) })
            }
        };
        if let Some(epilogue) = epilogue {
            // Column-major: y^T (out x rows) = w^T stored (in x out, transposed) * x^T
            // stored (in x rows); the bias runs along y^T's rows.
            let g = LtGemm {
                m: d_out,
                n: rows,
                k: d_in,
                a: self.w.cuda_ptr()?,
                lda: d_in,
                trans_a: true,
                b: self.x.cuda_ptr()?,
                ldb: d_in,
                trans_b: false,
                d: y.cuda_ptr()?,
                ldd: d_out,
                dtype: t,
                epilogue,
            };
            // SAFETY: w is [out, in], x [rows, in], y (and the kept pre) [rows, out], the
            // bias [out] (checked in `plan`); y is a fresh output.
            if unsafe { gpu.lt_matmul(&g)? } {
                return Ok(());
            }
        }
        let at = cuda::LinearAddresses {
            x: self.x.cuda_ptr()?,
            w: self.w.cuda_ptr()?,
            bias,
            pre: aux,
            y: y.cuda_ptr()?,
        };
        // SAFETY: as above; the pre-activation, when kept, is a fresh output of y's size.
        unsafe { cuda::unfused(gpu, &at, self.dims, t, self.act.is_some()) }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<LinearActOutput> {
        let (pre, y) = bufs.into_outputs();
        Ok(LinearActOutput { y, pre })
    }
}

/// Gradients of a linear layer.
#[derive(Debug)]
pub struct LinearGrads {
    /// Gradient of the input, `x`'s shape.
    pub dx: Tensor,
    /// Gradient of the weight, `[out, in]`.
    pub dw: Tensor,
    /// Gradient of the bias, `[out]`, when asked for.
    pub dbias: Option<Tensor>,
}

/// Gradients of [`linear`] from the forward input `x`, the weight `w` and the upstream
/// `dy: [.., out]`; `dbias` is computed when `with_bias`.
///
/// # Errors
///
/// As [`linear`], and [`Error::ShapeMismatch`] if `dy` is not the output's shape.
pub fn linear_backward(
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    with_bias: bool,
) -> Result<LinearGrads> {
    run(LinearBackward { x, w, dy, with_bias, dims: (0, 0, 0), acc: None })
}

struct LinearBackward<'a> {
    x: &'a Tensor,
    w: &'a Tensor,
    dy: &'a Tensor,
    with_bias: bool,
    /// `(rows, d_in, d_out)`.
    dims: (usize, usize, usize),
    /// The f32 column sums of dy (the bias gradient).
    acc: Option<usize>,
}

impl Op for LinearBackward<'_> {
    const NAME: &'static str = "linear_backward";
    /// `dx`, `dw` and, when asked for, `dbias`.
    type Outs = (Tensor, Tensor, Option<Tensor>);
    type Output = LinearGrads;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        let (x, w, dy) = (self.x, self.w, self.dy);
        let (rows, d_in, d_out) = backward_dims(Self::NAME, x, w, dy)?;
        self.dims = (rows, d_in, d_out);
        let dtype = x.dtype();
        // With no upstream element, nothing flows back.
        let zeroed = dy.numel() == 0;
        let mut plan = Plan::new((
            OutputSpec::zeroed_if(zeroed, x.shape(), dtype),
            OutputSpec::zeroed_if(zeroed, w.shape(), dtype),
            self.with_bias.then(|| OutputSpec::zeroed_if(zeroed, &[d_out], dtype)),
        ));
        if zeroed {
            return Ok(plan);
        }
        if self.with_bias {
            self.acc =
                plan.workspace(super::reduce::column_sum_workspace(Self::NAME, rows, d_out)?);
        }
        if d_in > 0 {
            plan.blas();
        }
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        if self.dy.numel() == 0 {
            return Ok(());
        }
        let (_, d_in, d_out) = self.dims;
        let (dx, dw, dbias) = bufs.outputs_mut();
        with_dtype!(self.x.dtype(), T => cpu::linear_backward(
            self.x.as_slice::<T>()?,
            self.w.as_slice::<T>()?,
            self.dy.as_slice::<T>()?,
            Some(dx.out_slice::<T>(Self::NAME)?),
            Some(dw.out_slice::<T>(Self::NAME)?),
            dbias.as_mut().map(|d| d.out_slice::<T>(Self::NAME)).transpose()?,
            d_in,
            d_out,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        if self.dy.numel() == 0 {
            return Ok(());
        }
        let (rows, d_in, d_out) = self.dims;
        let t = self.x.dtype();
        let (px, pw, pdy) = (self.x.cuda_ptr()?, self.w.cuda_ptr()?, self.dy.cuda_ptr()?);
        // The bias gradient's workspace (0 without a bias), before the outputs are borrowed.
        let acc = bufs.ws(self.acc)?;
        let (dx, dw, dbias) = bufs.outputs_mut();
        let dx = dx.cuda_ptr()?;
        // SAFETY: dy [rows, d_out] * w [d_out, d_in] -> dx [rows, d_in].
        unsafe { gpu.gemm(&MatmulSpec::new(rows, d_in, d_out), pdy, pw, dx, t, t)? };
        // SAFETY: x [rows, d_in], dy [rows, d_out], dw [d_out, d_in], dbias [d_out], the
        // workspace the column sums' (checked and planned in `plan`).
        unsafe { cuda::weight_grads(gpu, (px, pdy), dw, dbias.as_mut(), acc, self.dims, t) }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<LinearGrads> {
        let (dx, dw, dbias) = bufs.into_outputs();
        Ok(LinearGrads { dx, dw, dbias })
    }
}

/// The gradients of [`linear_backward_gelu`].
#[derive(Debug)]
pub struct GeluLinearGrads {
    /// Of the GELU's input `pre` (`x`'s shape): `(dy w) * gelu'(pre)`.
    pub dpre: Tensor,
    /// Of this layer's weight, `[out, in]`.
    pub dw: Tensor,
    /// Of this layer's bias, `[out]`, when asked for.
    pub dbias: Option<Tensor>,
    /// The column sums of `dpre`, `[in]`: the bias gradient of the layer that produced
    /// `pre` (an MLP's first linear layer).
    pub dpre_bias: Tensor,
}

/// The backward of a linear layer whose input was `x = gelu(pre)` (an MLP's second layer),
/// through the GELU: [`linear_backward`]'s weight and bias gradients, and instead of `dx`
/// the gradient of `pre` with its column sums (the first layer's bias gradient). `x` is
/// the forward input `gelu(pre)`, `w` the weight, `dy` the upstream gradient.
///
/// Host: `linear_backward`, [`gelu_backward`](super::gelu_backward) of its `dx`, then the
/// column sums `linear_backward` forms for a bias, bit for bit. On a GPU the input
/// gradient's product is one cuBLASLt call with the `DGELU_BGRAD` epilogue (GELU's
/// derivative and the column sums applied to the f32 product before rounding), so `dx`
/// never exists: the unfused ops hold `dx` and `dpre` at once. Needs `in % 8 == 0`
/// (cuBLASLt's leading-dimension rule for `pre`); otherwise, or where cuBLASLt has no
/// algorithm, cuBLAS writes `dx` into `dpre`'s buffer and the GELU backward kernel updates
/// it in place. **The cuBLASLt path has not yet run on a GPU.**
///
/// # Errors
///
/// As [`linear_backward`]; [`Error::ShapeMismatch`] for a `pre` not of `x`'s shape.
pub fn linear_backward_gelu(
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    with_bias: bool,
    pre: &Tensor,
) -> Result<GeluLinearGrads> {
    run(LinearBackwardGelu { x, w, dy, pre, with_bias, dims: (0, 0, 0), acc: [None, None] })
}

struct LinearBackwardGelu<'a> {
    x: &'a Tensor,
    w: &'a Tensor,
    dy: &'a Tensor,
    pre: &'a Tensor,
    with_bias: bool,
    /// `(rows, d_in, d_out)`.
    dims: (usize, usize, usize),
    /// The column sums' workspaces: of dy (the bias gradient) and of dpre.
    acc: [Option<usize>; 2],
}

impl Op for LinearBackwardGelu<'_> {
    const NAME: &'static str = "linear_backward_gelu";
    /// `[dpre, dw]`, `dbias` when asked for, `dpre_bias`.
    type Outs = ([Tensor; 2], Option<Tensor>, Tensor);
    type Output = GeluLinearGrads;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        let (x, w, dy) = (self.x, self.w, self.dy);
        let (rows, d_in, d_out) = backward_dims(Self::NAME, x, w, dy)?;
        self.dims = (rows, d_in, d_out);
        same_kind(Self::NAME, x, self.pre)?;
        expect_shape(Self::NAME, x.shape(), self.pre)?;
        let dtype = x.dtype();
        let zeroed = dy.numel() == 0;
        let mut plan = Plan::new((
            [
                OutputSpec::zeroed_if(zeroed, x.shape(), dtype),
                OutputSpec::zeroed_if(zeroed, w.shape(), dtype),
            ],
            self.with_bias.then(|| OutputSpec::zeroed_if(zeroed, &[d_out], dtype)),
            OutputSpec::zeroed_if(zeroed, &[d_in], dtype),
        ));
        if zeroed {
            return Ok(plan);
        }
        // The fallback's column sums (planned on every path, so every backend allocates
        // the same; cuBLASLt's epilogues do not touch them).
        if self.with_bias {
            self.acc[0] =
                plan.workspace(super::reduce::column_sum_workspace(Self::NAME, rows, d_out)?);
        }
        self.acc[1] = plan.workspace(super::reduce::column_sum_workspace(Self::NAME, rows, d_in)?);
        if d_in > 0 {
            plan.blas();
        }
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        if self.dy.numel() == 0 {
            return Ok(());
        }
        let (_, d_in, d_out) = self.dims;
        let ([dpre, dw], dbias, dpre_bias) = bufs.outputs_mut();
        with_dtype!(self.x.dtype(), T => {
            let mut dx = vec![T::default(); self.x.numel()];
            cpu::linear_backward(
                self.x.as_slice::<T>()?,
                self.w.as_slice::<T>()?,
                self.dy.as_slice::<T>()?,
                Some(&mut dx),
                Some(dw.out_slice::<T>(Self::NAME)?),
                dbias.as_mut().map(|d| d.out_slice::<T>(Self::NAME)).transpose()?,
                d_in,
                d_out,
            )?;
            let dpre = dpre.out_slice::<T>(Self::NAME)?;
            crate::cpu::activation::gelu_backward(self.pre.as_slice::<T>()?, &dx, dpre)?;
            // `linear_backward`'s bias gradient, in its order: f32 sums row by row.
            let mut sum = vec![0.0f32; d_in];
            if d_in > 0 {
                for row in dpre.chunks_exact(d_in) {
                    for (s, g) in sum.iter_mut().zip(row) {
                        *s += g.to_f32();
                    }
                }
            }
            for (d, s) in dpre_bias.out_slice::<T>(Self::NAME)?.iter_mut().zip(sum) {
                *d = T::from_f32(s);
            }
            Ok(())
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::blaslt::{Epilogue, LtGemm};
        if self.dy.numel() == 0 {
            return Ok(());
        }
        let (rows, d_in, d_out) = self.dims;
        let t = self.x.dtype();
        let (px, pw, pdy) = (self.x.cuda_ptr()?, self.w.cuda_ptr()?, self.dy.cuda_ptr()?);
        let ppre = self.pre.cuda_ptr()?;
        let acc = [bufs.ws(self.acc[0])?, bufs.ws(self.acc[1])?];
        let ([dpre, dw], dbias, dpre_bias) = bufs.outputs_mut();
        let pdpre = dpre.cuda_ptr()?;
        // Column-major: dpre^T (in x rows) = w stored (in x out) * dy^T stored (out x rows),
        // times gelu'(pre^T) elementwise; the bias gradient sums along dpre^T's rows.
        let g = LtGemm {
            m: d_in,
            n: rows,
            k: d_out,
            a: pw,
            lda: d_in,
            trans_a: false,
            b: pdy,
            ldb: d_out,
            trans_b: false,
            d: pdpre,
            ldd: d_in,
            dtype: t,
            epilogue: Epilogue::DgeluBgrad { aux: ppre, bias_grad: dpre_bias.cuda_ptr()? },
        };
        // SAFETY: w [d_out, d_in], dy [rows, d_out], pre and dpre [rows, d_in], dpre_bias
        // [d_in] (checked in `plan`); dpre and dpre_bias are fresh outputs.
        let fused = d_in.is_multiple_of(8) && unsafe { gpu.lt_matmul(&g)? };
        if !fused {
            // SAFETY: dy [rows, d_out] * w [d_out, d_in] -> dpre [rows, d_in].
            unsafe { gpu.gemm(&MatmulSpec::new(rows, d_in, d_out), pdy, pw, pdpre, t, t)? };
            cuda::gelu_backward_in_place(gpu, ppre, dpre)?;
            crate::cuda::helpers::column_sums(gpu, pdpre, t, rows, acc[1], dpre_bias)?;
        }
        // SAFETY: x [rows, d_in], dy [rows, d_out], dw [d_out, d_in], dbias [d_out], the
        // workspace the column sums' (checked and planned in `plan`).
        unsafe { cuda::weight_grads(gpu, (px, pdy), dw, dbias.as_mut(), acc[0], self.dims, t) }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<GeluLinearGrads> {
        let ([dpre, dw], dbias, dpre_bias) = bufs.into_outputs();
        Ok(GeluLinearGrads { dpre, dw, dbias, dpre_bias })
    }
}

/// The CUDA side of the gradients and the bias broadcast.
#[cfg(feature = "cuda")]
mod cuda {
    use crate::cuda::helpers::from_f32;
    use crate::cuda::launch::elementwise as grid;
    use crate::cuda::registry::BIAS_FILL;
    use crate::cuda::{Arg, Exec, Gpu};
    use crate::dtype::DType;
    use crate::error::Result;
    use crate::ops::MatmulSpec;
    use crate::tensor::Tensor;

    /// One gradient product of a matmul's backward, as the host's `grad_batches`: batched
    /// into `out` when the operand has its own matrix per batch, summed over batches when it
    /// was broadcast: in `out` itself for f32 (the first batch's product with beta = 0;
    /// `acc` unused), in the zeroed f32 accumulator `acc` for 16-bit types, rounded once.
    pub(super) fn grad_batches(
        gpu: &Gpu<'_>,
        spec: &MatmulSpec,
        grad: MatmulSpec,
        (lhs, rhs, lhs_stride, rhs_stride): (u64, u64, usize, usize),
        (out, out_stride, acc): (&mut Tensor, usize, u64),
    ) -> Result<()> {
        let t = out.dtype();
        let size = t.size_in_bytes();
        if out_stride != 0 || spec.batch <= 1 {
            let g = grad.batched(spec.batch, lhs_stride, rhs_stride, out_stride);
            // SAFETY: lhs, rhs and out are the forward operands, dc and the gradient, whose
            // layouts the forward spec describes; `g` addresses exactly those ranges.
            return unsafe { gpu.gemm(&g, lhs, rhs, out.cuda_ptr()?, t, t) };
        }
        let in_place = t == DType::F32;
        let acc = if in_place { out.cuda_ptr()? } else { acc };
        for i in 0..spec.batch {
            let beta = if in_place && i == 0 { 0.0 } else { 1.0 };
            let g = grad.scaled(grad.alpha, beta);
            // SAFETY: batch i's matrices start i strides in; acc holds the m * n f32 sum
            // (out's f32 elements when in place; with beta = 0 they are not read).
            unsafe {
                gpu.gemm(
                    &g,
                    lhs + (i * lhs_stride * size) as u64,
                    rhs + (i * rhs_stride * size) as u64,
                    acc,
                    t,
                    DType::F32,
                )?;
            }
        }
        if in_place { Ok(()) } else { from_f32(gpu, acc, out) }
    }

    /// `dx = gelu'(pre) * dx` over `dx`'s elements, in place (a plain map: each element
    /// is read before the same thread writes it); `pre` the address of as many.
    pub(super) fn gelu_backward_in_place(gpu: &Gpu<'_>, pre: u64, dx: &mut Tensor) -> Result<()> {
        use crate::cuda::registry::GELU;
        let n = dx.numel();
        let p = dx.cuda_ptr()?;
        // SAFETY: gelu_bwd_T(const T* x, const T* dy, T* dx, u64 n), a plain map; pre and dx
        // hold n elements.
        unsafe {
            gpu.launch(
                GELU.backward.of(dx.dtype()),
                crate::cuda::launch::map(n, dx.dtype().size_in_bytes()),
                &[Arg::Ptr(pre), Arg::Ptr(p), Arg::Ptr(p), Arg::count(n)],
            )
        }
    }

    /// The weight gradient `dw = dy^T x` and, with `dbias`, the bias gradient (dy's column
    /// sums): one cuBLASLt call with the `BGRADB` epilogue where it runs, else cuBLAS and
    /// the column-sum kernels in the workspace `acc`.
    ///
    /// # Safety
    ///
    /// `x` holds `[rows, d_in]`, `dy` `[rows, d_out]` of `t`; `dw` is `[d_out, d_in]`,
    /// `dbias` `[d_out]`; `acc` the column sums' workspace when `dbias` is asked for.
    pub(super) unsafe fn weight_grads(
        gpu: &Gpu<'_>,
        (px, pdy): (u64, u64),
        dw: &mut Tensor,
        dbias: Option<&mut Tensor>,
        acc: u64,
        (rows, d_in, d_out): (usize, usize, usize),
        t: DType,
    ) -> Result<()> {
        use crate::cuda::blaslt::{Epilogue, LtGemm};
        let dw = dw.cuda_ptr()?;
        if let Some(dbias) = dbias.as_ref() {
            // Column-major: dw^T (in x out) = x^T stored (in x rows) * dy stored (out x rows,
            // transposed); BGRADB sums B = dy over the product's k = rows: the bias gradient
            // in the same call (Transformer Engine's weight-gradient GEMM).
            let g = LtGemm {
                m: d_in,
                n: d_out,
                k: rows,
                a: px,
                lda: d_in,
                trans_a: false,
                b: pdy,
                ldb: d_out,
                trans_b: true,
                d: dw,
                ldd: d_in,
                dtype: t,
                epilogue: Epilogue::BgradB { bias_grad: dbias.cuda_ptr()? },
            };
            // SAFETY: the caller's contract; dw and dbias are fresh outputs.
            if unsafe { gpu.lt_matmul(&g)? } {
                return Ok(());
            }
        }
        let spec = MatmulSpec::new(d_out, d_in, rows).transpose(true, false);
        // SAFETY: dy^T ([rows, d_out] stored) * x [rows, d_in] -> dw [d_out, d_in].
        unsafe { gpu.gemm(&spec, pdy, px, dw, t, t)? };
        if let Some(dbias) = dbias {
            crate::cuda::helpers::column_sums(gpu, pdy, t, rows, acc, dbias)?;
        }
        Ok(())
    }

    /// The device addresses of a linear layer's unfused path ([`unfused`]).
    pub(crate) struct LinearAddresses {
        /// `[rows, d_in]`.
        pub(crate) x: u64,
        /// `[d_out, d_in]`.
        pub(crate) w: u64,
        /// `[d_out]`, if any.
        pub(crate) bias: Option<u64>,
        /// `[rows, d_out]`, the kept pre-activation, if any.
        pub(crate) pre: Option<u64>,
        /// `[rows, d_out]`.
        pub(crate) y: u64,
    }

    /// A linear layer without cuBLASLt: the product (the bias broadcast into C first,
    /// beta = 1, so each output is rounded once) into the pre-activation (kept, or y
    /// itself), then with `gelu` the GELU kernel into y (in place when nothing is kept: a
    /// plain map reads each element before the same thread writes it). Written against
    /// [`Exec`] so that the tests run it in the emulation.
    ///
    /// # Safety
    ///
    /// The addresses hold what [`LinearAddresses`] says for `(rows, d_in, d_out)`, of
    /// `dtype`; y and the pre-activation alias no input or each other.
    pub(crate) unsafe fn unfused(
        gpu: &impl Exec,
        at: &LinearAddresses,
        (rows, d_in, d_out): (usize, usize, usize),
        dtype: DType,
        gelu: bool,
    ) -> Result<()> {
        use crate::cuda::launch::map;
        use crate::cuda::registry::GELU;
        let z = at.pre.unwrap_or(at.y);
        let n = rows * d_out;
        let beta = match at.bias {
            Some(bias) if n > 0 => {
                // SAFETY: bias_fill_T(const T* b, T* y, u64 n, Div d); z holds n elements,
                // a multiple of d_out > 0; the bias d_out.
                unsafe {
                    gpu.launch(
                        BIAS_FILL.of(dtype),
                        grid(n),
                        &[Arg::Ptr(bias), Arg::Ptr(z), Arg::count(n), Arg::div(d_out)],
                    )?;
                }
                1.0
            }
            _ => 0.0,
        };
        let spec = MatmulSpec::new(rows, d_out, d_in).transpose(false, true).scaled(1.0, beta);
        // SAFETY: x is [rows, d_in], w [d_out, d_in], z [rows, d_out] (the contract).
        unsafe { gpu.gemm(&spec, at.x, at.w, z, dtype, dtype)? };
        if !gelu {
            return Ok(());
        }
        // SAFETY: gelu_T(const T* x, T* y, u64 n), a plain map over n elements of z and y.
        unsafe {
            gpu.launch(
                GELU.forward.of(dtype),
                map(n, dtype.size_in_bytes()),
                &[Arg::Ptr(z), Arg::Ptr(at.y), Arg::count(n)],
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops;
    use proptest::prelude::*;

    const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

    fn values(n: usize, seed: u64) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u64 * 2_654_435_761 + seed * 97) % 2001) as f32 / 500.0) - 2.0)
            .collect()
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.to_f32_vec().unwrap().iter().map(|v| v.to_bits()).collect()
    }

    fn tensor(dev: &Device, shape: &[usize], dtype: DType, seed: u64) -> Tensor {
        let n = shape.iter().product();
        Tensor::from_f32_slice(dev, shape, &values(n, seed), dtype).unwrap()
    }

    /// `linear_act` forward and backward against the unfused ops on the host, bit for bit:
    /// `linear` then `gelu` (the pre-activation is `linear`'s output), `gelu_backward` then
    /// `linear_backward`.
    fn check_against_unfused(
        dtype: DType,
        lead: &[usize],
        d_in: usize,
        d_out: usize,
        with_bias: bool,
        act: Option<LinearActivation>,
    ) {
        let dev = Device::host(64 << 20);
        let x_shape: Vec<usize> = lead.iter().copied().chain([d_in]).collect();
        let y_shape: Vec<usize> = lead.iter().copied().chain([d_out]).collect();
        let x = tensor(&dev, &x_shape, dtype, 1);
        let w = tensor(&dev, &[d_out, d_in], dtype, 2);
        let b = with_bias.then(|| tensor(&dev, &[d_out], dtype, 3));
        let dy = tensor(&dev, &y_shape, dtype, 4);
        let what = format!("{dtype:?} {x_shape:?} -> {d_out} bias {with_bias} {act:?}");
        let z = linear(&x, &w, b.as_ref()).unwrap();
        let want_y = match act {
            Some(LinearActivation::Gelu) => ops::gelu(&z).unwrap(),
            None => z.clone(),
        };
        let kept = linear_act(&x, &w, b.as_ref(), act, true).unwrap();
        assert_eq!(kept.y.shape(), &y_shape[..], "{what}");
        assert_eq!(bits(&kept.y), bits(&want_y), "{what}: y");
        assert_eq!(kept.pre.is_some(), act.is_some(), "{what}: pre kept with an activation");
        if let Some(pre) = &kept.pre {
            assert_eq!(bits(pre), bits(&z), "{what}: pre");
        }
        let eval = linear_act(&x, &w, b.as_ref(), act, false).unwrap();
        assert!(eval.pre.is_none(), "{what}: nothing kept");
        assert_eq!(bits(&eval.y), bits(&want_y), "{what}: y without keeping");

        let dz = match act {
            Some(LinearActivation::Gelu) => ops::gelu_backward(&z, &dy).unwrap(),
            None => dy.clone(),
        };
        let want = linear_backward(&x, &w, &dz, with_bias).unwrap();
        let got = linear_act_backward(&x, &w, kept.pre, dy, act, with_bias).unwrap();
        assert_eq!(bits(&got.dx), bits(&want.dx), "{what}: dx");
        assert_eq!(bits(&got.dw), bits(&want.dw), "{what}: dw");
        assert_eq!(got.dbias.is_some(), with_bias, "{what}: dbias");
        if let (Some(g), Some(w)) = (&got.dbias, &want.dbias) {
            assert_eq!(bits(g), bits(w), "{what}: dbias");
        }
    }

    #[test]
    fn linear_act_is_linear_then_gelu_in_every_dtype() {
        for dtype in DTYPES {
            for (lead, d_in, d_out) in [(&[7][..], 5, 3), (&[2, 65][..], 33, 17), (&[0][..], 4, 8)]
            {
                for with_bias in [true, false] {
                    for act in [Some(LinearActivation::Gelu), None] {
                        check_against_unfused(dtype, lead, d_in, d_out, with_bias, act);
                    }
                }
            }
            // No input features: y = act(bias), and the gradients of w are empty.
            check_against_unfused(dtype, &[3], 0, 5, true, Some(LinearActivation::Gelu));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Odd and even sizes, with and without a bias, in every dtype.
        #[test]
        fn linear_act_matches_the_unfused_ops(
            dtype in 0usize..3,
            rows in 1usize..12,
            d_in in 1usize..21,
            d_out in 1usize..21,
            with_bias: bool,
            gelu: bool,
        ) {
            let act = gelu.then_some(LinearActivation::Gelu);
            check_against_unfused(DTYPES[dtype], &[rows], d_in, d_out, with_bias, act);
        }
    }

    #[test]
    fn linear_act_refuses_bad_operands() {
        let dev = Device::host(64 << 20);
        let gelu = Some(LinearActivation::Gelu);
        let x = tensor(&dev, &[4, 3], DType::F32, 1);
        let w = tensor(&dev, &[5, 3], DType::F32, 2);
        let b = tensor(&dev, &[5], DType::F32, 3);
        let shape = |r: Result<LinearActOutput>| {
            matches!(r.map(|o| o.y), Err(Error::ShapeMismatch { op: "linear", .. }))
        };
        // The weight's input features, the bias's length.
        assert!(shape(linear_act(&x, &tensor(&dev, &[5, 4], DType::F32, 2), Some(&b), gelu, true)));
        assert!(shape(linear_act(&x, &w, Some(&tensor(&dev, &[4], DType::F32, 3)), gelu, true)));
        assert!(shape(linear_act(&x, &w, Some(&tensor(&dev, &[1, 5], DType::F32, 3)), None, true)));
        // A weight of another rank, a scalar input, another dtype.
        assert!(linear_act(&x, &tensor(&dev, &[15], DType::F32, 2), None, gelu, true).is_err());
        let scalar = Tensor::from_f32_slice(&dev, &[], &[1.0], DType::F32).unwrap();
        assert!(linear_act(&scalar, &w, None, gelu, true).is_err());
        let b16 = tensor(&dev, &[5], DType::BF16, 3);
        assert!(linear_act(&x, &w, Some(&b16), gelu, true).is_err());
        // Backward: GELU without its pre-activation, a pre-activation or dy of another shape.
        let dy = tensor(&dev, &[4, 5], DType::F32, 4);
        let e = linear_act_backward(&x, &w, None, dy.clone(), gelu, true).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { op: "linear_act_backward", .. }), "{e}");
        let pre = tensor(&dev, &[4, 6], DType::F32, 5);
        assert!(linear_act_backward(&x, &w, Some(pre), dy.clone(), gelu, true).is_err());
        let dy6 = tensor(&dev, &[4, 6], DType::F32, 4);
        let e = linear_act_backward(&x, &w, None, dy6, None, true).unwrap_err();
        assert!(matches!(e, Error::ShapeMismatch { op: "linear_act_backward", .. }), "{e}");
        let dy16 = tensor(&dev, &[4, 5], DType::BF16, 4);
        assert!(linear_act_backward(&x, &w, None, dy16, None, true).is_err());
    }

    /// Every backend makes the requests of the unfused ops `linear` then `gelu`: the
    /// pre-activation, then `y`; without keeping it, `y` only. The host and a virtual
    /// device (the GPU's plan) agree.
    #[test]
    fn linear_act_allocates_what_the_unfused_ops_did() {
        let (rows, d_in, d_out) = (6, 32, 48);
        let gelu = Some(LinearActivation::Gelu);
        let mut traces = Vec::new();
        for dev in [Device::host(64 << 20), Device::virtual_device(64 << 20)] {
            dev.set_blas_workspace_size(1 << 20);
            dev.prepare_blas_workspace().unwrap();
            let x = Tensor::zeros(&dev, &[rows, d_in], DType::BF16).unwrap();
            let w = Tensor::zeros(&dev, &[d_out, d_in], DType::BF16).unwrap();
            let b = Tensor::zeros(&dev, &[d_out], DType::BF16).unwrap();
            let requests = |f: &dyn Fn()| {
                dev.record_history(Some(100));
                f();
                let t = dev.trace();
                dev.record_history(None);
                t.iter()
                    .filter(|e| e.action == vram_alloc::TraceAction::Alloc)
                    .map(|e| e.requested)
                    .collect::<Vec<_>>()
            };
            let unfused = requests(&|| {
                let z = linear(&x, &w, Some(&b)).unwrap();
                drop(ops::gelu(&z).unwrap());
            });
            let fused = requests(&|| drop(linear_act(&x, &w, Some(&b), gelu, true).unwrap()));
            let eval = requests(&|| drop(linear_act(&x, &w, Some(&b), gelu, false).unwrap()));
            let y = rows * d_out * 2;
            assert_eq!(unfused, [y, y]);
            assert_eq!(fused, unfused);
            assert_eq!(eval, [y]);
            traces.push((fused, eval));
        }
        assert_eq!(traces[0], traces[1]);
    }

    /// TF32 for f32 matmuls is off by default (PyTorch's `allow_tf32`), and the switch is
    /// the device's, shared by its clones; the host computes in FP32 either way.
    #[test]
    fn tf32_matmul_is_off_by_default_and_per_device() {
        let dev = Device::host(64 << 20);
        let other = Device::host(64 << 20);
        assert!(!dev.allow_tf32_matmul());
        let x = tensor(&dev, &[5, 33], DType::F32, 1);
        let w = tensor(&dev, &[7, 33], DType::F32, 2);
        let fp32 = linear(&x, &w, None).unwrap();
        dev.clone().set_allow_tf32_matmul(true);
        assert!(dev.allow_tf32_matmul() && !other.allow_tf32_matmul());
        assert_eq!(bits(&linear(&x, &w, None).unwrap()), bits(&fp32), "host: FP32 always");
        dev.set_allow_tf32_matmul(false);
        assert!(!dev.allow_tf32_matmul());
    }

    #[test]
    fn devices_report_their_linear_path() {
        use crate::device::LinearPath;
        assert_eq!(Device::host(1 << 20).linear_path(), LinearPath::Host);
        assert_eq!(Device::virtual_device(1 << 20).linear_path(), LinearPath::Virtual);
        assert_eq!(Device::host(1 << 20).cublaslt_fallbacks(), 0);
    }

    /// Out of memory at `y` (the pre-activation fitted): an error, the pre-activation given
    /// back, the inputs intact.
    #[test]
    fn linear_act_out_of_memory_leaves_everything_as_it_was() {
        // 20 MiB of device memory: the operands (a 2 MiB small-pool segment) and one 12 MiB
        // output fit, not two.
        let dev = Device::host(20 << 20);
        let (rows, d_in, d_out) = (1536, 8, 2048);
        let x = tensor(&dev, &[rows, d_in], DType::F32, 1);
        let w = tensor(&dev, &[d_out, d_in], DType::F32, 2);
        let (xv, wv) = (bits(&x), bits(&w));
        let before = dev.memory_stats().allocated_bytes.all.current;
        let gelu = Some(LinearActivation::Gelu);
        let e = linear_act(&x, &w, None, gelu, true).unwrap_err();
        assert!(e.is_out_of_memory(), "{e}");
        assert_eq!(dev.memory_stats().allocated_bytes.all.current, before);
        assert_eq!((bits(&x), bits(&w)), (xv, wv));
        // Without keeping the pre-activation, y alone fits.
        assert!(linear_act(&x, &w, None, gelu, false).is_ok());
    }

    /// The unfused CUDA path (the fallback where cuBLASLt cannot run a product), emulated on
    /// the host through the op's own launch code: the bias broadcast, the product with
    /// beta = 1 into the kept pre-activation or y, then GELU (in place without a kept
    /// pre-activation). Within rounding of the host (the emulated product sums in f64).
    #[cfg(feature = "cuda")]
    #[test]
    fn the_unfused_cuda_path_matches_the_host() {
        use crate::cuda::emulate::Emulator;
        use crate::cuda::registry::GELU;
        let Some(e) = Emulator::new(GELU.forward.of(DType::F32)) else { return };
        let dev = Device::host(64 << 20);
        for dtype in DTYPES {
            let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
            for (rows, d_in, d_out) in [(7, 5, 3), (33, 16, 24)] {
                for (with_bias, keep) in
                    [(true, true), (true, false), (false, true), (false, false)]
                {
                    let what = format!("{dtype:?} {rows}x{d_in}->{d_out} {with_bias} {keep}");
                    let x = tensor(&dev, &[rows, d_in], dtype, 1);
                    let w = tensor(&dev, &[d_out, d_in], dtype, 2);
                    let b = with_bias.then(|| tensor(&dev, &[d_out], dtype, 3));
                    let want =
                        linear_act(&x, &w, b.as_ref(), Some(LinearActivation::Gelu), keep).unwrap();
                    let nan = || {
                        let v = vec![f32::NAN; rows * d_out];
                        Tensor::from_f32_slice(&dev, &[rows, d_out], &v, dtype).unwrap()
                    };
                    let (y, pre) = (nan(), keep.then(nan));
                    let a = |t: &Tensor| t.storage().address();
                    let at = cuda::LinearAddresses {
                        x: a(&x),
                        w: a(&w),
                        bias: b.as_ref().map(a),
                        pre: pre.as_ref().map(a),
                        y: a(&y),
                    };
                    // SAFETY: host buffers of the sizes the launches address.
                    unsafe { cuda::unfused(&e, &at, (rows, d_in, d_out), dtype, true) }.unwrap();
                    let close = |what: &str, got: &Tensor, want: &Tensor| {
                        let (g, w) = (got.to_f32_vec().unwrap(), want.to_f32_vec().unwrap());
                        for (i, (g, w)) in g.iter().zip(&w).enumerate() {
                            assert!(
                                (g - w).abs() <= tol * w.abs().max(1.0),
                                "{what} {i}: {g} vs {w}"
                            );
                        }
                    };
                    close(&format!("{what}: y"), &y, &want.y);
                    if let (Some(p), Some(w)) = (&pre, &want.pre) {
                        close(&format!("{what}: pre"), p, w);
                    }
                }
            }
        }
    }

    /// `linear_backward_gelu` is the unfused ops bit for bit on the host: `linear_backward`,
    /// `gelu_backward` of its `dx`, and the first layer's bias gradient as `linear_backward`
    /// sums it; every dtype, odd sizes, with and without this layer's bias.
    #[test]
    fn linear_backward_gelu_is_the_unfused_ops() {
        let dev = Device::host(64 << 20);
        for dtype in DTYPES {
            for (rows, d_in, d_out) in [(7, 5, 3), (65, 24, 17), (0, 8, 4), (3, 0, 2)] {
                for with_bias in [true, false] {
                    let what = format!("{dtype:?} {rows}x{d_in}->{d_out} {with_bias}");
                    let pre = tensor(&dev, &[rows, d_in], dtype, 1);
                    let x = ops::gelu(&pre).unwrap();
                    let w = tensor(&dev, &[d_out, d_in], dtype, 2);
                    let dy = tensor(&dev, &[rows, d_out], dtype, 3);
                    let got = linear_backward_gelu(&x, &w, &dy, with_bias, &pre).unwrap();
                    let want = linear_backward(&x, &w, &dy, with_bias).unwrap();
                    let dpre = ops::gelu_backward(&pre, &want.dx).unwrap();
                    // The first layer's bias gradient: its `linear_backward` of dpre.
                    let x1 = tensor(&dev, &[rows, 3], dtype, 4);
                    let w1 = tensor(&dev, &[d_in, 3], dtype, 5);
                    let first = linear_backward(&x1, &w1, &dpre, true).unwrap();
                    assert_eq!(bits(&got.dpre), bits(&dpre), "{what}: dpre");
                    assert_eq!(bits(&got.dw), bits(&want.dw), "{what}: dw");
                    assert_eq!(
                        got.dbias.as_ref().map(bits),
                        want.dbias.as_ref().map(bits),
                        "{what}: dbias"
                    );
                    assert_eq!(
                        bits(&got.dpre_bias),
                        bits(first.dbias.as_ref().unwrap()),
                        "{what}: dpre_bias"
                    );
                }
            }
        }
        let pre = tensor(&dev, &[4, 3], DType::F32, 1);
        let w = tensor(&dev, &[5, 3], DType::F32, 2);
        let dy = tensor(&dev, &[4, 5], DType::F32, 3);
        let bad_pre = tensor(&dev, &[4, 4], DType::F32, 1);
        assert!(linear_backward_gelu(&pre, &w, &dy, true, &bad_pre).is_err());
        let pre16 = tensor(&dev, &[4, 3], DType::BF16, 1);
        assert!(linear_backward_gelu(&pre, &w, &dy, true, &pre16).is_err());
        assert!(linear_backward_gelu(&pre, &w, &pre, true, &pre).is_err());
    }

    /// Host and virtual devices allocate the same for `linear_backward_gelu`, and its peak
    /// is below the unfused ops' (which hold `dx` and `dpre` at once).
    #[test]
    fn linear_backward_gelu_allocates_less_than_the_unfused_ops() {
        let (rows, d_in, d_out) = (64, 256, 64);
        let mut traces = Vec::new();
        for dev in [Device::host(64 << 20), Device::virtual_device(64 << 20)] {
            let z = |s: &[usize]| Tensor::zeros(&dev, s, DType::BF16).unwrap();
            let (pre, x, w, dy) =
                (z(&[rows, d_in]), z(&[rows, d_in]), z(&[d_out, d_in]), z(&[rows, d_out]));
            let (x1, w1) = (z(&[rows, 8]), z(&[d_in, 8]));
            dev.set_blas_workspace_size(1 << 20);
            dev.prepare_blas_workspace().unwrap();
            let peak = |f: &dyn Fn()| {
                let base = dev.memory_stats().allocated_bytes.all.current;
                dev.reset_peak_stats();
                f();
                dev.memory_stats().allocated_bytes.all.peak - base
            };
            let unfused = peak(&|| {
                let g = linear_backward(&x, &w, &dy, true).unwrap();
                let dpre = ops::gelu_backward(&pre, &g.dx).unwrap();
                drop(g.dx);
                drop(linear_backward(&x1, &w1, &dpre, true).unwrap().dbias);
            });
            dev.record_history(Some(100));
            let fused = peak(&|| drop(linear_backward_gelu(&x, &w, &dy, true, &pre).unwrap()));
            let trace: Vec<usize> = dev.trace().iter().map(|e| e.requested).collect();
            dev.record_history(None);
            assert!(fused < unfused, "fused peak {fused} vs unfused {unfused}");
            traces.push(trace);
        }
        assert_eq!(traces[0], traces[1]);
    }
}
