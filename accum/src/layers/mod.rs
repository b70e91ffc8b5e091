//! Ready-made layers built from `vram_kernels` ops, one library for every model of the
//! workspace:
//!
//! - basics: [`Linear`] (with an optional fused activation; bias and GELU are one
//!   cuBLASLt call on a GPU, [`ops::linear_act`]), [`Activation`] (ReLU, GELU),
//!   [`Dropout`], [`LayerNorm`], a pre-norm residual MLP block, [`ResidualMlp`];
//! - convolutional ([`conv`]): [`Conv2d`], [`MaxPool2d`], ResNet's basic
//!   [`ResidualBlock`] and [`Bottleneck`], MobileNet's [`InvertedResidual`], and a
//!   pooled [`ClassifierHead`]; every convolution optionally batch-normed;
//! - transformer ([`transformer`]): a multi-head [`TransformerBlock`] (causal for GPT,
//!   not for ViT), ViT's [`PatchEmbed`] and a token mean pool, [`TokenMeanPool`];
//! - Llama family ([`llama`]): [`RmsNorm`] and the grouped-query [`LlamaBlock`] with
//!   rotary embeddings and the SiLU-gated MLP.
//!
//! Layers with several settings are built from a config
//! (`LinearConfig::new(16, 32).with_seed(7).init(&dev)`), whose optional settings have
//! defaults and `with_*` setters. Weights are drawn from the config's seed (a counter-based
//! stream: the same seed gives the same weights on every machine); on a virtual device,
//! which keeps no values, nothing is drawn and the weights are only allocated.
//!
//! Under autocast ([`ForwardCtx::with_autocast`], see [`crate::autocast`]) [`Linear`],
//! [`LayerNorm`], [`Activation`], [`Dropout`], [`TransformerBlock`], [`MaxPool2d`] and
//! [`TokenMeanPool`] follow PyTorch's recipe; the others (convolutions, the CNN blocks,
//! [`ResidualMlp`], [`PatchEmbed`]) return [`Error::AutocastUnsupported`].
//!
//! A layer that needs its input in backward keeps a clone of it, which shares its memory (no
//! copy); the executor drops its own reference once the next layer has consumed the input, so
//! the layer's is the only one alive, as in PyTorch's autograd graph.

pub mod conv;
pub mod llama;
pub mod transformer;

pub use conv::{
    BATCH_NORM_EPS, BATCH_NORM_MOMENTUM, Bottleneck, BottleneckConfig, ClassifierHead,
    ClassifierHeadConfig, Conv2d, Conv2dConfig, InvertedResidual, InvertedResidualConfig,
    MaxPool2d, ResidualBlock, ResidualBlockConfig,
};
pub use llama::{
    LlamaBlock, LlamaBlockConfig, LlamaSaved, RmsNorm, RmsNormConfig, RmsSaved, RopeTables,
};
pub use transformer::{
    Attention, BlockSaved, PatchEmbed, PatchEmbedConfig, TokenMeanPool, TransformerBlock,
    TransformerBlockConfig,
};

use crate::autocast::{OpKind, accumulate_grad_cast, cast, cast_into};
use crate::error::{Error, Result};
use crate::layer::{ForwardCtx, Layer, Param};
use vram_kernels::cpu::random::uniform_at;
use vram_kernels::{DType, Device, Tensor, ops};

/// How a weight tensor is initialized from its fan-in (inputs per output element).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Uniform in `±gain / sqrt(fan_in)`: PyTorch's default for `nn.Linear` and `nn.Conv2d`
    /// with `gain = 1`.
    Uniform {
        /// Multiplies the bound.
        gain: f32,
    },
    /// Normal with standard deviation `gain * sqrt(2 / fan_in)` (He, for ReLU networks).
    HeNormal {
        /// Multiplies the standard deviation (below 1 starts a residual branch small).
        gain: f32,
    },
    /// Normal with a fixed standard deviation (GPT-2 and ViT: 0.02).
    Normal {
        /// The standard deviation.
        std: f32,
    },
}

impl Default for Init {
    /// PyTorch's default, [`Init::Uniform`] with gain 1.
    fn default() -> Self {
        Init::Uniform { gain: 1.0 }
    }
}

