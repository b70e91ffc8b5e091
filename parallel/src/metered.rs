//! [`Metered`]: counts what a ring (NCCL's algorithm for large messages) would move for
//! each collective the trainer calls, on any backend, virtual devices included.

use std::cell::Cell;

use crate::collective::Collective;
use crate::comm::{ReduceOp, Traffic};
use crate::error::DistError;
use vram_kernels::Tensor;

/// A [`Collective`] that counts, per rank, the bytes a ring moves for each call it passes
/// on, in the tensors' dtype: with `S` the bytes of the full buffer and `N` ranks, an
/// all-reduce sends (and receives) `2 (N - 1) / N * S` per rank, a reduce-scatter
/// (`S` its input) and an all-gather (`S` its output) `(N - 1) / N * S`, a broadcast and a
/// reduce `(N - 1) / N * S` (averaged over the ranks of the ring), a gather or a scatter
/// `(N - 1) / N` of one rank's chunk. [`Collective::traffic`] reports the sums.
///
/// So the counts follow what the trainer really calls (which collectives, how often, padded
/// shards included), not a formula per strategy: the data-parallel experiment and
/// `cargo xtask plan` read their bytes per parameter per step from it.
#[derive(Debug)]
pub struct Metered<C> {
    inner: C,
    /// Bytes sent times `N^2` (exact: every factor above is a multiple of `1 / N^2`).
    scaled: Cell<u128>,
    calls: Cell<u64>,
}

impl<C: Collective> Metered<C> {
    /// Counts the collectives of `inner`.
    pub fn new(inner: C) -> Self {
        Metered { inner, scaled: Cell::new(0), calls: Cell::new(0) }
    }

    /// `2 (N - 1) N`, `(N - 1) N` or `(N - 1)` parts of `bytes`, over `N^2`.
    fn add(&self, parts: u128, bytes: usize) {
        self.scaled.set(self.scaled.get() + parts * bytes as u128);
        self.calls.set(self.calls.get() + 1);
    }

    fn n(&self) -> u128 {
        self.inner.world_size() as u128
    }
}

impl<C: Collective> Collective for Metered<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn all_reduce(&self, t: &mut Tensor, op: ReduceOp) -> Result<(), DistError> {
        self.inner.all_reduce(t, op)?;
        let n = self.n();
        self.add(2 * (n - 1) * n, t.size_in_bytes());
        Ok(())
    }

    fn reduce_scatter(
        &self,
        input: &Tensor,
        output: &mut Tensor,
        op: ReduceOp,
    ) -> Result<(), DistError> {
        self.inner.reduce_scatter(input, output, op)?;
        let n = self.n();
        self.add((n - 1) * n, input.size_in_bytes());
        Ok(())
    }

    fn all_gather(&self, input: &Tensor, output: &mut Tensor) -> Result<(), DistError> {
        self.inner.all_gather(input, output)?;
        let n = self.n();
        self.add((n - 1) * n, output.size_in_bytes());
        Ok(())
    }

    fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<(), DistError> {
        self.inner.broadcast(t, root)?;
        let n = self.n();
        self.add((n - 1) * n, t.size_in_bytes());
        Ok(())
    }

    fn reduce(&self, t: &mut Tensor, root: usize) -> Result<(), DistError> {
        self.inner.reduce(t, root)?;
        let n = self.n();
        self.add((n - 1) * n, t.size_in_bytes());
        Ok(())
    }

    fn gather(
        &self,
        input: &Tensor,
        output: Option<&mut Tensor>,
        root: usize,
    ) -> Result<(), DistError> {
        self.inner.gather(input, output, root)?;
        self.add(self.n() - 1, input.size_in_bytes() * self.inner.world_size());
        Ok(())
    }

    fn scatter(
        &self,
        input: Option<&Tensor>,
        output: &mut Tensor,
        root: usize,
    ) -> Result<(), DistError> {
        self.inner.scatter(input, output, root)?;
        self.add(self.n() - 1, output.size_in_bytes() * self.inner.world_size());
        Ok(())
    }

    fn copy_elements(
        &self,
        src: &Tensor,
        src_offset: usize,
        dst: &mut Tensor,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), DistError> {
        self.inner.copy_elements(src, src_offset, dst, dst_offset, len)
    }

    fn abort(&self, reason: &str) {
        self.inner.abort(reason);
    }

    fn check(&self) -> Result<(), DistError> {
        self.inner.check()
    }

    fn traffic(&self) -> Option<Traffic> {
        let n = self.n();
        let sent = u64::try_from(self.scaled.get() / (n * n)).unwrap_or(u64::MAX);
        Some(Traffic { sent, received: sent, calls: self.calls.get() })
    }
}

/// Bytes per parameter per step that each rank sends (and receives) under a ring for
/// `strategy` with `n` ranks and `bytes` bytes per gradient element, as the trainer calls
/// its collectives: DDP all-reduces the gradients (`2 (N - 1) / N`), ZeRO-1 and 2
/// reduce-scatter them and all-gather the weights (the same), ZeRO-3 all-gathers the
/// weights for forward and again for backward and reduce-scatters the gradients
/// (`3 (N - 1) / N`, 1.5 times DDP). `None` for `DataParallel` (its volume depends on the
/// activations).
pub fn ring_bytes_per_param(strategy: crate::Strategy, n: usize, bytes: usize) -> Option<f64> {
    use crate::Strategy as S;
    let f = (n as f64 - 1.0) / n as f64 * bytes as f64;
    match strategy {
        S::Ddp | S::Zero1 | S::Zero2 => Some(2.0 * f),
        S::Zero3 => Some(3.0 * f),
        S::DataParallel => None,
    }
}
