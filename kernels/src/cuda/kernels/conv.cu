// 2-D convolution helpers (NCHW): im2col / col2im for the cuBLAS path, direct kernels for
// depthwise and small convolutions, and the per-channel bias broadcast. `ConvGeom` mirrors
// the Rust struct of the same name field for field (all i64, so no padding).

struct ConvGeom {
    i64 batch, c_in, h, w, c_out, kh, kw, sh, sw, ph, pw, dh, dw, groups, oh, ow;
};

// In a gradient gather: whether input offset t = i + pad - k * dilation is read by an output
// position along one axis, and which (into *o): t >= 0, a multiple of the stride (no
// division when `unit`), below `limit`.
__device__ __forceinline__ bool tap_source(i64 t, i64 stride, bool unit, i64 limit, i64* o) {
    if (t < 0) return false;
    if (!unit) {
        if (t % stride != 0) return false;
        t /= stride;
    }
    *o = t;
    return t < limit;
}

// The im2col matrices of images n0 .. n0 + nimg and channel group `group`: col[img][row][pos]
// (one [k, ohw] matrix per image, the forward's), or with `rows_outer` col[row][img][pos]
// (one [k, nimg * ohw] matrix whose columns run over the images' positions, the weight
// gradient's), where row = (c * kh + ky) * kw + kx over the group's channels and
// pos = oy * ow + ox. One block per (img, row) (grid nimg * k), its threads over the row's
// positions: the row is decoded once per thread and (oy, ox) stepped without a division per
// element. With a 1x1 geometry over planes of `dy` this lays out dy's channels as rows.
template <typename T>
__device__ void im2col_impl(const T* x, T* col, ConvGeom g, i64 n0, i64 nimg, i64 group,
                            u32 rows_outer) {
    const i64 cin_g = g.c_in / g.groups;
    const i64 k = cin_g * g.kh * g.kw;
    const i64 ohw = g.oh * g.ow;
    const i64 b = blockIdx.x;
    const i64 img = b / k, row = b % k;
    const i64 c = row / (g.kh * g.kw);
    const i64 ky = (row / g.kw) % g.kh, kx = row % g.kw;
    const T* plane = x + ((n0 + img) * g.c_in + group * cin_g + c) * g.h * g.w;
    T* out = col + (rows_outer ? row * nimg + img : b) * ohw;
    const i64 y0 = ky * g.dh - g.ph, x0 = kx * g.dw - g.pw;
    PlaneWalk o(g.ow);
    for (i64 pos = threadIdx.x; pos < ohw; pos += blockDim.x, o.next()) {
        const i64 iy = o.y * g.sh + y0, ix = o.x * g.sw + x0;
        T v = from_f32<T>(0.0f);
        if (iy >= 0 && iy < g.h && ix >= 0 && ix < g.w) v = plane[iy * g.w + ix];
        out[pos] = v;
    }
}

// Gathers the f32 column gradient `dcol` (im2col layout) back into dx for images
// n0 .. n0 + nimg and channel group `group`, one rounding: blocks (img * cin_g + c, part)
// (grid nimg * cin_g by parts), part p's threads at positions p * blockDim.x + t stepping
// gridDim.y * blockDim.x, so that few large planes (a stem's 3 channels of 224 x 224) still
// fill the device; with unit strides no tap needs a division.
template <typename T>
__device__ void col2im_impl(const float* dcol, T* dx, ConvGeom g, i64 n0, i64 nimg, i64 group) {
    const i64 cin_g = g.c_in / g.groups;
    const i64 taps = g.kh * g.kw;
    const i64 ohw = g.oh * g.ow;
    const i64 b = blockIdx.x;
    const i64 img = b / cin_g, c = b % cin_g;
    const float* base = dcol + (img * cin_g + c) * taps * ohw;
    T* plane = dx + ((n0 + img) * g.c_in + group * cin_g + c) * g.h * g.w;
    const bool unit = g.sh == 1 && g.sw == 1;
    const i64 hw = g.h * g.w;
    const i64 start = (i64)blockIdx.y * blockDim.x + threadIdx.x;
    const i64 step = (i64)gridDim.y * blockDim.x;
    PlaneWalk in(g.w, start, step);
    for (i64 pos = start; pos < hw; pos += step, in.next()) {
        float s = 0.0f;
        for (i64 ky = 0; ky < g.kh; ++ky) {
            i64 oy;
            if (!tap_source(in.y + g.ph - ky * g.dh, g.sh, unit, g.oh, &oy)) continue;
            for (i64 kx = 0; kx < g.kw; ++kx) {
                i64 ox;
                if (!tap_source(in.x + g.pw - kx * g.dw, g.sw, unit, g.ow, &ox)) continue;
                s += base[(ky * g.kw + kx) * ohw + oy * g.ow + ox];
            }
        }
        plane[pos] = from_f32<T>(s);
    }
}

