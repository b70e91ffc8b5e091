//! Layer normalization over the last dimension, forward and backward.
//!
//! Layout: `x`, `y`, `dy`, `dx` are row-major `[n, d]`; `gamma`, `beta`, `dgamma`, `dbeta`
//! are `[d]` with `d = gamma.len()`; the saved statistics `mean` and `rstd` are `[n]` in f32.
//! The variance is the biased one (divide by `d`), as in PyTorch.

use super::check_len;
use crate::Element;
use crate::cpu::elementwise::{COLUMN_SUM_ROWS, PAR_THRESHOLD};
use crate::error::{Error, Result};
use rayon::prelude::*;

/// Normalizes one row; returns `(mean, rstd)`.
fn forward_row<T: Element>(x: &[T], gamma: &[T], beta: &[T], eps: f32, y: &mut [T]) -> (f32, f32) {
    let d = x.len() as f32;
    let mean = x.iter().map(|v| v.to_f32()).sum::<f32>() / d;
    // Two passes: the centred sum of squares does not cancel catastrophically.
    let var = x
        .iter()
        .map(|v| {
            let c = v.to_f32() - mean;
            c * c
        })
        .sum::<f32>()
        / d;
    let rstd = 1.0 / (var + eps).sqrt();
    for (((o, &v), &g), &b) in y.iter_mut().zip(x).zip(gamma).zip(beta) {
        let xhat = (v.to_f32() - mean) * rstd;
        *o = T::from_f32(xhat * g.to_f32() + b.to_f32());
    }
    (mean, rstd)
}

/// Layer norm forward: `y = (x - mean) * rstd * gamma + beta` per row, with
/// `rstd = 1 / sqrt(var + eps)`. Writes `y` and the per-row `mean` and `rstd` that
/// [`layer_norm_backward`] needs.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for `d == 0` or lengths that do not fit the layout.
pub fn layer_norm<T: Element>(
    x: &[T],
    gamma: &[T],
    beta: &[T],
    eps: f32,
    y: &mut [T],
    mean: &mut [f32],
    rstd: &mut [f32],
) -> Result<()> {
    const OP: &str = "cpu::layer_norm";
    let d = gamma.len();
    let rows = check_rows(OP, x.len(), d)?;
    check_len(OP, "beta", beta.len(), d)?;
    check_len(OP, "y", y.len(), x.len())?;
    check_len(OP, "mean", mean.len(), rows)?;
    check_len(OP, "rstd", rstd.len(), rows)?;
    let row = |y: &mut [T], x: &[T], m: &mut f32, r: &mut f32| {
        (*m, *r) = forward_row(x, gamma, beta, eps, y);
    };
    if x.len() >= PAR_THRESHOLD {
        y.par_chunks_mut(d)
            .zip(x.par_chunks(d))
            .zip(mean.par_iter_mut().zip(rstd.par_iter_mut()))
            .for_each(|((y, x), (m, r))| row(y, x, m, r));
    } else {
        y.chunks_mut(d)
            .zip(x.chunks(d))
            .zip(mean.iter_mut().zip(rstd.iter_mut()))
            .for_each(|((y, x), (m, r))| row(y, x, m, r));
    }
    Ok(())
}

/// Checks `d > 0` and that `x` is whole rows of `d`; returns the rows.
pub(super) fn check_rows(op: &'static str, x: usize, d: usize) -> Result<usize> {
    if d == 0 {
        return Err(Error::InvalidArgument {
            op,
            reason: "cannot normalize rows of 0 elements".into(),
        });
    }
    super::rows_of(op, "x", x, d)
}

/// `dx` for one row: `rstd * (g - mean(g) - xhat * mean(g * xhat))` with `g = dy * gamma`,
/// rounded to `T`; with `dres`, that rounded value plus the row of `dres`, rounded again (what
/// an `add_assign` of `dres` into the stored `dx` gives).
fn backward_row<T: Element>(
    x: &[T],
    gamma: &[T],
    dy: &[T],
    mean: f32,
    rstd: f32,
    dres: Option<&[T]>,
    dx: &mut [T],
) {
    let d = x.len() as f32;
    let (mut sum_g, mut sum_gx) = (0.0f32, 0.0f32);
    for ((&v, &gm), &g) in x.iter().zip(gamma).zip(dy) {
        let xhat = (v.to_f32() - mean) * rstd;
        let g = g.to_f32() * gm.to_f32();
        sum_g += g;
        sum_gx += g * xhat;
    }
    let (mean_g, mean_gx) = (sum_g / d, sum_gx / d);
    for (i, (((o, &v), &gm), &g)) in dx.iter_mut().zip(x).zip(gamma).zip(dy).enumerate() {
        let xhat = (v.to_f32() - mean) * rstd;
        let g = g.to_f32() * gm.to_f32();
        let own = T::from_f32(rstd * (g - mean_g - xhat * mean_gx));
        *o = match dres {
            Some(r) => T::from_f32(own.to_f32() + r[i].to_f32()),
            None => own,
        };
    }
}

