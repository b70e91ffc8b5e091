//! 2-D convolution on the host, NCHW: im2col + gemm per group, and a direct loop for
//! depthwise convolutions (one input channel per output channel), where im2col would
//! turn every group into a matrix-vector product not worth its copy.
//!
//! Layouts: `x: [batch, c_in, h, w]`, `weight: [c_out, c_in / groups, kh, kw]`,
//! `bias: [c_out]`, `y: [batch, c_out, oh, ow]` with `(oh, ow) = params.output_hw()`.

use super::matmul::{MatmulSpec, widen, with_f32_out};
use crate::dtype::Element;
use rayon::prelude::*;
use std::ops::Range;

/// The geometry of a 2-D convolution (see the module doc for the tensor layouts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dParams {
    /// Images in the batch.
    pub batch: usize,
    /// Input channels.
    pub c_in: usize,
    /// Input height.
    pub h: usize,
    /// Input width.
    pub w: usize,
    /// Output channels.
    pub c_out: usize,
    /// Kernel (height, width).
    pub kernel: (usize, usize),
    /// Step between windows, (vertical, horizontal).
    pub stride: (usize, usize),
    /// Zero padding on each side, (vertical, horizontal).
    pub padding: (usize, usize),
    /// Spacing between kernel taps, (vertical, horizontal); 1 is a dense kernel.
    pub dilation: (usize, usize),
    /// Channel groups: `c_in` and `c_out` are both multiples of it.
    pub groups: usize,
}

impl Conv2dParams {
    /// A dense convolution with stride 1, no padding, no dilation and one group.
    pub fn new(
        batch: usize,
        c_in: usize,
        (h, w): (usize, usize),
        c_out: usize,
        kernel: (usize, usize),
    ) -> Self {
        Self {
            batch,
            c_in,
            h,
            w,
            c_out,
            kernel,
            stride: (1, 1),
            padding: (0, 0),
            dilation: (1, 1),
            groups: 1,
        }
    }

    /// Sets the stride.
    pub fn stride(mut self, stride: (usize, usize)) -> Self {
        self.stride = stride;
        self
    }

    /// Sets the zero padding.
    pub fn padding(mut self, padding: (usize, usize)) -> Self {
        self.padding = padding;
        self
    }

    /// Sets the dilation.
    pub fn dilation(mut self, dilation: (usize, usize)) -> Self {
        self.dilation = dilation;
        self
    }

    /// Sets the number of groups (`c_in` for a depthwise convolution).
    pub fn groups(mut self, groups: usize) -> Self {
        self.groups = groups;
        self
    }

    /// Output (height, width): `(in + 2 * pad - dilation * (k - 1) - 1) / stride + 1`, or 0
    /// when the dilated kernel does not fit in the padded input.
    pub fn output_hw(&self) -> (usize, usize) {
        let out = |len: usize, k: usize, s: usize, p: usize, d: usize| {
            let span = d * (k - 1) + 1;
            (len + 2 * p).checked_sub(span).map_or(0, |r| r / s + 1)
        };
        (
            out(self.h, self.kernel.0, self.stride.0, self.padding.0, self.dilation.0),
            out(self.w, self.kernel.1, self.stride.1, self.padding.1, self.dilation.1),
        )
    }

    /// Elements of `x`.
    pub fn input_len(&self) -> usize {
        self.batch * self.c_in * self.h * self.w
    }

    /// Elements of `weight`.
    pub fn weight_len(&self) -> usize {
        self.c_out * self.c_in / self.groups * self.kernel.0 * self.kernel.1
    }

    /// Elements of `y`.
    pub fn output_len(&self) -> usize {
        let (oh, ow) = self.output_hw();
        self.batch * self.c_out * oh * ow
    }

    /// Whether each output channel reads exactly its own input channel.
    pub fn is_depthwise(&self) -> bool {
        self.groups == self.c_in && self.c_out == self.c_in
    }

    /// Rows of the im2col matrix of one group: `c_in / groups * kh * kw`.
    fn col_rows(&self) -> usize {
        self.c_in / self.groups * self.kernel.0 * self.kernel.1
    }

