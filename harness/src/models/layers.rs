//! The layers the reference models are built from, as vram-accum [`Layer`]s.

use crate::rng::Rng;
use vram_accum::{Error, ForwardCtx, Layer, Param, Result};
use vram_kernels::{Conv2dOptions, DType, Device, Tensor, ops};

/// A tensor of normal values with standard deviation `std`.
pub(crate) fn normal(
    device: &Device,
    shape: &[usize],
    std: f32,
    rng: &mut Rng,
    dtype: DType,
) -> Result<Tensor> {
    if device.is_virtual() {
        // A virtual device keeps no values: allocate without drawing them (a GPT-2 medium
        // would otherwise draw 355 M normals on the host for nothing).
        return Ok(Tensor::zeros(device, shape, dtype)?);
    }
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n).map(|_| std * rng.normal()).collect();
    Ok(Tensor::from_f32_slice(device, shape, &values, dtype)?)
}

/// What a dense or convolution layer keeps: its input and, before a non-identity
/// activation, the pre-activation.
type AffineSaved = (Tensor, Option<Tensor>);

/// The state a sub-layer saved in training mode, or an error naming the block.
fn saved_in_training<T>(saved: Option<T>, block: &str) -> Result<T> {
    saved.ok_or_else(|| Error::InvalidArgument {
        what: "models::layers",
        reason: format!("a sub-layer of {block} saved nothing in training mode"),
    })
}

/// The activation after a dense or convolution layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    /// None.
    Identity,
    /// max(0, x).
    Relu,
    /// GELU (tanh approximation).
    Gelu,
}

impl Act {
    fn forward(self, z: Tensor) -> Result<Tensor> {
        Ok(match self {
            Act::Identity => z,
            Act::Relu => ops::relu(&z)?,
            Act::Gelu => ops::gelu(&z)?,
        })
    }

    fn backward(self, z: Option<&Tensor>, dy: &Tensor) -> Result<Option<Tensor>> {
        Ok(match (self, z) {
            (Act::Relu, Some(z)) => Some(ops::relu_backward(z, dy)?),
            (Act::Gelu, Some(z)) => Some(ops::gelu_backward(z, dy)?),
            _ => None,
        })
    }
}

/// `act(x W^T + b)`.
pub struct Dense {
    name: String,
    w: Param,
    b: Param,
    act: Act,
    device: Device,
}

impl Dense {
    /// A dense layer with He-normal weights and zero bias.
    pub fn new(
        device: &Device,
        name: &str,
        d_in: usize,
        d_out: usize,
        act: Act,
        rng: &mut Rng,
        dtype: DType,
    ) -> Result<Self> {
        let std = (2.0 / d_in as f32).sqrt();
        Ok(Dense {
            name: name.into(),
            w: Param::new(
                format!("{name}.weight"),
                normal(device, &[d_out, d_in], std, rng, dtype)?,
            ),
            b: Param::new(format!("{name}.bias"), Tensor::zeros(device, &[d_out], dtype)?),
            act,
            device: device.clone(),
        })
    }
}

impl Layer for Dense {
    type Saved = AffineSaved;

    fn name(&self) -> String {
        self.name.clone()
    }

    fn forward(
        &mut self,
        x: &Tensor,
        ctx: &mut ForwardCtx,
    ) -> Result<(Tensor, Option<AffineSaved>)> {
        let z = ops::linear(x, &self.w.value, Some(&self.b.value))?;
        if !ctx.training() {
            return Ok((self.act.forward(z)?, None));
        }
        let kept_z = if self.act == Act::Identity { None } else { Some(z.clone()) };
        let y = self.act.forward(z)?;
        Ok((y, Some((x.clone(), kept_z))))
    }

    fn backward(&mut self, s: AffineSaved, dy: &Tensor, want_dx: bool) -> Result<Option<Tensor>> {
        let (x, z) = s;
        let dz = self.act.backward(z.as_ref(), dy)?;
        let g = ops::linear_backward(&x, &self.w.value, dz.as_ref().unwrap_or(dy), true)?;
        self.w.accumulate_grad(g.dw)?;
        if let Some(db) = g.dbias {
            self.b.accumulate_grad(db)?;
        }
        Ok(want_dx.then_some(g.dx))
    }

