//! Ops from outside this crate: implement [`CustomOp`] (checks, an allocation plan, host
//! code and, optionally, CUDA source and launches) and [`run`] gives the op what this
//! crate's own ops get: its outputs and workspaces from the device's caching allocator
//! (counted in every statistic, snapshot and trace), the same requests on the host, on a
//! virtual device (which allocates and computes nothing) and on a GPU, the op profiler, and
//! out-of-memory errors that leave every live tensor intact. candle's `CustomOp1/2/3` play
//! the same part there.
//!
//! On a GPU the op's `.cu` source ([`CudaSource`]) is compiled with NVRTC on first use, after
//! this crate's helper header (`common.cuh`: `half_t`/`bf16_t` with `to_f32`/`from_f32`,
//! `u32`/`u64`/`i64`, `block_sum`, `warp_sum`, ...), and its kernels are launched with their
//! arguments checked against the parameters it declares. Without a GPU, the feature
//! `emulation` runs the same CUDA code on the host ([`emulate`]: the source compiled as C++
//! behind a shim of CUDA's execution model, a block's threads as OS threads), and
//! [`CudaSource::check_with_nvrtc`] compiles it for a GPU architecture and checks the
//! declared parameters against the PTX, so an op's kernels are tested on machines without a
//! GPU. [`compare`] and [`Tolerance`] are the equivalence helpers for the tests.
//!
//! ```
//! use vram_kernels::custom::{self, CustomOp, OpPlan};
//! use vram_kernels::{DType, Device, Error, Result, Tensor};
//!
//! /// y = x * x, element by element, in f32.
//! struct Square;
//!
//! impl CustomOp for Square {
//!     const NAME: &'static str = "square";
//!
//!     fn plan(&self, inputs: &[&Tensor]) -> Result<OpPlan> {
//!         let [x] = inputs else {
//!             return Err(Error::InvalidArgument { op: Self::NAME, reason: "takes one input".into() });
//!         };
//!         if x.dtype() != DType::F32 {
//!             return Err(Error::DTypeMismatch { op: Self::NAME, lhs: DType::F32, rhs: x.dtype() });
//!         }
//!         Ok(OpPlan::new().output(x.shape(), DType::F32))
//!     }
//!
//!     fn host(&self, inputs: &[&Tensor], outputs: &mut [Tensor]) -> Result<()> {
//!         let x = inputs[0].as_slice::<f32>()?;
//!         for (y, x) in outputs[0].as_mut_slice::<f32>()?.iter_mut().zip(x) {
//!             *y = x * x;
//!         }
//!         Ok(())
//!     }
//! }
//!
//! let dev = Device::host(64 << 20);
//! let x = Tensor::from_f32_slice(&dev, &[3], &[1.0, -2.0, 3.0], DType::F32)?;
//! let y = custom::run(&Square, &[&x])?.remove(0);
//! assert_eq!(y.to_f32_vec()?, [1.0, 4.0, 9.0]);
//!
//! // On a virtual device it allocates what it would on a GPU, and computes nothing.
//! let virt = Device::virtual_device(1 << 30);
//! let big = Tensor::zeros(&virt, &[1 << 20], DType::F32)?;
//! let out = custom::run(&Square, &[&big])?;
//! assert_eq!(virt.memory_allocated(), 2 * 4 << 20);
//! # drop(out);
//! # Ok::<(), vram_kernels::Error>(())
//! ```

use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::dispatch::{self, Buffers, Op, OutputSpec, Plan};
use crate::tensor::Tensor;

/// An op written outside this crate.
///
/// [`run`] calls [`plan`](Self::plan), allocates what it says from the device's caching
/// allocator (outputs in plan order, then workspaces), then calls [`host`](Self::host) on
/// the host, [`cuda`](Self::cuda) on a CUDA device, and nothing on a virtual device.
pub trait CustomOp {
    /// The op's name, in errors and in the op profile.
    const NAME: &'static str;

    /// Checks the inputs (shapes, dtypes, arguments) and says what to allocate. It must not
    /// depend on the device: every backend then makes the same requests.
    ///
    /// # Errors
    ///
    /// Whatever the inputs violate, as an [`Error`] that names the op
    /// ([`Error::InvalidArgument`], [`Error::ShapeMismatch`], [`Error::DTypeMismatch`], ...).
    fn plan(&self, inputs: &[&Tensor]) -> Result<OpPlan>;

