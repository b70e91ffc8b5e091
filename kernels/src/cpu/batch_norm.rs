//! Batch normalization over `[n, c, s]` (`s` the spatial positions, 1 for `[n, c]`): every
//! channel is normalized with the mean and variance over its `n * s` values.
//!
//! Layout: `x`, `y`, `dy`, `dx` are `[n, c, s]` row-major; the per-channel vectors (`mean`,
//! `invstd`, `gamma`, `beta`, `dgamma`, `dbeta`) are `[c]` in f32, `c = mean.len()`. The
//! statistics accumulate in f64 (two passes); the variance that normalizes is the biased
//! one, as in PyTorch (`batch_norm_cpu_update_stats_template`).
//!
//! The `_nhwc` functions take channels_last `x`, `y`, `dy`, `dx` (`[n, h, w, c]` seen as
//! `[rows, c]`) and add each channel's values in the order the NCHW ones do (images, then
//! positions): the same results, bit for bit.

use super::check_len;
use crate::Element;
use crate::cpu::elementwise::min_items_per_task;
use crate::error::{Error, Result};
use rayon::prelude::*;

/// Checks `x` against `c` channels of `s` positions; returns `n`.
fn batches(op: &'static str, len: usize, c: usize, s: usize) -> Result<usize> {
    let plane = c * s;
    if plane == 0 || !len.is_multiple_of(plane) {
        return Err(Error::InvalidArgument {
            op,
            reason: format!("{len} elements are not whole images of {c} channels x {s} positions"),
        });
    }
    Ok(len / plane)
}

/// `f(channel)` for every channel, `len` values in all: in parallel, small inputs on one
/// thread.
fn per_channel(
    c: usize,
    len: usize,
    f: impl Fn(usize) -> (f64, f64) + Sync + Send,
) -> Vec<(f64, f64)> {
    (0..c).into_par_iter().with_min_len(min_items_per_task(len / c.max(1))).map(f).collect()
}

/// The planes (`s` values) of channel `ch` in `x: [n, c, s]`.
fn planes<T>(x: &[T], c: usize, s: usize, ch: usize) -> impl Iterator<Item = &[T]> {
    x.chunks(c * s).map(move |img| &img[ch * s..(ch + 1) * s])
}

/// Per-channel mean and biased variance of `x: [n, c, s]` into `mean` and `var` (`[c]`).
///
/// # Errors
///
/// [`Error::InvalidArgument`] for lengths that do not fit the layout.
pub fn batch_norm_stats<T: Element>(
    x: &[T],
    s: usize,
    mean: &mut [f32],
    var: &mut [f32],
) -> Result<()> {
    const OP: &str = "cpu::batch_norm_stats";
    let c = mean.len();
    let n = batches(OP, x.len(), c, s)?;
    check_len(OP, "var", var.len(), c)?;
    let m = (n * s) as f64;
    mean_var(c, x.len(), m, |ch| planes(x, c, s, ch).flatten(), mean, var);
    Ok(())
}

/// Each channel's mean and biased variance over the `m` values `values(ch)` gives, in f64
/// (the mean first, then the squared deviations from it), into `mean` and `var` in f32.
fn mean_var<'a, T: Element + 'a, I: Iterator<Item = &'a T>>(
    c: usize,
    len: usize,
    m: f64,
    values: impl Fn(usize) -> I + Sync + Send,
    mean: &mut [f32],
    var: &mut [f32],
) {
    let stats = per_channel(c, len, |ch| {
        let sum: f64 = values(ch).map(|v| f64::from(v.to_f32())).sum();
        let mu = sum / m;
        let sq: f64 = values(ch)
            .map(|v| {
                let d = f64::from(v.to_f32()) - mu;
                d * d
            })
            .sum();
        (mu, sq / m)
    });
    for ((o, v), (mu, var_b)) in mean.iter_mut().zip(var.iter_mut()).zip(stats) {
        (*o, *v) = (mu as f32, var_b as f32);
    }
}

