"""The engine's thread contract and the core defects of issue 11, each pinned by a test.

Each defect was first reproduced against the code before the fix (commit a87aed9), with a script run
on that tree; what it printed is quoted in the test's docstring. Each test below was then seen red
against the sabotage it names, and green after restoring the code.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvgate.core.kv_cache import DoubleRelease, KVCacheManager
from kvgate.core.testing import set_step_hook
from kvgate.request import Admitted, Finished, GenerationRequest, Refusal, Refused
from kvgate.sampling import SamplingParams
from tests.server_util import wait_until


def prompt(n: int, salt: int = 0) -> list[int]:
    return [3 + (i * 7 + salt * 11) % 250 for i in range(n)]


def req(P: int, max_tokens: int, salt: int = 0) -> GenerationRequest:
    return GenerationRequest(
        prompt(P, salt), SamplingParams(temperature=0.8, seed=salt), max_tokens, ignore_eos=True
    )


def all_free(e) -> bool:
    s = e.snapshot()
    return s.idle and s.kv_blocks_available == s.kv_blocks_total


def test_a_request_arriving_while_a_row_finishes_gets_an_answer_not_an_error(make_engine):
    """The worker is parked in the middle of a row's exit (the row gone from `running`, its blocks not
    yet back) while a request with --max-ttft arrives: the admission gate answers from the published
    snapshot and never sees the half-finished row.

    Before the fix (a87aed9) the same moment (a running row whose `blocks` is already None) made
    `predicted_ttft` raise `TypeError: object of type 'NoneType' has no len()`, a 500 for the client.
    Seen red here when `Engine.snapshot()` is built from the live state on the caller's thread
    (`self.core.state.snapshot()`) instead of returning the published one: it then shows the blocks of
    a row that is no longer there (the assertion on `rows`)."""
    e = make_engine(block_size=4, max_seqs=1, max_ttft=30.0)
    e.generate(req(40, 2), timeout=20)  # times a prefill: the forecast needs one
    kv = e.core.state.kv
    parked, release = threading.Event(), threading.Event()
    free = kv.free

    def slow_free(rid):
        parked.set()  # the row has left `running`; its blocks are not back yet
        assert release.wait(10)
        return free(rid)

    kv.free = slow_free
    h = e.submit(req(8, 6, salt=1))
    assert parked.wait(10)  # the worker is inside finish(): row gone, blocks not back, event not sent
    snap = e.snapshot()
    assert sum(r.blocks for r in snap.rows) == snap.kv_blocks_held, "a half-finished row is visible"
    try:
        late = e.submit(req(8, 4, salt=2))
    except Refusal as r:
        late = r
    release.set()
    kv.free = free
    assert h.result(10).finish_reason == "length"
    if not isinstance(late, Refusal):
        assert late.result(10).finish_reason == "length"
    assert wait_until(lambda: all_free(e))


def test_a_drain_refuses_the_queue_at_once_and_lets_running_rows_finish(make_engine):
    """Shutdown with two rows running and two requests queued: the queued ones get 503 shutting_down
    with Retry-After within a second; the running ones run to their end, inside the grace.

    Before the fix (a87aed9) the queued request was admitted during the grace period
    (`Admitted(max_tokens=30, ...)`) and then cut off. Seen red when `Scheduler.drain` is not called
    (the queue waits for rows and is admitted)."""
    e = make_engine(block_size=4, max_seqs=2)
    set_step_hook(e, lambda so: time.sleep(0.01))
    a, b = e.submit(req(4, 80)), e.submit(req(4, 10, salt=1))
    a.wait_admitted(5)
    b.wait_admitted(5)
    queued = [e.submit(req(4, 30, salt=2)), e.submit(req(4, 30, salt=3))]
    t0 = time.monotonic()
    stopper = threading.Thread(target=e.shutdown, args=(10.0,))
    stopper.start()
    for q in queued:
        with pytest.raises(Refusal) as ei:
            q.wait_admitted(5)
        assert (ei.value.status, ei.value.code) == (503, "shutting_down") and ei.value.retry_after >= 1
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(Refusal) as ei:  # new arrivals too
        e.submit(req(4, 4))
    assert ei.value.code == "shutting_down"
    assert a.result(10).finish_reason == "length" and b.result(10).finish_reason == "length"
    stopper.join(10)
    assert e.snapshot().counters.rejected_unavailable == 3


def test_a_failure_while_admitting_fails_that_request_alone(make_engine, monkeypatch):
    """Building a row can raise (a sampler, a detokenizer): that request gets a 500 engine_error before
    any header, its blocks go back, and the worker and the other requests go on.

    Before the fix (a87aed9): `engine alive: False | dead: engine worker died: RuntimeError: boom while
    admitting | free blocks 8187 of 8192` -- the worker died and 5 blocks leaked. Seen red when the
    scheduler's try around the admission is removed (the engine dies)."""
    from kvgate.core.scheduler import Scheduler

    e = make_engine(block_size=4)
    make_row = Scheduler._make_row

    def flaky(self, handle, max_tokens, cap):
        if len(handle.request.prompt_ids) == 13:
            raise RuntimeError("boom while admitting")
        return make_row(self, handle, max_tokens, cap)

    monkeypatch.setattr(Scheduler, "_make_row", flaky)
    good = e.submit(req(4, 20))
    bad = e.submit(req(13, 5))
    with pytest.raises(Refusal) as ei:
        bad.wait_admitted(5)
    assert (ei.value.status, ei.value.code) == (500, "engine_error")
    assert good.result(10).finish_reason == "length"
    assert e.alive and e.generate(req(5, 3), timeout=10).finish_reason == "length"
    assert wait_until(lambda: all_free(e)) and e.snapshot().counters.failed == 1


