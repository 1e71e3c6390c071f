"""Serve's default router against kvgate's admission-aware router, same replicas, same load.

Two replicas with a small KV budget each, started twice on a local Ray: once behind Serve's default
power-of-two-choices router (each request goes to the less busy of two random replicas, as `kvgate
serve` replicas behind a plain Serve deployment would), once behind kvgate's router
(`kvgate.cluster.routing`). The same mixed workload is sent through `kvgate bench` at a fixed
concurrency: mostly short requests (2 blocks, 16 steps) and some long ones that hold a large share
of a replica's blocks for 200 steps. A replica holding long requests has *fewer* requests in flight
and *less* room, which is the one the default router prefers. The report puts refusals (429/503),
TTFT p50/p99 and throughput side by side, with the ratios.

By default a request may wait one second for room (`--max-queue-wait 1`): in the chosen replica's
FIFO under the default router, in the ingress's queue under kvgate's. With `--max-queue-wait 0` the
engines refuse at once what does not fit, so every 429 is a request sent where there was no room (and
the refused requests drop out of the TTFT percentiles, which flatters the router that refuses more).

    .venv/bin/python -m bench.cluster_routing [--concurrency 32] [--num-requests 192] [--model tiny]
                                              [--kv-blocks 120] [--max-queue-wait 1] [--json PATH]

`--model tiny` (default) is the test suite's random two-layer model with `--step-delay` seconds added
to every engine step (the replicas' test-only knob), so a step costs what a real model's does
without the 2-core machine spending its CPUs on matmuls; `--model default` runs SmolLM2-135M.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

ROUTERS = ("pow2", "kvgate")
NAMES = {"pow2": "Serve default (P2C)", "kvgate": "kvgate admission-aware"}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def shape(text: str) -> tuple[int, int]:
    p, o = text.split(":")
    return int(p), int(o)


def workload(path: Path, n: int, seed: int, long_share: float, long: str, short: str) -> dict:
    """A JSONL dataset of short and long requests (prompt:output tokens each), shuffled with a fixed
    seed. " a" is one token in both tokenizers used here."""
    rng = random.Random(seed)
    rows, n_long = [], 0
    for _ in range(n):
        is_long = rng.random() < long_share
        n_long += is_long
        p, o = shape(long) if is_long else shape(short)
        rows.append({"prompt": "a" + " a" * (p - 1), "prompt_tokens": p, "output_len": o})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"requests": n, "long": n_long, "short": n - n_long}


def run_router(router: str, a, model: str, dataset: Path) -> dict:
    from bench.compare import free_port
    from kvgate.bench import build_parser, run_bench
    from kvgate.cluster.app import ClusterOptions
    from kvgate.cluster.cli import launch, shutdown

    bpt = 256 if a.model == "tiny" else 23_040  # KV bytes per token in the default float16 cache (CPU)
    engine = dict(
        kv_cache_bytes=a.kv_blocks * 16 * bpt,
        block_size=16,
        max_seqs=a.max_seqs,
        max_queue_wait=a.max_queue_wait,
        dtype="float32",
        device="cpu",
        memory_limit="2GiB",
        threads=1,
    )
    opts = ClusterOptions(
        model=model,
        replicas=2,
        engine=engine,
        replica_cpus=0.5,
        ingress_cpus=0.5,
        router=router,
        stats_period=0.25,
        health_period=2.0,
        served_model_name="bench",
        step_delay=a.step_delay if a.model == "tiny" else 0.0,
    )
    port = free_port()
    started = launch(opts, "127.0.0.1", port, num_cpus=2, quiet=True)
    print(f"[{router}] cluster up in {started:.1f}s", file=sys.stderr, flush=True)
    try:
        argv = [
            "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "completions", "--dataset", str(dataset),
            "--concurrency", str(a.concurrency), "--num-requests", str(a.num_requests),
            "--eos-mode", "ignore_eos", "--seed", str(a.seed), "--label", router, "--quiet",
        ]  # fmt: skip
        result = asyncio.run(run_bench(build_parser().parse_args(argv)))
        routes = route_counts(f"http://127.0.0.1:{port}")
    finally:
        shutdown(local=True)
    return {"startup_s": started, "summary": result["runs"][0]["summary"], "routes": routes}


def route_counts(base: str) -> dict:
    """The ingress's `kvgate_cluster_route_attempts_total{outcome}`: how the requests were placed."""
    import httpx

    out = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvgate_cluster_route_attempts_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = int(float(line.rsplit(" ", 1)[1]))
    return out


