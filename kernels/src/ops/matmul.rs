//! Batched matrix products and the linear layer, forward and backward: the host's gemm
//! crate or cuBLAS (`cublasGemmEx` / `cublasGemmStridedBatchedEx`, f32 accumulation), which
//! runs in the device's cuBLAS workspace.

use super::dispatch::{Buffers, Op, OutputSpec, Plan, run};
use super::{expect_rank, expect_shape, rows_cols, same_kind};
use crate::cpu::matmul as cpu;
use crate::device::Device;
use crate::dtype::{DType, with_dtype};
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

/// The output shape of a linear layer: `x`'s with the last dimension replaced by `d_out`.
fn with_last(shape: &[usize], last: usize) -> Vec<usize> {
    let mut out = shape.to_vec();
    if let Some(l) = out.last_mut() {
        *l = last;
    }
    out
}

/// A linear layer `y = x * w^T + bias`: `x: [.., in]`, `w: [out, in]`, `bias: [out]`,
/// `y: [.., out]`.
///
/// # Errors
///
/// [`Error::ShapeMismatch`] if `w` or `bias` does not fit `x`; dtype and device
/// mismatches; out of memory.
pub fn linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    run(Linear { x, w, bias, dims: (0, 0, 0) })
}

struct Linear<'a> {
    x: &'a Tensor,
    w: &'a Tensor,
    bias: Option<&'a Tensor>,
    /// `(rows, d_in, d_out)`.
    dims: (usize, usize, usize),
}

impl Op for Linear<'_> {
    const NAME: &'static str = "linear";
    type Outs = Tensor;
    type Output = Tensor;

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
        let mut plan = Plan::one(&with_last(self.x.shape(), d_out), self.x.dtype());
        if rows > 0 && d_in > 0 && d_out > 0 {
            plan.blas();
        }
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let (_, d_in, d_out) = self.dims;
        with_dtype!(self.x.dtype(), T => cpu::linear(
            self.x.as_slice::<T>()?,
            self.w.as_slice::<T>()?,
            self.bias.map(|b| b.as_slice::<T>()).transpose()?,
            bufs.out().out_slice::<T>(Self::NAME)?,
            d_in,
            d_out,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let (rows, d_in, d_out) = self.dims;
        let y = bufs.out();
        // The bias is broadcast into y first and the gemm adds the product to it (beta = 1),
        // so each output is rounded once.
        let beta = match self.bias {
            Some(bias) => {
                cuda::bias_fill(gpu, bias, y)?;
                1.0
            }
            None => 0.0,
        };
        let spec = MatmulSpec::new(rows, d_out, d_in).transpose(false, true).scaled(1.0, beta);
        let t = self.x.dtype();
        // SAFETY: x is [rows, d_in], w [d_out, d_in], y [rows, d_out] (checked in `plan`).
        unsafe { gpu.gemm(&spec, self.x.cuda_ptr()?, self.w.cuda_ptr()?, y.cuda_ptr()?, t, t) }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
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
        let (rows, d_in, d_out) = linear_dims(Self::NAME, x, w)?;
        self.dims = (rows, d_in, d_out);
        same_kind(Self::NAME, x, dy)?;
        expect_shape(Self::NAME, &with_last(x.shape(), d_out), dy)?;
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
        let spec = MatmulSpec::new(d_out, d_in, rows).transpose(true, false);
        let dw = dw.cuda_ptr()?;
        // SAFETY: dy^T ([rows, d_out] stored) * x [rows, d_in] -> dw [d_out, d_in].
        unsafe { gpu.gemm(&spec, pdy, px, dw, t, t)? };
        if let Some(dbias) = dbias {
            crate::cuda::helpers::column_sums(gpu, pdy, t, rows, acc, dbias)?;
        }
        Ok(())
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<LinearGrads> {
        let (dx, dw, dbias) = bufs.into_outputs();
        Ok(LinearGrads { dx, dw, dbias })
    }
}

/// The CUDA side of the gradients and the bias broadcast.
#[cfg(feature = "cuda")]
mod cuda {
    use crate::cuda::helpers::{from_f32, ptr};
    use crate::cuda::launch::elementwise as grid;
    use crate::cuda::registry::BIAS_FILL;
    use crate::cuda::{Arg, Gpu};
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

    /// `y[i] = bias[i % d]` over all of `y` (the C operand of a linear layer's gemm).
    pub(super) fn bias_fill(gpu: &Gpu<'_>, bias: &Tensor, y: &mut Tensor) -> Result<()> {
        let (n, d) = (y.numel(), bias.numel());
        if n == 0 {
            return Ok(());
        }
        // SAFETY: bias_fill_T(const T* b, T* y, u64 n, Div d); y holds n elements, a multiple
        // of d > 0; bias holds d.
        unsafe {
            gpu.launch(
                BIAS_FILL.of(y.dtype()),
                grid(n),
                &[ptr(bias)?, ptr(y)?, Arg::count(n), Arg::div(d)],
            )
        }
    }
}
