//! `cargo xtask plan --nproc N`: per-process memory and per-step traffic of data parallel
//! training over N processes (one GPU each), for DDP and ZeRO-1/2/3, measured on N virtual
//! devices by the data-parallel trainer ([`crate::dp::measure`]), with the collectives
//! metered ([`vram_parallel::Metered`]: bytes a ring moves per rank, NCCL's algorithm for
//! large messages).

use serde::Serialize;
use vram_kernels::DType;
use vram_parallel::{DpConfig, Strategy, ring_bytes_per_param};

use super::{PlanError, PlanRequest, Precision, PrecisionChoice, UNLIMITED};
use crate::dp::{DeviceKind, DpBatch, analytic_state_bytes, measure_batches};
use crate::models::Arch;

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
    /// Parameters of the model run (an untied head where the model ties it).
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
/// `auto`).
///
/// # Errors
///
/// [`PlanError::InvalidArgument`] for no processes or a batch that does not split evenly;
/// [`PlanError::DataParallel`] if a run fails.
pub fn data_parallel(req: &PlanRequest, nproc: usize) -> Result<DpPlan, PlanError> {
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
            "one process per GPU, each with {} samples of the global batch at once: no \
             micro-batches, no checkpointing (the single-GPU plan above applies per process \
             to those)",
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
        PrecisionChoice::Only(p) if p.autocast().is_some() => {
            notes.push(format!(
                "{} runs here as fp32 (autocast's f32 weights; the 16-bit matmuls' activations \
                 are not modelled by the data-parallel trainer)",
                p.label()
            ));
            Precision::Fp32
        }
        PrecisionChoice::Only(p) => p,
        PrecisionChoice::Auto => Precision::Bf16,
    };
    let dtype = precision.dtype();
    let arch = match &req.model.arch {
        Arch::Gpt { vocab, d, layers, heads, seq, dropout, tied: true } => {
            notes.push(format!(
                "the LM head is untied here (+{} parameters): vram-parallel runs no tied head",
                vocab * d
            ));
            Arch::Gpt {
                vocab: *vocab,
                d: *d,
                layers: *layers,
                heads: *heads,
                seq: *seq,
                dropout: *dropout,
                tied: false,
            }
        }
        a => a.clone(),
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
        let run = measure_batches(&arch, dtype, config, nproc, kind, &batches, 0)
            .map_err(PlanError::DataParallel)?;
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
    Ok(DpPlan { nproc, precision, params, per_process_batch: req.batch / nproc, rows, notes })
}
