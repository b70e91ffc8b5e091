// Row-wise kernels, one block per row: softmax (plain and causal), fused cross-entropy and
// layer norm. Statistics in f32; each output rounded once.

// Softmax of row `blockIdx.x` of [rows, cols]; with seq > 0 (causal) the row only covers
// columns j <= row % seq and the rest of the output row is 0.
template <typename T> __device__ void softmax_impl(const T* x, T* y, u64 cols, u64 seq) {
    const u64 row = blockIdx.x;
    const u64 valid = seq > 0 ? row % seq + 1 : cols;
    const T* xr = x + row * cols;
    T* yr = y + row * cols;
    float m = neg_inf();
    for (u64 j = threadIdx.x; j < valid; j += blockDim.x) m = fmaxf(m, to_f32(xr[j]));
    m = block_max(m);
    float s = 0.0f;
    for (u64 j = threadIdx.x; j < valid; j += blockDim.x) s += expf(to_f32(xr[j]) - m);
    s = block_sum(s);
    const float inv = 1.0f / s;
    for (u64 j = threadIdx.x; j < cols; j += blockDim.x)
        yr[j] = from_f32<T>(j < valid ? expf(to_f32(xr[j]) - m) * inv : 0.0f);
}

template <typename T>
__device__ void softmax_bwd_impl(const T* y, const T* dy, T* dx, u64 cols, u64 seq) {
    const u64 row = blockIdx.x;
    const u64 valid = seq > 0 ? row % seq + 1 : cols;
    const u64 off = row * cols;
    float dot = 0.0f;
    for (u64 j = threadIdx.x; j < valid; j += blockDim.x) dot += to_f32(y[off + j]) * to_f32(dy[off + j]);
    dot = block_sum(dot);
    for (u64 j = threadIdx.x; j < cols; j += blockDim.x)
        dx[off + j] = from_f32<T>(j < valid ? to_f32(y[off + j]) * (to_f32(dy[off + j]) - dot) : 0.0f);
}

// Per row: lse[row] = log-sum-exp of the logits, loss[row] = lse - x[target] (0 if ignored).
template <typename T>
__device__ void ce_fwd_impl(const T* x, const u32* targets, u64 c, u32 ignore, u32 has_ignore,
                            float* lse, float* loss) {
    const u64 row = blockIdx.x;
    const T* xr = x + row * c;
    float m = neg_inf();
    for (u64 j = threadIdx.x; j < c; j += blockDim.x) m = fmaxf(m, to_f32(xr[j]));
    m = block_max(m);
    float s = 0.0f;
    if (m != neg_inf()) {
        for (u64 j = threadIdx.x; j < c; j += blockDim.x) s += expf(to_f32(xr[j]) - m);
    }
    s = block_sum(s);
    if (threadIdx.x == 0) {
        const float l = m == neg_inf() ? m : m + logf(s);
        const u32 t = targets[row];
        lse[row] = l;
        loss[row] = (has_ignore && t == ignore) ? 0.0f : l - to_f32(xr[t]);
    }
}

// dx[i, j] = g * (exp(x[i, j] - lse[i]) - [j == t_i]), 0 for ignored rows.
template <typename T>
__device__ void ce_bwd_impl(const T* x, const u32* targets, const float* lse, float g, u64 c,
                            u32 ignore, u32 has_ignore, T* dx, u64 n) {
    FOR_EACH(i, n) {
        const u64 row = i / c;
        const u64 j = i - row * c;
        const u32 t = targets[row];
        float v = 0.0f;
        if (!(has_ignore && t == ignore)) {
            const float p = expf(to_f32(x[i]) - lse[row]);
            v = g * (p - (j == (u64)t ? 1.0f : 0.0f));
        }
        dx[i] = from_f32<T>(v);
    }
}

template <typename T>
__device__ void layer_norm_impl(const T* x, const T* gamma, const T* beta, float eps, T* y,
                                float* mean, float* rstd, u64 d) {
    const u64 row = blockIdx.x;
    const T* xr = x + row * d;
    T* yr = y + row * d;
    float s = 0.0f;
    for (u64 j = threadIdx.x; j < d; j += blockDim.x) s += to_f32(xr[j]);
    const float mu = block_sum(s) / (float)d;
    float q = 0.0f;
    for (u64 j = threadIdx.x; j < d; j += blockDim.x) {
        const float c = to_f32(xr[j]) - mu;
        q += c * c;
    }
    const float var = block_sum(q) / (float)d;
    const float r = 1.0f / sqrtf(var + eps);
    for (u64 j = threadIdx.x; j < d; j += blockDim.x) {
        const float xhat = (to_f32(xr[j]) - mu) * r;
        yr[j] = from_f32<T>(xhat * to_f32(gamma[j]) + to_f32(beta[j]));
    }
    if (threadIdx.x == 0) {
        mean[row] = mu;
        rstd[row] = r;
    }
}

