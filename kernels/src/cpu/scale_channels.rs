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
