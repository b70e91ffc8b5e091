//! 2-D convolution (NCHW, with groups, so depthwise convolutions too), forward and backward.
//!
//! On CUDA a convolution is im2col (`conv.cu`) plus one cuBLAS product per channel group,
//! batched over the images of a chunk whose im2col matrices fit [`FORWARD_COL_BUDGET`];
//! the weight gradient is one product per chunk of images (of [`BACKWARD_COL_BUDGET`]) and
//! group, contracting over the chunk's output positions; depthwise convolutions, and small
//! ones (at most [`DIRECT_MAX_MACS`](super::DIRECT_MAX_MACS) multiply-adds, see
//! [`Conv2dParams::is_direct`]), use direct kernels that need no im2col buffer, which keeps
//! a small model's peak from being its largest im2col matrix (`kh * kw` times the
//! convolution's input); a depthwise weight gradient (up to 7 x 7) sums each image's taps in
//! registers, one block per image and channel, into f32 per-image sums that column sums add
//! over the images in order. The plan allocates those buffers and the f32 accumulators of
//! 16-bit weight gradients (an f32 one accumulates in place) on every backend, so the host's
//! figures are the GPU's. When a buffer does not fit in the memory left, the
//! convolution asks for half as many images, down to one, rather than failing (as PyTorch
//! falls back to a cuDNN algorithm with a smaller workspace; `Plan::chunked_workspace` in
//! `dispatch`).
//!
//! On a CUDA device where cuDNN loaded (and unless [`ConvBackend::Own`](crate::ConvBackend)
//! is chosen), a convolution runs through cuDNN instead (`cuda::dnn`): forward, backward data
//! and backward filter, its algorithm chosen as PyTorch does (heuristics, or a timed search
//! with [`Device::set_cudnn_benchmark`]), its workspace taken from the caching allocator for
//! the call and a smaller one tried when it does not fit. The bias stays on the own kernels
//! (written into the output, which cuDNN then adds the convolution to; its gradient summed
//! in f32). That path plans no im2col buffer; the host and virtual devices keep planning the
//! own kernels' workspaces (they cannot ask cuDNN for its sizes), so on a GPU with cuDNN the
//! peak differs from theirs by cuDNN's workspaces against those buffers. The cuDNN path has
//! been compiled and its pure parts tested without a GPU, but it has not yet run on one
//! (`tests/cudnn_vs_host.rs` checks it against the host where one is).
//!
//! [`conv2d_nhwc`] and [`conv2d_backward_nhwc`] take channels_last tensors
//! ([`ConvLayout::Nhwc`]): cuDNN reads them as they are; the own kernels and the host
//! reference permute them to NCHW and the results back (copies that are counted).

use super::dispatch::{Buffers, Op, OutputSpec, Plan, Wanted, run};
use super::{expect_rank, expect_shape, same_kind};
use crate::cpu::conv as cpu;
use crate::cudnn_choices::ConvPass;
use crate::device::ConvSettings;
use crate::device::Device;
use crate::dtype::{DType, with_dtype};
use crate::error::Result;
use crate::params::{Conv2dOptions, Conv2dParams, ConvLayout};
use crate::tensor::Tensor;
use std::marker::PhantomData;

/// Most bytes the forward's im2col buffer may take; the batch is processed in chunks of
/// images that fit (at least one image per chunk).
const FORWARD_COL_BUDGET: usize = 256 << 20;

/// Most bytes the backward's buffer may take (the input gradient's f32 columns, then the
/// weight gradient's operands). Smaller than the forward's: the backward runs while the
/// activations are held and freed one by one, and buffers of many sizes there fragment the
/// cache. Measured on the virtual device (`cargo xtask plan --batch 64`, f32, default
/// allocator): 32 MiB keeps ResNet-50's peak allocated at 5.45 GiB and reserved at
/// 5.56 GiB (64 MiB: 5.46 / 5.55, 256 MiB: 6.29 GiB reserved), MobileNetV3's at 2.77 and
/// 3.16 GiB (64 MiB: 3.32, 256 MiB: 3.57 GiB reserved). The price in time, measured on an
/// H100 (`cuda_conv`, ResNet-50's 53 convolutions at batch 64, f32): backward 62.9 ms at
/// 32 MiB, 58.5 at 64, 55.3 at 128, 54.0 at 256 (cuDNN: 45.9).
const BACKWARD_COL_BUDGET: usize = 32 << 20;

/// Images per chunk for a per-image buffer of `per_image` bytes within `budget`.
fn chunk_images(budget: usize, p: &Conv2dParams, per_image: usize) -> usize {
    (budget / per_image.max(1)).clamp(1, p.batch().max(1))
}

/// Bytes per image of the backward's `cols` workspace in dtype `t`: the f32 columns of the
/// input's gradient (none for a pointwise convolution, whose product is dx itself, and none
/// without dx, `input` false), then,
/// reused, the weight gradient's operands: the input's columns and dy's channels, each with
/// the images' positions as one dimension (`cuda::backward_weight`).
fn backward_cols_per_image(p: &Conv2dParams, t: DType, input: bool) -> usize {
    let (oh, ow) = p.output_hw();
    let (ohw, k, cout_g) = (oh * ow, p.col_rows(), p.c_out() / p.groups());
    let dcol = if p.is_pointwise() || !input { 0 } else { k * ohw * 4 };
    dcol.max((k + cout_g) * ohw * t.size_in_bytes())
}

/// Whether a convolution's weight gradient is the depthwise kernel's (taps in registers,
/// one block per image and channel, then column sums over the images): depthwise, at most
/// 7 x 7 (`DW_MAX_SIDE` in `conv.cu`).
fn depthwise_in_registers(p: &Conv2dParams) -> bool {
    p.is_depthwise() && p.kernel().0 <= 7 && p.kernel().1 <= 7
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
    let cudnn = x.device().cudnn_conv(&p, x.dtype(), ConvLayout::Nchw);
    run(Conv2d { p, x, weight, bias, col: None, chunk: 1, layout: ConvLayout::Nchw, cudnn })
}

/// The shape of a convolution's output in `layout`.
fn output_shape(p: &Conv2dParams, layout: ConvLayout) -> [usize; 4] {
    let [n, c, h, w] = p.output_shape();
    match layout {
        ConvLayout::Nchw => [n, c, h, w],
        ConvLayout::Nhwc => [n, h, w, c],
    }
}

/// The geometry of a channels_last convolution: `x: [batch, h, w, c_in]` and
/// `weight: [c_out, kh, kw, c_in / groups]` (see [`ConvLayout::Nhwc`]).
///
/// # Errors
///
/// As [`conv2d_params`] (a rank other than 4 included).
pub fn conv2d_params_nhwc(
    x: &[usize],
    weight: &[usize],
    opts: &Conv2dOptions,
) -> Result<Conv2dParams> {
    let nchw = |s: &[usize]| match *s {
        [n, h, w, c] => vec![n, c, h, w],
        _ => s.to_vec(),
    };
    conv2d_params(&nchw(x), &nchw(weight), opts)
}

