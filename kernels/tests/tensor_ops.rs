//! The tensor layer: errors name what went wrong, memory is counted and returned, and the
//! ops compute what the CPU reference computes.

use half::{bf16, f16};
use vram_kernels::cpu;
use vram_kernels::ops;
use vram_kernels::{
    AdamWConfig, Conv2dOptions, DType, Device, Element, Error, Pool2dOptions, SgdConfig, Tensor,
};

fn dev() -> Device {
    Device::host(256 << 20)
}

/// Deterministic values in about [-1, 1].
fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| ((((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 2001) as f32 / 1000.0) - 1.0)
        .collect()
}

fn t(dev: &Device, shape: &[usize], seed: u32) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_f32_slice(dev, shape, &values(n, seed), DType::F32).unwrap()
}

#[test]
fn shape_mismatch_errors_name_the_op_and_both_shapes() {
    let d = dev();
    let (a, b) = (t(&d, &[2, 3], 1), t(&d, &[3, 2], 2));
    let err = ops::add(&a, &b).unwrap_err();
    assert!(
        matches!(&err, Error::ShapeMismatch { op: "add", lhs, rhs } if lhs == &[2, 3] && rhs == &[3, 2])
    );
    assert_eq!(err.to_string(), "add: shape mismatch between [2, 3] and [3, 2]");

    let err = ops::matmul(&a, &a, false, false).unwrap_err().to_string();
    assert!(err.contains("matmul") && err.contains("[2, 3]"), "{err}");
    let w = t(&d, &[4, 5], 3);
    let err = ops::linear(&a, &w, None).unwrap_err().to_string();
    assert!(err.contains("linear") && err.contains("[2, 3]") && err.contains("[4, 5]"), "{err}");
    let x = t(&d, &[1, 4, 5, 5], 4);
    let k = t(&d, &[2, 3, 3, 3], 5);
    let err = ops::conv2d(&x, &k, None, &Conv2dOptions::default()).unwrap_err().to_string();
    assert!(err.contains("conv2d") && err.contains("[1, 4, 5, 5]") && err.contains("[2, 3, 3, 3]"));
    let err = ops::relu_backward(&a, &b).unwrap_err().to_string();
    assert!(err.starts_with("relu_backward"), "{err}");
}

#[test]
fn dtype_and_device_mismatches_are_errors() {
    let d = dev();
    let a = t(&d, &[4], 1);
    let h = a.to_dtype(DType::F16).unwrap();
    let err = ops::mul(&a, &h).unwrap_err();
    assert!(matches!(err, Error::DTypeMismatch { op: "mul", lhs: DType::F32, rhs: DType::F16 }));
    assert!(err.to_string().contains("f32") && err.to_string().contains("f16"));
    assert!(matches!(a.as_slice::<bf16>(), Err(Error::DTypeMismatch { .. })));

    let other = t(&dev(), &[4], 1);
    assert!(matches!(ops::add(&a, &other), Err(Error::DeviceMismatch { op: "add" })));
}

#[test]
fn out_of_memory_is_an_error_and_leaves_the_inputs_intact() {
    let d = Device::host(4 << 20);
    let a = t(&d, &[1024, 64], 1);
    let b = t(&d, &[64, 1024], 2);
    let before = d.memory_allocated();
    // The 4 MiB product needs a 20 MiB segment.
    let err = ops::matmul(&a, &b, false, false).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    assert!(matches!(err, Error::OutOfMemory(_)));
    assert_eq!(d.memory_allocated(), before);
    assert_eq!(a.to_f32_vec().unwrap(), values(1024 * 64, 1));
    assert_eq!(b.to_f32_vec().unwrap(), values(64 * 1024, 2));
    // The device still serves requests that fit.
    let c = ops::matmul(&t(&d, &[16, 64], 3), &a, false, true).unwrap();
    assert_eq!(c.shape(), &[16, 1024]);
}

