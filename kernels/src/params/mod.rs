//! What an op takes besides its tensors: the geometry of matrix products, convolutions and
//! pooling windows ([`MatmulSpec`], [`Conv2dParams`], [`Pool2dParams`] and their options),
//! the optimizers' hyper-parameters ([`SgdConfig`], [`AdamWConfig`]) and attention's
//! settings ([`AttentionParams`], [`AttentionDims`]).
//!
//! This module sits below the three that read it: `ops/` builds these values (checked) from
//! shapes and user options, and the CPU reference (`cpu/`) and the CUDA launches (`cuda/`)
//! compute from them; it imports nothing of theirs. The types are public at the crate root
//! and in `ops`.

mod attention;
mod geometry;
mod optim;

pub use attention::{AttentionDims, AttentionLayout, AttentionParams};
#[cfg(feature = "cuda")]
pub(crate) use geometry::Window2d;
pub use geometry::{
    Conv2dOptions, Conv2dParams, ConvLayout, DIRECT_MAX_MACS, MatmulSpec, Pool2dOptions,
    Pool2dParams,
};
pub(crate) use geometry::{mul, product};
pub use optim::{AdamWConfig, SgdConfig};
