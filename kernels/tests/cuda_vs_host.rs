//! Every op on CUDA against the host reference, on random inputs: f32 within 1e-5 relative
//! (1e-4 for the cuBLAS products: matmul, linear, conv), f16 and bf16 within 1e-2, dropout
//! masks identical. Results of long sums (products, convolutions, gradients of weights and
//! biases, reductions) are compared relative to the largest value of the tensor
//! ([`close_sum`]): the two backends add in different orders. Sums of plain terms that both
//! backends add in the same order (bias gradients, embedding rows, max-pool gradients) are
//! equal, and every gradient repeats bit for bit ([`gradients_repeat_bit_for_bit`]). Each
//! test prints `skipped: no CUDA device (...)` and passes where no GPU can be opened.

use std::io::Write as _;
use vram_kernels::ops;
use vram_kernels::{
    AdamWConfig, Conv2dOptions, ConvBackend, DType, Device, Indices, Pool2dOptions, SgdConfig,
    Tensor,
};

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// The CUDA device, or `None` after printing the skip line (straight to stderr, so that it
/// shows through the test harness's output capture).
fn gpu() -> Option<Device> {
    match Device::cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "skipped: no CUDA device ({e})");
            None
        }
    }
}

/// The host device of this test binary: one, shared by every test, so that the host
/// tensors of one comparison are on one device.
fn host() -> Device {
    static HOST: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
    HOST.get_or_init(|| Device::host(4 << 30)).clone()
}

/// Elementwise tolerance for `dtype`; `gemm` for cuBLAS products.
fn tol(dtype: DType, gemm: bool) -> f64 {
    match dtype {
        DType::F32 if gemm => 1e-4,
        DType::F32 => 1e-5,
        _ => 1e-2,
    }
}

/// Deterministic pseudo-random values in `[lo, hi)` (xorshift).
fn values(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            lo + (hi - lo) * ((s >> 40) as f32 / (1u64 << 24) as f32)
        })
        .collect()
}

/// The same random tensor on the host and on the GPU.
fn pair(gpu: &Device, shape: &[usize], dtype: DType, seed: u64) -> (Tensor, Tensor) {
    let n = shape.iter().product();
    let h = Tensor::from_f32_slice(&host(), shape, &values(n, seed, -4.0, 4.0), dtype).unwrap();
    let g = h.to_device(gpu).unwrap();
    (h, g)
}

/// `got` (from the GPU) against `want` (host): same shape and dtype,
/// `|g - w| <= tol * max(|w|, 1)` everywhere; NaN passes only against NaN.
fn close(what: &str, got: &Tensor, want: &Tensor, tol: f64) {
    compare(what, got, want, tol, false);
}

/// As [`close`] for the results of long sums (products, convolutions, weight and bias
/// gradients, reductions): `|g - w| <= tol * max(max_j |w_j|, 1)`. A sum's rounding error
/// follows the size of its terms, not of its result, and the GPU adds in another order than
/// the host: a result that cancels to near zero differs by more than `tol` of itself.
fn close_sum(what: &str, got: &Tensor, want: &Tensor, tol: f64) {
    compare(what, got, want, tol, true);
}

fn compare(what: &str, got: &Tensor, want: &Tensor, tol: f64, normwise: bool) {
    assert!(got.device().is_cuda() && !want.device().is_cuda(), "{what}: devices");
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    let (g, w) = (got.to_f32_vec().unwrap(), want.to_f32_vec().unwrap());
    let largest =
        if normwise { w.iter().fold(1.0f64, |m, &v| m.max(f64::from(v).abs())) } else { 1.0 };
    for (i, (&g, &w)) in g.iter().zip(&w).enumerate() {
        let (g, w) = (f64::from(g), f64::from(w));
        let ok = if w.is_nan() { g.is_nan() } else { (g - w).abs() <= tol * w.abs().max(largest) };
        assert!(
            ok,
            "{what} ({}): index {i}: cuda {g}, host {w}, tol {tol} (scale {largest})",
            got.dtype()
        );
    }
}

/// `|g - w| <= tol * max(|w|, scale, 1)`: `scale` is the sum of the absolute terms for a
/// whole-tensor sum (whose rounding follows them), 0 otherwise.
fn close_scalar(what: &str, got: f32, want: f32, tol: f64, scale: f64) {
    let (g, w) = (f64::from(got), f64::from(want));
    let bound = tol * w.abs().max(scale).max(1.0);
    assert!((g - w).abs() <= bound, "{what}: cuda {g}, host {w}, bound {bound}");
}

#[test]
fn device_copies_round_trip_and_memory_is_counted() {
    let Some(gpu) = gpu() else { return };
    for dtype in DTYPES {
        let (h, g) = pair(&gpu, &[3, 5, 7], dtype, 1);
        assert!(gpu.memory_allocated() >= g.size_in_bytes() as u64);
        assert!(g.as_slice::<f32>().is_err(), "host access to device memory must fail");
        let back = g.to_device(&h.device().clone()).unwrap();
        assert_eq!(back.to_f32_vec().unwrap(), h.to_f32_vec().unwrap());
        close("try_clone", &g.try_clone().unwrap(), &h, 0.0);
        for to in DTYPES {
            close("to_dtype", &g.to_dtype(to).unwrap(), &h.to_dtype(to).unwrap(), 0.0);
        }
        let z = Tensor::full(&gpu, &[1000], dtype, 1.5).unwrap();
        assert!(z.to_f32_vec().unwrap().iter().all(|&v| v == 1.5));
    }
    let live = gpu.memory_allocated();
    gpu.empty_cache();
    assert_eq!(gpu.memory_allocated(), live);
    gpu.synchronize().unwrap();
}

