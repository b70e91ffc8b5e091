//! Which model to plan for: names and size overrides, user model files, the forward FLOPs of
//! each chain layer (for the cost model) and the batches a run feeds.

use super::PlanError;
use crate::data::{Batch, Input};
use crate::models::Arch;
use crate::models::spec::{InputSpec, LayerSpec, ModelSpec, Resolved};
use crate::rng::Rng;
use serde::Serialize;

/// The model names [`model_from_args`] knows.
pub const KNOWN_MODELS: &[&str] =
    &["gpt2-small", "gpt2-medium", "resnet50", "gpt", "resnet", "mobilenet", "mlp"];

/// Size parameters that override a named model's defaults.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelOverrides {
    /// Sequence length (token models).
    pub seq: Option<usize>,
    /// Image side (image models).
    pub side: Option<usize>,
    /// Width: `d` of a GPT, first-stage channels of a CNN, hidden width of the MLP.
    pub width: Option<usize>,
    /// Depth: transformer blocks, blocks per CNN stage, hidden layers of the MLP.
    pub depth: Option<usize>,
    /// Vocabulary (token models).
    pub vocab: Option<usize>,
    /// Output classes (classifiers).
    pub classes: Option<usize>,
}

/// What one sample is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum SampleInput {
    /// `seq` token ids below `vocab`; one target per token.
    Tokens {
        /// Sequence length.
        seq: usize,
        /// Vocabulary.
        vocab: usize,
    },
    /// Real values of this shape (without the batch dimension); one target per sample.
    Dense {
        /// Per-sample shape.
        shape: Vec<usize>,
    },
}

/// A model to plan for.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanModel {
    /// Name for reports, with its size parameters.
    pub name: String,
    /// The architecture.
    pub arch: Arch,
    /// One sample.
    pub input: SampleInput,
    /// Classes of the loss.
    pub classes: usize,
    /// Notes on approximations in this model, printed with the report.
    pub notes: Vec<String>,
}

fn invalid(what: &'static str, reason: impl Into<String>) -> PlanError {
    PlanError::InvalidArgument { what, reason: reason.into() }
}

