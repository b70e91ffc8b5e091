//! Data parallelism for the reference models: [`DpModel`], a reference model as a
//! [`vram_parallel::Replica`] (one parameter group per layer, the token embedding (with
//! GPT's positions) a group of its own); [`measure`], one data-parallel run over N host or
//! virtual devices (its collectives [`Metered`]: bytes a ring moves per step); and
//! [`DpJob`], a training run as one rank of a multi-process job
//! ([`DpJob::train_process`], e.g. over [`vram_parallel::TcpComm`]) or as all its ranks on
//! threads of one process ([`DpJob::train_threads`]), the two giving the same bits.
//!
//! `DpModel` is a [`Model`] taken apart ([`Model::into_parts`]): the same layers in the same
//! order with the same random draws, its autocast and its loss (a tied LM head fused with
//! the cross-entropy), so one step of it on one device equals one step of the model
//! (`harness/tests/data_parallel.rs` checks it). It runs the layers as a vram-accum
//! [`Chain`] whose hooks wrap each layer in the trainer's group hooks, so that ZeRO-3 can
//! gather each layer's weights around its forward and backward, under a checkpoint
//! schedule if one is set ([`DpModel::with_checkpoint`]: a recomputed segment's layers are
//! gathered before their recomputation, once per backward). A tied head
//! reads the token embedding a second time after the chain: its group is gathered again
//! around the head (as DeepSpeed fetches a shared parameter at each use), and its gradient,
//! the head's and the embedding's summed, is reduced once, after the embedding's backward.

use std::time::Duration;

use crate::data::{Batch, Dataset, Input};

use crate::models::{
    Arch, EmbedParts, HeadSaved, Model, fused_tied_loss, loss_and_grad, loss_input, tied_head,
    tied_head_backward,
};
use std::borrow::Cow;

use vram_accum::autocast::cast_into;
use vram_accum::{
    BoxedLayer, Chain, ForwardCtx, HookPass, LayerHooks, Mode, Param, Schedule, Tape,
};
use vram_kernels::{DType, Device, Tensor, ops};
use vram_parallel::{
    Collective, DistError, DpConfig, GroupHooks, HostCollective, InProcessGroup, Metered, Pass,
    RankReport, Replica, VirtualCollective,
};

/// A reference model as a data-parallel replica.
pub struct DpModel {
    device: Device,
    /// GPT's token and position embeddings, Llama's token embedding: group 0.
    embed: Option<EmbedParts>,
    /// Whether the LM head is the token embedding.
    tied: bool,
    /// The low dtype of autocast, `None` without.
    autocast: Option<DType>,
    /// Whether images are converted to channels_last before the chain.
    channels_last: bool,
    /// Whether a training step fuses a tied head with its loss.
    fused_loss: bool,
    /// The chain's layers, group `i + 1` each (group `i` without embeddings).
    chain: Chain,
    /// Which segments of the chain forward keeps and which it recomputes in backward
    /// (`None`: keeps everything).
    schedule: Option<Schedule>,
    dtype: DType,
    forwards: u64,
}

fn accum(e: vram_accum::Error) -> DistError {
    match e {
        vram_accum::Error::Kernel(k) => DistError::Kernel(k),
        vram_accum::Error::Amp(a) => DistError::Amp(a),
        e => DistError::Replica(e.to_string()),
    }
}

impl DpModel {
    /// `arch` on `device`, weights of `dtype` drawn from `seed` as
    /// [`Model::new`](crate::models::Model::new) draws them.
    ///
    /// # Errors
    ///
    /// Sizes the layers refuse; out of memory.
    pub fn new(
        device: &Device,
        arch: &Arch,
        seed: u64,
        dtype: DType,
    ) -> Result<DpModel, DistError> {
        Ok(DpModel::from_model(Model::new(device, arch.clone(), seed, dtype).map_err(accum)?))
    }

