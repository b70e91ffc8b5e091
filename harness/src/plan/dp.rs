//! `cargo xtask plan --nproc N`: per-process memory and per-step traffic of data parallel
//! training over N processes (one GPU each), for DDP and ZeRO-1/2/3, measured on N virtual
//! devices by the data-parallel trainer ([`crate::dp::measure`]), with the collectives
//! metered ([`vram_parallel::Metered`]: bytes a ring moves per rank, NCCL's algorithm for
//! large messages).

use serde::Serialize;
use vram_kernels::DType;
use vram_parallel::{DistError, DpConfig, Strategy, ring_bytes_per_param};

use super::run::fixed_schedule;
use super::{PlanError, PlanKind, PlanRequest, Precision, PrecisionChoice, UNLIMITED};
use crate::dp::{DeviceKind, DpBatch, DpModel, analytic_state_bytes, measure_with};
use crate::models::Model;
use vram_alloc::human_bytes;
use vram_kernels::Device;

/// One strategy over N processes.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DpRow {
    /// `ddp`, `zero-1`, `zero-2`, `zero-3`.
    pub strategy: &'static str,
    /// The largest per-process peak of allocated bytes.
    pub peak_allocated: u64,
    /// The largest per-process peak of reserved bytes.
    pub peak_reserved: u64,
    /// Per-process model states after a step (weights, gradients, optimizer state, DDP's
    /// buckets), as the tensors requested them.
    pub model_states: u64,
    /// The same by DeepSpeed's accounting (`None`: no formula).
    pub analytic_model_states: Option<u64>,
    /// Whether the peak reserved fits the usable memory.
    pub fits: bool,
    /// Bytes each process sends (and receives) per step, counted on the collectives.
    pub bytes_per_step: u64,
    /// The same per parameter.
    pub bytes_per_param_per_step: f64,
    /// The ring's formula: `2 (N-1)/N` bytes per gradient byte for DDP, ZeRO-1 and 2,
    /// `3 (N-1)/N` for ZeRO-3.
    pub analytic_bytes_per_param_per_step: Option<f64>,
}

/// Data parallel over N processes.
#[derive(Clone, Debug, Serialize)]
pub struct DpPlan {
    /// Processes (GPUs).
    pub nproc: usize,
    /// The precision of the runs.
    pub precision: Precision,
    /// Their activation checkpointing (each process's chain under it).
    pub checkpoint: PlanKind,
    /// Parameters of the model (a tied head counted once).
    pub params: u64,
    /// Samples per process per step.
    pub per_process_batch: usize,
    /// One row per strategy.
    pub rows: Vec<DpRow>,
    /// What the figures assume and leave out.
    pub notes: Vec<String>,
}

