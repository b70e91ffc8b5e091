//! Host throughput of elementwise and row-wise ops through the tensor API, in bytes moved per
//! second (criterion's throughput), at 1M and 16M elements.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;
use vram_kernels::{DType, Device, Tensor, ops};

fn bench(c: &mut Criterion) {
    let dev = Device::host(2 << 30);
    let mut group = c.benchmark_group("elementwise_f32");
    for n in [1usize << 20, 1 << 24] {
        let values: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 1e-3 - 0.5).collect();
        let a = Tensor::from_f32_slice(&dev, &[n / 1024, 1024], &values, DType::F32).unwrap();
        let b = Tensor::from_f32_slice(&dev, &[n / 1024, 1024], &values, DType::F32).unwrap();
        let gamma = Tensor::full(&dev, &[1024], DType::F32, 1.0).unwrap();
        let beta = Tensor::zeros(&dev, &[1024], DType::F32).unwrap();
        let label = format!("{}M", n >> 20);
        // add reads two tensors and writes one; the others read one and write one.
        group.throughput(Throughput::Bytes(3 * 4 * n as u64));
        group.bench_function(BenchmarkId::new("add", &label), |bch| {
            bch.iter(|| ops::add(black_box(&a), &b).unwrap())
        });
        group.throughput(Throughput::Bytes(2 * 4 * n as u64));
        group.bench_function(BenchmarkId::new("relu", &label), |bch| {
            bch.iter(|| ops::relu(black_box(&a)).unwrap())
        });
        group.bench_function(BenchmarkId::new("gelu", &label), |bch| {
            bch.iter(|| ops::gelu(black_box(&a)).unwrap())
        });
        group.bench_function(BenchmarkId::new("softmax", &label), |bch| {
            bch.iter(|| ops::softmax(black_box(&a)).unwrap())
        });
        group.bench_function(BenchmarkId::new("layer_norm", &label), |bch| {
            bch.iter(|| ops::layer_norm(black_box(&a), &gamma, &beta, 1e-5).unwrap())
        });
        group.throughput(Throughput::Bytes(6 * n as u64));
        group.bench_function(BenchmarkId::new("cast_to_bf16", &label), |bch| {
            bch.iter(|| black_box(&a).to_dtype(DType::BF16).unwrap())
        });
    }
    group.finish();

    // Cross-entropy over a GPT-2-sized vocabulary: 20 rows of 50,257 logits (1M), forward
    // (log-sum-exp per row) and backward (softmax minus the one-hot target).
    let mut group = c.benchmark_group("cross_entropy_f32");
    let (rows, vocab) = (20usize, 50_257usize);
    let values: Vec<f32> = (0..rows * vocab).map(|i| (i % 1000) as f32 * 1e-2 - 5.0).collect();
    let logits = Tensor::from_f32_slice(&dev, &[rows, vocab], &values, DType::F32).unwrap();
    let targets: Vec<u32> = (0..rows as u32).map(|r| r * 997 % vocab as u32).collect();
    group.throughput(Throughput::Bytes(4 * (rows * vocab) as u64));
    group.bench_function("forward", |bch| {
        bch.iter(|| ops::cross_entropy(black_box(&logits), &targets, None).unwrap())
    });
    let fwd = ops::cross_entropy(&logits, &targets, None).unwrap();
    group.throughput(Throughput::Bytes(8 * (rows * vocab) as u64));
    group.bench_function("backward", |bch| {
        bch.iter(|| {
            ops::cross_entropy_backward(black_box(&logits), &targets, None, &fwd.lse, 1.0).unwrap()
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
