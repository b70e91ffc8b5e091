//! The fused LM head and loss (`ops::linear_cross_entropy`) against the plain path
//! (`linear`, `cross_entropy`, `cross_entropy_backward`, `linear_backward`): the loss and
//! both gradients, in every dtype and chunking; its memory at GPT-2 small's size on a
//! virtual device against the plain path's; the same allocations on the host, a virtual
//! device and a GPU where one opens.

use proptest::prelude::*;
use std::io::Write as _;
use vram_kernels::ops::{self, LinearCrossEntropyParams, LossChunk};
use vram_kernels::{DType, Device, Error, Result, Tensor, TraceAction};

const BLAS_WORKSPACE: usize = 4 << 20;

/// Deterministic values in about [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Loss and gradients of the plain path on `hidden`'s values widened to f32 (exact).
fn plain(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &[u32],
    ignore: Option<u32>,
    dloss: f32,
) -> (f32, Vec<f32>, Vec<f32>) {
    let d = hidden.device();
    let h = Tensor::from_f32_slice(d, hidden.shape(), &hidden.to_f32_vec().unwrap(), DType::F32);
    let w = Tensor::from_f32_slice(d, weight.shape(), &weight.to_f32_vec().unwrap(), DType::F32);
    let (h, w) = (h.unwrap(), w.unwrap());
    let logits = ops::linear(&h, &w, None).unwrap();
    let ce = ops::cross_entropy(&logits, targets, ignore).unwrap();
    let dl = ops::cross_entropy_backward(&logits, targets, ignore, &ce.lse, dloss).unwrap();
    let g = ops::linear_backward(&h, &w, &dl, false).unwrap();
    (ce.loss, g.dx.to_f32_vec().unwrap(), g.dw.to_f32_vec().unwrap())
}

/// Each element of `got` within `rel` of `want`'s, with an absolute floor of `rel` times
/// the largest magnitude of `want`.
fn close(
    what: &str,
    got: &[f32],
    want: &[f32],
    rel: f32,
) -> std::result::Result<(), TestCaseError> {
    prop_assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        prop_assert!(
            (g - w).abs() <= rel * w.abs().max(scale),
            "{}[{}]: got {}, want {}",
            what,
            i,
            g,
            w
        );
    }
    Ok(())
}

/// A case: rows, width, vocabulary, targets (some ignored), rows per chunk, dloss.
fn case() -> impl Strategy<Value = (usize, usize, usize, Vec<u32>, usize, f32)> {
    (1usize..40, 1usize..24, 2usize..70).prop_flat_map(|(n, d, v)| {
        let target = prop_oneof![5 => 0..v as u32, 1 => Just(IGNORE)];
        (
            Just(n),
            Just(d),
            Just(v),
            prop::collection::vec(target, n),
            prop_oneof![Just(1usize), 1..n + 3, Just(n), Just(n + 5)],
            prop_oneof![Just(1.0f32), 0.25f32..1024.0],
        )
    })
}

const IGNORE: u32 = 1_000_000;

