//! The planner behind `cargo xtask plan`: which micro-batch, checkpoint plan, precision and
//! allocator settings to train a model with on a GPU of a given memory, answered by running
//! each candidate's training step on a virtual device (exact allocations, no compute, no
//! GPU needed, no OOM ever reaching a real device).
//!
//! For every configuration (precision x checkpoint plan x allocator setting) the search
//! finds the largest micro-batch that fits (exponential then binary search, each probe two
//! optimizer steps on a fresh virtual device: the first creates the optimizer state, the
//! second is the steady state) and then the largest divisor of the requested global batch
//! that fits with gradient accumulation over the rest. Micro-batches start at one sample, or
//! at two when a step of one fails for another reason than memory (a batch norm over 1 x 1
//! planes, which PyTorch refuses too). "Fits" means the run's peak reserved
//! bytes stay within the usable memory (device memory minus a reserve for what vram does not
//! model: the CUDA context, library workspaces beyond cuBLAS's, other processes). A run is
//! first measured on an unlimited virtual device; only when its peak reserved does not fit
//! is it run again on a device of the usable capacity, where the allocator frees its cache
//! and retries before giving up, and a convolution whose im2col buffer does not fit works in
//! chunks of fewer images, as PyTorch's allocator and cuDNN algorithm fallback do.
//!
//! ```
//! use vram_harness::plan::{self, ModelOverrides, PlanRequest};
//!
//! let model = plan::model_from_args("gpt", &ModelOverrides::default())?;
//! let mut request = PlanRequest::new(model, 8, 64 << 20);
//! request.reserve = 0;
//! let report = plan::plan(&request, &mut plan::NoProgress)?;
//! let best = report.recommended().expect("a small GPT fits in 64 MiB");
//! assert!(best.peak_reserved <= report.usable);
//! # Ok::<(), vram_harness::plan::PlanError>(())
//! ```

mod dp;
mod error;
mod model;
mod run;
mod search;

pub use dp::{
    DpPlan, DpRow, MAX_GPUS, MultiGpuAnswer, ShardRow, ShardTable, data_parallel, shard_table,
};
pub use error::PlanError;
pub use model::{
    ModelOverrides, PlanModel, SampleInput, cudnn_choices_from_path, model_from_args,
    model_from_file, model_from_hf, model_from_spec,
};
pub use run::TimedRun;
pub(crate) use run::UNLIMITED;
pub(crate) use search::param_count;
pub use search::{Candidate, Target, estimate_cost, measure, measure_timed, plan, verify};

use serde::Serialize;
use vram_kernels::DType;

/// The optimizer whose state the plan counts. JSON: `"adamw"`, `"sgd"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum OptimizerKind {
    /// AdamW: two f32 moments per parameter (8 bytes).
    #[serde(rename = "adamw")]
    AdamW,
    /// SGD with momentum 0.9: one f32 buffer per parameter (4 bytes).
    #[serde(rename = "sgd")]
    Sgd,
}

impl OptimizerKind {
    /// The label in reports (`adamw`, `sgd`: `--optimizer`'s values).
    pub fn label(self) -> &'static str {
        match self {
            OptimizerKind::AdamW => "adamw",
            OptimizerKind::Sgd => "sgd",
        }
    }
}

/// The precision of a training run. JSON: `"fp32"`, `"bf16"`, `"fp16"`, `"bf16-autocast"`,
/// `"fp16-autocast"` ([`Precision::name`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Precision {
    /// Everything in f32.
    #[serde(rename = "fp32")]
    Fp32,
    /// bf16 weights and activations, f32 master weights in the optimizer.
    #[serde(rename = "bf16")]
    Bf16,
    /// f16 weights and activations, f32 master weights, dynamic loss scaling.
    #[serde(rename = "fp16")]
    Fp16,
    /// bf16 autocast (`torch.autocast`): f32 parameters, no master copy, linear and matmul
    /// in bf16, norms, softmax and the loss in f32.
    #[serde(rename = "bf16-autocast")]
    AutocastBf16,
    /// f16 autocast with dynamic loss scaling (`torch.cuda.amp`).
    #[serde(rename = "fp16-autocast")]
    AutocastFp16,
}

impl Precision {
    /// The dtype of the model's parameters (f32 under autocast).
    pub fn dtype(self) -> DType {
        match self {
            Precision::Fp32 | Precision::AutocastBf16 | Precision::AutocastFp16 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::Fp16 => DType::F16,
        }
    }