#[test]
fn every_tensor_is_counted_and_dropping_it_returns_its_bytes() {
    let d = dev();
    assert_eq!(d.memory_allocated(), 0);
    let x = Tensor::zeros(&d, &[100], DType::F32).unwrap(); // 400 B -> one 512 B block
    assert_eq!(x.size_in_bytes(), 400);
    assert_eq!(d.memory_allocated(), 512);
    let y = Tensor::zeros(&d, &[1000], DType::BF16).unwrap(); // 2000 B -> 2048 B
    assert_eq!(d.memory_allocated(), 512 + 2048);
    let z = ops::relu(&y).unwrap();
    assert_eq!(d.memory_allocated(), 512 + 2 * 2048);
    let empty = Tensor::zeros(&d, &[0, 7], DType::F16).unwrap();
    assert_eq!(empty.numel(), 0);
    assert_eq!(empty.size_in_bytes(), 0);
    let peak = d.max_memory_allocated();
    drop((x, y, z, empty));
    assert_eq!(d.memory_allocated(), 0);
    assert!(peak >= 512 + 2 * 2048);
    assert!(d.memory_reserved() > 0, "freed blocks stay cached");
    d.empty_cache();
    assert_eq!(d.memory_reserved(), 0);
    assert!(d.memory_summary().contains("Allocated memory"), "{}", d.memory_summary());
    assert_eq!(d.memory_stats().get("allocated_bytes.all.current"), Some(0));
}

fn round_trip<T: Element>(dev: &Device) {
    let data: Vec<T> = values(6, 9).into_iter().map(T::from_f32).collect();
    let x = Tensor::from_slice(dev, &[2, 3], &data).unwrap();
    assert_eq!(x.dtype(), T::DTYPE);
    assert_eq!(x.to_vec::<T>().unwrap(), data);
    assert_eq!(x.as_slice::<T>().unwrap(), &data[..]);
    let f32s: Vec<f32> = data.iter().map(|v| v.to_f32()).collect();
    assert_eq!(x.to_f32_vec().unwrap(), f32s);
    assert_eq!(
        Tensor::from_f32_slice(dev, &[3, 2], &f32s, T::DTYPE).unwrap().to_vec::<T>().unwrap(),
        data
    );
    let back = x.to_dtype(DType::F32).unwrap().to_dtype(T::DTYPE).unwrap();
    assert_eq!(back.to_vec::<T>().unwrap(), data, "widening then narrowing is exact");
    let copy = x.try_clone().unwrap();
    let r = x.reshape(&[3, 2]).unwrap();
    assert_eq!((r.shape(), copy.to_vec::<T>().unwrap()), (&[3usize, 2][..], data));
}

#[test]
fn from_slice_and_to_vec_round_trip_for_every_dtype() {
    let d = dev();
    round_trip::<f32>(&d);
    round_trip::<f16>(&d);
    round_trip::<bf16>(&d);
    let err = Tensor::from_slice(&d, &[2, 2], &[1.0f32; 3]).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }));
    let x = Tensor::zeros(&d, &[4], DType::F32).unwrap();
    assert!(matches!(x.reshape(&[5]), Err(Error::ShapeMismatch { op: "reshape", .. })));
    let mut y = Tensor::zeros(&d, &[4], DType::F32).unwrap();
    assert!(y.set_shape(&[3]).is_err());
    assert_eq!(y.shape(), &[4]);
}

