//! Scaled dot-product attention's settings ([`AttentionParams`]) and the sizes of one call
//! ([`AttentionDims`]).

use crate::error::{Error, Result};

/// How [`ops::attention`](crate::ops::attention) attends: causally or not, with which score
/// scale, and with dropout on the probabilities (PyTorch's
/// `F.scaled_dot_product_attention(q, k, v, dropout_p, is_causal, scale)`).
///
/// Dropout draws from the same counter-based stream as [`ops::dropout`](crate::ops::dropout):
/// the probability of query `i` and key `j` in head `h` (of `heads` heads of `seq` tokens)
/// is element `(h * seq + i) * seq + j` of a `[heads, seq, seq]` tensor, kept iff
/// `dropout_keep(seed, offset + that index, p)`. So the fused op with `(seed, offset)`
/// drops exactly what `ops::dropout(probs, p, seed, offset)` drops on the explicit
/// probabilities, and a caller advances its offset by `heads * seq * seq` per call as it
/// would for that dropout.
///
/// The layout ([`AttentionLayout`]) says how q, k, v and the output hold their heads:
/// heads-major by default, or tokens-major ([`AttentionParams::tokens_major`]), which reads
/// a projection's `[batch * seq, heads * head_dim]` output as it is, without a permutation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionParams {
    /// Query `i` attends to keys `j <= i` only.
    pub causal: bool,
    /// The factor on `q . k`; `None` is `1 / sqrt(head_dim)`.
    pub scale: Option<f32>,
    /// Drop probability of each attention probability, in `[0, 1)`.
    pub dropout: f32,
    /// The dropout stream's seed.
    pub seed: u64,
    /// The dropout stream's first index.
    pub offset: u64,
    /// How the operands hold their heads.
    pub layout: AttentionLayout,
    /// Grouped-query attention (PyTorch's `enable_gqa`): k and v may have fewer heads than
    /// q, a divisor of q's, each shared by that many consecutive query heads (query head
    /// `hh` of a batch element reads key/value head `hh / (heads / kv_heads)`, as
    /// Hugging Face's `repeat_kv` would repeat them), without repeating them in memory.
    pub grouped: bool,
}

/// How attention's q, k, v, output and gradients hold their heads.
///
/// The head index `h` of a batch element `b` and a head `hh` of `heads` is `b * heads + hh`
/// in both layouts: the logsumexp is `[batch * heads, seq]` (`[batch, heads, seq]`), and
/// dropout draws the same elements whichever layout the operands have.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionLayout {
    /// `[.., seq, head_dim]`, every leading index a head: `[batch * heads, seq, head_dim]`
    /// or `[batch, heads, seq, head_dim]`, the shape PyTorch's
    /// `F.scaled_dot_product_attention` takes.
    #[default]
    HeadsMajor,
    /// `[batch, seq, heads, head_dim]`: token by token, each token's heads side by side,
    /// FlashAttention's own layout (`flash_attn_func`'s) and the memory PyTorch's flash and
    /// memory-efficient SDPA backends read and write (their `[b, h, s, d]` operands are
    /// transposed views of it). A linear projection's `[batch * seq, heads * head_dim]`
    /// output is this layout as it is, and the output is the next projection's input as it
    /// is: no head permutation is copied, forward or backward.
    TokensMajor,
}

impl AttentionParams {
    /// Attention without dropout, causal or not, scaled by `1 / sqrt(head_dim)`.
    pub fn new(causal: bool) -> AttentionParams {
        AttentionParams {
            causal,
            scale: None,
            dropout: 0.0,
            seed: 0,
            offset: 0,
            layout: AttentionLayout::HeadsMajor,
            grouped: false,
        }
    }

    /// The same with grouped-query attention allowed ([`AttentionParams::grouped`]).
    pub fn grouped(self) -> AttentionParams {
        AttentionParams { grouped: true, ..self }
    }

    /// The same with operands in `[batch, seq, heads, head_dim]` ([`AttentionLayout::TokensMajor`]).
    pub fn tokens_major(self) -> AttentionParams {
        AttentionParams { layout: AttentionLayout::TokensMajor, ..self }
    }

