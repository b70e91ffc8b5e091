//! Parameter storage for mixed precision: f32 master weights, the low-precision weights the
//! model computes with, and f32 gradients, all allocated from the device's allocator so
//! their cost shows in `Device::memory_allocated`.
//!
//! Two layouts (plus plain f32):
//! - [`WeightLayout::CastPerStep`] (autocast style): the parameters are f32; the low-precision
//!   working copies are cast once per step, on the first [`MasterWeights::forward_weights`]
//!   after the masters changed, and freed when the optimizer updates the masters.
//! - [`WeightLayout::LowPrecisionModel`] (apex O2 style): the model's weights live in the low
//!   dtype for good, with an f32 master copy the optimizer updates; after each update the
//!   masters are cast back into the model's weights in place.
//!
//! For parameters that live elsewhere (the layers of a chain) in a 16-bit dtype, the
//! optimizers keep the f32 masters themselves (see [`optim`](crate::optim)).

use crate::convert::cast_into;
use crate::error::{Error, Result};
use crate::param::{Param, Params};
use serde::{Deserialize, Serialize};
use vram_kernels::{DType, Tensor, ops};

/// Where the weights live and in which precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightLayout {
    /// f32 weights, no low-precision copy.
    F32,
    /// f32 parameters; low-precision working copies cast once per step.
    CastPerStep(DType),
    /// Low-precision model weights with an f32 master copy.
    LowPrecisionModel(DType),
}

/// Bytes of element data held, by category (the allocator reserves each tensor rounded up to
/// 512 bytes, so `Device::memory_allocated` is at least [`total`](Self::total)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryBreakdown {
    /// Weights the model computes with: the f32 parameters in [`WeightLayout::F32`], the live
    /// working copies in `CastPerStep`, the low-precision model in `LowPrecisionModel`.
    pub model_weights: u64,
    /// f32 master weights kept only because of mixed precision (0 in `F32`).
    pub master_weights: u64,
    /// Gradients held for the optimizer (f32).
    pub grads: u64,
    /// Optimizer state (momentum, Adam moments).
    pub optimizer_state: u64,
}

impl MemoryBreakdown {
    /// The sum of all categories.
    pub fn total(&self) -> u64 {
        self.model_weights + self.master_weights + self.grads + self.optimizer_state
    }
}

/// Parameters with f32 masters, f32 gradients and (per the layout) low-precision weights.
///
/// The masters are [`Param`]s and the container is [`Params`]: an optimizer steps the
/// masters, and [`Params::after_step`] brings the low-precision weights in line.
#[derive(Debug)]
pub struct MasterWeights {
    layout: WeightLayout,
    master: Vec<Param>,
    /// Low-precision weights: persistent (`LowPrecisionModel`) or this step's copies.
    model: Vec<Option<Tensor>>,
}

fn bytes<'a>(ts: impl IntoIterator<Item = &'a Tensor>) -> u64 {
    ts.into_iter().map(|t| t.size_in_bytes() as u64).sum()
}

impl MasterWeights {
    /// Takes `params` (any dtype) into `layout`: masters are f32 (an f32 parameter is kept as
    /// is, others are widened) and named by their index, and `LowPrecisionModel` also keeps
    /// each parameter in its low dtype (a parameter already in it is kept as is).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a layout whose dtype is f32; out of memory.
    pub fn new(layout: WeightLayout, params: Vec<Tensor>) -> Result<MasterWeights> {
        if let WeightLayout::CastPerStep(d) | WeightLayout::LowPrecisionModel(d) = layout
            && !d.is_low_precision()
        {
            return Err(Error::InvalidConfig {
                what: "MasterWeights::new",
                reason: format!("a mixed-precision layout needs f16 or bf16, got {d}"),
            });
        }
        let n = params.len();
        let mut master = Vec::with_capacity(n);
        let mut model = Vec::with_capacity(n);
        for (i, p) in params.into_iter().enumerate() {
            match layout {
                WeightLayout::LowPrecisionModel(low) => {
                    let m = p.to_dtype(DType::F32)?;
                    let low_p = if p.dtype() == low { p } else { p.to_dtype(low)? };
                    master.push(Param::new(i.to_string(), m));
                    model.push(Some(low_p));
                }
                _ => {
                    let m = if p.dtype() == DType::F32 { p } else { p.to_dtype(DType::F32)? };
                    master.push(Param::new(i.to_string(), m));
                    model.push(None);
                }
            }
        }
        Ok(MasterWeights { layout, master, model })
    }