    /// The dtype matmuls compute in (the low dtype under autocast).
    pub fn compute_dtype(self) -> DType {
        match self {
            Precision::Fp32 => DType::F32,
            Precision::Bf16 | Precision::AutocastBf16 => DType::BF16,
            Precision::Fp16 | Precision::AutocastFp16 => DType::F16,
        }
    }

    /// The low dtype of autocast, `None` for the other precisions.
    pub fn autocast(self) -> Option<DType> {
        match self {
            Precision::AutocastBf16 => Some(DType::BF16),
            Precision::AutocastFp16 => Some(DType::F16),
            _ => None,
        }
    }

    /// Whether the run scales its loss (f16, full or autocast).
    pub fn scales_loss(self) -> bool {
        matches!(self, Precision::Fp16 | Precision::AutocastFp16)
    }

    /// The plain name, as in the JSON report: `fp32`, `bf16-autocast`, ...
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
            Precision::AutocastBf16 => "bf16-autocast",
            Precision::AutocastFp16 => "fp16-autocast",
        }
    }

    /// What to write in PyTorch for it.
    pub fn pytorch(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32 (torch.backends.cuda.matmul.allow_tf32 = True)",
            Precision::Bf16 => "model.to(torch.bfloat16) with f32 master weights in the optimizer",
            Precision::Fp16 => {
                "model.to(torch.float16) with f32 master weights and dynamic loss scaling"
            }
            Precision::AutocastBf16 => "with torch.autocast(\"cuda\", dtype=torch.bfloat16):",
            Precision::AutocastFp16 => {
                "with torch.autocast(\"cuda\", dtype=torch.float16): and torch.amp.GradScaler"
            }
        }
    }

    /// The label in reports.
    pub fn label(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
            Precision::AutocastBf16 => "bf16 autocast",
            Precision::AutocastFp16 => "fp16 autocast",
        }
    }
}

/// Which precisions to search.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrecisionChoice {
    /// Only this one.
    Only(Precision),
    /// fp32, bf16 and bf16 autocast (what most PyTorch users run); fp16 allocates as bf16
    /// does, plus the loss scaler's flag: ask for it by name.
    Auto,
}

impl PrecisionChoice {
    /// The precisions searched.
    pub fn precisions(self) -> Vec<Precision> {
        match self {
            PrecisionChoice::Only(p) => vec![p],
            PrecisionChoice::Auto => {
                vec![Precision::Fp32, Precision::Bf16, Precision::AutocastBf16]
            }
        }
    }
}

/// A kind of checkpoint plan. JSON: its label (`"none"`, `"every-2"`, `"sqrt"`, `"budget"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PlanKind {
    /// Keep every activation.
    None,
    /// Checkpoint segments of `k` layers.
    EveryK(usize),
    /// Segments of `round(sqrt(n))` layers.
    Sqrt,
    /// The least recomputation that fits the memory left (dynamic programming).
    Budget,
}

impl PlanKind {
    /// The label in reports.
    pub fn label(self) -> String {
        match self {
            PlanKind::None => "none".into(),
            PlanKind::EveryK(k) => format!("every-{k}"),
            PlanKind::Sqrt => "sqrt".into(),
            PlanKind::Budget => "budget".into(),
        }
    }
}

impl Serialize for PlanKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.label())
    }
}

/// The allocator settings searched: PyTorch's default, expandable segments, and a
/// `max_split_size` that keeps large cached blocks from being split.
pub const ALLOCATOR_SETTINGS: &[(&str, &str)] = &[
    ("default", ""),
    ("expandable", "expandable_segments:True"),
    ("max_split 128M", "max_split_size_mb:128"),
];

/// The checkpoint plans searched.
pub const PLAN_KINDS: &[PlanKind] =
    &[PlanKind::None, PlanKind::EveryK(2), PlanKind::Sqrt, PlanKind::Budget];

/// What to plan.
#[derive(Clone, Debug)]
pub struct PlanRequest {
    /// The model.
    pub model: PlanModel,
    /// Samples per optimizer step (the global batch).
    pub batch: usize,
    /// The device's memory in bytes.
    pub device_memory: u64,
    /// Bytes kept back for what vram does not model (CUDA context, library workspaces
    /// beyond cuBLAS's, other processes).
    pub reserve: u64,
    /// The optimizer.
    pub optimizer: OptimizerKind,
    /// The precisions to search.
    pub precision: PrecisionChoice,
    /// The largest micro-batch the search tries.
    pub max_micro: usize,
}

