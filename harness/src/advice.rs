//! The report's first section, "What should I do?": for each real-size model, peak memory
//! split into a fixed part (what the peak holds whatever the batch: weights and optimizer
//! state, the gradients made by the time of the peak, workspaces) and a per-sample part
//! (activations), beside the states' bytes per parameter, and the
//! techniques ranked by the memory they save at a realistic batch against their time cost
//! and numerical risk.
//!
//! Every memory figure is a training step (two optimizer steps, the second with the
//! optimizer state in place) on the virtual device ([`crate::plan::measure`]): exact for
//! vram's own allocations, computed by nothing. Time costs are the planner's cost model
//! ([`crate::plan::estimate_cost`]: FLOPs and weight traffic under stated assumptions), not
//! host timings.

use crate::ExperimentError;
use crate::plan::UNLIMITED;
use crate::plan::{
    self, Candidate, ModelOverrides, OptimizerKind, PlanError, PlanKind, PlanModel, Precision,
    Target,
};
use serde::Serialize;
use std::fmt::Write as _;
use vram_alloc::human_bytes;

/// One model's decomposition and ranked techniques.
#[derive(Clone, Debug, Serialize)]
pub struct ModelAdvice {
    /// Model name with its sizes.
    pub model: String,
    /// Parameters.
    pub params: u64,
    /// The batch the techniques are compared at.
    pub batch: usize,
    /// Model states with AdamW, 16 bytes per parameter alike in fp32 (weights 4, gradients
    /// 4, moments 8), in full bf16 (2 + 2, f32 masters 4, moments 8) and under bf16 autocast
    /// (4 + 4 + 8, plus 2 bytes of 16-bit weight copies while a step runs).
    pub state_bytes: u64,
    /// Measured fixed part (fp32, AdamW): the [`Footprint`]'s intercept at zero samples.
    pub fixed_bytes: u64,
    /// Measured per-sample part (fp32, AdamW): the [`Footprint`]'s slope.
    pub per_sample_bytes: u64,
    /// Share of the peak at one sample that is fixed.
    pub fixed_share_at_one: f64,
    /// Share of the peak at `batch` samples that is fixed.
    pub fixed_share_at_batch: f64,
    /// Techniques, most memory saved first.
    pub techniques: Vec<TechniqueRow>,
}

/// One technique (or combination) at the comparison batch.
#[derive(Clone, Debug, Serialize)]
pub struct TechniqueRow {
    /// What changes from the fp32 / AdamW / no checkpointing / default allocator baseline.
    pub technique: &'static str,
    /// Peak allocated bytes.
    pub peak_allocated: u64,
    /// Peak reserved bytes.
    pub peak_reserved: u64,
    /// Reserved bytes saved against the baseline (negative: costs memory).
    pub saved_bytes: i64,
    /// Estimated step cost relative to the baseline (1.0 = the same).
    pub relative_cost: f64,
    /// What it risks numerically.
    pub risk: &'static str,
}

/// The whole section.
#[derive(Clone, Debug, Serialize)]
pub struct Advice {
    /// One entry per model.
    pub models: Vec<ModelAdvice>,
}

struct Tech {
    name: &'static str,
    precision: Precision,
    plan: PlanKind,
    alloc_conf: &'static str,
    optimizer: OptimizerKind,
    accum: usize,
    risk: &'static str,
}

