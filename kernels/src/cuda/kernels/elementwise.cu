// Elementwise arithmetic, activations, casts, bias broadcast: arithmetic in f32, one rounding
// to the storage type, as on the host. The plain maps (fills, scales, activations, add, mul,
// casts, in-place updates) go through `map0`/`map1`/`map2` (common.cuh: 16-byte packs per
// thread, launched with `launch::map`); the indexed ones are one thread per element.

template <typename T> __device__ void fill_impl(T* y, float v, u64 n) { map0(y, n, v); }
template <typename T> __device__ void scale_impl(const T* x, float alpha, T* y, u64 n) {
    map1(x, y, n, [=](float v) { return alpha * v; });
}
// y = x + bias[i % d]
template <typename T>
__device__ void bias_add_impl(const T* x, const T* bias, T* y, u64 n, Div d) {
    FOR_EACH(i, n) y[i] = from_f32<T>(to_f32(x[i]) + to_f32(bias[d.mod(i)]));
}
// y[i] = bias[i % d]: the C operand of a linear layer's gemm with beta = 1.
template <typename T> __device__ void bias_fill_impl(const T* bias, T* y, u64 n, Div d) {
    FOR_EACH(i, n) y[i] = bias[d.mod(i)];
}
// dx[i] = dy[i / d] * factor (backward of row sums and means, global average pool).
template <typename T>
__device__ void broadcast_rows_impl(const T* dy, float factor, T* dx, u64 n, Div d) {
    FOR_EACH(i, n) dx[i] = from_f32<T>(to_f32(dy[d.div(i)]) * factor);
}
// acc[i] += dy[i / d] * factor, one rounding (a global average pool's gradient added in place).
template <typename T>
__device__ void broadcast_rows_add_impl(const T* dy, float factor, T* acc, u64 n, Div d) {
    FOR_EACH(i, n) acc[i] = from_f32<T>(to_f32(acc[i]) + to_f32(dy[d.div(i)]) * factor);
}

#define PER_DTYPE(T, S) \
    extern "C" __global__ void fill_##S(T* y, float v, u64 n) { fill_impl<T>(y, v, n); } \
    extern "C" __global__ void scale_##S(const T* x, float alpha, T* y, u64 n) { scale_impl<T>(x, alpha, y, n); } \
    extern "C" __global__ void bias_add_##S(const T* x, const T* b, T* y, u64 n, Div d) { bias_add_impl<T>(x, b, y, n, d); } \
    extern "C" __global__ void bias_fill_##S(const T* b, T* y, u64 n, Div d) { bias_fill_impl<T>(b, y, n, d); } \
    extern "C" __global__ void broadcast_rows_##S(const T* dy, float f, T* dx, u64 n, Div d) { broadcast_rows_impl<T>(dy, f, dx, n, d); } \
    extern "C" __global__ void broadcast_rows_add_##S(const T* dy, float f, T* acc, u64 n, Div d) { broadcast_rows_add_impl<T>(dy, f, acc, n, d); }
FOR_DTYPES(PER_DTYPE)

// x * s per plane of hw values (s: one scale per plane), and its backward: one block per
// plane, dx = dy * s and ds = the plane's sum of dy * x.
template <typename T>
__device__ void scale_channels_impl(const T* x, const T* s, T* y, u64 n, Div hw) {
    FOR_EACH(i, n) { y[i] = from_f32<T>(to_f32(x[i]) * to_f32(s[hw.div(i)])); }
}

template <typename T>
__device__ void scale_channels_bwd_impl(const T* x, const T* s, const T* dy, T* dx, T* ds,
                                        u64 hw) {
    const u64 p = blockIdx.x;
    const float sc = to_f32(s[p]);
    float acc = 0.0f;
    for (u64 j = threadIdx.x; j < hw; j += blockDim.x) {
        const float g = to_f32(dy[p * hw + j]);
        dx[p * hw + j] = from_f32<T>(g * sc);
        acc += g * to_f32(x[p * hw + j]);
    }
    acc = block_sum(acc);
    if (threadIdx.x == 0) ds[p] = from_f32<T>(acc);
}

