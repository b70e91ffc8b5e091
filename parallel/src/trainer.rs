//! The data-parallel trainer: one [`RankTrainer`] per device, each with its own replica,
//! collectives and caching allocator; [`train`] runs them on one thread per rank.
//!
//! Each step (`optimizer.zero_grad(); loss.backward(); optimizer.step()` in PyTorch terms):
//!
//! - [`Strategy::Ddp`]: every rank holds everything; after backward the gradients are
//!   averaged bucket by bucket ([`BucketPlan`], reverse parameter order, 25 MiB default) and
//!   every rank runs AdamW on all parameters.
//! - [`Strategy::Zero1`]: full weights and gradients, optimizer state (f32 master, moments)
//!   for this rank's shard only; gradients are reduce-scattered after backward, each rank
//!   updates its shard and the weights are all-gathered.
//! - [`Strategy::Zero2`]: as ZeRO-1, but each group's gradients are reduce-scattered as soon
//!   as backward produced them and the full gradients dropped.
//! - [`Strategy::Zero3`]: only shards persist; a group's weights are all-gathered before it
//!   runs, forward and backward, and released after.
//! - [`Strategy::DataParallel`]: PyTorch's `nn.DataParallel`: device 0 holds the model and
//!   the optimizer; each step it broadcasts the weights to fresh replicas, the outputs are
//!   gathered on device 0, which computes the loss and scatters its gradient back, and the
//!   replicas' gradients are summed into device 0's.

use std::time::{Duration, Instant};

use crate::bucket::{BucketPlan, DEFAULT_BUCKET_CAP_BYTES};
use crate::collective::Collective;
use crate::comm::ReduceOp;
use crate::error::DistError;
use crate::replica::{GroupHooks, NoHooks, Pass, Replica};
use crate::shard::{Shard, released};
use vram_amp::{AdamW, Optimizer, Param, Params};
use vram_kernels::{AdamWConfig, DType, Tensor, ops};

/// How the replicas share the work and the memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Strategy {
    /// PyTorch `DistributedDataParallel`.
    Ddp,
    /// ZeRO stage 1: optimizer state sharded.
    Zero1,
    /// ZeRO stage 2: optimizer state and gradients sharded.
    Zero2,
    /// ZeRO stage 3: optimizer state, gradients and parameters sharded.
    Zero3,
    /// PyTorch `nn.DataParallel`: outputs and loss on device 0.
    DataParallel,
}

impl Strategy {
    /// Every strategy, in the order reports list them.
    pub const ALL: [Strategy; 5] =
        [Strategy::Ddp, Strategy::Zero1, Strategy::Zero2, Strategy::Zero3, Strategy::DataParallel];

    /// A short name for reports (`ddp`, `zero-1`, `zero-2`, `zero-3`, `data-parallel`).
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Ddp => "ddp",
            Strategy::Zero1 => "zero-1",
            Strategy::Zero2 => "zero-2",
            Strategy::Zero3 => "zero-3",
            Strategy::DataParallel => "data-parallel",
        }
    }

    fn zero_stage(self) -> u8 {
        match self {
            Strategy::Zero1 => 1,
            Strategy::Zero2 => 2,
            Strategy::Zero3 => 3,
            _ => 0,
        }
    }
}

/// Settings of a data-parallel run.
#[derive(Debug, Clone, Copy)]
pub struct DpConfig {
    /// The strategy.
    pub strategy: Strategy,
    /// DDP's bucket cap in bytes (`bucket_cap_mb`; default 25 MiB).
    pub bucket_cap_bytes: usize,
    /// Keep DDP's flat bucket buffers between steps, as PyTorch does by default
    /// (`gradient_as_bucket_view=False`); `false` allocates each bucket for its reduction.
    pub keep_buckets: bool,
    /// AdamW's hyper-parameters (every strategy trains with AdamW).
    pub adamw: AdamWConfig,
}

impl DpConfig {
    /// `strategy` with PyTorch's defaults: 25 MiB buckets kept between steps, AdamW's
    /// defaults.
    pub fn new(strategy: Strategy) -> Self {
        DpConfig {
            strategy,
            bucket_cap_bytes: DEFAULT_BUCKET_CAP_BYTES,
            keep_buckets: true,
            adamw: AdamWConfig::default(),
        }
    }
}

