//! User-described models: a small TOML or JSON file of layer specs, built into a [`Model`]
//! through [`Arch::Custom`](super::Arch::Custom).
//!
//! ```toml
//! name = "tiny-gpt"
//! input = { kind = "tokens", seq = 128 }   # or { kind = "features", dim = 64 }
//!                                           # or { kind = "image", channels = 3, side = 32 }
//! [[layers]]
//! kind = "embedding"      # token + learned position embedding; first layer, tokens only
//! vocab = 1000
//! dim = 128
//! [[layers]]
//! kind = "attention"      # pre-norm transformer block: causal attention + 4*dim GELU MLP
//! repeat = 4              # any layer but the embedding may repeat
//! [[layers]]
//! kind = "norm"           # layer norm over the last dimension
//! [[layers]]
//! kind = "linear"         # out = classes (or vocabulary) for the last layer
//! out = 1000
//! ```
//!
//! Kinds: `embedding {vocab, dim}`, `linear {out, act}`, `conv {out, kernel, stride = 1,
//! groups = 1, bn = false, act}` (padding `kernel / 2`, no bias; `bn` adds a batch norm), `attention {heads = 1, dropout = 0}`, `norm`,
//! `pool` (global average pooling, `[b, c, h, w] -> [b, c]`). `act` is `none` (default),
//! `relu`, `gelu` or `hardswish`. The last layer's width is the number of classes of the
//! cross-entropy loss (per position for token inputs).
//!
//! [`Model`]: super::Model

use super::{Builder, EmbedParts, Param};
use crate::data::Dataset;
use serde::{Deserialize, Serialize};
use std::path::Path;
use vram_accum::layers::{
    Act, Conv2dConfig, Init, LayerNormConfig, LinearConfig, TransformerBlockConfig, init_weight,
    sub_seed,
};
use vram_accum::{ForwardCtx, Layer, Result};
use vram_kernels::{Device, Tensor, ops};

/// What is wrong with a model file.
#[derive(Debug, thiserror::Error)]
#[error("{reason}")]
pub struct SpecError {
    /// A sentence naming the problem (and the layer's index, from 0, when a layer has it).
    pub reason: String,
}

fn spec_err(reason: impl Into<String>) -> SpecError {
    SpecError { reason: reason.into() }
}

/// A user-described model.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSpec {
    /// Name for reports.
    pub name: String,
    /// What one sample is.
    pub input: InputSpec,
    /// The layers, in order.
    pub layers: Vec<LayerSpec>,
}

/// What one sample of a [`ModelSpec`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum InputSpec {
    /// A sequence of `seq` token ids (the first layer must be an embedding).
    Tokens {
        /// Sequence length.
        seq: usize,
    },
    /// A vector of `dim` features.
    Features {
        /// Feature width.
        dim: usize,
    },
    /// A `channels x side x side` image.
    Image {
        /// Channels.
        channels: usize,
        /// Height and width.
        side: usize,
    },
}

/// An activation after a linear or convolution layer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ActSpec {
    /// None.
    #[default]
    None,
    /// ReLU.
    Relu,
    /// GELU (tanh approximation).
    Gelu,
    /// Hard swish (MobileNetV3's).
    Hardswish,
}

impl ActSpec {
    fn act(self) -> Act {
        match self {
            ActSpec::None => Act::Identity,
            ActSpec::Relu => Act::Relu,
            ActSpec::Gelu => Act::Gelu,
            ActSpec::Hardswish => Act::Hardswish,
        }
    }
}