fn check(
    (dtype, gw_dtype): (DType, DType),
    (n, d, v): (usize, usize, usize),
    targets: &[u32],
    chunk: usize,
    dloss: f32,
    rel: f32,
) -> std::result::Result<(), TestCaseError> {
    let dev = Device::host(256 << 20);
    let h = Tensor::from_f32_slice(&dev, &[n, d], &values(n * d, n as u64), dtype).unwrap();
    let w = Tensor::from_f32_slice(&dev, &[v, d], &values(v * d, 3 + v as u64), dtype).unwrap();
    let params = LinearCrossEntropyParams::default()
        .ignore_index(Some(IGNORE))
        .dloss(dloss)
        .chunk(LossChunk::Rows(chunk))
        .grad_weight_dtype(gw_dtype);
    let fused = ops::linear_cross_entropy(&h, &w, targets, &params).unwrap();
    prop_assert_eq!(fused.grad_hidden.shape(), h.shape());
    prop_assert_eq!(fused.grad_weight.shape(), w.shape());
    prop_assert_eq!(fused.grad_hidden.dtype(), dtype);
    prop_assert_eq!(fused.grad_weight.dtype(), gw_dtype);
    let (loss, dx, dw) = plain(&h, &w, targets, Some(IGNORE), dloss);
    if targets.iter().all(|&t| t == IGNORE) {
        prop_assert!(loss.is_nan() && fused.loss.is_nan());
        prop_assert!(fused.grad_hidden.to_f32_vec().unwrap().iter().all(|&g| g == 0.0));
        prop_assert!(fused.grad_weight.to_f32_vec().unwrap().iter().all(|&g| g == 0.0));
        return Ok(());
    }
    close("loss", &[fused.loss], &[loss], rel.min(1e-5))?;
    close("grad_hidden", &fused.grad_hidden.to_f32_vec().unwrap(), &dx, rel)?;
    close("grad_weight", &fused.grad_weight.to_f32_vec().unwrap(), &dw, rel)?;
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    // The fused loss and its gradients are the plain path's, whatever the chunking (one
    // row, not dividing the rows, all rows and more), with ignored rows left out of the
    // mean over all chunks, for any upstream gradient; in 16 bits within the rounding of
    // the gradients to the storage dtype (the reference computes from the same rounded
    // operands in f32).
    #[test]
    fn fused_matches_plain_in_every_chunking((n, d, v, t, chunk, dloss) in case()) {
        check((DType::F32, DType::F32), (n, d, v), &t, chunk, dloss, 1e-5)?;
        check((DType::BF16, DType::BF16), (n, d, v), &t, chunk, dloss, 3e-2)?;
        check((DType::F16, DType::F16), (n, d, v), &t, chunk, dloss, 4e-3)?;
        // The weight's gradient in f32 from 16-bit operands: the accumulator, not rounded.
        check((DType::BF16, DType::F32), (n, d, v), &t, chunk, dloss, 3e-2)?;
        check((DType::F16, DType::F32), (n, d, v), &t, chunk, dloss, 4e-3)?;
    }
}

#[test]
fn leading_dimensions_are_rows_and_the_auto_chunk_is_ligers_rule() {
    let dev = Device::host(64 << 20);
    let h = Tensor::from_f32_slice(&dev, &[3, 5, 8], &values(120, 1), DType::F32).unwrap();
    let w = Tensor::from_f32_slice(&dev, &[33, 8], &values(264, 2), DType::F32).unwrap();
    let t: Vec<u32> = (0..15).map(|i| i * 5 % 33).collect();
    let fused = ops::linear_cross_entropy(&h, &w, &t, &Default::default()).unwrap();
    assert_eq!(fused.grad_hidden.shape(), &[3, 5, 8]);
    let h2 = h.clone().reshape(&[15, 8]).unwrap();
    let (loss, dx, _) = plain(&h2, &w, &t, None, 1.0);
    assert!((fused.loss - loss).abs() <= 1e-5 * loss.abs());
    let got = fused.grad_hidden.to_f32_vec().unwrap();
    assert!(got.iter().zip(&dx).all(|(g, w)| (g - w).abs() <= 1e-5));

    // Liger: inc_factor = ceil(50257 / 768) = 66, next_power_of_2(ceil(8192 / 66)) = 128.
    let p = LinearCrossEntropyParams::default();
    assert_eq!(p.chunk_rows(8192, 50257, 768, DType::BF16), 128);
    assert_eq!(p.chunk_rows(7, 50257, 768, DType::F32), 1);
    assert_eq!(p.chunk_rows(100, 10, 768, DType::F32), 100, "a vocabulary narrower than d");
    assert_eq!(p.chunk_rows(0, 10, 4, DType::F32), 1);
    // A byte budget: the f32 logits (and a 16-bit copy of their gradient) per row.
    assert_eq!(ops::chunk_bytes_per_row(1000, DType::F32), 4000);
    assert_eq!(ops::chunk_bytes_per_row(1000, DType::BF16), 6000);
    let budget = p.chunk(LossChunk::Bytes(64 << 20));
    assert_eq!(budget.chunk_rows(8192, 50257, 768, DType::F32), (64 << 20) / (50257 * 4));
    assert_eq!(budget.chunk_rows(8192, 50257, 768, DType::BF16), (64 << 20) / (50257 * 6));
    assert_eq!(p.chunk(LossChunk::Bytes(10)).chunk_rows(50, 1000, 8, DType::F32), 1);
    assert_eq!(p.chunk(LossChunk::Rows(0)).chunk_rows(50, 1000, 8, DType::F32), 1);
    assert_eq!(p.chunk(LossChunk::Rows(500)).chunk_rows(50, 1000, 8, DType::F32), 50);
}

