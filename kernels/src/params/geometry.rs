//! The geometry of matrix products, convolutions and pooling windows: what the op layer
//! derives (checked) from tensor shapes and user options, and what the host reference and
//! the CUDA launches both read.
//!
//! Every size is computed with checked arithmetic: shapes or options so large that an
//! element count, an offset or an output size would overflow are an
//! [`Error::InvalidArgument`] naming them, never a wrapped value. [`Conv2dParams`] and
//! [`Pool2dParams`] are only made by their checked constructors, so a value of either type
//! always describes a computable op.

use crate::error::{Error, Result};

fn invalid(op: &'static str, reason: String) -> Error {
    Error::InvalidArgument { op, reason }
}

/// `a * b`, or an overflow error naming `what`.
pub(crate) fn mul(op: &'static str, what: &str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b).ok_or_else(|| invalid(op, format!("{what} ({a} x {b}) overflows")))
}

/// The product of `dims`, or an overflow error naming `what`.
pub(crate) fn product(op: &'static str, what: &str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| invalid(op, format!("{what} {dims:?} has more elements than fit in memory")))
}

// ---------------------------------------------------------------------------------------
// Matrix products

/// The shape and scaling of a (batched) matrix product `C = alpha * op(A) * op(B) + beta * C`.
///
/// `op(A)` is `[m, k]`: `A` is stored `[m, k]`, or `[k, m]` when `trans_a`. `op(B)` is
/// `[k, n]`: `B` is stored `[k, n]`, or `[n, k]` when `trans_b`. `C` is `[m, n]`. Batch `i`
/// reads `A` from element `i * stride_a`, `B` from `i * stride_b` and writes `C` from
/// `i * stride_c`; a stride of 0 for `A` or `B` broadcasts one matrix to every batch.
/// Strides count elements. `beta == 0` means `C` is not read (NaN in it does not leak).
///
/// Sizes derived from a spec saturate instead of overflowing, so a spec too large for
/// memory is refused by the length checks of whatever runs it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MatmulSpec {
    /// Rows of `op(A)` and of `C`.
    pub m: usize,
    /// Columns of `op(B)` and of `C`.
    pub n: usize,
    /// The contracted dimension.
    pub k: usize,
    /// `A` is stored transposed, `[k, m]`.
    pub trans_a: bool,
    /// `B` is stored transposed, `[n, k]`.
    pub trans_b: bool,
    /// Number of products.
    pub batch: usize,
    /// Elements between consecutive `A` matrices (0 broadcasts).
    pub stride_a: usize,
    /// Elements between consecutive `B` matrices (0 broadcasts).
    pub stride_b: usize,
    /// Elements between consecutive `C` matrices (at least `m * n` when `batch > 1`).
    pub stride_c: usize,
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of the previous content of `C`.
    pub beta: f32,
}

impl MatmulSpec {
    /// A single dense product `C = A * B` with `A: [m, k]`, `B: [k, n]`, `C: [m, n]`.
    pub fn new(m: usize, n: usize, k: usize) -> Self {
        Self {
            m,
            n,
            k,
            trans_a: false,
            trans_b: false,
            batch: 1,
            stride_a: m.saturating_mul(k),
            stride_b: k.saturating_mul(n),
            stride_c: m.saturating_mul(n),
            alpha: 1.0,
            beta: 0.0,
        }
    }

    /// Sets the transpose flags (see the type's doc for the stored layouts).
    pub fn transpose(mut self, trans_a: bool, trans_b: bool) -> Self {
        self.trans_a = trans_a;
        self.trans_b = trans_b;
        self
    }

    /// Makes it `batch` products with the given element strides (0 broadcasts A or B).
    pub fn batched(
        mut self,
        batch: usize,
        stride_a: usize,
        stride_b: usize,
        stride_c: usize,
    ) -> Self {
        self.batch = batch;
        self.stride_a = stride_a;
        self.stride_b = stride_b;
        self.stride_c = stride_c;
        self
    }

    /// Sets `alpha` and `beta`.
    pub fn scaled(mut self, alpha: f32, beta: f32) -> Self {
        self.alpha = alpha;
        self.beta = beta;
        self
    }

    /// Elements of `A` the product reads: `(batch - 1) * stride_a + m * k` (saturating).
    pub fn a_len(&self) -> usize {
        span(self.batch, self.stride_a, self.m.saturating_mul(self.k))
    }