/// What one rank measured over a run.
#[derive(Debug, Clone, PartialEq)]
pub struct RankReport {
    /// The rank.
    pub rank: usize,
    /// Peak allocated bytes on its device over the steps (`max_memory_allocated`).
    pub peak_allocated: u64,
    /// Peak reserved bytes (`max_memory_reserved`).
    pub peak_reserved: u64,
    /// Bytes allocated right after the last optimizer step, gradients still held: the
    /// model states (weights, gradients, optimizer state, kept buckets), and whatever else
    /// the device keeps (a cuBLAS workspace).
    pub state_bytes: u64,
    /// The same, as requested by the tensors (`requested_bytes`: before the allocator's
    /// rounding to 512 bytes and its unsplit remainders).
    pub state_requested_bytes: u64,
    /// Wall time of each step.
    pub step_times: Vec<Duration>,
    /// What this rank's collectives moved over the steps (not the setup's broadcast of the
    /// weights, nor `finish`), where the backend counts it ([`Collective::traffic`]).
    pub step_traffic: Option<crate::Traffic>,
}

/// One rank of a data-parallel run: its replica, its collectives and its share of the
/// optimizer.
pub struct RankTrainer<R: Replica> {
    replica: R,
    comm: Box<dyn Collective>,
    config: DpConfig,
    dtype: DType,
    groups: Vec<usize>,
    /// DDP, and `DataParallel` on device 0.
    adamw: Option<AdamW>,
    /// ZeRO: this rank's partition of every parameter.
    shards: Vec<Shard>,
    /// DataParallel: the parameters' shapes (replicas allocate them each step).
    shapes: Vec<Vec<usize>>,
    plan: BucketPlan,
    buckets: Vec<Option<Tensor>>,
}

impl<R: Replica> std::fmt::Debug for RankTrainer<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankTrainer")
            .field("rank", &self.comm.rank())
            .field("strategy", &self.config.strategy)
            .finish_non_exhaustive()
    }
}

/// A [`RankTrainer`] but its communicator.
struct Setup<R> {
    replica: R,
    config: DpConfig,
    dtype: DType,
    groups: Vec<usize>,
    adamw: Option<AdamW>,
    shards: Vec<Shard>,
    shapes: Vec<Vec<usize>>,
    plan: BucketPlan,
    buckets: Vec<Option<Tensor>>,
}

/// A list of parameters as [`Params`], for vram-amp's optimizer.
struct ParamList<'a>(Vec<&'a mut Param>);

impl Params for ParamList<'_> {
    fn params(&self) -> Vec<&Param> {
        self.0.iter().map(|p| &**p).collect()
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        self.0.iter_mut().map(|p| &mut **p).collect()
    }
}

impl<R: Replica> RankTrainer<R> {
    /// Sets up rank `comm.rank()`: rank 0's initial weights are broadcast to every rank (as
    /// DDP does at construction); ZeRO cuts this rank's shards (ZeRO-3 then releases the
    /// full weights); `DataParallel` replicas other than device 0 release theirs.
    ///
    /// # Errors
    ///
    /// A collective's error, out of memory, or [`DistError::Invalid`] for a replica without
    /// parameters or with parameters of mixed dtypes.
    pub fn new(replica: R, comm: Box<dyn Collective>, config: DpConfig) -> Result<Self, DistError> {
        let s = match Self::setup(replica, &*comm, config) {
            Ok(s) => s,
            Err(e) => {
                if !matches!(e, DistError::Comm(crate::CommError::Aborted { .. })) {
                    comm.abort(&format!("rank {}: {e}", comm.rank()));
                }
                return Err(e);
            }
        };
        Ok(RankTrainer {
            replica: s.replica,
            comm,
            config: s.config,
            dtype: s.dtype,
            groups: s.groups,
            adamw: s.adamw,
            shards: s.shards,
            shapes: s.shapes,
            plan: s.plan,
            buckets: s.buckets,
        })
    }

