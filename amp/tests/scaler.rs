//! The loss scaler: the update rule against a reference model, the per-optimizer state
//! machine, skipping, detection, exact unscaling and serialization.

use half::f16;
use proptest::prelude::*;
use vram_amp::{
    AdamW, Error, LossScaler, MasterWeights, OptState, Optimizer, OptimizerId, ScalerConfig,
    ScalerState, Sgd, StepOutcome, WeightLayout, clip_grad_norm,
};
use vram_kernels::{AdamWConfig, DType, Device, SgdConfig, Tensor};

/// An optimizer that holds gradients and records what its steps saw.
struct Probe {
    id: OptimizerId,
    grads: Vec<Tensor>,
    steps: Vec<Vec<Vec<f32>>>,
}

impl Probe {
    fn new(grads: Vec<Tensor>) -> Probe {
        Probe { id: OptimizerId::fresh(), grads, steps: Vec::new() }
    }
}

impl Optimizer for Probe {
    fn id(&self) -> OptimizerId {
        self.id
    }
    fn grads_mut(&mut self) -> Vec<&mut Tensor> {
        self.grads.iter_mut().collect()
    }
    fn step(&mut self) -> vram_amp::Result<()> {
        self.steps.push(self.grads.iter().map(|g| g.to_f32_vec().unwrap()).collect());
        Ok(())
    }
}

fn dev() -> Device {
    Device::host(64 << 20)
}

fn grad(dev: &Device, values: &[f32], dtype: DType) -> Tensor {
    Tensor::from_f32_slice(dev, &[values.len()], values, dtype).unwrap()
}

/// Runs one iteration on a probe whose gradient is finite or not, and returns
/// (scale, growth tracker) after the update.
fn iterate(scaler: &mut LossScaler, dev: &Device, overflow: bool) -> (f32, u32) {
    let v = if overflow { f32::INFINITY } else { 1.0 };
    let mut p = Probe::new(vec![grad(dev, &[v, 2.0], DType::F32)]);
    scaler.step(&mut p).unwrap();
    scaler.update().unwrap();
    (scaler.scale(), scaler.growth_tracker())
}

/// PyTorch's `_amp_update_scale_`, written as a fold over the iterations: the scale lives in
/// f32, each product is taken in f64, and a growth that would overflow is dropped.
fn reference(cfg: &ScalerConfig, overflows: &[bool]) -> Vec<(f32, u32)> {
    overflows
        .iter()
        .scan((cfg.init_scale, 0u32), |(scale, tracker), &inf| {
            if inf {
                *scale = (f64::from(*scale) * cfg.backoff_factor) as f32;
                *tracker = 0;
            } else if *tracker + 1 < cfg.growth_interval {
                *tracker += 1;
            } else {
                let grown = (f64::from(*scale) * cfg.growth_factor) as f32;
                if grown.is_finite() {
                    *scale = grown;
                }
                *tracker = 0;
            }
            Some((*scale, *tracker))
        })
        .collect()
}

#[test]
fn known_vector_from_the_issue() {
    let dev = dev();
    let cfg = ScalerConfig {
        init_scale: 4.0,
        growth_factor: 2.0,
        backoff_factor: 0.25,
        growth_interval: 2,
        ..ScalerConfig::default()
    };
    let mut s = LossScaler::new(cfg).unwrap();
    assert_eq!(iterate(&mut s, &dev, false), (4.0, 1));
    assert_eq!(iterate(&mut s, &dev, false), (8.0, 0));
    assert_eq!(iterate(&mut s, &dev, true), (2.0, 0));
}

#[test]
fn defaults_are_pytorchs() {
    let c = ScalerConfig::default();
    assert_eq!((c.init_scale, c.growth_factor, c.backoff_factor), (65536.0, 2.0, 0.5));
    assert_eq!((c.growth_interval, c.hysteresis, c.enabled), (2000, 1, true));
    assert_eq!(LossScaler::default().scale(), 65536.0);
}

