//! The harness's error type.

use std::path::PathBuf;
use vram_alloc::human_bytes;

/// `bytes` as `--device-memory` takes it: `256GiB`, or plain bytes.
fn size_arg(bytes: u64) -> String {
    for (shift, unit) in [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// What can go wrong when running experiments.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// An experiment id that does not exist.
    #[error("unknown experiment id `{id}`; the ids are: {known}")]
    UnknownExperiment {
        /// The id given.
        id: String,
        /// Every valid id, comma-separated.
        known: String,
    },
    /// An experiment id given twice.
    #[error("experiment id `{id}` is given twice; give each id once")]
    DuplicateExperiment {
        /// The id given twice.
        id: String,
    },
    /// A size argument that could not be parsed.
    #[error("malformed size `{input}`: {reason} (e.g. `4GiB`)")]
    MalformedSize {
        /// The text given.
        input: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A simulated device capacity that an experiment cannot run with on the host.
    #[error(
        "experiment `{id}` simulates at most {} on the host backend, asked for {}: {why}; pass --device-memory {} or less, or leave `{id}` out of --only",
        human_bytes(*limit), human_bytes(*capacity), size_arg(*limit)
    )]
    CapacityTooLarge {
        /// The experiment.
        id: String,
        /// The capacity asked for, in bytes.
        capacity: u64,
        /// The largest it runs with, in bytes.
        limit: u64,
        /// Why it has a limit.
        why: String,
    },
    /// The CUDA backend was asked for where it cannot run.
    #[error("the CUDA backend was requested but is not usable: {reason}")]
    CudaUnavailable {
        /// Why CUDA cannot be used.
        reason: String,
    },
    /// Writing results failed.
    #[error("cannot write {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// An earlier run that `--resume` cannot continue or `--report-only` cannot report.
    #[error("earlier bench run {path}: {reason}")]
    EarlierRun {
        /// The earlier run's `bench-run.json`.
        path: PathBuf,
        /// Why not.
        reason: String,
    },
    /// An experiment failed in the run whose results a report is rendered from.
    #[error("experiment `{id}` failed in the run that wrote these results: {error}")]
    EarlierFailure {
        /// The experiment id.
        id: String,
        /// The run's error, as it recorded it.
        error: String,
    },
    /// An experiment failed while running.
    #[error("experiment `{id}` failed: {source}")]
    Experiment {
        /// The experiment id.
        id: String,
        /// What went wrong.
        source: ExperimentError,
    },
}

