//! The channels_last (NHWC) max pool, global average pool and squeeze-excitation scale on
//! CUDA against the host, beside `cuda_vs_host.rs`: bit for bit, since the kernels compare
//! and add as the host does, in its order (f32 sums, f64 for the scale's gradient, one
//! rounding; NVRTC compiles without contraction and divides correctly rounded), as the
//! emulation shows without a GPU. Odd shapes, padding, overlapping windows, one channel,
//! 1x1 planes, NaN, one chunk of positions and several, and the real layers' sizes. Each test
//! prints `skipped: no CUDA device (...)` and passes where no GPU can be opened (these have
//! not yet run on a GPU).

use std::io::Write as _;
use vram_kernels::ops;
use vram_kernels::{DType, Device, Pool2dOptions, Tensor};

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

fn gpu() -> Option<Device> {
    match Device::cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "skipped: no CUDA device ({e})");
            None
        }
    }
}

fn host() -> Device {
    static HOST: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
    HOST.get_or_init(|| Device::host(4 << 30)).clone()
}

/// Deterministic values in [-4, 4) (xorshift), on a grid of 1/16 when `ties` (equal values
/// inside windows).
fn values(n: usize, seed: u64, ties: bool) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let v = 8.0 * ((s >> 40) as f32 / (1u64 << 24) as f32) - 4.0;
            if ties { (v * 16.0).round() / 16.0 } else { v }
        })
        .collect()
}

/// The same tensor on the host and on the GPU.
fn pair(gpu: &Device, shape: &[usize], dtype: DType, seed: u64, ties: bool) -> (Tensor, Tensor) {
    let mut v = values(shape.iter().product(), seed, ties);
    if ties && v.len() > 7 {
        v[7] = f32::NAN;
    }
    let h = Tensor::from_f32_slice(&host(), shape, &v, dtype).unwrap();
    let g = h.to_device(gpu).unwrap();
    (h, g)
}

fn same(what: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    let bits =
        |t: &Tensor| -> Vec<u32> { t.to_f32_vec().unwrap().iter().map(|v| v.to_bits()).collect() };
    let (g, w) = (bits(got), bits(want));
    if let Some(i) = g.iter().zip(&w).position(|(g, w)| g != w) {
        panic!("{what}[{i}]: GPU {}, host {}", f32::from_bits(g[i]), f32::from_bits(w[i]));
    }
}

#[test]
fn channels_last_max_pool_matches_host_bit_for_bit() {
    let Some(gpu) = gpu() else { return };
    let pad = |k, s, p| Pool2dOptions::new(k, s).padding(p);
    let cases = [
        ([2, 11, 10, 3], pad((3, 3), (2, 2), (1, 1))),
        ([1, 6, 6, 1], Pool2dOptions::new((2, 2), (2, 2))),
        ([2, 7, 5, 67], pad((3, 2), (1, 1), (1, 0))),
        ([3, 1, 1, 4], Pool2dOptions::new((1, 1), (1, 1))),
        ([8, 112, 112, 64], pad((3, 3), (2, 2), (1, 1))), // ResNet-50's stem, 8 images
    ];
    for dtype in DTYPES {
        for (i, (shape, opts)) in cases.iter().enumerate() {
            let what = format!("max_pool2d_nhwc {dtype:?} {shape:?}");
            let (hx, gx) = pair(&gpu, shape, dtype, i as u64, true);
            let (hy, ha) = ops::max_pool2d_nhwc(&hx, opts).unwrap();
            let (gy, ga) = ops::max_pool2d_nhwc(&gx, opts).unwrap();
            same(&what, &gy, &hy);
            assert_eq!(ga.to_vec().unwrap(), ha.as_slice().unwrap(), "{what} indices");
            let (hdy, gdy) = pair(&gpu, hy.shape(), dtype, 10 + i as u64, false);
            same(
                &format!("{what} backward"),
                &ops::max_pool2d_backward_nhwc(&gdy, &ga, shape, opts).unwrap(),
                &ops::max_pool2d_backward_nhwc(&hdy, &ha, shape, opts).unwrap(),
            );
        }
    }
}

#[test]
fn channels_last_global_pool_and_scale_match_host_bit_for_bit() {
    let Some(gpu) = gpu() else { return };
    // 7x7 (one chunk of positions), 9x10 and 28x28 (several), 1x1, one channel, and the
    // ResNet-50 head and a MobileNetV3 squeeze-excitation at 16 images.
    let shapes = [
        [2, 7, 7, 5],
        [2, 9, 10, 3],
        [3, 1, 1, 4],
        [2, 8, 9, 1],
        [64, 7, 7, 2048],
        [16, 28, 28, 120],
    ];
    for dtype in DTYPES {
        for (i, shape) in shapes.iter().enumerate() {
            let what = format!("{dtype:?} {shape:?}");
            let seed = 100 * i as u64;
            let gc = [shape[0], shape[3]];
            let (hx, gx) = pair(&gpu, shape, dtype, seed, false);
            same(
                &format!("global_avg_pool_nhwc {what}"),
                &ops::global_avg_pool_nhwc(&gx).unwrap(),
                &ops::global_avg_pool_nhwc(&hx).unwrap(),
            );
            let (hg, gg) = pair(&gpu, &gc, dtype, seed + 1, false);
            same(
                &format!("global_avg_pool_backward_nhwc {what}"),
                &ops::global_avg_pool_backward_nhwc(&gg, shape).unwrap(),
                &ops::global_avg_pool_backward_nhwc(&hg, shape).unwrap(),
            );
            let (mut hacc, mut gacc) = (hx.clone(), gx.clone());
            ops::global_avg_pool_backward_add_nhwc(&mut hacc, &hg).unwrap();
            ops::global_avg_pool_backward_add_nhwc(&mut gacc, &gg).unwrap();
            same(&format!("global_avg_pool_backward_add_nhwc {what}"), &gacc, &hacc);
            same(&format!("{what}: the shared input is not written"), &gx, &hx);

            let (hs, gs) = pair(&gpu, &gc, dtype, seed + 2, false);
            same(
                &format!("scale_channels_nhwc {what}"),
                &ops::scale_channels_nhwc(&gx, &gs).unwrap(),
                &ops::scale_channels_nhwc(&hx, &hs).unwrap(),
            );
            let (hdy, gdy) = pair(&gpu, shape, dtype, seed + 3, false);
            let hgr = ops::scale_channels_backward_nhwc(&hx, &hs, &hdy).unwrap();
            let ggr = ops::scale_channels_backward_nhwc(&gx, &gs, &gdy).unwrap();
            same(&format!("scale_channels_backward_nhwc dx {what}"), &ggr.dx, &hgr.dx);
            same(&format!("scale_channels_backward_nhwc ds {what}"), &ggr.ds, &hgr.ds);
        }
    }
}
