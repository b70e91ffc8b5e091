//! Softmax over the last dimension on the host, plain and causally masked (attention),
//! forward and backward. Each row subtracts its maximum before `exp`, so large logits do
//! not overflow; a row whose entries are all `-inf` has no defined softmax and gives NaN.

use super::fastmath::exp;
use super::{check_len, rows_of, widen_f32, with_f32_out};
use crate::dtype::Element;
use crate::error::Result;
use rayon::prelude::*;

/// Rows per rayon task are chosen so that a task touches at least this many elements.
const MIN_TASK_ELEMENTS: usize = 1 << 14;

/// Row softmax: `x` and `y` are `[rows, cols]` row-major,
/// `y[r, j] = exp(x[r, j] - max_r) / sum_j exp(x[r, j] - max_r)`.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if the lengths differ or are
/// not whole rows.
pub fn softmax<T: Element>(x: &[T], y: &mut [T], cols: usize) -> Result<()> {
    check("cpu::softmax", x.len(), y.len(), None, cols)?;
    rowwise(x, y, cols, |_| cols, softmax_row);
    Ok(())
}

/// Checks `x`, `y` (and `dy`) of one length, whole rows of `cols`.
fn check(op: &'static str, x: usize, y: usize, dy: Option<usize>, cols: usize) -> Result<()> {
    check_len(op, "the output", y, x)?;
    if let Some(dy) = dy {
        check_len(op, "dy", dy, x)?;
    }
    rows_of(op, "the input", x, cols).map(|_| ())
}

/// Gradient of [`softmax`] from its output `y` and `dy` (all `[rows, cols]`):
/// `dx[r, j] = y[r, j] * (dy[r, j] - sum_k dy[r, k] * y[r, k])`. Overwrites `dx`.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if the lengths differ or are
/// not whole rows.
pub fn softmax_backward<T: Element>(y: &[T], dy: &[T], dx: &mut [T], cols: usize) -> Result<()> {
    check("cpu::softmax_backward", y.len(), dx.len(), Some(dy.len()), cols)?;
    rowwise_backward(y, dy, dx, cols, |_| cols);
    Ok(())
}

/// Causal softmax for attention scores `x: [batch * heads, seq, seq]`: row `i` of each
/// matrix is a softmax over keys `j <= i`, and `y[.., i, j] = 0` for `j > i` (the mask is
/// implied, `x` there is never read).
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if the lengths differ or are
/// not whole rows.
pub fn causal_softmax<T: Element>(x: &[T], y: &mut [T], seq: usize) -> Result<()> {
    check("cpu::causal_softmax", x.len(), y.len(), None, seq.saturating_mul(seq))?;
    rowwise(x, y, seq, |row| row % seq + 1, softmax_row);
    Ok(())
}

/// Gradient of [`causal_softmax`] from its output `y` and `dy` (all `[batch * heads, seq,
/// seq]`): the softmax gradient over `j <= i`, zero for `j > i`. Overwrites `dx`.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if the lengths differ or are
/// not whole rows.
pub fn causal_softmax_backward<T: Element>(
    y: &[T],
    dy: &[T],
    dx: &mut [T],
    seq: usize,
) -> Result<()> {
    check(
        "cpu::causal_softmax_backward",
        y.len(),
        dx.len(),
        Some(dy.len()),
        seq.saturating_mul(seq),
    )?;
    rowwise_backward(y, dy, dx, seq, |row| row % seq + 1);
    Ok(())
}

/// Runs `f(x_row, y_row)` on every row, with the row cut to its first `valid(row)` entries
/// and the rest of `y`'s row zeroed.
fn rowwise<T: Element>(
    x: &[T],
    y: &mut [T],
    cols: usize,
    valid: impl Fn(usize) -> usize + Sync,
    f: fn(&[f32], &mut [f32]),
) {
    if y.is_empty() {
        return;
    }
    let x = widen_f32(x);
    with_f32_out(y, |y| {
        y.par_chunks_mut(cols)
            .zip(x.par_chunks(cols))
            .with_min_len(MIN_TASK_ELEMENTS / cols + 1)
            .enumerate()
            .for_each(|(row, (y, x))| {
                let n = valid(row);
                f(&x[..n], &mut y[..n]);
                y[n..].fill(0.0);
            });
    });
}

fn softmax_row(x: &[f32], y: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // The exponentials in a pass of their own, so that they vectorize (a running sum in the
    // same loop would keep them scalar); the sum then adds them in the same order.
    y.iter_mut().zip(x).for_each(|(y, &x)| *y = exp(x - max));
    let sum: f32 = y.iter().sum();
    let inv = 1.0 / sum;
    y.iter_mut().for_each(|y| *y *= inv);
}

