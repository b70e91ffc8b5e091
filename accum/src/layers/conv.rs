//! Convolutional layers: [`Conv2d`] (any groups, so depthwise too) with a fused activation,
//! [`MaxPool2d`], ResNet's basic [`ResidualBlock`] and [`Bottleneck`] blocks, MobileNet's
//! [`InvertedResidual`] block and a [`ClassifierHead`] (global average pool, then linear
//! layers). Images are `[b, c, h, w]`, or `[b, h, w, c]` in channels_last layers
//! (`with_channels_last(true)`, PyTorch's `torch.channels_last` memory format): there the
//! activations, their gradients and each convolution's weight (`[c_out, kh, kw, c_in / groups]`)
//! are channels_last, the convolutions, batch norms, poolings and squeeze-excitation run
//! their NHWC ops (cuDNN reads NHWC as it is), and the same seed draws the same weights as
//! in NCHW, permuted.
//!
//! Every convolution can be followed by a batch norm (`with_batch_norm`, PyTorch's
//! `Conv2d` + `BatchNorm2d`): it keeps the conv output (the norm's input) and two f32
//! vectors of batch statistics, as PyTorch does, and holds running statistics that
//! [`Mode::Inference`](crate::Mode) normalizes with. Without batch norm a residual branch's
//! last convolution starts small instead (its weights drawn with a gain below 1, as Fixup
//! does), which keeps a deep stack trainable.

use super::{
    Act, AffineSaved, CastSaved, Init, Linear, LinearConfig, add_grad, add_promoted, init_weight,
    positive, sub_seed,
};
use crate::autocast::{OpKind, accumulate_grad_cast, cast, cast_into};
use crate::error::{Error, Result};
use crate::layer::{ForwardCtx, Layer, Param};
use vram_kernels::{Conv2dOptions, DType, Device, Indices, Pool2dOptions, Tensor, ops};

/// Batch norm's `eps` and `momentum`, PyTorch's defaults (`nn.BatchNorm2d`).
pub const BATCH_NORM_EPS: f32 = 1e-5;
/// See [`BATCH_NORM_EPS`].
pub const BATCH_NORM_MOMENTUM: f32 = 0.1;

/// The state a sub-layer saved in training mode, or an error naming the block.
fn saved<T>(s: Option<T>, block: &'static str) -> Result<T> {
    s.ok_or(Error::InvalidArgument {
        what: block,
        reason: "a sub-layer saved nothing in training mode".into(),
    })
}

/// The input gradient a sub-layer was asked for.
fn dx_of(dx: Option<Tensor>, block: &'static str) -> Result<Tensor> {
    dx.ok_or(Error::InvalidArgument {
        what: block,
        reason: "a sub-layer returned no input gradient".into(),
    })
}

/// The settings of a [`Conv2d`] layer: a square `kernel x kernel` convolution.
#[derive(Clone, Debug, PartialEq)]
pub struct Conv2dConfig {
    /// Input channels.
    pub c_in: usize,
    /// Output channels.
    pub c_out: usize,
    /// Kernel side.
    pub kernel: usize,
    /// Stride (default 1).
    pub stride: usize,
    /// Zero padding on each side (default `kernel / 2`, "same" for odd kernels at stride 1).
    pub padding: usize,
    /// Groups (default 1; `c_in` for a depthwise convolution).
    pub groups: usize,
    /// Whether the layer has a bias (default false, as in ResNet and MobileNet).
    pub bias: bool,
    /// Whether a batch norm follows the convolution, before the activation (default false;
    /// PyTorch's `Conv2d` + `BatchNorm2d`, eps 1e-5, momentum 0.1, scale 1, shift 0).
    pub batch_norm: bool,
    /// The activation fused after it (default none).
    pub activation: Act,
    /// The weight initialization (default PyTorch's, uniform in `±1/sqrt(fan_in)`).
    pub init: Init,
    /// The dtype of the weights (default f32).
    pub dtype: DType,
    /// Seed of the weight initialization (default 0).
    pub seed: u64,
    /// Whether the layer takes and gives channels_last images `[b, h, w, c]`, its weight
    /// `[c_out, kh, kw, c_in / groups]` (default false: `[b, c, h, w]`).
    pub channels_last: bool,
}

impl Conv2dConfig {
    /// A `kernel x kernel` convolution from `c_in` to `c_out` channels, stride 1, padding
    /// `kernel / 2`, one group, no bias, no activation, f32, seed 0.
    pub fn new(c_in: usize, c_out: usize, kernel: usize) -> Self {
        Conv2dConfig {
            c_in,
            c_out,
            kernel,
            stride: 1,
            padding: kernel / 2,
            groups: 1,
            bias: false,
            batch_norm: false,
            activation: Act::Identity,
            init: Init::default(),
            dtype: DType::F32,
            seed: 0,
            channels_last: false,
        }
    }

    /// The same with `stride`.
    pub fn with_stride(self, stride: usize) -> Self {
        Conv2dConfig { stride, ..self }
    }

    /// The same taking and giving channels_last images (see [`Conv2dConfig::channels_last`]).
    pub fn with_channels_last(self, channels_last: bool) -> Self {
        Conv2dConfig { channels_last, ..self }
    }

    /// The same with `padding` on each side.
    pub fn with_padding(self, padding: usize) -> Self {
        Conv2dConfig { padding, ..self }
    }

    /// The same with `groups` (`c_in` and `c_out` must be multiples of it).
    pub fn with_groups(self, groups: usize) -> Self {
        Conv2dConfig { groups, ..self }
    }

    /// The same with or without a bias.
    pub fn with_bias(self, bias: bool) -> Self {
        Conv2dConfig { bias, ..self }
    }

    /// The same with or without a batch norm after the convolution.
    pub fn with_batch_norm(self, batch_norm: bool) -> Self {
        Conv2dConfig { batch_norm, ..self }
    }

    /// The same with `activation` fused after the convolution.
    pub fn with_activation(self, activation: Act) -> Self {
        Conv2dConfig { activation, ..self }
    }

    /// The same with weights initialized by `init`.
    pub fn with_init(self, init: Init) -> Self {
        Conv2dConfig { init, ..self }
    }

    /// The same with weights in `dtype`.
    pub fn with_dtype(self, dtype: DType) -> Self {
        Conv2dConfig { dtype, ..self }
    }

    /// The same with weights drawn from `seed`.
    pub fn with_seed(self, seed: u64) -> Self {
        Conv2dConfig { seed, ..self }
    }

