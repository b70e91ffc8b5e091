//! Ready-made layers built from `vram_kernels` ops: [`Linear`], [`Activation`] (ReLU, GELU),
//! [`Dropout`], [`LayerNorm`] and a pre-norm residual MLP block, [`ResidualMlp`].
//!
//! Tensors are uniquely owned (no views), so a layer that needs its input in backward saves a
//! copy of it; the executor frees the original once the next layer has consumed it, so the
//! copy is the only one alive, as in PyTorch's autograd graph.

use crate::layer::{ForwardCtx, Layer, Param, Saved};
use vram_kernels::cpu::random::uniform_at;
use vram_kernels::{DType, Device, Error, Result, Tensor, ops};

/// A tensor of `shape` with elements uniform in `[-bound, bound)`, drawn from `seed`.
fn uniform(
    device: &Device,
    shape: &[usize],
    bound: f32,
    dtype: DType,
    seed: u64,
) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n as u64).map(|i| (2.0 * uniform_at(seed, i) - 1.0) * bound).collect();
    Tensor::from_f32_slice(device, shape, &data, dtype)
}

/// Downcasts what a forward saved, or says which layer got the wrong state.
fn unpack<T: 'static>(saved: Saved, op: &'static str) -> Result<Box<T>> {
    saved.downcast::<T>().map_err(|_| Error::InvalidArgument {
        op,
        reason: "the saved state was not produced by this layer's forward".into(),
    })
}

/// Keeps `x` (a shared reference, no copy) when the forward must save it.
fn save_input(x: &Tensor, ctx: &ForwardCtx) -> Result<Option<Tensor>> {
    Ok(ctx.training().then(|| x.clone()))
}

/// `y = x w^T + b` over the last dimension: `[.., d_in] -> [.., d_out]`.
#[derive(Debug)]
pub struct Linear {
    weight: Param,
    bias: Param,
    device: Device,
}

impl Linear {
    /// A layer with weights uniform in `±1/sqrt(d_in)` (PyTorch's default bound) drawn from
    /// `seed`, and zero bias.
    ///
    /// # Errors
    ///
    /// Out of memory.
    pub fn new(
        device: &Device,
        d_in: usize,
        d_out: usize,
        dtype: DType,
        seed: u64,
    ) -> Result<Self> {
        let bound = 1.0 / (d_in.max(1) as f32).sqrt();
        Ok(Linear {
            weight: Param::new("weight", uniform(device, &[d_out, d_in], bound, dtype, seed)?),
            bias: Param::new("bias", Tensor::zeros(device, &[d_out], dtype)?),
            device: device.clone(),
        })
    }
}

impl Layer for Linear {
    fn name(&self) -> String {
        let s = self.weight.value.shape();
        format!("Linear({}->{})", s[1], s[0])
    }

    fn forward(&mut self, x: &Tensor, ctx: &mut ForwardCtx) -> Result<(Tensor, Option<Saved>)> {
        let y = ops::linear(x, &self.weight.value, Some(&self.bias.value))?;
        Ok((y, save_input(x, ctx)?.map(|x| Box::new(x) as Saved)))
    }

    fn backward(&mut self, saved: Saved, dy: &Tensor, want: bool) -> Result<Option<Tensor>> {
        let x = unpack::<Tensor>(saved, "Linear::backward")?;
        let g = ops::linear_backward(&x, &self.weight.value, dy, true)?;
        drop(x);
        self.weight.accumulate_grad(g.dw)?;
        if let Some(db) = g.dbias {
            self.bias.accumulate_grad(db)?;
        }
        Ok(want.then_some(g.dx))
    }

    fn params(&self) -> Vec<&Param> {
        vec![&self.weight, &self.bias]
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        vec![&mut self.weight, &mut self.bias]
    }

    fn device(&self) -> &Device {
        &self.device
    }
}

/// Which elementwise activation an [`Activation`] layer applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Relu,
    Gelu,
}

/// An elementwise activation: [`Activation::relu`] or [`Activation::gelu`].
#[derive(Debug)]
pub struct Activation {
    kind: Kind,
    device: Device,
}

impl Activation {
    /// ReLU, `max(x, 0)`, on `device`.
    pub fn relu(device: &Device) -> Self {
        Activation { kind: Kind::Relu, device: device.clone() }
    }

