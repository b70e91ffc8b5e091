//! The preset CNNs channels_last compute what they compute in NCHW: the same seed draws the
//! same weights (stored `[c_out, kh, kw, c_in]`), and training steps give the same losses,
//! the same gradients (the convolutions' permuted) and the same running statistics, in f32
//! and under bf16 autocast. On the host the NHWC ops accumulate in the NCHW ops' order, so
//! "the same" is bit for bit.

use vram_accum::{ForwardCtx, Mode};
use vram_amp::{AdamW, AdamWConfig, Optimizer as _};
use vram_harness::data::Dataset;
use vram_harness::models::{Arch, Model, ModelOptions};
use vram_kernels::{DType, Device, ops};

/// Each step's loss, every gradient after the last step (a 4-d one as NCHW), and the
/// inference loss after the steps.
struct Run {
    losses: Vec<f32>,
    grads: Vec<(String, Vec<f32>)>,
    eval: f32,
}

fn run(arch: &Arch, data: &Dataset, autocast: bool, channels_last: bool) -> Run {
    let device = Device::host(1 << 30);
    let opts = ModelOptions::default().with_channels_last(channels_last);
    let mut model = Model::with_options(&device, arch.clone(), 3, DType::F32, opts).unwrap();
    assert_eq!(model.channels_last(), channels_last, "{arch:?}");
    // The stem's weight takes the 3 image channels: last in channels_last, second in NCHW.
    let stem = model.params()[0].value.shape().to_vec();
    assert_eq!(stem[if channels_last { 3 } else { 1 }], 3, "{arch:?}: stem weight {stem:?}");
    if autocast {
        model.set_autocast(Some(DType::BF16)).unwrap();
    }
    let mut opt = AdamW::new(AdamWConfig::default());
    let (mut losses, mut grads) = (Vec::new(), Vec::new());
    for step in 0..3 {
        let b = data.batch(5, step, 4);
        let mut ctx = ForwardCtx::new(Mode::Train, step);
        losses.push(model.train_step(&b, &mut ctx, 1.0).unwrap().loss);
        if step == 2 {
            for p in model.params() {
                let g = p.grad.as_ref().expect("every parameter has a gradient");
                let g = if channels_last && g.shape().len() == 4 {
                    ops::permute(g, &[0, 3, 1, 2]).unwrap()
                } else {
                    g.clone()
                };
                grads.push((p.name.clone(), g.to_f32_vec().unwrap()));
            }
        }
        opt.step(&mut model).unwrap();
        model.zero_grad();
    }
    // The running statistics the steps moved normalize here.
    let eval = model.eval_loss(&data.batch(5, 99, 4), Mode::Inference).unwrap();
    Run { losses, grads, eval }
}

fn same_in_both_layouts(arch: Arch, data: Dataset) {
    for autocast in [false, true] {
        let nchw = run(&arch, &data, autocast, false);
        let nhwc = run(&arch, &data, autocast, true);
        let what = format!("{} autocast {autocast}", arch.name());
        assert!(nchw.losses.iter().all(|l| l.is_finite()), "{what}: {:?}", nchw.losses);
        assert_eq!(nchw.losses, nhwc.losses, "{what}: losses");
        assert_eq!(nchw.grads.len(), nhwc.grads.len(), "{what}: parameters");
        for ((n1, g1), (n2, g2)) in nchw.grads.iter().zip(&nhwc.grads) {
            assert_eq!(n1, n2, "{what}: parameter order");
            assert!(g1.iter().any(|&v| v != 0.0), "{what}: {n1}'s gradient is zero");
            assert_eq!(g1, g2, "{what}: gradient of {n1}");
        }
        assert_eq!(nchw.eval.to_bits(), nhwc.eval.to_bits(), "{what}: inference loss");
    }
}

#[test]
fn resnet_like_is_the_same_channels_last() {
    let arch = Arch::ResNet { width: 8, blocks: vec![1, 1], classes: 4 };
    same_in_both_layouts(arch, Dataset::Stripes { side: 8, classes: 4 });
}

#[test]
fn mobilenet_like_is_the_same_channels_last() {
    let arch = Arch::MobileNet { width: 8, blocks: vec![1, 1], classes: 4 };
    same_in_both_layouts(arch, Dataset::Stripes { side: 8, classes: 4 });
}

/// Batch norm, max pool, projection shortcuts, squeeze-excitation and the classifier head.
#[test]
fn resnet50_and_mobilenetv3_tables_are_the_same_channels_last() {
    let resnet =
        Arch::BottleneckResNet { side: 32, width: 4, blocks: vec![1, 2, 1, 1], classes: 4 };
    same_in_both_layouts(resnet, Dataset::Stripes { side: 32, classes: 4 });
    let mobilenet = Arch::MobileNetV3 { side: 32, width_mult: 0.25, classes: 4 };
    same_in_both_layouts(mobilenet, Dataset::Stripes { side: 32, classes: 4 });
}

/// Models that are not preset CNNs ignore the option.
#[test]
fn other_models_ignore_channels_last() {
    let device = Device::host(1 << 28);
    let opts = ModelOptions::default().with_channels_last(true);
    let gpt = Arch::Gpt { vocab: 16, d: 16, layers: 1, heads: 2, seq: 8, dropout: 0.0, tied: true };
    let mlp = Arch::Mlp { dims: vec![8, 8], classes: 2 };
    for arch in [gpt, mlp] {
        let m = Model::with_options(&device, arch.clone(), 1, DType::F32, opts).unwrap();
        assert!(!m.channels_last(), "{arch:?}");
    }
}
