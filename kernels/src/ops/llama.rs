//! The Llama family's ops: RMS normalization ([`rms_norm`], Hugging Face's `LlamaRMSNorm`)
//! and rotary position embeddings ([`rope`], HF's `rotate_half` layout), forward and
//! backward. SiLU is a unary map ([`silu`](super::silu)); grouped-query attention is
//! composed from the existing ops by the layer (`vram_accum::layers::llama`).

use super::dispatch::{Buffers, Op, OutputSpec, Plan, run};
use super::norm::norm_dims;
use super::{expect_dtype, expect_shape, invalid, same_device, same_layout};
use crate::cpu::llama as cpu;
use crate::device::Device;
use crate::dtype::{DType, with_dtype};
use crate::error::Result;
use crate::tensor::Tensor;

pub use crate::cpu::llama::{RopeScaling, rope_inv_freq, rope_tables};

/// The result of [`rms_norm`].
#[derive(Debug)]
pub struct RmsNormOutput {
    /// The normalized output, `x`'s shape and dtype.
    pub y: Tensor,
    /// Per-row `1 / sqrt(mean(x^2) + eps)`, `[rows]` f32, saved for the backward.
    pub rstd: Tensor,
}

/// Gradients of [`rms_norm`].
#[derive(Debug)]
pub struct RmsNormGrads {
    /// Gradient of the input, `x`'s shape.
    pub dx: Tensor,
    /// Gradient of the weight, `[d]`.
    pub dweight: Tensor,
}

/// RMS norm over the last dimension of `x: [.., d]`, Hugging Face's `LlamaRMSNorm`:
/// `weight * (x * rsqrt(mean(x^2) + eps))`, the statistics in f32, the normalized value
/// rounded to `x`'s dtype before the weight multiplies it (HF's `.to(input_dtype)`).
///
/// # Errors
///
/// Shape, dtype and device mismatches; an empty last dimension; out of memory.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f32) -> Result<RmsNormOutput> {
    run(RmsNorm { x, weight, eps })
}

struct RmsNorm<'a> {
    x: &'a Tensor,
    weight: &'a Tensor,
    eps: f32,
}

impl Op for RmsNorm<'_> {
    const NAME: &'static str = "rms_norm";
    /// `y` and `rstd`.
    type Outs = [Tensor; 2];
    type Output = RmsNormOutput;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        let (rows, _) = norm_dims(Self::NAME, self.x, self.weight)?;
        Ok(Plan::new([
            OutputSpec::new(self.x.shape(), self.x.dtype()),
            OutputSpec::new(&[rows], DType::F32),
        ]))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let [y, rstd] = bufs.outputs_mut();
        with_dtype!(self.x.dtype(), T => cpu::rms_norm(
            self.x.as_slice::<T>()?,
            self.weight.as_slice::<T>()?,
            self.eps,
            y.out_slice::<T>(Self::NAME)?,
            rstd.out_slice::<f32>(Self::NAME)?,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::helpers::{check_rows, ptr};
        use crate::cuda::{Arg, launch, registry::RMS_NORM};
        let [y, rstd] = bufs.outputs_mut();
        let rows = rstd.numel();
        check_rows(Self::NAME, rows)?;
        // SAFETY: rms_norm_T(const T* x, const T* w, float eps, T* y, float* r, u64 d), one
        // block per row; x and y hold rows * d elements, w d, rstd rows floats.
        unsafe {
            gpu.launch(
                RMS_NORM.of(self.x.dtype()),
                launch::per_row(rows),
                &[
                    ptr(self.x)?,
                    ptr(self.weight)?,
                    Arg::F32(self.eps),
                    ptr(y)?,
                    ptr(rstd)?,
                    Arg::count(self.weight.numel()),
                ],
            )
        }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<RmsNormOutput> {
        let [y, rstd] = bufs.into_outputs();
        Ok(RmsNormOutput { y, rstd })
    }
}

/// Gradients of [`rms_norm`] from the forward input `x`, `weight`, the saved `rstd` and the
/// upstream `dy`.
///
/// # Errors
///
/// Shape, dtype and device mismatches; out of memory.
pub fn rms_norm_backward(
    x: &Tensor,
    weight: &Tensor,
    rstd: &Tensor,
    dy: &Tensor,
) -> Result<RmsNormGrads> {
    run(RmsNormBackward { x, weight, rstd, dy, acc: None })
}

struct RmsNormBackward<'a> {
    x: &'a Tensor,
    weight: &'a Tensor,
    rstd: &'a Tensor,
    dy: &'a Tensor,
    /// The f32 column sums of dweight and their partials.
    acc: Option<usize>,
}

