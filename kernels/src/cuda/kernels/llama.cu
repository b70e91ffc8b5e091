// The Llama family's row and rotary kernels: RMS norm (Hugging Face's LlamaRMSNorm) forward,
// backward and its weight's column sums, and rotary position embeddings in the rotate_half
// layout (forward and, with sign = -1, backward). Arithmetic in f32, one rounding to the
// storage type, as on the host (cpu/llama.rs).

// One block per row: rstd = 1 / sqrt(mean(x^2) + eps); y = w * T(x * rstd).
template <typename T>
__device__ void rms_norm_impl(const T* x, const T* w, float eps, T* y, float* rstd, u64 d) {
    const u64 row = blockIdx.x;
    const T* xr = x + row * d;
    T* yr = y + row * d;
    float s = 0.0f;
    for (u64 j = threadIdx.x; j < d; j += blockDim.x) {
        const float v = to_f32(xr[j]);
        s += v * v;
    }
    const float r = 1.0f / sqrtf(block_sum(s) / (float)d + eps);
    for (u64 j = threadIdx.x; j < d; j += blockDim.x) {
        const float xhat = to_f32(from_f32<T>(to_f32(xr[j]) * r));
        yr[j] = from_f32<T>(to_f32(w[j]) * xhat);
    }
    if (threadIdx.x == 0) rstd[row] = r;
}

// dx for one row: rstd * (g - xhat * mean(g * xhat)) with g = dy * w, xhat = x * rstd.
template <typename T>
__device__ void rms_norm_bwd_impl(const T* x, const T* w, const float* rstd, const T* dy, T* dx,
                                  u64 d) {
    const u64 row = blockIdx.x;
    const u64 off = row * d;
    const float r = rstd[row];
    float s = 0.0f;
    for (u64 j = threadIdx.x; j < d; j += blockDim.x) {
        s += to_f32(dy[off + j]) * to_f32(w[j]) * (to_f32(x[off + j]) * r);
    }
    const float m = block_sum(s) / (float)d;
    for (u64 j = threadIdx.x; j < d; j += blockDim.x) {
        const float xhat = to_f32(x[off + j]) * r;
        dx[off + j] = from_f32<T>(r * (to_f32(dy[off + j]) * to_f32(w[j]) - xhat * m));
    }
}

// dw[c, j] = sum over the rows of chunk c of dy * T(x * rstd) (f32 partials added in row
// order; grid (ceil(d / blockDim), at most the number of chunks)), which `col_sum_f32` then
// adds in chunk order, as the host does. No atomics.
template <typename T>
__device__ void rms_norm_weight_bwd_impl(const T* x, const float* rstd, const T* dy, float* dw,
                                         u64 rows, u64 d, u64 chunk) {
    const u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= d) return;
    const u64 chunks = rows > chunk ? (rows + chunk - 1) / chunk : 1;
    for (u64 c = blockIdx.y; c < chunks; c += gridDim.y) {
        const u64 r0 = c * chunk;
        const u64 r1 = r0 + chunk < rows ? r0 + chunk : rows;
        float a = 0.0f;
        for (u64 r = r0; r < r1; ++r) {
            a += to_f32(dy[r * d + j]) * to_f32(from_f32<T>(to_f32(x[r * d + j]) * rstd[r]));
        }
        dw[c * d + j] = a;
    }
}

// x: [b, s, h, dh], one thread per pair (j, j + dh/2) of a head: pair i is row i / half
// (a head of a token), column j = i % half; the token's position is (row / h) % s.
// y1 = x1 c - x2 s', y2 = x2 c + x1 s' with s' = sign * sin.
template <typename T>
__device__ void rope_impl(const T* x, const float* cos, const float* sin, T* y, float sign,
                          u64 pairs, Div half, Div heads, Div seq) {
    FOR_EACH(i, pairs) {
        const u64 row = half.div(i);
        const u64 j = i - row * half.d;
        const u64 t = seq.mod(heads.div(row));
        const u64 a = row * 2 * half.d + j;
        const u64 b = a + half.d;
        const float c = cos[t * half.d + j], s = sign * sin[t * half.d + j];
        const float x1 = to_f32(x[a]), x2 = to_f32(x[b]);
        y[a] = from_f32<T>(x1 * c - x2 * s);
        y[b] = from_f32<T>(x2 * c + x1 * s);
    }
}

#define LLAMA(T, S) \
    extern "C" __global__ void rms_norm_##S(const T* x, const T* w, float eps, T* y, float* r, u64 d) { rms_norm_impl<T>(x, w, eps, y, r, d); } \
    extern "C" __global__ void rms_norm_bwd_##S(const T* x, const T* w, const float* r, const T* dy, T* dx, u64 d) { rms_norm_bwd_impl<T>(x, w, r, dy, dx, d); } \
    extern "C" __global__ void rms_norm_weight_bwd_##S(const T* x, const float* r, const T* dy, float* dw, u64 rows, u64 d, u64 chunk) { rms_norm_weight_bwd_impl<T>(x, r, dy, dw, rows, d, chunk); } \
    extern "C" __global__ void rope_##S(const T* x, const float* cos, const float* sin, T* y, float sign, u64 pairs, Div half, Div heads, Div seq) { rope_impl<T>(x, cos, sin, y, sign, pairs, half, heads, seq); }
FOR_DTYPES(LLAMA)
