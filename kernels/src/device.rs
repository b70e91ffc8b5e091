//! Devices: where tensors live and which allocator counts their bytes.
//!
//! The host backend's memory is a [`CachingAllocator`] over [`HostMemory`]; a virtual
//! device's is the same allocator over [`VirtualMemory`] (addresses only, no bytes); a CUDA
//! device's (feature `cuda`) is the same allocator over `cuMemAlloc` segments. Every op
//! plans its allocations once for all three ([`crate::ops`]), so the same program makes the
//! same requests in the same order on each, and the statistics agree.
//!
//! The cuBLAS workspace is one of those requests: as PyTorch does, a device takes it from
//! its caching allocator at the first op that runs a matrix product and keeps it until the
//! device goes (see [`Device::set_blas_workspace_size`]). cuBLASLt (a linear layer's fused
//! epilogues) runs in the same block, at most `CUBLASLT_WORKSPACE_SIZE` KiB of it (default
//! 1024, PyTorch's): PyTorch's unified cuBLAS/cuBLASLt workspace
//! (`TORCH_CUBLASLT_UNIFIED_WORKSPACE`), so no second block is allocated (PyTorch without
//! that setting allocates a separate 1 MiB block for cuBLASLt on the first such product).
//!
//! Convolutions on a CUDA device run through cuDNN when it loads (`libcudnn.so.9`, looked for
//! at run time like the other CUDA libraries), otherwise through vram's own kernels: see
//! [`ConvBackend`], [`Device::conv_path`] and PyTorch's switches
//! [`Device::set_cudnn_benchmark`] and [`Device::set_allow_tf32_cudnn`]. The same switch sends
//! batch norm through cuDNN where PyTorch does ([`Device::batch_norm_path`]).

use crate::cudnn_choices::{BnPass as BnCall, ConvPass, CudnnChoices};
use crate::error::{Error, Result};
use crate::storage::Storage;
use std::fmt;
use std::io::Write as _;
use std::sync::{Arc, Mutex, MutexGuard, Once};
use vram_alloc::{
    AllocatorConfig, CachingAllocator, HostMemory, MemoryStats, Snapshot, VirtualMemory,
};

/// The environment variable [`Device::from_env`] reads: `cpu` or `cuda` (or `cuda:N`).
pub const DEVICE_ENV_VAR: &str = "VRAM_DEVICE";

/// The environment variable a CUDA device reads its [`ConvBackend`] from when it opens:
/// `auto` (or unset, or empty), `cudnn` or `own`.
pub const CONV_BACKEND_ENV_VAR: &str = "VRAM_CONV_BACKEND";

/// Host capacity used by [`Device::auto`] and [`Device::from_env`] when the machine's
/// physical memory cannot be read.
const FALLBACK_HOST_CAPACITY: u64 = 16 << 30;

/// The compute capability [`Device::virtual_device`] sizes its cuBLAS workspace for: an
/// H100 (sm_90).
const VIRTUAL_COMPUTE_CAPABILITY: (u32, u32) = (9, 0);

/// A compute device: a cheap-to-clone handle (clones share one allocator).
///
/// Two handles are the same device ([`PartialEq`]) when one is a clone of the other; ops
/// refuse to combine tensors of different devices.
#[derive(Clone)]
pub struct Device {
    inner: Arc<Inner>,
}

struct Inner {
    /// The cuBLAS workspace goes before the allocator that holds it.
    blas: Mutex<BlasWorkspace>,
    /// How convolutions run (CUDA devices only act on it).
    conv: Mutex<ConvSettings>,
    backend: Backend,
    /// Time per op, while profiling.
    profile: crate::profile::OpProfiler,
    /// Whether f32 matmuls may use TF32 tensor cores (default off).
    allow_tf32_matmul: std::sync::atomic::AtomicBool,
    /// A GPU's record of cuDNN's choices that a virtual device replays.
    cudnn_record: Mutex<Option<Arc<CudnnChoices>>>,
    /// cuDNN calls a virtual device replayed without a recorded choice.
    cudnn_misses: std::sync::atomic::AtomicUsize,
    /// The convolutions a virtual device replaying cuDNN has run (a GPU's algorithm caches:
    /// only a first call searches).
    cudnn_seen: Mutex<std::collections::HashSet<(ConvPass, crate::cudnn_choices::ConvKey)>>,
}

/// How a device runs a linear layer ([`crate::ops::linear`], [`crate::ops::linear_act`]) and
/// its backward ([`Device::linear_path`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinearPath {
    /// The CPU reference: the product, then the bias and the activation.
    Host,
    /// Nothing runs (a virtual device); allocations are the GPU's.
    Virtual,
    /// cuBLASLt, one call with the bias and GELU as its epilogue (the weight gradient's
    /// product also sums the bias gradient). A product cuBLASLt has no algorithm for runs
    /// the [`LinearPath::Cublas`] path instead (counted by [`Device::cublaslt_fallbacks`]).
    CublasLt,
    /// cuBLAS (`cublasGemmEx`, the bias broadcast into C first) and the crate's own GELU
    /// and column-sum kernels: libcublasLt could not be loaded or its handle not created
    /// ([`Device::cublaslt_missing`] says which).
    Cublas,
}

impl fmt::Display for LinearPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LinearPath::Host => "CPU reference",
            LinearPath::Virtual => "virtual (a GPU's allocations, nothing computed)",
            LinearPath::CublasLt => "cuBLASLt (bias and GELU epilogues)",
            LinearPath::Cublas => "cuBLAS and own kernels (no cuBLASLt)",
        })
    }
}

/// The workspace cuBLAS runs in: its size and, once an op has run a product, its block.
struct BlasWorkspace {
    size: usize,
    block: Option<Storage>,
}

/// Which code runs a CUDA device's convolutions ([`Device::set_conv_backend`]), and its batch
/// norms where PyTorch would run cuDNN ([`Device::batch_norm_path`]): one switch, as
/// `torch.backends.cudnn.enabled`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ConvBackend {
    /// cuDNN when the library loaded on this device, vram's own kernels otherwise (the
    /// default; as PyTorch with `torch.backends.cudnn.enabled = True`).
    #[default]
    Auto,
    /// cuDNN; asking for it where it did not load is an error.
    Cudnn,
    /// vram's own kernels (direct kernels, im2col + cuBLAS), as PyTorch with
    /// `torch.backends.cudnn.enabled = False` runs its native ones.
    Own,
}

impl std::str::FromStr for ConvBackend {
    type Err = Error;

    /// `auto` (or empty), `cudnn` or `own`, case-insensitive.
    fn from_str(s: &str) -> Result<ConvBackend> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(ConvBackend::Auto),
            "cudnn" => Ok(ConvBackend::Cudnn),
            "own" => Ok(ConvBackend::Own),
            other => Err(Error::InvalidArgument {
                op: "ConvBackend",
                reason: format!("{other:?} is not a convolution backend; use auto, cudnn or own"),
            }),
        }
    }
}

