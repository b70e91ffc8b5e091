//! Every reference model allocates on a virtual device (and a GPU, when there is one) exactly
//! as on the host: a training step (forward, loss, backward, optimizer step) gives the same
//! allocation trace, entry for entry (action, size, stream), and the same peaks, though the
//! virtual device computes nothing. (The host device is given the virtual device's cuBLAS
//! workspace size: the virtual device allocates what a GPU allocates, workspace included.)

use std::io::Write as _;
use vram_accum::{ForwardCtx, Mode};
use vram_amp::{AdamW, AdamWConfig, Optimizer as _};
use vram_harness::data::Dataset;
use vram_harness::models::{Arch, Model, ModelOptions};
use vram_kernels::{DType, Device, TraceAction};

type Entry = (TraceAction, usize, usize, u64);

/// Two training steps of `arch` on `device`, traced from model creation on.
fn trace(
    device: &Device,
    arch: &Arch,
    data: &Dataset,
    dtype: DType,
    opts: ModelOptions,
) -> (Vec<Entry>, u64, u64) {
    device.record_history(Some(1 << 20));
    let mut model = Model::with_options(device, arch.clone(), 1, dtype, opts).unwrap();
    // amp's AdamW: f32 masters for 16-bit parameters, state made at the first step.
    let mut opt = AdamW::new(AdamWConfig::default());
    for step in 0..2 {
        let b = data.batch(7, step, 4);
        let mut ctx = ForwardCtx::new(Mode::Train, step);
        model.train_step(&b, &mut ctx, 1.0).unwrap();
        opt.step(&mut model).unwrap();
        model.zero_grad();
    }
    // Before the model and optimizer go: AdamW keeps its state in a hash map, whose drop
    // order differs from run to run.
    let entries =
        device.trace().into_iter().map(|e| (e.action, e.size, e.requested, e.stream)).collect();
    let peaks = (device.max_memory_allocated(), device.max_memory_reserved());
    drop((model, opt));
    (entries, peaks.0, peaks.1)
}

fn same_on_host_and_virtual(arch: Arch, data: Dataset) {
    same_on_host_and_virtual_with(arch, data, ModelOptions::default());
}

fn same_on_host_and_virtual_with(arch: Arch, data: Dataset, opts: ModelOptions) {
    for dtype in [DType::F32, DType::BF16] {
        let (host_dev, virt_dev) = (Device::host(1 << 30), Device::virtual_device(1 << 30));
        // The virtual device stands for an H100, whose cuBLAS workspace the host lacks.
        assert!(virt_dev.blas_workspace_size() > 0);
        host_dev.set_blas_workspace_size(virt_dev.blas_workspace_size());
        let host = trace(&host_dev, &arch, &data, dtype, opts);
        let mut others = vec![("virtual", trace(&virt_dev, &arch, &data, dtype, opts))];
        match Device::cuda(0) {
            Ok(gpu) => {
                gpu.set_blas_workspace_size(virt_dev.blas_workspace_size());
                // The virtual device models vram's own convolution kernels, not cuDNN's.
                gpu.set_conv_backend(vram_kernels::ConvBackend::Own).unwrap();
                others.push(("CUDA", trace(&gpu, &arch, &data, dtype, opts)));
            }
            Err(e) => {
                let mut err = std::io::stderr();
                let _ = writeln!(err, "skipped: no CUDA device ({e}); host and virtual only");
            }
        }
        assert!(host.0.len() > 100, "{arch:?}: a step allocates ({} entries)", host.0.len());
        for (name, other) in others {
            for (i, (h, v)) in host.0.iter().zip(&other.0).enumerate() {
                assert_eq!(h, v, "{arch:?} {dtype:?} {name}: entry {i}");
            }
            assert_eq!(host.0.len(), other.0.len(), "{arch:?} {dtype:?} {name}: trace lengths");
            assert_eq!((host.1, host.2), (other.1, other.2), "{arch:?} {dtype:?} {name}: peaks");
        }
    }
}

#[test]
fn mlp_allocates_alike_on_host_and_virtual_devices() {
    let arch = Arch::Mlp { dims: vec![16, 32, 32], classes: 4 };
    same_on_host_and_virtual(arch, Dataset::Clusters { dim: 16, classes: 4 });
}

#[test]
fn resnet_like_allocates_alike_on_host_and_virtual_devices() {
    let arch = Arch::ResNet { width: 8, blocks: vec![1, 1], classes: 4 };
    same_on_host_and_virtual(arch, Dataset::Stripes { side: 8, classes: 4 });
}

#[test]
fn mobilenet_like_allocates_alike_on_host_and_virtual_devices() {
    let arch = Arch::MobileNet { width: 8, blocks: vec![1, 1], classes: 4 };
    same_on_host_and_virtual(arch, Dataset::Stripes { side: 8, classes: 4 });
}

#[test]
fn gpt_allocates_alike_on_host_and_virtual_devices() {
    let arch =
        Arch::Gpt { vocab: 16, d: 32, layers: 2, heads: 2, seq: 8, dropout: 0.1, tied: false };
    same_on_host_and_virtual(arch, Dataset::Sequences { vocab: 16, seq: 8 });
}

/// The zoo's real architectures at toy sizes: a tied GPT, a bottleneck ResNet, the
/// MobileNetV3 table at a small width, a ViT.
#[test]
fn zoo_architectures_allocate_alike_on_host_and_virtual_devices() {
    let gpt = Arch::Gpt { vocab: 16, d: 32, layers: 2, heads: 4, seq: 8, dropout: 0.1, tied: true };
    same_on_host_and_virtual(gpt, Dataset::Sequences { vocab: 16, seq: 8 });
    let resnet =
        Arch::BottleneckResNet { side: 32, width: 4, blocks: vec![1, 1, 1, 1], classes: 4 };
    same_on_host_and_virtual(resnet, Dataset::Stripes { side: 32, classes: 4 });
    let mobilenet = Arch::MobileNetV3 { side: 32, width_mult: 0.25, classes: 4 };
    same_on_host_and_virtual(mobilenet, Dataset::Stripes { side: 32, classes: 4 });
    let vit =
        Arch::Vit { side: 16, patch: 4, d: 16, layers: 2, heads: 2, classes: 4, dropout: 0.1 };
    same_on_host_and_virtual(vit, Dataset::Stripes { side: 16, classes: 4 });
}

/// The preset CNNs channels_last (NHWC convolutions, batch norms, poolings and
/// squeeze-excitation; on a GPU the own kernels, which the virtual device models).
#[test]
fn channels_last_cnns_allocate_alike_on_host_and_virtual_devices() {
    let opts = ModelOptions::default().with_channels_last(true);
    let small = Arch::ResNet { width: 8, blocks: vec![1, 1], classes: 4 };
    same_on_host_and_virtual_with(small, Dataset::Stripes { side: 8, classes: 4 }, opts);
    let resnet =
        Arch::BottleneckResNet { side: 32, width: 4, blocks: vec![1, 1, 1, 1], classes: 4 };
    same_on_host_and_virtual_with(resnet, Dataset::Stripes { side: 32, classes: 4 }, opts);
    let mobilenet = Arch::MobileNetV3 { side: 32, width_mult: 0.25, classes: 4 };
    same_on_host_and_virtual_with(mobilenet, Dataset::Stripes { side: 32, classes: 4 }, opts);
}
