//! Host matmul and convolution throughput; criterion reports FLOP/s as elements/s.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use half::bf16;
use std::hint::black_box;
use vram_kernels::cpu::conv::{conv2d, conv2d_backward};
use vram_kernels::cpu::matmul::matmul;
use vram_kernels::{Conv2dOptions, Conv2dParams, MatmulSpec};

/// Deterministic values in [-1, 1) so every run multiplies the same matrices.
fn values(len: usize) -> Vec<f32> {
    (0..len).map(|i| ((i * 7919) % 2003) as f32 / 1001.5 - 1.0).collect()
}

fn square_matmul(c: &mut Criterion) {
    let mut group = c.benchmark_group("matmul_f32");
    group.sample_size(20);
    for n in [256usize, 512, 1024] {
        let (a, b, mut out) = (values(n * n), values(n * n), vec![0.0f32; n * n]);
        let spec = MatmulSpec::new(n, n, n);
        group.throughput(Throughput::Elements(2 * (n * n * n) as u64));
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |bench, _| {
            bench.iter(|| matmul(&spec, black_box(&a), black_box(&b), &mut out).unwrap());
        });
    }
    group.finish();

    let mut group = c.benchmark_group("matmul_bf16");
    group.sample_size(20);
    let n = 512usize;
    let cast = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<_>>();
    let (a, b, mut out) = (cast(values(n * n)), cast(values(n * n)), vec![bf16::ZERO; n * n]);
    let spec = MatmulSpec::new(n, n, n);
    group.throughput(Throughput::Elements(2 * (n * n * n) as u64));
    group.bench_with_input(BenchmarkId::from_parameter(n), &n, |bench, _| {
        bench.iter(|| matmul(&spec, black_box(&a), black_box(&b), &mut out).unwrap());
    });
    group.finish();
}

fn resnet_block_conv(c: &mut Criterion) {
    let mut group = c.benchmark_group("conv2d_f32");
    group.sample_size(20);
    // A ResNet block's 3x3 (batch 8, 64 channels, 32 px), and the twin's resnet-like 3x3 and
    // 1x1 shapes (48 px).
    let cases = [
        ("resnet_block", [8, 64, 32, 32], [64, 64, 3, 3]),
        ("3x3_32c_48px", [8, 32, 48, 48], [32, 32, 3, 3]),
        ("1x1_16to32c_48px", [8, 16, 48, 48], [32, 16, 1, 1]),
    ];
    for (name, x_shape, w_shape) in cases {
        let pad = w_shape[2] / 2;
        let opts = Conv2dOptions::default().padding((pad, pad));
        let p = Conv2dParams::new(&x_shape, &w_shape, &opts).unwrap();
        let (oh, ow) = p.output_hw();
        let flops = 2 * p.batch() * p.c_out() * oh * ow * p.c_in() * w_shape[2] * w_shape[3];
        let (x, w, bias) = (values(p.input_len()), values(p.weight_len()), values(p.c_out()));
        let (mut y, dy) = (vec![0.0f32; p.output_len()], values(p.output_len()));
        let (mut dx, mut dw) = (vec![0.0f32; p.input_len()], vec![0.0f32; p.weight_len()]);
        group.throughput(Throughput::Elements(flops as u64));
        group.bench_function(BenchmarkId::new("forward", name), |bench| {
            bench.iter(|| conv2d(&p, black_box(&x), black_box(&w), Some(&bias), &mut y).unwrap());
        });
        // The input's and the weight's gradients: twice the forward's products.
        group.throughput(Throughput::Elements(2 * flops as u64));
        group.bench_function(BenchmarkId::new("backward", name), |bench| {
            bench.iter(|| {
                let (dx, dw) = (Some(&mut dx[..]), Some(&mut dw[..]));
                conv2d_backward(&p, black_box(&x), &w, &dy, dx, dw, None).unwrap()
            });
        });
    }
    group.finish();
}

criterion_group!(benches, square_matmul, resnet_block_conv);
criterion_main!(benches);
