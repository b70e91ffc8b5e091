#!/usr/bin/env python3
"""Records a real PyTorch training run's memory trace on a GPU, for vram's replay.

    python3 xtask/gpu/record_trace.py OUT.pickle [--conf SETTINGS] [--steps N]

Starts `torch.cuda.memory._record_memory_history` before anything touches the GPU (so the
trace starts from an empty cache), trains a small GPT (vocab 4096, d 256, 4 blocks, 4 heads,
256 tokens, batch 8; explicit attention) with AdamW for N steps (default 3), calls
`torch.cuda.empty_cache()`, trains one more step, and writes the snapshot with
`torch.cuda.memory._dump_snapshot` (no stack frames recorded, so that the file stays small
enough to commit as a test fixture). `--conf` sets PYTORCH_CUDA_ALLOC_CONF for the run (e.g.
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
        import torch.nn as nn
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

    vocab, d, layers, heads, seq, batch = 4096, 256, 4, 4, 256, 8

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
            self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), 1))

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            q, k, v = (t.view(b, s, heads, d // heads).transpose(1, 2) for t in (q, k, v))
            att = torch.softmax((q @ k.transpose(-2, -1)) * (d // heads) ** -0.5 + self.mask, dim=-1)
            x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, d))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))

    class Gpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for blk in self.blocks:
                x = blk(x)
            return self.ln_f(x) @ self.wte.weight.t()

    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = Gpt().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, vocab, (batch, seq), device=dev)
    targets = torch.randint(0, vocab, (batch * seq,), device=dev)
    figures = []

    def step(i):
        logits = model(idx)
        loss = F.cross_entropy(logits.view(-1, vocab), targets)
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
