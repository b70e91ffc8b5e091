//! Batch normalization over the channels of `x: [n, c, ..]` (`BatchNorm2d` on images,
//! `BatchNorm1d` on `[n, c]`), training and evaluation forward, and backward.
//!
//! As PyTorch's: in training every channel is normalized with its mean and biased variance
//! over the batch and the spatial positions, and the running statistics, when given, move
//! by `momentum` towards the mean and the *unbiased* variance
//! (`aten/src/ATen/native/Normalization.cpp`, `batch_norm_cpu_update_stats_template`); in
//! evaluation the running statistics normalize. The scale and shift (`gamma`, `beta`) and
//! the running statistics are stored either in `x`'s dtype or in f32 (what a 16-bit input
//! meets under autocast, where PyTorch runs batch norm on the 16-bit input with the f32
//! module's parameters); arithmetic is in f32. The saved statistics are f32 `[c]`.
//!
//! On a CUDA device where cuDNN loaded (and unless [`ConvBackend::Own`](crate::ConvBackend),
//! the convolutions' switch, is chosen), the three ops run through cuDNN exactly where
//! PyTorch's `_select_batch_norm_backend` (`aten/src/ATen/native/Normalization.cpp`) does:
//! an f32 input with f32 parameters or an f16 input with f32 parameters (autocast), 3 to 5
//! dimensions, at most 880801 images in training and 65535 in evaluation, fewer than
//! `i32::MAX` elements (`BnCase::cudnn_refusal` lists the rule). bf16, f16 parameters and
//! `[n, c]` inputs run the own kernels there as in PyTorch. cuDNN writes the same saved
//! mean and invstd and updates the running statistics by the same rule, so a forward on one
//! path and its backward on the other agree (`cuda::dnn::bn` has the details: mode,
//! descriptors, workspace and reserve space, the backward's `eps`). A backward whose shape
//! would need cuDNN's reserve space runs the own kernels: vram's forward keeps none.
//!
//! cuDNN's workspace and reserve space are taken from the caching allocator when it runs,
//! instead of the own kernels' per-channel workspaces (`2 * c * parts` floats and alike);
//! host and virtual devices plan the own kernels' (their sizes cannot be asked of cuDNN
//! without a GPU), so on a GPU with cuDNN the peak of a batch norm differs from theirs by
//! those buffers. The cuDNN path has been compiled and its pure parts tested without a
//! GPU; it has not yet run on a GPU (`tests/cudnn_vs_host.rs` checks it against the host
//! where one is).
//!
//! Channels_last (`torch.channels_last`): [`batch_norm_nhwc`], [`batch_norm_eval_nhwc`] and
//! [`batch_norm_backward_nhwc`] take `x` (and `dy`) as `[n, h, w, c]` and read it in place,
//! the channel the fastest index: no permute, so they allocate what the NCHW ops allocate
//! (at ResNet-50's first batch norm, `[64, 112, 112, 64]` bf16, the training forward 4
//! allocations and 103 MB instead of the permute composition's 6 and 308 MB, its peak 103 MB
//! instead of 206). On the host each channel's sums accumulate in the NCHW op's order
//! (images, then positions), so the results are bit-identical to the NCHW op on the permuted
//! input. On a GPU the statistics and the backward's sums run `bn_nhwc_partial` and
//! `bn_nhwc_bwd_partial`: a warp along 32 neighbouring channels (each row's load coalesced),
//! blocks of grid.y along parts of whole rows of the `[n * h * w, c]` matrix
//! (`nhwc_parts`, from the shape alone, so host and virtual devices plan the GPU's
//! workspace), as PyTorch's `batch_norm_collect_statistics_channels_last_kernel`
//! (`aten/src/ATen/native/cuda/Normalization.cuh`) but with per-part partials instead of
//! its semaphores; the partials merge, and the elementwise parts run, through the NCHW
//! kernels over `[rows, c, 1]` (`s = 1`). Where PyTorch would run cuDNN (the same rule,
//! `BnCase::cudnn_refusal`), cuDNN runs with NHWC descriptors and, in training and its
//! backward, `CUDNN_BATCHNORM_SPATIAL_PERSISTENT` (PyTorch's `getCudnnBatchNormMode` for a
//! channels_last input), the backward only where that mode asks for no reserve space. The
//! channels_last kernels have run in the emulation (`cuda::emulated_kernels`) and compiled
//! with NVRTC; neither they nor the channels_last cuDNN path have yet run on a GPU
//! (`tests/batch_norm_nhwc.rs` checks both against the host where one is).

use super::dispatch::{Buffers, Op, OutputSpec, Plan, run};
use super::{expect_dtype, expect_shape, invalid, same_device, same_layout};
use crate::cpu::batch_norm as cpu;
use crate::device::Device;
use crate::dtype::{DType, with_dtype};
use crate::error::Result;
use crate::params::ConvLayout;
use crate::tensor::Tensor;

/// The result of [`batch_norm`] in training.
#[derive(Debug)]
pub struct BatchNormOutput {
    /// The normalized output, `x`'s shape and dtype.
    pub y: Tensor,
    /// Per-channel batch mean, `[c]` f32, saved for the backward.
    pub mean: Tensor,
    /// Per-channel `1 / sqrt(var + eps)` of the batch (biased variance), `[c]` f32.
    pub invstd: Tensor,
}

/// Gradients of [`batch_norm`].
#[derive(Debug)]
pub struct BatchNormGrads {
    /// Gradient of the input, `x`'s shape and dtype.
    pub dx: Tensor,
    /// Gradient of the scale, `[c]`, `gamma`'s dtype.
    pub dgamma: Tensor,
    /// Gradient of the shift, `[c]`, `gamma`'s dtype.
    pub dbeta: Tensor,
}

/// The running statistics a training [`batch_norm`] updates in place:
/// `running = (1 - momentum) * running + momentum * batch` (PyTorch's convention, default
/// momentum 0.1), with the unbiased batch variance.
#[derive(Debug)]
pub struct RunningStats<'a> {
    /// Running mean, `[c]`, the parameters' dtype.
    pub mean: &'a mut Tensor,
    /// Running variance, `[c]`, the parameters' dtype.
    pub var: &'a mut Tensor,
    /// Weight of the batch statistics, in `[0, 1]`.
    pub momentum: f32,
}

