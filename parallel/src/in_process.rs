//! In-process backend: ranks are threads sharing one rendezvous.
//!
//! Each collective is a rendezvous: every rank deposits its buffer, the last to arrive
//! publishes all of them and advances the generation, and each rank then computes its own
//! result (sum, its chunk, the concatenation, the root's copy) from the published buffers.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::comm::{CommError, Communicator, ReduceOp, reduce_in_rank_order};

#[derive(Debug)]
struct State {
    generation: u64,
    arrived: usize,
    slots: Vec<Option<Vec<f32>>>,
    published: Option<Arc<Vec<Vec<f32>>>>,
    aborted: Option<CommError>,
}

#[derive(Debug)]
struct Shared {
    world_size: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking rank cannot leave the state half-updated (no panics while held).
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn abort(&self, by: usize, reason: &str) {
        let mut st = self.lock();
        if st.aborted.is_none() {
            st.aborted = Some(CommError::Aborted { by, reason: reason.to_owned() });
        }
        drop(st);
        self.cv.notify_all();
    }

    /// Deposits `data`, waits for every rank, returns every rank's deposit in rank order.
    fn rendezvous(&self, rank: usize, data: Vec<f32>) -> Result<Arc<Vec<Vec<f32>>>, CommError> {
        let mut st = self.lock();
        if let Some(e) = &st.aborted {
            return Err(e.clone());
        }
        let generation = st.generation;
        st.slots[rank] = Some(data);
        st.arrived += 1;
        if st.arrived == self.world_size {
            let all: Vec<Vec<f32>> =
                st.slots.iter_mut().map(|s| s.take().unwrap_or_default()).collect();
            st.published = Some(Arc::new(all));
            st.arrived = 0;
            st.generation += 1;
            let out = st.published.clone().unwrap_or_default();
            drop(st);
            self.cv.notify_all();
            return Ok(out);
        }
        let deadline = Instant::now() + self.timeout;
        loop {
            if st.generation != generation {
                return Ok(st.published.clone().unwrap_or_default());
            }
            if let Some(e) = &st.aborted {
                return Err(e.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                let e = CommError::Aborted {
                    by: rank,
                    reason: format!(
                        "timed out after {:?} waiting for {} of {} ranks",
                        self.timeout,
                        self.world_size - st.arrived,
                        self.world_size
                    ),
                };
                st.aborted = Some(e.clone());
                drop(st);
                self.cv.notify_all();
                return Err(e);
            }
            st = self.cv.wait_timeout(st, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// Aborts the group if any rank's deposit has not `expected` elements.
    fn check_lengths(
        &self,
        rank: usize,
        all: &[Vec<f32>],
        op: &'static str,
        expected: usize,
    ) -> Result<(), CommError> {
        if let Some((r, v)) = all.iter().enumerate().find(|(_, v)| v.len() != expected) {
            let e = CommError::LengthMismatch { op, rank: r, got: v.len(), expected };
            self.abort(rank, &e.to_string());
            return Err(e);
        }
        Ok(())
    }
}

/// Factory for an in-process group of ranks.
#[derive(Debug)]
pub struct InProcessGroup;

impl InProcessGroup {
    /// Creates `world_size` connected communicators, one per rank (hand each to a thread).
    /// A rank that waits longer than `timeout` for the others aborts the group.
    pub fn connect(world_size: usize, timeout: Duration) -> Result<Vec<InProcessComm>, CommError> {
        if world_size == 0 {
            return Err(CommError::Invalid("world_size must be at least 1".into()));
        }
        let shared = Arc::new(Shared {
            world_size,
            timeout,
            state: Mutex::new(State {
                generation: 0,
                arrived: 0,
                slots: vec![None; world_size],
                published: None,
                aborted: None,
            }),
            cv: Condvar::new(),
        });
        Ok((0..world_size)
            .map(|rank| InProcessComm { rank, shared: Arc::clone(&shared) })
            .collect())
    }
}

/// One rank of an [`InProcessGroup`]. Dropped while its thread panics, it aborts the group.
#[derive(Debug)]
pub struct InProcessComm {
    rank: usize,
    shared: Arc<Shared>,
}

impl Drop for InProcessComm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.shared.abort(self.rank, "rank panicked");
        }
    }
}

fn reduce(all: &[Vec<f32>], range: std::ops::Range<usize>, op: ReduceOp, out: &mut [f32]) {
    let all: Vec<&[f32]> = all.iter().map(Vec::as_slice).collect();
    reduce_in_rank_order(&all, range, op, out);
}

impl Communicator for InProcessComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world_size
    }

    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        let all = self.shared.rendezvous(self.rank, buf.to_vec())?;
        self.shared.check_lengths(self.rank, &all, "all_reduce", buf.len())?;
        reduce(&all, 0..buf.len(), op, buf);
        Ok(())
    }

    fn reduce_scatter(
        &self,
        input: &[f32],
        output: &mut [f32],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let n = self.world_size();
        let expected = output.len() * n;
        if input.len() != expected {
            let e = CommError::LengthMismatch {
                op: "reduce_scatter",
                rank: self.rank,
                got: input.len(),
                expected,
            };
            self.abort(&e.to_string());
            return Err(e);
        }
        let all = self.shared.rendezvous(self.rank, input.to_vec())?;
        self.shared.check_lengths(self.rank, &all, "reduce_scatter", expected)?;
        let start = self.rank * output.len();
        reduce(&all, start..start + output.len(), op, output);
        Ok(())
    }

    fn all_gather(&self, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        let expected = input.len() * self.world_size();
        if output.len() != expected {
            let e = CommError::LengthMismatch {
                op: "all_gather",
                rank: self.rank,
                got: output.len(),
                expected,
            };
            self.abort(&e.to_string());
            return Err(e);
        }
        let all = self.shared.rendezvous(self.rank, input.to_vec())?;
        self.shared.check_lengths(self.rank, &all, "all_gather", input.len())?;
        for (chunk, v) in output.chunks_mut(input.len().max(1)).zip(all.iter()) {
            chunk.copy_from_slice(v);
        }
        Ok(())
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        if root >= self.world_size() {
            let e = CommError::Invalid(format!(
                "broadcast root {root} outside a group of {}",
                self.world_size()
            ));
            self.abort(&e.to_string());
            return Err(e);
        }
        let all = self.shared.rendezvous(self.rank, buf.to_vec())?;
        self.shared.check_lengths(self.rank, &all, "broadcast", buf.len())?;
        buf.copy_from_slice(&all[root]);
        Ok(())
    }

    fn abort(&self, reason: &str) {
        self.shared.abort(self.rank, reason);
    }
}
