//! Row-wise and training kernels (`softmax.cu`, `misc.cu`): softmax, cross-entropy, layer
//! norm, embedding, optimizer steps and the unscale with non-finite check.

use super::elementwise::from_f32;
use super::reduce::check_rows;
use super::{ptr, zeroed_f32};
use crate::cpu::optim::{AdamWConfig, SgdConfig};
use crate::cuda::launch::{self, elementwise as grid};
use crate::cuda::registry::{
    ADAMW, CE_BWD, CE_FWD, EMBEDDING, EMBEDDING_BWD, LAYER_NORM, LAYER_NORM_BWD,
    LAYER_NORM_PARAMS_BWD, SGD, SOFTMAX_BWD, SOFTMAX_FWD, UNSCALE,
};
use crate::cuda::{Arg, CudaBackend};
use crate::error::Result;
use crate::tensor::Tensor;

/// Uploads host indices (targets, token ids) to a device buffer from the cache.
fn upload_u32(
    cu: &CudaBackend,
    data: &[u32],
) -> Result<vram_alloc::Allocation<vram_alloc::cuda::CudaMemory>> {
    let buf = cu.allocate(std::mem::size_of_val(data))?;
    let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_ne_bytes()).collect();
    cu.copy_to_device(buf.ptr(), &bytes)?;
    Ok(buf)
}

/// Softmax over rows of `cols`; `seq > 0` makes it causal (`cols == seq`).
pub(crate) fn softmax(
    cu: &CudaBackend,
    x: &Tensor,
    y: &mut Tensor,
    cols: usize,
    seq: usize,
) -> Result<()> {
    let rows = x.numel() / cols;
    check_rows("softmax", rows)?;
    // SAFETY: softmax_T(const T* x, T* y, u64 cols, u64 seq), one block per row; x and y
    // hold rows * cols elements.
    unsafe {
        cu.launch(
            SOFTMAX_FWD.of(x.dtype()),
            launch::per_row(rows),
            &[ptr(x)?, ptr(y)?, Arg::count(cols), Arg::count(seq)],
        )
    }
}

/// Gradient of [`softmax`] from its output `y`.
pub(crate) fn softmax_backward(
    cu: &CudaBackend,
    y: &Tensor,
    dy: &Tensor,
    dx: &mut Tensor,
    cols: usize,
    seq: usize,
) -> Result<()> {
    let rows = y.numel() / cols;
    check_rows("softmax_backward", rows)?;
    // SAFETY: softmax_bwd_T(const T* y, const T* dy, T* dx, u64 cols, u64 seq), one block
    // per row; all three hold rows * cols elements.
    unsafe {
        cu.launch(
            SOFTMAX_BWD.of(y.dtype()),
            launch::per_row(rows),
            &[ptr(y)?, ptr(dy)?, ptr(dx)?, Arg::count(cols), Arg::count(seq)],
        )
    }
}

/// Mean cross-entropy of `logits: [n, c]` (targets already validated, `c > 0`); writes
/// `lse: [n]` f32.
pub(crate) fn cross_entropy(
    cu: &CudaBackend,
    logits: &Tensor,
    targets: &[u32],
    ignore_index: Option<u32>,
    lse: &mut Tensor,
) -> Result<f32> {
    let n = targets.len();
    let c = logits.shape()[1];
    let count = targets.iter().filter(|&&t| Some(t) != ignore_index).count();
    if n == 0 {
        return Ok(f32::NAN);
    }
    check_rows("cross_entropy", n)?;
    let t = upload_u32(cu, targets)?;
    let losses = Tensor::uninit("cross_entropy", logits.device(), &[n], crate::DType::F32)?;
    // SAFETY: ce_fwd_T(const T* x, const u32* t, u64 c, u32 ignore, u32 has_ignore, float*
    // lse, float* loss), one block per row; logits hold n * c elements, targets n (each
    // below c unless ignored, checked by the caller), lse and losses n floats.
    unsafe {
        cu.launch(
            CE_FWD.of(logits.dtype()),
            launch::per_row(n),
            &[
                ptr(logits)?,
                Arg::Ptr(t.ptr()),
                Arg::count(c),
                Arg::U32(ignore_index.unwrap_or(0)),
                Arg::U32(ignore_index.is_some() as u32),
                ptr(lse)?,
                ptr(&losses)?,
            ],
        )?;
    }
    let total = super::reduce::sum(cu, &losses)?;
    Ok(total / count as f32)
}

