"""What a CUDA graph would make of a decode step: the same step's forward run eagerly and replayed
from one captured graph, and the whole engine step (inputs, forward, logits to the host, sampling).

    python -m bench.cuda_graph_probe --model PATH [--rows 1 16 64] [--context 300] [--reps 50]

Builds the real engine on the GPU (bf16, gather attention: the CUDA path), puts `rows` requests in
decode at `context`, takes one decode step's `StepBatch` and times `model.forward` on it eagerly and as
a graph replay (checking the replay's logits against the eager ones). The engine step is split into its
forward (synchronized), its sampling (top-p 0.9 at temperature 0.7) and the rest. A measurement for
planning, not a serving path: kvgate does not capture graphs yet. On a CPU it reports the eager times.
"""

from __future__ import annotations

import argparse
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
    """The engine step's wall time, and its forward (to the logits on the host) and sampling parts."""
    import kvgate.core.runner as runner_mod

    real_forward, real_sample = runner.model_forward, runner_mod.sample_batch
    spent = {"forward": 0.0, "sampling": 0.0}

    def forward(batch):  # to the logits on the device, synchronized
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
    return {"step_ms": step, "in_step_forward_ms": f, "sampling_ms": smp, "rest_ms": step - f - smp}


def measure(rows: int, context: int, model: str, device: str, reps: int) -> dict:
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    e = setup(rows, context, "bfloat16", "full", "off", "gather", model=model, device=device)
    try:
        return _measure(e, rows, cuda, sync, reps)
    finally:
        e.shutdown()


def _measure(e, rows: int, cuda: bool, sync, reps: int) -> dict:
    core, inbox, runner = e.core, e.inbox, e.core.runner
    real, seen = runner.model_forward, {}
    for _ in range(5):  # first steps at a shape pick their kernels
        core.tick(inbox.take(0))
    out = {"rows": rows, **split_step(core, inbox, runner, reps, sync)}

    def grab(batch):
        seen["batch"] = batch
        return real(batch)

    runner.model_forward = grab
    core.tick(inbox.take(0))
    runner.model_forward = real
    batch = seen["batch"]
    with torch.inference_mode():
        ref = real(batch)
        out["forward_ms"] = timed(lambda: real(batch), reps, sync)
        if cuda:
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(3):
                        real(batch)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    logits = real(batch)
                graph.replay()
                sync()
                out["replay_max_diff"] = (logits - ref).abs().max().item()
                out["replay_ms"] = timed(graph.replay, reps, sync)
            except Exception as exc:  # the probe reports what broke the capture
                out["capture_error"] = f"{type(exc).__name__}: {exc}"[:400]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args(argv)
    gpu = torch.cuda.get_device_name() if a.device.startswith("cuda") else "none"
    print(f"device {a.device} ({gpu}), torch {torch.__version__}, bf16, context {a.context}")
    print(
        "| rows | engine step (ms) | its forward | its sampling | the rest | forward eager (ms) "
        "| forward graph replay (ms) | replay vs eager |"
    )
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for rows in a.rows:
        r = measure(rows, a.context, a.model, a.device, a.reps)
        replay = f"{r['replay_ms']:.2f}" if "replay_ms" in r else r.get("capture_error", "-")
        diff = f"{r['replay_max_diff']:.1e}" if "replay_max_diff" in r else "-"
        print(
            f"| {rows} | {r['step_ms']:.2f} | {r['in_step_forward_ms']:.2f} | {r['sampling_ms']:.2f} "
            f"| {r['rest_ms']:.2f} | {r['forward_ms']:.2f} | {replay} | {diff} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
