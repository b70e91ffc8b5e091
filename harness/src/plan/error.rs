//! What can go wrong when planning.

use vram_alloc::human_bytes;

/// A planning error. Every variant but [`PlanError::Run`] and [`PlanError::DataParallel`]
/// is bad input (`cargo xtask plan`
/// exits with status 2 on them).
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// A model name that is not known.
    #[error(
        "unknown model `{name}`; known models: {known}; or describe your own with --model-file"
    )]
    UnknownModel {
        /// The name given.
        name: String,
        /// The known names, comma-separated.
        known: String,
    },
    /// A size that could not be parsed ([`crate::parse_size`]'s message, the one every
    /// command gives).
    #[error("{what}: {message}")]
    MalformedSize {
        /// The option.
        what: &'static str,
        /// The text given.
        input: String,
        /// What is wrong with it.
        message: String,
    },
    /// An argument outside its domain (zero batch, an override a model has no use for, ...).
    #[error("invalid {what}: {reason}")]
    InvalidArgument {
        /// The argument.
        what: &'static str,
        /// Why.
        reason: String,
    },
    /// The device cannot even hold the parameters.
    #[error(
        "the model's parameters alone ({}: {params} parameters in {dtype}) exceed the device ({} usable: {} device memory minus {} reserve); ZeRO-3 shards them over several GPUs: about {gpus} GPUs of this size hold its model states (try --gpus {gpus})",
        human_bytes(*param_bytes), human_bytes(*usable), human_bytes(*device_memory), human_bytes(*reserve)
    )]
    DeviceTooSmall {
        /// Number of parameters.
        params: u64,
        /// Their bytes in the smallest precision asked for.
        param_bytes: u64,
        /// That precision.
        dtype: &'static str,
        /// Usable bytes.
        usable: u64,
        /// Device memory.
        device_memory: u64,
        /// Reserve.
        reserve: u64,
        /// GPUs of this size that hold the model states under ZeRO-3 (16 bytes per
        /// parameter, sharded).
        gpus: u64,
    },
    /// A model file that cannot be used.
    #[error("{0}")]
    ModelFile(#[from] crate::models::spec::SpecError),
    /// Allocator settings that do not parse.
    #[error("invalid allocator settings: {0}")]
    AllocatorSettings(#[from] vram_alloc::ConfigError),
    /// The device could not be opened, or capped, under the allocator settings (a backend
    /// that cannot honour them, no CUDA device).
    #[error("invalid allocator settings: {0}")]
    Device(#[source] vram_kernels::Error),
    /// A training step failed for another reason than running out of memory.
    #[error("{context}: {source}")]
    Run {
        /// What was being run.
        context: String,
        /// The error.
        source: Box<vram_accum::Error>,
    },
    /// A data-parallel run (`--nproc`) failed.
    #[error("data parallel run: {0}")]
    DataParallel(#[source] vram_parallel::DistError),
}

impl PlanError {
    /// Whether the error is the user's input (exit status 2) rather than a failure.
    pub fn is_bad_input(&self) -> bool {
        !matches!(self, PlanError::Run { .. } | PlanError::DataParallel(_))
    }

    /// Whether the error is an out-of-memory error (a step or a device that ran out), seen
    /// through [`PlanError::Run`] and [`PlanError::Device`].
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            PlanError::Run { source, .. } => source.is_out_of_memory(),
            PlanError::Device(e) => e.is_out_of_memory(),
            PlanError::DataParallel(e) => e.is_out_of_memory(),
            _ => false,
        }
    }
}