/// What an experiment (or the [`Trainer`](crate::trainer::Trainer)) can fail with. Each
/// variant keeps the error it came from, so [`ExperimentError::is_out_of_memory`] sees an
/// out-of-memory error wherever it was raised: a layer, the loss scaler, an optimizer step,
/// the allocator, a data-parallel rank, the planner.
#[derive(Debug, thiserror::Error)]
pub enum ExperimentError {
    /// A layer, the executor, the planner or the accumulator failed.
    #[error(transparent)]
    Accum(vram_accum::Error),
    /// The loss scaler, an optimizer or gradient clipping failed.
    #[error(transparent)]
    Amp(#[from] vram_amp::Error),
    /// A tensor op failed.
    #[error(transparent)]
    Kernel(#[from] vram_kernels::Error),
    /// The allocator failed.
    #[error(transparent)]
    Alloc(#[from] vram_alloc::AllocError),
    /// The raw device memory backend failed (e.g. opening a CUDA device).
    #[error(transparent)]
    Device(#[from] vram_alloc::RawError),
    /// Allocator settings that do not parse.
    #[error(transparent)]
    Config(#[from] vram_alloc::ConfigError),
    /// A data-parallel run failed (on any rank: the first rank's own error).
    #[error(transparent)]
    Dist(#[from] vram_parallel::DistError),
    /// Planning or measuring a real-size model failed (an unknown model, a bad override, a
    /// step that failed).
    #[error(transparent)]
    Plan(#[from] crate::plan::PlanError),
    /// A model of the zoo could not be looked up or resized.
    #[error(transparent)]
    Zoo(#[from] crate::models::ZooError),
    /// The experiment cannot be set up as asked (a size out of range, a backend this build
    /// lacks).
    #[error("invalid setup: {0}")]
    Setup(String),
}

impl From<vram_accum::Error> for ExperimentError {
    /// Keeps an amp error an amp error and a tensor error a tensor error.
    fn from(e: vram_accum::Error) -> Self {
        match e {
            vram_accum::Error::Kernel(k) => ExperimentError::Kernel(k),
            vram_accum::Error::Amp(a) => ExperimentError::Amp(a),
            other => ExperimentError::Accum(other),
        }
    }
}

impl ExperimentError {
    /// Whether this is an out-of-memory error, wherever it was raised.
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            ExperimentError::Accum(e) => e.is_out_of_memory(),
            ExperimentError::Amp(e) => e.is_out_of_memory(),
            ExperimentError::Kernel(e) => e.is_out_of_memory(),
            ExperimentError::Alloc(e) => e.is_out_of_memory(),
            ExperimentError::Device(e) => matches!(e, vram_alloc::RawError::OutOfMemory { .. }),
            ExperimentError::Dist(e) => e.is_out_of_memory(),
            ExperimentError::Plan(e) => e.is_out_of_memory(),
            ExperimentError::Config(_) | ExperimentError::Zoo(_) | ExperimentError::Setup(_) => {
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::{Arch, Model, ZooError};
    use crate::plan::PlanError;
    use vram_kernels::{DType, Device};

    /// A real out-of-memory error: GPT-2 small's parameters on a 1 MiB virtual device.
    fn real_oom() -> vram_accum::Error {
        let device = Device::virtual_device(1 << 20);
        let arch = Arch::preset("gpt2-small").unwrap();
        let err = Model::new(&device, arch, 1, DType::F32).err().expect("1 MiB cannot hold it");
        assert!(err.is_out_of_memory(), "{err}");
        err
    }

    #[test]
    fn a_plan_error_that_is_an_oom_stays_an_oom_through_experiment_error() {
        let plan =
            PlanError::Run { context: "gpt2-small on 1 MiB".into(), source: Box::new(real_oom()) };
        assert!(plan.is_out_of_memory());
        let text = plan.to_string();
        let setup = || -> Result<(), ExperimentError> { Err(plan)? };
        let err = setup().unwrap_err();
        assert!(matches!(err, ExperimentError::Plan(PlanError::Run { .. })), "{err:?}");
        assert!(err.is_out_of_memory(), "{err}");
        assert_eq!(err.to_string(), text, "transparent: the planner's message");
        // And one the planner raised as bad input is not an OOM.
        let bad = ExperimentError::from(PlanError::InvalidArgument {
            what: "batch",
            reason: "must be at least 1".into(),
        });
        assert!(!bad.is_out_of_memory(), "{bad}");
    }

    #[test]
    fn a_zoo_error_stays_typed_through_experiment_error() {
        let lookup = |name: &str| -> Result<Arch, ExperimentError> { Ok(Arch::preset(name)?) };
        let err = lookup("gpt5").unwrap_err();
        let ExperimentError::Zoo(ZooError::UnknownPreset { name, known }) = &err else {
            panic!("expected the zoo's error, got {err:?}");
        };
        assert_eq!(name, "gpt5");
        assert!(known.contains("gpt2-small"), "{known}");
        assert_eq!(err.to_string(), Arch::preset("gpt5").unwrap_err().to_string());
        assert!(!err.is_out_of_memory());
        let resize = || -> Result<Arch, ExperimentError> { Ok(Arch::preset("mlp")?.with_seq(8)?) };
        assert!(matches!(
            resize().unwrap_err(),
            ExperimentError::Zoo(ZooError::NotApplicable { setting: "seq", .. })
        ));
    }
}