impl PlanRequest {
    /// A request with the defaults: 1 GiB reserve, AdamW, fp32 and bf16, micro-batches up
    /// to 65536 samples.
    pub fn new(model: PlanModel, batch: usize, device_memory: u64) -> Self {
        PlanRequest {
            model,
            batch,
            device_memory,
            reserve: DEFAULT_RESERVE,
            optimizer: OptimizerKind::AdamW,
            precision: PrecisionChoice::Auto,
            max_micro: 65536,
        }
    }

    /// Device memory minus the reserve.
    pub fn usable(&self) -> u64 {
        self.device_memory.saturating_sub(self.reserve)
    }
}

/// The default reserve: 1 GiB for the CUDA context (about 500 MiB on recent GPUs), cuDNN
/// and other library workspaces vram does not model.
pub const DEFAULT_RESERVE: u64 = 1 << 30;

/// Machine balance assumed by the cost model, FLOP per byte: an H100's dense bf16 rate
/// (989 TFLOP/s) over its memory bandwidth (3.35 TB/s), rounded.
pub const ASSUMED_FLOP_PER_BYTE: f64 = 300.0;

/// Cost of an fp32 FLOP relative to a 16-bit one assumed by the cost model (TF32 tensor
/// cores run at half the bf16/fp16 rate).
pub const ASSUMED_FP32_FACTOR: f64 = 2.0;

/// One configuration's result.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Row {
    /// Precision.
    pub precision: Precision,
    /// Checkpoint plan kind.
    pub plan: PlanKind,
    /// The schedule it gave, in words (segments, how many recomputed).
    pub schedule: String,
    /// Allocator setting label.
    pub allocator: String,
    /// The `PYTORCH_CUDA_ALLOC_CONF` string of the setting (empty: the default).
    pub alloc_conf: String,
    /// Whether a split of the global batch fits.
    pub fits: bool,
    /// Micro-batch size of the best split (of the smallest tried when nothing fits).
    pub micro: usize,
    /// Micro-batches per optimizer step.
    pub accum: usize,
    /// Peak allocated bytes of that split.
    pub peak_allocated: u64,
    /// Peak reserved bytes of that split (on the usable capacity when that was needed).
    pub peak_reserved: u64,
    /// Usable bytes minus peak reserved (negative: short by that much).
    pub headroom: i64,
    /// Forward FLOPs recomputed, as a fraction of the step's forward + backward FLOPs.
    pub recompute: f64,
    /// Estimated step time relative to an fp32 step of the whole batch at once without
    /// recomputation (see [`PlanReport::assumptions`]).
    pub relative_cost: f64,
    /// The largest micro-batch that fits, at most the global batch (0: not even the
    /// smallest, [`PlanReport::min_micro`]); `micro` is the largest divisor of the global
    /// batch up to it.
    pub max_micro: usize,
    /// The chain's layers to wrap in `torch.utils.checkpoint`, one entry per recomputed
    /// segment (`h0..h1`: layers h0 to h1 in one checkpoint); empty when nothing is
    /// recomputed.
    pub checkpoint: Vec<String>,
    /// Other configurations with exactly the same split and peaks, folded into this row
    /// (labels as [`Row::label`]).
    pub same_as: Vec<String>,
}

impl Row {
    /// `precision / plan / allocator`.
    pub fn label(&self) -> String {
        format!("{} / {} / {}", self.precision.label(), self.plan.label(), self.allocator)
    }

    /// The checkpoint plan in PyTorch's words: which blocks to wrap in
    /// `torch.utils.checkpoint`.
    pub fn checkpoint_advice(&self) -> String {
        if self.checkpoint.is_empty() {
            "no activation checkpointing".into()
        } else {
            format!(
                "wrap {} in torch.utils.checkpoint (one call per group: {})",
                if self.checkpoint.len() == 1 { "this group" } else { "these groups" },
                self.checkpoint.join(", ")
            )
        }
    }
}

/// The largest device memory the planner takes: the virtual device that measures a
/// candidate unlimited has 1 PiB (the largest GPUs hold under 200 GiB).
pub const MAX_DEVICE_MEMORY: u64 = UNLIMITED;

