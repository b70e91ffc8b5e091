//! Choosing the backend experiments run on.

use crate::HarnessError;

/// The backend asked for on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum BackendChoice {
    /// CUDA when a usable GPU is present, else the host.
    #[default]
    Auto,
    /// The host backend, with a simulated device capacity.
    Cpu,
    /// A CUDA device; an error when none is usable.
    Cuda,
}

/// The backend experiments actually run on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Host memory and CPU compute.
    Cpu,
    /// CUDA device 0.
    Cuda {
        /// The device's name, then which code runs its convolutions, batch norms and linear
        /// layers (`convolutions: cuDNN 9.14.0; batch norm: cuDNN 9.14.0 where PyTorch uses
        /// it; linear layers: cuBLASLt (bias and GELU epilogues)`).
        name: String,
        /// Its total memory in bytes.
        total_bytes: u64,
    },
}

impl Backend {
    /// `"cpu"` or `"cuda"`, as written in results files.
    pub fn tag(&self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda { .. } => "cuda",
        }
    }
}

/// Resolves a choice to a backend. `Auto` falls back to the host and says why in `note`.
pub fn resolve(choice: BackendChoice, note: &mut dyn FnMut(&str)) -> Result<Backend, HarnessError> {
    match choice {
        BackendChoice::Cpu => Ok(Backend::Cpu),
        BackendChoice::Cuda => cuda().map_err(|reason| HarnessError::CudaUnavailable { reason }),
        BackendChoice::Auto => match cuda() {
            Ok(b) => Ok(b),
            Err(reason) => {
                note(&format!("no usable CUDA device ({reason}); using the host backend"));
                Ok(Backend::Cpu)
            }
        },
    }
}

/// Which code runs `device`'s convolutions, batch norms and linear layers, in words. Batch
/// norms take cuDNN only where PyTorch does (f32, or f16 with f32 parameters, 3 to 5
/// dimensions), the own kernels elsewhere.
pub(crate) fn kernel_paths(device: &vram_kernels::Device) -> String {
    let bn = device.batch_norm_path();
    let where_ = if matches!(bn, vram_kernels::ConvPath::Cudnn { .. }) {
        " where PyTorch uses it"
    } else {
        ""
    };
    let why_not_lt = device.cublaslt_missing().map(|why| format!(": {why}")).unwrap_or_default();
    format!(
        "convolutions: {}; batch norm: {bn}{where_}; linear layers: {}{why_not_lt}",
        device.conv_path(),
        device.linear_path()
    )
}

#[cfg(feature = "cuda")]
fn cuda() -> Result<Backend, String> {
    let info = vram_alloc::cuda::probe(0)?;
    // The name says which libraries run the convolutions and linear layers (cuDNN and its
    // version or the own kernels, cuBLASLt or cuBLAS), so every results file and the report
    // name the path their figures came from.
    let device = vram_kernels::Device::cuda(0).map_err(|e| e.to_string())?;
    let name = format!("{}, {}", info.name, kernel_paths(&device));
    Ok(Backend::Cuda { name, total_bytes: info.total_bytes as u64 })
}

#[cfg(not(feature = "cuda"))]
fn cuda() -> Result<Backend, String> {
    Err("this build has no CUDA support (built without the `cuda` feature)".into())
}
