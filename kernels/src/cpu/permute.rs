//! Axis permutation on the host: `y` is `x` (row-major, shape `shape`) with its axes
//! reordered, `y.shape[i] = shape[perm[i]]`. A pure copy: no arithmetic, no rounding.

use super::check_len;
use crate::error::{Error, Result};
use rayon::prelude::*;

/// The most axes a permutation may have (the CUDA kernel's index arithmetic is unrolled
/// for this many).
pub const MAX_RANK: usize = 4;

/// Checks that `perm` is a permutation of `0..shape.len()` with at most [`MAX_RANK`] axes.
pub(crate) fn check_perm(op: &'static str, shape: &[usize], perm: &[usize]) -> Result<()> {
    let bad = |reason: String| Err(Error::InvalidArgument { op, reason });
    if perm.len() != shape.len() {
        return bad(format!(
            "the permutation {perm:?} has {} axes; the tensor of shape {shape:?} has {}",
            perm.len(),
            shape.len()
        ));
    }
    if perm.len() > MAX_RANK {
        return bad(format!("at most {MAX_RANK} axes can be permuted, got {}", perm.len()));
    }
    let mut seen = [false; MAX_RANK];
    for &p in perm {
        if p >= perm.len() || std::mem::replace(&mut seen[p], true) {
            return bad(format!(
                "{perm:?} is not a permutation of 0..{} (each axis exactly once)",
                perm.len()
            ));
        }
    }
    Ok(())
}

/// The geometry both backends use: the output shape and, per output axis, the input
/// stride of the axis it reads, both padded in front to [`MAX_RANK`] axes (size 1, stride 0).
pub(crate) fn geometry(shape: &[usize], perm: &[usize]) -> ([usize; MAX_RANK], [usize; MAX_RANK]) {
    let rank = shape.len();
    let mut in_strides = [0usize; MAX_RANK];
    let mut s = 1;
    for i in (0..rank).rev() {
        in_strides[i] = s;
        s *= shape[i];
    }
    let (mut dims, mut strides) = ([1usize; MAX_RANK], [0usize; MAX_RANK]);
    let pad = MAX_RANK - rank;
    for (i, &p) in perm.iter().enumerate() {
        dims[pad + i] = shape[p];
        strides[pad + i] = in_strides[p];
    }
    (dims, strides)
}

/// Output rows (of the last axis) per rayon task.
const ROWS_PER_TASK: usize = 64;

/// `y = x.permute(perm)` for `x` of shape `shape` (both contiguous, row-major).
///
/// # Errors
///
/// [`Error::InvalidArgument`] if `perm` is not a permutation of the axes (at most
/// [`MAX_RANK`]) or a slice's length does not match `shape`; nothing is written then.
pub fn permute<T: Copy + Send + Sync>(
    x: &[T],
    shape: &[usize],
    perm: &[usize],
    y: &mut [T],
) -> Result<()> {
    const OP: &str = "permute";
    check_perm(OP, shape, perm)?;
    let n: usize = shape.iter().product();
    check_len(OP, "x", x.len(), n)?;
    check_len(OP, "y", y.len(), n)?;
    if n == 0 {
        return Ok(());
    }
    let (d, s) = geometry(shape, perm);
    // One task per output row of the last axis: the innermost loop reads with stride s[3].
    let row = d[3];
    y.par_chunks_mut(row * ROWS_PER_TASK).enumerate().for_each(|(chunk, out)| {
        let first_row = chunk * ROWS_PER_TASK;
        for (r, out_row) in out.chunks_mut(row).enumerate() {
            let mut rest = first_row + r;
            let i2 = rest % d[2];
            rest /= d[2];
            let i1 = rest % d[1];
            let i0 = rest / d[1];
            let base = i0 * s[0] + i1 * s[1] + i2 * s[2];
            for (i3, o) in out_row.iter_mut().enumerate() {
                *o = x[base + i3 * s[3]];
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition, one multi-index at a time.
    fn naive(x: &[f32], shape: &[usize], perm: &[usize]) -> Vec<f32> {
        let rank = shape.len();
        let out_shape: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
        let n: usize = shape.iter().product();
        let mut y = vec![0.0; n];
        for (flat, slot) in y.iter_mut().enumerate() {
            // Output multi-index.
            let mut idx = vec![0; rank];
            let mut rest = flat;
            for a in (0..rank).rev() {
                idx[a] = rest % out_shape[a];
                rest /= out_shape[a];
            }
            // Input multi-index: axis perm[a] of the input is idx[a].
            let mut src = vec![0; rank];
            for a in 0..rank {
                src[perm[a]] = idx[a];
            }
            let off = src.iter().zip(shape).fold(0, |acc, (&i, &d)| acc * d + i);
            *slot = x[off];
        }
        y
    }

    #[test]
    fn every_permutation_up_to_rank_4_matches_the_definition() {
        fn perms(k: usize) -> Vec<Vec<usize>> {
            if k == 0 {
                return vec![vec![]];
            }
            let mut out = Vec::new();
            for p in perms(k - 1) {
                for at in 0..=p.len() {
                    let mut q = p.clone();
                    q.insert(at, k - 1);
                    out.push(q);
                }
            }
            out
        }
        let shapes: [&[usize]; 5] = [&[], &[5], &[3, 4], &[2, 3, 5], &[2, 3, 4, 5]];
        for shape in shapes {
            let n: usize = shape.iter().product();
            let x: Vec<f32> = (0..n).map(|i| i as f32).collect();
            for perm in perms(shape.len()) {
                let mut y = vec![-1.0; n];
                permute(&x, shape, &perm, &mut y).unwrap();
                assert_eq!(y, naive(&x, shape, &perm), "shape {shape:?} perm {perm:?}");
            }
        }
    }

    #[test]
    fn bad_permutations_are_errors_and_write_nothing() {
        let x = [1.0f32; 6];
        let mut y = [0.0f32; 6];
        for perm in [&[0, 0][..], &[0, 2], &[1], &[2, 1, 0]] {
            let e = permute(&x, &[2, 3], perm, &mut y).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument { op: "permute", .. }), "{e}");
        }
        let e = permute(&[0.0f32; 32], &[2; 5], &[0, 1, 2, 3, 4], &mut [0.0; 32]).unwrap_err();
        assert!(e.to_string().contains("at most 4 axes"), "{e}");
        assert_eq!(y, [0.0; 6]);
    }
}