/// NHWC to NCHW, and back.
const TO_NCHW: [usize; 4] = [0, 3, 1, 2];
const TO_NHWC: [usize; 4] = [0, 2, 3, 1];

/// [`conv2d`] on channels_last tensors (PyTorch's `torch.channels_last`):
/// `x: [batch, h, w, c_in]`, `weight: [c_out, kh, kw, c_in / groups]`, `bias: [c_out]`; the
/// result is `[batch, oh, ow, c_out]`. Through cuDNN the tensors are read as they are;
/// elsewhere (own kernels, host, virtual device) `x` and `weight` are permuted to NCHW, the
/// NCHW convolution runs, and its result is permuted back (each a counted copy).
///
/// # Errors
///
/// As [`conv2d`], with the shapes read as NHWC.
pub fn conv2d_nhwc(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    opts: &Conv2dOptions,
) -> Result<Tensor> {
    let p = conv2d_params_nhwc(x.shape(), weight.shape(), opts)?;
    if let Some(cudnn) = x.device().cudnn_conv(&p, x.dtype(), ConvLayout::Nhwc) {
        let layout = ConvLayout::Nhwc;
        return run(Conv2d { p, x, weight, bias, col: None, chunk: 1, layout, cudnn: Some(cudnn) });
    }
    let xc = super::permute(x, &TO_NCHW)?;
    let wc = super::permute(weight, &TO_NCHW)?;
    let y = conv2d(&xc, &wc, bias, opts)?;
    drop((xc, wc));
    super::permute(&y, &TO_NHWC)
}

/// [`conv2d_backward`] on channels_last tensors (see [`conv2d_nhwc`]): `dy` is
/// `[batch, oh, ow, c_out]`; `dx` and `dweight` come back channels_last.
///
/// # Errors
///
/// As [`conv2d_backward`], with the shapes read as NHWC.
pub fn conv2d_backward_nhwc(
    x: &Tensor,
    weight: &Tensor,
    dy: &Tensor,
    opts: &Conv2dOptions,
    with_bias: bool,
) -> Result<Conv2dGrads> {
    let p = conv2d_params_nhwc(x.shape(), weight.shape(), opts)?;
    if let Some(cudnn) = x.device().cudnn_conv(&p, x.dtype(), ConvLayout::Nhwc) {
        return backward(p, x, weight, dy, with_bias, ConvLayout::Nhwc, Some(cudnn));
    }
    let (xc, wc, dyc) = nchw_operands(&p, x, weight, dy)?;
    let g = conv2d_backward(&xc, &wc, &dyc, opts, with_bias)?;
    drop((xc, wc, dyc));
    let dx = super::permute(&g.dx, &TO_NHWC)?;
    drop(g.dx);
    let dweight = super::permute(&g.dweight, &TO_NHWC)?;
    Ok(Conv2dGrads { dx, dweight, dbias: g.dbias })
}

struct Conv2d<'a> {
    p: Conv2dParams,
    x: &'a Tensor,
    weight: &'a Tensor,
    bias: Option<&'a Tensor>,
    /// The im2col buffer of `chunk` images.
    col: Option<usize>,
    chunk: usize,
    /// NHWC only with `cudnn` (the other paths permute around an NCHW convolution).
    layout: ConvLayout,
    /// Runs through cuDNN with these settings.
    cudnn: Option<ConvSettings>,
}

impl Op for Conv2d<'_> {
    const NAME: &'static str = "conv2d";
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        let p = &self.p;
        same_kind(Self::NAME, self.x, self.weight)?;
        if let Some(bias) = self.bias {
            same_kind(Self::NAME, self.x, bias)?;
            expect_shape(Self::NAME, &[p.c_out()], bias)?;
        }
        let mut plan = Plan::one(&output_shape(p, self.layout), self.x.dtype());
        // cuDNN's workspace is asked for, and allocated, when it runs.
        if self.cudnn.is_some() {
            return Ok(plan);
        }
        debug_assert_eq!(self.layout, ConvLayout::Nchw);
        if p.output_len() == 0 || self.x.numel() == 0 || p.is_direct() {
            return Ok(plan);
        }
        let (oh, ow) = p.output_hw();
        let col_bytes = p.col_rows() * oh * ow * self.x.dtype().size_in_bytes();
        self.chunk = chunk_images(FORWARD_COL_BUDGET, p, col_bytes);
        if !p.is_pointwise() {
            self.col = plan.chunked_workspace(col_bytes, self.chunk);
        }
        plan.blas();
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        with_dtype!(self.x.dtype(), T => cpu::conv2d(
            &self.p,
            self.x.as_slice::<T>()?,
            self.weight.as_slice::<T>()?,
            self.bias.map(|b| b.as_slice::<T>()).transpose()?,
            bufs.out().out_slice::<T>(Self::NAME)?,
        ))
    }

    fn on_virtual(&mut self) -> Result<()> {
        let Some(settings) = self.cudnn else { return Ok(()) };
        let (p, dtype, tf32) = (&self.p, self.x.dtype(), settings.allow_tf32);
        self.x.device().replay_cudnn_workspace(ConvPass::Forward, p, dtype, self.layout, tf32)
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        if let Some(settings) = self.cudnn {
            let (x, w, y) = (self.x.cuda_ptr()?, self.weight.cuda_ptr()?, bufs.out().cuda_ptr()?);
            let bias = self.bias.map(Tensor::cuda_ptr).transpose()?;
            let c = cudnn::Conv { p: &self.p, t: self.x.dtype(), layout: self.layout, settings };
            return c.forward(gpu, x, w, bias, y);
        }
        debug_assert_eq!(self.layout, ConvLayout::Nchw);
        let col = (bufs.ws(self.col)?, bufs.chunks(self.col).unwrap_or(self.chunk));
        let f = cuda::Forward {
            x: self.x.cuda_ptr()?,
            w: self.weight.cuda_ptr()?,
            bias: self.bias.map(Tensor::cuda_ptr).transpose()?,
            y: bufs.out().cuda_ptr()?,
        };
        let (p, t) = (&self.p, self.x.dtype());
        if p.output_len() == 0 {
            Ok(())
        } else if self.x.numel() > 0 && p.is_direct() {
            cuda::direct_forward(gpu, p, t, &f)
        } else {
            cuda::forward(gpu, p, t, &f, col)
        }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
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
    let cudnn = x.device().cudnn_conv(&p, x.dtype(), ConvLayout::Nchw);
    backward(p, x, weight, dy, with_bias, ConvLayout::Nchw, cudnn)
}

/// Runs the backward of a convolution of geometry `p` in `layout` (NHWC only through cuDNN,
/// `cudnn` given; the own kernels take NCHW), with the input's gradient when `Dx` is a
/// [`Tensor`], without it when `()`.
fn run_backward<Dx: Wanted>(
    p: Conv2dParams,
    x: &Tensor,
    weight: &Tensor,
    dy: &Tensor,
    with_bias: bool,
    layout: ConvLayout,
    cudnn: Option<ConvSettings>,
) -> Result<(Dx, Tensor, Option<Tensor>)> {
    let ws = BackwardWorkspaces::default();
    run(Conv2dBackward::<Dx> { p, x, weight, dy, with_bias, ws, dx: PhantomData, layout, cudnn })
}