    /// The layout.
    pub fn layout(&self) -> WeightLayout {
        self.layout
    }

    /// The number of parameters.
    pub fn len(&self) -> usize {
        self.master.len()
    }

    /// Whether there are no parameters.
    pub fn is_empty(&self) -> bool {
        self.master.is_empty()
    }

    /// The f32 master weights and their gradients (the parameters themselves in `F32` and
    /// `CastPerStep`).
    pub fn master(&self) -> &[Param] {
        &self.master
    }

    /// The weights the forward pass should use: the f32 parameters (`F32`), this step's
    /// working copies, cast now if the masters changed since the last cast (`CastPerStep`),
    /// or the low-precision model (`LowPrecisionModel`).
    ///
    /// # Errors
    ///
    /// Out of memory for the working copies.
    pub fn forward_weights(&mut self) -> Result<Vec<&Tensor>> {
        if let WeightLayout::CastPerStep(low) = self.layout {
            for (slot, m) in self.model.iter_mut().zip(&self.master) {
                if slot.is_none() {
                    *slot = Some(m.value.to_dtype(low)?);
                }
            }
        }
        Ok(match self.layout {
            WeightLayout::F32 => self.master.iter().map(|p| &p.value).collect(),
            _ => self.model.iter().flatten().collect(),
        })
    }

    /// Frees this step's working copies (`CastPerStep`); a no-op for the other layouts.
    pub fn release_working_copies(&mut self) {
        if let WeightLayout::CastPerStep(_) = self.layout {
            self.model.iter_mut().for_each(|m| *m = None);
        }
    }

    fn check_grad(&self, op: &'static str, i: usize, grad: &Tensor) -> Result<()> {
        let Some(p) = self.master.get(i) else {
            return Err(Error::InvalidArgument {
                op,
                reason: format!("parameter {i} does not exist; there are {}", self.len()),
            });
        };
        if p.value.shape() != grad.shape() {
            return Err(Error::InvalidArgument {
                op,
                reason: format!(
                    "gradient shape {:?} does not match parameter {i}'s {:?}",
                    grad.shape(),
                    p.value.shape()
                ),
            });
        }
        Ok(())
    }

    /// Sets parameter `i`'s gradient, widened to f32 if it is not (the backward of the
    /// autocast cast, or the copy into the master gradients).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a bad index or shape; out of memory.
    pub fn set_grad(&mut self, i: usize, grad: Tensor) -> Result<()> {
        self.check_grad("set_grad", i, &grad)?;
        let g = if grad.dtype() == DType::F32 { grad } else { grad.to_dtype(DType::F32)? };
        self.master[i].grad = Some(g);
        Ok(())
    }

    /// Adds `grad` (any dtype) into parameter `i`'s f32 gradient, creating it if absent.
    ///
    /// # Errors
    ///
    /// As [`set_grad`](Self::set_grad).
    pub fn accumulate_grad(&mut self, i: usize, grad: &Tensor) -> Result<()> {
        self.check_grad("accumulate_grad", i, grad)?;
        match &mut self.master[i].grad {
            Some(acc) => ops::add_assign(acc, grad)?,
            slot @ None => *slot = Some(grad.to_dtype(DType::F32)?),
        }
        Ok(())
    }

    /// Parameter `i`'s gradient, if set.
    pub fn grad(&self, i: usize) -> Option<&Tensor> {
        self.master.get(i).and_then(|p| p.grad.as_ref())
    }

    /// Bytes held by weights and gradients (`optimizer_state` is 0 here; add the optimizer's
    /// [`state_bytes`](crate::AdamW::state_bytes)).
    pub fn memory(&self) -> MemoryBreakdown {
        let master = bytes(self.master.iter().map(|p| &p.value));
        let low = bytes(self.model.iter().flatten());
        let (model_weights, master_weights) = match self.layout {
            WeightLayout::F32 => (master, 0),
            _ => (low, master),
        };
        MemoryBreakdown {
            model_weights,
            master_weights,
            grads: bytes(self.master.iter().filter_map(|p| p.grad.as_ref())),
            optimizer_state: 0,
        }
    }
}

impl Params for MasterWeights {
    fn params(&self) -> Vec<&Param> {
        self.master.iter().collect()
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        self.master.iter_mut().collect()
    }

