"""What a queued request waiting beside the KV (logprobs memory, a grammar slot) passes, is passed by,
and is told: a review of sessions 37-38 (session 39). Each test here failed on b86e350, before its fix
(listed in its docstring), and passes with it."""

from __future__ import annotations

import time

import pytest

from kvgate.core import logprob_budget as B
from kvgate.core.testing import set_step_hook
from kvgate.request import Admitted, GenerationRequest, Refusal
from kvgate.sampling_params import SamplingParams
from tests.test_grammar_slots import _grammar, _request
from tests.test_logprob_budget import lp_request


def test_a_lists_later_prompt_does_not_run_before_its_first_prompt_reserved_the_list(make_engine):
    """A held prompt list [x1, x2]: x1 reserves the whole list's logprobs (logprobs_bytes = both), x2
    reserves none, on the promise that x1 holds them. When x1 must wait for logprobs memory, x2
    (needing 'none') passes it and runs, its logprobs covered by no reservation: the memory held is
    then more than --logprobs-memory."""
    per = 16 * B.position_bytes(20)
    limit = 2 * per + per // 2
    e = make_engine(logprobs_memory=limit, max_queue_wait=5.0)
    a = e.submit(lp_request(32))  # holds 2 * per until closed (a response still being sent)
    a.result(10)
    assert e.snapshot().logprobs_bytes_held == 2 * per
    x1, x2 = e.submit_many([lp_request(16), lp_request(16, prompt=(9, 10))])
    try:
        with pytest.raises(TimeoutError):
            x1.wait_admitted(0.3)  # needs 2 * per, per // 2 free: waits
        admitted_early = True
        try:
            x2.wait_admitted(0.5)
        except TimeoutError:
            admitted_early = False
        if admitted_early:
            res = x2.result(10)
            held = e.snapshot().logprobs_bytes_held
            real = held + res.completion_tokens * B.position_bytes(20)  # x2's logprobs, reserved by nobody
            pytest.fail(
                f"x2 ran before x1 reserved the list's logprobs: reserved {held} B, but held for real "
                f"{real} B > --logprobs-memory {limit} B"
            )
    finally:
        a.close()
        for h in (x1, x2):
            h.cancel()
            h.close()


def _kv_hog_engine(make_engine, **cfg):
    """One grammar slot, a pool of a context and 384 positions, and the slot held by a long row that
    also takes a context's worth of the pool: a request with max_tokens unset (ceiling ~L) then fits
    only capped (kv_free_now, ~380 tokens, above --min-cap-tokens 256)."""
    L = 512  # the tiny model's context
    e = make_engine(max_grammars=1, kv_cache_bytes=(L + 384) * 256, **cfg)
    assert e.max_model_len == L
    set_step_hook(e, lambda so: time.sleep(0.02))
    g1, g2 = _grammar(e, "first"), _grammar(e, "second")
    a = e.submit(_request(g1, max_tokens=L - 8))
    assert isinstance(a.wait_admitted(10), Admitted)
    return e, g1, g2, a


def test_an_unset_max_tokens_head_that_waited_for_a_slot_gets_the_grammar_429(make_engine):
    """A head with max_tokens unset is admitted capped to the KV free now (kv_free_now), so what it
    waits for is the grammar slot: the hold is taken for it. Yet past --max-queue-wait `_head_waits`
    judges it at its uncapped max_tokens, finds the KV short, and answers the KV 429
    (kv_memory_unavailable, 'lower max_tokens', a KV Retry-After) to a request that had its KV."""
    e, g1, g2, a = _kv_hog_engine(make_engine, max_queue_wait=0.6)
    b = e.submit(GenerationRequest([5, 6, 7, 8], SamplingParams(temperature=0.0, grammar=g2), None))
    time.sleep(0.3)
    assert g1.compiler.held == g1.text  # _admit saw b wait for a slot (and held g1 for it)
    with pytest.raises(Refusal) as err:
        b.wait_admitted(10)
    a.cancel()
    assert (err.value.status, err.value.code) == (429, "grammar_memory_unavailable"), err.value.message


def test_an_unset_max_tokens_head_that_waited_for_logprobs_gets_the_logprobs_429(make_engine):
    """The same for logprobs memory: the head fits its KV capped, waits for logprobs memory only, and
    is told kv_memory_unavailable."""
    L = 512
    pb = B.position_bytes(20)
    e = make_engine(kv_cache_bytes=(L + 384) * 256, logprobs_memory=512 * pb, max_queue_wait=0.6)
    set_step_hook(e, lambda so: time.sleep(0.02))
    hog = e.submit(GenerationRequest([5, 6, 7, 8], SamplingParams(temperature=0.0), L - 8, ignore_eos=True))
    assert isinstance(hog.wait_admitted(10), Admitted)
    a = e.submit(lp_request(256, held=0))
    a.result(30)  # holds 256 positions' logprobs until closed: 256 are free
    # unset max_tokens (its ceiling, ~508 tokens, fits the logprobs budget whole): admission caps it to
    # the ~380 the pool has free, whose logprobs (380 positions) do not fit the 256 free: it waits for them
    b = e.submit(lp_request(None, held=0, prompt=(9, 10)))
    with pytest.raises(Refusal) as err:
        b.wait_admitted(10)
    hog.cancel()
    a.close()
    assert (err.value.status, err.value.code) == (429, "logprobs_memory_unavailable"), err.value.message


