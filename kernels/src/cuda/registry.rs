//! The typed kernel registry: every `.cu` module and every kernel the Rust side launches,
//! with its parameter list, in one const table.
//!
//! The launch code ([`super::CudaBackend::launch`]) refuses arguments that do not match the
//! entry's parameters, and the NVRTC test (`nvrtc_check.rs`) compiles every module and
//! checks each entry's name and parameters against the PTX: together they cover what
//! actually runs. A kernel exists once per storage type (`relu_f32`, `relu_f16`,
//! `relu_bf16`), once per pair of storage types (`cast_f16_bf16`), or once (`sum_final`);
//! its names are `&'static str`s built at compile time, so a launch looks one up without
//! formatting a string.

use crate::dtype::DType;

/// Helpers every module uses (type conversions, block reductions), prepended to each source.
pub(crate) const COMMON: &str = include_str!("kernels/common.cuh");

/// One `.cu` source: a unit of compilation.
#[derive(Debug)]
pub(crate) struct Module {
    /// The file name without `.cu`.
    pub(crate) name: &'static str,
    /// The source, without [`COMMON`].
    pub(crate) source: &'static str,
}

/// Fill, arithmetic, activations, casts, bias broadcast.
pub(crate) const ELEMENTWISE: Module =
    Module { name: "elementwise", source: include_str!("kernels/elementwise.cu") };
/// Whole-tensor, row and column sums.
pub(crate) const REDUCE: Module =
    Module { name: "reduce", source: include_str!("kernels/reduce.cu") };
/// Softmax, cross-entropy, layer norm, batch norm.
pub(crate) const SOFTMAX: Module =
    Module { name: "softmax", source: include_str!("kernels/softmax.cu") };
/// im2col / col2im and the depthwise convolution.
pub(crate) const CONV: Module = Module { name: "conv", source: include_str!("kernels/conv.cu") };
/// Max and average pooling.
pub(crate) const POOL: Module = Module { name: "pool", source: include_str!("kernels/pool.cu") };
/// Embedding, dropout, optimizers, unscale, axis permutation.
pub(crate) const MISC: Module = Module { name: "misc", source: include_str!("kernels/misc.cu") };
/// Fused epilogues: bias + GELU forward and backward, residual add with dropout on the
/// branch, alone or + layer norm.
pub(crate) const FUSED: Module = Module { name: "fused", source: include_str!("kernels/fused.cu") };
/// Multi-tensor optimizer steps (one launch over every parameter).
pub(crate) const MULTI_TENSOR: Module =
    Module { name: "multi_tensor", source: include_str!("kernels/multi_tensor.cu") };

/// RMS norm and rotary embeddings (the Llama family's).
pub(crate) const LLAMA: Module = Module { name: "llama", source: include_str!("kernels/llama.cu") };

/// Fused scaled dot-product attention, forward and backward.
pub(crate) const ATTENTION: Module =
    Module { name: "attention", source: include_str!("kernels/attention.cu") };

/// Every module, in the order the NVRTC test compiles them.
#[cfg(test)]
pub(crate) const MODULES: &[&Module] = &[
    &ELEMENTWISE,
    &REDUCE,
    &SOFTMAX,
    &CONV,
    &POOL,
    &MISC,
    &LLAMA,
    &ATTENTION,
    &MULTI_TENSOR,
    &FUSED,
];

/// A kernel parameter's type as the `.cu` source declares it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Param {
    /// A device pointer (`T*`).
    Ptr,
    /// `u64`.
    U64,
    /// `i64`.
    I64,
    /// `u32`.
    U32,
    /// `float`.
    F32,
    /// `ConvGeom` by value (sixteen i64).
    Conv,
    /// `PoolGeom` by value (twelve i64).
    Pool,
    /// `Div` by value (two u64, two u32).
    Div,
}

impl Param {
    /// How PTX declares a parameter of this type: its `.param` type and, for a struct passed
    /// by value, its size in bytes.
    #[cfg(test)]
    pub(crate) fn ptx(self) -> (&'static str, usize) {
        match self {
            Param::Ptr | Param::U64 | Param::I64 => ("u64", 8),
            Param::U32 => ("u32", 4),
            Param::F32 => ("f32", 4),
            Param::Conv => ("b8", 16 * 8),
            Param::Pool => ("b8", 12 * 8),
            Param::Div => ("b8", 24),
        }
    }
}

