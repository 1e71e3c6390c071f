"""Admission through the real engine: typed refusals with their numbers, the queue gate, waiting for
KV with a deadline, and budget caps that are always reported.

KV bytes per token of the tiny model in the default float16 cache = 256 (`TINY_KV_BYTES_PER_TOKEN`), so
`kv_cache_bytes = blocks * block_size * BPT`.
A "hog" request holds part of the pool while a slow-step hook keeps it decoding, so the head of the
queue really does wait for KV (nothing else stops the worker).
"""

from __future__ import annotations

import re
import threading
import time

import pytest

from kvgate.core.forecast import decode_seconds, predicted_ttft, typical_step
from kvgate.core.testing import set_step_hook
from kvgate.request import Admitted, BudgetCap, GenerationRequest, Refusal, Refused, Token
from kvgate.sampling import SamplingParams
from tests.server_util import wait_until
from tests.tiny_model import TINY_KV_BYTES_PER_TOKEN

BPT = TINY_KV_BYTES_PER_TOKEN


def prompt(n: int, salt: int = 0) -> list[int]:
    return [3 + (i * 11 + salt * 17) % 250 for i in range(n)]


def req(P: int, max_tokens: int | None = None, *, salt: int = 0, seed: int = 0) -> GenerationRequest:
    return GenerationRequest(
        prompt(P, salt), SamplingParams(temperature=0.8, seed=seed), max_tokens, ignore_eos=True
    )


def hog(e, P: int, max_tokens: int, step_sleep: float = 0.02):
    """Admit a long request and slow every step down, so the KV it holds stays busy for a while."""
    h = e.submit(req(P, max_tokens, salt=99))
    h.wait_admitted(5)
    assert isinstance(h.events.get(5), Token)  # decoding
    set_step_hook(e, lambda so: time.sleep(step_sleep))
    return h


def running_ids(e) -> set[int]:
    return {r.request_id for r in e.snapshot().rows}


def refusal_counters(e) -> dict:
    c = e.snapshot().counters
    return {
        k: getattr(c, k)
        for k in ("rejected_context_length", "rejected_kv_budget", "rejected_kv_timeout", "queue_rejected")
    }


# ---- never fits: 400s with both sides of the arithmetic ---------------------------------------------


def test_exact_pool_ceiling_admitted_and_one_more_refused(make_engine):
    """prompt + max_tokens == KV positions runs to the end holding every block; one position more is a
    kv_budget_exceeded 400 with estimated/limit bytes and positions.

    Seen to fail when the never-fits check is `>=` instead of `>`.
    """
    e = make_engine(kv_cache_bytes=16 * 4 * BPT, block_size=4, max_seqs=4)
    res = e.generate(req(10, 54), timeout=20)
    assert res.finish_reason == "length" and res.completion_tokens == 54
    assert e.snapshot().counters.kv_blocks_peak == 16
    with pytest.raises(Refusal) as ei:
        e.submit(req(10, 55))
    r = ei.value
    assert (r.code, r.status) == ("kv_budget_exceeded", 400)
    assert r.details() == {
        "estimated_bytes": 17 * 4 * BPT,  # 65 positions round up to 17 blocks
        "limit_bytes": 64 * BPT,
        "positions": 65,
        "positions_limit": 64,
    }
    assert "65 positions" in r.message and "16 blocks" in r.message
    assert refusal_counters(e) == {
        "rejected_context_length": 0,
        "rejected_kv_budget": 1,
        "rejected_kv_timeout": 0,
        "queue_rejected": 0,
    }
    assert wait_until(lambda: e.snapshot().kv_blocks_available == e.snapshot().kv_blocks_total)