def table(results: dict) -> str:
    def row(label, fn, fmt="{:>12}"):
        return f"{label:<28}" + "".join(fmt.format(fn(results[r]["summary"])) for r in ROUTERS)

    def ms(x):
        return "-" if x is None else f"{x:,.0f} ms"

    counts = lambda s, k: s["status_counts"].get(k, 0)  # noqa: E731
    lines = [
        f"{'':<28}" + "".join(f"{r:>12}" for r in ROUTERS),
        row("requests", lambda s: s["requests"]),
        row("200 admitted", lambda s: counts(s, "200")),
        row("429 (shed, come back)", lambda s: counts(s, "429")),
        row("503 (shed, unavailable)", lambda s: counts(s, "503")),
        row("TTFT p50", lambda s: ms(s["ttft_ms"]["p50"])),
        row("TTFT p99", lambda s: ms(s["ttft_ms"]["p99"])),
        row("output tokens/s", lambda s: f"{s['output_throughput']:.1f}"),
        row("completed requests/s", lambda s: f"{s['request_throughput']:.2f}"),
    ]
    return "\n".join(lines)


def ratios(results: dict) -> str:
    p, k = results["pow2"]["summary"], results["kvgate"]["summary"]
    shed = lambda s: s["status_counts"].get("429", 0) + s["status_counts"].get("503", 0)  # noqa: E731
    t_p, t_k = p["ttft_ms"]["p99"], k["ttft_ms"]["p99"]
    out = [f"shed requests: {shed(k)} (kvgate) vs {shed(p)} (Serve default)"]
    if t_p and t_k:
        out.append(f"TTFT p99: kvgate / Serve default = {t_k / t_p:.2f}")
    out.append(
        f"output throughput: kvgate / Serve default = {k['output_throughput'] / p['output_throughput']:.2f}"
    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cluster_routing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny | default | PATH")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=192)
    ap.add_argument("--kv-blocks", type=int, default=120, help="KV blocks (of 16 tokens) per replica")
    ap.add_argument("--max-seqs", type=int, default=16)
    ap.add_argument("--max-queue-wait", type=float, default=1.0, help="the engines' (0: refuse at once)")
    ap.add_argument("--long-share", type=float, default=0.1)
    ap.add_argument("--long", default="300:200", help="prompt:output tokens of a long request (32 blocks)")
    ap.add_argument("--short", default="8:16", help="prompt:output tokens of a short request (2 blocks)")
    ap.add_argument("--step-delay", type=float, default=0.02, help="seconds added per step (tiny model only)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="kvgate-cluster-bench-"))
    model = a.model
    if a.model == "tiny":
        from tests.tiny_model import make_tiny_hf_dir

        model = str(make_tiny_hf_dir(tmp / "tiny"))
    mix = workload(tmp / "mix.jsonl", a.num_requests, a.seed, a.long_share, a.long, a.short)
    t0 = time.monotonic()
    results = {r: run_router(r, a, model, tmp / "mix.jsonl") for r in ROUTERS}
    print(
        f"\nkvgate cluster routing: 2 replicas x {a.kv_blocks} KV blocks, max_seqs {a.max_seqs}, "
        f"max_queue_wait {a.max_queue_wait:g}s, model {a.model}"
        + (f" (+{a.step_delay * 1000:.0f} ms/step)" if a.model == "tiny" else "")
        + f"; {mix['requests']} requests ({mix['long']} long {a.long}, {mix['short']} short {a.short}) at "
        f"concurrency "
        f"{a.concurrency}; {cpu_model()}, {time.monotonic() - t0:.0f}s in all\n"
    )
    print(table(results))
    print()
    print(ratios(results))
    for r in ROUTERS:
        print(f"ingress route attempts ({r}): {results[r]['routes']}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "mix": mix, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
