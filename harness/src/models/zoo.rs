//! The architectures: small models the experiments execute on the host, and real-size
//! presets (GPT-2 small and medium, ResNet-50, a MobileNetV3-like, a ViT-B/16-like) for the
//! virtual device, looked up by name with [`Arch::preset`] and listed by [`Arch::presets`].
//!
//! ```
//! use vram_harness::models::Arch;
//!
//! let gpt = Arch::preset("gpt2-medium")?.with_seq(2048)?;
//! assert!(matches!(gpt, Arch::Gpt { d: 1024, layers: 24, heads: 16, seq: 2048, .. }));
//! let err = Arch::preset("gpt5").unwrap_err().to_string();
//! assert!(err.contains("gpt2-small") && err.contains("resnet50"));
//! # Ok::<(), vram_harness::models::ZooError>(())
//! ```

use super::spec::ModelSpec;
use crate::data::Dataset;

/// Which model.
#[derive(Clone, Debug, PartialEq)]
pub enum Arch {
    /// Linear layers with ReLU: `dims[0]` inputs, hidden widths, `classes` outputs.
    Mlp {
        /// Input width then hidden widths.
        dims: Vec<usize>,
        /// Output classes.
        classes: usize,
    },
    /// A small ResNet-like CNN: a 3x3 stem, then stages of basic residual blocks (two full
    /// 3x3 convolutions), each stage after the first halving the resolution and doubling
    /// the channels; global pool and classifier. Fully convolutional (any image side).
    ResNet {
        /// Channels of the first stage.
        width: usize,
        /// Blocks per stage.
        blocks: Vec<usize>,
        /// Output classes.
        classes: usize,
    },
    /// The same stages with depthwise-separable blocks (3x3 depthwise + 1x1 pointwise, two
    /// layers of the chain) in place of each residual block.
    MobileNet {
        /// Channels of the first stage.
        width: usize,
        /// Blocks per stage.
        blocks: Vec<usize>,
        /// Output classes.
        classes: usize,
    },
    /// GPT: token + position embedding, pre-norm multi-head causal transformer blocks, a
    /// final layer norm and the LM head (GPT-2's layout; the head bias-free).
    Gpt {
        /// Vocabulary.
        vocab: usize,
        /// Width.
        d: usize,
        /// Blocks.
        layers: usize,
        /// Attention heads (`d` must be a multiple).
        heads: usize,
        /// Sequence length.
        seq: usize,
        /// Dropout on attention probabilities and residual branches.
        dropout: f32,
        /// Whether the LM head is the token embedding (GPT-2: yes; saves `vocab * d`
        /// parameters) or a separate `[vocab, d]` matrix.
        tied: bool,
    },
    /// ResNet with bottleneck blocks (ResNet-50: stages 3-4-6-3), a 7x7/2 stem and a 3x3/2
    /// max pool, projection shortcuts, a batch norm after every convolution (torchvision's).
    BottleneckResNet {
        /// Image side in pixels (the data's; the network is fully convolutional).
        side: usize,
        /// Bottleneck width of the first stage (64; doubled per stage, blocks output 4x).
        width: usize,
        /// Bottleneck blocks per stage.
        blocks: Vec<usize>,
        /// Output classes.
        classes: usize,
    },
    /// MobileNetV3-Large's layout of inverted residual blocks (3x3 and 5x5 depthwise) with
    /// torchvision's layers: a batch norm after every convolution, hard swish and ReLU,
    /// squeeze-excitation where the table has it, a hard-swish hidden layer in the head.
    MobileNetV3 {
        /// Image side in pixels (the data's).
        side: usize,
        /// Width multiplier (1.0; channels rounded to multiples of 8 as torchvision does).
        width_mult: f32,
        /// Output classes.
        classes: usize,
    },
    /// A Vision Transformer: patches by a strided convolution plus learned positions,
    /// non-causal pre-norm blocks, a final norm, the mean over tokens (no class token) and
    /// a linear classifier.
    Vit {
        /// Image side in pixels (a multiple of `patch`).
        side: usize,
        /// Patch side.
        patch: usize,
        /// Width.
        d: usize,
        /// Blocks.
        layers: usize,
        /// Attention heads.
        heads: usize,
        /// Output classes.
        classes: usize,
        /// Dropout on attention probabilities and residual branches.
        dropout: f32,
    },
    /// A user-described model ([`ModelSpec`], read from a TOML or JSON file).
    Custom(ModelSpec),
    /// The Llama family (Llama, Mistral, Qwen2, TinyLlama), usually read from a Hugging Face
    /// `config.json` ([`super::hf`]).
    Llama(LlamaArch),
}

