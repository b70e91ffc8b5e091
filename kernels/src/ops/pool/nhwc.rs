//! Channels_last (NHWC) max pool and global average pool, forward and backward: direct ops
//! on `x: [batch, h, w, channels]`, no permute to NCHW and back (each of which is a full-size
//! copy). The host references (`cpu::pool::*_nhwc`) read NHWC directly and give what the
//! NCHW ops give the permuted image (bit for bit, except the global average pool over more
//! than 64 positions, whose f32 sum is grouped by chunks of 64: see
//! [`global_avg_pool_nhwc`]). The CUDA kernels (`pool.cu`, `*_nhwc`) put one thread per
//! element with the channel fastest, so a warp reads 32 neighbouring channels of one pixel,
//! as PyTorch's channels_last max pool does (`max_pool_forward_nhwc` and
//! `max_pool_backward_nhwc` in `aten/src/ATen/native/cuda/DilatedMaxPool2d.cu`); they add in
//! the host's order, so the emulation (tests below) matches the host bit for bit. The CUDA
//! code has not yet run on a GPU.

use super::super::dispatch::{Buffers, Op, OutputSpec, Plan, run};
use super::super::{expect_shape, invalid, same_kind};
use super::pool2d_params;
use crate::cpu::pool as cpu;
use crate::device::Device;
use crate::dtype::with_dtype;
use crate::error::Result;
use crate::params::{Pool2dOptions, Pool2dParams};
use crate::tensor::{Indices, Tensor};

/// The NCHW shape `[n, c, h, w]` of the channels_last `[n, h, w, c]`; an error for a rank
/// other than 4.
fn nchw_of(op: &'static str, shape: &[usize]) -> Result<[usize; 4]> {
    let &[n, h, w, c] = shape else {
        return Err(invalid(op, format!("expected shape [batch, h, w, channels], got {shape:?}")));
    };
    Ok([n, c, h, w])
}

/// The channels_last shape `[n, h, w, c]` of the NCHW `[n, c, h, w]`.
fn nhwc_of([n, c, h, w]: [usize; 4]) -> [usize; 4] {
    [n, h, w, c]
}

/// [`max_pool2d`](super::max_pool2d) of a channels_last `x: [batch, h, w, channels]`: the
/// output is `[batch, oh, ow, channels]`, and so are the indices, for
/// [`max_pool2d_backward_nhwc`]: each the position of its window's maximum in its
/// channel's plane, `iy * w + ix` (the value [`max_pool2d`](super::max_pool2d) gives, as
/// PyTorch's channels_last indices, in channels_last order). NaN wins and the first of tied
/// maxima is kept, as in the NCHW op; output and indices are the NCHW op's, permuted, bit
/// for bit.
///
/// # Errors
///
/// As [`max_pool2d`](super::max_pool2d); a rank other than 4.
pub fn max_pool2d_nhwc(x: &Tensor, opts: &Pool2dOptions) -> Result<(Tensor, Indices)> {
    let p = pool2d_params(&nchw_of("max_pool2d_nhwc", x.shape())?, opts)?;
    run(MaxPoolNhwc { p, x })
}

struct MaxPoolNhwc<'a> {
    /// The geometry, of the NCHW input `[batch, channels, h, w]`.
    p: Pool2dParams,
    x: &'a Tensor,
}