def test_the_context_refusals_advice_fits_every_choice(make_engine):
    """n choices share the pool, so the max_tokens a context 400 advises must fit all of them, or
    following it earns a kv_budget 400 (review of session 33). Seen red with the advice taken for
    one choice ("at most 22")."""
    e = make_engine(kv_cache_bytes=8 * 4 * BPT, block_size=4, max_model_len=48, max_seqs=4)
    with pytest.raises(Refusal) as ei:
        e.submit_choices(req(10, 40), 2)  # 50 > 48 context
    most = int(re.search(r"at most (\d+)", ei.value.message).group(1))
    assert ei.value.code == "context_length_exceeded" and most == 10, ei.value.message
    for h in e.submit_choices(req(10, most), 2):  # the advice, followed, is admitted
        assert h.result(timeout=60).finish_reason == "length"


def test_the_context_400_begins_as_openai_and_vllm_word_it(make_engine):
    """LiteLLM (and aider, CrewAI through it) map a 400 to ContextWindowExceededError by the sentence
    OpenAI and vLLM begin with; kvgate's own wording was a plain BadRequestError (QA pass 16). Red with
    the old messages ("this request needs ...", "the prompt alone is ...")."""
    from kvgate.core.admission import context_refusal

    cfg = make_engine(kv_cache_bytes=8 * 4 * BPT, block_size=4, max_model_len=48).sched_cfg
    for P, mt in ((10, 40), (60, 5)):  # prompt + max_tokens past the context; the prompt alone past it
        msg = context_refusal(cfg, P, mt).message
        assert msg.startswith("This model's maximum context length is 48 tokens. However, "), msg


def test_a_context_400s_estimate_exceeds_its_limit_at_any_block_size():
    """The review of session 45: with a context that is not a multiple of the block size, both numbers
    rounded up to whole blocks came out equal (100,800 and 100,800 for 1,001 positions against 1,000).
    The limit is the context's own positions now. Red with it rounded up."""
    from types import SimpleNamespace

    from kvgate.core.admission import context_bytes

    cfg = SimpleNamespace(block_size=16, total_blocks=1000, max_model_len=1000, kv_bytes_per_token=100)
    got = context_bytes(cfg, 1001)
    assert got == {"estimated_bytes": 1008 * 100, "limit_bytes": 1000 * 100}
    small = SimpleNamespace(block_size=16, total_blocks=10, max_model_len=1000, kv_bytes_per_token=100)
    assert context_bytes(small, 1001)["limit_bytes"] == 160 * 100  # the whole pool, when less


def test_context_overflow_reported_before_budget_overflow(make_engine):
    """When both the context and the pool are exceeded, the client hears about the context (it can fix
    that); each refusal is counted once, in its own counter.

    Seen to fail when the budget check runs before the context check.
    """
    e = make_engine(kv_cache_bytes=8 * 4 * BPT, block_size=4, max_model_len=48)  # pool: 32 positions
    with pytest.raises(Refusal) as ei:
        e.submit(req(10, 40))  # 50 > 48 context and > 32 pool
    r = ei.value
    assert (r.code, r.status) == ("context_length_exceeded", 400)
    # bytes as the pool's 400 counts them: 50 positions are 13 blocks; the most one sequence can hold is
    # the pool's 8 blocks, not the context's 48 positions (red with the context's unrounded bytes)
    assert r.details() == {
        "estimated_bytes": 52 * BPT,
        "limit_bytes": 32 * BPT,
        "positions": 50,
        "positions_limit": 48,
    }
    # the advice fits the pool as well as the context (QA pass 6: following "at most 38" earned a
    # second 400, kv_budget_exceeded); seen red with the advice taken from the context alone
    assert "at most 22 (the context allows 38, but this server's whole KV pool holds 32" in r.message
    with pytest.raises(Refusal) as ei:
        e.submit(req(48))  # unset max_tokens: no room for even one token
    assert ei.value.code == "context_length_exceeded" and ei.value.positions == 49
    with pytest.raises(Refusal) as ei:
        e.submit(req(10, 30))  # 40 <= 48 context, > 32 pool
    r = ei.value
    assert (r.code, r.status, r.positions, r.positions_limit) == ("kv_budget_exceeded", 400, 40, 32)
    assert (r.estimated_bytes, r.limit_bytes) == (10 * 4 * BPT, 32 * BPT)
    assert refusal_counters(e) == {
        "rejected_context_length": 2,
        "rejected_kv_budget": 1,
        "rejected_kv_timeout": 0,
        "queue_rejected": 0,
    }
    assert e.snapshot().waiting == 0 and e.snapshot().counters.admitted == 0


