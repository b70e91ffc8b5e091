//! 2-D pooling on the host, NCHW: max pool (with argmax for backward), average pool, and
//! the global average pool that ends most CNNs.
//!
//! Layouts: `x: [batch, channels, h, w]`, `y: [batch, channels, oh, ow]` with
//! `(oh, ow) = params.output_hw()`. Every backward overwrites its `dx`.

use super::matmul::{widen, with_f32_out};
use crate::dtype::Element;
use rayon::prelude::*;
use std::ops::Range;

/// The geometry of a 2-D pooling window (see the module doc for the layouts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pool2dParams {
    /// Images in the batch.
    pub batch: usize,
    /// Channels (pooled independently).
    pub channels: usize,
    /// Input height.
    pub h: usize,
    /// Input width.
    pub w: usize,
    /// Window (height, width).
    pub kernel: (usize, usize),
    /// Step between windows, (vertical, horizontal).
    pub stride: (usize, usize),
    /// Implicit padding on each side; at most half the window, so every window holds at
    /// least one real element.
    pub padding: (usize, usize),
}

impl Pool2dParams {
    /// A window of `kernel` moved by `stride`, without padding.
    pub fn new(
        batch: usize,
        channels: usize,
        (h, w): (usize, usize),
        kernel: (usize, usize),
        stride: (usize, usize),
    ) -> Self {
        Self { batch, channels, h, w, kernel, stride, padding: (0, 0) }
    }

    /// Sets the padding.
    pub fn padding(mut self, padding: (usize, usize)) -> Self {
        self.padding = padding;
        self
    }

    /// Output (height, width): `(in + 2 * pad - k) / stride + 1`, or 0 when the window does
    /// not fit in the padded input.
    pub fn output_hw(&self) -> (usize, usize) {
        let out = |len: usize, k: usize, s: usize, p: usize| {
            (len + 2 * p).checked_sub(k).map_or(0, |r| r / s + 1)
        };
        (
            out(self.h, self.kernel.0, self.stride.0, self.padding.0),
            out(self.w, self.kernel.1, self.stride.1, self.padding.1),
        )
    }

    /// Elements of `x`.
    pub fn input_len(&self) -> usize {
        self.batch * self.channels * self.h * self.w
    }

    /// Elements of `y`.
    pub fn output_len(&self) -> usize {
        let (oh, ow) = self.output_hw();
        self.batch * self.channels * oh * ow
    }

    /// The input rows and columns under window `(oy, ox)`, padding excluded.
    fn window(&self, oy: usize, ox: usize) -> (Range<usize>, Range<usize>) {
        let span = |o: usize, s: usize, p: usize, k: usize, len: usize| {
            let start = (o * s) as isize - p as isize;
            start.max(0) as usize..((start + k as isize).max(0) as usize).min(len)
        };
        (
            span(oy, self.stride.0, self.padding.0, self.kernel.0, self.h),
            span(ox, self.stride.1, self.padding.1, self.kernel.1, self.w),
        )
    }

    fn debug_check(&self, x: usize, y: usize) {
        debug_assert!(self.stride.0 > 0 && self.stride.1 > 0);
        debug_assert!(2 * self.padding.0 <= self.kernel.0 && 2 * self.padding.1 <= self.kernel.1);
        debug_assert_eq!(x, self.input_len(), "pool: x length");
        debug_assert_eq!(y, self.output_len(), "pool: y length");
    }
}

/// Max pool: `y` gets each window's maximum and `argmax` (same layout as `y`) its position
/// inside the input plane, `iy * w + ix`. NaN wins over every number, so it propagates.
pub fn max_pool2d<T: Element>(p: &Pool2dParams, x: &[T], y: &mut [T], argmax: &mut [u32]) {
    p.debug_check(x.len(), y.len());
    debug_assert_eq!(argmax.len(), y.len());
    let (oh, ow) = p.output_hw();
    if oh * ow == 0 {
        return;
    }
    let x = widen(x);
    with_f32_out(y, |y| {
        y.par_chunks_mut(oh * ow)
            .zip(argmax.par_chunks_mut(oh * ow))
            .zip(x.par_chunks(p.h * p.w))
            .for_each(|((y, arg), x)| {
                for oy in 0..oh {
                    for ox in 0..ow {
                        let (rows, cols) = p.window(oy, ox);
                        let (mut best, mut at) = (f32::NEG_INFINITY, rows.start * p.w + cols.start);
                        for iy in rows {
                            for ix in cols.clone() {
                                let v = x[iy * p.w + ix];
                                if v > best || (v.is_nan() && !best.is_nan()) {
                                    (best, at) = (v, iy * p.w + ix);
                                }
                            }
                        }
                        y[oy * ow + ox] = best;
                        arg[oy * ow + ox] = at as u32;
                    }
                }
            });
    });
}