    /// Computes on the host into `outputs`: fresh tensors of the planned shapes and dtypes,
    /// in plan order, zeros where planned so (`as_mut_slice` writes them). The planned
    /// workspaces exist for the GPU's sake; the host uses its own scratch memory.
    ///
    /// # Errors
    ///
    /// Whatever the computation reports; replacing an output by a tensor of another shape,
    /// dtype or device is refused after the call.
    fn host(&self, inputs: &[&Tensor], outputs: &mut [Tensor]) -> Result<()>;

    /// The CUDA source of the op's kernels, if it has any.
    fn cuda_source(&self) -> Option<&'static CudaSource> {
        None
    }

    /// Queues the CUDA work: [`CudaCall::launch`] the kernels of
    /// [`cuda_source`](Self::cuda_source) on the addresses [`CudaCall`] gives (`inputs` for
    /// their shapes and dtypes; their values are on the device).
    ///
    /// # Errors
    ///
    /// By default [`Error::Unsupported`]: an op without CUDA code runs on the host and on
    /// virtual devices only.
    fn cuda(&self, inputs: &[&Tensor], call: &CudaCall<'_>) -> Result<()> {
        let _ = (inputs, call);
        Err(Error::Unsupported(format!(
            "{}: the op has no CUDA code; run it on the host",
            Self::NAME
        )))
    }
}

/// What a [`CustomOp`] allocates before it computes: its outputs and its workspaces.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OpPlan {
    outputs: Vec<(Vec<usize>, DType, bool)>,
    workspaces: Vec<(usize, bool)>,
}

impl OpPlan {
    /// An empty plan.
    pub fn new() -> OpPlan {
        OpPlan::default()
    }

    /// Adds an output of `shape` and `dtype` that the op overwrites entirely.
    #[must_use]
    pub fn output(mut self, shape: &[usize], dtype: DType) -> OpPlan {
        self.outputs.push((shape.to_vec(), dtype, false));
        self
    }

    /// Adds an output that starts as zeros (the op may write part of it).
    #[must_use]
    pub fn zeroed_output(mut self, shape: &[usize], dtype: DType) -> OpPlan {
        self.outputs.push((shape.to_vec(), dtype, true));
        self
    }

    /// Adds a scratch buffer of `bytes` for the CUDA code ([`CudaCall::workspace`]),
    /// allocated on every backend so that the statistics agree; `zeroed` sets it to zeros
    /// on the GPU first. A workspace of 0 bytes is allocated nowhere and has address 0.
    #[must_use]
    pub fn workspace(mut self, bytes: usize, zeroed: bool) -> OpPlan {
        self.workspaces.push((bytes, zeroed));
        self
    }

    /// The planned outputs' shapes, in order.
    pub fn output_shapes(&self) -> impl Iterator<Item = &[usize]> {
        self.outputs.iter().map(|(shape, ..)| shape.as_slice())
    }
}

/// Runs `op` on `inputs`, which must live on one device (the op's), and returns its
/// outputs in plan order. On any error every input is as it was.
///
/// # Errors
///
/// [`Error::InvalidArgument`] without inputs; [`Error::DeviceMismatch`] for inputs on
/// different devices; the op's own checks; [`Error::OutOfMemory`] when the outputs or
/// workspaces do not fit; on a CUDA device, [`Error::Unsupported`] for an op without CUDA
/// code and [`Error::Device`] when its source does not compile or a launch fails.
pub fn run<O: CustomOp>(op: &O, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    dispatch::run(Custom::new(op, inputs, Backend::Native)?)
}

/// Runs `op`'s CUDA code on the host, on host tensors: its kernels compiled as C++ behind a
/// shim of CUDA's execution model, the launches checked as on a GPU. `Ok(None)` (after a
/// `skipped: no C++ compiler` line on stderr) where no C++ compiler can build the source.
///
/// # Errors
///
/// As [`run`]; [`Error::InvalidArgument`] for inputs that are not on the host;
/// [`Error::Device`] when the source does not compile as C++ or a launch is malformed.
#[cfg(feature = "emulation")]
pub fn emulate<O: CustomOp>(op: &O, inputs: &[&Tensor]) -> Result<Option<Vec<Tensor>>> {
    let custom = Custom::new(op, inputs, Backend::Emulated)?;
    if custom.device.is_cuda() || custom.device.is_virtual() {
        return Err(Error::InvalidArgument {
            op: O::NAME,
            reason: "the emulation runs on host tensors; create the inputs on Device::host".into(),
        });
    }
    let Some(source) = op.cuda_source() else {
        return Err(Error::Unsupported(format!(
            "{}: the op has no CUDA source to emulate",
            O::NAME
        )));
    };
    if !crate::cuda::emulate::compiler_available(source)? {
        return Ok(None);
    }
    dispatch::run(custom).map(Some)
}

