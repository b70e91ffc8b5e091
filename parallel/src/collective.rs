//! Collectives on device tensors: the trait the data-parallel trainer talks to, and the
//! backends for host devices (values through an in-process [`Communicator`]) and virtual
//! devices (memory only). NCCL for CUDA devices is in `nccl.rs` (feature `cuda`).
//!
//! A backend never allocates device memory itself: every buffer a collective writes (a
//! bucket, a gathered parameter, a gradient shard) is allocated by the caller from the
//! device's caching allocator, as PyTorch allocates the tensors it hands to NCCL. So host,
//! virtual and CUDA devices show the same memory figures for the same training step.

use crate::comm::{CommError, Communicator, ReduceOp, Traffic};
use crate::error::DistError;
use vram_kernels::half::{bf16, f16};
use vram_kernels::{DType, Tensor};

/// One rank's collectives on tensors of its device. Every rank calls the same collectives
/// in the same order with tensors of the same dtype; element counts are checked.
pub trait Collective: Send {
    /// This rank, in `0..world_size()`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// Combines `t` over all ranks, in place, on every rank.
    fn all_reduce(&self, t: &mut Tensor, op: ReduceOp) -> Result<(), DistError>;
    /// Reduces `input` (`world_size * output.numel()` elements) over ranks; this rank
    /// receives chunk `rank()` in `output`.
    fn reduce_scatter(
        &self,
        input: &Tensor,
        output: &mut Tensor,
        op: ReduceOp,
    ) -> Result<(), DistError>;
    /// Concatenates every rank's `input` in rank order into `output`.
    fn all_gather(&self, input: &Tensor, output: &mut Tensor) -> Result<(), DistError>;
    /// Copies `root`'s `t` into every rank's `t`.
    fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<(), DistError>;
    /// Sums `t` over ranks into `root`'s `t` (the others' are left as they were).
    fn reduce(&self, t: &mut Tensor, root: usize) -> Result<(), DistError>;
    /// Concatenates every rank's `input` in rank order into `root`'s `output` (`Some` on
    /// the root only; the others pass `None`).
    fn gather(
        &self,
        input: &Tensor,
        output: Option<&mut Tensor>,
        root: usize,
    ) -> Result<(), DistError>;
    /// Splits `root`'s `input` (`Some` on the root only, `None` elsewhere) into
    /// `world_size` chunks; this rank
    /// receives chunk `rank()` in `output`.
    fn scatter(
        &self,
        input: Option<&Tensor>,
        output: &mut Tensor,
        root: usize,
    ) -> Result<(), DistError>;
    /// Copies `len` elements of `src` from `src_offset` into `dst` at `dst_offset` on this
    /// rank's device (flattening gradients into a bucket and back, cutting a shard). Not a
    /// collective, but where the values live is the backend's business.
    fn copy_elements(
        &self,
        src: &Tensor,
        src_offset: usize,
        dst: &mut Tensor,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), DistError>;
    /// Aborts the group: every pending and later collective of every rank fails with
    /// [`CommError::Aborted`]. A rank calls it when it fails (out of memory).
    fn abort(&self, reason: &str);
    /// Fails with the group's abort, if it was aborted. Where collectives run asynchronously
    /// (NCCL on a GPU) an abort can end a collective's kernel early while this rank waits for
    /// the device: the wait then returns as if it had finished, so a rank checks this after
    /// each synchronization before it trusts the values. Backends whose collectives fail
    /// when aborted need nothing more (the default).
    fn check(&self) -> Result<(), DistError> {
        Ok(())
    }
    /// What this rank's collectives moved so far, where the backend counts it (the TCP
    /// transport on the wire, [`Metered`](crate::Metered) as a ring would); `None` elsewhere.
    fn traffic(&self) -> Option<Traffic> {
        None
    }
}

fn mismatch(op: &'static str, rank: usize, got: usize, expected: usize) -> DistError {
    DistError::Comm(CommError::LengthMismatch { op, rank, got, expected })
}

