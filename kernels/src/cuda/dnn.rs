//! Convolutions (and batch norm, see `bn`) through cuDNN's legacy (v7-style) descriptor API:
//! `cudnnConvolutionForward`, `cudnnConvolutionBackwardData` and
//! `cudnnConvolutionBackwardFilter`, grouped and depthwise ones included, NCHW or NHWC
//! (channels_last), f32, f16 and bf16. Which convolutions come here is PyTorch's choice
//! (`cudnn_choices::pytorch_uses_cudnn`): a depthwise one channels_last, or NCHW in f16 where
//! PyTorch's workload table says so (the others run the own depthwise kernels, as PyTorch
//! runs its own), and bf16 from compute capability 8.
//!
//! The library is loaded at run time (`libcudnn.so.9` by its usual names, through cudarc's
//! `dynamic-loading`), once per device: when it cannot be loaded the device records why and
//! runs its own kernels ([`Dnn::load`]).
//!
//! The algorithm of each convolution is chosen as PyTorch's `AlgoIterator::try_all` does
//! (`aten/src/ATen/native/cudnn/Conv_v7.cpp`):
//!
//! - a choice already cached for the convolution's key ([`ConvKey`]: shape, dtype, layout,
//!   groups, TF32 setting) is tried first;
//! - otherwise cuDNN's heuristics rank the algorithms (`cudnnGet...Algorithm_v7`), or, with
//!   `cudnn_benchmark` on, a timed search runs them all (`cudnnFind...AlgorithmEx`) in one
//!   workspace from the caching allocator, sized as PyTorch's `getMaxWorkspaceSize` does:
//!   the largest workspace `cudnnGet...WorkspaceSize` gives any of the direction's
//!   algorithms, asked one by one, no larger than the allocator's `cacheInfo` (the device's
//!   free memory, or its largest cached free block when larger); as in PyTorch, that
//!   allocation failing is the convolution's error, and the cache is emptied right after
//!   the search, while its workspace is still held (`emptyCache` in PyTorch's
//!   `findAlgorithms`: the search's block then goes back to a cache holding little else);
//! - the candidates are tried in order: each one's workspace comes from the device's caching
//!   allocator (so it is counted in the statistics) and goes back to it after the call; one
//!   whose workspace does not fit (out of memory) or that cuDNN refuses is skipped for the
//!   next, as PyTorch catches `OutOfMemoryError` and `CuDNNError`; the first that runs is
//!   cached.
//!
//! Math types follow PyTorch's `allow_tf32`: f16 and bf16 on tensor cores
//! (`CUDNN_TENSOR_OP_MATH`); f32 with `CUDNN_DEFAULT_MATH` (TF32 allowed) when
//! `allow_tf32_cudnn` is on, PyTorch's default, and `CUDNN_FMA_MATH` (plain FP32) when off.
//! Every type accumulates in f32 (the convolution descriptor's compute type is FLOAT).
//!
//! A workspace cuDNN sizes at 1 TiB or more is refused without asking the allocator (as
//! PyTorch does: cuDNN sometimes reports absurd sizes).
//!
//! Batch norm runs through cuDNN too, where PyTorch runs it there: the submodule `bn`
//! (`cudnnBatchNormalizationForwardTrainingEx`, `...ForwardInference` and `...BackwardEx`
//! in `CUDNN_BATCHNORM_SPATIAL` mode, workspace and reserve space from the caching
//! allocator; PyTorch's choice in `crate::ops::batch_norm`).
//!
//! This code has been compiled and its pure parts tested on machines without a GPU; its
//! cuDNN calls have not yet run on one (`tests/cudnn_vs_host.rs` runs them where one is).

mod bn;

pub(crate) use bn::{BnBackward, BnEval, BnTraining};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::params::ConvLayout;
use cudarc::cudnn::sys;
use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::sync::{Mutex, MutexGuard};

/// Workspaces cuDNN asks for above this are refused as out of memory without asking the
/// allocator (PyTorch's `1_TiB` check: cuDNN sometimes reports absurd sizes).
const MAX_WORKSPACE: usize = 1 << 40;

fn dnn_error(op: &'static str) -> impl Fn(sys::cudnnStatus_t) -> Error {
    move |s| Error::Device { op, reason: format!("cuDNN: {s:?}") }
}

fn check(op: &'static str, s: sys::cudnnStatus_t) -> Result<()> {
    if s == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS { Ok(()) } else { Err(dnn_error(op)(s)) }
}

/// cuDNN's element type for `dtype`.
pub(crate) fn data_type(dtype: DType) -> sys::cudnnDataType_t {
    match dtype {
        DType::F32 => sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
        DType::F16 => sys::cudnnDataType_t::CUDNN_DATA_HALF,
        DType::BF16 => sys::cudnnDataType_t::CUDNN_DATA_BFLOAT16,
    }
}

/// The math type a convolution of `dtype` asks cuDNN for (PyTorch's
/// `ConvolutionDescriptor::set` and `AlgoIterator::onlyDefaultAlgorithm`): tensor cores for
/// the 16-bit types; for f32, `CUDNN_DEFAULT_MATH` (TF32 allowed) when `allow_tf32`, else
/// `CUDNN_FMA_MATH`.
pub(crate) fn math_type(dtype: DType, allow_tf32: bool) -> sys::cudnnMathType_t {
    match dtype {
        DType::F16 | DType::BF16 => sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
        DType::F32 if allow_tf32 => sys::cudnnMathType_t::CUDNN_DEFAULT_MATH,
        DType::F32 => sys::cudnnMathType_t::CUDNN_FMA_MATH,
    }
}

/// The math type a convolution runs with once an algorithm's search result says `found`:
/// the result's own (PyTorch sets it on the descriptor, see "Note [behavior of cudnnFind and
/// cudnnGet]" in `Conv_v7.cpp`), except that f32 without TF32 stays `CUDNN_FMA_MATH` whatever
/// the result says (PyTorch asserts it).
pub(crate) fn run_math_type(
    dtype: DType,
    allow_tf32: bool,
    found: sys::cudnnMathType_t,
) -> sys::cudnnMathType_t {
    if dtype == DType::F32 && !allow_tf32 { sys::cudnnMathType_t::CUDNN_FMA_MATH } else { found }
}

/// A 4-d tensor's descriptor: logical `[n, c, h, w]` dimensions and the strides of
/// `layout`, all within cuDNN's `int`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TensorDims {
    pub(crate) dims: [i32; 4],
    pub(crate) strides: [i32; 4],
}

