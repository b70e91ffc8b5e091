//! Matrix products with fused epilogues through cuBLASLt (`cublasLtMatmul`): a linear layer's
//! bias, its GELU (tanh approximation, cuBLASLt's) with or without the pre-activation kept
//! for backward, the bias gradient of a weight gradient's product (`BGRADB`), and GELU's
//! gradient with the previous layer's bias gradient in an input gradient's product
//! (`DGELU_BGRAD`), as
//! PyTorch's `gemm_and_bias` (`aten/src/ATen/cuda/CUDABlas.cpp`) and Transformer Engine's
//! GEMMs use them. f16 and bf16 run on tensor cores with f32 accumulation
//! (`CUBLAS_COMPUTE_32F`); f32 is plain FP32 unless the device allows TF32 for matmuls
//! (`CUBLAS_COMPUTE_32F_FAST_TF32`, PyTorch's `torch.backends.cuda.matmul.allow_tf32`).
//!
//! The heuristic picks the algorithm per call (PyTorch does the same, without a cache); when
//! it finds none for a layout or epilogue, [`BlasLt::matmul`] says so and the caller runs the
//! unfused cuBLAS path, as `gemm_and_bias` returning `false` makes PyTorch do.
//!
//! Never run on a GPU yet: no machine this was written on had one.

use crate::dtype::DType;
use crate::error::{Error, Result};
use cudarc::cublaslt::result::{self, CublasError};
use cudarc::cublaslt::sys;
use std::ffi::c_void;

/// PyTorch's default cuBLASLt workspace, `CUBLASLT_WORKSPACE_SIZE` (KiB) unset: 1 MiB
/// (`parseCUDABlasLtWorkspaceSize` in `aten/src/ATen/cuda/CublasHandlePool.cpp`).
pub(crate) const DEFAULT_LT_WORKSPACE_KIB: usize = 1024;

/// The bytes cuBLASLt may use of the device's cuBLAS workspace of `blas_bytes`:
/// `CUBLASLT_WORKSPACE_SIZE` KiB (default 1024), at most the cuBLAS workspace, as PyTorch's
/// `getCUDABlasLtWorkspaceSize` with its unified workspace.
pub(crate) fn lt_workspace_bytes(blas_bytes: usize) -> usize {
    let kib = std::env::var("CUBLASLT_WORKSPACE_SIZE")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(DEFAULT_LT_WORKSPACE_KIB);
    kib.saturating_mul(1024).min(blas_bytes)
}

/// What cuBLASLt does after the product.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Epilogue {
    /// `D = A B + bias`, the bias (`m` elements) broadcast along the columns.
    Bias { bias: u64 },
    /// `D = gelu(A B + bias)`; with `aux`, `A B + bias` is stored there too (leading
    /// dimension `m`, D's type). `bias` 0 for none.
    Gelu { bias: u64, aux: u64 },
    /// `D = A B` and `bias_grad[j] = sum over k of B[k, j]` (`n` elements, D's type).
    BgradB { bias_grad: u64 },
    /// `D = A B * gelu'(aux)` (aux: GELU's input, leading dimension `m`, D's type) and
    /// `bias_grad[i] = sum over j of D[i, j]` (`m` elements): the gradient of the GELU's
    /// input and the bias gradient of the layer that produced it.
    DgeluBgrad { aux: u64, bias_grad: u64 },
}

/// One column-major product `D (m x n) = op(A) (m x k) * op(B) (k x n)` of one dtype, with
/// leading dimensions; D is written (beta = 0).
#[derive(Clone, Copy, Debug)]
pub(crate) struct LtGemm {
    pub(crate) m: usize,
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) a: u64,
    pub(crate) lda: usize,
    pub(crate) trans_a: bool,
    pub(crate) b: u64,
    pub(crate) ldb: usize,
    pub(crate) trans_b: bool,
    pub(crate) d: u64,
    pub(crate) ldd: usize,
    pub(crate) dtype: DType,
    pub(crate) epilogue: Epilogue,
}

fn lt_error(op: &'static str) -> impl Fn(CublasError) -> Error {
    move |e| Error::Device { op, reason: format!("cuBLASLt: {e:?}") }
}

