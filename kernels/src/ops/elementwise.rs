//! Elementwise arithmetic, in-place accumulation and the broadcast bias add.

use super::dispatch::{Buffers, Op, Plan, run};
use super::map::binary_op;
use super::{expect_shape, rows_cols, same_device, same_kind};
use crate::cpu::elementwise as cpu;
use crate::device::Device;
use crate::dtype::with_dtype;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

binary_op! {
    /// `a + b`, elementwise; same shape and dtype.
    add: Add, ADD, |a, b| a + b,
}

binary_op! {
    /// `a * b`, elementwise; same shape and dtype.
    mul: Mul, MUL, |a, b| a * b,
}

/// `alpha * x`.
///
/// # Errors
///
/// [`Error::OutOfMemory`].
pub fn scale(x: &Tensor, alpha: f32) -> Result<Tensor> {
    run(Scale { x, alpha })
}

struct Scale<'a> {
    x: &'a Tensor,
    alpha: f32,
}

impl Op for Scale<'_> {
    const NAME: &'static str = "scale";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        Ok(Plan::one(self.x.shape(), self.x.dtype()))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        with_dtype!(self.x.dtype(), T => {
            cpu::scale(self.x.as_slice::<T>()?, self.alpha, bufs.out().out_slice::<T>(Self::NAME)?)
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::{Arg, helpers::ptr, launch, registry::SCALE};
        let y = bufs.out();
        let n = y.numel();
        // SAFETY: scale_T(const T* x, float alpha, T* y, u64 n); x and y hold n elements.
        unsafe {
            gpu.launch(
                SCALE.of(self.x.dtype()),
                launch::map(n, y.dtype().size_in_bytes()),
                &[ptr(self.x)?, Arg::F32(self.alpha), ptr(y)?, Arg::count(n)],
            )
        }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

/// Checks that `x` can update `acc` in place: one device, one shape (dtypes may differ).
fn check_update(op: &'static str, acc: &Tensor, x: &Tensor) -> Result<()> {
    same_device(op, acc, x)?;
    if acc.shape() != x.shape() {
        return Err(Error::ShapeMismatch {
            op,
            lhs: acc.shape().to_vec(),
            rhs: x.shape().to_vec(),
        });
    }
    Ok(())
}

/// `acc += x` in place (gradient accumulation). The dtypes may differ, e.g. f16 gradients
/// into an f32 accumulator; shapes must match.
///
/// # Errors
///
/// [`Error::ShapeMismatch`], [`Error::DeviceMismatch`]; `acc` is unchanged then.
pub fn add_assign(acc: &mut Tensor, x: &Tensor) -> Result<()> {
    run(Update { op: "add_assign", alpha: None, x, y: acc })
}

/// `y += alpha * x` in place (BLAS axpy). The dtypes may differ; shapes must match.
///
/// # Errors
///
/// As [`add_assign`].
pub fn axpy(alpha: f32, x: &Tensor, y: &mut Tensor) -> Result<()> {
    run(Update { op: "axpy", alpha: Some(alpha), x, y })
}

/// `y += x` (`alpha: None`) or `y += alpha * x`, in place.
struct Update<'a> {
    op: &'static str,
    alpha: Option<f32>,
    x: &'a Tensor,
    y: &'a mut Tensor,
}

impl Op for Update<'_> {
    const NAME: &'static str = "add_assign";
    type Outs = ();
    type Output = ();

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        check_update(self.op, self.y, self.x)?;
        self.y.make_unique()?;
        Ok(Plan::none())
    }

    fn host(&mut self, _: &mut Buffers<Self::Outs>) -> Result<()> {
        let (x, y) = (self.x, &mut *self.y);
        with_dtype!(y.dtype(), Y => with_dtype!(x.dtype(), X => match self.alpha {
            None => cpu::add_assign(y.as_mut_slice::<Y>()?, x.as_slice::<X>()?),
            Some(alpha) => cpu::axpy(alpha, x.as_slice::<X>()?, y.as_mut_slice::<Y>()?),
        }))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, _: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::registry::{ADD_ASSIGN, AXPY};
        use crate::cuda::{Arg, helpers::ptr, launch};
        let (x, y) = (self.x, &*self.y);
        let n = y.numel();
        let grid = launch::map(n, x.dtype().size_in_bytes().max(y.dtype().size_in_bytes()));
        match self.alpha {
            // SAFETY: add_assign_A_X(A* acc, const X* x, u64 n); both hold n elements of
            // their types (one shape, checked in `plan`).
            None => unsafe {
                gpu.launch(
                    ADD_ASSIGN.of_pair(y.dtype(), x.dtype()),
                    grid,
                    &[ptr(y)?, ptr(x)?, Arg::count(n)],
                )
            },
            // SAFETY: axpy_Y_X(float alpha, const X* x, Y* y, u64 n); as above.
            Some(alpha) => unsafe {
                gpu.launch(
                    AXPY.of_pair(y.dtype(), x.dtype()),
                    grid,
                    &[Arg::F32(alpha), ptr(x)?, ptr(y)?, Arg::count(n)],
                )
            },
        }
    }

    fn finish(self, _: Buffers<Self::Outs>) -> Result<()> {
        Ok(())
    }
}

