"""Memory read bandwidth of this machine and the batch-1 decode bound it implies.

Each decode step of a dense model streams every weight once, so at batch 1
`tok/s <= bandwidth / weight bytes per step` (KV reads are small next to the weights at short
contexts). Weight bytes come from kvgate's own plan (`kvgate.memory.plan.weight_bytes`).

    .venv/bin/python -m bench.bandwidth [--size-gib 1] [--repeats 7] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _time(fn, repeats: int) -> list[float]:
    fn()  # first touch / warm-up
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def measure(size_gib: float = 1.0, repeats: int = 7, threads: int | None = None) -> dict:
    """GB/s (10^9 bytes/s) for several kernels over a `size_gib` GiB float32 array (torch kernels use
    `threads` threads, default torch's choice; numpy's are single-threaded)."""
    import numpy as np
    import torch

    if threads:
        torch.set_num_threads(threads)

    n = int(size_gib * (1 << 30)) // 4
    nbytes = n * 4
    a = np.ones(n, dtype=np.float32)
    b = np.empty_like(a)
    ta = torch.from_numpy(a)
    tb = torch.from_numpy(b)
    kernels = {
        # reads only
        "numpy_sum_read": (lambda: a.sum(), nbytes),
        "torch_sum_read": (lambda: ta.sum(), nbytes),
        # read + write: the bytes counted are both directions
        "numpy_copy": (lambda: np.copyto(b, a), 2 * nbytes),
        "torch_copy": (lambda: tb.copy_(ta), 2 * nbytes),
    }
    results = {}
    for name, (fn, moved) in kernels.items():
        times = _time(fn, repeats)
        results[name] = {
            "best_gbps": moved / min(times) / 1e9,
            "median_gbps": moved / statistics.median(times) / 1e9,
            "bytes_moved": moved,
        }
    reads = {k: v for k, v in results.items() if k.endswith("_read")}
    best_read = max(reads.values(), key=lambda v: v["best_gbps"])
    return {
        "array_bytes": nbytes,
        "repeats": repeats,
        "torch_threads": torch.get_num_threads(),
        "kernels": results,
        "read_best_gbps": best_read["best_gbps"],
        "read_median_gbps": best_read["median_gbps"],
        "read_kernel": max(reads, key=lambda k: reads[k]["best_gbps"]),
    }


_NOW: dict = {}


def read_now(size_gib: float = 0.5, repeats: int = 3) -> float:
    """The best GB/s of `repeats` torch.sum reads of one `size_gib` GiB float32 tensor (kept between calls,
    so a reading costs ~0.1 s and no allocation), on torch's current threads.

    Taken right before and after a batch-1 run, to hold that run against the bandwidth of its own moment:
    on this project's 2-vCPU VMs the read speed flips within one process between ~30 and ~46-66 GB/s
    and stays a few seconds to minutes in each state (docs/DESIGN_NOTES.md, session 28), so one reading
    at a run's start says little about a run minutes later."""
    import torch

    n = int(size_gib * (1 << 30)) // 4
    if _NOW.get("n") != n:
        _NOW["t"], _NOW["n"] = torch.ones(n), n
    t = _NOW["t"]
    best = min(_time(t.sum, repeats))
    return n * 4 / best / 1e9


def default_model_weights() -> dict:
    """Weight bytes per decode step of the default model, from kvgate's plan, plus its GGUF file."""
    from kvgate.memory.plan import weight_bytes
    from kvgate.models import load_model, resolve_model_path

    path = resolve_model_path("default")
    spec = load_model("default").spec
    return {
        "model": spec.name,
        "path": str(path),
        "fp32": weight_bytes(spec, 4),
        "bf16": weight_bytes(spec, 2),
        "gguf_file": os.path.getsize(path),  # Q4_1: what llama.cpp streams (an upper bound on it)
        # kvgate's default here (--weights auto -> gguf): the Q4_1 layer blocks and the Q8_0 table, as held
        "kvgate_gguf": weight_bytes(spec, 4, weight_format="gguf", q8_head=True),
        # --weights gguf-q8act: the same blocks in tiles (fp16 d and m), the table in tiles
        "kvgate_gguf_q8act": weight_bytes(spec, 4, weight_format="gguf-q8act", q8_head=True),
    }


def decode_bounds(read_gbps: float, weights: dict) -> dict:
    return {
        k: read_gbps * 1e9 / weights[k]
        for k in ("fp32", "bf16", "gguf_file", "kvgate_gguf", "kvgate_gguf_q8act")
        if k in weights
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bandwidth", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    bw = measure(a.size_gib, a.repeats, a.threads)
    w = default_model_weights()
    bounds = {
        "best": decode_bounds(bw["read_best_gbps"], w),
        "median": decode_bounds(bw["read_median_gbps"], w),
    }
    print(
        f"memory bandwidth, {a.size_gib:g} GiB float32 array, {a.repeats} repeats, {bw['torch_threads']} torch threads:"
    )
    for name, r in bw["kernels"].items():
        print(f"  {name:<16} best {r['best_gbps']:6.1f} GB/s   median {r['median_gbps']:6.1f} GB/s")
    print(
        f"read bandwidth (best kernel {bw['read_kernel']}): best {bw['read_best_gbps']:.1f} GB/s, "
        f"median {bw['read_median_gbps']:.1f} GB/s"
    )
    print(f"batch-1 decode bound for {w['model']} = read bandwidth / weight bytes per step:")
    for k, label in (
        ("fp32", "fp32"),
        ("bf16", "bf16"),
        ("gguf_file", "Q4_1 GGUF file"),
        ("kvgate_gguf", "kvgate gguf"),
    ):
        print(
            f"  {label:<15} {w[k] / 1e6:7.1f} MB -> {bounds['best'][k]:6.1f} tok/s (median bw: {bounds['median'][k]:.1f})"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"bandwidth": bw, "weights_bytes": w, "decode_bound_tok_s": bounds}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
