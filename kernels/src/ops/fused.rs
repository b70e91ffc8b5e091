//! Fused epilogues: `gelu(x + bias)` (a GPT MLP's first linear layer without its bias, then
//! the bias and the activation) in one pass forward and one pass backward, the backward
//! also summing the bias gradient's partials per chunk of rows (then one small launch adds
//! them). Unfused, the same work is bias_add + gelu forward (two launches, the sum stored
//! and read again) and gelu_bwd + the bias gradient's column sums and cast backward (three
//! or four launches).
//!
//! [`add_layer_norm`] is a transformer block's residual add and the layer norm after it in
//! one launch per row block instead of two (the sum is still stored: the residual stream
//! continues from it); its backward is layer norm's plus the residual's gradient, as before.
//!
//! Each result is the unfused ops' bit for bit on the host (the sum `x + bias` rounded to
//! the dtype as `bias_add` stores it, the gradient rounded as `gelu_backward` stores it and
//! summed in `bias_add_backward`'s order); the kernels follow the same steps (emulated in the
//! tests; on a GPU within the device's `tanhf` and contraction).

use super::dispatch::{Buffers, Op, OutputSpec, Plan, run};
use super::elementwise::param_dims;
use super::norm::{LayerNormOutput, param_chunks};
use super::same_layout;
use crate::cpu::{activation as act, elementwise as ew, norm};
use crate::device::Device;
use crate::dtype::{Element, with_dtype};
use crate::error::Result;
use crate::tensor::Tensor;

/// The gradients of [`bias_gelu`].
#[derive(Debug)]
pub struct BiasGeluGrads {
    /// Of `x` (and of `x + bias`): `dy * gelu'(x + bias)`.
    pub dx: Tensor,
    /// Of the bias: the column sums of `dx`.
    pub dbias: Tensor,
}

/// `gelu(x + bias)` (tanh approximation) with `bias: [d]` broadcast over the rows of
/// `x: [.., d]`, in one pass.
///
/// # Errors
///
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) if `bias` is not `[d]`; dtype and
/// device mismatches; [`Error::OutOfMemory`](crate::Error::OutOfMemory).
pub fn bias_gelu(x: &Tensor, bias: &Tensor) -> Result<Tensor> {
    run(BiasGelu { x, bias })
}

/// The backward of [`bias_gelu`] from its input `x`, `bias` and the output gradient `dy`
/// (the sum is recomputed, not saved), in one pass plus the bias gradient's final sums.
///
/// # Errors
///
/// As [`bias_gelu`], and for a `dy` not of `x`'s layout.
pub fn bias_gelu_backward(x: &Tensor, bias: &Tensor, dy: &Tensor) -> Result<BiasGeluGrads> {
    run(BiasGeluBackward { x, bias, dy, partials: None })
}

/// The result of [`add_layer_norm`]: the sum and its layer norm.
#[derive(Debug)]
pub struct AddLayerNorm {
    /// `a + b`, the residual stream after the add.
    pub sum: Tensor,
    /// `layer_norm(a + b)`, with the statistics its backward needs.
    pub norm: LayerNormOutput,
}

/// `s = a + b` and `layer_norm(s, gamma, beta, eps)` over the last dimension, in one pass:
/// [`add`](super::add) then [`layer_norm`](super::layer_norm) in one launch.
///
/// # Errors
///
/// As those two ops: shape, dtype and device mismatches; out of memory.
pub fn add_layer_norm(
    a: &Tensor,
    b: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    eps: f32,
) -> Result<AddLayerNorm> {
    run(AddLayerNormOp { a, b, gamma, beta, eps })
}

struct AddLayerNormOp<'a> {
    a: &'a Tensor,
    b: &'a Tensor,
    gamma: &'a Tensor,
    beta: &'a Tensor,
    eps: f32,
}

