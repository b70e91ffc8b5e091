//! Layer normalization over the last dimension, forward and backward.

use super::dispatch::{Buffers, Op, OutputSpec, Plan, run};
use super::{expect_dtype, expect_shape, invalid, rows_cols, same_device, same_kind, same_layout};
use crate::cpu::norm as cpu;
use crate::device::Device;
use crate::dtype::{DType, with_dtype};
use crate::error::Result;
use crate::tensor::Tensor;

/// The result of [`layer_norm`].
#[derive(Debug)]
pub struct LayerNormOutput {
    /// The normalized output, `x`'s shape and dtype.
    pub y: Tensor,
    /// Per-row mean, `[rows]` f32, saved for the backward.
    pub mean: Tensor,
    /// Per-row `1 / sqrt(var + eps)`, `[rows]` f32, saved for the backward.
    pub rstd: Tensor,
}

/// Gradients of [`layer_norm`].
#[derive(Debug)]
pub struct LayerNormGrads {
    /// Gradient of the input, `x`'s shape.
    pub dx: Tensor,
    /// Gradient of the scale, `[d]`.
    pub dgamma: Tensor,
    /// Gradient of the shift, `[d]`.
    pub dbeta: Tensor,
}

/// Checks `x: [.., d]` against `gamma: [d]`; returns `(rows, d)`.
fn dims(op: &'static str, x: &Tensor, gamma: &Tensor) -> Result<(usize, usize)> {
    same_kind(op, x, gamma)?;
    let (rows, d) = rows_cols(op, x.shape())?;
    if d == 0 {
        return Err(invalid(
            op,
            format!("cannot normalize over an empty last dimension {:?}", x.shape()),
        ));
    }
    expect_shape(op, &[d], gamma)?;
    Ok((rows, d))
}

/// Layer norm over the last dimension of `x: [.., d]`: `(x - mean) * rstd * gamma + beta`
/// with the biased variance, as in PyTorch; `gamma` and `beta` are `[d]`.
///
/// # Errors
///
/// Shape, dtype and device mismatches; an empty last dimension; out of memory.
pub fn layer_norm(x: &Tensor, gamma: &Tensor, beta: &Tensor, eps: f32) -> Result<LayerNormOutput> {
    run(LayerNorm { x, gamma, beta, eps })
}

struct LayerNorm<'a> {
    x: &'a Tensor,
    gamma: &'a Tensor,
    beta: &'a Tensor,
    eps: f32,
}

impl Op for LayerNorm<'_> {
    const NAME: &'static str = "layer_norm";
    /// `y`, `mean` and `rstd`.
    type Outs = [Tensor; 3];
    type Output = LayerNormOutput;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        let (rows, d) = dims(Self::NAME, self.x, self.gamma)?;
        same_kind(Self::NAME, self.x, self.beta)?;
        expect_shape(Self::NAME, &[d], self.beta)?;
        Ok(Plan::new([
            OutputSpec::new(self.x.shape(), self.x.dtype()),
            OutputSpec::new(&[rows], DType::F32),
            OutputSpec::new(&[rows], DType::F32),
        ]))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let [y, mean, rstd] = bufs.outputs_mut();
        with_dtype!(self.x.dtype(), T => cpu::layer_norm(
            self.x.as_slice::<T>()?,
            self.gamma.as_slice::<T>()?,
            self.beta.as_slice::<T>()?,
            self.eps,
            y.out_slice::<T>(Self::NAME)?,
            mean.out_slice::<f32>(Self::NAME)?,
            rstd.out_slice::<f32>(Self::NAME)?,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::helpers::{check_rows, ptr};
        use crate::cuda::{Arg, launch, registry::LAYER_NORM};
        let [y, mean, rstd] = bufs.outputs_mut();
        let rows = mean.numel();
        check_rows(Self::NAME, rows)?;
        // SAFETY: layer_norm_T(const T* x, const T* g, const T* b, float eps, T* y, float* m,
        // float* r, u64 d), one block per row; x and y hold rows * d elements, gamma and
        // beta d, mean and rstd rows floats.
        unsafe {
            gpu.launch(
                LAYER_NORM.of(self.x.dtype()),
                launch::per_row(rows),
                &[
                    ptr(self.x)?,
                    ptr(self.gamma)?,
                    ptr(self.beta)?,
                    Arg::F32(self.eps),
                    ptr(y)?,
                    ptr(mean)?,
                    ptr(rstd)?,
                    Arg::count(self.gamma.numel()),
                ],
            )
        }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<LayerNormOutput> {
        let [y, mean, rstd] = bufs.into_outputs();
        Ok(LayerNormOutput { y, mean, rstd })
    }
}

/// Gradients of [`layer_norm`] from the forward input `x`, `gamma`, the saved `mean` and
/// `rstd`, and the upstream `dy`.
///
/// # Errors
///
/// Shape, dtype and device mismatches; out of memory.
pub fn layer_norm_backward(
    x: &Tensor,
    gamma: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    dy: &Tensor,
) -> Result<LayerNormGrads> {
    run(LayerNormBackward { x, gamma, mean, rstd, dy, acc: [None; 2] })
}

struct LayerNormBackward<'a> {
    x: &'a Tensor,
    gamma: &'a Tensor,
    mean: &'a Tensor,
    rstd: &'a Tensor,
    dy: &'a Tensor,
    /// The f32 column sums of dgamma and dbeta, and their partials.
    acc: [Option<usize>; 2],
}

