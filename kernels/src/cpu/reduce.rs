//! Sum and mean reductions (whole tensor and over the last dimension) and their backward.
//!
//! Accumulation is in f32 with pairwise summation over blocks, so the rounding error grows
//! with `log(n)` rather than `n`; results are deterministic for a given length. Last-dim
//! reductions take `x` row-major `[n, d]` and write `out[n]`.

use crate::Element;
use crate::cpu::elementwise::{PAR_CHUNK, PAR_THRESHOLD};
use crate::error::{Error, Result};
use rayon::prelude::*;

/// Block length below which summation is a plain (8-lane) loop.
const BLOCK: usize = 128;

/// Pairwise sum in f32: eight interleaved accumulators within a block, halving above.
fn pairwise<T: Element>(x: &[T]) -> f32 {
    if x.len() <= BLOCK {
        let mut lanes = [0.0f32; 8];
        let chunks = x.chunks_exact(8);
        let rest = chunks.remainder();
        for c in chunks {
            for (l, &v) in lanes.iter_mut().zip(c) {
                *l += v.to_f32();
            }
        }
        for (l, &v) in lanes.iter_mut().zip(rest) {
            *l += v.to_f32();
        }
        ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
            + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))
    } else {
        let mid = x.len() / 2;
        pairwise(&x[..mid]) + pairwise(&x[mid..])
    }
}

/// Sum of all elements, accumulated in f32 (0 for an empty slice).
pub fn sum<T: Element>(x: &[T]) -> f32 {
    if x.len() >= PAR_THRESHOLD {
        let partials: Vec<f32> = x.par_chunks(PAR_CHUNK).map(pairwise).collect();
        pairwise(&partials)
    } else {
        pairwise(x)
    }
}

/// Mean of all elements, in f32 (NaN for an empty slice, as in PyTorch).
pub fn mean<T: Element>(x: &[T]) -> f32 {
    sum(x) / x.len() as f32
}

/// Applies `f(row_sum)` to every row of `x` (`[n, d]`, `d = x.len() / out.len()`).
fn reduce_rows<T: Element>(
    op: &'static str,
    x: &[T],
    out: &mut [T],
    f: impl Fn(f32) -> f32 + Sync,
) -> Result<()> {
    let n = out.len();
    let d = row_len(op, x.len(), n)?;
    if n == 0 {
        return Ok(());
    }
    if d == 0 {
        out.fill(T::from_f32(f(0.0)));
        return Ok(());
    }
    if x.len() >= PAR_THRESHOLD {
        out.par_iter_mut()
            .zip(x.par_chunks(d))
            .for_each(|(o, row)| *o = T::from_f32(f(pairwise(row))));
    } else {
        for (o, row) in out.iter_mut().zip(x.chunks_exact(d)) {
            *o = T::from_f32(f(pairwise(row)));
        }
    }
    Ok(())
}

/// The row length `d` of `[n, d]` holding `len` elements; an error unless `len` is a
/// multiple of `n` (for `n == 0`, unless `len == 0`).
fn row_len(op: &'static str, len: usize, n: usize) -> Result<usize> {
    match len.checked_div(n) {
        Some(d) if len.is_multiple_of(n) => Ok(d),
        None if len == 0 => Ok(0),
        _ => Err(Error::InvalidArgument {
            op,
            reason: format!("{len} elements are not {n} rows of equal length"),
        }),
    }
}

/// Row sums: `out[i] = sum_j x[i, j]`, `x` row-major `[n, d]`, `n = out.len()`.
///
/// # Errors
///
/// [`Error::InvalidArgument`] unless `x` is `out.len()` rows of equal length.
pub fn sum_last_dim<T: Element>(x: &[T], out: &mut [T]) -> Result<()> {
    reduce_rows("cpu::sum_last_dim", x, out, |s| s)
}

