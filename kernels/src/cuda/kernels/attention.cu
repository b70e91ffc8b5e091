// Fused scaled dot-product attention (FlashAttention-2's split of the work, Dao 2023): no
// seq x seq buffer. The forward runs one block per tile of ATT_BQ query rows of one head
// (grid (query tiles, heads)), visiting the keys in tiles of ATT_BK with the online softmax
// and saving the output and each row's logsumexp. The backward recomputes the
// probabilities from the logsumexp, tile by tile: `attention_bwd_dot` computes
// D_i = dO_i . O_i, `attention_bwd_dkdv` one block per key tile (dK, dV over every query
// tile), `attention_bwd_dq` one block per query tile (dQ over every key tile), so each
// gradient element has one writer and no atomics are needed (FlashAttention-2 adds dQ with
// atomics instead).
//
// Two paths. f16 and bf16 with head dims a multiple of 16 run on tensor cores (`_mma`
// kernels below: mma.sync m16n8k16, 16-bit in, f32 accumulate, 64-row tiles, 16 rows a
// warp). Everything else (f32, other head dims) runs the kernels here: tiles of 16 rows
// held in shared memory as f32 and multiplied with f32 FMAs; the thread that owns column c
// (threadIdx.x) of the head dimension keeps that column of the block's accumulator in
// registers. Head dims up to ATT_DMAX; any sequence length (rows and
// keys past the end are masked). Dropout draws the probability (h, i, j) from element
// offset + (h * seq + i) * seq + j of the stream `seed`, as ops::dropout on the explicit
// probabilities [heads, seq, seq] would.
//
// Layouts: every kernel takes `nh`, the heads side by side in a token's row. nh = 1 is
// heads-major ([heads, seq, d]); nh > 1 tokens-major ([heads / nh, seq, nh, d], head
// h = b * nh + hh), where a head's rows are nh * d apart. lse and dsum are [heads, seq]
// in both. Grouped-query attention: `group` query heads share one key/value head (query
// head h reads key/value head h / group), and k, v, dk and dv hold heads / group heads,
// `nkv` of them side by side in a token's row (1 heads-major, nh / group tokens-major).

#define ATT_BQ 16
#define ATT_BK 16
#define ATT_DMAX 128
#define ATT_THREADS 128
// Row stride of the shared tiles: one float of padding so that threads reading the same
// column of different rows hit different banks.
#define ATT_LD (ATT_DMAX + 1)

// The first element of head h (see "Layouts" above).
__device__ __forceinline__ u64 att_head(u64 h, u64 nh, u64 seq, u64 d) {
    return (h / nh) * seq * nh * d + (h % nh) * d;
}

// The factor on probability (h, i, j): 1 / (1 - p) when dropout keeps it, else 0; 1
// without dropout.
__device__ __forceinline__ float att_drop(float p, u64 seed, u64 offset, u64 seq, u64 h, u64 i,
                                          u64 j) {
    if (p <= 0.0f) return 1.0f;
    const float u = philox_uniform(seed, offset + (h * seq + i) * seq + j);
    return u >= p ? 1.0f / (1.0f - p) : 0.0f;
}

// Copies rows [r0, r0 + ATT_BQ) (or ATT_BK) of a head's [seq, d] matrix (rows `ld` apart)
// into `tile` as f32, zeros past the end; thread c copies column c.
template <typename T, int ROWS>
__device__ __forceinline__ void att_load(float* tile, const T* m, u64 r0, u64 seq, u64 d,
                                         u64 ld) {
    const u32 c = threadIdx.x;
    if (c >= d) return;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        tile[r * ATT_LD + c] = r0 + r < seq ? to_f32(m[(r0 + r) * ld + c]) : 0.0f;
    }
}

__device__ __forceinline__ float att_dot(const float* a, const float* b, u64 d) {
    float s = 0.0f;
    for (u32 c = 0; c < d; ++c) s += a[c] * b[c];
    return s;
}

