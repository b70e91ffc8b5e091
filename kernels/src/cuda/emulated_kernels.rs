//! The CUDA kernels, run on the host by [`super::emulate`], against the host reference: the
//! launch configurations and arguments the ops use, outputs compared with the host ops (or,
//! for im2col and col2im, which have no host op, with their definitions written with
//! integer division). These run wherever a C++ compiler is, so a kernel's index arithmetic
//! is checked before any GPU runs it; `cuda_vs_host.rs` checks the same on a GPU.

use super::emulate::{launch, ptr};
use super::launch::{self, Arg, ConvGeom, PoolGeom};
use super::registry::*;
use crate::cpu::widen_f32;
use crate::device::Device;
use crate::dtype::{DType, Element};
use crate::ops;
use crate::params::{
    AdamWConfig, Conv2dOptions, Conv2dParams, Pool2dOptions, Pool2dParams, SgdConfig,
};
use crate::tensor::Tensor;
use cudarc::driver::LaunchConfig;
use half::{bf16, f16};

/// One host device for all references (tensors of an op share a device).
fn host() -> &'static Device {
    static HOST: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
    HOST.get_or_init(|| Device::host(1 << 30))
}

/// Deterministic pseudo-random values in `[lo, hi)` (xorshift).
pub(crate) use crate::cpu::elementwise::testing::seeded_in as values;

/// A host tensor of `T` holding `v` rounded into `T`.
fn tensor_of<T: Element>(shape: &[usize], v: &[f32]) -> Tensor {
    Tensor::from_f32_slice(host(), shape, v, T::DTYPE).unwrap()
}

fn tensor(shape: &[usize], v: &[f32]) -> Tensor {
    tensor_of::<f32>(shape, v)
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_f32_vec().unwrap()
}

/// `got` against `want`: `|g - w| <= tol * max(|w|, 1)` everywhere.
fn close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * w.abs().max(1.0),
            "{what}: index {i}: emulated {g}, host {w}"
        );
    }
}

/// `add` and `cast` (the packed maps) at sizes below a pack, with a tail, and over many
/// packs, from pointers aligned to their pack and one element off: every element written
/// once, exactly as the host rounds it, and nothing outside the range.
fn maps_of<T: Element>() -> bool {
    let size = T::DTYPE.size_in_bytes();
    for n in [1usize, 7, 9, 4773] {
        for offset in [0usize, 1] {
            let (a, b) = (values(n, 1, -4.0, 4.0), values(n, 2, -4.0, 4.0));
            let want =
                f32s(&ops::add(&tensor_of::<T>(&[n], &a), &tensor_of::<T>(&[n], &b)).unwrap());
            let pad = |v: &[f32]| -> Vec<T> {
                let mut out = vec![T::from_f32(-7.0); n + offset + 1];
                out[offset..offset + n].iter_mut().zip(v).for_each(|(o, &x)| *o = T::from_f32(x));
                out
            };
            let (mut ea, mut eb, mut y) =
                (pad(&a), pad(&b), vec![T::from_f32(99.0); n + offset + 1]);
            let at = |v: &mut Vec<T>| Arg::Ptr(v[offset..].as_mut_ptr() as u64);
            let args = [at(&mut ea), at(&mut eb), at(&mut y), Arg::count(n)];
            if !launch(ADD.of(T::DTYPE), launch::map(n, size), &args) {
                return false;
            }
            let got = widen_f32(&y[offset..offset + n]);
            close(&format!("add {:?} n {n} offset {offset}", T::DTYPE), &got, &want, 0.0);
            let outside = [&y[..offset], &y[offset + n..]].concat();
            assert!(outside.iter().all(|v| v.to_f32() == 99.0), "add wrote outside its range");
            // A cast from f32 into T, packs of 16 bytes of f32.
            let mut src = a.clone();
            let mut out = vec![T::from_f32(99.0); n];
            let args = [ptr(&mut src), ptr(&mut out), Arg::count(n)];
            launch(CAST.of_pair(DType::F32, T::DTYPE), launch::map(n, 4), &args);
            let want: Vec<f32> = a.iter().map(|&v| T::from_f32(v).to_f32()).collect();
            let got = widen_f32(&out);
            close(&format!("cast f32 -> {:?}", T::DTYPE), &got, &want, 0.0);
        }
    }
    true
}

#[test]
fn packed_maps_cover_every_element_once() {
    if maps_of::<f32>() {
        assert!(maps_of::<f16>() && maps_of::<bf16>());
    }
}

#[test]
fn indexed_kernels_split_indices_as_the_host_does() {
    let (rows, d) = (37, 129);
    let (xv, bv) = (values(rows * d, 3, -4.0, 4.0), values(d, 4, -1.0, 1.0));
    let want = f32s(&ops::bias_add(&tensor(&[rows, d], &xv), &tensor(&[d], &bv)).unwrap());
    let (mut x, mut b, mut y) = (xv.clone(), bv.clone(), vec![0.0f32; rows * d]);
    let n = rows * d;
    let args = [ptr(&mut x), ptr(&mut b), ptr(&mut y), Arg::count(n), Arg::div(d)];
    if !launch(BIAS_ADD.of(DType::F32), launch::elementwise(n), &args) {
        return;
    }
    close("bias_add", &y, &want, 0.0);

    // The gradient of a global average pool: dy [n, c] broadcast over planes of h * w.
    let shape = [3, 5, 7, 9];
    let dyv = values(15, 5, -2.0, 2.0);
    let want = f32s(&ops::global_avg_pool_backward(&tensor(&[3, 5], &dyv), &shape).unwrap());
    let (mut dy, mut dx) = (dyv.clone(), vec![0.0f32; want.len()]);
    let n = want.len();
    let args = [ptr(&mut dy), Arg::F32(1.0 / 63.0), ptr(&mut dx), Arg::count(n), Arg::div(63)];
    launch(BROADCAST_ROWS.of(DType::F32), launch::elementwise(n), &args);
    close("broadcast_rows", &dx, &want, 1e-6);
    // The same added in place (one rounding), by its definition.
    let accv = values(n, 11, -1.0, 1.0);
    let mut acc = accv.clone();
    let args = [ptr(&mut dy), Arg::F32(1.0 / 63.0), ptr(&mut acc), Arg::count(n), Arg::div(63)];
    launch(BROADCAST_ROWS_ADD.of(DType::F32), launch::elementwise(n), &args);
    let want: Vec<f32> = (0..n).map(|i| accv[i] + dyv[i / 63] * (1.0 / 63.0)).collect();
    close("broadcast_rows_add", &acc, &want, 0.0);

    // Squeeze-excitation's scale per plane.
    let (xv, sv) = (values(n, 6, -4.0, 4.0), values(15, 7, 0.0, 1.0));
    let want = f32s(&ops::scale_channels(&tensor(&shape, &xv), &tensor(&[3, 5], &sv)).unwrap());
    let (mut x, mut s, mut y) = (xv, sv, vec![0.0f32; n]);
    let args = [ptr(&mut x), ptr(&mut s), ptr(&mut y), Arg::count(n), Arg::div(63)];
    launch(SCALE_CHANNELS.of(DType::F32), launch::elementwise(n), &args);
    close("scale_channels", &y, &want, 0.0);

    // A convolution's bias over [n, c, oh * ow] planes, by its definition.
    let mut b = values(5, 8, -1.0, 1.0);
    let mut y = vec![0.0f32; n];
    let args = [ptr(&mut b), ptr(&mut y), Arg::count(n), Arg::div(5), Arg::div(63)];
    launch(BIAS_PLANES.of(DType::F32), launch::elementwise(n), &args);
    let want: Vec<f32> = (0..n).map(|i| b[(i / 63) % 5]).collect();
    close("bias_planes", &y, &want, 0.0);
    // A linear layer's bias rows (the C operand of its product), by definition.
    let args = [ptr(&mut b), ptr(&mut y), Arg::count(n), Arg::div(5)];
    launch(BIAS_FILL.of(DType::F32), launch::elementwise(n), &args);
    let want: Vec<f32> = (0..n).map(|i| b[i % 5]).collect();
    close("bias_fill", &y, &want, 0.0);

    // Embedding rows gathered and their gradients scattered.
    let (vocab, dim) = (50, 24);
    let tv = values(vocab * dim, 9, -1.0, 1.0);
    let ids: Vec<u32> = (0..97).map(|i| (i * i % vocab) as u32).collect();
    let want = f32s(&ops::embedding(&tensor(&[vocab, dim], &tv), &ids).unwrap());
    let (mut table, mut ids_dev, mut out) = (tv, ids.clone(), vec![0.0f32; 97 * dim]);
    let n = 97 * dim;
    let args = [ptr(&mut ids_dev), ptr(&mut table), ptr(&mut out), Arg::count(n), Arg::div(dim)];
    launch(EMBEDDING.of(DType::F32), launch::elementwise(n), &args);
    close("embedding", &out, &want, 0.0);
    // Their gradients, summed per vocabulary row in token order: the host's sums, bit for bit,
    // for rows of one block and of several, vocabularies of one row per range and of several.
    for (vocab, dim, tokens) in [(50, 24, 97), (7, 300, 200), (3000, 40, 900)] {
        let ids: Vec<u32> = (0..tokens).map(|i| (i * i % vocab) as u32).collect();
        let dv = values(tokens * dim, 10, -1.0, 1.0);
        let want =
            f32s(&ops::embedding_backward(&ids, &tensor(&[tokens, dim], &dv), vocab).unwrap());
        let (cfg, per_range) = launch::embedding_rows(vocab, dim);
        let (mut ids_dev, mut dout, mut acc) = (ids, dv, vec![0.0f32; vocab * dim]);
        let args = [
            ptr(&mut ids_dev),
            ptr(&mut dout),
            ptr(&mut acc),
            Arg::count(tokens),
            Arg::count(dim),
            Arg::count(per_range),
        ];
        launch(EMBEDDING_BWD.of(DType::F32), cfg, &args);
        close(&format!("embedding_backward {vocab} x {dim}"), &acc, &want, 0.0);
    }
}