/// Layer norm backward from the forward input `x`, `gamma`, the saved `mean`/`rstd` and the
/// upstream `dy`. Overwrites `dx` (`[n, d]`), `dgamma = sum_rows(dy * xhat)` and
/// `dbeta = sum_rows(dy)` (both `[d]`, accumulated in f32).
///
/// # Errors
///
/// As [`layer_norm`].
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward<T: Element>(
    x: &[T],
    gamma: &[T],
    mean: &[f32],
    rstd: &[f32],
    dy: &[T],
    dx: &mut [T],
    dgamma: &mut [T],
    dbeta: &mut [T],
) -> Result<()> {
    backward("cpu::layer_norm_backward", x, gamma, mean, rstd, dy, None, dx, dgamma, dbeta)
}

/// [`layer_norm_backward`] with a second gradient `dres` (`[n, d]`) arriving at `x` by
/// another path (a residual shortcut): `dx` is layer norm's input gradient rounded to `T`
/// plus `dres`, rounded again, bit for bit [`layer_norm_backward`] then an `add_assign` of
/// `dres` into its `dx`; `dgamma` and `dbeta` are [`layer_norm_backward`]'s.
///
/// # Errors
///
/// As [`layer_norm`], and for a `dres` not of `x`'s length.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward_residual<T: Element>(
    x: &[T],
    gamma: &[T],
    mean: &[f32],
    rstd: &[f32],
    dy: &[T],
    dres: &[T],
    dx: &mut [T],
    dgamma: &mut [T],
    dbeta: &mut [T],
) -> Result<()> {
    const OP: &str = "cpu::layer_norm_backward_residual";
    check_len(OP, "dres", dres.len(), x.len())?;
    backward(OP, x, gamma, mean, rstd, dy, Some(dres), dx, dgamma, dbeta)
}

#[allow(clippy::too_many_arguments)]
fn backward<T: Element>(
    op: &'static str,
    x: &[T],
    gamma: &[T],
    mean: &[f32],
    rstd: &[f32],
    dy: &[T],
    dres: Option<&[T]>,
    dx: &mut [T],
    dgamma: &mut [T],
    dbeta: &mut [T],
) -> Result<()> {
    let d = gamma.len();
    let rows = check_rows(op, x.len(), d)?;
    check_len(op, "dgamma", dgamma.len(), d)?;
    check_len(op, "dbeta", dbeta.len(), d)?;
    check_len(op, "dy", dy.len(), x.len())?;
    check_len(op, "dx", dx.len(), x.len())?;
    check_len(op, "mean", mean.len(), rows)?;
    check_len(op, "rstd", rstd.len(), rows)?;
    let row = |r: usize, dx: &mut [T]| {
        let at = r * d..(r + 1) * d;
        let res = dres.map(|v| &v[at.clone()]);
        backward_row(&x[at.clone()], gamma, &dy[at], mean[r], rstd[r], res, dx);
    };
    if x.len() >= PAR_THRESHOLD {
        dx.par_chunks_mut(d).enumerate().for_each(|(r, dx)| row(r, dx));
    } else {
        dx.chunks_mut(d).enumerate().for_each(|(r, dx)| row(r, dx));
    }
    let (dg, db) = param_sums(x, mean, rstd, dy, d);
    for (o, v) in dgamma.iter_mut().zip(dg) {
        *o = T::from_f32(v);
    }
    for (o, v) in dbeta.iter_mut().zip(db) {
        *o = T::from_f32(v);
    }
    Ok(())
}

