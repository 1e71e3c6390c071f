"""`kvgate bench`: drive any OpenAI-compatible endpoint and report latency and throughput.

In the spirit of `vllm bench serve`: fixed-length synthetic prompts (counted with the server's own
tokenizer when it exposes one) or a JSONL dataset, a fixed client concurrency or Poisson arrivals,
streaming over httpx, and per-request TTFT / TPOT / ITL / E2E. Refusals are first-class results: the
report counts 200/400/429/503/other and whether each 429/503 carried Retry-After.

Definitions (the same as vLLM's):
- TTFT: request sent -> first non-empty streamed text chunk.
- ITL: gaps between consecutive non-empty text chunks.
- TPOT: (E2E - TTFT) / (output tokens - 1), per request.
- E2E: request sent -> stream closed.
- throughput: tokens of completed requests / wall time of the run (first send -> last completion).
- goodput: completed requests that meet every SLO given with --slo, per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# A fixed word list: prompts are random draws from it, so every prompt is distinct from its first word.
WORDS = """
time year people way day man thing woman life child world school state family student group country
problem hand part place case week company system program question work government number night point
home water room mother area money story fact month lot right study book eye job word business issue
side kind head house service friend father power hour game line end member law car city community name
president team minute idea kid body information back parent face others level office door health person
art war history party result change morning reason research girl guy moment air teacher force education
foot boy age policy process music market sense nation plan college interest death experience effect use
class control care field development role effort rate heart drug show leader light voice wife police
mind price report decision son view relationship town road arm difference value building action model
season society tax director position player record paper space ground form event official matter center
couple site project activity star table need court oil situation cost industry figure street image phone
data picture practice piece land product doctor wall patient worker news test movie north love support
technology step baby computer type attention film tree source organization hair window evidence
population truth song river garden ocean mountain bridge engine signal memory pattern winter summer
""".split()

SLO_KEYS = ("ttft", "tpot", "itl", "e2e")


# ---- small helpers ----------------------------------------------------------------------------


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


def parse_list(text: str, cast) -> list:
    return [cast(x) for x in str(text).split(",") if x.strip()]


def root_url(base_url: str) -> str:
    u = base_url.rstrip("/")
    return u[: -len("/v1")] if u.endswith("/v1") else u


# ---- records ----------------------------------------------------------------------------------


@dataclass
class Prompt:
    text: str | None = None
    messages: list | None = None
    prompt_tokens: int | None = None  # as counted when built (None: unknown)
    output_len: int | None = None
    prompt_ids: list[int] | None = None

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class RequestRecord:
    index: int
    sent_at: float  # seconds since the run started
    status: int = 0  # HTTP status; 0 = no response (connection error or timeout)
    ok: bool = False  # 200 and a complete stream (finish_reason seen, no error event)
    error: str | None = None
    error_code: str | None = None
    retry_after: str | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    tokens_from_usage: bool = False
    finish_reason: str | None = None
    requested_output: int | None = None

    @property
    def tpot_ms(self) -> float | None:
        if self.ok and self.output_tokens > 1 and self.ttft_ms is not None and self.e2e_ms is not None:
            return (self.e2e_ms - self.ttft_ms) / (self.output_tokens - 1)
        return None


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


# ---- the client ---------------------------------------------------------------------------------


class Target:
    """One OpenAI-compatible server: URLs, model name, negotiated request extras, token counting."""

    def __init__(self, base_url: str, endpoint: str, model: str | None, api_key: str | None, timeout: float):
        import httpx

        self.root = root_url(base_url)
        self.endpoint = endpoint
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self.extras: dict = {}
        self.eos_mode = "none"
        self.tokenize_url: str | None = None
        self.tokenize_kind: str | None = None
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=1024),
            headers=self.headers,
        )

    @property
    def url(self) -> str:
        return self.root + ("/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions")

    async def close(self) -> None:
        await self.client.aclose()

    async def resolve_model(self) -> str:
        if self.model:
            return self.model
        r = await self.client.get(self.root + "/v1/models")
        r.raise_for_status()
        data = r.json().get("data") or []
        if not data:
            raise RuntimeError(f"{self.root}/v1/models lists no model; pass --model")
        self.model = data[0]["id"]
        return self.model

    # -- token counting --
    async def count_tokens(self, text: str) -> int | None:
        """Tokens the server will see for this prompt (chat: with its template), or None if it can't say."""
        if self.tokenize_kind is None:
            await self._find_tokenizer()
        if self.tokenize_kind == "none":
            return None
        return await self._tokenize(self.tokenize_kind, text)

    async def _find_tokenizer(self) -> None:
        for kind in ("v1", "vllm", "llamacpp", "llama-cpp-python"):
            try:
                n = await self._tokenize(kind, "hello world")
            except Exception:
                n = None
            if n:
                self.tokenize_kind = kind
                return
        self.tokenize_kind = "none"

    async def _tokenize(self, kind: str, text: str) -> int | None:
        msgs = [{"role": "user", "content": text}]
        if kind in ("v1", "vllm"):
            body = {"model": self.model}
            body.update({"messages": msgs} if self.endpoint == "chat" else {"prompt": text})
            url = self.root + ("/v1/tokenize" if kind == "v1" else "/tokenize")
        elif kind == "llamacpp":
            if self.endpoint == "chat":
                return None
            body, url = {"content": text, "add_special": True}, self.root + "/tokenize"
        else:
            if self.endpoint == "chat":
                return None
            body, url = {"input": text, "model": self.model}, self.root + "/extras/tokenize"
        r = await self.client.post(url, json=body, timeout=30)
        if r.status_code != 200:
            return None
        j = r.json()
        if isinstance(j.get("count"), int):
            return j["count"]
        toks = j.get("tokens")
        return len(toks) if isinstance(toks, list) else None

    # -- request bodies --
    def body(self, p: Prompt, max_tokens: int | None, temperature: float, extras: dict | None = None) -> dict:
        b: dict = {"model": self.model, "stream": True, "temperature": temperature}
        if self.endpoint == "chat":
            b["messages"] = p.messages or [{"role": "user", "content": p.text or ""}]
        else:
            b["prompt"] = p.text if p.text is not None else _messages_text(p.messages)
        if max_tokens is not None:
            b["max_tokens"] = max_tokens
        ex = self.extras if extras is None else extras
        for k, v in ex.items():
            b[k] = max_tokens if v == "$max_tokens" else v
        if max_tokens is None:
            b.pop("min_tokens", None)
            b.pop("ignore_eos", None)
        return b

    async def negotiate(self, eos_mode: str, usage: bool, extra_body: dict, temperature: float) -> None:
        """Pick the request extras the server accepts (one short warm-up request per candidate).

        auto: ignore_eos + min_tokens (vLLM, llama.cpp servers ignore what they don't know), then
        ignore_eos alone (kvgate refuses unknown fields), then min_tokens alone, then nothing.
        """
        usage_ex = {"stream_options": {"include_usage": True}} if usage else {}
        modes = {
            "auto": [
                ("ignore_eos+min_tokens", {"ignore_eos": True, "min_tokens": "$max_tokens"}),
                ("ignore_eos", {"ignore_eos": True}),
                ("min_tokens", {"min_tokens": "$max_tokens"}),
                ("none", {}),
            ],
            "ignore_eos": [("ignore_eos", {"ignore_eos": True})],
            "min_tokens": [("min_tokens", {"min_tokens": "$max_tokens"})],
            "none": [("none", {})],
        }[eos_mode]
        candidates = [(n, {**ex, **usage_ex, **extra_body}) for n, ex in modes]
        if usage:
            candidates += [(n + " (no usage)", {**ex, **extra_body}) for n, ex in modes]
        last = None
        probe = Prompt(text="Say hello.")
        for name, ex in candidates:
            rec = RequestRecord(index=-1, sent_at=0.0)
            await self.send(rec, probe, 2, temperature, ex, time.perf_counter())
            if rec.status == 200:
                self.extras, self.eos_mode = ex, name
                return
            last = rec
            if rec.status not in (400, 422):
                break
        raise RuntimeError(
            f"warm-up request to {self.url} failed: status {last.status if last else '?'} "
            f"{(last.error or '')[:300] if last else ''}"
        )

    async def send(
        self,
        rec: RequestRecord,
        p: Prompt,
        max_tokens: int | None,
        temperature: float,
        extras: dict | None,
        t_run0: float,
    ) -> None:
        """Send one streaming request and fill `rec` (never raises for HTTP or network errors)."""
        import httpx

        body = self.body(p, max_tokens, temperature, extras)
        rec.requested_output = max_tokens
        rec.prompt_tokens = p.prompt_tokens
        t0 = time.perf_counter()
        rec.sent_at = t0 - t_run0
        last = None
        try:
            async with self.client.stream("POST", self.url, json=body) as r:
                rec.status = r.status_code
                if r.status_code != 200:
                    rec.retry_after = r.headers.get("retry-after")
                    raw = (await r.aread()).decode("utf-8", "replace")
                    rec.error = raw[:500]
                    try:
                        err = json.loads(raw).get("error")
                        rec.error_code = (err or {}).get("code") if isinstance(err, dict) else None
                    except (ValueError, AttributeError):
                        pass
                    return
                chunks = 0
                done = False
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        obj = json.loads(data)
                    except ValueError:
                        continue
                    if "error" in obj:
                        rec.error = json.dumps(obj["error"])[:500]
                        err = obj["error"]
                        rec.error_code = err.get("code") if isinstance(err, dict) else None
                        continue
                    if obj.get("usage"):
                        u = obj["usage"]
                        if u.get("completion_tokens") is not None:
                            rec.output_tokens = u["completion_tokens"]
                            rec.tokens_from_usage = True
                        if u.get("prompt_tokens"):
                            rec.prompt_tokens = u["prompt_tokens"]
                    for ch in obj.get("choices") or []:
                        text = (ch.get("delta") or {}).get("content") if "delta" in ch else ch.get("text")
                        now = time.perf_counter()
                        if text:
                            chunks += 1
                            if last is None:
                                rec.ttft_ms = (now - t0) * 1000
                            else:
                                rec.itl_ms.append((now - last) * 1000)
                            last = now
                        if ch.get("finish_reason"):
                            rec.finish_reason = ch["finish_reason"]
                rec.e2e_ms = (time.perf_counter() - t0) * 1000
                if not rec.tokens_from_usage:
                    rec.output_tokens = chunks
                rec.ok = (
                    rec.error is None
                    and (done or rec.finish_reason is not None)
                    and rec.finish_reason != "error"
                )
                if not rec.ok and rec.error is None:
                    rec.error = "stream ended without finish_reason or [DONE]"
        except httpx.HTTPError as exc:
            rec.error = f"{type(exc).__name__}: {exc}"[:500]
            rec.e2e_ms = (time.perf_counter() - t0) * 1000


