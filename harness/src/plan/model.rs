//! Which model to plan for: names and size overrides, user model files, the forward FLOPs of
//! each chain layer (for the cost model) and the batches a run feeds.

use super::PlanError;
use crate::data::{Batch, Dataset, Input};
use crate::models::Arch;
use crate::models::Attention;
use crate::models::spec::{InputSpec, LayerSpec, ModelSpec, Resolved};
use crate::rng::Rng;
use serde::Serialize;

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

/// How a model's name says its transformer blocks attend by default ([`Attention::Fused`]);
/// [`PlanModel::set_attention`] changes it.
const FUSED_LABEL: &str = "fused attention";
/// The same for [`Attention::Explicit`].
const EXPLICIT_LABEL: &str = "explicit attention";

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
    /// How its transformer blocks attend (fused by default; `plan --attention explicit`).
    pub attention: Attention,
    /// Whether a preset CNN runs channels_last (`plan --channels-last`; default false).
    pub channels_last: bool,
    /// A GPU's record of cuDNN's choices that the virtual devices replay
    /// ([`vram_kernels::Device::set_cudnn_choices`]; `plan --cudnn-choices`), so that the
    /// convolutions allocate what that GPU's cuDNN path allocates; `None`: vram's own
    /// kernels' workspaces.
    pub cudnn: Option<std::sync::Arc<vram_kernels::cudnn_choices::CudnnChoices>>,
}

fn invalid(what: &'static str, reason: impl Into<String>) -> PlanError {
    PlanError::InvalidArgument { what, reason: reason.into() }
}

/// The model called `name` (a preset of the zoo or one of its aliases, [`Arch::preset`];
/// spaces around it and case are ignored), with `overrides` applied: absolute sizes (`--width` is GPT's and ViT's `d`, kept at the
/// preset's head width; the CNNs' first-stage width; the MLP's hidden width), unlike the
/// zoo's multipliers.
///
/// # Errors
///
/// [`PlanError::UnknownModel`] listing the known names; [`PlanError::InvalidArgument`] for
/// a zero size, a width that is not whole heads, or an override the model has no use for.
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
    let key = name.trim().to_ascii_lowercase();
    // A lookup fails only for an unknown name.
    let arch = Arch::preset(&key).map_err(|_| PlanError::UnknownModel {
        name: name.to_string(),
        known: Arch::preset_names().join(", "),
    })?;
    model_from_arch(&key, arch, o)
}

/// The model a Hugging Face `config.json` describes ([`crate::models::hf`]: `gpt2`,
/// `llama`, `mistral`, `qwen2`), with `overrides` applied as to a preset (`--seq`,
/// `--depth`, `--vocab`; a Llama's width is the config's). Its notes say which keys of the
/// file were not read and the parameter count, Hugging Face's.
///
/// # Errors
///
/// [`PlanError::ModelFile`] naming the file and the key for a config that cannot be used
/// (an unknown `model_type` lists the known ones); as [`model_from_args`] for overrides.
pub fn model_from_hf(path: &std::path::Path, o: &ModelOverrides) -> Result<PlanModel, PlanError> {
    let hf = crate::models::HfModel::from_path(path)
        .map_err(|e| crate::models::spec::SpecError { reason: e.to_string() })?;
    let mut m = model_from_arch(&hf.name, hf.arch.clone(), o)?;
    let params = match &m.arch {
        Arch::Llama(l) => l.param_count(),
        _ => crate::models::HfModel { arch: m.arch.clone(), ..hf.clone() }.param_count(),
    };
    let mut notes = vec![format!(
        "from {} (model_type {}): {params} parameters, Hugging Face's count",
        path.display(),
        hf.model_type
    )];
    // The default sequence length's note is moot once --seq is given.
    let seq_given = o.seq.is_some();
    notes.extend(
        hf.notes.iter().filter(|n| !(seq_given && n.starts_with("sequence length"))).cloned(),
    );
    notes.push(hf.ignored_line());
    notes.append(&mut m.notes);
    m.notes = notes;
    Ok(m)
}

