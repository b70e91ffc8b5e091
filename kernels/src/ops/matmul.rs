//! Batched matrix products and the linear layer, forward and backward.

use super::{expect_rank, invalid, output, rows_cols, same_kind, with_dtype};
use crate::cpu::matmul as cpu;
use crate::cpu::matmul::MatmulSpec;
#[cfg(feature = "cuda")]
use crate::cuda::ops::matmul as cuda;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// The product spec and output shape of `op(A) * op(B)` for stored shapes `a: [.., r, c]`
/// and `b: [.., r, c]` (see [`matmul`] for the layouts and broadcasting rules).
///
/// # Errors
///
/// [`Error::InvalidArgument`] for an operand of rank below 2; [`Error::ShapeMismatch`] if
/// the contracted dimensions or the batch dimensions disagree.
pub fn matmul_spec(
    a: &[usize],
    b: &[usize],
    trans_a: bool,
    trans_b: bool,
) -> Result<(MatmulSpec, Vec<usize>)> {
    const OP: &str = "matmul";
    let mismatch = || Error::ShapeMismatch { op: OP, lhs: a.to_vec(), rhs: b.to_vec() };
    let (Some((a_batch, &[ar, ac])), Some((b_batch, &[br, bc]))) =
        (a.split_last_chunk::<2>(), b.split_last_chunk::<2>())
    else {
        return Err(invalid(OP, format!("operands need rank >= 2, got {a:?} and {b:?}")));
    };
    let (m, k) = if trans_a { (ac, ar) } else { (ar, ac) };
    let (kb, n) = if trans_b { (bc, br) } else { (br, bc) };
    if k != kb {
        return Err(mismatch());
    }
    // Equal batch dimensions pair up; a rank-2 operand is broadcast to every batch.
    let (batch_dims, stride_a, stride_b) = if a_batch == b_batch {
        (a_batch, m * k, k * n)
    } else if b_batch.is_empty() {
        (a_batch, m * k, 0)
    } else if a_batch.is_empty() {
        (b_batch, 0, k * n)
    } else {
        return Err(mismatch());
    };
    let batch = batch_dims.iter().product();
    let spec = MatmulSpec::new(m, n, k).transpose(trans_a, trans_b).batched(
        batch,
        stride_a,
        stride_b,
        m * n,
    );
    let mut out = batch_dims.to_vec();
    out.extend([m, n]);
    Ok((spec, out))
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
    const OP: &str = "matmul";
    same_kind(OP, a, b)?;
    let (spec, shape) = matmul_spec(a.shape(), b.shape(), trans_a, trans_b)?;
    let mut c = output(OP, a.device(), &shape, a.dtype())?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = a.device().cuda_backend() {
        cuda::matmul(cu, &spec, a, b, &mut c)?;
        return Ok(c);
    }
    with_dtype!(a.dtype(), T => {
        cpu::matmul(&spec, a.as_slice::<T>()?, b.as_slice::<T>()?, c.as_mut_slice::<T>()?)
    });
    Ok(c)
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
    const OP: &str = "matmul_backward";
    same_kind(OP, a, b)?;
    same_kind(OP, a, dc)?;
    let (spec, shape) = matmul_spec(a.shape(), b.shape(), trans_a, trans_b)?;
    super::expect_shape(OP, &shape, dc)?;
    if dc.numel() == 0 {
        // No product was formed, so nothing flows back.
        let da = Tensor::zeros(a.device(), a.shape(), a.dtype())?;
        return Ok((da, Tensor::zeros(b.device(), b.shape(), b.dtype())?));
    }
    let mut da = output(OP, a.device(), a.shape(), a.dtype())?;
    let mut db = output(OP, b.device(), b.shape(), b.dtype())?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = a.device().cuda_backend() {
        cuda::matmul_backward(cu, &spec, a, b, dc, &mut da, &mut db)?;
        return Ok((da, db));
    }
    with_dtype!(a.dtype(), T => cpu::matmul_backward(
        &spec,
        a.as_slice::<T>()?,
        b.as_slice::<T>()?,
        dc.as_slice::<T>()?,
        Some(da.as_mut_slice::<T>()?),
        Some(db.as_mut_slice::<T>()?),
    ));
    Ok((da, db))
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
    const OP: &str = "linear";
    let (_, d_in, d_out) = linear_dims(OP, x, w)?;
    if let Some(bias) = bias {
        same_kind(OP, x, bias)?;
        super::expect_shape(OP, &[d_out], bias)?;
    }
    let mut y = output(OP, x.device(), &with_last(x.shape(), d_out), x.dtype())?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = x.device().cuda_backend() {
        cuda::linear(cu, x, w, bias, &mut y, d_in, d_out)?;
        return Ok(y);
    }
    with_dtype!(x.dtype(), T => cpu::linear(
        x.as_slice::<T>()?,
        w.as_slice::<T>()?,
        bias.map(|b| b.as_slice::<T>()).transpose()?,
        y.as_mut_slice::<T>()?,
        d_in,
        d_out,
    ));
    Ok(y)
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
    const OP: &str = "linear_backward";
    let (_, d_in, d_out) = linear_dims(OP, x, w)?;
    same_kind(OP, x, dy)?;
    super::expect_shape(OP, &with_last(x.shape(), d_out), dy)?;
    let zeros = dy.numel() == 0;
    let alloc = |shape: &[usize]| {
        if zeros {
            Tensor::zeros(x.device(), shape, x.dtype())
        } else {
            output(OP, x.device(), shape, x.dtype())
        }
    };
    let mut dx = alloc(x.shape())?;
    let mut dw = alloc(w.shape())?;
    let mut dbias = if with_bias { Some(alloc(&[d_out])?) } else { None };
    #[cfg(feature = "cuda")]
    if let Some(cu) = x.device().cuda_backend() {
        if !zeros {
            cuda::linear_backward(cu, x, w, dy, &mut dx, &mut dw, dbias.as_mut(), d_in, d_out)?;
        }
        return Ok(LinearGrads { dx, dw, dbias });
    }
    if !zeros {
        with_dtype!(x.dtype(), T => cpu::linear_backward(
            x.as_slice::<T>()?,
            w.as_slice::<T>()?,
            dy.as_slice::<T>()?,
            Some(dx.as_mut_slice::<T>()?),
            Some(dw.as_mut_slice::<T>()?),
            dbias.as_mut().map(|d| d.as_mut_slice::<T>()).transpose()?,
            d_in,
            d_out,
        ));
    }
    Ok(LinearGrads { dx, dw, dbias })
}
