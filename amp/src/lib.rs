//! vram-amp: mixed precision for training loops: an autocast precision policy, a dynamic
//! loss scaler with the semantics of `torch.amp.GradScaler`, and f32 master weights with
//! low-precision working copies, all counted by the device's allocator.
//!
//! ```
//! use vram_amp::{LossScaler, MasterWeights, Optimizer, Sgd, StepOutcome, WeightLayout};
//! use vram_kernels::{DType, Device, SgdConfig, Tensor, ops};
//!
//! let dev = Device::host(64 << 20);
//! // One f32 linear layer trained in f16: working copies are cast once per step.
//! let w = Tensor::from_f32_slice(&dev, &[2, 3], &[0.1, 0.2, 0.3, -0.3, 0.2, 0.1], DType::F32)?;
//! let weights = MasterWeights::new(WeightLayout::CastPerStep(DType::F16), vec![w])?;
//! let cfg = SgdConfig { lr: 0.1, momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false };
//! let mut opt = Sgd::new(weights, cfg);
//! let mut scaler = LossScaler::default(); // init 2^16, growth 2, backoff 0.5, interval 2000
//!
//! let x = Tensor::from_f32_slice(&dev, &[2, 3], &[1., 2., 3., -1., 0., 1.], DType::F16)?;
//! let w16 = opt.weights_mut().forward_weights()?[0];
//! let logits = ops::linear(&x, w16, None)?.to_dtype(DType::F32)?; // the loss runs in f32
//! let ce = ops::cross_entropy(&logits, &[0, 1], None)?;
//! // Backward of `scale * loss`: the upstream gradient is the scale.
//! let dlogits = ops::cross_entropy_backward(&logits, &[0, 1], None, &ce.lse, scaler.scale())?;
//! let grads = ops::linear_backward(&x, w16, &dlogits.to_dtype(DType::F16)?, false)?;
//! opt.weights_mut().set_grad(0, grads.dw)?; // widened to the f32 master gradient
//!
//! assert_eq!(scaler.step(&mut opt)?, StepOutcome::Stepped); // unscales, checks, steps
//! scaler.update()?;
//! assert_eq!(scaler.growth_tracker(), 1);
//! // Misuse is an error, never a panic.
//! assert!(scaler.update().is_err()); // no inf check recorded since the last update
//! # Ok::<(), vram_amp::Error>(())
//! ```

pub mod autocast;
mod convert;
pub mod error;
pub mod master;
pub mod optim;
pub mod policy;
pub mod scaler;

pub use autocast::{AutocastGuard, Casted, autocast, disable_autocast};
pub use error::{Error, Result};
pub use master::{MasterWeights, MemoryBreakdown, WeightLayout};
pub use optim::{AdamW, Optimizer, OptimizerId, Sgd, clip_grad_norm};
pub use policy::{AutocastPolicy, OpClass, OpKind};
pub use scaler::{
    LossScaler, OptState, ScaleChange, ScalerConfig, ScalerCounters, ScalerState, StepOutcome,
};
pub use vram_kernels::DType;