/// Gradient of [`cross_entropy`] for the upstream `dloss`.
pub(crate) fn cross_entropy_backward(
    cu: &CudaBackend,
    logits: &Tensor,
    targets: &[u32],
    ignore_index: Option<u32>,
    lse: &Tensor,
    dloss: f32,
    dlogits: &mut Tensor,
) -> Result<()> {
    let total = dlogits.numel();
    if total == 0 {
        return Ok(());
    }
    let c = logits.shape()[1];
    let count = targets.iter().filter(|&&t| Some(t) != ignore_index).count();
    let g = dloss / count as f32;
    let t = upload_u32(cu, targets)?;
    // SAFETY: ce_bwd_T(const T* x, const u32* t, const float* lse, float g, u64 c, u32
    // ignore, u32 has_ignore, T* dx, u64 n); logits and dlogits hold n = rows * c elements,
    // targets and lse one per row, targets validated by the caller.
    unsafe {
        cu.launch(
            CE_BWD.of(logits.dtype()),
            grid(total),
            &[
                ptr(logits)?,
                Arg::Ptr(t.ptr()),
                ptr(lse)?,
                Arg::F32(g),
                Arg::count(c),
                Arg::U32(ignore_index.unwrap_or(0)),
                Arg::U32(ignore_index.is_some() as u32),
                ptr(dlogits)?,
                Arg::count(total),
            ],
        )
    }
}

/// Layer norm forward over rows of `d > 0`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn layer_norm(
    cu: &CudaBackend,
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    eps: f32,
    y: &mut Tensor,
    mean: &mut Tensor,
    rstd: &mut Tensor,
) -> Result<()> {
    let rows = mean.numel();
    let d = gamma.numel();
    check_rows("layer_norm", rows)?;
    // SAFETY: layer_norm_T(const T* x, const T* g, const T* b, float eps, T* y, float* m,
    // float* r, u64 d), one block per row; x and y hold rows * d elements, gamma and beta
    // d, mean and rstd rows floats.
    unsafe {
        cu.launch(
            LAYER_NORM.of(x.dtype()),
            launch::per_row(rows),
            &[
                ptr(x)?,
                ptr(gamma)?,
                ptr(beta)?,
                Arg::F32(eps),
                ptr(y)?,
                ptr(mean)?,
                ptr(rstd)?,
                Arg::count(d),
            ],
        )
    }
}

/// Layer norm backward: `dx` per row, `dgamma` and `dbeta` as f32 column sums.
#[allow(clippy::too_many_arguments)]
pub(crate) fn layer_norm_backward(
    cu: &CudaBackend,
    x: &Tensor,
    gamma: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    dy: &Tensor,
    dx: &mut Tensor,
    dgamma: &mut Tensor,
    dbeta: &mut Tensor,
) -> Result<()> {
    let rows = mean.numel();
    let d = gamma.numel();
    check_rows("layer_norm_backward", rows)?;
    // SAFETY: layer_norm_bwd_T(const T* x, const T* g, const float* m, const float* r,
    // const T* dy, T* dx, u64 d), one block per row; sizes as in `layer_norm`.
    unsafe {
        cu.launch(
            LAYER_NORM_BWD.of(x.dtype()),
            launch::per_row(rows),
            &[ptr(x)?, ptr(gamma)?, ptr(mean)?, ptr(rstd)?, ptr(dy)?, ptr(dx)?, Arg::count(d)],
        )?;
    }
    let dg = zeroed_f32(cu, d)?;
    let db = zeroed_f32(cu, d)?;
    let (cfg, chunk) = launch::columns(rows, d);
    // SAFETY: layer_norm_params_bwd_T(const T* x, const float* m, const float* r, const T*
    // dy, float* dg, float* db, u64 rows, u64 d, u64 chunk), grid (columns, row chunks);
    // dg and db hold d floats.
    unsafe {
        cu.launch(
            LAYER_NORM_PARAMS_BWD.of(x.dtype()),
            cfg,
            &[
                ptr(x)?,
                ptr(mean)?,
                ptr(rstd)?,
                ptr(dy)?,
                Arg::Ptr(dg.ptr()),
                Arg::Ptr(db.ptr()),
                Arg::count(rows),
                Arg::count(d),
                Arg::count(chunk),
            ],
        )?;
    }
    from_f32(cu, dg.ptr(), dgamma)?;
    from_f32(cu, db.ptr(), dbeta)
}

/// Gathers rows `ids` (validated by the caller) of `table: [vocab, dim]`.
pub(crate) fn embedding(
    cu: &CudaBackend,
    table: &Tensor,
    ids: &[u32],
    out: &mut Tensor,
) -> Result<()> {
    let n = out.numel();
    if n == 0 {
        return Ok(());
    }
    let dim = table.shape()[1];
    let idx = upload_u32(cu, ids)?;
    // SAFETY: embedding_T(const u32* ids, const T* table, T* out, u64 n, u64 dim); out
    // holds n = ids.len() * dim elements, every id is below the table's rows.
    unsafe {
        cu.launch(
            EMBEDDING.of(table.dtype()),
            grid(n),
            &[Arg::Ptr(idx.ptr()), ptr(table)?, ptr(out)?, Arg::count(n), Arg::count(dim)],
        )
    }
}