    /// `model` as a replica: its layers, embeddings, tied head (fused with the loss or not,
    /// [`Model::set_fused_loss`]), autocast ([`Model::set_autocast`]) and channels_last
    /// images.
    pub fn from_model(model: Model) -> DpModel {
        let device = model.device().clone();
        let dtype = model.params().first().map_or(DType::F32, |p| p.value.dtype());
        let parts = model.into_parts();
        DpModel {
            device,
            embed: parts.embed,
            tied: parts.tied,
            autocast: parts.autocast,
            channels_last: parts.channels_last,
            fused_loss: parts.fused_loss,
            chain: Chain::new(parts.layers),
            schedule: None,
            dtype,
            forwards: 0,
        }
    }

    /// The same, recomputing the checkpointed segments of `schedule` in backward
    /// (activation checkpointing, as `torch.utils.checkpoint` under DDP or FSDP): under
    /// ZeRO-3 a recomputed segment's layers are gathered before its recomputation and
    /// released after each one's backward, so each layer is gathered once in backward as
    /// without checkpointing.
    ///
    /// # Errors
    ///
    /// [`DistError::Invalid`] for a schedule of another length than the chain's.
    pub fn with_checkpoint(mut self, schedule: Schedule) -> Result<DpModel, DistError> {
        if schedule.layer_count() != self.chain.len() {
            return Err(DistError::Invalid(format!(
                "a checkpoint schedule of {} layers for a chain of {}",
                schedule.layer_count(),
                self.chain.len()
            )));
        }
        self.schedule = Some(schedule);
        Ok(self)
    }

    /// Layers in the chain (what a checkpoint schedule is made for).
    pub fn chain_len(&self) -> usize {
        self.chain.len()
    }

    /// Number of parameters (a tied head counted once, as the token embedding).
    pub fn param_count(&mut self) -> u64 {
        self.params_mut().iter().map(|p| p.value.numel() as u64).sum()
    }

    fn offset(&self) -> usize {
        usize::from(self.embed.is_some())
    }

    /// A training context, under the model's autocast if any.
    fn context(&mut self) -> Result<ForwardCtx, DistError> {
        let ctx = ForwardCtx::new(Mode::Train, self.forwards);
        self.forwards += 1;
        match self.autocast {
            Some(low) => ctx.with_autocast(low).map_err(accum),
            None => Ok(ctx),
        }
    }

    /// The chain's input (the embeddings run as group 0) and the token ids, if any.
    fn input(
        &mut self,
        batch: &DpBatch,
        hooks: &mut dyn GroupHooks,
    ) -> Result<(Tensor, Option<Vec<u32>>), DistError> {
        match (&batch.batch.input, &mut self.embed) {
            (Input::Dense { values, shape }, None) => {
                let x = Tensor::from_f32_slice(&self.device, shape, values, self.dtype)?;
                let x = if self.channels_last { ops::permute(&x, &[0, 2, 3, 1])? } else { x };
                Ok((x, None))
            }
            (Input::Tokens(ids), Some(e)) => {
                if !ids.len().is_multiple_of(e.seq.max(1)) {
                    return Err(DistError::Invalid(format!(
                        "{} tokens are not whole sequences of {}",
                        ids.len(),
                        e.seq
                    )));
                }
                hooks.before(Pass::Forward, 0, &mut e.params_mut())?;
                let x = e.forward(ids).map_err(accum)?;
                hooks.after(Pass::Forward, 0, &mut e.params_mut())?;
                Ok((x, Some(ids.clone())))
            }
            _ => Err(DistError::Invalid("the batch does not match the model".into())),
        }
    }

    /// The chain's forward under the checkpoint schedule, each layer's group between its
    /// hooks.
    fn chain_forward(
        &mut self,
        x: Tensor,
        ctx: &mut ForwardCtx,
        hooks: &mut dyn GroupHooks,
    ) -> Result<(Tensor, Tape<'static>), DistError> {
        let plain;
        let schedule = match &self.schedule {
            Some(s) => s,
            None => {
                plain = Schedule::none(self.chain.len()).map_err(accum)?;
                &plain
            }
        };
        let mut h = ChainHooks { hooks, offset: self.offset(), error: None };
        let r = self.chain.forward_hooked(Cow::Owned(x), ctx, schedule, &mut h);
        r.map_err(|e| h.error.take().unwrap_or_else(|| accum(e)))
    }