#define SCALE_CHANNELS(T, S) \
    extern "C" __global__ void scale_channels_##S(const T* x, const T* s, T* y, u64 n, Div hw) { scale_channels_impl<T>(x, s, y, n, hw); } \
    extern "C" __global__ void scale_channels_bwd_##S(const T* x, const T* s, const T* dy, T* dx, T* ds, u64 hw) { scale_channels_bwd_impl<T>(x, s, dy, dx, ds, hw); }
FOR_DTYPES(SCALE_CHANNELS)

// The same, channels_last: x [n, hw, c], s [n, c]. The forward is one thread per element
// (the channel fastest, coalesced); the backward one thread per (image, chunk of `rows`
// positions, channel), i over [n, chunks, c], writing dx over its chunk and adding dy * x in
// f64 in position order from 0.0 (the host's `scale_channels_backward_nhwc`): with one
// chunk into ds, else into the partials, which scale_channels_nhwc_bwd_finish adds in chunk
// order.
template <typename T>
__device__ void scale_channels_nhwc_impl(const T* x, const T* s, T* y, u64 n, Div c, Div hwc) {
    FOR_EACH(i, n) { y[i] = from_f32<T>(to_f32(x[i]) * to_f32(s[hwc.div(i) * c.d + c.mod(i)])); }
}

template <typename T>
__device__ void scale_channels_nhwc_bwd_impl(const T* x, const T* s, const T* dy, T* dx,
                                             double* partial, T* ds, u64 total, Div c,
                                             Div chunks, u64 hw, u64 rows) {
    FOR_EACH(i, total) {
        const u64 q = c.div(i), ch = i - q * c.d;
        const u64 b = chunks.div(q), k = q - b * chunks.d;
        const u64 r0 = k * rows, r1 = r0 + rows < hw ? r0 + rows : hw;
        const float sc = to_f32(s[b * c.d + ch]);
        double acc = 0.0;
        for (u64 r = r0; r < r1; ++r) {
            const u64 at = (b * hw + r) * c.d + ch;
            const float g = to_f32(dy[at]);
            dx[at] = from_f32<T>(g * sc);
            acc += (double)g * (double)to_f32(x[at]);
        }
        if (chunks.d == 1) {
            ds[b * c.d + ch] = from_f32<T>((float)acc);
        } else {
            partial[i] = acc;
        }
    }
}

// ds[b, ch] = the [n, chunks, c] partials' sum over chunks, in chunk order from 0.0.
template <typename T>
__device__ void scale_channels_nhwc_bwd_finish_impl(const double* partial, T* ds, u64 total,
                                                    Div c, u64 chunks) {
    FOR_EACH(i, total) {
        const u64 b = c.div(i), ch = i - b * c.d;
        double acc = 0.0;
        for (u64 k = 0; k < chunks; ++k) acc += partial[(b * chunks + k) * c.d + ch];
        ds[i] = from_f32<T>((float)acc);
    }
}

#define SCALE_CHANNELS_NHWC(T, S) \
    extern "C" __global__ void scale_channels_nhwc_##S(const T* x, const T* s, T* y, u64 n, Div c, Div hwc) { scale_channels_nhwc_impl<T>(x, s, y, n, c, hwc); } \
    extern "C" __global__ void scale_channels_nhwc_bwd_##S(const T* x, const T* s, const T* dy, T* dx, double* p, T* ds, u64 total, Div c, Div chunks, u64 hw, u64 rows) { scale_channels_nhwc_bwd_impl<T>(x, s, dy, dx, p, ds, total, c, chunks, hw, rows); } \
    extern "C" __global__ void scale_channels_nhwc_bwd_finish_##S(const double* p, T* ds, u64 total, Div c, u64 chunks) { scale_channels_nhwc_bwd_finish_impl<T>(p, ds, total, c, chunks); }
FOR_DTYPES(SCALE_CHANNELS_NHWC)

