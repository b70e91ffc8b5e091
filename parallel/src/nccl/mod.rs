//! NCCL collectives for CUDA devices, through cudarc's `nccl` bindings (loaded at run
//! time). Work is enqueued on each device's vram stream ([`Device::cuda_stream`]), so it is
//! ordered with the ops that produced and will read the tensors.
//!
//! Two ways to make the ranks. In one process, one rank per GPU ([`NcclCollective::connect`],
//! `ncclCommInitAll`): the ranks share an abort flag; a rank that fails sets it and aborts
//! its communicator, and every other rank checks it before each collective and aborts its
//! own, so none enqueues work a dead peer will never match. In a multi-process job, one rank
//! per process ([`NcclCollective::connect_process`]): rank 0 makes NCCL's unique id and
//! hands it out through the TCP rendezvous at `MASTER_ADDR:MASTER_PORT`, every process
//! calls `ncclCommInitRank` on its `LOCAL_RANK` GPU, and the rendezvous connections stay
//! open as a watchdog: a rank that aborts, or whose process dies (its connection closes),
//! makes every other process abort its communicator (`ncclCommAbort` from the watchdog's
//! thread, which ends NCCL kernels waiting on the dead peer) and fail with an error naming
//! it.
//!
//! NCCL has no timeout of its own here: a rank that stays alive but stops calling
//! collectives leaves its peers waiting on the GPU.
//!
//! Not yet run on a GPU: it compiles on every build with the `cuda` feature, and its test
//! skips without a CUDA device; the multi-process path has run on no machine at all (the
//! TCP rendezvous it uses is tested by the TCP backend's tests).

use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::CudaStream;
use cudarc::nccl::{result, sys};

use crate::collective::{Collective, check_copy};
use crate::comm::{CommError, ReduceOp};
use crate::error::DistError;
use crate::process_group::ProcessGroupConfig;
use vram_kernels::{DType, Device, Tensor};

mod watchdog;

use watchdog::Watchdog;

/// A communicator and whether it is still live; every NCCL call on it holds the lock, so
/// the watchdog's `ncclCommAbort` never runs beside an enqueue.
#[derive(Debug)]
pub(crate) struct CommHandle {
    comm: sys::ncclComm_t,
    live: Mutex<bool>,
}

// SAFETY: NCCL allows a communicator to be used from any thread, one call at a time; every
// use of `comm` holds `live`'s lock (`lock`, `abort`, `destroy`), so calls never overlap.
unsafe impl Send for CommHandle {}
// SAFETY: as above: shared use goes through the lock.
unsafe impl Sync for CommHandle {}

impl CommHandle {
    fn lock(&self) -> MutexGuard<'_, bool> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Aborts the communicator (once): pending NCCL work on it ends.
    pub(crate) fn abort(&self) {
        let mut live = self.lock();
        if *live {
            *live = false;
            // SAFETY: `comm` is live (checked under the lock) and never used after this.
            let _ = unsafe { result::comm_abort(self.comm) };
        }
    }

    fn destroy(&self) {
        let mut live = self.lock();
        if *live {
            *live = false;
            // SAFETY: `comm` is live and never used after this.
            let _ = unsafe { result::comm_destroy(self.comm) };
        }
    }
}

/// One rank of an NCCL group on one CUDA device.
#[derive(Debug)]
pub struct NcclCollective {
    handle: Arc<CommHandle>,
    stream: Arc<CudaStream>,
    rank: usize,
    world_size: usize,
    aborted: Arc<Mutex<Option<CommError>>>,
    /// One process's ranks ([`NcclCollective::connect`]): every rank's communicator, so that
    /// a rank that fails aborts them all (a peer already waiting on the GPU for this rank's
    /// part of a collective never reaches its next abort check); empty in a multi-process
    /// job, where the watchdog tells the other processes.
    group: Arc<Vec<Arc<CommHandle>>>,
    /// Multi-process jobs: the rendezvous connections, watched.
    watchdog: Option<Watchdog>,
}