/// `permute` as `ops/permute.rs` launches it (the shape padded in front to four axes by
/// `cpu::permute::geometry`).
/// `None` without a compiler.
fn emulated_permute(x: &[f32], shape: &[usize], perm: &[usize]) -> Option<Vec<f32>> {
    let (d, s) = crate::cpu::permute::geometry(shape, perm);
    let n = x.len();
    let (mut x, mut y) = (x.to_vec(), vec![0.0f32; n]);
    let args = [
        ptr(&mut x),
        ptr(&mut y),
        Arg::count(n),
        Arg::div(d[1]),
        Arg::div(d[2]),
        Arg::div(d[3]),
        Arg::count(s[0]),
        Arg::count(s[1]),
        Arg::count(s[2]),
        Arg::count(s[3]),
    ];
    launch(PERMUTE.of(DType::F32), launch::elementwise(n), &args).then_some(y)
}

#[test]
fn permute_reads_every_element_from_its_source() {
    let cases: [(&[usize], &[usize]); 5] = [
        (&[3, 17, 4, 9], &[0, 2, 1, 3]),
        (&[3, 17, 4, 9], &[3, 1, 0, 2]),
        (&[3, 17, 4, 9], &[0, 1, 2, 3]),
        (&[37, 5], &[1, 0]),
        (&[6, 1, 11], &[2, 0, 1]),
    ];
    for (shape, perm) in cases {
        let xv = values(shape.iter().product(), 11, -4.0, 4.0);
        let want = f32s(&ops::permute(&tensor(shape, &xv), perm).unwrap());
        let Some(got) = emulated_permute(&xv, shape, perm) else { return };
        close(&format!("permute {shape:?} by {perm:?}"), &got, &want, 0.0);
    }
}

#[test]
fn batch_norm_parts_merge_into_the_hosts_statistics_and_gradients() {
    // 4 even parts, 2 uneven ones (3 and 4 images), one part.
    for (case, shape) in [[16, 4, 32, 32], [7, 2, 30, 40], [4, 6, 3, 3]].iter().enumerate() {
        let (n, c, s) = (shape[0], shape[1], shape[2] * shape[3]);
        let total = n * c * s;
        let parts = ops::batch_norm_parts(n, c, s);
        assert_eq!(parts, [4, 2, 1][case]);
        let seed = 20 + 10 * case as u64;
        let (xv, gv, bv) = (
            values(total, seed, -3.0, 5.0),
            values(c, seed + 1, 0.5, 2.0),
            values(c, seed + 2, -1.0, 1.0),
        );
        let (mut rm_t, mut rv_t) = (tensor(&[c], &vec![0.5; c]), tensor(&[c], &vec![2.0; c]));
        let running = ops::RunningStats { mean: &mut rm_t, var: &mut rv_t, momentum: 0.1 };
        let (x_t, g_t) = (tensor(shape, &xv), tensor(&[c], &gv));
        let want = ops::batch_norm(&x_t, &g_t, &tensor(&[c], &bv), Some(running), 1e-5).unwrap();

        let (mut x, mut g, mut b) = (xv.clone(), gv.clone(), bv.clone());
        let mut part = vec![f32::NAN; 2 * c * parts];
        let args = [
            ptr(&mut x),
            ptr(&mut part),
            Arg::count(n),
            Arg::count(c),
            Arg::count(s),
            Arg::U32(parts as u32),
        ];
        if !launch(BN_PARTIAL.of(DType::F32), launch::per_row_parts(c, parts), &args) {
            return;
        }
        let (mut mean, mut inv) = (vec![0.0f32; c], vec![0.0f32; c]);
        let (mut rm, mut rv) = (vec![0.5f32; c], vec![2.0f32; c]);
        let args = [
            ptr(&mut part),
            ptr(&mut mean),
            ptr(&mut inv),
            ptr(&mut rm),
            ptr(&mut rv),
            Arg::U32(1),
            Arg::U32(1),
            Arg::F32(0.1),
            Arg::F32(1e-5),
            Arg::count(n),
            Arg::count(c),
            Arg::count(s),
            Arg::U32(parts as u32),
        ];
        launch(BN_FINALIZE.of(DType::F32), launch::elementwise(c), &args);
        close("batch norm mean", &mean, &f32s(&want.mean), 1e-5);
        close("batch norm invstd", &inv, &f32s(&want.invstd), 1e-4);
        close("running mean", &rm, &f32s(&rm_t), 1e-5);
        close("running var", &rv, &f32s(&rv_t), 1e-4);
        let mut y = vec![0.0f32; total];
        let args = [
            ptr(&mut x),
            ptr(&mut mean),
            ptr(&mut inv),
            ptr(&mut g),
            ptr(&mut b),
            Arg::U32(1),
            ptr(&mut y),
            Arg::count(total),
            Arg::div(c),
            Arg::div(s),
        ];
        launch(BN_APPLY.of(DType::F32), launch::elementwise(total), &args);
        close("batch norm y", &y, &f32s(&want.y), 1e-4);

        // Backward from the host's saved statistics.
        let dyv = values(total, seed + 3, -1.0, 1.0);
        let grads = ops::batch_norm_backward(
            &x_t,
            &g_t,
            &want.mean,
            &want.invstd,
            &tensor(shape, &dyv),
            1e-5,
        )
        .unwrap();
        let (mut dy, mut mean, mut inv) = (dyv, f32s(&want.mean), f32s(&want.invstd));
        let mut part = vec![f32::NAN; 2 * c * parts];
        let args = [
            ptr(&mut x),
            ptr(&mut dy),
            ptr(&mut mean),
            ptr(&mut inv),
            ptr(&mut part),
            Arg::count(n),
            Arg::count(c),
            Arg::count(s),
            Arg::U32(parts as u32),
        ];
        launch(BN_BWD_PARTIAL.of(DType::F32), launch::per_row_parts(c, parts), &args);
        let mut sums = vec![f32::NAN; 2 * c];
        let args = [ptr(&mut part), ptr(&mut sums), Arg::count(c), Arg::U32(parts as u32)];
        launch(BN_BWD_FINALIZE.of(DType::F32), launch::elementwise(c), &args);
        close("batch norm dgamma", &sums[..c], &f32s(&grads.dgamma), 1e-3);
        close("batch norm dbeta", &sums[c..], &f32s(&grads.dbeta), 1e-3);
        let mut dx = vec![0.0f32; total];
        let args = [
            ptr(&mut x),
            ptr(&mut dy),
            ptr(&mut mean),
            ptr(&mut inv),
            ptr(&mut g),
            Arg::U32(1),
            ptr(&mut sums),
            ptr(&mut dx),
            Arg::count(total),
            Arg::div(c),
            Arg::div(s),
        ];
        launch(BN_BWD_DX.of(DType::F32), launch::elementwise(total), &args);
        close("batch norm dx", &dx, &f32s(&grads.dx), 1e-3);
    }
}

#[test]
fn pooling_windows_and_their_gradients_match_the_host() {
    let shape = [2, 3, 11, 10];
    let xv = values(660, 30, -4.0, 4.0);
    let x_t = tensor(&shape, &xv);
    for opts in
        [Pool2dOptions::new((2, 2), (2, 2)), Pool2dOptions::new((3, 3), (2, 1)).padding((1, 1))]
    {
        let p = ops::pool2d_params(&shape, &opts).unwrap();
        let (oh, ow) = p.output_hw();
        let ny = p.output_len();
        let geom = Arg::Pool(PoolGeom::of(&p));
        let (want, want_arg) = ops::max_pool2d(&x_t, &opts).unwrap();
        let (mut x, mut y, mut arg) = (xv.clone(), vec![0.0f32; ny], vec![0u32; ny]);
        let args = [ptr(&mut x), ptr(&mut y), ptr(&mut arg), geom, Arg::div(ow), Arg::div(oh)];
        if !launch(MAX_POOL.of(DType::F32), launch::elementwise(ny), &args) {
            return;
        }
        close("max_pool", &y, &f32s(&want), 0.0);
        assert_eq!(arg, want_arg.as_slice().unwrap(), "max_pool argmax");
        let dyv = values(ny, 31, -1.0, 1.0);
        let dy_t = tensor(want.shape(), &dyv);
        let want = ops::max_pool2d_backward(&dy_t, &want_arg, &shape, &opts).unwrap();
        let (mut dy, mut dx) = (dyv.clone(), vec![f32::NAN; 660]);
        let args = pool_bwd_args(&[ptr(&mut dy), ptr(&mut arg), ptr(&mut dx), geom], &shape, &p);
        launch(MAX_POOL_BWD.of(DType::F32), launch::elementwise(660), &args);
        // Gathered in the order the host scatters: the same sums, bit for bit.
        close("max_pool_backward", &dx, &f32s(&want), 0.0);
        for pad in [true, false] {
            let want = ops::avg_pool2d(&x_t, &opts, pad).unwrap();
            let mut y = vec![0.0f32; ny];
            let args =
                [ptr(&mut x), ptr(&mut y), geom, Arg::U32(pad as u32), Arg::div(ow), Arg::div(oh)];
            launch(AVG_POOL.of(DType::F32), launch::elementwise(ny), &args);
            close("avg_pool", &y, &f32s(&want), 1e-6);
            let want = ops::avg_pool2d_backward(&dy_t, &shape, &opts, pad).unwrap();
            let mut dx = vec![0.0f32; 660];
            let args = pool_bwd_args(
                &[ptr(&mut dy), ptr(&mut dx), geom, Arg::U32(pad as u32)],
                &shape,
                &p,
            );
            launch(AVG_POOL_BWD.of(DType::F32), launch::elementwise(660), &args);
            close("avg_pool_backward", &dx, &f32s(&want), 1e-6);
        }
    }
}

