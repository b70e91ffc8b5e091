//! One op, one place: the [`Op`] description every op implements and [`run`], the one
//! dispatch function every op goes through.
//!
//! An op checks its operands and returns a [`Plan`]: the outputs it writes (shape, dtype,
//! zeroed or not), the workspaces it needs (bytes, zeroed or not) and whether it runs a
//! cuBLAS product. [`run`] allocates all of it from the device's caching allocator (outputs,
//! then workspaces, then the cuBLAS workspace on first use) and hands the buffers to the
//! backend: the CPU reference on the host, the CUDA launches on a GPU, nothing on a virtual
//! device. Backends compute into the buffers they are given and allocate nothing, so every
//! backend makes the same requests in the same order, and the host's and a virtual device's
//! statistics are the GPU's. Workspaces go back to the cache when the op returns (on a GPU
//! after its work is queued, which the stream orders before any later use of the block).
//!
//! A chunked workspace ([`Plan::chunked_workspace`], a convolution's im2col buffer) is a
//! preference, not a need: when its full size runs out of memory, [`run`] asks for half as
//! many chunks, down to one, and the op works in smaller chunks, as PyTorch falls back to a
//! convolution algorithm with a smaller workspace when cuDNN's preferred one does not fit
//! (`try_plans` in `aten/src/ATen/native/cudnn/Conv_v8.cpp`, and `AlgoIterator::try_all` in
//! `Conv_v7.cpp`, catch the workspace's `OutOfMemoryError` and try the next plan). Each
//! refused request is an out-of-memory of the allocator (its `num_ooms`, its trace's `oom`
//! entry), as in PyTorch; the fallback depends only on the allocator's state, so every
//! backend still makes the same requests.

use crate::device::{Compute, Device};
use crate::dtype::DType;
use crate::error::Result;
use crate::storage::Storage;
use crate::tensor::{Tensor, checked_len};

/// What an op allocates before it computes.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    outputs: Vec<Output>,
    workspaces: Vec<Workspace>,
    blas: bool,
}

#[derive(Debug)]
struct Output {
    shape: Vec<usize>,
    /// The element type; `None` for u32 indices.
    dtype: Option<DType>,
    zeroed: bool,
}

#[derive(Debug)]
struct Workspace {
    /// Bytes of one chunk; the buffer holds `chunks` of them, and fewer (at least one) will
    /// do when they do not fit.
    chunk: usize,
    chunks: usize,
    zeroed: bool,
}

impl Plan {
    /// A plan with one output of `shape` and `dtype` that the backend overwrites entirely.
    pub(crate) fn one(shape: &[usize], dtype: DType) -> Plan {
        let mut plan = Plan::default();
        plan.output(shape, dtype);
        plan
    }

    /// An output of `shape` and `dtype` that the backend overwrites entirely; returns its
    /// index in [`Buffers::out`].
    pub(crate) fn output(&mut self, shape: &[usize], dtype: DType) -> usize {
        self.push_output(shape, Some(dtype), false)
    }

    /// An output that starts as zeros (0.0 in every dtype); the backend may write part of
    /// it, or nothing.
    pub(crate) fn zeroed_output(&mut self, shape: &[usize], dtype: DType) -> usize {
        self.push_output(shape, Some(dtype), true)
    }

    /// An output of u32 indices (becomes an [`Indices`](crate::Indices)).
    pub(crate) fn index_output(&mut self, shape: &[usize]) -> usize {
        self.push_output(shape, None, false)
    }

    fn push_output(&mut self, shape: &[usize], dtype: Option<DType>, zeroed: bool) -> usize {
        self.outputs.push(Output { shape: shape.to_vec(), dtype, zeroed });
        self.outputs.len() - 1
    }

    /// A scratch buffer of `bytes` for the CUDA backend; returns its index in
    /// [`Buffers::ws`], or `None` when `bytes` is 0 (nothing is allocated). The host
    /// computes in its own scratch memory; the buffer is allocated there too, so that the
    /// host's allocator sees what a GPU's does.
    pub(crate) fn workspace(&mut self, bytes: usize) -> Option<usize> {
        self.push_workspace(Workspace { chunk: bytes, chunks: 1, zeroed: false })
    }

