//! [`Tensor`]: a dense, row-major, uniquely owned array on a [`Device`], and [`Indices`],
//! the u32 buffers some ops save for their backward.
//!
//! A tensor owns one block from its device's caching allocator (no sharing, no views), so
//! its bytes show in the allocator's statistics for exactly as long as it lives. Copies are
//! explicit ([`Tensor::try_clone`], [`Tensor::to_dtype`], [`Tensor::to_device`]) because
//! they allocate and can run out of memory.
//!
//! A CUDA tensor's memory is device memory: [`Tensor::as_slice`] refuses it with
//! [`Error::Unsupported`], and [`Tensor::to_vec`] / [`Tensor::to_f32_vec`] copy it to the
//! host.

use crate::device::Device;
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::ops::with_dtype;
use half::{bf16, f16};
use std::any::TypeId;
use std::fmt;
use std::sync::Arc;
use vram_alloc::{Allocation, HostMemory};

/// The bytes behind a tensor: a block of the device's caching allocator.
enum Storage {
    Host(Allocation<HostMemory>),
    #[cfg(feature = "cuda")]
    Cuda(Allocation<vram_alloc::cuda::CudaMemory>),
}

impl Storage {
    /// `bytes` bytes from `device`'s allocator.
    fn allocate(device: &Device, bytes: usize) -> Result<Storage> {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = device.cuda_backend() {
            return Ok(Storage::Cuda(cuda.allocate(bytes)?));
        }
        Ok(Storage::Host(device.host_allocator().allocate(bytes)?))
    }

