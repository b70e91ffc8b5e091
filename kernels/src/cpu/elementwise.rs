//! Elementwise arithmetic, bias broadcasting, fills, dtype casts and gradient accumulation.
//!
//! Every op reads its inputs as f32, computes in f32 and rounds once when it stores. Unless a
//! function says otherwise, all slices have the same length and are contiguous; the `[n, d]`
//! layouts are row-major (the last dimension is contiguous).

use super::{check_len, rows_of};
use crate::Element;
use crate::error::Result;
use rayon::prelude::*;

/// Below this many elements a plain loop beats rayon's scheduling overhead.
pub(crate) const PAR_THRESHOLD: usize = 1 << 16;

/// Items of `size` values each per rayon task (`with_min_len`), so that inputs below
/// [`PAR_THRESHOLD`] values run on one thread.
pub(crate) fn min_items_per_task(size: usize) -> usize {
    (PAR_THRESHOLD / size.max(1)).max(1)
}

/// Elements per rayon task once an op runs in parallel.
pub(crate) const PAR_CHUNK: usize = 1 << 14;

/// `out[i] = f(a[i])`, in parallel chunks for large inputs.
pub(crate) fn map_into<A, O, F>(a: &[A], out: &mut [O], f: F)
where
    A: Copy + Sync,
    O: Send,
    F: Fn(A) -> O + Sync,
{
    debug_assert_eq!(a.len(), out.len());
    let run = |a: &[A], out: &mut [O]| {
        for (o, &x) in out.iter_mut().zip(a) {
            *o = f(x);
        }
    };
    if out.len() >= PAR_THRESHOLD {
        out.par_chunks_mut(PAR_CHUNK).zip(a.par_chunks(PAR_CHUNK)).for_each(|(o, a)| run(a, o));
    } else {
        run(a, out);
    }
}

/// `out[i] = f(a[i], b[i])`, in parallel chunks for large inputs.
pub(crate) fn zip_map_into<A, B, O, F>(a: &[A], b: &[B], out: &mut [O], f: F)
where
    A: Copy + Sync,
    B: Copy + Sync,
    O: Send,
    F: Fn(A, B) -> O + Sync,
{
    debug_assert_eq!(a.len(), out.len());
    debug_assert_eq!(b.len(), out.len());
    let run = |a: &[A], b: &[B], out: &mut [O]| {
        for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
            *o = f(x, y);
        }
    };
    if out.len() >= PAR_THRESHOLD {
        out.par_chunks_mut(PAR_CHUNK)
            .zip(a.par_chunks(PAR_CHUNK))
            .zip(b.par_chunks(PAR_CHUNK))
            .for_each(|((o, a), b)| run(a, b, o));
    } else {
        run(a, b, out);
    }
}

/// `acc[i] = f(acc[i], a[i])`, in parallel chunks for large inputs.
pub(crate) fn update_with<O, A, F>(acc: &mut [O], a: &[A], f: F)
where
    O: Copy + Send,
    A: Copy + Sync,
    F: Fn(O, A) -> O + Sync,
{
    debug_assert_eq!(a.len(), acc.len());
    let run = |acc: &mut [O], a: &[A]| {
        for (o, &x) in acc.iter_mut().zip(a) {
            *o = f(*o, x);
        }
    };
    if acc.len() >= PAR_THRESHOLD {
        acc.par_chunks_mut(PAR_CHUNK).zip(a.par_chunks(PAR_CHUNK)).for_each(|(o, a)| run(o, a));
    } else {
        run(acc, a);
    }
}

/// `out = a + b`.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if the lengths do not fit.
pub fn add<T: Element>(a: &[T], b: &[T], out: &mut [T]) -> Result<()> {
    check_len("cpu::add", "b", b.len(), a.len())?;
    check_len("cpu::add", "out", out.len(), a.len())?;
    zip_map_into(a, b, out, |x, y| T::from_f32(x.to_f32() + y.to_f32()));
    Ok(())
}

