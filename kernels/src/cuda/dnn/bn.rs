//! Batch norm through cuDNN, as PyTorch's `cudnn_batch_norm` and `cudnn_batch_norm_backward`
//! (`aten/src/ATen/native/cudnn/BatchNorm.cpp`) call it: training through
//! `cudnnBatchNormalizationForwardTrainingEx`, evaluation through
//! `cudnnBatchNormalizationForwardInference`, the backward through
//! `cudnnBatchNormalizationBackwardEx`, all in `CUDNN_BATCHNORM_SPATIAL` mode with
//! `CUDNN_BATCHNORM_OPS_BN` (no fused activation).
//!
//! - **Mode.** PyTorch's `getCudnnBatchNormMode` takes `SPATIAL_PERSISTENT` for a
//!   channels_last input in training, its forward and its backward, and `SPATIAL` for every
//!   other (and `PER_ACTIVATION` for a 2-d one, which `_select_batch_norm_backend` never
//!   sends to cuDNN): so does [`mode`], for vram's `[n, c, ..]` inputs and its channels_last
//!   `[n, h, w, c]` ones (`batch_norm_nhwc` and its evaluation and backward).
//! - **Descriptors.** An NCHW `x` (and `y`, `dy`, `dx`) is described as the 4-d NCHW tensor
//!   `[n, c, s, 1]`, `s` the product of the spatial sizes: the same elements and the same
//!   per-channel sets as PyTorch's 3- to 5-d descriptor (a `[n, c, l]` input is padded to
//!   `[n, c, l, 1]` there too). A channels_last `[n, h, w, c]` one as `[n, c, h, w]` with
//!   NHWC strides (`[h * w * c, 1, w * c, c]`), as PyTorch's `TensorDescriptor` describes a
//!   `channels_last` tensor. The scale, shift, running and saved statistics share one
//!   `[1, c, 1, 1]` descriptor in the parameters' dtype, f32 (cuDNN's rule for a 16-bit
//!   input, which PyTorch's choice of backend enforces: f16 parameters never get here).
//! - **Scalars.** alpha = 1 and beta = 0 as f32 (cuDNN's scaling type for f32 and f16
//!   data); `exponentialAverageFactor` = momentum and `epsilon` = eps, as f64.
//! - **What it saves.** `resultSaveMean` and `resultSaveInvVariance` are the batch mean and
//!   `1 / sqrt(var + eps)` of the biased variance, f32 `[c]`: vram's saved `mean` and
//!   `invstd`, which the own backward reads too. The running variance moves towards the
//!   unbiased variance, as the own kernels' (PyTorch compares its cuDNN and native paths on
//!   that).
//! - **Workspace and reserve space.** Asked of cuDNN per call
//!   (`cudnnGetBatchNormalization...WorkspaceSize`,
//!   `cudnnGetBatchNormalizationTrainingExReserveSpaceSize`) and taken from the device's
//!   caching allocator (counted in its statistics), given back after the call is queued.
//!   PyTorch keeps the forward's reserve space for the backward; vram's forward returns only
//!   `y`, `mean` and `invstd`, so its reserve (none in `SPATIAL` mode as far as cuDNN's
//!   documentation says; checked per shape) goes back at once, and a backward whose shape
//!   would have one runs the own kernels instead ([`Dnn::bn_reserve_size`]).
//! - **The backward's eps.** The forward's, as cuDNN requires ("same epsilon as forward
//!   pass") and PyTorch's `cudnn_batch_norm_backward` passes; `tests/cudnn_vs_host.rs` runs
//!   1e-5 and 1e-3 on a GPU.
//!
//! This code has been compiled and its pure parts tested on machines without a GPU; its
//! cuDNN calls have not yet run on one (`tests/cudnn_vs_host.rs` runs them where one is),
//! the channels_last ones (NHWC descriptors, `SPATIAL_PERSISTENT`) neither.

use super::{
    Dnn, MAX_WORKSPACE, TensorDims, WorkspaceSource, alpha, beta, check, tensor_descriptor,
};
use crate::cudnn_choices::BnPass;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::params::ConvLayout;
use cudarc::cudnn::sys;
use std::ffi::c_void;
use std::ptr::null_mut;

/// The mode of an NCHW input, and of a channels_last one in evaluation (see the module's
/// docs).
pub(crate) const MODE: sys::cudnnBatchNormMode_t =
    sys::cudnnBatchNormMode_t::CUDNN_BATCHNORM_SPATIAL;

