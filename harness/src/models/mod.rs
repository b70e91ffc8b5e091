//! Reference models: small ones the experiments execute on the host (an MLP, a ResNet-like
//! and a MobileNet-like CNN, a small GPT) and real-size presets for the virtual device
//! (GPT-2 small and medium, ResNet-50, a MobileNetV3-like, a ViT-B/16-like; see [`zoo`]).
//! Each is a [`Chain`] of vram-accum layers ([`vram_accum::layers`]) with a cross-entropy
//! loss; GPT has a token + position embedding in front and, tied, its LM head after. The
//! Llama family ([`Arch::Llama`], read from a Hugging Face `config.json` by [`hf`]) has a
//! token embedding only (rotary embeddings in its blocks) and the same tied or untied head.
//!
//! A model built in f32 can train under autocast ([`Model::set_autocast`]): PyTorch's
//! `torch.autocast` recipe, every forward (and the loss) in an autocast region whose cache of
//! 16-bit weight casts is cleared when the loss is computed. The embedding lookups are not
//! autocast ops (f32 out), the LM head is a linear (16-bit), the cross-entropy runs in f32.
//!
//! A training step computes a tied LM head and its loss fused ([`ops::linear_cross_entropy`],
//! Liger-Kernel's fused linear cross-entropy): the logits in chunks of rows, in f32, with the
//! gradients of the head's input and of the token embedding accumulated chunk by chunk, so
//! that the `[tokens, vocab]` logits and their gradient never exist whole (GPT-2 small at
//! 8 x 1024 tokens: 3.07 GiB fewer at the loss). [`Model::set_fused_loss`] turns it off;
//! evaluation, [`Model::infer`] and [`Model::forward_graph`] compute the logits.
//!
//! The preset CNNs can run channels_last ([`ModelOptions::channels_last`], PyTorch's
//! `model.to(memory_format=torch.channels_last)` with the images converted alike): every
//! activation `[b, h, w, c]`, every convolution's weight `[c_out, kh, kw, c_in / groups]`,
//! the NHWC ops throughout (cuDNN reads NHWC as it is: the layout its tensor-core kernels
//! prefer), the same seed drawing the same model.

pub mod hf;
pub mod spec;
pub mod zoo;

pub use hf::{HfError, HfModel};
pub use vram_accum::layers::Attention;
pub use zoo::{Arch, LlamaArch, Preset, ZooError};

use crate::data::{Batch, Input};
use vram_accum::autocast::{AutocastPolicy, OpKind, accumulate_grad_cast, cast_into};
use vram_accum::layers::{
    Act, BottleneckConfig, ClassifierHeadConfig, Conv2dConfig, Init, InvertedResidualConfig,
    LayerNormConfig, LinearConfig, MaxPool2d, PatchEmbedConfig, ResidualBlockConfig, RmsNormConfig,
    RopeTables, TokenMeanPool, TransformerBlockConfig, init_weight, prefix_param_names, sub_seed,
};
use vram_accum::{
    Autocast, BoxedLayer, Chain, ChainProfile, Error, ForwardCtx, HookPass, Layer, LayerHooks,
    Mode, Param, Params, Result, SavedBox, Schedule,
};
use vram_kernels::{DType, Device, Tensor, ops};
use zoo::{MOBILENETV3_LARGE, make_divisible};

/// A GPT's or Llama's token embedding taken apart ([`Model::into_parts`]).
pub struct EmbedParts {
    /// The token embedding (`wte`, `embed_tokens`): `[vocab, d]`.
    pub tok: Param,
    /// GPT's learned positions (`wpe`); `None` for Llama (rotary embeddings in its blocks).
    pub pos: Option<Param>,
    /// The sequence length.
    pub seq: usize,
}

impl EmbedParts {
    /// The embedding's parameters: the token table, then the positions' if any.
    pub fn params_mut(&mut self) -> Vec<&mut Param> {
        std::iter::once(&mut self.tok).chain(self.pos.as_mut()).collect()
    }

    /// The chain's input for token ids `ids`: the token rows, plus the positions' rows
    /// (GPT; position `i % seq` for id `i`).
    ///
    /// # Errors
    ///
    /// An op's error.
    pub fn forward(&self, ids: &[u32]) -> Result<Tensor> {
        let t = ops::embedding(&self.tok.value, ids)?;
        let Some(pos) = &self.pos else { return Ok(t) };
        let p = ops::embedding(&pos.value, &self.positions(ids.len()))?;
        Ok(ops::add(&t, &p)?)
    }

    /// Adds the gradients of [`forward`](Self::forward) for the chain's input gradient `dx`.
    ///
    /// # Errors
    ///
    /// An op's error.
    pub fn backward(&mut self, ids: &[u32], dx: &Tensor) -> Result<()> {
        let vocab = self.tok.value.shape().first().copied().unwrap_or(0);
        self.tok.accumulate_grad(ops::embedding_backward(ids, dx, vocab)?)?;
        let positions = self.positions(ids.len());
        if let Some(pos) = &mut self.pos {
            pos.accumulate_grad(ops::embedding_backward(&positions, dx, self.seq)?)?;
        }
        Ok(())
    }

    /// The position of each of `n` tokens of whole sequences.
    fn positions(&self, n: usize) -> Vec<u32> {
        (0..n).map(|i| (i % self.seq) as u32).collect()
    }
}

/// A [`Model`] taken apart ([`Model::into_parts`]).
pub struct ModelParts {
    /// GPT's token and position embeddings, Llama's token embedding.
    pub embed: Option<EmbedParts>,
    /// Whether the LM head is the token embedding (logits `h tok^T` after the chain).
    pub tied: bool,
    /// The low dtype of autocast, `None` without ([`Model::set_autocast`]).
    pub autocast: Option<DType>,
    /// Whether the images are converted to channels_last before the chain.
    pub channels_last: bool,
    /// Whether a training step computes a tied head with its loss fused
    /// ([`Model::set_fused_loss`]).
    pub fused_loss: bool,
    /// The chain's layers, in order.
    pub layers: Vec<BoxedLayer>,
}

