//! The harness's error type.

use std::path::PathBuf;

/// What can go wrong when running experiments.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// An experiment id that does not exist.
    #[error("unknown experiment id `{id}`; `cargo xtask bench --list` shows the valid ids")]
    UnknownExperiment {
        /// The id given.
        id: String,
    },
    /// A size argument that could not be parsed.
    #[error(
        "malformed size `{input}`: expected a number with an optional unit (B, KiB, MiB, GiB, KB, MB, GB), e.g. `4GiB`"
    )]
    MalformedSize {
        /// The text given.
        input: String,
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
    /// An experiment failed while running.
    #[error("experiment `{id}` failed: {message}")]
    Experiment {
        /// The experiment id.
        id: String,
        /// What went wrong.
        message: String,
    },
}