/// `arch` (named `key`) with `o` applied: [`model_from_args`] after its lookup.
fn model_from_arch(key: &str, mut arch: Arch, o: &ModelOverrides) -> Result<PlanModel, PlanError> {
    let name = key;
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
    let unused = |what: &str, given: Option<usize>| -> Result<(), PlanError> {
        match given {
            Some(_) => Err(invalid("size override", format!("model `{name}` has no --{what}"))),
            None => Ok(()),
        }
    };
    let whole_heads = |d: usize, head: usize| -> Result<usize, PlanError> {
        if d.is_multiple_of(head) {
            Ok(d / head)
        } else {
            Err(invalid(
                "size override",
                format!("--width {d} is not whole heads of {head} (the preset's head width)"),
            ))
        }
    };
    // The small CNNs take any image side: it lives in the input, not the architecture.
    let mut cnn_side = 32;
    match &mut arch {
        Arch::Gpt { vocab, d, layers, heads, seq, .. } => {
            unused("side", o.side)?;
            unused("classes", o.classes)?;
            if let Some(w) = o.width {
                *heads = whole_heads(w, *d / *heads)?;
                *d = w;
            }
            *layers = o.depth.unwrap_or(*layers);
            *seq = o.seq.unwrap_or(*seq);
            *vocab = o.vocab.unwrap_or(*vocab);
        }
        Arch::Vit { side, patch, d, layers, heads, classes, .. } => {
            unused("seq", o.seq)?;
            unused("vocab", o.vocab)?;
            if let Some(w) = o.width {
                *heads = whole_heads(w, *d / *heads)?;
                *d = w;
            }
            *layers = o.depth.unwrap_or(*layers);
            *classes = o.classes.unwrap_or(*classes);
            if let Some(px) = o.side {
                if !px.is_multiple_of(*patch) {
                    return Err(invalid(
                        "size override",
                        format!("--side {px} is not whole {patch} px patches"),
                    ));
                }
                *side = px;
            }
        }
        Arch::BottleneckResNet { side, width, blocks, classes } => {
            unused("seq", o.seq)?;
            unused("vocab", o.vocab)?;
            *width = o.width.unwrap_or(*width);
            if let Some(d) = o.depth {
                blocks.iter_mut().for_each(|b| *b = d);
            }
            *classes = o.classes.unwrap_or(*classes);
            *side = o.side.unwrap_or(*side);
        }
        Arch::MobileNetV3 { side, classes, .. } => {
            unused("seq", o.seq)?;
            unused("vocab", o.vocab)?;
            unused("width", o.width)?;
            unused("depth", o.depth)?;
            *classes = o.classes.unwrap_or(*classes);
            *side = o.side.unwrap_or(*side);
        }
        Arch::ResNet { width, blocks, classes } | Arch::MobileNet { width, blocks, classes } => {
            unused("seq", o.seq)?;
            unused("vocab", o.vocab)?;
            *width = o.width.unwrap_or(*width);
            if let Some(d) = o.depth {
                blocks.iter_mut().for_each(|b| *b = d);
            }
            *classes = o.classes.unwrap_or(*classes);
            cnn_side = o.side.unwrap_or(cnn_side);
        }
        Arch::Mlp { dims, classes } => {
            unused("seq", o.seq)?;
            unused("side", o.side)?;
            unused("vocab", o.vocab)?;
            let hidden = dims.len().saturating_sub(1);
            let width = o.width.unwrap_or_else(|| dims.get(1).copied().unwrap_or(64));
            dims.truncate(1);
            dims.extend(std::iter::repeat_n(width, o.depth.unwrap_or(hidden)));
            *classes = o.classes.unwrap_or(*classes);
        }
        Arch::Custom(_) => {
            return Err(invalid("model", "a model file is read by model_from_file".to_string()));
        }
        Arch::Llama(l) => {
            unused("side", o.side)?;
            unused("classes", o.classes)?;
            unused("width", o.width)?;
            l.layers = o.depth.unwrap_or(l.layers);
            l.seq = o.seq.unwrap_or(l.seq);
            l.vocab = o.vocab.unwrap_or(l.vocab);
        }
    }
    let (input, classes) = match arch.dataset() {
        Dataset::Sequences { vocab, seq } => (SampleInput::Tokens { seq, vocab }, vocab),
        Dataset::Stripes { side, classes } => {
            let side = if matches!(arch, Arch::ResNet { .. } | Arch::MobileNet { .. }) {
                cnn_side
            } else {
                side
            };
            (SampleInput::Dense { shape: vec![3, side, side] }, classes)
        }
        Dataset::Clusters { dim, classes } => (SampleInput::Dense { shape: vec![dim] }, classes),
    };
    let mut notes = Vec::new();
    match arch {
        Arch::BottleneckResNet { .. } => notes.push(
            "ResNet-50 as torchvision's, batch norms included (each keeps its convolution's \
             output beside the normalised one, as PyTorch's)"
                .into(),
        ),
        Arch::MobileNetV3 { .. } => notes.push(
            "MobileNetV3-Large as torchvision's (batch norms, hard swish, squeeze-excitation), \
             but without the classifier's dropout"
                .into(),
        ),
        Arch::Gpt { .. } => notes.push(
            "GPT: q, k, v are three matrices (the fused c_attn has the same count); a tied \
             head trains through the fused LM loss (linear_cross_entropy: the [tokens, vocab] \
             logits never whole)"
                .into(),
        ),
        _ => {}
    }
    let size = match &arch {
        Arch::Gpt { d, layers, heads, seq, vocab, dropout, .. } => format!(
            "d {d}, {layers} layers, {heads} heads, seq {seq}, vocab {vocab}, dropout {dropout}, \
             {FUSED_LABEL}"
        ),
        Arch::Vit { side, d, layers, heads, dropout, .. } => {
            format!(
                "d {d}, {layers} layers, {heads} heads, {side} px, dropout {dropout}, {FUSED_LABEL}"
            )
        }
        Arch::BottleneckResNet { side, width, blocks, classes } => {
            format!("width {width}, blocks {blocks:?}, {side} px, {classes} classes")
        }
        Arch::MobileNetV3 { side, classes, .. } => format!("{side} px, {classes} classes"),
        Arch::ResNet { width, blocks, classes } | Arch::MobileNet { width, blocks, classes } => {
            format!("width {width}, blocks {blocks:?}, {cnn_side} px, {classes} classes")
        }
        Arch::Mlp { dims, classes } => format!("dims {dims:?}, {classes} classes"),
        Arch::Custom(_) => String::new(),
        Arch::Llama(l) => format!(
            "d {}, {} layers, {} heads ({} key/value), mlp {}, seq {}, vocab {}{}, {FUSED_LABEL}",
            l.d,
            l.layers,
            l.heads,
            l.kv_heads,
            l.hidden,
            l.seq,
            l.vocab,
            if l.tied { ", tied head" } else { "" }
        ),
    };
    if let Arch::Llama(_) = arch {
        notes.push(
            "Llama: grouped-query attention in the form --attention names: fused (the \
             default; HF's sdpa, without its repeat_kv: each key and value head read where it \
             is, not copied to every query head) or explicit (HF's eager, keys and values \
             repeated by repeat_kv)"
                .into(),
        );
    }
    if matches!(arch, Arch::Gpt { .. } | Arch::Vit { .. } | Arch::Llama(_)) {
        notes.push(
            "transformer MLPs keep their pre-activations (Llama: gate and up outputs) and \
             recompute the activation (GELU; SiLU and its product with up) in backward, as \
             torch.compile's partitioner does; PyTorch's eager mode keeps both"
                .into(),
        );
    }
    let attention = Attention::Fused;
    Ok(PlanModel {
        name: format!("{key} ({size})"),
        arch,
        input,
        classes,
        notes,
        attention,
        channels_last: false,
        cudnn: None,
    })
}

