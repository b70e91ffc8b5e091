//! `x * s` with a per-(image, channel) scale broadcast over the spatial positions:
//! `x: [n, c, ..]`, `s: [n, c]` (squeeze-excitation's gate, PyTorch's `x * s[:, :, None,
//! None]`, which broadcasts without materializing `s` at `x`'s size), and its backward; the
//! same for a channels_last `x: [n, h, w, c]` (`*_nhwc`), directly, without permutes.

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

/// `(hw, c)` of the channels_last `x: [n, h, w, c]` after checking `s: [n, c]` (same dtype
/// and device).
fn nhwc(op: &'static str, x: &Tensor, s: &Tensor) -> Result<(usize, usize)> {
    same_kind(op, x, s)?;
    let &[n, h, w, c] = x.shape() else {
        return Err(invalid(
            op,
            format!("expected x of shape [batch, h, w, channels], got {:?}", x.shape()),
        ));
    };
    if s.shape() != [n, c] {
        return Err(invalid(
            op,
            format!(
                "scale {:?} is not [batch, channels] of the channels_last x {:?}",
                s.shape(),
                x.shape()
            ),
        ));
    }
    Ok((h * w, c))
}

/// [`scale_channels`] of a channels_last `x: [n, h, w, c]` by `s: [n, c]`:
/// `y[n, i, j, c] = x[n, i, j, c] * s[n, c]`, channels_last, each element as
/// [`scale_channels`] computes it (its result on the NCHW image, permuted, bit for bit). A
/// GPU runs one thread per element, the channel fastest (coalesced); this has not yet run
/// on a GPU.
///
/// # Errors
///
/// Shape, dtype and device mismatches; a rank other than 4; out of memory.
pub fn scale_channels_nhwc(x: &Tensor, s: &Tensor) -> Result<Tensor> {
    let (hw, c) = nhwc("scale_channels_nhwc", x, s)?;
    run(ScaleChannelsNhwc { x, s, hw, c })
}

/// Gradients of [`scale_channels_nhwc`]: `dx = dy * s` broadcast (channels_last, each
/// element as [`scale_channels_backward`] computes it) and `ds: [n, c]`, the sum over each
/// image's positions of `dy * x`, in f64: in position order within chunks of 64 positions,
/// the chunks' sums then in chunk order. Up to 64 positions (a 7x7 or 8x8 plane) `ds` is
/// [`scale_channels_backward`]'s, bit for bit; past that the same exact products grouped by
/// chunk, which can differ from it in the last bit of f64 and so, rarely, in the last bit
/// of the result. A GPU adds in the same order (one thread per image, chunk and channel,
/// writing `dx` over its chunk), with the chunks' f64 partial sums (`n * chunks * c`
/// f64s) in a workspace when there are several; it has not yet run on a GPU.
///
/// # Errors
///
/// As [`scale_channels_nhwc`], and `dy` not of `x`'s shape, dtype and device.
pub fn scale_channels_backward_nhwc(
    x: &Tensor,
    s: &Tensor,
    dy: &Tensor,
) -> Result<ScaleChannelsGrads> {
    let (hw, c) = nhwc("scale_channels_backward_nhwc", x, s)?;
    same_layout("scale_channels_backward_nhwc", x, dy)?;
    let [dx, ds] = run(ScaleChannelsBackwardNhwc { x, s, dy, hw, c, partials: None })?;
    Ok(ScaleChannelsGrads { dx, ds })
}

/// The channels_last forward.
struct ScaleChannelsNhwc<'a> {
    x: &'a Tensor,
    s: &'a Tensor,
    hw: usize,
    c: usize,
}

impl Op for ScaleChannelsNhwc<'_> {
    const NAME: &'static str = "scale_channels_nhwc";
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
            let y = bufs.out().out_slice::<T>(Self::NAME)?;
            cpu::scale_channels_nhwc(x, s, (self.hw, self.c), y)
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Tensor>) -> Result<()> {
        let at = (self.x.cuda_ptr()?, self.s.cuda_ptr()?, bufs.out().cuda_ptr()?);
        cuda::forward(gpu, self.x.numel(), (self.hw, self.c), self.x.dtype(), at)
    }

    fn finish(self, bufs: Buffers<Tensor>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

/// The channels_last backward: `dx` and `ds`.
struct ScaleChannelsBackwardNhwc<'a> {
    x: &'a Tensor,
    s: &'a Tensor,
    dy: &'a Tensor,
    hw: usize,
    c: usize,
    /// The chunks' f64 partial sums of `ds`, with several chunks.
    partials: Option<usize>,
}