/// One layer of a [`ModelSpec`] (before `repeat` is applied).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum LayerSpec {
    /// Token + learned position embedding (GPT's): first layer, token inputs only.
    Embedding {
        /// Vocabulary.
        vocab: usize,
        /// Width.
        dim: usize,
    },
    /// `act(x W^T + b)`.
    Linear {
        /// Output width.
        out: usize,
        /// Activation.
        #[serde(default)]
        act: ActSpec,
    },
    /// A 2-d convolution (no bias, padding `kernel / 2`), optionally batch-normed.
    Conv {
        /// Output channels.
        out: usize,
        /// Kernel side.
        kernel: usize,
        /// Stride.
        #[serde(default = "one")]
        stride: usize,
        /// Groups (`groups == channels` is depthwise).
        #[serde(default = "one")]
        groups: usize,
        /// A batch norm after the convolution, before the activation (PyTorch's
        /// `BatchNorm2d`).
        #[serde(default)]
        bn: bool,
        /// Activation.
        #[serde(default)]
        act: ActSpec,
    },
    /// A pre-norm transformer block of the current width: causal multi-head attention and
    /// a GELU MLP of 4x the width, with residual connections.
    Attention {
        /// Attention heads (the width must be whole heads; default 1).
        #[serde(default = "one")]
        heads: usize,
        /// Dropout on the attention probabilities and both residual branches.
        #[serde(default)]
        dropout: f32,
    },
    /// Layer norm over the last dimension.
    Norm,
    /// Global average pooling: `[b, c, h, w] -> [b, c]`.
    Pool,
}

fn one() -> usize {
    1
}

/// A chain layer with its resolved sizes (what the layer specs mean for the shapes flowing
/// through them).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Resolved {
    /// Linear `d_in -> d_out` over `rows_per_sample` rows per sample.
    Linear {
        /// Input width.
        d_in: usize,
        /// Output width.
        d_out: usize,
        /// Rows per sample (the sequence length for token inputs, else 1).
        rows_per_sample: usize,
        /// Activation.
        act: ActSpec,
    },
    /// Convolution.
    Conv {
        /// Input channels.
        c_in: usize,
        /// Output channels.
        c_out: usize,
        /// Kernel side.
        kernel: usize,
        /// Stride.
        stride: usize,
        /// Groups.
        groups: usize,
        /// Output side.
        side_out: usize,
        /// Batch norm after the convolution.
        bn: bool,
        /// Activation.
        act: ActSpec,
    },
    /// Transformer block.
    Attention {
        /// Width.
        d: usize,
        /// Heads.
        heads: usize,
        /// Sequence length.
        seq: usize,
        /// Dropout.
        dropout: f32,
    },
    /// Layer norm over `d` with `rows_per_sample` rows per sample.
    Norm {
        /// Width.
        d: usize,
        /// Rows per sample.
        rows_per_sample: usize,
    },
    /// Global average pooling of `c` planes of `side x side`.
    Pool {
        /// Channels.
        c: usize,
        /// Side of the planes.
        side: usize,
    },
}

/// A [`ModelSpec`] with shapes checked and resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct ResolvedSpec {
    /// `(vocab, dim)` of the embedding, if the model starts with one.
    pub embedding: Option<(usize, usize)>,
    /// The chain layers, `repeat` expanded.
    pub chain: Vec<Resolved>,
    /// Width of the last layer: the classes of the loss.
    pub classes: usize,
}

/// The shape flowing between layers, per sample.
#[derive(Clone, Copy)]
enum Flow {
    Tokens { seq: usize },
    Rows { rows: usize, d: usize, seq: Option<usize> },
    Planes { c: usize, side: usize },
}

impl ModelSpec {
    /// The synthetic data set for this model's input (image inputs must have 3 channels,
    /// the stripe images'; [`ModelSpec::resolve`] does not check that, `Model::new` does).
    pub fn dataset(&self) -> Dataset {
        let classes = self.resolve().map_or(1, |r| r.classes);
        match self.input {
            InputSpec::Tokens { seq } => {
                let vocab = self.resolve().ok().and_then(|r| r.embedding).map_or(1, |e| e.0);
                Dataset::Sequences { vocab, seq }
            }
            InputSpec::Features { dim } => Dataset::Clusters { dim, classes },
            InputSpec::Image { side, .. } => Dataset::Stripes { side, classes },
        }
    }

