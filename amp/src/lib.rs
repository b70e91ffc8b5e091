//! vram-amp: mixed precision for training loops: autocast policy, dynamic loss scaling and
//! f32 master weights with PyTorch's semantics.
//!
//! The crate is being built (see the project's issues); it currently re-exports the dtypes
//! its API is expressed in.

pub use vram_kernels::DType;
