//! Softmax over the last dimension, plain and causal, forward and backward.

use super::{invalid, output_like, rows_cols, same_layout, with_dtype};
use crate::cpu::softmax as cpu;
#[cfg(feature = "cuda")]
use crate::cuda::ops::nn as cuda;
use crate::error::Result;
use crate::tensor::Tensor;

/// The last dimension of `x`, which softmax normalizes over.
fn last_dim(op: &'static str, x: &Tensor) -> Result<usize> {
    Ok(rows_cols(op, x.shape())?.1)
}

/// The sequence length of causal attention scores `[.., seq, seq]`.
fn seq_len(op: &'static str, x: &Tensor) -> Result<usize> {
    match x.shape() {
        [.., a, b] if a == b => Ok(*a),
        shape => Err(invalid(op, format!("expected scores [.., seq, seq], got {shape:?}"))),
    }
}

/// Softmax over the last dimension of `x`.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a rank-0 `x`; out of memory.
pub fn softmax(x: &Tensor) -> Result<Tensor> {
    const OP: &str = "softmax";
    let cols = last_dim(OP, x)?;
    let mut y = output_like(OP, x)?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = x.device().cuda_backend() {
        if x.numel() > 0 {
            cuda::softmax(cu, x, &mut y, cols, 0)?;
        }
        return Ok(y);
    }
    if x.numel() > 0 {
        with_dtype!(x.dtype(), T => cpu::softmax(x.as_slice::<T>()?, y.as_mut_slice::<T>()?, cols));
    }
    Ok(y)
}

/// Gradient of [`softmax`] from its output `y` and the upstream `dy`.
///
/// # Errors
///
/// Shape, dtype and device mismatches between `y` and `dy`; out of memory.
pub fn softmax_backward(y: &Tensor, dy: &Tensor) -> Result<Tensor> {
    const OP: &str = "softmax_backward";
    same_layout(OP, y, dy)?;
    let cols = last_dim(OP, y)?;
    let mut dx = output_like(OP, y)?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = y.device().cuda_backend() {
        if y.numel() > 0 {
            cuda::softmax_backward(cu, y, dy, &mut dx, cols, 0)?;
        }
        return Ok(dx);
    }
    if y.numel() > 0 {
        with_dtype!(y.dtype(), T => cpu::softmax_backward(
            y.as_slice::<T>()?,
            dy.as_slice::<T>()?,
            dx.as_mut_slice::<T>()?,
            cols,
        ));
    }
    Ok(dx)
}

/// Causally masked softmax of attention scores `x: [.., seq, seq]`: row `i` is a softmax over
/// columns `j <= i`, and the output is 0 for `j > i` (those inputs are never read).
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) unless the last two dimensions
/// are equal; out of memory.
pub fn causal_softmax(x: &Tensor) -> Result<Tensor> {
    const OP: &str = "causal_softmax";
    let seq = seq_len(OP, x)?;
    let mut y = output_like(OP, x)?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = x.device().cuda_backend() {
        if x.numel() > 0 {
            cuda::softmax(cu, x, &mut y, seq, seq)?;
        }
        return Ok(y);
    }
    if x.numel() > 0 {
        with_dtype!(x.dtype(), T => {
            cpu::causal_softmax(x.as_slice::<T>()?, y.as_mut_slice::<T>()?, seq)
        });
    }
    Ok(y)
}

/// Gradient of [`causal_softmax`] from its output `y` and the upstream `dy`.
///
/// # Errors
///
/// As [`causal_softmax`], and mismatches between `y` and `dy`.
pub fn causal_softmax_backward(y: &Tensor, dy: &Tensor) -> Result<Tensor> {
    const OP: &str = "causal_softmax_backward";
    same_layout(OP, y, dy)?;
    let seq = seq_len(OP, y)?;
    let mut dx = output_like(OP, y)?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = y.device().cuda_backend() {
        if y.numel() > 0 {
            cuda::softmax_backward(cu, y, dy, &mut dx, seq, seq)?;
        }
        return Ok(dx);
    }
    if y.numel() > 0 {
        with_dtype!(y.dtype(), T => cpu::causal_softmax_backward(
            y.as_slice::<T>()?,
            dy.as_slice::<T>()?,
            dx.as_mut_slice::<T>()?,
            seq,
        ));
    }
    Ok(dx)
}
