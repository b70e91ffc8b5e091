//! Channels_last batch norm (`batch_norm_nhwc`, `batch_norm_eval_nhwc`,
//! `batch_norm_backward_nhwc`, `x: [n, h, w, c]`) against the NCHW ops on the permuted input:
//! on the host bit for bit (each channel's sums accumulate in the same order, images then
//! positions), in every dtype with parameters in `x`'s dtype and in f32, with and without
//! running statistics, on fixed shapes and a property test over shapes; the refusals; out of
//! memory at every point of the ops leaving the running statistics and the inputs intact;
//! the same allocations on the host and the virtual device, and exactly the NCHW op's (no
//! permute copies); and, where a GPU is, the own kernels and cuDNN against the host (these
//! print `skipped: no CUDA device (...)` or `skipped: no cuDNN (...)` and pass otherwise:
//! they have not yet run on a GPU).

use proptest::prelude::*;
use std::io::Write as _;
use vram_kernels::ops::{self, RunningStats};
use vram_kernels::{ConvBackend, ConvPath, DType, Device, Tensor, TraceAction};

const EPS: f32 = 1e-5;
const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];
const TO_NCHW: [usize; 4] = [0, 3, 1, 2];
const TO_NHWC: [usize; 4] = [0, 2, 3, 1];

fn host() -> Device {
    static HOST: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
    HOST.get_or_init(|| Device::host(1 << 30)).clone()
}

/// Deterministic values in `[lo, hi)`.
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

fn tensor(d: &Device, shape: &[usize], seed: u64, lo: f32, hi: f32, dtype: DType) -> Tensor {
    let v = values(shape.iter().product(), seed, lo, hi);
    Tensor::from_f32_slice(d, shape, &v, dtype).unwrap()
}

/// The stored bits of `t`'s values, widened exactly to f32 (so `==` is bit equality for
/// every dtype; no NaN is compared).
fn bits(t: &Tensor) -> Vec<u32> {
    t.to_f32_vec().unwrap().into_iter().map(f32::to_bits).collect()
}

fn same(what: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    assert!(bits(got) == bits(want), "{what}: not bit-identical");
}

/// One training forward (with or without running statistics), an evaluation and a backward
/// of `x: [n, h, w, c]` through the NHWC ops and through the NCHW ops on the permuted
/// tensors: every result bit-identical.
fn check_against_nchw(shape: [usize; 4], dtype: DType, pdtype: DType, with_running: bool) {
    let d = host();
    let c = shape[3];
    let what = format!("{shape:?} {dtype:?} params {pdtype:?} running {with_running}");
    let x = tensor(&d, &shape, 1, -3.0, 5.0, dtype);
    let dy = tensor(&d, &shape, 2, -1.0, 1.0, dtype);
    let g = tensor(&d, &[c], 3, 0.5, 2.0, pdtype);
    let b = tensor(&d, &[c], 4, -1.0, 1.0, pdtype);
    let (xc, dyc) = (ops::permute(&x, &TO_NCHW).unwrap(), ops::permute(&dy, &TO_NCHW).unwrap());
    let stats = || (tensor(&d, &[c], 5, -0.5, 0.5, pdtype), tensor(&d, &[c], 6, 0.5, 2.0, pdtype));
    let ((mut m1, mut v1), (mut m2, mut v2)) = (stats(), stats());
    let run = |m, v| RunningStats { mean: m, var: v, momentum: 0.1 };
    let (got, want) = if with_running {
        (
            ops::batch_norm_nhwc(&x, &g, &b, Some(run(&mut m1, &mut v1)), EPS).unwrap(),
            ops::batch_norm(&xc, &g, &b, Some(run(&mut m2, &mut v2)), EPS).unwrap(),
        )
    } else {
        (
            ops::batch_norm_nhwc(&x, &g, &b, None, EPS).unwrap(),
            ops::batch_norm(&xc, &g, &b, None, EPS).unwrap(),
        )
    };
    same(&format!("{what} y"), &got.y, &ops::permute(&want.y, &TO_NHWC).unwrap());
    same(&format!("{what} mean"), &got.mean, &want.mean);
    same(&format!("{what} invstd"), &got.invstd, &want.invstd);
    same(&format!("{what} running mean"), &m1, &m2);
    same(&format!("{what} running var"), &v1, &v2);

    let ye = ops::batch_norm_eval_nhwc(&x, &g, &b, &m1, &v1, EPS).unwrap();
    let we = ops::batch_norm_eval(&xc, &g, &b, &m2, &v2, EPS).unwrap();
    same(&format!("{what} eval y"), &ye, &ops::permute(&we, &TO_NHWC).unwrap());

    let gg = ops::batch_norm_backward_nhwc(&x, &g, &got.mean, &got.invstd, &dy, EPS).unwrap();
    let wg = ops::batch_norm_backward(&xc, &g, &want.mean, &want.invstd, &dyc, EPS).unwrap();
    same(&format!("{what} dx"), &gg.dx, &ops::permute(&wg.dx, &TO_NHWC).unwrap());
    same(&format!("{what} dgamma"), &gg.dgamma, &wg.dgamma);
    same(&format!("{what} dbeta"), &gg.dbeta, &wg.dbeta);
}

