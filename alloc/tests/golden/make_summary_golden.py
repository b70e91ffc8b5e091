#!/usr/bin/env python3
"""Writes the memory_summary golden files with PyTorch's own formatting code.

    python3 make_summary_golden.py PATH/TO/torch/cuda/memory.py

For every summary_<name>.stats.json next to this script (a statistics dict with PyTorch's
keys, as vram's MemoryStats::to_map() gives it), runs torch.cuda.memory_summary() from the
given memory.py on it and writes summary_<name>.txt. torch itself is not needed: the
function's source is taken from memory.py and run with memory_stats() returning the dict and
the device index 0. Nothing of PyTorch is stored here; the golden files are its output.
"""

import ast
import glob
import json
import os
import sys


def load_memory_summary(memory_py):
    with open(memory_py) as f:
        tree = ast.parse(f.read(), memory_py)
    fn = next(
        node
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name == "memory_summary"
    )
    fn.returns = None
    for arg in fn.args.args + fn.args.kwonlyargs:
        arg.annotation = None
    module = ast.Module(body=[fn], type_ignores=[])
    namespace = {"_get_device_index": lambda device, optional=False: 0}
    exec(compile(module, memory_py, "exec"), namespace)
    return namespace


def main():
    memory_py = sys.argv[1]
    here = os.path.dirname(os.path.abspath(__file__))
    namespace = load_memory_summary(memory_py)
    for path in sorted(glob.glob(os.path.join(here, "summary_*.stats.json"))):
        with open(path) as f:
            stats = json.load(f)
        namespace["memory_stats"] = lambda device=None, stats=stats: stats
        text = namespace["memory_summary"]()
        out = path[: -len(".stats.json")] + ".txt"
        with open(out, "w") as f:
            f.write(text)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