/// Checks a copy's ranges and dtypes (every backend uses it, so all refuse alike).
pub(crate) fn check_copy(
    src: &Tensor,
    src_offset: usize,
    dst: &Tensor,
    dst_offset: usize,
    len: usize,
) -> Result<(), DistError> {
    if src.dtype() != dst.dtype() {
        return Err(DistError::Kernel(vram_kernels::Error::DTypeMismatch {
            op: "copy_elements",
            lhs: src.dtype(),
            rhs: dst.dtype(),
        }));
    }
    let fits = |off: usize, n: usize| off.checked_add(len).is_some_and(|end| end <= n);
    if !fits(src_offset, src.numel()) || !fits(dst_offset, dst.numel()) {
        return Err(DistError::Invalid(format!(
            "copy_elements: {len} elements from offset {src_offset} of {} into offset \
             {dst_offset} of {} do not fit",
            src.numel(),
            dst.numel()
        )));
    }
    Ok(())
}

/// Collectives for host devices: values go through a host [`Communicator`] (the
/// in-process group, one thread per rank, or [`TcpComm`](crate::TcpComm), one process per
/// rank), results are written into the device tensors.
/// Tensors of any dtype; reductions run in f32 and round once into the dtype.
#[derive(Debug)]
pub struct HostCollective<C> {
    comm: C,
}

impl<C: Communicator> HostCollective<C> {
    /// Collectives over `comm`.
    pub fn new(comm: C) -> Self {
        HostCollective { comm }
    }
}

/// Writes `values` into `t` from element `offset`, rounding into its dtype.
fn write(t: &mut Tensor, offset: usize, values: &[f32]) -> Result<(), DistError> {
    let end = offset + values.len();
    match t.dtype() {
        DType::F32 => t.as_mut_slice::<f32>()?[offset..end].copy_from_slice(values),
        DType::F16 => t.as_mut_slice::<f16>()?[offset..end]
            .iter_mut()
            .zip(values)
            .for_each(|(o, v)| *o = f16::from_f32(*v)),
        DType::BF16 => t.as_mut_slice::<bf16>()?[offset..end]
            .iter_mut()
            .zip(values)
            .for_each(|(o, v)| *o = bf16::from_f32(*v)),
    }
    Ok(())
}

impl<C: Communicator> Collective for HostCollective<C> {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn all_reduce(&self, t: &mut Tensor, op: ReduceOp) -> Result<(), DistError> {
        let mut v = t.to_f32_vec()?;
        self.comm.all_reduce(&mut v, op)?;
        write(t, 0, &v)
    }

    fn reduce_scatter(
        &self,
        input: &Tensor,
        output: &mut Tensor,
        op: ReduceOp,
    ) -> Result<(), DistError> {
        let mut out = vec![0.0; output.numel()];
        self.comm.reduce_scatter(&input.to_f32_vec()?, &mut out, op)?;
        write(output, 0, &out)
    }

    fn all_gather(&self, input: &Tensor, output: &mut Tensor) -> Result<(), DistError> {
        let mut out = vec![0.0; output.numel()];
        self.comm.all_gather(&input.to_f32_vec()?, &mut out)?;
        write(output, 0, &out)
    }

    fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<(), DistError> {
        let mut v = t.to_f32_vec()?;
        self.comm.broadcast(&mut v, root)?;
        if self.rank() != root {
            write(t, 0, &v)?;
        }
        Ok(())
    }

    fn reduce(&self, t: &mut Tensor, root: usize) -> Result<(), DistError> {
        // The host transport has no rooted reduce: every rank computes the sum, only the
        // root keeps it. No device memory is involved beyond `t`.
        let mut v = t.to_f32_vec()?;
        self.comm.all_reduce(&mut v, ReduceOp::Sum)?;
        if self.rank() == root {
            write(t, 0, &v)?;
        }
        Ok(())
    }

    fn gather(
        &self,
        input: &Tensor,
        output: Option<&mut Tensor>,
        root: usize,
    ) -> Result<(), DistError> {
        let n = self.world_size() * input.numel();
        let output = match (self.rank() == root, output) {
            (true, Some(o)) if o.numel() == n => Some(o),
            (true, o) => {
                let got = o.map_or(0, |o| o.numel());
                let e = mismatch("gather", self.rank(), got, n);
                self.abort(&e.to_string());
                return Err(e);
            }
            (false, _) => None,
        };
        let mut all = vec![0.0; n];
        self.comm.all_gather(&input.to_f32_vec()?, &mut all)?;
        match output {
            Some(o) => write(o, 0, &all),
            None => Ok(()),
        }
    }

