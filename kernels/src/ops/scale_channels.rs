//! `x * s` with a per-(image, channel) scale broadcast over the spatial positions:
//! `x: [n, c, ..]`, `s: [n, c]` (squeeze-excitation's gate, PyTorch's `x * s[:, :, None,
//! None]`, which broadcasts without materializing `s` at `x`'s size), and its backward.

use super::dispatch::{Buffers, Op, OutputSpec, Plan, run};
use super::{invalid, same_kind, same_layout};
use crate::cpu::scale_channels as cpu;
use crate::device::Device;
use crate::dtype::with_dtype;
use crate::error::Result;
use crate::tensor::Tensor;

/// Gradients of [`scale_channels`].
#[derive(Debug)]
pub struct ScaleChannelsGrads {
    /// Gradient of `x`, `x`'s shape.
    pub dx: Tensor,
    /// Gradient of `s`, `[n, c]`: the sum over each plane of `dy * x`.
    pub ds: Tensor,
}

/// The spatial size of `x: [n, c, ..]` after checking `s: [n, c]` (same dtype and device).
fn plane(op: &'static str, x: &Tensor, s: &Tensor) -> Result<usize> {
    same_kind(op, x, s)?;
    let shape = x.shape();
    if shape.len() < 2 || s.shape() != &shape[..2] {
        return Err(invalid(
            op,
            format!("scale {:?} is not [batch, channels] of x {shape:?}", s.shape()),
        ));
    }
    Ok(shape[2..].iter().product())
}

/// `y = x * s[:, :, None, ..]` for `x: [n, c, ..]` and `s: [n, c]`.
///
/// # Errors
///
/// Shape, dtype and device mismatches; out of memory.
pub fn scale_channels(x: &Tensor, s: &Tensor) -> Result<Tensor> {
    let hw = plane("scale_channels", x, s)?;
    run(ScaleChannels { x, s, hw })
}

/// Gradients of [`scale_channels`] from its inputs and the upstream `dy`: `dx = dy * s`
/// broadcast, `ds = sum over each plane of dy * x`.
///
/// # Errors
///
/// As [`scale_channels`], and `dy` not of `x`'s shape.
pub fn scale_channels_backward(x: &Tensor, s: &Tensor, dy: &Tensor) -> Result<ScaleChannelsGrads> {
    let hw = plane("scale_channels_backward", x, s)?;
    same_layout("scale_channels_backward", x, dy)?;
    let [dx, ds] = run(ScaleChannelsBackward { x, s, dy, hw })?;
    Ok(ScaleChannelsGrads { dx, ds })
}

/// The forward.
struct ScaleChannels<'a> {
    x: &'a Tensor,
    s: &'a Tensor,
    hw: usize,
}

