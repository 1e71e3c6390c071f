"""From how many rows `--weights gguf`'s decode calls run on AMX's int8 tiles, chosen by a probe at load.

A decode row of a Q4_1 (or Q4F) matrix is exact integer products per block (csrc/q4_1_int24.cpp).
On a CPU that lists amx_int8, the tile unit can compute the same integers (csrc/amx_i24.cpp), so every
row gets the same bits from either kernel (tests/test_amx_i24.py), and which one takes a call changes
speed only. The tiles pay where a call has many rows, and the VNNI loop where it has few. On the AMX
Xeon (session 44, 2 threads, SmolLM2's layer shapes, cache-warm) the 30 layers took:

| rows | VNNI loop | AMX tiles |
|---|---|---|
| 1 | 0.93 ms | 2.63 |
| 4 | 2.66 | 2.89 |
| 8 | 5.39 | 3.51 |
| 16 | 10.6 | 5.67 |
| 32 | 20.4 | 11.4 |

So `choose` times the model's own Q4_1 / Q4F matrices (up to decode_prefetch's PROBE_BYTES) at each of
ROWS with each kernel, in rotating order for ROUNDS rounds, keeps the best run of each, and sets the
switch to the fewest rows from which the tiles win at every probed count (0, never, where they do not):
about 0.7 s at load for SmolLM2 (decode_prefetch's probe: 0.2 s).
It times the op path (a fork and join per matrix) at the load's thread count; decode-only steps run the
same kernels on the decode stack's thread team.

`KVGATE_Q4_1_AMX_ROWS=off|<rows>` sets the switch without a probe (A/B runs).
"""

from __future__ import annotations

import logging
import os

import torch

from kvgate.models import native
from kvgate.models.block_formats import BlockLinear
from kvgate.models.decode_prefetch import pass_timer, probe_matrices
from kvgate.models.q4_1 import Q41Linear

log = logging.getLogger("kvgate.models")

ENV = "KVGATE_Q4_1_AMX_ROWS"
ROWS = (4, 6, 8, 12, 16, 32)  # 32: two groups of 16 rows, what a c=32 decode step runs as
ROUNDS = 5
Q4F_BYTES = 384  # block_pack16's Q4F tile-block (csrc/q4_1_int24.cpp): the other format these kernels take


def takes_tiles(lin) -> bool:
    """Whether `lin`'s decode rows run the integer products (Q4_1, or a Q4F block matrix)."""
    return type(lin) is Q41Linear or (type(lin) is BlockLinear and lin.packed.shape[-1] == Q4F_BYTES)


def _calls(model) -> list[tuple[object, int]]:
    """(matrix, in_features) of `model`'s layers that take these kernels, up to PROBE_BYTES of tiles."""
    return probe_matrices(model, None, "", takes_tiles)


def fewest(times: dict[int, dict[str, list[float]]]) -> int:
    """The fewest probed rows from which the tiles' best run beats the loop's at every larger count too
    (a tie keeps the loop); 0 where there is none."""
    start = 0
    for rows in sorted(times, reverse=True):
        if min(times[rows]["tiles"]) >= min(times[rows]["loop"]):
            break
        start = rows
    return start


def choose(model) -> str | None:
    """Set the row count from which `model`'s decode calls take the tiles and say what was chosen (with
    the probe's best times), or None where there is no choice (no such matrices, no AMX int8 build or
    grant, or the float decode loop set by KVGATE_Q4_1_DECODE)."""
    ext = native.ready()
    calls = _calls(model)
    setting = os.environ.get(ENV, "auto")
    if ext is None or not calls:
        return None
    if not (ext.q4_1_amx_built() and ext.amx_unavailable() == ""):
        if setting != "auto":
            log.warning("%s=%s ignored: this build or process has no AMX int8 tiles", ENV, setting)
        return None
    if not ext.q4_1_decode().startswith("int24"):
        if setting != "auto":
            log.warning(
                "%s=%s ignored: KVGATE_Q4_1_DECODE=float keeps the decode rows off the tiles", ENV, setting
            )
        return None
    if setting == "off" or (setting.isdigit() and len(setting) <= 6):
        ext.set_q4_1_amx_rows(0 if setting == "off" else int(setting))
        rows = ext.q4_1_amx_rows() or "no"
        return f"gguf decode calls on AMX int8 tiles from {rows} rows ({ENV}={setting})"
    if setting != "auto":
        log.warning("%s=%s ignored: want auto, off or a row count (at most 6 digits)", ENV, setting)
    run = pass_timer(calls, ROWS)
    kernels = ("loop", "tiles")
    times: dict[int, dict[str, list[float]]] = {r: {k: [] for k in kernels} for r in ROWS}
    before = ext.q4_1_amx_rows()
    try:
        with torch.inference_mode():
            run(ROWS[-1])  # first touch of the outputs' allocations
            for i in range(ROUNDS):
                for kernel in kernels[i % 2 :] + kernels[: i % 2]:  # each round starts with the other
                    for rows in ROWS:
                        ext.set_q4_1_amx_rows(rows if kernel == "tiles" else 0)
                        times[rows][kernel].append(run(rows))
    finally:  # a failed call leaves the switch as it was (the same bits either way: speed only)
        ext.set_q4_1_amx_rows(before)
    start = fewest(times)
    ext.set_q4_1_amx_rows(start)
    best = "; ".join(
        f"{r} {min(times[r]['loop']) * 1e3:.2f} / {min(times[r]['tiles']) * 1e3:.2f}" for r in ROWS
    )
    return (
        f"gguf decode calls on AMX int8 tiles from {start or 'no'} rows (probe over the model's {len(calls)} "
        f"matrices, best ms loop / tiles at rows: {best})"
    )
