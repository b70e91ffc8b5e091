//! Layer normalization over the last dimension, forward and backward.

use super::dispatch::{Buffers, Op, OutputSpec, Plan, run};
use super::{expect_dtype, expect_shape, invalid, rows_cols, same_device, same_kind, same_layout};
use crate::cpu::norm as cpu;
use crate::device::Device;
use crate::dtype::{DType, with_dtype};
use crate::error::Result;
use crate::tensor::Tensor;

/// The result of [`layer_norm`].
#[derive(Debug)]
pub struct LayerNormOutput {
    /// The normalized output, `x`'s shape and dtype.
    pub y: Tensor,
    /// Per-row mean, `[rows]` f32, saved for the backward.
    pub mean: Tensor,
    /// Per-row `1 / sqrt(var + eps)`, `[rows]` f32, saved for the backward.
    pub rstd: Tensor,
}

/// Gradients of [`layer_norm`].
#[derive(Debug)]
pub struct LayerNormGrads {
    /// Gradient of the input, `x`'s shape.
    pub dx: Tensor,
    /// Gradient of the scale, `[d]`.
    pub dgamma: Tensor,
    /// Gradient of the shift, `[d]`.
    pub dbeta: Tensor,
}

/// Checks `x: [.., d]` (`d > 0`) against a norm's `gamma: [d]` (or RMS norm's weight);
/// returns `(rows, d)`.
pub(super) fn norm_dims(op: &'static str, x: &Tensor, gamma: &Tensor) -> Result<(usize, usize)> {
    same_kind(op, x, gamma)?;
    let (rows, d) = rows_cols(op, x.shape())?;
    if d == 0 {
        return Err(invalid(
            op,
            format!("cannot normalize over an empty last dimension {:?}", x.shape()),
        ));
    }
    expect_shape(op, &[d], gamma)?;
    Ok((rows, d))
}

/// Layer norm over the last dimension of `x: [.., d]`: `(x - mean) * rstd * gamma + beta`
/// with the biased variance, as in PyTorch; `gamma` and `beta` are `[d]`.
///
/// # Errors
///
/// Shape, dtype and device mismatches; an empty last dimension; out of memory.
pub fn layer_norm(x: &Tensor, gamma: &Tensor, beta: &Tensor, eps: f32) -> Result<LayerNormOutput> {
    run(LayerNorm { x, gamma, beta, eps })
}

struct LayerNorm<'a> {
    x: &'a Tensor,
    gamma: &'a Tensor,
    beta: &'a Tensor,
    eps: f32,
}

