// Reductions accumulated in f32: whole-tensor sums (two passes), row sums (one block per
// row) and column sums (per chunk of rows, then over chunks). Every sum is added by one
// thread or one block in a fixed order, so results repeat bit for bit from run to run.

template <typename T> __device__ void sum_partial_impl(const T* x, u64 n, float* partial) {
    float s = 0.0f;
    FOR_EACH(i, n) s += to_f32(x[i]);
    s = block_sum(s);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// One block: out[0] = sum of `count` partial sums.
extern "C" __global__ void sum_final(const float* partial, u32 count, float* out) {
    float s = 0.0f;
    for (u32 i = threadIdx.x; i < count; i += blockDim.x) s += partial[i];
    s = block_sum(s);
    if (threadIdx.x == 0) out[0] = s;
}

// y[row] = scale * sum_j x[row, j]; one block per row.
template <typename T> __device__ void row_sum_impl(const T* x, T* y, u64 d, float scale) {
    const T* row = x + (u64)blockIdx.x * d;
    float s = 0.0f;
    for (u64 j = threadIdx.x; j < d; j += blockDim.x) s += to_f32(row[j]);
    s = block_sum(s);
    if (threadIdx.x == 0) y[blockIdx.x] = from_f32<T>(s * scale);
}

// y[row] = sum_j x[row, j] in f32; one block per row.
template <typename T> __device__ void row_sum_f32_impl(const T* x, float* y, u64 d) {
    const T* row = x + (u64)blockIdx.x * d;
    float s = 0.0f;
    for (u64 j = threadIdx.x; j < d; j += blockDim.x) s += to_f32(row[j]);
    s = block_sum(s);
    if (threadIdx.x == 0) y[blockIdx.x] = s;
}

// partial[c, j] = sum of x[row, j] over the rows of chunk c (rows c * chunk onwards), added
// in row order from 0; grid (ceil(d / blockDim), at most the number of chunks: blocks stride
// over chunks). The host's `column_sums` adds the same terms in the same order, and a
// second launch over the partials (rows = chunks, one chunk) adds them in chunk order, as
// the host does: column sums equal the host's bit for bit.
template <typename T>
__device__ void col_sum_impl(const T* x, float* partial, u64 rows, u64 d, u64 chunk) {
    const u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= d) return;
    const u64 chunks = rows > chunk ? (rows + chunk - 1) / chunk : 1;
    for (u64 c = blockIdx.y; c < chunks; c += gridDim.y) {
        const u64 r0 = c * chunk;
        const u64 r1 = r0 + chunk < rows ? r0 + chunk : rows;
        float s = 0.0f;
        for (u64 r = r0; r < r1; ++r) s += to_f32(x[r * d + j]);
        partial[c * d + j] = s;
    }
}

#define REDUCE(T, S) \
    extern "C" __global__ void sum_partial_##S(const T* x, u64 n, float* p) { sum_partial_impl<T>(x, n, p); } \
    extern "C" __global__ void row_sum_##S(const T* x, T* y, u64 d, float scale) { row_sum_impl<T>(x, y, d, scale); } \
    extern "C" __global__ void row_sum_f32_##S(const T* x, float* y, u64 d) { row_sum_f32_impl<T>(x, y, d); } \
    extern "C" __global__ void col_sum_##S(const T* x, float* p, u64 rows, u64 d, u64 chunk) { col_sum_impl<T>(x, p, rows, d, chunk); }
FOR_DTYPES(REDUCE)
