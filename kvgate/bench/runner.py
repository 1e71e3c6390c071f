"""One benchmark run: a fixed number of requests at one concurrency and arrival rate.

`run_once` keeps at most `concurrency` requests in flight (unbounded: `math.inf`) and, with a finite
`request_rate`, spaces sends by Poisson (burstiness 1) or gamma-distributed gaps; `max_seconds` stops
new sends. Prompts are reused round-robin. The run's duration is first send -> last completion. It
returns the run's block of the JSON report (settings, `summary`, per-request `records`) and prints a
progress line on stderr unless told not to.
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from dataclasses import dataclass

from kvgate.bench.client import Target
from kvgate.bench.records import Prompt, RequestRecord, record_json
from kvgate.bench.summary import summarize


@dataclass
class RunConfig:
    concurrency: float  # math.inf = unbounded
    request_rate: float  # math.inf = all at once (bounded by concurrency)
    num_requests: int
    max_seconds: float | None
    output_len: int | None
    temperature: float
    burstiness: float = 1.0
    seed: int = 0


class Progress:
    def __init__(self, label: str, total: int, enabled: bool):
        self.label, self.total, self.enabled = label, total, enabled
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self.t_last = 0.0

    def update(self, records: list[RequestRecord], inflight: int, final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not final and now - self.t_last < (0.5 if self.tty else 10.0):
            return
        self.t_last = now
        done = [r for r in records if r.e2e_ms is not None or (r.status and r.status != 200)]
        ok = sum(1 for r in done if r.ok)
        toks = sum(r.output_tokens for r in done if r.ok)
        bad = len(done) - ok
        el = now - self.t0
        line = (
            f"[{self.label}] {len(done)}/{self.total} done ({ok} ok, {bad} not), {inflight} in flight, "
            f"{toks / max(el, 1e-9):.1f} out tok/s, {el:.0f}s"
        )
        if self.tty:
            print("\r" + line.ljust(100), end="\n" if final else "", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)


async def run_once(
    target: Target, prompts: list[Prompt], cfg: RunConfig, slo: dict, label: str, progress: bool = True
) -> dict:
    rng = random.Random(cfg.seed)
    records: list[RequestRecord] = []
    sem = asyncio.Semaphore(int(cfg.concurrency)) if math.isfinite(cfg.concurrency) else None
    inflight = 0
    prog = Progress(label, cfg.num_requests, progress)
    t0 = time.perf_counter()
    tasks = []

    async def one(i: int, p: Prompt) -> None:
        nonlocal inflight
        rec = RequestRecord(index=i, sent_at=0.0)
        records.append(rec)
        inflight += 1
        try:
            out_len = p.output_len if p.output_len is not None else cfg.output_len
            await target.send(rec, p, out_len, cfg.temperature, None, t0)
        finally:
            inflight -= 1
            if sem is not None:
                sem.release()
            prog.update(records, inflight)

    next_arrival = 0.0
    for i in range(cfg.num_requests):
        if cfg.max_seconds is not None and time.perf_counter() - t0 >= cfg.max_seconds:
            break
        if math.isfinite(cfg.request_rate) and i > 0:
            # Poisson arrivals (burstiness 1) or gamma-distributed gaps, mean 1/rate.
            shape = cfg.burstiness
            next_arrival += rng.gammavariate(shape, 1.0 / (cfg.request_rate * shape))
            delay = t0 + next_arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        if sem is not None:
            await sem.acquire()
        if cfg.max_seconds is not None and time.perf_counter() - t0 >= cfg.max_seconds:
            if sem is not None:
                sem.release()
            break
        tasks.append(asyncio.ensure_future(one(i, prompts[i % len(prompts)])))
        prog.update(records, inflight)
    if tasks:
        while not all(t.done() for t in tasks):
            await asyncio.sleep(0.2)
            prog.update(records, inflight)
        await asyncio.gather(*tasks)
    ends = [r.sent_at + (r.e2e_ms or 0) / 1000 for r in records]
    duration = max(ends) if ends else time.perf_counter() - t0
    prog.update(records, inflight, final=True)
    records.sort(key=lambda r: r.index)
    return {
        "label": label,
        "concurrency": cfg.concurrency if math.isfinite(cfg.concurrency) else None,
        "request_rate": cfg.request_rate if math.isfinite(cfg.request_rate) else None,
        "num_requests": cfg.num_requests,
        "output_len": cfg.output_len,
        "summary": summarize(records, duration, slo),
        "records": [record_json(r) for r in records],
    }
