//! The CUDA kernels run on the host, for tests on machines without a GPU: each `.cu` module
//! is compiled as C++ (the system's `c++`, C++20) behind a small shim of CUDA's execution
//! model, loaded, and launched with the registry's argument checks and the launch
//! configurations the ops use. Device pointers are host addresses.
//!
//! The shim runs one block at a time, each of its threads an OS thread: `__syncthreads` is a
//! barrier of the block, `__shfl_xor_sync` an exchange through memory between two barriers
//! of the warp, a tensor-core `mma.sync` (m16n8k16, 16-bit in, f32 accumulate: `mma_16816`
//! in `attention.cu`) a gather of the warp's fragments the same way, `__shared__` a static (one block at a time); there is no `atomicAdd` (no
//! kernel adds with atomics: `nvrtc_check` keeps it so). It is faithful for kernels that
//! follow CUDA's rules (barriers reached by the whole block, shuffles by whole warps) and
//! finds what NVRTC's type checks cannot: wrong indices, elements missed or written twice,
//! packs that overrun, reductions that drop a thread's share, sums added in another order
//! than the host's. It says nothing of speed, of the GPU's memory model beyond barriers, or
//! of the device's math library (the host's `expf` differs from CUDA's in the last bits: the
//! comparisons allow for it; GELU and SiLU use `vram_exp`, the host's own, on both). f16 converts through the compiler's `_Float16`
//! instead of PTX (`VRAM_HOST_EMULATION` in `common.cuh`); every other line is the one NVRTC
//! compiles.
//!
//! [`Emulator`] goes one level up: an op's CUDA code written against [`Exec`] (the
//! convolution's) runs here whole, its kernels emulated and its cuBLAS products computed by
//! definition.
//!
//! Without a C++ compiler the tests print `skipped: no C++ compiler (...)` and pass.

#[cfg(test)]
use super::Exec;
use super::launch::Arg;
use super::registry::COMMON;
#[cfg(test)]
use super::{
    launch::check_args,
    registry::{ALL, Instance, Module},
};
#[cfg(feature = "emulation")]
use crate::custom::{CudaKernel, CudaSource, Grid, KernelArg};
#[cfg(test)]
use crate::dtype::DType;
use crate::error::{Error, Result};
#[cfg(test)]
use crate::params::MatmulSpec;
#[cfg(test)]
use cudarc::driver::LaunchConfig;
#[cfg(test)]
use half::{bf16, f16};
use std::collections::HashMap;
use std::ffi::c_void;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Mutex, MutexGuard, OnceLock};

/// Before the sources: the CUDA names the kernels use, on the host.
const PRELUDE: &str = r#"
#define VRAM_HOST_EMULATION 1
#include <atomic>
#include <barrier>
#include <math.h>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
struct emu_dim3 { unsigned int x, y, z; };
static thread_local emu_dim3 threadIdx, blockIdx;
static emu_dim3 blockDim, gridDim;
static std::barrier<>* emu_block;
static std::vector<std::unique_ptr<std::barrier<>>> emu_warps;
static float emu_exchange[1024];
inline void __syncthreads() { emu_block->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
    const unsigned t = threadIdx.x;
    std::barrier<>& warp = *emu_warps[t / 32];
    emu_exchange[t] = v;
    warp.arrive_and_wait();
    const float r = emu_exchange[t ^ (unsigned)lane_mask];
    warp.arrive_and_wait();
    return r;
}
// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: d += A (16x16) B (16x8), each lane
// holding its fragments in PTX's layout (A: a[r] = rows g, g + 8 for r = 0, 1, 2, 3 by
// r % 2, columns 2 t + 8 (r / 2) and the next; B: b[r] = rows 2 t + 8 r and the next,
// column g; C and D: rows g, g + 8, columns 2 t and 2 t + 1; g = lane / 4, t = lane % 4,
// the lower-indexed element in the low half). Gathered through memory between two
// barriers of the warp, as __shfl_xor_sync; products summed in f32 in k order.
static unsigned emu_mma_a[1024][4], emu_mma_b[1024][2];
inline float emu_16bit(unsigned short h, bool bf16) {
    return bf16 ? __builtin_bit_cast(float, (unsigned)h << 16)
                : (float)__builtin_bit_cast(_Float16, h);
}
inline void emu_mma_16816(float* d, const unsigned* a, const unsigned* b, bool bf16) {
    const unsigned t = threadIdx.x, w0 = t & ~31u, lane = t & 31u;
    std::barrier<>& warp = *emu_warps[t / 32];
    for (int i = 0; i < 4; ++i) emu_mma_a[t][i] = a[i];
    emu_mma_b[t][0] = b[0];
    emu_mma_b[t][1] = b[1];
    warp.arrive_and_wait();
    auto A = [&](unsigned r, unsigned c) {
        const unsigned word = emu_mma_a[w0 + (r % 8) * 4 + (c % 8) / 2][r / 8 + 2 * (c / 8)];
        return emu_16bit((unsigned short)(word >> (16 * (c % 2))), bf16);
    };
    auto B = [&](unsigned k, unsigned n) {
        const unsigned word = emu_mma_b[w0 + n * 4 + (k % 8) / 2][k / 8];
        return emu_16bit((unsigned short)(word >> (16 * (k % 2))), bf16);
    };
    const unsigned g = lane / 4, tg = lane % 4;
    for (unsigned i = 0; i < 4; ++i) {
        const unsigned r = g + 8 * (i / 2), n = 2 * tg + i % 2;
        float s = 0.0f;
        for (unsigned k = 0; k < 16; ++k) s += A(r, k) * B(k, n);
        d[i] += s;
    }
    warp.arrive_and_wait();
}
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
inline unsigned int __umulhi(unsigned int a, unsigned int b) {
    return (unsigned int)(((unsigned long long)a * b) >> 32);
}
inline unsigned int __float_as_uint(float f) { return __builtin_bit_cast(unsigned int, f); }
inline float __uint_as_float(unsigned int u) { return __builtin_bit_cast(float, u); }
inline float __int_as_float(int i) { return __builtin_bit_cast(float, i); }
"#;