fn to_int(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::InvalidArgument {
        op: "conv2d (cuDNN)",
        reason: format!("{what} = {v} exceeds cuDNN's 32-bit limit"),
    })
}

/// The descriptor of a `[n, c, h, w]` tensor stored in `layout`: NCHW strides
/// `[c*h*w, h*w, w, 1]`, NHWC ones `[h*w*c, 1, w*c, c]`.
///
/// # Errors
///
/// [`Error::InvalidArgument`] if an element count or stride exceeds `i32::MAX`.
pub(crate) fn tensor_dims(dims: [usize; 4], layout: ConvLayout) -> Result<TensorDims> {
    let [n, c, h, w] = dims;
    let total = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    to_int("the element count", total.unwrap_or(usize::MAX))?;
    let strides = match layout {
        ConvLayout::Nchw => [c * h * w, h * w, w, 1],
        ConvLayout::Nhwc => [h * w * c, 1, w * c, c],
    };
    let d = [to_int("n", n)?, to_int("c", c)?, to_int("h", h)?, to_int("w", w)?];
    let s = [
        to_int("a stride", strides[0].max(1))?,
        to_int("a stride", strides[1].max(1))?,
        to_int("a stride", strides[2].max(1))?,
        to_int("a stride", strides[3].max(1))?,
    ];
    Ok(TensorDims { dims: d, strides: s })
}

pub(crate) use crate::cudnn_choices::ConvKey;
use crate::cudnn_choices::{BnChoice, BnPass, ConvChoice, ConvPass};

/// A batch norm call through cuDNN: its pass, dtype, layout and input shape, zero-padded to
/// 5 dimensions.
type BnKey = (BnPass, DType, ConvLayout, [usize; 5]);

/// One convolution direction's cached choice: the algorithm, its math type and workspace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Choice<A> {
    pub(crate) algo: A,
    pub(crate) math: sys::cudnnMathType_t,
    pub(crate) workspace: usize,
    /// The workspace bytes of the timed search that found it; `None`: the heuristics did.
    pub(crate) search: Option<usize>,
}

/// The algorithms that ran, per [`ConvKey`] (PyTorch's `BenchmarkCache`). A choice found by
/// the heuristics is cached as one found by a timed search is; as in PyTorch, turning
/// `cudnn_benchmark` on later does not search again for a key already cached.
#[derive(Debug)]
pub(crate) struct AlgoCache<A> {
    map: Mutex<HashMap<ConvKey, Choice<A>>>,
}

impl<A> Default for AlgoCache<A> {
    fn default() -> Self {
        AlgoCache { map: Mutex::new(HashMap::new()) }
    }
}

impl<A: Copy> AlgoCache<A> {
    fn lock(&self) -> MutexGuard<'_, HashMap<ConvKey, Choice<A>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The cached choice for `key`.
    pub(crate) fn get(&self, key: &ConvKey) -> Option<Choice<A>> {
        self.lock().get(key).copied()
    }

    /// Caches `choice` for `key`, replacing an earlier one.
    pub(crate) fn insert(&self, key: ConvKey, choice: Choice<A>) {
        self.lock().insert(key, choice);
    }

    /// How many keys are cached.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }

    /// Every cached key with its choice.
    fn entries(&self) -> Vec<(ConvKey, Choice<A>)> {
        self.lock().iter().map(|(k, c)| (*k, *c)).collect()
    }
}

/// The record of `key`'s choice in `pass`.
fn record<A: std::fmt::Debug>(pass: ConvPass, key: ConvKey, c: Choice<A>) -> ConvChoice {
    let algo = format!("{:?}", c.algo);
    ConvChoice { pass, key, algo, workspace: c.workspace, search_workspace: c.search }
}

/// What a cuDNN call needs of the device: workspaces from its caching allocator.
pub(crate) trait WorkspaceSource {
    /// `bytes` bytes of device memory (`None` for zero bytes), freed on drop.
    fn workspace(
        &self,
        bytes: usize,
    ) -> Result<Option<vram_alloc::Allocation<vram_alloc::cuda::CudaMemory>>>;

    /// The caching allocator's `cacheInfo` (see [`vram_alloc::CachingAllocator::cache_info`]).
    fn cache_info(&self) -> u64;

    /// The caching allocator's `empty_cache` (PyTorch's `emptyCache`, which its timed search
    /// calls after each `cudnnFind*AlgorithmEx`).
    fn empty_cache(&self);
}

/// cuDNN on one device: its handle, version and algorithm caches.
#[derive(Debug)]
pub(crate) struct Dnn {
    handle: sys::cudnnHandle_t,
    version: usize,
    fwd: AlgoCache<sys::cudnnConvolutionFwdAlgo_t>,
    bwd_data: AlgoCache<sys::cudnnConvolutionBwdDataAlgo_t>,
    bwd_filter: AlgoCache<sys::cudnnConvolutionBwdFilterAlgo_t>,
    /// Every batch norm call's workspace and reserve sizes, for [`Dnn::batch_norm_choices`].
    bn_calls: Mutex<HashMap<BnKey, (usize, usize)>>,
}

// SAFETY: a cuDNN handle may be used from any thread as long as calls on it do not overlap;
// the backend keeps it behind a mutex.
unsafe impl Send for Dnn {}

/// The oldest cuDNN this wrapper accepts: 9.0 (cudarc's bindings are cuDNN 9's).
const MIN_VERSION: usize = 90000;

/// `91400` as `9.14.0`.
pub(crate) fn version_string(v: usize) -> String {
    format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100)
}