    /// Elements of `B` the product reads: `(batch - 1) * stride_b + k * n` (saturating).
    pub fn b_len(&self) -> usize {
        span(self.batch, self.stride_b, self.k.saturating_mul(self.n))
    }

    /// Elements of `C` the product writes: `(batch - 1) * stride_c + m * n` (saturating).
    pub fn c_len(&self) -> usize {
        span(self.batch, self.stride_c, self.m.saturating_mul(self.n))
    }

    /// The spec and output shape of `op(A) * op(B)` for stored shapes `a: [.., r, c]` and
    /// `b: [.., r, c]`: equal batch dimensions pair up, and an operand of rank 2 is
    /// broadcast to every batch of the other (the layouts of `ops::matmul`).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an operand of rank below 2 or sizes that overflow;
    /// [`Error::ShapeMismatch`] if the contracted dimensions or the batch dimensions
    /// disagree.
    pub fn for_shapes(
        a: &[usize],
        b: &[usize],
        trans_a: bool,
        trans_b: bool,
    ) -> Result<(MatmulSpec, Vec<usize>)> {
        const OP: &str = "matmul";
        let mismatch = || Error::ShapeMismatch { op: OP, lhs: a.to_vec(), rhs: b.to_vec() };
        let (Some((a_batch, &[ar, ac])), Some((b_batch, &[br, bc]))) =
            (a.split_last_chunk::<2>(), b.split_last_chunk::<2>())
        else {
            return Err(invalid(OP, format!("operands need rank >= 2, got {a:?} and {b:?}")));
        };
        let (m, k) = if trans_a { (ac, ar) } else { (ar, ac) };
        let (kb, n) = if trans_b { (bc, br) } else { (br, bc) };
        if k != kb {
            return Err(mismatch());
        }
        let (mk, kn, mn) =
            (mul(OP, "m * k", m, k)?, mul(OP, "k * n", k, n)?, mul(OP, "m * n", m, n)?);
        // Equal batch dimensions pair up; a rank-2 operand is broadcast to every batch.
        let (batch_dims, stride_a, stride_b) = if a_batch == b_batch {
            (a_batch, mk, kn)
        } else if b_batch.is_empty() {
            (a_batch, mk, 0)
        } else if a_batch.is_empty() {
            (b_batch, 0, kn)
        } else {
            return Err(mismatch());
        };
        let batch = product(OP, "the batch", batch_dims)?;
        let mut out = batch_dims.to_vec();
        out.extend([m, n]);
        product(OP, "the product", &out)?;
        let spec = MatmulSpec::new(m, n, k)
            .transpose(trans_a, trans_b)
            .batched(batch, stride_a, stride_b, mn);
        Ok((spec, out))
    }
}

fn span(batch: usize, stride: usize, len: usize) -> usize {
    if batch == 0 || len == 0 { 0 } else { (batch - 1).saturating_mul(stride).saturating_add(len) }
}

// ---------------------------------------------------------------------------------------
// Convolution

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

/// How a convolution's tensors are stored: NCHW (`x: [batch, c_in, h, w]`,
/// `weight: [c_out, c_in / groups, kh, kw]`), or NHWC, PyTorch's channels_last
/// (`x: [batch, h, w, c_in]`, `weight: [c_out, kh, kw, c_in / groups]`, the output
/// `[batch, oh, ow, c_out]`), the layout cuDNN's tensor-core kernels read natively. In
/// files: `"nchw"`, `"nhwc"`.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum ConvLayout {
    /// Channels before the plane (vram's default).
    #[default]
    Nchw,
    /// Channels last (`torch.channels_last`).
    Nhwc,
}

/// Most multiply-adds of a convolution that runs as direct kernels
/// ([`Conv2dParams::is_direct`]): 2^26, about 0.13 GFLOP. Below it a convolution is small
/// (the toy models' 32-pixel images), kernel launches dominate its time and an im2col
/// buffer would dominate its memory. The convolutions of the real-size presets at 224
/// pixels that are not depthwise or pointwise are above it at any batch (ResNet-50's,
/// ViT-B's patch embedding), or from batch 13 on (MobileNetV3's stem: 3 input channels),
/// and keep the cuBLAS path.
pub const DIRECT_MAX_MACS: u64 = 1 << 26;