/// Runs DDP and ZeRO-1/2/3 of `req`'s model on `nproc` virtual devices (two steps of the
/// global batch split over them, AdamW), in the precision `req` asks for (bf16 under
/// `auto`), autocast included, each process's chain under the activation checkpointing
/// `checkpoint` (a budget plan, which depends on one device's micro-batch, runs as none).
///
/// # Errors
///
/// [`PlanError::InvalidArgument`] for no processes or a batch that does not split evenly;
/// [`PlanError::DataParallel`] if a run fails.
pub fn data_parallel(
    req: &PlanRequest,
    nproc: usize,
    checkpoint: PlanKind,
) -> Result<DpPlan, PlanError> {
    if nproc == 0 || req.batch == 0 || !req.batch.is_multiple_of(nproc) {
        return Err(PlanError::InvalidArgument {
            what: "nproc",
            reason: format!(
                "the global batch of {} must split evenly over --nproc {nproc} processes",
                req.batch
            ),
        });
    }
    let mut notes = vec![
        format!(
            "one process per GPU, each with {} samples of the global batch at once (no \
             micro-batches)",
            req.batch / nproc
        ),
        "AdamW (every data-parallel strategy trains with it); 16-bit runs keep f32 master \
         weights and moments (DeepSpeed's 2 + 2 + 12 bytes per parameter)"
            .into(),
        "bytes per step: what each process sends (and receives) in its collectives' dtype \
         under a ring, counted on the calls the trainer makes (ZeRO's shards padded to N), \
         the setup's broadcast of the weights left out; NCCL may use trees for small \
         messages"
            .into(),
    ];
    let precision = match req.precision {
        PrecisionChoice::Only(p) => p,
        PrecisionChoice::Auto => Precision::Bf16,
    };
    if let Some(low) = precision.autocast() {
        notes.push(format!(
            "{}: f32 weights, gradients, optimizer state and collectives, as DDP and ZeRO \
             under `torch.autocast`; the matmuls' activations and the weights' casts in \
             {low:?} (the cast cache holds each weight's cast until the loss, under ZeRO-3 \
             too)",
            precision.label()
        ));
    }
    if req.model.arch.tied_head() {
        notes.push(
            "tied LM head: one token embedding for the input and the head (counted once); \
             its gradient, the head's and the embedding's summed, is reduced once; ZeRO-3 \
             gathers it for the embedding and again for the head (one all-gather of the \
             table per step more than the ring's formula counts)"
                .into(),
        );
    }
    let dtype = precision.dtype();
    let checkpoint = match checkpoint {
        PlanKind::Budget => {
            notes.push(
                "the single-GPU plan's budget checkpointing depends on its micro-batch: the \
                 processes here keep every activation"
                    .into(),
            );
            PlanKind::None
        }
        PlanKind::None => PlanKind::None,
        k => {
            notes.push(format!(
                "activation checkpointing {} in every process (the chain's checkpointed \
                 segments recomputed in backward; under ZeRO-3 a recomputed segment's layers \
                 are gathered before their recomputation, once per backward as without it)",
                k.label()
            ));
            k
        }
    };
    let build = |device: &Device| -> Result<DpModel, DistError> {
        let m = &req.model;
        let fail = |e: vram_accum::Error| DistError::Replica(e.to_string());
        let mut model =
            Model::with_options(device, m.arch.clone(), 0, dtype, m.options()).map_err(fail)?;
        model.set_autocast(precision.autocast()).map_err(fail)?;
        let replica = DpModel::from_model(model);
        let schedule = fixed_schedule(checkpoint, replica.chain_len())
            .map_err(|e| DistError::Invalid(e.to_string()))?;
        replica.with_checkpoint(schedule)
    };
    let batch = DpBatch {
        batch: req.model.batch(req.batch, None),
        rows_per_sample: req.model.targets_per_sample(),
    };
    let batches = [batch.clone(), batch];
    let mut rows = Vec::new();
    let mut params = 0;
    for strategy in [Strategy::Ddp, Strategy::Zero1, Strategy::Zero2, Strategy::Zero3] {
        let config = DpConfig::new(strategy);
        let kind = DeviceKind::Virtual(UNLIMITED);
        let run =
            measure_with(&build, config, nproc, kind, &batches).map_err(PlanError::DataParallel)?;
        params = run.params;
        let per_param = run.bytes_per_param_per_step();
        rows.push(DpRow {
            strategy: strategy.name(),
            peak_allocated: run.max_peak_allocated(),
            peak_reserved: run.max_peak_reserved(),
            model_states: run.max_state_bytes(),
            analytic_model_states: analytic_state_bytes(&config, dtype, run.params, nproc)
                .map(|a| a.round() as u64),
            fits: run.max_peak_reserved() <= req.usable(),
            bytes_per_step: (per_param * run.params as f64).round() as u64,
            bytes_per_param_per_step: per_param,
            analytic_bytes_per_param_per_step: ring_bytes_per_param(
                strategy,
                nproc,
                if dtype == DType::F32 { 4 } else { 2 },
            ),
        });
    }
    Ok(DpPlan {
        nproc,
        precision,
        checkpoint,
        params,
        per_process_batch: req.batch / nproc,
        rows,
        notes,
    })
}

/// The most GPUs the multi-GPU answer considers.
pub const MAX_GPUS: usize = 1024;

/// DeepSpeed's `additional_buffer_factor` in its host-memory estimators.
const HOST_BUFFER_FACTOR: f64 = 1.5;