#[test]
fn bad_operands_are_errors_and_allocate_nothing() {
    let dev = Device::host(64 << 20);
    let h = Tensor::from_f32_slice(&dev, &[4, 8], &values(32, 1), DType::F32).unwrap();
    let w = Tensor::from_f32_slice(&dev, &[10, 8], &values(80, 2), DType::F32).unwrap();
    let w7 = Tensor::from_f32_slice(&dev, &[10, 7], &values(70, 2), DType::F32).unwrap();
    let w16 = Tensor::from_f32_slice(&dev, &[10, 8], &values(80, 2), DType::BF16).unwrap();
    let p = LinearCrossEntropyParams::default();
    let held = dev.memory_allocated();
    let lce = |h: &Tensor, w: &Tensor, t: &[u32], p: &LinearCrossEntropyParams| {
        ops::linear_cross_entropy(h, w, t, p).unwrap_err()
    };
    assert!(matches!(lce(&h, &w7, &[0; 4], &p), Error::ShapeMismatch { .. }));
    assert!(matches!(lce(&h, &w, &[0; 3], &p), Error::ShapeMismatch { .. }));
    assert!(matches!(lce(&h, &w16, &[0; 4], &p), Error::DTypeMismatch { .. }));
    let err = lce(&h, &w, &[0, 1, 10, 2], &p);
    assert!(matches!(err, Error::IndexOutOfRange { index: 10, bound: 10, .. }), "{err}");
    // The ignore index may lie outside the vocabulary.
    let ok = ops::linear_cross_entropy(&h, &w, &[0, 1, 10, 2], &p.ignore_index(Some(10)));
    assert!(ok.unwrap().loss.is_finite());
    assert_eq!(dev.memory_allocated(), held);
    // No rows: a NaN loss (the mean of nothing) and zero gradients.
    let empty = Tensor::zeros(&dev, &[0, 8], DType::F32).unwrap();
    let out = ops::linear_cross_entropy(&empty, &w, &[], &p).unwrap();
    assert!(out.loss.is_nan());
    assert_eq!(out.grad_hidden.shape(), &[0, 8]);
    assert!(out.grad_weight.to_f32_vec().unwrap().iter().all(|&g| g == 0.0));
}

#[test]
fn a_chunk_buffer_that_does_not_fit_is_halved_and_the_loss_stays_exact() {
    // 2048 rows, vocab 4000: the whole batch as one chunk wants 2048 * 16000 B = 31.3 MiB;
    // in 24 MiB (the operands, outputs, small workspaces and a 512 KiB cuBLAS workspace
    // share one 2 MiB segment) it gets half the rows, and the same results.
    let (n, d, v) = (2048, 16, 4000);
    let targets: Vec<u32> = (0..n).map(|i| (i * 37 % v) as u32).collect();
    let run = |dev: &Device| {
        dev.set_blas_workspace_size(512 << 10);
        let h = Tensor::from_f32_slice(dev, &[n, d], &values(n * d, 5), DType::F32).unwrap();
        let w = Tensor::from_f32_slice(dev, &[v, d], &values(v * d, 6), DType::F32).unwrap();
        let p = LinearCrossEntropyParams::default().chunk(LossChunk::Rows(n));
        let before = dev.memory_stats().num_ooms;
        let out = ops::linear_cross_entropy(&h, &w, &targets, &p).unwrap();
        let ooms = dev.memory_stats().num_ooms - before;
        (
            out.loss,
            out.grad_hidden.to_f32_vec().unwrap(),
            out.grad_weight.to_f32_vec().unwrap(),
            ooms,
        )
    };
    let (loss, dx, dw, ooms) = run(&Device::host(1 << 30));
    assert_eq!(ooms, 0);
    let (small_loss, small_dx, small_dw, small_ooms) = run(&Device::host(24 << 20));
    assert!(small_ooms > 0, "the whole chunk should not have fit");
    assert_eq!(small_loss, loss, "the per-row losses are summed in row order whatever the chunk");
    assert_eq!(small_dx, dx, "each row's gradient is the chunk's");
    let tol = dw.iter().fold(0.0f32, |m, v| m.max(v.abs())) * 1e-5;
    assert!(small_dw.iter().zip(&dw).all(|(a, b)| (a - b).abs() <= tol));
}

/// A host, a virtual and (where one opens) a CUDA device.
fn devices() -> Vec<Device> {
    let mut devices = vec![Device::host(1 << 30), Device::virtual_device(1 << 30)];
    match Device::cuda(0) {
        Ok(gpu) => devices.push(gpu),
        Err(e) => {
            let _ =
                writeln!(std::io::stderr(), "skipped: no CUDA device ({e}); host and virtual only");
        }
    }
    for d in &devices {
        d.set_blas_workspace_size(BLAS_WORKSPACE);
    }
    devices
}