/// A reference model on a device.
pub struct Model {
    /// Name for reports.
    pub name: String,
    arch: Arch,
    device: Device,
    /// GPT's token and position embeddings, Llama's token embedding.
    embed: Option<EmbedParts>,
    /// The LM head is the token embedding (GPT-2): logits are `h tok^T`, outside the chain.
    tied: bool,
    chain: Chain,
    /// The low dtype of autocast, `None` without.
    autocast: Option<DType>,
    /// Bytes in the autocast cache when the last training forward ended.
    cast_bytes: u64,
    /// Whether a training step computes a tied LM head and its loss fused
    /// ([`ops::linear_cross_entropy`]: the logits in chunks, never whole).
    fused_loss: bool,
    /// Whether the images and activations are channels_last.
    channels_last: bool,
}

/// How [`Model::with_options`] builds a model beyond its architecture, seed and dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ModelOptions {
    /// How transformer blocks (GPT, ViT, Llama) attend (default [`Attention::Fused`]).
    pub attention: Attention,
    /// Whether a preset CNN (ResNet-like, MobileNet-like, ResNet-50, MobileNetV3) runs
    /// channels_last, as PyTorch's `torch.channels_last` (default false). Other models,
    /// a user-described one included, ignore it.
    pub channels_last: bool,
}

impl ModelOptions {
    /// The same with transformer blocks attending in the form `attention`.
    pub fn with_attention(self, attention: Attention) -> Self {
        ModelOptions { attention, ..self }
    }

    /// The same with a preset CNN channels_last (or not).
    pub fn with_channels_last(self, channels_last: bool) -> Self {
        ModelOptions { channels_last, ..self }
    }
}

/// What the tied LM head keeps for backward: its input and weight as multiplied, and the
/// input's own dtype.
pub(crate) struct HeadSaved {
    x: Tensor,
    w: Tensor,
    in_dtype: DType,
}

/// What a training forward keeps alive for backward, with its output.
pub struct Graph {
    _saved: Vec<SavedBox>,
    /// A tied LM head's saved input (and weight), which its backward needs.
    _head: Option<HeadSaved>,
    _logits: Tensor,
}

/// A phase of [`Model::train_step_marked`]: layers by index in the chain and name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Phase {
    /// A layer's forward.
    Forward(usize, String),
    /// The head and the loss, with the loss gradient.
    Loss,
    /// A layer's backward.
    Backward(usize, String),
    /// The embedding tables' backward (GPT).
    EmbeddingBackward,
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Phase::Forward(i, name) => write!(f, "forward of layer {i} ({name})"),
            Phase::Loss => f.write_str("loss"),
            Phase::Backward(i, name) => write!(f, "backward of layer {i} ({name})"),
            Phase::EmbeddingBackward => f.write_str("embedding backward"),
        }
    }
}

/// What one training step measured.
#[derive(Clone, Copy, Debug)]
pub struct StepOutcome {
    /// Mean loss of the batch.
    pub loss: f32,
}

/// Collects a model's layers, each under a name prefix for its parameters, seeded apart.
struct Builder<'a> {
    device: &'a Device,
    dtype: DType,
    seed: u64,
    /// Whether convolutions carry a batch norm (the torchvision presets).
    batch_norm: bool,
    /// Whether the images are channels_last.
    channels_last: bool,
    layers: Vec<BoxedLayer>,
}

impl Builder<'_> {
    fn seed(&self) -> u64 {
        sub_seed(self.seed, self.layers.len() as u64 + 1)
    }

    fn push<L: Layer + 'static>(&mut self, name: &str, mut layer: L) {
        prefix_param_names(&mut layer, name);
        self.layers.push(BoxedLayer::new(layer));
    }

    /// A He-normal convolution with padding `k / 2` and a fused activation, batch-normed
    /// when the builder's `batch_norm` is on.
    #[allow(clippy::too_many_arguments)]
    fn conv(
        &mut self,
        name: &str,
        c_in: usize,
        c_out: usize,
        k: usize,
        stride: usize,
        groups: usize,
        act: Act,
    ) -> Result<()> {
        let conv = Conv2dConfig::new(c_in, c_out, k)
            .with_stride(stride)
            .with_groups(groups)
            .with_batch_norm(self.batch_norm)
            .with_channels_last(self.channels_last)
            .with_activation(act)
            .with_init(Init::HeNormal { gain: 1.0 })
            .with_dtype(self.dtype)
            .with_seed(self.seed())
            .init(self.device)?;
        self.push(name, conv);
        Ok(())
    }

    fn head(&mut self, channels: usize, hidden: Option<usize>, classes: usize) -> Result<()> {
        self.head_with(channels, hidden, Act::Relu, classes)
    }

    /// The classifier head, its hidden layer (if any) activated by `act`.
    fn head_with(
        &mut self,
        channels: usize,
        hidden: Option<usize>,
        act: Act,
        classes: usize,
    ) -> Result<()> {
        let mut cfg = ClassifierHeadConfig::new(channels, classes)
            .with_hidden_activation(act)
            .with_channels_last(self.channels_last)
            .with_dtype(self.dtype)
            .with_seed(self.seed());
        if let Some(h) = hidden {
            cfg = cfg.with_hidden(h);
        }
        let head = cfg.init(self.device)?;
        self.push("head", head);
        Ok(())
    }

    fn norm(&mut self, name: &str, d: usize) -> Result<()> {
        let n = LayerNormConfig::new(d).with_dtype(self.dtype).init(self.device)?;
        self.push(name, n);
        Ok(())
    }
}

