"""Logprobs memory is planned: reserved per request at admission, given back when the response is sent.

Before session 37 a whole answer's logprobs (~20 KB a token at top_logprobs 20) were outside the plan.
Each test names what breaks it; each was seen red by making that break.
"""

from __future__ import annotations

import asyncio
import copy
import math
import random
import time
import tracemalloc
from types import SimpleNamespace

import httpx
import pytest
import torch

from kvgate.core import logprob_budget as B
from kvgate.request import Admitted, GenerationRequest, Refusal
from kvgate.sampling import prompt_logprobs, token_logprobs
from kvgate.sampling_params import SamplingParams, TokenLogprobs


def lp_request(max_tokens, k=20, held=0, prompt=(5, 6, 7, 8), **kw) -> GenerationRequest:
    sp = SamplingParams(temperature=0.0, logprobs=k)
    return GenerationRequest(list(prompt), sp, max_tokens, ignore_eos=True, held=held, **kw)


# ---- the constants hold what a position keeps ---------------------------------------------------------
@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_a_positions_logprobs_fit_their_reservation(k):
    """A generated or scored position's `TokenLogprobs`, kept in a list as the server keeps them, take
    at most `position_bytes(k)` (tracemalloc). Red with TOP_BYTES 4 at k = 20 (the old list of tuples,
    ~2.5 KB a position, is red at any constant that lets 64 MiB hold an answer)."""
    logits = torch.randn(8, 49152) * 3
    tracemalloc.start()
    kept = [token_logprobs(logits[i % 8], 1000 + i, k) for i in range(1000)]
    kept += prompt_logprobs(logits, list(range(30000, 30008)), k) * 1
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(kept) == 1008
    assert used / len(kept) <= B.position_bytes(k), (used / len(kept), B.position_bytes(k))
    assert used / len(kept) > B.position_bytes(k) * 0.6  # the constants are not a blanket over-charge


def test_packed_logprobs_keep_their_values():
    """The packed arrays give back the ids and float32 logprobs exactly, and -inf stays -inf. Red with
    float32 storage of a float64 value (a test value) or ids past 2**31 wrapping."""
    lp = TokenLogprobs(3, -0.25, [(7, -0.1), (49151, float("-inf"))])
    assert lp.top == [(7, -0.1), (49151, float("-inf"))]
    assert lp == TokenLogprobs(3, -0.25, [(7, -0.1), (49151, float("-inf"))])
    assert TokenLogprobs(3, -0.25, []).top == [] and TokenLogprobs(3, -0.25, [])  # an empty top is truthy


# ---- admission -------------------------------------------------------------------------------------------
def test_a_request_that_can_never_fit_is_a_400_naming_the_numbers(make_engine):
    """Red without the check in `admission.plan_entry` (it waited, then got a 429)."""
    e = make_engine(logprobs_memory=64 << 10)
    with pytest.raises(Refusal) as err:
        e.submit(lp_request(200, k=20))
    r = err.value
    assert (r.status, r.code, r.param) == (400, "logprobs_budget_exceeded", "max_tokens")
    need = 200 * B.position_bytes(20)
    assert r.estimated_bytes == need and r.limit_bytes == 64 << 10
    best = (64 << 10) // B.position_bytes(20)
    assert f"at most {best}" in r.message and "--logprobs-memory" in r.message
    assert e.submit(lp_request(best, k=20)).result(30).finish_reason == "length"  # the advice fits


def test_an_unset_max_tokens_is_capped_to_the_logprobs_memory_and_says_so(make_engine):
    """Red with the cap's line in `plan_entry` removed (a 400 for a request that set nothing)."""
    e = make_engine(logprobs_memory=64 << 10, max_model_len=512)
    h = e.submit(lp_request(None, k=20))
    adm = h.wait_admitted(30)
    best = (64 << 10) // B.position_bytes(20)
    assert adm.max_tokens == best and adm.budget_cap.reason == "logprobs_budget"
    assert h.result(60).completion_tokens == best