/// After the sources: the launcher and the calls by parameter array (`void**`, as
/// `cuLaunchKernel` takes them).
const LAUNCHER: &str = r#"
template <typename... A, std::size_t... I>
void emu_call(void (*f)(A...), void** p, std::index_sequence<I...>) {
    f(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(p[I])...);
}
template <typename... A> void emu_call(void (*f)(A...), void** p) {
    emu_call(f, p, std::index_sequence_for<A...>{});
}
// Runs `kernel` over grid (gx, gy) of blocks of bx threads (whole warps, at most 1024).
extern "C" int emu_launch(void (*kernel)(void**), unsigned gx, unsigned gy, unsigned bx,
                          void** params) {
    if (bx == 0 || bx > 1024 || bx % 32 != 0) return 1;
    blockDim = {bx, 1, 1};
    gridDim = {gx, gy, 1};
    std::barrier<> block(bx);
    emu_block = &block;
    emu_warps.clear();
    for (unsigned w = 0; w < bx / 32; ++w) emu_warps.push_back(std::make_unique<std::barrier<>>(32));
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < bx; ++t) {
        threads.emplace_back([=, &block] {
            threadIdx = {t, 0, 0};
            for (unsigned y = 0; y < gy; ++y) {
                for (unsigned x = 0; x < gx; ++x) {
                    blockIdx = {x, y, 0};
                    kernel(params);
                    block.arrive_and_wait();
                }
            }
        });
    }
    for (auto& th : threads) th.join();
    return 0;
}
"#;

type Entry = unsafe extern "C" fn(*mut *mut c_void);
type Launch = unsafe extern "C" fn(Entry, u32, u32, u32, *mut *mut c_void) -> i32;

/// One module compiled for the host.
struct Library {
    lib: libloading::Library,
}

/// What a module is compiled from: its name, its source (without `common.cuh`) and the
/// kernels to export.
struct Source<'a> {
    name: &'a str,
    source: &'a str,
    kernels: Vec<&'a str>,
}

/// Why a source was not compiled.
enum Unbuilt {
    /// No C++ compiler (or the library would not load): the emulation skips.
    NoCompiler(String),
    /// The compiler rejected the source.
    Rejected(String),
}

/// Compiled modules, by name for this crate's modules and by the address of their
/// [`CudaSource`] for custom ops' (`None`: no compiler); their lock also makes launches one
/// at a time (the shim's launch state is global).
#[derive(Default)]
struct Libraries {
    #[cfg(test)]
    modules: HashMap<&'static str, Option<&'static Library>>,
    #[cfg(feature = "emulation")]
    custom: HashMap<usize, Option<&'static Library>>,
}

