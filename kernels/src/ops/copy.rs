//! The ops behind [`Tensor`]'s constructors and conversions: fills, casts and copies,
//! uploads of host data, copies between devices, and copy-on-write.

use super::dispatch::{Buffers, Op, OutputSpec, Plan, run};
use crate::device::Device;
use crate::dtype::{DType, Element, with_dtype};
use crate::error::{Error, Result};
use crate::tensor::{Indices, Tensor, check_data_len, check_element};

/// Sets every element of a host tensor to `value`.
fn fill_into(t: &mut Tensor, value: f32, op: &'static str) -> Result<()> {
    with_dtype!(t.dtype(), T => crate::cpu::elementwise::fill(t.out_slice::<T>(op)?, value));
    Ok(())
}

#[cfg(feature = "cuda")]
fn fill_cuda(gpu: &crate::cuda::Gpu<'_>, t: &Tensor, value: f32) -> Result<()> {
    use crate::cuda::{Arg, helpers::ptr, launch, registry::FILL};
    let n = t.numel();
    let grid = launch::map(n, t.dtype().size_in_bytes());
    // SAFETY: fill_T(T* y, float v, u64 n); y holds n elements of T.
    unsafe { gpu.launch(FILL.of(t.dtype()), grid, &[ptr(t)?, Arg::F32(value), Arg::count(n)]) }
}

/// A new tensor of `shape` and `dtype`, every element `value`.
struct Full<'a> {
    device: &'a Device,
    shape: &'a [usize],
    dtype: DType,
    value: f32,
}

impl Op for Full<'_> {
    const NAME: &'static str = "full";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.device
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        Ok(Plan::one(self.shape, self.dtype))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        fill_into(bufs.out(), self.value, Self::NAME)
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        fill_cuda(gpu, bufs.out(), self.value)
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

/// Every element of a tensor set to `value`, in place.
struct Fill<'a> {
    t: &'a mut Tensor,
    value: f32,
}

impl Op for Fill<'_> {
    const NAME: &'static str = "fill";
    type Outs = ();
    type Output = ();

    fn device(&self) -> &Device {
        self.t.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        self.t.make_unique()?;
        Ok(Plan::none())
    }

    fn host(&mut self, _: &mut Buffers<Self::Outs>) -> Result<()> {
        fill_into(self.t, self.value, Self::NAME)
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, _: &mut Buffers<Self::Outs>) -> Result<()> {
        fill_cuda(gpu, self.t, self.value)
    }

    fn finish(self, _: Buffers<Self::Outs>) -> Result<()> {
        Ok(())
    }
}

/// `x` converted into `out`'s dtype on the host (a byte copy when the dtypes match).
fn cast_host(x: &Tensor, out: &mut Tensor, op: &'static str) -> Result<()> {
    if x.dtype() == out.dtype() {
        out.out_bytes(op)?.copy_from_slice(x.storage().bytes(op)?);
        return Ok(());
    }
    with_dtype!(x.dtype(), S => with_dtype!(out.dtype(), D => {
        crate::cpu::elementwise::cast(x.as_slice::<S>()?, out.out_slice::<D>(op)?)
    }))
}

/// `x` converted into `y`'s dtype on the GPU (a device copy when the dtypes match).
#[cfg(feature = "cuda")]
fn cast_cuda(gpu: &crate::cuda::Gpu<'_>, x: &Tensor, y: &Tensor) -> Result<()> {
    if x.dtype() == y.dtype() {
        return gpu.copy_on_device(y.cuda_ptr()?, x.cuda_ptr()?, x.size_in_bytes());
    }
    crate::cuda::helpers::cast(gpu, x.cuda_ptr()?, x.dtype(), y.cuda_ptr()?, y.dtype(), x.numel())
}

/// A copy of `x` converted to `dtype` on `x`'s device.
struct Cast<'a> {
    x: &'a Tensor,
    dtype: DType,
}

impl Op for Cast<'_> {
    const NAME: &'static str = "to_dtype";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        Ok(Plan::one(self.x.shape(), self.dtype))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        cast_host(self.x, bufs.out(), Self::NAME)
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        cast_cuda(gpu, self.x, bufs.out())
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

/// `src` converted into `dst`'s dtype, written over `dst` in place (same shape and device).
struct CastInto<'a> {
    src: &'a Tensor,
    dst: &'a mut Tensor,
}

