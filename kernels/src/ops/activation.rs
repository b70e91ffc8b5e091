//! ReLU and GELU (tanh approximation), forward and backward.

use super::{output_like, same_layout, with_dtype};
use crate::cpu::activation as cpu;
#[cfg(feature = "cuda")]
use crate::cuda::ops::elementwise as cuda;
use crate::error::Result;
use crate::tensor::Tensor;

/// `max(x, 0)`.
///
/// # Errors
///
/// [`Error::OutOfMemory`](crate::Error::OutOfMemory).
pub fn relu(x: &Tensor) -> Result<Tensor> {
    let mut y = output_like("relu", x)?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = x.device().cuda_backend() {
        cuda::activation(cu, &crate::cuda::registry::RELU, x, &mut y)?;
        return Ok(y);
    }
    with_dtype!(x.dtype(), T => cpu::relu(x.as_slice::<T>()?, y.as_mut_slice::<T>()?));
    Ok(y)
}

/// Gradient of [`relu`] from the forward input `x` and the upstream `dy`.
///
/// # Errors
///
/// Shape, dtype and device mismatches between `x` and `dy`; out of memory.
pub fn relu_backward(x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    const OP: &str = "relu_backward";
    same_layout(OP, x, dy)?;
    let mut dx = output_like(OP, x)?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = x.device().cuda_backend() {
        cuda::activation_backward(cu, &crate::cuda::registry::RELU_BWD, x, dy, &mut dx)?;
        return Ok(dx);
    }
    with_dtype!(x.dtype(), T => {
        cpu::relu_backward(x.as_slice::<T>()?, dy.as_slice::<T>()?, dx.as_mut_slice::<T>()?)
    });
    Ok(dx)
}

/// GELU, tanh approximation (PyTorch's `gelu(x, approximate='tanh')`).
///
/// # Errors
///
/// [`Error::OutOfMemory`](crate::Error::OutOfMemory).
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    let mut y = output_like("gelu", x)?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = x.device().cuda_backend() {
        cuda::activation(cu, &crate::cuda::registry::GELU, x, &mut y)?;
        return Ok(y);
    }
    with_dtype!(x.dtype(), T => cpu::gelu(x.as_slice::<T>()?, y.as_mut_slice::<T>()?));
    Ok(y)
}

/// Gradient of [`gelu`] from the forward input `x` and the upstream `dy`.
///
/// # Errors
///
/// As [`relu_backward`].
pub fn gelu_backward(x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    const OP: &str = "gelu_backward";
    same_layout(OP, x, dy)?;
    let mut dx = output_like(OP, x)?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = x.device().cuda_backend() {
        cuda::activation_backward(cu, &crate::cuda::registry::GELU_BWD, x, dy, &mut dx)?;
        return Ok(dx);
    }
    with_dtype!(x.dtype(), T => {
        cpu::gelu_backward(x.as_slice::<T>()?, dy.as_slice::<T>()?, dx.as_mut_slice::<T>()?)
    });
    Ok(dx)
}