impl Model {
    /// Builds `arch` on `device` with weights drawn from `seed` (the same seed gives the same
    /// weights; on a virtual device nothing is drawn).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for sizes the layers refuse (an empty MLP, a width that
    /// is not whole heads, an image side that is not whole patches, ...); out of memory.
    pub fn new(device: &Device, arch: Arch, seed: u64, dtype: DType) -> Result<Model> {
        Model::with_attention(device, arch, seed, dtype, Attention::Fused)
    }

    /// [`Model::new`] with the transformer blocks (GPT, ViT, Llama) attending in the form
    /// `attention`: [`Attention::Fused`] (the default, PyTorch's
    /// `scaled_dot_product_attention`) or [`Attention::Explicit`] (the `[b, heads, seq, seq]`
    /// probabilities kept, PyTorch's eager attention). Other models ignore it.
    ///
    /// # Errors
    ///
    /// As [`Model::new`].
    pub fn with_attention(
        device: &Device,
        arch: Arch,
        seed: u64,
        dtype: DType,
        attention: Attention,
    ) -> Result<Model> {
        let opts = ModelOptions::default().with_attention(attention);
        Model::with_options(device, arch, seed, dtype, opts)
    }

    /// [`Model::new`] built as `opts` says: the attention's form and, for a preset CNN,
    /// channels_last images (see [`ModelOptions`]).
    ///
    /// # Errors
    ///
    /// As [`Model::new`].
    pub fn with_options(
        device: &Device,
        arch: Arch,
        seed: u64,
        dtype: DType,
        opts: ModelOptions,
    ) -> Result<Model> {
        let attention = opts.attention;
        let batch_norm = matches!(arch, Arch::BottleneckResNet { .. } | Arch::MobileNetV3 { .. });
        let channels_last = opts.channels_last && arch.is_preset_cnn();
        let mut b = Builder { device, dtype, seed, batch_norm, channels_last, layers: Vec::new() };
        let (mut embed, mut tied_head) = (None, false);
        match &arch {
            Arch::Mlp { dims, classes } => {
                if dims.is_empty() {
                    return Err(invalid("an MLP needs an input width"));
                }
                let mut widths = dims.clone();
                widths.push(*classes);
                let last = widths.len() - 2;
                for (i, w) in widths.windows(2).enumerate() {
                    let (act, name) = if i < last {
                        (Act::Relu, format!("fc{i}"))
                    } else {
                        (Act::Identity, "head".into())
                    };
                    let l = LinearConfig::new(w[0], w[1])
                        .with_activation(act)
                        .with_init(Init::HeNormal { gain: 1.0 })
                        .with_dtype(dtype)
                        .with_seed(b.seed())
                        .init(device)?;
                    b.push(&name, l);
                }
            }
            Arch::ResNet { width, blocks, classes }
            | Arch::MobileNet { width, blocks, classes } => {
                let depthwise = matches!(arch, Arch::MobileNet { .. });
                b.conv("stem", 3, *width, 3, 1, 1, Act::Relu)?;
                let mut c = *width;
                for (stage, &n) in blocks.iter().enumerate() {
                    if stage > 0 {
                        b.conv(&format!("down{stage}"), c, 2 * c, 3, 2, 1, Act::Relu)?;
                        c *= 2;
                    }
                    for i in 0..n {
                        let name = format!("s{stage}b{i}");
                        if depthwise {
                            b.conv(&format!("{name}.dw"), c, c, 3, 1, c, Act::Relu)?;
                            b.conv(&format!("{name}.pw"), c, c, 1, 1, 1, Act::Relu)?;
                        } else {
                            let block = ResidualBlockConfig::new(c)
                                .with_channels_last(channels_last)
                                .with_dtype(dtype)
                                .with_seed(b.seed())
                                .init(device)?;
                            b.push(&name, block);
                        }
                    }
                }
                b.head(c, None, *classes)?;
            }
            Arch::Gpt { vocab, d, layers, heads, seq, dropout, tied } => {
                let table = |rows, part| {
                    let std = Init::Normal { std: 0.02 };
                    init_weight(device, &[rows, *d], std, 1, dtype, sub_seed(seed, part))
                };
                embed = Some(EmbedParts {
                    tok: Param::new("wte", table(*vocab, 0)?),
                    pos: Some(Param::new("wpe", table(*seq, 1 << 32)?)),
                    seq: *seq,
                });
                tied_head = *tied;
                for i in 0..*layers {
                    let block = TransformerBlockConfig::new(*d, *heads, *seq)
                        .with_attention(attention)
                        .with_dropout(*dropout)
                        .with_init(0.02, *layers)
                        .with_dtype(dtype)
                        .with_seed(b.seed())
                        .init(device)?;
                    b.push(&format!("h{i}"), block);
                }
                b.norm("ln_f", *d)?;
                if !tied {
                    let head = LinearConfig::new(*d, *vocab)
                        .with_bias(false)
                        .with_init(Init::Normal { std: 0.02 })
                        .with_dtype(dtype)
                        .with_seed(b.seed())
                        .init(device)?;
                    b.push("lm_head", head);
                }
            }
            Arch::BottleneckResNet { width, blocks, classes, .. } => {
                b.conv("conv1", 3, *width, 7, 2, 1, Act::Relu)?;
                let pool = MaxPool2d::new(device, 3, 2, 1).with_channels_last(channels_last);
                b.push("maxpool", pool);
                let mut c_in = *width;
                for (stage, &n) in blocks.iter().enumerate() {
                    let mid = width << stage;
                    for i in 0..n {
                        let stride = if i == 0 && stage > 0 { 2 } else { 1 };
                        let block = BottleneckConfig::new(c_in, mid, 4 * mid)
                            .with_stride(stride)
                            .with_batch_norm(true)
                            .with_channels_last(channels_last)
                            .with_dtype(dtype)
                            .with_seed(b.seed())
                            .init(device)?;
                        b.push(&format!("layer{}.{i}", stage + 1), block);
                        c_in = 4 * mid;
                    }
                }
                b.head(c_in, None, *classes)?;
            }
            Arch::MobileNetV3 { width_mult, classes, .. } => {
                let ch = |c| make_divisible(c, *width_mult);
                let first = ch(MOBILENETV3_LARGE[0].0);
                b.conv("stem", 3, first, 3, 2, 1, Act::Hardswish)?;
                let mut last = first;
                for (i, &(c_in, k, e, c_out, se, hs, stride)) in
                    MOBILENETV3_LARGE.iter().enumerate()
                {
                    let e = ch(e);
                    // torchvision: _make_divisible(expanded // 4, 8).
                    let squeeze = se.then(|| make_divisible(e / 4, 1.0));
                    let block = InvertedResidualConfig::new(ch(c_in), e, ch(c_out))
                        .with_kernel(k)
                        .with_stride(stride)
                        .with_batch_norm(true)
                        .with_activation(if hs { Act::Hardswish } else { Act::Relu })
                        .with_squeeze_excitation(squeeze)
                        .with_channels_last(channels_last)
                        .with_dtype(dtype)
                        .with_seed(b.seed())
                        .init(device)?;
                    b.push(&format!("features.{}", i + 1), block);
                    last = ch(c_out);
                }
                b.conv("lastconv", last, 6 * last, 1, 1, 1, Act::Hardswish)?;
                b.head_with(6 * last, Some(ch(1280)), Act::Hardswish, *classes)?;
            }
            Arch::Custom(spec) => embed = spec::build(&mut b, spec)?,
            Arch::Llama(l) => {
                let std = Init::Normal { std: 0.02 };
                let tok = init_weight(device, &[l.vocab, l.d], std, 1, dtype, sub_seed(seed, 0))?;
                embed = Some(EmbedParts {
                    tok: Param::new("embed_tokens.weight", tok),
                    pos: None,
                    seq: l.seq,
                });
                tied_head = l.tied;
                let cfg = l.block().with_dtype(dtype).with_attention(attention);
                // One pair of rotary tables for every block, as HF computes one per forward.
                let tables =
                    RopeTables::new(device, l.seq, l.head_dim, l.rope_theta, l.rope_scaling)?;
                for i in 0..l.layers {
                    let block =
                        cfg.clone().with_seed(b.seed()).init_with_tables(device, &tables)?;
                    b.push(&format!("layers.{i}"), block);
                }
                let norm =
                    RmsNormConfig::new(l.d).with_eps(l.eps).with_dtype(dtype).init(device)?;
                b.push("norm", norm);
                if !l.tied {
                    let head = LinearConfig::new(l.d, l.vocab)
                        .with_bias(false)
                        .with_init(std)
                        .with_dtype(dtype)
                        .with_seed(b.seed())
                        .init(device)?;
                    b.push("lm_head", head);
                }
            }
            Arch::Vit { side, patch, d, layers, heads, classes, dropout } => {
                let cfg = PatchEmbedConfig::new(3, *d, *patch, *side)
                    .with_dtype(dtype)
                    .with_seed(b.seed());
                let tokens = cfg.tokens();
                let patches = cfg.init(device)?;
                b.push("patch_embed", patches);
                for i in 0..*layers {
                    let block = TransformerBlockConfig::new(*d, *heads, tokens)
                        .with_attention(attention)
                        .with_causal(false)
                        .with_dropout(*dropout)
                        .with_init(0.02, *layers)
                        .with_dtype(dtype)
                        .with_seed(b.seed())
                        .init(device)?;
                    b.push(&format!("blocks.{i}"), block);
                }
                b.norm("norm", *d)?;
                b.push("pool", TokenMeanPool::new(device, tokens)?);
                let head = LinearConfig::new(*d, *classes)
                    .with_init(Init::Normal { std: 0.02 })
                    .with_dtype(dtype)
                    .with_seed(b.seed())
                    .init(device)?;
                b.push("head", head);
            }
        }
        Ok(Model {
            name: arch.name().to_string(),
            arch,
            device: device.clone(),
            embed,
            tied: tied_head,
            chain: Chain::new(b.layers),
            autocast: None,
            cast_bytes: 0,
            fused_loss: true,
            channels_last,
        })
    }

