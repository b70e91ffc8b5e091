//! The fused ops of issue 33 on CUDA against the host: the multi-tensor optimizer steps
//! The fused ops of issue 33 on CUDA against the host: the multi-tensor optimizer steps
//! (every dtype combination in one launch), bias + GELU forward and backward, the residual
//! add + layer norm, with and without dropout on the branch (and the residual add with
//! dropout alone, and the branch's gradient), and the linear layer with its bias and GELU in
//! one cuBLASLt call (forward and backward, TF32 off and on), and layer norm's backward with
//! the residual's and the branch's gradients. f32 within 1e-5 relative,
//! 16-bit within 1e-2; sums (the bias gradient) relative to the largest value.
//! Each test prints `skipped: no CUDA device (...)` and passes where no GPU can be opened.
//! (Layer norm's fused backward is `cuda_vs_host.rs`'s layer norm test.)

use std::io::Write as _;
use vram_kernels::ops::{self, AdamWTensors, SgdTensors};
use vram_kernels::{AdamWConfig, DType, Device, SgdConfig, Tensor};

fn gpu() -> Option<Device> {
    match Device::cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "skipped: no CUDA device ({e})");
            None
        }
    }
}

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

/// `got` against `want` (both copied to the host): `|g - w| <= tol * max(scale, 1)` with
/// `scale` = `|w|`, or the largest `|w|` for a sum.
fn close(what: &str, got: &Tensor, want: &Tensor, tol: f32, sum: bool) {
    let (g, w) = (got.to_f32_vec().unwrap(), want.to_f32_vec().unwrap());
    assert_eq!(g.len(), w.len(), "{what}: length");
    let top = w.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    for (i, (g, w)) in g.iter().zip(&w).enumerate() {
        let scale = if sum { top } else { w.abs() };
        assert!((g - w).abs() <= tol * scale.max(1.0), "{what}: index {i}: cuda {g}, host {w}");
    }
}

/// One parameter on one device: value, optional master, gradient, two state tensors.
struct Slot {
    p: Tensor,
    master: Option<Tensor>,
    g: Tensor,
    s1: Tensor,
    s2: Tensor,
}

fn slots(dev: &Device) -> Vec<Slot> {
    let specs = [
        (DType::F32, false, DType::F32, 70_001),
        (DType::BF16, true, DType::BF16, 131_073),
        (DType::F16, true, DType::F32, 3),
        (DType::BF16, false, DType::BF16, 1000),
        (DType::F32, false, DType::F16, 0),
    ];
    specs
        .iter()
        .enumerate()
        .map(|(i, &(dt, master, gt, n))| {
            let seed = 10 * i as u64;
            let p = Tensor::from_f32_slice(dev, &[n], &values(n, seed, -1.0, 1.0), dt).unwrap();
            Slot {
                master: master.then(|| p.to_dtype(DType::F32).unwrap()),
                p,
                g: Tensor::from_f32_slice(dev, &[n], &values(n, seed + 1, -0.5, 0.5), gt).unwrap(),
                s1: Tensor::zeros(dev, &[n], DType::F32).unwrap(),
                s2: Tensor::zeros(dev, &[n], DType::F32).unwrap(),
            }
        })
        .collect()
}

fn adamw(list: &mut [Slot], step: u32, cfg: &AdamWConfig) {
    let mut l: Vec<AdamWTensors<'_>> = list
        .iter_mut()
        .map(|s| AdamWTensors {
            param: &mut s.p,
            grad: &s.g,
            exp_avg: &mut s.s1,
            exp_avg_sq: &mut s.s2,
            master: s.master.as_mut(),
            step,
        })
        .collect();
    ops::adamw_step_multi(&mut l, cfg).unwrap();
}

fn sgd(list: &mut [Slot], first: bool, cfg: &SgdConfig) {
    let mut l: Vec<SgdTensors<'_>> = list
        .iter_mut()
        .map(|s| SgdTensors {
            param: &mut s.p,
            grad: &s.g,
            momentum_buf: Some(&mut s.s1),
            first_step: first,
            master: s.master.as_mut(),
        })
        .collect();
    ops::sgd_step_multi(&mut l, cfg).unwrap();
}

