//! `x * s` with a per-(image, channel) scale broadcast over the spatial positions:
//! `x: [n, c, ..]`, `s: [n, c]` (squeeze-excitation's gate, PyTorch's `x * s[:, :, None,
//! None]`, which broadcasts without materializing `s` at `x`'s size), and its backward.

use super::dispatch::{Buffers, Op, Plan, run};
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
    let mut out = run(ScaleChannels { x, s, dy: None, hw })?;
    Ok(out.pop().expect("planned"))
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
    let mut out = run(ScaleChannels { x, s, dy: Some(dy), hw })?;
    let ds = out.pop().expect("planned");
    let dx = out.pop().expect("planned");
    Ok(ScaleChannelsGrads { dx, ds })
}

/// The forward (`dy` none: one output) or the backward (two outputs, `dx` and `ds`).
struct ScaleChannels<'a> {
    x: &'a Tensor,
    s: &'a Tensor,
    dy: Option<&'a Tensor>,
    hw: usize,
}

impl Op for ScaleChannels<'_> {
    const NAME: &'static str = "scale_channels";
    type Output = Vec<Tensor>;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan> {
        let mut plan = Plan::one(self.x.shape(), self.x.dtype());
        if self.dy.is_some() {
            // Empty planes sum to 0.
            if self.hw == 0 {
                plan.zeroed_output(self.s.shape(), self.s.dtype());
            } else {
                plan.output(self.s.shape(), self.s.dtype());
            }
        }
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers) -> Result<()> {
        with_dtype!(self.x.dtype(), T => {
            let (x, s) = (self.x.as_slice::<T>()?, self.s.as_slice::<T>()?);
            match self.dy {
                None => cpu::scale_channels(x, s, self.hw, bufs.out(0).out_slice::<T>(Self::NAME)?),
                Some(dy) => {
                    let [dx, ds] = bufs.outputs_mut() else { unreachable!("planned") };
                    cpu::scale_channels_backward(
                        x,
                        s,
                        dy.as_slice::<T>()?,
                        self.hw,
                        dx.out_slice::<T>(Self::NAME)?,
                        ds.out_slice::<T>(Self::NAME)?,
                    )
                }
            }
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers) -> Result<()> {
        use crate::cuda::helpers::{check_rows, ptr};
        use crate::cuda::registry::{SCALE_CHANNELS, SCALE_CHANNELS_BWD};
        use crate::cuda::{Arg, launch};
        let t = self.x.dtype();
        let n = self.x.numel();
        if n == 0 {
            return Ok(()); // nothing to scale; empty planes' ds is zeroed
        }
        match self.dy {
            // SAFETY: scale_channels_T(const T* x, const T* s, T* y, u64 n, Div hw),
            // grid-stride over the n elements of x and y; s holds n / hw scales.
            None => unsafe {
                gpu.launch(
                    SCALE_CHANNELS.of(t),
                    launch::elementwise(n),
                    &[
                        ptr(self.x)?,
                        ptr(self.s)?,
                        ptr(bufs.out(0))?,
                        Arg::count(n),
                        Arg::div(self.hw),
                    ],
                )
            },
            Some(dy) => {
                let planes = self.s.numel();
                check_rows(Self::NAME, planes)?;
                let [dx, ds] = bufs.outputs_mut() else { unreachable!("planned") };
                // SAFETY: scale_channels_bwd_T(const T* x, const T* s, const T* dy, T* dx,
                // T* ds, u64 hw), one block per plane: dx, x and dy hold planes * hw
                // elements, s and ds planes.
                unsafe {
                    gpu.launch(
                        SCALE_CHANNELS_BWD.of(t),
                        launch::per_row(planes),
                        &[
                            ptr(self.x)?,
                            ptr(self.s)?,
                            ptr(dy)?,
                            ptr(dx)?,
                            ptr(ds)?,
                            Arg::count(self.hw),
                        ],
                    )
                }
            }
        }
    }

    fn finish(self, bufs: Buffers) -> Result<Vec<Tensor>> {
        Ok(bufs.into_outputs().collect())
    }
}