    fn setup(
        mut replica: R,
        comm: &dyn Collective,
        config: DpConfig,
    ) -> Result<Setup<R>, DistError> {
        let groups = replica.group_sizes();
        let mut params = replica.params_mut();
        if params.len() != groups.iter().sum::<usize>() {
            return Err(DistError::Invalid(format!(
                "the replica lists {} parameters but its groups hold {}",
                params.len(),
                groups.iter().sum::<usize>()
            )));
        }
        let dtype = params
            .first()
            .map(|p| p.value.dtype())
            .ok_or_else(|| DistError::Invalid("the replica has no parameters".into()))?;
        if params.iter().any(|p| p.value.dtype() != dtype) {
            return Err(DistError::Invalid("parameters of mixed dtypes".into()));
        }
        let shapes: Vec<Vec<usize>> = params.iter().map(|p| p.value.shape().to_vec()).collect();
        let numels: Vec<usize> = params.iter().map(|p| p.value.numel()).collect();
        for p in params.iter_mut() {
            comm.broadcast(&mut p.value, 0)?;
        }
        let mut shards = Vec::new();
        let strategy = config.strategy;
        if strategy.zero_stage() > 0 {
            for p in params.iter_mut() {
                let mut shard = Shard::new(comm, &p.value)?;
                if strategy == Strategy::Zero3 {
                    shard.work = Some(shard.working(dtype)?);
                    p.value = released(p.value.device(), dtype)?;
                }
                shards.push(shard);
            }
        }
        let root = comm.rank() == 0;
        if strategy == Strategy::DataParallel && !root {
            for p in params.iter_mut() {
                p.value = released(p.value.device(), dtype)?;
            }
        }
        let adamw = (strategy == Strategy::Ddp || (strategy == Strategy::DataParallel && root))
            .then(|| AdamW::new(config.adamw));
        let plan = BucketPlan::new(&numels, config.bucket_cap_bytes);
        let buckets = vec![None; plan.buckets.len()];
        drop(params);
        Ok(Setup { replica, config, dtype, groups, adamw, shards, shapes, plan, buckets })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The replica (its parameters are released between uses under ZeRO-3, and on ranks
    /// other than 0 under `DataParallel`: read them with [`full_params`](Self::full_params)).
    pub fn replica(&self) -> &R {
        &self.replica
    }

    /// Tells the other ranks that this one failed, so that none waits for it.
    pub fn abort(&self, reason: &str) {
        self.comm.abort(reason);
    }

    /// One training step on this rank's part of `global` (split into `world_size` equal
    /// parts). The model states stay allocated until the next step begins (its
    /// `zero_grad`), so the device's statistics right after it show them.
    ///
    /// # Errors
    ///
    /// This rank's error (out of memory, a bad batch), or [`CommError::Aborted`] when
    /// another rank failed. The caller should [`abort`](Self::abort) on its own errors
    /// ([`train`] does).
    ///
    /// [`CommError::Aborted`]: crate::CommError::Aborted
    pub fn step(&mut self, global: &R::Batch) -> Result<(), DistError> {
        let (n, rank) = (self.comm.world_size(), self.comm.rank());
        let parts = R::split(global, n)?;
        let local = parts.get(rank).ok_or_else(|| {
            DistError::Invalid(format!("the batch split into {} parts, not {n}", parts.len()))
        })?;
        for p in self.replica.params_mut() {
            p.zero_grad();
        }
        for s in &mut self.shards {
            s.grad = None;
        }
        match self.config.strategy {
            Strategy::DataParallel => self.data_parallel_step(global, local),
            Strategy::Ddp => {
                self.forward_backward(local)?;
                self.all_reduce_buckets()?;
                let mut params = ParamList(self.replica.params_mut());
                self.adamw.as_mut().map_or(Ok(()), |o| o.step(&mut params))?;
                Ok(())
            }
            Strategy::Zero1 | Strategy::Zero2 | Strategy::Zero3 => self.zero_step(local),
        }
    }

    /// Forward, local mean loss, backward, with the strategy's hooks.
    fn forward_backward(&mut self, local: &R::Batch) -> Result<(), DistError> {
        let stage = self.config.strategy.zero_stage();
        let mut zero;
        let mut none = NoHooks;
        let hooks: &mut dyn GroupHooks = if stage >= 2 {
            zero = ZeroHooks {
                stage,
                comm: &*self.comm,
                shards: &mut self.shards,
                starts: starts(&self.groups),
                dtype: self.dtype,
            };
            &mut zero
        } else {
            &mut none
        };
        self.replica.forward_backward(local, hooks).map(drop)
    }

    /// DDP: averages every gradient over the ranks, bucket by bucket.
    fn all_reduce_buckets(&mut self) -> Result<(), DistError> {
        let device = self.replica.device().clone();
        let mut params = self.replica.params_mut();
        for (b, bucket) in self.plan.buckets.iter().enumerate() {
            let mut grads = Vec::with_capacity(bucket.len());
            for &i in bucket {
                let p = &params[i];
                let g = p.grad.as_ref().ok_or_else(|| {
                    DistError::Invalid(format!(
                        "parameter {} got no gradient; every parameter must take part in \
                         the loss",
                        p.name
                    ))
                })?;
                grads.push((i, g.numel()));
            }
            let total: usize = grads.iter().map(|&(_, n)| n).sum();
            let mut flat = match self.buckets[b].take() {
                Some(t) => t,
                None => Tensor::zeros(&device, &[total], self.dtype)?,
            };
            let mut off = 0;
            for &(i, len) in &grads {
                if let Some(g) = params[i].grad.as_ref() {
                    self.comm.copy_elements(g, 0, &mut flat, off, len)?;
                }
                off += len;
            }
            self.comm.all_reduce(&mut flat, ReduceOp::Average)?;
            let mut off = 0;
            for &(i, len) in &grads {
                if let Some(g) = params[i].grad.as_mut() {
                    self.comm.copy_elements(&flat, off, g, 0, len)?;
                }
                off += len;
            }
            if self.config.keep_buckets {
                self.buckets[b] = Some(flat);
            }
        }
        Ok(())
    }

    /// ZeRO-1/2/3: forward, backward (ZeRO-2/3 reduce-scatter in the hooks), shard update,
    /// and (ZeRO-1/2) all-gather of the updated weights.
    fn zero_step(&mut self, local: &R::Batch) -> Result<(), DistError> {
        let stage = self.config.strategy.zero_stage();
        self.forward_backward(local)?;
        let comm = &*self.comm;
        let mut params = self.replica.params_mut();
        if stage == 1 {
            for (p, s) in params.iter().zip(&mut self.shards) {
                let g = p.grad.as_ref().ok_or_else(|| {
                    DistError::Invalid(format!("parameter {} got no gradient", p.name))
                })?;
                s.reduce_grad(comm, g)?;
            }
        }
        Shard::step_all(&mut self.shards, &self.config.adamw, stage >= 2)?;
        for (p, s) in params.iter_mut().zip(&mut self.shards) {
            let work = s.working(self.dtype)?;
            if stage == 3 {
                s.work = Some(work);
            } else {
                s.gather_into(comm, &work, &mut p.value)?;
            }
        }
        Ok(())
    }

    /// `nn.DataParallel`: replicate, parallel forward, gather outputs on device 0, loss and
    /// its gradient there, scatter, parallel backward, sum the gradients into device 0,
    /// step there.
    fn data_parallel_step(&mut self, global: &R::Batch, local: &R::Batch) -> Result<(), DistError> {
        let root = self.comm.rank() == 0;
        let device = self.replica.device().clone();
        for (p, shape) in self.replica.params_mut().into_iter().zip(&self.shapes) {
            if !root {
                p.value = Tensor::zeros(&device, shape, self.dtype)?;
            }
            self.comm.broadcast(&mut p.value, 0)?;
        }
        let (logits, tape) = self.replica.forward(local, &mut NoHooks)?;
        let (rows, classes) = match logits.shape() {
            [r, c] => (*r, *c),
            s => {
                return Err(DistError::Invalid(format!(
                    "logits of shape {s:?}, not [rows, classes]"
                )));
            }
        };
        let n = self.comm.world_size();
        let mut dlocal = Tensor::zeros(&device, &[rows, classes], logits.dtype())?;
        if root {
            let mut all = Tensor::zeros(&device, &[n * rows, classes], logits.dtype())?;
            self.comm.gather(&logits, Some(&mut all), 0)?;
            drop(logits);
            let targets = R::targets(global);
            let ce = ops::cross_entropy(&all, targets, None)?;
            let dall = ops::cross_entropy_backward(&all, targets, None, &ce.lse, 1.0)?;
            drop((all, ce));
            self.comm.scatter(Some(&dall), &mut dlocal, 0)?;
        } else {
            self.comm.gather(&logits, None, 0)?;
            drop(logits);
            self.comm.scatter(None, &mut dlocal, 0)?;
        }
        self.replica.backward(tape, &dlocal, &mut NoHooks)?;
        drop(dlocal);
        let mut params = self.replica.params_mut();
        for p in params.iter_mut() {
            let g = p.grad.as_mut().ok_or_else(|| {
                DistError::Invalid(format!("parameter {} got no gradient", p.name))
            })?;
            self.comm.reduce(g, 0)?;
        }
        if root {
            let mut list = ParamList(params);
            self.adamw.as_mut().map_or(Ok(()), |o| o.step(&mut list))?;
            return Ok(());
        }
        for p in params.iter_mut() {
            p.zero_grad();
            p.value = released(&device, self.dtype)?;
        }
        Ok(())
    }

    /// Every parameter's full value as f32, on every rank (gathered under ZeRO-3, broadcast
    /// from device 0 under `DataParallel`). A collective: every rank must call it.
    ///
    /// # Errors
    ///
    /// A collective's error; [`vram_kernels::Error::NoValues`] on a virtual device.
    pub fn full_params(&mut self) -> Result<Vec<Vec<f32>>, DistError> {
        let comm = &*self.comm;
        let device = self.replica.device().clone();
        let mut out = Vec::new();
        let params = self.replica.params_mut();
        for (i, p) in params.into_iter().enumerate() {
            let full = match self.config.strategy {
                Strategy::Zero3 => self.shards[i].gather(comm)?,
                Strategy::DataParallel => {
                    let mut t = if comm.rank() == 0 {
                        p.value.try_clone()?
                    } else {
                        Tensor::zeros(&device, &self.shapes[i], self.dtype)?
                    };
                    comm.broadcast(&mut t, 0)?;
                    t
                }
                _ => p.value.clone(),
            };
            out.push(full.to_f32_vec()?);
        }
        Ok(out)
    }
}

/// Index of each group's first parameter.
fn starts(groups: &[usize]) -> Vec<usize> {
    groups
        .iter()
        .scan(0, |acc, &g| {
            let s = *acc;
            *acc += g;
            Some(s)
        })
        .collect()
}

/// ZeRO-2 and ZeRO-3's work around each group.
struct ZeroHooks<'a> {
    stage: u8,
    comm: &'a dyn Collective,
    shards: &'a mut [Shard],
    starts: Vec<usize>,
    dtype: DType,
}

impl ZeroHooks<'_> {
    fn shard(&mut self, group: usize, j: usize) -> Result<&mut Shard, DistError> {
        let i = self.starts.get(group).copied().unwrap_or(usize::MAX).saturating_add(j);
        self.shards
            .get_mut(i)
            .ok_or_else(|| DistError::Invalid(format!("group {group} has no parameter {j}")))
    }
}

