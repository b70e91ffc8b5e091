//! 2-D pooling on the host, NCHW: max pool (with argmax for backward), average pool, and
//! the global average pool that ends most CNNs.
//!
//! Layouts: `x: [batch, channels, h, w]`, `y: [batch, channels, oh, ow]` with
//! `(oh, ow) = params.output_hw()`. Every backward overwrites its `dx`.

use super::elementwise::COLUMN_SUM_ROWS;
use super::{check_len, rows_of, widen_f32, with_f32_out};
use crate::dtype::Element;
use crate::error::Result;
use crate::params::Pool2dParams;
use rayon::prelude::*;
use std::ops::Range;

/// The input rows and columns under window `(oy, ox)`, padding excluded.
fn window(p: &Pool2dParams, oy: usize, ox: usize) -> (Range<usize>, Range<usize>) {
    let span = |o: usize, s: usize, pad: usize, k: usize, len: usize| {
        let start = (o * s) as isize - pad as isize;
        start.max(0) as usize..((start + k as isize).max(0) as usize).min(len)
    };
    let (k, s, pad) = (p.kernel(), p.stride(), p.padding());
    (span(oy, s.0, pad.0, k.0, p.h()), span(ox, s.1, pad.1, k.1, p.w()))
}

/// Checks the lengths of `x` and `y` (and of an argmax of `y`'s length) against `p`.
fn check(op: &'static str, p: &Pool2dParams, x: usize, y: usize) -> Result<()> {
    check_len(op, "x", x, p.input_len())?;
    check_len(op, "y", y, p.output_len())
}

/// Max pool: `y` gets each window's maximum and `argmax` (same layout as `y`) its position
/// inside the input plane, `iy * w + ix`. NaN wins over every number, so it propagates.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if a length does not fit `p`.
pub fn max_pool2d<T: Element>(
    p: &Pool2dParams,
    x: &[T],
    y: &mut [T],
    argmax: &mut [u32],
) -> Result<()> {
    const OP: &str = "cpu::max_pool2d";
    check(OP, p, x.len(), y.len())?;
    check_len(OP, "argmax", argmax.len(), y.len())?;
    let (oh, ow) = p.output_hw();
    if y.is_empty() {
        return Ok(());
    }
    let x = widen_f32(x);
    with_f32_out(y, |y| {
        y.par_chunks_mut(oh * ow)
            .zip(argmax.par_chunks_mut(oh * ow))
            .zip(x.par_chunks(p.h() * p.w()))
            .for_each(|((y, arg), x)| {
                for oy in 0..oh {
                    for ox in 0..ow {
                        let (rows, cols) = window(p, oy, ox);
                        let (mut best, mut at) =
                            (f32::NEG_INFINITY, rows.start * p.w() + cols.start);
                        for iy in rows {
                            for ix in cols.clone() {
                                let v = x[iy * p.w() + ix];
                                if v > best || (v.is_nan() && !best.is_nan()) {
                                    (best, at) = (v, iy * p.w() + ix);
                                }
                            }
                        }
                        y[oy * ow + ox] = best;
                        arg[oy * ow + ox] = at as u32;
                    }
                }
            });
    });
    Ok(())
}

/// Gradient of [`max_pool2d`]: each `dy` element goes to the input position its window
/// took the maximum from (`argmax` as returned by the forward).
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if a length does not fit `p`;
/// [`Error::IndexOutOfRange`](crate::Error::IndexOutOfRange) for an argmax outside the
/// input plane. Nothing is written then.
pub fn max_pool2d_backward<T: Element>(
    p: &Pool2dParams,
    dy: &[T],
    argmax: &[u32],
    dx: &mut [T],
) -> Result<()> {
    const OP: &str = "cpu::max_pool2d_backward";
    check(OP, p, dx.len(), dy.len())?;
    check_len(OP, "argmax", argmax.len(), dy.len())?;
    let plane = p.h() * p.w();
    if let Some(&bad) = argmax.iter().find(|&&i| i as usize >= plane) {
        return Err(crate::Error::IndexOutOfRange { op: OP, index: bad as usize, bound: plane });
    }
    let (oh, ow) = p.output_hw();
    let dy = widen_f32(dy);
    with_f32_out(dx, |dx| {
        dx.fill(0.0);
        if oh * ow == 0 {
            return;
        }
        dx.par_chunks_mut(p.h() * p.w())
            .zip(dy.par_chunks(oh * ow))
            .zip(argmax.par_chunks(oh * ow))
            .for_each(|((dx, dy), arg)| {
                for (&g, &i) in dy.iter().zip(arg) {
                    dx[i as usize] += g;
                }
            });
    });
    Ok(())
}

