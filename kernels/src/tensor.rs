//! [`Tensor`]: a dense, row-major, uniquely owned array on a [`Device`], and [`Indices`],
//! the u32 buffers some ops save for their backward.
//!
//! A tensor owns one block from its device's caching allocator (no sharing, no views), so
//! its bytes show in the allocator's statistics for exactly as long as it lives. Copies are
//! explicit ([`Tensor::try_clone`], [`Tensor::to_dtype`]) because they allocate and can run
//! out of memory.

use crate::device::Device;
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::ops::with_dtype;
use half::{bf16, f16};
use std::any::TypeId;
use std::fmt;
use vram_alloc::{Allocation, HostMemory};

/// The bytes behind a tensor. A CUDA variant joins once CUDA kernels exist.
enum Storage {
    Host(Allocation<HostMemory>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Host(a) => a.as_bytes(),
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Storage::Host(a) => a.as_bytes_mut(),
        }
    }
}

/// The number of elements of `shape`, and its size in bytes for `dtype`, checked for
/// overflow.
fn checked_len(op: &'static str, shape: &[usize], dtype: DType) -> Result<(usize, usize)> {
    let overflow = || Error::InvalidArgument {
        op,
        reason: format!("shape {shape:?} of {dtype} has more bytes than memory can address"),
    };
    let numel = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).ok_or_else(overflow)?;
    let bytes = numel.checked_mul(dtype.size_in_bytes()).ok_or_else(overflow)?;
    Ok((numel, bytes))
}

/// Checks that `T` is the very type that stores `T::DTYPE` (f32, f16 or bf16), so a byte
/// buffer of that dtype may be viewed as `[T]`.
fn check_element<T: Element>(op: &'static str, dtype: DType) -> Result<()> {
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

/// Views bytes as elements. Only called after [`check_element`] accepted `T`.
fn cast_slice<T: Element>(bytes: &[u8]) -> &[T] {
    let len = bytes.len() / std::mem::size_of::<T>();
    debug_assert_eq!(bytes.as_ptr().align_offset(std::mem::align_of::<T>()), 0);
    // SAFETY: `T` is f32, f16 or bf16 (checked by `check_element`): plain data with no
    // invalid bit patterns. Allocator blocks are 512-byte aligned, more than any of them
    // needs, and `len * size_of::<T>()` bytes lie within `bytes`, borrowed for the result's
    // lifetime.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), len) }
}

/// Views bytes as elements, mutably. Only called after [`check_element`] accepted `T`.
fn cast_slice_mut<T: Element>(bytes: &mut [u8]) -> &mut [T] {
    let len = bytes.len() / std::mem::size_of::<T>();
    debug_assert_eq!(bytes.as_ptr().align_offset(std::mem::align_of::<T>()), 0);
    // SAFETY: as in `cast_slice`; the exclusive borrow of `bytes` is handed on, and every
    // value written through the result is a valid `T`, hence valid bytes.
    unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<T>(), len) }
}

/// A dense row-major array of f32, f16 or bf16 on a [`Device`].
///
/// The tensor owns its memory exclusively; it is freed back to the device's cache on drop.
/// `Clone` is not implemented because copying allocates: use [`try_clone`](Self::try_clone).
pub struct Tensor {
    storage: Storage,
    shape: Vec<usize>,
    dtype: DType,
    device: Device,
}

impl Tensor {
    /// A tensor whose contents are unspecified (a reused cache block keeps its previous
    /// bytes). Every op that uses it overwrites all of it before returning.
    pub(crate) fn uninit(
        op: &'static str,
        device: &Device,
        shape: &[usize],
        dtype: DType,
    ) -> Result<Tensor> {
        let (_, bytes) = checked_len(op, shape, dtype)?;
        let block = device.host_allocator().allocate(bytes)?;
        Ok(Tensor {
            storage: Storage::Host(block),
            shape: shape.to_vec(),
            dtype,
            device: device.clone(),
        })
    }

    /// A tensor of zeros.
    ///
    /// # Errors
    ///
    /// [`Error::OutOfMemory`] if the device cannot hold it; [`Error::InvalidArgument`] if
    /// its size overflows.
    pub fn zeros(device: &Device, shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::full(device, shape, dtype, 0.0)
    }

    /// A tensor with every element `value` (rounded once to `dtype`).
    ///
    /// # Errors
    ///
    /// As [`zeros`](Self::zeros).
    pub fn full(device: &Device, shape: &[usize], dtype: DType, value: f32) -> Result<Tensor> {
        let mut t = Tensor::uninit("full", device, shape, dtype)?;
        t.fill(value);
        Ok(t)
    }

    /// A tensor of dtype `T::DTYPE` holding a copy of `data` (row-major).
    ///
    /// # Errors
    ///
    /// [`Error::ShapeMismatch`] if `data.len()` is not the number of elements of `shape`
    /// (reported as shapes `shape` and `[data.len()]`); [`Error::OutOfMemory`].
    pub fn from_slice<T: Element>(device: &Device, shape: &[usize], data: &[T]) -> Result<Tensor> {
        const OP: &str = "Tensor::from_slice";
        check_element::<T>(OP, T::DTYPE)?;
        check_data_len(OP, shape, T::DTYPE, data.len())?;
        let mut t = Tensor::uninit(OP, device, shape, T::DTYPE)?;
        t.as_mut_slice::<T>()?.copy_from_slice(data);
        Ok(t)
    }

