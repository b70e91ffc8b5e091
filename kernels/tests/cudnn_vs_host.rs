//! Convolutions through cuDNN against the host reference: forward (with bias), backward data,
//! backward filter and the bias gradient; dense, strided, dilated, pointwise, grouped and
//! depthwise (which PyTorch's rule sends to cuDNN channels_last, and NCHW in f16 only: the
//! others run the own kernels, as PyTorch runs its own); NCHW and NHWC (channels_last); f32,
//! f16 and bf16; cuDNN's heuristics and its
//! timed search (`cudnn_benchmark`); TF32 off (f32 within 1e-4 of the largest value) and on
//! (1e-2). The GPU tests print `skipped: no CUDA device (...)` or `skipped: no cuDNN (...)`
//! and pass where they cannot run. The channels_last ops on the host, which run through
//! permutes around the NCHW reference, are checked against a direct NHWC loop everywhere.
//!
//! Batch norm through cuDNN (f32, and f16 with f32 parameters, as PyTorch) against the host
//! too: training with the running statistics, evaluation and backward, with the dtype pairs
//! and the 2-d inputs that stay on the own kernels alongside; the saved statistics crossing
//! from one path to the other; its workspaces given back.
//!
//! On the GPU machine, after `xtask/gpu/prepare`: `bash xtask/gpu/tests.sh cudnn` runs every
//! test whose name holds `cudnn` (these, the algorithm cache's and the device's fallback).

use std::io::Write as _;
use vram_kernels::cudnn_choices::BnPass;
use vram_kernels::ops;
use vram_kernels::{Conv2dOptions, ConvBackend, ConvPath, DType, Device, Tensor};

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// The host device of this test binary.
fn host() -> Device {
    static HOST: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
    HOST.get_or_init(|| Device::host(4 << 30)).clone()
}

