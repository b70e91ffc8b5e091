//! Custom ops' kernels on a GPU ([`crate::custom`]): launches of a user's `.cu` source,
//! compiled with NVRTC on first use, and the NVRTC check of such a source against its
//! declared parameters (no GPU needed).

use super::CudaBackend;
use super::launch::Arg;
use super::loader::{compile_error, compile_options, full_source};
use super::registry::Module;
use crate::custom::{CudaKernel, CudaSource, Grid, KernelArg, KernelParam};
use crate::error::{Error, Result};
use cudarc::driver::LaunchConfig;
use cudarc::nvrtc::compile_ptx_with_opts;
use std::collections::BTreeMap;

impl CudaBackend {
    /// Launches `kernel` of `source` over `grid` on the device's stream.
    ///
    /// # Safety
    ///
    /// `args` match `kernel.params` (the caller checked) and every pointer among them is a
    /// live allocation of this device holding what the kernel addresses.
    pub(crate) unsafe fn launch_custom(
        &self,
        source: &'static CudaSource,
        kernel: &'static CudaKernel,
        grid: Grid,
        args: &[KernelArg],
    ) -> Result<()> {
        self.bind()?;
        let func = self.kernels.custom_function(&self.ctx, source, kernel.name)?;
        let cfg = LaunchConfig {
            grid_dim: (grid.blocks.0, grid.blocks.1, 1),
            block_dim: (grid.threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let args: Vec<Arg> = args.iter().map(|&a| a.into()).collect();
        // SAFETY: the arguments match the kernel's declared parameters (checked by the
        // caller; `check_with_nvrtc` checks the declaration against the PTX); the pointers
        // are the caller's contract.
        unsafe { self.launch_function(&func, cfg, &args, kernel.name) }
    }
}

/// See [`CudaSource::check_with_nvrtc`].
pub(crate) fn check_with_nvrtc(source: &'static CudaSource, arch: &str) -> Result<bool> {
    // SAFETY: only tries to open the library by its candidate names; no NVRTC call.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Ok(false);
    }
    let module = Module { name: source.name, source: source.source };
    let ptx = compile_ptx_with_opts(full_source(&module), compile_options(&module, arch))
        .map_err(|e| compile_error(&module, e))?;
    let entries =
        ptx_entries(&ptx.to_src()).map_err(|reason| Error::Device { op: "nvrtc", reason })?;
    let mismatch = |reason: String| Error::Device { op: "nvrtc", reason };
    for kernel in source.kernels {
        let Some(got) = entries.get(kernel.name) else {
            return Err(mismatch(format!(
                "{}: no kernel `{}` in the PTX (is it `extern \"C\" __global__`?); it defines {:?}",
                source.name,
                kernel.name,
                entries.keys().collect::<Vec<_>>()
            )));
        };
        let want: Vec<(String, usize)> =
            kernel.params.iter().map(|&p| ptx_of(p)).map(|(t, b)| (t.to_string(), b)).collect();
        if *got != want {
            return Err(mismatch(format!(
                "{}: `{}` takes {got:?} in the PTX, declared {:?}",
                source.name, kernel.name, kernel.params
            )));
        }
    }
    Ok(true)
}

/// How PTX declares a parameter of this type: its `.param` type and bytes.
fn ptx_of(p: KernelParam) -> (&'static str, usize) {
    match p {
        KernelParam::Ptr | KernelParam::U64 | KernelParam::I64 => ("u64", 8),
        KernelParam::U32 => ("u32", 4),
        KernelParam::F32 => ("f32", 4),
    }
}

/// The parameters of every `.entry` in `ptx`, as `(type, bytes)` pairs (also the NVRTC
/// check's reading of this crate's modules) (64-bit integers and
/// bit types as `u64`, 32-bit ones as `u32`, structs by value as `b8` with their size).
pub(crate) fn ptx_entries(ptx: &str) -> Result<BTreeMap<String, Vec<(String, usize)>>, String> {
    let mut entries = BTreeMap::new();
    let mut rest = ptx;
    while let Some(at) = rest.find(".entry ") {
        rest = &rest[at + ".entry ".len()..];
        let open = rest.find('(').ok_or("an .entry without a parameter list")?;
        let name = rest[..open].trim().to_string();
        let close = rest.find(')').ok_or("an unterminated parameter list")?;
        let params = rest[open + 1..close]
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|p| ptx_param(p).ok_or_else(|| format!("{name}: cannot read parameter `{p}`")))
            .collect::<Result<Vec<_>, _>>()?;
        entries.insert(name, params);
        rest = &rest[close..];
    }
    Ok(entries)
}

/// One PTX parameter declaration, e.g. `.param .u64 .ptr .align 4 f_param_0` or
/// `.param .align 8 .b8 f_param_2[128]`, as `(type, bytes)`.
fn ptx_param(decl: &str) -> Option<(String, usize)> {
    let words: Vec<&str> = decl.split_whitespace().collect();
    let ty = words.iter().skip(1).find(|w| {
        matches!(**w, ".u64" | ".s64" | ".b64" | ".u32" | ".s32" | ".b32" | ".f32" | ".b8")
    })?;
    let ty = ty.trim_start_matches('.');
    let bytes = match ty {
        "b8" => {
            let last = words.last()?;
            let open = last.find('[')?;
            last[open + 1..last.len() - 1].parse().ok()?
        }
        "u64" | "s64" | "b64" => 8,
        _ => 4,
    };
    let ty = match ty {
        "s64" | "b64" => "u64",
        "s32" | "b32" => "u32",
        other => other,
    };
    Some((ty.to_string(), bytes))
}
