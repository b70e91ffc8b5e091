//! A custom layer in a checkpointed f16 chain, trained with gradient accumulation, AdamW on
//! f32 masters, gradient clipping and dynamic loss scaling. Run with
//! `cargo run -p vram-accum --example custom_layer`.

use vram_accum::layers::LinearConfig;
use vram_accum::{Chain, ForwardCtx, GradAccumulator, Layer, Mode, Normalization, Param};
use vram_accum::{Result, Schedule, StepHooks};
use vram_amp::{AdamW, AdamWConfig, LossScaler};
use vram_kernels::{DType, Device, Tensor, ops};

/// `y = relu(x + b)` with a learned bias; keeps the pre-activation for backward.
struct BiasRelu(Param);

impl Layer for BiasRelu {
    type Saved = Tensor;
    fn name(&self) -> String {
        "BiasRelu".into()
    }
    fn forward(&mut self, x: &Tensor, ctx: &mut ForwardCtx) -> Result<(Tensor, Option<Tensor>)> {
        let z = ops::bias_add(x, &self.0.value)?;
        Ok((ops::relu(&z)?, ctx.training().then_some(z)))
    }
    fn backward(&mut self, z: Tensor, dy: Tensor, want_dx: bool) -> Result<Option<Tensor>> {
        let dz = ops::relu_backward(&z, &dy)?;
        drop((z, dy)); // freed as soon as they are used, as PyTorch frees them
        self.0.accumulate_grad(ops::bias_add_backward(&dz)?)?;
        Ok(want_dx.then_some(dz))
    }
    fn params(&self) -> Vec<&Param> {
        vec![&self.0]
    }
    fn params_mut(&mut self) -> Vec<&mut Param> {
        vec![&mut self.0]
    }
    fn device(&self) -> &Device {
        self.0.value.device()
    }
}

/// Trains 25 epochs of 8 micro-batches; returns the first and last epoch's mean loss.
fn train() -> Result<(f32, f32)> {
    let dev = Device::host(256 << 20);
    let (f16, mut chain) = (DType::F16, Chain::default());
    for i in 0..4 {
        chain.push(LinearConfig::new(16, 16).with_dtype(f16).with_seed(i).init(&dev)?);
        chain.push(BiasRelu(Param::new("bias", Tensor::zeros(&dev, &[16], f16)?)));
    }
    chain.push(LinearConfig::new(16, 4).with_dtype(f16).with_seed(9).init(&dev)?);
    let schedule = Schedule::sqrt(chain.len())?; // 3 segments of 3 layers, 2 checkpointed
    let adamw = AdamWConfig { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 };
    let scaler = LossScaler::default();
    let mut hooks = StepHooks::new(AdamW::new(adamw), scaler).with_max_grad_norm(1.0)?;
    let acc = GradAccumulator::new(4, Normalization::Mean)?;
    // 64 rows of 16 features in [-1, 1); a row's class is the largest of its first 4.
    let xs: Vec<f32> = (0..64 * 16).map(|i| (i * 7919 % 113) as f32 / 56.5 - 1.0).collect();
    let class = |r: &[f32]| (0..4).max_by(|&a, &b| r[a].total_cmp(&r[b])).unwrap_or(0) as u32;
    let ys: Vec<u32> = xs.chunks(16).map(class).collect();
    let mut losses = Vec::new();
    for epoch in 0..25 {
        let mut loss = 0.0;
        acc.run_epoch(&[8; 8], &mut chain, &mut hooks, |chain, step| {
            let rows = 8 * step.micro_batch..8 * step.micro_batch + 8;
            let x =
                Tensor::from_f32_slice(&dev, &[8, 16], &xs[rows.start * 16..rows.end * 16], f16)?;
            let mut ctx = ForwardCtx::new(Mode::Train, epoch);
            let (logits, tape) = chain.forward(&x, &mut ctx, &schedule)?;
            let logits = logits.to_dtype(DType::F32)?; // the loss runs in f32
            let ce = ops::cross_entropy(&logits, &ys[rows.clone()], None)?;
            let dl = ops::cross_entropy_backward(&logits, &ys[rows], None, &ce.lse, step.dloss)?;
            loss += ce.loss / 8.0;
            chain.backward(tape, dl.to_dtype(f16)?, false).map(drop)
        })?;
        losses.push(loss);
    }
    let (s, c) = (hooks.scaler.scale(), hooks.scaler.counters());
    println!("{} steps, {} skipped, loss scale {s}", c.steps_taken, c.steps_skipped);
    println!("f32 masters: {} bytes; loss per epoch: {losses:.3?}", hooks.optimizer.master_bytes());
    Ok((losses[0], losses[losses.len() - 1]))
}

fn main() -> Result<()> {
    train().map(drop)
}

#[test]
fn the_f16_chain_learns() {
    let (first, last) = train().unwrap();
    assert!(last < 0.6 * first, "loss {first} -> {last}");
}
