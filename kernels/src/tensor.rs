//! [`Tensor`]: a dense, row-major array on a [`Device`], and [`Indices`], the u32 buffers
//! some ops save for their backward. This module is the data model and its reads; the ops
//! that make and change tensors (zeros, fills, casts, copies, uploads, in-place writes)
//! live in [`crate::ops`].
//!
//! A tensor's memory is one block from its device's caching allocator, so its bytes show in
//! the allocator's statistics for exactly as long as some handle to them lives. Tensors
//! are shared, not copied: `clone` is a second handle to the same block (as a second Python
//! reference to a PyTorch tensor is), and the block returns to the cache when the last
//! handle goes. Writes are copy-on-write: an in-place op on a shared tensor first copies
//! the block, so no handle ever sees another's writes. Copies are explicit
//! ([`Tensor::try_clone`], [`Tensor::to_dtype`], [`Tensor::to_device`]) because they
//! allocate and can run out of memory. There are no views: `reshape` keeps the block.
//!
//! Host memory is readable in place ([`Tensor::as_slice`]); CUDA memory is read by a copy
//! ([`Tensor::to_vec`], [`Tensor::to_f32_vec`]); a virtual device has no values, and every
//! read is an [`Error::NoValues`].

use crate::device::Device;
use crate::dtype::{DType, Element, with_dtype};
use crate::error::{Error, Result};
use crate::storage::Storage;
use half::{bf16, f16};
use std::any::TypeId;
use std::fmt;
use std::sync::Arc;

/// The number of elements of `shape`, and its size in bytes for elements of `elem_bytes`,
/// checked for overflow.
pub(crate) fn checked_len(
    op: &'static str,
    shape: &[usize],
    elem_bytes: usize,
) -> Result<(usize, usize)> {
    let overflow = || Error::InvalidArgument {
        op,
        reason: format!(
            "shape {shape:?} of {elem_bytes}-byte elements has more bytes than memory can address"
        ),
    };
    let numel = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).ok_or_else(overflow)?;
    let bytes = numel.checked_mul(elem_bytes).ok_or_else(overflow)?;
    // Allocation sizes are rounded up and added to byte counters: keep far from the edge.
    if bytes > isize::MAX as usize / 2 {
        return Err(overflow());
    }
    Ok((numel, bytes))
}

/// Checks that `T` is the very type that stores `T::DTYPE` (f32, f16 or bf16), so a byte
/// buffer of that dtype may be viewed as `[T]`.
pub(crate) fn check_element<T: Element>(op: &'static str, dtype: DType) -> Result<()> {
    if T::DTYPE != dtype {
        return Err(Error::DTypeMismatch { op, lhs: dtype, rhs: T::DTYPE });
    }
    let native = match T::DTYPE {
        DType::F32 => TypeId::of::<f32>(),
        DType::F16 => TypeId::of::<f16>(),
        DType::BF16 => TypeId::of::<bf16>(),
    };
    if TypeId::of::<T>() != native {
        return Err(Error::InvalidArgument {
            op,
            reason: format!(
                "{} is not the storage type of {dtype}; use f32, half::f16 or half::bf16",
                std::any::type_name::<T>()
            ),
        });
    }
    Ok(())
}

/// Views bytes as plain-data elements.
///
/// # Safety
///
/// Every bit pattern must be a valid `T` (f32, f16, bf16 or u32 here).
unsafe fn cast_slice<T: Copy>(bytes: &[u8]) -> &[T] {
    let len = bytes.len() / std::mem::size_of::<T>();
    if len == 0 {
        return &[];
    }
    debug_assert_eq!(bytes.as_ptr().align_offset(std::mem::align_of::<T>()), 0);
    // SAFETY: any bit pattern is a valid `T` (the caller's contract); allocator blocks are
    // 512-byte aligned, more than any `T` here needs, and `len * size_of::<T>()` bytes lie
    // within `bytes`, borrowed for the result's lifetime.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), len) }
}

/// Views bytes as plain-data elements, mutably.
///
/// # Safety
///
/// As [`cast_slice`].
pub(crate) unsafe fn cast_slice_mut<T: Copy>(bytes: &mut [u8]) -> &mut [T] {
    let len = bytes.len() / std::mem::size_of::<T>();
    if len == 0 {
        return &mut [];
    }
    debug_assert_eq!(bytes.as_ptr().align_offset(std::mem::align_of::<T>()), 0);
    // SAFETY: as in `cast_slice`; the exclusive borrow of `bytes` is handed on, and every
    // value written through the result is a valid `T`, hence valid bytes.
    unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<T>(), len) }
}