    /// GELU (tanh approximation, as `vram_kernels::ops::gelu`) on `device`.
    pub fn gelu(device: &Device) -> Self {
        Activation { kind: Kind::Gelu, device: device.clone() }
    }
}

impl Layer for Activation {
    fn name(&self) -> String {
        format!("{:?}", self.kind)
    }

    fn forward(&mut self, x: &Tensor, ctx: &mut ForwardCtx) -> Result<(Tensor, Option<Saved>)> {
        let y = match self.kind {
            Kind::Relu => ops::relu(x)?,
            Kind::Gelu => ops::gelu(x)?,
        };
        Ok((y, save_input(x, ctx)?.map(|x| Box::new(x) as Saved)))
    }

    fn backward(&mut self, saved: Saved, dy: &Tensor, want: bool) -> Result<Option<Tensor>> {
        let x = unpack::<Tensor>(saved, "Activation::backward")?;
        if !want {
            return Ok(None);
        }
        match self.kind {
            Kind::Relu => ops::relu_backward(&x, dy).map(Some),
            Kind::Gelu => ops::gelu_backward(&x, dy).map(Some),
        }
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

/// What [`Dropout`] keeps for backward: the stream position, not a mask.
struct DropoutSaved {
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
        if !(0.0..1.0).contains(&p) {
            return Err(Error::InvalidArgument {
                op: "Dropout::new",
                reason: format!("drop probability {p} is not in [0, 1)"),
            });
        }
        Ok(Dropout { p, device: device.clone() })
    }
}

impl Layer for Dropout {
    fn name(&self) -> String {
        format!("Dropout({})", self.p)
    }

    fn forward(&mut self, x: &Tensor, ctx: &mut ForwardCtx) -> Result<(Tensor, Option<Saved>)> {
        if !ctx.training() {
            return Ok((x.clone(), None));
        }
        let offset = ctx.take_offsets(x.numel() as u64);
        let y = ops::dropout(x, self.p, ctx.seed, offset)?;
        Ok((y, Some(Box::new(DropoutSaved { seed: ctx.seed, offset }))))
    }