    /// The layer on `device`, its bias zero.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a zero size, stride or group count, or channels that
    /// are not multiples of the groups; out of memory.
    pub fn init(&self, device: &Device) -> Result<Conv2d> {
        const WHAT: &str = "Conv2dConfig";
        for (name, v) in [
            ("c_in", self.c_in),
            ("c_out", self.c_out),
            ("kernel", self.kernel),
            ("stride", self.stride),
            ("groups", self.groups),
        ] {
            positive(WHAT, name, v)?;
        }
        if !self.c_in.is_multiple_of(self.groups) || !self.c_out.is_multiple_of(self.groups) {
            return Err(Error::InvalidArgument {
                what: WHAT,
                reason: format!(
                    "channels {} -> {} are not multiples of the {} groups",
                    self.c_in, self.c_out, self.groups
                ),
            });
        }
        let (k, cg) = (self.kernel, self.c_in / self.groups);
        let w = init_weight(
            device,
            &[self.c_out, cg, k, k],
            self.init,
            cg * k * k,
            self.dtype,
            self.seed,
        )?;
        // The same weights as in NCHW, stored channels_last.
        let w = if self.channels_last { ops::permute(&w, &[0, 2, 3, 1])? } else { w };
        let bias = if self.bias {
            Some(Param::new("bias", Tensor::zeros(device, &[self.c_out], self.dtype)?))
        } else {
            None
        };
        let opts = Conv2dOptions::default()
            .stride((self.stride, self.stride))
            .padding((self.padding, self.padding))
            .groups(self.groups);
        let norm = if self.batch_norm {
            let c = [self.c_out];
            Some(Norm {
                gamma: Param::new("bn.weight", Tensor::full(device, &c, self.dtype, 1.0)?),
                beta: Param::new("bn.bias", Tensor::zeros(device, &c, self.dtype)?),
                running_mean: Tensor::zeros(device, &c, self.dtype)?,
                running_var: Tensor::full(device, &c, self.dtype, 1.0)?,
            })
        } else {
            None
        };
        Ok(Conv2d {
            weight: Param::new("weight", w),
            bias,
            norm,
            opts,
            act: self.activation,
            channels_last: self.channels_last,
            device: device.clone(),
        })
    }
}

/// A convolution's batch norm: scale and shift (parameters `bn.weight`, `bn.bias`) and the
/// running statistics (buffers, not parameters), all in the layer's dtype.
#[derive(Debug)]
struct Norm {
    gamma: Param,
    beta: Param,
    running_mean: Tensor,
    running_var: Tensor,
}

/// What a training batch norm keeps: its input (the convolution's output) and the batch's
/// f32 mean and `1 / std`, as PyTorch's `native_batch_norm` saves.
#[derive(Debug)]
pub(crate) struct NormSaved {
    z: Tensor,
    mean: Tensor,
    invstd: Tensor,
}

/// A 2-d convolution, optionally followed by a batch norm, with a fused activation,
/// `[b, c_in, h, w] -> [b, c_out, h', w']`. Built from a [`Conv2dConfig`].
///
/// The batch norm normalizes with the batch's statistics in [`Mode::Train`](crate::Mode)
/// (moving the running ones unless [`ForwardCtx::update_running_stats`] is off) and with the
/// running statistics in [`Mode::Inference`](crate::Mode), as PyTorch's `train()` and
/// `eval()` modules do.
#[derive(Debug)]
pub struct Conv2d {
    pub(super) weight: Param,
    bias: Option<Param>,
    norm: Option<Norm>,
    opts: Conv2dOptions,
    act: Act,
    channels_last: bool,
    pub(super) device: Device,
}

impl Conv2d {
    /// Input channels.
    fn c_in(&self) -> usize {
        let s = self.weight.value.shape();
        let c = if self.channels_last { s.get(3) } else { s.get(1) };
        self.opts.groups * c.copied().unwrap_or(0)
    }

    /// Output channels.
    fn c_out(&self) -> usize {
        self.weight.value.shape().first().copied().unwrap_or(0)
    }
}

impl Layer for Conv2d {
    type Saved = AffineSaved;

    fn name(&self) -> String {
        let (s, g, cl) = (self.weight.value.shape(), self.opts.groups, self.channels_last);
        let at = |i: usize| s.get(i).copied().unwrap_or(0);
        let (kh, kw) = if cl { (at(1), at(2)) } else { (at(2), at(3)) };
        let (i, o, stride) = (self.c_in(), self.c_out(), self.opts.stride.0);
        let layout = if cl { ", channels_last" } else { "" };
        format!("Conv2d({i}->{o}, {kh}x{kw}, /{stride}, g{g}{layout})")
    }

    fn forward(
        &mut self,
        x: &Tensor,
        ctx: &mut ForwardCtx,
    ) -> Result<(Tensor, Option<AffineSaved>)> {
        // `conv2d` is in PyTorch's lower-precision list (autocast_mode.h): input, weight and
        // bias cast to the low dtype (the parameters through the cache), output low. Batch
        // norm is in no list: it runs on the low input with the f32 scale, shift and
        // running statistics, output low (what cuDNN's batch norm does under autocast).
        let w_dtype = self.weight.value.dtype();
        let low = match ctx.op_dtype(OpKind::Conv2d, &[x.dtype(), w_dtype]) {
            Some(dt) if dt != x.dtype() || dt != w_dtype => Some(dt),
            _ => None,
        };
        let (xc, cast_saved) = match low {
            Some(dt) => {
                let w = ctx.cast_param(&self.weight, dt)?;
                (cast(x, dt)?, Some(CastSaved { w, in_dtype: x.dtype() }))
            }
            None => (x.clone(), None),
        };
        let w = cast_saved.as_ref().map_or(&self.weight.value, |c| &c.w);
        let b = match (&self.bias, low) {
            (Some(b), Some(dt)) => Some(ctx.cast_param(b, dt)?),
            (Some(b), None) => Some(b.value.clone()),
            (None, _) => None,
        };
        let z = if self.channels_last {
            ops::conv2d_nhwc(&xc, w, b.as_ref(), &self.opts)?
        } else {
            ops::conv2d(&xc, w, b.as_ref(), &self.opts)?
        };
        drop(b);
        let Some(norm) = &mut self.norm else {
            let (y, saved) = AffineSaved::activate(self.act, &xc, z, ctx)?;
            return Ok((y, saved.map(|s| AffineSaved { cast: cast_saved, ..s })));
        };
        let (g, b) = (&norm.gamma.value, &norm.beta.value);
        if !ctx.training() {
            drop(xc);
            let (rm, rv) = (&norm.running_mean, &norm.running_var);
            let u = if self.channels_last {
                ops::batch_norm_eval_nhwc(&z, g, b, rm, rv, BATCH_NORM_EPS)?
            } else {
                ops::batch_norm_eval(&z, g, b, rm, rv, BATCH_NORM_EPS)?
            };
            drop(z);
            return Ok((self.act.forward(u)?, None));
        }
        let running = ctx.update_running_stats.then_some(ops::RunningStats {
            mean: &mut norm.running_mean,
            var: &mut norm.running_var,
            momentum: BATCH_NORM_MOMENTUM,
        });
        let out = if self.channels_last {
            ops::batch_norm_nhwc(&z, g, b, running, BATCH_NORM_EPS)?
        } else {
            ops::batch_norm(&z, g, b, running, BATCH_NORM_EPS)?
        };
        let (y, kept) = self.act.forward_saving(out.y, true)?;
        let norm = Some(NormSaved { z, mean: out.mean, invstd: out.invstd });
        Ok((y, Some(AffineSaved { x: xc, z: kept, cast: cast_saved, norm })))
    }

