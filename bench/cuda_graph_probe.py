"""What the CUDA decode graphs do to a decode step: the same engine step with `--cuda-graphs on` and off.

    python -m bench.cuda_graph_probe --model PATH [--rows 1 16 64] [--context 300] [--reps 50]

Builds the real engine on the GPU (bf16, gather attention: the CUDA path) twice, graphs on and off, puts
`rows` requests in decode at `context`, and times the engine step (`core.tick`), split into its forward
(to the logits on the device, synchronized), its sampling (top-p 0.9 at temperature 0.7; `--greedy`
for argmax) and the rest (scheduling, inputs, the logits' copy to the host, the update). With
`--profile` it also prints the Python functions that take the graph step's time at the first row count
(cProfile, cumulative). On a CPU, `--cuda-graphs on` is refused, so only the off rows print.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch

from bench.profile_step import setup
from bench.step_split import timed as timed_calls  # a call wrapper that adds its time to a dict


def timed(fn, reps: int, sync) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps * 1000


def split_step(core, inbox, runner, reps: int, sync) -> dict:
    """The engine step's wall time, and its forward (to the logits on the device) and sampling parts."""
    import kvgate.core.runner as runner_mod

    real_forward, real_sample = runner.model_forward, runner_mod.sample_batch
    spent = {"forward": 0.0, "sampling": 0.0}

    def forward(batch):
        logits = real_forward(batch)
        sync()
        return logits

    forward, sample = timed_calls(spent, "forward", forward), timed_calls(spent, "sampling", real_sample)
    runner.model_forward, runner_mod.sample_batch = forward, sample
    try:
        step = timed(lambda: core.tick(inbox.take(0)), reps, sync)
    finally:
        runner.model_forward, runner_mod.sample_batch = real_forward, real_sample
    f, smp = spent["forward"] / reps * 1000, spent["sampling"] / reps * 1000
    return {"step_ms": step, "forward_ms": f, "sampling_ms": smp, "rest_ms": step - f - smp}


def measure(rows: int, a, graphs: str, profile: bool) -> dict:
    cuda = a.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    temp = 0.0 if a.greedy else 0.7
    e = setup(rows, a.context, "bfloat16", "full", "off", "gather", "auto", temp, a.model, a.device, graphs)
    try:
        core, inbox = e.core, e.inbox
        for _ in range(5):  # first steps at a shape pick their kernels
            core.tick(inbox.take(0))
        g = e.runner.graphs
        before = g.replays if g is not None else 0
        out = {"rows": rows, "graphs": graphs, **split_step(core, inbox, e.runner, a.reps, sync)}
        out["replayed"] = (g.replays - before) if g is not None else 0
        out["note"] = e.graphs_note
        if profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.reps):
                core.tick(inbox.take(0))
            sync()
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(30)
            out["profile"] = text.getvalue()
        return out
    finally:
        e.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args(argv)
    cuda = a.device.startswith("cuda")
    gpu = torch.cuda.get_device_name() if cuda else "none"
    print(f"device {a.device} ({gpu}), torch {torch.__version__}, bf16, context {a.context}")
    print("| rows | graphs | engine step (ms) | its forward | its sampling | the rest | steps replayed |")
    print("|---|---|---|---|---|---|---|", flush=True)
    notes, profiles = set(), []
    for rows in a.rows:
        for graphs in ("on", "off") if cuda else ("off",):
            r = measure(rows, a, graphs, a.profile and rows == a.rows[0] and graphs == "on")
            notes.add(r["note"])
            if "profile" in r:
                profiles.append(r["profile"])
            print(
                f"| {rows} | {graphs} | {r['step_ms']:.2f} | {r['forward_ms']:.2f} | {r['sampling_ms']:.2f} "
                f"| {r['rest_ms']:.2f} | {r['replayed']}/{a.reps} |",
                flush=True,
            )
    for n in sorted(notes):
        print("graphs:", n)
    for p in profiles:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