    /// Whether the model runs channels_last (asked for in [`ModelOptions`] and a preset
    /// CNN).
    pub fn channels_last(&self) -> bool {
        self.channels_last
    }

    /// Trains (and evaluates) under autocast to `low` (f16 or bf16), PyTorch's
    /// `torch.autocast` recipe, or without autocast (`None`). The parameters stay f32: there
    /// is no master copy; pair f16 with a loss scaler.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if `low` is not a 16-bit type or the model is not in f32.
    pub fn set_autocast(&mut self, low: Option<DType>) -> Result<()> {
        if let Some(low) = low {
            if !low.is_low_precision() {
                return Err(invalid(&format!("autocast needs f16 or bf16, got {low}")));
            }
            if let Some(p) = self.params().into_iter().find(|p| p.value.dtype() != DType::F32) {
                return Err(invalid(&format!(
                    "autocast keeps f32 parameters (no master copy), but {} is {}: build the \
                     model in f32",
                    p.name,
                    p.value.dtype()
                )));
            }
        }
        self.autocast = low;
        Ok(())
    }

    /// Whether a training step computes a tied LM head and its cross-entropy fused, in
    /// chunks of rows ([`ops::linear_cross_entropy`], the default), or plainly (the whole
    /// `[tokens, vocab]` logits and their gradient, as `F.cross_entropy(h @ wte.T, y)`).
    /// Evaluation and [`Model::forward_graph`] compute the logits either way; models without
    /// a tied head are not affected.
    pub fn set_fused_loss(&mut self, fused: bool) {
        self.fused_loss = fused;
    }