template <typename T>
__device__ void attention_fwd_impl(const T* q, const T* k, const T* v, T* o, float* lse, u64 seq,
                                   u64 d, u64 nh, u64 nkv, u64 group, float scale, u32 causal,
                                   float p, u64 seed, u64 offset) {
    __shared__ float qs[ATT_BQ * ATT_LD];
    __shared__ float ks[ATT_BK * ATT_LD];
    __shared__ float vs[ATT_BK * ATT_LD];
    __shared__ float ss[ATT_BQ * ATT_BK];
    __shared__ float row_m[ATT_BQ], row_l[ATT_BQ], row_alpha[ATT_BQ];
    const u64 h = blockIdx.y;
    const u64 i0 = (u64)blockIdx.x * ATT_BQ;
    const u32 t = threadIdx.x;
    const u64 head = att_head(h, nh, seq, d), ld = nh * d;
    const u64 kvhead = att_head(h / group, nkv, seq, d), kld = nkv * d;
    q += head;
    k += kvhead;
    v += kvhead;
    o += head;
    att_load<T, ATT_BQ>(qs, q, i0, seq, d, ld);
    if (t < ATT_BQ) {
        row_m[t] = neg_inf();
        row_l[t] = 0.0f;
    }
    float acc[ATT_BQ];
#pragma unroll
    for (int r = 0; r < ATT_BQ; ++r) acc[r] = 0.0f;
    const u64 last = i0 + ATT_BQ < seq ? i0 + ATT_BQ : seq;
    const u64 kend = causal ? last : seq;
    for (u64 j0 = 0; j0 < kend; j0 += ATT_BK) {
        __syncthreads();
        att_load<T, ATT_BK>(ks, k, j0, seq, d, kld);
        att_load<T, ATT_BK>(vs, v, j0, seq, d, kld);
        __syncthreads();
        for (u32 e = t; e < ATT_BQ * ATT_BK; e += ATT_THREADS) {
            const u32 r = e / ATT_BK, jj = e % ATT_BK;
            const u64 i = i0 + r, j = j0 + jj;
            const bool valid = i < seq && j < seq && !(causal && j > i);
            ss[e] = valid ? scale * att_dot(qs + r * ATT_LD, ks + jj * ATT_LD, d) : neg_inf();
        }
        __syncthreads();
        if (t < ATT_BQ) {
            const u32 r = t;
            float bm = neg_inf();
            for (u32 jj = 0; jj < ATT_BK; ++jj) bm = fmaxf(bm, ss[r * ATT_BK + jj]);
            const float m_old = row_m[r];
            const float m_new = fmaxf(m_old, bm);
            // A row with no visible key yet (past the end) keeps m = -inf and adds nothing.
            const bool none = m_new == neg_inf();
            const float alpha = none ? 1.0f : expf(m_old - m_new);
            float l = row_l[r] * alpha;
            for (u32 jj = 0; jj < ATT_BK; ++jj) {
                const float s = ss[r * ATT_BK + jj];
                const float e = none || s == neg_inf() ? 0.0f : expf(s - m_new);
                l += e;
                ss[r * ATT_BK + jj] =
                    e == 0.0f ? 0.0f : e * att_drop(p, seed, offset, seq, h, i0 + r, j0 + jj);
            }
            row_m[r] = m_new;
            row_l[r] = l;
            row_alpha[r] = alpha;
        }
        __syncthreads();
        if (t < d) {
#pragma unroll
            for (int r = 0; r < ATT_BQ; ++r) {
                float a = acc[r] * row_alpha[r];
                for (u32 jj = 0; jj < ATT_BK; ++jj) a += ss[r * ATT_BK + jj] * vs[jj * ATT_LD + t];
                acc[r] = a;
            }
        }
    }
    __syncthreads();
    if (t < d) {
#pragma unroll
        for (int r = 0; r < ATT_BQ; ++r) {
            if (i0 + r < seq) o[(i0 + r) * ld + t] = from_f32<T>(acc[r] / row_l[r]);
        }
    }
    if (t < ATT_BQ && i0 + t < seq) lse[h * seq + i0 + t] = row_m[t] + logf(row_l[t]);
}

// dsum[r] = dout[r] . o[r] for each of `rows` rows of d (row r = h * seq + i: row i of
// head h, in the layout nh says).
template <typename T>
__device__ void attention_bwd_dot_impl(const T* o, const T* dout, float* dsum, u64 rows, u64 seq,
                                       u64 d, u64 nh) {
    FOR_EACH(r, rows) {
        const u64 at = att_head(r / seq, nh, seq, d) + (r % seq) * nh * d;
        float s = 0.0f;
        for (u64 c = 0; c < d; ++c) s += to_f32(dout[at + c]) * to_f32(o[at + c]);
        dsum[r] = s;
    }
}

// For the query tile in qs/dos (rows i0..) and the key tile in ks/vs (keys j0..): the
// dropped probabilities P~ into pt and dS / scale into dst, [ATT_BQ][ATT_BK] each (0 where
// masked).
__device__ __forceinline__ void att_grad_tile(const float* qs, const float* dos, const float* ks,
                                              const float* vs, const float* lse_s,
                                              const float* dsum_s, float* pt, float* dst,
                                              u64 i0, u64 j0, u64 h, u64 seq, u64 d, float scale,
                                              u32 causal, float p, u64 seed, u64 offset) {
    for (u32 e = threadIdx.x; e < ATT_BQ * ATT_BK; e += ATT_THREADS) {
        const u32 r = e / ATT_BK, jj = e % ATT_BK;
        const u64 i = i0 + r, j = j0 + jj;
        float pd = 0.0f, ds = 0.0f;
        if (i < seq && j < seq && !(causal && j > i)) {
            const float pr =
                expf(scale * att_dot(qs + r * ATT_LD, ks + jj * ATT_LD, d) - lse_s[r]);
            const float f = att_drop(p, seed, offset, seq, h, i, j);
            const float dp = f == 0.0f ? 0.0f : f * att_dot(dos + r * ATT_LD, vs + jj * ATT_LD, d);
            pd = pr * f;
            ds = pr * (dp - dsum_s[r]);
        }
        pt[e] = pd;
        dst[e] = ds;
    }
}

// Loads lse and D of query rows i0.. into shared memory (0 past the end).
__device__ __forceinline__ void att_load_rows(float* lse_s, float* dsum_s, const float* lse,
                                              const float* dsum, u64 i0, u64 seq) {
    const u32 t = threadIdx.x;
    if (t < ATT_BQ) {
        lse_s[t] = i0 + t < seq ? lse[i0 + t] : 0.0f;
        dsum_s[t] = i0 + t < seq ? dsum[i0 + t] : 0.0f;
    }
}

