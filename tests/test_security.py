"""Security: the API key guards every /v1 route with a constant-time compare, /health and /metrics stay
open, a non-loopback bind without a key is refused, error bodies leak nothing, and no request can make
the server open a file path it names.

Seen to fail (each break made in a copy of the tree, then restored):
- AuthAndCount comparing keys with `!=` instead of hmac.compare_digest (the spy saw no call);
- AuthAndCount guarding only POST routes (GET /v1/models answered 200 without a key);
- serve() without the loopback check (`kvgate serve --host 0.0.0.0` started serving instead of
  exiting 2; the test timed out waiting for the exit);
- the model_not_found message carrying the module's __file__ (the leak check named the path).
"""

from __future__ import annotations

import builtins
import hmac
import io
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from kvgate.server.auth import keyed_path
from tests.server_util import free_port, running_server
from tests.test_bad_input import CATALOGUE, send

KEY = "s3cret-Key-for-tests"
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hello"}]
TIMEOUT = httpx.Timeout(20.0)

# What must never appear in a public error body.
LEAKS = [
    re.compile(r"Traceback"),
    re.compile(r'File "'),
    re.compile(r"/work\b|/tmp\b|/home/|/root\b|site-packages"),
    re.compile(r"\.py\b"),
    re.compile(r"\b(?=[0-9a-f]*[a-f])[0-9a-f]{16,}\b"),  # uuid-like hex: request or handle ids
    re.compile(r"chatcmpl-|cmpl-"),
    re.compile(r"\b(?:handle|row|request)[ _]?id\b", re.I),
    re.compile(r"0x[0-9a-f]{6,}", re.I),  # object addresses
]


def leaks(text: str) -> list[str]:
    return [p.pattern for p in LEAKS if p.search(text)]


@pytest.fixture(scope="module")
def keyed(tiny_dir):
    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine

    engine = Engine.from_model(
        str(tiny_dir), EngineConfig(memory_limit="1GiB", dtype="float32", device="cpu"), overhead_bytes=0
    )
    engine.start()
    with running_server(engine, api_key=KEY, max_body_bytes=16 * 1024) as (base, app):
        with httpx.Client(base_url=base, timeout=TIMEOUT) as client:
            yield client, app, engine
    engine.shutdown()


def _v1_routes(app) -> list[tuple[str, str]]:
    out = []
    for r in app.routes:
        path = getattr(r, "path", "")
        if keyed_path(path):  # /v1/ (vLLM's root aliases answer without the key, as there)
            for m in sorted(getattr(r, "methods", None) or ()):
                if m != "HEAD":
                    out.append((m, path))
    return out


def test_every_v1_route_needs_the_key_and_health_metrics_stay_open(keyed):
    client, app, _ = keyed
    routes = _v1_routes(app)
    assert {p for _, p in routes} >= {
        CHAT,
        "/v1/completions",
        "/v1/models",
        "/v1/tokenize",
        "/v1/detokenize",
        "/v1/resources",
        "/v1/responses",
    }
    bodies = {
        CHAT: {"messages": MSG, "max_tokens": 2},
        "/v1/completions": {"prompt": "hi", "max_tokens": 2},
        "/v1/tokenize": {"prompt": "hi"},
        "/v1/detokenize": {"tokens": [5, 6]},
        "/tokenize": {"prompt": "hi"},
        "/detokenize": {"tokens": [5, 6]},
        "/v1/responses": {"input": "hi", "max_output_tokens": 2},
        "/v1/messages": {"model": "tiny", "messages": MSG, "max_tokens": 2},
        "/v1/messages/count_tokens": {"model": "tiny", "messages": MSG},
        "/inference/v1/generate": {"token_ids": [5, 6], "sampling_params": {"max_tokens": 2}},
    }
    wrong = [
        None,
        "Bearer nope",
        f"Bearer {KEY}x",
        f"Bearer {KEY[:-1]}",
        f"Basic {KEY}",
        KEY,
        "Bearer",
        f"bearer{KEY}",
        f"Bearer  {KEY}",
    ]
    good = {"Authorization": f"Bearer {KEY}"}
    for method, route in routes:

        def target(route: str = route) -> str:
            path = route.replace("{model_id:path}", "tiny")  # GET /v1/models/{id}: the served model
            if "{response_id}" in route:  # GET / DELETE of a kept response: a fresh one each time
                made = client.post("/v1/responses", json=bodies["/v1/responses"], headers=good)
                path = route.replace("{response_id}", made.json()["id"])
            return path

        path = target()
        for auth in wrong:
            headers = {} if auth is None else {"Authorization": auth}
            r = client.request(method, path, json=bodies.get(path), headers=headers)
            assert r.status_code == 401, (method, path, auth, r.status_code)
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and err["type"] == "authentication_error"
            assert KEY not in r.text and "nope" not in r.text, "the 401 echoes a key"
        served = 400 if route.endswith("/cancel") else 200  # past the key: no background response to cancel
        ok = client.request(method, path, json=bodies.get(path), headers=good)
        assert ok.status_code == served, (method, path, ok.text[:300])
        path = target()
        ok = client.request(method, path, json=bodies.get(path), headers={"Authorization": f"bearer {KEY}"})
        assert ok.status_code == served, "the scheme name is case-insensitive (RFC 7235)"
    for path in ("/health", "/metrics"):
        assert client.get(path).status_code == 200, path
    # vLLM's root aliases answer without the key, as vLLM's do: lm-eval probes them keyless and, on a
    # 401, fell back to a hub download that failed (QA pass 14). Red with them keyed again.
    assert client.get("/tokenizer_info").status_code == 200
    assert client.post("/tokenize", json=bodies["/tokenize"]).json()["tokens"]
    assert client.post("/detokenize", json=bodies["/detokenize"]).status_code == 200


