"""--weights gguf's two decode loops, int24 (the default) and float, side by side in one process.

    .venv/bin/python -m bench.q4_1_decode_ab [--rows 1 3 8 16] [--rounds 15] [--threads 2]

On a shared VM a kernel's time moves by up to 1.5x between processes minutes apart, and a served
`bench.compare` of 4 or 64 requests cannot resolve a 10% kernel difference. This script therefore
runs SmolLM2's own layer matrices (every Q4_1 matrix of the default model, from memory: 66 MB, past any
cache) through `q4_1_matmul` with the loop switched (`set_q4_1_decode`) every round. It prints
each loop's median ms and the median of the per-round int24 / float ratios. Pairing each round
cancels the machine's slow drift. The two loops give the same numbers to float32 rounding, with
other bits (tests/test_q4_1_int24.py); the script only times them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.cpu import cpu_line, machine_info


def layer_mats(model) -> list[tuple[object, int]]:
    """(Q41Linear, in_features) for every Q4_1 layer matrix of a loaded model, in the layers' order."""
    from kvgate.models.q4_1 import QBLOCK, Q41Linear

    return [
        (m, m.packed.size(1) * QBLOCK) for layer in model.layers for m in layer if isinstance(m, Q41Linear)
    ]


def kernels(threads: int | None):
    """kvgate's C++ kernels on `threads` torch threads (None: torch's own), or exit saying why not."""
    from kvgate.models import native

    if threads:
        torch.set_num_threads(threads)
    ext = native.extension()
    if ext is None:
        raise SystemExit(f"kvgate's C++ kernels are not available: {native.unavailable()}")
    return ext


def paired(ext, mats, rows: int, rounds: int) -> dict:
    xs = [torch.randn(rows, k) for _, k in mats]
    ms: dict[str, list[float]] = {"float": [], "int24": []}
    try:
        for _ in range(rounds):
            for how in ms:
                ext.set_q4_1_decode(how)
                t = time.perf_counter()
                for (m, _), x in zip(mats, xs):
                    ext.q4_1_matmul(x, m.packed, m.out_features, rows)
                ms[how].append((time.perf_counter() - t) * 1e3)
    finally:
        ext.set_q4_1_decode("int24")
    ratios = [i / f for i, f in zip(ms["int24"], ms["float"])]
    return {
        "rows": rows,
        "float_ms": statistics.median(ms["float"]),
        "int24_ms": statistics.median(ms["int24"]),
        "ratio": statistics.median(ratios),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    a = p.parse_args(argv)
    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine

    ext = kernels(a.threads)
    e = Engine.from_model("default", EngineConfig(dtype="float32", memory_limit="2GiB", weights="gguf"))
    try:
        mats = layer_mats(e.model)
        mb = sum(m.packed.numel() * m.packed.element_size() for m, _ in mats) / 1e6
        print(cpu_line(machine_info()))
        print(
            f"{len(mats)} Q4_1 layer matrices ({mb:.1f} MB), {torch.get_num_threads()} threads, "
            f"{a.rounds} rounds, int24 = {ext.set_q4_1_decode('int24')}; median ms\n"
        )
        print("| rows | float | int24 | int24 / float (paired median) |\n|---|---|---|---|")
        for rows in a.rows:
            r = paired(ext, mats, rows, a.rounds)
            print(f"| {rows} | {r['float_ms']:.2f} | {r['int24_ms']:.2f} | {r['ratio']:.3f} |", flush=True)
    finally:
        e.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
