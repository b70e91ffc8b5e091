//! 2-D max and average pooling (NCHW) and the global average pool, forward and backward;
//! the channels_last (NHWC) max pool and global average pool in [`nhwc`].

use super::dispatch::{Buffers, Op, OutputSpec, Plan, run};
use super::{expect_rank, expect_shape, invalid};
use crate::cpu::pool as cpu;
use crate::device::Device;
use crate::dtype::with_dtype;
use crate::error::{Error, Result};
use crate::params::{Pool2dOptions, Pool2dParams};
use crate::tensor::{Indices, Tensor};

/// The full geometry of pooling an input of shape `[batch, channels, h, w]`; the output is
/// `[batch, channels, oh, ow]` with `(oh, ow) = params.output_hw()` (see
/// [`Pool2dParams::new`]).
///
/// # Errors
///
/// As [`Pool2dParams::new`].
pub fn pool2d_params(x: &[usize], opts: &Pool2dOptions) -> Result<Pool2dParams> {
    Pool2dParams::new(x, opts)
}

/// Max pool of `x: [batch, channels, h, w]`; returns the output and, for the backward, the
/// position of each window's maximum in its input plane.
///
/// # Errors
///
/// As [`pool2d_params`]; out of memory.
pub fn max_pool2d(x: &Tensor, opts: &Pool2dOptions) -> Result<(Tensor, Indices)> {
    run(MaxPool { p: pool2d_params(x.shape(), opts)?, x })
}

struct MaxPool<'a> {
    p: Pool2dParams,
    x: &'a Tensor,
}

impl Op for MaxPool<'_> {
    const NAME: &'static str = "max_pool2d";
    /// `y` and the indices of the maxima.
    type Outs = [Tensor; 2];
    type Output = (Tensor, Indices);

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        let shape = self.p.output_shape();
        Ok(Plan::new([OutputSpec::new(&shape, self.x.dtype()), OutputSpec::indices(&shape)]))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let [y, argmax] = bufs.outputs_mut();
        with_dtype!(self.x.dtype(), T => cpu::max_pool2d(
            &self.p,
            self.x.as_slice::<T>()?,
            y.out_slice::<T>(Self::NAME)?,
            argmax.out_u32(Self::NAME)?,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::{Arg, helpers::ptr, launch::elementwise as grid, registry::MAX_POOL};
        let [y, argmax] = bufs.outputs_mut();
        let (oh, ow) = self.p.output_hw();
        // SAFETY: max_pool_T(const T* x, T* y, u32* arg, PoolGeom g, Div ow, Div oh); x, y
        // and arg have the geometry's shapes.
        unsafe {
            gpu.launch(
                MAX_POOL.of(self.x.dtype()),
                grid(y.numel()),
                &[
                    ptr(self.x)?,
                    ptr(y)?,
                    ptr(argmax)?,
                    Arg::Pool(crate::cuda::launch::PoolGeom::of(&self.p)),
                    Arg::div(ow),
                    Arg::div(oh),
                ],
            )
        }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<(Tensor, Indices)> {
        let [y, argmax] = bufs.into_outputs();
        Ok((y, Indices::from_tensor(argmax)))
    }
}

/// Checks `dy` against the pooled shape of `input_shape`; returns the geometry.
fn backward_params(
    op: &'static str,
    dy: &Tensor,
    input_shape: &[usize],
    opts: &Pool2dOptions,
) -> Result<Pool2dParams> {
    let p = pool2d_params(input_shape, opts)?;
    expect_shape(op, &p.output_shape(), dy)?;
    Ok(p)
}

/// Gradient of [`max_pool2d`] for an input of `input_shape`, from the upstream `dy` and the
/// saved `argmax`.
///
/// # Errors
///
/// [`Error::ShapeMismatch`] if `dy` or `argmax` is not the pooled shape;
/// [`Error::IndexOutOfRange`] for an argmax outside the input plane (on the host; a GPU
/// skips such entries, which cannot come from `max_pool2d`); [`Error::DeviceMismatch`];
/// out of memory.
pub fn max_pool2d_backward(
    dy: &Tensor,
    argmax: &Indices,
    input_shape: &[usize],
    opts: &Pool2dOptions,
) -> Result<Tensor> {
    const OP: &str = "max_pool2d_backward";
    let p = backward_params(OP, dy, input_shape, opts)?;
    run(MaxPoolBackward { p, dy, argmax })
}

/// `argmax` on `dy`'s device and of its shape (one index per pooled element).
fn same_as_argmax(op: &'static str, dy: &Tensor, argmax: &Indices) -> Result<()> {
    if argmax.device() != dy.device() {
        return Err(Error::DeviceMismatch { op });
    }
    if argmax.shape() != dy.shape() {
        return Err(Error::ShapeMismatch {
            op,
            lhs: dy.shape().to_vec(),
            rhs: argmax.shape().to_vec(),
        });
    }
    Ok(())
}

struct MaxPoolBackward<'a> {
    p: Pool2dParams,
    dy: &'a Tensor,
    argmax: &'a Indices,
}