/// Where a [`Custom`] op computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backend {
    /// The device's own backend.
    Native,
    /// The CUDA code, on the host's emulation.
    #[cfg(feature = "emulation")]
    Emulated,
}

/// A [`CustomOp`] as one of this crate's ops.
struct Custom<'a, O: CustomOp> {
    op: &'a O,
    inputs: &'a [&'a Tensor],
    device: Device,
    backend: Backend,
    /// The outputs' shapes and dtypes as planned, to check the host code's result.
    planned: Vec<(Vec<usize>, DType)>,
    /// Each planned workspace's index among the allocated ones (`None`: 0 bytes).
    workspaces: Vec<Option<usize>>,
}

impl<'a, O: CustomOp> Custom<'a, O> {
    fn new(op: &'a O, inputs: &'a [&'a Tensor], backend: Backend) -> Result<Self> {
        let Some(first) = inputs.first() else {
            return Err(Error::InvalidArgument {
                op: O::NAME,
                reason: "a custom op needs at least one input (its device)".into(),
            });
        };
        if inputs.iter().any(|t| !t.device().same_device(first.device())) {
            return Err(Error::DeviceMismatch { op: O::NAME });
        }
        Ok(Custom {
            op,
            inputs,
            device: first.device().clone(),
            backend,
            planned: Vec::new(),
            workspaces: Vec::new(),
        })
    }

    /// The CUDA code's view of the buffers: the addresses of the inputs, the outputs and
    /// the workspaces, and where its launches go.
    #[cfg(feature = "cuda")]
    fn call<'g>(
        &self,
        bufs: &mut Buffers<Vec<Tensor>>,
        target: Target<'g>,
        source: &'static CudaSource,
    ) -> CudaCall<'g> {
        let allocated = bufs.workspace_addresses();
        CudaCall {
            target,
            source,
            op: O::NAME,
            inputs: self.inputs.iter().map(|t| t.storage().address()).collect(),
            outputs: bufs.outputs_mut().iter().map(|t| t.storage().address()).collect(),
            workspaces: self.workspaces.iter().map(|i| i.map_or(0, |i| allocated[i])).collect(),
        }
    }
}

impl<O: CustomOp> Op for Custom<'_, O> {
    const NAME: &'static str = O::NAME;
    type Outs = Vec<Tensor>;
    type Output = Vec<Tensor>;

    fn device(&self) -> &Device {
        &self.device
    }

    fn plan(&mut self) -> Result<Plan<Vec<Tensor>>> {
        let custom = self.op.plan(self.inputs)?;
        let specs = custom
            .outputs
            .iter()
            .map(|(shape, dtype, zeroed)| OutputSpec::zeroed_if(*zeroed, shape, *dtype))
            .collect();
        self.planned = custom.outputs.into_iter().map(|(shape, dtype, _)| (shape, dtype)).collect();
        let mut plan = Plan::new(specs);
        for &(bytes, zeroed) in &custom.workspaces {
            // A workspace of 0 bytes is not allocated; its address is 0.
            let index = if zeroed { plan.zeroed_workspace(bytes) } else { plan.workspace(bytes) };
            self.workspaces.push(index);
        }
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers<Vec<Tensor>>) -> Result<()> {
        match self.backend {
            Backend::Native => {
                self.op.host(self.inputs, bufs.outputs_mut())?;
                check_outputs::<O>(&self.device, &self.planned, bufs.outputs_mut())
            }
            #[cfg(feature = "emulation")]
            Backend::Emulated => {
                let source = self.op.cuda_source().ok_or_else(|| {
                    Error::Unsupported(format!("{}: the op has no CUDA source", O::NAME))
                })?;
                self.op.cuda(self.inputs, &self.call(bufs, Target::Emulated, source))
            }
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Vec<Tensor>>) -> Result<()> {
        let source = self.op.cuda_source().unwrap_or(&NO_SOURCE);
        self.op.cuda(self.inputs, &self.call(bufs, Target::Gpu(gpu.backend()), source))
    }

    fn finish(self, bufs: Buffers<Vec<Tensor>>) -> Result<Vec<Tensor>> {
        Ok(bufs.into_outputs())
    }
}