fn rowwise_backward<T: Element>(
    y: &[T],
    dy: &[T],
    dx: &mut [T],
    cols: usize,
    valid: impl Fn(usize) -> usize + Sync,
) {
    if dx.is_empty() {
        return;
    }
    let (y, dy) = (widen_f32(y), widen_f32(dy));
    with_f32_out(dx, |dx| {
        dx.par_chunks_mut(cols)
            .zip(y.par_chunks(cols).zip(dy.par_chunks(cols)))
            .with_min_len(MIN_TASK_ELEMENTS / cols + 1)
            .enumerate()
            .for_each(|(row, (dx, (y, dy)))| {
                let n = valid(row);
                let dot: f32 = y[..n].iter().zip(&dy[..n]).map(|(y, g)| y * g).sum();
                for ((dx, &y), &g) in dx.iter_mut().zip(y).zip(dy).take(n) {
                    *dx = y * (g - dot);
                }
                dx[n..].fill(0.0);
            });
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::elementwise::testing::{assert_close, finite_diff_sum as finite_diff};
    use crate::cpu::widen_f64;
    use half::{bf16, f16};
    use proptest::prelude::*;

    /// f64 softmax of each row over its first `valid(row)` entries, zeros after them.
    fn reference(x: &[f64], cols: usize, valid: impl Fn(usize) -> usize) -> Vec<f64> {
        let mut y = vec![0.0; x.len()];
        for (row, (x, y)) in x.chunks(cols).zip(y.chunks_mut(cols)).enumerate() {
            let n = valid(row);
            let sum: f64 = x[..n].iter().map(|v| v.exp()).sum();
            for j in 0..n {
                y[j] = x[j].exp() / sum;
            }
        }
        y
    }

    fn check<T: Element>(x: &[f32], cols: usize, causal: bool, tol: f64) {
        let x: Vec<T> = x.iter().map(|&v| T::from_f32(v)).collect();
        let mut y = vec![T::default(); x.len()];
        let want = if causal {
            causal_softmax(&x, &mut y, cols).unwrap();
            reference(&widen_f64(&x), cols, |r| r % cols + 1)
        } else {
            softmax(&x, &mut y, cols).unwrap();
            reference(&widen_f64(&x), cols, |_| cols)
        };
        assert_close(&widen_f64(&y), &want, tol, "y");
    }

    /// `(cols, x, r)` with `x` and `r` of `rows * cols` values in [-2, 2]; for the causal
    /// case `cols` is `seq` and rows is a multiple of it.
    fn case(causal: bool) -> impl Strategy<Value = (usize, Vec<f32>, Vec<f32>)> {
        (1..=9usize, 1..=4usize).prop_flat_map(move |(cols, mats)| {
            let len = if causal { mats * cols * cols } else { mats * cols };
            let v = || prop::collection::vec(-2.0f32..2.0, len);
            (Just(cols), v(), v())
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        // Property: softmax equals the f64 definition (1e-5 in f32, 1e-2 in f16/bf16 on the
        // rounded inputs).
        #[test]
        fn softmax_matches_f64_reference_in_every_dtype((cols, x, _r) in case(false)) {
            check::<f32>(&x, cols, false, 1e-5);
            check::<f16>(&x, cols, false, 1e-2);
            check::<bf16>(&x, cols, false, 1e-2);
        }

        // Property: causal softmax equals the f64 softmax over j <= i, and exactly 0 above
        // the diagonal.
        #[test]
        fn causal_softmax_matches_f64_reference_in_every_dtype((seq, x, _r) in case(true)) {
            check::<f32>(&x, seq, true, 1e-5);
            check::<f16>(&x, seq, true, 1e-2);
            check::<bf16>(&x, seq, true, 1e-2);
        }

        // Property: softmax_backward equals central finite differences of sum(y * r).
        #[test]
        fn softmax_backward_matches_finite_differences((cols, x, r) in case(false)) {
            let fd = finite_diff(&x, &r, |x, y| softmax(x, y, cols).unwrap());
            let mut y = vec![0.0f32; x.len()];
            softmax(&x, &mut y, cols).unwrap();
            let mut dx = vec![f32::NAN; x.len()];
            softmax_backward(&y, &r, &mut dx, cols).unwrap();
            assert_close(&widen_f64(&dx), &fd, 1e-2, "dx");
        }

        // Property: causal_softmax_backward equals central finite differences of
        // sum(y * r); in particular the masked scores get a zero gradient.
        #[test]
        fn causal_softmax_backward_matches_finite_differences((seq, x, r) in case(true)) {
            let fd = finite_diff(&x, &r, |x, y| causal_softmax(x, y, seq).unwrap());
            let mut y = vec![0.0f32; x.len()];
            causal_softmax(&x, &mut y, seq).unwrap();
            let mut dx = vec![f32::NAN; x.len()];
            causal_softmax_backward(&y, &r, &mut dx, seq).unwrap();
            assert_close(&widen_f64(&dx), &fd, 1e-2, "dx");
        }
    }

    #[test]
    fn softmax_of_huge_logits_does_not_overflow() {
        let mut y = [0.0f32; 3];
        softmax(&[1000.0f32, 1000.0, f32::NEG_INFINITY], &mut y, 3).unwrap();
        assert_eq!(y, [0.5, 0.5, 0.0]);
    }

    #[test]
    fn causal_softmax_ignores_masked_scores_even_when_nan() {
        let mut y = [1.0f32; 4];
        causal_softmax(&[0.0f32, f32::NAN, 2.0, 2.0], &mut y, 2).unwrap();
        assert_eq!(y, [1.0, 0.0, 0.5, 0.5]);
    }
}