def test_bad_max_tokens_is_refused_before_it_can_hurt_a_neighbour(make_engine):
    """max_tokens below 1 is a ValueError at submit. Before it was, max_tokens=-5 reserved fewer blocks
    than the prompt, its prefill indexed past its block table and the step's exception failed every
    row in that step, neighbours included. Seen to fail without the max_tokens check in Engine.submit.
    """
    e = make_engine(kv_cache_bytes=64 * 4 * BPT, block_size=4)
    a = e.submit(req(10, 40))
    for bad in (0, -5):
        with pytest.raises(ValueError, match="max_tokens"):
            e.submit(req(10, bad))
    assert a.result(20).finish_reason == "length"
    assert e.snapshot().waiting == 0 and e.snapshot().counters.admitted == 1


# ---- does not fit now: wait, then 429 ---------------------------------------------------------------


def test_queue_full_exactly_max_queue_wait_under_racing_threads(make_engine):
    """32 threads race to submit while the KV pool is held by a running request: exactly max_queue wait;
    the rest get queue_full 503 with Retry-After, each counted once -- at the gate (more than the free
    rows plus the queue) or from the worker (let through for a free row, but the KV is held).

    Seen to fail when the queue gate is `>` instead of `>=` (one request too many accepted), and with the
    worker's trim left out (12 waited: the gate's room for 7 free rows was never taken back).
    """
    e = make_engine(kv_cache_bytes=32 * 4 * BPT, block_size=4, max_queue=5, max_queue_wait=30, max_seqs=8)
    h0 = hog(e, 4, 124)  # the whole pool, one of the 8 rows
    accepted, refused, errors = [], [], []
    lock = threading.Lock()
    barrier = threading.Barrier(32)

    def submit(i):
        try:
            barrier.wait()
            h = e.submit(req(4, 8, salt=i))
            with lock:
                accepted.append(h)
        except Refusal as r:
            with lock:
                refused.append(r)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors
    assert "queue places (--max-queue" in refused[0].message
    # the snapshot that counts the worker's refusals is published before their events go out
    assert wait_until(lambda: e.snapshot().counters.queue_rejected == 27, 10)
    trimmed, waiters = [], []

    def sort_out() -> bool:
        for h in [h for h in accepted if h not in waiters and all(h is not x for x, _ in trimmed)]:
            try:
                trimmed.append((h, h.events.get(0)))
            except TimeoutError:
                pass
        return len(refused) + len(trimmed) == 27

    assert wait_until(sort_out, 5)
    waiters = [h for h in accepted if all(h is not x for x, _ in trimmed)]
    assert len(waiters) == 5
    everyone = refused + [ev.refusal for _, ev in trimmed if isinstance(ev, Refused)]
    assert len(everyone) == 27 and all((r.code, r.status) == ("queue_full", 503) for r in everyone)
    assert all(1 <= r.retry_after <= 60 for r in everyone)
    assert e.inbox.queued == 5 and e.snapshot().waiting == 5 and h0.cancelled is False
    for h in waiters:
        h.cancel()
    h0.cancel()
    for h in waiters:
        assert h.result(10).finish_reason == "cancelled"
    assert h0.result(10).finish_reason == "cancelled"
    assert wait_until(lambda: e.snapshot().counters.aborted == 6 and e.snapshot().idle)
    snap = e.snapshot()
    assert snap.kv_blocks_available == snap.kv_blocks_total