    /// Whether a training step fuses a tied LM head with its loss ([`Model::set_fused_loss`]).
    pub fn fused_loss(&self) -> bool {
        self.fused_loss
    }

    /// The low dtype of autocast, `None` without autocast.
    pub fn autocast(&self) -> Option<DType> {
        self.autocast
    }

    /// Bytes of the 16-bit weight casts in the autocast cache when the last training forward
    /// ended (each weight cast once; 0 without autocast).
    pub fn cast_cache_bytes(&self) -> u64 {
        self.cast_bytes
    }

    /// A context for `mode` and `seed`, under the model's autocast if any.
    fn context(&self, mode: Mode, seed: u64) -> Result<ForwardCtx> {
        let ctx = ForwardCtx::new(mode, seed);
        match self.autocast {
            Some(low) => ctx.with_autocast(low),
            None => Ok(ctx),
        }
    }

    /// Puts `ctx` under the model's autocast unless it already has an autocast state.
    fn enter_autocast(&self, ctx: &mut ForwardCtx) -> Result<()> {
        if let (Some(low), None) = (self.autocast, &ctx.autocast) {
            ctx.autocast = Some(Autocast::new(AutocastPolicy::new(low)?));
        }
        Ok(())
    }

    /// The model taken apart: the token embedding (with GPT's positions), whether the LM
    /// head is tied to it (applied after the chain), autocast, the images' layout and the
    /// chain's layers.
    pub fn into_parts(self) -> ModelParts {
        ModelParts {
            embed: self.embed,
            tied: self.tied,
            autocast: self.autocast,
            channels_last: self.channels_last,
            fused_loss: self.fused_loss,
            layers: self.chain.into_layers(),
        }
    }

    /// The architecture.
    pub fn arch(&self) -> &Arch {
        &self.arch
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Every parameter (a tied LM head is the token embedding, counted once).
    pub fn params(&self) -> Vec<&Param> {
        let mut p: Vec<&Param> =
            self.embed.iter().flat_map(|e| std::iter::once(&e.tok).chain(&e.pos)).collect();
        p.extend(self.chain.params());
        p
    }

    /// Every parameter, mutably.
    pub fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut p: Vec<&mut Param> = self
            .embed
            .iter_mut()
            .flat_map(|e| std::iter::once(&mut e.tok).chain(e.pos.as_mut()))
            .collect();
        p.extend(self.chain.params_mut());
        p
    }

    /// Bytes of parameter values.
    pub fn param_bytes(&self) -> u64 {
        self.params().iter().map(|p| p.value.size_in_bytes() as u64).sum()
    }

    /// Number of parameters.
    pub fn param_count(&self) -> u64 {
        self.params().iter().map(|p| p.value.numel() as u64).sum()
    }

    /// Drops every gradient.
    pub fn zero_grad(&mut self) {
        self.params_mut().into_iter().for_each(Param::zero_grad);
    }

    /// The chain's input for a batch: the features, or the embedded tokens.
    fn input(&self, batch: &Batch, dtype: DType) -> Result<Tensor> {
        // Channels_last images are converted on the device, as PyTorch's
        // `x.to(memory_format=torch.channels_last)` copies a contiguous batch.
        let layout = |x: Tensor| -> Result<Tensor> {
            if self.channels_last { Ok(ops::permute(&x, &[0, 2, 3, 1])?) } else { Ok(x) }
        };
        match (&batch.input, &self.embed) {
            (Input::Dense { values, shape }, None) => {
                layout(Tensor::from_f32_slice(&self.device, shape, values, dtype)?)
            }
            (Input::Shape(shape), None) if self.device.is_virtual() => {
                layout(Tensor::zeros(&self.device, shape, dtype)?)
            }
            (Input::Shape(_), None) => Err(invalid(
                "a batch without values (Dataset::batch_without_values) runs only on a virtual \
                 device",
            )),
            (Input::Tokens(ids), Some(e)) => e.forward(ids),
            _ => Err(invalid("the batch does not match the model's input kind")),
        }
    }

    fn embed_backward(&mut self, batch: &Batch, dx: &Tensor) -> Result<()> {
        if let (Input::Tokens(ids), Some(e)) = (&batch.input, &mut self.embed) {
            e.backward(ids, dx)?;
        }
        Ok(())
    }

    /// The logits from the chain's output (the tied head applied, if any: see
    /// [`tied_head`]), and what the head keeps.
    fn head(&self, out: Tensor, ctx: &mut ForwardCtx) -> Result<(Tensor, Option<HeadSaved>)> {
        let Some(e) = self.embed.as_ref().filter(|_| self.tied) else { return Ok((out, None)) };
        let (logits, saved) = tied_head(&e.tok, out, ctx)?;
        Ok((logits, Some(saved)))
    }

    /// The mean cross-entropy of the chain's output (the head applied) under `ctx`.
    fn loss_of(&self, out: Tensor, targets: &[u32], ctx: &mut ForwardCtx) -> Result<f32> {
        // A tied head's saved input lives until the loss is computed, as in a training step.
        let (logits, _head) = self.head(out, ctx)?;
        let logits = loss_input(logits, ctx)?;
        Ok(ops::cross_entropy(&logits, targets, None)?.loss)
    }

    /// Number of layers in the chain (what schedules are built for).
    pub fn chain_len(&self) -> usize {
        self.chain.len()
    }

    /// Forward, loss and backward on one batch: gradients are added into the parameters'
    /// gradients. `scale` multiplies the loss gradient (accumulation, loss scaling).
    ///
    /// # Errors
    ///
    /// A batch of the wrong kind; an op's error (out of memory above all).
    pub fn train_step(
        &mut self,
        batch: &Batch,
        ctx: &mut ForwardCtx,
        scale: f32,
    ) -> Result<StepOutcome> {
        let plain = Schedule::none(self.chain.len())?;
        self.train_step_with(batch, ctx, scale, &plain)
    }

