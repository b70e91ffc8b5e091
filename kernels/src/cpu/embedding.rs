//! Embedding lookup on the host: forward gathers rows of a table, backward scatter-adds
//! the output gradient back into the rows that were read.
//!
//! Layouts: `table: [vocab, dim]`, `ids: [tokens]`, `out: [tokens, dim]`, all row-major.
//! Ids are checked before anything is written, so an error leaves the output untouched.

use super::{check_len, rows_of, widen_f32, with_f32_out};
use crate::dtype::Element;
use crate::error::{Error, Result};
use rayon::prelude::*;

/// Checks that every id is below `vocab`: the first one that is not is an
/// [`Error::IndexOutOfRange`] of `op`.
pub(crate) fn check_ids(op: &'static str, ids: &[u32], vocab: usize) -> Result<()> {
    match ids.iter().find(|&&id| id as usize >= vocab) {
        Some(&id) => Err(Error::IndexOutOfRange { op, index: id as usize, bound: vocab }),
        None => Ok(()),
    }
}

/// Checks `dim > 0`, the table's rows and the output's length; returns the rows.
fn check_layout(
    op: &'static str,
    table: usize,
    out: usize,
    ids: usize,
    dim: usize,
) -> Result<usize> {
    if dim == 0 {
        return Err(Error::InvalidArgument {
            op,
            reason: "the embedding dimension must be positive".into(),
        });
    }
    let vocab = rows_of(op, "the table", table, dim)?;
    check_len(op, "the rows", out, ids.saturating_mul(dim))?;
    Ok(vocab)
}

/// Gathers `out[t, :] = table[ids[t], :]` (layouts in the module doc).
///
/// # Errors
///
/// [`Error::IndexOutOfRange`] for the first id not below `table.len() / dim`;
/// [`Error::InvalidArgument`] for `dim == 0` or lengths that do not fit. Nothing is written
/// then.
pub fn embedding<T: Element>(ids: &[u32], table: &[T], out: &mut [T], dim: usize) -> Result<()> {
    const OP: &str = "cpu::embedding";
    let vocab = check_layout(OP, table.len(), out.len(), ids.len(), dim)?;
    check_ids(OP, ids, vocab)?;
    out.par_chunks_mut(dim).zip(ids.par_iter()).for_each(|(row, &id)| {
        row.copy_from_slice(&table[id as usize * dim..][..dim]);
    });
    Ok(())
}

