//! vram-amp: mixed precision for training loops: an autocast precision policy, a dynamic
//! loss scaler with the semantics of `torch.amp.GradScaler`, and f32 master weights with
//! low-precision working copies, all counted by the device's allocator.
//!
//! The optimizers, the scaler and gradient clipping reach parameters through the small
//! [`Params`] visitor trait, so they work on a layer chain's parameters (vram-accum's
//! `Chain` implements it), on [`MasterWeights`] or on a model of the user's own.
//!
//! ```
//! use vram_amp::{AdamW, LossScaler, Optimizer, Param, Params, StepOutcome};
//! use vram_kernels::{AdamWConfig, DType, Device, Tensor, ops};
//!
//! let dev = Device::host(64 << 20);
//! // One linear layer kept in f16; AdamW keeps its f32 master copy.
//! let w = Tensor::from_f32_slice(&dev, &[2, 3], &[0.1, 0.2, 0.3, -0.3, 0.2, 0.1], DType::F16)?;
//! let mut params = vec![Param::new("w", w)];
//! let mut opt = AdamW::new(AdamWConfig { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 });
//! let mut scaler = LossScaler::default(); // init 2^16, growth 2, backoff 0.5, interval 2000
//!
//! let x = Tensor::from_f32_slice(&dev, &[2, 3], &[1., 2., 3., -1., 0., 1.], DType::F16)?;
//! let logits = ops::linear(&x, &params[0].value, None)?.to_dtype(DType::F32)?; // loss in f32
//! let ce = ops::cross_entropy(&logits, &[0, 1], None)?;
//! // Backward of `scale * loss`: the upstream gradient is the scale.
//! let dlogits = ops::cross_entropy_backward(&logits, &[0, 1], None, &ce.lse, scaler.scale())?;
//! let grads = ops::linear_backward(&x, &params[0].value, &dlogits.to_dtype(DType::F16)?, false)?;
//! params[0].accumulate_grad(grads.dw)?;
//!
//! assert_eq!(scaler.step(&mut opt, &mut params)?, StepOutcome::Stepped); // unscale, check, step
//! scaler.update()?;
//! params.zero_grad();
//! assert_eq!((scaler.growth_tracker(), opt.step_count(params[0].id())), (1, 1));
//! assert_eq!(opt.master_bytes(), 6 * 4);
//! // Misuse is an error, never a panic.
//! assert!(scaler.update().is_err()); // no inf check recorded since the last update
//! # Ok::<(), vram_amp::Error>(())
//! ```

pub mod autocast;
mod convert;
pub mod error;
pub mod master;
pub mod optim;
pub mod param;
pub mod policy;
pub mod scaler;

pub use autocast::{AutocastGuard, Casted, autocast, disable_autocast};
pub use error::{Error, Result};
pub use master::{MasterWeights, MemoryBreakdown, WeightLayout};
pub use optim::{AdamW, Optimizer, OptimizerId, Sgd, clip_grad_norm};
pub use param::{Param, ParamId, Params};
pub use policy::{AutocastPolicy, OpClass, OpKind};
pub use scaler::{
    LossScaler, OptState, ScaleChange, ScalerConfig, ScalerCounters, ScalerState, StepOutcome,
};
pub use vram_kernels::{AdamWConfig, DType, SgdConfig};
