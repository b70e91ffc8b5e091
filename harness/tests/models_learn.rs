//! Every reference model learns its synthetic data set: the loss falls.

use vram_accum::{ForwardCtx, Mode};
use vram_amp::Optimizer;
use vram_harness::data::Dataset;
use vram_harness::models::{Arch, Model};
use vram_harness::trainer::{adamw, sgd};
use vram_kernels::{DType, Device};

fn loss_falls(
    arch: Arch,
    data: Dataset,
    batch: usize,
    steps: usize,
    mut opt: impl Optimizer,
) -> (f32, f32) {
    let device = Device::host(1 << 30);
    let mut model = Model::new(&device, arch, 1, DType::F32).unwrap();
    let eval = data.batch(7, 1 << 40, 64); // same data stream, a batch never trained on
    let before = model.eval_loss(&eval, Mode::Inference).unwrap();
    for step in 0..steps {
        let b = data.batch(7, step as u64, batch);
        let mut ctx = ForwardCtx::new(Mode::Train, step as u64);
        model.train_step(&b, &mut ctx, 1.0).unwrap();
        opt.step(&mut model).unwrap();
        model.zero_grad();
    }
    let after = model.eval_loss(&eval, Mode::Inference).unwrap();
    assert!(after < 0.7 * before, "{}: loss {before} -> {after}", model.name);
    (before, after)
}

#[test]
fn mlp_learns_gaussian_clusters() {
    let arch = Arch::Mlp { dims: vec![16, 32, 32], classes: 4 };
    loss_falls(arch, Dataset::Clusters { dim: 16, classes: 4 }, 32, 30, sgd(0.01));
}

#[test]
fn resnet_like_cnn_learns_stripes() {
    let arch = Arch::ResNet { width: 8, blocks: vec![1, 1], classes: 4 };
    loss_falls(arch, Dataset::Stripes { side: 8, classes: 4 }, 16, 30, adamw(3e-3));
}

#[test]
fn mobilenet_like_cnn_learns_stripes() {
    let arch = Arch::MobileNet { width: 8, blocks: vec![1, 1], classes: 4 };
    loss_falls(arch, Dataset::Stripes { side: 8, classes: 4 }, 16, 40, adamw(3e-3));
}

#[test]
fn gpt_learns_affine_sequences() {
    let arch =
        Arch::Gpt { vocab: 16, d: 32, layers: 2, heads: 2, seq: 8, dropout: 0.1, tied: false };
    loss_falls(arch, Dataset::Sequences { vocab: 16, seq: 8 }, 8, 60, adamw(3e-3));
}

/// The layer-by-layer step with phase marks computes what the executor's step computes (same
/// loss, same gradients bit for bit, same peak), and marks every layer forward and backward.
#[test]
fn marked_step_equals_the_plain_step() {
    use vram_harness::models::Phase;
    let gpt =
        |tied| Arch::Gpt { vocab: 16, d: 32, layers: 2, heads: 2, seq: 8, dropout: 0.1, tied };
    for (arch, autocast) in [
        (gpt(true), None),
        (gpt(false), None),
        (gpt(true), Some(DType::BF16)),
        (Arch::ResNet { width: 8, blocks: vec![1, 1], classes: 4 }, None),
    ] {
        let data = arch.dataset();
        let b = data.batch(3, 0, 4);
        let run = |marked: bool| {
            let device = Device::host(1 << 30);
            let mut model = Model::new(&device, arch.clone(), 1, DType::F32).unwrap();
            model.set_autocast(autocast).unwrap();
            let mut ctx = ForwardCtx::new(Mode::Train, 5);
            let mut phases = Vec::new();
            let loss = if marked {
                model.train_step_marked(&b, &mut ctx, &mut |p| phases.push(p)).unwrap().loss
            } else {
                model.train_step(&b, &mut ctx, 1.0).unwrap().loss
            };
            let grads: Vec<Vec<u32>> = model
                .params()
                .iter()
                .map(|p| {
                    p.grad
                        .as_ref()
                        .unwrap()
                        .to_f32_vec()
                        .unwrap()
                        .iter()
                        .map(|v| v.to_bits())
                        .collect()
                })
                .collect();
            (loss.to_bits(), grads, device.max_memory_allocated(), phases, model.chain_len())
        };
        let (plain, marked) = (run(false), run(true));
        assert_eq!(plain.0, marked.0, "{arch:?}: loss");
        assert_eq!(plain.1, marked.1, "{arch:?}: gradients");
        assert_eq!(plain.2, marked.2, "{arch:?}: peak allocated");
        let n = marked.4;
        let forwards = marked.3.iter().filter(|p| matches!(p, Phase::Forward(..))).count();
        let backwards = marked.3.iter().filter(|p| matches!(p, Phase::Backward(..))).count();
        assert_eq!((forwards, backwards), (n, n), "{arch:?}: {:?}", marked.3);
        assert!(marked.3.contains(&Phase::Loss));
    }
}
