//! Transformer layers: a pre-norm, multi-head [`TransformerBlock`] (causal for GPT, not for
//! ViT), ViT's [`PatchEmbed`] (a strided convolution into tokens plus learned positions)
//! and [`TokenMeanPool`] (the mean over a sequence's tokens). Tokens are rows: a batch of
//! `b` sequences of `s` tokens of width `d` is `[b * s, d]`.

use super::{
    Act, AffineSaved, Conv2d, Conv2dConfig, DropoutSaved, Init, LayerNorm, LayerNormConfig, Linear,
    LinearConfig, NormSaved, check_dropout, dx_of, init_weight, invalid, merge_heads, positive,
    saved, split_heads, sub_seed,
};
use crate::autocast::{OpKind, cast, cast_into};
use crate::error::Result;
use crate::layer::{ForwardCtx, Layer, Param};
use vram_kernels::{DType, Device, Tensor, ops};

/// The settings of a [`TransformerBlock`].
#[derive(Clone, Debug, PartialEq)]
pub struct TransformerBlockConfig {
    /// Width of a token.
    pub d: usize,
    /// Attention heads (`d` must be a multiple).
    pub heads: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Whether a token attends only to itself and earlier tokens (GPT; default true) or to
    /// every token (ViT, BERT).
    pub causal: bool,
    /// Dropout on the attention probabilities and on both residual branches (default 0).
    pub dropout: f32,
    /// Hidden units of the MLP per unit of width (default 4).
    pub mlp_ratio: usize,
    /// Standard deviation of the weights (default 0.02, GPT-2's); the two projections that
    /// end a residual branch get `std / sqrt(2 * depth)`.
    pub init_std: f32,
    /// Blocks in the model, for that scaling (default 1).
    pub depth: usize,
    /// The dtype of the parameters (default f32).
    pub dtype: DType,
    /// Seed of the weight initialization (default 0).
    pub seed: u64,
    /// How attention is computed (default [`Attention::Fused`]).
    pub attention: Attention,
    /// Whether each residual add runs fused with the dropout on its branch, and the first
    /// with the layer norm after it ([`ops::dropout_add_layer_norm`], [`ops::dropout_add`],
    /// [`ops::dropout_add_backward`]), and the backward's seams with them: each layer norm's
    /// backward with the shortcut's gradient (and `ln_2`'s with the attention branch's
    /// masked gradient, [`ops::layer_norm_backward_residual`]), fc1's GELU with fc2's
    /// input-gradient product ([`ops::linear_backward_gelu`]); default true. The values and
    /// gradients are the unfused composition's bit for bit on the host (the same masks, the
    /// same roundings); false runs dropout, the residual add (with autocast's f32 copy of a
    /// 16-bit branch) and the layer norm one after the other, and backward each op alone,
    /// kept for comparison.
    pub fused_residual: bool,
    /// Whether the MLP's GELU output (fc2's input) is recomputed in backward from the
    /// pre-activation fc1 keeps for GELU's derivative, instead of kept from forward (default
    /// true): `[b * seq, mlp_ratio * d]` less per block between forward and backward, for one
    /// GELU over it in backward. `torch.compile`'s partitioner makes the same trade for
    /// pointwise ops; PyTorch's eager mode keeps both. On the host the gradients are the
    /// kept output's bit for bit; on a GPU, where cuBLASLt applies the GELU to the f32 sum
    /// before rounding, fc2's weight gradient may differ by a rounding of the dtype.
    pub recompute_activation: bool,
}

/// How a [`TransformerBlock`] computes its attention. Both give the same values and the
/// same gradients (up to f32 rounding; dropout drops the same probabilities) and draw the
/// same dropout offsets, so the rest of the model sees no difference but memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Attention {
    /// [`ops::attention`]: saves the output and each row's logsumexp, nothing of size
    /// `seq x seq` (PyTorch's `F.scaled_dot_product_attention` on its flash backend).
    #[default]
    Fused,
    /// The composition PyTorch's eager attention runs (`q k^T`, softmax, dropout, `p v`):
    /// saves the `[b * heads, seq, seq]` probabilities (and their dropped copy). Kept for
    /// comparison.
    Explicit,
}

impl TransformerBlockConfig {
    /// A causal block of width `d` with `heads` heads for sequences of `seq` tokens; MLP
    /// ratio 4, no dropout, GPT-2's initialization, f32, seed 0, fused attention, fused
    /// residual adds.
    pub fn new(d: usize, heads: usize, seq: usize) -> Self {
        TransformerBlockConfig {
            d,
            heads,
            seq,
            causal: true,
            dropout: 0.0,
            mlp_ratio: 4,
            init_std: 0.02,
            depth: 1,
            dtype: DType::F32,
            seed: 0,
            attention: Attention::Fused,
            fused_residual: true,
            recompute_activation: true,
        }
    }

    /// The same with the MLP's GELU output recomputed in backward, or kept
    /// ([`TransformerBlockConfig::recompute_activation`]).
    pub fn with_recompute_activation(self, recompute_activation: bool) -> Self {
        TransformerBlockConfig { recompute_activation, ..self }
    }

    /// The same with the residual adds fused with their dropout (and the first with the
    /// second layer norm) or not.
    pub fn with_fused_residual(self, fused_residual: bool) -> Self {
        TransformerBlockConfig { fused_residual, ..self }
    }

    /// The same with attention computed as `attention` says.
    pub fn with_attention(self, attention: Attention) -> Self {
        TransformerBlockConfig { attention, ..self }
    }

    /// The same, causal or not.
    pub fn with_causal(self, causal: bool) -> Self {
        TransformerBlockConfig { causal, ..self }
    }

    /// The same with dropout `p` (attention probabilities and residual branches).
    pub fn with_dropout(self, p: f32) -> Self {
        TransformerBlockConfig { dropout: p, ..self }
    }