def test_kv_memory_unavailable_after_max_queue_wait(make_engine):
    """A request that waits longer than max_queue_wait for KV gets a 429 with Retry-After in [1, 60] and
    the numbers; it is counted once, the head's slot is freed and the running request is unaffected.

    Seen to fail when expiry ignores the deadline (the request waits until the hog ends and is admitted).
    """
    e = make_engine(kv_cache_bytes=32 * 4 * BPT, block_size=4, max_queue_wait=0.3)
    h0 = hog(e, 4, 100)  # 26 blocks of 32
    t0 = time.monotonic()
    h = e.submit(req(8, 40))  # 12 blocks: waits
    with pytest.raises(Refusal) as ei:
        h.wait_admitted(10)
    waited = time.monotonic() - t0
    r = ei.value
    assert (r.code, r.status) == ("kv_memory_unavailable", 429)
    assert 1 <= r.retry_after <= 60
    assert r.details() == {
        "estimated_bytes": 12 * 4 * BPT,
        "limit_bytes": 128 * BPT,
        "positions": 48,
        "positions_limit": 128,
    }
    assert "needs 12 blocks" in r.message
    assert 0.25 <= waited < 3, waited
    assert h0.id in running_ids(e)  # the running request is untouched by the refusal
    assert refusal_counters(e) == {
        "rejected_context_length": 0,
        "rejected_kv_budget": 0,
        "rejected_kv_timeout": 1,
        "queue_rejected": 0,
    }
    h0.cancel()
    assert h0.result(10).finish_reason == "cancelled"
    assert (
        wait_until(lambda: e.snapshot().kv_blocks_available == e.snapshot().kv_blocks_total)
        and e.snapshot().idle
    )


def test_max_queue_wait_zero_refuses_at_once_and_admits_what_fits(make_engine):
    """With max_queue_wait=0 a request that does not fit right now is refused at once (no waiting),
    while one that fits is admitted as usual.

    Seen to fail when a zero wait is treated as "wait forever".
    """
    e = make_engine(kv_cache_bytes=32 * 4 * BPT, block_size=4, max_queue_wait=0)
    h0 = hog(e, 4, 100)  # 26 of 32 blocks
    t0 = time.monotonic()
    h = e.submit(req(8, 40))
    with pytest.raises(Refusal) as ei:
        h.wait_admitted(5)
    assert time.monotonic() - t0 < 1.5  # not after the hog (>2 s): at once
    assert ei.value.code == "kv_memory_unavailable" and 1 <= ei.value.retry_after <= 60
    ok = e.submit(req(4, 16))  # 5 blocks of the 6 free
    assert isinstance(ok.wait_admitted(5), Admitted)
    h0.cancel()
    assert ok.result(10).finish_reason == "length"
    assert e.snapshot().counters.rejected_kv_timeout == 1


# ---- budget caps: reported, never silent -------------------------------------------------------------


def test_unset_max_tokens_gets_the_remaining_context(make_engine):
    """Unset max_tokens runs up to the context, uncapped when the pool can hold it.

    Seen to fail when the unset ceiling is one short of the remaining context.
    """
    e = make_engine(kv_cache_bytes=64 * 4 * BPT, block_size=4, max_model_len=40)
    h = e.submit(req(10))
    adm = h.wait_admitted(5)
    assert adm.max_tokens == 30 and adm.budget_cap is None
    res = h.result(10)
    assert res.finish_reason == "length" and res.completion_tokens == 30 and res.budget_cap is None
    assert e.snapshot().counters.budget_caps == 0