impl GroupHooks for ZeroHooks<'_> {
    fn before(
        &mut self,
        _pass: Pass,
        group: usize,
        params: &mut [&mut Param],
    ) -> Result<(), DistError> {
        if self.stage == 3 {
            let comm = self.comm;
            for (j, p) in params.iter_mut().enumerate() {
                p.value = self.shard(group, j)?.gather(comm)?;
            }
        }
        Ok(())
    }

    fn after(
        &mut self,
        pass: Pass,
        group: usize,
        params: &mut [&mut Param],
    ) -> Result<(), DistError> {
        let comm = self.comm;
        for (j, p) in params.iter_mut().enumerate() {
            if pass == Pass::Backward {
                let g = p.grad.take().ok_or_else(|| {
                    DistError::Invalid(format!("parameter {} got no gradient", p.name))
                })?;
                self.shard(group, j)?.reduce_grad(comm, &g)?;
            }
            if self.stage == 3 {
                p.value = released(p.value.device(), self.dtype)?;
            }
        }
        Ok(())
    }
}

/// Trains `replicas[r]` with `comms[r]` on one thread per rank for every batch of
/// `batches` (global batches, split evenly over the ranks), then lets `finish` read each
/// rank's trainer on its thread (e.g. [`RankTrainer::full_params`], a collective).
///
/// A rank that fails aborts the group with its error, so every other rank returns
/// [`CommError::Aborted`](crate::CommError::Aborted) naming it instead of waiting.
///
/// # Errors
///
/// Per rank: its own error or the abort. [`DistError::Invalid`] for all when
/// `replicas` and `comms` differ in length or are empty.
pub fn train<R, T, F>(
    replicas: Vec<R>,
    comms: Vec<Box<dyn Collective>>,
    config: DpConfig,
    batches: &[R::Batch],
    finish: F,
) -> Vec<Result<(RankReport, T), DistError>>
where
    R: Replica,
    T: Send,
    F: Fn(&mut RankTrainer<R>) -> Result<T, DistError> + Sync,
{
    if replicas.is_empty() || replicas.len() != comms.len() {
        let msg = format!("{} replicas for {} communicators", replicas.len(), comms.len());
        return vec![Err(DistError::Invalid(msg))];
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = replicas
            .into_iter()
            .zip(comms)
            .map(|(replica, comm)| {
                let finish = &finish;
                scope.spawn(move || train_rank(replica, comm, config, batches, |t| finish(t)))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(DistError::Invalid("a rank's thread panicked".into())))
            })
            .collect()
    })
}