/// The full geometry of a 2-D convolution: the input and weight shapes with the
/// [`Conv2dOptions`], checked. Layouts: `x: [batch, c_in, h, w]`,
/// `weight: [c_out, c_in / groups, kh, kw]`, `bias: [c_out]`, `y: [batch, c_out, oh, ow]`
/// with `(oh, ow) = output_hw()`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dParams {
    batch: usize,
    c_in: usize,
    h: usize,
    w: usize,
    c_out: usize,
    kernel: (usize, usize),
    options: Conv2dOptions,
    out: (usize, usize),
}

/// One output dimension of a window of `k` taps `d` apart moved by `s` over `len` with `p`
/// padding on each side: `(len + 2p - (d (k - 1) + 1)) / s + 1`, or 0 when the window does
/// not fit; `None` on overflow.
fn out_len(len: usize, k: usize, s: usize, p: usize, d: usize) -> Option<usize> {
    let span = d.checked_mul(k.checked_sub(1)?)?.checked_add(1)?;
    let padded = p.checked_mul(2)?.checked_add(len)?;
    Some(padded.checked_sub(span).map_or(0, |r| r / s + 1))
}

/// A window moved over an input plane: the geometry a convolution and a pooling share, each
/// size a (vertical, horizontal) pair. [`Conv2dParams::window`] and
/// [`Pool2dParams::window`] give it (a pooling window is dense: dilation 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Window2d {
    /// The input plane, (h, w).
    pub(crate) input: (usize, usize),
    /// Taps, (kh, kw).
    pub(crate) kernel: (usize, usize),
    /// Step between windows.
    pub(crate) stride: (usize, usize),
    /// Padding on each side.
    pub(crate) padding: (usize, usize),
    /// Spacing between taps.
    pub(crate) dilation: (usize, usize),
    /// The output plane, (oh, ow): one position per window.
    pub(crate) output: (usize, usize),
}

impl Window2d {
    /// The window and its output plane ([`out_len`] per dimension); `None` on overflow.
    fn new(
        input: (usize, usize),
        kernel: (usize, usize),
        stride: (usize, usize),
        padding: (usize, usize),
        dilation: (usize, usize),
    ) -> Option<Window2d> {
        let oh = out_len(input.0, kernel.0, stride.0, padding.0, dilation.0)?;
        let ow = out_len(input.1, kernel.1, stride.1, padding.1, dilation.1)?;
        Some(Window2d { input, kernel, stride, padding, dilation, output: (oh, ow) })
    }
}

