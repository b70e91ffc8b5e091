//! vram-accum: a layer-chain executor with gradient accumulation and activation
//! checkpointing, trading compute for memory.
//!
//! A [`Chain`] runs [`Layer`]s forward and backward under a [`Schedule`] of checkpointed
//! segments ([`CheckpointPlan`]: none, every k-th layer, sqrt(n), or the fastest plan
//! within a memory budget). A profiling pass ([`Chain::profile`]) measures each layer's
//! activation bytes and times, from which every plan's peak activation memory and extra
//! compute are predicted ([`ChainProfile::predict`]; what "activation memory" counts is set
//! out in [`plan`]). A [`GradAccumulator`] runs micro-batches in windows with one optimizer
//! step each.
//!
//! [`Chain::forward_hooked`] and [`Chain::backward_hooked`] call [`LayerHooks`] around
//! each layer (a checkpointed segment's layers before their recomputation too): what data
//! parallelism needs to gather a sharded layer's weights before it runs and reduce its
//! gradients once backward made them (vram-harness's `DpModel` over vram-parallel).
//!
//! A chain is a [`vram_amp::Params`]: vram-amp's optimizers, loss scaler and gradient
//! clipping work on its parameters directly, and [`StepHooks`] put them at the end of each
//! accumulation window.
//!
//! Layers run PyTorch's autocast recipe (f32 parameters, 16-bit matmuls, f32 norms,
//! softmax and losses, a cache of 16-bit parameter casts per step) under a context built
//! with [`ForwardCtx::with_autocast`]; see [`autocast`].
//!
//! ```
//! use vram_accum::layers::{Dropout, ResidualMlpConfig};
//! use vram_accum::{Chain, CheckpointPlan, ForwardCtx, Mode};
//! use vram_kernels::{DType, Device, Tensor};
//!
//! let dev = Device::host(256 << 20);
//! let mut chain = Chain::default();
//! for i in 0..9 {
//!     chain.push(ResidualMlpConfig::new(16, 32).with_seed(i).init(&dev)?);
//! }
//! chain.push(Dropout::new(&dev, 0.1)?);
//! let x = Tensor::full(&dev, &[4, 16], DType::F32, 0.5)?;
//!
//! let ctx = ForwardCtx::new(Mode::Train, 7);
//! let profile = chain.profile(&x, &ctx, false)?;
//! let schedule = CheckpointPlan::Sqrt.schedule(&profile)?;
//! let predicted = profile.predict(&schedule)?;
//!
//! // The first step also allocates the parameter gradients; later steps reuse them.
//! for first in [true, false] {
//!     let base = dev.memory_allocated();
//!     let scope = dev.stats_scope(); // measures this step's peak, the caller's stays
//!     let (y, tape) = chain.forward(&x, &mut ctx.clone(), &schedule)?;
//!     chain.backward(tape, y, false)?; // d(0.5 |y|^2)/dy = y
//!     let peak = scope.finish().allocated_bytes.all.peak as u64 - base;
//!     if first {
//!         assert_eq!(dev.memory_allocated() - base, predicted.grad_bytes);
//!         assert!(peak <= predicted.peak_bytes + predicted.grad_bytes);
//!     } else {
//!         assert_eq!(peak, predicted.peak_bytes);
//!     }
//! }
//! assert!(predicted.recompute > std::time::Duration::ZERO);
//! # Ok::<(), vram_accum::Error>(())
//! ```
//!
//! A training loop: windows of 4 micro-batches, SGD on the chain's parameters at the end of
//! each window (no `RefCell`: the accumulator lends the chain to the micro-batch and to the
//! hooks in turn).
//!
//! ```
//! use vram_accum::layers::{Activation, LinearConfig};
//! use vram_accum::{Chain, ForwardCtx, GradAccumulator, Mode, Normalization, Schedule, StepHooks};
//! use vram_amp::{LossScaler, Sgd, SgdConfig};
//! use vram_kernels::{DType, Device, Tensor, ops};
//!
//! let dev = Device::host(64 << 20);
//! let mut chain = Chain::default();
//! chain.push(LinearConfig::new(8, 16).with_seed(1).init(&dev)?);
//! chain.push(Activation::relu(&dev));
//! chain.push(LinearConfig::new(16, 3).with_seed(2).init(&dev)?);
//! let schedule = Schedule::none(chain.len())?;
//! let sgd = SgdConfig { lr: 0.1, momentum: 0.9, dampening: 0.0, weight_decay: 0.0, nesterov: false };
//! let mut hooks = StepHooks::new(Sgd::new(sgd), LossScaler::disabled());
//!
//! let x = Tensor::full(&dev, &[2, 8], DType::F32, 0.25)?;
//! let acc = GradAccumulator::new(4, Normalization::Mean)?;
//! let steps = acc.run_epoch(&[2; 8], &mut chain, &mut hooks, |chain, step| {
//!     let (logits, tape) = chain.forward(&x, &mut ForwardCtx::new(Mode::Train, 0), &schedule)?;
//!     let ce = ops::cross_entropy(&logits, &[0, 2], None)?;
//!     let dlogits = ops::cross_entropy_backward(&logits, &[0, 2], None, &ce.lse, step.dloss)?;
//!     chain.backward(tape, dlogits, false)?;
//!     Ok(())
//! })?;
//! assert_eq!(steps, 2);
//! assert!(chain.params().iter().all(|p| p.grad.is_none())); // dropped after each step
//! # Ok::<(), vram_accum::Error>(())
//! ```

mod accumulate;
pub mod autocast;
mod chain;
mod error;
mod layer;
pub mod layers;
pub mod plan;

pub use accumulate::{
    FnHooks, GradAccumulator, MicroStep, Normalization, StepHooks, StepReport, Window, WindowHooks,
};
pub use autocast::Autocast;
pub use chain::{Chain, ChainId, HookPass, LayerHooks, Tape};
pub use error::{Error, Result};
pub use layer::{BoxedLayer, ForwardCtx, Layer, Mode, Param, ParamId, SavedBox};
pub use plan::{ChainProfile, CheckpointPlan, LayerProfile, Prediction, Schedule, Segment};
pub use vram_amp::Params;