    fn params(&self) -> Vec<&Param> {
        vec![&self.w, &self.b]
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        vec![&mut self.w, &mut self.b]
    }

    fn device(&self) -> &Device {
        &self.device
    }
}

/// A 2-d convolution (any groups: `groups == channels` is depthwise) with an activation.
pub struct Conv {
    name: String,
    w: Param,
    opts: Conv2dOptions,
    act: Act,
    device: Device,
}

impl Conv {
    /// A convolution with He-normal weights (no bias), `k x k` kernel, padding `k / 2`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        device: &Device,
        name: &str,
        c_in: usize,
        c_out: usize,
        k: usize,
        stride: usize,
        groups: usize,
        act: Act,
        rng: &mut Rng,
        dtype: DType,
    ) -> Result<Self> {
        let fan_in = c_in / groups * k * k;
        let std = (2.0 / fan_in as f32).sqrt();
        let w = normal(device, &[c_out, c_in / groups, k, k], std, rng, dtype)?;
        let opts = Conv2dOptions {
            stride: (stride, stride),
            padding: (k / 2, k / 2),
            dilation: (1, 1),
            groups,
        };
        Ok(Conv {
            name: name.into(),
            w: Param::new(format!("{name}.weight"), w),
            opts,
            act,
            device: device.clone(),
        })
    }
}

impl Layer for Conv {
    type Saved = AffineSaved;

    fn name(&self) -> String {
        self.name.clone()
    }

    fn forward(
        &mut self,
        x: &Tensor,
        ctx: &mut ForwardCtx,
    ) -> Result<(Tensor, Option<AffineSaved>)> {
        let z = ops::conv2d(x, &self.w.value, None, &self.opts)?;
        if !ctx.training() {
            return Ok((self.act.forward(z)?, None));
        }
        let kept_z = if self.act == Act::Identity { None } else { Some(z.clone()) };
        let y = self.act.forward(z)?;
        Ok((y, Some((x.clone(), kept_z))))
    }

    fn backward(&mut self, s: AffineSaved, dy: &Tensor, want_dx: bool) -> Result<Option<Tensor>> {
        let (x, z) = s;
        let dz = self.act.backward(z.as_ref(), dy)?;
        let g =
            ops::conv2d_backward(&x, &self.w.value, dz.as_ref().unwrap_or(dy), &self.opts, false)?;
        self.w.accumulate_grad(g.dweight)?;
        Ok(want_dx.then_some(g.dx))
    }

    fn params(&self) -> Vec<&Param> {
        vec![&self.w]
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        vec![&mut self.w]
    }

    fn device(&self) -> &Device {
        &self.device
    }
}

/// ResNet's basic block without normalisation: `relu(x + conv(relu(conv(x))))`. The second
/// convolution starts at a small scale so the block starts near the identity (as Fixup
/// does), which keeps training stable without batch norm.
pub struct ResidualBlock {
    name: String,
    c1: Conv,
    c2: Conv,
    device: Device,
}

impl ResidualBlock {
    /// A block of `channels` channels.
    pub fn new(
        device: &Device,
        name: &str,
        channels: usize,
        rng: &mut Rng,
        dtype: DType,
    ) -> Result<Self> {
        let c1 = Conv::new(
            device,
            &format!("{name}.conv1"),
            channels,
            channels,
            3,
            1,
            1,
            Act::Relu,
            rng,
            dtype,
        )?;
        let mut c2 = Conv::new(
            device,
            &format!("{name}.conv2"),
            channels,
            channels,
            3,
            1,
            1,
            Act::Identity,
            rng,
            dtype,
        )?;
        c2.w.value = ops::scale(&c2.w.value, 0.1)?;
        Ok(ResidualBlock { name: name.into(), c1, c2, device: device.clone() })
    }
}

impl Layer for ResidualBlock {
    /// Both convolutions' state and the sum before the last ReLU.
    type Saved = (AffineSaved, AffineSaved, Tensor);

