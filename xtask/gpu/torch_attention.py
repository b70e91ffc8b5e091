#!/usr/bin/env python3
"""PyTorch's fused attention at the shapes `kernels/examples/cuda_attention.rs` times.

    python3 xtask/gpu/torch_attention.py [seq ...]

`F.scaled_dot_product_attention(q, k, v, is_causal=True)` in bf16 on q, k, v of
[8, 12, seq, 64] under the flash backend (`torch.nn.attention.sdpa_kernel(FLASH_ATTENTION)`,
what SDPA picks by default for these shapes on an H100), forward alone and forward +
backward (`out.backward(dout)`): milliseconds per call (three warm-up calls, then twenty
between two synchronizations) and the memory the call adds above its inputs
(`max_memory_allocated` after `reset_peak_memory_stats`, less the inputs), printed in
cuda_attention's format so that the two outputs compare line by line.

Exit status 3 when PyTorch is not installed, 2 without a usable CUDA device.
"""

import sys
import time


def main():
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:
        print(f"skipped: PyTorch is not installed ({e})", file=sys.stderr)
        return 3
    if not torch.cuda.is_available():
        print("error: no usable CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    seqs = [int(a) for a in sys.argv[1:]] or [1024, 4096]
    batch, heads, dim = 8, 12, 64
    dev = torch.device("cuda")
    print(f"# PyTorch {torch.__version__} SDPA (flash) on {torch.cuda.get_device_name()}: bf16, causal, no dropout")

    def timed(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / 20

    for seq in seqs:
        g = torch.Generator(device=dev).manual_seed(seq)
        shape = (batch, heads, seq, dim)
        q, k, v = (torch.rand(shape, device=dev, generator=g, dtype=torch.bfloat16).mul_(2).sub_(1)
                   .requires_grad_() for _ in range(3))
        dout = torch.rand(shape, device=dev, generator=g, dtype=torch.bfloat16).mul_(2).sub_(1)
        torch.cuda.synchronize()
        inputs = torch.cuda.memory_allocated()
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            torch.cuda.reset_peak_memory_stats()

            def forward():
                with torch.no_grad():
                    F.scaled_dot_product_attention(q, k, v, is_causal=True)

            fwd = timed(forward)
            fwd_peak = torch.cuda.max_memory_allocated() - inputs
            torch.cuda.reset_peak_memory_stats()

            def both():
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                q.grad = k.grad = v.grad = None
                out.backward(dout)

            both_t = timed(both)
            both_peak = torch.cuda.max_memory_allocated() - inputs
        q.grad = k.grad = v.grad = None
        print(f"attention b{batch} h{heads} s{seq} d{dim} bf16 causal: forward {fwd * 1e3:.3f} ms, "
              f"forward+backward {both_t * 1e3:.3f} ms, memory above the inputs forward {fwd_peak} B, "
              f"forward+backward {both_peak} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
