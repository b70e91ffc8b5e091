//! NCCL collectives for CUDA devices, through cudarc's `nccl` bindings (loaded at run
//! time). Work is enqueued on each device's vram stream ([`Device::cuda_stream`]), so it is
//! ordered with the ops that produced and will read the tensors.
//!
//! Ranks live in this process, one per GPU (`ncclCommInitAll`). The ranks share an abort
//! flag: a rank that fails sets it and aborts its communicator, and every other rank checks
//! it before each collective and aborts its own, so none enqueues work a dead peer will
//! never match. NCCL has no timeout of its own here: a rank that stops without aborting
//! (a crash of its thread is an abort, see [`Drop`]) leaves its peers waiting on the GPU.
//!
//! Not yet run on a GPU: it compiles on every build with the `cuda` feature, and its test
//! skips without a CUDA device.

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaStream;
use cudarc::nccl::{result, sys};

use crate::collective::{Collective, check_copy};
use crate::comm::{CommError, ReduceOp};
use crate::error::DistError;
use vram_kernels::{DType, Device, Tensor};

/// One rank of an NCCL group on one CUDA device.
#[derive(Debug)]
pub struct NcclCollective {
    comm: sys::ncclComm_t,
    stream: Arc<CudaStream>,
    rank: usize,
    world_size: usize,
    aborted: Arc<Mutex<Option<CommError>>>,
    comm_aborted: std::sync::atomic::AtomicBool,
}

// SAFETY: an NCCL communicator may be used from any thread as long as one thread uses it
// at a time; each `NcclCollective` is owned by one rank's thread (`&self` methods are not
// shared across threads: the type is not `Sync`).
unsafe impl Send for NcclCollective {}

fn nccl_error(op: &'static str) -> impl Fn(result::NcclError) -> DistError {
    move |e| DistError::Kernel(vram_kernels::Error::Device { op, reason: format!("{e:?}") })
}

fn dtype(t: &Tensor) -> sys::ncclDataType_t {
    match t.dtype() {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
    }
}

fn red(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Average => sys::ncclRedOp_t::ncclAvg,
    }
}

impl NcclCollective {
    /// Whether the NCCL library can be loaded on this machine.
    pub fn is_available() -> bool {
        // SAFETY: only tries to open the library.
        unsafe { sys::is_culib_present() }
    }