fn compare(what: &str, got: &[Slot], want: &[Slot]) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = if w.p.dtype() == DType::F32 { 1e-5 } else { 1e-2 };
        close(&format!("{what} param {i}"), &g.p, &w.p, tol, false);
        close(&format!("{what} state {i}"), &g.s1, &w.s1, 1e-5, false);
        if let (Some(gm), Some(wm)) = (&g.master, &w.master) {
            close(&format!("{what} master {i}"), gm, wm, 1e-5, false);
        }
    }
}

#[test]
fn multi_tensor_steps_match_the_host() {
    let Some(gpu) = gpu() else { return };
    let host = Device::host(1 << 30);
    let cfg = AdamWConfig { lr: 1e-2, weight_decay: 0.1, ..AdamWConfig::default() };
    let (mut h, mut g) = (slots(&host), slots(&gpu));
    for step in 1..=3 {
        adamw(&mut h, step, &cfg);
        adamw(&mut g, step, &cfg);
    }
    compare("adamw_step_multi", &g, &h);
    let cfg = SgdConfig { lr: 0.05, momentum: 0.9, nesterov: true, ..SgdConfig::default() };
    let (mut h, mut g) = (slots(&host), slots(&gpu));
    for step in 0..3 {
        sgd(&mut h, step == 0, &cfg);
        sgd(&mut g, step == 0, &cfg);
    }
    compare("sgd_step_multi", &g, &h);
}

#[test]
fn bias_gelu_matches_the_host() {
    let Some(gpu) = gpu() else { return };
    let host = Device::host(1 << 30);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
        let (rows, d) = (300, 3072);
        let t = |dev: &Device, n: usize, shape: &[usize], seed| {
            Tensor::from_f32_slice(dev, shape, &values(n, seed, -3.0, 3.0), dtype).unwrap()
        };
        let run = |dev: &Device| {
            let x = t(dev, rows * d, &[rows, d], 1);
            let b = t(dev, d, &[d], 2);
            let dy = t(dev, rows * d, &[rows, d], 3);
            (ops::bias_gelu(&x, &b).unwrap(), ops::bias_gelu_backward(&x, &b, &dy).unwrap())
        };
        let ((hy, hg), (gy, gg)) = (run(&host), run(&gpu));
        close(&format!("bias_gelu {dtype:?}"), &gy, &hy, tol, false);
        close(&format!("bias_gelu dx {dtype:?}"), &gg.dx, &hg.dx, tol, false);
        close(&format!("bias_gelu dbias {dtype:?}"), &gg.dbias, &hg.dbias, tol, true);
    }
}

#[test]
fn add_layer_norm_matches_the_host() {
    let Some(gpu) = gpu() else { return };
    let host = Device::host(1 << 30);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
        let (rows, d) = (257, 768);
        let t = |dev: &Device, n: usize, shape: &[usize], seed| {
            Tensor::from_f32_slice(dev, shape, &values(n, seed, -3.0, 3.0), dtype).unwrap()
        };
        let run = |dev: &Device| {
            let (a, b) = (t(dev, rows * d, &[rows, d], 4), t(dev, rows * d, &[rows, d], 5));
            let (g, be) = (t(dev, d, &[d], 6), t(dev, d, &[d], 7));
            ops::add_layer_norm(&a, &b, &g, &be, 1e-5).unwrap()
        };
        let (h, g) = (run(&host), run(&gpu));
        close(&format!("add_layer_norm sum {dtype:?}"), &g.sum, &h.sum, 0.0, false);
        close(&format!("add_layer_norm y {dtype:?}"), &g.norm.y, &h.norm.y, tol, false);
        close(&format!("add_layer_norm rstd {dtype:?}"), &g.norm.rstd, &h.norm.rstd, 1e-4, false);
    }
}

