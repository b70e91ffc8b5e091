// Multi-tensor optimizer steps: one launch updates every parameter of a step, as PyTorch's
// `fused=True` optimizers do through `multi_tensor_apply` (MultiTensorApply.cuh).
//
// The host writes a table into a small device buffer before the launch (ops/multi_tensor.rs
// builds it): one 64-byte `MultiEntry` per tensor, then one `MultiTask` per block saying
// which chunk of which tensor the block updates. PyTorch passes the same lists as a kernel
// argument (at most 4 KiB, so it splits a long parameter list over several launches); a
// buffer has no such limit, so one launch covers any number of tensors.
//
// Each tensor carries its own element types: the tensor updated in f32 (`p`: an f32 master
// copy, an f32 parameter, or a 16-bit parameter updated in f32 and rounded once), the
// gradient, and the 16-bit working copy written from an f32 master (`copy`, 0 if none). The
// types are uniform within a block, so the dispatch below costs one branch per block.

struct MultiEntry {
    u64 p, g, s1, s2, copy, n;
    // Element types (DType::index: 0 f32, 1 f16, 2 bf16) of p, g and copy in bytes 0, 1, 2.
    u32 types;
    // Bit 0: SGD's first step (the momentum buffer becomes the gradient).
    u32 flags;
    // AdamW: this tensor's step_size and bias2_sqrt (its own step count). Unused by SGD.
    float a, b;
};

struct MultiTask {
    u32 tensor, chunk;
};

__device__ __forceinline__ void store_as(u64 p, u32 type, u64 i, float v) {
    if (type == 0u) {
        ((float*)p)[i] = v;
    } else if (type == 1u) {
        ((half_t*)p)[i] = from_f32<half_t>(v);
    } else {
        ((bf16_t*)p)[i] = from_f32<bf16_t>(v);
    }
}

// Calls body.template operator()<P, G>() for the entry's parameter and gradient types.
template <typename F> __device__ __forceinline__ void dispatch_types(u32 types, F body) {
    const u32 pt = types & 0xffu, gt = (types >> 8) & 0xffu;
#define MULTI_G(P)                                            \
    if (gt == 0u) body.template operator()<P, float>();       \
    else if (gt == 1u) body.template operator()<P, half_t>(); \
    else body.template operator()<P, bf16_t>();
    if (pt == 0u) {
        MULTI_G(float)
    } else if (pt == 1u) {
        MULTI_G(half_t)
    } else {
        MULTI_G(bf16_t)
    }
#undef MULTI_G
}

// The elements [start, end) of the block's chunk.
struct ChunkRange {
    MultiEntry e;
    u64 start, end;
    __device__ ChunkRange(const MultiEntry* table, const MultiTask* tasks, u64 chunk) {
        const MultiTask t = tasks[blockIdx.x];
        e = table[t.tensor];
        start = (u64)t.chunk * chunk;
        end = start + chunk < e.n ? start + chunk : e.n;
    }
};

// The per-element math is adamw_impl's (misc.cu), with the entry's step scalars.
struct AdamWChunk {
    ChunkRange r;
    float beta1, beta2, eps, decay;
    template <typename P, typename G> __device__ void operator()() const {
        P* p = (P*)r.e.p;
        const G* g = (const G*)r.e.g;
        float* m = (float*)r.e.s1;
        float* v = (float*)r.e.s2;
        const u32 ct = (r.e.types >> 16) & 0xffu;
        for (u64 i = r.start + threadIdx.x; i < r.end; i += blockDim.x) {
            const float gi = to_f32(g[i]);
            float pi = to_f32(p[i]) * decay;
            const float mi = beta1 * m[i] + (1.0f - beta1) * gi;
            const float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
            const float denom = sqrtf(vi) / r.e.b + eps;
            pi -= r.e.a * mi / denom;
            p[i] = from_f32<P>(pi);
            m[i] = mi;
            v[i] = vi;
            if (r.e.copy != 0u) store_as(r.e.copy, ct, i, pi);
        }
    }
};

// The per-element math is sgd_impl's (misc.cu).
struct SgdChunk {
    ChunkRange r;
    float lr, momentum, dampening, weight_decay;
    u32 nesterov;
    template <typename P, typename G> __device__ void operator()() const {
        P* p = (P*)r.e.p;
        const G* g = (const G*)r.e.g;
        float* buf = (float*)r.e.s1;
        const u32 ct = (r.e.types >> 16) & 0xffu;
        const bool first_step = (r.e.flags & 1u) != 0u;
        for (u64 i = r.start + threadIdx.x; i < r.end; i += blockDim.x) {
            float pi = to_f32(p[i]);
            const float d = to_f32(g[i]) + weight_decay * pi;
            if (momentum == 0.0f) {
                pi -= lr * d;
            } else {
                const float b = first_step ? d : momentum * buf[i] + (1.0f - dampening) * d;
                buf[i] = b;
                const float step = nesterov ? d + momentum * b : b;
                pi -= lr * step;
            }
            p[i] = from_f32<P>(pi);
            if (r.e.copy != 0u) store_as(r.e.copy, ct, i, pi);
        }
    }
};

extern "C" __global__ void adamw_multi(const MultiEntry* table, const MultiTask* tasks,
                                       float beta1, float beta2, float eps, float decay,
                                       u64 chunk) {
    const AdamWChunk c{ChunkRange(table, tasks, chunk), beta1, beta2, eps, decay};
    dispatch_types(c.r.e.types, c);
}

extern "C" __global__ void sgd_multi(const MultiEntry* table, const MultiTask* tasks, float lr,
                                     float momentum, float dampening, float weight_decay,
                                     u32 nesterov, u64 chunk) {
    const SgdChunk c{ChunkRange(table, tasks, chunk), lr, momentum, dampening, weight_decay,
                     nesterov};
    dispatch_types(c.r.e.types, c);
}