    /// The chain's backward from its output's gradient `dy` (recomputing its checkpointed
    /// segments), then the embeddings'.
    fn chain_backward(
        &mut self,
        tape: Tape<'static>,
        ids: Option<Vec<u32>>,
        dy: Tensor,
        hooks: &mut dyn GroupHooks,
    ) -> Result<(), DistError> {
        let want_first = self.embed.is_some();
        let mut h = ChainHooks { hooks, offset: self.offset(), error: None };
        let r = self.chain.backward_hooked(tape, dy, want_first, &mut h);
        let dy = r.map_err(|e| h.error.take().unwrap_or_else(|| accum(e)))?;
        match (ids, dy, &mut self.embed) {
            (Some(ids), Some(dx), Some(e)) => {
                hooks.before(Pass::Backward, 0, &mut e.params_mut())?;
                e.backward(&ids, &dx).map_err(accum)?;
                hooks.after(Pass::Backward, 0, &mut e.params_mut())
            }
            (Some(_), None, _) => {
                Err(DistError::Replica("the first layer returned no input gradient".into()))
            }
            _ => Ok(()),
        }
    }

    /// From the chain's output: the tied head if any, the logits cast for the loss, the
    /// autocast cache cleared; the logits and the tape.
    fn finish_forward(
        &mut self,
        out: Tensor,
        saved: Tape<'static>,
        ids: Option<Vec<u32>>,
        mut ctx: ForwardCtx,
        hooks: &mut dyn GroupHooks,
    ) -> Result<(Tensor, DpTape), DistError> {
        let (logits, head) = if self.tied {
            let e = self.tied_table()?;
            hooks.before(Pass::Forward, 0, &mut e.params_mut())?;
            let r = tied_head(&e.tok, out, &mut ctx);
            hooks.after(Pass::Forward, 0, &mut e.params_mut())?;
            let (logits, head) = r.map_err(accum)?;
            (logits, Some(head))
        } else {
            (out, None)
        };
        let logits_dtype = logits.dtype();
        let logits = loss_input(logits, &ctx).map_err(accum)?;
        ctx.clear_autocast_cache();
        Ok((logits, DpTape { saved, ids, head, logits_dtype }))
    }

    /// The token embedding, for the tied head.
    fn tied_table(&mut self) -> Result<&mut EmbedParts, DistError> {
        self.embed
            .as_mut()
            .ok_or_else(|| DistError::Invalid("a tied head needs the token embedding".into()))
    }
}

/// A replica's [`GroupHooks`] as the chain's [`LayerHooks`]: layer `i` is group
/// `i + offset`. A hook's error is kept, to be returned instead of the chain's copy.
struct ChainHooks<'a> {
    hooks: &'a mut dyn GroupHooks,
    offset: usize,
    error: Option<DistError>,
}

impl ChainHooks<'_> {
    fn call(
        &mut self,
        before: bool,
        pass: HookPass,
        i: usize,
        layer: &mut BoxedLayer,
    ) -> vram_accum::Result<()> {
        let p = match pass {
            HookPass::Forward => Pass::Forward,
            HookPass::Backward => Pass::Backward,
        };
        let mut params = layer.params_mut();
        let r = if before {
            self.hooks.before(p, i + self.offset, &mut params)
        } else {
            self.hooks.after(p, i + self.offset, &mut params)
        };
        r.map_err(|e| {
            let err = vram_accum::Error::Hook {
                pass: format!("{} {p:?}", if before { "before" } else { "after" }),
                index: i,
                reason: e.to_string(),
            };
            self.error = Some(e);
            err
        })
    }
}

