//! 2-D max and average pooling (NCHW) and the global average pool, forward and backward.

use super::{expect_rank, invalid, output, with_dtype};
use crate::cpu::pool as cpu;
use crate::cpu::pool::Pool2dParams;
#[cfg(feature = "cuda")]
use crate::cuda::ops::pool as cuda;
use crate::error::{Error, Result};
use crate::tensor::{Indices, Tensor};

/// A pooling window: its size, step and padding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pool2dOptions {
    /// Window (height, width).
    pub kernel: (usize, usize),
    /// Step between windows, (vertical, horizontal).
    pub stride: (usize, usize),
    /// Implicit padding on each side, at most half the window.
    pub padding: (usize, usize),
}

impl Pool2dOptions {
    /// A window of `kernel` moved by `stride`, without padding.
    pub fn new(kernel: (usize, usize), stride: (usize, usize)) -> Self {
        Pool2dOptions { kernel, stride, padding: (0, 0) }
    }

    /// Sets the padding.
    pub fn padding(mut self, padding: (usize, usize)) -> Self {
        self.padding = padding;
        self
    }
}

/// The full geometry of pooling an input of shape `[batch, channels, h, w]`; the output is
/// `[batch, channels, oh, ow]` with `(oh, ow) = params.output_hw()`.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a rank other than 4, a zero kernel or stride, or padding
/// over half the window.
pub fn pool2d_params(x: &[usize], opts: &Pool2dOptions) -> Result<Pool2dParams> {
    const OP: &str = "pool2d";
    let &[batch, channels, h, w] = x else {
        return Err(invalid(OP, format!("expected x [batch, channels, h, w], got {x:?}")));
    };
    let Pool2dOptions { kernel: k, stride: s, padding: p } = *opts;
    if k.0 == 0 || k.1 == 0 || s.0 == 0 || s.1 == 0 {
        return Err(invalid(OP, format!("kernel {k:?} and stride {s:?} must be positive")));
    }
    if 2 * p.0 > k.0 || 2 * p.1 > k.1 {
        return Err(invalid(OP, format!("padding {p:?} is more than half the window {k:?}")));
    }
    Ok(Pool2dParams::new(batch, channels, (h, w), k, s).padding(p))
}

fn output_shape(p: &Pool2dParams) -> [usize; 4] {
    let (oh, ow) = p.output_hw();
    [p.batch, p.channels, oh, ow]
}

/// Max pool of `x: [batch, channels, h, w]`; returns the output and, for the backward, the
/// position of each window's maximum in its input plane.
///
/// # Errors
///
/// As [`pool2d_params`]; out of memory.
pub fn max_pool2d(x: &Tensor, opts: &Pool2dOptions) -> Result<(Tensor, Indices)> {
    const OP: &str = "max_pool2d";
    let p = pool2d_params(x.shape(), opts)?;
    let shape = output_shape(&p);
    let mut y = output(OP, x.device(), &shape, x.dtype())?;
    let mut argmax = Indices::uninit(OP, x.device(), &shape)?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = x.device().cuda_backend() {
        cuda::max_pool2d(cu, &p, x, &mut y, &mut argmax)?;
        return Ok((y, argmax));
    }
    with_dtype!(x.dtype(), T => {
        cpu::max_pool2d(&p, x.as_slice::<T>()?, y.as_mut_slice::<T>()?, argmax.as_mut_slice()?)
    });
    Ok((y, argmax))
}

/// Checks `dy` against the pooled shape of `input_shape`; returns the geometry.
fn backward_params(
    op: &'static str,
    dy: &Tensor,
    input_shape: &[usize],
    opts: &Pool2dOptions,
) -> Result<Pool2dParams> {
    let p = pool2d_params(input_shape, opts)?;
    super::expect_shape(op, &output_shape(&p), dy)?;
    Ok(p)
}