/// Scatter-adds `dout` into `dtable` (f32 atomics, one rounding).
pub(crate) fn embedding_backward(
    cu: &CudaBackend,
    ids: &[u32],
    dout: &Tensor,
    dtable: &mut Tensor,
) -> Result<()> {
    let acc = zeroed_f32(cu, dtable.numel())?;
    let n = dout.numel();
    if n > 0 {
        let dim = dout.shape()[1];
        let idx = upload_u32(cu, ids)?;
        // SAFETY: embedding_bwd_T(const u32* ids, const T* dout, float* acc, u64 n, u64
        // dim); dout holds n = ids.len() * dim elements, acc vocab * dim floats and every
        // id is below vocab (checked by the caller).
        unsafe {
            cu.launch(
                EMBEDDING_BWD.of(dout.dtype()),
                grid(n),
                &[
                    Arg::Ptr(idx.ptr()),
                    ptr(dout)?,
                    Arg::Ptr(acc.ptr()),
                    Arg::count(n),
                    Arg::count(dim),
                ],
            )?;
        }
    }
    from_f32(cu, acc.ptr(), dtable)
}

/// One SGD step; `buf` is `None` exactly when `cfg.momentum == 0`.
pub(crate) fn sgd_step(
    cu: &CudaBackend,
    params: &mut Tensor,
    grads: &Tensor,
    buf: Option<&mut Tensor>,
    first_step: bool,
    cfg: &SgdConfig,
) -> Result<()> {
    let n = params.numel();
    let buf = match buf {
        Some(b) => ptr(b)?,
        None => Arg::Ptr(0),
    };
    // SAFETY: sgd_T(float* p, const T* g, float* buf, u64 n, float lr, float momentum,
    // float dampening, float wd, u32 nesterov, u32 first_step); params, grads and (with
    // momentum) buf hold n elements; without momentum buf is never read.
    unsafe {
        cu.launch(
            SGD.of(grads.dtype()),
            grid(n),
            &[
                ptr(params)?,
                ptr(grads)?,
                buf,
                Arg::count(n),
                Arg::F32(cfg.lr),
                Arg::F32(cfg.momentum),
                Arg::F32(cfg.dampening),
                Arg::F32(cfg.weight_decay),
                Arg::U32(cfg.nesterov as u32),
                Arg::U32(first_step as u32),
            ],
        )
    }
}

/// One AdamW step, with the host's bias corrections.
pub(crate) fn adamw_step(
    cu: &CudaBackend,
    params: &mut Tensor,
    grads: &Tensor,
    exp_avg: &mut Tensor,
    exp_avg_sq: &mut Tensor,
    step: u32,
    cfg: &AdamWConfig,
) -> Result<()> {
    let n = params.numel();
    let t = step as i32;
    let bias1 = 1.0 - cfg.beta1.powi(t);
    let bias2_sqrt = (1.0 - cfg.beta2.powi(t)).sqrt();
    let step_size = cfg.lr / bias1;
    let decay = 1.0 - cfg.lr * cfg.weight_decay;
    // SAFETY: adamw_T(float* p, const T* g, float* m, float* v, u64 n, float b1, float b2,
    // float eps, float step_size, float bias2_sqrt, float decay); all four tensors hold n
    // elements.
    unsafe {
        cu.launch(
            ADAMW.of(grads.dtype()),
            grid(n),
            &[
                ptr(params)?,
                ptr(grads)?,
                ptr(exp_avg)?,
                ptr(exp_avg_sq)?,
                Arg::count(n),
                Arg::F32(cfg.beta1),
                Arg::F32(cfg.beta2),
                Arg::F32(cfg.eps),
                Arg::F32(step_size),
                Arg::F32(bias2_sqrt),
                Arg::F32(decay),
            ],
        )
    }
}

/// Multiplies every gradient by `inv_scale` in place; one device flag for all of them,
/// read back once at the end.
pub(crate) fn unscale_and_check_finite(
    cu: &CudaBackend,
    grads: &mut [&mut Tensor],
    inv_scale: f32,
) -> Result<bool> {
    let flag = cu.allocate(4)?;
    cu.zero(flag.ptr(), 4)?;
    for g in grads.iter_mut() {
        let n = g.numel();
        // SAFETY: unscale_T(T* g, float inv, u64 n, u32* flag); g holds n elements, flag
        // one u32.
        unsafe {
            cu.launch(
                UNSCALE.of(g.dtype()),
                grid(n),
                &[ptr(g)?, Arg::F32(inv_scale), Arg::count(n), Arg::Ptr(flag.ptr())],
            )?;
        }
    }
    let mut out = [0u8; 4];
    cu.copy_to_host(&mut out, flag.ptr())?;
    Ok(u32::from_ne_bytes(out) != 0)
}