/// A Llama-family decoder: token embedding (no position table: rotary embeddings in every
/// block), [`LlamaBlock`](vram_accum::layers::LlamaBlock)s, a final RMS norm and the LM head
/// (tied to the embedding or not). HF's `LlamaConfig` names in the comments.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaArch {
    /// Name for reports (the config's model, e.g. `llama-3.2-1b`).
    pub name: String,
    /// `vocab_size`.
    pub vocab: usize,
    /// `hidden_size`.
    pub d: usize,
    /// `num_hidden_layers`.
    pub layers: usize,
    /// `num_attention_heads`.
    pub heads: usize,
    /// `num_key_value_heads`.
    pub kv_heads: usize,
    /// `head_dim` (`hidden_size / num_attention_heads` unless given).
    pub head_dim: usize,
    /// `intermediate_size`.
    pub hidden: usize,
    /// Tokens per sequence of a run (at most `max_positions`).
    pub seq: usize,
    /// `max_position_embeddings`.
    pub max_positions: usize,
    /// `rms_norm_eps`.
    pub eps: f32,
    /// `rope_theta`.
    pub rope_theta: f32,
    /// `rope_scaling`.
    pub rope_scaling: vram_kernels::ops::RopeScaling,
    /// Biases on q, k, v (`attention_bias`; Qwen2 always).
    pub qkv_bias: bool,
    /// `tie_word_embeddings`.
    pub tied: bool,
}

impl LlamaArch {
    /// The block configuration (without dtype and seed).
    pub fn block(&self) -> vram_accum::layers::LlamaBlockConfig {
        vram_accum::layers::LlamaBlockConfig::new(
            self.d,
            self.heads,
            self.kv_heads,
            self.hidden,
            self.seq,
        )
        .with_head_dim(self.head_dim)
        .with_eps(self.eps)
        .with_rope(self.rope_theta, self.rope_scaling)
        .with_qkv_bias(self.qkv_bias)
    }

    /// Parameters, as Hugging Face counts them (`model.num_parameters()`: a tied head once):
    /// `vocab d` of embedding, the blocks, `d` of the final norm, `vocab d` of an untied head.
    pub fn param_count(&self) -> u64 {
        let (v, d) = (self.vocab as u64, self.d as u64);
        let head = if self.tied { 0 } else { v * d };
        v * d + self.layers as u64 * self.block().param_count() + d + head
    }
}

/// A named architecture of the zoo: one entry of [`Arch::presets`], the only list of them
/// (names, aliases, descriptions and the architectures all come from it).
#[derive(Clone, Copy, Debug)]
pub struct Preset {
    /// The name [`Arch::preset`] takes.
    pub name: &'static str,
    /// Other names [`Arch::preset`] takes for it.
    pub aliases: &'static [&'static str],
    /// One line: what it is and what it leaves out.
    pub description: &'static str,
    /// Whether it is a real-size model (for the virtual device or a GPU) rather than a small
    /// one the experiments execute on the host.
    pub real_size: bool,
    /// The architecture.
    pub arch: fn() -> Arch,
}