/// The mode of a channels_last input in training, forward and backward.
pub(crate) const MODE_NHWC_TRAINING: sys::cudnnBatchNormMode_t =
    sys::cudnnBatchNormMode_t::CUDNN_BATCHNORM_SPATIAL_PERSISTENT;

/// PyTorch's `getCudnnBatchNormMode` (`aten/src/ATen/native/cudnn/BatchNorm.cpp`) for an
/// input of at least 3 dimensions: `SPATIAL_PERSISTENT` for a channels_last one in training
/// (the backward counts as training), `SPATIAL` otherwise.
pub(crate) fn mode(layout: ConvLayout, training: bool) -> sys::cudnnBatchNormMode_t {
    match (layout, training) {
        (ConvLayout::Nhwc, true) => MODE_NHWC_TRAINING,
        _ => MODE,
    }
}

/// Batch norm alone, no fused activation or addition.
const OPS: sys::cudnnBatchNormOps_t = sys::cudnnBatchNormOps_t::CUDNN_BATCHNORM_OPS_BN;

/// The descriptor dimensions of a batch norm input of `shape` in `layout`: for NCHW
/// (`[n, c, ..]`, contiguous) `[n, c, s, 1]` with NCHW strides, `s` the product of the
/// spatial sizes (1 for none); for NHWC (`[n, h, w, c]`, contiguous) `[n, c, h, w]` with NHWC
/// strides.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for fewer than 2 dimensions (NHWC: other than 4) or a size
/// past cuDNN's `int`.
pub(crate) fn input_dims(shape: &[usize], layout: ConvLayout) -> Result<TensorDims> {
    if layout == ConvLayout::Nhwc {
        let &[n, h, w, c] = shape else {
            return Err(Error::InvalidArgument {
                op: "batch_norm_nhwc (cuDNN)",
                reason: format!("expected [batch, h, w, channels], got shape {shape:?}"),
            });
        };
        return super::tensor_dims([n, c, h, w], ConvLayout::Nhwc);
    }
    if shape.len() < 2 {
        return Err(Error::InvalidArgument {
            op: "batch_norm (cuDNN)",
            reason: format!("expected [batch, channels, ..], got shape {shape:?}"),
        });
    }
    let s = shape[2..].iter().try_fold(1usize, |a, &d| a.checked_mul(d)).unwrap_or(usize::MAX);
    super::tensor_dims([shape[0], shape[1], s, 1], ConvLayout::Nchw)
}

/// The descriptor dimensions of the per-channel tensors of a `c`-channel batch norm:
/// `[1, c, 1, 1]` (PyTorch's `expandScale`).
pub(crate) fn param_dims(c: usize) -> Result<TensorDims> {
    super::tensor_dims([1, c, 1, 1], ConvLayout::Nchw)
}

/// A tensor descriptor, destroyed on drop.
struct Desc(sys::cudnnTensorDescriptor_t);

impl Desc {
    fn new(d: &TensorDims, dtype: DType) -> Result<Desc> {
        tensor_descriptor(d, dtype).map(Desc)
    }
}

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created once in `Desc::new`, destroyed once here.
        let _ = unsafe { sys::cudnnDestroyTensorDescriptor(self.0) };
    }
}

/// The input's and the parameters' descriptors of one call.
struct Descs {
    x: Desc,
    p: Desc,
}

impl Descs {
    fn new(shape: &[usize], dtype: DType, layout: ConvLayout) -> Result<Descs> {
        let dims = input_dims(shape, layout)?;
        let x = Desc::new(&dims, dtype)?;
        let p = Desc::new(&param_dims(dims.dims[1] as usize)?, DType::F32)?;
        Ok(Descs { x, p })
    }
}

/// `bytes` from `ws` (none for 0), refusing a size cuDNN cannot mean (see `MAX_WORKSPACE`).
fn block(
    ws: &dyn WorkspaceSource,
    what: &str,
    bytes: usize,
) -> Result<(Option<vram_alloc::Allocation<vram_alloc::cuda::CudaMemory>>, u64)> {
    if bytes >= MAX_WORKSPACE {
        return Err(Error::Device {
            op: "batch_norm (cuDNN)",
            reason: format!("cuDNN asked for a {what} of {bytes} bytes"),
        });
    }
    let block = ws.workspace(bytes)?;
    let addr = block.as_ref().map_or(0, |b| b.ptr());
    Ok((block, addr))
}