/// `(n, c, s)` of `x: [n, c, spatial..]` (`s` the product of the spatial sizes, 1 for
/// `[n, c]`), or of a channels_last `x: [n, h, w, c]` when `nhwc` (`s = h * w`), after
/// checking the per-channel tensors: `[c]`, on `x`'s device, all of one dtype that is `x`'s
/// or f32, and `eps` finite and `>= 0`.
fn dims(
    op: &'static str,
    x: &Tensor,
    per_channel: &[&Tensor],
    eps: f32,
    nhwc: bool,
) -> Result<(usize, usize, usize)> {
    let shape = x.shape();
    if nhwc && shape.len() != 4 {
        return Err(invalid(
            op,
            format!("expected x [batch, h, w, channels], got shape {shape:?}"),
        ));
    }
    if shape.len() < 2 {
        return Err(invalid(op, format!("expected [batch, channels, ..], got shape {shape:?}")));
    }
    let (n, c, s) = if nhwc {
        (shape[0], shape[3], shape[1] * shape[2])
    } else {
        (shape[0], shape[1], shape[2..].iter().product::<usize>())
    };
    if c == 0 {
        return Err(invalid(op, format!("cannot normalize zero channels {shape:?}")));
    }
    let pdtype = per_channel[0].dtype();
    if pdtype != x.dtype() && pdtype != DType::F32 {
        return Err(invalid(
            op,
            format!(
                "parameters in {pdtype:?} for a {:?} input: they must be f32 or {:?}",
                x.dtype(),
                x.dtype()
            ),
        ));
    }
    for t in per_channel {
        same_device(op, x, t)?;
        expect_dtype(op, pdtype, t)?;
        expect_shape(op, &[c], t)?;
    }
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(invalid(op, format!("eps {eps} is not finite and >= 0")));
    }
    Ok((n, c, s))
}

/// cuDNN's smallest `eps` for batch norm, `CUDNN_BN_MIN_EPSILON` (0.0 in the headers of cuDNN
/// 8 and 9, which vram loads; 1e-5 in old ones). PyTorch's `batchnormMinEpsilonCuDNN` returns it, and a
/// batch norm with a smaller `eps` runs PyTorch's native kernels. vram refuses a negative
/// `eps` anyway, so the floor refuses nothing today; it is kept to follow PyTorch's rule.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the rule is only consulted with CUDA
pub(crate) const CUDNN_BN_MIN_EPSILON: f64 = 0.0;

/// The most images PyTorch gives cuDNN's spatial batch norm in training.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const CUDNN_MAX_BATCH_TRAINING: usize = 880_801;

/// The most images PyTorch gives cuDNN's spatial batch norm in evaluation.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const CUDNN_MAX_BATCH_EVAL: usize = 65_535;

/// Which batch norm call a [`BnCase`] is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum BnPass {
    /// [`batch_norm`], with this `eps`.
    Training(f32),
    /// [`batch_norm_eval`], with this `eps`.
    Eval(f32),
    /// [`batch_norm_backward`] (of a training forward; it is not told the forward's `eps`,
    /// which the forward already checked).
    Backward,
}

/// A batch norm as PyTorch's choice of backend sees it: `x`'s shape and dtype, the
/// parameters' dtype, and the call.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[derive(Clone, Copy, Debug)]
pub(crate) struct BnCase<'a> {
    pub(crate) shape: &'a [usize],
    pub(crate) dtype: DType,
    pub(crate) params: DType,
    pub(crate) pass: BnPass,
    /// `x` is `[n, c, ..]` (NCHW) or channels_last `[n, h, w, c]` (NHWC): the rule is the
    /// same (it reads the batch, the rank and the element count), cuDNN's descriptors and
    /// mode differ (`cuda::dnn::bn`).
    pub(crate) layout: ConvLayout,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl BnCase<'_> {
    /// Why PyTorch would not run this batch norm through cuDNN on a GPU where cuDNN is
    /// enabled, or `None` when it would: PyTorch's `_select_batch_norm_backend`
    /// (`aten/src/ATen/native/Normalization.cpp`), whose conditions are, in its order:
    ///
    /// - neither the input nor the weight is bf16;
    /// - an f16 input has f32 parameters (cuDNN's scale, shift and statistics are f32 for a
    ///   16-bit input: f16 parameters run the native kernels);
    /// - weight and bias given, running statistics both given or (in training) both absent:
    ///   always so in vram;
    /// - at least 3 dimensions (`[n, c]`, `BatchNorm1d` on vectors, runs the native kernels);
    /// - at most 880801 images in training, 65535 in evaluation;
    /// - `eps >= CUDNN_BN_MIN_EPSILON`;
    /// - fewer than `i32::MAX` elements ("some cuDNN kernels have 32-bit indexing
    ///   limitations").
    ///
    /// PyTorch's backward (`_batch_norm_impl_index_backward`) runs cuDNN exactly when the
    /// forward did; vram's backward is not told which path the forward took, so it applies
    /// the same rule to the same input (every condition the backward cannot see, `eps`, is
    /// one vram's forward always meets). Two more refusals are vram's own: an empty input
    /// (PyTorch returns before choosing a backend) and more than 5 dimensions
    /// (`cudnn_batch_norm` in `aten/src/ATen/native/cudnn/BatchNorm.cpp` takes 2 to 5).
    pub(crate) fn cudnn_refusal(&self) -> Option<&'static str> {
        let (dtype, params) = (self.dtype, self.params);
        let numel = self.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let training = !matches!(self.pass, BnPass::Eval(_));
        let eps = match self.pass {
            BnPass::Training(eps) | BnPass::Eval(eps) => Some(f64::from(eps)),
            BnPass::Backward => None,
        };
        if dtype == DType::BF16 || params == DType::BF16 {
            Some("bf16 (PyTorch runs its native kernels)")
        } else if dtype == DType::F16 && params != DType::F32 {
            Some("f16 parameters (cuDNN takes f32 parameters for an f16 input)")
        } else if self.shape.len() < 3 {
            Some("fewer than 3 dimensions (PyTorch's cuDNN path is the spatial one)")
        } else if self.shape.len() > 5 {
            Some("more than 5 dimensions")
        } else if training && self.shape[0] > CUDNN_MAX_BATCH_TRAINING {
            Some("more than 880801 images in training")
        } else if !training && self.shape[0] > CUDNN_MAX_BATCH_EVAL {
            Some("more than 65535 images in evaluation")
        } else if eps.is_some_and(|e| e.is_nan() || e < CUDNN_BN_MIN_EPSILON) {
            Some("eps below CUDNN_BN_MIN_EPSILON")
        } else if numel == Some(0) {
            Some("an empty input")
        } else if numel.is_none_or(|n| n >= i32::MAX as usize) {
            Some("i32::MAX elements or more")
        } else {
            None
        }
    }
}