/// The largest global batch the planner takes (2^40 samples).
pub const MAX_BATCH: usize = 1 << 40;

/// Micro-batches per step a search run simulates at most: from the third micro-batch on,
/// a step allocates as the second did (the gradients are in place), so `k > 3`
/// micro-batches peak as 3 do and the run time does not grow with the batch.
pub const SIMULATED_ACCUM: usize = 3;

/// Host bytes of a virtual run's batch (token ids, pixels, targets) the search allows
/// itself: larger micro-batches are not run.
pub const HOST_BATCH_LIMIT: u64 = 512 << 20;

/// Fixed and per-sample memory of one configuration, from its peaks at micro-batches 8 and
/// 16 (the slope is the per-sample part).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Decomposition {
    /// The configuration.
    pub config: String,
    /// Its precision.
    pub precision: Precision,
    /// Its activation checkpointing (a budget plan is decomposed as none).
    pub checkpoint: PlanKind,
    /// Bytes independent of the batch (weights, master weights, gradients, optimizer
    /// state, workspaces).
    pub fixed: u64,
    /// Peak bytes added per sample (activations).
    pub per_sample: u64,
}

/// The planner's answer.
#[derive(Clone, Debug, Serialize)]
pub struct PlanReport {
    /// The model's name.
    pub model: String,
    /// Parameters.
    pub params: u64,
    /// The global batch.
    pub batch: usize,
    /// Device memory.
    pub device_memory: u64,
    /// Reserve.
    pub reserve: u64,
    /// Usable bytes.
    pub usable: u64,
    /// The optimizer.
    pub optimizer: OptimizerKind,
    /// Configurations that fit, best first (the first is the recommendation).
    pub fitting: Vec<Row>,
    /// Configurations that do not fit, closest first.
    pub not_fitting: Vec<Row>,
    /// Why the first row is recommended.
    pub why: String,
    /// Fixed vs per-sample memory of the recommended (or least-memory) configuration.
    pub decomposition: Option<Decomposition>,
    /// What would fit, when nothing does.
    pub suggestions: Vec<String>,
    /// The cost model's assumptions.
    pub assumptions: Vec<String>,
    /// What the figures leave out, and model approximations.
    pub notes: Vec<String>,
    /// The fewest samples per micro-batch the model trains on: 1, or 2 when a step of one
    /// sample fails (a batch norm over 1 x 1 planes; the reason is in `notes`).
    pub min_micro: usize,
    /// When nothing fits one device: the fewest GPUs and lowest ZeRO stage that fit
    /// (estimated), or why none does up to [`dp::MAX_GPUS`].
    pub multi_gpu: Option<MultiGpuAnswer>,
    /// Training runs on the virtual device.
    pub runs: usize,
    /// Wall time of the search in seconds.
    pub seconds: f64,
}

impl PlanReport {
    /// The recommended configuration, if any fits.
    pub fn recommended(&self) -> Option<&Row> {
        self.fitting.first()
    }
}

/// The result of `--verify`: the recommended configuration run on a real device next to
/// its prediction.
#[derive(Clone, Debug, Serialize)]
pub struct Verification {
    /// The device it ran on.
    pub device: String,
    /// The model run (reduced on the host).
    pub model: String,
    /// The configuration.
    pub config: String,
    /// Micro-batch and micro-batches per step.
    pub micro: usize,
    /// Micro-batches per step.
    pub accum: usize,
    /// Predicted (virtual device) peak allocated and reserved bytes.
    pub predicted: (u64, u64),
    /// Measured peak allocated and reserved bytes.
    pub measured: (u64, u64),
    /// Seconds the real run took.
    pub seconds: f64,
}

impl Verification {
    /// Whether the measurement equals the prediction.
    pub fn matches(&self) -> bool {
        self.predicted == self.measured
    }
}

/// Progress of a search.
pub trait PlanProgress {
    /// The search has `total` configurations to go through.
    fn begin(&mut self, total: usize);
    /// One more is done (`label` names it).
    fn advance(&mut self, label: &str);
}

/// No progress display.
pub struct NoProgress;

impl PlanProgress for NoProgress {
    fn begin(&mut self, _total: usize) {}
    fn advance(&mut self, _label: &str) {}
}