def test_a_flush_that_raises_in_a_failed_step_still_frees_and_answers(make_engine):
    """A step fails, and flushing one of its rows' held-back text raises too: every row of the step
    still gets its final event, each block comes back once, and the worker serves on.

    Before the fix the flush ran inside `_finish` before the row was removed, on the step's error path
    with no guard: its exception escaped mid-loop and killed the worker. Seen red when
    `EngineState.finish` loses its try around the flush."""
    e = make_engine(block_size=4)
    state = e.core.state
    fired = {}

    def fail_once(so):
        if so.decodes and not fired:
            fired["ids"] = set(so.request_ids)
            for rid in so.request_ids:
                state.running[rid].detok.flush = lambda: (_ for _ in ()).throw(RuntimeError("flush boom"))
            raise RuntimeError("step boom")

    set_step_hook(e, fail_once)
    hs = [e.submit(req(4, 30, salt=i)) for i in range(3)]
    results = {h.id: h.result(10) for h in hs}
    set_step_hook(e, None)
    assert fired["ids"]
    for rid, r in results.items():
        if rid in fired["ids"]:
            assert r.finish_reason == "error" and "step boom" in r.error
        else:
            assert r.finish_reason == "length"
    assert e.alive and e.generate(req(5, 3), timeout=10).finish_reason == "length"
    assert wait_until(lambda: all_free(e))


def test_result_timeout_cancels_the_request(make_engine):
    """`RequestHandle.result(timeout)` that times out cancels the request, so its row does not keep
    its blocks with no one to read it.

    Before the fix (a87aed9): `after the timeout: still running = True cancelled = False`. Seen red
    with the `except TimeoutError: self.cancel()` removed from `result`."""
    e = make_engine(block_size=4)
    set_step_hook(e, lambda so: time.sleep(0.01))
    h = e.submit(req(4, 300))
    with pytest.raises(TimeoutError):
        h.result(0.2)
    assert h.cancelled
    assert wait_until(lambda: all_free(e), 5)
    assert e.snapshot().counters.aborted == 1


def test_the_kv_manager_detects_a_double_release_by_block_identity():
    """Giving back blocks that are already free raises, even when the count alone would look fine.

    Before the fix (a87aed9): `releasing the same 2 blocks twice raised nothing; free = 8 (4 held by
    b2)`. Seen red when `free` checks only the count of free blocks."""
    kv = KVCacheManager(8, 4)
    assert kv.allocate_for(1, 8) and kv.allocate_for(2, 8)  # 8 positions: 2 blocks each
    table = list(kv.table(1))
    assert kv.free(1) == 2
    kv._tables[1] = table  # a second owner of the same blocks, as a bug would make one
    with pytest.raises(DoubleRelease):
        kv.free(1)
    kv._tables.pop(1)
    kv.check()
    assert kv.free_blocks == 6 and kv.free(1) == 0 and kv.free(2) == 2


def test_a_stop_string_completed_in_the_flushed_tail_reports_stop():
    """A row ending by length whose held-back text completes a stop string when flushed: the text is
    cut at the stop and the finish reason is `stop`, not `length`.

    Before the fix `_finish` cut the text but kept the reason it was called with ("length"). Seen red
    with the `if hit:` branch of `EngineState.finish` reporting the caller's reason."""
    from kvgate.core.inbox import Inbox
    from kvgate.core.rows import Row
    from kvgate.core.state import EngineState
    from kvgate.request import RequestHandle
    from kvgate.stop import StopMatcher

    state = EngineState(KVCacheManager(8, 4), Inbox(), 8)
    h = RequestHandle(req(4, 3), lambda rid: None)

    class HeldTail:
        def flush(self):
            return "b and more"

    stop = StopMatcher(set(), ["ab"])
    emitted, hit = stop.push("xa")  # "a" is held: it may start "ab"
    assert (emitted, hit) == ("x", False)
    row = Row(h, [5, 6, 7, 8], 3, None, stop, HeldTail(), None, time.monotonic(), tokens=[5, 6, 7, 8, 9])
    row.text.append("x")
    state.running[h.id] = row
    state.finish(row, "length")
    ((_, ev),) = [x for x in state.outbox if x[0] is h]
    state.outbox.clear()
    assert isinstance(ev, Finished)
    assert ev.result.finish_reason == "stop" and ev.result.text == "x" and ev.result.stop_reason == "string"


