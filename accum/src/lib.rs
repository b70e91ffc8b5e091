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
//! ```
//! use vram_accum::{Chain, CheckpointPlan, ForwardCtx, Mode, layers::{Dropout, ResidualMlp}};
//! use vram_kernels::{DType, Device, Tensor};
//!
//! let dev = Device::host(256 << 20);
//! let mut chain = Chain::default();
//! for i in 0..9 {
//!     chain.push(ResidualMlp::new(&dev, 16, 32, 0.0, DType::F32, i)?);
//! }
//! chain.push(Dropout::new(&dev, 0.1)?);
//! let x = Tensor::full(&dev, &[4, 16], DType::F32, 0.5)?;
//!
//! let ctx = ForwardCtx::new(Mode::Train, 7);
//! let profile = chain.profile(&x, &ctx, false)?;
//! let schedule = CheckpointPlan::Sqrt.schedule(&profile)?;
//! let predicted = profile.predict(&schedule)?;
//!
//! // Warm up once so parameter gradients exist (the steady state), then measure a step.
//! for measure in [false, true] {
//!     let base = dev.memory_allocated();
//!     dev.reset_peak_stats();
//!     let (y, tape) = chain.forward(&x, &mut ctx.clone(), &schedule)?;
//!     chain.backward(tape, y, false)?; // d(0.5 |y|^2)/dy = y
//!     if measure {
//!         assert_eq!(dev.max_memory_allocated() - base, predicted.peak_bytes);
//!     }
//! }
//! assert!(predicted.recompute > std::time::Duration::ZERO);
//! # Ok::<(), vram_accum::Error>(())
//! ```

mod accumulate;
mod chain;
mod error;
mod layer;
pub mod layers;
pub mod plan;

pub use accumulate::{FnHooks, GradAccumulator, MicroStep, Normalization, Window, WindowHooks};
pub use chain::{Chain, Tape};
pub use error::{Error, Result};
pub use layer::{ForwardCtx, Layer, Mode, Param, Saved};
pub use plan::{ChainProfile, CheckpointPlan, LayerProfile, Prediction, Schedule, Segment};