/// The divisor of window `(oy, ox)`: the full window when padding counts, else the number
/// of real elements under it.
fn divisor(p: &Pool2dParams, oy: usize, ox: usize, count_include_pad: bool) -> f32 {
    if count_include_pad {
        (p.kernel().0 * p.kernel().1) as f32
    } else {
        let (rows, cols) = window(p, oy, ox);
        (rows.len() * cols.len()) as f32
    }
}

/// Average pool: `y` gets each window's mean. Padding counts as zeros in the divisor when
/// `count_include_pad` (PyTorch's default), otherwise only real elements are averaged.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if a length does not fit `p`.
pub fn avg_pool2d<T: Element>(
    p: &Pool2dParams,
    x: &[T],
    y: &mut [T],
    count_include_pad: bool,
) -> Result<()> {
    check("cpu::avg_pool2d", p, x.len(), y.len())?;
    let (oh, ow) = p.output_hw();
    if y.is_empty() {
        return Ok(());
    }
    let x = widen_f32(x);
    with_f32_out(y, |y| {
        y.par_chunks_mut(oh * ow).zip(x.par_chunks(p.h() * p.w())).for_each(|(y, x)| {
            for oy in 0..oh {
                for ox in 0..ow {
                    let (rows, cols) = window(p, oy, ox);
                    let sum: f32 =
                        rows.map(|iy| x[iy * p.w()..][cols.clone()].iter().sum::<f32>()).sum();
                    y[oy * ow + ox] = sum / divisor(p, oy, ox, count_include_pad);
                }
            }
        });
    });
    Ok(())
}

/// Gradient of [`avg_pool2d`] (same `count_include_pad`): each `dy` element is spread
/// evenly over its window.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if a length does not fit `p`.
pub fn avg_pool2d_backward<T: Element>(
    p: &Pool2dParams,
    dy: &[T],
    dx: &mut [T],
    count_include_pad: bool,
) -> Result<()> {
    check("cpu::avg_pool2d_backward", p, dx.len(), dy.len())?;
    let (oh, ow) = p.output_hw();
    let dy = widen_f32(dy);
    with_f32_out(dx, |dx| {
        dx.fill(0.0);
        if oh * ow == 0 {
            return;
        }
        dx.par_chunks_mut(p.h() * p.w()).zip(dy.par_chunks(oh * ow)).for_each(|(dx, dy)| {
            for oy in 0..oh {
                for ox in 0..ow {
                    let (rows, cols) = window(p, oy, ox);
                    let g = dy[oy * ow + ox] / divisor(p, oy, ox, count_include_pad);
                    for iy in rows {
                        dx[iy * p.w()..][cols.clone()].iter_mut().for_each(|d| *d += g);
                    }
                }
            }
        });
    });
    Ok(())
}

/// Global average pool: `x: [planes, hw]` (planes = batch * channels) to `y: [planes]`,
/// the mean of each plane.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if a length does not fit, or for `hw == 0`.
pub fn global_avg_pool<T: Element>(x: &[T], y: &mut [T], hw: usize) -> Result<()> {
    let planes = plane_rows("cpu::global_avg_pool", x.len(), hw)?;
    check_len("cpu::global_avg_pool", "y", y.len(), planes)?;
    y.par_iter_mut().zip(x.par_chunks(hw)).for_each(|(y, x)| {
        *y = T::from_f32(x.iter().map(|v| v.to_f32()).sum::<f32>() / hw as f32);
    });
    Ok(())
}

/// The planes of a `[planes, hw]` buffer of `len` elements; `hw` must be positive.
fn plane_rows(op: &'static str, len: usize, hw: usize) -> Result<usize> {
    if hw == 0 {
        return Err(crate::Error::InvalidArgument {
            op,
            reason: "cannot average an empty plane".into(),
        });
    }
    rows_of(op, "x", len, hw)
}

/// Gradient of [`global_avg_pool`]: `dx[plane, i] = dy[plane] / hw`.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if a length does not fit, or for `hw == 0`.
pub fn global_avg_pool_backward<T: Element>(dy: &[T], dx: &mut [T], hw: usize) -> Result<()> {
    let planes = plane_rows("cpu::global_avg_pool_backward", dx.len(), hw)?;
    check_len("cpu::global_avg_pool_backward", "dy", dy.len(), planes)?;
    dx.par_chunks_mut(hw).zip(dy.par_iter()).for_each(|(dx, g)| {
        dx.fill(T::from_f32(g.to_f32() / hw as f32));
    });
    Ok(())
}

