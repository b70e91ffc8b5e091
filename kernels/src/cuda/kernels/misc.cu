// Embedding gather / scatter-add, dropout on Philox4x32-10, fused optimizer steps and the
// fused unscale with non-finite check, axis permutation.

template <typename T>
__device__ void embedding_impl(const u32* ids, const T* table, T* out, u64 n, Div dim) {
    FOR_EACH(i, n) {
        const u64 t = dim.div(i);
        out[i] = table[(u64)ids[t] * dim.d + (i - t * dim.d)];
    }
}

// acc[v, j] = sum of dout[t, j] over the tokens t with ids[t] == v, added in token order
// (acc zeroed by the caller). Thread (j, r) owns column j of the vocabulary rows
// [r * per_range, (r + 1) * per_range) and scans every id: each cell has one writer that adds
// in the host's order, so the result repeats bit for bit and equals the host's (atomics
// would add in whatever order the threads arrive). grid (ceil(d / blockDim), ranges).
template <typename T>
__device__ void embedding_bwd_impl(const u32* ids, const T* dout, float* acc, u64 tokens, u64 d,
                                   u64 per_range) {
    const u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= d) return;
    const u64 v0 = (u64)blockIdx.y * per_range;
    for (u64 t = 0; t < tokens; ++t) {
        const u64 v = ids[t];
        if (v - v0 < per_range) acc[v * d + j] += to_f32(dout[t * d + j]);
    }
}

// Element i uses word (offset + i) % 4 of philox(counter = (offset + i) / 4, key = seed)
// and is kept iff its uniform (top 24 bits / 2^24) is >= p; kept values are scaled.
template <typename T>
__device__ void dropout_impl(const T* x, T* y, u64 n, float p, float scale, u64 seed, u64 offset) {
    FOR_EACH(i, n) {
        const u64 index = offset + i;
        const u32 r = philox_word(index >> 2, seed, (u32)(index & 3u));
        const float u = (float)(r >> 8) * (1.0f / 16777216.0f);
        y[i] = u >= p ? from_f32<T>(to_f32(x[i]) * scale) : from_f32<T>(0.0f);
    }
}

template <typename T>
__device__ void sgd_impl(float* p, const T* g, float* buf, u64 n, float lr, float momentum,
                         float dampening, float weight_decay, u32 nesterov, u32 first_step) {
    FOR_EACH(i, n) {
        const float d = to_f32(g[i]) + weight_decay * p[i];
        if (momentum == 0.0f) {
            p[i] -= lr * d;
        } else {
            const float b = first_step ? d : momentum * buf[i] + (1.0f - dampening) * d;
            buf[i] = b;
            const float step = nesterov ? d + momentum * b : b;
            p[i] -= lr * step;
        }
    }
}

template <typename T>
__device__ void adamw_impl(float* p, const T* g, float* m, float* v, u64 n, float beta1,
                           float beta2, float eps, float step_size, float bias2_sqrt, float decay) {
    FOR_EACH(i, n) {
        const float gi = to_f32(g[i]);
        float pi = p[i] * decay;
        const float mi = beta1 * m[i] + (1.0f - beta1) * gi;
        const float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
        const float denom = sqrtf(vi) / bias2_sqrt + eps;
        pi -= step_size * mi / denom;
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
    }
}

// g *= inv_scale in place; *flag = 1 if any stored result is inf or NaN.
template <typename T> __device__ void unscale_impl(T* g, float inv_scale, u64 n, u32* flag) {
    bool bad = false;
    FOR_EACH(i, n) {
        const T r = from_f32<T>(to_f32(g[i]) * inv_scale);
        g[i] = r;
        bad |= !is_finite(to_f32(r));
    }
    if (bad) *flag = 1u;
}

// y = x.permute(perm) for rank <= 4, padded in front to 4 axes: output element i has the
// multi-index (i0, i1, i2, i3) in the output shape (d0, d1, d2, d3) and reads x at
// i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3 (s_k: the input stride of the axis output axis k reads).
template <typename T>
__device__ void permute_impl(const T* x, T* y, u64 n, Div d1, Div d2, Div d3, u64 s0, u64 s1,
                             u64 s2, u64 s3) {
    FOR_EACH(i, n) {
        const u64 r3 = d3.div(i), i3 = i - r3 * d3.d;
        const u64 r2 = d2.div(r3), i2 = r3 - r2 * d2.d;
        const u64 i0 = d1.div(r2), i1 = r2 - i0 * d1.d;
        y[i] = x[i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3];
    }
}

#define MISC(T, S) \
    extern "C" __global__ void embedding_##S(const u32* ids, const T* table, T* out, u64 n, Div dim) { embedding_impl<T>(ids, table, out, n, dim); } \
    extern "C" __global__ void embedding_bwd_##S(const u32* ids, const T* dout, float* acc, u64 tokens, u64 d, u64 per_range) { embedding_bwd_impl<T>(ids, dout, acc, tokens, d, per_range); } \
    extern "C" __global__ void dropout_##S(const T* x, T* y, u64 n, float p, float scale, u64 seed, u64 offset) { dropout_impl<T>(x, y, n, p, scale, seed, offset); } \
    extern "C" __global__ void sgd_##S(float* p, const T* g, float* buf, u64 n, float lr, float mom, float damp, float wd, u32 nest, u32 first) { sgd_impl<T>(p, g, buf, n, lr, mom, damp, wd, nest, first); } \
    extern "C" __global__ void adamw_##S(float* p, const T* g, float* m, float* v, u64 n, float b1, float b2, float eps, float ss, float b2s, float decay) { adamw_impl<T>(p, g, m, v, n, b1, b2, eps, ss, b2s, decay); } \
    extern "C" __global__ void unscale_##S(T* g, float inv, u64 n, u32* flag) { unscale_impl<T>(g, inv, n, flag); } \
    extern "C" __global__ void permute_##S(const T* x, T* y, u64 n, Div d1, Div d2, Div d3, u64 s0, u64 s1, u64 s2, u64 s3) { permute_impl<T>(x, y, n, d1, d2, d3, s0, s1, s2, s3); }
FOR_DTYPES(MISC)