impl Conv2dParams {
    /// The geometry of convolving `x: [batch, c_in, h, w]` with
    /// `weight: [c_out, c_in / groups, kh, kw]` under `opts`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for ranks other than 4, a zero stride, dilation, kernel or
    /// group count, channels not divisible by the groups, or sizes that overflow;
    /// [`Error::ShapeMismatch`] if the weight's input channels do not match
    /// `c_in / groups`.
    pub fn new(x: &[usize], weight: &[usize], opts: &Conv2dOptions) -> Result<Conv2dParams> {
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
            return Err(invalid(
                OP,
                format!("groups {g} must divide c_in {c_in} and c_out {c_out}"),
            ));
        }
        if w_in.checked_mul(g) != Some(c_in) {
            return Err(Error::ShapeMismatch { op: OP, lhs: x.to_vec(), rhs: weight.to_vec() });
        }
        let (s, d, p) = (opts.stride, opts.dilation, opts.padding);
        if kh == 0 || kw == 0 || s.0 == 0 || s.1 == 0 || d.0 == 0 || d.1 == 0 {
            return Err(invalid(
                OP,
                format!("kernel ({kh}, {kw}), stride {s:?} and dilation {d:?} must be positive"),
            ));
        }
        let Some(Window2d { output: (oh, ow), .. }) = Window2d::new((h, w), (kh, kw), s, p, d)
        else {
            return Err(invalid(
                OP,
                format!(
                    "padding {p:?} and dilation {d:?} with kernel ({kh}, {kw}) overflow the input size"
                ),
            ));
        };
        product(OP, "the output", &[batch, c_out, oh, ow])?;
        product(OP, "the weight", weight)?;
        // The im2col matrix of one image and group: (c_in / groups) kh kw rows, oh ow columns.
        product(OP, "the im2col matrix", &[w_in, kh, kw, oh, ow, 4])?;
        Ok(Conv2dParams {
            batch,
            c_in,
            h,
            w,
            c_out,
            kernel: (kh, kw),
            options: *opts,
            out: (oh, ow),
        })
    }

    /// Images in the batch.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Input channels.
    pub fn c_in(&self) -> usize {
        self.c_in
    }

    /// Input height.
    pub fn h(&self) -> usize {
        self.h
    }

    /// Input width.
    pub fn w(&self) -> usize {
        self.w
    }

    /// Output channels.
    pub fn c_out(&self) -> usize {
        self.c_out
    }

    /// Kernel (height, width).
    pub fn kernel(&self) -> (usize, usize) {
        self.kernel
    }

    /// The options: stride, padding, dilation, groups.
    pub fn options(&self) -> &Conv2dOptions {
        &self.options
    }

    /// Step between windows.
    pub fn stride(&self) -> (usize, usize) {
        self.options.stride
    }

    /// Zero padding on each side.
    pub fn padding(&self) -> (usize, usize) {
        self.options.padding
    }

    /// Spacing between kernel taps.
    pub fn dilation(&self) -> (usize, usize) {
        self.options.dilation
    }

    /// Channel groups.
    pub fn groups(&self) -> usize {
        self.options.groups
    }

    /// Output (height, width): `(in + 2 * pad - dilation * (k - 1) - 1) / stride + 1`, or 0
    /// when the dilated kernel does not fit in the padded input.
    pub fn output_hw(&self) -> (usize, usize) {
        self.out
    }

    /// The window over one input plane.
    #[cfg(feature = "cuda")]
    pub(crate) fn window(&self) -> Window2d {
        Window2d {
            input: (self.h, self.w),
            kernel: self.kernel,
            stride: self.stride(),
            padding: self.padding(),
            dilation: self.dilation(),
            output: self.out,
        }
    }

    /// Elements of `x`.
    pub fn input_len(&self) -> usize {
        self.batch * self.c_in * self.h * self.w
    }

    /// Elements of `weight`.
    pub fn weight_len(&self) -> usize {
        self.c_out * self.c_in / self.groups() * self.kernel.0 * self.kernel.1
    }

    /// Elements of `y`.
    pub fn output_len(&self) -> usize {
        self.batch * self.c_out * self.out.0 * self.out.1
    }

    /// The output shape `[batch, c_out, oh, ow]`.
    pub fn output_shape(&self) -> [usize; 4] {
        [self.batch, self.c_out, self.out.0, self.out.1]
    }

    /// Whether each output channel reads exactly its own input channel.
    pub fn is_depthwise(&self) -> bool {
        self.groups() == self.c_in && self.c_out == self.c_in
    }

    /// Multiply-adds of the forward: every output element sums `c_in / groups * kh * kw`
    /// products (saturating).
    pub fn macs(&self) -> u64 {
        (self.output_len() as u64).saturating_mul(self.col_rows() as u64)
    }

    /// Whether the convolution runs as direct kernels, without im2col buffers and cuBLAS:
    /// depthwise convolutions, and those of at most [`DIRECT_MAX_MACS`] multiply-adds that
    /// are not pointwise, whose im2col buffer (`kh * kw` times the input) would cost more
    /// memory than the matrix product saves time. Decided from the shape alone, so every
    /// backend allocates the same.
    pub fn is_direct(&self) -> bool {
        self.is_depthwise() || (!self.is_pointwise() && self.macs() <= DIRECT_MAX_MACS)
    }

    /// Whether im2col would copy `x` unchanged (1x1 kernel, stride 1, no padding).
    pub(crate) fn is_pointwise(&self) -> bool {
        self.kernel == (1, 1) && self.stride() == (1, 1) && self.padding() == (0, 0)
    }

    /// Rows of the im2col matrix of one group: `c_in / groups * kh * kw`.
    pub(crate) fn col_rows(&self) -> usize {
        self.c_in / self.groups() * self.kernel.0 * self.kernel.1
    }
}

// ---------------------------------------------------------------------------------------
// Pooling

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

