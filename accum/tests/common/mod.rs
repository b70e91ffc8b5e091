//! Helpers shared by the integration tests.
#![allow(dead_code)]

use vram_accum::layers::{Activation, Dropout, LayerNormConfig, LinearConfig, ResidualMlpConfig};
use vram_accum::{BoxedLayer, Chain, ForwardCtx, Mode, Schedule};
use vram_kernels::cpu::random::uniform_at;
use vram_kernels::{DType, Device, Tensor};

pub fn device() -> Device {
    Device::host(1 << 30)
}

/// Values uniform in [-1, 1) from `seed`.
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    (0..n as u64).map(|i| 2.0 * uniform_at(seed, i) - 1.0).collect()
}

pub fn tensor(dev: &Device, shape: &[usize], seed: u64) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_f32_slice(dev, shape, &values(n, seed), DType::F32).unwrap()
}

/// A width-preserving layer of kind `kind % 6` and width `d`.
pub fn layer(dev: &Device, kind: u8, d: usize, seed: u64) -> BoxedLayer {
    match kind % 6 {
        0 => LinearConfig::new(d, d).with_seed(seed).init(dev).unwrap().into(),
        1 => Activation::relu(dev).into(),
        2 => Activation::gelu(dev).into(),
        3 => Dropout::new(dev, 0.3).unwrap().into(),
        4 => LayerNormConfig::new(d).init(dev).unwrap().into(),
        _ => ResidualMlpConfig::new(d, 2 * d)
            .with_dropout(0.2)
            .with_seed(seed)
            .init(dev)
            .unwrap()
            .into(),
    }
}

/// Every parameter gradient, as bits (`None` where a parameter got none).
pub fn grad_bits(chain: &Chain) -> Vec<Option<Vec<u32>>> {
    chain
        .params()
        .iter()
        .map(|p| {
            p.grad.as_ref().map(|g| g.to_f32_vec().unwrap().iter().map(|v| v.to_bits()).collect())
        })
        .collect()
}

pub fn bits(t: &Tensor) -> Vec<u32> {
    t.to_f32_vec().unwrap().iter().map(|v| v.to_bits()).collect()
}

/// One training step under `schedule` from fresh gradients, with the loss `0.5 |y|^2`
/// (so `dy = y`): returns (output bits, input gradient bits, parameter gradient bits).
pub fn step_bits(
    chain: &mut Chain,
    x: &Tensor,
    seed: u64,
    schedule: &Schedule,
) -> (Vec<u32>, Vec<u32>, Vec<Option<Vec<u32>>>) {
    chain.zero_grad();
    let mut ctx = ForwardCtx::new(Mode::Train, seed);
    let (y, tape) = chain.forward(x, &mut ctx, schedule).unwrap();
    let y_bits = bits(&y);
    let dx = chain.backward(tape, y, true).unwrap().expect("input gradient asked for");
    (y_bits, bits(&dx), grad_bits(chain))
}

/// Peak memory above the start of one step under `schedule`, measured in a statistics
/// scope, and the memory the step left allocated.
pub fn step_peak(chain: &mut Chain, x: &Tensor, schedule: &Schedule) -> (u64, u64) {
    let dev = x.device().clone();
    let base = dev.memory_allocated();
    let scope = dev.stats_scope();
    let mut ctx = ForwardCtx::new(Mode::Train, 3);
    let (y, tape) = chain.forward(x, &mut ctx, schedule).unwrap();
    // The loss gradient is computed while the output is alive, as a training step does.
    let dy = Tensor::full(&dev, y.shape(), y.dtype(), 1.0).unwrap();
    drop(y);
    chain.backward(tape, dy, false).unwrap();
    let peak = scope.finish().allocated_bytes.all.peak as u64 - base;
    (peak, dev.memory_allocated() - base)
}

/// Measured peak activation memory of one step under `schedule`, in the steady state
/// (gradients already allocated by a warm-up step).
pub fn measured_peak(chain: &mut Chain, x: &Tensor, schedule: &Schedule) -> u64 {
    step_peak(chain, x, schedule);
    step_peak(chain, x, schedule).0
}

/// `|a - b| <= tol * b`.
pub fn within(a: u64, b: u64, tol: f64) -> bool {
    (a as f64 - b as f64).abs() <= tol * b as f64
}