    /// The same with an MLP of `ratio * d` hidden units.
    pub fn with_mlp_ratio(self, ratio: usize) -> Self {
        TransformerBlockConfig { mlp_ratio: ratio, ..self }
    }

    /// The same with weights of standard deviation `std`, the residual projections scaled
    /// for a model of `depth` blocks.
    pub fn with_init(self, std: f32, depth: usize) -> Self {
        TransformerBlockConfig { init_std: std, depth, ..self }
    }

    /// The same with parameters in `dtype`.
    pub fn with_dtype(self, dtype: DType) -> Self {
        TransformerBlockConfig { dtype, ..self }
    }

    /// The same with weights drawn from `seed`.
    pub fn with_seed(self, seed: u64) -> Self {
        TransformerBlockConfig { seed, ..self }
    }

    /// The block on `device`: GPT-2's parameter layout (`12 d^2 + 13 d` with ratio 4:
    /// query, key, value and output projections with biases, two layer norms, the MLP).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a zero size, a width that is not a multiple of the
    /// heads, or a dropout outside `[0, 1)`; out of memory.
    pub fn init(&self, device: &Device) -> Result<TransformerBlock> {
        const WHAT: &str = "TransformerBlockConfig";
        for (name, v) in [
            ("d", self.d),
            ("heads", self.heads),
            ("seq", self.seq),
            ("mlp_ratio", self.mlp_ratio),
            ("depth", self.depth),
        ] {
            positive(WHAT, name, v)?;
        }
        if !self.d.is_multiple_of(self.heads) {
            return Err(invalid(
                WHAT,
                format!("width {} is not a multiple of the {} heads", self.d, self.heads),
            ));
        }
        check_dropout(WHAT, self.dropout)?;
        let d = self.d;
        let hidden = self.mlp_ratio * d;
        let resid = self.init_std / (2.0 * self.depth as f32).sqrt();
        let linear = |i, o, act, std, part, name| -> Result<Linear> {
            let mut l = LinearConfig::new(i, o)
                .with_activation(act)
                .with_init(Init::Normal { std })
                .with_dtype(self.dtype)
                .with_seed(sub_seed(self.seed, part))
                .init(device)?;
            super::prefix_param_names(&mut l, name);
            Ok(l)
        };
        let norm = |name| -> Result<LayerNorm> {
            let mut n = LayerNormConfig::new(d).with_dtype(self.dtype).init(device)?;
            super::prefix_param_names(&mut n, name);
            Ok(n)
        };
        let std = self.init_std;
        Ok(TransformerBlock {
            ln1: norm("ln_1")?,
            q: linear(d, d, Act::Identity, std, 0, "attn.q")?,
            k: linear(d, d, Act::Identity, std, 1, "attn.k")?,
            v: linear(d, d, Act::Identity, std, 2, "attn.v")?,
            proj: linear(d, d, Act::Identity, resid, 3, "attn.c_proj")?,
            ln2: norm("ln_2")?,
            fc1: linear(d, hidden, Act::Gelu, std, 4, "mlp.c_fc")?,
            fc2: linear(hidden, d, Act::Identity, resid, 5, "mlp.c_proj")?,
            heads: self.heads,
            seq: self.seq,
            causal: self.causal,
            p: self.dropout,
            attention: self.attention,
            fused_residual: self.fused_residual,
            recompute_activation: self.recompute_activation,
        })
    }
}

/// A pre-norm transformer block on `[b * seq, d]`:
/// `x2 = x + drop(proj(attn(ln_1(x))))`, `y = x2 + drop(mlp(ln_2(x2)))`, with multi-head
/// scaled dot-product attention (heads of width `d / heads`, causal or not, dropout on the
/// probabilities) and a GELU MLP. Built from a [`TransformerBlockConfig`].
///
/// Per block, training keeps the normalized inputs, the queries, keys and values, what
/// attention saves, the attention output and the MLP's pre-activation; the MLP's activation
/// (the GELU output) too with [`TransformerBlockConfig::with_recompute_activation`]`(false)`,
/// as PyTorch's eager mode keeps it, where by default backward recomputes it from the
/// pre-activation.
/// Attention saves, by default ([`Attention::Fused`], PyTorch's
/// `scaled_dot_product_attention`), its output and each row's logsumexp. Fused attention
/// reads the q, k and v projections' outputs as they are, tokens-major
/// ([`ops::AttentionLayout::TokensMajor`], as PyTorch's flash and memory-efficient SDPA
/// read the transposed views a GPT block gives them), and its output is the output
/// projection's input as it is: no head permutation is copied, forward or backward, and the
/// attention output is kept once (as PyTorch keeps it, its SDPA output's transpose being
/// contiguous). With [`Attention::Explicit`] (PyTorch's eager attention) the per-head
/// queries, keys and values are heads-major copies (`[b * heads, seq, d / heads]`), and
/// attention keeps the probabilities and, with dropout, the dropped probabilities
/// (`[b * heads, seq, seq]` each). Dropout masks are regenerated, not kept.
///
/// By default each residual add runs fused with its branch's dropout, the first with `ln_2`
/// as well ([`ops::dropout_add_layer_norm`], [`ops::dropout_add`]; backward
/// [`ops::dropout_add_backward`] for each branch): no dropped copy of a branch and, under
/// autocast, no f32 copy of the 16-bit branch is made, and one launch replaces two or three.
/// Where the sum or the norm would not run in the residual stream's dtype (a 16-bit stream
/// under autocast) the block falls back to the unfused ops, as it does with
/// [`TransformerBlockConfig::with_fused_residual`]`(false)`; both give the same values bit
/// for bit on the host.
///
/// Backward, by default, `ln_2`'s backward, the shortcut's gradient `dy` and the attention
/// branch's gradient through `drop1` are one [`ops::layer_norm_backward_residual`] (on a GPU
/// layer norm's two launches instead of those, an add and a masking pass), and `ln_1`'s
/// backward adds `x2`'s gradient the same way; fc2's input-gradient product applies GELU's
/// derivative and sums fc1's bias gradient ([`ops::linear_backward_gelu`]: the GELU's output
/// gradient is never stored; nothing more is saved for it, fc1 keeps its pre-activation and
/// fc2 its input as before), at the cost of that sum's partials being requested while fc2's
/// input is still held; the k and v projections' 16-bit input gradients are added into the
/// f32 sum as they are. Where the dtypes do not allow it (a norm run on an autocast copy) the
/// unfused ops run. For a GPT-2 small block at 8 x 1024 tokens under bf16 autocast with
/// dropout 0.1 a training step makes 87 allocations of 709.5 MiB instead of 94 of 856.8 MiB
/// (`cargo run -p vram-accum --example block_allocations`); the backward's peak is 1.5 MiB
/// higher (the bias gradient's partial sums). The residual norm backward's CUDA kernel has
/// not yet run on a GPU.
#[derive(Debug)]
pub struct TransformerBlock {
    ln1: LayerNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    proj: Linear,
    ln2: LayerNorm,
    fc1: Linear,
    fc2: Linear,
    heads: usize,
    seq: usize,
    causal: bool,
    p: f32,
    attention: Attention,
    fused_residual: bool,
    recompute_activation: bool,
}