/// `out = a * b` (elementwise product).
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if the lengths do not fit.
pub fn mul<T: Element>(a: &[T], b: &[T], out: &mut [T]) -> Result<()> {
    check_len("cpu::mul", "b", b.len(), a.len())?;
    check_len("cpu::mul", "out", out.len(), a.len())?;
    zip_map_into(a, b, out, |x, y| T::from_f32(x.to_f32() * y.to_f32()));
    Ok(())
}

/// `out = alpha * x`.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if the lengths do not fit.
pub fn scale<T: Element>(x: &[T], alpha: f32, out: &mut [T]) -> Result<()> {
    check_len("cpu::scale", "out", out.len(), x.len())?;
    map_into(x, out, |v| T::from_f32(alpha * v.to_f32()));
    Ok(())
}

/// `y += alpha * x` (BLAS axpy). `x` may have a different element type than `y`, so a
/// low-precision update can be applied to f32 master data directly.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if the lengths do not fit.
pub fn axpy<X: Element, Y: Element>(alpha: f32, x: &[X], y: &mut [Y]) -> Result<()> {
    check_len("cpu::axpy", "y", y.len(), x.len())?;
    update_with(y, x, |acc, v| Y::from_f32(acc.to_f32() + alpha * v.to_f32()));
    Ok(())
}

/// `acc += x`: gradient accumulation. `acc` and `x` may differ in element type (for example
/// f16 micro-batch gradients accumulated into an f32 buffer).
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if the lengths do not fit.
pub fn add_assign<A: Element, X: Element>(acc: &mut [A], x: &[X]) -> Result<()> {
    check_len("cpu::add_assign", "acc", acc.len(), x.len())?;
    update_with(acc, x, |a, v| A::from_f32(a.to_f32() + v.to_f32()));
    Ok(())
}

/// Sets every element to `value` (rounded once to `T`).
pub fn fill<T: Element>(out: &mut [T], value: f32) {
    out.fill(T::from_f32(value));
}

/// Converts `src` into `dst` element by element, through f32 (exact for every widening,
/// one round-to-nearest-even for every narrowing).
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if the lengths do not fit.
pub fn cast<S: Element, D: Element>(src: &[S], dst: &mut [D]) -> Result<()> {
    check_len("cpu::cast", "dst", dst.len(), src.len())?;
    map_into(src, dst, |v| D::from_f32(v.to_f32()));
    Ok(())
}

/// Broadcast bias: `out[i, j] = x[i, j] + bias[j]` with `x` and `out` row-major `[n, d]` and
/// `d = bias.len()`.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if the lengths do not fit.
pub fn bias_add<T: Element>(x: &[T], bias: &[T], out: &mut [T]) -> Result<()> {
    let d = bias.len();
    check_len("cpu::bias_add", "out", out.len(), x.len())?;
    rows_of("cpu::bias_add", "x", x.len(), d)?;
    if d == 0 {
        return Ok(());
    }
    let run = |x: &[T], out: &mut [T]| {
        for (orow, xrow) in out.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
            for ((o, &v), &b) in orow.iter_mut().zip(xrow).zip(bias) {
                *o = T::from_f32(v.to_f32() + b.to_f32());
            }
        }
    };
    if out.len() >= PAR_THRESHOLD {
        let chunk = (PAR_CHUNK / d).max(1) * d;
        out.par_chunks_mut(chunk).zip(x.par_chunks(chunk)).for_each(|(o, x)| run(x, o));
    } else {
        run(x, out);
    }
    Ok(())
}

/// Rows per partial column sum. Column sums (bias gradients, layer norm's dgamma and dbeta)
/// add each chunk of this many rows in row order from 0, then the chunks' sums in chunk
/// order, on the host and on a GPU alike: the order is fixed, so results repeat bit for bit,
/// and the two backends add the same terms in the same order. 64 rows give a GPU one thread
/// per column and chunk, 98,304 threads for 8192 rows of 768 (a GPT-2 bias), with partials
/// of 1/16 of an f32 input.
pub(crate) const COLUMN_SUM_ROWS: usize = 64;

/// The rows of partial sums that column sums over `rows` rows keep: one per chunk of
/// [`COLUMN_SUM_ROWS`], none when the rows fit one chunk (its partials are the sums). Sizes
/// the GPU's workspace and says where its second pass reads.
pub(crate) fn column_sum_partials(rows: usize) -> usize {
    if rows > COLUMN_SUM_ROWS { rows.div_ceil(COLUMN_SUM_ROWS) } else { 0 }
}