fn libraries() -> MutexGuard<'static, Libraries> {
    static LIBS: OnceLock<Mutex<Libraries>> = OnceLock::new();
    LIBS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner())
}

fn say(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// `source` with the shim, compiled into a shared library, or why not.
fn compile(source: &Source<'_>) -> std::result::Result<Library, Unbuilt> {
    let mut text = format!("{PRELUDE}\n{COMMON}\n{}\n{LAUNCHER}\n", source.source);
    for name in &source.kernels {
        text += &format!("extern \"C\" void emu_{name}(void** p) {{ emu_call({name}, p); }}\n");
    }
    static BUILDS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let build = BUILDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir: PathBuf =
        std::env::temp_dir().join(format!("vram-emulate-{}-{build}", std::process::id()));
    let io = |e: std::io::Error| Unbuilt::NoCompiler(e.to_string());
    std::fs::create_dir_all(&dir).map_err(io)?;
    let (src, lib) = (dir.join("module.cpp"), dir.join("module.so"));
    std::fs::write(&src, text).map_err(io)?;
    let out = Command::new("c++")
        .args(["-std=c++20", "-O1", "-ffp-contract=off", "-fPIC", "-shared", "-pthread"])
        .args(["-Wno-unknown-pragmas", "-o"])
        .arg(&lib)
        .arg(&src)
        .output()
        .map_err(|e| Unbuilt::NoCompiler(format!("no C++ compiler ({e})")))?;
    let loaded = if out.status.success() {
        // SAFETY: a library just built from our sources; its initializers only set up
        // statics.
        unsafe { libloading::Library::new(&lib) }.map_err(|e| Unbuilt::NoCompiler(e.to_string()))
    } else {
        Err(Unbuilt::Rejected(format!(
            "{}.cu does not compile as C++:\n{}",
            source.name,
            String::from_utf8_lossy(&out.stderr)
        )))
    };
    // Loaded (or not), the files can go: the mapping outlives them.
    let _ = (std::fs::remove_file(&src), std::fs::remove_file(&lib), std::fs::remove_dir(&dir));
    Ok(Library { lib: loaded? })
}

/// Compiles `source` once into `slot`: the library, `None` after a skip line without a
/// compiler, or the compiler's complaint.
fn build(
    slot: &mut Option<Option<&'static Library>>,
    source: impl FnOnce() -> Source<'static>,
) -> std::result::Result<Option<&'static Library>, String> {
    if let Some(built) = *slot {
        return Ok(built);
    }
    let built = match compile(&source()) {
        Ok(lib) => Some(&*Box::leak(Box::new(lib))),
        Err(Unbuilt::NoCompiler(e)) => {
            say(&format!("skipped: no C++ compiler for the kernel emulation ({e})"));
            None
        }
        Err(Unbuilt::Rejected(e)) => return Err(e),
    };
    *slot = Some(built);
    Ok(built)
}

/// The library of `module`, compiled on first use; `None` (after a skip line) without a
/// compiler. Panics when the compiler rejects the source: this crate's kernels must build.
#[cfg(test)]
fn library(libs: &mut Libraries, module: &'static Module) -> Option<&'static Library> {
    let mut slot = libs.modules.get(module.name).copied();
    let built = build(&mut slot, || Source {
        name: module.name,
        source: module.source,
        kernels: ALL
            .iter()
            .filter(|k| k.module.name == module.name)
            .flat_map(|k| k.names.iter().copied())
            .collect(),
    })
    .unwrap_or_else(|e| panic!("{e}"));
    libs.modules.insert(module.name, built);
    built
}

/// The library of a custom op's `source`, compiled on first use; `None` (after a skip line)
/// without a compiler.
#[cfg(feature = "emulation")]
fn custom_library(
    libs: &mut Libraries,
    source: &'static CudaSource,
) -> Result<Option<&'static Library>> {
    let key = std::ptr::from_ref(source) as usize;
    let mut slot = libs.custom.get(&key).copied();
    let built = build(&mut slot, || Source {
        name: source.name,
        source: source.source,
        kernels: source.kernels.iter().map(|k| k.name).collect(),
    })
    .map_err(|reason| Error::Device { op: "emulate", reason })?;
    libs.custom.insert(key, built);
    Ok(built)
}

