//! An op written outside `vram-kernels`, through its public custom-op API
//! ([`vram_kernels::custom`]): SwiGLU's gate, `y = silu(gate) * up` (the gated MLP of the
//! Llama family), and its backward, on f32, f16 and bf16 tensors.
//!
//! Each op is a [`CustomOp`]: its checks and allocation plan, its host code, and its CUDA
//! kernels (`swiglu.cu`, one line per dtype) with their launches. Through
//! [`custom::run`] the outputs come from the device's caching
//! allocator, a virtual device allocates them without computing, and the tests
//! (`tests/swiglu.rs`) check the host code against an f64 reference, the CUDA code on the
//! host's emulation (and on a GPU when there is one) against the host code, and the
//! virtual device's allocations against the host's.
//!
//! ```
//! use vram_kernels::{DType, Device, Tensor};
//!
//! let dev = Device::host(64 << 20);
//! let gate = Tensor::from_f32_slice(&dev, &[2, 2], &[0.0, 1.0, -1.0, 2.0], DType::F32)?;
//! let up = Tensor::from_f32_slice(&dev, &[2, 2], &[1.0, 1.0, 2.0, 0.5], DType::F32)?;
//! let y = vram_example_custom_op::swiglu(&gate, &up)?;
//! let silu_1 = 1.0 / (1.0 + (-1.0f32).exp());
//! assert_eq!(y.to_f32_vec()?[1], silu_1);
//!
//! let grads = vram_example_custom_op::swiglu_backward(&gate, &up, &y)?;
//! assert_eq!(grads.dup.shape(), &[2, 2]);
//! # Ok::<(), vram_kernels::Error>(())
//! ```

use vram_kernels::custom::{self, CustomOp, OpPlan};
use vram_kernels::{DType, Element, Error, Result, Tensor};

#[cfg(feature = "cuda")]
use vram_kernels::custom::{CudaCall, CudaKernel, CudaSource, Grid, KernelArg, KernelParam};

/// The kernels: `swiglu_<dtype>` and `swiglu_backward_<dtype>` for f32, f16 and bf16.
#[cfg(feature = "cuda")]
pub static SOURCE: CudaSource = {
    use KernelParam::{Ptr, U64};
    const FORWARD: &[KernelParam] = &[Ptr, Ptr, Ptr, U64];
    const BACKWARD: &[KernelParam] = &[Ptr, Ptr, Ptr, Ptr, Ptr, U64];
    CudaSource {
        name: "swiglu",
        source: include_str!("swiglu.cu"),
        kernels: &[
            CudaKernel { name: "swiglu_f32", params: FORWARD },
            CudaKernel { name: "swiglu_f16", params: FORWARD },
            CudaKernel { name: "swiglu_bf16", params: FORWARD },
            CudaKernel { name: "swiglu_backward_f32", params: BACKWARD },
            CudaKernel { name: "swiglu_backward_f16", params: BACKWARD },
            CudaKernel { name: "swiglu_backward_bf16", params: BACKWARD },
        ],
    }
};

/// Threads per block of both kernels.
#[cfg(feature = "cuda")]
const THREADS: u32 = 256;

/// Launches `<base>_<dtype>` over the operands' elements with `pointers` and their count:
/// both kernels take their operands' addresses (inputs, then outputs) and `n`.
#[cfg(feature = "cuda")]
fn launch(
    call: &CudaCall<'_>,
    inputs: &[&Tensor],
    base: &str,
    pointers: &[KernelArg],
) -> Result<()> {
    let n = inputs[0].numel();
    let suffix = match inputs[0].dtype() {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
    };
    let mut args = pointers.to_vec();
    args.push(KernelArg::count(n));
    // SAFETY: every operand holds n elements of one dtype (checked and planned by the op),
    // `pointers` are this call's inputs and outputs, and the kernels touch elements below n
    // only, writing the outputs alone.
    unsafe { call.launch(&format!("{base}_{suffix}"), Grid::for_elements(n, THREADS), &args) }
}

