//! vram-kernels: devices, tensors (f32/f16/bf16) and the ops training needs.

pub mod cpu;
pub mod dtype;

pub use dtype::{DType, Element};
