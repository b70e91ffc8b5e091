// 2-D pooling (NCHW). `PoolGeom` mirrors the Rust struct of the same name (all i64).

struct PoolGeom {
    i64 batch, channels, h, w, kh, kw, sh, sw, ph, pw, oh, ow;
};

// The input rows [*y0, *y1) and columns [*x0, *x1) under window (oy, ox), padding excluded.
__device__ __forceinline__ void window(const PoolGeom& g, i64 oy, i64 ox, i64* y0, i64* y1,
                                       i64* x0, i64* x1) {
    const i64 sy = oy * g.sh - g.ph, sx = ox * g.sw - g.pw;
    *y0 = sy > 0 ? sy : 0;
    *y1 = sy + g.kh < g.h ? sy + g.kh : g.h;
    *x0 = sx > 0 ? sx : 0;
    *x1 = sx + g.kw < g.w ? sx + g.kw : g.w;
}

// Element i of [planes, rows, cols] as (plane, row, col), with cols and rows as dividers.
__device__ __forceinline__ void decode(u64 i, Div cols, Div rows, i64* plane, i64* row,
                                       i64* col) {
    const u64 q = cols.div(i), p = rows.div(q);
    *col = (i64)(i - q * cols.d);
    *row = (i64)(q - p * rows.d);
    *plane = (i64)p;
}

// Max pool with the host's rules: strict > keeps the first maximum, NaN wins over numbers.
template <typename T>
__device__ void max_pool_impl(const T* x, T* y, u32* arg, PoolGeom g, Div ow, Div oh) {
    const u64 total = (u64)(g.batch * g.channels * g.oh * g.ow);
    FOR_EACH(i, total) {
        i64 plane, oy, ox;
        decode(i, ow, oh, &plane, &oy, &ox);
        const T* xp = x + plane * g.h * g.w;
        i64 y0, y1, x0, x1;
        window(g, oy, ox, &y0, &y1, &x0, &x1);
        float best = neg_inf();
        i64 at = y0 * g.w + x0;
        for (i64 iy = y0; iy < y1; ++iy) {
            for (i64 ix = x0; ix < x1; ++ix) {
                const float v = to_f32(xp[iy * g.w + ix]);
                if (v > best || (v != v && best == best)) {
                    best = v;
                    at = iy * g.w + ix;
                }
            }
        }
        y[i] = from_f32<T>(best);
        arg[i] = (u32)at;
    }
}

__device__ __forceinline__ float divisor(const PoolGeom& g, i64 oy, i64 ox, u32 include_pad) {
    if (include_pad) return (float)(g.kh * g.kw);
    i64 y0, y1, x0, x1;
    window(g, oy, ox, &y0, &y1, &x0, &x1);
    return (float)((y1 - y0) * (x1 - x0));
}

template <typename T>
__device__ void avg_pool_impl(const T* x, T* y, PoolGeom g, u32 include_pad, Div ow, Div oh) {
    const u64 total = (u64)(g.batch * g.channels * g.oh * g.ow);
    FOR_EACH(i, total) {
        i64 plane, oy, ox;
        decode(i, ow, oh, &plane, &oy, &ox);
        const T* xp = x + plane * g.h * g.w;
        i64 y0, y1, x0, x1;
        window(g, oy, ox, &y0, &y1, &x0, &x1);
        float s = 0.0f;
        for (i64 iy = y0; iy < y1; ++iy)
            for (i64 ix = x0; ix < x1; ++ix) s += to_f32(xp[iy * g.w + ix]);
        y[i] = from_f32<T>(s / divisor(g, oy, ox, include_pad));
    }
}

// The windows along one axis that cover input position t + pad (t >= 0): [*o0, *o1), those
// o < out with o * stride <= t + pad < o * stride + k.
__device__ __forceinline__ void covering(i64 tp, i64 k, Div stride, i64 out, i64* o0, i64* o1) {
    const i64 s = (i64)stride.d;
    *o0 = tp - k + 1 > 0 ? (i64)stride.div((u64)(tp - k + s)) : 0;
    const i64 last = (i64)stride.div((u64)tp) + 1;
    *o1 = last < out ? last : out;
}

// Max-pool gradient gathered per input element: the sum of dy over the windows that cover it
// and chose it (arg), added in window order, as the host's scatter adds them, and rounded
// once. Every element is written by one thread (no atomics): the result repeats bit for
// bit and equals the host's.
template <typename T>
__device__ void max_pool_bwd_impl(const T* dy, const u32* arg, T* dx, PoolGeom g, Div w, Div h,
                                  Div sh, Div sw) {
    const u64 total = (u64)(g.batch * g.channels) * h.d * w.d;
    FOR_EACH(i, total) {
        i64 plane, iy, ix;
        decode(i, w, h, &plane, &iy, &ix);
        const i64 out = plane * g.oh * g.ow;
        const u32 at = (u32)(iy * g.w + ix);
        i64 oy0, oy1, ox0, ox1;
        covering(iy + g.ph, g.kh, sh, g.oh, &oy0, &oy1);
        covering(ix + g.pw, g.kw, sw, g.ow, &ox0, &ox1);
        float s = 0.0f;
        for (i64 oy = oy0; oy < oy1; ++oy)
            for (i64 ox = ox0; ox < ox1; ++ox)
                if (arg[out + oy * g.ow + ox] == at) s += to_f32(dy[out + oy * g.ow + ox]);
        dx[i] = from_f32<T>(s);
    }
}