def _messages_text(messages: list | None) -> str:
    return "\n".join(str(m.get("content", "")) for m in messages or [])


# ---- prompts ------------------------------------------------------------------------------------


async def build_prompts(
    target: Target, n: int, input_len: int, seed: int, progress: bool = True
) -> list[Prompt]:
    """`n` distinct prompts of `input_len` tokens each (as the server counts them, when it can)."""
    rng = random.Random(seed)
    exact = await target.count_tokens("hello world") is not None
    out: list[Prompt] = []
    ratio = 1.3  # tokens per word, refined as we go
    t_last = 0.0
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(max(1, int(input_len / ratio)) + 8)]
        words[0] = words[0].capitalize()
        if not exact:
            k = max(1, round(input_len * 4 / 5.5))  # ~4 chars per token, ~5.5 chars per word with the space
            words += [rng.choice(WORDS) for _ in range(k - len(words))]
            out.append(Prompt(text=" ".join(words[:k]), prompt_tokens=None))
            continue
        text, tokens = await _fit_words(target, words, input_len, ratio, rng)
        ratio = 0.8 * ratio + 0.2 * (tokens / max(1, len(text.split())))
        out.append(Prompt(text=text, prompt_tokens=tokens))
        if progress and time.monotonic() - t_last > 1:
            t_last = time.monotonic()
            print(f"\rbuilding prompts {i + 1}/{n}", end="", file=sys.stderr, flush=True)
    if progress and exact and n:
        print(f"\rbuilt {n} prompts of {input_len} tokens (counted by the server)", file=sys.stderr)
    return out


