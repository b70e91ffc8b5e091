//! Embedding lookup (a gather of table rows) and its scatter-add backward.

use super::{expect_rank, invalid, output, with_dtype};
use crate::cpu::embedding as cpu;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

fn id_error(op: &'static str, e: cpu::IdOutOfRange) -> Error {
    Error::IndexOutOfRange { op, index: e.id as usize, bound: e.vocab }
}

/// Rows `ids` of `table: [vocab, dim]`, as `[ids.len(), dim]`.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a table that is not `[vocab, dim]` with `dim > 0`;
/// [`Error::IndexOutOfRange`] for an id not below `vocab`; out of memory.
pub fn embedding(table: &Tensor, ids: &[u32]) -> Result<Tensor> {
    const OP: &str = "embedding";
    expect_rank(OP, table, 2, "table [vocab, dim]")?;
    let dim = table.shape()[1];
    if dim == 0 {
        return Err(invalid(OP, "the embedding dimension must be positive"));
    }
    let mut out = output(OP, table.device(), &[ids.len(), dim], table.dtype())?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = table.device().cuda_backend() {
        cpu::check_ids(ids, table.shape()[0]).map_err(|e| id_error(OP, e))?;
        crate::cuda::ops::nn::embedding(cu, table, ids, &mut out)?;
        return Ok(out);
    }
    with_dtype!(table.dtype(), T => {
        cpu::embedding(ids, table.as_slice::<T>()?, out.as_mut_slice::<T>()?, dim)
    })
    .map_err(|e| id_error(OP, e))?;
    Ok(out)
}

/// Gradient of [`embedding`] with respect to a table of `vocab` rows: `[vocab, dim]`, row `v`
/// the sum of the rows of `dout: [ids.len(), dim]` whose id is `v`.
///
/// # Errors
///
/// [`Error::ShapeMismatch`] if `dout` is not `[ids.len(), dim]`;
/// [`Error::IndexOutOfRange`] for an id not below `vocab`; out of memory.
pub fn embedding_backward(ids: &[u32], dout: &Tensor, vocab: usize) -> Result<Tensor> {
    const OP: &str = "embedding_backward";
    expect_rank(OP, dout, 2, "dout [tokens, dim]")?;
    let dim = dout.shape()[1];
    if dim == 0 {
        return Err(invalid(OP, "the embedding dimension must be positive"));
    }
    super::expect_shape(OP, &[ids.len(), dim], dout)?;
    let mut dtable = output(OP, dout.device(), &[vocab, dim], dout.dtype())?;
    #[cfg(feature = "cuda")]
    if let Some(cu) = dout.device().cuda_backend() {
        cpu::check_ids(ids, vocab).map_err(|e| id_error(OP, e))?;
        crate::cuda::ops::nn::embedding_backward(cu, ids, dout, &mut dtable)?;
        return Ok(dtable);
    }
    with_dtype!(dout.dtype(), T => {
        cpu::embedding_backward(ids, dout.as_slice::<T>()?, dtable.as_mut_slice::<T>()?, dim)
    })
    .map_err(|e| id_error(OP, e))?;
    Ok(dtable)
}
