//! A small MLP (linear, ReLU, linear, cross-entropy) trained on synthetic data with a fixed
//! seed, with and without loss scaling, in f32, f16 and bf16, under both master-weight
//! layouts.

use vram_amp::autocast::{self, cast_to, ops as amp_ops};
use vram_amp::{
    AutocastPolicy, LossScaler, MasterWeights, MemoryBreakdown, ScalerConfig, Sgd, WeightLayout,
};
use vram_kernels::{DType, Device, SgdConfig, Tensor, ops};

const BATCH: usize = 32;
const IN: usize = 8;
const HIDDEN: usize = 16;
const CLASSES: usize = 4;

/// splitmix64: a tiny deterministic generator for weights and data.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
}

/// Batches labelled by a fixed random linear teacher (learnable).
fn data(dev: &Device, steps: usize) -> Vec<(Tensor, Vec<u32>)> {
    let mut rng = Rng(7);
    let teacher = rng.vec(CLASSES * IN, 1.0);
    (0..steps)
        .map(|_| {
            let x = rng.vec(BATCH * IN, 2.0);
            let y = x
                .chunks(IN)
                .map(|row| {
                    let score = |c: usize| -> f32 {
                        row.iter().zip(&teacher[c * IN..(c + 1) * IN]).map(|(a, b)| a * b).sum()
                    };
                    (0..CLASSES).max_by(|&a, &b| score(a).total_cmp(&score(b))).unwrap() as u32
                })
                .collect();
            (Tensor::from_f32_slice(dev, &[BATCH, IN], &x, DType::F32).unwrap(), y)
        })
        .collect()
}

fn init(dev: &Device) -> Vec<Tensor> {
    let mut rng = Rng(42);
    let mut t = |shape: &[usize], scale: f32| {
        let n = shape.iter().product();
        Tensor::from_f32_slice(dev, shape, &rng.vec(n, scale), DType::F32).unwrap()
    };
    vec![t(&[HIDDEN, IN], 0.35), t(&[HIDDEN], 0.1), t(&[CLASSES, HIDDEN], 0.25), t(&[CLASSES], 0.1)]
}

struct Run {
    losses: Vec<f32>,
    master_bits: Vec<u32>,
    skipped: u64,
    memory: MemoryBreakdown,
}

/// Trains `steps` SGD steps. The forward runs under autocast when `low` is set; the scaler
/// scales the loss's upstream gradient, unscales and skips as its configuration says.
fn train(
    layout: WeightLayout,
    low: Option<DType>,
    scaler: Option<ScalerConfig>,
    steps: usize,
) -> Run {
    let dev = Device::host(64 << 20);
    let cfg =
        SgdConfig { lr: 0.05, momentum: 0.9, dampening: 0.0, weight_decay: 0.0, nesterov: false };
    let mut weights = MasterWeights::new(layout, init(&dev)).unwrap();
    let mut opt = Sgd::new(cfg);
    let mut scaler = scaler.map_or_else(LossScaler::disabled, |c| LossScaler::new(c).unwrap());
    let mut losses = Vec::new();
    for (x, y) in data(&dev, steps) {
        let _scope = low.map(|d| autocast::autocast(AutocastPolicy::new(d).unwrap()));
        let w = weights.forward_weights().unwrap();
        // Forward: linear runs in the low dtype (inputs cast), the loss in f32.
        let h = amp_ops::linear(&x, w[0], Some(w[1])).unwrap();
        let a = amp_ops::relu(&h).unwrap();
        let logits = amp_ops::linear(&a, w[2], Some(w[3])).unwrap();
        let (ce, logits32) = amp_ops::cross_entropy(&logits, &y, None).unwrap();
        losses.push(ce.loss);
        // Backward of scale * loss; each cast's backward casts the gradient back.
        let dl = ops::cross_entropy_backward(&logits32, &y, None, &ce.lse, scaler.scale()).unwrap();
        let dl = cast_to(&dl, logits.dtype()).unwrap();
        let g2 = ops::linear_backward(&a, w[2], &dl, true).unwrap();
        let dh = ops::relu_backward(&h, &g2.dx).unwrap();
        let xc = cast_to(&x, h.dtype()).unwrap();
        let g1 = ops::linear_backward(&xc, w[0], &dh, true).unwrap();
        let grads = [g1.dw, g1.dbias.unwrap(), g2.dw, g2.dbias.unwrap()];
        for (i, g) in grads.into_iter().enumerate() {
            weights.set_grad(i, g).unwrap();
        }
        scaler.step(&mut opt, &mut weights).unwrap();
        scaler.update().unwrap();
    }
    let memory = MemoryBreakdown { optimizer_state: opt.state_bytes(), ..weights.memory() };
    let master_bits = weights
        .master()
        .iter()
        .flat_map(|p| p.value.to_f32_vec().unwrap())
        .map(f32::to_bits)
        .collect();
    Run { losses, master_bits, skipped: scaler.counters().steps_skipped, memory }
}

