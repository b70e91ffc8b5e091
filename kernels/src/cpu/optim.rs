//! Fused optimizer updates on f32 master weights, and the fused gradient unscale + inf/NaN
//! check of dynamic loss scaling.
//!
//! Parameters and optimizer state are f32 slices of one length; gradients have the same
//! length and any element type. Each update is one pass over its tensor and follows
//! PyTorch's `torch.optim` formulas (single-tensor path, `maximize=False`).

use super::check_len;
use crate::Element;
use crate::cpu::elementwise::{PAR_CHUNK, PAR_THRESHOLD};
use crate::error::{Error, Result};
use crate::params::{AdamWConfig, SgdConfig};
use rayon::prelude::*;

/// Runs `f` over aligned elements of the f32 state slices and the gradient, in parallel
/// chunks for large tensors.
fn zip_state<T, F>(params: &mut [f32], s1: &mut [f32], s2: &mut [f32], grads: &[T], f: F)
where
    T: Element,
    F: Fn(&mut f32, &mut f32, &mut f32, f32) + Sync,
{
    let run = |p: &mut [f32], a: &mut [f32], b: &mut [f32], g: &[T]| {
        for (((p, a), b), g) in p.iter_mut().zip(a).zip(b).zip(g) {
            f(p, a, b, g.to_f32());
        }
    };
    if params.len() >= PAR_THRESHOLD {
        params
            .par_chunks_mut(PAR_CHUNK)
            .zip(s1.par_chunks_mut(PAR_CHUNK))
            .zip(s2.par_chunks_mut(PAR_CHUNK))
            .zip(grads.par_chunks(PAR_CHUNK))
            .for_each(|(((p, a), b), g)| run(p, a, b, g));
    } else {
        run(params, s1, s2, grads);
    }
}

/// One SGD step on `params` with gradients `grads`.
///
/// With `momentum != 0`, `momentum_buf` (same length as `params`) holds the buffer;
/// `first_step` says it is not yet initialized, in which case it becomes the gradient
/// itself (PyTorch's `buf = g.clone()`). With `momentum == 0` the buffer is unused and may be
/// empty.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for an invalid `cfg` ([`SgdConfig::validate`]) or lengths that
/// differ; nothing is updated then.
pub fn sgd_step<T: Element>(
    params: &mut [f32],
    grads: &[T],
    momentum_buf: &mut [f32],
    first_step: bool,
    cfg: &SgdConfig,
) -> Result<()> {
    const OP: &str = "cpu::sgd_step";
    cfg.validate()?;
    check_len(OP, "grads", grads.len(), params.len())?;
    if cfg.momentum != 0.0 {
        check_len(OP, "the momentum buffer", momentum_buf.len(), params.len())?;
    }
    let SgdConfig { lr, momentum, dampening, weight_decay, nesterov } = *cfg;
    if momentum == 0.0 {
        let run = |p: &mut [f32], g: &[T]| {
            for (p, g) in p.iter_mut().zip(g) {
                let d = g.to_f32() + weight_decay * *p;
                *p -= lr * d;
            }
        };
        if params.len() >= PAR_THRESHOLD {
            params
                .par_chunks_mut(PAR_CHUNK)
                .zip(grads.par_chunks(PAR_CHUNK))
                .for_each(|(p, g)| run(p, g));
        } else {
            run(params, grads);
        }
        return Ok(());
    }
    let run = |p: &mut [f32], b: &mut [f32], g: &[T]| {
        for ((p, b), g) in p.iter_mut().zip(b).zip(g) {
            let d = g.to_f32() + weight_decay * *p;
            *b = if first_step { d } else { momentum * *b + (1.0 - dampening) * d };
            let step = if nesterov { d + momentum * *b } else { *b };
            *p -= lr * step;
        }
    };
    if params.len() >= PAR_THRESHOLD {
        params
            .par_chunks_mut(PAR_CHUNK)
            .zip(momentum_buf.par_chunks_mut(PAR_CHUNK))
            .zip(grads.par_chunks(PAR_CHUNK))
            .for_each(|((p, b), g)| run(p, b, g));
    } else {
        run(params, momentum_buf, grads);
    }
    Ok(())
}