/// [`global_avg_pool_backward`] added in place: `acc[plane, i] += dy[plane] / hw`, in f32
/// with one rounding.
///
/// # Errors
///
/// As [`global_avg_pool_backward`].
pub fn global_avg_pool_backward_add<T: Element>(dy: &[T], acc: &mut [T], hw: usize) -> Result<()> {
    let planes = plane_rows("cpu::global_avg_pool_backward_add", acc.len(), hw)?;
    check_len("cpu::global_avg_pool_backward_add", "dy", dy.len(), planes)?;
    acc.par_chunks_mut(hw).zip(dy.par_iter()).for_each(|(acc, g)| {
        let g = g.to_f32() / hw as f32;
        acc.iter_mut().for_each(|a| *a = T::from_f32(a.to_f32() + g));
    });
    Ok(())
}

/// [`max_pool2d`] of a channels_last `x: [batch, h, w, channels]` into `y: [batch, oh, ow,
/// channels]`; `argmax` (`y`'s layout) gets each maximum's position in its channel's plane,
/// `iy * w + ix`, as [`max_pool2d`]'s (and PyTorch's channels_last indices). Each channel's
/// window is visited in the same order with the same comparison, so `y` and `argmax` are
/// [`max_pool2d`]'s of the same image in NCHW, permuted, bit for bit.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if a length does not fit `p`
/// (whose input is `[batch, channels, h, w]`).
pub fn max_pool2d_nhwc<T: Element>(
    p: &Pool2dParams,
    x: &[T],
    y: &mut [T],
    argmax: &mut [u32],
) -> Result<()> {
    const OP: &str = "cpu::max_pool2d_nhwc";
    check(OP, p, x.len(), y.len())?;
    check_len(OP, "argmax", argmax.len(), y.len())?;
    let ((oh, ow), c, (h, w)) = (p.output_hw(), p.channels(), (p.h(), p.w()));
    if y.is_empty() {
        return Ok(());
    }
    let x = widen_f32(x);
    with_f32_out(y, |y| {
        // One output row [ow, c] of one image per task.
        y.par_chunks_mut(ow * c).zip(argmax.par_chunks_mut(ow * c)).enumerate().for_each(
            |(row, (y, arg))| {
                let (b, oy) = (row / oh, row % oh);
                let image = &x[b * h * w * c..][..h * w * c];
                for ox in 0..ow {
                    let (rows, cols) = window(p, oy, ox);
                    let (y, arg) = (&mut y[ox * c..][..c], &mut arg[ox * c..][..c]);
                    y.fill(f32::NEG_INFINITY);
                    arg.fill((rows.start * w + cols.start) as u32);
                    for iy in rows {
                        for ix in cols.clone() {
                            let at = iy * w + ix;
                            let pixel = &image[at * c..][..c];
                            for ((best, a), &v) in y.iter_mut().zip(arg.iter_mut()).zip(pixel) {
                                if v > *best || (v.is_nan() && !best.is_nan()) {
                                    (*best, *a) = (v, at as u32);
                                }
                            }
                        }
                    }
                }
            },
        );
    });
    Ok(())
}

/// Gradient of [`max_pool2d_nhwc`], channels_last: each `dy` element goes to the input
/// position of its channel's plane that `argmax` names, added in f32 in output order (as
/// [`max_pool2d_backward`] adds, so the result is its, permuted, bit for bit) and rounded
/// once.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if a length does not fit `p`;
/// [`Error::IndexOutOfRange`](crate::Error::IndexOutOfRange) for an argmax outside the
/// input plane. Nothing is written then.
pub fn max_pool2d_backward_nhwc<T: Element>(
    p: &Pool2dParams,
    dy: &[T],
    argmax: &[u32],
    dx: &mut [T],
) -> Result<()> {
    const OP: &str = "cpu::max_pool2d_backward_nhwc";
    check(OP, p, dx.len(), dy.len())?;
    check_len(OP, "argmax", argmax.len(), dy.len())?;
    let plane = p.h() * p.w();
    if let Some(&bad) = argmax.iter().find(|&&i| i as usize >= plane) {
        return Err(crate::Error::IndexOutOfRange { op: OP, index: bad as usize, bound: plane });
    }
    let c = p.channels();
    let dy = widen_f32(dy);
    with_f32_out(dx, |dx| {
        dx.fill(0.0);
        if dx.is_empty() || dy.is_empty() {
            return;
        }
        let out = dy.len() / p.batch();
        dx.par_chunks_mut(plane * c).zip(dy.par_chunks(out)).zip(argmax.par_chunks(out)).for_each(
            |((dx, dy), arg)| {
                for (dy, arg) in dy.chunks(c).zip(arg.chunks(c)) {
                    for (ch, (&g, &i)) in dy.iter().zip(arg).enumerate() {
                        dx[i as usize * c + ch] += g;
                    }
                }
            },
        );
    });
    Ok(())
}