impl LayerHooks for ChainHooks<'_> {
    fn before(
        &mut self,
        pass: HookPass,
        i: usize,
        layer: &mut BoxedLayer,
    ) -> vram_accum::Result<()> {
        self.call(true, pass, i, layer)
    }

    fn after(
        &mut self,
        pass: HookPass,
        i: usize,
        layer: &mut BoxedLayer,
    ) -> vram_accum::Result<()> {
        self.call(false, pass, i, layer)
    }
}

/// A global or per-device batch, with the rows one sample spans (the sequence length for
/// token batches, 1 for features), so that a split never cuts a sample.
#[derive(Clone, Debug)]
pub struct DpBatch {
    /// The batch.
    pub batch: Batch,
    /// Rows (targets) per sample.
    pub rows_per_sample: usize,
}

impl DpBatch {
    /// Batch `index` of `samples` samples of `data` for data seed `seed`.
    pub fn new(data: &Dataset, seed: u64, index: u64, samples: usize) -> DpBatch {
        let rows_per_sample = match data {
            Dataset::Sequences { seq, .. } => *seq,
            _ => 1,
        };
        DpBatch { batch: data.batch(seed, index, samples), rows_per_sample }
    }
}

/// What forward keeps for backward: the layers' saved states, the token ids for the
/// embeddings' backward, a tied head's operands, and the logits' dtype before the loss's
/// cast (16 bits under autocast).
pub struct DpTape {
    saved: Tape<'static>,
    ids: Option<Vec<u32>>,
    head: Option<HeadSaved>,
    logits_dtype: DType,
}

impl Replica for DpModel {
    type Batch = DpBatch;
    type Tape = DpTape;

    fn device(&self) -> &Device {
        &self.device
    }

    fn group_sizes(&self) -> Vec<usize> {
        let mut g: Vec<usize> =
            self.embed.iter().map(|e| 1 + usize::from(e.pos.is_some())).collect();
        g.extend(self.chain.layers().iter().map(|l| l.params().len()));
        g
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut p: Vec<&mut Param> =
            self.embed.iter_mut().flat_map(EmbedParts::params_mut).collect();
        p.extend(self.chain.params_mut());
        p
    }

    fn split(batch: &DpBatch, parts: usize) -> Result<Vec<DpBatch>, DistError> {
        let rows = batch.batch.targets.len();
        let unit = batch.rows_per_sample.max(1);
        if parts == 0 || !rows.is_multiple_of(parts * unit) {
            return Err(DistError::Invalid(format!(
                "a batch of {} samples does not split into {parts} equal parts",
                rows / unit
            )));
        }
        Ok(batch
            .batch
            .split(parts)
            .into_iter()
            .map(|b| DpBatch { batch: b, rows_per_sample: unit })
            .collect())
    }

    fn targets(batch: &DpBatch) -> &[u32] {
        &batch.batch.targets
    }

    /// The logits, in the dtype the loss runs in (f32 under autocast); a tied head computes
    /// them whole (`nn.DataParallel` gathers them on device 0).
    fn forward(
        &mut self,
        batch: &DpBatch,
        hooks: &mut dyn GroupHooks,
    ) -> Result<(Tensor, DpTape), DistError> {
        let mut ctx = self.context()?;
        let (x, ids) = self.input(batch, hooks)?;
        let (out, saved) = self.chain_forward(x, &mut ctx, hooks)?;
        self.finish_forward(out, saved, ids, ctx, hooks)
    }

    fn backward(
        &mut self,
        tape: DpTape,
        dlogits: &Tensor,
        hooks: &mut dyn GroupHooks,
    ) -> Result<(), DistError> {
        let dy = cast_into(dlogits.clone(), tape.logits_dtype).map_err(accum)?;
        let dy = match tape.head {
            Some(h) => tied_head_backward(h, &mut self.tied_table()?.tok, &dy).map_err(accum)?,
            None => dy,
        };
        self.chain_backward(tape.saved, tape.ids, dy, hooks)
    }