/// The full geometry of pooling `x: [batch, channels, h, w]` with a [`Pool2dOptions`]
/// window, checked; `y: [batch, channels, oh, ow]` with `(oh, ow) = output_hw()`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pool2dParams {
    batch: usize,
    channels: usize,
    h: usize,
    w: usize,
    options: Pool2dOptions,
    out: (usize, usize),
}

impl Pool2dParams {
    /// The geometry of pooling an input of shape `[batch, channels, h, w]`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a rank other than 4, an empty input plane (`h` or `w`
    /// zero: no window would hold an element), a zero kernel or stride, padding over half
    /// the window, or sizes that overflow.
    pub fn new(x: &[usize], opts: &Pool2dOptions) -> Result<Pool2dParams> {
        const OP: &str = "pool2d";
        let &[batch, channels, h, w] = x else {
            return Err(invalid(OP, format!("expected x [batch, channels, h, w], got {x:?}")));
        };
        let Pool2dOptions { kernel: k, stride: s, padding: p } = *opts;
        if k.0 == 0 || k.1 == 0 || s.0 == 0 || s.1 == 0 {
            return Err(invalid(OP, format!("kernel {k:?} and stride {s:?} must be positive")));
        }
        if p.0 > k.0 / 2 || p.1 > k.1 / 2 {
            return Err(invalid(OP, format!("padding {p:?} is more than half the window {k:?}")));
        }
        if h == 0 || w == 0 {
            return Err(invalid(
                OP,
                format!("the input plane of {x:?} is empty; a window needs an element to pool"),
            ));
        }
        let Some(Window2d { output: (oh, ow), .. }) = Window2d::new((h, w), k, s, p, (1, 1)) else {
            return Err(invalid(OP, format!("padding {p:?} overflows the input size {x:?}")));
        };
        product(OP, "the output", &[batch, channels, oh, ow])?;
        Ok(Pool2dParams { batch, channels, h, w, options: *opts, out: (oh, ow) })
    }

    /// Images in the batch.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Channels (pooled independently).
    pub fn channels(&self) -> usize {
        self.channels
    }

    /// Input height.
    pub fn h(&self) -> usize {
        self.h
    }

    /// Input width.
    pub fn w(&self) -> usize {
        self.w
    }

    /// Window (height, width).
    pub fn kernel(&self) -> (usize, usize) {
        self.options.kernel
    }

    /// Step between windows.
    pub fn stride(&self) -> (usize, usize) {
        self.options.stride
    }

    /// Implicit padding on each side (at most half the window, so every window holds at
    /// least one real element).
    pub fn padding(&self) -> (usize, usize) {
        self.options.padding
    }

    /// Output (height, width): `(in + 2 * pad - k) / stride + 1`, or 0 when the window does
    /// not fit in the padded input.
    pub fn output_hw(&self) -> (usize, usize) {
        self.out
    }

    /// The window over one input plane (dense: dilation 1).
    #[cfg(feature = "cuda")]
    pub(crate) fn window(&self) -> Window2d {
        Window2d {
            input: (self.h, self.w),
            kernel: self.kernel(),
            stride: self.stride(),
            padding: self.padding(),
            dilation: (1, 1),
            output: self.out,
        }
    }

    /// Elements of `x`.
    pub fn input_len(&self) -> usize {
        self.batch * self.channels * self.h * self.w
    }

    /// Elements of `y`.
    pub fn output_len(&self) -> usize {
        self.batch * self.channels * self.out.0 * self.out.1
    }

