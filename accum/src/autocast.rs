//! Autocast in the layers: the recipe of PyTorch's `torch.autocast` / `torch.cuda.amp`, run
//! by a [`ForwardCtx`](crate::ForwardCtx) built with
//! [`with_autocast`](crate::ForwardCtx::with_autocast).
//!
//! The parameters stay f32 (no master copy: gradients and optimizer state are f32 too). Each
//! layer asks the context's [`AutocastPolicy`] (vram-amp's table, which follows PyTorch's
//! op lists in `aten/src/ATen/autocast_mode.h`) what its ops compute in:
//!
//! - linear and matmul (`AT_FORALL_LOWER_PRECISION_FP`): inputs cast to the low dtype, output
//!   low; their 16-bit inputs are what they save for backward;
//! - layer norm, softmax, log-softmax and the losses (`AT_FORALL_FP32`,
//!   `AT_FORALL_FP32_SET_OPT_DTYPE`): inputs cast to f32, output f32;
//! - everything else falls through (`TORCH_LIBRARY_IMPL(_, Autocast, m)`'s fallthrough):
//!   GELU, ReLU and dropout keep their input's dtype, and an addition of f32 and 16-bit
//!   tensors is computed in f32 (ATen's own type promotion), so the residual stream stays f32.
//!
//! Casts of f32 parameters to the low dtype are cached for the duration of the autocast
//! region, one cast per parameter however often it is used: PyTorch's `cached_cast` in
//! `aten/src/ATen/autocast_mode.cpp` caches exactly these (f32 leaves requiring grad cast to
//! the lower-precision type) and `clear_cache` empties the cache when the outermost autocast
//! region exits, which a training step does after its forward and loss
//! ([`ForwardCtx::clear_autocast_cache`](crate::ForwardCtx::clear_autocast_cache)). A cast
//! saved for backward lives on until that layer's backward, as PyTorch's saved tensors do.
//!
//! In backward a layer does what autograd does through a `to(dtype)` node: the input
//! gradient goes back in the input's own dtype, and a parameter's 16-bit gradient is cast to
//! f32 and accumulated into its f32 [`Param::grad`]. (A parameter used twice gets each use's
//! gradient cast and summed in f32; PyTorch sums the two 16-bit gradients of the cached copy
//! first, in 16 bits, then casts once: the same memory, a slightly more exact sum here.)

use crate::error::{Error, Result};
use crate::layer::Param;
use std::collections::HashMap;
use vram_amp::ParamId;
use vram_kernels::{DType, Tensor};

pub use vram_amp::{AutocastPolicy, OpClass, OpKind};

/// The autocast state of a forward: the policy and the cache of parameter casts.
#[derive(Clone, Debug)]
pub struct Autocast {
    policy: AutocastPolicy,
    cache: HashMap<ParamId, Tensor>,
    casts: u64,
}

impl Autocast {
    /// Autocast with `policy` and an empty cache.
    pub fn new(policy: AutocastPolicy) -> Self {
        Autocast { policy, cache: HashMap::new(), casts: 0 }
    }

    /// The policy.
    pub fn policy(&self) -> &AutocastPolicy {
        &self.policy
    }

    /// The low-precision dtype (f16 or bf16).
    pub fn low_dtype(&self) -> DType {
        self.policy.low_dtype()
    }

    /// Parameters whose cast is in the cache.
    pub fn cached(&self) -> usize {
        self.cache.len()
    }

    /// Bytes of the cached casts.
    pub fn cached_bytes(&self) -> u64 {
        self.cache.values().map(|t| t.size_in_bytes() as u64).sum()
    }

    /// Parameter casts made through the cache since this state was created (a hit makes
    /// none).
    pub fn param_casts(&self) -> u64 {
        self.casts
    }

    /// Empties the cache (PyTorch's `torch.clear_autocast_cache`, which leaving the outermost
    /// autocast region calls). Casts that layers saved for backward stay alive until then.
    pub fn clear_cache(&mut self) {
        self.cache.clear();
    }

    /// `p`'s value in `dtype`. A cast of an f32 parameter to the low dtype is cached
    /// (`cached_cast` in PyTorch's `autocast_mode.cpp`); other casts are not; a parameter
    /// already in `dtype` is shared, not copied.
    ///
    /// # Errors
    ///
    /// Out of memory for the copy.
    pub fn cast_param(&mut self, p: &Param, dtype: DType) -> Result<Tensor> {
        if p.value.dtype() == dtype {
            return Ok(p.value.clone());
        }
        let cacheable = dtype == self.low_dtype() && p.value.dtype() == DType::F32;
        if !cacheable {
            return Ok(p.value.to_dtype(dtype)?);
        }
        if let Some(t) = self.cache.get(&p.id()) {
            return Ok(t.clone());
        }
        let t = p.value.to_dtype(dtype)?;
        self.casts += 1;
        self.cache.insert(p.id(), t.clone());
        Ok(t)
    }
}

/// `t` in `dtype`: `t` itself (shared, no copy) when it has that dtype, else a copy.
///
/// # Errors
///
/// Out of memory for the copy.
pub fn cast(t: &Tensor, dtype: DType) -> Result<Tensor> {
    if t.dtype() == dtype { Ok(t.clone()) } else { Ok(t.to_dtype(dtype)?) }
}

/// `t` in `dtype`, consuming it: `t` itself when it has that dtype, else a copy (and `t` is
/// freed here).
///
/// # Errors
///
/// Out of memory for the copy.
pub fn cast_into(t: Tensor, dtype: DType) -> Result<Tensor> {
    if t.dtype() == dtype { Ok(t) } else { Ok(t.to_dtype(dtype)?) }
}

/// Adds a gradient computed in another dtype into `p`'s gradient, cast to `p`'s dtype first
/// (the backward of a `to(dtype)` node).
///
/// # Errors
///
/// Out of memory; a shape mismatch.
pub fn accumulate_grad_cast(p: &mut Param, g: Tensor) -> Result<()> {
    let g = if g.dtype() == p.value.dtype() { g } else { g.to_dtype(p.value.dtype())? };
    Ok(p.accumulate_grad(g)?)
}

/// The error of a layer without autocast rules.
pub(crate) fn unsupported(layer: String) -> Error {
    Error::AutocastUnsupported { layer }
}
