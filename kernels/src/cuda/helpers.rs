//! Launch helpers several ops share: casts, row and column sums, broadcasts, the two-pass
//! whole-tensor sum. They compute into buffers the op layer allocated and allocate nothing.

use super::launch::{self, BLOCK, elementwise as grid};
use super::registry::{
    BROADCAST_ROWS, CAST, COL_SUM, ROW_SUM, ROW_SUM_F32, SUM_FINAL, SUM_PARTIAL,
};
use super::{Arg, Exec, Gpu};
use crate::cpu::elementwise::column_sum_partials;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use cudarc::driver::LaunchConfig;

/// A tensor's device pointer as a kernel argument.
pub(crate) fn ptr(t: &Tensor) -> Result<Arg> {
    Ok(Arg::Ptr(t.cuda_ptr()?))
}

/// Checks that `rows` blocks fit a grid.
pub(crate) fn check_rows(op: &'static str, rows: usize) -> Result<()> {
    if launch::fits_grid(rows) {
        Ok(())
    } else {
        Err(Error::InvalidArgument { op, reason: format!("{rows} rows exceed a CUDA grid") })
    }
}

/// Converts `n` elements at `src` (of `from`) to `dst` (of `to`).
pub(crate) fn cast(
    gpu: &impl Exec,
    src: u64,
    from: DType,
    dst: u64,
    to: DType,
    n: usize,
) -> Result<()> {
    let grid = launch::map(n, from.size_in_bytes().max(to.size_in_bytes()));
    // SAFETY: cast_S_D(const S* x, D* y, u64 n); the caller's pointers hold n elements of
    // their dtypes.
    unsafe {
        gpu.launch(CAST.of_pair(from, to), grid, &[Arg::Ptr(src), Arg::Ptr(dst), Arg::count(n)])
    }
}

/// Writes an f32 buffer of `y.numel()` elements into `y`, rounding to its dtype.
pub(crate) fn from_f32(gpu: &Gpu<'_>, src: u64, y: &mut Tensor) -> Result<()> {
    cast(gpu, src, DType::F32, y.cuda_ptr()?, y.dtype(), y.numel())
}

/// The sum of `n` elements of `dtype` at `x`, in f32, read back to the host: a first pass
/// into `blocks` partial sums at `partial`, a second into the float at `total`.
pub(crate) fn sum(
    gpu: &Gpu<'_>,
    x: u64,
    dtype: DType,
    n: usize,
    (partial, blocks): (u64, usize),
    total: u64,
) -> Result<f32> {
    if n == 0 {
        return Ok(0.0);
    }
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: sum_partial_T(const T* x, u64 n, float* partial); x holds n elements and
    // partial one float per block.
    unsafe {
        gpu.launch(SUM_PARTIAL.of(dtype), cfg, &[Arg::Ptr(x), Arg::count(n), Arg::Ptr(partial)])?;
    }
    let one = LaunchConfig { grid_dim: (1, 1, 1), ..cfg };
    // SAFETY: sum_final(const float* partial, u32 count, float* out); partial holds
    // `blocks` floats, out one.
    unsafe {
        gpu.launch(
            SUM_FINAL.of(DType::F32),
            one,
            &[Arg::Ptr(partial), Arg::U32(blocks as u32), Arg::Ptr(total)],
        )?;
    }
    let mut out = [0u8; 4];
    gpu.copy_to_host(&mut out, total)?;
    Ok(f32::from_ne_bytes(out))
}

/// `y[row] = scale * sum_j x[row, j]` for `x: [rows, d]`, `y: [rows]`.
pub(crate) fn row_sum(
    gpu: &Gpu<'_>,
    op: &'static str,
    x: &Tensor,
    y: &mut Tensor,
    scale: f32,
) -> Result<()> {
    let rows = y.numel();
    if rows == 0 {
        return Ok(());
    }
    check_rows(op, rows)?;
    let d = x.numel() / rows;
    // SAFETY: row_sum_T(const T* x, T* y, u64 d, float scale), one block per row; x holds
    // rows * d elements, y rows.
    unsafe {
        gpu.launch(
            ROW_SUM.of(x.dtype()),
            launch::per_row(rows),
            &[ptr(x)?, ptr(y)?, Arg::count(d), Arg::F32(scale)],
        )
    }
}

/// `out[j] = sum over rows of x[row, j]` for `x` at `x_ptr` (`[rows, d]` of `dtype`), added
/// in f32 in the workspace `ws` (`column_sum_partials(rows) + 1` rows of `d` f32s) and rounded
/// once into `out: [d]`: per chunk of rows, then over chunks in order, as the host adds.
pub(crate) fn column_sums(
    gpu: &Gpu<'_>,
    x_ptr: u64,
    dtype: DType,
    rows: usize,
    ws: u64,
    out: &mut Tensor,
) -> Result<()> {
    column_sums_into(gpu, x_ptr, dtype, rows, ws, (out.cuda_ptr()?, out.dtype(), out.numel()))
}