def test_a_held_reservation_lasts_until_the_handle_closes(make_engine):
    """Two requests that fit the budget one at a time: the second waits while the first's logprobs are
    held, past the first's row end, until its caller closes the handle; then it is admitted. A request
    whose logprobs the engine alone keeps (held None) gives them back at its row's end. Red with
    `give_back` at every row's end (the second admitted before the close), and with the Release command
    ignored (the second never admitted)."""
    per = 16 * B.position_bytes(20)
    e = make_engine(logprobs_memory=per + per // 2)
    a = e.submit(lp_request(16))
    a.wait_admitted(30)
    b = e.submit(lp_request(16))
    assert a.result(30).finish_reason == "length"
    time.sleep(0.3)
    assert e.snapshot().logprobs_bytes_held == per
    with pytest.raises(TimeoutError):
        b.wait_admitted(0.2)  # still waiting: a's logprobs are still held
    a.close()
    assert isinstance(b.wait_admitted(5), Admitted)
    b.result(30)
    b.close()
    c = e.submit(lp_request(16, held=None))  # the engine's own: back at the row's end
    c.result(30)
    deadline = time.monotonic() + 5
    while e.snapshot().logprobs_bytes_held and time.monotonic() < deadline:
        time.sleep(0.02)
    snap = e.snapshot()
    assert snap.logprobs_bytes_held == 0 and snap.logprobs_bytes_peak == per


def test_a_waiter_held_back_by_logprobs_memory_gets_a_429_that_says_so(make_engine):
    """The head and a logprobs request behind it (FIFO) are both told the logprobs memory held the
    line up. Red with the KV message kept (it said KV blocks did not free up, with the pool all free),
    and, for the one behind, without `head_waits` (QA pass 10: "the first of them still does not
    fit", code kv_memory_unavailable)."""
    per = 16 * B.position_bytes(20)
    e = make_engine(logprobs_memory=per + per // 2, max_queue_wait=0.3)
    a = e.submit(lp_request(16))
    a.result(30)
    b = e.submit(lp_request(16))
    c = e.submit(lp_request(2, prompt=(5, 6)))  # needs logprobs too: waits behind b (FIFO)
    with pytest.raises(Refusal) as err:
        b.wait_admitted(10)
    assert (err.value.status, err.value.code) == (429, "logprobs_memory_unavailable")
    assert "--logprobs-memory" in err.value.message and err.value.retry_after >= 1
    with pytest.raises(Refusal) as behind:
        c.wait_admitted(10)
    assert (behind.value.status, behind.value.code) == (429, "logprobs_memory_unavailable")
    assert "waited behind 1 earlier request" in behind.value.message
    assert "waits for logprobs memory" in behind.value.message
    a.close()


def test_a_scored_prompt_past_the_budget_is_a_400_even_with_max_tokens_unset():
    """Only the prompt scored (no output logprobs) and the prompt alone past the budget: the 400, not a
    cap of max_tokens. Red with `best_tokens` giving any number of tokens there (a cap of 2**62)."""
    req = GenerationRequest(list(range(3, 203)), SamplingParams(), None, prompt_logprobs=5, held=0)
    got = B.never_fits(req, 100, False, 1, 1000)
    assert isinstance(got, Refusal) and (got.status, got.param) == (400, "logprobs")
    assert B.never_fits(req, 100, False, 1, 199 * B.position_bytes(5)) is None


def test_a_closed_handle_reserves_nothing(make_engine):
    """A handle closed before its admission (its client left while it queued) holds nothing once
    admitted. Red without the `closed` check in `LogprobBudget.take`."""
    budget = B.LogprobBudget(1000)
    h = SimpleNamespace(id=7, closed=True)
    budget.take(h, 500)
    assert budget.held == 0
    h.closed = False
    budget.take(h, 500)
    budget.give_back(7)
    budget.give_back(7)  # twice: once
    assert budget.held == 0 and budget.peak == 500


def test_a_list_refused_part_way_gives_back_what_its_first_prompts_took(make_engine, monkeypatch):
    """`submit_many` refuses a later prompt (here: past the context) after the first was queued and
    admitted: the first is cancelled and closed, its logprobs back (review of session 37: held for good,
    10 of 10 tries where checking the long second prompt outlasted the first's admission; here the
    check waits for it). Red without the close in `Engine.submit_many`."""
    from kvgate.core import admission

    e = make_engine(logprobs_memory=1 << 20)
    L, real = e.max_model_len, admission.plan_entry

    def after_the_first_is_admitted(cfg, handle, followers=()):
        if len(handle.request.prompt_ids) > 10:
            assert wait_until_true(lambda: e.snapshot().logprobs_bytes_held > 0)
        return real(cfg, handle, followers)

    monkeypatch.setattr(admission, "plan_entry", after_the_first_is_admitted)
    with pytest.raises(Refusal) as err:
        e.submit_many([lp_request(32), lp_request(32, prompt=[5] * (L - 10))])
    assert err.value.code == "context_length_exceeded"
    assert wait_for_no_logprobs(e), e.snapshot().logprobs_bytes_held


def wait_until_true(pred, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.01)
    return pred()


def wait_for_no_logprobs(e, seconds: float = 5.0) -> bool:
    return wait_until_true(lambda: e.snapshot().logprobs_bytes_held == 0, seconds)


def test_two_lists_queued_in_turns_do_not_wait_on_each_other(make_engine):
    """Two held prompt lists queued x1 y1 x2 y2, the budget short of both: each list's first prompt
    reserves the whole list, and a later prompt (which needs none) passes a head that waits for
    logprobs memory alone, so both lists finish at once. Before: x2 waited for y1's bytes, y1's for y2,
    behind x2 (review of session 37): a 429 at --max-queue-wait. Red without the first prompt's
    reservation of its list, and without the pass (each: the 429)."""
    from kvgate.core import admission

    per = 16 * B.position_bytes(20)
    e = make_engine(logprobs_memory=2 * per + per // 2, max_queue_wait=3.0)
    x = admission.fit_group(e.sched_cfg, [lp_request(16), lp_request(16, prompt=(9, 10))], 1)
    y = admission.fit_group(e.sched_cfg, [lp_request(16, prompt=(11, 12)), lp_request(16, prompt=(13,))], 1)
    handles = [e.submit(r) for r in (x[0], y[0], x[1], y[1])]
    t0 = time.monotonic()
    for pair in (handles[0::2], handles[1::2]):  # a list's answer is sent when all its prompts are done
        for h in pair:
            assert h.result(10).finish_reason == "length"
        for h in pair:
            h.close()
    assert time.monotonic() - t0 < 2.5
    assert wait_for_no_logprobs(e)


def test_a_request_without_logprobs_passes_a_head_that_waits_for_them(make_engine):
    """QA pass 10: a plain request queued behind one that waits for logprobs memory waited with it (up to
    --max-queue-wait). It needs none of it: admitted at once. Red without the pass in `_admit`."""
    per = 16 * B.position_bytes(20)
    e = make_engine(logprobs_memory=per + per // 2, max_queue_wait=5.0)
    a = e.submit(lp_request(16))
    a.result(10)
    b = e.submit(lp_request(16))  # waits: a's logprobs are held until a is closed
    c = e.submit(GenerationRequest([5, 6], SamplingParams(temperature=0.0), 4, held=0))
    t0 = time.monotonic()
    assert c.result(10).finish_reason in ("length", "stop") and time.monotonic() - t0 < 2.0
    with pytest.raises(TimeoutError):
        b.wait_admitted(0.1)
    a.close()
    assert isinstance(b.wait_admitted(5), Admitted)


def test_a_list_of_prompts_that_can_never_fit_together_is_a_400(make_engine):
    """Prompts of one request are admitted and answered together: their logprobs together past the
    budget would wait for each other until a 429. Red without the check in `admission.fit_group`."""
    per = 16 * B.position_bytes(20)
    e = make_engine(logprobs_memory=per + per // 2)
    with pytest.raises(Refusal) as err:
        e.submit_many([lp_request(16), lp_request(16, prompt=(9, 10, 11))])
    assert (err.value.status, err.value.code, err.value.param) == (400, "logprobs_budget_exceeded", "prompt")


# ---- the body written while it is sent is the body ----------------------------------------------------
def _tok():
    from kvgate.models.hf_loader import TokenizerInfo
    from kvgate.tokenizer import TextTokenizer
    from tests.tiny_model import build_tokenizer

    return TextTokenizer(TokenizerInfo(build_tokenizer().to_str(), None, 0, 2, [2], False))


def _random_lps(rng, vocab, n, k) -> list[TokenLogprobs]:
    out = []
    for _ in range(n):
        top = [(rng.randrange(vocab), -rng.random() * 9) for _ in range(k)]
        if k and rng.random() < 0.2:
            top[-1] = (top[-1][0], float("-inf"))  # a token the grammar forbids
        out.append(TokenLogprobs(rng.randrange(vocab), math.log(rng.random() + 1e-9), top))
    return out


@pytest.mark.parametrize("kind, echo", [("chat", False), ("completion", False), ("completion", True)])
def test_the_written_body_is_byte_for_byte_the_json_body(kind, echo):
    """`logprob_body.logprob_response` sends exactly what `JSONResponse` sends for the dicts
    `decorate_body` builds, for n = 2 choices of 150 tokens (three slices each), non-ASCII and
    partial-character tokens, -inf, and an echoed scored prompt. Red with a slice's separator dropped,
    and with the echoed prompt's lead values left out."""
    from fastapi.responses import JSONResponse

    from kvgate.server import logprob_body as LB
    from kvgate.server.features import Features
    from kvgate.server.logprobs import decorate_body

    tok, rng = _tok(), random.Random(3)
    vocab = tok.vocab_size
    prompt = [rng.randrange(3, vocab) for _ in range(40)]
    gens = [SimpleNamespace(prompt_ids=prompt)]
    f = Features(logprobs=3, echo=echo)
    prepared = SimpleNamespace(
        kind=kind, n=2, features=f, generations=gens, request=SimpleNamespace(prompt=prompt)
    )
    lps = [_random_lps(rng, vocab, 150, 3) for _ in range(2)]
    scores = [_random_lps(rng, vocab, len(prompt) - 1, 3)] if echo else None
    texts = [tok.decode([lp.token_id for lp in c]) for c in lps]
    body = {
        "id": "x",
        "choices": [
            {"index": i, "text": t, "logprobs": None, "finish_reason": "length"} for i, t in enumerate(texts)
        ],
    }
    body["usage"] = {"prompt_tokens": 40, "completion_tokens": 300, "note": "ünïcode"}
    whole = copy.deepcopy(body)
    decorate_body(whole, prepared, tok, lps, scores)
    expected = JSONResponse(whole).body

    writers = {}
    decorate_body(
        body,
        prepared,
        tok,
        lps,
        scores,
        lambda i, ch, lp, pre: writers.__setitem__(
            i, LB.choice_writer(prepared, tok, i, ch, lp, scores, pre)
        ),
    )
    response = LB.logprob_response(body, writers, {})

    async def sent() -> bytes:
        return b"".join([part async for part in response.body_iterator])

    assert asyncio.run(sent()) == expected


# ---- over HTTP ---------------------------------------------------------------------------------------------
def test_a_served_answer_holds_its_logprobs_until_it_is_sent(make_engine):
    """A non-streamed and a streamed chat answer with top_logprobs 20 over HTTP: both complete, and once
    each response is read the engine holds no logprobs bytes; the too-large one is a 400 before any
    header. Red with `hold` left out of `serving.submitted` (the bytes stay held after the response),
    and with the middleware not closing (the same)."""
    from tests.server_util import running_server

    e = make_engine(logprobs_memory=64 << 10)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
    body.update(logprobs=True, top_logprobs=20, temperature=0, ignore_eos=True)
    with running_server(e) as (base, _app):
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert len(content) == 20 and all(len(c["top_logprobs"]) == 20 for c in content)
        with httpx.stream(
            "POST", base + "/v1/chat/completions", json={**body, "stream": True}, timeout=60
        ) as s:
            assert (
                s.status_code == 200 and sum(1 for line in s.iter_lines() if line.startswith("data: {")) >= 20
            )
        deadline = time.monotonic() + 5
        while e.snapshot().logprobs_bytes_held and time.monotonic() < deadline:
            time.sleep(0.02)
        assert e.snapshot().logprobs_bytes_held == 0
        assert e.snapshot().logprobs_bytes_peak >= 20 * B.position_bytes(20)
        big = httpx.post(base + "/v1/chat/completions", json={**body, "max_tokens": 150}, timeout=60)
        assert big.status_code == 400 and big.json()["error"]["code"] == "logprobs_budget_exceeded"


def test_the_advice_names_the_field_the_client_sent(make_engine):
    """A budget 400 says which max_tokens to lower in the client's own name: max_completion_tokens on chat,
    max_output_tokens on /v1/responses (QA pass 10: "Lower max_tokens" to a Responses client). Red
    without the renaming in `errors.from_refusal`."""
    from tests.server_util import running_server

    e = make_engine(logprobs_memory=64 << 10)
    msgs = [{"role": "user", "content": "hi"}]
    with running_server(e) as (base, _app):
        chat = {"model": "tiny", "messages": msgs, "logprobs": True, "top_logprobs": 20}
        r = httpx.post(base + "/v1/chat/completions", json={**chat, "max_completion_tokens": 150}, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "max_completion_tokens", err
        assert (
            "Lower max_completion_tokens to at most" in err["message"] and "max_tokens " not in err["message"]
        )
        resp = {
            "model": "tiny",
            "input": "hi",
            "include": ["message.output_text.logprobs"],
            "top_logprobs": 20,
        }
        r = httpx.post(base + "/v1/responses", json={**resp, "max_output_tokens": 150}, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "max_output_tokens", err
        assert "Lower max_output_tokens to at most" in err["message"], err


# ---- when logprobs memory comes back: the 429's Retry-After ----------------------------------------------
def test_logprobs_come_back_when_the_rows_holding_them_end():
    """`forecast.logprobs_steps` walks the rows that hold logprobs, soonest end first; a row without
    logprobs frees none, and what responses hold past their rows (being sent) counts as back at once.
    Red with the soonest row of any kind (the scheduler's Retry-After before: QA pass 15's 1 s for an
    11 s wait), and with the bytes past rows left out (0 steps would be 300)."""
    from kvgate.core import forecast
    from kvgate.core.snapshot import RowView
    from tests.cluster_util import snapshot

    plain = RowView(1, 5, 4, 8, 0, 10, 15)  # ends in 5 steps, holds no logprobs
    lp_long = RowView(2, 300, 4, 8, 0, 10, 310, logprobs_bytes=6000)
    lp_mid = RowView(3, 120, 4, 8, 0, 10, 130, logprobs_bytes=1000)
    snap = snapshot(
        rows=(plain, lp_long, lp_mid), logprobs_bytes_held=7000 + 2000
    )  # 2000 B past their rows (being sent)
    limit = 10_000  # 1,000 free now, 2,000 back as soon as sent
    assert forecast.logprobs_steps(snap, 3000, limit) == 0
    assert forecast.logprobs_steps(snap, 4000, limit) == 120
    assert forecast.logprobs_steps(snap, 4001, limit) == 300
    assert forecast.logprobs_steps(snap, 10_000, limit) == 300


def test_the_logprobs_429_says_when_enough_comes_back(make_engine):
    """A head waiting for logprobs memory held by a long row gets a Retry-After near that row's end,
    not the soonest row's of any kind (a short plain row ends in ~0.8 s; the logprobs row in ~10 s at 20 ms
    a step). Red with the scheduler's `retry` (soonest row) passed to the logprobs 429: Retry-After 1 or 2."""
    from kvgate.core.testing import set_step_hook

    per = B.position_bytes(20)
    e = make_engine(logprobs_memory=500 * per, max_queue_wait=0.3)
    set_step_hook(e, lambda _so: time.sleep(0.02))
    long = e.submit(lp_request(480, held=None))
    long.wait_admitted(30)
    plain = e.submit(GenerationRequest([5, 6], SamplingParams(temperature=0.0), 40, ignore_eos=True))
    plain.wait_admitted(30)
    waiter = e.submit(lp_request(100, held=None))  # 100 positions: more than the 20 left free
    with pytest.raises(Refusal) as err:
        waiter.wait_admitted(10)
    assert err.value.code == "logprobs_memory_unavailable"
    assert err.value.retry_after >= 5, err.value.retry_after
    set_step_hook(e, None)
    long.cancel()
    plain.cancel()
