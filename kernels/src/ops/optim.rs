//! Fused optimizer steps on f32 parameters and state, and the fused gradient unscale with
//! non-finite check of dynamic loss scaling. All update their tensors in place.

use super::{expect_dtype, invalid, same_device, with_dtype};
use crate::cpu::optim as cpu;
use crate::cpu::optim::{AdamWConfig, SgdConfig};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Checks an f32 state tensor (parameters, moments) against the gradient.
fn check_state(op: &'static str, state: &Tensor, grads: &Tensor) -> Result<()> {
    same_device(op, state, grads)?;
    expect_dtype(op, DType::F32, state)?;
    if state.shape() != grads.shape() {
        return Err(Error::ShapeMismatch {
            op,
            lhs: state.shape().to_vec(),
            rhs: grads.shape().to_vec(),
        });
    }
    Ok(())
}

/// One SGD step (`torch.optim.SGD`) on f32 `params` with gradients `grads` of any dtype.
///
/// With `cfg.momentum != 0`, `momentum_buf` (f32, `params`' shape) holds the momentum;
/// `first_step` says it is not initialized yet (it then becomes the gradient itself). With
/// `momentum == 0` no buffer is needed.
///
/// # Errors
///
/// [`Error::DTypeMismatch`] for non-f32 parameters or buffer; [`Error::ShapeMismatch`];
/// [`Error::InvalidArgument`] for a missing buffer, or Nesterov without momentum or with
/// dampening. Nothing is updated on error.
pub fn sgd_step(
    params: &mut Tensor,
    grads: &Tensor,
    mut momentum_buf: Option<&mut Tensor>,
    first_step: bool,
    cfg: &SgdConfig,
) -> Result<()> {
    const OP: &str = "sgd_step";
    check_state(OP, params, grads)?;
    if cfg.nesterov && (cfg.momentum <= 0.0 || cfg.dampening != 0.0) {
        return Err(invalid(OP, "Nesterov momentum needs momentum > 0 and dampening 0"));
    }
    params.make_unique()?;
    if let Some(buf) = momentum_buf.as_deref_mut() {
        buf.make_unique()?;
    }
    #[cfg(feature = "cuda")]
    if let Some(cu) = grads.device().cuda_backend() {
        let buf = match momentum_buf {
            _ if cfg.momentum == 0.0 => None,
            Some(buf) => {
                check_state(OP, buf, grads)?;
                Some(buf)
            }
            None => return Err(invalid(OP, "momentum != 0 needs a momentum buffer")),
        };
        return crate::cuda::ops::nn::sgd_step(cu, params, grads, buf, first_step, cfg);
    }
    let mut empty: [f32; 0] = [];
    let buf: &mut [f32] = match momentum_buf {
        _ if cfg.momentum == 0.0 => &mut empty,
        Some(buf) => {
            check_state(OP, buf, grads)?;
            buf.as_mut_slice::<f32>()?
        }
        None => return Err(invalid(OP, "momentum != 0 needs a momentum buffer")),
    };
    let p = params.as_mut_slice::<f32>()?;
    with_dtype!(grads.dtype(), T => cpu::sgd_step(p, grads.as_slice::<T>()?, buf, first_step, cfg));
    Ok(())
}

/// One AdamW step (`torch.optim.AdamW`) on f32 `params` with gradients of any dtype;
/// `exp_avg` and `exp_avg_sq` are the f32 moment buffers (zeros before the first step) and
/// `step` the 1-based step count used for bias correction.
///
/// # Errors
///
/// [`Error::DTypeMismatch`], [`Error::ShapeMismatch`] for the state tensors;
/// [`Error::InvalidArgument`] for `step == 0`. Nothing is updated on error.
pub fn adamw_step(
    params: &mut Tensor,
    grads: &Tensor,
    exp_avg: &mut Tensor,
    exp_avg_sq: &mut Tensor,
    step: u32,
    cfg: &AdamWConfig,
) -> Result<()> {
    const OP: &str = "adamw_step";
    for state in [&*params, &*exp_avg, &*exp_avg_sq] {
        check_state(OP, state, grads)?;
    }
    if step == 0 {
        return Err(invalid(OP, "the step count is 1-based; the first step is 1"));
    }
    for state in [&mut *params, &mut *exp_avg, &mut *exp_avg_sq] {
        state.make_unique()?;
    }
    #[cfg(feature = "cuda")]
    if let Some(cu) = grads.device().cuda_backend() {
        return crate::cuda::ops::nn::adamw_step(cu, params, grads, exp_avg, exp_avg_sq, step, cfg);
    }
    let (p, m, v) = (
        params.as_mut_slice::<f32>()?,
        exp_avg.as_mut_slice::<f32>()?,
        exp_avg_sq.as_mut_slice::<f32>()?,
    );
    with_dtype!(grads.dtype(), T => cpu::adamw_step(p, grads.as_slice::<T>()?, m, v, step, cfg));
    Ok(())
}

/// Multiplies every gradient by `inv_scale` in place and returns whether any element was or
/// became inf or NaN (PyTorch's `_amp_foreach_non_finite_check_and_unscale_`). Every tensor
/// is unscaled even after a non-finite value is found; dtypes may differ between tensors.
///
/// # Errors
///
/// [`Error::DeviceMismatch`] if the tensors are not on one device; nothing is changed then.
pub fn unscale_and_check_finite(grads: &mut [&mut Tensor], inv_scale: f32) -> Result<bool> {
    const OP: &str = "unscale_and_check_finite";
    if let Some((first, rest)) = grads.split_first() {
        for g in rest {
            same_device(OP, first, g)?;
        }
    }
    for g in grads.iter_mut() {
        g.make_unique()?;
    }
    #[cfg(feature = "cuda")]
    if let Some(device) = grads.first().map(|g| g.device().clone())
        && let Some(cu) = device.cuda_backend()
    {
        return crate::cuda::ops::nn::unscale_and_check_finite(cu, grads, inv_scale);
    }
    let mut found = false;
    for g in grads.iter_mut() {
        found |= with_dtype!(g.dtype(), T => {
            cpu::unscale_and_check_finite([g.as_mut_slice::<T>()?], inv_scale)
        });
    }
    Ok(found)
}