/// The path a device's convolutions take ([`Device::conv_path`]), in words through
/// [`Display`](fmt::Display), for a run's report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConvPath {
    /// cuDNN, of this version (`cudnnGetVersion`, e.g. 91400 for 9.14.0).
    Cudnn {
        /// The library's version number.
        version: usize,
    },
    /// vram's own CUDA kernels, and why not cuDNN.
    Own {
        /// Why: cuDNN was not found (with the loader's reason), or [`ConvBackend::Own`].
        reason: String,
    },
    /// The host's CPU reference.
    Host,
    /// A virtual device: no computation; it allocates what vram's own kernels allocate (their
    /// im2col and accumulator workspaces, batch norm's per-channel ones), not what cuDNN's
    /// algorithms would (their workspaces and reserve spaces can only be sized on a GPU).
    Virtual,
    /// A virtual device replaying a GPU's record of cuDNN's choices
    /// ([`Device::set_cudnn_choices`]): it allocates what that GPU's cuDNN path allocates.
    VirtualCudnn {
        /// The recorded cuDNN's version number.
        version: usize,
        /// The GPU the record was made on.
        device: String,
    },
}

impl fmt::Display for ConvPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConvPath::Cudnn { version } => {
                write!(f, "cuDNN {}.{}.{}", version / 10000, (version / 100) % 100, version % 100)
            }
            ConvPath::Own { reason } => write!(f, "own kernels ({reason})"),
            ConvPath::Host => write!(f, "CPU reference"),
            ConvPath::Virtual => write!(f, "virtual (own kernels' workspaces modelled)"),
            ConvPath::VirtualCudnn { version, device } => write!(
                f,
                "virtual (replaying {}'s choices on {device})",
                ConvPath::Cudnn { version: *version }
            ),
        }
    }
}

/// A device's convolution settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ConvSettings {
    pub(crate) backend: ConvBackend,
    /// `torch.backends.cudnn.benchmark`: a timed search per new shape instead of cuDNN's
    /// heuristics.
    pub(crate) benchmark: bool,
    /// `torch.backends.cudnn.allow_tf32`: f32 convolutions may use TF32 tensor cores.
    pub(crate) allow_tf32: bool,
}

impl Default for ConvSettings {
    /// PyTorch's defaults: cuDNN enabled, benchmark off, TF32 allowed for cuDNN.
    fn default() -> Self {
        ConvSettings { backend: ConvBackend::Auto, benchmark: false, allow_tf32: true }
    }
}

/// The backends.
enum Backend {
    Host(CachingAllocator<HostMemory>),
    Virtual(CachingAllocator<VirtualMemory>),
    #[cfg(feature = "cuda")]
    Cuda(Box<crate::cuda::CudaBackend>),
}

/// What an op computes on: the dispatch function's view of a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Compute {
    /// The CPU reference, on host memory.
    Host,
    /// Nothing: a virtual device only allocates.
    Virtual,
    /// NVRTC kernels and cuBLAS ([`Device::cuda_backend`]).
    #[cfg(feature = "cuda")]
    Cuda,
}

/// Runs `$body` with `$a` bound to the device's allocator, whatever its memory type.
macro_rules! with_allocator {
    ($device:expr, $a:ident => $body:expr) => {
        match &$device.inner.backend {
            Backend::Host($a) => $body,
            Backend::Virtual($a) => $body,
            #[cfg(feature = "cuda")]
            Backend::Cuda(cuda) => {
                let $a = cuda.allocator();
                $body
            }
        }
    };
}

/// The cuBLAS workspace PyTorch gives a GPU of compute capability `major.minor`:
/// `CUBLAS_WORKSPACE_CONFIG` when set (`:SIZE:COUNT` pairs, SIZE in KiB, summed), otherwise
/// 32 MiB on sm_90 (`:4096:8`) and 8 MiB + 128 KiB elsewhere (`:4096:2:16:8`).
pub fn default_blas_workspace_size(major: u32, minor: u32) -> usize {
    let default =
        if (major, minor) == (9, 0) { 4096 * 8 * 1024 } else { 4096 * 1024 * 2 + 16 * 1024 * 8 };
    std::env::var("CUBLAS_WORKSPACE_CONFIG")
        .ok()
        .and_then(|config| parse_workspace_config(&config))
        .unwrap_or(default)
}

/// The bytes of a `CUBLAS_WORKSPACE_CONFIG` value such as `:4096:8` or `:4096:2:16:8`, or
/// `None` when it has no `:SIZE:COUNT` pair (PyTorch then warns and keeps its default).
fn parse_workspace_config(config: &str) -> Option<usize> {
    let numbers: Vec<usize> = config
        .split(':')
        .filter(|s| !s.is_empty())
        .map(|s| s.trim().parse().ok())
        .collect::<Option<_>>()?;
    if numbers.is_empty() || !numbers.len().is_multiple_of(2) {
        return None;
    }
    numbers.chunks_exact(2).try_fold(0usize, |total, pair| {
        total.checked_add(pair[0].checked_mul(1024)?.checked_mul(pair[1])?)
    })
}

/// Prints why [`Device::auto`] chose the host, once per process.
fn note_host_fallback(reason: &str) {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = writeln!(std::io::stderr(), "vram: using the host device: {reason}");
    });
}

impl Device {
    /// A host device whose memory is capped at `capacity_bytes`, with the allocator's default
    /// settings and no cuBLAS workspace (give it one with
    /// [`set_blas_workspace_size`](Self::set_blas_workspace_size) to count the bytes a GPU
    /// would).
    pub fn host(capacity_bytes: u64) -> Device {
        Device::from_backend(Backend::Host(CachingAllocator::new(HostMemory::new(capacity_bytes))))
    }

    /// A host device with the given allocator settings.
    ///
    /// # Errors
    ///
    /// [`Error::Allocator`] if the host backend cannot honour `config`.
    pub fn host_with_config(capacity_bytes: u64, config: AllocatorConfig) -> Result<Device> {
        let alloc = CachingAllocator::with_config(HostMemory::new(capacity_bytes), config)?;
        Ok(Device::from_backend(Backend::Host(alloc)))
    }

    /// The host, capped at the machine's physical memory and configured from
    /// [`vram_alloc::ENV_VAR`] (`VRAM_ALLOC_CONF`).
    ///
    /// # Errors
    ///
    /// [`Error::Allocator`] if `VRAM_ALLOC_CONF` is invalid.
    pub fn host_from_env() -> Result<Device> {
        let alloc = CachingAllocator::from_env(HostMemory::new(physical_memory()))?;
        Ok(Device::from_backend(Backend::Host(alloc)))
    }