fn p(addr: u64) -> *mut c_void {
    addr as *mut c_void
}

/// The device addresses of a training forward. `running`: the running mean and variance,
/// updated in place with `momentum`, or `None`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BnTraining {
    pub(crate) x: u64,
    pub(crate) y: u64,
    pub(crate) gamma: u64,
    pub(crate) beta: u64,
    pub(crate) running: Option<(u64, u64)>,
    pub(crate) momentum: f32,
    pub(crate) eps: f32,
    pub(crate) save_mean: u64,
    pub(crate) save_invstd: u64,
}

/// The device addresses of an evaluation forward.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BnEval {
    pub(crate) x: u64,
    pub(crate) y: u64,
    pub(crate) gamma: u64,
    pub(crate) beta: u64,
    pub(crate) running_mean: u64,
    pub(crate) running_var: u64,
    pub(crate) eps: f32,
}

/// The device addresses of a backward: inputs `x`, `dy`, `gamma` and the saved statistics;
/// outputs `dx`, `dgamma`, `dbeta`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BnBackward {
    pub(crate) x: u64,
    pub(crate) dy: u64,
    pub(crate) gamma: u64,
    pub(crate) save_mean: u64,
    pub(crate) save_invstd: u64,
    pub(crate) dx: u64,
    pub(crate) dgamma: u64,
    pub(crate) dbeta: u64,
}

impl Dnn {
    /// Bytes of the reserve space cuDNN's training asks for an input of `shape` in `dtype`
    /// and `layout` (`cudnnGetBatchNormalizationTrainingExReserveSpaceSize`, as PyTorch's
    /// `_get_cudnn_batch_norm_reserve_space_size`, in the training mode). The caller has
    /// bound the context.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a shape cuDNN cannot describe; [`Error::Device`] when
    /// cuDNN refuses.
    pub(crate) fn bn_reserve_size(
        &self,
        shape: &[usize],
        dtype: DType,
        layout: ConvLayout,
    ) -> Result<usize> {
        let x = Desc::new(&input_dims(shape, layout)?, dtype)?;
        let mut bytes = 0usize;
        // SAFETY: live handle and descriptor; no activation (null) for OPS_BN.
        check("cudnnGetBatchNormalizationTrainingExReserveSpaceSize", unsafe {
            sys::cudnnGetBatchNormalizationTrainingExReserveSpaceSize(
                self.handle,
                mode(layout, true),
                OPS,
                null_mut(),
                x.0,
                &mut bytes,
            )
        })?;
        Ok(bytes)
    }

    /// Batch norm in training over `x` of `shape` in `dtype` (f32, or f16 with f32
    /// parameters), contiguous in `layout` (`[n, c, ..]`, or `[n, h, w, c]` for NHWC): writes `y`, the saved mean and invstd, and updates the running
    /// statistics when given. Workspace and reserve space from `ws`. The caller has bound
    /// the context.
    ///
    /// # Errors
    ///
    /// Out of memory for the workspace or reserve space (nothing written then);
    /// [`Error::Device`] when cuDNN refuses.
    ///
    /// # Safety
    ///
    /// The addresses are live device allocations: `x` and `y` of `shape` in `dtype` (and in
    /// `layout`), the others `c` f32 values; `y` and the saved statistics alias nothing.
    pub(crate) unsafe fn bn_forward_training(
        &self,
        shape: &[usize],
        dtype: DType,
        layout: ConvLayout,
        a: &BnTraining,
        ws: &dyn WorkspaceSource,
    ) -> Result<()> {
        let d = Descs::new(shape, dtype, layout)?;
        let mode = mode(layout, true);
        let mut ws_bytes = 0usize;
        // SAFETY: live handle and descriptors; x, z and y share one descriptor, as PyTorch's
        // query passes them.
        check("cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize", unsafe {
            sys::cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize(
                self.handle,
                mode,
                OPS,
                d.x.0,
                d.x.0,
                d.x.0,
                d.p.0,
                null_mut(),
                &mut ws_bytes,
            )
        })?;
        let reserve_bytes = self.bn_reserve_size(shape, dtype, layout)?;
        self.note_batch_norm(BnPass::Training, shape, dtype, layout, (ws_bytes, reserve_bytes));
        let (work, work_addr) = block(ws, "workspace", ws_bytes)?;
        let (reserve, reserve_addr) = block(ws, "reserve space", reserve_bytes)?;
        let (rm, rv) = a.running.unwrap_or((0, 0));
        // SAFETY: the caller's contract; the workspace and reserve blocks hold the sizes
        // cuDNN asked for and go back to the cache after the call is queued, which the
        // stream orders before their reuse.
        let status = unsafe {
            sys::cudnnBatchNormalizationForwardTrainingEx(
                self.handle,
                mode,
                OPS,
                alpha(),
                beta(false),
                d.x.0,
                p(a.x),
                null_mut(),
                std::ptr::null(),
                d.x.0,
                p(a.y),
                d.p.0,
                p(a.gamma),
                p(a.beta),
                f64::from(a.momentum),
                p(rm),
                p(rv),
                f64::from(a.eps),
                p(a.save_mean),
                p(a.save_invstd),
                null_mut(),
                p(work_addr),
                ws_bytes,
                p(reserve_addr),
                reserve_bytes,
            )
        };
        drop((work, reserve));
        check("cudnnBatchNormalizationForwardTrainingEx", status)
    }