    /// As the model's training step: a tied head fused with its loss (the logits never
    /// whole), the loss in f32 under autocast, the autocast cache cleared at the loss.
    fn forward_backward(
        &mut self,
        batch: &DpBatch,
        hooks: &mut dyn GroupHooks,
    ) -> Result<f32, DistError> {
        let targets = &batch.batch.targets;
        if self.tied && !self.fused_loss {
            let (logits, tape) = self.forward(batch, hooks)?;
            let dt = logits.dtype();
            let (loss, dlogits) = loss_and_grad(logits, targets, 1.0, dt).map_err(accum)?;
            self.backward(tape, &dlogits, hooks)?;
            return Ok(loss);
        }
        let mut ctx = self.context()?;
        let (x, ids) = self.input(batch, hooks)?;
        let (out, saved) = self.chain_forward(x, &mut ctx, hooks)?;
        let (loss, dy) = if self.tied {
            let e = self.tied_table()?;
            hooks.before(Pass::Forward, 0, &mut e.params_mut())?;
            let mut cast_bytes = 0;
            let r = fused_tied_loss(&mut e.tok, out, targets, &mut ctx, 1.0, &mut cast_bytes);
            hooks.after(Pass::Forward, 0, &mut e.params_mut())?;
            r.map_err(accum)?
        } else {
            let logits_dtype = out.dtype();
            let logits = loss_input(out, &ctx).map_err(accum)?;
            ctx.clear_autocast_cache();
            loss_and_grad(logits, targets, 1.0, logits_dtype).map_err(accum)?
        };
        self.chain_backward(saved, ids, dy, hooks)?;
        Ok(loss)
    }
}

/// Where the ranks of a run live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    /// Host devices of this capacity each: values computed, timings are host timings.
    Host(u64),
    /// Virtual devices of this capacity each: memory only, nothing computed.
    Virtual(u64),
}

/// What one data-parallel run measured.
#[derive(Clone, Debug)]
pub struct DpRun {
    /// Settings.
    pub config: DpConfig,
    /// Number of devices.
    pub devices: usize,
    /// Parameters of the model.
    pub params: u64,
    /// Per rank, in rank order.
    pub ranks: Vec<RankReport>,
    /// The cuBLAS workspace each device holds once it ran a product (0 on host devices):
    /// part of [`RankReport::state_bytes`], not a model state.
    pub workspace_bytes: u64,
}

impl DpRun {
    /// The largest per-device peak of allocated bytes.
    pub fn max_peak_allocated(&self) -> u64 {
        self.ranks.iter().map(|r| r.peak_allocated).max().unwrap_or(0)
    }

    /// The largest per-device bytes of model states after a step, as the tensors
    /// requested them (the allocator's rounding and the cuBLAS workspace left out).
    pub fn max_state_bytes(&self) -> u64 {
        let max = self.ranks.iter().map(|r| r.state_requested_bytes).max().unwrap_or(0);
        max.saturating_sub(self.workspace_bytes)
    }

    /// Bytes per parameter per step that each rank's collectives send (and receive) as a
    /// ring moves them, in the model's dtype: counted by [`Metered`] over the steps (the
    /// setup's broadcast of the weights left out); the largest over the ranks.
    pub fn bytes_per_param_per_step(&self) -> f64 {
        let steps = self.ranks.first().map_or(0, |r| r.step_times.len()).max(1) as f64;
        let sent = self.ranks.iter().filter_map(|r| r.step_traffic).map(|t| t.sent).max();
        sent.unwrap_or(0) as f64 / steps / self.params.max(1) as f64
    }

    /// The largest per-device peak of reserved bytes.
    pub fn max_peak_reserved(&self) -> u64 {
        self.ranks.iter().map(|r| r.peak_reserved).max().unwrap_or(0)
    }

