//! Ops on [`Tensor`]s, forward and backward, each described once: its checks, what it
//! allocates, its host code and its CUDA launches, run through one dispatch function
//! (`dispatch`).
//!
//! Every op validates before it allocates and allocates before it writes, so an error (out
//! of memory included) leaves its inputs as they were. An op allocates exactly the same
//! buffers on the host, on a virtual device and on a GPU (outputs, the GPU's workspaces and
//! the cuBLAS workspace), so the memory statistics of all three agree. Arithmetic is in f32
//! whatever the storage dtype. Backward ops take what the forward saved and return fresh
//! gradient tensors; the in-place ops (`add_assign`, `axpy`, optimizer steps, unscale) name
//! it. Fused attention ([`attention`], [`attention_backward`]) saves its output and row
//! logsumexps and recomputes the probabilities backward, as FlashAttention-2 does. The
//! geometry and configuration types the ops take ([`MatmulSpec`], [`Conv2dParams`],
//! [`Pool2dParams`], [`SgdConfig`], [`AdamWConfig`], [`AttentionParams`]) are re-exported here;
//! they are defined below the ops, the CPU reference and the CUDA launches, which all read
//! them.
//!
//! A linear layer with a bias and a GELU is one call ([`linear_act`]): one cuBLASLt product
//! with the bias and the activation as its epilogue on a GPU; an MLP's second layer's
//! backward runs through the GELU ([`linear_backward_gelu`]), so that the GELU's output
//! gradient is never stored.
//!
//! One op is two fused: [`linear_cross_entropy`], a language model's head and loss, computes
//! the logits in chunks of rows and the gradients of its input and weight with the loss, so
//! that the `[tokens, vocab]` logits never exist whole (its module docs give the design, the
//! chunk rule and the memory).

mod activation;
mod attention;
pub(crate) mod batch_norm;
mod conv;
mod copy;
pub(crate) mod dispatch;
mod elementwise;
mod embedding;
mod fused;
mod linear_cross_entropy;
mod llama;
mod loss;
pub(crate) mod map;
mod matmul;
mod multi_tensor;
mod norm;
mod optim;
mod permute;
mod pool;
mod random;
mod reduce;
mod scale_channels;
mod softmax;

