//! Matrix products through cuBLAS: matmul, its backward and the linear layer.

use super::elementwise::{bias_fill, from_f32};
use super::reduce::column_sums;
use super::zeroed_f32;
use crate::cpu::matmul::MatmulSpec;
use crate::cuda::CudaBackend;
use crate::dtype::DType;
use crate::error::Result;
use crate::tensor::Tensor;

/// `c = op(a) * op(b)` for a spec from [`crate::ops::matmul_spec`].
pub(crate) fn matmul(
    cu: &CudaBackend,
    spec: &MatmulSpec,
    a: &Tensor,
    b: &Tensor,
    c: &mut Tensor,
) -> Result<()> {
    let t = a.dtype();
    // SAFETY: the spec was derived from the tensors' shapes, so a, b and c hold a_len(),
    // b_len() and c_len() elements of t; c is a fresh output and stride_c = m * n.
    unsafe { cu.gemm(spec, a.cuda_ptr()?, b.cuda_ptr()?, c.cuda_ptr()?, t, t) }
}

/// One gradient product of [`matmul_backward`], as the host's `grad_batches`: batched into
/// `out` when the operand has its own matrix per batch, summed over batches (in an f32
/// accumulator, rounded once) when it was broadcast.
#[allow(clippy::too_many_arguments)]
fn grad_batches(
    cu: &CudaBackend,
    spec: &MatmulSpec,
    grad: MatmulSpec,
    lhs: u64,
    rhs: u64,
    lhs_stride: usize,
    rhs_stride: usize,
    out: &mut Tensor,
    out_stride: usize,
) -> Result<()> {
    let t = out.dtype();
    let size = t.size_in_bytes();
    if out_stride != 0 || spec.batch <= 1 {
        let g = grad.batched(spec.batch, lhs_stride, rhs_stride, out_stride);
        // SAFETY: lhs, rhs and out are the forward operands, dc and the gradient, whose
        // layouts the forward spec describes; `g` addresses exactly those ranges.
        return unsafe { cu.gemm(&g, lhs, rhs, out.cuda_ptr()?, t, t) };
    }
    let acc = zeroed_f32(cu, grad.m * grad.n)?;
    for i in 0..spec.batch {
        let g = grad.scaled(grad.alpha, 1.0);
        // SAFETY: batch i's matrices start i strides in; acc holds the m * n f32 sum.
        unsafe {
            cu.gemm(
                &g,
                lhs + (i * lhs_stride * size) as u64,
                rhs + (i * rhs_stride * size) as u64,
                acc.ptr(),
                t,
                DType::F32,
            )?;
        }
    }
    from_f32(cu, acc.ptr(), out)
}

/// Gradients of [`matmul`]; `dc` is nonempty.
pub(crate) fn matmul_backward(
    cu: &CudaBackend,
    s: &MatmulSpec,
    a: &Tensor,
    b: &Tensor,
    dc: &Tensor,
    da: &mut Tensor,
    db: &mut Tensor,
) -> Result<()> {
    let (pa, pb, pc) = (a.cuda_ptr()?, b.cuda_ptr()?, dc.cuda_ptr()?);
    // dA = dC * op(B)^T, or its transpose op(B) * dC^T (the host's formulation).
    let grad = if s.trans_a {
        MatmulSpec::new(s.k, s.m, s.n).transpose(s.trans_b, true)
    } else {
        MatmulSpec::new(s.m, s.k, s.n).transpose(false, !s.trans_b)
    };
    let (lhs, rhs, ls, rs) =
        if s.trans_a { (pb, pc, s.stride_b, s.stride_c) } else { (pc, pb, s.stride_c, s.stride_b) };
    grad_batches(cu, s, grad.scaled(s.alpha, 0.0), lhs, rhs, ls, rs, da, s.stride_a)?;
    // dB = op(A)^T * dC, or its transpose dC^T * op(A).
    let grad = if s.trans_b {
        MatmulSpec::new(s.n, s.k, s.m).transpose(true, s.trans_a)
    } else {
        MatmulSpec::new(s.k, s.n, s.m).transpose(!s.trans_a, false)
    };
    let (lhs, rhs, ls, rs) =
        if s.trans_b { (pc, pa, s.stride_c, s.stride_a) } else { (pa, pc, s.stride_a, s.stride_c) };
    grad_batches(cu, s, grad.scaled(s.alpha, 0.0), lhs, rhs, ls, rs, db, s.stride_b)
}

/// `y = x * w^T + bias`: the bias is broadcast into y first and the gemm adds the product
/// to it (beta = 1), so each output is rounded once.
pub(crate) fn linear(
    cu: &CudaBackend,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    y: &mut Tensor,
    d_in: usize,
    d_out: usize,
) -> Result<()> {
    let rows = y.numel().checked_div(d_out).unwrap_or(0);
    let beta = match bias {
        Some(bias) => {
            bias_fill(cu, bias, y)?;
            1.0
        }
        None => 0.0,
    };
    let spec = MatmulSpec::new(rows, d_out, d_in).transpose(false, true).scaled(1.0, beta);
    let t = x.dtype();
    // SAFETY: x is [rows, d_in], w [d_out, d_in], y [rows, d_out] (checked by the op layer).
    unsafe { cu.gemm(&spec, x.cuda_ptr()?, w.cuda_ptr()?, y.cuda_ptr()?, t, t) }
}

/// Gradients of [`linear`]: `dx = dy * w`, `dw = dy^T * x`, `dbias` = column sums of dy.
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear_backward(
    cu: &CudaBackend,
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    dx: &mut Tensor,
    dw: &mut Tensor,
    dbias: Option<&mut Tensor>,
    d_in: usize,
    d_out: usize,
) -> Result<()> {
    let rows = dy.numel().checked_div(d_out).unwrap_or(0);
    let t = x.dtype();
    let (px, pw, pdy) = (x.cuda_ptr()?, w.cuda_ptr()?, dy.cuda_ptr()?);
    // SAFETY: dy [rows, d_out] * w [d_out, d_in] -> dx [rows, d_in].
    unsafe { cu.gemm(&MatmulSpec::new(rows, d_in, d_out), pdy, pw, dx.cuda_ptr()?, t, t)? };
    let spec = MatmulSpec::new(d_out, d_in, rows).transpose(true, false);
    // SAFETY: dy^T ([rows, d_out] stored) * x [rows, d_in] -> dw [d_out, d_in].
    unsafe { cu.gemm(&spec, pdy, px, dw.cuda_ptr()?, t, t)? };
    if let Some(dbias) = dbias {
        column_sums(cu, pdy, t, rows, dbias)?;
    }
    Ok(())
}
