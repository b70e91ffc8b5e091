//! The public custom-op API (`vram_kernels::custom`) from a user's side: allocation through
//! the caching allocator on the host and on a virtual device, refusals of malformed host
//! code and launches, the emulation of a user's CUDA source, the NVRTC check of its
//! declarations, and the comparison helper. The example crate `examples/custom-op` is the
//! full worked op (SwiGLU).

use vram_kernels::custom::{self, CustomOp, OpPlan, Tolerance, compare};
use vram_kernels::{DType, Device, Error, Result, Tensor};

/// `y = a * x + b` in f32 through a workspace: the CUDA code copies x into workspace 1 and
/// computes from there (workspace 0 has 0 bytes and address 0).
struct Affine {
    a: f32,
    b: f32,
    /// What the CUDA code does (for the refusal tests).
    #[cfg_attr(not(feature = "emulation"), allow(dead_code))]
    launch: Launch,
}

#[derive(Clone, Copy, PartialEq)]
#[cfg_attr(not(feature = "emulation"), allow(dead_code))]
enum Launch {
    Right,
    UndeclaredKernel,
    WrongArgs,
    BadBlock,
    NoSuchWorkspace,
}

impl Affine {
    fn new(a: f32, b: f32) -> Affine {
        Affine { a, b, launch: Launch::Right }
    }
}

impl CustomOp for Affine {
    const NAME: &'static str = "affine";

    fn plan(&self, inputs: &[&Tensor]) -> Result<OpPlan> {
        let [x] = inputs else {
            return Err(Error::InvalidArgument { op: Self::NAME, reason: "one input".into() });
        };
        if x.dtype() != DType::F32 {
            return Err(Error::DTypeMismatch { op: Self::NAME, lhs: DType::F32, rhs: x.dtype() });
        }
        Ok(OpPlan::new()
            .output(x.shape(), DType::F32)
            .workspace(0, false)
            .workspace(x.size_in_bytes(), true))
    }

    fn host(&self, inputs: &[&Tensor], outputs: &mut [Tensor]) -> Result<()> {
        let x = inputs[0].as_slice::<f32>()?;
        for (y, x) in outputs[0].as_mut_slice::<f32>()?.iter_mut().zip(x) {
            *y = self.a * x + self.b;
        }
        Ok(())
    }

    #[cfg(feature = "emulation")]
    fn cuda_source(&self) -> Option<&'static custom::CudaSource> {
        Some(&emulated::SOURCE)
    }

    #[cfg(feature = "emulation")]
    fn cuda(&self, inputs: &[&Tensor], call: &custom::CudaCall<'_>) -> Result<()> {
        use custom::{Grid, KernelArg};
        let n = inputs[0].numel();
        let grid = Grid::for_elements(n, 64);
        let mut args = vec![
            call.input(0)?,
            call.workspace(1)?,
            call.output(0)?,
            KernelArg::F32(self.a),
            KernelArg::F32(self.b),
            KernelArg::count(n),
        ];
        let (kernel, grid) = match self.launch {
            Launch::Right => ("affine", grid),
            Launch::UndeclaredKernel => ("affine2", grid),
            Launch::WrongArgs => {
                args[3] = KernelArg::U32(1);
                ("affine", grid)
            }
            Launch::BadBlock => ("affine", Grid { blocks: (1, 1), threads: 100 }),
            Launch::NoSuchWorkspace => {
                args[1] = call.workspace(2)?;
                ("affine", grid)
            }
        };
        assert_eq!(call.workspace(0)?, KernelArg::Ptr(0), "a workspace of 0 bytes");
        // SAFETY: x, workspace 1 and y hold n f32 each; the kernel touches elements below n.
        unsafe { call.launch(kernel, grid, &args) }
    }
}

fn host() -> Device {
    Device::host(64 << 20)
}

#[test]
fn runs_on_the_host_and_allocates_alike_on_a_virtual_device() {
    let dev = host();
    let x = Tensor::from_f32_slice(&dev, &[4], &[1.0, 2.0, 3.0, 4.0], DType::F32).unwrap();
    let y = custom::run(&Affine::new(2.0, 1.0), &[&x]).unwrap();
    assert_eq!(y.len(), 1);
    assert_eq!(y[0].to_f32_vec().unwrap(), [3.0, 5.0, 7.0, 9.0]);

    // The same requests on a virtual device: output and workspace, then the workspace back.
    let virt = Device::virtual_device(64 << 20);
    let xv = Tensor::zeros(&virt, &[4], DType::F32).unwrap();
    let yv = custom::run(&Affine::new(2.0, 1.0), &[&xv]).unwrap();
    assert_eq!(yv[0].shape(), &[4]);
    assert_eq!(virt.memory_stats(), dev.memory_stats());
    assert_eq!(dev.memory_stats().allocation.all.allocated, 3, "x, y and the workspace");
    assert_eq!(dev.memory_allocated(), 2 * 512, "x and y live; the workspace went back");
}

