//! 2-D convolution on CUDA: im2col (`conv.cu`) + cuBLAS gemm per channel group, batched
//! over the images of a chunk; direct kernels for depthwise convolutions.

use super::elementwise::from_f32;
use super::reduce::{channel_sums, check_rows};
use super::{ptr, zeroed_f32};
use crate::cpu::conv::Conv2dParams;
use crate::cpu::matmul::MatmulSpec;
use crate::cuda::launch::{self, ConvGeom, elementwise as grid};
use crate::cuda::registry::{BIAS_PLANES, COL2IM, DW_BWD_INPUT, DW_BWD_WEIGHT, DW_FWD, IM2COL};
use crate::cuda::{Arg, CudaBackend};
use crate::dtype::DType;
use crate::error::Result;
use crate::tensor::Tensor;

/// Most bytes an im2col buffer may take; the batch is processed in chunks of images that
/// fit (at least one image per chunk).
const COL_BUDGET: usize = 256 << 20;

fn geom(p: &Conv2dParams) -> ConvGeom {
    let (oh, ow) = p.output_hw();
    let i = |v: usize| v as i64;
    ConvGeom {
        batch: i(p.batch),
        c_in: i(p.c_in),
        h: i(p.h),
        w: i(p.w),
        c_out: i(p.c_out),
        kh: i(p.kernel.0),
        kw: i(p.kernel.1),
        sh: i(p.stride.0),
        sw: i(p.stride.1),
        ph: i(p.padding.0),
        pw: i(p.padding.1),
        dh: i(p.dilation.0),
        dw: i(p.dilation.1),
        groups: i(p.groups),
        oh: i(oh),
        ow: i(ow),
    }
}

/// Sizes of one group's product: `(ohw, k, cin_g, cout_g, hw)`.
fn dims(p: &Conv2dParams) -> (usize, usize, usize, usize, usize) {
    let (oh, ow) = p.output_hw();
    let cin_g = p.c_in / p.groups;
    (oh * ow, cin_g * p.kernel.0 * p.kernel.1, cin_g, p.c_out / p.groups, p.h * p.w)
}

/// Whether im2col would copy x unchanged (1x1 kernel, stride 1, no padding).
fn pointwise(p: &Conv2dParams) -> bool {
    p.kernel == (1, 1) && p.stride == (1, 1) && p.padding == (0, 0)
}

/// Images per chunk for a per-image buffer of `per_image` bytes.
fn chunk_images(p: &Conv2dParams, per_image: usize) -> usize {
    (COL_BUDGET / per_image.max(1)).clamp(1, p.batch.max(1))
}

/// Fills `col` with the im2col matrices of images `n0 .. n0 + nimg`, group `group`.
fn im2col(
    cu: &CudaBackend,
    p: &Conv2dParams,
    x: &Tensor,
    col: u64,
    n0: usize,
    nimg: usize,
    group: usize,
) -> Result<()> {
    let (ohw, k, ..) = dims(p);
    // SAFETY: im2col_T(const T* x, T* col, ConvGeom g, i64 n0, i64 nimg, i64 group); x is
    // the input the geometry describes, col holds nimg * k * ohw elements of T.
    unsafe {
        cu.launch(
            IM2COL.of(x.dtype()),
            grid(nimg * k * ohw),
            &[
                ptr(x)?,
                Arg::Ptr(col),
                Arg::Conv(geom(p)),
                Arg::I64(n0 as i64),
                Arg::I64(nimg as i64),
                Arg::I64(group as i64),
            ],
        )
    }
}