// One block per key tile: dK = scale * dS^T Q, dV = P~^T dO over the query tiles that see
// the keys (from the key tile's diagonal on when causal).
template <typename T>
__device__ void attention_bwd_dkdv_impl(const T* q, const T* k, const T* v, const T* dout,
                                        const float* lse, const float* dsum, T* dk, T* dv,
                                        u64 seq, u64 d, u64 nh, u64 nkv, u64 group, float scale,
                                        u32 causal, float p, u64 seed, u64 offset) {
    __shared__ float qs[ATT_BQ * ATT_LD];
    __shared__ float dos[ATT_BQ * ATT_LD];
    __shared__ float ks[ATT_BK * ATT_LD];
    __shared__ float vs[ATT_BK * ATT_LD];
    __shared__ float pt[ATT_BQ * ATT_BK];
    __shared__ float dst[ATT_BQ * ATT_BK];
    __shared__ float lse_s[ATT_BQ], dsum_s[ATT_BQ];
    const u64 kh = blockIdx.y;  // the key/value head
    const u64 j0 = (u64)blockIdx.x * ATT_BK;
    const u32 t = threadIdx.x;
    const u64 kvhead = att_head(kh, nkv, seq, d), kld = nkv * d, ld = nh * d;
    att_load<T, ATT_BK>(ks, k + kvhead, j0, seq, d, kld);
    att_load<T, ATT_BK>(vs, v + kvhead, j0, seq, d, kld);
    float gk[ATT_BK], gv[ATT_BK];
#pragma unroll
    for (int j = 0; j < ATT_BK; ++j) gk[j] = gv[j] = 0.0f;
    const u64 first = causal ? j0 / ATT_BQ * ATT_BQ : 0;
    // Every query head of the group, each over the query tiles that see the keys.
    for (u64 h = kh * group; h < (kh + 1) * group; ++h)
    for (u64 i0 = first, head = att_head(h, nh, seq, d); i0 < seq; i0 += ATT_BQ) {
        __syncthreads();
        att_load<T, ATT_BQ>(qs, q + head, i0, seq, d, ld);
        att_load<T, ATT_BQ>(dos, dout + head, i0, seq, d, ld);
        att_load_rows(lse_s, dsum_s, lse + h * seq, dsum + h * seq, i0, seq);
        __syncthreads();
        att_grad_tile(qs, dos, ks, vs, lse_s, dsum_s, pt, dst, i0, j0, h, seq, d, scale, causal,
                      p, seed, offset);
        __syncthreads();
        if (t < d) {
#pragma unroll
            for (int j = 0; j < ATT_BK; ++j) {
                float a = gk[j], b = gv[j];
                for (u32 r = 0; r < ATT_BQ; ++r) {
                    a += dst[r * ATT_BK + j] * qs[r * ATT_LD + t];
                    b += pt[r * ATT_BK + j] * dos[r * ATT_LD + t];
                }
                gk[j] = a;
                gv[j] = b;
            }
        }
    }
    if (t < d) {
#pragma unroll
        for (int j = 0; j < ATT_BK; ++j) {
            if (j0 + j < seq) {
                dk[kvhead + (j0 + j) * kld + t] = from_f32<T>(scale * gk[j]);
                dv[kvhead + (j0 + j) * kld + t] = from_f32<T>(gv[j]);
            }
        }
    }
}

// One block per query tile: dQ = scale * dS K over the key tiles the queries see.
template <typename T>
__device__ void attention_bwd_dq_impl(const T* q, const T* k, const T* v, const T* dout,
                                      const float* lse, const float* dsum, T* dq, u64 seq, u64 d,
                                      u64 nh, u64 nkv, u64 group, float scale, u32 causal,
                                      float p, u64 seed, u64 offset) {
    __shared__ float qs[ATT_BQ * ATT_LD];
    __shared__ float dos[ATT_BQ * ATT_LD];
    __shared__ float ks[ATT_BK * ATT_LD];
    __shared__ float vs[ATT_BK * ATT_LD];
    __shared__ float pt[ATT_BQ * ATT_BK];
    __shared__ float dst[ATT_BQ * ATT_BK];
    __shared__ float lse_s[ATT_BQ], dsum_s[ATT_BQ];
    const u64 h = blockIdx.y;
    const u64 i0 = (u64)blockIdx.x * ATT_BQ;
    const u32 t = threadIdx.x;
    const u64 head = att_head(h, nh, seq, d), ld = nh * d;
    const u64 kvhead = att_head(h / group, nkv, seq, d), kld = nkv * d;
    att_load<T, ATT_BQ>(qs, q + head, i0, seq, d, ld);
    att_load<T, ATT_BQ>(dos, dout + head, i0, seq, d, ld);
    att_load_rows(lse_s, dsum_s, lse + h * seq, dsum + h * seq, i0, seq);
    float g[ATT_BQ];
#pragma unroll
    for (int r = 0; r < ATT_BQ; ++r) g[r] = 0.0f;
    const u64 last = i0 + ATT_BQ < seq ? i0 + ATT_BQ : seq;
    const u64 kend = causal ? last : seq;
    for (u64 j0 = 0; j0 < kend; j0 += ATT_BK) {
        __syncthreads();
        att_load<T, ATT_BK>(ks, k + kvhead, j0, seq, d, kld);
        att_load<T, ATT_BK>(vs, v + kvhead, j0, seq, d, kld);
        __syncthreads();
        att_grad_tile(qs, dos, ks, vs, lse_s, dsum_s, pt, dst, i0, j0, h, seq, d, scale, causal,
                      p, seed, offset);
        __syncthreads();
        if (t < d) {
#pragma unroll
            for (int r = 0; r < ATT_BQ; ++r) {
                float a = g[r];
                for (u32 j = 0; j < ATT_BK; ++j) a += dst[r * ATT_BK + j] * ks[j * ATT_LD + t];
                g[r] = a;
            }
        }
    }
    if (t < d) {
#pragma unroll
        for (int r = 0; r < ATT_BQ; ++r) {
            if (i0 + r < seq) dq[head + (i0 + r) * ld + t] = from_f32<T>(scale * g[r]);
        }
    }
}

// ---- The 16-bit forward on tensor cores ----------------------------------------------
//
// FlashAttention-2's forward: a block of 4 warps takes ATT_MQ = 64 query rows, 16 per warp,
// and visits the keys in tiles of ATT_MK = 64 staged in shared memory. Each warp computes
// its S = Q K^T (16 x 64) with mma.sync m16n8k16 (16-bit in, f32 accumulate), keeps its
// rows' online softmax in registers (a row's 64 scores live on the 4 lanes of a quad,
// reduced with shuffles), turns P into 16-bit A fragments in registers (the C layout of two
// 16x8 tiles is the A layout of one 16x16) and accumulates O += P V with mma.sync again.
// Q stays in registers as A fragments for the whole block. Head dims: multiples of 16 up to
// the instance's DM (64 or 128); any sequence length (rows and keys past the end are zeros, masked).