/// Every preset, small executed models first.
const PRESETS: &[Preset] = &[
    Preset {
        name: "mlp",
        aliases: &[],
        description: "MLP 32-64-64, 8 classes (executed on the host)",
        real_size: false,
        arch: || Arch::Mlp { dims: vec![32, 64, 64], classes: 8 },
    },
    Preset {
        name: "resnet-like",
        aliases: &["resnet"],
        description: "small CNN of basic residual blocks, width 16, stages 2-2, 10 classes, 32 px",
        real_size: false,
        arch: || Arch::ResNet { width: 16, blocks: vec![2, 2], classes: 10 },
    },
    Preset {
        name: "mobilenet-like",
        aliases: &["mobilenet"],
        description: "small CNN of depthwise-separable blocks, width 16, stages 2-2, 10 classes, 32 px",
        real_size: false,
        arch: || Arch::MobileNet { width: 16, blocks: vec![2, 2], classes: 10 },
    },
    Preset {
        name: "gpt",
        aliases: &[],
        description: "small GPT: vocab 256, d 128, 4 layers, 4 heads, seq 64, untied head",
        real_size: false,
        arch: || Arch::Gpt {
            vocab: 256,
            d: 128,
            layers: 4,
            heads: 4,
            seq: 64,
            dropout: 0.1,
            tied: false,
        },
    },
    Preset {
        name: "gpt2-small",
        aliases: &[],
        description: "GPT-2 small, 124,439,808 params: vocab 50257, d 768, 12 layers, 12 heads, seq 1024, tied head",
        real_size: true,
        arch: || Arch::Gpt {
            vocab: 50257,
            d: 768,
            layers: 12,
            heads: 12,
            seq: 1024,
            dropout: 0.1,
            tied: true,
        },
    },
    Preset {
        name: "gpt2-medium",
        aliases: &[],
        description: "GPT-2 medium, 354,823,168 params: d 1024, 24 layers, 16 heads, seq 1024, tied head",
        real_size: true,
        arch: || Arch::Gpt {
            vocab: 50257,
            d: 1024,
            layers: 24,
            heads: 16,
            seq: 1024,
            dropout: 0.1,
            tied: true,
        },
    },
    Preset {
        name: "resnet50",
        aliases: &[],
        description: "ResNet-50 with batch norm, 25,557,032 params (= torchvision): 224 px, 1000 classes",
        real_size: true,
        arch: || Arch::BottleneckResNet {
            side: 224,
            width: 64,
            blocks: vec![3, 4, 6, 3],
            classes: 1000,
        },
    },
    Preset {
        name: "mobilenetv3-like",
        aliases: &[],
        description: "MobileNetV3-Large, 5,483,032 params (= torchvision): 224 px, 1000 classes",
        real_size: true,
        arch: || Arch::MobileNetV3 { side: 224, width_mult: 1.0, classes: 1000 },
    },
    Preset {
        name: "vit-b-like",
        aliases: &[],
        description: "ViT-B/16 with mean pooling, no class token, 86,566,120 params (timm 86,567,656): 224 px",
        real_size: true,
        arch: || Arch::Vit {
            side: 224,
            patch: 16,
            d: 768,
            layers: 12,
            heads: 12,
            classes: 1000,
            dropout: 0.1,
        },
    },
];

/// What went wrong looking up or resizing an architecture.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ZooError {
    /// No preset of that name.
    #[error("unknown model `{name}`; the known models are: {known}")]
    UnknownPreset {
        /// The name given.
        name: String,
        /// The known names, comma-separated.
        known: String,
    },
    /// A size override the architecture has no use for.
    #[error("`{setting}` does not apply to {arch}")]
    NotApplicable {
        /// The override.
        setting: &'static str,
        /// The architecture's name.
        arch: String,
    },
    /// A size override out of range.
    #[error("bad `{setting}` for {arch}: {reason}")]
    BadSize {
        /// The override.
        setting: &'static str,
        /// The architecture's name.
        arch: String,
        /// Why.
        reason: String,
    },
}

