//! Activations: ReLU and GELU (tanh approximation), forward and backward.
//!
//! All slices are contiguous and of equal length; the backward functions take the forward
//! input `x` (not the output) and the upstream gradient `dy`.

use super::check_len;
use crate::Element;
use crate::cpu::elementwise::{map_into, zip_map_into};
use crate::cpu::fastmath::sigmoid;
use crate::error::Result;

/// `sqrt(2 / pi)`, the scale inside GELU's tanh approximation.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
/// The cubic coefficient of GELU's tanh approximation.
const GELU_COEF: f32 = 0.044_715;

/// `y = max(x, 0)`.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if the lengths differ.
pub fn relu<T: Element>(x: &[T], y: &mut [T]) -> Result<()> {
    check_len("cpu::relu", "y", y.len(), x.len())?;
    map_into(x, y, |v| T::from_f32(relu_f32(v.to_f32())));
    Ok(())
}

#[inline]
pub(crate) fn relu_f32(x: f32) -> f32 {
    x.max(0.0)
}

/// Backward of [`relu`]: `dx = dy` where `x > 0`, else 0 (the subgradient at 0 is 0, as in
/// PyTorch).
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if the lengths differ.
pub fn relu_backward<T: Element>(x: &[T], dy: &[T], dx: &mut [T]) -> Result<()> {
    check_len("cpu::relu_backward", "dy", dy.len(), x.len())?;
    check_len("cpu::relu_backward", "dx", dx.len(), x.len())?;
    zip_map_into(x, dy, dx, |v, g| if v.to_f32() > 0.0 { g } else { T::from_f32(0.0) });
    Ok(())
}

// GELU's tanh form written with a sigmoid: `1 + tanh(u) = 2 sigmoid(2u)`, so
// `gelu(x) = x sigmoid(2u)` with `u = sqrt(2/pi) (x + 0.044715 x^3)`, and with `s =
// sigmoid(2u)`, `1 - tanh(u)^2 = 4 s (1 - s)`: the same function, without `tanhf` (a libm
// call per element) and without `1 + tanh` cancelling for negative x.
#[inline(always)]
pub(crate) fn gelu_f32(x: f32) -> f32 {
    let inner = SQRT_2_OVER_PI * (x + GELU_COEF * x * x * x);
    x * sigmoid(2.0 * inner)
}

#[inline(always)]
pub(crate) fn gelu_grad_f32(x: f32) -> f32 {
    let inner = SQRT_2_OVER_PI * (x + GELU_COEF * x * x * x);
    let s = sigmoid(2.0 * inner);
    let d_inner = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_COEF * x * x);
    s + 2.0 * x * s * (1.0 - s) * d_inner
}

/// GELU with the tanh approximation (PyTorch's `gelu(x, approximate='tanh')`):
/// `y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if the lengths differ.
pub fn gelu<T: Element>(x: &[T], y: &mut [T]) -> Result<()> {
    check_len("cpu::gelu", "y", y.len(), x.len())?;
    map_into(x, y, |v| T::from_f32(gelu_f32(v.to_f32())));
    Ok(())
}

/// Backward of [`gelu`]: `dx = dy * gelu'(x)`.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if the lengths differ.
pub fn gelu_backward<T: Element>(x: &[T], dy: &[T], dx: &mut [T]) -> Result<()> {
    check_len("cpu::gelu_backward", "dy", dy.len(), x.len())?;
    check_len("cpu::gelu_backward", "dx", dx.len(), x.len())?;
    zip_map_into(x, dy, dx, |v, g| T::from_f32(g.to_f32() * gelu_grad_f32(v.to_f32())));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::elementwise::testing::*;
    use crate::cpu::widen_f64;
    use half::{bf16, f16};
    use proptest::prelude::*;
    use proptest::test_runner::TestCaseError;

    fn gelu_ref(x: f64) -> f64 {
        let k = (2.0 / std::f64::consts::PI).sqrt();
        0.5 * x * (1.0 + (k * (x + 0.044715 * x * x * x)).tanh())
    }

    fn check_forward<T: Element>(x: &[f32]) -> Result<(), TestCaseError> {
        let x = round::<T>(x);
        let wx = widen_f64(&x);
        let mut y = vec![T::default(); x.len()];
        relu(&x, &mut y).unwrap();
        let want: Vec<f64> = wx.iter().map(|v| v.max(0.0)).collect();
        check_close(&widen_f64(&y), &want, tol::<T>())?;
        gelu(&x, &mut y).unwrap();
        let want: Vec<f64> = wx.iter().map(|&v| gelu_ref(v)).collect();
        check_close(&widen_f64(&y), &want, tol::<T>())
    }

    fn weighted(y: &[f32], r: &[f32]) -> f64 {
        y.iter().zip(r).map(|(&y, &r)| f64::from(y) * f64::from(r)).sum()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        // relu and gelu match an f64 reference from the same rounded inputs, every type.
        #[test]
        fn forward_matches_f64_reference(x in (0usize..70).prop_flat_map(values)) {
            check_forward::<f32>(&x)?;
            check_forward::<f16>(&x)?;
            check_forward::<bf16>(&x)?;
        }

        // gelu_backward is the gradient of L = sum(gelu(x) * r).
        #[test]
        fn gelu_backward_matches_finite_differences(
            (x, r) in (1usize..40).prop_flat_map(|n| (values(n), values(n)))
        ) {
            let loss = |x: &[f32]| {
                let mut y = vec![0.0f32; x.len()];
                gelu(x, &mut y).unwrap();
                weighted(&y, &r)
            };
            let mut dx = vec![0.0f32; x.len()];
            gelu_backward(&x, &r, &mut dx).unwrap();
            check_grad(loss, &x, &dx, 1e-2, 1e-2)?;
        }

        // relu_backward is the gradient of L = sum(relu(x) * r) away from the kink at 0.
        #[test]
        fn relu_backward_matches_finite_differences(
            (x, r) in (1usize..40).prop_flat_map(|n| (values(n), values(n)))
        ) {
            let x: Vec<f32> = x.into_iter().map(|v| if v.abs() < 0.05 { 0.5 } else { v }).collect();
            let loss = |x: &[f32]| {
                let mut y = vec![0.0f32; x.len()];
                relu(x, &mut y).unwrap();
                weighted(&y, &r)
            };
            let mut dx = vec![0.0f32; x.len()];
            relu_backward(&x, &r, &mut dx).unwrap();
            check_grad(loss, &x, &dx, 1e-2, 1e-2)?;
        }
    }

    #[test]
    fn gelu_matches_pytorch_tanh_values() {
        // torch.nn.functional.gelu(torch.tensor([-1., 0.5, 2.]), approximate='tanh')
        let x = [-1.0f32, 0.5, 2.0];
        let mut y = [0.0f32; 3];
        gelu(&x, &mut y).unwrap();
        let want = [-0.158_808_f32, 0.345_714, 1.954_598];
        for (g, w) in y.iter().zip(want) {
            assert!((g - w).abs() < 1e-5, "{g} vs {w}");
        }
    }
}
