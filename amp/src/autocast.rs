//! Autocast scopes: a per-thread current policy that nests, and ops that cast their inputs
//! to the dtype the current policy assigns them.
//!
//! [`autocast`] enters a scope with a policy, [`disable_autocast`] a scope without one; each
//! returns a guard that restores the enclosing state when dropped, so scopes nest like
//! PyTorch's `with torch.autocast(...)` blocks. Outside any scope (or in a disabled one) the
//! ops in [`ops`] promote mixed inputs to the widest dtype and otherwise run in the inputs'
//! own dtype.
//!
//! These ops cast every input on every call. PyTorch also caches the 16-bit casts of f32
//! parameters for the duration of the autocast region (`cached_cast` in
//! `aten/src/ATen/autocast_mode.cpp`); tensors here do not know whether they are parameters,
//! so that cache lives with the layers that own them: vram-accum's `ForwardCtx`.

use crate::error::Result;
use crate::policy::{AutocastPolicy, OpKind, widest};
use std::cell::RefCell;
use std::marker::PhantomData;
use std::ops::Deref;
use vram_kernels::{DType, Tensor};

thread_local! {
    static CURRENT: RefCell<Option<AutocastPolicy>> = const { RefCell::new(None) };
}

/// Restores the enclosing autocast state when dropped. Tied to its thread (not `Send`).
#[must_use = "the scope ends when the guard is dropped"]
#[derive(Debug)]
pub struct AutocastGuard {
    previous: Option<AutocastPolicy>,
    _thread_bound: PhantomData<*const ()>,
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        let previous = self.previous.take();
        CURRENT.with(|c| *c.borrow_mut() = previous);
    }
}

fn enter(policy: Option<AutocastPolicy>) -> AutocastGuard {
    let previous = CURRENT.with(|c| c.replace(policy));
    AutocastGuard { previous, _thread_bound: PhantomData }
}

/// Enables autocast with `policy` on this thread until the guard is dropped.
pub fn autocast(policy: AutocastPolicy) -> AutocastGuard {
    enter(Some(policy))
}

/// Disables autocast on this thread until the guard is dropped (e.g. for a numerically
/// sensitive region inside an autocast scope).
pub fn disable_autocast() -> AutocastGuard {
    enter(None)
}

/// The policy in force on this thread, `None` when autocast is off.
pub fn current_policy() -> Option<AutocastPolicy> {
    CURRENT.with(|c| c.borrow().clone())
}

/// Whether autocast is on for this thread.
pub fn is_enabled() -> bool {
    CURRENT.with(|c| c.borrow().is_some())
}

/// The dtype `op` computes in for inputs of `inputs`' dtypes under the current state: the
/// policy's choice when enabled, the widest input dtype otherwise.
pub fn op_dtype(op: OpKind, inputs: &[DType]) -> DType {
    CURRENT.with(|c| match &*c.borrow() {
        Some(p) => p.dtype_for(op, inputs),
        None => widest(inputs),
    })
}

/// A tensor as an op should see it: the caller's own when it already had the right dtype,
/// or a cast copy (which allocates, and is freed when this is dropped).
#[derive(Debug)]
pub enum Casted<'a> {
    /// The input itself, no copy.
    Borrowed(&'a Tensor),
    /// A converted copy.
    Owned(Tensor),
}

impl Deref for Casted<'_> {
    type Target = Tensor;
    fn deref(&self) -> &Tensor {
        match self {
            Casted::Borrowed(t) => t,
            Casted::Owned(t) => t,
        }
    }
}

/// `t` in `dtype`, copying only when its dtype differs.
///
/// # Errors
///
/// Out of memory for the copy.
pub fn cast_to(t: &Tensor, dtype: DType) -> Result<Casted<'_>> {
    if t.dtype() == dtype { Ok(Casted::Borrowed(t)) } else { Ok(Casted::Owned(t.to_dtype(dtype)?)) }
}

