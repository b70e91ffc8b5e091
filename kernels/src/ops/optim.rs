//! Fused optimizer steps on f32 parameters and state, and the fused gradient unscale with
//! non-finite check of dynamic loss scaling. All update their tensors in place.

use super::dispatch::{Buffers, Op, Plan, run};
use super::{expect_dtype, invalid, same_device};
use crate::cpu::optim as cpu;
use crate::device::Device;
use crate::dtype::{DType, with_dtype};
use crate::error::{Error, Result};
use crate::params::{AdamWConfig, SgdConfig};
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
/// [`Error::InvalidArgument`] for an invalid `cfg` ([`SgdConfig::validate`]: a NaN or
/// negative learning rate, Nesterov without momentum, ...) or a missing buffer;
/// [`Error::DTypeMismatch`] for non-f32 parameters or buffer; [`Error::ShapeMismatch`].
/// Nothing is updated on error.
pub fn sgd_step(
    params: &mut Tensor,
    grads: &Tensor,
    momentum_buf: Option<&mut Tensor>,
    first_step: bool,
    cfg: &SgdConfig,
) -> Result<()> {
    run(Sgd { params, grads, buf: momentum_buf, first_step, cfg })
}

struct Sgd<'a> {
    params: &'a mut Tensor,
    grads: &'a Tensor,
    buf: Option<&'a mut Tensor>,
    first_step: bool,
    cfg: &'a SgdConfig,
}

impl Op for Sgd<'_> {
    const NAME: &'static str = "sgd_step";
    type Outs = ();
    type Output = ();

    fn device(&self) -> &Device {
        self.grads.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        self.cfg.validate()?;
        check_state(Self::NAME, self.params, self.grads)?;
        if self.cfg.momentum == 0.0 {
            self.buf = None;
        } else {
            let buf = self
                .buf
                .as_deref()
                .ok_or_else(|| invalid(Self::NAME, "momentum != 0 needs a momentum buffer"))?;
            check_state(Self::NAME, buf, self.grads)?;
        }
        self.params.make_unique()?;
        if let Some(buf) = self.buf.as_deref_mut() {
            buf.make_unique()?;
        }
        Ok(Plan::none())
    }

    fn host(&mut self, _: &mut Buffers<Self::Outs>) -> Result<()> {
        let mut empty: [f32; 0] = [];
        let buf = match self.buf.as_deref_mut() {
            Some(buf) => buf.as_mut_slice::<f32>()?,
            None => &mut empty,
        };
        let p = self.params.as_mut_slice::<f32>()?;
        let (first, cfg) = (self.first_step, self.cfg);
        with_dtype!(self.grads.dtype(), T => {
            cpu::sgd_step(p, self.grads.as_slice::<T>()?, buf, first, cfg)
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, _: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::{Arg, helpers::ptr, launch::elementwise as grid, registry::SGD};
        let n = self.params.numel();
        let buf = match self.buf.as_deref() {
            Some(b) => ptr(b)?,
            None => Arg::Ptr(0),
        };
        let [lr, mo, da, wd, ne, fi] = sgd_scalars(self.cfg, self.first_step);
        // SAFETY: sgd_T(float* p, const T* g, float* buf, u64 n, float lr, float momentum,
        // float dampening, float wd, u32 nesterov, u32 first_step); params, grads and (with
        // momentum) buf hold n elements; without momentum buf is never read.
        unsafe {
            gpu.launch(
                SGD.of(self.grads.dtype()),
                grid(n),
                &[ptr(self.params)?, ptr(self.grads)?, buf, Arg::count(n), lr, mo, da, wd, ne, fi],
            )
        }
    }

    fn finish(self, _: Buffers<Self::Outs>) -> Result<()> {
        Ok(())
    }
}

/// The scalar arguments of `sgd_T` after its pointers and count: lr, momentum, dampening,
/// weight decay, nesterov, first step.
#[cfg(feature = "cuda")]
pub(crate) fn sgd_scalars(cfg: &SgdConfig, first_step: bool) -> [crate::cuda::Arg; 6] {
    use crate::cuda::Arg;
    [
        Arg::F32(cfg.lr),
        Arg::F32(cfg.momentum),
        Arg::F32(cfg.dampening),
        Arg::F32(cfg.weight_decay),
        Arg::U32(cfg.nesterov as u32),
        Arg::U32(first_step as u32),
    ]
}

/// The scalar arguments of `adamw_T` after its pointers and count: beta1, beta2, eps and
/// step `step`'s [`AdamWConfig::step_scalars`].
#[cfg(feature = "cuda")]
pub(crate) fn adamw_scalars(cfg: &AdamWConfig, step: u32) -> [crate::cuda::Arg; 6] {
    use crate::cuda::Arg;
    let (step_size, bias2_sqrt, decay) = cfg.step_scalars(step);
    [cfg.beta1, cfg.beta2, cfg.eps, step_size, bias2_sqrt, decay].map(Arg::F32)
}

/// One AdamW step (`torch.optim.AdamW`) on f32 `params` with gradients of any dtype;
/// `exp_avg` and `exp_avg_sq` are the f32 moment buffers (zeros before the first step) and
/// `step` the 1-based step count used for bias correction.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for an invalid `cfg` ([`AdamWConfig::validate`]: a beta of 1,
/// a negative eps, ...) or `step == 0`; [`Error::DTypeMismatch`], [`Error::ShapeMismatch`]
/// for the state tensors. Nothing is updated on error.
pub fn adamw_step(
    params: &mut Tensor,
    grads: &Tensor,
    exp_avg: &mut Tensor,
    exp_avg_sq: &mut Tensor,
    step: u32,
    cfg: &AdamWConfig,
) -> Result<()> {
    run(AdamW { params, grads, exp_avg, exp_avg_sq, step, cfg })
}

struct AdamW<'a> {
    params: &'a mut Tensor,
    grads: &'a Tensor,
    exp_avg: &'a mut Tensor,
    exp_avg_sq: &'a mut Tensor,
    step: u32,
    cfg: &'a AdamWConfig,
}