    /// Reads a model file: `.toml` as TOML, anything else as JSON.
    ///
    /// # Errors
    ///
    /// A [`SpecError`] naming the file and the problem: unreadable, not TOML/JSON (with
    /// line and column), an unknown layer kind or field (with the layer's index), or shapes
    /// that do not chain (see [`ModelSpec::resolve`]).
    pub fn from_path(path: &Path) -> std::result::Result<ModelSpec, SpecError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| spec_err(format!("cannot read model file {}: {e}", path.display())))?;
        let is_toml = path.extension().is_some_and(|e| e.eq_ignore_ascii_case("toml"));
        let default_name: String =
            path.file_stem().map_or("custom".into(), |s| s.to_string_lossy().into_owned());
        let parsed = if is_toml {
            ModelSpec::from_toml_str(&text, &default_name)
        } else {
            ModelSpec::from_json_str(&text, &default_name)
        };
        parsed.map_err(|e| spec_err(format!("model file {}: {}", path.display(), e.reason)))
    }

    /// Parses TOML text (see the module's documentation for the format).
    ///
    /// # Errors
    ///
    /// See [`ModelSpec::from_path`].
    pub fn from_toml_str(
        text: &str,
        default_name: &str,
    ) -> std::result::Result<ModelSpec, SpecError> {
        let value: serde_json::Value =
            toml::from_str(text).map_err(|e| spec_err(format!("not valid TOML: {e}")))?;
        ModelSpec::from_value(value, default_name)
    }

    /// Parses JSON text: `{"name": .., "input": {..}, "layers": [{"kind": ..}, ..]}`.
    ///
    /// # Errors
    ///
    /// See [`ModelSpec::from_path`].
    pub fn from_json_str(
        text: &str,
        default_name: &str,
    ) -> std::result::Result<ModelSpec, SpecError> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| spec_err(format!("not valid JSON: {e}")))?;
        ModelSpec::from_value(value, default_name)
    }

    fn from_value(
        value: serde_json::Value,
        default_name: &str,
    ) -> std::result::Result<ModelSpec, SpecError> {
        let serde_json::Value::Object(mut top) = value else {
            return Err(spec_err("the top level must be a table/object"));
        };
        let name = match top.remove("name") {
            None => default_name.to_string(),
            Some(serde_json::Value::String(s)) => s,
            Some(other) => return Err(spec_err(format!("`name` must be a string, got {other}"))),
        };
        if top.contains_key("model_type") && !top.contains_key("layers") {
            return Err(spec_err(
                "this is a Hugging Face config.json (it has `model_type`), not a vram model \
                 file: pass it with --hf-config",
            ));
        }
        let input = top.remove("input").ok_or_else(|| spec_err("missing `input`"))?;
        let input: InputSpec =
            serde_json::from_value(input).map_err(|e| spec_err(format!("`input`: {e}")))?;
        let Some(serde_json::Value::Array(raw)) = top.remove("layers") else {
            return Err(spec_err("missing `layers` (an array of layer tables)"));
        };
        if let Some(key) = top.keys().next() {
            return Err(spec_err(format!(
                "unknown top-level key `{key}`; expected name, input, layers"
            )));
        }
        let mut layers = Vec::new();
        for (i, mut layer) in raw.into_iter().enumerate() {
            let kind = layer.get("kind").and_then(|k| k.as_str()).unwrap_or("?").to_string();
            let repeat = match layer.as_object_mut().and_then(|o| o.remove("repeat")) {
                None => 1,
                Some(v) => v.as_u64().filter(|&r| r >= 1).ok_or_else(|| {
                    spec_err(format!("layer {i} ({kind}): `repeat` must be an integer >= 1"))
                })?,
            };
            let spec: LayerSpec = serde_json::from_value(layer).map_err(|e| {
                spec_err(format!(
                    "layer {i} (kind `{kind}`): {e}; known kinds: embedding, linear, conv, \
                     attention, norm, pool"
                ))
            })?;
            if repeat > 1 && matches!(spec, LayerSpec::Embedding { .. }) {
                return Err(spec_err(format!("layer {i}: an embedding cannot repeat")));
            }
            let repeat = usize::try_from(repeat)
                .ok()
                .filter(|&r| r <= 100_000)
                .ok_or_else(|| spec_err(format!("layer {i}: `repeat` = {repeat} is too large")))?;
            layers.extend(std::iter::repeat_n(spec, repeat));
        }
        let spec = ModelSpec { name, input, layers };
        spec.resolve()?;
        Ok(spec)
    }

    /// Checks that the layers chain (each gets the shape it needs) and resolves every
    /// layer's sizes.
    ///
    /// # Errors
    ///
    /// A [`SpecError`] naming the first layer (by index) whose input does not fit it, a zero
    /// size, or a last layer that is not 2-d (the loss needs `[rows, classes]`).
    pub fn resolve(&self) -> std::result::Result<ResolvedSpec, SpecError> {
        let zero = |what: &str| spec_err(format!("{what} must be at least 1"));
        let mut flow = match self.input {
            InputSpec::Tokens { seq } if seq > 0 => Flow::Tokens { seq },
            InputSpec::Features { dim } if dim > 0 => Flow::Rows { rows: 1, d: dim, seq: None },
            InputSpec::Image { channels, side } if channels > 0 && side > 0 => {
                Flow::Planes { c: channels, side }
            }
            _ => return Err(zero("every input size")),
        };
        let mut embedding = None;
        let mut chain = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            let bad = |reason: String| spec_err(format!("layer {i} ({}): {reason}", kind(layer)));
            flow = match (*layer, flow) {
                (LayerSpec::Embedding { vocab, dim }, Flow::Tokens { seq }) => {
                    if vocab == 0 || dim == 0 {
                        return Err(bad("vocab and dim must be at least 1".into()));
                    }
                    embedding = Some((vocab, dim));
                    Flow::Rows { rows: seq, d: dim, seq: Some(seq) }
                }
                (LayerSpec::Embedding { .. }, _) => {
                    return Err(bad(
                        "an embedding must be the first layer of a tokens input".into()
                    ));
                }
                (_, Flow::Tokens { .. }) => {
                    return Err(bad("a tokens input must start with an embedding layer".into()));
                }
                (LayerSpec::Linear { out, act }, Flow::Rows { rows, d, seq }) => {
                    if out == 0 {
                        return Err(bad("out must be at least 1".into()));
                    }
                    chain.push(Resolved::Linear {
                        d_in: d,
                        d_out: out,
                        rows_per_sample: rows,
                        act,
                    });
                    Flow::Rows { rows, d: out, seq }
                }
                (
                    LayerSpec::Conv { out, kernel, stride, groups, bn, act },
                    Flow::Planes { c, side },
                ) => {
                    if out == 0 || kernel == 0 || stride == 0 || groups == 0 {
                        return Err(
                            bad("out, kernel, stride and groups must be at least 1".into()),
                        );
                    }
                    if c % groups != 0 || out % groups != 0 {
                        return Err(bad(format!(
                            "groups = {groups} must divide the input channels ({c}) and out ({out})"
                        )));
                    }
                    let padded = side + 2 * (kernel / 2);
                    if padded < kernel {
                        return Err(bad(format!(
                            "kernel {kernel} is larger than the {side} px plane"
                        )));
                    }
                    let side_out = (padded - kernel) / stride + 1;
                    chain.push(Resolved::Conv {
                        c_in: c,
                        c_out: out,
                        kernel,
                        stride,
                        groups,
                        side_out,
                        bn,
                        act,
                    });
                    Flow::Planes { c: out, side: side_out }
                }
                (LayerSpec::Attention { heads, dropout }, Flow::Rows { d, seq: Some(seq), .. }) => {
                    if !(0.0..1.0).contains(&dropout) {
                        return Err(bad(format!("dropout {dropout} is not in [0, 1)")));
                    }
                    if heads == 0 || !d.is_multiple_of(heads) {
                        return Err(bad(format!("heads = {heads} must divide the width ({d})")));
                    }
                    chain.push(Resolved::Attention { d, heads, seq, dropout });
                    flow
                }
                (LayerSpec::Attention { .. }, _) => {
                    return Err(bad("attention needs a tokens input (after the embedding)".into()));
                }
                (LayerSpec::Norm, Flow::Rows { rows, d, .. }) => {
                    chain.push(Resolved::Norm { d, rows_per_sample: rows });
                    flow
                }
                (LayerSpec::Pool, Flow::Planes { c, side }) => {
                    chain.push(Resolved::Pool { c, side });
                    Flow::Rows { rows: 1, d: c, seq: None }
                }
                (LayerSpec::Linear { .. } | LayerSpec::Norm, Flow::Planes { .. }) => {
                    return Err(bad(
                        "needs rows [batch, width]; put a `pool` layer before it".into()
                    ));
                }
                (LayerSpec::Conv { .. } | LayerSpec::Pool, Flow::Rows { .. }) => {
                    return Err(bad("needs images [batch, channels, h, w]".into()));
                }
            };
        }
        let classes = match flow {
            Flow::Rows { d, .. } => d,
            _ => {
                return Err(spec_err(
                    "the last layer must give rows [batch, classes] (end with pool + linear)",
                ));
            }
        };
        if chain.is_empty() {
            return Err(spec_err("the model has no layer besides the embedding"));
        }
        Ok(ResolvedSpec { embedding, chain, classes })
    }
}