#[test]
fn elementwise_and_activations_match_host() {
    let Some(gpu) = gpu() else { return };
    for dtype in DTYPES {
        let t = tol(dtype, false);
        let shape = [37, 129];
        let (ha, ga) = pair(&gpu, &shape, dtype, 2);
        let (hb, gb) = pair(&gpu, &shape, dtype, 3);
        close("add", &ops::add(&ga, &gb).unwrap(), &ops::add(&ha, &hb).unwrap(), t);
        close("mul", &ops::mul(&ga, &gb).unwrap(), &ops::mul(&ha, &hb).unwrap(), t);
        close("scale", &ops::scale(&ga, -0.37).unwrap(), &ops::scale(&ha, -0.37).unwrap(), t);
        close("relu", &ops::relu(&ga).unwrap(), &ops::relu(&ha).unwrap(), t);
        close("gelu", &ops::gelu(&ga).unwrap(), &ops::gelu(&ha).unwrap(), t);
        let (hr, gr) =
            (ops::relu_backward(&ha, &hb).unwrap(), ops::relu_backward(&ga, &gb).unwrap());
        close("relu_backward", &gr, &hr, t);
        let (hg, gg) =
            (ops::gelu_backward(&ha, &hb).unwrap(), ops::gelu_backward(&ga, &gb).unwrap());
        close("gelu_backward", &gg, &hg, t);
        for (name, f, b) in [
            (
                "hardswish",
                ops::hardswish as fn(&Tensor) -> _,
                ops::hardswish_backward as fn(&Tensor, &Tensor) -> _,
            ),
            ("hardsigmoid", ops::hardsigmoid, ops::hardsigmoid_backward),
        ] {
            close(name, &f(&ga).unwrap(), &f(&ha).unwrap(), t);
            close(name, &b(&ga, &gb).unwrap(), &b(&ha, &hb).unwrap(), t);
        }
        // Squeeze-excitation's per-channel scale over [n, c, h, w] planes.
        let planes = [6, 5, 7, 9];
        let (hx, gx) = pair(&gpu, &planes, dtype, 32);
        let (hdy, gdy) = pair(&gpu, &planes, dtype, 33);
        let (hs, gs) = pair(&gpu, &planes[..2], dtype, 31);
        close(
            "scale_channels",
            &ops::scale_channels(&gx, &gs).unwrap(),
            &ops::scale_channels(&hx, &hs).unwrap(),
            t,
        );
        let (hg, gg) = (
            ops::scale_channels_backward(&hx, &hs, &hdy).unwrap(),
            ops::scale_channels_backward(&gx, &gs, &gdy).unwrap(),
        );
        close("scale_channels dx", &gg.dx, &hg.dx, t);
        close_sum("scale_channels ds", &gg.ds, &hg.ds, t.max(1e-4));
        let (hbias, gbias) = pair(&gpu, &[129], dtype, 4);
        close(
            "bias_add",
            &ops::bias_add(&ga, &gbias).unwrap(),
            &ops::bias_add(&ha, &hbias).unwrap(),
            t,
        );
        close_sum(
            "bias_add_backward",
            &ops::bias_add_backward(&ga).unwrap(),
            &ops::bias_add_backward(&ha).unwrap(),
            t,
        );
        for acc_dtype in DTYPES {
            let (mut hacc, mut gacc) = pair(&gpu, &shape, acc_dtype, 5);
            ops::add_assign(&mut hacc, &ha).unwrap();
            ops::add_assign(&mut gacc, &ga).unwrap();
            close("add_assign", &gacc, &hacc, tol(acc_dtype, false));
            ops::axpy(-1.5, &ga, &mut gacc).unwrap();
            ops::axpy(-1.5, &ha, &mut hacc).unwrap();
            close("axpy", &gacc, &hacc, tol(acc_dtype, false));
        }
    }
}

/// The plain maps move 16-byte packs per thread with a scalar tail, grid-stride over packs
/// once a tensor has more packs than the grid has threads (2^24). Every element, at sizes
/// below one pack, with a tail, and past one grid's worth of packs for each element size,
/// must come out: integer values in [-128, 128), exact in all three dtypes.
#[test]
fn elementwise_maps_reach_every_element_at_odd_and_grid_exceeding_sizes() {
    let Some(gpu) = gpu() else { return };
    for dtype in DTYPES {
        let per_pack = 16 / dtype.size_in_bytes();
        for n in [1, per_pack - 1, 4773, (per_pack << 24) + per_pack * 3 + 5] {
            let ints: Vec<f32> = (0..n).map(|i| (i % 256) as f32 - 128.0).collect();
            let a = Tensor::from_f32_slice(&gpu, &[n], &ints, dtype).unwrap();
            let one = Tensor::full(&gpu, &[n], dtype, 1.0).unwrap();
            let check = |what: &str, t: &Tensor, f: &dyn Fn(f32) -> f32| {
                let got = t.to_f32_vec().unwrap();
                assert_eq!(got.len(), n, "{what} ({dtype}, n = {n}): length");
                if let Some(i) = (0..n).find(|&i| got[i] != f(ints[i])) {
                    panic!("{what} ({dtype}, n = {n}): index {i}: {} != {}", got[i], f(ints[i]));
                }
            };
            check("add", &ops::add(&a, &one).unwrap(), &|v| v + 1.0);
            check("scale", &ops::scale(&a, 0.5).unwrap(), &|v| v * 0.5);
            check("relu", &ops::relu(&a).unwrap(), &|v| v.max(0.0));
            check("cast", &a.to_dtype(DType::F32).unwrap(), &|v| v);
            let mut acc = Tensor::full(&gpu, &[n], DType::F32, 2.0).unwrap();
            ops::axpy(-1.0, &a, &mut acc).unwrap();
            check("axpy", &acc, &|v| 2.0 - v);
        }
    }
}

#[test]
fn reductions_match_host() {
    let Some(gpu) = gpu() else { return };
    for dtype in DTYPES {
        let t = tol(dtype, false);
        let (h, g) = pair(&gpu, &[41, 263], dtype, 6);
        let abs: f64 = h.to_f32_vec().unwrap().iter().map(|v| f64::from(v.abs())).sum();
        let n = h.numel() as f64;
        close_scalar("sum", ops::sum(&g).unwrap(), ops::sum(&h).unwrap(), 1e-6, abs);
        close_scalar("mean", ops::mean(&g).unwrap(), ops::mean(&h).unwrap(), 1e-6, abs / n);
        close_sum(
            "sum_last_dim",
            &ops::sum_last_dim(&g).unwrap(),
            &ops::sum_last_dim(&h).unwrap(),
            t,
        );
        close(
            "mean_last_dim",
            &ops::mean_last_dim(&g).unwrap(),
            &ops::mean_last_dim(&h).unwrap(),
            t,
        );
        let (hd, gd) = pair(&gpu, &[41], dtype, 7);
        close(
            "sum_last_dim_backward",
            &ops::sum_last_dim_backward(&gd, 263).unwrap(),
            &ops::sum_last_dim_backward(&hd, 263).unwrap(),
            t,
        );
        close(
            "mean_last_dim_backward",
            &ops::mean_last_dim_backward(&gd, 263).unwrap(),
            &ops::mean_last_dim_backward(&hd, 263).unwrap(),
            t,
        );
        close(
            "mean_backward",
            &ops::mean_backward(2.5, &gpu, &[7, 9], dtype).unwrap(),
            &ops::mean_backward(2.5, &host(), &[7, 9], dtype).unwrap(),
            t,
        );
    }
}

