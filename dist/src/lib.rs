//! Data parallelism for vram: collective communication between replicas.
//!
//! This first step provides the [`Communicator`] trait (all-reduce, reduce-scatter,
//! all-gather, broadcast) and an in-process backend, [`InProcessGroup`], in which each
//! rank is a thread. A failed rank (an error, a panic, or a rank that never arrives
//! within the timeout) aborts the group: every rank gets [`CommError::Aborted`], none hangs.
//!
//! ```
//! use std::time::Duration;
//! use vram_dist::{Communicator, InProcessGroup, ReduceOp};
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
mod comm;
mod in_process;

pub use bucket::{BucketPlan, DEFAULT_BUCKET_CAP_BYTES};
pub use comm::{CommError, Communicator, ReduceOp};
pub use in_process::{InProcessComm, InProcessGroup};