/// What attention keeps for backward, besides the per-head queries, keys and values.
#[derive(Debug)]
enum AttentionSaved {
    Fused {
        /// The per-head output and logsumexp.
        fwd: ops::AttentionOutput,
        /// The settings, with the dropout stream's seed and offset.
        params: ops::AttentionParams,
    },
    Explicit {
        probs: Tensor,
        /// The left operand of `p @ v` as multiplied: the (dropped) probabilities, or under
        /// autocast their 16-bit copy.
        pv_lhs: Tensor,
        /// Dropout on the probabilities.
        drop_p: Option<DropoutSaved>,
    },
}

/// What attention gives the block: the per-head output, the per-head queries, keys and
/// values as attended (kept for backward) and what else the backward needs.
struct Attended {
    out: Tensor,
    qh: Tensor,
    kh: Tensor,
    vh: Tensor,
    saved: AttentionSaved,
}

/// What a [`TransformerBlock`] keeps for backward.
#[derive(Debug)]
pub struct BlockSaved {
    ln1: NormSaved,
    sq: AffineSaved,
    sk: AffineSaved,
    sv: AffineSaved,
    qh: Tensor,
    kh: Tensor,
    vh: Tensor,
    /// The dtype of the q/k/v projections' outputs (their gradients go back in it).
    qkv_dtype: DType,
    attn: AttentionSaved,
    sproj: AffineSaved,
    drop1: Option<DropoutSaved>,
    /// The dtype of the attention branch before the residual addition.
    branch1: DType,
    ln2: NormSaved,
    s1: AffineSaved,
    s2: AffineSaved,
    drop2: Option<DropoutSaved>,
    /// The dtype of the MLP branch before the residual addition.
    branch2: DType,
    /// Whether fc2's input (the GELU output) was released, to be recomputed from fc1's
    /// pre-activation in backward.
    gelu_released: bool,
}

impl BlockSaved {
    /// With [`Attention::Explicit`], the attention probabilities softmax saved (f32 under
    /// autocast) and the operand `p @ v` saved (under autocast, the low-precision copy);
    /// `None` with fused attention, which saves no probabilities.
    pub fn attention_probs(&self) -> Option<(&Tensor, &Tensor)> {
        match &self.attn {
            AttentionSaved::Explicit { probs, pv_lhs, .. } => Some((probs, pv_lhs)),
            AttentionSaved::Fused { .. } => None,
        }
    }

    /// With [`Attention::Fused`], the per-head attention output and each row's logsumexp
    /// (`[b * heads, seq]`, f32) the op saved; `None` with explicit attention.
    pub fn attention_output_and_lse(&self) -> Option<(&Tensor, &Tensor)> {
        match &self.attn {
            AttentionSaved::Fused { fwd, .. } => Some((&fwd.out, &fwd.lse)),
            AttentionSaved::Explicit { .. } => None,
        }
    }

    /// The per-head queries as the score product saved them.
    pub fn queries(&self) -> &Tensor {
        &self.qh
    }

    /// The first layer norm's and the query projection's saved inputs.
    pub fn ln1_and_q_inputs(&self) -> (&Tensor, &Tensor) {
        (self.ln1.saved_input(), self.sq.saved_input())
    }
}

/// `a + b` with autocast's promotion (an addition is in no autocast list: it falls through to
/// ATen's type promotion, so f32 with 16 bits gives f32); without autocast the plain op.
fn residual_add(a: &Tensor, b: &Tensor, ctx: &ForwardCtx) -> Result<Tensor> {
    match ctx.op_dtype(OpKind::Add, &[a.dtype(), b.dtype()]) {
        Some(dt) if dt != a.dtype() || dt != b.dtype() => {
            Ok(ops::add(&cast(a, dt)?, &cast(b, dt)?)?)
        }
        _ => Ok(ops::add(a, b)?),
    }
}

impl TransformerBlock {
    /// `[b * s, d] -> [b * heads, s, dh]`.
    /// Fused attention reads the projection as it is, tokens-major (`[b, s, heads, dh]`, a
    /// reshape: no copy, as PyTorch's SDPA reads a transposed view); the explicit form's
    /// products need the heads-major copy.
    fn split_heads(&self, t: Tensor, b: usize, fused: bool) -> Result<Tensor> {
        let dh = t.shape()[1] / self.heads;
        if fused {
            return Ok(t.reshape(&[b, self.seq, self.heads, dh])?);
        }
        split_heads(t, b, self.seq, self.heads, dh)
    }