/// The chunks of [`COLUMN_SUM_ROWS`] positions that the channels_last reductions over `hw`
/// positions add separately (at least one).
pub(crate) fn nhwc_chunks(hw: usize) -> usize {
    hw.div_ceil(COLUMN_SUM_ROWS).max(1)
}

/// Global average pool of a channels_last `x: [batch, hw, c]` to `y: [batch, c]`. Each
/// channel's values are added in f32 in position order, in chunks of 64 positions
/// (`COLUMN_SUM_ROWS`, as the column sums), the chunks' sums then in chunk order (every sum from -0.0, as Rust's `sum`),
/// and the total divided by `hw`: the order a GPU with one thread per image, chunk and
/// channel adds in. Up to 64 positions (a 7x7 head) that is [`global_avg_pool`]'s sum of
/// the NCHW plane, bit for bit; past it, the same terms grouped by chunk.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if a length does not fit, or
/// for `hw == 0`.
pub fn global_avg_pool_nhwc<T: Element>(x: &[T], y: &mut [T], hw: usize, c: usize) -> Result<()> {
    const OP: &str = "cpu::global_avg_pool_nhwc";
    let images = plane_rows(OP, x.len(), hw * c.max(1))?;
    check_len(OP, "y", y.len(), images * c)?;
    if y.is_empty() {
        return Ok(());
    }
    y.par_chunks_mut(c).zip(x.par_chunks(hw * c)).for_each(|(y, x)| {
        let mut total = vec![-0.0f32; c];
        for chunk in x.chunks(COLUMN_SUM_ROWS * c) {
            let mut acc = vec![-0.0f32; c];
            for pixel in chunk.chunks(c) {
                acc.iter_mut().zip(pixel).for_each(|(a, v)| *a += v.to_f32());
            }
            total.iter_mut().zip(acc).for_each(|(t, a)| *t += a);
        }
        y.iter_mut().zip(total).for_each(|(y, t)| *y = T::from_f32(t / hw as f32));
    });
    Ok(())
}

