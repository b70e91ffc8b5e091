//! The CUDA side of every op: launches on tensors the op layer ([`crate::ops`]) has already
//! checked (shapes, dtypes, devices) and allocated. Each function documents the kernel it
//! launches; each launch states why its arguments fit the kernel.

pub(crate) mod conv;
pub(crate) mod elementwise;
pub(crate) mod matmul;
pub(crate) mod nn;
pub(crate) mod pool;
pub(crate) mod reduce;

use super::{Arg, CudaBackend};
use crate::error::Result;
use crate::tensor::Tensor;

/// A tensor's device pointer as a kernel argument.
pub(crate) fn ptr(t: &Tensor) -> Result<Arg> {
    Ok(Arg::Ptr(t.cuda_ptr()?))
}

/// An f32 scratch buffer of `n` elements from the device's cache, zeroed.
pub(crate) fn zeroed_f32(
    cu: &CudaBackend,
    n: usize,
) -> Result<vram_alloc::Allocation<vram_alloc::cuda::CudaMemory>> {
    let buf = cu.allocate(n * 4)?;
    cu.zero(buf.ptr(), n * 4)?;
    Ok(buf)
}