    /// [`Model::train_step`] with a checkpoint schedule for the chain.
    ///
    /// # Errors
    ///
    /// As [`Model::train_step`], and a schedule made for another chain.
    pub fn train_step_with(
        &mut self,
        batch: &Batch,
        ctx: &mut ForwardCtx,
        scale: f32,
        schedule: &Schedule,
    ) -> Result<StepOutcome> {
        self.step(batch, ctx, scale, schedule, None)
    }

    /// [`Model::train_step_with`] that feeds `peaks` the device's peak so far and the
    /// parameters' gradient bytes before each phase: the forward, the loss, each layer's
    /// backward (a checkpointed segment's layers before their recomputation), the
    /// embeddings' backward and the end of the step. With a mark after the caller's
    /// optimizer step, [`PeakGrads::grads_at_peak`] says which gradients existed when the
    /// peak was reached (`zero_grad` frees them each step, PyTorch's `set_to_none`).
    ///
    /// # Errors
    ///
    /// As [`Model::train_step_with`].
    pub fn train_step_tracked(
        &mut self,
        batch: &Batch,
        ctx: &mut ForwardCtx,
        scale: f32,
        schedule: &Schedule,
        peaks: &mut PeakGrads,
    ) -> Result<StepOutcome> {
        self.step(batch, ctx, scale, schedule, Some(peaks))
    }

    /// The training step, marking `peaks` before each phase when given (the plain step
    /// reads no statistics).
    fn step(
        &mut self,
        batch: &Batch,
        ctx: &mut ForwardCtx,
        scale: f32,
        schedule: &Schedule,
        mut peaks: Option<&mut PeakGrads>,
    ) -> Result<StepOutcome> {
        self.enter_autocast(ctx)?;
        let dtype = self.params()[0].value.dtype();
        self.mark(&mut peaks);
        let x = self.input(batch, dtype)?;
        let (out, tape) = self.chain.forward(&x, ctx, schedule)?;
        self.mark(&mut peaks);
        let (loss, dy) = self.loss_backward(out, &batch.targets, ctx, scale)?;
        let want_dx = self.embed.is_some();
        let dx = match peaks.as_deref_mut() {
            Some(peaks) => {
                let dev = self.device.clone();
                let (grads, held) = (self.grad_bytes(), vec![0; self.chain.len()]);
                let mut probe = GradProbe { dev: &dev, peaks, grads, held };
                self.chain.backward_hooked(tape, dy, want_dx, &mut probe)?
            }
            None => self.chain.backward(tape, dy, want_dx)?,
        };
        drop(x);
        if let Some(dx) = dx {
            self.mark(&mut peaks);
            self.embed_backward(batch, &dx)?;
        }
        self.mark(&mut peaks);
        Ok(StepOutcome { loss })
    }

    /// A phase starts: the peak so far and the gradients that exist, into `peaks` if given.
    fn mark(&self, peaks: &mut Option<&mut PeakGrads>) {
        if let Some(p) = peaks {
            p.mark(self.device.max_memory_allocated(), self.grad_bytes());
        }
    }

    /// From the chain's output: the head, the loss and their backward; returns the loss and
    /// the gradient of the chain's output.
    fn loss_backward(
        &mut self,
        out: Tensor,
        targets: &[u32],
        ctx: &mut ForwardCtx,
        scale: f32,
    ) -> Result<(f32, Tensor)> {
        if self.fused_loss && self.tied && self.embed.is_some() {
            return self.fused_loss_backward(out, targets, ctx, scale);
        }
        let (logits, head) = self.head(out, ctx)?;
        let logits_dtype = logits.dtype();
        let logits = loss_input(logits, ctx)?;
        // The autocast region ends with the loss: PyTorch's clear_cache. Casts the layers
        // saved for backward live on until their backward.
        self.cast_bytes = ctx.autocast().map_or(0, Autocast::cached_bytes);
        ctx.clear_autocast_cache();
        let (loss, mut dy) = loss_and_grad(logits, targets, scale, logits_dtype)?;
        if let (Some(h), Some(e)) = (head, &mut self.embed) {
            dy = tied_head_backward(h, &mut e.tok, &dy)?;
        }
        Ok((loss, dy))
    }

    /// [`Model::loss_backward`] for a tied head, fused ([`fused_tied_loss`]).
    fn fused_loss_backward(
        &mut self,
        out: Tensor,
        targets: &[u32],
        ctx: &mut ForwardCtx,
        scale: f32,
    ) -> Result<(f32, Tensor)> {
        let e =
            self.embed.as_mut().ok_or_else(|| invalid("a tied head needs the token embedding"))?;
        fused_tied_loss(&mut e.tok, out, targets, ctx, scale, &mut self.cast_bytes)
    }