/// Dropout fused with the residual add (alone and with the layer norm) and the branch's
/// gradient, every (residual, branch) dtype pair, p 0.1: the mask is the host's (the same
/// Philox stream), so the sums and gradients agree exactly (a product and a sum each
/// rounded once, no library math, no contraction: the kernels compile with fmad off); the
/// norm within the tolerance above.
#[test]
fn dropout_add_and_its_layer_norm_match_the_host() {
    let Some(gpu) = gpu() else { return };
    let host = Device::host(1 << 30);
    let pairs = [
        (DType::F32, DType::F32),
        (DType::F32, DType::F16),
        (DType::F32, DType::BF16),
        (DType::F16, DType::F16),
        (DType::BF16, DType::BF16),
    ];
    let (p, seed, offset) = (0.1, 0x5eed, 1 << 33);
    for (r, b) in pairs {
        let what = format!("{r:?}+{b:?}");
        let tol = if r == DType::F32 { 1e-5 } else { 1e-2 };
        let (rows, d) = (257, 768);
        let t = |dev: &Device, n: usize, shape: &[usize], seed, dt| {
            Tensor::from_f32_slice(dev, shape, &values(n, seed, -3.0, 3.0), dt).unwrap()
        };
        let run = |dev: &Device| {
            let (x, o) = (t(dev, rows * d, &[rows, d], 4, r), t(dev, rows * d, &[rows, d], 5, b));
            let (g, be) = (t(dev, d, &[d], 6, r), t(dev, d, &[d], 7, r));
            let dy = t(dev, rows * d, &[rows, d], 8, r);
            (
                ops::dropout_add(&x, &o, p, seed, offset).unwrap(),
                ops::dropout_add_layer_norm(&x, &o, &g, &be, 1e-5, p, seed, offset).unwrap(),
                ops::dropout_add_backward(&dy, b, p, seed, offset).unwrap(),
            )
        };
        let ((hy, hn, hd), (gy, gn, gd)) = (run(&host), run(&gpu));
        close(&format!("dropout_add {what}"), &gy, &hy, 0.0, false);
        close(&format!("dropout_add_backward {what}"), &gd, &hd, 0.0, false);
        close(&format!("dropout_add_layer_norm sum {what}"), &gn.sum, &hn.sum, 0.0, false);
        close(&format!("dropout_add_layer_norm y {what}"), &gn.norm.y, &hn.norm.y, tol, false);
        let rstd = &format!("dropout_add_layer_norm rstd {what}");
        close(rstd, &gn.norm.rstd, &hn.norm.rstd, 1e-4, false);
    }
}