/// `y = conv2d(x, w) + bias`; `y` is nonempty.
pub(crate) fn conv2d(
    cu: &CudaBackend,
    p: &Conv2dParams,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    y: &mut Tensor,
) -> Result<()> {
    let t = x.dtype();
    if p.is_depthwise() {
        let n = y.numel();
        let (b, has_b) = match bias {
            Some(b) => (ptr(b)?, 1),
            None => (Arg::Ptr(0), 0),
        };
        // SAFETY: dw_fwd_T(const T* x, const T* w, const T* b, u32 has_b, T* y, ConvGeom
        // g); the tensors have the geometry's shapes; b is read only when has_b.
        return unsafe {
            cu.launch(
                DW_FWD.of(t),
                grid(n),
                &[ptr(x)?, ptr(w)?, b, Arg::U32(has_b), ptr(y)?, Arg::Conv(geom(p))],
            )
        };
    }
    let (ohw, k, cin_g, cout_g, hw) = dims(p);
    let size = t.size_in_bytes();
    let beta = match bias {
        Some(bias) => {
            let n = y.numel();
            // SAFETY: bias_planes_T(const T* b, T* y, u64 n, u64 c, u64 ohw); y holds n =
            // batch * c_out * ohw elements, bias c_out.
            unsafe {
                cu.launch(
                    BIAS_PLANES.of(t),
                    grid(n),
                    &[ptr(bias)?, ptr(y)?, Arg::count(n), Arg::count(p.c_out), Arg::count(ohw)],
                )?;
            }
            1.0
        }
        None => 0.0,
    };
    let chunk = chunk_images(p, k * ohw * size);
    let col = if pointwise(p) { None } else { Some(cu.allocate(chunk * k * ohw * size)?) };
    let (px, pw, py) = (x.cuda_ptr()?, w.cuda_ptr()?, y.cuda_ptr()?);
    for n0 in (0..p.batch).step_by(chunk) {
        let nimg = chunk.min(p.batch - n0);
        for g in 0..p.groups {
            let (b, stride_b) = match &col {
                Some(col) => {
                    im2col(cu, p, x, col.ptr(), n0, nimg, g)?;
                    (col.ptr(), k * ohw)
                }
                None => (px + ((n0 * p.c_in + g * cin_g) * hw * size) as u64, p.c_in * hw),
            };
            let spec = MatmulSpec::new(cout_g, ohw, k)
                .batched(nimg, 0, stride_b, p.c_out * ohw)
                .scaled(1.0, beta);
            // SAFETY: A is group g's weights [cout_g, k] (shared by the images), B the
            // images' [k, ohw] columns, C their [cout_g, ohw] output planes, c_out * ohw
            // apart; all inside x / col, w and y.
            unsafe {
                cu.gemm(
                    &spec,
                    pw + (g * cout_g * k * size) as u64,
                    b,
                    py + ((n0 * p.c_out + g * cout_g) * ohw * size) as u64,
                    t,
                    t,
                )?;
            }
        }
    }
    Ok(())
}

/// Gradients of [`conv2d`]; `dy` is nonempty.
#[allow(clippy::too_many_arguments)]
pub(crate) fn conv2d_backward(
    cu: &CudaBackend,
    p: &Conv2dParams,
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    dx: &mut Tensor,
    dweight: &mut Tensor,
    dbias: Option<&mut Tensor>,
) -> Result<()> {
    if p.is_depthwise() {
        depthwise_backward(cu, p, x, w, dy, dx, dweight)?;
    } else {
        backward_input(cu, p, w, dy, dx)?;
        backward_weight(cu, p, x, dy, dweight)?;
    }
    if let Some(dbias) = dbias {
        channel_sums(cu, dy, p.batch, dbias)?;
    }
    Ok(())
}

fn depthwise_backward(
    cu: &CudaBackend,
    p: &Conv2dParams,
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    dx: &mut Tensor,
    dweight: &mut Tensor,
) -> Result<()> {
    let t = x.dtype();
    // SAFETY: dw_bwd_input_T(const T* w, const T* dy, T* dx, ConvGeom g); shapes from the
    // geometry.
    unsafe {
        cu.launch(
            DW_BWD_INPUT.of(t),
            grid(dx.numel()),
            &[ptr(w)?, ptr(dy)?, ptr(dx)?, Arg::Conv(geom(p))],
        )?;
    }
    let taps = dweight.numel();
    check_rows("conv2d_backward", taps)?;
    // SAFETY: dw_bwd_weight_T(const T* x, const T* dy, T* dw, ConvGeom g), one block per
    // weight element; dweight holds c_in * kh * kw elements.
    unsafe {
        cu.launch(
            DW_BWD_WEIGHT.of(t),
            launch::per_row(taps),
            &[ptr(x)?, ptr(dy)?, ptr(dweight)?, Arg::Conv(geom(p))],
        )
    }
}