/// The model called `name`, with `overrides` applied: the one place that maps names to
/// architectures.
///
/// # Errors
///
/// [`PlanError::UnknownModel`] listing the known names; [`PlanError::InvalidArgument`] for
/// a zero size or an override the model has no use for.
pub fn model_from_args(name: &str, o: &ModelOverrides) -> Result<PlanModel, PlanError> {
    for (what, v) in [
        ("seq", o.seq),
        ("side", o.side),
        ("width", o.width),
        ("depth", o.depth),
        ("vocab", o.vocab),
        ("classes", o.classes),
    ] {
        if v == Some(0) {
            return Err(invalid("size override", format!("--{what} must be at least 1")));
        }
    }
    let unused = |what: &str, given: bool| -> Result<(), PlanError> {
        if given {
            Err(invalid("size override", format!("model `{name}` has no --{what}")))
        } else {
            Ok(())
        }
    };
    let key = name.to_ascii_lowercase();
    let gpt = |vocab: usize, d: usize, layers: usize, seq: usize| {
        let (vocab, d) = (o.vocab.unwrap_or(vocab), o.width.unwrap_or(d));
        let (layers, seq) = (o.depth.unwrap_or(layers), o.seq.unwrap_or(seq));
        PlanModel {
            name: format!("{key} (d {d}, {layers} layers, seq {seq}, vocab {vocab})"),
            arch: Arch::Gpt { vocab, d, layers, seq, dropout: 0.0 },
            input: SampleInput::Tokens { seq, vocab },
            classes: vocab,
            notes: Vec::new(),
        }
    };
    let cnn = |width: usize, blocks: usize, stages: usize, side: usize, mobile: bool| {
        let (width, side) = (o.width.unwrap_or(width), o.side.unwrap_or(side));
        let classes = o.classes.unwrap_or(10);
        let blocks = vec![o.depth.unwrap_or(blocks); stages];
        let arch = if mobile {
            Arch::MobileNet { width, blocks: blocks.clone(), classes }
        } else {
            Arch::ResNet { width, blocks: blocks.clone(), classes }
        };
        PlanModel {
            name: format!("{key} (width {width}, blocks {blocks:?}, {side} px, {classes} classes)"),
            arch,
            input: SampleInput::Dense { shape: vec![3, side, side] },
            classes,
            notes: Vec::new(),
        }
    };
    let model = match key.as_str() {
        "gpt2-small" | "gpt2-medium" | "gpt" => {
            unused("side", o.side.is_some())?;
            unused("classes", o.classes.is_some())?;
            let m = match key.as_str() {
                // GPT-2's sizes; the harness's block has single-head attention (the memory of
                // multi-head attention differs in the score tensors' layout, not their size).
                "gpt2-small" => gpt(50257, 768, 12, 1024),
                "gpt2-medium" => gpt(50257, 1024, 24, 1024),
                _ => gpt(256, 64, 2, 64),
            };
            let mut m = m;
            if key.starts_with("gpt2") {
                // TODO(presets): `Arch::preset(..)` (multi-head attention) once it is merged.
                m.notes.push(
                    "GPT-2 is the harness's GPT at GPT-2's sizes: single-head attention (the \
                     score tensors of multi-head attention have the same bytes per layer \
                     only with one head; with h heads they are h times larger), an LM head \
                     not tied to the token embedding (+vocab x d parameters), no dropout"
                        .into(),
                );
            }
            m
        }
        "resnet50" => {
            unused("seq", o.seq.is_some())?;
            unused("vocab", o.vocab.is_some())?;
            // TODO(presets): switch to `Arch::preset("resnet50")` (bottleneck blocks) once
            // it is merged. Until then: the harness's residual CNN with ResNet-50's stage
            // depths 3-4-6-3 and 64..512 channels (basic blocks, ResNet-34's body) at 56 px,
            // the resolution ResNet-50's stem (7x7/2 conv + 3x3/2 max pool) leaves of a
            // 224 px image; 1000 classes.
            let side = o.side.unwrap_or(56);
            let width = o.width.unwrap_or(64);
            let classes = o.classes.unwrap_or(1000);
            let blocks = match o.depth {
                Some(d) => vec![d; 4],
                None => vec![3, 4, 6, 3],
            };
            let mut m = PlanModel {
                name: format!(
                    "resnet50 (approximation: width {width}, blocks {blocks:?}, {side} px, {classes} classes)"
                ),
                arch: Arch::ResNet { width, blocks, classes },
                input: SampleInput::Dense { shape: vec![3, side, side] },
                classes,
                notes: Vec::new(),
            };
            m.notes.push(
                "resnet50 is approximated (TODO until the real-size presets are merged): basic \
                 residual blocks 3-4-6-3 with 64..512 channels, no batch norm, at the 56 px \
                 resolution ResNet-50's stem leaves of a 224 px image; the stem is not modelled"
                    .into(),
            );
            m
        }
        "resnet" | "mobilenet" => {
            unused("seq", o.seq.is_some())?;
            unused("vocab", o.vocab.is_some())?;
            cnn(16, 2, 3, 32, key == "mobilenet")
        }
        "mlp" => {
            unused("seq", o.seq.is_some())?;
            unused("side", o.side.is_some())?;
            unused("vocab", o.vocab.is_some())?;
            let width = o.width.unwrap_or(256);
            let depth = o.depth.unwrap_or(2);
            let classes = o.classes.unwrap_or(10);
            let mut dims = vec![64];
            dims.extend(std::iter::repeat_n(width, depth));
            PlanModel {
                name: format!("mlp (64 inputs, {depth} x {width} hidden, {classes} classes)"),
                arch: Arch::Mlp { dims, classes },
                input: SampleInput::Dense { shape: vec![64] },
                classes,
                notes: Vec::new(),
            }
        }
        _ => {
            return Err(PlanError::UnknownModel {
                name: name.to_string(),
                known: KNOWN_MODELS.join(", "),
            });
        }
    };
    Ok(model)
}

/// A user-described model (see [`crate::models::spec`]).
///
/// # Errors
///
/// [`PlanError::ModelFile`] for a file that cannot be read or used.
pub fn model_from_file(path: &std::path::Path) -> Result<PlanModel, PlanError> {
    let spec = ModelSpec::from_path(path)?;
    model_from_spec(spec)
}