const TECHNIQUES: &[Tech] = &[
    Tech {
        name: "baseline: fp32, AdamW, no checkpointing",
        precision: Precision::Fp32,
        plan: PlanKind::None,
        alloc_conf: "",
        optimizer: OptimizerKind::AdamW,
        accum: 1,
        risk: "-",
    },
    Tech {
        name: "full bf16 (weights and activations), f32 master weights",
        precision: Precision::Bf16,
        plan: PlanKind::None,
        alloc_conf: "",
        optimizer: OptimizerKind::AdamW,
        accum: 1,
        risk: "low: 8-bit mantissa in activations (see mixed-precision's loss agreement)",
    },
    Tech {
        name: "bf16 autocast (torch.autocast): f32 weights, 16-bit matmuls",
        precision: Precision::AutocastBf16,
        plan: PlanKind::None,
        alloc_conf: "",
        optimizer: OptimizerKind::AdamW,
        accum: 1,
        risk: "low: 16-bit matmul inputs only; norms, softmax, loss and weights stay f32",
    },
    Tech {
        name: "fp16 + dynamic loss scaling, f32 masters",
        precision: Precision::Fp16,
        plan: PlanKind::None,
        alloc_conf: "",
        optimizer: OptimizerKind::AdamW,
        accum: 1,
        risk: "medium: overflow; the scaler skips steps (counted in mixed-precision)",
    },
    Tech {
        name: "checkpointing, sqrt(n) segments",
        precision: Precision::Fp32,
        plan: PlanKind::Sqrt,
        alloc_conf: "",
        optimizer: OptimizerKind::AdamW,
        accum: 1,
        risk: "none: gradients bit-identical (checkpointing's test)",
    },
    Tech {
        name: "checkpointing, every 2 layers",
        precision: Precision::Fp32,
        plan: PlanKind::EveryK(2),
        alloc_conf: "",
        optimizer: OptimizerKind::AdamW,
        accum: 1,
        risk: "none: gradients bit-identical",
    },
    Tech {
        name: "gradient accumulation, 4 micro-batches",
        precision: Precision::Fp32,
        plan: PlanKind::None,
        alloc_conf: "",
        optimizer: OptimizerKind::AdamW,
        accum: 4,
        risk: "none: equal to the full batch up to summation order",
    },
    Tech {
        name: "SGD with momentum instead of AdamW",
        precision: Precision::Fp32,
        plan: PlanKind::None,
        alloc_conf: "",
        optimizer: OptimizerKind::Sgd,
        accum: 1,
        risk: "high: a different optimizer; convergence and tuning change",
    },
    Tech {
        name: "expandable segments (allocator)",
        precision: Precision::Fp32,
        plan: PlanKind::None,
        alloc_conf: "expandable_segments:True",
        optimizer: OptimizerKind::AdamW,
        accum: 1,
        risk: "none: allocator policy only",
    },
    Tech {
        name: "bf16 + sqrt checkpointing + 4 micro-batches + expandable",
        precision: Precision::Bf16,
        plan: PlanKind::Sqrt,
        alloc_conf: "expandable_segments:True",
        optimizer: OptimizerKind::AdamW,
        accum: 4,
        risk: "low (bf16's)",
    },
];

/// The models of the section and the batch each is compared at (a realistic training batch
/// per device): the quick run takes the first two.
const MODELS: &[(&str, usize)] = &[
    ("gpt2-small", 8),
    ("resnet50", 64),
    ("gpt2-medium", 8),
    ("vit-b-like", 64),
    ("mobilenetv3-like", 64),
];

fn candidate(t: &Tech, micro: usize, accum: usize) -> Candidate {
    Candidate {
        precision: t.precision,
        plan: t.plan,
        alloc_conf: t.alloc_conf.into(),
        optimizer: t.optimizer,
        micro,
        accum,
    }
}

fn peak(model: &PlanModel, c: &Candidate) -> Result<(u64, u64), PlanError> {
    plan::measure(model, c, Target::Virtual(UNLIMITED))?.ok_or_else(|| PlanError::InvalidArgument {
        what: "model",
        reason: format!("{} ran out of a {} virtual device", model.name, human_bytes(UNLIMITED)),
    })
}

/// The batches a [`Footprint`] is fitted over, for every model.
pub const FOOTPRINT_BATCHES: &[usize] = &[1, 2, 4, 8, 16];

/// A model's peak training memory (fp32, AdamW, no checkpointing, default allocator, two
/// optimizer steps on the virtual device) as a line in the batch: `fixed + per_sample x
/// batch`, the least-squares line through the peaks allocated at [`FOOTPRINT_BATCHES`]. The
/// one computation of these figures: the advice table, `batch-size` and `lighter-model`
/// all quote it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Footprint {
    /// The line's intercept: what the step holds whatever the batch (weights, gradients,
    /// AdamW's moments, workspaces), in bytes.
    pub fixed: u64,
    /// The line's slope: bytes per sample (activations and what scales with them).
    pub per_sample: u64,
    /// How well the line fits the measured peaks (1 = exactly).
    pub r2: f64,
}

