//! Gradient accumulation over micro-batches against full-batch gradients.

mod common;

use common::{device, grad_bits, values};
use vram_accum::layers::{Activation, LayerNormConfig, LinearConfig};
use vram_accum::{
    Chain, FnHooks, ForwardCtx, GradAccumulator, Mode, Normalization, Schedule, StepHooks, Window,
};
use vram_amp::{LossScaler, Optimizer, Sgd, SgdConfig, StepOutcome};
use vram_kernels::{DType, Device, Tensor, ops};

const D_IN: usize = 8;
const CLASSES: usize = 4;

/// A small classifier; no dropout, so a row's gradient does not depend on its batch.
fn model(dev: &Device) -> Chain {
    Chain::new(vec![
        LinearConfig::new(D_IN, 16).with_seed(1).init(dev).unwrap().into(),
        Activation::gelu(dev).into(),
        LayerNormConfig::new(16).init(dev).unwrap().into(),
        LinearConfig::new(16, CLASSES).with_seed(2).init(dev).unwrap().into(),
    ])
}

struct Data {
    x: Vec<f32>,
    targets: Vec<u32>,
}

fn data(rows: usize) -> Data {
    let targets = values(rows, 77).iter().map(|v| ((v + 1.0) * 2.0) as u32 % 4).collect();
    Data { x: values(rows * D_IN, 5), targets }
}

/// Forward and backward of rows `r` with the mean cross-entropy, its gradient scaled by
/// `dloss`; gradients add into the chain's.
fn backprop(chain: &mut Chain, dev: &Device, d: &Data, r: std::ops::Range<usize>, dloss: f32) {
    let x = Tensor::from_f32_slice(
        dev,
        &[r.len(), D_IN],
        &d.x[r.start * D_IN..r.end * D_IN],
        DType::F32,
    )
    .unwrap();
    let n = chain.len();
    let (logits, tape) = chain
        .forward(&x, &mut ForwardCtx::new(Mode::Train, 0), &Schedule::none(n).unwrap())
        .unwrap();
    let t = &d.targets[r];
    let ce = ops::cross_entropy(&logits, t, None).unwrap();
    let dlogits = ops::cross_entropy_backward(&logits, t, None, &ce.lse, dloss).unwrap();
    drop(logits);
    chain.backward(tape, dlogits, false).unwrap();
}

fn grads(chain: &Chain) -> Vec<Vec<f32>> {
    chain.params().iter().map(|p| p.grad.as_ref().unwrap().to_f32_vec().unwrap()).collect()
}

/// Largest `|a - b| / |b|` over parameters, in the 2-norm.
fn rel_err(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(a, b)| {
            let diff: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
            let norm: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
            (diff / norm).sqrt()
        })
        .fold(0.0, f64::max)
}

/// Runs an epoch of micro-batches of `sizes` rows with `acc`, returning each window's
/// gradients (captured and cleared at the window boundary, where an optimizer would step).
fn starts(sizes: &[usize]) -> Vec<usize> {
    sizes
        .iter()
        .scan(0, |s, n| {
            *s += n;
            Some(*s - n)
        })
        .collect()
}

fn accumulate(acc: &GradAccumulator, sizes: &[usize], d: &Data) -> Vec<Vec<Vec<f32>>> {
    let dev = device();
    let mut chain = model(&dev);
    let starts = starts(sizes);
    let items: Vec<u64> = sizes.iter().map(|&n| n as u64).collect();
    let mut windows = Vec::new();
    let mut hooks = FnHooks {
        start: |_: &mut Chain, _: &Window| Ok(1.0),
        end: |chain: &mut Chain, _: &Window| {
            windows.push(grads(chain));
            chain.zero_grad();
            Ok(())
        },
    };
    acc.run_epoch(&items, &mut chain, &mut hooks, |chain, step| {
        let (start, n) = (starts[step.micro_batch], sizes[step.micro_batch]);
        // The loss of a micro-batch is a mean under `Mean`, a sum over its rows otherwise;
        // the kernel's loss is a mean, so a sum's gradient is `n` times the mean's.
        let per_item = if acc.normalization() == Normalization::Mean { 1.0 } else { n as f32 };
        backprop(chain, &dev, d, start..start + n, step.dloss * per_item);
        Ok(())
    })
    .unwrap();
    windows
}