    /// The output shape `[batch, channels, oh, ow]`.
    pub fn output_shape(&self) -> [usize; 4] {
        [self.batch, self.channels, self.out.0, self.out.1]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_and_depthwise_convolutions_are_direct_real_size_ones_are_not() {
        let o = Conv2dOptions::default();
        let direct = |x: [usize; 4], w: [usize; 4], o: Conv2dOptions| {
            Conv2dParams::new(&x, &w, &o).unwrap().is_direct()
        };
        // The toy models' 3x3 convolutions at 32 px; depthwise ones at any size.
        assert!(direct([8, 16, 32, 32], [16, 16, 3, 3], o.padding((1, 1))));
        assert!(direct([64, 96, 56, 56], [96, 1, 3, 3], o.padding((1, 1)).groups(96)));
        // Pointwise ones keep the product (their forward needs no buffer).
        assert!(!direct([2, 8, 7, 7], [16, 8, 1, 1], o));
        // ResNet-50 at batch 1: its smallest 3x3 (layer 4) and strided 1x1 convolutions.
        assert!(!direct([1, 512, 7, 7], [512, 512, 3, 3], o.padding((1, 1))));
        assert!(!direct([1, 1024, 14, 14], [2048, 1024, 1, 1], o.stride((2, 2))));
        // MobileNetV3's stem goes over the threshold at batch 13.
        let stem = |b| direct([b, 3, 224, 224], [16, 3, 3, 3], o.stride((2, 2)).padding((1, 1)));
        assert!(stem(12) && !stem(13));
        let p = Conv2dParams::new(&[8, 16, 32, 32], &[16, 8, 3, 3], &o.padding((1, 1)).groups(2));
        assert_eq!(p.unwrap().macs(), 8 * 16 * 32 * 32 * 8 * 9);
    }

    #[test]
    fn huge_padding_dilation_and_shapes_are_errors_not_overflows() {
        let opts = Conv2dOptions::default();
        let huge = usize::MAX / 2;
        for (x, w, o) in [
            ([1, 1, 4, 4], [1, 1, 3, 3], opts.padding((huge, 0))),
            ([1, 1, 4, 4], [1, 1, 3, 3], opts.dilation((usize::MAX, 1))),
            ([1, 1, 4, 4], [1, 1, usize::MAX, 1], opts.dilation((2, 1))),
            ([huge, 1, 1, 1], [huge, 1, 1, 1], opts),
            ([1, 1, 1, 1], [1, 1, 1, 1], opts.groups(usize::MAX)),
        ] {
            let e = Conv2dParams::new(&x, &w, &o).unwrap_err();
            assert!(
                matches!(e, Error::InvalidArgument { .. } | Error::ShapeMismatch { .. }),
                "{e}"
            );
        }
        let pool = Pool2dOptions::new((2, 2), (1, 1));
        for (x, o) in [
            ([1, 1, usize::MAX, 2], pool.padding((1, 0))),
            ([huge, huge, 4, 4], pool),
            ([1, 1, 4, 4], Pool2dOptions::new((usize::MAX, 2), (1, 1)).padding((huge, 0))),
        ] {
            assert!(Pool2dParams::new(&x, &o).is_err(), "{x:?} {o:?}");
        }
        for (a, b) in [
            (vec![huge, huge], vec![huge, 4]),
            (vec![huge, 2, 2], vec![huge, 2, 2]),
            (vec![huge, huge, 1, 1], vec![1, 1]),
        ] {
            let e = MatmulSpec::for_shapes(&a, &b, false, false).unwrap_err();
            assert!(e.to_string().contains("overflow") || e.to_string().contains("fit"), "{e}");
        }
    }

    #[test]
    fn output_sizes_follow_the_pytorch_formula() {
        let p = Conv2dParams::new(
            &[1, 3, 32, 30],
            &[8, 3, 3, 5],
            &Conv2dOptions::default().stride((2, 1)).padding((1, 2)).dilation((1, 2)),
        )
        .unwrap();
        // (32 + 2 - 3) / 2 + 1 = 16; (30 + 4 - 9) / 1 + 1 = 26.
        assert_eq!(p.output_hw(), (16, 26));
        let small = Conv2dParams::new(&[1, 1, 2, 2], &[1, 1, 3, 3], &Conv2dOptions::default());
        assert_eq!(small.unwrap().output_hw(), (0, 0));
        let pool =
            Pool2dParams::new(&[1, 1, 5, 5], &Pool2dOptions::new((3, 3), (2, 2)).padding((1, 1)));
        assert_eq!(pool.unwrap().output_hw(), (3, 3));
    }

    #[test]
    fn pooling_an_empty_plane_is_an_error() {
        let opts = Pool2dOptions::new((2, 2), (2, 2)).padding((1, 1));
        for x in [[1, 1, 0, 4], [1, 1, 4, 0]] {
            let e = Pool2dParams::new(&x, &opts).unwrap_err();
            assert!(e.to_string().contains("empty"), "{e}");
        }
        // An empty batch or channel count is fine: the output is empty.
        assert_eq!(Pool2dParams::new(&[0, 3, 4, 4], &opts).unwrap().output_len(), 0);
    }
}
