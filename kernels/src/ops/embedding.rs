//! Embedding lookup (a gather of table rows) and its scatter-add backward. Ids live on the
//! host; they are checked before anything is allocated and, on a GPU, uploaded into a
//! workspace.

use super::dispatch::{Buffers, Op, Plan, run};
use super::{expect_rank, expect_shape, invalid};
use crate::cpu::embedding as cpu;
use crate::device::Device;
use crate::dtype::with_dtype;
use crate::error::Result;
use crate::params::mul;
use crate::tensor::Tensor;

/// Rows `ids` of `table: [vocab, dim]`, as `[ids.len(), dim]`.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a table that is not
/// `[vocab, dim]` with `dim > 0`; [`Error::IndexOutOfRange`](crate::Error::IndexOutOfRange)
/// for an id not below `vocab`; out of memory.
pub fn embedding(table: &Tensor, ids: &[u32]) -> Result<Tensor> {
    run(Embedding { table, ids, upload: None })
}

struct Embedding<'a> {
    table: &'a Tensor,
    ids: &'a [u32],
    /// The ids on the device.
    upload: Option<usize>,
}

impl Op for Embedding<'_> {
    const NAME: &'static str = "embedding";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.table.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        expect_rank(Self::NAME, self.table, 2, "table [vocab, dim]")?;
        let (vocab, dim) = (self.table.shape()[0], self.table.shape()[1]);
        if dim == 0 {
            return Err(invalid(Self::NAME, "the embedding dimension must be positive"));
        }
        cpu::check_ids(Self::NAME, self.ids, vocab)?;
        let n = self.ids.len();
        let mut plan = Plan::one(&[n, dim], self.table.dtype());
        self.upload = plan.workspace(mul(Self::NAME, "the ids", n, 4)?);
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let dim = self.table.shape()[1];
        with_dtype!(self.table.dtype(), T => cpu::embedding(
            self.ids,
            self.table.as_slice::<T>()?,
            bufs.out().out_slice::<T>(Self::NAME)?,
            dim,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::registry::EMBEDDING;
        use crate::cuda::{Arg, helpers::ptr, helpers::upload_u32, launch::elementwise as grid};
        let out = bufs.out();
        let n = out.numel();
        if n == 0 {
            return Ok(());
        }
        let dim = self.table.shape()[1];
        let idx = bufs.ws(self.upload)?;
        upload_u32(gpu, self.ids, idx)?;
        let out = bufs.out();
        // SAFETY: embedding_T(const u32* ids, const T* table, T* out, u64 n, Div dim); out
        // holds n = ids.len() * dim elements, every id is below the table's rows (checked in
        // `plan`).
        unsafe {
            gpu.launch(
                EMBEDDING.of(self.table.dtype()),
                grid(n),
                &[Arg::Ptr(idx), ptr(self.table)?, ptr(out)?, Arg::count(n), Arg::div(dim)],
            )
        }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

/// Gradient of [`embedding`] with respect to a table of `vocab` rows: `[vocab, dim]`, row `v`
/// the sum of the rows of `dout: [ids.len(), dim]` whose id is `v`.
///
/// # Errors
///
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) if `dout` is not
/// `[ids.len(), dim]`; [`Error::IndexOutOfRange`](crate::Error::IndexOutOfRange) for an id
/// not below `vocab`; out of memory.
pub fn embedding_backward(ids: &[u32], dout: &Tensor, vocab: usize) -> Result<Tensor> {
    run(EmbeddingBackward { ids, dout, vocab, acc: None, upload: None })
}

struct EmbeddingBackward<'a> {
    ids: &'a [u32],
    dout: &'a Tensor,
    vocab: usize,
    /// The f32 sums, zeroed (rows no id names stay 0).
    acc: Option<usize>,
    /// The ids on the device.
    upload: Option<usize>,
}

impl Op for EmbeddingBackward<'_> {
    const NAME: &'static str = "embedding_backward";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.dout.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        expect_rank(Self::NAME, self.dout, 2, "dout [tokens, dim]")?;
        let dim = self.dout.shape()[1];
        if dim == 0 {
            return Err(invalid(Self::NAME, "the embedding dimension must be positive"));
        }
        expect_shape(Self::NAME, &[self.ids.len(), dim], self.dout)?;
        cpu::check_ids(Self::NAME, self.ids, self.vocab)?;
        let table = mul(Self::NAME, "the table", self.vocab, dim)?;
        let mut plan = Plan::one(&[self.vocab, dim], self.dout.dtype());
        self.acc = plan.zeroed_workspace(mul(Self::NAME, "the table", table, 4)?);
        if self.dout.numel() > 0 {
            self.upload = plan.workspace(self.ids.len() * 4);
        }
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let dim = self.dout.shape()[1];
        with_dtype!(self.dout.dtype(), T => cpu::embedding_backward(
            self.ids,
            self.dout.as_slice::<T>()?,
            bufs.out().out_slice::<T>(Self::NAME)?,
            dim,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::registry::EMBEDDING_BWD;
        use crate::cuda::{Arg, helpers::ptr, helpers::upload_u32, launch::embedding_rows};
        let acc = bufs.ws(self.acc)?;
        let n = self.dout.numel();
        if n > 0 {
            let dim = self.dout.shape()[1];
            let idx = bufs.ws(self.upload)?;
            upload_u32(gpu, self.ids, idx)?;
            let (cfg, per_range) = embedding_rows(self.vocab, dim);
            // SAFETY: embedding_bwd_T(const u32* ids, const T* dout, float* acc, u64 tokens,
            // u64 d, u64 per_range), grid (columns, vocabulary ranges); dout holds tokens * d
            // elements, acc vocab * d zeroed floats, and every id is below vocab (checked in
            // `plan`).
            unsafe {
                gpu.launch(
                    EMBEDDING_BWD.of(self.dout.dtype()),
                    cfg,
                    &[
                        Arg::Ptr(idx),
                        ptr(self.dout)?,
                        Arg::Ptr(acc),
                        Arg::count(self.ids.len()),
                        Arg::count(dim),
                        Arg::count(per_range),
                    ],
                )?;
            }
        }
        if acc == 0 {
            return Ok(());
        }
        crate::cuda::helpers::from_f32(gpu, acc, bufs.out())
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}
