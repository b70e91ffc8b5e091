"""cuDNN's time for ResNet-50's convolutions, the shapes of kernels/examples/cuda_conv.rs
(batch 64, f32, TF32 off as in the twin): forward, backward (dx and the weight's gradient,
aten.convolution_backward), dx alone and the weight's gradient alone.
Usage: python torch_conv.py [--benchmark] (torch.backends.cudnn.benchmark; the twin runs
without it)."""
import sys
import time

import torch

torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.benchmark = "--benchmark" in sys.argv
BATCH = 64
# (c_in, c_out, kernel, stride, input side, calls per step), as in cuda_conv.rs
SHAPES = [
    (3, 64, 7, 2, 224, 1), (64, 64, 1, 1, 56, 1), (256, 64, 1, 1, 56, 2), (64, 64, 3, 1, 56, 3),
    (64, 256, 1, 1, 56, 4), (256, 128, 1, 1, 56, 1), (512, 128, 1, 1, 28, 3),
    (128, 128, 3, 2, 56, 1), (128, 128, 3, 1, 28, 3), (128, 512, 1, 1, 28, 4),
    (256, 512, 1, 2, 56, 1), (512, 256, 1, 1, 28, 1), (1024, 256, 1, 1, 14, 5),
    (256, 256, 3, 2, 28, 1), (256, 256, 3, 1, 14, 5), (256, 1024, 1, 1, 14, 6),
    (512, 1024, 1, 2, 28, 1), (1024, 512, 1, 1, 14, 1), (2048, 512, 1, 1, 7, 2),
    (512, 512, 3, 2, 14, 1), (512, 512, 3, 1, 7, 2), (512, 2048, 1, 1, 7, 3),
    (1024, 2048, 1, 2, 14, 1),
]


def ms(f):
    """Milliseconds per call after two untimed calls, ten calls between synchronizations."""
    for _ in range(2):
        f()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / 10


print(f"device: {torch.cuda.get_device_name()}, PyTorch {torch.__version__}, cuDNN "
      f"{torch.backends.cudnn.version()}, benchmark {torch.backends.cudnn.benchmark}")
print("| c_in | c_out | kernel | stride | side | calls | forward ms | backward ms | dx only ms "
      "| weight only ms |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
total = [0.0] * 4
for cin, cout, k, s, side, calls in SHAPES:
    x = torch.randn(BATCH, cin, side, side, device="cuda")
    w = torch.randn(cout, cin, k, k, device="cuda")
    pad = k // 2
    dy = torch.randn_like(torch.nn.functional.conv2d(x, w, None, s, pad))

    def backward(mask):
        return torch.ops.aten.convolution_backward(
            dy, x, w, None, [s, s], [pad, pad], [1, 1], False, [0, 0], 1, mask)

    t = [ms(lambda: torch.nn.functional.conv2d(x, w, None, s, pad)),
         ms(lambda: backward([True, True, False])),
         ms(lambda: backward([True, False, False])),
         ms(lambda: backward([False, True, False]))]
    total = [a + b * calls for a, b in zip(total, t)]
    print(f"| {cin} | {cout} | {k} | {s} | {side} | {calls} | "
          + " | ".join(f"{v:.3f}" for v in t) + " |")
print("total over a step's calls: forward %.2f ms, backward %.2f ms, dx only %.2f ms, "
      "weight only %.2f ms" % tuple(total))
