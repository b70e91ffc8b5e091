//! 2-D convolution on the host, NCHW: im2col + gemm per group, and a direct loop for
//! depthwise convolutions (one input channel per output channel), where im2col would
//! turn every group into a matrix-vector product not worth its copy.
//!
//! Layouts: `x: [batch, c_in, h, w]`, `weight: [c_out, c_in / groups, kh, kw]`,
//! `bias: [c_out]`, `y: [batch, c_out, oh, ow]` with `(oh, ow) = params.output_hw()`.

use super::{check_len, widen_f32, with_f32_out};
use crate::dtype::Element;
use crate::error::Result;
use crate::params::{Conv2dParams, MatmulSpec};
use rayon::prelude::*;
use std::ops::Range;

/// Checks the lengths of `x`, `weight` and `y` (or `dy`) against `p`.
fn check(op: &'static str, p: &Conv2dParams, x: usize, w: usize, y: usize) -> Result<()> {
    check_len(op, "x", x, p.input_len())?;
    check_len(op, "weight", w, p.weight_len())?;
    check_len(op, "y", y, p.output_len())
}

/// Computes `y = conv2d(x, weight) + bias` (layouts in the module doc). An empty input
/// (no input channels, or an empty plane under padding) convolves to zeros plus the bias.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if a length does not fit `p`.
pub fn conv2d<T: Element>(
    p: &Conv2dParams,
    x: &[T],
    weight: &[T],
    bias: Option<&[T]>,
    y: &mut [T],
) -> Result<()> {
    const OP: &str = "cpu::conv2d";
    check(OP, p, x.len(), weight.len(), y.len())?;
    if let Some(bias) = bias {
        check_len(OP, "bias", bias.len(), p.c_out())?;
    }
    if y.is_empty() {
        return Ok(());
    }
    let (x, weight) = (widen_f32(x), widen_f32(weight));
    let bias = bias.map(widen_f32);
    with_f32_out(y, |y| {
        if x.is_empty() {
            y.fill(0.0);
        } else if p.is_depthwise() {
            depthwise_forward(p, &x, &weight, y);
        } else {
            im2col_forward(p, &x, &weight, y);
        }
        if let Some(bias) = bias {
            let (oh, ow) = p.output_hw();
            for (plane, b) in y.chunks_exact_mut(oh * ow).zip(bias.iter().cycle()) {
                plane.iter_mut().for_each(|v| *v += b);
            }
        }
    });
    Ok(())
}

/// Gradients of [`conv2d`] for `dy` (`y`'s layout), overwriting the outputs asked for:
/// `dx` (`x`'s layout), `dweight` (`weight`'s), `dbias` (`[c_out]`).
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if a length does not fit `p`.
#[allow(clippy::too_many_arguments)]
pub fn conv2d_backward<T: Element>(
    p: &Conv2dParams,
    x: &[T],
    weight: &[T],
    dy: &[T],
    dx: Option<&mut [T]>,
    dweight: Option<&mut [T]>,
    dbias: Option<&mut [T]>,
) -> Result<()> {
    const OP: &str = "cpu::conv2d_backward";
    check(OP, p, x.len(), weight.len(), dy.len())?;
    if let Some(dx) = &dx {
        check_len(OP, "dx", dx.len(), x.len())?;
    }
    if let Some(dweight) = &dweight {
        check_len(OP, "dweight", dweight.len(), weight.len())?;
    }
    if let Some(dbias) = &dbias {
        check_len(OP, "dbias", dbias.len(), p.c_out())?;
    }
    // With no output element, or no input element, nothing flows back.
    let nothing = dy.is_empty() || x.is_empty();
    let dy = widen_f32(dy);
    if let Some(dx) = dx {
        let weight = widen_f32(weight);
        with_f32_out(dx, |dx| {
            if nothing {
                dx.fill(0.0);
            } else if p.is_depthwise() {
                depthwise_backward_input(p, &weight, &dy, dx);
            } else {
                im2col_backward_input(p, &weight, &dy, dx);
            }
        });
    }
    if let Some(dweight) = dweight {
        let x = widen_f32(x);
        with_f32_out(dweight, |dw| {
            if nothing {
                dw.fill(0.0);
            } else if p.is_depthwise() {
                depthwise_backward_weight(p, &x, &dy, dw);
            } else {
                im2col_backward_weight(p, &x, &dy, dw);
            }
        });
    }
    if let Some(dbias) = dbias {
        let (oh, ow) = p.output_hw();
        let mut sum = vec![0.0f32; p.c_out()];
        if oh * ow > 0 {
            for (plane, s) in dy.chunks_exact(oh * ow).zip((0..p.c_out()).cycle()) {
                sum[s] += plane.iter().sum::<f32>();
            }
        }
        for (d, s) in dbias.iter_mut().zip(sum) {
            *d = T::from_f32(s);
        }
    }
    Ok(())
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
    let (kh, kw) = p.kernel();
    for c in 0..channels {
        for ky in 0..kh {
            for kx in 0..kw {
                let row = (c * kh + ky) * kw + kx;
                let oy = (ky * p.dilation().0) as isize - p.padding().0 as isize;
                let ox = (kx * p.dilation().1) as isize - p.padding().1 as isize;
                f(row, c, oy, ox);
            }
        }
    }
}