    /// The same with dropout `p` drawn from `(seed, offset)`.
    pub fn with_dropout(self, p: f32, seed: u64, offset: u64) -> AttentionParams {
        AttentionParams { dropout: p, seed, offset, ..self }
    }

    /// The same with scores scaled by `scale`.
    pub fn with_scale(self, scale: f32) -> AttentionParams {
        AttentionParams { scale: Some(scale), ..self }
    }

    /// The score scale for heads of `head_dim`.
    pub fn scale_for(&self, head_dim: usize) -> f32 {
        self.scale.unwrap_or_else(|| 1.0 / (head_dim.max(1) as f32).sqrt())
    }

    /// Checks the dropout probability and the scale.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] unless `0 <= dropout < 1` and the scale is finite.
    pub fn validate(&self, op: &'static str) -> Result<()> {
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(Error::InvalidArgument {
                op,
                reason: format!("drop probability {} is not in [0, 1)", self.dropout),
            });
        }
        match self.scale {
            Some(s) if !s.is_finite() => {
                Err(Error::InvalidArgument { op, reason: format!("scale {s} is not finite") })
            }
            _ => Ok(()),
        }
    }
}

/// The sizes of one attention call: `heads` independent query heads (batch times heads) of
/// `seq` tokens of width `dim`; q and the output are `[heads, seq, dim]`, row-major, when
/// `heads_per_token` is 1, and `[heads / heads_per_token, seq, heads_per_token, dim]`
/// (tokens-major) otherwise; k and v have `heads / kv_group` heads in the same layout
/// ([`AttentionDims::kv`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionDims {
    /// Heads over the whole batch.
    pub heads: usize,
    /// Tokens per head.
    pub seq: usize,
    /// Width of a head.
    pub dim: usize,
    /// Heads side by side in each token's row: 1 for heads-major operands, the model's heads
    /// for tokens-major ones. Divides `heads`.
    pub heads_per_token: usize,
    /// Query heads per key/value head (grouped-query attention): 1 without grouping. Divides
    /// `heads` and, tokens-major, `heads_per_token`.
    pub kv_group: usize,
}

impl AttentionDims {
    /// Heads-major sizes (`[heads, seq, dim]`).
    pub fn heads_major(heads: usize, seq: usize, dim: usize) -> AttentionDims {
        AttentionDims { heads, seq, dim, heads_per_token: 1, kv_group: 1 }
    }

    /// The sizes of k and v (and their gradients): `heads / kv_group` heads in the same
    /// layout, ungrouped.
    pub fn kv(&self) -> AttentionDims {
        let group = self.kv_group.max(1);
        AttentionDims {
            heads: self.heads / group,
            heads_per_token: (self.heads_per_token / group).max(1),
            kv_group: 1,
            ..*self
        }
    }

    /// Elements between two consecutive rows of one head.
    pub fn row_stride(&self) -> usize {
        self.heads_per_token * self.dim
    }

    /// The element where row 0 of head `h` starts.
    pub fn head_start(&self, h: usize) -> usize {
        let n = self.heads_per_token.max(1);
        (h / n) * self.seq * n * self.dim + (h % n) * self.dim
    }

    /// The element where row `i` of head `h` starts.
    pub fn row_start(&self, h: usize, i: usize) -> usize {
        self.head_start(h) + i * self.row_stride()
    }

    /// Elements of q (or k, v, the output).
    pub fn len(&self) -> usize {
        self.heads * self.seq * self.dim
    }

    /// Whether there is nothing to compute.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Rows of the logsumexp: `heads * seq`.
    pub fn rows(&self) -> usize {
        self.heads * self.seq
    }

    /// The dropout index of query `i`, key `j` of head `h` (relative to the offset): the
    /// element of a `[heads, seq, seq]` tensor.
    pub fn prob_index(&self, h: usize, i: usize, j: usize) -> u64 {
        ((h * self.seq + i) * self.seq + j) as u64
    }
}