/// Whether `record` was made with `cudnn_benchmark` on (a choice found by a timed search).
fn searched(record: &vram_kernels::cudnn_choices::CudnnChoices) -> bool {
    record.convolutions.iter().any(|c| c.search_workspace.is_some())
}

/// A GPU's record of cuDNN's choices, read from a JSON file (the `cudnn-choices.json` that
/// the twin writes on a GPU; [`vram_kernels::cudnn_choices::CudnnChoices`]).
///
/// # Errors
///
/// [`PlanError::InvalidArgument`] naming the file for one that cannot be read or parsed.
pub fn cudnn_choices_from_path(
    path: &std::path::Path,
) -> Result<vram_kernels::cudnn_choices::CudnnChoices, PlanError> {
    let bad = |reason: String| invalid("cudnn choices", format!("{}: {reason}", path.display()));
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    serde_json::from_str(&text).map_err(|e| bad(e.to_string()))
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
        attention: Attention::Fused,
        channels_last: false,
        cudnn: None,
    })
}

impl PlanModel {
    /// The model attending in the form `attention`, its name and (for transformers) a note
    /// saying so.
    pub fn set_attention(&mut self, attention: Attention) {
        let (from, to, note) = match attention {
            Attention::Fused => (
                EXPLICIT_LABEL,
                FUSED_LABEL,
                "attention: fused (as PyTorch's scaled_dot_product_attention: the output and \
                 each row's logsumexp kept; --attention explicit to compare)",
            ),
            Attention::Explicit => (
                FUSED_LABEL,
                EXPLICIT_LABEL,
                "attention: explicit (as eager PyTorch: the [b, heads, seq, seq] probabilities \
                 kept for backward)",
            ),
        };
        self.name = self.name.replace(from, to);
        self.attention = attention;
        if matches!(self.arch, Arch::Gpt { .. } | Arch::Vit { .. } | Arch::Llama(_)) {
            self.notes.retain(|n| !n.starts_with("attention: "));
            self.notes.push(note.into());
        }
    }

