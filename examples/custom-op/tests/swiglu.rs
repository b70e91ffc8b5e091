//! The custom SwiGLU op on every backend: the host code against an f64 reference and finite
//! differences, the CUDA code on the host's emulation against the host code (bit for bit:
//! same f32 operations in the same order, no fused multiply-adds on either side), on a GPU
//! when there is one, the virtual device's allocations against the host's, bad input and
//! out-of-memory.

use proptest::prelude::*;
use vram_example_custom_op::{swiglu, swiglu_backward};
use vram_kernels::custom::Tolerance;
#[cfg(feature = "cuda")]
use vram_kernels::custom::compare;
use vram_kernels::{DType, Device, Error, Tensor};

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

fn host() -> Device {
    Device::host(64 << 20)
}

/// `n` values in about [-4, 4], deterministic in `seed`.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 * 8.0 - 4.0
        })
        .collect()
}

fn tensor(dev: &Device, n: usize, seed: u64, dtype: DType) -> Tensor {
    Tensor::from_f32_slice(dev, &[n], &values(n, seed), dtype).unwrap()
}

fn sigmoid(g: f64) -> f64 {
    1.0 / (1.0 + (-g).exp())
}

fn forward_f64(g: f64, u: f64) -> f64 {
    g * sigmoid(g) * u
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// The host code is SwiGLU: within the dtype's rounding of an f64 reference, and its
    /// gradients within rounding of the analytic ones.
    #[test]
    fn host_code_matches_an_f64_reference(n in 0usize..300, seed in any::<u64>(), d in 0usize..3) {
        let dtype = DTYPES[d];
        let dev = host();
        let (gate, up, dy) = (tensor(&dev, n, seed, dtype), tensor(&dev, n, seed ^ 1, dtype), tensor(&dev, n, seed ^ 2, dtype));
        let y = swiglu(&gate, &up).unwrap();
        let grads = swiglu_backward(&gate, &up, &dy).unwrap();
        let (g, u, dyv) = (gate.to_f32_vec().unwrap(), up.to_f32_vec().unwrap(), dy.to_f32_vec().unwrap());
        let (yv, dg, du) = (y.to_f32_vec().unwrap(), grads.dgate.to_f32_vec().unwrap(), grads.dup.to_f32_vec().unwrap());
        let tol = Tolerance::for_dtype(dtype);
        let close = |got: f32, want: f64| (f64::from(got) - want).abs() <= tol.abs + tol.rel * want.abs();
        for i in 0..n {
            let (gi, ui, di) = (f64::from(g[i]), f64::from(u[i]), f64::from(dyv[i]));
            let s = sigmoid(gi);
            prop_assert!(close(yv[i], forward_f64(gi, ui)), "y[{i}] = {} for g {gi} u {ui}", yv[i]);
            prop_assert!(close(dg[i], di * ui * s * (1.0 + gi * (1.0 - s))), "dgate[{i}] = {}", dg[i]);
            prop_assert!(close(du[i], di * gi * s), "dup[{i}] = {}", du[i]);
        }
    }
}

/// The analytic gradient the op implements is the derivative of its forward (central
/// differences in f64), so a wrong formula in both the kernel and the host code would fail.
#[test]
fn gradients_are_the_forward_derivative() {
    let dev = host();
    let n = 64;
    let (gate, up) = (tensor(&dev, n, 7, DType::F32), tensor(&dev, n, 8, DType::F32));
    let ones = Tensor::full(&dev, &[n], DType::F32, 1.0).unwrap();
    let grads = swiglu_backward(&gate, &up, &ones).unwrap();
    let (g, u) = (gate.to_f32_vec().unwrap(), up.to_f32_vec().unwrap());
    let (dg, du) = (grads.dgate.to_f32_vec().unwrap(), grads.dup.to_f32_vec().unwrap());
    let h = 1e-5;
    for i in 0..n {
        let (gi, ui) = (f64::from(g[i]), f64::from(u[i]));
        let fd_g = (forward_f64(gi + h, ui) - forward_f64(gi - h, ui)) / (2.0 * h);
        let fd_u = (forward_f64(gi, ui + h) - forward_f64(gi, ui - h)) / (2.0 * h);
        assert!((f64::from(dg[i]) - fd_g).abs() < 1e-4 * (1.0 + fd_g.abs()), "dgate[{i}]");
        assert!((f64::from(du[i]) - fd_u).abs() < 1e-4 * (1.0 + fd_u.abs()), "dup[{i}]");
    }
}

