//! Batch norm against a reference written from PyTorch's definition
//! (`aten/src/ATen/native/Normalization.cpp`: biased variance to normalize, the unbiased one
//! into `running_var`, `running = momentum * batch + (1 - momentum) * running`), in f64;
//! the backward against central differences of that reference; and the refusals.

use vram_kernels::ops::{self, RunningStats};
use vram_kernels::{DType, Device, Tensor};

const EPS: f32 = 1e-5;

fn host() -> Device {
    Device::host(1 << 30)
}

/// Deterministic values in `[lo, hi)`.
fn values(n: usize, seed: u64, lo: f64, hi: f64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            lo + (hi - lo) * ((s >> 11) as f64 / (1u64 << 53) as f64)
        })
        .collect()
}

fn tensor(dev: &Device, shape: &[usize], v: &[f64], dtype: DType) -> Tensor {
    let v: Vec<f32> = v.iter().map(|&x| x as f32).collect();
    Tensor::from_f32_slice(dev, shape, &v, dtype).unwrap()
}

fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_f32_vec().unwrap().into_iter().map(f64::from).collect()
}

/// The values as stored in `dtype` (so the reference starts from what the op reads).
fn rounded(v: &[f64], dtype: DType) -> Vec<f64> {
    f64s(&tensor(&host(), &[v.len()], v, dtype))
}

/// PyTorch's training batch norm in f64 over `x: [n, c, s]`: `(y, mean, invstd, biased
/// var, unbiased var)`.
#[allow(clippy::type_complexity)]
fn reference(
    x: &[f64],
    c: usize,
    s: usize,
    g: &[f64],
    b: &[f64],
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let n = x.len() / (c * s);
    let m = (n * s) as f64;
    let at = |i: usize, ch: usize, j: usize| x[(i * c + ch) * s + j];
    let (mut mean, mut inv, mut var, mut unbiased) = (vec![], vec![], vec![], vec![]);
    for ch in 0..c {
        let vals: Vec<f64> =
            (0..n).flat_map(|i| (0..s).map(move |j| (i, j))).map(|(i, j)| at(i, ch, j)).collect();
        let mu = vals.iter().sum::<f64>() / m;
        let sq = vals.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>();
        mean.push(mu);
        var.push(sq / m);
        unbiased.push(sq / (m - 1.0));
        inv.push(1.0 / (sq / m + f64::from(EPS)).sqrt());
    }
    let y = (0..x.len())
        .map(|k| {
            let ch = (k / s) % c;
            (x[k] - mean[ch]) * inv[ch] * g[ch] + b[ch]
        })
        .collect();
    (y, mean, inv, var, unbiased)
}

fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * w.abs().max(1.0),
            "{what}[{i}]: got {g}, want {w} (tol {tol})"
        );
    }
}

/// Training forward, two steps of running statistics, evaluation forward: every dtype, with
/// parameters in the input's dtype and in f32, on images and on `[n, c]`.
#[test]
fn forward_and_running_statistics_match_pytorchs_definition() {
    let dev = host();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
        for pdtype in [dtype, DType::F32] {
            let ptol = if pdtype == DType::F32 { 1e-5 } else { 1e-2 };
            for shape in [&[3usize, 4, 5, 7][..], &[9, 6], &[2, 3, 1, 1]] {
                let (c, s) = (shape[1], shape[2..].iter().product::<usize>());
                let len = shape.iter().product();
                let x = rounded(&values(len, 1, -3.0, 5.0), dtype);
                let g = rounded(&values(c, 2, 0.5, 1.5), pdtype);
                let b = rounded(&values(c, 3, -1.0, 1.0), pdtype);
                let (tx, tg, tb) = (
                    tensor(&dev, shape, &x, dtype),
                    tensor(&dev, &[c], &g, pdtype),
                    tensor(&dev, &[c], &b, pdtype),
                );
                let rm0 = rounded(&values(c, 4, -0.5, 0.5), pdtype);
                let rv0 = rounded(&values(c, 5, 0.5, 2.0), pdtype);
                let (mut rm, mut rv) =
                    (tensor(&dev, &[c], &rm0, pdtype), tensor(&dev, &[c], &rv0, pdtype));
                let (want_y, want_mean, want_inv, _, unbiased) = reference(&x, c, s, &g, &b);
                let mut want_rm: Vec<f64> = rm0.clone();
                let mut want_rv: Vec<f64> = rv0.clone();
                for _ in 0..2 {
                    let run = RunningStats { mean: &mut rm, var: &mut rv, momentum: 0.1 };
                    let out = ops::batch_norm(&tx, &tg, &tb, Some(run), EPS).unwrap();
                    assert_eq!((out.y.shape(), out.y.dtype()), (shape, dtype));
                    assert_eq!((out.mean.dtype(), out.invstd.dtype()), (DType::F32, DType::F32));
                    assert_close("y", &f64s(&out.y), &want_y, tol);
                    assert_close("mean", &f64s(&out.mean), &want_mean, 1e-5);
                    assert_close("invstd", &f64s(&out.invstd), &want_inv, 1e-4);
                    for ch in 0..c {
                        want_rm[ch] = 0.1 * want_mean[ch] + 0.9 * want_rm[ch];
                        want_rv[ch] = 0.1 * unbiased[ch] + 0.9 * want_rv[ch];
                    }
                    assert_close("running_mean", &f64s(&rm), &want_rm, ptol);
                    assert_close("running_var", &f64s(&rv), &want_rv, ptol);
                    assert_eq!(rm.dtype(), pdtype);
                }
                // Without running statistics the output is the same.
                let out = ops::batch_norm(&tx, &tg, &tb, None, EPS).unwrap();
                assert_close("y without running", &f64s(&out.y), &want_y, tol);
                // Evaluation normalizes with the running statistics.
                let (em, ev) = (f64s(&rm), f64s(&rv));
                let want_eval: Vec<f64> = (0..len)
                    .map(|k| {
                        let ch = (k / s) % c;
                        (x[k] - em[ch]) / (ev[ch] + f64::from(EPS)).sqrt() * g[ch] + b[ch]
                    })
                    .collect();
                let y = ops::batch_norm_eval(&tx, &tg, &tb, &rm, &rv, EPS).unwrap();
                assert_close("eval y", &f64s(&y), &want_eval, tol);
            }
        }
    }
}

