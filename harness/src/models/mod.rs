//! Reference models: an MLP, a ResNet-like CNN, a MobileNet-like CNN of the same depth with
//! depthwise-separable convolutions, and a small GPT. Each is a chain of vram-accum layers
//! with a cross-entropy loss; the GPT has a token + position embedding in front.

pub mod layers;
pub mod spec;

use crate::data::{Batch, Input};
use crate::rng::Rng;
use layers::{Act, ClassifierHead, Conv, Dense, ResidualBlock, TransformerBlock};
use vram_accum::{
    BoxedLayer, Chain, ChainProfile, Error, ForwardCtx, Mode, Param, Params, Result, SavedBox,
    Schedule,
};
use vram_kernels::{DType, Device, Tensor, ops};

/// Which reference model.
#[derive(Clone, Debug, PartialEq)]
pub enum Arch {
    /// Dense layers with ReLU: `dims[0]` inputs, hidden widths, `classes` outputs.
    Mlp {
        /// Input width then hidden widths.
        dims: Vec<usize>,
        /// Output classes.
        classes: usize,
    },
    /// A stem convolution then stages of residual blocks (full 3x3 convolutions), each
    /// stage after the first halving the resolution and doubling the channels.
    ResNet {
        /// Channels of the first stage.
        width: usize,
        /// Blocks per stage.
        blocks: Vec<usize>,
        /// Output classes.
        classes: usize,
    },
    /// The same stages with depthwise-separable blocks (3x3 depthwise + 1x1 pointwise) in
    /// place of each residual block's two full convolutions.
    MobileNet {
        /// Channels of the first stage.
        width: usize,
        /// Blocks per stage.
        blocks: Vec<usize>,
        /// Output classes.
        classes: usize,
    },
    /// Token + position embedding, pre-norm transformer blocks, final norm and LM head.
    Gpt {
        /// Vocabulary.
        vocab: usize,
        /// Width.
        d: usize,
        /// Blocks.
        layers: usize,
        /// Sequence length.
        seq: usize,
        /// Dropout after each block's MLP.
        dropout: f32,
    },
    /// A user-described model ([`spec::ModelSpec`], read from a TOML or JSON file).
    Custom(spec::ModelSpec),
}

struct Embed {
    tok: Param,
    pos: Param,
    seq: usize,
}

/// A reference model on a device.
pub struct Model {
    /// Name for reports.
    pub name: String,
    arch: Arch,
    device: Device,
    embed: Option<Embed>,
    chain: Chain,
}

/// What a training forward keeps alive for backward, with its output.
pub struct Graph {
    _saved: Vec<SavedBox>,
    _logits: Tensor,
}

/// What one training step measured.
#[derive(Clone, Copy, Debug)]
pub struct StepOutcome {
    /// Mean loss of the batch.
    pub loss: f32,
}