type Entry = (TraceAction, usize, usize, u64);

fn traced<T>(d: &Device, f: impl FnOnce() -> Result<T>) -> Vec<Entry> {
    d.record_history(Some(1 << 20));
    let out = f();
    if let Err(e) = &out {
        panic!("{} failed: {e}", d.name());
    }
    drop(out);
    let trace = d.trace();
    d.record_history(None);
    trace.iter().map(|e| (e.action, e.size, e.requested, e.stream)).collect()
}

#[test]
fn every_device_allocates_alike() {
    for (dtype, gw_dtype) in
        [(DType::F32, DType::F32), (DType::BF16, DType::BF16), (DType::BF16, DType::F32)]
    {
        for chunk in [LossChunk::Auto, LossChunk::Rows(7), LossChunk::Rows(1000)] {
            let (n, d, v) = (300, 24, 1001);
            let targets: Vec<u32> = (0..n).map(|i| (i * 13 % v) as u32).collect();
            let case = |dev: &Device| {
                let h = Tensor::from_f32_slice(dev, &[n, d], &values(n * d, 1), dtype).unwrap();
                let w = Tensor::from_f32_slice(dev, &[v, d], &values(v * d, 2), dtype).unwrap();
                let p = LinearCrossEntropyParams::default()
                    .chunk(chunk)
                    .ignore_index(Some(3))
                    .grad_weight_dtype(gw_dtype);
                traced(dev, || ops::linear_cross_entropy(&h, &w, &targets, &p))
            };
            let devices = devices();
            let want = case(&devices[0]);
            assert!(!want.is_empty());
            for dev in &devices[1..] {
                assert_eq!(
                    case(dev),
                    want,
                    "{dtype:?} {gw_dtype:?} {chunk:?}: {} against the host",
                    dev.name()
                );
            }
        }
    }
}

/// `t` in `dtype`, the original dropped (a model's cast of a value it no longer needs).
fn into_dtype(t: Tensor, dtype: DType) -> Tensor {
    if t.dtype() == dtype { t } else { t.to_dtype(dtype).unwrap() }
}

/// Peak bytes above what was allocated before `f` ran, on `dev`.
fn peak_of<T>(dev: &Device, f: impl FnOnce() -> T) -> u64 {
    let base = dev.memory_allocated();
    dev.reset_peak_stats();
    drop(f());
    dev.max_memory_allocated() - base
}

/// GPT-2 small's head at 8 x 1024 tokens, on a virtual device: the plain path holds the
/// whole logits and their gradient (3.07 GiB in f32); the fused op holds the gradients of
/// hidden and weight, the f32 weight-gradient accumulator for a 16-bit gradient, one chunk
/// and per-row vectors.
#[test]
fn gpt2_small_head_peak_is_far_below_the_plain_path() {
    let (n, d, v) = (8192usize, 768usize, 50257usize);
    let targets: Vec<u32> = (0..n).map(|i| (i * 7919 % v) as u32).collect();
    let mut report = String::new();
    let configs = [(DType::F32, DType::F32), (DType::BF16, DType::BF16), (DType::BF16, DType::F32)];
    for (dtype, gw_dtype) in configs {
        let dev = Device::virtual_device(80 << 30);
        let h = Tensor::zeros(&dev, &[n, d], dtype).unwrap();
        let w = Tensor::zeros(&dev, &[v, d], dtype).unwrap();
        let plain = peak_of(&dev, || {
            // As a model does it: the logits in the compute dtype, the loss in f32.
            let logits = ops::linear(&h, &w, None).unwrap();
            let logits = into_dtype(logits, DType::F32);
            let ce = ops::cross_entropy(&logits, &targets, None).unwrap();
            let dl = ops::cross_entropy_backward(&logits, &targets, None, &ce.lse, 1.0).unwrap();
            drop((logits, ce));
            let dl = into_dtype(dl, dtype);
            ops::linear_backward(&h, &w, &dl, false).unwrap()
        });
        let what = format!("{dtype:?} (weight gradient {gw_dtype:?})");
        let p = LinearCrossEntropyParams::default().grad_weight_dtype(gw_dtype);
        let fused = peak_of(&dev, || ops::linear_cross_entropy(&h, &w, &targets, &p).unwrap());
        let hidden = (n * d * dtype.size_in_bytes()) as u64;
        let weight = (v * d * gw_dtype.size_in_bytes()) as u64;
        let acc = if gw_dtype == DType::F32 { 0 } else { (v * d * 4) as u64 };
        let rows = p.chunk_rows(n, v, d, dtype);
        assert_eq!(rows, 128);
        let chunk = (rows * ops::chunk_bytes_per_row(v, dtype)) as u64;
        // Per-row targets, lse and losses, the sum's partials, block rounding.
        let slack = 4 << 20;
        let bound = hidden + weight + acc + chunk + slack;
        assert!(fused <= bound, "{what}: fused peak {fused} above {bound}");
        assert!(fused >= hidden + weight + acc + chunk, "{what}: fused peak {fused}");
        let logits = (n * v * 4) as u64;
        assert!(plain >= 2 * logits, "{what}: plain peak {plain}");
        assert!(fused * 8 < plain, "{what}: fused {fused} against plain {plain}");
        report += &format!(
            "{what}: plain {plain} B ({:.2} GiB), fused {fused} B ({:.1} MiB), chunk {rows} rows\n",
            plain as f64 / f64::from(1 << 30),
            fused as f64 / f64::from(1 << 20)
        );
    }
    let _ = writeln!(std::io::stderr(), "{report}");
}

