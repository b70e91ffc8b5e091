//! A linear classifier kept in f16 and trained with AdamW on f32 masters and dynamic loss
//! scaling. The scale starts too high on purpose (2^24): the first steps overflow f16, are
//! skipped, and the scaler backs off until the gradients fit. Run with
//! `cargo run -p vram-amp --example fp16_scaler`.

use vram_amp::{AdamW, AdamWConfig, LossScaler, Param, Params, Result, ScalerConfig, StepOutcome};
use vram_kernels::{DType, Device, Tensor, ops};

/// Trains 40 steps; returns the losses and the number of skipped steps.
fn train() -> Result<(Vec<f32>, u64)> {
    let dev = Device::host(64 << 20);
    let f16 = DType::F16;
    let mut params = vec![
        Param::new("weight", Tensor::zeros(&dev, &[4, 16], f16)?),
        Param::new("bias", Tensor::zeros(&dev, &[4], f16)?),
    ];
    let cfg = AdamWConfig { lr: 5e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 };
    let mut opt = AdamW::new(cfg);
    let mut scaler =
        LossScaler::new(ScalerConfig { init_scale: 16_777_216.0, ..Default::default() })?;
    // 32 rows of 16 features in [-1, 1); a row's class is the largest of its first 4.
    let xs: Vec<f32> = (0..32 * 16).map(|i| (i * 7919 % 113) as f32 / 56.5 - 1.0).collect();
    let class = |r: &[f32]| (0..4).max_by(|&a, &b| r[a].total_cmp(&r[b])).unwrap_or(0) as u32;
    let ys: Vec<u32> = xs.chunks(16).map(class).collect();
    let x = Tensor::from_f32_slice(&dev, &[32, 16], &xs, f16)?;
    let mut losses = Vec::new();
    for step in 0..40 {
        let logits = ops::linear(&x, &params[0].value, Some(&params[1].value))?;
        let logits32 = logits.to_dtype(DType::F32)?; // the loss runs in f32
        let ce = ops::cross_entropy(&logits32, &ys, None)?;
        // Backward of `scale * loss`, cast back to f16 as autocast's cast would be.
        let dl = ops::cross_entropy_backward(&logits32, &ys, None, &ce.lse, scaler.scale())?;
        let g = ops::linear_backward(&x, &params[0].value, &dl.to_dtype(f16)?, false)?;
        params[0].accumulate_grad(g.dw)?;
        params[1].accumulate_grad(ops::bias_add_backward(&dl.to_dtype(f16)?)?)?;
        if scaler.step(&mut opt, &mut params)? == StepOutcome::Skipped {
            println!("step {step:2}: skipped, gradients overflow f16 at scale {}", scaler.scale());
        }
        scaler.update()?;
        params.zero_grad();
        losses.push(ce.loss);
    }
    println!("scale now {}; loss {:.3} -> {:.3}", scaler.scale(), losses[0], losses[39]);
    Ok((losses, scaler.counters().steps_skipped))
}

fn main() -> Result<()> {
    train().map(drop)
}

#[test]
fn the_scaler_backs_off_and_the_f16_model_learns() {
    let (losses, skipped) = train().unwrap();
    assert!(skipped > 0, "2^24 must overflow f16 gradients");
    assert!(losses[39] < 0.7 * losses[0], "{losses:?}");
}