/// `y = (x - mean[ch]) * invstd[ch] * gamma[ch] + beta[ch]` over `x: [n, c, s]`.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for lengths that do not fit the layout.
pub fn batch_norm_apply<T: Element>(
    x: &[T],
    s: usize,
    mean: &[f32],
    invstd: &[f32],
    gamma: &[f32],
    beta: &[f32],
    y: &mut [T],
) -> Result<()> {
    const OP: &str = "cpu::batch_norm_apply";
    let c = mean.len();
    batches(OP, x.len(), c, s)?;
    for (what, v) in [("invstd", invstd), ("gamma", gamma), ("beta", beta)] {
        check_len(OP, what, v.len(), c)?;
    }
    check_len(OP, "y", y.len(), x.len())?;
    y.par_chunks_mut(s)
        .zip(x.par_chunks(s))
        .enumerate()
        .with_min_len(min_items_per_task(s))
        .for_each(|(p, (y, x))| {
            let ch = p % c;
            let (mu, r, g, b) = (mean[ch], invstd[ch], gamma[ch], beta[ch]);
            for (o, &v) in y.iter_mut().zip(x) {
                *o = T::from_f32((v.to_f32() - mu) * r * g + b);
            }
        });
    Ok(())
}

/// Batch-norm backward from the forward input `x`, the saved `mean`/`invstd`, `gamma` and
/// the upstream `dy`: `dgamma = sum(dy * xhat)`, `dbeta = sum(dy)` per channel, and
/// `dx = gamma * invstd * (dy - dbeta / m - xhat * dgamma / m)` with `m = n * s` (training
/// statistics: the mean and variance depend on `x`).
///
/// # Errors
///
/// [`Error::InvalidArgument`] for lengths that do not fit the layout.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_backward<T: Element>(
    x: &[T],
    dy: &[T],
    s: usize,
    mean: &[f32],
    invstd: &[f32],
    gamma: &[f32],
    dx: &mut [T],
    dgamma: &mut [f32],
    dbeta: &mut [f32],
) -> Result<()> {
    const OP: &str = "cpu::batch_norm_backward";
    let c = mean.len();
    let n = batches(OP, x.len(), c, s)?;
    let pairs =
        |ch| planes(x, c, s, ch).zip(planes(dy, c, s, ch)).flat_map(|(a, b)| a.iter().zip(b));
    backward_sums(OP, (x, dy, dx.len()), (mean, invstd, gamma), (dgamma, dbeta), pairs)?;
    let m = (n * s) as f32;
    let (dgamma, dbeta) = (&*dgamma, &*dbeta);
    dx.par_chunks_mut(s)
        .zip(x.par_chunks(s).zip(dy.par_chunks(s)))
        .enumerate()
        .with_min_len(min_items_per_task(s))
        .for_each(|(p, (dx, (x, dy)))| {
            let ch = p % c;
            let (mu, r) = (mean[ch], invstd[ch]);
            let (mean_dy, mean_dyx) = (dbeta[ch] / m, dgamma[ch] / m);
            let k = gamma[ch] * r;
            for ((o, &v), &g) in dx.iter_mut().zip(x).zip(dy) {
                let xhat = (v.to_f32() - mu) * r;
                *o = T::from_f32(k * (g.to_f32() - mean_dy - xhat * mean_dyx));
            }
        });
    Ok(())
}

/// What both backward layouts share: the per-channel lengths checked (`dy` and `dx` of
/// `x`'s length, `[c]` for the rest), then `dgamma = sum(dy * xhat)` and `dbeta = sum(dy)`
/// over each channel's `(x, dy)` pairs as `pairs(ch)` yields them, in f64.
fn backward_sums<'a, T: Element + 'a, I: Iterator<Item = (&'a T, &'a T)>>(
    op: &'static str,
    (x, dy, dx_len): (&[T], &[T], usize),
    (mean, invstd, gamma): (&[f32], &[f32], &[f32]),
    (dgamma, dbeta): (&mut [f32], &mut [f32]),
    pairs: impl Fn(usize) -> I + Sync + Send,
) -> Result<()> {
    let c = mean.len();
    for (what, len) in [
        ("invstd", invstd.len()),
        ("gamma", gamma.len()),
        ("dgamma", dgamma.len()),
        ("dbeta", dbeta.len()),
    ] {
        check_len(op, what, len, c)?;
    }
    check_len(op, "dy", dy.len(), x.len())?;
    check_len(op, "dx", dx_len, x.len())?;
    let sums = per_channel(c, x.len(), |ch| {
        let (mu, r) = (f64::from(mean[ch]), f64::from(invstd[ch]));
        let (mut a, mut b) = (0.0f64, 0.0f64);
        for (&v, &g) in pairs(ch) {
            let g = f64::from(g.to_f32());
            a += g * (f64::from(v.to_f32()) - mu) * r;
            b += g;
        }
        (a, b)
    });
    for ((dg, db), &(a, b)) in dgamma.iter_mut().zip(dbeta.iter_mut()).zip(&sums) {
        (*dg, *db) = (a as f32, b as f32);
    }
    Ok(())
}

