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
__device__ void ce_bwd_impl(const T* x, const u32* targets, const float* lse, float g, Div c,
                            u32 ignore, u32 has_ignore, T* dx, u64 n) {
    FOR_EACH(i, n) {
        const u64 row = c.div(i);
        const u64 j = i - row * c.d;
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

// The backward in two launches: `layer_norm_bwd_fused` computes dx (one block per row) and,
// in the blocks after the rows, the f32 partial sums of dgamma and dbeta per chunk of rows;
// `layer_norm_bwd_finish` adds the partials in chunk order and rounds them into dgamma and
// dbeta. (Before: dx, the partials, two column-sum passes and two casts, six launches.)

// The row's mean(g) and mean(g * xhat) with g = dy * gamma, xhat = (x - mu) * r: block sums,
// every thread gets both.
template <typename T>
__device__ __forceinline__ void layer_norm_bwd_means(const T* x, const T* gamma, const T* dy,
                                                     float mu, float r, u64 off, u64 d,
                                                     float* mean_g, float* mean_gx) {
    float sg = 0.0f, sgx = 0.0f;
    for (u64 j = threadIdx.x; j < d; j += blockDim.x) {
        const float xhat = (to_f32(x[off + j]) - mu) * r;
        const float g = to_f32(dy[off + j]) * to_f32(gamma[j]);
        sg += g;
        sgx += g * xhat;
    }
    *mean_g = block_sum(sg) / (float)d;
    *mean_gx = block_sum(sgx) / (float)d;
}

// dx for one row: rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * gamma.
template <typename T>
__device__ void layer_norm_bwd_row(const T* x, const T* gamma, const float* mean,
                                   const float* rstd, const T* dy, T* dx, u64 row, u64 d) {
    const u64 off = row * d;
    const float mu = mean[row], r = rstd[row];
    float mean_g, mean_gx;
    layer_norm_bwd_means<T>(x, gamma, dy, mu, r, off, d, &mean_g, &mean_gx);
    for (u64 j = threadIdx.x; j < d; j += blockDim.x) {
        const float xhat = (to_f32(x[off + j]) - mu) * r;
        const float g = to_f32(dy[off + j]) * to_f32(gamma[j]);
        dx[off + j] = from_f32<T>(r * (g - mean_g - xhat * mean_gx));
    }
}

// dgamma[c, j] = sum over the rows of chunk c of dy * xhat, dbeta[c, j] = sum of dy (f32
// partials, added in row order) for the columns of column block `cb` and the chunks c0,
// c0 + stride, ...; the finish adds them in chunk order, as the host does. No atomics: the
// result repeats bit for bit.
template <typename T>
__device__ void layer_norm_params_part(const T* x, const float* mean, const float* rstd,
                                       const T* dy, float* dgamma, float* dbeta, u64 rows,
                                       u64 d, u64 chunk, u64 cb, u64 c0, u64 stride) {
    const u64 j = cb * blockDim.x + threadIdx.x;
    if (j >= d) return;
    const u64 chunks = (rows + chunk - 1) / chunk;
    for (u64 c = c0; c < chunks; c += stride) {
        const u64 r0 = c * chunk;
        const u64 r1 = r0 + chunk < rows ? r0 + chunk : rows;
        float a = 0.0f, b = 0.0f;
        for (u64 r = r0; r < r1; ++r) {
            const float g = to_f32(dy[r * d + j]);
            a += g * (to_f32(x[r * d + j]) - mean[r]) * rstd[r];
            b += g;
        }
        dgamma[c * d + j] = a;
        dbeta[c * d + j] = b;
    }
}

// grid: rows blocks of dx, then col_blocks * chunk_blocks blocks of partials (dg and db hold
// ceil(rows / chunk) * d floats each).
template <typename T>
__device__ void layer_norm_bwd_fused_impl(const T* x, const T* gamma, const float* mean,
                                          const float* rstd, const T* dy, T* dx, float* dg,
                                          float* db, u64 rows, u64 d, u64 chunk, u32 col_blocks,
                                          u32 chunk_blocks) {
    const u64 b = blockIdx.x;
    if (b < rows) {
        layer_norm_bwd_row<T>(x, gamma, mean, rstd, dy, dx, b, d);
        return;
    }
    const u32 q = (u32)(b - rows);
    const u32 cy = q / col_blocks, cb = q - cy * col_blocks;
    layer_norm_params_part<T>(x, mean, rstd, dy, dg, db, rows, d, chunk, cb, cy, chunk_blocks);
}

// dgamma[j] and dbeta[j]: the `chunks` partials of column j added in chunk order from 0.
template <typename T>
__device__ void layer_norm_bwd_finish_impl(const float* dg, const float* db, T* dgamma,
                                           T* dbeta, u64 chunks, u64 d) {
    FOR_EACH(j, d) {
        float a = 0.0f, b = 0.0f;
        for (u64 c = 0; c < chunks; ++c) {
            a += dg[c * d + j];
            b += db[c * d + j];
        }
        dgamma[j] = from_f32<T>(a);
        dbeta[j] = from_f32<T>(b);
    }
}

// Layer norm's backward with a second gradient arriving at its input (a residual stream:
// s = residual + dropout(branch), h = layer_norm(s)), in the same two launches: each row's
// dx is layer_norm_bwd_row's, rounded to R as it stores it, plus dres (rounded to R again, as
// add_assign adds it into the stored dx); with has_branch the branch's gradient of that sum
// follows in the same pass, as dropout_add_bwd makes it (rounded to B, masked and scaled with
// the forward's p, seed and offset: element i of the stream at offset + i). The partials of
// dgamma and dbeta are layer_norm_bwd_fused's; layer_norm_bwd_finish adds them.
template <typename R, typename B>
__device__ void layer_norm_bwd_residual_row(const R* x, const R* gamma, const float* mean,
                                            const float* rstd, const R* dy, const R* dres,
                                            R* dx, B* db, u32 has_branch, float p, float scale,
                                            u64 seed, u64 offset, u64 row, u64 d) {
    const u64 off = row * d;
    const float mu = mean[row], r = rstd[row];
    float mean_g, mean_gx;
    layer_norm_bwd_means<R>(x, gamma, dy, mu, r, off, d, &mean_g, &mean_gx);
    for (u64 j = threadIdx.x; j < d; j += blockDim.x) {
        const u64 i = off + j;
        const float xhat = (to_f32(x[i]) - mu) * r;
        const float g = to_f32(dy[i]) * to_f32(gamma[j]);
        const R own = from_f32<R>(r * (g - mean_g - xhat * mean_gx));
        const R v = from_f32<R>(to_f32(own) + to_f32(dres[i]));
        dx[i] = v;
        if (has_branch) {
            const B gb = from_f32<B>(to_f32(v));
            db[i] = from_f32<B>(dropped_branch<B>(gb, offset + i, p, scale, seed));
        }
    }
}

// grid: rows blocks of dx (and the branch's gradient), then col_blocks * chunk_blocks blocks
// of partials, as layer_norm_bwd_fused_impl.
template <typename R, typename B>
__device__ void layer_norm_bwd_residual_impl(const R* x, const R* gamma, const float* mean,
                                             const float* rstd, const R* dy, const R* dres,
                                             R* dx, B* db, u32 has_branch, float p, float scale,
                                             u64 seed, u64 offset, float* dg, float* dbp,
                                             u64 rows, u64 d, u64 chunk, u32 col_blocks,
                                             u32 chunk_blocks) {
    const u64 b = blockIdx.x;
    if (b < rows) {
        layer_norm_bwd_residual_row<R, B>(x, gamma, mean, rstd, dy, dres, dx, db, has_branch, p,
                                          scale, seed, offset, b, d);
        return;
    }
    const u32 q = (u32)(b - rows);
    const u32 cy = q / col_blocks, cb = q - cy * col_blocks;
    layer_norm_params_part<R>(x, mean, rstd, dy, dg, dbp, rows, d, chunk, cb, cy, chunk_blocks);
}

// Batch norm over x: [n, c, s]. The statistics and the backward's sums spread each channel
// over `parts` blocks of whole images (grid (c, parts), `batch_norm::parts` on the Rust
// side), whose partial results one thread per channel then merges; the elementwise parts
// are a grid-stride loop. gamma, beta and the running statistics are f32 (pf32 = 1) or T
// (pf32 = 0).
template <typename T>
__device__ __forceinline__ float load_param(const void* p, u64 i, u32 pf32) {
    return pf32 ? ((const float*)p)[i] : to_f32(((const T*)p)[i]);
}

template <typename T>
__device__ __forceinline__ void store_param(void* p, u64 i, u32 pf32, float v) {
    if (pf32) {
        ((float*)p)[i] = v;
    } else {
        ((T*)p)[i] = from_f32<T>(v);
    }
}

__device__ __forceinline__ float inv_std(float var, float eps) {
    return (var == 0.0f && eps == 0.0f) ? 0.0f : 1.0f / sqrtf(var + eps);
}

// The images of part p of `parts` (of n): [n * p / parts, n * (p + 1) / parts).
__device__ __forceinline__ u64 part_start(u64 n, u64 p, u64 parts) { return n * p / parts; }

// The block's part of its channel in a (c, parts) grid: the index in x of the part's first
// value, and the part's images. Value k of the part is at start + (k / s) * c * s + k % s;
// a PlaneWalk over width s gives (k / s, k % s) without dividing.
__device__ __forceinline__ u64 channel_part(u64 n, u64 c, u64 s, u32 parts, u64* images) {
    const u64 p = blockIdx.y, img0 = part_start(n, p, parts);
    *images = part_start(n, p + 1, parts) - img0;
    return (img0 * c + blockIdx.x) * s;
}

// The statistics' first kernel, grid (c, parts): each block writes its part's mean and sum
// of squared deviations from it (two passes over the part), part[2 * (ch * parts + p)] =
// (mean, m2); the part's count follows from n, s and parts.
template <typename T>
__device__ void bn_partial_impl(const T* x, float* part, u64 n, u64 c, u64 s, u32 parts) {
    const u64 ch = blockIdx.x, p = blockIdx.y;
    u64 images;
    const T* base = x + channel_part(n, c, s, parts, &images);
    const u64 m = images * s;
    const PlaneWalk first(s);
    float sum = 0.0f;
    PlaneWalk v = first;
    for (u64 k = threadIdx.x; k < m; k += blockDim.x, v.next()) sum += to_f32(base[v.y * c * s + v.x]);
    const float mu = m > 0 ? block_sum(sum) / (float)m : 0.0f;
    float q = 0.0f;
    v = first;
    for (u64 k = threadIdx.x; k < m; k += blockDim.x, v.next()) {
        const float d = to_f32(base[v.y * c * s + v.x]) - mu;
        q += d * d;
    }
    const float m2 = block_sum(q);
    if (threadIdx.x == 0) {
        part[2 * (ch * parts + p)] = mu;
        part[2 * (ch * parts + p) + 1] = m2;
    }
}

// The second: merges each channel's parts in order with Chan et al.'s pairwise formula (one
// thread per channel) into mean and invstd and, when `update`, the running statistics
// (momentum, unbiased variance).
template <typename T>
__device__ void bn_finalize_impl(const float* part, float* mean, float* invstd, void* rmean,
                                 void* rvar, u32 pf32, u32 update, float momentum, float eps,
                                 u64 n, u64 c, u64 s, u32 parts) {
    FOR_EACH(ch, c) {
        float count = 0.0f, mu = 0.0f, m2 = 0.0f;
        for (u32 p = 0; p < parts; ++p) {
            const float nb = (float)((part_start(n, p + 1, parts) - part_start(n, p, parts)) * s);
            if (nb == 0.0f) continue;
            const float pm = part[2 * (ch * parts + p)], pq = part[2 * (ch * parts + p) + 1];
            const float total = count + nb;
            const float d = pm - mu;
            mu += d * (nb / total);
            m2 += pq + d * d * (count * nb / total);
            count = total;
        }
        mean[ch] = mu;
        invstd[ch] = inv_std(m2 / count, eps);
        if (update) {
            const float rm = load_param<T>(rmean, ch, pf32);
            const float rv = load_param<T>(rvar, ch, pf32);
            store_param<T>(rmean, ch, pf32, momentum * mu + (1.0f - momentum) * rm);
            store_param<T>(rvar, ch, pf32, momentum * (m2 / (count - 1.0f)) + (1.0f - momentum) * rv);
        }
    }
}

template <typename T>
__device__ void bn_eval_stats_impl(const void* rmean, const void* rvar, u32 pf32, float eps,
                                   float* mean, float* invstd, u64 c) {
    FOR_EACH(i, c) {
        mean[i] = load_param<T>(rmean, i, pf32);
        invstd[i] = inv_std(load_param<T>(rvar, i, pf32), eps);
    }
}

template <typename T>
__device__ void bn_apply_impl(const T* x, const float* mean, const float* invstd, const void* g,
                              const void* b, u32 pf32, T* y, u64 total, Div c, Div s) {
    FOR_EACH(i, total) {
        const u64 ch = c.mod(s.div(i));
        const float v = (to_f32(x[i]) - mean[ch]) * invstd[ch] * load_param<T>(g, ch, pf32);
        y[i] = from_f32<T>(v + load_param<T>(b, ch, pf32));
    }
}

// The backward's per-channel sums in two kernels, over grid (c, parts) as the statistics:
// part[2 * (ch * parts + p)] = (sum of dy * xhat, sum of dy) over part p of channel ch.
template <typename T>
__device__ void bn_bwd_partial_impl(const T* x, const T* dy, const float* mean,
                                    const float* invstd, float* part, u64 n, u64 c, u64 s,
                                    u32 parts) {
    const u64 ch = blockIdx.x, p = blockIdx.y;
    u64 images;
    const u64 start = channel_part(n, c, s, parts, &images);
    const u64 m = images * s;
    const float mu = mean[ch], r = invstd[ch];
    float a = 0.0f, b = 0.0f;
    PlaneWalk v(s);
    for (u64 k = threadIdx.x; k < m; k += blockDim.x, v.next()) {
        const u64 i = start + v.y * c * s + v.x;
        const float g = to_f32(dy[i]);
        a += g * (to_f32(x[i]) - mu) * r;
        b += g;
    }
    a = block_sum(a);
    b = block_sum(b);
    if (threadIdx.x == 0) {
        part[2 * (ch * parts + p)] = a;
        part[2 * (ch * parts + p) + 1] = b;
    }
}

// sums[ch] = sum of dy * xhat, sums[c + ch] = sum of dy over channel ch: the parts added in
// order, one thread per channel.
extern "C" __global__ void bn_bwd_finalize(const float* part, float* sums, u64 c, u32 parts) {
    FOR_EACH(ch, c) {
        float a = 0.0f, b = 0.0f;
        for (u32 p = 0; p < parts; ++p) {
            a += part[2 * (ch * parts + p)];
            b += part[2 * (ch * parts + p) + 1];
        }
        sums[ch] = a;
        sums[c + ch] = b;
    }
}

template <typename T>
__device__ void bn_bwd_dx_impl(const T* x, const T* dy, const float* mean, const float* invstd,
                               const void* g, u32 pf32, const float* sums, T* dx, u64 total,
                               Div c, Div s) {
    const float m = (float)c.div(total);
    FOR_EACH(i, total) {
        const u64 ch = c.mod(s.div(i));
        const float r = invstd[ch];
        const float xhat = (to_f32(x[i]) - mean[ch]) * r;
        const float k = load_param<T>(g, ch, pf32) * r;
        dx[i] = from_f32<T>(k * (to_f32(dy[i]) - sums[c.d + ch] / m - xhat * sums[ch] / m));
    }
}

// Batch norm over a channels_last x: [n, h, w, c] seen as the matrix [rows, c] (rows = n * h *
// w, the channel the fastest index), after PyTorch's channels_last kernels
// (aten/src/ATen/native/cuda/Normalization.cuh, batch_norm_collect_statistics_channels_last_
// kernel and batch_norm_backward_reduce_channels_last_kernel, apex's welford_kernel_c_last):
// the threads of a warp run along 32 neighbouring channels, so each load of a row is one
// coalesced segment, the warps of a block and the blocks of grid.y along the rows; a block's
// warps merge in shared memory. Where PyTorch merges the blocks of a column with a staging
// buffer and semaphores (atomics), these write per-part partials, part[2 * (ch * parts + p)],
// part p the rows [rows * p / parts, rows * (p + 1) / parts): the layout of the NCHW kernels'
// with n = rows and s = 1, so bn_finalize and bn_bwd_finalize merge them and bn_apply and
// bn_bwd_dx (s = 1: channel = i % c) run the elementwise parts. Grid (ceil(c / 32), parts),
// blocks of whole warps, at most 32 of them.
#define BN_NHWC_LANES 32

// The two f32 sums of every warp of the block into those of its first warp, which returns
// them (other warps get garbage); all threads must call it.
__device__ __forceinline__ void bn_nhwc_merge(float* a, float* b) {
    __shared__ float sa[32][BN_NHWC_LANES], sb[32][BN_NHWC_LANES];
    const u32 lane = threadIdx.x % BN_NHWC_LANES, w = threadIdx.x / BN_NHWC_LANES;
    const u32 warps = blockDim.x / BN_NHWC_LANES;
    __syncthreads();
    sa[w][lane] = *a;
    sb[w][lane] = *b;
    __syncthreads();
    if (w == 0) {
        float ta = 0.0f, tb = 0.0f;
        for (u32 k = 0; k < warps; ++k) {
            ta += sa[k][lane];
            tb += sb[k][lane];
        }
        *a = ta;
        *b = tb;
    }
}

// The statistics' first kernel: each block's column part's mean and sum of squared deviations
// from it (two passes over the part, as bn_partial).
template <typename T>
__device__ void bn_nhwc_partial_impl(const T* x, float* part, u64 rows, u64 c, u32 parts) {
    __shared__ float mus[BN_NHWC_LANES];
    const u32 lane = threadIdx.x % BN_NHWC_LANES, w = threadIdx.x / BN_NHWC_LANES;
    const u32 warps = blockDim.x / BN_NHWC_LANES;
    const u64 ch = (u64)blockIdx.x * BN_NHWC_LANES + lane, p = blockIdx.y;
    const u64 r0 = part_start(rows, p, parts), r1 = part_start(rows, p + 1, parts);
    const bool live = ch < c;
    float sum = 0.0f, unused = 0.0f;
    if (live) {
        for (u64 r = r0 + w; r < r1; r += warps) sum += to_f32(x[r * c + ch]);
    }
    bn_nhwc_merge(&sum, &unused);
    if (w == 0) mus[lane] = r1 > r0 ? sum / (float)(r1 - r0) : 0.0f;
    __syncthreads();
    const float mu = mus[lane];
    float q = 0.0f;
    if (live) {
        for (u64 r = r0 + w; r < r1; r += warps) {
            const float d = to_f32(x[r * c + ch]) - mu;
            q += d * d;
        }
    }
    bn_nhwc_merge(&q, &unused);
    if (w == 0 && live) {
        part[2 * (ch * parts + p)] = mu;
        part[2 * (ch * parts + p) + 1] = q;
    }
}

// The backward's per-part sums of dy * xhat and dy, as bn_bwd_partial.
template <typename T>
__device__ void bn_nhwc_bwd_partial_impl(const T* x, const T* dy, const float* mean,
                                         const float* invstd, float* part, u64 rows, u64 c,
                                         u32 parts) {
    const u32 lane = threadIdx.x % BN_NHWC_LANES, w = threadIdx.x / BN_NHWC_LANES;
    const u32 warps = blockDim.x / BN_NHWC_LANES;
    const u64 ch = (u64)blockIdx.x * BN_NHWC_LANES + lane, p = blockIdx.y;
    const u64 r0 = part_start(rows, p, parts), r1 = part_start(rows, p + 1, parts);
    const bool live = ch < c;
    float a = 0.0f, b = 0.0f;
    if (live) {
        const float mu = mean[ch], r = invstd[ch];
        for (u64 row = r0 + w; row < r1; row += warps) {
            const u64 i = row * c + ch;
            const float g = to_f32(dy[i]);
            a += g * (to_f32(x[i]) - mu) * r;
            b += g;
        }
    }
    bn_nhwc_merge(&a, &b);
    if (w == 0 && live) {
        part[2 * (ch * parts + p)] = a;
        part[2 * (ch * parts + p) + 1] = b;
    }
}

#define ROWWISE(T, S) \
    extern "C" __global__ void softmax_##S(const T* x, T* y, u64 cols, u64 seq) { softmax_impl<T>(x, y, cols, seq); } \
    extern "C" __global__ void softmax_bwd_##S(const T* y, const T* dy, T* dx, u64 cols, u64 seq) { softmax_bwd_impl<T>(y, dy, dx, cols, seq); } \
    extern "C" __global__ void ce_fwd_##S(const T* x, const u32* t, u64 c, u32 ig, u32 has_ig, float* lse, float* loss) { ce_fwd_impl<T>(x, t, c, ig, has_ig, lse, loss); } \
    extern "C" __global__ void ce_bwd_##S(const T* x, const u32* t, const float* lse, float g, Div c, u32 ig, u32 has_ig, T* dx, u64 n) { ce_bwd_impl<T>(x, t, lse, g, c, ig, has_ig, dx, n); } \
    extern "C" __global__ void layer_norm_##S(const T* x, const T* g, const T* b, float eps, T* y, float* m, float* r, u64 d) { layer_norm_impl<T>(x, g, b, eps, y, m, r, d); } \
    extern "C" __global__ void layer_norm_bwd_fused_##S(const T* x, const T* g, const float* m, const float* r, const T* dy, T* dx, float* dg, float* db, u64 rows, u64 d, u64 chunk, u32 cols, u32 chunks) { layer_norm_bwd_fused_impl<T>(x, g, m, r, dy, dx, dg, db, rows, d, chunk, cols, chunks); } \
    extern "C" __global__ void layer_norm_bwd_finish_##S(const float* dg, const float* db, T* dgamma, T* dbeta, u64 chunks, u64 d) { layer_norm_bwd_finish_impl<T>(dg, db, dgamma, dbeta, chunks, d); } \
    extern "C" __global__ void bn_partial_##S(const T* x, float* part, u64 n, u64 c, u64 s, u32 parts) { bn_partial_impl<T>(x, part, n, c, s, parts); } \
    extern "C" __global__ void bn_finalize_##S(const float* part, float* m, float* r, void* rm, void* rv, u32 pf32, u32 update, float momentum, float eps, u64 n, u64 c, u64 s, u32 parts) { bn_finalize_impl<T>(part, m, r, rm, rv, pf32, update, momentum, eps, n, c, s, parts); } \
    extern "C" __global__ void bn_eval_stats_##S(const void* rm, const void* rv, u32 pf32, float eps, float* m, float* r, u64 c) { bn_eval_stats_impl<T>(rm, rv, pf32, eps, m, r, c); } \
    extern "C" __global__ void bn_apply_##S(const T* x, const float* m, const float* r, const void* g, const void* b, u32 pf32, T* y, u64 total, Div c, Div s) { bn_apply_impl<T>(x, m, r, g, b, pf32, y, total, c, s); } \
    extern "C" __global__ void bn_bwd_partial_##S(const T* x, const T* dy, const float* m, const float* r, float* part, u64 n, u64 c, u64 s, u32 parts) { bn_bwd_partial_impl<T>(x, dy, m, r, part, n, c, s, parts); } \
    extern "C" __global__ void bn_bwd_dx_##S(const T* x, const T* dy, const float* m, const float* r, const void* g, u32 pf32, const float* sums, T* dx, u64 total, Div c, Div s) { bn_bwd_dx_impl<T>(x, dy, m, r, g, pf32, sums, dx, total, c, s); } \
    extern "C" __global__ void bn_nhwc_partial_##S(const T* x, float* part, u64 rows, u64 c, u32 parts) { bn_nhwc_partial_impl<T>(x, part, rows, c, parts); } \
    extern "C" __global__ void bn_nhwc_bwd_partial_##S(const T* x, const T* dy, const float* m, const float* r, float* part, u64 rows, u64 c, u32 parts) { bn_nhwc_bwd_partial_impl<T>(x, dy, m, r, part, rows, c, parts); }
FOR_DTYPES(ROWWISE)

// Layer norm's backward with a residual, named layer_norm_bwd_residual_<stream>_<branch>.
#define LAYER_NORM_RESIDUAL(R, SR, B, SB) \
    extern "C" __global__ void layer_norm_bwd_residual_##SR##_##SB(const R* x, const R* g, const float* m, const float* r, const R* dy, const R* dres, R* dx, B* db, u32 has_branch, float p, float scale, u64 seed, u64 offset, float* dg, float* dbp, u64 rows, u64 d, u64 chunk, u32 cols, u32 chunks) { layer_norm_bwd_residual_impl<R, B>(x, g, m, r, dy, dres, dx, db, has_branch, p, scale, seed, offset, dg, dbp, rows, d, chunk, cols, chunks); }
FOR_DTYPE_PAIRS(LAYER_NORM_RESIDUAL)