/// The backward (dx, dgamma, dbeta) against central differences of the f64 reference of
/// `L = sum(y * w)`, for a random `w`.
#[test]
fn backward_matches_central_differences_of_the_reference() {
    let dev = host();
    for shape in [&[3usize, 4, 3, 2][..], &[7, 3]] {
        let (c, s) = (shape[1], shape[2..].iter().product::<usize>());
        let len: usize = shape.iter().product();
        let x = rounded(&values(len, 7, -2.0, 3.0), DType::F32);
        let g = rounded(&values(c, 8, 0.5, 1.5), DType::F32);
        let b = rounded(&values(c, 9, -1.0, 1.0), DType::F32);
        let w = rounded(&values(len, 10, -1.0, 1.0), DType::F32);
        let loss = |x: &[f64], g: &[f64], b: &[f64]| -> f64 {
            reference(x, c, s, g, b).0.iter().zip(&w).map(|(y, w)| y * w).sum()
        };
        let h = 1e-6;
        let fd = |v: &[f64], f: &dyn Fn(&[f64]) -> f64| -> Vec<f64> {
            (0..v.len())
                .map(|i| {
                    let (mut p, mut m) = (v.to_vec(), v.to_vec());
                    p[i] += h;
                    m[i] -= h;
                    (f(&p) - f(&m)) / (2.0 * h)
                })
                .collect()
        };
        let want_dx = fd(&x, &|v| loss(v, &g, &b));
        let want_dg = fd(&g, &|v| loss(&x, v, &b));
        let want_db = fd(&b, &|v| loss(&x, &g, v));
        let (tx, tg, tb) = (
            tensor(&dev, shape, &x, DType::F32),
            tensor(&dev, &[c], &g, DType::F32),
            tensor(&dev, &[c], &b, DType::F32),
        );
        let out = ops::batch_norm(&tx, &tg, &tb, None, EPS).unwrap();
        let dy = tensor(&dev, shape, &w, DType::F32);
        let grads = ops::batch_norm_backward(&tx, &tg, &out.mean, &out.invstd, &dy, EPS).unwrap();
        assert_close("dx", &f64s(&grads.dx), &want_dx, 1e-4);
        assert_close("dgamma", &f64s(&grads.dgamma), &want_dg, 1e-4);
        assert_close("dbeta", &f64s(&grads.dbeta), &want_db, 1e-4);
        // The gradient of a normalized channel sums to zero over the channel.
        let dx = f64s(&grads.dx);
        for ch in 0..c {
            let sum: f64 = (0..len).filter(|k| (k / s) % c == ch).map(|k| dx[k]).sum();
            assert!(sum.abs() < 1e-4, "channel {ch}: dx sums to {sum}");
        }
    }
}

