//! Compiled modules and loaded functions of one device: each `.cu` module is compiled with
//! NVRTC on first use in the process (its PTX then cached for every device of the process),
//! loaded into the device's context once, and its functions are cached by their static names
//! (the shape of candle's `get_or_load_func`).

use super::driver_error;
use super::registry::{COMMON, Instance, Module};
use crate::custom::CudaSource as CustomSource;
use crate::error::{Error, Result};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{CompileError, CompileOptions, Ptx, compile_ptx_with_opts};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// The NVRTC options every module is compiled with, for `--gpu-architecture=<arch>`.
///
/// fmad off: products and sums round separately, as on the host, so elementwise results
/// match the CPU reference bit for bit (these kernels are memory-bound; the matmuls go
/// through cuBLAS).
pub(crate) fn compile_options(module: &Module, arch: &str) -> CompileOptions {
    CompileOptions {
        fmad: Some(false),
        options: vec![format!("--gpu-architecture={arch}")],
        name: Some(format!("{}.cu", module.name)),
        ..Default::default()
    }
}

/// The full source NVRTC compiles for `module`: the common helpers, then the module.
pub(crate) fn full_source(module: &Module) -> String {
    format!("{COMMON}\n{}", module.source)
}

/// Compiled modules and loaded functions of one device.
#[derive(Debug)]
pub(crate) struct Loader {
    /// `compute_XY` for the device's compute capability.
    arch: String,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    /// Keyed by the instance's static name (names are unique across modules), with the
    /// dynamic shared memory the function was opted in to.
    functions: Mutex<HashMap<&'static str, (CudaFunction, u32)>>,
    /// Custom ops' functions, keyed by their source's address and the kernel's name (a
    /// custom kernel may share a name with one of this crate's, or of another source).
    custom: Mutex<HashMap<(usize, &'static str), CudaFunction>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The maps are only ever inserted into; a panic elsewhere cannot leave them inconsistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Loader {
    /// An empty cache for a device of compute capability `major.minor`.
    pub(crate) fn new(major: i32, minor: i32) -> Loader {
        Loader {
            arch: format!("compute_{major}{minor}"),
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            custom: Mutex::new(HashMap::new()),
        }
    }

    /// The function of `kernel`, compiling and loading its module on first use, and opted in
    /// to `shared` bytes of dynamic shared memory a launch where it was not yet
    /// (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`: without it a launch whose static and
    /// dynamic shared memory pass 48 KiB fails). Only kernels that ask for dynamic shared
    /// memory pay the attribute call, once.
    pub(crate) fn function(
        &self,
        ctx: &Arc<CudaContext>,
        kernel: Instance,
        shared: u32,
    ) -> Result<CudaFunction> {
        let known = lock(&self.functions).get(kernel.name).cloned();
        let (f, opted) = match known {
            Some((f, opted)) if shared <= opted => return Ok(f),
            Some(known) => known,
            None => {
                let module = kernel.kernel.module;
                let loaded = self.module(ctx, module)?;
                let f = loaded.load_function(kernel.name).map_err(|e| Error::Device {
                    op: "kernel lookup",
                    reason: format!("no kernel `{}` in module `{}`: {e}", kernel.name, module.name),
                })?;
                (f, 0)
            }
        };
        if shared > opted {
            let bytes = i32::try_from(shared).unwrap_or(i32::MAX);
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes,
            )
            .map_err(|e| Error::Device {
                op: "cuFuncSetAttribute",
                reason: format!(
                    "{}: {shared} B of dynamic shared memory (MAX_DYNAMIC_SHARED_SIZE_BYTES): {e}",
                    kernel.name
                ),
            })?;
        }
        lock(&self.functions).insert(kernel.name, (f.clone(), shared.max(opted)));
        Ok(f)
    }

    /// Compiles (NVRTC) and loads `module` once; later calls return the loaded module.
    pub(crate) fn module(
        &self,
        ctx: &Arc<CudaContext>,
        module: &'static Module,
    ) -> Result<Arc<CudaModule>> {
        let mut modules = lock(&self.modules);
        if let Some(m) = modules.get(module.name) {
            return Ok(Arc::clone(m));
        }
        let ptx = compiled(module, &self.arch)?;
        let loaded = ctx.load_module(ptx).map_err(driver_error("cuModuleLoadData"))?;
        modules.insert(module.name, Arc::clone(&loaded));
        Ok(loaded)
    }
}