/// A dense row-major array of f32, f16 or bf16 on a [`Device`].
///
/// `Clone` is cheap and shares the memory, like a second reference to a PyTorch tensor: a
/// layer keeps its input for backward by cloning it, without a copy. The memory goes back to
/// the device's cache when the last clone is dropped. Writing in place (`as_mut_slice`,
/// `fill`, `ops::add_assign`, optimizer steps) first copies the memory if a clone shares it
/// (copy-on-write), so no clone ever sees another's writes. [`try_clone`](Self::try_clone)
/// makes a deep copy.
#[derive(Clone)]
pub struct Tensor {
    storage: Arc<Storage>,
    shape: Vec<usize>,
    dtype: DType,
    device: Device,
}

impl Tensor {
    /// A tensor over `storage`, which holds `shape` elements of `dtype`.
    pub(crate) fn from_storage(
        device: &Device,
        storage: Storage,
        shape: &[usize],
        dtype: DType,
    ) -> Tensor {
        Tensor { storage: Arc::new(storage), shape: shape.to_vec(), dtype, device: device.clone() }
    }

    /// Whether another clone shares this tensor's memory.
    pub fn is_shared(&self) -> bool {
        Arc::strong_count(&self.storage) > 1
    }

    /// The storage, when no clone shares it.
    pub(crate) fn unique_storage(&mut self) -> Option<&mut Storage> {
        Arc::get_mut(&mut self.storage)
    }

    /// Replaces the storage with `copy`'s (copy-on-write: `copy` is a fresh copy of this
    /// tensor).
    pub(crate) fn adopt_storage(&mut self, copy: Tensor) {
        self.storage = copy.storage;
    }

    /// The storage, for reading.
    pub(crate) fn storage(&self) -> &Storage {
        &self.storage
    }

    /// The elements, copied into a vector (a device-to-host copy for a CUDA tensor).
    ///
    /// # Errors
    ///
    /// [`Error::DTypeMismatch`] if `T` is not the tensor's dtype; [`Error::NoValues`] on a
    /// virtual device; [`Error::Device`] if the copy from a CUDA device fails.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = self.device.cuda_backend() {
            check_element::<T>("to_vec", self.dtype)?;
            let mut out = vec![T::default(); self.numel()];
            cuda.copy_to_host(crate::storage::as_bytes_mut(&mut out), self.cuda_ptr()?)?;
            return Ok(out);
        }
        Ok(self.as_slice::<T>()?.to_vec())
    }

    /// The elements converted to f32 (exact for every dtype), copied from the device.
    ///
    /// # Errors
    ///
    /// [`Error::NoValues`] on a virtual device; [`Error::Device`] if the copy from a CUDA
    /// device fails; never on the host.
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        let mut out = vec![0.0f32; self.numel()];
        if self.device.is_cuda() {
            with_dtype!(self.dtype, T => {
                crate::cpu::elementwise::cast(&self.to_vec::<T>()?, &mut out)?
            });
            return Ok(out);
        }
        with_dtype!(self.dtype, T => {
            crate::cpu::elementwise::cast(self.as_slice::<T>()?, &mut out)?
        });
        Ok(out)
    }

    /// The elements as a slice of `T`.
    ///
    /// # Errors
    ///
    /// [`Error::DTypeMismatch`] if `T` is not the tensor's dtype; [`Error::Unsupported`] for
    /// a CUDA tensor (the host cannot address device memory: use [`to_vec`](Self::to_vec));
    /// [`Error::NoValues`] on a virtual device.
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        check_element::<T>("as_slice", self.dtype)?;
        // SAFETY: `T` is f32, f16 or bf16 (checked above): every bit pattern is valid.
        Ok(unsafe { cast_slice(self.storage.bytes("as_slice")?) })
    }

    /// The elements as a mutable slice of `T`, for ops writing their fresh outputs (never
    /// shared: the op made them).
    pub(crate) fn out_slice<T: Element>(&mut self, op: &'static str) -> Result<&mut [T]> {
        check_element::<T>(op, self.dtype)?;
        let storage = self.unique_storage().ok_or_else(|| shared(op))?;
        // SAFETY: as in `as_slice`.
        Ok(unsafe { cast_slice_mut(storage.bytes_mut(op)?) })
    }

    /// The bytes as u32 values, for index outputs (an [`Indices`] in the making).
    pub(crate) fn out_u32(&mut self, op: &'static str) -> Result<&mut [u32]> {
        let storage = self.unique_storage().ok_or_else(|| shared(op))?;
        // SAFETY: every bit pattern is a valid u32.
        Ok(unsafe { cast_slice_mut(storage.bytes_mut(op)?) })
    }

    /// The raw bytes, mutably, for ops writing a fresh output.
    pub(crate) fn out_bytes(&mut self, op: &'static str) -> Result<&mut [u8]> {
        self.unique_storage().ok_or_else(|| shared(op))?.bytes_mut(op)
    }

    /// The device address of a CUDA tensor's first element.
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_ptr(&self) -> Result<u64> {
        self.storage.cuda_ptr("cuda kernel")
    }

    /// The device address (`CUdeviceptr`) of a CUDA tensor's first element, for libraries
    /// that work on raw device memory (NCCL). Work that writes through it must be ordered on
    /// [`Device::cuda_stream`] and must only write a tensor that no clone shares
    /// ([`is_shared`](Self::is_shared) false), or other clones would see the writes.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] if the tensor is not on a CUDA device.
    #[cfg(feature = "cuda")]
    pub fn cuda_device_ptr(&self) -> Result<u64> {
        self.cuda_ptr()
    }

    /// The dimensions, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// The number of elements (1 for a rank-0 tensor, 0 if any dimension is 0).
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device holding the tensor.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Bytes of element data: `numel * dtype.size_in_bytes()` (the allocator rounds the
    /// block it reserves up to 512 bytes).
    pub fn size_in_bytes(&self) -> usize {
        self.storage.len()
    }

    /// The same elements under a new shape with as many elements; no copy.
    ///
    /// # Errors
    ///
    /// [`Error::ShapeMismatch`] if the element counts differ. The tensor is dropped then;
    /// use [`set_shape`](Self::set_shape) to keep it on failure.
    pub fn reshape(mut self, shape: &[usize]) -> Result<Tensor> {
        self.set_shape(shape)?;
        Ok(self)
    }

    /// Gives the tensor a new shape with as many elements; no copy.
    ///
    /// # Errors
    ///
    /// [`Error::ShapeMismatch`] if the element counts differ; the shape is unchanged then.
    pub fn set_shape(&mut self, shape: &[usize]) -> Result<()> {
        let (numel, _) = checked_len("reshape", shape, self.dtype.size_in_bytes())?;
        if numel != self.numel() {
            return Err(Error::ShapeMismatch {
                op: "reshape",
                lhs: self.shape.clone(),
                rhs: shape.to_vec(),
            });
        }
        self.shape = shape.to_vec();
        Ok(())
    }
}