    /// Whether im2col would copy `x` unchanged (1x1 kernel, stride 1, no padding).
    fn is_pointwise(&self) -> bool {
        self.kernel == (1, 1) && self.stride == (1, 1) && self.padding == (0, 0)
    }

    fn debug_check(&self, x: usize, w: usize, y: usize) {
        debug_assert!(
            self.groups > 0
                && self.c_in.is_multiple_of(self.groups)
                && self.c_out.is_multiple_of(self.groups)
        );
        debug_assert!(
            self.stride.0 > 0 && self.stride.1 > 0 && self.dilation.0 > 0 && self.dilation.1 > 0
        );
        debug_assert_eq!(x, self.input_len(), "conv2d: x length");
        debug_assert_eq!(w, self.weight_len(), "conv2d: weight length");
        debug_assert_eq!(y, self.output_len(), "conv2d: output length");
    }
}

/// Computes `y = conv2d(x, weight) + bias` (layouts in the module doc).
pub fn conv2d<T: Element>(
    p: &Conv2dParams,
    x: &[T],
    weight: &[T],
    bias: Option<&[T]>,
    y: &mut [T],
) {
    p.debug_check(x.len(), weight.len(), y.len());
    let (x, weight) = (widen(x), widen(weight));
    let bias = bias.map(widen);
    with_f32_out(y, |y| {
        if p.is_depthwise() {
            depthwise_forward(p, &x, &weight, y);
        } else {
            im2col_forward(p, &x, &weight, y);
        }
        if let Some(bias) = bias {
            debug_assert_eq!(bias.len(), p.c_out);
            let (oh, ow) = p.output_hw();
            for (plane, b) in y.chunks_exact_mut((oh * ow).max(1)).zip(bias.iter().cycle()) {
                plane.iter_mut().for_each(|v| *v += b);
            }
        }
    });
}

/// Gradients of [`conv2d`] for `dy` (`y`'s layout), overwriting the outputs asked for:
/// `dx` (`x`'s layout), `dweight` (`weight`'s), `dbias` (`[c_out]`).
#[allow(clippy::too_many_arguments)]
pub fn conv2d_backward<T: Element>(
    p: &Conv2dParams,
    x: &[T],
    weight: &[T],
    dy: &[T],
    dx: Option<&mut [T]>,
    dweight: Option<&mut [T]>,
    dbias: Option<&mut [T]>,
) {
    p.debug_check(x.len(), weight.len(), dy.len());
    let dy = widen(dy);
    if let Some(dx) = dx {
        let weight = widen(weight);
        with_f32_out(dx, |dx| {
            if p.is_depthwise() {
                depthwise_backward_input(p, &weight, &dy, dx);
            } else {
                im2col_backward_input(p, &weight, &dy, dx);
            }
        });
    }
    if let Some(dweight) = dweight {
        let x = widen(x);
        with_f32_out(dweight, |dw| {
            if p.is_depthwise() {
                depthwise_backward_weight(p, &x, &dy, dw);
            } else {
                im2col_backward_weight(p, &x, &dy, dw);
            }
        });
    }
    if let Some(dbias) = dbias {
        debug_assert_eq!(dbias.len(), p.c_out);
        let (oh, ow) = p.output_hw();
        let mut sum = vec![0.0f32; p.c_out];
        for (plane, s) in dy.chunks_exact((oh * ow).max(1)).zip((0..p.c_out).cycle()) {
            sum[s] += plane.iter().sum::<f32>();
        }
        for (d, s) in dbias.iter_mut().zip(sum) {
            *d = T::from_f32(s);
        }
    }
}

/// The output positions `o in 0..out_len` whose input coordinate `o * stride + offset`
/// lies in `0..in_len`; `offset` is `tap * dilation - padding`.
fn valid_range(out_len: usize, in_len: usize, stride: usize, offset: isize) -> Range<usize> {
    let lo = if offset < 0 { ((-offset) as usize).div_ceil(stride) } else { 0 };
    let last = in_len as isize - 1 - offset;
    let hi = if last < 0 { 0 } else { (last as usize / stride + 1).min(out_len) };
    lo.min(hi)..hi
}

