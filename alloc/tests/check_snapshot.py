#!/usr/bin/env python3
"""Checks a vram-alloc snapshot pickle the way PyTorch's tools will read it.

    python3 check_snapshot.py SNAPSHOT.pickle --peak-requested BYTES
        [--json SNAPSHOT.json] [--expect-oom] [--expect-expandable] [--expect-pending]

Needs only the standard library. Checks that:

* the file is exactly what Python's own pickler (protocol 4, as
  torch.cuda.memory._dump_snapshot uses) writes for the object it holds, uses only opcodes
  PyTorch's MemoryViz.js decodes, and has no integer that MemoryViz.js would turn into a
  BigInt (LONG1 of more than 8 bytes);
* the dict has the keys and value types of torch.cuda.memory._snapshot(), in its order;
* every segment's blocks tile it and add up to its total_size, allocated_size, active_size
  and requested_size;
* every alloc is paired with a free_requested and a free_completed at its address, the
  allocations still live at the end are the snapshot's active blocks, the peak of live
  requested bytes over the trace equals --peak-requested, and segment events add up to the
  reserved bytes;
* oom entries carry device_free (and no addr);
* the JSON form, if given, holds the same dict.

The trace must have been recorded from an empty cache on. Exits non-zero on the first
failure, with the reason.
"""

import argparse
import json
import pickle
import pickletools
import sys

# Opcodes MemoryViz.js's unpickler decodes.
MEMORYVIZ_OPCODES = {
    "PROTO", "FRAME", "STOP", "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2",
    "LONG1", "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE", "EMPTY_LIST", "EMPTY_TUPLE",
    "EMPTY_DICT", "MARK", "APPEND", "APPENDS", "SETITEM", "SETITEMS", "TUPLE", "TUPLE1",
    "TUPLE2", "TUPLE3", "MEMOIZE", "BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT", "LIST",
    "DICT",
}

TOP_KEYS = ["segments", "device_traces", "allocator_settings", "external_annotations"]
SEGMENT_KEYS = [
    "device", "address", "total_size", "allocated_size", "active_size", "requested_size",
    "stream", "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks",
]
BLOCK_KEYS = ["address", "size", "requested_size", "state", "frames"]
TRACE_TAIL = ["size", "stream", "time_us", "compile_context", "user_metadata", "frames"]
SETTINGS = {
    "PYTORCH_CUDA_ALLOC_CONF": str,
    "max_split_size": int,
    "garbage_collection_threshold": float,
    "expandable_segments": bool,
    "pinned_num_register_threads": int,
    "release_lock_on_cudamalloc": bool,
    "pinned_use_cuda_host_register": bool,
    "graph_capture_record_stream_reuse": bool,
    "roundup_power2_divisions": dict,
}
ACTIONS = {
    "alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
    "segment_map", "segment_unmap", "oom", "snapshot",
}
STATES = {"active_allocated", "active_pending_free", "inactive"}


class CheckError(Exception):
    pass


def check(cond, msg):
    if not cond:
        raise CheckError(msg)


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def check_encoding(raw):
    check(raw[:2] == b"\x80\x04", f"expected a protocol 4 pickle, header {raw[:2]!r}")
    data = pickle.loads(raw)
    again = pickle.dumps(data, protocol=4)
    if again != raw:
        at = next(i for i, (a, b) in enumerate(zip(raw, again)) if a != b) if len(raw) == len(
            again
        ) else min(len(raw), len(again))
        raise CheckError(
            f"Python's pickler writes other bytes for this object (first difference at byte "
            f"{at}: ours {raw[at:at + 16]!r}, Python's {again[at:at + 16]!r})"
        )
    for op, arg, pos in pickletools.genops(raw):
        check(op.name in MEMORYVIZ_OPCODES, f"opcode {op.name} at {pos}: MemoryViz.js lacks it")
        if op.name == "LONG1":
            n = len(pickle.encode_long(arg))
            check(n <= 8, f"LONG1 of {n} bytes at {pos} ({arg}): MemoryViz.js makes it a BigInt")
    return data