    /// [`Model::train_step`] without checkpointing, layer by layer, calling `mark` before each
    /// phase (each layer's forward, the loss, each layer's backward, the embedding's
    /// backward): what PyTorch's module hooks or `record_function` ranges give a memory
    /// profiler, so that an allocation can be attributed to the layer that made it.
    ///
    /// # Errors
    ///
    /// As [`Model::train_step`].
    pub fn train_step_marked(
        &mut self,
        batch: &Batch,
        ctx: &mut ForwardCtx,
        mark: &mut dyn FnMut(Phase),
    ) -> Result<StepOutcome> {
        self.enter_autocast(ctx)?;
        let dtype = self.params()[0].value.dtype();
        let want_first_dx = self.embed.is_some();
        let mut x = self.input(batch, dtype)?;
        let mut saved = Vec::with_capacity(self.chain.len());
        for (i, layer) in self.chain.layers_mut().iter_mut().enumerate() {
            mark(Phase::Forward(i, layer.name()));
            let (y, s) = layer.forward(&x, ctx)?;
            saved.push(s);
            x = y;
        }
        mark(Phase::Loss);
        let (loss, dy) = self.loss_backward(x, &batch.targets, ctx, 1.0)?;
        // Each layer owns its output gradient (and frees it when done with it).
        let mut dy = Some(dy);
        for (i, layer) in self.chain.layers_mut().iter_mut().enumerate().rev() {
            mark(Phase::Backward(i, layer.name()));
            let s = saved.pop().flatten().ok_or_else(|| invalid("a layer saved nothing"))?;
            let g = dy.take().ok_or_else(|| invalid("a layer returned no input gradient"))?;
            dy = layer.backward(s, g, i > 0 || want_first_dx)?;
        }
        if want_first_dx {
            mark(Phase::EmbeddingBackward);
            let dy = dy.ok_or_else(|| invalid("the first layer returned no input gradient"))?;
            self.embed_backward(batch, &dy)?;
        }
        Ok(StepOutcome { loss })
    }

    /// Bytes of the parameters' gradients that exist now (none after
    /// [`Model::zero_grad`], PyTorch's `set_to_none`).
    pub fn grad_bytes(&self) -> u64 {
        self.params().iter().filter_map(|p| p.grad.as_ref()).map(|g| g.size_in_bytes() as u64).sum()
    }

    /// Per-layer activation bytes and times of the chain on `batch` (for checkpoint plans).
    /// A tied LM head is outside the chain and not in the profile.
    ///
    /// # Errors
    ///
    /// As [`Model::train_step`].
    pub fn profile(&mut self, batch: &Batch, seed: u64) -> Result<ChainProfile> {
        let dtype = self.params()[0].value.dtype();
        let x = self.input(batch, dtype)?;
        let ctx = self.context(Mode::Train, seed)?;
        self.chain.profile(&x, &ctx, self.embed.is_some())
    }

    /// A training forward whose saved state (what backward would need: PyTorch's autograd
    /// graph) goes to the caller with the logits. Keeping it alive is the classic leak of
    /// `losses.append(loss)`; dropping it is `loss.item()`.
    ///
    /// # Errors
    ///
    /// As [`Model::train_step`].
    pub fn forward_graph(&mut self, batch: &Batch, seed: u64) -> Result<(f32, Graph)> {
        let dtype = self.params()[0].value.dtype();
        let mut ctx = self.context(Mode::Train, seed)?;
        let mut x = self.input(batch, dtype)?;
        let mut saved = Vec::with_capacity(self.chain.len());
        for layer in self.chain.layers_mut() {
            let (y, s) = layer.forward(&x, &mut ctx)?;
            saved.extend(s);
            x = y;
        }
        let (logits, head) = self.head(x, &mut ctx)?;
        let logits = loss_input(logits, &ctx)?;
        ctx.clear_autocast_cache();
        let loss = ops::cross_entropy(&logits, &batch.targets, None)?.loss;
        Ok((loss, Graph { _saved: saved, _head: head, _logits: logits }))
    }

    /// The logits of an inference forward on `batch` (nothing saved for backward: PyTorch's
    /// `with torch.no_grad(): out = model(x)`). The output stays allocated while the caller
    /// holds it.
    ///
    /// # Errors
    ///
    /// As [`Model::train_step`].
    pub fn infer(&mut self, batch: &Batch) -> Result<Tensor> {
        let dtype = self.params()[0].value.dtype();
        let x = self.input(batch, dtype)?;
        let mut ctx = self.context(Mode::Inference, 0)?;
        let plain = Schedule::none(self.chain.len())?;
        let (out, tape) = self.chain.forward(&x, &mut ctx, &plain)?;
        drop(tape);
        drop(x);
        let (logits, _) = self.head(out, &mut ctx)?;
        ctx.clear_autocast_cache();
        Ok(logits)
    }

    /// Mean loss on a batch without backward. With `mode == Mode::Train` the forward saves
    /// what backward would need (as a training forward does) and drops it at the end; with
    /// `Mode::Inference` nothing is saved.
    ///
    /// # Errors
    ///
    /// As [`Model::train_step`].
    pub fn eval_loss(&mut self, batch: &Batch, mode: Mode) -> Result<f32> {
        let dtype = self.params()[0].value.dtype();
        let x = self.input(batch, dtype)?;
        let mut ctx = self.context(mode, 0)?;
        let plain = Schedule::none(self.chain.len())?;
        let (out, tape) = self.chain.forward(&x, &mut ctx, &plain)?;
        let loss = self.loss_of(out, &batch.targets, &mut ctx)?;
        drop(tape);
        Ok(loss)
    }
}

/// The embedding tables (GPT) and the chain's parameters, for vram-amp's optimizers.
impl Params for Model {
    fn params(&self) -> Vec<&Param> {
        Model::params(self)
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        Model::params_mut(self)
    }
}

/// A tied head's operands: the chain's output and the token table in the dtype a linear
/// runs in (16 bits under autocast, the table through the cast cache).
fn head_operands(tok: &Param, out: Tensor, ctx: &mut ForwardCtx) -> Result<HeadSaved> {
    let in_dtype = out.dtype();
    let dt = ctx.op_dtype(OpKind::Linear, &[in_dtype, tok.value.dtype()]).unwrap_or(in_dtype);
    let w = ctx.cast_param(tok, dt)?;
    Ok(HeadSaved { x: cast_into(out, dt)?, w, in_dtype })
}

/// A tied LM head on the chain's output `out`: the logits `out tok^T` (a linear, so in 16
/// bits under autocast, the weight through the cast cache), and what its backward keeps.
///
/// # Errors
///
/// An op's error.
pub(crate) fn tied_head(
    tok: &Param,
    out: Tensor,
    ctx: &mut ForwardCtx,
) -> Result<(Tensor, HeadSaved)> {
    let h = head_operands(tok, out, ctx)?;
    let logits = ops::linear(&h.x, &h.w, None)?;
    Ok((logits, h))
}

