"""Clients that never finish sending a request do not hold connections (kvgate.server.slow_clients).

uvicorn times a connection out only between requests: a client that sent nothing, part of a head, or
a head and less body than its Content-Length kept its connection for good (reproduced on `kvgate
serve`: all three still open after 40 s; a few hundred such clients use up the descriptors). Now a
head must be complete `head_seconds` after it began and a body may not stall `body_idle_seconds`:
a 408 (kvgate's JSON error, `Connection: close`) where a request had begun, a quiet close where
nothing came. Here both deadlines are 1 s, on each HTTP protocol uvicorn may pick (httptools, h11).

Seen red: with `guarded_http_protocol` returning uvicorn's own classes (the deadlines off), 11 of the
13 failed: the sockets of the 408 and close tests were still open at their 6 s read timeout, the
pipelined partial request behind the stream never got its 408, and the `kvgate serve` test timed out
the same way. The slow-but-steady body and keep-alive test passed both ways, as it should: it guards
against deadlines that cut what is not the client's fault.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from kvgate.core.testing import set_step_hook
from kvgate.server.slow_clients import HttpToolsProtocol, guarded_http_protocol
from tests.server_util import free_port, running_server, wait_until

DEADLINE = 1.0
KINDS = ["h11"] + (["httptools"] if HttpToolsProtocol is not None else [])
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"


@pytest.fixture(scope="module", params=KINDS)
def server(request, tiny_dir):
    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine

    cfg = EngineConfig(kv_cache_bytes=16 << 20, memory_limit="2GiB", dtype="float32", device="cpu")
    engine = Engine.from_model(str(tiny_dir), cfg, overhead_bytes=0).start()
    proto = guarded_http_protocol(DEADLINE, DEADLINE, kind=request.param)
    with running_server(engine, http=proto) as (base, _app):
        yield base, engine
    engine.shutdown()


def connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.settimeout(6)
    return s


def read_until_closed(s: socket.socket) -> tuple[bytes, float]:
    t0, got = time.monotonic(), b""
    while chunk := s.recv(65536):
        got += chunk
    return got, time.monotonic() - t0


def timeout_error(raw: bytes) -> dict:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), raw[:300]
    assert b"connection: close" in head.lower()
    err = json.loads(body)["error"]
    assert err["code"] == "request_timeout" and err["timeout_seconds"] == DEADLINE, err
    assert "send the whole request" in err["message"], err
    return err


def test_a_connection_that_sends_nothing_is_closed(server):
    with connect(server[0]) as s:
        got, took = read_until_closed(s)
    assert got == b"" and took < DEADLINE + 2, took


def test_a_partial_head_gets_a_408_and_a_close(server):
    with connect(server[0]) as s:
        s.sendall(HEAD)
        got, took = read_until_closed(s)
    err = timeout_error(got)
    assert "request head" in err["message"] and took < DEADLINE + 2, (err, took)


def test_a_trickled_head_does_not_reset_the_clock(server):
    """The slowloris proper: a header line every 0.3 s keeps bytes coming, the head never ends."""
    with connect(server[0]) as s:
        t0, first = time.monotonic(), b""
        s.sendall(HEAD)
        s.settimeout(0.3)
        for i in range(20):
            try:
                first = s.recv(65536)  # the answer came: stop sending (a write after the close is an RST)
                break
            except TimeoutError:
                s.sendall(b"X-Slow-%d: y\r\n" % i)
        s.settimeout(6)
        got = first + read_until_closed(s)[0]
    assert time.monotonic() - t0 < DEADLINE + 2
    assert "request head" in timeout_error(got)["message"]


def test_a_body_shorter_than_its_content_length_gets_a_408(server):
    with connect(server[0]) as s:
        s.sendall(HEAD + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n" + b'{"prompt":')
        got, took = read_until_closed(s)
    err = timeout_error(got)
    assert (err["body_bytes_received"], err["content_length"]) == (10, 100), err
    assert "10 bytes of the 100 bytes" in err["message"] and took < DEADLINE + 2, (err, took)


def test_a_client_gone_mid_body_is_a_quiet_499(server, caplog):
    """A client that leaves while its body comes in (or whose body stalled past the deadline) is a 499
    in the request counts and one info line, not two ERROR tracebacks (the app's 500 handler, then
    uvicorn's "Exception in ASGI application"). Seen red without the ClientDisconnect handler."""
    base = server[0]
    count = lambda: _requests_total(base, "/v1/completions", "499")  # noqa: E731
    before = count()
    with caplog.at_level("INFO"):
        with connect(base) as s:
            s.sendall(HEAD + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n" + b'{"prompt":')
            time.sleep(0.2)
        assert wait_until(lambda: count() == before + 1, 5)
    errors = [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    assert not errors, [r.getMessage() for r in errors]


def _requests_total(base: str, endpoint: str, code: str) -> float:
    for line in httpx.get(base + "/metrics").text.splitlines():
        if (
            line.startswith("kvgate_requests_total{")
            and f'endpoint="{endpoint}"' in line
            and f'status="{code}"' in line
        ):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_slow_but_steady_body_and_a_keep_alive_gap_are_fine(server):
    """The body's deadline is idleness, not total time: 2.5 s of pieces 0.5 s apart is one request.
    Then, on the same connection, a pause longer than the head deadline before the next request: the
    clock starts with the next head, not at the end of the last response."""
    base, _ = server
    body = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
    with connect(base) as s:
        s.sendall(HEAD + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
        for i in range(0, len(body), len(body) // 5 + 1):
            time.sleep(0.5)
            s.sendall(body[i : i + len(body) // 5 + 1])
        head = s.recv(65536)
        assert head.startswith(b"HTTP/1.1 200 "), head[:300]
    conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().read() and conn.sock is not None
    time.sleep(DEADLINE * 1.5)
    conn.request("GET", "/health")  # a closed connection would raise RemoteDisconnected here
    assert conn.getresponse().status == 200
    conn.close()


def test_normal_streaming_and_large_requests_still_work(server):
    """A stream that runs past both deadlines, with a partial next request pipelined behind it, is
    sent whole; the partial request gets its 408 only after. A 4 MB body at loopback speed is read."""
    base, engine = server
    with httpx.Client(base_url=base, timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
        big = c.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 1, "user": "u" * ((4 << 20) - 200)}
        )
        assert big.status_code in (200, 400, 413) and big.status_code != 408, big.text[:300]
    set_step_hook(engine, lambda so: time.sleep(0.05))
    try:
        stream = {"stream": True, "stream_options": {"include_usage": True}}
        body = json.dumps({"prompt": "hello", "max_tokens": 50, "ignore_eos": True, **stream}).encode()
        with connect(base) as s:
            t0 = time.monotonic()
            s.sendall(HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body + HEAD)  # + the partial one
            got, _ = read_until_closed(s)
    finally:
        set_step_hook(engine, None)
    stream, rest = got[: got.find(b"HTTP/1.1 408 ")], got[got.find(b"HTTP/1.1 408 ") :]
    assert time.monotonic() - t0 > DEADLINE * 2  # the stream outlived both deadlines
    assert stream.startswith(b"HTTP/1.1 200 ") and b"data: [DONE]" in stream, got[-500:]
    assert b'"completion_tokens": 50' in stream, stream[-600:]
    timeout_error(rest)


BOOT = """
import sys
from kvgate.server import slow_clients
slow_clients._RequestDeadlines.head_seconds = slow_clients._RequestDeadlines.body_idle_seconds = 1.0
from kvgate.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_kvgate_serve_runs_the_deadlines(tiny_dir, tmp_path):
    """The real CLI (`kvgate.server.run.serve`) serves with them: a partial head gets its 408."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_") or k == "KVGATE_EXT_DIR"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH")) if p)
    args = ["serve", "--model", str(tiny_dir), "--port", str(port), "--dtype", "float32", "--device", "cpu"]
    args += ["--threads", "1", "--kv-cache-bytes", str(16 << 20), "--memory-limit", "1GiB"]
    with open(tmp_path / "serve.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", BOOT, *args], stdout=log, stderr=subprocess.STDOUT, env=env
        )
    try:
        base = f"http://127.0.0.1:{port}"
        end = time.monotonic() + 120
        while time.monotonic() < end:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        with connect(base) as s:
            s.sendall(HEAD)
            got, took = read_until_closed(s)
        assert "request head" in timeout_error(got)["message"] and took < DEADLINE + 2, took
    finally:
        proc.kill()
        proc.wait(10)


def test_a_uvicorn_whose_state_moved_serves_on_without_deadlines(tiny_dir, monkeypatch, caplog):
    """The deadlines read uvicorn's protocol state, which is not public API: where a release moves it,
    requests are still served (the deadlines off, a warning logged once) instead of every connection
    failing. Seen red without the guard in `data_received` (the request's connection was dropped)."""
    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine
    from kvgate.server import slow_clients

    def moved(self):
        raise AttributeError("'H11Protocol' object has no attribute 'conn'")

    monkeypatch.setattr(slow_clients._H11Deadlines, "_phase", moved)
    monkeypatch.setattr(slow_clients, "_off", [])
    cfg = EngineConfig(kv_cache_bytes=16 << 20, memory_limit="2GiB", dtype="float32", device="cpu")
    engine = Engine.from_model(str(tiny_dir), cfg, overhead_bytes=0).start()
    try:
        proto = guarded_http_protocol(DEADLINE, DEADLINE, kind="h11")
        with (
            caplog.at_level("WARNING", logger="kvgate.serve"),
            running_server(engine, http=proto) as (base, _),
        ):
            for _ in range(2):
                r = httpx.post(
                    base + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3}
                )
                assert r.status_code == 200, r.text
        assert sum("request deadlines off" in m for m in caplog.messages) == 1
    finally:
        engine.shutdown()


def test_a_response_nobody_reads_is_cut_and_its_logprobs_come_back(tmp_path):
    """A client that asks for a long stream with top_logprobs 20 and reads nothing: once the buffers are
    full and nothing drains for `send_stall_seconds` (here 1 s), the connection is cut, the row is
    cancelled and its logprobs reservation comes back (QA pass 10: held 90 s after the row ended, until
    the client read). Seen red with `send_stall_seconds` never firing (the bytes stayed held)."""
    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine
    from tests.tiny_model import TINY_KV_BYTES_PER_TOKEN, make_tiny_hf_dir

    model = make_tiny_hf_dir(tmp_path / "long", geometry={"max_pos": 8192})
    cfg = EngineConfig(
        kv_cache_bytes=8192 * TINY_KV_BYTES_PER_TOKEN, memory_limit="2GiB", dtype="float32", device="cpu"
    )
    engine = Engine.from_model(str(model), cfg, overhead_bytes=0).start()
    body = json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8000, "stream": True}
        | {"ignore_eos": True, "logprobs": True, "top_logprobs": 20}
    ).encode()
    try:
        proto = guarded_http_protocol(30, 30, send_stall_seconds=1.0)
        with running_server(engine, http=proto) as (base, _):
            s = connect(base)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            s.sendall(head.encode() + body)  # and never read
            assert wait_until(lambda: engine.snapshot().logprobs_bytes_held > 0, 10)
            cut = wait_until(
                lambda: engine.snapshot().logprobs_bytes_held == 0 and engine.snapshot().running == 0, 60
            )
            assert cut, (engine.snapshot().logprobs_bytes_held, engine.snapshot().running)
            s.close()
    finally:
        engine.shutdown()