/// Gradient of [`max_pool2d`]: each `dy` element goes to the input position its window
/// took the maximum from (`argmax` as returned by the forward).
pub fn max_pool2d_backward<T: Element>(p: &Pool2dParams, dy: &[T], argmax: &[u32], dx: &mut [T]) {
    p.debug_check(dx.len(), dy.len());
    debug_assert_eq!(argmax.len(), dy.len());
    let (oh, ow) = p.output_hw();
    let dy = widen(dy);
    with_f32_out(dx, |dx| {
        dx.fill(0.0);
        if oh * ow == 0 {
            return;
        }
        dx.par_chunks_mut(p.h * p.w)
            .zip(dy.par_chunks(oh * ow))
            .zip(argmax.par_chunks(oh * ow))
            .for_each(|((dx, dy), arg)| {
                for (&g, &i) in dy.iter().zip(arg) {
                    dx[i as usize] += g;
                }
            });
    });
}

/// The divisor of window `(oy, ox)`: the full window when padding counts, else the number
/// of real elements under it.
fn divisor(p: &Pool2dParams, oy: usize, ox: usize, count_include_pad: bool) -> f32 {
    if count_include_pad {
        (p.kernel.0 * p.kernel.1) as f32
    } else {
        let (rows, cols) = p.window(oy, ox);
        (rows.len() * cols.len()) as f32
    }
}

/// Average pool: `y` gets each window's mean. Padding counts as zeros in the divisor when
/// `count_include_pad` (PyTorch's default), otherwise only real elements are averaged.
pub fn avg_pool2d<T: Element>(p: &Pool2dParams, x: &[T], y: &mut [T], count_include_pad: bool) {
    p.debug_check(x.len(), y.len());
    let (oh, ow) = p.output_hw();
    if oh * ow == 0 {
        return;
    }
    let x = widen(x);
    with_f32_out(y, |y| {
        y.par_chunks_mut(oh * ow).zip(x.par_chunks(p.h * p.w)).for_each(|(y, x)| {
            for oy in 0..oh {
                for ox in 0..ow {
                    let (rows, cols) = p.window(oy, ox);
                    let sum: f32 =
                        rows.map(|iy| x[iy * p.w..][cols.clone()].iter().sum::<f32>()).sum();
                    y[oy * ow + ox] = sum / divisor(p, oy, ox, count_include_pad);
                }
            }
        });
    });
}

/// Gradient of [`avg_pool2d`] (same `count_include_pad`): each `dy` element is spread
/// evenly over its window.
pub fn avg_pool2d_backward<T: Element>(
    p: &Pool2dParams,
    dy: &[T],
    dx: &mut [T],
    count_include_pad: bool,
) {
    p.debug_check(dx.len(), dy.len());
    let (oh, ow) = p.output_hw();
    let dy = widen(dy);
    with_f32_out(dx, |dx| {
        dx.fill(0.0);
        if oh * ow == 0 {
            return;
        }
        dx.par_chunks_mut(p.h * p.w).zip(dy.par_chunks(oh * ow)).for_each(|(dx, dy)| {
            for oy in 0..oh {
                for ox in 0..ow {
                    let (rows, cols) = p.window(oy, ox);
                    let g = dy[oy * ow + ox] / divisor(p, oy, ox, count_include_pad);
                    for iy in rows {
                        dx[iy * p.w..][cols.clone()].iter_mut().for_each(|d| *d += g);
                    }
                }
            }
        });
    });
}