    /// A virtual device of `capacity_bytes`: tensors have shapes, dtypes and memory from a
    /// caching allocator over [`VirtualMemory`], and ops allocate exactly what they allocate
    /// on a CUDA device but compute nothing, so a training step of a model of any size runs
    /// in moments and its statistics are those of the GPU. Reading values is an
    /// [`Error::NoValues`]; a loss is NaN. The cuBLAS workspace is an H100's (32 MiB, see
    /// [`default_blas_workspace_size`]).
    ///
    /// ```
    /// use vram_kernels::{DType, Device, Tensor, ops};
    ///
    /// let gpu = Device::virtual_device(80 << 30);
    /// let x = Tensor::zeros(&gpu, &[8192, 8192], DType::BF16)?;
    /// let y = ops::matmul(&x, &x, false, false)?;
    /// assert_eq!(gpu.memory_allocated(), 2 * (128 << 20) + (32 << 20));
    /// assert!(y.to_f32_vec().unwrap_err().to_string().contains("virtual device"));
    /// # Ok::<(), vram_kernels::Error>(())
    /// ```
    pub fn virtual_device(capacity_bytes: u64) -> Device {
        let memory = VirtualMemory::new(capacity_bytes);
        Device::new_virtual(CachingAllocator::new(memory))
    }

    /// A virtual device with the given allocator settings (see
    /// [`virtual_device`](Self::virtual_device)).
    ///
    /// # Errors
    ///
    /// [`Error::Allocator`] if the allocator cannot honour `config`.
    pub fn virtual_with_config(capacity_bytes: u64, config: AllocatorConfig) -> Result<Device> {
        let alloc = CachingAllocator::with_config(VirtualMemory::new(capacity_bytes), config)?;
        Ok(Device::new_virtual(alloc))
    }

    fn new_virtual(alloc: CachingAllocator<VirtualMemory>) -> Device {
        let device = Device::from_backend(Backend::Virtual(alloc));
        let (major, minor) = VIRTUAL_COMPUTE_CAPABILITY;
        device.set_blas_workspace_size(default_blas_workspace_size(major, minor));
        device
    }

