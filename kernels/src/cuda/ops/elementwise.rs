//! Elementwise kernels (`elementwise.cu`, `misc.cu` for dropout): fill, casts, arithmetic,
//! activations, bias broadcast.

use super::ptr;
use crate::cuda::launch::elementwise as grid;
use crate::cuda::registry::{
    ADD_ASSIGN, AXPY, BIAS_ADD, BIAS_FILL, BROADCAST_ROWS, CAST, DROPOUT, FILL, Kernel, SCALE,
};
use crate::cuda::{Arg, CudaBackend};
use crate::dtype::DType;
use crate::error::Result;
use crate::tensor::Tensor;

/// `y[..] = value`.
pub(crate) fn fill(cu: &CudaBackend, y: &mut Tensor, value: f32) -> Result<()> {
    let n = y.numel();
    // SAFETY: fill_T(T* y, float v, u64 n); y holds n elements of T.
    unsafe { cu.launch(FILL.of(y.dtype()), grid(n), &[ptr(y)?, Arg::F32(value), Arg::count(n)]) }
}

/// `y = x` converted to `y`'s dtype (a device copy when the dtypes agree); same shapes.
pub(crate) fn convert(cu: &CudaBackend, x: &Tensor, y: &mut Tensor) -> Result<()> {
    if x.dtype() == y.dtype() {
        return cu.copy_on_device(y.cuda_ptr()?, x.cuda_ptr()?, x.size_in_bytes());
    }
    cast_ptr(cu, x.cuda_ptr()?, x.dtype(), y.cuda_ptr()?, y.dtype(), x.numel())
}

/// Converts `n` elements at `src` (of `from`) to `dst` (of `to`).
pub(crate) fn cast_ptr(
    cu: &CudaBackend,
    src: u64,
    from: DType,
    dst: u64,
    to: DType,
    n: usize,
) -> Result<()> {
    // SAFETY: cast_S_D(const S* x, D* y, u64 n); the caller's pointers hold n elements of
    // their dtypes.
    unsafe {
        cu.launch(CAST.of_pair(from, to), grid(n), &[Arg::Ptr(src), Arg::Ptr(dst), Arg::count(n)])
    }
}

/// Writes an f32 buffer of `y.numel()` elements into `y`, rounding to its dtype.
pub(crate) fn from_f32(cu: &CudaBackend, src: u64, y: &mut Tensor) -> Result<()> {
    cast_ptr(cu, src, DType::F32, y.cuda_ptr()?, y.dtype(), y.numel())
}

/// `out = a (op) b` for `op` in `add`, `mul`; one shape and dtype.
pub(crate) fn binary(
    cu: &CudaBackend,
    op: &'static Kernel,
    a: &Tensor,
    b: &Tensor,
    out: &mut Tensor,
) -> Result<()> {
    let n = out.numel();
    // SAFETY: add_T / mul_T(const T* a, const T* b, T* y, u64 n); all three hold n
    // elements of T.
    unsafe { cu.launch(op.of(a.dtype()), grid(n), &[ptr(a)?, ptr(b)?, ptr(out)?, Arg::count(n)]) }
}

/// `out = alpha * x`.
pub(crate) fn scale(cu: &CudaBackend, x: &Tensor, alpha: f32, out: &mut Tensor) -> Result<()> {
    let n = out.numel();
    // SAFETY: scale_T(const T* x, float alpha, T* y, u64 n); x and out hold n elements.
    unsafe {
        cu.launch(
            SCALE.of(x.dtype()),
            grid(n),
            &[ptr(x)?, Arg::F32(alpha), ptr(out)?, Arg::count(n)],
        )
    }
}

/// `acc += x` (dtypes may differ).
pub(crate) fn add_assign(cu: &CudaBackend, acc: &mut Tensor, x: &Tensor) -> Result<()> {
    let n = acc.numel();
    let kernel = ADD_ASSIGN.of_pair(acc.dtype(), x.dtype());
    // SAFETY: add_assign_A_X(A* acc, const X* x, u64 n); both hold n elements of their types.
    unsafe { cu.launch(kernel, grid(n), &[ptr(acc)?, ptr(x)?, Arg::count(n)]) }
}

/// `y += alpha * x` (dtypes may differ).
pub(crate) fn axpy(cu: &CudaBackend, alpha: f32, x: &Tensor, y: &mut Tensor) -> Result<()> {
    let n = y.numel();
    let kernel = AXPY.of_pair(y.dtype(), x.dtype());
    // SAFETY: axpy_Y_X(float alpha, const X* x, Y* y, u64 n); both hold n elements.
    unsafe { cu.launch(kernel, grid(n), &[Arg::F32(alpha), ptr(x)?, ptr(y)?, Arg::count(n)]) }
}