def test_a_hold_does_not_refuse_a_running_schema_while_a_slot_is_free(make_engine):
    """Two slots running g1 (ends sooner: held for the head) and g2. The head with a third schema gives
    up (its client will retry); then g2's row ends, so a slot is free for the retry. A request of g1
    (a schema that is running: it needs no slot at all) still waits for g1's rows to end, and past
    --max-queue-wait gets 429 grammar_memory_unavailable 'held to free its slot', with a slot free."""
    e = make_engine(max_grammars=2, max_queue_wait=0.8)
    set_step_hook(e, lambda so: time.sleep(0.02))
    L = e.max_model_len
    g1, g2, g3 = _grammar(e, "one"), _grammar(e, "two"), _grammar(e, "three")
    a1 = e.submit(_request(g1, max_tokens=L // 2))
    a2 = e.submit(_request(g2, max_tokens=L - 8))
    for h in (a1, a2):
        assert isinstance(h.wait_admitted(10), Admitted)
    b = e.submit(_request(g3))
    time.sleep(0.2)
    assert g1.compiler.held == g1.text  # g1's rows end sooner
    b.cancel()  # the client gave up
    a2.cancel()  # g2 ends: its slot is free (idle, evictable) for b's retry
    time.sleep(0.2)
    assert g1.compiler.kept() == (2, 1) and g1.compiler.can_pin(g3.text)
    z = e.submit(_request(g1, max_tokens=4))
    try:
        outcome = z.wait_admitted(5)
    except Refusal as r:
        outcome = r
    a1.cancel()
    assert isinstance(outcome, Admitted), getattr(outcome, "message", outcome)


def test_the_worker_does_not_wait_for_a_server_threads_compile_of_another_schema(make_engine):
    """A grammar whose template was not kept by its check (no free slot then) is compiled at admission,
    on the worker, under `_compiling`: while a server thread compiles some other request's schema
    (held here, as `test_a_cached_grammar_never_waits_for_a_compile` does), the whole engine stops, and
    a plain request that needs no grammar at all waits for that compile. The pinned grammar's template
    lives in the slot `acquire` took, so its compile needs no share of the one compile in hand."""
    import threading

    e = make_engine(max_grammars=1)
    g_idle = _grammar(e, "idle", min_length=1)  # checked: kept in the one slot, idle
    g_new = _grammar(e, "new", min_length=1)  # checked: no free slot (a check never evicts): not kept
    comp = g_new.compiler
    assert comp.kept() == (1, 0) and g_new.text not in comp._cache and g_idle.text in comp._cache
    held, release = threading.Event(), threading.Event()

    def another_compile():  # a server thread compiling another request's (large) schema
        with comp._compiling:
            held.set()
            release.wait(10)

    t = threading.Thread(target=another_compile, daemon=True)
    t.start()
    assert held.wait(5)
    try:
        b = e.submit(_request(g_new, max_tokens=4))  # admission evicts g_idle and compiles g_new
        time.sleep(0.1)
        t0 = time.monotonic()
        plain = e.submit(_request(None, max_tokens=4))
        try:
            plain.result(2.0)
            took = time.monotonic() - t0
        except TimeoutError:
            took = None
    finally:
        release.set()
        t.join(5)
    b.result(10)
    assert took is not None and took < 1.0, "the plain request waited for another schema's compile"


def test_a_held_list_leaves_the_queue_together(make_engine, monkeypatch):
    """A held list's first prompt, waiting for the list's logprobs memory, is refused past
    --max-queue-wait: its later prompt, whose deadline comes a moment later (submitted after it), must
    leave with it, not be admitted in the next tick with no reservation of its own (its first prompt
    held the list's). The handles' clock is shifted so the moment is a second here. Red without the
    list's prompts joining `late` in `Scheduler._expire` (x2 admitted)."""
    import kvgate.request as R

    real, shift = time.monotonic, [0.0]

    class Clock:
        @staticmethod
        def monotonic():
            return real() + shift[0]

    per = 16 * B.position_bytes(20)
    e = make_engine(logprobs_memory=2 * per + per // 2, max_queue_wait=0.4)
    a = e.submit(lp_request(32))  # holds 2 * per until closed: x1 (2 * per, the list's) waits
    a.result(10)
    monkeypatch.setattr(R, "time", Clock)
    real_submit = e.submit_choices

    def submit_later(r, n):  # x2's handle is made a second after x1's
        out = real_submit(r, n)
        shift[0] += 1.0
        return out

    monkeypatch.setattr(e, "submit_choices", submit_later)
    x1, x2 = e.submit_many([lp_request(16), lp_request(16, prompt=(9, 10))])
    try:
        with pytest.raises(Refusal):
            x1.wait_admitted(5)
        try:
            outcome = x2.wait_admitted(0.5)
        except (Refusal, TimeoutError) as err:
            outcome = err
        assert isinstance(outcome, Refusal), f"x2 after its first prompt left: {outcome!r}"
    finally:
        a.close()
        for h in (x1, x2):
            h.cancel()
            h.close()
