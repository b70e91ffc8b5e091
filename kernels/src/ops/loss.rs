//! Fused softmax cross-entropy over class logits, forward and backward.

use super::{expect_dtype, expect_rank, output, output_like, same_device, with_dtype};
use crate::cpu::loss as cpu;
#[cfg(feature = "cuda")]
use crate::cuda::ops::nn as cuda;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// The result of [`cross_entropy`].
#[derive(Debug)]
pub struct CrossEntropy {
    /// The mean loss over the rows not ignored (NaN if every row is ignored).
    pub loss: f32,
    /// Per-row log-sum-exp, `[n]` f32, saved for [`cross_entropy_backward`].
    pub lse: Tensor,
}

/// Checks logits `[n, c]` against `n` targets.
fn check(op: &'static str, logits: &Tensor, targets: &[u32]) -> Result<()> {
    expect_rank(op, logits, 2, "of logits [n, classes]")?;
    if logits.shape()[0] != targets.len() {
        return Err(Error::ShapeMismatch {
            op,
            lhs: logits.shape().to_vec(),
            rhs: vec![targets.len()],
        });
    }
    Ok(())
}

fn target_error(op: &'static str, e: cpu::TargetOutOfRange) -> Error {
    Error::IndexOutOfRange { op, index: e.target as usize, bound: e.classes }
}

/// Mean softmax cross-entropy of `logits: [n, c]` (any dtype, computed in f32) against class
/// indices `targets: [n]`; rows whose target is `ignore_index` do not count.
///
/// # Errors
///
/// [`Error::ShapeMismatch`] if `targets.len() != n`; [`Error::IndexOutOfRange`] for a target
/// not below `c`; out of memory.
pub fn cross_entropy(
    logits: &Tensor,
    targets: &[u32],
    ignore_index: Option<u32>,
) -> Result<CrossEntropy> {
    const OP: &str = "cross_entropy";
    check(OP, logits, targets)?;
    let mut lse = output(OP, logits.device(), &[targets.len()], DType::F32)?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = logits.device().cuda_backend() {
        cpu::validate(targets, logits.shape()[1], ignore_index).map_err(|e| target_error(OP, e))?;
        let loss = if logits.shape()[1] == 0 {
            f32::NAN
        } else {
            cuda::cross_entropy(cu, logits, targets, ignore_index, &mut lse)?
        };
        return Ok(CrossEntropy { loss, lse });
    }
    let loss = with_dtype!(logits.dtype(), T => cpu::cross_entropy(
        logits.as_slice::<T>()?,
        targets,
        ignore_index,
        lse.as_mut_slice::<f32>()?,
    ))
    .map_err(|e| target_error(OP, e))?;
    Ok(CrossEntropy { loss, lse })
}

/// Gradient of [`cross_entropy`] with respect to the logits, for the upstream gradient
/// `dloss` of the scalar loss (1 for a plain loss, the loss scale under mixed precision).
///
/// # Errors
///
/// As [`cross_entropy`], and mismatches of `lse` (`[n]` f32 on the logits' device).
pub fn cross_entropy_backward(
    logits: &Tensor,
    targets: &[u32],
    ignore_index: Option<u32>,
    lse: &Tensor,
    dloss: f32,
) -> Result<Tensor> {
    const OP: &str = "cross_entropy_backward";
    check(OP, logits, targets)?;
    same_device(OP, logits, lse)?;
    expect_dtype(OP, DType::F32, lse)?;
    super::expect_shape(OP, &[targets.len()], lse)?;
    let mut dlogits = output_like(OP, logits)?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = logits.device().cuda_backend() {
        cpu::validate(targets, logits.shape()[1], ignore_index).map_err(|e| target_error(OP, e))?;
        cuda::cross_entropy_backward(cu, logits, targets, ignore_index, lse, dloss, &mut dlogits)?;
        return Ok(dlogits);
    }
    with_dtype!(logits.dtype(), T => cpu::cross_entropy_backward(
        logits.as_slice::<T>()?,
        targets,
        ignore_index,
        lse.as_slice::<f32>()?,
        dloss,
        dlogits.as_mut_slice::<T>()?,
    ))
    .map_err(|e| target_error(OP, e))?;
    Ok(dlogits)
}