/// One AdamW step: `step` is the 1-based step count `t` (after incrementing) used for bias
/// correction; `exp_avg` (m) and `exp_avg_sq` (v) are the moment buffers, zero before the
/// first step.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for an invalid `cfg` ([`AdamWConfig::validate`]), `step == 0`
/// or lengths that differ; nothing is updated then.
pub fn adamw_step<T: Element>(
    params: &mut [f32],
    grads: &[T],
    exp_avg: &mut [f32],
    exp_avg_sq: &mut [f32],
    step: u32,
    cfg: &AdamWConfig,
) -> Result<()> {
    const OP: &str = "cpu::adamw_step";
    cfg.validate()?;
    if step == 0 {
        return Err(Error::InvalidArgument {
            op: OP,
            reason: "the step count is 1-based; the first step is 1".into(),
        });
    }
    check_len(OP, "grads", grads.len(), params.len())?;
    check_len(OP, "exp_avg", exp_avg.len(), params.len())?;
    check_len(OP, "exp_avg_sq", exp_avg_sq.len(), params.len())?;
    let AdamWConfig { beta1, beta2, eps, .. } = *cfg;
    let (step_size, bias2_sqrt, decay) = cfg.step_scalars(step);
    zip_state(params, exp_avg, exp_avg_sq, grads, |p, m, v, g| {
        *p *= decay;
        *m = beta1 * *m + (1.0 - beta1) * g;
        *v = beta2 * *v + (1.0 - beta2) * g * g;
        let denom = v.sqrt() / bias2_sqrt + eps;
        *p -= step_size * *m / denom;
    });
    Ok(())
}

/// Multiplies one tensor by `inv_scale` in place; returns whether any stored result is
/// non-finite (a non-finite input always gives a non-finite result, and so does an overflow).
fn unscale_one<T: Element>(g: &mut [T], inv_scale: f32) -> bool {
    let run = |g: &mut [T]| {
        let mut bad = false;
        for v in g.iter_mut() {
            *v = T::from_f32(v.to_f32() * inv_scale);
            bad |= !v.to_f32().is_finite();
        }
        bad
    };
    if g.len() >= PAR_THRESHOLD {
        g.par_chunks_mut(PAR_CHUNK).map(run).reduce(|| false, |a, b| a | b)
    } else {
        run(g)
    }
}

