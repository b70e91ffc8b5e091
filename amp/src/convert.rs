//! In-place tensor conversions the kernels do not offer as ops.

use crate::error::{Error, Result};
use half::{bf16, f16};
use vram_kernels::{DType, Tensor, cpu::elementwise::cast};

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

/// Overwrites `dst` with `src` converted to `dst`'s dtype (round-to-nearest-even), without
/// allocating on the host. Tensors in CUDA memory are not host-addressable: there `dst` is
/// replaced by a converted copy (kernels has no in-place cast op yet).
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
    if src.device().is_cuda() || dst.device().is_cuda() {
        *dst = src.to_dtype(dst.dtype())?;
        return Ok(());
    }
    with_dtype!(src.dtype(), S => with_dtype!(dst.dtype(), D => {
        cast(src.as_slice::<S>()?, dst.as_mut_slice::<D>()?)
    }))?;
    Ok(())
}

/// The sum of squares of `t`'s elements: in f64 on the host, through f32 kernel ops on a
/// CUDA device.
pub(crate) fn sum_of_squares(t: &Tensor) -> Result<f64> {
    if t.device().is_cuda() {
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