/// `y = (x - mean) * invstd * gamma + beta` on the host over `x: [n, c, s]`, or over a
/// channels_last `x` when `nhwc`.
fn host_apply(
    x: &Tensor,
    (nhwc, s): (bool, usize),
    (mean, inv): (&[f32], &[f32]),
    (g, b): (&[f32], &[f32]),
    y: &mut Tensor,
    op: &'static str,
) -> Result<()> {
    if nhwc {
        with_dtype!(x.dtype(), T => cpu::batch_norm_apply_nhwc(
            x.as_slice::<T>()?, mean, inv, g, b, y.out_slice::<T>(op)?,
        ))
    } else {
        with_dtype!(x.dtype(), T => cpu::batch_norm_apply(
            x.as_slice::<T>()?, s, mean, inv, g, b, y.out_slice::<T>(op)?,
        ))
    }
}

/// Writes f32 `values` into the `[c]` tensor `t` in its dtype.
fn host_store(t: &mut Tensor, values: &[f32]) -> Result<()> {
    with_dtype!(t.dtype(), T => crate::cpu::elementwise::cast(values, t.as_mut_slice::<T>()?))
}

/// Blocks the GPU aims for in a per-channel reduction (an H100 holds about 1000 of 256
/// threads at once).
const PART_BLOCKS: usize = 1024;

/// Fewest values a block of a per-channel reduction is given.
const PART_VALUES: usize = 4096;

/// Parts (of whole images) each channel's statistics and backward sums are spread over on
/// the GPU, for `x: [n, c, s]`: enough for about [`PART_BLOCKS`] blocks, at most one per
/// image, each over at least [`PART_VALUES`] values. A function of the shape alone, so
/// the workspace it sizes is the same on every backend.
pub(crate) fn parts(n: usize, c: usize, s: usize) -> usize {
    let by_values = n.saturating_mul(s) / PART_VALUES;
    (PART_BLOCKS / c.max(1)).min(n).min(by_values).clamp(1, u16::MAX as usize)
}

/// Channels a block of the channels_last kernels covers: one per thread of a warp.
pub(crate) const NHWC_LANES: usize = 32;

/// Parts (of whole rows) each channel's statistics and backward sums are spread over on the
/// GPU for a channels_last `x: [rows, c]` (`rows = n * h * w`), whose blocks each cover
/// [`NHWC_LANES`] channels: enough for about [`PART_BLOCKS`] blocks, each over at least
/// [`PART_VALUES`] values. A function of the shape alone, as [`parts`].
pub(crate) fn nhwc_parts(rows: usize, c: usize) -> usize {
    let lanes = c.clamp(1, NHWC_LANES);
    let by_values = rows.saturating_mul(lanes) / PART_VALUES;
    (PART_BLOCKS / c.div_ceil(NHWC_LANES).max(1))
        .min(rows)
        .min(by_values)
        .clamp(1, u16::MAX as usize)
}

/// The parts of `x` (`(n, c, s)`) in its layout: [`nhwc_parts`] or [`parts`].
fn layout_parts(nhwc: bool, (n, c, s): (usize, usize, usize)) -> usize {
    if nhwc { nhwc_parts(n * s, c) } else { parts(n, c, s) }
}

/// The layout of an op's `x`.
fn layout(nhwc: bool) -> ConvLayout {
    if nhwc { ConvLayout::Nhwc } else { ConvLayout::Nchw }
}

/// `1 / sqrt(var + eps)`, 0 where both are 0 (as PyTorch's `InvStd`).
fn invstd(var: f32, eps: f32) -> f32 {
    if var == 0.0 && eps == 0.0 { 0.0 } else { 1.0 / (var + eps).sqrt() }
}

/// Batch norm in training: `y = (x - mean) * invstd * gamma + beta` per channel with the
/// batch's statistics over `x: [n, c, ..]`; `gamma` and `beta` are `[c]`. Updates
/// `running` when given. Through cuDNN on a CUDA device where PyTorch would (see the
/// module's docs; not yet run on a GPU).
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a rank below 2, zero channels, a channel with fewer than
/// two values (PyTorch's "expected more than 1 value per channel when training"), a negative
/// or non-finite `eps`, a momentum outside `[0, 1]`; shape, dtype (parameters neither `x`'s
/// dtype nor f32, or not all alike) and device mismatches; out of memory. Nothing is updated
/// on error.
pub fn batch_norm(
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    running: Option<RunningStats<'_>>,
    eps: f32,
) -> Result<BatchNormOutput> {
    run(BatchNorm::<false> {
        x,
        gamma,
        beta,
        running,
        eps,
        dims: (0, 0, 0),
        part: None,
        cudnn: false,
    })
}

/// A training batch norm over `x: [n, c, ..]`, or over a channels_last `x: [n, h, w, c]`
/// when `NHWC`.
struct BatchNorm<'a, 'r, const NHWC: bool> {
    x: &'a Tensor,
    gamma: &'a Tensor,
    beta: &'a Tensor,
    running: Option<RunningStats<'r>>,
    eps: f32,
    dims: (usize, usize, usize),
    /// The per-part (mean, m2) pairs on the GPU, `2 * c * parts` floats.
    part: Option<usize>,
    /// Runs through cuDNN ([`Device::cudnn_batch_norm`]): no workspace planned.
    cudnn: bool,
}

