//! Fused softmax + cross-entropy over rows (PyTorch's `cross_entropy` with mean reduction).
//!
//! Layout: `logits` and `dlogits` are row-major `[n, c]` with `n = targets.len()`; the saved
//! log-sum-exp `lse` is `[n]` in f32. Rows whose target equals the ignore index contribute
//! neither to the loss nor to the count it is averaged over, and get a zero gradient.

use super::fastmath::exp;
use super::matmul::matmul_f32;
use super::{check_len, widen_f32};
use crate::Element;
use crate::cpu::elementwise::PAR_THRESHOLD;
use crate::cpu::reduce;
use crate::error::{Error, Result};
use crate::params::MatmulSpec;
use rayon::prelude::*;
use std::any::TypeId;

/// Checks every target: each must be below `classes` or equal the ignore index. The first
/// that is not is an [`Error::IndexOutOfRange`] of `op`.
pub(crate) fn validate(
    op: &'static str,
    targets: &[u32],
    classes: usize,
    ignore: Option<u32>,
) -> Result<()> {
    match targets.iter().find(|&&t| Some(t) != ignore && t as usize >= classes) {
        Some(&t) => Err(Error::IndexOutOfRange { op, index: t as usize, bound: classes }),
        None => Ok(()),
    }
}

/// `log(sum_j exp(row[j]))`, shifted by the row maximum so that nothing overflows.
fn log_sum_exp<T: Element>(row: &[T]) -> f32 {
    let max = row.iter().map(|v| v.to_f32()).fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return max;
    }
    // The exponentials a block at a time, so that they vectorize (in the sum's loop they
    // would not); the sum adds them in row order all the same.
    let mut block = [0.0f32; 64];
    let mut sum = 0.0f32;
    for chunk in row.chunks(block.len()) {
        let e = &mut block[..chunk.len()];
        e.iter_mut().zip(chunk).for_each(|(e, v)| *e = exp(v.to_f32() - max));
        sum = e.iter().fold(sum, |s, &e| s + e);
    }
    max + sum.ln()
}

/// The classes `c` of `logits: [n, c]` for `n` targets, after checking the lengths.
fn classes(op: &'static str, logits: usize, rows: usize, lse: usize) -> Result<usize> {
    check_len(op, "lse", lse, rows)?;
    Ok(logits.checked_div(rows).unwrap_or(0))
}

/// Mean softmax cross-entropy of `logits` (`[n, c]`) against class indices `targets` (`[n]`).
///
/// Writes the per-row log-sum-exp into `lse` (`[n]`) for [`cross_entropy_backward`]. Returns
/// the loss averaged over the rows not ignored; NaN when every row is ignored (as in PyTorch).
///
/// # Errors
///
/// [`Error::IndexOutOfRange`] for a target not below `c` (nothing is written);
/// [`Error::InvalidArgument`] if `logits` is not whole rows of `n` targets or `lse` is not
/// `[n]`.
pub fn cross_entropy<T: Element>(
    logits: &[T],
    targets: &[u32],
    ignore_index: Option<u32>,
    lse: &mut [f32],
) -> Result<f32> {
    const OP: &str = "cpu::cross_entropy";
    let n = targets.len();
    let c = classes(OP, logits.len(), n, lse.len())?;
    check_len(OP, "the logits", logits.len(), n * c)?;
    validate(OP, targets, c, ignore_index)?;
    if c == 0 {
        // validate() guarantees every row is ignored here.
        return Ok(f32::NAN);
    }
    let mut losses = vec![0.0f32; n];
    row_losses(logits, c, targets, ignore_index, lse, &mut losses);
    Ok(reduce::sum(&losses) / counted(targets, ignore_index) as f32)
}

/// The rows whose target is not `ignore`: what the mean loss divides by.
pub(crate) fn counted(targets: &[u32], ignore: Option<u32>) -> usize {
    targets.iter().filter(|&&t| Some(t) != ignore).count()
}