/// The refusal of host code that replaced an output by another tensor.
fn check_outputs<O: CustomOp>(
    device: &Device,
    planned: &[(Vec<usize>, DType)],
    outputs: &[Tensor],
) -> Result<()> {
    for (i, (t, (shape, dtype))) in outputs.iter().zip(planned).enumerate() {
        if t.shape() != shape.as_slice() || t.dtype() != *dtype || !t.device().same_device(device) {
            return Err(Error::InvalidArgument {
                op: O::NAME,
                reason: format!(
                    "the host code replaced output {i} ({shape:?} {dtype} planned) by a tensor \
                     of {:?} {}; write into the planned outputs instead",
                    t.shape(),
                    t.dtype()
                ),
            });
        }
    }
    Ok(())
}

/// The source of an op without one: no kernels, so every launch is refused by name.
#[cfg(feature = "cuda")]
static NO_SOURCE: CudaSource = CudaSource { name: "(none)", source: "", kernels: &[] };

/// A `.cu` source of a custom op's kernels, and each kernel's parameters (checked at every
/// launch, and against the PTX by [`check_with_nvrtc`](Self::check_with_nvrtc)). Kernels
/// are `extern "C" __global__` functions, so that their names are the ones declared here.
#[derive(Debug)]
pub struct CudaSource {
    /// A name for errors and for the compiled module (one module per name and device).
    pub name: &'static str,
    /// The source, compiled after `common.cuh` (typically `include_str!("op.cu")`).
    pub source: &'static str,
    /// The kernels the op launches.
    pub kernels: &'static [CudaKernel],
}

/// A kernel of a [`CudaSource`]: its name and parameter types, in order.
#[derive(Debug)]
pub struct CudaKernel {
    /// The `extern "C"` function's name.
    pub name: &'static str,
    /// Its parameters as the source declares them.
    pub params: &'static [KernelParam],
}

/// A kernel parameter's type as the `.cu` source declares it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelParam {
    /// A device pointer (`T*`, `const T*`).
    Ptr,
    /// `u64` (`unsigned long long`).
    U64,
    /// `i64` (`long long`).
    I64,
    /// `u32` (`unsigned int`).
    U32,
    /// `float`.
    F32,
}

/// An argument of a kernel launch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KernelArg {
    /// A device pointer (from [`CudaCall::input`], [`CudaCall::output`],
    /// [`CudaCall::workspace`]).
    Ptr(u64),
    /// `u64`.
    U64(u64),
    /// `i64`.
    I64(i64),
    /// `u32`.
    U32(u32),
    /// `float`.
    F32(f32),
}

impl KernelArg {
    /// The parameter type this argument passes.
    pub fn param(&self) -> KernelParam {
        match self {
            KernelArg::Ptr(_) => KernelParam::Ptr,
            KernelArg::U64(_) => KernelParam::U64,
            KernelArg::I64(_) => KernelParam::I64,
            KernelArg::U32(_) => KernelParam::U32,
            KernelArg::F32(_) => KernelParam::F32,
        }
    }

    /// An element count (`u64`).
    pub fn count(n: usize) -> KernelArg {
        KernelArg::U64(n as u64)
    }
}

/// A launch's shape: a 1-D or 2-D grid of 1-D blocks of whole warps (what the host's
/// emulation runs too).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grid {
    /// Blocks along x and y.
    pub blocks: (u32, u32),
    /// Threads per block: a multiple of 32, at most 1024.
    pub threads: u32,
}

impl Grid {
    /// One thread per element of `n`, `threads` per block, grid-stride beyond 65,536 blocks
    /// (the kernel must loop with `gridDim.x * blockDim.x` as its stride).
    pub fn for_elements(n: usize, threads: u32) -> Grid {
        let blocks = n.div_ceil(threads.max(1) as usize).clamp(1, 1 << 16) as u32;
        Grid { blocks: (blocks, 1), threads }
    }

