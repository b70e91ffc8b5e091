//! Sum and mean, over the whole tensor (to a host scalar) or over the last dimension, and
//! their backward.

use super::dispatch::{Buffers, Op, Plan, run};
use super::rows_cols;
use crate::cpu::reduce as cpu;
use crate::device::Device;
use crate::dtype::{DType, with_dtype};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Threads per block of the GPU's first summation pass.
const SUM_THREADS: usize = 256;
/// Most blocks of that pass.
const SUM_BLOCKS: usize = 1024;

/// The workspaces of a whole-tensor sum of `n` elements on a GPU, in bytes: one f32
/// partial sum per block of the first pass, and the f32 total.
pub(crate) fn sum_workspaces(n: usize) -> (usize, usize) {
    if n == 0 {
        return (0, 0);
    }
    (n.div_ceil(SUM_THREADS).min(SUM_BLOCKS) * 4, 4)
}

/// The f32 workspace of column sums over `[rows, d]` on a GPU, in bytes: the `d` sums, and,
/// when the rows span more than one chunk of
/// [`COLUMN_SUM_ROWS`](crate::cpu::elementwise::COLUMN_SUM_ROWS), one partial sum per chunk
/// and column, which a second pass adds in chunk order (no atomics: the sums repeat bit for
/// bit, and equal the host's). Every backend allocates it, so that memory figures agree.
pub(crate) fn column_sum_workspace(op: &'static str, rows: usize, d: usize) -> Result<usize> {
    let partials = crate::cpu::elementwise::column_sum_partials(rows);
    let floats = crate::params::mul(op, "the column sums", partials + 1, d)?;
    crate::params::mul(op, "the column sums", floats, 4)
}

/// The sum of all elements, accumulated in f32 (pairwise on the host).
///
/// # Errors
///
/// [`Error::NoValues`] on a virtual device; [`Error::Device`] if the read back from a GPU
/// fails.
pub fn sum(x: &Tensor) -> Result<f32> {
    run(Sum { x, total: 0.0, ws: [None; 2] })
}

/// The mean of all elements in f32 (NaN for an empty tensor, as in PyTorch).
///
/// # Errors
///
/// As [`sum`].
pub fn mean(x: &Tensor) -> Result<f32> {
    Ok(sum(x)? / x.numel() as f32)
}

/// A whole-tensor sum read back to the host.
struct Sum<'a> {
    x: &'a Tensor,
    total: f32,
    /// The partial sums and the total on the device.
    ws: [Option<usize>; 2],
}

impl Op for Sum<'_> {
    const NAME: &'static str = "sum";
    type Outs = ();
    type Output = f32;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        if self.x.device().is_virtual() {
            return Err(Error::NoValues { op: Self::NAME });
        }
        let mut plan = Plan::none();
        let (partial, total) = sum_workspaces(self.x.numel());
        self.ws = [plan.workspace(partial), plan.workspace(total)];
        Ok(plan)
    }

    fn host(&mut self, _: &mut Buffers<Self::Outs>) -> Result<()> {
        self.total = with_dtype!(self.x.dtype(), T => cpu::sum(self.x.as_slice::<T>()?));
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let n = self.x.numel();
        let blocks = sum_workspaces(n).0 / 4;
        let (partial, total) = (bufs.ws(self.ws[0])?, bufs.ws(self.ws[1])?);
        self.total = crate::cuda::helpers::sum(
            gpu,
            self.x.cuda_ptr()?,
            self.x.dtype(),
            n,
            (partial, blocks),
            total,
        )?;
        Ok(())
    }

    fn finish(self, _: Buffers<Self::Outs>) -> Result<f32> {
        Ok(self.total)
    }
}

/// Gradient of [`sum`]: a tensor of `shape` and `dtype` on `device` filled with `dy`.
///
/// # Errors
///
/// Out of memory.
pub fn sum_backward(dy: f32, device: &Device, shape: &[usize], dtype: DType) -> Result<Tensor> {
    Tensor::full(device, shape, dtype, dy)
}

/// Gradient of [`mean`]: a tensor of `shape` and `dtype` on `device` filled with
/// `dy / numel`.
///
/// # Errors
///
/// Out of memory; [`Error::InvalidArgument`] if `shape` overflows.
pub fn mean_backward(dy: f32, device: &Device, shape: &[usize], dtype: DType) -> Result<Tensor> {
    let n = crate::params::product("mean_backward", "the shape", shape)?;
    Tensor::full(device, shape, dtype, dy / n as f32)
}

/// Row sums of `x: [.., d]`, shape `[..]`.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a rank-0 `x`; out of memory.
pub fn sum_last_dim(x: &Tensor) -> Result<Tensor> {
    run(RowReduce { x, mean: false })
}

/// Row means of `x: [.., d]`, shape `[..]` (NaN rows when `d == 0`).
///
/// # Errors
///
/// As [`sum_last_dim`].
pub fn mean_last_dim(x: &Tensor) -> Result<Tensor> {
    run(RowReduce { x, mean: true })
}

/// Row sums or means.
struct RowReduce<'a> {
    x: &'a Tensor,
    mean: bool,
}

impl Op for RowReduce<'_> {
    const NAME: &'static str = "sum_last_dim";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        rows_cols(Self::NAME, self.x.shape())?;
        Ok(Plan::one(&self.x.shape()[..self.x.rank() - 1], self.x.dtype()))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        with_dtype!(self.x.dtype(), T => {
            let (x, out) = (self.x.as_slice::<T>()?, bufs.out().out_slice::<T>(Self::NAME)?);
            if self.mean { cpu::mean_last_dim(x, out) } else { cpu::sum_last_dim(x, out) }
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let (_, d) = rows_cols(Self::NAME, self.x.shape())?;
        let scale = if self.mean { 1.0 / d as f32 } else { 1.0 };
        crate::cuda::helpers::row_sum(gpu, Self::NAME, self.x, bufs.out(), scale)
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

/// Gradient of [`sum_last_dim`] for rows of length `d`: `dy: [..]` broadcast to `[.., d]`.
///
/// # Errors
///
/// Out of memory.
pub fn sum_last_dim_backward(dy: &Tensor, d: usize) -> Result<Tensor> {
    run(RowBroadcast { dy, d, mean: false })
}

/// Gradient of [`mean_last_dim`] for rows of length `d`: `dy / d` broadcast to `[.., d]`.
///
/// # Errors
///
/// Out of memory.
pub fn mean_last_dim_backward(dy: &Tensor, d: usize) -> Result<Tensor> {
    run(RowBroadcast { dy, d, mean: true })
}

/// `dy` (times `1 / d` for a mean) broadcast over rows of `d`.
struct RowBroadcast<'a> {
    dy: &'a Tensor,
    d: usize,
    mean: bool,
}

impl Op for RowBroadcast<'_> {
    const NAME: &'static str = "sum_last_dim_backward";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.dy.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        let mut shape = self.dy.shape().to_vec();
        shape.push(self.d);
        Ok(Plan::one(&shape, self.dy.dtype()))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        with_dtype!(self.dy.dtype(), T => {
            let (dy, dx) = (self.dy.as_slice::<T>()?, bufs.out().out_slice::<T>(Self::NAME)?);
            if self.mean {
                cpu::mean_last_dim_backward(dy, dx)
            } else {
                cpu::sum_last_dim_backward(dy, dx)
            }
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let factor = if self.mean { 1.0 / self.d as f32 } else { 1.0 };
        crate::cuda::helpers::broadcast_rows(gpu, self.dy, factor, bufs.out())
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}
