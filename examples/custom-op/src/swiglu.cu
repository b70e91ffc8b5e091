// SwiGLU's gate, y = silu(gate) * up with silu(g) = g * sigmoid(g), and its gradients, for
// f32, f16 and bf16 storage (arithmetic in f32). Compiled by vram after its `common.cuh`
// (`half_t`, `bf16_t`, `to_f32`, `from_f32`, `u64`). Grid-stride loops: any grid covers any n.

__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

template <typename T>
__device__ void swiglu(const T* gate, const T* up, T* y, u64 n) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float g = to_f32(gate[i]);
        const float s = sigmoid(g);
        y[i] = from_f32<T>(g * s * to_f32(up[i]));
    }
}

// d gate = dy * up * s * (1 + g * (1 - s)), d up = dy * g * s.
template <typename T>
__device__ void swiglu_backward(const T* gate, const T* up, const T* dy, T* dgate, T* dup,
                                u64 n) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float g = to_f32(gate[i]);
        const float u = to_f32(up[i]);
        const float d = to_f32(dy[i]);
        const float s = sigmoid(g);
        dgate[i] = from_f32<T>(d * u * s * (1.0f + g * (1.0f - s)));
        dup[i] = from_f32<T>(d * g * s);
    }
}

#define SWIGLU(SUFFIX, T)                                                                    \
    extern "C" __global__ void swiglu_##SUFFIX(const T* gate, const T* up, T* y, u64 n) {     \
        swiglu(gate, up, y, n);                                                              \
    }                                                                                        \
    extern "C" __global__ void swiglu_backward_##SUFFIX(const T* gate, const T* up,          \
                                                        const T* dy, T* dgate, T* dup,       \
                                                        u64 n) {                             \
        swiglu_backward(gate, up, dy, dgate, dup, n);                                        \
    }

SWIGLU(f32, float)
SWIGLU(f16, half_t)
SWIGLU(bf16, bf16_t)
