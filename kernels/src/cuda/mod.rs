//! The CUDA backend: one device's primary context, its legacy default stream, a caching
//! allocator over `cuMemAlloc`, the NVRTC kernel registry, a cuBLAS handle, where
//! libcublasLt loads a cuBLASLt handle (matmuls with fused epilogues, [`blaslt`]) and, when
//! the library loads, a cuDNN handle for convolutions (`dnn`).
//!
//! Every op runs on the legacy default stream (`CUstream` 0), which is also the stream the
//! allocator hands blocks out for ([`vram_alloc::Stream::DEFAULT`]): a block freed by a
//! dropped tensor and reused by the next allocation is therefore stream-ordered after all
//! work that used it, with no events needed. Copies to the host synchronize that stream.
//!
//! The 16-bit types have no `#include <cuda_fp16.h>`: NVRTC only finds that header with the
//! toolkit's include path, which a machine with just the driver and runtime libraries may
//! lack. `common.cuh` defines them as bit containers with PTX (f16) and integer (bf16)
//! conversions instead.

mod blas;
pub(crate) mod blaslt;
mod custom;
pub(crate) mod dnn;
#[cfg(any(test, feature = "emulation"))]
pub(crate) mod emulate;
#[cfg(test)]
pub(crate) mod emulated_kernels;
pub(crate) mod helpers;
pub(crate) mod launch;
mod loader;
#[cfg(test)]
mod nvrtc_check;
pub(crate) mod registry;

pub(crate) use custom::check_with_nvrtc as custom_check_with_nvrtc;
pub(crate) use launch::Arg;

use crate::error::{Error, Result};
use blas::Blas;
use blaslt::{BlasLt, LtGemm};
use cudarc::driver::{CudaContext, CudaStream, DriverError, LaunchConfig, PushKernelArg, result};
use loader::Loader;
use registry::Instance;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use vram_alloc::cuda::{CudaMemory, probe};
use vram_alloc::{Allocation, AllocatorConfig, CachingAllocator};

/// Maps a driver error of `op` into this crate's [`Error::Device`].
pub(crate) fn driver_error(op: &'static str) -> impl Fn(DriverError) -> Error {
    move |e| Error::Device { op, reason: format!("CUDA driver: {e:?}") }
}

/// One CUDA device: everything its tensors and ops need.
///
/// Fields drop in order: the cuBLAS handle and the kernel modules go before the context
/// reference they were made in.
pub(crate) struct CudaBackend {
    blas: Mutex<Blas>,
    /// cuDNN's handle and algorithm caches, or why cuDNN is not usable here.
    dnn: std::result::Result<Mutex<dnn::Dnn>, String>,
    /// `None` where libcublasLt could not be loaded: linears then run cuBLAS and own kernels.
    /// cuBLASLt, or why it is not usable (the linears then run cuBLAS and own kernels).
    blas_lt: std::result::Result<Mutex<BlasLt>, String>,
    /// Products cuBLASLt found no algorithm for, which ran the unfused path instead.
    lt_fallbacks: AtomicU64,
    kernels: Loader,
    alloc: CachingAllocator<CudaMemory>,
    stream: Arc<CudaStream>,
    /// A non-blocking stream for host-to-device copies that overlap compute, made on first use.
    transfer: std::sync::OnceLock<Arc<CudaStream>>,
    ctx: Arc<CudaContext>,
    ordinal: usize,
    compute_capability: (u32, u32),
    name: String,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .finish()
    }
}