    fn check(&self, op: &'static str, kernel: &str) -> Result<()> {
        let (x, y) = self.blocks;
        if self.threads == 0 || self.threads > 1024 || !self.threads.is_multiple_of(32) {
            return Err(Error::InvalidArgument {
                op,
                reason: format!(
                    "{kernel}: {} threads per block; blocks are whole warps (a multiple of 32) \
                     of at most 1024 threads",
                    self.threads
                ),
            });
        }
        if x == 0 || y == 0 || x > i32::MAX as u32 || y > 65535 {
            return Err(Error::InvalidArgument {
                op,
                reason: format!(
                    "{kernel}: a grid of ({x}, {y}) blocks; x must be 1..=2^31-1 and y 1..=65535"
                ),
            });
        }
        Ok(())
    }
}

/// What a [`CustomOp`]'s CUDA code runs with: the addresses of its inputs, outputs and
/// workspaces on the device (host addresses under [`emulate`]), and launches of its
/// source's kernels on the device's stream (stream-ordered with every other op).
pub struct CudaCall<'a> {
    target: Target<'a>,
    source: &'static CudaSource,
    op: &'static str,
    inputs: Vec<u64>,
    outputs: Vec<u64>,
    workspaces: Vec<u64>,
}

/// Where a [`CudaCall`] launches.
#[cfg(feature = "cuda")]
enum Target<'a> {
    Gpu(&'a crate::cuda::CudaBackend),
    #[cfg(feature = "emulation")]
    Emulated,
}

/// Nowhere: without CUDA support no [`CudaCall`] is ever made.
#[cfg(not(feature = "cuda"))]
enum Target<'a> {
    #[allow(dead_code)]
    Never(std::convert::Infallible, std::marker::PhantomData<&'a ()>),
}

impl CudaCall<'_> {
    /// The device address of input `i`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when there is no input `i`.
    pub fn input(&self, i: usize) -> Result<KernelArg> {
        self.pointer("input", &self.inputs, i)
    }

    /// The device address of output `i` (plan order).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when there is no output `i`.
    pub fn output(&self, i: usize) -> Result<KernelArg> {
        self.pointer("output", &self.outputs, i)
    }

    /// The device address of workspace `i` (plan order; 0 for one of 0 bytes).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when there is no workspace `i`.
    pub fn workspace(&self, i: usize) -> Result<KernelArg> {
        self.pointer("workspace", &self.workspaces, i)
    }

    /// Address `i` of `list` (the `what`s), or the error that names the op and the count.
    fn pointer(&self, what: &str, list: &[u64], i: usize) -> Result<KernelArg> {
        list.get(i).map(|&p| KernelArg::Ptr(p)).ok_or_else(|| Error::InvalidArgument {
            op: self.op,
            reason: format!("{what} {i} does not exist: the op has {}", list.len()),
        })
    }

    /// Launches `kernel` of the op's [`CudaSource`] over `grid` with `args`; the source is
    /// compiled on first use. Arguments that do not match the kernel's declared parameters
    /// in number and type are refused before anything runs.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a kernel the source does not declare, a bad grid or
    /// mismatched arguments; [`Error::Device`] when the source does not compile or the
    /// launch fails.
    ///
    /// # Safety
    ///
    /// The kernel must only touch memory the pointer arguments cover: every pointer among
    /// `args` must come from this call ([`input`](Self::input), [`output`](Self::output),
    /// [`workspace`](Self::workspace)) and hold every element the kernel addresses with
    /// these arguments; inputs must not be written.
    pub unsafe fn launch(&self, kernel: &str, grid: Grid, args: &[KernelArg]) -> Result<()> {
        let Some(k) = self.source.kernels.iter().find(|k| k.name == kernel) else {
            return Err(Error::InvalidArgument {
                op: self.op,
                reason: format!(
                    "no kernel `{kernel}` in the CUDA source `{}` (it declares {:?})",
                    self.source.name,
                    self.source.kernels.iter().map(|k| k.name).collect::<Vec<_>>()
                ),
            });
        };
        grid.check(self.op, kernel)?;
        let given: Vec<KernelParam> = args.iter().map(KernelArg::param).collect();
        if given != k.params {
            return Err(Error::InvalidArgument {
                op: self.op,
                reason: format!(
                    "{kernel}: arguments of types {given:?} do not match the declared \
                     parameters {:?}",
                    k.params
                ),
            });
        }
        match self.target {
            #[cfg(feature = "cuda")]
            // SAFETY: the caller's contract; the arguments match the declared parameters.
            Target::Gpu(cu) => unsafe { cu.launch_custom(self.source, k, grid, args) },
            #[cfg(feature = "emulation")]
            // SAFETY: as above; the addresses are host addresses of the planned buffers.
            Target::Emulated => unsafe {
                crate::cuda::emulate::launch_custom(self.source, k, grid, args)
            },
            #[cfg(not(feature = "cuda"))]
            Target::Never(never, _) => match never {},
        }
    }
}