/// Row means: `out[i] = sum_j x[i, j] / d`, `x` row-major `[n, d]`, `n = out.len()`.
///
/// # Errors
///
/// As [`sum_last_dim`].
pub fn mean_last_dim<T: Element>(x: &[T], out: &mut [T]) -> Result<()> {
    let d = x.len().checked_div(out.len()).unwrap_or(0);
    let inv = 1.0 / d as f32;
    reduce_rows("cpu::mean_last_dim", x, out, |s| s * inv)
}

/// Backward of [`sum`]: every `dx[i] = dy` (overwrites `dx`).
pub fn sum_backward<T: Element>(dy: f32, dx: &mut [T]) {
    dx.fill(T::from_f32(dy));
}

/// Backward of [`mean`]: every `dx[i] = dy / n` with `n = dx.len()` (overwrites `dx`).
pub fn mean_backward<T: Element>(dy: f32, dx: &mut [T]) {
    let n = dx.len() as f32;
    dx.fill(T::from_f32(dy / n));
}

/// Broadcasts `dy[i] * factor` over row `i` of `dx` (`[n, d]`, `n = dy.len()`).
fn broadcast_rows<T: Element>(dy: &[T], factor: f32, dx: &mut [T]) {
    let d = dx.len().checked_div(dy.len()).unwrap_or(0);
    if d == 0 {
        return;
    }
    for (row, &g) in dx.chunks_exact_mut(d).zip(dy) {
        row.fill(T::from_f32(g.to_f32() * factor));
    }
}

/// Backward of [`sum_last_dim`]: `dx[i, j] = dy[i]`, `dx` row-major `[n, d]`, `n = dy.len()`.
///
/// # Errors
///
/// [`Error::InvalidArgument`] unless `dx` is `dy.len()` rows of equal length.
pub fn sum_last_dim_backward<T: Element>(dy: &[T], dx: &mut [T]) -> Result<()> {
    row_len("cpu::sum_last_dim_backward", dx.len(), dy.len())?;
    broadcast_rows(dy, 1.0, dx);
    Ok(())
}