impl Dnn {
    /// Loads cuDNN and makes a handle for the current context (bound by the caller), on the
    /// legacy default stream. `Err` says why cuDNN is not usable: not found, too old, or the
    /// handle could not be made. Never panics: the library is looked for before any call.
    pub(crate) fn load() -> std::result::Result<Dnn, String> {
        // SAFETY: only tries to open the library by its candidate names; no cuDNN call.
        if !unsafe { sys::is_culib_present() } {
            return Err("libcudnn (9.x) was not found (looked for libcudnn.so.9 and the other \
                        names cudarc tries, in LD_LIBRARY_PATH and the system's library path)"
                .into());
        }
        // SAFETY: the library is present; cudnnGetVersion has no preconditions.
        let version = unsafe { sys::cudnnGetVersion() };
        if version < MIN_VERSION {
            return Err(format!(
                "cuDNN {} is older than 9.0, which vram needs",
                version_string(version)
            ));
        }
        // cuDNN 9 loads its parts (`libcudnn_ops`, `libcudnn_cnn`, ...) on demand: check now
        // that the two convolutions need are there and match, rather than fail at the first
        // convolution.
        // SAFETY: plain calls without arguments into the loaded library.
        let parts = unsafe { [sys::cudnnOpsVersionCheck(), sys::cudnnCnnVersionCheck()] };
        for (part, status) in ["libcudnn_ops", "libcudnn_cnn"].into_iter().zip(parts) {
            if status != sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
                return Err(format!(
                    "cuDNN {} was found, but its part {part} is not usable: {status:?}",
                    version_string(version)
                ));
            }
        }
        let mut handle = MaybeUninit::uninit();
        // SAFETY: writes a handle into `handle` on success.
        let status = unsafe { sys::cudnnCreate(handle.as_mut_ptr()) };
        if status != sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
            return Err(format!("cudnnCreate failed: {status:?}"));
        }
        // SAFETY: cudnnCreate succeeded, so the handle is initialised; it runs on the
        // legacy default stream (NULL), every op's.
        let handle = unsafe { handle.assume_init() };
        Ok(Dnn {
            handle,
            version,
            fwd: AlgoCache::default(),
            bwd_data: AlgoCache::default(),
            bwd_filter: AlgoCache::default(),
            bn_calls: Mutex::new(Default::default()),
        })
    }

    /// The library's version, e.g. `91400` for 9.14.0.
    pub(crate) fn version(&self) -> usize {
        self.version
    }

    /// Notes the `(workspace, reserve)` bytes of a batch norm call on an input of `shape`
    /// (3 to 5 dimensions, as cuDNN's batch norm takes) for [`Dnn::batch_norm_choices`];
    /// nothing is allocated per call.
    pub(crate) fn note_batch_norm(
        &self,
        pass: BnPass,
        shape: &[usize],
        dtype: DType,
        layout: ConvLayout,
        sizes: (usize, usize),
    ) {
        // Zero-padded: cuDNN takes no empty dimension, so the padding is unambiguous.
        let mut dims = [0; 5];
        dims.iter_mut().zip(shape).for_each(|(d, &s)| *d = s);
        let mut calls = self.bn_calls.lock().unwrap_or_else(|e| e.into_inner());
        calls.insert((pass, dtype, layout, dims), sizes);
    }

    /// Every batch norm call noted (see [`crate::cudnn_choices`]).
    pub(crate) fn batch_norm_choices(&self) -> Vec<BnChoice> {
        let calls = self.bn_calls.lock().unwrap_or_else(|e| e.into_inner());
        calls
            .iter()
            .map(|(&(pass, dtype, layout, dims), &(workspace, reserve))| BnChoice {
                pass,
                shape: dims.into_iter().take_while(|&d| d > 0).collect(),
                dtype,
                layout,
                workspace,
                reserve,
            })
            .collect()
    }

    /// Every choice the three directions' caches hold (see [`crate::cudnn_choices`]).
    pub(crate) fn choices(&self) -> Vec<ConvChoice> {
        let fwd = self.fwd.entries().into_iter().map(|(k, c)| record(ConvPass::Forward, k, c));
        let data = self.bwd_data.entries().into_iter();
        let data = data.map(|(k, c)| record(ConvPass::BackwardData, k, c));
        let filter = self.bwd_filter.entries().into_iter();
        let filter = filter.map(|(k, c)| record(ConvPass::BackwardFilter, k, c));
        fwd.chain(data).chain(filter).collect()
    }

    /// How many algorithm choices are cached: forward, backward data, backward filter.
    #[cfg(test)]
    pub(crate) fn cached(&self) -> [usize; 3] {
        [self.fwd.len(), self.bwd_data.len(), self.bwd_filter.len()]
    }
}

impl Drop for Dnn {
    fn drop(&mut self) {
        // SAFETY: the handle was created in `load` and is destroyed once, here.
        let _ = unsafe { sys::cudnnDestroy(self.handle) };
    }
}

/// A tensor, filter and convolution descriptor, destroyed on drop.
struct Descriptors {
    x: sys::cudnnTensorDescriptor_t,
    y: sys::cudnnTensorDescriptor_t,
    w: sys::cudnnFilterDescriptor_t,
    conv: sys::cudnnConvolutionDescriptor_t,
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: each was created once in `Descriptors::new` (null ones were not and are
        // skipped) and is destroyed once, here.
        unsafe {
            if !self.x.is_null() {
                let _ = sys::cudnnDestroyTensorDescriptor(self.x);
            }
            if !self.y.is_null() {
                let _ = sys::cudnnDestroyTensorDescriptor(self.y);
            }
            if !self.w.is_null() {
                let _ = sys::cudnnDestroyFilterDescriptor(self.w);
            }
            if !self.conv.is_null() {
                let _ = sys::cudnnDestroyConvolutionDescriptor(self.conv);
            }
        }
    }
}

fn tensor_descriptor(d: &TensorDims, dtype: DType) -> Result<sys::cudnnTensorDescriptor_t> {
    let mut desc = MaybeUninit::uninit();
    // SAFETY: writes a descriptor on success.
    check("cudnnCreateTensorDescriptor", unsafe {
        sys::cudnnCreateTensorDescriptor(desc.as_mut_ptr())
    })?;
    // SAFETY: created just above.
    let desc = unsafe { desc.assume_init() };
    let [n, c, h, w] = d.dims;
    let [sn, sc, sh, sw] = d.strides;
    // SAFETY: `desc` is live; plain integer arguments.
    let status = unsafe {
        sys::cudnnSetTensor4dDescriptorEx(desc, data_type(dtype), n, c, h, w, sn, sc, sh, sw)
    };
    if let Err(e) = check("cudnnSetTensor4dDescriptorEx", status) {
        // SAFETY: created above, not destroyed yet.
        let _ = unsafe { sys::cudnnDestroyTensorDescriptor(desc) };
        return Err(e);
    }
    Ok(desc)
}