/// A virtual device allocates what the host does, request for request, and computes
/// nothing: the same peak, the same live bytes, the same number of allocations.
#[test]
fn virtual_device_allocates_what_the_host_does() {
    let n = 3 * 1024 + 5;
    let stats = |dev: &Device| {
        let (gate, up, dy) = (
            Tensor::zeros(dev, &[n], DType::BF16).unwrap(),
            Tensor::zeros(dev, &[n], DType::BF16).unwrap(),
            Tensor::zeros(dev, &[n], DType::BF16).unwrap(),
        );
        let y = swiglu(&gate, &up).unwrap();
        let grads = swiglu_backward(&gate, &up, &dy).unwrap();
        let live = dev.memory_allocated();
        drop((y, grads));
        let s = dev.memory_stats();
        (
            live,
            dev.max_memory_allocated(),
            dev.memory_allocated(),
            s.num_alloc_retries,
            s.allocation.all.allocated,
        )
    };
    let (on_host, on_virtual) = (stats(&host()), stats(&Device::virtual_device(64 << 20)));
    assert_eq!(on_host, on_virtual);
    // Inputs and outputs, each rounded to the allocator's 512 bytes.
    let block = (n * 2).div_ceil(512) * 512;
    assert_eq!(on_host.0, 6 * block as u64, "3 inputs + y + dgate + dup live");
    assert_eq!(on_host.4, 6, "one allocation per tensor");
}

/// The kernels compile with NVRTC for sm_80 and sm_90 and declare what the Rust side
/// launches (the PTX's parameter lists against `SOURCE`). Without libnvrtc this prints a
/// skip line, unless `VRAM_REQUIRE_NVRTC=1` (CI) makes it a failure.
#[cfg(feature = "cuda")]
#[test]
fn kernels_compile_with_nvrtc_as_declared() {
    for arch in ["compute_80", "compute_90"] {
        if !vram_example_custom_op::SOURCE.check_with_nvrtc(arch).unwrap() {
            let required =
                std::env::var("VRAM_REQUIRE_NVRTC").is_ok_and(|v| !v.is_empty() && v != "0");
            assert!(!required, "VRAM_REQUIRE_NVRTC is set but libnvrtc.so.13 cannot be loaded");
            eprintln!("skipped: no NVRTC (libnvrtc.so.13 is not on LD_LIBRARY_PATH)");
            return;
        }
    }
}

/// The CUDA code on the host's emulation writes what the host code writes, bit for bit, for
/// every dtype, at sizes that leave a partial block and that need the grid-stride loop.
#[cfg(feature = "cuda")]
#[test]
fn cuda_code_on_the_emulation_matches_the_host_code() {
    use vram_example_custom_op::{swiglu_backward_emulated, swiglu_emulated};
    let dev = host();
    for &n in &[1usize, 255, 257, 1000] {
        for dtype in DTYPES {
            let (gate, up, dy) = (
                tensor(&dev, n, n as u64, dtype),
                tensor(&dev, n, 3, dtype),
                tensor(&dev, n, 4, dtype),
            );
            let Some(y) = swiglu_emulated(&gate, &up).unwrap() else { return };
            let want = swiglu(&gate, &up).unwrap();
            let diff = compare(&y, &want, Tolerance::EXACT).unwrap();
            assert!(diff.within, "{dtype} n={n}: {diff:?}");
            let got = swiglu_backward_emulated(&gate, &up, &dy).unwrap().unwrap();
            let want = swiglu_backward(&gate, &up, &dy).unwrap();
            for (got, want, name) in
                [(&got.dgate, &want.dgate, "dgate"), (&got.dup, &want.dup, "dup")]
            {
                let diff = compare(got, want, Tolerance::EXACT).unwrap();
                assert!(diff.within, "{name} {dtype} n={n}: {diff:?}");
            }
        }
    }
}

