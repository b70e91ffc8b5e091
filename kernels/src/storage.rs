//! The bytes behind tensors, indices and op workspaces: one block of a device's caching
//! allocator, whichever memory backs it.

use crate::error::{Error, Result};
use vram_alloc::{Allocation, HostMemory, VirtualMemory};

/// A block of the device's caching allocator.
pub(crate) enum Storage {
    /// Host memory: addressable here, computed on by the CPU reference.
    Host(Allocation<HostMemory>),
    /// Addresses only: sizes and statistics, no bytes.
    Virtual(Allocation<VirtualMemory>),
    /// CUDA device memory.
    #[cfg(feature = "cuda")]
    Cuda(Allocation<vram_alloc::cuda::CudaMemory>),
}

impl Storage {
    /// The size requested, in bytes.
    pub(crate) fn len(&self) -> usize {
        match self {
            Storage::Host(a) => a.len(),
            Storage::Virtual(a) => a.len(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(a) => a.len(),
        }
    }

    /// The block's address (a host pointer, a virtual address or a `CUdeviceptr`).
    pub(crate) fn address(&self) -> u64 {
        match self {
            Storage::Host(a) => a.ptr(),
            Storage::Virtual(a) => a.ptr(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(a) => a.ptr(),
        }
    }

    /// The host bytes; an error for device memory and for virtual memory.
    pub(crate) fn bytes(&self, op: &'static str) -> Result<&[u8]> {
        match self {
            Storage::Host(a) => Ok(a.as_bytes()),
            Storage::Virtual(_) => Err(Error::NoValues { op }),
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => Err(on_device(op)),
        }
    }

    /// The host bytes, mutably; an error for device memory and for virtual memory.
    pub(crate) fn bytes_mut(&mut self, op: &'static str) -> Result<&mut [u8]> {
        match self {
            Storage::Host(a) => Ok(a.as_bytes_mut()),
            Storage::Virtual(_) => Err(Error::NoValues { op }),
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => Err(on_device(op)),
        }
    }

    /// The device address of CUDA memory.
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_ptr(&self, op: &'static str) -> Result<u64> {
        match self {
            Storage::Cuda(a) => Ok(a.ptr()),
            _ => Err(Error::Unsupported(format!(
                "{op}: the memory is not on a CUDA device; CUDA kernels need CUDA tensors \
                 (use `to_device`)"
            ))),
        }
    }
}

/// The error for host access to device memory.
#[cfg(feature = "cuda")]
pub(crate) fn on_device(op: &'static str) -> Error {
    Error::Unsupported(format!(
        "{op}: the tensor lives in CUDA device memory, which the host cannot address; copy it \
         with `to_vec`, `to_f32_vec` or `to_device`"
    ))
}

/// Views plain-data elements as bytes (for copies between the host and a device).
#[cfg(feature = "cuda")]
pub(crate) fn as_bytes<T: Copy>(data: &[T]) -> &[u8] {
    // SAFETY: `T` is plain data (f32, f16, bf16 or u32 here) without padding; the bytes
    // are borrowed for as long as `data` is.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data)) }
}

/// Views plain-data elements as bytes, mutably (for device-to-host copies).
#[cfg(feature = "cuda")]
pub(crate) fn as_bytes_mut<T: Copy>(data: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`; every byte pattern is a valid f32, f16, bf16 or u32, so any
    // bytes written through the result leave valid values.
    unsafe {
        std::slice::from_raw_parts_mut(data.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(data))
    }
}
