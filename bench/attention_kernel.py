"""Cold-cache speed of the paged decode attention kernel (kvgate/models/csrc/paged_attention.cpp).

    KVGATE_EXT_DIR=... .venv/bin/python -m bench.attention_kernel [--rows 1 4 16] [--context 300 1000]
        [--layers 30] [--repeats 5] [--kv-dtype float32 | float16 | bfloat16 | int8]

SmolLM2's geometry (9 query heads, 3 KV heads, head_dim 64, block size 16, float32). Each layer has its
own K/V pool, as in serving, and all layers share one scattered block table; the caches are flushed
(a 128 MiB read) before each repeat, so every layer's K/V comes from memory. Prints ms per `--layers`
calls (the fastest of `--repeats`: on a shared machine the slower ones measure the neighbours) and the
K/V read rate it implies, with the CPU model and flags.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvgate.models.kv_int8 import head_bytes, random_pool

H, KVH, D, BS = 9, 3, 64, 16


def cold_ms(
    op, rows: int, context: int, layers: int = 30, repeats: int = 5, kv_dtype: torch.dtype = torch.float32
) -> float:
    """Fastest ms for `layers` calls of `op`, each on its own pool (in `kv_dtype`: `--kv-dtype`),
    starting from flushed caches."""
    gen = torch.Generator().manual_seed(0)
    nblk = -(-context // BS)
    tables = torch.randperm(rows * nblk, generator=gen).view(rows, nblk)
    lens = torch.full((rows,), context, dtype=torch.long)
    shape = (rows * nblk, BS, KVH, D)
    pools = []
    for _ in range(layers):
        q = torch.randn(rows, H, D, generator=gen)
        (k, ks), (v, vs) = (random_pool(shape, gen, kv_dtype) for _ in range(2))
        pools.append((q, k, v, ks, vs))
    flush = torch.ones(32 << 20)
    best = float("inf")
    for _ in range(repeats):
        flush.sum()
        t0 = time.perf_counter()
        for q, k, v, ks, vs in pools:
            op(q, k, v, tables, lens, D**-0.5, ks, vs)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--context", type=int, nargs="+", default=[300, 1000])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--kv-dtype", default="float32", help="float32 | float16 | bfloat16 | int8: the pools' dtype"
    )
    a = ap.parse_args(argv)
    kv = getattr(torch, a.kv_dtype)
    from bench.cpu import cpu_line, machine_info
    from kvgate.models.paged_attention import kernel

    op = kernel()
    if op is None:
        print("the paged kernel could not be built (see the log)")
        return 1
    m = machine_info()
    print(
        f"{cpu_line(m)} Load at start {m['loadavg_at_start'][0]:.1f}; torch threads {torch.get_num_threads()}"
    )
    print()
    print(f"K/V pools in {a.kv_dtype}")
    print(f"| rows | context | ms per {a.layers} layers | K/V GB/s |")
    print("|---|---|---|---|")
    with torch.inference_mode():
        for context in a.context:
            for rows in a.rows:
                ms = cold_ms(op, rows, context, a.layers, a.repeats, kv)
                gb = rows * context * KVH * head_bytes(kv, D) * 2 * a.layers / 1e9
                print(f"| {rows} | {context} | {ms:.2f} | {gb / ms * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
