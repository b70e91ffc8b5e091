//! Data parallelism for the reference models: [`DpModel`], the reference MLP and GPT as a
//! [`vram_parallel::Replica`] (one parameter group per layer, the GPT's embeddings a group of
//! their own); [`measure`], one data-parallel run over N host or virtual devices (its
//! collectives [`Metered`]: bytes a ring moves per step); and [`DpJob`], a training run as
//! one rank of a multi-process job ([`DpJob::train_process`], e.g. over
//! [`vram_parallel::TcpComm`]) or as all its ranks on threads of one process
//! ([`DpJob::train_threads`]), the two giving the same bits.
//!
//! `DpModel` is built from the same layers in the same order with the same random draws as
//! [`Model`], so one step of it on one device equals one step of the
//! reference model (`harness/tests/data_parallel.rs` checks it); it runs the layers one by
//! one so that ZeRO-3 can gather each layer's weights around its forward and backward.

use std::time::Duration;

use crate::data::{Batch, Dataset, Input};

use crate::models::{Arch, Model};
use vram_accum::{BoxedLayer, ForwardCtx, Mode, Param, SavedBox};
use vram_kernels::{DType, Device, Tensor, ops};
use vram_parallel::{
    Collective, DistError, DpConfig, GroupHooks, HostCollective, InProcessGroup, Metered, Pass,
    RankReport, Replica, VirtualCollective,
};

/// A reference model (MLP or GPT) as a data-parallel replica.
pub struct DpModel {
    device: Device,
    /// GPT: token and position embeddings, and the sequence length.
    embed: Option<([Param; 2], usize)>,
    layers: Vec<BoxedLayer>,
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
    /// `arch` (an MLP or a GPT) on `device`, weights drawn from `seed` as
    /// [`Model::new`](crate::models::Model::new) draws them.
    ///
    /// # Errors
    ///
    /// [`DistError::Invalid`] for a GPT with a tied LM head (not supported here); out of
    /// memory.
    pub fn new(
        device: &Device,
        arch: &Arch,
        seed: u64,
        dtype: DType,
    ) -> Result<DpModel, DistError> {
        if let Arch::Llama(l) = arch {
            return Err(DistError::Invalid(format!(
                "{} (Llama family) is not supported by the data-parallel model yet",
                l.name
            )));
        }
        if matches!(arch, Arch::Gpt { tied: true, .. }) {
            return Err(DistError::Invalid(
                "a GPT whose LM head is tied to the token embedding is not supported here: \
                 build it with `tied: false` (a separate head of vocab x d)"
                    .into(),
            ));
        }
        let parts = Model::new(device, arch.clone(), seed, dtype).map_err(accum)?.into_parts();
        let (embed, out) = (parts.embed, parts.layers);
        Ok(DpModel { device: device.clone(), embed, layers: out, dtype, forwards: 0 })
    }

    /// Number of parameters.
    pub fn param_count(&mut self) -> u64 {
        self.params_mut().iter().map(|p| p.value.numel() as u64).sum()
    }

