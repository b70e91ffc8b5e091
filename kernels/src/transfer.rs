//! Page-locked (pinned) host buffers and asynchronous host-to-device copies on a second
//! stream, so that the next batch's copy overlaps the current batch's compute.
//!
//! On a CUDA device, [`PinnedBuffer`] is `cuMemHostAlloc` memory and [`Device::upload_async`]
//! copies it on a non-blocking transfer stream, recording an event that the compute stream
//! waits on in [`Upload::wait`]. On the host backend there is nothing to transfer: the buffer
//! is plain memory, the "upload" is a copy into a new tensor, and [`Upload::is_async`] says so.

use crate::{DType, Device, Error, Result, Tensor};
use std::marker::PhantomData;

/// A host buffer for host-to-device copies: page-locked on CUDA devices, plain memory on the
/// host backend.
pub struct PinnedBuffer {
    device: Device,
    memory: Memory,
    len: usize,
}

enum Memory {
    Plain(Vec<u8>),
    #[cfg(feature = "cuda")]
    Locked(*mut u8),
}

// SAFETY: the page-locked pointer is owned by this buffer alone (like a Box) and freed once,
// on drop; access goes through `&self` / `&mut self`.
unsafe impl Send for PinnedBuffer {}
// SAFETY: shared access only reads.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// A zeroed buffer of `bytes` bytes for uploads to `device`.
    ///
    /// # Errors
    ///
    /// [`Error::Device`] if the driver cannot page-lock the memory.
    pub fn new(device: &Device, bytes: usize) -> Result<PinnedBuffer> {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = device.cuda_backend() {
            let ptr = cuda.alloc_pinned(bytes)?;
            // SAFETY: `ptr` holds at least `bytes` (>= 1) writable bytes just allocated.
            unsafe { std::ptr::write_bytes(ptr, 0, bytes) };
            return Ok(PinnedBuffer {
                device: device.clone(),
                memory: Memory::Locked(ptr),
                len: bytes,
            });
        }
        Ok(PinnedBuffer {
            device: device.clone(),
            memory: Memory::Plain(vec![0; bytes]),
            len: bytes,
        })
    }

    /// Whether the memory is page-locked (false on the host backend).
    pub fn is_page_locked(&self) -> bool {
        !matches!(self.memory, Memory::Plain(_))
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        match &self.memory {
            Memory::Plain(v) => v,
            // SAFETY: `p` holds `len` initialised bytes owned by this buffer.
            #[cfg(feature = "cuda")]
            Memory::Locked(p) => unsafe { std::slice::from_raw_parts(*p, self.len) },
        }
    }

    /// The bytes, mutably.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.memory {
            Memory::Plain(v) => v,
            // SAFETY: as in `bytes`; `&mut self` makes this the only access.
            #[cfg(feature = "cuda")]
            Memory::Locked(p) => unsafe { std::slice::from_raw_parts_mut(*p, self.len) },
        }
    }

    /// Writes `values` converted to `dtype` at the start of the buffer.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if they do not fit.
    pub fn write_f32(&mut self, values: &[f32], dtype: DType) -> Result<()> {
        let need = values.len() * dtype.size_in_bytes();
        if need > self.len {
            return Err(Error::InvalidArgument {
                op: "PinnedBuffer::write_f32",
                reason: format!("{need} bytes do not fit in a buffer of {}", self.len),
            });
        }
        let dst = &mut self.bytes_mut()[..need];
        match dtype {
            DType::F32 => dst
                .chunks_exact_mut(4)
                .zip(values)
                .for_each(|(d, v)| d.copy_from_slice(&v.to_ne_bytes())),
            DType::F16 => dst
                .chunks_exact_mut(2)
                .zip(values)
                .for_each(|(d, &v)| d.copy_from_slice(&half::f16::from_f32(v).to_ne_bytes())),
            DType::BF16 => dst
                .chunks_exact_mut(2)
                .zip(values)
                .for_each(|(d, &v)| d.copy_from_slice(&half::bf16::from_f32(v).to_ne_bytes())),
        }
        Ok(())
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        #[cfg(feature = "cuda")]
        if let (Memory::Locked(p), Some(cuda)) = (&self.memory, self.device.cuda_backend()) {
            // Copies from this buffer must be finished before it goes: wait for the device.
            let _ = cuda.synchronize_all();
            // SAFETY: `p` came from `alloc_pinned`, and no copy reads it any more.
            unsafe { cuda.free_pinned(*p) };
        }
    }
}

/// A copy in flight into a new tensor; [`Upload::wait`] hands the tensor to the compute
/// stream. It borrows the buffer, which must not change until the copy is done.
pub struct Upload<'a> {
    tensor: Tensor,
    #[cfg(feature = "cuda")]
    event: Option<cudarc::driver::CudaEvent>,
    _buffer: PhantomData<&'a PinnedBuffer>,
}

impl Upload<'_> {
    /// Whether the copy really runs asynchronously (false on the host backend, where it is a
    /// plain copy made at once).
    pub fn is_async(&self) -> bool {
        #[cfg(feature = "cuda")]
        if self.event.is_some() {
            return true;
        }
        false
    }

    /// Makes the compute stream wait for the copy and returns the tensor.
    ///
    /// # Errors
    ///
    /// [`Error::Device`] if the driver fails.
    pub fn wait(self) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let (Some(event), Some(cuda)) = (&self.event, self.tensor.device().cuda_backend()) {
            cuda.wait_for(event)?;
        }
        Ok(self.tensor)
    }
}

impl Device {
    /// Starts copying the first `numel(shape) * dtype` bytes of `buffer` into a new tensor on
    /// this device. On CUDA the copy runs on a transfer stream and overlaps compute queued
    /// meanwhile; on the host it is a plain copy.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if the buffer is too small or belongs to another device;
    /// [`Error::OutOfMemory`].
    pub fn upload_async<'a>(
        &self,
        buffer: &'a PinnedBuffer,
        shape: &[usize],
        dtype: DType,
    ) -> Result<Upload<'a>> {
        const OP: &str = "Device::upload_async";
        let (_, bytes) = crate::tensor::checked_len(OP, shape, dtype.size_in_bytes())?;
        if bytes > buffer.len() {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!(
                    "shape {shape:?} of {dtype} needs {bytes} bytes; the buffer has {}",
                    buffer.len()
                ),
            });
        }
        if buffer.device != *self {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: "the buffer was made for another device".into(),
            });
        }
        #[cfg(feature = "cuda")]
        if let Some(cuda) = self.cuda_backend() {
            // SAFETY: the returned `Upload` borrows `buffer`, so it stays alive and unchanged
            // until the caller lets go of the upload; `PinnedBuffer`'s drop waits for the device.
            let (block, event) = unsafe { cuda.upload(&buffer.bytes()[..bytes]) }?;
            return Ok(Upload {
                tensor: Tensor::from_storage(
                    self,
                    crate::storage::Storage::Cuda(block),
                    shape,
                    dtype,
                ),
                event: Some(event),
                _buffer: PhantomData,
            });
        }
        let tensor = Tensor::from_bytes(self, shape, dtype, &buffer.bytes()[..bytes])?;
        Ok(Upload {
            tensor,
            #[cfg(feature = "cuda")]
            event: None,
            _buffer: PhantomData,
        })
    }
}