/// NCCL's error as vram's, with the result code (cudarc's `NcclError` prints only its name).
fn nccl_error(op: &'static str) -> impl Fn(result::NcclError) -> DistError {
    move |e| {
        DistError::Kernel(vram_kernels::Error::Device { op, reason: format!("NCCL: {:?}", e.0) })
    }
}

/// Why NCCL could not be loaded: cudarc looks for `libnccl.so` (and `libnccl.so.13`, `.12`,
/// ... `.9`, `.1`), while NCCL installs `libnccl.so.2` (PyTorch's `nvidia-nccl` wheel, the
/// `libnccl2` package) and only its development package adds `libnccl.so`.
pub const NCCL_MISSING: &str = "the NCCL library could not be loaded: cudarc loads it as \
     libnccl.so (or libnccl.so.13, .12, .11, .10, .9, .1), and NCCL installs libnccl.so.2; \
     put a libnccl.so symlink to libnccl.so.2 in a directory on LD_LIBRARY_PATH \
     (xtask/gpu/env.sh does on the GPU machine)";

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
    /// Whether the NCCL library can be loaded on this machine (see [`NCCL_MISSING`] for the
    /// file name it must have).
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
            return Err(DistError::Invalid(NCCL_MISSING.into()));
        }
        let ordinals: Vec<i32> = streams.iter().map(|s| s.context().ordinal() as i32).collect();
        let n = i32::try_from(devices.len())
            .map_err(|_| DistError::Invalid("too many devices".into()))?;
        let mut comms = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: `comms` has room for `n` communicators and `ordinals` lists `n` devices.
        unsafe { result::comm_init_all(comms.as_mut_ptr(), n, ordinals.as_ptr()) }
            .map_err(nccl_error("ncclCommInitAll"))?;
        let aborted = Arc::new(Mutex::new(None));
        let handles: Vec<Arc<CommHandle>> = comms
            .into_iter()
            .map(|comm| Arc::new(CommHandle { comm, live: Mutex::new(true) }))
            .collect();
        let group = Arc::new(handles.clone());
        Ok(handles
            .into_iter()
            .zip(streams)
            .enumerate()
            .map(|(rank, (handle, stream))| NcclCollective {
                handle,
                stream,
                rank,
                world_size: devices.len(),
                aborted: Arc::clone(&aborted),
                group: Arc::clone(&group),
                watchdog: None,
            })
            .collect())
    }

    /// This process's rank of a multi-process job (torchrun's conventions: see
    /// [`ProcessGroupConfig`]) on `device`, normally the CUDA device `LOCAL_RANK`: rank 0
    /// makes NCCL's unique id and hands it out through the TCP rendezvous at
    /// `MASTER_ADDR:MASTER_PORT`; every rank then calls `ncclCommInitRank`. The rendezvous
    /// connections stay open as a watchdog (see the module docs). Not yet run on a GPU.
    ///
    /// # Errors
    ///
    /// [`DistError::Invalid`] for a device that is not CUDA or a missing NCCL library; the
    /// rendezvous' errors ([`CommError::Listen`], [`CommError::MissingRanks`],
    /// [`CommError::WorldSizeMismatch`], ...); NCCL's.
    pub fn connect_process(
        config: &ProcessGroupConfig,
        device: &Device,
    ) -> Result<NcclCollective, DistError> {
        let stream = device.cuda_stream().ok_or_else(|| {
            DistError::Invalid(format!("NCCL needs a CUDA device, got {}", device.name()))
        })?;
        if !Self::is_available() {
            return Err(DistError::Invalid(NCCL_MISSING.into()));
        }
        let mine = if config.rank == 0 {
            let id = result::get_uniqueid().map_err(nccl_error("ncclGetUniqueId"))?;
            id.internal.iter().map(|&c| c as u8).collect()
        } else {
            Vec::new()
        };
        let (links, payload) = crate::tcp::rendezvous(config, &mine)?;
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        if payload.len() != id.internal.len() {
            return Err(DistError::Comm(CommError::Protocol {
                rank: 0,
                reason: format!("sent a unique id of {} bytes, not 128", payload.len()),
            }));
        }
        for (d, s) in id.internal.iter_mut().zip(&payload) {
            *d = *s as std::ffi::c_char;
        }
        stream.context().bind_to_thread().map_err(|e| {
            DistError::Kernel(vram_kernels::Error::Device {
                op: "cuCtxSetCurrent",
                reason: e.to_string(),
            })
        })?;
        let (n, r) = (
            i32::try_from(config.world_size)
                .map_err(|_| DistError::Invalid("WORLD_SIZE too large".into()))?,
            i32::try_from(config.rank).map_err(|_| DistError::Invalid("RANK too large".into()))?,
        );
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` receives one communicator; `id` is rank 0's unique id, the same on
        // every rank; this thread has the device's context bound.
        unsafe { result::comm_init_rank(&mut comm, n, id, r) }
            .map_err(nccl_error("ncclCommInitRank"))?;
        let handle = Arc::new(CommHandle { comm, live: Mutex::new(true) });
        let aborted = Arc::new(Mutex::new(None));
        let watchdog =
            Watchdog::start(links, config.rank, Arc::clone(&handle), Arc::clone(&aborted))
                .map_err(|e| {
                    handle.abort();
                    DistError::Comm(e)
                })?;
        Ok(NcclCollective {
            handle,
            stream,
            rank: config.rank,
            world_size: config.world_size,
            aborted,
            group: Arc::new(Vec::new()),
            watchdog: Some(watchdog),
        })
    }

    /// Fails when the group was aborted (aborting this rank's communicator then), else
    /// binds the device's context to this thread and returns the stream, with the
    /// communicator's lock held for the NCCL calls that follow.
    fn ready(&self) -> Result<(MutexGuard<'_, bool>, sys::cudaStream_t), DistError> {
        let aborted = self.aborted.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(e) = aborted {
            self.handle.abort();
            return Err(DistError::Comm(e));
        }
        let live = self.handle.lock();
        if !*live {
            return Err(DistError::Comm(CommError::Aborted {
                by: self.rank,
                reason: "the communicator was aborted".into(),
            }));
        }
        self.stream.context().bind_to_thread().map_err(|e| {
            DistError::Kernel(vram_kernels::Error::Device {
                op: "cuCtxSetCurrent",
                reason: e.to_string(),
            })
        })?;
        Ok((live, self.stream.cu_stream() as sys::cudaStream_t))
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
        } else {
            self.handle.destroy();
        }
        if let Some(w) = self.watchdog.take() {
            w.stop();
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
        let (_live, stream) = self.ready()?;
        t.make_unique()?;
        let p = Self::ptr(t)?;
        // SAFETY: `p` addresses `t.numel()` elements of `t`'s dtype, owned by `t` alone
        // (made unique above) and alive until the stream reaches this work: a freed block
        // is reused only by work later on the same stream.
        unsafe { result::all_reduce(p, p, t.numel(), dtype(t), red(op), self.handle.comm, stream) }
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
        let (_live, stream) = self.ready()?;
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
                self.handle.comm,
                stream,
            )
        }
        .map_err(nccl_error("ncclReduceScatter"))?;
        Ok(())
    }

    fn all_gather(&self, input: &Tensor, output: &mut Tensor) -> Result<(), DistError> {
        self.len_check("all_gather", output.numel(), input.numel() * self.world_size)?;
        let (_live, stream) = self.ready()?;
        output.make_unique()?;
        let (src, dst) = (Self::ptr(input)?, Self::ptr(output)?);
        // SAFETY: as in `all_reduce`; `output` holds `world_size` times `input`'s count.
        unsafe {
            result::all_gather(src, dst, input.numel(), dtype(input), self.handle.comm, stream)
        }
        .map_err(nccl_error("ncclAllGather"))?;
        Ok(())
    }

    fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<(), DistError> {
        let (_live, stream) = self.ready()?;
        t.make_unique()?;
        let p = Self::ptr(t)?;
        // SAFETY: as in `all_reduce`.
        unsafe {
            result::broadcast(p, p, t.numel(), dtype(t), root as i32, self.handle.comm, stream)
        }
        .map_err(nccl_error("ncclBroadcast"))?;
        Ok(())
    }

    fn reduce(&self, t: &mut Tensor, root: usize) -> Result<(), DistError> {
        let (_live, stream) = self.ready()?;
        t.make_unique()?;
        let p = Self::ptr(t)?;
        let sum = sys::ncclRedOp_t::ncclSum;
        // SAFETY: as in `all_reduce`.
        unsafe {
            result::reduce(p, p, t.numel(), dtype(t), sum, root as i32, self.handle.comm, stream)
        }
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
        let (_live, stream) = self.ready()?;
        let src = Self::ptr(input)?;
        let bytes = n * input.dtype().size_in_bytes();
        // Everything that can fail before ncclGroupStart: a return between it and
        // ncclGroupEnd would leave this thread's NCCL group open (its calls never run).
        let base = match output {
            Some(out) => {
                out.make_unique()?;
                Some(Self::ptr(out)? as usize)
            }
            None => None,
        };
        result::group_start().map_err(nccl_error("ncclGroupStart"))?;
        // SAFETY: every buffer is a live tensor of the counts given; sends and receives
        // pair up in one group (ncclGroupEnd below), as NCCL's gather recipe does.
        let r = unsafe {
            let mut r = result::send(src, n, dtype(input), root as i32, self.handle.comm, stream);
            if let Some(base) = base {
                for peer in 0..self.world_size {
                    let dst = (base + peer * bytes) as *mut c_void;
                    r = r.and(result::recv(
                        dst,
                        n,
                        dtype(input),
                        peer as i32,
                        self.handle.comm,
                        stream,
                    ));
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
        let (_live, stream) = self.ready()?;
        output.make_unique()?;
        let dst = Self::ptr(output)?;
        let bytes = n * output.dtype().size_in_bytes();
        // As in `gather`: nothing fails between the group's start and end.
        let base = input.map(|inp| Self::ptr(inp).map(|p| p as usize)).transpose()?;
        result::group_start().map_err(nccl_error("ncclGroupStart"))?;
        // SAFETY: as in `gather`.
        let r = unsafe {
            let mut r = result::recv(dst, n, dtype(output), root as i32, self.handle.comm, stream);
            if let Some(base) = base {
                for peer in 0..self.world_size {
                    let src = (base + peer * bytes) as *mut c_void;
                    r = r.and(result::send(
                        src,
                        n,
                        dtype(output),
                        peer as i32,
                        self.handle.comm,
                        stream,
                    ));
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
        let (_live, stream) = self.ready()?;
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

    fn check(&self) -> Result<(), DistError> {
        match self.aborted.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            Some(e) => Err(DistError::Comm(e)),
            None => Ok(()),
        }
    }

    fn abort(&self, reason: &str) {
        let mut st = self.aborted.lock().unwrap_or_else(|e| e.into_inner());
        let first = st.is_none();
        if first {
            *st = Some(CommError::Aborted { by: self.rank, reason: reason.to_owned() });
        }
        drop(st);
        self.handle.abort();
        // In one process, the peers' communicators too (NCCL allows `ncclCommAbort` from
        // any thread; PyTorch aborts every communicator of the group).
        for peer in self.group.iter() {
            peer.abort();
        }
        if let (true, Some(w)) = (first, &self.watchdog) {
            w.tell(self.rank, reason);
        }
    }
}