    /// CUDA device `ordinal`, its allocator configured from `VRAM_ALLOC_CONF`. The driver,
    /// NVRTC and cuBLAS are loaded at run time; the elementwise kernels are compiled here,
    /// the others on first use. cuDNN is loaded too when it is found; without it
    /// convolutions run on vram's own kernels and [`Device::conv_path`] says why. The
    /// convolution backend is [`CONV_BACKEND_ENV_VAR`]'s (`VRAM_CONV_BACKEND`), else
    /// [`ConvBackend::Auto`].
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] naming the reason when there is no usable device (no driver,
    /// no such ordinal, a missing library, or a build without the `cuda` feature);
    /// [`Error::Device`] if the driver or NVRTC fails; [`Error::Allocator`] for an invalid
    /// `VRAM_ALLOC_CONF`; [`Error::InvalidArgument`] for an invalid `VRAM_CONV_BACKEND`, or
    /// `cudnn` where cuDNN did not load.
    pub fn cuda(ordinal: usize) -> Result<Device> {
        Device::open_cuda(ordinal, None)
    }

    /// CUDA device `ordinal` with the given allocator settings.
    ///
    /// # Errors
    ///
    /// As [`Device::cuda`].
    pub fn cuda_with_config(ordinal: usize, config: AllocatorConfig) -> Result<Device> {
        Device::open_cuda(ordinal, Some(config))
    }

    #[cfg(feature = "cuda")]
    fn open_cuda(ordinal: usize, config: Option<AllocatorConfig>) -> Result<Device> {
        let backend = crate::cuda::CudaBackend::new(ordinal, config)?;
        let (major, minor) = backend.compute_capability();
        let device = Device::from_backend(Backend::Cuda(Box::new(backend)));
        device.set_blas_workspace_size(default_blas_workspace_size(major, minor));
        let backend: ConvBackend = std::env::var(CONV_BACKEND_ENV_VAR)
            .unwrap_or_default()
            .parse()
            .map_err(|_| Error::InvalidArgument {
                op: "Device::cuda",
                reason: format!(
                    "{CONV_BACKEND_ENV_VAR}={:?} is not a convolution backend; use auto, \
                         cudnn or own",
                    std::env::var(CONV_BACKEND_ENV_VAR).unwrap_or_default()
                ),
            })?;
        device.set_conv_backend(backend).map_err(|e| Error::InvalidArgument {
            op: "Device::cuda",
            reason: format!("{CONV_BACKEND_ENV_VAR}=cudnn: {e}"),
        })?;
        Ok(device)
    }

    #[cfg(not(feature = "cuda"))]
    fn open_cuda(ordinal: usize, config: Option<AllocatorConfig>) -> Result<Device> {
        let _ = (ordinal, config);
        Err(Error::Unsupported(
            "CUDA: this build of vram-kernels has no `cuda` feature; rebuild with default features"
                .to_string(),
        ))
    }

    /// The best device available: CUDA device 0 when it is usable (driver, NVRTC, cuBLAS
    /// present and the kernels compile), otherwise the host capped at the machine's physical
    /// memory, with one line on stderr (once per process) saying why. The allocator is
    /// configured from [`vram_alloc::ENV_VAR`] (`VRAM_ALLOC_CONF`).
    ///
    /// # Errors
    ///
    /// [`Error::Allocator`] if `VRAM_ALLOC_CONF` is invalid.
    pub fn auto() -> Result<Device> {
        match Device::cuda(0) {
            Ok(device) => return Ok(device),
            // A bad setting (VRAM_ALLOC_CONF, VRAM_CONV_BACKEND) is the user's to fix, not a
            // reason to run on the host.
            Err(e @ (Error::Allocator(_) | Error::InvalidArgument { .. })) => return Err(e),
            Err(e) => note_host_fallback(&e.to_string()),
        }
        Device::host_from_env()
    }

    /// The device named by [`DEVICE_ENV_VAR`] (`VRAM_DEVICE`): `cpu` for the host, `cuda`
    /// (or `cuda:N`) for a GPU; unset or empty means [`Device::auto`].
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for any other value; for `cuda`, [`Device::cuda`]'s errors
    /// (a machine without a usable GPU is an error, not a silent fallback); and
    /// [`Device::auto`]'s errors.
    pub fn from_env() -> Result<Device> {
        Device::from_name(&std::env::var(DEVICE_ENV_VAR).unwrap_or_default())
    }

    /// The device named `name` (case-insensitive): `cpu` (or `host`) for the host, `cuda` or
    /// `cuda:N` for a GPU; empty means [`Device::auto`].
    ///
    /// # Errors
    ///
    /// As [`Device::from_env`].
    pub fn from_name(name: &str) -> Result<Device> {
        let name = name.trim().to_ascii_lowercase();
        let bad = |other: &str| Error::InvalidArgument {
            op: "Device::from_env",
            reason: format!("{DEVICE_ENV_VAR}={other:?} is not a device; use `cpu` or `cuda`"),
        };
        match name.as_str() {
            "" => Device::auto(),
            "cpu" | "host" => Device::host_from_env(),
            "cuda" => Device::cuda(0),
            other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(ordinal)) => Device::cuda(ordinal),
                _ => Err(bad(other)),
            },
        }
    }

    fn from_backend(backend: Backend) -> Device {
        let blas = Mutex::new(BlasWorkspace { size: 0, block: None });
        let conv = Mutex::new(ConvSettings::default());
        let inner = Inner {
            blas,
            conv,
            backend,
            profile: Default::default(),
            allow_tf32_matmul: Default::default(),
            cudnn_record: Mutex::new(None),
            cudnn_misses: Default::default(),
            cudnn_seen: Default::default(),
        };
        Device { inner: Arc::new(inner) }
    }

    /// The host allocator that holds this device's tensors, or `None` on another device.
    pub fn host_allocator(&self) -> Option<&CachingAllocator<HostMemory>> {
        match &self.inner.backend {
            Backend::Host(alloc) => Some(alloc),
            _ => None,
        }
    }

    /// The virtual allocator of a virtual device, or `None` on another device.
    pub fn virtual_allocator(&self) -> Option<&CachingAllocator<VirtualMemory>> {
        match &self.inner.backend {
            Backend::Virtual(alloc) => Some(alloc),
            _ => None,
        }
    }

    /// The CUDA allocator, or `None` on another device.
    #[cfg(feature = "cuda")]
    pub fn cuda_allocator(&self) -> Option<&CachingAllocator<vram_alloc::cuda::CudaMemory>> {
        self.cuda_backend().map(|cuda| cuda.allocator())
    }

    /// The CUDA stream every op of this device runs on (bound to the device's primary
    /// context), for libraries that enqueue work in order with vram's ops, such as NCCL;
    /// `None` on a host or virtual device.
    #[cfg(feature = "cuda")]
    pub fn cuda_stream(&self) -> Option<std::sync::Arc<cudarc::driver::CudaStream>> {
        self.cuda_backend().map(|cuda| std::sync::Arc::clone(cuda.stream()))
    }

    /// The CUDA backend, or `None` on another device.
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_backend(&self) -> Option<&crate::cuda::CudaBackend> {
        match &self.inner.backend {
            Backend::Cuda(cuda) => Some(cuda),
            _ => None,
        }
    }

    /// Whether f32 matrix products (cuBLAS and cuBLASLt) may use TF32 tensor cores:
    /// PyTorch's `torch.backends.cuda.matmul.allow_tf32`, off by default. f16 and bf16
    /// products are unaffected (tensor cores, f32 accumulation, either way); the host and a
    /// virtual device compute in FP32 whatever it says.
    pub fn allow_tf32_matmul(&self) -> bool {
        self.inner.allow_tf32_matmul.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Sets [`Device::allow_tf32_matmul`] for ops run from now on (on this device and its
    /// clones).
    pub fn set_allow_tf32_matmul(&self, allow: bool) {
        self.inner.allow_tf32_matmul.store(allow, std::sync::atomic::Ordering::Relaxed);
    }

    /// How this device runs linear layers: the host reference, nothing (virtual), cuBLASLt
    /// with fused epilogues, or cuBLAS and the crate's own kernels where libcublasLt did
    /// not load.
    pub fn linear_path(&self) -> LinearPath {
        match &self.inner.backend {
            Backend::Host(_) => LinearPath::Host,
            Backend::Virtual(_) => LinearPath::Virtual,
            #[cfg(feature = "cuda")]
            Backend::Cuda(cuda) if cuda.has_blas_lt() => LinearPath::CublasLt,
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => LinearPath::Cublas,
        }
    }

    /// Why linear layers run [`LinearPath::Cublas`] on this CUDA device (libcublasLt not
    /// loaded, or its handle not created); `None` elsewhere and where cuBLASLt runs them.
    pub fn cublaslt_missing(&self) -> Option<String> {
        match &self.inner.backend {
            #[cfg(feature = "cuda")]
            Backend::Cuda(cuda) => cuda.blas_lt_missing().map(str::to_string),
            _ => None,
        }
    }

    /// How many products cuBLASLt did not run on this device (no algorithm, a dimension of
    /// 1, or the call failed), each run unfused (cuBLAS and the crate's kernels) instead; 0
    /// off a GPU.
    pub fn cublaslt_fallbacks(&self) -> u64 {
        match &self.inner.backend {
            #[cfg(feature = "cuda")]
            Backend::Cuda(cuda) => cuda.lt_fallbacks(),
            _ => 0,
        }
    }

    /// What ops compute on for this device.
    pub(crate) fn compute(&self) -> Compute {
        match &self.inner.backend {
            Backend::Host(_) => Compute::Host,
            Backend::Virtual(_) => Compute::Virtual,
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => Compute::Cuda,
        }
    }

    /// `bytes` bytes from the device's caching allocator, on the stream ops run on.
    pub(crate) fn allocate(&self, bytes: usize) -> Result<Storage> {
        Ok(match &self.inner.backend {
            Backend::Host(a) => Storage::Host(a.allocate(bytes)?),
            Backend::Virtual(a) => Storage::Virtual(a.allocate(bytes)?),
            #[cfg(feature = "cuda")]
            Backend::Cuda(cuda) => Storage::Cuda(cuda.allocate(bytes)?),
        })
    }

    fn blas(&self) -> MutexGuard<'_, BlasWorkspace> {
        // Only whole-value updates happen under the lock; a panic cannot leave it torn.
        self.inner.blas.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn conv(&self) -> MutexGuard<'_, ConvSettings> {
        // Only whole-value updates happen under the lock.
        self.inner.conv.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Which code runs this device's convolutions: [`ConvBackend::Auto`] unless set (a CUDA
    /// device opens with [`CONV_BACKEND_ENV_VAR`] when it is set).
    pub fn conv_backend(&self) -> ConvBackend {
        self.conv().backend
    }

    /// Chooses the code that runs this device's convolutions from the next op on. Host and
    /// virtual devices take [`ConvBackend::Auto`] and [`ConvBackend::Own`] (both mean their
    /// usual path, [`ConvPath::Host`] or [`ConvPath::Virtual`]).
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] for [`ConvBackend::Cudnn`] on a device where cuDNN did not
    /// load (the message says why), or on a host or virtual device; the setting is then
    /// unchanged.
    pub fn set_conv_backend(&self, backend: ConvBackend) -> Result<()> {
        if backend == ConvBackend::Cudnn
            && let Some(reason) = self.cudnn_missing()
        {
            return Err(Error::Unsupported(format!(
                "convolutions through cuDNN were asked for on {}, but {reason}",
                self.name()
            )));
        }
        self.conv().backend = backend;
        Ok(())
    }

    /// Why this device cannot run cuDNN, or `None` when it can.
    fn cudnn_missing(&self) -> Option<String> {
        match &self.inner.backend {
            #[cfg(feature = "cuda")]
            Backend::Cuda(cuda) => cuda.cudnn_version().err(),
            Backend::Host(_) => Some("the host device runs the CPU reference".into()),
            Backend::Virtual(_) if self.cudnn_record().is_some() => None,
            Backend::Virtual(_) => Some(
                "a virtual device cannot call cuDNN (it models vram's own kernels' workspaces, \
                 or a GPU's cuDNN choices given by Device::set_cudnn_choices)"
                    .into(),
            ),
        }
    }

    /// Whether convolutions search for the fastest cuDNN algorithm of each new shape by
    /// timing them all (`cudnnFind...AlgorithmEx`), as `torch.backends.cudnn.benchmark`;
    /// off by default (cuDNN's heuristics choose, `cudnnGet...Algorithm_v7`). Either way
    /// the algorithm that ran is cached per shape, dtype, layout and TF32 setting.
    pub fn cudnn_benchmark(&self) -> bool {
        self.conv().benchmark
    }

    /// Sets [`cudnn_benchmark`](Self::cudnn_benchmark). No effect on the own kernels.
    pub fn set_cudnn_benchmark(&self, on: bool) {
        self.conv().benchmark = on;
    }

    /// Whether f32 convolutions through cuDNN may use TF32 tensor cores
    /// (`CUDNN_DEFAULT_MATH`; off: `CUDNN_FMA_MATH`), as `torch.backends.cudnn.allow_tf32`,
    /// whose default, on, this follows. f16 and bf16 use tensor cores either way; the own
    /// kernels compute f32 in f32 either way.
    pub fn allow_tf32_cudnn(&self) -> bool {
        self.conv().allow_tf32
    }

    /// Sets [`allow_tf32_cudnn`](Self::allow_tf32_cudnn).
    pub fn set_allow_tf32_cudnn(&self, on: bool) {
        self.conv().allow_tf32 = on;
    }

    /// The path this device's convolutions take now, with cuDNN's version or the reason it
    /// is not used (print it with `{}`: `cuDNN 9.14.0`, `own kernels (libcudnn ... was not
    /// found ...)`). A convolution cuDNN cannot take (an empty one, or one with more than
    /// `i32::MAX` elements in a tensor) runs on the own kernels whatever this says.
    pub fn conv_path(&self) -> ConvPath {
        match &self.inner.backend {
            Backend::Host(_) => ConvPath::Host,
            Backend::Virtual(_) => match self.cudnn_record() {
                Some(r) if self.conv_backend() != ConvBackend::Own => {
                    ConvPath::VirtualCudnn { version: r.version, device: r.device.clone() }
                }
                _ => ConvPath::Virtual,
            },
            #[cfg(feature = "cuda")]
            Backend::Cuda(cuda) => match (self.conv_backend(), cuda.cudnn_version()) {
                (ConvBackend::Own, _) => {
                    ConvPath::Own { reason: "ConvBackend::Own was chosen".into() }
                }
                (_, Ok(version)) => ConvPath::Cudnn { version },
                (_, Err(reason)) => ConvPath::Own { reason: format!("no cuDNN: {reason}") },
            },
        }
    }

    /// The settings a convolution of `p` in `dtype` and `layout` runs cuDNN with, or `None`
    /// when it runs on the own kernels: not a CUDA device, no cuDNN, [`ConvBackend::Own`], or
    /// a convolution PyTorch would not send to cuDNN (its depthwise and bf16 rules, see
    /// `cudnn_choices::pytorch_uses_cudnn`; a virtual device replaying a record assumes a GPU
    /// of compute capability 8 or more, as the records this project makes are).
    pub(crate) fn cudnn_conv(
        &self,
        p: &crate::params::Conv2dParams,
        dtype: crate::DType,
        layout: crate::ConvLayout,
    ) -> Option<ConvSettings> {
        use crate::cudnn_choices::pytorch_uses_cudnn;
        #[cfg(feature = "cuda")]
        if let Backend::Cuda(cuda) = &self.inner.backend {
            let settings = *self.conv();
            let on = settings.backend != ConvBackend::Own
                && cuda.cudnn_version().is_ok()
                && pytorch_uses_cudnn(p, dtype, layout, cuda.compute_capability().0);
            return on.then_some(settings);
        }
        if self.replaying_cudnn().is_some() {
            let on = pytorch_uses_cudnn(p, dtype, layout, 8);
            return on.then_some(*self.conv());
        }
        None
    }

    /// The path this device's batch norms take where PyTorch would run cuDNN (f32, or f16
    /// with f32 parameters, 3 to 5 dimensions: PyTorch's `_select_batch_norm_backend`, see
    /// [`batch_norm`](crate::ops::batch_norm())):
    /// the convolutions' ([`conv_path`](Self::conv_path)), as one switch,
    /// [`ConvBackend`] (`VRAM_CONV_BACKEND`), turns cuDNN on or off for both, as
    /// `torch.backends.cudnn.enabled` does. Other batch norms run the own kernels whatever
    /// this says.
    pub fn batch_norm_path(&self) -> ConvPath {
        self.conv_path()
    }

    /// Whether batch norm `case` runs through cuDNN: a CUDA device where cuDNN loaded, not
    /// [`ConvBackend::Own`], PyTorch's rule (`BnCase::cudnn_refusal`)
    /// and, for the backward, no reserve space: vram's forward cannot hand one to its backward
    /// (it keeps only the saved mean and invstd), so a shape for which cuDNN's training asks
    /// for a reserve runs its backward on the own kernels (from the same saved statistics).
    pub(crate) fn cudnn_batch_norm(&self, case: &crate::ops::batch_norm::BnCase<'_>) -> bool {
        #[cfg(feature = "cuda")]
        if let Backend::Cuda(cuda) = &self.inner.backend {
            let on = self.conv_backend() != ConvBackend::Own
                && cuda.cudnn_version().is_ok()
                && case.cudnn_refusal().is_none();
            if !on {
                return false;
            }
            if !matches!(case.pass, crate::ops::batch_norm::BnPass::Backward) {
                return true;
            }
            return cuda
                .dnn_lock()
                .and_then(|dnn| dnn.bn_reserve_size(case.shape, case.dtype, case.layout))
                .is_ok_and(|bytes| bytes == 0);
        }
        // Replaying a GPU's cuDNN: PyTorch's rule, and a backward through cuDNN where the
        // recorded training call took no reserve space (or the record lacks it).
        if let Some(record) = self.replaying_cudnn() {
            if case.cudnn_refusal().is_some() {
                return false;
            }
            if !matches!(case.pass, crate::ops::batch_norm::BnPass::Backward) {
                return true;
            }
            let training = record.batch_norm(BnCall::Training, case.shape, case.dtype, case.layout);
            return training.is_none_or(|t| t.reserve == 0);
        }
        false
    }

    /// Makes a virtual device replay a GPU's cuDNN (see [`crate::cudnn_choices`]): from the
    /// next op on, its convolutions run as that GPU's cuDNN path (no own-kernel workspaces,
    /// channels_last read as it is, each call's workspace at the recorded size) and its
    /// batch norms go where PyTorch sends them to cuDNN; `None` returns it to modelling
    /// vram's own kernels. [`ConvBackend::Own`] on the device turns the replay off too.
    /// Resets [`cudnn_choice_misses`](Self::cudnn_choice_misses) and which shapes have run
    /// (with [`cudnn_benchmark`](Self::cudnn_benchmark) on, each shape's first call replays
    /// its recorded timed search).
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] on a host or CUDA device (a CUDA device makes its own choices).
    pub fn set_cudnn_choices(&self, choices: Option<CudnnChoices>) -> Result<()> {
        if !self.is_virtual() {
            return Err(Error::Unsupported(format!(
                "only a virtual device replays recorded cuDNN choices, not {}",
                self.name()
            )));
        }
        *self.inner.cudnn_record.lock().unwrap_or_else(|e| e.into_inner()) = choices.map(Arc::new);
        self.inner.cudnn_misses.store(0, std::sync::atomic::Ordering::Relaxed);
        self.inner.cudnn_seen.lock().unwrap_or_else(|e| e.into_inner()).clear();
        Ok(())
    }

    /// The cuDNN choices this device made (a CUDA device: every convolution shape and
    /// direction that ran through cuDNN, with its algorithm and workspace) or replays (a
    /// virtual device given some); `None` on the host, a virtual device without a record,
    /// or a CUDA device without cuDNN.
    pub fn cudnn_choices(&self) -> Option<CudnnChoices> {
        #[cfg(feature = "cuda")]
        if let Backend::Cuda(cuda) = &self.inner.backend {
            let version = cuda.cudnn_version().ok()?;
            let dnn = cuda.dnn_lock().ok()?;
            let mut record = CudnnChoices {
                device: self.name(),
                version,
                convolutions: dnn.choices(),
                batch_norms: dnn.batch_norm_choices(),
            };
            record.sort();
            return Some(record);
        }
        self.cudnn_record().map(|r| (*r).clone())
    }

    /// How many cuDNN calls this virtual device replayed without a recorded choice since
    /// [`set_cudnn_choices`](Self::set_cudnn_choices) (with
    /// [`cudnn_benchmark`](Self::cudnn_benchmark) on, also each shape's first call whose
    /// recorded choice was not found by a timed search): each took no workspace (no search
    /// workspace), so a peak measured with misses is a lower bound by those workspaces. 0 on
    /// other devices.
    pub fn cudnn_choice_misses(&self) -> usize {
        self.inner.cudnn_misses.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn cudnn_record(&self) -> Option<Arc<CudnnChoices>> {
        self.inner.cudnn_record.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The record this virtual device replays now (given one and not [`ConvBackend::Own`]).
    fn replaying_cudnn(&self) -> Option<Arc<CudnnChoices>> {
        if !self.is_virtual() || self.conv_backend() == ConvBackend::Own {
            return None;
        }
        self.cudnn_record()
    }

    /// On a virtual device replaying cuDNN, allocates and frees what the record's batch norm
    /// call `pass` on `x` took (training: its workspace, then its reserve space, both freed
    /// after the call; none, counted as a miss, when the record has no such call).
    ///
    /// # Errors
    ///
    /// Out of memory.
    pub(crate) fn replay_cudnn_batch_norm(
        &self,
        pass: BnCall,
        x: &crate::Tensor,
        layout: crate::ConvLayout,
    ) -> Result<()> {
        let Some(record) = self.replaying_cudnn() else { return Ok(()) };
        match record.batch_norm(pass, x.shape(), x.dtype(), layout) {
            Some(call) => {
                let work =
                    (call.workspace > 0).then(|| self.allocate(call.workspace)).transpose()?;
                let reserve =
                    (call.reserve > 0).then(|| self.allocate(call.reserve)).transpose()?;
                drop((work, reserve));
                Ok(())
            }
            None => {
                self.inner.cudnn_misses.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Ok(())
            }
        }
    }

    /// On a virtual device replaying cuDNN, allocates and frees the workspace the record
    /// gives convolution `p` in `pass` (none, counted as a miss, when it has no such call),
    /// as the GPU's call takes it from the caching allocator and returns it after. With
    /// [`cudnn_benchmark`](Self::cudnn_benchmark) on, a shape's first call first allocates
    /// the workspace its timed search ran in, empties the cache (as PyTorch does after the
    /// search) and frees the search's workspace (a miss when the recorded choice came from
    /// the heuristics).
    ///
    /// # Errors
    ///
    /// Out of memory.
    pub(crate) fn replay_cudnn_workspace(
        &self,
        pass: ConvPass,
        p: &crate::params::Conv2dParams,
        dtype: crate::DType,
        layout: crate::ConvLayout,
        allow_tf32: bool,
    ) -> Result<()> {
        let Some(record) = self.replaying_cudnn() else { return Ok(()) };
        let miss = || self.inner.cudnn_misses.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let key = crate::cudnn_choices::ConvKey::new(p, dtype, layout, allow_tf32);
        let Some(choice) = record.convolution(pass, &key) else {
            miss();
            return Ok(());
        };
        let seen = || self.inner.cudnn_seen.lock().unwrap_or_else(|e| e.into_inner());
        // As on the GPU, a shape is cached once its call ran: one that ran out of memory
        // searches again.
        let first = !seen().contains(&(pass, key));
        if first && self.cudnn_benchmark() {
            match choice.search_workspace {
                // PyTorch's `findAlgorithms` empties the cache after the search, while the
                // search's workspace is still held.
                Some(0) => self.empty_cache(),
                Some(bytes) => {
                    let search = self.allocate(bytes)?;
                    self.empty_cache();
                    drop(search);
                }
                None => {
                    miss();
                }
            }
        }
        if choice.workspace > 0 {
            drop(self.allocate(choice.workspace)?);
        }
        if first {
            seen().insert((pass, key));
        }
        Ok(())
    }

    /// Bytes of the cuBLAS workspace this device allocates at its first matrix product.
    pub fn blas_workspace_size(&self) -> usize {
        self.blas().size
    }

    /// Sets the size of the cuBLAS workspace (0 for none). A workspace already allocated
    /// goes back to the cache now; the next op with a matrix product allocates the new one.
    ///
    /// A CUDA device starts with [`default_blas_workspace_size`] for its compute capability
    /// (PyTorch's choice, `CUBLAS_WORKSPACE_CONFIG` included), a virtual device with an
    /// H100's, and a host device with none. Give the host or a virtual device the size of the
    /// GPU you mean, and their statistics are that GPU's.
    pub fn set_blas_workspace_size(&self, bytes: usize) {
        let old = {
            let mut blas = self.blas();
            blas.size = bytes;
            blas.block.take()
        };
        drop(old);
    }

    /// Allocates the cuBLAS workspace now, if this device has one and it is not allocated yet
    /// (otherwise the first matrix product allocates it, and it stays): for measurements of
    /// the steady state, in which it exists.
    ///
    /// # Errors
    ///
    /// Out of memory.
    pub fn prepare_blas_workspace(&self) -> Result<()> {
        self.blas_workspace().map(|_| ())
    }

    /// The cuBLAS workspace's block as `(address, bytes)` once an op has allocated it (at the
    /// first matrix product; `None` before, or with a size of 0), so that a reader of the
    /// allocator's trace can tell it from the tensors: it lives as long as the device or its
    /// size.
    pub fn blas_workspace_block(&self) -> Option<(u64, usize)> {
        self.blas().block.as_ref().map(|b| (b.address(), b.len()))
    }

    /// The cuBLAS workspace as `(address, bytes)`, allocated on first use; `None` when its
    /// size is 0. Ops that run matrix products ask for it after allocating their outputs,
    /// where PyTorch's first cuBLAS call allocates its own.
    pub(crate) fn blas_workspace(&self) -> Result<Option<(u64, usize)>> {
        let mut blas = self.blas();
        if blas.size == 0 {
            return Ok(None);
        }
        if blas.block.is_none() {
            blas.block = Some(self.allocate(blas.size)?);
        }
        Ok(blas.block.as_ref().map(|b| (b.address(), b.len())))
    }

    /// The device in words, e.g. `cpu (host memory (16.00 GiB cap))` or
    /// `cuda:0 (NVIDIA H100 80GB HBM3, sm_90) (...)`.
    pub fn name(&self) -> String {
        match &self.inner.backend {
            Backend::Host(alloc) => {
                format!("cpu ({})", vram_alloc::DeviceMemory::name(alloc.memory()))
            }
            Backend::Virtual(alloc) => {
                format!("virtual ({})", vram_alloc::DeviceMemory::name(alloc.memory()))
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(cuda) => cuda.name(),
        }
    }

    /// Whether this is a CUDA device.
    pub fn is_cuda(&self) -> bool {
        match &self.inner.backend {
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => true,
            _ => false,
        }
    }

    /// Whether this is a virtual device (memory without values).
    pub fn is_virtual(&self) -> bool {
        matches!(self.compute(), Compute::Virtual)
    }

    /// Waits until all work queued on the device has finished (for timing); a no-op on the
    /// host, whose ops finish before they return.
    ///
    /// # Errors
    ///
    /// [`Error::Device`] if the device reports an error from earlier work.
    pub fn synchronize(&self) -> Result<()> {
        match &self.inner.backend {
            #[cfg(feature = "cuda")]
            Backend::Cuda(cuda) => cuda.synchronize(),
            _ => Ok(()),
        }
    }

    /// Starts timing every op on this device (and its clones), from a clean table: see
    /// [`crate::profile`] for what is timed. [`Device::stop_op_profile`] returns the table.
    ///
    /// ```
    /// use vram_kernels::{DType, Device, Tensor, ops};
    ///
    /// let dev = Device::host(16 << 20);
    /// let a = Tensor::zeros(&dev, &[64, 64], DType::F32)?;
    /// dev.start_op_profile();
    /// let b = ops::matmul(&a, &a, false, false)?;
    /// let _ = ops::add(&b, &a)?;
    /// let _ = ops::add(&b, &b)?;
    /// let ops = dev.stop_op_profile();
    /// let add = ops.iter().find(|o| o.name == "add").unwrap();
    /// assert_eq!((add.calls, ops.len()), (2, 2));
    /// # Ok::<(), vram_kernels::Error>(())
    /// ```
    pub fn start_op_profile(&self) {
        self.inner.profile.start();
    }

    /// Stops timing ops; what each op took while profiling, longest total first.
    pub fn stop_op_profile(&self) -> Vec<crate::profile::OpTime> {
        self.inner.profile.stop()
    }

    /// Whether ops are being timed (one relaxed load: the dispatch function asks per op).
    pub(crate) fn op_profiler(&self) -> Option<&crate::profile::OpProfiler> {
        let p = &self.inner.profile;
        p.is_on().then_some(p)
    }

    /// The allocator's statistics, with PyTorch's key names.
    pub fn memory_stats(&self) -> MemoryStats {
        with_allocator!(self, a => a.memory_stats())
    }

    /// Bytes held by live tensors (`torch.cuda.memory_allocated`).
    pub fn memory_allocated(&self) -> u64 {
        with_allocator!(self, a => a.memory_allocated())
    }

    /// Bytes reserved from the device, live plus cached (`torch.cuda.memory_reserved`).
    pub fn memory_reserved(&self) -> u64 {
        with_allocator!(self, a => a.memory_reserved())
    }

    /// Peak of [`memory_allocated`](Self::memory_allocated) since creation or the last
    /// [`reset_peak_stats`](Self::reset_peak_stats).
    pub fn max_memory_allocated(&self) -> u64 {
        with_allocator!(self, a => a.max_memory_allocated())
    }

    /// Peak of [`memory_reserved`](Self::memory_reserved).
    pub fn max_memory_reserved(&self) -> u64 {
        with_allocator!(self, a => a.max_memory_reserved())
    }

    /// Restarts the peak statistics from the current values.
    pub fn reset_peak_stats(&self) {
        with_allocator!(self, a => a.reset_peak_stats());
    }

    /// Opens a statistics scope on the device's allocator (see
    /// [`vram_alloc::CachingAllocator::stats_scope`]): a profiler measures its own peak
    /// without resetting the caller's.
    pub fn stats_scope(&self) -> vram_alloc::StatsScope {
        with_allocator!(self, a => a.stats_scope())
    }

    /// Returns cached, unused memory to the device; live tensors are untouched.
    pub fn empty_cache(&self) {
        with_allocator!(self, a => a.empty_cache());
    }

    /// Caps reserved memory at `fraction` (in `[0, 1]`) of the device's capacity.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if `fraction` is outside `[0, 1]`.
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<()> {
        with_allocator!(self, a => a.set_memory_fraction(fraction)).map_err(|e| {
            Error::InvalidArgument { op: "set_memory_fraction", reason: e.to_string() }
        })
    }

    /// The allocator's statistics as a table (`torch.cuda.memory_summary`).
    pub fn memory_summary(&self) -> String {
        with_allocator!(self, a => a.memory_summary())
    }

    /// Segments and blocks of the allocator (`torch.cuda.memory._snapshot`).
    pub fn snapshot(&self) -> Snapshot {
        with_allocator!(self, a => a.snapshot())
    }

    /// Starts recording the allocator's last `max_entries` actions (`Some(n)`), or stops
    /// (`None`), like `torch.cuda.memory._record_memory_history`; on every backend.
    pub fn record_history(&self, max_entries: Option<usize>) {
        with_allocator!(self, a => a.record_history(max_entries));
    }

    /// The allocator's recorded actions, oldest first.
    pub fn trace(&self) -> Vec<vram_alloc::TraceEntry> {
        with_allocator!(self, a => a.trace())
    }

    /// The number of recorded allocator actions, without copying them (see
    /// [`vram_alloc::CachingAllocator::trace_len`]).
    pub fn trace_len(&self) -> usize {
        with_allocator!(self, a => a.trace_len())
    }

    /// Free and total memory as the device reports it.
    pub fn mem_info(&self) -> vram_alloc::MemInfo {
        with_allocator!(self, a => a.mem_info())
    }

    /// Whether `self` and `other` are handles to one device.
    pub fn same_device(&self, other: &Device) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl PartialEq for Device {
    fn eq(&self, other: &Device) -> bool {
        self.same_device(other)
    }
}

impl Eq for Device {}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.name())
            .field("allocated", &self.memory_allocated())
            .field("reserved", &self.memory_reserved())
            .finish()
    }
}