def test_unset_max_tokens_capped_by_the_whole_pool_is_reported(make_engine):
    """When prompt + remaining context exceeds the whole pool, the ceiling is capped to what the pool
    holds, reason kv_budget, on the admission and on the result; counted once.

    Seen to fail when the cap is applied but not attached to the request.
    """
    e = make_engine(kv_cache_bytes=16 * 4 * BPT, block_size=4, max_model_len=200)
    h = e.submit(req(10))
    adm = h.wait_admitted(5)
    assert adm.budget_cap == BudgetCap(190, 54, "kv_budget") and adm.max_tokens == 54
    res = h.result(10)
    assert res.budget_cap == BudgetCap(190, 54, "kv_budget") and res.completion_tokens == 54
    assert res.budget_cap.header() == "requested=190; admitted=54; reason=kv_budget"
    assert e.snapshot().counters.budget_caps == 1 and e.snapshot().counters.kv_blocks_peak == 16


def test_head_admitted_now_with_a_free_now_cap(make_engine):
    """A head with unset max_tokens that does not fit now, but for which >= min_cap_tokens fit the free
    blocks, is admitted at once with the cap (reason kv_free_now) instead of waiting.

    Seen to fail when the free-now cap is never applied (the head waits for the hog to finish).
    """
    e = make_engine(kv_cache_bytes=32 * 4 * BPT, block_size=4, max_model_len=100, min_cap_tokens=16)
    h0 = hog(e, 4, 60)  # 16 of 32 blocks
    h = e.submit(req(8))  # ceiling 92 needs 25 blocks; 16 free -> 56 tokens fit
    adm = h.wait_admitted(5)
    assert adm.budget_cap == BudgetCap(92, 56, "kv_free_now") and adm.max_tokens == 56
    assert h0.id in running_ids(e)  # admitted while the hog still runs
    set_step_hook(e, None)
    res = h.result(10)
    assert res.budget_cap == BudgetCap(92, 56, "kv_free_now") and res.completion_tokens == 56
    assert e.snapshot().counters.budget_caps == 1
    h0.result(10)


def test_free_now_cap_needs_min_cap_tokens(make_engine):
    """Fewer than min_cap_tokens free: the unset-max_tokens head waits rather than take a tiny cap.

    Seen to fail when the free-now cap ignores min_cap_tokens.
    """
    e = make_engine(kv_cache_bytes=32 * 4 * BPT, block_size=4, max_model_len=100, min_cap_tokens=64)
    h0 = hog(e, 4, 60)  # 16 blocks free -> 56 tokens would fit, under 64
    h = e.submit(req(8))
    with pytest.raises(TimeoutError):
        h.events.get(0.2)
    set_step_hook(e, None)
    assert h0.result(10).finish_reason == "length"
    adm = h.wait_admitted(5)
    assert adm.budget_cap is None and adm.max_tokens == 92
    assert h.result(10).completion_tokens == 92


def test_explicit_max_tokens_is_never_capped(make_engine):
    """An explicit max_tokens that does not fit now waits for the full reservation, even when a
    free-now cap would apply to an unset one.

    Seen to fail when the free-now cap ignores `explicit`.
    """
    e = make_engine(kv_cache_bytes=32 * 4 * BPT, block_size=4, max_model_len=100, min_cap_tokens=16)
    h0 = hog(e, 4, 60)
    h = e.submit(req(8, 80))  # 22 blocks; only 16 free
    with pytest.raises(TimeoutError):
        h.events.get(0.2)
    set_step_hook(e, None)
    r0 = h0.result(10)
    adm = h.wait_admitted(5)
    assert adm.budget_cap is None and adm.max_tokens == 80
    res = h.result(10)
    assert res.completion_tokens == 80 and res.budget_cap is None and res.admitted_at >= r0.finished_at
    assert e.snapshot().counters.budget_caps == 0


def test_refused_waiter_event_protocol(make_engine):
    """A refused waiter's only event is the Refused one; nothing follows it.

    Seen to fail when an expired waiter is also sent a Finished event after its Refused.
    """
    e = make_engine(kv_cache_bytes=32 * 4 * BPT, block_size=4, max_queue_wait=0.05)
    h0 = hog(e, 4, 100)
    h = e.submit(req(8, 40))
    ev = h.events.get(5)
    assert isinstance(ev, Refused)
    with pytest.raises(TimeoutError):
        h.events.get(0.1)
    h0.cancel()
    h0.result(10)