fn mean_tail(v: &[f32], n: usize) -> f32 {
    v[v.len() - n..].iter().sum::<f32>() / n as f32
}

#[test]
fn f32_training_with_the_scaler_equals_training_without_it_bit_exactly() {
    let plain = train(WeightLayout::F32, None, None, 30);
    // The default scale, and a scale that grows every 3 steps during the run.
    let growing = ScalerConfig { init_scale: 1024.0, growth_interval: 3, ..Default::default() };
    for cfg in [ScalerConfig::default(), growing] {
        let scaled = train(WeightLayout::F32, None, Some(cfg), 30);
        assert_eq!(scaled.skipped, 0);
        assert_eq!(scaled.master_bits, plain.master_bits);
        let bits = |v: &[f32]| v.iter().map(|l| l.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&scaled.losses), bits(&plain.losses));
    }
    // The model learns (so the comparison is not between two idle runs).
    assert!(mean_tail(&plain.losses, 5) < 0.6 * plain.losses[0], "{:?}", plain.losses);
}

#[test]
fn scaled_f16_training_without_overflow_tracks_f32_within_tolerance() {
    // Tolerance: 0.005 absolute on each step's loss over 30 steps (losses start near 1.4).
    const TOL: f32 = 0.005;
    let plain = train(WeightLayout::F32, None, None, 30);
    let cfg = ScalerConfig { init_scale: 256.0, ..Default::default() };
    for layout in
        [WeightLayout::CastPerStep(DType::F16), WeightLayout::LowPrecisionModel(DType::F16)]
    {
        let run = train(layout, Some(DType::F16), Some(cfg.clone()), 30);
        assert_eq!(run.skipped, 0, "{layout:?}");
        assert_ne!(run.master_bits, plain.master_bits, "f16 must differ from f32 somewhere");
        for (step, (a, b)) in run.losses.iter().zip(&plain.losses).enumerate() {
            assert!((a - b).abs() < TOL, "{layout:?} step {step}: f16 {a} vs f32 {b}");
        }
    }
}

#[test]
fn an_f16_run_with_dynamic_scaling_reaches_the_f32_loss() {
    // Tolerance: the mean loss of the last 20 of 120 steps within 0.01 of f32's.
    const TOL: f32 = 0.01;
    let plain = train(WeightLayout::F32, None, None, 120);
    let want = mean_tail(&plain.losses, 20);
    assert!(want < 0.3 * plain.losses[0], "f32 must learn: {:?}", plain.losses);
    let f16 = |cfg| train(WeightLayout::CastPerStep(DType::F16), Some(DType::F16), Some(cfg), 120);
    let default = f16(ScalerConfig::default());
    // Starting at 2^24 the scaled gradients overflow f16: the scaler must back off.
    let too_high = f16(ScalerConfig { init_scale: 16_777_216.0, ..Default::default() });
    assert!(too_high.skipped > 0);
    let bf16 = train(WeightLayout::LowPrecisionModel(DType::BF16), Some(DType::BF16), None, 120);
    for (name, run) in [("f16", &default), ("f16 from 2^24", &too_high), ("bf16", &bf16)] {
        let got = mean_tail(&run.losses, 20);
        assert!((got - want).abs() < TOL, "{name}: {got} vs f32 {want}");
    }
}

#[test]
fn memory_breakdown_shows_where_each_layout_puts_its_bytes() {
    let params = (HIDDEN * IN + HIDDEN + CLASSES * HIDDEN + CLASSES) as u64;
    let f32_run = train(WeightLayout::F32, None, None, 2);
    let cast = train(WeightLayout::CastPerStep(DType::F16), Some(DType::F16), None, 2);
    let low = train(WeightLayout::LowPrecisionModel(DType::F16), Some(DType::F16), None, 2);
    let grads_and_momentum = (params * 4, params * 4);
    let split = |m: &MemoryBreakdown| (m.grads, m.optimizer_state);
    for m in [&f32_run.memory, &cast.memory, &low.memory] {
        assert_eq!(split(m), grads_and_momentum);
    }
    assert_eq!((f32_run.memory.model_weights, f32_run.memory.master_weights), (params * 4, 0));
    // Working copies are freed by the optimizer step: only the masters remain.
    assert_eq!((cast.memory.model_weights, cast.memory.master_weights), (0, params * 4));
    assert_eq!((low.memory.model_weights, low.memory.master_weights), (params * 2, params * 4));
}

#[test]
fn master_weights_are_allocated_through_the_device_allocator() {
    let dev = Device::host(64 << 20);
    let base = dev.memory_allocated();
    let w = MasterWeights::new(WeightLayout::LowPrecisionModel(DType::F16), init(&dev)).unwrap();
    let held = dev.memory_allocated() - base;
    assert!(held >= w.memory().total(), "{held} < {:?}", w.memory());
    drop(w);
    assert_eq!(dev.memory_allocated(), base);
}