/// Two-layer MLP, forward and backward, through the tensor ops and through `cpu::` on
/// plain vectors: the results must be identical (the ops add checks, not arithmetic).
fn mlp_matches_reference<T: Element>() {
    let d = dev();
    let (n, i, h, c) = (8, 5, 16, 3);
    let targets: Vec<u32> = (0..n as u32).map(|r| r % c as u32).collect();
    let vec = |len: usize, seed: u32| -> Vec<T> {
        values(len, seed).into_iter().map(T::from_f32).collect::<Vec<T>>()
    };
    let (xv, w1v, b1v, w2v, b2v) =
        (vec(n * i, 1), vec(h * i, 2), vec(h, 3), vec(c * h, 4), vec(c, 5));
    let tensor = |shape: &[usize], v: &[T]| Tensor::from_slice(&d, shape, v).unwrap();
    let (x, w1, b1, w2, b2) = (
        tensor(&[n, i], &xv),
        tensor(&[h, i], &w1v),
        tensor(&[h], &b1v),
        tensor(&[c, h], &w2v),
        tensor(&[c], &b2v),
    );

    let z1 = ops::linear(&x, &w1, Some(&b1)).unwrap();
    let a1 = ops::relu(&z1).unwrap();
    let z2 = ops::linear(&a1, &w2, Some(&b2)).unwrap();
    let ce = ops::cross_entropy(&z2, &targets, None).unwrap();
    let dz2 = ops::cross_entropy_backward(&z2, &targets, None, &ce.lse, 1.0).unwrap();
    let g2 = ops::linear_backward(&a1, &w2, &dz2, true).unwrap();
    let da1 = ops::relu_backward(&z1, &g2.dx).unwrap();
    let g1 = ops::linear_backward(&x, &w1, &da1, true).unwrap();

    let zeros = |len: usize| vec![T::from_f32(0.0); len];
    let (mut rz1, mut ra1, mut rz2) = (zeros(n * h), zeros(n * h), zeros(n * c));
    cpu::matmul::linear(&xv, &w1v, Some(&b1v), &mut rz1, i, h).unwrap();
    cpu::activation::relu(&rz1, &mut ra1).unwrap();
    cpu::matmul::linear(&ra1, &w2v, Some(&b2v), &mut rz2, h, c).unwrap();
    let mut lse = vec![0.0f32; n];
    let loss = cpu::loss::cross_entropy(&rz2, &targets, None, &mut lse).unwrap();
    let mut rdz2 = zeros(n * c);
    cpu::loss::cross_entropy_backward(&rz2, &targets, None, &lse, 1.0, &mut rdz2).unwrap();
    let (mut rda1, mut rdw2, mut rdb2) = (zeros(n * h), zeros(c * h), zeros(c));
    cpu::matmul::linear_backward(
        &ra1,
        &w2v,
        &rdz2,
        Some(&mut rda1),
        Some(&mut rdw2),
        Some(&mut rdb2),
        h,
        c,
    )
    .unwrap();
    let mut rdz1 = zeros(n * h);
    cpu::activation::relu_backward(&rz1, &rda1, &mut rdz1).unwrap();
    let (mut rdx, mut rdw1, mut rdb1) = (zeros(n * i), zeros(h * i), zeros(h));
    cpu::matmul::linear_backward(
        &xv,
        &w1v,
        &rdz1,
        Some(&mut rdx),
        Some(&mut rdw1),
        Some(&mut rdb1),
        i,
        h,
    )
    .unwrap();

    assert!(loss.is_finite());
    assert_eq!(ce.loss.to_bits(), loss.to_bits());
    assert_eq!(z2.to_vec::<T>().unwrap(), rz2);
    assert_eq!(g1.dx.to_vec::<T>().unwrap(), rdx);
    assert_eq!(g1.dw.to_vec::<T>().unwrap(), rdw1);
    assert_eq!(g1.dbias.unwrap().to_vec::<T>().unwrap(), rdb1);
    assert_eq!(g2.dw.to_vec::<T>().unwrap(), rdw2);
    assert_eq!(g2.dbias.unwrap().to_vec::<T>().unwrap(), rdb2);
}

#[test]
fn mlp_forward_and_backward_match_the_cpu_reference() {
    mlp_matches_reference::<f32>();
    mlp_matches_reference::<bf16>();
}

#[test]
fn batched_matmul_broadcasts_a_rank_2_operand_and_sums_its_gradient() {
    let d = dev();
    let (a, w) = (t(&d, &[3, 4, 5], 1), t(&d, &[5, 2], 2));
    let c = ops::matmul(&a, &w, false, false).unwrap();
    assert_eq!(c.shape(), &[3, 4, 2]);
    let dc = t(&d, &[3, 4, 2], 3);
    let (da, dw) = ops::matmul_backward(&a, &w, &dc, false, false).unwrap();
    assert_eq!((da.shape(), dw.shape()), (&[3usize, 4, 5][..], &[5usize, 2][..]));
    // The broadcast weight's gradient equals the one of the flattened [12, 5] x [5, 2].
    let a2 = a.try_clone().unwrap().reshape(&[12, 5]).unwrap();
    let dc2 = dc.try_clone().unwrap().reshape(&[12, 2]).unwrap();
    let (_, dw2) = ops::matmul_backward(&a2, &w, &dc2, false, false).unwrap();
    for (x, y) in dw.to_f32_vec().unwrap().iter().zip(dw2.to_f32_vec().unwrap()) {
        assert!((x - y).abs() < 1e-5, "{x} vs {y}");
    }
    // Transposed operands: a^T stored [5, 4] per batch.
    let at = t(&d, &[3, 5, 4], 4);
    assert_eq!(ops::matmul(&at, &w, true, false).unwrap().shape(), &[3, 4, 2]);
    assert!(ops::matmul(&at, &t(&d, &[2, 5, 2], 5), true, false).is_err());
}