async def _fit_words(
    target: Target, words: list[str], want: int, ratio: float, rng: random.Random
) -> tuple[str, int]:
    """The prefix of `words` whose token count is closest to `want` (ties: the shorter), then topped up
    one character at a time for tokenizers where a word is several tokens."""
    seen: dict[int, int] = {}

    async def count(k: int) -> int:
        while k > len(words):
            words.append(rng.choice(WORDS))
        if k not in seen:
            seen[k] = await target.count_tokens(" ".join(words[:k]))
        return seen[k]

    k = max(1, round(want / ratio))
    for _ in range(12):
        c = await count(k)
        if c == want:
            break
        nk = max(1, round(want * k / max(c, 1)))
        if nk in seen:
            nk = k + (1 if c < want else -1)
        if nk < 1 or nk in seen:
            break
        k = nk
    under = [k for k, c in seen.items() if c <= want]
    k = max(under, key=lambda k: seen[k]) if under else min(seen, key=lambda k: seen[k])
    text, c = " ".join(words[:k]), seen[k]
    fill = "etaoinshrdlu"
    for i in range(2 * (want - c) + 4):
        if c >= want:
            break
        cand = text + fill[i % len(fill)]
        cc = await target.count_tokens(cand)
        if cc > want:
            break
        text, c = cand, cc
    return text, c