/// `layer_norm_backward_residual` (layer norm's backward, the shortcut's gradient added and
/// the branch's masked gradient, in two launches) against the host: dx and the branch's
/// gradient within 1e-5 (f32) or 1e-2 (16-bit) relative, dgamma and dbeta relative to the
/// largest value; the branch's gradient also bit for bit `dropout_add_backward` of the GPU's
/// own dx (the same mask, the same roundings). Not yet run on a GPU.
#[test]
fn layer_norm_backward_residual_matches_the_host() {
    let Some(gpu) = gpu() else { return };
    let host = Device::host(1 << 30);
    let pairs = [
        (DType::F32, DType::F32),
        (DType::F32, DType::F16),
        (DType::F32, DType::BF16),
        (DType::F16, DType::F16),
        (DType::BF16, DType::BF16),
    ];
    let (p, seed, offset) = (0.1, 0x5eed, 1 << 33);
    for (r, b) in pairs {
        let what = format!("{r:?}+{b:?}");
        let tol = if r == DType::F32 { 1e-5 } else { 1e-2 };
        let (rows, d) = (257, 768);
        let t = |dev: &Device, n: usize, shape: &[usize], seed, dt| {
            Tensor::from_f32_slice(dev, shape, &values(n, seed, -3.0, 3.0), dt).unwrap()
        };
        let branch = ops::ResidualBranch { dtype: b, p, seed, offset };
        // The statistics of the host's forward on both devices: only the backward compared.
        let (hx, hg) = (t(&host, rows * d, &[rows, d], 4, r), t(&host, d, &[d], 6, r));
        let fwd = ops::layer_norm(&hx, &hg, &t(&host, d, &[d], 7, r), 1e-5).unwrap();
        let run = |dev: &Device| {
            let (x, g) = (t(dev, rows * d, &[rows, d], 4, r), t(dev, d, &[d], 6, r));
            let (mean, rstd) = (fwd.mean.to_device(dev).unwrap(), fwd.rstd.to_device(dev).unwrap());
            let dy = t(dev, rows * d, &[rows, d], 8, r);
            let dres = t(dev, rows * d, &[rows, d], 9, r);
            ops::layer_norm_backward_residual(&x, &g, &mean, &rstd, &dy, &dres, Some(branch))
                .unwrap()
        };
        let (h, g) = (run(&host), run(&gpu));
        close(&format!("layer_norm_backward_residual dx {what}"), &g.dx, &h.dx, tol, false);
        let sums = if r == DType::F32 { 1e-4 } else { 2e-2 };
        close(&format!("dgamma {what}"), &g.dgamma, &h.dgamma, sums, true);
        close(&format!("dbeta {what}"), &g.dbeta, &h.dbeta, sums, true);
        let (gd, hd) = (g.dbranch.unwrap(), h.dbranch.unwrap());
        close(&format!("layer_norm_backward_residual branch {what}"), &gd, &hd, tol, false);
        let own = ops::dropout_add_backward(&g.dx, b, p, seed, offset).unwrap();
        close(&format!("branch of the GPU's dx {what}"), &gd, &own, 0.0, false);
    }
}

/// `linear_act` (cuBLASLt's `GELU_AUX_BIAS` / `GELU_BIAS` / `BIAS` epilogues, and `BGRADB`
/// for the bias gradient backward) against the host's unfused ops. Products and sums are
/// compared relative to the largest value: f32 within 1e-4 (2e-2 with TF32 allowed), 16-bit
/// within 2e-2 (cuBLASLt applies GELU to the f32 sum before rounding; the host to the
/// rounded pre-activation). Shapes: GPT-2's fc1 (out a multiple of 8: the kept
/// pre-activation's path) and odd sizes (out = 30: the kept pre-activation falls back to
/// cuBLAS and the GELU kernel).
#[test]
fn linear_act_matches_the_host() {
    let Some(gpu) = gpu() else { return };
    let host = Device::host(1 << 30);
    assert_eq!(gpu.linear_path(), vram_kernels::LinearPath::CublasLt, "libcublasLt loads");
    let gelu = Some(ops::LinearActivation::Gelu);
    for (dtype, tf32) in
        [(DType::F32, false), (DType::F32, true), (DType::F16, false), (DType::BF16, false)]
    {
        gpu.set_allow_tf32_matmul(tf32);
        let tol = match (dtype, tf32) {
            (DType::F32, false) => 1e-4,
            _ => 2e-2,
        };
        for (rows, d_in, d_out) in [(256, 768, 3072), (37, 50, 30), (5, 8, 16)] {
            for (with_bias, act) in [(true, gelu), (false, gelu), (true, None)] {
                let what =
                    format!("{dtype:?} tf32 {tf32} {rows}x{d_in}->{d_out} {with_bias} {act:?}");
                let t = |dev: &Device, shape: &[usize], seed| {
                    let n = shape.iter().product();
                    Tensor::from_f32_slice(dev, shape, &values(n, seed, -1.0, 1.0), dtype).unwrap()
                };
                let run = |dev: &Device| {
                    let x = t(dev, &[rows, d_in], 1);
                    let w = t(dev, &[d_out, d_in], 2);
                    let b = with_bias.then(|| t(dev, &[d_out], 3));
                    let dy = t(dev, &[rows, d_out], 4);
                    let kept = ops::linear_act(&x, &w, b.as_ref(), act, true).unwrap();
                    let eval = ops::linear_act(&x, &w, b.as_ref(), act, false).unwrap();
                    let pre = kept.pre.as_ref().map(|p| p.to_f32_vec().unwrap());
                    let g = ops::linear_act_backward(&x, &w, kept.pre, dy, act, with_bias);
                    (kept.y, eval.y, pre, g.unwrap())
                };
                let (hy, hy_eval, hpre, hg) = run(&host);
                let fallbacks = gpu.cublaslt_fallbacks();
                let (gy, gy_eval, gpre, gg) = run(&gpu);
                if dtype == DType::BF16 && d_out == 3072 {
                    // GPT-2's fc1 in bf16: the epilogues llm.c runs (GELU_AUX_BIAS, BIAS,
                    // BGRADB) must have found an algorithm, not fallen back.
                    assert_eq!(gpu.cublaslt_fallbacks(), fallbacks, "{what}: ran unfused");
                }
                close(&format!("{what}: y"), &gy, &hy, tol, true);
                close(&format!("{what}: y, nothing kept"), &gy_eval, &hy_eval, tol, true);
                if let (Some(g), Some(h)) = (gpre, hpre) {
                    let top = h.iter().fold(0.0f32, |a, v| a.max(v.abs())).max(1.0);
                    for (i, (g, h)) in g.iter().zip(&h).enumerate() {
                        assert!((g - h).abs() <= tol * top, "{what}: pre {i}: cuda {g}, host {h}");
                    }
                }
                close(&format!("{what}: dx"), &gg.dx, &hg.dx, tol, true);
                close(&format!("{what}: dw"), &gg.dw, &hg.dw, tol, true);
                if let (Some(g), Some(h)) = (&gg.dbias, &hg.dbias) {
                    close(&format!("{what}: dbias"), g, h, tol, true);
                }
            }
        }
    }
    gpu.set_allow_tf32_matmul(false);
    let _ = writeln!(
        std::io::stderr(),
        "linear_act: {} product(s) ran unfused (no cuBLASLt algorithm)",
        gpu.cublaslt_fallbacks()
    );
}

