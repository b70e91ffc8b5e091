//! 2-D convolution (NCHW, with groups, so depthwise convolutions too), forward and backward.

use super::{expect_rank, invalid, output, same_kind, with_dtype};
use crate::cpu::conv as cpu;
use crate::cpu::conv::Conv2dParams;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// The settings of a 2-D convolution that the tensor shapes do not give.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dOptions {
    /// Step between windows, (vertical, horizontal).
    pub stride: (usize, usize),
    /// Zero padding on each side, (vertical, horizontal).
    pub padding: (usize, usize),
    /// Spacing between kernel taps; 1 is a dense kernel.
    pub dilation: (usize, usize),
    /// Channel groups; `groups == c_in == c_out` is a depthwise convolution.
    pub groups: usize,
}

impl Default for Conv2dOptions {
    fn default() -> Self {
        Conv2dOptions { stride: (1, 1), padding: (0, 0), dilation: (1, 1), groups: 1 }
    }
}

impl Conv2dOptions {
    /// Sets the stride.
    pub fn stride(mut self, stride: (usize, usize)) -> Self {
        self.stride = stride;
        self
    }

    /// Sets the padding.
    pub fn padding(mut self, padding: (usize, usize)) -> Self {
        self.padding = padding;
        self
    }

    /// Sets the dilation.
    pub fn dilation(mut self, dilation: (usize, usize)) -> Self {
        self.dilation = dilation;
        self
    }

    /// Sets the number of groups.
    pub fn groups(mut self, groups: usize) -> Self {
        self.groups = groups;
        self
    }
}

/// The full geometry of a convolution of input shape `x: [batch, c_in, h, w]` with weight
/// shape `weight: [c_out, c_in / groups, kh, kw]`; the output is
/// `[batch, c_out, oh, ow]` with `(oh, ow) = params.output_hw()`.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for ranks other than 4, a zero stride, dilation, kernel or
/// group count, or channels not divisible by the groups; [`Error::ShapeMismatch`] if the
/// weight's input channels do not match `c_in / groups`.
pub fn conv2d_params(x: &[usize], weight: &[usize], opts: &Conv2dOptions) -> Result<Conv2dParams> {
    const OP: &str = "conv2d";
    let (&[batch, c_in, h, w], &[c_out, w_in, kh, kw]) = (x, weight) else {
        return Err(invalid(
            OP,
            format!(
                "expected x [batch, c_in, h, w] and weight [c_out, c_in/groups, kh, kw], got {x:?} and {weight:?}"
            ),
        ));
    };
    let g = opts.groups;
    if g == 0 || !c_in.is_multiple_of(g) || !c_out.is_multiple_of(g) {
        return Err(invalid(OP, format!("groups {g} must divide c_in {c_in} and c_out {c_out}")));
    }
    if w_in * g != c_in {
        return Err(Error::ShapeMismatch { op: OP, lhs: x.to_vec(), rhs: weight.to_vec() });
    }
    let (s, d) = (opts.stride, opts.dilation);
    if kh == 0 || kw == 0 || s.0 == 0 || s.1 == 0 || d.0 == 0 || d.1 == 0 {
        return Err(invalid(
            OP,
            format!("kernel ({kh}, {kw}), stride {s:?} and dilation {d:?} must be positive"),
        ));
    }
    Ok(Conv2dParams::new(batch, c_in, (h, w), c_out, (kh, kw))
        .stride(s)
        .padding(opts.padding)
        .dilation(d)
        .groups(g))
}

fn output_shape(p: &Conv2dParams) -> [usize; 4] {
    let (oh, ow) = p.output_hw();
    [p.batch, p.c_out, oh, ow]
}

