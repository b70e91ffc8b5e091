//! The channels_last (NHWC) max pool, global average pool and squeeze-excitation scale
//! against the NCHW ops on the permuted input, on the host: bit for bit where they add in
//! the same order (everything but the global average pool's and the scale gradient's sums
//! over more than 64 positions, which are grouped by chunks of 64: within rounding there);
//! the refusals; out of memory leaving the inputs and `acc` intact; and what the direct ops
//! save over the permute composition they replace (allocations and bytes at ResNet-50's and
//! MobileNetV3's sizes, on a virtual device, which allocates what the host and a GPU do).

use proptest::prelude::*;
use vram_kernels::ops;
use vram_kernels::{DType, Device, Indices, Pool2dOptions, Result, Tensor};

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];
const TO_NCHW: [usize; 4] = [0, 3, 1, 2];
const TO_NHWC: [usize; 4] = [0, 2, 3, 1];

fn host() -> Device {
    Device::host(1 << 30)
}

/// Deterministic values in [-2, 2) on a grid of 1/8: ties inside small windows.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) % 32) as f32 / 8.0 - 2.0
        })
        .collect()
}

/// Finer deterministic values in [-2, 2) (sums that round).
fn fine(n: usize, seed: u64) -> Vec<f32> {
    (0..n as u64).map(|i| ((i * 7919 + seed * 104_729) % 40_009) as f32 / 10_002.25 - 2.0).collect()
}

fn t(d: &Device, shape: &[usize], v: &[f32], dtype: DType) -> Tensor {
    Tensor::from_f32_slice(d, shape, v, dtype).unwrap()
}

fn bits(x: &Tensor) -> Vec<u32> {
    x.to_f32_vec().unwrap().iter().map(|v| v.to_bits()).collect()
}

fn nhwc(x: &Tensor) -> Tensor {
    ops::permute(x, &TO_NHWC).unwrap()
}

fn nchw(x: &Tensor) -> Tensor {
    ops::permute(x, &TO_NCHW).unwrap()
}

/// `same` bit for bit as `want`, or within `tol` of it relative to its magnitude.
fn check(what: &str, got: &Tensor, want: &Tensor, tol: Option<f32>) {
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    match tol {
        None => assert_eq!(bits(got), bits(want), "{what}"),
        Some(tol) => {
            let (g, w) = (got.to_f32_vec().unwrap(), want.to_f32_vec().unwrap());
            for (i, (g, w)) in g.iter().zip(&w).enumerate() {
                assert!((g - w).abs() <= tol * w.abs().max(1.0), "{what}[{i}]: {g}, want {w}");
            }
        }
    }
}

/// NCHW indices `[n, c, oh, ow]` in NHWC order `[n, oh, ow, c]`.
fn indices_nhwc(arg: &Indices) -> Vec<u32> {
    let &[n, c, oh, ow] = arg.shape() else { panic!("rank 4") };
    let v = arg.as_slice().unwrap();
    let mut out = Vec::with_capacity(v.len());
    for b in 0..n {
        for y in 0..oh {
            for x in 0..ow {
                for ch in 0..c {
                    out.push(v[((b * c + ch) * oh + y) * ow + x]);
                }
            }
        }
    }
    out
}

/// One max-pool case: forward (values and indices) and backward, NHWC against NCHW on the
/// permuted tensors, bit for bit.
fn max_pool_case(shape: [usize; 4], opts: &Pool2dOptions, dtype: DType, seed: u64) {
    let d = host();
    let n: usize = shape.iter().product();
    let mut xv = values(n, seed);
    if n > 5 {
        xv[n / 3] = f32::NAN;
    }
    let x = t(&d, &shape, &xv, dtype);
    let what = format!("max_pool2d_nhwc {dtype:?} {shape:?} {opts:?}");
    let (y, arg) = ops::max_pool2d_nhwc(&x, opts).unwrap();
    let (yc, argc) = ops::max_pool2d(&nchw(&x), opts).unwrap();
    check(&what, &y, &nhwc(&yc), None);
    assert_eq!(arg.shape(), y.shape(), "{what}: indices in the output's layout");
    assert_eq!(arg.as_slice().unwrap(), indices_nhwc(&argc), "{what}: indices");
    let dy = t(&d, y.shape(), &values(y.numel(), seed + 1), dtype);
    let dx = ops::max_pool2d_backward_nhwc(&dy, &arg, &shape, opts).unwrap();
    let [b, h, w, c] = shape;
    let dxc = ops::max_pool2d_backward(&nchw(&dy), &argc, &[b, c, h, w], opts).unwrap();
    check(&format!("{what} backward"), &dx, &nhwc(&dxc), None);
}