/// One sharding strategy over N GPUs, estimated: model states as the data-parallel crate
/// lays them out ([`analytic_state_bytes`]), or as DeepSpeed's estimators give them with CPU
/// offload, plus the rest of the single-device measurement (activations per sample,
/// workspaces).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ShardRow {
    /// `ddp`, `zero-1`, `zero-2`, `zero-3`, `zero-2-offload-optimizer`,
    /// `zero-3-offload-optimizer`, `zero-3-offload-optimizer-and-params`.
    pub strategy: &'static str,
    /// ZeRO stage (0: DDP).
    pub zero_stage: u8,
    /// Optimizer state (and, for the last, parameters) kept in host memory.
    pub offload: bool,
    /// Per-GPU bytes of model states (weights, gradients, optimizer state; ZeRO-3: plus a
    /// gathered layer and its prefetch).
    pub model_states: u64,
    /// Per-GPU micro-batch of the split (0: none fits).
    pub micro: usize,
    /// Micro-batches per step on each GPU.
    pub accum: usize,
    /// Estimated per-GPU peak at that micro-batch (at the smallest when none fits).
    pub peak: u64,
    /// Whether the peak is within the usable memory.
    pub fits: bool,
    /// Host RAM per node DeepSpeed's estimator asks for (`additional_buffer_factor` 1.5).
    pub host_ram_per_node: u64,
}

/// Every strategy over one number of GPUs.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ShardTable {
    /// GPUs in all.
    pub gpus: usize,
    /// Nodes they are spread over (GPUs per node = gpus / nodes).
    pub nodes: usize,
    /// Samples per GPU per optimizer step (global batch / gpus).
    pub per_gpu_batch: usize,
    /// The precision the estimate is for.
    pub precision: Precision,
    /// The single-device configuration whose fixed and per-sample memory it starts from
    /// (precision / checkpointing / allocator, e.g. `bf16 / every-2 / expandable`).
    pub basis: String,
    /// One row per strategy, DDP first.
    pub rows: Vec<ShardRow>,
}

impl ShardTable {
    /// The first row that fits, in the table's order (DDP, ZeRO-1, 2, 3, then offload).
    pub fn first_fit(&self) -> Option<&ShardRow> {
        self.rows.iter().find(|r| r.fits)
    }
}

/// What the multi-GPU estimate starts from: one device's measurement.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ShardBasis {
    /// Parameters.
    pub params: u64,
    /// Parameters of the largest chain layer (ZeRO-3 gathers one at a time).
    pub largest_layer: u64,
    /// The precision measured.
    pub precision: Precision,
    /// Fixed bytes of the single-device measurement (model states included).
    pub fixed: u64,
    /// Bytes per sample of the single-device measurement.
    pub per_sample: u64,
    /// Usable bytes per GPU.
    pub usable: u64,
    /// Global batch.
    pub batch: usize,
    /// Fewest samples a micro-batch holds.
    pub min_micro: usize,
    /// The measured configuration (precision / checkpointing / allocator).
    pub config: String,
}

/// The strategies of a [`ShardTable`], in its order.
const SHARDINGS: [(&str, u8, bool); 7] = [
    ("ddp", 0, false),
    ("zero-1", 1, false),
    ("zero-2", 2, false),
    ("zero-3", 3, false),
    ("zero-2-offload-optimizer", 2, true),
    ("zero-3-offload-optimizer", 3, true),
    ("zero-3-offload-optimizer-and-params", 3, true),
];