    fn backward(&mut self, s: AffineSaved, dy: Tensor, want: bool) -> Result<Option<Tensor>> {
        let AffineSaved { x, z: kept, norm: norm_saved, cast: cast_saved } = s;
        // Under autocast the output was in the compute dtype; the gradient arrives in it
        // (cast if not).
        let dtype = if cast_saved.is_some() { x.dtype() } else { dy.dtype() };
        let dy = cast_into(dy, dtype)?;
        // Each gradient is dropped as soon as the next one is computed from it, as PyTorch
        // frees a node's incoming gradient after that node's backward.
        let mut dz = self.act.backward(kept.as_ref(), &dy)?.unwrap_or(dy);
        drop(kept);
        if let (Some(norm), Some(ns)) = (&mut self.norm, norm_saved) {
            let (gamma, cl) = (&norm.gamma.value, self.channels_last);
            let g = if cl {
                ops::batch_norm_backward_nhwc(
                    &ns.z,
                    gamma,
                    &ns.mean,
                    &ns.invstd,
                    &dz,
                    BATCH_NORM_EPS,
                )?
            } else {
                ops::batch_norm_backward(&ns.z, gamma, &ns.mean, &ns.invstd, &dz, BATCH_NORM_EPS)?
            };
            drop(ns);
            dz = g.dx;
            accumulate_grad_cast(&mut norm.gamma, g.dgamma)?;
            accumulate_grad_cast(&mut norm.beta, g.dbeta)?;
        }
        let w = cast_saved.as_ref().map_or(&self.weight.value, |c| &c.w);
        let with_bias = self.bias.is_some();
        // Without a wanted input gradient (the first layer), dx is neither computed nor
        // allocated, as PyTorch's convolution_backward with output_mask [False, ...].
        let (opts, cl) = (&self.opts, self.channels_last);
        let (dx, dweight, dbias) = if want {
            let g = if cl {
                ops::conv2d_backward_nhwc(&x, w, &dz, opts, with_bias)?
            } else {
                ops::conv2d_backward(&x, w, &dz, opts, with_bias)?
            };
            (Some(g.dx), g.dweight, g.dbias)
        } else {
            let g = if cl {
                ops::conv2d_backward_weight_nhwc(&x, w, &dz, opts, with_bias)?
            } else {
                ops::conv2d_backward_weight(&x, w, &dz, opts, with_bias)?
            };
            (None, g.dweight, g.dbias)
        };
        drop((x, dz));
        accumulate_grad_cast(&mut self.weight, dweight)?;
        if let (Some(b), Some(db)) = (&mut self.bias, dbias) {
            accumulate_grad_cast(b, db)?;
        }
        let Some(dx) = dx else { return Ok(None) };
        match cast_saved {
            Some(c) => Ok(Some(cast(&dx, c.in_dtype)?)),
            None => Ok(Some(dx)),
        }
    }

    fn params(&self) -> Vec<&Param> {
        let mut p = vec![&self.weight];
        p.extend(&self.bias);
        if let Some(n) = &self.norm {
            p.extend([&n.gamma, &n.beta]);
        }
        p
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut p = vec![&mut self.weight];
        p.extend(&mut self.bias);
        if let Some(n) = &mut self.norm {
            p.extend([&mut n.gamma, &mut n.beta]);
        }
        p
    }

    fn device(&self) -> &Device {
        &self.device
    }
}

/// Max pooling over `kernel x kernel` windows (ResNet's stem: 3, stride 2, padding 1).
#[derive(Debug)]
pub struct MaxPool2d {
    opts: Pool2dOptions,
    channels_last: bool,
    device: Device,
}

/// What [`MaxPool2d`] keeps: the argmax of each window and the input's shape.
#[derive(Debug)]
pub struct PoolSaved {
    argmax: Indices,
    shape: Vec<usize>,
}

impl MaxPool2d {
    /// Max pooling with a square `kernel`, `stride` and `padding`.
    pub fn new(device: &Device, kernel: usize, stride: usize, padding: usize) -> Self {
        let opts =
            Pool2dOptions::new((kernel, kernel), (stride, stride)).padding((padding, padding));
        MaxPool2d { opts, channels_last: false, device: device.clone() }
    }

    /// The same pooling channels_last images `[b, h, w, c]` (or not).
    pub fn with_channels_last(self, channels_last: bool) -> Self {
        MaxPool2d { channels_last, ..self }
    }
}

impl Layer for MaxPool2d {
    type Saved = PoolSaved;

    fn name(&self) -> String {
        format!("MaxPool2d({:?}, /{})", self.opts.kernel, self.opts.stride.0)
    }

    fn forward(&mut self, x: &Tensor, ctx: &mut ForwardCtx) -> Result<(Tensor, Option<PoolSaved>)> {
        let (y, argmax) = if self.channels_last {
            ops::max_pool2d_nhwc(x, &self.opts)?
        } else {
            ops::max_pool2d(x, &self.opts)?
        };
        let saved = ctx.training().then(|| PoolSaved { argmax, shape: x.shape().to_vec() });
        Ok((y, saved))
    }