    /// The masters changed: `CastPerStep` frees its working copies (cast again at the next
    /// [`forward_weights`](MasterWeights::forward_weights)), `LowPrecisionModel` rounds the
    /// masters into its weights.
    fn after_step(&mut self) -> Result<()> {
        match self.layout {
            WeightLayout::F32 => {}
            WeightLayout::CastPerStep(_) => self.release_working_copies(),
            WeightLayout::LowPrecisionModel(_) => {
                for (m, low) in self.master.iter().zip(self.model.iter_mut().flatten()) {
                    cast_into(&m.value, low)?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vram_kernels::Device;

    fn params(dev: &Device) -> Vec<Tensor> {
        vec![
            Tensor::from_f32_slice(dev, &[64, 32], &vec![0.1; 64 * 32], DType::F32).unwrap(),
            Tensor::from_f32_slice(dev, &[64], &vec![0.2; 64], DType::F32).unwrap(),
        ]
    }

    #[test]
    fn cast_per_step_copies_show_in_the_allocator_and_are_cast_once_per_step() {
        let dev = Device::host(64 << 20);
        let mut w =
            MasterWeights::new(WeightLayout::CastPerStep(DType::F16), params(&dev)).unwrap();
        let before = dev.memory_allocated();
        assert_eq!(w.memory().model_weights, 0);
        let n = w.forward_weights().unwrap().len();
        assert_eq!(n, 2);
        let with_copies = dev.memory_allocated();
        assert_eq!(w.memory().model_weights, (64 * 32 + 64) * 2);
        assert!(with_copies - before >= w.memory().model_weights);
        // A second call in the same step reuses the copies.
        w.forward_weights().unwrap();
        assert_eq!(dev.memory_allocated(), with_copies);
        assert_eq!(w.memory().master_weights, (64 * 32 + 64) * 4);
        // An update frees them.
        w.set_grad(1, Tensor::zeros(&dev, &[64], DType::F16).unwrap()).unwrap();
        w.after_step().unwrap();
        assert_eq!(w.memory().model_weights, 0);
    }

    #[test]
    fn low_precision_model_is_refreshed_from_the_masters_after_an_update() {
        let dev = Device::host(64 << 20);
        let mut w =
            MasterWeights::new(WeightLayout::LowPrecisionModel(DType::BF16), params(&dev)).unwrap();
        w.set_grad(1, Tensor::full(&dev, &[64], DType::BF16, 1.0).unwrap()).unwrap();
        assert_eq!(w.grad(1).unwrap().dtype(), DType::F32);
        for p in w.params_mut() {
            if let Some(g) = &p.grad {
                ops::axpy(-0.5, g, &mut p.value).unwrap();
            }
        }
        w.after_step().unwrap();
        let model = w.forward_weights().unwrap();
        assert_eq!(model[1].dtype(), DType::BF16);
        let want = half::bf16::from_f32(0.2 - 0.5).to_f32();
        assert!(model[1].to_f32_vec().unwrap().iter().all(|&v| v == want));
        assert_eq!(model[0].to_f32_vec().unwrap()[0], half::bf16::from_f32(0.1).to_f32());
    }

    #[test]
    fn bad_gradients_and_layouts_are_errors() {
        let dev = Device::host(64 << 20);
        let mut w = MasterWeights::new(WeightLayout::F32, params(&dev)).unwrap();
        let g = Tensor::zeros(&dev, &[3], DType::F32).unwrap();
        assert!(matches!(w.set_grad(1, g), Err(Error::InvalidArgument { .. })));
        let g = Tensor::zeros(&dev, &[64], DType::F32).unwrap();
        assert!(matches!(w.set_grad(7, g), Err(Error::InvalidArgument { .. })));
        let bad = MasterWeights::new(WeightLayout::CastPerStep(DType::F32), params(&dev));
        assert!(matches!(bad, Err(Error::InvalidConfig { .. })));
    }

    #[test]
    fn accumulate_grad_sums_into_f32() {
        let dev = Device::host(64 << 20);
        let mut w = MasterWeights::new(WeightLayout::F32, params(&dev)).unwrap();
        let g = Tensor::full(&dev, &[64], DType::F16, 0.5).unwrap();
        w.accumulate_grad(1, &g).unwrap();
        w.accumulate_grad(1, &g).unwrap();
        assert!(w.grad(1).unwrap().to_f32_vec().unwrap().iter().all(|&v| v == 1.0));
        assert_eq!(w.memory().grads, 64 * 4);
        w.zero_grad();
        assert!(w.grad(1).is_none());
    }
}