def test_only_the_worker_thread_changes_engine_state(make_engine):
    """Under racing submitters and cancellers, every call that changes the queue, the rows or the blocks
    runs on the worker thread. Seen red when `RequestHandle.cancel` finishes a row directly (the
    canceller's thread shows up in the record)."""
    from kvgate.core.scheduler import Scheduler

    e = make_engine(block_size=4, max_seqs=3, max_queue=64)
    seen: set[str] = set()
    kv = e.core.state.kv
    for obj, names in ((kv, ("allocate_for", "free")), (e.core.scheduler, ("apply", "schedule", "cancel"))):
        for name in names:
            fn = getattr(obj, name)

            def recorded(*a, _fn=fn, **k):
                seen.add(threading.current_thread().name)
                return _fn(*a, **k)

            setattr(obj, name, recorded)
    assert isinstance(e.core.scheduler, Scheduler)
    handles, lock = [], threading.Lock()

    def client(i):
        for k in range(6):
            try:
                h = e.submit(req(4 + k, 8, salt=i * 10 + k))
            except Refusal:
                continue
            with lock:
                handles.append(h)
            if k % 2:
                h.cancel()

    threads = [threading.Thread(target=client, args=(i,), name=f"client-{i}") for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    for h in handles:
        h.result(10)
    assert wait_until(lambda: all_free(e))
    assert seen == {"kvgate-engine"}, seen


def test_a_hung_step_turns_health_503_and_fails_new_requests_fast(make_engine):
    """A step blocked past --step-timeout: `stalled()` names the step and the timeout, new requests are
    refused at once (503 engine_unavailable), and once the step returns the engine is healthy again.
    Seen red with `stalled()` always returning None (the hung engine keeps accepting)."""
    e = make_engine(block_size=4, step_timeout=0.3)
    release = threading.Event()

    def block_once(so):
        if not release.is_set():
            assert release.wait(20)

    set_step_hook(e, block_once)
    h = e.submit(req(4, 5))
    assert wait_until(lambda: e.stalled() is not None, 5)
    assert "past the step timeout of 0.3s" in e.stalled()
    t0 = time.monotonic()
    with pytest.raises(Refusal) as ei:
        e.submit(req(4, 5, salt=1))
    assert time.monotonic() - t0 < 0.5 and (ei.value.status, ei.value.code) == (503, "engine_unavailable")
    release.set()
    assert h.result(10).finish_reason == "length"
    assert e.stalled() is None and e.submit(req(4, 3, salt=2)).result(10).finish_reason == "length"


def test_the_step_timeout_defaults_to_a_generous_multiple_of_the_slowest_step(make_engine):
    """Unset, the timeout is max(30 s, 20 x the slowest step measured)."""
    from kvgate.config import STEP_TIMEOUT_FACTOR, STEP_TIMEOUT_FLOOR

    e = make_engine(block_size=4)
    e.generate(req(30, 3), timeout=10)
    slowest = e.snapshot().slowest_step
    assert slowest > 0
    assert e.step_timeout() == max(STEP_TIMEOUT_FLOOR, STEP_TIMEOUT_FACTOR * slowest)


def test_admitted_events_come_after_the_snapshot_that_shows_them(make_engine):
    """The snapshot is published before the step's events go out: whoever has seen `Admitted` sees the
    row in the snapshot, and whoever has seen `Finished` sees its blocks back."""
    e = make_engine(block_size=4)
    for i in range(5):
        h = e.submit(req(4 + i, 3, salt=i))
        adm = h.wait_admitted(5)
        assert isinstance(adm, Admitted)
        snap = e.snapshot()
        assert snap.counters.admitted >= i + 1
        res = h.result(5)
        assert res.finish_reason == "length"
        assert e.snapshot().counters.finished >= i + 1


def test_a_request_cancelled_in_the_inbox_ends_with_one_event(make_engine):
    """Submit then cancel before the worker looks: one `Finished(cancelled)` and no admission."""
    e = make_engine(block_size=4)
    release = threading.Event()
    set_step_hook(e, lambda so: release.wait(10))
    first = e.submit(req(4, 3))
    h = e.submit(req(4, 3, salt=1))
    h.cancel()
    release.set()
    ev = h.events.get(5)
    assert isinstance(ev, Finished | Refused) and ev.result.finish_reason == "cancelled"
    assert first.result(5).finish_reason == "length"
