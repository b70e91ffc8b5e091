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
    /// A group was asked for with no ranks, or a root outside the group; a process group
    /// whose settings (environment variables) are missing or malformed.
    #[error("invalid group argument: {0}")]
    Invalid(String),
    /// Rank 0 cannot listen at the rendezvous address (`MASTER_ADDR:MASTER_PORT`).
    #[error(
        "rank 0 cannot listen on {addr}: {reason}; if the port is taken (another job, or a \
         previous run still exiting), pick another MASTER_PORT"
    )]
    Listen {
        /// The address.
        addr: String,
        /// The operating system's reason.
        reason: String,
    },
    /// A rank could not reach rank 0 at the rendezvous address in time.
    #[error(
        "rank {rank} could not reach rank 0 at {addr} within {waited:?} ({reason}); is rank 0 \
         running, with the same MASTER_ADDR and MASTER_PORT?"
    )]
    Unreachable {
        /// The rank that tried.
        rank: usize,
        /// The address.
        addr: String,
        /// How long it tried.
        waited: std::time::Duration,
        /// The last error.
        reason: String,
    },
    /// Ranks never arrived at the rendezvous.
    #[error(
        "rendezvous at {addr}: rank(s) {missing:?} of {world_size} did not arrive within {waited:?}"
    )]
    MissingRanks {
        /// The ranks that did not arrive.
        missing: Vec<usize>,
        /// The group's size.
        world_size: usize,
        /// The address.
        addr: String,
        /// How long rank 0 waited.
        waited: std::time::Duration,
    },
    /// A rank was started with another world size than rank 0 (or a rank outside it).
    #[error(
        "rank {rank} says WORLD_SIZE={world_size}, rank 0 says WORLD_SIZE={expected}: every \
         process of a job must be started with the same WORLD_SIZE and distinct RANKs below it"
    )]
    WorldSizeMismatch {
        /// The rank that disagrees.
        rank: usize,
        /// Its world size.
        world_size: usize,
        /// Rank 0's.
        expected: usize,
    },
    /// A rank's connection closed or failed: its process died or was killed.
    #[error("rank {rank} is gone during {op} ({reason}): its process died or was killed")]
    RankLost {
        /// The lost rank.
        rank: usize,
        /// What this rank was doing.
        op: String,
        /// The connection's error.
        reason: String,
    },
    /// A rank sent nothing for too long.
    #[error("rank {rank} sent nothing for {op} within {waited:?} (hung, or far behind)")]
    Timeout {
        /// The silent rank.
        rank: usize,
        /// The collective.
        op: String,
        /// How long this rank waited.
        waited: std::time::Duration,
    },
    /// A rank sent something the protocol does not allow: another collective than this
    /// rank's, a duplicate rank, or bytes that are not vram's (another program on the port).
    #[error("rank {rank}: {reason}")]
    Protocol {
        /// The rank at fault (as far as this rank can tell).
        rank: usize,
        /// What was wrong.
        reason: String,
    },
}

/// Bytes a rank's collectives moved: on the wire for the TCP backend
/// ([`TcpComm`](crate::TcpComm)), as a ring would move them for [`Metered`](crate::Metered).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Bytes this rank sent.
    pub sent: u64,
    /// Bytes this rank received.
    pub received: u64,
    /// Collective calls.
    pub calls: u64,
}

impl Traffic {
    /// `self - earlier` (the traffic between two readings).
    pub fn since(self, earlier: Traffic) -> Traffic {
        Traffic {
            sent: self.sent.saturating_sub(earlier.sent),
            received: self.received.saturating_sub(earlier.received),
            calls: self.calls.saturating_sub(earlier.calls),
        }
    }
}

/// The element-wise combination of every rank's `range` of `all`, summed in rank order from
/// zero (then divided by the number of ranks for an average): every host backend reduces so,
/// which makes them agree bit for bit.
pub(crate) fn reduce_in_rank_order(
    all: &[&[f32]],
    range: std::ops::Range<usize>,
    op: ReduceOp,
    out: &mut [f32],
) {
    out.fill(0.0);
    for v in all {
        for (o, x) in out.iter_mut().zip(&v[range.clone()]) {
            *o += x;
        }
    }
    if op == ReduceOp::Average {
        let n = all.len() as f32;
        out.iter_mut().for_each(|o| *o /= n);
    }
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
    /// What this rank's collectives moved so far, where the transport counts it (the TCP
    /// backend does; the in-process group moves nothing over a wire and says `None`).
    fn traffic(&self) -> Option<Traffic> {
        None
    }
}