    fn name(&self) -> String {
        self.name.clone()
    }

    fn forward(
        &mut self,
        x: &Tensor,
        ctx: &mut ForwardCtx,
    ) -> Result<(Tensor, Option<Self::Saved>)> {
        let (a, s1) = self.c1.forward(x, ctx)?;
        let (z, s2) = self.c2.forward(&a, ctx)?;
        drop(a);
        let sum = ops::add(x, &z)?;
        drop(z);
        if !ctx.training() {
            return Ok((ops::relu(&sum)?, None));
        }
        let y = ops::relu(&sum)?;
        let (s1, s2) = (saved_in_training(s1, &self.name)?, saved_in_training(s2, &self.name)?);
        Ok((y, Some((s1, s2, sum))))
    }

    fn backward(&mut self, s: Self::Saved, dy: &Tensor, want_dx: bool) -> Result<Option<Tensor>> {
        let (s1, s2, sum) = s;
        let ds = ops::relu_backward(&sum, dy)?;
        drop(sum);
        let da = self.c2.backward(s2, &ds, true)?.expect("asked for dx");
        let dx_branch = self.c1.backward(s1, &da, want_dx)?;
        match dx_branch {
            Some(mut dx) if want_dx => {
                ops::add_assign(&mut dx, &ds)?;
                Ok(Some(dx))
            }
            _ => Ok(None),
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
        &self.device
    }
}

/// Global average pooling then a dense classifier: `[b, c, h, w] -> [b, classes]`.
pub struct ClassifierHead {
    pool_input_shape: Vec<usize>,
    fc: Dense,
}

impl ClassifierHead {
    /// A head from `channels` to `classes`.
    pub fn new(
        device: &Device,
        channels: usize,
        classes: usize,
        rng: &mut Rng,
        dtype: DType,
    ) -> Result<Self> {
        Ok(ClassifierHead {
            pool_input_shape: Vec::new(),
            fc: Dense::new(device, "head", channels, classes, Act::Identity, rng, dtype)?,
        })
    }
}

impl Layer for ClassifierHead {
    type Saved = AffineSaved;

    fn name(&self) -> String {
        "head".into()
    }

    fn forward(
        &mut self,
        x: &Tensor,
        ctx: &mut ForwardCtx,
    ) -> Result<(Tensor, Option<AffineSaved>)> {
        self.pool_input_shape = x.shape().to_vec();
        let pooled = ops::global_avg_pool(x)?;
        self.fc.forward(&pooled, ctx)
    }

    fn backward(&mut self, s: AffineSaved, dy: &Tensor, want_dx: bool) -> Result<Option<Tensor>> {
        let dp = self.fc.backward(s, dy, true)?.expect("asked for dx");
        if !want_dx {
            return Ok(None);
        }
        Ok(Some(ops::global_avg_pool_backward(&dp, &self.pool_input_shape)?))
    }

    fn params(&self) -> Vec<&Param> {
        self.fc.params()
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        self.fc.params_mut()
    }

    fn device(&self) -> &Device {
        self.fc.device()
    }
}

/// Layer norm over the last dimension, with learnt scale and shift.
struct Norm {
    gamma: Param,
    beta: Param,
}

impl Norm {
    fn new(device: &Device, name: &str, d: usize, dtype: DType) -> Result<Self> {
        Ok(Norm {
            gamma: Param::new(format!("{name}.weight"), Tensor::full(device, &[d], dtype, 1.0)?),
            beta: Param::new(format!("{name}.bias"), Tensor::zeros(device, &[d], dtype)?),
        })
    }

    fn forward(&self, x: &Tensor) -> Result<vram_kernels::ops::LayerNormOutput> {
        Ok(ops::layer_norm(x, &self.gamma.value, &self.beta.value, 1e-5)?)
    }