/// Global average pool: `x: [planes, hw]` (planes = batch * channels) to `y: [planes]`,
/// the mean of each plane.
pub fn global_avg_pool<T: Element>(x: &[T], y: &mut [T], hw: usize) {
    debug_assert_eq!(x.len(), y.len() * hw);
    if hw == 0 {
        return;
    }
    y.par_iter_mut().zip(x.par_chunks(hw)).for_each(|(y, x)| {
        *y = T::from_f32(x.iter().map(|v| v.to_f32()).sum::<f32>() / hw as f32);
    });
}

/// Gradient of [`global_avg_pool`]: `dx[plane, i] = dy[plane] / hw`.
pub fn global_avg_pool_backward<T: Element>(dy: &[T], dx: &mut [T], hw: usize) {
    debug_assert_eq!(dx.len(), dy.len() * hw);
    if hw == 0 {
        return;
    }
    dx.par_chunks_mut(hw).zip(dy.par_iter()).for_each(|(dx, g)| {
        dx.fill(T::from_f32(g.to_f32() / hw as f32));
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::elementwise::testing::{
        assert_close, finite_diff_sum as finite_diff, round as cast, widen as to_f64,
    };
    use half::{bf16, f16};
    use proptest::prelude::*;

    /// f64 pooling from the definition, with the padded positions explicitly excluded
    /// (max) or counted as zeros (average).
    fn reference(p: &Pool2dParams, x: &[f64], max: bool, include_pad: bool) -> Vec<f64> {
        let (oh, ow) = p.output_hw();
        let mut y = Vec::with_capacity(p.output_len());
        for plane in 0..p.batch * p.channels {
            for oy in 0..oh {
                for ox in 0..ow {
                    let (mut best, mut sum, mut count) = (f64::NEG_INFINITY, 0.0, 0usize);
                    for ky in 0..p.kernel.0 {
                        for kx in 0..p.kernel.1 {
                            let iy = (oy * p.stride.0 + ky) as isize - p.padding.0 as isize;
                            let ix = (ox * p.stride.1 + kx) as isize - p.padding.1 as isize;
                            if iy < 0 || ix < 0 || iy >= p.h as isize || ix >= p.w as isize {
                                count += include_pad as usize;
                                continue;
                            }
                            let v = x[(plane * p.h + iy as usize) * p.w + ix as usize];
                            best = best.max(v);
                            sum += v;
                            count += 1;
                        }
                    }
                    y.push(if max { best } else { sum / count as f64 });
                }
            }
        }
        y
    }

    fn params() -> impl Strategy<Value = Pool2dParams> {
        (
            (1..=2usize, 1..=3usize, 1..=8usize, 1..=8usize),
            (1..=3usize, 1..=3usize, 1..=3usize, 1..=3usize),
            (0..=1usize, 0..=1usize),
        )
            .prop_map(|((n, c, h, w), (kh, kw, sh, sw), (ph, pw))| {
                Pool2dParams::new(n, c, (h, w), (kh, kw), (sh, sw))
                    .padding((ph.min(kh / 2), pw.min(kw / 2)))
            })
            .prop_filter("empty output", |p| p.output_len() > 0)
    }

    /// A shuffled ramp: distinct values 0.05 apart, so a step of 1e-2 never changes which
    /// element is a window's maximum.
    fn distinct_values(len: usize) -> impl Strategy<Value = Vec<f32>> {
        Just((0..len).map(|i| i as f32 * 0.05 - 1.0).collect::<Vec<_>>()).prop_shuffle()
    }

    fn case() -> impl Strategy<Value = (Pool2dParams, Vec<f32>, Vec<f32>)> {
        params().prop_flat_map(|p| {
            (
                Just(p),
                distinct_values(p.input_len()),
                prop::collection::vec(-2.0f32..2.0, p.output_len()),
            )
        })
    }

    fn check_forward<T: Element>(p: &Pool2dParams, x: &[f32], tol: f64) {
        let x = cast::<T>(x);
        let (mut y, mut arg) = (vec![T::default(); p.output_len()], vec![0u32; p.output_len()]);
        max_pool2d(p, &x, &mut y, &mut arg);
        assert_close(&to_f64(&y), &reference(p, &to_f64(&x), true, false), tol, "max");
        for (plane, (y, arg)) in y
            .chunks(y.len() / (p.batch * p.channels))
            .zip(arg.chunks(arg.len() / (p.batch * p.channels)))
            .enumerate()
        {
            for (v, &i) in y.iter().zip(arg) {
                assert_eq!(*v, x[plane * p.h * p.w + i as usize], "argmax points at the maximum");
            }
        }
        for include_pad in [false, true] {
            avg_pool2d(p, &x, &mut y, include_pad);
            assert_close(&to_f64(&y), &reference(p, &to_f64(&x), false, include_pad), tol, "avg");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        // Property: max and average pools equal the f64 definition (1e-5 in f32, 1e-2 in
        // f16/bf16 on the rounded inputs), and argmax points at the element returned.
        #[test]
        fn pools_match_f64_reference_in_every_dtype((p, x, _r) in case()) {
            check_forward::<f32>(&p, &x, 1e-5);
            check_forward::<f16>(&p, &x, 1e-2);
            check_forward::<bf16>(&p, &x, 1e-2);
        }

        // Property: max pool's gradient equals central finite differences of sum(y * r)
        // (inputs distinct, so the maximum is stable under the step).
        #[test]
        fn max_pool_backward_matches_finite_differences((p, x, r) in case()) {
            let mut arg = vec![0u32; p.output_len()];
            let fd = finite_diff(&x, &r, |x, y| max_pool2d(&p, x, y, &mut arg.clone()));
            let mut y = vec![0.0f32; p.output_len()];
            max_pool2d(&p, &x, &mut y, &mut arg);
            let mut dx = vec![f32::NAN; x.len()];
            max_pool2d_backward(&p, &r, &arg, &mut dx);
            assert_close(&to_f64(&dx), &fd, 1e-2, "dx");
        }

        // Property: average pool's gradient equals central finite differences of
        // sum(y * r), with and without padding in the divisor.
        #[test]
        fn avg_pool_backward_matches_finite_differences((p, x, r) in case(), include_pad in any::<bool>()) {
            let fd = finite_diff(&x, &r, |x, y| avg_pool2d(&p, x, y, include_pad));
            let mut dx = vec![f32::NAN; x.len()];
            avg_pool2d_backward(&p, &r, &mut dx, include_pad);
            assert_close(&to_f64(&dx), &fd, 1e-2, "dx");
        }

        // Property: the global average pool is each plane's mean, and its gradient equals
        // central finite differences of sum(y * r).
        #[test]
        fn global_avg_pool_matches_reference_and_finite_differences(
            (planes, hw) in (1..=6usize, 1..=20usize),
            seed in prop::collection::vec(-2.0f32..2.0, 126),
        ) {
            let x = &seed[..planes * hw];
            let r = &seed[120..120 + planes];
            let mut y = vec![0.0f32; planes];
            global_avg_pool(x, &mut y, hw);
            let want: Vec<f64> = x.chunks(hw).map(|c| c.iter().map(|&v| v as f64).sum::<f64>() / hw as f64).collect();
            assert_close(&to_f64(&y), &want, 1e-5, "y");
            let mut yb = vec![bf16::ZERO; planes];
            let xb = cast::<bf16>(x);
            global_avg_pool(&xb, &mut yb, hw);
            let want: Vec<f64> = xb.chunks(hw).map(|c| c.iter().map(|v| v.to_f64()).sum::<f64>() / hw as f64).collect();
            assert_close(&to_f64(&yb), &want, 1e-2, "y bf16");
            let fd = finite_diff(x, r, |x, y| global_avg_pool(x, y, hw));
            let mut dx = vec![f32::NAN; x.len()];
            global_avg_pool_backward(r, &mut dx, hw);
            assert_close(&to_f64(&dx), &fd, 1e-2, "dx");
        }
    }

    #[test]
    fn max_pool_propagates_nan() {
        let p = Pool2dParams::new(1, 1, (2, 2), (2, 2), (2, 2));
        let (mut y, mut arg) = ([0.0f32], [0u32]);
        max_pool2d(&p, &[1.0, f32::NAN, 3.0, 2.0], &mut y, &mut arg);
        assert!(y[0].is_nan());
        assert_eq!(arg[0], 1);
    }
}