    /// A scratch buffer of `bytes` that starts as zeros on the GPU (an accumulator).
    pub(crate) fn zeroed_workspace(&mut self, bytes: usize) -> Option<usize> {
        self.push_workspace(Workspace { chunk: bytes, chunks: 1, zeroed: true })
    }

    /// A scratch buffer of `chunks` chunks of `chunk` bytes each, of which fewer will do:
    /// when the whole does not fit, [`run`] halves the number of chunks until it does, down
    /// to one ([`Buffers::chunks`] says how many the op got). Not zeroed.
    pub(crate) fn chunked_workspace(&mut self, chunk: usize, chunks: usize) -> Option<usize> {
        self.push_workspace(Workspace { chunk, chunks: chunks.max(1), zeroed: false })
    }

    fn push_workspace(&mut self, ws: Workspace) -> Option<usize> {
        if ws.chunk == 0 {
            return None;
        }
        self.workspaces.push(ws);
        Some(self.workspaces.len() - 1)
    }

    /// The op runs a cuBLAS product: the device's cuBLAS workspace must exist.
    pub(crate) fn blas(&mut self) {
        self.blas = true;
    }
}

/// The buffers of a [`Plan`]: outputs in plan order, then workspaces.
pub(crate) struct Buffers {
    outputs: Vec<Tensor>,
    /// Each workspace, and the number of chunks it holds.
    workspaces: Vec<(Storage, usize)>,
}

impl Buffers {
    /// Output `i`.
    pub(crate) fn out(&mut self, i: usize) -> &mut Tensor {
        &mut self.outputs[i]
    }

    /// The device address of workspace `i` (an index from [`Plan::workspace`]); 0 for
    /// `None`, a workspace that was not needed.
    #[cfg(feature = "cuda")]
    pub(crate) fn ws(&self, i: Option<usize>) -> Result<u64> {
        match i {
            Some(i) => self.workspaces[i].0.cuda_ptr("workspace"),
            None => Ok(0),
        }
    }

    /// The chunks workspace `i` holds (fewer than planned when memory ran short); `None`
    /// for a workspace that was not needed.
    #[cfg(feature = "cuda")]
    pub(crate) fn chunks(&self, i: Option<usize>) -> Option<usize> {
        i.map(|i| self.workspaces[i].1)
    }

    /// Each workspace's address (a host pointer on the host) and bytes, in plan order.
    #[cfg(feature = "cuda")]
    pub(crate) fn workspace_addresses(&self) -> Vec<(u64, usize)> {
        self.workspaces.iter().map(|(s, _)| (s.address(), s.len())).collect()
    }

    /// Every output, in plan order.
    pub(crate) fn outputs_mut(&mut self) -> &mut [Tensor] {
        &mut self.outputs
    }

    /// The outputs, in plan order.
    pub(crate) fn into_outputs(self) -> std::vec::IntoIter<Tensor> {
        self.outputs.into_iter()
    }

    /// The only output.
    pub(crate) fn into_output(self) -> Tensor {
        self.outputs.into_iter().next().expect("the plan has an output")
    }
}

/// An op: checks, allocation plan, host compute, CUDA launches and result, in one place.
pub(crate) trait Op: Sized {
    /// The name in errors.
    const NAME: &'static str;
    /// What the caller gets.
    type Output;

    /// The device the op runs on.
    fn device(&self) -> &Device;

    /// Checks the operands and says what to allocate; allocates nothing itself, except that
    /// in-place operands are made unique here (a copy-on-write copy is an op of its own).
    fn plan(&mut self) -> Result<Plan>;

    /// Computes on the host into the planned buffers.
    fn host(&mut self, bufs: &mut Buffers) -> Result<()>;