/// One global-average-pool and scale case: NHWC against NCHW on the permuted tensors, bit
/// for bit up to 64 positions, within `sum_tol` past (the chunked sums).
fn pool_and_scale_case(shape: [usize; 4], dtype: DType, seed: u64) {
    let d = host();
    let [b, h, w, c] = shape;
    let n: usize = shape.iter().product();
    let sum_tol = (h * w > 64).then_some(match dtype {
        DType::F32 => 1e-5,
        _ => 1e-2,
    });
    let what = format!("{dtype:?} {shape:?}");
    let x = t(&d, &shape, &fine(n, seed), dtype);
    let xc = nchw(&x);
    check(
        &format!("global_avg_pool_nhwc {what}"),
        &ops::global_avg_pool_nhwc(&x).unwrap(),
        &ops::global_avg_pool(&xc).unwrap(),
        sum_tol,
    );
    let g = t(&d, &[b, c], &fine(b * c, seed + 1), dtype);
    let dx = ops::global_avg_pool_backward_nhwc(&g, &shape).unwrap();
    let dxc = ops::global_avg_pool_backward(&g, &[b, c, h, w]).unwrap();
    check(&format!("global_avg_pool_backward_nhwc {what}"), &dx, &nhwc(&dxc), None);
    let (mut acc, mut accc) = (x.clone(), xc.clone());
    ops::global_avg_pool_backward_add_nhwc(&mut acc, &g).unwrap();
    ops::global_avg_pool_backward_add(&mut accc, &g).unwrap();
    check(&format!("global_avg_pool_backward_add_nhwc {what}"), &acc, &nhwc(&accc), None);
    assert_eq!(bits(&x), bits(&nhwc(&xc)), "{what}: a clone of acc is not written");

    let s = t(&d, &[b, c], &fine(b * c, seed + 2), dtype);
    let y = ops::scale_channels_nhwc(&x, &s).unwrap();
    check(
        &format!("scale_channels_nhwc {what}"),
        &y,
        &nhwc(&ops::scale_channels(&xc, &s).unwrap()),
        None,
    );
    let dy = t(&d, &shape, &fine(n, seed + 3), dtype);
    let gr = ops::scale_channels_backward_nhwc(&x, &s, &dy).unwrap();
    let grc = ops::scale_channels_backward(&xc, &s, &nchw(&dy)).unwrap();
    check(&format!("scale_channels_backward_nhwc dx {what}"), &gr.dx, &nhwc(&grc.dx), None);
    // f64 sums of exact products: grouped by chunk they differ in f64's last bits at most,
    // so by at most one unit of the stored dtype's last place after rounding.
    let ds_tol = (h * w > 64).then_some(match dtype {
        DType::F32 => 1e-6,
        DType::F16 => 1e-3,
        DType::BF16 => 8e-3,
    });
    check(&format!("scale_channels_backward_nhwc ds {what}"), &gr.ds, &grc.ds, ds_tol);
}

