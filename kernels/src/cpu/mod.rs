//! The CPU reference implementation of every op: plain functions over slices.
//!
//! Storage is in the element type `T`; arithmetic and accumulation are in f32. Every
//! function checks that its slices have the lengths its layout needs and returns an
//! [`Error::InvalidArgument`] otherwise (it writes nothing then); the geometry types it
//! takes ([`MatmulSpec`](crate::MatmulSpec), [`Conv2dParams`](crate::Conv2dParams),
//! [`Pool2dParams`](crate::Pool2dParams)) and the optimizer configurations come from the
//! parameter module below this one, checked where the op layer makes them.
//!
//! They are also the host backend users train on, so they are written for speed where it
//! costs no accuracy: products through the `gemm` crate (convolutions as im2col + gemm,
//! attention by blocks of 64 queries and keys), rayon over rows and images, and an `exp`
//! that vectorizes (`fastmath`) for GELU, SiLU, softmax, cross-entropy and attention.
//! `cargo bench -p vram-kernels` measures them (matmul and convolution, elementwise and
//! row-wise ops, cross-entropy, attention).

pub mod activation;
pub mod attention;
pub mod batch_norm;
pub mod conv;
pub mod elementwise;
pub mod embedding;
pub(crate) mod fastmath;
pub mod llama;
pub mod loss;
pub mod matmul;
pub mod norm;
pub mod optim;
pub mod permute;
pub mod pool;
pub mod random;
pub mod reduce;
pub mod scale_channels;
pub mod softmax;

use crate::dtype::Element;
use crate::error::{Error, Result};
use std::any::TypeId;
use std::borrow::Cow;

/// Checks that `what` has `want` elements.
pub(crate) fn check_len(op: &'static str, what: &str, got: usize, want: usize) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(Error::InvalidArgument {
            op,
            reason: format!("{what} has {got} elements; the layout needs {want}"),
        })
    }
}

/// Checks that `what` (`got` elements) is whole rows of `d` elements; returns the rows.
pub(crate) fn rows_of(op: &'static str, what: &str, got: usize, d: usize) -> Result<usize> {
    match got.checked_div(d) {
        Some(rows) if got.is_multiple_of(d) => Ok(rows),
        _ if got == 0 => Ok(0),
        _ => Err(Error::InvalidArgument {
            op,
            reason: format!("{what} has {got} elements, not whole rows of {d}"),
        }),
    }
}

/// Views `x` as f32: borrowed when `T` is f32, widened into a new vector otherwise.
pub(crate) fn widen_f32<T: Element>(x: &[T]) -> Cow<'_, [f32]> {
    if TypeId::of::<T>() == TypeId::of::<f32>() {
        // SAFETY: T is f32 (same TypeId), so the slice already is a `[f32]` of that length.
        Cow::Borrowed(unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<f32>(), x.len()) })
    } else {
        Cow::Owned(x.iter().map(|v| v.to_f32()).collect())
    }
}

/// Runs `f` on `out` as f32: in place when `T` is f32, otherwise on a widened copy that is
/// narrowed back afterwards (widening is exact, so untouched elements are kept).
pub(crate) fn with_f32_out<T: Element, R>(out: &mut [T], f: impl FnOnce(&mut [f32]) -> R) -> R {
    if TypeId::of::<T>() == TypeId::of::<f32>() {
        // SAFETY: T is f32 (same TypeId); the exclusive borrow of `out` is handed on.
        f(unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<f32>(), out.len()) })
    } else {
        let mut tmp: Vec<f32> = out.iter().map(|v| v.to_f32()).collect();
        let r = f(&mut tmp);
        for (o, v) in out.iter_mut().zip(tmp) {
            *o = T::from_f32(v);
        }
        r
    }
}

/// Widens `T` values to f64 (exact): the tests' references compute in f64.
#[cfg(test)]
pub(crate) fn widen_f64<T: Element>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| f64::from(x.to_f32())).collect()
}
