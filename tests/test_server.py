"""HTTP behaviour on the tiny model: pre-header admission, refusals, caps, disconnects, errors.

Each test names the break it was seen to fail against.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from kvgate.core.testing import set_step_hook
from tests.server_util import running_server
from tests.server_util import wait_until as shared_wait_until
from tests.tiny_model import TINY_KV_BYTES_PER_TOKEN

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def shared_base(tiny_dir):
    """One server for the read-only validation tests (each refusal never reaches the engine)."""
    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine

    engine = Engine.from_model(
        str(tiny_dir), EngineConfig(memory_limit="1GiB", dtype="float32"), overhead_bytes=0
    )
    engine.start()
    with running_server(engine) as (base, _):
        yield base
    engine.shutdown()


def slow_steps(engine, seconds: float):
    """Make every engine step take at least `seconds`, so a running request holds its KV for a while."""

    set_step_hook(engine, lambda so: time.sleep(seconds))


def metric(base: str, name: str, labels: str = "") -> float:
    text = httpx.get(base + "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + (labels and "{" + labels + "}")) and not line.startswith("#"):
            if labels or line.split(" ")[0] == name:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_until(pred, timeout=10.0):
    return shared_wait_until(pred, timeout)


def test_chat_and_completion_round_trip_with_usage(make_engine):
    """Seen to fail when usage.total_tokens was not prompt + completion."""
    engine = make_engine()
    with running_server(engine) as (base, _):
        r = httpx.post(base + CHAT, json={"messages": MSG, "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["role"] == "assistant"
        u = body["usage"]
        assert u["completion_tokens"] == 5 and u["total_tokens"] == u["prompt_tokens"] + 5
        assert u["budget_cap"] is None
        r = httpx.post(
            base + "/v1/completions", json={"prompt": ["ab", "cd"], "max_tokens": 3, "temperature": 0}
        )
        assert r.status_code == 200
        assert [c["index"] for c in r.json()["choices"]] == [0, 1]


def test_streaming_sends_role_deltas_finish_usage_and_done(make_engine):
    """Seen to fail when the usage chunk was emitted without stream_options.include_usage."""
    engine = make_engine()
    with running_server(engine) as (base, _):
        body = {"messages": MSG, "max_tokens": 6, "temperature": 0, "stream": True}
        with httpx.stream("POST", base + CHAT, json={**body, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = [ln for ln in r.iter_lines() if ln]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
        with httpx.stream("POST", base + CHAT, json=body) as r:
            chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln and ln != "data: [DONE]"]
        assert all("usage" not in c for c in chunks)


def test_overload_gets_429_before_any_sse_byte_and_counts_each_once(make_engine):
    """16 over-budget streaming requests while the KV is full: each a plain 429 + Retry-After with the
    stable body and no SSE bytes; kvgate_rejections_total rises by exactly 16; a small request then
    succeeds. Seen to fail when headers were sent before admission (SSE 200 then error event)."""
    engine = make_engine(
        kv_cache_bytes=8 * 16 * TINY_KV_BYTES_PER_TOKEN,
        block_size=16,
        max_queue_wait=0,
        min_cap_tokens=10_000,
    )
    slow_steps(engine, 0.02)
    with running_server(engine) as (base, _):
        holder = threading.Thread(
            target=httpx.post,
            args=(base + CHAT,),
            kwargs={"json": {"messages": MSG, "max_tokens": 100, "ignore_eos": True}, "timeout": 60},
        )
        holder.start()
        assert wait_until(lambda: engine.snapshot().kv_blocks_held > 0)
        before = metric(base, "kvgate_rejections_total", 'reason="kv_memory_unavailable"')
        results = []

        def one():
            body = {"messages": MSG, "max_tokens": 60, "stream": True}
            with httpx.stream("POST", base + CHAT, json=body, timeout=30) as r:
                results.append((r.status_code, dict(r.headers), r.read()))

        threads = [threading.Thread(target=one) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == 16
        for status, headers, raw in results:
            assert status == 429, raw
            assert 1 <= int(headers["retry-after"]) <= 60
            assert headers["content-type"].startswith("application/json")
            assert not raw.startswith(b"data:")
            err = json.loads(raw)["error"]
            assert err["type"] == "resource_limit_error" and err["code"] == "kv_memory_unavailable"
        after = metric(base, "kvgate_rejections_total", 'reason="kv_memory_unavailable"')
        assert after - before == 16
        holder.join()
        set_step_hook(engine, None)
        r = httpx.post(base + CHAT, json={"messages": MSG, "max_tokens": 3})
        assert r.status_code == 200


def test_never_fits_is_400_with_numbers_and_a_waiter_streams_once_room_frees(make_engine):
    """Seen to fail when kv_budget_exceeded was reported as 429 (come back later) instead of 400."""
    engine = make_engine(
        kv_cache_bytes=8 * 16 * TINY_KV_BYTES_PER_TOKEN,
        block_size=16,
        max_queue_wait=20,
        min_cap_tokens=10_000,
    )
    with running_server(engine) as (base, _):
        r = httpx.post(base + CHAT, json={"messages": MSG, "max_tokens": 200})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "kv_budget_exceeded"
        assert err["positions_limit"] == 128 and err["limit_bytes"] == 128 * TINY_KV_BYTES_PER_TOKEN
        assert err["estimated_bytes"] > err["limit_bytes"] and "max_tokens" in err["message"]
        slow_steps(engine, 0.01)
        holder = threading.Thread(
            target=httpx.post,
            args=(base + CHAT,),
            kwargs={"json": {"messages": MSG, "max_tokens": 60, "ignore_eos": True}},
        )
        holder.start()
        assert wait_until(lambda: engine.snapshot().kv_blocks_held > 0)
        with httpx.stream(
            "POST", base + CHAT, json={"messages": MSG, "max_tokens": 60, "stream": True}, timeout=30
        ) as r:
            assert r.status_code == 200
            lines = [ln for ln in r.iter_lines() if ln]
        assert lines[-1] == "data: [DONE]"
        holder.join()


def test_queue_full_is_503_with_retry_after(make_engine):
    """Seen to fail when a full queue answered 429 instead of 503."""
    engine = make_engine(
        kv_cache_bytes=8 * 16 * TINY_KV_BYTES_PER_TOKEN,
        block_size=16,
        max_queue=1,
        max_queue_wait=20,
        min_cap_tokens=10_000,
    )
    slow_steps(engine, 0.02)
    with running_server(engine) as (base, _):
        big = {"messages": MSG, "max_tokens": 100, "ignore_eos": True}
        t1 = threading.Thread(target=httpx.post, args=(base + CHAT,), kwargs={"json": big, "timeout": 60})
        t1.start()
        assert wait_until(lambda: engine.snapshot().running)
        t2 = threading.Thread(target=httpx.post, args=(base + CHAT,), kwargs={"json": big, "timeout": 60})
        t2.start()
        assert wait_until(lambda: engine.snapshot().waiting == 1)
        r = httpx.post(base + CHAT, json=big)
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
        assert int(r.headers["retry-after"]) >= 1
        set_step_hook(engine, None)
        t1.join()
        t2.join()


def test_budget_cap_is_reported_in_usage_and_header(make_engine):
    """Unset max_tokens on a pool smaller than the context: capped, and said so. Seen to fail when
    the header was only set for streaming responses."""
    engine = make_engine(kv_cache_bytes=8 * 16 * TINY_KV_BYTES_PER_TOKEN, block_size=16)
    with running_server(engine) as (base, _):
        r = httpx.post(base + CHAT, json={"messages": MSG, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200
        cap = r.json()["usage"]["budget_cap"]
        assert cap["reason"] == "kv_budget"
        assert cap["admitted_max_tokens"] < cap["requested_max_tokens"]
        assert f"admitted={cap['admitted_max_tokens']}" in r.headers["x-kvgate-budget-cap"]
        with httpx.stream(
            "POST", base + CHAT, json={"messages": MSG, "stream": True, "max_tokens": None}
        ) as s:
            assert "x-kvgate-budget-cap" in s.headers
            s.read()


def test_client_disconnect_mid_stream_frees_blocks_and_counts_one_abort(make_engine):
    """Seen to fail when the SSE generator's finally did not cancel the engine request."""
    engine = make_engine()
    slow_steps(engine, 0.02)
    with running_server(engine) as (base, _):
        before = engine.snapshot().counters.aborted
        with httpx.stream(
            "POST", base + CHAT, json={"messages": MSG, "max_tokens": 400, "ignore_eos": True, "stream": True}
        ) as r:
            for n, _line in enumerate(r.iter_lines()):
                if n > 4:
                    break
        assert wait_until(lambda: engine.snapshot().kv_blocks_available == engine.snapshot().kv_blocks_total)
        assert wait_until(lambda: engine.snapshot().counters.aborted == before + 1)
        steps = engine.snapshot().counters.decode_steps
        time.sleep(0.2)
        assert engine.snapshot().counters.decode_steps == steps, "decoding went on for a client that left"