/// Odd sizes, one channel, two values per channel (`n * h * w = 2`, the fewest training
/// takes), many channels: every dtype, parameters in `x`'s dtype and in f32.
#[test]
fn nhwc_ops_equal_the_nchw_ops_on_the_permuted_input_bit_for_bit() {
    let shapes =
        [[3, 5, 7, 6], [2, 3, 3, 1], [1, 1, 2, 3], [2, 1, 1, 4], [1, 2, 1, 1], [4, 3, 2, 37]];
    for shape in shapes {
        for dtype in DTYPES {
            for pdtype in [dtype, DType::F32] {
                for with_running in [false, true] {
                    check_against_nchw(shape, dtype, pdtype, with_running);
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn nhwc_ops_equal_the_nchw_ops_over_shapes(
        n in 1usize..4, h in 1usize..6, w in 1usize..6, c in 1usize..40,
        dtype in prop::sample::select(DTYPES.to_vec()), pf32 in any::<bool>(),
        with_running in any::<bool>(),
    ) {
        prop_assume!(n * h * w >= 2);
        let pdtype = if pf32 { DType::F32 } else { dtype };
        check_against_nchw([n, h, w, c], dtype, pdtype, with_running);
    }
}

/// Bad input is an error naming what is wrong, never a panic; nothing is updated.
#[test]
fn bad_input_is_refused_and_changes_nothing() {
    let d = host();
    let x = tensor(&d, &[2, 3, 3, 4], 1, -1.0, 1.0, DType::F32);
    let p = |v: f32, n: usize, dtype| Tensor::from_f32_slice(&d, &[n], &vec![v; n], dtype).unwrap();
    let (g, b) = (p(1.0, 4, DType::F32), p(0.0, 4, DType::F32));
    let (mut rm, mut rv) = (p(0.0, 4, DType::F32), p(1.0, 4, DType::F32));
    let msg = |e: vram_kernels::Error| e.to_string();

    // Rank other than 4.
    for shape in [&[2, 3, 4][..], &[2, 3, 3, 4, 1], &[4]] {
        let bad = Tensor::zeros(&d, shape, DType::F32).unwrap();
        let e = msg(ops::batch_norm_nhwc(&bad, &g, &b, None, EPS).unwrap_err());
        assert!(e.contains("[batch, h, w, channels]") && e.contains("batch_norm_nhwc"), "{e}");
        let e = msg(ops::batch_norm_eval_nhwc(&bad, &g, &b, &rm, &rv, EPS).unwrap_err());
        assert!(e.contains("[batch, h, w, channels]"), "{e}");
        let e = msg(ops::batch_norm_backward_nhwc(&bad, &g, &rm, &rv, &bad, EPS).unwrap_err());
        assert!(e.contains("[batch, h, w, channels]"), "{e}");
    }
    // The channels are the last dimension: parameters of x's dim 1 are refused.
    let g3 = p(1.0, 3, DType::F32);
    assert!(ops::batch_norm_nhwc(&x, &g3, &g3, None, EPS).is_err());
    // Zero channels; one value per channel in training (evaluation takes it).
    let none = Tensor::zeros(&d, &[2, 3, 3, 0], DType::F32).unwrap();
    let e =
        msg(ops::batch_norm_nhwc(&none, &p(1.0, 0, DType::F32), &p(0.0, 0, DType::F32), None, EPS)
            .unwrap_err());
    assert!(e.contains("zero channels"), "{e}");
    let one = tensor(&d, &[1, 1, 1, 4], 9, -1.0, 1.0, DType::F32);
    let run = RunningStats { mean: &mut rm, var: &mut rv, momentum: 0.1 };
    let e = msg(ops::batch_norm_nhwc(&one, &g, &b, Some(run), EPS).unwrap_err());
    assert!(e.contains("more than 1 value per channel"), "{e}");
    assert!(ops::batch_norm_eval_nhwc(&one, &g, &b, &rm, &rv, EPS).is_ok());
    // Dtypes: f16 parameters for an f32 input; parameters of two dtypes; bf16 saved stats.
    let (g16, b16) = (p(1.0, 4, DType::F16), p(0.0, 4, DType::F16));
    let e = msg(ops::batch_norm_nhwc(&x, &g16, &b16, None, EPS).unwrap_err());
    assert!(e.contains("must be f32 or"), "{e}");
    assert!(ops::batch_norm_nhwc(&x, &g, &b16, None, EPS).is_err());
    let mut half = p(1.0, 4, DType::BF16);
    let run = RunningStats { mean: &mut rm, var: &mut half, momentum: 0.1 };
    assert!(
        ops::batch_norm_nhwc(&x, &g, &b, Some(run), EPS).is_err(),
        "running stats of two dtypes"
    );
    let e = msg(ops::batch_norm_eval_nhwc(&x, &g, &b, &rm, &half, EPS).unwrap_err());
    assert!(!e.is_empty());
    // eps and momentum.
    assert!(msg(ops::batch_norm_nhwc(&x, &g, &b, None, f32::NAN).unwrap_err()).contains("eps"));
    assert!(
        msg(ops::batch_norm_eval_nhwc(&x, &g, &b, &rm, &rv, -1.0).unwrap_err()).contains("eps")
    );
    let run = RunningStats { mean: &mut rm, var: &mut rv, momentum: -0.5 };
    assert!(
        msg(ops::batch_norm_nhwc(&x, &g, &b, Some(run), EPS).unwrap_err()).contains("momentum")
    );
    assert_eq!((rm.to_f32_vec().unwrap(), rv.to_f32_vec().unwrap()), (vec![0.0; 4], vec![1.0; 4]));
    // The backward: dy of another shape or dtype, saved statistics not f32 [c].
    let out = ops::batch_norm_nhwc(&x, &g, &b, None, EPS).unwrap();
    let dy_t = Tensor::zeros(&d, &[2, 3, 4, 3], DType::F32).unwrap();
    assert!(ops::batch_norm_backward_nhwc(&x, &g, &out.mean, &out.invstd, &dy_t, EPS).is_err());
    let dy_b = Tensor::zeros(&d, &[2, 3, 3, 4], DType::BF16).unwrap();
    assert!(ops::batch_norm_backward_nhwc(&x, &g, &out.mean, &out.invstd, &dy_b, EPS).is_err());
    let m16 = out.mean.to_dtype(DType::F16).unwrap();
    assert!(ops::batch_norm_backward_nhwc(&x, &g, &m16, &out.invstd, &out.y, EPS).is_err());
    // The forward's eps, which cuDNN's backward takes: checked as the forward checks it.
    let e = msg(ops::batch_norm_backward_nhwc(&x, &g, &out.mean, &out.invstd, &out.y, f32::NAN)
        .unwrap_err());
    assert!(e.contains("eps"), "{e}");
    let e = msg(ops::batch_norm_backward_nhwc(
        &x,
        &g,
        &p(0.0, 3, DType::F32),
        &out.invstd,
        &out.y,
        EPS,
    )
    .unwrap_err());
    assert!(!e.is_empty());
}

/// Caps `d`'s reserved memory at `extra` bytes above what it holds now (cache emptied).
fn cap(d: &Device, extra: u64) {
    d.empty_cache();
    let total = d.mem_info().total;
    d.set_memory_fraction(((d.memory_reserved() + extra) as f64 / total as f64).min(1.0)).unwrap();
}

/// Out of memory in the three ops, at capacities from what the inputs hold up to where the
/// op succeeds, in steps of 1 MiB (the running statistics shared with another tensor, so
/// that the forward first copies them, `make_unique`, and fails after that): the error says
/// so, and the running statistics and the inputs are as they were.
#[test]
fn out_of_memory_anywhere_leaves_running_statistics_and_inputs_intact() {
    // 6M values a tensor, 12 MB in bf16: each large tensor a segment of its own (below
    // 10 MB they would share 20 MiB segments, as PyTorch's allocator's).
    let shape = [2, 1000, 1000, 3];
    let d = Device::host(256 << 20);
    let x = tensor(&d, &shape, 1, -2.0, 2.0, DType::BF16);
    let dy = tensor(&d, &shape, 2, -1.0, 1.0, DType::BF16);
    let (g, b) =
        (tensor(&d, &[3], 3, 0.5, 2.0, DType::F32), tensor(&d, &[3], 4, -1.0, 1.0, DType::F32));
    let (mut rm, mut rv) =
        (tensor(&d, &[3], 5, -0.5, 0.5, DType::F32), tensor(&d, &[3], 6, 0.5, 2.0, DType::F32));
    let _shared = (rm.clone(), rv.clone());
    let before = [bits(&x), bits(&dy), bits(&rm), bits(&rv)];
    // The running statistics after every failure, the inputs after every sweep.
    let intact = |rm: &Tensor, rv: &Tensor, what: &str| {
        assert!([bits(rm), bits(rv)] == before[2..], "{what}: changed");
    };
    const STEP: u64 = 1 << 20;

    let mut fails = [0usize; 3];
    let mut out = None;
    for k in 0..64 {
        cap(&d, k * STEP);
        let run = RunningStats { mean: &mut rm, var: &mut rv, momentum: 0.1 };
        match ops::batch_norm_nhwc(&x, &g, &b, Some(run), EPS) {
            Ok(o) => {
                out = Some(o);
                break;
            }
            Err(e) => {
                assert!(e.is_out_of_memory(), "forward at +{k} steps: {e}");
                intact(&rm, &rv, &format!("forward at +{k} steps"));
                fails[0] += 1;
            }
        }
    }
    assert!([bits(&x), bits(&dy)] == before[..2], "the inputs changed");
    let out = out.expect("the forward fits at last");
    drop(out.y);
    let after = [bits(&x), bits(&dy), bits(&rm), bits(&rv)];
    assert!(after[2] != before[2], "the forward updated the running mean");
    let unchanged = |rm: &Tensor, rv: &Tensor, what: &str| {
        assert!([bits(rm), bits(rv)] == after[2..], "{what}: changed");
    };
    for k in 0..64 {
        cap(&d, k * STEP);
        match ops::batch_norm_backward_nhwc(&x, &g, &out.mean, &out.invstd, &dy, EPS) {
            Ok(_) => break,
            Err(e) => {
                assert!(e.is_out_of_memory(), "backward at +{k} steps: {e}");
                unchanged(&rm, &rv, &format!("backward at +{k} steps"));
                fails[1] += 1;
            }
        }
    }
    for k in 0..64 {
        cap(&d, k * STEP);
        match ops::batch_norm_eval_nhwc(&x, &g, &b, &rm, &rv, EPS) {
            Ok(_) => break,
            Err(e) => {
                assert!(e.is_out_of_memory(), "evaluation at +{k} steps: {e}");
                unchanged(&rm, &rv, &format!("evaluation at +{k} steps"));
                fails[2] += 1;
            }
        }
    }
    d.set_memory_fraction(1.0).unwrap();
    assert!([bits(&x), bits(&dy)] == before[..2], "the inputs changed");
    assert!(fails.iter().all(|&f| f > 0), "every op failed first: {fails:?}");
}

type Entry = (TraceAction, usize, usize, u64);

/// The allocator actions of `f` on `d`, its results dropped at the end.
fn traced<T>(d: &Device, f: impl FnOnce() -> vram_kernels::Result<T>) -> Vec<Entry> {
    d.record_history(Some(1 << 20));
    let out = f().unwrap();
    drop(out);
    let trace = d.trace();
    d.record_history(None);
    trace.iter().map(|e| (e.action, e.size, e.requested, e.stream)).collect()
}

/// The three ops' traces on `d`: training with running statistics, evaluation, backward.
fn nhwc_traces(d: &Device, shape: [usize; 4], dtype: DType, pdtype: DType) -> Vec<Vec<Entry>> {
    let c = shape[3];
    let x = Tensor::zeros(d, &shape, dtype).unwrap();
    let g = Tensor::zeros(d, &[c], pdtype).unwrap();
    let (b, mut rm, mut rv) = (g.clone(), g.clone(), g.clone());
    let (mean, invstd) =
        (Tensor::zeros(d, &[c], DType::F32).unwrap(), Tensor::zeros(d, &[c], DType::F32).unwrap());
    vec![
        traced(d, || {
            let run = RunningStats { mean: &mut rm, var: &mut rv, momentum: 0.1 };
            ops::batch_norm_nhwc(&x, &g, &b, Some(run), EPS)
        }),
        traced(d, || ops::batch_norm_eval_nhwc(&x, &g, &b, &rm, &rv, EPS)),
        traced(d, || ops::batch_norm_backward_nhwc(&x, &g, &mean, &invstd, &x, EPS)),
    ]
}

/// The host and the virtual device allocate alike, request for request, what the GPU's own
/// kernels need (outputs and the per-part workspace, planned through the op).
#[test]
fn host_and_virtual_device_allocate_alike() {
    for (shape, dtype, pdtype) in [
        ([4, 6, 6, 8], DType::BF16, DType::F32),
        ([2, 5, 3, 70], DType::F32, DType::F32),
        ([8, 32, 32, 16], DType::F16, DType::F16),
    ] {
        let (h, v) = (Device::host(1 << 30), Device::virtual_device(1 << 30));
        let want = nhwc_traces(&h, shape, dtype, pdtype);
        assert!(want.iter().all(|t| !t.is_empty()));
        assert_eq!(nhwc_traces(&v, shape, dtype, pdtype), want, "{shape:?} {dtype:?}");
    }
}

/// `(allocations, bytes allocated, peak above what was live before)` of `f` on `d`.
fn footprint<T>(d: &Device, f: impl FnOnce() -> vram_kernels::Result<T>) -> (usize, usize, u64) {
    let base = d.memory_allocated();
    d.reset_peak_stats();
    let trace = traced(d, f);
    let allocs: Vec<_> = trace.iter().filter(|e| e.0 == TraceAction::Alloc).collect();
    let bytes = allocs.iter().map(|e| e.1).sum();
    (allocs.len(), bytes, d.max_memory_allocated() - base)
}

/// The channels_last ops allocate what the NCHW ops allocate on an input of the same size
/// (no permute copies), at ResNet-50's first batch norm, bf16 with f32 parameters, on the
/// virtual device; prints the figures.
#[test]
fn nhwc_ops_allocate_what_the_nchw_ops_do_at_resnet50s_first_batch_norm() {
    let d = Device::virtual_device(8 << 30);
    let (nhwc, nchw) = ([64, 112, 112, 64], [64, 64, 112, 112]);
    let pd = DType::F32;
    let make = |shape: &[usize]| Tensor::zeros(&d, shape, DType::BF16).unwrap();
    let (x, xc) = (make(&nhwc), make(&nchw));
    let p = || Tensor::zeros(&d, &[64], pd).unwrap();
    let (g, b, mut rm, mut rv, mut rm2, mut rv2) = (p(), p(), p(), p(), p(), p());
    let stats = (
        Tensor::zeros(&d, &[64], DType::F32).unwrap(),
        Tensor::zeros(&d, &[64], DType::F32).unwrap(),
    );
    let run = |m, v| RunningStats { mean: m, var: v, momentum: 0.1 };
    let rows = [
        (
            "batch_norm",
            footprint(&d, || ops::batch_norm_nhwc(&x, &g, &b, Some(run(&mut rm, &mut rv)), EPS)),
            footprint(&d, || ops::batch_norm(&xc, &g, &b, Some(run(&mut rm2, &mut rv2)), EPS)),
        ),
        (
            "batch_norm_eval",
            footprint(&d, || ops::batch_norm_eval_nhwc(&x, &g, &b, &rm, &rv, EPS)),
            footprint(&d, || ops::batch_norm_eval(&xc, &g, &b, &rm, &rv, EPS)),
        ),
        (
            "batch_norm_backward",
            footprint(&d, || ops::batch_norm_backward_nhwc(&x, &g, &stats.0, &stats.1, &x, EPS)),
            footprint(&d, || ops::batch_norm_backward(&xc, &g, &stats.0, &stats.1, &xc, EPS)),
        ),
    ];
    for (op, got, nchw) in rows {
        let _ = writeln!(
            std::io::stderr(),
            "{op}_nhwc [64, 112, 112, 64] bf16, f32 params: {} allocations, {} bytes, peak +{} \
             bytes (NCHW op: {} allocations, {} bytes, peak +{})",
            got.0,
            got.1,
            got.2,
            nchw.0,
            nchw.1,
            nchw.2
        );
        // The outputs plus a workspace: as many allocations as the NCHW op, and the same
        // bytes but the per-part workspace (sized by each layout's parts).
        assert_eq!(got.0, nchw.0, "{op}");
        let x_bytes = 64 * 112 * 112 * 64 * 2;
        assert!(got.1 < x_bytes + (1 << 20) && got.2 < x_bytes as u64 + (1 << 20), "{op}: {got:?}");
    }
}

/// The CUDA device for the GPU checks, or `None` after printing the skip line.
fn gpu() -> Option<Device> {
    match Device::cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "skipped: no CUDA device ({e})");
            None
        }
    }
}

/// `got` (any device) against the host's `want`: `|g - w| <= tol * max(|w|, 1)`.
fn close(what: &str, got: &Tensor, want: &Tensor, tol: f32) {
    let (g, w) = (got.to_f32_vec().unwrap(), want.to_f32_vec().unwrap());
    assert_eq!(g.len(), w.len(), "{what}: length");
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!((a - b).abs() <= tol * b.abs().max(1.0), "{what}[{i}]: gpu {a}, host {b}");
    }
}