    fn backward(&mut self, saved: Saved, dy: &Tensor, want: bool) -> Result<Option<Tensor>> {
        let s = unpack::<DropoutSaved>(saved, "Dropout::backward")?;
        if !want {
            return Ok(None);
        }
        ops::dropout_backward(dy, self.p, s.seed, s.offset).map(Some)
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

/// Layer normalization over the last dimension with a learned scale and shift.
#[derive(Debug)]
pub struct LayerNorm {
    gamma: Param,
    beta: Param,
    eps: f32,
    device: Device,
}

/// What [`LayerNorm`] keeps for backward.
struct NormSaved {
    x: Tensor,
    mean: Tensor,
    rstd: Tensor,
}

impl LayerNorm {
    /// A layer norm over `d` features with scale 1, shift 0 and `eps = 1e-5`.
    ///
    /// # Errors
    ///
    /// Out of memory.
    pub fn new(device: &Device, d: usize, dtype: DType) -> Result<Self> {
        Ok(LayerNorm {
            gamma: Param::new("gamma", Tensor::full(device, &[d], dtype, 1.0)?),
            beta: Param::new("beta", Tensor::zeros(device, &[d], dtype)?),
            eps: 1e-5,
            device: device.clone(),
        })
    }

    fn run(&self, x: &Tensor, ctx: &ForwardCtx) -> Result<(Tensor, Option<NormSaved>)> {
        let out = ops::layer_norm(x, &self.gamma.value, &self.beta.value, self.eps)?;
        let saved = match save_input(x, ctx)? {
            Some(x) => Some(NormSaved { x, mean: out.mean, rstd: out.rstd }),
            None => None,
        };
        Ok((out.y, saved))
    }

    fn grads(&mut self, s: NormSaved, dy: &Tensor) -> Result<Tensor> {
        let g = ops::layer_norm_backward(&s.x, &self.gamma.value, &s.mean, &s.rstd, dy)?;
        drop(s);
        self.gamma.accumulate_grad(g.dgamma)?;
        self.beta.accumulate_grad(g.dbeta)?;
        Ok(g.dx)
    }
}

impl Layer for LayerNorm {
    fn name(&self) -> String {
        format!("LayerNorm({})", self.gamma.value.numel())
    }

    fn forward(&mut self, x: &Tensor, ctx: &mut ForwardCtx) -> Result<(Tensor, Option<Saved>)> {
        let (y, saved) = self.run(x, ctx)?;
        Ok((y, saved.map(|s| Box::new(s) as Saved)))
    }

    fn backward(&mut self, saved: Saved, dy: &Tensor, want: bool) -> Result<Option<Tensor>> {
        let s = unpack::<NormSaved>(saved, "LayerNorm::backward")?;
        let dx = self.grads(*s, dy)?;
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

/// A pre-norm residual MLP block, one layer of a chain:
/// `y = x + dropout(fc2(gelu(fc1(layer_norm(x)))))`, `[.., d] -> [.., d]`.
#[derive(Debug)]
pub struct ResidualMlp {
    norm: LayerNorm,
    fc1: Linear,
    fc2: Linear,
    p: f32,
}

/// What [`ResidualMlp`] keeps for backward. The block owns its intermediates, so it moves
/// them here instead of copying.
struct MlpSaved {
    norm: NormSaved,
    normed: Tensor,
    hidden: Tensor,
    activated: Tensor,
    dropout: Option<DropoutSaved>,
}

impl ResidualMlp {
    /// A block of width `d` with a hidden layer of `hidden` units and dropout `p` on the
    /// branch (0 for none), weights drawn from `seed`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] unless `0 <= p < 1`; out of memory.
    pub fn new(
        device: &Device,
        d: usize,
        hidden: usize,
        p: f32,
        dtype: DType,
        seed: u64,
    ) -> Result<Self> {
        Dropout::new(device, p)?;
        Ok(ResidualMlp {
            norm: LayerNorm::new(device, d, dtype)?,
            fc1: Linear::new(device, d, hidden, dtype, seed)?,
            fc2: Linear::new(device, hidden, d, dtype, seed.wrapping_add(0x9E37_79B9))?,
            p,
        })
    }
}

impl Layer for ResidualMlp {
    fn name(&self) -> String {
        let s = self.fc1.weight.value.shape();
        format!("ResidualMlp({}, {}, p={})", s[1], s[0], self.p)
    }

    fn forward(&mut self, x: &Tensor, ctx: &mut ForwardCtx) -> Result<(Tensor, Option<Saved>)> {
        let (normed, norm) = self.norm.run(x, ctx)?;
        let hidden = ops::linear(&normed, &self.fc1.weight.value, Some(&self.fc1.bias.value))?;
        let activated = ops::gelu(&hidden)?;
        let mut branch =
            ops::linear(&activated, &self.fc2.weight.value, Some(&self.fc2.bias.value))?;
        let dropout = if ctx.training() && self.p > 0.0 {
            let offset = ctx.take_offsets(branch.numel() as u64);
            branch = ops::dropout(&branch, self.p, ctx.seed, offset)?;
            Some(DropoutSaved { seed: ctx.seed, offset })
        } else {
            None
        };
        let y = ops::add(x, &branch)?;
        let saved = norm
            .map(|norm| Box::new(MlpSaved { norm, normed, hidden, activated, dropout }) as Saved);
        Ok((y, saved))
    }

    fn backward(&mut self, saved: Saved, dy: &Tensor, want: bool) -> Result<Option<Tensor>> {
        let s = *unpack::<MlpSaved>(saved, "ResidualMlp::backward")?;
        let dbranch = match &s.dropout {
            Some(d) => Some(ops::dropout_backward(dy, self.p, d.seed, d.offset)?),
            None => None,
        };
        let g2 = ops::linear_backward(
            &s.activated,
            &self.fc2.weight.value,
            dbranch.as_ref().unwrap_or(dy),
            true,
        )?;
        drop((dbranch, s.activated));
        self.fc2.weight.accumulate_grad(g2.dw)?;
        if let Some(db) = g2.dbias {
            self.fc2.bias.accumulate_grad(db)?;
        }
        let dhidden = ops::gelu_backward(&s.hidden, &g2.dx)?;
        drop((g2.dx, s.hidden));
        let g1 = ops::linear_backward(&s.normed, &self.fc1.weight.value, &dhidden, true)?;
        drop((dhidden, s.normed));
        self.fc1.weight.accumulate_grad(g1.dw)?;
        if let Some(db) = g1.dbias {
            self.fc1.bias.accumulate_grad(db)?;
        }
        let mut dx = self.norm.grads(s.norm, &g1.dx)?;
        drop(g1.dx);
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
