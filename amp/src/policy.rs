//! The autocast precision policy: a readable, overridable table from op kind to precision
//! class, PyTorch's CUDA autocast op lists (`aten/src/ATen/autocast_mode.h`:
//! `AT_FORALL_LOWER_PRECISION_FP`, `AT_FORALL_FP32`, `AT_FORALL_FP32_SET_OPT_DTYPE`,
//! `AT_FORALL_PROMOTE`; ops in no list fall through, registered in `autocast_mode.cpp`)
//! restricted to the op kinds below.
//!
//! - [`OpClass::LowPrecision`]: ops that are fast and safe in 16 bits and dominate compute
//!   (matmul, linear, convolutions, attention products) run in the policy's low dtype.
//! - [`OpClass::F32`]: ops whose range or accumulation needs f32 (softmax, log-softmax,
//!   losses, norms, exp/log, sums and means) run in f32.
//! - [`OpClass::Promote`]: ops with several inputs run in the widest input dtype (f32 wins;
//!   f16 with bf16 gives f32); with one input this is the input's own dtype. This is both
//!   PyTorch's `promote` policy and what its fall-through ops (in no list: add, mul, relu,
//!   gelu, dropout, mean) do through ATen's own type promotion.

use crate::error::{Error, Result};
use std::collections::BTreeMap;
use vram_kernels::DType;

/// An op kind the policy has an entry for. [`OpKind::Other`] names ops of the user's own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum OpKind {
    /// Matrix product.
    Matmul,
    /// Linear layer `x w^T + b`.
    Linear,
    /// 2-D convolution (full or depthwise).
    Conv2d,
    /// Attention products (`q k^T`, `p v`).
    Attention,
    /// Softmax.
    Softmax,
    /// Log-softmax.
    LogSoftmax,
    /// Losses (cross-entropy, MSE, ...).
    Loss,
    /// Layer norm (PyTorch's fp32 list also has group norm; batch norm is in no CUDA list
    /// and falls through).
    LayerNorm,
    /// Exponential.
    Exp,
    /// Logarithm.
    Log,
    /// Sums, products and cumulative sums (PyTorch's `fp32_set_opt_dtype` list).
    Sum,
    /// Means: in no PyTorch list, so they fall through (the input's dtype).
    Mean,
    /// Elementwise addition.
    Add,
    /// Elementwise multiplication.
    Mul,
    /// Activations (ReLU, GELU) and dropout.
    Activation,
    /// An op of the user's, by name; [`OpClass::Promote`] unless the table says otherwise.
    Other(&'static str),
}

/// How an op's inputs are cast under autocast.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpClass {
    /// Run in the policy's low dtype (f16 or bf16).
    LowPrecision,
    /// Run in f32.
    F32,
    /// Run in the widest input dtype.
    Promote,
}

/// The widest of `inputs`: f32 if any input is f32 or if f16 meets bf16 (neither holds the
/// other); otherwise the one 16-bit type; f32 for no inputs.
pub fn widest(inputs: &[DType]) -> DType {
    let mut it = inputs.iter().copied();
    let Some(first) = it.next() else { return DType::F32 };
    it.fold(first, |acc, d| if acc == d { acc } else { DType::F32 })
}

impl OpClass {
    /// The dtype an op of this class computes in, given the low dtype and its inputs'
    /// dtypes.
    pub fn dtype(self, low: DType, inputs: &[DType]) -> DType {
        match self {
            OpClass::LowPrecision => low,
            OpClass::F32 => DType::F32,
            OpClass::Promote => widest(inputs),
        }
    }
}

/// The default table, PyTorch's lists restricted to the op kinds above.
const DEFAULT_TABLE: [(OpKind, OpClass); 15] = [
    (OpKind::Matmul, OpClass::LowPrecision),
    (OpKind::Linear, OpClass::LowPrecision),
    (OpKind::Conv2d, OpClass::LowPrecision),
    (OpKind::Attention, OpClass::LowPrecision),
    (OpKind::Softmax, OpClass::F32),
    (OpKind::LogSoftmax, OpClass::F32),
    (OpKind::Loss, OpClass::F32),
    (OpKind::LayerNorm, OpClass::F32),
    (OpKind::Exp, OpClass::F32),
    (OpKind::Log, OpClass::F32),
    (OpKind::Sum, OpClass::F32),
    (OpKind::Mean, OpClass::Promote),
    (OpKind::Add, OpClass::Promote),
    (OpKind::Mul, OpClass::Promote),
    (OpKind::Activation, OpClass::Promote),
];

/// A precision policy: the low dtype and the class of every op kind.
#[derive(Clone, Debug, PartialEq)]
pub struct AutocastPolicy {
    low: DType,
    table: BTreeMap<OpKind, OpClass>,
}

impl AutocastPolicy {
    /// The default table with `low` as the low-precision dtype.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] if `low` is f32.
    pub fn new(low: DType) -> Result<AutocastPolicy> {
        if !low.is_low_precision() {
            return Err(Error::InvalidConfig {
                what: "AutocastPolicy::new",
                reason: format!("the low dtype must be f16 or bf16, got {low}"),
            });
        }
        Ok(AutocastPolicy { low, table: DEFAULT_TABLE.into_iter().collect() })
    }

