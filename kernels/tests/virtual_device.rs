//! The virtual device allocates what the host allocates, request for request: every op's
//! allocation trace (action, size, requested bytes, stream; addresses differ) on a virtual
//! device equals the host device's, and the CUDA device's where one opens (the CUDA part
//! prints `skipped: no CUDA device (...)` otherwise). Reading values from a virtual tensor
//! is an error, never a panic.

use std::io::Write as _;
use vram_kernels::ops;
use vram_kernels::{
    AdamWConfig, Conv2dOptions, DType, Device, Error, Indices, Pool2dOptions, Result, SgdConfig,
    Tensor, TraceAction,
};

/// The cuBLAS workspace every device of these tests gets, so that all three allocate it.
const BLAS_WORKSPACE: usize = 4 << 20;

/// One allocator action without its address (and time): what must agree across devices.
type Entry = (TraceAction, usize, usize, u64);

fn devices() -> Vec<Device> {
    devices_of(None)
}

/// A host, a virtual and (where one opens) a CUDA device whose allocators may hold at most
/// `capacity` bytes (4 GiB for the host and virtual ones, the GPU's own memory for CUDA,
/// when `None`).
fn devices_of(capacity: Option<u64>) -> Vec<Device> {
    let cap = capacity.unwrap_or(4 << 30);
    let mut devices = vec![Device::host(cap), Device::virtual_device(cap)];
    match Device::cuda(0) {
        Ok(gpu) => {
            // The virtual device models vram's own convolution kernels, not cuDNN's
            // workspaces (which only cuDNN can size).
            gpu.set_conv_backend(vram_kernels::ConvBackend::Own).unwrap();
            if let Some(cap) = capacity {
                let total = gpu.mem_info().total.max(1);
                gpu.set_memory_fraction(cap as f64 / total as f64).unwrap();
            }
            devices.push(gpu);
        }
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

/// Deterministic values in [-2, 2), never all zero.
fn values(n: usize, seed: u64) -> Vec<f32> {
    (0..n as u64).map(|i| ((i * 7919 + seed * 104_729) % 4001) as f32 / 1000.25 - 2.0).collect()
}

fn t(d: &Device, shape: &[usize], seed: u64, dtype: DType) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_f32_slice(d, shape, &values(n, seed), dtype).unwrap()
}

/// The allocator actions of `f` on `d`, its results dropped at the end.
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

/// Runs `case` on every device and checks that the traces agree entry for entry.
fn same_trace(name: &str, case: impl Fn(&Device) -> Vec<Entry>) {
    let devices = devices();
    let want = case(&devices[0]);
    assert!(!want.is_empty(), "{name}: the host allocated nothing");
    for d in &devices[1..] {
        let got = case(d);
        assert_eq!(got, want, "{name}: {} against the host", d.name());
    }
}

#[test]
fn elementwise_and_activation_ops_allocate_alike_on_every_device() {
    for dtype in [DType::F32, DType::BF16] {
        same_trace("add", |d| {
            let (a, b) = (t(d, &[33, 65], 1, dtype), t(d, &[33, 65], 2, dtype));
            traced(d, || ops::add(&a, &b))
        });
        same_trace("mul/scale", |d| {
            let (a, b) = (t(d, &[1000], 1, dtype), t(d, &[1000], 2, dtype));
            traced(d, || Ok((ops::mul(&a, &b)?, ops::scale(&a, 0.5)?)))
        });
        same_trace("relu, gelu and backward", |d| {
            let (x, dy) = (t(d, &[7, 300], 1, dtype), t(d, &[7, 300], 2, dtype));
            traced(d, || {
                Ok((
                    ops::relu(&x)?,
                    ops::relu_backward(&x, &dy)?,
                    ops::gelu(&x)?,
                    ops::gelu_backward(&x, &dy)?,
                ))
            })
        });
        same_trace("bias_add and backward", |d| {
            let (x, b) = (t(d, &[5, 700], 1, dtype), t(d, &[700], 2, dtype));
            traced(d, || Ok((ops::bias_add(&x, &b)?, ops::bias_add_backward(&x)?)))
        });
        same_trace("permute and backward", |d| {
            let x = t(d, &[2, 7, 3, 5], 1, dtype);
            traced(d, || {
                let y = ops::permute(&x, &[0, 2, 1, 3])?;
                Ok((ops::permute_backward(&y, &[0, 2, 1, 3])?, y))
            })
        });
        same_trace("dropout and backward", |d| {
            let x = t(d, &[4096], 1, dtype);
            traced(d, || {
                Ok((ops::dropout(&x, 0.3, 7, 11)?, ops::dropout_backward(&x, 0.3, 7, 11)?))
            })
        });
    }
    same_trace("add_assign and axpy, mixed dtypes, on a shared tensor", |d| {
        let mut acc = t(d, &[2000], 1, DType::F32);
        let shared = acc.clone();
        let x = t(d, &[2000], 2, DType::BF16);
        traced(d, || {
            ops::add_assign(&mut acc, &x)?;
            ops::axpy(0.5, &x, &mut acc)?;
            Ok(shared)
        })
    });
}

#[test]
fn tensor_constructors_and_copies_allocate_alike_on_every_device() {
    same_trace("constructors", |d| {
        traced(d, || {
            let z = Tensor::zeros(d, &[300, 3], DType::F32)?;
            let f = Tensor::full(d, &[1 << 20], DType::F16, 1.5)?;
            let s = Tensor::from_slice(d, &[4], &[1.0f32, 2.0, 3.0, 4.0])?;
            let i = Indices::from_slice(d, &[3], &[1, 2, 3])?;
            Ok((z, f, s, i))
        })
    });
    same_trace("casts, clones, copy-on-write, fill", |d| {
        let x = t(d, &[1000, 3], 1, DType::F32);
        traced(d, || {
            let b = x.to_dtype(DType::BF16)?;
            let c = x.try_clone()?;
            let mut shared = x.clone();
            shared.fill(2.0)?;
            Ok((b, c, shared))
        })
    });
}

#[test]
fn matrix_products_allocate_alike_on_every_device_cublas_workspace_included() {
    same_trace("matmul, batched and broadcast, and backward", |d| {
        let a = t(d, &[3, 17, 40], 1, DType::F32);
        let w = t(d, &[40, 9], 2, DType::F32);
        let dc = t(d, &[3, 17, 9], 3, DType::F32);
        traced(d, || {
            let c = ops::matmul(&a, &w, false, false)?;
            let grads = ops::matmul_backward(&a, &w, &dc, false, false)?;
            let bt = ops::matmul_backward(&a, &a, &t(d, &[3, 17, 17], 4, DType::F32), false, true)?;
            Ok((c, grads, bt))
        })
    });
    let virt = Device::virtual_device(1 << 30);
    virt.set_blas_workspace_size(BLAS_WORKSPACE);
    let a = t(&virt, &[8, 8], 1, DType::F32);
    let entries = traced(&virt, || ops::matmul(&a, &a, false, false));
    assert!(
        entries.iter().any(|e| e.0 == TraceAction::Alloc && e.2 == BLAS_WORKSPACE),
        "the first product allocates the cuBLAS workspace: {entries:?}"
    );
    for dtype in [DType::F32, DType::F16] {
        same_trace("linear and backward", |d| {
            let (x, w, b) =
                (t(d, &[2, 6, 30], 1, dtype), t(d, &[20, 30], 2, dtype), t(d, &[20], 3, dtype));
            let dy = t(d, &[2, 6, 20], 4, dtype);
            traced(d, || {
                let y = ops::linear(&x, &w, Some(&b))?;
                let g = ops::linear_backward(&x, &w, &dy, true)?;
                let g2 = ops::linear_backward(&x, &w, &dy, false)?;
                Ok((y, g, g2))
            })
        });
    }
    same_trace("empty products", |d| {
        let (a, b) = (t(d, &[0, 4], 1, DType::F32), t(d, &[4, 3], 2, DType::F32));
        let dc = t(d, &[0, 3], 3, DType::F32);
        traced(d, || {
            Ok((
                ops::matmul(&a, &b, false, false)?,
                ops::matmul_backward(&a, &b, &dc, false, false)?,
            ))
        })
    });
}

#[test]
fn convolutions_allocate_alike_on_every_device() {
    let cases = [
        ([2, 3, 13, 11], [8, 3, 3, 3], Conv2dOptions::default().padding((1, 1))),
        ([2, 4, 12, 12], [6, 2, 3, 3], Conv2dOptions::default().stride((2, 2)).groups(2)),
        ([2, 8, 7, 7], [16, 8, 1, 1], Conv2dOptions::default()),
        ([2, 6, 10, 10], [6, 1, 3, 3], Conv2dOptions::default().padding((1, 1)).groups(6)),
        ([2, 0, 4, 4], [3, 0, 3, 3], Conv2dOptions::default().padding((1, 1))),
        ([1, 2, 0, 3], [3, 2, 1, 1], Conv2dOptions::default().padding((1, 1))),
        // Above DIRECT_MAX_MACS: im2col buffers and the cuBLAS workspace.
        ([2, 32, 48, 48], [64, 32, 3, 3], Conv2dOptions::default().padding((1, 1))),
    ];
    for (xs, ws, opts) in cases {
        for with_bias in [false, true] {
            same_trace(&format!("conv2d {xs:?} {ws:?} bias {with_bias}"), |d| {
                let (x, w) = (t(d, &xs, 1, DType::F32), t(d, &ws, 2, DType::F32));
                let b = t(d, &[ws[0]], 3, DType::F32);
                let p = ops::conv2d_params(&xs, &ws, &opts).unwrap();
                let dy = t(d, &p.output_shape(), 4, DType::F32);
                traced(d, || {
                    let y = ops::conv2d(&x, &w, with_bias.then_some(&b), &opts)?;
                    let g = ops::conv2d_backward(&x, &w, &dy, &opts, with_bias)?;
                    Ok((y, g))
                })
            });
        }
    }
}

/// Channels_last convolutions off cuDNN: x, the weight and dy permuted to NCHW, the NCHW
/// op, its results permuted back; the same requests on every device (CUDA with its own
/// kernels, as `devices_of` sets it).
#[test]
fn channels_last_convolutions_allocate_alike_on_every_device() {
    let cases = [
        ([2, 13, 11, 3], [8, 3, 3, 3], Conv2dOptions::default().padding((1, 1))),
        ([2, 10, 10, 6], [6, 3, 3, 1], Conv2dOptions::default().padding((1, 1)).groups(6)),
        ([2, 48, 48, 32], [64, 3, 3, 32], Conv2dOptions::default().padding((1, 1))),
    ];
    for (xs, ws, opts) in cases {
        same_trace(&format!("conv2d_nhwc {xs:?} {ws:?}"), |d| {
            let (x, w) = (t(d, &xs, 1, DType::F32), t(d, &ws, 2, DType::F32));
            let b = t(d, &[ws[0]], 3, DType::F32);
            let p = ops::conv2d_params_nhwc(&xs, &ws, &opts).unwrap();
            let [n, c, h, wd] = p.output_shape();
            let dy = t(d, &[n, h, wd, c], 4, DType::F32);
            traced(d, || {
                let y = ops::conv2d_nhwc(&x, &w, Some(&b), &opts)?;
                assert_eq!(y.shape(), dy.shape());
                let g = ops::conv2d_backward_nhwc(&x, &w, &dy, &opts, true)?;
                Ok((y, g))
            })
        });
    }
}

#[test]
fn pooling_normalization_and_losses_allocate_alike_on_every_device() {
    for opts in
        [Pool2dOptions::new((2, 2), (2, 2)), Pool2dOptions::new((3, 3), (2, 1)).padding((1, 1))]
    {
        same_trace("max and average pools and backward", |d| {
            let x = t(d, &[2, 3, 9, 8], 1, DType::F32);
            let p = ops::pool2d_params(x.shape(), &opts).unwrap();
            let dy = t(d, &p.output_shape(), 2, DType::F32);
            traced(d, || {
                let (y, arg) = ops::max_pool2d(&x, &opts)?;
                let dx = ops::max_pool2d_backward(&dy, &arg, x.shape(), &opts)?;
                let a = ops::avg_pool2d(&x, &opts, true)?;
                let da = ops::avg_pool2d_backward(&dy, x.shape(), &opts, false)?;
                Ok((y, arg, dx, a, da))
            })
        });
    }
    same_trace("global average pool and backward", |d| {
        let x = t(d, &[4, 5, 6, 7], 1, DType::F32);
        let dy = t(d, &[4, 5], 2, DType::F32);
        traced(d, || {
            Ok((ops::global_avg_pool(&x)?, ops::global_avg_pool_backward(&dy, x.shape())?))
        })
    });
    same_trace("layer norm and backward", |d| {
        let (x, g, b) = (
            t(d, &[6, 130], 1, DType::BF16),
            t(d, &[130], 2, DType::BF16),
            t(d, &[130], 3, DType::BF16),
        );
        let dy = t(d, &[6, 130], 4, DType::BF16);
        traced(d, || {
            let out = ops::layer_norm(&x, &g, &b, 1e-5)?;
            let grads = ops::layer_norm_backward(&x, &g, &out.mean, &out.rstd, &dy)?;
            Ok((out, grads))
        })
    });
    same_trace("cross-entropy and backward", |d| {
        let logits = t(d, &[300, 11], 1, DType::F32);
        let targets: Vec<u32> = (0..300).map(|i| (i * 7 % 11) as u32).collect();
        traced(d, || {
            let ce = ops::cross_entropy(&logits, &targets, Some(3))?;
            let dl = ops::cross_entropy_backward(&logits, &targets, Some(3), &ce.lse, 1.0)?;
            Ok((ce.lse, dl))
        })
    });
    same_trace("fused linear cross-entropy", |d| {
        let (h, w) = (t(d, &[300, 24], 1, DType::BF16), t(d, &[1001, 24], 2, DType::BF16));
        let targets: Vec<u32> = (0..300).map(|i| (i * 13 % 1001) as u32).collect();
        let p = ops::LinearCrossEntropyParams::default().ignore_index(Some(3));
        traced(d, || ops::linear_cross_entropy(&h, &w, &targets, &p))
    });
    same_trace("embedding and backward", |d| {
        let table = t(d, &[50, 16], 1, DType::F32);
        let ids: Vec<u32> = (0..40).map(|i| (i * 13 % 50) as u32).collect();
        let dout = t(d, &[40, 16], 2, DType::F32);
        traced(d, || Ok((ops::embedding(&table, &ids)?, ops::embedding_backward(&ids, &dout, 50)?)))
    });
    same_trace("softmax family and row reductions", |d| {
        let x = t(d, &[3, 9, 9], 1, DType::F32);
        let dy = t(d, &[3, 9, 9], 2, DType::F32);
        let r = t(d, &[3, 9], 3, DType::F32);
        traced(d, || {
            Ok((
                (ops::softmax(&x)?, ops::softmax_backward(&x, &dy)?),
                (ops::causal_softmax(&x)?, ops::causal_softmax_backward(&x, &dy)?),
                (ops::sum_last_dim(&x)?, ops::mean_last_dim(&x)?),
                (ops::sum_last_dim_backward(&r, 9)?, ops::mean_last_dim_backward(&r, 9)?),
                ops::mean_backward(1.0, d, &[3, 4], DType::F32)?,
            ))
        })
    });
}

#[test]
fn llama_ops_allocate_alike_on_every_device() {
    same_trace("rms norm, rotary embeddings and SiLU, forward and backward", |d| {
        let (x, w) = (t(d, &[70, 130], 1, DType::BF16), t(d, &[130], 2, DType::BF16));
        let dy = t(d, &[70, 130], 3, DType::BF16);
        let q = t(d, &[2, 5, 3, 8], 4, DType::F16);
        let (cos, sin) = ops::rope_tables(5, 8, 10_000.0, ops::RopeScaling::Default);
        let cos = Tensor::from_f32_slice(d, &[5, 4], &cos, DType::F32).unwrap();
        let sin = Tensor::from_f32_slice(d, &[5, 4], &sin, DType::F32).unwrap();
        traced(d, || {
            let out = ops::rms_norm(&x, &w, 1e-5)?;
            let g = ops::rms_norm_backward(&x, &w, &out.rstd, &dy)?;
            let r = ops::rope(&q, &cos, &sin)?;
            let dr = ops::rope_backward(&r, &cos, &sin)?;
            let s = ops::silu(&x)?;
            let ds = ops::silu_backward(&x, &dy)?;
            Ok((out, g, r, dr, s, ds))
        })
    });
}

#[test]
fn optimizer_steps_and_unscale_allocate_alike_on_every_device() {
    same_trace("sgd, adamw, unscale on shared tensors", |d| {
        let mut p = t(d, &[3000], 1, DType::F32);
        let g = t(d, &[3000], 2, DType::BF16);
        let mut buf = Tensor::zeros(d, &[3000], DType::F32).unwrap();
        let (mut m, mut v) = (buf.try_clone().unwrap(), buf.try_clone().unwrap());
        let keep = (p.clone(), m.clone());
        let mut g2 = g.clone();
        traced(d, || {
            let sgd = SgdConfig { momentum: 0.9, ..SgdConfig::default() };
            ops::sgd_step(&mut p, &g, Some(&mut buf), true, &sgd)?;
            ops::adamw_step(&mut p, &g, &mut m, &mut v, 1, &AdamWConfig::default())?;
            ops::unscale_and_check_finite(&mut [&mut g2], 0.5)?;
            Ok(keep)
        })
    });
}

#[test]
fn reading_values_on_a_virtual_device_is_a_clear_error() {
    let d = Device::virtual_device(1 << 30);
    let x = Tensor::from_f32_slice(&d, &[2, 2], &[1.0, 2.0, 3.0, 4.0], DType::F32).unwrap();
    let no_values = |e: Error| {
        assert!(matches!(e, Error::NoValues { .. }), "{e}");
        assert!(e.to_string().contains("virtual device"), "{e}");
    };
    no_values(x.to_f32_vec().unwrap_err());
    no_values(x.to_vec::<f32>().unwrap_err());
    no_values(x.as_slice::<f32>().unwrap_err());
    no_values(ops::sum(&x).unwrap_err());
    no_values(ops::mean(&x).unwrap_err());
    let (_, arg) = ops::max_pool2d(
        &x.clone().reshape(&[1, 1, 2, 2]).unwrap(),
        &Pool2dOptions::new((2, 2), (2, 2)),
    )
    .unwrap();
    no_values(arg.to_vec().unwrap_err());
    no_values(x.to_device(&Device::host(1 << 20)).unwrap_err());
    // Ops run and allocate; the loss of a virtual device is NaN, and no overflow is found.
    let ce = ops::cross_entropy(&x, &[0, 1], None).unwrap();
    assert!(ce.loss.is_nan());
    let mut g = x.clone();
    assert!(!ops::unscale_and_check_finite(&mut [&mut g], 0.5).unwrap());
    assert!(d.is_virtual() && !d.is_cuda());
    assert!(d.name().starts_with("virtual"), "{}", d.name());
}

#[test]
fn channels_last_pools_and_scale_allocate_alike_on_every_device() {
    let opts = Pool2dOptions::new((3, 3), (2, 2)).padding((1, 1));
    for dtype in [DType::F32, DType::BF16] {
        same_trace("channels_last max pool and backward", |d| {
            let x = t(d, &[2, 9, 8, 5], 1, dtype);
            let dy = t(d, &[2, 5, 4, 5], 2, dtype);
            traced(d, || {
                let (y, arg) = ops::max_pool2d_nhwc(&x, &opts)?;
                let dx = ops::max_pool2d_backward_nhwc(&dy, &arg, x.shape(), &opts)?;
                Ok((y, arg, dx))
            })
        });
        // 7x7 positions (one chunk: no workspace) and 9x10 (two chunks: partial sums).
        for shape in [[3, 7, 7, 6], [2, 9, 10, 3]] {
            same_trace("channels_last global average pool, backward and backward_add", |d| {
                let x = t(d, &shape, 1, dtype);
                let g = t(d, &[shape[0], shape[3]], 2, dtype);
                let mut acc = t(d, &shape, 3, dtype);
                let shared = acc.clone();
                traced(d, || {
                    let y = ops::global_avg_pool_nhwc(&x)?;
                    let dx = ops::global_avg_pool_backward_nhwc(&g, &shape)?;
                    // Shared: copied first, then added in place.
                    ops::global_avg_pool_backward_add_nhwc(&mut acc, &g)?;
                    ops::global_avg_pool_backward_add_nhwc(&mut acc, &g)?;
                    Ok((y, dx, shared))
                })
            });
            same_trace("channels_last scale and backward", |d| {
                let (x, dy) = (t(d, &shape, 1, dtype), t(d, &shape, 2, dtype));
                let s = t(d, &[shape[0], shape[3]], 3, dtype);
                traced(d, || {
                    let y = ops::scale_channels_nhwc(&x, &s)?;
                    Ok((y, ops::scale_channels_backward_nhwc(&x, &s, &dy)?))
                })
            });
        }
    }
}

#[test]
fn a_virtual_device_runs_out_of_memory_where_the_gpu_would() {
    let d = Device::virtual_device(1 << 30);
    let x = Tensor::zeros(&d, &[100 << 20], DType::F32).unwrap();
    let e = ops::add(&x, &x).and_then(|y| ops::add(&y, &x).map(|z| (y, z))).unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    assert_eq!(d.memory_allocated(), 400 << 20, "the failed op's output went back");
}

#[test]
fn a_convolution_whose_im2col_buffer_does_not_fit_works_in_fewer_images() {
    // 8 images of 16 x 64 x 64, a 3x3 convolution: each image's im2col matrix is
    // 144 x 4096 x 4 B = 2.25 MiB, 18 MiB for the whole batch; the backward's columns take
    // 2.5 MiB an image (the weight gradient's operands: those columns and dy's 16 channels).
    let (xs, ws) = ([8, 16, 64, 64], [16, 16, 3, 3]);
    let opts = Conv2dOptions::default().padding((1, 1));
    assert!(!ops::conv2d_params(&xs, &ws, &opts).unwrap().is_direct(), "the im2col path");
    let (forward, backward) = (16 * 9 * 64 * 64 * 4, (16 * 9 + 16) * 64 * 64 * 4);
    let step = |d: &Device| {
        let (x, w) = (t(d, &xs, 1, DType::F32), t(d, &ws, 2, DType::F32));
        let dy = t(d, &xs, 3, DType::F32);
        let before = d.memory_stats().num_ooms;
        let trace = traced(d, || {
            let y = ops::conv2d(&x, &w, None, &opts)?;
            let g = ops::conv2d_backward(&x, &w, &dy, &opts, false)?;
            Ok((y, g))
        });
        (trace, d.memory_stats().num_ooms - before)
    };
    let workspaces = |trace: &[Entry]| -> Vec<usize> {
        let sizes = trace.iter().filter(|e| e.0 == TraceAction::Alloc).map(|e| e.2);
        let images =
            |s: usize, per_image: usize| s.is_multiple_of(per_image).then_some(s / per_image);
        sizes.filter_map(|s| images(s, backward).or_else(|| images(s, forward))).collect()
    };
    // With room, each op takes the whole batch's columns at once.
    let (roomy, ooms) = step(&Device::host(1 << 30));
    assert_eq!((workspaces(&roomy), ooms), (vec![8, 8], 0));
    // In 36 MiB (operands, outputs and the cuBLAS workspace share a 20 MiB segment, the
    // small weights a 2 MiB one) 18 MiB more do not fit, and every device settles on the
    // same fewer images, after the same out-of-memory attempts.
    let devices = devices_of(Some(36 << 20));
    let (want, ooms) = step(&devices[0]);
    let got = workspaces(&want);
    assert_eq!(got.len(), 2, "{want:?}");
    assert!(got.iter().all(|&n| (1..8).contains(&n) && 8 % n == 0), "{got:?}");
    let refused = want.iter().filter(|e| e.0 == TraceAction::Oom).count();
    assert!(refused >= 2 && ooms == refused as u64, "{refused} oom entries, {ooms} ooms");
    for d in &devices[1..] {
        assert_eq!(step(d), (want.clone(), ooms), "{} against the host", d.name());
    }
    // When not even one image's columns fit, the op fails as out of memory and everything
    // the caller held is intact.
    for d in [Device::host(24 << 20), Device::virtual_device(24 << 20)] {
        d.set_blas_workspace_size(BLAS_WORKSPACE);
        let (x, w) = (t(&d, &xs, 1, DType::F32), t(&d, &ws, 2, DType::F32));
        let filler = Tensor::zeros(&d, &[(19 << 20) / 4 - x.numel() - w.numel() - 64], DType::F32);
        let filler = filler.unwrap();
        let held = d.memory_allocated();
        let e = ops::conv2d(&x, &w, None, &opts).unwrap_err();
        assert!(e.is_out_of_memory(), "{}: {e}", d.name());
        assert_eq!(d.memory_allocated(), held, "{}: the failed op's buffers went back", d.name());
        if !d.is_virtual() {
            assert_eq!(x.to_f32_vec().unwrap(), values(x.numel(), 1));
        }
        drop(filler);
    }
}

#[test]
fn small_convolutions_run_direct_and_allocate_only_their_outputs() {
    // A toy model's 3x3 convolution: its im2col matrix would be 9x its input (4.5 MiB here);
    // the direct kernels need no buffer and no cuBLAS workspace, on every device.
    let (xs, ws) = ([8, 16, 32, 32], [16, 16, 3, 3]);
    let opts = Conv2dOptions::default().padding((1, 1));
    let p = ops::conv2d_params(&xs, &ws, &opts).unwrap();
    assert!(p.is_direct());
    let (x_bytes, w_bytes) = (8 * 16 * 32 * 32 * 4, 16 * 16 * 9 * 4);
    same_trace("direct conv2d", |d| {
        let (x, w) = (t(d, &xs, 1, DType::F32), t(d, &ws, 2, DType::F32));
        let dy = t(d, &p.output_shape(), 3, DType::F32);
        let trace = traced(d, || {
            let y = ops::conv2d(&x, &w, None, &opts)?;
            let g = ops::conv2d_backward(&x, &w, &dy, &opts, false)?;
            Ok((y, g))
        });
        let allocs: Vec<usize> =
            trace.iter().filter(|e| e.0 == TraceAction::Alloc).map(|e| e.2).collect();
        assert_eq!(allocs, [x_bytes, x_bytes, w_bytes], "{}: y, dx, dweight only", d.name());
        trace
    });
}

#[test]
fn fused_attention_allocates_alike_on_every_device() {
    for dtype in [DType::F32, DType::BF16] {
        same_trace("attention", |d| {
            let shape = [2, 37, 64];
            let [q, k, v, dout] = [1, 2, 3, 4].map(|s| t(d, &shape, s, dtype));
            let p = ops::AttentionParams::new(true).with_dropout(0.1, 1, 0);
            traced(d, || {
                let fwd = ops::attention(&q, &k, &v, &p)?;
                let grads = ops::attention_backward(&q, &k, &v, &fwd, &dout, &p)?;
                Ok((fwd, grads))
            })
        });
    }
}
