"""Where a decode step's wall time goes, kernel by kernel, without a profiler.

    python -m bench.step_split [--rows 1 16] [--weights gguf] [--context 300] [--steps 30]

torch.profiler does not see kvgate's pybind kernels (the block matmuls, the layer ops), so
bench/profile_step.py books them under "python and glue". This script instead wraps each call site
with a wall clock for `--steps` decode steps of the real engine (the worker's own `EngineCore.tick`,
top-p sampling, every row decoding at `--context`): the Q4_1 layer matmuls, the Q8_0 head, paged
attention, the C++ layer ops, sampling, the whole forward and the whole tick. What the forward spends
outside the wrapped calls (ATen ops such as SiLU * up, the embedding lookup, Python) and what the tick
spends outside forward and sampling (scheduling, building the step's inputs, events) are the
remainders. The wrappers cost ~1 us a call: a few hundred per step at one row.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

from bench.cpu import cpu_line, machine_info
from bench.profile_step import setup


def timed(acc: dict, name: str, fn):
    def call(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[name] += time.perf_counter() - t

    return call


class TimedOps:
    """The model's layer ops with each call timed (the model calls them through this object)."""

    def __init__(self, ops, acc: dict):
        self.rms_norm = timed(acc, "layer ops", ops.rms_norm)
        self.add_rms_norm_ = timed(acc, "layer ops", ops.add_rms_norm_)
        self.rope_write_kv_ = timed(acc, "layer ops", ops.rope_write_kv_)
        self.silu_mul = timed(acc, "layer ops", ops.silu_mul)


def split(
    rows: int, weights: str, context: int, steps: int, kv_dtype: str = "auto", temperature: float = 0.7
) -> dict:
    import kvgate.core.runner as runner_mod
    import kvgate.models.llama as llama_mod
    from kvgate.models.q4_1 import Q41Linear
    from kvgate.models.q4_1_dot8 import Q41Dot8Linear
    from kvgate.models.q8_head import Q8DotTable, Q8Table

    acc: dict[str, float] = defaultdict(float)
    e = setup(rows, context, "float32", weights, kv_dtype=kv_dtype, temperature=temperature)
    saved = (Q41Linear.__call__, Q8Table.__call__, llama_mod.paged_kernel, runner_mod.sample_batch)
    saved_q8act = (Q41Dot8Linear.__call__, Q8DotTable.__call__)  # --weights gguf-q8act's kernels
    try:
        Q41Linear.__call__ = timed(acc, "Q4_1 matmuls", saved[0])
        Q8Table.__call__ = timed(acc, "Q8_0 head", saved[1])
        Q41Dot8Linear.__call__ = timed(acc, "Q4_1 matmuls", saved_q8act[0])
        Q8DotTable.__call__ = timed(acc, "Q8_0 head", saved_q8act[1])
        op = saved[2]()
        if op is not None:
            llama_mod.paged_kernel = lambda: timed(acc, "paged attention", op)
        runner_mod.sample_batch = timed(acc, "sampling", saved[3])
        if e.model.layer_ops is not None:
            e.model.layer_ops = TimedOps(e.model.layer_ops, acc)
        e.core.runner.model_forward = timed(acc, "forward", e.core.runner.model_forward)
        core, inbox = e.core, e.inbox
        for _ in range(3):
            core.tick(inbox.take(0))
        acc.clear()
        t0 = time.perf_counter()
        for _ in range(steps):
            core.tick(inbox.take(0))
        tick = time.perf_counter() - t0
    finally:
        Q41Linear.__call__, Q8Table.__call__, llama_mod.paged_kernel, runner_mod.sample_batch = saved
        Q41Dot8Linear.__call__, Q8DotTable.__call__ = saved_q8act
        e.shutdown()
    ms = {k: v / steps * 1e3 for k, v in acc.items()}
    kernels = sum(v for k, v in ms.items() if k not in ("forward", "sampling"))
    ms["rest of the forward"] = ms.get("forward", 0.0) - kernels
    ms["rest of the tick"] = tick / steps * 1e3 - ms.get("forward", 0.0) - ms.get("sampling", 0.0)
    return {"rows": rows, "tick_ms": tick / steps * 1e3, "ms": ms}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--weights", default="gguf", help="full | int8 | int4 | gguf | gguf-q8act")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--kv-dtype", default="auto", help="auto | float32 | float16 | bfloat16")
    ap.add_argument("--temperature", type=float, default=0.7, help="0: greedy, as bench.compare sends")
    a = ap.parse_args(argv)
    m = machine_info()
    results = [split(r, a.weights, a.context, a.steps, a.kv_dtype, a.temperature) for r in a.rows]
    names = [
        "Q4_1 matmuls",
        "Q8_0 head",
        "paged attention",
        "layer ops",
        "rest of the forward",
        "sampling",
        "rest of the tick",
    ]
    print(
        f"{cpu_line(m)} Load at start {m['loadavg_at_start'][0]:.1f}; weights {a.weights}, decode at context "
        f"{a.context}, "
        + ("greedy" if a.temperature == 0 else f"top-p 0.9 at temperature {a.temperature}")
        + ", wall ms per step"
    )
    print()
    print("| rows | step | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 2) + "|")
    for r in results:
        cells = [f"{r['ms'].get(n, 0.0):.2f}" for n in names]
        print(f"| {r['rows']} | {r['tick_ms']:.2f} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