/// A pooling backward's arguments as `ops/pool.rs` passes them: `head` (through the
/// geometry and the divisor flag), then the input's width and height and the strides as
/// dividers.
fn pool_bwd_args(head: &[Arg], shape: &[usize], p: &Pool2dParams) -> Vec<Arg> {
    let mut args = head.to_vec();
    let (sh, sw) = p.stride();
    args.extend([Arg::div(shape[3]), Arg::div(shape[2]), Arg::div(sh), Arg::div(sw)]);
    args
}

/// im2col's columns by definition: `col[img][row][pos]` for images `n0 .. n0 + nimg` and
/// channel group `group`, with integer division.
fn im2col_reference(p: &Conv2dParams, x: &[f32], n0: usize, nimg: usize, group: usize) -> Vec<f32> {
    let (oh, ow) = p.output_hw();
    let ((kh, kw), (sh, sw), (ph, pw), (dh, dw)) =
        (p.kernel(), p.stride(), p.padding(), p.dilation());
    let (h, w, cin_g, k) = (p.h(), p.w(), p.c_in() / p.groups(), p.col_rows());
    let mut col = vec![0.0f32; nimg * k * oh * ow];
    for img in 0..nimg {
        for row in 0..k {
            let (c, ky, kx) = (row / (kh * kw), (row / kw) % kh, row % kw);
            for pos in 0..oh * ow {
                let (oy, ox) = (pos / ow, pos % ow);
                let iy = (oy * sh + ky * dh) as i64 - ph as i64;
                let ix = (ox * sw + kx * dw) as i64 - pw as i64;
                if iy >= 0 && (iy as usize) < h && ix >= 0 && (ix as usize) < w {
                    let plane = ((n0 + img) * p.c_in() + group * cin_g + c) * h * w;
                    col[(img * k + row) * oh * ow + pos] = x[plane + iy as usize * w + ix as usize];
                }
            }
        }
    }
    col
}

#[test]
fn convolution_kernels_match_the_host() {
    let cases = [
        ([3, 4, 12, 12], [6, 2, 3, 3], Conv2dOptions::default().stride((2, 2)).groups(2)),
        ([2, 3, 13, 11], [8, 3, 3, 3], Conv2dOptions::default().padding((1, 1))),
        ([3, 5, 9, 9], [4, 5, 3, 2], Conv2dOptions::default().dilation((2, 1)).padding((2, 0))),
        (
            [2, 6, 11, 11],
            [6, 1, 5, 5],
            Conv2dOptions::default().stride((2, 2)).padding((2, 2)).groups(6),
        ),
        ([1, 2, 20, 20], [2, 1, 3, 3], Conv2dOptions::default().padding((1, 1)).groups(2)),
    ];
    for (i, (xs, ws, opts)) in cases.iter().enumerate() {
        let p = ops::conv2d_params(xs, ws, opts).unwrap();
        let geom = Arg::Conv(ConvGeom::of(&p));
        let seed = 40 + 10 * i as u64;
        let (xv, wv, bv) = (
            values(xs.iter().product(), seed, -2.0, 2.0),
            values(ws.iter().product(), seed + 1, -1.0, 1.0),
            values(ws[0], seed + 2, -1.0, 1.0),
        );
        let (oh, ow) = p.output_hw();
        let (ohw, hw, ny) = (oh * ow, p.h() * p.w(), p.output_len());
        let mut want = vec![0.0f32; ny];
        crate::cpu::conv::conv2d(&p, &xv, &wv, Some(&bv), &mut want).unwrap();
        let (mut x, mut w, mut b, mut y) = (xv.clone(), wv.clone(), bv.clone(), vec![0.0f32; ny]);
        let args = [ptr(&mut x), ptr(&mut w), ptr(&mut b), Arg::U32(1), ptr(&mut y), geom];
        let planes = launch::per_plane(p.batch() * p.c_out(), ohw);
        if !launch(DIRECT_FWD.of(DType::F32), planes, &args) {
            return;
        }
        close(&format!("direct conv case {i}"), &y, &want, 1e-5);

        let dyv = values(ny, seed + 3, -1.0, 1.0);
        let (mut want_dx, mut want_dw) = (vec![0.0f32; xv.len()], vec![0.0f32; wv.len()]);
        crate::cpu::conv::conv2d_backward(
            &p,
            &xv,
            &wv,
            &dyv,
            Some(&mut want_dx),
            Some(&mut want_dw),
            None,
        )
        .unwrap();
        let (mut dy, mut dx, mut dw) =
            (dyv.clone(), vec![0.0f32; xv.len()], vec![0.0f32; wv.len()]);
        let args = [ptr(&mut w), ptr(&mut dy), ptr(&mut dx), geom];
        launch(DIRECT_BWD_INPUT.of(DType::F32), launch::per_plane(p.batch() * p.c_in(), hw), &args);
        close(&format!("direct conv dx case {i}"), &dx, &want_dx, 1e-5);
        let args = [ptr(&mut x), ptr(&mut dy), ptr(&mut dw), geom];
        launch(DIRECT_BWD_WEIGHT.of(DType::F32), launch::per_plane(wv.len(), ohw), &args);
        close(&format!("direct conv dweight case {i}"), &dw, &want_dw, 1e-4);

        // im2col of the last images of the last group, and col2im (its adjoint) back.
        let k = p.col_rows();
        let (group, n0) = (p.groups() - 1, p.batch() / 2);
        let nimg = p.batch() - n0;
        let want = im2col_reference(&p, &xv, n0, nimg, group);
        let mut col = vec![f32::NAN; want.len()];
        let args = [
            ptr(&mut x),
            ptr(&mut col),
            geom,
            Arg::I64(n0 as i64),
            Arg::I64(nimg as i64),
            Arg::I64(group as i64),
            Arg::U32(0),
        ];
        launch(IM2COL.of(DType::F32), launch::per_plane(nimg * k, ohw), &args);
        close(&format!("im2col case {i}"), &col, &want, 0.0);
        // The weight gradient's layout: the same matrices with rows outermost.
        let mut rows_outer = vec![f32::NAN; want.len()];
        let mut args = args;
        args[1] = ptr(&mut rows_outer);
        args[6] = Arg::U32(1);
        launch(IM2COL.of(DType::F32), launch::per_plane(nimg * k, ohw), &args);
        let want_rows_outer: Vec<f32> = (0..want.len())
            .map(|e| {
                let (row, img, pos) = (e / (nimg * ohw), e / ohw % nimg, e % ohw);
                want[(img * k + row) * ohw + pos]
            })
            .collect();
        close(&format!("im2col rows outer case {i}"), &rows_outer, &want_rows_outer, 0.0);
        // col2im: <im2col(x), dcol> = <x, col2im(dcol)> for every x, so col2im's output is
        // the sum of dcol over the column entries each input element was copied to.
        let mut dcol = values(want.len(), seed + 4, -1.0, 1.0);
        let mut want_dx = vec![0.0f32; xv.len()];
        let probe = |e: usize| {
            let mut unit = vec![0.0f32; xv.len()];
            unit[e] = 1.0;
            im2col_reference(&p, &unit, n0, nimg, group)
        };
        let cin_g = p.c_in() / p.groups();
        for img in n0..p.batch() {
            for c in group * cin_g..(group + 1) * cin_g {
                let plane = (img * p.c_in() + c) * hw;
                for (e, v) in want_dx.iter_mut().enumerate().skip(plane).take(hw) {
                    *v = probe(e).iter().zip(&dcol).map(|(u, d)| u * d).sum();
                }
            }
        }
        // As launched (each plane split over blocks where the planes are few), and with
        // every plane split over 3 blocks (of whole warps, whatever the plane's size).
        let mut forced = launch::per_plane(nimg * cin_g, hw);
        forced.grid_dim.1 = 3;
        for (how, cfg) in
            [("split", launch::per_plane_split(nimg * cin_g, hw)), ("3 parts", forced)]
        {
            let mut dx = vec![f32::NAN; xv.len()];
            let args = [
                ptr(&mut dcol),
                ptr(&mut dx),
                geom,
                Arg::I64(n0 as i64),
                Arg::I64(nimg as i64),
                Arg::I64(group as i64),
            ];
            launch(COL2IM.of(DType::F32), cfg, &args);
            // Planes outside the chunk and group stay unwritten (NaN).
            let plane_of = |e: usize| (e / (hw * p.c_in()), e / hw % p.c_in());
            let mine = |e: usize| {
                let (img, c) = plane_of(e);
                img >= n0 && c / cin_g == group
            };
            assert!(dx.iter().enumerate().all(|(e, v)| mine(e) != v.is_nan()), "col2im {how} {i}");
            let dx: Vec<f32> = dx.iter().map(|v| if v.is_nan() { 0.0 } else { *v }).collect();
            close(&format!("col2im {how} case {i}"), &dx, &want_dx, 1e-5);
        }
    }
}