#[test]
fn conv_pool_and_norm_ops_check_shapes_and_compute_the_reference() {
    let d = dev();
    // Depthwise: groups == channels.
    let x = t(&d, &[2, 4, 6, 6], 1);
    let k = t(&d, &[4, 1, 3, 3], 2);
    let opts = Conv2dOptions::default().padding((1, 1)).groups(4);
    let y = ops::conv2d(&x, &k, None, &opts).unwrap();
    assert_eq!(y.shape(), &[2, 4, 6, 6]);
    let params = ops::conv2d_params(x.shape(), k.shape(), &opts).unwrap();
    let mut want = vec![0.0f32; y.numel()];
    cpu::conv::conv2d(&params, x.as_slice().unwrap(), k.as_slice().unwrap(), None, &mut want)
        .unwrap();
    assert_eq!(y.to_f32_vec().unwrap(), want);
    let g = ops::conv2d_backward(&x, &k, &y, &opts, true).unwrap();
    assert_eq!((g.dx.shape(), g.dweight.shape()), (x.shape(), k.shape()));
    // The parameters' gradients alone: the same values, and no dx allocated (the peak is
    // lower by at least dx's bytes).
    d.reset_peak_stats();
    let full_peak = {
        let _g = ops::conv2d_backward(&x, &k, &y, &opts, true).unwrap();
        d.max_memory_allocated()
    };
    d.reset_peak_stats();
    let alone = ops::conv2d_backward_weight(&x, &k, &y, &opts, true).unwrap();
    let alone_peak = d.max_memory_allocated();
    assert_eq!(alone.dweight.to_f32_vec().unwrap(), g.dweight.to_f32_vec().unwrap());
    assert_eq!(alone.dbias.unwrap().to_f32_vec().unwrap(), g.dbias.unwrap().to_f32_vec().unwrap());
    assert!(alone_peak + x.size_in_bytes() as u64 <= full_peak, "{alone_peak} vs {full_peak}");
    assert!(ops::conv2d(&x, &k, None, &Conv2dOptions::default().groups(3)).is_err());

    let p = Pool2dOptions::new((2, 2), (2, 2));
    let (m, argmax) = ops::max_pool2d(&x, &p).unwrap();
    assert_eq!(m.shape(), &[2, 4, 3, 3]);
    let dx = ops::max_pool2d_backward(&m, &argmax, x.shape(), &p).unwrap();
    assert_eq!(dx.shape(), x.shape());
    let avg = ops::avg_pool2d(&x, &p, true).unwrap();
    assert_eq!(ops::avg_pool2d_backward(&avg, x.shape(), &p, true).unwrap().shape(), x.shape());
    let gap = ops::global_avg_pool(&x).unwrap();
    assert_eq!(gap.shape(), &[2, 4]);
    assert_eq!(ops::global_avg_pool_backward(&gap, x.shape()).unwrap().shape(), x.shape());
    // Added in place: in f32 the same values as materializing the gradient and adding it.
    let mut acc = t(&d, x.shape(), 5);
    let mut want = acc.clone();
    ops::add_assign(&mut want, &ops::global_avg_pool_backward(&gap, x.shape()).unwrap()).unwrap();
    ops::global_avg_pool_backward_add(&mut acc, &gap).unwrap();
    assert_eq!(acc.to_f32_vec().unwrap(), want.to_f32_vec().unwrap());
    // Bad input: an error, the accumulator unchanged.
    let before = acc.to_f32_vec().unwrap();
    let half = gap.to_dtype(DType::F16).unwrap();
    for dy in [&x, &half, &t(&d, &[4, 2], 6)] {
        assert!(ops::global_avg_pool_backward_add(&mut acc, dy).is_err());
    }
    assert!(ops::global_avg_pool_backward_add(&mut gap.clone(), &gap).is_err());
    assert_eq!(acc.to_f32_vec().unwrap(), before);
    assert!(ops::max_pool2d(&x, &Pool2dOptions::new((2, 2), (0, 1))).is_err());

    let h = t(&d, &[3, 8], 3);
    let gamma = Tensor::full(&d, &[8], DType::F32, 1.0).unwrap();
    let beta = Tensor::zeros(&d, &[8], DType::F32).unwrap();
    let ln = ops::layer_norm(&h, &gamma, &beta, 1e-5).unwrap();
    assert_eq!((ln.mean.shape(), ln.rstd.dtype()), (&[3usize][..], DType::F32));
    for row in ln.y.to_f32_vec().unwrap().chunks(8) {
        assert!(row.iter().sum::<f32>().abs() < 1e-4, "normalized rows have mean 0");
    }
    let lg = ops::layer_norm_backward(&h, &gamma, &ln.mean, &ln.rstd, &ln.y).unwrap();
    assert_eq!(lg.dgamma.shape(), &[8]);
    assert!(ops::layer_norm(&h, &t(&d, &[7], 4), &beta, 1e-5).is_err());
}

