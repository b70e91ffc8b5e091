//! vram-kernels: devices, tensors (f32/f16/bf16) and the ops training needs, forward and
//! backward.
//!
//! A [`Device`] owns a caching allocator ([`vram_alloc::CachingAllocator`]); every
//! [`Tensor`] owns one block from it, so every byte a model holds shows in the device's
//! statistics (`memory_allocated`, peaks, `memory_summary`, snapshots) exactly as PyTorch
//! would report it on a GPU. Ops ([`ops`]) check shapes, dtypes and devices, allocate their
//! outputs from the input's device and compute there: on the host with the CPU reference
//! ([`cpu`]), on a CUDA device ([`Device::cuda`], feature `cuda`, on by default) with NVRTC-
//! compiled kernels and cuBLAS. Storage is in the tensor's dtype, arithmetic in f32, on both.
//! Among the ops: fused scaled dot-product attention ([`ops::attention`], FlashAttention-2's
//! algorithm: saves the output and each row's logsumexp, never a `seq x seq` buffer; reads
//! heads-major or tokens-major operands, so a projection's output goes in without a copy,
//! and grouped-query keys and values without repeating them; its 16-bit forward and
//! backward run on tensor cores), and a linear layer with its bias and
//! GELU in one cuBLASLt call ([`ops::linear_act`]; f32 products in FP32 unless
//! [`Device::set_allow_tf32_matmul`]).
//! The CUDA libraries are loaded at run time, so a CUDA build runs on a machine without a
//! GPU: [`Device::auto`] then picks the host.
//!
//! ```
//! use vram_kernels::{DType, Device, Tensor, ops};
//!
//! let dev = Device::host(64 << 20);
//! // A linear layer with 3 inputs and 2 classes on a batch of 2, in bf16.
//! let x = Tensor::from_f32_slice(&dev, &[2, 3], &[1., 2., 3., -1., 0., 1.], DType::BF16)?;
//! let w = Tensor::from_f32_slice(&dev, &[2, 3], &[0.1, 0.2, 0.3, -0.3, 0.2, 0.1], DType::BF16)?;
//! let logits = ops::linear(&x, &w, None)?;
//! assert_eq!(logits.shape(), &[2, 2]);
//!
//! let ce = ops::cross_entropy(&logits, &[0, 1], None)?;
//! assert!(ce.loss.is_finite());
//! let dlogits = ops::cross_entropy_backward(&logits, &[0, 1], None, &ce.lse, 1.0)?;
//! let grads = ops::linear_backward(&x, &w, &dlogits, false)?;
//! assert_eq!(grads.dw.shape(), w.shape());
//!
//! // Every live tensor is counted; dropping one returns its bytes to the cache.
//! let live = dev.memory_allocated();
//! assert!(live >= (x.size_in_bytes() + w.size_in_bytes()) as u64);
//! drop(grads);
//! assert!(dev.memory_allocated() < live);
//!
//! // Mismatches are errors that name the op and the shapes, never panics.
//! let err = ops::add(&x, &logits).unwrap_err();
//! assert_eq!(err.to_string(), "add: shape mismatch between [2, 3] and [2, 2]");
//! # Ok::<(), vram_kernels::Error>(())
//! ```

pub mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
pub mod cudnn_choices;
pub mod custom;
pub mod device;
pub mod dtype;
pub mod error;
pub mod ops;
mod params;
pub mod profile;
mod storage;
pub mod tensor;
pub mod transfer;

pub use device::{
    CONV_BACKEND_ENV_VAR, ConvBackend, ConvPath, DEVICE_ENV_VAR, Device, LinearPath,
    default_blas_workspace_size,
};
pub use dtype::{DType, Element};
pub use error::{Error, Result};
pub use params::{
    AdamWConfig, AttentionDims, AttentionLayout, AttentionParams, Conv2dOptions, Conv2dParams,
    ConvLayout, MatmulSpec, Pool2dOptions, Pool2dParams, SgdConfig,
};
pub use profile::OpTime;
pub use tensor::{Indices, Tensor};
pub use transfer::{PinnedBuffer, Upload};

/// The `half` crate, whose `f16` and `bf16` are the 16-bit element types.
pub use half;
/// The allocator items this crate's API takes and returns.
pub use vram_alloc::{
    AllocatorConfig, MemInfo, MemoryStats, Snapshot, StatsScope, TraceAction, TraceEntry,
};