def check_layout(d):
    check(isinstance(d, dict), "the snapshot is not a dict")
    check(list(d) == TOP_KEYS, f"top-level keys {list(d)}, PyTorch writes {TOP_KEYS}")
    check(d["external_annotations"] == [], "external_annotations should be an empty list")
    settings = d["allocator_settings"]
    check(list(settings) == list(SETTINGS), f"allocator_settings keys {list(settings)}")
    for k, t in SETTINGS.items():
        v = settings[k]
        ok = is_int(v) if t is int else isinstance(v, t)
        check(ok, f"allocator_settings[{k!r}] = {v!r} is not {t.__name__}")
    roundup = settings["roundup_power2_divisions"]
    check(
        list(roundup) == [str(1 << i) for i in range(16)],
        f"roundup_power2_divisions keys {list(roundup)}",
    )
    check(all(is_int(v) and v >= 0 for v in roundup.values()), "roundup divisions are ints")

    for seg in d["segments"]:
        check(list(seg) == SEGMENT_KEYS, f"segment keys {list(seg)}, PyTorch: {SEGMENT_KEYS}")
        for k in SEGMENT_KEYS:
            if k in ("segment_type", "segment_pool_id", "is_expandable", "frames", "blocks"):
                continue
            check(is_int(seg[k]) and seg[k] >= 0, f"segment {k} = {seg[k]!r} is not an int")
        check(seg["segment_type"] in ("small", "large"), f"segment_type {seg['segment_type']!r}")
        check(seg["segment_pool_id"] == (0, 0), f"segment_pool_id {seg['segment_pool_id']!r}")
        check(isinstance(seg["is_expandable"], bool), "is_expandable is not a bool")
        check(seg["frames"] == [], "segment frames should be []")
        for b in seg["blocks"]:
            check(list(b) == BLOCK_KEYS, f"block keys {list(b)}, PyTorch: {BLOCK_KEYS}")
            check(b["state"] in STATES, f"block state {b['state']!r}")
            check(b["frames"] == [], "block frames should be []")
            for k in ("address", "size", "requested_size"):
                check(is_int(b[k]) and b[k] >= 0, f"block {k} = {b[k]!r}")

    check(isinstance(d["device_traces"], list) and len(d["device_traces"]) == 1,
          "device_traces should hold one list (one device)")
    for e in d["device_traces"][0]:
        check(e.get("action") in ACTIONS, f"unknown action in {e}")
        where = "device_free" if e["action"] == "oom" else "addr"
        keys = ["action", where] + TRACE_TAIL
        check(list(e) == keys, f"{e['action']} entry keys {list(e)}, PyTorch: {keys}")
        for k in (where, "size", "stream", "time_us"):
            check(is_int(e[k]) and e[k] >= 0, f"{e['action']} {k} = {e[k]!r}")
        check(e["compile_context"] == "N/A" and e["user_metadata"] == "", f"context in {e}")
        check(e["frames"] == [], "trace frames should be []")


def check_segments(d):
    addresses = [s["address"] for s in d["segments"]]
    check(addresses == sorted(addresses), "segments are not sorted by address")
    for seg in d["segments"]:
        blocks = seg["blocks"]
        check(blocks, f"segment {seg['address']:#x} has no blocks")
        addr = seg["address"]
        allocated = active = requested = 0
        for b in blocks:
            check(b["address"] == addr,
                  f"block at {b['address']:#x} should start at {addr:#x} (segment "
                  f"{seg['address']:#x}): blocks do not tile the segment")
            check(b["size"] > 0, f"empty block at {addr:#x}")
            addr += b["size"]
            if b["state"] == "inactive":
                check(b["requested_size"] == 0, f"inactive block at {b['address']:#x} "
                      f"reports {b['requested_size']} requested bytes")
            else:
                check(0 <= b["requested_size"] <= b["size"],
                      f"active block at {b['address']:#x}: requested {b['requested_size']} "
                      f"of {b['size']}")
                active += b["size"]
                requested += b["requested_size"]
            if b["state"] == "active_allocated":
                allocated += b["size"]
        check(addr - seg["address"] == seg["total_size"],
              f"segment {seg['address']:#x}: blocks sum to {addr - seg['address']}, "
              f"total_size is {seg['total_size']}")
        check((allocated, active, requested)
              == (seg["allocated_size"], seg["active_size"], seg["requested_size"]),
              f"segment {seg['address']:#x}: allocated/active/requested sizes "
              f"{(seg['allocated_size'], seg['active_size'], seg['requested_size'])}, "
              f"blocks give {(allocated, active, requested)}")


