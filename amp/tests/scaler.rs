//! The loss scaler: the update rule against a reference model, the per-optimizer state
//! machine, skipping, detection, exact unscaling and serialization.

use half::f16;
use proptest::prelude::*;
use vram_amp::{
    AdamW, Error, LossScaler, MasterWeights, OptState, Optimizer, OptimizerId, Param, Params,
    ScalerConfig, ScalerState, Sgd, StepOutcome, WeightLayout, clip_grad_norm,
};
use vram_kernels::{AdamWConfig, DType, Device, SgdConfig, Tensor};

/// An optimizer that records the gradients its steps saw.
struct Probe {
    id: OptimizerId,
    steps: Vec<Vec<Vec<f32>>>,
}

impl Probe {
    fn new() -> Probe {
        Probe { id: OptimizerId::fresh(), steps: Vec::new() }
    }
}

impl Optimizer for Probe {
    fn id(&self) -> OptimizerId {
        self.id
    }
    fn step(&mut self, params: &mut dyn Params) -> vram_amp::Result<()> {
        self.steps.push(params.grads_mut().iter().map(|g| g.to_f32_vec().unwrap()).collect());
        Ok(())
    }
}

/// Parameters holding `grads` as their gradients.
fn with_grads(grads: Vec<Tensor>) -> Vec<Param> {
    grads
        .into_iter()
        .map(|g| {
            let mut p = Param::new("p", Tensor::zeros(g.device(), g.shape(), g.dtype()).unwrap());
            p.grad = Some(g);
            p
        })
        .collect()
}

fn grad_of(p: &[Param], i: usize) -> &Tensor {
    p[i].grad.as_ref().unwrap()
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
    let mut p = with_grads(vec![grad(dev, &[v, 2.0], DType::F32)]);
    scaler.step(&mut Probe::new(), &mut p).unwrap();
    scaler.update().unwrap();
    (scaler.scale(), scaler.growth_tracker())
}

