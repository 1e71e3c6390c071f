"""Server processes the benchmarks start and stop themselves (by their own PID only), on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def log(msg: str, tag: str = "compare") -> None:
    print(f"[{tag} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def rel(p: Path | str) -> str:
    p = Path(p)
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return str(p)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process we start and stop ourselves (by its own PID only)."""

    def __init__(self, name: str, cmd: list[str], ready_url: str, log_path: Path, env: dict | None = None):
        self.name, self.cmd, self.ready_url, self.log_path = name, cmd, ready_url, log_path
        self.env = env
        self.proc: subprocess.Popen | None = None

    def command_line(self) -> str:
        """The command as a shell line, led by the variables its environment sets beyond the caller's."""
        added = [f"{k}={v}" for k, v in (self.env or {}).items() if os.environ.get(k) != v]
        return shlex.join(added + self.cmd)

    def start(self, timeout: float = 600) -> Server:
        import httpx

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        log(f"starting {self.name}: {shlex.join(self.cmd)}")
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT, env=self.env
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}; see {rel(self.log_path)}"
                )
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = httpx.get(self.ready_url, timeout=2)
                if r.status_code == 200:
                    log(f"{self.name} ready (pid {self.proc.pid})")
                    return self
                body = r.json() if r.status_code == 503 else {}
                if body.get("status") == "failed":  # kvgate's /health after a failed load
                    self.stop()
                    raise RuntimeError(f"{self.name} failed to load: {body.get('reason')}")
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f}s; see {rel(self.log_path)}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()
        log(f"stopped {self.name}")

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