impl CudaBackend {
    /// Opens device `ordinal` and compiles the elementwise kernels, so that a device that is
    /// returned can run ops. `config: None` reads `VRAM_ALLOC_CONF`.
    pub(crate) fn new(ordinal: usize, config: Option<AllocatorConfig>) -> Result<CudaBackend> {
        let unusable = |reason: String| {
            Error::Unsupported(format!(
                "CUDA device {ordinal} is not usable: {reason}; use the host (VRAM_DEVICE=cpu)"
            ))
        };
        let info = probe(ordinal).map_err(unusable)?;
        // SAFETY: only tries to open the libraries by their candidate names; no CUDA call.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(unusable(
                "libnvrtc (CUDA 13) was not found; add its directory to LD_LIBRARY_PATH".into(),
            ));
        }
        // SAFETY: as above.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(unusable(
                "libcublas (CUDA 13) was not found; add its directory to LD_LIBRARY_PATH".into(),
            ));
        }
        let memory = CudaMemory::new(ordinal)
            .map_err(|e| Error::Device { op: "Device::cuda", reason: e.to_string() })?;
        let alloc = match config {
            Some(config) => CachingAllocator::with_config(memory, config)?,
            None => CachingAllocator::from_env(memory)?,
        };
        let ctx = CudaContext::new(ordinal).map_err(driver_error("CudaContext::new"))?;
        let stream = ctx.default_stream();
        let (major, minor) =
            ctx.compute_capability().map_err(driver_error("cuDeviceGetAttribute"))?;
        ctx.bind_to_thread().map_err(driver_error("cuCtxSetCurrent"))?;
        let blas = Blas::new()?;
        // cuDNN is optional: without it convolutions run on the own kernels.
        let dnn = dnn::Dnn::load().map(Mutex::new);
        // cuBLASLt is optional too: without it linears run cuBLAS and the own kernels.
        let blas_lt = BlasLt::new().map(Mutex::new);
        let backend = CudaBackend {
            blas: Mutex::new(blas),
            dnn,
            blas_lt,
            lt_fallbacks: AtomicU64::new(0),
            kernels: Loader::new(major, minor),
            alloc,
            stream,
            transfer: std::sync::OnceLock::new(),
            ctx,
            ordinal,
            compute_capability: (major as u32, minor as u32),
            name: format!("cuda:{ordinal} ({}, sm_{major}{minor})", info.name),
        };
        backend.kernels.module(&backend.ctx, &registry::ELEMENTWISE)?;
        Ok(backend)
    }

    /// Whether cuBLASLt was loaded (fused linear epilogues), or linears run cuBLAS and
    /// the crate's own kernels.
    pub(crate) fn has_blas_lt(&self) -> bool {
        self.blas_lt.is_ok()
    }

    /// Why cuBLASLt is not usable on this device, if it is not.
    pub(crate) fn blas_lt_missing(&self) -> Option<&str> {
        self.blas_lt.as_ref().err().map(String::as_str)
    }

    /// How many products cuBLASLt did not run (no algorithm, a dimension of 1, or the call
    /// failed; each ran the unfused path).
    pub(crate) fn lt_fallbacks(&self) -> u64 {
        self.lt_fallbacks.load(Ordering::Relaxed)
    }

    /// The compute capability, `(major, minor)`.
    pub(crate) fn compute_capability(&self) -> (u32, u32) {
        self.compute_capability
    }

    /// The loaded cuDNN's version, or why cuDNN is not usable on this device.
    pub(crate) fn cudnn_version(&self) -> std::result::Result<usize, String> {
        match &self.dnn {
            Ok(d) => Ok(d.lock().unwrap_or_else(|e| e.into_inner()).version()),
            Err(reason) => Err(reason.clone()),
        }
    }

    /// Runs one direction of convolution `key` through cuDNN (see [`dnn::Dnn::convolution`]),
    /// its workspace from this device's caching allocator.
    ///
    /// # Safety
    ///
    /// As [`dnn::Dnn::convolution`].
    pub(crate) unsafe fn cudnn_convolution(
        &self,
        pass: dnn::Pass,
        key: &dnn::ConvKey,
        benchmark: bool,
        ptrs: dnn::Pointers,
        blend: Option<&dyn Fn() -> Result<()>>,
    ) -> Result<()> {
        let dnn = self.dnn_lock()?;
        // SAFETY: the caller's contract.
        unsafe { dnn.convolution(pass, key, benchmark, ptrs, self, blend) }
    }

    /// cuDNN's handle with the device's context bound, or an error naming why cuDNN is not
    /// loaded.
    pub(crate) fn dnn_lock(&self) -> Result<std::sync::MutexGuard<'_, dnn::Dnn>> {
        match &self.dnn {
            Ok(d) => {
                let guard = d.lock().unwrap_or_else(|e| e.into_inner());
                self.bind()?;
                Ok(guard)
            }
            Err(reason) => Err(Error::Unsupported(format!("cuDNN is not usable: {reason}"))),
        }
    }

    /// The allocator holding this device's tensors.
    pub(crate) fn allocator(&self) -> &CachingAllocator<CudaMemory> {
        &self.alloc
    }

    /// The device in words.
    pub(crate) fn name(&self) -> String {
        format!("{} ({})", self.name, vram_alloc::DeviceMemory::name(self.alloc.memory()))
    }

    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(driver_error("cuCtxSetCurrent"))
    }

    /// Device memory for `bytes` bytes from the cache (for outputs and temporaries).
    pub(crate) fn allocate(&self, bytes: usize) -> Result<Allocation<CudaMemory>> {
        Ok(self.alloc.allocate(bytes)?)
    }

    /// The stream every op runs on.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The transfer stream (created on first use).
    fn transfer_stream(&self) -> Result<&Arc<CudaStream>> {
        if let Some(s) = self.transfer.get() {
            return Ok(s);
        }
        let s = self.ctx.new_stream().map_err(driver_error("cuStreamCreate"))?;
        Ok(self.transfer.get_or_init(|| s))
    }

    /// Page-locked host memory of `bytes` bytes (`cuMemHostAlloc`).
    pub(crate) fn alloc_pinned(&self, bytes: usize) -> Result<*mut u8> {
        self.bind()?;
        // SAFETY: allocates fresh page-locked memory; freed by `free_pinned`.
        let p = unsafe { result::malloc_host(bytes.max(1), 0) }
            .map_err(driver_error("cuMemHostAlloc"))?;
        Ok(p.cast())
    }

    /// Frees memory from [`Self::alloc_pinned`].
    ///
    /// # Safety
    /// `ptr` must come from `alloc_pinned` and no queued copy may still read it.
    pub(crate) unsafe fn free_pinned(&self, ptr: *mut u8) {
        let _ = self.bind();
        // SAFETY: the caller's contract.
        let _ = unsafe { result::free_host(ptr.cast()) };
    }

    /// Starts copying `src` (page-locked) into a new allocation on the transfer stream and
    /// returns the allocation, already marked as used by the compute stream, and an event the
    /// compute stream must wait on before reading it.
    ///
    /// # Safety
    /// `src` must stay alive and unmodified until the event has completed.
    pub(crate) unsafe fn upload(
        &self,
        src: &[u8],
    ) -> Result<(Allocation<CudaMemory>, cudarc::driver::CudaEvent)> {
        let transfer = self.transfer_stream()?;
        // Allocated for the transfer stream, so that no block the compute stream may still be
        // using is written; the compute stream is recorded as a user before it reads it.
        let block =
            self.alloc.allocate_on(src.len(), vram_alloc::Stream(transfer.cu_stream() as u64))?;
        block.record_stream(vram_alloc::Stream(self.stream.cu_stream() as u64));
        self.bind()?;
        if !src.is_empty() {
            // SAFETY: `block` holds `src.len()` bytes; `src` outlives the copy (the caller's
            // contract), and page-locked memory makes the copy truly asynchronous.
            unsafe { result::memcpy_htod_async(block.ptr(), src, transfer.cu_stream()) }
                .map_err(driver_error("cuMemcpyHtoDAsync"))?;
        }
        let event = transfer.record_event(None).map_err(driver_error("cuEventRecord"))?;
        Ok((block, event))
    }

    /// Makes the compute stream wait for `event` (recorded on the transfer stream).
    pub(crate) fn wait_for(&self, event: &cudarc::driver::CudaEvent) -> Result<()> {
        self.stream.wait(event).map_err(driver_error("cuStreamWaitEvent"))
    }

    /// Waits for all work on every stream of the device's context.
    pub(crate) fn synchronize_all(&self) -> Result<()> {
        self.bind()?;
        self.ctx.synchronize().map_err(driver_error("cuCtxSynchronize"))
    }

    /// Waits for all work queued on the device's stream.
    pub(crate) fn synchronize(&self) -> Result<()> {
        self.bind()?;
        self.stream.synchronize().map_err(driver_error("cuStreamSynchronize"))
    }

    /// Copies host bytes to device memory at `dst` (which holds at least `src.len()` bytes).
    pub(crate) fn copy_to_device(&self, dst: u64, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: `dst` is a live device allocation of at least `src.len()` bytes (the
        // caller's contract). From pageable memory the call returns once `src` has been
        // staged, so `src` may be dropped afterwards.
        unsafe { result::memcpy_htod_async(dst, src, self.stream.cu_stream()) }
            .map_err(driver_error("cuMemcpyHtoDAsync"))
    }

    /// Copies `dst.len()` bytes of device memory at `src` to the host, after all queued work.
    pub(crate) fn copy_to_host(&self, dst: &mut [u8], src: u64) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: `src` is a live device allocation of at least `dst.len()` bytes (the
        // caller's contract); the stream is synchronized before `dst` is read.
        unsafe { result::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }
            .map_err(driver_error("cuMemcpyDtoHAsync"))?;
        self.synchronize()
    }

    /// Copies `bytes` bytes between device allocations, stream-ordered.
    pub(crate) fn copy_on_device(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: both are live device allocations of at least `bytes` bytes that do not
        // overlap (the caller's contract).
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .map_err(driver_error("cuMemcpyDtoDAsync"))
    }

    /// Sets `bytes` bytes at `dst` to zero (0.0 in every dtype), stream-ordered.
    pub(crate) fn zero(&self, dst: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: `dst` is a live device allocation of at least `bytes` bytes.
        unsafe { result::memset_d8_async(dst, 0, bytes, self.stream.cu_stream()) }
            .map_err(driver_error("cuMemsetD8Async"))
    }

    /// Launches `kernel` with `args` on the device's stream. A grid with no blocks launches
    /// nothing. Arguments that do not match the kernel's registered parameters in number and
    /// type are refused before anything is launched.
    ///
    /// # Safety
    ///
    /// Every pointer among `args` must be a live allocation of this device holding every
    /// element the kernel addresses with these arguments (and, for outputs, not aliasing
    /// inputs unless the kernel works in place).
    pub(crate) unsafe fn launch(
        &self,
        kernel: Instance,
        cfg: LaunchConfig,
        args: &[Arg],
    ) -> Result<()> {
        launch::check_args(kernel, args)?;
        let (x, y, z) = cfg.grid_dim;
        if x == 0 || y == 0 || z == 0 {
            return Ok(());
        }
        let func = self.kernels.function(&self.ctx, kernel, cfg.shared_mem_bytes)?;
        // SAFETY: the arguments match the kernel's parameters (checked above against the
        // registry, which the NVRTC test checks against the compiled PTX); the pointers are
        // the caller's contract.
        unsafe { self.launch_function(&func, cfg, args, kernel.name) }
    }

    /// Launches the loaded `func` (named `name` in errors) with `args` on the device's stream.
    ///
    /// # Safety
    ///
    /// `args` match `func`'s parameters in number and type, and every pointer among them is
    /// a live allocation of this device holding what the kernel addresses.
    unsafe fn launch_function(
        &self,
        func: &cudarc::driver::CudaFunction,
        cfg: LaunchConfig,
        args: &[Arg],
        name: &str,
    ) -> Result<()> {
        let mut builder = self.stream.launch_builder(func);
        for arg in args {
            match arg {
                Arg::Ptr(v) | Arg::U64(v) => builder.arg(v),
                Arg::I64(v) => builder.arg(v),
                Arg::U32(v) => builder.arg(v),
                Arg::F32(v) => builder.arg(v),
                Arg::Conv(v) => builder.arg(v),
                Arg::Pool(v) => builder.arg(v),
                Arg::Div(v) => builder.arg(v),
            };
        }
        // SAFETY: the caller's contract; `args` outlives the launch call that reads them.
        unsafe { builder.launch(cfg) }
            .map_err(|e| Error::Device { op: "kernel launch", reason: format!("{name}: {e:?}") })?;
        Ok(())
    }
}

