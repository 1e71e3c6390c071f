"""The console (`GET /`) in a real headless Chromium against a live kvgate, and `LiveStats` on its own.

The browser test drives Debian's Chromium (/usr/bin/chromium; never a downloaded browser) through
Playwright, against a server with an API key on the tiny model with a KV pool of 8 blocks (128
positions), and checks, in one page session: the page asks for the key after a 401; the memory bar's
segments (their bytes read from the DOM) add up to `ledger.limit_bytes` of /v1/resources, role by role;
a chat answer streams (text shows while the request still runs, and the bar then shows the request's
KV blocks as referenced); the budget cap of an unset max_tokens is shown; an over-budget request shows
the 400's numbers, and the refusal shows up in the last-minute table; the page talks to nothing but
the five endpoints it may read. A screenshot goes to bench/out/console.png (ignored by git).
Missing Chromium or Playwright fails the test with what to install; it never skips.

Seen to fail: with the "step workspace" segment left out of console.js's bar, the sum check went red
(the bar fell short of the limit by exactly the workspace reservation); restored, green. With
`record_refusal` removed from the 400 path in app.py, the refusals table never showed the reason.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from kvgate.core.testing import set_step_hook
from kvgate.request import Result
from kvgate.server.console import BUCKET_SECONDS, SAMPLES_PER_BUCKET, LiveStats
from tests.server_util import running_server
from tests.tiny_model import TINY_KV_BYTES_PER_TOKEN

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOT = Path(__file__).resolve().parents[1] / "bench" / "out" / "console.png"
PAGE_READS = {"/", "/health", "/v1/models", "/v1/resources", "/metrics", "/v1/chat/completions"}
KEY = "console-test-key"
BLOCKS, BLOCK_SIZE, BYTES_PER_TOKEN = 8, 16, TINY_KV_BYTES_PER_TOKEN  # the default float16 cache


@contextlib.contextmanager
def chromium(profile: Path):
    if not os.path.exists(CHROMIUM):
        pytest.fail(
            f"{CHROMIUM} is missing: the console test needs Debian's Chromium. Install it with "
            "'apt-get install -y --no-install-recommends chromium' (make test does this when it is missing)."
        )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the Python package playwright is missing: run .venv/bin/pip install -e '.[test]'")
    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield ctx
        finally:
            ctx.close()


def bar_segments(page) -> list[tuple[str, int]]:
    return page.eval_on_selector_all(
        "#bar rect", "rs => rs.map(r => [r.dataset.segment, Number(r.dataset.bytes)])"
    )


def test_console_in_headless_chromium(make_engine, tmp_path):
    engine = make_engine(
        kv_cache_bytes=BLOCKS * BLOCK_SIZE * BYTES_PER_TOKEN, block_size=BLOCK_SIZE, responses_store=1 << 20
    )
    with running_server(engine, api_key=KEY) as (base, _), chromium(tmp_path / "profile") as ctx:
        page = ctx.new_page()
        page.set_default_timeout(10_000)
        requests, crashes = [], []
        page.on("request", lambda r: requests.append(r.url))
        page.on("pageerror", lambda e: crashes.append(str(e)))
        assert httpx.get(base + "/").headers["content-type"].startswith("text/html")  # no key for the page
        page.goto(base + "/")

        # The key: asked for after /v1/models answers 401, then sent as a bearer token.
        page.wait_for_selector("#key-form:not([hidden])")
        page.fill("#api-key", KEY)
        page.click("#key-form button")
        page.wait_for_selector("#bar rect[data-bytes]")

        # The bar, idle: every role's bytes, and together exactly the limit.
        res = httpx.get(base + "/v1/resources", headers={"Authorization": f"Bearer {KEY}"}).json()
        ledger, roles = res["ledger"], res["ledger"]["reserved_by_role"]
        segs = bar_segments(page)
        got = dict(segs)
        assert sum(b for _, b in segs) == ledger["limit_bytes"], f"bar segments {segs} != limit {ledger}"
        assert [name for name, _ in segs] == [
            "weights",
            "overhead",
            "workspace",
            "logprobs",
            "responses",  # the kept responses' plan term (red without its segment: drawn as "other")
            "kv-referenced",
            "kv-cached",
            "kv-free",
            "unreserved",
        ]
        assert (got["weights"], got["overhead"], got["workspace"], got["logprobs"]) == (
            roles["weights"],
            roles["overhead"],
            roles["workspace"],
            roles["logprobs"],
        )
        assert got["responses"] == roles["responses"] == 1 << 20
        assert "kept responses" in page.text_content("#legend li[data-segment=responses]")
        assert got["kv-referenced"] == got["kv-cached"] == 0
        assert got["kv-free"] == roles["kv_cache"] == BLOCKS * BLOCK_SIZE * BYTES_PER_TOKEN
        assert got["unreserved"] == ledger["limit_bytes"] - ledger["reserved_bytes"]
        # the KV cache's format beside its blocks (red before /v1/resources named it)
        assert page.text_content("#kv-held-label") == f"KV blocks held ({res['kv']['dtype']})"
        assert page.get_attribute("#bar", "data-limit-bytes") == str(ledger["limit_bytes"])
        kv_zoom = page.eval_on_selector_all("#kv-bar rect", "rs => rs.map(r => Number(r.dataset.bytes))")
        assert sum(kv_zoom) == roles["kv_cache"] and len(kv_zoom) == 3  # the pool to its own scale
        assert "weights" in page.text_content("#bar rect[data-segment=weights] title")  # the hover text

        # A chat answer streams; max_tokens unset, so the server caps it to the pool and says so.
        set_step_hook(engine, lambda so: time.sleep(0.05))  # ~20 tokens/s: long enough to watch
        page.fill("#temperature", "0")
        page.fill("#prompt", "Tell me a story")  # greedy on the tiny model: 95 tokens, to the cap
        page.click("#send")
        page.wait_for_function(
            "() => document.querySelector('.msg.assistant').textContent.length > 0"
            " && document.getElementById('usage').textContent === ''"
        )
        page.wait_for_function(
            "() => Number(document.querySelector('#bar rect[data-segment=kv-referenced]').dataset.bytes) > 0"
        )
        segs = bar_segments(page)
        assert sum(b for _, b in segs) == ledger["limit_bytes"], f"while running: {segs}"
        set_step_hook(engine, None)
        page.wait_for_selector("#usage[data-completion-tokens]")
        assert page.inner_text(".msg.assistant").strip()
        cap = page.get_attribute("#budget-cap", "data-admitted")
        prompt_tokens = int(page.inner_text("#usage").split("prompt ")[1].split(" ")[0])
        assert cap == str(BLOCKS * BLOCK_SIZE - prompt_tokens), page.inner_text("#budget-cap")
        assert "X-KVGate-Budget-Cap: requested=" in page.inner_text("#budget-cap")
        # finished: its prompt blocks stay in the prefix cache, evictable, not held by anyone (red when
        # the console counted every block not free as held, session 30's QA)
        page.wait_for_function(
            "() => /^0 \\/ .*; [1-9][0-9]* cached, evictable\\)$/.test("
            "document.querySelector('#kv-held').textContent)"
        )

        # Over budget: the 400 and its numbers, as the server sent them.
        page.click("#clear")
        page.fill("#max-tokens", "200")
        page.fill("#prompt", "Hello there")
        with page.expect_response("**/v1/chat/completions") as answer:
            page.click("#send")
        assert answer.value.status == 400
        err = answer.value.json()["error"]
        page.wait_for_selector("#refusal:not([hidden])")
        assert page.get_attribute("#refusal", "data-code") == err["code"] == "kv_budget_exceeded"
        shown = dict(
            page.eval_on_selector_all(
                "#refusal-numbers dd", "ds => ds.map(d => [d.dataset.field, d.dataset.value])"
            )
        )
        numbers = ("estimated_bytes", "limit_bytes", "positions", "positions_limit", "param")
        assert shown == {k: str(err[k]) for k in numbers} and err["param"] == "max_tokens"
        assert err["limit_bytes"] == BLOCKS * BLOCK_SIZE * BYTES_PER_TOKEN
        page.wait_for_selector("#refusals tr[data-reason=kv_budget_exceeded] td[data-count='1']")
        page.wait_for_function("() => document.querySelector('#spark-tok path').getAttribute('d').length > 0")

        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOT), full_page=True)
        assert not crashes, f"the page threw: {crashes}"
        strays = {u for u in requests if not u.startswith(base) or urlsplit(u).path not in PAGE_READS}
        assert not strays, f"the page fetched what it must not: {strays}"


# ---- LiveStats, with a hand-driven clock ------------------------------------------------------------
def result(first: float, n_tokens: int, gap: float, submitted: float) -> Result:
    times = [first + i * gap for i in range(n_tokens)]
    return Result(
        token_ids=list(range(n_tokens)),
        text="",
        finish_reason="length",
        prompt_tokens=1,
        completion_tokens=n_tokens,
        budget_cap=None,
        submitted_at=submitted,
        admitted_at=submitted,
        first_token_at=first,
        finished_at=times[-1],
        token_times=times,
    )


def test_live_stats_buckets_tokens_ttft_itl_and_forgets_after_five_minutes():
    """Seen to fail when tokens were counted at the finish time instead of when each was generated."""
    now = [1000.0]
    live = LiveStats(clock=lambda: now[0])
    live.observe_result(result(first=990.0, n_tokens=11, gap=1.0, submitted=989.5))  # 990..1000
    s = live.summary()["series"]
    assert len(s["seconds_ago"]) == 300 // BUCKET_SECONDS and s["seconds_ago"][-1] == 0
    tok = s["output_tokens_per_second"]
    # buckets [990,995) and [995,1000) hold 5 tokens each over 5 s; [1000,1005) holds one, 1 s in
    assert tok[-3:] == [1.0, 1.0, 1.0] and sum(tok[:-3]) == 0
    assert s["ttft_p50_seconds"][-3] == 0.5 and s["ttft_p50_seconds"][-1] is None
    assert s["itl_p50_seconds"][-3:] == [1.0, 1.0, 1.0]
    now[0] += 300
    s = live.summary()["series"]
    assert sum(s["output_tokens_per_second"]) == 0 and set(s["itl_p50_seconds"]) == {None}


def test_live_stats_memory_is_bounded():
    """Seen to fail with the reservoir's cap removed (the bucket kept every gap)."""
    now = [50.0]
    live = LiveStats(clock=lambda: now[0])
    live.observe_result(result(first=50.0, n_tokens=5000, gap=1e-4, submitted=49.0))
    bucket = live._buckets[int(50 // BUCKET_SECONDS)]
    assert len(bucket.itl.values) == SAMPLES_PER_BUCKET and bucket.itl.seen == 4999
    assert abs(live.summary()["series"]["itl_p50_seconds"][-1] - 1e-4) < 1e-6
    for t in range(0, 2000, 7):  # 33 minutes of observations: old buckets are dropped
        now[0] = 50.0 + t
        live.observe_result(result(first=now[0], n_tokens=2, gap=0.5, submitted=now[0] - 0.1))
    assert len(live._buckets) <= 300 // BUCKET_SECONDS + 1


def test_live_stats_refusals_count_the_last_minute_with_the_latest_retry_after():
    now = [100.0]
    live = LiveStats(clock=lambda: now[0])
    live.record_refusal("queue_full", 3)
    now[0] = 130.0
    live.record_refusal("queue_full", 7)
    live.record_refusal("kv_budget_exceeded", None)
    by = live.summary()["refusals"]["by_reason"]
    assert by["queue_full"]["count"] == 2 and by["queue_full"]["retry_after_seconds"] == 7
    assert by["kv_budget_exceeded"] == {"count": 1, "retry_after_seconds": None, "seconds_ago": 0.0}
    now[0] = 165.0  # the first queue_full is 65 s old now
    by = live.summary()["refusals"]["by_reason"]
    assert by["queue_full"]["count"] == 1 and by["queue_full"]["seconds_ago"] == 35.0
    now[0] = 200.0
    assert live.summary()["refusals"]["by_reason"] == {}