/// The backward of [`tied_head`] for the logits' gradient `dy`: adds the weight's gradient
/// into `tok`'s (cast to its dtype) and returns the chain output's gradient.
///
/// # Errors
///
/// An op's error.
pub(crate) fn tied_head_backward(h: HeadSaved, tok: &mut Param, dy: &Tensor) -> Result<Tensor> {
    let g = ops::linear_backward(&h.x, &h.w, dy, false)?;
    drop(h.x);
    drop(h.w);
    accumulate_grad_cast(tok, g.dw)?;
    cast_into(g.dx, h.in_dtype)
}

/// The loss's input: the logits in the dtype the loss runs in (f32 under autocast:
/// PyTorch's fp32 list has `nll_loss`, `log_softmax` and `cross_entropy_loss`).
pub(crate) fn loss_input(logits: Tensor, ctx: &ForwardCtx) -> Result<Tensor> {
    let dt = ctx.op_dtype(OpKind::Loss, &[logits.dtype()]).unwrap_or(logits.dtype());
    cast_into(logits, dt)
}

/// The mean cross-entropy of `logits` (the loss's input) against `targets`, and its
/// gradient times `scale` in `dtype` (the logits' dtype before [`loss_input`]).
///
/// # Errors
///
/// An op's error.
pub(crate) fn loss_and_grad(
    logits: Tensor,
    targets: &[u32],
    scale: f32,
    dtype: DType,
) -> Result<(f32, Tensor)> {
    let ce = ops::cross_entropy(&logits, targets, None)?;
    let dy = ops::cross_entropy_backward(&logits, targets, None, &ce.lse, scale)?;
    let loss = ce.loss;
    drop((logits, ce));
    Ok((loss, cast_into(dy, dtype)?))
}

/// A tied LM head and its loss, fused: the head's operands as [`tied_head`] casts them,
/// then the logits, the f32 loss and the gradients of the head's input and weight chunk by
/// chunk ([`ops::linear_cross_entropy`], for the upstream gradient `scale`); the weight's
/// gradient (in `tok`'s dtype: under autocast the f32 accumulator itself, neither rounded to
/// 16 bits nor cast back, as the plain path's `to(dtype)` backward) goes into `tok`'s, the
/// input's is returned with the loss. The autocast region ends with the loss, as in the
/// plain path: `cast_bytes` gets the cache's bytes before it is cleared.
///
/// # Errors
///
/// An op's error.
pub(crate) fn fused_tied_loss(
    tok: &mut Param,
    out: Tensor,
    targets: &[u32],
    ctx: &mut ForwardCtx,
    scale: f32,
    cast_bytes: &mut u64,
) -> Result<(f32, Tensor)> {
    let HeadSaved { x, w, in_dtype } = head_operands(tok, out, ctx)?;
    *cast_bytes = ctx.autocast().map_or(0, Autocast::cached_bytes);
    ctx.clear_autocast_cache();
    let params =
        ops::LinearCrossEntropyParams::default().dloss(scale).grad_weight_dtype(tok.value.dtype());
    let lce = ops::linear_cross_entropy(&x, &w, targets, &params)?;
    drop((x, w));
    accumulate_grad_cast(tok, lce.grad_weight)?;
    Ok((lce.loss, cast_into(lce.grad_hidden, in_dtype)?))
}

/// Which parameters' gradients existed when a run's peak allocation was reached: fed the
/// device's peak so far and the gradient bytes at the start of each phase
/// ([`Model::train_step_tracked`], and the caller's optimizer step), it keeps those at the
/// start of the phase in which the running peak last rose. The phase's own gradients, made
/// during it, are not counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeakGrads {
    last_peak: Option<u64>,
    last_grads: u64,
    at_peak: u64,
}

impl PeakGrads {
    /// A phase starts: the peak so far and the gradient bytes that exist.
    pub fn mark(&mut self, peak_so_far: u64, grads: u64) {
        if self.last_peak.is_some_and(|p| peak_so_far > p) {
            self.at_peak = self.last_grads;
        }
        self.last_peak = Some(peak_so_far);
        self.last_grads = grads;
    }

    /// The gradient bytes at the start of the phase in which the peak was reached.
    pub fn grads_at_peak(&self) -> u64 {
        self.at_peak
    }
}

/// [`Model::train_step_tracked`]'s hooks on the chain's backward: a mark before each
/// layer, the gradient total updated after it.
struct GradProbe<'a> {
    dev: &'a Device,
    peaks: &'a mut PeakGrads,
    grads: u64,
    /// Each layer's gradient bytes when its backward began.
    held: Vec<u64>,
}

fn layer_grad_bytes(layer: &BoxedLayer) -> u64 {
    layer.params().iter().filter_map(|p| p.grad.as_ref()).map(|g| g.size_in_bytes() as u64).sum()
}

impl LayerHooks for GradProbe<'_> {
    fn before(&mut self, pass: HookPass, i: usize, layer: &mut BoxedLayer) -> Result<()> {
        if pass == HookPass::Backward {
            if let Some(h) = self.held.get_mut(i) {
                *h = layer_grad_bytes(layer);
            }
            self.peaks.mark(self.dev.max_memory_allocated(), self.grads);
        }
        Ok(())
    }

    fn after(&mut self, pass: HookPass, i: usize, layer: &mut BoxedLayer) -> Result<()> {
        if pass == HookPass::Backward {
            let before = self.held.get(i).copied().unwrap_or(0);
            self.grads = self.grads - before.min(self.grads) + layer_grad_bytes(layer);
        }
        Ok(())
    }
}

fn invalid(reason: &str) -> Error {
    Error::InvalidArgument { what: "model", reason: reason.into() }
}