impl dnn::WorkspaceSource for CudaBackend {
    fn workspace(&self, bytes: usize) -> Result<Option<Allocation<CudaMemory>>> {
        if bytes == 0 { Ok(None) } else { Ok(Some(self.alloc.allocate(bytes)?)) }
    }

    fn cache_info(&self) -> u64 {
        self.alloc.cache_info()
    }

    fn empty_cache(&self) {
        self.alloc.empty_cache();
    }
}

/// What an op's CUDA code runs with: the device, the cuBLAS workspace the op layer
/// allocated for it and the device's TF32 setting for f32 matmuls.
pub(crate) struct Gpu<'a> {
    cu: &'a CudaBackend,
    blas_workspace: Option<(u64, usize)>,
    tf32: bool,
}

impl<'a> Gpu<'a> {
    /// The device `cu` with the cuBLAS workspace `blas_workspace` (`(address, bytes)`);
    /// `tf32`: f32 products may use TF32 tensor cores
    /// ([`Device::allow_tf32_matmul`](crate::Device::allow_tf32_matmul)).
    pub(crate) fn new(
        cu: &'a CudaBackend,
        blas_workspace: Option<(u64, usize)>,
        tf32: bool,
    ) -> Gpu<'a> {
        Gpu { cu, blas_workspace, tf32 }
    }

    /// Runs the product `g` with its epilogue through cuBLASLt, in the device's cuBLAS
    /// workspace (at most [`blaslt::lt_workspace_bytes`] of it: PyTorch's unified cuBLAS /
    /// cuBLASLt workspace). `Ok(false)`, with nothing queued, when cuBLASLt is not loaded or
    /// has no algorithm for it: the caller then runs the unfused path.
    ///
    /// # Safety
    ///
    /// As [`BlasLt::matmul`]: the pointers of `g` hold what its dimensions address.
    pub(crate) unsafe fn lt_matmul(&self, g: &LtGemm) -> Result<bool> {
        let Ok(lt) = &self.cu.blas_lt else { return Ok(false) };
        if g.m == 0 || g.n == 0 || g.k == 0 {
            return Ok(false);
        }
        self.cu.bind()?;
        let workspace = self
            .blas_workspace
            .map(|(ptr, bytes)| (ptr, blaslt::lt_workspace_bytes(bytes)))
            .filter(|&(_, bytes)| bytes > 0);
        // cuBLAS and cuBLASLt share the workspace: hold the cuBLAS lock too, so that no
        // product of another thread uses it at the same time (both queue on one stream).
        let _blas = self.cu.blas.lock().unwrap_or_else(|e| e.into_inner());
        let lt = lt.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the caller's contract; the context is bound and the workspace is the
        // device's cuBLAS workspace, used by products queued in order on the one stream.
        let ran = unsafe { lt.matmul(g, workspace, self.tf32)? };
        if !ran {
            self.cu.lt_fallbacks.fetch_add(1, Ordering::Relaxed);
        }
        Ok(ran)
    }

    /// The device.
    pub(crate) fn backend(&self) -> &'a CudaBackend {
        self.cu
    }

    /// `C = alpha * op(A) * op(B) + beta * C` through cuBLAS (see [`blas::Blas::gemm`]);
    /// A and B of `ab`, C of `c_type`. Empty products write nothing, except that `k == 0`
    /// with `beta == 0` zeroes C.
    ///
    /// # Safety
    ///
    /// `a`, `b` and `c` must be live allocations of this device holding `spec.a_len()`,
    /// `b_len()` and `c_len()` elements of their types, C matrices of different batches
    /// must not overlap, and C must not alias A or B.
    pub(crate) unsafe fn gemm(
        &self,
        spec: &crate::params::MatmulSpec,
        a: u64,
        b: u64,
        c: u64,
        ab: crate::DType,
        c_type: crate::DType,
    ) -> Result<()> {
        let s = spec;
        if s.batch == 0 || s.m == 0 || s.n == 0 {
            return Ok(());
        }
        if s.k == 0 {
            if s.beta == 0.0 {
                let size = c_type.size_in_bytes();
                for i in 0..s.batch {
                    self.zero(c + (i * s.stride_c * size) as u64, s.m * s.n * size)?;
                }
            }
            return Ok(());
        }
        self.cu.bind()?;
        let mut blas = self.cu.blas.lock().unwrap_or_else(|e| e.into_inner());
        blas.set_workspace(self.blas_workspace)?;
        blas.set_tf32(self.tf32);
        blas.gemm(s, a, b, c, ab, c_type)
    }
}