impl<const NHWC: bool> Op for BatchNorm<'_, '_, NHWC> {
    const NAME: &'static str = if NHWC { "batch_norm_nhwc" } else { "batch_norm" };
    /// `y`, `mean` and `invstd`.
    type Outs = [Tensor; 3];
    type Output = BatchNormOutput;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        let mut per_channel = vec![self.gamma, self.beta];
        if let Some(r) = &self.running {
            if !(0.0..=1.0).contains(&r.momentum) {
                return Err(invalid(
                    Self::NAME,
                    format!("momentum {} is not in [0, 1]", r.momentum),
                ));
            }
            per_channel.extend([&*r.mean, &*r.var]);
        }
        let (n, c, s) = dims(Self::NAME, self.x, &per_channel, self.eps, NHWC)?;
        if n * s < 2 {
            return Err(invalid(
                Self::NAME,
                format!(
                    "expected more than 1 value per channel when training, got input of shape {:?}",
                    self.x.shape()
                ),
            ));
        }
        self.dims = (n, c, s);
        if let Some(r) = &mut self.running {
            r.mean.make_unique()?;
            r.var.make_unique()?;
        }
        let mut plan = Plan::new([
            OutputSpec::new(self.x.shape(), self.x.dtype()),
            OutputSpec::new(&[c], DType::F32),
            OutputSpec::new(&[c], DType::F32),
        ]);
        let case = BnCase {
            shape: self.x.shape(),
            dtype: self.x.dtype(),
            params: self.gamma.dtype(),
            pass: BnPass::Training(self.eps),
            layout: layout(NHWC),
        };
        self.cudnn = self.x.device().cudnn_batch_norm(&case);
        // cuDNN's workspace and reserve space are asked for, and allocated, when it runs.
        if !self.cudnn {
            self.part = plan.workspace(2 * c * layout_parts(NHWC, (n, c, s)) * 4);
        }
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let (n, c, s) = self.dims;
        let [y, mean, inv] = bufs.outputs_mut();
        let (mean, inv) = (mean.out_slice::<f32>(Self::NAME)?, inv.out_slice::<f32>(Self::NAME)?);
        let mut var = vec![0.0f32; c];
        if NHWC {
            with_dtype!(self.x.dtype(), T => cpu::batch_norm_stats_nhwc(self.x.as_slice::<T>()?, mean, &mut var))?;
        } else {
            with_dtype!(self.x.dtype(), T => cpu::batch_norm_stats(self.x.as_slice::<T>()?, s, mean, &mut var))?;
        }
        for (r, &v) in inv.iter_mut().zip(&var) {
            *r = invstd(v, self.eps);
        }
        let (g, b) = (self.gamma.to_f32_vec()?, self.beta.to_f32_vec()?);
        host_apply(self.x, (NHWC, s), (mean, inv), (&g, &b), y, Self::NAME)?;
        if let Some(r) = &mut self.running {
            let (m, unbias) = (r.momentum, (n * s) as f32 / (n * s - 1) as f32);
            let rm: Vec<f32> = r
                .mean
                .to_f32_vec()?
                .iter()
                .zip(mean.iter())
                .map(|(&old, &mu)| m * mu + (1.0 - m) * old)
                .collect();
            let rv: Vec<f32> = r
                .var
                .to_f32_vec()?
                .iter()
                .zip(&var)
                .map(|(&old, &v)| m * (v * unbias) + (1.0 - m) * old)
                .collect();
            host_store(r.mean, &rm)?;
            host_store(r.var, &rv)?;
        }
        Ok(())
    }

    fn on_virtual(&mut self) -> Result<()> {
        if !self.cudnn {
            return Ok(());
        }
        let call = crate::cudnn_choices::BnPass::Training;
        self.x.device().replay_cudnn_batch_norm(call, self.x, layout(NHWC))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::helpers::{check_rows, ptr};
        use crate::cuda::registry::{BN_FINALIZE, BN_NHWC_PARTIAL, BN_PARTIAL};
        use crate::cuda::{Arg, launch};
        if self.cudnn {
            let [y, mean, inv] = bufs.outputs_mut();
            let a = crate::cuda::dnn::BnTraining {
                x: self.x.cuda_ptr()?,
                y: y.cuda_ptr()?,
                gamma: self.gamma.cuda_ptr()?,
                beta: self.beta.cuda_ptr()?,
                running: match &self.running {
                    Some(r) => Some((r.mean.cuda_ptr()?, r.var.cuda_ptr()?)),
                    None => None,
                },
                momentum: self.running.as_ref().map_or(0.0, |r| r.momentum),
                eps: self.eps,
                save_mean: mean.cuda_ptr()?,
                save_invstd: inv.cuda_ptr()?,
            };
            let cu = gpu.backend();
            let dnn = cu.dnn_lock()?;
            let (shape, layout) = (self.x.shape(), layout(NHWC));
            // SAFETY: x, gamma, beta and the running statistics are the op's tensors of the
            // shapes, dtypes and layout the plan checked (contiguous; f32 parameters:
            // PyTorch's rule); y and the
            // saved statistics are fresh outputs; the running statistics were made unique.
            return unsafe { dnn.bn_forward_training(shape, self.x.dtype(), layout, &a, cu) };
        }
        let parts = layout_parts(NHWC, self.dims);
        // The channels_last kernels merge as the NCHW ones over [rows, c, 1].
        let (n, c, s) = if NHWC { (self.dims.0 * self.dims.2, self.dims.1, 1) } else { self.dims };
        let t = self.x.dtype();
        let pf32 = Arg::U32((self.gamma.dtype() == DType::F32) as u32);
        let part = bufs.ws(self.part)?;
        let [y, mean, inv] = bufs.outputs_mut();
        let (rm, rv, momentum) = match &self.running {
            Some(r) => (ptr(r.mean)?, ptr(r.var)?, r.momentum),
            None => (Arg::Ptr(0), Arg::Ptr(0), 0.0),
        };
        if NHWC {
            let blocks = c.div_ceil(NHWC_LANES);
            check_rows(Self::NAME, blocks)?;
            // SAFETY: bn_nhwc_partial_T(const T* x, float* part, u64 rows, u64 c, u32 parts),
            // grid (ceil(c / 32), parts) of whole warps; x holds rows * c elements, the
            // workspace 2 * c * parts floats.
            unsafe {
                gpu.launch(
                    BN_NHWC_PARTIAL.of(t),
                    launch::per_row_parts(blocks, parts),
                    &[
                        ptr(self.x)?,
                        Arg::Ptr(part),
                        Arg::count(n),
                        Arg::count(c),
                        Arg::U32(parts as u32),
                    ],
                )?;
            }
        } else {
            check_rows(Self::NAME, c)?;
            // SAFETY: bn_partial_T(const T* x, float* part, u64 n, u64 c, u64 s, u32 parts),
            // grid (c, parts); x holds n * c * s elements, the workspace 2 * c * parts floats.
            unsafe {
                gpu.launch(
                    BN_PARTIAL.of(t),
                    launch::per_row_parts(c, parts),
                    &[
                        ptr(self.x)?,
                        Arg::Ptr(part),
                        Arg::count(n),
                        Arg::count(c),
                        Arg::count(s),
                        Arg::U32(parts as u32),
                    ],
                )?;
            }
        }
        // SAFETY: bn_finalize_T(const float* part, float* mean, float* invstd, void* rmean,
        // void* rvar, u32 pf32, u32 update, float momentum, float eps, u64 n, u64 c, u64 s,
        // u32 parts), grid-stride over c; part as just written, mean and invstd c floats, the
        // running statistics (read and written only when update is 1) c parameters.
        unsafe {
            gpu.launch(
                BN_FINALIZE.of(t),
                launch::elementwise(c),
                &[
                    Arg::Ptr(part),
                    ptr(mean)?,
                    ptr(inv)?,
                    rm,
                    rv,
                    pf32,
                    Arg::U32(self.running.is_some() as u32),
                    Arg::F32(momentum),
                    Arg::F32(self.eps),
                    Arg::count(n),
                    Arg::count(c),
                    Arg::count(s),
                    Arg::U32(parts as u32),
                ],
            )?;
        }
        let (mean, inv) = (ptr(mean)?, ptr(inv)?);
        apply(gpu, self.x, (mean, inv), (self.gamma, self.beta), y, (c, s))
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<BatchNormOutput> {
        let [y, mean, invstd] = bufs.into_outputs();
        Ok(BatchNormOutput { y, mean, invstd })
    }
}

