//! CUDA time of ResNet-50's convolutions (torchvision's v1.5 shapes, batch 64, f32), one row
//! per distinct shape with the times of one call and how many times a step calls it:
//! forward, backward (dx and the weight's gradient) and the weight's gradient alone (what
//! the stem's backward is). The totals weigh each shape by its count, so that they compare
//! with the twin's `conv2d` and `conv2d_backward` rows; `xtask/gpu/torch_conv.py` times
//! cuDNN on the same shapes (`measure.sh conv` runs both).
//!
//! The convolutions run on the device's path (`VRAM_CONV_BACKEND`: `auto`, the default, is
//! cuDNN where it loads; `own` is vram's kernels; `cudnn`), printed on the first line with
//! TF32 off and cuDNN's heuristics (`--benchmark`: its timed search), as `torch_conv.py`.
//!
//! Timing: two warm-up calls, then ten between two device synchronizations. On a machine
//! without a usable CUDA device it prints `skipped: no CUDA device (...)` and exits 0.
//!
//! `cargo run --release -p vram-kernels --example cuda_conv [batch] [--benchmark]`

mod common;

use common::{cuda_or_skip, time, values};
use vram_kernels::ops::{self, Conv2dOptions};
use vram_kernels::{DType, Result, Tensor};

/// `(c_in, c_out, kernel, stride, input side, calls per step)`; padding is kernel / 2.
const SHAPES: &[(usize, usize, usize, usize, usize, usize)] = &[
    (3, 64, 7, 2, 224, 1),
    (64, 64, 1, 1, 56, 1),
    (256, 64, 1, 1, 56, 2),
    (64, 64, 3, 1, 56, 3),
    (64, 256, 1, 1, 56, 4),
    (256, 128, 1, 1, 56, 1),
    (512, 128, 1, 1, 28, 3),
    (128, 128, 3, 2, 56, 1),
    (128, 128, 3, 1, 28, 3),
    (128, 512, 1, 1, 28, 4),
    (256, 512, 1, 2, 56, 1),
    (512, 256, 1, 1, 28, 1),
    (1024, 256, 1, 1, 14, 5),
    (256, 256, 3, 2, 28, 1),
    (256, 256, 3, 1, 14, 5),
    (256, 1024, 1, 1, 14, 6),
    (512, 1024, 1, 2, 28, 1),
    (1024, 512, 1, 1, 14, 1),
    (2048, 512, 1, 1, 7, 2),
    (512, 512, 3, 2, 14, 1),
    (512, 512, 3, 1, 7, 2),
    (512, 2048, 1, 1, 7, 3),
    (1024, 2048, 1, 2, 14, 1),
];

fn main() -> Result<()> {
    let Some(dev) = cuda_or_skip() else { return Ok(()) };
    let batch = std::env::args().skip(1).find_map(|v| v.parse().ok()).unwrap_or(64);
    // As torch_conv.py: TF32 off, heuristics unless asked.
    dev.set_allow_tf32_cudnn(false);
    dev.set_cudnn_benchmark(std::env::args().any(|a| a == "--benchmark"));
    let tensor = |shape: &[usize], seed| {
        let n = shape.iter().product();
        Tensor::from_f32_slice(&dev, shape, &values(n, seed), DType::F32)
    };
    println!(
        "device: {}, batch {batch}, f32, convolutions: {} (TF32 off, benchmark {})",
        dev.name(),
        dev.conv_path(),
        dev.cudnn_benchmark()
    );
    println!(
        "| c_in | c_out | kernel | stride | side | calls | forward ms | backward ms | weight only ms |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut total = [0.0; 3];
    for &(cin, cout, k, s, side, calls) in SHAPES {
        let opts = Conv2dOptions::default().stride((s, s)).padding((k / 2, k / 2));
        let x = tensor(&[batch, cin, side, side], 1)?;
        let w = tensor(&[cout, cin, k, k], 2)?;
        let dy = tensor(ops::conv2d(&x, &w, None, &opts)?.shape(), 3)?;
        let ms = |f: &mut dyn FnMut() -> Result<()>| {
            Ok::<_, vram_kernels::Error>(time(&dev, 2, 10, f)? * 1e3)
        };
        let t = [
            ms(&mut || ops::conv2d(&x, &w, None, &opts).map(drop))?,
            ms(&mut || ops::conv2d_backward(&x, &w, &dy, &opts, false).map(drop))?,
            ms(&mut || ops::conv2d_backward_weight(&x, &w, &dy, &opts, false).map(drop))?,
        ];
        for (sum, t) in total.iter_mut().zip(t) {
            *sum += t * calls as f64;
        }
        let [f, b, wo] = t;
        println!("| {cin} | {cout} | {k} | {s} | {side} | {calls} | {f:.3} | {b:.3} | {wo:.3} |");
    }
    let [f, b, wo] = total;
    println!(
        "total over a step's calls: forward {f:.2} ms, backward {b:.2} ms, weight only {wo:.2} ms"
    );
    Ok(())
}