#[test]
fn softmax_cross_entropy_and_layer_norm_match_host() {
    let Some(gpu) = gpu() else { return };
    for dtype in DTYPES {
        let t = tol(dtype, false);
        let (hx, gx) = pair(&gpu, &[2, 3, 33, 33], dtype, 8);
        let (hdy, gdy) = pair(&gpu, &[2, 3, 33, 33], dtype, 9);
        for causal in [false, true] {
            let f = if causal { ops::causal_softmax } else { ops::softmax };
            let b = if causal { ops::causal_softmax_backward } else { ops::softmax_backward };
            let (hy, gy) = (f(&hx).unwrap(), f(&gx).unwrap());
            close("softmax", &gy, &hy, t);
            close("softmax_backward", &b(&gy, &gdy).unwrap(), &b(&hy, &hdy).unwrap(), t);
        }

        let (hl, gl) = pair(&gpu, &[67, 301], dtype, 10);
        let targets: Vec<u32> = (0..67).map(|i| (i * 37 % 301) as u32).collect();
        for ignore in [None, Some(targets[3])] {
            let (hc, gc) = (
                ops::cross_entropy(&hl, &targets, ignore).unwrap(),
                ops::cross_entropy(&gl, &targets, ignore).unwrap(),
            );
            close_scalar("cross_entropy", gc.loss, hc.loss, 1e-5, 0.0);
            close("cross_entropy lse", &gc.lse, &hc.lse, 1e-5);
            let hd = ops::cross_entropy_backward(&hl, &targets, ignore, &hc.lse, 2.0).unwrap();
            let gd = ops::cross_entropy_backward(&gl, &targets, ignore, &gc.lse, 2.0).unwrap();
            close("cross_entropy_backward", &gd, &hd, t);
        }
        assert!(ops::cross_entropy(&gl, &[301; 67], None).is_err());

        let (hx, gx) = pair(&gpu, &[5, 13, 257], dtype, 11);
        let (hg, gg) = pair(&gpu, &[257], dtype, 12);
        let (hb, gb) = pair(&gpu, &[257], dtype, 13);
        let (hn, gn) = (
            ops::layer_norm(&hx, &hg, &hb, 1e-5).unwrap(),
            ops::layer_norm(&gx, &gg, &gb, 1e-5).unwrap(),
        );
        close("layer_norm", &gn.y, &hn.y, t);
        close("layer_norm mean", &gn.mean, &hn.mean, 1e-5);
        close("layer_norm rstd", &gn.rstd, &hn.rstd, 1e-5);
        let (hdy, gdy) = pair(&gpu, &[5, 13, 257], dtype, 14);
        let hgr = ops::layer_norm_backward(&hx, &hg, &hn.mean, &hn.rstd, &hdy).unwrap();
        let ggr = ops::layer_norm_backward(&gx, &gg, &gn.mean, &gn.rstd, &gdy).unwrap();
        close("layer_norm dx", &ggr.dx, &hgr.dx, t);
        close_sum("layer_norm dgamma", &ggr.dgamma, &hgr.dgamma, t);
        close_sum("layer_norm dbeta", &ggr.dbeta, &hgr.dbeta, t);
    }
}

#[test]
fn rms_norm_rotary_embeddings_and_silu_match_host() {
    let Some(gpu) = gpu() else { return };
    let (s, dh) = (9, 64);
    let scaling = ops::RopeScaling::Llama3 {
        factor: 32.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192.0,
    };
    let (cv, sv) = ops::rope_tables(s, dh, 500_000.0, scaling);
    let table = |v: &[f32]| Tensor::from_f32_slice(&host(), &[s, dh / 2], v, DType::F32).unwrap();
    let (hc, hs) = (table(&cv), table(&sv));
    let (gc, gs) = (hc.to_device(&gpu).unwrap(), hs.to_device(&gpu).unwrap());
    for dtype in DTYPES {
        let t = tol(dtype, false);
        let (hx, gx) = pair(&gpu, &[70, 300], dtype, 40);
        let (hw, gw) = pair(&gpu, &[300], dtype, 41);
        let (hdy, gdy) = pair(&gpu, &[70, 300], dtype, 42);
        let (hn, gn) =
            (ops::rms_norm(&hx, &hw, 1e-5).unwrap(), ops::rms_norm(&gx, &gw, 1e-5).unwrap());
        close("rms_norm", &gn.y, &hn.y, t);
        close("rms_norm rstd", &gn.rstd, &hn.rstd, 1e-5);
        let hg = ops::rms_norm_backward(&hx, &hw, &hn.rstd, &hdy).unwrap();
        let gg = ops::rms_norm_backward(&gx, &gw, &gn.rstd, &gdy).unwrap();
        close("rms_norm dx", &gg.dx, &hg.dx, t);
        close_sum("rms_norm dweight", &gg.dweight, &hg.dweight, t);

        let (hq, gq) = pair(&gpu, &[2, s, 3, dh], dtype, 43);
        let (hr, gr) = (ops::rope(&hq, &hc, &hs).unwrap(), ops::rope(&gq, &gc, &gs).unwrap());
        close("rope", &gr, &hr, t);
        let (hb, gb) = (
            ops::rope_backward(&hq, &hc, &hs).unwrap(),
            ops::rope_backward(&gq, &gc, &gs).unwrap(),
        );
        close("rope_backward", &gb, &hb, t);

        close("silu", &ops::silu(&gx).unwrap(), &ops::silu(&hx).unwrap(), t);
        let (hd, gd) =
            (ops::silu_backward(&hx, &hdy).unwrap(), ops::silu_backward(&gx, &gdy).unwrap());
        close("silu_backward", &gd, &hd, t);
    }
}