// Average-pool gradient gathered per input element over the windows that cover it.
template <typename T>
__device__ void avg_pool_bwd_impl(const T* dy, T* dx, PoolGeom g, u32 include_pad, Div w, Div h,
                                  Div sh, Div sw) {
    const u64 total = (u64)(g.batch * g.channels) * h.d * w.d;
    FOR_EACH(i, total) {
        i64 plane, iy, ix;
        decode(i, w, h, &plane, &iy, &ix);
        const T* dyp = dy + plane * g.oh * g.ow;
        i64 oy0, oy1, ox0, ox1;
        covering(iy + g.ph, g.kh, sh, g.oh, &oy0, &oy1);
        covering(ix + g.pw, g.kw, sw, g.ow, &ox0, &ox1);
        float s = 0.0f;
        for (i64 oy = oy0; oy < oy1; ++oy)
            for (i64 ox = ox0; ox < ox1; ++ox)
                s += to_f32(dyp[oy * g.ow + ox]) / divisor(g, oy, ox, include_pad);
        dx[i] = from_f32<T>(s);
    }
}

#define POOL(T, S) \
    extern "C" __global__ void max_pool_##S(const T* x, T* y, u32* arg, PoolGeom g, Div ow, Div oh) { max_pool_impl<T>(x, y, arg, g, ow, oh); } \
    extern "C" __global__ void max_pool_bwd_##S(const T* dy, const u32* arg, T* dx, PoolGeom g, Div w, Div h, Div sh, Div sw) { max_pool_bwd_impl<T>(dy, arg, dx, g, w, h, sh, sw); } \
    extern "C" __global__ void avg_pool_##S(const T* x, T* y, PoolGeom g, u32 inc, Div ow, Div oh) { avg_pool_impl<T>(x, y, g, inc, ow, oh); } \
    extern "C" __global__ void avg_pool_bwd_##S(const T* dy, T* dx, PoolGeom g, u32 inc, Div w, Div h, Div sh, Div sw) { avg_pool_bwd_impl<T>(dy, dx, g, inc, w, h, sh, sw); }
FOR_DTYPES(POOL)

// Channels_last (NHWC) pooling: x [batch, h, w, channels], one thread per element with the
// channel fastest, so that a warp reads 32 neighbouring channels of one pixel (coalesced),
// as PyTorch's `max_pool_forward_nhwc` / `max_pool_backward_nhwc` put threads along the
// channels (aten/src/ATen/native/cuda/DilatedMaxPool2d.cu; its indices, like these, are
// the position in the channel's plane, ih * width + iw). Each thread visits its channel's
// window in the NCHW kernels' order with their comparison and sums: the results are theirs,
// permuted, bit for bit.

// Max pool, channels_last: y and arg [batch, oh, ow, channels].
template <typename T>
__device__ void max_pool_nhwc_impl(const T* x, T* y, u32* arg, PoolGeom g, Div c, Div ow,
                                   Div oh) {
    const u64 total = (u64)(g.batch * g.oh * g.ow * g.channels);
    FOR_EACH(i, total) {
        const u64 q = c.div(i);
        const i64 ch = (i64)(i - q * c.d);
        i64 b, oy, ox;
        decode(q, ow, oh, &b, &oy, &ox);
        const T* xb = x + b * g.h * g.w * g.channels + ch;
        i64 y0, y1, x0, x1;
        window(g, oy, ox, &y0, &y1, &x0, &x1);
        float best = neg_inf();
        i64 at = y0 * g.w + x0;
        for (i64 iy = y0; iy < y1; ++iy) {
            for (i64 ix = x0; ix < x1; ++ix) {
                const float v = to_f32(xb[(iy * g.w + ix) * g.channels]);
                if (v > best || (v != v && best == best)) {
                    best = v;
                    at = iy * g.w + ix;
                }
            }
        }
        y[i] = from_f32<T>(best);
        arg[i] = (u32)at;
    }
}

