"""Request records -> the report's summary block: percentiles, throughput, goodput, refusal counts.

Percentiles are linear-interpolated (numpy's default). TPOT is per request,
(E2E - TTFT) / (output tokens - 1); ITL statistics pool every gap of every completed request.
Throughput divides the tokens of completed requests by the run's wall time. Goodput counts completed
requests that meet every SLO (`parse_slo`: `ttft=2s,tpot=200ms`, values in milliseconds) per second.
Status counts sort every request into 200/400/429/503/other and note whether each 429/503 carried
Retry-After. Pure functions: no I/O.
"""

from __future__ import annotations

import math

from kvgate.bench.records import RequestRecord

SLO_KEYS = ("ttft", "tpot", "itl", "e2e")


def percentile(xs: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100), like numpy's default."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def stats(xs: list[float]) -> dict:
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None, "n": 0}
    return {
        "mean": sum(xs) / len(xs),
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
        "max": max(xs),
        "n": len(xs),
    }


def parse_duration_ms(text: str) -> float:
    t = text.strip().lower()
    for suffix, mult in (("ms", 1.0), ("s", 1000.0), ("m", 60000.0)):
        if t.endswith(suffix):
            return float(t[: -len(suffix)]) * mult
    return float(t)  # a bare number is milliseconds, as in `vllm bench serve --goodput`


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=2s,tpot=200ms' -> {'ttft': 2000.0, 'tpot': 200.0} (milliseconds)."""
    out: dict[str, float] = {}
    for part in (text or "").replace(" ", "").split(","):
        if not part:
            continue
        key, sep, value = part.partition("=") if "=" in part else part.partition(":")
        key = {"e2el": "e2e"}.get(key.lower(), key.lower())
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--slo {text!r}: use KEY=VALUE pairs with KEY in {', '.join(SLO_KEYS)}")
        out[key] = parse_duration_ms(value)
    return out


def summarize(records: list[RequestRecord], duration_s: float, slo: dict[str, float] | None = None) -> dict:
    """Aggregate request records into the report's summary block."""
    slo = slo or {}
    done = [r for r in records if r.ok]
    counts = {"200": 0, "400": 0, "429": 0, "503": 0, "other": 0}
    retry_after = {"429": {"with": 0, "without": 0}, "503": {"with": 0, "without": 0}}
    for r in records:
        key = str(r.status) if str(r.status) in counts else "other"
        counts[key] += 1
        if key in retry_after:
            retry_after[key]["with" if r.retry_after else "without"] += 1
    other: dict[str, int] = {}  # what "other" holds: statuses by code, "no_response" for network errors
    for r in records:
        if str(r.status) not in counts:
            key = str(r.status) if r.status else "no_response"
            other[key] = other.get(key, 0) + 1
    admitted = [r for r in records if r.status == 200]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens or 0 for r in done)
    dur = max(duration_s, 1e-9)

    def good(r: RequestRecord) -> bool:
        checks = {
            "ttft": r.ttft_ms,
            "tpot": r.tpot_ms,
            "e2e": r.e2e_ms,
            "itl": max(r.itl_ms) if r.itl_ms else 0.0,
        }
        return all(checks[k] is not None and checks[k] <= v for k, v in slo.items())

    n_good = sum(1 for r in done if good(r)) if slo else None
    short = [r for r in done if r.requested_output and r.output_tokens < r.requested_output]
    return {
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "admitted": len(admitted),
        "admitted_completed": sum(1 for r in admitted if r.ok),
        "admitted_completion_rate": (sum(1 for r in admitted if r.ok) / len(admitted)) if admitted else None,
        "stream_errors": sum(1 for r in admitted if not r.ok),
        "status_counts": counts,
        "other_statuses": other,
        "retry_after": retry_after,
        "duration_s": duration_s,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "output_tokens_source": "usage" if done and all(r.tokens_from_usage for r in done) else "chunks",
        "short_outputs": len(short),
        "request_throughput": len(done) / dur,
        "output_throughput": out_tokens / dur,
        "total_throughput": (in_tokens + out_tokens) / dur,
        "ttft_ms": stats([r.ttft_ms for r in done if r.ttft_ms is not None]),
        "tpot_ms": stats([r.tpot_ms for r in done if r.tpot_ms is not None]),
        "itl_ms": stats([x for r in done for x in r.itl_ms]),
        "e2e_ms": stats([r.e2e_ms for r in done if r.e2e_ms is not None]),
        "slo_ms": slo,
        "goodput_requests": n_good,
        "goodput": (n_good / dur) if slo else None,
        "goodput_fraction": (n_good / len(records)) if slo and records else None,
    }
