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

// Max pool with the host's rules: strict > keeps the first maximum, NaN wins over numbers.
template <typename T> __device__ void max_pool_impl(const T* x, T* y, u32* arg, PoolGeom g) {
    const u64 total = (u64)(g.batch * g.channels * g.oh * g.ow);
    FOR_EACH(i, total) {
        const i64 ox = (i64)(i % (u64)g.ow);
        const i64 oy = (i64)((i / (u64)g.ow) % (u64)g.oh);
        const i64 plane = (i64)(i / (u64)(g.oh * g.ow));
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

// acc[plane, arg] += dy (f32 accumulator zeroed by the caller); out-of-plane indices are
// skipped.
template <typename T> __device__ void max_pool_bwd_impl(const T* dy, const u32* arg, float* acc, PoolGeom g) {
    const i64 ohw = g.oh * g.ow, hw = g.h * g.w;
    const u64 total = (u64)(g.batch * g.channels * ohw);
    FOR_EACH(i, total) {
        const i64 plane = (i64)(i / (u64)ohw);
        const u32 a = arg[i];
        if ((i64)a < hw) atomicAdd(acc + plane * hw + a, to_f32(dy[i]));
    }
}

__device__ __forceinline__ float divisor(const PoolGeom& g, i64 oy, i64 ox, u32 include_pad) {
    if (include_pad) return (float)(g.kh * g.kw);
    i64 y0, y1, x0, x1;
    window(g, oy, ox, &y0, &y1, &x0, &x1);
    return (float)((y1 - y0) * (x1 - x0));
}

template <typename T> __device__ void avg_pool_impl(const T* x, T* y, PoolGeom g, u32 include_pad) {
    const u64 total = (u64)(g.batch * g.channels * g.oh * g.ow);
    FOR_EACH(i, total) {
        const i64 ox = (i64)(i % (u64)g.ow);
        const i64 oy = (i64)((i / (u64)g.ow) % (u64)g.oh);
        const i64 plane = (i64)(i / (u64)(g.oh * g.ow));
        const T* xp = x + plane * g.h * g.w;
        i64 y0, y1, x0, x1;
        window(g, oy, ox, &y0, &y1, &x0, &x1);
        float s = 0.0f;
        for (i64 iy = y0; iy < y1; ++iy)
            for (i64 ix = x0; ix < x1; ++ix) s += to_f32(xp[iy * g.w + ix]);
        y[i] = from_f32<T>(s / divisor(g, oy, ox, include_pad));
    }
}

// Average-pool gradient gathered per input element over the windows that cover it.
template <typename T> __device__ void avg_pool_bwd_impl(const T* dy, T* dx, PoolGeom g, u32 include_pad) {
    const u64 total = (u64)(g.batch * g.channels * g.h * g.w);
    FOR_EACH(i, total) {
        const i64 ix = (i64)(i % (u64)g.w);
        const i64 iy = (i64)((i / (u64)g.w) % (u64)g.h);
        const i64 plane = (i64)(i / (u64)(g.h * g.w));
        const T* dyp = dy + plane * g.oh * g.ow;
        // Windows oy with oy * sh - ph <= iy < oy * sh - ph + kh.
        const i64 ty = iy + g.ph, tx = ix + g.pw;
        i64 oy0 = ty - g.kh + 1 > 0 ? (ty - g.kh + 1 + g.sh - 1) / g.sh : 0;
        i64 oy1 = ty / g.sh + 1 < g.oh ? ty / g.sh + 1 : g.oh;
        i64 ox0 = tx - g.kw + 1 > 0 ? (tx - g.kw + 1 + g.sw - 1) / g.sw : 0;
        i64 ox1 = tx / g.sw + 1 < g.ow ? tx / g.sw + 1 : g.ow;
        float s = 0.0f;
        for (i64 oy = oy0; oy < oy1; ++oy)
            for (i64 ox = ox0; ox < ox1; ++ox)
                s += to_f32(dyp[oy * g.ow + ox]) / divisor(g, oy, ox, include_pad);
        dx[i] = from_f32<T>(s);
    }
}

#define POOL(T, S) \
    extern "C" __global__ void max_pool_##S(const T* x, T* y, u32* arg, PoolGeom g) { max_pool_impl<T>(x, y, arg, g); } \
    extern "C" __global__ void max_pool_bwd_##S(const T* dy, const u32* arg, float* acc, PoolGeom g) { max_pool_bwd_impl<T>(dy, arg, acc, g); } \
    extern "C" __global__ void avg_pool_##S(const T* x, T* y, PoolGeom g, u32 inc) { avg_pool_impl<T>(x, y, g, inc); } \
    extern "C" __global__ void avg_pool_bwd_##S(const T* dy, T* dx, PoolGeom g, u32 inc) { avg_pool_bwd_impl<T>(dy, dx, g, inc); }
FOR_DTYPES(POOL)