fn full_batch(d: &Data, rows: std::ops::Range<usize>) -> Vec<Vec<f32>> {
    let dev = device();
    let mut chain = model(&dev);
    backprop(&mut chain, &dev, d, rows, 1.0);
    grads(&chain)
}

#[test]
fn mean_over_k_equal_micro_batches_gives_the_full_batch_gradient() {
    let d = data(24);
    let full = full_batch(&d, 0..24);
    for k in [2, 3, 4, 6] {
        let acc = GradAccumulator::new(k, Normalization::Mean).unwrap();
        let w = accumulate(&acc, &vec![24 / k; k], &d);
        assert_eq!(w.len(), 1);
        let err = rel_err(&w[0], &full);
        assert!(err <= 1e-5, "k = {k}: relative error {err}");
    }
}

#[test]
fn k_equal_one_is_bit_identical_to_no_accumulation() {
    let d = data(18);
    let acc = GradAccumulator::new(1, Normalization::Mean).unwrap();
    let windows = accumulate(&acc, &[6, 6, 6], &d);
    assert_eq!(windows.len(), 3);
    for (i, w) in windows.iter().enumerate() {
        let plain = full_batch(&d, 6 * i..6 * i + 6);
        let bits = |g: &Vec<Vec<f32>>| -> Vec<Vec<u32>> {
            g.iter().map(|t| t.iter().map(|v| v.to_bits()).collect()).collect()
        };
        assert_eq!(bits(w), bits(&plain), "window {i}");
    }
}

#[test]
fn global_count_over_variable_length_micro_batches_gives_the_per_item_mean() {
    let d = data(24);
    let full = full_batch(&d, 0..24);
    let sizes = [3, 9, 5, 7];
    let acc = GradAccumulator::new(4, Normalization::GlobalCount).unwrap();
    let global = accumulate(&acc, &sizes, &d);
    let err = rel_err(&global[0], &full);
    assert!(err <= 1e-5, "global count: relative error {err}");

    // The mean of per-micro-batch means weights a row of the 3-row micro-batch three times
    // as much as one of the 9-row micro-batch: not the per-item mean.
    let acc = GradAccumulator::new(4, Normalization::Mean).unwrap();
    let mean_of_means = accumulate(&acc, &sizes, &d);
    let err = rel_err(&mean_of_means[0], &full);
    assert!(err > 1e-2, "mean of means should differ, relative error {err}");
}

#[test]
fn sum_normalization_adds_the_micro_batch_sums() {
    let d = data(12);
    let full = full_batch(&d, 0..12);
    let acc = GradAccumulator::new(3, Normalization::Sum).unwrap();
    let sum = accumulate(&acc, &[4, 4, 4], &d);
    // Sum over 12 rows = 12 x per-item mean.
    let scaled: Vec<Vec<f32>> = full.iter().map(|g| g.iter().map(|v| v * 12.0).collect()).collect();
    assert!(rel_err(&sum[0], &scaled) <= 1e-5);
}

#[test]
fn the_last_shorter_window_of_an_epoch_is_normalized_by_its_own_size() {
    let d = data(30);
    let acc = GradAccumulator::new(4, Normalization::Mean).unwrap();
    let windows = accumulate(&acc, &[3; 10], &d);
    assert_eq!(windows.len(), 3, "10 micro-batches in windows of 4, 4 and 2");
    for (w, rows) in windows.iter().zip([0..12, 12..24, 24..30]) {
        let err = rel_err(w, &full_batch(&d, rows.clone()));
        assert!(err <= 1e-5, "rows {rows:?}: relative error {err}");
    }
    let acc = GradAccumulator::new(4, Normalization::GlobalCount).unwrap();
    let windows = accumulate(&acc, &[3; 10], &d);
    assert!(rel_err(&windows[2], &full_batch(&d, 24..30)) <= 1e-5);
}

