//! The kernel registry: `.cu` sources compiled with NVRTC on first use, once per device, and
//! their functions cached by name (the shape of candle's `get_or_load_func`).

use super::driver_error;
use crate::error::{Error, Result};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{CompileError, CompileOptions, compile_ptx_with_opts};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// Helpers every module uses (type conversions, block reductions), prepended to each source.
const COMMON: &str = include_str!("kernels/common.cuh");

/// One `.cu` source: a unit of compilation.
#[derive(Debug)]
pub(crate) struct Module {
    name: &'static str,
    source: &'static str,
}

/// Fill, arithmetic, activations, casts, bias broadcast.
pub(crate) const ELEMENTWISE: Module =
    Module { name: "elementwise", source: include_str!("kernels/elementwise.cu") };
/// Whole-tensor, row and column sums.
pub(crate) const REDUCE: Module =
    Module { name: "reduce", source: include_str!("kernels/reduce.cu") };
/// Softmax, cross-entropy, layer norm.
pub(crate) const SOFTMAX: Module =
    Module { name: "softmax", source: include_str!("kernels/softmax.cu") };
/// im2col / col2im and the depthwise convolution.
pub(crate) const CONV: Module = Module { name: "conv", source: include_str!("kernels/conv.cu") };
/// Max and average pooling.
pub(crate) const POOL: Module = Module { name: "pool", source: include_str!("kernels/pool.cu") };
/// Embedding, dropout, optimizers, unscale.
pub(crate) const MISC: Module = Module { name: "misc", source: include_str!("kernels/misc.cu") };

/// Compiled modules and loaded functions of one device.
#[derive(Debug)]
pub(crate) struct Registry {
    /// `--gpu-architecture=compute_XY` for the device's compute capability.
    arch: String,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    functions: Mutex<HashMap<String, CudaFunction>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The maps are only ever inserted into; a panic elsewhere cannot leave them inconsistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Registry {
    /// An empty registry for a device of compute capability `major.minor`.
    pub(crate) fn new(major: i32, minor: i32) -> Registry {
        Registry {
            arch: format!("--gpu-architecture=compute_{major}{minor}"),
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
        }
    }

    /// The function `name` of `module`, compiling and loading the module on first use.
    pub(crate) fn function(
        &self,
        ctx: &Arc<CudaContext>,
        module: &'static Module,
        name: &str,
    ) -> Result<CudaFunction> {
        let key = format!("{}::{name}", module.name);
        if let Some(f) = lock(&self.functions).get(&key) {
            return Ok(f.clone());
        }
        let loaded = self.module(ctx, module)?;
        let f = loaded.load_function(name).map_err(|e| Error::Device {
            op: "kernel lookup",
            reason: format!("no kernel `{name}` in module `{}`: {e}", module.name),
        })?;
        lock(&self.functions).insert(key, f.clone());
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
        let source = format!("{COMMON}\n{}", module.source);
        // fmad off: products and sums round separately, as on the host, so elementwise
        // results match the CPU reference bit for bit (these kernels are memory-bound; the
        // matmuls go through cuBLAS).
        let opts = CompileOptions {
            fmad: Some(false),
            options: vec![self.arch.clone()],
            name: Some(format!("{}.cu", module.name)),
            ..Default::default()
        };
        let ptx = compile_ptx_with_opts(source, opts).map_err(|e| compile_error(module, e))?;
        let loaded = ctx.load_module(ptx).map_err(driver_error("cuModuleLoadData"))?;
        modules.insert(module.name, Arc::clone(&loaded));
        Ok(loaded)
    }
}

fn compile_error(module: &Module, e: CompileError) -> Error {
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
