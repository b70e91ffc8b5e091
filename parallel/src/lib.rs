//! Data parallelism for vram: N replicas on N devices, each with its own caching allocator,
//! trained as PyTorch's `DistributedDataParallel` (bucketed gradient all-reduce), as
//! DeepSpeed's ZeRO stages 1, 2 and 3, or as `nn.DataParallel` (outputs and loss on
//! device 0).
//!
//! Communication is behind [`Collective`] (tensors) with three backends:
//! [`HostCollective`] for host devices (values through a [`Communicator`]: the in-process
//! [`InProcessGroup`], one thread per rank, or [`TcpComm`], one process per rank),
//! [`VirtualCollective`] for virtual devices (moves no values; every buffer a real
//! collective needs is still allocated, so memory figures hold at real sizes), and
//! `NcclCollective` for CUDA devices (feature `cuda`; one process or, by rendezvous, one
//! process per GPU). A failed rank (out of memory, a dead process) aborts the group: every
//! rank gets an error naming it, none hangs.
//!
//! Multi-process jobs follow torchrun's conventions ([`ProcessGroupConfig::from_env`]);
//! [`launch`] starts one on this machine (`cargo xtask launch`), and each process runs its
//! rank with [`train_rank`].
//!
//! ```
//! use std::time::Duration;
//! use vram_parallel::{Communicator, InProcessGroup, ReduceOp};
//!
//! let comms = InProcessGroup::connect(2, Duration::from_secs(10)).unwrap();
//! let handles: Vec<_> = comms
//!     .into_iter()
//!     .map(|c| {
//!         std::thread::spawn(move || {
//!             let mut x = vec![c.rank() as f32 + 1.0; 3];
//!             c.all_reduce(&mut x, ReduceOp::Average).unwrap();
//!             x
//!         })
//!     })
//!     .collect();
//! for h in handles {
//!     assert_eq!(h.join().unwrap(), vec![1.5; 3]);
//! }
//! ```

mod bucket;
mod collective;
mod comm;
mod error;
mod in_process;
pub mod launch;
mod metered;
#[cfg(feature = "cuda")]
mod nccl;
mod process_group;
mod replica;
mod shard;
mod tcp;
mod trainer;

pub use bucket::{BucketPlan, DEFAULT_BUCKET_CAP_BYTES};
pub use collective::{Collective, HostCollective, VirtualCollective};
pub use comm::{CommError, Communicator, ReduceOp, Traffic};
pub use error::DistError;
pub use in_process::{InProcessComm, InProcessGroup};
pub use metered::{Metered, ring_bytes_per_param};
#[cfg(feature = "cuda")]
pub use nccl::{NCCL_MISSING, NcclCollective};
pub use process_group::{DEFAULT_TIMEOUT, ProcessGroupConfig, TIMEOUT_VAR};
pub use replica::{GroupHooks, NoHooks, Pass, Replica};
pub use tcp::TcpComm;
pub use trainer::{DpConfig, RankReport, RankTrainer, Strategy, train, train_rank};