/// Calls `f(row, tap_offsets)` for every row of a group's im2col matrix: `row` indexes
/// `(channel, ky, kx)` and the offsets are `(ky * dh - ph, kx * dw - pw)`.
fn for_each_tap(p: &Conv2dParams, channels: usize, mut f: impl FnMut(usize, usize, isize, isize)) {
    let (kh, kw) = p.kernel;
    for c in 0..channels {
        for ky in 0..kh {
            for kx in 0..kw {
                let row = (c * kh + ky) * kw + kx;
                let oy = (ky * p.dilation.0) as isize - p.padding.0 as isize;
                let ox = (kx * p.dilation.1) as isize - p.padding.1 as isize;
                f(row, c, oy, ox);
            }
        }
    }
}

/// Fills `col: [cin_g * kh * kw, oh * ow]` from one group of one image, `x: [cin_g, h, w]`.
fn im2col(p: &Conv2dParams, x: &[f32], col: &mut [f32]) {
    let (oh, ow) = p.output_hw();
    let (h, w) = (p.h, p.w);
    for_each_tap(p, p.c_in / p.groups, |row, c, off_y, off_x| {
        let col = &mut col[row * oh * ow..(row + 1) * oh * ow];
        col.fill(0.0);
        let xs = valid_range(ow, w, p.stride.1, off_x);
        for oy in valid_range(oh, h, p.stride.0, off_y) {
            let iy = (oy * p.stride.0) as isize + off_y;
            let src = &x[(c * h + iy as usize) * w..][..w];
            let dst = &mut col[oy * ow..(oy + 1) * ow];
            for ox in xs.clone() {
                dst[ox] = src[((ox * p.stride.1) as isize + off_x) as usize];
            }
        }
    });
}

/// Adds `col: [cin_g * kh * kw, oh * ow]` back into one group of one image (inverse
/// scatter of [`im2col`]).
fn col2im(p: &Conv2dParams, col: &[f32], x: &mut [f32]) {
    let (oh, ow) = p.output_hw();
    let (h, w) = (p.h, p.w);
    for_each_tap(p, p.c_in / p.groups, |row, c, off_y, off_x| {
        let col = &col[row * oh * ow..(row + 1) * oh * ow];
        let xs = valid_range(ow, w, p.stride.1, off_x);
        for oy in valid_range(oh, h, p.stride.0, off_y) {
            let iy = (oy * p.stride.0) as isize + off_y;
            let dst = &mut x[(c * h + iy as usize) * w..][..w];
            let src = &col[oy * ow..(oy + 1) * ow];
            for ox in xs.clone() {
                dst[((ox * p.stride.1) as isize + off_x) as usize] += src[ox];
            }
        }
    });
}

fn im2col_forward(p: &Conv2dParams, x: &[f32], weight: &[f32], y: &mut [f32]) {
    let (oh, ow) = p.output_hw();
    let (ohw, k) = (oh * ow, p.col_rows());
    let (cin_g, cout_g) = (p.c_in / p.groups, p.c_out / p.groups);
    if ohw == 0 || p.batch == 0 {
        return;
    }
    let spec = MatmulSpec::new(cout_g, ohw, k);
    y.par_chunks_mut(p.c_out * ohw).zip(x.par_chunks(p.c_in * p.h * p.w)).for_each_init(
        || vec![0.0f32; if p.is_pointwise() { 0 } else { k * ohw }],
        |col, (y, x)| {
            for g in 0..p.groups {
                let x = &x[g * cin_g * p.h * p.w..][..cin_g * p.h * p.w];
                let cols: &[f32] = if p.is_pointwise() {
                    x
                } else {
                    im2col(p, x, col);
                    col
                };
                let y = &mut y[g * cout_g * ohw..][..cout_g * ohw];
                super::matmul::matmul(&spec, &weight[g * cout_g * k..][..cout_g * k], cols, y);
            }
        },
    );
}