impl Op for LayerNorm<'_> {
    const NAME: &'static str = "layer_norm";
    /// `y`, `mean` and `rstd`.
    type Outs = [Tensor; 3];
    type Output = LayerNormOutput;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        let (rows, d) = norm_dims(Self::NAME, self.x, self.gamma)?;
        same_kind(Self::NAME, self.x, self.beta)?;
        expect_shape(Self::NAME, &[d], self.beta)?;
        Ok(Plan::new([
            OutputSpec::new(self.x.shape(), self.x.dtype()),
            OutputSpec::new(&[rows], DType::F32),
            OutputSpec::new(&[rows], DType::F32),
        ]))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let [y, mean, rstd] = bufs.outputs_mut();
        with_dtype!(self.x.dtype(), T => cpu::layer_norm(
            self.x.as_slice::<T>()?,
            self.gamma.as_slice::<T>()?,
            self.beta.as_slice::<T>()?,
            self.eps,
            y.out_slice::<T>(Self::NAME)?,
            mean.out_slice::<f32>(Self::NAME)?,
            rstd.out_slice::<f32>(Self::NAME)?,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::helpers::{check_rows, ptr};
        use crate::cuda::{Arg, launch, registry::LAYER_NORM};
        let [y, mean, rstd] = bufs.outputs_mut();
        let rows = mean.numel();
        check_rows(Self::NAME, rows)?;
        // SAFETY: layer_norm_T(const T* x, const T* g, const T* b, float eps, T* y, float* m,
        // float* r, u64 d), one block per row; x and y hold rows * d elements, gamma and
        // beta d, mean and rstd rows floats.
        unsafe {
            gpu.launch(
                LAYER_NORM.of(self.x.dtype()),
                launch::per_row(rows),
                &[
                    ptr(self.x)?,
                    ptr(self.gamma)?,
                    ptr(self.beta)?,
                    Arg::F32(self.eps),
                    ptr(y)?,
                    ptr(mean)?,
                    ptr(rstd)?,
                    Arg::count(self.gamma.numel()),
                ],
            )
        }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<LayerNormOutput> {
        let [y, mean, rstd] = bufs.into_outputs();
        Ok(LayerNormOutput { y, mean, rstd })
    }
}

/// Gradients of [`layer_norm`] from the forward input `x`, `gamma`, the saved `mean` and
/// `rstd`, and the upstream `dy`.
///
/// # Errors
///
/// Shape, dtype and device mismatches; out of memory.
pub fn layer_norm_backward(
    x: &Tensor,
    gamma: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    dy: &Tensor,
) -> Result<LayerNormGrads> {
    run(LayerNormBackward { x, gamma, mean, rstd, dy, acc: None })
}

struct LayerNormBackward<'a> {
    x: &'a Tensor,
    gamma: &'a Tensor,
    mean: &'a Tensor,
    rstd: &'a Tensor,
    dy: &'a Tensor,
    /// The f32 partial sums of dgamma, then of dbeta (`[param_chunks(rows), d]` each).
    acc: Option<usize>,
}