    fn backward(
        &mut self,
        x: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
        dy: &Tensor,
    ) -> Result<Tensor> {
        let g = ops::layer_norm_backward(x, &self.gamma.value, mean, rstd, dy)?;
        self.gamma.accumulate_grad(g.dgamma)?;
        self.beta.accumulate_grad(g.dbeta)?;
        Ok(g.dx)
    }
}

/// A GPT block (pre-norm): `x + attn(ln(x))`, then `x + mlp(ln(x))`, single-head causal
/// attention, GELU MLP of width 4d, dropout after the MLP. Input and output `[b * s, d]`.
pub struct TransformerBlock {
    name: String,
    seq: usize,
    d: usize,
    ln1: Norm,
    q: Dense,
    k: Dense,
    v: Dense,
    proj: Dense,
    ln2: Norm,
    fc1: Dense,
    fc2: Dense,
    dropout: f32,
    device: Device,
}

impl TransformerBlock {
    /// A block of width `d` for sequences of length `seq`.
    pub fn new(
        device: &Device,
        name: &str,
        d: usize,
        seq: usize,
        dropout: f32,
        rng: &mut Rng,
        dtype: DType,
    ) -> Result<Self> {
        let dense = |n: &str, i, o, a, rng: &mut Rng| {
            Dense::new(device, &format!("{name}.{n}"), i, o, a, rng, dtype)
        };
        let mut proj = dense("proj", d, d, Act::Identity, rng)?;
        let mut fc2 = dense("fc2", 4 * d, d, Act::Identity, rng)?;
        // Small residual-branch outputs at start (GPT-2 scales them by 1/sqrt(2 * layers)).
        proj.w.value = ops::scale(&proj.w.value, 0.2)?;
        fc2.w.value = ops::scale(&fc2.w.value, 0.2)?;
        Ok(TransformerBlock {
            name: name.into(),
            seq,
            d,
            ln1: Norm::new(device, &format!("{name}.ln1"), d, dtype)?,
            q: dense("q", d, d, Act::Identity, rng)?,
            k: dense("k", d, d, Act::Identity, rng)?,
            v: dense("v", d, d, Act::Identity, rng)?,
            proj,
            ln2: Norm::new(device, &format!("{name}.ln2"), d, dtype)?,
            fc1: dense("fc1", d, 4 * d, Act::Gelu, rng)?,
            fc2,
            dropout,
            device: device.clone(),
        })
    }
}

/// What a transformer block keeps for backward.
pub struct BlockSaved {
    x: Tensor,
    ln1: vram_kernels::ops::LayerNormOutput,
    sq: AffineSaved,
    sk: AffineSaved,
    sv: AffineSaved,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    probs: Tensor,
    sproj: AffineSaved,
    x2: Tensor,
    ln2: vram_kernels::ops::LayerNormOutput,
    s1: AffineSaved,
    s2: AffineSaved,
    dropout_seed: u64,
    dropout_offset: u64,
}

impl Layer for TransformerBlock {
    type Saved = BlockSaved;

    fn name(&self) -> String {
        self.name.clone()
    }

    fn forward(
        &mut self,
        x: &Tensor,
        ctx: &mut ForwardCtx,
    ) -> Result<(Tensor, Option<BlockSaved>)> {
        let (n, d, s) = (x.shape()[0], self.d, self.seq);
        let b = n / s;
        let ln1 = self.ln1.forward(x)?;
        let (q, sq) = self.q.forward(&ln1.y, ctx)?;
        let (k, sk) = self.k.forward(&ln1.y, ctx)?;
        let (v, sv) = self.v.forward(&ln1.y, ctx)?;
        let (q, k, v) = (q.reshape(&[b, s, d])?, k.reshape(&[b, s, d])?, v.reshape(&[b, s, d])?);
        let scores = ops::scale(&ops::matmul(&q, &k, false, true)?, 1.0 / (d as f32).sqrt())?;
        let probs = ops::causal_softmax(&scores)?;
        drop(scores);
        let attn = ops::matmul(&probs, &v, false, false)?.reshape(&[n, d])?;
        let (proj, sproj) = self.proj.forward(&attn, ctx)?;
        drop(attn);
        let x2 = ops::add(x, &proj)?;
        drop(proj);
        let ln2 = self.ln2.forward(&x2)?;
        let (h, s1) = self.fc1.forward(&ln2.y, ctx)?;
        let (m, s2) = self.fc2.forward(&h, ctx)?;
        drop(h);
        let dropout_offset = ctx.take_offsets(m.numel() as u64)?;
        let m = if ctx.training() && self.dropout > 0.0 {
            ops::dropout(&m, self.dropout, ctx.seed, dropout_offset)?
        } else {
            m
        };
        let y = ops::add(&x2, &m)?;
        if !ctx.training() {
            return Ok((y, None));
        }
        let saved = BlockSaved {
            x: x.clone(),
            ln1,
            sq: sq.expect("training"),
            sk: sk.expect("training"),
            sv: sv.expect("training"),
            q,
            k,
            v,
            probs,
            sproj: sproj.expect("training"),
            x2,
            ln2,
            s1: s1.expect("training"),
            s2: s2.expect("training"),
            dropout_seed: ctx.seed,
            dropout_offset,
        };
        Ok((y, Some(saved)))
    }