impl Op for MaxPoolNhwc<'_> {
    const NAME: &'static str = "max_pool2d_nhwc";
    /// `y` and the indices of the maxima.
    type Outs = [Tensor; 2];
    type Output = (Tensor, Indices);

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        let shape = nhwc_of(self.p.output_shape());
        Ok(Plan::new([OutputSpec::new(&shape, self.x.dtype()), OutputSpec::indices(&shape)]))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let [y, argmax] = bufs.outputs_mut();
        with_dtype!(self.x.dtype(), T => cpu::max_pool2d_nhwc(
            &self.p,
            self.x.as_slice::<T>()?,
            y.out_slice::<T>(Self::NAME)?,
            argmax.out_u32(Self::NAME)?,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let [y, argmax] = bufs.outputs_mut();
        let at = (self.x.cuda_ptr()?, y.cuda_ptr()?, argmax.cuda_ptr()?);
        cuda::max_pool(gpu, &self.p, self.x.dtype(), at)
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<(Tensor, Indices)> {
        let [y, argmax] = bufs.into_outputs();
        Ok((y, Indices::from_tensor(argmax)))
    }
}

/// Gradient of [`max_pool2d_nhwc`] for an input of `input_shape` (`[batch, h, w,
/// channels]`) from `dy: [batch, oh, ow, channels]` and the saved `argmax` (its layout and
/// convention): channels_last, each element the sum, in f32 in window order with one
/// rounding, of the `dy` that chose it (the NCHW op's, permuted, bit for bit).
///
/// # Errors
///
/// As [`max_pool2d_backward`](super::max_pool2d_backward), with the shapes read as NHWC; a
/// rank other than 4.
pub fn max_pool2d_backward_nhwc(
    dy: &Tensor,
    argmax: &Indices,
    input_shape: &[usize],
    opts: &Pool2dOptions,
) -> Result<Tensor> {
    const OP: &str = "max_pool2d_backward_nhwc";
    let p = pool2d_params(&nchw_of(OP, input_shape)?, opts)?;
    expect_shape(OP, &nhwc_of(p.output_shape()), dy)?;
    run(MaxPoolBackwardNhwc { p, dy, argmax })
}

struct MaxPoolBackwardNhwc<'a> {
    p: Pool2dParams,
    dy: &'a Tensor,
    argmax: &'a Indices,
}