impl Op for MaxPoolBackward<'_> {
    const NAME: &'static str = "max_pool2d_backward";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.dy.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        same_as_argmax(Self::NAME, self.dy, self.argmax)?;
        // The GPU gathers each input element's gradient in f32 and rounds once: no
        // accumulator (as PyTorch's `max_pool_backward_nchw`).
        Ok(Plan::one(&[self.p.batch(), self.p.channels(), self.p.h(), self.p.w()], self.dy.dtype()))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        with_dtype!(self.dy.dtype(), T => cpu::max_pool2d_backward(
            &self.p,
            self.dy.as_slice::<T>()?,
            self.argmax.as_slice()?,
            bufs.out().out_slice::<T>(Self::NAME)?,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::registry::MAX_POOL_BWD;
        use crate::cuda::{Arg, helpers::ptr, launch::elementwise as grid};
        let dx = bufs.out();
        let n = dx.numel();
        if n == 0 {
            return Ok(());
        }
        let (sh, sw) = self.p.stride();
        // SAFETY: max_pool_bwd_T(const T* dy, const u32* arg, T* dx, PoolGeom g, Div w, Div h,
        // Div sh, Div sw); dy and arg have the pooled shape, dx the input's, each element of
        // which one thread writes; indices >= h * w match no element.
        unsafe {
            gpu.launch(
                MAX_POOL_BWD.of(self.dy.dtype()),
                grid(n),
                &[
                    ptr(self.dy)?,
                    Arg::Ptr(self.argmax.cuda_ptr()?),
                    ptr(dx)?,
                    Arg::Pool(crate::cuda::launch::PoolGeom::of(&self.p)),
                    Arg::div(self.p.w()),
                    Arg::div(self.p.h()),
                    Arg::div(sh),
                    Arg::div(sw),
                ],
            )
        }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

/// Average pool of `x: [batch, channels, h, w]`. Padding counts in the divisor when
/// `count_include_pad` (PyTorch's default).
///
/// # Errors
///
/// As [`pool2d_params`]; out of memory.
pub fn avg_pool2d(x: &Tensor, opts: &Pool2dOptions, count_include_pad: bool) -> Result<Tensor> {
    run(AvgPool { p: pool2d_params(x.shape(), opts)?, x, count_include_pad })
}

struct AvgPool<'a> {
    p: Pool2dParams,
    x: &'a Tensor,
    count_include_pad: bool,
}

impl Op for AvgPool<'_> {
    const NAME: &'static str = "avg_pool2d";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        Ok(Plan::one(&self.p.output_shape(), self.x.dtype()))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        with_dtype!(self.x.dtype(), T => cpu::avg_pool2d(
            &self.p,
            self.x.as_slice::<T>()?,
            bufs.out().out_slice::<T>(Self::NAME)?,
            self.count_include_pad,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::{Arg, helpers::ptr, launch::elementwise as grid, registry::AVG_POOL};
        let y = bufs.out();
        let (oh, ow) = self.p.output_hw();
        // SAFETY: avg_pool_T(const T* x, T* y, PoolGeom g, u32 include_pad, Div ow, Div oh);
        // shapes from the geometry.
        unsafe {
            gpu.launch(
                AVG_POOL.of(self.x.dtype()),
                grid(y.numel()),
                &[
                    ptr(self.x)?,
                    ptr(y)?,
                    Arg::Pool(crate::cuda::launch::PoolGeom::of(&self.p)),
                    Arg::U32(self.count_include_pad as u32),
                    Arg::div(ow),
                    Arg::div(oh),
                ],
            )
        }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

/// Gradient of [`avg_pool2d`] (same options) for an input of `input_shape`.
///
/// # Errors
///
/// [`Error::ShapeMismatch`] if `dy` is not the pooled shape; as [`pool2d_params`]; out of
/// memory.
pub fn avg_pool2d_backward(
    dy: &Tensor,
    input_shape: &[usize],
    opts: &Pool2dOptions,
    count_include_pad: bool,
) -> Result<Tensor> {
    let p = backward_params("avg_pool2d_backward", dy, input_shape, opts)?;
    run(AvgPoolBackward { p, dy, count_include_pad })
}

struct AvgPoolBackward<'a> {
    p: Pool2dParams,
    dy: &'a Tensor,
    count_include_pad: bool,
}