fn im2col_backward_input(p: &Conv2dParams, weight: &[f32], dy: &[f32], dx: &mut [f32]) {
    let (oh, ow) = p.output_hw();
    let (ohw, k) = (oh * ow, p.col_rows());
    let (cin_g, cout_g) = (p.c_in / p.groups, p.c_out / p.groups);
    let plane_in = cin_g * p.h * p.w;
    // dcol = W_g^T * dy_g: [k, cout_g] x [cout_g, ohw].
    let spec = MatmulSpec::new(k, ohw, cout_g).transpose(true, false);
    if ohw == 0 {
        dx.fill(0.0);
        return;
    }
    dx.par_chunks_mut(p.c_in * p.h * p.w).zip(dy.par_chunks((p.c_out * ohw).max(1))).for_each_init(
        || vec![0.0f32; if p.is_pointwise() { 0 } else { k * ohw }],
        |dcol, (dx, dy)| {
            for g in 0..p.groups {
                let w = &weight[g * cout_g * k..][..cout_g * k];
                let dy = &dy[g * cout_g * ohw..][..cout_g * ohw];
                let dx = &mut dx[g * plane_in..][..plane_in];
                if p.is_pointwise() {
                    super::matmul::matmul(&spec, w, dy, dx);
                } else {
                    super::matmul::matmul(&spec, w, dy, dcol);
                    dx.fill(0.0);
                    col2im(p, dcol, dx);
                }
            }
        },
    );
}

fn im2col_backward_weight(p: &Conv2dParams, x: &[f32], dy: &[f32], dw: &mut [f32]) {
    let (oh, ow) = p.output_hw();
    let (ohw, k) = (oh * ow, p.col_rows());
    let (cin_g, cout_g) = (p.c_in / p.groups, p.c_out / p.groups);
    let plane_in = cin_g * p.h * p.w;
    // dW_g += dy_g * col^T: [cout_g, ohw] x [ohw, k], summed over the images.
    let spec = MatmulSpec::new(cout_g, k, ohw).transpose(false, true).scaled(1.0, 1.0);
    let len = dw.len();
    let sum = (0..p.batch)
        .into_par_iter()
        .fold(
            || (vec![0.0f32; len], vec![0.0f32; if p.is_pointwise() { 0 } else { k * ohw }]),
            |(mut acc, mut col), n| {
                let x = &x[n * p.c_in * p.h * p.w..];
                let dy = &dy[n * p.c_out * ohw..];
                for g in 0..p.groups {
                    let x = &x[g * plane_in..][..plane_in];
                    let cols: &[f32] = if p.is_pointwise() {
                        x
                    } else {
                        im2col(p, x, &mut col);
                        &col
                    };
                    let dy = &dy[g * cout_g * ohw..][..cout_g * ohw];
                    super::matmul::matmul(
                        &spec,
                        dy,
                        cols,
                        &mut acc[g * cout_g * k..][..cout_g * k],
                    );
                }
                (acc, col)
            },
        )
        .map(|(acc, _)| acc)
        .reduce_with(|mut a, b| {
            a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
            a
        });
    match sum {
        Some(sum) => dw.copy_from_slice(&sum),
        None => dw.fill(0.0),
    }
}

/// Depthwise forward: plane `(n, c)` of `y` is plane `(n, c)` of `x` correlated with
/// kernel `c`.
fn depthwise_forward(p: &Conv2dParams, x: &[f32], weight: &[f32], y: &mut [f32]) {
    let (oh, ow) = p.output_hw();
    let (kh, kw) = p.kernel;
    if oh * ow == 0 {
        return;
    }
    y.par_chunks_mut(oh * ow).zip(x.par_chunks(p.h * p.w)).enumerate().for_each(
        |(plane, (y, x))| {
            let w = &weight[(plane % p.c_in) * kh * kw..][..kh * kw];
            y.fill(0.0);
            for_each_tap(p, 1, |row, _, off_y, off_x| {
                let wv = w[row];
                let xs = valid_range(ow, p.w, p.stride.1, off_x);
                for oy in valid_range(oh, p.h, p.stride.0, off_y) {
                    let src = &x[((oy * p.stride.0) as isize + off_y) as usize * p.w..][..p.w];
                    let dst = &mut y[oy * ow..(oy + 1) * ow];
                    for ox in xs.clone() {
                        dst[ox] += wv * src[((ox * p.stride.1) as isize + off_x) as usize];
                    }
                }
            });
        },
    );
}

