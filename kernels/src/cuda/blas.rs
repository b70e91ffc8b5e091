//! Matrix products through cuBLAS (`cublasGemmEx` / `cublasGemmStridedBatchedEx`): f16 and
//! bf16 on tensor cores, every type accumulated in f32 (`CUBLAS_COMPUTE_32F`, which for f32
//! operands is plain FP32, not TF32, unless the device allows TF32 for matmuls:
//! `CUBLAS_COMPUTE_32F_FAST_TF32`, as PyTorch's `allow_tf32` sets `CUBLAS_TF32_TENSOR_OP_MATH`).

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::params::MatmulSpec;
use cudarc::cublas::{result, sys};
use std::ffi::c_void;

/// A cuBLAS handle bound to the context that was current when it was made (the device's
/// primary context) and to the legacy default stream, the stream every op runs on.
#[derive(Debug)]
pub(crate) struct Blas {
    handle: sys::cublasHandle_t,
    /// The workspace last given to the handle, `(address, bytes)`.
    workspace: Option<(u64, usize)>,
    /// Whether f32 products may use TF32 (the device's setting, given before each product
    /// as PyTorch sets the handle's math mode in `getCurrentCUDABlasHandle`).
    tf32: bool,
}

// SAFETY: a cuBLAS handle may be used from any thread as long as calls on it do not overlap;
// the backend keeps it behind a mutex.
unsafe impl Send for Blas {}

fn blas_error(op: &'static str) -> impl Fn(result::CublasError) -> Error {
    move |e| Error::Device { op, reason: format!("cuBLAS: {e:?}") }
}

fn data_type(dtype: DType) -> sys::cudaDataType {
    match dtype {
        DType::F32 => sys::cudaDataType::CUDA_R_32F,
        DType::F16 => sys::cudaDataType::CUDA_R_16F,
        DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
    }
}

fn to_int(op: &'static str, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::InvalidArgument {
        op,
        reason: format!("{what} = {v} exceeds cuBLAS's 32-bit limit"),
    })
}

impl Blas {
    /// A handle for the current context. The caller has bound the device's context.
    pub(crate) fn new() -> Result<Blas> {
        let handle = result::create_handle().map_err(blas_error("cublasCreate"))?;
        Ok(Blas { handle, workspace: None, tf32: false })
    }

    /// Gives the handle `workspace` (`(address, bytes)` from the device's caching
    /// allocator, as PyTorch does) unless it has it already. The caller has bound the
    /// context.
    pub(crate) fn set_workspace(&mut self, workspace: Option<(u64, usize)>) -> Result<()> {
        if self.workspace == workspace {
            return Ok(());
        }
        let (ptr, bytes) = workspace.unwrap_or((0, 0));
        // SAFETY: the handle is live; the workspace is a device allocation of `bytes` bytes
        // that the device keeps until it replaces it, and then it passes the new one here
        // before the next product.
        unsafe { sys::cublasSetWorkspace_v2(self.handle, ptr as *mut c_void, bytes) }
            .result()
            .map_err(blas_error("cublasSetWorkspace"))?;
        self.workspace = workspace;
        Ok(())
    }

    /// Lets f32 products use TF32 tensor cores (`CUBLAS_COMPUTE_32F_FAST_TF32`) or not.
    pub(crate) fn set_tf32(&mut self, tf32: bool) {
        self.tf32 = tf32;
    }

    /// `C = alpha * op(A) * op(B) + beta * C` for every batch of `spec` (row-major, the
    /// layout of [`MatmulSpec`]), with A and B of `ab` and C of `c_type`; an all-f32
    /// product uses TF32 tensor cores when [`Blas::set_tf32`] allowed it. The caller has
    /// bound the context and checked that the pointers hold `spec.a_len()`, `b_len()` and
    /// `c_len()` elements; `m`, `n` and `batch` are nonzero and `k` too.
    ///
    /// Row-major `C = op(A) op(B)` is column-major `C^T = op(B)^T op(A)^T`, so cuBLAS gets B
    /// first, with the dimensions swapped.
    pub(crate) fn gemm(
        &self,
        spec: &MatmulSpec,
        a: u64,
        b: u64,
        c: u64,
        ab: DType,
        c_type: DType,
    ) -> Result<()> {
        const OP: &str = "matmul";
        let s = spec;
        debug_assert!(s.m > 0 && s.n > 0 && s.k > 0 && s.batch > 0);
        let (m, n, k) = (to_int(OP, "m", s.m)?, to_int(OP, "n", s.n)?, to_int(OP, "k", s.k)?);
        let batch = to_int(OP, "batch", s.batch)?;
        let op = |t: bool| {
            if t {
                sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        // Column-major leading dimensions of the stored row-major matrices.
        let ld_b = if s.trans_b { k } else { n };
        let ld_a = if s.trans_a { m } else { k };
        let (alpha, beta) = (s.alpha, s.beta);
        let (t_ab, t_c) = (data_type(ab), data_type(c_type));
        let compute = if self.tf32 && ab == DType::F32 && c_type == DType::F32 {
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
        } else {
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
        };
        let algo = sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT;
        if s.batch == 1 {
            // SAFETY: the handle is live and its context current; alpha and beta are f32
            // host values as COMPUTE_32F requires; a, b and c are device pointers holding
            // the elements the dimensions and leading dimensions address (checked by the
            // caller), and c does not alias a or b.
            unsafe {
                result::gemm_ex(
                    self.handle,
                    op(s.trans_b),
                    op(s.trans_a),
                    n,
                    m,
                    k,
                    (&alpha as *const f32).cast::<c_void>(),
                    b as *const c_void,
                    t_ab,
                    ld_b,
                    a as *const c_void,
                    t_ab,
                    ld_a,
                    (&beta as *const f32).cast::<c_void>(),
                    c as *mut c_void,
                    t_c,
                    n,
                    compute,
                    algo,
                )
            }
            .map_err(blas_error("cublasGemmEx"))
        } else {
            let stride = |v: usize| {
                i64::try_from(v).map_err(|_| Error::InvalidArgument {
                    op: OP,
                    reason: format!("stride {v} exceeds cuBLAS's 64-bit limit"),
                })
            };
            let (sa, sb, sc) = (stride(s.stride_a)?, stride(s.stride_b)?, stride(s.stride_c)?);
            // SAFETY: as above, for every batch: batch i reads a + i * stride_a, b + i *
            // stride_b and writes c + i * stride_c (elements); C matrices of different
            // batches do not overlap (stride_c >= m * n, checked by the caller).
            unsafe {
                result::gemm_strided_batched_ex(
                    self.handle,
                    op(s.trans_b),
                    op(s.trans_a),
                    n,
                    m,
                    k,
                    (&alpha as *const f32).cast::<c_void>(),
                    b as *const c_void,
                    t_ab,
                    ld_b,
                    sb,
                    a as *const c_void,
                    t_ab,
                    ld_a,
                    sa,
                    (&beta as *const f32).cast::<c_void>(),
                    c as *mut c_void,
                    t_c,
                    n,
                    sc,
                    batch,
                    compute,
                    algo,
                )
            }
            .map_err(blas_error("cublasGemmStridedBatchedEx"))
        }
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: the handle was created in `new` and is destroyed once, here.
        let _ = unsafe { result::destroy_handle(self.handle) };
    }
}