fn kind(layer: &LayerSpec) -> &'static str {
    match layer {
        LayerSpec::Embedding { .. } => "embedding",
        LayerSpec::Linear { .. } => "linear",
        LayerSpec::Conv { .. } => "conv",
        LayerSpec::Attention { .. } => "attention",
        LayerSpec::Norm => "norm",
        LayerSpec::Pool => "pool",
    }
}

/// Builds `spec`'s layers into `b` (vram-accum's layer library); returns the embedding.
pub(super) fn build(b: &mut Builder<'_>, spec: &ModelSpec) -> Result<Option<EmbedParts>> {
    let resolved = spec
        .resolve()
        .map_err(|e| vram_accum::Error::InvalidArgument { what: "model spec", reason: e.reason })?;
    let (device, dtype, seed) = (b.device, b.dtype, b.seed);
    let embed = match (resolved.embedding, spec.input) {
        (Some((vocab, dim)), InputSpec::Tokens { seq }) => {
            let table = |rows, part| {
                let std = Init::Normal { std: 0.02 };
                init_weight(device, &[rows, dim], std, 1, dtype, sub_seed(seed, part))
            };
            Some(EmbedParts {
                tok: Param::new("wte", table(vocab, 0)?),
                pos: Some(Param::new("wpe", table(seq, 1 << 32)?)),
                seq,
            })
        }
        _ => None,
    };
    for (i, layer) in resolved.chain.iter().enumerate() {
        let name = format!("l{i}");
        match *layer {
            Resolved::Linear { d_in, d_out, act, .. } => {
                let l = LinearConfig::new(d_in, d_out)
                    .with_activation(act.act())
                    .with_init(Init::HeNormal { gain: 1.0 })
                    .with_dtype(dtype)
                    .with_seed(b.seed())
                    .init(device)?;
                b.push(&name, l);
            }
            Resolved::Conv { c_in, c_out, kernel, stride, groups, bn, act, .. } => {
                let c = Conv2dConfig::new(c_in, c_out, kernel)
                    .with_stride(stride)
                    .with_groups(groups)
                    .with_batch_norm(bn)
                    .with_activation(act.act())
                    .with_init(Init::HeNormal { gain: 1.0 })
                    .with_dtype(dtype)
                    .with_seed(b.seed())
                    .init(device)?;
                b.push(&name, c);
            }
            Resolved::Attention { d, heads, seq, dropout } => {
                let block = TransformerBlockConfig::new(d, heads, seq)
                    .with_dropout(dropout)
                    .with_dtype(dtype)
                    .with_seed(b.seed())
                    .init(device)?;
                b.push(&name, block);
            }
            Resolved::Norm { d, .. } => {
                let n = LayerNormConfig::new(d).with_dtype(dtype).init(device)?;
                b.push(&name, n);
            }
            Resolved::Pool { .. } => b.push(&name, GlobalPool { device: device.clone() }),
        }
    }
    Ok(embed)
}

/// Global average pooling as a chain layer.
struct GlobalPool {
    device: Device,
}

impl Layer for GlobalPool {
    /// The input's shape.
    type Saved = Vec<usize>;

    fn name(&self) -> String {
        "pool".into()
    }

    fn forward(
        &mut self,
        x: &Tensor,
        ctx: &mut ForwardCtx,
    ) -> Result<(Tensor, Option<Vec<usize>>)> {
        let y = ops::global_avg_pool(x)?;
        Ok((y, ctx.training().then(|| x.shape().to_vec())))
    }

    fn backward(&mut self, shape: Vec<usize>, dy: Tensor, want_dx: bool) -> Result<Option<Tensor>> {
        if !want_dx {
            return Ok(None);
        }
        Ok(Some(ops::global_avg_pool_backward(&dy, &shape)?))
    }

    fn params(&self) -> Vec<&Param> {
        Vec::new()
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        Vec::new()
    }

    fn device(&self) -> &Device {
        &self.device
    }
}
