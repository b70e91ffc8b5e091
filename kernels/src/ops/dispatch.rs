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

/// One output of a [`Plan`]: its shape and element type, and whether it starts as zeros.
#[derive(Debug)]
pub(crate) struct OutputSpec {
    shape: Vec<usize>,
    /// The element type; `None` for u32 indices.
    dtype: Option<DType>,
    zeroed: bool,
}

impl OutputSpec {
    /// An output of `shape` and `dtype` that the backend overwrites entirely.
    pub(crate) fn new(shape: &[usize], dtype: DType) -> OutputSpec {
        OutputSpec { shape: shape.to_vec(), dtype: Some(dtype), zeroed: false }
    }

    /// An output that starts as zeros (0.0 in every dtype) when `zeroed`, the backend then
    /// writing part of it or nothing; else as [`OutputSpec::new`].
    pub(crate) fn zeroed_if(zeroed: bool, shape: &[usize], dtype: DType) -> OutputSpec {
        OutputSpec { shape: shape.to_vec(), dtype: Some(dtype), zeroed }
    }

    /// An output of u32 indices (becomes an [`Indices`](crate::Indices)).
    pub(crate) fn indices(shape: &[usize]) -> OutputSpec {
        OutputSpec { shape: shape.to_vec(), dtype: None, zeroed: false }
    }
}

/// The outputs of an op, in a shape its type fixes: no output (`()`), one [`Tensor`], an
/// array of them, an optional one, or a tuple of these. A [`Plan`] holds an [`OutputSpec`]
/// in the same shape ([`Outputs::Specs`]) and [`Buffers`] hands the tensors back in it, so
/// an op destructures its outputs irrefutably: a missing one is a compile error.
///
/// [`run`] allocates them in order (left to right, an absent optional output skipped); when
/// one fails, those already allocated are dropped first to last, as a `Vec` of them would be.
pub(crate) trait Outputs: Sized {
    /// The plan of these outputs: the same shape, holding an [`OutputSpec`] per tensor.
    type Specs;

    /// Allocates every output of `specs` in order with `alloc`; stops at the first error.
    fn allocate(
        specs: &Self::Specs,
        alloc: &mut dyn FnMut(&OutputSpec) -> Result<Tensor>,
    ) -> Result<Self>;
}

impl Outputs for () {
    type Specs = ();

    fn allocate(_: &(), _: &mut dyn FnMut(&OutputSpec) -> Result<Tensor>) -> Result<()> {
        Ok(())
    }
}

impl Outputs for Tensor {
    type Specs = OutputSpec;

    fn allocate(
        spec: &OutputSpec,
        alloc: &mut dyn FnMut(&OutputSpec) -> Result<Tensor>,
    ) -> Result<Tensor> {
        alloc(spec)
    }
}

impl<O: Outputs> Outputs for Option<O> {
    type Specs = Option<O::Specs>;

    fn allocate(
        specs: &Option<O::Specs>,
        alloc: &mut dyn FnMut(&OutputSpec) -> Result<Tensor>,
    ) -> Result<Option<O>> {
        specs.as_ref().map(|s| O::allocate(s, alloc)).transpose()
    }
}

/// `next`, paired with what was allocated before it; on an error, `done` is dropped (its
/// tensors first to last) before the error is returned.
fn then<D, T>(done: D, next: Result<T>) -> Result<(D, T)> {
    match next {
        Ok(t) => Ok((done, t)),
        Err(e) => {
            drop(done);
            Err(e)
        }
    }
}

impl<O: Outputs> Outputs for [O; 2] {
    type Specs = [O::Specs; 2];

    fn allocate(
        [s0, s1]: &[O::Specs; 2],
        alloc: &mut dyn FnMut(&OutputSpec) -> Result<Tensor>,
    ) -> Result<[O; 2]> {
        let a = O::allocate(s0, alloc)?;
        let (a, b) = then(a, O::allocate(s1, alloc))?;
        Ok([a, b])
    }
}

impl<O: Outputs> Outputs for [O; 3] {
    type Specs = [O::Specs; 3];

    fn allocate(
        [s0, s1, s2]: &[O::Specs; 3],
        alloc: &mut dyn FnMut(&OutputSpec) -> Result<Tensor>,
    ) -> Result<[O; 3]> {
        let a = O::allocate(s0, alloc)?;
        let (a, b) = then(a, O::allocate(s1, alloc))?;
        let ((a, b), c) = then((a, b), O::allocate(s2, alloc))?;
        Ok([a, b, c])
    }
}

/// Outputs whose number is known at run time only (a [custom op](crate::custom)'s): a
/// missing one is the op's business, as with any slice.
impl Outputs for Vec<Tensor> {
    type Specs = Vec<OutputSpec>;