impl Op for AvgPoolBackward<'_> {
    const NAME: &'static str = "avg_pool2d_backward";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.dy.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        let p = &self.p;
        let shape = [p.batch(), p.channels(), p.h(), p.w()];
        // No window: nothing flows back.
        let zeroed = p.output_len() == 0;
        Ok(Plan::new(OutputSpec::zeroed_if(zeroed, &shape, self.dy.dtype())))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        with_dtype!(self.dy.dtype(), T => cpu::avg_pool2d_backward(
            &self.p,
            self.dy.as_slice::<T>()?,
            bufs.out().out_slice::<T>(Self::NAME)?,
            self.count_include_pad,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::registry::AVG_POOL_BWD;
        use crate::cuda::{Arg, helpers::ptr, launch::elementwise as grid};
        if self.p.output_len() == 0 {
            return Ok(());
        }
        let dx = bufs.out();
        // SAFETY: avg_pool_bwd_T(const T* dy, T* dx, PoolGeom g, u32 include_pad, Div w, Div
        // h, Div sh, Div sw); shapes from the geometry.
        unsafe {
            gpu.launch(
                AVG_POOL_BWD.of(self.dy.dtype()),
                grid(dx.numel()),
                &[
                    ptr(self.dy)?,
                    ptr(dx)?,
                    Arg::Pool(crate::cuda::launch::PoolGeom::of(&self.p)),
                    Arg::U32(self.count_include_pad as u32),
                    Arg::div(self.p.w()),
                    Arg::div(self.p.h()),
                    Arg::div(self.p.stride().0),
                    Arg::div(self.p.stride().1),
                ],
            )
        }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

/// Global average pool: `x: [batch, channels, h, w]` to `[batch, channels]`.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a rank other than 4 or an empty plane; out of memory.
pub fn global_avg_pool(x: &Tensor) -> Result<Tensor> {
    const OP: &str = "global_avg_pool";
    expect_rank(OP, x, 4, "x [batch, channels, h, w]")?;
    let s = x.shape();
    let hw = s[2] * s[3];
    if hw == 0 {
        return Err(invalid(OP, format!("cannot average an empty plane, x is {s:?}")));
    }
    run(GlobalAvgPool { input: x, backward: false, shape: s.to_vec(), hw })
}

/// Gradient of [`global_avg_pool`] for an input of `input_shape` (`[batch, channels, h, w]`)
/// from `dy: [batch, channels]`.
///
/// # Errors
///
/// [`Error::ShapeMismatch`] if `dy` is not `input_shape[..2]`; as [`global_avg_pool`].
pub fn global_avg_pool_backward(dy: &Tensor, input_shape: &[usize]) -> Result<Tensor> {
    const OP: &str = "global_avg_pool_backward";
    let &[b, c, h, w] = input_shape else {
        return Err(invalid(
            OP,
            format!("expected input shape [batch, channels, h, w], got {input_shape:?}"),
        ));
    };
    expect_shape(OP, &[b, c], dy)?;
    let hw = h.checked_mul(w).unwrap_or(0);
    if hw == 0 {
        return Err(invalid(
            OP,
            format!("cannot average an empty plane, input is {input_shape:?}"),
        ));
    }
    crate::params::product(OP, "the input", input_shape)?;
    run(GlobalAvgPool { input: dy, backward: true, shape: input_shape.to_vec(), hw })
}

/// [`global_avg_pool_backward`] added into `acc` in place, without materializing it:
/// `acc[b, c, i, j] += dy[b, c] / (h * w)`, computed in f32 with one rounding. Where a
/// layer's input gradient is a sum of a path through the pooling and another path
/// (squeeze-excitation), this saves an input-sized temporary.
///
/// # Errors
///
/// [`Error::ShapeMismatch`] if `dy` is not `acc.shape()[..2]`, [`Error::DTypeMismatch`],
/// [`Error::DeviceMismatch`]; as [`global_avg_pool_backward`] for `acc`'s shape. `acc` is
/// unchanged then.
pub fn global_avg_pool_backward_add(acc: &mut Tensor, dy: &Tensor) -> Result<()> {
    const OP: &str = "global_avg_pool_backward_add";
    let &[b, c, h, w] = acc.shape() else {
        return Err(invalid(
            OP,
            format!("expected acc of shape [batch, channels, h, w], got {:?}", acc.shape()),
        ));
    };
    super::same_kind(OP, acc, dy)?;
    expect_shape(OP, &[b, c], dy)?;
    let hw = h * w;
    if hw == 0 {
        return Err(invalid(
            OP,
            format!("cannot average an empty plane, acc is {:?}", acc.shape()),
        ));
    }
    run(PoolGradAdd { acc, dy, hw })
}

/// `acc += global_avg_pool_backward(dy)`, in place.
struct PoolGradAdd<'a> {
    acc: &'a mut Tensor,
    dy: &'a Tensor,
    hw: usize,
}

impl Op for PoolGradAdd<'_> {
    const NAME: &'static str = "global_avg_pool_backward_add";
    type Outs = ();
    type Output = ();

    fn device(&self) -> &Device {
        self.dy.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        self.acc.make_unique()?;
        Ok(Plan::none())
    }

    fn host(&mut self, _: &mut Buffers<Self::Outs>) -> Result<()> {
        let (dy, acc, hw) = (self.dy, &mut *self.acc, self.hw);
        with_dtype!(dy.dtype(), T => {
            cpu::global_avg_pool_backward_add(dy.as_slice::<T>()?, acc.as_mut_slice::<T>()?, hw)
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, _: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::registry::BROADCAST_ROWS_ADD;
        use crate::cuda::{Arg, helpers::ptr, launch::elementwise as grid};
        let (dy, acc) = (self.dy, &*self.acc);
        let n = acc.numel();
        let factor = 1.0 / self.hw as f32;
        // SAFETY: broadcast_rows_add_T(const T* dy, float f, T* acc, u64 n, Div d); acc holds
        // n elements of T and dy n / hw (shapes and dtypes checked before `run`).
        unsafe {
            gpu.launch(
                BROADCAST_ROWS_ADD.of(acc.dtype()),
                grid(n),
                &[ptr(dy)?, Arg::F32(factor), ptr(acc)?, Arg::count(n), Arg::div(self.hw)],
            )
        }
    }

    fn finish(self, _: Buffers<Self::Outs>) -> Result<()> {
        Ok(())
    }
}

/// The global average pool, or its gradient, over planes of `hw`.
struct GlobalAvgPool<'a> {
    /// `x` for the pool, `dy` for its gradient.
    input: &'a Tensor,
    /// Whether this is the gradient.
    backward: bool,
    /// The pool's input shape.
    shape: Vec<usize>,
    hw: usize,
}

impl Op for GlobalAvgPool<'_> {
    const NAME: &'static str = "global_avg_pool";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.input.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        let dtype = self.input.dtype();
        let shape = if self.backward { &self.shape[..] } else { &self.shape[..2] };
        Ok(Plan::one(shape, dtype))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let (t, out, hw) = (self.input, bufs.out(), self.hw);
        with_dtype!(t.dtype(), T => if self.backward {
            cpu::global_avg_pool_backward(t.as_slice::<T>()?, out.out_slice::<T>(Self::NAME)?, hw)
        } else {
            cpu::global_avg_pool(t.as_slice::<T>()?, out.out_slice::<T>(Self::NAME)?, hw)
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::helpers::{broadcast_rows, row_sum};
        let (t, out, factor) = (self.input, bufs.out(), 1.0 / self.hw as f32);
        if self.backward {
            // dy / hw broadcast over each plane.
            broadcast_rows(gpu, t, factor, out)
        } else {
            // Row means of [planes, hw].
            row_sum(gpu, Self::NAME, t, out, factor)
        }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

mod nhwc;
pub use nhwc::{
    global_avg_pool_backward_add_nhwc, global_avg_pool_backward_nhwc, global_avg_pool_nhwc,
    max_pool2d_backward_nhwc, max_pool2d_nhwc,
};