/// Backward of [`mean_last_dim`]: `dx[i, j] = dy[i] / d`, `dx` row-major `[n, d]`,
/// `n = dy.len()`.
///
/// # Errors
///
/// As [`sum_last_dim_backward`].
pub fn mean_last_dim_backward<T: Element>(dy: &[T], dx: &mut [T]) -> Result<()> {
    let d = row_len("cpu::mean_last_dim_backward", dx.len(), dy.len())?;
    broadcast_rows(dy, 1.0 / d as f32, dx);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::elementwise::testing::*;
    use crate::cpu::widen_f64;
    use half::{bf16, f16};
    use proptest::prelude::*;
    use proptest::test_runner::TestCaseError;

    /// Fails unless `|got - want| <= tol * max(1, |want|) + e`, where `e` is the error
    /// bound of pairwise summation in f32 (the accumulation type) over `count` terms of
    /// total magnitude `scale`: `eps * (ceil(log2 count) + 1) * scale`. A sum is accurate
    /// relative to the magnitudes it adds, not to a result that cancellation made small.
    fn check_reduction(
        got: &[f64],
        want: &[f64],
        scale: &[f64],
        count: usize,
        tol: f64,
    ) -> Result<(), TestCaseError> {
        let steps = (count.max(1) as f64).log2().ceil() + 1.0;
        for (i, ((&g, &w), &s)) in got.iter().zip(want).zip(scale).enumerate() {
            let bound = tol * w.abs().max(1.0) + f64::from(f32::EPSILON) * steps * s;
            prop_assert!((g - w).abs() <= bound, "index {i}: got {g}, want {w}, bound {bound}");
        }
        Ok(())
    }

    fn check_forward<T: Element>(x: &[f32], n: usize, d: usize) -> Result<(), TestCaseError> {
        let x = round::<T>(x);
        let wx = widen_f64(&x);
        let total: f64 = wx.iter().sum();
        let magnitude: f64 = wx.iter().map(|v| v.abs()).sum();
        check_reduction(&[f64::from(sum(&x))], &[total], &[magnitude], x.len(), tol::<f32>())?;
        if !x.is_empty() {
            let len = x.len() as f64;
            check_reduction(
                &[f64::from(mean(&x))],
                &[total / len],
                &[magnitude / len],
                x.len(),
                tol::<f32>(),
            )?;
        }
        let row_sums: Vec<f64> = (0..n).map(|i| wx[i * d..(i + 1) * d].iter().sum()).collect();
        let row_mags: Vec<f64> =
            (0..n).map(|i| wx[i * d..(i + 1) * d].iter().map(|v| v.abs()).sum()).collect();
        let mut out = vec![T::default(); n];
        sum_last_dim(&x, &mut out).unwrap();
        check_reduction(&widen_f64(&out), &row_sums, &row_mags, d, tol::<T>())?;
        mean_last_dim(&x, &mut out).unwrap();
        let row_means: Vec<f64> = row_sums.iter().map(|s| s / d as f64).collect();
        let mean_mags: Vec<f64> = row_mags.iter().map(|s| s / d as f64).collect();
        check_reduction(&widen_f64(&out), &row_means, &mean_mags, d, tol::<T>())
    }

    fn weighted(y: &[f32], r: &[f32]) -> f64 {
        y.iter().zip(r).map(|(&y, &r)| f64::from(y) * f64::from(r)).sum()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        // Whole-tensor and last-dim sums and means match an f64 reference, every type.
        #[test]
        fn forward_matches_f64_reference(
            (x, n, d) in (1usize..8, 1usize..300)
                .prop_flat_map(|(n, d)| (values(n * d), Just(n), Just(d)))
        ) {
            check_forward::<f32>(&x, n, d)?;
            check_forward::<f16>(&x, n, d)?;
            check_forward::<bf16>(&x, n, d)?;
        }

        // The last-dim backward ops are the gradients of L = sum(reduce(x) * r), and the
        // whole-tensor ones of L = reduce(x) * r.
        #[test]
        fn backward_matches_finite_differences(
            (x, r, n) in (1usize..5, 1usize..9)
                .prop_flat_map(|(n, d)| (values(n * d), values(n), Just(n)))
        ) {
            let mut dx = vec![0.0f32; x.len()];
            sum_last_dim_backward(&r, &mut dx).unwrap();
            let loss = |x: &[f32]| {
                let mut y = vec![0.0f32; n];
                sum_last_dim(x, &mut y).unwrap();
                weighted(&y, &r)
            };
            check_grad(loss, &x, &dx, 1e-2, 1e-2)?;
            mean_last_dim_backward(&r, &mut dx).unwrap();
            let loss = |x: &[f32]| {
                let mut y = vec![0.0f32; n];
                mean_last_dim(x, &mut y).unwrap();
                weighted(&y, &r)
            };
            check_grad(loss, &x, &dx, 1e-2, 1e-2)?;
            sum_backward(r[0], &mut dx);
            check_grad(|x| f64::from(sum(x)) * f64::from(r[0]), &x, &dx, 1e-2, 1e-2)?;
            mean_backward(r[0], &mut dx);
            check_grad(|x| f64::from(mean(x)) * f64::from(r[0]), &x, &dx, 1e-2, 1e-2)?;
        }
    }

    #[test]
    fn large_sum_of_ones_is_exact_where_naive_f32_summation_stalls() {
        // Naive f32 accumulation stops growing at 2^24; pairwise summation does not.
        let n = (1usize << 24) + 4096;
        let x = vec![1.0f32; n];
        assert_eq!(sum(&x), n as f32);
    }

    #[test]
    fn empty_inputs_give_zero_sum_and_nan_mean() {
        let x: [f32; 0] = [];
        assert_eq!(sum(&x), 0.0);
        assert!(mean(&x).is_nan());
    }
}
