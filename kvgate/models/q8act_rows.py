"""Which `--weights gguf-q8act` kernel takes calls of one to four rows, chosen per CPU by a probe at load.

In a build with AVX-512 VNNI (csrc/int8_vnni.cpp), calls of five rows or more take pairs of tiles
(16 outputs a vector). Calls of 1-4 rows can take those pairs or the AVX2 tiles (csrc/int8_dot.cpp, 8
outputs a vector, one weight stream per thread). Both give the same bits (tests/test_int8_vnni.py), so
the choice changes speed only, and which is faster depends on the CPU:
- on a Zen 4 EPYC (session 25) one row of SmolLM2's 30 layers, cold, took 1.7-1.9 ms on the AVX2 tiles
  against 2.0 on the pairs;
- on an AMX Xeon (session 43, one thread) a one-row step took 12.1-12.5 ms with the tiles and 10.7-11.0
  with the pairs, a four-row step 23.4-24.5 against 18.0-18.1.
So `choose` times the model's own q8act matrices (the head, then layers up to decode_prefetch's PROBE_BYTES) at
1, 2, 3 and 4 rows with each kernel, in rotating order for ROUNDS rounds (5), and keeps the faster one for
each row count (the best run of each: what disturbs a run on a shared machine only slows it). It times
the op path (a fork and join per matrix) at the load's thread count, and one switch serves the layers
and the head; decode-only steps run the same kernels on the decode stack's thread team.

`KVGATE_Q8ACT_SMALL_ROWS=tiles|pairs` sets every row count without a probe (A/B runs).
"""

from __future__ import annotations

import logging
import os

import torch

from kvgate.models import native
from kvgate.models.decode_prefetch import pass_timer, probe_matrices
from kvgate.models.q4_1_dot8 import Q41Dot8Linear
from kvgate.models.q8_head import Q8DotTable

log = logging.getLogger("kvgate.models")

ENV = "KVGATE_Q8ACT_SMALL_ROWS"
KERNELS = ("tiles", "pairs")
ROWS = (1, 2, 3, 4)  # the calls where the kernel is a choice; 5 rows and more always take the pairs
ROUNDS = 5  # ~60 ms a round on SmolLM2; with another process busy, 3 rounds once kept the slower kernel


def mask(pairs_at) -> int:
    """The kernel's switch: bit R set where calls of R rows take the pairs."""
    return sum(1 << r for r in pairs_at)


def faster(times: dict[int, dict[str, list[float]]]) -> list[int]:
    """The row counts whose best pairs run beat the best tiles run (a tie keeps the tiles, the default)."""
    return [r for r in sorted(times) if min(times[r]["pairs"]) < min(times[r]["tiles"])]


def _calls(model) -> list[tuple[object, int]]:
    """`model`'s q8act matrices: the head first, then layers until PROBE_BYTES of tiles."""
    return probe_matrices(model, Q8DotTable, "packed", Q41Dot8Linear)


def choose(model) -> str | None:
    """Set which kernel takes `model`'s calls of 1-4 rows and say what was chosen (with the probe's best
    times), or None where there is no choice (not gguf-q8act, no C++ build, no VNNI kernels)."""
    ext = native.ready()
    calls = _calls(model)
    setting = os.environ.get(ENV, "auto")
    if ext is None or not calls or ext.int8_isa() != "avx512-vnni":
        if calls and setting != "auto":
            log.warning(
                "%s=%s ignored: the gguf-q8act kernels here have no VNNI pairs to choose", ENV, setting
            )
        return None
    if setting in KERNELS:
        ext.set_int8_small_rows(mask(ROWS) if setting == "pairs" else 0)
        return f"gguf-q8act calls of 1-4 rows: {setting} ({ENV}={setting})"
    if setting != "auto":
        log.warning("%s=%s ignored: want auto, tiles or pairs", ENV, setting)
    run = pass_timer(calls, ROWS)

    times: dict[int, dict[str, list[float]]] = {r: {k: [] for k in KERNELS} for r in ROWS}
    before = ext.int8_small_rows()
    try:
        with torch.inference_mode():
            run(1)  # first touch of the outputs' allocations
            for i in range(ROUNDS):
                for kernel in KERNELS[i % 2 :] + KERNELS[: i % 2]:  # each round starts with the other
                    ext.set_int8_small_rows(mask(ROWS) if kernel == "pairs" else 0)
                    for rows in ROWS:
                        times[rows][kernel].append(run(rows))
    finally:  # a failed call leaves the switch as it was (the same bits either way: speed only)
        ext.set_int8_small_rows(before)
    pairs_at = faster(times)
    ext.set_int8_small_rows(mask(pairs_at))
    best = "; ".join(
        f"{r} {'pairs' if r in pairs_at else 'tiles'} ({min(times[r]['tiles']) * 1e3:.2f} / "
        f"{min(times[r]['pairs']) * 1e3:.2f})"
        for r in ROWS
    )
    return (
        f"gguf-q8act calls of 1-4 rows (probe over the model's {len(calls)} matrices, best ms tiles / "
        f"pairs): {best}"
    )