pub use crate::params::{
    AdamWConfig, AttentionDims, AttentionLayout, AttentionParams, Conv2dOptions, Conv2dParams,
    DIRECT_MAX_MACS, MatmulSpec, Pool2dOptions, Pool2dParams, SgdConfig,
};
// Every op an `unary_op!` entry declares (with the tests' `UNARY_OPS`, crate-private).
pub use activation::*;
pub use attention::{AttentionGrads, AttentionOutput, attention, attention_backward};
#[cfg(all(test, feature = "cuda"))]
pub(crate) use batch_norm::parts as batch_norm_parts;
pub use batch_norm::{
    BatchNormGrads, BatchNormOutput, RunningStats, batch_norm, batch_norm_backward,
    batch_norm_backward_nhwc, batch_norm_eval, batch_norm_eval_nhwc, batch_norm_nhwc,
};
pub use conv::{
    Conv2dGrads, Conv2dWeightGrads, conv2d, conv2d_backward, conv2d_backward_nhwc,
    conv2d_backward_weight, conv2d_backward_weight_nhwc, conv2d_nhwc, conv2d_params,
    conv2d_params_nhwc,
};
pub use elementwise::{add, add_assign, axpy, bias_add, bias_add_backward, mul, scale};
pub use embedding::{embedding, embedding_backward};
pub use fused::{
    AddLayerNorm, BiasGeluGrads, ResidualBranch, ResidualNormGrads, add_layer_norm, bias_gelu,
    bias_gelu_backward, dropout_add, dropout_add_backward, dropout_add_layer_norm,
    layer_norm_backward_residual,
};
pub use linear_cross_entropy::{
    LinearCrossEntropy, LinearCrossEntropyParams, LossChunk, chunk_bytes_per_row,
    linear_cross_entropy,
};
pub use llama::{
    RmsNormGrads, RmsNormOutput, RopeScaling, rms_norm, rms_norm_backward, rope, rope_backward,
    rope_inv_freq, rope_tables,
};
pub use loss::{CrossEntropy, cross_entropy, cross_entropy_backward};
pub use matmul::{
    GeluLinearGrads, LinearActOutput, LinearActivation, LinearGrads, linear, linear_act,
    linear_act_backward, linear_backward, linear_backward_gelu, matmul, matmul_backward,
    matmul_spec,
};
pub use multi_tensor::{AdamWTensors, SgdTensors, adamw_step_multi, sgd_step_multi};
#[cfg(all(test, feature = "cuda"))]
pub(crate) use norm::{
    BackwardAddresses as LayerNormBackwardAddresses,
    backward_launches as layer_norm_backward_launches,
};
pub use norm::{LayerNormGrads, LayerNormOutput, layer_norm, layer_norm_backward};
#[cfg(all(test, feature = "cuda"))]
pub(crate) use optim::{adamw_scalars, sgd_scalars};
pub use optim::{adamw_step, sgd_step, unscale_and_check_finite};
pub use permute::{MAX_PERMUTE_RANK, permute, permute_backward};
pub use pool::{
    avg_pool2d, avg_pool2d_backward, global_avg_pool, global_avg_pool_backward,
    global_avg_pool_backward_add, global_avg_pool_backward_add_nhwc, global_avg_pool_backward_nhwc,
    global_avg_pool_nhwc, max_pool2d, max_pool2d_backward, max_pool2d_backward_nhwc,
    max_pool2d_nhwc, pool2d_params,
};
pub use random::{dropout, dropout_backward};
pub use reduce::{
    mean, mean_backward, mean_last_dim, mean_last_dim_backward, sum, sum_backward, sum_last_dim,
    sum_last_dim_backward,
};
pub use scale_channels::{
    ScaleChannelsGrads, scale_channels, scale_channels_backward, scale_channels_backward_nhwc,
    scale_channels_nhwc,
};
pub use softmax::{causal_softmax, causal_softmax_backward, softmax, softmax_backward};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// An [`Error::InvalidArgument`].
pub(crate) fn invalid(op: &'static str, reason: impl Into<String>) -> Error {
    Error::InvalidArgument { op, reason: reason.into() }
}

/// Checks that `b` lives on `a`'s device.
pub(crate) fn same_device(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.device() == b.device() { Ok(()) } else { Err(Error::DeviceMismatch { op }) }
}

/// Checks that `b` has `a`'s device and dtype.
pub(crate) fn same_kind(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    same_device(op, a, b)?;
    if a.dtype() == b.dtype() {
        Ok(())
    } else {
        Err(Error::DTypeMismatch { op, lhs: a.dtype(), rhs: b.dtype() })
    }
}

/// Checks that `b` has `a`'s device, dtype and shape.
pub(crate) fn same_layout(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    same_kind(op, a, b)?;
    expect_shape(op, a.shape(), b)
}

/// Checks that `t` has shape `want`.
pub(crate) fn expect_shape(op: &'static str, want: &[usize], t: &Tensor) -> Result<()> {
    if t.shape() == want {
        Ok(())
    } else {
        Err(Error::ShapeMismatch { op, lhs: want.to_vec(), rhs: t.shape().to_vec() })
    }
}

/// Checks that `t` is stored as `dtype`.
pub(crate) fn expect_dtype(op: &'static str, dtype: DType, t: &Tensor) -> Result<()> {
    if t.dtype() == dtype {
        Ok(())
    } else {
        Err(Error::DTypeMismatch { op, lhs: dtype, rhs: t.dtype() })
    }
}

/// Checks that `t` has rank `rank`; `what` names the expected layout in the message.
pub(crate) fn expect_rank(op: &'static str, t: &Tensor, rank: usize, what: &str) -> Result<()> {
    if t.rank() == rank {
        Ok(())
    } else {
        Err(invalid(op, format!("expected a rank-{rank} tensor {what}, got shape {:?}", t.shape())))
    }
}

/// Splits `shape` into (leading elements, last dimension); an error for rank 0.
pub(crate) fn rows_cols(op: &'static str, shape: &[usize]) -> Result<(usize, usize)> {
    match shape.split_last() {
        Some((&d, lead)) => Ok((lead.iter().product(), d)),
        None => Err(invalid(op, "expected a tensor of rank at least 1, got a scalar")),
    }
}