/// Fills `col: [cin_g * kh * kw, oh * ow]` from one group of one image, `x: [cin_g, h, w]`.
fn im2col(p: &Conv2dParams, x: &[f32], col: &mut [f32]) {
    let (oh, ow) = p.output_hw();
    let (h, w) = (p.h(), p.w());
    for_each_tap(p, p.c_in() / p.groups(), |row, c, off_y, off_x| {
        let col = &mut col[row * oh * ow..(row + 1) * oh * ow];
        col.fill(0.0);
        let xs = valid_range(ow, w, p.stride().1, off_x);
        for oy in valid_range(oh, h, p.stride().0, off_y) {
            let iy = (oy * p.stride().0) as isize + off_y;
            let src = &x[(c * h + iy as usize) * w..][..w];
            let dst = &mut col[oy * ow..(oy + 1) * ow];
            for ox in xs.clone() {
                dst[ox] = src[((ox * p.stride().1) as isize + off_x) as usize];
            }
        }
    });
}

/// Adds `col: [cin_g * kh * kw, oh * ow]` back into one group of one image (inverse
/// scatter of [`im2col`]).
fn col2im(p: &Conv2dParams, col: &[f32], x: &mut [f32]) {
    let (oh, ow) = p.output_hw();
    let (h, w) = (p.h(), p.w());
    for_each_tap(p, p.c_in() / p.groups(), |row, c, off_y, off_x| {
        let col = &col[row * oh * ow..(row + 1) * oh * ow];
        let xs = valid_range(ow, w, p.stride().1, off_x);
        for oy in valid_range(oh, h, p.stride().0, off_y) {
            let iy = (oy * p.stride().0) as isize + off_y;
            let dst = &mut x[(c * h + iy as usize) * w..][..w];
            let src = &col[oy * ow..(oy + 1) * ow];
            for ox in xs.clone() {
                dst[((ox * p.stride().1) as isize + off_x) as usize] += src[ox];
            }
        }
    });
}

fn im2col_forward(p: &Conv2dParams, x: &[f32], weight: &[f32], y: &mut [f32]) {
    let (oh, ow) = p.output_hw();
    let (ohw, k) = (oh * ow, p.col_rows());
    let (cin_g, cout_g) = (p.c_in() / p.groups(), p.c_out() / p.groups());
    if ohw == 0 || p.batch() == 0 {
        return;
    }
    let spec = MatmulSpec::new(cout_g, ohw, k);
    y.par_chunks_mut(p.c_out() * ohw).zip(x.par_chunks(p.c_in() * p.h() * p.w())).for_each_init(
        || vec![0.0f32; if p.is_pointwise() { 0 } else { k * ohw }],
        |col, (y, x)| {
            for g in 0..p.groups() {
                let x = &x[g * cin_g * p.h() * p.w()..][..cin_g * p.h() * p.w()];
                let cols: &[f32] = if p.is_pointwise() {
                    x
                } else {
                    im2col(p, x, col);
                    col
                };
                let y = &mut y[g * cout_g * ohw..][..cout_g * ohw];
                super::matmul::matmul_f32(&spec, &weight[g * cout_g * k..][..cout_g * k], cols, y);
            }
        },
    );
}