    /// Batch norm in evaluation over `x` of `shape` in `dtype` and `layout` from the running
    /// statistics
    /// (no workspace). The caller has bound the context.
    ///
    /// # Errors
    ///
    /// [`Error::Device`] when cuDNN refuses.
    ///
    /// # Safety
    ///
    /// As [`bn_forward_training`](Self::bn_forward_training).
    pub(crate) unsafe fn bn_forward_inference(
        &self,
        shape: &[usize],
        dtype: DType,
        layout: ConvLayout,
        a: &BnEval,
    ) -> Result<()> {
        let d = Descs::new(shape, dtype, layout)?;
        // SAFETY: the caller's contract.
        check("cudnnBatchNormalizationForwardInference", unsafe {
            sys::cudnnBatchNormalizationForwardInference(
                self.handle,
                mode(layout, false),
                alpha(),
                beta(false),
                d.x.0,
                p(a.x),
                d.x.0,
                p(a.y),
                d.p.0,
                p(a.gamma),
                p(a.beta),
                p(a.running_mean),
                p(a.running_var),
                f64::from(a.eps),
            )
        })
    }

    /// The backward of a training batch norm over `x` of `shape` in `dtype` and `layout`, from
    /// the saved
    /// statistics: writes `dx` (overwritten, alphaDataDiff = 1, betaDataDiff = 0), `dgamma`
    /// and `dbeta` (likewise). No reserve space (see the module's docs); workspace from
    /// `ws`. The caller has bound the context.
    ///
    /// # Errors
    ///
    /// Out of memory for the workspace; [`Error::Device`] when cuDNN refuses.
    ///
    /// # Safety
    ///
    /// As [`bn_forward_training`](Self::bn_forward_training): `x`, `dy`, `dx` of `shape` in
    /// `dtype` and `layout`, the rest `c` f32 values; outputs alias nothing.
    pub(crate) unsafe fn bn_backward(
        &self,
        shape: &[usize],
        dtype: DType,
        layout: ConvLayout,
        a: &BnBackward,
        eps: f32,
        ws: &dyn WorkspaceSource,
    ) -> Result<()> {
        let d = Descs::new(shape, dtype, layout)?;
        let mode = mode(layout, true);
        let mut ws_bytes = 0usize;
        // SAFETY: live handle and descriptors; no dz (OPS_BN), no activation.
        check("cudnnGetBatchNormalizationBackwardExWorkspaceSize", unsafe {
            sys::cudnnGetBatchNormalizationBackwardExWorkspaceSize(
                self.handle,
                mode,
                OPS,
                d.x.0,
                d.x.0,
                d.x.0,
                null_mut(),
                d.x.0,
                d.p.0,
                null_mut(),
                &mut ws_bytes,
            )
        })?;
        self.note_batch_norm(BnPass::Backward, shape, dtype, layout, (ws_bytes, 0));
        let (work, work_addr) = block(ws, "workspace", ws_bytes)?;
        // SAFETY: the caller's contract; the workspace as in the forward.
        let status = unsafe {
            sys::cudnnBatchNormalizationBackwardEx(
                self.handle,
                mode,
                OPS,
                alpha(),
                beta(false),
                alpha(),
                beta(false),
                d.x.0,
                p(a.x),
                null_mut(),
                std::ptr::null(),
                d.x.0,
                p(a.dy),
                null_mut(),
                null_mut(),
                d.x.0,
                p(a.dx),
                d.p.0,
                p(a.gamma),
                std::ptr::null(),
                p(a.dgamma),
                p(a.dbeta),
                f64::from(eps),
                p(a.save_mean),
                p(a.save_invstd),
                null_mut(),
                p(work_addr),
                ws_bytes,
                null_mut(),
                0,
            )
        };
        drop(work);
        check("cudnnBatchNormalizationBackwardEx", status)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_input_is_described_as_nchw_with_the_spatial_sizes_folded() {
        // BatchNorm2d: [n, c, h, w] -> [n, c, h*w, 1], NCHW strides.
        let d = input_dims(&[4, 3, 5, 7], ConvLayout::Nchw).unwrap();
        assert_eq!(d.dims, [4, 3, 35, 1]);
        assert_eq!(d.strides, [105, 35, 1, 1]);
        // BatchNorm1d on sequences, [n, c, l], padded as PyTorch's descriptor pads it.
        let d = input_dims(&[2, 8, 10], ConvLayout::Nchw).unwrap();
        assert_eq!((d.dims, d.strides), ([2, 8, 10, 1], [80, 10, 1, 1]));
        // BatchNorm3d, [n, c, d, h, w].
        let d = input_dims(&[2, 4, 3, 5, 6], ConvLayout::Nchw).unwrap();
        assert_eq!((d.dims, d.strides), ([2, 4, 90, 1], [360, 90, 1, 1]));
        // Element (n, c, i) of the contiguous input is at n * c * s + c * s + i.
        let [sn, sc, ss, _] = input_dims(&[4, 3, 5, 7], ConvLayout::Nchw).unwrap().strides;
        assert_eq!(3 * sn + 2 * sc + 11 * ss, (3 * 3 + 2) * 35 + 11);
    }

    #[test]
    fn a_channels_last_input_is_described_with_nhwc_strides() {
        // [n, h, w, c] = [4, 5, 7, 3] -> dims [n, c, h, w] with NHWC strides.
        let d = input_dims(&[4, 5, 7, 3], ConvLayout::Nhwc).unwrap();
        assert_eq!(d.dims, [4, 3, 5, 7]);
        assert_eq!(d.strides, [105, 1, 21, 3]);
        // Element (n, y, x, ch) of the contiguous [n, h, w, c] input.
        let [sn, sc, sh, sw] = d.strides;
        assert_eq!(3 * sn + 2 * sc + 4 * sh + 6 * sw, ((3 * 5 + 4) * 7 + 6) * 3 + 2);
        let e = input_dims(&[4, 5, 3], ConvLayout::Nhwc).unwrap_err();
        assert!(e.to_string().contains("[batch, h, w, channels]"), "{e}");
    }

    #[test]
    fn channels_last_training_runs_spatial_persistent_as_pytorch() {
        use sys::cudnnBatchNormMode_t::{
            CUDNN_BATCHNORM_SPATIAL as SPATIAL, CUDNN_BATCHNORM_SPATIAL_PERSISTENT as PERSISTENT,
        };
        assert_eq!(mode(ConvLayout::Nhwc, true), PERSISTENT);
        assert_eq!(mode(ConvLayout::Nhwc, false), SPATIAL);
        assert_eq!(mode(ConvLayout::Nchw, true), SPATIAL);
        assert_eq!(mode(ConvLayout::Nchw, false), SPATIAL);
    }

    #[test]
    fn the_parameters_share_one_per_channel_descriptor() {
        let d = param_dims(64).unwrap();
        assert_eq!((d.dims, d.strides), ([1, 64, 1, 1], [64, 1, 1, 1]));
    }

    #[test]
    fn bad_inputs_are_refused_with_a_clear_error() {
        let e = input_dims(&[8], ConvLayout::Nchw).unwrap_err();
        assert!(e.to_string().contains("[batch, channels, ..]"), "{e}");
        let e = input_dims(&[1 << 16, 1 << 8, 1 << 8], ConvLayout::Nchw).unwrap_err();
        assert!(e.to_string().contains("32-bit"), "{e}");
        let e = input_dims(&[2, 2, usize::MAX, 2], ConvLayout::Nchw).unwrap_err();
        assert!(e.to_string().contains("32-bit"), "{e}");
    }

    #[test]
    fn the_mode_is_spatial() {
        assert_eq!(MODE, sys::cudnnBatchNormMode_t::CUDNN_BATCHNORM_SPATIAL);
    }
}