    fn offset(&self) -> usize {
        usize::from(self.embed.is_some())
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

/// Saved states of the layers, and the token ids for the embeddings' backward.
pub struct DpTape {
    saved: Vec<SavedBox>,
    ids: Option<Vec<u32>>,
}

impl Replica for DpModel {
    type Batch = DpBatch;
    type Tape = DpTape;

    fn device(&self) -> &Device {
        &self.device
    }

    fn group_sizes(&self) -> Vec<usize> {
        let mut g: Vec<usize> = self.embed.iter().map(|_| 2).collect();
        g.extend(self.layers.iter().map(|l| l.params().len()));
        g
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut p: Vec<&mut Param> =
            self.embed.iter_mut().flat_map(|(e, _)| e.iter_mut()).collect();
        p.extend(self.layers.iter_mut().flat_map(|l| l.params_mut()));
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

    fn forward(
        &mut self,
        batch: &DpBatch,
        hooks: &mut dyn GroupHooks,
    ) -> Result<(Tensor, DpTape), DistError> {
        let mut token_ids = None;
        let mut x = match (&batch.batch.input, &mut self.embed) {
            (Input::Dense { values, shape }, None) => {
                Tensor::from_f32_slice(&self.device, shape, values, self.dtype)?
            }
            (Input::Tokens(ids), Some((e, seq))) => {
                if !ids.len().is_multiple_of(*seq) {
                    return Err(DistError::Invalid(format!(
                        "{} tokens are not whole sequences of {seq}",
                        ids.len()
                    )));
                }
                let positions: Vec<u32> = (0..ids.len()).map(|i| (i % *seq) as u32).collect();
                let [tok, pos] = e;
                hooks.before(Pass::Forward, 0, &mut [&mut *tok, &mut *pos])?;
                let t = ops::embedding(&tok.value, ids)?;
                let p = ops::embedding(&pos.value, &positions)?;
                hooks.after(Pass::Forward, 0, &mut [&mut *tok, &mut *pos])?;
                token_ids = Some(ids.clone());
                ops::add(&t, &p)?
            }
            _ => return Err(DistError::Invalid("the batch does not match the model".into())),
        };
        let mut ctx = ForwardCtx::new(Mode::Train, self.forwards);
        self.forwards += 1;
        let off = self.offset();
        let mut saved = Vec::with_capacity(self.layers.len());
        for (i, layer) in self.layers.iter_mut().enumerate() {
            hooks.before(Pass::Forward, i + off, &mut layer.params_mut())?;
            let (y, s) = layer.forward(&x, &mut ctx).map_err(accum)?;
            hooks.after(Pass::Forward, i + off, &mut layer.params_mut())?;
            saved.push(s.ok_or_else(|| DistError::Replica("a layer saved nothing".into()))?);
            x = y;
        }
        Ok((x, DpTape { saved, ids: token_ids }))
    }

    fn backward(
        &mut self,
        tape: DpTape,
        dlogits: &Tensor,
        hooks: &mut dyn GroupHooks,
    ) -> Result<(), DistError> {
        let off = self.offset();
        let want_first = self.embed.is_some();
        let mut dy = Some(dlogits.clone());
        for (i, (layer, s)) in self.layers.iter_mut().zip(tape.saved).enumerate().rev() {
            hooks.before(Pass::Backward, i + off, &mut layer.params_mut())?;
            let g = dy
                .take()
                .ok_or_else(|| DistError::Replica("a layer returned no input gradient".into()))?;
            dy = layer.backward(s, g, i > 0 || want_first).map_err(accum)?;
            hooks.after(Pass::Backward, i + off, &mut layer.params_mut())?;
        }
        match (tape.ids, dy) {
            (Some(ids), Some(dy)) => self.embed_backward(&ids, &dy, hooks),
            (Some(_), None) => {
                Err(DistError::Replica("the first layer returned no input gradient".into()))
            }
            (None, _) => Ok(()),
        }
    }
}

impl DpModel {
    /// The embeddings' gradients from the first block's input gradient.
    fn embed_backward(
        &mut self,
        ids: &[u32],
        dx: &Tensor,
        hooks: &mut dyn GroupHooks,
    ) -> Result<(), DistError> {
        let Some(([tok, pos], seq)) = &mut self.embed else { return Ok(()) };
        let positions: Vec<u32> = (0..ids.len()).map(|i| (i % *seq) as u32).collect();
        hooks.before(Pass::Backward, 0, &mut [&mut *tok, &mut *pos])?;
        let vocab = tok.value.shape().first().copied().unwrap_or(0);
        tok.accumulate_grad(ops::embedding_backward(ids, dx, vocab)?)?;
        pos.accumulate_grad(ops::embedding_backward(&positions, dx, *seq)?)?;
        hooks.after(Pass::Backward, 0, &mut [&mut *tok, &mut *pos])
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
    measure_batches(arch, dtype, config, n, kind, &batches, seed)
}

/// [`measure`] on the global batches `batches`.
pub(crate) fn measure_batches(
    arch: &Arch,
    dtype: DType,
    config: DpConfig,
    n: usize,
    kind: DeviceKind,
    batches: &[DpBatch],
    seed: u64,
) -> Result<DpRun, DistError> {
    let groups = InProcessGroup::connect(n, Duration::from_secs(600))?;
    let mut replicas = Vec::with_capacity(n);
    let mut comms: Vec<Box<dyn Collective>> = Vec::with_capacity(n);
    for comm in groups {
        let device = match kind {
            DeviceKind::Host(c) => Device::host(c),
            DeviceKind::Virtual(c) => Device::virtual_device(c),
        };
        replicas.push(DpModel::new(&device, arch, seed, dtype)?);
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
    /// The model (an MLP, or a GPT with an untied head).
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