    /// The model channels_last (or not), its name and notes saying so.
    ///
    /// # Errors
    ///
    /// [`PlanError::InvalidArgument`] for channels_last on a model that is not one of the
    /// preset CNNs (the only ones with a channels_last form).
    pub fn set_channels_last(&mut self, on: bool) -> Result<(), PlanError> {
        if on && !self.arch.is_preset_cnn() {
            return Err(invalid(
                "channels_last",
                format!(
                    "{} is not a preset CNN (resnet50, mobilenetv3-like, resnet-like, mobilenet-like)",
                    self.name
                ),
            ));
        }
        const LABEL: &str = ", channels_last";
        self.name = self.name.replace(LABEL, "");
        self.notes.retain(|n| !n.starts_with("channels_last: "));
        if on {
            self.name = match self.name.strip_suffix(')') {
                Some(stem) => format!("{stem}{LABEL})"),
                None => format!("{}{LABEL}", self.name),
            };
            self.notes.push(
                "channels_last: images, activations and convolution weights NHWC, as PyTorch's \
                 torch.channels_last; without --cudnn-choices the virtual device models vram's \
                 own kernels, which permute around each NHWC convolution (cuDNN reads NHWC as it \
                 is)"
                .into(),
            );
        }
        self.channels_last = on;
        Ok(())
    }

    /// The virtual devices replay `record`, a GPU's cuDNN choices (or model vram's own
    /// kernels, `None`), and the notes say so.
    pub fn set_cudnn_choices(&mut self, record: Option<vram_kernels::cudnn_choices::CudnnChoices>) {
        self.notes.retain(|n| !n.starts_with("convolutions: "));
        if let Some(r) = &record {
            self.notes.push(format!(
                "convolutions: {}'s choices on {} replayed ({} convolution and {} batch norm \
                 calls recorded): each call's workspace as recorded, batch norm through cuDNN \
                 where PyTorch sends it; a call the record lacks (another batch size) takes no \
                 workspace, a lower bound{}",
                vram_kernels::ConvPath::Cudnn { version: r.version },
                r.device,
                r.convolutions.len(),
                r.batch_norms.len(),
                if searched(r) {
                    "; recorded with cudnn.benchmark, so each shape's first call also takes the \
                     workspace its timed search ran in (and a GPU run to verify searches too)"
                } else {
                    ""
                }
            ));
        }
        self.cudnn = record.map(std::sync::Arc::new);
    }

