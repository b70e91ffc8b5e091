//! The Llama family's layers (Llama, Mistral, Qwen2, TinyLlama): [`RmsNorm`] and the
//! decoder block [`LlamaBlock`] of Hugging Face's `modeling_llama.py`: input RMS norm,
//! query/key/value projections (biased for Qwen2), rotary embeddings, causal grouped-query
//! attention, output projection and residual; post-attention RMS norm, the SiLU-gated MLP
//! (`down(silu(gate(x)) * up(x))`) and residual. Tokens are rows: a batch of `b` sequences
//! of `s` tokens of width `d` is `[b * s, d]`.
//!
//! Attention is the fused op ([`ops::attention`], HF's `sdpa` implementation: the output
//! and each row's logsumexp kept, nothing of size seq x seq) or, with
//! [`Attention::Explicit`], the explicit form (scores, causal softmax, product with the
//! values: HF's `eager`). The fused op attends grouped (PyTorch's `enable_gqa`): it reads
//! the rotated projections as they are (tokens-major, no head permutation) and each key and
//! value head where it is, where HF's `repeat_kv` copies them to every query head (the
//! explicit form does, as HF's `eager` and `sdpa` both do, and sums the copies' gradients
//! back).

use super::{
    Attention, HEADS_FIRST, Init, Linear, LinearConfig, add_promoted, dx_of, invalid, merge_heads,
    positive, prefix_param_names, saved, split_heads, sub_seed,
};
use crate::autocast::{OpKind, accumulate_grad_cast, cast, cast_into};
use crate::error::Result;
use crate::layer::{ForwardCtx, Layer, Param};
use vram_kernels::ops::RopeScaling;
use vram_kernels::{DType, Device, Tensor, ops};

/// The settings of an [`RmsNorm`] layer.
#[derive(Clone, Debug, PartialEq)]
pub struct RmsNormConfig {
    /// Features normalized over (the last dimension).
    pub d: usize,
    /// Added to the mean square (HF's `rms_norm_eps`; default 1e-6).
    pub eps: f32,
    /// The dtype of the weight (default f32).
    pub dtype: DType,
}

impl RmsNormConfig {
    /// A norm over `d` features, `eps = 1e-6`, f32.
    pub fn new(d: usize) -> Self {
        RmsNormConfig { d, eps: 1e-6, dtype: DType::F32 }
    }

    /// The same with the weight in `dtype`.
    pub fn with_dtype(self, dtype: DType) -> Self {
        RmsNormConfig { dtype, ..self }
    }

    /// The same with `eps`.
    pub fn with_eps(self, eps: f32) -> Self {
        RmsNormConfig { eps, ..self }
    }

    /// An RMS norm with weight 1 on `device`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) unless `eps` is finite and > 0 and `d > 0`; out of memory.
    pub fn init(&self, device: &Device) -> Result<RmsNorm> {
        positive("RmsNormConfig", "d", self.d)?;
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(invalid(
                "RmsNormConfig::eps",
                format!("must be finite and > 0, got {}", self.eps),
            ));
        }
        Ok(RmsNorm {
            weight: Param::new("weight", Tensor::full(device, &[self.d], self.dtype, 1.0)?),
            eps: self.eps,
            device: device.clone(),
        })
    }
}

/// RMS normalization over the last dimension with a learned scale (HF's `LlamaRMSNorm`).
/// Built from an [`RmsNormConfig`].
#[derive(Debug)]
pub struct RmsNorm {
    weight: Param,
    eps: f32,
    device: Device,
}

/// What [`RmsNorm`] keeps for backward: its input (as normalized: promoted to the weight's
/// dtype) and the row statistics.
#[derive(Debug)]
pub struct RmsSaved {
    x: Tensor,
    rstd: Tensor,
    /// The input's own dtype when it was promoted.
    in_dtype: Option<DType>,
}

impl RmsNorm {
    /// `y` and, in training, what backward needs. HF's norm computes in f32 and multiplies
    /// by the weight, so an input of another dtype than the weight's is promoted to the
    /// weight's (f32 weights under autocast: f32 out, as HF's `weight * x.to(dtype)`).
    fn run(&self, x: &Tensor, ctx: &ForwardCtx) -> Result<(Tensor, Option<RmsSaved>)> {
        let w = &self.weight.value;
        let (xc, in_dtype) = if x.dtype() == w.dtype() {
            (x.clone(), None)
        } else {
            (cast(x, w.dtype())?, Some(x.dtype()))
        };
        let out = ops::rms_norm(&xc, w, self.eps)?;
        let saved = ctx.training().then(|| RmsSaved { x: xc, rstd: out.rstd, in_dtype });
        Ok((out.y, saved))
    }

    fn grads(&mut self, s: RmsSaved, dy: &Tensor) -> Result<Tensor> {
        let dy = cast(dy, s.x.dtype())?;
        let g = ops::rms_norm_backward(&s.x, &self.weight.value, &s.rstd, &dy)?;
        let in_dtype = s.in_dtype;
        drop((s, dy));
        accumulate_grad_cast(&mut self.weight, g.dweight)?;
        match in_dtype {
            Some(d) if d != g.dx.dtype() => Ok(g.dx.to_dtype(d)?),
            _ => Ok(g.dx),
        }
    }
}

impl Layer for RmsNorm {
    type Saved = RmsSaved;

    fn name(&self) -> String {
        format!("RmsNorm({})", self.weight.value.numel())
    }

    fn forward(&mut self, x: &Tensor, ctx: &mut ForwardCtx) -> Result<(Tensor, Option<RmsSaved>)> {
        self.run(x, ctx)
    }

    fn backward(&mut self, s: RmsSaved, dy: Tensor, want: bool) -> Result<Option<Tensor>> {
        let dx = self.grads(s, &dy)?;
        Ok(want.then_some(dx))
    }

    fn params(&self) -> Vec<&Param> {
        vec![&self.weight]
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        vec![&mut self.weight]
    }

    fn device(&self) -> &Device {
        &self.device
    }
}