/// The three ops on `gpu` against the host, for shapes with several parts, a partial block
/// of channels, one channel.
fn gpu_against_host(gpu: &Device, cases: &[(DType, DType)]) {
    let h = host();
    for &(dtype, pdtype) in cases {
        let tol = if dtype == DType::F32 { 1e-4 } else { 2e-2 };
        for shape in [[16, 32, 32, 4], [5, 7, 9, 40], [3, 1, 2, 1], [8, 14, 14, 96]] {
            let c = shape[3];
            let what = format!("{shape:?} {dtype:?} params {pdtype:?}");
            let on = |d: &Device, seed, lo, hi, s: &[usize], t| tensor(d, s, seed, lo, hi, t);
            let (hx, gx) =
                (on(&h, 1, -3.0, 5.0, &shape, dtype), on(gpu, 1, -3.0, 5.0, &shape, dtype));
            let (hdy, gdy) =
                (on(&h, 2, -1.0, 1.0, &shape, dtype), on(gpu, 2, -1.0, 1.0, &shape, dtype));
            let (hg, gg) = (on(&h, 3, 0.5, 2.0, &[c], pdtype), on(gpu, 3, 0.5, 2.0, &[c], pdtype));
            let (hb, gb) =
                (on(&h, 4, -1.0, 1.0, &[c], pdtype), on(gpu, 4, -1.0, 1.0, &[c], pdtype));
            let (mut hm, mut gm) =
                (on(&h, 5, -0.5, 0.5, &[c], pdtype), on(gpu, 5, -0.5, 0.5, &[c], pdtype));
            let (mut hv, mut gv) =
                (on(&h, 6, 0.5, 2.0, &[c], pdtype), on(gpu, 6, 0.5, 2.0, &[c], pdtype));
            let hr = RunningStats { mean: &mut hm, var: &mut hv, momentum: 0.1 };
            let gr = RunningStats { mean: &mut gm, var: &mut gv, momentum: 0.1 };
            let hn = ops::batch_norm_nhwc(&hx, &hg, &hb, Some(hr), EPS).unwrap();
            let gn = ops::batch_norm_nhwc(&gx, &gg, &gb, Some(gr), EPS).unwrap();
            close(&format!("{what} y"), &gn.y, &hn.y, tol);
            close(&format!("{what} mean"), &gn.mean, &hn.mean, 1e-5);
            close(&format!("{what} invstd"), &gn.invstd, &hn.invstd, 1e-4);
            let pt = if pdtype == DType::F32 { 1e-4 } else { 1e-2 };
            close(&format!("{what} running mean"), &gm, &hm, pt);
            close(&format!("{what} running var"), &gv, &hv, pt);
            let he = ops::batch_norm_eval_nhwc(&hx, &hg, &hb, &hm, &hv, EPS).unwrap();
            let ge = ops::batch_norm_eval_nhwc(&gx, &gg, &gb, &gm, &gv, EPS).unwrap();
            close(&format!("{what} eval"), &ge, &he, tol);
            let hgr =
                ops::batch_norm_backward_nhwc(&hx, &hg, &hn.mean, &hn.invstd, &hdy, EPS).unwrap();
            let ggr =
                ops::batch_norm_backward_nhwc(&gx, &gg, &gn.mean, &gn.invstd, &gdy, EPS).unwrap();
            close(&format!("{what} dx"), &ggr.dx, &hgr.dx, tol.max(1e-3));
            close(&format!("{what} dgamma"), &ggr.dgamma, &hgr.dgamma, pt.max(1e-3));
            close(&format!("{what} dbeta"), &ggr.dbeta, &hgr.dbeta, pt.max(1e-3));
        }
    }
}