#define ATT_MQ 64
#define ATT_MK 64
// Each tensor-core kernel is instantiated for heads of at most DM (64 or 128): its register
// fragments and accumulators are sized for DM, so a 64-wide head does not pay 128's registers
// (at 128 dK/dV reads K and V from shared memory instead, see ATT_KV_DYN_BYTES; no instance
// spills: nvrtc_check's test compiles them for sm_90).
// Row stride (in 16-bit elements) of the shared K and V tiles of an instance for heads up to
// DM: even (pairs are read as one u32), padded by 8.
#define ATT_MLD(DM) ((DM) + 8)

template <typename T> struct att_is_bf16 { static constexpr bool value = false; };
template <> struct att_is_bf16<bf16_t> { static constexpr bool value = true; };

// d += a b for one m16n8k16 tile (fragments in PTX's layout, see emulate.rs's shim).
template <typename T>
__device__ __forceinline__ void mma_16816(float* d, const u32* a, const u32* b) {
#ifndef VRAM_HOST_EMULATION
    if (att_is_bf16<T>::value) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
#else
    emu_mma_16816(d, a, b, att_is_bf16<T>::value);
#endif
}

// Two 16-bit values as one fragment register, `lo` in the low half.
__device__ __forceinline__ u32 att_pack(u16 lo, u16 hi) { return (u32)lo | ((u32)hi << 16); }

template <typename T> __device__ __forceinline__ u32 att_pack_f32(float lo, float hi) {
    return att_pack(from_f32<T>(lo).bits, from_f32<T>(hi).bits);
}

// Rows [r0, r0 + ATT_MK) of a head's [seq, d] matrix (rows `ld` apart) into `tile` (16-bit
// bits, stride ATT_MLD(DM)), zeros past the end; pairs of elements per thread.
template <typename T, int DM>
__device__ __forceinline__ void att_load16(u16* tile, const T* m, u64 r0, u64 seq, u32 d,
                                           u64 ld) {
    const u32 pairs = d / 2;
    for (u32 e = threadIdx.x; e < ATT_MK * pairs; e += ATT_THREADS) {
        const u32 r = e / pairs, c = 2 * (e - r * pairs);
        u32 w = 0;
        if (r0 + r < seq) w = att_pack(m[(r0 + r) * ld + c].bits, m[(r0 + r) * ld + c + 1].bits);
        *reinterpret_cast<u32*>(tile + r * ATT_MLD(DM) + c) = w;
    }
}

template <int DM>
__device__ __forceinline__ u32 att_pair(const u16* tile, u32 r, u32 c) {
    return *reinterpret_cast<const u32*>(tile + r * ATT_MLD(DM) + c);
}

// A warp's A fragments of rows [r, r + 16) of `tile` (r = warp * 16), nk chunks of 16
// columns.
template <int DM>
__device__ __forceinline__ void att_frags(u32 (*a)[4], const u16* tile, u32 r, u32 nk) {
    const u32 lane = threadIdx.x % 32, g = lane / 4, tg = lane % 4;
#pragma unroll
    for (u32 kc = 0; kc < DM / 16; ++kc) {
        if (kc < nk) {
            a[kc][0] = att_pair<DM>(tile, r + g, kc * 16 + 2 * tg);
            a[kc][1] = att_pair<DM>(tile, r + g + 8, kc * 16 + 2 * tg);
            a[kc][2] = att_pair<DM>(tile, r + g, kc * 16 + 2 * tg + 8);
            a[kc][3] = att_pair<DM>(tile, r + g + 8, kc * 16 + 2 * tg + 8);
        }
    }
}

// s (16 x ATT_MK, C fragments) = A (16 x d, fragments a) times the transpose of the
// ATT_MK rows of `tile` (ATT_MK x d): each output column is one row of the tile.
template <typename T, int DM>
__device__ __forceinline__ void att_mma_rows(float (*s)[4], const u32 (*a)[4], const u16* tile,
                                             u32 nk) {
    const u32 lane = threadIdx.x % 32, g = lane / 4, tg = lane % 4;
#pragma unroll
    for (u32 nt = 0; nt < ATT_MK / 8; ++nt) {
        s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
        for (u32 kc = 0; kc < DM / 16; ++kc) {
            if (kc < nk) {
                const u32 b[2] = {att_pair<DM>(tile, nt * 8 + g, kc * 16 + 2 * tg),
                                  att_pair<DM>(tile, nt * 8 + g, kc * 16 + 2 * tg + 8)};
                mma_16816<T>(s[nt], a[kc], b);
            }
        }
    }
}

