//! Trainable parameters and the small visitor trait through which optimizers, the loss
//! scaler and gradient clipping reach them, wherever they live (a layer chain, a hand-written
//! model, [`MasterWeights`](crate::MasterWeights)).
//!
//! As in burn, a model does not hand its parameters to the optimizer once and for all: the
//! optimizer walks them at each step ([`Params::params_mut`]) and keys its per-parameter
//! state by [`ParamId`], as PyTorch keys it by the parameter object. A parameter without a
//! gradient is skipped, so its state (and its AdamW step count) stays as it was.

use crate::error::Result;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use vram_kernels::{Tensor, ops};

/// The identity of a [`Param`] for optimizer state. Each [`Param::new`] gets an id no other
/// parameter in the process has.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ParamId(u64);

impl ParamId {
    fn fresh() -> ParamId {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        ParamId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

impl fmt::Display for ParamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "param#{}", self.0)
    }
}

/// A trainable tensor and its accumulated gradient.
#[derive(Debug)]
pub struct Param {
    id: ParamId,
    /// Name for reports, e.g. `"fc1.weight"`.
    pub name: String,
    /// The value, in whatever dtype the model computes in. An optimizer keeps an f32 master
    /// copy of a 16-bit value (see [`Sgd`](crate::Sgd)).
    pub value: Tensor,
    /// The gradient accumulated since the last [`Param::zero_grad`]; `None` until a backward
    /// pass writes one (allocated lazily, as PyTorch does).
    pub grad: Option<Tensor>,
}

impl Param {
    /// A parameter with a fresh [`ParamId`] and no gradient yet.
    pub fn new(name: impl Into<String>, value: Tensor) -> Self {
        Param { id: ParamId::fresh(), name: name.into(), value, grad: None }
    }

    /// The parameter's identity (stable for its lifetime).
    pub fn id(&self) -> ParamId {
        self.id
    }

    /// Adds `g` into the gradient; the first gradient is taken as is (no copy).
    ///
    /// # Errors
    ///
    /// Shape, dtype or device mismatch with the gradient already held; out of memory.
    pub fn accumulate_grad(&mut self, g: Tensor) -> Result<()> {
        match &mut self.grad {
            Some(acc) => ops::add_assign(acc, &g)?,
            None => self.grad = Some(g),
        }
        Ok(())
    }

    /// Drops the gradient (`set_to_none=True`, PyTorch's default), freeing its memory.
    pub fn zero_grad(&mut self) {
        self.grad = None;
    }
}

/// Something holding trainable parameters: the visitor an optimizer, the loss scaler and
/// [`clip_grad_norm`](crate::clip_grad_norm) walk.
///
/// Both methods list the same parameters in the same order.
///
/// ```
/// use vram_amp::{Param, Params};
/// use vram_kernels::{DType, Device, Tensor};
///
/// struct TwoLayer {
///     w1: Param,
///     w2: Param,
/// }
///
/// impl Params for TwoLayer {
///     fn params(&self) -> Vec<&Param> {
///         vec![&self.w1, &self.w2]
///     }
///     fn params_mut(&mut self) -> Vec<&mut Param> {
///         vec![&mut self.w1, &mut self.w2]
///     }
/// }
///
/// let dev = Device::host(16 << 20);
/// let mut m = TwoLayer {
///     w1: Param::new("w1", Tensor::zeros(&dev, &[4], DType::F32)?),
///     w2: Param::new("w2", Tensor::zeros(&dev, &[2], DType::F32)?),
/// };
/// m.w1.accumulate_grad(Tensor::full(&dev, &[4], DType::F32, 1.0)?)?;
/// m.zero_grad();
/// assert!(m.params().iter().all(|p| p.grad.is_none()));
/// # Ok::<(), vram_amp::Error>(())
/// ```
pub trait Params {
    /// Every parameter, in a fixed order.
    fn params(&self) -> Vec<&Param>;

    /// Every parameter, mutably, in the same order.
    fn params_mut(&mut self) -> Vec<&mut Param>;

    /// Called by an optimizer after it changed parameter values, so that a container keeping
    /// copies derived from them (low-precision working weights) brings them in line. Does
    /// nothing by default.
    ///
    /// # Errors
    ///
    /// Whatever refreshing the copies fails with (out of memory).
    fn after_step(&mut self) -> Result<()> {
        Ok(())
    }

    /// Drops every gradient (`zero_grad(set_to_none=True)`).
    fn zero_grad(&mut self) {
        self.params_mut().into_iter().for_each(Param::zero_grad);
    }

    /// Every gradient that is set, in parameter order.
    fn grads_mut(&mut self) -> Vec<&mut Tensor> {
        self.params_mut().into_iter().filter_map(|p| p.grad.as_mut()).collect()
    }
}

impl Params for [Param] {
    fn params(&self) -> Vec<&Param> {
        self.iter().collect()
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        self.iter_mut().collect()
    }
}

impl Params for Vec<Param> {
    fn params(&self) -> Vec<&Param> {
        self.iter().collect()
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        self.iter_mut().collect()
    }
}

impl Params for Param {
    fn params(&self) -> Vec<&Param> {
        vec![self]
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        vec![self]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vram_kernels::{DType, Device};

    #[test]
    fn each_param_gets_its_own_id() {
        let dev = Device::host(16 << 20);
        let a = Param::new("a", Tensor::zeros(&dev, &[1], DType::F32).unwrap());
        let b = Param::new("a", Tensor::zeros(&dev, &[1], DType::F32).unwrap());
        assert_ne!(a.id(), b.id());
    }

    #[test]
    fn gradients_add_up_until_zeroed() {
        let dev = Device::host(16 << 20);
        let mut p = vec![Param::new("p", Tensor::zeros(&dev, &[2], DType::F32).unwrap())];
        for _ in 0..3 {
            p[0].accumulate_grad(Tensor::full(&dev, &[2], DType::F32, 0.5).unwrap()).unwrap();
        }
        assert_eq!(p.grads_mut()[0].to_f32_vec().unwrap(), [1.5, 1.5]);
        let wrong = Tensor::full(&dev, &[3], DType::F32, 0.5).unwrap();
        assert!(p[0].accumulate_grad(wrong).is_err());
        p.zero_grad();
        assert!(p.grads_mut().is_empty());
    }
}