#[test]
fn softmax_embedding_dropout_and_reductions() {
    let d = dev();
    let s = ops::causal_softmax(&t(&d, &[2, 4, 4], 1)).unwrap();
    let v = s.to_f32_vec().unwrap();
    assert_eq!(v[1], 0.0, "row 0 sees only column 0");
    assert!((v[..4].iter().sum::<f32>() - 1.0).abs() < 1e-6);
    assert!(ops::causal_softmax(&t(&d, &[4, 3], 1)).is_err());
    let y = ops::softmax(&t(&d, &[3, 5], 2)).unwrap();
    assert!((ops::sum(&y).unwrap() - 3.0).abs() < 1e-5);

    let table = t(&d, &[10, 4], 3);
    let e = ops::embedding(&table, &[1, 9, 1]).unwrap();
    assert_eq!(&e.to_f32_vec().unwrap()[..4], &table.to_f32_vec().unwrap()[4..8]);
    let err = ops::embedding(&table, &[10]).unwrap_err();
    assert!(matches!(err, Error::IndexOutOfRange { op: "embedding", index: 10, bound: 10 }));
    let dt = ops::embedding_backward(&[1, 9, 1], &e, 10).unwrap();
    assert_eq!(dt.shape(), &[10, 4]);
    let ce = ops::cross_entropy(&t(&d, &[2, 3], 4), &[0, 3], None).unwrap_err();
    assert!(matches!(ce, Error::IndexOutOfRange { index: 3, bound: 3, .. }));

    let x = Tensor::full(&d, &[1000], DType::F16, 1.0).unwrap();
    let y = ops::dropout(&x, 0.5, 7, 0).unwrap();
    let dy = ops::dropout_backward(&x, 0.5, 7, 0).unwrap();
    assert_eq!(
        y.to_f32_vec().unwrap(),
        dy.to_f32_vec().unwrap(),
        "the backward recomputes the forward's mask"
    );
    let kept = y.to_f32_vec().unwrap().iter().filter(|&&v| v == 2.0).count();
    assert!((400..600).contains(&kept), "{kept}");
    assert!(matches!(ops::dropout(&x, 1.0, 7, 0), Err(Error::InvalidArgument { .. })));

    assert_eq!(ops::mean(&x).unwrap(), 1.0);
    let rows = ops::sum_last_dim(&t(&d, &[3, 4], 5)).unwrap();
    assert_eq!(rows.shape(), &[3]);
    assert_eq!(ops::mean_last_dim_backward(&rows, 4).unwrap().shape(), &[3, 4]);
    let db = ops::bias_add_backward(&Tensor::full(&d, &[5, 2], DType::F32, 1.0).unwrap()).unwrap();
    assert_eq!(db.to_f32_vec().unwrap(), vec![5.0, 5.0]);
}

