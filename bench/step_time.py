"""Plain wall time of engine steps, no profiler: decode steps at each row count and one prefill chunk.

    python -m bench.step_time [--rows 1 4 16] [--weights full] [--steps 20] [--prefill 256]
        [--prefill-attention auto | kernel | sdpa]

Prints one JSON line per measurement (`{"weights", "rows" or "prefill", "step_ms", ...}`), so runs of
two checkouts can be interleaved and their medians compared (bench/profile_step.py gives the split by
op family; this is the cheaper number to repeat on a shared, noisy machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.profile_step import setup


def decode_ms(
    rows: int,
    weights: str,
    steps: int,
    context: int = 300,
    kv_dtype: str = "auto",
    model: str = "default",
    dtype: str = "float32",
) -> tuple[list[float], list[float]]:
    """Wall and process CPU ms of `steps` decode steps (CPU time: less hurt by other processes)."""
    e = setup(rows, context, dtype, weights, kv_dtype=kv_dtype, model=model)
    core, inbox = e.core, e.inbox
    try:
        for _ in range(3):
            core.tick(inbox.take(0))
        out, cpu = [], []
        for _ in range(steps):
            t0, c0 = time.perf_counter(), time.process_time()
            core.tick(inbox.take(0))
            out.append((time.perf_counter() - t0) * 1000)
            cpu.append((time.process_time() - c0) * 1000)
        return out, cpu
    finally:
        e.shutdown()


def prefill_ms(
    tokens: int,
    weights: str,
    reps: int = 3,
    kv_dtype: str = "auto",
    attention: str = "auto",
    model: str = "default",
    dtype: str = "float32",
) -> tuple[list[float], list[float]]:
    """The step that prefills one `tokens`-long prompt (distinct prompts: no prefix-cache hits)."""
    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine
    from kvgate.request import GenerationRequest, RequestHandle
    from kvgate.sampling import SamplingParams

    cfg = EngineConfig(
        dtype=dtype,
        memory_limit="4GiB",
        max_seqs=1,
        weights=weights,
        prefill_chunk=tokens,
        kv_dtype=kv_dtype,
        prefill_attention=attention,
    )
    e = Engine.from_model(model, cfg)
    core, out, cpu = e.core, [], []
    try:
        for r in range(reps + 1):
            prompt = [100 + (r * 7919 + k * 13) % 40000 for k in range(tokens)]
            req = GenerationRequest(prompt, SamplingParams(temperature=0.0), 1, ignore_eos=True)
            e.gate.submit(RequestHandle(req, lambda rid: None))
            t0, c0 = time.perf_counter(), time.process_time()
            core.tick(e.inbox.take(0))
            if r:  # the first one warms up
                out.append((time.perf_counter() - t0) * 1000)
                cpu.append((time.process_time() - c0) * 1000)
            while core.state.running:
                core.tick(e.inbox.take(0))
        return out, cpu
    finally:
        e.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 4, 16])
    ap.add_argument("--weights", default="full", help="full | int8 | int4 | gguf | gguf-q8act")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prefill", type=int, default=256, help="prompt tokens of the prefill step (0: skip)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--kv-dtype", default="auto", help="auto | float32 | float16 | bfloat16")
    ap.add_argument("--prefill-attention", default="auto", help="auto | kernel | sdpa (the prefill step's)")
    ap.add_argument(
        "--dtype",
        default="float32",
        help="the model dtype (--dtype auto picks bfloat16 for full on bf16 CPUs)",
    )
    ap.add_argument(
        "--model", default="default", help="a .gguf file or HF directory (bench.kquant_model writes k-quants)"
    )
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    for rows in a.rows:
        ms, cpu = decode_ms(rows, a.weights, a.steps, kv_dtype=a.kv_dtype, model=a.model, dtype=a.dtype)
        med = statistics.median(ms)
        print(
            json.dumps(
                {
                    "weights": a.weights,
                    "kv_dtype": a.kv_dtype,
                    "rows": rows,
                    "step_ms": round(med, 2),
                    "min_ms": round(min(ms), 2),
                    "cpu_ms": round(statistics.median(cpu), 2),
                    "tok_s": round(rows * 1000 / med, 1),
                }
            ),
            flush=True,
        )
    if a.prefill:
        ms, cpu = prefill_ms(
            a.prefill,
            a.weights,
            kv_dtype=a.kv_dtype,
            attention=a.prefill_attention,
            model=a.model,
            dtype=a.dtype,
        )
        print(
            json.dumps(
                {
                    "weights": a.weights,
                    "kv_dtype": a.kv_dtype,
                    "prefill": a.prefill,
                    "prefill_attention": a.prefill_attention,
                    "step_ms": round(statistics.median(ms), 2),
                    "min_ms": round(min(ms), 2),
                    "cpu_ms": round(statistics.median(cpu), 2),
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