/// The per-GPU estimate of every strategy over `gpus` GPUs on `nodes` nodes, or `None` when
/// the global batch does not split evenly over them.
pub(crate) fn shard_estimate(b: &ShardBasis, gpus: usize, nodes: usize) -> Option<ShardTable> {
    if gpus == 0 || nodes == 0 || !b.batch.is_multiple_of(gpus) || !gpus.is_multiple_of(nodes) {
        return None;
    }
    let per_gpu = b.batch / gpus;
    let per_node = (gpus / nodes) as f64;
    let dtype = b.precision.dtype();
    let w = dtype.size_in_bytes() as f64;
    let (p, n, layer) = (b.params as f64, gpus as f64, b.largest_layer as f64);
    // What one device holds for the model states (AdamW: 16 bytes per parameter in every
    // precision: f32 weights, gradients and moments, or 16-bit ones with an f32 master).
    let single = 16.0 * p;
    let other = (b.fixed as f64 - single).max(0.0);
    let mut rows = Vec::new();
    for (name, stage, offload) in SHARDINGS {
        let strategy = match stage {
            0 => Strategy::Ddp,
            1 => Strategy::Zero1,
            2 => Strategy::Zero2,
            _ => Strategy::Zero3,
        };
        let gathered = if stage == 3 { 2.0 * w * layer } else { 0.0 };
        // DeepSpeed's estimate_zero2/zero3_model_states_mem_needs (stage_1_and_2.py,
        // stage3.py), zero_init for ZeRO-3.
        let (states, host) = match (name, offload) {
            ("zero-2-offload-optimizer", _) => {
                (2.0 * p, p * (4.0 * n).max(16.0) * HOST_BUFFER_FACTOR)
            }
            ("zero-3-offload-optimizer", _) => {
                (4.0 * layer + 2.0 * p / n, p * 16.0 / nodes as f64 * HOST_BUFFER_FACTOR)
            }
            ("zero-3-offload-optimizer-and-params", _) => {
                (4.0 * layer, p * 18.0 / nodes as f64 * HOST_BUFFER_FACTOR)
            }
            _ => {
                let s = analytic_state_bytes(&DpConfig::new(strategy), dtype, b.params, gpus)
                    .unwrap_or(single);
                let host = if stage == 3 { layer } else { p } * 4.0 * per_node * HOST_BUFFER_FACTOR;
                (s + gathered, host)
            }
        };
        let base = other + states;
        let room = b.usable as f64 - base;
        let most = if b.per_sample == 0 {
            per_gpu
        } else if room <= 0.0 {
            0
        } else {
            (room / b.per_sample as f64).floor().min(per_gpu as f64) as usize
        };
        let micro = (b.min_micro..=most.min(per_gpu))
            .rev()
            .find(|m| per_gpu.is_multiple_of(*m))
            .unwrap_or(0);
        let shown = if micro == 0 { b.min_micro.min(per_gpu).max(1) } else { micro };
        let peak = base + shown as f64 * b.per_sample as f64;
        rows.push(ShardRow {
            strategy: name,
            zero_stage: stage,
            offload,
            model_states: states.round() as u64,
            micro,
            accum: per_gpu.checked_div(micro).unwrap_or(0),
            peak: peak.round() as u64,
            fits: micro > 0,
            host_ram_per_node: host.round() as u64,
        });
    }
    Some(ShardTable {
        gpus,
        nodes,
        per_gpu_batch: per_gpu,
        precision: b.precision,
        basis: b.config.clone(),
        rows,
    })
}

/// The answer when one device holds no configuration: the fewest GPUs (dividing the global
/// batch, up to [`MAX_GPUS`]) and, for that count, the first strategy that fits (DDP, then
/// ZeRO-1, 2, 3, then CPU offload).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MultiGpuAnswer {
    /// GPUs needed (`None`: none up to [`MAX_GPUS`]).
    pub gpus: Option<usize>,
    /// The strategy (a [`ShardRow::strategy`]).
    pub strategy: Option<String>,
    /// The answer in words.
    pub answer: String,
    /// The estimate for that count of GPUs.
    pub table: Option<ShardTable>,
}