/// A [`PlanModel`] from a parsed spec.
///
/// # Errors
///
/// [`PlanError::ModelFile`] if the layers do not chain.
pub fn model_from_spec(spec: ModelSpec) -> Result<PlanModel, PlanError> {
    let resolved = spec.resolve()?;
    let input = match spec.input {
        InputSpec::Tokens { seq } => {
            SampleInput::Tokens { seq, vocab: resolved.embedding.map_or(1, |(vocab, _)| vocab) }
        }
        InputSpec::Features { dim } => SampleInput::Dense { shape: vec![dim] },
        InputSpec::Image { channels, side } => {
            SampleInput::Dense { shape: vec![channels, side, side] }
        }
    };
    Ok(PlanModel {
        name: format!("{} (model file, {} layers)", spec.name, resolved.chain.len()),
        arch: Arch::Custom(spec),
        input,
        classes: resolved.classes,
        notes: Vec::new(),
    })
}

impl PlanModel {
    /// Targets (loss rows) per sample.
    pub fn targets_per_sample(&self) -> usize {
        match self.input {
            SampleInput::Tokens { seq, .. } => seq,
            SampleInput::Dense { .. } => 1,
        }
    }

    /// A batch of `samples`: zeros (enough for a virtual device, which reads no values) or,
    /// with `rng`, random inputs and targets.
    pub fn batch(&self, samples: usize, rng: Option<&mut Rng>) -> Batch {
        let rows = samples * self.targets_per_sample();
        let classes = self.classes.max(1) as u64;
        match (&self.input, rng) {
            (SampleInput::Tokens { vocab, .. }, None) => {
                let _ = vocab;
                Batch { input: Input::Tokens(vec![0; rows]), targets: vec![0; rows] }
            }
            (SampleInput::Tokens { vocab, .. }, Some(rng)) => {
                let ids = (0..rows).map(|_| rng.below(*vocab as u64) as u32).collect();
                let targets = (0..rows).map(|_| rng.below(classes) as u32).collect();
                Batch { input: Input::Tokens(ids), targets }
            }
            (SampleInput::Dense { shape }, rng) => {
                let per: usize = shape.iter().product();
                let mut full = vec![samples];
                full.extend(shape);
                let (values, targets) = match rng {
                    None => (vec![0.0; samples * per], vec![0; rows]),
                    Some(rng) => (
                        (0..samples * per).map(|_| rng.normal()).collect(),
                        (0..rows).map(|_| rng.below(classes) as u32).collect(),
                    ),
                };
                Batch { input: Input::Dense { values, shape: full }, targets }
            }
        }
    }

    /// Forward FLOPs per sample of each chain layer (matrix products and convolutions; the
    /// elementwise work is memory-bound and left out), in chain order.
    pub fn chain_flops(&self) -> Vec<f64> {
        let f = |x: usize| x as f64;
        let conv = |c_in: usize, c_out: usize, k: usize, groups: usize, side: usize| {
            2.0 * f(c_out) * f(c_in / groups.max(1)) * f(k * k) * f(side * side)
        };
        match &self.arch {
            Arch::Mlp { dims, classes } => {
                let mut v: Vec<f64> = dims.windows(2).map(|w| 2.0 * f(w[0]) * f(w[1])).collect();
                v.push(2.0 * f(*dims.last().unwrap_or(&0)) * f(*classes));
                v
            }
            Arch::ResNet { width, blocks, classes }
            | Arch::MobileNet { width, blocks, classes } => {
                let mobile = matches!(self.arch, Arch::MobileNet { .. });
                let mut side = match &self.input {
                    SampleInput::Dense { shape } => shape.last().copied().unwrap_or(1),
                    SampleInput::Tokens { .. } => 1,
                };
                let mut v = vec![conv(3, *width, 3, 1, side)];
                let mut c = *width;
                for (stage, &n) in blocks.iter().enumerate() {
                    if stage > 0 {
                        side = (side + 2 - 3) / 2 + 1;
                        v.push(conv(c, 2 * c, 3, 1, side));
                        c *= 2;
                    }
                    for _ in 0..n {
                        if mobile {
                            v.push(conv(c, c, 3, c, side));
                            v.push(conv(c, c, 1, 1, side));
                        } else {
                            v.push(2.0 * conv(c, c, 3, 1, side));
                        }
                    }
                }
                v.push(2.0 * f(c) * f(*classes));
                v
            }
            Arch::Gpt { vocab, d, layers, seq, .. } => {
                let block = 24.0 * f(*seq) * f(*d) * f(*d) + 4.0 * f(*seq) * f(*seq) * f(*d);
                let mut v = vec![block; *layers];
                v.push(2.0 * f(*seq) * f(*d) * f(*vocab));
                v
            }
            Arch::Custom(spec) => spec
                .resolve()
                .map(|r| {
                    r.chain
                        .iter()
                        .map(|l| match *l {
                            Resolved::Linear { d_in, d_out, rows_per_sample, .. } => {
                                2.0 * f(rows_per_sample) * f(d_in) * f(d_out)
                            }
                            Resolved::Conv { c_in, c_out, kernel, groups, side_out, .. } => {
                                conv(c_in, c_out, kernel, groups, side_out)
                            }
                            Resolved::Attention { d, seq, .. } => {
                                24.0 * f(seq) * f(d) * f(d) + 4.0 * f(seq) * f(seq) * f(d)
                            }
                            Resolved::Norm { .. } | Resolved::Pool { .. } => 0.0,
                        })
                        .collect()
                })
                .unwrap_or_default(),
        }
    }