// att_mma_rows with the A operand read from rows [r, r + 16) of `atile` (shared memory) as
// it is used, each chunk of 16 columns once for all ATT_MK / 8 output tiles, instead of held
// as register fragments; the same products, each output summed in the same order.
template <typename T, int DM>
__device__ __forceinline__ void att_mma_rows_shared(float (*s)[4], const u16* atile, u32 r,
                                                    const u16* tile, u32 nk) {
    const u32 lane = threadIdx.x % 32, g = lane / 4, tg = lane % 4;
#pragma unroll
    for (u32 nt = 0; nt < ATT_MK / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
    for (u32 kc = 0; kc < DM / 16; ++kc) {
        if (kc < nk) {
            const u32 a[4] = {att_pair<DM>(atile, r + g, kc * 16 + 2 * tg),
                              att_pair<DM>(atile, r + g + 8, kc * 16 + 2 * tg),
                              att_pair<DM>(atile, r + g, kc * 16 + 2 * tg + 8),
                              att_pair<DM>(atile, r + g + 8, kc * 16 + 2 * tg + 8)};
#pragma unroll
            for (u32 nt = 0; nt < ATT_MK / 8; ++nt) {
                const u32 b[2] = {att_pair<DM>(tile, nt * 8 + g, kc * 16 + 2 * tg),
                                  att_pair<DM>(tile, nt * 8 + g, kc * 16 + 2 * tg + 8)};
                mma_16816<T>(s[nt], a, b);
            }
        }
    }
}

// The dK/dV kernel for heads wider than 64 keeps its key tile's K and V in shared memory
// rather than as register fragments: at 128 the fragments (64 registers a thread) on top of
// the dK and dV accumulators (128) and the two score tiles (64) pass the 255 registers a
// thread has, and ptxas spilled them to local memory. With the Q and dO tiles (static,
// 34,816 B at 128) they pass the 48 KiB of static shared memory, so K and V take the launch's
// dynamic shared memory: ATT_KV_DYN_BYTES, which the launch passes and opts in to
// (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES). The dQ kernel does the same with its
// dO tile (half of it). The emulation, one block at a time, gives them a static array.
#define ATT_KV_DYN_BYTES (2 * ATT_MK * ATT_MLD(ATT_DMAX) * 2)
#ifdef VRAM_HOST_EMULATION
#define ATT_DYNAMIC_SHARED(name) static u32 name[ATT_KV_DYN_BYTES / 4]
#else
#define ATT_DYNAMIC_SHARED(name) extern __shared__ u32 name[]
#endif

// acc (16 x d, C fragments, nd tiles of 8 columns) += c (16 x ATT_MK, C fragments, rounded
// to T as A fragments) times `tile` (ATT_MK x d).
template <typename T, int DM>
__device__ __forceinline__ void att_mma_acc(float (*acc)[4], const float (*c)[4], const u16* tile,
                                            u32 nd) {
    const u32 lane = threadIdx.x % 32, g = lane / 4, tg = lane % 4;
#pragma unroll
    for (u32 kc = 0; kc < ATT_MK / 16; ++kc) {
        const u32 pa[4] = {att_pack_f32<T>(c[2 * kc][0], c[2 * kc][1]),
                           att_pack_f32<T>(c[2 * kc][2], c[2 * kc][3]),
                           att_pack_f32<T>(c[2 * kc + 1][0], c[2 * kc + 1][1]),
                           att_pack_f32<T>(c[2 * kc + 1][2], c[2 * kc + 1][3])};
        const u32 key = kc * 16 + 2 * tg;
#pragma unroll
        for (u32 dt = 0; dt < DM / 8; ++dt) {
            if (dt < nd) {
                const u32 col = dt * 8 + g;
                const u32 b[2] = {
                    att_pack(tile[key * ATT_MLD(DM) + col], tile[(key + 1) * ATT_MLD(DM) + col]),
                    att_pack(tile[(key + 8) * ATT_MLD(DM) + col], tile[(key + 9) * ATT_MLD(DM) + col])};
                mma_16816<T>(acc[dt], pa, b);
            }
        }
    }
}

// The backward on tensor cores, FlashAttention-2's split without its atomics: a block of
// 4 warps per 64 keys (16 a warp) accumulates dK = scale dS^T Q and dV = P~^T dO over the
// query tiles in registers, computing S^T = K Q^T and dP^T = V dO^T with K and V as
// register fragments (heads of at most 64) or read from shared memory (wider); a block per
// 64 queries accumulates dQ = scale dS K, computing
// S = Q K^T and dP = dO V^T with Q and dO as register fragments. P~ and dS are rounded to
// T as mma operands, as FlashAttention does.
template <typename T, int DM>
__device__ void attention_bwd_dkdv_mma_impl(const T* q, const T* k, const T* v, const T* dout,
                                            const float* lse, const float* dsum, T* dk, T* dv,
                                            u64 seq, u64 d64, u64 nh, u64 nkv, u64 group,
                                            float scale, u32 causal, float pdrop, u64 seed,
                                            u64 offset) {
    __shared__ u32 qs_words[ATT_MK * ATT_MLD(DM) / 2];
    __shared__ u32 dos_words[ATT_MK * ATT_MLD(DM) / 2];
    __shared__ float lse_s[ATT_MK], dsum_s[ATT_MK];
    u16* qs = reinterpret_cast<u16*>(qs_words);
    u16* dos = reinterpret_cast<u16*>(dos_words);
    const u32 d = (u32)d64;
    const u64 kh = blockIdx.y;  // the key/value head
    const u64 j0 = (u64)blockIdx.x * ATT_MK;
    const u32 lane = threadIdx.x % 32, w = threadIdx.x / 32;
    const u32 g = lane / 4, tg = lane % 4;
    const u32 nk = d / 16, nd = d / 8;
    const u64 kvhead = att_head(kh, nkv, seq, d), kld = nkv * d, ld = nh * d;
    constexpr bool kv_shared = DM > 64;
    constexpr u32 frags = kv_shared ? 1 : DM / 16;
    u32 ka[frags][4], va[frags][4];
    ATT_DYNAMIC_SHARED(kv_words);
    u16* ks = reinterpret_cast<u16*>(kv_words);
    u16* vs = ks + ATT_MK * ATT_MLD(DM);
    if constexpr (kv_shared) {
        att_load16<T, DM>(ks, k + kvhead, j0, seq, d, kld);
        att_load16<T, DM>(vs, v + kvhead, j0, seq, d, kld);
    } else {
        att_load16<T, DM>(qs, k + kvhead, j0, seq, d, kld);
        att_load16<T, DM>(dos, v + kvhead, j0, seq, d, kld);
        __syncthreads();
        att_frags<DM>(ka, qs, w * 16, nk);
        att_frags<DM>(va, dos, w * 16, nk);
    }
    float gk[DM / 8][4], gv[DM / 8][4];
#pragma unroll
    for (u32 dt = 0; dt < DM / 8; ++dt) {
#pragma unroll
        for (u32 i = 0; i < 4; ++i) gk[dt][i] = gv[dt][i] = 0.0f;
    }
    const u64 key[2] = {j0 + w * 16 + g, j0 + w * 16 + g + 8};
    const u64 first = causal ? j0 : 0;
    // Every query head of the group, each over the query tiles that see the keys.
    for (u64 h = kh * group; h < (kh + 1) * group; ++h)
    for (u64 i0 = first, head = att_head(h, nh, seq, d); i0 < seq; i0 += ATT_MQ) {
        __syncthreads();
        att_load16<T, DM>(qs, q + head, i0, seq, d, ld);
        att_load16<T, DM>(dos, dout + head, i0, seq, d, ld);
        if (threadIdx.x < ATT_MQ) {
            const u64 r = i0 + threadIdx.x;
            lse_s[threadIdx.x] = r < seq ? lse[h * seq + r] : 0.0f;
            dsum_s[threadIdx.x] = r < seq ? dsum[h * seq + r] : 0.0f;
        }
        __syncthreads();
        float st[ATT_MK / 8][4], dpt[ATT_MK / 8][4];
        if constexpr (kv_shared) {
            att_mma_rows_shared<T, DM>(st, ks, w * 16, qs, nk);
            att_mma_rows_shared<T, DM>(dpt, vs, w * 16, dos, nk);
        } else {
            att_mma_rows<T, DM>(st, ka, qs, nk);
            att_mma_rows<T, DM>(dpt, va, dos, nk);
        }
#pragma unroll
        for (u32 nt = 0; nt < ATT_MK / 8; ++nt) {
#pragma unroll
            for (u32 i = 0; i < 4; ++i) {
                const u32 c = nt * 8 + 2 * tg + i % 2;
                const u64 kj = key[i / 2], qi = i0 + c;
                float pd = 0.0f, ds = 0.0f;
                if (kj < seq && qi < seq && !(causal && kj > qi)) {
                    const float pr = expf(st[nt][i] * scale - lse_s[c]);
                    const float f = att_drop(pdrop, seed, offset, seq, h, qi, kj);
                    pd = pr * f;
                    ds = pr * (f * dpt[nt][i] - dsum_s[c]);
                }
                st[nt][i] = pd;
                dpt[nt][i] = ds;
            }
        }
        att_mma_acc<T, DM>(gv, st, dos, nd);
        att_mma_acc<T, DM>(gk, dpt, qs, nd);
    }
#pragma unroll
    for (u32 dt = 0; dt < DM / 8; ++dt) {
        if (dt < nd) {
#pragma unroll
            for (u32 i = 0; i < 4; ++i) {
                const u64 kj = key[i / 2];
                if (kj < seq) {
                    const u64 at = kvhead + kj * kld + dt * 8 + 2 * tg + i % 2;
                    dk[at] = from_f32<T>(scale * gk[dt][i]);
                    dv[at] = from_f32<T>(gv[dt][i]);
                }
            }
        }
    }
}

template <typename T, int DM>
__device__ void attention_bwd_dq_mma_impl(const T* q, const T* k, const T* v, const T* dout,
                                          const float* lse, const float* dsum, T* dq, u64 seq,
                                          u64 d64, u64 nh, u64 nkv, u64 group, float scale,
                                          u32 causal, float pdrop, u64 seed, u64 offset) {
    __shared__ u32 ks_words[ATT_MK * ATT_MLD(DM) / 2];
    __shared__ u32 vs_words[ATT_MK * ATT_MLD(DM) / 2];
    u16* ks = reinterpret_cast<u16*>(ks_words);
    u16* vs = reinterpret_cast<u16*>(vs_words);
    const u32 d = (u32)d64;
    const u64 h = blockIdx.y;
    const u64 i0 = (u64)blockIdx.x * ATT_MQ;
    const u32 lane = threadIdx.x % 32, w = threadIdx.x / 32;
    const u32 g = lane / 4, tg = lane % 4;
    const u32 nk = d / 16, nd = d / 8;
    const u64 head = att_head(h, nh, seq, d), ld = nh * d;
    const u64 kvhead = att_head(h / group, nkv, seq, d), kld = nkv * d;
    // The heads' first elements, folded into the pointers (fewer live registers).
    q += head;
    dout += head;
    dq += head;
    k += kvhead;
    v += kvhead;
    // Heads wider than 64 read dO from (dynamic) shared memory rather than holding it as
    // register fragments, as the dK/dV kernel does K and V: held, the fragments took the
    // kernel to 255 registers and a spill.
    constexpr bool do_shared = DM > 64;
    u32 qa[DM / 16][4], da[do_shared ? 1 : DM / 16][4];
    ATT_DYNAMIC_SHARED(do_words);
    u16* dos = reinterpret_cast<u16*>(do_words);
    att_load16<T, DM>(ks, q, i0, seq, d, ld);
    att_load16<T, DM>(do_shared ? dos : vs, dout, i0, seq, d, ld);
    __syncthreads();
    att_frags<DM>(qa, ks, w * 16, nk);
    if constexpr (!do_shared) att_frags<DM>(da, vs, w * 16, nk);
    const u64 row[2] = {i0 + w * 16 + g, i0 + w * 16 + g + 8};
    float lse_r[2], dsum_r[2];
#pragma unroll
    for (u32 x = 0; x < 2; ++x) {
        lse_r[x] = row[x] < seq ? lse[h * seq + row[x]] : 0.0f;
        dsum_r[x] = row[x] < seq ? dsum[h * seq + row[x]] : 0.0f;
    }
    float gq[DM / 8][4];
#pragma unroll
    for (u32 dt = 0; dt < DM / 8; ++dt) gq[dt][0] = gq[dt][1] = gq[dt][2] = gq[dt][3] = 0.0f;
    const u64 last = i0 + ATT_MQ < seq ? i0 + ATT_MQ : seq;
    const u64 kend = causal ? last : seq;
    for (u64 j0 = 0; j0 < kend; j0 += ATT_MK) {
        __syncthreads();
        att_load16<T, DM>(ks, k, j0, seq, d, kld);
        att_load16<T, DM>(vs, v, j0, seq, d, kld);
        __syncthreads();
        float s[ATT_MK / 8][4], dp[ATT_MK / 8][4];
        att_mma_rows<T, DM>(s, qa, ks, nk);
        if constexpr (do_shared) {
            att_mma_rows_shared<T, DM>(dp, dos, w * 16, vs, nk);
        } else {
            att_mma_rows<T, DM>(dp, da, vs, nk);
        }
#pragma unroll
        for (u32 nt = 0; nt < ATT_MK / 8; ++nt) {
#pragma unroll
            for (u32 i = 0; i < 4; ++i) {
                const u32 x = i / 2;
                const u64 qi = row[x], kj = j0 + nt * 8 + 2 * tg + i % 2;
                float ds = 0.0f;
                if (qi < seq && kj < seq && !(causal && kj > qi)) {
                    const float pr = expf(s[nt][i] * scale - lse_r[x]);
                    const float f = att_drop(pdrop, seed, offset, seq, h, qi, kj);
                    ds = pr * (f * dp[nt][i] - dsum_r[x]);
                }
                s[nt][i] = ds;
            }
        }
        att_mma_acc<T, DM>(gq, s, ks, nd);
    }
#pragma unroll
    for (u32 dt = 0; dt < DM / 8; ++dt) {
        if (dt < nd) {
#pragma unroll
            for (u32 i = 0; i < 4; ++i) {
                const u64 qi = row[i / 2];
                if (qi < seq) dq[qi * ld + dt * 8 + 2 * tg + i % 2] = from_f32<T>(scale * gq[dt][i]);
            }
        }
    }
}

template <typename T, int DM>
__device__ void attention_fwd_mma_impl(const T* q, const T* k, const T* v, T* o, float* lse,
                                       u64 seq, u64 d64, u64 nh, u64 nkv, u64 group, float scale,
                                       u32 causal, float pdrop, u64 seed, u64 offset) {
    __shared__ u32 ks_words[ATT_MK * ATT_MLD(DM) / 2];
    __shared__ u32 vs_words[ATT_MK * ATT_MLD(DM) / 2];
    u16* ks = reinterpret_cast<u16*>(ks_words);
    u16* vs = reinterpret_cast<u16*>(vs_words);
    const u32 d = (u32)d64;
    const u64 h = blockIdx.y;
    const u64 i0 = (u64)blockIdx.x * ATT_MQ;
    const u32 lane = threadIdx.x % 32, w = threadIdx.x / 32;
    const u32 g = lane / 4, tg = lane % 4;
    const u32 nk = d / 16;  // k chunks of the head dim
    const u32 nd = d / 8;   // n tiles of the output
    const u64 head = att_head(h, nh, seq, d), ld = nh * d;
    const u64 kvhead = att_head(h / group, nkv, seq, d), kld = nkv * d;
    q += head;
    k += kvhead;
    v += kvhead;
    o += head;
    // Q's A fragments, through the K buffer.
    att_load16<T, DM>(ks, q, i0, seq, d, ld);
    __syncthreads();
    u32 qa[DM / 16][4];
    const u32 qr = w * 16 + g;
#pragma unroll
    for (u32 kc = 0; kc < DM / 16; ++kc) {
        if (kc < nk) {
            qa[kc][0] = att_pair<DM>(ks, qr, kc * 16 + 2 * tg);
            qa[kc][1] = att_pair<DM>(ks, qr + 8, kc * 16 + 2 * tg);
            qa[kc][2] = att_pair<DM>(ks, qr, kc * 16 + 2 * tg + 8);
            qa[kc][3] = att_pair<DM>(ks, qr + 8, kc * 16 + 2 * tg + 8);
        }
    }
    float oacc[DM / 8][4];
#pragma unroll
    for (u32 dt = 0; dt < DM / 8; ++dt) oacc[dt][0] = oacc[dt][1] = oacc[dt][2] = oacc[dt][3] = 0.0f;
    // This lane's two rows (g and g + 8 of the warp's 16): running max and partial sum.
    const u64 row[2] = {i0 + qr, i0 + qr + 8};
    float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.0f, 0.0f};
    const u64 last = i0 + ATT_MQ < seq ? i0 + ATT_MQ : seq;
    const u64 kend = causal ? last : seq;
    for (u64 j0 = 0; j0 < kend; j0 += ATT_MK) {
        __syncthreads();
        att_load16<T, DM>(ks, k, j0, seq, d, kld);
        att_load16<T, DM>(vs, v, j0, seq, d, kld);
        __syncthreads();
        float s[ATT_MK / 8][4];
#pragma unroll
        for (u32 nt = 0; nt < ATT_MK / 8; ++nt) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
            for (u32 kc = 0; kc < DM / 16; ++kc) {
                if (kc < nk) {
                    const u32 b[2] = {att_pair<DM>(ks, nt * 8 + g, kc * 16 + 2 * tg),
                                      att_pair<DM>(ks, nt * 8 + g, kc * 16 + 2 * tg + 8)};
                    mma_16816<T>(s[nt], qa[kc], b);
                }
            }
        }
        // Scale, mask, and each row's maximum over the quad.
        float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
        for (u32 nt = 0; nt < ATT_MK / 8; ++nt) {
#pragma unroll
            for (u32 i = 0; i < 4; ++i) {
                const u64 r = row[i / 2], j = j0 + nt * 8 + 2 * tg + i % 2;
                const bool valid = r < seq && j < seq && !(causal && j > r);
                s[nt][i] = valid ? s[nt][i] * scale : neg_inf();
                mx[i / 2] = fmaxf(mx[i / 2], s[nt][i]);
            }
        }
        float alpha[2];
#pragma unroll
        for (u32 x = 0; x < 2; ++x) {
            mx[x] = fmaxf(mx[x], __shfl_xor_sync(0xffffffffu, mx[x], 1));
            mx[x] = fmaxf(mx[x], __shfl_xor_sync(0xffffffffu, mx[x], 2));
            const float m_new = fmaxf(m[x], mx[x]);
            alpha[x] = m_new == neg_inf() ? 1.0f : expf(m[x] - m_new);
            m[x] = m_new;
            l[x] *= alpha[x];
        }
        // P (undropped into l, dropped into the A fragments).
#pragma unroll
        for (u32 nt = 0; nt < ATT_MK / 8; ++nt) {
#pragma unroll
            for (u32 i = 0; i < 4; ++i) {
                const u32 x = i / 2;
                const float e = s[nt][i] == neg_inf() ? 0.0f : expf(s[nt][i] - m[x]);
                l[x] += e;
                s[nt][i] = e == 0.0f ? 0.0f
                                     : e * att_drop(pdrop, seed, offset, seq, h, row[x],
                                                    j0 + nt * 8 + 2 * tg + i % 2);
            }
        }
#pragma unroll
        for (u32 dt = 0; dt < DM / 8; ++dt) {
            oacc[dt][0] *= alpha[0];
            oacc[dt][1] *= alpha[0];
            oacc[dt][2] *= alpha[1];
            oacc[dt][3] *= alpha[1];
        }
#pragma unroll
        for (u32 kc = 0; kc < ATT_MK / 16; ++kc) {
            const u32 pa[4] = {att_pack_f32<T>(s[2 * kc][0], s[2 * kc][1]),
                               att_pack_f32<T>(s[2 * kc][2], s[2 * kc][3]),
                               att_pack_f32<T>(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                               att_pack_f32<T>(s[2 * kc + 1][2], s[2 * kc + 1][3])};
            const u32 key = kc * 16 + 2 * tg;
#pragma unroll
            for (u32 dt = 0; dt < DM / 8; ++dt) {
                if (dt < nd) {
                    const u32 col = dt * 8 + g;
                    const u32 b[2] = {
                        att_pack(vs[key * ATT_MLD(DM) + col], vs[(key + 1) * ATT_MLD(DM) + col]),
                        att_pack(vs[(key + 8) * ATT_MLD(DM) + col], vs[(key + 9) * ATT_MLD(DM) + col])};
                    mma_16816<T>(oacc[dt], pa, b);
                }
            }
        }
    }
#pragma unroll
    for (u32 x = 0; x < 2; ++x) {
        l[x] += __shfl_xor_sync(0xffffffffu, l[x], 1);
        l[x] += __shfl_xor_sync(0xffffffffu, l[x], 2);
    }
#pragma unroll
    for (u32 dt = 0; dt < DM / 8; ++dt) {
        if (dt < nd) {
#pragma unroll
            for (u32 i = 0; i < 4; ++i) {
                const u32 x = i / 2;
                if (row[x] < seq) o[row[x] * ld + dt * 8 + 2 * tg + i % 2] = from_f32<T>(oacc[dt][i] / l[x]);
            }
        }
    }
    if (tg == 0) {
#pragma unroll
        for (u32 x = 0; x < 2; ++x) {
            if (row[x] < seq) lse[h * seq + row[x]] = m[x] + logf(l[x]);
        }
    }
}