impl Op for MaxPoolBackwardNhwc<'_> {
    const NAME: &'static str = "max_pool2d_backward_nhwc";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.dy.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        super::same_as_argmax(Self::NAME, self.dy, self.argmax)?;
        let p = &self.p;
        // Gathered per input element in f32, rounded once: no accumulator.
        Ok(Plan::one(&[p.batch(), p.h(), p.w(), p.channels()], self.dy.dtype()))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        with_dtype!(self.dy.dtype(), T => cpu::max_pool2d_backward_nhwc(
            &self.p,
            self.dy.as_slice::<T>()?,
            self.argmax.as_slice()?,
            bufs.out().out_slice::<T>(Self::NAME)?,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let at = (self.dy.cuda_ptr()?, self.argmax.cuda_ptr()?, bufs.out().cuda_ptr()?);
        cuda::max_pool_backward(gpu, &self.p, self.dy.dtype(), at)
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

/// `[n, h, w, c]` and `h * w`, checked: rank 4 (`what` names the tensor) and a nonempty
/// plane.
fn nhwc_plane(op: &'static str, shape: &[usize], what: &str) -> Result<([usize; 4], usize)> {
    let &[n, h, w, c] = shape else {
        return Err(invalid(op, format!("expected {what} [batch, h, w, channels], got {shape:?}")));
    };
    let hw = h.checked_mul(w).unwrap_or(0);
    if hw == 0 {
        return Err(invalid(op, format!("cannot average an empty plane, {what} is {shape:?}")));
    }
    crate::params::product(op, what, shape)?;
    Ok(([n, h, w, c], hw))
}

/// [`global_avg_pool`](super::global_avg_pool) of a channels_last `x: [batch, h, w,
/// channels]`, to `[batch, channels]`: the mean over the h * w positions, as PyTorch's
/// `adaptive_avg_pool2d` to 1x1 is (`input.mean({-1, -2})` in
/// `aten/src/ATen/native/AdaptiveAveragePooling.cpp`, channels_last included). Each channel
/// is added in f32 in position order, in chunks of 64 positions whose sums are then added
/// in chunk order (so that a GPU can run one thread per image, chunk and channel): up to 64
/// positions (ResNet's and MobileNet's 7x7 heads) the NCHW op's result, bit for bit; past
/// that the same terms grouped by chunk, within f32 rounding of it. A GPU adds in the same
/// order; over more than 64 positions it adds the chunks' partial sums (`batch * chunks *
/// channels` f32s) in a workspace.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a rank other than 4 or an empty plane; out of memory.
pub fn global_avg_pool_nhwc(x: &Tensor) -> Result<Tensor> {
    let ([n, _, _, c], hw) = nhwc_plane("global_avg_pool_nhwc", x.shape(), "x")?;
    run(GlobalAvgPoolNhwc { x, n, c, hw, partials: None })
}

struct GlobalAvgPoolNhwc<'a> {
    x: &'a Tensor,
    n: usize,
    c: usize,
    hw: usize,
    /// The chunks' partial sums, with several chunks.
    partials: Option<usize>,
}

impl Op for GlobalAvgPoolNhwc<'_> {
    const NAME: &'static str = "global_avg_pool_nhwc";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        let mut plan = Plan::one(&[self.n, self.c], self.x.dtype());
        let chunks = cpu::nhwc_chunks(self.hw);
        if chunks > 1 {
            self.partials = plan.workspace(self.n * chunks * self.c * 4);
        }
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let (x, y, (hw, c)) = (self.x, bufs.out(), (self.hw, self.c));
        with_dtype!(x.dtype(), T => {
            cpu::global_avg_pool_nhwc(x.as_slice::<T>()?, y.out_slice::<T>(Self::NAME)?, hw, c)
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let partials = bufs.ws(self.partials)?;
        let at = (self.x.cuda_ptr()?, partials, bufs.out().cuda_ptr()?);
        cuda::global_avg_pool(gpu, (self.n, self.hw, self.c), self.x.dtype(), at)
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

/// Gradient of [`global_avg_pool_nhwc`] for an input of `input_shape` (`[batch, h, w,
/// channels]`) from `dy: [batch, channels]`, channels_last: `dx[b, i, j, c] = dy[b, c] / (h
/// * w)`, in f32 with one rounding (the NCHW op's, permuted, bit for bit).
///
/// # Errors
///
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) if `dy` is not `[batch, channels]` of `input_shape`;
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a rank other than 4 or an empty plane; out of memory.
pub fn global_avg_pool_backward_nhwc(dy: &Tensor, input_shape: &[usize]) -> Result<Tensor> {
    const OP: &str = "global_avg_pool_backward_nhwc";
    let (shape, hw) = nhwc_plane(OP, input_shape, "the input")?;
    expect_shape(OP, &[shape[0], shape[3]], dy)?;
    run(GlobalAvgPoolBackwardNhwc { dy, shape, hw })
}

/// [`global_avg_pool_backward_nhwc`] added into the channels_last `acc: [batch, h, w,
/// channels]` in place, without materializing it: `acc[b, i, j, c] += dy[b, c] / (h * w)`,
/// in f32 with one rounding (the NCHW op's, permuted, bit for bit). Allocates nothing,
/// unless `acc` shares its storage and is copied first.
///
/// # Errors
///
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) if `dy` is not `[batch, channels]` of `acc`,
/// [`Error::DTypeMismatch`](crate::Error::DTypeMismatch), [`Error::DeviceMismatch`](crate::Error::DeviceMismatch); [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a
/// rank other than 4 or an empty plane; out of memory (copying a shared `acc`). `acc` is
/// unchanged then.
pub fn global_avg_pool_backward_add_nhwc(acc: &mut Tensor, dy: &Tensor) -> Result<()> {
    const OP: &str = "global_avg_pool_backward_add_nhwc";
    let ([n, _, _, c], hw) = nhwc_plane(OP, acc.shape(), "acc")?;
    same_kind(OP, acc, dy)?;
    expect_shape(OP, &[n, c], dy)?;
    run(GlobalAvgPoolBackwardAddNhwc { acc, dy, c, hw })
}

/// `out (+)= dy / hw` broadcast over the positions of a channels_last `out: [n, hw, c]` on
/// the host.
fn broadcast_host(
    op: &'static str,
    dy: &Tensor,
    out: &mut Tensor,
    c: usize,
    hw: usize,
    add: bool,
) -> Result<()> {
    with_dtype!(dy.dtype(), T => {
        let out = if add { out.as_mut_slice::<T>()? } else { out.out_slice::<T>(op)? };
        cpu::global_avg_pool_backward_nhwc(dy.as_slice::<T>()?, out, hw, c, add)
    })
}

/// The global average pool's gradient, into a new tensor.
struct GlobalAvgPoolBackwardNhwc<'a> {
    dy: &'a Tensor,
    /// The pool's input shape, `[n, h, w, c]`.
    shape: [usize; 4],
    hw: usize,
}