    /// A tensor of `dtype` holding `data` converted from f32 (round-to-nearest-even).
    ///
    /// # Errors
    ///
    /// As [`from_slice`](Self::from_slice).
    pub fn from_f32_slice(
        device: &Device,
        shape: &[usize],
        data: &[f32],
        dtype: DType,
    ) -> Result<Tensor> {
        const OP: &str = "Tensor::from_f32_slice";
        check_data_len(OP, shape, dtype, data.len())?;
        let mut t = Tensor::uninit(OP, device, shape, dtype)?;
        with_dtype!(dtype, T => crate::cpu::elementwise::cast(data, t.as_mut_slice::<T>()?));
        Ok(t)
    }

    /// The elements, copied into a vector.
    ///
    /// # Errors
    ///
    /// [`Error::DTypeMismatch`] if `T` is not the tensor's dtype.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        Ok(self.as_slice::<T>()?.to_vec())
    }

    /// The elements converted to f32 (exact for every dtype).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.numel()];
        with_dtype!(self.dtype, T => {
            crate::cpu::elementwise::cast(cast_slice::<T>(self.storage.bytes()), &mut out)
        });
        out
    }

    /// A copy converted to `dtype` (a plain copy when `dtype` is the tensor's own).
    ///
    /// # Errors
    ///
    /// [`Error::OutOfMemory`]; `self` is unchanged.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        let mut out = Tensor::uninit("to_dtype", &self.device, &self.shape, dtype)?;
        if dtype == self.dtype {
            out.storage.bytes_mut().copy_from_slice(self.storage.bytes());
            return Ok(out);
        }
        with_dtype!(self.dtype, S => with_dtype!(dtype, D => crate::cpu::elementwise::cast(
            cast_slice::<S>(self.storage.bytes()),
            cast_slice_mut::<D>(out.storage.bytes_mut()),
        )));
        Ok(out)
    }

    /// A copy on the same device.
    ///
    /// # Errors
    ///
    /// [`Error::OutOfMemory`]; `self` is unchanged.
    pub fn try_clone(&self) -> Result<Tensor> {
        self.to_dtype(self.dtype)
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
        let (numel, _) = checked_len("reshape", shape, self.dtype)?;
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

    /// Sets every element to `value` (rounded once to the dtype).
    pub fn fill(&mut self, value: f32) {
        with_dtype!(self.dtype, T => {
            crate::cpu::elementwise::fill(cast_slice_mut::<T>(self.storage.bytes_mut()), value)
        });
    }

    /// The elements as a slice of `T`.
    ///
    /// # Errors
    ///
    /// [`Error::DTypeMismatch`] if `T` is not the tensor's dtype.
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        check_element::<T>("as_slice", self.dtype)?;
        Ok(cast_slice(self.storage.bytes()))
    }

    /// The elements as a mutable slice of `T`.
    ///
    /// # Errors
    ///
    /// [`Error::DTypeMismatch`] if `T` is not the tensor's dtype.
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        check_element::<T>("as_mut_slice", self.dtype)?;
        Ok(cast_slice_mut(self.storage.bytes_mut()))
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
        self.storage.bytes().len()
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor({:?}, {}, {})", self.shape, self.dtype, self.device.name())
    }
}

fn check_data_len(op: &'static str, shape: &[usize], dtype: DType, len: usize) -> Result<()> {
    let (numel, _) = checked_len(op, shape, dtype)?;
    if numel != len {
        return Err(Error::ShapeMismatch { op, lhs: shape.to_vec(), rhs: vec![len] });
    }
    Ok(())
}

/// A dense row-major array of u32 indices on a [`Device`] (the argmax a max pool saves for
/// its backward). Like [`Tensor`], its memory comes from the device's allocator.
pub struct Indices {
    storage: Storage,
    shape: Vec<usize>,
    device: Device,
}

impl Indices {
    /// Index storage of `shape` with unspecified contents, overwritten by the op filling it.
    pub(crate) fn uninit(op: &'static str, device: &Device, shape: &[usize]) -> Result<Indices> {
        // u32 has f32's size; the dtype only sizes the block.
        let (_, bytes) = checked_len(op, shape, DType::F32)?;
        let block = device.host_allocator().allocate(bytes)?;
        Ok(Indices { storage: Storage::Host(block), shape: shape.to_vec(), device: device.clone() })
    }

    /// Indices holding a copy of `data` (row-major).
    ///
    /// # Errors
    ///
    /// [`Error::ShapeMismatch`] if `data.len()` does not match `shape`; [`Error::OutOfMemory`].
    pub fn from_slice(device: &Device, shape: &[usize], data: &[u32]) -> Result<Indices> {
        const OP: &str = "Indices::from_slice";
        check_data_len(OP, shape, DType::F32, data.len())?;
        let mut idx = Indices::uninit(OP, device, shape)?;
        idx.as_mut_slice().copy_from_slice(data);
        Ok(idx)
    }

    /// The indices.
    pub fn as_slice(&self) -> &[u32] {
        let bytes = self.storage.bytes();
        // SAFETY: u32 has no invalid bit patterns; the block is 512-byte aligned and holds
        // `bytes.len() / 4` u32 values, borrowed for the result's lifetime.
        unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<u32>(), bytes.len() / 4) }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u32] {
        let bytes = self.storage.bytes_mut();
        // SAFETY: as in `as_slice`; the exclusive borrow is handed on.
        unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<u32>(), bytes.len() / 4) }
    }

    /// The dimensions, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
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