/// [`run_backward`] with the input's gradient.
fn backward(
    p: Conv2dParams,
    x: &Tensor,
    weight: &Tensor,
    dy: &Tensor,
    with_bias: bool,
    layout: ConvLayout,
    cudnn: Option<ConvSettings>,
) -> Result<Conv2dGrads> {
    let (dx, dweight, dbias) = run_backward(p, x, weight, dy, with_bias, layout, cudnn)?;
    Ok(Conv2dGrads { dx, dweight, dbias })
}

/// Gradients of a 2-D convolution's parameters only.
#[derive(Debug)]
pub struct Conv2dWeightGrads {
    /// Gradient of the weight, the weight's shape.
    pub dweight: Tensor,
    /// Gradient of the bias, `[c_out]`, when asked for.
    pub dbias: Option<Tensor>,
}

/// [`conv2d_backward`] without the input's gradient, for a convolution whose input needs
/// none (a network's first layer): as PyTorch's `convolution_backward` with
/// `output_mask = [False, True, with_bias]`, it neither computes nor allocates dx (a
/// ResNet stem's dx is 3 planes of 224 x 224 per image, gathered from 49 taps each).
///
/// # Errors
///
/// As [`conv2d_backward`].
pub fn conv2d_backward_weight(
    x: &Tensor,
    weight: &Tensor,
    dy: &Tensor,
    opts: &Conv2dOptions,
    with_bias: bool,
) -> Result<Conv2dWeightGrads> {
    let p = conv2d_params(x.shape(), weight.shape(), opts)?;
    let cudnn = x.device().cudnn_conv(&p, x.dtype(), ConvLayout::Nchw);
    weight_backward(p, x, weight, dy, with_bias, ConvLayout::Nchw, cudnn)
}

/// [`run_backward`] without the input's gradient.
fn weight_backward(
    p: Conv2dParams,
    x: &Tensor,
    weight: &Tensor,
    dy: &Tensor,
    with_bias: bool,
    layout: ConvLayout,
    cudnn: Option<ConvSettings>,
) -> Result<Conv2dWeightGrads> {
    let ((), dweight, dbias) = run_backward(p, x, weight, dy, with_bias, layout, cudnn)?;
    Ok(Conv2dWeightGrads { dweight, dbias })
}

/// `x`, `weight` and `dy` of the channels_last convolution `p`, `dy` checked, permuted to
/// NCHW for the paths that run NCHW only (each a counted copy).
fn nchw_operands(
    p: &Conv2dParams,
    x: &Tensor,
    weight: &Tensor,
    dy: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    expect_rank("conv2d_backward", dy, 4, "dy [batch, oh, ow, c_out]")?;
    expect_shape("conv2d_backward", &output_shape(p, ConvLayout::Nhwc), dy)?;
    let xc = super::permute(x, &TO_NCHW)?;
    let wc = super::permute(weight, &TO_NCHW)?;
    Ok((xc, wc, super::permute(dy, &TO_NCHW)?))
}

/// [`conv2d_backward_weight`] on channels_last tensors (see [`conv2d_nhwc`]): `dweight`
/// comes back `[c_out, kh, kw, c_in / groups]`.
///
/// # Errors
///
/// As [`conv2d_backward`], with the shapes read as NHWC.
pub fn conv2d_backward_weight_nhwc(
    x: &Tensor,
    weight: &Tensor,
    dy: &Tensor,
    opts: &Conv2dOptions,
    with_bias: bool,
) -> Result<Conv2dWeightGrads> {
    let p = conv2d_params_nhwc(x.shape(), weight.shape(), opts)?;
    if let Some(cudnn) = x.device().cudnn_conv(&p, x.dtype(), ConvLayout::Nhwc) {
        return weight_backward(p, x, weight, dy, with_bias, ConvLayout::Nhwc, Some(cudnn));
    }
    let (xc, wc, dyc) = nchw_operands(&p, x, weight, dy)?;
    let g = conv2d_backward_weight(&xc, &wc, &dyc, opts, with_bias)?;
    drop((xc, wc, dyc));
    let dweight = super::permute(&g.dweight, &TO_NHWC)?;
    Ok(Conv2dWeightGrads { dweight, dbias: g.dbias })
}

/// The backward of a convolution; `Dx` is the input gradient's type: [`Tensor`] when it is
/// computed (the first output), `()` when not.
struct Conv2dBackward<'a, Dx> {
    p: Conv2dParams,
    x: &'a Tensor,
    weight: &'a Tensor,
    dy: &'a Tensor,
    with_bias: bool,
    ws: BackwardWorkspaces,
    dx: PhantomData<Dx>,
    /// NHWC only with `cudnn`.
    layout: ConvLayout,
    /// Runs through cuDNN with these settings.
    cudnn: Option<ConvSettings>,
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
    /// The depthwise weight gradient's per-image sums, `[batch, dw.numel()]` f32, and
    /// their column-sum workspace.
    depthwise: [Option<usize>; 2],
    /// Per-(image, channel) sums of `dy`, f32.
    plane_sums: Option<usize>,
    /// The bias gradient in f32.
    dbias: Option<usize>,
}