impl Arch {
    /// Every preset: name, aliases, one-line description and architecture.
    pub fn presets() -> &'static [Preset] {
        PRESETS
    }

    /// Every name [`Arch::preset`] takes: the presets' names in order, then their aliases.
    pub fn preset_names() -> Vec<&'static str> {
        let aliases = PRESETS.iter().flat_map(|p| p.aliases.iter().copied());
        PRESETS.iter().map(|p| p.name).chain(aliases).collect()
    }

    /// The preset called `name`, or one of its aliases (see [`Arch::presets`]).
    ///
    /// # Errors
    ///
    /// [`ZooError::UnknownPreset`], listing the known names ([`Arch::preset_names`]).
    pub fn preset(name: &str) -> Result<Arch, ZooError> {
        PRESETS
            .iter()
            .find(|p| p.name == name || p.aliases.contains(&name))
            .map(|p| (p.arch)())
            .ok_or_else(|| ZooError::UnknownPreset {
                name: name.into(),
                known: Arch::preset_names().join(", "),
            })
    }

    /// Whether the LM head is the token embedding (a GPT or Llama with `tied`).
    pub fn tied_head(&self) -> bool {
        match self {
            Arch::Gpt { tied, .. } => *tied,
            Arch::Llama(l) => l.tied,
            _ => false,
        }
    }

    /// Whether this is one of the preset CNNs (ResNet-like, MobileNet-like, ResNet-50,
    /// MobileNetV3), which can run channels_last
    /// ([`ModelOptions::channels_last`](super::ModelOptions::channels_last)).
    pub fn is_preset_cnn(&self) -> bool {
        matches!(
            self,
            Arch::ResNet { .. }
                | Arch::MobileNet { .. }
                | Arch::BottleneckResNet { .. }
                | Arch::MobileNetV3 { .. }
        )
    }

    /// A short name for reports ("gpt", "resnet-bottleneck", ...).
    pub fn name(&self) -> &str {
        match self {
            Arch::Custom(spec) => &spec.name,
            Arch::Mlp { .. } => "mlp",
            Arch::ResNet { .. } => "resnet-like",
            Arch::MobileNet { .. } => "mobilenet-like",
            Arch::Gpt { .. } => "gpt",
            Arch::BottleneckResNet { .. } => "resnet-bottleneck",
            Arch::MobileNetV3 { .. } => "mobilenetv3-like",
            Arch::Vit { .. } => "vit",
            Arch::Llama(l) => &l.name,
        }
    }

    /// The data set whose batches this model takes: clusters for the MLP, stripe images
    /// (of the architecture's side; 32 px for the small CNNs, which take any side), token
    /// sequences of the model's length for GPT.
    pub fn dataset(&self) -> Dataset {
        match *self {
            Arch::Mlp { ref dims, classes } => {
                Dataset::Clusters { dim: dims.first().copied().unwrap_or(0), classes }
            }
            Arch::ResNet { classes, .. } | Arch::MobileNet { classes, .. } => {
                Dataset::Stripes { side: 32, classes }
            }
            Arch::Gpt { vocab, seq, .. } => Dataset::Sequences { vocab, seq },
            Arch::Llama(ref l) => Dataset::Sequences { vocab: l.vocab, seq: l.seq },
            Arch::BottleneckResNet { side, classes, .. }
            | Arch::MobileNetV3 { side, classes, .. }
            | Arch::Vit { side, classes, .. } => Dataset::Stripes { side, classes },
            Arch::Custom(ref spec) => spec.dataset(),
        }
    }

    fn not_applicable(&self, setting: &'static str) -> ZooError {
        ZooError::NotApplicable { setting, arch: self.name().into() }
    }

    fn bad(&self, setting: &'static str, reason: impl Into<String>) -> ZooError {
        ZooError::BadSize { setting, arch: self.name().into(), reason: reason.into() }
    }

    /// The same with sequences of `seq` tokens (GPT).
    ///
    /// # Errors
    ///
    /// [`ZooError::NotApplicable`] for a model without sequences; [`ZooError::BadSize`]
    /// for 0.
    pub fn with_seq(self, seq: usize) -> Result<Arch, ZooError> {
        if seq == 0 {
            return Err(self.bad("seq", "must be positive"));
        }
        match self {
            Arch::Gpt { vocab, d, layers, heads, dropout, tied, .. } => {
                Ok(Arch::Gpt { vocab, d, layers, heads, seq, dropout, tied })
            }
            Arch::Llama(l) => Ok(Arch::Llama(LlamaArch { seq, ..l })),
            other => Err(other.not_applicable("seq")),
        }
    }

    /// The same for images of `side` pixels (the image models; ViT needs a multiple of
    /// its patch).
    ///
    /// # Errors
    ///
    /// [`ZooError::NotApplicable`] for the MLP, GPT and the small CNNs (which take any
    /// side: choose it in the data set); [`ZooError::BadSize`] for a side the network
    /// cannot take (below 32 px, which five stride-2 stages need, or not whole patches).
    pub fn with_side(mut self, px: usize) -> Result<Arch, ZooError> {
        match &mut self {
            Arch::BottleneckResNet { side, .. } | Arch::MobileNetV3 { side, .. } => {
                if px < 32 {
                    return Err(self.bad("side", format!("{px} px is below 32 px")));
                }
                *side = px;
            }
            Arch::Vit { side, patch, .. } => {
                if px == 0 || !px.is_multiple_of(*patch) {
                    let p = *patch;
                    return Err(self.bad("side", format!("{px} px is not whole {p} px patches")));
                }
                *side = px;
            }
            _ => return Err(self.not_applicable("side")),
        }
        Ok(self)
    }

    /// The same with `n` output classes (every model but GPT, whose outputs are its
    /// vocabulary).
    ///
    /// # Errors
    ///
    /// [`ZooError::NotApplicable`] for GPT; [`ZooError::BadSize`] for 0.
    pub fn with_classes(mut self, n: usize) -> Result<Arch, ZooError> {
        if n == 0 {
            return Err(self.bad("classes", "must be positive"));
        }
        match &mut self {
            Arch::Mlp { classes, .. }
            | Arch::ResNet { classes, .. }
            | Arch::MobileNet { classes, .. }
            | Arch::BottleneckResNet { classes, .. }
            | Arch::MobileNetV3 { classes, .. }
            | Arch::Vit { classes, .. } => *classes = n,
            Arch::Gpt { .. } | Arch::Custom(_) | Arch::Llama(_) => {
                return Err(self.not_applicable("classes"));
            }
        }
        Ok(self)
    }

    /// The same with widths multiplied by `mult`: GPT's and ViT's `d` (rounded to whole
    /// heads of the same width), the CNNs' first-stage width, MobileNetV3's multiplier,
    /// the MLP's hidden widths.
    ///
    /// # Errors
    ///
    /// [`ZooError::BadSize`] unless `mult` is finite and positive and the result is at
    /// least one channel (one head).
    pub fn with_width(mut self, mult: f32) -> Result<Arch, ZooError> {
        if !(mult.is_finite() && mult > 0.0) {
            return Err(self.bad("width", format!("multiplier {mult} is not finite and > 0")));
        }
        let scale = |w: usize| (w as f32 * mult).round() as usize;
        let too_small = self.bad("width", format!("multiplier {mult} leaves no channels"));
        match &mut self {
            Arch::Mlp { dims, .. } => {
                for w in dims.iter_mut().skip(1) {
                    *w = scale(*w);
                }
                if dims.contains(&0) {
                    return Err(too_small);
                }
            }
            Arch::ResNet { width, .. }
            | Arch::MobileNet { width, .. }
            | Arch::BottleneckResNet { width, .. } => {
                *width = scale(*width);
                if *width == 0 {
                    return Err(too_small);
                }
            }
            Arch::MobileNetV3 { width_mult, .. } => *width_mult *= mult,
            Arch::Gpt { d, heads, .. } | Arch::Vit { d, heads, .. } => {
                let head = *d / *heads;
                *heads = scale(*heads);
                if *heads == 0 {
                    return Err(too_small);
                }
                *d = *heads * head;
            }
            Arch::Custom(_) | Arch::Llama(_) => return Err(self.not_applicable("width")),
        }
        Ok(self)
    }

    /// The same with depth multiplied by `mult`: GPT's and ViT's blocks, the ResNets'
    /// blocks per stage (at least one each).
    ///
    /// # Errors
    ///
    /// [`ZooError::NotApplicable`] for the MLP and MobileNetV3 (a fixed table);
    /// [`ZooError::BadSize`] unless `mult` is finite and positive and leaves a block.
    pub fn with_depth(mut self, mult: f32) -> Result<Arch, ZooError> {
        if !(mult.is_finite() && mult > 0.0) {
            return Err(self.bad("depth", format!("multiplier {mult} is not finite and > 0")));
        }
        let scale = |n: usize| (n as f32 * mult).round() as usize;
        match &mut self {
            Arch::Gpt { layers, .. }
            | Arch::Vit { layers, .. }
            | Arch::Llama(LlamaArch { layers, .. }) => {
                *layers = scale(*layers);
                if *layers == 0 {
                    return Err(self.bad("depth", format!("multiplier {mult} leaves no block")));
                }
            }
            Arch::ResNet { blocks, .. }
            | Arch::MobileNet { blocks, .. }
            | Arch::BottleneckResNet { blocks, .. } => {
                for n in blocks.iter_mut() {
                    *n = scale(*n).max(1);
                }
            }
            Arch::Mlp { .. } | Arch::MobileNetV3 { .. } | Arch::Custom(_) => {
                return Err(self.not_applicable("depth"));
            }
        }
        Ok(self)
    }
}