impl Descriptors {
    fn new(key: &ConvKey, math: sys::cudnnMathType_t) -> Result<Descriptors> {
        let mut d = Descriptors {
            x: std::ptr::null_mut(),
            y: std::ptr::null_mut(),
            w: std::ptr::null_mut(),
            conv: std::ptr::null_mut(),
        };
        d.x = tensor_descriptor(&tensor_dims(key.x, key.layout)?, key.dtype)?;
        d.y = tensor_descriptor(&tensor_dims(key.y(), key.layout)?, key.dtype)?;
        let mut w = MaybeUninit::uninit();
        // SAFETY: writes a descriptor on success.
        check("cudnnCreateFilterDescriptor", unsafe {
            sys::cudnnCreateFilterDescriptor(w.as_mut_ptr())
        })?;
        // SAFETY: created just above; dropped with `d`.
        d.w = unsafe { w.assume_init() };
        let [k, c, r, s] = key.w;
        let format = match key.layout {
            ConvLayout::Nchw => sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW,
            ConvLayout::Nhwc => sys::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC,
        };
        let (k, c, r, s) =
            (to_int("c_out", k)?, to_int("c_in/groups", c)?, to_int("kh", r)?, to_int("kw", s)?);
        // SAFETY: `d.w` is live; plain arguments.
        check("cudnnSetFilter4dDescriptor", unsafe {
            sys::cudnnSetFilter4dDescriptor(d.w, data_type(key.dtype), format, k, c, r, s)
        })?;
        let mut conv = MaybeUninit::uninit();
        // SAFETY: writes a descriptor on success.
        check("cudnnCreateConvolutionDescriptor", unsafe {
            sys::cudnnCreateConvolutionDescriptor(conv.as_mut_ptr())
        })?;
        // SAFETY: created just above; dropped with `d`.
        d.conv = unsafe { conv.assume_init() };
        let (ph, pw) = (to_int("padding", key.padding.0)?, to_int("padding", key.padding.1)?);
        let (sh, sw) = (to_int("stride", key.stride.0)?, to_int("stride", key.stride.1)?);
        let (dh, dw) = (to_int("dilation", key.dilation.0)?, to_int("dilation", key.dilation.1)?);
        // SAFETY: `d.conv` is live; plain arguments. Compute type FLOAT for every dtype
        // (f16 and bf16 accumulate in f32, as PyTorch asks).
        check("cudnnSetConvolution2dDescriptor", unsafe {
            sys::cudnnSetConvolution2dDescriptor(
                d.conv,
                ph,
                pw,
                sh,
                sw,
                dh,
                dw,
                sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
            )
        })?;
        let groups = to_int("groups", key.groups)?;
        // SAFETY: `d.conv` is live.
        check("cudnnSetConvolutionGroupCount", unsafe {
            sys::cudnnSetConvolutionGroupCount(d.conv, groups)
        })?;
        d.set_math(math)?;
        Ok(d)
    }

    fn set_math(&self, math: sys::cudnnMathType_t) -> Result<()> {
        // SAFETY: `self.conv` is live.
        check("cudnnSetConvolutionMathType", unsafe {
            sys::cudnnSetConvolutionMathType(self.conv, math)
        })
    }
}

/// The device pointers of one call: `x`, `w`, `y` in the forward's roles (for backward
/// data, `x` is dx, written; for backward filter, `w` is dw, written).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Pointers {
    pub(crate) x: u64,
    pub(crate) w: u64,
    pub(crate) y: u64,
}

/// One direction of a convolution: its algorithm type, search and run calls.
trait Direction {
    type Algo: Copy + std::fmt::Debug + 'static;
    type Perf: Copy;
    const NAME: &'static str;
    fn cache(dnn: &Dnn) -> &AlgoCache<Self::Algo>;
    fn unpack(p: &Self::Perf) -> (Self::Algo, sys::cudnnStatus_t, usize, sys::cudnnMathType_t);
    /// The algorithms PyTorch's `findAlgorithms` lists for this direction, whose workspaces
    /// `getMaxWorkspaceSize` asks for one by one.
    const ALGOS: &'static [Self::Algo];
    /// `cudnnGet*WorkspaceSize` of `algo` for these descriptors, into `bytes`.
    ///
    /// # Safety
    /// Live handle and descriptors.
    unsafe fn workspace_size(
        h: sys::cudnnHandle_t,
        d: &Descriptors,
        algo: Self::Algo,
        bytes: &mut usize,
    ) -> sys::cudnnStatus_t;
    /// Ranks the algorithms into `out`, returning how many it wrote.
    ///
    /// # Safety
    /// Live handle and descriptors; with `find`, `ptrs` and `ws` live device memory.
    unsafe fn search(
        h: sys::cudnnHandle_t,
        d: &Descriptors,
        find: Option<(Pointers, u64, usize)>,
        out: &mut [Self::Perf],
    ) -> Result<usize>;
    /// # Safety
    /// Live handle and descriptors; the pointers hold the descriptors' elements, `ws` the
    /// algorithm's workspace.
    unsafe fn run(
        h: sys::cudnnHandle_t,
        d: &Descriptors,
        algo: Self::Algo,
        ptrs: Pointers,
        ws: (u64, usize),
        beta: *const c_void,
    ) -> sys::cudnnStatus_t;
}

fn zeroed_perfs<P>(n: usize) -> Vec<P> {
    // SAFETY: every perf struct is C data whose all-zero bits are valid (algorithm 0,
    // CUDNN_STATUS_SUCCESS, CUDNN_NON_DETERMINISTIC, CUDNN_DEFAULT_MATH, zero numbers).
    (0..n).map(|_| unsafe { MaybeUninit::<P>::zeroed().assume_init() }).collect()
}

const ONE: f32 = 1.0;
const ZERO: f32 = 0.0;

fn alpha() -> *const c_void {
    (&ONE as *const f32).cast()
}

fn beta(blend: bool) -> *const c_void {
    if blend { (&ONE as *const f32).cast() } else { (&ZERO as *const f32).cast() }
}

