//! 2-D convolution (NCHW, with groups, so depthwise convolutions too), forward and backward.
//!
//! On CUDA a convolution is im2col (`conv.cu`) plus one cuBLAS product per channel group,
//! batched over the images of a chunk whose im2col matrices fit [`COL_BUDGET`]; depthwise
//! convolutions, and small ones (at most [`DIRECT_MAX_MACS`](super::DIRECT_MAX_MACS)
//! multiply-adds, see [`Conv2dParams::is_direct`]), use direct kernels that need no buffer
//! at all, which keeps a small model's peak from being its largest im2col matrix (`kh * kw`
//! times the convolution's input). The plan allocates those im2col buffers and the f32
//! accumulators of 16-bit gradients (an f32 weight gradient accumulates over the images in
//! place) on every backend, so the host's figures are the GPU's. When the im2col
//! buffer does not fit in the memory left, the convolution asks for half as many images,
//! down to one, rather than failing (as PyTorch falls back to a cuDNN algorithm with a
//! smaller workspace; `Plan::chunked_workspace` in `dispatch`).

use super::dispatch::{Buffers, Op, Plan, run};
use super::params::{Conv2dOptions, Conv2dParams};
use super::{expect_rank, expect_shape, same_kind};
use crate::cpu::conv as cpu;
use crate::device::Device;
use crate::dtype::{DType, with_dtype};
use crate::error::Result;
use crate::tensor::Tensor;

/// Most bytes an im2col buffer may take; the batch is processed in chunks of images that
/// fit (at least one image per chunk).
const COL_BUDGET: usize = 256 << 20;

/// Images per chunk for a per-image buffer of `per_image` bytes.
fn chunk_images(p: &Conv2dParams, per_image: usize) -> usize {
    (COL_BUDGET / per_image.max(1)).clamp(1, p.batch().max(1))
}

/// The full geometry of a convolution of input shape `x: [batch, c_in, h, w]` with weight
/// shape `weight: [c_out, c_in / groups, kh, kw]`; the output is `[batch, c_out, oh, ow]`
/// with `(oh, ow) = params.output_hw()` (see [`Conv2dParams::new`]).
///
/// # Errors
///
/// As [`Conv2dParams::new`].
pub fn conv2d_params(x: &[usize], weight: &[usize], opts: &Conv2dOptions) -> Result<Conv2dParams> {
    Conv2dParams::new(x, weight, opts)
}

/// `conv2d(x, weight) + bias` with `x: [batch, c_in, h, w]`,
/// `weight: [c_out, c_in / groups, kh, kw]`, `bias: [c_out]`; the result is
/// `[batch, c_out, oh, ow]`. An input with no element (no input channels, or an empty plane
/// under padding) gives the bias (or zeros).
///
/// # Errors
///
/// As [`conv2d_params`]; dtype and device mismatches; out of memory.
pub fn conv2d(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    opts: &Conv2dOptions,
) -> Result<Tensor> {
    let p = conv2d_params(x.shape(), weight.shape(), opts)?;
    run(Conv2d { p, x, weight, bias, col: None, chunk: 1 })
}

struct Conv2d<'a> {
    p: Conv2dParams,
    x: &'a Tensor,
    weight: &'a Tensor,
    bias: Option<&'a Tensor>,
    /// The im2col buffer of `chunk` images.
    col: Option<usize>,
    chunk: usize,
}

