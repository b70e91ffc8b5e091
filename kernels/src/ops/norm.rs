//! Layer normalization over the last dimension, forward and backward.

use super::{
    expect_dtype, invalid, output, output_like, rows_cols, same_device, same_kind, with_dtype,
};
use crate::cpu::norm as cpu;
#[cfg(feature = "cuda")]
use crate::cuda::ops::nn as cuda;
use crate::dtype::DType;
use crate::error::Result;
use crate::tensor::Tensor;

/// The result of [`layer_norm`].
#[derive(Debug)]
pub struct LayerNormOutput {
    /// The normalized output, `x`'s shape and dtype.
    pub y: Tensor,
    /// Per-row mean, `[rows]` f32, saved for the backward.
    pub mean: Tensor,
    /// Per-row `1 / sqrt(var + eps)`, `[rows]` f32, saved for the backward.
    pub rstd: Tensor,
}

/// Gradients of [`layer_norm`].
#[derive(Debug)]
pub struct LayerNormGrads {
    /// Gradient of the input, `x`'s shape.
    pub dx: Tensor,
    /// Gradient of the scale, `[d]`.
    pub dgamma: Tensor,
    /// Gradient of the shift, `[d]`.
    pub dbeta: Tensor,
}

/// Checks `x: [.., d]` against `gamma: [d]`; returns `(rows, d)`.
fn dims(op: &'static str, x: &Tensor, gamma: &Tensor) -> Result<(usize, usize)> {
    same_kind(op, x, gamma)?;
    let (rows, d) = rows_cols(op, x.shape())?;
    if d == 0 {
        return Err(invalid(
            op,
            format!("cannot normalize over an empty last dimension {:?}", x.shape()),
        ));
    }
    super::expect_shape(op, &[d], gamma)?;
    Ok((rows, d))
}

/// Layer norm over the last dimension of `x: [.., d]`: `(x - mean) * rstd * gamma + beta`
/// with the biased variance, as in PyTorch; `gamma` and `beta` are `[d]`.
///
/// # Errors
///
/// Shape, dtype and device mismatches; an empty last dimension; out of memory.
pub fn layer_norm(x: &Tensor, gamma: &Tensor, beta: &Tensor, eps: f32) -> Result<LayerNormOutput> {
    const OP: &str = "layer_norm";
    let (rows, d) = dims(OP, x, gamma)?;
    same_kind(OP, x, beta)?;
    super::expect_shape(OP, &[d], beta)?;
    let mut y = output_like(OP, x)?;
    let mut mean = output(OP, x.device(), &[rows], DType::F32)?;
    let mut rstd = output(OP, x.device(), &[rows], DType::F32)?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = x.device().cuda_backend() {
        cuda::layer_norm(cu, x, gamma, beta, eps, &mut y, &mut mean, &mut rstd)?;
        return Ok(LayerNormOutput { y, mean, rstd });
    }
    with_dtype!(x.dtype(), T => cpu::layer_norm(
        x.as_slice::<T>()?,
        gamma.as_slice::<T>()?,
        beta.as_slice::<T>()?,
        eps,
        y.as_mut_slice::<T>()?,
        mean.as_mut_slice::<f32>()?,
        rstd.as_mut_slice::<f32>()?,
    ));
    Ok(LayerNormOutput { y, mean, rstd })
}

/// Gradients of [`layer_norm`] from the forward input `x`, `gamma`, the saved `mean` and
/// `rstd`, and the upstream `dy`.
///
/// # Errors
///
/// Shape, dtype and device mismatches; out of memory.
pub fn layer_norm_backward(
    x: &Tensor,
    gamma: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    dy: &Tensor,
) -> Result<LayerNormGrads> {
    const OP: &str = "layer_norm_backward";
    let (rows, d) = dims(OP, x, gamma)?;
    super::same_layout(OP, x, dy)?;
    for saved in [mean, rstd] {
        same_device(OP, x, saved)?;
        expect_dtype(OP, DType::F32, saved)?;
        super::expect_shape(OP, &[rows], saved)?;
    }
    let mut dx = output_like(OP, x)?;
    let mut dgamma = output(OP, x.device(), &[d], x.dtype())?;
    let mut dbeta = output(OP, x.device(), &[d], x.dtype())?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = x.device().cuda_backend() {
        cuda::layer_norm_backward(cu, x, gamma, mean, rstd, dy, &mut dx, &mut dgamma, &mut dbeta)?;
        return Ok(LayerNormGrads { dx, dgamma, dbeta });
    }
    with_dtype!(x.dtype(), T => cpu::layer_norm_backward(
        x.as_slice::<T>()?,
        gamma.as_slice::<T>()?,
        mean.as_slice::<f32>()?,
        rstd.as_slice::<f32>()?,
        dy.as_slice::<T>()?,
        dx.as_mut_slice::<T>()?,
        dgamma.as_mut_slice::<T>()?,
        dbeta.as_mut_slice::<T>()?,
    ));
    Ok(LayerNormGrads { dx, dgamma, dbeta })
}