/// `x + bias` with `bias: [d]` broadcast over the rows of `x: [.., d]`.
///
/// # Errors
///
/// [`Error::ShapeMismatch`] if `bias` is not `[d]`; dtype and device mismatches;
/// [`Error::OutOfMemory`].
pub fn bias_add(x: &Tensor, bias: &Tensor) -> Result<Tensor> {
    run(BiasAdd { x, bias })
}

struct BiasAdd<'a> {
    x: &'a Tensor,
    bias: &'a Tensor,
}

impl Op for BiasAdd<'_> {
    const NAME: &'static str = "bias_add";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        param_dims(Self::NAME, self.x, self.bias)?;
        Ok(Plan::one(self.x.shape(), self.x.dtype()))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        with_dtype!(self.x.dtype(), T => cpu::bias_add(
            self.x.as_slice::<T>()?,
            self.bias.as_slice::<T>()?,
            bufs.out().out_slice::<T>(Self::NAME)?,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let kernel = crate::cuda::registry::BIAS_ADD.of(self.x.dtype());
        launch_bias_rows(gpu, kernel, self.x, self.bias, bufs.out())
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

/// Checks `x: [.., d]` against a per-column `param: [d]` (a bias, a norm's gamma or beta);
/// returns `(rows, d)`.
pub(super) fn param_dims(op: &'static str, x: &Tensor, param: &Tensor) -> Result<(usize, usize)> {
    same_kind(op, x, param)?;
    let (rows, d) = rows_cols(op, x.shape())?;
    expect_shape(op, &[d], param)?;
    Ok((rows, d))
}

/// Launches `kernel`, one of `bias_add_T` and `bias_gelu_T` (`y = f(x + bias)` with `bias: [d]`
/// broadcast over the rows of `x`), on `x`, `bias` and `y`; nothing for an empty `y`.
#[cfg(feature = "cuda")]
pub(super) fn launch_bias_rows(
    gpu: &crate::cuda::Gpu<'_>,
    kernel: crate::cuda::registry::Instance,
    x: &Tensor,
    bias: &Tensor,
    y: &Tensor,
) -> Result<()> {
    use crate::cuda::{Arg, helpers::ptr, launch::elementwise as grid};
    let (n, d) = (y.numel(), bias.numel());
    if n == 0 {
        return Ok(());
    }
    // SAFETY: kernel(const T* x, const T* b, T* y, u64 n, Div d); x and y hold n elements,
    // bias d > 0 (n > 0 and n is a multiple of d).
    unsafe {
        gpu.launch(kernel, grid(n), &[ptr(x)?, ptr(bias)?, ptr(y)?, Arg::count(n), Arg::div(d)])
    }
}

/// Gradient of [`bias_add`] with respect to the bias: the column sums of `dy: [.., d]`, shape
/// `[d]`. (The gradient with respect to `x` is `dy` itself.)
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a rank-0 `dy`; [`Error::OutOfMemory`].
pub fn bias_add_backward(dy: &Tensor) -> Result<Tensor> {
    run(BiasAddBackward { dy, acc: None })
}

struct BiasAddBackward<'a> {
    dy: &'a Tensor,
    /// The f32 column sums and their partials.
    acc: Option<usize>,
}

impl Op for BiasAddBackward<'_> {
    const NAME: &'static str = "bias_add_backward";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.dy.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        let (rows, d) = rows_cols(Self::NAME, self.dy.shape())?;
        // The GPU sums columns in f32 (per chunk of rows, then over chunks) and rounds once.
        let mut plan = Plan::one(&[d], self.dy.dtype());
        self.acc = plan.workspace(super::reduce::column_sum_workspace(Self::NAME, rows, d)?);
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        with_dtype!(self.dy.dtype(), T => {
            cpu::bias_add_backward(self.dy.as_slice::<T>()?, bufs.out().out_slice::<T>(Self::NAME)?)
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let (rows, _) = rows_cols(Self::NAME, self.dy.shape())?;
        let acc = bufs.ws(self.acc)?;
        let dy = self.dy.cuda_ptr()?;
        crate::cuda::helpers::column_sums(gpu, dy, self.dy.dtype(), rows, acc, bufs.out())
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}
