// Fused epilogues: bias + GELU (a GPT MLP's first linear layer and its activation) forward in
// one pass and backward in one pass with the bias gradient's partial sums; a residual add
// with dropout on its branch, alone or with the layer norm that follows it. Each rounds where
// the unfused ops (bias_add, gelu, gelu_bwd, bias_add_bwd) round, so the results are theirs.

// y = gelu(x + b[i % d]), the sum rounded to T first as bias_add stores it.
template <typename T>
__device__ void bias_gelu_impl(const T* x, const T* b, T* y, u64 n, Div d) {
    FOR_EACH(i, n) {
        const float pre = to_f32(from_f32<T>(to_f32(x[i]) + to_f32(b[d.mod(i)])));
        y[i] = from_f32<T>(gelu_f(pre));
    }
}

// dx = dy * gelu'(x + b) (rounded to T, the gradient of x and of the bias's input), and per
// column j and chunk c of `chunk` rows the f32 partial sum of dx over the chunk's rows in row
// order: part[c * d + j]. Grid (ceil(d / blockDim), at most the number of chunks), as
// `launch::columns`; `column_finish` then adds the partials in chunk order.
template <typename T>
__device__ void bias_gelu_bwd_impl(const T* x, const T* b, const T* dy, T* dx, float* part,
                                   u64 rows, u64 d, u64 chunk) {
    const u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= d) return;
    const float bj = to_f32(b[j]);
    const u64 chunks = (rows + chunk - 1) / chunk;
    for (u64 c = blockIdx.y; c < chunks; c += gridDim.y) {
        const u64 r0 = c * chunk;
        const u64 r1 = r0 + chunk < rows ? r0 + chunk : rows;
        float a = 0.0f;
        for (u64 r = r0; r < r1; ++r) {
            const u64 i = r * d + j;
            const float pre = to_f32(from_f32<T>(to_f32(x[i]) + bj));
            const T g = from_f32<T>(to_f32(dy[i]) * gelu_grad(pre));
            dx[i] = g;
            a += to_f32(g);
        }
        part[c * d + j] = a;
    }
}

// out[j] = the `chunks` partials of column j added in chunk order from 0, rounded to T.
template <typename T>
__device__ void column_finish_impl(const float* part, T* out, u64 chunks, u64 d) {
    FOR_EACH(j, d) {
        float a = 0.0f;
        for (u64 c = 0; c < chunks; ++c) a += part[c * d + j];
        out[j] = from_f32<T>(a);
    }
}

// y = a + dropout(b): the branch of dtype B dropped as ops::dropout drops it (element i of
// the stream at offset + i), added in f32 to the residual and rounded to R.
template <typename R, typename B>
__device__ void dropout_add_impl(const R* a, const B* b, R* y, u64 n, float p, float scale,
                                 u64 seed, u64 offset) {
    FOR_EACH(i, n) {
        y[i] = from_f32<R>(to_f32(a[i]) + dropped_branch<B>(b[i], offset + i, p, scale, seed));
    }
}

// The branch's gradient of dropout_add: dy rounded to B (the cast the unfused backward
// makes), then masked and scaled as dropout's backward, rounded to B again.
template <typename R, typename B>
__device__ void dropout_add_bwd_impl(const R* dy, B* db, u64 n, float p, float scale, u64 seed,
                                     u64 offset) {
    FOR_EACH(i, n) {
        const B g = from_f32<B>(to_f32(dy[i]));
        db[i] = from_f32<B>(dropped_branch<B>(g, offset + i, p, scale, seed));
    }
}

// A residual add (the branch of dtype B optionally dropped out, as dropout_add) and the layer
// norm after it, one block per row: s = a + dropout(b) (rounded to R and stored: the residual
// stream goes on from it), then layer_norm_impl's statistics and output (softmax.cu) on s,
// each thread reading back the elements it wrote.
template <typename R, typename B>
__device__ void add_layer_norm_impl(const R* a, const B* b, const R* gamma, const R* beta,
                                    float eps, float p, float scale, u64 seed, u64 offset, R* s,
                                    R* y, float* mean, float* rstd, u64 d) {
    const u64 off = (u64)blockIdx.x * d;
    float acc = 0.0f;
    for (u64 j = threadIdx.x; j < d; j += blockDim.x) {
        const u64 i = off + j;
        const R v = from_f32<R>(to_f32(a[i]) + dropped_branch<B>(b[i], offset + i, p, scale, seed));
        s[i] = v;
        acc += to_f32(v);
    }
    const float mu = block_sum(acc) / (float)d;
    float q = 0.0f;
    for (u64 j = threadIdx.x; j < d; j += blockDim.x) {
        const float c = to_f32(s[off + j]) - mu;
        q += c * c;
    }
    const float var = block_sum(q) / (float)d;
    const float r = 1.0f / sqrtf(var + eps);
    for (u64 j = threadIdx.x; j < d; j += blockDim.x) {
        const float xhat = (to_f32(s[off + j]) - mu) * r;
        y[off + j] = from_f32<R>(xhat * to_f32(gamma[j]) + to_f32(beta[j]));
    }
    if (threadIdx.x == 0) {
        mean[blockIdx.x] = mu;
        rstd[blockIdx.x] = r;
    }
}

#define FUSED(T, S) \
    extern "C" __global__ void bias_gelu_##S(const T* x, const T* b, T* y, u64 n, Div d) { bias_gelu_impl<T>(x, b, y, n, d); } \
    extern "C" __global__ void bias_gelu_bwd_##S(const T* x, const T* b, const T* dy, T* dx, float* part, u64 rows, u64 d, u64 chunk) { bias_gelu_bwd_impl<T>(x, b, dy, dx, part, rows, d, chunk); } \
    extern "C" __global__ void column_finish_##S(const float* part, T* out, u64 chunks, u64 d) { column_finish_impl<T>(part, out, chunks, d); }
FOR_DTYPES(FUSED)

// Residual kernels, named <op>_<residual>_<branch>.
#define FUSED_RESIDUAL(R, SR, B, SB) \
    extern "C" __global__ void dropout_add_##SR##_##SB(const R* a, const B* b, R* y, u64 n, float p, float scale, u64 seed, u64 offset) { dropout_add_impl<R, B>(a, b, y, n, p, scale, seed, offset); } \
    extern "C" __global__ void dropout_add_bwd_##SR##_##SB(const R* dy, B* db, u64 n, float p, float scale, u64 seed, u64 offset) { dropout_add_bwd_impl<R, B>(dy, db, n, p, scale, seed, offset); } \
    extern "C" __global__ void add_layer_norm_##SR##_##SB(const R* a, const B* b, const R* g, const R* be, float eps, float p, float scale, u64 seed, u64 offset, R* s, R* y, float* m, float* r, u64 d) { add_layer_norm_impl<R, B>(a, b, g, be, eps, p, scale, seed, offset, s, y, m, r, d); }
FOR_DTYPE_PAIRS(FUSED_RESIDUAL)