impl<Dx: Wanted> Op for Conv2dBackward<'_, Dx> {
    const NAME: &'static str = "conv2d_backward";
    /// dx (when `Dx` is a tensor), dweight, and dbias when asked for.
    type Outs = (Dx, Tensor, Option<Tensor>);
    type Output = (Dx, Tensor, Option<Tensor>);

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        let p = &self.p;
        let (x, w, dy) = (self.x, self.weight, self.dy);
        same_kind(Self::NAME, x, w)?;
        same_kind(Self::NAME, x, dy)?;
        expect_rank(Self::NAME, dy, 4, "dy [batch, c_out, oh, ow]")?;
        expect_shape(Self::NAME, &output_shape(p, self.layout), dy)?;
        // With no output element, or no input element, nothing flows to dx and dweight.
        let nothing = dy.numel() == 0 || x.numel() == 0;
        let dtype = x.dtype();
        let mut plan = Plan::new((
            Dx::plan(OutputSpec::zeroed_if(nothing, x.shape(), dtype)),
            OutputSpec::zeroed_if(nothing, w.shape(), dtype),
            // The bias gradient sums dy: zeros only when dy is empty.
            self.with_bias.then(|| OutputSpec::zeroed_if(dy.numel() == 0, &[p.c_out()], dtype)),
        ));
        // cuDNN's workspaces are asked for, and allocated, when it runs; the own kernels'
        // are planned here.
        let own = self.cudnn.is_none();
        debug_assert!(own <= (self.layout == ConvLayout::Nchw));
        if own && !nothing && depthwise_in_registers(p) {
            let taps = w.numel();
            self.ws.depthwise = [
                plan.workspace(crate::params::mul(
                    Self::NAME,
                    "the weight gradient",
                    p.batch(),
                    taps * 4,
                )?),
                plan.workspace(super::reduce::column_sum_workspace(Self::NAME, p.batch(), taps)?),
            ];
        }
        if own && !nothing && !p.is_direct() {
            // One buffer serves the f32 input-gradient columns, then the weight gradient's
            // operands (the input's columns and dy's channels, over a chunk of images).
            let per_image = backward_cols_per_image(p, dtype, Dx::WANTED);
            self.ws.chunk = chunk_images(BACKWARD_COL_BUDGET, p, per_image);
            self.ws.cols = plan.chunked_workspace(per_image, self.ws.chunk);
            // An f32 weight gradient accumulates over the chunks in place (the first chunk's
            // product overwrites); a 16-bit one in an f32 buffer, rounded once.
            if dtype != DType::F32 {
                self.ws.dweight = plan.workspace(w.numel() * 4);
            }
            plan.blas();
        }
        if self.with_bias && dy.numel() > 0 {
            if self.layout == ConvLayout::Nhwc {
                // Column sums of dy as `[batch * oh * ow, c_out]` rows.
                let rows = dy.numel() / p.c_out();
                self.ws.dbias = plan.workspace(super::reduce::column_sum_workspace(
                    Self::NAME,
                    rows,
                    p.c_out(),
                )?);
            } else {
                self.ws.plane_sums = plan.workspace(p.batch() * p.c_out() * 4);
                self.ws.dbias = plan.workspace(super::reduce::column_sum_workspace(
                    Self::NAME,
                    p.batch(),
                    p.c_out(),
                )?);
            }
        }
        Ok(plan)
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        if self.dy.numel() == 0 {
            return Ok(());
        }
        let (dx, dw, dbias) = bufs.outputs_mut();
        with_dtype!(self.x.dtype(), T => cpu::conv2d_backward(
            &self.p,
            self.x.as_slice::<T>()?,
            self.weight.as_slice::<T>()?,
            self.dy.as_slice::<T>()?,
            dx.get_mut().map(|b| b.out_slice::<T>(Self::NAME)).transpose()?,
            Some(dw.out_slice::<T>(Self::NAME)?),
            dbias.as_mut().map(|b| b.out_slice::<T>(Self::NAME)).transpose()?,
        ))
    }

    fn on_virtual(&mut self) -> Result<()> {
        let Some(settings) = self.cudnn else { return Ok(()) };
        let (p, dtype, tf32, device) =
            (&self.p, self.x.dtype(), settings.allow_tf32, self.x.device());
        if Dx::WANTED {
            device.replay_cudnn_workspace(ConvPass::BackwardData, p, dtype, self.layout, tf32)?;
        }
        device.replay_cudnn_workspace(ConvPass::BackwardFilter, p, dtype, self.layout, tf32)
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        let ws = self.ws;
        let (p, x, w, dy) = (&self.p, self.x, self.weight, self.dy);
        if let Some(settings) = self.cudnn {
            let c = cudnn::Conv { p, t: x.dtype(), layout: self.layout, settings };
            let (xp, wp, dyp) = (x.cuda_ptr()?, w.cuda_ptr()?, dy.cuda_ptr()?);
            let (dx, dw, _) = bufs.outputs_mut();
            let dx = dx.get_mut().map(|dx| dx.cuda_ptr()).transpose()?;
            c.backward(gpu, xp, wp, dyp, dx, dw.cuda_ptr()?)?;
            if self.layout == ConvLayout::Nhwc {
                let (rows, ws_sums) = (dy.numel() / p.c_out(), bufs.ws(ws.dbias)?);
                if let (_, _, Some(dbias)) = bufs.outputs_mut() {
                    crate::cuda::helpers::column_sums(gpu, dyp, dy.dtype(), rows, ws_sums, dbias)?;
                }
                return Ok(());
            }
        } else if dy.numel() > 0 && x.numel() > 0 {
            let (dx, dw, _) = bufs.outputs_mut();
            let b = cuda::Backward {
                x: x.cuda_ptr()?,
                w: w.cuda_ptr()?,
                dy: dy.cuda_ptr()?,
                dx: dx.get_mut().map(|dx| dx.cuda_ptr()).transpose()?,
                dw: dw.cuda_ptr()?,
            };
            let t = x.dtype();
            if p.is_direct() {
                let [partials, sums] = ws.depthwise;
                let depthwise = match partials {
                    Some(_) => Some((bufs.ws(partials)?, bufs.ws(sums)?)),
                    None => None,
                };
                cuda::direct_backward(gpu, p, t, &b, depthwise)?;
            } else {
                let cols = (bufs.ws(ws.cols)?, bufs.chunks(ws.cols).unwrap_or(ws.chunk));
                cuda::backward_input(gpu, p, t, &b, cols)?;
                cuda::backward_weight(gpu, p, t, &b, cols, bufs.ws(ws.dweight)?)?;
            }
        }
        if dy.numel() > 0 {
            // The bias gradient's workspaces (none without a bias), then the output.
            let sums = (bufs.ws(ws.plane_sums)?, bufs.ws(ws.dbias)?);
            if let (_, _, Some(dbias)) = bufs.outputs_mut() {
                crate::cuda::helpers::channel_sums(gpu, dy, p.batch(), sums, dbias)?;
            }
        }
        Ok(())
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Self::Output> {
        Ok(bufs.into_outputs())
    }
}

/// The cuDNN side: one call per direction (`crate::cuda::dnn`). The bias is the own
/// kernels': written into the output before cuDNN adds the convolution to it (beta = 1),
/// and its gradient summed in f32 as on the own path.
#[cfg(feature = "cuda")]
mod cudnn {
    use crate::cuda::dnn::{ConvKey, Pass, Pointers};
    use crate::cuda::launch::elementwise as grid;
    use crate::cuda::registry::BIAS_PLANES;
    use crate::cuda::{Arg, Gpu};
    use crate::device::ConvSettings;
    use crate::dtype::DType;
    use crate::error::Result;
    use crate::params::{Conv2dParams, ConvLayout};