    /// Whether the devices run with `cudnn_benchmark`: when the cuDNN record replayed was
    /// made with it (its choices were found by timed searches).
    pub fn cudnn_benchmark(&self) -> bool {
        self.cudnn.as_deref().is_some_and(searched)
    }

    /// How [`Model::with_options`](crate::models::Model::with_options) builds this model.
    pub fn options(&self) -> crate::models::ModelOptions {
        crate::models::ModelOptions::default()
            .with_attention(self.attention)
            .with_channels_last(self.channels_last)
    }

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
            Arch::Gpt { vocab, d, layers, seq, tied, .. } => {
                let block = 24.0 * f(*seq) * f(*d) * f(*d) + 4.0 * f(*seq) * f(*seq) * f(*d);
                let mut v = vec![block; *layers];
                v.push(0.0); // ln_f
                if !tied {
                    v.push(2.0 * f(*seq) * f(*d) * f(*vocab));
                }
                v
            }
            Arch::Llama(l) => {
                let (s, d, dh) = (f(l.seq), f(l.d), f(l.head_dim));
                let qkvo = 2.0 * s * d * dh * f(2 * l.heads + 2 * l.kv_heads);
                let attn = 4.0 * s * s * dh * f(l.heads);
                let mlp = 6.0 * s * d * f(l.hidden);
                let mut v = vec![qkvo + attn + mlp; l.layers];
                v.push(0.0); // norm
                if !l.tied {
                    v.push(2.0 * s * d * f(l.vocab));
                }
                v
            }
            Arch::BottleneckResNet { side, width, blocks, classes } => {
                // conv1 7x7/2, max pool 3x3/2, bottlenecks (stride on the 3x3), head.
                let out = |s: usize, k: usize, st: usize| (s + 2 * (k / 2) - k) / st + 1;
                let mut s = out(*side, 7, 2);
                let mut v = vec![conv(3, *width, 7, 1, s)];
                s = (s + 2 - 3) / 2 + 1;
                v.push(0.0);
                let mut c_in = *width;
                for (stage, &n) in blocks.iter().enumerate() {
                    let mid = width << stage;
                    for i in 0..n {
                        let st = if i == 0 && stage > 0 { 2 } else { 1 };
                        let s_out = out(s, 3, st);
                        let mut fl = conv(c_in, mid, 1, 1, s)
                            + conv(mid, mid, 3, 1, s_out)
                            + conv(mid, 4 * mid, 1, 1, s_out);
                        if st != 1 || c_in != 4 * mid {
                            fl += conv(c_in, 4 * mid, 1, 1, s_out);
                        }
                        v.push(fl);
                        (c_in, s) = (4 * mid, s_out);
                    }
                }
                v.push(2.0 * f(c_in) * f(*classes));
                v
            }
            Arch::MobileNetV3 { side, width_mult, classes } => {
                use crate::models::zoo::{MOBILENETV3_LARGE, make_divisible};
                let ch = |c| make_divisible(c, *width_mult);
                let out = |s: usize, k: usize, st: usize| (s + 2 * (k / 2) - k) / st + 1;
                let mut s = out(*side, 3, 2);
                let first = ch(MOBILENETV3_LARGE[0].0);
                let mut v = vec![conv(3, first, 3, 1, s)];
                let mut last = first;
                for &(c_in, k, e, c_out, se, _, st) in MOBILENETV3_LARGE.iter() {
                    let (c_in, e, c_out) = (ch(c_in), ch(e), ch(c_out));
                    let s_out = out(s, k, st);
                    let expand = if e != c_in { conv(c_in, e, 1, 1, s) } else { 0.0 };
                    let sq = make_divisible(e / 4, 1.0);
                    let se = if se { 4.0 * f(e) * f(sq) } else { 0.0 };
                    v.push(expand + conv(e, e, k, e, s_out) + se + conv(e, c_out, 1, 1, s_out));
                    (last, s) = (c_out, s_out);
                }
                v.push(conv(last, 6 * last, 1, 1, s));
                let hidden = ch(1280);
                v.push(2.0 * f(6 * last) * f(hidden) + 2.0 * f(hidden) * f(*classes));
                v
            }
            Arch::Vit { side, patch, d, layers, classes, .. } => {
                let tokens = (side / patch) * (side / patch);
                let mut v = vec![2.0 * f(tokens) * f(3 * patch * patch) * f(*d)];
                let block = 24.0 * f(tokens) * f(*d) * f(*d) + 4.0 * f(tokens) * f(tokens) * f(*d);
                v.extend(std::iter::repeat_n(block, *layers));
                v.extend([0.0, 0.0, 2.0 * f(*d) * f(*classes)]); // norm, pool, head
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

    /// Forward FLOPs per sample outside the chain: GPT's LM head when it is tied to the
    /// token embedding (applied after the chain, never recomputed).
    pub fn outside_chain_flops(&self) -> f64 {
        match self.arch {
            Arch::Gpt { vocab, d, seq, tied: true, .. } => 2.0 * (seq * d) as f64 * vocab as f64,
            Arch::Llama(ref l) if l.tied => 2.0 * (l.seq * l.d) as f64 * l.vocab as f64,
            _ => 0.0,
        }
    }

    /// A smaller model of the same kind for `--verify` on the host: it runs on the CPU in
    /// seconds, with the same plan kinds, precision, allocator settings and optimizer
    /// (widths capped at 64, 16 channels, vocabularies at 512, sequences at 32, images at
    /// 16 px; a model file keeps its layer structure).
    pub fn reduced(&self) -> PlanModel {
        let mut m = self.clone();
        match &mut m.arch {
            Arch::Gpt { vocab, d, layers, heads, seq, .. } => {
                (*vocab, *d, *layers, *seq) = ((*vocab).min(512), 64, (*layers).min(4), 32);
                *heads = (*heads).min(4);
                m.input = SampleInput::Tokens { seq: *seq, vocab: *vocab };
                m.classes = *vocab;
            }
            Arch::Llama(l) => {
                // Width 64 in heads of 16, the config's grouping kept where it fits.
                let group = (l.heads / l.kv_heads).clamp(1, 4);
                (l.vocab, l.d, l.layers, l.seq) = (l.vocab.min(512), 64, l.layers.min(4), 32);
                (l.heads, l.kv_heads, l.head_dim, l.hidden) = (4, 4 / group, 16, 128);
                m.input = SampleInput::Tokens { seq: l.seq, vocab: l.vocab };
                m.classes = l.vocab;
            }
            Arch::Vit { side, patch, d, layers, heads, classes, .. } => {
                (*side, *patch, *d, *layers) = (16, 4, 64, (*layers).min(2));
                (*heads, *classes) = ((*heads).min(4), (*classes).min(10));
                m.classes = *classes;
                m.input = SampleInput::Dense { shape: vec![3, 16, 16] };
            }
            Arch::BottleneckResNet { side, width, blocks, classes } => {
                (*side, *width) = (32, (*width).min(8));
                blocks.iter_mut().for_each(|b| *b = (*b).min(1));
                *classes = (*classes).min(10);
                m.classes = *classes;
                m.input = SampleInput::Dense { shape: vec![3, 32, 32] };
            }
            Arch::MobileNetV3 { side, width_mult, classes } => {
                (*side, *width_mult) = (32, 0.25);
                *classes = (*classes).min(10);
                m.classes = *classes;
                m.input = SampleInput::Dense { shape: vec![3, 32, 32] };
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