def test_non_streaming_disconnect_cancels_the_request(make_engine):
    """Seen to fail before until_disconnect watched the connection while the result was pending."""
    engine = make_engine()
    slow_steps(engine, 0.02)
    with running_server(engine) as (base, _):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(
                base + CHAT, json={"messages": MSG, "max_tokens": 400, "ignore_eos": True}, timeout=0.5
            )
        assert wait_until(lambda: engine.snapshot().counters.aborted == 1)
        assert wait_until(lambda: engine.snapshot().kv_blocks_available == engine.snapshot().kv_blocks_total)


@pytest.mark.parametrize(
    "field,value",
    [
        ("top_logprobs", 3),  # without logprobs=true
        ("tool_choice", "auto"),  # without tools
        ("functions", [{"name": "f"}]),  # the deprecated form of tools: would change the output
        ("audio", {"voice": "alloy"}),
        ("frobnicate", 1),
    ],
)
def test_unsupported_fields_are_refused_by_name(shared_base, field, value):
    """Seen to fail when unknown fields were dropped silently (extra='ignore'). Issue 13 made
    logprobs, tools, response_format and logit_bias supported (tests/test_compat.py and others)."""
    r = httpx.post(shared_base + CHAT, json={"messages": MSG, field: value})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": "hi"}, "messages"),
        ({"messages": MSG, "max_tokens": "many"}, "max_tokens"),
        ({"messages": MSG, "temperature": -1}, "temperature"),
        ({"messages": MSG, "top_p": 0}, "top_p"),
        ({"messages": MSG, "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({}, "messages"),
    ],
)
def test_schema_and_value_errors_are_readable_400s(shared_base, body, param):
    """Seen to fail with FastAPI's raw 422 before bodies were validated by hand."""
    r = httpx.post(shared_base + CHAT, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param


def test_api_key_guards_v1_routes_and_leaves_health_and_metrics_open(make_engine):
    """Seen to fail when the middleware compared keys only on POST routes."""
    engine = make_engine()
    with running_server(engine, api_key="sekret") as (base, _):
        assert httpx.get(base + "/v1/models").status_code == 401
        assert (
            httpx.post(
                base + CHAT, json={"messages": MSG}, headers={"Authorization": "Bearer nope"}
            ).status_code
            == 401
        )
        ok = httpx.post(
            base + CHAT, json={"messages": MSG, "max_tokens": 2}, headers={"Authorization": "Bearer sekret"}
        )
        assert ok.status_code == 200
        assert httpx.get(base + "/health").status_code == 200
        assert httpx.get(base + "/metrics").status_code == 200


def test_body_limit_unknown_model_and_unknown_route(make_engine):
    """Seen to fail when the body limit was only checked against Content-Length."""
    engine = make_engine()
    with running_server(engine, max_body_bytes=1000) as (base, _):
        r = httpx.post(base + CHAT, content=json.dumps({"messages": MSG, "user": "x" * 2000}))
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

        def chunks():
            yield b'{"messages": [], "user": "'
            yield b"y" * 4000
            yield b'"}'

        r = httpx.post(base + CHAT, content=chunks())
        assert r.status_code == 413
        r = httpx.post(base + CHAT, json={"model": "gpt-9", "messages": MSG})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert httpx.get(base + "/v1/nothing").json()["error"]["code"] == "not_found"


def test_health_metrics_resources_tokenize(make_engine):
    """Seen to fail when /v1/resources reported blocks_free from a stale copy of the allocator; the KV
    cache's dtype as resolved (float16 under auto on a CPU) is named (red without the field)."""
    engine = make_engine()
    with running_server(engine) as (base, _):
        assert httpx.get(base + "/health").json() == {"status": "ok"}
        res = httpx.get(base + "/v1/resources").json()
        assert res["kv"]["blocks_free"] == res["kv"]["blocks_total"] == engine.plan.kv_blocks
        assert res["kv"]["dtype"] == str(engine.kv_dtype).removeprefix("torch.") == "float16"
        assert res["ledger"]["reserved_bytes"] <= res["ledger"]["limit_bytes"]
        assert set(res["ledger"]["reserved_by_role"]) >= {"weights", "kv_cache", "workspace"}
        proc = res["process"]  # measured beside the ledger: resident now <= the peak so far
        assert 0 < proc["rss_bytes"] <= proc["peak_rss_bytes"] and "load_peak_rss_bytes" in proc
        ids = httpx.post(base + "/v1/tokenize", json={"prompt": "hello"}).json()["tokens"]
        assert httpx.post(base + "/v1/detokenize", json={"tokens": ids}).json()["prompt"] == "hello"
        bad = httpx.post(base + "/v1/detokenize", json={"tokens": [10**9]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        # vLLM's root aliases, as lm-eval's tokenizer_backend=auto probes them (QA pass 8's L1; red
        # without routes.ROOT_ALIASES: 404)
        info = httpx.get(base + "/tokenizer_info").json()
        assert info["eos_token"] == engine.tokenizer.token_text(engine.tokenizer.info.eos_token_id)
        assert info["chat_template"] and info["model_max_length"] == engine.max_model_len
        probe = httpx.post(base + "/tokenize", json={"prompt": "hello", "add_special_tokens": False}).json()
        assert probe["tokens"] == ids[-len(probe["tokens"]) :] and len(probe["tokens"]) >= 1
        assert httpx.post(base + "/detokenize", json={"tokens": ids}).json()["prompt"] == "hello"
        httpx.post(base + CHAT, json={"messages": MSG, "max_tokens": 3})
        text = httpx.get(base + "/metrics").text
        for name in (
            "kvgate_requests_total",
            "kvgate_requests_running",
            "kvgate_requests_waiting",
            "kvgate_kv_blocks_total",
            "kvgate_kv_blocks_free",
            "kvgate_kv_blocks_peak",
            "kvgate_kv_usage_ratio",
            "kvgate_memory_limit_bytes",
            "kvgate_memory_reserved_bytes",
            "kvgate_budget_caps_total",
            "kvgate_prompt_tokens_total",
            "kvgate_generation_tokens_total",
            "kvgate_aborted_total",
            "kvgate_prefill_chunks_total",
            "kvgate_decode_steps_total",
            "kvgate_time_to_first_token_seconds",
            "kvgate_inter_token_latency_seconds",
            "kvgate_e2e_request_latency_seconds",
            "kvgate_queue_time_seconds",
        ):
            assert name in text, name


def test_health_is_503_while_loading_and_engine_metrics_are_absent():
    """Absent is not zero: before the engine exists no kv_* metric is emitted. Seen to fail when the
    collector reported zeros for a missing engine."""
    with running_server(None) as (base, _):
        r = httpx.get(base + "/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        assert "kvgate_kv_blocks_total" not in httpx.get(base + "/metrics").text
        r = httpx.post(base + CHAT, json={"messages": MSG})
        assert r.status_code == 503 and "retry-after" in r.headers
        # the model list too (QA pass 16: a 200 card without max_model_len, cached by LiteLLM for 300 s);
        # red with the card answered while loading
        r = httpx.get(base + "/v1/models")
        assert (r.status_code, r.json()["error"]["code"]) == (503, "not_ready") and "retry-after" in r.headers