/// MobileNetV3-Large's blocks (torchvision's `_mobilenet_v3_conf`): input channels, kernel,
/// expanded channels, output channels, squeeze-excitation, hard swish (else ReLU), stride.
pub(crate) const MOBILENETV3_LARGE: [(usize, usize, usize, usize, bool, bool, usize); 15] = [
    (16, 3, 16, 16, false, false, 1),
    (16, 3, 64, 24, false, false, 2),
    (24, 3, 72, 24, false, false, 1),
    (24, 5, 72, 40, true, false, 2),
    (40, 5, 120, 40, true, false, 1),
    (40, 5, 120, 40, true, false, 1),
    (40, 3, 240, 80, false, true, 2),
    (80, 3, 200, 80, false, true, 1),
    (80, 3, 184, 80, false, true, 1),
    (80, 3, 184, 80, false, true, 1),
    (80, 3, 480, 112, true, true, 1),
    (112, 3, 672, 112, true, true, 1),
    (112, 5, 672, 160, true, true, 2),
    (160, 5, 960, 160, true, true, 1),
    (160, 5, 960, 160, true, true, 1),
];

/// torchvision's `_make_divisible(c * mult, 8)`: the nearest multiple of 8, at least 8 and
/// not below 90% of the scaled value.
pub(crate) fn make_divisible(c: usize, mult: f32) -> usize {
    let v = c as f32 * mult;
    let mut r = (((v + 4.0) as usize) / 8 * 8).max(8);
    if (r as f32) < 0.9 * v {
        r += 8;
    }
    r
}