impl Op for LayerNormBackward<'_> {
    const NAME: &'static str = "layer_norm_backward";
    /// `dx`, `dgamma` and `dbeta`.
    type Outs = [Tensor; 3];
    type Output = LayerNormGrads;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        let (rows, d) = dims(Self::NAME, self.x, self.gamma)?;
        same_layout(Self::NAME, self.x, self.dy)?;
        for saved in [self.mean, self.rstd] {
            same_device(Self::NAME, self.x, saved)?;
            expect_dtype(Self::NAME, DType::F32, saved)?;
            expect_shape(Self::NAME, &[rows], saved)?;
        }
        let mut plan = Plan::new([
            OutputSpec::new(self.x.shape(), self.x.dtype()),
            OutputSpec::new(&[d], self.x.dtype()),
            OutputSpec::new(&[d], self.x.dtype()),
        ]);
        // dgamma and dbeta: f32 column sums (per chunk of rows, then over chunks).
        let bytes = super::reduce::column_sum_workspace(Self::NAME, rows, d)?;
        self.acc = [plan.workspace(bytes), plan.workspace(bytes)];
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let [dx, dgamma, dbeta] = bufs.outputs_mut();
        with_dtype!(self.x.dtype(), T => cpu::layer_norm_backward(
            self.x.as_slice::<T>()?,
            self.gamma.as_slice::<T>()?,
            self.mean.as_slice::<f32>()?,
            self.rstd.as_slice::<f32>()?,
            self.dy.as_slice::<T>()?,
            dx.out_slice::<T>(Self::NAME)?,
            dgamma.out_slice::<T>(Self::NAME)?,
            dbeta.out_slice::<T>(Self::NAME)?,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::helpers::{
            check_rows, column_partials, finish_column_sums, from_f32, ptr,
        };
        use crate::cuda::registry::{LAYER_NORM_BWD, LAYER_NORM_PARAMS_BWD};
        use crate::cuda::{Arg, launch};
        let (dg, db) = (bufs.ws(self.acc[0])?, bufs.ws(self.acc[1])?);
        let [dx, dgamma, dbeta] = bufs.outputs_mut();
        let rows = self.mean.numel();
        let d = self.gamma.numel();
        let t = self.x.dtype();
        check_rows(Self::NAME, rows)?;
        // SAFETY: layer_norm_bwd_T(const T* x, const T* g, const float* m, const float* r,
        // const T* dy, T* dx, u64 d), one block per row; sizes as in `layer_norm`.
        unsafe {
            gpu.launch(
                LAYER_NORM_BWD.of(t),
                launch::per_row(rows),
                &[
                    ptr(self.x)?,
                    ptr(self.gamma)?,
                    ptr(self.mean)?,
                    ptr(self.rstd)?,
                    ptr(self.dy)?,
                    ptr(dx)?,
                    Arg::count(d),
                ],
            )?;
        }
        let (cfg, chunk) = launch::columns(rows, d);
        // SAFETY: layer_norm_params_bwd_T(const T* x, const float* m, const float* r, const
        // T* dy, float* dg, float* db, u64 rows, u64 d, u64 chunk), grid (columns, row
        // chunks); dg and db point at the partials (chunks * d floats) of the column-sum
        // workspaces.
        unsafe {
            gpu.launch(
                LAYER_NORM_PARAMS_BWD.of(t),
                cfg,
                &[
                    ptr(self.x)?,
                    ptr(self.mean)?,
                    ptr(self.rstd)?,
                    ptr(self.dy)?,
                    Arg::Ptr(column_partials(dg, rows, d)),
                    Arg::Ptr(column_partials(db, rows, d)),
                    Arg::count(rows),
                    Arg::count(d),
                    Arg::count(chunk),
                ],
            )?;
        }
        finish_column_sums(gpu, dg, rows, d)?;
        finish_column_sums(gpu, db, rows, d)?;
        from_f32(gpu, dg, dgamma)?;
        from_f32(gpu, db, dbeta)
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<LayerNormGrads> {
        let [dx, dgamma, dbeta] = bufs.into_outputs();
        Ok(LayerNormGrads { dx, dgamma, dbeta })
    }
}