/// `linear_backward_gelu` (cuBLASLt's `DGELU_BGRAD` for the gradient of the GELU's input
/// and the first layer's bias gradient, `BGRADB` for this layer's) against the host's
/// unfused ops; tolerances as `linear_act_matches_the_host`. GPT-2's fc2 (in = 3072) and an
/// odd width (in = 30: the unfused path).
#[test]
fn linear_backward_gelu_matches_the_host() {
    let Some(gpu) = gpu() else { return };
    let host = Device::host(1 << 30);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let tol = if dtype == DType::F32 { 1e-4 } else { 2e-2 };
        for (rows, d_in, d_out) in [(256, 3072, 768), (37, 30, 50)] {
            let what = format!("{dtype:?} {rows}x{d_in}->{d_out}");
            let t = |dev: &Device, shape: &[usize], seed| {
                let n = shape.iter().product();
                Tensor::from_f32_slice(dev, shape, &values(n, seed, -1.0, 1.0), dtype).unwrap()
            };
            let run = |dev: &Device| {
                let pre = t(dev, &[rows, d_in], 1);
                let x = ops::gelu(&pre).unwrap();
                let w = t(dev, &[d_out, d_in], 2);
                let dy = t(dev, &[rows, d_out], 3);
                ops::linear_backward_gelu(&x, &w, &dy, true, &pre).unwrap()
            };
            let fallbacks = gpu.cublaslt_fallbacks();
            let (h, g) = (run(&host), run(&gpu));
            if dtype == DType::BF16 && d_in == 3072 {
                assert_eq!(gpu.cublaslt_fallbacks(), fallbacks, "{what}: ran unfused");
            }
            close(&format!("{what}: dpre"), &g.dpre, &h.dpre, tol, true);
            close(&format!("{what}: dw"), &g.dw, &h.dw, tol, true);
            close(
                &format!("{what}: dbias"),
                g.dbias.as_ref().unwrap(),
                h.dbias.as_ref().unwrap(),
                tol,
                true,
            );
            close(&format!("{what}: dpre_bias"), &g.dpre_bias, &h.dpre_bias, tol, true);
        }
    }
}