    /// A smaller model of the same kind for `--verify` on the host: it runs on the CPU in
    /// seconds, with the same plan kinds, precision, allocator settings and optimizer
    /// (widths capped at 64, 16 channels, vocabularies at 512, sequences at 32, images at
    /// 16 px; a model file keeps its layer structure).
    pub fn reduced(&self) -> PlanModel {
        let mut m = self.clone();
        match &mut m.arch {
            Arch::Gpt { vocab, d, layers, seq, .. } => {
                (*vocab, *d, *layers, *seq) = ((*vocab).min(512), 64, (*layers).min(4), 32);
                m.input = SampleInput::Tokens { seq: *seq, vocab: *vocab };
                m.classes = *vocab;
            }
            Arch::ResNet { width, blocks, classes }
            | Arch::MobileNet { width, blocks, classes } => {
                *width = (*width).min(8);
                blocks.iter_mut().for_each(|b| *b = (*b).min(2));
                *classes = (*classes).min(10);
                m.classes = *classes;
                m.input = SampleInput::Dense { shape: vec![3, 16, 16] };
            }
            Arch::Mlp { dims, classes } => {
                dims.iter_mut().skip(1).for_each(|d| *d = (*d).min(64));
                *classes = (*classes).min(10);
                m.classes = *classes;
            }
            Arch::Custom(spec) => {
                let mut spec = spec.clone();
                match &mut spec.input {
                    InputSpec::Tokens { seq } => *seq = (*seq).min(32),
                    InputSpec::Image { side, .. } => *side = (*side).min(16),
                    InputSpec::Features { dim } => *dim = (*dim).min(64),
                }
                let mut channels = match spec.input {
                    InputSpec::Image { channels, .. } => channels,
                    _ => 0,
                };
                let last = spec.layers.len().saturating_sub(1);
                for (i, layer) in spec.layers.iter_mut().enumerate() {
                    match layer {
                        LayerSpec::Embedding { vocab, dim } => {
                            (*vocab, *dim) = ((*vocab).min(512), (*dim).min(64));
                        }
                        LayerSpec::Linear { out, .. } => {
                            *out = (*out).min(if i == last { 512 } else { 64 });
                        }
                        LayerSpec::Conv { out, groups, .. } => {
                            let depthwise = *groups > 1 && *groups == *out;
                            *out = (*out).min(16);
                            *groups = if depthwise && channels == *out { *out } else { 1 };
                            channels = *out;
                        }
                        LayerSpec::Attention { .. } | LayerSpec::Norm | LayerSpec::Pool => {}
                    }
                }
                if let Ok(pm) = model_from_spec(spec) {
                    m = pm;
                }
            }
        }
        m.name =
            format!("{} reduced for the host", self.name.split(" (").next().unwrap_or("model"));
        m
    }
}