    /// The default table in f16 (pair it with a [`LossScaler`](crate::LossScaler)).
    pub fn f16() -> AutocastPolicy {
        AutocastPolicy { low: DType::F16, table: DEFAULT_TABLE.into_iter().collect() }
    }

    /// The default table in bf16 (no loss scaling needed).
    pub fn bf16() -> AutocastPolicy {
        AutocastPolicy { low: DType::BF16, table: DEFAULT_TABLE.into_iter().collect() }
    }

    /// The low-precision dtype.
    pub fn low_dtype(&self) -> DType {
        self.low
    }

    /// The class of `op` ([`OpClass::Promote`] for kinds the table does not list).
    pub fn class_of(&self, op: OpKind) -> OpClass {
        self.table.get(&op).copied().unwrap_or(OpClass::Promote)
    }

    /// Overrides the class of `op` (or adds an entry for an [`OpKind::Other`]).
    pub fn set_class(&mut self, op: OpKind, class: OpClass) -> &mut Self {
        self.table.insert(op, class);
        self
    }

    /// `self` with the class of `op` overridden.
    pub fn with_class(mut self, op: OpKind, class: OpClass) -> Self {
        self.set_class(op, class);
        self
    }

    /// The table, in op-kind order.
    pub fn table(&self) -> impl Iterator<Item = (OpKind, OpClass)> + '_ {
        self.table.iter().map(|(&k, &c)| (k, c))
    }

    /// The dtype `op` computes in for inputs of `inputs`' dtypes.
    pub fn dtype_for(&self, op: OpKind, inputs: &[DType]) -> DType {
        self.class_of(op).dtype(self.low, inputs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widest_prefers_f32_and_mixes_16_bit_types_into_f32() {
        assert_eq!(widest(&[DType::F16, DType::F16]), DType::F16);
        assert_eq!(widest(&[DType::BF16]), DType::BF16);
        assert_eq!(widest(&[DType::F16, DType::F32]), DType::F32);
        assert_eq!(widest(&[DType::F16, DType::BF16]), DType::F32);
        assert_eq!(widest(&[]), DType::F32);
    }

    /// The default table against PyTorch's CUDA lists, transcribed from
    /// `aten/src/ATen/autocast_mode.h` (the ATen op each kind stands for; ops in no list fall
    /// through: with one input they keep its dtype, with several ATen promotes).
    #[test]
    fn the_default_table_follows_pytorchs_cuda_lists() {
        const LOWER_PRECISION_FP: &[&str] =
            &["conv2d", "matmul", "mm", "bmm", "linear", "scaled_dot_product_attention"];
        const FP32: &[&str] = &["exp", "log", "layer_norm", "group_norm", "nll_loss", "mse_loss"];
        const FP32_SET_OPT_DTYPE: &[&str] = &["softmax", "log_softmax", "sum", "prod", "cumsum"];
        let aten = |op: OpKind| match op {
            OpKind::Matmul => "matmul",
            OpKind::Linear => "linear",
            OpKind::Conv2d => "conv2d",
            OpKind::Attention => "scaled_dot_product_attention",
            OpKind::Softmax => "softmax",
            OpKind::LogSoftmax => "log_softmax",
            OpKind::Loss => "nll_loss",
            OpKind::LayerNorm => "layer_norm",
            OpKind::Exp => "exp",
            OpKind::Log => "log",
            OpKind::Sum => "sum",
            OpKind::Mean => "mean",
            OpKind::Add => "add",
            OpKind::Mul => "mul",
            OpKind::Activation => "gelu",
            OpKind::Other(name) => name,
        };
        let p = AutocastPolicy::bf16();
        for (op, class) in p.table() {
            let name = aten(op);
            let want = if LOWER_PRECISION_FP.contains(&name) {
                OpClass::LowPrecision
            } else if FP32.contains(&name) || FP32_SET_OPT_DTYPE.contains(&name) {
                OpClass::F32
            } else {
                OpClass::Promote
            };
            assert_eq!(class, want, "{op:?} ({name})");
        }
        // Regression: a mean used to be classed with the sums (f32); PyTorch lists no mean,
        // so it keeps a 16-bit input's dtype.
        assert_eq!(p.dtype_for(OpKind::Mean, &[DType::BF16]), DType::BF16);
        assert_eq!(p.dtype_for(OpKind::Sum, &[DType::BF16]), DType::F32);
    }

    #[test]
    fn f32_is_rejected_as_the_low_dtype() {
        assert!(matches!(AutocastPolicy::new(DType::F32), Err(Error::InvalidConfig { .. })));
        assert_eq!(AutocastPolicy::new(DType::BF16).unwrap(), AutocastPolicy::bf16());
    }

    #[test]
    fn overrides_replace_table_entries_and_name_new_ops() {
        let p = AutocastPolicy::f16()
            .with_class(OpKind::Softmax, OpClass::LowPrecision)
            .with_class(OpKind::Other("rope"), OpClass::F32);
        assert_eq!(p.class_of(OpKind::Softmax), OpClass::LowPrecision);
        assert_eq!(p.dtype_for(OpKind::Other("rope"), &[DType::F16]), DType::F32);
        assert_eq!(p.class_of(OpKind::Other("unlisted")), OpClass::Promote);
        assert_eq!(p.table().count(), DEFAULT_TABLE.len() + 1);
    }
}
