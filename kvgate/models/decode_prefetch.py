"""Whether the float decode loops prefetch their tiles into L1, chosen per CPU by a probe at load.

The decode rows of `q4_1_matmul` (--weights gguf's layers) and `q8_matmul` (the Q8_0 head) can ask for
each tile's bytes a few blocks before they use them (csrc/tile_matmul.cpp). Whether that pays depends
on the CPU, and differently for one row than for several: on Zen 5 (session 13) one row without it took
1.45x as long; on Zen 4 (session 16) SmolLM2's 30 layers at one row took 4.3 ms with it and 3.7 without,
while 16 rows still gained from it (18.5 against 19.8 ms). So `choose` times the model's own matrices,
from memory, at one row and at eight, each switch on and off in alternating rounds, and keeps the
faster; the prefetch stays on unless going without is clearly (3%) faster. A model past 256 MB of such
tiles is probed on its first 256 MB (the head, then layers), which still stream from memory.
Prefetching never changes a bit of any result (tests/test_decode_prefetch.py), so the probe changes
only speed.

`KVGATE_DECODE_PREFETCH=on` or `off` sets both switches without a probe (A/B runs).
"""

from __future__ import annotations

import logging
import os
import time

import torch

from kvgate.models import native
from kvgate.models.q4_1 import Q41Linear
from kvgate.models.q8_head import Q8Table

log = logging.getLogger("kvgate.models")

ENV = "KVGATE_DECODE_PREFETCH"
MARGIN = 0.97  # without the prefetch must take under 97% of the time with it to be chosen
ROUNDS = 3
MORE_ROWS = 8  # one group of 8 rows: the kernel's widest, what 8 or more decode rows run as
PROBE_BYTES = 256 << 20  # a bigger model's probe takes its first matrices up to this: still far past any L3


def keep_prefetch(with_s: list[float], without_s: list[float]) -> bool:
    """True unless the runs without the prefetch are clearly faster: their best under MARGIN x the best
    with it (the best of each, since what disturbs a run on a shared machine only ever slows it)."""
    return not min(without_s) < MARGIN * min(with_s)


def _calls(model) -> list[tuple[object, int]]:
    """(matrix, in_features) for the matrices of `model` the switches govern, in the forward's order
    (the head first, then layers until PROBE_BYTES of tiles)."""
    out, total = [], 0
    head = getattr(model, "lm_head", None)
    if type(head) is Q8Table:  # not Q8DotTable (gguf-q8act): its kernel has no such switch
        out.append((head, head.tiles.shape[1] * 32))
        total += head.tiles.numel()
    for layer in model.layers:
        for lin in layer:
            if type(lin) is Q41Linear and total < PROBE_BYTES:
                out.append((lin, lin.packed.shape[1] * 32))
                total += lin.packed.numel()
    return out


def choose(model) -> str | None:
    """Set the prefetch switches for `model` and say what was chosen (with the probe's best times), or None
    where its matrices do not take these kernels (other formats, no C++ build)."""
    ext = native.ready()
    calls = _calls(model)
    if ext is None or not calls:
        return None
    setting = os.environ.get(ENV, "auto")
    if setting in ("on", "off"):
        ext.set_decode_prefetch(setting == "on", setting == "on")
        return f"decode prefetch {setting} for every row count ({ENV}={setting})"
    if setting != "auto":
        log.warning("%s=%s ignored: want auto, on or off", ENV, setting)
    xs = {
        (rows, k): torch.zeros(rows, k)
        for rows in (1, MORE_ROWS)
        for k in {k for _, k in calls}
    }

    def run(rows: int) -> float:
        t = time.perf_counter()
        for mat, k in calls:
            mat(xs[rows, k])
        return time.perf_counter() - t

    times: dict[tuple[int, bool], list[float]] = {(r, on): [] for r in (1, MORE_ROWS) for on in (True, False)}
    with torch.inference_mode():
        run(1)  # first touch of the outputs' allocations
        for i in range(ROUNDS):
            for on in (True, False) if i % 2 == 0 else (False, True):
                ext.set_decode_prefetch(on, on)
                for rows in (1, MORE_ROWS):
                    times[rows, on].append(run(rows))
    one = keep_prefetch(times[1, True], times[1, False])
    more = keep_prefetch(times[MORE_ROWS, True], times[MORE_ROWS, False])
    ext.set_decode_prefetch(one, more)

    def ms(rows: int, on: bool) -> str:
        return f"{min(times[rows, on]) * 1e3:.2f}"

    return (
        f"decode prefetch: one row {'on' if one else 'off'}, {MORE_ROWS}+ rows {'on' if more else 'off'} "
        f"(probe over the model's {len(calls)} matrices, best ms with / without: 1 row {ms(1, True)} / "
        f"{ms(1, False)}, {MORE_ROWS} rows {ms(MORE_ROWS, True)} / {ms(MORE_ROWS, False)})"
    )
