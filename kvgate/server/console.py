"""The kvgate console: `GET /` serves one self-contained page, and `LiveStats` feeds its live panel.

The page (`static/console.html` with `console.css` and `console.js` inlined at startup, so one
response holds everything and nothing is fetched from elsewhere) reads only `/health`, `/v1/models`,
`/v1/resources` and POST `/v1/chat/completions`. It needs no key itself; the `/v1/*` calls it makes
carry the key the user types in when the server answers 401. A Content-Security-Policy with the
hashes of the inlined script and style lets the browser load nothing else and talk only to this origin.

`LiveStats` is what `/v1/resources` reports under `"live"`: refusals of the last 60 s by reason (with
the latest Retry-After) and, over the last 5 minutes in 5-second buckets, output tokens per second and
the medians of time to first token and inter-token latency. It is thread-safe and its memory is bounded:
at most 60 buckets of at most `SAMPLES_PER_BUCKET` samples per series (a uniform reservoir beyond
that), and per reason at most 60 one-second refusal counts. Time is `time.monotonic`, the clock of
`Result`'s timestamps, and tokens are counted in the bucket of the moment they were generated.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import random
import statistics
import threading
import time
from collections import deque
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

BUCKET_SECONDS = 5
WINDOW_SECONDS = 300
REFUSAL_WINDOW_SECONDS = 60
SAMPLES_PER_BUCKET = 256


class _Reservoir:
    """A uniform sample of at most SAMPLES_PER_BUCKET values out of all `seen`."""

    def __init__(self, rng: random.Random):
        self.values: list[float] = []
        self.seen = 0
        self.rng = rng

    def add(self, x: float) -> None:
        self.seen += 1
        if len(self.values) < SAMPLES_PER_BUCKET:
            self.values.append(x)
        else:
            j = self.rng.randrange(self.seen)
            if j < SAMPLES_PER_BUCKET:
                self.values[j] = x

    def median(self) -> float | None:
        return statistics.median(self.values) if self.values else None


class _Bucket:
    def __init__(self, rng: random.Random):
        self.tokens = 0
        self.ttft = _Reservoir(rng)
        self.itl = _Reservoir(rng)


class _ReasonWindow:
    def __init__(self):
        self.per_second: deque[list[int]] = deque()  # [second, count], oldest first
        self.retry_after: int | None = None
        self.last_at = 0.0


class LiveStats:
    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._rng = random.Random(0)
        self._buckets: dict[int, _Bucket] = {}
        self._refusals: dict[str, _ReasonWindow] = {}

    # ---- recording (called by the HTTP layer) ------------------------------------------------
    def observe_result(self, result) -> None:
        """Count one finished request's tokens, TTFT and inter-token gaps in the buckets they fell in."""
        with self._lock:
            oldest = self._index(self._clock()) - WINDOW_SECONDS // BUCKET_SECONDS + 1
            times = result.token_times
            for t in times:
                b = self._bucket(t, oldest)
                if b is not None:
                    b.tokens += 1
            if result.first_token_at is not None:
                b = self._bucket(result.first_token_at, oldest)
                if b is not None:
                    b.ttft.add(result.first_token_at - result.submitted_at)
            for a, z in zip(times, times[1:]):
                b = self._bucket(z, oldest)
                if b is not None:
                    b.itl.add(z - a)
            for i in [i for i in self._buckets if i < oldest]:
                del self._buckets[i]

    def record_refusal(self, code: str, retry_after: int | None) -> None:
        """Count one refusal now, remembering its Retry-After (seconds, or None when it had none)."""
        with self._lock:
            now = self._clock()
            w = self._refusals.setdefault(code, _ReasonWindow())
            sec = int(now)
            if w.per_second and w.per_second[-1][0] == sec:
                w.per_second[-1][1] += 1
            else:
                w.per_second.append([sec, 1])
            while w.per_second and w.per_second[0][0] <= sec - REFUSAL_WINDOW_SECONDS:
                w.per_second.popleft()
            w.retry_after = None if retry_after is None else int(retry_after)
            w.last_at = now

    # ---- reading (the "live" part of /v1/resources) ------------------------------------------
    def summary(self) -> dict:
        with self._lock:
            now = self._clock()
            sec = int(now)
            refusals = {}
            for code, w in sorted(self._refusals.items()):
                n = sum(c for s, c in w.per_second if s > sec - REFUSAL_WINDOW_SECONDS)
                if n:
                    refusals[code] = {
                        "count": n,
                        "retry_after_seconds": w.retry_after,
                        "seconds_ago": round(now - w.last_at, 1),
                    }
            last = self._index(now)
            n_buckets = WINDOW_SECONDS // BUCKET_SECONDS
            ages, tok_s, ttft, itl = [], [], [], []
            for i in range(last - n_buckets + 1, last + 1):
                b = self._buckets.get(i)
                # the bucket in progress is divided by the part of it that has passed (at least 1 s)
                width = BUCKET_SECONDS if i < last else max(1.0, now - i * BUCKET_SECONDS)
                ages.append((last - i) * BUCKET_SECONDS)
                tok_s.append(round(b.tokens / width, 3) if b else 0.0)
                ttft.append(_round(b.ttft.median()) if b else None)
                itl.append(_round(b.itl.median()) if b else None)
        return {
            "refusals": {"window_seconds": REFUSAL_WINDOW_SECONDS, "by_reason": refusals},
            "series": {
                "window_seconds": WINDOW_SECONDS,
                "bucket_seconds": BUCKET_SECONDS,
                "seconds_ago": ages,
                "output_tokens_per_second": tok_s,
                "ttft_p50_seconds": ttft,
                "itl_p50_seconds": itl,
            },
        }

    # ---- helpers (lock held) -----------------------------------------------------------------
    @staticmethod
    def _index(t: float) -> int:
        return int(t // BUCKET_SECONDS)

    def _bucket(self, t: float, oldest: int) -> _Bucket | None:
        i = self._index(t)
        if i < oldest:
            return None  # older than the window: nothing to show it in
        b = self._buckets.get(i)
        if b is None:
            b = self._buckets[i] = _Bucket(self._rng)
        return b


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def _csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


@functools.cache
def console_page() -> tuple[str, str]:
    """(the page with its script and style inlined, the Content-Security-Policy that allows just them)."""
    static = resources.files("kvgate.server") / "static"
    html = (static / "console.html").read_text(encoding="utf-8")
    css = (static / "console.css").read_text(encoding="utf-8")
    js = (static / "console.js").read_text(encoding="utf-8")
    for marker in ("/*console.css*/", "/*console.js*/"):
        if html.count(marker) != 1:
            raise RuntimeError(
                f"kvgate/server/static/console.html must hold the marker {marker} exactly once; "
                "reinstall kvgate or restore the file"
            )
    html = html.replace("/*console.css*/", css).replace("/*console.js*/", js)
    csp = (
        f"default-src 'none'; script-src {_csp_hash(js)}; style-src {_csp_hash(css)}; "
        "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    return html, csp


def install_console(app: FastAPI) -> None:
    """Serve the console at `GET /` (no key needed: the page holds no data; the API calls need one)."""
    html, csp = console_page()
    headers = {
        "Content-Security-Policy": csp,
        "Cache-Control": "no-cache",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    }

    @app.get("/", include_in_schema=False)
    async def console():
        return HTMLResponse(html, headers=headers)