#[test]
fn nhwc_pools_and_scale_equal_the_nchw_ops_on_the_permuted_input() {
    let pad = |k, s, p| Pool2dOptions::new(k, s).padding(p);
    let cases = [
        ([2, 7, 9, 3], pad((3, 3), (2, 2), (1, 1))), // ResNet's stem pool, odd sizes
        ([1, 6, 6, 1], Pool2dOptions::new((2, 2), (2, 2))), // one channel
        ([2, 5, 4, 17], pad((3, 2), (1, 1), (1, 0))), // kernel > stride: shared inputs
        ([3, 1, 1, 4], Pool2dOptions::new((1, 1), (1, 1))), // 1x1 planes
        ([1, 8, 7, 2], pad((2, 3), (3, 2), (1, 1))), // stride > kernel: skipped inputs
    ];
    for (i, (shape, opts)) in cases.iter().enumerate() {
        for dtype in DTYPES {
            max_pool_case(*shape, opts, dtype, i as u64);
        }
    }
    // Up to 64 positions (one chunk), 7x7 included, and past it (two and three chunks).
    for (i, shape) in [[2, 7, 7, 5], [3, 1, 1, 2], [1, 8, 8, 1], [2, 9, 10, 3], [1, 14, 13, 4]]
        .into_iter()
        .enumerate()
    {
        for dtype in DTYPES {
            pool_and_scale_case(shape, dtype, 10 + i as u64);
        }
    }
}