/// The own channels_last kernels on a GPU against the host, every dtype, parameters in `x`'s
/// dtype and f32.
#[test]
fn own_nhwc_kernels_on_a_gpu_match_the_host() {
    let Some(gpu) = gpu() else { return };
    gpu.set_conv_backend(ConvBackend::Own).unwrap();
    let cases: Vec<_> = DTYPES.iter().flat_map(|&t| [(t, t), (t, DType::F32)]).collect();
    gpu_against_host(&gpu, &cases);
}

/// cuDNN's channels_last batch norm (NHWC descriptors, `SPATIAL_PERSISTENT` in training)
/// against the host, where PyTorch runs it: f32, f16 with f32 parameters.
#[test]
fn cudnn_nhwc_batch_norm_on_a_gpu_matches_the_host() {
    let Some(gpu) = gpu() else { return };
    match gpu.conv_path() {
        ConvPath::Cudnn { .. } => gpu.set_conv_backend(ConvBackend::Cudnn).unwrap(),
        other => {
            let _ = writeln!(std::io::stderr(), "skipped: no cuDNN ({other})");
            return;
        }
    }
    let _ = writeln!(std::io::stderr(), "batch norm through {}", gpu.batch_norm_path());
    gpu_against_host(&gpu, &[(DType::F32, DType::F32), (DType::F16, DType::F32)]);
}
