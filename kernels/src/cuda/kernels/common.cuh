// Shared by every module: prepended to each .cu source before NVRTC compiles it.
//
// No #include: NVRTC finds <cuda_fp16.h> and <cuda_bf16.h> only with the toolkit's include
// path, which a machine with just the driver and the runtime libraries may not have. The
// 16-bit types are therefore plain bit containers here, converted with one PTX instruction
// (f16) or with integer arithmetic (bf16, round-to-nearest-even exactly like the `half`
// crate on the host, so both backends round bf16 identically).

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

struct half_t { u16 bits; };
struct bf16_t { u16 bits; };

__device__ __forceinline__ float to_f32(float v) { return v; }

// (The host emulation of the tests, `cuda/emulate.rs`, has no PTX: it converts with the C++
// compiler's _Float16, which also rounds to nearest even.)
#ifndef VRAM_HOST_EMULATION
__device__ __forceinline__ float to_f32(half_t v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
    return f;
}
#else
__device__ __forceinline__ float to_f32(half_t v) { return (float)__builtin_bit_cast(_Float16, v.bits); }
#endif

__device__ __forceinline__ float to_f32(bf16_t v) {
    return __uint_as_float(((u32)v.bits) << 16);
}

template <typename T> __device__ __forceinline__ T from_f32(float v);

template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }

template <> __device__ __forceinline__ half_t from_f32<half_t>(float v) {
    half_t h;
#ifndef VRAM_HOST_EMULATION
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(v));
#else
    h.bits = __builtin_bit_cast(u16, (_Float16)v);
#endif
    return h;
}

template <> __device__ __forceinline__ bf16_t from_f32<bf16_t>(float v) {
    u32 u = __float_as_uint(v);
    bf16_t b;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        // NaN: keep the sign and the top payload bits, force it quiet.
        b.bits = (u16)((u >> 16) | 0x0040u);
        return b;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    b.bits = (u16)(u >> 16);
    return b;
}

__device__ __forceinline__ bool is_finite(float v) {
    return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u;
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// Philox4x32-10 (Random123): the same rounds as kernels/src/cpu/random.rs; dropout's and
// attention's masks draw from it.
__device__ __forceinline__ u32 philox_word(u64 counter, u64 seed, u32 word) {
    u32 c0 = (u32)counter, c1 = (u32)(counter >> 32), c2 = 0u, c3 = 0u;
    u32 k0 = (u32)seed, k1 = (u32)(seed >> 32);
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const u32 hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const u32 hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        const u32 n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
    }
    return word == 0 ? c0 : word == 1 ? c1 : word == 2 ? c2 : c3;
}

// The uniform in [0, 1) of element `index` of the stream `seed` (cpu::random::uniform_at):
// word index % 4 of philox(index / 4), its top 24 bits over 2^24.
__device__ __forceinline__ float philox_uniform(u64 seed, u64 index) {
    const u32 r = philox_word(index >> 2, seed, (u32)(index & 3u));
    return (float)(r >> 8) * (1.0f / 16777216.0f);
}

// Element `index` of a residual branch after dropout (fused.cu's residual kernels, softmax.cu's
// layer norm backward with a residual), as f32: kept iff its uniform is >= p
// (misc.cu's dropout_impl), then scaled and rounded to B as ops::dropout stores it; 0 when
// dropped. p == 0 keeps everything unscaled without drawing.
template <typename B>
__device__ __forceinline__ float dropped_branch(B v, u64 index, float p, float scale, u64 seed) {
    if (p == 0.0f) return to_f32(v);
    return philox_uniform(seed, index) >= p ? to_f32(from_f32<B>(to_f32(v) * scale)) : 0.0f;
}

// e^x as the host computes it (`cpu::fastmath::exp`: Cephes' expf, Cody and Waite's two-part
// ln 2, a degree-7 polynomial, 2^n put into the exponent bits; within 2 ulp, 0 below
// -87.33654, infinity above 88), so that GELU and SiLU emulated on the host are the host's bit
// for bit; on a GPU, NVRTC contracting products and sums into FMAs moves the last bit.
__device__ __forceinline__ float vram_exp(float x) {
    const float xc = fminf(fmaxf(x, -87.33654f), 88.0f);
    const float t = xc * 1.44269504088896341f + 12582912.0f;
    const float n = t - 12582912.0f;
    const float r = (xc - n * 0.6933594f) - n * -2.1219444e-4f;
    float p = 1.9875691e-4f;
    p = p * r + 1.3982e-3f;
    p = p * r + 8.333452e-3f;
    p = p * r + 4.1665796e-2f;
    p = p * r + 0.16666665f;
    p = p * r + 0.5f;
    const float er = p * (r * r) + r + 1.0f;
    const float two_n = __uint_as_float((__float_as_uint(t) - 0x4B400000u + 127u) << 23);
    float y = er * two_n;
    y = x > 88.0f ? __uint_as_float(0x7f800000u) : y;
    y = x < -87.33654f ? 0.0f : y;
    return x != x ? x : y;
}
__device__ __forceinline__ float vram_sigmoid(float x) { return 1.0f / (1.0f + vram_exp(-x)); }