/// Batch norm in training (running statistics updated on both) and evaluation, and its
/// backward, for parameters in the input's dtype and in f32 (the autocast case), on images
/// and on `[n, c]`.
#[test]
fn batch_norm_matches_host() {
    let Some(gpu) = gpu() else { return };
    // vram's own kernels (cuDNN's path has its own test in cudnn_vs_host.rs).
    gpu.set_conv_backend(ConvBackend::Own).unwrap();
    for dtype in DTYPES {
        let t = tol(dtype, false);
        for pdtype in [dtype, DType::F32] {
            // One part per channel (the first two), then 4 even and 2 uneven parts of whole
            // images per channel (`batch_norm::parts`: at least 4096 values per part).
            for shape in [&[4usize, 6, 9, 11][..], &[37, 5], &[16, 4, 32, 32], &[7, 2, 30, 40]] {
                let c = shape[1];
                let (hx, gx) = pair(&gpu, shape, dtype, 20);
                let (hg, gg) = pair(&gpu, &[c], pdtype, 21);
                let (hb, gb) = pair(&gpu, &[c], pdtype, 22);
                let ones = vec![1.0; c];
                let (mut hm, mut gm) = pair(&gpu, &[c], pdtype, 23);
                let mut hv = Tensor::from_f32_slice(&host(), &[c], &ones, pdtype).unwrap();
                let mut gv = hv.to_device(&gpu).unwrap();
                let hr = ops::RunningStats { mean: &mut hm, var: &mut hv, momentum: 0.1 };
                let hn = ops::batch_norm(&hx, &hg, &hb, Some(hr), 1e-5).unwrap();
                let gr = ops::RunningStats { mean: &mut gm, var: &mut gv, momentum: 0.1 };
                let gn = ops::batch_norm(&gx, &gg, &gb, Some(gr), 1e-5).unwrap();
                close("batch_norm", &gn.y, &hn.y, t);
                close("batch_norm mean", &gn.mean, &hn.mean, 1e-5);
                close("batch_norm invstd", &gn.invstd, &hn.invstd, 1e-5);
                let pt = tol(pdtype, false);
                close("batch_norm running mean", &gm, &hm, pt);
                close("batch_norm running var", &gv, &hv, pt);
                let he = ops::batch_norm_eval(&hx, &hg, &hb, &hm, &hv, 1e-5).unwrap();
                let ge = ops::batch_norm_eval(&gx, &gg, &gb, &gm, &gv, 1e-5).unwrap();
                close("batch_norm_eval", &ge, &he, t);
                let (hdy, gdy) = pair(&gpu, shape, dtype, 24);
                let hgr =
                    ops::batch_norm_backward(&hx, &hg, &hn.mean, &hn.invstd, &hdy, 1e-5).unwrap();
                let ggr =
                    ops::batch_norm_backward(&gx, &gg, &gn.mean, &gn.invstd, &gdy, 1e-5).unwrap();
                close("batch_norm dx", &ggr.dx, &hgr.dx, t);
                close_sum("batch_norm dgamma", &ggr.dgamma, &hgr.dgamma, pt.max(1e-4));
                close_sum("batch_norm dbeta", &ggr.dbeta, &hgr.dbeta, pt.max(1e-4));
            }
        }
    }
}

#[test]
fn matmul_and_linear_match_host() {
    let Some(gpu) = gpu() else { return };
    for dtype in DTYPES {
        let t = tol(dtype, true);
        // (a shape, b shape, trans_a, trans_b): plain, transposed, batched, broadcast.
        let cases: [(&[usize], &[usize], bool, bool); 5] = [
            (&[65, 31], &[31, 47], false, false),
            (&[31, 65], &[47, 31], true, true),
            (&[3, 17, 9], &[3, 9, 21], false, false),
            (&[4, 17, 9], &[21, 9], false, true),
            (&[9, 17], &[4, 9, 21], true, false),
        ];
        for (i, &(sa, sb, ta, tb)) in cases.iter().enumerate() {
            let (ha, ga) = pair(&gpu, sa, dtype, 20 + i as u64);
            let (hb, gb) = pair(&gpu, sb, dtype, 30 + i as u64);
            let (hc, gc) =
                (ops::matmul(&ha, &hb, ta, tb).unwrap(), ops::matmul(&ga, &gb, ta, tb).unwrap());
            close_sum("matmul", &gc, &hc, t);
            let (hdc, gdc) = pair(&gpu, hc.shape(), dtype, 40 + i as u64);
            let (hda, hdb) = ops::matmul_backward(&ha, &hb, &hdc, ta, tb).unwrap();
            let (gda, gdb) = ops::matmul_backward(&ga, &gb, &gdc, ta, tb).unwrap();
            close_sum("matmul_backward da", &gda, &hda, t);
            close_sum("matmul_backward db", &gdb, &hdb, t);
        }
        let (hx, gx) = pair(&gpu, &[3, 11, 64], dtype, 50);
        let (hw, gw) = pair(&gpu, &[24, 64], dtype, 51);
        let (hb, gb) = pair(&gpu, &[24], dtype, 52);
        close_sum(
            "linear",
            &ops::linear(&gx, &gw, Some(&gb)).unwrap(),
            &ops::linear(&hx, &hw, Some(&hb)).unwrap(),
            t,
        );
        close_sum(
            "linear no bias",
            &ops::linear(&gx, &gw, None).unwrap(),
            &ops::linear(&hx, &hw, None).unwrap(),
            t,
        );
        let (hdy, gdy) = pair(&gpu, &[3, 11, 24], dtype, 53);
        let hg = ops::linear_backward(&hx, &hw, &hdy, true).unwrap();
        let gg = ops::linear_backward(&gx, &gw, &gdy, true).unwrap();
        close_sum("linear dx", &gg.dx, &hg.dx, t);
        close_sum("linear dw", &gg.dw, &hg.dw, t);
        close_sum(
            "linear dbias",
            gg.dbias.as_ref().unwrap(),
            hg.dbias.as_ref().unwrap(),
            tol(dtype, false),
        );
    }
}