/// Bad input is an error naming what is wrong; a refused or failed call changes nothing.
#[test]
fn bad_input_is_refused_and_leaves_the_running_statistics_alone() {
    let dev = host();
    let x = Tensor::from_f32_slice(
        &dev,
        &[2, 3, 2],
        &[1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12.],
        DType::F32,
    )
    .unwrap();
    let p = |v: f32, dtype| Tensor::from_f32_slice(&dev, &[3], &[v; 3], dtype).unwrap();
    let (g, b) = (p(1.0, DType::F32), p(0.0, DType::F32));
    let (mut rm, mut rv) = (p(0.0, DType::F32), p(1.0, DType::F32));
    let err = |r: vram_kernels::Result<ops::BatchNormOutput>| r.unwrap_err().to_string();

    // One value per channel cannot be normalized in training (PyTorch refuses it too);
    // evaluation takes it.
    let one = Tensor::from_f32_slice(&dev, &[1, 3], &[1., 2., 3.], DType::F32).unwrap();
    let run = RunningStats { mean: &mut rm, var: &mut rv, momentum: 0.1 };
    let e = err(ops::batch_norm(&one, &g, &b, Some(run), EPS));
    assert!(e.contains("more than 1 value per channel"), "{e}");
    assert!(ops::batch_norm_eval(&one, &g, &b, &rm, &rv, EPS).is_ok());

    let flat = Tensor::from_f32_slice(&dev, &[3], &[1., 2., 3.], DType::F32).unwrap();
    assert!(err(ops::batch_norm(&flat, &g, &b, None, EPS)).contains("[batch, channels"));
    let e = err(ops::batch_norm(&x, &p(1.0, DType::F16), &p(0.0, DType::F16), None, EPS));
    assert!(e.contains("must be f32 or"), "{e}");
    let wrong = Tensor::from_f32_slice(&dev, &[2], &[1.0; 2], DType::F32).unwrap();
    assert!(ops::batch_norm(&x, &wrong, &b, None, EPS).is_err());
    assert!(err(ops::batch_norm(&x, &g, &b, None, f32::NAN)).contains("eps"));
    let run = RunningStats { mean: &mut rm, var: &mut rv, momentum: 1.5 };
    assert!(err(ops::batch_norm(&x, &g, &b, Some(run), EPS)).contains("momentum"));
    let mut half = p(1.0, DType::BF16);
    let run = RunningStats { mean: &mut rm, var: &mut half, momentum: 0.1 };
    assert!(ops::batch_norm(&x, &g, &b, Some(run), EPS).is_err(), "running stats of two dtypes");
    assert_eq!((rm.to_f32_vec().unwrap(), rv.to_f32_vec().unwrap()), (vec![0.0; 3], vec![1.0; 3]));

    // Out of memory: the output does not fit; nothing moved.
    let small = Device::host(30 << 20);
    let pp = |v: f32| Tensor::from_f32_slice(&small, &[3], &[v; 3], DType::F32).unwrap();
    let (g, b, mut rm, mut rv) = (pp(1.0), pp(0.0), pp(0.0), pp(1.0));
    let x = Tensor::zeros(&small, &[2, 3, 1_000_000], DType::F32).unwrap();
    let run = RunningStats { mean: &mut rm, var: &mut rv, momentum: 0.1 };
    let e = ops::batch_norm(&x, &g, &b, Some(run), EPS).unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    assert_eq!((rm.to_f32_vec().unwrap(), rv.to_f32_vec().unwrap()), (vec![0.0; 3], vec![1.0; 3]));
}

/// The host, the virtual device and (through the dispatch) the GPU allocate the same
/// buffers: a training forward and a backward leave the same statistics on host and virtual.
#[test]
fn host_and_virtual_device_allocate_alike() {
    let run = |dev: &Device| {
        let x = Tensor::zeros(dev, &[4, 8, 6, 6], DType::BF16).unwrap();
        let g = Tensor::zeros(dev, &[8], DType::F32).unwrap();
        let (mut rm, mut rv) = (g.clone(), g.clone());
        let b = g.clone();
        dev.reset_peak_stats();
        let out = ops::batch_norm(
            &x,
            &g,
            &b,
            Some(RunningStats { mean: &mut rm, var: &mut rv, momentum: 0.1 }),
            EPS,
        )
        .unwrap();
        let grads = ops::batch_norm_backward(&x, &g, &out.mean, &out.invstd, &out.y, EPS).unwrap();
        assert_eq!(grads.dgamma.dtype(), DType::F32);
        (dev.memory_allocated(), dev.max_memory_allocated())
    };
    let (h, v) = (host(), Device::virtual_device(1 << 30));
    v.set_blas_workspace_size(h.blas_workspace_size());
    assert_eq!(run(&h), run(&v));
}