/// A CUDA device running convolutions through cuDNN, or `None` after printing why not.
fn cudnn_gpu() -> Option<Device> {
    let gpu = match Device::cuda(0) {
        Ok(d) => d,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "skipped: no CUDA device ({e})");
            return None;
        }
    };
    match gpu.conv_path() {
        ConvPath::Cudnn { .. } => {
            gpu.set_conv_backend(ConvBackend::Cudnn).unwrap();
            let _ = writeln!(std::io::stderr(), "convolutions through {}", gpu.conv_path());
            Some(gpu)
        }
        other => {
            let _ = writeln!(std::io::stderr(), "skipped: no cuDNN ({other})");
            None
        }
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

fn tensor(d: &Device, shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_f32_slice(d, shape, &values(n, seed, -2.0, 2.0), dtype).unwrap()
}

/// `got` within `tol` of the largest magnitude of `want` everywhere (a convolution's sums
/// add in another order on each backend), same shape and dtype.
fn close(what: &str, got: &Tensor, want: &Tensor, tol: f64) {
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    let (g, w) = (got.to_f32_vec().unwrap(), want.to_f32_vec().unwrap());
    let largest = w.iter().fold(1.0f64, |m, &v| m.max(f64::from(v).abs()));
    for (i, (&g, &w)) in g.iter().zip(&w).enumerate() {
        let (g, w) = (f64::from(g), f64::from(w));
        assert!(
            (g - w).abs() <= tol * largest,
            "{what} ({}): index {i}: got {g}, want {w}, tol {tol} (scale {largest})",
            got.dtype()
        );
    }
}

fn tol(dtype: DType, tf32: bool) -> f64 {
    match dtype {
        DType::F32 if tf32 => 1e-2,
        DType::F32 => 1e-4,
        _ => 1e-2,
    }
}

/// (x NCHW shape, weight NCHW shape, options): every kind of convolution cuDNN takes here.
fn cases() -> Vec<([usize; 4], [usize; 4], Conv2dOptions)> {
    let o = Conv2dOptions::default;
    vec![
        ([2, 3, 13, 11], [8, 3, 3, 3], o().padding((1, 1))),
        ([2, 4, 12, 12], [6, 2, 3, 3], o().stride((2, 2)).groups(2)),
        ([3, 5, 9, 9], [4, 5, 3, 2], o().dilation((2, 1)).padding((2, 0))),
        ([2, 8, 7, 7], [16, 8, 1, 1], o()),
        ([2, 8, 9, 9], [16, 8, 1, 1], o().stride((2, 2))),
        // Depthwise, 3x3 and 5x5 strided, and a channel multiplier of 2.
        ([2, 6, 10, 10], [6, 1, 3, 3], o().padding((1, 1)).groups(6)),
        ([2, 6, 11, 11], [6, 1, 5, 5], o().stride((2, 2)).padding((2, 2)).groups(6)),
        ([2, 4, 9, 9], [8, 1, 3, 3], o().padding((1, 1)).groups(4)),
        // Large enough for cuDNN's implicit-GEMM and Winograd kernels and a workspace.
        ([4, 32, 28, 28], [64, 32, 3, 3], o().padding((1, 1))),
        ([4, 64, 16, 16], [64, 16, 3, 3], o().padding((1, 1)).dilation((2, 1)).groups(4)),
    ]
}

/// `[n, c, h, w]` as `[n, h, w, c]` (and a weight `[k, c, r, s]` as `[k, r, s, c]`).
fn nhwc(s: [usize; 4]) -> [usize; 4] {
    [s[0], s[2], s[3], s[1]]
}

/// Forward with bias, backward with bias and (NCHW) the weight's gradient alone, on `gpu`
/// against the host, in every dtype and both layouts; forward and backward twice, the second
/// time from the algorithms the first cached.
fn check_all(gpu: &Device, tf32: bool, what: &str) {
    for dtype in DTYPES {
        let t = tol(dtype, tf32);
        for (i, (xs, ws, opts)) in cases().into_iter().enumerate() {
            for layout_nhwc in [false, true] {
                let seed = 10 * i as u64;
                let (xs, ws) = if layout_nhwc { (nhwc(xs), nhwc(ws)) } else { (xs, ws) };
                let name = format!(
                    "{what} case {i} {} {dtype}",
                    if layout_nhwc { "NHWC" } else { "NCHW" }
                );
                let (hx, hw, hb) = (
                    tensor(&host(), &xs, dtype, seed),
                    tensor(&host(), &ws, dtype, seed + 1),
                    tensor(&host(), &[ws[0]], dtype, seed + 2),
                );
                let (gx, gw, gb) = (
                    hx.to_device(gpu).unwrap(),
                    hw.to_device(gpu).unwrap(),
                    hb.to_device(gpu).unwrap(),
                );
                let forward = |x: &Tensor, w: &Tensor, b: &Tensor| {
                    if layout_nhwc {
                        ops::conv2d_nhwc(x, w, Some(b), &opts).unwrap()
                    } else {
                        ops::conv2d(x, w, Some(b), &opts).unwrap()
                    }
                };
                let backward = |x: &Tensor, w: &Tensor, dy: &Tensor| {
                    if layout_nhwc {
                        ops::conv2d_backward_nhwc(x, w, dy, &opts, true).unwrap()
                    } else {
                        ops::conv2d_backward(x, w, dy, &opts, true).unwrap()
                    }
                };
                let (hy, gy) = (forward(&hx, &hw, &hb), forward(&gx, &gw, &gb));
                close(&format!("{name} forward"), &gy, &hy, t);
                let hdy = tensor(&host(), hy.shape(), dtype, seed + 3);
                let gdy = hdy.to_device(gpu).unwrap();
                let (hg, gg) = (backward(&hx, &hw, &hdy), backward(&gx, &gw, &gdy));
                close(&format!("{name} dx"), &gg.dx, &hg.dx, t);
                close(&format!("{name} dweight"), &gg.dweight, &hg.dweight, t);
                close(
                    &format!("{name} dbias"),
                    gg.dbias.as_ref().unwrap(),
                    hg.dbias.as_ref().unwrap(),
                    t,
                );
                // Again, now from the choices the first calls cached (PyTorch's algorithm
                // cache, `try_all`'s first branch): the same results.
                close(&format!("{name} forward, cached choice"), &forward(&gx, &gw, &gb), &hy, t);
                let gg2 = backward(&gx, &gw, &gdy);
                close(&format!("{name} dx, cached choice"), &gg2.dx, &hg.dx, t);
                close(&format!("{name} dweight, cached choice"), &gg2.dweight, &hg.dweight, t);
                if !layout_nhwc {
                    let alone = ops::conv2d_backward_weight(&gx, &gw, &gdy, &opts, false).unwrap();
                    close(&format!("{name} dweight alone"), &alone.dweight, &hg.dweight, t);
                    assert!(alone.dbias.is_none());
                }
            }
        }
    }
}

#[test]
fn cudnn_convolutions_match_the_host_with_tf32_off() {
    let Some(gpu) = cudnn_gpu() else { return };
    gpu.set_allow_tf32_cudnn(false);
    check_all(&gpu, false, "heuristics, TF32 off");
}

#[test]
fn cudnn_convolutions_match_the_host_with_tf32_on_as_pytorchs_default() {
    let Some(gpu) = cudnn_gpu() else { return };
    assert!(gpu.allow_tf32_cudnn(), "PyTorch's default");
    check_all(&gpu, true, "heuristics, TF32 on");
}

#[test]
fn cudnn_benchmark_search_matches_the_host() {
    let Some(gpu) = cudnn_gpu() else { return };
    gpu.set_cudnn_benchmark(true);
    gpu.set_allow_tf32_cudnn(false);
    check_all(&gpu, false, "timed search, TF32 off");
}

/// cuDNN's workspaces come from the caching allocator and go back to it: after a step,
/// only the outputs are live, and the peak is at least the outputs.
#[test]
fn cudnn_workspaces_are_counted_and_returned() {
    let Some(gpu) = cudnn_gpu() else { return };
    let (x, w) = (
        tensor(&gpu, &[8, 64, 56, 56], DType::F32, 1),
        tensor(&gpu, &[64, 64, 3, 3], DType::F32, 2),
    );
    let opts = Conv2dOptions::default().padding((1, 1));
    let before = gpu.memory_allocated();
    gpu.reset_peak_stats();
    let y = ops::conv2d(&x, &w, None, &opts).unwrap();
    let g = ops::conv2d_backward(&x, &w, &y, &opts, false).unwrap();
    gpu.synchronize().unwrap();
    let outputs = (y.size_in_bytes() + g.dx.size_in_bytes() + g.dweight.size_in_bytes()) as u64;
    assert_eq!(gpu.memory_allocated() - before, outputs, "only the outputs stay");
    let peak = gpu.max_memory_allocated() - before;
    let _ = writeln!(
        std::io::stderr(),
        "{}: peak above the operands {peak} B, outputs {outputs} B (workspaces {} B at most)",
        gpu.conv_path(),
        peak - outputs
    );
    assert!(peak >= outputs);
}

/// An output that does not fit is an out-of-memory error that leaves the operands intact.
#[test]
fn cudnn_out_of_memory_leaves_live_tensors_intact() {
    let Some(gpu) = cudnn_gpu() else { return };
    let x = tensor(&gpu, &[4, 16, 64, 64], DType::F32, 3);
    let w = tensor(&gpu, &[1024, 16, 3, 3], DType::F32, 4);
    let want = x.to_f32_vec().unwrap();
    // Room for a few MiB more than what is live: the 64 MiB output cannot fit.
    let total = gpu.mem_info().total.max(1) as f64;
    let room = (gpu.memory_reserved() + (8 << 20)) as f64;
    gpu.set_memory_fraction(room / total).unwrap();
    let live = gpu.memory_allocated();
    let e = ops::conv2d(&x, &w, None, &Conv2dOptions::default().padding((1, 1))).unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    assert_eq!(gpu.memory_allocated(), live);
    assert_eq!(x.to_f32_vec().unwrap(), want);
}

/// A direct NHWC convolution: `x [n, h, w, c]`, `w [k, r, s, c / groups]`.
fn naive_nhwc(
    xs: [usize; 4],
    x: &[f32],
    ws: [usize; 4],
    w: &[f32],
    o: &Conv2dOptions,
) -> (Vec<f32>, [usize; 4]) {
    let [n, h, wd, c] = xs;
    let [k, r, s, cg] = ws;
    let (oh, ow) = (
        (h + 2 * o.padding.0 - o.dilation.0 * (r - 1) - 1) / o.stride.0 + 1,
        (wd + 2 * o.padding.1 - o.dilation.1 * (s - 1) - 1) / o.stride.1 + 1,
    );
    let kg = k / o.groups;
    let mut y = vec![0.0f32; n * oh * ow * k];
    for b in 0..n {
        for i in 0..oh {
            for j in 0..ow {
                for ko in 0..k {
                    let g = ko / kg;
                    let mut acc = 0.0f64;
                    for ri in 0..r {
                        for si in 0..s {
                            let hi = (i * o.stride.0 + ri * o.dilation.0) as isize
                                - o.padding.0 as isize;
                            let wi = (j * o.stride.1 + si * o.dilation.1) as isize
                                - o.padding.1 as isize;
                            if hi < 0 || wi < 0 || hi >= h as isize || wi >= wd as isize {
                                continue;
                            }
                            for ci in 0..cg {
                                let xv =
                                    x[((b * h + hi as usize) * wd + wi as usize) * c + g * cg + ci];
                                let wv = w[((ko * r + ri) * s + si) * cg + ci];
                                acc += f64::from(xv) * f64::from(wv);
                            }
                        }
                    }
                    y[((b * oh + i) * ow + j) * k + ko] = acc as f32;
                }
            }
        }
    }
    (y, [n, oh, ow, k])
}

/// The channels_last ops on the host (permutes around the NCHW reference) against a direct
/// NHWC loop, forward, and backward through the identities `<dy, conv(x, w)>`: dx and dw
/// are the gradients of the scalar `sum(dy * y)`, checked by its change under one-hot
/// perturbations of x and w (exact for a bilinear function).
#[test]
fn channels_last_convolutions_on_the_host_match_a_direct_nhwc_loop() {
    let d = host();
    for (i, (xs, ws, opts)) in cases().into_iter().enumerate().filter(|(i, _)| *i < 8) {
        let (xs, ws) = (nhwc(xs), nhwc(ws));
        let (xv, wv) = (
            values(xs.iter().product(), 7 + i as u64, -2.0, 2.0),
            values(ws.iter().product(), 8 + i as u64, -2.0, 2.0),
        );
        let x = Tensor::from_f32_slice(&d, &xs, &xv, DType::F32).unwrap();
        let w = Tensor::from_f32_slice(&d, &ws, &wv, DType::F32).unwrap();
        let y = ops::conv2d_nhwc(&x, &w, None, &opts).unwrap();
        let (want, shape) = naive_nhwc(xs, &xv, ws, &wv, &opts);
        assert_eq!(y.shape(), shape, "case {i}");
        let want_t = Tensor::from_f32_slice(&d, &shape, &want, DType::F32).unwrap();
        close(&format!("NHWC forward case {i}"), &y, &want_t, 1e-5);
        let dyv = values(want.len(), 9 + i as u64, -1.0, 1.0);
        let dy = Tensor::from_f32_slice(&d, &shape, &dyv, DType::F32).unwrap();
        let g = ops::conv2d_backward_nhwc(&x, &w, &dy, &opts, true).unwrap();
        assert_eq!((g.dx.shape(), g.dweight.shape()), (&xs[..], &ws[..]), "case {i}");
        let loss = |xv: &[f32], wv: &[f32]| -> f64 {
            let (y, _) = naive_nhwc(xs, xv, ws, wv, &opts);
            y.iter().zip(&dyv).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum()
        };
        let base = loss(&xv, &wv);
        let (dx, dw) = (g.dx.to_f32_vec().unwrap(), g.dweight.to_f32_vec().unwrap());
        for idx in [0, xv.len() / 3, xv.len() - 1] {
            let mut xp = xv.clone();
            xp[idx] += 1.0;
            let want = loss(&xp, &wv) - base;
            assert!(
                (f64::from(dx[idx]) - want).abs() < 1e-3 * want.abs().max(1.0),
                "case {i} dx[{idx}]"
            );
        }
        for idx in [0, wv.len() / 2, wv.len() - 1] {
            let mut wp = wv.clone();
            wp[idx] += 1.0;
            let want = loss(&xv, &wp) - base;
            assert!(
                (f64::from(dw[idx]) - want).abs() < 1e-3 * want.abs().max(1.0),
                "case {i} dw[{idx}]"
            );
        }
        let db = g.dbias.unwrap().to_f32_vec().unwrap();
        for (ko, got) in db.iter().enumerate() {
            let want: f64 = dyv.iter().skip(ko).step_by(ws[0]).map(|v| f64::from(*v)).sum();
            assert!(
                (f64::from(*got) - want).abs() < 1e-4 * want.abs().max(1.0),
                "case {i} db[{ko}]"
            );
        }
    }
}

/// Bad channels_last shapes are errors, never panics.
#[test]
fn channels_last_shape_errors_are_clear() {
    let d = host();
    let x = Tensor::zeros(&d, &[2, 8, 8, 3], DType::F32).unwrap();
    let w = Tensor::zeros(&d, &[4, 3, 3, 2], DType::F32).unwrap();
    let e = ops::conv2d_nhwc(&x, &w, None, &Conv2dOptions::default()).unwrap_err();
    assert!(e.to_string().contains("conv2d"), "{e}");
    let flat = Tensor::zeros(&d, &[2, 8, 8], DType::F32).unwrap();
    assert!(ops::conv2d_nhwc(&flat, &w, None, &Conv2dOptions::default()).is_err());
    let w = Tensor::zeros(&d, &[4, 3, 3, 3], DType::F32).unwrap();
    let y = ops::conv2d_nhwc(&x, &w, None, &Conv2dOptions::default()).unwrap();
    assert_eq!(y.shape(), &[2, 6, 6, 4]);
    let bad_dy = Tensor::zeros(&d, &[2, 4, 6, 6], DType::F32).unwrap();
    assert!(ops::conv2d_backward_nhwc(&x, &w, &bad_dy, &Conv2dOptions::default(), false).is_err());
}

/// Batch norm's (input dtype, parameter dtype) pairs: cuDNN takes the first two (PyTorch's
/// rule), the own kernels the rest, on the same device.
const BN_DTYPES: [(DType, DType); 5] = [
    (DType::F32, DType::F32),
    (DType::F16, DType::F32),
    (DType::F16, DType::F16),
    (DType::BF16, DType::F32),
    (DType::BF16, DType::BF16),
];

/// BatchNorm2d, BatchNorm1d on sequences and BatchNorm3d (cuDNN), then `[n, c]` (the own
/// kernels: PyTorch gives cuDNN 3 dimensions or more); the third large enough for cuDNN's
/// multi-block kernels.
const BN_SHAPES: [&[usize]; 5] =
    [&[4, 6, 9, 7], &[3, 5, 11], &[16, 8, 32, 32], &[2, 3, 4, 5, 6], &[37, 5]];

/// Positive values in `[0.5, 1.5)` (a running variance).
fn positive(d: &Device, c: usize, dtype: DType, seed: u64) -> Tensor {
    Tensor::from_f32_slice(d, &[c], &values(c, seed, 0.5, 1.5), dtype).unwrap()
}

/// One batch norm step on `d`: training with running statistics (momentum 0.1), evaluation
/// with the updated statistics, backward from the saved ones. Returns
/// `[y, mean, invstd, running mean, running var, eval y, dx, dgamma, dbeta]`.
fn bn_step(d: &Device, shape: &[usize], (t, pt): (DType, DType), eps: f32) -> Vec<Tensor> {
    let c = shape[1];
    let on = |x: Tensor| x.to_device(d).unwrap();
    let x = on(tensor(&host(), shape, t, 40));
    let (g, b) = (on(tensor(&host(), &[c], pt, 41)), on(tensor(&host(), &[c], pt, 42)));
    let mut rm = on(tensor(&host(), &[c], pt, 43));
    let mut rv = on(positive(&host(), c, pt, 44));
    let dy = on(tensor(&host(), shape, t, 45));
    let running = ops::RunningStats { mean: &mut rm, var: &mut rv, momentum: 0.1 };
    let out = ops::batch_norm(&x, &g, &b, Some(running), eps).unwrap();
    let eval = ops::batch_norm_eval(&x, &g, &b, &rm, &rv, eps).unwrap();
    let grads = ops::batch_norm_backward(&x, &g, &out.mean, &out.invstd, &dy, eps).unwrap();
    vec![out.y, out.mean, out.invstd, rm, rv, eval, grads.dx, grads.dgamma, grads.dbeta]
}

const BN_NAMES: [&str; 9] =
    ["y", "mean", "invstd", "running mean", "running var", "eval y", "dx", "dgamma", "dbeta"];

/// Batch norm on the GPU (cuDNN where PyTorch uses it, the own kernels elsewhere) against the
/// host: training with the running statistics, evaluation, backward; every dtype pair,
/// 3- to 5-d and 2-d inputs, PyTorch's eps and a larger one (cuDNN's backward is given the
/// forward's, as it requires). f32 batch norms of 3 to 5 dimensions must have run through
/// cuDNN (PyTorch's rule), training and backward: the record of the calls says so, so that a
/// silent fall back to the own kernels fails here.
#[test]
fn cudnn_batch_norm_matches_the_host() {
    let Some(gpu) = cudnn_gpu() else { return };
    let _ = writeln!(std::io::stderr(), "batch norm through {}", gpu.batch_norm_path());
    for (t, pt) in BN_DTYPES {
        for shape in BN_SHAPES {
            for eps in [1e-5, 1e-3] {
                let want = bn_step(&host(), shape, (t, pt), eps);
                let got = bn_step(&gpu, shape, (t, pt), eps);
                for ((name, g), w) in BN_NAMES.iter().zip(&got).zip(&want) {
                    // The saved statistics are f32 whatever the input; the running ones are
                    // in the parameters' dtype; the rest in the input's.
                    // Sums over 16-bit inputs (the running statistics, dgamma, dbeta) are
                    // held to the 16-bit tolerance: the GPU may round its terms.
                    let tol = match *name {
                        "mean" | "invstd" => 1e-4,
                        "running mean" | "running var" | "dgamma" | "dbeta" => {
                            tol(pt, false).max(tol(t, false))
                        }
                        _ => tol(t, false),
                    };
                    close(&format!("{name} {shape:?} {t:?}/{pt:?} eps {eps}"), g, w, tol);
                }
            }
        }
    }
    let calls = gpu.cudnn_choices().expect("cuDNN loaded").batch_norms;
    for shape in BN_SHAPES.iter().filter(|s| (3..=5).contains(&s.len())) {
        for pass in [BnPass::Training, BnPass::Backward] {
            let ran =
                calls.iter().any(|c| c.pass == pass && c.shape == *shape && c.dtype == DType::F32);
            assert!(ran, "f32 {shape:?}: no {pass:?} call through cuDNN in {calls:?}");
        }
    }
}

/// cuDNN's saved mean and invstd are the own kernels' (mean and `1 / sqrt(var + eps)` of the
/// biased variance): a cuDNN forward's feed the own backward, and the own forward's feed
/// cuDNN's backward, both matching the host.
#[test]
fn cudnn_batch_norm_saves_what_the_own_kernels_save() {
    let Some(gpu) = cudnn_gpu() else { return };
    let shape = [8, 6, 12, 10];
    let on = |x: &Tensor| x.to_device(&gpu).unwrap();
    let (hx, hg, hb, hdy) = (
        tensor(&host(), &shape, DType::F32, 50),
        tensor(&host(), &[6], DType::F32, 51),
        tensor(&host(), &[6], DType::F32, 52),
        tensor(&host(), &shape, DType::F32, 53),
    );
    let want = ops::batch_norm(&hx, &hg, &hb, None, 1e-3).unwrap();
    let want_g = ops::batch_norm_backward(&hx, &hg, &want.mean, &want.invstd, &hdy, 1e-3).unwrap();
    let (x, g, b, dy) = (on(&hx), on(&hg), on(&hb), on(&hdy));
    for (forward, backward) in
        [(ConvBackend::Cudnn, ConvBackend::Own), (ConvBackend::Own, ConvBackend::Cudnn)]
    {
        gpu.set_conv_backend(forward).unwrap();
        let out = ops::batch_norm(&x, &g, &b, None, 1e-3).unwrap();
        close(&format!("mean ({forward:?})"), &out.mean, &want.mean, 1e-4);
        close(&format!("invstd ({forward:?})"), &out.invstd, &want.invstd, 1e-4);
        gpu.set_conv_backend(backward).unwrap();
        let grads = ops::batch_norm_backward(&x, &g, &out.mean, &out.invstd, &dy, 1e-3).unwrap();
        close(&format!("dx ({forward:?} then {backward:?})"), &grads.dx, &want_g.dx, 1e-4);
        close(&format!("dgamma ({backward:?})"), &grads.dgamma, &want_g.dgamma, 1e-4);
        close(&format!("dbeta ({backward:?})"), &grads.dbeta, &want_g.dbeta, 1e-4);
    }
}

/// cuDNN batch norm's workspaces and reserve space come from the caching allocator and go
/// back to it: after training, evaluation and backward, the live bytes are the outputs',
/// the same as the own kernels leave, and nothing once the outputs are dropped. Prints the
/// peaks of both paths.
#[test]
fn cudnn_batch_norm_workspaces_are_returned() {
    let Some(gpu) = cudnn_gpu() else { return };
    for (t, pt) in [(DType::F32, DType::F32), (DType::F16, DType::F32)] {
        let shape = [32, 64, 28, 28];
        let x = tensor(&gpu, &shape, t, 60);
        let (g, b) = (positive(&gpu, 64, pt, 61), tensor(&gpu, &[64], pt, 62));
        let (mut rm, mut rv) = (tensor(&gpu, &[64], pt, 63), positive(&gpu, 64, pt, 64));
        let dy = tensor(&gpu, &shape, t, 65);
        let mut live = Vec::new();
        for backend in [ConvBackend::Cudnn, ConvBackend::Own] {
            gpu.set_conv_backend(backend).unwrap();
            gpu.synchronize().unwrap();
            let before = gpu.memory_allocated();
            gpu.reset_peak_stats();
            let running = ops::RunningStats { mean: &mut rm, var: &mut rv, momentum: 0.1 };
            let out = ops::batch_norm(&x, &g, &b, Some(running), 1e-5).unwrap();
            let eval = ops::batch_norm_eval(&x, &g, &b, &rm, &rv, 1e-5).unwrap();
            let grads =
                ops::batch_norm_backward(&x, &g, &out.mean, &out.invstd, &dy, 1e-5).unwrap();
            gpu.synchronize().unwrap();
            let outputs = gpu.memory_allocated() - before;
            let peak = gpu.max_memory_allocated() - before;
            let _ = writeln!(
                std::io::stderr(),
                "batch norm {shape:?} {t:?}/{pt:?} through {}: outputs {outputs} B live, \
                 peak above the operands {peak} B (workspaces {} B at most)",
                gpu.batch_norm_path(),
                peak - outputs
            );
            assert!(peak >= outputs);
            live.push(outputs);
            drop((out, eval, grads));
            assert_eq!(gpu.memory_allocated(), before, "{backend:?}: everything went back");
        }
        assert_eq!(live[0], live[1], "{t:?}: cuDNN leaves only the outputs, as the own kernels");
    }
    gpu.set_conv_backend(ConvBackend::Cudnn).unwrap();
}