fn depthwise_backward_input(p: &Conv2dParams, weight: &[f32], dy: &[f32], dx: &mut [f32]) {
    let (oh, ow) = p.output_hw();
    let (kh, kw) = p.kernel;
    if oh * ow == 0 {
        dx.fill(0.0);
        return;
    }
    dx.par_chunks_mut((p.h * p.w).max(1))
        .zip(dy.par_chunks((oh * ow).max(1)))
        .enumerate()
        .for_each(|(plane, (dx, dy))| {
            let w = &weight[(plane % p.c_in) * kh * kw..][..kh * kw];
            dx.fill(0.0);
            for_each_tap(p, 1, |row, _, off_y, off_x| {
                let wv = w[row];
                let xs = valid_range(ow, p.w, p.stride.1, off_x);
                for oy in valid_range(oh, p.h, p.stride.0, off_y) {
                    let dst = &mut dx[((oy * p.stride.0) as isize + off_y) as usize * p.w..][..p.w];
                    let src = &dy[oy * ow..(oy + 1) * ow];
                    for ox in xs.clone() {
                        dst[((ox * p.stride.1) as isize + off_x) as usize] += wv * src[ox];
                    }
                }
            });
        });
}

fn depthwise_backward_weight(p: &Conv2dParams, x: &[f32], dy: &[f32], dw: &mut [f32]) {
    let (oh, ow) = p.output_hw();
    let (kh, kw) = p.kernel;
    dw.par_chunks_mut(kh * kw).enumerate().for_each(|(c, dw)| {
        dw.fill(0.0);
        for n in 0..p.batch {
            let plane = n * p.c_in + c;
            let x = &x[plane * p.h * p.w..][..p.h * p.w];
            let dy = &dy[plane * oh * ow..][..oh * ow];
            for_each_tap(p, 1, |row, _, off_y, off_x| {
                let xs = valid_range(ow, p.w, p.stride.1, off_x);
                let mut acc = 0.0f32;
                for oy in valid_range(oh, p.h, p.stride.0, off_y) {
                    let src = &x[((oy * p.stride.0) as isize + off_y) as usize * p.w..][..p.w];
                    let g = &dy[oy * ow..(oy + 1) * ow];
                    for ox in xs.clone() {
                        acc += g[ox] * src[((ox * p.stride.1) as isize + off_x) as usize];
                    }
                }
                dw[row] += acc;
            });
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::elementwise::testing::{assert_close, round as cast, widen as to_f64};
    use half::{bf16, f16};
    use proptest::prelude::*;

    /// f64 convolution straight from the definition.
    fn reference(p: &Conv2dParams, x: &[f64], w: &[f64], bias: &[f64]) -> Vec<f64> {
        let (oh, ow) = p.output_hw();
        let (kh, kw) = p.kernel;
        let (cin_g, cout_g) = (p.c_in / p.groups, p.c_out / p.groups);
        let mut y = vec![0.0; p.output_len()];
        for n in 0..p.batch {
            for co in 0..p.c_out {
                let g = co / cout_g;
                for oy in 0..oh {
                    for ox in 0..ow {
                        let mut acc = bias[co];
                        for ci in 0..cin_g {
                            for ky in 0..kh {
                                for kx in 0..kw {
                                    let iy = (oy * p.stride.0 + ky * p.dilation.0) as isize
                                        - p.padding.0 as isize;
                                    let ix = (ox * p.stride.1 + kx * p.dilation.1) as isize
                                        - p.padding.1 as isize;
                                    if iy < 0 || ix < 0 || iy >= p.h as isize || ix >= p.w as isize
                                    {
                                        continue;
                                    }
                                    let xi = ((n * p.c_in + g * cin_g + ci) * p.h + iy as usize)
                                        * p.w
                                        + ix as usize;
                                    acc += x[xi] * w[((co * cin_g + ci) * kh + ky) * kw + kx];
                                }
                            }
                        }
                        y[((n * p.c_out + co) * oh + oy) * ow + ox] = acc;
                    }
                }
            }
        }
        y
    }

    /// Small convolutions whose output is not empty: any groups, stride, padding, dilation.
    fn params() -> impl Strategy<Value = Conv2dParams> {
        (
            (1..=2usize, 1..=3usize, 1..=3usize, 1..=3usize),
            (1..=7usize, 1..=7usize, 1..=3usize, 1..=3usize),
            (1..=2usize, 1..=2usize, 0..=1usize, 0..=1usize, 1..=2usize, 1..=2usize),
        )
            .prop_map(|((n, groups, cin_g, cout_g), (h, w, kh, kw), (sh, sw, ph, pw, dh, dw))| {
                Conv2dParams::new(n, groups * cin_g, (h, w), groups * cout_g, (kh, kw))
                    .stride((sh, sw))
                    .padding((ph, pw))
                    .dilation((dh, dw))
                    .groups(groups)
            })
            .prop_filter("empty output", |p| p.output_len() > 0)
    }

    /// Depthwise convolutions, the shapes that take the direct loop.
    fn depthwise_params() -> impl Strategy<Value = Conv2dParams> {
        (1..=4usize, params()).prop_map(|(c, p)| Conv2dParams { c_in: c, c_out: c, groups: c, ..p })
    }

    fn values(len: usize) -> impl Strategy<Value = Vec<f32>> {
        prop::collection::vec(-2.0f32..2.0, len)
    }

    fn case(
        params: impl Strategy<Value = Conv2dParams>,
    ) -> impl Strategy<Value = (Conv2dParams, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>)> {
        params.prop_flat_map(|p| {
            (
                Just(p),
                values(p.input_len()),
                values(p.weight_len()),
                values(p.c_out),
                values(p.output_len()),
            )
        })
    }

    fn check_forward<T: Element>(p: &Conv2dParams, x: &[f32], w: &[f32], b: &[f32], tol: f64) {
        let (x, w, b) = (cast::<T>(x), cast::<T>(w), cast::<T>(b));
        let want = reference(p, &to_f64(&x), &to_f64(&w), &to_f64(&b));
        let mut y = vec![T::default(); p.output_len()];
        conv2d(p, &x, &w, Some(&b), &mut y);
        assert_close(&to_f64(&y), &want, tol, "y");
    }

    /// Gradients by central differences of L = sum(conv2d(x, w) * r), checked on at most
    /// 24 coordinates of each input (every coordinate would make the test slow).
    fn check_backward(p: &Conv2dParams, x: &[f32], w: &[f32], r: &[f32], grads: [&[f32]; 3]) {
        let loss = |x: &[f32], w: &[f32], b: &[f32]| {
            let mut y = vec![0.0f32; p.output_len()];
            conv2d(p, x, w, Some(b), &mut y);
            y.iter().zip(r).map(|(&y, &r)| y as f64 * r as f64).sum::<f64>()
        };
        let b = vec![0.5f32; p.c_out];
        let fd = |v: &[f32], which: usize, grad: &[f32]| {
            let h = 1e-2f32;
            let step = (v.len() / 24).max(1);
            for i in (0..v.len()).step_by(step) {
                let mut v = v.to_vec();
                let at = |v: &[f32]| match which {
                    0 => loss(v, w, &b),
                    1 => loss(x, v, &b),
                    _ => loss(x, w, v),
                };
                let x0 = v[i];
                v[i] = x0 + h;
                let up = at(&v);
                v[i] = x0 - h;
                let want = (up - at(&v)) / (2.0 * h as f64);
                assert_close(&[grad[i] as f64], &[want], 1e-2, ["dx", "dw", "db"][which]);
            }
        };
        fd(x, 0, grads[0]);
        fd(w, 1, grads[1]);
        fd(&b, 2, grads[2]);
    }

    fn backward_grads(p: &Conv2dParams, x: &[f32], w: &[f32], r: &[f32]) -> [Vec<f32>; 3] {
        let mut dx = vec![f32::NAN; x.len()];
        let mut dw = vec![f32::NAN; w.len()];
        let mut db = vec![f32::NAN; p.c_out];
        conv2d_backward(p, x, w, r, Some(&mut dx), Some(&mut dw), Some(&mut db));
        [dx, dw, db]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        // Property: for any groups, stride, padding and dilation, conv2d equals the f64
        // definition within 1e-5 (f32) or 1e-2 (f16, bf16 on the rounded inputs).
        #[test]
        fn conv2d_matches_f64_reference_in_every_dtype((p, x, w, b, _r) in case(params())) {
            check_forward::<f32>(&p, &x, &w, &b, 1e-5);
            check_forward::<f16>(&p, &x, &w, &b, 1e-2);
            check_forward::<bf16>(&p, &x, &w, &b, 1e-2);
        }

        // Property: the direct depthwise loop equals the f64 definition too.
        #[test]
        fn depthwise_conv2d_matches_f64_reference((p, x, w, b, _r) in case(depthwise_params())) {
            check_forward::<f32>(&p, &x, &w, &b, 1e-5);
            check_forward::<bf16>(&p, &x, &w, &b, 1e-2);
        }

        // Property: dx, dw, db equal central finite differences of sum(y * r).
        #[test]
        fn conv2d_backward_matches_finite_differences((p, x, w, _b, r) in case(params())) {
            let [dx, dw, db] = backward_grads(&p, &x, &w, &r);
            check_backward(&p, &x, &w, &r, [&dx, &dw, &db]);
        }

        // Property: the depthwise direct loops give the same forward and gradients as the
        // im2col path (which the tests above check against the definition).
        #[test]
        fn depthwise_direct_loop_agrees_with_im2col_path((p, x, w, _b, r) in case(depthwise_params())) {
            let mut direct = vec![0.0f32; p.output_len()];
            let mut general = vec![0.0f32; p.output_len()];
            depthwise_forward(&p, &x, &w, &mut direct);
            im2col_forward(&p, &x, &w, &mut general);
            assert_close(&to_f64(&direct), &to_f64(&general), 1e-5, "y");
            let (mut dx1, mut dx2) = (vec![0.0f32; x.len()], vec![0.0f32; x.len()]);
            depthwise_backward_input(&p, &w, &r, &mut dx1);
            im2col_backward_input(&p, &w, &r, &mut dx2);
            assert_close(&to_f64(&dx1), &to_f64(&dx2), 1e-5, "dx");
            let (mut dw1, mut dw2) = (vec![0.0f32; w.len()], vec![0.0f32; w.len()]);
            depthwise_backward_weight(&p, &x, &r, &mut dw1);
            im2col_backward_weight(&p, &x, &r, &mut dw2);
            assert_close(&to_f64(&dw1), &to_f64(&dw2), 1e-5, "dw");
        }

        // Property: depthwise gradients equal central finite differences of sum(y * r).
        #[test]
        fn depthwise_backward_matches_finite_differences((p, x, w, _b, r) in case(depthwise_params())) {
            let [dx, dw, db] = backward_grads(&p, &x, &w, &r);
            check_backward(&p, &x, &w, &r, [&dx, &dw, &db]);
        }
    }

    #[test]
    fn output_hw_follows_the_pytorch_formula() {
        let p = Conv2dParams::new(1, 3, (32, 30), 8, (3, 5))
            .stride((2, 1))
            .padding((1, 2))
            .dilation((1, 2));
        // h: (32 + 2 - 2 - 1) / 2 + 1 = 16; w: (30 + 4 - 8 - 1) / 1 + 1 = 26.
        assert_eq!(p.output_hw(), (16, 26));
        assert_eq!(Conv2dParams::new(1, 1, (2, 2), 1, (3, 3)).output_hw(), (0, 0));
    }
}