impl Op for RmsNormBackward<'_> {
    const NAME: &'static str = "rms_norm_backward";
    /// `dx` and `dweight`.
    type Outs = [Tensor; 2];
    type Output = RmsNormGrads;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        let (rows, d) = norm_dims(Self::NAME, self.x, self.weight)?;
        same_layout(Self::NAME, self.x, self.dy)?;
        same_device(Self::NAME, self.x, self.rstd)?;
        expect_dtype(Self::NAME, DType::F32, self.rstd)?;
        expect_shape(Self::NAME, &[rows], self.rstd)?;
        let mut plan = Plan::new([
            OutputSpec::new(self.x.shape(), self.x.dtype()),
            OutputSpec::new(&[d], self.x.dtype()),
        ]);
        let bytes = super::reduce::column_sum_workspace(Self::NAME, rows, d)?;
        self.acc = plan.workspace(bytes);
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let [dx, dw] = bufs.outputs_mut();
        with_dtype!(self.x.dtype(), T => cpu::rms_norm_backward(
            self.x.as_slice::<T>()?,
            self.weight.as_slice::<T>()?,
            self.rstd.as_slice::<f32>()?,
            self.dy.as_slice::<T>()?,
            dx.out_slice::<T>(Self::NAME)?,
            dw.out_slice::<T>(Self::NAME)?,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::helpers::{
            check_rows, column_partials, finish_column_sums, from_f32, ptr,
        };
        use crate::cuda::registry::{RMS_NORM_BWD, RMS_NORM_WEIGHT_BWD};
        use crate::cuda::{Arg, launch};
        let acc = bufs.ws(self.acc)?;
        let [dx, dw] = bufs.outputs_mut();
        let rows = self.rstd.numel();
        let d = self.weight.numel();
        let t = self.x.dtype();
        check_rows(Self::NAME, rows)?;
        // SAFETY: rms_norm_bwd_T(const T* x, const T* w, const float* r, const T* dy, T* dx,
        // u64 d), one block per row; sizes as in `rms_norm`.
        unsafe {
            gpu.launch(
                RMS_NORM_BWD.of(t),
                launch::per_row(rows),
                &[
                    ptr(self.x)?,
                    ptr(self.weight)?,
                    ptr(self.rstd)?,
                    ptr(self.dy)?,
                    ptr(dx)?,
                    Arg::count(d),
                ],
            )?;
        }
        let (cfg, chunk) = launch::columns(rows, d);
        // SAFETY: rms_norm_weight_bwd_T(const T* x, const float* r, const T* dy, float* dw,
        // u64 rows, u64 d, u64 chunk), grid (columns, row chunks); dw points at the partials
        // (chunks * d floats) of the column-sum workspace.
        unsafe {
            gpu.launch(
                RMS_NORM_WEIGHT_BWD.of(t),
                cfg,
                &[
                    ptr(self.x)?,
                    ptr(self.rstd)?,
                    ptr(self.dy)?,
                    Arg::Ptr(column_partials(acc, rows, d)),
                    Arg::count(rows),
                    Arg::count(d),
                    Arg::count(chunk),
                ],
            )?;
        }
        finish_column_sums(gpu, acc, rows, d)?;
        from_f32(gpu, acc, dw)
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<RmsNormGrads> {
        let [dx, dweight] = bufs.into_outputs();
        Ok(RmsNormGrads { dx, dweight })
    }
}

/// Rotary position embeddings of `x: [b, s, h, dh]` (tokens as rows, the heads of a token
/// side by side: a query or key projection's output reshaped) by the tables `cos` and
/// `sin`, `[s, dh / 2]` f32 each ([`rope_tables`]): HF's `q * cos + rotate_half(q) * sin`,
/// the first half of each head's features rotated with the second, in f32 with one rounding.
///
/// # Errors
///
/// Shape, dtype and device mismatches; an odd head width; out of memory.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    run(Rope { x, cos, sin, sign: 1.0, name: "rope" })
}

/// The gradient of [`rope`] for the upstream `dy` (`x`'s shape): the inverse rotation.
///
/// # Errors
///
/// As [`rope`].
pub fn rope_backward(dy: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    run(Rope { x: dy, cos, sin, sign: -1.0, name: "rope_backward" })
}

struct Rope<'a> {
    x: &'a Tensor,
    cos: &'a Tensor,
    sin: &'a Tensor,
    sign: f32,
    name: &'static str,
}