/// Runs `kernel` of `library` over grid `(gx, gy)` of blocks of `bx` threads with `args`.
///
/// # Safety
///
/// `kernel` is exported by `library`, and `args` match its parameters in number and type;
/// every pointer among them covers what the kernel addresses.
unsafe fn run(library: &Library, kernel: &str, (gx, gy, bx): (u32, u32, u32), args: &[Arg]) -> i32 {
    if gx == 0 || gy == 0 {
        return 0;
    }
    let mut params: Vec<*mut c_void> = args
        .iter()
        .map(|a| match a {
            Arg::Ptr(v) | Arg::U64(v) => v as *const u64 as *mut c_void,
            Arg::I64(v) => v as *const i64 as *mut c_void,
            Arg::U32(v) => v as *const u32 as *mut c_void,
            Arg::F32(v) => v as *const f32 as *mut c_void,
            Arg::Conv(v) => v as *const _ as *mut c_void,
            Arg::Pool(v) => v as *const _ as *mut c_void,
            Arg::Div(v) => v as *const _ as *mut c_void,
        })
        .collect();
    // SAFETY: the symbols exist (generated for every kernel of the library) with these
    // signatures; `params` holds one pointer per parameter to a value of its type (the
    // caller's contract), alive for the call; the pointers the arguments carry are the
    // caller's contract, as on a GPU.
    unsafe {
        let launch: libloading::Symbol<'_, Launch> = library.lib.get(b"emu_launch").unwrap();
        let entry: libloading::Symbol<'_, Entry> =
            library.lib.get(format!("emu_{kernel}").as_bytes()).unwrap();
        launch(*entry, gx, gy, bx, params.as_mut_ptr())
    }
}

/// Launches `kernel` on the host as the GPU would (see the module doc). Panics on a launch
/// the GPU would refuse (arguments that do not match the registry, a 3-D grid or block).
/// Returns false (after a skip line) where no compiler is available.
#[cfg(test)]
pub(crate) fn launch(kernel: Instance, cfg: LaunchConfig, args: &[Arg]) -> bool {
    check_args(kernel, args).unwrap();
    let mut libs = libraries();
    let Some(library) = library(&mut libs, kernel.kernel.module) else { return false };
    let (gx, gy, gz) = cfg.grid_dim;
    let (bx, by, bz) = cfg.block_dim;
    assert!(
        gz == 1 && by == 1 && bz == 1,
        "{}: the kernels use 1-D blocks, 2-D grids",
        kernel.name
    );
    // SAFETY: the kernel's module exports it; the arguments match its registered parameters
    // (checked above, the registry against the kernel's declaration by the NVRTC test); the
    // pointers are the caller's contract.
    let status = unsafe { run(library, kernel.name, (gx, gy, bx), args) };
    assert_eq!(status, 0, "{}: block of {bx}", kernel.name);
    true
}

/// Whether the host can build `source`'s emulation (compiling it now); `false` after a
/// `skipped: no C++ compiler` line.
#[cfg(feature = "emulation")]
pub(crate) fn compiler_available(source: &'static CudaSource) -> Result<bool> {
    Ok(custom_library(&mut libraries(), source)?.is_some())
}

/// Launches a custom op's `kernel` on the host over `grid` (checked by the caller).
///
/// # Safety
///
/// `args` match `kernel.params`; every pointer among them is a host address covering what
/// the kernel addresses.
#[cfg(feature = "emulation")]
pub(crate) unsafe fn launch_custom(
    source: &'static CudaSource,
    kernel: &CudaKernel,
    grid: Grid,
    args: &[KernelArg],
) -> Result<()> {
    let args: Vec<Arg> = args.iter().map(|&a| a.into()).collect();
    let mut libs = libraries();
    let Some(library) = custom_library(&mut libs, source)? else {
        return Err(Error::Device { op: "emulate", reason: "no C++ compiler".into() });
    };
    // SAFETY: the library exports every declared kernel; the caller's contract covers the
    // arguments.
    let status =
        unsafe { run(library, kernel.name, (grid.blocks.0, grid.blocks.1, grid.threads), &args) };
    if status != 0 {
        return Err(Error::InvalidArgument {
            op: "emulate",
            reason: format!("{}: the emulation refused a block of {}", kernel.name, grid.threads),
        });
    }
    Ok(())
}