/// Checks that every operand has the first one's shape and dtype.
fn same_shape_and_dtype(op: &'static str, operands: &[&Tensor]) -> Result<()> {
    let Some(first) = operands.first() else {
        return Err(Error::InvalidArgument { op, reason: "no operands".into() });
    };
    for t in &operands[1..] {
        if t.shape() != first.shape() {
            return Err(Error::ShapeMismatch {
                op,
                lhs: first.shape().to_vec(),
                rhs: t.shape().to_vec(),
            });
        }
        if t.dtype() != first.dtype() {
            return Err(Error::DTypeMismatch { op, lhs: first.dtype(), rhs: t.dtype() });
        }
    }
    Ok(())
}

/// The operands of an op taking exactly `N` tensors.
fn operands<'a, const N: usize>(
    op: &'static str,
    inputs: &[&'a Tensor],
) -> Result<[&'a Tensor; N]> {
    let operands: [&Tensor; N] = inputs.try_into().map_err(|_| Error::InvalidArgument {
        op,
        reason: format!("takes {N} tensors, got {}", inputs.len()),
    })?;
    same_shape_and_dtype(op, &operands)?;
    Ok(operands)
}

/// `sigmoid(g)` in f32, as the kernels compute it.
fn sigmoid(g: f32) -> f32 {
    1.0 / (1.0 + (-g).exp())
}

/// `y = silu(gate) * up`.
struct Swiglu;

impl Swiglu {
    fn host_typed<T: Element>(gate: &Tensor, up: &Tensor, y: &mut Tensor) -> Result<()> {
        let (gate, up) = (gate.as_slice::<T>()?, up.as_slice::<T>()?);
        for ((y, &g), &u) in y.as_mut_slice::<T>()?.iter_mut().zip(gate).zip(up) {
            let g = g.to_f32();
            *y = T::from_f32(g * sigmoid(g) * u.to_f32());
        }
        Ok(())
    }
}

impl CustomOp for Swiglu {
    const NAME: &'static str = "swiglu";

    fn plan(&self, inputs: &[&Tensor]) -> Result<OpPlan> {
        let [gate, _] = operands::<2>(Self::NAME, inputs)?;
        Ok(OpPlan::new().output(gate.shape(), gate.dtype()))
    }

    fn host(&self, inputs: &[&Tensor], outputs: &mut [Tensor]) -> Result<()> {
        let ([gate, up], [y]) = (inputs, outputs) else { return Err(arity(Self::NAME)) };
        match gate.dtype() {
            DType::F32 => Self::host_typed::<f32>(gate, up, y),
            DType::F16 => Self::host_typed::<vram_kernels::half::f16>(gate, up, y),
            DType::BF16 => Self::host_typed::<vram_kernels::half::bf16>(gate, up, y),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_source(&self) -> Option<&'static CudaSource> {
        Some(&SOURCE)
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, inputs: &[&Tensor], call: &CudaCall<'_>) -> Result<()> {
        launch(call, inputs, "swiglu", &[call.input(0)?, call.input(1)?, call.output(0)?])
    }
}

/// Gradients of [`swiglu`].
#[derive(Debug)]
pub struct SwigluGrads {
    /// The gradient of `gate`.
    pub dgate: Tensor,
    /// The gradient of `up`.
    pub dup: Tensor,
}

/// `dgate = dy * up * s * (1 + gate * (1 - s))` and `dup = dy * gate * s`, with
/// `s = sigmoid(gate)`.
struct SwigluBackward;

impl SwigluBackward {
    fn host_typed<T: Element>(
        inputs: [&Tensor; 3],
        dgate: &mut Tensor,
        dup: &mut Tensor,
    ) -> Result<()> {
        let [gate, up, dy] = inputs;
        let (gate, up, dy) = (gate.as_slice::<T>()?, up.as_slice::<T>()?, dy.as_slice::<T>()?);
        let dup = dup.as_mut_slice::<T>()?;
        for (i, dgate) in dgate.as_mut_slice::<T>()?.iter_mut().enumerate() {
            let (g, u, d) = (gate[i].to_f32(), up[i].to_f32(), dy[i].to_f32());
            let s = sigmoid(g);
            *dgate = T::from_f32(d * u * s * (1.0 + g * (1.0 - s)));
            dup[i] = T::from_f32(d * g * s);
        }
        Ok(())
    }
}

impl CustomOp for SwigluBackward {
    const NAME: &'static str = "swiglu_backward";