/// One kernel of a module, instantiated per dtype, per dtype pair, or once.
#[derive(Debug)]
pub(crate) struct Kernel {
    /// The module that defines it.
    pub(crate) module: &'static Module,
    /// Its instantiations: 3 (one per [`DType`], in [`DType::ALL`] order), 9 (pairs `(a, b)`
    /// at `3 * a + b`) or 1.
    pub(crate) names: &'static [&'static str],
    /// Its parameters, in order.
    pub(crate) params: &'static [Param],
    /// For a plain map (`map0`/`map1`/`map2` in `common.cuh`, 16-byte packs per thread): the
    /// arrays it reads or writes (an array both read and written counts twice), each of which
    /// the NVRTC test expects to see moved in packs. `None` for every other kernel.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) map: Option<usize>,
}

/// The two kernels of a unary map (one `UNARY_OP` line of `elementwise.cu`, one
/// `unary_op!` entry of `ops::map`): the forward `base_T(const T* x, T* y, u64 n)` and the
/// backward `base_bwd_T(const T* x, const T* dy, T* dx, u64 n)`, both plain maps.
#[derive(Debug)]
pub(crate) struct UnaryKernels {
    /// `y = f(x)`.
    pub(crate) forward: Kernel,
    /// `dx = f'(x) dy`.
    pub(crate) backward: Kernel,
}

impl Kernel {
    /// The instantiation for `dtype` (the only one of a kernel declared `once`).
    pub(crate) fn of(&'static self, dtype: DType) -> Instance {
        let name = self.names.get(dtype.index()).copied().unwrap_or(self.names[0]);
        Instance { kernel: self, name }
    }

    /// The instantiation for the pair `(first, second)`.
    pub(crate) fn of_pair(&'static self, first: DType, second: DType) -> Instance {
        let i = 3 * first.index() + second.index();
        Instance { kernel: self, name: self.names.get(i).copied().unwrap_or(self.names[0]) }
    }
}

/// One instantiation of a [`Kernel`]: what a launch names.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Instance {
    /// The kernel (its module and parameters).
    pub(crate) kernel: &'static Kernel,
    /// The function's name in the module.
    pub(crate) name: &'static str,
}