    /// A convolution that runs through cuDNN.
    pub(super) struct Conv<'a> {
        pub(super) p: &'a Conv2dParams,
        pub(super) t: DType,
        pub(super) layout: ConvLayout,
        pub(super) settings: ConvSettings,
    }

    impl Conv<'_> {
        fn key(&self) -> ConvKey {
            ConvKey::new(self.p, self.t, self.layout, self.settings.allow_tf32)
        }

        /// `y = conv(x, w) + bias`: device addresses of tensors of the convolution's shapes in
        /// its layout and dtype.
        pub(super) fn forward(
            &self,
            gpu: &Gpu<'_>,
            x: u64,
            w: u64,
            bias: Option<u64>,
            y: u64,
        ) -> Result<()> {
            let key = self.key();
            let (p, t) = (self.p, self.t);
            let n = p.output_len();
            // Channel of output element i: (i / plane) % c_out in NCHW, i % c_out in NHWC.
            let plane = match self.layout {
                ConvLayout::Nchw => p.output_hw().0 * p.output_hw().1,
                ConvLayout::Nhwc => 1,
            };
            let write_bias = |bias: u64| -> Result<()> {
                // SAFETY: bias_planes_T(const T* b, T* y, u64 n, Div c, Div ohw) writes
                // y[i] = b[(i / ohw) % c] for the n elements of y; bias holds c_out.
                unsafe {
                    gpu.launch(
                        BIAS_PLANES.of(t),
                        grid(n),
                        &[
                            Arg::Ptr(bias),
                            Arg::Ptr(y),
                            Arg::count(n),
                            Arg::div(p.c_out()),
                            Arg::div(plane),
                        ],
                    )
                }
            };
            let blend = bias.map(|b| move || write_bias(b));
            let blend = blend.as_ref().map(|f| f as &dyn Fn() -> Result<()>);
            let ptrs = Pointers { x, w, y };
            // SAFETY: x, w and y are the op's live tensors of the shapes `key` describes
            // (checked by the plan); y is a fresh output.
            unsafe {
                gpu.backend().cudnn_convolution(
                    Pass::Forward,
                    &key,
                    self.settings.benchmark,
                    ptrs,
                    blend,
                )
            }
        }

        /// dx (when asked for) and dw from x, w and dy.
        pub(super) fn backward(
            &self,
            gpu: &Gpu<'_>,
            x: u64,
            w: u64,
            dy: u64,
            dx: Option<u64>,
            dw: u64,
        ) -> Result<()> {
            let key = self.key();
            let cu = gpu.backend();
            let bench = self.settings.benchmark;
            if let Some(dx) = dx {
                let ptrs = Pointers { x: dx, w, y: dy };
                // SAFETY: dx is a fresh output of x's shape; w and dy the op's tensors.
                unsafe { cu.cudnn_convolution(Pass::BackwardData, &key, bench, ptrs, None)? };
            }
            let ptrs = Pointers { x, w: dw, y: dy };
            // SAFETY: dw is a fresh output of w's shape; x and dy the op's tensors.
            unsafe { cu.cudnn_convolution(Pass::BackwardFilter, &key, bench, ptrs, None) }
        }
    }
}

/// The CUDA side: im2col + cuBLAS per group, or direct kernels. It works on device addresses
/// through [`Exec`](crate::cuda::Exec), so that the tests run it on the host emulation too.
#[cfg(feature = "cuda")]
mod cuda {
    use crate::cuda::helpers::{cast, check_rows, column_sums_into};
    use crate::cuda::launch::{self, ConvGeom, elementwise as grid};
    use crate::cuda::registry::{
        BIAS_PLANES, COL2IM, DEPTHWISE_BWD_WEIGHT, DIRECT_BWD_INPUT, DIRECT_BWD_WEIGHT, DIRECT_FWD,
        IM2COL,
    };
    use crate::cuda::{Arg, Exec};
    use crate::dtype::DType;
    use crate::error::Result;
    use crate::ops::{Conv2dOptions, Conv2dParams, MatmulSpec};

    /// Sizes of one group's product: `(ohw, k, cin_g, cout_g, hw)`.
    fn dims(p: &Conv2dParams) -> (usize, usize, usize, usize, usize) {
        let (oh, ow) = p.output_hw();
        let cin_g = p.c_in() / p.groups();
        (oh * ow, p.col_rows(), cin_g, p.c_out() / p.groups(), p.h() * p.w())
    }

    /// Elements of the input `[batch, c_in, h, w]`.
    fn input_len(p: &Conv2dParams) -> usize {
        p.batch() * p.c_in() * p.h() * p.w()
    }

    /// How im2col lays out the matrices of a chunk of images.
    #[derive(Clone, Copy, PartialEq)]
    enum Layout {
        /// `[img][row][pos]`: one `[k, ohw]` matrix per image (forward).
        PerImage,
        /// `[row][img][pos]`: one `[k, nimg * ohw]` matrix whose columns run over every
        /// image's positions (weight gradient).
        RowsOuter,
    }

    /// Fills `col` with the im2col matrices of images `n0 .. n0 + nimg`, group `group`, of
    /// the input at `x` (of dtype `t`) that `p` describes.
    fn im2col(
        e: &impl Exec,
        p: &Conv2dParams,
        t: DType,
        (x, col): (u64, u64),
        (n0, nimg, group): (usize, usize, usize),
        layout: Layout,
    ) -> Result<()> {
        let (ohw, k, ..) = dims(p);
        check_rows("conv2d", nimg * k)?;
        // SAFETY: im2col_T(const T* x, T* col, ConvGeom g, i64 n0, i64 nimg, i64 group,
        // u32 rows_outer), one block per (image, row); x is the input the geometry
        // describes, col holds nimg * k * ohw elements of T (the caller's chunk of images).
        unsafe {
            e.launch(
                IM2COL.of(t),
                launch::per_plane(nimg * k, ohw),
                &[
                    Arg::Ptr(x),
                    Arg::Ptr(col),
                    Arg::Conv(ConvGeom::of(p)),
                    Arg::I64(n0 as i64),
                    Arg::I64(nimg as i64),
                    Arg::I64(group as i64),
                    Arg::U32(u32::from(layout == Layout::RowsOuter)),
                ],
            )
        }
    }

    /// The device addresses of a forward's tensors.
    pub(super) struct Forward {
        pub(super) x: u64,
        pub(super) w: u64,
        pub(super) bias: Option<u64>,
        pub(super) y: u64,
    }

    /// `y = conv2d(x, w) + bias` in dtype `t` by the direct kernel; `x` and `y` are
    /// nonempty.
    pub(super) fn direct_forward(
        e: &impl Exec,
        p: &Conv2dParams,
        t: DType,
        f: &Forward,
    ) -> Result<()> {
        let (b, has_b) = match f.bias {
            Some(b) => (b, 1),
            None => (0, 0),
        };
        check_rows("conv2d", p.batch() * p.c_out())?;
        // SAFETY: direct_fwd_T(const T* x, const T* w, const T* b, u32 has_b, T* y,
        // ConvGeom g), one block per output plane; the tensors have the geometry's shapes;
        // b is read only when has_b.
        unsafe {
            e.launch(
                DIRECT_FWD.of(t),
                launch::per_plane(p.batch() * p.c_out(), dims(p).0),
                &[
                    Arg::Ptr(f.x),
                    Arg::Ptr(f.w),
                    Arg::Ptr(b),
                    Arg::U32(has_b),
                    Arg::Ptr(f.y),
                    Arg::Conv(ConvGeom::of(p)),
                ],
            )
        }
    }

