//! Sum and mean, over the whole tensor (to a host scalar) or over the last dimension, and
//! their backward.

use super::{output, rows_cols, with_dtype};
use crate::cpu::reduce as cpu;
use crate::device::Device;
use crate::dtype::DType;
use crate::error::Result;
use crate::tensor::Tensor;

/// The sum of all elements, accumulated in f32 (pairwise).
///
/// # Errors
///
/// None on the host; the `Result` leaves room for devices where reading back can fail.
pub fn sum(x: &Tensor) -> Result<f32> {
    #[cfg(feature = "cuda")]
    if let Some(cu) = x.device().cuda_backend() {
        return crate::cuda::ops::reduce::sum(cu, x);
    }
    Ok(with_dtype!(x.dtype(), T => cpu::sum(x.as_slice::<T>()?)))
}

/// The mean of all elements in f32 (NaN for an empty tensor, as in PyTorch).
///
/// # Errors
///
/// As [`sum`].
pub fn mean(x: &Tensor) -> Result<f32> {
    #[cfg(feature = "cuda")]
    if let Some(cu) = x.device().cuda_backend() {
        return Ok(crate::cuda::ops::reduce::sum(cu, x)? / x.numel() as f32);
    }
    Ok(with_dtype!(x.dtype(), T => cpu::mean(x.as_slice::<T>()?)))
}

/// Gradient of [`sum`]: a tensor of `shape` and `dtype` on `device` filled with `dy`.
///
/// # Errors
///
/// Out of memory.
pub fn sum_backward(dy: f32, device: &Device, shape: &[usize], dtype: DType) -> Result<Tensor> {
    Tensor::full(device, shape, dtype, dy)
}

/// Gradient of [`mean`]: a tensor of `shape` and `dtype` on `device` filled with
/// `dy / numel`.
///
/// # Errors
///
/// Out of memory.
pub fn mean_backward(dy: f32, device: &Device, shape: &[usize], dtype: DType) -> Result<Tensor> {
    let mut dx = output("mean_backward", device, shape, dtype)?;
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        dx.try_fill(dy / dx.numel() as f32)?;
        return Ok(dx);
    }
    with_dtype!(dtype, T => cpu::mean_backward(dy, dx.as_mut_slice::<T>()?));
    Ok(dx)
}

/// Row sums of `x: [.., d]`, shape `[..]`.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a rank-0 `x`; out of memory.
pub fn sum_last_dim(x: &Tensor) -> Result<Tensor> {
    const OP: &str = "sum_last_dim";
    rows_cols(OP, x.shape())?;
    let mut out = output(OP, x.device(), &x.shape()[..x.rank() - 1], x.dtype())?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = x.device().cuda_backend() {
        crate::cuda::ops::reduce::row_sum(cu, x, &mut out, 1.0)?;
        return Ok(out);
    }
    with_dtype!(x.dtype(), T => cpu::sum_last_dim(x.as_slice::<T>()?, out.as_mut_slice::<T>()?));
    Ok(out)
}

/// Row means of `x: [.., d]`, shape `[..]` (NaN rows when `d == 0`).
///
/// # Errors
///
/// As [`sum_last_dim`].
pub fn mean_last_dim(x: &Tensor) -> Result<Tensor> {
    const OP: &str = "mean_last_dim";
    rows_cols(OP, x.shape())?;
    let mut out = output(OP, x.device(), &x.shape()[..x.rank() - 1], x.dtype())?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = x.device().cuda_backend() {
        let d = x.shape()[x.rank() - 1];
        crate::cuda::ops::reduce::row_sum(cu, x, &mut out, 1.0 / d as f32)?;
        return Ok(out);
    }
    with_dtype!(x.dtype(), T => cpu::mean_last_dim(x.as_slice::<T>()?, out.as_mut_slice::<T>()?));
    Ok(out)
}

/// `dy`'s shape with a last dimension `d` appended.
fn widened(dy: &Tensor, d: usize) -> Vec<usize> {
    let mut shape = dy.shape().to_vec();
    shape.push(d);
    shape
}

/// Gradient of [`sum_last_dim`] for rows of length `d`: `dy: [..]` broadcast to `[.., d]`.
///
/// # Errors
///
/// Out of memory.
pub fn sum_last_dim_backward(dy: &Tensor, d: usize) -> Result<Tensor> {
    let mut dx = output("sum_last_dim_backward", dy.device(), &widened(dy, d), dy.dtype())?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = dy.device().cuda_backend() {
        crate::cuda::ops::elementwise::broadcast_rows(cu, dy, 1.0, &mut dx)?;
        return Ok(dx);
    }
    with_dtype!(dy.dtype(), T => {
        cpu::sum_last_dim_backward(dy.as_slice::<T>()?, dx.as_mut_slice::<T>()?)
    });
    Ok(dx)
}

/// Gradient of [`mean_last_dim`] for rows of length `d`: `dy / d` broadcast to `[.., d]`.
///
/// # Errors
///
/// Out of memory.
pub fn mean_last_dim_backward(dy: &Tensor, d: usize) -> Result<Tensor> {
    let mut dx = output("mean_last_dim_backward", dy.device(), &widened(dy, d), dy.dtype())?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = dy.device().cuda_backend() {
        crate::cuda::ops::elementwise::broadcast_rows(cu, dy, 1.0 / d as f32, &mut dx)?;
        return Ok(dx);
    }
    with_dtype!(dy.dtype(), T => {
        cpu::mean_last_dim_backward(dy.as_slice::<T>()?, dx.as_mut_slice::<T>()?)
    });
    Ok(dx)
}