fn data_type(dtype: DType) -> sys::cudaDataType {
    match dtype {
        DType::F32 => sys::cudaDataType::CUDA_R_32F,
        DType::F16 => sys::cudaDataType::CUDA_R_16F,
        DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
    }
}

/// The largest power of two up to 256 dividing `address` (PyTorch's `_getAlignment`).
fn alignment(address: u64) -> u32 {
    let mut a = 1u32;
    while a < 256 && address.is_multiple_of(u64::from(a) * 2) {
        a *= 2;
    }
    a
}

/// A matmul descriptor, destroyed on drop.
struct Desc(sys::cublasLtMatmulDesc_t);

impl Desc {
    fn set<T>(&self, attr: sys::cublasLtMatmulDescAttributes_t, value: &T) -> Result<()> {
        // SAFETY: the descriptor is live; `value` is the attribute's type (the callers pass
        // the type cuBLASLt documents for each attribute) and is read during the call only.
        unsafe {
            result::set_matmul_desc_attribute(
                self.0,
                attr,
                std::ptr::from_ref(value).cast::<c_void>(),
                size_of::<T>(),
            )
        }
        .map_err(lt_error("cublasLtMatmulDescSetAttribute"))
    }
}

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created once and destroyed once, here.
        let _ = unsafe { result::destroy_matmul_desc(self.0) };
    }
}

/// A matrix layout, destroyed on drop.
struct Layout(sys::cublasLtMatrixLayout_t);

impl Layout {
    /// The stored matrix of `rows x cols` (column-major, leading dimension `ld`).
    fn new(dtype: DType, rows: usize, cols: usize, ld: usize) -> Result<Layout> {
        let ld = i64::try_from(ld).map_err(|_| Error::InvalidArgument {
            op: "cublasLtMatrixLayoutCreate",
            reason: format!("leading dimension {ld} exceeds 64 bits"),
        })?;
        result::create_matrix_layout(data_type(dtype), rows as u64, cols as u64, ld)
            .map(Layout)
            .map_err(lt_error("cublasLtMatrixLayoutCreate"))
    }
}

impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: created once and destroyed once, here.
        let _ = unsafe { result::destroy_matrix_layout(self.0) };
    }
}

/// A heuristic preference, destroyed on drop.
struct Pref(sys::cublasLtMatmulPreference_t);

impl Pref {
    fn set<T>(&self, attr: sys::cublasLtMatmulPreferenceAttributes_t, value: &T) -> Result<()> {
        // SAFETY: as `Desc::set`.
        unsafe {
            result::set_matmul_pref_attribute(
                self.0,
                attr,
                std::ptr::from_ref(value).cast::<c_void>(),
                size_of::<T>(),
            )
        }
        .map_err(lt_error("cublasLtMatmulPreferenceSetAttribute"))
    }
}

impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created once and destroyed once, here.
        let _ = unsafe { result::destroy_matmul_pref(self.0) };
    }
}

/// A cuBLASLt handle of the device's context.
#[derive(Debug)]
pub(crate) struct BlasLt {
    handle: sys::cublasLtHandle_t,
}

// SAFETY: a cuBLASLt handle may be used from any thread as long as calls on it do not
// overlap; the backend keeps it behind a mutex.
unsafe impl Send for BlasLt {}

impl BlasLt {
    /// A handle, or why there is none: libcublasLt cannot be loaded, or `cublasLtCreate`
    /// failed (the caller then runs cuBLAS and its own kernels, and says why). The caller
    /// has bound the device's context.
    pub(crate) fn new() -> std::result::Result<BlasLt, String> {
        // SAFETY: only tries to open the library by its candidate names.
        if !unsafe { sys::is_culib_present() } {
            return Err("libcublasLt could not be loaded".to_string());
        }
        let handle = result::create_handle().map_err(|e| format!("cublasLtCreate: {e:?}"))?;
        Ok(BlasLt { handle })
    }

