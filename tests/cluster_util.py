"""Helpers for tests/test_cluster.py: replica views and a scripted Serve handle (no Ray), and a real
local Ray Serve cluster of tiny-model replicas (with Ray)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import threading
import time

import httpx

from kvgate.cluster.routing import Demand
from kvgate.cluster.views import ReplicaView
from kvgate.core.snapshot import Counters, EngineSnapshot, RowView
from tests.server_util import free_port, wait_until
from tests.tiny_model import TINY_KV_BYTES_PER_TOKEN

BLOCK = 16
POOL_BLOCKS = 28  # 448 positions per replica: below the tiny model's 512-position context


def snapshot(**kw) -> EngineSnapshot:
    """An EngineSnapshot with every field not given set to its type's empty value (robust to new
    fields of the engine's snapshot)."""
    empty = {"int": 0, "float": 0.0, "tuple": (), "frozenset": frozenset(), "Counters": Counters()}
    values = {}
    for f in dataclasses.fields(EngineSnapshot):
        kind = str(f.type)
        if f.name in kw:
            values[f.name] = kw[f.name]
        elif f.default is not dataclasses.MISSING:
            values[f.name] = f.default
        else:
            values[f.name] = None if "None" in kind else empty[kind.split("[")[0]]
    return EngineSnapshot(**values)


def rows(*ending: tuple[int, int]) -> tuple[RowView, ...]:
    """Running rows as (steps left, blocks held)."""
    return tuple(RowView(i + 1, steps, blocks, 4, 0, 0, steps) for i, (steps, blocks) in enumerate(ending))


def view(tag: str, free: int = 28, ending: tuple = (), **kw) -> ReplicaView:
    """A replica's view; `ending`: its running rows as (steps left, blocks held)."""
    base = dict(
        replica=tag,
        version=1,
        admitted=0,
        healthy=True,
        reason=None,
        blocks_total=28,
        blocks_available=free,
        block_size=BLOCK,
        running=0,
        waiting=0,
        max_seqs=8,
        max_queue=16,
        max_queue_wait=0.0,
        step_time=0.02,
        retry_after=1,
        ledger_limit=1 << 30,
        ledger=[],
        pid=0,
        snapshot=snapshot(rows=rows(*ending), kv_blocks_total=28, kv_blocks_free=free),
    )
    base.update(kw)
    return ReplicaView(**base)


class FakeStream:
    """A replica's response stream: scripted messages, or an exception instead of the first one."""

    def __init__(self, script):
        self.script = list(script) if not isinstance(script, BaseException) else script
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if isinstance(self.script, BaseException):
            raise self.script
        if not self.script:
            raise StopAsyncIteration
        return self.script.pop(0)

    def cancel(self):
        self.cancelled = True


class FakeHandle:
    """Stands in for Serve's handle to the replicas: `answer(target, wait)` scripts each call."""

    def __init__(self, answer):
        self.answer = answer
        self.calls: list[tuple[str | None, bool]] = []
        self.streams: list[FakeStream] = []

    def options(self, stream: bool = False):
        return self

    @property
    def generate(self):
        return self

    def remote(self, requests, n, wait, demand, route=None):
        target = (route or {}).get("target")
        self.calls.append((target, wait))
        s = FakeStream(self.answer(target, wait))
        self.streams.append(s)
        return s


class PendingHandle(FakeHandle):
    """Every call stays unanswered (in flight to its replica) until the test answers it; `routes`
    keeps what the ingress sent with each call."""

    def __init__(self):
        super().__init__(lambda t, w: [])
        self.routes: list[dict] = []
        self.answers: list[asyncio.Future] = []

    def remote(self, requests, n, wait, demand, route=None):
        self.calls.append(((route or {}).get("target"), wait))
        self.routes.append(route or {})
        answer = asyncio.get_running_loop().create_future()
        self.answers.append(answer)

        class Pending(FakeStream):
            async def __anext__(self):
                return await answer

        return Pending([])


class FakeCall:
    def __init__(self, blocks: int = 4, rows: int = 1):
        self.requests, self.n, self.demand = [], 1, Demand(blocks, rows)


def admitted(tag: str, seq: int = 1, **kw):
    return [("admitted", {"admitted": ["A"], "seq": seq, "view": view(tag, version=2, admitted=seq, **kw)})]