#[test]
fn refusals_name_the_op() {
    let dev = host();
    let x = Tensor::zeros(&dev, &[4], DType::BF16).unwrap();
    let err = custom::run(&Affine::new(1.0, 0.0), &[&x]).unwrap_err();
    assert!(matches!(err, Error::DTypeMismatch { op: "affine", .. }), "{err}");
    let err = custom::run(&Affine::new(1.0, 0.0), &[]).unwrap_err();
    assert!(err.to_string().contains("at least one input"), "{err}");
    let other = host();
    let y = Tensor::zeros(&other, &[4], DType::F32).unwrap();
    let z = Tensor::zeros(&dev, &[4], DType::F32).unwrap();
    let err = custom::run(&Affine::new(1.0, 0.0), &[&z, &y]).unwrap_err();
    assert!(matches!(err, Error::DeviceMismatch { op: "affine" }), "{err}");
}

/// Host code that swaps an output for a tensor of another shape is refused, not returned.
#[test]
fn host_code_must_write_the_planned_outputs() {
    struct Cheat;
    impl CustomOp for Cheat {
        const NAME: &'static str = "cheat";
        fn plan(&self, inputs: &[&Tensor]) -> Result<OpPlan> {
            Ok(OpPlan::new().output(&[2], inputs[0].dtype()))
        }
        fn host(&self, inputs: &[&Tensor], outputs: &mut [Tensor]) -> Result<()> {
            outputs[0] = Tensor::zeros(inputs[0].device(), &[3], inputs[0].dtype())?;
            Ok(())
        }
    }
    let dev = host();
    let x = Tensor::zeros(&dev, &[2], DType::F32).unwrap();
    let err = custom::run(&Cheat, &[&x]).unwrap_err();
    assert!(err.to_string().contains("replaced output 0"), "{err}");
}

/// An op without CUDA code says so when asked to run there (a custom op is usable without
/// writing any CUDA).
#[test]
fn an_op_without_cuda_code_says_so() {
    struct HostOnly;
    impl CustomOp for HostOnly {
        const NAME: &'static str = "host_only";
        fn plan(&self, inputs: &[&Tensor]) -> Result<OpPlan> {
            Ok(OpPlan::new().zeroed_output(inputs[0].shape(), inputs[0].dtype()))
        }
        fn host(&self, _: &[&Tensor], _: &mut [Tensor]) -> Result<()> {
            Ok(())
        }
    }
    let dev = host();
    let x = Tensor::full(&dev, &[3], DType::F16, 2.0).unwrap();
    let y = custom::run(&HostOnly, &[&x]).unwrap().remove(0);
    assert_eq!(y.to_f32_vec().unwrap(), [0.0; 3], "a zeroed output starts as zeros");
    #[cfg(feature = "emulation")]
    {
        let err = custom::emulate(&HostOnly, &[&x]).unwrap_err();
        assert!(err.to_string().contains("no CUDA source"), "{err}");
    }
}

#[test]
fn compare_tells_equal_close_and_different() {
    let dev = host();
    let t = |v: &[f32]| Tensor::from_f32_slice(&dev, &[v.len()], v, DType::F32).unwrap();
    let (a, b) = (t(&[1.0, f32::NAN, f32::INFINITY]), t(&[1.0, f32::NAN, f32::INFINITY]));
    assert!(compare(&a, &b, Tolerance::EXACT).unwrap().within, "NaN = NaN, inf = inf");
    let d = compare(&t(&[1.0, 2.0, 3.0]), &t(&[1.0, 2.0 + 1e-6, 3.0]), Tolerance::EXACT).unwrap();
    assert!(!d.within);
    assert_eq!(d.worst, 1);
    assert!(
        compare(&t(&[2.0]), &t(&[2.0 + 1e-6]), Tolerance::for_dtype(DType::F32)).unwrap().within
    );
    assert!(
        !compare(&t(&[f32::NAN]), &t(&[1.0]), Tolerance { abs: 1e9, rel: 0.0 }).unwrap().within
    );
    let err = compare(&t(&[1.0]), &t(&[1.0, 2.0]), Tolerance::EXACT).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { op: "compare", .. }));
}

