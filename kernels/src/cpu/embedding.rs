//! Embedding lookup on the host: forward gathers rows of a table, backward scatter-adds
//! the output gradient back into the rows that were read.
//!
//! Layouts: `table: [vocab, dim]`, `ids: [tokens]`, `out: [tokens, dim]`, all row-major.
//! Ids are checked before anything is written, so an error leaves the output untouched.

use super::matmul::{widen, with_f32_out};
use crate::dtype::Element;
use rayon::prelude::*;

/// A token id outside the embedding table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "embedding: id {id} at position {position} is out of range for a vocabulary of {vocab}; ids must be below {vocab}"
)]
pub struct IdOutOfRange {
    /// Index of the offending id in `ids`.
    pub position: usize,
    /// The offending id.
    pub id: u32,
    /// Rows in the table.
    pub vocab: usize,
}

/// Returns the first id that is not below `vocab`.
pub(crate) fn check_ids(ids: &[u32], vocab: usize) -> Result<(), IdOutOfRange> {
    match ids.iter().position(|&id| id as usize >= vocab) {
        Some(position) => Err(IdOutOfRange { position, id: ids[position], vocab }),
        None => Ok(()),
    }
}

/// Gathers `out[t, :] = table[ids[t], :]` (layouts in the module doc).
///
/// # Errors
///
/// [`IdOutOfRange`] for the first id not below `table.len() / dim`; nothing is written.
pub fn embedding<T: Element>(
    ids: &[u32],
    table: &[T],
    out: &mut [T],
    dim: usize,
) -> Result<(), IdOutOfRange> {
    debug_assert!(dim > 0 && table.len().is_multiple_of(dim));
    debug_assert_eq!(out.len(), ids.len() * dim);
    check_ids(ids, table.len() / dim.max(1))?;
    out.par_chunks_mut(dim.max(1)).zip(ids.par_iter()).for_each(|(row, &id)| {
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
/// [`IdOutOfRange`] for the first id not below `dtable.len() / dim`; nothing is written.
pub fn embedding_backward<T: Element>(
    ids: &[u32],
    dout: &[T],
    dtable: &mut [T],
    dim: usize,
) -> Result<(), IdOutOfRange> {
    debug_assert!(dim > 0 && dtable.len().is_multiple_of(dim));
    debug_assert_eq!(dout.len(), ids.len() * dim);
    check_ids(ids, dtable.len() / dim.max(1))?;
    let dout = widen(dout);
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
    use crate::cpu::elementwise::testing::{assert_close, widen as to_f64};
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
            assert_close(&to_f64(&out), &want, 0.0, "out");
            let table: Vec<bf16> = table.iter().map(|&v| bf16::from_f32(v)).collect();
            let want = ids.iter().flat_map(|&id| to_f64(&table[id as usize * dim..][..dim])).collect::<Vec<_>>();
            let mut out = vec![bf16::NAN; ids.len() * dim];
            embedding(&ids, &table, &mut out, dim).unwrap();
            assert_close(&to_f64(&out), &want, 0.0, "out bf16");
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
            assert_close(&to_f64(&dtable), &fd, 1e-2, "dtable");
        }
    }

    #[test]
    fn out_of_range_id_is_reported_and_nothing_is_written() {
        let table = [1.0f32, 2.0, 3.0, 4.0];
        let mut out = [0.0f32; 4];
        let err = embedding(&[1, 2], &table, &mut out, 2).unwrap_err();
        assert_eq!(err, IdOutOfRange { position: 1, id: 2, vocab: 2 });
        assert_eq!(out, [0.0; 4]);
        let mut dtable = [9.0f32; 4];
        let err = embedding_backward(&[7, 0], &out, &mut dtable, 2).unwrap_err();
        assert_eq!(err.position, 0);
        assert_eq!(dtable, [9.0; 4]);
    }
}