    /// Runs `g` on the legacy default stream (every op's) with `workspace` (`(address,
    /// bytes)`, from the device's caching allocator); `tf32` lets f32 products use TF32
    /// tensor cores. Returns `Ok(false)` when the caller must run the unfused path instead,
    /// as PyTorch's `gemm_and_bias` returning `false` makes it: a dimension of 1 (which
    /// PyTorch's `addmm` never sends to cuBLASLt: its heuristic fails on them), no algorithm
    /// for this product and epilogue, or `cublasLtMatmul` failing (PyTorch warns and falls
    /// back; so does this, once per process).
    ///
    /// # Safety
    ///
    /// The context is bound; every pointer of `g` is a live device allocation holding what
    /// its dimensions and leading dimensions address (the epilogue's bias `m` elements, its
    /// aux `m * n`, its bias gradient `n` for `BGRADB` and `m` for `DGELU_BGRAD`), D aliases
    /// no input, and the workspace is not used by anything else queued concurrently.
    ///
    /// # Errors
    ///
    /// A descriptor cuBLASLt refuses, or a heuristic error other than finding no algorithm
    /// (PyTorch checks the heuristic's status too): a mistake in the call, not a product
    /// cuBLASLt cannot run.
    pub(crate) unsafe fn matmul(
        &self,
        g: &LtGemm,
        workspace: Option<(u64, usize)>,
        tf32: bool,
    ) -> Result<bool> {
        if g.m <= 1 || g.n <= 1 || g.k <= 1 {
            return Ok(false);
        }
        let compute = if g.dtype == DType::F32 && tf32 {
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
        } else {
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
        };
        let desc = Desc(
            result::create_matmul_desc(compute, sys::cudaDataType::CUDA_R_32F)
                .map_err(lt_error("cublasLtMatmulDescCreate"))?,
        );
        // cublasOperation_t (an int32): CUBLAS_OP_N = 0, CUBLAS_OP_T = 1.
        let op = |t: bool| i32::from(t);
        use sys::cublasLtMatmulDescAttributes_t as A;
        desc.set(A::CUBLASLT_MATMUL_DESC_TRANSA, &op(g.trans_a))?;
        desc.set(A::CUBLASLT_MATMUL_DESC_TRANSB, &op(g.trans_b))?;
        use sys::cublasLtEpilogue_t as E;
        // The aux and bias vectors are D's type: cuBLASLt's default when their data-type
        // attributes are left unset (as PyTorch leaves them), so they are not set.
        let (epilogue, vector) = match g.epilogue {
            Epilogue::Bias { bias } => (E::CUBLASLT_EPILOGUE_BIAS, bias),
            Epilogue::Gelu { bias, aux } => {
                if aux != 0 {
                    let ld = g.m as i64;
                    desc.set(A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &(aux as *mut c_void))?;
                    desc.set(A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld)?;
                }
                let e = match (bias != 0, aux != 0) {
                    (true, true) => E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
                    (true, false) => E::CUBLASLT_EPILOGUE_GELU_BIAS,
                    (false, true) => E::CUBLASLT_EPILOGUE_GELU_AUX,
                    (false, false) => E::CUBLASLT_EPILOGUE_GELU,
                };
                (e, bias)
            }
            Epilogue::BgradB { bias_grad } => (E::CUBLASLT_EPILOGUE_BGRADB, bias_grad),
            Epilogue::DgeluBgrad { aux, bias_grad } => {
                let ld = g.m as i64;
                desc.set(A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &(aux as *mut c_void))?;
                desc.set(A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld)?;
                (E::CUBLASLT_EPILOGUE_DGELU_BGRAD, bias_grad)
            }
        };
        desc.set(A::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?;
        if vector != 0 {
            desc.set(A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &(vector as *mut c_void))?;
        }
        // Stored shapes: op(A) is m x k, so A is k x m when transposed.
        let (ar, ac) = if g.trans_a { (g.k, g.m) } else { (g.m, g.k) };
        let (br, bc) = if g.trans_b { (g.n, g.k) } else { (g.k, g.n) };
        let a_layout = Layout::new(g.dtype, ar, ac, g.lda)?;
        let b_layout = Layout::new(g.dtype, br, bc, g.ldb)?;
        let d_layout = Layout::new(g.dtype, g.m, g.n, g.ldd)?;
        let pref =
            Pref(result::create_matmul_pref().map_err(lt_error("cublasLtMatmulPreferenceCreate"))?);
        let (ws_ptr, ws_bytes) = workspace.unwrap_or((0, 0));
        use sys::cublasLtMatmulPreferenceAttributes_t as P;
        pref.set(P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &(ws_bytes as u64))?;
        // As PyTorch: the pointers' actual alignment, so that the heuristic picks no
        // algorithm that needs more (the bias vector's is D's).
        pref.set(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &alignment(g.a))?;
        pref.set(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &alignment(g.b))?;
        pref.set(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &alignment(g.d))?;
        let d_align =
            if vector != 0 { alignment(g.d).min(alignment(vector)) } else { alignment(g.d) };
        pref.set(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &d_align)?;
        // SAFETY: every descriptor is live; the heuristic reads no device memory.
        let heuristic = unsafe {
            result::get_matmul_algo_heuristic(
                self.handle,
                desc.0,
                a_layout.0,
                b_layout.0,
                d_layout.0,
                d_layout.0,
                pref.0,
            )
        };
        // cudarc reports no algorithm found as NOT_SUPPORTED (PyTorch's `returnedResult ==
        // 0`); any other status is an error, as PyTorch's check of the call makes it.
        let heuristic = match heuristic {
            Ok(h) => h,
            Err(CublasError(sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED)) => return Ok(false),
            Err(e) => return Err(lt_error("cublasLtMatmulAlgoGetHeuristic")(e)),
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the caller's contract: the pointers hold what the layouts address; alpha
        // and beta are f32 host values (scale type 32F); C is D with beta = 0 (not read);
        // the algorithm came from the heuristic for these descriptors and needs at most
        // `ws_bytes` of workspace.
        let status = unsafe {
            result::matmul(
                self.handle,
                desc.0,
                std::ptr::from_ref(&alpha).cast::<c_void>(),
                std::ptr::from_ref(&beta).cast::<c_void>(),
                g.a as *const c_void,
                a_layout.0,
                g.b as *const c_void,
                b_layout.0,
                g.d as *const c_void,
                d_layout.0,
                g.d as *mut c_void,
                d_layout.0,
                &heuristic.algo,
                ws_ptr as *mut c_void,
                ws_bytes,
                std::ptr::null_mut(),
            )
        };
        match status {
            Ok(()) => Ok(true),
            Err(CublasError(status)) => {
                warn_fallback_once(g, status);
                Ok(false)
            }
        }
    }
}

/// PyTorch's warning when `cublasLtMatmul` fails ("Will attempt to recover by calling
/// unfused cublas path"), printed for the first failure of the process; every fallback is
/// counted ([`crate::Device::cublaslt_fallbacks`]).
fn warn_fallback_once(g: &LtGemm, status: sys::cublasStatus_t) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| {
        eprintln!(
            "vram: cublasLtMatmul failed ({status:?}) for a {:?} product m {} n {} k {} \
             (transposes {} {}, epilogue {:?}); running the unfused cuBLAS path instead \
             (Device::cublaslt_fallbacks counts every such product)",
            g.dtype, g.m, g.n, g.k, g.trans_a, g.trans_b, g.epilogue
        );
    });
}

impl Drop for BlasLt {
    fn drop(&mut self) {
        // SAFETY: the handle was created in `new` and is destroyed once, here.
        let _ = unsafe { result::destroy_handle(self.handle) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_is_the_largest_power_of_two_up_to_256() {
        assert_eq!(alignment(0), 256);
        assert_eq!(alignment(512), 256);
        assert_eq!(alignment(96), 32);
        assert_eq!(alignment(2), 2);
        assert_eq!(alignment(7), 1);
    }

    #[test]
    fn the_lt_workspace_is_pytorchs_default_capped_by_the_cublas_workspace() {
        if std::env::var_os("CUBLASLT_WORKSPACE_SIZE").is_some() {
            return;
        }
        assert_eq!(lt_workspace_bytes(32 << 20), 1 << 20);
        assert_eq!(lt_workspace_bytes(4096), 4096);
        assert_eq!(lt_workspace_bytes(0), 0);
    }
}