    /// `y = conv2d(x, w) + bias` in dtype `t` by im2col and cuBLAS (or zeros, or the bias,
    /// for an empty input); `y` is nonempty (the op returns before). `col` is the im2col
    /// workspace of `chunk` images (0 for a pointwise convolution).
    pub(super) fn forward(
        e: &impl Exec,
        p: &Conv2dParams,
        t: DType,
        f: &Forward,
        (col, chunk): (u64, usize),
    ) -> Result<()> {
        let n = p.output_len();
        let (ohw, k, cin_g, cout_g, hw) = dims(p);
        let beta = match f.bias {
            Some(bias) => {
                // SAFETY: bias_planes_T(const T* b, T* y, u64 n, Div c, Div ohw); y holds
                // n = batch * c_out * ohw elements, bias c_out.
                unsafe {
                    e.launch(
                        BIAS_PLANES.of(t),
                        grid(n),
                        &[
                            Arg::Ptr(bias),
                            Arg::Ptr(f.y),
                            Arg::count(n),
                            Arg::div(p.c_out()),
                            Arg::div(ohw),
                        ],
                    )?;
                }
                1.0
            }
            None => 0.0,
        };
        if input_len(p) == 0 {
            // Nothing to convolve: the output is the bias, or zeros.
            return if f.bias.is_some() { Ok(()) } else { e.zero(f.y, n * t.size_in_bytes()) };
        }
        let size = t.size_in_bytes();
        for n0 in (0..p.batch()).step_by(chunk) {
            let nimg = chunk.min(p.batch() - n0);
            for g in 0..p.groups() {
                let (b, stride_b) = if p.is_pointwise() {
                    (f.x + ((n0 * p.c_in() + g * cin_g) * hw * size) as u64, p.c_in() * hw)
                } else {
                    im2col(e, p, t, (f.x, col), (n0, nimg, g), Layout::PerImage)?;
                    (col, k * ohw)
                };
                let spec = MatmulSpec::new(cout_g, ohw, k)
                    .batched(nimg, 0, stride_b, p.c_out() * ohw)
                    .scaled(1.0, beta);
                // SAFETY: A is group g's weights [cout_g, k] (shared by the images), B the
                // images' [k, ohw] columns, C their [cout_g, ohw] output planes, c_out * ohw
                // apart; all inside x / col, w and y.
                unsafe {
                    e.gemm(
                        &spec,
                        f.w + (g * cout_g * k * size) as u64,
                        b,
                        f.y + ((n0 * p.c_out() + g * cout_g) * ohw * size) as u64,
                        t,
                        t,
                    )?;
                }
            }
        }
        Ok(())
    }

    /// The device addresses of a backward's tensors.
    pub(super) struct Backward {
        pub(super) x: u64,
        pub(super) w: u64,
        pub(super) dy: u64,
        /// None when dx is not wanted.
        pub(super) dx: Option<u64>,
        pub(super) dw: u64,
    }

    /// Direct gradients of the input (when wanted) and the weight; `depthwise` holds the
    /// depthwise weight gradient's workspaces (per-image sums, column-sum workspace) when it
    /// uses them ([`depthwise_in_registers`](super::depthwise_in_registers)).
    pub(super) fn direct_backward(
        e: &impl Exec,
        p: &Conv2dParams,
        t: DType,
        b: &Backward,
        depthwise: Option<(u64, u64)>,
    ) -> Result<()> {
        let (ohw, .., hw) = dims(p);
        if let Some(dx) = b.dx {
            check_rows("conv2d_backward", p.batch() * p.c_in())?;
            // SAFETY: direct_bwd_input_T(const T* w, const T* dy, T* dx, ConvGeom g), one
            // block per input plane; shapes from the geometry.
            unsafe {
                e.launch(
                    DIRECT_BWD_INPUT.of(t),
                    launch::per_plane(p.batch() * p.c_in(), hw),
                    &[Arg::Ptr(b.w), Arg::Ptr(b.dy), Arg::Ptr(dx), Arg::Conv(ConvGeom::of(p))],
                )?;
            }
        }
        let taps = p.c_out() * p.col_rows();
        if let Some((partials, sums)) = depthwise {
            let planes = p.batch() * p.c_out();
            check_rows("conv2d_backward", planes)?;
            // SAFETY: depthwise_bwd_weight_T(const T* x, const T* dy, float* partial,
            // ConvGeom g), one block per (image, channel) plane of a depthwise convolution
            // of at most 7 x 7; partials holds batch * taps floats.
            unsafe {
                e.launch(
                    DEPTHWISE_BWD_WEIGHT.of(t),
                    launch::per_plane(planes, ohw),
                    &[
                        Arg::Ptr(b.x),
                        Arg::Ptr(b.dy),
                        Arg::Ptr(partials),
                        Arg::Conv(ConvGeom::of(p)),
                    ],
                )?;
            }
            return column_sums_into(e, partials, DType::F32, p.batch(), sums, (b.dw, t, taps));
        }
        check_rows("conv2d_backward", taps)?;
        // SAFETY: direct_bwd_weight_T(const T* x, const T* dy, T* dw, ConvGeom g), one block
        // (whole warps, for its block sum) per weight element; dw holds
        // c_out * c_in / groups * kh * kw elements.
        unsafe {
            e.launch(
                DIRECT_BWD_WEIGHT.of(t),
                launch::per_plane(taps, ohw),
                &[Arg::Ptr(b.x), Arg::Ptr(b.dy), Arg::Ptr(b.dw), Arg::Conv(ConvGeom::of(p))],
            )
        }
    }