struct Fwd;
impl Direction for Fwd {
    type Algo = sys::cudnnConvolutionFwdAlgo_t;
    type Perf = sys::cudnnConvolutionFwdAlgoPerf_t;
    const NAME: &'static str = "cudnnConvolutionForward";
    fn cache(dnn: &Dnn) -> &AlgoCache<Self::Algo> {
        &dnn.fwd
    }
    fn unpack(p: &Self::Perf) -> (Self::Algo, sys::cudnnStatus_t, usize, sys::cudnnMathType_t) {
        (p.algo, p.status, p.memory, p.mathType)
    }
    const ALGOS: &'static [Self::Algo] = &[
        sys::cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_GEMM,
        sys::cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_FFT,
        sys::cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING,
        sys::cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
        sys::cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
        sys::cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_DIRECT,
        sys::cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD,
        sys::cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED,
    ];
    unsafe fn workspace_size(
        h: sys::cudnnHandle_t,
        d: &Descriptors,
        algo: Self::Algo,
        bytes: &mut usize,
    ) -> sys::cudnnStatus_t {
        // SAFETY: the caller's contract; `bytes` is a valid out-pointer.
        unsafe {
            sys::cudnnGetConvolutionForwardWorkspaceSize(h, d.x, d.w, d.conv, d.y, algo, bytes)
        }
    }
    unsafe fn search(
        h: sys::cudnnHandle_t,
        d: &Descriptors,
        find: Option<(Pointers, u64, usize)>,
        out: &mut [Self::Perf],
    ) -> Result<usize> {
        let mut n = 0;
        let cap = out.len() as i32;
        // SAFETY: the caller's contract; `out` holds `cap` results.
        let status = unsafe {
            match find {
                None => sys::cudnnGetConvolutionForwardAlgorithm_v7(
                    h,
                    d.x,
                    d.w,
                    d.conv,
                    d.y,
                    cap,
                    &mut n,
                    out.as_mut_ptr(),
                ),
                Some((p, ws, bytes)) => sys::cudnnFindConvolutionForwardAlgorithmEx(
                    h,
                    d.x,
                    p.x as *const c_void,
                    d.w,
                    p.w as *const c_void,
                    d.conv,
                    d.y,
                    p.y as *mut c_void,
                    cap,
                    &mut n,
                    out.as_mut_ptr(),
                    ws as *mut c_void,
                    bytes,
                ),
            }
        };
        check("cudnnGetConvolutionForwardAlgorithm", status)?;
        Ok((n.max(0) as usize).min(out.len()))
    }
    unsafe fn run(
        h: sys::cudnnHandle_t,
        d: &Descriptors,
        algo: Self::Algo,
        p: Pointers,
        (ws, bytes): (u64, usize),
        beta: *const c_void,
    ) -> sys::cudnnStatus_t {
        // SAFETY: the caller's contract; alpha and beta are f32 as a FLOAT compute type needs.
        unsafe {
            sys::cudnnConvolutionForward(
                h,
                alpha(),
                d.x,
                p.x as *const c_void,
                d.w,
                p.w as *const c_void,
                d.conv,
                algo,
                ws as *mut c_void,
                bytes,
                beta,
                d.y,
                p.y as *mut c_void,
            )
        }
    }
}

struct BwdData;
impl Direction for BwdData {
    type Algo = sys::cudnnConvolutionBwdDataAlgo_t;
    type Perf = sys::cudnnConvolutionBwdDataAlgoPerf_t;
    const NAME: &'static str = "cudnnConvolutionBackwardData";
    fn cache(dnn: &Dnn) -> &AlgoCache<Self::Algo> {
        &dnn.bwd_data
    }
    fn unpack(p: &Self::Perf) -> (Self::Algo, sys::cudnnStatus_t, usize, sys::cudnnMathType_t) {
        (p.algo, p.status, p.memory, p.mathType)
    }
    const ALGOS: &'static [Self::Algo] = &[
        sys::cudnnConvolutionBwdDataAlgo_t::CUDNN_CONVOLUTION_BWD_DATA_ALGO_0,
        sys::cudnnConvolutionBwdDataAlgo_t::CUDNN_CONVOLUTION_BWD_DATA_ALGO_1,
        sys::cudnnConvolutionBwdDataAlgo_t::CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT,
        sys::cudnnConvolutionBwdDataAlgo_t::CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING,
        sys::cudnnConvolutionBwdDataAlgo_t::CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD,
        sys::cudnnConvolutionBwdDataAlgo_t::CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED,
    ];
    unsafe fn workspace_size(
        h: sys::cudnnHandle_t,
        d: &Descriptors,
        algo: Self::Algo,
        bytes: &mut usize,
    ) -> sys::cudnnStatus_t {
        // SAFETY: the caller's contract; `bytes` is a valid out-pointer.
        unsafe {
            sys::cudnnGetConvolutionBackwardDataWorkspaceSize(h, d.w, d.y, d.conv, d.x, algo, bytes)
        }
    }
    unsafe fn search(
        h: sys::cudnnHandle_t,
        d: &Descriptors,
        find: Option<(Pointers, u64, usize)>,
        out: &mut [Self::Perf],
    ) -> Result<usize> {
        let mut n = 0;
        let cap = out.len() as i32;
        // SAFETY: the caller's contract; `out` holds `cap` results.
        let status = unsafe {
            match find {
                None => sys::cudnnGetConvolutionBackwardDataAlgorithm_v7(
                    h,
                    d.w,
                    d.y,
                    d.conv,
                    d.x,
                    cap,
                    &mut n,
                    out.as_mut_ptr(),
                ),
                Some((p, ws, bytes)) => sys::cudnnFindConvolutionBackwardDataAlgorithmEx(
                    h,
                    d.w,
                    p.w as *const c_void,
                    d.y,
                    p.y as *const c_void,
                    d.conv,
                    d.x,
                    p.x as *mut c_void,
                    cap,
                    &mut n,
                    out.as_mut_ptr(),
                    ws as *mut c_void,
                    bytes,
                ),
            }
        };
        check("cudnnGetConvolutionBackwardDataAlgorithm", status)?;
        Ok((n.max(0) as usize).min(out.len()))
    }
    unsafe fn run(
        h: sys::cudnnHandle_t,
        d: &Descriptors,
        algo: Self::Algo,
        p: Pointers,
        (ws, bytes): (u64, usize),
        beta: *const c_void,
    ) -> sys::cudnnStatus_t {
        // SAFETY: the caller's contract.
        unsafe {
            sys::cudnnConvolutionBackwardData(
                h,
                alpha(),
                d.w,
                p.w as *const c_void,
                d.y,
                p.y as *const c_void,
                d.conv,
                algo,
                ws as *mut c_void,
                bytes,
                beta,
                d.x,
                p.x as *mut c_void,
            )
        }
    }
}