def refused(tag: str, retry: int, status: int = 429, code: str = "kv_memory_unavailable", **kw):
    body = {"code": code, "message": f"{tag} is full", "status": status, "retry_after": retry}
    return [("refused", {"refusal": body, "view": view(tag, version=2, retry_after=retry, **kw)})]


# ---- a real cluster ---------------------------------------------------------------------------------
ENGINE = dict(
    kv_cache_bytes=POOL_BLOCKS * BLOCK * TINY_KV_BYTES_PER_TOKEN,
    block_size=BLOCK,
    max_seqs=8,
    max_queue_wait=0.0,  # a replica refuses at once what does not fit: the cluster's 429 is immediate
    dtype="float32",
    device="cpu",
    memory_limit="2GiB",
    threads=1,
)


@contextlib.contextmanager
def local_cluster(model_dir, replicas: int = 2, router: str = "kvgate", step_delay: float = 0.02, **engine):
    """Ray on 2 logical CPUs, Serve on a free loopback port, `replicas` tiny-model replicas; yields
    the base URL once every replica is ready, and shuts Serve and Ray down after."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    from kvgate.cluster.app import ClusterOptions
    from kvgate.cluster.cli import launch, shutdown

    port = free_port()
    opts = ClusterOptions(
        model=str(model_dir),
        replicas=replicas,
        engine={**ENGINE, **engine},
        replica_cpus=0.5,
        ingress_cpus=0.5,
        router=router,
        stats_period=0.2,
        health_period=1.0,
        served_model_name="tiny",
        step_delay=step_delay,
    )
    try:
        launch(opts, "127.0.0.1", port, num_cpus=2, quiet=True)
        base = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: ready(base) == replicas, timeout=90, interval=0.2), (
            "cluster never became ready"
        )
        yield base
    finally:
        with contextlib.suppress(Exception):
            shutdown(local=True)
        import ray

        ray.shutdown()


def health(base: str) -> dict:
    try:
        return httpx.get(base + "/health", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return {}


def ready(base: str) -> int:
    return health(base).get("replicas_ready", 0)


def replica_views(base: str) -> dict[str, dict]:
    r = httpx.get(base + "/v1/resources", timeout=5)
    assert r.status_code == 200, f"/v1/resources answered {r.status_code}: {r.text}"
    return {v["replica"]: v for v in r.json()["replicas"]}


def idle(base: str) -> bool:
    views = replica_views(base)
    return bool(views) and all(v["running"] == 0 and v["waiting"] == 0 for v in views.values())


def route_attempts(base: str) -> dict[str, int]:
    """The ingress's `kvgate_cluster_route_attempts_total` by outcome."""
    out = {}
    for line in httpx.get(base + "/metrics", timeout=5).text.splitlines():
        if line.startswith("kvgate_cluster_route_attempts_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = int(float(line.rsplit(" ", 1)[1]))
    return out


def kill_replica(tag: str) -> None:
    """Kill the Serve replica actor whose tag is `tag` (Serve then starts a replacement)."""
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    name = next(n for n in names if n.startswith("SERVE_REPLICA::") and n.endswith("#" + tag))
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)


def settle(base: str, timeout: float = 20.0) -> None:
    assert wait_until(lambda: idle(base), timeout=timeout, interval=0.1), (
        f"replicas still busy: {replica_views(base)}"
    )
    time.sleep(0.3)  # one stats period, so the ingress's views are idle too


def body(max_tokens: int, prompt: str = "hello", stream: bool = True) -> dict:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


class Stream:
    """A streaming completion read on a thread: status, replica header, and every SSE data line."""

    def __init__(self, base: str, payload: dict):
        self.lines: list[str] = []
        self.status = None
        self.replica = None
        self.started = threading.Event()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(base, payload), daemon=True)
        self._t.start()
        assert self.started.wait(30), "no response headers within 30 s"

    def _run(self, base, payload):
        with httpx.Client(timeout=60) as c, c.stream("POST", base + "/v1/completions", json=payload) as r:
            self.status, self.replica = r.status_code, r.headers.get("x-kvgate-replica")
            self.started.set()
            for line in r.iter_lines():
                if line:
                    self.lines.append(line)
                if self._stop.is_set():
                    return

    def close(self):
        self._stop.set()
        self._t.join(10)

    def done(self) -> bool:
        return not self._t.is_alive()
