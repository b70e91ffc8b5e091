//! The CPU reference implementation of every op: plain functions over slices.
//!
//! Storage is in the element type `T`; arithmetic and accumulation are in f32. Every
//! function checks that its slices have the lengths its layout needs and returns an
//! [`Error::InvalidArgument`] otherwise (it writes nothing then); the geometry types it
//! takes ([`MatmulSpec`](crate::MatmulSpec), [`Conv2dParams`](crate::Conv2dParams),
//! [`Pool2dParams`](crate::Pool2dParams)) and the optimizer configurations come from the
//! parameter module below this one, checked where the op layer makes them.

pub mod activation;
pub mod batch_norm;
pub mod conv;
pub mod elementwise;
pub mod embedding;
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

use crate::error::{Error, Result};

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
