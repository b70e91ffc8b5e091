#!/usr/bin/env python3
"""Records a real PyTorch training run's memory trace on a GPU, for vram's replay.

    python3 xtask/gpu/record_trace.py OUT.pickle [--conf SETTINGS] [--steps N]

Starts `torch.cuda.memory._record_memory_history` before anything touches the GPU (so the
trace starts from an empty cache), trains a small GPT (the twin's, `xtask/twin/torch_twin.py`:
vocab 4096, d 256, 4 blocks, 4 heads, 256 tokens, batch 8, tied head, explicit attention) with
AdamW for N steps (default 3), calls `torch.cuda.empty_cache()`, trains one more step, and
writes the snapshot with `torch.cuda.memory._dump_snapshot` (no stack frames recorded, so that
the file stays small enough to commit as a test fixture). `--conf` sets PYTORCH_CUDA_ALLOC_CONF for the run (e.g.
`expandable_segments:True`); the snapshot records the settings.

Then `cargo xtask replay OUT.pickle --strict` checks that vram's allocator, under the recorded
settings, makes the same segment actions in the same allocator calls and holds the same
reserved bytes after every trace entry. Also written: OUT.json with PyTorch's own figures
after each step (`memory_allocated`, `memory_reserved`, the trace length so far).

Exit status 3 when PyTorch is not installed, 2 without a usable CUDA device.
"""

import argparse
import json
import os
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="the snapshot to write (.pickle)")
    ap.add_argument("--conf", default=None, help="PYTORCH_CUDA_ALLOC_CONF for the run")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    if args.conf is not None:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = args.conf
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        print(f"skipped: PyTorch is not installed ({e})", file=sys.stderr)
        return 3
    if not torch.cuda.is_available():
        print("error: no usable CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    if args.steps < 1:
        print("error: --steps must be at least 1", file=sys.stderr)
        return 2

    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=1_000_000)

    # The twin's GPT (xtask/twin/torch_twin.py): explicit attention, tied head.
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "twin"))
    from torch_twin import GPT

    vocab, d, layers, heads, seq, batch = 4096, 256, 4, 4, 256, 8
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = GPT(vocab, d, layers, heads, seq, dropout=0.0, tied=True, sdpa=False).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, vocab, (batch, seq), device=dev)
    targets = torch.randint(0, vocab, (batch * seq,), device=dev)
    figures = []

    def step(i):
        loss = F.cross_entropy(model(idx), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
        figures.append({"step": i, "loss": value, "allocated": torch.cuda.memory_allocated(),
                        "reserved": torch.cuda.memory_reserved(), "trace_len": len(trace)})

    for i in range(args.steps):
        step(i)
    torch.cuda.empty_cache()
    figures.append({"empty_cache": True, "reserved": torch.cuda.memory_reserved()})
    step(args.steps)
    torch.cuda.memory._dump_snapshot(args.out)
    torch.cuda.memory._record_memory_history(enabled=None)
    side = os.path.splitext(args.out)[0] + ".json"
    with open(side, "w", encoding="utf-8") as f:
        json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                   "conf": args.conf, "steps": figures}, f, indent=1)
    size = os.path.getsize(args.out)
    print(f"wrote {args.out} ({size} bytes) and {side}; PyTorch {torch.__version__} on "
          f"{torch.cuda.get_device_name()}, conf {args.conf!r}; reserved after each step: "
          + ", ".join(str(s["reserved"]) for s in figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