/// Channel `ch`'s values of a channels_last `x: [rows, c]` (`rows = n * h * w`), in the order
/// [`planes`] gives them for `[n, c, s]`: images, then positions.
fn column<T>(x: &[T], c: usize, ch: usize) -> impl Iterator<Item = &T> {
    x.iter().skip(ch).step_by(c)
}

/// [`batch_norm_stats`] of a channels_last `x: [n, h, w, c]` seen as `[rows, c]`, channel the
/// fastest index: each channel's sums accumulate in the same order as over the NCHW
/// permutation (images, then positions), so the results are bit-identical to it.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for lengths that do not fit the layout.
pub fn batch_norm_stats_nhwc<T: Element>(x: &[T], mean: &mut [f32], var: &mut [f32]) -> Result<()> {
    const OP: &str = "cpu::batch_norm_stats_nhwc";
    let c = mean.len();
    let rows = batches(OP, x.len(), c, 1)?;
    check_len(OP, "var", var.len(), c)?;
    mean_var(c, x.len(), rows as f64, |ch| column(x, c, ch), mean, var);
    Ok(())
}

/// [`batch_norm_apply`] over a channels_last `x: [rows, c]`.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for lengths that do not fit the layout.
pub fn batch_norm_apply_nhwc<T: Element>(
    x: &[T],
    mean: &[f32],
    invstd: &[f32],
    gamma: &[f32],
    beta: &[f32],
    y: &mut [T],
) -> Result<()> {
    const OP: &str = "cpu::batch_norm_apply_nhwc";
    let c = mean.len();
    batches(OP, x.len(), c, 1)?;
    for (what, v) in [("invstd", invstd), ("gamma", gamma), ("beta", beta)] {
        check_len(OP, what, v.len(), c)?;
    }
    check_len(OP, "y", y.len(), x.len())?;
    y.par_chunks_mut(c).zip(x.par_chunks(c)).with_min_len(min_items_per_task(c)).for_each(
        |(y, x)| {
            for (ch, (o, &v)) in y.iter_mut().zip(x).enumerate() {
                *o = T::from_f32((v.to_f32() - mean[ch]) * invstd[ch] * gamma[ch] + beta[ch]);
            }
        },
    );
    Ok(())
}

/// [`batch_norm_backward`] over channels_last `x` and `dy` (`[rows, c]`): the per-channel
/// sums in the NCHW order (bit-identical to it), `dx` channels_last.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for lengths that do not fit the layout.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_backward_nhwc<T: Element>(
    x: &[T],
    dy: &[T],
    mean: &[f32],
    invstd: &[f32],
    gamma: &[f32],
    dx: &mut [T],
    dgamma: &mut [f32],
    dbeta: &mut [f32],
) -> Result<()> {
    const OP: &str = "cpu::batch_norm_backward_nhwc";
    let c = mean.len();
    let rows = batches(OP, x.len(), c, 1)?;
    let pairs = |ch| column(x, c, ch).zip(column(dy, c, ch));
    backward_sums(OP, (x, dy, dx.len()), (mean, invstd, gamma), (dgamma, dbeta), pairs)?;
    let m = rows as f32;
    let (dgamma, dbeta) = (&*dgamma, &*dbeta);
    dx.par_chunks_mut(c)
        .zip(x.par_chunks(c).zip(dy.par_chunks(c)))
        .with_min_len(min_items_per_task(c))
        .for_each(|(dx, (x, dy))| {
            for (ch, ((o, &v), &g)) in dx.iter_mut().zip(x).zip(dy).enumerate() {
                let (mu, r) = (mean[ch], invstd[ch]);
                let (mean_dy, mean_dyx) = (dbeta[ch] / m, dgamma[ch] / m);
                let k = gamma[ch] * r;
                let xhat = (v.to_f32() - mu) * r;
                *o = T::from_f32(k * (g.to_f32() - mean_dy - xhat * mean_dyx));
            }
        });
    Ok(())
}