/// Column sums in f32 of a row-major `[n, d]` matrix, blocked by [`COLUMN_SUM_ROWS`] rows so
/// that each partial sum adds at most that many terms (accuracy) and blocks can run in
/// parallel (deterministic: partials are combined in block order).
pub(crate) fn column_sums<T: Element>(x: &[T], d: usize) -> Vec<f32> {
    const ROWS: usize = COLUMN_SUM_ROWS;
    let mut total = vec![0.0f32; d];
    if d == 0 {
        return total;
    }
    let block = |rows: &[T]| {
        let mut acc = vec![0.0f32; d];
        for row in rows.chunks_exact(d) {
            for (a, &v) in acc.iter_mut().zip(row) {
                *a += v.to_f32();
            }
        }
        acc
    };
    let partials: Vec<Vec<f32>> = if x.len() >= PAR_THRESHOLD {
        x.par_chunks(ROWS * d).map(block).collect()
    } else {
        x.chunks(ROWS * d).map(block).collect()
    };
    for p in &partials {
        for (t, &v) in total.iter_mut().zip(p) {
            *t += v;
        }
    }
    total
}

/// Backward of [`bias_add`]: `db[j] = sum_i dy[i, j]` with `dy` row-major `[n, d]` and
/// `d = db.len()`. Overwrites `db`; the gradient with respect to `x` is `dy` itself.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if the lengths do not fit.
pub fn bias_add_backward<T: Element>(dy: &[T], db: &mut [T]) -> Result<()> {
    let d = db.len();
    rows_of("cpu::bias_add_backward", "dy", dy.len(), d)?;
    for (o, s) in db.iter_mut().zip(column_sums(dy, d)) {
        *o = T::from_f32(s);
    }
    Ok(())
}

/// Helpers shared by the CPU op tests: tolerances, rounding, and NaN-proof comparisons.
#[cfg(test)]
pub(crate) mod testing {
    use crate::{DType, Element};
    use proptest::prelude::*;
    use proptest::test_runner::TestCaseError;

    /// The relative tolerance of a forward op storing into `T`.
    pub(crate) fn tol<T: Element>() -> f64 {
        if T::DTYPE == DType::F32 { 1e-5 } else { 1e-2 }
    }