/// `y = (x - mean) * invstd * gamma + beta` on the GPU, from the f32 statistics at
/// `stats` and the `[c]` scale and shift, over `x: [n, c, s]` (`dims` = `(c, s)`).
#[cfg(feature = "cuda")]
fn apply(
    gpu: &crate::cuda::Gpu<'_>,
    x: &Tensor,
    stats: (crate::cuda::Arg, crate::cuda::Arg),
    (gamma, beta): (&Tensor, &Tensor),
    y: &mut Tensor,
    (c, s): (usize, usize),
) -> Result<()> {
    use crate::cuda::helpers::ptr;
    use crate::cuda::registry::BN_APPLY;
    use crate::cuda::{Arg, launch};
    let total = x.numel();
    // SAFETY: bn_apply_T(const T* x, const float* mean, const float* invstd, const void* g,
    // const void* b, u32 pf32, T* y, u64 total, Div c, Div s), grid-stride over total
    // elements; x and y hold total elements, the statistics c floats each, gamma and beta c
    // parameters (f32 when pf32 is 1).
    unsafe {
        gpu.launch(
            BN_APPLY.of(x.dtype()),
            launch::elementwise(total),
            &[
                ptr(x)?,
                stats.0,
                stats.1,
                ptr(gamma)?,
                ptr(beta)?,
                Arg::U32((gamma.dtype() == DType::F32) as u32),
                ptr(y)?,
                Arg::count(total),
                Arg::div(c),
                Arg::div(s),
            ],
        )
    }
}

/// Batch norm in evaluation: `y = (x - running_mean) * invstd * gamma + beta` per channel,
/// `invstd = 1 / sqrt(running_var + eps)`, over `x: [n, c, ..]` (any batch, one image too).
/// Through cuDNN on a CUDA device where PyTorch would (see the module's docs; not yet run
/// on a GPU).
///
/// # Errors
///
/// As [`batch_norm`], less the two-values rule and the momentum.
pub fn batch_norm_eval(
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    running_mean: &Tensor,
    running_var: &Tensor,
    eps: f32,
) -> Result<Tensor> {
    run(BatchNormEval::<false> {
        x,
        gamma,
        beta,
        running_mean,
        running_var,
        eps,
        s: 0,
        ws: None,
        cudnn: false,
    })
}

/// An evaluation batch norm over `x: [n, c, ..]`, or a channels_last `x: [n, h, w, c]` when
/// `NHWC`.
struct BatchNormEval<'a, const NHWC: bool> {
    x: &'a Tensor,
    gamma: &'a Tensor,
    beta: &'a Tensor,
    running_mean: &'a Tensor,
    running_var: &'a Tensor,
    eps: f32,
    s: usize,
    /// The f32 mean and invstd on the GPU, `2 * c` floats.
    ws: Option<usize>,
    /// Runs through cuDNN ([`Device::cudnn_batch_norm`]): no workspace planned.
    cudnn: bool,
}

impl<const NHWC: bool> Op for BatchNormEval<'_, NHWC> {
    const NAME: &'static str = if NHWC { "batch_norm_eval_nhwc" } else { "batch_norm_eval" };
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        let per_channel = [self.gamma, self.beta, self.running_mean, self.running_var];
        let (_, c, s) = dims(Self::NAME, self.x, &per_channel, self.eps, NHWC)?;
        // Channels_last: [rows, c, 1] for the elementwise kernel.
        self.s = if NHWC { 1 } else { s };
        let mut plan = Plan::one(self.x.shape(), self.x.dtype());
        let case = BnCase {
            shape: self.x.shape(),
            dtype: self.x.dtype(),
            params: self.gamma.dtype(),
            pass: BnPass::Eval(self.eps),
            layout: layout(NHWC),
        };
        self.cudnn = self.x.device().cudnn_batch_norm(&case);
        if !self.cudnn {
            self.ws = plan.workspace(2 * c * 4);
        }
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let mean = self.running_mean.to_f32_vec()?;
        let inv: Vec<f32> =
            self.running_var.to_f32_vec()?.iter().map(|&v| invstd(v, self.eps)).collect();
        let (g, b) = (self.gamma.to_f32_vec()?, self.beta.to_f32_vec()?);
        host_apply(self.x, (NHWC, self.s), (&mean, &inv), (&g, &b), bufs.out(), Self::NAME)
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::helpers::ptr;
        use crate::cuda::registry::BN_EVAL_STATS;
        use crate::cuda::{Arg, launch};
        if self.cudnn {
            let a = crate::cuda::dnn::BnEval {
                x: self.x.cuda_ptr()?,
                y: bufs.out().cuda_ptr()?,
                gamma: self.gamma.cuda_ptr()?,
                beta: self.beta.cuda_ptr()?,
                running_mean: self.running_mean.cuda_ptr()?,
                running_var: self.running_var.cuda_ptr()?,
                eps: self.eps,
            };
            let dnn = gpu.backend().dnn_lock()?;
            let (shape, layout) = (self.x.shape(), layout(NHWC));
            // SAFETY: the op's tensors of the shapes and dtypes the plan checked (f32
            // parameters: PyTorch's rule); y is a fresh output.
            return unsafe { dnn.bn_forward_inference(shape, self.x.dtype(), layout, &a) };
        }
        let c = self.gamma.numel();
        let t = self.x.dtype();
        let pf32 = Arg::U32((self.gamma.dtype() == DType::F32) as u32);
        let mean = bufs.ws(self.ws)?;
        let inv = mean + 4 * c as u64;
        // SAFETY: bn_eval_stats_T(const void* rmean, const void* rvar, u32 pf32, float eps,
        // float* mean, float* invstd, u64 c), grid-stride over c; the workspace holds 2c
        // floats.
        unsafe {
            gpu.launch(
                BN_EVAL_STATS.of(t),
                launch::elementwise(c),
                &[
                    ptr(self.running_mean)?,
                    ptr(self.running_var)?,
                    pf32,
                    Arg::F32(self.eps),
                    Arg::Ptr(mean),
                    Arg::Ptr(inv),
                    Arg::count(c),
                ],
            )?;
        }
        let y = bufs.out();
        apply(gpu, self.x, (Arg::Ptr(mean), Arg::Ptr(inv)), (self.gamma, self.beta), y, (c, self.s))
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

