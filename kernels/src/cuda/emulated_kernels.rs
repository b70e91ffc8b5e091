//! The CUDA kernels, run on the host by [`super::emulate`], against the host reference: the
//! launch configurations and arguments the ops use, outputs compared with the host ops (or,
//! for im2col and col2im, which have no host op, with their definitions written with
//! integer division). These run wherever a C++ compiler is, so a kernel's index arithmetic
//! is checked before any GPU runs it; `cuda_vs_host.rs` checks the same on a GPU.

use super::emulate::{launch, ptr};
use super::launch::{self, Arg};
use super::registry::*;
use crate::device::Device;
use crate::dtype::{DType, Element};
use crate::ops;
use crate::tensor::Tensor;
use half::{bf16, f16};

/// One host device for all references (tensors of an op share a device).
fn host() -> &'static Device {
    static HOST: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
    HOST.get_or_init(|| Device::host(1 << 30))
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

fn tensor(shape: &[usize], v: &[f32]) -> Tensor {
    Tensor::from_f32_slice(host(), shape, v, DType::F32).unwrap()
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
            let want = f32s(
                &ops::add(
                    &Tensor::from_f32_slice(host(), &[n], &a, T::DTYPE).unwrap(),
                    &Tensor::from_f32_slice(host(), &[n], &b, T::DTYPE).unwrap(),
                )
                .unwrap(),
            );
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
            let got: Vec<f32> = y[offset..offset + n].iter().map(|v| v.to_f32()).collect();
            close(&format!("add {:?} n {n} offset {offset}", T::DTYPE), &got, &want, 0.0);
            let outside = [&y[..offset], &y[offset + n..]].concat();
            assert!(outside.iter().all(|v| v.to_f32() == 99.0), "add wrote outside its range");
            // A cast from f32 into T, packs of 16 bytes of f32.
            let mut src = a.clone();
            let mut out = vec![T::from_f32(99.0); n];
            let args = [ptr(&mut src), ptr(&mut out), Arg::count(n)];
            launch(CAST.of_pair(DType::F32, T::DTYPE), launch::map(n, 4), &args);
            let want: Vec<f32> = a.iter().map(|&v| T::from_f32(v).to_f32()).collect();
            let got: Vec<f32> = out.iter().map(|v| v.to_f32()).collect();
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
    let dv = values(n, 10, -1.0, 1.0);
    let want = f32s(&ops::embedding_backward(&ids, &tensor(&[97, dim], &dv), vocab).unwrap());
    let (mut dout, mut acc) = (dv, vec![0.0f32; vocab * dim]);
    let args = [ptr(&mut ids_dev), ptr(&mut dout), ptr(&mut acc), Arg::count(n), Arg::div(dim)];
    launch(EMBEDDING_BWD.of(DType::F32), launch::elementwise(n), &args);
    close("embedding_backward", &acc, &want, 1e-5);
}

/// `permute` as `ops/permute.rs` launches it: the shape padded in front to four axes.
/// `None` without a compiler.
fn emulated_permute(x: &[f32], shape: &[usize], perm: &[usize]) -> Option<Vec<f32>> {
    let pad = 4 - shape.len();
    let mut strides = vec![1usize; shape.len()];
    for k in (0..shape.len().saturating_sub(1)).rev() {
        strides[k] = strides[k + 1] * shape[k + 1];
    }
    let (mut d, mut s) = ([1usize; 4], [0usize; 4]);
    for (k, &p) in perm.iter().enumerate() {
        d[pad + k] = shape[p];
        s[pad + k] = strides[p];
    }
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