// dx for one row: rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * gamma.
template <typename T>
__device__ void layer_norm_bwd_impl(const T* x, const T* gamma, const float* mean,
                                    const float* rstd, const T* dy, T* dx, u64 d) {
    const u64 row = blockIdx.x;
    const u64 off = row * d;
    const float mu = mean[row], r = rstd[row];
    float sg = 0.0f, sgx = 0.0f;
    for (u64 j = threadIdx.x; j < d; j += blockDim.x) {
        const float xhat = (to_f32(x[off + j]) - mu) * r;
        const float g = to_f32(dy[off + j]) * to_f32(gamma[j]);
        sg += g;
        sgx += g * xhat;
    }
    const float mean_g = block_sum(sg) / (float)d;
    const float mean_gx = block_sum(sgx) / (float)d;
    for (u64 j = threadIdx.x; j < d; j += blockDim.x) {
        const float xhat = (to_f32(x[off + j]) - mu) * r;
        const float g = to_f32(dy[off + j]) * to_f32(gamma[j]);
        dx[off + j] = from_f32<T>(r * (g - mean_g - xhat * mean_gx));
    }
}

// dgamma[j] += sum over a chunk of rows of dy * xhat, dbeta[j] += sum of dy (f32
// accumulators zeroed by the caller); grid (ceil(d / blockDim), row chunks).
template <typename T>
__device__ void layer_norm_params_bwd_impl(const T* x, const float* mean, const float* rstd,
                                           const T* dy, float* dgamma, float* dbeta, u64 rows,
                                           u64 d, u64 chunk) {
    const u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= d) return;
    const u64 r0 = (u64)blockIdx.y * chunk;
    const u64 r1 = r0 + chunk < rows ? r0 + chunk : rows;
    float a = 0.0f, b = 0.0f;
    for (u64 r = r0; r < r1; ++r) {
        const float g = to_f32(dy[r * d + j]);
        a += g * (to_f32(x[r * d + j]) - mean[r]) * rstd[r];
        b += g;
    }
    atomicAdd(dgamma + j, a);
    atomicAdd(dbeta + j, b);
}

#define ROWWISE(T, S) \
    extern "C" __global__ void softmax_##S(const T* x, T* y, u64 cols, u64 seq) { softmax_impl<T>(x, y, cols, seq); } \
    extern "C" __global__ void softmax_bwd_##S(const T* y, const T* dy, T* dx, u64 cols, u64 seq) { softmax_bwd_impl<T>(y, dy, dx, cols, seq); } \
    extern "C" __global__ void ce_fwd_##S(const T* x, const u32* t, u64 c, u32 ig, u32 has_ig, float* lse, float* loss) { ce_fwd_impl<T>(x, t, c, ig, has_ig, lse, loss); } \
    extern "C" __global__ void ce_bwd_##S(const T* x, const u32* t, const float* lse, float g, u64 c, u32 ig, u32 has_ig, T* dx, u64 n) { ce_bwd_impl<T>(x, t, lse, g, c, ig, has_ig, dx, n); } \
    extern "C" __global__ void layer_norm_##S(const T* x, const T* g, const T* b, float eps, T* y, float* m, float* r, u64 d) { layer_norm_impl<T>(x, g, b, eps, y, m, r, d); } \
    extern "C" __global__ void layer_norm_bwd_##S(const T* x, const T* g, const float* m, const float* r, const T* dy, T* dx, u64 d) { layer_norm_bwd_impl<T>(x, g, m, r, dy, dx, d); } \
    extern "C" __global__ void layer_norm_params_bwd_##S(const T* x, const float* m, const float* r, const T* dy, float* dg, float* db, u64 rows, u64 d, u64 chunk) { layer_norm_params_bwd_impl<T>(x, m, r, dy, dg, db, rows, d, chunk); }
FOR_DTYPES(ROWWISE)