/// Gradient of [`max_pool2d`] for an input of `input_shape`, from the upstream `dy` and the
/// saved `argmax`.
///
/// # Errors
///
/// [`Error::ShapeMismatch`] if `dy` or `argmax` is not the pooled shape;
/// [`Error::IndexOutOfRange`] for an argmax outside the input plane;
/// [`Error::DeviceMismatch`]; out of memory.
pub fn max_pool2d_backward(
    dy: &Tensor,
    argmax: &Indices,
    input_shape: &[usize],
    opts: &Pool2dOptions,
) -> Result<Tensor> {
    const OP: &str = "max_pool2d_backward";
    let p = backward_params(OP, dy, input_shape, opts)?;
    if argmax.device() != dy.device() {
        return Err(Error::DeviceMismatch { op: OP });
    }
    if argmax.shape() != dy.shape() {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: dy.shape().to_vec(),
            rhs: argmax.shape().to_vec(),
        });
    }
    #[cfg(feature = "cuda")]
    if let Some(cu) = dy.device().cuda_backend() {
        // The argmax stays on the device; the kernel skips entries outside the plane
        // instead of reporting them (they cannot come from `max_pool2d`).
        let mut dx = output(OP, dy.device(), input_shape, dy.dtype())?;
        cuda::max_pool2d_backward(cu, &p, dy, argmax, &mut dx)?;
        return Ok(dx);
    }
    let plane = p.h.saturating_mul(p.w);
    if let Some(&bad) = argmax.as_slice().iter().find(|&&i| i as usize >= plane) {
        return Err(Error::IndexOutOfRange { op: OP, index: bad as usize, bound: plane });
    }
    let mut dx = output(OP, dy.device(), input_shape, dy.dtype())?;
    with_dtype!(dy.dtype(), T => cpu::max_pool2d_backward(
        &p,
        dy.as_slice::<T>()?,
        argmax.as_slice(),
        dx.as_mut_slice::<T>()?,
    ));
    Ok(dx)
}

/// Average pool of `x: [batch, channels, h, w]`. Padding counts in the divisor when
/// `count_include_pad` (PyTorch's default).
///
/// # Errors
///
/// As [`pool2d_params`]; out of memory.
pub fn avg_pool2d(x: &Tensor, opts: &Pool2dOptions, count_include_pad: bool) -> Result<Tensor> {
    const OP: &str = "avg_pool2d";
    let p = pool2d_params(x.shape(), opts)?;
    let mut y = output(OP, x.device(), &output_shape(&p), x.dtype())?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = x.device().cuda_backend() {
        cuda::avg_pool2d(cu, &p, x, &mut y, count_include_pad)?;
        return Ok(y);
    }
    with_dtype!(x.dtype(), T => {
        cpu::avg_pool2d(&p, x.as_slice::<T>()?, y.as_mut_slice::<T>()?, count_include_pad)
    });
    Ok(y)
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
    const OP: &str = "avg_pool2d_backward";
    let p = backward_params(OP, dy, input_shape, opts)?;
    let mut dx = output(OP, dy.device(), input_shape, dy.dtype())?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = dy.device().cuda_backend() {
        cuda::avg_pool2d_backward(cu, &p, dy, &mut dx, count_include_pad)?;
        return Ok(dx);
    }
    with_dtype!(dy.dtype(), T => cpu::avg_pool2d_backward(
        &p,
        dy.as_slice::<T>()?,
        dx.as_mut_slice::<T>()?,
        count_include_pad,
    ));
    Ok(dx)
}

/// Global average pool: `x: [batch, channels, h, w]` to `[batch, channels]`.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a rank other than 4; out of memory.
pub fn global_avg_pool(x: &Tensor) -> Result<Tensor> {
    const OP: &str = "global_avg_pool";
    expect_rank(OP, x, 4, "x [batch, channels, h, w]")?;
    let s = x.shape();
    let hw = s[2] * s[3];
    if hw == 0 {
        return Err(invalid(OP, format!("cannot average an empty plane, x is {s:?}")));
    }
    let mut y = output(OP, x.device(), &s[..2], x.dtype())?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = x.device().cuda_backend() {
        cuda::global_avg_pool(cu, x, &mut y, hw)?;
        return Ok(y);
    }
    with_dtype!(x.dtype(), T => {
        cpu::global_avg_pool(x.as_slice::<T>()?, y.as_mut_slice::<T>()?, hw)
    });
    Ok(y)
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
    super::expect_shape(OP, &[b, c], dy)?;
    if h * w == 0 {
        return Err(invalid(
            OP,
            format!("cannot average an empty plane, input is {input_shape:?}"),
        ));
    }
    let mut dx = output(OP, dy.device(), input_shape, dy.dtype())?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = dy.device().cuda_backend() {
        cuda::global_avg_pool_backward(cu, dy, &mut dx, h * w)?;
        return Ok(dx);
    }
    with_dtype!(dy.dtype(), T => {
        cpu::global_avg_pool_backward(dy.as_slice::<T>()?, dx.as_mut_slice::<T>()?, h * w)
    });
    Ok(dx)
}
