"""Predicted outputs (OpenAI's `prediction`, `kvgate.core.predicted`): drafts read off the text the
client expects back, verified like any other drafts, so a request's tokens never change; what the
usage reports; and what the plan charges for them."""

from __future__ import annotations

import pytest

from kvgate.core import predicted
from kvgate.core.predicted import PredictionDrafts
from kvgate.request import GenerationRequest
from kvgate.sampling import SamplingParams
from tests.test_speculate import LOOPY, PROMPTS, greedy


def test_drafts_follow_the_prediction_and_resync_forward_after_an_edit():
    """In step: the next k prediction tokens. Departed (an edit): the longest output suffix is found
    at or after the cursor, else from the start; not found: no drafts. Broken by (seen red): trying
    the 1-token suffix first (the `9` at 8 wins over `3 9` at 10); searching from the start first
    (the earlier `5 6` is found, not the one after the cursor); not advancing past matched tokens."""
    pred = [1, 2, 3, 4, 5, 6, 7, 9, 0, 3, 9, 8, 5, 6, 4]
    p = PredictionDrafts(pred)
    assert p.propose([], 3) == [1, 2, 3]  # nothing generated yet: the prediction's start
    assert p.propose([1, 2], 3) == [3, 4, 5]
    assert p.propose([1, 2, 3, 4, 5, 6], 2) == [7, 9]
    assert p.propose([1, 2, 3, 4, 5, 6, 7, 9, 0, 3], 2) == [9, 8]  # still in step
    p = PredictionDrafts(pred)
    assert p.propose([1, 2, 3, 42, 3, 9], 2) == [8, 5]  # "3 9" (at 9..10), not the lone "9" at 7
    p = PredictionDrafts(pred)
    p.propose([1, 2, 3, 4, 5, 6, 7, 9, 0, 3, 9], 1)  # the cursor is at 11 now
    assert p.propose([1, 2, 3, 4, 5, 6, 7, 9, 0, 3, 9, 77, 5, 6], 2) == [4]  # the "5 6" ahead, at 12
    assert p.propose([1, 2, 3, 4, 5, 6, 7, 9, 0, 3, 9, 77, 5, 6, 4, 1, 2], 2) == [3, 4]  # from the start
    assert PredictionDrafts(pred).propose([55, 66], 3) == []  # nothing in common
    assert PredictionDrafts(pred).propose([1], 0) == []


def test_a_resync_tries_a_bounded_number_of_candidates(monkeypatch):
    """A common last token (a newline) occurs all over a long prediction: a re-sync checks at most
    RESYNC_CHECKS of its occurrences, so a step's Python work stays bounded. Red with the bound taken
    out of `_find` (the match past the bound was found)."""
    monkeypatch.setattr(predicted, "RESYNC_CHECKS", 8)
    pred = [7] * 20 + [1, 7, 2]  # "1 7" occurs once, after twenty 7s
    # the bound stops the search for "1 7" among the 7s: the lone "7" (at 0) is what is found
    assert PredictionDrafts(pred).propose([99, 1, 7], 1) == [7]
    assert PredictionDrafts(pred[15:]).propose([99, 1, 7], 1) == [2]  # within the bound: found


def _prediction_run(make_engine, k: int, prompt: list[int], prediction: list[int], n: int = 40):
    e = make_engine(speculate=k)
    r = e.submit(greedy(prompt, n, prediction_ids=prediction)).result(60)
    return e, r


def test_a_prediction_changes_the_steps_never_the_tokens(make_engine):
    """The tiny model's greedy answers, with the exact answer as the prediction, with a wrong one,
    and with none: the same tokens every time. The exact prediction's drafts are accepted (the
    usage's accepted_prediction_tokens), and the request takes fewer steps than the plain n-gram
    drafts needed; the wrong one's are counted rejected. Without --speculate a prediction is not
    read: (0, 0), and its tokens are not kept. Broken by (seen red): not drafting from the
    prediction (accepted stays 0); counting a span's drafts as the prediction's when they came from
    the history (a wrong prediction's `rejected` came out as accepted)."""
    base = make_engine(speculate=0)
    for prompt in PROMPTS:
        want = base.submit(greedy(prompt)).result(60).token_ids
        e, exact = _prediction_run(make_engine, 4, prompt, want)
        assert exact.token_ids == want
        accepted, rejected = exact.prediction_tokens
        assert accepted >= 0.6 * len(want) and rejected <= 4, exact.prediction_tokens
        steps_exact = e.core.state.counters.decode_steps
        e2, wrong = _prediction_run(make_engine, 4, prompt, [(t * 7 + 3) % 250 for t in want])
        assert wrong.token_ids == want
        assert wrong.prediction_tokens[0] <= 2  # a chance agreement at most
        e3, plain = _prediction_run(make_engine, 4, prompt, None)
        assert plain.token_ids == want and plain.prediction_tokens is None
        assert steps_exact < e3.core.state.counters.decode_steps or steps_exact <= len(want) // 4
    h = base.submit(greedy(LOOPY, 10, prediction_ids=[5, 6, 7]))
    assert h.request.prediction_ids == [] and h.result(60).prediction_tokens == (0, 0)