    /// Connects one rank per device of `devices` (all CUDA devices, distinct GPUs), rank `r`
    /// on `devices[r]`.
    ///
    /// # Errors
    ///
    /// [`DistError::Invalid`] for an empty list, a device that is not CUDA, or a missing
    /// NCCL library; NCCL's error otherwise.
    pub fn connect(devices: &[Device]) -> Result<Vec<NcclCollective>, DistError> {
        if devices.is_empty() {
            return Err(DistError::Invalid("NCCL needs at least one device".into()));
        }
        let streams = devices
            .iter()
            .map(|d| {
                d.cuda_stream().ok_or_else(|| {
                    DistError::Invalid(format!("NCCL needs CUDA devices, got {}", d.name()))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        if !Self::is_available() {
            return Err(DistError::Invalid(
                "the NCCL library (libnccl.so.2) was not found; install NCCL".into(),
            ));
        }
        let ordinals: Vec<i32> = streams.iter().map(|s| s.context().ordinal() as i32).collect();
        let n = i32::try_from(devices.len())
            .map_err(|_| DistError::Invalid("too many devices".into()))?;
        let mut comms = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: `comms` has room for `n` communicators and `ordinals` lists `n` devices.
        unsafe { result::comm_init_all(comms.as_mut_ptr(), n, ordinals.as_ptr()) }
            .map_err(nccl_error("ncclCommInitAll"))?;
        let aborted = Arc::new(Mutex::new(None));
        Ok(comms
            .into_iter()
            .zip(streams)
            .enumerate()
            .map(|(rank, (comm, stream))| NcclCollective {
                comm,
                stream,
                rank,
                world_size: devices.len(),
                aborted: Arc::clone(&aborted),
                comm_aborted: false.into(),
            })
            .collect())
    }

    /// Fails when the group was aborted (aborting this rank's communicator then), else
    /// binds the device's context to this thread.
    fn ready(&self) -> Result<sys::cudaStream_t, DistError> {
        let aborted = self.aborted.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(e) = aborted {
            self.abort_comm();
            return Err(DistError::Comm(e));
        }
        self.stream.context().bind_to_thread().map_err(|e| {
            DistError::Kernel(vram_kernels::Error::Device {
                op: "cuCtxSetCurrent",
                reason: e.to_string(),
            })
        })?;
        Ok(self.stream.cu_stream() as sys::cudaStream_t)
    }

    fn abort_comm(&self) {
        if !self.comm_aborted.swap(true, std::sync::atomic::Ordering::SeqCst) {
            // SAFETY: `comm` is this rank's live communicator; it is not used after this
            // (every later call fails in `ready`, and `Drop` sees `comm_aborted`).
            let _ = unsafe { result::comm_abort(self.comm) };
        }
    }

    fn ptr(t: &Tensor) -> Result<*mut c_void, DistError> {
        Ok(t.cuda_device_ptr()? as *mut c_void)
    }

    fn len_check(&self, op: &'static str, got: usize, expected: usize) -> Result<(), DistError> {
        if got != expected {
            let e = CommError::LengthMismatch { op, rank: self.rank, got, expected };
            self.abort(&e.to_string());
            return Err(e.into());
        }
        Ok(())
    }
}

impl Drop for NcclCollective {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.abort("rank panicked");
            return;
        }
        if !self.comm_aborted.load(std::sync::atomic::Ordering::SeqCst) {
            // SAFETY: the communicator is live and no longer used.
            let _ = unsafe { result::comm_destroy(self.comm) };
        }
    }
}

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&self, t: &mut Tensor, op: ReduceOp) -> Result<(), DistError> {
        let stream = self.ready()?;
        t.make_unique()?;
        let p = Self::ptr(t)?;
        // SAFETY: `p` addresses `t.numel()` elements of `t`'s dtype, owned by `t` alone
        // (made unique above) and alive until the stream reaches this work: a freed block
        // is reused only by work later on the same stream.
        unsafe { result::all_reduce(p, p, t.numel(), dtype(t), red(op), self.comm, stream) }
            .map_err(nccl_error("ncclAllReduce"))?;
        Ok(())
    }

    fn reduce_scatter(
        &self,
        input: &Tensor,
        output: &mut Tensor,
        op: ReduceOp,
    ) -> Result<(), DistError> {
        self.len_check("reduce_scatter", input.numel(), output.numel() * self.world_size)?;
        let stream = self.ready()?;
        output.make_unique()?;
        let (src, dst) = (Self::ptr(input)?, Self::ptr(output)?);
        // SAFETY: as in `all_reduce`; `input` holds `world_size` times `output`'s count.
        unsafe {
            result::reduce_scatter(
                src,
                dst,
                output.numel(),
                dtype(output),
                red(op),
                self.comm,
                stream,
            )
        }
        .map_err(nccl_error("ncclReduceScatter"))?;
        Ok(())
    }

    fn all_gather(&self, input: &Tensor, output: &mut Tensor) -> Result<(), DistError> {
        self.len_check("all_gather", output.numel(), input.numel() * self.world_size)?;
        let stream = self.ready()?;
        output.make_unique()?;
        let (src, dst) = (Self::ptr(input)?, Self::ptr(output)?);
        // SAFETY: as in `all_reduce`; `output` holds `world_size` times `input`'s count.
        unsafe { result::all_gather(src, dst, input.numel(), dtype(input), self.comm, stream) }
            .map_err(nccl_error("ncclAllGather"))?;
        Ok(())
    }

    fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<(), DistError> {
        let stream = self.ready()?;
        t.make_unique()?;
        let p = Self::ptr(t)?;
        // SAFETY: as in `all_reduce`.
        unsafe { result::broadcast(p, p, t.numel(), dtype(t), root as i32, self.comm, stream) }
            .map_err(nccl_error("ncclBroadcast"))?;
        Ok(())
    }

