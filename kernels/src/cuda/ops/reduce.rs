//! Reductions (`reduce.cu`): whole-tensor sums read back to the host, row sums, column
//! sums.

use super::elementwise::from_f32;
use super::{ptr, zeroed_f32};
use crate::cuda::launch::{self, BLOCK};
use crate::cuda::registry::{COL_SUM, ROW_SUM, ROW_SUM_F32, SUM_FINAL, SUM_PARTIAL};
use crate::cuda::{Arg, CudaBackend};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use cudarc::driver::LaunchConfig;

/// Blocks of the first pass of a whole-tensor sum.
const SUM_BLOCKS: usize = 1024;

/// Checks that `rows` blocks fit a grid.
pub(crate) fn check_rows(op: &'static str, rows: usize) -> Result<()> {
    if launch::fits_grid(rows) {
        Ok(())
    } else {
        Err(Error::InvalidArgument { op, reason: format!("{rows} rows exceed a CUDA grid") })
    }
}

/// The sum of all elements of `x` in f32, copied back to the host.
pub(crate) fn sum(cu: &CudaBackend, x: &Tensor) -> Result<f32> {
    let n = x.numel();
    if n == 0 {
        return Ok(0.0);
    }
    let blocks = n.div_ceil(BLOCK as usize).min(SUM_BLOCKS);
    let partial = cu.allocate(blocks * 4)?;
    let total = cu.allocate(4)?;
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: sum_partial_T(const T* x, u64 n, float* partial); x holds n elements and
    // partial one float per block.
    unsafe {
        cu.launch(
            SUM_PARTIAL.of(x.dtype()),
            cfg,
            &[ptr(x)?, Arg::count(n), Arg::Ptr(partial.ptr())],
        )?;
    }
    let one = LaunchConfig { grid_dim: (1, 1, 1), ..cfg };
    // SAFETY: sum_final(const float* partial, u32 count, float* out); partial holds
    // `blocks` floats, out one.
    unsafe {
        cu.launch(
            SUM_FINAL.of(DType::F32),
            one,
            &[Arg::Ptr(partial.ptr()), Arg::U32(blocks as u32), Arg::Ptr(total.ptr())],
        )?;
    }
    let mut out = [0u8; 4];
    cu.copy_to_host(&mut out, total.ptr())?;
    Ok(f32::from_ne_bytes(out))
}

/// `y[row] = scale * sum_j x[row, j]` for `x: [rows, d]`, `y: [rows]`.
pub(crate) fn row_sum(cu: &CudaBackend, x: &Tensor, y: &mut Tensor, scale: f32) -> Result<()> {
    let rows = y.numel();
    if rows == 0 {
        return Ok(());
    }
    check_rows("sum_last_dim", rows)?;
    let d = x.numel() / rows;
    // SAFETY: row_sum_T(const T* x, T* y, u64 d, float scale), one block per row; x holds
    // rows * d elements, y rows.
    unsafe {
        cu.launch(
            ROW_SUM.of(x.dtype()),
            launch::per_row(rows),
            &[ptr(x)?, ptr(y)?, Arg::count(d), Arg::F32(scale)],
        )
    }
}

/// `out[j] = sum over rows of x[row, j]` for `x` at `x_ptr` (`[rows, d]` of `dtype`),
/// accumulated in f32 and rounded once into `out: [d]`.
pub(crate) fn column_sums(
    cu: &CudaBackend,
    x_ptr: u64,
    dtype: DType,
    rows: usize,
    out: &mut Tensor,
) -> Result<()> {
    let d = out.numel();
    if d == 0 {
        return Ok(());
    }
    let acc = zeroed_f32(cu, d)?;
    let (cfg, chunk) = launch::columns(rows, d);
    // SAFETY: col_sum_T(const T* x, float* acc, u64 rows, u64 d, u64 chunk), grid (columns,
    // row chunks); x holds rows * d elements of `dtype`, acc d floats.
    unsafe {
        cu.launch(
            COL_SUM.of(dtype),
            cfg,
            &[
                Arg::Ptr(x_ptr),
                Arg::Ptr(acc.ptr()),
                Arg::count(rows),
                Arg::count(d),
                Arg::count(chunk),
            ],
        )?;
    }
    from_f32(cu, acc.ptr(), out)
}

/// Per-channel sums of `dy: [batch, c, plane]` (the bias gradient of a convolution) into
/// `out: [c]`: row sums of every (image, channel) plane, then column sums over images.
pub(crate) fn channel_sums(
    cu: &CudaBackend,
    dy: &Tensor,
    batch: usize,
    out: &mut Tensor,
) -> Result<()> {
    let c = out.numel();
    let planes = batch * c;
    if planes == 0 {
        return Ok(());
    }
    check_rows("conv2d_backward", planes)?;
    let plane = dy.numel() / planes;
    let sums = cu.allocate(planes * 4)?;
    // SAFETY: row_sum_f32_T(const T* x, float* y, u64 d), one block per plane; dy holds
    // planes * plane elements, sums planes floats.
    unsafe {
        cu.launch(
            ROW_SUM_F32.of(dy.dtype()),
            launch::per_row(planes),
            &[ptr(dy)?, Arg::Ptr(sums.ptr()), Arg::count(plane)],
        )?;
    }
    column_sums(cu, sums.ptr(), DType::F32, batch, out)
}
