"""A review of the cluster's 429s (49a6a29, 579ed68; session 39): what a replica's refusal says and when
the ingress keeps it. No Ray cluster: the ingress's dispatcher over scripted replicas, and
`attempt_refusal` on a fake view. Each test failed on 36096e7 and passes with its fix."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest

from kvgate.cluster.dispatch import Dispatcher
from kvgate.cluster.routing import Demand
from kvgate.core import logprob_budget as B
from kvgate.request import GenerationRequest, Refusal
from kvgate.sampling_params import SamplingParams
from tests.cluster_util import FakeCall, FakeHandle, snapshot, view
from tests.test_cluster_refusals import GRAMMAR


def _grammars(v, running: int, **kw):
    v = dataclasses.replace(v, **kw)
    return dataclasses.replace(
        v, snapshot=dataclasses.replace(v.snapshot, grammars_running=running, grammars_kept=running)
    )


def _two_refusing_a_slot(mqw: float):
    """Replicas a and b, each running one grammar, that refuse every attempt for a grammar slot with
    Retry-After 5: their published views (to change) and a dispatcher over them."""
    published = {t: _grammars(view(t, free=20, max_queue_wait=mqw), 1) for t in ("a", "b")}

    def answer(t, w):
        v = _grammars(view(t, version=2, free=20, max_queue_wait=mqw), 1)
        return [("refused", {"refusal": {**GRAMMAR, "retry_after": 5}, "view": v})]

    return published, Dispatcher(FakeHandle(answer), lambda: published)


# ---- F1: a side refusal kept after the replica's side budget changed ---------------------------------
def test_a_side_refusal_whose_budget_has_since_freed_does_not_name_the_429():
    """a and b refuse the request for a grammar slot; then each one's grammar ends (the view shows it:
    grammars_running 1 -> 0, so the parking lets them be asked again) but meanwhile their KV filled
    (2 free, it needs 4): no replica is asked again (none fits by the views) and past --max-queue-wait
    what held the request on every replica was KV. The ingress still answers with the old grammar 429
    ("each of the 2 refused it (grammar_memory_unavailable)") whose slot is free now."""
    mqw = 0.6
    published, d = _two_refusing_a_slot(mqw)

    async def scenario():
        task = asyncio.ensure_future(d.dispatch(FakeCall(blocks=4)))
        await asyncio.sleep(0.2)
        assert sorted(d.handle.calls) == [("a", False), ("b", False)]
        for t in ("a", "b"):  # their grammars ended; their KV is taken by other requests now
            published[t] = _grammars(view(t, version=3, free=2, max_queue_wait=mqw), 0)
        return await asyncio.wait_for(task, 3)

    with pytest.raises(Refusal) as e:
        asyncio.run(scenario())
    assert e.value.code == "kv_memory_unavailable", e.value.message


# ---- F2: attempt_refusal's order is not the scheduler's ----------------------------------------------
def _lp_request(max_tokens: int) -> GenerationRequest:
    sp = SamplingParams(temperature=0.0, logprobs=20)
    return GenerationRequest([5, 6, 7, 8], sp, max_tokens, ignore_eos=True, held=0)


def test_an_attempt_that_found_every_row_busy_is_told_rows_as_serve_says_not_logprobs():
    """The scheduler (`Scheduler._admit`) looks at a waiter only while a batch row is free, then at its
    KV, and only then at logprobs memory and a grammar slot; a waiter that timed out with every row
    busy gets serve's batch_rows_unavailable (head_waits None). `attempt_refusal` checks logprobs
    memory first: with 8 of 8 rows busy and the logprobs memory held by those rows it says
    logprobs_memory_unavailable (and the ingress parks the replica on that budget)."""
    from kvgate.cluster.refusals import attempt_refusal

    pb = B.position_bytes(20)
    limit = 100 * pb
    cfg = SimpleNamespace(logprobs_memory=limit)
    handles = [SimpleNamespace(request=_lp_request(16))]
    snap = snapshot(kv_blocks_total=28, kv_blocks_free=20, logprobs_bytes_held=limit - 8 * pb)
    v = view("a", free=20, running=8, max_seqs=8, snapshot=snap)
    r = attempt_refusal(cfg, handles, Demand(2, 1), v, 0.25)
    assert r.code == "batch_rows_unavailable", r.message


def test_a_replicas_grammar_429_retry_after_is_when_the_slot_frees_not_the_soonest_row():
    """One grammar slot, run by a row with 400 steps left; a plain row ends in 1 step. Serve's engine
    tells a request waiting for the slot `retry_after_steps(snap, steps of the held grammar)` (the
    scheduler's `slot_retry`); the replica's `attempt_refusal` passes `view.retry_after`, the soonest
    row of any kind: Retry-After 1 for a slot that frees in ~8 s (and the ingress then parks the
    replica for only max(2, 1) s: the re-asks QA counted, every 2 s)."""
    from kvgate.cluster.refusals import attempt_refusal
    from kvgate.core import forecast
    from tests.cluster_util import rows

    compiler = SimpleNamespace(can_pin=lambda t: False, kept=lambda: (1, 1), slots=1, held=None)
    g = SimpleNamespace(text="start: B", compiler=compiler)
    req = SimpleNamespace(
        sampling=SimpleNamespace(grammar=g, logprobs=None), prompt_logprobs=None, logprobs_bytes=None
    )
    snap = snapshot(
        rows=rows((1, 2), (400, 10)),
        kv_blocks_total=28,
        kv_blocks_free=16,
        step_time_ema=0.02,
        grammar_slot_steps=400,  # what the fix's worker publishes (ignored by the helper without it)
    )
    v = view("a", free=16, running=2, snapshot=snap, retry_after=forecast.retry_after(snap))
    r = attempt_refusal(
        SimpleNamespace(logprobs_memory=1 << 20), [SimpleNamespace(request=req)], Demand(2, 1), v, 0.25
    )
    assert r.code == "grammar_memory_unavailable"
    assert r.retry_after > 1, f"Retry-After {r.retry_after} s; the slot frees in ~400 steps"


def test_a_replicas_logprobs_429_retry_after_is_when_enough_comes_back():
    """Session 40: the logprobs memory is held by a row with 400 steps left; a plain row ends in 1
    step. The replica's logprobs 429 says when enough comes back (`forecast.logprobs_steps`, as serve's
    scheduler), not `view.retry_after` (the soonest row of any kind: 1 s). Red with `retry` passed."""
    from kvgate.cluster.refusals import attempt_refusal
    from kvgate.core import forecast
    from kvgate.core.snapshot import RowView

    pb = B.position_bytes(20)
    limit = 100 * pb
    held = RowView(2, 400, 10, 4, 0, 0, 400, logprobs_bytes=90 * pb)
    snap = snapshot(
        rows=(RowView(1, 1, 2, 4, 0, 0, 1), held),
        kv_blocks_total=28,
        kv_blocks_free=16,
        step_time_ema=0.02,
        logprobs_bytes_held=90 * pb,
    )
    v = view("a", free=16, running=2, snapshot=snap, retry_after=forecast.retry_after(snap))
    handles = [SimpleNamespace(request=_lp_request(16))]  # 16 positions: more than the 10 free
    r = attempt_refusal(SimpleNamespace(logprobs_memory=limit), handles, Demand(2, 1), v, 0.25)
    assert r.code == "logprobs_memory_unavailable", r.message
    assert r.retry_after > 1, f"Retry-After {r.retry_after} s; the logprobs come back in ~400 steps"


# ---- F5: the side 429 after the wait repeats a Retry-After given a wait ago ----------------------------
def test_the_side_429_after_the_wait_counts_the_wait_in_its_retry_after():
    """Both replicas refuse for a grammar slot with Retry-After 5 at t = 0 and are parked (not asked
    again: nothing changed). At t = 2 (--max-queue-wait) the cluster answers with that refusal, still
    Retry-After 5: the slot is due ~3 s from then, and the openai SDK sleeps the whole 5."""
    mqw = 2.0
    _, d = _two_refusing_a_slot(mqw)
    with pytest.raises(Refusal) as e:
        asyncio.run(asyncio.wait_for(d.dispatch(FakeCall(blocks=4)), 5))
    assert e.value.code == "grammar_memory_unavailable" and len(d.handle.calls) == 2
    assert e.value.retry_after <= 3, e.value.retry_after