    /// The slowest rank's step time of every step after the first (which allocates the
    /// optimizer state and the buckets), in ms.
    pub fn step_samples_ms(&self) -> Vec<f64> {
        let steps = self.ranks.first().map_or(0, |r| r.step_times.len());
        (1.min(steps.saturating_sub(1))..steps)
            .map(|s| {
                self.ranks
                    .iter()
                    .filter_map(|r| r.step_times.get(s))
                    .max()
                    .copied()
                    .unwrap_or(Duration::ZERO)
                    .as_secs_f64()
                    * 1e3
            })
            .collect()
    }
}

/// Trains `arch` (dtype `dtype`, AdamW) with `config` on `n` devices of `kind` for `steps`
/// global batches of `samples` samples of `data`, and returns every rank's figures.
///
/// # Errors
///
/// The first rank's own error (a rank that failed, rather than one that was told of it):
/// out of memory keeps its variant.
#[allow(clippy::too_many_arguments)]
pub fn measure(
    arch: &Arch,
    data: &Dataset,
    dtype: DType,
    config: DpConfig,
    n: usize,
    kind: DeviceKind,
    samples: usize,
    steps: usize,
    seed: u64,
) -> Result<DpRun, DistError> {
    let batches: Vec<DpBatch> =
        (0..steps).map(|i| DpBatch::new(data, seed, i as u64, samples)).collect();
    let build = |device: &Device| DpModel::new(device, arch, seed, dtype);
    measure_with(&build, config, n, kind, &batches)
}

/// A replica built on a rank's device (the same weights on every rank).
pub type BuildReplica<'a> = dyn Fn(&Device) -> Result<DpModel, DistError> + Sync + 'a;

/// [`measure`] of the replica `build` makes on each rank's device (any model, its options,
/// autocast and checkpointing: [`DpModel::from_model`], [`DpModel::with_checkpoint`]), on the
/// global batches `batches`.
///
/// # Errors
///
/// As [`measure`], and `build`'s.
pub fn measure_with(
    build: &BuildReplica<'_>,
    config: DpConfig,
    n: usize,
    kind: DeviceKind,
    batches: &[DpBatch],
) -> Result<DpRun, DistError> {
    let groups = InProcessGroup::connect(n, Duration::from_secs(600))?;
    let mut replicas = Vec::with_capacity(n);
    let mut comms: Vec<Box<dyn Collective>> = Vec::with_capacity(n);
    for comm in groups {
        let device = match kind {
            DeviceKind::Host(c) => Device::host(c),
            DeviceKind::Virtual(c) => Device::virtual_device(c),
        };
        replicas.push(build(&device)?);
        comms.push(match kind {
            DeviceKind::Host(_) => Box::new(Metered::new(HostCollective::new(comm))),
            DeviceKind::Virtual(_) => Box::new(Metered::new(VirtualCollective::new(comm))),
        });
    }
    let params = replicas.first_mut().map_or(0, DpModel::param_count);
    let workspace_bytes = replicas.first().map_or(0, |r| r.device().blas_workspace_size() as u64);
    let out = vram_parallel::train(replicas, comms, config, batches, |_| Ok(()));
    let mut ranks = Vec::with_capacity(n);
    let mut first_abort = None;
    for r in out {
        match r {
            Ok((report, ())) => ranks.push(report),
            Err(DistError::Comm(e)) => {
                first_abort.get_or_insert(DistError::Comm(e));
            }
            Err(e) => return Err(e),
        }
    }
    match first_abort {
        Some(e) => Err(e),
        None => Ok(DpRun { config, devices: n, params, ranks, workspace_bytes }),
    }
}

