//! In-place tensor conversions the kernels do not offer as ops.

use crate::error::{Error, Result};
use half::{bf16, f16};
use vram_kernels::{DType, Tensor};

/// Runs `$body` with `$T` bound to the storage type of `$dtype`.
macro_rules! with_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F16 => {
                type $T = f16;
                $body
            }
            DType::BF16 => {
                type $T = bf16;
                $body
            }
        }
    };
}

/// Overwrites `dst` with `src` converted to `dst`'s dtype (round-to-nearest-even), in place
/// on every backend (`Tensor::copy_from`), so that the host, a virtual device and a GPU
/// allocate alike.
///
/// # Errors
///
/// [`Error::InvalidArgument`] if the shapes differ; `dst` is unchanged then.
pub(crate) fn cast_into(src: &Tensor, dst: &mut Tensor) -> Result<()> {
    if src.shape() != dst.shape() {
        return Err(Error::InvalidArgument {
            op: "cast_into",
            reason: format!("source shape {:?} != destination {:?}", src.shape(), dst.shape()),
        });
    }
    dst.copy_from(src)?;
    Ok(())
}

/// Whether `t`'s memory is not host-addressable (CUDA), or stands for such memory (virtual).
fn off_host(t: &Tensor) -> bool {
    t.device().is_cuda() || t.device().is_virtual()
}

/// The sum of squares of `t`'s elements: in f64 on the host, through f32 kernel ops on a
/// CUDA (or virtual) device.
pub(crate) fn sum_of_squares(t: &Tensor) -> Result<f64> {
    if off_host(t) {
        let t32 = t.to_dtype(DType::F32)?;
        return Ok(f64::from(vram_kernels::ops::sum(&vram_kernels::ops::mul(&t32, &t32)?)?));
    }
    Ok(with_dtype!(t.dtype(), T => t
        .as_slice::<T>()?
        .iter()
        .map(|v| {
            let v = f64::from(vram_kernels::Element::to_f32(*v));
            v * v
        })
        .sum()))
}