/// The rotary tables of a model: `cos` and `sin`, `[seq, head_dim / 2]` f32 each, shared by
/// all its blocks (clones share the memory), as HF computes one `(cos, sin)` per forward for
/// every layer.
#[derive(Clone, Debug)]
pub struct RopeTables {
    /// `cos(t * inv_freq[i])`.
    pub cos: Tensor,
    /// `sin(t * inv_freq[i])`.
    pub sin: Tensor,
}

impl RopeTables {
    /// The tables of positions `0..seq` for heads of `head_dim` features, base `theta`,
    /// frequencies scaled by `scaling` ([`ops::rope_tables`]); on a virtual device only
    /// allocated.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for an odd or zero head width or `seq == 0`; out of memory.
    pub fn new(
        device: &Device,
        seq: usize,
        head_dim: usize,
        theta: f32,
        scaling: RopeScaling,
    ) -> Result<RopeTables> {
        positive("RopeTables", "seq", seq)?;
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(invalid("RopeTables", format!("head width {head_dim} is not even")));
        }
        let shape = [seq, head_dim / 2];
        if device.is_virtual() {
            return Ok(RopeTables {
                cos: Tensor::zeros(device, &shape, DType::F32)?,
                sin: Tensor::zeros(device, &shape, DType::F32)?,
            });
        }
        let (c, s) = ops::rope_tables(seq, head_dim, theta, scaling);
        Ok(RopeTables {
            cos: Tensor::from_f32_slice(device, &shape, &c, DType::F32)?,
            sin: Tensor::from_f32_slice(device, &shape, &s, DType::F32)?,
        })
    }
}

/// The settings of a [`LlamaBlock`] (HF's `LlamaConfig` names in the comments).
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaBlockConfig {
    /// Width of a token (`hidden_size`).
    pub d: usize,
    /// Query heads (`num_attention_heads`).
    pub heads: usize,
    /// Key and value heads (`num_key_value_heads`; a divisor of `heads`).
    pub kv_heads: usize,
    /// Features per head (`head_dim`; default `d / heads`).
    pub head_dim: usize,
    /// Hidden units of the gated MLP (`intermediate_size`).
    pub hidden: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// `rms_norm_eps` (default 1e-6).
    pub eps: f32,
    /// `rope_theta` (default 10000).
    pub rope_theta: f32,
    /// `rope_scaling` (default none).
    pub rope_scaling: RopeScaling,
    /// Biases on the query, key and value projections (Qwen2; `attention_bias`).
    pub qkv_bias: bool,
    /// Standard deviation of the weights (`initializer_range`, default 0.02).
    pub init_std: f32,
    /// The dtype of the parameters (default f32).
    pub dtype: DType,
    /// Seed of the weight initialization (default 0).
    pub seed: u64,
    /// How attention is computed (default [`Attention::Fused`], as HF's `sdpa`
    /// implementation, PyTorch's `scaled_dot_product_attention`, without its `repeat_kv`:
    /// grouped).
    pub attention: Attention,
    /// Whether the MLP's SiLU output and its product with `up` (the down projection's
    /// input) are recomputed in backward from the gate and up outputs kept anyway, instead
    /// of kept from forward (default true): `2 * [b * seq, hidden]` less per block between
    /// forward and backward, for a SiLU and a product over them in backward, as
    /// `torch.compile`'s partitioner trades pointwise ops. Bit for bit the kept tensors'
    /// gradients (the same kernels recompute the same values).
    pub recompute_activation: bool,
}

impl LlamaBlockConfig {
    /// A block of width `d`, `heads` query and `kv_heads` key/value heads of `d / heads`
    /// features, an MLP of `hidden` units, for sequences of `seq` tokens; eps 1e-6, theta
    /// 10000 unscaled, no biases, std 0.02, f32, seed 0.
    pub fn new(d: usize, heads: usize, kv_heads: usize, hidden: usize, seq: usize) -> Self {
        LlamaBlockConfig {
            d,
            heads,
            kv_heads,
            head_dim: d / heads.max(1),
            hidden,
            seq,
            eps: 1e-6,
            rope_theta: 10_000.0,
            rope_scaling: RopeScaling::Default,
            qkv_bias: false,
            init_std: 0.02,
            dtype: DType::F32,
            seed: 0,
            attention: Attention::Fused,
            recompute_activation: true,
        }
    }

    /// The same with the MLP's SiLU output and gated product recomputed in backward, or kept
    /// ([`LlamaBlockConfig::recompute_activation`]).
    pub fn with_recompute_activation(self, recompute_activation: bool) -> Self {
        LlamaBlockConfig { recompute_activation, ..self }
    }

    /// The same attending with `attention` ([`Attention::Explicit`]: HF's `eager`
    /// implementation, which keeps the `[b * heads, seq, seq]` probabilities).
    pub fn with_attention(self, attention: Attention) -> Self {
        LlamaBlockConfig { attention, ..self }
    }

    /// The same with heads of `head_dim` features.
    pub fn with_head_dim(self, head_dim: usize) -> Self {
        LlamaBlockConfig { head_dim, ..self }
    }

    /// The same with `rms_norm_eps` `eps`.
    pub fn with_eps(self, eps: f32) -> Self {
        LlamaBlockConfig { eps, ..self }
    }

    /// The same with rotary base `theta` and `scaling`.
    pub fn with_rope(self, theta: f32, scaling: RopeScaling) -> Self {
        LlamaBlockConfig { rope_theta: theta, rope_scaling: scaling, ..self }
    }

    /// The same with or without biases on the query, key and value projections.
    pub fn with_qkv_bias(self, qkv_bias: bool) -> Self {
        LlamaBlockConfig { qkv_bias, ..self }
    }

    /// The same with weights of standard deviation `std`.
    pub fn with_init(self, std: f32) -> Self {
        LlamaBlockConfig { init_std: std, ..self }
    }

    /// The same with parameters in `dtype`.
    pub fn with_dtype(self, dtype: DType) -> Self {
        LlamaBlockConfig { dtype, ..self }
    }

    /// The same with weights drawn from `seed`.
    pub fn with_seed(self, seed: u64) -> Self {
        LlamaBlockConfig { seed, ..self }
    }