struct BwdFilter;
impl Direction for BwdFilter {
    type Algo = sys::cudnnConvolutionBwdFilterAlgo_t;
    type Perf = sys::cudnnConvolutionBwdFilterAlgoPerf_t;
    const NAME: &'static str = "cudnnConvolutionBackwardFilter";
    fn cache(dnn: &Dnn) -> &AlgoCache<Self::Algo> {
        &dnn.bwd_filter
    }
    fn unpack(p: &Self::Perf) -> (Self::Algo, sys::cudnnStatus_t, usize, sys::cudnnMathType_t) {
        (p.algo, p.status, p.memory, p.mathType)
    }
    const ALGOS: &'static [Self::Algo] = &[
        // PyTorch leaves out ALGO_WINOGRAD, which cuDNN does not implement here.
        sys::cudnnConvolutionBwdFilterAlgo_t::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0,
        sys::cudnnConvolutionBwdFilterAlgo_t::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
        sys::cudnnConvolutionBwdFilterAlgo_t::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT,
        sys::cudnnConvolutionBwdFilterAlgo_t::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3,
        sys::cudnnConvolutionBwdFilterAlgo_t::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED,
        sys::cudnnConvolutionBwdFilterAlgo_t::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING,
    ];
    unsafe fn workspace_size(
        h: sys::cudnnHandle_t,
        d: &Descriptors,
        algo: Self::Algo,
        bytes: &mut usize,
    ) -> sys::cudnnStatus_t {
        // SAFETY: the caller's contract; `bytes` is a valid out-pointer.
        unsafe {
            sys::cudnnGetConvolutionBackwardFilterWorkspaceSize(
                h, d.x, d.y, d.conv, d.w, algo, bytes,
            )
        }
    }
    unsafe fn search(
        h: sys::cudnnHandle_t,
        d: &Descriptors,
        find: Option<(Pointers, u64, usize)>,
        out: &mut [Self::Perf],
    ) -> Result<usize> {
        let mut n = 0;
        let cap = out.len() as i32;
        // SAFETY: the caller's contract; `out` holds `cap` results.
        let status = unsafe {
            match find {
                None => sys::cudnnGetConvolutionBackwardFilterAlgorithm_v7(
                    h,
                    d.x,
                    d.y,
                    d.conv,
                    d.w,
                    cap,
                    &mut n,
                    out.as_mut_ptr(),
                ),
                Some((p, ws, bytes)) => sys::cudnnFindConvolutionBackwardFilterAlgorithmEx(
                    h,
                    d.x,
                    p.x as *const c_void,
                    d.y,
                    p.y as *const c_void,
                    d.conv,
                    d.w,
                    p.w as *mut c_void,
                    cap,
                    &mut n,
                    out.as_mut_ptr(),
                    ws as *mut c_void,
                    bytes,
                ),
            }
        };
        check("cudnnGetConvolutionBackwardFilterAlgorithm", status)?;
        Ok((n.max(0) as usize).min(out.len()))
    }
    unsafe fn run(
        h: sys::cudnnHandle_t,
        d: &Descriptors,
        algo: Self::Algo,
        p: Pointers,
        (ws, bytes): (u64, usize),
        beta: *const c_void,
    ) -> sys::cudnnStatus_t {
        // SAFETY: the caller's contract.
        unsafe {
            sys::cudnnConvolutionBackwardFilter(
                h,
                alpha(),
                d.x,
                p.x as *const c_void,
                d.y,
                p.y as *const c_void,
                d.conv,
                algo,
                ws as *mut c_void,
                bytes,
                beta,
                d.w,
                p.w as *mut c_void,
            )
        }
    }
}

/// How many results a search asks for: more than any direction has algorithms.
const MAX_ALGOS: usize = 16;

/// Which convolution direction to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pass {
    Forward,
    BackwardData,
    BackwardFilter,
}

impl Dnn {
    /// Runs convolution `key` in direction `pass` on `ptrs` (see [`Pointers`]); workspaces
    /// from `ws`; `benchmark`: a timed search rather than the heuristics for a key not cached
    /// yet. The output is overwritten (beta = 0), or, with `blend`, first written by `blend`
    /// (right before each algorithm's call, after any timed search has scribbled on it) and
    /// the convolution added to it (beta = 1). The caller has bound the context.
    ///
    /// # Errors
    ///
    /// The last out-of-memory error when no candidate's workspace fits; [`Error::Device`]
    /// when cuDNN refuses every candidate or a search fails.
    ///
    /// # Safety
    ///
    /// The pointers are live device allocations holding the elements `key` describes in its
    /// layout; outputs do not alias inputs.
    pub(crate) unsafe fn convolution(
        &self,
        pass: Pass,
        key: &ConvKey,
        benchmark: bool,
        ptrs: Pointers,
        ws: &dyn WorkspaceSource,
        blend: Option<&dyn Fn() -> Result<()>>,
    ) -> Result<()> {
        let r = Run { ptrs, ws, blend };
        // SAFETY: the caller's contract.
        unsafe {
            match pass {
                Pass::Forward => self.try_all::<Fwd>(key, benchmark, &r),
                Pass::BackwardData => self.try_all::<BwdData>(key, benchmark, &r),
                Pass::BackwardFilter => self.try_all::<BwdFilter>(key, benchmark, &r),
            }
        }
    }

