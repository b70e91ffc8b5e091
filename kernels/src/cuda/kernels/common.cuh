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

__device__ __forceinline__ float to_f32(half_t v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
    return f;
}

__device__ __forceinline__ float to_f32(bf16_t v) {
    return __uint_as_float(((u32)v.bits) << 16);
}

template <typename T> __device__ __forceinline__ T from_f32(float v);

template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }

template <> __device__ __forceinline__ half_t from_f32<half_t>(float v) {
    half_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(v));
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

// Grid-stride loop over [0, n).
#define FOR_EACH(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (u64)blockDim.x * gridDim.x)

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
