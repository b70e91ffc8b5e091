//! vram-accum: a layer-chain executor with gradient accumulation and activation
//! checkpointing, trading compute for memory.
//!
//! The crate is being built (see the project's issues); it currently re-exports the dtypes
//! its API is expressed in.

pub use vram_kernels::DType;