impl Model {
    /// Builds `arch` on `device` with weights drawn from `seed`.
    pub fn new(device: &Device, arch: Arch, seed: u64, dtype: DType) -> Result<Model> {
        let mut rng = Rng::new(seed);
        let rng = &mut rng;
        let mut layers: Vec<BoxedLayer> = Vec::new();
        let mut embed = None;
        let name = match &arch {
            Arch::Mlp { dims, classes } => {
                for (i, w) in dims.windows(2).enumerate() {
                    layers.push(BoxedLayer::new(Dense::new(
                        device,
                        &format!("fc{i}"),
                        w[0],
                        w[1],
                        Act::Relu,
                        rng,
                        dtype,
                    )?));
                }
                let last = *dims.last().ok_or_else(|| invalid("an MLP needs an input width"))?;
                layers.push(BoxedLayer::new(Dense::new(
                    device,
                    "head",
                    last,
                    *classes,
                    Act::Identity,
                    rng,
                    dtype,
                )?));
                "mlp".to_string()
            }
            Arch::ResNet { width, blocks, classes }
            | Arch::MobileNet { width, blocks, classes } => {
                let depthwise = matches!(arch, Arch::MobileNet { .. });
                layers.push(BoxedLayer::new(Conv::new(
                    device,
                    "stem",
                    3,
                    *width,
                    3,
                    1,
                    1,
                    Act::Relu,
                    rng,
                    dtype,
                )?));
                let mut c = *width;
                for (stage, &n) in blocks.iter().enumerate() {
                    if stage > 0 {
                        let name = format!("down{stage}");
                        layers.push(BoxedLayer::new(Conv::new(
                            device,
                            &name,
                            c,
                            2 * c,
                            3,
                            2,
                            1,
                            Act::Relu,
                            rng,
                            dtype,
                        )?));
                        c *= 2;
                    }
                    for b in 0..n {
                        let name = format!("s{stage}b{b}");
                        if depthwise {
                            let dw = Conv::new(
                                device,
                                &format!("{name}.dw"),
                                c,
                                c,
                                3,
                                1,
                                c,
                                Act::Relu,
                                rng,
                                dtype,
                            )?;
                            let pw = Conv::new(
                                device,
                                &format!("{name}.pw"),
                                c,
                                c,
                                1,
                                1,
                                1,
                                Act::Relu,
                                rng,
                                dtype,
                            )?;
                            layers.push(BoxedLayer::new(dw));
                            layers.push(BoxedLayer::new(pw));
                        } else {
                            layers.push(BoxedLayer::new(ResidualBlock::new(
                                device, &name, c, rng, dtype,
                            )?));
                        }
                    }
                }
                layers.push(BoxedLayer::new(ClassifierHead::new(device, c, *classes, rng, dtype)?));
                if depthwise { "mobilenet-like" } else { "resnet-like" }.to_string()
            }
            Arch::Gpt { vocab, d, layers: n, seq, dropout } => {
                embed = Some(Embed {
                    tok: Param::new(
                        "wte",
                        layers::normal(device, &[*vocab, *d], 0.02, rng, dtype)?,
                    ),
                    pos: Param::new("wpe", layers::normal(device, &[*seq, *d], 0.02, rng, dtype)?),
                    seq: *seq,
                });
                for i in 0..*n {
                    layers.push(BoxedLayer::new(TransformerBlock::new(
                        device,
                        &format!("h{i}"),
                        *d,
                        *seq,
                        *dropout,
                        rng,
                        dtype,
                    )?));
                }
                layers.push(BoxedLayer::new(Dense::new(
                    device,
                    "lm_head",
                    *d,
                    *vocab,
                    Act::Identity,
                    rng,
                    dtype,
                )?));
                "gpt".to_string()
            }
            Arch::Custom(model_spec) => {
                let (e, chain) = spec::build(device, model_spec, rng, dtype)?;
                embed = e;
                layers = chain;
                model_spec.name.clone()
            }
        };
        Ok(Model { name, arch, device: device.clone(), embed, chain: Chain::new(layers) })
    }

    /// The architecture.
    pub fn arch(&self) -> &Arch {
        &self.arch
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Every parameter.
    pub fn params(&self) -> Vec<&Param> {
        let mut p: Vec<&Param> = self.embed.iter().flat_map(|e| [&e.tok, &e.pos]).collect();
        p.extend(self.chain.params());
        p
    }

    /// Every parameter, mutably.
    pub fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut p: Vec<&mut Param> =
            self.embed.iter_mut().flat_map(|e| [&mut e.tok, &mut e.pos]).collect();
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
        match (&batch.input, &self.embed) {
            (Input::Dense { values, shape }, None) => {
                Ok(Tensor::from_f32_slice(&self.device, shape, values, dtype)?)
            }
            (Input::Tokens(ids), Some(e)) => {
                let positions: Vec<u32> = (0..ids.len()).map(|i| (i % e.seq) as u32).collect();
                let tok = ops::embedding(&e.tok.value, ids)?;
                let pos = ops::embedding(&e.pos.value, &positions)?;
                Ok(ops::add(&tok, &pos)?)
            }
            _ => Err(invalid("the batch does not match the model's input kind")),
        }
    }

