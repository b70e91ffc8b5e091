//! Pooling on CUDA (`pool.cu`); the global average pool reuses the row sums.

use super::elementwise::{broadcast_rows, from_f32};
use super::reduce::row_sum;
use super::{ptr, zeroed_f32};
use crate::cpu::pool::Pool2dParams;
use crate::cuda::launch::{PoolGeom, elementwise as grid};
use crate::cuda::registry::{AVG_POOL, AVG_POOL_BWD, MAX_POOL, MAX_POOL_BWD};
use crate::cuda::{Arg, CudaBackend};
use crate::error::Result;
use crate::tensor::{Indices, Tensor};

fn geom(p: &Pool2dParams) -> PoolGeom {
    let (oh, ow) = p.output_hw();
    let i = |v: usize| v as i64;
    PoolGeom {
        batch: i(p.batch),
        channels: i(p.channels),
        h: i(p.h),
        w: i(p.w),
        kh: i(p.kernel.0),
        kw: i(p.kernel.1),
        sh: i(p.stride.0),
        sw: i(p.stride.1),
        ph: i(p.padding.0),
        pw: i(p.padding.1),
        oh: i(oh),
        ow: i(ow),
    }
}

/// Max pool with argmax.
pub(crate) fn max_pool2d(
    cu: &CudaBackend,
    p: &Pool2dParams,
    x: &Tensor,
    y: &mut Tensor,
    arg: &mut Indices,
) -> Result<()> {
    // SAFETY: max_pool_T(const T* x, T* y, u32* arg, PoolGeom g); x, y and arg have the
    // geometry's shapes.
    unsafe {
        cu.launch(
            MAX_POOL.of(x.dtype()),
            grid(y.numel()),
            &[ptr(x)?, ptr(y)?, Arg::Ptr(arg.cuda_ptr()?), Arg::Pool(geom(p))],
        )
    }
}

/// Max-pool gradient: scatter-add through argmax into an f32 accumulator, rounded once.
/// Indices outside the input plane are skipped (they cannot come from [`max_pool2d`]).
pub(crate) fn max_pool2d_backward(
    cu: &CudaBackend,
    p: &Pool2dParams,
    dy: &Tensor,
    arg: &Indices,
    dx: &mut Tensor,
) -> Result<()> {
    let acc = zeroed_f32(cu, dx.numel())?;
    // SAFETY: max_pool_bwd_T(const T* dy, const u32* arg, float* acc, PoolGeom g); dy and
    // arg have the pooled shape, acc the input's; the kernel skips indices >= h * w.
    unsafe {
        cu.launch(
            MAX_POOL_BWD.of(dy.dtype()),
            grid(dy.numel()),
            &[ptr(dy)?, Arg::Ptr(arg.cuda_ptr()?), Arg::Ptr(acc.ptr()), Arg::Pool(geom(p))],
        )?;
    }
    from_f32(cu, acc.ptr(), dx)
}

/// Average pool.
pub(crate) fn avg_pool2d(
    cu: &CudaBackend,
    p: &Pool2dParams,
    x: &Tensor,
    y: &mut Tensor,
    include_pad: bool,
) -> Result<()> {
    // SAFETY: avg_pool_T(const T* x, T* y, PoolGeom g, u32 include_pad); shapes from the
    // geometry.
    unsafe {
        cu.launch(
            AVG_POOL.of(x.dtype()),
            grid(y.numel()),
            &[ptr(x)?, ptr(y)?, Arg::Pool(geom(p)), Arg::U32(include_pad as u32)],
        )
    }
}

/// Average-pool gradient, gathered per input element.
pub(crate) fn avg_pool2d_backward(
    cu: &CudaBackend,
    p: &Pool2dParams,
    dy: &Tensor,
    dx: &mut Tensor,
    include_pad: bool,
) -> Result<()> {
    let (oh, ow) = p.output_hw();
    if oh * ow == 0 {
        return cu.zero(dx.cuda_ptr()?, dx.size_in_bytes());
    }
    // SAFETY: avg_pool_bwd_T(const T* dy, T* dx, PoolGeom g, u32 include_pad); shapes from
    // the geometry.
    unsafe {
        cu.launch(
            AVG_POOL_BWD.of(dy.dtype()),
            grid(dx.numel()),
            &[ptr(dy)?, ptr(dx)?, Arg::Pool(geom(p)), Arg::U32(include_pad as u32)],
        )
    }
}

/// Global average pool: row means of `[planes, hw]`.
pub(crate) fn global_avg_pool(
    cu: &CudaBackend,
    x: &Tensor,
    y: &mut Tensor,
    hw: usize,
) -> Result<()> {
    row_sum(cu, x, y, 1.0 / hw as f32)
}

/// Its gradient: `dy / hw` broadcast over each plane.
pub(crate) fn global_avg_pool_backward(
    cu: &CudaBackend,
    dy: &Tensor,
    dx: &mut Tensor,
    hw: usize,
) -> Result<()> {
    broadcast_rows(cu, dy, 1.0 / hw as f32, dx)
}
