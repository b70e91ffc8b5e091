//! A GPT whose LM head is tied to the token embedding trains with the head and its loss
//! fused (`ops::linear_cross_entropy`, the default): the same loss and gradients as the
//! plain path (the whole logits), in f32 and under bf16 autocast, and at GPT-2 small's size
//! on a virtual device a peak without the `[tokens, vocab]` logits and their gradient.

use std::collections::HashMap;
use vram_accum::{ForwardCtx, Mode};
use vram_harness::data::Dataset;
use vram_harness::models::{Arch, Model};
use vram_kernels::{DType, Device};

/// Loss and every parameter's gradient (by name) after one training step.
fn step(fused: bool, autocast: Option<DType>, scale: f32) -> (f32, HashMap<String, Vec<f32>>) {
    let dev = Device::host(256 << 20);
    let arch =
        Arch::Gpt { vocab: 37, d: 32, layers: 2, heads: 2, seq: 8, dropout: 0.1, tied: true };
    let mut model = Model::new(&dev, arch, 3, DType::F32).unwrap();
    model.set_autocast(autocast).unwrap();
    model.set_fused_loss(fused);
    assert_eq!(model.fused_loss(), fused);
    let batch = Dataset::Sequences { vocab: 37, seq: 8 }.batch(5, 0, 4);
    let out = model.train_step(&batch, &mut ForwardCtx::new(Mode::Train, 9), scale).unwrap();
    let grads = model
        .params()
        .into_iter()
        .map(|p| (p.name.clone(), p.grad.as_ref().unwrap().to_f32_vec().unwrap()))
        .collect();
    (out.loss, grads)
}

fn compare(autocast: Option<DType>, scale: f32, rel: f32) {
    let (plain_loss, plain) = step(false, autocast, scale);
    let (fused_loss, fused) = step(true, autocast, scale);
    assert!(
        (fused_loss - plain_loss).abs() <= rel * plain_loss.abs(),
        "{autocast:?}: loss {fused_loss} against {plain_loss}"
    );
    assert_eq!(plain.len(), fused.len());
    let largest = |v: &[f32]| v.iter().fold(1e-12f32, |m, x| m.max(x.abs()));
    let global = plain.values().map(|v| largest(v)).fold(0.0f32, f32::max);
    for (name, want) in &plain {
        let got = &fused[name];
        // Relative to the parameter's largest gradient, or to a thousandth of the model's
        // for one whose gradient is rounding noise (the key bias's is 0 in exact arithmetic).
        let max = largest(want).max(global * 1e-3);
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= rel * max, "{autocast:?} {name}[{i}]: {g} against {w}");
        }
    }
}

#[test]
fn fused_and_plain_loss_train_alike() {
    compare(None, 1.0, 1e-4);
    // A loss scale multiplies every gradient, the fused ones before they are rounded.
    compare(None, 1024.0, 1e-4);
    // The plain path rounds the logits to bf16 before its f32 loss; the fused one keeps them
    // in f32: the two agree to bf16's rounding.
    compare(Some(DType::BF16), 1.0, 5e-2);
}

/// One GPT-2 small training step (b8, s1024) on a virtual device: peak allocated bytes.
fn gpt2_peak(fused: bool, autocast: Option<DType>) -> u64 {
    let arch = Arch::preset("gpt2-small").unwrap();
    let dev = Device::virtual_device(80 << 30);
    let mut model = Model::new(&dev, arch.clone(), 0, DType::F32).unwrap();
    model.set_autocast(autocast).unwrap();
    model.set_fused_loss(fused);
    let batch = arch.dataset().batch_without_values(1, 0, 8);
    dev.reset_peak_stats();
    model.train_step(&batch, &mut ForwardCtx::new(Mode::Train, 1), 1.0).unwrap();
    dev.max_memory_allocated()
}

#[test]
fn gpt2_small_peak_drops_by_the_logits_and_their_gradient() {
    let (tokens, vocab) = (8 * 1024u64, 50257u64);
    let logits = tokens * vocab * 4;
    for autocast in [None, Some(DType::BF16)] {
        let (plain, fused) = (gpt2_peak(false, autocast), gpt2_peak(true, autocast));
        println!(
            "gpt2-small b8 s1024 {autocast:?}: plain {:.2} GiB, fused {:.2} GiB",
            plain as f64 / f64::from(1 << 30),
            fused as f64 / f64::from(1 << 30)
        );
        // The plain step's peak is at the loss, with the f32 logits and their gradient
        // (under autocast the bf16 logits too, until their f32 copy is made); the fused
        // one holds a chunk of them, and its peak moves elsewhere.
        let drop = plain.saturating_sub(fused);
        assert!(drop >= logits, "{autocast:?}: plain {plain}, fused {fused}");
    }
}
