"""`--log-requests` (kvgate/server/request_log.py): request bodies and answers' outcomes in the log.

QA pass 17 had to put a logging proxy in front of the server to see what six client libraries sent;
vLLM has `--enable-log-requests` with `--max-log-len` for that. Each test says what was broken to see
it red.
"""

from __future__ import annotations

import logging

import httpx
import pytest

from kvgate.cli import build_parser
from tests.server_util import running_server
from tests.tiny_model import make_tiny_hf_dir

BODY = {
    "messages": [{"role": "user", "content": "Hello there, tiny model"}],
    "max_tokens": 5,
    "temperature": 0,
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine

    d = make_tiny_hf_dir(tmp_path_factory.mktemp("tiny_log"))
    cfg = EngineConfig(kv_cache_bytes=8 << 20, memory_limit="2GiB", dtype="float32", device="cpu")
    e = Engine.from_model(str(d), cfg, overhead_bytes=0).start()
    yield e
    e.shutdown()


def logged(engine, caplog, **settings) -> list[str]:
    with (
        caplog.at_level(logging.INFO, logger="kvgate.requests"),
        running_server(engine, **settings) as (base, _),
    ):
        for stream in (False, True):
            r = httpx.post(
                base + "/v1/chat/completions",
                json={**BODY, "stream": stream},
                timeout=60,
                headers={"X-Request-Id": f"qa-{int(stream)}"},
            )
            assert r.status_code == 200, r.text
    return [r.getMessage() for r in caplog.records if r.name == "kvgate.requests"]


def test_bodies_and_outcomes_are_logged_only_when_asked(engine, caplog):
    """On: the body as sent, under the request's id, and one line per finished choice (finish reason,
    token counts, times), whole and streamed. Off (the default): nothing. Seen red with the `body`
    call left out of `read_body` and with the `outcome` call left out of `serving.on_result`."""
    lines = logged(engine, caplog, log_requests=True)
    for rid in ("qa-0", "qa-1"):
        (body,) = [m for m in lines if m.startswith(f"request {rid} POST /v1/chat/completions: body ")]
        assert "Hello there, tiny model" in body
        (end,) = [m for m in lines if m.startswith(f"request {rid}: finished ")]
        assert "finished length" in end and "+ 5 generated" in end and "first token" in end, end
    caplog.clear()
    assert logged(engine, caplog) == []


def test_max_log_len_cuts_the_body_and_says_how_much(engine, caplog):
    """Seen red with the limit ignored in `request_log.body`."""
    lines = logged(engine, caplog, log_requests=True, max_log_len=12)
    body = next(m for m in lines if ": body " in m)
    assert body.split(": body ", 1)[1].startswith('{"messages":') and "Hello" not in body
    assert "bytes in all)" in body


def test_the_flags_parse_for_serve_and_cluster():
    a = build_parser().parse_args(["serve", "--log-requests", "--max-log-len", "100"])
    assert a.log_requests is True and a.max_log_len == 100
    assert build_parser().parse_args(["serve"]).log_requests is False
    c = build_parser().parse_args(["cluster", "--log-requests"])
    assert c.log_requests is True and c.max_log_len is None