impl CudaSource {
    /// Compiles the source with NVRTC for `arch` (e.g. `"compute_80"`) and checks that every
    /// declared kernel is in the PTX with the declared parameter types. No GPU is needed,
    /// only `libnvrtc.so.13` on the library path: `Ok(false)` without it.
    ///
    /// # Errors
    ///
    /// [`Error::Device`] with NVRTC's log when the source does not compile, or naming the
    /// kernel whose PTX declaration differs from its [`CudaKernel`].
    #[cfg(feature = "cuda")]
    pub fn check_with_nvrtc(&'static self, arch: &str) -> Result<bool> {
        crate::cuda::custom_check_with_nvrtc(self, arch)
    }
}

/// How close two results must be: `|a - b| <= abs + rel * |b|` for every element.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    /// The absolute part.
    pub abs: f64,
    /// The part relative to the expected value.
    pub rel: f64,
}

impl Tolerance {
    /// Bit-for-bit equality.
    pub const EXACT: Tolerance = Tolerance { abs: 0.0, rel: 0.0 };

    /// A few units in the last place of `dtype` (f32: 1e-6 relative; f16: 2e-3; bf16:
    /// 1.6e-2), for results computed in f32 whose math library or order of summation
    /// differs between backends.
    pub fn for_dtype(dtype: DType) -> Tolerance {
        match dtype {
            DType::F32 => Tolerance { abs: 1e-6, rel: 1e-5 },
            DType::F16 => Tolerance { abs: 1e-3, rel: 2e-3 },
            DType::BF16 => Tolerance { abs: 8e-3, rel: 1.6e-2 },
        }
    }
}

/// The largest difference between two tensors of one shape and dtype, element by element.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Difference {
    /// The largest `|a - b|`.
    pub max_abs: f64,
    /// The element where `|a - b| - tolerance` is largest.
    pub worst: usize,
    /// Whether every element is within the tolerance (NaNs must be NaN on both sides).
    pub within: bool,
}

/// Compares `actual` with `expected` (any devices: values are copied to the host) under
/// `tol`.
///
/// # Errors
///
/// [`Error::ShapeMismatch`] or [`Error::DTypeMismatch`] when they are not comparable;
/// [`Error::NoValues`] for a tensor on a virtual device.
pub fn compare(actual: &Tensor, expected: &Tensor, tol: Tolerance) -> Result<Difference> {
    if actual.shape() != expected.shape() {
        return Err(Error::ShapeMismatch {
            op: "compare",
            lhs: actual.shape().to_vec(),
            rhs: expected.shape().to_vec(),
        });
    }
    if actual.dtype() != expected.dtype() {
        return Err(Error::DTypeMismatch {
            op: "compare",
            lhs: actual.dtype(),
            rhs: expected.dtype(),
        });
    }
    let (a, b) = (actual.to_f32_vec()?, expected.to_f32_vec()?);
    let mut diff = Difference { max_abs: 0.0, worst: 0, within: true };
    let mut worst_excess = f64::NEG_INFINITY;
    for (i, (&a, &b)) in a.iter().zip(&b).enumerate() {
        let (a, b) = (f64::from(a), f64::from(b));
        let excess = if a.is_nan() || b.is_nan() {
            if a.is_nan() && b.is_nan() { f64::NEG_INFINITY } else { f64::INFINITY }
        } else if a == b {
            // Equal infinities included.
            f64::NEG_INFINITY
        } else {
            let d = (a - b).abs();
            diff.max_abs = diff.max_abs.max(d);
            d - (tol.abs + tol.rel * b.abs())
        };
        if excess > worst_excess {
            worst_excess = excess;
            diff.worst = i;
        }
        if excess > 0.0 || excess.is_nan() {
            diff.within = false;
        }
    }
    Ok(diff)
}