    /// PyTorch's `AlgoIterator::try_all` (see the module's docs).
    unsafe fn try_all<D: Direction>(
        &self,
        key: &ConvKey,
        benchmark: bool,
        r: &Run<'_>,
    ) -> Result<()> {
        let (ptrs, ws) = (r.ptrs, r.ws);
        let math = math_type(key.dtype, key.allow_tf32);
        let d = Descriptors::new(key, math)?;
        let mut last_oom = None;
        let mut refused = Vec::new();
        if let Some(choice) = D::cache(self).get(key) {
            // SAFETY: the caller's contract.
            match unsafe { self.attempt::<D>(&d, choice, r) } {
                Ok(()) => return Ok(()),
                Err(Attempt::Oom(e)) => last_oom = Some(e),
                Err(Attempt::Refused(s)) => refused.push(format!("{:?}: {s:?}", choice.algo)),
                Err(Attempt::Failed(e)) => return Err(e),
            }
            d.set_math(math)?;
        }
        let mut perfs = zeroed_perfs::<D::Perf>(MAX_ALGOS);
        let (n, search) = if benchmark {
            // PyTorch's `findAlgorithms`: one workspace of `getMaxWorkspaceSize`, allocated
            // outside `try_all`'s catch (its out-of-memory is the convolution's).
            let bytes = search_workspace(&self.workspace_sizes::<D>(&d), ws.cache_info());
            let block = ws.workspace(bytes)?;
            let addr = block.as_ref().map_or(0, |b| b.ptr());
            // SAFETY: the caller's contract; `block` holds `bytes` bytes and lives until the
            // search returns (which synchronizes).
            let n = unsafe { D::search(self.handle, &d, Some((ptrs, addr, bytes)), &mut perfs)? };
            // PyTorch empties the cache right after the search, while the search's workspace
            // is still held (it goes back to the cache after).
            ws.empty_cache();
            drop(block);
            (n, Some(bytes))
        } else {
            // SAFETY: live handle and descriptors.
            (unsafe { D::search(self.handle, &d, None, &mut perfs)? }, None)
        };
        for perf in &perfs[..n] {
            let (algo, status, workspace, found) = D::unpack(perf);
            if status != sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
                continue;
            }
            let math = run_math_type(key.dtype, key.allow_tf32, found);
            let choice = Choice { algo, math, workspace, search };
            // SAFETY: the caller's contract.
            match unsafe { self.attempt::<D>(&d, choice, r) } {
                Ok(()) => {
                    D::cache(self).insert(*key, choice);
                    return Ok(());
                }
                Err(Attempt::Oom(e)) => last_oom = Some(e),
                Err(Attempt::Refused(s)) => refused.push(format!("{algo:?}: {s:?}")),
                Err(Attempt::Failed(e)) => return Err(e),
            }
        }
        if let Some(e) = last_oom {
            return Err(e);
        }
        Err(Error::Device {
            op: D::NAME,
            reason: format!(
                "no cuDNN algorithm ran ({} candidates{}{})",
                n,
                if refused.is_empty() { "" } else { "; refused: " },
                refused.join(", ")
            ),
        })
    }

    /// The workspace size of each algorithm of direction `D` that cuDNN can size for these
    /// descriptors (for the timed search), asked one by one as PyTorch's
    /// `getMaxWorkspaceSize` does (not the heuristics' list, which may leave some out).
    fn workspace_sizes<D: Direction>(&self, d: &Descriptors) -> Vec<usize> {
        D::ALGOS
            .iter()
            .filter_map(|&algo| {
                let mut bytes = 0;
                // SAFETY: live handle and descriptors; `bytes` is a valid out-pointer.
                let status = unsafe { D::workspace_size(self.handle, d, algo, &mut bytes) };
                (status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS).then_some(bytes)
            })
            .collect()
    }

    /// Runs `choice`: its workspace from `ws`, the math type on the descriptor, the call.
    unsafe fn attempt<D: Direction>(
        &self,
        d: &Descriptors,
        choice: Choice<D::Algo>,
        r: &Run<'_>,
    ) -> std::result::Result<(), Attempt> {
        let (ptrs, ws) = (r.ptrs, r.ws);
        if choice.workspace >= MAX_WORKSPACE {
            return Err(Attempt::Refused(sys::cudnnStatus_t::CUDNN_STATUS_ALLOC_FAILED));
        }
        let block = match ws.workspace(choice.workspace) {
            Ok(b) => b,
            Err(e) if e.is_out_of_memory() => return Err(Attempt::Oom(e)),
            Err(_) => return Err(Attempt::Refused(sys::cudnnStatus_t::CUDNN_STATUS_ALLOC_FAILED)),
        };
        d.set_math(choice.math)
            .map_err(|_| Attempt::Refused(sys::cudnnStatus_t::CUDNN_STATUS_BAD_PARAM))?;
        if let Some(blend) = r.blend {
            blend().map_err(Attempt::Failed)?;
        }
        let addr = block.as_ref().map_or(0, |b| b.ptr());
        let beta = beta(r.blend.is_some());
        // SAFETY: the caller's contract; `block` holds `choice.workspace` bytes and goes back
        // to the cache after the call is queued, which the stream orders before its reuse.
        let status =
            unsafe { D::run(self.handle, d, choice.algo, ptrs, (addr, choice.workspace), beta) };
        drop(block);
        if status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
            Ok(())
        } else {
            Err(Attempt::Refused(status))
        }
    }
}

/// PyTorch's `getMaxWorkspaceSize`: the largest of the algorithms' workspace `sizes` no
/// larger than `cache_info` (the caching allocator's `cacheInfo`), 0 when none is; sizes of
/// 1 TiB or more (cuDNN's absurd reports) never.
fn search_workspace(sizes: &[usize], cache_info: u64) -> usize {
    sizes
        .iter()
        .copied()
        .filter(|&s| s < MAX_WORKSPACE && s as u64 <= cache_info)
        .max()
        .unwrap_or(0)
}

/// Why one algorithm did not run.
enum Attempt {
    /// Its workspace did not fit.
    Oom(Error),
    /// cuDNN refused it.
    Refused(sys::cudnnStatus_t),
    /// Something else failed (writing the output before a blend): no other algorithm helps.
    Failed(Error),
}