/// The PTX of this crate's `module` for `arch`, compiled by NVRTC once per process: a fresh
/// [`Device`](crate::Device) per measurement (how the bench, the planner's `--verify` and the
/// twin work) loads the cached PTX into its context instead of compiling every module again.
/// Module names are unique across the registry; custom ops' sources are cached per device.
fn compiled(module: &'static Module, arch: &str) -> Result<Ptx> {
    type Cache = Mutex<HashMap<(&'static str, String), Ptx>>;
    static PTX: OnceLock<Cache> = OnceLock::new();
    let cache = PTX.get_or_init(Cache::default);
    let key = (module.name, arch.to_string());
    if let Some(ptx) = lock(cache).get(&key) {
        return Ok(ptx.clone());
    }
    // Compiled outside the lock: two devices compiling one module at once both finish, and
    // the second insert replaces an identical PTX.
    let ptx = compile_ptx_with_opts(full_source(module), compile_options(module, arch))
        .map_err(|e| compile_error(module, e))?;
    #[cfg(test)]
    {
        let mut counts = lock(&COMPILATIONS);
        match counts.iter_mut().find(|(k, _)| *k == key) {
            Some((_, n)) => *n += 1,
            None => counts.push((key.clone(), 1)),
        }
    }
    lock(cache).insert(key, ptx.clone());
    Ok(ptx)
}

/// NVRTC compilations by [`compiled`] in this test process, per module and architecture.
#[cfg(test)]
static COMPILATIONS: Mutex<Vec<((&'static str, String), usize)>> = Mutex::new(Vec::new());

impl Loader {
    /// The function `kernel` of a custom op's `source`, compiling and loading the source on
    /// first use (one module per source).
    pub(crate) fn custom_function(
        &self,
        ctx: &Arc<CudaContext>,
        source: &'static CustomSource,
        kernel: &'static str,
    ) -> Result<CudaFunction> {
        let key = (std::ptr::from_ref(source) as usize, kernel);
        let mut functions = lock(&self.custom);
        if let Some(f) = functions.get(&key) {
            return Ok(f.clone());
        }
        let module = Module { name: source.name, source: source.source };
        let ptx = compile_ptx_with_opts(full_source(&module), compile_options(&module, &self.arch))
            .map_err(|e| compile_error(&module, e))?;
        let loaded = ctx.load_module(ptx).map_err(driver_error("cuModuleLoadData"))?;
        // Every declared kernel of the module at once: one compilation per source.
        for k in source.kernels {
            let f = loaded.load_function(k.name).map_err(|e| Error::Device {
                op: "kernel lookup",
                reason: format!("no kernel `{}` in the CUDA source `{}`: {e}", k.name, source.name),
            })?;
            functions.insert((key.0, k.name), f);
        }
        functions.get(&key).cloned().ok_or_else(|| Error::Device {
            op: "kernel lookup",
            reason: format!("`{kernel}` is not declared by the CUDA source `{}`", source.name),
        })
    }
}

/// An NVRTC failure on `module` as this crate's error, with the compiler's log.
pub(crate) fn compile_error(module: &Module, e: CompileError) -> Error {
    let reason = match e {
        CompileError::CompileError { nvrtc, options, log } => format!(
            "NVRTC could not compile {}.cu ({nvrtc:?}, options {options:?}):\n{}",
            module.name,
            log.to_string_lossy()
        ),
        other => format!("NVRTC failed on {}.cu: {other:?}", module.name),
    };
    Error::Device { op: "nvrtc", reason }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compilations(module: &Module, arch: &str) -> usize {
        let counts = lock(&COMPILATIONS);
        counts.iter().find(|((m, a), _)| *m == module.name && a == arch).map_or(0, |c| c.1)
    }

    /// NVRTC runs once per module and architecture in a process, whatever the number of
    /// devices asking (skips where libnvrtc is missing, as the NVRTC test does).
    #[test]
    fn a_module_is_compiled_once_per_process_and_architecture() {
        let module = super::super::registry::MODULES[0];
        let first = match compiled(module, "compute_89") {
            Ok(p) => p,
            Err(e) => {
                eprintln!("skipped: NVRTC unavailable ({e})");
                return;
            }
        };
        let again = compiled(module, "compute_89").unwrap();
        assert_eq!(compilations(module, "compute_89"), 1, "compiled again");
        assert_eq!(format!("{first:?}"), format!("{again:?}"));
        // Another architecture is another PTX.
        compiled(module, "compute_87").unwrap();
        assert_eq!(compilations(module, "compute_87"), 1);
    }
}
