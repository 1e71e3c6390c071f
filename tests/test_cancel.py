"""Cancel wherever the request is (queued, prefilling, decoding, not yet seen by the worker), and a
fault inside a step: partial output kept, blocks returned exactly once, neighbours unaffected.

`BlockAudit` wraps the engine's KV cache manager so every block handed out must come back exactly
once. Cancels and faults are injected from a step hook (`kvgate.core.testing.set_step_hook`), which
runs on the worker inside a step, so "the request is prefilling right now" is a fact, not a timing
guess.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from kvgate.core.testing import set_step_hook
from kvgate.request import Finished, GenerationRequest, Refusal, Refused, Token
from kvgate.sampling import SamplingParams
from tests.server_util import wait_until
from tests.tiny_model import TINY_KV_BYTES_PER_TOKEN

BPT = TINY_KV_BYTES_PER_TOKEN  # the default float16 cache


def prompt(n: int, salt: int = 0) -> list[int]:
    return [3 + (i * 13 + salt * 29) % 250 for i in range(n)]


def req(
    P: int, max_tokens: int, *, salt: int = 0, seed: int = 0, temperature: float = 0.8
) -> GenerationRequest:
    return GenerationRequest(
        prompt(P, salt), SamplingParams(temperature=temperature, seed=seed), max_tokens, ignore_eos=True
    )


class BlockAudit:
    """Every block the KV cache manager hands out must be released exactly once (wrapped methods run on
    the worker; `check` reads the counts once the engine is idle)."""

    def __init__(self, engine):
        self.engine = engine
        kv = engine.core.state.kv
        self.taken: Counter = Counter()
        self.released: Counter = Counter()
        allocate, free = kv.allocate_for, kv.free

        def audited_allocate(rid, *a, **k):
            ok = allocate(rid, *a, **k)
            if ok:
                self.taken.update(kv.table(rid))
            return ok

        def audited_free(rid):
            if kv.holds(rid):
                self.released.update(kv.table(rid))
            return free(rid)

        kv.allocate_for = audited_allocate
        kv.free = audited_free

    def check(self):
        assert wait_until(lambda: self.engine.snapshot().idle, 5)
        assert self.released == self.taken, "a block was released twice or never"
        snap = self.engine.snapshot()
        assert snap.kv_blocks_available == snap.kv_blocks_total


def audited(make_engine, **kw):
    e = make_engine(**{**dict(kv_cache_bytes=64 * 4 * BPT, block_size=4, max_seqs=4, prefill_chunk=8), **kw})
    e.audit = BlockAudit(e)
    return e


@pytest.fixture
def engine(make_engine):
    return audited(make_engine)


def events(h, timeout: float = 10.0) -> list:
    """Every event of a request up to its terminal one; TimeoutError if the terminal one never comes."""
    out = []
    end = time.monotonic() + timeout
    while not out or not isinstance(out[-1], Finished | Refused):
        out.append(h.events.get(max(0.0, end - time.monotonic())))
    return out


def solo(e, r: GenerationRequest):
    return e.generate(r, timeout=20)


def hooks(e, *fns):
    def hook(so):
        for fn in fns:
            fn(so)

    set_step_hook(e, hook)


def counters(e):
    return e.snapshot().counters


def test_cancel_while_queued(make_engine):
    """A queued request cancelled while the head is running ends at the next step with no admission,
    finish_reason 'cancelled' and no tokens; the running neighbour's output is unchanged.

    Seen to fail when queued waiters are not checked for cancel (it is admitted once room appears).
    """
    e = audited(make_engine, max_seqs=1)  # the next request must queue behind the running one
    big = req(4, 120, salt=1, seed=1)
    want = solo(e, big)
    hooks(e, lambda so: time.sleep(0.002))  # keep the neighbour running well past the cancel
    h0 = e.submit(big)
    h0.wait_admitted(5)
    h = e.submit(req(6, 10, salt=2))
    h.cancel()
    res = h.result(5)
    assert isinstance(h.admission, Refusal), "a cancelled waiter must end without being admitted"
    assert res.finish_reason == "cancelled" and res.token_ids == [] and res.admitted_at is None
    assert h0.id in {r.request_id for r in e.snapshot().rows}  # still running when the waiter ended
    r0 = h0.result(20)
    assert r0.token_ids == want.token_ids and r0.finish_reason == "length"
    assert counters(e).aborted == 1 and counters(e).admitted == 2
    e.audit.check()


def test_cancel_before_the_worker_sees_the_job_is_not_lost(engine):
    """Submit and cancel while the worker is inside a step: when it comes back, the job ends cancelled,
    never admitted, with one terminal event.

    Seen to fail when a dropped waiter is not sent its final event (the caller waits forever), and
    when queued waiters are not checked for cancel (it is admitted first).
    """
    e = engine
    inside, release = threading.Event(), threading.Event()

    def park(so):
        inside.set()
        assert release.wait(10)

    hooks(e, park)
    h0 = e.submit(req(4, 20, salt=3))
    assert inside.wait(5)  # the worker is inside h0's first step
    h = e.submit(req(5, 10, salt=4))
    h.cancel()
    h.cancel()  # twice is harmless
    assert e.inbox.queued == 1 and e.snapshot().waiting == 0  # the worker has not looked at it
    set_step_hook(e, None)
    release.set()
    evs = events(h)
    assert len(evs) == 1 and evs[0].result.finish_reason == "cancelled"
    assert evs[0].result.admitted_at is None
    assert h0.result(10).finish_reason == "length"
    assert counters(e).aborted == 1
    e.audit.check()


def test_cancel_while_prefilling_runs_no_more_chunks(engine):
    """A cancel that lands while the prompt is mid-prefill stops it at the next step boundary: the
    remaining chunks never run, no token is produced, blocks go back once, the neighbour is unchanged.

    Seen to fail when cancelled rows are only aborted once they are decoding.
    """
    e = engine
    nb = req(4, 40, salt=5, seed=5)
    want = solo(e, nb)
    seen = []
    victim = {}
    known = threading.Event()

    def cancel_mid_prefill(so):
        for p in so.prefills:  # the neighbour only decodes: every prompt chunk is the victim's
            assert known.wait(5)
            seen.append(p.start)
            if p.start >= 16:
                victim["h"].cancel()

    h0 = e.submit(nb)
    h0.wait_admitted(5)
    assert isinstance(h0.events.get(5), Token)  # its prompt is done: only h prefills from here
    before = counters(e).prefill_tokens
    hooks(e, cancel_mid_prefill)
    victim["h"] = h = e.submit(req(120, 10, salt=6))
    known.set()
    res = h.result(10)
    assert res.finish_reason == "cancelled" and res.token_ids == [] and res.first_token_at is None
    assert seen == [0, 8, 16], seen  # cancelled during the third chunk; nothing ran after it
    assert counters(e).prefill_tokens - before == 24
    assert h0.result(10).token_ids == want.token_ids
    assert counters(e).aborted == 1
    e.audit.check()


def test_cancel_while_decoding_keeps_partial_output(engine):
    """A cancel during decode ends the row at the next step with the tokens produced so far (a prefix of
    the uncancelled run), text included; the neighbour in the same batch is unchanged.

    Seen to fail when a cancelled row's output is dropped, and when its blocks are released twice.
    """
    e = engine
    r1, r2 = req(6, 60, salt=7, seed=7), req(9, 60, salt=8, seed=8)
    w1, w2 = solo(e, r1), solo(e, r2)
    h1, h2 = e.submit(r1), e.submit(r2)
    got = []
    end = time.monotonic() + 10
    while True:
        ev = h1.events.get(max(0.0, end - time.monotonic()))
        if isinstance(ev, Token):
            got.append(ev.token_id)
            if len(got) == 5:
                h1.cancel()
        if isinstance(ev, Finished):
            res1 = ev.result
            break
    assert res1.finish_reason == "cancelled"
    assert 5 <= len(res1.token_ids) < 60 and res1.token_ids == w1.token_ids[: len(res1.token_ids)]
    assert got == res1.token_ids
    assert res1.text and w1.text.startswith(res1.text)
    assert h2.result(10).token_ids == w2.token_ids
    h1.cancel()  # after the end: harmless
    assert counters(e).aborted == 1
    e.audit.check()


def test_fault_in_a_step_fails_only_the_rows_in_that_step(engine):
    """A step that raises fails exactly the rows it carried ('error', partial output kept, blocks
    released); a running row that was not in that step, and requests after it, are served normally.

    Seen to fail when a failed step fails every running row, and when failed rows keep their blocks.
    """
    e = engine
    ra, rb, rc = req(4, 100, salt=9, seed=9), req(40, 5, salt=10), req(40, 5, salt=11, seed=3)
    rd = req(7, 12, salt=12, seed=4)
    wa, wc, wd = solo(e, ra), solo(e, rc), solo(e, rd)
    state = {"fired": False}
    ha = e.submit(ra)
    ha.wait_admitted(5)
    assert isinstance(ha.events.get(5), Token)

    def fault(so):
        ids = set(so.request_ids)
        hb, hc = state.get("b"), state.get("c")
        if state["fired"] or hb is None or hc is None:
            return
        running = {r.request_id for r in e.snapshot().rows}  # published just before this forward
        # a step carrying a (decoding) and b (prefilling) but not c, which is running (prefilling too)
        if ha.id in ids and hb.id in ids and hc.id in running and hc.id not in ids:
            state["fired"] = True
            state["rows"] = ids
            raise RuntimeError("boom in step")

    inside, release = threading.Event(), threading.Event()

    def park(so):  # hold the worker inside a step so that b and c are admitted in the same tick
        if not release.is_set():
            inside.set()
            assert release.wait(10)

    hooks(e, park, fault)
    assert inside.wait(5)
    state["b"] = hb = e.submit(rb)
    state["c"] = hc = e.submit(rc)
    release.set()
    res_a, res_b, res_c = ha.result(10), hb.result(10), hc.result(10)
    assert state["fired"] and state["rows"] == {ha.id, hb.id}
    for r in (res_a, res_b):
        assert r.finish_reason == "error" and "RuntimeError: boom in step" in r.error
    assert res_a.token_ids and res_a.token_ids == wa.token_ids[: len(res_a.token_ids)]
    assert res_c.finish_reason == "length" and res_c.token_ids == wc.token_ids
    assert counters(e).failed == 2
    set_step_hook(e, None)
    assert e.alive
    assert e.generate(rd, timeout=10).token_ids == wd.token_ids
    e.audit.check()


def test_every_exit_path_returns_blocks_once(make_engine):
    """Finish by length, by stop string, cancel while queued and while running, and error: afterwards
    the allocator has every block back and each was released exactly once.

    Seen to fail when a cancelled row's blocks are not released, and when a failed row's are not.
    """
    e = audited(make_engine, max_seqs=3)  # q waits for a row
    base = solo(e, req(5, 30, salt=13, seed=13))
    stop_req = req(5, 30, salt=13, seed=13)
    stop_req.stop = [base.text[6:8]]
    hs = [e.submit(req(4, 30, salt=14)), e.submit(stop_req), e.submit(req(90, 8, salt=15))]
    q = e.submit(req(4, 5, salt=16))
    q.cancel()
    hs[2].wait_admitted(5)
    hs[2].cancel()  # admitted: it holds blocks (prefilling or decoding)
    rs = [h.result(10) for h in hs]
    assert rs[0].finish_reason == "length" and rs[1].finish_reason == "stop"
    assert rs[2].finish_reason == "cancelled"
    evs = events(q)
    assert len(evs) == 1 and evs[0].result.finish_reason == "cancelled"
    set_step_hook(e, lambda so: (_ for _ in ()).throw(ValueError("x")))
    assert e.generate(req(4, 5), timeout=10).finish_reason == "error"
    set_step_hook(e, None)
    e.audit.check()
    assert counters(e).kv_blocks_held == 0