#[test]
fn reductions_and_row_backwards_match_the_host() {
    // A whole-tensor sum in two passes, over several block counts.
    let n = 100_003;
    let xv = values(n, 60, -1.0, 1.0);
    let want = ops::sum(&tensor(&[n], &xv)).unwrap();
    for blocks in [1usize, 7, 40] {
        let (mut x, mut partial, mut total) = (xv.clone(), vec![f32::NAN; blocks], [f32::NAN]);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (launch::BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = [ptr(&mut x), Arg::count(n), ptr(&mut partial)];
        if !launch(SUM_PARTIAL.of(DType::F32), cfg, &args) {
            return;
        }
        let one = LaunchConfig { grid_dim: (1, 1, 1), ..cfg };
        let args = [ptr(&mut partial), Arg::U32(blocks as u32), ptr(&mut total)];
        launch(SUM_FINAL.of(DType::F32), one, &args);
        close(&format!("sum over {blocks} blocks"), &total, &[want], 1e-4);
    }

    // Row sums (a mean) and column sums (a bias gradient) of [rows, d], d past one block.
    let (rows, d) = (70, 300);
    let xv = values(rows * d, 61, -1.0, 1.0);
    let x_t = tensor(&[rows, d], &xv);
    let want = f32s(&ops::mean_last_dim(&x_t).unwrap());
    let (mut x, mut y) = (xv.clone(), vec![0.0f32; rows]);
    let args = [ptr(&mut x), ptr(&mut y), Arg::count(d), Arg::F32(1.0 / d as f32)];
    launch(ROW_SUM.of(DType::F32), launch::per_row(rows), &args);
    close("row_sum", &y, &want, 1e-5);
    column_sums_match_the_hosts_bit_for_bit();

    // Softmax backward from the host's output.
    let y_t = ops::softmax(&x_t).unwrap();
    let dyv = values(rows * d, 62, -1.0, 1.0);
    let dy_t = tensor(&[rows, d], &dyv);
    let want = f32s(&ops::softmax_backward(&y_t, &dy_t).unwrap());
    let (mut yv, mut dy, mut dx) = (f32s(&y_t), dyv.clone(), vec![0.0f32; rows * d]);
    let args = [ptr(&mut yv), ptr(&mut dy), ptr(&mut dx), Arg::count(d), Arg::count(0)];
    launch(SOFTMAX_BWD.of(DType::F32), launch::per_row(rows), &args);
    close("softmax_backward", &dx, &want, 1e-5);
}

/// The second pass of column sums, as `helpers::finish_column_sums` launches it: the
/// `[chunks, d]` partials added in chunk order.
fn finish_columns(partials: &mut [f32], d: usize) -> Vec<f32> {
    let chunks = partials.len() / d;
    let mut sums = vec![f32::NAN; d];
    let (mut cfg, _) = launch::columns(1, d);
    cfg.grid_dim.1 = 1;
    let args =
        [ptr(partials), ptr(&mut sums), Arg::count(chunks), Arg::count(d), Arg::count(chunks)];
    launch(COL_SUM.of(DType::F32), cfg, &args);
    sums
}

/// Column sums (a bias gradient) as `helpers::column_sums` runs them, over one chunk of
/// rows and over several, and with fewer block rows than chunks (blocks stride): the host's
/// sums, bit for bit (the same terms added in the same order).
fn column_sums_match_the_hosts_bit_for_bit() {
    let d = 300;
    for rows in [50, 70, 700] {
        let xv = values(rows * d, 65, -1.0, 1.0);
        let want = f32s(&ops::bias_add_backward(&tensor(&[rows, d], &xv)).unwrap());
        let (cfg, chunk) = launch::columns(rows, d);
        let chunks = rows.div_ceil(chunk);
        for grid_rows in [cfg.grid_dim.1, 2] {
            let cfg = LaunchConfig { grid_dim: (cfg.grid_dim.0, grid_rows, 1), ..cfg };
            let (mut x, mut partials) = (xv.clone(), vec![f32::NAN; chunks * d]);
            let args = [
                ptr(&mut x),
                ptr(&mut partials),
                Arg::count(rows),
                Arg::count(d),
                Arg::count(chunk),
            ];
            if !launch(COL_SUM.of(DType::F32), cfg, &args) {
                return;
            }
            let sums = if chunks > 1 { finish_columns(&mut partials, d) } else { partials };
            close(&format!("col_sum {rows} rows, {grid_rows} block rows"), &sums, &want, 0.0);
        }
    }
}

/// Layer norm's backward, both launches as the op makes them (dx and the partials of dgamma
/// and dbeta in one grid, then the partials added), over one chunk of rows and several, in
/// every dtype: dx within rounding of the host's, dgamma and dbeta added in the host's order
/// (dbeta bit for bit; dgamma's products may be fused on a GPU, not here).
fn layer_norm_backward_of<T: Element>(e: &super::emulate::Emulator, row_counts: &[usize]) {
    let d = 300;
    for &rows in row_counts {
        let xv = values(rows * d, 66, -1.0, 1.0);
        let dyv = values(rows * d, 67, -1.0, 1.0);
        let x_t = tensor_of::<T>(&[rows, d], &xv);
        let (gv, bv) = (values(d, 68, 0.5, 2.0), values(d, 69, -1.0, 1.0));
        let g_t = tensor_of::<T>(&[d], &gv);
        let fwd = ops::layer_norm(&x_t, &g_t, &tensor_of::<T>(&[d], &bv), 1e-5).unwrap();
        let dy_t = tensor_of::<T>(&[rows, d], &dyv);
        let want = ops::layer_norm_backward(&x_t, &g_t, &fwd.mean, &fwd.rstd, &dy_t).unwrap();
        let (mut x, mut g, mut dy) = (typed::<T>(&xv), typed::<T>(&gv), typed::<T>(&dyv));
        let (mut m, mut r) = (f32s(&fwd.mean), f32s(&fwd.rstd));
        let mut dx = vec![T::from_f32(f32::NAN); rows * d];
        let (mut dg, mut db) = (vec![T::from_f32(f32::NAN); d], vec![T::from_f32(f32::NAN); d]);
        let mut partials = vec![f32::NAN; 2 * rows.div_ceil(64) * d];
        let addr = |v: Arg| match v {
            Arg::Ptr(p) => p,
            _ => unreachable!("ptr gives a pointer"),
        };
        let at = ops::LayerNormBackwardAddresses {
            x: addr(ptr(&mut x)),
            gamma: addr(ptr(&mut g)),
            mean: addr(ptr(&mut m)),
            rstd: addr(ptr(&mut r)),
            dy: addr(ptr(&mut dy)),
            dx: addr(ptr(&mut dx)),
            dgamma: addr(ptr(&mut dg)),
            dbeta: addr(ptr(&mut db)),
            partials: addr(ptr(&mut partials)),
        };
        // SAFETY: every address is a host buffer of the size the launches address.
        unsafe { ops::layer_norm_backward_launches(e, &at, rows, d, T::DTYPE) }.unwrap();
        let what = format!("layer_norm_backward {:?} {rows} rows", T::DTYPE);
        close_rounded(&format!("{what} dx"), &dx, &want.dx);
        close(&format!("{what} dgamma"), &widen_f32(&dg), &f32s(&want.dgamma), 1e-5);
        close(&format!("{what} dbeta"), &widen_f32(&db), &f32s(&want.dbeta), 0.0);
    }
}

#[test]
fn layer_norm_backward_matches_the_host_in_two_launches() {
    let Some(e) = super::emulate::Emulator::new(LAYER_NORM_BWD_FUSED.of(DType::F32)) else {
        return;
    };
    // One chunk of rows; two, the second cut short; three (the emulation is slow per row).
    layer_norm_backward_of::<f32>(&e, &[1, 70, 130]);
    layer_norm_backward_of::<f16>(&e, &[70]);
    layer_norm_backward_of::<bf16>(&e, &[70]);
}

/// Dropout's mask is Philox4x32-10 of (seed, offset + index) on both backends: the same
/// elements are dropped, bit for bit, at any offset (also one not a multiple of 4).
#[test]
fn dropout_draws_the_hosts_mask() {
    let n = 1037;
    let xv = values(n, 70, 0.5, 2.0);
    for (p, seed, offset) in [(0.1f32, 7u64, 0u64), (0.5, 1 << 40, 13), (0.9, 3, 1 << 33)] {
        let want = f32s(&ops::dropout(&tensor(&[n], &xv), p, seed, offset).unwrap());
        let (mut x, mut y) = (xv.clone(), vec![f32::NAN; n]);
        let args = [
            ptr(&mut x),
            ptr(&mut y),
            Arg::count(n),
            Arg::F32(p),
            Arg::F32(1.0 / (1.0 - p)),
            Arg::U64(seed),
            Arg::U64(offset),
        ];
        if !launch(DROPOUT.of(DType::F32), launch::elementwise(n), &args) {
            return;
        }
        close(&format!("dropout p {p} seed {seed} offset {offset}"), &y, &want, 0.0);
        let dropped = y.iter().filter(|&&v| v == 0.0).count() as f32 / n as f32;
        assert!((dropped - p).abs() < 0.06, "dropout p {p}: {dropped} dropped");
    }
}

/// `v` rounded into `T` (as a tensor of `T` built from `v` holds it).
fn typed<T: Element>(v: &[f32]) -> Vec<T> {
    v.iter().map(|&x| T::from_f32(x)).collect()
}

/// The activations forward and backward (every unary map the registry lists, each through
/// its op), `scale`, `mul`, `fill`, and the mixed-type
/// in-place updates (`add_assign`, `axpy` into an f32 accumulator and into `T`), as the
/// ops launch them, bit for bit against the host (one f32 expression, one rounding, the same
/// `exp` in GELU and SiLU), on inputs that include each piecewise definition's edges.
fn maps_of_dtype<T: Element>() -> bool {
    let n = 1029;
    let mut xv = values(n, 80, -5.0, 5.0);
    xv[..8].copy_from_slice(&[0.0, -0.0, -3.0, 3.0, -6.0, 6.0, 1e-3, -1e-3]);
    let dyv = values(n, 81, -2.0, 2.0);
    let (xt, dyt) = (tensor_of::<T>(&[n], &xv), tensor_of::<T>(&[n], &dyv));
    let size = T::DTYPE.size_in_bytes();
    assert_eq!(ops::UNARY_OPS.len(), UNARY.len(), "unary ops and registered unary maps");
    for kernels in UNARY {
        let name = kernels.forward.names[0];
        let op = ops::UNARY_OPS.iter().find(|op| op.kernels.forward.names[0] == name);
        let Some(op) = op else { panic!("{name}: a registered unary map without an op") };
        let (fwd, bwd) = (op.forward, op.backward);
        let (kernel, bwd_kernel) = (kernels.forward.of(T::DTYPE), kernels.backward.of(T::DTYPE));
        let name = op.name;
        let (mut x, mut dy) = (typed::<T>(&xv), typed::<T>(&dyv));
        let mut y = vec![T::from_f32(f32::NAN); n];
        if !launch(kernel, launch::map(n, size), &[ptr(&mut x), ptr(&mut y), Arg::count(n)]) {
            return false;
        }
        let what = format!("{name} {:?}", T::DTYPE);
        close(&what, &widen_f32(&y), &f32s(&fwd(&xt).unwrap()), 0.0);
        let args = [ptr(&mut x), ptr(&mut dy), ptr(&mut y), Arg::count(n)];
        launch(bwd_kernel, launch::map(n, size), &args);
        close(&format!("{what} backward"), &widen_f32(&y), &f32s(&bwd(&xt, &dyt).unwrap()), 0.0);
    }

    let (mut x, mut dy) = (typed::<T>(&xv), typed::<T>(&dyv));
    let mut y = vec![T::from_f32(f32::NAN); n];
    let args = [ptr(&mut x), Arg::F32(-0.37), ptr(&mut y), Arg::count(n)];
    launch(SCALE.of(T::DTYPE), launch::map(n, size), &args);
    close("scale", &widen_f32(&y), &f32s(&ops::scale(&xt, -0.37).unwrap()), 0.0);
    let args = [ptr(&mut x), ptr(&mut dy), ptr(&mut y), Arg::count(n)];
    launch(MUL.of(T::DTYPE), launch::map(n, size), &args);
    close("mul", &widen_f32(&y), &f32s(&ops::mul(&xt, &dyt).unwrap()), 0.0);
    let args = [ptr(&mut y), Arg::F32(0.1), Arg::count(n)];
    launch(FILL.of(T::DTYPE), launch::map(n, size), &args);
    close("fill", &widen_f32(&y), &vec![T::from_f32(0.1).to_f32(); n], 0.0);

    // In-place updates of an accumulator of every dtype by x of T (the packs of the wider).
    let accv = values(n, 82, -3.0, 3.0);
    for acc_dtype in DType::ALL {
        let grid = launch::map(n, size.max(acc_dtype.size_in_bytes()));
        let mut acc_t = Tensor::from_f32_slice(host(), &[n], &accv, acc_dtype).unwrap();
        ops::add_assign(&mut acc_t, &xt).unwrap();
        let mut acc = accv.clone();
        let got = with_typed(acc_dtype, &mut acc, |acc| {
            launch(
                ADD_ASSIGN.of_pair(acc_dtype, T::DTYPE),
                grid,
                &[acc, ptr(&mut x), Arg::count(n)],
            );
        });
        close(&format!("add_assign {acc_dtype:?} += {:?}", T::DTYPE), &got, &f32s(&acc_t), 0.0);
        let mut acc_t = Tensor::from_f32_slice(host(), &[n], &accv, acc_dtype).unwrap();
        ops::axpy(0.25, &xt, &mut acc_t).unwrap();
        let mut acc = accv.clone();
        let got = with_typed(acc_dtype, &mut acc, |acc| {
            let args = [Arg::F32(0.25), ptr(&mut x), acc, Arg::count(n)];
            launch(AXPY.of_pair(acc_dtype, T::DTYPE), grid, &args);
        });
        close(&format!("axpy {acc_dtype:?} += {:?}", T::DTYPE), &got, &f32s(&acc_t), 0.0);
    }
    true
}

/// Runs `f` on `v` rounded into `dtype` (its pointer as the argument) and returns the
/// result widened back to f32.
fn with_typed(dtype: DType, v: &mut [f32], f: impl FnOnce(Arg)) -> Vec<f32> {
    fn run<T: Element>(v: &[f32], f: impl FnOnce(Arg)) -> Vec<f32> {
        let mut t = typed::<T>(v);
        f(ptr(&mut t));
        widen_f32(&t).into_owned()
    }
    match dtype {
        DType::F32 => run::<f32>(v, f),
        DType::F16 => run::<f16>(v, f),
        DType::BF16 => run::<bf16>(v, f),
    }
}

#[test]
fn activations_and_in_place_maps_match_the_host_bit_for_bit() {
    if maps_of_dtype::<f32>() {
        assert!(maps_of_dtype::<f16>() && maps_of_dtype::<bf16>());
    }
}

/// SGD (plain; momentum over two steps, the first taking the gradient as the buffer;
/// Nesterov with weight decay; dampening) and AdamW (steps 1 and 2, the op's per-step
/// scalars) on f32 parameters with gradients of `T`, and the fused unscale with its
/// non-finite flag, as the ops launch them, bit for bit against the host.
fn updates_of_dtype<T: Element>() -> bool {
    let n = 1031;
    let (pv, gv1, gv2) =
        (values(n, 90, -1.0, 1.0), values(n, 91, -0.5, 0.5), values(n, 92, -0.5, 0.5));
    let grads = [tensor_of::<T>(&[n], &gv1), tensor_of::<T>(&[n], &gv2)];
    let sgd = [
        SgdConfig { lr: 0.1, ..SgdConfig::default() },
        SgdConfig { lr: 0.05, momentum: 0.9, ..SgdConfig::default() },
        SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            weight_decay: 1e-2,
            nesterov: true,
            ..SgdConfig::default()
        },
        SgdConfig { lr: 0.05, momentum: 0.5, dampening: 0.3, ..SgdConfig::default() },
    ];
    for cfg in sgd {
        let mut p_t = tensor(&[n], &pv);
        let mut b_t = tensor(&[n], &vec![0.0; n]);
        let (mut p, mut b) = (pv.clone(), vec![0.0f32; n]);
        for (step, (g_t, gv)) in grads.iter().zip([&gv1, &gv2]).enumerate() {
            let buf = (cfg.momentum != 0.0).then_some(&mut b_t);
            ops::sgd_step(&mut p_t, g_t, buf, step == 0, &cfg).unwrap();
            let mut g = typed::<T>(gv);
            let buf = if cfg.momentum != 0.0 { ptr(&mut b) } else { Arg::Ptr(0) };
            let [lr, mo, da, wd, ne, fi] = ops::sgd_scalars(&cfg, step == 0);
            let args = [ptr(&mut p), ptr(&mut g), buf, Arg::count(n), lr, mo, da, wd, ne, fi];
            if !launch(SGD.of(T::DTYPE), launch::elementwise(n), &args) {
                return false;
            }
            let what = format!("sgd {:?} {cfg:?} step {}", T::DTYPE, step + 1);
            close(&what, &p, &f32s(&p_t), 0.0);
            if cfg.momentum != 0.0 {
                close(&format!("{what} buffer"), &b, &f32s(&b_t), 0.0);
            }
        }
    }

    let cfg = AdamWConfig { lr: 1e-2, weight_decay: 0.1, ..AdamWConfig::default() };
    let zeros = vec![0.0f32; n];
    let (mut p_t, mut m_t, mut v_t) =
        (tensor(&[n], &pv), tensor(&[n], &zeros), tensor(&[n], &zeros));
    let (mut p, mut m, mut v) = (pv.clone(), zeros.clone(), zeros);
    for (step, (g_t, gv)) in (1..).zip(grads.iter().zip([&gv1, &gv2])) {
        ops::adamw_step(&mut p_t, g_t, &mut m_t, &mut v_t, step, &cfg).unwrap();
        let [b1, b2, eps, step_size, bias2_sqrt, decay] = ops::adamw_scalars(&cfg, step);
        let mut g = typed::<T>(gv);
        let args = [
            ptr(&mut p),
            ptr(&mut g),
            ptr(&mut m),
            ptr(&mut v),
            Arg::count(n),
            b1,
            b2,
            eps,
            step_size,
            bias2_sqrt,
            decay,
        ];
        launch(ADAMW.of(T::DTYPE), launch::elementwise(n), &args);
        let what = format!("adamw {:?} step {step}", T::DTYPE);
        close(&what, &p, &f32s(&p_t), 0.0);
        close(&format!("{what} exp_avg"), &m, &f32s(&m_t), 0.0);
        close(&format!("{what} exp_avg_sq"), &v, &f32s(&v_t), 0.0);
    }

    // Unscale: all finite (the flag stays 0), then one inf and one NaN among the elements.
    let scaled = values(n, 93, -6e4, 6e4);
    for bad in [None, Some((17, f32::INFINITY)), Some((n - 1, f32::NAN))] {
        let mut gv = scaled.clone();
        if let Some((i, x)) = bad {
            gv[i] = x;
        }
        let mut g_t = tensor_of::<T>(&[n], &gv);
        let want_found = ops::unscale_and_check_finite(&mut [&mut g_t], 1.0 / 1024.0).unwrap();
        let (mut g, mut flag) = (typed::<T>(&gv), [0u32]);
        let args = [ptr(&mut g), Arg::F32(1.0 / 1024.0), Arg::count(n), ptr(&mut flag)];
        launch(UNSCALE.of(T::DTYPE), launch::elementwise(n), &args);
        let what = format!("unscale {:?} with {bad:?}", T::DTYPE);
        assert_eq!(flag[0] != 0, want_found, "{what}: the found-non-finite flag");
        assert_eq!(want_found, bad.is_some(), "{what}: the host's flag");
        let (got, want) = (widen_f32(&g), f32s(&g_t));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(g == w || (g.is_nan() && w.is_nan()), "{what}: index {i}: {g} vs {w}");
        }
    }
    true
}