    /// `[b * heads, s, dh]` (or fused attention's `[b, s, heads, dh]`, by a reshape) `->
    /// [b * s, d]`, the inverse of [`Self::split_heads`].
    fn merge_heads(&self, t: Tensor, b: usize, fused: bool) -> Result<Tensor> {
        let dh = t.shape()[t.rank() - 1];
        if fused {
            return Ok(t.reshape(&[b * self.seq, self.heads * dh])?);
        }
        merge_heads(t, b, self.seq, self.heads, dh)
    }

    /// The rows of `x` as whole sequences: the batch.
    fn batch_of(&self, x: &Tensor) -> Result<usize> {
        let rows = x.shape().first().copied().unwrap_or(0);
        if x.rank() != 2 || !rows.is_multiple_of(self.seq) {
            return Err(invalid(
                "TransformerBlock",
                format!("expected [b * {}, d] tokens, got shape {:?}", self.seq, x.shape()),
            ));
        }
        Ok(rows / self.seq)
    }

    /// The next `n` offsets of the random stream when this forward drops out (training with
    /// `p > 0`), else `None`.
    fn take_dropout(&self, n: usize, ctx: &mut ForwardCtx) -> Result<Option<DropoutSaved>> {
        if !(ctx.training() && self.p > 0.0) {
            return Ok(None);
        }
        let offset = ctx.take_offsets(n as u64)?;
        Ok(Some(DropoutSaved { seed: ctx.seed, offset }))
    }

    fn dropout(&self, x: Tensor, ctx: &mut ForwardCtx) -> Result<(Tensor, Option<DropoutSaved>)> {
        match self.take_dropout(x.numel(), ctx)? {
            None => Ok((x, None)),
            Some(s) => Ok((ops::dropout(&x, self.p, s.seed, s.offset)?, Some(s))),
        }
    }

    /// The fused residual ops' `(p, seed, offset)`: `p == 0` without dropout.
    fn drop_args(&self, s: Option<&DropoutSaved>) -> (f32, u64, u64) {
        s.map_or((0.0, 0, 0), |s| (self.p, s.seed, s.offset))
    }

    /// Whether the residual add of a branch of dtype `branch` to a stream of dtype
    /// `residual` runs fused: when the block fuses and the sum [`residual_add`] makes is in
    /// the stream's dtype, from a branch of that dtype or a 16-bit branch on an f32 stream
    /// (autocast), the pairs the fused ops take.
    fn fuses_residual(&self, residual: DType, branch: DType, ctx: &ForwardCtx) -> bool {
        if !self.fused_residual {
            return false;
        }
        let sum = match ctx.op_dtype(OpKind::Add, &[residual, branch]) {
            Some(dt) => dt,
            None if residual == branch => residual,
            // The plain add refuses the pair: the unfused path reports it.
            None => return false,
        };
        sum == residual && (branch == residual || residual == DType::F32)
    }

    /// `x2 = x + drop(o)` and `h2 = ln_2(x2)`, with ln_2's saved state and the dropout's
    /// offsets: one op ([`ops::dropout_add_layer_norm`]) when the sum and the norm run in
    /// `x`'s dtype, else dropout, the residual add and ln_2 one after the other (the same
    /// values bit for bit on the host, the same offsets drawn).
    #[allow(clippy::type_complexity)]
    fn add_norm(
        &self,
        x: &Tensor,
        o: Tensor,
        ctx: &mut ForwardCtx,
    ) -> Result<(Tensor, Tensor, Option<NormSaved>, Option<DropoutSaved>)> {
        if self.fuses_residual(x.dtype(), o.dtype(), ctx) && self.ln2.runs_in(x.dtype(), ctx) {
            let mask = self.take_dropout(o.numel(), ctx)?;
            let args = self.drop_args(mask.as_ref());
            let (x2, h2, ln2) = self.ln2.run_after_residual(x, &o, args, ctx)?;
            return Ok((x2, h2, ln2, mask));
        }
        let (o, mask) = self.dropout(o, ctx)?;
        let x2 = residual_add(x, &o, ctx)?;
        drop(o);
        let (h2, ln2) = self.ln2.run(&x2, ctx)?;
        Ok((x2, h2, ln2, mask))
    }

    /// `y = x2 + drop(m)` and the dropout's offsets: one op ([`ops::dropout_add`]) when the
    /// sum runs in `x2`'s dtype, else dropout then the residual add.
    fn add_branch(
        &self,
        x2: &Tensor,
        m: Tensor,
        ctx: &mut ForwardCtx,
    ) -> Result<(Tensor, Option<DropoutSaved>)> {
        if self.fuses_residual(x2.dtype(), m.dtype(), ctx) {
            let mask = self.take_dropout(m.numel(), ctx)?;
            let (p, seed, offset) = self.drop_args(mask.as_ref());
            return Ok((ops::dropout_add(x2, &m, p, seed, offset)?, mask));
        }
        let (m, mask) = self.dropout(m, ctx)?;
        Ok((residual_add(x2, &m, ctx)?, mask))
    }

    /// The gradient of a residual branch of dtype `dtype` from the sum's `dy`: `dy` in the
    /// branch's dtype through the branch's dropout; one op ([`ops::dropout_add_backward`])
    /// when the block fuses and the pair is one it takes, else a cast then the dropout's
    /// backward (bit for bit the same).
    fn branch_grad(&self, dy: &Tensor, dtype: DType, s: Option<&DropoutSaved>) -> Result<Tensor> {
        let pair = dy.dtype() == dtype || dy.dtype() == DType::F32;
        match s {
            Some(s) if self.fused_residual && pair => {
                Ok(ops::dropout_add_backward(dy, dtype, self.p, s.seed, s.offset)?)
            }
            _ => {
                let d = cast(dy, dtype)?;
                Ok(self.dropout_backward(s, &d)?.unwrap_or(d))
            }
        }
    }