/// On a GPU, the kernels against the host code, within the dtype's rounding (the device's
/// `expf` differs from the host's in the last bits).
#[cfg(feature = "cuda")]
#[test]
fn cuda_matches_the_host() {
    let gpu = match Device::cuda(0) {
        Ok(gpu) => gpu,
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            return;
        }
    };
    let dev = host();
    for dtype in DTYPES {
        let n = 100_003;
        let (gate, up, dy) =
            (tensor(&dev, n, 11, dtype), tensor(&dev, n, 12, dtype), tensor(&dev, n, 13, dtype));
        let on_gpu = |t: &Tensor| t.to_device(&gpu).unwrap();
        let y = swiglu(&on_gpu(&gate), &on_gpu(&up)).unwrap();
        let diff = compare(&y, &swiglu(&gate, &up).unwrap(), Tolerance::for_dtype(dtype)).unwrap();
        assert!(diff.within, "{dtype}: {diff:?}");
        let got = swiglu_backward(&on_gpu(&gate), &on_gpu(&up), &on_gpu(&dy)).unwrap();
        let want = swiglu_backward(&gate, &up, &dy).unwrap();
        let diff = compare(&got.dgate, &want.dgate, Tolerance::for_dtype(dtype)).unwrap();
        assert!(diff.within, "dgate {dtype}: {diff:?}");
    }
}

/// Bad operands are errors that name the op and what differs, before anything is allocated.
#[test]
fn bad_operands_are_clear_errors() {
    let dev = host();
    let a = tensor(&dev, 4, 1, DType::F32);
    let b = tensor(&dev, 5, 2, DType::F32);
    let c = tensor(&dev, 4, 3, DType::BF16);
    let live = dev.memory_allocated();
    assert_eq!(
        swiglu(&a, &b).unwrap_err().to_string(),
        "swiglu: shape mismatch between [4] and [5]"
    );
    assert!(matches!(swiglu(&a, &c).unwrap_err(), Error::DTypeMismatch { op: "swiglu", .. }));
    assert!(matches!(
        swiglu_backward(&a, &a, &b).unwrap_err(),
        Error::ShapeMismatch { op: "swiglu_backward", .. }
    ));
    let other = Device::host(64 << 20);
    let elsewhere = tensor(&other, 4, 1, DType::F32);
    assert!(matches!(swiglu(&a, &elsewhere).unwrap_err(), Error::DeviceMismatch { op: "swiglu" }));
    assert_eq!(dev.memory_allocated(), live, "nothing allocated by a refused call");
}

/// Out of memory is the allocator's error, and the inputs are intact.
#[test]
fn out_of_memory_leaves_the_inputs_intact() {
    // 12 MiB tensors (above 10 MiB a segment is the request rounded to 2 MiB): room for the
    // two inputs, not for the output.
    let n = 3 << 20;
    let dev = Device::host(30 << 20);
    let (gate, up) = (tensor(&dev, n, 5, DType::F32), tensor(&dev, n, 6, DType::F32));
    let before = (gate.to_f32_vec().unwrap(), up.to_f32_vec().unwrap());
    let err = swiglu(&gate, &up).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    assert_eq!((gate.to_f32_vec().unwrap(), up.to_f32_vec().unwrap()), before);
    assert_eq!(dev.memory_stats().num_ooms, 1);
}

/// The emulation refuses tensors that are not on the host, saying so.
#[cfg(feature = "cuda")]
#[test]
fn emulation_wants_host_tensors() {
    let virt = Device::virtual_device(64 << 20);
    let t = Tensor::zeros(&virt, &[8], DType::F32).unwrap();
    let err = vram_example_custom_op::swiglu_emulated(&t, &t).unwrap_err();
    assert!(err.to_string().contains("Device::host"), "{err}");
}