/// One call's operands: pointers, the workspace source and the blend (see
/// [`Dnn::convolution`]).
struct Run<'a> {
    ptrs: Pointers,
    ws: &'a dyn WorkspaceSource,
    blend: Option<&'a dyn Fn() -> Result<()>>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cudnn_choices::supports;
    use crate::params::{Conv2dOptions, Conv2dParams};
    use std::io::Write as _;

    fn params(x: &[usize], w: &[usize], o: &Conv2dOptions) -> Conv2dParams {
        Conv2dParams::new(x, w, o).unwrap()
    }

    #[test]
    fn tensor_strides_follow_the_layout() {
        let nchw = tensor_dims([2, 3, 4, 5], ConvLayout::Nchw).unwrap();
        assert_eq!(nchw.dims, [2, 3, 4, 5]);
        assert_eq!(nchw.strides, [60, 20, 5, 1]);
        let nhwc = tensor_dims([2, 3, 4, 5], ConvLayout::Nhwc).unwrap();
        assert_eq!(nhwc.dims, [2, 3, 4, 5]);
        assert_eq!(nhwc.strides, [60, 1, 15, 3]);
        // Element (n, c, h, w) of an NHWC tensor is at ((n * H + h) * W + w) * C + c.
        let [sn, sc, sh, sw] = nhwc.strides;
        assert_eq!(sn + 2 * sc + 3 * sh + 4 * sw, ((4 + 3) * 5 + 4) * 3 + 2);
    }

    #[test]
    fn tensors_past_cudnns_int_are_refused_with_a_clear_error() {
        let e = tensor_dims([1 << 16, 1 << 8, 1 << 8, 1], ConvLayout::Nchw).unwrap_err();
        assert!(e.to_string().contains("32-bit"), "{e}");
        let big = params(&[1 << 12, 1 << 8, 64, 64], &[8, 1 << 8, 3, 3], &Conv2dOptions::default());
        assert!(!supports(&big));
        let small = params(&[2, 4, 8, 8], &[8, 4, 3, 3], &Conv2dOptions::default());
        assert!(supports(&small));
        let empty = params(&[0, 4, 8, 8], &[8, 4, 3, 3], &Conv2dOptions::default());
        assert!(!supports(&empty));
    }

    #[test]
    fn the_key_holds_the_logical_shapes_and_the_output_matches_the_params() {
        let o = Conv2dOptions::default().stride((2, 1)).padding((1, 2)).dilation((1, 2)).groups(2);
        let p = params(&[3, 4, 11, 9], &[6, 2, 3, 3], &o);
        let key = ConvKey::new(&p, DType::BF16, ConvLayout::Nhwc, true);
        assert_eq!(key.x, [3, 4, 11, 9]);
        assert_eq!(key.w, [6, 2, 3, 3]);
        assert_eq!(key.y(), p.output_shape());
        assert_eq!(
            (key.groups, key.padding, key.stride, key.dilation),
            (2, (1, 2), (2, 1), (1, 2))
        );
    }

    #[test]
    fn the_algorithm_cache_is_keyed_per_shape_dtype_layout_and_tf32() {
        let cache = AlgoCache::<sys::cudnnConvolutionFwdAlgo_t>::default();
        let o = Conv2dOptions::default().padding((1, 1));
        let p = params(&[2, 4, 8, 8], &[8, 4, 3, 3], &o);
        let key = ConvKey::new(&p, DType::F32, ConvLayout::Nchw, true);
        let choice = Choice {
            algo: sys::cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
            math: sys::cudnnMathType_t::CUDNN_DEFAULT_MATH,
            workspace: 1024,
            search: None,
        };
        assert_eq!(cache.get(&key), None);
        cache.insert(key, choice);
        assert_eq!(cache.get(&key), Some(choice));
        let other_batch = ConvKey::new(
            &params(&[3, 4, 8, 8], &[8, 4, 3, 3], &o),
            DType::F32,
            ConvLayout::Nchw,
            true,
        );
        let others = [
            other_batch,
            ConvKey { dtype: DType::F16, ..key },
            ConvKey { layout: ConvLayout::Nhwc, ..key },
            ConvKey { allow_tf32: false, ..key },
            ConvKey { groups: 2, w: [8, 2, 3, 3], ..key },
            ConvKey { stride: (2, 2), ..key },
        ];
        for other in others {
            assert_eq!(cache.get(&other), None, "{other:?}");
        }
        let second = Choice { workspace: 0, ..choice };
        cache.insert(others[1], second);
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.get(&others[1]), Some(second));
        assert_eq!(cache.get(&key), Some(choice));
    }

    #[test]
    fn the_search_workspace_is_the_largest_algorithm_size_within_cache_info() {
        const MIB: usize = 1 << 20;
        let sizes = [0, 4 * MIB, 300 * MIB, 2 * MIB, MAX_WORKSPACE, usize::MAX];
        assert_eq!(search_workspace(&sizes, 100 * MIB as u64), 4 * MIB);
        assert_eq!(search_workspace(&sizes, 300 * MIB as u64), 300 * MIB, "at the cap");
        assert_eq!(search_workspace(&sizes, u64::MAX), 300 * MIB, "never 1 TiB or more");
        assert_eq!(search_workspace(&sizes, MIB as u64), 0);
        assert_eq!(search_workspace(&[], u64::MAX), 0);
    }

    #[test]
    fn math_types_follow_pytorchs_allow_tf32() {
        use sys::cudnnMathType_t::*;
        assert_eq!(math_type(DType::F32, true), CUDNN_DEFAULT_MATH);
        assert_eq!(math_type(DType::F32, false), CUDNN_FMA_MATH);
        for tf32 in [true, false] {
            assert_eq!(math_type(DType::F16, tf32), CUDNN_TENSOR_OP_MATH);
            assert_eq!(math_type(DType::BF16, tf32), CUDNN_TENSOR_OP_MATH);
        }
        // A search result cannot turn TF32 on for f32 when it is off.
        assert_eq!(run_math_type(DType::F32, false, CUDNN_TENSOR_OP_MATH), CUDNN_FMA_MATH);
        assert_eq!(run_math_type(DType::F32, true, CUDNN_TENSOR_OP_MATH), CUDNN_TENSOR_OP_MATH);
        assert_eq!(run_math_type(DType::F16, false, CUDNN_TENSOR_OP_MATH), CUDNN_TENSOR_OP_MATH);
        assert_eq!(data_type(DType::BF16), sys::cudnnDataType_t::CUDNN_DATA_BFLOAT16);
    }

    #[test]
    fn versions_read_as_cudnn_writes_them() {
        assert_eq!(version_string(91400), "9.14.0");
        assert_eq!(version_string(90102), "9.1.2");
    }

    /// On a GPU with cuDNN: one cached choice per direction and key, the same key again
    /// adding none.
    #[test]
    fn cudnn_caches_one_choice_per_direction_and_key_on_a_gpu() {
        let Ok(d) = crate::Device::cuda(0) else {
            let _ = writeln!(std::io::stderr(), "skipped: no CUDA device");
            return;
        };
        let cu = d.cuda_backend().expect("a CUDA device");
        if let Err(reason) = cu.cudnn_version() {
            let _ = writeln!(std::io::stderr(), "skipped: no cuDNN ({reason})");
            return;
        }
        let cached = || cu.dnn_lock().unwrap().cached();
        let before = cached();
        let o = Conv2dOptions::default().padding((1, 1));
        for (shape, repeat) in [([2, 8, 12, 12], 2), ([3, 8, 12, 12], 1)] {
            let x = crate::Tensor::zeros(&d, &shape, DType::F32).unwrap();
            let w = crate::Tensor::zeros(&d, &[8, 8, 3, 3], DType::F32).unwrap();
            for _ in 0..repeat {
                let y = crate::ops::conv2d(&x, &w, None, &o).unwrap();
                crate::ops::conv2d_backward(&x, &w, &y, &o, false).unwrap();
            }
        }
        let after = cached();
        for i in 0..3 {
            assert_eq!(after[i] - before[i], 2, "direction {i}: {before:?} -> {after:?}");
        }
    }

    #[test]
    fn loading_without_the_library_reports_why_instead_of_panicking() {
        // SAFETY: only looks for the library.
        if unsafe { sys::is_culib_present() } {
            let _ = writeln!(std::io::stderr(), "skipped: cuDNN is installed here");
            return;
        }
        let e = Dnn::load().unwrap_err();
        assert!(e.contains("libcudnn"), "{e}");
    }
}