#[test]
fn gradients_accumulate_across_backward_calls_until_zeroed() {
    let dev = device();
    let d = data(4);
    let mut chain = model(&dev);
    backprop(&mut chain, &dev, &d, 0..4, 1.0);
    let once = grad_bits(&chain);
    backprop(&mut chain, &dev, &d, 0..4, 1.0);
    assert_ne!(grad_bits(&chain), once);
    chain.zero_grad();
    assert!(grad_bits(&chain).iter().all(Option::is_none));
}

fn params(chain: &Chain) -> Vec<Vec<f32>> {
    chain.params().iter().map(|p| p.value.to_f32_vec().unwrap()).collect()
}

/// An optimizer stepping the chain's own parameters at each window end, through
/// [`StepHooks`], moves them as one step on the full-batch gradient does.
#[test]
fn sgd_through_step_hooks_matches_a_step_on_the_full_batch_gradient() {
    let d = data(24);
    let sgd =
        SgdConfig { lr: 0.5, momentum: 0.9, dampening: 0.0, weight_decay: 0.01, nesterov: false };
    let dev = device();
    let mut full = model(&dev);
    backprop(&mut full, &dev, &d, 0..24, 1.0);
    Sgd::new(sgd).step(&mut full).unwrap();

    let mut chain = model(&dev);
    let before = params(&chain);
    let mut hooks = StepHooks::new(Sgd::new(sgd), LossScaler::disabled());
    let acc = GradAccumulator::new(4, Normalization::Mean).unwrap();
    let sizes = [6; 4];
    let starts = starts(&sizes);
    let steps = acc
        .run_epoch(&[6; 4], &mut chain, &mut hooks, |chain, step| {
            let start = starts[step.micro_batch];
            backprop(chain, &dev, &d, start..start + 6, step.dloss);
            Ok(())
        })
        .unwrap();
    assert_eq!(steps, 1);
    assert_eq!(hooks.last_step().map(|r| r.outcome), Some(StepOutcome::Stepped));
    assert!(chain.params().iter().all(|p| p.grad.is_none()), "gradients dropped after the step");
    let err = rel_err(&params(&chain), &params(&full));
    assert!(err <= 1e-6, "relative error {err}");
    assert!(rel_err(&params(&chain), &before) > 1e-3, "the step moved the parameters");
}

/// With a loss scale, the micro-batches see `dloss` scaled and the optimizer sees the
/// unscaled, clipped gradient: the parameters match an unscaled run with the same clipping.
#[test]
fn step_hooks_unscale_and_clip_before_stepping() {
    let d = data(16);
    let sgd =
        SgdConfig { lr: 0.1, momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false };
    let run = |scaler: LossScaler| {
        let dev = device();
        let mut chain = model(&dev);
        let mut hooks = StepHooks::new(Sgd::new(sgd), scaler).with_max_grad_norm(0.05).unwrap();
        let acc = GradAccumulator::new(2, Normalization::Mean).unwrap();
        let mut dlosses = Vec::new();
        acc.run_epoch(&[8, 8], &mut chain, &mut hooks, |chain, step| {
            dlosses.push(step.dloss);
            backprop(chain, &dev, &d, 8 * step.micro_batch..8 * step.micro_batch + 8, step.dloss);
            Ok(())
        })
        .unwrap();
        let report = hooks.last_step().unwrap();
        (params(&chain), dlosses, report)
    };
    let cfg = vram_amp::ScalerConfig { init_scale: 1024.0, ..Default::default() };
    let (scaled, dl_scaled, r_scaled) = run(LossScaler::new(cfg).unwrap());
    let (plain, dl_plain, r_plain) = run(LossScaler::disabled());
    assert_eq!((dl_scaled, dl_plain), (vec![512.0; 2], vec![0.5; 2]));
    assert_eq!((r_scaled.scale, r_plain.scale), (1024.0, 1.0));
    let (n_scaled, n_plain) = (r_scaled.grad_norm.unwrap(), r_plain.grad_norm.unwrap());
    assert!(n_plain > 0.05, "the bound clips: norm {n_plain}");
    assert!((n_scaled - n_plain).abs() <= 1e-5 * n_plain, "{n_scaled} vs {n_plain}");
    assert!(rel_err(&scaled, &plain) <= 1e-5);
    assert!(
        StepHooks::new(Sgd::new(sgd), LossScaler::disabled()).with_max_grad_norm(f32::NAN).is_err()
    );
}