    fn reduce(&self, t: &mut Tensor, root: usize) -> Result<(), DistError> {
        let stream = self.ready()?;
        t.make_unique()?;
        let p = Self::ptr(t)?;
        let sum = sys::ncclRedOp_t::ncclSum;
        // SAFETY: as in `all_reduce`.
        unsafe { result::reduce(p, p, t.numel(), dtype(t), sum, root as i32, self.comm, stream) }
            .map_err(nccl_error("ncclReduce"))?;
        Ok(())
    }

    fn gather(
        &self,
        input: &Tensor,
        output: Option<&mut Tensor>,
        root: usize,
    ) -> Result<(), DistError> {
        let n = input.numel();
        let expected = if self.rank == root { n * self.world_size } else { 0 };
        self.len_check("gather", output.as_ref().map_or(0, |o| o.numel()), expected)?;
        let stream = self.ready()?;
        let src = Self::ptr(input)?;
        let bytes = n * input.dtype().size_in_bytes();
        result::group_start().map_err(nccl_error("ncclGroupStart"))?;
        // SAFETY: every buffer is a live tensor of the counts given; sends and receives
        // pair up in one group (ncclGroupEnd below), as NCCL's gather recipe does.
        let r = unsafe {
            let mut r = result::send(src, n, dtype(input), root as i32, self.comm, stream);
            if let Some(out) = output {
                out.make_unique()?;
                let base = Self::ptr(out)? as usize;
                for peer in 0..self.world_size {
                    let dst = (base + peer * bytes) as *mut c_void;
                    r = r.and(result::recv(dst, n, dtype(input), peer as i32, self.comm, stream));
                }
            }
            r
        };
        let end = result::group_end();
        r.and(end).map_err(nccl_error("ncclSend/ncclRecv (gather)"))?;
        Ok(())
    }

    fn scatter(
        &self,
        input: Option<&Tensor>,
        output: &mut Tensor,
        root: usize,
    ) -> Result<(), DistError> {
        let n = output.numel();
        let expected = if self.rank == root { n * self.world_size } else { 0 };
        self.len_check("scatter", input.map_or(0, |i| i.numel()), expected)?;
        let stream = self.ready()?;
        output.make_unique()?;
        let dst = Self::ptr(output)?;
        let bytes = n * output.dtype().size_in_bytes();
        result::group_start().map_err(nccl_error("ncclGroupStart"))?;
        // SAFETY: as in `gather`.
        let r = unsafe {
            let mut r = result::recv(dst, n, dtype(output), root as i32, self.comm, stream);
            if let Some(inp) = input {
                let base = Self::ptr(inp)? as usize;
                for peer in 0..self.world_size {
                    let src = (base + peer * bytes) as *mut c_void;
                    r = r.and(result::send(src, n, dtype(output), peer as i32, self.comm, stream));
                }
            }
            r
        };
        let end = result::group_end();
        r.and(end).map_err(nccl_error("ncclSend/ncclRecv (scatter)"))?;
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
        check_copy(src, src_offset, dst, dst_offset, len)?;
        let stream = self.ready()?;
        dst.make_unique()?;
        let size = src.dtype().size_in_bytes();
        let s = src.cuda_device_ptr()? + (src_offset * size) as u64;
        let d = dst.cuda_device_ptr()? + (dst_offset * size) as u64;
        // SAFETY: both ranges lie inside their tensors (checked above); stream-ordered.
        unsafe { cudarc::driver::result::memcpy_dtod_async(d, s, len * size, stream as _) }.map_err(
            |e| {
                DistError::Kernel(vram_kernels::Error::Device {
                    op: "cuMemcpyDtoDAsync",
                    reason: e.to_string(),
                })
            },
        )
    }

    fn abort(&self, reason: &str) {
        let mut st = self.aborted.lock().unwrap_or_else(|e| e.into_inner());
        if st.is_none() {
            *st = Some(CommError::Aborted { by: self.rank, reason: reason.to_owned() });
        }
        drop(st);
        self.abort_comm();
    }
}