/// The [`Footprint`] of `model`, measured once per architecture and process (every caller
/// gets the same figures).
///
/// # Errors
///
/// A model that cannot be built or run on the virtual device.
pub fn footprint(model: &PlanModel) -> Result<Footprint, PlanError> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static MEASURED: OnceLock<Mutex<HashMap<String, Footprint>>> = OnceLock::new();
    let key = format!("{:?}", model.arch);
    let memo = MEASURED.get_or_init(Default::default);
    if let Some(f) = memo.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(*f);
    }
    let base = &TECHNIQUES[0];
    let mut ys = Vec::new();
    for &b in FOOTPRINT_BATCHES {
        ys.push(peak(model, &candidate(base, b, 1))?.0 as f64);
    }
    let xs: Vec<f64> = FOOTPRINT_BATCHES.iter().map(|&b| b as f64).collect();
    let (a, slope, r2) = crate::experiments::fit_line(&xs, &ys);
    let f = Footprint {
        fixed: a.max(0.0).round() as u64,
        per_sample: slope.max(0.0).round() as u64,
        r2,
    };
    memo.lock().unwrap_or_else(|e| e.into_inner()).insert(key, f);
    Ok(f)
}

fn one_model(name: &str, batch: usize) -> Result<ModelAdvice, PlanError> {
    let model = plan::model_from_args(name, &ModelOverrides::default())?;
    let Footprint { fixed, per_sample, .. } = footprint(&model)?;
    let (params, _) = plan::param_count(&model)?;
    let mut rows = Vec::new();
    let mut baseline = None;
    for t in TECHNIQUES {
        let c = candidate(t, batch / t.accum, t.accum);
        let (alloc, reserved) = match peak(&model, &c) {
            Ok(p) => p,
            // A layer without autocast rules (a user model's residual MLP): the technique
            // does not apply to this model.
            Err(PlanError::Run { source, .. })
                if matches!(*source, vram_accum::Error::AutocastUnsupported { .. }) =>
            {
                continue;
            }
            Err(e) => return Err(e),
        };
        let (_, cost) = plan::estimate_cost(&model, &c)?;
        let (base_reserved, base_cost) = *baseline.get_or_insert((reserved, cost));
        rows.push(TechniqueRow {
            technique: t.name,
            peak_allocated: alloc,
            peak_reserved: reserved,
            saved_bytes: base_reserved as i64 - reserved as i64,
            relative_cost: cost / base_cost,
            risk: t.risk,
        });
    }
    let (first, rest) = rows.split_at_mut(1);
    rest.sort_by_key(|r| std::cmp::Reverse(r.saved_bytes));
    let techniques = first.iter().chain(rest.iter()).cloned().collect();
    let at = |n: usize| fixed as f64 / (fixed + n as u64 * per_sample).max(1) as f64;
    Ok(ModelAdvice {
        model: model.name.clone(),
        params,
        batch,
        state_bytes: 16 * params,
        fixed_bytes: fixed,
        per_sample_bytes: per_sample,
        fixed_share_at_one: at(1),
        fixed_share_at_batch: at(batch),
        techniques,
    })
}

/// Computes the section: two models when `quick`, five otherwise.
///
/// # Errors
///
/// A model that cannot be built or run on the virtual device.
pub fn compute(quick: bool) -> Result<Advice, ExperimentError> {
    let n = if quick { 2 } else { MODELS.len() };
    let models = MODELS[..n]
        .iter()
        .map(|&(name, batch)| one_model(name, batch))
        .collect::<Result<_, _>>()?;
    Ok(Advice { models })
}

