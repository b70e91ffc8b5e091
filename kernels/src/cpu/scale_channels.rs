//! `x * s` with one scale per plane of `hw` values (squeeze-excitation's gate), and its
//! backward. Layout: `x`, `y`, `dy`, `dx` are planes of `hw`; `s` and `ds` one value per
//! plane.

use super::check_len;
use crate::Element;
use crate::cpu::elementwise::min_items_per_task;
use crate::error::Result;
use rayon::prelude::*;

/// `y = x * s[plane]`.
///
/// # Errors
///
/// [`crate::Error::InvalidArgument`] for lengths that do not fit the layout.
pub fn scale_channels<T: Element>(x: &[T], s: &[T], hw: usize, y: &mut [T]) -> Result<()> {
    const OP: &str = "cpu::scale_channels";
    check_len(OP, "x", x.len(), s.len() * hw)?;
    check_len(OP, "y", y.len(), x.len())?;
    let hw = hw.max(1);
    y.par_chunks_mut(hw)
        .zip(x.par_chunks(hw))
        .zip(s.par_iter())
        .with_min_len(min_items_per_task(hw))
        .for_each(|((y, x), &s)| {
            let s = s.to_f32();
            for (o, &v) in y.iter_mut().zip(x) {
                *o = T::from_f32(v.to_f32() * s);
            }
        });
    Ok(())
}

/// `dx = dy * s[plane]` and `ds[plane] = sum(dy * x)` over the plane (f64 accumulation).
/// Planes of no value leave `ds` as it is (the caller zeroes it).
///
/// # Errors
///
/// [`crate::Error::InvalidArgument`] for lengths that do not fit the layout.
pub fn scale_channels_backward<T: Element>(
    x: &[T],
    s: &[T],
    dy: &[T],
    hw: usize,
    dx: &mut [T],
    ds: &mut [T],
) -> Result<()> {
    const OP: &str = "cpu::scale_channels_backward";
    check_len(OP, "x", x.len(), s.len() * hw)?;
    check_len(OP, "dy", dy.len(), x.len())?;
    check_len(OP, "dx", dx.len(), x.len())?;
    check_len(OP, "ds", ds.len(), s.len())?;
    let hw = hw.max(1);
    dx.par_chunks_mut(hw)
        .zip(ds.par_iter_mut())
        .zip(x.par_chunks(hw).zip(dy.par_chunks(hw)))
        .zip(s.par_iter())
        .with_min_len(min_items_per_task(hw))
        .for_each(|(((dx, ds), (x, dy)), &s)| {
            let s = s.to_f32();
            let mut acc = 0.0f64;
            for ((o, &v), &g) in dx.iter_mut().zip(x).zip(dy) {
                let g = g.to_f32();
                *o = T::from_f32(g * s);
                acc += f64::from(g) * f64::from(v.to_f32());
            }
            *ds = T::from_f32(acc as f32);
        });
    Ok(())
}

/// [`scale_channels`] of a channels_last `x: [n, hw, c]` by `s: [n, c]`: `y[b, i, ch] =
/// x[b, i, ch] * s[b, ch]`, each element as [`scale_channels`] computes it.
///
/// # Errors
///
/// [`crate::Error::InvalidArgument`] for lengths that do not fit the layout.
pub fn scale_channels_nhwc<T: Element>(
    x: &[T],
    s: &[T],
    (hw, c): (usize, usize),
    y: &mut [T],
) -> Result<()> {
    const OP: &str = "cpu::scale_channels_nhwc";
    check_len(OP, "x", x.len(), s.len() * hw)?;
    check_len(OP, "y", y.len(), x.len())?;
    if y.is_empty() {
        return Ok(());
    }
    y.par_chunks_mut(hw * c).zip(x.par_chunks(hw * c)).zip(s.par_chunks(c)).for_each(
        |((y, x), s)| {
            let s: Vec<f32> = s.iter().map(|v| v.to_f32()).collect();
            for (y, x) in y.chunks_mut(c).zip(x.chunks(c)) {
                for ((o, &v), &s) in y.iter_mut().zip(x).zip(&s) {
                    *o = T::from_f32(v.to_f32() * s);
                }
            }
        },
    );
    Ok(())
}

/// Gradients of [`scale_channels_nhwc`]: `dx = dy * s[b, ch]` (as [`scale_channels_backward`]
/// computes each element) and `ds[b, ch] = sum(dy * x)` over the image's positions, in f64:
/// in position order within chunks of 64 positions (`COLUMN_SUM_ROWS`), the chunks' sums then
/// in chunk order, each sum from 0.0, the order a GPU with one thread per image, chunk and
/// channel adds in. Up to 64 positions that is [`scale_channels_backward`]'s sum, bit for
/// bit; past it the same exact f64 products grouped by chunk, which may round differently
/// in the last bit of f64 (and so, rarely, of the f32 result). `ds` is left as it is for
/// `hw == 0` (the caller zeroes it).
///
/// # Errors
///
/// [`crate::Error::InvalidArgument`] for lengths that do not fit the layout.
pub fn scale_channels_backward_nhwc<T: Element>(
    x: &[T],
    s: &[T],
    dy: &[T],
    (hw, c): (usize, usize),
    dx: &mut [T],
    ds: &mut [T],
) -> Result<()> {
    const OP: &str = "cpu::scale_channels_backward_nhwc";
    check_len(OP, "x", x.len(), s.len() * hw)?;
    check_len(OP, "dy", dy.len(), x.len())?;
    check_len(OP, "dx", dx.len(), x.len())?;
    check_len(OP, "ds", ds.len(), s.len())?;
    if dx.is_empty() {
        return Ok(());
    }
    let rows = crate::cpu::elementwise::COLUMN_SUM_ROWS * c;
    dx.par_chunks_mut(hw * c)
        .zip(ds.par_chunks_mut(c))
        .zip(x.par_chunks(hw * c).zip(dy.par_chunks(hw * c)))
        .zip(s.par_chunks(c))
        .for_each(|(((dx, ds), (x, dy)), s)| {
            let s: Vec<f32> = s.iter().map(|v| v.to_f32()).collect();
            let mut total = vec![0.0f64; c];
            for ((dx, x), dy) in dx.chunks_mut(rows).zip(x.chunks(rows)).zip(dy.chunks(rows)) {
                let mut acc = vec![0.0f64; c];
                for ((dx, x), dy) in dx.chunks_mut(c).zip(x.chunks(c)).zip(dy.chunks(c)) {
                    for ((((o, &v), &g), &s), a) in
                        dx.iter_mut().zip(x).zip(dy).zip(&s).zip(acc.iter_mut())
                    {
                        let g = g.to_f32();
                        *o = T::from_f32(g * s);
                        *a += f64::from(g) * f64::from(v.to_f32());
                    }
                }
                total.iter_mut().zip(acc).for_each(|(t, a)| *t += a);
            }
            ds.iter_mut().zip(total).for_each(|(d, t)| *d = T::from_f32(t as f32));
        });
    Ok(())
}