#[test]
fn optimizer_steps_and_unscale_match_the_host_bit_for_bit() {
    if updates_of_dtype::<f32>() {
        assert!(updates_of_dtype::<f16>() && updates_of_dtype::<bf16>());
    }
}

/// One unit in the last place of `T` at 1 (the tolerance of a result rounded once into
/// `T` from an f32 computed in another order).
fn ulp<T: Element>() -> f32 {
    match T::DTYPE {
        DType::F32 => 1e-5,
        DType::F16 => 1.0 / 1024.0,
        DType::BF16 => 1.0 / 128.0,
    }
}

/// The row kernels in `T` (softmax plain and causal over rows longer than a block, layer
/// norm, cross-entropy forward and backward with an ignored row), squeeze-excitation's backward, the per-plane f32 sums of a convolution's bias
/// gradient and batch norm in evaluation (parameters in f32 and in `T`), against the host's
/// ops on tensors of `T`.
fn rows_of_dtype<T: Element>() -> bool {
    let dt = T::DTYPE;
    let (rows, cols) = (5, 300);
    let xv = values(rows * cols, 100, -6.0, 6.0);
    let x_t = tensor_of::<T>(&[rows, cols], &xv);
    let (mut x, mut y) = (typed::<T>(&xv), vec![T::from_f32(f32::NAN); rows * cols]);
    let args = [ptr(&mut x), ptr(&mut y), Arg::count(cols), Arg::count(0)];
    if !launch(SOFTMAX_FWD.of(dt), launch::per_row(rows), &args) {
        return false;
    }
    close_rounded(&format!("softmax {dt:?}"), &y, &ops::softmax(&x_t).unwrap());
    let seq = 30;
    let cv = values(2 * seq * seq, 101, -6.0, 6.0);
    let want = ops::causal_softmax(&tensor_of::<T>(&[2, seq, seq], &cv)).unwrap();
    let (mut c, mut y) = (typed::<T>(&cv), vec![T::from_f32(f32::NAN); 2 * seq * seq]);
    let args = [ptr(&mut c), ptr(&mut y), Arg::count(seq), Arg::count(seq)];
    launch(SOFTMAX_FWD.of(dt), launch::per_row(2 * seq), &args);
    close_rounded(&format!("causal softmax {dt:?}"), &y, &want);

    let (gv, bv) = (values(cols, 102, 0.5, 2.0), values(cols, 103, -1.0, 1.0));
    let ln =
        ops::layer_norm(&x_t, &tensor_of::<T>(&[cols], &gv), &tensor_of::<T>(&[cols], &bv), 1e-5)
            .unwrap();
    let (mut g, mut b) = (typed::<T>(&gv), typed::<T>(&bv));
    let mut y = vec![T::from_f32(f32::NAN); rows * cols];
    let (mut m, mut r) = (vec![0.0f32; rows], vec![0.0f32; rows]);
    let args = [
        ptr(&mut x),
        ptr(&mut g),
        ptr(&mut b),
        Arg::F32(1e-5),
        ptr(&mut y),
        ptr(&mut m),
        ptr(&mut r),
        Arg::count(cols),
    ];
    launch(LAYER_NORM.of(dt), launch::per_row(rows), &args);
    close_rounded(&format!("layer_norm {dt:?} y"), &y, &ln.y);
    close(&format!("layer_norm {dt:?} mean"), &m, &f32s(&ln.mean), 1e-5);
    close(&format!("layer_norm {dt:?} rstd"), &r, &f32s(&ln.rstd), 1e-4);

    // Cross-entropy over 7 rows of 1000 classes, one row ignored; statistics in f32.
    let (n, c) = (7, 1000);
    let lv = values(n * c, 111, -5.0, 5.0);
    let logits = tensor_of::<T>(&[n, c], &lv);
    let targets: Vec<u32> = (0..n as u32).map(|i| i * 137 % c as u32).collect();
    let ignore = Some(targets[3]);
    let ce = ops::cross_entropy(&logits, &targets, ignore).unwrap();
    let (mut l, mut t) = (typed::<T>(&lv), targets.clone());
    let (mut lse, mut loss) = (vec![0.0f32; n], vec![0.0f32; n]);
    let args = [
        ptr(&mut l),
        ptr(&mut t),
        Arg::count(c),
        Arg::U32(targets[3]),
        Arg::U32(1),
        ptr(&mut lse),
        ptr(&mut loss),
    ];
    launch(CE_FWD.of(dt), launch::per_row(n), &args);
    close(&format!("cross_entropy {dt:?} lse"), &lse, &f32s(&ce.lse), 1e-5);
    let kept = targets.iter().filter(|&&v| Some(v) != ignore).count();
    let mean = loss.iter().sum::<f32>() / kept as f32;
    close(&format!("cross_entropy {dt:?} loss"), &[mean], &[ce.loss], 1e-5);
    let want = ops::cross_entropy_backward(&logits, &targets, ignore, &ce.lse, 1.0).unwrap();
    let mut dx = vec![T::from_f32(f32::NAN); n * c];
    let args = [
        ptr(&mut l),
        ptr(&mut t),
        ptr(&mut lse),
        Arg::F32(1.0 / kept as f32),
        Arg::div(c),
        Arg::U32(targets[3]),
        Arg::U32(1),
        ptr(&mut dx),
        Arg::count(n * c),
    ];
    launch(CE_BWD.of(dt), launch::elementwise(n * c), &args);
    close_rounded(&format!("cross_entropy_backward {dt:?}"), &dx, &want);

    // Squeeze-excitation's backward over planes of 300 (past one block's threads).
    let (planes, hw) = (6, 300);
    let shape = [2, 3, 15, 20];
    let (xv, sv, dyv) = (
        values(planes * hw, 104, -2.0, 2.0),
        values(planes, 105, 0.0, 1.0),
        values(planes * hw, 106, -1.0, 1.0),
    );
    let want = ops::scale_channels_backward(
        &tensor_of::<T>(&shape, &xv),
        &tensor_of::<T>(&[2, 3], &sv),
        &tensor_of::<T>(&shape, &dyv),
    )
    .unwrap();
    let (mut x, mut s, mut dy) = (typed::<T>(&xv), typed::<T>(&sv), typed::<T>(&dyv));
    let (mut dx, mut ds) =
        (vec![T::from_f32(f32::NAN); planes * hw], vec![T::from_f32(f32::NAN); planes]);
    let args = [ptr(&mut x), ptr(&mut s), ptr(&mut dy), ptr(&mut dx), ptr(&mut ds), Arg::count(hw)];
    launch(SCALE_CHANNELS_BWD.of(dt), launch::per_row(planes), &args);
    close(&format!("scale_channels_backward {dt:?} dx"), &widen_f32(&dx), &f32s(&want.dx), 0.0);
    close_rounded(&format!("scale_channels_backward {dt:?} ds"), &ds, &want.ds);

    // Per-plane f32 sums (the first pass of a convolution's bias gradient), by definition.
    let mut sums = vec![f32::NAN; planes];
    let args = [ptr(&mut dy), ptr(&mut sums), Arg::count(hw)];
    launch(ROW_SUM_F32.of(dt), launch::per_row(planes), &args);
    let want: Vec<f32> = widen_f32(&dy)
        .chunks(hw)
        .map(|p| p.iter().map(|&v| f64::from(v)).sum::<f64>() as f32)
        .collect();
    close(&format!("row_sum_f32 {dt:?}"), &sums, &want, 1e-5);

    // Batch norm in evaluation: the running statistics into mean and invstd, then applied.
    let c = 3;
    let (mv, vv) = (values(c, 107, -0.5, 0.5), values(c, 108, 0.5, 2.0));
    let (gv, bv) = (values(c, 109, 0.5, 1.5), values(c, 110, -0.5, 0.5));
    let mut param_dtypes = vec![DType::F32];
    if dt != DType::F32 {
        param_dtypes.push(dt);
    }
    for pdt in param_dtypes {
        let p = |v: &[f32]| Tensor::from_f32_slice(host(), &[c], v, pdt).unwrap();
        let want = ops::batch_norm_eval(
            &tensor_of::<T>(&shape, &xv),
            &p(&gv),
            &p(&bv),
            &p(&mv),
            &p(&vv),
            1e-5,
        )
        .unwrap();
        // The parameters as the kernels read them: f32, or T when pf32 is 0.
        let mut wide = [mv.clone(), vv.clone(), gv.clone(), bv.clone()];
        let mut narrow = [&mv, &vv, &gv, &bv].map(|v| typed::<T>(v));
        let mut raw =
            |i: usize| if pdt == DType::F32 { ptr(&mut wide[i]) } else { ptr(&mut narrow[i]) };
        let (mut mean, mut inv) = (vec![f32::NAN; c], vec![f32::NAN; c]);
        let pf32 = Arg::U32((pdt == DType::F32) as u32);
        let args =
            [raw(0), raw(1), pf32, Arg::F32(1e-5), ptr(&mut mean), ptr(&mut inv), Arg::count(c)];
        launch(BN_EVAL_STATS.of(dt), launch::elementwise(c), &args);
        let mut y = vec![T::from_f32(f32::NAN); planes * hw];
        let args = [
            ptr(&mut x),
            ptr(&mut mean),
            ptr(&mut inv),
            raw(2),
            raw(3),
            pf32,
            ptr(&mut y),
            Arg::count(planes * hw),
            Arg::div(c),
            Arg::div(hw),
        ];
        launch(BN_APPLY.of(dt), launch::elementwise(planes * hw), &args);
        close(&format!("batch_norm_eval {dt:?} params {pdt:?}"), &widen_f32(&y), &f32s(&want), 0.0);
    }
    true
}