    /// The branch whose gradient [`ops::layer_norm_backward_residual`] also gives, from a
    /// stream's gradient of dtype `stream`: a branch of dtype `dtype` through its dropout
    /// `s`, or without dropout its cast when the dtypes differ; `None` (the gradient is then
    /// [`Self::branch_grad`]'s) for a pair the op does not take or a gradient that is the
    /// stream's own.
    fn residual_branch(
        &self,
        stream: DType,
        dtype: DType,
        s: Option<&DropoutSaved>,
    ) -> Option<ops::ResidualBranch> {
        if !(dtype == stream || stream == DType::F32) {
            return None;
        }
        match s {
            Some(s) => {
                Some(ops::ResidualBranch { dtype, p: self.p, seed: s.seed, offset: s.offset })
            }
            None if dtype != stream => {
                Some(ops::ResidualBranch { dtype, p: 0.0, seed: 0, offset: 0 })
            }
            None => None,
        }
    }

    fn dropout_backward(&self, s: Option<&DropoutSaved>, dy: &Tensor) -> Result<Option<Tensor>> {
        match s {
            Some(s) => Ok(Some(ops::dropout_backward(dy, self.p, s.seed, s.offset)?)),
            None => Ok(None),
        }
    }

    /// The settings of fused attention in this forward: the block's masking, tokens-major
    /// operands and, when training with dropout, the next `b * heads * seq * seq` offsets of
    /// the stream (what the explicit form's dropout on the probabilities takes).
    fn attention_params(&self, heads: usize, ctx: &mut ForwardCtx) -> Result<ops::AttentionParams> {
        let params = ops::AttentionParams::new(self.causal).tokens_major();
        if !(ctx.training() && self.p > 0.0) {
            return Ok(params);
        }
        let offset = ctx.take_offsets((heads * self.seq * self.seq) as u64)?;
        Ok(params.with_dropout(self.p, ctx.seed, offset))
    }

    /// Fused attention of the tokens-major `qh`, `kh`, `vh` (`[b, s, heads, dh]`; under
    /// autocast in the products' low dtype, as PyTorch's autocast runs
    /// `scaled_dot_product_attention`): the output (tokens-major, so that merging the heads
    /// is a reshape and the output projection's saved input is the output itself), the
    /// inputs as attended, and what the backward needs.
    fn attend_fused(
        &self,
        qh: Tensor,
        kh: Tensor,
        vh: Tensor,
        ctx: &mut ForwardCtx,
    ) -> Result<Attended> {
        let dt = qh.dtype();
        let mm = ctx.op_dtype(OpKind::Matmul, &[dt]).unwrap_or(dt);
        let (qh, kh, vh) = (cast_into(qh, mm)?, cast_into(kh, mm)?, cast_into(vh, mm)?);
        let params = self.attention_params(qh.shape()[0] * qh.shape()[2], ctx)?;
        let fwd = ops::attention(&qh, &kh, &vh, &params)?;
        let out = fwd.out.clone();
        Ok(Attended { out, qh, kh, vh, saved: AttentionSaved::Fused { fwd, params } })
    }

    /// The explicit composition: `q k^T`, scale, softmax (f32 under autocast), dropout,
    /// `p v`.
    fn attend_explicit(
        &self,
        qh: Tensor,
        kh: Tensor,
        vh: Tensor,
        ctx: &mut ForwardCtx,
    ) -> Result<Attended> {
        let dt = qh.dtype();
        let mm = ctx.op_dtype(OpKind::Matmul, &[dt]).unwrap_or(dt);
        let (qh, kh) = (cast_into(qh, mm)?, cast_into(kh, mm)?);
        let scale = self.head_scale(qh.shape()[2]);
        let scores = ops::scale(&ops::matmul(&qh, &kh, false, true)?, scale)?;
        let sm = ctx.op_dtype(OpKind::Softmax, &[scores.dtype()]).unwrap_or(scores.dtype());
        let scores = cast_into(scores, sm)?;
        let probs =
            if self.causal { ops::causal_softmax(&scores)? } else { ops::softmax(&scores)? };
        drop(scores);
        let (dropped, drop_p) = self.dropout(probs.clone(), ctx)?;
        let pv = ctx.op_dtype(OpKind::Matmul, &[dropped.dtype(), vh.dtype()]);
        let pv = pv.unwrap_or(dropped.dtype());
        let (pv_lhs, vh) = (cast_into(dropped, pv)?, cast_into(vh, pv)?);
        let ctx_h = ops::matmul(&pv_lhs, &vh, false, false)?;
        let saved = AttentionSaved::Explicit { probs, pv_lhs, drop_p };
        Ok(Attended { out: ctx_h, qh, kh, vh, saved })
    }