fn config() -> impl Strategy<Value = ScalerConfig> {
    (
        prop_oneof![Just(65536.0f32), 1e-3f32..1e6, Just(f32::MAX / 4.0)],
        prop_oneof![Just(2.0f64), 1.001f64..8.0],
        prop_oneof![Just(0.5f64), 0.01f64..0.999],
        1u32..8,
    )
        .prop_map(|(init_scale, growth_factor, backoff_factor, growth_interval)| {
            ScalerConfig {
                init_scale,
                growth_factor,
                backoff_factor,
                growth_interval,
                ..ScalerConfig::default()
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    // For any settings and any sequence of overflowing/finite iterations, the scaler's
    // (scale, tracker) after each update equals PyTorch's rule; the scale never becomes
    // inf and the tracker stays below the interval.
    #[test]
    fn update_rule_matches_the_reference_model(
        cfg in config(),
        overflows in prop::collection::vec(prop::bool::weighted(0.3), 0..60),
    ) {
        let dev = dev();
        let mut s = LossScaler::new(cfg.clone()).unwrap();
        let want = reference(&cfg, &overflows);
        for (&inf, &(scale, tracker)) in overflows.iter().zip(&want) {
            let got = iterate(&mut s, &dev, inf);
            prop_assert_eq!(got.0.to_bits(), scale.to_bits());
            prop_assert_eq!(got.1, tracker);
            prop_assert!(got.0.is_finite());
            prop_assert!(got.1 < cfg.growth_interval);
        }
        let skipped = overflows.iter().filter(|&&b| b).count() as u64;
        prop_assert_eq!(s.counters().steps_skipped, skipped);
        prop_assert_eq!(s.counters().steps_taken, overflows.len() as u64 - skipped);
    }

    // With hysteresis h, the scale backs off only on the h-th and later overflowing
    // iterations of a run, and min/max clamps hold the scale inside [min, max].
    #[test]
    fn hysteresis_and_clamps_bound_the_scale(
        h in 1u32..4,
        overflows in prop::collection::vec(prop::bool::weighted(0.5), 0..60),
    ) {
        let dev = dev();
        let cfg = ScalerConfig {
            init_scale: 64.0,
            growth_interval: 2,
            hysteresis: h,
            min_scale: Some(8.0),
            max_scale: Some(256.0),
            ..ScalerConfig::default()
        };
        let mut s = LossScaler::new(cfg).unwrap();
        let mut run = 0;
        for &inf in &overflows {
            let before = s.scale();
            let (after, _) = iterate(&mut s, &dev, inf);
            run = if inf { run + 1 } else { 0 };
            prop_assert!((8.0..=256.0).contains(&after));
            if inf {
                let want = if run >= h { (before / 2.0).max(8.0) } else { before };
                prop_assert_eq!(after, want);
            } else {
                prop_assert!(after >= before);
            }
        }
    }

    // An inf or NaN injected at any tensor and index (of any dtype) is always detected, and
    // all-finite gradients are never flagged.
    #[test]
    fn injected_non_finite_is_always_detected(
        sizes in prop::collection::vec((1usize..40, 0usize..3), 1..5),
        which in any::<prop::sample::Index>(),
        at in any::<prop::sample::Index>(),
        bad in prop_oneof![Just(f32::INFINITY), Just(f32::NEG_INFINITY), Just(f32::NAN)],
    ) {
        let dev = dev();
        let dtypes = [DType::F32, DType::F16, DType::BF16];
        let make = |poison: Option<(usize, usize)>| {
            let grads = sizes.iter().enumerate().map(|(t, &(n, d))| {
                let mut v: Vec<f32> = (0..n).map(|i| (i as f32 - 7.0) * 0.25).collect();
                if let Some((pt, pi)) = poison && pt == t {
                    v[pi] = bad;
                }
                grad(&dev, &v, dtypes[d])
            });
            Probe::new(grads.collect())
        };
        let t = which.index(sizes.len());
        let i = at.index(sizes[t].0);
        let mut s = LossScaler::default();
        let mut finite = make(None);
        prop_assert!(!s.unscale(&mut finite).unwrap());
        prop_assert_eq!(s.step(&mut finite).unwrap(), StepOutcome::Stepped);
        let mut poisoned = make(Some((t, i)));
        prop_assert!(s.unscale(&mut poisoned).unwrap());
        prop_assert_eq!(s.step(&mut poisoned).unwrap(), StepOutcome::Skipped);
        prop_assert!(poisoned.steps.is_empty());
    }

    // Gradients scaled by a power of two 2^k and unscaled by the scaler come back
    // bit-exactly (f32 and f16, values and products kept in the normal range).
    #[test]
    fn power_of_two_unscale_is_bit_exact(
        mantissas in prop::collection::vec((1.0f32..2.0, -8i32..4, any::<bool>()), 1..64),
        k in 0i32..10,
    ) {
        let dev = dev();
        let values: Vec<f32> = mantissas
            .iter()
            .map(|&(m, e, neg)| if neg { -m } else { m } * 2.0f32.powi(e))
            .collect();
        let scale = 2.0f32.powi(k);
        let scaled: Vec<f32> = values.iter().map(|v| v * scale).collect();
        let cfg = ScalerConfig { init_scale: scale, ..ScalerConfig::default() };
        let mut s = LossScaler::new(cfg).unwrap();
        let mut p = Probe::new(vec![
            grad(&dev, &scaled, DType::F32),
            grad(&dev, &scaled, DType::F16),
        ]);
        prop_assert!(!s.unscale(&mut p).unwrap());
        let back32 = p.grads[0].as_slice::<f32>().unwrap();
        for (got, want) in back32.iter().zip(&values) {
            prop_assert_eq!(got.to_bits(), want.to_bits());
        }
        let back16 = p.grads[1].as_slice::<f16>().unwrap();
        for (got, want) in back16.iter().zip(&values) {
            prop_assert_eq!(got.to_bits(), f16::from_f32(*want).to_bits());
        }
    }
}

#[test]
fn misuse_of_the_state_machine_is_an_error_not_a_panic() {
    let dev = dev();
    let mut s = LossScaler::default();
    let mut p = Probe::new(vec![grad(&dev, &[1.0], DType::F32)]);
    assert!(matches!(s.update(), Err(Error::NoInfChecks)));
    assert_eq!(s.stage(p.id()), OptState::Ready);
    s.unscale(&mut p).unwrap();
    assert_eq!(s.stage(p.id()), OptState::Unscaled);
    assert!(matches!(s.unscale(&mut p), Err(Error::AlreadyUnscaled { .. })));
    s.step(&mut p).unwrap();
    assert_eq!(s.stage(p.id()), OptState::Stepped);
    assert!(matches!(s.step(&mut p), Err(Error::AlreadyStepped { .. })));
    let e = s.unscale(&mut p).unwrap_err();
    assert!(matches!(e, Error::UnscaleAfterStep { .. }));
    assert!(e.to_string().contains("update()"), "{e}");
    // The gradient was unscaled exactly once.
    assert_eq!(p.grads[0].to_f32_vec().unwrap(), [1.0 / 65536.0]);
    s.update().unwrap();
    assert_eq!(s.stage(p.id()), OptState::Ready);
    s.step(&mut p).unwrap();
}

#[test]
fn step_skips_only_the_optimizer_that_overflowed_and_update_backs_off_for_all() {
    let dev = dev();
    let mut s = LossScaler::default();
    let mut ok = Probe::new(vec![grad(&dev, &[2.0], DType::F32)]);
    let mut bad = Probe::new(vec![grad(&dev, &[f32::NAN], DType::F16)]);
    assert_eq!(s.step(&mut ok).unwrap(), StepOutcome::Stepped);
    assert_eq!(s.step(&mut bad).unwrap(), StepOutcome::Skipped);
    assert_eq!((s.found_inf(ok.id()), s.found_inf(bad.id())), (Some(false), Some(true)));
    s.update().unwrap();
    assert_eq!(s.scale(), 32768.0);
    assert_eq!((s.counters().steps_taken, s.counters().steps_skipped), (1, 1));
    assert_eq!(s.counters().scale_history.last().map(|c| (c.update, c.scale)), Some((1, 32768.0)));
}

#[test]
fn unscale_before_clipping_is_not_undone_by_step() {
    let dev = dev();
    let mut s =
        LossScaler::new(ScalerConfig { init_scale: 4.0, ..ScalerConfig::default() }).unwrap();
    let mut p = Probe::new(vec![grad(&dev, &[12.0, 16.0], DType::F32)]);
    s.unscale(&mut p).unwrap();
    let norm = clip_grad_norm(&mut p.grads_mut(), 1.0).unwrap();
    assert_eq!(norm, 5.0); // the true (unscaled) norm of [3, 4]
    s.step(&mut p).unwrap();
    let seen = &p.steps[0][0];
    assert!((seen[0] - 0.6).abs() < 1e-6 && (seen[1] - 0.8).abs() < 1e-6, "{seen:?}");
}

#[test]
fn a_disabled_scaler_is_a_transparent_pass_through() {
    let dev = dev();
    let mut s = LossScaler::disabled();
    assert_eq!((s.scale(), s.scale_loss(0.75)), (1.0, 0.75));
    let t = grad(&dev, &[3.0, -1.0], DType::BF16);
    assert_eq!(s.scale_tensor(&t).unwrap().to_f32_vec().unwrap(), t.to_f32_vec().unwrap());
    let mut p = Probe::new(vec![grad(&dev, &[f32::INFINITY, 8.0], DType::BF16)]);
    assert!(!s.unscale(&mut p).unwrap());
    assert_eq!(s.step(&mut p).unwrap(), StepOutcome::Stepped);
    assert_eq!(p.steps[0][0], [f32::INFINITY, 8.0]); // untouched, and stepped anyway
    s.update().unwrap();
    s.update().unwrap();
    assert_eq!(s.scale(), 1.0);
}

#[test]
fn scale_multiplies_losses_and_tensors() {
    let dev = dev();
    let s = LossScaler::default();
    assert_eq!(s.scale_loss(0.5), 32768.0);
    let t = grad(&dev, &[1.0, -2.0], DType::F32);
    assert_eq!(s.scale_tensor(&t).unwrap().to_f32_vec().unwrap(), [65536.0, -131072.0]);
    let odd = LossScaler::new(ScalerConfig { init_scale: 3.0, ..ScalerConfig::default() }).unwrap();
    assert_eq!(odd.inv_scale(), (1.0f64 / 3.0) as f32);
}

#[test]
fn state_serializes_and_restores_exactly() {
    let dev = dev();
    let cfg = ScalerConfig {
        init_scale: 3.3,
        growth_interval: 3,
        hysteresis: 2,
        min_scale: Some(0.01),
        ..ScalerConfig::default()
    };
    let mut a = LossScaler::new(cfg).unwrap();
    for inf in [false, true, false, false, false, true, true, false] {
        iterate(&mut a, &dev, inf);
    }
    let json = serde_json::to_string(a.state()).unwrap();
    let restored: ScalerState = serde_json::from_str(&json).unwrap();
    assert_eq!(&restored, a.state());
    let mut b = LossScaler::from_state(restored).unwrap();
    for inf in [true, true, false, false, false, false] {
        assert_eq!(iterate(&mut a, &dev, inf), iterate(&mut b, &dev, inf));
    }
    assert_eq!(a.state(), b.state());
    assert_eq!(a.scale().to_bits(), b.scale().to_bits());
}

#[test]
fn invalid_settings_and_states_are_rejected() {
    let bad = |c: ScalerConfig| matches!(LossScaler::new(c), Err(Error::InvalidConfig { .. }));
    let d = ScalerConfig::default;
    assert!(bad(ScalerConfig { init_scale: f32::INFINITY, ..d() }));
    assert!(bad(ScalerConfig { growth_factor: 1.0, ..d() }));
    assert!(bad(ScalerConfig { backoff_factor: 1.0, ..d() }));
    assert!(bad(ScalerConfig { growth_interval: 0, ..d() }));
    assert!(bad(ScalerConfig { hysteresis: 0, ..d() }));
    assert!(bad(ScalerConfig { max_scale: Some(2.0), ..d() }));
    let mut state = LossScaler::default().state().clone();
    state.growth_tracker = 2000;
    assert!(LossScaler::from_state(state).is_err());
}

fn weights(dev: &Device) -> MasterWeights {
    let p = Tensor::from_f32_slice(dev, &[4], &[0.5, -1.0, 2.0, 0.25], DType::F32).unwrap();
    MasterWeights::new(WeightLayout::CastPerStep(DType::F16), vec![p]).unwrap()
}

fn set_grad(opt: &mut impl HasWeights, dev: &Device, v: f32) {
    let g = Tensor::from_f32_slice(dev, &[4], &[v, 1.0, -2.0, 0.5], DType::F16).unwrap();
    opt.weights_mut().set_grad(0, g).unwrap();
}

trait HasWeights: Optimizer {
    fn weights_mut(&mut self) -> &mut MasterWeights;
    fn state_bits(&self) -> Vec<u32>;
}

impl HasWeights for Sgd {
    fn weights_mut(&mut self) -> &mut MasterWeights {
        Sgd::weights_mut(self)
    }
    fn state_bits(&self) -> Vec<u32> {
        let m = self.weights().master()[0].as_slice::<f32>().unwrap().iter();
        let b = self.momentum_buffer(0).unwrap().as_slice::<f32>().unwrap().iter();
        m.chain(b).map(|v| v.to_bits()).collect()
    }
}

impl HasWeights for AdamW {
    fn weights_mut(&mut self) -> &mut MasterWeights {
        AdamW::weights_mut(self)
    }
    fn state_bits(&self) -> Vec<u32> {
        let (m, v, step) = self.moments(0).unwrap();
        let p = self.weights().master()[0].as_slice::<f32>().unwrap().iter();
        let mv = m.as_slice::<f32>().unwrap().iter().chain(v.as_slice::<f32>().unwrap());
        p.chain(mv).map(|v| v.to_bits()).chain([step]).collect()
    }
}

fn check_skip_is_bit_identical(mut opt: impl HasWeights, dev: &Device) {
    let mut s = LossScaler::default();
    set_grad(&mut opt, dev, 3.0 * 4096.0);
    assert_eq!(s.step(&mut opt).unwrap(), StepOutcome::Stepped);
    s.update().unwrap();
    let before = opt.state_bits();
    set_grad(&mut opt, dev, f32::INFINITY);
    assert_eq!(s.step(&mut opt).unwrap(), StepOutcome::Skipped);
    s.update().unwrap();
    assert_eq!(opt.state_bits(), before);
    // Sabotage check: a finite gradient does change the state.
    set_grad(&mut opt, dev, 1.0);
    assert_eq!(s.step(&mut opt).unwrap(), StepOutcome::Stepped);
    assert_ne!(opt.state_bits(), before);
}

#[test]
fn a_skipped_step_leaves_parameters_and_optimizer_state_bit_identical() {
    let dev = dev();
    let sgd =
        SgdConfig { lr: 0.1, momentum: 0.9, dampening: 0.0, weight_decay: 0.01, nesterov: true };
    check_skip_is_bit_identical(Sgd::new(weights(&dev), sgd), &dev);
    let adamw = AdamWConfig { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
    check_skip_is_bit_identical(AdamW::new(weights(&dev), adamw), &dev);
}
