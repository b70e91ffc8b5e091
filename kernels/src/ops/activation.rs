//! The activations (ReLU, GELU with the tanh approximation, hard swish, hard sigmoid, SiLU),
//! forward and backward: elementwise maps, one [`unary_op!`](super::map::unary_op) entry
//! each.

use super::map::unary_op;
use crate::cpu::activation as cpu;
use crate::cpu::fastmath::sigmoid;
use crate::error::Result;
use crate::tensor::Tensor;

unary_op! {
    /// `max(x, 0)`.
    relu,
    /// Gradient of [`relu`] from the forward input `x` and the upstream `dy`: `dy` where
    /// `x > 0`, else 0 (the subgradient at 0 is 0, as in PyTorch). The forward output
    /// `relu(x)` gives the same result in place of `x` (it is `> 0` exactly where `x` is),
    /// which is what PyTorch's `relu` keeps for its backward.
    relu_backward: Relu, RELU,
    |x| cpu::relu_f32(x),
    |x, dy| if x > 0.0 { dy } else { 0.0 };

    /// Hard swish, `x * relu6(x + 3) / 6` (PyTorch's `hardswish`, MobileNetV3's activation).
    hardswish,
    /// Gradient of [`hardswish`] from the forward input `x` and the upstream `dy`: 0 for
    /// `x <= -3`, `dy * (x / 3 + 1/2)` below 3, `dy` from 3 on (PyTorch's CUDA kernel).
    hardswish_backward: Hardswish, HARDSWISH,
    |x| x * (x + 3.0).clamp(0.0, 6.0) / 6.0,
    |x, dy| if x <= -3.0 { 0.0 } else if x < 3.0 { dy * (x / 3.0 + 0.5) } else { dy };

    /// Hard sigmoid, `relu6(x + 3) / 6` (PyTorch's `hardsigmoid`, squeeze-excitation's gate
    /// in MobileNetV3).
    hardsigmoid,
    /// Gradient of [`hardsigmoid`] from the forward input `x` and the upstream `dy`: `dy / 6`
    /// strictly between -3 and 3, else 0.
    hardsigmoid_backward: Hardsigmoid, HARDSIGMOID,
    |x| (x + 3.0).clamp(0.0, 6.0) / 6.0,
    |x, dy| if x > -3.0 && x < 3.0 { dy / 6.0 } else { 0.0 };

    /// GELU, tanh approximation (PyTorch's `gelu(x, approximate='tanh')`).
    gelu,
    /// Gradient of [`gelu`] from the forward input `x` and the upstream `dy`.
    gelu_backward: Gelu, GELU,
    |x| cpu::gelu_f32(x),
    |x, dy| dy * cpu::gelu_grad_f32(x);

    /// SiLU, `x * sigmoid(x)` (PyTorch's `silu`; the gate of Llama's MLP).
    silu,
    /// Gradient of [`silu`] from the forward input `x` and the upstream `dy`:
    /// `dy * s * (1 + x * (1 - s))` with `s = sigmoid(x)`.
    silu_backward: Silu, SILU,
    |x| x * sigmoid(x),
    |x, dy| {
        let s = sigmoid(x);
        dy * (s * (1.0 + x * (1.0 - s)))
    };
}
