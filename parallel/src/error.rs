//! The error type of data-parallel training.

use crate::comm::CommError;

/// Everything a data-parallel step can fail with. An out-of-memory error on a rank stays
/// [`DistError::Kernel`] with [`vram_kernels::Error::OutOfMemory`] on that rank; the other
/// ranks get [`DistError::Comm`] with [`CommError::Aborted`] naming it.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// A collective failed, or another rank aborted the group.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A tensor op failed on this rank (out of memory keeps its variant).
    #[error(transparent)]
    Kernel(#[from] vram_kernels::Error),
    /// The optimizer failed on this rank.
    #[error(transparent)]
    Amp(#[from] vram_amp::Error),
    /// The replica (the model) failed for a reason other than a tensor op.
    #[error("replica: {0}")]
    Replica(String),
    /// A setting or an input that data parallelism cannot use (a batch that does not
    /// split evenly, devices of different kinds, no ranks).
    #[error("data parallel: {0}")]
    Invalid(String),
    /// Processes of a local job failed (see [`launch`](crate::launch)); the launcher
    /// stopped the others.
    #[error("{}; the other ranks were stopped", failed.iter().map(|(r, s)| format!("rank {r} failed ({s})")).collect::<Vec<_>>().join(", "))]
    RankFailed {
        /// The rank(s) found failed at the same check, with how they ended.
        failed: Vec<(usize, String)>,
    },
    /// A local job could not be started or ran too long.
    #[error("launch: {0}")]
    Launch(String),
}

impl DistError {
    /// Whether the error is (or reports, from another rank) an out-of-memory error.
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            DistError::Kernel(e) => e.is_out_of_memory(),
            DistError::Amp(e) => e.is_out_of_memory(),
            DistError::Comm(CommError::Aborted { reason, .. }) => reason.contains("out of memory"),
            _ => false,
        }
    }
}