/// The error for a write to memory another handle shares (an op forgot copy-on-write).
pub(crate) fn shared(op: &'static str) -> Error {
    Error::InvalidArgument { op, reason: "the tensor's memory is shared; copy it first".into() }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor({:?}, {}, {})", self.shape, self.dtype, self.device.name())
    }
}

/// Checks that `len` values fill `shape`.
pub(crate) fn check_data_len(op: &'static str, shape: &[usize], len: usize) -> Result<()> {
    let (numel, _) = checked_len(op, shape, 1)?;
    if numel != len {
        return Err(Error::ShapeMismatch { op, lhs: shape.to_vec(), rhs: vec![len] });
    }
    Ok(())
}

/// A dense row-major array of u32 indices on a [`Device`] (the argmax a max pool saves for
/// its backward). Like [`Tensor`], its memory comes from the device's allocator.
pub struct Indices {
    storage: Arc<Storage>,
    shape: Vec<usize>,
    device: Device,
}

impl Indices {
    /// Indices over a tensor's memory (an op's index output, allocated as 4-byte elements).
    pub(crate) fn from_tensor(t: Tensor) -> Indices {
        Indices { storage: t.storage, shape: t.shape, device: t.device }
    }

    /// The indices, borrowed from host memory.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] for indices in CUDA device memory (use
    /// [`to_vec`](Self::to_vec)); [`Error::NoValues`] on a virtual device.
    pub fn as_slice(&self) -> Result<&[u32]> {
        // SAFETY: every bit pattern is a valid u32.
        Ok(unsafe { cast_slice(self.storage.bytes("Indices::as_slice")?) })
    }

    /// The indices, copied to a vector (a device-to-host copy on a CUDA device).
    ///
    /// # Errors
    ///
    /// [`Error::NoValues`] on a virtual device; [`Error::Device`] if the copy from a CUDA
    /// device fails.
    pub fn to_vec(&self) -> Result<Vec<u32>> {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = self.device.cuda_backend() {
            let mut out = vec![0u32; self.storage.len() / 4];
            cuda.copy_to_host(crate::storage::as_bytes_mut(&mut out), self.cuda_ptr()?)?;
            return Ok(out);
        }
        Ok(self.as_slice()?.to_vec())
    }

    /// The device address of CUDA indices.
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_ptr(&self) -> Result<u64> {
        self.storage.cuda_ptr("cuda kernel")
    }

    /// The dimensions, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The number of indices.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The device holding the indices.
    pub fn device(&self) -> &Device {
        &self.device
    }
}

impl fmt::Debug for Indices {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Indices({:?}, {})", self.shape, self.device.name())
    }
}