/// Per-row log-sum-exp (`lse`) and loss (`losses`, 0 for an ignored row) of `logits: [n, c]`
/// for `n = targets.len()` validated targets and `c > 0`.
fn row_losses<T: Element>(
    logits: &[T],
    c: usize,
    targets: &[u32],
    ignore_index: Option<u32>,
    lse: &mut [f32],
    losses: &mut [f32],
) {
    let row_loss = |(row, ((&t, l), loss)): (&[T], ((&u32, &mut f32), &mut f32))| {
        *l = log_sum_exp(row);
        *loss = if Some(t) == ignore_index { 0.0 } else { *l - row[t as usize].to_f32() };
    };
    if logits.len() >= PAR_THRESHOLD {
        logits
            .par_chunks(c)
            .zip(targets.par_iter().zip(lse.par_iter_mut()).zip(losses.par_iter_mut()))
            .for_each(row_loss);
    } else {
        logits
            .chunks(c)
            .zip(targets.iter().zip(lse.iter_mut()).zip(losses.iter_mut()))
            .for_each(row_loss);
    }
}

/// Backward of [`cross_entropy`]: `dlogits[i, j] = dloss / count * (softmax(x_i)[j] - [j ==
/// t_i])` for rows not ignored, 0 for ignored rows, where `count` is the number of rows not
/// ignored and `dloss` the upstream gradient of the (scalar) loss. Overwrites `dlogits`.
///
/// # Errors
///
/// As [`cross_entropy`], and if `dlogits` is not the logits' length.
pub fn cross_entropy_backward<T: Element>(
    logits: &[T],
    targets: &[u32],
    ignore_index: Option<u32>,
    lse: &[f32],
    dloss: f32,
    dlogits: &mut [T],
) -> Result<()> {
    const OP: &str = "cpu::cross_entropy_backward";
    let n = targets.len();
    let c = classes(OP, logits.len(), n, lse.len())?;
    check_len(OP, "the logits", logits.len(), n * c)?;
    check_len(OP, "dlogits", dlogits.len(), n * c)?;
    validate(OP, targets, c, ignore_index)?;
    if c == 0 {
        return Ok(());
    }
    let g = dloss / counted(targets, ignore_index) as f32;
    grad_rows(logits, c, targets, ignore_index, lse, g, dlogits);
    Ok(())
}

/// `dlogits[i, j] = g * (softmax(x_i)[j] - [j == t_i])` (0 for ignored rows) from `logits:
/// [n, c]` (`c > 0`) and their log-sum-exp, targets validated.
fn grad_rows<T: Element, D: Element>(
    logits: &[T],
    c: usize,
    targets: &[u32],
    ignore_index: Option<u32>,
    lse: &[f32],
    g: f32,
    dlogits: &mut [D],
) {
    let row = |d: &mut [D], x: &[T], t: u32, l: f32| {
        if Some(t) == ignore_index {
            d.fill(D::from_f32(0.0));
            return;
        }
        for (j, (o, &v)) in d.iter_mut().zip(x).enumerate() {
            let p = exp(v.to_f32() - l);
            let onehot = if j == t as usize { 1.0 } else { 0.0 };
            *o = D::from_f32(g * (p - onehot));
        }
    };
    if logits.len() >= PAR_THRESHOLD {
        dlogits
            .par_chunks_mut(c)
            .zip(logits.par_chunks(c))
            .zip(targets.par_iter().zip(lse.par_iter()))
            .for_each(|((d, x), (&t, &l))| row(d, x, t, l));
    } else {
        dlogits
            .chunks_mut(c)
            .zip(logits.chunks(c))
            .zip(targets.iter().zip(lse.iter()))
            .for_each(|((d, x), (&t, &l))| row(d, x, t, l));
    }
}