/// Per-device bytes of model states (weights, gradients, optimizer state, kept DDP
/// buckets) for `params` parameters of `dtype` trained with AdamW, as the trainer lays them
/// out: in 16-bit, DeepSpeed's accounting (2-byte weights and gradients, 12 bytes of
/// optimizer state: f32 master and two moments), so DDP holds 16 bytes per parameter and
/// ZeRO-1/2/3 hold 4 + 12/N, 2 + 14/N and 16/N; in f32, 4-byte weights and gradients,
/// and a master copy only where the weights are not already the f32 shard (ZeRO-1 and 2).
/// `None` for `DataParallel` (device 0 holds everything, the others nothing between steps).
pub fn analytic_state_bytes(config: &DpConfig, dtype: DType, params: u64, n: usize) -> Option<f64> {
    use vram_parallel::Strategy as S;
    let (p, n, w) = (params as f64, n as f64, dtype.size_in_bytes() as f64);
    let f32 = dtype == DType::F32;
    let adam = if f32 { 8.0 } else { 12.0 };
    let buckets = if config.keep_buckets { w } else { 0.0 };
    match config.strategy {
        S::Ddp => Some((2.0 * w + adam + buckets) * p),
        S::Zero1 => Some(2.0 * w * p + 12.0 * p / n),
        S::Zero2 => Some(w * p + (w + 12.0) * p / n),
        S::Zero3 => Some((2.0 * w + adam) * p / n),
        S::DataParallel => None,
    }
}

/// One rank's report and every parameter's final value (f32).
pub type RankResult = (RankReport, Vec<Vec<f32>>);

/// A data-parallel training run of a reference model on host devices, to run as one rank of
/// a multi-process job ([`train_process`](Self::train_process)) or with all its ranks on
/// threads of this process ([`train_threads`](Self::train_threads)). Both reduce in rank
/// order, so they give the same weights bit for bit.
#[derive(Clone, Debug)]
pub struct DpJob {
    /// The model (any [`Arch`]: an MLP, a CNN, a GPT with a tied head or not, a Llama).
    pub arch: Arch,
    /// Its data.
    pub data: Dataset,
    /// Weights' dtype.
    pub dtype: DType,
    /// Strategy and AdamW.
    pub config: DpConfig,
    /// Samples per global batch (split over the ranks).
    pub samples: usize,
    /// Optimizer steps.
    pub steps: usize,
    /// Seed of the weights and the data.
    pub seed: u64,
    /// Each rank's host device capacity.
    pub device_memory: u64,
}

impl DpJob {
    fn batches(&self) -> Vec<DpBatch> {
        (0..self.steps)
            .map(|i| DpBatch::new(&self.data, self.seed, i as u64, self.samples))
            .collect()
    }

    fn replica(&self) -> Result<DpModel, DistError> {
        DpModel::new(&Device::host(self.device_memory), &self.arch, self.seed, self.dtype)
    }

    /// Trains this process's rank with `comm` (a [`HostCollective`] over
    /// [`vram_parallel::TcpComm`]): its report and every parameter's final value.
    ///
    /// # Errors
    ///
    /// This rank's error, or another rank's (named).
    pub fn train_process(&self, comm: Box<dyn Collective>) -> Result<RankResult, DistError> {
        let replica =
            self.replica().inspect_err(|e| comm.abort(&format!("rank {}: {e}", comm.rank())))?;
        vram_parallel::train_rank(replica, comm, self.config, &self.batches(), |t| t.full_params())
    }

    /// Trains all `n` ranks on threads of this process (the in-process group): each rank's
    /// report and final parameters.
    ///
    /// # Errors
    ///
    /// The first rank's error.
    pub fn train_threads(&self, n: usize) -> Result<Vec<RankResult>, DistError> {
        let comms: Vec<Box<dyn Collective>> = InProcessGroup::connect(n, Duration::from_secs(600))?
            .into_iter()
            .map(|c| Box::new(HostCollective::new(c)) as Box<dyn Collective>)
            .collect();
        let replicas = (0..n).map(|_| self.replica()).collect::<Result<Vec<_>, _>>()?;
        vram_parallel::train(replicas, comms, self.config, &self.batches(), |t| t.full_params())
            .into_iter()
            .collect()
    }
}