impl Op for GlobalAvgPoolBackwardNhwc<'_> {
    const NAME: &'static str = "global_avg_pool_backward_nhwc";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.dy.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        Ok(Plan::one(&self.shape, self.dy.dtype()))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        broadcast_host(Self::NAME, self.dy, bufs.out(), self.shape[3], self.hw, false)
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let dims = (self.shape[0], self.hw, self.shape[3]);
        let at = (self.dy.cuda_ptr()?, bufs.out().cuda_ptr()?);
        cuda::global_avg_pool_backward(gpu, dims, self.dy.dtype(), at, false)
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

/// The global average pool's gradient added into `acc`, in place.
struct GlobalAvgPoolBackwardAddNhwc<'a> {
    acc: &'a mut Tensor,
    dy: &'a Tensor,
    c: usize,
    hw: usize,
}

impl Op for GlobalAvgPoolBackwardAddNhwc<'_> {
    const NAME: &'static str = "global_avg_pool_backward_add_nhwc";
    type Outs = ();
    type Output = ();

    fn device(&self) -> &Device {
        self.dy.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        self.acc.make_unique()?;
        Ok(Plan::none())
    }

    fn host(&mut self, _: &mut Buffers<Self::Outs>) -> Result<()> {
        broadcast_host(Self::NAME, self.dy, self.acc, self.c, self.hw, true)
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, _: &mut Buffers<Self::Outs>) -> Result<()> {
        let dims = (self.acc.shape()[0], self.hw, self.c);
        let at = (self.dy.cuda_ptr()?, self.acc.cuda_ptr()?);
        cuda::global_avg_pool_backward(gpu, dims, self.dy.dtype(), at, true)
    }

    fn finish(self, _: Buffers<Self::Outs>) -> Result<()> {
        Ok(())
    }
}

/// The CUDA side, on device addresses through [`Exec`](crate::cuda::Exec), so that the tests
/// run it on the host emulation too. Each launch is one thread per element (or per image,
/// chunk and channel), grid-stride, the channel fastest.
#[cfg(feature = "cuda")]
mod cuda {
    use crate::cpu::elementwise::COLUMN_SUM_ROWS;
    use crate::cpu::pool::nhwc_chunks;
    use crate::cuda::launch::{PoolGeom, elementwise as grid};
    use crate::cuda::registry::{
        GLOBAL_AVG_POOL_NHWC, GLOBAL_AVG_POOL_NHWC_BWD, GLOBAL_AVG_POOL_NHWC_FINISH, MAX_POOL_NHWC,
        MAX_POOL_NHWC_BWD,
    };
    use crate::cuda::{Arg, Exec};
    use crate::dtype::DType;
    use crate::error::Result;
    use crate::params::Pool2dParams;