/// dx: per group, `dcol = W_g^T * dy_g` (f32), gathered back by col2im; for a pointwise
/// convolution the product is dx itself.
fn backward_input(
    cu: &CudaBackend,
    p: &Conv2dParams,
    w: &Tensor,
    dy: &Tensor,
    dx: &mut Tensor,
) -> Result<()> {
    let t = w.dtype();
    let size = t.size_in_bytes();
    let (ohw, k, cin_g, cout_g, hw) = dims(p);
    if ohw == 0 {
        return cu.zero(dx.cuda_ptr()?, dx.size_in_bytes());
    }
    let (pw, pdy, pdx) = (w.cuda_ptr()?, dy.cuda_ptr()?, dx.cuda_ptr()?);
    let point = pointwise(p);
    let chunk = chunk_images(p, k * ohw * 4);
    let dcol = if point { None } else { Some(cu.allocate(chunk * k * ohw * 4)?) };
    for n0 in (0..p.batch).step_by(chunk) {
        let nimg = chunk.min(p.batch - n0);
        for g in 0..p.groups {
            let a = pw + (g * cout_g * k * size) as u64;
            let b = pdy + ((n0 * p.c_out + g * cout_g) * ohw * size) as u64;
            match &dcol {
                None => {
                    let spec = MatmulSpec::new(cin_g, ohw, cout_g).transpose(true, false).batched(
                        nimg,
                        0,
                        p.c_out * ohw,
                        p.c_in * hw,
                    );
                    let c = pdx + ((n0 * p.c_in + g * cin_g) * hw * size) as u64;
                    // SAFETY: W_g^T [cin_g, cout_g] * dy planes [cout_g, hw] -> dx planes,
                    // all inside w, dy and dx.
                    unsafe { cu.gemm(&spec, a, b, c, t, t)? };
                }
                Some(dcol) => {
                    let spec = MatmulSpec::new(k, ohw, cout_g).transpose(true, false).batched(
                        nimg,
                        0,
                        p.c_out * ohw,
                        k * ohw,
                    );
                    // SAFETY: W_g^T [k, cout_g] * dy planes [cout_g, ohw] -> dcol, which
                    // holds nimg * k * ohw floats.
                    unsafe { cu.gemm(&spec, a, b, dcol.ptr(), t, DType::F32)? };
                    // SAFETY: col2im_T(const float* dcol, T* dx, ConvGeom g, i64 n0, i64
                    // nimg, i64 group); dcol as just written, dx the input's shape.
                    unsafe {
                        cu.launch(
                            COL2IM.of(t),
                            grid(nimg * cin_g * hw),
                            &[
                                Arg::Ptr(dcol.ptr()),
                                Arg::Ptr(pdx),
                                Arg::Conv(geom(p)),
                                Arg::I64(n0 as i64),
                                Arg::I64(nimg as i64),
                                Arg::I64(g as i64),
                            ],
                        )?;
                    }
                }
            }
        }
    }
    Ok(())
}

/// dW_g = sum over images of `dy_g * col^T`, accumulated in f32 and rounded once.
fn backward_weight(
    cu: &CudaBackend,
    p: &Conv2dParams,
    x: &Tensor,
    dy: &Tensor,
    dweight: &mut Tensor,
) -> Result<()> {
    let t = x.dtype();
    let size = t.size_in_bytes();
    let (ohw, k, cin_g, cout_g, hw) = dims(p);
    let acc = zeroed_f32(cu, dweight.numel())?;
    if ohw > 0 {
        let (px, pdy) = (x.cuda_ptr()?, dy.cuda_ptr()?);
        let chunk = chunk_images(p, k * ohw * size);
        let col = if pointwise(p) { None } else { Some(cu.allocate(chunk * k * ohw * size)?) };
        let spec = MatmulSpec::new(cout_g, k, ohw).transpose(false, true).scaled(1.0, 1.0);
        for n0 in (0..p.batch).step_by(chunk) {
            let nimg = chunk.min(p.batch - n0);
            for g in 0..p.groups {
                if let Some(col) = &col {
                    im2col(cu, p, x, col.ptr(), n0, nimg, g)?;
                }
                for i in 0..nimg {
                    let n = n0 + i;
                    let b = match &col {
                        Some(col) => col.ptr() + (i * k * ohw * size) as u64,
                        None => px + ((n * p.c_in + g * cin_g) * hw * size) as u64,
                    };
                    let a = pdy + ((n * p.c_out + g * cout_g) * ohw * size) as u64;
                    let c = acc.ptr() + (g * cout_g * k * 4) as u64;
                    // SAFETY: dy plane block [cout_g, ohw] * columns^T ([k, ohw] stored) ->
                    // the f32 accumulator of group g, [cout_g, k], inside acc.
                    unsafe { cu.gemm(&spec, a, b, c, t, DType::F32)? };
                }
            }
        }
    }
    from_f32(cu, acc.ptr(), dweight)
}
