"""A GGUF's layer matrices in their tile format against the same codes in q8s, side by side in one process.

    .venv/bin/python -m bench.block_format_ab MODEL.gguf [--format q5f] [--rows 1 4 16] [--rounds 15]

`--weights gguf` holds every layer matrix in the narrowest tile format that gives back its values
(`kvgate.models.block_formats`). This times that choice: every fused layer matrix of MODEL that is held
in `--format` goes through `block_matmul` once in that format and once packed as q8s (int8 codes, d and m
per 16: the format it had before a narrower one existed), alternating every round, from memory. It prints
each one's median ms and the median of the per-round ratios: pairing each round cancels the VM's drift
(docs/DESIGN_NOTES.md, session 28). The two give the same numbers to float32 rounding; the script only
times them. `bench.kquant_model` writes the default model in llama.cpp's Q4_K_M recipe (mostly Q5_0).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.cpu import cpu_line, machine_info
from bench.q4_1_decode_ab import kernels


def matrices(path: str, fmt: str) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """(tiles in `fmt`, the same codes as q8s tiles, out_features) for every fused layer matrix of the
    model at `path` that `--weights gguf` holds in `fmt`."""
    from kvgate.models import load_model
    from kvgate.models.block_formats import block_pack16, fused_names, fused_scales, recover

    loaded = load_model(path)
    out = []
    for i in range(loaded.spec.num_layers):
        for names in fused_names(i):
            w = torch.cat([loaded.weights[n].float() for n in names])
            got = recover(w, fused_scales(loaded.block_scales, names))
            if got is not None and got[0] == fmt:
                out.append((block_pack16(fmt, *got[1]), block_pack16("q8s", *got[1]), w.shape[0]))
    return out


def paired(ext, mats, rows: int, rounds: int) -> dict:
    xs = [torch.randn(rows, a.size(1) * 32) for a, _, _ in mats]
    ms: dict[str, list[float]] = {"held": [], "q8s": []}
    for _ in range(rounds):
        for which, col in (("held", 0), ("q8s", 1)):
            t = time.perf_counter()
            for m, x in zip(mats, xs):
                ext.block_matmul(x, m[col], m[2], rows)
            ms[which].append((time.perf_counter() - t) * 1e3)
    return {
        "held_ms": statistics.median(ms["held"]),
        "q8s_ms": statistics.median(ms["q8s"]),
        "ratio": statistics.median(h / q for h, q in zip(ms["held"], ms["q8s"])),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", help="a .gguf file (bench.kquant_model writes k-quant ones)")
    p.add_argument("--format", default="q5f", help="the held format to time against q8s (q4f, q5f)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    a = p.parse_args(argv)
    ext = kernels(a.threads)
    mats = matrices(a.model, a.format)
    if not mats:
        raise SystemExit(f"no layer matrix of {a.model} is held as {a.format}")
    held_mb = sum(m[0].numel() for m in mats) / 1e6
    q8s_mb = sum(m[1].numel() for m in mats) / 1e6
    print(cpu_line(machine_info()))
    print(
        f"{len(mats)} layer matrices held as {a.format} ({held_mb:.1f} MB; as q8s {q8s_mb:.1f} MB), "
        f"{torch.get_num_threads()} threads, {a.rounds} rounds; median ms\n"
    )
    print(f"| rows | {a.format} | q8s | {a.format} / q8s (paired median) |\n|---|---|---|---|")
    for rows in a.rows:
        r = paired(ext, mats, rows, a.rounds)
        print(f"| {rows} | {r['held_ms']:.2f} | {r['q8s_ms']:.2f} | {r['ratio']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
