"""Where a decode step's time goes: matmuls, attention, K/V gathers, small ops, Python, sampling.

    python -m bench.profile_step [--rows 1 4 16] [--context 300] [--dtype float32] [--weights full] [--steps 20]
        [--decode-attention auto | paged | gather] [--model default | PATH] [--device auto | cpu | cuda]

Builds the real engine (no server), puts `rows` requests in decode at `context` positions, then times
`--steps` engine steps on the worker's own code path (`EngineCore.tick`), once plainly (wall time per
step) and once under torch.profiler (time per op family). "python and glue" is the step's wall time
minus everything the profiler attributes to ops and to sampling. Prints a markdown table with the CPU
model and flags; docs/DESIGN_NOTES.md quotes it. The profiler does not see kvgate's pybind kernels
(block matmuls, layer ops): their time lands in "python and glue"; bench/step_split.py times them.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict

import torch

FAMILIES = [
    ("matmul", ("mkldnn", "linear", "addmm", "mm", "matmul", "_linear_pointwise")),
    (
        "attention",
        (
            "scaled_dot_product",
            "paged_decode_attention",
            "flash_attention",
            "_efficient_attention",
            "softmax",
            "bmm",
        ),
    ),
    ("K/V gather + write", ("index_select", "index_copy", "index")),
    ("norm, rope, silu, adds", ("rms_norm", "mul", "add", "silu", "cat", "neg", "sub", "copy_", "embedding")),
]


def family(name: str) -> str:
    n = name.lower()
    for fam, keys in FAMILIES:
        if any(k in n for k in keys):
            return fam
    return "other ops"


def setup(
    rows: int,
    context: int,
    dtype: str,
    weights: str = "full",
    q8_head: str = "auto",
    attention: str = "auto",
    kv_dtype: str = "auto",
    temperature: float = 0.7,
    model: str = "default",
    device: str = "auto",
    cuda_graphs: str = "auto",
):
    """An engine with `rows` requests all decoding at `context` (top-p 0.9 at `temperature`; 0 is greedy,
    what bench.compare sends)."""
    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine
    from kvgate.request import GenerationRequest, RequestHandle
    from kvgate.sampling import SamplingParams

    e = Engine.from_model(
        model,
        EngineConfig(
            device=device,
            dtype=dtype,
            memory_limit="4GiB",
            max_seqs=max(rows, 1),
            weights=weights,
            q8_head=q8_head,
            decode_attention=attention,
            kv_dtype=kv_dtype,
            cuda_graphs=cuda_graphs,
        ),
    )
    core = e.core
    for i in range(rows):
        prompt = [100 + (i * 13 + k) % 40000 for k in range(context)]
        req = GenerationRequest(
            prompt, SamplingParams(temperature=temperature, top_p=0.9, seed=i), 2048, ignore_eos=True
        )
        e.gate.submit(RequestHandle(req, lambda rid: None))  # driven below without a worker thread
    # submissions reach the core's state through the inbox on its next tick: run until every row is
    # in decode (checking `state` before the first tick would time prefill steps as decode ones)
    while len(core.state.running) < rows or any(r.prefilling for r in core.state.running.values()):
        core.tick(e.inbox.take(0))
    return e


def profile(
    rows: int,
    context: int,
    dtype: str,
    steps: int,
    weights: str = "full",
    q8_head: str = "auto",
    attention: str = "auto",
    model: str = "default",
    device: str = "auto",
) -> dict:
    e = setup(rows, context, dtype, weights, q8_head, attention, model=model, device=device)
    core, inbox = e.core, e.inbox
    for _ in range(3):
        core.tick(inbox.take(0))
    t0 = time.perf_counter()
    for _ in range(steps):
        core.tick(inbox.take(0))
    wall = (time.perf_counter() - t0) / steps
    runner = core.runner
    sample_time = [0.0]
    import kvgate.core.runner as runner_mod

    real_sample = runner_mod.sample_batch

    def timed_sample(*a, **k):
        t = time.perf_counter()
        try:
            return real_sample(*a, **k)
        finally:
            sample_time[0] += time.perf_counter() - t

    runner_mod.sample_batch = timed_sample
    by_family: dict[str, float] = defaultdict(float)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            core.tick(inbox.take(0))
        prof_wall = (time.perf_counter() - t0) / steps
    runner_mod.sample_batch = real_sample
    op_calls = 0
    for ev in prof.key_averages():
        if "::" in ev.key and ev.self_cpu_time_total > 0:  # aten:: and mkldnn:: ops (not Python scopes)
            by_family[family(ev.key)] += ev.self_cpu_time_total / 1e6 / steps
            op_calls += ev.count
    sampling = sample_time[0] / steps
    ops = sum(by_family.values())
    del runner
    e.shutdown()
    return {
        "rows": rows,
        "step_ms": wall * 1000,
        "profiled_step_ms": prof_wall * 1000,
        "families_ms": {k: v * 1000 for k, v in sorted(by_family.items(), key=lambda x: -x[1])},
        "sampling_ms_incl_ops": sampling * 1000,
        "python_and_glue_ms": max(0.0, prof_wall - ops) * 1000,
        "op_calls_per_step": op_calls / steps,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--weights", default="full", help="full | int8 | int4 | gguf")
    ap.add_argument("--q8-head", default="auto", help="auto | on | off")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--decode-attention", default="auto", help="auto | paged | gather")
    ap.add_argument("--model", default="default", help="default (SmolLM2) | PATH")
    ap.add_argument(
        "--device", default="auto", help="auto | cpu | cuda (on CUDA the ops' times are their launches)"
    )
    a = ap.parse_args(argv)
    from bench.compare import machine_info

    m = machine_info()
    fams = [f for f, _ in FAMILIES] + ["other ops"]
    print(
        f"CPU: {m['model_name']}, {m['cpus']} cores, flags {' '.join(m['flags_present'])}; load at start "
        f"{m['loadavg_at_start'][0]:.1f}; {a.dtype}, weights {a.weights}, --q8-head {a.q8_head}, "
        f"decode attention {a.decode_attention}, decode at context {a.context}, torch threads {torch.get_num_threads()}"
        + (f"; GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() and a.device != "cpu" else "")
    )
    print()
    print(
        "| rows | step (ms) | tok/s | "
        + " | ".join(fams)
        + " | python and glue | sampling (of which ops) | op calls |"
    )
    print("|---" * (len(fams) + 6) + "|", flush=True)
    for rows in a.rows:  # each row of the table as soon as it is measured
        t0 = time.perf_counter()
        r = profile(
            rows, a.context, a.dtype, a.steps, a.weights, a.q8_head, a.decode_attention, a.model, a.device
        )
        f = r["families_ms"]
        cells = [f"{f.get(k, 0.0):.1f}" for k in fams]
        print(
            f"| {r['rows']} | {r['step_ms']:.1f} | {r['rows'] * 1000 / r['step_ms']:.1f} | "
            + " | ".join(cells)
            + f" | {r['python_and_glue_ms']:.1f} | {r['sampling_ms_incl_ops']:.1f} | {r['op_calls_per_step']:.0f} |",
            flush=True,
        )
        print(
            f"<!-- {rows} rows: {time.perf_counter() - t0:.1f} s with setup -->", file=sys.stderr, flush=True
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
