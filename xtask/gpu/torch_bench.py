#!/usr/bin/env python3
"""PyTorch's figures beside vram's, measured in the same run on the same GPU.

    python3 xtask/gpu/torch_bench.py [--vram-kernels FILE] [--vram-pairs FILE] [--device cuda|cpu]

Times in PyTorch what vram's two CUDA examples time in Rust:

- `kernels/examples/cuda_bench.rs`: device-to-device copy (`clone`) and elementwise `add` of 64M
  elements in f32, f16 and bf16, and `matmul` at 8192^3 in f16, bf16 and f32 (TF32 off: vram
  computes f32 in f32);
- `alloc/examples/cuda_pairs.rs`: an allocate + free pair of a cached size, here
  `torch.cuda.caching_allocator_alloc` + `caching_allocator_delete` (the allocator alone) and
  `torch.empty` + `del` (what a user writes, with the tensor's own overhead).

With the files those examples printed (`--vram-kernels`, `--vram-pairs`; their last line is
JSON), it prints the ratios the GPU issue asks for: vram's `add` as a fraction of the copy
bandwidth measured in the same run (goal >= 0.80), vram's matmul over `torch.matmul` (goal
>= 0.95x), the cached pair against the raw `cuMemAlloc` + `cuMemFree` pair (goal >= 200x) and
against PyTorch's cached pair. Ends with one JSON line of everything.

`--device cpu` runs the same code at small sizes on the CPU (a check of the script, no
figures worth reading). Exit status 3 when PyTorch is not installed.
"""

import argparse
import json
import sys
import time

ELEMENTS = 64 << 20
MATMUL = 8192
PAIR_SIZES = [512, 64 << 10, 4 << 20, 64 << 20]