// y[n, c, pos] = bias[c]: the C operand of the forward gemm with beta = 1.
template <typename T> __device__ void bias_planes_impl(const T* bias, T* y, u64 n, Div c, Div ohw) {
    FOR_EACH(i, n) y[i] = bias[c.mod(ohw.div(i))];
}

// Direct convolution (depthwise, or small enough that an im2col buffer is not worth it),
// any groups: one block per output plane (n, co) (grid batch * c_out), its threads over the
// plane's positions stepped as in im2col, each summing over its group's input channels and
// the taps in f32, one rounding.
template <typename T>
__device__ void direct_fwd_impl(const T* x, const T* wt, const T* bias, u32 has_bias, T* y, ConvGeom g) {
    const i64 cin_g = g.c_in / g.groups;
    const i64 cout_g = g.c_out / g.groups;
    const i64 ohw = g.oh * g.ow;
    const i64 b = blockIdx.x;
    const i64 n = b / g.c_out, co = b % g.c_out;
    const T* xn = x + (n * g.c_in + (co / cout_g) * cin_g) * g.h * g.w;
    const T* wc = wt + co * cin_g * g.kh * g.kw;
    T* out = y + b * ohw;
    PlaneWalk o(g.ow);
    for (i64 pos = threadIdx.x; pos < ohw; pos += blockDim.x, o.next()) {
        float s = 0.0f;
        for (i64 c = 0; c < cin_g; ++c) {
            const T* xp = xn + c * g.h * g.w;
            const T* wp = wc + c * g.kh * g.kw;
            for (i64 ky = 0; ky < g.kh; ++ky) {
                const i64 iy = o.y * g.sh - g.ph + ky * g.dh;
                if (iy < 0 || iy >= g.h) continue;
                for (i64 kx = 0; kx < g.kw; ++kx) {
                    const i64 ix = o.x * g.sw - g.pw + kx * g.dw;
                    if (ix < 0 || ix >= g.w) continue;
                    s += to_f32(wp[ky * g.kw + kx]) * to_f32(xp[iy * g.w + ix]);
                }
            }
        }
        if (has_bias) s += to_f32(bias[co]);
        out[pos] = from_f32<T>(s);
    }
}

// Direct input gradient: one block per input plane (n, ci) (grid batch * c_in), its threads
// over the plane's positions, each gathering over its group's output channels and the taps
// that read it (no division for unit strides).
template <typename T>
__device__ void direct_bwd_input_impl(const T* wt, const T* dy, T* dx, ConvGeom g) {
    const i64 cin_g = g.c_in / g.groups;
    const i64 cout_g = g.c_out / g.groups;
    const i64 ohw = g.oh * g.ow;
    const i64 hw = g.h * g.w;
    const i64 b = blockIdx.x;
    const i64 n = b / g.c_in, ci = b % g.c_in;
    const i64 grp = ci / cin_g, cl = ci % cin_g;
    const T* dyn = dy + (n * g.c_out + grp * cout_g) * ohw;
    const T* wg = wt + (grp * cout_g * cin_g + cl) * g.kh * g.kw;
    T* plane = dx + b * hw;
    const bool unit = g.sh == 1 && g.sw == 1;
    PlaneWalk in(g.w);
    for (i64 pos = threadIdx.x; pos < hw; pos += blockDim.x, in.next()) {
        float s = 0.0f;
        for (i64 ky = 0; ky < g.kh; ++ky) {
            i64 oy;
            if (!tap_source(in.y + g.ph - ky * g.dh, g.sh, unit, g.oh, &oy)) continue;
            for (i64 kx = 0; kx < g.kw; ++kx) {
                i64 ox;
                if (!tap_source(in.x + g.pw - kx * g.dw, g.sw, unit, g.ow, &ox)) continue;
                for (i64 o = 0; o < cout_g; ++o) {
                    s += to_f32(wg[(o * cin_g * g.kh + ky) * g.kw + kx])
                        * to_f32(dyn[o * ohw + oy * g.ow + ox]);
                }
            }
        }
        plane[pos] = from_f32<T>(s);
    }
}

// Direct weight gradient: one block per weight element (co, c, ky, kx), reducing over the
// batch and, per image, over the output plane's positions stepped as in im2col.
template <typename T>
__device__ void direct_bwd_weight_impl(const T* x, const T* dy, T* dw, ConvGeom g) {
    const i64 cin_g = g.c_in / g.groups;
    const i64 cout_g = g.c_out / g.groups;
    const i64 tap = blockIdx.x;
    const i64 kx = tap % g.kw;
    const i64 ky = (tap / g.kw) % g.kh;
    const i64 c = (tap / (g.kh * g.kw)) % cin_g;
    const i64 co = tap / (g.kh * g.kw * cin_g);
    const i64 ci = (co / cout_g) * cin_g + c;
    const i64 ohw = g.oh * g.ow;
    const i64 y0 = ky * g.dh - g.ph, x0 = kx * g.dw - g.pw;
    const PlaneWalk first(g.ow);
    float s = 0.0f;
    for (i64 n = 0; n < g.batch; ++n) {
        const T* dyp = dy + (n * g.c_out + co) * ohw;
        const T* xp = x + (n * g.c_in + ci) * g.h * g.w;
        PlaneWalk o = first;
        for (i64 pos = threadIdx.x; pos < ohw; pos += blockDim.x, o.next()) {
            const i64 iy = o.y * g.sh + y0, ix = o.x * g.sw + x0;
            if (iy >= 0 && iy < g.h && ix >= 0 && ix < g.w)
                s += to_f32(dyp[pos]) * to_f32(xp[iy * g.w + ix]);
        }
    }
    s = block_sum(s);
    if (threadIdx.x == 0) dw[tap] = from_f32<T>(s);
}