    /// `n` values in `[lo, hi)` from `seed` (xorshift): the same inputs on every run,
    /// without a proptest strategy.
    pub(crate) fn seeded_in(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                lo + (hi - lo) * ((s >> 40) as f32 / (1u64 << 24) as f32)
            })
            .collect()
    }

    /// [`seeded_in`] over `[-1, 1)`.
    pub(crate) fn seeded(n: usize, seed: u64) -> Vec<f32> {
        seeded_in(n, seed, -1.0, 1.0)
    }

    /// Rounds f32 values into `T`.
    pub(crate) fn round<T: Element>(v: &[f32]) -> Vec<T> {
        v.iter().map(|&x| T::from_f32(x)).collect()
    }

    /// Panics unless `|got - want| <= tol * max(1, |want|)` everywhere; fails on NaN:
    /// `!(err <= tol)` is true when either side is NaN.
    pub(crate) fn assert_close(got: &[f64], want: &[f64], tol: f64, what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let err = (g - w).abs();
            assert!(err <= tol * w.abs().max(1.0), "{what}[{i}]: got {g}, want {w}");
        }
    }

    /// Central differences of `L(x) = sum(f(x) * r)` on every coordinate of `x` (h = 1e-2).
    pub(crate) fn finite_diff_sum(
        x: &[f32],
        r: &[f32],
        f: impl Fn(&[f32], &mut [f32]),
    ) -> Vec<f64> {
        let h = 1e-2f32;
        let mut x = x.to_vec();
        let mut y = vec![0.0f32; r.len()];
        let mut loss = |x: &[f32]| {
            f(x, &mut y);
            y.iter().zip(r).map(|(&y, &r)| y as f64 * r as f64).sum::<f64>()
        };
        (0..x.len())
            .map(|i| {
                let v = x[i];
                x[i] = v + h;
                let up = loss(&x);
                x[i] = v - h;
                let down = loss(&x);
                x[i] = v;
                (up - down) / (2.0 * h as f64)
            })
            .collect()
    }

    /// Fails unless `|got - want| <= tol * max(1, |want|)` everywhere; a NaN on either side
    /// fails because the comparison is written so that NaN makes it false.
    pub(crate) fn check_close(got: &[f64], want: &[f64], tol: f64) -> Result<(), TestCaseError> {
        prop_assert_eq!(got.len(), want.len());
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            let ok = (g - w).abs() <= tol * w.abs().max(1.0);
            prop_assert!(ok, "index {i}: got {g}, want {w}, tol {tol}");
        }
        Ok(())
    }

    /// Values in a range where every op under test is well conditioned.
    pub(crate) fn values(len: usize) -> impl Strategy<Value = Vec<f32>> {
        prop::collection::vec(-4.0f32..4.0, len)
    }

    /// Compares `analytic` with central finite differences of the scalar `loss` at `x`.
    pub(crate) fn check_grad(
        loss: impl Fn(&[f32]) -> f64,
        x: &[f32],
        analytic: &[f32],
        h: f32,
        tol: f64,
    ) -> Result<(), TestCaseError> {
        let mut xp = x.to_vec();
        let mut fd = Vec::with_capacity(x.len());
        for i in 0..x.len() {
            xp[i] = x[i] + h;
            let up = loss(&xp);
            xp[i] = x[i] - h;
            let down = loss(&xp);
            xp[i] = x[i];
            // The step actually taken, after rounding x +- h to f32.
            let step = f64::from(x[i] + h) - f64::from(x[i] - h);
            fd.push((up - down) / step);
        }
        let analytic: Vec<f64> = analytic.iter().map(|&v| f64::from(v)).collect();
        check_close(&analytic, &fd, tol)
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;
    use crate::cpu::widen_f64;
    use half::{bf16, f16};
    use proptest::prelude::*;
    use proptest::test_runner::TestCaseError;

    fn check_binary<T: Element>(a: &[f32], b: &[f32]) -> Result<(), TestCaseError> {
        let (a, b) = (round::<T>(a), round::<T>(b));
        let (wa, wb) = (widen_f64(&a), widen_f64(&b));
        let mut out = vec![T::default(); a.len()];
        add(&a, &b, &mut out).unwrap();
        let want: Vec<f64> = wa.iter().zip(&wb).map(|(x, y)| x + y).collect();
        check_close(&widen_f64(&out), &want, tol::<T>())?;
        mul(&a, &b, &mut out).unwrap();
        let want: Vec<f64> = wa.iter().zip(&wb).map(|(x, y)| x * y).collect();
        check_close(&widen_f64(&out), &want, tol::<T>())?;
        scale(&a, 0.37, &mut out).unwrap();
        let want: Vec<f64> = wa.iter().map(|x| f64::from(0.37f32) * x).collect();
        check_close(&widen_f64(&out), &want, tol::<T>())?;
        let mut y = b.clone();
        axpy(-1.5, &a, &mut y).unwrap();
        let want: Vec<f64> = wa.iter().zip(&wb).map(|(x, y)| y - 1.5 * x).collect();
        check_close(&widen_f64(&y), &want, tol::<T>())?;
        let mut acc = vec![0.25f32; a.len()];
        add_assign(&mut acc, &a).unwrap();
        let want: Vec<f64> = wa.iter().map(|x| x + 0.25).collect();
        check_close(&widen_f64(&acc), &want, 1e-5)
    }

    fn check_bias<T: Element>(x: &[f32], b: &[f32]) -> Result<(), TestCaseError> {
        let (x, b) = (round::<T>(x), round::<T>(b));
        let (wx, wb) = (widen_f64(&x), widen_f64(&b));
        let d = b.len();
        let mut out = vec![T::default(); x.len()];
        bias_add(&x, &b, &mut out).unwrap();
        let want: Vec<f64> = wx.iter().enumerate().map(|(i, v)| v + wb[i % d]).collect();
        check_close(&widen_f64(&out), &want, tol::<T>())?;
        let mut db = vec![T::default(); d];
        bias_add_backward(&x, &mut db).unwrap();
        let mut want = vec![0.0f64; d];
        for (i, v) in wx.iter().enumerate() {
            want[i % d] += v;
        }
        check_close(&widen_f64(&db), &want, tol::<T>())
    }

    fn check_cast<S: Element, D: Element>(v: &[f32]) -> Result<(), TestCaseError> {
        let src = round::<S>(v);
        let mut dst = vec![D::default(); v.len()];
        cast(&src, &mut dst).unwrap();
        check_close(&widen_f64(&dst), &widen_f64(&src), tol::<D>())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        // add, mul, scale, axpy and add_assign match an f64 reference computed from the same
        // rounded inputs, for every element type.
        #[test]
        fn binary_ops_match_f64_reference(
            (a, b) in (0usize..70).prop_flat_map(|n| (values(n), values(n)))
        ) {
            check_binary::<f32>(&a, &b)?;
            check_binary::<f16>(&a, &b)?;
            check_binary::<bf16>(&a, &b)?;
        }

        // bias_add broadcasts over rows and its backward is the column sum, for every type.
        #[test]
        fn bias_add_and_backward_match_f64_reference(
            (x, b) in (1usize..9, 1usize..12)
                .prop_flat_map(|(n, d)| (values(n * d), values(d)))
        ) {
            check_bias::<f32>(&x, &b)?;
            check_bias::<f16>(&x, &b)?;
            check_bias::<bf16>(&x, &b)?;
        }

        // Casting between any two element types equals rounding the source value once.
        #[test]
        fn cast_between_all_types_rounds_once(v in prop::collection::vec(-1e4f32..1e4, 0..40)) {
            check_cast::<f32, f16>(&v)?;
            check_cast::<f32, bf16>(&v)?;
            check_cast::<f16, f32>(&v)?;
            check_cast::<bf16, f32>(&v)?;
            check_cast::<f16, bf16>(&v)?;
            check_cast::<bf16, f16>(&v)?;
            check_cast::<f32, f32>(&v)?;
        }

        // The bias backward is the gradient of L = sum(bias_add(x, b) * r) in b.
        #[test]
        fn bias_add_backward_matches_finite_differences(
            (x, b, r) in (1usize..6, 1usize..8)
                .prop_flat_map(|(n, d)| (values(n * d), values(d), values(n * d)))
        ) {
            let loss = |b: &[f32]| {
                let mut out = vec![0.0f32; x.len()];
                bias_add(&x, b, &mut out).unwrap();
                out.iter().zip(&r).map(|(&o, &r)| f64::from(o) * f64::from(r)).sum::<f64>()
            };
            let mut db = vec![0.0f32; b.len()];
            bias_add_backward(&r, &mut db).unwrap();
            check_grad(loss, &b, &db, 1e-2, 1e-2)?;
        }
    }

    #[test]
    fn parallel_path_matches_sequential_definition() {
        let n = PAR_THRESHOLD + 123;
        let a: Vec<f32> = (0..n).map(|i| (i % 97) as f32 * 0.5).collect();
        let b: Vec<f32> = (0..n).map(|i| (i % 13) as f32).collect();
        let mut out = vec![0.0f32; n];
        add(&a, &b, &mut out).unwrap();
        assert!(out.iter().enumerate().all(|(i, &o)| o == a[i] + b[i]));
        let bias: Vec<f32> = (0..7).map(|j| j as f32).collect();
        let x = &a[..(n / 7) * 7];
        let mut out = vec![0.0f32; x.len()];
        bias_add(x, &bias, &mut out).unwrap();
        assert!(out.iter().enumerate().all(|(i, &o)| o == x[i] + bias[i % 7]));
    }

    #[test]
    fn fill_sets_every_element_to_the_rounded_value() {
        let mut v = vec![bf16::ZERO; 5];
        fill(&mut v, 1.0 / 3.0);
        assert!(v.iter().all(|&x| x == bf16::from_f32(1.0 / 3.0)));
    }
}