/// [`column_sums`] into the `d` elements of `out_dtype` at `out`.
pub(crate) fn column_sums_into(
    gpu: &impl Exec,
    x_ptr: u64,
    dtype: DType,
    rows: usize,
    ws: u64,
    (out, out_dtype, d): (u64, DType, usize),
) -> Result<()> {
    if d == 0 {
        return Ok(());
    }
    let (cfg, chunk) = launch::columns(rows, d);
    // SAFETY: col_sum_T(const T* x, float* partial, u64 rows, u64 d, u64 chunk), grid
    // (columns, chunks); x holds rows * d elements of `dtype`, the partials chunks * d floats
    // (the workspace's layout, `column_partials`).
    unsafe {
        gpu.launch(
            COL_SUM.of(dtype),
            cfg,
            &[
                Arg::Ptr(x_ptr),
                Arg::Ptr(column_partials(ws, rows, d)),
                Arg::count(rows),
                Arg::count(d),
                Arg::count(chunk),
            ],
        )?;
    }
    finish_column_sums(gpu, ws, rows, d)?;
    cast(gpu, ws, DType::F32, out, out_dtype, d)
}

/// Where the first pass of column sums over `[rows, d]` writes its per-chunk partial sums in
/// the workspace `ws`: after the `d` sums when the rows span several chunks, else the sums
/// themselves (one chunk: its partials are the sums).
pub(crate) fn column_partials(ws: u64, rows: usize, d: usize) -> u64 {
    if column_sum_partials(rows) > 0 { ws + d as u64 * 4 } else { ws }
}

/// The second pass of column sums: the first `d` floats of `ws` become the sums, in chunk
/// order, of the partials [`column_partials`] points at (nothing to do for one chunk).
pub(crate) fn finish_column_sums(gpu: &impl Exec, ws: u64, rows: usize, d: usize) -> Result<()> {
    let chunks = column_sum_partials(rows);
    if chunks == 0 || d == 0 {
        return Ok(());
    }
    let (mut cfg, _) = launch::columns(1, d);
    cfg.grid_dim.1 = 1;
    // SAFETY: col_sum_f32(const float* x, float* partial, u64 rows, u64 d, u64 chunk) over
    // the [chunks, d] partials as one chunk: writes the d floats at ws, which the partials
    // (from ws + 4d) do not overlap.
    unsafe {
        gpu.launch(
            COL_SUM.of(DType::F32),
            cfg,
            &[
                Arg::Ptr(column_partials(ws, rows, d)),
                Arg::Ptr(ws),
                Arg::count(chunks),
                Arg::count(d),
                Arg::count(chunks),
            ],
        )
    }
}

/// Per-channel sums of `dy: [batch, c, plane]` (the bias gradient of a convolution) into
/// `out: [c]`: row sums of every (image, channel) plane into `sums` (`batch * c` floats),
/// then column sums over images in the column-sum workspace `ws` (`column_sum_workspace(batch,
/// c)` bytes).
pub(crate) fn channel_sums(
    gpu: &Gpu<'_>,
    dy: &Tensor,
    batch: usize,
    (sums, ws): (u64, u64),
    out: &mut Tensor,
) -> Result<()> {
    let c = out.numel();
    let planes = batch * c;
    if planes == 0 {
        return Ok(());
    }
    check_rows("conv2d_backward", planes)?;
    let plane = dy.numel() / planes;
    // SAFETY: row_sum_f32_T(const T* x, float* y, u64 d), one block per plane; dy holds
    // planes * plane elements, sums planes floats.
    unsafe {
        gpu.launch(
            ROW_SUM_F32.of(dy.dtype()),
            launch::per_row(planes),
            &[ptr(dy)?, Arg::Ptr(sums), Arg::count(plane)],
        )?;
    }
    column_sums(gpu, sums, DType::F32, batch, ws, out)
}

/// `dx[i] = dy[i / d] * factor` with `dx: [dy.numel() * d]`.
pub(crate) fn broadcast_rows(
    gpu: &Gpu<'_>,
    dy: &Tensor,
    factor: f32,
    dx: &mut Tensor,
) -> Result<()> {
    let n = dx.numel();
    if n == 0 {
        return Ok(());
    }
    let d = n / dy.numel();
    // SAFETY: broadcast_rows_T(const T* dy, float f, T* dx, u64 n, Div d); dx holds n
    // elements and dy n / d.
    unsafe {
        gpu.launch(
            BROADCAST_ROWS.of(dx.dtype()),
            grid(n),
            &[ptr(dy)?, Arg::F32(factor), ptr(dx)?, Arg::count(n), Arg::div(d)],
        )
    }
}

/// Copies host u32 values (targets, token ids) into the device buffer at `dst`, which holds
/// at least `data.len()` of them.
pub(crate) fn upload_u32(gpu: &Gpu<'_>, data: &[u32], dst: u64) -> Result<()> {
    gpu.copy_to_device(dst, crate::storage::as_bytes(data))
}