/// `conv2d(x, weight) + bias` with `x: [batch, c_in, h, w]`,
/// `weight: [c_out, c_in / groups, kh, kw]`, `bias: [c_out]`; the result is
/// `[batch, c_out, oh, ow]`.
///
/// # Errors
///
/// As [`conv2d_params`]; dtype and device mismatches; out of memory.
pub fn conv2d(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    opts: &Conv2dOptions,
) -> Result<Tensor> {
    const OP: &str = "conv2d";
    same_kind(OP, x, weight)?;
    let p = conv2d_params(x.shape(), weight.shape(), opts)?;
    if let Some(bias) = bias {
        same_kind(OP, x, bias)?;
        super::expect_shape(OP, &[p.c_out], bias)?;
    }
    let mut y = output(OP, x.device(), &output_shape(&p), x.dtype())?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = x.device().cuda_backend() {
        if y.numel() > 0 {
            crate::cuda::ops::conv::conv2d(cu, &p, x, weight, bias, &mut y)?;
        }
        return Ok(y);
    }
    if y.numel() > 0 {
        with_dtype!(x.dtype(), T => cpu::conv2d(
            &p,
            x.as_slice::<T>()?,
            weight.as_slice::<T>()?,
            bias.map(|b| b.as_slice::<T>()).transpose()?,
            y.as_mut_slice::<T>()?,
        ));
    }
    Ok(y)
}

/// Gradients of a 2-D convolution.
#[derive(Debug)]
pub struct Conv2dGrads {
    /// Gradient of the input, `x`'s shape.
    pub dx: Tensor,
    /// Gradient of the weight, the weight's shape.
    pub dweight: Tensor,
    /// Gradient of the bias, `[c_out]`, when asked for.
    pub dbias: Option<Tensor>,
}

/// Gradients of [`conv2d`] from the forward input `x`, the `weight` and the upstream `dy`;
/// `dbias` is computed when `with_bias`.
///
/// # Errors
///
/// As [`conv2d`], and [`Error::ShapeMismatch`] if `dy` is not the output's shape.
pub fn conv2d_backward(
    x: &Tensor,
    weight: &Tensor,
    dy: &Tensor,
    opts: &Conv2dOptions,
    with_bias: bool,
) -> Result<Conv2dGrads> {
    const OP: &str = "conv2d_backward";
    same_kind(OP, x, weight)?;
    same_kind(OP, x, dy)?;
    expect_rank(OP, dy, 4, "dy [batch, c_out, oh, ow]")?;
    let p = conv2d_params(x.shape(), weight.shape(), opts)?;
    super::expect_shape(OP, &output_shape(&p), dy)?;
    // With no output element nothing flows back, and the reference leaves outputs unwritten.
    let zeros = dy.numel() == 0;
    let alloc = |shape: &[usize]| {
        if zeros {
            Tensor::zeros(x.device(), shape, x.dtype())
        } else {
            output(OP, x.device(), shape, x.dtype())
        }
    };
    let mut dx = alloc(x.shape())?;
    let mut dweight = alloc(weight.shape())?;
    let mut dbias = if with_bias { Some(alloc(&[p.c_out])?) } else { None };
    #[cfg(feature = "cuda")]
    if let Some(cu) = x.device().cuda_backend() {
        if !zeros {
            crate::cuda::ops::conv::conv2d_backward(
                cu,
                &p,
                x,
                weight,
                dy,
                &mut dx,
                &mut dweight,
                dbias.as_mut(),
            )?;
        }
        return Ok(Conv2dGrads { dx, dweight, dbias });
    }
    if !zeros {
        with_dtype!(x.dtype(), T => cpu::conv2d_backward(
            &p,
            x.as_slice::<T>()?,
            weight.as_slice::<T>()?,
            dy.as_slice::<T>()?,
            Some(dx.as_mut_slice::<T>()?),
            Some(dweight.as_mut_slice::<T>()?),
            dbias.as_mut().map(|d| d.as_mut_slice::<T>()).transpose()?,
        ));
    }
    Ok(Conv2dGrads { dx, dweight, dbias })
}