/// On a GPU (skipped without one): the CUDA path against the host's, every dtype, several
/// chunkings, ignored rows and a loss scale; and GPT-2 small's head at 8192 tokens, whose
/// peak equals the virtual device's to the byte.
#[test]
fn cuda_matches_the_host() {
    let gpu = match Device::cuda(0) {
        Ok(gpu) => gpu,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "skipped: no CUDA device ({e})");
            return;
        }
    };
    let host = Device::host(1 << 30);
    let (n, d, v) = (300, 64, 5003);
    let targets: Vec<u32> =
        (0..n).map(|i| if i % 11 == 4 { 7 } else { (i * 7919 % v) as u32 }).collect();
    for (dtype, tol) in [(DType::F32, 1e-4f32), (DType::BF16, 2e-2), (DType::F16, 4e-3)] {
        for chunk in [LossChunk::Auto, LossChunk::Rows(1), LossChunk::Rows(37), LossChunk::Rows(n)]
        {
            let p =
                LinearCrossEntropyParams::default().chunk(chunk).ignore_index(Some(7)).dloss(256.0);
            let run = |dev: &Device| {
                let h = Tensor::from_f32_slice(dev, &[n, d], &values(n * d, 1), dtype).unwrap();
                let w = Tensor::from_f32_slice(dev, &[v, d], &values(v * d, 2), dtype).unwrap();
                let out = ops::linear_cross_entropy(&h, &w, &targets, &p).unwrap();
                (
                    out.loss,
                    out.grad_hidden.to_f32_vec().unwrap(),
                    out.grad_weight.to_f32_vec().unwrap(),
                )
            };
            let (want, got) = (run(&host), run(&gpu));
            let what = format!("{dtype:?} {chunk:?}");
            assert!(
                (got.0 - want.0).abs() <= 1e-4 * want.0.abs(),
                "{what}: loss {} against {}",
                got.0,
                want.0
            );
            for (name, g, w) in [("grad_hidden", &got.1, &want.1), ("grad_weight", &got.2, &want.2)]
            {
                let max = w.iter().fold(1e-12f32, |m, x| m.max(x.abs()));
                for (i, (a, b)) in g.iter().zip(w).enumerate() {
                    assert!((a - b).abs() <= tol * max, "{what} {name}[{i}]: {a} against {b}");
                }
            }
        }
    }
    let (n, d, v) = (8192usize, 768usize, 50257usize);
    let targets: Vec<u32> = (0..n).map(|i| (i * 7919 % v) as u32).collect();
    let virt = Device::virtual_device(80 << 30);
    virt.set_blas_workspace_size(gpu.blas_workspace_size());
    let peak = |dev: &Device| {
        let h = Tensor::zeros(dev, &[n, d], DType::BF16).unwrap();
        let w = Tensor::zeros(dev, &[v, d], DType::BF16).unwrap();
        let p = LinearCrossEntropyParams::default();
        let start = std::time::Instant::now();
        let bytes = peak_of(dev, || ops::linear_cross_entropy(&h, &w, &targets, &p).unwrap());
        (bytes, start.elapsed())
    };
    // The GPU made its cuBLAS workspace above; the virtual device makes it on a first run.
    peak(&virt);
    let ((want, _), (got, time)) = (peak(&virt), peak(&gpu));
    let _ =
        writeln!(std::io::stderr(), "GPT-2 small head on {}: peak {got} B, {time:?}", gpu.name());
    assert_eq!(got, want, "the GPU's peak against the virtual device's");
}