// Elementwise maps, the kernels of `ops::map`. A unary op and its backward are one
// UNARY_OP line: the name, the forward as an expression of v = x[i], the backward as an
// expression of v and g = dy[i] (both f32). It defines NAME_<dtype>(const T* x, T* y, u64 n)
// and NAME_bwd_<dtype>(const T* x, const T* dy, T* dx, u64 n). A binary op is one BINARY_OP
// line, an expression of a and b, defining NAME_<dtype>(const T* a, const T* b, T* y, u64 n).
#define UNARY_INSTANCE(T, S, NAME, FWD, BWD) \
    extern "C" __global__ void NAME##_##S(const T* x, T* y, u64 n) { \
        map1(x, y, n, [](float v) { return FWD; }); \
    } \
    extern "C" __global__ void NAME##_bwd_##S(const T* x, const T* dy, T* dx, u64 n) { \
        map2(x, dy, dx, n, [](float v, float g) { return BWD; }); \
    }
#define UNARY_OP(NAME, FWD, BWD) \
    UNARY_INSTANCE(float, f32, NAME, FWD, BWD) \
    UNARY_INSTANCE(half_t, f16, NAME, FWD, BWD) \
    UNARY_INSTANCE(bf16_t, bf16, NAME, FWD, BWD)

#define BINARY_INSTANCE(T, S, NAME, F) \
    extern "C" __global__ void NAME##_##S(const T* x, const T* y, T* out, u64 n) { \
        map2(x, y, out, n, [](float a, float b) { return F; }); \
    }
#define BINARY_OP(NAME, F) \
    BINARY_INSTANCE(float, f32, NAME, F) \
    BINARY_INSTANCE(half_t, f16, NAME, F) \
    BINARY_INSTANCE(bf16_t, bf16, NAME, F)

UNARY_OP(relu, fmaxf(v, 0.0f), v > 0.0f ? g : 0.0f)
UNARY_OP(gelu, gelu_f(v), g * gelu_grad(v))
// PyTorch's hardswish and hardsigmoid (ActivationHardswishKernel.cu,
// ActivationHardsigmoidKernel.cu): x * relu6(x + 3) / 6 and relu6(x + 3) / 6; hardswish's
// derivative is 0 up to -3 (included), x / 3 + 1/2 below 3, then 1.
UNARY_OP(hardswish, v * fminf(fmaxf(v + 3.0f, 0.0f), 6.0f) / 6.0f,
         v <= -3.0f ? 0.0f : (v < 3.0f ? g * (v / 3.0f + 0.5f) : g))
UNARY_OP(hardsigmoid, fminf(fmaxf(v + 3.0f, 0.0f), 6.0f) / 6.0f,
         (v > -3.0f && v < 3.0f) ? g / 6.0f : 0.0f)
// SiLU, x * sigmoid(x) (PyTorch's silu, Llama's MLP gate), and its derivative
// s (1 + x (1 - s)) with s = sigmoid(x); the host writes the same expressions.
UNARY_OP(silu, v * vram_sigmoid(v),
         g * (vram_sigmoid(v) * (1.0f + v * (1.0f - vram_sigmoid(v)))))
BINARY_OP(add, a + b)
BINARY_OP(mul, a * b)

// Mixed-type kernels, named <op>_<first>_<second>: cast_<src>_<dst>, add_assign_<acc>_<x>,
// axpy_<y>_<x>.
#define PAIR(A, SA, B, SB) \
    extern "C" __global__ void cast_##SA##_##SB(const A* x, B* y, u64 n) { \
        map1(x, y, n, [](float v) { return v; }); \
    } \
    extern "C" __global__ void add_assign_##SA##_##SB(A* acc, const B* x, u64 n) { \
        map2(acc, x, acc, n, [](float a, float b) { return a + b; }); \
    } \
    extern "C" __global__ void axpy_##SA##_##SB(float alpha, const B* x, A* y, u64 n) { \
        map2(y, x, y, n, [=](float a, float b) { return a + alpha * b; }); \
    }
FOR_DTYPE_PAIRS(PAIR)