fn im2col_backward_input(p: &Conv2dParams, weight: &[f32], dy: &[f32], dx: &mut [f32]) {
    let (oh, ow) = p.output_hw();
    let (ohw, k) = (oh * ow, p.col_rows());
    let (cin_g, cout_g) = (p.c_in() / p.groups(), p.c_out() / p.groups());
    let plane_in = cin_g * p.h() * p.w();
    // dcol = W_g^T * dy_g: [k, cout_g] x [cout_g, ohw].
    let spec = MatmulSpec::new(k, ohw, cout_g).transpose(true, false);
    if ohw == 0 {
        dx.fill(0.0);
        return;
    }
    dx.par_chunks_mut(p.c_in() * p.h() * p.w())
        .zip(dy.par_chunks((p.c_out() * ohw).max(1)))
        .for_each_init(
            || vec![0.0f32; if p.is_pointwise() { 0 } else { k * ohw }],
            |dcol, (dx, dy)| {
                for g in 0..p.groups() {
                    let w = &weight[g * cout_g * k..][..cout_g * k];
                    let dy = &dy[g * cout_g * ohw..][..cout_g * ohw];
                    let dx = &mut dx[g * plane_in..][..plane_in];
                    if p.is_pointwise() {
                        super::matmul::matmul_f32(&spec, w, dy, dx);
                    } else {
                        super::matmul::matmul_f32(&spec, w, dy, dcol);
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
    let (cin_g, cout_g) = (p.c_in() / p.groups(), p.c_out() / p.groups());
    let plane_in = cin_g * p.h() * p.w();
    // dW_g += dy_g * col^T: [cout_g, ohw] x [ohw, k], summed over the images.
    let spec = MatmulSpec::new(cout_g, k, ohw).transpose(false, true).scaled(1.0, 1.0);
    let len = dw.len();
    let sum = (0..p.batch())
        .into_par_iter()
        .fold(
            || (vec![0.0f32; len], vec![0.0f32; if p.is_pointwise() { 0 } else { k * ohw }]),
            |(mut acc, mut col), n| {
                let x = &x[n * p.c_in() * p.h() * p.w()..];
                let dy = &dy[n * p.c_out() * ohw..];
                for g in 0..p.groups() {
                    let x = &x[g * plane_in..][..plane_in];
                    let cols: &[f32] = if p.is_pointwise() {
                        x
                    } else {
                        im2col(p, x, &mut col);
                        &col
                    };
                    let dy = &dy[g * cout_g * ohw..][..cout_g * ohw];
                    super::matmul::matmul_f32(
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
    let (kh, kw) = p.kernel();
    if oh * ow == 0 {
        return;
    }
    y.par_chunks_mut(oh * ow).zip(x.par_chunks(p.h() * p.w())).enumerate().for_each(
        |(plane, (y, x))| {
            let w = &weight[(plane % p.c_in()) * kh * kw..][..kh * kw];
            y.fill(0.0);
            for_each_tap(p, 1, |row, _, off_y, off_x| {
                let wv = w[row];
                let xs = valid_range(ow, p.w(), p.stride().1, off_x);
                for oy in valid_range(oh, p.h(), p.stride().0, off_y) {
                    let src =
                        &x[((oy * p.stride().0) as isize + off_y) as usize * p.w()..][..p.w()];
                    let dst = &mut y[oy * ow..(oy + 1) * ow];
                    for ox in xs.clone() {
                        dst[ox] += wv * src[((ox * p.stride().1) as isize + off_x) as usize];
                    }
                }
            });
        },
    );
}

fn depthwise_backward_input(p: &Conv2dParams, weight: &[f32], dy: &[f32], dx: &mut [f32]) {
    let (oh, ow) = p.output_hw();
    let (kh, kw) = p.kernel();
    if oh * ow == 0 {
        dx.fill(0.0);
        return;
    }
    dx.par_chunks_mut((p.h() * p.w()).max(1))
        .zip(dy.par_chunks((oh * ow).max(1)))
        .enumerate()
        .for_each(|(plane, (dx, dy))| {
            let w = &weight[(plane % p.c_in()) * kh * kw..][..kh * kw];
            dx.fill(0.0);
            for_each_tap(p, 1, |row, _, off_y, off_x| {
                let wv = w[row];
                let xs = valid_range(ow, p.w(), p.stride().1, off_x);
                for oy in valid_range(oh, p.h(), p.stride().0, off_y) {
                    let dst =
                        &mut dx[((oy * p.stride().0) as isize + off_y) as usize * p.w()..][..p.w()];
                    let src = &dy[oy * ow..(oy + 1) * ow];
                    for ox in xs.clone() {
                        dst[((ox * p.stride().1) as isize + off_x) as usize] += wv * src[ox];
                    }
                }
            });
        });
}

fn depthwise_backward_weight(p: &Conv2dParams, x: &[f32], dy: &[f32], dw: &mut [f32]) {
    let (oh, ow) = p.output_hw();
    let (kh, kw) = p.kernel();
    dw.par_chunks_mut(kh * kw).enumerate().for_each(|(c, dw)| {
        dw.fill(0.0);
        for n in 0..p.batch() {
            let plane = n * p.c_in() + c;
            let x = &x[plane * p.h() * p.w()..][..p.h() * p.w()];
            let dy = &dy[plane * oh * ow..][..oh * ow];
            for_each_tap(p, 1, |row, _, off_y, off_x| {
                let xs = valid_range(ow, p.w(), p.stride().1, off_x);
                let mut acc = 0.0f32;
                for oy in valid_range(oh, p.h(), p.stride().0, off_y) {
                    let src =
                        &x[((oy * p.stride().0) as isize + off_y) as usize * p.w()..][..p.w()];
                    let g = &dy[oy * ow..(oy + 1) * ow];
                    for ox in xs.clone() {
                        acc += g[ox] * src[((ox * p.stride().1) as isize + off_x) as usize];
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
    use crate::cpu::elementwise::testing::{assert_close, round as cast};
    use crate::cpu::widen_f64;
    use crate::params::Conv2dOptions;
    use half::{bf16, f16};
    use proptest::prelude::*;

    /// f64 convolution straight from the definition.
    fn reference(p: &Conv2dParams, x: &[f64], w: &[f64], bias: &[f64]) -> Vec<f64> {
        let (oh, ow) = p.output_hw();
        let (kh, kw) = p.kernel();
        let (cin_g, cout_g) = (p.c_in() / p.groups(), p.c_out() / p.groups());
        let mut y = vec![0.0; p.output_len()];
        for n in 0..p.batch() {
            for co in 0..p.c_out() {
                let g = co / cout_g;
                for oy in 0..oh {
                    for ox in 0..ow {
                        let mut acc = bias[co];
                        for ci in 0..cin_g {
                            for ky in 0..kh {
                                for kx in 0..kw {
                                    let iy = (oy * p.stride().0 + ky * p.dilation().0) as isize
                                        - p.padding().0 as isize;
                                    let ix = (ox * p.stride().1 + kx * p.dilation().1) as isize
                                        - p.padding().1 as isize;
                                    if iy < 0
                                        || ix < 0
                                        || iy >= p.h() as isize
                                        || ix >= p.w() as isize
                                    {
                                        continue;
                                    }
                                    let xi = ((n * p.c_in() + g * cin_g + ci) * p.h()
                                        + iy as usize)
                                        * p.w()
                                        + ix as usize;
                                    acc += x[xi] * w[((co * cin_g + ci) * kh + ky) * kw + kx];
                                }
                            }
                        }
                        y[((n * p.c_out() + co) * oh + oy) * ow + ox] = acc;
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
                let opts = Conv2dOptions::default()
                    .stride((sh, sw))
                    .padding((ph, pw))
                    .dilation((dh, dw))
                    .groups(groups);
                let x = [n, groups * cin_g, h, w];
                Conv2dParams::new(&x, &[groups * cout_g, cin_g, kh, kw], &opts).unwrap()
            })
            .prop_filter("empty output", |p| p.output_len() > 0)
    }

    /// Depthwise convolutions, the shapes that take the direct loop.
    fn depthwise_params() -> impl Strategy<Value = Conv2dParams> {
        (1..=4usize, params()).prop_map(|(c, p)| {
            let x = [p.batch(), c, p.h(), p.w()];
            let (kh, kw) = p.kernel();
            Conv2dParams::new(&x, &[c, 1, kh, kw], &p.options().groups(c)).unwrap()
        })
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
                values(p.c_out()),
                values(p.output_len()),
            )
        })
    }

    fn check_forward<T: Element>(p: &Conv2dParams, x: &[f32], w: &[f32], b: &[f32], tol: f64) {
        let (x, w, b) = (cast::<T>(x), cast::<T>(w), cast::<T>(b));
        let want = reference(p, &widen_f64(&x), &widen_f64(&w), &widen_f64(&b));
        let mut y = vec![T::default(); p.output_len()];
        conv2d(p, &x, &w, Some(&b), &mut y).unwrap();
        assert_close(&widen_f64(&y), &want, tol, "y");
    }

    /// Gradients by central differences of L = sum(conv2d(x, w) * r), checked on at most
    /// 24 coordinates of each input (every coordinate would make the test slow).
    fn check_backward(p: &Conv2dParams, x: &[f32], w: &[f32], r: &[f32], grads: [&[f32]; 3]) {
        let loss = |x: &[f32], w: &[f32], b: &[f32]| {
            let mut y = vec![0.0f32; p.output_len()];
            conv2d(p, x, w, Some(b), &mut y).unwrap();
            y.iter().zip(r).map(|(&y, &r)| y as f64 * r as f64).sum::<f64>()
        };
        let b = vec![0.5f32; p.c_out()];
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
        let mut db = vec![f32::NAN; p.c_out()];
        conv2d_backward(p, x, w, r, Some(&mut dx), Some(&mut dw), Some(&mut db)).unwrap();
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
            assert_close(&widen_f64(&direct), &widen_f64(&general), 1e-5, "y");
            let (mut dx1, mut dx2) = (vec![0.0f32; x.len()], vec![0.0f32; x.len()]);
            depthwise_backward_input(&p, &w, &r, &mut dx1);
            im2col_backward_input(&p, &w, &r, &mut dx2);
            assert_close(&widen_f64(&dx1), &widen_f64(&dx2), 1e-5, "dx");
            let (mut dw1, mut dw2) = (vec![0.0f32; w.len()], vec![0.0f32; w.len()]);
            depthwise_backward_weight(&p, &x, &r, &mut dw1);
            im2col_backward_weight(&p, &x, &r, &mut dw2);
            assert_close(&widen_f64(&dw1), &widen_f64(&dw2), 1e-5, "dw");
        }

        // Property: depthwise gradients equal central finite differences of sum(y * r).
        #[test]
        fn depthwise_backward_matches_finite_differences((p, x, w, _b, r) in case(depthwise_params())) {
            let [dx, dw, db] = backward_grads(&p, &x, &w, &r);
            check_backward(&p, &x, &w, &r, [&dx, &dw, &db]);
        }
    }

    #[test]
    fn empty_inputs_convolve_to_the_bias_and_get_zero_gradients() {
        // No input channels, and an empty plane under padding: both used to panic.
        for (x, w, o) in [
            ([2, 0, 4, 4], [3, 0, 3, 3], Conv2dOptions::default().padding((1, 1))),
            ([2, 2, 0, 3], [3, 2, 1, 1], Conv2dOptions::default().padding((1, 1))),
            ([1, 2, 0, 0], [2, 1, 3, 3], Conv2dOptions::default().padding((2, 2)).groups(2)),
        ] {
            let p = Conv2dParams::new(&x, &w, &o).unwrap();
            assert!(p.output_len() > 0, "{x:?}");
            let bias: Vec<f32> = (0..p.c_out()).map(|c| c as f32).collect();
            let weight = vec![1.0f32; p.weight_len()];
            let mut y = vec![f32::NAN; p.output_len()];
            conv2d(&p, &[], &weight, Some(&bias), &mut y).unwrap();
            let plane = p.output_len() / (p.batch() * p.c_out());
            for (i, v) in y.iter().enumerate() {
                assert_eq!(*v, ((i / plane) % p.c_out()) as f32, "{x:?}");
            }
            let dy = vec![1.0f32; p.output_len()];
            let (mut dw, mut db) = (vec![f32::NAN; p.weight_len()], vec![0.0f32; p.c_out()]);
            conv2d_backward(&p, &[], &weight, &dy, Some(&mut []), Some(&mut dw), Some(&mut db))
                .unwrap();
            assert!(dw.iter().all(|&v| v == 0.0), "{x:?}");
            assert!(db.iter().all(|&v| v == (p.batch() * plane) as f32), "{x:?}");
        }
    }

    #[test]
    fn lengths_that_do_not_fit_the_params_are_errors_not_panics() {
        let p = Conv2dParams::new(&[1, 2, 4, 4], &[3, 2, 3, 3], &Conv2dOptions::default()).unwrap();
        let (x, w) = (vec![0.0f32; p.input_len()], vec![0.0f32; p.weight_len()]);
        let mut y = vec![0.0f32; p.output_len()];
        assert!(conv2d(&p, &x[1..], &w, None, &mut y).is_err());
        assert!(conv2d(&p, &x, &w[1..], None, &mut y).is_err());
        assert!(conv2d(&p, &x, &w, Some(&[0.0]), &mut y).is_err());
        assert!(conv2d(&p, &x, &w, None, &mut y[1..]).is_err());
        let mut dx = vec![0.0f32; 3];
        assert!(conv2d_backward(&p, &x, &w, &y, Some(&mut dx), None, None).is_err());
    }
}
