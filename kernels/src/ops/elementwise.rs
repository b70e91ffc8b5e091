//! Elementwise arithmetic and the broadcast bias add.

use super::{output, output_like, rows_cols, same_device, same_kind, same_layout, with_dtype};
use crate::cpu::elementwise as cpu;
#[cfg(feature = "cuda")]
use crate::cuda::ops::elementwise as cuda;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// `a + b`, elementwise; same shape and dtype.
///
/// # Errors
///
/// [`Error::ShapeMismatch`], [`Error::DTypeMismatch`], [`Error::DeviceMismatch`],
/// [`Error::OutOfMemory`].
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    const OP: &str = "add";
    same_layout(OP, a, b)?;
    let mut out = output_like(OP, a)?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = a.device().cuda_backend() {
        cuda::binary(cu, &crate::cuda::registry::ADD, a, b, &mut out)?;
        return Ok(out);
    }
    with_dtype!(a.dtype(), T => {
        cpu::add(a.as_slice::<T>()?, b.as_slice::<T>()?, out.as_mut_slice::<T>()?)
    });
    Ok(out)
}

/// `a * b`, elementwise; same shape and dtype.
///
/// # Errors
///
/// As [`add`].
pub fn mul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    const OP: &str = "mul";
    same_layout(OP, a, b)?;
    let mut out = output_like(OP, a)?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = a.device().cuda_backend() {
        cuda::binary(cu, &crate::cuda::registry::MUL, a, b, &mut out)?;
        return Ok(out);
    }
    with_dtype!(a.dtype(), T => {
        cpu::mul(a.as_slice::<T>()?, b.as_slice::<T>()?, out.as_mut_slice::<T>()?)
    });
    Ok(out)
}

/// `alpha * x`.
///
/// # Errors
///
/// [`Error::OutOfMemory`].
pub fn scale(x: &Tensor, alpha: f32) -> Result<Tensor> {
    let mut out = output_like("scale", x)?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = x.device().cuda_backend() {
        cuda::scale(cu, x, alpha, &mut out)?;
        return Ok(out);
    }
    with_dtype!(x.dtype(), T => cpu::scale(x.as_slice::<T>()?, alpha, out.as_mut_slice::<T>()?));
    Ok(out)
}

/// Checks that `x` can update `acc` in place: one device, one shape (dtypes may differ).
fn check_update(op: &'static str, acc: &Tensor, x: &Tensor) -> Result<()> {
    same_device(op, acc, x)?;
    if acc.shape() != x.shape() {
        return Err(Error::ShapeMismatch {
            op,
            lhs: acc.shape().to_vec(),
            rhs: x.shape().to_vec(),
        });
    }
    Ok(())
}

/// `acc += x` in place (gradient accumulation). The dtypes may differ, e.g. f16 gradients
/// into an f32 accumulator; shapes must match.
///
/// # Errors
///
/// [`Error::ShapeMismatch`], [`Error::DeviceMismatch`]; `acc` is unchanged then.
pub fn add_assign(acc: &mut Tensor, x: &Tensor) -> Result<()> {
    check_update("add_assign", acc, x)?;
    acc.make_unique()?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = x.device().cuda_backend() {
        return cuda::add_assign(cu, acc, x);
    }
    with_dtype!(acc.dtype(), A => with_dtype!(x.dtype(), X => {
        cpu::add_assign(acc.as_mut_slice::<A>()?, x.as_slice::<X>()?)
    }));
    Ok(())
}

/// `y += alpha * x` in place (BLAS axpy). The dtypes may differ; shapes must match.
///
/// # Errors
///
/// As [`add_assign`].
pub fn axpy(alpha: f32, x: &Tensor, y: &mut Tensor) -> Result<()> {
    check_update("axpy", y, x)?;
    y.make_unique()?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = x.device().cuda_backend() {
        return cuda::axpy(cu, alpha, x, y);
    }
    with_dtype!(y.dtype(), Y => with_dtype!(x.dtype(), X => {
        cpu::axpy(alpha, x.as_slice::<X>()?, y.as_mut_slice::<Y>()?)
    }));
    Ok(())
}

/// `x + bias` with `bias: [d]` broadcast over the rows of `x: [.., d]`.
///
/// # Errors
///
/// [`Error::ShapeMismatch`] if `bias` is not `[d]`; dtype and device mismatches;
/// [`Error::OutOfMemory`].
pub fn bias_add(x: &Tensor, bias: &Tensor) -> Result<Tensor> {
    const OP: &str = "bias_add";
    same_kind(OP, x, bias)?;
    let (_, d) = rows_cols(OP, x.shape())?;
    super::expect_shape(OP, &[d], bias)?;
    let mut out = output_like(OP, x)?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = x.device().cuda_backend() {
        cuda::bias_add(cu, x, bias, &mut out)?;
        return Ok(out);
    }
    with_dtype!(x.dtype(), T => {
        cpu::bias_add(x.as_slice::<T>()?, bias.as_slice::<T>()?, out.as_mut_slice::<T>()?)
    });
    Ok(out)
}

/// Gradient of [`bias_add`] with respect to the bias: the column sums of `dy: [.., d]`, shape
/// `[d]`. (The gradient with respect to `x` is `dy` itself.)
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a rank-0 `dy`; [`Error::OutOfMemory`].
pub fn bias_add_backward(dy: &Tensor) -> Result<Tensor> {
    const OP: &str = "bias_add_backward";
    let (_, d) = rows_cols(OP, dy.shape())?;
    let mut db = output(OP, dy.device(), &[d], dy.dtype())?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = dy.device().cuda_backend() {
        let rows = dy.numel().checked_div(d).unwrap_or(0);
        crate::cuda::ops::reduce::column_sums(cu, dy.cuda_ptr()?, dy.dtype(), rows, &mut db)?;
        return Ok(db);
    }
    with_dtype!(dy.dtype(), T => {
        cpu::bias_add_backward(dy.as_slice::<T>()?, db.as_mut_slice::<T>()?)
    });
    Ok(db)
}