/// Fused unscale and inf/NaN detection over many gradient tensors (PyTorch's
/// `_amp_foreach_non_finite_check_and_unscale_`): multiplies every element by `inv_scale` in
/// place, one pass per tensor, and returns `true` if any element was or became inf or NaN.
/// Every tensor is unscaled even after a non-finite value is found.
pub fn unscale_and_check_finite<'a, T: Element>(
    grads: impl IntoIterator<Item = &'a mut [T]>,
    inv_scale: f32,
) -> bool {
    grads.into_iter().fold(false, |found, g| unscale_one(g, inv_scale) | found)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::elementwise::testing::*;
    use crate::cpu::widen_f64;
    use half::{bf16, f16};
    use proptest::prelude::*;
    use proptest::test_runner::TestCaseError;

    /// PyTorch's `_single_tensor_sgd`, literally, in f64.
    fn sgd_ref(p: &mut [f64], g: &[f64], buf: &mut Option<Vec<f64>>, cfg: &SgdConfig) {
        let (lr, mom, damp, wd) = (
            f64::from(cfg.lr),
            f64::from(cfg.momentum),
            f64::from(cfg.dampening),
            f64::from(cfg.weight_decay),
        );
        let mut d: Vec<f64> = g.iter().zip(p.iter()).map(|(g, p)| g + wd * p).collect();
        if mom != 0.0 {
            let b = match buf.take() {
                None => d.clone(),
                Some(b) => b.iter().zip(&d).map(|(b, d)| mom * b + (1.0 - damp) * d).collect(),
            };
            d = if cfg.nesterov {
                d.iter().zip(&b).map(|(d, b)| d + mom * b).collect()
            } else {
                b.clone()
            };
            *buf = Some(b);
        }
        for (p, d) in p.iter_mut().zip(d) {
            *p -= lr * d;
        }
    }

    /// PyTorch's `_single_tensor_adamw` (amsgrad off), literally, in f64.
    fn adamw_ref(p: &mut [f64], g: &[f64], m: &mut [f64], v: &mut [f64], t: i32, c: &AdamWConfig) {
        let (lr, b1, b2, eps, wd) = (
            f64::from(c.lr),
            f64::from(c.beta1),
            f64::from(c.beta2),
            f64::from(c.eps),
            f64::from(c.weight_decay),
        );
        for i in 0..p.len() {
            p[i] *= 1.0 - lr * wd;
            m[i] += (g[i] - m[i]) * (1.0 - b1);
            v[i] = v[i] * b2 + (1.0 - b2) * g[i] * g[i];
            let bc1 = 1.0 - b1.powi(t);
            let bc2 = 1.0 - b2.powi(t);
            let denom = v[i].sqrt() / bc2.sqrt() + eps;
            p[i] -= lr / bc1 * m[i] / denom;
        }
    }

    fn f64s(v: &[f32]) -> Vec<f64> {
        v.iter().map(|&x| f64::from(x)).collect()
    }

    fn check_sgd<T: Element>(
        p0: &[f32],
        grads: &[Vec<f32>],
        cfg: &SgdConfig,
    ) -> Result<(), TestCaseError> {
        let mut p = p0.to_vec();
        let mut buf = vec![0.0f32; p.len()];
        let mut want = f64s(p0);
        let mut want_buf = None;
        for (step, g) in grads.iter().enumerate() {
            let g = round::<T>(g);
            sgd_step(&mut p, &g, &mut buf, step == 0, cfg).unwrap();
            sgd_ref(&mut want, &widen_f64(&g), &mut want_buf, cfg);
        }
        check_close(&f64s(&p), &want, 1e-5)
    }

    fn check_adamw<T: Element>(
        p0: &[f32],
        grads: &[Vec<f32>],
        cfg: &AdamWConfig,
    ) -> Result<(), TestCaseError> {
        let n = p0.len();
        let mut p = p0.to_vec();
        let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
        let mut want = f64s(p0);
        let (mut wm, mut wv) = (vec![0.0f64; n], vec![0.0f64; n]);
        for (step, g) in grads.iter().enumerate() {
            let g = round::<T>(g);
            adamw_step(&mut p, &g, &mut m, &mut v, step as u32 + 1, cfg).unwrap();
            adamw_ref(&mut want, &widen_f64(&g), &mut wm, &mut wv, step as i32 + 1, cfg);
        }
        check_close(&f64s(&p), &want, 1e-5)?;
        check_close(&f64s(&m), &wm, 1e-5)?;
        check_close(&f64s(&v), &wv, 1e-5)
    }

    /// Parameters and five steps of gradients for one tensor.
    fn trajectory() -> impl Strategy<Value = (Vec<f32>, Vec<Vec<f32>>)> {
        (1usize..40).prop_flat_map(|n| (values(n), prop::collection::vec(values(n), 5)))
    }

    fn sgd_config() -> impl Strategy<Value = SgdConfig> {
        (
            0.001f32..0.5,
            prop_oneof![Just(0.0f32), 0.1f32..0.99],
            prop_oneof![Just(0.0f32), 0.0f32..0.5],
            prop_oneof![Just(0.0f32), 0.0f32..0.1],
            any::<bool>(),
        )
            .prop_map(|(lr, momentum, dampening, weight_decay, nesterov)| {
                // PyTorch rejects Nesterov without momentum or with dampening.
                let nesterov = nesterov && momentum > 0.0;
                SgdConfig {
                    lr,
                    momentum,
                    dampening: if nesterov { 0.0 } else { dampening },
                    weight_decay,
                    nesterov,
                }
            })
    }

    fn adamw_config() -> impl Strategy<Value = AdamWConfig> {
        (0.0001f32..0.1, 0.5f32..0.99, 0.9f32..0.9999, 0.0f32..0.1).prop_map(
            |(lr, beta1, beta2, weight_decay)| AdamWConfig {
                lr,
                beta1,
                beta2,
                eps: 1e-8,
                weight_decay,
            },
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        // Five SGD steps match PyTorch's SGD formula in f64, for f32 and 16-bit gradients.
        #[test]
        fn sgd_matches_pytorch_formula_over_steps((p, g) in trajectory(), cfg in sgd_config()) {
            check_sgd::<f32>(&p, &g, &cfg)?;
            check_sgd::<f16>(&p, &g, &cfg)?;
            check_sgd::<bf16>(&p, &g, &cfg)?;
        }

        // Five AdamW steps match PyTorch's AdamW formula in f64 (params and both moments).
        #[test]
        fn adamw_matches_pytorch_formula_over_steps((p, g) in trajectory(), cfg in adamw_config()) {
            check_adamw::<f32>(&p, &g, &cfg)?;
            check_adamw::<bf16>(&p, &g, &cfg)?;
        }

        // An inf or NaN placed at any tensor and index is always reported, whatever the
        // scale.
        #[test]
        fn injected_non_finite_is_always_detected(
            sizes in prop::collection::vec(1usize..50, 1..6),
            which in any::<prop::sample::Index>(),
            at in any::<prop::sample::Index>(),
            bad in prop_oneof![Just(f32::INFINITY), Just(f32::NEG_INFINITY), Just(f32::NAN)],
            inv_scale in prop_oneof![Just(0.0f32), 1e-6f32..1e3],
        ) {
            let mut grads: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![0.5; n]).collect();
            let t = which.index(grads.len());
            let i = at.index(grads[t].len());
            grads[t][i] = bad;
            prop_assert!(unscale_and_check_finite(grads.iter_mut().map(|g| g.as_mut_slice()), inv_scale));
            let mut half: Vec<Vec<f16>> = grads.iter().map(|g| round::<f16>(g)).collect();
            prop_assert!(unscale_and_check_finite(half.iter_mut().map(|g| g.as_mut_slice()), inv_scale));
        }

        // All-finite gradients unscaled by a power of two without overflow or underflow are
        // never flagged and are multiplied exactly (bit-exact), in f32 and f16.
        #[test]
        fn finite_power_of_two_unscale_is_exact_and_unflagged(
            grads in prop::collection::vec(
                prop::collection::vec((1.0f32..2.0, -6i32..7, any::<bool>()), 0..40), 0..5),
            k in -6i32..7,
        ) {
            let inv_scale = 2.0f32.powi(k);
            let values: Vec<Vec<f32>> = grads
                .iter()
                .map(|g| g.iter().map(|&(m, e, s)| if s { -m } else { m } * 2.0f32.powi(e)).collect())
                .collect();
            let mut g32 = values.clone();
            prop_assert!(!unscale_and_check_finite(g32.iter_mut().map(|g| g.as_mut_slice()), inv_scale));
            for (got, orig) in g32.iter().flatten().zip(values.iter().flatten()) {
                prop_assert_eq!(got.to_bits(), (orig * inv_scale).to_bits());
                prop_assert_eq!(f64::from(*got), f64::from(*orig) * f64::from(inv_scale));
            }
            let orig16: Vec<Vec<f16>> = values.iter().map(|g| round::<f16>(g)).collect();
            let mut g16 = orig16.clone();
            prop_assert!(!unscale_and_check_finite(g16.iter_mut().map(|g| g.as_mut_slice()), inv_scale));
            for (got, orig) in g16.iter().flatten().zip(orig16.iter().flatten()) {
                prop_assert_eq!(f64::from(got.to_f32()), f64::from(orig.to_f32()) * f64::from(inv_scale));
            }
        }
    }

    #[test]
    fn overflow_while_unscaling_is_flagged() {
        let mut g = vec![f16::from_f32(60000.0)];
        assert!(unscale_and_check_finite([g.as_mut_slice()], 2.0));
    }
}