/// Gradients of a training [`batch_norm`] from its input `x`, `gamma`, the saved `mean` and
/// `invstd`, the upstream `dy`, and the forward's `eps` (PyTorch's
/// `native_batch_norm_backward` takes it too). Through cuDNN on a CUDA device where PyTorch
/// would (see the module's docs; not yet run on a GPU), whichever path saved `mean` and
/// `invstd`; cuDNN's backward must be given the forward's `eps` ("same epsilon as forward
/// pass", `cudnn_ops.h`), the own kernels and the host read it from `invstd`.
///
/// # Errors
///
/// Shape, dtype and device mismatches; an `eps` that is negative or not finite; out of
/// memory.
pub fn batch_norm_backward(
    x: &Tensor,
    gamma: &Tensor,
    mean: &Tensor,
    invstd: &Tensor,
    dy: &Tensor,
    eps: f32,
) -> Result<BatchNormGrads> {
    run(BatchNormBackward::<false>::new(x, gamma, (mean, invstd), dy, eps))
}

/// [`batch_norm`] on a channels_last image batch `x: [n, h, w, c]` (PyTorch's
/// `BatchNorm2d` on a `torch.channels_last` input): the same statistics, `y` channels_last.
/// Reads `x` in place, channel the fastest index (no permute): on the host bit-identical to
/// [`batch_norm`] on the NCHW permutation; on a GPU through its own coalesced kernels, or
/// cuDNN with NHWC descriptors where PyTorch would (see the module's docs; neither has yet
/// run on a GPU).
///
/// # Errors
///
/// As [`batch_norm`]; a rank other than 4.
pub fn batch_norm_nhwc(
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    running: Option<RunningStats<'_>>,
    eps: f32,
) -> Result<BatchNormOutput> {
    run(BatchNorm::<true> {
        x,
        gamma,
        beta,
        running,
        eps,
        dims: (0, 0, 0),
        part: None,
        cudnn: false,
    })
}

/// [`batch_norm_eval`] on a channels_last `x: [n, h, w, c]`; `y` channels_last, no permute
/// (bit-identical to [`batch_norm_eval`] on the NCHW permutation on the host).
///
/// # Errors
///
/// As [`batch_norm_eval`]; a rank other than 4.
pub fn batch_norm_eval_nhwc(
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    running_mean: &Tensor,
    running_var: &Tensor,
    eps: f32,
) -> Result<Tensor> {
    run(BatchNormEval::<true> {
        x,
        gamma,
        beta,
        running_mean,
        running_var,
        eps,
        s: 0,
        ws: None,
        cudnn: false,
    })
}

/// [`batch_norm_backward`] of a [`batch_norm_nhwc`]: `x` and `dy` are `[n, h, w, c]`, `dx`
/// comes back channels_last, no permute (bit-identical to [`batch_norm_backward`] on the
/// NCHW permutations on the host).
///
/// # Errors
///
/// As [`batch_norm_backward`]; a rank other than 4.
pub fn batch_norm_backward_nhwc(
    x: &Tensor,
    gamma: &Tensor,
    mean: &Tensor,
    invstd: &Tensor,
    dy: &Tensor,
    eps: f32,
) -> Result<BatchNormGrads> {
    run(BatchNormBackward::<true>::new(x, gamma, (mean, invstd), dy, eps))
}

/// The backward of a training batch norm over `x: [n, c, ..]`, or a channels_last
/// `x: [n, h, w, c]` when `NHWC`.
struct BatchNormBackward<'a, const NHWC: bool> {
    x: &'a Tensor,
    gamma: &'a Tensor,
    mean: &'a Tensor,
    invstd: &'a Tensor,
    dy: &'a Tensor,
    /// The forward's `eps`, for cuDNN.
    eps: f32,
    s: usize,
    /// The f32 per-channel sums of `dy * xhat` and `dy` on the GPU, `2 * c` floats, then
    /// their per-part terms, `2 * c * parts(n, c, s)`.
    sums: Option<usize>,
    /// Runs through cuDNN ([`Device::cudnn_batch_norm`]): no workspace planned.
    cudnn: bool,
}

impl<'a, const NHWC: bool> BatchNormBackward<'a, NHWC> {
    /// The backward of `x`, with the forward's saved `(mean, invstd)` and `eps`, before the
    /// plan.
    fn new(
        x: &'a Tensor,
        gamma: &'a Tensor,
        (mean, invstd): (&'a Tensor, &'a Tensor),
        dy: &'a Tensor,
        eps: f32,
    ) -> Self {
        BatchNormBackward { x, gamma, mean, invstd, dy, eps, s: 0, sums: None, cudnn: false }
    }
}