// The tensor-core kernels of dtype T (suffix S) for heads up to DM, named with suffix N:
// `_d64` for heads of at most 64, none for at most 128.
#define ATTENTION_MMA(T, S, DM, N) \
    extern "C" __global__ void attention_fwd_mma##N##_##S(const T* q, const T* k, const T* v, T* o, float* lse, u64 seq, u64 d, u64 nh, u64 nkv, u64 group, float scale, u32 causal, float p, u64 seed, u64 offset) { attention_fwd_mma_impl<T, DM>(q, k, v, o, lse, seq, d, nh, nkv, group, scale, causal, p, seed, offset); } \
    extern "C" __global__ void attention_bwd_dkdv_mma##N##_##S(const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* dsum, T* dk, T* dv, u64 seq, u64 d, u64 nh, u64 nkv, u64 group, float scale, u32 causal, float p, u64 seed, u64 offset) { attention_bwd_dkdv_mma_impl<T, DM>(q, k, v, dout, lse, dsum, dk, dv, seq, d, nh, nkv, group, scale, causal, p, seed, offset); } \
    extern "C" __global__ void attention_bwd_dq_mma##N##_##S(const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* dsum, T* dq, u64 seq, u64 d, u64 nh, u64 nkv, u64 group, float scale, u32 causal, float p, u64 seed, u64 offset) { attention_bwd_dq_mma_impl<T, DM>(q, k, v, dout, lse, dsum, dq, seq, d, nh, nkv, group, scale, causal, p, seed, offset); }