impl Op for ScaleChannels<'_> {
    const NAME: &'static str = "scale_channels";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Tensor>> {
        Ok(Plan::one(self.x.shape(), self.x.dtype()))
    }

    fn host(&mut self, bufs: &mut Buffers<Tensor>) -> Result<()> {
        with_dtype!(self.x.dtype(), T => {
            let (x, s) = (self.x.as_slice::<T>()?, self.s.as_slice::<T>()?);
            cpu::scale_channels(x, s, self.hw, bufs.out().out_slice::<T>(Self::NAME)?)
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Tensor>) -> Result<()> {
        use crate::cuda::helpers::ptr;
        use crate::cuda::registry::SCALE_CHANNELS;
        use crate::cuda::{Arg, launch};
        let t = self.x.dtype();
        let n = self.x.numel();
        if n == 0 {
            return Ok(()); // nothing to scale
        }
        // SAFETY: scale_channels_T(const T* x, const T* s, T* y, u64 n, Div hw), grid-stride
        // over the n elements of x and y; s holds n / hw scales.
        unsafe {
            gpu.launch(
                SCALE_CHANNELS.of(t),
                launch::elementwise(n),
                &[ptr(self.x)?, ptr(self.s)?, ptr(bufs.out())?, Arg::count(n), Arg::div(self.hw)],
            )
        }
    }

    fn finish(self, bufs: Buffers<Tensor>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

/// The backward: `dx` and `ds`.
struct ScaleChannelsBackward<'a> {
    x: &'a Tensor,
    s: &'a Tensor,
    dy: &'a Tensor,
    hw: usize,
}

impl Op for ScaleChannelsBackward<'_> {
    // The forward's name: the one the profile has always recorded for both.
    const NAME: &'static str = "scale_channels";
    /// `dx` and `ds`.
    type Outs = [Tensor; 2];
    type Output = [Tensor; 2];

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<[Tensor; 2]>> {
        Ok(Plan::new([
            OutputSpec::new(self.x.shape(), self.x.dtype()),
            // Empty planes sum to 0.
            OutputSpec::zeroed_if(self.hw == 0, self.s.shape(), self.s.dtype()),
        ]))
    }

    fn host(&mut self, bufs: &mut Buffers<[Tensor; 2]>) -> Result<()> {
        let [dx, ds] = bufs.outputs_mut();
        with_dtype!(self.x.dtype(), T => cpu::scale_channels_backward(
            self.x.as_slice::<T>()?,
            self.s.as_slice::<T>()?,
            self.dy.as_slice::<T>()?,
            self.hw,
            dx.out_slice::<T>(Self::NAME)?,
            ds.out_slice::<T>(Self::NAME)?,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<[Tensor; 2]>) -> Result<()> {
        use crate::cuda::helpers::{check_rows, ptr};
        use crate::cuda::registry::SCALE_CHANNELS_BWD;
        use crate::cuda::{Arg, launch};
        let t = self.x.dtype();
        let n = self.x.numel();
        if n == 0 {
            return Ok(()); // nothing to scale; empty planes' ds is zeroed
        }
        let planes = self.s.numel();
        check_rows(Self::NAME, planes)?;
        let [dx, ds] = bufs.outputs_mut();
        // SAFETY: scale_channels_bwd_T(const T* x, const T* s, const T* dy, T* dx, T* ds,
        // u64 hw), one block per plane: dx, x and dy hold planes * hw elements, s and ds
        // planes.
        unsafe {
            gpu.launch(
                SCALE_CHANNELS_BWD.of(t),
                launch::per_row(planes),
                &[
                    ptr(self.x)?,
                    ptr(self.s)?,
                    ptr(self.dy)?,
                    ptr(dx)?,
                    ptr(ds)?,
                    Arg::count(self.hw),
                ],
            )
        }
    }

    fn finish(self, bufs: Buffers<[Tensor; 2]>) -> Result<[Tensor; 2]> {
        Ok(bufs.into_outputs())
    }
}

/// NHWC to NCHW, and back.
const TO_NCHW: [usize; 4] = [0, 3, 1, 2];
const TO_NHWC: [usize; 4] = [0, 2, 3, 1];

/// `x: [n, h, w, c]` and `s: [n, c]` checked (rank 4, `s` the batch and channels of `x`).
fn nhwc(op: &'static str, x: &Tensor, s: &Tensor) -> Result<()> {
    same_kind(op, x, s)?;
    let shape = x.shape();
    if shape.len() != 4 || s.shape() != [shape[0], shape[3]] {
        return Err(invalid(
            op,
            format!(
                "scale {:?} is not [batch, channels] of the channels_last x {shape:?}",
                s.shape()
            ),
        ));
    }
    Ok(())
}

/// [`scale_channels`] of a channels_last `x: [n, h, w, c]` by `s: [n, c]`:
/// `y[n, i, j, c] = x[n, i, j, c] * s[n, c]`, channels_last.
///
/// # Errors
///
/// Shape, dtype and device mismatches; out of memory.
pub fn scale_channels_nhwc(x: &Tensor, s: &Tensor) -> Result<Tensor> {
    nhwc("scale_channels_nhwc", x, s)?;
    let xc = super::permute(x, &TO_NCHW)?;
    let y = scale_channels(&xc, s)?;
    drop(xc);
    super::permute(&y, &TO_NHWC)
}

/// Gradients of [`scale_channels_nhwc`]: `dx` channels_last, `ds: [n, c]`.
///
/// # Errors
///
/// As [`scale_channels_nhwc`], and `dy` not of `x`'s shape.
pub fn scale_channels_backward_nhwc(
    x: &Tensor,
    s: &Tensor,
    dy: &Tensor,
) -> Result<ScaleChannelsGrads> {
    nhwc("scale_channels_backward_nhwc", x, s)?;
    same_layout("scale_channels_backward_nhwc", x, dy)?;
    let xc = super::permute(x, &TO_NCHW)?;
    let dyc = super::permute(dy, &TO_NCHW)?;
    let g = scale_channels_backward(&xc, s, &dyc)?;
    drop((xc, dyc));
    Ok(ScaleChannelsGrads { dx: super::permute(&g.dx, &TO_NHWC)?, ds: g.ds })
}