/// Gradient of [`global_avg_pool_nhwc`], or (`add`) that gradient added into `dx` in place:
/// `dx[b, i, ch] (+)= dy[b, ch] / hw`, in f32 with one rounding, as
/// [`global_avg_pool_backward`] and [`global_avg_pool_backward_add`] compute each element.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if a length does not fit, or
/// for `hw == 0`.
pub fn global_avg_pool_backward_nhwc<T: Element>(
    dy: &[T],
    dx: &mut [T],
    hw: usize,
    c: usize,
    add: bool,
) -> Result<()> {
    const OP: &str = "cpu::global_avg_pool_backward_nhwc";
    let images = plane_rows(OP, dx.len(), hw * c.max(1))?;
    check_len(OP, "dy", dy.len(), images * c)?;
    if dx.is_empty() {
        return Ok(());
    }
    dx.par_chunks_mut(hw * c).zip(dy.par_chunks(c)).for_each(|(dx, dy)| {
        let g: Vec<f32> = dy.iter().map(|g| g.to_f32() / hw as f32).collect();
        for pixel in dx.chunks_mut(c) {
            for (d, &g) in pixel.iter_mut().zip(&g) {
                *d = T::from_f32(if add { d.to_f32() + g } else { g });
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::elementwise::testing::{
        assert_close, finite_diff_sum as finite_diff, round as cast,
    };
    use crate::cpu::widen_f64;
    use crate::params::Pool2dOptions;
    use half::{bf16, f16};
    use proptest::prelude::*;

    /// f64 pooling from the definition, with the padded positions explicitly excluded
    /// (max) or counted as zeros (average).
    fn reference(p: &Pool2dParams, x: &[f64], max: bool, include_pad: bool) -> Vec<f64> {
        let (oh, ow) = p.output_hw();
        let mut y = Vec::with_capacity(p.output_len());
        for plane in 0..p.batch() * p.channels() {
            for oy in 0..oh {
                for ox in 0..ow {
                    let (mut best, mut sum, mut count) = (f64::NEG_INFINITY, 0.0, 0usize);
                    for ky in 0..p.kernel().0 {
                        for kx in 0..p.kernel().1 {
                            let iy = (oy * p.stride().0 + ky) as isize - p.padding().0 as isize;
                            let ix = (ox * p.stride().1 + kx) as isize - p.padding().1 as isize;
                            if iy < 0 || ix < 0 || iy >= p.h() as isize || ix >= p.w() as isize {
                                count += include_pad as usize;
                                continue;
                            }
                            let v = x[(plane * p.h() + iy as usize) * p.w() + ix as usize];
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
                let opts = Pool2dOptions::new((kh, kw), (sh, sw))
                    .padding((ph.min(kh / 2), pw.min(kw / 2)));
                Pool2dParams::new(&[n, c, h, w], &opts).unwrap()
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
        max_pool2d(p, &x, &mut y, &mut arg).unwrap();
        assert_close(&widen_f64(&y), &reference(p, &widen_f64(&x), true, false), tol, "max");
        for (plane, (y, arg)) in y
            .chunks(y.len() / (p.batch() * p.channels()))
            .zip(arg.chunks(arg.len() / (p.batch() * p.channels())))
            .enumerate()
        {
            for (v, &i) in y.iter().zip(arg) {
                assert_eq!(
                    *v,
                    x[plane * p.h() * p.w() + i as usize],
                    "argmax points at the maximum"
                );
            }
        }
        for include_pad in [false, true] {
            avg_pool2d(p, &x, &mut y, include_pad).unwrap();
            assert_close(
                &widen_f64(&y),
                &reference(p, &widen_f64(&x), false, include_pad),
                tol,
                "avg",
            );
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
            let fd = finite_diff(&x, &r, |x, y| max_pool2d(&p, x, y, &mut arg.clone()).unwrap());
            let mut y = vec![0.0f32; p.output_len()];
            max_pool2d(&p, &x, &mut y, &mut arg).unwrap();
            let mut dx = vec![f32::NAN; x.len()];
            max_pool2d_backward(&p, &r, &arg, &mut dx).unwrap();
            assert_close(&widen_f64(&dx), &fd, 1e-2, "dx");
        }

        // Property: average pool's gradient equals central finite differences of
        // sum(y * r), with and without padding in the divisor.
        #[test]
        fn avg_pool_backward_matches_finite_differences((p, x, r) in case(), include_pad in any::<bool>()) {
            let fd = finite_diff(&x, &r, |x, y| avg_pool2d(&p, x, y, include_pad).unwrap());
            let mut dx = vec![f32::NAN; x.len()];
            avg_pool2d_backward(&p, &r, &mut dx, include_pad).unwrap();
            assert_close(&widen_f64(&dx), &fd, 1e-2, "dx");
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
            global_avg_pool(x, &mut y, hw).unwrap();
            let want: Vec<f64> = x.chunks(hw).map(|c| c.iter().map(|&v| v as f64).sum::<f64>() / hw as f64).collect();
            assert_close(&widen_f64(&y), &want, 1e-5, "y");
            let mut yb = vec![bf16::ZERO; planes];
            let xb = cast::<bf16>(x);
            global_avg_pool(&xb, &mut yb, hw).unwrap();
            let want: Vec<f64> = xb.chunks(hw).map(|c| c.iter().map(|v| v.to_f64()).sum::<f64>() / hw as f64).collect();
            assert_close(&widen_f64(&yb), &want, 1e-2, "y bf16");
            let fd = finite_diff(x, r, |x, y| global_avg_pool(x, y, hw).unwrap());
            let mut dx = vec![f32::NAN; x.len()];
            global_avg_pool_backward(r, &mut dx, hw).unwrap();
            assert_close(&widen_f64(&dx), &fd, 1e-2, "dx");
        }
    }

    #[test]
    fn max_pool_propagates_nan() {
        let p = Pool2dParams::new(&[1, 1, 2, 2], &Pool2dOptions::new((2, 2), (2, 2))).unwrap();
        let (mut y, mut arg) = ([0.0f32], [0u32]);
        max_pool2d(&p, &[1.0, f32::NAN, 3.0, 2.0], &mut y, &mut arg).unwrap();
        assert!(y[0].is_nan());
        assert_eq!(arg[0], 1);
    }
}