    /// The max pool of the channels_last input at `x` (the NCHW geometry `p`, dtype `t`)
    /// into `y` and `arg`, both `[batch, oh, ow, channels]`.
    pub(super) fn max_pool(
        e: &impl Exec,
        p: &Pool2dParams,
        t: DType,
        (x, y, arg): (u64, u64, u64),
    ) -> Result<()> {
        let (oh, ow) = p.output_hw();
        // SAFETY: max_pool_nhwc_T(const T* x, T* y, u32* arg, PoolGeom g, Div c, Div ow, Div
        // oh), grid-stride over the output's elements; x holds the input the geometry
        // describes (channels_last), y and arg its output's elements.
        unsafe {
            e.launch(
                MAX_POOL_NHWC.of(t),
                grid(p.output_len()),
                &[
                    Arg::Ptr(x),
                    Arg::Ptr(y),
                    Arg::Ptr(arg),
                    Arg::Pool(PoolGeom::of(p)),
                    Arg::div(p.channels()),
                    Arg::div(ow),
                    Arg::div(oh),
                ],
            )
        }
    }

    /// The max pool's gradient into the channels_last `dx` at `dx`, from `dy` and `arg`
    /// (`[batch, oh, ow, channels]`).
    pub(super) fn max_pool_backward(
        e: &impl Exec,
        p: &Pool2dParams,
        t: DType,
        (dy, arg, dx): (u64, u64, u64),
    ) -> Result<()> {
        let n = p.input_len();
        if n == 0 {
            return Ok(());
        }
        let (sh, sw) = p.stride();
        // SAFETY: max_pool_nhwc_bwd_T(const T* dy, const u32* arg, T* dx, PoolGeom g, Div c,
        // Div w, Div h, Div sh, Div sw), one thread per element of dx (the input's size);
        // dy and arg hold the output's elements; indices >= h * w match no element.
        unsafe {
            e.launch(
                MAX_POOL_NHWC_BWD.of(t),
                grid(n),
                &[
                    Arg::Ptr(dy),
                    Arg::Ptr(arg),
                    Arg::Ptr(dx),
                    Arg::Pool(PoolGeom::of(p)),
                    Arg::div(p.channels()),
                    Arg::div(p.w()),
                    Arg::div(p.h()),
                    Arg::div(sh),
                    Arg::div(sw),
                ],
            )
        }
    }