#[test]
fn optimizer_steps_and_unscale_update_in_place() {
    let d = dev();
    let mut p = Tensor::full(&d, &[4], DType::F32, 1.0).unwrap();
    let g = Tensor::full(&d, &[4], DType::BF16, 0.5).unwrap();
    let sgd =
        SgdConfig { lr: 0.1, momentum: 0.9, dampening: 0.0, weight_decay: 0.0, nesterov: false };
    assert!(ops::sgd_step(&mut p, &g, None, true, &sgd).is_err(), "momentum needs a buffer");
    let mut buf = Tensor::zeros(&d, &[4], DType::F32).unwrap();
    ops::sgd_step(&mut p, &g, Some(&mut buf), true, &sgd).unwrap();
    assert_eq!(p.to_f32_vec().unwrap(), vec![0.95; 4]);
    assert_eq!(buf.to_f32_vec().unwrap(), vec![0.5; 4]);

    let (mut m, mut v) = (
        Tensor::zeros(&d, &[4], DType::F32).unwrap(),
        Tensor::zeros(&d, &[4], DType::F32).unwrap(),
    );
    let adam = AdamWConfig { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 };
    assert!(ops::adamw_step(&mut p, &g, &mut m, &mut v, 0, &adam).is_err());
    ops::adamw_step(&mut p, &g, &mut m, &mut v, 1, &adam).unwrap();
    assert!((p.to_f32_vec().unwrap()[0] - 0.94).abs() < 1e-5, "the first Adam step moves by lr");
    let mut half_params = p.to_dtype(DType::F16).unwrap();
    assert!(matches!(
        ops::adamw_step(&mut half_params, &g, &mut m, &mut v, 2, &adam),
        Err(Error::DTypeMismatch { .. })
    ));

    let mut g1 = Tensor::full(&d, &[3], DType::F16, 4.0).unwrap();
    let mut g2 = Tensor::from_slice(&d, &[2], &[1.0f32, f32::INFINITY]).unwrap();
    assert!(!ops::unscale_and_check_finite(&mut [&mut g1], 0.25).unwrap());
    assert_eq!(g1.to_f32_vec().unwrap(), vec![1.0; 3]);
    assert!(ops::unscale_and_check_finite(&mut [&mut g1, &mut g2], 0.5).unwrap());
    assert_eq!(g1.to_f32_vec().unwrap(), vec![0.5; 3], "every tensor is unscaled");

    let mut acc = Tensor::zeros(&d, &[3], DType::F32).unwrap();
    ops::add_assign(&mut acc, &g1).unwrap();
    ops::add_assign(&mut acc, &g1).unwrap();
    assert_eq!(acc.to_f32_vec().unwrap(), vec![1.0; 3]);
    assert!(ops::add_assign(&mut acc, &g2).is_err());
}

#[test]
fn degenerate_shapes_give_empty_or_zero_results_not_panics() {
    let d = dev();
    // k = 0: the product of [2, 0] and [0, 3] is a [2, 3] matrix of zeros.
    let c = ops::matmul(&t(&d, &[2, 0], 1), &t(&d, &[0, 3], 2), false, false).unwrap();
    assert_eq!(c.to_f32_vec().unwrap(), vec![0.0; 6]);
    let (da, db) = ops::matmul_backward(
        &t(&d, &[0, 2, 2], 1),
        &t(&d, &[2, 2], 2),
        &t(&d, &[0, 2, 2], 3),
        false,
        false,
    )
    .unwrap();
    assert_eq!((da.numel(), db.to_f32_vec().unwrap()), (0, vec![0.0; 4]));
    let g = ops::linear_backward(&t(&d, &[3, 2], 1), &t(&d, &[0, 2], 2), &t(&d, &[3, 0], 3), true)
        .unwrap();
    assert_eq!(g.dx.to_f32_vec().unwrap(), vec![0.0; 6]);
    assert_eq!(ops::softmax(&t(&d, &[0, 4], 1)).unwrap().numel(), 0);
    assert!(ops::softmax(&Tensor::zeros(&d, &[], DType::F32).unwrap()).is_err());
    assert!(ops::layer_norm(&t(&d, &[2, 0], 1), &t(&d, &[0], 1), &t(&d, &[0], 1), 1e-5).is_err());
}

/// Clones share memory (nothing allocated); writing to a shared tensor copies it first, so
/// the other clone keeps its values; the memory returns when the last clone is dropped.
#[test]
fn clones_share_memory_and_writes_copy_on_write() {
    let dev = Device::host(64 << 20);
    let mut a = Tensor::from_slice(&dev, &[4], &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
    let before = dev.memory_allocated();
    let b = a.clone();
    assert_eq!(dev.memory_allocated(), before, "a clone allocates nothing");
    assert!(a.is_shared() && b.is_shared());
    let ones = Tensor::full(&dev, &[4], DType::F32, 1.0).unwrap();
    let with_ones = dev.memory_allocated();
    vram_kernels::ops::add_assign(&mut a, &ones).unwrap();
    assert_eq!(a.to_vec::<f32>().unwrap(), [2.0, 3.0, 4.0, 5.0]);
    assert_eq!(b.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0, 4.0], "the clone kept its values");
    assert_eq!(dev.memory_allocated(), with_ones + 512, "the write copied the shared block");
    assert!(!a.is_shared() && !b.is_shared());
    drop((a, b, ones));
    assert_eq!(dev.memory_allocated(), 0);
}