impl<const NHWC: bool> Op for BatchNormBackward<'_, NHWC> {
    const NAME: &'static str =
        if NHWC { "batch_norm_backward_nhwc" } else { "batch_norm_backward" };
    /// `dx`, `dgamma` and `dbeta`.
    type Outs = [Tensor; 3];
    type Output = BatchNormGrads;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        let (n, c, s) = dims(Self::NAME, self.x, &[self.gamma], self.eps, NHWC)?;
        same_layout(Self::NAME, self.x, self.dy)?;
        for saved in [self.mean, self.invstd] {
            same_device(Self::NAME, self.x, saved)?;
            expect_dtype(Self::NAME, DType::F32, saved)?;
            expect_shape(Self::NAME, &[c], saved)?;
        }
        self.s = s;
        let mut plan = Plan::new([
            OutputSpec::new(self.x.shape(), self.x.dtype()),
            OutputSpec::new(&[c], self.gamma.dtype()),
            OutputSpec::new(&[c], self.gamma.dtype()),
        ]);
        let case = BnCase {
            shape: self.x.shape(),
            dtype: self.x.dtype(),
            params: self.gamma.dtype(),
            pass: BnPass::Backward,
            layout: layout(NHWC),
        };
        self.cudnn = self.x.device().cudnn_batch_norm(&case);
        if !self.cudnn {
            self.sums = plan.workspace(2 * c * (1 + layout_parts(NHWC, (n, c, s))) * 4);
        }
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let c = self.gamma.numel();
        let (mut dg, mut db) = (vec![0.0f32; c], vec![0.0f32; c]);
        let g = self.gamma.to_f32_vec()?;
        let [dx, dgamma, dbeta] = bufs.outputs_mut();
        let (mean, inv) = (self.mean.as_slice::<f32>()?, self.invstd.as_slice::<f32>()?);
        if NHWC {
            with_dtype!(self.x.dtype(), T => cpu::batch_norm_backward_nhwc(
                self.x.as_slice::<T>()?,
                self.dy.as_slice::<T>()?,
                mean,
                inv,
                &g,
                dx.out_slice::<T>(Self::NAME)?,
                &mut dg,
                &mut db,
            ))?;
        } else {
            with_dtype!(self.x.dtype(), T => cpu::batch_norm_backward(
                self.x.as_slice::<T>()?,
                self.dy.as_slice::<T>()?,
                self.s,
                mean,
                inv,
                &g,
                dx.out_slice::<T>(Self::NAME)?,
                &mut dg,
                &mut db,
            ))?;
        }
        host_store(dgamma, &dg)?;
        host_store(dbeta, &db)
    }

    fn on_virtual(&mut self) -> Result<()> {
        if !self.cudnn {
            return Ok(());
        }
        let call = crate::cudnn_choices::BnPass::Backward;
        self.x.device().replay_cudnn_batch_norm(call, self.x, layout(NHWC))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::helpers::{check_rows, from_f32, ptr};
        use crate::cuda::registry::{
            BN_BWD_DX, BN_BWD_FINALIZE, BN_BWD_PARTIAL, BN_NHWC_BWD_PARTIAL,
        };
        use crate::cuda::{Arg, launch};
        if self.cudnn {
            let [dx, dgamma, dbeta] = bufs.outputs_mut();
            let a = crate::cuda::dnn::BnBackward {
                x: self.x.cuda_ptr()?,
                dy: self.dy.cuda_ptr()?,
                gamma: self.gamma.cuda_ptr()?,
                save_mean: self.mean.cuda_ptr()?,
                save_invstd: self.invstd.cuda_ptr()?,
                dx: dx.cuda_ptr()?,
                dgamma: dgamma.cuda_ptr()?,
                dbeta: dbeta.cuda_ptr()?,
            };
            let cu = gpu.backend();
            let dnn = cu.dnn_lock()?;
            let (shape, layout) = (self.x.shape(), layout(NHWC));
            // SAFETY: the op's tensors of the shapes and dtypes the plan checked (f32
            // parameters: PyTorch's rule; the saved statistics f32 [c]); the gradients are
            // fresh outputs.
            return unsafe { dnn.bn_backward(shape, self.x.dtype(), layout, &a, self.eps, cu) };
        }
        let c = self.gamma.numel();
        let n = self.x.numel() / (c * self.s).max(1);
        let (t, parts) = (self.x.dtype(), layout_parts(NHWC, (n, c, self.s)));
        // The channels_last kernels see [rows, c, 1].
        let s = if NHWC { 1 } else { self.s };
        let sums = bufs.ws(self.sums)?;
        let part = sums + (2 * c * 4) as u64;
        if NHWC {
            let (rows, blocks) = (n * self.s, c.div_ceil(NHWC_LANES));
            check_rows(Self::NAME, blocks)?;
            // SAFETY: bn_nhwc_bwd_partial_T(const T* x, const T* dy, const float* mean, const
            // float* invstd, float* part, u64 rows, u64 c, u32 parts), grid (ceil(c / 32),
            // parts) of whole warps; x and dy hold rows * c elements, mean and invstd c
            // floats, part (inside the workspace, after the 2c sums) 2 * c * parts.
            unsafe {
                gpu.launch(
                    BN_NHWC_BWD_PARTIAL.of(t),
                    launch::per_row_parts(blocks, parts),
                    &[
                        ptr(self.x)?,
                        ptr(self.dy)?,
                        ptr(self.mean)?,
                        ptr(self.invstd)?,
                        Arg::Ptr(part),
                        Arg::count(rows),
                        Arg::count(c),
                        Arg::U32(parts as u32),
                    ],
                )?;
            }
        } else {
            check_rows(Self::NAME, c)?;
            // SAFETY: bn_bwd_partial_T(const T* x, const T* dy, const float* mean, const
            // float* invstd, float* part, u64 n, u64 c, u64 s, u32 parts), grid (c, parts); x
            // and dy hold n * c * s elements, mean and invstd c floats, part (inside the
            // workspace, after the 2c sums) 2 * c * parts.
            unsafe {
                gpu.launch(
                    BN_BWD_PARTIAL.of(t),
                    launch::per_row_parts(c, parts),
                    &[
                        ptr(self.x)?,
                        ptr(self.dy)?,
                        ptr(self.mean)?,
                        ptr(self.invstd)?,
                        Arg::Ptr(part),
                        Arg::count(n),
                        Arg::count(c),
                        Arg::count(self.s),
                        Arg::U32(parts as u32),
                    ],
                )?;
            }
        }
        // SAFETY: bn_bwd_finalize(const float* part, float* sums, u64 c, u32 parts),
        // grid-stride over c; sums holds 2c floats (sum of dy * xhat, then sum of dy).
        unsafe {
            gpu.launch(
                BN_BWD_FINALIZE.of(DType::F32),
                launch::elementwise(c),
                &[Arg::Ptr(part), Arg::Ptr(sums), Arg::count(c), Arg::U32(parts as u32)],
            )?;
        }
        let total = self.x.numel();
        let [dx, dgamma, dbeta] = bufs.outputs_mut();
        // SAFETY: bn_bwd_dx_T(const T* x, const T* dy, const float* mean, const float* invstd,
        // const void* g, u32 pf32, const float* sums, T* dx, u64 total, Div c, Div s),
        // grid-stride over total elements.
        unsafe {
            gpu.launch(
                BN_BWD_DX.of(t),
                launch::elementwise(total),
                &[
                    ptr(self.x)?,
                    ptr(self.dy)?,
                    ptr(self.mean)?,
                    ptr(self.invstd)?,
                    ptr(self.gamma)?,
                    Arg::U32((self.gamma.dtype() == DType::F32) as u32),
                    Arg::Ptr(sums),
                    ptr(dx)?,
                    Arg::count(total),
                    Arg::div(c),
                    Arg::div(s),
                ],
            )?;
        }
        from_f32(gpu, sums, dgamma)?;
        from_f32(gpu, sums + 4 * c as u64, dbeta)
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<BatchNormGrads> {
        let [dx, dgamma, dbeta] = bufs.into_outputs();
        Ok(BatchNormGrads { dx, dgamma, dbeta })
    }
}