fn pool_options() -> impl Strategy<Value = Pool2dOptions> {
    (1..=3usize, 1..=3usize, 1..=3usize, 1..=3usize, 0..=1usize, 0..=1usize).prop_map(
        |(kh, kw, sh, sw, ph, pw)| {
            Pool2dOptions::new((kh, kw), (sh, sw)).padding((ph.min(kh / 2), pw.min(kw / 2)))
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    // Property: for any shape, window, stride and padding, and every dtype, the NHWC max
    // pool's output, indices and gradient are the NCHW op's on the permuted tensors, bit
    // for bit (windows larger than the padded input are refused by both).
    #[test]
    fn nhwc_max_pool_is_the_permuted_nchw_max_pool(
        shape in (1..=2usize, 1..=9usize, 1..=9usize, 1..=6usize),
        opts in pool_options(),
        dtype in 0..3usize,
        seed in 0..1000u64,
    ) {
        let shape = [shape.0, shape.1, shape.2, shape.3];
        let x = t(&host(), &shape, &values(shape.iter().product(), seed), DTYPES[dtype]);
        let nchw_result = ops::max_pool2d(&nchw(&x), &opts);
        prop_assert_eq!(nchw_result.is_ok(), ops::max_pool2d_nhwc(&x, &opts).is_ok());
        if nchw_result.is_ok() {
            max_pool_case(shape, &opts, DTYPES[dtype], seed);
        }
    }

    // Property: for any shape and dtype, the NHWC global average pool, its gradients and the
    // scale and its gradients are the NCHW ops' on the permuted tensors (bit for bit up to
    // 64 positions, within rounding past).
    #[test]
    fn nhwc_pool_and_scale_are_the_permuted_nchw_ops(
        shape in (1..=2usize, 1..=11usize, 1..=11usize, 1..=6usize),
        dtype in 0..3usize,
        seed in 0..1000u64,
    ) {
        pool_and_scale_case([shape.0, shape.1, shape.2, shape.3], DTYPES[dtype], seed);
    }
}

#[test]
fn nhwc_ops_refuse_bad_ranks_shapes_dtypes_and_devices() {
    let d = host();
    let z = |shape: &[usize], dtype| Tensor::zeros(&d, shape, dtype).unwrap();
    let opts = Pool2dOptions::new((2, 2), (2, 2));
    let x = z(&[2, 4, 4, 3], DType::F32);
    // Rank.
    for bad in [z(&[4, 4, 3], DType::F32), z(&[1, 2, 4, 4, 3], DType::F32)] {
        assert!(ops::max_pool2d_nhwc(&bad, &opts).is_err());
        assert!(ops::global_avg_pool_nhwc(&bad).is_err());
        assert!(ops::scale_channels_nhwc(&bad, &z(&[2, 3], DType::F32)).is_err());
        assert!(
            ops::global_avg_pool_backward_add_nhwc(&mut bad.clone(), &z(&[2, 3], DType::F32))
                .is_err()
        );
    }
    let (y, arg) = ops::max_pool2d_nhwc(&x, &opts).unwrap();
    assert_eq!(y.shape(), [2, 2, 2, 3]);
    assert!(ops::max_pool2d_backward_nhwc(&y, &arg, &[2, 4, 4], &opts).is_err(), "rank 3");
    assert!(ops::global_avg_pool_backward_nhwc(&z(&[2, 3], DType::F32), &[2, 4, 4]).is_err());
    // Shapes: dy of the NCHW layout, indices of another pool, s of the wrong channels.
    let err = ops::max_pool2d_backward_nhwc(&z(&[2, 3, 2, 2], DType::F32), &arg, x.shape(), &opts);
    assert!(err.unwrap_err().to_string().contains("max_pool2d_backward_nhwc"));
    let (_, other) = ops::max_pool2d_nhwc(&z(&[2, 4, 4, 5], DType::F32), &opts).unwrap();
    assert!(ops::max_pool2d_backward_nhwc(&y, &other, x.shape(), &opts).is_err());
    assert!(ops::max_pool2d_nhwc(&x, &Pool2dOptions::new((2, 2), (0, 1))).is_err(), "stride 0");
    assert!(ops::global_avg_pool_backward_nhwc(&z(&[3, 2], DType::F32), x.shape()).is_err());
    assert!(ops::global_avg_pool_nhwc(&z(&[2, 0, 4, 3], DType::F32)).is_err(), "empty plane");
    assert!(ops::scale_channels_nhwc(&x, &z(&[2, 4], DType::F32)).is_err(), "s [n, h]");
    assert!(ops::scale_channels_nhwc(&x, &z(&[3], DType::F32)).is_err());
    let s = z(&[2, 3], DType::F32);
    assert!(ops::scale_channels_backward_nhwc(&x, &s, &z(&[2, 3, 4, 4], DType::F32)).is_err());
    // Dtypes.
    assert!(ops::scale_channels_nhwc(&x, &z(&[2, 3], DType::BF16)).is_err());
    assert!(ops::scale_channels_backward_nhwc(&x, &s, &z(&[2, 4, 4, 3], DType::BF16)).is_err());
    let mut acc = z(&[2, 4, 4, 3], DType::F32);
    assert!(ops::global_avg_pool_backward_add_nhwc(&mut acc, &z(&[2, 3], DType::BF16)).is_err());
    assert!(ops::global_avg_pool_backward_add_nhwc(&mut acc, &z(&[3, 2], DType::F32)).is_err());
    // Devices.
    let other = Device::host(64 << 20);
    let s_other = Tensor::zeros(&other, &[2, 3], DType::F32).unwrap();
    assert!(ops::scale_channels_nhwc(&x, &s_other).is_err());
    assert!(ops::global_avg_pool_backward_add_nhwc(&mut acc, &s_other).is_err());
    let arg_other =
        ops::max_pool2d_nhwc(&Tensor::zeros(&other, x.shape(), DType::F32).unwrap(), &opts)
            .unwrap()
            .1;
    assert!(ops::max_pool2d_backward_nhwc(&y, &arg_other, x.shape(), &opts).is_err());
    assert_eq!(bits(&acc), vec![0; acc.numel()], "acc untouched by the refusals");
}

/// Each op that runs out of memory leaves its inputs (and an in-place `acc`) as they were,
/// and the device's allocated bytes where they were.
#[test]
fn out_of_memory_leaves_inputs_and_acc_intact() {
    let d = Device::host(60 << 20);
    let shape = [2, 32, 32, 2048]; // 16 MiB of f32
    let n: usize = shape.iter().product();
    let x = t(&d, &shape, &fine(n, 1), DType::F32);
    let s = t(&d, &[2, 2048], &fine(4096, 2), DType::F32);
    let dy = t(&d, &shape, &fine(n, 3), DType::F32);
    let mut acc = t(&d, &shape, &fine(n, 4), DType::F32);
    let shared = acc.clone();
    let g = t(&d, &[2, 2048], &fine(4096, 5), DType::F32);
    let before = (bits(&x), bits(&s), bits(&dy), bits(&acc));
    let allocated = d.memory_allocated();
    let oom = |what: &str, e: vram_kernels::Error| assert!(e.is_out_of_memory(), "{what}: {e}");
    // 60 MiB hold the three 16 MiB tensors and a segment of small ones: no 16 MiB more.
    oom("scale_channels_nhwc", ops::scale_channels_nhwc(&x, &s).unwrap_err());
    oom(
        "scale_channels_backward_nhwc",
        ops::scale_channels_backward_nhwc(&x, &s, &dy).unwrap_err(),
    );
    oom(
        "global_avg_pool_backward_nhwc",
        ops::global_avg_pool_backward_nhwc(&g, &shape).unwrap_err(),
    );
    oom(
        "max_pool2d_nhwc",
        ops::max_pool2d_nhwc(&x, &Pool2dOptions::new((1, 1), (1, 1))).map(drop).unwrap_err(),
    );
    // The in-place add would copy the shared acc first: no room, acc unchanged.
    oom(
        "global_avg_pool_backward_add_nhwc",
        ops::global_avg_pool_backward_add_nhwc(&mut acc, &g).unwrap_err(),
    );
    assert_eq!((bits(&x), bits(&s), bits(&dy), bits(&acc)), before);
    assert_eq!(d.memory_allocated(), allocated, "the failed ops gave back what they took");
    // Unshared, it is added in place with nothing allocated.
    drop(shared);
    ops::global_avg_pool_backward_add_nhwc(&mut acc, &g).unwrap();
    assert_ne!(bits(&acc), before.3);
    assert_eq!(d.memory_allocated(), allocated);
}

/// The lead's permute composition (the bodies these ops replaced), for the comparison.
mod composed {
    use super::*;

    pub fn max_pool(x: &Tensor, opts: &Pool2dOptions) -> Result<(Tensor, Indices)> {
        let xc = ops::permute(x, &TO_NCHW)?;
        let (y, arg) = ops::max_pool2d(&xc, opts)?;
        drop(xc);
        Ok((ops::permute(&y, &TO_NHWC)?, arg))
    }

    pub fn max_pool_backward(
        dy: &Tensor,
        arg: &Indices,
        [n, h, w, c]: [usize; 4],
        opts: &Pool2dOptions,
    ) -> Result<Tensor> {
        let dyc = ops::permute(dy, &TO_NCHW)?;
        let dx = ops::max_pool2d_backward(&dyc, arg, &[n, c, h, w], opts)?;
        drop(dyc);
        ops::permute(&dx, &TO_NHWC)
    }

    pub fn global_avg_pool(x: &Tensor) -> Result<Tensor> {
        ops::global_avg_pool(&ops::permute(x, &TO_NCHW)?)
    }

    pub fn global_avg_pool_backward(dy: &Tensor, [n, h, w, c]: [usize; 4]) -> Result<Tensor> {
        ops::permute(&ops::global_avg_pool_backward(dy, &[n, c, h, w])?, &TO_NHWC)
    }

    pub fn global_avg_pool_backward_add(acc: &mut Tensor, dy: &Tensor) -> Result<()> {
        let &[n, h, w, c] = acc.shape() else { unreachable!("rank 4") };
        let g = global_avg_pool_backward(dy, [n, h, w, c])?;
        ops::add_assign(acc, &g)
    }

    pub fn scale(x: &Tensor, s: &Tensor) -> Result<Tensor> {
        let xc = ops::permute(x, &TO_NCHW)?;
        let y = ops::scale_channels(&xc, s)?;
        drop(xc);
        ops::permute(&y, &TO_NHWC)
    }

    pub fn scale_backward(x: &Tensor, s: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
        let xc = ops::permute(x, &TO_NCHW)?;
        let dyc = ops::permute(dy, &TO_NCHW)?;
        let g = ops::scale_channels_backward(&xc, s, &dyc)?;
        drop((xc, dyc));
        Ok((ops::permute(&g.dx, &TO_NHWC)?, g.ds))
    }
}

/// Allocations, bytes allocated and the peak above the start of `f` on `d`.
fn cost<T>(d: &Device, f: impl FnOnce() -> Result<T>) -> (u64, u64, i64) {
    let start = d.memory_stats();
    d.reset_peak_stats();
    let out = f().unwrap();
    let end = d.memory_stats();
    drop(out);
    (
        end.allocation.all.allocated - start.allocation.all.allocated,
        end.allocated_bytes.all.allocated - start.allocated_bytes.all.allocated,
        end.allocated_bytes.all.peak - start.allocated_bytes.all.current,
    )
}

/// The direct ops against the permute composition at ResNet-50's stem max pool ([64, 112,
/// 112, 64] bf16, 3x3, stride 2, padding 1) and head pool ([64, 7, 7, 2048] bf16) and
/// MobileNetV3's squeeze-excitation scale ([64, 28, 28, 120] bf16), forward and backward,
/// on a virtual device: no more allocations, fewer bytes and a lower peak each (printed with
/// `--nocapture`).
#[test]
fn direct_nhwc_ops_allocate_less_than_the_permute_composition() {
    let d = Device::virtual_device(16 << 30);
    let z = |shape: &[usize]| Tensor::zeros(&d, shape, DType::BF16).unwrap();
    let opts = Pool2dOptions::new((3, 3), (2, 2)).padding((1, 1));
    let report = |what: &str, before: (u64, u64, i64), after: (u64, u64, i64)| {
        let mib = |b: f64| b / f64::from(1 << 20);
        println!(
            "{what}: permutes {} allocations, {:.1} MiB allocated, peak +{:.1} MiB; direct {} \
             allocations, {:.1} MiB allocated, peak +{:.1} MiB",
            before.0,
            mib(before.1 as f64),
            mib(before.2 as f64),
            after.0,
            mib(after.1 as f64),
            mib(after.2 as f64)
        );
        assert!(after.0 <= before.0 && after.1 < before.1 && after.2 < before.2, "{what}");
    };

    let stem = [64, 112, 112, 64];
    let x = z(&stem);
    let before = cost(&d, || composed::max_pool(&x, &opts));
    let after = cost(&d, || ops::max_pool2d_nhwc(&x, &opts));
    report("stem max pool [64,112,112,64] bf16", before, after);
    let (y, arg) = ops::max_pool2d_nhwc(&x, &opts).unwrap();
    let (_, argc) = composed::max_pool(&x, &opts).unwrap();
    let before = cost(&d, || composed::max_pool_backward(&y, &argc, stem, &opts));
    let after = cost(&d, || ops::max_pool2d_backward_nhwc(&y, &arg, &stem, &opts));
    report("stem max pool backward", before, after);

    let head = [64, 7, 7, 2048];
    let x = z(&head);
    let g = z(&[64, 2048]);
    report(
        "head global average pool [64,7,7,2048] bf16",
        cost(&d, || composed::global_avg_pool(&x)),
        cost(&d, || ops::global_avg_pool_nhwc(&x)),
    );
    report(
        "head global average pool backward",
        cost(&d, || composed::global_avg_pool_backward(&g, head)),
        cost(&d, || ops::global_avg_pool_backward_nhwc(&g, &head)),
    );
    let mut acc = z(&head);
    let before = cost(&d, || composed::global_avg_pool_backward_add(&mut acc, &g));
    let after = cost(&d, || ops::global_avg_pool_backward_add_nhwc(&mut acc, &g));
    println!(
        "head global average pool backward_add: permutes {before:?}, direct {after:?} (allocations, bytes, peak)"
    );
    assert_eq!(after, (0, 0, 0), "added in place");

    let se = [64, 28, 28, 120];
    let (x, dy, s) = (z(&se), z(&se), z(&[64, 120]));
    report(
        "SE scale [64,28,28,120] bf16",
        cost(&d, || composed::scale(&x, &s)),
        cost(&d, || ops::scale_channels_nhwc(&x, &s)),
    );
    report(
        "SE scale backward",
        cost(&d, || composed::scale_backward(&x, &s, &dy)),
        cost(&d, || ops::scale_channels_backward_nhwc(&x, &s, &dy)),
    );
    report(
        "SE squeeze (global average pool) [64,28,28,120] bf16",
        cost(&d, || composed::global_avg_pool(&x)),
        cost(&d, || ops::global_avg_pool_nhwc(&x)),
    );
}