// Largest depthwise kernel side whose weight gradient keeps its taps in registers.
#define DW_MAX_SIDE 7

// Depthwise weight gradient, first pass: one block per (image n, channel c) (grid
// batch * c_out), each thread adding, for every tap, dy * x over its positions of the plane
// in registers (the kh x kw taps unrolled up to DW_MAX_SIDE); the block's sums go to
// partial[n][c][tap], which column sums then add over the images in order. dy is read once
// and x from cache, with batch * c_out blocks; one block per weight element summing over
// every image (direct_bwd_weight) left an early MobileNet layer 144 blocks of 800K terms.
template <typename T>
__device__ void depthwise_bwd_weight_impl(const T* x, const T* dy, float* partial, ConvGeom g) {
    const i64 ohw = g.oh * g.ow;
    const i64 b = blockIdx.x;
    const T* dyp = dy + b * ohw;
    const T* xp = x + b * g.h * g.w;  // depthwise: c_in == c_out, channel c reads channel c
    float acc[DW_MAX_SIDE][DW_MAX_SIDE];
#pragma unroll
    for (int ky = 0; ky < DW_MAX_SIDE; ++ky)
#pragma unroll
        for (int kx = 0; kx < DW_MAX_SIDE; ++kx) acc[ky][kx] = 0.0f;
    PlaneWalk o(g.ow);
    for (i64 pos = threadIdx.x; pos < ohw; pos += blockDim.x, o.next()) {
        const float d = to_f32(dyp[pos]);
        const i64 iy0 = o.y * g.sh - g.ph, ix0 = o.x * g.sw - g.pw;
#pragma unroll
        for (int ky = 0; ky < DW_MAX_SIDE; ++ky) {
            const i64 iy = iy0 + ky * g.dh;
            if (ky >= g.kh || iy < 0 || iy >= g.h) continue;
#pragma unroll
            for (int kx = 0; kx < DW_MAX_SIDE; ++kx) {
                const i64 ix = ix0 + kx * g.dw;
                if (kx < g.kw && ix >= 0 && ix < g.w) acc[ky][kx] += d * to_f32(xp[iy * g.w + ix]);
            }
        }
    }
    float* out = partial + b * g.kh * g.kw;
#pragma unroll
    for (int ky = 0; ky < DW_MAX_SIDE; ++ky) {
        if (ky >= g.kh) break;
#pragma unroll
        for (int kx = 0; kx < DW_MAX_SIDE; ++kx) {
            if (kx >= g.kw) break;
            const float s = block_sum(acc[ky][kx]);
            if (threadIdx.x == 0) out[ky * g.kw + kx] = s;
        }
    }
}

#define CONV(T, S) \
    extern "C" __global__ void im2col_##S(const T* x, T* col, ConvGeom g, i64 n0, i64 nimg, i64 group, u32 rows_outer) { im2col_impl<T>(x, col, g, n0, nimg, group, rows_outer); } \
    extern "C" __global__ void col2im_##S(const float* dcol, T* dx, ConvGeom g, i64 n0, i64 nimg, i64 group) { col2im_impl<T>(dcol, dx, g, n0, nimg, group); } \
    extern "C" __global__ void bias_planes_##S(const T* b, T* y, u64 n, Div c, Div ohw) { bias_planes_impl<T>(b, y, n, c, ohw); } \
    extern "C" __global__ void direct_fwd_##S(const T* x, const T* w, const T* b, u32 has_b, T* y, ConvGeom g) { direct_fwd_impl<T>(x, w, b, has_b, y, g); } \
    extern "C" __global__ void direct_bwd_input_##S(const T* w, const T* dy, T* dx, ConvGeom g) { direct_bwd_input_impl<T>(w, dy, dx, g); } \
    extern "C" __global__ void direct_bwd_weight_##S(const T* x, const T* dy, T* dw, ConvGeom g) { direct_bwd_weight_impl<T>(x, dy, dw, g); } \
    extern "C" __global__ void depthwise_bwd_weight_##S(const T* x, const T* dy, float* partial, ConvGeom g) { depthwise_bwd_weight_impl<T>(x, dy, partial, g); }
FOR_DTYPES(CONV)
