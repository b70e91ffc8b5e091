//! vram-alloc: a caching device-memory allocator.

#[cfg(feature = "cuda")]
pub mod cuda;