/// The section as Markdown.
pub fn markdown(a: &Advice) -> String {
    let mut s = String::from("## What should I do?\n\n");
    s.push_str(
        "Peak memory of one training step at real model sizes, measured on the virtual \
         device (exact for vram's own allocations; a GPU adds the CUDA context, ~0.5 GiB, \
         and library workspaces beyond cuBLAS's, which `cargo xtask plan --reserve` keeps \
         back). Fixed = what the peak holds whatever the batch (the line's intercept through \
         the peaks at 1 to 16 samples, fp32 and AdamW); per sample = activations. The model \
         states are 16 bytes per parameter for AdamW in fp32 (and also in full bf16, whose f32 \
         master weights keep it at 2 + 2 + 4 + 8, and under bf16 autocast, whose weights stay \
         f32: 4 + 4 + 8, plus 2 bytes of 16-bit weight copies during a step), but not all of \
         them are alive at the peak: `zero_grad` frees the gradients (PyTorch's \
         `set_to_none`), so weights and AdamW's moments (12 bytes per parameter) are there \
         all the time and the gradients only once backward has made them. Where the peak \
         falls as backward begins (the transformers; GPT-2 has made only its tied LM head's \
         gradient then), the fixed part lies near 12 bytes per parameter; where it falls later (the \
         CNNs), near 16, the workspaces on top.\n\n",
    );
    s.push_str(
        "| model | parameters | weights + moments, 12 B/param | + gradients, 16 B/param | fixed (measured) | per sample | fixed share at 1 sample | at the batch |\n|---|---|---|---|---|---|---|---|\n",
    );
    for m in &a.models {
        let _ = writeln!(
            s,
            "| {} | {:.1} M | {} | {} | {} | {} | {:.0}% | {:.0}% (batch {}) |",
            m.model,
            m.params as f64 / 1e6,
            human_bytes(m.state_bytes / 4 * 3),
            human_bytes(m.state_bytes),
            human_bytes(m.fixed_bytes),
            human_bytes(m.per_sample_bytes),
            100.0 * m.fixed_share_at_one,
            100.0 * m.fixed_share_at_batch,
            m.batch
        );
    }
    s.push_str(
        "\nWhere the fixed share is high (large models, small batches), techniques that cut \
         activations (checkpointing, smaller batches, accumulation, 16-bit activations) save \
         little: only sharding the states (ZeRO, see data-parallel), a lighter optimizer or \
         a smaller model do. Techniques ranked by the reserved memory they save at each \
         model's batch; cost is the planner's estimate relative to the baseline (FLOPs and \
         weight traffic, assuming 16-bit math at twice fp32's rate: a GPU assumption, not a \
         host timing).\n",
    );
    for m in &a.models {
        let _ = write!(
            s,
            "\n### {} at batch {}\n\n| technique | peak allocated | peak reserved | saved | est. cost | numerical risk |\n|---|---|---|---|---|---|\n",
            m.model, m.batch
        );
        for r in &m.techniques {
            let saved = if r.saved_bytes >= 0 {
                human_bytes(r.saved_bytes as u64)
            } else {
                format!("-{}", human_bytes(r.saved_bytes.unsigned_abs()))
            };
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {:.2}x | {} |",
                r.technique,
                human_bytes(r.peak_allocated),
                human_bytes(r.peak_reserved),
                saved,
                r.relative_cost,
                r.risk
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fixed_part_is_one_figure_whoever_asks() {
        let model = plan::model_from_args("resnet50", &ModelOverrides::default()).unwrap();
        let fp = footprint(&model).unwrap();
        // The advice table quotes the same line.
        let advice = one_model("resnet50", 64).unwrap();
        assert_eq!((advice.fixed_bytes, advice.per_sample_bytes), (fp.fixed, fp.per_sample));
        // The line is the least-squares one through the peaks at FOOTPRINT_BATCHES: each
        // measured peak lies near it (the allocator's rounding aside).
        for &b in FOOTPRINT_BATCHES {
            let (p, _) = peak(&model, &candidate(&TECHNIQUES[0], b, 1)).unwrap();
            let line = fp.fixed + fp.per_sample * b as u64;
            let off = (p as f64 - line as f64).abs() / p as f64;
            assert!(off < 0.05, "batch {b}: peak {p}, line {line}");
        }
        assert!(fp.r2 > 0.99, "{fp:?}");
        // ResNet-50's peak comes late in backward: weights, gradients and AdamW's two
        // moments (16 B per parameter) are all there, whatever the batch.
        let (params, _) = plan::param_count(&model).unwrap();
        let states = 16 * params;
        eprintln!("resnet50: {fp:?}, states {states}");
        assert!(fp.fixed >= states, "{fp:?} vs states {states}");
    }

    /// GPT-2 small's peak comes as backward begins: weights and moments (12 B per
    /// parameter) are there, the gradients not yet but the tied LM head's (the token table,
    /// made by the fused loss before the chain's backward), so the intercept lies between
    /// 12 B per parameter plus that gradient and 16 B per parameter.
    #[test]
    fn a_transformers_fixed_part_holds_its_moments_but_not_all_its_gradients() {
        let model = plan::model_from_args("gpt2-small", &ModelOverrides::default()).unwrap();
        let fp = footprint(&model).unwrap();
        let (params, _) = plan::param_count(&model).unwrap();
        let table = 4 * 50257 * 768;
        eprintln!("gpt2-small: {fp:?}, params {params}");
        assert!(fp.fixed >= 12 * params + table, "{fp:?}");
        assert!(fp.fixed < 16 * params, "{fp:?}");
    }
}