def last_json(path):
    """The last line of `path` that parses as a JSON object."""
    with open(path, encoding="utf-8") as f:
        for line in reversed(f.read().splitlines()):
            line = line.strip()
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except ValueError:
                    continue
    raise ValueError(f"{path}: no JSON line (did the example run?)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vram-kernels", help="output of cuda_bench (its last line is JSON)")
    ap.add_argument("--vram-pairs", help="output of cuda_pairs (its last line is JSON)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        print(f"skipped: PyTorch is not installed ({e})", file=sys.stderr)
        return 3
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("error: --device cuda: torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    n, m = (ELEMENTS, MATMUL) if cuda else (1 << 20, 256)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def seconds(warmup, iters, f):
        for _ in range(warmup):
            f()
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            f()
        sync()
        return (time.perf_counter() - start) / iters

    def values(shape, seed, dtype):
        g = torch.Generator(device="cpu").manual_seed(seed)
        return (torch.rand(shape, generator=g) * 2 - 1).to(device=dev, dtype=dtype)

    name = torch.cuda.get_device_name() if cuda else "cpu"
    out = {"torch": torch.__version__, "device": name, "kernels": [], "pairs": []}
    print(f"PyTorch {torch.__version__} on {name}")
    print("| measurement | dtype | time (ms) | throughput |")
    print("|---|---|---:|---:|")
    dtypes = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
    for tag in ["f32", "f16", "bf16"]:
        a, b = values(n, 1, dtypes[tag]), values(n, 2, dtypes[tag])
        size = a.numel() * a.element_size()
        t_copy = seconds(3, 20, lambda: a.clone())
        t_add = seconds(3, 20, lambda: torch.add(a, b))
        copy, add = 2 * size / t_copy / 1e9, 3 * size / t_add / 1e9
        out["kernels"] += [
            {"op": "copy", "dtype": tag, "ms": t_copy * 1e3, "rate": copy},
            {"op": "add", "dtype": tag, "ms": t_add * 1e3, "rate": add},
        ]
        print(f"| clone {n >> 20}M | {tag} | {t_copy * 1e3:.3f} | {copy:.0f} GB/s |")
        print(f"| add {n >> 20}M | {tag} | {t_add * 1e3:.3f} | {add:.0f} GB/s |")
        del a, b
    for tag in ["f16", "bf16", "f32"]:
        a, b = values((m, m), 3, dtypes[tag]), values((m, m), 4, dtypes[tag])
        iters = 5 if tag == "f32" else 20
        t = seconds(2, iters, lambda: torch.matmul(a, b))
        tflops = 2 * m**3 / t / 1e12
        out["kernels"].append({"op": "matmul", "dtype": tag, "ms": t * 1e3, "rate": tflops})
        print(f"| matmul {m}^3 | {tag} | {t * 1e3:.3f} | {tflops:.1f} TFLOP/s |")
        del a, b

    if cuda:
        print("\n| size | caching_allocator_alloc + delete (ns) | torch.empty + del (ns) |")
        print("|---|---:|---:|")
        for size in PAIR_SIZES:

            def raw_pair():
                p = torch.cuda.caching_allocator_alloc(size)
                torch.cuda.caching_allocator_delete(p)

            def tensor_pair():
                t = torch.empty(size, dtype=torch.uint8, device=dev)
                del t

            best = lambda f, iters: min(seconds(0, iters, f) for _ in range(5)) * 1e9
            raw_pair(), tensor_pair()
            alloc_ns, empty_ns = best(raw_pair, 20000), best(tensor_pair, 20000)
            out["pairs"].append({"size": size, "alloc_ns": alloc_ns, "empty_ns": empty_ns})
            print(f"| {size} | {alloc_ns:.0f} | {empty_ns:.0f} |")

    ratios = []
    if args.vram_kernels:
        vram = {(k["op"], k["dtype"]): k for k in last_json(args.vram_kernels)["kernels"]}
        torch_k = {(k["op"], k["dtype"]): k for k in out["kernels"]}
        print("\n| vram | dtype | vram | PyTorch | ratio | goal |")
        print("|---|---|---:|---:|---:|---|")
        for tag in ["f32", "f16", "bf16"]:
            if ("add", tag) in vram and ("copy", tag) in vram:
                frac = vram[("add", tag)]["rate"] / vram[("copy", tag)]["rate"]
                t_frac = torch_k[("add", tag)]["rate"] / torch_k[("copy", tag)]["rate"]
                ratios.append({"what": "add / copy bandwidth", "dtype": tag, "vram": frac, "torch": t_frac})
                print(f"| add 64M / own copy bandwidth | {tag} | {frac:.2f} | {t_frac:.2f} | | >= 0.80 |")
        for tag in ["f16", "bf16", "f32"]:
            if ("matmul", tag) in vram:
                v, t = vram[("matmul", tag)]["rate"], torch_k[("matmul", tag)]["rate"]
                ratios.append({"what": "matmul TFLOP/s", "dtype": tag, "vram": v, "torch": t, "ratio": v / t})
                print(f"| matmul {MATMUL}^3 TFLOP/s | {tag} | {v:.1f} | {t:.1f} | {v / t:.2f}x | >= 0.95x |")
    if args.vram_pairs:
        pairs = {p["size"]: p for p in last_json(args.vram_pairs)["pairs"]}
        print("\n| size | vram cached (ns) | raw cuMemAlloc+Free (ns) | raw / cached (goal >= 200x) | PyTorch alloc+delete (ns) | PyTorch empty+del (ns) |")
        print("|---|---:|---:|---:|---:|---:|")
        torch_p = {p["size"]: p for p in out["pairs"]}
        for size, p in sorted(pairs.items()):
            t = torch_p.get(size, {})
            row = {"what": "pair", "size": size, "vram_cached_ns": p["cached_ns"], "raw_ns": p["raw_ns"],
                   "raw_over_cached": p["raw_ns"] / p["cached_ns"], "torch_alloc_ns": t.get("alloc_ns"),
                   "torch_empty_ns": t.get("empty_ns")}
            ratios.append(row)
            fmt = lambda x: "-" if x is None else f"{x:.0f}"
            print(f"| {size} | {p['cached_ns']:.1f} | {p['raw_ns']:.0f} | {row['raw_over_cached']:.0f}x | "
                  f"{fmt(t.get('alloc_ns'))} | {fmt(t.get('empty_ns'))} |")
    out["ratios"] = ratios
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