    fn backward(&mut self, sv: BlockSaved, dy: &Tensor, want_dx: bool) -> Result<Option<Tensor>> {
        let (n, d, seq) = (dy.shape()[0], self.d, self.seq);
        let b = n / seq;
        // y = x2 + dropout(fc2(fc1(ln2(x2))))
        let dropped;
        let dm = if self.dropout > 0.0 {
            dropped = ops::dropout_backward(dy, self.dropout, sv.dropout_seed, sv.dropout_offset)?;
            &dropped
        } else {
            dy
        };
        let dh = self.fc2.backward(sv.s2, dm, true)?.expect("dx");
        let dln2 = self.fc1.backward(sv.s1, &dh, true)?.expect("dx");
        drop(dh);
        let mut dx2 = self.ln2.backward(&sv.x2, &sv.ln2.mean, &sv.ln2.rstd, &dln2)?;
        ops::add_assign(&mut dx2, dy)?;
        drop((dln2, sv.ln2, sv.x2));
        // x2 = x + proj(attn(ln1(x)))
        let dattn = self.proj.backward(sv.sproj, &dx2, true)?.expect("dx").reshape(&[b, seq, d])?;
        let (dprobs, dv) = ops::matmul_backward(&sv.probs, &sv.v, &dattn, false, false)?;
        drop(dattn);
        let dscores = ops::scale(
            &ops::causal_softmax_backward(&sv.probs, &dprobs)?,
            1.0 / (d as f32).sqrt(),
        )?;
        drop((dprobs, sv.probs));
        let (dq, dk) = ops::matmul_backward(&sv.q, &sv.k, &dscores, false, true)?;
        drop(dscores);
        let mut dln1 = self.q.backward(sv.sq, &dq.reshape(&[n, d])?, true)?.expect("dx");
        ops::add_assign(
            &mut dln1,
            &self.k.backward(sv.sk, &dk.reshape(&[n, d])?, true)?.expect("dx"),
        )?;
        ops::add_assign(
            &mut dln1,
            &self.v.backward(sv.sv, &dv.reshape(&[n, d])?, true)?.expect("dx"),
        )?;
        let mut dx = self.ln1.backward(&sv.x, &sv.ln1.mean, &sv.ln1.rstd, &dln1)?;
        ops::add_assign(&mut dx, &dx2)?;
        Ok(want_dx.then_some(dx))
    }

    fn params(&self) -> Vec<&Param> {
        let mut p = vec![&self.ln1.gamma, &self.ln1.beta, &self.ln2.gamma, &self.ln2.beta];
        for l in [&self.q, &self.k, &self.v, &self.proj, &self.fc1, &self.fc2] {
            p.extend(l.params());
        }
        p
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut p =
            vec![&mut self.ln1.gamma, &mut self.ln1.beta, &mut self.ln2.gamma, &mut self.ln2.beta];
        for l in
            [&mut self.q, &mut self.k, &mut self.v, &mut self.proj, &mut self.fc1, &mut self.fc2]
        {
            p.extend(l.params_mut());
        }
        p
    }

    fn device(&self) -> &Device {
        &self.device
    }
}