/// vram's own convolution kernels (cuDNN's are `cudnn_vs_host.rs`'s).
#[test]
fn conv2d_dense_grouped_pointwise_and_depthwise_match_host() {
    let Some(gpu) = gpu() else { return };
    gpu.set_conv_backend(ConvBackend::Own).unwrap();
    // (x shape, weight shape, options)
    let cases = [
        ([2, 3, 13, 11], [8, 3, 3, 3], Conv2dOptions::default().padding((1, 1))),
        ([2, 4, 12, 12], [6, 2, 3, 3], Conv2dOptions::default().stride((2, 2)).groups(2)),
        ([3, 5, 9, 9], [4, 5, 3, 2], Conv2dOptions::default().dilation((2, 1)).padding((2, 0))),
        ([2, 8, 7, 7], [16, 8, 1, 1], Conv2dOptions::default()),
        ([2, 6, 10, 10], [6, 1, 3, 3], Conv2dOptions::default().padding((1, 1)).groups(6)),
        (
            [2, 6, 11, 11],
            [6, 1, 5, 5],
            Conv2dOptions::default().stride((2, 2)).padding((2, 2)).groups(6),
        ),
        (
            [2, 6, 11, 11],
            [4, 3, 5, 5],
            Conv2dOptions::default().stride((2, 2)).padding((2, 2)).groups(2),
        ),
        // Direct with planes of more positions than a block has threads (1600 and 360).
        ([2, 4, 40, 40], [4, 1, 3, 3], Conv2dOptions::default().padding((1, 1)).groups(4)),
        ([2, 3, 40, 36], [4, 3, 3, 3], Conv2dOptions::default().stride((2, 2)).padding((1, 1))),
        // Above DIRECT_MAX_MACS: im2col and cuBLAS, grouped and dilated too.
        ([4, 32, 40, 40], [64, 32, 3, 3], Conv2dOptions::default().padding((1, 1))),
        (
            [4, 64, 64, 64],
            [64, 16, 3, 3],
            Conv2dOptions::default().padding((1, 1)).dilation((2, 1)).groups(4),
        ),
        // im2col strided (col2im's taps divide), and rows wider than a block (600 > 256).
        ([4, 64, 48, 48], [64, 64, 3, 3], Conv2dOptions::default().stride((2, 2)).padding((1, 1))),
        ([1, 64, 6, 600], [64, 64, 3, 3], Conv2dOptions::default().padding((1, 1))),
    ];
    let direct = cases.iter().map(|(x, w, o)| ops::conv2d_params(x, w, o).unwrap().is_direct());
    assert_eq!(
        direct.collect::<Vec<_>>(),
        [true, true, true, false, true, true, true, true, true, false, false, false, false]
    );
    for dtype in DTYPES {
        let t = tol(dtype, true);
        for (i, (xs, ws, opts)) in cases.iter().enumerate() {
            let seed = 60 + 10 * i as u64;
            let (hx, gx) = pair(&gpu, xs, dtype, seed);
            let (hw, gw) = pair(&gpu, ws, dtype, seed + 1);
            let (hb, gb) = pair(&gpu, &[ws[0]], dtype, seed + 2);
            let hy = ops::conv2d(&hx, &hw, Some(&hb), opts).unwrap();
            let gy = ops::conv2d(&gx, &gw, Some(&gb), opts).unwrap();
            close_sum(&format!("conv2d case {i}"), &gy, &hy, t);
            let (hdy, gdy) = pair(&gpu, hy.shape(), dtype, seed + 3);
            let hg = ops::conv2d_backward(&hx, &hw, &hdy, opts, true).unwrap();
            let gg = ops::conv2d_backward(&gx, &gw, &gdy, opts, true).unwrap();
            close_sum(&format!("conv2d dx case {i}"), &gg.dx, &hg.dx, t);
            close_sum(&format!("conv2d dweight case {i}"), &gg.dweight, &hg.dweight, t);
            close_sum(
                &format!("conv2d dbias case {i}"),
                gg.dbias.as_ref().unwrap(),
                hg.dbias.as_ref().unwrap(),
                t,
            );
            // The parameters' gradients alone (no dx): the same as with it.
            let gw_only = ops::conv2d_backward_weight(&gx, &gw, &gdy, opts, true).unwrap();
            close_sum(&format!("conv2d dweight alone case {i}"), &gw_only.dweight, &hg.dweight, t);
            close_sum(
                &format!("conv2d dbias alone case {i}"),
                gw_only.dbias.as_ref().unwrap(),
                hg.dbias.as_ref().unwrap(),
                t,
            );
        }
    }
}

/// The images per chunk a convolution's forward and backward got on `d` (from their
/// buffers' requests of `forward` and `backward` bytes an image), and their outputs.
fn conv_in_chunks(
    d: &Device,
    (x, w, dy): (&Tensor, &Tensor, &Tensor),
    opts: &Conv2dOptions,
    (forward, backward): (usize, usize),
) -> vram_kernels::Result<(Vec<usize>, Tensor, ops::Conv2dGrads)> {
    d.record_history(Some(1 << 16));
    let out = ops::conv2d(x, w, None, opts)
        .and_then(|y| Ok((y, ops::conv2d_backward(x, w, dy, opts, false)?)));
    let trace = d.trace();
    d.record_history(None);
    let (y, g) = out?;
    let requests = trace.iter().filter(|e| e.action == vram_kernels::TraceAction::Alloc);
    let images = |r: usize, per_image: usize| r.is_multiple_of(per_image).then_some(r / per_image);
    let chunks =
        requests.filter_map(|e| images(e.requested, backward).or(images(e.requested, forward)));
    Ok((chunks.collect(), y, g))
}

/// A convolution that runs short of memory for its im2col buffer works through the batch in
/// chunks of fewer images (`Plan::chunked_workspace`), and computes what the host computes:
/// 5 images in 2 groups, chunks of 2 and a last one of 1.
#[test]
fn conv2d_in_chunks_of_fewer_images_matches_host() {
    let Some(gpu) = gpu() else { return };
    // The own kernels' im2col buffer (cuDNN sizes its own workspaces).
    gpu.set_conv_backend(ConvBackend::Own).unwrap();
    // An image's columns take 4.5 MiB: 5 images need a segment of 24 MiB, 2 share one of
    // 20 MiB; the backward's 5.25 MiB (its columns and dy's 12 channels of a group). No
    // output is a multiple of either (x and dx 5 MiB, y and dy 7.5 MiB). Above
    // DIRECT_MAX_MACS, so the im2col path.
    let (xs, ws, ys) = ([5, 16, 128, 128], [24, 8, 3, 3], [5, 24, 128, 128]);
    let opts = Conv2dOptions::default().padding((1, 1)).groups(2);
    assert!(!ops::conv2d_params(&xs, &ws, &opts).unwrap().is_direct());
    let per_image = (8 * 9 * 128 * 128 * 4, (8 * 9 + 12) * 128 * 128 * 4);
    let run = |d: &Device| {
        // No cuBLAS workspace: its block would fragment the little room there is.
        d.set_blas_workspace_size(0);
        let t = |shape: &[usize], seed| {
            let n = shape.iter().product();
            Tensor::from_f32_slice(d, shape, &values(n, seed, -4.0, 4.0), DType::F32)
        };
        let (x, w, dy) = (t(&xs, 1)?, t(&ws, 2)?, t(&ys, 3)?);
        conv_in_chunks(d, (&x, &w, &dy), &opts, per_image)
    };
    let (roomy, want_y, want_g) = run(&host()).unwrap();
    assert_eq!(roomy, [5, 5]);
    // The largest capacity (whole MiB) that leaves the host's forward 2 images per chunk.
    let (capacity, host_chunks) = (16..64u64)
        .rev()
        .find_map(|mib| match run(&Device::host(mib << 20)) {
            Ok((chunks, ..)) if chunks.first() == Some(&2) => Some((mib << 20, chunks)),
            _ => None,
        })
        .expect("a capacity that leaves the forward chunks of 2 images");
    let total = gpu.mem_info().total.max(1);
    gpu.set_memory_fraction(capacity as f64 / total as f64).unwrap();
    let (chunks, y, g) = run(&gpu).unwrap();
    assert_eq!(chunks, host_chunks, "images per chunk, CUDA against the host in {capacity} B");
    let t = tol(DType::F32, true);
    close_sum("conv2d in chunks", &y, &want_y, t);
    close_sum("conv2d dx in chunks", &g.dx, &want_g.dx, t);
    close_sum("conv2d dweight in chunks", &g.dweight, &want_g.dweight, t);
}