/// A seed for part `part` of a layer built from `seed` (splitmix64 of both): sub-layers of
/// a block draw from unrelated streams.
pub fn sub_seed(seed: u64, part: u64) -> u64 {
    let mut z = seed ^ part.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A weight of `shape` drawn by `init` with fan-in `fan_in` from `seed` (what the layers'
/// configs use; also for tables outside a layer, such as an embedding). On a virtual device
/// nothing is drawn (it keeps no values): the tensor is only allocated.
///
/// # Errors
///
/// Out of memory.
pub fn init_weight(
    device: &Device,
    shape: &[usize],
    init: Init,
    fan_in: usize,
    dtype: DType,
    seed: u64,
) -> Result<Tensor> {
    if device.is_virtual() {
        return Ok(Tensor::zeros(device, shape, dtype)?);
    }
    let n: usize = shape.iter().product();
    let fan_in = fan_in.max(1) as f32;
    let normal = |std: f32| -> Vec<f32> {
        // Box-Muller on two counters per element.
        (0..n as u64)
            .map(|i| {
                let u1 = 1.0 - uniform_at(seed, 2 * i); // (0, 1]
                let u2 = uniform_at(seed, 2 * i + 1);
                std * (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
            })
            .collect()
    };
    let data: Vec<f32> = match init {
        Init::Uniform { gain } => {
            let bound = gain / fan_in.sqrt();
            (0..n as u64).map(|i| (2.0 * uniform_at(seed, i) - 1.0) * bound).collect()
        }
        Init::HeNormal { gain } => normal(gain * (2.0 / fan_in).sqrt()),
        Init::Normal { std } => normal(std),
    };
    Ok(Tensor::from_f32_slice(device, shape, &data, dtype)?)
}

/// Prefixes the name of every parameter of `layer` with `prefix` and a dot
/// (`weight` becomes `h3.attn.q.weight`): for reports on a model built of many layers.
pub fn prefix_param_names<L: Layer + ?Sized>(layer: &mut L, prefix: &str) {
    for p in layer.params_mut() {
        p.name = format!("{prefix}.{}", p.name);
    }
}

/// Keeps `x` (a shared reference, no copy) when the forward must save it.
/// `a + b` with PyTorch's type promotion: under autocast a residual sum may meet a 16-bit
/// branch and an f32 one, which add in f32.
fn add_promoted(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.dtype() == b.dtype() {
        return Ok(ops::add(a, b)?);
    }
    Ok(ops::add(&cast(a, DType::F32)?, &cast(b, DType::F32)?)?)
}

/// `dx += g`, with `g` in `dx`'s dtype (the gradient of a promoted sum is in the sum's).
fn add_grad(dx: &mut Tensor, g: &Tensor) -> Result<()> {
    Ok(ops::add_assign(dx, &cast(g, dx.dtype())?)?)
}

fn save_input(x: &Tensor, ctx: &ForwardCtx) -> Option<Tensor> {
    ctx.training().then(|| x.clone())
}

fn check_dropout(what: &'static str, p: f32) -> Result<()> {
    if !(0.0..1.0).contains(&p) {
        return Err(Error::InvalidArgument {
            what,
            reason: format!("drop probability {p} is not in [0, 1)"),
        });
    }
    Ok(())
}

/// `[b, s, heads, dh] <-> [b, heads, s, dh]` (its own inverse).
const HEADS_FIRST: [usize; 4] = [0, 2, 1, 3];

fn invalid(what: &'static str, reason: String) -> Error {
    Error::InvalidArgument { what, reason }
}

fn saved<T>(s: Option<T>, what: &'static str) -> Result<T> {
    s.ok_or_else(|| invalid(what, "a sub-layer saved nothing in training mode".into()))
}

fn dx_of(dx: Option<Tensor>, what: &'static str) -> Result<Tensor> {
    dx.ok_or_else(|| invalid(what, "a sub-layer returned no input gradient".into()))
}

/// `[b * s, h * dh]` -> `[b * h, s, dh]`.
fn split_heads(t: Tensor, b: usize, s: usize, h: usize, dh: usize) -> Result<Tensor> {
    let t = t.reshape(&[b, s, h, dh])?;
    Ok(ops::permute(&t, &HEADS_FIRST)?.reshape(&[b * h, s, dh])?)
}

/// `[b * h, s, dh]` -> `[b * s, h * dh]`, the inverse of [`split_heads`].
fn merge_heads(t: Tensor, b: usize, s: usize, h: usize, dh: usize) -> Result<Tensor> {
    let t = t.reshape(&[b, h, s, dh])?;
    Ok(ops::permute(&t, &HEADS_FIRST)?.reshape(&[b * s, h * dh])?)
}

/// An [`Error::InvalidArgument`] unless `value > 0`.
fn positive(what: &'static str, name: &str, value: usize) -> Result<()> {
    if value == 0 {
        return Err(Error::InvalidArgument { what, reason: format!("{name} must be positive") });
    }
    Ok(())
}

/// The elementwise activation fused after a [`Linear`] or [`Conv2d`], or applied by an
/// [`Activation`] layer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Act {
    /// None.
    #[default]
    Identity,
    /// `max(x, 0)`.
    Relu,
    /// GELU (tanh approximation, as `vram_kernels::ops::gelu`).
    Gelu,
    /// Hard swish, `x * relu6(x + 3) / 6` (MobileNetV3's).
    Hardswish,
}

impl Act {
    /// `act(z)`; the identity returns `z` itself.
    fn forward(self, z: Tensor) -> Result<Tensor> {
        Ok(match self {
            Act::Identity => z,
            Act::Relu => ops::relu(&z)?,
            Act::Gelu => ops::gelu(&z)?,
            Act::Hardswish => ops::hardswish(&z)?,
        })
    }

    /// `act(z)` and, in training, what its backward needs: ReLU keeps its output (as
    /// PyTorch's `relu` does: `y > 0` exactly where `z > 0`, and the output is usually kept
    /// by the next layer anyway), GELU and hard swish their input `z`, the identity nothing.
    fn forward_saving(self, z: Tensor, training: bool) -> Result<(Tensor, Option<Tensor>)> {
        Ok(match self {
            Act::Identity => (z, None),
            Act::Relu => {
                let y = ops::relu(&z)?;
                drop(z);
                let kept = training.then(|| y.clone());
                (y, kept)
            }
            Act::Gelu | Act::Hardswish => {
                let y = self.forward(z.clone())?;
                (y, training.then_some(z))
            }
        })
    }

    /// `dz` from what [`Act::forward_saving`] kept (ReLU's output or GELU's input) and `dy`;
    /// `None` for the identity (`dz = dy`).
    fn backward(self, z: Option<&Tensor>, dy: &Tensor) -> Result<Option<Tensor>> {
        Ok(match (self, z) {
            (Act::Relu, Some(z)) => Some(ops::relu_backward(z, dy)?),
            (Act::Gelu, Some(z)) => Some(ops::gelu_backward(z, dy)?),
            (Act::Hardswish, Some(z)) => Some(ops::hardswish_backward(z, dy)?),
            _ => None,
        })
    }
}

/// What a [`Linear`] or [`Conv2d`] keeps for backward: its input, a convolution's batch norm
/// input and statistics, and what a fused activation needs (ReLU's output, GELU's input;
/// nothing for the identity); under autocast the input and the
/// weight as cast (what PyTorch's linear saves) and the input's own dtype.
#[derive(Debug)]
pub struct AffineSaved {
    x: Tensor,
    z: Option<Tensor>,
    cast: Option<CastSaved>,
    /// A convolution's batch norm: its input and the batch statistics.
    norm: Option<conv::NormSaved>,
}

/// What a layer run under autocast keeps besides its usual state.
#[derive(Debug)]
struct CastSaved {
    /// The weight in the compute dtype (the cached cast, shared).
    w: Tensor,
    /// The dtype of the input, which the input gradient goes back in.
    in_dtype: DType,
}

impl AffineSaved {
    /// The dtype of the layer's input as it came in.
    pub fn input_dtype(&self) -> DType {
        self.cast.as_ref().map_or(self.x.dtype(), |c| c.in_dtype)
    }

    /// The saved input (under autocast, its cast copy).
    pub fn saved_input(&self) -> &Tensor {
        &self.x
    }

    /// Gives up the saved input, to be recomputed before backward
    /// ([`AffineSaved::restore_input`]), where `stand_in` (a tensor kept anyway, which holds
    /// the place without new memory) has its dtype and shape. Returns whether it did.
    fn release_input(&mut self, stand_in: &Tensor) -> bool {
        let agree = stand_in.dtype() == self.x.dtype() && stand_in.shape() == self.x.shape();
        if agree {
            self.x = stand_in.clone();
        }
        agree
    }

    /// Puts back the input [`AffineSaved::release_input`] gave up, recomputed.
    fn restore_input(&mut self, x: Tensor) {
        self.x = x;
    }
}

impl AffineSaved {
    /// Applies `act` to the affine output `z`, keeping what backward needs in training.
    fn activate(
        act: Act,
        x: &Tensor,
        z: Tensor,
        ctx: &ForwardCtx,
    ) -> Result<(Tensor, Option<Self>)> {
        if !ctx.training() {
            return Ok((act.forward(z)?, None));
        }
        let (y, kept) = act.forward_saving(z, true)?;
        Ok((y, Some(AffineSaved { x: x.clone(), z: kept, cast: None, norm: None })))
    }
}

/// `act(x w^T + b)`, keeping what backward needs in training: for the identity and GELU
/// one [`ops::linear_act`] call (on a GPU one cuBLASLt product with the bias and GELU as its
/// epilogue; GELU keeps its pre-activation, as the unfused ops did), for the other
/// activations [`ops::linear`] then the activation.
fn affine(
    act: Act,
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    ctx: &ForwardCtx,
) -> Result<(Tensor, Option<AffineSaved>)> {
    let fused = match act {
        Act::Identity => None,
        Act::Gelu => Some(ops::LinearActivation::Gelu),
        Act::Relu | Act::Hardswish => {
            let z = ops::linear(x, w, b)?;
            return AffineSaved::activate(act, x, z, ctx);
        }
    };
    let training = ctx.training();
    let out = ops::linear_act(x, w, b, fused, training)?;
    let saved = training.then(|| AffineSaved { x: x.clone(), z: out.pre, cast: None, norm: None });
    Ok((out.y, saved))
}

/// The settings of a [`Linear`] layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LinearConfig {
    /// Input features.
    pub d_in: usize,
    /// Output features.
    pub d_out: usize,
    /// The dtype of the weights (default f32).
    pub dtype: DType,
    /// Seed of the weight initialization (default 0).
    pub seed: u64,
    /// Whether the layer has a bias (default true).
    pub bias: bool,
    /// The activation fused after it (default none).
    pub activation: Act,
    /// The weight initialization (default PyTorch's, uniform in `±1/sqrt(d_in)`).
    pub init: Init,
}

impl LinearConfig {
    /// `d_in -> d_out` features with a bias, no activation, PyTorch's initialization, f32,
    /// seed 0.
    pub fn new(d_in: usize, d_out: usize) -> Self {
        LinearConfig {
            d_in,
            d_out,
            dtype: DType::F32,
            seed: 0,
            bias: true,
            activation: Act::Identity,
            init: Init::default(),
        }
    }

    /// The same with weights in `dtype`.
    pub fn with_dtype(self, dtype: DType) -> Self {
        LinearConfig { dtype, ..self }
    }

    /// The same with weights drawn from `seed`.
    pub fn with_seed(self, seed: u64) -> Self {
        LinearConfig { seed, ..self }
    }

    /// The same with or without a bias.
    pub fn with_bias(self, bias: bool) -> Self {
        LinearConfig { bias, ..self }
    }

    /// The same with `activation` fused after the product.
    pub fn with_activation(self, activation: Act) -> Self {
        LinearConfig { activation, ..self }
    }

    /// The same with weights initialized by `init`.
    pub fn with_init(self, init: Init) -> Self {
        LinearConfig { init, ..self }
    }

    /// The layer on `device`, its bias zero.
    ///
    /// # Errors
    ///
    /// Out of memory.
    pub fn init(&self, device: &Device) -> Result<Linear> {
        let w = init_weight(
            device,
            &[self.d_out, self.d_in],
            self.init,
            self.d_in,
            self.dtype,
            self.seed,
        )?;
        let bias = if self.bias {
            Some(Param::new("bias", Tensor::zeros(device, &[self.d_out], self.dtype)?))
        } else {
            None
        };
        Ok(Linear {
            weight: Param::new("weight", w),
            bias,
            act: self.activation,
            device: device.clone(),
        })
    }
}

/// `y = act(x w^T + b)` over the last dimension: `[.., d_in] -> [.., d_out]`. Built from a
/// [`LinearConfig`]. With no activation or GELU, forward is one [`ops::linear_act`] call
/// (on a GPU one cuBLASLt product, the bias and GELU its epilogue) and backward the GELU's
/// gradient then [`ops::linear_backward`] (whose weight-gradient product also sums the bias
/// gradient there).
#[derive(Debug)]
pub struct Linear {
    weight: Param,
    bias: Option<Param>,
    act: Act,
    device: Device,
}

impl Linear {
    /// The weight, `[d_out, d_in]`.
    pub fn weight(&self) -> &Param {
        &self.weight
    }

    fn bias_value(&self) -> Option<&Tensor> {
        self.bias.as_ref().map(|b| &b.value)
    }

    /// Adds the gradients of a product from `x` to the output gradient `dz`; returns `dx`.
    fn grads(&mut self, x: &Tensor, dz: &Tensor) -> Result<Tensor> {
        let g = ops::linear_backward(x, &self.weight.value, dz, self.bias.is_some())?;
        self.weight.accumulate_grad(g.dw)?;
        if let (Some(b), Some(db)) = (&mut self.bias, g.dbias) {
            b.accumulate_grad(db)?;
        }
        Ok(g.dx)
    }
}

impl Linear {
    /// This layer's backward with its input gradient added into `into` (and dropped at
    /// once): how a block sums the gradients of the projections that read one input.
    pub(crate) fn backward_into(
        &mut self,
        s: AffineSaved,
        dy: Tensor,
        into: &mut Tensor,
    ) -> Result<()> {
        // Under autocast the input gradient comes in the product's dtype; where the cast to
        // the input's dtype only widens (16 bits into f32), `add_assign` widens each element
        // exactly as that cast would, so no copy in the input's dtype is made.
        let (dx, in_dtype) = self.backward_in_product_dtype(s, dy)?;
        let exact = dx.dtype() == into.dtype() || into.dtype() == DType::F32;
        let dx = if in_dtype == into.dtype() && exact { dx } else { cast_into(dx, in_dtype)? };
        ops::add_assign(into, &dx)?;
        Ok(())
    }

    /// This layer's backward (the parameters' gradients accumulated) with the input gradient
    /// as the product gave it: in the product's dtype under autocast. Returns it with the
    /// dtype of the layer's input, which [`Layer::backward`] casts it to.
    fn backward_in_product_dtype(&mut self, s: AffineSaved, dy: Tensor) -> Result<(Tensor, DType)> {
        // The activation's gradient replaces `dy`, which is dropped then, as PyTorch frees a
        // node's incoming gradient after that node's backward.
        let Some(c) = s.cast else {
            let dz = self.act.backward(s.z.as_ref(), &dy)?.unwrap_or(dy);
            drop(s.z);
            let dx = self.grads(&s.x, &dz)?;
            let dt = dx.dtype();
            return Ok((dx, dt));
        };
        // The output was in the compute dtype; the gradient arrives in it (cast if not).
        let dy = cast_into(dy, s.x.dtype())?;
        let dz = self.act.backward(s.z.as_ref(), &dy)?.unwrap_or(dy);
        drop(s.z);
        let g = ops::linear_backward(&s.x, &c.w, &dz, self.bias.is_some())?;
        drop((dz, s.x, c.w));
        self.accumulate_cast(g.dw, g.dbias)?;
        Ok((g.dx, c.in_dtype))
    }

    /// Adds a product's weight and bias gradients (in the product's dtype under autocast)
    /// into the parameters' gradients, in the parameters' dtype.
    fn accumulate_cast(&mut self, dw: Tensor, dbias: Option<Tensor>) -> Result<()> {
        accumulate_grad_cast(&mut self.weight, dw)?;
        if let (Some(b), Some(db)) = (&mut self.bias, dbias) {
            accumulate_grad_cast(b, db)?;
        }
        Ok(())
    }
}

impl Linear {
    /// An MLP's backward through its GELU, this layer (no activation) having read
    /// `gelu(pre)` with `pre` `fc1`'s output before its fused GELU: from this layer's saved
    /// state `s`, fc1's `s1` and the output gradient `dy`, one [`ops::linear_backward_gelu`]
    /// call gives this layer's weight and bias gradients, the gradient of `pre` and fc1's
    /// bias gradient (on a GPU the GELU's output gradient is never stored), then
    /// [`ops::linear_backward`] fc1's weight and input gradients. Both sides keep what they
    /// kept for their own backward (fc1 its input and `pre`, this layer its input), nothing
    /// more. Bit for bit this layer's then fc1's [`Layer::backward`] on the host, which run
    /// instead when the layers are not of that form. Returns fc1's input gradient, in its
    /// input's dtype.
    pub(crate) fn backward_through_gelu(
        &mut self,
        fc1: &mut Linear,
        s: AffineSaved,
        mut s1: AffineSaved,
        dy: Tensor,
        what: &'static str,
    ) -> Result<Tensor> {
        let gelu = self.act == Act::Identity && fc1.act == Act::Gelu;
        let pre = match s1.z.take() {
            Some(z) if gelu && z.dtype() == s.x.dtype() => z,
            z => {
                s1.z = z;
                let da = dx_of(self.backward(s, dy, true)?, what)?;
                return dx_of(fc1.backward(s1, da, true)?, what);
            }
        };
        // Under autocast the output gradient arrives in the product's dtype (cast if not), as
        // in `Layer::backward`.
        let dy = cast_into(dy, s.x.dtype())?;
        let w = s.cast.as_ref().map_or(&self.weight.value, |c| &c.w);
        let g = ops::linear_backward_gelu(&s.x, w, &dy, self.bias.is_some(), &pre)?;
        drop((dy, s, pre));
        self.accumulate_cast(g.dw, g.dbias)?;
        if let Some(b) = &mut fc1.bias {
            accumulate_grad_cast(b, g.dpre_bias)?;
        }
        let w1 = s1.cast.as_ref().map_or(&fc1.weight.value, |c| &c.w);
        let g1 = ops::linear_backward(&s1.x, w1, &g.dpre, false)?;
        drop((g.dpre, s1.x));
        accumulate_grad_cast(&mut fc1.weight, g1.dw)?;
        match s1.cast {
            Some(c) => {
                drop(c.w);
                cast_into(g1.dx, c.in_dtype)
            }
            None => Ok(g1.dx),
        }
    }
}

impl Layer for Linear {
    type Saved = AffineSaved;

    fn name(&self) -> String {
        match self.weight.value.shape() {
            [out, inp] => format!("Linear({inp}->{out})"),
            _ => "Linear".into(),
        }
    }

    fn forward(
        &mut self,
        x: &Tensor,
        ctx: &mut ForwardCtx,
    ) -> Result<(Tensor, Option<AffineSaved>)> {
        // `linear` is in PyTorch's lower-precision list (autocast_mode.h,
        // AT_FORALL_LOWER_PRECISION_FP): input, weight and bias cast to the low dtype (the
        // parameters through the cache), output low; the fused activation falls through.
        let w_dtype = self.weight.value.dtype();
        let dt = match ctx.op_dtype(OpKind::Linear, &[x.dtype(), w_dtype]) {
            Some(dt) if dt != x.dtype() || dt != w_dtype => dt,
            _ => return affine(self.act, x, &self.weight.value, self.bias_value(), ctx),
        };
        let xc = cast(x, dt)?;
        let w = ctx.cast_param(&self.weight, dt)?;
        let b = match &self.bias {
            Some(b) => Some(ctx.cast_param(b, dt)?),
            None => None,
        };
        let (y, saved) = affine(self.act, &xc, &w, b.as_ref(), ctx)?;
        drop(b);
        let saved =
            saved.map(|s| AffineSaved { cast: Some(CastSaved { w, in_dtype: x.dtype() }), ..s });
        Ok((y, saved))
    }

    fn backward(&mut self, s: AffineSaved, dy: Tensor, want: bool) -> Result<Option<Tensor>> {
        let (dx, in_dtype) = self.backward_in_product_dtype(s, dy)?;
        if !want {
            return Ok(None);
        }
        Ok(Some(cast_into(dx, in_dtype)?))
    }

    fn params(&self) -> Vec<&Param> {
        let mut p = vec![&self.weight];
        p.extend(&self.bias);
        p
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut p = vec![&mut self.weight];
        p.extend(&mut self.bias);
        p
    }

    fn device(&self) -> &Device {
        &self.device
    }
}

/// An elementwise activation: [`Activation::relu`] or [`Activation::gelu`].
#[derive(Debug)]
pub struct Activation {
    kind: Act,
    device: Device,
}

impl Activation {
    /// ReLU, `max(x, 0)`, on `device`.
    pub fn relu(device: &Device) -> Self {
        Activation { kind: Act::Relu, device: device.clone() }
    }

    /// GELU (tanh approximation, as `vram_kernels::ops::gelu`) on `device`.
    pub fn gelu(device: &Device) -> Self {
        Activation { kind: Act::Gelu, device: device.clone() }
    }
}

impl Layer for Activation {
    /// ReLU's output or GELU's input.
    type Saved = Tensor;

    fn name(&self) -> String {
        format!("{:?}", self.kind)
    }

    fn forward(&mut self, x: &Tensor, ctx: &mut ForwardCtx) -> Result<(Tensor, Option<Tensor>)> {
        self.kind.forward_saving(x.clone(), ctx.training())
    }

    fn backward(&mut self, x: Tensor, dy: Tensor, want: bool) -> Result<Option<Tensor>> {
        if !want {
            return Ok(None);
        }
        self.kind.backward(Some(&x), &dy)
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

/// Inverted dropout with probability `p`. Its mask is a function of the context's seed and
/// a counter range reserved with [`ForwardCtx::take_offsets`], so it saves no mask: backward
/// and checkpoint recomputation regenerate it. The identity in inference mode.
#[derive(Debug)]
pub struct Dropout {
    p: f32,
    device: Device,
}

/// What [`Dropout`] keeps for backward: the random stream position, not a mask.
#[derive(Debug)]
pub struct DropoutSaved {
    seed: u64,
    offset: u64,
}

impl Dropout {
    /// A dropout layer zeroing each element with probability `p`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] unless `0 <= p < 1`.
    pub fn new(device: &Device, p: f32) -> Result<Self> {
        check_dropout("Dropout::new", p)?;
        Ok(Dropout { p, device: device.clone() })
    }
}

impl Layer for Dropout {
    type Saved = DropoutSaved;

    fn name(&self) -> String {
        format!("Dropout({})", self.p)
    }

    fn forward(
        &mut self,
        x: &Tensor,
        ctx: &mut ForwardCtx,
    ) -> Result<(Tensor, Option<DropoutSaved>)> {
        if !ctx.training() {
            return Ok((x.clone(), None));
        }
        let offset = ctx.take_offsets(x.numel() as u64)?;
        let y = ops::dropout(x, self.p, ctx.seed, offset)?;
        Ok((y, Some(DropoutSaved { seed: ctx.seed, offset })))
    }

    fn backward(&mut self, s: DropoutSaved, dy: Tensor, want: bool) -> Result<Option<Tensor>> {
        if !want {
            return Ok(None);
        }
        Ok(Some(ops::dropout_backward(&dy, self.p, s.seed, s.offset)?))
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

/// The settings of a [`LayerNorm`] layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerNormConfig {
    /// Features normalized over (the last dimension).
    pub d: usize,
    /// Added to the variance (default 1e-5).
    pub eps: f32,
    /// The dtype of the scale and shift (default f32).
    pub dtype: DType,
}

impl LayerNormConfig {
    /// A norm over `d` features, `eps = 1e-5`, f32.
    pub fn new(d: usize) -> Self {
        LayerNormConfig { d, eps: 1e-5, dtype: DType::F32 }
    }

    /// The same with scale and shift in `dtype`.
    pub fn with_dtype(self, dtype: DType) -> Self {
        LayerNormConfig { dtype, ..self }
    }

    /// The same with `eps`.
    pub fn with_eps(self, eps: f32) -> Self {
        LayerNormConfig { eps, ..self }
    }

    /// A layer norm with scale 1 and shift 0 on `device`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] unless `eps` is finite and > 0; out of memory.
    pub fn init(&self, device: &Device) -> Result<LayerNorm> {
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(Error::InvalidArgument {
                what: "LayerNormConfig::eps",
                reason: format!("must be finite and > 0, got {}", self.eps),
            });
        }
        Ok(LayerNorm {
            gamma: Param::new("gamma", Tensor::full(device, &[self.d], self.dtype, 1.0)?),
            beta: Param::new("beta", Tensor::zeros(device, &[self.d], self.dtype)?),
            eps: self.eps,
            device: device.clone(),
        })
    }
}

/// Layer normalization over the last dimension with a learned scale and shift. Built from a
/// [`LayerNormConfig`].
#[derive(Debug)]
pub struct LayerNorm {
    gamma: Param,
    beta: Param,
    eps: f32,
    device: Device,
}

/// What [`LayerNorm`] keeps for backward: its input (under autocast, as cast: f32) and the
/// row statistics.
#[derive(Debug)]
pub struct NormSaved {
    x: Tensor,
    mean: Tensor,
    rstd: Tensor,
    /// The input's own dtype when autocast cast it.
    in_dtype: Option<DType>,
}

impl NormSaved {
    /// The saved input (under autocast, its f32 copy).
    pub fn saved_input(&self) -> &Tensor {
        &self.x
    }
}

impl LayerNorm {
    fn run(&self, x: &Tensor, ctx: &mut ForwardCtx) -> Result<(Tensor, Option<NormSaved>)> {
        // `layer_norm` is in PyTorch's fp32 list (autocast_mode.h, AT_FORALL_FP32): inputs
        // and parameters cast to f32, output f32.
        let p_dtype = self.gamma.value.dtype();
        let dt = match ctx.op_dtype(OpKind::LayerNorm, &[x.dtype(), p_dtype]) {
            Some(dt) if dt != x.dtype() || dt != p_dtype => dt,
            _ => {
                let out = ops::layer_norm(x, &self.gamma.value, &self.beta.value, self.eps)?;
                let saved = save_input(x, ctx).map(|x| NormSaved {
                    x,
                    mean: out.mean,
                    rstd: out.rstd,
                    in_dtype: None,
                });
                return Ok((out.y, saved));
            }
        };
        let xc = cast(x, dt)?;
        let (g, b) = (ctx.cast_param(&self.gamma, dt)?, ctx.cast_param(&self.beta, dt)?);
        let out = ops::layer_norm(&xc, &g, &b, self.eps)?;
        let saved = ctx.training().then(|| NormSaved {
            x: xc,
            mean: out.mean,
            rstd: out.rstd,
            in_dtype: Some(x.dtype()),
        });
        Ok((out.y, saved))
    }

    /// Whether [`Self::run`] on an input of dtype `x` normalizes it as it is, with the
    /// parameters as they are (no autocast copy of either): what
    /// [`Self::run_after_residual`] computes in.
    fn runs_in(&self, x: DType, ctx: &ForwardCtx) -> bool {
        let p = self.gamma.value.dtype();
        p == x && ctx.op_dtype(OpKind::LayerNorm, &[x, p]).is_none_or(|dt| dt == x)
    }

    /// `s = residual + dropout(branch)` and this norm of `s` in one op
    /// ([`ops::dropout_add_layer_norm`], `p == 0` for no dropout): the sum, the norm and, in
    /// training, what [`Self::grads`] needs (the sum itself, shared, and the statistics),
    /// bit for bit what dropout, the residual add and [`Self::run`] give when
    /// [`Self::runs_in`] holds for the residual's dtype.
    fn run_after_residual(
        &self,
        residual: &Tensor,
        branch: &Tensor,
        (p, seed, offset): (f32, u64, u64),
        ctx: &ForwardCtx,
    ) -> Result<(Tensor, Tensor, Option<NormSaved>)> {
        let (g, b) = (&self.gamma.value, &self.beta.value);
        let out = ops::dropout_add_layer_norm(residual, branch, g, b, self.eps, p, seed, offset)?;
        let n = out.norm;
        let saved = save_input(&out.sum, ctx).map(|x| NormSaved {
            x,
            mean: n.mean,
            rstd: n.rstd,
            in_dtype: None,
        });
        Ok((out.sum, n.y, saved))
    }

    /// Whether [`Self::grads_with_residual`] runs for the saved state `s` with an output
    /// gradient of dtype `dy` and a shortcut's gradient of dtype `dres`: the norm ran on its
    /// input as it came, with parameters of its dtype (no autocast copies), and both
    /// gradients have that dtype.
    fn fuses_residual_grads(&self, s: &NormSaved, dy: DType, dres: DType) -> bool {
        let dt = s.x.dtype();
        s.in_dtype.is_none() && self.gamma.value.dtype() == dt && dy == dt && dres == dt
    }

    /// [`Self::grads`] with `dres`, the gradient arriving at the norm's input by a residual
    /// shortcut, added, and with `branch` the gradient of the residual add's branch, in one
    /// op ([`ops::layer_norm_backward_residual`]): bit for bit [`Self::grads`], an
    /// `add_assign` of `dres` and [`ops::dropout_add_backward`] on the host when
    /// [`Self::fuses_residual_grads`] holds. Returns the input's and the branch's gradients.
    fn grads_with_residual(
        &mut self,
        s: NormSaved,
        dy: &Tensor,
        dres: Tensor,
        branch: Option<ops::ResidualBranch>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let gamma = &self.gamma.value;
        let g =
            ops::layer_norm_backward_residual(&s.x, gamma, &s.mean, &s.rstd, dy, &dres, branch)?;
        drop((s, dres));
        accumulate_grad_cast(&mut self.gamma, g.dgamma)?;
        accumulate_grad_cast(&mut self.beta, g.dbeta)?;
        Ok((g.dx, g.dbranch))
    }

    fn grads(&mut self, s: NormSaved, dy: &Tensor) -> Result<Tensor> {
        let dt = s.x.dtype();
        let dy = cast(dy, dt)?;
        let gamma = cast(&self.gamma.value, dt)?;
        let g = ops::layer_norm_backward(&s.x, &gamma, &s.mean, &s.rstd, &dy)?;
        let in_dtype = s.in_dtype;
        drop((s, dy, gamma));
        accumulate_grad_cast(&mut self.gamma, g.dgamma)?;
        accumulate_grad_cast(&mut self.beta, g.dbeta)?;
        match in_dtype {
            Some(d) if d != g.dx.dtype() => Ok(g.dx.to_dtype(d)?),
            _ => Ok(g.dx),
        }
    }
}

impl Layer for LayerNorm {
    type Saved = NormSaved;

    fn name(&self) -> String {
        format!("LayerNorm({})", self.gamma.value.numel())
    }

    fn forward(&mut self, x: &Tensor, ctx: &mut ForwardCtx) -> Result<(Tensor, Option<NormSaved>)> {
        self.run(x, ctx)
    }

    fn backward(&mut self, s: NormSaved, dy: Tensor, want: bool) -> Result<Option<Tensor>> {
        let dx = self.grads(s, &dy)?;
        Ok(want.then_some(dx))
    }

    fn params(&self) -> Vec<&Param> {
        vec![&self.gamma, &self.beta]
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        vec![&mut self.gamma, &mut self.beta]
    }

    fn device(&self) -> &Device {
        &self.device
    }
}

/// The settings of a [`ResidualMlp`] block.
#[derive(Clone, Debug, PartialEq)]
pub struct ResidualMlpConfig {
    /// Width of the block's input and output.
    pub d: usize,
    /// Units of the hidden layer.
    pub hidden: usize,
    /// Dropout probability on the branch (default 0: none).
    pub dropout: f32,
    /// The dtype of the parameters (default f32).
    pub dtype: DType,
    /// Seed of the weight initialization (default 0).
    pub seed: u64,
}

impl ResidualMlpConfig {
    /// A block of width `d` with `hidden` hidden units, no dropout, f32, seed 0.
    pub fn new(d: usize, hidden: usize) -> Self {
        ResidualMlpConfig { d, hidden, dropout: 0.0, dtype: DType::F32, seed: 0 }
    }

    /// The same with dropout `p` on the branch.
    pub fn with_dropout(self, p: f32) -> Self {
        ResidualMlpConfig { dropout: p, ..self }
    }

    /// The same with parameters in `dtype`.
    pub fn with_dtype(self, dtype: DType) -> Self {
        ResidualMlpConfig { dtype, ..self }
    }

    /// The same with weights drawn from `seed`.
    pub fn with_seed(self, seed: u64) -> Self {
        ResidualMlpConfig { seed, ..self }
    }

    /// The block on `device`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] unless `0 <= dropout < 1`; out of memory.
    pub fn init(&self, device: &Device) -> Result<ResidualMlp> {
        check_dropout("ResidualMlpConfig::dropout", self.dropout)?;
        let linear = |d_in, d_out, seed| {
            LinearConfig::new(d_in, d_out).with_dtype(self.dtype).with_seed(seed).init(device)
        };
        Ok(ResidualMlp {
            norm: LayerNormConfig::new(self.d).with_dtype(self.dtype).init(device)?,
            fc1: linear(self.d, self.hidden, self.seed)?,
            fc2: linear(self.hidden, self.d, self.seed.wrapping_add(0x9E37_79B9))?,
            p: self.dropout,
        })
    }
}

/// A pre-norm residual MLP block, one layer of a chain:
/// `y = x + dropout(fc2(gelu(fc1(layer_norm(x)))))`, `[.., d] -> [.., d]`. Built from a
/// [`ResidualMlpConfig`]. fc1 and its GELU are one [`ops::linear_act`] call; backward, fc2's
/// gradients come with the GELU's and fc1's bias gradient in one
/// [`ops::linear_backward_gelu`] call.
#[derive(Debug)]
pub struct ResidualMlp {
    norm: LayerNorm,
    fc1: Linear,
    fc2: Linear,
    p: f32,
}

/// What [`ResidualMlp`] keeps for backward. The block owns its intermediates, so it moves
/// them here instead of copying.
#[derive(Debug)]
pub struct MlpSaved {
    norm: NormSaved,
    normed: Tensor,
    hidden: Tensor,
    activated: Tensor,
    dropout: Option<DropoutSaved>,
}

impl Layer for ResidualMlp {
    type Saved = MlpSaved;

    fn name(&self) -> String {
        let s = self.fc1.weight.value.shape();
        let at = |i: usize| s.get(i).copied().unwrap_or(0);
        format!("ResidualMlp({}, {}, p={})", at(1), at(0), self.p)
    }

    fn forward(&mut self, x: &Tensor, ctx: &mut ForwardCtx) -> Result<(Tensor, Option<MlpSaved>)> {
        ctx.refuse_autocast(|| self.name())?;
        let (normed, norm) = self.norm.run(x, ctx)?;
        // fc1 and its GELU in one call, the pre-activation kept for backward.
        let fc1 = ops::linear_act(
            &normed,
            &self.fc1.weight.value,
            self.fc1.bias_value(),
            Some(ops::LinearActivation::Gelu),
            norm.is_some(),
        )?;
        let activated = fc1.y;
        let mut branch = ops::linear(&activated, &self.fc2.weight.value, self.fc2.bias_value())?;
        let dropout = if ctx.training() && self.p > 0.0 {
            let offset = ctx.take_offsets(branch.numel() as u64)?;
            branch = ops::dropout(&branch, self.p, ctx.seed, offset)?;
            Some(DropoutSaved { seed: ctx.seed, offset })
        } else {
            None
        };
        let y = ops::add(x, &branch)?;
        let saved = norm.zip(fc1.pre).map(|(norm, hidden)| MlpSaved {
            norm,
            normed,
            hidden,
            activated,
            dropout,
        });
        Ok((y, saved))
    }

    fn backward(&mut self, s: MlpSaved, dy: Tensor, want: bool) -> Result<Option<Tensor>> {
        let dy = &dy; // also the shortcut's gradient: kept to the end
        let dbranch = match &s.dropout {
            Some(d) => Some(ops::dropout_backward(dy, self.p, d.seed, d.offset)?),
            None => None,
        };
        // fc2's backward through the GELU: the gradient of fc1's output and fc1's bias
        // gradient come with fc2's (on a GPU one cuBLASLt call, DGELU_BGRAD), so the GELU's
        // output gradient is never stored.
        let g = ops::linear_backward_gelu(
            &s.activated,
            &self.fc2.weight.value,
            dbranch.as_ref().unwrap_or(dy),
            self.fc2.bias.is_some(),
            &s.hidden,
        )?;
        drop((dbranch, s.activated, s.hidden));
        self.fc2.weight.accumulate_grad(g.dw)?;
        if let (Some(b), Some(db)) = (&mut self.fc2.bias, g.dbias) {
            b.accumulate_grad(db)?;
        }
        if let Some(b) = &mut self.fc1.bias {
            b.accumulate_grad(g.dpre_bias)?;
        }
        let g1 = ops::linear_backward(&s.normed, &self.fc1.weight.value, &g.dpre, false)?;
        drop((g.dpre, s.normed));
        self.fc1.weight.accumulate_grad(g1.dw)?;
        let dnormed = g1.dx;
        let mut dx = self.norm.grads(s.norm, &dnormed)?;
        drop(dnormed);
        if !want {
            return Ok(None);
        }
        ops::add_assign(&mut dx, dy)?;
        Ok(Some(dx))
    }

    fn params(&self) -> Vec<&Param> {
        let mut p = self.norm.params();
        p.extend(self.fc1.params());
        p.extend(self.fc2.params());
        p
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut p = self.norm.params_mut();
        p.extend(self.fc1.params_mut());
        p.extend(self.fc2.params_mut());
        p
    }

    fn device(&self) -> &Device {
        &self.fc1.device
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layer::Mode;

    #[test]
    fn configs_check_their_settings() {
        let dev = Device::host(16 << 20);
        assert!(ResidualMlpConfig::new(4, 8).with_dropout(1.0).init(&dev).is_err());
        assert!(LayerNormConfig::new(4).with_eps(0.0).init(&dev).is_err());
        assert!(Dropout::new(&dev, -0.1).is_err());
        let l = LinearConfig::new(3, 5).with_dtype(DType::F16).with_seed(7).init(&dev).unwrap();
        assert_eq!((l.name(), l.weight.value.dtype()), ("Linear(3->5)".into(), DType::F16));
    }

    /// Regression: a random stream near `u64::MAX` used to wrap (a panic in debug builds, a
    /// repeated dropout mask in release).
    #[test]
    fn a_random_stream_that_would_pass_u64_max_is_an_error() {
        let dev = Device::host(16 << 20);
        let mut ctx = ForwardCtx { offset: u64::MAX - 3, ..ForwardCtx::new(Mode::Train, 1) };
        assert_eq!(ctx.take_offsets(3).unwrap(), u64::MAX - 3);
        assert!(matches!(
            ctx.take_offsets(1),
            Err(Error::RandomStreamExhausted { offset: u64::MAX, requested: 1 })
        ));
        assert_eq!(ctx.offset, u64::MAX, "a failed reservation leaves the offset");
        let x = Tensor::full(&dev, &[2, 4], DType::F32, 1.0).unwrap();
        let mut ctx = ForwardCtx { offset: u64::MAX - 4, ..ctx };
        let e = Dropout::new(&dev, 0.5).unwrap().forward(&x, &mut ctx).unwrap_err();
        assert!(matches!(e, Error::RandomStreamExhausted { requested: 8, .. }), "{e}");
    }
}