// GELU, tanh approximation (GPT-2's; PyTorch's `approximate='tanh'`), and its derivative:
// elementwise.cu's gelu and fused.cu's bias + GELU. Written as the host writes it, with
// `1 + tanh(u) = 2 sigmoid(2u)` and `1 - tanh(u)^2 = 4 s (1 - s)`.
#define GELU_K 0.7978846f
#define GELU_C 0.044715f
__device__ __forceinline__ float gelu_f(float v) {
    const float inner = GELU_K * (v + GELU_C * v * v * v);
    return v * vram_sigmoid(2.0f * inner);
}
__device__ __forceinline__ float gelu_grad(float v) {
    const float inner = GELU_K * (v + GELU_C * v * v * v);
    const float s = vram_sigmoid(2.0f * inner);
    const float d_inner = GELU_K * (1.0f + 3.0f * GELU_C * v * v);
    return s + 2.0f * v * s * (1.0f - s) * d_inner;
}

// Division of element indices by a divisor fixed for the launch, with the magic number the
// host computed (`launch::Div`: Granlund and Montgomery's figure 4.1 for 64 bits, exact for
// every u64): a high multiply, a subtraction, two shifts and an add, where `/` on a u64 is a
// software routine of dozens of instructions. Every grid-stride kernel that splits an index
// into coordinates divides with this; `nvrtc_check` holds them to it.
struct Div {
    u64 d, m;
    u32 s1, s2;
    __device__ __forceinline__ u64 div(u64 n) const {
        const u64 t = __umul64hi(n, m);
        return (t + ((n - t) >> s1)) >> s2;
    }
    __device__ __forceinline__ u64 mod(u64 n) const { return n - div(n) * d; }
};

// Grid-stride loop over [0, n).
#define FOR_EACH(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (u64)blockDim.x * gridDim.x)

// Elementwise maps over [0, n), computed in f32 with one rounding to the output type. Each
// thread moves a pack of V elements at a time, V = 16 bytes over the widest operand's
// element (PyTorch's vectorized elementwise kernels do the same with `aligned_vector`), so
// that every load and store is one 8- or 16-byte access; a scalar loop takes the tail, or
// everything when a pointer is not aligned to its pack (the allocator's blocks always are;
// a buffer at an odd offset inside one may not be). Grid-stride over packs; `launch::map`
// sizes the grid for V. `nvrtc_check` checks the PTX for the vector accesses.
template <typename T, int V> struct alignas(sizeof(T) * V) Pack { T v[V]; };

// Elements per pack: 16 bytes over the widest of the operands' element sizes.
__host__ __device__ constexpr int pack_len(int a, int b, int c) {
    return 16 / (a > b ? (a > c ? a : c) : (b > c ? b : c));
}

__device__ __forceinline__ bool packs_aligned(const void* p, u64 bytes) {
    return ((u64)p & (bytes - 1)) == 0;
}

// Calls pack(k) for every whole pack k of V elements when `aligned`, then one(i) for every
// element not in a pack; grid-stride over both.
template <int V, typename P, typename S>
__device__ __forceinline__ void map_loop(u64 n, bool aligned, P pack, S one) {
    const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)blockDim.x * gridDim.x;
    u64 done = 0;
    if (aligned) {
        const u64 packs = n / V;
        for (u64 k = first; k < packs; k += stride) pack(k);
        done = packs * V;
    }
    for (u64 i = done + first; i < n; i += stride) one(i);
}

// y[i] = v for i in [0, n).
template <typename O> __device__ __forceinline__ void map0(O* y, u64 n, float v) {
    constexpr int V = pack_len(sizeof(O), sizeof(O), sizeof(O));
    const O t = from_f32<O>(v);
    Pack<O, V> r;
#pragma unroll
    for (int j = 0; j < V; ++j) r.v[j] = t;
    map_loop<V>(n, packs_aligned(y, sizeof(O) * V),
                [&](u64 k) { reinterpret_cast<Pack<O, V>*>(y)[k] = r; },
                [&](u64 i) { y[i] = t; });
}