#[test]
fn pooling_matches_host() {
    let Some(gpu) = gpu() else { return };
    for dtype in DTYPES {
        let t = tol(dtype, false);
        let (hx, gx) = pair(&gpu, &[2, 3, 11, 10], dtype, 90);
        for opts in
            [Pool2dOptions::new((2, 2), (2, 2)), Pool2dOptions::new((3, 3), (2, 1)).padding((1, 1))]
        {
            let ((hy, ha), (gy, ga)) =
                (ops::max_pool2d(&hx, &opts).unwrap(), ops::max_pool2d(&gx, &opts).unwrap());
            close("max_pool2d", &gy, &hy, 0.0);
            assert_eq!(ga.to_vec().unwrap(), ha.as_slice().unwrap(), "max_pool2d argmax");
            let (hdy, gdy) = pair(&gpu, hy.shape(), dtype, 91);
            // Gathered in the order the host scatters, in f32, rounded once: equal.
            close(
                "max_pool2d_backward",
                &ops::max_pool2d_backward(&gdy, &ga, hx.shape(), &opts).unwrap(),
                &ops::max_pool2d_backward(&hdy, &ha, hx.shape(), &opts).unwrap(),
                0.0,
            );
            let gi = Indices::from_slice(&gpu, ha.shape(), ha.as_slice().unwrap()).unwrap();
            assert_eq!(gi.to_vec().unwrap(), ha.as_slice().unwrap());
            for pad in [true, false] {
                close(
                    "avg_pool2d",
                    &ops::avg_pool2d(&gx, &opts, pad).unwrap(),
                    &ops::avg_pool2d(&hx, &opts, pad).unwrap(),
                    t,
                );
                close(
                    "avg_pool2d_backward",
                    &ops::avg_pool2d_backward(&gdy, hx.shape(), &opts, pad).unwrap(),
                    &ops::avg_pool2d_backward(&hdy, hx.shape(), &opts, pad).unwrap(),
                    t,
                );
            }
        }
        close(
            "global_avg_pool",
            &ops::global_avg_pool(&gx).unwrap(),
            &ops::global_avg_pool(&hx).unwrap(),
            t,
        );
        let (hdy, gdy) = pair(&gpu, &[2, 3], dtype, 92);
        close(
            "global_avg_pool_backward",
            &ops::global_avg_pool_backward(&gdy, hx.shape()).unwrap(),
            &ops::global_avg_pool_backward(&hdy, hx.shape()).unwrap(),
            t,
        );
        let (mut hacc, mut gacc) = pair(&gpu, hx.shape(), dtype, 93);
        ops::global_avg_pool_backward_add(&mut hacc, &hdy).unwrap();
        ops::global_avg_pool_backward_add(&mut gacc, &gdy).unwrap();
        close("global_avg_pool_backward_add", &gacc, &hacc, t);
    }
}

#[test]
fn embedding_matches_host() {
    let Some(gpu) = gpu() else { return };
    for dtype in DTYPES {
        let (ht, gt) = pair(&gpu, &[50, 24], dtype, 100);
        let ids: Vec<u32> = (0..97).map(|i| (i * i % 50) as u32).collect();
        close(
            "embedding",
            &ops::embedding(&gt, &ids).unwrap(),
            &ops::embedding(&ht, &ids).unwrap(),
            0.0,
        );
        let (hd, gd) = pair(&gpu, &[97, 24], dtype, 101);
        // Each row's terms added in token order, as the host adds them: equal.
        close(
            "embedding_backward",
            &ops::embedding_backward(&ids, &gd, 50).unwrap(),
            &ops::embedding_backward(&ids, &hd, 50).unwrap(),
            0.0,
        );
        assert!(ops::embedding(&gt, &[50]).is_err());
    }
}

#[test]
fn permute_matches_host() {
    let Some(gpu) = gpu() else { return };
    for dtype in DTYPES {
        let (hx, gx) = pair(&gpu, &[3, 17, 4, 9], dtype, 102);
        for perm in [[0, 2, 1, 3], [3, 1, 0, 2], [0, 1, 2, 3]] {
            let (hy, gy) = (ops::permute(&hx, &perm).unwrap(), ops::permute(&gx, &perm).unwrap());
            close("permute", &gy, &hy, 0.0);
            close(
                "permute_backward",
                &ops::permute_backward(&gy, &perm).unwrap(),
                &ops::permute_backward(&hy, &perm).unwrap(),
                0.0,
            );
        }
        assert!(ops::permute(&gx, &[0, 1, 1, 2]).is_err());
        // Lower ranks are padded in front to four axes: dividers of 1.
        for (shape, perm) in [(&[37, 5][..], &[1, 0][..]), (&[6, 1, 11][..], &[2, 0, 1][..])] {
            let (hx, gx) = pair(&gpu, shape, dtype, 103);
            let (hy, gy) = (ops::permute(&hx, perm).unwrap(), ops::permute(&gx, perm).unwrap());
            close("permute (rank < 4)", &gy, &hy, 0.0);
        }
    }
}

#[test]
fn dropout_masks_are_identical_on_both_backends() {
    let Some(gpu) = gpu() else { return };
    for dtype in DTYPES {
        let n = 10_007;
        let h = Tensor::from_f32_slice(&host(), &[n], &values(n, 110, 0.5, 2.0), dtype).unwrap();
        let g = h.to_device(&gpu).unwrap();
        for (p, seed, offset) in [(0.1, 7, 0), (0.5, u64::MAX, 3), (0.9, 1 << 40, u64::MAX - 5)] {
            let hy = ops::dropout(&h, p, seed, offset).unwrap().to_f32_vec().unwrap();
            let gy = ops::dropout(&g, p, seed, offset).unwrap().to_f32_vec().unwrap();
            assert_eq!(gy, hy, "dropout {dtype} p {p}: values and mask must be identical");
            let hb = ops::dropout_backward(&h, p, seed, offset).unwrap().to_f32_vec().unwrap();
            let gb = ops::dropout_backward(&g, p, seed, offset).unwrap().to_f32_vec().unwrap();
            assert_eq!(gb, hb, "dropout_backward {dtype} p {p}");
        }
    }
}