impl Op for LayerNormBackward<'_> {
    const NAME: &'static str = "layer_norm_backward";
    /// `dx`, `dgamma` and `dbeta`.
    type Outs = [Tensor; 3];
    type Output = LayerNormGrads;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        let (x, dy) = (self.x, self.dy);
        let (rows, d) = backward_dims(Self::NAME, x, self.gamma, [self.mean, self.rstd], dy)?;
        let mut plan = Plan::new([
            OutputSpec::new(self.x.shape(), self.x.dtype()),
            OutputSpec::new(&[d], self.x.dtype()),
            OutputSpec::new(&[d], self.x.dtype()),
        ]);
        self.acc = plan_partials(Self::NAME, &mut plan, rows, d)?;
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let [dx, dgamma, dbeta] = bufs.outputs_mut();
        with_dtype!(self.x.dtype(), T => cpu::layer_norm_backward(
            self.x.as_slice::<T>()?,
            self.gamma.as_slice::<T>()?,
            self.mean.as_slice::<f32>()?,
            self.rstd.as_slice::<f32>()?,
            self.dy.as_slice::<T>()?,
            dx.out_slice::<T>(Self::NAME)?,
            dgamma.out_slice::<T>(Self::NAME)?,
            dbeta.out_slice::<T>(Self::NAME)?,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let ws = bufs.ws(self.acc)?;
        let [dx, dgamma, dbeta] = bufs.outputs_mut();
        let at = BackwardAddresses {
            x: self.x.cuda_ptr()?,
            gamma: self.gamma.cuda_ptr()?,
            mean: self.mean.cuda_ptr()?,
            rstd: self.rstd.cuda_ptr()?,
            dy: self.dy.cuda_ptr()?,
            dx: dx.cuda_ptr()?,
            dgamma: dgamma.cuda_ptr()?,
            dbeta: dbeta.cuda_ptr()?,
            partials: ws,
        };
        // SAFETY: the tensors hold what `plan` checked (x, dy, dx: rows * d elements; gamma,
        // dgamma, dbeta: d; mean, rstd: rows floats) and the workspace the partials.
        unsafe {
            backward_launches(gpu, &at, self.mean.numel(), self.gamma.numel(), self.x.dtype())
        }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<LayerNormGrads> {
        let [dx, dgamma, dbeta] = bufs.into_outputs();
        Ok(LayerNormGrads { dx, dgamma, dbeta })
    }
}

/// Checks a layer-norm backward's operands: `x: [.., d]` against `gamma`, the saved
/// statistics (`mean` and `rstd`, f32 `[rows]` on `x`'s device) and `dy` of `x`'s layout;
/// returns `(rows, d)`.
pub(super) fn backward_dims(
    op: &'static str,
    x: &Tensor,
    gamma: &Tensor,
    saved: [&Tensor; 2],
    dy: &Tensor,
) -> Result<(usize, usize)> {
    let (rows, d) = norm_dims(op, x, gamma)?;
    same_layout(op, x, dy)?;
    for s in saved {
        same_device(op, x, s)?;
        expect_dtype(op, DType::F32, s)?;
        expect_shape(op, &[rows], s)?;
    }
    Ok((rows, d))
}

/// Plans a layer-norm backward's workspace: the f32 partial sums of dgamma, then of dbeta,
/// per chunk of rows ([`param_chunks`] x `d` each), added over chunks after.
pub(super) fn plan_partials<O: super::dispatch::Outputs>(
    op: &'static str,
    plan: &mut Plan<O>,
    rows: usize,
    d: usize,
) -> Result<Option<usize>> {
    let floats = crate::params::mul(op, "the partial sums", 2 * param_chunks(rows), d)?;
    Ok(plan.workspace(crate::params::mul(op, "the partial sums", floats, 4)?))
}

/// The chunks of [`COLUMN_SUM_ROWS`](crate::cpu::elementwise::COLUMN_SUM_ROWS) rows whose
/// partial sums of dgamma and dbeta the backward keeps (the host adds in the same chunks).
pub(super) fn param_chunks(rows: usize) -> usize {
    rows.div_ceil(crate::cpu::elementwise::COLUMN_SUM_ROWS)
}

/// The device addresses [`backward_launches`] works on.
#[cfg(feature = "cuda")]
pub(crate) struct BackwardAddresses {
    pub(crate) x: u64,
    pub(crate) gamma: u64,
    pub(crate) mean: u64,
    pub(crate) rstd: u64,
    pub(crate) dy: u64,
    pub(crate) dx: u64,
    pub(crate) dgamma: u64,
    pub(crate) dbeta: u64,
    /// `2 * param_chunks(rows) * d` floats: dgamma's partials, then dbeta's.
    pub(crate) partials: u64,
}

/// The backward's two launches over `[rows, d]` of `dtype`: `layer_norm_bwd_fused` (dx, one
/// block per row, and the partial sums of dgamma and dbeta, a block per column block and
/// chunk of rows, in one grid), then `layer_norm_bwd_finish` (the partials added in chunk
/// order, rounded into dgamma and dbeta). Written against [`Exec`](crate::cuda::Exec) so that
/// the tests run it whole in the emulation.
///
/// # Safety
///
/// The addresses hold what [`BackwardAddresses`] says for `rows` and `d`.
#[cfg(feature = "cuda")]
pub(crate) unsafe fn backward_launches(
    gpu: &impl crate::cuda::Exec,
    at: &BackwardAddresses,
    rows: usize,
    d: usize,
    dtype: DType,
) -> Result<()> {
    use crate::cuda::Arg;
    use crate::cuda::registry::LAYER_NORM_BWD_FUSED;
    let grid = BackwardGrid::new("layer_norm_backward", rows, d)?;
    let db_partials = grid.dbeta_partials(at.partials);
    // SAFETY: layer_norm_bwd_fused_T(const T* x, const T* g, const float* m, const float* r,
    // const T* dy, T* dx, float* dg, float* db, u64 rows, u64 d, u64 chunk, u32 col_blocks,
    // u32 chunk_blocks); the caller's contract covers the sizes; the grid is rows blocks
    // then col_blocks * chunk_blocks (both u32: checked against the grid in `new`).
    unsafe {
        gpu.launch(
            LAYER_NORM_BWD_FUSED.of(dtype),
            grid.cfg,
            &[
                Arg::Ptr(at.x),
                Arg::Ptr(at.gamma),
                Arg::Ptr(at.mean),
                Arg::Ptr(at.rstd),
                Arg::Ptr(at.dy),
                Arg::Ptr(at.dx),
                Arg::Ptr(at.partials),
                Arg::Ptr(db_partials),
                Arg::count(rows),
                Arg::count(d),
                Arg::count(crate::cpu::elementwise::COLUMN_SUM_ROWS),
                Arg::U32(grid.col_blocks),
                Arg::U32(grid.chunk_blocks),
            ],
        )?;
        grid.finish(gpu, at.partials, at.dgamma, at.dbeta, dtype)
    }
}

/// The grid of the backward's first launch over `[rows, d]`: `rows` blocks of dx, then a
/// block per column block and chunk of rows (at most 65535 chunk blocks, each striding over
/// the chunks) for the partial sums of dgamma and dbeta.
#[cfg(feature = "cuda")]
pub(crate) struct BackwardGrid {
    pub(crate) cfg: cudarc::driver::LaunchConfig,
    pub(crate) col_blocks: u32,
    pub(crate) chunk_blocks: u32,
    /// The chunks of rows whose partials the first launch writes.
    chunks: usize,
    d: usize,
}

#[cfg(feature = "cuda")]
impl BackwardGrid {
    /// The grid for `rows` rows of `d`; an error (for `op`) when it exceeds a CUDA grid.
    pub(crate) fn new(op: &'static str, rows: usize, d: usize) -> Result<Self> {
        use crate::cuda::launch;
        let chunks = param_chunks(rows);
        let col_blocks = d.div_ceil(launch::BLOCK as usize);
        let chunk_blocks = chunks.min(65535);
        let blocks = col_blocks
            .checked_mul(chunk_blocks)
            .and_then(|b| b.checked_add(rows))
            .filter(|&b| launch::fits_grid(b))
            .ok_or_else(|| invalid(op, format!("{rows} rows of {d} exceed a CUDA grid")))?;
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (launch::BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // Both fit a u32: their product fits the grid.
        Ok(BackwardGrid {
            cfg,
            col_blocks: col_blocks as u32,
            chunk_blocks: chunk_blocks as u32,
            chunks,
            d,
        })
    }

    /// Where dbeta's partials start in the workspace at `partials` (after dgamma's).
    pub(crate) fn dbeta_partials(&self, partials: u64) -> u64 {
        partials + (self.chunks * self.d * 4) as u64
    }

    /// The second launch, `layer_norm_bwd_finish`: the partials at `partials` added in chunk
    /// order and rounded into `dgamma` and `dbeta`.
    ///
    /// # Safety
    ///
    /// `partials` holds `2 * chunks * d` floats written by the first launch; `dgamma` and
    /// `dbeta` `d` elements of `dtype`.
    pub(crate) unsafe fn finish(
        &self,
        gpu: &impl crate::cuda::Exec,
        partials: u64,
        dgamma: u64,
        dbeta: u64,
        dtype: DType,
    ) -> Result<()> {
        use crate::cuda::registry::LAYER_NORM_BWD_FINISH;
        use crate::cuda::{Arg, launch};
        // SAFETY: layer_norm_bwd_finish_T(const float* dg, const float* db, T* dgamma, T*
        // dbeta, u64 chunks, u64 d): the caller's contract.
        unsafe {
            gpu.launch(
                LAYER_NORM_BWD_FINISH.of(dtype),
                launch::elementwise(self.d),
                &[
                    Arg::Ptr(partials),
                    Arg::Ptr(self.dbeta_partials(partials)),
                    Arg::Ptr(dgamma),
                    Arg::Ptr(dbeta),
                    Arg::count(self.chunks),
                    Arg::count(self.d),
                ],
            )
        }
    }
}