/// Declares kernels: `NAME = module "base" [instances] (params) [map N];` where instances
/// is `dtypes` (`base_f32`, `base_f16`, `base_bf16`), `pairs` (`base_f32_f32`, ...) or
/// `once` (`base`), and `map N` marks a plain map of N array accesses ([`Kernel::map`]);
/// `NAME = unary "base";` declares a unary map's forward and backward at once
/// ([`UnaryKernels`], in `elementwise.cu`). Also collects every kernel in `ALL` and the
/// unary maps in `UNARY`, so that the tests that walk them need no list of their own.
macro_rules! kernels {
    // Each entry is munched into three accumulators: the items, `ALL`'s elements and
    // `UNARY`'s elements.
    (@munch [$($items:tt)*] [$($all:tt)*] [$($unary:tt)*]) => {
        $($items)*
        /// Every kernel the Rust side launches.
        #[cfg(test)]
        pub(crate) const ALL: &[&Kernel] = &[$($all)*];
        /// Every unary map.
        #[cfg(test)]
        pub(crate) const UNARY: &[&UnaryKernels] = &[$($unary)*];
    };
    (
        @munch [$($items:tt)*] [$($all:tt)*] [$($unary:tt)*]
        $(#[$doc:meta])* $id:ident = unary $base:literal; $($rest:tt)*
    ) => {
        kernels! {
            @munch
            [
                $($items)*
                $(#[$doc])*
                pub(crate) const $id: UnaryKernels = UnaryKernels {
                    forward: Kernel {
                        module: &ELEMENTWISE,
                        names: &kernels!(@names dtypes $base),
                        params: &[Param::Ptr, Param::Ptr, Param::U64],
                        map: Some(2),
                    },
                    backward: Kernel {
                        module: &ELEMENTWISE,
                        names: &kernels!(@names dtypes concat!($base, "_bwd")),
                        params: &[Param::Ptr, Param::Ptr, Param::Ptr, Param::U64],
                        map: Some(3),
                    },
                };
            ]
            [$($all)* &$id.forward, &$id.backward,]
            [$($unary)* &$id,]
            $($rest)*
        }
    };
    (
        @munch [$($items:tt)*] [$($all:tt)*] [$($unary:tt)*]
        $(#[$doc:meta])* $id:ident = $module:ident $base:literal $inst:ident ($($p:ident),*)
        $(map $arrays:literal)?; $($rest:tt)*
    ) => {
        kernels! {
            @munch
            [
                $($items)*
                $(#[$doc])*
                pub(crate) const $id: Kernel = Kernel {
                    module: &$module,
                    names: &kernels!(@names $inst $base),
                    params: &[$(Param::$p),*],
                    map: kernels!(@map $($arrays)?),
                };
            ]
            [$($all)* &$id,]
            [$($unary)*]
            $($rest)*
        }
    };
    (@map) => { None };
    (@map $arrays:literal) => { Some($arrays) };
    (@names dtypes $b:expr) => {
        [concat!($b, "_f32"), concat!($b, "_f16"), concat!($b, "_bf16")]
    };
    (@names pairs $b:expr) => {
        [
            concat!($b, "_f32_f32"), concat!($b, "_f32_f16"), concat!($b, "_f32_bf16"),
            concat!($b, "_f16_f32"), concat!($b, "_f16_f16"), concat!($b, "_f16_bf16"),
            concat!($b, "_bf16_f32"), concat!($b, "_bf16_f16"), concat!($b, "_bf16_bf16"),
        ]
    };
    (@names once $b:expr) => {
        [$b]
    };
    ($($entries:tt)*) => {
        kernels!(@munch [] [] [] $($entries)*);
    };
}

kernels! {
    /// `fill(T* y, float v, u64 n)`.
    FILL = ELEMENTWISE "fill" dtypes (Ptr, F32, U64) map 1;
    /// `add(const T* a, const T* b, T* y, u64 n)`.
    ADD = ELEMENTWISE "add" dtypes (Ptr, Ptr, Ptr, U64) map 3;
    /// `mul(const T* a, const T* b, T* y, u64 n)`.
    MUL = ELEMENTWISE "mul" dtypes (Ptr, Ptr, Ptr, U64) map 3;
    /// `scale(const T* x, float alpha, T* y, u64 n)`.
    SCALE = ELEMENTWISE "scale" dtypes (Ptr, F32, Ptr, U64) map 2;
    /// `relu` and `relu_bwd`.
    RELU = unary "relu";
    /// `gelu` and `gelu_bwd`.
    GELU = unary "gelu";
    /// `hardswish` and `hardswish_bwd`.
    HARDSWISH = unary "hardswish";
    /// `hardsigmoid` and `hardsigmoid_bwd`.
    HARDSIGMOID = unary "hardsigmoid";
    /// `silu` and `silu_bwd`.
    SILU = unary "silu";
    /// `scale_channels(const T* x, const T* s, T* y, u64 n, Div hw)`.
    SCALE_CHANNELS = ELEMENTWISE "scale_channels" dtypes (Ptr, Ptr, Ptr, U64, Div);
    /// `scale_channels_bwd(const T* x, const T* s, const T* dy, T* dx, T* ds, u64 hw)`.
    SCALE_CHANNELS_BWD = ELEMENTWISE "scale_channels_bwd" dtypes (Ptr, Ptr, Ptr, Ptr, Ptr, U64);
    /// `scale_channels_nhwc(const T* x, const T* s, T* y, u64 n, Div c, Div hwc)`.
    SCALE_CHANNELS_NHWC = ELEMENTWISE "scale_channels_nhwc" dtypes (Ptr, Ptr, Ptr, U64, Div, Div);
    /// `scale_channels_nhwc_bwd(const T* x, const T* s, const T* dy, T* dx, double* partial,
    /// T* ds, u64 total, Div c, Div chunks, u64 hw, u64 rows)`.
    SCALE_CHANNELS_NHWC_BWD = ELEMENTWISE "scale_channels_nhwc_bwd" dtypes
        (Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U64, Div, Div, U64, U64);
    /// `scale_channels_nhwc_bwd_finish(const double* partial, T* ds, u64 total, Div c, u64
    /// chunks)`.
    SCALE_CHANNELS_NHWC_BWD_FINISH = ELEMENTWISE "scale_channels_nhwc_bwd_finish" dtypes
        (Ptr, Ptr, U64, Div, U64);
    /// `bias_add(const T* x, const T* b, T* y, u64 n, Div d)`.
    BIAS_ADD = ELEMENTWISE "bias_add" dtypes (Ptr, Ptr, Ptr, U64, Div);
    /// `bias_fill(const T* b, T* y, u64 n, Div d)`.
    BIAS_FILL = ELEMENTWISE "bias_fill" dtypes (Ptr, Ptr, U64, Div);
    /// `broadcast_rows(const T* dy, float f, T* dx, u64 n, Div d)`.
    BROADCAST_ROWS = ELEMENTWISE "broadcast_rows" dtypes (Ptr, F32, Ptr, U64, Div);
    /// `broadcast_rows_add(const T* dy, float f, T* acc, u64 n, Div d)`.
    BROADCAST_ROWS_ADD = ELEMENTWISE "broadcast_rows_add" dtypes (Ptr, F32, Ptr, U64, Div);
    /// `cast_S_D(const S* x, D* y, u64 n)`.
    CAST = ELEMENTWISE "cast" pairs (Ptr, Ptr, U64) map 2;
    /// `add_assign_A_X(A* acc, const X* x, u64 n)`.
    ADD_ASSIGN = ELEMENTWISE "add_assign" pairs (Ptr, Ptr, U64) map 3;
    /// `axpy_Y_X(float alpha, const X* x, Y* y, u64 n)`.
    AXPY = ELEMENTWISE "axpy" pairs (F32, Ptr, Ptr, U64) map 3;

    /// `sum_partial(const T* x, u64 n, float* partial)`.
    SUM_PARTIAL = REDUCE "sum_partial" dtypes (Ptr, U64, Ptr);
    /// `sum_final(const float* partial, u32 count, float* out)`.
    SUM_FINAL = REDUCE "sum_final" once (Ptr, U32, Ptr);
    /// `row_sum(const T* x, T* y, u64 d, float scale)`.
    ROW_SUM = REDUCE "row_sum" dtypes (Ptr, Ptr, U64, F32);
    /// `row_sum_f32(const T* x, float* y, u64 d)`.
    ROW_SUM_F32 = REDUCE "row_sum_f32" dtypes (Ptr, Ptr, U64);
    /// `col_sum(const T* x, float* acc, u64 rows, u64 d, u64 chunk)`.
    COL_SUM = REDUCE "col_sum" dtypes (Ptr, Ptr, U64, U64, U64);

    /// `softmax(const T* x, T* y, u64 cols, u64 seq)`.
    SOFTMAX_FWD = SOFTMAX "softmax" dtypes (Ptr, Ptr, U64, U64);
    /// `softmax_bwd(const T* y, const T* dy, T* dx, u64 cols, u64 seq)`.
    SOFTMAX_BWD = SOFTMAX "softmax_bwd" dtypes (Ptr, Ptr, Ptr, U64, U64);
    /// `ce_fwd(const T* x, const u32* t, u64 c, u32 ignore, u32 has_ignore, float* lse,
    /// float* loss)`.
    CE_FWD = SOFTMAX "ce_fwd" dtypes (Ptr, Ptr, U64, U32, U32, Ptr, Ptr);
    /// `ce_bwd(const T* x, const u32* t, const float* lse, float g, Div c, u32 ignore,
    /// u32 has_ignore, T* dx, u64 n)`.
    CE_BWD = SOFTMAX "ce_bwd" dtypes (Ptr, Ptr, Ptr, F32, Div, U32, U32, Ptr, U64);
    /// `layer_norm(const T* x, const T* g, const T* b, float eps, T* y, float* m, float* r,
    /// u64 d)`.
    LAYER_NORM = SOFTMAX "layer_norm" dtypes (Ptr, Ptr, Ptr, F32, Ptr, Ptr, Ptr, U64);
    /// `layer_norm_bwd_fused(const T* x, const T* g, const float* m, const float* r, const T*
    /// dy, T* dx, float* dg, float* db, u64 rows, u64 d, u64 chunk, u32 col_blocks, u32
    /// chunk_blocks)`: dx rows and dgamma/dbeta partials in one launch.
    LAYER_NORM_BWD_FUSED = SOFTMAX "layer_norm_bwd_fused" dtypes
        (Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U64, U64, U64, U32, U32);
    /// `layer_norm_bwd_finish(const float* dg, const float* db, T* dgamma, T* dbeta, u64
    /// chunks, u64 d)`.
    LAYER_NORM_BWD_FINISH = SOFTMAX "layer_norm_bwd_finish" dtypes (Ptr, Ptr, Ptr, Ptr, U64, U64);
    /// `layer_norm_bwd_residual_R_B(const R* x, const R* g, const float* m, const float* r,
    /// const R* dy, const R* dres, R* dx, B* db, u32 has_branch, float p, float scale, u64
    /// seed, u64 offset, float* dg, float* dbp, u64 rows, u64 d, u64 chunk, u32 col_blocks,
    /// u32 chunk_blocks)`: `layer_norm_bwd_fused` plus a residual's gradient and the branch's.
    LAYER_NORM_BWD_RESIDUAL = SOFTMAX "layer_norm_bwd_residual" pairs
        (Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, F32, F32, U64, U64, Ptr, Ptr, U64, U64, U64,
         U32, U32);
    /// `bn_partial(const T* x, float* part, u64 n, u64 c, u64 s, u32 parts)`.
    BN_PARTIAL = SOFTMAX "bn_partial" dtypes (Ptr, Ptr, U64, U64, U64, U32);
    /// `bn_finalize(const float* part, float* mean, float* invstd, void* rmean, void* rvar,
    /// u32 pf32, u32 update, float momentum, float eps, u64 n, u64 c, u64 s, u32 parts)`.
    BN_FINALIZE = SOFTMAX "bn_finalize" dtypes
        (Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, F32, F32, U64, U64, U64, U32);
    /// `bn_eval_stats(const void* rmean, const void* rvar, u32 pf32, float eps, float* mean,
    /// float* invstd, u64 c)`.
    BN_EVAL_STATS = SOFTMAX "bn_eval_stats" dtypes (Ptr, Ptr, U32, F32, Ptr, Ptr, U64);
    /// `bn_apply(const T* x, const float* mean, const float* invstd, const void* g, const
    /// void* b, u32 pf32, T* y, u64 total, Div c, Div s)`.
    BN_APPLY = SOFTMAX "bn_apply" dtypes (Ptr, Ptr, Ptr, Ptr, Ptr, U32, Ptr, U64, Div, Div);
    /// `bn_bwd_partial(const T* x, const T* dy, const float* mean, const float* invstd,
    /// float* part, u64 n, u64 c, u64 s, u32 parts)`.
    BN_BWD_PARTIAL = SOFTMAX "bn_bwd_partial" dtypes (Ptr, Ptr, Ptr, Ptr, Ptr, U64, U64, U64, U32);
    /// `bn_bwd_finalize(const float* part, float* sums, u64 c, u32 parts)`.
    BN_BWD_FINALIZE = SOFTMAX "bn_bwd_finalize" once (Ptr, Ptr, U64, U32);
    /// `bn_bwd_dx(const T* x, const T* dy, const float* mean, const float* invstd, const void*
    /// g, u32 pf32, const float* sums, T* dx, u64 total, Div c, Div s)`.
    BN_BWD_DX = SOFTMAX "bn_bwd_dx" dtypes (Ptr, Ptr, Ptr, Ptr, Ptr, U32, Ptr, Ptr, U64, Div, Div);
    /// `bn_nhwc_partial(const T* x, float* part, u64 rows, u64 c, u32 parts)`: `bn_partial`
    /// over a channels_last `[rows, c]`, grid `(ceil(c / 32), parts)`.
    BN_NHWC_PARTIAL = SOFTMAX "bn_nhwc_partial" dtypes (Ptr, Ptr, U64, U64, U32);
    /// `bn_nhwc_bwd_partial(const T* x, const T* dy, const float* mean, const float* invstd,
    /// float* part, u64 rows, u64 c, u32 parts)`: `bn_bwd_partial` over a channels_last
    /// `[rows, c]`, grid `(ceil(c / 32), parts)`.
    BN_NHWC_BWD_PARTIAL = SOFTMAX "bn_nhwc_bwd_partial" dtypes
        (Ptr, Ptr, Ptr, Ptr, Ptr, U64, U64, U32);

    /// `im2col(const T* x, T* col, ConvGeom g, i64 n0, i64 nimg, i64 group, u32 rows_outer)`.
    IM2COL = CONV "im2col" dtypes (Ptr, Ptr, Conv, I64, I64, I64, U32);
    /// `col2im(const float* dcol, T* dx, ConvGeom g, i64 n0, i64 nimg, i64 group)`.
    COL2IM = CONV "col2im" dtypes (Ptr, Ptr, Conv, I64, I64, I64);
    /// `bias_planes(const T* b, T* y, u64 n, Div c, Div ohw)`.
    BIAS_PLANES = CONV "bias_planes" dtypes (Ptr, Ptr, U64, Div, Div);
    /// `direct_fwd(const T* x, const T* w, const T* b, u32 has_b, T* y, ConvGeom g)`.
    DIRECT_FWD = CONV "direct_fwd" dtypes (Ptr, Ptr, Ptr, U32, Ptr, Conv);
    /// `direct_bwd_input(const T* w, const T* dy, T* dx, ConvGeom g)`.
    DIRECT_BWD_INPUT = CONV "direct_bwd_input" dtypes (Ptr, Ptr, Ptr, Conv);
    /// `direct_bwd_weight(const T* x, const T* dy, T* dw, ConvGeom g)`, one block per weight
    /// element.
    DIRECT_BWD_WEIGHT = CONV "direct_bwd_weight" dtypes (Ptr, Ptr, Ptr, Conv);
    /// `depthwise_bwd_weight(const T* x, const T* dy, float* partial, ConvGeom g)`.
    DEPTHWISE_BWD_WEIGHT = CONV "depthwise_bwd_weight" dtypes (Ptr, Ptr, Ptr, Conv);

    /// `max_pool(const T* x, T* y, u32* arg, PoolGeom g, Div ow, Div oh)`.
    MAX_POOL = POOL "max_pool" dtypes (Ptr, Ptr, Ptr, Pool, Div, Div);
    /// `max_pool_bwd(const T* dy, const u32* arg, float* acc, PoolGeom g, Div ohw)`.
    MAX_POOL_BWD = POOL "max_pool_bwd" dtypes (Ptr, Ptr, Ptr, Pool, Div, Div, Div, Div);
    /// `avg_pool(const T* x, T* y, PoolGeom g, u32 include_pad, Div ow, Div oh)`.
    AVG_POOL = POOL "avg_pool" dtypes (Ptr, Ptr, Pool, U32, Div, Div);
    /// `avg_pool_bwd(const T* dy, T* dx, PoolGeom g, u32 include_pad, Div w, Div h, Div sh,
    /// Div sw)`.
    AVG_POOL_BWD = POOL "avg_pool_bwd" dtypes (Ptr, Ptr, Pool, U32, Div, Div, Div, Div);

    /// `max_pool_nhwc(const T* x, T* y, u32* arg, PoolGeom g, Div c, Div ow, Div oh)`.
    MAX_POOL_NHWC = POOL "max_pool_nhwc" dtypes (Ptr, Ptr, Ptr, Pool, Div, Div, Div);
    /// `max_pool_nhwc_bwd(const T* dy, const u32* arg, T* dx, PoolGeom g, Div c, Div w, Div h,
    /// Div sh, Div sw)`.
    MAX_POOL_NHWC_BWD = POOL "max_pool_nhwc_bwd" dtypes (Ptr, Ptr, Ptr, Pool, Div, Div, Div, Div, Div);
    /// `global_avg_pool_nhwc(const T* x, float* partial, T* y, u64 total, Div c, Div chunks,
    /// u64 hw, u64 rows)`.
    GLOBAL_AVG_POOL_NHWC = POOL "global_avg_pool_nhwc" dtypes (Ptr, Ptr, Ptr, U64, Div, Div, U64, U64);
    /// `global_avg_pool_nhwc_finish(const float* partial, T* y, u64 total, Div c, u64 chunks,
    /// u64 hw)`.
    GLOBAL_AVG_POOL_NHWC_FINISH = POOL "global_avg_pool_nhwc_finish" dtypes
        (Ptr, Ptr, U64, Div, U64, U64);
    /// `global_avg_pool_nhwc_bwd(const T* dy, T* dx, u64 n, Div c, Div hwc, float hw, u32
    /// add)`.
    GLOBAL_AVG_POOL_NHWC_BWD = POOL "global_avg_pool_nhwc_bwd" dtypes
        (Ptr, Ptr, U64, Div, Div, F32, U32);

    /// `embedding(const u32* ids, const T* table, T* out, u64 n, Div dim)`.
    EMBEDDING = MISC "embedding" dtypes (Ptr, Ptr, Ptr, U64, Div);
    /// `embedding_bwd(const u32* ids, const T* dout, float* acc, u64 n, Div dim)`.
    EMBEDDING_BWD = MISC "embedding_bwd" dtypes (Ptr, Ptr, Ptr, U64, U64, U64);
    /// `dropout(const T* x, T* y, u64 n, float p, float scale, u64 seed, u64 offset)`.
    DROPOUT = MISC "dropout" dtypes (Ptr, Ptr, U64, F32, F32, U64, U64);
    /// `sgd(float* p, const T* g, float* buf, u64 n, float lr, float momentum, float
    /// dampening, float wd, u32 nesterov, u32 first_step)`.
    SGD = MISC "sgd" dtypes (Ptr, Ptr, Ptr, U64, F32, F32, F32, F32, U32, U32);
    /// `adamw(float* p, const T* g, float* m, float* v, u64 n, float b1, float b2, float
    /// eps, float step_size, float bias2_sqrt, float decay)`.
    ADAMW = MISC "adamw" dtypes (Ptr, Ptr, Ptr, Ptr, U64, F32, F32, F32, F32, F32, F32);
    /// `permute(const T* x, T* y, u64 n, Div d1, Div d2, Div d3, u64 s0, u64 s1, u64 s2,
    /// u64 s3)`.
    PERMUTE = MISC "permute" dtypes (Ptr, Ptr, U64, Div, Div, Div, U64, U64, U64, U64);
    /// `unscale(T* g, float inv, u64 n, u32* flag)`.
    UNSCALE = MISC "unscale" dtypes (Ptr, F32, U64, Ptr);

    /// `rms_norm(const T* x, const T* w, float eps, T* y, float* r, u64 d)`.
    RMS_NORM = LLAMA "rms_norm" dtypes (Ptr, Ptr, F32, Ptr, Ptr, U64);
    /// `rms_norm_bwd(const T* x, const T* w, const float* r, const T* dy, T* dx, u64 d)`.
    RMS_NORM_BWD = LLAMA "rms_norm_bwd" dtypes (Ptr, Ptr, Ptr, Ptr, Ptr, U64);
    /// `rms_norm_weight_bwd(const T* x, const float* r, const T* dy, float* dw, u64 rows,
    /// u64 d, u64 chunk)`.
    RMS_NORM_WEIGHT_BWD = LLAMA "rms_norm_weight_bwd" dtypes (Ptr, Ptr, Ptr, Ptr, U64, U64, U64);
    /// `rope(const T* x, const float* cos, const float* sin, T* y, float sign, u64 pairs,
    /// Div half, Div heads, Div seq)`.
    ROPE = LLAMA "rope" dtypes (Ptr, Ptr, Ptr, Ptr, F32, U64, Div, Div, Div);

    /// `attention_fwd(const T* q, const T* k, const T* v, T* o, float* lse, u64 seq, u64 d,
    /// u64 nh, u64 nkv, u64 group, float scale, u32 causal, float p, u64 seed, u64 offset)`, grid (query tiles, heads).
    ATTENTION_FWD = ATTENTION "attention_fwd" dtypes
        (Ptr, Ptr, Ptr, Ptr, Ptr, U64, U64, U64, U64, U64, F32, U32, F32, U64, U64);
    /// `attention_fwd_mma_f16(...)`: `attention_fwd`'s parameters, on tensor cores, grid
    /// (64-row query tiles, heads); head dims a multiple of 16.
    ATTENTION_FWD_MMA_F16 = ATTENTION "attention_fwd_mma_f16" once
        (Ptr, Ptr, Ptr, Ptr, Ptr, U64, U64, U64, U64, U64, F32, U32, F32, U64, U64);
    /// The same in bf16.
    ATTENTION_FWD_MMA_BF16 = ATTENTION "attention_fwd_mma_bf16" once
        (Ptr, Ptr, Ptr, Ptr, Ptr, U64, U64, U64, U64, U64, F32, U32, F32, U64, U64);
    /// `attention_bwd_dkdv_mma_f16(...)`: `attention_bwd_dkdv`'s parameters, on tensor
    /// cores, grid (64-key tiles, heads); head dims a multiple of 16.
    ATTENTION_BWD_DKDV_MMA_F16 = ATTENTION "attention_bwd_dkdv_mma_f16" once
        (Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U64, U64, U64, U64, U64, F32, U32, F32, U64, U64);
    /// The same in bf16.
    ATTENTION_BWD_DKDV_MMA_BF16 = ATTENTION "attention_bwd_dkdv_mma_bf16" once
        (Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U64, U64, U64, U64, U64, F32, U32, F32, U64, U64);
    /// `attention_bwd_dq_mma_f16(...)`: `attention_bwd_dq`'s parameters, on tensor cores,
    /// grid (64-row query tiles, heads); head dims a multiple of 16.
    ATTENTION_BWD_DQ_MMA_F16 = ATTENTION "attention_bwd_dq_mma_f16" once
        (Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U64, U64, U64, U64, U64, F32, U32, F32, U64, U64);
    /// The same in bf16.
    ATTENTION_BWD_DQ_MMA_BF16 = ATTENTION "attention_bwd_dq_mma_bf16" once
        (Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U64, U64, U64, U64, U64, F32, U32, F32, U64, U64);
    /// `attention_fwd_mma_d64_f16(...)`: `attention_fwd_mma_f16` for head dims of at most 64
    /// (its registers sized for 64).
    ATTENTION_FWD_MMA_D64_F16 = ATTENTION "attention_fwd_mma_d64_f16" once
        (Ptr, Ptr, Ptr, Ptr, Ptr, U64, U64, U64, U64, U64, F32, U32, F32, U64, U64);
    /// The same in bf16.
    ATTENTION_FWD_MMA_D64_BF16 = ATTENTION "attention_fwd_mma_d64_bf16" once
        (Ptr, Ptr, Ptr, Ptr, Ptr, U64, U64, U64, U64, U64, F32, U32, F32, U64, U64);
    /// `attention_bwd_dkdv_mma_d64_f16(...)`: `attention_bwd_dkdv_mma_f16` for head dims of
    /// at most 64.
    ATTENTION_BWD_DKDV_MMA_D64_F16 = ATTENTION "attention_bwd_dkdv_mma_d64_f16" once
        (Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U64, U64, U64, U64, U64, F32, U32, F32, U64, U64);
    /// The same in bf16.
    ATTENTION_BWD_DKDV_MMA_D64_BF16 = ATTENTION "attention_bwd_dkdv_mma_d64_bf16" once
        (Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U64, U64, U64, U64, U64, F32, U32, F32, U64, U64);
    /// `attention_bwd_dq_mma_d64_f16(...)`: `attention_bwd_dq_mma_f16` for head dims of at
    /// most 64.
    ATTENTION_BWD_DQ_MMA_D64_F16 = ATTENTION "attention_bwd_dq_mma_d64_f16" once
        (Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U64, U64, U64, U64, U64, F32, U32, F32, U64, U64);
    /// The same in bf16.
    ATTENTION_BWD_DQ_MMA_D64_BF16 = ATTENTION "attention_bwd_dq_mma_d64_bf16" once
        (Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U64, U64, U64, U64, U64, F32, U32, F32, U64, U64);
    /// `attention_bwd_dot(const T* o, const T* dout, float* dsum, u64 rows, u64 seq, u64 d,
    /// u64 nh)`.
    ATTENTION_BWD_DOT = ATTENTION "attention_bwd_dot" dtypes (Ptr, Ptr, Ptr, U64, U64, U64, U64);
    /// `attention_bwd_dkdv(const T* q, const T* k, const T* v, const T* dout, const float*
    /// lse, const float* dsum, T* dk, T* dv, u64 seq, u64 d, u64 nh, u64 nkv, u64 group, float scale, u32 causal, float p,
    /// u64 seed, u64 offset)`, grid (key tiles, heads).
    ATTENTION_BWD_DKDV = ATTENTION "attention_bwd_dkdv" dtypes
        (Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U64, U64, U64, U64, U64, F32, U32, F32, U64, U64);
    /// `attention_bwd_dq(const T* q, const T* k, const T* v, const T* dout, const float* lse,
    /// const float* dsum, T* dq, u64 seq, u64 d, u64 nh, u64 nkv, u64 group, float scale, u32 causal, float p, u64 seed,
    /// u64 offset)`, grid (query tiles, heads).
    ATTENTION_BWD_DQ = ATTENTION "attention_bwd_dq" dtypes
        (Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U64, U64, U64, U64, U64, F32, U32, F32, U64, U64);

    /// `adamw_multi(const MultiEntry* table, const MultiTask* tasks, float b1, float b2,
    /// float eps, float decay, u64 chunk)`.
    ADAMW_MULTI = MULTI_TENSOR "adamw_multi" once (Ptr, Ptr, F32, F32, F32, F32, U64);
    /// `sgd_multi(const MultiEntry* table, const MultiTask* tasks, float lr, float momentum,
    /// float dampening, float wd, u32 nesterov, u64 chunk)`.
    SGD_MULTI = MULTI_TENSOR "sgd_multi" once (Ptr, Ptr, F32, F32, F32, F32, U32, U64);

    /// `bias_gelu(const T* x, const T* b, T* y, u64 n, Div d)`.
    BIAS_GELU = FUSED "bias_gelu" dtypes (Ptr, Ptr, Ptr, U64, Div);
    /// `bias_gelu_bwd(const T* x, const T* b, const T* dy, T* dx, float* part, u64 rows, u64
    /// d, u64 chunk)`.
    BIAS_GELU_BWD = FUSED "bias_gelu_bwd" dtypes (Ptr, Ptr, Ptr, Ptr, Ptr, U64, U64, U64);
    /// `column_finish(const float* part, T* out, u64 chunks, u64 d)`.
    COLUMN_FINISH = FUSED "column_finish" dtypes (Ptr, Ptr, U64, U64);
    /// `dropout_add_R_B(const R* a, const B* b, R* y, u64 n, float p, float scale, u64 seed,
    /// u64 offset)`.
    DROPOUT_ADD = FUSED "dropout_add" pairs (Ptr, Ptr, Ptr, U64, F32, F32, U64, U64);
    /// `dropout_add_bwd_R_B(const R* dy, B* db, u64 n, float p, float scale, u64 seed, u64
    /// offset)`.
    DROPOUT_ADD_BWD = FUSED "dropout_add_bwd" pairs (Ptr, Ptr, U64, F32, F32, U64, U64);
    /// `add_layer_norm_R_B(const R* a, const B* b, const R* g, const R* beta, float eps,
    /// float p, float scale, u64 seed, u64 offset, R* s, R* y, float* m, float* r, u64 d)`.
    ADD_LAYER_NORM = FUSED "add_layer_norm" pairs
        (Ptr, Ptr, Ptr, Ptr, F32, F32, F32, U64, U64, Ptr, Ptr, Ptr, Ptr, U64);
}