/// The channels_last batch norm as `batch_norm_nhwc` and `batch_norm_backward_nhwc` launch
/// it on a GPU (`bn_nhwc_partial`, then `bn_finalize`, `bn_apply` with `s = 1`; the
/// backward's `bn_nhwc_bwd_partial`, `bn_bwd_finalize`, `bn_bwd_dx`), input in `T` and
/// parameters in `P`, against the host ops: several parts of uneven rows, a last block of
/// channels only partly filled, one channel. Returns false where no C++ compiler is.
fn batch_norm_nhwc_of<T: Element, P: Element>() -> bool {
    let (t, pt) = (T::DTYPE, P::DTYPE);
    // The 16-bit outputs are rounded from statistics merged in another order than the host's.
    let tol = if t == DType::F32 { 1e-4 } else { 1e-2 };
    for (case, shape) in [[5, 7, 9, 40], [16, 32, 32, 4], [3, 1, 2, 1]].iter().enumerate() {
        let (rows, c) = (shape[0] * shape[1] * shape[2], shape[3]);
        let total = rows * c;
        let parts = ops::batch_norm::nhwc_parts(rows, c);
        assert_eq!(parts, [2, 16, 1][case], "{shape:?}");
        let seed = 300 + 10 * case as u64;
        let (xv, gv, bv) = (
            values(total, seed, -3.0, 5.0),
            values(c, seed + 1, 0.5, 2.0),
            values(c, seed + 2, -1.0, 1.0),
        );
        let p = |v: &[f32]| Tensor::from_f32_slice(host(), &[c], v, pt).unwrap();
        let (mut rm_t, mut rv_t) = (p(&vec![0.5; c]), p(&vec![2.0; c]));
        let running = ops::RunningStats { mean: &mut rm_t, var: &mut rv_t, momentum: 0.1 };
        let (x_t, g_t) = (tensor_of::<T>(shape, &xv), p(&gv));
        let want = ops::batch_norm_nhwc(&x_t, &g_t, &p(&bv), Some(running), 1e-5).unwrap();

        let mut x = typed::<T>(&xv);
        let (mut g, mut b) = (typed::<P>(&gv), typed::<P>(&bv));
        let blocks = c.div_ceil(ops::batch_norm::NHWC_LANES);
        let mut part = vec![f32::NAN; 2 * c * parts];
        let args =
            [ptr(&mut x), ptr(&mut part), Arg::count(rows), Arg::count(c), Arg::U32(parts as u32)];
        if !launch(BN_NHWC_PARTIAL.of(t), launch::per_row_parts(blocks, parts), &args) {
            return false;
        }
        assert!(part.iter().all(|v| v.is_finite()), "every part of every channel written");
        let (mut mean, mut inv) = (vec![0.0f32; c], vec![0.0f32; c]);
        let (mut rm, mut rv) = (typed::<P>(&vec![0.5; c]), typed::<P>(&vec![2.0; c]));
        let pf32 = Arg::U32((pt == DType::F32) as u32);
        let args = [
            ptr(&mut part),
            ptr(&mut mean),
            ptr(&mut inv),
            ptr(&mut rm),
            ptr(&mut rv),
            pf32,
            Arg::U32(1),
            Arg::F32(0.1),
            Arg::F32(1e-5),
            Arg::count(rows),
            Arg::count(c),
            Arg::count(1),
            Arg::U32(parts as u32),
        ];
        launch(BN_FINALIZE.of(t), launch::elementwise(c), &args);
        let what = format!("batch_norm_nhwc {shape:?} {t:?} params {pt:?}");
        close(&format!("{what} mean"), &mean, &f32s(&want.mean), 1e-5);
        close(&format!("{what} invstd"), &inv, &f32s(&want.invstd), 1e-4);
        let ptol = if pt == DType::F32 { 1e-4 } else { 1e-2 };
        close(&format!("{what} running mean"), &widen_f32(&rm), &f32s(&rm_t), ptol);
        close(&format!("{what} running var"), &widen_f32(&rv), &f32s(&rv_t), ptol);
        let mut y = vec![T::from_f32(f32::NAN); total];
        let args = [
            ptr(&mut x),
            ptr(&mut mean),
            ptr(&mut inv),
            ptr(&mut g),
            ptr(&mut b),
            pf32,
            ptr(&mut y),
            Arg::count(total),
            Arg::div(c),
            Arg::div(1),
        ];
        launch(BN_APPLY.of(t), launch::elementwise(total), &args);
        close(&format!("{what} y"), &widen_f32(&y), &f32s(&want.y), tol);

        // Backward from the host's saved statistics.
        let dyv = values(total, seed + 3, -1.0, 1.0);
        let dy_t = tensor_of::<T>(shape, &dyv);
        let grads =
            ops::batch_norm_backward_nhwc(&x_t, &g_t, &want.mean, &want.invstd, &dy_t, 1e-5)
                .unwrap();
        let (mut dy, mut mean, mut inv) = (typed::<T>(&dyv), f32s(&want.mean), f32s(&want.invstd));
        let mut part = vec![f32::NAN; 2 * c * parts];
        let args = [
            ptr(&mut x),
            ptr(&mut dy),
            ptr(&mut mean),
            ptr(&mut inv),
            ptr(&mut part),
            Arg::count(rows),
            Arg::count(c),
            Arg::U32(parts as u32),
        ];
        launch(BN_NHWC_BWD_PARTIAL.of(t), launch::per_row_parts(blocks, parts), &args);
        assert!(part.iter().all(|v| v.is_finite()), "every part of every channel written");
        let mut sums = vec![f32::NAN; 2 * c];
        let args = [ptr(&mut part), ptr(&mut sums), Arg::count(c), Arg::U32(parts as u32)];
        launch(BN_BWD_FINALIZE.of(DType::F32), launch::elementwise(c), &args);
        // The host's sums are f64 rounded once into P: compare with P's rounding allowed.
        let stol = if pt == DType::F32 { 1e-3 } else { 1e-2 };
        close(&format!("{what} dgamma"), &sums[..c], &f32s(&grads.dgamma), stol);
        close(&format!("{what} dbeta"), &sums[c..], &f32s(&grads.dbeta), stol);
        let mut dx = vec![T::from_f32(f32::NAN); total];
        let args = [
            ptr(&mut x),
            ptr(&mut dy),
            ptr(&mut mean),
            ptr(&mut inv),
            ptr(&mut g),
            pf32,
            ptr(&mut sums),
            ptr(&mut dx),
            Arg::count(total),
            Arg::div(c),
            Arg::div(1),
        ];
        launch(BN_BWD_DX.of(t), launch::elementwise(total), &args);
        close(&format!("{what} dx"), &widen_f32(&dx), &f32s(&grads.dx), tol.max(1e-3));
    }
    true
}