/// PyTorch's `_amp_update_scale_`, written as a fold over the iterations: the scale lives in
/// f32, each product is taken in f64, and a growth that would overflow is dropped. A backoff
/// stops at `min_scale`, where PyTorch would go on to subnormal scales and then 0.
fn reference(cfg: &ScalerConfig, overflows: &[bool]) -> Vec<(f32, u32)> {
    overflows
        .iter()
        .scan((cfg.init_scale, 0u32), |(scale, tracker), &inf| {
            if inf {
                *scale = ((f64::from(*scale) * cfg.backoff_factor) as f32).max(cfg.min_scale);
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
            min_scale: 8.0,
            max_scale: 256.0,
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
            with_grads(grads.collect())
        };
        let t = which.index(sizes.len());
        let i = at.index(sizes[t].0);
        let mut s = LossScaler::default();
        let (mut finite, mut finite_opt) = (make(None), Probe::new());
        prop_assert!(!s.unscale(&finite_opt, &mut finite).unwrap());
        prop_assert_eq!(s.step(&mut finite_opt, &mut finite).unwrap(), StepOutcome::Stepped);
        let (mut poisoned, mut poisoned_opt) = (make(Some((t, i))), Probe::new());
        prop_assert!(s.unscale(&poisoned_opt, &mut poisoned).unwrap());
        prop_assert_eq!(s.step(&mut poisoned_opt, &mut poisoned).unwrap(), StepOutcome::Skipped);
        prop_assert!(poisoned_opt.steps.is_empty());
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
        let mut p = with_grads(vec![
            grad(&dev, &scaled, DType::F32),
            grad(&dev, &scaled, DType::F16),
        ]);
        prop_assert!(!s.unscale(&Probe::new(), &mut p).unwrap());
        let back32 = grad_of(&p, 0).as_slice::<f32>().unwrap();
        for (got, want) in back32.iter().zip(&values) {
            prop_assert_eq!(got.to_bits(), want.to_bits());
        }
        let back16 = grad_of(&p, 1).as_slice::<f16>().unwrap();
        for (got, want) in back16.iter().zip(&values) {
            prop_assert_eq!(got.to_bits(), f16::from_f32(*want).to_bits());
        }
    }
}

#[test]
fn misuse_of_the_state_machine_is_an_error_not_a_panic() {
    let dev = dev();
    let mut s = LossScaler::default();
    let mut p = with_grads(vec![grad(&dev, &[1.0], DType::F32)]);
    let mut o = Probe::new();
    assert!(matches!(s.update(), Err(Error::NoInfChecks)));
    assert_eq!(s.stage(o.id()), OptState::Ready);
    s.unscale(&o, &mut p).unwrap();
    assert_eq!(s.stage(o.id()), OptState::Unscaled);
    assert!(matches!(s.unscale(&o, &mut p), Err(Error::AlreadyUnscaled { .. })));
    s.step(&mut o, &mut p).unwrap();
    assert_eq!(s.stage(o.id()), OptState::Stepped);
    assert!(matches!(s.step(&mut o, &mut p), Err(Error::AlreadyStepped { .. })));
    let e = s.unscale(&o, &mut p).unwrap_err();
    assert!(matches!(e, Error::UnscaleAfterStep { .. }));
    assert!(e.to_string().contains("update()"), "{e}");
    // The gradient was unscaled exactly once.
    assert_eq!(grad_of(&p, 0).to_f32_vec().unwrap(), [1.0 / 65536.0]);
    s.update().unwrap();
    assert_eq!(s.stage(o.id()), OptState::Ready);
    s.step(&mut o, &mut p).unwrap();
}

#[test]
fn step_skips_only_the_optimizer_that_overflowed_and_update_backs_off_for_all() {
    let dev = dev();
    let mut s = LossScaler::default();
    let mut ok = Probe::new();
    let mut bad = Probe::new();
    let mut ok_params = with_grads(vec![grad(&dev, &[2.0], DType::F32)]);
    let mut bad_params = with_grads(vec![grad(&dev, &[f32::NAN], DType::F16)]);
    assert_eq!(s.step(&mut ok, &mut ok_params).unwrap(), StepOutcome::Stepped);
    assert_eq!(s.step(&mut bad, &mut bad_params).unwrap(), StepOutcome::Skipped);
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
    let mut p = with_grads(vec![grad(&dev, &[12.0, 16.0], DType::F32)]);
    let mut o = Probe::new();
    s.unscale(&o, &mut p).unwrap();
    let norm = clip_grad_norm(&mut p, 1.0).unwrap();
    assert_eq!(norm, 5.0); // the true (unscaled) norm of [3, 4]
    s.step(&mut o, &mut p).unwrap();
    let seen = &o.steps[0][0];
    assert!((seen[0] - 0.6).abs() < 1e-6 && (seen[1] - 0.8).abs() < 1e-6, "{seen:?}");
}

#[test]
fn a_disabled_scaler_is_a_transparent_pass_through() {
    let dev = dev();
    let mut s = LossScaler::disabled();
    assert_eq!((s.scale(), s.scale_loss(0.75)), (1.0, 0.75));
    let t = grad(&dev, &[3.0, -1.0], DType::BF16);
    assert_eq!(s.scale_tensor(&t).unwrap().to_f32_vec().unwrap(), t.to_f32_vec().unwrap());
    let mut p = with_grads(vec![grad(&dev, &[f32::INFINITY, 8.0], DType::BF16)]);
    let mut o = Probe::new();
    assert!(!s.unscale(&o, &mut p).unwrap());
    assert_eq!(s.step(&mut o, &mut p).unwrap(), StepOutcome::Stepped);
    assert_eq!(o.steps[0][0], [f32::INFINITY, 8.0]); // untouched, and stepped anyway
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
        min_scale: 0.01,
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
    assert!(bad(ScalerConfig { max_scale: 2.0, ..d() }));
    assert!(bad(ScalerConfig { min_scale: 0.0, ..d() }));
    assert!(bad(ScalerConfig { min_scale: 1e-45, ..d() })); // 1 / min_scale is inf in f32
    assert!(bad(ScalerConfig { max_scale: f32::INFINITY, ..d() }));
    let mut state = LossScaler::default().state().clone();
    state.growth_tracker = 2000;
    assert!(LossScaler::from_state(state).is_err());
}

/// Regression: with the defaults, ~150 overflowing iterations in a row used to take the
/// scale to 0 (and `1 / scale` to inf), after which `from_state` rejected the scaler's own
/// state.
#[test]
fn two_hundred_overflows_in_a_row_stop_at_min_scale_and_the_state_restores() {
    let dev = dev();
    let mut s = LossScaler::default();
    for _ in 0..200 {
        iterate(&mut s, &dev, true);
        assert!(s.scale() >= f32::MIN_POSITIVE);
        assert!(s.inv_scale().is_finite());
    }
    assert_eq!(s.scale(), f32::MIN_POSITIVE);
    let restored = LossScaler::from_state(s.state().clone()).unwrap();
    assert_eq!(restored.state(), s.state());
    // And it recovers from there: growth works from the floor.
    let cfg = ScalerConfig { growth_interval: 1, ..ScalerConfig::default() };
    let mut s = LossScaler::new(cfg).unwrap();
    for _ in 0..200 {
        iterate(&mut s, &dev, true);
    }
    assert_eq!(iterate(&mut s, &dev, false).0, 2.0 * f32::MIN_POSITIVE);
}

#[test]
fn update_to_outside_the_clamps_is_an_error_and_changes_nothing() {
    let cfg =
        ScalerConfig { init_scale: 4.0, min_scale: 1.0, max_scale: 8.0, ..Default::default() };
    let mut s = LossScaler::new(cfg).unwrap();
    for bad in [0.5, 16.0, 0.0, f32::INFINITY, f32::NAN] {
        assert!(matches!(s.update_to(bad), Err(Error::InvalidConfig { .. })), "{bad}");
    }
    assert_eq!((s.scale(), s.counters().updates), (4.0, 0));
    s.update_to(8.0).unwrap();
    assert_eq!(s.scale(), 8.0);
}

/// One event of a scaler's life.
#[derive(Clone, Debug)]
enum Event {
    Finite,
    Overflow,
    UpdateTo(f32),
}

fn events() -> impl Strategy<Value = Vec<Event>> {
    let event = prop_oneof![
        4 => Just(Event::Finite),
        4 => Just(Event::Overflow),
        1 => prop_oneof![Just(0.0f32), Just(f32::MAX), 1e-40f32..1e38].prop_map(Event::UpdateTo),
    ];
    prop::collection::vec(event, 0..300)
}

fn clamped_config() -> impl Strategy<Value = ScalerConfig> {
    (config(), 1u32..4, prop::option::of(-126i32..10), prop::option::of(0i32..128)).prop_map(
        |(cfg, hysteresis, lo, hi)| {
            let min_scale =
                lo.map_or(f32::MIN_POSITIVE, |e| 2.0f64.powi(e) as f32).min(cfg.init_scale);
            let max_scale = hi.map_or(f32::MAX, |e| 2.0f32.powi(e)).max(cfg.init_scale);
            ScalerConfig { hysteresis, min_scale, max_scale, ..cfg }
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    // For any valid settings and any sequence of finite and overflowing iterations and
    // explicit scales (valid or not), the scale stays in [min_scale, max_scale] with a finite
    // inverse, and every state the scaler passes through restores with `from_state`, also
    // after a JSON round trip.
    #[test]
    fn every_state_the_scaler_reaches_stays_in_range_and_restores(
        cfg in clamped_config(),
        events in events(),
    ) {
        let dev = dev();
        let mut s = LossScaler::new(cfg.clone()).unwrap();
        for e in &events {
            match *e {
                Event::Finite => {
                    iterate(&mut s, &dev, false);
                }
                Event::Overflow => {
                    iterate(&mut s, &dev, true);
                }
                Event::UpdateTo(v) => {
                    let ok = s.update_to(v).is_ok();
                    prop_assert_eq!(ok, (cfg.min_scale..=cfg.max_scale).contains(&v));
                }
            }
            prop_assert!((cfg.min_scale..=cfg.max_scale).contains(&s.scale()));
            prop_assert!(s.inv_scale().is_finite() && s.inv_scale() > 0.0);
            let restored = LossScaler::from_state(s.state().clone()).unwrap();
            prop_assert_eq!(restored.state(), s.state());
            // serde_json rounds some f64 settings by an ulp; what it gives back still restores.
            let json = serde_json::to_string(s.state()).unwrap();
            let back: ScalerState = serde_json::from_str(&json).unwrap();
            prop_assert!(LossScaler::from_state(back).is_ok());
        }
    }
}

fn weights(dev: &Device) -> MasterWeights {
    let p = Tensor::from_f32_slice(dev, &[4], &[0.5, -1.0, 2.0, 0.25], DType::F32).unwrap();
    MasterWeights::new(WeightLayout::CastPerStep(DType::F16), vec![p]).unwrap()
}

fn set_grad(w: &mut MasterWeights, dev: &Device, v: f32) {
    let g = Tensor::from_f32_slice(dev, &[4], &[v, 1.0, -2.0, 0.5], DType::F16).unwrap();
    w.set_grad(0, g).unwrap();
}

fn bits(t: &Tensor) -> impl Iterator<Item = u32> + '_ {
    t.as_slice::<f32>().unwrap().iter().map(|v| v.to_bits())
}

trait StateBits: Optimizer {
    fn state_bits(&self, w: &MasterWeights) -> Vec<u32>;
}

impl StateBits for Sgd {
    fn state_bits(&self, w: &MasterWeights) -> Vec<u32> {
        let p = &w.master()[0];
        bits(&p.value).chain(bits(self.momentum_buffer(p.id()).unwrap())).collect()
    }
}

impl StateBits for AdamW {
    fn state_bits(&self, w: &MasterWeights) -> Vec<u32> {
        let p = &w.master()[0];
        let (m, v) = self.moments(p.id()).unwrap();
        bits(&p.value).chain(bits(m)).chain(bits(v)).chain([self.step_count(p.id())]).collect()
    }
}

fn check_skip_is_bit_identical(mut opt: impl StateBits, dev: &Device) {
    let mut s = LossScaler::default();
    let mut w = weights(dev);
    set_grad(&mut w, dev, 3.0 * 4096.0);
    assert_eq!(s.step(&mut opt, &mut w).unwrap(), StepOutcome::Stepped);
    s.update().unwrap();
    let before = opt.state_bits(&w);
    set_grad(&mut w, dev, f32::INFINITY);
    assert_eq!(s.step(&mut opt, &mut w).unwrap(), StepOutcome::Skipped);
    s.update().unwrap();
    assert_eq!(opt.state_bits(&w), before);
    // Sabotage check: a finite gradient does change the state.
    set_grad(&mut w, dev, 1.0);
    assert_eq!(s.step(&mut opt, &mut w).unwrap(), StepOutcome::Stepped);
    assert_ne!(opt.state_bits(&w), before);
}

#[test]
fn a_skipped_step_leaves_parameters_and_optimizer_state_bit_identical() {
    let dev = dev();
    let sgd =
        SgdConfig { lr: 0.1, momentum: 0.9, dampening: 0.0, weight_decay: 0.01, nesterov: true };
    check_skip_is_bit_identical(Sgd::new(sgd), &dev);
    let adamw = AdamWConfig { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
    check_skip_is_bit_identical(AdamW::new(adamw), &dev);
}
