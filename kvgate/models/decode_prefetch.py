"""How the decode loops prefetch their tiles, chosen per CPU by a probe at load.

The decode rows of `q4_1_matmul` (--weights gguf's layers) and `q8_matmul` (the Q8_0 head) can ask for
each tile's bytes ahead of use in two ways (csrc/tile_matmul.cpp): into L1 a few blocks ahead ("near"),
and the next group's tiles into L2 while the current group runs ("next"). Each of two switches, for
groups of one row and of several, is a mode: off, near, next or both. Which pays depends on the CPU,
and differently for one row than for several: on Zen 5 (session 13) one row without "near" took 1.45x
as long; on Zen 4 (session 16) "near" made one row slower (4.3 against 3.7 ms for SmolLM2's 30 layers)
and 16 rows faster (18.5 against 19.8); on Zen 4 (session 21) "next" took one row's layers to 0.78x
and the head to 0.72x of no prefetch (2 rows: 0.63x and 0.73x), "both" to 0.85x and 0.80x. So `choose` times the model's own
matrices, from memory, at one row and at eight, every mode in rotating order for ROUNDS rounds, and
keeps the mode with the best time per switch. A model past 256 MB of such tiles is probed on its first
256 MB (the head, then layers), which still stream from memory. Prefetching never changes a bit of any
result (tests/test_decode_prefetch.py), so the probe changes only speed.

`KVGATE_DECODE_PREFETCH=off|near|next|both` sets both switches without a probe (A/B runs); `on` is `both`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

from kvgate.models import native
from kvgate.models.q4_1 import Q41Linear
from kvgate.models.q8_head import Q8Table

log = logging.getLogger("kvgate.models")

ENV = "KVGATE_DECODE_PREFETCH"
MODES = ("off", "near", "next", "both")  # index = the kernel's mode (bit 1 near, bit 2 next)
ROUNDS = 3
MORE_ROWS = 8  # one group of 8 rows: the kernel's widest, what 8 or more decode rows run as
PROBE_BYTES = 256 << 20  # a bigger model's probe takes its first matrices up to this: still far past any L3


def fastest(times: dict[str, list[float]]) -> str:
    """The mode whose best run is the shortest (the best of each, since what disturbs a run on a shared
    machine only ever slows it); a tie goes to the earlier mode in MODES."""
    return min(MODES, key=lambda m: (min(times[m]), MODES.index(m)))


def probe_matrices(
    model, head_type: type | None, head_tiles: str, layer_type: type | Callable[[object], bool]
) -> list[tuple[object, int]]:
    """(matrix, in_features) of `model`'s head and layer matrices of exactly these types, in the forward's
    order: the head first (its tiles in attribute `head_tiles`; None: no head), then layers (`packed`)
    until PROBE_BYTES of tiles; `layer_type` may be a test of a matrix instead of its type. Blocks of 32
    values: in_features is 32 x the tiles' second dimension."""
    out, total = [], 0
    takes = layer_type if not isinstance(layer_type, type) else lambda lin: type(lin) is layer_type
    head = getattr(model, "lm_head", None)
    if type(head) is head_type:
        tiles = getattr(head, head_tiles)
        out.append((head, tiles.shape[1] * 32))
        total += tiles.numel()
    for layer in model.layers:
        for lin in layer:
            if takes(lin) and total < PROBE_BYTES:
                out.append((lin, lin.packed.shape[1] * 32))
                total += lin.packed.numel()
    return out


def pass_timer(calls: list[tuple[object, int]], row_counts) -> Callable[[int], float]:
    """`run(rows)`: the seconds one pass over `calls` takes at that many rows of zeros."""
    xs = {(rows, k): torch.zeros(rows, k) for rows in row_counts for k in {k for _, k in calls}}

    def run(rows: int) -> float:
        t = time.perf_counter()
        for mat, k in calls:
            mat(xs[rows, k])
        return time.perf_counter() - t

    return run


def _calls(model) -> list[tuple[object, int]]:
    """The matrices the switches govern: a Q8 head (not Q8DotTable, gguf-q8act's: its kernel has no such
    switch) and Q4_1 layers."""
    return probe_matrices(model, Q8Table, "tiles", Q41Linear)


def choose(model) -> str | None:
    """Set the prefetch switches for `model` and say what was chosen (with the probe's best times), or None
    where its matrices do not take these kernels (other formats, no C++ build)."""
    ext = native.ready()
    calls = _calls(model)
    if ext is None or not calls:
        return None
    setting = os.environ.get(ENV, "auto")
    setting = "both" if setting == "on" else setting
    if setting in MODES:
        mode = MODES.index(setting)
        ext.set_decode_prefetch(mode, mode)
        return f"decode prefetch {setting} for every row count ({ENV}={os.environ[ENV]})"
    if setting != "auto":
        log.warning("%s=%s ignored: want auto, %s or on", ENV, setting, ", ".join(MODES))
    run = pass_timer(calls, (1, MORE_ROWS))

    times: dict[int, dict[str, list[float]]] = {r: {m: [] for m in MODES} for r in (1, MORE_ROWS)}
    tiles = ext.q4_1_amx_rows()  # calls on AMX's int8 tiles (amx_rows) ignore the prefetch: time the loop
    ext.set_q4_1_amx_rows(0)
    try:
        with torch.inference_mode():
            run(1)  # first touch of the outputs' allocations
            for i in range(ROUNDS):
                for mode in MODES[i % len(MODES) :] + MODES[: i % len(MODES)]:  # each round starts elsewhere
                    ext.set_decode_prefetch(MODES.index(mode), MODES.index(mode))
                    for rows in (1, MORE_ROWS):
                        times[rows][mode].append(run(rows))
    finally:
        ext.set_q4_1_amx_rows(tiles)
    one, more = fastest(times[1]), fastest(times[MORE_ROWS])
    ext.set_decode_prefetch(MODES.index(one), MODES.index(more))

    def ms(rows: int) -> str:
        return ", ".join(f"{m} {min(times[rows][m]) * 1e3:.2f}" for m in MODES)

    return (
        f"decode prefetch: one row {one}, {MORE_ROWS}+ rows {more} (probe over the model's {len(calls)} "
        f"matrices, best ms: 1 row {ms(1)}; {MORE_ROWS} rows {ms(MORE_ROWS)})"
    )