ATTENTION_MMA(half_t, f16, 128, )
ATTENTION_MMA(bf16_t, bf16, 128, )
ATTENTION_MMA(half_t, f16, 64, _d64)
ATTENTION_MMA(bf16_t, bf16, 64, _d64)

#define ATTENTION(T, S) \
    extern "C" __global__ void attention_fwd_##S(const T* q, const T* k, const T* v, T* o, float* lse, u64 seq, u64 d, u64 nh, u64 nkv, u64 group, float scale, u32 causal, float p, u64 seed, u64 offset) { attention_fwd_impl<T>(q, k, v, o, lse, seq, d, nh, nkv, group, scale, causal, p, seed, offset); } \
    extern "C" __global__ void attention_bwd_dot_##S(const T* o, const T* dout, float* dsum, u64 rows, u64 seq, u64 d, u64 nh) { attention_bwd_dot_impl<T>(o, dout, dsum, rows, seq, d, nh); } \
    extern "C" __global__ void attention_bwd_dkdv_##S(const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* dsum, T* dk, T* dv, u64 seq, u64 d, u64 nh, u64 nkv, u64 group, float scale, u32 causal, float p, u64 seed, u64 offset) { attention_bwd_dkdv_impl<T>(q, k, v, dout, lse, dsum, dk, dv, seq, d, nh, nkv, group, scale, causal, p, seed, offset); } \
    extern "C" __global__ void attention_bwd_dq_##S(const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* dsum, T* dq, u64 seq, u64 d, u64 nh, u64 nkv, u64 group, float scale, u32 causal, float p, u64 seed, u64 offset) { attention_bwd_dq_impl<T>(q, k, v, dout, lse, dsum, dq, seq, d, nh, nkv, group, scale, causal, p, seed, offset); }
FOR_DTYPES(ATTENTION)