def load_dataset(path: str) -> list[Prompt]:
    """JSONL: one object per line with `prompt` (or `text`) or `messages`; optional `output_len`
    (or `max_tokens`), `prompt_tokens`, `prompt_ids`."""
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            line = line.strip()
            if not line:
                continue
            obj = json.loads(line)
            text = obj.get("prompt", obj.get("text"))
            if text is None and "messages" not in obj:
                raise ValueError(f"{path}:{i + 1}: each line needs 'prompt', 'text' or 'messages'")
            out.append(
                Prompt(
                    text=text,
                    messages=obj.get("messages"),
                    prompt_tokens=obj.get("prompt_tokens"),
                    output_len=obj.get("output_len", obj.get("max_tokens")),
                    prompt_ids=obj.get("prompt_ids"),
                )
            )
    if not out:
        raise ValueError(f"{path} holds no prompts")
    return out


# ---- one run --------------------------------------------------------------------------------------


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


def record_json(r: RequestRecord) -> dict:
    d = asdict(r)
    d["tpot_ms"] = r.tpot_ms
    return d


# ---- output -----------------------------------------------------------------------------------


def _fmt(x, nd=1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def print_report(result: dict, out=None) -> None:
    out = out or sys.stdout
    meta = result["meta"]
    print(
        f"target {meta['base_url']} model {meta['model']} endpoint {meta['endpoint']} "
        f"(output length control: {meta['eos_mode']})",
        file=out,
    )
    hdr = (
        f"{'conc':>5} {'rate':>6} {'done':>5} {'req/s':>6} {'out tok/s':>9} {'tot tok/s':>9} "
        f"{'TTFT p50/p90/p99 ms':>22} {'TPOT p50/p99 ms':>16} {'ITL p50/p99':>12} {'E2E p50/p99 s':>14} "
        f"{'200/400/429/503/oth':>20}"
    )
    print(hdr, file=out)
    for run in result["runs"]:
        s = run["summary"]
        c = s["status_counts"]
        t, tp, itl, e = s["ttft_ms"], s["tpot_ms"], s["itl_ms"], s["e2e_ms"]
        conc = "inf" if run["concurrency"] is None else f"{run['concurrency']:g}"
        rate = "inf" if run["request_rate"] is None else f"{run['request_rate']:g}"
        print(
            f"{conc:>5} {rate:>6} {s['completed']:>5} {s['request_throughput']:>6.2f} {s['output_throughput']:>9.1f} "
            f"{s['total_throughput']:>9.1f} {_fmt(t['p50'], 0) + '/' + _fmt(t['p90'], 0) + '/' + _fmt(t['p99'], 0):>22} "
            f"{_fmt(tp['p50']) + '/' + _fmt(tp['p99']):>16} {_fmt(itl['p50'], 0) + '/' + _fmt(itl['p99'], 0):>12} "
            f"{_fmt(e['p50'] and e['p50'] / 1000) + '/' + _fmt(e['p99'] and e['p99'] / 1000):>14} "
            f"{c['200']}/{c['400']}/{c['429']}/{c['503']}/{c['other']:>1}",
            file=out,
        )
        ra = s["retry_after"]
        if c["429"] or c["503"]:
            print(
                f"      Retry-After present: 429 {ra['429']['with']}/{c['429']}, 503 {ra['503']['with']}/{c['503']}",
                file=out,
            )
        if s["goodput"] is not None:
            print(
                f"      goodput {s['goodput']:.3f} req/s ({s['goodput_requests']}/{s['requests']} met {s['slo_ms']} ms)",
                file=out,
            )
        if s["stream_errors"]:
            print(f"      {s['stream_errors']} admitted request(s) did not complete", file=out)
        if s["short_outputs"]:
            print(f"      {s['short_outputs']} request(s) produced fewer tokens than requested", file=out)


def write_plots(result: dict, outdir: str, title: str = "") -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "kvgate bench: matplotlib is not installed; skipping plots (pip install matplotlib)",
            file=sys.stderr,
        )
        return []
    os.makedirs(outdir, exist_ok=True)
    runs = result["runs"]
    paths = []
    concs = [r for r in runs if r["concurrency"] is not None]
    if len({r["concurrency"] for r in concs}) > 1:
        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        xs = [r["concurrency"] for r in concs]
        ax[0].plot(xs, [r["summary"]["output_throughput"] for r in concs], "o-")
        ax[0].set(
            xscale="log", xlabel="concurrency", ylabel="output tok/s", title="throughput vs concurrency"
        )
        ax[1].plot(xs, [(r["summary"]["ttft_ms"]["p50"] or 0) / 1000 for r in concs], "o-", label="TTFT p50")
        ax[1].plot(xs, [(r["summary"]["ttft_ms"]["p99"] or 0) / 1000 for r in concs], "o--", label="TTFT p99")
        ax[1].set(xscale="log", xlabel="concurrency", ylabel="seconds", title="TTFT vs concurrency")
        ax[1].legend()
        for a in ax:
            a.set_xticks(xs, [f"{x:g}" for x in xs])
            a.grid(alpha=0.3)
        fig.suptitle(title)
        fig.tight_layout()
        p = os.path.join(outdir, "throughput_vs_concurrency.png")
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)
    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    for run in runs:
        ok = [r for r in run["records"] if r["ok"]]
        label = run["label"]
        for a, key, unit in ((ax[0], "ttft_ms", "TTFT (s)"), (ax[1], "e2e_ms", "E2E (s)")):
            xs = sorted(r[key] / 1000 for r in ok if r[key] is not None)
            if xs:
                a.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
            a.set(xlabel=unit, ylabel="fraction of requests")
        itl = sorted(x for r in ok for x in r["itl_ms"])
        if itl:
            ax[2].plot(itl, [(i + 1) / len(itl) for i in range(len(itl))], label=label)
        ax[2].set(xlabel="ITL (ms)", ylabel="fraction of gaps", xscale="log")
    for a, t in zip(ax, ("TTFT CDF", "E2E CDF", "inter-token latency CDF"), strict=True):
        a.set_title(t)
        a.grid(alpha=0.3)
    ax[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    p = os.path.join(outdir, "latency_cdf.png")
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)
    return paths


# ---- entry point --------------------------------------------------------------------------------


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


if __name__ == "__main__":
    sys.exit(main())