def test_the_key_is_compared_in_constant_time(keyed, monkeypatch):
    """The compare goes through hmac.compare_digest (spied), for right and wrong keys alike."""
    client, _, _ = keyed
    import kvgate.server.auth as app_mod

    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((bytes(a), bytes(b)))
        return real(a, b)

    monkeypatch.setattr(app_mod.hmac, "compare_digest", spy)
    assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert client.get("/v1/models").status_code == 401
    assert calls == [(b"wrong", KEY.encode()), (KEY.encode(), KEY.encode()), (b"", KEY.encode())]


def test_loopback_detection():
    from kvgate.server.run import is_loopback

    for host in ("127.0.0.1", "127.8.9.10", "::1", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.0.0.1", "192.168.1.20", "8.8.8.8", "fe80::1", "no-such-host.invalid"):
        assert not is_loopback(host), host


def _serve_args(**kw):
    base = dict(
        host="127.0.0.1",
        port=0,
        api_key=None,
        allow_unauthenticated=False,
        served_model_name=None,
        max_body_bytes=1 << 20,
        shutdown_grace=1.0,
        responses_store=1 << 20,
        log_level="warning",
        model="default",
        reasoning_parser="auto",
        generation_config="auto",
        log_requests=False,
        max_log_len=None,
    )
    return SimpleNamespace(**{**base, **kw})


def test_non_loopback_bind_without_a_key_exits_2_with_a_clear_message(tiny_dir):
    """A real `kvgate serve --host 0.0.0.0` subprocess: refused before any model load or bind."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    t0 = time.monotonic()
    exe = shutil.which("kvgate", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "kvgate.cli"]
    p = subprocess.run(
        [*cmd, "serve", "--host", "0.0.0.0", "--port", str(port), "--model", str(tiny_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "refusing to bind 0.0.0.0" in p.stderr
    assert "--api-key" in p.stderr and "--allow-unauthenticated" in p.stderr
    assert "Traceback" not in p.stderr
    assert time.monotonic() - t0 < 30
    with socket.socket() as s:  # nothing was ever bound on that port
        s.bind(("0.0.0.0", port))


@pytest.mark.parametrize("extra", [{"allow_unauthenticated": True}, {"api_key": "k"}])
def test_non_loopback_bind_is_allowed_with_a_key_or_the_explicit_flag(monkeypatch, extra, tiny_dir):
    """The allowed path, without binding anything: uvicorn's run and the model load are stubbed."""
    import kvgate.server.run as run_mod

    seen = {}

    def fake_run(self, *a, **k):
        seen["host"] = self.config.host
        seen["api_key"] = self.kv_app.state.settings.api_key

    monkeypatch.setattr(run_mod.GracefulServer, "run", fake_run)
    # Only run.py's view of `threading` is stubbed (no model load thread); the real module is untouched.
    monkeypatch.setattr(
        run_mod,
        "threading",
        SimpleNamespace(Thread=lambda *a, **k: SimpleNamespace(start=lambda: None), Event=threading.Event),
    )
    args = _serve_args(host="0.0.0.0", model=str(tiny_dir), **extra)
    from kvgate.config import ENGINE_FLAGS

    for flag, _typ, default, _help in ENGINE_FLAGS:
        setattr(args, flag.lstrip("-").replace("-", "_"), default)
    assert run_mod.serve(args) == 0
    assert seen == {"host": "0.0.0.0", "api_key": extra.get("api_key")}


def test_no_error_body_leaks_a_trace_a_path_or_an_id(keyed):
    """Across the whole bad-input catalogue (sent with the key), plus 401/404/405/413 bodies."""
    client, _, _ = keyed
    auth = {"Authorization": f"Bearer {KEY}"}
    bodies = []
    for case in CATALOGUE:
        r = send(client, case, headers=auth)
        assert 400 <= r.status_code < 500, (case.id, r.status_code)
        bodies.append((case.id, r.text))
    bodies.append(("401", client.get("/v1/models").text))
    bodies.append(("404-route", client.get("/v1/nothing", headers=auth).text))
    bodies.append(("405", client.delete(CHAT, headers=auth).text))
    for name, text in bodies:
        assert not leaks(text), (name, leaks(text), text[:400])


def test_the_api_never_opens_a_path_taken_from_a_request(keyed, monkeypatch):
    """Model names, prompts and content parts that look like paths are strings, never opened: every
    file-opening entry point is spied while the requests run."""
    client, _, _ = keyed
    opened = []

    def spy(real):
        def wrapper(file, *a, **k):
            opened.append(str(file))
            return real(file, *a, **k)

        return wrapper

    def spy_path_open(real):
        def wrapper(self, *a, **k):
            opened.append(str(self))
            return real(self, *a, **k)

        return wrapper

    auth = {"Authorization": f"Bearer {KEY}"}
    paths = [
        "/etc/passwd",
        "../../../../etc/passwd",
        "file:///etc/passwd",
        "~/.ssh/id_rsa",
        "/proc/self/environ",
    ]
    monkeypatch.setattr(builtins, "open", spy(builtins.open))
    monkeypatch.setattr(io, "open", spy(io.open))
    monkeypatch.setattr(os, "open", spy(os.open))
    monkeypatch.setattr(pathlib.Path, "open", spy_path_open(pathlib.Path.open))
    monkeypatch.setattr(pathlib.Path, "read_text", spy_path_open(pathlib.Path.read_text))
    monkeypatch.setattr(pathlib.Path, "read_bytes", spy_path_open(pathlib.Path.read_bytes))
    for p in paths:
        r = client.post(CHAT, json={"model": p, "messages": MSG}, headers=auth)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        r = client.post("/v1/completions", json={"model": p, "prompt": "x"}, headers=auth)
        assert r.status_code == 404
        r = client.post("/v1/tokenize", json={"model": p, "prompt": "x"}, headers=auth)
        assert r.status_code == 404
        r = client.post(
            CHAT, json={"messages": [{"role": "user", "content": p}], "max_tokens": 2}, headers=auth
        )
        assert r.status_code == 200
        r = client.post(
            CHAT,
            json={
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": p}}]}]
            },
            headers=auth,
        )
        assert r.status_code == 400
    monkeypatch.undo()
    assert opened == [], f"the server opened files while serving requests: {opened}"


def test_a_busy_port_is_refused_before_the_model_loads_with_what_to_do(tiny_dir):
    """A second server on a port another process listens on: exit 2 at once, saying the port is held
    and to stop that process or pass another --port; never that it is starting (QA pass 7: it printed
    "serving on", then died on uvicorn's raw bind error). Red without `port_taken`."""
    exe = shutil.which("kvgate", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "kvgate"]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        p = subprocess.run(
            [*cmd, "serve", "--port", str(port), "--model", str(tiny_dir)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert f"cannot listen on 127.0.0.1:{port}" in p.stderr and "another --port" in p.stderr
    assert "starting on" not in p.stderr and "Traceback" not in p.stderr