#[test]
fn channels_last_batch_norm_kernels_match_the_host() {
    if batch_norm_nhwc_of::<f32, f32>() {
        assert!(batch_norm_nhwc_of::<bf16, f32>());
        assert!(batch_norm_nhwc_of::<bf16, bf16>());
        assert!(batch_norm_nhwc_of::<f16, f32>());
    }
}

#[test]
fn row_channel_and_eval_kernels_match_the_host_in_every_dtype() {
    if rows_of_dtype::<f32>() {
        assert!(rows_of_dtype::<f16>() && rows_of_dtype::<bf16>());
    }
}

/// `got` (computed in f32 in another order, rounded once into `T`) against `want` (the
/// host's, rounded once): within one unit in the last place of `T` at each value, plus the
/// f32 sums' own difference (1e-5 of the largest value, for sums that cancel).
fn close_rounded<T: Element>(what: &str, got: &[T], want: &Tensor) {
    let want = f32s(want);
    let scale = want.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    for (i, (g, &w)) in got.iter().zip(&want).enumerate() {
        let g = g.to_f32();
        assert!(
            (g - w).abs() <= ulp::<T>() * w.abs() + 1e-5 * scale,
            "{what}: index {i}: emulated {g}, host {w}"
        );
    }
    assert_eq!(got.len(), want.len(), "{what}: length");
}