/// `out = x + bias` with `bias: [d]` broadcast over rows; `d > 0` unless `x` is empty.
pub(crate) fn bias_add(
    cu: &CudaBackend,
    x: &Tensor,
    bias: &Tensor,
    out: &mut Tensor,
) -> Result<()> {
    let (n, d) = (out.numel(), bias.numel());
    if n == 0 {
        return Ok(());
    }
    // SAFETY: bias_add_T(const T* x, const T* b, T* y, u64 n, u64 d); x and out hold n
    // elements, bias d > 0 (n > 0 and n is a multiple of d).
    unsafe {
        cu.launch(
            BIAS_ADD.of(x.dtype()),
            grid(n),
            &[ptr(x)?, ptr(bias)?, ptr(out)?, Arg::count(n), Arg::count(d)],
        )
    }
}

/// `y[i] = bias[i % d]` over all of `y` (the C operand of a linear layer's gemm).
pub(crate) fn bias_fill(cu: &CudaBackend, bias: &Tensor, y: &mut Tensor) -> Result<()> {
    let (n, d) = (y.numel(), bias.numel());
    if n == 0 {
        return Ok(());
    }
    // SAFETY: bias_fill_T(const T* b, T* y, u64 n, u64 d); y holds n elements, a multiple
    // of d > 0; bias holds d.
    unsafe {
        cu.launch(
            BIAS_FILL.of(y.dtype()),
            grid(n),
            &[ptr(bias)?, ptr(y)?, Arg::count(n), Arg::count(d)],
        )
    }
}

/// `dx[i] = dy[i / d] * factor` with `dx: [dy.numel() * d]`.
pub(crate) fn broadcast_rows(
    cu: &CudaBackend,
    dy: &Tensor,
    factor: f32,
    dx: &mut Tensor,
) -> Result<()> {
    let n = dx.numel();
    if n == 0 {
        return Ok(());
    }
    let d = n / dy.numel();
    // SAFETY: broadcast_rows_T(const T* dy, float f, T* dx, u64 n, u64 d); dx holds n
    // elements and dy n / d.
    unsafe {
        cu.launch(
            BROADCAST_ROWS.of(dx.dtype()),
            grid(n),
            &[ptr(dy)?, Arg::F32(factor), ptr(dx)?, Arg::count(n), Arg::count(d)],
        )
    }
}

/// `y = f(x)` for `f` in `relu`, `gelu`.
pub(crate) fn activation(
    cu: &CudaBackend,
    f: &'static Kernel,
    x: &Tensor,
    y: &mut Tensor,
) -> Result<()> {
    let n = y.numel();
    // SAFETY: relu_T / gelu_T(const T* x, T* y, u64 n); both hold n elements.
    unsafe { cu.launch(f.of(x.dtype()), grid(n), &[ptr(x)?, ptr(y)?, Arg::count(n)]) }
}

/// `dx = dy * f'(x)` for `f` in `relu_bwd`, `gelu_bwd`.
pub(crate) fn activation_backward(
    cu: &CudaBackend,
    f: &'static Kernel,
    x: &Tensor,
    dy: &Tensor,
    dx: &mut Tensor,
) -> Result<()> {
    let n = dx.numel();
    // SAFETY: relu_bwd_T / gelu_bwd_T(const T* x, const T* dy, T* dx, u64 n); all hold n.
    unsafe { cu.launch(f.of(x.dtype()), grid(n), &[ptr(x)?, ptr(dy)?, ptr(dx)?, Arg::count(n)]) }
}

/// Dropout with the host's Philox scheme; `0 <= p < 1` is checked by the caller.
pub(crate) fn dropout(
    cu: &CudaBackend,
    x: &Tensor,
    y: &mut Tensor,
    p: f32,
    seed: u64,
    offset: u64,
) -> Result<()> {
    let n = y.numel();
    let scale = 1.0 / (1.0 - p);
    // SAFETY: dropout_T(const T* x, T* y, u64 n, float p, float scale, u64 seed, u64
    // offset); x and y hold n elements.
    unsafe {
        cu.launch(
            DROPOUT.of(x.dtype()),
            grid(n),
            &[
                ptr(x)?,
                ptr(y)?,
                Arg::count(n),
                Arg::F32(p),
                Arg::F32(scale),
                Arg::U64(seed),
                Arg::U64(offset),
            ],
        )
    }
}
