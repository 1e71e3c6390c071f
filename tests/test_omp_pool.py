"""The thread that builds and starts an engine leaves no OpenMP pool behind (kvgate.core.omp_pool).

Two pools on a 2-CPU machine make libgomp throttle its barriers, and a one-row step ran ~2.7x slower
on the worker; these tests check the mechanism (the pool's threads exit), not a timing. Seen red: with
the `release_calling_thread_pool()` call dropped from `Engine.start`, the engine test fails (the
building thread's pool thread stays alive); with the `omp_pause_resource_all` call replaced by `rc = 0`,
both fail.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from kvgate.core.omp_pool import release_calling_thread_pool

pytestmark = [
    pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU: no second OpenMP thread"),
    pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc/self/task"),
]


@pytest.fixture(autouse=True)
def two_threads():
    """Two intra-op threads for the test (an engine built earlier with --threads 1 leaves one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def task_ids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def on_fresh_thread(fn):
    """Run fn on a new thread (its OpenMP pool starts empty, whatever the main thread's holds)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # handed to the test's thread
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def make_pool() -> set[int]:
    """Start a parallel region on this thread; the thread ids its pool added."""
    before = task_ids()
    torch.ones(1 << 24).sum()  # far past ATen's grain: runs on every OpenMP thread
    return task_ids() - before


def gone(tids: set[int], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not tids & task_ids():
            return True
        time.sleep(0.01)
    return False


def test_release_ends_the_calling_threads_pool_threads():
    def body():
        pool = make_pool()
        assert pool, "a 2-thread parallel region added no thread"
        assert release_calling_thread_pool() == ""
        return pool, gone(pool)

    pool, ended = on_fresh_thread(body)
    assert ended, f"pool threads {sorted(pool)} still alive after the release"


def test_engine_start_frees_the_building_threads_pool(tiny_dir):
    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine

    def body():
        before = task_ids()
        e = Engine.from_model(
            str(tiny_dir),
            EngineConfig(kv_cache_bytes=16 << 20, dtype="float32", device="cpu"),
            overhead_bytes=0,
        )
        make_pool()  # building may have made the pool already
        pool = task_ids() - before
        assert pool
        e.start()
        try:
            return pool, gone(pool)
        finally:
            e.shutdown()

    pool, ended = on_fresh_thread(body)
    assert ended, f"the building thread's pool threads {sorted(pool)} outlived Engine.start()"
