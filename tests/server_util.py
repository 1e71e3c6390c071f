"""Run a real uvicorn server on a free loopback port in a background thread, for tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import uvicorn

from kvgate.server.app import ServerSettings, create_app
from kvgate.server.slow_clients import guarded_http_protocol


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
def running_server(engine, http=None, **settings):
    """`http`: uvicorn's protocol class; by default the one `kvgate serve` runs (request deadlines)."""
    settings.setdefault("model_name", "tiny")
    app = create_app(ServerSettings(**settings), engine)
    port = free_port()
    http = http or guarded_http_protocol()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", http=http))
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


def langchain_weather(base: str, **chat_kw):
    """LangChain's ChatOpenAI pointed at a kvgate server (SmolLM2, greedy, 80 tokens; `chat_kw` adds
    to that) and the `get_weather` tool both LangChain tests bind."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"It is sunny in {city}."

    llm = ChatOpenAI(
        base_url=base + "/v1",
        api_key="unused",
        model="SmolLM2-135M-Instruct",
        temperature=0,
        max_tokens=80,
        **chat_kw,
    )
    return llm, get_weather