    /// The gradients of the per-head queries, keys and values from the per-head output's
    /// `dctx`.
    fn attend_backward(
        &self,
        saved: AttentionSaved,
        qh: Tensor,
        kh: Tensor,
        vh: Tensor,
        dctx: Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        match saved {
            AttentionSaved::Fused { fwd, params } => {
                let dctx = cast_into(dctx, qh.dtype())?;
                let g = ops::attention_backward(&qh, &kh, &vh, &fwd, &dctx, &params)?;
                Ok((g.dq, g.dk, g.dv))
            }
            AttentionSaved::Explicit { probs, pv_lhs, drop_p } => {
                let dctx = cast_into(dctx, pv_lhs.dtype())?;
                let (dlhs, dvh) = ops::matmul_backward(&pv_lhs, &vh, &dctx, false, false)?;
                drop((dctx, pv_lhs, vh));
                // The backward of the cast to `p @ v`'s dtype, then of dropout and softmax
                // (f32). Each `[b, heads, s, s]` gradient is dropped as soon as the next one
                // exists, as autograd frees them: no two of them outlive the op that reads
                // them.
                let ddropped = cast_into(dlhs, probs.dtype())?;
                let undropped = self.dropout_backward(drop_p.as_ref(), &ddropped)?;
                let dprobs = undropped.as_ref().unwrap_or(&ddropped);
                let dscores = if self.causal {
                    ops::causal_softmax_backward(&probs, dprobs)?
                } else {
                    ops::softmax_backward(&probs, dprobs)?
                };
                drop((undropped, ddropped, probs));
                let dscores = cast_into(dscores, qh.dtype())?;
                let scaled = ops::scale(&dscores, self.head_scale(qh.shape()[2]))?;
                drop(dscores);
                let (dqh, dkh) = ops::matmul_backward(&qh, &kh, &scaled, false, true)?;
                drop((scaled, qh, kh));
                Ok((dqh, dkh, dvh))
            }
        }
    }

    fn head_scale(&self, dh: usize) -> f32 {
        1.0 / (dh as f32).sqrt()
    }
}

impl Layer for TransformerBlock {
    type Saved = BlockSaved;

    fn name(&self) -> String {
        let d = self.q.weight.value.shape().first().copied().unwrap_or(0);
        let kind = if self.causal { "causal" } else { "full" };
        format!("TransformerBlock(d={d}, heads={}, {kind})", self.heads)
    }

    fn forward(
        &mut self,
        x: &Tensor,
        ctx: &mut ForwardCtx,
    ) -> Result<(Tensor, Option<BlockSaved>)> {
        const WHAT: &str = "TransformerBlock";
        let b = self.batch_of(x)?;
        // Under autocast (PyTorch's lists in aten/src/ATen/autocast_mode.h): the layer norms
        // give f32, the projections and both attention products (matmul/bmm) run in the low
        // dtype, softmax runs in f32 (its f32 probabilities are what its backward needs),
        // and the probabilities are cast to the low dtype for `p @ v`. The residual stream
        // stays f32: f32 + 16 bits promotes.
        let (h1, ln1) = self.ln1.run(x, ctx)?;
        let (q, sq) = self.q.forward(&h1, ctx)?;
        let (k, sk) = self.k.forward(&h1, ctx)?;
        let (v, sv) = self.v.forward(&h1, ctx)?;
        drop(h1);
        let qkv_dtype = q.dtype();
        let fused = self.attention == Attention::Fused;
        let split = |t| self.split_heads(t, b, fused);
        let (qh, kh, vh) = (split(q)?, split(k)?, split(v)?);
        let Attended { out: ctx_h, qh, kh, vh, saved: attn_saved } = match self.attention {
            Attention::Fused => self.attend_fused(qh, kh, vh, ctx)?,
            Attention::Explicit => self.attend_explicit(qh, kh, vh, ctx)?,
        };
        let attn = self.merge_heads(ctx_h, b, fused)?;
        let (o, sproj) = self.proj.forward(&attn, ctx)?;
        drop(attn);
        let branch1 = o.dtype();
        let (x2, h2, ln2, drop1) = self.add_norm(x, o, ctx)?;
        let (a, s1) = self.fc1.forward(&h2, ctx)?;
        drop(h2);
        let (m, s2) = self.fc2.forward(&a, ctx)?;
        drop(a);
        let branch2 = m.dtype();
        let (y, drop2) = self.add_branch(&x2, m, ctx)?;
        if !ctx.training() {
            return Ok((y, None));
        }
        // fc2's input, the GELU output, is recomputed in backward from the pre-activation fc1
        // keeps, rather than kept (where fc1 kept one of its dtype).
        let s1 = saved(s1, WHAT)?;
        let mut s2 = saved(s2, WHAT)?;
        let gelu_released =
            self.recompute_activation && s1.z.as_ref().is_some_and(|pre| s2.release_input(pre));
        let s = BlockSaved {
            ln1: saved(ln1, WHAT)?,
            sq: saved(sq, WHAT)?,
            sk: saved(sk, WHAT)?,
            sv: saved(sv, WHAT)?,
            qh,
            kh,
            vh,
            qkv_dtype,
            attn: attn_saved,
            sproj: saved(sproj, WHAT)?,
            drop1,
            branch1,
            ln2: saved(ln2, WHAT)?,
            s1,
            s2,
            drop2,
            branch2,
            gelu_released,
        };
        Ok((y, Some(s)))
    }

