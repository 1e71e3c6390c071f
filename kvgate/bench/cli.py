"""`kvgate bench`'s command line: its flags, a sweep of runs over them, and `main`.

`build_parser` holds every flag. `run_bench` resolves the model, builds or loads the prompts,
negotiates the request extras (or, with `--no-warmup`, sets them from the flags), then runs every
concurrency x request-rate pair in order and returns the full result (`meta` + `runs`). `main` prints
the report and writes `--json` / `--plot`; it returns 2 with a one-line error for bad input or an
unreachable server, and 0 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from pathlib import Path

from kvgate.bench.client import Target
from kvgate.bench.report import print_report, write_plots
from kvgate.bench.runner import RunConfig, run_once
from kvgate.bench.summary import parse_slo
from kvgate.bench.workload import build_prompts, load_dataset


def parse_list(text: str, cast) -> list:
    return [cast(x) for x in str(text).split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvgate bench",
        description="Drive an OpenAI-compatible endpoint with streaming requests; report TTFT/TPOT/ITL/E2E, "
        "throughput, goodput and refusals (429/503 with Retry-After).",
    )
    ap.add_argument(
        "--base-url",
        default=os.environ.get("KVGATE_BENCH_URL", "http://127.0.0.1:8000"),
        help="server root or .../v1",
    )
    ap.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    ap.add_argument("--model", default=None, help="model name (default: the first one /v1/models lists)")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--dataset", default=None, help="JSONL: prompt|text|messages, optional output_len")
    ap.add_argument("--input-len", type=int, default=256, help="synthetic prompt length in tokens")
    ap.add_argument(
        "--output-len", type=int, default=128, help="max_tokens (forced with ignore_eos/min_tokens)"
    )
    ap.add_argument(
        "--eos-mode",
        choices=("auto", "ignore_eos", "min_tokens", "none"),
        default="auto",
        help="how to force --output-len tokens: auto probes ignore_eos and min_tokens",
    )
    ap.add_argument(
        "--no-usage", action="store_true", help="don't ask for stream usage (count chunks instead)"
    )
    ap.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument(
        "--num-requests", type=int, default=None, help="per run (default: max(8, 4 x concurrency))"
    )
    ap.add_argument(
        "--max-seconds", type=float, default=None, help="stop sending new requests after this long"
    )
    ap.add_argument(
        "--concurrency",
        default=None,
        help="max in-flight requests; a comma list sweeps (default 1, or unbounded with --request-rate)",
    )
    ap.add_argument("--request-rate", default="inf", help="Poisson arrivals per second; a comma list sweeps")
    ap.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of inter-arrival gaps (1 = Poisson)"
    )
    ap.add_argument("--slo", default=None, help="goodput SLOs, e.g. ttft=2s,tpot=200ms,e2e=30s")
    ap.add_argument("--timeout", type=float, default=900.0, help="per-request timeout in seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-warmup", action="store_true", help="skip the warm-up/negotiation request")
    ap.add_argument(
        "--json", default=None, help="write the full results (summary + per-request records) here"
    )
    ap.add_argument("--save-prompts", default=None, help="write the prompts used as a JSONL dataset")
    ap.add_argument("--plot", default=None, help="write PNG plots into this directory (needs matplotlib)")
    ap.add_argument("--label", default=None, help="name for this target in reports and plots")
    ap.add_argument("--quiet", action="store_true", help="no progress line")
    return ap


async def run_bench(a: argparse.Namespace) -> dict:
    slo = parse_slo(a.slo)
    rates = [float(x) for x in parse_list(a.request_rate, str)]
    concs = (
        parse_list(a.concurrency, float)
        if a.concurrency
        else [math.inf if any(map(math.isfinite, rates)) else 1.0]
    )
    extra_body = json.loads(a.extra_body) if a.extra_body else {}
    if not isinstance(extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")
    target = Target(a.base_url, a.endpoint, a.model, a.api_key, a.timeout)
    try:
        await target.resolve_model()
        runs_n = [
            (c, r, a.num_requests or max(8, int(4 * c) if math.isfinite(c) else 32))
            for c in concs
            for r in rates
        ]
        if a.dataset:
            prompts = load_dataset(a.dataset)
        else:
            prompts = await build_prompts(
                target, max(n for _, _, n in runs_n), a.input_len, a.seed, not a.quiet
            )
        if a.save_prompts:
            with open(a.save_prompts, "w") as f:
                for p in prompts:
                    f.write(json.dumps(p.to_json()) + "\n")
        if a.no_warmup:
            target.extras = dict(extra_body)
            if a.eos_mode in ("ignore_eos", "min_tokens"):
                target.extras[a.eos_mode] = True if a.eos_mode == "ignore_eos" else "$max_tokens"
            if not a.no_usage:
                target.extras["stream_options"] = {"include_usage": True}
            target.eos_mode = a.eos_mode
        else:
            await target.negotiate(a.eos_mode, not a.no_usage, extra_body, a.temperature)
        label = a.label or target.model
        runs = []
        for c, r, n in runs_n:
            cfg = RunConfig(c, r, n, a.max_seconds, a.output_len, a.temperature, a.burstiness, a.seed)
            tag = f"{label} c={'inf' if not math.isfinite(c) else f'{c:g}'}" + (
                f" rate={r:g}" if math.isfinite(r) else ""
            )
            run = await run_once(target, prompts, cfg, slo, tag, not a.quiet)
            runs.append(run)
        return {
            "meta": {
                "tool": "kvgate bench",
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "base_url": target.root,
                "endpoint": a.endpoint,
                "model": target.model,
                "label": label,
                "eos_mode": target.eos_mode,
                "request_extras": {k: v for k, v in target.extras.items()},
                "tokenizer": target.tokenize_kind if not a.dataset else "dataset",
                "input_len": None if a.dataset else a.input_len,
                "dataset": a.dataset,
                "output_len": a.output_len,
                "temperature": a.temperature,
                "slo_ms": slo,
                "argv": getattr(a, "argv", None),
            },
            "runs": runs,
        }
    finally:
        await target.close()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    a = build_parser().parse_args(argv)
    a.argv = argv
    try:
        result = asyncio.run(run_bench(a))
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"kvgate bench: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # httpx connection errors before the first run
        import httpx

        if isinstance(exc, httpx.HTTPError):
            print(f"kvgate bench: error: cannot reach {a.base_url}: {exc}", file=sys.stderr)
            return 2
        raise
    print_report(result)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    if a.plot:
        for p in write_plots(result, a.plot, result["meta"]["label"]):
            print(f"wrote {p}", file=sys.stderr)
    return 0