    /// Queues the CUDA work into the planned buffers.
    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers) -> Result<()>;

    /// The result, from the buffers (computed, or just allocated on a virtual device).
    fn finish(self, bufs: Buffers) -> Result<Self::Output>;
}

/// Runs `op`: plan, allocate, compute on the device's backend, release the workspaces,
/// finish. On an error nothing the caller holds has changed, except that in-place operands
/// may have been made unique.
pub(crate) fn run<O: Op>(mut op: O) -> Result<O::Output> {
    let plan = op.plan()?;
    let device = op.device().clone();
    let compute = device.compute();
    // Profiling: the op's own time, from a synchronized device to the end of its work.
    let timer = match device.op_profiler() {
        Some(_) => {
            device.synchronize()?;
            Some(std::time::Instant::now())
        }
        None => None,
    };
    let mut outputs = Vec::with_capacity(plan.outputs.len());
    for out in &plan.outputs {
        let elem = out.dtype.map_or(4, DType::size_in_bytes);
        let (_, bytes) = checked_len(O::NAME, &out.shape, elem)?;
        let storage = device.allocate(bytes)?;
        // Index outputs are 4-byte elements; the dtype only sizes them.
        let mut t =
            Tensor::from_storage(&device, storage, &out.shape, out.dtype.unwrap_or(DType::F32));
        if out.zeroed {
            zero_output(&device, compute, &mut t)?;
        }
        outputs.push(t);
    }
    let mut workspaces = Vec::with_capacity(plan.workspaces.len());
    for ws in &plan.workspaces {
        let (storage, chunks) = allocate_workspace(&device, ws)?;
        if ws.zeroed {
            zero_workspace(&device, compute, &storage)?;
        }
        workspaces.push((storage, chunks));
    }
    // Allocated on every backend, for the statistics; only cuBLAS uses it.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    let blas = if plan.blas { device.blas_workspace()? } else { None };
    let mut bufs = Buffers { outputs, workspaces };
    match compute {
        Compute::Host => op.host(&mut bufs)?,
        Compute::Virtual => {}
        #[cfg(feature = "cuda")]
        Compute::Cuda => {
            if let Some(cu) = device.cuda_backend() {
                op.cuda(&crate::cuda::Gpu::new(cu, blas), &mut bufs)?;
            }
        }
    }
    bufs.workspaces.clear();
    if let Some(start) = timer {
        device.synchronize()?;
        if let Some(profile) = device.op_profiler() {
            profile.record(O::NAME, start.elapsed());
        }
    }
    op.finish(bufs)
}

/// Allocates `ws`; one of several chunks that runs out of memory is asked for again with
/// half as many, down to one. Returns the storage and its chunks.
fn allocate_workspace(device: &Device, ws: &Workspace) -> Result<(Storage, usize)> {
    let mut chunks = ws.chunks;
    loop {
        match device.allocate(ws.chunk * chunks) {
            Ok(storage) => return Ok((storage, chunks)),
            Err(e) if chunks > 1 && e.is_out_of_memory() => chunks /= 2,
            Err(e) => return Err(e),
        }
    }
}

/// Sets a fresh output to zeros (nothing to set on a virtual device).
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
fn zero_output(device: &Device, compute: Compute, t: &mut Tensor) -> Result<()> {
    match compute {
        Compute::Host => t.out_bytes("zeros")?.fill(0),
        Compute::Virtual => {}
        #[cfg(feature = "cuda")]
        Compute::Cuda => {
            if let Some(cu) = device.cuda_backend() {
                cu.zero(t.cuda_ptr()?, t.size_in_bytes())?;
            }
        }
    }
    Ok(())
}

/// Sets a workspace to zeros where a backend reads it: only the GPU does.
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
fn zero_workspace(device: &Device, compute: Compute, ws: &Storage) -> Result<()> {
    #[cfg(feature = "cuda")]
    if compute == Compute::Cuda
        && let Some(cu) = device.cuda_backend()
    {
        cu.zero(ws.cuda_ptr("workspace")?, ws.len())?;
    }
    Ok(())
}