    fn backward(&mut self, s: BlockSaved, dy: Tensor, want: bool) -> Result<Option<Tensor>> {
        const WHAT: &str = "TransformerBlock";
        let b = dy.shape()[0] / self.seq;
        // y = x2 + drop(fc2(fc1(ln_2(x2)))); the branch's gradient in the branch's dtype.
        // `dy` is also the shortcut's: kept until it is added to x2's.
        let dbranch = self.branch_grad(&dy, s.branch2, s.drop2.as_ref())?;
        let mut s2 = s.s2;
        if s.gelu_released {
            let pre =
                s.s1.z
                    .as_ref()
                    .ok_or_else(|| invalid(WHAT, "fc1 kept no pre-activation".into()))?;
            s2.restore_input(ops::gelu(pre)?);
        }
        let dh2 = if self.fused_residual {
            // fc2's input-gradient product through fc1's GELU, with fc1's bias gradient.
            self.fc2.backward_through_gelu(&mut self.fc1, s2, s.s1, dbranch, WHAT)?
        } else {
            let da = dx_of(self.fc2.backward(s2, dbranch, true)?, WHAT)?;
            dx_of(self.fc1.backward(s.s1, da, true)?, WHAT)?
        };
        // x2's gradient: ln_2's plus the shortcut's `dy`; then the attention branch's.
        let fuse2 =
            self.fused_residual && self.ln2.fuses_residual_grads(&s.ln2, dh2.dtype(), dy.dtype());
        let (dx2, dbranch) = if fuse2 {
            // One op: ln_2's backward, `dy` added, the branch's gradient through drop1.
            let branch = self.residual_branch(dy.dtype(), s.branch1, s.drop1.as_ref());
            let (dx2, dbranch) = self.ln2.grads_with_residual(s.ln2, &dh2, dy, branch)?;
            drop(dh2);
            let dbranch = match dbranch {
                Some(d) => d,
                None => self.branch_grad(&dx2, s.branch1, s.drop1.as_ref())?,
            };
            (dx2, dbranch)
        } else {
            let mut dx2 = self.ln2.grads(s.ln2, &dh2)?;
            drop(dh2);
            let dy_res = cast_into(dy, dx2.dtype())?;
            ops::add_assign(&mut dx2, &dy_res)?;
            drop(dy_res);
            let dbranch = self.branch_grad(&dx2, s.branch1, s.drop1.as_ref())?;
            (dx2, dbranch)
        };
        // x2 = x + drop(proj(attn(ln_1(x))))
        let dattn = dx_of(self.proj.backward(s.sproj, dbranch, true)?, WHAT)?;
        let fused = matches!(s.attn, AttentionSaved::Fused { .. });
        let dctx = self.split_heads(dattn, b, fused)?;
        let (dqh, dkh, dvh) = self.attend_backward(s.attn, s.qh, s.kh, s.vh, dctx)?;
        let qkv = s.qkv_dtype;
        let dq = cast_into(self.merge_heads(dqh, b, fused)?, qkv)?;
        let mut dh1 = dx_of(self.q.backward(s.sq, dq, true)?, WHAT)?;
        let dk = cast_into(self.merge_heads(dkh, b, fused)?, qkv)?;
        self.k.backward_into(s.sk, dk, &mut dh1)?;
        let dv = cast_into(self.merge_heads(dvh, b, fused)?, qkv)?;
        self.v.backward_into(s.sv, dv, &mut dh1)?;
        // x's gradient: ln_1's plus x2's by the shortcut, in one op where the dtypes allow.
        if want
            && self.fused_residual
            && self.ln1.fuses_residual_grads(&s.ln1, dh1.dtype(), dx2.dtype())
        {
            let (dx, _) = self.ln1.grads_with_residual(s.ln1, &dh1, dx2, None)?;
            return Ok(Some(dx));
        }
        let mut dx = self.ln1.grads(s.ln1, &dh1)?;
        drop(dh1);
        if !want {
            return Ok(None);
        }
        let dx2 = cast_into(dx2, dx.dtype())?;
        ops::add_assign(&mut dx, &dx2)?;
        Ok(Some(dx))
    }

    fn params(&self) -> Vec<&Param> {
        let mut p = self.ln1.params();
        for l in [&self.q, &self.k, &self.v, &self.proj] {
            p.extend(l.params());
        }
        p.extend(self.ln2.params());
        p.extend(self.fc1.params());
        p.extend(self.fc2.params());
        p
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut p = self.ln1.params_mut();
        for l in [&mut self.q, &mut self.k, &mut self.v, &mut self.proj] {
            p.extend(l.params_mut());
        }
        p.extend(self.ln2.params_mut());
        p.extend(self.fc1.params_mut());
        p.extend(self.fc2.params_mut());
        p
    }

    fn device(&self) -> &Device {
        &self.q.device
    }
}

/// The settings of a [`PatchEmbed`] layer.
#[derive(Clone, Debug, PartialEq)]
pub struct PatchEmbedConfig {
    /// Image channels (3).
    pub channels: usize,
    /// Token width.
    pub d: usize,
    /// Patch side (ViT-B/16: 16).
    pub patch: usize,
    /// Image side (a multiple of `patch`).
    pub side: usize,
    /// The dtype of the parameters (default f32).
    pub dtype: DType,
    /// Seed of the weight initialization (default 0).
    pub seed: u64,
}

impl PatchEmbedConfig {
    /// Patches of `patch x patch` pixels of `channels`-channel images of `side` pixels
    /// into tokens of width `d`; f32, seed 0.
    pub fn new(channels: usize, d: usize, patch: usize, side: usize) -> Self {
        PatchEmbedConfig { channels, d, patch, side, dtype: DType::F32, seed: 0 }
    }

    /// The same with parameters in `dtype`.
    pub fn with_dtype(self, dtype: DType) -> Self {
        PatchEmbedConfig { dtype, ..self }
    }

    /// The same with weights drawn from `seed`.
    pub fn with_seed(self, seed: u64) -> Self {
        PatchEmbedConfig { seed, ..self }
    }

    /// Tokens per image, `(side / patch)^2`.
    pub fn tokens(&self) -> usize {
        let g = self.side / self.patch.max(1);
        g * g
    }

    /// The layer on `device`: the projection's weights PyTorch's default, its bias zero,
    /// positions normal with std 0.02.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a zero size or a side that is not a multiple of the
    /// patch; out of memory.
    pub fn init(&self, device: &Device) -> Result<PatchEmbed> {
        const WHAT: &str = "PatchEmbedConfig";
        for (name, v) in [("channels", self.channels), ("d", self.d), ("patch", self.patch)] {
            positive(WHAT, name, v)?;
        }
        if self.side == 0 || !self.side.is_multiple_of(self.patch) {
            return Err(invalid(
                WHAT,
                format!(
                    "image side {} is not a positive multiple of the patch {}",
                    self.side, self.patch
                ),
            ));
        }
        let mut conv = Conv2dConfig::new(self.channels, self.d, self.patch)
            .with_stride(self.patch)
            .with_padding(0)
            .with_bias(true)
            .with_dtype(self.dtype)
            .with_seed(sub_seed(self.seed, 0))
            .init(device)?;
        super::prefix_param_names(&mut conv, "proj");
        let s = self.tokens();
        let pos = init_weight(
            device,
            &[s, self.d],
            Init::Normal { std: 0.02 },
            1,
            self.dtype,
            sub_seed(self.seed, 1),
        )?;
        Ok(PatchEmbed { conv, pos: Param::new("pos_embed", pos), tokens: s })
    }
}