// Max-pool gradient, channels_last, gathered per input element over the windows that cover
// it and chose it, in window order, rounded once (max_pool_bwd_impl's sum).
template <typename T>
__device__ void max_pool_nhwc_bwd_impl(const T* dy, const u32* arg, T* dx, PoolGeom g, Div c,
                                       Div w, Div h, Div sh, Div sw) {
    const u64 total = (u64)(g.batch * g.channels) * h.d * w.d;
    FOR_EACH(i, total) {
        const u64 q = c.div(i);
        const i64 ch = (i64)(i - q * c.d);
        i64 b, iy, ix;
        decode(q, w, h, &b, &iy, &ix);
        const u32 at = (u32)(iy * g.w + ix);
        i64 oy0, oy1, ox0, ox1;
        covering(iy + g.ph, g.kh, sh, g.oh, &oy0, &oy1);
        covering(ix + g.pw, g.kw, sw, g.ow, &ox0, &ox1);
        float s = 0.0f;
        for (i64 oy = oy0; oy < oy1; ++oy) {
            for (i64 ox = ox0; ox < ox1; ++ox) {
                const i64 o = ((b * g.oh + oy) * g.ow + ox) * g.channels + ch;
                if (arg[o] == at) s += to_f32(dy[o]);
            }
        }
        dx[i] = from_f32<T>(s);
    }
}

// Global average pool, channels_last: x [batch, hw, c] to y [batch, c]. One thread per
// (image, chunk of `rows` positions, channel), i over [batch, chunks, c]: the chunk's sum in
// position order from -0.0 (the host's `global_avg_pool_nhwc`); with one chunk it writes
// the mean, else its partial sum, which global_avg_pool_nhwc_finish adds in chunk order.
template <typename T>
__device__ void global_avg_pool_nhwc_impl(const T* x, float* partial, T* y, u64 total, Div c,
                                          Div chunks, u64 hw, u64 rows) {
    FOR_EACH(i, total) {
        const u64 q = c.div(i), ch = i - q * c.d;
        const u64 b = chunks.div(q), k = q - b * chunks.d;
        const u64 r0 = k * rows, r1 = r0 + rows < hw ? r0 + rows : hw;
        float s = -0.0f;
        for (u64 r = r0; r < r1; ++r) s += to_f32(x[(b * hw + r) * c.d + ch]);
        if (chunks.d == 1) {
            y[i] = from_f32<T>(s / (float)hw);
        } else {
            partial[i] = s;
        }
    }
}

// y[b, ch] = the [batch, chunks, c] partials' sum over chunks, in chunk order from -0.0,
// over hw.
template <typename T>
__device__ void global_avg_pool_nhwc_finish_impl(const float* partial, T* y, u64 total, Div c,
                                                 u64 chunks, u64 hw) {
    FOR_EACH(i, total) {
        const u64 b = c.div(i), ch = i - b * c.d;
        float s = -0.0f;
        for (u64 k = 0; k < chunks; ++k) s += partial[(b * chunks + k) * c.d + ch];
        y[i] = from_f32<T>(s / (float)hw);
    }
}

// The global average pool's gradient, channels_last: dx[b, i, ch] = dy[b, ch] / hw, or
// (add) that added into dx, one rounding.
template <typename T>
__device__ void global_avg_pool_nhwc_bwd_impl(const T* dy, T* dx, u64 n, Div c, Div hwc,
                                              float hw, u32 add) {
    FOR_EACH(i, n) {
        const float g = to_f32(dy[hwc.div(i) * c.d + c.mod(i)]) / hw;
        dx[i] = from_f32<T>(add ? to_f32(dx[i]) + g : g);
    }
}

#define POOL_NHWC(T, S) \
    extern "C" __global__ void max_pool_nhwc_##S(const T* x, T* y, u32* arg, PoolGeom g, Div c, Div ow, Div oh) { max_pool_nhwc_impl<T>(x, y, arg, g, c, ow, oh); } \
    extern "C" __global__ void max_pool_nhwc_bwd_##S(const T* dy, const u32* arg, T* dx, PoolGeom g, Div c, Div w, Div h, Div sh, Div sw) { max_pool_nhwc_bwd_impl<T>(dy, arg, dx, g, c, w, h, sh, sw); } \
    extern "C" __global__ void global_avg_pool_nhwc_##S(const T* x, float* p, T* y, u64 total, Div c, Div chunks, u64 hw, u64 rows) { global_avg_pool_nhwc_impl<T>(x, p, y, total, c, chunks, hw, rows); } \
    extern "C" __global__ void global_avg_pool_nhwc_finish_##S(const float* p, T* y, u64 total, Div c, u64 chunks, u64 hw) { global_avg_pool_nhwc_finish_impl<T>(p, y, total, c, chunks, hw); } \
    extern "C" __global__ void global_avg_pool_nhwc_bwd_##S(const T* dy, T* dx, u64 n, Div c, Div hwc, float hw, u32 add) { global_avg_pool_nhwc_bwd_impl<T>(dy, dx, n, c, hwc, hw, add); }
FOR_DTYPES(POOL_NHWC)