    fn allocate(
        specs: &Vec<OutputSpec>,
        alloc: &mut dyn FnMut(&OutputSpec) -> Result<Tensor>,
    ) -> Result<Vec<Tensor>> {
        // On an error the tensors allocated so far drop first to last, as the arrays' do.
        specs.iter().map(alloc).collect()
    }
}

impl<A: Outputs, B: Outputs> Outputs for (A, B) {
    type Specs = (A::Specs, B::Specs);

    fn allocate(
        (s0, s1): &(A::Specs, B::Specs),
        alloc: &mut dyn FnMut(&OutputSpec) -> Result<Tensor>,
    ) -> Result<(A, B)> {
        let a = A::allocate(s0, alloc)?;
        then(a, B::allocate(s1, alloc))
    }
}

impl<A: Outputs, B: Outputs, C: Outputs> Outputs for (A, B, C) {
    type Specs = (A::Specs, B::Specs, C::Specs);

    fn allocate(
        (s0, s1, s2): &(A::Specs, B::Specs, C::Specs),
        alloc: &mut dyn FnMut(&OutputSpec) -> Result<Tensor>,
    ) -> Result<(A, B, C)> {
        let a = A::allocate(s0, alloc)?;
        let (a, b) = then(a, B::allocate(s1, alloc))?;
        let ((a, b), c) = then((a, b), C::allocate(s2, alloc))?;
        Ok((a, b, c))
    }
}

/// An output its caller asks for or not, decided by type: [`Tensor`] (planned, computed,
/// returned) or `()` (neither), for an op whose public functions differ in that output
/// only (a convolution's backward with and without dx).
pub(crate) trait Wanted: Outputs {
    /// Whether the output is planned.
    const WANTED: bool;

    /// The plan of the output `spec` describes: `spec`, or nothing.
    fn plan(spec: OutputSpec) -> Self::Specs;

    /// The output, when planned.
    fn get_mut(&mut self) -> Option<&mut Tensor>;
}

impl Wanted for Tensor {
    const WANTED: bool = true;

    fn plan(spec: OutputSpec) -> OutputSpec {
        spec
    }

    fn get_mut(&mut self) -> Option<&mut Tensor> {
        Some(self)
    }
}

impl Wanted for () {
    const WANTED: bool = false;

    fn plan(_: OutputSpec) {}

    fn get_mut(&mut self) -> Option<&mut Tensor> {
        None
    }
}

/// What an op allocates before it computes: its outputs (`O`), workspaces, and whether it
/// needs the cuBLAS workspace.
pub(crate) struct Plan<O: Outputs> {
    outputs: O::Specs,
    workspaces: Vec<Workspace>,
    blas: bool,
}

#[derive(Debug)]
struct Workspace {
    /// Bytes of one chunk; the buffer holds `chunks` of them, and fewer (at least one) will
    /// do when they do not fit.
    chunk: usize,
    chunks: usize,
    zeroed: bool,
}

impl Plan<Tensor> {
    /// A plan with one output of `shape` and `dtype` that the backend overwrites entirely.
    pub(crate) fn one(shape: &[usize], dtype: DType) -> Plan<Tensor> {
        Plan::new(OutputSpec::new(shape, dtype))
    }
}

impl Plan<()> {
    /// A plan with no output (an in-place op).
    pub(crate) fn none() -> Plan<()> {
        Plan::new(())
    }
}