#[test]
fn optimizers_and_unscale_match_host() {
    let Some(gpu) = gpu() else { return };
    for dtype in DTYPES {
        let n = 3001;
        let (hp0, gp0) = pair(&gpu, &[n], DType::F32, 120);
        let (hg, gg) = pair(&gpu, &[n], dtype, 121);
        let sgds = [
            SgdConfig {
                lr: 0.1,
                momentum: 0.0,
                dampening: 0.0,
                weight_decay: 0.01,
                nesterov: false,
            },
            SgdConfig {
                lr: 0.05,
                momentum: 0.9,
                dampening: 0.1,
                weight_decay: 0.0,
                nesterov: false,
            },
            SgdConfig {
                lr: 0.05,
                momentum: 0.9,
                dampening: 0.0,
                weight_decay: 1e-4,
                nesterov: true,
            },
        ];
        for cfg in sgds {
            let (mut hp, mut gp) = (hp0.try_clone().unwrap(), gp0.try_clone().unwrap());
            let mut hbuf = Tensor::zeros(&host(), &[n], DType::F32).unwrap();
            let mut gbuf = Tensor::zeros(&gpu, &[n], DType::F32).unwrap();
            for step in 0..3 {
                ops::sgd_step(&mut hp, &hg, Some(&mut hbuf), step == 0, &cfg).unwrap();
                ops::sgd_step(&mut gp, &gg, Some(&mut gbuf), step == 0, &cfg).unwrap();
            }
            close("sgd params", &gp, &hp, 1e-5);
            if cfg.momentum != 0.0 {
                close("sgd momentum", &gbuf, &hbuf, 1e-5);
            }
        }
        let cfg = AdamWConfig { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
        let (mut hp, mut gp) = (hp0.try_clone().unwrap(), gp0.try_clone().unwrap());
        let mut hm = Tensor::zeros(&host(), &[n], DType::F32).unwrap();
        let mut hv = Tensor::zeros(&host(), &[n], DType::F32).unwrap();
        let mut gm = Tensor::zeros(&gpu, &[n], DType::F32).unwrap();
        let mut gv = Tensor::zeros(&gpu, &[n], DType::F32).unwrap();
        for step in 1..=3 {
            ops::adamw_step(&mut hp, &hg, &mut hm, &mut hv, step, &cfg).unwrap();
            ops::adamw_step(&mut gp, &gg, &mut gm, &mut gv, step, &cfg).unwrap();
        }
        close("adamw params", &gp, &hp, 1e-5);
        close("adamw exp_avg", &gm, &hm, 1e-5);
        close("adamw exp_avg_sq", &gv, &hv, 1e-5);

        let (mut ha, mut ga) = pair(&gpu, &[n], dtype, 122);
        let (mut hb, mut gb) = pair(&gpu, &[17], dtype, 123);
        let hf = ops::unscale_and_check_finite(&mut [&mut ha, &mut hb], 0.25).unwrap();
        let gf = ops::unscale_and_check_finite(&mut [&mut ga, &mut gb], 0.25).unwrap();
        assert_eq!((gf, hf), (false, false), "finite gradients");
        close("unscale", &ga, &ha, tol(dtype, false));
        close("unscale", &gb, &hb, tol(dtype, false));
        let mut bad = vec![1.0f32; 40];
        bad[33] = f32::INFINITY;
        let mut hbad = Tensor::from_f32_slice(&host(), &[40], &bad, dtype).unwrap();
        let mut gbad = hbad.to_device(&gpu).unwrap();
        assert!(ops::unscale_and_check_finite(&mut [&mut ga, &mut gbad], 0.5).unwrap());
        assert!(ops::unscale_and_check_finite(&mut [&mut ha, &mut hbad], 0.5).unwrap());
        close("unscale after inf", &ga, &ha, tol(dtype, false));
    }
}

/// A page-locked buffer uploaded on the transfer stream arrives intact once the compute
/// stream has waited for it, while compute queued meanwhile is unaffected.
#[test]
fn pinned_upload_on_the_transfer_stream_arrives_intact() {
    let Some(dev) = gpu() else { return };
    let values = values(1 << 16, 7, -2.0, 2.0);
    let mut buf = vram_kernels::PinnedBuffer::new(&dev, values.len() * 4).unwrap();
    assert!(buf.is_page_locked());
    buf.write_f32(&values, DType::F32).unwrap();
    let busy =
        Tensor::from_f32_slice(&dev, &[512, 512], &values[..512 * 512 % values.len()], DType::F32);
    let upload = dev.upload_async(&buf, &[values.len()], DType::F32).unwrap();
    assert!(upload.is_async());
    drop(busy);
    let t = upload.wait().unwrap();
    assert_eq!(t.to_vec::<f32>().unwrap(), values);
}

/// The bits of `t`.
fn bits(t: &Tensor) -> Vec<u32> {
    t.to_f32_vec().unwrap().iter().map(|v| v.to_bits()).collect()
}

/// No kernel adds with atomics, so the gradients that sum over rows, tokens or images come
/// out the same, bit for bit, every time (what makes checkpointed and plain backward passes
/// agree exactly), at sizes of several row chunks and many repeated tokens. Sums of plain
/// terms (bias gradients, embedding rows) also equal the host's: the same terms in the
/// same order.
#[test]
fn gradients_repeat_bit_for_bit() {
    let Some(gpu) = gpu() else { return };
    // vram's own convolution kernels: cuDNN's algorithms need not repeat bit for bit (as
    // in PyTorch without `torch.backends.cudnn.deterministic`).
    gpu.set_conv_backend(ConvBackend::Own).unwrap();
    for dtype in DTYPES {
        let (_, gx) = pair(&gpu, &[1000, 300], dtype, 120);
        let (hdy, gdy) = pair(&gpu, &[1000, 300], dtype, 121);
        let gb = ops::bias_add_backward(&gdy).unwrap();
        close("bias_add_backward over 16 chunks", &gb, &ops::bias_add_backward(&hdy).unwrap(), 0.0);
        assert_eq!(bits(&gb), bits(&ops::bias_add_backward(&gdy).unwrap()), "bias_add_backward");

        let (_, gg) = pair(&gpu, &[300], dtype, 122);
        let (_, gbeta) = pair(&gpu, &[300], dtype, 123);
        let f = ops::layer_norm(&gx, &gg, &gbeta, 1e-5).unwrap();
        let run = || ops::layer_norm_backward(&gx, &gg, &f.mean, &f.rstd, &gdy).unwrap();
        let (a, b) = (run(), run());
        assert_eq!(bits(&a.dgamma), bits(&b.dgamma), "layer_norm dgamma ({dtype})");
        assert_eq!(bits(&a.dbeta), bits(&b.dbeta), "layer_norm dbeta ({dtype})");
        assert_eq!(bits(&a.dx), bits(&b.dx), "layer_norm dx ({dtype})");

        // 4096 tokens over 64 ids: every row gathers 64 terms.
        let ids: Vec<u32> = (0..4096u32).map(|i| (i * 7 + i / 64) % 64).collect();
        let (hd, gd) = pair(&gpu, &[4096, 300], dtype, 124);
        let ge = ops::embedding_backward(&ids, &gd, 100).unwrap();
        close(
            "embedding_backward, 64 terms a row",
            &ge,
            &ops::embedding_backward(&ids, &hd, 100).unwrap(),
            0.0,
        );
        assert_eq!(bits(&ge), bits(&ops::embedding_backward(&ids, &gd, 100).unwrap()));

        // Overlapping max-pool windows: inputs chosen by several windows.
        let opts = Pool2dOptions::new((3, 3), (1, 1)).padding((1, 1));
        let (hp, gp) = pair(&gpu, &[4, 8, 33, 31], dtype, 125);
        let ((_, ha), (gy, ga)) =
            (ops::max_pool2d(&hp, &opts).unwrap(), ops::max_pool2d(&gp, &opts).unwrap());
        let (hpy, gpy) = pair(&gpu, gy.shape(), dtype, 126);
        let gm = ops::max_pool2d_backward(&gpy, &ga, gp.shape(), &opts).unwrap();
        let hm = ops::max_pool2d_backward(&hpy, &ha, hp.shape(), &opts).unwrap();
        close("max_pool2d_backward, overlapping windows", &gm, &hm, 0.0);

        // Linear and convolution bias gradients (column sums over rows, over images).
        let (_, gw) = pair(&gpu, &[300, 300], dtype, 127);
        let lin = || ops::linear_backward(&gx, &gw, &gdy, true).unwrap();
        let (a, b) = (lin(), lin());
        let (da, db) = (a.dbias.expect("a bias gradient"), b.dbias.expect("a bias gradient"));
        assert_eq!(bits(&da), bits(&db), "linear db ({dtype})");
        assert_eq!(bits(&a.dw), bits(&b.dw), "linear dw ({dtype})");
        let (_, cx) = pair(&gpu, &[300, 4, 6, 6], dtype, 128);
        let (_, cw) = pair(&gpu, &[5, 4, 3, 3], dtype, 129);
        let (_, cdy) = pair(&gpu, &[300, 5, 4, 4], dtype, 130);
        let conv =
            || ops::conv2d_backward(&cx, &cw, &cdy, &Conv2dOptions::default(), true).unwrap();
        let (a, b) = (conv(), conv());
        assert_eq!(
            bits(a.dbias.as_ref().expect("a bias gradient")),
            bits(b.dbias.as_ref().expect("a bias gradient")),
            "conv2d dbias ({dtype})"
        );
        assert_eq!(bits(&a.dweight), bits(&b.dweight), "conv2d dweight ({dtype})");
        assert_eq!(bits(&a.dx), bits(&b.dx), "conv2d dx ({dtype})");

        // Depthwise (per-image tap sums added over 300 images in order) and im2col + cuBLAS
        // (the weight gradient a product per chunk of 12 images, over 6 chunks).
        let cases = [
            ([300, 8, 12, 12], [8, 1, 3, 3], Conv2dOptions::default().padding((1, 1)).groups(8)),
            ([64, 64, 32, 32], [64, 64, 3, 3], Conv2dOptions::default().padding((1, 1))),
        ];
        for (i, (xs, ws, opts)) in cases.iter().enumerate() {
            let p = ops::conv2d_params(xs, ws, opts).unwrap();
            let (_, cx) = pair(&gpu, xs, dtype, 131 + i as u64);
            let (_, cw) = pair(&gpu, ws, dtype, 133 + i as u64);
            let (_, cdy) = pair(&gpu, &p.output_shape(), dtype, 135 + i as u64);
            let conv = || ops::conv2d_backward(&cx, &cw, &cdy, opts, false).unwrap();
            let (a, b) = (conv(), conv());
            assert_eq!(bits(&a.dweight), bits(&b.dweight), "conv2d case {i} dweight ({dtype})");
            assert_eq!(bits(&a.dx), bits(&b.dx), "conv2d case {i} dx ({dtype})");
        }
    }
}

/// Fused attention on q, dout of `q_shape` and k, v of `kv_shape` (`dtype`, params `p`),
/// on the host and the GPU: the output and the three gradients compared; returns both
/// forwards (host, GPU).
fn attention_matches(
    gpu: &Device,
    what: &str,
    [q_shape, kv_shape]: [&[usize]; 2],
    dtype: DType,
    p: &ops::AttentionParams,
) -> [ops::AttentionOutput; 2] {
    let [(hq, gq), (hd, gd)] = [1, 4].map(|s| pair(gpu, q_shape, dtype, s));
    let [(hk, gk), (hv, gv)] = [2, 3].map(|s| pair(gpu, kv_shape, dtype, s));
    let hf = ops::attention(&hq, &hk, &hv, p).unwrap();
    let gf = ops::attention(&gq, &gk, &gv, p).unwrap();
    close_sum(&format!("{what} out"), &gf.out, &hf.out, tol(dtype, true));
    let hg = ops::attention_backward(&hq, &hk, &hv, &hf, &hd, p).unwrap();
    let gg = ops::attention_backward(&gq, &gk, &gv, &gf, &gd, p).unwrap();
    for (name, g, h) in [("dq", &gg.dq, &hg.dq), ("dk", &gg.dk, &hg.dk), ("dv", &gg.dv, &hg.dv)] {
        close_sum(&format!("{what} {name}"), g, h, tol(dtype, true));
    }
    [hf, gf]
}

#[test]
fn fused_attention_matches_host() {
    let Some(gpu) = gpu() else { return };
    for dtype in DTYPES {
        // Head dims on tensor cores (64, 128 in 16 bits) and on the FMA path (24; f32);
        // sequences of one token, of partial tiles and of several tiles; heads-major
        // [heads, seq, dim] and tokens-major [2, seq, heads, dim] (a projection's output).
        let cases = [(3, 1, 64), (2, 100, 64), (2, 300, 128), (3, 77, 24)];
        for ((heads, seq, dim), tokens_major) in
            cases.into_iter().flat_map(|c| [(c, false), (c, true)])
        {
            for causal in [false, true] {
                for drop in [0.0, 0.2] {
                    let p = ops::AttentionParams::new(causal).with_dropout(drop, 5, 1 << 20);
                    let (p, shape) = if tokens_major {
                        (p.tokens_major(), vec![2, seq, heads, dim])
                    } else {
                        (p, vec![heads, seq, dim])
                    };
                    let what = format!("attention {dtype:?} {shape:?} {p:?}");
                    let [hf, gf] = attention_matches(&gpu, &what, [&shape, &shape], dtype, &p);
                    close_sum(&format!("{what} lse"), &gf.lse, &hf.lse, tol(DType::F32, true));
                }
            }
        }
        // Grouped-query attention, tokens-major as the Llama block runs it: 6 query heads
        // over 2 key/value heads, on both tensor-core instances and the FMA path (dim 24).
        for dim in [64, 128, 24] {
            let p =
                ops::AttentionParams::new(true).with_dropout(0.1, 5, 7).tokens_major().grouped();
            let what = format!("grouped attention {dtype:?} dim {dim}");
            let shapes: [&[usize]; 2] = [&[2, 100, 6, dim], &[2, 100, 2, dim]];
            attention_matches(&gpu, &what, shapes, dtype, &p);
        }
    }
}