/// Gradient of [`embedding`]: overwrites `dtable: [vocab, dim]` with
/// `dtable[v, :] = sum over t with ids[t] == v of dout[t, :]` (rows never read get 0).
/// Sums are accumulated in f32 and rounded once.
///
/// # Errors
///
/// As [`embedding`], for `dtable` and `dout`.
pub fn embedding_backward<T: Element>(
    ids: &[u32],
    dout: &[T],
    dtable: &mut [T],
    dim: usize,
) -> Result<()> {
    const OP: &str = "cpu::embedding_backward";
    let vocab = check_layout(OP, dtable.len(), dout.len(), ids.len(), dim)?;
    check_ids(OP, ids, vocab)?;
    let dout = widen_f32(dout);
    with_f32_out(dtable, |dtable| {
        dtable.fill(0.0);
        for (&id, g) in ids.iter().zip(dout.chunks_exact(dim)) {
            for (d, g) in dtable[id as usize * dim..][..dim].iter_mut().zip(g) {
                *d += g;
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::elementwise::testing::assert_close;
    use crate::cpu::widen_f64;
    use half::bf16;
    use proptest::prelude::*;

    /// `(vocab, dim, ids, table, dout)` with every id in range and repeated ids likely.
    fn case() -> impl Strategy<Value = (usize, usize, Vec<u32>, Vec<f32>, Vec<f32>)> {
        (1..=9usize, 1..=9usize, 0..=12usize).prop_flat_map(|(vocab, dim, tokens)| {
            (
                Just(vocab),
                Just(dim),
                prop::collection::vec(0..vocab as u32, tokens),
                prop::collection::vec(-2.0f32..2.0, vocab * dim),
                prop::collection::vec(-2.0f32..2.0, tokens * dim),
            )
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        // Property: the forward copies table row ids[t] to output row t, exactly, in f32
        // and bf16.
        #[test]
        fn embedding_gathers_the_rows_of_the_ids((_vocab, dim, ids, table, _dout) in case()) {
            let want: Vec<f64> = ids.iter().flat_map(|&id| table[id as usize * dim..][..dim].iter().map(|&v| v as f64)).collect();
            let mut out = vec![f32::NAN; ids.len() * dim];
            embedding(&ids, &table, &mut out, dim).unwrap();
            assert_close(&widen_f64(&out), &want, 0.0, "out");
            let table: Vec<bf16> = table.iter().map(|&v| bf16::from_f32(v)).collect();
            let want = ids.iter().flat_map(|&id| widen_f64(&table[id as usize * dim..][..dim])).collect::<Vec<_>>();
            let mut out = vec![bf16::NAN; ids.len() * dim];
            embedding(&ids, &table, &mut out, dim).unwrap();
            assert_close(&widen_f64(&out), &want, 0.0, "out bf16");
        }

        // Property: the backward equals central finite differences of
        // L(table) = sum(embedding(table) * dout), repeated ids included.
        #[test]
        fn embedding_backward_matches_finite_differences((_vocab, dim, ids, table, dout) in case()) {
            let h = 1e-2f32;
            let loss = |table: &[f32]| {
                let mut out = vec![0.0f32; ids.len() * dim];
                embedding(&ids, table, &mut out, dim).unwrap();
                out.iter().zip(&dout).map(|(&o, &r)| o as f64 * r as f64).sum::<f64>()
            };
            let mut t = table.clone();
            let fd: Vec<f64> = (0..t.len()).map(|i| {
                let v = t[i];
                t[i] = v + h;
                let up = loss(&t);
                t[i] = v - h;
                let down = loss(&t);
                t[i] = v;
                (up - down) / (2.0 * h as f64)
            }).collect();
            let mut dtable = vec![f32::NAN; table.len()];
            embedding_backward(&ids, &dout, &mut dtable, dim).unwrap();
            assert_close(&widen_f64(&dtable), &fd, 1e-2, "dtable");
        }
    }

    #[test]
    fn out_of_range_id_is_reported_and_nothing_is_written() {
        let table = [1.0f32, 2.0, 3.0, 4.0];
        let mut out = [0.0f32; 4];
        let err = embedding(&[1, 2], &table, &mut out, 2).unwrap_err();
        assert!(matches!(err, Error::IndexOutOfRange { index: 2, bound: 2, .. }), "{err}");
        assert_eq!(out, [0.0; 4]);
        let mut dtable = [9.0f32; 4];
        let err = embedding_backward(&[7, 0], &out, &mut dtable, 2).unwrap_err();
        assert!(matches!(err, Error::IndexOutOfRange { index: 7, .. }), "{err}");
        assert_eq!(dtable, [9.0; 4]);
    }

    #[test]
    fn lengths_that_do_not_fit_the_layout_are_errors_not_panics() {
        let table = [1.0f32, 2.0, 3.0, 4.0];
        let mut short = [0.0f32; 3];
        assert!(matches!(
            embedding(&[0, 1], &table, &mut short, 2),
            Err(Error::InvalidArgument { .. })
        ));
        assert!(embedding(&[0], &table, &mut short, 0).is_err(), "dim 0");
        assert!(embedding(&[0], &table[..3], &mut short[..2], 2).is_err(), "ragged table");
        let mut dtable = [0.0f32; 4];
        assert!(embedding_backward(&[0, 1], &short, &mut dtable, 2).is_err());
    }
}