/// The direct convolutions (forward, dx, dweight) of a depthwise and a small dense case,
/// im2col, and max and average pooling with their gradients, on tensors of `T`, against the
/// host's ops in `T` (f32 arithmetic, one rounding).
fn windows_of_dtype<T: Element>() -> bool {
    let dt = T::DTYPE;
    let cases = [
        (
            [2, 6, 11, 11],
            [6, 1, 5, 5],
            Conv2dOptions::default().stride((2, 2)).padding((2, 2)).groups(6),
        ),
        ([2, 3, 9, 9], [4, 3, 3, 3], Conv2dOptions::default().padding((1, 1))),
    ];
    for (i, (xs, ws, opts)) in cases.iter().enumerate() {
        let p = ops::conv2d_params(xs, ws, opts).unwrap();
        assert!(p.is_direct(), "case {i} takes the direct kernels");
        let geom = Arg::Conv(ConvGeom::of(&p));
        let (xv, wv, bv) = (
            values(xs.iter().product(), 120 + i as u64, -2.0, 2.0),
            values(ws.iter().product(), 121, -1.0, 1.0),
            values(ws[0], 122, -1.0, 1.0),
        );
        let (x_t, w_t, b_t) =
            (tensor_of::<T>(xs, &xv), tensor_of::<T>(ws, &wv), tensor_of::<T>(&[ws[0]], &bv));
        let want = ops::conv2d(&x_t, &w_t, Some(&b_t), opts).unwrap();
        let (mut x, mut w, mut b) = (typed::<T>(&xv), typed::<T>(&wv), typed::<T>(&bv));
        let (oh, ow) = p.output_hw();
        let mut y = vec![T::from_f32(f32::NAN); p.output_len()];
        let args = [ptr(&mut x), ptr(&mut w), ptr(&mut b), Arg::U32(1), ptr(&mut y), geom];
        if !launch(DIRECT_FWD.of(dt), launch::per_plane(p.batch() * p.c_out(), oh * ow), &args) {
            return false;
        }
        close_rounded(&format!("direct conv {dt:?} case {i}"), &y, &want);
        let dyv = values(p.output_len(), 123, -1.0, 1.0);
        let dy_t = tensor_of::<T>(want.shape(), &dyv);
        let grads = ops::conv2d_backward(&x_t, &w_t, &dy_t, opts, false).unwrap();
        let mut dy = typed::<T>(&dyv);
        let mut dx = vec![T::from_f32(f32::NAN); xv.len()];
        let args = [ptr(&mut w), ptr(&mut dy), ptr(&mut dx), geom];
        launch(
            DIRECT_BWD_INPUT.of(dt),
            launch::per_plane(p.batch() * p.c_in(), p.h() * p.w()),
            &args,
        );
        close_rounded(&format!("direct conv dx {dt:?} case {i}"), &dx, &grads.dx);
        let mut dw = vec![T::from_f32(f32::NAN); wv.len()];
        let args = [ptr(&mut x), ptr(&mut dy), ptr(&mut dw), geom];
        launch(DIRECT_BWD_WEIGHT.of(dt), launch::per_plane(wv.len(), oh * ow), &args);
        close_rounded(&format!("direct conv dweight {dt:?} case {i}"), &dw, &grads.dweight);

        // im2col copies: exact in any dtype.
        let want: Vec<f32> = im2col_reference(&p, &widen_f32(&x), 0, p.batch(), 0);
        let mut col = vec![T::from_f32(f32::NAN); want.len()];
        let args = [
            ptr(&mut x),
            ptr(&mut col),
            geom,
            Arg::I64(0),
            Arg::I64(p.batch() as i64),
            Arg::I64(0),
            Arg::U32(0),
        ];
        launch(IM2COL.of(dt), launch::per_plane(p.batch() * p.col_rows(), oh * ow), &args);
        close(&format!("im2col {dt:?} case {i}"), &widen_f32(&col), &want, 0.0);
    }

    let shape = [2, 3, 11, 10];
    let xv = values(660, 124, -4.0, 4.0);
    let x_t = tensor_of::<T>(&shape, &xv);
    let opts = Pool2dOptions::new((3, 3), (2, 1)).padding((1, 1));
    let p = ops::pool2d_params(&shape, &opts).unwrap();
    let (oh, ow) = p.output_hw();
    let ny = p.output_len();
    let geom = Arg::Pool(PoolGeom::of(&p));
    let (want, want_arg) = ops::max_pool2d(&x_t, &opts).unwrap();
    let mut x = typed::<T>(&xv);
    let (mut y, mut arg) = (vec![T::from_f32(f32::NAN); ny], vec![0u32; ny]);
    let args = [ptr(&mut x), ptr(&mut y), ptr(&mut arg), geom, Arg::div(ow), Arg::div(oh)];
    launch(MAX_POOL.of(dt), launch::elementwise(ny), &args);
    close(&format!("max_pool {dt:?}"), &widen_f32(&y), &f32s(&want), 0.0);
    assert_eq!(arg, want_arg.as_slice().unwrap(), "max_pool {dt:?} argmax");
    let dyv = values(ny, 125, -1.0, 1.0);
    let dy_t = tensor_of::<T>(want.shape(), &dyv);
    let want = ops::max_pool2d_backward(&dy_t, &want_arg, &shape, &opts).unwrap();
    let (mut dy, mut dx) = (typed::<T>(&dyv), vec![T::from_f32(f32::NAN); 660]);
    let args = pool_bwd_args(&[ptr(&mut dy), ptr(&mut arg), ptr(&mut dx), geom], &shape, &p);
    launch(MAX_POOL_BWD.of(dt), launch::elementwise(660), &args);
    // Summed in f32 in the host's order and rounded once into T, as the host does.
    close(&format!("max_pool_backward {dt:?}"), &widen_f32(&dx), &f32s(&want), 0.0);
    let want = ops::avg_pool2d(&x_t, &opts, true).unwrap();
    let mut y = vec![T::from_f32(f32::NAN); ny];
    let args = [ptr(&mut x), ptr(&mut y), geom, Arg::U32(1), Arg::div(ow), Arg::div(oh)];
    launch(AVG_POOL.of(dt), launch::elementwise(ny), &args);
    close(&format!("avg_pool {dt:?}"), &widen_f32(&y), &f32s(&want), ulp::<T>());
    let want = ops::avg_pool2d_backward(&dy_t, &shape, &opts, true).unwrap();
    let mut dx = vec![T::from_f32(f32::NAN); 660];
    let args = pool_bwd_args(&[ptr(&mut dy), ptr(&mut dx), geom, Arg::U32(1)], &shape, &p);
    launch(AVG_POOL_BWD.of(dt), launch::elementwise(660), &args);
    close(&format!("avg_pool_backward {dt:?}"), &widen_f32(&dx), &f32s(&want), ulp::<T>());
    true
}

#[test]
fn convolution_and_pooling_kernels_match_the_host_in_16_bits() {
    if windows_of_dtype::<f16>() {
        assert!(windows_of_dtype::<bf16>());
    }
}

/// RMS norm forward and backward (the row kernels and the weight's column sums, over one
/// chunk and several) and rotary embeddings forward and backward, in `T`, as the ops launch
/// them, against the host's ops on tensors of `T`.
fn llama_of_dtype<T: Element>() -> bool {
    let dt = T::DTYPE;
    let tol = match dt {
        DType::F32 => 1e-5,
        DType::F16 => 2.0 / 1024.0,
        DType::BF16 => 2.0 / 128.0,
    };
    let d = 300;
    for rows in [5usize, 70, 200] {
        let (xv, wv, dyv) = (
            values(rows * d, 120, -3.0, 3.0),
            values(d, 121, 0.5, 2.0),
            values(rows * d, 122, -1.0, 1.0),
        );
        let (x_t, w_t, dy_t) = (
            tensor_of::<T>(&[rows, d], &xv),
            tensor_of::<T>(&[d], &wv),
            tensor_of::<T>(&[rows, d], &dyv),
        );
        let want = ops::rms_norm(&x_t, &w_t, 1e-5).unwrap();
        let (mut x, mut w, mut dy) = (typed::<T>(&xv), typed::<T>(&wv), typed::<T>(&dyv));
        let (mut y, mut r) = (vec![T::from_f32(f32::NAN); rows * d], vec![f32::NAN; rows]);
        let args =
            [ptr(&mut x), ptr(&mut w), Arg::F32(1e-5), ptr(&mut y), ptr(&mut r), Arg::count(d)];
        if !launch(RMS_NORM.of(dt), launch::per_row(rows), &args) {
            return false;
        }
        close(&format!("rms_norm {dt:?} y"), &widen_f32(&y), &f32s(&want.y), tol);
        close(&format!("rms_norm {dt:?} rstd"), &r, &f32s(&want.rstd), 1e-5);
        let grads = ops::rms_norm_backward(&x_t, &w_t, &want.rstd, &dy_t).unwrap();
        let mut r = f32s(&want.rstd);
        let mut dx = vec![T::from_f32(f32::NAN); rows * d];
        let args =
            [ptr(&mut x), ptr(&mut w), ptr(&mut r), ptr(&mut dy), ptr(&mut dx), Arg::count(d)];
        launch(RMS_NORM_BWD.of(dt), launch::per_row(rows), &args);
        close(&format!("rms_norm_backward {dt:?} dx"), &widen_f32(&dx), &f32s(&grads.dx), tol);
        let (cfg, chunk) = launch::columns(rows, d);
        let chunks = rows.div_ceil(chunk);
        let mut dw = vec![f32::NAN; chunks * d];
        let args = [
            ptr(&mut x),
            ptr(&mut r),
            ptr(&mut dy),
            ptr(&mut dw),
            Arg::count(rows),
            Arg::count(d),
            Arg::count(chunk),
        ];
        launch(RMS_NORM_WEIGHT_BWD.of(dt), cfg, &args);
        let dw = if chunks > 1 { finish_columns(&mut dw, d) } else { dw };
        let dw: Vec<f32> = dw.iter().map(|&v| T::from_f32(v).to_f32()).collect();
        close(
            &format!("rms_norm_backward {dt:?} dweight, {rows} rows"),
            &dw,
            &f32s(&grads.dweight),
            tol,
        );
    }

    // Rotary embeddings: [b, s, h, dh] with llama3-scaled tables, forward and backward.
    let (b, s, h, dh) = (2, 9, 3, 16);
    let n = b * s * h * dh;
    let scaling = ops::RopeScaling::Llama3 {
        factor: 32.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192.0,
    };
    let (cv, sv) = ops::rope_tables(s, dh, 500_000.0, scaling);
    let xv = values(n, 123, -2.0, 2.0);
    let x_t = tensor_of::<T>(&[b, s, h, dh], &xv);
    let (cos_t, sin_t) = (tensor(&[s, dh / 2], &cv), tensor(&[s, dh / 2], &sv));
    for (sign, want) in [
        (1.0f32, ops::rope(&x_t, &cos_t, &sin_t).unwrap()),
        (-1.0, ops::rope_backward(&x_t, &cos_t, &sin_t).unwrap()),
    ] {
        let (mut x, mut c, mut sn) = (typed::<T>(&xv), cv.clone(), sv.clone());
        let mut y = vec![T::from_f32(f32::NAN); n];
        let args = [
            ptr(&mut x),
            ptr(&mut c),
            ptr(&mut sn),
            ptr(&mut y),
            Arg::F32(sign),
            Arg::count(n / 2),
            Arg::div(dh / 2),
            Arg::div(h),
            Arg::div(s),
        ];
        launch(ROPE.of(dt), launch::elementwise(n / 2), &args);
        close(&format!("rope {dt:?} sign {sign}"), &widen_f32(&y), &f32s(&want), 0.0);
    }
    true
}

#[test]
fn llama_kernels_match_the_host() {
    if llama_of_dtype::<f32>() {
        assert!(llama_of_dtype::<f16>() && llama_of_dtype::<bf16>());
    }
}