/// ViT's patch embedding: a `patch x patch` convolution of stride `patch` (one token per
/// patch), the tokens as rows, plus a learned position per token:
/// `[b, c, side, side] -> [b * tokens, d]`. No class token: a [`TokenMeanPool`] makes the
/// image's features. Built from a [`PatchEmbedConfig`].
#[derive(Debug)]
pub struct PatchEmbed {
    conv: Conv2d,
    pos: Param,
    tokens: usize,
}

/// What a [`PatchEmbed`] keeps: the convolution's state and its output's shape.
#[derive(Debug)]
pub struct PatchSaved {
    conv: AffineSaved,
    shape: Vec<usize>,
}

impl PatchEmbed {
    fn positions(&self, b: usize) -> Vec<u32> {
        (0..b * self.tokens).map(|i| (i % self.tokens) as u32).collect()
    }
}

impl Layer for PatchEmbed {
    type Saved = PatchSaved;

    fn name(&self) -> String {
        let s = self.conv.weight.value.shape();
        let at = |i: usize| s.get(i).copied().unwrap_or(0);
        format!("PatchEmbed({}x{} -> {}, {} tokens)", at(2), at(3), at(0), self.tokens)
    }

    fn forward(
        &mut self,
        x: &Tensor,
        ctx: &mut ForwardCtx,
    ) -> Result<(Tensor, Option<PatchSaved>)> {
        // Under autocast the convolution's output is 16-bit and the positions f32: the sum
        // promotes to f32, as PyTorch's `x + pos_embed` does.
        let (z, sc) = self.conv.forward(x, ctx)?;
        let shape = z.shape().to_vec(); // [b, d, g, g]
        let (b, d) = (shape[0], shape[1]);
        let t = shape[2] * shape[3];
        if t != self.tokens {
            return Err(invalid(
                "PatchEmbed",
                format!("the image gives {t} patches; the layer was built for {}", self.tokens),
            ));
        }
        let rows = ops::permute(&z.reshape(&[b, d, t])?, &[0, 2, 1])?.reshape(&[b * t, d])?;
        let pos = ops::embedding(&self.pos.value, &self.positions(b))?;
        let y = super::add_promoted(&rows, &pos)?;
        drop((rows, pos));
        let saved = sc.map(|conv| PatchSaved { conv, shape });
        Ok((y, saved))
    }

    fn backward(&mut self, s: PatchSaved, dy: Tensor, want: bool) -> Result<Option<Tensor>> {
        let (b, d, t) = (s.shape[0], s.shape[1], self.tokens);
        self.pos.accumulate_grad(ops::embedding_backward(&self.positions(b), &dy, t)?)?;
        let dz = dy.reshape(&[b, t, d])?;
        let dz = ops::permute_backward(&dz, &[0, 2, 1])?.reshape(&s.shape)?;
        self.conv.backward(s.conv, dz, want)
    }

    fn params(&self) -> Vec<&Param> {
        let mut p = self.conv.params();
        p.push(&self.pos);
        p
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut p = self.conv.params_mut();
        p.push(&mut self.pos);
        p
    }

    fn device(&self) -> &Device {
        &self.conv.device
    }
}

/// The mean over each sequence's tokens: `[b * seq, d] -> [b, d]` (ViT without a class
/// token).
#[derive(Debug)]
pub struct TokenMeanPool {
    seq: usize,
    device: Device,
}

impl TokenMeanPool {
    /// A pool over sequences of `seq` tokens.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for `seq == 0`.
    pub fn new(device: &Device, seq: usize) -> Result<Self> {
        positive("TokenMeanPool", "seq", seq)?;
        Ok(TokenMeanPool { seq, device: device.clone() })
    }
}

impl Layer for TokenMeanPool {
    /// The input's shape (`[b * seq, d]`).
    type Saved = Vec<usize>;

    fn name(&self) -> String {
        format!("TokenMeanPool({})", self.seq)
    }

    fn forward(
        &mut self,
        x: &Tensor,
        ctx: &mut ForwardCtx,
    ) -> Result<(Tensor, Option<Vec<usize>>)> {
        let (rows, d) = match x.shape() {
            &[rows, d] if rows.is_multiple_of(self.seq) => (rows, d),
            other => {
                return Err(invalid(
                    "TokenMeanPool",
                    format!("expected [b * {}, d] tokens, got shape {other:?}", self.seq),
                ));
            }
        };
        let b = rows / self.seq;
        let t = ops::permute(&x.clone().reshape(&[b, self.seq, d])?, &[0, 2, 1])?;
        let y = ops::mean_last_dim(&t)?;
        Ok((y, ctx.training().then(|| x.shape().to_vec())))
    }

    fn backward(&mut self, shape: Vec<usize>, dy: Tensor, want: bool) -> Result<Option<Tensor>> {
        if !want {
            return Ok(None);
        }
        let (b, d) = (shape[0] / self.seq, shape[1]);
        let dt = ops::mean_last_dim_backward(&dy, self.seq)?.reshape(&[b, d, self.seq])?;
        Ok(Some(ops::permute_backward(&dt, &[0, 2, 1])?.reshape(&shape)?))
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