/// `dgamma = sum over rows of dy * xhat` and `dbeta = sum over rows of dy` in f32, in the
/// order of every column sum ([`COLUMN_SUM_ROWS`] rows at a time, then the chunks in order),
/// which the GPU's kernels follow too; chunks run in parallel for large inputs.
fn param_sums<T: Element>(
    x: &[T],
    mean: &[f32],
    rstd: &[f32],
    dy: &[T],
    d: usize,
) -> (Vec<f32>, Vec<f32>) {
    // Chunk c: rows c * COLUMN_SUM_ROWS onwards, added in row order from 0.
    let chunk = |c: usize| {
        let rows = c * COLUMN_SUM_ROWS..((c + 1) * COLUMN_SUM_ROWS).min(mean.len());
        let (mut a, mut b) = (vec![0.0f32; d], vec![0.0f32; d]);
        for r in rows {
            let (x, dy) = (&x[r * d..][..d], &dy[r * d..][..d]);
            let (m, rs) = (mean[r], rstd[r]);
            for (((a, b), &v), &g) in a.iter_mut().zip(b.iter_mut()).zip(x).zip(dy) {
                let g = g.to_f32();
                *a += g * (v.to_f32() - m) * rs;
                *b += g;
            }
        }
        (a, b)
    };
    let chunks = mean.len().div_ceil(COLUMN_SUM_ROWS);
    let partials: Vec<(Vec<f32>, Vec<f32>)> = if x.len() >= PAR_THRESHOLD {
        (0..chunks).into_par_iter().map(chunk).collect()
    } else {
        (0..chunks).map(chunk).collect()
    };
    let (mut dg, mut db) = (vec![0.0f32; d], vec![0.0f32; d]);
    for (a, b) in &partials {
        dg.iter_mut().zip(a).for_each(|(t, &v)| *t += v);
        db.iter_mut().zip(b).for_each(|(t, &v)| *t += v);
    }
    (dg, db)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::elementwise::testing::*;
    use crate::cpu::widen_f64;
    use half::{bf16, f16};
    use proptest::prelude::*;
    use proptest::test_runner::TestCaseError;

    const EPS: f32 = 1e-5;

    fn check_forward<T: Element>(x: &[f32], g: &[f32], b: &[f32]) -> Result<(), TestCaseError> {
        let (x, g, b) = (round::<T>(x), round::<T>(g), round::<T>(b));
        let (wx, wg, wb) = (widen_f64(&x), widen_f64(&g), widen_f64(&b));
        let d = g.len();
        let n = x.len() / d;
        let mut y = vec![T::default(); x.len()];
        let (mut mean, mut rstd) = (vec![0.0f32; n], vec![0.0f32; n]);
        layer_norm(&x, &g, &b, EPS, &mut y, &mut mean, &mut rstd).unwrap();
        let mut want = Vec::with_capacity(x.len());
        let (mut want_mean, mut want_rstd) = (Vec::new(), Vec::new());
        for row in wx.chunks(d) {
            let m = row.iter().sum::<f64>() / d as f64;
            let var = row.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / d as f64;
            let r = 1.0 / (var + f64::from(EPS)).sqrt();
            want.extend(row.iter().enumerate().map(|(j, v)| (v - m) * r * wg[j] + wb[j]));
            want_mean.push(m);
            want_rstd.push(r);
        }
        check_close(&widen_f64(&mean), &want_mean, 1e-5)?;
        check_close(&widen_f64(&rstd), &want_rstd, 1e-4)?;
        check_close(&widen_f64(&y), &want, tol::<T>())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        // y, mean and rstd match an f64 reference from the same rounded inputs, every type.
        #[test]
        fn forward_matches_f64_reference(
            (x, g, b) in (1usize..6, 2usize..40)
                .prop_flat_map(|(n, d)| (values(n * d), values(d), values(d)))
        ) {
            check_forward::<f32>(&x, &g, &b)?;
            check_forward::<f16>(&x, &g, &b)?;
            check_forward::<bf16>(&x, &g, &b)?;
        }

        // dx, dgamma and dbeta are the gradients of L = sum(layer_norm(x) * r).
        #[test]
        fn backward_matches_finite_differences(
            (x, g, b, r) in (1usize..4, 2usize..10)
                .prop_flat_map(|(n, d)| (values(n * d), values(d), values(d), values(n * d)))
        ) {
            let d = g.len();
            let n = x.len() / d;
            // Rows of nearly equal values make layer norm ill-conditioned for finite
            // differences; keep rows with a standard deviation of at least 0.5.
            for row in x.chunks(d) {
                let m = row.iter().sum::<f32>() / d as f32;
                let var = row.iter().map(|v| (v - m) * (v - m)).sum::<f32>() / d as f32;
                prop_assume!(var >= 0.25);
            }
            let loss = |x: &[f32], g: &[f32], b: &[f32]| {
                let mut y = vec![0.0f32; x.len()];
                let (mut m, mut s) = (vec![0.0f32; n], vec![0.0f32; n]);
                layer_norm(x, g, b, EPS, &mut y, &mut m, &mut s).unwrap();
                y.iter().zip(&r).map(|(&y, &r)| f64::from(y) * f64::from(r)).sum::<f64>()
            };
            let mut y = vec![0.0f32; x.len()];
            let (mut m, mut s) = (vec![0.0f32; n], vec![0.0f32; n]);
            layer_norm(&x, &g, &b, EPS, &mut y, &mut m, &mut s).unwrap();
            let mut dx = vec![0.0f32; x.len()];
            let (mut dg, mut db) = (vec![0.0f32; d], vec![0.0f32; d]);
            layer_norm_backward(&x, &g, &m, &s, &r, &mut dx, &mut dg, &mut db).unwrap();
            check_grad(|x| loss(x, &g, &b), &x, &dx, 5e-3, 1e-2)?;
            check_grad(|g| loss(&x, g, &b), &g, &dg, 1e-2, 1e-2)?;
            check_grad(|b| loss(&x, &g, b), &b, &db, 1e-2, 1e-2)?;
        }
    }
}