/// `inputs` cast to the dtype the current state assigns `op`.
///
/// # Errors
///
/// Out of memory for a copy.
pub fn cast_inputs<'a>(op: OpKind, inputs: &[&'a Tensor]) -> Result<Vec<Casted<'a>>> {
    let dtypes: Vec<DType> = inputs.iter().map(|t| t.dtype()).collect();
    let dtype = op_dtype(op, &dtypes);
    inputs.iter().map(|t| cast_to(t, dtype)).collect()
}

/// Kernels' ops behind autocast: each casts its inputs per the current state, then calls
/// [`vram_kernels::ops`]. Outputs are in the op's compute dtype.
pub mod ops {
    use super::{Casted, cast_inputs};
    use crate::error::Result;
    use crate::policy::OpKind;
    use vram_kernels::Tensor;
    use vram_kernels::ops::{self as k, CrossEntropy};

    fn two<'a>(op: OpKind, a: &'a Tensor, b: &'a Tensor) -> Result<(Casted<'a>, Casted<'a>)> {
        let mut v = cast_inputs(op, &[a, b])?.into_iter();
        match (v.next(), v.next()) {
            (Some(a), Some(b)) => Ok((a, b)),
            _ => unreachable!("cast_inputs returns one tensor per input"),
        }
    }

    /// [`OpKind::Linear`]: `x w^T + bias` ([`vram_kernels::ops::linear`]).
    ///
    /// # Errors
    ///
    /// As the kernel op; out of memory for casts.
    pub fn linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let mut inputs = vec![x, w];
        inputs.extend(bias);
        let c = cast_inputs(OpKind::Linear, &inputs)?;
        Ok(k::linear(&c[0], &c[1], c.get(2).map(|b| &**b))?)
    }

    /// [`OpKind::Matmul`] ([`vram_kernels::ops::matmul`]).
    ///
    /// # Errors
    ///
    /// As the kernel op; out of memory for casts.
    pub fn matmul(a: &Tensor, b: &Tensor, trans_a: bool, trans_b: bool) -> Result<Tensor> {
        let (a, b) = two(OpKind::Matmul, a, b)?;
        Ok(k::matmul(&a, &b, trans_a, trans_b)?)
    }

    /// [`OpKind::Softmax`] over the last dimension ([`vram_kernels::ops::softmax`]).
    ///
    /// # Errors
    ///
    /// As the kernel op; out of memory for the cast.
    pub fn softmax(x: &Tensor) -> Result<Tensor> {
        let c = cast_inputs(OpKind::Softmax, &[x])?;
        Ok(k::softmax(&c[0])?)
    }

    /// [`OpKind::Loss`]: cross-entropy of logits against class targets
    /// ([`vram_kernels::ops::cross_entropy`]). Also returns the logits as cast, which the
    /// backward needs.
    ///
    /// # Errors
    ///
    /// As the kernel op; out of memory for the cast.
    pub fn cross_entropy<'a>(
        logits: &'a Tensor,
        targets: &[u32],
        ignore_index: Option<u32>,
    ) -> Result<(CrossEntropy, Casted<'a>)> {
        let c = cast_inputs(OpKind::Loss, &[logits])?.pop();
        let logits = c.unwrap_or_else(|| unreachable!("one input gives one output"));
        Ok((k::cross_entropy(&logits, targets, ignore_index)?, logits))
    }

    /// [`OpKind::Add`]: `a + b` ([`vram_kernels::ops::add`]).
    ///
    /// # Errors
    ///
    /// As the kernel op; out of memory for casts.
    pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let (a, b) = two(OpKind::Add, a, b)?;
        Ok(k::add(&a, &b)?)
    }

    /// [`OpKind::Mul`]: `a * b` ([`vram_kernels::ops::mul`]).
    ///
    /// # Errors
    ///
    /// As the kernel op; out of memory for casts.
    pub fn mul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let (a, b) = two(OpKind::Mul, a, b)?;
        Ok(k::mul(&a, &b)?)
    }

    /// [`OpKind::Activation`]: ReLU ([`vram_kernels::ops::relu`]).
    ///
    /// # Errors
    ///
    /// As the kernel op; out of memory for the cast.
    pub fn relu(x: &Tensor) -> Result<Tensor> {
        let c = cast_inputs(OpKind::Activation, &[x])?;
        Ok(k::relu(&c[0])?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::OpClass;
    use vram_kernels::Device;

    fn t(dev: &Device, shape: &[usize], dtype: DType) -> Tensor {
        let n = shape.iter().product::<usize>();
        let data: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        Tensor::from_f32_slice(dev, shape, &data, dtype).unwrap()
    }

    #[test]
    fn each_policy_class_produces_the_dtype_it_promises() {
        let dev = Device::host(16 << 20);
        for low in [DType::F16, DType::BF16] {
            let _scope = autocast(AutocastPolicy::new(low).unwrap());
            let (x32, w32) = (t(&dev, &[4, 3], DType::F32), t(&dev, &[2, 3], DType::F32));
            // LowPrecision: f32 inputs run in the low dtype.
            assert_eq!(ops::linear(&x32, &w32, None).unwrap().dtype(), low);
            assert_eq!(ops::matmul(&x32, &w32, false, true).unwrap().dtype(), low);
            // F32: low-precision inputs run in f32.
            let x16 = t(&dev, &[4, 3], low);
            assert_eq!(ops::softmax(&x16).unwrap().dtype(), DType::F32);
            let (ce, cast) = ops::cross_entropy(&x16, &[0, 1, 2, 0], None).unwrap();
            assert_eq!((cast.dtype(), ce.lse.dtype()), (DType::F32, DType::F32));
            // Promote: the widest input wins; one input keeps its dtype.
            assert_eq!(ops::add(&x16, &x32).unwrap().dtype(), DType::F32);
            assert_eq!(ops::mul(&x16, &x16).unwrap().dtype(), low);
            assert_eq!(ops::relu(&x16).unwrap().dtype(), low);
        }
    }

    #[test]
    fn scopes_nest_and_restore_the_enclosing_state() {
        assert!(!is_enabled());
        assert_eq!(op_dtype(OpKind::Linear, &[DType::F32]), DType::F32);
        {
            let _outer = autocast(AutocastPolicy::f16());
            assert_eq!(op_dtype(OpKind::Linear, &[DType::F32]), DType::F16);
            {
                let _off = disable_autocast();
                assert!(!is_enabled());
                assert_eq!(op_dtype(OpKind::Linear, &[DType::F32]), DType::F32);
                {
                    let _inner = autocast(AutocastPolicy::bf16());
                    assert_eq!(op_dtype(OpKind::Linear, &[DType::F32]), DType::BF16);
                }
                assert!(!is_enabled());
            }
            assert_eq!(current_policy(), Some(AutocastPolicy::f16()));
        }
        assert!(!is_enabled());
    }

    #[test]
    fn an_overridden_class_changes_what_the_op_computes_in() {
        let dev = Device::host(16 << 20);
        let policy = AutocastPolicy::f16().with_class(OpKind::Linear, OpClass::F32);
        let _scope = autocast(policy);
        let (x, w) = (t(&dev, &[4, 3], DType::F16), t(&dev, &[2, 3], DType::F16));
        assert_eq!(ops::linear(&x, &w, None).unwrap().dtype(), DType::F32);
    }

    #[test]
    fn inputs_already_in_the_compute_dtype_are_not_copied() {
        let dev = Device::host(16 << 20);
        let x = t(&dev, &[8, 8], DType::F16);
        let before = dev.memory_allocated();
        let _scope = autocast(AutocastPolicy::f16());
        let c = cast_inputs(OpKind::Linear, &[&x]).unwrap();
        assert!(matches!(c[0], Casted::Borrowed(_)));
        assert_eq!(dev.memory_allocated(), before);
        let c = cast_inputs(OpKind::Softmax, &[&x]).unwrap();
        assert!(matches!(c[0], Casted::Owned(_)));
        assert!(dev.memory_allocated() > before);
    }
}