    /// dx (when wanted, `b.dx`): per group, `dcol = W_g^T * dy_g` (f32) into `cols`, gathered
    /// back by col2im; for a pointwise convolution the product is dx itself.
    pub(super) fn backward_input(
        e: &impl Exec,
        p: &Conv2dParams,
        t: DType,
        b: &Backward,
        (cols, chunk): (u64, usize),
    ) -> Result<()> {
        let Some(dx) = b.dx else { return Ok(()) };
        let size = t.size_in_bytes();
        let (ohw, k, cin_g, cout_g, hw) = dims(p);
        for n0 in (0..p.batch()).step_by(chunk) {
            let nimg = chunk.min(p.batch() - n0);
            for g in 0..p.groups() {
                let a = b.w + (g * cout_g * k * size) as u64;
                let dy = b.dy + ((n0 * p.c_out() + g * cout_g) * ohw * size) as u64;
                if p.is_pointwise() {
                    let spec = MatmulSpec::new(cin_g, ohw, cout_g).transpose(true, false).batched(
                        nimg,
                        0,
                        p.c_out() * ohw,
                        p.c_in() * hw,
                    );
                    let c = dx + ((n0 * p.c_in() + g * cin_g) * hw * size) as u64;
                    // SAFETY: W_g^T [cin_g, cout_g] * dy planes [cout_g, hw] -> dx planes,
                    // all inside w, dy and dx.
                    unsafe { e.gemm(&spec, a, dy, c, t, t)? };
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
                unsafe { e.gemm(&spec, a, dy, cols, t, DType::F32)? };
                check_rows("conv2d_backward", nimg * cin_g)?;
                // SAFETY: col2im_T(const float* dcol, T* dx, ConvGeom g, i64 n0, i64 nimg,
                // i64 group), one block per input plane; dcol as just written, dx the
                // input's shape.
                unsafe {
                    e.launch(
                        COL2IM.of(t),
                        launch::per_plane_split(nimg * cin_g, hw),
                        &[
                            Arg::Ptr(cols),
                            Arg::Ptr(dx),
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

    /// dW_g = dy_g * col^T with the images' positions as one contracted dimension: per chunk
    /// of images and group, im2col writes the input's columns `[k, nimg * ohw]` and dy's
    /// group channels `[cout_g, nimg * ohw]` (a 1x1 im2col over dy's planes) into `cols`,
    /// rows outermost, and one product adds the chunk's share. For f32 weights the products
    /// accumulate in `dw` itself, for 16-bit ones in the f32 `acc` (rounded once at the
    /// end); the first chunk's product has beta = 0, so neither need be zeroed. One product
    /// per chunk rather than one per image: a batch of 64 at ResNet-50's 7x7 planes made
    /// 64 products contracting 49 positions, each reading and writing all of C.
    pub(super) fn backward_weight(
        e: &impl Exec,
        p: &Conv2dParams,
        t: DType,
        b: &Backward,
        (cols, chunk): (u64, usize),
        acc: u64,
    ) -> Result<()> {
        let size = t.size_in_bytes();
        let (ohw, k, _, cout_g, _) = dims(p);
        let (oh, ow) = p.output_hw();
        // dy's planes as the input of a 1x1 convolution: its im2col rows are dy's channels.
        let dy_planes = Conv2dParams::new(
            &[p.batch(), p.c_out(), oh, ow],
            &[p.c_out(), cout_g, 1, 1],
            &Conv2dOptions::default().groups(p.groups()),
        )?;
        let in_place = t == DType::F32;
        let acc = if in_place { b.dw } else { acc };
        for n0 in (0..p.batch()).step_by(chunk) {
            let nimg = chunk.min(p.batch() - n0);
            let dy_rows = cols + (k * nimg * ohw * size) as u64;
            let beta = if n0 == 0 { 0.0 } else { 1.0 };
            let spec = MatmulSpec::new(cout_g, k, nimg * ohw).transpose(false, true);
            for g in 0..p.groups() {
                im2col(e, p, t, (b.x, cols), (n0, nimg, g), Layout::RowsOuter)?;
                im2col(e, &dy_planes, t, (b.dy, dy_rows), (n0, nimg, g), Layout::RowsOuter)?;
                // SAFETY: dy's rows [cout_g, nimg * ohw] * columns^T ([k, nimg * ohw] stored)
                // -> group g's [cout_g, k] block of the f32 accumulator (dw's own elements
                // when in place; with beta = 0 its contents are not read); both operands
                // inside `cols`, which holds chunk * (k + cout_g) * ohw elements of T.
                unsafe {
                    e.gemm(
                        &spec.scaled(1.0, beta),
                        dy_rows,
                        cols,
                        acc + (g * cout_g * k * 4) as u64,
                        t,
                        DType::F32,
                    )?;
                }
            }
        }
        if in_place { Ok(()) } else { cast(e, acc, DType::F32, b.dw, t, p.c_out() * k) }
    }

    /// The CUDA code above on the host emulation ([`Emulator`]), against the host's
    /// convolution: every layout, chunk and group loop, without a GPU.
    #[cfg(test)]
    mod tests {
        use super::*;
        use crate::cuda::emulate::Emulator;
        use crate::cuda::emulated_kernels::values;
        use crate::dtype::Element;
        use half::{bf16, f16};

        /// Words after a workspace that nothing may write.
        const GUARD: usize = 64;

        /// A workspace of `bytes` bytes (8-byte aligned) of all-ones bits, NaN in every
        /// dtype, so that an element read before it is written shows; [`GUARD`] words more
        /// follow it, for [`intact`].
        fn poisoned(bytes: usize) -> Vec<u64> {
            vec![u64::MAX; bytes.div_ceil(8) + GUARD]
        }

        /// Nothing was written past the workspace's planned bytes.
        fn intact(what: &str, ws: &[u64]) {
            assert!(ws[ws.len() - GUARD..].iter().all(|&w| w == u64::MAX), "{what} overran");
        }

        fn addr<T>(v: &mut [T]) -> u64 {
            v.as_mut_ptr() as u64
        }

        /// `got` within `tol` times the largest magnitude of `want`, and no NaN.
        fn close<T: Element>(what: &str, got: &[T], want: &[f32], tol: f32) {
            let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                let g = g.to_f32();
                assert!((g - w).abs() <= tol * scale, "{what}[{i}]: got {g}, want {w}");
            }
        }

        /// A convolution's operands in `T`, its outputs (NaN until written), and what the
        /// host computes from the same (rounded) operands in f32.
        struct Case<T> {
            x: Vec<T>,
            w: Vec<T>,
            bias: Vec<T>,
            dy: Vec<T>,
            y: Vec<T>,
            dx: Vec<T>,
            dw: Vec<T>,
            want_y: Vec<f32>,
            want_dx: Vec<f32>,
            want_dw: Vec<f32>,
        }

        impl<T: Element> Case<T> {
            fn new(p: &Conv2dParams, seed: u64) -> Case<T> {
                let (xn, wn, yn) = (input_len(p), p.c_out() * p.col_rows(), p.output_len());
                let typed = |n, seed| {
                    let v = values(n, seed, -1.0, 1.0);
                    v.into_iter().map(T::from_f32).collect::<Vec<T>>()
                };
                let (x, w, bias, dy) = (
                    typed(xn, seed),
                    typed(wn, seed + 1),
                    typed(p.c_out(), seed + 2),
                    typed(yn, seed + 3),
                );
                use crate::cpu::widen_f32;
                let (xf, wf, dyf) = (widen_f32(&x), widen_f32(&w), widen_f32(&dy));
                let mut want_y = vec![0.0f32; yn];
                crate::cpu::conv::conv2d(p, &xf, &wf, Some(&widen_f32(&bias)), &mut want_y)
                    .unwrap();
                let (mut want_dx, mut want_dw) = (vec![0.0f32; xn], vec![0.0f32; wn]);
                let (dx, dw) = (Some(&mut want_dx[..]), Some(&mut want_dw[..]));
                crate::cpu::conv::conv2d_backward(p, &xf, &wf, &dyf, dx, dw, None).unwrap();
                let nan = |n| vec![T::from_f32(f32::NAN); n];
                Case {
                    x,
                    w,
                    bias,
                    dy,
                    y: nan(yn),
                    dx: nan(xn),
                    dw: nan(wn),
                    want_y,
                    want_dx,
                    want_dw,
                }
            }

            fn forward(&mut self) -> Forward {
                Forward {
                    x: addr(&mut self.x),
                    w: addr(&mut self.w),
                    bias: Some(addr(&mut self.bias)),
                    y: addr(&mut self.y),
                }
            }

            fn backward(&mut self) -> Backward {
                Backward {
                    x: addr(&mut self.x),
                    w: addr(&mut self.w),
                    dy: addr(&mut self.dy),
                    dx: Some(addr(&mut self.dx)),
                    dw: addr(&mut self.dw),
                }
            }

            /// The outputs against the host's, within `tol`.
            fn check(&self, what: &str, tol: f32) {
                close(&format!("forward {what}"), &self.y, &self.want_y, tol);
                close(&format!("dx {what}"), &self.dx, &self.want_dx, tol);
                close(&format!("dweight {what}"), &self.dw, &self.want_dw, tol);
            }

            /// After a backward without dx: the weight gradient, and dx never written.
            fn check_weight_only(&self, what: &str, tol: f32) {
                close(&format!("dweight alone {what}"), &self.dw, &self.want_dw, tol);
                let untouched = self.dx.iter().all(|v| v.to_f32().is_nan());
                assert!(untouched, "dx written without being asked for, {what}");
            }
        }

        /// The im2col + cuBLAS path in chunks of `chunk` images, with the workspaces the
        /// plan sizes.
        fn run<T: Element>(e: &Emulator, case: usize, p: &Conv2dParams, chunk: usize, tol: f32) {
            let t = T::DTYPE;
            let mut c = Case::<T>::new(p, 3 * case as u64);
            let (ohw, k) = (dims(p).0, p.col_rows());
            let mut col_ws = poisoned(chunk * k * ohw * t.size_in_bytes());
            let col = if p.is_pointwise() { 0 } else { addr(&mut col_ws) };
            forward(e, p, t, &c.forward(), (col, chunk)).unwrap();
            let mut cols = poisoned(chunk * super::super::backward_cols_per_image(p, t, true));
            let mut acc = poisoned(c.dw.len() * 4);
            let b = c.backward();
            backward_input(e, p, t, &b, (addr(&mut cols), chunk)).unwrap();
            backward_weight(e, p, t, &b, (addr(&mut cols), chunk), addr(&mut acc)).unwrap();
            let what = format!("case {case} {t:?} chunk {chunk}");
            c.check(&what, tol);
            intact(&format!("forward's columns {what}"), &col_ws);
            intact(&format!("backward's columns {what}"), &cols);
            intact(&format!("weight gradient's accumulator {what}"), &acc);
            // Without dx: the workspace the plan sizes for the weight gradient alone.
            let mut c = Case::<T>::new(p, 3 * case as u64);
            let mut cols = poisoned(chunk * super::super::backward_cols_per_image(p, t, false));
            let mut acc = poisoned(c.dw.len() * 4);
            let b = Backward { dx: None, ..c.backward() };
            backward_weight(e, p, t, &b, (addr(&mut cols), chunk), addr(&mut acc)).unwrap();
            c.check_weight_only(&what, tol);
            intact(&format!("backward's columns without dx {what}"), &cols);
        }

        /// The direct kernels, with the depthwise weight gradient's workspaces as the plan
        /// sizes them where it has them.
        fn run_direct<T: Element>(e: &Emulator, case: usize, p: &Conv2dParams, tol: f32) {
            let t = T::DTYPE;
            let mut c = Case::<T>::new(p, 5 + case as u64);
            direct_forward(e, p, t, &c.forward()).unwrap();
            let wn = c.dw.len();
            let sums = crate::ops::reduce::column_sum_workspace("test", p.batch(), wn).unwrap();
            let (mut partials, mut sums) = (poisoned(p.batch() * wn * 4), poisoned(sums));
            let depthwise = super::super::depthwise_in_registers(p);
            let ws = depthwise.then(|| (addr(&mut partials), addr(&mut sums)));
            direct_backward(e, p, t, &c.backward(), ws).unwrap();
            let what = format!("direct case {case} {t:?} (depthwise kernel: {depthwise})");
            c.check(&what, tol);
            intact(&format!("depthwise partials {what}"), &partials);
            intact(&format!("depthwise column sums {what}"), &sums);
            let mut c = Case::<T>::new(p, 5 + case as u64);
            let b = Backward { dx: None, ..c.backward() };
            direct_backward(e, p, t, &b, ws).unwrap();
            c.check_weight_only(&what, tol);
        }

        #[test]
        fn direct_and_depthwise_convolutions_match_the_host() {
            let Some(e) = Emulator::new(IM2COL.of(DType::F32)) else { return };
            let o = Conv2dOptions::default;
            let cases = [
                ([3, 4, 9, 9], [4, 1, 3, 3], o().padding((1, 1)).groups(4)),
                ([2, 3, 11, 10], [3, 1, 5, 5], o().stride((2, 2)).padding((2, 2)).groups(3)),
                ([2, 2, 12, 12], [2, 1, 7, 7], o().padding((3, 3)).groups(2)),
                ([2, 3, 10, 9], [3, 1, 3, 5], o().dilation((2, 1)).padding((2, 2)).groups(3)),
                // More images than a column-sum chunk: the two-pass sums over images.
                ([70, 2, 5, 5], [2, 1, 3, 3], o().padding((1, 1)).groups(2)),
                // Past the registers' 7 x 7, and not depthwise: the per-tap kernel.
                ([1, 2, 10, 10], [2, 1, 9, 9], o().padding((4, 4)).groups(2)),
                ([2, 4, 8, 8], [6, 2, 3, 3], o().padding((1, 1)).groups(2)),
            ];
            for (i, (xs, ws, opts)) in cases.iter().enumerate() {
                let p = Conv2dParams::new(xs, ws, opts).unwrap();
                assert!(p.is_direct(), "case {i}");
                assert_eq!(super::super::depthwise_in_registers(&p), i < 5, "case {i}");
                run_direct::<f32>(&e, i, &p, 1e-5);
                run_direct::<bf16>(&e, i, &p, 2e-2);
                run_direct::<f16>(&e, i, &p, 4e-3);
            }
        }

        #[test]
        fn convolutions_through_cublas_match_the_host_in_every_chunking() {
            let Some(e) = Emulator::new(IM2COL.of(DType::F32)) else { return };
            let o = Conv2dOptions::default;
            let cases = [
                ([3, 8, 5, 5], [6, 8, 1, 1], o()),
                ([3, 8, 4, 6], [6, 4, 1, 1], o().groups(2)),
                ([3, 4, 7, 7], [5, 4, 1, 1], o().stride((2, 2))),
                ([3, 5, 9, 8], [7, 5, 3, 3], o().padding((1, 1))),
                ([3, 4, 12, 12], [6, 2, 3, 3], o().stride((2, 2)).groups(2)),
                ([2, 3, 9, 9], [4, 3, 3, 2], o().dilation((2, 1)).padding((2, 0))),
            ];
            for (i, (xs, ws, opts)) in cases.iter().enumerate() {
                let p = Conv2dParams::new(xs, ws, opts).unwrap();
                for chunk in [1, 2, p.batch()] {
                    run::<f32>(&e, i, &p, chunk, 1e-5);
                }
                run::<bf16>(&e, i, &p, 2, 2e-2);
                run::<f16>(&e, i, &p, p.batch(), 4e-3);
            }
        }
    }
}
