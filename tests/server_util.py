"""Run a real uvicorn server on a free loopback port in a background thread, for tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import uvicorn

from kvgate.server.app import ServerSettings, create_app


def wait_until(pred, timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Poll `pred` until it is true or `timeout` seconds pass; return whether it became true."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(engine, **settings):
    settings.setdefault("model_name", "tiny")
    app = create_app(ServerSettings(**settings), engine)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=1).status_code in (200, 503):
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    try:
        yield base, app
    finally:
        server.should_exit = True
        thread.join(timeout=10)
