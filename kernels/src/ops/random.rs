//! Dropout with a counter-based RNG: the mask is a function of `(seed, offset + index)`, so
//! the backward (and a checkpointed recomputation) regenerates it instead of storing it.

use super::{invalid, output_like, with_dtype};
use crate::cpu::random as cpu;
#[cfg(feature = "cuda")]
use crate::cuda::ops::elementwise as cuda;
use crate::error::Result;
use crate::tensor::Tensor;

fn check_p(op: &'static str, p: f32) -> Result<()> {
    if (0.0..1.0).contains(&p) {
        Ok(())
    } else {
        Err(invalid(op, format!("drop probability {p} is not in [0, 1)")))
    }
}

/// Dropout: element `i` is zeroed with probability `p`, and kept elements are scaled by
/// `1 / (1 - p)`. The mask depends only on `(seed, offset + i)`: give each call a disjoint
/// range (advance `offset` by the element count) and the backward the same arguments.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) unless `0 <= p < 1`; out of
/// memory.
pub fn dropout(x: &Tensor, p: f32, seed: u64, offset: u64) -> Result<Tensor> {
    const OP: &str = "dropout";
    check_p(OP, p)?;
    let mut y = output_like(OP, x)?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = x.device().cuda_backend() {
        cuda::dropout(cu, x, &mut y, p, seed, offset)?;
        return Ok(y);
    }
    with_dtype!(x.dtype(), T => {
        cpu::dropout(x.as_slice::<T>()?, y.as_mut_slice::<T>()?, p, seed, offset)
    });
    Ok(y)
}

/// Gradient of [`dropout`] with the forward's `(p, seed, offset)`: `dy` masked and scaled as
/// the forward masked and scaled `x`.
///
/// # Errors
///
/// As [`dropout`].
pub fn dropout_backward(dy: &Tensor, p: f32, seed: u64, offset: u64) -> Result<Tensor> {
    const OP: &str = "dropout_backward";
    check_p(OP, p)?;
    let mut dx = output_like(OP, dy)?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = dy.device().cuda_backend() {
        cuda::dropout(cu, dy, &mut dx, p, seed, offset)?;
        return Ok(dx);
    }
    with_dtype!(dy.dtype(), T => {
        cpu::dropout_backward(dy.as_slice::<T>()?, dx.as_mut_slice::<T>()?, p, seed, offset)
    });
    Ok(dx)
}