/// The machine's physical memory (`MemTotal` of `/proc/meminfo`), or a fallback.
fn physical_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            kib.checked_mul(1024)
        })
        .unwrap_or(FALLBACK_HOST_CAPACITY)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clones_are_one_device_and_new_devices_are_distinct() {
        let a = Device::host(1 << 20);
        let b = a.clone();
        assert_eq!(a, b);
        assert_ne!(a, Device::host(1 << 20));
        assert!(!a.is_cuda());
        assert!(a.name().starts_with("cpu"), "{}", a.name());
    }

    #[test]
    fn memory_fraction_outside_unit_interval_is_rejected() {
        let d = Device::host(1 << 20);
        assert!(matches!(d.set_memory_fraction(1.5), Err(Error::InvalidArgument { .. })));
        d.set_memory_fraction(0.5).unwrap();
    }

    #[test]
    fn device_names_parse_and_cuda_without_a_device_is_a_clear_error() {
        assert!(!Device::from_name("CPU").unwrap().is_cuda());
        match Device::from_name("cuda") {
            Ok(cuda) => assert!(cuda.is_cuda() && cuda.name().starts_with("cuda:0")),
            Err(e) => {
                assert!(matches!(e, Error::Unsupported(_)), "{e}");
                assert!(e.to_string().contains("CUDA"), "{e}");
            }
        }
        let bad = Device::from_name("tpu").unwrap_err();
        assert!(bad.to_string().contains("VRAM_DEVICE") && bad.to_string().contains("tpu"));
        assert!(Device::from_name("cuda:x").is_err());
    }

    #[test]
    fn conv_settings_default_to_pytorchs_and_cudnn_is_refused_where_it_cannot_run() {
        for d in [Device::host(1 << 20), Device::virtual_device(1 << 30)] {
            assert_eq!(d.conv_backend(), ConvBackend::Auto);
            assert!(!d.cudnn_benchmark());
            assert!(d.allow_tf32_cudnn());
            let e = d.set_conv_backend(ConvBackend::Cudnn).unwrap_err();
            assert!(matches!(e, Error::Unsupported(_)) && e.to_string().contains("cuDNN"), "{e}");
            assert_eq!(d.conv_backend(), ConvBackend::Auto, "unchanged after the error");
            d.set_conv_backend(ConvBackend::Own).unwrap();
            assert_eq!(d.conv_backend(), ConvBackend::Own);
            d.set_cudnn_benchmark(true);
            d.set_allow_tf32_cudnn(false);
            assert!(d.cudnn_benchmark() && !d.allow_tf32_cudnn());
            let p = crate::params::Conv2dParams::new(
                &[1, 1, 3, 3],
                &[1, 1, 1, 1],
                &crate::params::Conv2dOptions::default(),
            )
            .unwrap();
            assert_eq!(d.cudnn_conv(&p, crate::DType::F32, crate::ConvLayout::Nchw), None);
        }
        assert_eq!(Device::host(1 << 20).conv_path(), ConvPath::Host);
        assert_eq!(Device::virtual_device(1 << 20).conv_path(), ConvPath::Virtual);
    }

    #[test]
    fn conv_backends_parse_and_paths_print() {
        assert_eq!("".parse::<ConvBackend>().unwrap(), ConvBackend::Auto);
        assert_eq!(" CuDNN ".parse::<ConvBackend>().unwrap(), ConvBackend::Cudnn);
        assert_eq!("own".parse::<ConvBackend>().unwrap(), ConvBackend::Own);
        let e = "fast".parse::<ConvBackend>().unwrap_err();
        assert!(e.to_string().contains("fast") && e.to_string().contains("cudnn"), "{e}");
        assert_eq!(ConvPath::Cudnn { version: 91400 }.to_string(), "cuDNN 9.14.0");
        let own = ConvPath::Own { reason: "no cuDNN: not found".into() };
        assert_eq!(own.to_string(), "own kernels (no cuDNN: not found)");
    }

    #[test]
    fn a_cuda_device_without_cudnn_falls_back_to_its_own_kernels_and_says_why() {
        let Ok(d) = Device::cuda(0) else {
            let _ = writeln!(std::io::stderr(), "skipped: no CUDA device");
            return;
        };
        match d.conv_path() {
            ConvPath::Cudnn { version } => {
                assert!(version >= 90000);
                d.set_conv_backend(ConvBackend::Cudnn).unwrap();
            }
            ConvPath::Own { reason } => {
                assert!(reason.contains("cuDNN"), "{reason}");
                let e = d.set_conv_backend(ConvBackend::Cudnn).unwrap_err();
                assert!(e.to_string().contains("cuDNN"), "{e}");
            }
            other => panic!("a CUDA device's path: {other:?}"),
        }
        d.set_conv_backend(ConvBackend::Own).unwrap();
        assert!(matches!(d.conv_path(), ConvPath::Own { .. }));
    }

    #[test]
    fn auto_picks_cuda_exactly_when_a_cuda_device_opens() {
        let cuda_usable = Device::cuda(0).is_ok();
        assert_eq!(Device::auto().unwrap().is_cuda(), cuda_usable);
    }
}