/// What an op's CUDA code runs on: kernel launches, cuBLAS products and memsets. [`Gpu`] is
/// the device; in tests, `emulate::Emulator` runs the same code on the host (the kernels
/// compiled as C++, products by a reference loop), so an op's launch sequence, strides and
/// workspace layout are checked on machines without a GPU. Ops whose CUDA code takes an
/// `Exec` (convolution) work on raw addresses rather than tensors for that reason.
pub(crate) trait Exec {
    /// Launches `kernel` (see [`CudaBackend::launch`]).
    ///
    /// # Safety
    ///
    /// As [`CudaBackend::launch`].
    unsafe fn launch(&self, kernel: Instance, cfg: LaunchConfig, args: &[Arg]) -> Result<()>;

    /// `C = alpha * op(A) * op(B) + beta * C` (see [`Gpu::gemm`]).
    ///
    /// # Safety
    ///
    /// As [`Gpu::gemm`].
    unsafe fn gemm(
        &self,
        spec: &crate::params::MatmulSpec,
        a: u64,
        b: u64,
        c: u64,
        ab: crate::DType,
        c_type: crate::DType,
    ) -> Result<()>;

    /// Sets `bytes` bytes at `dst` to zero (see [`CudaBackend::zero`]).
    fn zero(&self, dst: u64, bytes: usize) -> Result<()>;
}

impl Exec for Gpu<'_> {
    unsafe fn launch(&self, kernel: Instance, cfg: LaunchConfig, args: &[Arg]) -> Result<()> {
        // SAFETY: the caller's contract is the backend's.
        unsafe { self.cu.launch(kernel, cfg, args) }
    }

    unsafe fn gemm(
        &self,
        spec: &crate::params::MatmulSpec,
        a: u64,
        b: u64,
        c: u64,
        ab: crate::DType,
        c_type: crate::DType,
    ) -> Result<()> {
        // SAFETY: the caller's contract is the inherent method's.
        unsafe { Gpu::gemm(self, spec, a, b, c, ab, c_type) }
    }

    fn zero(&self, dst: u64, bytes: usize) -> Result<()> {
        self.cu.zero(dst, bytes)
    }
}

impl std::ops::Deref for Gpu<'_> {
    type Target = CudaBackend;

    fn deref(&self) -> &CudaBackend {
        self.cu
    }
}