impl Rope<'_> {
    /// `(seq, heads, head_dim)` of `x`, checked against the tables.
    fn geometry(&self) -> Result<(usize, usize, usize)> {
        let op = self.name;
        let &[_, s, h, dh] = self.x.shape() else {
            return Err(invalid(
                op,
                format!("expected x of shape [b, s, heads, head_dim], got {:?}", self.x.shape()),
            ));
        };
        if dh == 0 || !dh.is_multiple_of(2) {
            return Err(invalid(op, format!("the head width {dh} is not even")));
        }
        for t in [self.cos, self.sin] {
            same_device(op, self.x, t)?;
            expect_dtype(op, DType::F32, t)?;
            expect_shape(op, &[s, dh / 2], t)?;
        }
        Ok((s, h, dh))
    }
}

impl Op for Rope<'_> {
    const NAME: &'static str = "rope";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        self.geometry()?;
        Ok(Plan::one(self.x.shape(), self.x.dtype()))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let (s, h, dh) = self.geometry()?;
        with_dtype!(self.x.dtype(), T => cpu::rope(
            self.x.as_slice::<T>()?,
            self.cos.as_slice::<f32>()?,
            self.sin.as_slice::<f32>()?,
            s,
            h,
            dh,
            self.sign,
            bufs.out().out_slice::<T>(self.name)?,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::{Arg, helpers::ptr, launch, registry::ROPE};
        let (s, h, dh) = self.geometry()?;
        let y = bufs.out();
        let pairs = y.numel() / 2;
        // SAFETY: rope_T(const T* x, const float* cos, const float* sin, T* y, float sign,
        // u64 pairs, Div half, Div heads, Div seq): x and y hold 2 * pairs elements of
        // [b, s, h, dh], cos and sin s * dh / 2 floats (checked in `plan`).
        unsafe {
            gpu.launch(
                ROPE.of(self.x.dtype()),
                launch::elementwise(pairs),
                &[
                    ptr(self.x)?,
                    ptr(self.cos)?,
                    ptr(self.sin)?,
                    ptr(y)?,
                    Arg::F32(self.sign),
                    Arg::count(pairs),
                    Arg::div(dh / 2),
                    Arg::div(h),
                    Arg::div(s),
                ],
            )
        }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev() -> Device {
        Device::host(1 << 28)
    }

    fn vals(n: usize, seed: u64) -> Vec<f32> {
        crate::cpu::elementwise::testing::seeded_in(n, seed, -2.0, 2.0)
    }

    fn t(d: &Device, shape: &[usize], v: &[f32], dt: DType) -> Tensor {
        Tensor::from_f32_slice(d, shape, v, dt).unwrap()
    }

    fn close(what: &str, got: &[f32], want: &[f32], tol: f32) {
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= tol * w.abs().max(1.0), "{what} [{i}]: {g} vs {w}");
        }
    }

    /// RMS norm, written as HF's LlamaRMSNorm in f64: `w * x / sqrt(mean(x^2) + eps)`.
    fn rms_reference(x: &[f32], w: &[f32], eps: f64) -> Vec<f32> {
        let d = w.len();
        x.chunks(d)
            .flat_map(|r| {
                let ms = r.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / d as f64;
                let rs = 1.0 / (ms + eps).sqrt();
                r.iter().zip(w).map(move |(&v, &g)| (f64::from(v) * rs * f64::from(g)) as f32)
            })
            .collect()
    }

    #[test]
    fn rms_norm_matches_its_definition_and_its_gradients_finite_differences() {
        let d = dev();
        let (rows, n) = (6, 10);
        let (xv, wv, dyv) = (vals(rows * n, 1), vals(n, 2), vals(rows * n, 3));
        let (x, w) = (t(&d, &[rows, n], &xv, DType::F32), t(&d, &[n], &wv, DType::F32));
        let out = rms_norm(&x, &w, 1e-6).unwrap();
        close("y", &out.y.to_f32_vec().unwrap(), &rms_reference(&xv, &wv, 1e-6), 1e-5);
        let dy = t(&d, &[rows, n], &dyv, DType::F32);
        let g = rms_norm_backward(&x, &w, &out.rstd, &dy).unwrap();
        // The loss sum(y * dy) in f64, by central differences in x and in w.
        let loss = |x: &[f32], w: &[f32]| -> f64 {
            rms_reference(x, w, 1e-6).iter().zip(&dyv).map(|(&a, &b)| f64::from(a * b)).sum()
        };
        let h = 1e-2f32;
        let fd = |v: &[f32], i: usize, which: bool| {
            let (mut p, mut m) = (v.to_vec(), v.to_vec());
            p[i] += h;
            m[i] -= h;
            let (lp, lm) =
                if which { (loss(&p, &wv), loss(&m, &wv)) } else { (loss(&xv, &p), loss(&xv, &m)) };
            ((lp - lm) / (2.0 * f64::from(h))) as f32
        };
        let want_dx: Vec<f32> = (0..xv.len()).map(|i| fd(&xv, i, true)).collect();
        let want_dw: Vec<f32> = (0..wv.len()).map(|i| fd(&wv, i, false)).collect();
        close("dx", &g.dx.to_f32_vec().unwrap(), &want_dx, 2e-2);
        close("dw", &g.dweight.to_f32_vec().unwrap(), &want_dw, 2e-2);
        // bf16: within rounding of the f32 result.
        let xb = t(&d, &[rows, n], &xv, DType::BF16);
        let yb = rms_norm(&xb, &t(&d, &[n], &wv, DType::BF16), 1e-6).unwrap();
        close("bf16 y", &yb.y.to_f32_vec().unwrap(), &out.y.to_f32_vec().unwrap(), 3e-2);
    }

    #[test]
    fn rope_is_huggingfaces_rotate_half_composition_and_its_backward_the_transpose() {
        let d = dev();
        let (b, s, h, dh) = (2, 7, 3, 8);
        let half = dh / 2;
        let xv = vals(b * s * h * dh, 4);
        let (cv, sv) = rope_tables(s, dh, 500_000.0, RopeScaling::Default);
        let (cos, sin) = (t(&d, &[s, half], &cv, DType::F32), t(&d, &[s, half], &sv, DType::F32));
        let x = t(&d, &[b, s, h, dh], &xv, DType::F32);
        let y = rope(&x, &cos, &sin).unwrap().to_f32_vec().unwrap();
        // HF: emb = cat(freqs, freqs); q * cos + rotate_half(q) * sin, rotate_half(q) =
        // cat(-q2, q1), per head at the token's position.
        let mut want = vec![0.0f32; xv.len()];
        for (i, head) in xv.chunks(dh).enumerate() {
            let pos = (i / h) % s;
            let full = |tab: &[f32], j: usize| tab[pos * half + j % half];
            for j in 0..dh {
                let rot = if j < half { -head[j + half] } else { head[j - half] };
                want[i * dh + j] = head[j] * full(&cv, j) + rot * full(&sv, j);
            }
        }
        close("rope", &y, &want, 1e-6);
        // <rope(x), dy> = <x, rope_backward(dy)>: the backward is the transpose.
        let dyv = vals(xv.len(), 5);
        let dx = rope_backward(&t(&d, &[b, s, h, dh], &dyv, DType::F32), &cos, &sin)
            .unwrap()
            .to_f32_vec()
            .unwrap();
        let lhs: f64 = y.iter().zip(&dyv).map(|(a, b)| f64::from(a * b)).sum();
        let rhs: f64 = xv.iter().zip(&dx).map(|(a, b)| f64::from(a * b)).sum();
        assert!((lhs - rhs).abs() < 1e-4 * lhs.abs().max(1.0), "{lhs} vs {rhs}");
        // Bad shapes name the problem.
        let odd = t(&d, &[1, s, 1, 3], &vals(s * 3, 6), DType::F32);
        let err = rope(&odd, &cos, &sin).unwrap_err().to_string();
        assert!(err.contains("not even"), "{err}");
    }

    #[test]
    fn silu_and_its_gradient_match_their_definitions() {
        let d = dev();
        let xv = vals(50, 7);
        let x = t(&d, &[50], &xv, DType::F32);
        let y = crate::ops::silu(&x).unwrap().to_f32_vec().unwrap();
        let dy = t(&d, &[50], &[1.0; 50], DType::F32);
        let g = crate::ops::silu_backward(&x, &dy).unwrap().to_f32_vec().unwrap();
        for (i, &v) in xv.iter().enumerate() {
            let v = f64::from(v);
            let f = |v: f64| v / (1.0 + (-v).exp());
            assert!((f64::from(y[i]) - f(v)).abs() < 1e-6);
            let fd = (f(v + 1e-4) - f(v - 1e-4)) / 2e-4;
            assert!((f64::from(g[i]) - fd).abs() < 1e-4, "{i}: {} vs {fd}", g[i]);
        }
    }
}