    /// Parameters of one block: `2 d` of norms, `d * dh * (heads + 2 kv_heads)` of query,
    /// key and value (plus `dh * (heads + 2 kv_heads)` of biases), `heads * dh * d` of the
    /// output projection, `3 d hidden` of the MLP: HF's count.
    pub fn param_count(&self) -> u64 {
        let (d, dh) = (self.d as u64, self.head_dim as u64);
        let qkv = dh * (self.heads + 2 * self.kv_heads) as u64;
        let bias = if self.qkv_bias { qkv } else { 0 };
        2 * d + d * qkv + bias + self.heads as u64 * dh * d + 3 * d * self.hidden as u64
    }

    /// The block on `device` with its own rotary tables.
    ///
    /// # Errors
    ///
    /// As [`LlamaBlockConfig::init_with_tables`].
    pub fn init(&self, device: &Device) -> Result<LlamaBlock> {
        let tables =
            RopeTables::new(device, self.seq, self.head_dim, self.rope_theta, self.rope_scaling)?;
        self.init_with_tables(device, &tables)
    }

    /// The block on `device`, rotating with `tables` (shared with the model's other blocks):
    /// HF's parameter layout and names (`input_layernorm`, `self_attn.{q,k,v,o}_proj`,
    /// `post_attention_layernorm`, `mlp.{gate,up,down}_proj`), weights normal with
    /// `init_std`, biases zero, norms one.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a zero size, query heads that are not whole groups of
    /// key/value heads, an odd head width, or tables of another shape; out of memory.
    pub fn init_with_tables(&self, device: &Device, tables: &RopeTables) -> Result<LlamaBlock> {
        const WHAT: &str = "LlamaBlockConfig";
        for (name, v) in [
            ("d", self.d),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("hidden", self.hidden),
            ("seq", self.seq),
        ] {
            positive(WHAT, name, v)?;
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(invalid(
                WHAT,
                format!(
                    "{} query heads are not whole groups of {} key/value heads",
                    self.heads, self.kv_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(invalid(WHAT, format!("head width {} is not even", self.head_dim)));
        }
        let want = [self.seq, self.head_dim / 2];
        if tables.cos.shape() != want || tables.sin.shape() != want {
            return Err(invalid(
                WHAT,
                format!(
                    "rotary tables of shape {:?}, the block needs {want:?}",
                    tables.cos.shape()
                ),
            ));
        }
        let (d, dh) = (self.d, self.head_dim);
        let linear = |i, o, bias, part, name| -> Result<Linear> {
            let mut l = LinearConfig::new(i, o)
                .with_bias(bias)
                .with_init(Init::Normal { std: self.init_std })
                .with_dtype(self.dtype)
                .with_seed(sub_seed(self.seed, part))
                .init(device)?;
            prefix_param_names(&mut l, name);
            Ok(l)
        };
        let norm = |name| -> Result<RmsNorm> {
            let mut n =
                RmsNormConfig::new(d).with_eps(self.eps).with_dtype(self.dtype).init(device)?;
            prefix_param_names(&mut n, name);
            Ok(n)
        };
        let b = self.qkv_bias;
        Ok(LlamaBlock {
            norm1: norm("input_layernorm")?,
            q: linear(d, self.heads * dh, b, 0, "self_attn.q_proj")?,
            k: linear(d, self.kv_heads * dh, b, 1, "self_attn.k_proj")?,
            v: linear(d, self.kv_heads * dh, b, 2, "self_attn.v_proj")?,
            o: linear(self.heads * dh, d, false, 3, "self_attn.o_proj")?,
            norm2: norm("post_attention_layernorm")?,
            gate: linear(d, self.hidden, false, 4, "mlp.gate_proj")?,
            up: linear(d, self.hidden, false, 5, "mlp.up_proj")?,
            down: linear(self.hidden, d, false, 6, "mlp.down_proj")?,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: dh,
            seq: self.seq,
            tables: tables.clone(),
            attention: self.attention,
            recompute_activation: self.recompute_activation,
        })
    }
}

/// A Llama decoder layer on `[b * seq, d]` (HF's `LlamaDecoderLayer`):
/// `x2 = x + o(attn(rope(q(n1(x))), rope(k(n1(x))), v(n1(x))))`,
/// `y = x2 + down(silu(gate(n2(x2))) * up(n2(x2)))`, causal grouped-query attention.
/// Built from a [`LlamaBlockConfig`].
///
/// Training keeps the norms' inputs, the projections' inputs, the rotated queries and keys
/// and the values, the fused attention's output (also the output projection's input: the
/// heads merge by a reshape) and each row's logsumexp, and the MLP's gate and up outputs
/// (its SiLU output and the gated product, the down projection's input, are recomputed from
/// them in backward; [`LlamaBlockConfig::with_recompute_activation`]`(false)` keeps them, as
/// PyTorch's eager mode does). HF's `sdpa` attention keeps the keys and values repeated to every query head
/// (`repeat_kv`) instead: `heads / kv_heads` times theirs. With [`Attention::Explicit`]
/// (HF's `eager`) the block keeps what `eager` keeps: the rotated per-head queries, the
/// repeated keys and values (`[b * heads, seq, dh]`), the probabilities (`[b * heads, seq,
/// seq]`) and the merged attention output.
#[derive(Debug)]
pub struct LlamaBlock {
    norm1: RmsNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    norm2: RmsNorm,
    gate: Linear,
    up: Linear,
    down: Linear,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    seq: usize,
    tables: RopeTables,
    attention: Attention,
    recompute_activation: bool,
}

/// What the attention keeps for backward: the queries, keys and values as attended (fused:
/// tokens-major, the keys and values not repeated; explicit: per head, repeated), and the
/// fused op's output and logsumexp or the explicit form's probabilities.
#[derive(Debug)]
pub struct AttnSaved {
    qh: Tensor,
    kh: Tensor,
    vh: Tensor,
    form: AttnForm,
}

/// The part of [`AttnSaved`] that depends on the attention's form.
#[derive(Debug)]
enum AttnForm {
    /// [`ops::attention`]'s output and logsumexp (nothing of size seq x seq).
    Fused(ops::AttentionOutput),
    /// The probabilities and the left operand of `p @ v` as multiplied (under autocast,
    /// the 16-bit copy).
    Explicit { probs: Tensor, pv_lhs: Tensor },
}

/// What a [`LlamaBlock`] keeps for backward.
#[derive(Debug)]
pub struct LlamaSaved {
    n1: RmsSaved,
    sq: super::AffineSaved,
    sk: super::AffineSaved,
    sv: super::AffineSaved,
    /// The dtype of the q/k/v projections' outputs (their gradients go back in it).
    qkv_dtype: DType,
    attn: AttnSaved,
    so: super::AffineSaved,
    branch1: DType,
    n2: RmsSaved,
    sg: super::AffineSaved,
    su: super::AffineSaved,
    gate: Tensor,
    up: Tensor,
    /// `silu(gate)`, unless recomputed in backward.
    act: Option<Tensor>,
    /// The down projection's state; its input, `act * up`, released when `act` is.
    sd: super::AffineSaved,
    branch2: DType,
}

impl LlamaBlock {
    /// The rows of `x` as whole sequences: the batch.
    fn batch_of(&self, x: &Tensor) -> Result<usize> {
        let rows = x.shape().first().copied().unwrap_or(0);
        if x.rank() != 2 || !rows.is_multiple_of(self.seq) {
            return Err(invalid(
                "LlamaBlock",
                format!("expected [b * {}, d] tokens, got shape {:?}", self.seq, x.shape()),
            ));
        }
        Ok(rows / self.seq)
    }

    /// `[b * s, h * dh]` -> rotated `[b * h, s, dh]`.
    fn rotate_heads(&self, t: Tensor, b: usize, h: usize) -> Result<Tensor> {
        let (s, dh) = (self.seq, self.head_dim);
        let r = ops::rope(&t.reshape(&[b, s, h, dh])?, &self.tables.cos, &self.tables.sin)?;
        Ok(ops::permute(&r, &HEADS_FIRST)?.reshape(&[b * h, s, dh])?)
    }

    /// The gradient of [`Self::rotate_heads`]: `[b * h, s, dh]` -> `[b * s, h * dh]`.
    fn unrotate(&self, t: Tensor, b: usize, h: usize) -> Result<Tensor> {
        let (s, dh) = (self.seq, self.head_dim);
        let t = ops::permute(&t.reshape(&[b, h, s, dh])?, &HEADS_FIRST)?;
        let r = ops::rope_backward(&t, &self.tables.cos, &self.tables.sin)?;
        Ok(r.reshape(&[b * s, h * dh])?)
    }

    /// `[b * s, h * dh]` -> `[b * h, s, dh]`.
    fn split_heads(&self, t: Tensor, b: usize, h: usize) -> Result<Tensor> {
        split_heads(t, b, self.seq, h, self.head_dim)
    }

    /// `[b * h, s, dh]` -> `[b * s, h * dh]`.
    fn merge_heads(&self, t: Tensor, b: usize, h: usize) -> Result<Tensor> {
        merge_heads(t, b, self.seq, h, self.head_dim)
    }

    /// The source key/value head of each query head, batch by batch: HF's `repeat_kv`
    /// (`[b, kv, s, dh] -> [b, kv * rep, s, dh]`, each key/value head `rep` times in a row).
    fn kv_rows(&self, b: usize) -> Vec<u32> {
        let rep = self.heads / self.kv_heads;
        (0..b * self.heads)
            .map(|i| ((i / self.heads) * self.kv_heads + (i % self.heads) / rep) as u32)
            .collect()
    }

    /// `[b * kv, s, dh] -> [b * heads, s, dh]` (a copy; nothing to do without grouping).
    fn repeat_kv(&self, t: Tensor, b: usize) -> Result<Tensor> {
        if self.heads == self.kv_heads {
            return Ok(t);
        }
        let (s, dh) = (self.seq, self.head_dim);
        let rows = ops::embedding(&t.reshape(&[b * self.kv_heads, s * dh])?, &self.kv_rows(b))?;
        Ok(rows.reshape(&[b * self.heads, s, dh])?)
    }

    /// The gradient of [`Self::repeat_kv`]: each key/value head's copies summed.
    fn repeat_kv_backward(&self, d: Tensor, b: usize) -> Result<Tensor> {
        if self.heads == self.kv_heads {
            return Ok(d);
        }
        let (s, dh) = (self.seq, self.head_dim);
        let flat = d.reshape(&[b * self.heads, s * dh])?;
        let g = ops::embedding_backward(&self.kv_rows(b), &flat, b * self.kv_heads)?;
        Ok(g.reshape(&[b * self.kv_heads, s, dh])?)
    }

    /// The fused op's settings: causal, tokens-major, grouped.
    fn fused_params() -> ops::AttentionParams {
        ops::AttentionParams::new(true).tokens_major().grouped()
    }

    /// Fused causal attention of the `[b * s, heads * dh]` query and `[b * s, kv_heads * dh]`
    /// key and value projections, read tokens-major (`[b, s, heads, dh]`) and grouped: the
    /// queries and keys rotated, nothing permuted or repeated. Returns the output as `[b * s,
    /// heads * dh]` (a reshape of what the op keeps) and what the backward needs.
    fn attend_fused(
        &self,
        [q, k, v]: [Tensor; 3],
        b: usize,
        ctx: &ForwardCtx,
    ) -> Result<(Tensor, AttnSaved)> {
        let (s, dh) = (self.seq, self.head_dim);
        let (cos, sin) = (&self.tables.cos, &self.tables.sin);
        let qh = ops::rope(&q.reshape(&[b, s, self.heads, dh])?, cos, sin)?;
        let kh = ops::rope(&k.reshape(&[b, s, self.kv_heads, dh])?, cos, sin)?;
        let vh = v.reshape(&[b, s, self.kv_heads, dh])?;
        // As autocast runs scaled_dot_product_attention: every input in the low dtype.
        let qkv = qh.dtype();
        let mm = ctx.op_dtype(OpKind::Matmul, &[qkv]).unwrap_or(qkv);
        let (qh, kh, vh) = (cast_into(qh, mm)?, cast_into(kh, mm)?, cast_into(vh, mm)?);
        let fwd = ops::attention(&qh, &kh, &vh, &Self::fused_params())?;
        let out = fwd.out.clone().reshape(&[b * s, self.heads * dh])?;
        Ok((out, AttnSaved { qh, kh, vh, form: AttnForm::Fused(fwd) }))
    }

    /// A gradient of the attention's queries (`h` = heads, rotated), keys (`kv_heads`,
    /// rotated) or values (`kv_heads`, not) as the projection's `[b * s, h * dh]` rows: fused,
    /// tokens-major and not repeated, so only the rotation's backward (values: a reshape);
    /// explicit, per head and repeated, so the copies summed, then un-permuted.
    fn grad_rows(
        &self,
        g: Tensor,
        b: usize,
        h: usize,
        rotated: bool,
        fused: bool,
    ) -> Result<Tensor> {
        let (s, dh) = (self.seq, self.head_dim);
        let g = match (fused, h == self.heads) {
            (true, _) => {
                let g = if rotated {
                    ops::rope_backward(&g, &self.tables.cos, &self.tables.sin)?
                } else {
                    g
                };
                return Ok(g.reshape(&[b * s, h * dh])?);
            }
            (false, true) => g,
            (false, false) => self.repeat_kv_backward(g, b)?,
        };
        if rotated { self.unrotate(g, b, h) } else { self.merge_heads(g, b, h) }
    }

    /// Causal scaled dot-product attention of `[b * heads, s, dh]` queries, keys and values
    /// (the keys and values already repeated to the query heads), explicit: scores, causal
    /// softmax, product with the values.
    fn attend_explicit(
        &self,
        qh: Tensor,
        kh: Tensor,
        vh: Tensor,
        ctx: &ForwardCtx,
    ) -> Result<(Tensor, AttnSaved)> {
        let qkv = qh.dtype();
        let mm = ctx.op_dtype(OpKind::Matmul, &[qkv]).unwrap_or(qkv);
        let (qh, kh) = (cast_into(qh, mm)?, cast_into(kh, mm)?);
        let scale = 1.0 / (self.head_dim as f32).sqrt();
        let scores = ops::scale(&ops::matmul(&qh, &kh, false, true)?, scale)?;
        let sm = ctx.op_dtype(OpKind::Softmax, &[scores.dtype()]).unwrap_or(scores.dtype());
        let scores = cast_into(scores, sm)?;
        let probs = ops::causal_softmax(&scores)?;
        drop(scores);
        let pv = ctx.op_dtype(OpKind::Matmul, &[probs.dtype(), vh.dtype()]);
        let pv = pv.unwrap_or(probs.dtype());
        let (pv_lhs, vh) = (cast(&probs, pv)?, cast_into(vh, pv)?);
        let out = ops::matmul(&pv_lhs, &vh, false, false)?;
        Ok((out, AttnSaved { qh, kh, vh, form: AttnForm::Explicit { probs, pv_lhs } }))
    }

    /// The gradients of [`Self::attention`]'s queries, keys and values from `dout`.
    fn attention_backward(&self, s: AttnSaved, dout: Tensor) -> Result<[Tensor; 3]> {
        let AttnSaved { qh, kh, vh, form } = s;
        let (probs, pv_lhs) = match form {
            AttnForm::Fused(fwd) => {
                let dout = cast_into(dout, qh.dtype())?;
                let g = ops::attention_backward(&qh, &kh, &vh, &fwd, &dout, &Self::fused_params())?;
                return Ok([g.dq, g.dk, g.dv]);
            }
            AttnForm::Explicit { probs, pv_lhs } => (probs, pv_lhs),
        };
        let dout = cast_into(dout, pv_lhs.dtype())?;
        let (dlhs, dvh) = ops::matmul_backward(&pv_lhs, &vh, &dout, false, false)?;
        drop((dout, pv_lhs, vh));
        let dprobs = cast_into(dlhs, probs.dtype())?;
        let dscores = ops::causal_softmax_backward(&probs, &dprobs)?;
        drop((dprobs, probs));
        let dscores = cast_into(dscores, qh.dtype())?;
        let scaled = ops::scale(&dscores, 1.0 / (self.head_dim as f32).sqrt())?;
        drop(dscores);
        let (dqh, dkh) = ops::matmul_backward(&qh, &kh, &scaled, false, true)?;
        Ok([dqh, dkh, dvh])
    }
}

impl Layer for LlamaBlock {
    type Saved = LlamaSaved;

    fn name(&self) -> String {
        let d = self.q.weight().value.shape().get(1).copied().unwrap_or(0);
        format!("LlamaBlock(d={d}, heads={}, kv_heads={})", self.heads, self.kv_heads)
    }

    fn forward(
        &mut self,
        x: &Tensor,
        ctx: &mut ForwardCtx,
    ) -> Result<(Tensor, Option<LlamaSaved>)> {
        const WHAT: &str = "LlamaBlock";
        let b = self.batch_of(x)?;
        let (h1, n1) = self.norm1.run(x, ctx)?;
        let (q, sq) = self.q.forward(&h1, ctx)?;
        let (k, sk) = self.k.forward(&h1, ctx)?;
        let (v, sv) = self.v.forward(&h1, ctx)?;
        drop(h1);
        let qkv_dtype = q.dtype();
        let (merged, attn) = if self.attention == Attention::Fused {
            self.attend_fused([q, k, v], b, ctx)?
        } else {
            let qh = self.rotate_heads(q, b, self.heads)?;
            let kh = self.repeat_kv(self.rotate_heads(k, b, self.kv_heads)?, b)?;
            let vh = self.repeat_kv(self.split_heads(v, b, self.kv_heads)?, b)?;
            let (out, attn) = self.attend_explicit(qh, kh, vh, ctx)?;
            (self.merge_heads(out, b, self.heads)?, attn)
        };
        let (o, so) = self.o.forward(&merged, ctx)?;
        drop(merged);
        let branch1 = o.dtype();
        let x2 = add_promoted(x, &o)?;
        drop(o);
        let (h2, n2) = self.norm2.run(&x2, ctx)?;
        let (gate, sg) = self.gate.forward(&h2, ctx)?;
        let (up, su) = self.up.forward(&h2, ctx)?;
        drop(h2);
        let act = ops::silu(&gate)?;
        let m = ops::mul(&act, &up)?;
        let (dn, sd) = self.down.forward(&m, ctx)?;
        drop(m);
        let branch2 = dn.dtype();
        let y = add_promoted(&x2, &dn)?;
        if !ctx.training() {
            return Ok((y, None));
        }
        // The SiLU output and the product (the down projection's input) are recomputed in
        // backward from gate and up, kept anyway, rather than kept.
        let mut sd = saved(sd, WHAT)?;
        let act = if self.recompute_activation && sd.release_input(&gate) {
            drop(act);
            None
        } else {
            Some(act)
        };
        let s = LlamaSaved {
            n1: saved(n1, WHAT)?,
            sq: saved(sq, WHAT)?,
            sk: saved(sk, WHAT)?,
            sv: saved(sv, WHAT)?,
            qkv_dtype,
            attn,
            so: saved(so, WHAT)?,
            branch1,
            n2: saved(n2, WHAT)?,
            sg: saved(sg, WHAT)?,
            su: saved(su, WHAT)?,
            gate,
            up,
            act,
            sd,
            branch2,
        };
        Ok((y, Some(s)))
    }

    fn backward(&mut self, s: LlamaSaved, dy: Tensor, want: bool) -> Result<Option<Tensor>> {
        const WHAT: &str = "LlamaBlock";
        let b = dy.shape()[0] / self.seq;
        // y = x2 + down(silu(gate) * up)
        let dbranch = cast(&dy, s.branch2)?;
        let mut sd = s.sd;
        let act = match s.act {
            Some(act) => act,
            None => {
                let act = ops::silu(&s.gate)?;
                sd.restore_input(ops::mul(&act, &s.up)?);
                act
            }
        };
        let dm = dx_of(self.down.backward(sd, dbranch, true)?, WHAT)?;
        let dact = ops::mul(&dm, &s.up)?;
        let dup = ops::mul(&dm, &act)?;
        drop((dm, s.up, act));
        let dgate = ops::silu_backward(&s.gate, &dact)?;
        drop((dact, s.gate));
        let mut dh2 = dx_of(self.up.backward(s.su, dup, true)?, WHAT)?;
        let dh2g = dx_of(self.gate.backward(s.sg, dgate, true)?, WHAT)?;
        super::add_grad(&mut dh2, &dh2g)?;
        drop(dh2g);
        let mut dx2 = self.norm2.grads(s.n2, &dh2)?;
        drop(dh2);
        let dy_res = cast_into(dy, dx2.dtype())?;
        ops::add_assign(&mut dx2, &dy_res)?;
        drop(dy_res);
        // x2 = x + o(attn(...))
        let dbranch = cast(&dx2, s.branch1)?;
        let dmerged = dx_of(self.o.backward(s.so, dbranch, true)?, WHAT)?;
        let fused = matches!(s.attn.form, AttnForm::Fused(_));
        let dout = if fused {
            dmerged.reshape(&[b, self.seq, self.heads, self.head_dim])?
        } else {
            self.split_heads(dmerged, b, self.heads)?
        };
        let [dqh, dkh, dvh] = self.attention_backward(s.attn, dout)?;
        let qkv = s.qkv_dtype;
        let dq = cast_into(self.grad_rows(dqh, b, self.heads, true, fused)?, qkv)?;
        let mut dh1 = dx_of(self.q.backward(s.sq, dq, true)?, WHAT)?;
        let dk = cast_into(self.grad_rows(dkh, b, self.kv_heads, true, fused)?, qkv)?;
        self.k.backward_into(s.sk, dk, &mut dh1)?;
        let dv = cast_into(self.grad_rows(dvh, b, self.kv_heads, false, fused)?, qkv)?;
        self.v.backward_into(s.sv, dv, &mut dh1)?;
        let mut dx = self.norm1.grads(s.n1, &dh1)?;
        drop(dh1);
        if !want {
            return Ok(None);
        }
        let dx2 = cast_into(dx2, dx.dtype())?;
        ops::add_assign(&mut dx, &dx2)?;
        Ok(Some(dx))
    }

    fn params(&self) -> Vec<&Param> {
        let mut p = self.norm1.params();
        for l in [&self.q, &self.k, &self.v, &self.o] {
            p.extend(l.params());
        }
        p.extend(self.norm2.params());
        for l in [&self.gate, &self.up, &self.down] {
            p.extend(l.params());
        }
        p
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut p = self.norm1.params_mut();
        for l in [&mut self.q, &mut self.k, &mut self.v, &mut self.o] {
            p.extend(l.params_mut());
        }
        p.extend(self.norm2.params_mut());
        for l in [&mut self.gate, &mut self.up, &mut self.down] {
            p.extend(l.params_mut());
        }
        p
    }

    fn device(&self) -> &Device {
        self.norm1.device()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layer::Mode;
    use std::collections::HashMap;

    /// HF's decoder layer written out in f64 from the definitions (`LlamaRMSNorm`,
    /// `apply_rotary_pos_emb` with `rotate_half`, `repeat_kv`, eager causal attention, the
    /// SiLU-gated MLP), on `[b * s, d]` rows, with the weights by HF's names.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        x: &[f64],
        w: &HashMap<String, Vec<f64>>,
        (b, s, d): (usize, usize, usize),
        (heads, kv, dh, hidden): (usize, usize, usize, usize),
        eps: f64,
        theta: f64,
    ) -> Vec<f64> {
        let rms = |x: &[f64], g: &[f64]| -> Vec<f64> {
            x.chunks(d)
                .flat_map(|r| {
                    let ms = r.iter().map(|v| v * v).sum::<f64>() / d as f64;
                    let rs = 1.0 / (ms + eps).sqrt();
                    r.iter().zip(g).map(move |(v, g)| v * rs * g).collect::<Vec<_>>()
                })
                .collect()
        };
        let lin = |x: &[f64], name: &str, i: usize, o: usize| -> Vec<f64> {
            let wt = &w[&format!("{name}.weight")];
            let bias = w.get(&format!("{name}.bias"));
            x.chunks(i)
                .flat_map(|r| {
                    (0..o).map(move |j| {
                        let dot: f64 =
                            r.iter().zip(&wt[j * i..(j + 1) * i]).map(|(a, b)| a * b).sum();
                        dot + bias.map_or(0.0, |bv| bv[j])
                    })
                })
                .collect()
        };
        let half = dh / 2;
        let rope = |t: &mut [f64], h: usize| {
            for (row, chunk) in t.chunks_mut(h * dh).enumerate() {
                let pos = (row % s) as f64;
                for head in chunk.chunks_mut(dh) {
                    let orig = head.to_vec();
                    for j in 0..dh {
                        let f = 1.0 / theta.powf((2 * (j % half)) as f64 / dh as f64);
                        let (c, sn) = ((pos * f).cos(), (pos * f).sin());
                        let rot = if j < half { -orig[j + half] } else { orig[j - half] };
                        head[j] = orig[j] * c + rot * sn;
                    }
                }
            }
        };
        let h1 = rms(x, &w["input_layernorm.weight"]);
        let mut q = lin(&h1, "self_attn.q_proj", d, heads * dh);
        let mut k = lin(&h1, "self_attn.k_proj", d, kv * dh);
        let v = lin(&h1, "self_attn.v_proj", d, kv * dh);
        rope(&mut q, heads);
        rope(&mut k, kv);
        let rep = heads / kv;
        let mut attn = vec![0.0; b * s * heads * dh];
        for bi in 0..b {
            for h in 0..heads {
                let g = h / rep;
                for t in 0..s {
                    let qv = &q[(bi * s + t) * heads * dh + h * dh..][..dh];
                    let scores: Vec<f64> = (0..=t)
                        .map(|u| {
                            let kv_ = &k[(bi * s + u) * kv * dh + g * dh..][..dh];
                            qv.iter().zip(kv_).map(|(a, b)| a * b).sum::<f64>() / (dh as f64).sqrt()
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                    let e: Vec<f64> = scores.iter().map(|v| (v - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for (u, p) in e.iter().enumerate() {
                        let vv = &v[(bi * s + u) * kv * dh + g * dh..][..dh];
                        for j in 0..dh {
                            attn[(bi * s + t) * heads * dh + h * dh + j] += p / z * vv[j];
                        }
                    }
                }
            }
        }
        let o = lin(&attn, "self_attn.o_proj", heads * dh, d);
        let x2: Vec<f64> = x.iter().zip(&o).map(|(a, b)| a + b).collect();
        let h2 = rms(&x2, &w["post_attention_layernorm.weight"]);
        let gate = lin(&h2, "mlp.gate_proj", d, hidden);
        let up = lin(&h2, "mlp.up_proj", d, hidden);
        let m: Vec<f64> = gate.iter().zip(&up).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
        let dn = lin(&m, "mlp.down_proj", hidden, d);
        x2.iter().zip(&dn).map(|(a, b)| a + b).collect()
    }

    fn vals(n: usize, seed: u64) -> Vec<f32> {
        (0..n as u64)
            .map(|i| (((i * 7919 + seed * 104_729) % 4001) as f32 / 1000.25 - 2.0) * 0.5)
            .collect()
    }

    #[test]
    fn llama_block_matches_hugging_faces_definitions_forward_and_backward() {
        for attention in [Attention::Fused, Attention::Explicit] {
            block_matches_hugging_faces_definitions(attention);
        }
    }

    /// HF's `sdpa` and `eager` attention give the same numbers: both forms against the
    /// f64 reference.
    fn block_matches_hugging_faces_definitions(attention: Attention) {
        let dev = Device::host(1 << 28);
        let (b, s, d, heads, kv, hidden) = (2, 5, 16, 4, 2, 24);
        let dh = d / heads;
        let cfg = LlamaBlockConfig::new(d, heads, kv, hidden, s)
            .with_qkv_bias(true)
            .with_eps(1e-5)
            .with_init(0.2)
            .with_seed(3)
            .with_attention(attention);
        let mut block = cfg.init(&dev).unwrap();
        assert_eq!(
            block.params().iter().map(|p| p.value.numel() as u64).sum::<u64>(),
            cfg.param_count()
        );
        // Non-trivial norm weights and biases.
        for (i, p) in block.params_mut().into_iter().enumerate() {
            if p.name.ends_with("bias") || p.name.contains("layernorm") {
                let n = p.value.numel();
                let v: Vec<f32> = vals(n, 50 + i as u64).iter().map(|v| 1.0 + 0.3 * v).collect();
                p.value = Tensor::from_f32_slice(&dev, &[n], &v, DType::F32).unwrap();
            }
        }
        let weights = |block: &LlamaBlock| -> HashMap<String, Vec<f64>> {
            block
                .params()
                .iter()
                .map(|p| {
                    (
                        p.name.clone(),
                        p.value.to_f32_vec().unwrap().iter().map(|&v| f64::from(v)).collect(),
                    )
                })
                .collect()
        };
        let xv = vals(b * s * d, 1);
        let dyv = vals(b * s * d, 2);
        let x = Tensor::from_f32_slice(&dev, &[b * s, d], &xv, DType::F32).unwrap();
        let mut ctx = ForwardCtx::new(Mode::Train, 0);
        let (y, saved) = block.forward(&x, &mut ctx).unwrap();
        let w = weights(&block);
        let x64: Vec<f64> = xv.iter().map(|&v| f64::from(v)).collect();
        let dims = ((b, s, d), (heads, kv, dh, hidden));
        let want = reference(&x64, &w, dims.0, dims.1, 1e-5, 10_000.0);
        for (i, (g, w)) in y.to_f32_vec().unwrap().iter().zip(&want).enumerate() {
            assert!((f64::from(*g) - w).abs() < 1e-4 * w.abs().max(1.0), "y[{i}]: {g} vs {w}");
        }
        let dy = Tensor::from_f32_slice(&dev, &[b * s, d], &dyv, DType::F32).unwrap();
        let dx = block.backward(saved.unwrap(), dy, true).unwrap().unwrap().to_f32_vec().unwrap();
        // Central differences of sum(y * dy) in f64.
        let loss = |x: &[f64], w: &HashMap<String, Vec<f64>>| -> f64 {
            reference(x, w, dims.0, dims.1, 1e-5, 10_000.0)
                .iter()
                .zip(&dyv)
                .map(|(a, b)| a * f64::from(*b))
                .sum()
        };
        let h = 1e-5;
        for i in (0..x64.len()).step_by(7) {
            let (mut p, mut m) = (x64.clone(), x64.clone());
            p[i] += h;
            m[i] -= h;
            let fd = (loss(&p, &w) - loss(&m, &w)) / (2.0 * h);
            assert!(
                (f64::from(dx[i]) - fd).abs() < 1e-3 * fd.abs().max(1.0),
                "dx[{i}]: {} vs {fd}",
                dx[i]
            );
        }
        for p in block.params() {
            let g = p.grad.as_ref().unwrap().to_f32_vec().unwrap();
            for i in (0..g.len()).step_by(g.len() / 3 + 1) {
                let (mut wp, mut wm) = (w.clone(), w.clone());
                wp.get_mut(&p.name).unwrap()[i] += h;
                wm.get_mut(&p.name).unwrap()[i] -= h;
                let fd = (loss(&x64, &wp) - loss(&x64, &wm)) / (2.0 * h);
                assert!(
                    (f64::from(g[i]) - fd).abs() < 1e-3 * fd.abs().max(1.0),
                    "{}[{i}]: {} vs {fd}",
                    p.name,
                    g[i]
                );
            }
        }
    }

    #[test]
    fn fused_attention_keeps_no_probabilities() {
        // Bytes the forward leaves for backward: the explicit form's [b * heads, s, s]
        // probabilities are the difference, and nothing of that size is kept fused.
        let kept = |attention: Attention| {
            let dev = Device::virtual_device(1 << 34);
            let (b, s) = (2, 256);
            let cfg = LlamaBlockConfig::new(64, 8, 2, 128, s).with_attention(attention);
            let mut block = cfg.init(&dev).unwrap();
            let x = Tensor::zeros(&dev, &[b * s, 64], DType::F32).unwrap();
            // A first forward takes the cuBLAS workspace, which stays.
            drop(block.forward(&x, &mut ForwardCtx::new(Mode::Train, 0)).unwrap());
            let before = dev.memory_allocated();
            let mut ctx = ForwardCtx::new(Mode::Train, 0);
            let (y, saved) = block.forward(&x, &mut ctx).unwrap();
            drop(y);
            let kept = dev.memory_allocated() - before;
            drop(saved);
            kept
        };
        let (fused, explicit) = (kept(Attention::Fused), kept(Attention::Explicit));
        // Explicit: the f32 probabilities [b * heads, s, s] and the keys and values repeated
        // to the 8 query heads (HF's repeat_kv, [b * heads, s, dh] each). Fused: the keys and
        // values as projected ([b, s, 2, dh] each, read grouped) and the logsumexp
        // [b * heads, s] instead. Both keep the rotated queries and the attention output once.
        let probs = 2 * 8 * 256 * 256 * 4;
        let repeated = 2 * (2 * 256 * 8 * 8 - 2 * 256 * 2 * 8) * 4;
        let lse = 2 * 8 * 256 * 4;
        assert_eq!(explicit - fused, probs + repeated - lse, "fused {fused}, explicit {explicit}");
        assert!(fused < probs, "fused keeps {fused} B, a probability matrix is {probs} B");
    }

    #[test]
    fn llama_block_allocates_on_a_virtual_device_as_on_the_host() {
        let run = |dev: &Device| {
            let cfg = LlamaBlockConfig::new(32, 4, 1, 48, 8).with_seed(1);
            let mut block = cfg.init(dev).unwrap();
            let x = Tensor::zeros(dev, &[16, 32], DType::F32).unwrap();
            dev.set_blas_workspace_size(1 << 20);
            dev.record_history(Some(1 << 16));
            let mut ctx = ForwardCtx::new(Mode::Train, 0);
            let (y, s) = block.forward(&x, &mut ctx).unwrap();
            block.backward(s.unwrap(), y, true).unwrap();
            dev.trace().iter().map(|e| (e.action, e.size, e.requested)).collect::<Vec<_>>()
        };
        let host = run(&Device::host(1 << 28));
        assert!(!host.is_empty());
        assert_eq!(run(&Device::virtual_device(1 << 28)), host);
    }

    #[test]
    fn llama_block_under_bf16_autocast_follows_the_f32_block() {
        let dev = Device::host(1 << 28);
        let (rows, d) = (2 * 6, 32);
        let cfg = LlamaBlockConfig::new(d, 4, 2, 48, 6).with_init(0.1).with_seed(9);
        let x = Tensor::from_f32_slice(&dev, &[rows, d], &vals(rows * d, 3), DType::F32).unwrap();
        let run = |autocast: bool| {
            let mut block = cfg.init(&dev).unwrap();
            let mut ctx = ForwardCtx::new(Mode::Train, 0);
            if autocast {
                ctx = ctx.with_autocast(DType::BF16).unwrap();
            }
            let (y, s) = block.forward(&x, &mut ctx).unwrap();
            // The residual stream stays f32 (f32 + bf16 promotes), as in PyTorch.
            assert_eq!(y.dtype(), DType::F32);
            let dx = block.backward(s.unwrap(), y.clone(), true).unwrap().unwrap();
            assert_eq!(dx.dtype(), DType::F32);
            let g = block.params()[2].grad.as_ref().unwrap().to_f32_vec().unwrap();
            (y.to_f32_vec().unwrap(), dx.to_f32_vec().unwrap(), g)
        };
        let (full, low) = (run(false), run(true));
        for (what, a, b, tol) in [
            ("y", &full.0, &low.0, 0.05),
            ("dx", &full.1, &low.1, 0.1),
            ("dq", &full.2, &low.2, 0.1),
        ] {
            let scale = a.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            for (i, (p, q)) in a.iter().zip(b).enumerate() {
                assert!((p - q).abs() <= tol * scale, "{what}[{i}]: f32 {p}, bf16 {q}");
            }
        }
    }

    #[test]
    fn bad_block_settings_are_named() {
        let dev = Device::host(1 << 26);
        let err = LlamaBlockConfig::new(16, 4, 3, 8, 4).init(&dev).unwrap_err().to_string();
        assert!(err.contains("groups of 3"), "{err}");
        let err = RmsNormConfig::new(4).with_eps(0.0).init(&dev).unwrap_err().to_string();
        assert!(err.contains("eps"), "{err}");
    }
}