impl Op for AdamW<'_> {
    const NAME: &'static str = "adamw_step";
    type Outs = ();
    type Output = ();

    fn device(&self) -> &Device {
        self.grads.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        self.cfg.validate()?;
        for state in [&*self.params, &*self.exp_avg, &*self.exp_avg_sq] {
            check_state(Self::NAME, state, self.grads)?;
        }
        if self.step == 0 {
            return Err(invalid(Self::NAME, "the step count is 1-based; the first step is 1"));
        }
        for state in [&mut *self.params, &mut *self.exp_avg, &mut *self.exp_avg_sq] {
            state.make_unique()?;
        }
        Ok(Plan::none())
    }

    fn host(&mut self, _: &mut Buffers<Self::Outs>) -> Result<()> {
        let (p, m, v) = (
            self.params.as_mut_slice::<f32>()?,
            self.exp_avg.as_mut_slice::<f32>()?,
            self.exp_avg_sq.as_mut_slice::<f32>()?,
        );
        let (step, cfg) = (self.step, self.cfg);
        with_dtype!(self.grads.dtype(), T => {
            cpu::adamw_step(p, self.grads.as_slice::<T>()?, m, v, step, cfg)
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, _: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::{Arg, helpers::ptr, launch::elementwise as grid, registry::ADAMW};
        let n = self.params.numel();
        let [b1, b2, eps, step_size, bias2_sqrt, decay] = adamw_scalars(self.cfg, self.step);
        // SAFETY: adamw_T(float* p, const T* g, float* m, float* v, u64 n, float b1, float
        // b2, float eps, float step_size, float bias2_sqrt, float decay); all four tensors
        // hold n elements.
        unsafe {
            gpu.launch(
                ADAMW.of(self.grads.dtype()),
                grid(n),
                &[
                    ptr(self.params)?,
                    ptr(self.grads)?,
                    ptr(self.exp_avg)?,
                    ptr(self.exp_avg_sq)?,
                    Arg::count(n),
                    b1,
                    b2,
                    eps,
                    step_size,
                    bias2_sqrt,
                    decay,
                ],
            )
        }
    }

    fn finish(self, _: Buffers<Self::Outs>) -> Result<()> {
        Ok(())
    }
}

/// Multiplies every gradient by `inv_scale` in place and returns whether any element was or
/// became inf or NaN (PyTorch's `_amp_foreach_non_finite_check_and_unscale_`). Every tensor
/// is unscaled even after a non-finite value is found; dtypes may differ between tensors.
/// On a virtual device, which holds no values, nothing is found (`false`).
///
/// # Errors
///
/// [`Error::DeviceMismatch`] if the tensors are not on one device; nothing is changed then.
pub fn unscale_and_check_finite(grads: &mut [&mut Tensor], inv_scale: f32) -> Result<bool> {
    let Some(device) = grads.first().map(|g| g.device().clone()) else {
        return Ok(false);
    };
    run(Unscale { device, grads, inv_scale, found: false, flag: None })
}

struct Unscale<'a, 'g> {
    device: Device,
    grads: &'a mut [&'g mut Tensor],
    inv_scale: f32,
    found: bool,
    /// The device's found-non-finite flag, one u32.
    flag: Option<usize>,
}

impl Op for Unscale<'_, '_> {
    const NAME: &'static str = "unscale_and_check_finite";
    type Outs = ();
    type Output = bool;

    fn device(&self) -> &Device {
        &self.device
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        if let Some((first, rest)) = self.grads.split_first() {
            for g in rest {
                same_device(Self::NAME, first, g)?;
            }
        }
        for g in self.grads.iter_mut() {
            g.make_unique()?;
        }
        let mut plan = Plan::none();
        self.flag = plan.zeroed_workspace(4);
        Ok(plan)
    }

    fn host(&mut self, _: &mut Buffers<Self::Outs>) -> Result<()> {
        for g in self.grads.iter_mut() {
            self.found |= with_dtype!(g.dtype(), T => {
                cpu::unscale_and_check_finite([g.as_mut_slice::<T>()?], self.inv_scale)
            });
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::{Arg, helpers::ptr, launch::elementwise as grid, registry::UNSCALE};
        let flag = bufs.ws(self.flag)?;
        for g in self.grads.iter() {
            let n = g.numel();
            // SAFETY: unscale_T(T* g, float inv, u64 n, u32* flag); g holds n elements, flag
            // one u32.
            unsafe {
                gpu.launch(
                    UNSCALE.of(g.dtype()),
                    grid(n),
                    &[ptr(g)?, Arg::F32(self.inv_scale), Arg::count(n), Arg::Ptr(flag)],
                )?;
            }
        }
        let mut out = [0u8; 4];
        gpu.copy_to_host(&mut out, flag)?;
        self.found = u32::from_ne_bytes(out) != 0;
        Ok(())
    }

    fn finish(self, _: Buffers<Self::Outs>) -> Result<bool> {
        Ok(self.found)
    }
}
