//! MobileNetV3's ops: hard swish and hard sigmoid (PyTorch's definitions, including the
//! derivative's value at the kinks) and the per-channel scale of squeeze-excitation, against
//! references written here and central differences.

use vram_kernels::ops;
use vram_kernels::{DType, Device, Tensor};

fn host() -> Device {
    Device::host(1 << 28)
}

fn t(dev: &Device, shape: &[usize], v: &[f32]) -> Tensor {
    Tensor::from_f32_slice(dev, shape, v, DType::F32).unwrap()
}

#[test]
fn hard_swish_and_hard_sigmoid_follow_pytorch() {
    let dev = host();
    let xs = [-5.0f32, -3.0, -2.5, -1.0, 0.0, 0.5, 2.9, 3.0, 4.0];
    let x = t(&dev, &[xs.len()], &xs);
    let dy = t(&dev, &[xs.len()], &[2.0; 9]);
    let relu6 = |v: f32| (v + 3.0).clamp(0.0, 6.0);
    let hs = ops::hardswish(&x).unwrap().to_f32_vec().unwrap();
    let hg = ops::hardsigmoid(&x).unwrap().to_f32_vec().unwrap();
    for (i, &v) in xs.iter().enumerate() {
        assert_eq!(hs[i], v * relu6(v) / 6.0, "hardswish({v})");
        assert_eq!(hg[i], relu6(v) / 6.0, "hardsigmoid({v})");
    }
    // PyTorch's CUDA kernels: hardswish' is 0 at -3 and 1 at 3 (x/3 + 1/2 strictly between),
    // hardsigmoid' is 1/6 strictly between -3 and 3.
    let dhs = ops::hardswish_backward(&x, &dy).unwrap().to_f32_vec().unwrap();
    let dhg = ops::hardsigmoid_backward(&x, &dy).unwrap().to_f32_vec().unwrap();
    let want_hs = [0.0, 0.0, 2.0 * (-2.5 / 3.0 + 0.5), 2.0 * (-1.0 / 3.0 + 0.5), 1.0];
    for (i, w) in want_hs.iter().enumerate() {
        assert!((dhs[i] - w).abs() < 1e-6, "hardswish'({}) = {}", xs[i], dhs[i]);
    }
    assert_eq!(&dhs[7..], &[2.0, 2.0]);
    let want_hg = [0.0, 0.0, 2.0 / 6.0, 2.0 / 6.0, 2.0 / 6.0, 2.0 / 6.0, 2.0 / 6.0, 0.0, 0.0];
    assert_eq!(dhg, want_hg);
    // Away from the kinks the derivative is the central difference of the forward.
    for v in [-2.0f32, -0.7, 0.3, 1.7, 2.5] {
        let h = 1e-2f32;
        let f = |u: f32| u * relu6(u) / 6.0;
        let fd = (f(v + h) - f(v - h)) / (2.0 * h);
        let one = t(&dev, &[1], &[v]);
        let g = ops::hardswish_backward(&one, &t(&dev, &[1], &[1.0])).unwrap();
        assert!((g.to_f32_vec().unwrap()[0] - fd).abs() < 1e-3, "hardswish'({v})");
    }
}

#[test]
fn scale_channels_broadcasts_over_planes_and_its_backward_sums_them() {
    let dev = host();
    let (n, c, hw) = (2, 3, 4);
    let xs: Vec<f32> = (0..n * c * hw).map(|i| (i as f32 * 0.37).sin()).collect();
    let ss: Vec<f32> = (0..n * c).map(|i| 0.5 + i as f32 * 0.1).collect();
    let dys: Vec<f32> = (0..n * c * hw).map(|i| (i as f32 * 0.11).cos()).collect();
    let (x, s, dy) =
        (t(&dev, &[n, c, 2, 2], &xs), t(&dev, &[n, c], &ss), t(&dev, &[n, c, 2, 2], &dys));
    let y = ops::scale_channels(&x, &s).unwrap();
    assert_eq!(y.shape(), x.shape());
    let y = y.to_f32_vec().unwrap();
    let g = ops::scale_channels_backward(&x, &s, &dy).unwrap();
    let (dx, ds) = (g.dx.to_f32_vec().unwrap(), g.ds.to_f32_vec().unwrap());
    assert_eq!(g.ds.shape(), &[n, c]);
    for p in 0..n * c {
        let mut want_ds = 0.0f32;
        for j in 0..hw {
            let i = p * hw + j;
            assert_eq!(y[i], xs[i] * ss[p]);
            assert_eq!(dx[i], dys[i] * ss[p]);
            want_ds += dys[i] * xs[i];
        }
        assert!((ds[p] - want_ds).abs() < 1e-5, "ds[{p}] {} vs {want_ds}", ds[p]);
    }
    // Bad shapes and dtypes are errors.
    assert!(ops::scale_channels(&x, &t(&dev, &[n, c + 1], &[1.0; 8])).is_err());
    let half = Tensor::from_f32_slice(&dev, &[n, c], &ss, DType::BF16).unwrap();
    assert!(ops::scale_channels(&x, &half).is_err());
    assert!(ops::scale_channels_backward(&x, &s, &s).is_err());
}