/// The LM head and its cross-entropy fused (see `ops::linear_cross_entropy`): the mean loss
/// of `logits = hidden * weight^T` against `targets`, with its gradients for the upstream
/// gradient `dloss`, over chunks of `chunk_rows` rows so that no more than one chunk's logits
/// exist at a time. `hidden: [n, d]`, `weight: [vocab, d]`, `n = targets.len()`;
/// `grad_hidden` (`[n, d]`) and `grad_weight` (`[vocab, d]`, in its own element type `G`)
/// are overwritten.
///
/// Per chunk: the logits in f32 (the product of the `T` operands accumulated in f32, not
/// rounded to `T`), each row's log-sum-exp and loss as [`cross_entropy`] computes them, the
/// logits' gradient `dloss / count * (softmax - onehot)` rounded to `T` (the dtype the
/// products take), then `grad_hidden[chunk] = dlogits * weight` and `grad_weight +=
/// dlogits^T * hidden[chunk]` in f32, rounded to `G` once at the end. `count` is the number
/// of rows not ignored over all rows, so the loss and gradients are the unchunked ones: the
/// loss is the f32 sum of the per-row losses in row order over `count`, as
/// [`cross_entropy`]'s. Returns the loss: NaN when every row is ignored (the gradients are
/// then 0) or `n == 0`.
///
/// # Errors
///
/// [`Error::IndexOutOfRange`] for a target not below `vocab` and not ignored;
/// [`Error::InvalidArgument`] if a slice does not fit the layout. Nothing is written then.
#[allow(clippy::too_many_arguments)]
pub fn linear_cross_entropy<T: Element, G: Element>(
    hidden: &[T],
    weight: &[T],
    targets: &[u32],
    ignore_index: Option<u32>,
    dloss: f32,
    (vocab, d): (usize, usize),
    chunk_rows: usize,
    grad_hidden: &mut [T],
    grad_weight: &mut [G],
) -> Result<f32> {
    const OP: &str = "cpu::linear_cross_entropy";
    let n = targets.len();
    check_len(OP, "hidden", hidden.len(), n * d)?;
    check_len(OP, "weight", weight.len(), vocab * d)?;
    check_len(OP, "grad_hidden", grad_hidden.len(), n * d)?;
    check_len(OP, "grad_weight", grad_weight.len(), vocab * d)?;
    validate(OP, targets, vocab, ignore_index)?;
    if n == 0 || vocab == 0 {
        grad_hidden.fill(T::from_f32(0.0));
        grad_weight.fill(G::from_f32(0.0));
        return Ok(f32::NAN);
    }
    let chunk = chunk_rows.clamp(1, n);
    let count = counted(targets, ignore_index);
    let g = dloss / count as f32;
    let (h, w) = (widen_f32(hidden), widen_f32(weight));
    let rounds = TypeId::of::<T>() != TypeId::of::<f32>();
    let (mut lse, mut losses) = (vec![0.0f32; n], vec![0.0f32; n]);
    let mut logits = vec![0.0f32; chunk * vocab];
    let mut dlogits = vec![0.0f32; chunk * vocab];
    let mut gh = vec![0.0f32; chunk * d];
    let mut gw = vec![0.0f32; vocab * d];
    for (i, r0) in (0..n).step_by(chunk).enumerate() {
        let rows = chunk.min(n - r0);
        let (h, t) = (&h[r0 * d..(r0 + rows) * d], &targets[r0..r0 + rows]);
        let (x, dx) = (&mut logits[..rows * vocab], &mut dlogits[..rows * vocab]);
        matmul_f32(&MatmulSpec::new(rows, vocab, d).transpose(false, true), h, &w, x);
        let (l, loss) = (&mut lse[r0..r0 + rows], &mut losses[r0..r0 + rows]);
        row_losses(x, vocab, t, ignore_index, l, loss);
        grad_rows(x, vocab, t, ignore_index, l, g, dx);
        if rounds {
            dx.iter_mut().for_each(|v| *v = T::from_f32(*v).to_f32());
        }
        let gh = &mut gh[..rows * d];
        matmul_f32(&MatmulSpec::new(rows, d, vocab), dx, &w, gh);
        for (o, v) in grad_hidden[r0 * d..(r0 + rows) * d].iter_mut().zip(gh.iter()) {
            *o = T::from_f32(*v);
        }
        let beta = if i == 0 { 0.0 } else { 1.0 };
        let spec = MatmulSpec::new(vocab, d, rows).transpose(true, false).scaled(1.0, beta);
        matmul_f32(&spec, dx, h, &mut gw);
    }
    for (o, v) in grad_weight.iter_mut().zip(gw) {
        *o = G::from_f32(v);
    }
    Ok(reduce::sum(&losses) / count as f32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::elementwise::testing::*;
    use crate::cpu::widen_f64;
    use half::{bf16, f16};
    use proptest::prelude::*;
    use proptest::test_runner::TestCaseError;

    /// Logits, targets (some equal to `IGNORE`), for `n` rows of `c` classes.
    fn case() -> impl Strategy<Value = (Vec<f32>, Vec<u32>, usize)> {
        (1usize..8, 1usize..12).prop_flat_map(|(n, c)| {
            let target = prop_oneof![4 => 0..c as u32, 1 => Just(IGNORE)];
            (prop::collection::vec(-8.0f32..8.0, n * c), prop::collection::vec(target, n), Just(c))
        })
    }

    const IGNORE: u32 = u32::MAX;

    fn reference(x: &[f64], t: &[u32], c: usize) -> f64 {
        let (mut total, mut count) = (0.0, 0usize);
        for (row, &t) in x.chunks(c).zip(t) {
            if t == IGNORE {
                continue;
            }
            let lse = row.iter().map(|v| v.exp()).sum::<f64>().ln();
            total += lse - row[t as usize];
            count += 1;
        }
        total / count as f64
    }

    fn check_forward<T: Element>(x: &[f32], t: &[u32], c: usize) -> Result<(), TestCaseError> {
        let x = round::<T>(x);
        let mut lse = vec![0.0f32; t.len()];
        let got = cross_entropy(&x, t, Some(IGNORE), &mut lse).unwrap();
        let want = reference(&widen_f64(&x), t, c);
        if want.is_nan() {
            prop_assert!(got.is_nan());
            return Ok(());
        }
        check_close(&[f64::from(got)], &[want], tol::<f32>())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        // The loss matches an f64 reference from the same rounded logits, every type,
        // with ignored rows left out of the mean.
        #[test]
        fn forward_matches_f64_reference((x, t, c) in case()) {
            check_forward::<f32>(&x, &t, c)?;
            check_forward::<f16>(&x, &t, c)?;
            check_forward::<bf16>(&x, &t, c)?;
        }

        // dlogits is the gradient of L = loss * r for an upstream scalar r.
        #[test]
        fn backward_matches_finite_differences((x, t, _c) in case(), r in -2.0f32..2.0) {
            prop_assume!(t.iter().any(|&t| t != IGNORE));
            let mut lse = vec![0.0f32; t.len()];
            let loss = |x: &[f32]| {
                let mut lse = vec![0.0f32; t.len()];
                f64::from(cross_entropy(x, &t, Some(IGNORE), &mut lse).unwrap()) * f64::from(r)
            };
            cross_entropy(&x, &t, Some(IGNORE), &mut lse).unwrap();
            let mut dx = vec![0.0f32; x.len()];
            cross_entropy_backward(&x, &t, Some(IGNORE), &lse, r, &mut dx).unwrap();
            check_grad(loss, &x, &dx, 1e-2, 1e-2)?;
        }

        // Any target >= c that is not the ignore index is reported, never a panic.
        #[test]
        fn out_of_range_target_is_an_error((x, mut t, c) in case(), row in any::<prop::sample::Index>(), over in 0u32..5) {
            let row = row.index(t.len());
            t[row] = c as u32 + over;
            let mut lse = vec![0.0f32; t.len()];
            let err = cross_entropy(&x, &t, None, &mut lse).unwrap_err();
            let bounded = matches!(err, Error::IndexOutOfRange { bound, index, .. } if bound == c && index >= c);
            prop_assert!(bounded, "{}", err);
            let mut dx = vec![0.0f32; x.len()];
            prop_assert!(cross_entropy_backward(&x, &t, None, &lse, 1.0, &mut dx).is_err());
        }
    }

    #[test]
    fn all_rows_ignored_gives_nan_loss_and_zero_gradient() {
        let x = [1.0f32, 2.0, 3.0, 4.0];
        let t = [7u32, 7];
        let mut lse = [0.0f32; 2];
        assert!(cross_entropy(&x, &t, Some(7), &mut lse).unwrap().is_nan());
        let mut dx = [1.0f32; 4];
        cross_entropy_backward(&x, &t, Some(7), &lse, 1.0, &mut dx).unwrap();
        assert_eq!(dx, [0.0; 4]);
    }

    #[test]
    fn lengths_that_do_not_fit_the_layout_are_errors_not_panics() {
        let x = [1.0f32, 2.0, 3.0];
        let mut lse = [0.0f32; 2];
        assert!(cross_entropy(&x, &[0, 1], None, &mut lse).is_err(), "3 logits for 2 rows");
        assert!(cross_entropy(&x, &[], None, &mut []).is_err(), "logits for no rows");
        assert!(cross_entropy(&x[..2], &[0, 1], None, &mut lse[..1]).is_err(), "short lse");
        let mut dx = [0.0f32; 1];
        assert!(cross_entropy_backward(&x[..2], &[0, 1], None, &lse, 1.0, &mut dx).is_err());
    }

    #[test]
    fn large_logits_do_not_overflow() {
        let x = [1000.0f32, 0.0];
        let mut lse = [0.0f32];
        let loss = cross_entropy(&x, &[1], None, &mut lse).unwrap();
        assert_eq!(loss, 1000.0);
    }
}