#[cfg(feature = "emulation")]
mod emulated {
    use super::*;
    use KernelParam::{F32, Ptr, U64};
    use custom::{CudaKernel, CudaSource, KernelParam};

    pub(super) static SOURCE: CudaSource = CudaSource {
        name: "affine",
        source: r#"
extern "C" __global__ void affine(const float* x, float* ws, float* y, float a, float b, u64 n) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) ws[i] = x[i];
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        y[i] = a * ws[i] + b;
    }
}
"#,
        kernels: &[CudaKernel { name: "affine", params: &[Ptr, Ptr, Ptr, F32, F32, U64] }],
    };

    fn x(dev: &Device, n: usize) -> Tensor {
        let v: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 7.0).collect();
        Tensor::from_f32_slice(dev, &[n], &v, DType::F32).unwrap()
    }

    #[test]
    fn the_cuda_code_runs_on_the_emulation() {
        let dev = host();
        let x = x(&dev, 1000);
        let Some(got) = custom::emulate(&Affine::new(3.0, -1.0), &[&x]).unwrap() else { return };
        let want = custom::run(&Affine::new(3.0, -1.0), &[&x]).unwrap();
        assert!(compare(&got[0], &want[0], Tolerance::EXACT).unwrap().within);
        assert_eq!(dev.memory_allocated(), 3 * 4096, "x and both ys; the workspaces went back");
    }

    #[test]
    fn malformed_launches_are_refused_before_anything_runs() {
        let dev = host();
        let x = x(&dev, 100);
        let cases = [
            (Launch::UndeclaredKernel, "no kernel `affine2`"),
            (Launch::WrongArgs, "do not match the declared parameters"),
            (Launch::BadBlock, "100 threads per block"),
            (Launch::NoSuchWorkspace, "workspace 2 does not exist: the op has 2"),
        ];
        for (launch, says) in cases {
            let op = Affine { launch, ..Affine::new(1.0, 0.0) };
            match custom::emulate(&op, &[&x]) {
                Ok(None) => return,
                Ok(Some(_)) => panic!("{says}: launched"),
                Err(e) => assert!(e.to_string().contains(says), "{e}"),
            }
        }
    }

    /// A source the compiler rejects is an error with the compiler's words, not a panic.
    #[test]
    fn a_source_that_does_not_compile_is_an_error() {
        static BROKEN: CudaSource = CudaSource {
            name: "broken",
            source: "extern \"C\" __global__ void affine(float* y) { y[0] = undeclared; }",
            kernels: &[CudaKernel { name: "affine", params: &[Ptr] }],
        };
        struct Broken;
        impl CustomOp for Broken {
            const NAME: &'static str = "broken";
            fn plan(&self, inputs: &[&Tensor]) -> Result<OpPlan> {
                Ok(OpPlan::new().output(inputs[0].shape(), DType::F32))
            }
            fn host(&self, _: &[&Tensor], _: &mut [Tensor]) -> Result<()> {
                Ok(())
            }
            fn cuda_source(&self) -> Option<&'static CudaSource> {
                Some(&BROKEN)
            }
        }
        let dev = host();
        let x = Tensor::zeros(&dev, &[1], DType::F32).unwrap();
        match custom::emulate(&Broken, &[&x]) {
            Ok(None) => {}
            Ok(Some(_)) => panic!("a broken source ran"),
            Err(e) => assert!(e.to_string().contains("undeclared"), "{e}"),
        }
        match BROKEN.check_with_nvrtc("compute_80") {
            Ok(false) => eprintln!("skipped: no NVRTC"),
            Ok(true) => panic!("NVRTC accepted a broken source"),
            Err(e) => assert!(e.to_string().contains("undeclared"), "{e}"),
        }
    }

    /// The NVRTC check reads the PTX's parameter lists: a declaration that differs from the
    /// source is found without a GPU.
    #[test]
    fn nvrtc_check_finds_a_wrong_declaration() {
        static MISDECLARED: CudaSource = CudaSource {
            name: "misdeclared",
            source: SOURCE.source,
            kernels: &[CudaKernel { name: "affine", params: &[Ptr, Ptr, Ptr, F32, U64, U64] }],
        };
        match SOURCE.check_with_nvrtc("compute_80") {
            Ok(false) => {
                eprintln!("skipped: no NVRTC (libnvrtc.so.13 is not on LD_LIBRARY_PATH)");
                return;
            }
            Ok(true) => {}
            Err(e) => panic!("{e}"),
        }
        let err = MISDECLARED.check_with_nvrtc("compute_80").unwrap_err();
        assert!(err.to_string().contains("`affine` takes"), "{err}");
    }
}