impl Op for CastInto<'_> {
    const NAME: &'static str = "copy_from";
    type Outs = ();
    type Output = ();

    fn device(&self) -> &Device {
        self.dst.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        if self.src.shape() != self.dst.shape() {
            return Err(Error::ShapeMismatch {
                op: Self::NAME,
                lhs: self.dst.shape().to_vec(),
                rhs: self.src.shape().to_vec(),
            });
        }
        if self.src.device() != self.dst.device() {
            return Err(Error::DeviceMismatch { op: Self::NAME });
        }
        self.dst.make_unique()?;
        Ok(Plan::none())
    }

    fn host(&mut self, _: &mut Buffers<Self::Outs>) -> Result<()> {
        cast_host(self.src, self.dst, Self::NAME)
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, _: &mut Buffers<Self::Outs>) -> Result<()> {
        cast_cuda(gpu, self.src, self.dst)
    }

    fn finish(self, _: Buffers<Self::Outs>) -> Result<()> {
        Ok(())
    }
}

/// Host data copied into a new tensor (or indices) on a device.
struct Upload<'a> {
    device: &'a Device,
    shape: &'a [usize],
    data: Data<'a>,
}

/// What an upload copies: elements of the target dtype, f32 values to convert, or indices.
enum Data<'a> {
    Bytes(&'a [u8], DType),
    F32(&'a [f32], DType),
    Indices(&'a [u32]),
}

impl Op for Upload<'_> {
    const NAME: &'static str = "upload";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.device
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        Ok(Plan::new(match self.data {
            Data::Bytes(_, dtype) | Data::F32(_, dtype) => OutputSpec::new(self.shape, dtype),
            Data::Indices(_) => OutputSpec::indices(self.shape),
        }))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let out = bufs.out();
        match self.data {
            Data::Bytes(bytes, _) => out.out_bytes(Self::NAME)?.copy_from_slice(bytes),
            Data::Indices(ids) => out.out_u32(Self::NAME)?.copy_from_slice(ids),
            Data::F32(values, dtype) => with_dtype!(dtype, T => {
                crate::cpu::elementwise::cast(values, out.out_slice::<T>(Self::NAME)?)?
            }),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::storage::as_bytes;
        let dst = bufs.out().cuda_ptr()?;
        match self.data {
            Data::Bytes(bytes, _) => gpu.copy_to_device(dst, bytes),
            Data::Indices(ids) => gpu.copy_to_device(dst, as_bytes(ids)),
            // Converted on the host: the copy is the same size as the tensor.
            Data::F32(values, dtype) => with_dtype!(dtype, T => {
                let mut host = vec![T::default(); values.len()];
                crate::cpu::elementwise::cast(values, &mut host)?;
                gpu.copy_to_device(dst, as_bytes(&host))
            }),
        }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

/// A copy of `x` on another device (host, virtual or CUDA), same shape and dtype.
struct ToDevice<'a> {
    x: &'a Tensor,
    to: &'a Device,
}

impl Op for ToDevice<'_> {
    const NAME: &'static str = "to_device";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.to
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        if self.x.device().is_virtual() && !self.to.is_virtual() {
            return Err(Error::NoValues { op: Self::NAME });
        }
        Ok(Plan::one(self.x.shape(), self.x.dtype()))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let out = bufs.out().out_bytes(Self::NAME)?;
        #[cfg(feature = "cuda")]
        if let Some(from) = self.x.device().cuda_backend() {
            return from.copy_to_host(out, self.x.cuda_ptr()?);
        }
        out.copy_from_slice(self.x.storage().bytes(Self::NAME)?);
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let dst = bufs.out().cuda_ptr()?;
        match self.x.device().cuda_backend() {
            None => gpu.copy_to_device(dst, self.x.storage().bytes(Self::NAME)?),
            Some(from) => {
                // Between two CUDA devices: through the host (rare, and simple).
                let mut host = vec![0u8; self.x.size_in_bytes()];
                from.copy_to_host(&mut host, self.x.cuda_ptr()?)?;
                gpu.copy_to_device(dst, &host)
            }
        }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

impl Tensor {
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
        run(Full { device, shape, dtype, value })
    }

    /// A tensor of dtype `T::DTYPE` holding a copy of `data` (row-major). On a virtual
    /// device only the length is checked: the values are not kept.
    ///
    /// # Errors
    ///
    /// [`Error::ShapeMismatch`] if `data.len()` is not the number of elements of `shape`
    /// (reported as shapes `shape` and `[data.len()]`); [`Error::OutOfMemory`].
    pub fn from_slice<T: Element>(device: &Device, shape: &[usize], data: &[T]) -> Result<Tensor> {
        const OP: &str = "Tensor::from_slice";
        check_element::<T>(OP, T::DTYPE)?;
        check_data_len(OP, shape, data.len())?;
        // SAFETY: `T` is f32, f16 or bf16 (checked above): plain data without padding,
        // viewed as its bytes for as long as `data` is borrowed.
        let bytes = unsafe {
            std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data))
        };
        run(Upload { device, shape, data: Data::Bytes(bytes, T::DTYPE) })
    }

    /// A tensor of `dtype` over a copy of `bytes`, which hold its elements (an upload of a
    /// pinned buffer on a device without a transfer stream).
    pub(crate) fn from_bytes(
        device: &Device,
        shape: &[usize],
        dtype: DType,
        bytes: &[u8],
    ) -> Result<Tensor> {
        run(Upload { device, shape, data: Data::Bytes(bytes, dtype) })
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
        check_data_len("Tensor::from_f32_slice", shape, data.len())?;
        run(Upload { device, shape, data: Data::F32(data, dtype) })
    }

    /// A copy converted to `dtype` (a plain copy when `dtype` is the tensor's own).
    ///
    /// # Errors
    ///
    /// [`Error::OutOfMemory`]; `self` is unchanged.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        run(Cast { x: self, dtype })
    }

    /// Overwrites this tensor with `src` converted to this tensor's dtype
    /// (round-to-nearest-even), in place: PyTorch's `self.copy_(src)`. Allocates nothing
    /// unless this tensor's memory is shared (copy-on-write).
    ///
    /// # Errors
    ///
    /// [`Error::ShapeMismatch`] or [`Error::DeviceMismatch`]; `self` is unchanged then.
    pub fn copy_from(&mut self, src: &Tensor) -> Result<()> {
        run(CastInto { src, dst: self })
    }

    /// A copy on the same device.
    ///
    /// # Errors
    ///
    /// [`Error::OutOfMemory`]; `self` is unchanged.
    pub fn try_clone(&self) -> Result<Tensor> {
        self.to_dtype(self.dtype())
    }

    /// A copy on `device` (host, virtual or CUDA), same shape and dtype. Copying to the
    /// tensor's own device is [`try_clone`](Self::try_clone).
    ///
    /// # Errors
    ///
    /// [`Error::OutOfMemory`] on the target device; [`Error::Device`] if a copy fails;
    /// [`Error::NoValues`] from a virtual device to a real one.
    pub fn to_device(&self, device: &Device) -> Result<Tensor> {
        if device == self.device() {
            return self.try_clone();
        }
        run(ToDevice { x: self, to: device })
    }

    /// Makes this tensor the only owner of its memory, copying it first if a clone shares it.
    ///
    /// # Errors
    ///
    /// [`Error::OutOfMemory`] if the copy does not fit; the tensor is unchanged then.
    pub fn make_unique(&mut self) -> Result<()> {
        if self.is_shared() {
            let copy = self.try_clone()?;
            self.adopt_storage(copy);
        }
        Ok(())
    }

    /// Sets every element to `value` (rounded once to the dtype), copying the memory first
    /// if a clone shares it.
    ///
    /// # Errors
    ///
    /// [`Error::OutOfMemory`] for that copy; [`Error::Device`] if a CUDA device fails.
    pub fn fill(&mut self, value: f32) -> Result<()> {
        run(Fill { t: self, value })
    }

    /// The elements as a mutable slice of `T`, after making the memory this tensor's own.
    ///
    /// # Errors
    ///
    /// As [`as_slice`](Self::as_slice), and [`Error::OutOfMemory`] if a shared tensor cannot
    /// be copied.
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        check_element::<T>("as_mut_slice", self.dtype())?;
        self.make_unique()?;
        self.out_slice::<T>("as_mut_slice")
    }
}

impl Indices {
    /// Indices holding a copy of `data` (row-major).
    ///
    /// # Errors
    ///
    /// [`Error::ShapeMismatch`] if `data.len()` does not match `shape`; [`Error::OutOfMemory`].
    pub fn from_slice(device: &Device, shape: &[usize], data: &[u32]) -> Result<Indices> {
        check_data_len("Indices::from_slice", shape, data.len())?;
        run(Upload { device, shape, data: Data::Indices(data) }).map(Indices::from_tensor)
    }
}