/// `copy_from` converts in place: no allocation (unless the memory is shared), the values
/// rounded to the destination's dtype, the source untouched; bad shapes are errors.
#[test]
fn copy_from_converts_in_place_without_allocating() {
    let d = dev();
    let src = Tensor::from_f32_slice(&d, &[3], &[1.0, 0.1, -2.5], DType::F32).unwrap();
    let mut dst = Tensor::zeros(&d, &[3], DType::BF16).unwrap();
    let before = d.memory_stats().allocation.all.allocated;
    dst.copy_from(&src).unwrap();
    assert_eq!(d.memory_stats().allocation.all.allocated, before, "no allocation");
    let want: Vec<f32> =
        [1.0f32, 0.1, -2.5].iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
    assert_eq!(dst.to_f32_vec().unwrap(), want);
    assert_eq!(src.to_f32_vec().unwrap(), [1.0, 0.1, -2.5]);
    // A shared destination is copied first, so its other handle keeps its values.
    let other = dst.clone();
    dst.copy_from(&Tensor::zeros(&d, &[3], DType::F32).unwrap()).unwrap();
    assert_eq!(other.to_f32_vec().unwrap(), want);
    assert_eq!(dst.to_f32_vec().unwrap(), [0.0; 3]);
    let wrong = Tensor::zeros(&d, &[4], DType::F32).unwrap();
    assert!(matches!(dst.copy_from(&wrong), Err(Error::ShapeMismatch { .. })));
}

/// Regression tests for inputs that once panicked or corrupted (the kernels issue's list):
/// zero input channels, empty planes with padding, huge padding, and optimizer settings
/// that would turn parameters into NaN. Each is a result or a clear error, and a refused
/// step leaves the parameters as they were.
#[test]
fn bad_inputs_are_results_or_clear_errors_never_panics() {
    let d = dev();
    let z = |shape: &[usize]| Tensor::zeros(&d, shape, DType::F32).unwrap();
    // Convolution with no input channels: zeros (plus bias), and a backward of the same shape.
    let opts = Conv2dOptions::default().padding((1, 1));
    let (x, w) = (z(&[2, 0, 5, 5]), z(&[3, 0, 3, 3]));
    let y = ops::conv2d(&x, &w, None, &opts).unwrap();
    assert_eq!((y.shape(), y.to_f32_vec().unwrap()), (&[2, 3, 5, 5][..], vec![0.0; 150]));
    let g = ops::conv2d_backward(&x, &w, &z(&[2, 3, 5, 5]), &opts, true).unwrap();
    assert_eq!((g.dx.numel(), g.dweight.numel()), (0, 0));
    assert_eq!(g.dbias.map(|b| b.numel()), Some(3));
    // Pooling an empty plane with padding, forward and backward: errors naming the problem.
    let pool = Pool2dOptions::new((2, 2), (1, 1)).padding((1, 1));
    for e in [
        ops::max_pool2d(&z(&[2, 3, 0, 0]), &pool).map(drop).unwrap_err(),
        ops::avg_pool2d(&z(&[2, 3, 0, 0]), &pool, true).map(drop).unwrap_err(),
        ops::avg_pool2d_backward(&z(&[2, 3, 1, 1]), &[2, 3, 0, 0], &pool, true)
            .map(drop)
            .unwrap_err(),
    ] {
        assert!(e.to_string().contains("empty"), "{e}");
    }
    // Huge padding and dilation: errors, not overflowed shapes.
    let huge = Pool2dOptions::new((2, 2), (1, 1)).padding((usize::MAX / 2, 1));
    assert!(ops::max_pool2d(&z(&[1, 1, 4, 4]), &huge).is_err());
    // A dilated window wider than any input: an empty output, as a window larger than the
    // padded input gives, not a wrapped shape.
    let dilated = Conv2dOptions::default().dilation((usize::MAX / 2, 1));
    match ops::conv2d(&z(&[1, 1, 4, 4]), &z(&[1, 1, 3, 3]), None, &dilated) {
        Ok(y) => assert_eq!(y.numel(), 0, "{:?}", y.shape()),
        Err(e) => assert!(matches!(e, Error::InvalidArgument { .. }), "{e}"),
    }
    // Optimizer settings that make NaN are refused before anything is written.
    let mut p = Tensor::full(&d, &[4], DType::F32, 1.0).unwrap();
    let grad = Tensor::full(&d, &[4], DType::F32, 0.5).unwrap();
    let sgd = SgdConfig { lr: f32::NAN, ..SgdConfig::default() };
    assert!(ops::sgd_step(&mut p, &grad, None, true, &sgd).is_err());
    let (mut m, mut v) = (z(&[4]), z(&[4]));
    for bad in [
        AdamWConfig { beta1: 1.0, ..AdamWConfig::default() },
        AdamWConfig { eps: -1e-8, ..AdamWConfig::default() },
    ] {
        assert!(ops::adamw_step(&mut p, &grad, &mut m, &mut v, 1, &bad).is_err());
    }
    assert_eq!(p.to_f32_vec().unwrap(), [1.0; 4], "refused steps change nothing");
}