impl Op for AddLayerNormOp<'_> {
    const NAME: &'static str = "add_layer_norm";
    /// `sum`, `y`, `mean` and `rstd`.
    type Outs = (Tensor, Tensor, [Tensor; 2]);
    type Output = AddLayerNorm;

    fn device(&self) -> &Device {
        self.a.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        same_layout(Self::NAME, self.a, self.b)?;
        let (rows, d) = param_dims(Self::NAME, self.a, self.gamma)?;
        param_dims(Self::NAME, self.a, self.beta)?;
        if d == 0 {
            return Err(super::invalid(Self::NAME, "the last dimension is empty"));
        }
        let (shape, dt) = (self.a.shape(), self.a.dtype());
        let stat = || OutputSpec::new(&[rows], crate::DType::F32);
        Ok(Plan::new((OutputSpec::new(shape, dt), OutputSpec::new(shape, dt), [stat(), stat()])))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let (sum, y, [mean, rstd]) = bufs.outputs_mut();
        with_dtype!(self.a.dtype(), T => {
            let s = sum.out_slice::<T>(Self::NAME)?;
            ew::add(self.a.as_slice::<T>()?, self.b.as_slice::<T>()?, s)?;
            norm::layer_norm(
                s,
                self.gamma.as_slice::<T>()?,
                self.beta.as_slice::<T>()?,
                self.eps,
                y.out_slice::<T>(Self::NAME)?,
                mean.out_slice::<f32>(Self::NAME)?,
                rstd.out_slice::<f32>(Self::NAME)?,
            )
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::helpers::{check_rows, ptr};
        use crate::cuda::{Arg, launch, registry::ADD_LAYER_NORM};
        let (sum, y, [mean, rstd]) = bufs.outputs_mut();
        let rows = mean.numel();
        check_rows(Self::NAME, rows)?;
        // SAFETY: add_layer_norm_T(const T* a, const T* b, const T* g, const T* beta, float
        // eps, T* s, T* y, float* m, float* r, u64 d), one block per row; a, b, s and y hold
        // rows * d elements, gamma and beta d, mean and rstd rows floats.
        unsafe {
            gpu.launch(
                ADD_LAYER_NORM.of(self.a.dtype()),
                launch::per_row(rows),
                &[
                    ptr(self.a)?,
                    ptr(self.b)?,
                    ptr(self.gamma)?,
                    ptr(self.beta)?,
                    Arg::F32(self.eps),
                    ptr(sum)?,
                    ptr(y)?,
                    ptr(mean)?,
                    ptr(rstd)?,
                    Arg::count(self.gamma.numel()),
                ],
            )
        }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<AddLayerNorm> {
        let (sum, y, [mean, rstd]) = bufs.into_outputs();
        Ok(AddLayerNorm { sum, norm: LayerNormOutput { y, mean, rstd } })
    }
}

/// `x + bias` on the host, rounded as `bias_add` stores it.
fn pre_activation<T: Element>(x: &Tensor, bias: &Tensor) -> Result<Vec<T>> {
    let mut pre = vec![T::default(); x.numel()];
    ew::bias_add(x.as_slice::<T>()?, bias.as_slice::<T>()?, &mut pre)?;
    Ok(pre)
}

struct BiasGelu<'a> {
    x: &'a Tensor,
    bias: &'a Tensor,
}

impl Op for BiasGelu<'_> {
    const NAME: &'static str = "bias_gelu";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        param_dims(Self::NAME, self.x, self.bias)?;
        Ok(Plan::one(self.x.shape(), self.x.dtype()))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        with_dtype!(self.x.dtype(), T => {
            let pre = pre_activation::<T>(self.x, self.bias)?;
            act::gelu(&pre, bufs.out().out_slice::<T>(Self::NAME)?)
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let kernel = crate::cuda::registry::BIAS_GELU.of(self.x.dtype());
        super::elementwise::launch_bias_rows(gpu, kernel, self.x, self.bias, bufs.out())
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

struct BiasGeluBackward<'a> {
    x: &'a Tensor,
    bias: &'a Tensor,
    dy: &'a Tensor,
    /// The bias gradient's f32 partial sums, `[chunks, d]`.
    partials: Option<usize>,
}

impl Op for BiasGeluBackward<'_> {
    const NAME: &'static str = "bias_gelu_backward";
    /// `dx` and `dbias`.
    type Outs = [Tensor; 2];
    type Output = BiasGeluGrads;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        let (rows, d) = param_dims(Self::NAME, self.x, self.bias)?;
        same_layout(Self::NAME, self.x, self.dy)?;
        let mut plan = Plan::new([
            OutputSpec::new(self.x.shape(), self.x.dtype()),
            OutputSpec::new(&[d], self.x.dtype()),
        ]);
        let floats = crate::params::mul(Self::NAME, "the partial sums", param_chunks(rows), d)?;
        self.partials =
            plan.workspace(crate::params::mul(Self::NAME, "the partial sums", floats, 4)?);
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let [dx, dbias] = bufs.outputs_mut();
        with_dtype!(self.x.dtype(), T => {
            let pre = pre_activation::<T>(self.x, self.bias)?;
            let dx = dx.out_slice::<T>(Self::NAME)?;
            act::gelu_backward(&pre, self.dy.as_slice::<T>()?, dx)?;
            ew::bias_add_backward(dx, dbias.out_slice::<T>(Self::NAME)?)
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let partials = bufs.ws(self.partials)?;
        let [dx, dbias] = bufs.outputs_mut();
        let at = BiasGeluBackwardAddresses {
            x: self.x.cuda_ptr()?,
            bias: self.bias.cuda_ptr()?,
            dy: self.dy.cuda_ptr()?,
            dx: dx.cuda_ptr()?,
            dbias: dbias.cuda_ptr()?,
            partials,
        };
        let rows = self.x.numel() / self.bias.numel().max(1);
        // SAFETY: x, dy, dx hold rows * d elements, bias and dbias d, the workspace the
        // partials (`plan`).
        unsafe { backward_launches(gpu, &at, rows, self.bias.numel(), self.x.dtype()) }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<BiasGeluGrads> {
        let [dx, dbias] = bufs.into_outputs();
        Ok(BiasGeluGrads { dx, dbias })
    }
}

/// The device addresses [`backward_launches`] works on.
#[cfg(feature = "cuda")]
pub(crate) struct BiasGeluBackwardAddresses {
    pub(crate) x: u64,
    pub(crate) bias: u64,
    pub(crate) dy: u64,
    pub(crate) dx: u64,
    pub(crate) dbias: u64,
    /// `param_chunks(rows) * d` floats.
    pub(crate) partials: u64,
}

/// The backward's launches over `[rows, d]` of `dtype`: `bias_gelu_bwd` (dx and the bias
/// gradient's partials, a thread per column and chunk of rows), then `column_finish`.
/// Written against [`Exec`](crate::cuda::Exec) so that the tests run it in the emulation.
///
/// # Safety
///
/// The addresses hold what [`BiasGeluBackwardAddresses`] says for `rows` and `d`.
#[cfg(feature = "cuda")]
pub(crate) unsafe fn backward_launches(
    gpu: &impl crate::cuda::Exec,
    at: &BiasGeluBackwardAddresses,
    rows: usize,
    d: usize,
    dtype: crate::DType,
) -> Result<()> {
    use crate::cuda::registry::{BIAS_GELU_BWD, COLUMN_FINISH};
    use crate::cuda::{Arg, launch};
    if d == 0 {
        return Ok(());
    }
    let (cfg, chunk) = launch::columns(rows, d);
    // SAFETY: bias_gelu_bwd_T(const T* x, const T* b, const T* dy, T* dx, float* part, u64
    // rows, u64 d, u64 chunk), grid (column blocks, chunks); then column_finish_T(const
    // float* part, T* out, u64 chunks, u64 d) over the d columns. Sizes: the caller's
    // contract.
    unsafe {
        gpu.launch(
            BIAS_GELU_BWD.of(dtype),
            cfg,
            &[
                Arg::Ptr(at.x),
                Arg::Ptr(at.bias),
                Arg::Ptr(at.dy),
                Arg::Ptr(at.dx),
                Arg::Ptr(at.partials),
                Arg::count(rows),
                Arg::count(d),
                Arg::count(chunk),
            ],
        )?;
        gpu.launch(
            COLUMN_FINISH.of(dtype),
            launch::elementwise(d),
            &[
                Arg::Ptr(at.partials),
                Arg::Ptr(at.dbias),
                Arg::count(param_chunks(rows)),
                Arg::count(d),
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;
    use crate::ops;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u64 * 2_654_435_761 + seed * 97) % 2001) as f32 / 500.0) - 2.0)
            .collect()
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.to_f32_vec().unwrap().iter().map(|v| v.to_bits()).collect()
    }

    /// Forward and backward are the unfused ops' (bias_add, gelu, gelu_backward,
    /// bias_add_backward) bit for bit on the host, in every dtype, over one chunk of rows
    /// and several.
    #[test]
    fn bias_gelu_is_the_unfused_ops_bit_for_bit() {
        let dev = Device::host(64 << 20);
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for (rows, d) in [(3, 5), (130, 33), (0, 4)] {
                let t = |v: &[f32], s: &[usize]| Tensor::from_f32_slice(&dev, s, v, dtype).unwrap();
                let x = t(&values(rows * d, 1), &[rows, d]);
                let b = t(&values(d, 2), &[d]);
                let dy = t(&values(rows * d, 3), &[rows, d]);
                let pre = ops::bias_add(&x, &b).unwrap();
                let y = bias_gelu(&x, &b).unwrap();
                assert_eq!(bits(&y), bits(&ops::gelu(&pre).unwrap()), "{dtype:?} {rows}x{d}");
                let g = bias_gelu_backward(&x, &b, &dy).unwrap();
                let dx = ops::gelu_backward(&pre, &dy).unwrap();
                assert_eq!(bits(&g.dx), bits(&dx), "{dtype:?} {rows}x{d} dx");
                assert_eq!(bits(&g.dbias), bits(&ops::bias_add_backward(&dx).unwrap()));
            }
        }
        let x = Tensor::zeros(&dev, &[2, 3], DType::F32).unwrap();
        assert!(bias_gelu(&x, &Tensor::zeros(&dev, &[2], DType::F32).unwrap()).is_err());
        assert!(bias_gelu(&x, &Tensor::zeros(&dev, &[3], DType::F16).unwrap()).is_err());
        let b = Tensor::zeros(&dev, &[3], DType::F32).unwrap();
        assert!(
            bias_gelu_backward(&x, &b, &Tensor::zeros(&dev, &[3, 3], DType::F32).unwrap()).is_err()
        );
    }

    /// The residual add + layer norm is `add` then `layer_norm`, bit for bit on the host.
    #[test]
    fn add_layer_norm_is_add_then_layer_norm_bit_for_bit() {
        let dev = Device::host(64 << 20);
        for dtype in [DType::F32, DType::BF16] {
            let t = |v: &[f32], s: &[usize]| Tensor::from_f32_slice(&dev, s, v, dtype).unwrap();
            let (rows, d) = (7, 40);
            let (a, b) = (t(&values(rows * d, 4), &[rows, d]), t(&values(rows * d, 5), &[rows, d]));
            let (g, be) = (t(&values(d, 6), &[d]), t(&values(d, 7), &[d]));
            let got = add_layer_norm(&a, &b, &g, &be, 1e-5).unwrap();
            let sum = ops::add(&a, &b).unwrap();
            let want = ops::layer_norm(&sum, &g, &be, 1e-5).unwrap();
            assert_eq!(bits(&got.sum), bits(&sum));
            assert_eq!(bits(&got.norm.y), bits(&want.y));
            assert_eq!(bits(&got.norm.rstd), bits(&want.rstd));
            assert!(add_layer_norm(&a, &g, &g, &be, 1e-5).is_err());
        }
    }

    /// The host and a virtual device (the GPU's plan) make the same requests: the outputs
    /// and one workspace of the bias gradient's partials, `ceil(rows / 64) * d` floats; the
    /// same for layer norm's backward (its dgamma and dbeta partials, twice that).
    #[test]
    fn host_and_virtual_devices_allocate_the_same_partials() {
        let (rows, d) = (130, 48);
        let mut traces = Vec::new();
        for dev in [Device::host(64 << 20), Device::virtual_device(64 << 20)] {
            let z = |s: &[usize]| Tensor::zeros(&dev, s, DType::BF16).unwrap();
            let (x, b, dy) = (z(&[rows, d]), z(&[d]), z(&[rows, d]));
            let ln = ops::layer_norm(&x, &b, &b, 1e-5).unwrap();
            dev.record_history(Some(100));
            drop(bias_gelu_backward(&x, &b, &dy).unwrap());
            drop(ops::layer_norm_backward(&x, &b, &ln.mean, &ln.rstd, &dy).unwrap());
            let allocs: Vec<usize> = dev
                .trace()
                .iter()
                .filter(|e| e.action == vram_alloc::TraceAction::Alloc)
                .map(|e| e.requested)
                .collect();
            traces.push(allocs);
        }
        let (x, p) = (rows * d * 2, 3 * d * 4);
        assert_eq!(traces[0], [x, d * 2, p, x, d * 2, d * 2, 2 * p]);
        assert_eq!(traces[0], traces[1]);
    }

    /// The residual add + layer norm kernel, emulated, against the host: the sum bit for bit,
    /// the norm within rounding (the block adds the row's statistics in another order).
    #[cfg(feature = "cuda")]
    #[test]
    fn add_layer_norm_kernel_matches_the_host() {
        use crate::cuda::emulate::launch;
        use crate::cuda::registry::ADD_LAYER_NORM;
        use crate::cuda::{Arg, launch as grid};
        let dev = Device::host(64 << 20);
        for dtype in [DType::F32, DType::BF16] {
            let t = |v: &[f32], s: &[usize]| Tensor::from_f32_slice(&dev, s, v, dtype).unwrap();
            let (rows, d) = (3, 300);
            let (a, b) = (t(&values(rows * d, 4), &[rows, d]), t(&values(rows * d, 5), &[rows, d]));
            let (g, be) = (t(&values(d, 6), &[d]), t(&values(d, 7), &[d]));
            let want = add_layer_norm(&a, &b, &g, &be, 1e-5).unwrap();
            let (s, y) = (
                t(&vec![f32::NAN; rows * d], &[rows, d]),
                t(&vec![f32::NAN; rows * d], &[rows, d]),
            );
            let (mut m, mut r) = (vec![f32::NAN; rows], vec![f32::NAN; rows]);
            let at = |t: &Tensor| Arg::Ptr(t.storage().address());
            let args = [
                at(&a),
                at(&b),
                at(&g),
                at(&be),
                Arg::F32(1e-5),
                at(&s),
                at(&y),
                Arg::Ptr(m.as_mut_ptr() as u64),
                Arg::Ptr(r.as_mut_ptr() as u64),
                Arg::count(d),
            ];
            if !launch(ADD_LAYER_NORM.of(dtype), grid::per_row(rows), &args) {
                return;
            }
            assert_eq!(bits(&s), bits(&want.sum), "{dtype:?} sum");
            let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
            let close = |what: &str, got: &[f32], want: &[f32]| {
                for (i, (g, w)) in got.iter().zip(want).enumerate() {
                    assert!((g - w).abs() <= tol * w.abs().max(1.0), "{what} {i}: {g} vs {w}");
                }
            };
            close("y", &y.to_f32_vec().unwrap(), &want.norm.y.to_f32_vec().unwrap());
            close("mean", &m, &want.norm.mean.to_f32_vec().unwrap());
            close("rstd", &r, &want.norm.rstd.to_f32_vec().unwrap());
        }
    }

    /// The kernels, emulated on the host through the op's own launch code, against the host
    /// op: bit for bit (the emulation's `tanhf` is the host's; no contraction).
    #[cfg(feature = "cuda")]
    #[test]
    fn bias_gelu_kernels_match_the_host_bit_for_bit() {
        use crate::cuda::emulate::{Emulator, launch};
        use crate::cuda::registry::{BIAS_GELU, BIAS_GELU_BWD};
        use crate::cuda::{Arg, launch as grid};
        let Some(e) = Emulator::new(BIAS_GELU_BWD.of(DType::F32)) else { return };
        let dev = Device::host(64 << 20);
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for (rows, d) in [(3, 300), (130, 33)] {
                let t = |v: &[f32], s: &[usize]| Tensor::from_f32_slice(&dev, s, v, dtype).unwrap();
                let (x, b) = (t(&values(rows * d, 1), &[rows, d]), t(&values(d, 2), &[d]));
                let dy = t(&values(rows * d, 3), &[rows, d]);
                let want_y = bias_gelu(&x, &b).unwrap();
                let want = bias_gelu_backward(&x, &b, &dy).unwrap();
                let nan = |s: &[usize]| t(&vec![f32::NAN; s.iter().product()], s);
                let (y, dx, db) = (nan(&[rows, d]), nan(&[rows, d]), nan(&[d]));
                let mut partials = vec![f32::NAN; param_chunks(rows) * d];
                let a = |t: &Tensor| t.storage().address();
                let n = rows * d;
                let args =
                    [Arg::Ptr(a(&x)), Arg::Ptr(a(&b)), Arg::Ptr(a(&y)), Arg::count(n), Arg::div(d)];
                assert!(launch(BIAS_GELU.of(dtype), grid::elementwise(n), &args));
                let at = BiasGeluBackwardAddresses {
                    x: a(&x),
                    bias: a(&b),
                    dy: a(&dy),
                    dx: a(&dx),
                    dbias: a(&db),
                    partials: partials.as_mut_ptr() as u64,
                };
                // SAFETY: host buffers of the sizes the launches address.
                unsafe { backward_launches(&e, &at, rows, d, dtype) }.unwrap();
                let what = format!("{dtype:?} {rows}x{d}");
                assert_eq!(bits(&y), bits(&want_y), "{what} y");
                assert_eq!(bits(&dx), bits(&want.dx), "{what} dx");
                assert_eq!(bits(&db), bits(&want.dbias), "{what} dbias");
            }
        }
    }
}