    fn len(&self) -> usize {
        match self {
            Storage::Host(a) => a.len(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(a) => a.len(),
        }
    }

    /// The host bytes, or [`Error::Unsupported`] for device memory.
    fn bytes(&self, op: &'static str) -> Result<&[u8]> {
        let _ = op;
        match self {
            Storage::Host(a) => Ok(a.as_bytes()),
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => Err(on_device(op)),
        }
    }

    /// The host bytes, mutably, or [`Error::Unsupported`] for device memory.
    fn bytes_mut(&mut self, op: &'static str) -> Result<&mut [u8]> {
        let _ = op;
        match self {
            Storage::Host(a) => Ok(a.as_bytes_mut()),
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => Err(on_device(op)),
        }
    }

    /// The device address of CUDA storage.
    #[cfg(feature = "cuda")]
    fn cuda_ptr(&self, op: &'static str) -> Result<u64> {
        match self {
            Storage::Cuda(a) => Ok(a.ptr()),
            Storage::Host(_) => Err(Error::Unsupported(format!(
                "{op}: the tensor lives on the host; CUDA kernels need a CUDA tensor (use `to_device`)"
            ))),
        }
    }
}

/// The error for host access to device memory.
#[cfg(feature = "cuda")]
fn on_device(op: &'static str) -> Error {
    Error::Unsupported(format!(
        "{op}: the tensor lives in CUDA device memory, which the host cannot address; copy it \
         with `to_vec`, `to_f32_vec` or `to_device`"
    ))
}

/// Views elements as bytes (for host <-> device copies).
#[cfg(feature = "cuda")]
fn as_bytes<T: Copy>(data: &[T]) -> &[u8] {
    // SAFETY: `T` is plain data (f32, f16, bf16 or u32 here) without padding; the bytes
    // are borrowed for as long as `data` is.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data)) }
}

/// Views elements as bytes, mutably (for device -> host copies).
#[cfg(feature = "cuda")]
fn as_bytes_mut<T: Copy>(data: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`; every byte pattern is a valid f32, f16, bf16 or u32, so any
    // bytes written through the result leave valid values.
    unsafe {
        std::slice::from_raw_parts_mut(data.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(data))
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
    /// A tensor whose contents are unspecified (a reused cache block keeps its previous
    /// bytes). Every op that uses it overwrites all of it before returning.
    pub(crate) fn uninit(
        op: &'static str,
        device: &Device,
        shape: &[usize],
        dtype: DType,
    ) -> Result<Tensor> {
        let (_, bytes) = checked_len(op, shape, dtype)?;
        Ok(Tensor {
            storage: Arc::new(Storage::allocate(device, bytes)?),
            shape: shape.to_vec(),
            dtype,
            device: device.clone(),
        })
    }

    /// A tensor over a CUDA allocation made elsewhere (an upload on the transfer stream).
    #[cfg(feature = "cuda")]
    pub(crate) fn from_cuda_allocation(
        device: &Device,
        block: Allocation<vram_alloc::cuda::CudaMemory>,
        shape: &[usize],
        dtype: DType,
    ) -> Tensor {
        Tensor {
            storage: Arc::new(Storage::Cuda(block)),
            shape: shape.to_vec(),
            dtype,
            device: device.clone(),
        }
    }

    /// Makes this tensor the only owner of its memory, copying it first if a clone shares it.
    ///
    /// # Errors
    ///
    /// [`Error::OutOfMemory`] if the copy does not fit; the tensor is unchanged then.
    pub fn make_unique(&mut self) -> Result<()> {
        if Arc::get_mut(&mut self.storage).is_none() {
            self.storage = self.try_clone()?.storage;
        }
        Ok(())
    }

    /// Whether another clone shares this tensor's memory.
    pub fn is_shared(&self) -> bool {
        Arc::strong_count(&self.storage) > 1
    }

    /// The storage for writing: unique (copied first if shared).
    fn storage_mut(&mut self) -> Result<&mut Storage> {
        self.make_unique()?;
        Ok(Arc::get_mut(&mut self.storage).expect("storage is unique after make_unique"))
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
    /// As [`zeros`](Self::zeros), and [`Error::Device`] if a CUDA device fails.
    pub fn full(device: &Device, shape: &[usize], dtype: DType, value: f32) -> Result<Tensor> {
        let mut t = Tensor::uninit("full", device, shape, dtype)?;
        t.try_fill(value)?;
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
        #[cfg(feature = "cuda")]
        if let Some(cuda) = device.cuda_backend() {
            cuda.copy_to_device(t.cuda_ptr()?, as_bytes(data))?;
            return Ok(t);
        }
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
        #[cfg(feature = "cuda")]
        if let Some(cuda) = device.cuda_backend() {
            with_dtype!(dtype, T => {
                let mut host = vec![T::default(); data.len()];
                crate::cpu::elementwise::cast(data, &mut host);
                cuda.copy_to_device(t.cuda_ptr()?, as_bytes(&host))?;
            });
            return Ok(t);
        }
        with_dtype!(dtype, T => crate::cpu::elementwise::cast(data, t.as_mut_slice::<T>()?));
        Ok(t)
    }

    /// The elements, copied into a vector (a device-to-host copy for a CUDA tensor).
    ///
    /// # Errors
    ///
    /// [`Error::DTypeMismatch`] if `T` is not the tensor's dtype; [`Error::Device`] if the
    /// copy from a CUDA device fails.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = self.device.cuda_backend() {
            check_element::<T>("to_vec", self.dtype)?;
            let mut out = vec![T::default(); self.numel()];
            cuda.copy_to_host(as_bytes_mut(&mut out), self.cuda_ptr()?)?;
            return Ok(out);
        }
        Ok(self.as_slice::<T>()?.to_vec())
    }

    /// The elements converted to f32 (exact for every dtype).
    ///
    /// # Panics
    ///
    /// If the copy from a CUDA device fails (the device is then unusable); use
    /// [`try_to_f32_vec`](Self::try_to_f32_vec) to get that as an error. Host tensors never
    /// panic.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        self.try_to_f32_vec().unwrap_or_else(|e| panic!("to_f32_vec: {e}"))
    }

    /// The elements converted to f32 (exact for every dtype).
    ///
    /// # Errors
    ///
    /// [`Error::Device`] if the copy from a CUDA device fails; never on the host.
    pub fn try_to_f32_vec(&self) -> Result<Vec<f32>> {
        let mut out = vec![0.0f32; self.numel()];
        #[cfg(feature = "cuda")]
        if self.device.is_cuda() {
            with_dtype!(self.dtype, T => {
                crate::cpu::elementwise::cast(&self.to_vec::<T>()?, &mut out)
            });
            return Ok(out);
        }
        with_dtype!(self.dtype, T => {
            crate::cpu::elementwise::cast(cast_slice::<T>(self.storage.bytes("to_f32_vec")?), &mut out)
        });
        Ok(out)
    }

    /// A copy converted to `dtype` (a plain copy when `dtype` is the tensor's own).
    ///
    /// # Errors
    ///
    /// [`Error::OutOfMemory`]; `self` is unchanged.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        let mut out = Tensor::uninit("to_dtype", &self.device, &self.shape, dtype)?;
        #[cfg(feature = "cuda")]
        if let Some(cuda) = self.device.cuda_backend() {
            crate::cuda::ops::elementwise::convert(cuda, self, &mut out)?;
            return Ok(out);
        }
        if dtype == self.dtype {
            out.storage_mut()?
                .bytes_mut("to_dtype")?
                .copy_from_slice(self.storage.bytes("to_dtype")?);
            return Ok(out);
        }
        with_dtype!(self.dtype, S => with_dtype!(dtype, D => crate::cpu::elementwise::cast(
            cast_slice::<S>(self.storage.bytes("to_dtype")?),
            cast_slice_mut::<D>(out.storage_mut()?.bytes_mut("to_dtype")?),
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

    /// A copy on `device` (host to CUDA, CUDA to host, or within one device), same shape
    /// and dtype. Copying to the tensor's own device is [`try_clone`](Self::try_clone).
    ///
    /// # Errors
    ///
    /// [`Error::OutOfMemory`] on the target device; [`Error::Device`] if a copy fails.
    pub fn to_device(&self, device: &Device) -> Result<Tensor> {
        const OP: &str = "to_device";
        if *device == self.device {
            return self.try_clone();
        }
        let mut out = Tensor::uninit(OP, device, &self.shape, self.dtype)?;
        #[cfg(feature = "cuda")]
        {
            match (self.device.cuda_backend(), device.cuda_backend()) {
                (None, Some(to)) => to.copy_to_device(out.cuda_ptr()?, self.storage.bytes(OP)?)?,
                (Some(from), None) => {
                    from.copy_to_host(out.storage_mut()?.bytes_mut(OP)?, self.cuda_ptr()?)?
                }
                (Some(from), Some(to)) => {
                    // Between two CUDA devices: through the host (rare, and simple).
                    let mut host = vec![0u8; self.storage.len()];
                    from.copy_to_host(&mut host, self.cuda_ptr()?)?;
                    to.copy_to_device(out.cuda_ptr()?, &host)?;
                }
                (None, None) => {
                    out.storage_mut()?.bytes_mut(OP)?.copy_from_slice(self.storage.bytes(OP)?)
                }
            }
            Ok(out)
        }
        #[cfg(not(feature = "cuda"))]
        {
            out.storage_mut()?.bytes_mut(OP)?.copy_from_slice(self.storage.bytes(OP)?);
            Ok(out)
        }
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
    ///
    /// # Panics
    ///
    /// If the fill kernel cannot be launched on a CUDA device (the device is then
    /// unusable); use [`try_fill`](Self::try_fill) to get that as an error. Host tensors
    /// never panic.
    pub fn fill(&mut self, value: f32) {
        self.try_fill(value).unwrap_or_else(|e| panic!("fill: {e}"));
    }

    /// Sets every element to `value` (rounded once to the dtype).
    ///
    /// # Errors
    ///
    /// [`Error::Device`] if a CUDA device fails; never on the host.
    pub fn try_fill(&mut self, value: f32) -> Result<()> {
        self.make_unique()?;
        #[cfg(feature = "cuda")]
        if self.device.is_cuda()
            && let Some(cuda) = self.device.clone().cuda_backend()
        {
            return crate::cuda::ops::elementwise::fill(cuda, self, value);
        }
        with_dtype!(self.dtype, T => {
            crate::cpu::elementwise::fill(cast_slice_mut::<T>(self.storage_mut()?.bytes_mut("fill")?), value)
        });
        Ok(())
    }

    /// The elements as a slice of `T`.
    ///
    /// # Errors
    ///
    /// [`Error::DTypeMismatch`] if `T` is not the tensor's dtype; [`Error::Unsupported`] for
    /// a CUDA tensor (the host cannot address device memory: use [`to_vec`](Self::to_vec)).
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        check_element::<T>("as_slice", self.dtype)?;
        Ok(cast_slice(self.storage.bytes("as_slice")?))
    }

    /// The elements as a mutable slice of `T`.
    ///
    /// # Errors
    ///
    /// As [`as_slice`](Self::as_slice).
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        check_element::<T>("as_mut_slice", self.dtype)?;
        Ok(cast_slice_mut(self.storage_mut()?.bytes_mut("as_mut_slice")?))
    }

    /// The device address of a CUDA tensor's first element.
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_ptr(&self) -> Result<u64> {
        self.storage.cuda_ptr("cuda kernel")
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
        Ok(Indices {
            storage: Storage::allocate(device, bytes)?,
            shape: shape.to_vec(),
            device: device.clone(),
        })
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
        #[cfg(feature = "cuda")]
        if let Some(cuda) = device.cuda_backend() {
            cuda.copy_to_device(idx.cuda_ptr()?, as_bytes(data))?;
            return Ok(idx);
        }
        idx.as_mut_slice()?.copy_from_slice(data);
        Ok(idx)
    }

    /// The indices.
    ///
    /// # Panics
    ///
    /// For indices in CUDA device memory, which the host cannot address: use
    /// [`to_vec`](Self::to_vec) or [`try_as_slice`](Self::try_as_slice) there.
    pub fn as_slice(&self) -> &[u32] {
        self.try_as_slice().unwrap_or_else(|e| panic!("Indices::as_slice: {e}"))
    }

    /// The indices, or [`Error::Unsupported`] for indices in CUDA device memory.
    ///
    /// # Errors
    ///
    /// As above.
    pub fn try_as_slice(&self) -> Result<&[u32]> {
        let bytes = self.storage.bytes("Indices::as_slice")?;
        // SAFETY: u32 has no invalid bit patterns; the block is 512-byte aligned and holds
        // `bytes.len() / 4` u32 values, borrowed for the result's lifetime.
        Ok(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<u32>(), bytes.len() / 4) })
    }

    /// The indices, copied to a vector (a device-to-host copy on a CUDA device).
    ///
    /// # Errors
    ///
    /// [`Error::Device`] if the copy from a CUDA device fails.
    pub fn to_vec(&self) -> Result<Vec<u32>> {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = self.device.cuda_backend() {
            let mut out = vec![0u32; self.storage.len() / 4];
            cuda.copy_to_host(as_bytes_mut(&mut out), self.cuda_ptr()?)?;
            return Ok(out);
        }
        Ok(self.try_as_slice()?.to_vec())
    }

    pub(crate) fn as_mut_slice(&mut self) -> Result<&mut [u32]> {
        let bytes = self.storage.bytes_mut("Indices::as_mut_slice")?;
        // SAFETY: as in `try_as_slice`; the exclusive borrow is handed on.
        Ok(unsafe {
            std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<u32>(), bytes.len() / 4)
        })
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