#[cfg(test)]
/// A device pointer to `v`'s elements (a host address here).
pub(crate) fn ptr<T>(v: &mut [T]) -> Arg {
    Arg::Ptr(v.as_mut_ptr() as u64)
}

#[cfg(test)]
/// An op's CUDA code on the host, as an [`Exec`]: kernels through [`launch`], products by
/// the definition of [`MatmulSpec`] (row-major layouts, f64 sums rounded once to C's
/// dtype), memsets by writing zeros. What it checks is the op's side of the contract: which
/// kernels it launches on which addresses, its products' shapes, transposes and strides, and
/// whether its workspaces are large enough and laid out as the kernels read them. Whether
/// [`Gpu::gemm`](super::Gpu::gemm) maps a spec onto cuBLAS correctly is the matmul tests'
/// business on a GPU.
pub(crate) struct Emulator(());

#[cfg(test)]
impl Emulator {
    /// The emulation of `probe`'s module, or `None` (after a skip line) where no C++
    /// compiler can build it.
    pub(crate) fn new(probe: Instance) -> Option<Emulator> {
        library(&mut libraries(), probe.kernel.module).map(|_| Emulator(()))
    }
}

#[cfg(test)]
/// Element `i` of the `dtype` array at `p`.
///
/// # Safety
///
/// `p` must be the host address of at least `i + 1` elements of `dtype`.
unsafe fn load(p: u64, dtype: DType, i: usize) -> f64 {
    // SAFETY: the caller's contract.
    unsafe {
        match dtype {
            DType::F32 => f64::from(*(p as *const f32).add(i)),
            DType::F16 => (*(p as *const f16).add(i)).to_f64(),
            DType::BF16 => (*(p as *const bf16).add(i)).to_f64(),
        }
    }
}

#[cfg(test)]
/// Writes `v` (rounded to `dtype`) to element `i` of the `dtype` array at `p`.
///
/// # Safety
///
/// `p` must be the host address of at least `i + 1` writable elements of `dtype`.
unsafe fn store(p: u64, dtype: DType, i: usize, v: f64) {
    // SAFETY: the caller's contract.
    unsafe {
        match dtype {
            DType::F32 => *(p as *mut f32).add(i) = v as f32,
            DType::F16 => *(p as *mut f16).add(i) = f16::from_f64(v),
            DType::BF16 => *(p as *mut bf16).add(i) = bf16::from_f64(v),
        }
    }
}

#[cfg(test)]
impl Exec for Emulator {
    unsafe fn launch(&self, kernel: Instance, cfg: LaunchConfig, args: &[Arg]) -> Result<()> {
        if launch(kernel, cfg, args) {
            Ok(())
        } else {
            Err(Error::Device { op: "emulate", reason: "no C++ compiler".into() })
        }
    }

    unsafe fn gemm(
        &self,
        s: &MatmulSpec,
        a: u64,
        b: u64,
        c: u64,
        ab: DType,
        c_type: DType,
    ) -> Result<()> {
        let (m, n, k) = (s.m, s.n, s.k);
        for batch in 0..s.batch {
            let (a0, b0, c0) = (batch * s.stride_a, batch * s.stride_b, batch * s.stride_c);
            for i in 0..m {
                for j in 0..n {
                    let mut sum = 0.0f64;
                    for l in 0..k {
                        let ai = if s.trans_a { l * m + i } else { i * k + l };
                        let bi = if s.trans_b { j * k + l } else { l * n + j };
                        // SAFETY: the caller's contract: A and B hold a_len() and b_len()
                        // elements of `ab`.
                        sum += unsafe { load(a, ab, a0 + ai) * load(b, ab, b0 + bi) };
                    }
                    let ci = c0 + i * n + j;
                    let mut v = f64::from(s.alpha) * sum;
                    if s.beta != 0.0 {
                        // SAFETY: C holds c_len() elements of `c_type`.
                        v += f64::from(s.beta) * unsafe { load(c, c_type, ci) };
                    }
                    // SAFETY: as above.
                    unsafe { store(c, c_type, ci, v) };
                }
            }
        }
        Ok(())
    }

    fn zero(&self, dst: u64, bytes: usize) -> Result<()> {
        // SAFETY: `dst` is the host address of `bytes` writable bytes (the caller's buffer,
        // as a device allocation on a GPU).
        unsafe { std::ptr::write_bytes(dst as *mut u8, 0, bytes) };
        Ok(())
    }
}
