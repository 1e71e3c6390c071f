"""Retry herd: many clients that follow a TTFT 429's Retry-After, and how often following it pays.

    python -m bench.retry_herd                          # SmolLM2, --max-seqs 2 --max-ttft 1.5, 12 clients, 60 s
    python -m bench.retry_herd --clients 24 --seconds 90 --json herd.json
    python -m bench.retry_herd --base-url http://127.0.0.1:8000   # a server you started

Each client loops for --seconds: a streaming /v1/completions of a random prompt (20-300 words) and
max_tokens (100-400, ignore_eos). On a 429 it sleeps the wait it was given, in full, as the openai
SDK does (retry-after-ms when sent, else Retry-After), and sends the same request again, up to --max-attempts. Reported: how many first
retries were admitted (the number Retry-After promises something about), attempts per admitted
request, the Retry-After values handed out, and the admitted requests' TTFT against the budget.
Every loop is bounded by time and attempts; the server listens on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from bench.servers import ROOT, Server, free_port, log
from kvgate.bench.workload import WORDS

PREFER_MS = True  # --seconds-only: a client that reads only Retry-After's whole seconds


def one_attempt(client: httpx.Client, base: str, body: dict) -> tuple[int, float | None, float]:
    """(status, TTFT in seconds or None, Retry-After seconds or 0) of one streamed request."""
    t0 = time.monotonic()
    with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            ms = r.headers.get("retry-after-ms") if PREFER_MS else None  # as the openai SDK reads them
            return (
                r.status_code,
                None,
                float(ms) / 1000 if ms else float(r.headers.get("retry-after", 0) or 0),
            )
        ttft = None
        for line in r.iter_lines():
            if ttft is None and line.startswith("data: {"):
                ttft = time.monotonic() - t0
        return 200, ttft, 0.0


def client_loop(
    seed: int, base: str, until: float, max_attempts: int, out: list, lock: threading.Lock
) -> None:
    rng = random.Random(seed)
    with httpx.Client(timeout=120) as client:
        while time.monotonic() < until:
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 300)))
            body = {"prompt": words, "max_tokens": rng.randint(100, 400), "stream": True, "ignore_eos": True}
            record = {"attempts": [], "ttft": None}
            for _ in range(max_attempts):
                status, ttft, retry = one_attempt(client, base, body)
                record["attempts"].append({"status": status, "retry_after": retry})
                if status != 429:
                    record["ttft"] = ttft
                    break
                if time.monotonic() + retry >= until:  # told to come back after the run: this client is done
                    with lock:
                        out.append(record)
                    return
                time.sleep(retry)
            with lock:
                out.append(record)


def summarize(records: list[dict], budget: float | None) -> dict:
    refused_first = [r for r in records if r["attempts"][0]["status"] == 429]
    retried = [r for r in refused_first if len(r["attempts"]) > 1]
    first_retry_ok = sum(r["attempts"][1]["status"] == 200 for r in retried)
    done = [r for r in records if r["attempts"][-1]["status"] == 200]
    ttfts = sorted(r["ttft"] for r in done if r["ttft"] is not None)
    retry_values = Counter(
        math.ceil(a["retry_after"]) for r in records for a in r["attempts"] if a["status"] == 429
    )
    over = sum(t > budget for t in ttfts) if budget else None
    return {
        "requests": len(records),
        "admitted": len(done),
        "refused_first": len(refused_first),
        "first_retries": len(retried),
        "first_retry_admitted": first_retry_ok,
        "first_retry_rate": first_retry_ok / len(retried) if retried else None,
        "attempts_per_admitted": statistics.mean(len(r["attempts"]) for r in done) if done else None,
        "retry_after_values": dict(sorted(retry_values.items())),
        "statuses": dict(Counter(a["status"] for r in records for a in r["attempts"])),
        "ttft_p50": statistics.median(ttfts) if ttfts else None,
        "ttft_max": ttfts[-1] if ttfts else None,
        "ttft_over_budget": over,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="a running server; else one is started with --serve-args")
    p.add_argument("--serve-args", default="--max-seqs 2 --max-ttft 1.5", help="flags for kvgate serve")
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--max-attempts", type=int, default=8)
    p.add_argument("--budget", type=float, default=1.5, help="the server's --max-ttft, for the report")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seconds-only", action="store_true", help="ignore retry-after-ms")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    global PREFER_MS
    PREFER_MS = not args.seconds_only
    server = None
    base = args.base_url
    if base is None:
        port = free_port()
        cmd = [str(ROOT / ".venv/bin/kvgate"), "serve", "--port", str(port), "--log-level", "warning"]
        server = Server(
            "kvgate",
            cmd + args.serve_args.split(),
            f"http://127.0.0.1:{port}/health",
            ROOT / "bench/out/retry_herd/server.log",
        ).start()
        base = f"http://127.0.0.1:{port}"
    records: list[dict] = []
    lock = threading.Lock()
    until = time.monotonic() + args.seconds
    threads = [
        threading.Thread(
            target=client_loop, args=(args.seed + i, base, until, args.max_attempts, records, lock)
        )
        for i in range(args.clients)
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        if server is not None:
            server.stop()
    report = summarize(records, args.budget)
    log(json.dumps(report), "retry_herd")
    if args.json:
        args.json.write_text(json.dumps({"report": report, "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