impl Op for Conv2d<'_> {
    const NAME: &'static str = "conv2d";
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan> {
        let p = &self.p;
        same_kind(Self::NAME, self.x, self.weight)?;
        if let Some(bias) = self.bias {
            same_kind(Self::NAME, self.x, bias)?;
            expect_shape(Self::NAME, &[p.c_out()], bias)?;
        }
        let mut plan = Plan::one(&p.output_shape(), self.x.dtype());
        if p.output_len() == 0 || self.x.numel() == 0 || p.is_direct() {
            return Ok(plan);
        }
        let (oh, ow) = p.output_hw();
        let col_bytes = p.col_rows() * oh * ow * self.x.dtype().size_in_bytes();
        self.chunk = chunk_images(p, col_bytes);
        if !p.is_pointwise() {
            self.col = plan.chunked_workspace(col_bytes, self.chunk);
        }
        plan.blas();
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers) -> Result<()> {
        with_dtype!(self.x.dtype(), T => cpu::conv2d(
            &self.p,
            self.x.as_slice::<T>()?,
            self.weight.as_slice::<T>()?,
            self.bias.map(|b| b.as_slice::<T>()).transpose()?,
            bufs.out(0).out_slice::<T>(Self::NAME)?,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers) -> Result<()> {
        let col = (bufs.ws(self.col)?, bufs.chunks(self.col).unwrap_or(self.chunk));
        cuda::forward(gpu, &self.p, self.x, self.weight, self.bias, bufs.out(0), col)
    }

    fn finish(self, bufs: Buffers) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

/// Gradients of a 2-D convolution.
#[derive(Debug)]
pub struct Conv2dGrads {
    /// Gradient of the input, `x`'s shape.
    pub dx: Tensor,
    /// Gradient of the weight, the weight's shape.
    pub dweight: Tensor,
    /// Gradient of the bias, `[c_out]`, when asked for.
    pub dbias: Option<Tensor>,
}

/// Gradients of [`conv2d`] from the forward input `x`, the `weight` and the upstream `dy`;
/// `dbias` is computed when `with_bias`.
///
/// # Errors
///
/// As [`conv2d`], and [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) if `dy` is not
/// the output's shape.
pub fn conv2d_backward(
    x: &Tensor,
    weight: &Tensor,
    dy: &Tensor,
    opts: &Conv2dOptions,
    with_bias: bool,
) -> Result<Conv2dGrads> {
    let p = conv2d_params(x.shape(), weight.shape(), opts)?;
    run(Conv2dBackward { p, x, weight, dy, with_bias, ws: BackwardWorkspaces::default() })
}

struct Conv2dBackward<'a> {
    p: Conv2dParams,
    x: &'a Tensor,
    weight: &'a Tensor,
    dy: &'a Tensor,
    with_bias: bool,
    ws: BackwardWorkspaces,
}

/// The workspaces of a convolution's backward on the GPU.
#[derive(Clone, Copy, Debug, Default)]
struct BackwardWorkspaces {
    /// Images per chunk of `cols`.
    chunk: usize,
    /// im2col matrices (of the input, or of the input's gradient in f32) of `chunk` images.
    cols: Option<usize>,
    /// The weight gradient in f32, for 16-bit weights (f32 ones accumulate in place).
    dweight: Option<usize>,
    /// Per-(image, channel) sums of `dy`, f32.
    plane_sums: Option<usize>,
    /// The bias gradient in f32.
    dbias: Option<usize>,
}

impl Op for Conv2dBackward<'_> {
    const NAME: &'static str = "conv2d_backward";
    type Output = Conv2dGrads;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan> {
        let p = &self.p;
        let (x, w, dy) = (self.x, self.weight, self.dy);
        same_kind(Self::NAME, x, w)?;
        same_kind(Self::NAME, x, dy)?;
        expect_rank(Self::NAME, dy, 4, "dy [batch, c_out, oh, ow]")?;
        expect_shape(Self::NAME, &p.output_shape(), dy)?;
        // With no output element, or no input element, nothing flows to dx and dweight.
        let nothing = dy.numel() == 0 || x.numel() == 0;
        let mut plan = Plan::default();
        let dtype = x.dtype();
        if nothing {
            plan.zeroed_output(x.shape(), dtype);
            plan.zeroed_output(w.shape(), dtype);
        } else {
            plan.output(x.shape(), dtype);
            plan.output(w.shape(), dtype);
        }
        if self.with_bias {
            if dy.numel() == 0 {
                plan.zeroed_output(&[p.c_out()], dtype);
            } else {
                plan.output(&[p.c_out()], dtype);
            }
        }
        if !nothing && !p.is_direct() {
            let (oh, ow) = p.output_hw();
            // One buffer serves the f32 input-gradient columns, then the input's columns.
            let per_image = p.col_rows() * oh * ow * 4;
            self.ws.chunk = chunk_images(p, per_image);
            if !p.is_pointwise() {
                self.ws.cols = plan.chunked_workspace(per_image, self.ws.chunk);
            }
            // An f32 weight gradient accumulates over the images in place (the first image's
            // product overwrites); a 16-bit one in an f32 buffer, rounded once.
            if dtype != DType::F32 {
                self.ws.dweight = plan.zeroed_workspace(w.numel() * 4);
            }
            plan.blas();
        }
        if self.with_bias && dy.numel() > 0 {
            self.ws.plane_sums = plan.workspace(p.batch() * p.c_out() * 4);
            self.ws.dbias = plan.workspace(super::reduce::column_sum_workspace(
                Self::NAME,
                p.batch(),
                p.c_out(),
            )?);
        }
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers) -> Result<()> {
        if self.dy.numel() == 0 {
            return Ok(());
        }
        let [dx, dw, rest @ ..] = bufs.outputs_mut() else { unreachable!("planned") };
        with_dtype!(self.x.dtype(), T => cpu::conv2d_backward(
            &self.p,
            self.x.as_slice::<T>()?,
            self.weight.as_slice::<T>()?,
            self.dy.as_slice::<T>()?,
            Some(dx.out_slice::<T>(Self::NAME)?),
            Some(dw.out_slice::<T>(Self::NAME)?),
            rest.first_mut().map(|b| b.out_slice::<T>(Self::NAME)).transpose()?,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers) -> Result<()> {
        let ws = self.ws;
        let (p, x, w, dy) = (&self.p, self.x, self.weight, self.dy);
        if dy.numel() > 0 && x.numel() > 0 {
            if p.is_direct() {
                cuda::direct_backward(gpu, p, x, w, dy, bufs)?;
            } else {
                let cols = (bufs.ws(ws.cols)?, bufs.chunks(ws.cols).unwrap_or(ws.chunk));
                cuda::backward_input(gpu, p, w, dy, bufs.out(0), cols)?;
                let acc = bufs.ws(ws.dweight)?;
                cuda::backward_weight(gpu, p, x, dy, bufs.out(1), cols, acc)?;
            }
        }
        if self.with_bias && dy.numel() > 0 {
            let sums = (bufs.ws(ws.plane_sums)?, bufs.ws(ws.dbias)?);
            crate::cuda::helpers::channel_sums(gpu, dy, p.batch(), sums, bufs.out(2))?;
        }
        Ok(())
    }

    fn finish(self, bufs: Buffers) -> Result<Conv2dGrads> {
        let mut out = bufs.into_outputs();
        let (Some(dx), Some(dweight)) = (out.next(), out.next()) else {
            unreachable!("the plan has dx and dweight")
        };
        Ok(Conv2dGrads { dx, dweight, dbias: out.next() })
    }
}

/// The CUDA side: im2col + cuBLAS per group, or direct kernels.
#[cfg(feature = "cuda")]
mod cuda {
    use super::Buffers;
    use crate::cuda::helpers::{check_rows, from_f32, ptr};
    use crate::cuda::launch::{self, ConvGeom, elementwise as grid};
    use crate::cuda::registry::{
        BIAS_PLANES, COL2IM, DIRECT_BWD_INPUT, DIRECT_BWD_WEIGHT, DIRECT_FWD, IM2COL,
    };
    use crate::cuda::{Arg, Gpu};
    use crate::dtype::DType;
    use crate::error::Result;
    use crate::ops::{Conv2dParams, MatmulSpec};
    use crate::tensor::Tensor;

    /// Sizes of one group's product: `(ohw, k, cin_g, cout_g, hw)`.
    fn dims(p: &Conv2dParams) -> (usize, usize, usize, usize, usize) {
        let (oh, ow) = p.output_hw();
        let cin_g = p.c_in() / p.groups();
        (oh * ow, p.col_rows(), cin_g, p.c_out() / p.groups(), p.h() * p.w())
    }

    /// Fills `col` with the im2col matrices of images `n0 .. n0 + nimg`, group `group`.
    fn im2col(
        gpu: &Gpu<'_>,
        p: &Conv2dParams,
        x: &Tensor,
        col: u64,
        (n0, nimg, group): (usize, usize, usize),
    ) -> Result<()> {
        let (ohw, k, ..) = dims(p);
        check_rows("conv2d", nimg * k)?;
        // SAFETY: im2col_T(const T* x, T* col, ConvGeom g, i64 n0, i64 nimg, i64 group), one
        // block per (image, row); x is the input the geometry describes, col holds
        // nimg * k * ohw elements of T (the plan's chunk of images).
        unsafe {
            gpu.launch(
                IM2COL.of(x.dtype()),
                launch::per_plane(nimg * k, ohw),
                &[
                    ptr(x)?,
                    Arg::Ptr(col),
                    Arg::Conv(ConvGeom::of(p)),
                    Arg::I64(n0 as i64),
                    Arg::I64(nimg as i64),
                    Arg::I64(group as i64),
                ],
            )
        }
    }

    /// `y = conv2d(x, w) + bias`; `y` is nonempty. `col` is the im2col workspace of
    /// `chunk` images (0 for a pointwise or direct convolution).
    pub(super) fn forward(
        gpu: &Gpu<'_>,
        p: &Conv2dParams,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        y: &mut Tensor,
        (col, chunk): (u64, usize),
    ) -> Result<()> {
        let t = x.dtype();
        let n = y.numel();
        if n == 0 {
            return Ok(());
        }
        if x.numel() > 0 && p.is_direct() {
            let (b, has_b) = match bias {
                Some(b) => (ptr(b)?, 1),
                None => (Arg::Ptr(0), 0),
            };
            let (oh, ow) = p.output_hw();
            check_rows("conv2d", p.batch() * p.c_out())?;
            // SAFETY: direct_fwd_T(const T* x, const T* w, const T* b, u32 has_b, T* y,
            // ConvGeom g), one block per output plane; the tensors have the geometry's
            // shapes; b is read only when has_b.
            return unsafe {
                gpu.launch(
                    DIRECT_FWD.of(t),
                    launch::per_plane(p.batch() * p.c_out(), oh * ow),
                    &[ptr(x)?, ptr(w)?, b, Arg::U32(has_b), ptr(y)?, Arg::Conv(ConvGeom::of(p))],
                )
            };
        }
        let (ohw, k, cin_g, cout_g, hw) = dims(p);
        let beta = match bias {
            Some(bias) => {
                // SAFETY: bias_planes_T(const T* b, T* y, u64 n, Div c, Div ohw); y holds
                // n = batch * c_out * ohw elements, bias c_out.
                unsafe {
                    gpu.launch(
                        BIAS_PLANES.of(t),
                        grid(n),
                        &[ptr(bias)?, ptr(y)?, Arg::count(n), Arg::div(p.c_out()), Arg::div(ohw)],
                    )?;
                }
                1.0
            }
            None => 0.0,
        };
        if x.numel() == 0 {
            // Nothing to convolve: the output is the bias, or zeros.
            return if bias.is_some() {
                Ok(())
            } else {
                gpu.zero(y.cuda_ptr()?, y.size_in_bytes())
            };
        }
        let size = t.size_in_bytes();
        let (px, pw, py) = (x.cuda_ptr()?, w.cuda_ptr()?, y.cuda_ptr()?);
        for n0 in (0..p.batch()).step_by(chunk) {
            let nimg = chunk.min(p.batch() - n0);
            for g in 0..p.groups() {
                let (b, stride_b) = if p.is_pointwise() {
                    (px + ((n0 * p.c_in() + g * cin_g) * hw * size) as u64, p.c_in() * hw)
                } else {
                    im2col(gpu, p, x, col, (n0, nimg, g))?;
                    (col, k * ohw)
                };
                let spec = MatmulSpec::new(cout_g, ohw, k)
                    .batched(nimg, 0, stride_b, p.c_out() * ohw)
                    .scaled(1.0, beta);
                // SAFETY: A is group g's weights [cout_g, k] (shared by the images), B the
                // images' [k, ohw] columns, C their [cout_g, ohw] output planes, c_out * ohw
                // apart; all inside x / col, w and y.
                unsafe {
                    gpu.gemm(
                        &spec,
                        pw + (g * cout_g * k * size) as u64,
                        b,
                        py + ((n0 * p.c_out() + g * cout_g) * ohw * size) as u64,
                        t,
                        t,
                    )?;
                }
            }
        }
        Ok(())
    }

    /// Direct gradients of the input (`out(0)`) and the weight (`out(1)`).
    pub(super) fn direct_backward(
        gpu: &Gpu<'_>,
        p: &Conv2dParams,
        x: &Tensor,
        w: &Tensor,
        dy: &Tensor,
        bufs: &mut Buffers,
    ) -> Result<()> {
        let t = x.dtype();
        let (ohw, .., hw) = dims(p);
        let dx = bufs.out(0);
        check_rows("conv2d_backward", p.batch() * p.c_in())?;
        // SAFETY: direct_bwd_input_T(const T* w, const T* dy, T* dx, ConvGeom g), one block
        // per input plane; shapes from the geometry.
        unsafe {
            gpu.launch(
                DIRECT_BWD_INPUT.of(t),
                launch::per_plane(p.batch() * p.c_in(), hw),
                &[ptr(w)?, ptr(dy)?, ptr(dx)?, Arg::Conv(ConvGeom::of(p))],
            )?;
        }
        let dweight = bufs.out(1);
        let taps = dweight.numel();
        check_rows("conv2d_backward", taps)?;
        // SAFETY: direct_bwd_weight_T(const T* x, const T* dy, T* dw, ConvGeom g), one block
        // (whole warps, for its block sum) per weight element; dweight holds
        // c_out * c_in / groups * kh * kw elements.
        unsafe {
            gpu.launch(
                DIRECT_BWD_WEIGHT.of(t),
                launch::per_plane(taps, ohw),
                &[ptr(x)?, ptr(dy)?, ptr(dweight)?, Arg::Conv(ConvGeom::of(p))],
            )
        }
    }

    /// dx: per group, `dcol = W_g^T * dy_g` (f32) into `cols`, gathered back by col2im; for
    /// a pointwise convolution the product is dx itself.
    pub(super) fn backward_input(
        gpu: &Gpu<'_>,
        p: &Conv2dParams,
        w: &Tensor,
        dy: &Tensor,
        dx: &mut Tensor,
        (cols, chunk): (u64, usize),
    ) -> Result<()> {
        let t = w.dtype();
        let size = t.size_in_bytes();
        let (ohw, k, cin_g, cout_g, hw) = dims(p);
        let (pw, pdy, pdx) = (w.cuda_ptr()?, dy.cuda_ptr()?, dx.cuda_ptr()?);
        for n0 in (0..p.batch()).step_by(chunk) {
            let nimg = chunk.min(p.batch() - n0);
            for g in 0..p.groups() {
                let a = pw + (g * cout_g * k * size) as u64;
                let b = pdy + ((n0 * p.c_out() + g * cout_g) * ohw * size) as u64;
                if p.is_pointwise() {
                    let spec = MatmulSpec::new(cin_g, ohw, cout_g).transpose(true, false).batched(
                        nimg,
                        0,
                        p.c_out() * ohw,
                        p.c_in() * hw,
                    );
                    let c = pdx + ((n0 * p.c_in() + g * cin_g) * hw * size) as u64;
                    // SAFETY: W_g^T [cin_g, cout_g] * dy planes [cout_g, hw] -> dx planes,
                    // all inside w, dy and dx.
                    unsafe { gpu.gemm(&spec, a, b, c, t, t)? };
                    continue;
                }
                let spec = MatmulSpec::new(k, ohw, cout_g).transpose(true, false).batched(
                    nimg,
                    0,
                    p.c_out() * ohw,
                    k * ohw,
                );
                // SAFETY: W_g^T [k, cout_g] * dy planes [cout_g, ohw] -> dcol in `cols`,
                // which holds chunk * k * ohw floats.
                unsafe { gpu.gemm(&spec, a, b, cols, t, DType::F32)? };
                check_rows("conv2d_backward", nimg * cin_g)?;
                // SAFETY: col2im_T(const float* dcol, T* dx, ConvGeom g, i64 n0, i64 nimg,
                // i64 group), one block per input plane; dcol as just written, dx the
                // input's shape.
                unsafe {
                    gpu.launch(
                        COL2IM.of(t),
                        launch::per_plane(nimg * cin_g, hw),
                        &[
                            Arg::Ptr(cols),
                            Arg::Ptr(pdx),
                            Arg::Conv(ConvGeom::of(p)),
                            Arg::I64(n0 as i64),
                            Arg::I64(nimg as i64),
                            Arg::I64(g as i64),
                        ],
                    )?;
                }
            }
        }
        Ok(())
    }

    /// dW_g = sum over images of `dy_g * col^T`: for f32 weights accumulated in `dweight`
    /// itself (the first image's product with beta = 0, so `dweight` need not be zeroed;
    /// `acc` unused), for 16-bit ones in the zeroed f32 `acc` and rounded once. The input's
    /// columns go to `cols`.
    pub(super) fn backward_weight(
        gpu: &Gpu<'_>,
        p: &Conv2dParams,
        x: &Tensor,
        dy: &Tensor,
        dweight: &mut Tensor,
        (cols, chunk): (u64, usize),
        acc: u64,
    ) -> Result<()> {
        let t = x.dtype();
        let size = t.size_in_bytes();
        let (ohw, k, cin_g, cout_g, hw) = dims(p);
        let (px, pdy) = (x.cuda_ptr()?, dy.cuda_ptr()?);
        let in_place = t == DType::F32;
        let acc = if in_place { dweight.cuda_ptr()? } else { acc };
        let spec = MatmulSpec::new(cout_g, k, ohw).transpose(false, true);
        for n0 in (0..p.batch()).step_by(chunk) {
            let nimg = chunk.min(p.batch() - n0);
            for g in 0..p.groups() {
                if !p.is_pointwise() {
                    im2col(gpu, p, x, cols, (n0, nimg, g))?;
                }
                for i in 0..nimg {
                    let n = n0 + i;
                    let b = if p.is_pointwise() {
                        px + ((n * p.c_in() + g * cin_g) * hw * size) as u64
                    } else {
                        cols + (i * k * ohw * size) as u64
                    };
                    let a = pdy + ((n * p.c_out() + g * cout_g) * ohw * size) as u64;
                    let c = acc + (g * cout_g * k * 4) as u64;
                    let beta = if in_place && n == 0 { 0.0 } else { 1.0 };
                    // SAFETY: dy plane block [cout_g, ohw] * columns^T ([k, ohw] stored) ->
                    // the f32 accumulator of group g, [cout_g, k], inside acc (dweight's
                    // f32 elements when in place; with beta = 0 its contents are not read).
                    unsafe { gpu.gemm(&spec.scaled(1.0, beta), a, b, c, t, DType::F32)? };
                }
            }
        }
        if in_place { Ok(()) } else { from_f32(gpu, acc, dweight) }
    }
}
