//! The collective-communication trait every backend implements.

/// How an all-reduce or reduce-scatter combines the ranks' contributions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Element-wise sum over ranks.
    Sum,
    /// Element-wise sum divided by the number of ranks (DDP's gradient average).
    Average,
}

/// Errors of a collective.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CommError {
    /// The group was aborted, by this or another rank; every later collective fails too.
    #[error("communicator aborted by rank {by}: {reason}")]
    Aborted {
        /// The rank that aborted the group.
        by: usize,
        /// Why it did.
        reason: String,
    },
    /// The ranks' buffers do not fit the collective.
    #[error("{op}: rank {rank} passed {got} elements, expected {expected}")]
    LengthMismatch {
        /// The collective.
        op: &'static str,
        /// The offending rank.
        rank: usize,
        /// Elements it passed.
        got: usize,
        /// Elements the collective needed.
        expected: usize,
    },
    /// A group was asked for with no ranks, or a root outside the group.
    #[error("invalid group argument: {0}")]
    Invalid(String),
}

/// One rank's handle on a group of `world_size` ranks.
///
/// Every rank must call the same collectives in the same order (as with NCCL).
pub trait Communicator: Send {
    /// This rank, in `0..world_size()`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn world_size(&self) -> usize;
    /// Combines `buf` over all ranks, in place, on every rank.
    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError>;
    /// Reduces `input` (`world_size * output.len()` elements) over ranks; rank `r` receives
    /// the `r`-th chunk in `output`.
    fn reduce_scatter(
        &self,
        input: &[f32],
        output: &mut [f32],
        op: ReduceOp,
    ) -> Result<(), CommError>;
    /// Concatenates every rank's `input` in rank order into `output`
    /// (`world_size * input.len()` elements).
    fn all_gather(&self, input: &[f32], output: &mut [f32]) -> Result<(), CommError>;
    /// Copies `root`'s `buf` into every rank's `buf`.
    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<(), CommError>;
    /// Aborts the group: this and every other rank's pending and later collectives fail
    /// with [`CommError::Aborted`]. Call it when this rank fails (e.g. out of memory).
    fn abort(&self, reason: &str);
}