// y[i] = f(x[i]) for i in [0, n); f maps f32 to f32.
template <typename X, typename O, typename F>
__device__ __forceinline__ void map1(const X* x, O* y, u64 n, F f) {
    constexpr int V = pack_len(sizeof(X), sizeof(O), sizeof(O));
    map_loop<V>(
        n, packs_aligned(x, sizeof(X) * V) && packs_aligned(y, sizeof(O) * V),
        [&](u64 k) {
            const Pack<X, V> a = reinterpret_cast<const Pack<X, V>*>(x)[k];
            Pack<O, V> r;
#pragma unroll
            for (int j = 0; j < V; ++j) r.v[j] = from_f32<O>(f(to_f32(a.v[j])));
            reinterpret_cast<Pack<O, V>*>(y)[k] = r;
        },
        [&](u64 i) { y[i] = from_f32<O>(f(to_f32(x[i]))); });
}

// y[i] = f(a[i], b[i]) for i in [0, n); f maps two f32 to f32. y may be a (in-place
// updates: the thread that writes a pack or an element has read it first).
template <typename A, typename B, typename O, typename F>
__device__ __forceinline__ void map2(const A* a, const B* b, O* y, u64 n, F f) {
    constexpr int V = pack_len(sizeof(A), sizeof(B), sizeof(O));
    map_loop<V>(
        n,
        packs_aligned(a, sizeof(A) * V) && packs_aligned(b, sizeof(B) * V) &&
            packs_aligned(y, sizeof(O) * V),
        [&](u64 k) {
            const Pack<A, V> pa = reinterpret_cast<const Pack<A, V>*>(a)[k];
            const Pack<B, V> pb = reinterpret_cast<const Pack<B, V>*>(b)[k];
            Pack<O, V> r;
#pragma unroll
            for (int j = 0; j < V; ++j) r.v[j] = from_f32<O>(f(to_f32(pa.v[j]), to_f32(pb.v[j])));
            reinterpret_cast<Pack<O, V>*>(y)[k] = r;
        },
        [&](u64 i) { y[i] = from_f32<O>(f(to_f32(a[i]), to_f32(b[i]))); });
}

// The positions of a plane `width` wide that a block's threads visit in turn: thread t at
// t, t + blockDim.x, ...; (y, x) follow without a division per step.
struct PlaneWalk {
    i64 y, x, step_y, step_x, width;
    __device__ explicit PlaneWalk(i64 w) : PlaneWalk(w, threadIdx.x, blockDim.x) {}
    // From position `start`, `step` positions at a time.
    __device__ PlaneWalk(i64 w, i64 start, i64 step)
        : y(start / w), x(start % w), step_y(step / w), step_x(step % w), width(w) {}
    __device__ void next() {
        x += step_x;
        y += step_y;
        if (x >= width) {
            x -= width;
            ++y;
        }
    }
};

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum (IS_MAX false) or maximum (IS_MAX true) over the block; every thread gets the result.
// blockDim.x must be a multiple of 32 (the launch helpers use 256). Safe to call repeatedly.
template <bool IS_MAX>
__device__ float block_reduce(float v) {
    __shared__ float buf[33];
    v = IS_MAX ? warp_max(v) : warp_sum(v);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) buf[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = lane < warps ? buf[lane] : (IS_MAX ? neg_inf() : 0.0f);
        w = IS_MAX ? warp_max(w) : warp_sum(w);
        if (lane == 0) buf[32] = w;
    }
    __syncthreads();
    return buf[32];
}

__device__ __forceinline__ float block_sum(float v) { return block_reduce<false>(v); }
__device__ __forceinline__ float block_max(float v) { return block_reduce<true>(v); }

// Instantiates MACRO(T, suffix) for the three storage types.
#define FOR_DTYPES(MACRO) MACRO(float, f32) MACRO(half_t, f16) MACRO(bf16_t, bf16)

// Instantiates MACRO(A, a, B, b) for all nine pairs of storage types.
#define FOR_DTYPE_PAIRS(MACRO) \
    MACRO(float, f32, float, f32) MACRO(float, f32, half_t, f16) MACRO(float, f32, bf16_t, bf16) \
    MACRO(half_t, f16, float, f32) MACRO(half_t, f16, half_t, f16) MACRO(half_t, f16, bf16_t, bf16) \
    MACRO(bf16_t, bf16, float, f32) MACRO(bf16_t, bf16, half_t, f16) MACRO(bf16_t, bf16, bf16_t, bf16)