/// `permute` against a naive multi-index reference in every dtype, its backward is the
/// inverse permutation, and bad permutations are clear errors that allocate nothing.
#[test]
fn permute_matches_a_naive_reference_and_its_backward_inverts_it() {
    fn naive(x: &[f32], shape: &[usize], perm: &[usize]) -> Vec<f32> {
        let out: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
        let mut y = Vec::with_capacity(x.len());
        let idx = |flat: usize, dims: &[usize]| {
            let mut i = vec![0; dims.len()];
            let mut rest = flat;
            for a in (0..dims.len()).rev() {
                i[a] = rest % dims[a];
                rest /= dims[a];
            }
            i
        };
        for flat in 0..x.len() {
            let o = idx(flat, &out);
            let mut src = vec![0; shape.len()];
            for (a, &p) in perm.iter().enumerate() {
                src[p] = o[a];
            }
            y.push(x[src.iter().zip(shape).fold(0, |acc, (&i, &d)| acc * d + i)]);
        }
        y
    }
    let d = dev();
    let cases: [(&[usize], &[usize]); 5] = [
        (&[2, 5, 3, 4], &[0, 2, 1, 3]), // [b, s, h, dh] -> [b, h, s, dh]
        (&[2, 3, 5, 4], &[0, 2, 1, 3]),
        (&[3, 7, 6], &[0, 2, 1]),
        (&[4, 9], &[1, 0]),
        (&[2, 3, 4, 5], &[3, 1, 0, 2]),
    ];
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (shape, perm) in cases {
            let x = t(&d, shape, 3).to_dtype(dtype).unwrap();
            let y = ops::permute(&x, perm).unwrap();
            let want_shape: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
            assert_eq!(y.shape(), want_shape);
            assert_eq!(y.dtype(), dtype);
            // A copy: exact in every dtype.
            assert_eq!(y.to_f32_vec().unwrap(), naive(&x.to_f32_vec().unwrap(), shape, perm));
            let back = ops::permute_backward(&y, perm).unwrap();
            assert_eq!(back.shape(), shape);
            assert_eq!(back.to_f32_vec().unwrap(), x.to_f32_vec().unwrap());
        }
    }
    let x = t(&d, &[2, 3, 4], 1);
    let five = t(&d, &[1, 1, 1, 1, 2], 1);
    let before = d.memory_allocated();
    for perm in [&[0, 1][..], &[0, 1, 1], &[0, 1, 3], &[0, 1, 2, 3]] {
        let e = ops::permute(&x, perm).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { op: "permute", .. }), "{perm:?}: {e}");
        assert!(e.to_string().contains(&format!("{perm:?}")), "{e}");
        let e = ops::permute_backward(&x, perm).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { op: "permute_backward", .. }), "{e}");
    }
    let e = ops::permute(&five, &[0, 1, 2, 3, 4]).unwrap_err();
    assert!(e.to_string().contains("at most 4 axes"), "{e}");
    assert_eq!(d.memory_allocated(), before, "a refused permute allocates nothing");
}