    fn scatter(
        &self,
        input: Option<&Tensor>,
        output: &mut Tensor,
        root: usize,
    ) -> Result<(), DistError> {
        let n = self.world_size() * output.numel();
        let mut all = match (self.rank() == root, input) {
            (true, Some(i)) if i.numel() == n => i.to_f32_vec()?,
            (true, i) => {
                let e = mismatch("scatter", self.rank(), i.map_or(0, |i| i.numel()), n);
                self.abort(&e.to_string());
                return Err(e);
            }
            (false, _) => vec![0.0; n],
        };
        self.comm.broadcast(&mut all, root)?;
        let k = output.numel();
        let r = self.rank();
        write(output, 0, &all[r * k..(r + 1) * k])
    }

    fn copy_elements(
        &self,
        src: &Tensor,
        src_offset: usize,
        dst: &mut Tensor,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), DistError> {
        check_copy(src, src_offset, dst, dst_offset, len)?;
        let v = src.to_f32_vec()?;
        write(dst, dst_offset, &v[src_offset..src_offset + len])
    }

    fn abort(&self, reason: &str) {
        self.comm.abort(reason);
    }

    fn traffic(&self) -> Option<Traffic> {
        self.comm.traffic()
    }
}

/// Collectives for virtual devices, which hold no values: a collective moves nothing, but
/// checks element counts as the real one does and keeps the ranks in step (each collective
/// is an empty rendezvous on `comm`), so a failed rank aborts the others exactly as on real
/// devices. The memory a real collective needs is allocated by the caller, so it counts.
#[derive(Debug)]
pub struct VirtualCollective<C> {
    comm: C,
}

impl<C: Communicator> VirtualCollective<C> {
    /// Memory-only collectives, in step over `comm`.
    pub fn new(comm: C) -> Self {
        VirtualCollective { comm }
    }

    fn step(&self, op: &'static str, got: usize, expected: usize) -> Result<(), DistError> {
        if got != expected {
            let e = mismatch(op, self.rank(), got, expected);
            self.abort(&e.to_string());
            return Err(e);
        }
        self.comm.all_reduce(&mut [], ReduceOp::Sum)?;
        Ok(())
    }
}

impl<C: Communicator> Collective for VirtualCollective<C> {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn all_reduce(&self, _t: &mut Tensor, _op: ReduceOp) -> Result<(), DistError> {
        self.step("all_reduce", 0, 0)
    }

    fn reduce_scatter(
        &self,
        input: &Tensor,
        output: &mut Tensor,
        _op: ReduceOp,
    ) -> Result<(), DistError> {
        self.step("reduce_scatter", input.numel(), output.numel() * self.world_size())
    }

    fn all_gather(&self, input: &Tensor, output: &mut Tensor) -> Result<(), DistError> {
        self.step("all_gather", output.numel(), input.numel() * self.world_size())
    }

    fn broadcast(&self, _t: &mut Tensor, _root: usize) -> Result<(), DistError> {
        self.step("broadcast", 0, 0)
    }

    fn reduce(&self, _t: &mut Tensor, _root: usize) -> Result<(), DistError> {
        self.step("reduce", 0, 0)
    }

    fn gather(
        &self,
        input: &Tensor,
        output: Option<&mut Tensor>,
        root: usize,
    ) -> Result<(), DistError> {
        let n = if self.rank() == root { input.numel() * self.world_size() } else { 0 };
        self.step("gather", output.map_or(0, |o| o.numel()), n)
    }

    fn scatter(
        &self,
        input: Option<&Tensor>,
        output: &mut Tensor,
        root: usize,
    ) -> Result<(), DistError> {
        let n = if self.rank() == root { output.numel() * self.world_size() } else { 0 };
        self.step("scatter", input.map_or(0, |i| i.numel()), n)
    }

    fn copy_elements(
        &self,
        src: &Tensor,
        src_offset: usize,
        dst: &mut Tensor,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), DistError> {
        check_copy(src, src_offset, dst, dst_offset, len)
    }

    fn abort(&self, reason: &str) {
        self.comm.abort(reason);
    }
}