#[cfg(test)]
mod tests {
    use super::{BnCase, BnPass, CUDNN_BN_MIN_EPSILON, ConvLayout, nhwc_parts, parts};
    use crate::DType::{self, BF16, F16, F32};

    fn case(shape: &[usize], dtype: DType, params: DType, pass: BnPass) -> Option<&'static str> {
        BnCase { shape, dtype, params, pass, layout: ConvLayout::Nchw }.cudnn_refusal()
    }

    const PASSES: [BnPass; 3] = [BnPass::Training(1e-5), BnPass::Eval(1e-5), BnPass::Backward];

    #[test]
    fn cudnn_takes_f32_and_f16_with_f32_parameters_as_pytorch() {
        for pass in PASSES {
            let img = [8, 16, 7, 7];
            assert_eq!(case(&img, F32, F32, pass), None, "{pass:?}");
            assert_eq!(case(&img, F16, F32, pass), None, "autocast: f16 input, f32 module");
            assert!(case(&img, F16, F16, pass).unwrap().contains("f16 parameters"));
            for (x, p) in [(BF16, F32), (BF16, BF16)] {
                assert!(case(&img, x, p, pass).unwrap().contains("bf16"), "{x:?}/{p:?}");
            }
        }
    }

    #[test]
    fn cudnn_takes_3_to_5_dimensions() {
        for pass in PASSES {
            assert!(case(&[8, 16], F32, F32, pass).unwrap().contains("fewer than 3"));
            for shape in [&[8, 16, 10][..], &[8, 16, 5, 5], &[2, 4, 3, 5, 6]] {
                assert_eq!(case(shape, F32, F32, pass), None, "{shape:?}");
            }
            assert!(case(&[2, 4, 3, 5, 6, 2], F32, F32, pass).unwrap().contains("more than 5"));
        }
    }

    #[test]
    fn cudnn_batch_limits_differ_between_training_and_evaluation() {
        let at = |n: usize, pass| case(&[n, 2, 1, 1], F32, F32, pass);
        assert_eq!(at(880_801, BnPass::Training(1e-5)), None);
        assert!(at(880_802, BnPass::Training(1e-5)).unwrap().contains("880801"));
        assert_eq!(at(880_801, BnPass::Backward), None);
        assert!(at(880_802, BnPass::Backward).is_some());
        assert_eq!(at(65_535, BnPass::Eval(1e-5)), None);
        assert!(at(65_536, BnPass::Eval(1e-5)).unwrap().contains("65535"));
    }

    #[test]
    fn cudnn_needs_eps_at_its_floor_a_nonempty_input_and_32_bit_sizes() {
        assert_eq!(CUDNN_BN_MIN_EPSILON, 0.0, "cuDNN 7 and later");
        for pass in [BnPass::Training(0.0), BnPass::Eval(0.0)] {
            assert_eq!(case(&[2, 3, 4, 4], F32, F32, pass), None, "eps = the floor");
        }
        for pass in [BnPass::Training(-1e-3), BnPass::Eval(f32::NAN)] {
            assert!(case(&[2, 3, 4, 4], F32, F32, pass).unwrap().contains("eps"));
        }
        assert!(case(&[0, 3, 4, 4], F32, F32, BnPass::Eval(1e-5)).unwrap().contains("empty"));
        // 2^31 - 1 elements and more: refused (PyTorch: numel < INT32_MAX).
        let big = [1, 1, (1 << 31) - 1];
        assert!(case(&big, F32, F32, BnPass::Training(1e-5)).unwrap().contains("i32::MAX"));
        let fits = [1, 1, (1 << 31) - 2];
        assert_eq!(case(&fits, F32, F32, BnPass::Training(1e-5)), None);
        let overflow = [usize::MAX, 2, 2];
        assert!(case(&overflow, F32, F32, BnPass::Eval(1e-5)).is_some());
    }

    #[test]
    fn host_and_virtual_devices_keep_the_own_path() {
        for d in [crate::Device::host(1 << 20), crate::Device::virtual_device(1 << 20)] {
            for pass in PASSES {
                for layout in [ConvLayout::Nchw, ConvLayout::Nhwc] {
                    let c = BnCase { shape: &[8, 16, 7, 7], dtype: F32, params: F32, pass, layout };
                    assert!(!d.cudnn_batch_norm(&c), "{pass:?} {layout:?}");
                }
            }
            assert_eq!(d.batch_norm_path(), d.conv_path());
        }
    }

    #[test]
    fn a_channel_is_spread_over_parts_of_whole_images_of_at_least_4096_values() {
        // Small inputs, many channels: one part.
        assert_eq!(parts(4, 6, 99), 1);
        assert_eq!(parts(37, 5, 1), 1);
        assert_eq!(parts(64, 2048, 49), 1);
        // ResNet-50's first batch norm at batch 64 and at batch 2.
        assert_eq!(parts(64, 64, 112 * 112), 16);
        assert_eq!(parts(2, 64, 112 * 112), 2);
        // The GPU test's shapes: 4 even parts, then 2 parts of 3 and 4 images.
        assert_eq!(parts(16, 4, 32 * 32), 4);
        assert_eq!(parts(7, 2, 30 * 40), 2);
        // Never more parts than images, never zero.
        assert_eq!(parts(3, 1, 1 << 20), 3);
        assert_eq!(parts(0, 0, 0), 1);
    }

    #[test]
    fn a_channels_last_column_is_spread_over_parts_of_whole_rows() {
        // ResNet-50's first batch norm at batch 64: 2 blocks of 32 channels, 512 parts each.
        assert_eq!(nhwc_parts(64 * 112 * 112, 64), 512);
        // Its last (c = 2048 at 7x7): 64 blocks of channels, 16 parts each.
        assert_eq!(nhwc_parts(64 * 7 * 7, 2048), 16);
        // Few values per block: fewer parts, each over at least 4096 values.
        assert_eq!(nhwc_parts(315, 40), 2);
        assert_eq!(nhwc_parts(16 * 32 * 32, 4), 16);
        // Never more parts than rows, never zero.
        assert_eq!(nhwc_parts(6, 1), 1);
        assert_eq!(nhwc_parts(1 << 20, 1), 256);
        assert_eq!(nhwc_parts(0, 0), 1);
    }
}