def check_trace(d, args):
    trace = d["device_traces"][0]
    times = [e["time_us"] for e in trace]
    check(times == sorted(times), "time_us goes backwards")
    live = {}  # addr -> [requested size, free requested?]
    segments = {}  # base -> size (segment_alloc / segment_free)
    mapped = {}  # start -> size of mapped ranges (segment_map / segment_unmap)
    total = peak = 0
    ooms = 0

    def in_memory(addr, size):
        # Within one segment, or within adjacent mapped ranges.
        if any(b <= addr and addr + size <= b + n for b, n in segments.items()):
            return True
        end = addr
        for start, n in sorted(mapped.items()):
            if start <= end < start + n:
                end = start + n
            if end >= addr + size:
                return True
        return False

    requested_at = {}  # addr -> index of its free_requested
    waited = False

    for i, e in enumerate(trace):
        a, size = e["action"], e["size"]
        if a == "alloc":
            addr = e["addr"]
            check(addr not in live, f"entry {i}: alloc at {addr:#x}, which is live")
            check(in_memory(addr, size), f"entry {i}: alloc at {addr:#x} outside any segment")
            live[addr] = [size, False]
            total += size
            peak = max(peak, total)
        elif a == "free_requested":
            addr = e["addr"]
            check(addr in live, f"entry {i}: free_requested at {addr:#x} without an alloc")
            check(not live[addr][1], f"entry {i}: second free_requested at {addr:#x}")
            check(live[addr][0] == size, f"entry {i}: free_requested of {size} bytes at "
                  f"{addr:#x}, allocated {live[addr][0]}")
            live[addr][1] = True
            requested_at[addr] = i
        elif a == "free_completed":
            addr = e["addr"]
            check(addr in live and live[addr][1],
                  f"entry {i}: free_completed at {addr:#x} without alloc and free_requested")
            check(live[addr][0] == size, f"entry {i}: free_completed of {size} bytes at "
                  f"{addr:#x}, allocated {live[addr][0]}")
            del live[addr]
            total -= size
            waited |= requested_at.pop(addr) + 1 < i
        elif a == "segment_alloc":
            check(e["addr"] not in segments, f"entry {i}: segment_alloc of a live segment")
            check(size > 0, f"entry {i}: segment_alloc of 0 bytes")
            segments[e["addr"]] = size
        elif a == "segment_free":
            check(segments.get(e["addr"]) == size,
                  f"entry {i}: segment_free at {e['addr']:#x} of {size} bytes does not match "
                  f"a segment_alloc")
            del segments[e["addr"]]
        elif a == "segment_map":
            check(size > 0, f"entry {i}: segment_map of 0 bytes")
            mapped[e["addr"]] = size
        elif a == "segment_unmap":
            # Unmapping may take any part of the mapped ranges: split them.
            lo, hi = e["addr"], e["addr"] + size
            covered = 0
            for start, n in sorted(mapped.items()):
                s, t = max(start, lo), min(start + n, hi)
                if s >= t:
                    continue
                covered += t - s
                del mapped[start]
                if start < s:
                    mapped[start] = s - start
                if t < start + n:
                    mapped[t] = start + n - t
            check(covered == size, f"entry {i}: segment_unmap of unmapped memory")
        elif a == "oom":
            check("addr" not in e and is_int(e["device_free"]), f"entry {i}: oom {e}")
            check(size > 0, f"entry {i}: oom of 0 bytes")
            ooms += 1

    active = {
        b["address"]: [b["requested_size"], b["state"] == "active_pending_free"]
        for seg in d["segments"]
        for b in seg["blocks"]
        if b["state"] != "inactive"
    }
    check(live == active,
          f"allocations live at the end of the trace ({len(live)}) are not the snapshot's "
          f"active blocks ({len(active)})")
    reserved = sum(s["total_size"] for s in d["segments"])
    traced = sum(segments.values()) + sum(mapped.values())
    check(traced == reserved, f"segment events leave {traced} bytes reserved, the segments "
          f"hold {reserved}")
    check(peak == args.peak_requested,
          f"peak of live requested bytes over the trace is {peak}, expected "
          f"{args.peak_requested}")
    if args.expect_oom:
        check(ooms > 0, "no oom entry")
    if args.expect_expandable:
        check(any(s["is_expandable"] for s in d["segments"]), "no expandable segment")
        check(any(e["action"] == "segment_map" for e in trace), "no segment_map entry")
    if args.expect_pending:
        check(waited or any(p for _, p in live.values()), "no free waited for another stream")
    return len(trace), peak, ooms


def untuple(v):
    if isinstance(v, (list, tuple)):
        return [untuple(x) for x in v]
    if isinstance(v, dict):
        return {k: untuple(x) for k, x in v.items()}
    return v


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("pickle")
    p.add_argument("--peak-requested", type=int, required=True)
    p.add_argument("--json")
    p.add_argument("--expect-oom", action="store_true")
    p.add_argument("--expect-expandable", action="store_true")
    p.add_argument("--expect-pending", action="store_true")
    args = p.parse_args()
    try:
        with open(args.pickle, "rb") as f:
            raw = f.read()
        d = check_encoding(raw)
        check_layout(d)
        check_segments(d)
        entries, peak, ooms = check_trace(d, args)
        if args.json:
            with open(args.json) as f:
                check(json.load(f) == untuple(d), "the JSON form holds another dict")
    except CheckError as e:
        print(f"check_snapshot: {args.pickle}: FAILED: {e}", file=sys.stderr)
        return 1
    print(
        f"check_snapshot: {args.pickle}: ok ({len(d['segments'])} segments, {entries} trace "
        f"entries, {ooms} ooms, peak requested {peak} bytes, {len(raw)} bytes)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