    fn embed_backward(&mut self, batch: &Batch, dx: &Tensor) -> Result<()> {
        if let (Input::Tokens(ids), Some(e)) = (&batch.input, &mut self.embed) {
            let positions: Vec<u32> = (0..ids.len()).map(|i| (i % e.seq) as u32).collect();
            e.tok.accumulate_grad(ops::embedding_backward(ids, dx, e.tok.value.shape()[0])?)?;
            e.pos.accumulate_grad(ops::embedding_backward(&positions, dx, e.seq)?)?;
        }
        Ok(())
    }

    /// Number of layers in the chain (what schedules are built for).
    pub fn chain_len(&self) -> usize {
        self.chain.len()
    }

    /// Forward, loss and backward on one batch: gradients are added into the parameters'
    /// gradients. `scale` multiplies the loss gradient (accumulation, loss scaling).
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
    pub fn train_step_with(
        &mut self,
        batch: &Batch,
        ctx: &mut ForwardCtx,
        scale: f32,
        schedule: &Schedule,
    ) -> Result<StepOutcome> {
        let dtype = self.params()[0].value.dtype();
        let x = self.input(batch, dtype)?;
        let (logits, tape) = self.chain.forward(&x, ctx, schedule)?;
        let ce = ops::cross_entropy(&logits, &batch.targets, None)?;
        let loss = ce.loss;
        let dy = ops::cross_entropy_backward(&logits, &batch.targets, None, &ce.lse, scale)?;
        drop((logits, ce));
        let dx = self.chain.backward(tape, dy, self.embed.is_some())?;
        drop(x);
        if let Some(dx) = dx {
            self.embed_backward(batch, &dx)?;
        }
        Ok(StepOutcome { loss })
    }

    /// Per-layer activation bytes and times of the chain on `batch` (for checkpoint plans).
    pub fn profile(&mut self, batch: &Batch, seed: u64) -> Result<ChainProfile> {
        let dtype = self.params()[0].value.dtype();
        let x = self.input(batch, dtype)?;
        let ctx = ForwardCtx::new(Mode::Train, seed);
        self.chain.profile(&x, &ctx, self.embed.is_some())
    }

    /// A training forward whose saved state (what backward would need: PyTorch's autograd
    /// graph) goes to the caller with the logits. Keeping it alive is the classic leak of
    /// `losses.append(loss)`; dropping it is `loss.item()`.
    pub fn forward_graph(&mut self, batch: &Batch, seed: u64) -> Result<(f32, Graph)> {
        let dtype = self.params()[0].value.dtype();
        let mut ctx = ForwardCtx::new(Mode::Train, seed);
        let mut x = self.input(batch, dtype)?;
        let mut saved = Vec::with_capacity(self.chain.len());
        for layer in self.chain.layers_mut() {
            let (y, s) = layer.forward(&x, &mut ctx)?;
            saved.extend(s);
            x = y;
        }
        let loss = ops::cross_entropy(&x, &batch.targets, None)?.loss;
        Ok((loss, Graph { _saved: saved, _logits: x }))
    }

    /// Mean loss on a batch without backward. With `mode == Mode::Train` the forward saves
    /// what backward would need (as a training forward does) and drops it at the end; with
    /// `Mode::Inference` nothing is saved.
    pub fn eval_loss(&mut self, batch: &Batch, mode: Mode) -> Result<f32> {
        let dtype = self.params()[0].value.dtype();
        let x = self.input(batch, dtype)?;
        let loss = if mode == Mode::Inference {
            ops::cross_entropy(&self.chain.infer(&x)?, &batch.targets, None)?.loss
        } else {
            let mut ctx = ForwardCtx::new(mode, 0);
            let plain = Schedule::none(self.chain.len())?;
            let (logits, tape) = self.chain.forward(&x, &mut ctx, &plain)?;
            let loss = ops::cross_entropy(&logits, &batch.targets, None)?.loss;
            drop(tape);
            loss
        };
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

fn invalid(reason: &str) -> Error {
    Error::InvalidArgument { what: "model", reason: reason.into() }
}