    /// The global average pool of the channels_last `[n, hw, c]` at `x` into `y: [n, c]`,
    /// through `partials` (`n * chunks * c` f32s) when the positions span several chunks.
    pub(super) fn global_avg_pool(
        e: &impl Exec,
        (n, hw, c): (usize, usize, usize),
        t: DType,
        (x, partials, y): (u64, u64, u64),
    ) -> Result<()> {
        let chunks = nhwc_chunks(hw);
        let total = n * chunks * c;
        if total == 0 {
            return Ok(());
        }
        // SAFETY: global_avg_pool_nhwc_T(const T* x, float* partial, T* y, u64 total, Div c,
        // Div chunks, u64 hw, u64 rows), one thread per (image, chunk, channel); x holds n *
        // hw * c elements, y n * c, the partials (read only with several chunks) total f32s.
        unsafe {
            e.launch(
                GLOBAL_AVG_POOL_NHWC.of(t),
                grid(total),
                &[
                    Arg::Ptr(x),
                    Arg::Ptr(partials),
                    Arg::Ptr(y),
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
        // SAFETY: global_avg_pool_nhwc_finish_T(const float* partial, T* y, u64 total, Div c,
        // u64 chunks, u64 hw), one thread per element of y (n * c); the partials hold n *
        // chunks * c f32s, written by the launch above (ordered before on the stream).
        unsafe {
            e.launch(
                GLOBAL_AVG_POOL_NHWC_FINISH.of(t),
                grid(n * c),
                &[
                    Arg::Ptr(partials),
                    Arg::Ptr(y),
                    Arg::count(n * c),
                    Arg::div(c),
                    Arg::count(chunks),
                    Arg::count(hw),
                ],
            )
        }
    }

    /// `dx (+)= dy / hw` over the channels_last `[n, hw, c]` at `dx`, from `dy: [n, c]`.
    pub(super) fn global_avg_pool_backward(
        e: &impl Exec,
        (n, hw, c): (usize, usize, usize),
        t: DType,
        (dy, dx): (u64, u64),
        add: bool,
    ) -> Result<()> {
        let total = n * hw * c;
        if total == 0 {
            return Ok(());
        }
        // SAFETY: global_avg_pool_nhwc_bwd_T(const T* dy, T* dx, u64 n, Div c, Div hwc, float
        // hw, u32 add), grid-stride over dx's total elements; dy holds total / hw.
        unsafe {
            e.launch(
                GLOBAL_AVG_POOL_NHWC_BWD.of(t),
                grid(total),
                &[
                    Arg::Ptr(dy),
                    Arg::Ptr(dx),
                    Arg::count(total),
                    Arg::div(c),
                    Arg::div(hw * c),
                    Arg::F32(hw as f32),
                    Arg::U32(u32::from(add)),
                ],
            )
        }
    }
}

/// The CUDA code above on the host emulation, against the host ops: bit for bit (the same
/// comparisons, the same sums in the same order, one rounding), over one chunk of positions
/// and several, odd sizes, padding, overlapping windows, one channel, 1x1 planes, ties and
/// NaN.
#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;
    use crate::cpu::elementwise::COLUMN_SUM_ROWS;
    use crate::cuda::emulate::Emulator;
    use crate::cuda::emulated_kernels::values;
    use crate::cuda::registry::MAX_POOL_NHWC;
    use crate::dtype::{DType, Element};
    use half::{bf16, f16};

    fn host() -> Device {
        Device::host(1 << 28)
    }

    fn addr<T>(v: &mut [T]) -> u64 {
        v.as_mut_ptr() as u64
    }

    /// Each value's f32 bits: equal values (and the same NaN) compare equal.
    fn bits<T: Element>(v: &[T]) -> Vec<u32> {
        v.iter().map(|v| v.to_f32().to_bits()).collect()
    }

    /// `n` values in [-2, 2) on a grid of 1/4 (ties in every window of a few), NaN where
    /// `nan` says.
    fn grid_values(n: usize, seed: u64, nan: impl Fn(usize) -> bool) -> Vec<f32> {
        let v = values(n, seed, -2.0, 2.0);
        v.iter()
            .enumerate()
            .map(|(i, &v)| if nan(i) { f32::NAN } else { (v * 4.0).round() / 4.0 })
            .collect()
    }

    fn max_pool_of<T: Element>(e: &Emulator) {
        let t = T::DTYPE;
        let cases = [
            ([2, 5, 7, 3], Pool2dOptions::new((3, 3), (2, 2)).padding((1, 1))),
            ([1, 4, 4, 1], Pool2dOptions::new((2, 2), (2, 2))),
            ([2, 6, 5, 33], Pool2dOptions::new((3, 2), (1, 2)).padding((1, 1))),
            ([1, 1, 1, 4], Pool2dOptions::new((1, 1), (1, 1))),
            ([3, 9, 8, 5], Pool2dOptions::new((3, 3), (2, 1)).padding((1, 0))),
        ];
        for (case, (shape, opts)) in cases.iter().enumerate() {
            let n: usize = shape.iter().product();
            let xv = grid_values(n, case as u64, |i| i % 17 == 3);
            let d = host();
            let x = Tensor::from_f32_slice(&d, shape, &xv, t).unwrap();
            let (want_y, want_arg) = max_pool2d_nhwc(&x, opts).unwrap();
            let p = pool2d_params(&nchw_of("test", shape).unwrap(), opts).unwrap();
            let mut xe = x.to_vec::<T>().unwrap();
            let mut y = vec![T::from_f32(7.0); p.output_len()];
            let mut arg = vec![u32::MAX; p.output_len()];
            cuda::max_pool(e, &p, t, (addr(&mut xe), addr(&mut y), addr(&mut arg))).unwrap();
            let what = format!("max_pool2d_nhwc {t:?} {shape:?}");
            assert_eq!(bits(&y), bits(&want_y.to_vec::<T>().unwrap()), "{what}");
            assert_eq!(arg, want_arg.as_slice().unwrap(), "{what} argmax");

            let dyv = grid_values(p.output_len(), 40 + case as u64, |_| false);
            let dy = Tensor::from_f32_slice(&d, want_y.shape(), &dyv, t).unwrap();
            let want = max_pool2d_backward_nhwc(&dy, &want_arg, shape, opts).unwrap();
            let mut dye = dy.to_vec::<T>().unwrap();
            let mut dx = vec![T::from_f32(f32::NAN); n];
            let at = (addr(&mut dye), addr(&mut arg), addr(&mut dx));
            cuda::max_pool_backward(e, &p, t, at).unwrap();
            assert_eq!(bits(&dx), bits(&want.to_vec::<T>().unwrap()), "{what} backward");
        }
    }

    fn global_avg_pool_of<T: Element>(e: &Emulator) {
        let t = T::DTYPE;
        // One chunk of positions, two (the second cut short), three; one channel; 1x1.
        for (case, shape) in
            [[2, 7, 7, 5], [2, 9, 10, 3], [3, 13, 11, 2], [2, 8, 9, 1], [1, 1, 1, 4]]
                .iter()
                .enumerate()
        {
            let [n, h, w, c] = *shape;
            let hw = h * w;
            let xv = values(n * hw * c, 50 + case as u64, -2.0, 2.0);
            let d = host();
            let x = Tensor::from_f32_slice(&d, shape, &xv, t).unwrap();
            let want = global_avg_pool_nhwc(&x).unwrap();
            let chunks = hw.div_ceil(COLUMN_SUM_ROWS);
            let mut xe = x.to_vec::<T>().unwrap();
            let mut partials = vec![f32::NAN; if chunks > 1 { n * chunks * c } else { 0 }];
            let mut y = vec![T::from_f32(f32::NAN); n * c];
            let at = (addr(&mut xe), addr(&mut partials), addr(&mut y));
            cuda::global_avg_pool(e, (n, hw, c), t, at).unwrap();
            let what = format!("global_avg_pool_nhwc {t:?} {shape:?}");
            assert_eq!(bits(&y), bits(&want.to_vec::<T>().unwrap()), "{what}");

            let dyv = values(n * c, 60 + case as u64, -2.0, 2.0);
            let dy = Tensor::from_f32_slice(&d, &[n, c], &dyv, t).unwrap();
            let want = global_avg_pool_backward_nhwc(&dy, shape).unwrap();
            let mut dye = dy.to_vec::<T>().unwrap();
            let mut dx = vec![T::from_f32(f32::NAN); n * hw * c];
            cuda::global_avg_pool_backward(
                e,
                (n, hw, c),
                t,
                (addr(&mut dye), addr(&mut dx)),
                false,
            )
            .unwrap();
            assert_eq!(bits(&dx), bits(&want.to_vec::<T>().unwrap()), "{what} backward");

            let mut acc = Tensor::from_f32_slice(&d, shape, &xv, t).unwrap();
            let mut acc_e = acc.to_vec::<T>().unwrap();
            global_avg_pool_backward_add_nhwc(&mut acc, &dy).unwrap();
            cuda::global_avg_pool_backward(
                e,
                (n, hw, c),
                t,
                (addr(&mut dye), addr(&mut acc_e)),
                true,
            )
            .unwrap();
            assert_eq!(bits(&acc_e), bits(&acc.to_vec::<T>().unwrap()), "{what} backward_add");
        }
    }

    #[test]
    fn emulated_nhwc_pool_kernels_match_the_host_bit_for_bit() {
        let Some(e) = Emulator::new(MAX_POOL_NHWC.of(DType::F32)) else { return };
        max_pool_of::<f32>(&e);
        max_pool_of::<f16>(&e);
        max_pool_of::<bf16>(&e);
        global_avg_pool_of::<f32>(&e);
        global_avg_pool_of::<f16>(&e);
        global_avg_pool_of::<bf16>(&e);
    }
}