impl<O: Outputs> Plan<O> {
    /// A plan with the outputs `outputs`, no workspace and no cuBLAS product.
    pub(crate) fn new(outputs: O::Specs) -> Plan<O> {
        Plan { outputs, workspaces: Vec::new(), blas: false }
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

/// The buffers of a [`Plan`]: the outputs, in the plan's shape, then the workspaces.
pub(crate) struct Buffers<O> {
    outputs: O,
    /// Each workspace, and the number of chunks it holds.
    workspaces: Vec<(Storage, usize)>,
}

impl<O> Buffers<O> {
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
    pub(crate) fn chunks(&self, i: Option<usize>) -> Option<usize> {
        i.map(|i| self.workspaces[i].1)
    }

    /// Each workspace's address (a host pointer on the host), in plan order.
    #[cfg(feature = "cuda")]
    pub(crate) fn workspace_addresses(&self) -> Vec<u64> {
        self.workspaces.iter().map(|(s, _)| s.address()).collect()
    }

    /// The outputs, in the plan's shape.
    pub(crate) fn outputs_mut(&mut self) -> &mut O {
        &mut self.outputs
    }

    /// The outputs, in the plan's shape.
    pub(crate) fn into_outputs(self) -> O {
        self.outputs
    }
}

impl Buffers<Tensor> {
    /// The only output.
    pub(crate) fn out(&mut self) -> &mut Tensor {
        &mut self.outputs
    }

    /// The only output.
    pub(crate) fn into_output(self) -> Tensor {
        self.outputs
    }
}

/// An op: checks, allocation plan, host compute, CUDA launches and result, in one place.
pub(crate) trait Op: Sized {
    /// The name in errors.
    const NAME: &'static str;
    /// The tensors it allocates, in plan order ([`Outputs`]: `()`, a [`Tensor`], an array,
    /// an `Option`, a tuple).
    type Outs: Outputs;
    /// What the caller gets.
    type Output;

    /// The device the op runs on.
    fn device(&self) -> &Device;

    /// Checks the operands and says what to allocate; allocates nothing itself, except that
    /// in-place operands are made unique here (a copy-on-write copy is an op of its own).
    fn plan(&mut self) -> Result<Plan<Self::Outs>>;

    /// Computes on the host into the planned buffers.
    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()>;

    /// Queues the CUDA work into the planned buffers.
    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()>;

    /// On a virtual device, what the op would allocate while it runs on a GPU beyond its
    /// plan: a cuDNN call's workspace, at the size a GPU's record of cuDNN's choices gives
    /// ([`Device::set_cudnn_choices`]). Nothing by default.
    fn on_virtual(&mut self) -> Result<()> {
        Ok(())
    }

    /// The result, from the buffers (computed, or just allocated on a virtual device).
    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Self::Output>;
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
    let outputs = O::Outs::allocate(&plan.outputs, &mut |out| {
        let elem = out.dtype.map_or(4, DType::size_in_bytes);
        let (_, bytes) = checked_len(O::NAME, &out.shape, elem)?;
        let storage = device.allocate(bytes)?;
        // Index outputs are 4-byte elements; the dtype only sizes them.
        let mut t =
            Tensor::from_storage(&device, storage, &out.shape, out.dtype.unwrap_or(DType::F32));
        if out.zeroed {
            zero_output(&device, compute, &mut t)?;
        }
        Ok(t)
    })?;
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
        Compute::Virtual => op.on_virtual()?,
        #[cfg(feature = "cuda")]
        Compute::Cuda => {
            if let Some(cu) = device.cuda_backend() {
                op.cuda(&crate::cuda::Gpu::new(cu, blas, device.allow_tf32_matmul()), &mut bufs)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use vram_alloc::TraceAction;

    /// An op of four f32 outputs of `lens` elements, in nested shapes; computes nothing.
    struct Nested {
        device: Device,
        lens: [usize; 4],
    }

    impl Op for Nested {
        const NAME: &'static str = "nested";
        type Outs = (Tensor, [Tensor; 2], Option<Tensor>);
        type Output = ();

        fn device(&self) -> &Device {
            &self.device
        }

        fn plan(&mut self) -> Result<Plan<Self::Outs>> {
            let spec = |n: usize| OutputSpec::new(&[n], DType::F32);
            let [a, b, c, d] = self.lens;
            Ok(Plan::new((spec(a), [spec(b), spec(c)], Some(spec(d)))))
        }

        fn host(&mut self, _: &mut Buffers<Self::Outs>) -> Result<()> {
            Ok(())
        }

        #[cfg(feature = "cuda")]
        fn cuda(&mut self, _: &crate::cuda::Gpu<'_>, _: &mut Buffers<Self::Outs>) -> Result<()> {
            Ok(())
        }

        fn finish(self, _: Buffers<Self::Outs>) -> Result<()> {
            Ok(())
        }
    }

    /// The requested bytes of `device`'s trace entries of `action`, in order.
    fn requested(device: &Device, action: TraceAction) -> Vec<usize> {
        device.trace().iter().filter(|e| e.action == action).map(|e| e.requested).collect()
    }

    #[test]
    fn outputs_are_allocated_in_plan_order_and_freed_first_to_last() {
        let device = Device::host(64 << 20);
        device.record_history(Some(1000));
        run(Nested { device: device.clone(), lens: [1000, 2000, 3000, 4000] }).unwrap();
        let bytes = vec![4000, 8000, 12000, 16000];
        assert_eq!(requested(&device, TraceAction::Alloc), bytes);
        assert_eq!(requested(&device, TraceAction::FreeRequested), bytes);

        // The last output does not fit: the others go back first to last, as a Vec would.
        let device = Device::host(64 << 20);
        device.record_history(Some(1000));
        let err = run(Nested { device: device.clone(), lens: [1000, 2000, 3000, 1 << 40] });
        assert!(err.unwrap_err().is_out_of_memory());
        assert_eq!(requested(&device, TraceAction::Alloc), bytes[..3]);
        assert_eq!(requested(&device, TraceAction::Oom).len(), 1);
        assert_eq!(requested(&device, TraceAction::FreeRequested), bytes[..3]);
    }
}