impl Op for ScaleChannelsBackwardNhwc<'_> {
    const NAME: &'static str = "scale_channels_backward_nhwc";
    /// `dx` and `ds`.
    type Outs = [Tensor; 2];
    type Output = [Tensor; 2];

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<[Tensor; 2]>> {
        let mut plan = Plan::new([
            OutputSpec::new(self.x.shape(), self.x.dtype()),
            // Empty planes sum to 0.
            OutputSpec::zeroed_if(self.hw == 0, self.s.shape(), self.s.dtype()),
        ]);
        let chunks = crate::cpu::pool::nhwc_chunks(self.hw);
        if chunks > 1 {
            self.partials = plan.workspace(self.s.numel() * chunks * 8);
        }
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers<[Tensor; 2]>) -> Result<()> {
        let [dx, ds] = bufs.outputs_mut();
        with_dtype!(self.x.dtype(), T => cpu::scale_channels_backward_nhwc(
            self.x.as_slice::<T>()?,
            self.s.as_slice::<T>()?,
            self.dy.as_slice::<T>()?,
            (self.hw, self.c),
            dx.out_slice::<T>(Self::NAME)?,
            ds.out_slice::<T>(Self::NAME)?,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<[Tensor; 2]>) -> Result<()> {
        let partials = bufs.ws(self.partials)?;
        let [dx, ds] = bufs.outputs_mut();
        let at = cuda::Backward {
            x: self.x.cuda_ptr()?,
            s: self.s.cuda_ptr()?,
            dy: self.dy.cuda_ptr()?,
            dx: dx.cuda_ptr()?,
            partials,
            ds: ds.cuda_ptr()?,
        };
        cuda::backward(gpu, self.s.shape()[0], (self.hw, self.c), self.x.dtype(), &at)
    }

    fn finish(self, bufs: Buffers<[Tensor; 2]>) -> Result<[Tensor; 2]> {
        Ok(bufs.into_outputs())
    }
}

/// The channels_last CUDA side, on device addresses through [`Exec`](crate::cuda::Exec), so
/// that the tests run it on the host emulation too.
#[cfg(feature = "cuda")]
mod cuda {
    use crate::cpu::elementwise::COLUMN_SUM_ROWS;
    use crate::cpu::pool::nhwc_chunks;
    use crate::cuda::launch::elementwise as grid;
    use crate::cuda::registry::{
        SCALE_CHANNELS_NHWC, SCALE_CHANNELS_NHWC_BWD, SCALE_CHANNELS_NHWC_BWD_FINISH,
    };
    use crate::cuda::{Arg, Exec};
    use crate::dtype::DType;
    use crate::error::Result;

    /// `y = x * s` over the `n` elements of the channels_last `x` at `x` (`[.., hw, c]`).
    pub(super) fn forward(
        e: &impl Exec,
        n: usize,
        (hw, c): (usize, usize),
        t: DType,
        (x, s, y): (u64, u64, u64),
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        // SAFETY: scale_channels_nhwc_T(const T* x, const T* s, T* y, u64 n, Div c, Div hwc),
        // grid-stride over the n elements of x and y; s holds n / hw scales.
        unsafe {
            e.launch(
                SCALE_CHANNELS_NHWC.of(t),
                grid(n),
                &[
                    Arg::Ptr(x),
                    Arg::Ptr(s),
                    Arg::Ptr(y),
                    Arg::count(n),
                    Arg::div(c),
                    Arg::div(hw * c),
                ],
            )
        }
    }

    /// The device addresses of a backward's tensors and workspace.
    pub(super) struct Backward {
        pub(super) x: u64,
        pub(super) s: u64,
        pub(super) dy: u64,
        pub(super) dx: u64,
        /// `images * chunks * c` f64s; read only with several chunks.
        pub(super) partials: u64,
        pub(super) ds: u64,
    }

    /// `dx` and `ds` of `images` channels_last images of `hw` positions and `c` channels.
    pub(super) fn backward(
        e: &impl Exec,
        images: usize,
        (hw, c): (usize, usize),
        t: DType,
        at: &Backward,
    ) -> Result<()> {
        let chunks = nhwc_chunks(hw);
        let total = images * chunks * c;
        if total == 0 || hw == 0 {
            return Ok(()); // nothing to scale; empty planes' ds is zeroed
        }
        // SAFETY: scale_channels_nhwc_bwd_T(const T* x, const T* s, const T* dy, T* dx,
        // double* partial, T* ds, u64 total, Div c, Div chunks, u64 hw, u64 rows), one thread
        // per (image, chunk, channel); x, dy and dx hold images * hw * c elements, s and ds
        // images * c, the partials (written only with several chunks) total f64s.
        unsafe {
            e.launch(
                SCALE_CHANNELS_NHWC_BWD.of(t),
                grid(total),
                &[
                    Arg::Ptr(at.x),
                    Arg::Ptr(at.s),
                    Arg::Ptr(at.dy),
                    Arg::Ptr(at.dx),
                    Arg::Ptr(at.partials),
                    Arg::Ptr(at.ds),
                    Arg::count(total),
                    Arg::div(c),
                    Arg::div(chunks),
                    Arg::count(hw),
                    Arg::count(COLUMN_SUM_ROWS),
                ],
            )?;
        }
        if chunks == 1 {
            return Ok(());
        }
        // SAFETY: scale_channels_nhwc_bwd_finish_T(const double* partial, T* ds, u64 total,
        // Div c, u64 chunks), one thread per element of ds (images * c); the partials, written
        // by the launch above, hold images * chunks * c f64s.
        unsafe {
            e.launch(
                SCALE_CHANNELS_NHWC_BWD_FINISH.of(t),
                grid(images * c),
                &[
                    Arg::Ptr(at.partials),
                    Arg::Ptr(at.ds),
                    Arg::count(images * c),
                    Arg::div(c),
                    Arg::count(chunks),
                ],
            )
        }
    }
}

/// The channels_last CUDA code on the host emulation, against the host op: bit for bit (the
/// same products, the same f64 sums in the same order), over one chunk of positions and
/// several, one channel and a 1x1 plane.
#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;
    use crate::cpu::elementwise::COLUMN_SUM_ROWS;
    use crate::cuda::emulate::Emulator;
    use crate::cuda::emulated_kernels::values;
    use crate::cuda::registry::SCALE_CHANNELS_NHWC;
    use crate::dtype::{DType, Element};
    use half::{bf16, f16};

    fn addr<T>(v: &mut [T]) -> u64 {
        v.as_mut_ptr() as u64
    }

    fn bits<T: Element>(v: &[T]) -> Vec<u32> {
        v.iter().map(|v| v.to_f32().to_bits()).collect()
    }

    fn scale_channels_of<T: Element>(e: &Emulator) {
        let t = T::DTYPE;
        for (case, shape) in
            [[2, 7, 7, 5], [2, 9, 10, 3], [3, 13, 11, 2], [2, 8, 9, 1], [1, 1, 1, 4]]
                .iter()
                .enumerate()
        {
            let [n, h, w, c] = *shape;
            let (hw, len) = (h * w, n * h * w * c);
            let d = Device::host(1 << 28);
            let tensor = |shape: &[usize], seed| {
                let v = values(shape.iter().product(), seed, -2.0, 2.0);
                Tensor::from_f32_slice(&d, shape, &v, t).unwrap()
            };
            let seed = 10 * case as u64;
            let (x, s, dy) =
                (tensor(shape, seed), tensor(&[n, c], seed + 1), tensor(shape, seed + 2));
            let want = scale_channels_nhwc(&x, &s).unwrap();
            let grads = scale_channels_backward_nhwc(&x, &s, &dy).unwrap();
            let (mut xe, mut se, mut dye) =
                (x.to_vec::<T>().unwrap(), s.to_vec::<T>().unwrap(), dy.to_vec::<T>().unwrap());
            let mut y = vec![T::from_f32(f32::NAN); len];
            cuda::forward(e, len, (hw, c), t, (addr(&mut xe), addr(&mut se), addr(&mut y)))
                .unwrap();
            let what = format!("scale_channels_nhwc {t:?} {shape:?}");
            assert_eq!(bits(&y), bits(&want.to_vec::<T>().unwrap()), "{what}");

            let chunks = hw.div_ceil(COLUMN_SUM_ROWS);
            let mut partials = vec![f64::NAN; if chunks > 1 { n * chunks * c } else { 0 }];
            let (mut dx, mut ds) =
                (vec![T::from_f32(f32::NAN); len], vec![T::from_f32(f32::NAN); n * c]);
            let at = cuda::Backward {
                x: addr(&mut xe),
                s: addr(&mut se),
                dy: addr(&mut dye),
                dx: addr(&mut dx),
                partials: addr(&mut partials),
                ds: addr(&mut ds),
            };
            cuda::backward(e, n, (hw, c), t, &at).unwrap();
            assert_eq!(bits(&dx), bits(&grads.dx.to_vec::<T>().unwrap()), "{what} dx");
            assert_eq!(bits(&ds), bits(&grads.ds.to_vec::<T>().unwrap()), "{what} ds");
        }
    }

    #[test]
    fn emulated_nhwc_scale_channels_kernels_match_the_host_bit_for_bit() {
        let Some(e) = Emulator::new(SCALE_CHANNELS_NHWC.of(DType::F32)) else { return };
        scale_channels_of::<f32>(&e);
        scale_channels_of::<f16>(&e);
        scale_channels_of::<bf16>(&e);
    }
}
