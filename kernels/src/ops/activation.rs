//! ReLU and GELU (tanh approximation), forward and backward: elementwise maps
//! ([`unary_op!`](super::map::unary_op)).

use super::map::unary_op;
use crate::cpu::activation as cpu;
use crate::error::Result;
use crate::tensor::Tensor;

unary_op! {
    /// `max(x, 0)`.
    relu,
    /// Gradient of [`relu`] from the forward input `x` and the upstream `dy`: `dy` where
    /// `x > 0`, else 0 (the subgradient at 0 is 0, as in PyTorch). The forward output
    /// `relu(x)` gives the same result in place of `x` (it is `> 0` exactly where `x` is),
    /// which is what PyTorch's `relu` keeps for its backward.
    relu_backward: Relu, RELU, RELU_BWD,
    |x| cpu::relu_f32(x),
    |x, dy| if x > 0.0 { dy } else { 0.0 },
}

unary_op! {
    /// GELU, tanh approximation (PyTorch's `gelu(x, approximate='tanh')`).
    gelu,
    /// Gradient of [`gelu`] from the forward input `x` and the upstream `dy`.
    gelu_backward: Gelu, GELU, GELU_BWD,
    |x| cpu::gelu_f32(x),
    |x, dy| dy * cpu::gelu_grad_f32(x),
}
