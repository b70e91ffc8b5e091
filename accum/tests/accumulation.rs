//! Gradient accumulation over micro-batches against full-batch gradients.

mod common;

use common::{device, grad_bits, values};
use vram_accum::layers::{Activation, LayerNorm, Linear};
use vram_accum::{
    Chain, FnHooks, ForwardCtx, GradAccumulator, Mode, Normalization, Schedule, Window,
};
use vram_kernels::{DType, Device, Tensor, ops};

const D_IN: usize = 8;
const CLASSES: usize = 4;

/// A small classifier; no dropout, so a row's gradient does not depend on its batch.
fn model(dev: &Device) -> Chain {
    Chain::new(vec![
        Box::new(Linear::new(dev, D_IN, 16, DType::F32, 1).unwrap()),
        Box::new(Activation::gelu(dev)),
        Box::new(LayerNorm::new(dev, 16, DType::F32).unwrap()),
        Box::new(Linear::new(dev, 16, CLASSES, DType::F32, 2).unwrap()),
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
fn accumulate(acc: &GradAccumulator, sizes: &[usize], d: &Data) -> Vec<Vec<Vec<f32>>> {
    let dev = device();
    let chain = std::cell::RefCell::new(model(&dev));
    let starts: Vec<usize> = sizes
        .iter()
        .scan(0, |s, n| {
            *s += n;
            Some(*s - n)
        })
        .collect();
    let items: Vec<u64> = sizes.iter().map(|&n| n as u64).collect();
    let mut windows = Vec::new();
    let mut hooks = FnHooks {
        start: |_: &Window| Ok(1.0),
        end: |_: &Window| {
            let mut c = chain.borrow_mut();
            windows.push(grads(&c));
            c.zero_grad();
            Ok(())
        },
    };
    acc.run_epoch(&items, &mut hooks, |step| {
        let (start, n) = (starts[step.micro_batch], sizes[step.micro_batch]);
        // The loss of a micro-batch is a mean under `Mean`, a sum over its rows otherwise;
        // the kernel's loss is a mean, so a sum's gradient is `n` times the mean's.
        let per_item = if acc.normalization() == Normalization::Mean { 1.0 } else { n as f32 };
        backprop(&mut chain.borrow_mut(), &dev, d, start..start + n, step.dloss * per_item);
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