/// One rank of a data-parallel run, on this thread: what [`train`] runs on each of its
/// threads, and what each process of a multi-process job runs with its
/// [`TcpComm`](crate::TcpComm) or NCCL collectives. Sets up the [`RankTrainer`], trains on
/// every batch of `batches` (global batches), then lets `finish` read the trainer (e.g.
/// [`RankTrainer::full_params`], a collective).
///
/// # Errors
///
/// This rank's own error (after aborting the group with it, so no other rank waits), or the
/// error of another rank that failed ([`CommError::Aborted`](crate::CommError::Aborted),
/// or a lost or silent rank named by the TCP backend).
pub fn train_rank<R: Replica, T>(
    replica: R,
    comm: Box<dyn Collective>,
    config: DpConfig,
    batches: &[R::Batch],
    finish: impl FnOnce(&mut RankTrainer<R>) -> Result<T, DistError>,
) -> Result<(RankReport, T), DistError> {
    let rank = comm.rank();
    let fail = |comm: &dyn Collective, e: DistError| {
        if !matches!(e, DistError::Comm(crate::CommError::Aborted { .. })) {
            comm.abort(&format!("rank {rank}: {e}"));
        }
        e
    };
    let mut trainer = RankTrainer::new(replica, comm, config)?;
    let device = trainer.replica.device().clone();
    device.reset_peak_stats();
    let traffic_before = trainer.comm.traffic();
    let mut times = Vec::with_capacity(batches.len());
    let (mut state_bytes, mut state_requested_bytes) = (0, 0);
    for batch in batches {
        let t0 = Instant::now();
        trainer.step(batch).map_err(|e| fail(&*trainer.comm, e))?;
        device.synchronize().map_err(|e| fail(&*trainer.comm, e.into()))?;
        // An abort may have ended a collective's kernel early: the wait then returned as if
        // it had finished.
        trainer.comm.check()?;
        times.push(t0.elapsed());
        state_bytes = device.memory_allocated();
        state_requested_bytes =
            u64::try_from(device.memory_stats().requested_bytes.all.current).unwrap_or(0);
    }
    let report = RankReport {
        rank,
        peak_allocated: device.max_memory_allocated(),
        peak_reserved: device.max_memory_reserved(),
        state_bytes,
        state_requested_bytes,
        step_times: times,
        step_traffic: trainer.comm.traffic().map(|t| t.since(traffic_before.unwrap_or_default())),
    };
    let extra = finish(&mut trainer).map_err(|e| fail(&*trainer.comm, e))?;
    device.synchronize().map_err(|e| fail(&*trainer.comm, e.into()))?;
    trainer.comm.check()?;
    Ok((report, extra))
}