/// The fewest GPUs on `nodes` nodes that hold `b` without offload, and how (the smallest
/// count first, then the lowest ZeRO stage); failing that, the fewest with CPU offload. The
/// answer names the offload alternative when it needs fewer GPUs.
pub(crate) fn multi_gpu_answer(b: &ShardBasis, nodes: usize, config: &str) -> MultiGpuAnswer {
    let find = |offload: bool| {
        (1..=MAX_GPUS).find_map(|gpus| {
            // One GPU without offload is the single-device search, which found nothing.
            if gpus == 1 && !offload {
                return None;
            }
            let t = shard_estimate(b, gpus, nodes.min(gpus).max(1))?;
            let r = t.rows.iter().find(|r| r.fits && r.offload == offload)?.clone();
            Some((gpus, r, t))
        })
    };
    let describe = |gpus: usize, r: &ShardRow| {
        let how = if r.offload {
            format!(
                "{} (host RAM {} per node, DeepSpeed's estimate)",
                r.strategy,
                human_bytes(r.host_ram_per_node)
            )
        } else {
            r.strategy.to_string()
        };
        format!(
            "{gpus} GPU{} with {how}: {} x {} samples per GPU, about {} per GPU",
            if gpus == 1 { "" } else { "s" },
            r.accum,
            r.micro,
            human_bytes(r.peak)
        )
    };
    let plain = find(false);
    let offload = find(true);
    let (chosen, other) = match (plain, offload) {
        (Some(p), o) => (Some(p.clone()), o.filter(|o| o.0 < p.0)),
        (None, o) => (o, None),
    };
    match chosen {
        Some((gpus, r, t)) => {
            let mut answer = format!(
                "needs {} (estimate from the single-device measurement of {config}; `--gpus \
                 {gpus}` shows every strategy)",
                describe(gpus, &r)
            );
            if let Some((g, o, _)) = &other {
                answer += &format!("; or, slower, {}", describe(*g, o));
            }
            MultiGpuAnswer {
                gpus: Some(gpus),
                strategy: Some(r.strategy.to_string()),
                answer,
                table: Some(t),
            }
        }
        None => MultiGpuAnswer {
            gpus: None,
            strategy: None,
            answer: format!(
                "does not fit: no count of GPUs up to {MAX_GPUS} that divides the global batch \
                 of {} holds it with DDP, ZeRO-1/2/3 or CPU offload (what one GPU keeps besides \
                 the model states, {} per sample and the fixed workspaces, is too much)",
                b.batch,
                human_bytes(b.per_sample)
            ),
            table: None,
        },
    }
}

/// The per-GPU estimate of every strategy for `req` over `gpus` GPUs on `nodes` nodes, from
/// `report`'s single-device measurement (its fixed and per-sample memory).
///
/// # Errors
///
/// [`PlanError::InvalidArgument`] for zero GPUs or nodes, GPUs that do not spread evenly
/// over the nodes, a global batch that does not split evenly over the GPUs, or a report
/// without a measurement; [`PlanError::Run`] if the model cannot be built.
pub fn shard_table(
    req: &PlanRequest,
    report: &super::PlanReport,
    gpus: usize,
    nodes: usize,
) -> Result<ShardTable, PlanError> {
    let bad = |reason: String| PlanError::InvalidArgument { what: "--gpus", reason };
    if gpus == 0 || nodes == 0 || gpus > MAX_GPUS {
        return Err(bad(format!("--gpus must be 1 to {MAX_GPUS} and --nodes at least 1")));
    }
    if !gpus.is_multiple_of(nodes) {
        return Err(bad(format!("{gpus} GPUs do not spread evenly over {nodes} nodes")));
    }
    if !req.batch.is_multiple_of(gpus) {
        return Err(bad(format!(
            "the global batch of {} must split evenly over --gpus {gpus}",
            req.batch
        )));
    }
    let basis = basis(req, report)?;
    shard_estimate(&basis, gpus, nodes).ok_or_else(|| bad("no even split".into()))
}

/// The estimate's starting point from a single-device report.
pub(crate) fn basis(
    req: &PlanRequest,
    report: &super::PlanReport,
) -> Result<ShardBasis, PlanError> {
    let d = report.decomposition.as_ref().ok_or_else(|| PlanError::InvalidArgument {
        what: "--gpus",
        reason: "the single-device search measured nothing to start from".into(),
    })?;
    let shape = super::search::model_shape(&req.model)?;
    Ok(ShardBasis {
        params: shape.params,
        largest_layer: shape.largest_layer,
        precision: d.precision,
        fixed: d.fixed,
        per_sample: d.per_sample,
        usable: report.usable,
        batch: req.batch,
        min_micro: report.min_micro,
        config: d.config.clone(),
    })
}