    fn plan(&self, inputs: &[&Tensor]) -> Result<OpPlan> {
        let [gate, ..] = operands::<3>(Self::NAME, inputs)?;
        Ok(OpPlan::new().output(gate.shape(), gate.dtype()).output(gate.shape(), gate.dtype()))
    }

    fn host(&self, inputs: &[&Tensor], outputs: &mut [Tensor]) -> Result<()> {
        let (&[gate, up, dy], [dgate, dup]) = (inputs, outputs) else {
            return Err(arity(Self::NAME));
        };
        let inputs = [gate, up, dy];
        match gate.dtype() {
            DType::F32 => Self::host_typed::<f32>(inputs, dgate, dup),
            DType::F16 => Self::host_typed::<vram_kernels::half::f16>(inputs, dgate, dup),
            DType::BF16 => Self::host_typed::<vram_kernels::half::bf16>(inputs, dgate, dup),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_source(&self) -> Option<&'static CudaSource> {
        Some(&SOURCE)
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, inputs: &[&Tensor], call: &CudaCall<'_>) -> Result<()> {
        let (x, out) = (|i| call.input(i), |i| call.output(i));
        launch(call, inputs, "swiglu_backward", &[x(0)?, x(1)?, x(2)?, out(0)?, out(1)?])
    }
}

/// The error for host code called with other operands than planned (not reachable
/// through [`custom::run`], which checks the plan first).
fn arity(op: &'static str) -> Error {
    Error::InvalidArgument { op, reason: "called with operands other than planned".into() }
}

/// SwiGLU's gate: `silu(gate) * up`, element by element (`silu(g) = g * sigmoid(g)`), in the
/// operands' dtype, computed in f32.
///
/// # Errors
///
/// [`Error::ShapeMismatch`] / [`Error::DTypeMismatch`] when `gate` and `up` differ;
/// [`Error::DeviceMismatch`]; [`Error::OutOfMemory`].
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    Ok(custom::run(&Swiglu, &[gate, up])?.remove(0))
}

/// The gradients of [`swiglu`] for the output's gradient `dy`.
///
/// # Errors
///
/// As [`swiglu`], for all three operands.
pub fn swiglu_backward(gate: &Tensor, up: &Tensor, dy: &Tensor) -> Result<SwigluGrads> {
    let mut grads = custom::run(&SwigluBackward, &[gate, up, dy])?;
    let dup = grads.remove(1);
    Ok(SwigluGrads { dgate: grads.remove(0), dup })
}

/// [`swiglu`]'s CUDA code on the host's emulation (the tests compare it with [`swiglu`]);
/// `None` without a C++ compiler.
///
/// # Errors
///
/// As [`swiglu`]; the inputs must live on the host.
#[cfg(feature = "cuda")]
pub fn swiglu_emulated(gate: &Tensor, up: &Tensor) -> Result<Option<Tensor>> {
    Ok(custom::emulate(&Swiglu, &[gate, up])?.map(|mut out| out.remove(0)))
}

/// [`swiglu_backward`]'s CUDA code on the host's emulation; `None` without a C++ compiler.
///
/// # Errors
///
/// As [`swiglu_backward`]; the inputs must live on the host.
#[cfg(feature = "cuda")]
pub fn swiglu_backward_emulated(
    gate: &Tensor,
    up: &Tensor,
    dy: &Tensor,
) -> Result<Option<SwigluGrads>> {
    Ok(custom::emulate(&SwigluBackward, &[gate, up, dy])?.map(|mut grads| {
        let dup = grads.remove(1);
        SwigluGrads { dgate: grads.remove(0), dup }
    }))
}