    fn backward(&mut self, s: PoolSaved, dy: Tensor, want: bool) -> Result<Option<Tensor>> {
        if !want {
            return Ok(None);
        }
        let dx = if self.channels_last {
            ops::max_pool2d_backward_nhwc(&dy, &s.argmax, &s.shape, &self.opts)?
        } else {
            ops::max_pool2d_backward(&dy, &s.argmax, &s.shape, &self.opts)?
        };
        Ok(Some(dx))
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

/// The settings of a [`ResidualBlock`].
#[derive(Clone, Debug, PartialEq)]
pub struct ResidualBlockConfig {
    /// Channels in and out.
    pub channels: usize,
    /// Whether each convolution is followed by a batch norm (default false).
    pub batch_norm: bool,
    /// The dtype of the weights (default f32).
    pub dtype: DType,
    /// Seed of the weight initialization (default 0).
    pub seed: u64,
    /// Whether the block takes and gives channels_last images (default false).
    pub channels_last: bool,
}

impl ResidualBlockConfig {
    /// A block of `channels` channels, f32, seed 0.
    pub fn new(channels: usize) -> Self {
        ResidualBlockConfig {
            channels,
            batch_norm: false,
            dtype: DType::F32,
            seed: 0,
            channels_last: false,
        }
    }

    /// The same taking and giving channels_last images `[b, h, w, c]` (or not).
    pub fn with_channels_last(self, channels_last: bool) -> Self {
        ResidualBlockConfig { channels_last, ..self }
    }

    /// The same with or without a batch norm after each convolution.
    pub fn with_batch_norm(self, batch_norm: bool) -> Self {
        ResidualBlockConfig { batch_norm, ..self }
    }

    /// The same with weights in `dtype`.
    pub fn with_dtype(self, dtype: DType) -> Self {
        ResidualBlockConfig { dtype, ..self }
    }

    /// The same with weights drawn from `seed`.
    pub fn with_seed(self, seed: u64) -> Self {
        ResidualBlockConfig { seed, ..self }
    }

    /// The block on `device`: He-normal weights, the second convolution at gain 0.1 without
    /// batch norm (at 1 with it).
    ///
    /// # Errors
    ///
    /// As [`Conv2dConfig::init`].
    pub fn init(&self, device: &Device) -> Result<ResidualBlock> {
        let last_gain = if self.batch_norm { 1.0 } else { 0.1 };
        let conv = |act, gain, part| {
            Conv2dConfig::new(self.channels, self.channels, 3)
                .with_batch_norm(self.batch_norm)
                .with_channels_last(self.channels_last)
                .with_activation(act)
                .with_init(Init::HeNormal { gain })
                .with_dtype(self.dtype)
                .with_seed(sub_seed(self.seed, part))
                .init(device)
        };
        let mut c1 = conv(Act::Relu, 1.0, 0)?;
        let mut c2 = conv(Act::Identity, last_gain, 1)?;
        super::prefix_param_names(&mut c1, "conv1");
        super::prefix_param_names(&mut c2, "conv2");
        Ok(ResidualBlock { c1, c2 })
    }
}

/// ResNet's basic block, `relu(x + conv(relu(conv(x))))` with two 3x3 convolutions of the
/// same width, each optionally batch-normed. Built from a [`ResidualBlockConfig`].
#[derive(Debug)]
pub struct ResidualBlock {
    c1: Conv2d,
    c2: Conv2d,
}

/// What a [`ResidualBlock`] keeps: both convolutions' state and the block's output (the
/// final ReLU's mask).
#[derive(Debug)]
pub struct ResidualSaved {
    s1: AffineSaved,
    s2: AffineSaved,
    out: Tensor,
}

impl Layer for ResidualBlock {
    type Saved = ResidualSaved;

    fn name(&self) -> String {
        format!("ResidualBlock({})", self.c1.c_out())
    }

    fn forward(
        &mut self,
        x: &Tensor,
        ctx: &mut ForwardCtx,
    ) -> Result<(Tensor, Option<ResidualSaved>)> {
        const WHAT: &str = "ResidualBlock";
        let (a, s1) = self.c1.forward(x, ctx)?;
        let (z, s2) = self.c2.forward(&a, ctx)?;
        drop(a);
        let sum = add_promoted(x, &z)?;
        drop(z);
        let y = ops::relu(&sum)?;
        drop(sum);
        if !ctx.training() {
            return Ok((y, None));
        }
        // The ReLU's output gives its mask (`y > 0` where `sum > 0`), as PyTorch's relu keeps.
        let out = y.clone();
        Ok((y, Some(ResidualSaved { s1: saved(s1, WHAT)?, s2: saved(s2, WHAT)?, out })))
    }

    fn backward(&mut self, s: ResidualSaved, dy: Tensor, want: bool) -> Result<Option<Tensor>> {
        const WHAT: &str = "ResidualBlock";
        let ds = ops::relu_backward(&s.out, &dy)?;
        drop((dy, s.out));
        // `ds` flows into the branch and, kept, into the shortcut.
        let da = dx_of(self.c2.backward(s.s2, ds.clone(), true)?, WHAT)?;
        let dx = self.c1.backward(s.s1, da, want)?;
        match dx {
            Some(mut dx) => {
                add_grad(&mut dx, &ds)?;
                Ok(Some(dx))
            }
            None => Ok(None),
        }
    }

    fn params(&self) -> Vec<&Param> {
        let mut p = self.c1.params();
        p.extend(self.c2.params());
        p
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut p = self.c1.params_mut();
        p.extend(self.c2.params_mut());
        p
    }

    fn device(&self) -> &Device {
        &self.c1.device
    }
}

/// The settings of a [`Bottleneck`] block.
#[derive(Clone, Debug, PartialEq)]
pub struct BottleneckConfig {
    /// Input channels.
    pub c_in: usize,
    /// Channels of the 3x3 convolution (ResNet-50: 64, 128, 256, 512 per stage).
    pub mid: usize,
    /// Output channels (ResNet-50: `4 * mid`, the expansion).
    pub c_out: usize,
    /// Stride of the 3x3 convolution and of the projection shortcut (default 1).
    pub stride: usize,
    /// Whether each convolution (the projection's too) is followed by a batch norm, as in
    /// torchvision's ResNet-50 (default false).
    pub batch_norm: bool,
    /// The dtype of the weights (default f32).
    pub dtype: DType,
    /// Seed of the weight initialization (default 0).
    pub seed: u64,
    /// Whether the block takes and gives channels_last images (default false).
    pub channels_last: bool,
}

impl BottleneckConfig {
    /// A block `c_in -> mid -> mid -> c_out`, stride 1, no batch norm, f32, seed 0.
    pub fn new(c_in: usize, mid: usize, c_out: usize) -> Self {
        BottleneckConfig {
            c_in,
            mid,
            c_out,
            stride: 1,
            batch_norm: false,
            dtype: DType::F32,
            seed: 0,
            channels_last: false,
        }
    }

    /// The same with or without a batch norm after each convolution.
    pub fn with_batch_norm(self, batch_norm: bool) -> Self {
        BottleneckConfig { batch_norm, ..self }
    }

    /// The same taking and giving channels_last images `[b, h, w, c]` (or not).
    pub fn with_channels_last(self, channels_last: bool) -> Self {
        BottleneckConfig { channels_last, ..self }
    }

    /// The same with `stride` (2 halves the resolution).
    pub fn with_stride(self, stride: usize) -> Self {
        BottleneckConfig { stride, ..self }
    }

    /// The same with weights in `dtype`.
    pub fn with_dtype(self, dtype: DType) -> Self {
        BottleneckConfig { dtype, ..self }
    }

    /// The same with weights drawn from `seed`.
    pub fn with_seed(self, seed: u64) -> Self {
        BottleneckConfig { seed, ..self }
    }

    /// The block on `device`: He-normal weights, the last convolution at gain 0.1 without
    /// batch norm (at 1 with it), and a projection shortcut (1x1, strided) when the stride is
    /// not 1 or the channels change.
    ///
    /// # Errors
    ///
    /// As [`Conv2dConfig::init`].
    pub fn init(&self, device: &Device) -> Result<Bottleneck> {
        let last_gain = if self.batch_norm { 1.0 } else { 0.1 };
        let conv = |c_in, c_out, k, stride, act, gain, part, name| -> Result<Conv2d> {
            let mut c = Conv2dConfig::new(c_in, c_out, k)
                .with_stride(stride)
                .with_batch_norm(self.batch_norm)
                .with_channels_last(self.channels_last)
                .with_activation(act)
                .with_init(Init::HeNormal { gain })
                .with_dtype(self.dtype)
                .with_seed(sub_seed(self.seed, part))
                .init(device)?;
            super::prefix_param_names(&mut c, name);
            Ok(c)
        };
        let (c_in, mid, c_out, s) = (self.c_in, self.mid, self.c_out, self.stride);
        let shortcut = if s != 1 || c_in != c_out {
            Some(conv(c_in, c_out, 1, s, Act::Identity, 1.0, 3, "downsample")?)
        } else {
            None
        };
        Ok(Bottleneck {
            c1: conv(c_in, mid, 1, 1, Act::Relu, 1.0, 0, "conv1")?,
            c2: conv(mid, mid, 3, s, Act::Relu, 1.0, 1, "conv2")?,
            c3: conv(mid, c_out, 1, 1, Act::Identity, last_gain, 2, "conv3")?,
            shortcut,
        })
    }
}

/// ResNet-50's bottleneck block, each conv optionally batch-normed:
/// `relu(c3(c2(c1(x))) + shortcut(x))`
/// with `c1` 1x1 (ReLU), `c2` 3x3 strided (ReLU), `c3` 1x1, and the shortcut the identity or
/// a 1x1 strided projection. Built from a [`BottleneckConfig`].
#[derive(Debug)]
pub struct Bottleneck {
    c1: Conv2d,
    c2: Conv2d,
    c3: Conv2d,
    shortcut: Option<Conv2d>,
}

/// What a [`Bottleneck`] keeps: each convolution's state and the block's output (the final
/// ReLU's mask).
#[derive(Debug)]
pub struct BottleneckSaved {
    s1: AffineSaved,
    s2: AffineSaved,
    s3: AffineSaved,
    short: Option<AffineSaved>,
    out: Tensor,
}

impl Layer for Bottleneck {
    type Saved = BottleneckSaved;

    fn name(&self) -> String {
        let (i, o) = (self.c1.c_in(), self.c3.c_out());
        format!("Bottleneck({i}->{o}, /{})", self.c2.opts.stride.0)
    }

    fn forward(
        &mut self,
        x: &Tensor,
        ctx: &mut ForwardCtx,
    ) -> Result<(Tensor, Option<Self::Saved>)> {
        const WHAT: &str = "Bottleneck";
        let (a1, s1) = self.c1.forward(x, ctx)?;
        let (a2, s2) = self.c2.forward(&a1, ctx)?;
        drop(a1);
        let (z3, s3) = self.c3.forward(&a2, ctx)?;
        drop(a2);
        let (sum, short) = match &mut self.shortcut {
            Some(c) => {
                let (p, s) = c.forward(x, ctx)?;
                (add_promoted(&z3, &p)?, s)
            }
            None => (add_promoted(&z3, x)?, None),
        };
        drop(z3);
        let y = ops::relu(&sum)?;
        drop(sum);
        if !ctx.training() {
            return Ok((y, None));
        }
        let short = match (&self.shortcut, short) {
            (Some(_), s) => Some(saved(s, WHAT)?),
            (None, _) => None,
        };
        let s = BottleneckSaved {
            s1: saved(s1, WHAT)?,
            s2: saved(s2, WHAT)?,
            s3: saved(s3, WHAT)?,
            short,
            out: y.clone(),
        };
        Ok((y, Some(s)))
    }

    fn backward(&mut self, s: BottleneckSaved, dy: Tensor, want: bool) -> Result<Option<Tensor>> {
        const WHAT: &str = "Bottleneck";
        let dsum = ops::relu_backward(&s.out, &dy)?;
        drop((dy, s.out));
        // Without a projection the shortcut's gradient is `dsum` itself, kept for the end;
        // either way the main branch has the last use of `dsum`.
        let dshort = match (&mut self.shortcut, s.short) {
            (Some(c), Some(ss)) => c.backward(ss, dsum.clone(), want)?,
            _ => want.then(|| dsum.clone()),
        };
        let da2 = dx_of(self.c3.backward(s.s3, dsum, true)?, WHAT)?;
        let da1 = dx_of(self.c2.backward(s.s2, da2, true)?, WHAT)?;
        let dx = self.c1.backward(s.s1, da1, want)?;
        match dx {
            Some(mut dx) => {
                add_grad(&mut dx, &dx_of(dshort, WHAT)?)?;
                Ok(Some(dx))
            }
            None => Ok(None),
        }
    }

    fn params(&self) -> Vec<&Param> {
        let mut p = self.c1.params();
        p.extend(self.c2.params());
        p.extend(self.c3.params());
        if let Some(c) = &self.shortcut {
            p.extend(c.params());
        }
        p
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut p = self.c1.params_mut();
        p.extend(self.c2.params_mut());
        p.extend(self.c3.params_mut());
        if let Some(c) = &mut self.shortcut {
            p.extend(c.params_mut());
        }
        p
    }

    fn device(&self) -> &Device {
        &self.c1.device
    }
}

/// The settings of an [`InvertedResidual`] block.
#[derive(Clone, Debug, PartialEq)]
pub struct InvertedResidualConfig {
    /// Input channels.
    pub c_in: usize,
    /// Channels after the 1x1 expansion (`c_in` skips the expansion, as MobileNetV3's
    /// first block does).
    pub expanded: usize,
    /// Output channels.
    pub c_out: usize,
    /// Side of the depthwise kernel (3 or 5 in MobileNetV3; default 3).
    pub kernel: usize,
    /// Stride of the depthwise convolution (default 1).
    pub stride: usize,
    /// Whether each convolution is followed by a batch norm, as in torchvision's MobileNets
    /// (default false).
    pub batch_norm: bool,
    /// The activation of the expansion and the depthwise convolution (default ReLU;
    /// MobileNetV3 uses hard swish in its later blocks).
    pub activation: Act,
    /// Squeeze-excitation after the depthwise convolution, squeezing to this many channels
    /// (default none; MobileNetV3: `make_divisible(expanded / 4, 8)` in some blocks).
    pub squeeze: Option<usize>,
    /// The dtype of the weights (default f32).
    pub dtype: DType,
    /// Seed of the weight initialization (default 0).
    pub seed: u64,
    /// Whether the block takes and gives channels_last images (default false).
    pub channels_last: bool,
}

impl InvertedResidualConfig {
    /// A block `c_in -> expanded -> c_out`, 3x3 depthwise, stride 1, f32, seed 0.
    pub fn new(c_in: usize, expanded: usize, c_out: usize) -> Self {
        InvertedResidualConfig {
            c_in,
            expanded,
            c_out,
            kernel: 3,
            stride: 1,
            batch_norm: false,
            activation: Act::Relu,
            squeeze: None,
            dtype: DType::F32,
            seed: 0,
            channels_last: false,
        }
    }

    /// The same taking and giving channels_last images `[b, h, w, c]` (or not).
    pub fn with_channels_last(self, channels_last: bool) -> Self {
        InvertedResidualConfig { channels_last, ..self }
    }

    /// The same with `activation` after the expansion and the depthwise convolution.
    pub fn with_activation(self, activation: Act) -> Self {
        InvertedResidualConfig { activation, ..self }
    }

    /// The same with squeeze-excitation to `channels` (or without, for `None`).
    pub fn with_squeeze_excitation(self, channels: Option<usize>) -> Self {
        InvertedResidualConfig { squeeze: channels, ..self }
    }

    /// The same with or without a batch norm after each convolution.
    pub fn with_batch_norm(self, batch_norm: bool) -> Self {
        InvertedResidualConfig { batch_norm, ..self }
    }

    /// The same with a `kernel x kernel` depthwise convolution.
    pub fn with_kernel(self, kernel: usize) -> Self {
        InvertedResidualConfig { kernel, ..self }
    }

    /// The same with `stride`.
    pub fn with_stride(self, stride: usize) -> Self {
        InvertedResidualConfig { stride, ..self }
    }

    /// The same with weights in `dtype`.
    pub fn with_dtype(self, dtype: DType) -> Self {
        InvertedResidualConfig { dtype, ..self }
    }

    /// The same with weights drawn from `seed`.
    pub fn with_seed(self, seed: u64) -> Self {
        InvertedResidualConfig { seed, ..self }
    }

    /// The block on `device`: He-normal weights, the projection at gain 0.1 when the block
    /// is residual and has no batch norm.
    ///
    /// # Errors
    ///
    /// As [`Conv2dConfig::init`].
    pub fn init(&self, device: &Device) -> Result<InvertedResidual> {
        let residual = self.stride == 1 && self.c_in == self.c_out;
        let conv = |cfg: Conv2dConfig, gain, part, name| -> Result<Conv2d> {
            let mut c = cfg
                .with_batch_norm(self.batch_norm)
                .with_channels_last(self.channels_last)
                .with_init(Init::HeNormal { gain })
                .with_dtype(self.dtype)
                .with_seed(sub_seed(self.seed, part))
                .init(device)?;
            super::prefix_param_names(&mut c, name);
            Ok(c)
        };
        let e = self.expanded;
        let expand = if e != self.c_in {
            let cfg = Conv2dConfig::new(self.c_in, e, 1).with_activation(self.activation);
            Some(conv(cfg, 1.0, 0, "expand")?)
        } else {
            None
        };
        let dw = Conv2dConfig::new(e, e, self.kernel)
            .with_stride(self.stride)
            .with_groups(e)
            .with_activation(self.activation);
        let project = Conv2dConfig::new(e, self.c_out, 1);
        let se = match self.squeeze {
            Some(sq) => {
                positive("InvertedResidualConfig", "squeeze", sq)?;
                let linear = |i, o, act, part, name| -> Result<Linear> {
                    let mut l = LinearConfig::new(i, o)
                        .with_activation(act)
                        .with_dtype(self.dtype)
                        .with_seed(sub_seed(self.seed, part))
                        .init(device)?;
                    super::prefix_param_names(&mut l, name);
                    Ok(l)
                };
                Some(SqueezeExcitation {
                    fc1: linear(e, sq, Act::Relu, 3, "se.fc1")?,
                    fc2: linear(sq, e, Act::Identity, 4, "se.fc2")?,
                    channels_last: self.channels_last,
                })
            }
            None => None,
        };
        Ok(InvertedResidual {
            expand,
            depthwise: conv(dw, 1.0, 1, "depthwise")?,
            se,
            project: conv(
                project,
                if residual && !self.batch_norm { 0.1 } else { 1.0 },
                2,
                "project",
            )?,
            residual,
        })
    }
}

/// MobileNetV2/V3's inverted residual block, each conv optionally batch-normed: a 1x1
/// expansion (activated), a depthwise `k x k` convolution (activated, strided), optionally
/// squeeze-excitation, a linear 1x1 projection, and `x +` that when the stride is 1 and the
/// channels stay. Built from an [`InvertedResidualConfig`].
#[derive(Debug)]
pub struct InvertedResidual {
    expand: Option<Conv2d>,
    depthwise: Conv2d,
    se: Option<SqueezeExcitation>,
    project: Conv2d,
    residual: bool,
}

/// torchvision's `SqueezeExcitation` (MobileNetV3's): `x * hardsigmoid(fc2(relu(fc1(pool(x)))))`
/// with the two 1x1 convolutions on the pooled `[n, c]` as linear layers (same parameters).
#[derive(Debug)]
struct SqueezeExcitation {
    fc1: Linear,
    fc2: Linear,
    /// Images `[n, h, w, c]` rather than `[n, c, h, w]`.
    channels_last: bool,
}

/// What squeeze-excitation keeps: its input and shape, the linear layers' state, the gate's
/// input and the gate.
#[derive(Debug)]
struct SeSaved {
    x: Tensor,
    fc1: AffineSaved,
    fc2: AffineSaved,
    g: Tensor,
    gate: Tensor,
}

impl SqueezeExcitation {
    fn forward(&mut self, x: &Tensor, ctx: &mut ForwardCtx) -> Result<(Tensor, Option<SeSaved>)> {
        const WHAT: &str = "SqueezeExcitation";
        let pooled = if self.channels_last {
            ops::global_avg_pool_nhwc(x)?
        } else {
            ops::global_avg_pool(x)?
        };
        let (h, s1) = self.fc1.forward(&pooled, ctx)?;
        drop(pooled);
        let (g, s2) = self.fc2.forward(&h, ctx)?;
        drop(h);
        // The gate multiplies `x`, in `x`'s dtype (both are 16-bit under autocast).
        let gate = cast(&ops::hardsigmoid(&g)?, x.dtype())?;
        let y = if self.channels_last {
            ops::scale_channels_nhwc(x, &gate)?
        } else {
            ops::scale_channels(x, &gate)?
        };
        if !ctx.training() {
            return Ok((y, None));
        }
        let s = SeSaved { x: x.clone(), fc1: saved(s1, WHAT)?, fc2: saved(s2, WHAT)?, g, gate };
        Ok((y, Some(s)))
    }

    /// Each saved tensor and gradient is dropped once consumed, as autograd frees a node's
    /// inputs after its backward; the pooling's gradient is added into `dx` in place
    /// (PyTorch materializes it, then adds out of place).
    fn backward(&mut self, s: SeSaved, dy: Tensor) -> Result<Tensor> {
        const WHAT: &str = "SqueezeExcitation";
        let ops::ScaleChannelsGrads { mut dx, ds } = if self.channels_last {
            ops::scale_channels_backward_nhwc(&s.x, &s.gate, &dy)?
        } else {
            ops::scale_channels_backward(&s.x, &s.gate, &dy)?
        };
        drop((dy, s.x, s.gate));
        let dg = ops::hardsigmoid_backward(&s.g, &cast(&ds, s.g.dtype())?)?;
        drop((ds, s.g));
        let dh = dx_of(self.fc2.backward(s.fc2, dg, true)?, WHAT)?;
        let dpooled = dx_of(self.fc1.backward(s.fc1, dh, true)?, WHAT)?;
        let dpooled = cast(&dpooled, dx.dtype())?;
        if self.channels_last {
            ops::global_avg_pool_backward_add_nhwc(&mut dx, &dpooled)?;
        } else {
            ops::global_avg_pool_backward_add(&mut dx, &dpooled)?;
        }
        Ok(dx)
    }
}

/// What an [`InvertedResidual`] keeps: each convolution's state and squeeze-excitation's.
#[derive(Debug)]
pub struct InvertedSaved {
    expand: Option<AffineSaved>,
    depthwise: AffineSaved,
    se: Option<SeSaved>,
    project: AffineSaved,
}

impl Layer for InvertedResidual {
    type Saved = InvertedSaved;

    fn name(&self) -> String {
        let (e, o) = (self.depthwise.c_out(), self.project.c_out());
        format!("InvertedResidual({e}->{o}, /{})", self.depthwise.opts.stride.0)
    }

    fn forward(
        &mut self,
        x: &Tensor,
        ctx: &mut ForwardCtx,
    ) -> Result<(Tensor, Option<InvertedSaved>)> {
        const WHAT: &str = "InvertedResidual";
        let (h, se) = match &mut self.expand {
            Some(c) => {
                let (h, s) = c.forward(x, ctx)?;
                (h, Some(s))
            }
            None => (x.clone(), None),
        };
        let (d, sd) = self.depthwise.forward(&h, ctx)?;
        drop(h);
        let (d, sse) = match &mut self.se {
            Some(se) => se.forward(&d, ctx)?,
            None => (d, None),
        };
        let (p, sp) = self.project.forward(&d, ctx)?;
        drop(d);
        let y = if self.residual { add_promoted(x, &p)? } else { p };
        if !ctx.training() {
            return Ok((y, None));
        }
        let expand = match se {
            Some(s) => Some(saved(s, WHAT)?),
            None => None,
        };
        let se = match (&self.se, sse) {
            (Some(_), s) => Some(saved(s, WHAT)?),
            (None, _) => None,
        };
        let s =
            InvertedSaved { expand, depthwise: saved(sd, WHAT)?, se, project: saved(sp, WHAT)? };
        Ok((y, Some(s)))
    }

    fn backward(&mut self, s: InvertedSaved, dy: Tensor, want: bool) -> Result<Option<Tensor>> {
        const WHAT: &str = "InvertedResidual";
        // With a residual, `dy` also flows into the shortcut and is kept for the end.
        let dshort = (self.residual && want).then(|| dy.clone());
        let mut dd = dx_of(self.project.backward(s.project, dy, true)?, WHAT)?;
        if let (Some(se), Some(ss)) = (&mut self.se, s.se) {
            dd = se.backward(ss, dd)?;
        }
        let want_h = want || self.expand.is_some();
        let dh = self.depthwise.backward(s.depthwise, dd, want_h)?;
        let dx = match (&mut self.expand, s.expand) {
            (Some(c), Some(se)) => c.backward(se, dx_of(dh, WHAT)?, want)?,
            _ => dh,
        };
        match (dx, dshort) {
            (Some(mut dx), Some(dshort)) => {
                add_grad(&mut dx, &dshort)?;
                Ok(Some(dx))
            }
            (dx, _) => Ok(dx),
        }
    }

    fn params(&self) -> Vec<&Param> {
        let mut p = self.expand.as_ref().map(|c| c.params()).unwrap_or_default();
        p.extend(self.depthwise.params());
        if let Some(se) = &self.se {
            p.extend(se.fc1.params());
            p.extend(se.fc2.params());
        }
        p.extend(self.project.params());
        p
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut p = self.expand.as_mut().map(|c| c.params_mut()).unwrap_or_default();
        p.extend(self.depthwise.params_mut());
        if let Some(se) = &mut self.se {
            p.extend(se.fc1.params_mut());
            p.extend(se.fc2.params_mut());
        }
        p.extend(self.project.params_mut());
        p
    }

    fn device(&self) -> &Device {
        &self.depthwise.device
    }
}

/// The settings of a [`ClassifierHead`].
#[derive(Clone, Debug, PartialEq)]
pub struct ClassifierHeadConfig {
    /// Channels of the pooled features.
    pub channels: usize,
    /// Units of a hidden layer before the classifier (MobileNetV3: 1280), or none
    /// (default).
    pub hidden: Option<usize>,
    /// The hidden layer's activation (default ReLU; MobileNetV3: hard swish).
    pub hidden_activation: Act,
    /// Output classes.
    pub classes: usize,
    /// The dtype of the weights (default f32).
    pub dtype: DType,
    /// Seed of the weight initialization (default 0).
    pub seed: u64,
    /// Whether the head pools channels_last images `[b, h, w, c]` (default false).
    pub channels_last: bool,
}

impl ClassifierHeadConfig {
    /// A head from `channels` pooled features to `classes`, no hidden layer, f32, seed 0.
    pub fn new(channels: usize, classes: usize) -> Self {
        ClassifierHeadConfig {
            channels,
            hidden: None,
            hidden_activation: Act::Relu,
            classes,
            dtype: DType::F32,
            seed: 0,
            channels_last: false,
        }
    }

    /// The same pooling channels_last images `[b, h, w, c]` (or not).
    pub fn with_channels_last(self, channels_last: bool) -> Self {
        ClassifierHeadConfig { channels_last, ..self }
    }

    /// The same with `activation` after the hidden layer.
    pub fn with_hidden_activation(self, activation: Act) -> Self {
        ClassifierHeadConfig { hidden_activation: activation, ..self }
    }

    /// The same with a hidden layer of `units` (activated by `hidden_activation`).
    pub fn with_hidden(self, units: usize) -> Self {
        ClassifierHeadConfig { hidden: Some(units), ..self }
    }

    /// The same with weights in `dtype`.
    pub fn with_dtype(self, dtype: DType) -> Self {
        ClassifierHeadConfig { dtype, ..self }
    }

    /// The same with weights drawn from `seed`.
    pub fn with_seed(self, seed: u64) -> Self {
        ClassifierHeadConfig { seed, ..self }
    }

    /// The head on `device` (He-normal weights, zero biases).
    ///
    /// # Errors
    ///
    /// Out of memory.
    pub fn init(&self, device: &Device) -> Result<ClassifierHead> {
        let linear = |i, o, act, part, name| -> Result<Linear> {
            let mut l = LinearConfig::new(i, o)
                .with_activation(act)
                .with_init(Init::HeNormal { gain: 1.0 })
                .with_dtype(self.dtype)
                .with_seed(sub_seed(self.seed, part))
                .init(device)?;
            super::prefix_param_names(&mut l, name);
            Ok(l)
        };
        let (hidden, last) = match self.hidden {
            Some(h) => (Some(linear(self.channels, h, self.hidden_activation, 0, "hidden")?), h),
            None => (None, self.channels),
        };
        let fc = linear(last, self.classes, Act::Identity, 1, "fc")?;
        Ok(ClassifierHead { hidden, fc, channels_last: self.channels_last })
    }
}

/// Global average pooling then linear layers: `[b, c, h, w]` (or channels_last
/// `[b, h, w, c]`) `-> [b, classes]`. Built from a
/// [`ClassifierHeadConfig`].
#[derive(Debug)]
pub struct ClassifierHead {
    hidden: Option<Linear>,
    fc: Linear,
    channels_last: bool,
}

/// What a [`ClassifierHead`] keeps: the input's shape and the linear layers' state.
#[derive(Debug)]
pub struct HeadSaved {
    shape: Vec<usize>,
    hidden: Option<AffineSaved>,
    fc: AffineSaved,
}

impl Layer for ClassifierHead {
    type Saved = HeadSaved;

    fn name(&self) -> String {
        format!("ClassifierHead({})", self.fc.weight.value.shape().first().unwrap_or(&0))
    }

    fn forward(&mut self, x: &Tensor, ctx: &mut ForwardCtx) -> Result<(Tensor, Option<HeadSaved>)> {
        const WHAT: &str = "ClassifierHead";
        let mut h = if self.channels_last {
            ops::global_avg_pool_nhwc(x)?
        } else {
            ops::global_avg_pool(x)?
        };
        let mut hidden = None;
        if let Some(l) = &mut self.hidden {
            let (y, s) = l.forward(&h, ctx)?;
            (h, hidden) = (y, s);
        }
        let (y, fc) = self.fc.forward(&h, ctx)?;
        if !ctx.training() {
            return Ok((y, None));
        }
        let hidden = match (&self.hidden, hidden) {
            (Some(_), s) => Some(saved(s, WHAT)?),
            (None, _) => None,
        };
        Ok((y, Some(HeadSaved { shape: x.shape().to_vec(), hidden, fc: saved(fc, WHAT)? })))
    }

    fn backward(&mut self, s: HeadSaved, dy: Tensor, want: bool) -> Result<Option<Tensor>> {
        const WHAT: &str = "ClassifierHead";
        let want_h = want || self.hidden.is_some();
        let mut dh = self.fc.backward(s.fc, dy, want_h)?;
        if let (Some(l), Some(sh)) = (&mut self.hidden, s.hidden) {
            dh = l.backward(sh, dx_of(dh, WHAT)?, want)?;
        }
        match dh {
            Some(dp) if want && self.channels_last => {
                Ok(Some(ops::global_avg_pool_backward_nhwc(&dp, &s.shape)?))
            }
            Some(dp) if want => Ok(Some(ops::global_avg_pool_backward(&dp, &s.shape)?)),
            _ => Ok(None),
        }
    }

    fn params(&self) -> Vec<&Param> {
        let mut p = self.hidden.as_ref().map(|l| l.params()).unwrap_or_default();
        p.extend(self.fc.params());
        p
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut p = self.hidden.as_mut().map(|l| l.params_mut()).unwrap_or_default();
        p.extend(self.fc.params_mut());
        p
    }

    fn device(&self) -> &Device {
        &self.fc.device
    }
}