# ---- TTFT budget (--max-ttft): refuse at arrival what would start too late --------------------------


def test_ttft_budget_refuses_at_arrival_with_the_prediction_and_retry_after(make_engine):
    """With rows busy for ~2 s and --max-ttft 0.5, a new request is refused at once (no queueing) with
    429 ttft_budget_exceeded, the predicted wait in the message and a Retry-After; with rows free it
    is admitted. Broken by (each seen red): no budget check in submit; the admission wait ignoring
    busy rows (the prediction is then only the prefill, well under budget)."""
    e = make_engine(block_size=4, max_seqs=1, max_ttft=0.5)
    e.generate(req(40, 2), timeout=20)  # times a prefill (>= 32 tokens): the prediction needs one
    assert e.snapshot().prefill_line is not None
    h = hog(e, 8, 400, step_sleep=0.01)  # the only row, ~4 s of decoding left
    # the prediction reads the typical decode step: wait until it has seen the slowed steps. Right
    # after the hook it still held the fast steps before it, and once those were ~1.2 ms (session 23)
    # 399 of them came to under the 0.5 s budget: this test failed in a full run for that reason alone
    assert wait_until(lambda: typical_step(e.snapshot()) >= 0.005)
    t0 = time.monotonic()
    with pytest.raises(Refusal) as ei:
        e.submit(req(8, 4, salt=1))
    r = ei.value
    assert time.monotonic() - t0 < 0.5  # answered at arrival, not after a wait
    assert (r.status, r.code) == (429, "ttft_budget_exceeded")
    assert "--max-ttft 0.5s" in r.message and "until rows and KV free up" in r.message
    assert 1 <= r.retry_after <= 60
    assert e.snapshot().counters.rejected_ttft_budget == 1
    assert e.snapshot().waiting == 0 and e.inbox.queued == 0
    h.cancel()
    set_step_hook(e, None)
    assert wait_until(lambda: e.snapshot().running == 0)
    ok = e.generate(req(8, 4, salt=2), timeout=20)  # rows free: predicted prefill only, admitted
    assert ok.finish_reason == "length"


def test_predicted_ttft_walks_running_rows_by_remaining_steps(make_engine):
    """Two busy rows (max_seqs 2): a newcomer is admitted when the sooner of them ends, so the admission
    part is its remaining steps x the step time; with a row free it is 0. Broken by: taking the
    later row's remaining steps, or counting the newcomer's own prompt out of the prefill."""
    e = make_engine(block_size=4, max_seqs=2)
    e.generate(req(40, 2), timeout=20)
    a = hog(e, 8, 250, step_sleep=0.01)
    b = e.submit(req(8, 490, salt=5))
    b.wait_admitted(5)
    assert isinstance(b.events.get(5), Token)  # decoding: its prompt is all prefilled
    snap = e.snapshot()
    soonest = min(r.steps_left for r in snap.rows)
    admit, prefill, ahead = predicted_ttft(e.sched_cfg, snap, [], 10, 4)
    step = typical_step(snap)
    assert soonest < max(r.steps_left for r in snap.rows)
    # one snapshot: the forecast is exact arithmetic over it (the steps grow with the rows' contexts)
    assert admit == decode_seconds(snap, step, soonest + 1) >= (soonest + 1) * step
    # both rows are decoding (`computed` then counts generated tokens too): nothing of theirs is left
    # to prefill. Seen red when a decoding row's prompt - computed went negative into the sum.
    assert ahead == 10 and prefill > 0
    a.cancel()
    b.cancel()
    assert wait_until(lambda: e.snapshot().running == 0)
    admit, _, ahead = predicted_ttft(e.sched_cfg, e.snapshot(), [], 10, 4)
    assert admit == 0.0 and ahead == 10