def test_a_sampled_row_with_a_prediction_keeps_its_distribution_rule(make_engine):
    """A sampled, seeded row drafts from its prediction too, verified by the rejection rule: the
    same request twice gives the same tokens (its own generator), and the counts add up to what it
    verified."""
    req = lambda: GenerationRequest(  # noqa: E731
        list(LOOPY), SamplingParams(temperature=0.7, seed=3), 30, ignore_eos=True, prediction_ids=LOOPY * 3
    )
    e = make_engine(speculate=4)
    a, b = e.submit(req()).result(60), e.submit(req()).result(60)
    assert a.token_ids == b.token_ids and a.prediction_tokens == b.prediction_tokens
    assert sum(a.prediction_tokens) <= e.core.state.counters.spec_draft_tokens


def test_the_plan_charges_a_speculating_rows_prediction(tiny_dir):
    """With --speculate, each row may hold a prediction of up to its context's positions: the row
    state grows by max_seqs x padded context x (n-gram index + prediction) bytes, exactly. Red with
    the prediction's term left out of `step_workspace`."""
    from kvgate.config import EngineConfig
    from kvgate.core.placement import plan_for
    from kvgate.memory import workspace as W
    from kvgate.models import load_model

    loaded = load_model(str(tiny_dir))
    cfg = dict(kv_cache_bytes=4 << 20, memory_limit="2GiB", dtype="float32", max_seqs=8, prefill_chunk=64)
    p0 = plan_for(loaded, EngineConfig(**cfg), overhead_bytes=0).plan
    p4 = plan_for(loaded, EngineConfig(speculate=4, **cfg), overhead_bytes=0).plan
    Lp = W.padded_len(p4.limits.max_model_len, p4.block_size)
    per_position = W.NGRAM_BYTES_PER_POSITION + W.PREDICTION_BYTES_PER_POSITION
    grown = p4.workspace_breakdown["row_state"] - p0.workspace_breakdown["row_state"]
    assert grown == 8 * Lp * per_position


def test_the_openai_client_sends_a_prediction_and_reads_the_usage(make_engine):
    """A real client, unmodified: `prediction={"type": "content", ...}` is accepted, the answer is the
    one without it, and `usage.completion_tokens_details` counts the prediction's drafts (the tiny
    model's random bytes do not re-tokenize as generated, so how many are accepted is left to the
    SmolLM2 test below). The pre-change tree refused the field (400 "predicted outputs are not
    implemented"). Also: a prediction given as text parts; one that is not text is a 400 naming it."""
    import httpx
    import openai

    from tests.server_util import running_server

    e = make_engine(speculate=4)
    msg = [{"role": "user", "content": "abc abc abc abc abc abc"}]
    with running_server(e) as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
        plain = client.chat.completions.create(model="tiny", messages=msg, temperature=0, max_tokens=40)
        text = plain.choices[0].message.content
        assert plain.usage.completion_tokens_details is None  # no prediction: no such details
        got = client.chat.completions.create(
            model="tiny",
            messages=msg,
            temperature=0,
            max_tokens=40,
            prediction={"type": "content", "content": text},
        )
        assert got.choices[0].message.content == text
        details = got.usage.completion_tokens_details
        assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0, details
        parts = {"type": "content", "content": [{"type": "text", "text": text}]}
        body = {"messages": msg, "temperature": 0, "max_tokens": 40, "prediction": parts}
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == text
        body["prediction"] = {"type": "content", "content": [{"type": "image_url", "image_url": {}}]}
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prediction.content.0", r.text


@pytest.mark.slow
def test_smollm2_editing_a_paragraph_with_its_prediction_through_the_sdk():
    """The real model, served with --speculate 4, edits a paragraph it is given, asked through the
    openai SDK with the paragraph as the prediction: the answer is the one without the prediction
    (greedy; speculation's exactness is tests/test_speculate.py's), and most of its tokens came as
    accepted prediction drafts."""
    import openai

    from bench.speculate import PARAGRAPH
    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine
    from tests.server_util import running_server

    e = Engine.from_model(
        "default", EngineConfig(speculate=4, memory_limit="3GiB", max_model_len=1024)
    ).start()
    msg = [
        {
            "role": "user",
            "content": f"Rewrite this paragraph with 'roads' in place of 'routes':\n\n{PARAGRAPH}",
        }
    ]
    try:
        with running_server(e) as (base, _):
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
            ask = dict(model=client.models.list().data[0].id, messages=msg, temperature=0, max_tokens=96)
            plain = client.chat.completions.create(**ask)
            got = client.chat.completions.create(**ask, prediction={"type": "content", "content": PARAGRAPH})
    finally:
        e.shutdown()
    assert got.choices[0].message.content == plain.choices[0].message.content
    d = got.usage.completion_tokens_details
    print(
        f"\nprediction drafts accepted {d.accepted_prediction_tokens}, rejected {d.rejected_prediction_tokens}, "
        f"of {got.usage.completion_tokens} tokens"
    )
    assert d.accepted_prediction_tokens >= 0.3 * got.usage.completion_tokens
