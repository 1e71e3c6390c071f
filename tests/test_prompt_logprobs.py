"""A scored prompt (`GenerationRequest.prompt_logprobs`; OpenAI's completions `echo` with `logprobs`).

What the scores are: the log-probability of each prompt token after the first under the raw logits of
the position before it, the numbers evaluation clients (lm-evaluation-harness's `local-completions`,
perplexity scripts) read as a text's log-likelihood. What keeps them honest: a scored chunk's logits
rows count against the step's planned logits rows (the chunk is cut to fit), a scored request takes
no prefix-cache hits (a cached position would have no score), and a score does not depend on how
the prompt was chunked.
"""

from __future__ import annotations

import httpx
import pytest

from kvgate.core.testing import set_step_hook
from kvgate.request import GenerationRequest, RequestError, Token
from kvgate.sampling import SamplingParams

PROMPT = list(range(3, 23))
COMP = "/v1/completions"


def _generate(engine, prompt, n):
    """Greedy tokens and their logprobs (as generated: decode rows)."""
    h = engine.submit(
        GenerationRequest(prompt, SamplingParams(temperature=0, logprobs=1), max_tokens=n, ignore_eos=True)
    )
    events = [ev for ev in h if isinstance(ev, Token)]
    return [ev.token_id for ev in events], [ev.logprobs for ev in events]


def _score(engine, prompt, top=2, max_tokens=1):
    req = GenerationRequest(
        prompt, SamplingParams(temperature=0), max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=top
    )
    return engine.submit(req).result(60)


def test_scores_are_the_next_tokens_and_do_not_depend_on_chunking(make_engine):
    """Score a prompt followed by its own greedy continuation: each continuation token is the top
        alternative at its position and its score is the logprob it was generated with (decode rows
        against prefill rows: float32 rounding apart). Chunks of 5 and of 64 give the same scores (to float32
    rounding: the tiny model's full-weight matmuls block by row count; gguf's prompt rows are exact
    whatever the chunk, tests/test_q4_1.py). Seen red
        with the scored targets taken one position early (row.prompt[at : at + n]): the greedy check fails."""
    results = []
    for chunk in (64, 5):
        e = make_engine(prefill_chunk=chunk)
        out, gen_lps = _generate(e, PROMPT, 6)
        res = _score(e, PROMPT + out)
        lps = res.prompt_logprobs
        assert len(lps) == len(PROMPT) + len(out) - 1 and res.cached_tokens == 0
        assert [lp.token_id for lp in lps] == (PROMPT + out)[1:]
        tail = lps[-len(out) :]
        assert [lp.top[0][0] for lp in tail] == out
        assert all(len(lp.top) == 2 for lp in lps)
        for scored, generated in zip(tail, gen_lps, strict=True):
            assert scored.logprob == pytest.approx(generated.logprob, abs=1e-4)
        results.append(lps)
    for a, b in zip(*results, strict=True):  # this model's full float32 matmuls block by row count
        assert [i for i, _ in a.top] == [i for i, _ in b.top] and a.logprob == pytest.approx(
            b.logprob, abs=1e-4
        )


def test_a_scored_chunk_fits_the_planned_logits_rows(make_engine):
    """With max_seqs=2 the plan sizes the logits for 2 rows: a scored 20-token prompt runs in chunks
    that, with the decode row beside them, never need more. Seen red without the cut in
    Scheduler._pick_step (a 16-row chunk against 2 planned rows)."""
    e = make_engine(max_seqs=2, prefill_chunk=16)
    limit = e.plan.limits.max_logit_rows
    seen = []

    def count(so):
        rows = len(so.decodes) + sum(len(v.tokens) for v in so.verifies)
        rows += sum(len(p.tokens) if p.score is not None else p.wants_logits for p in so.prefills)
        seen.append((rows, [len(p.tokens) for p in so.prefills if p.score is not None]))

    set_step_hook(e, count)
    other = e.submit(
        GenerationRequest([5, 6, 7], SamplingParams(temperature=0), max_tokens=30, ignore_eos=True)
    )
    res = _score(e, PROMPT)
    other.result(60)
    assert len(res.prompt_logprobs) == len(PROMPT) - 1
    assert max(r for r, _ in seen) <= limit == 2
    assert sum(sum(c) for _, c in seen) == len(PROMPT)  # every prompt token scored once


def test_a_scored_prompt_takes_no_prefix_cache_hits(make_engine):
    """The same prompt computed once (its blocks now cached), then scored: every position is
    computed again and scored. Seen red without the `scores` check in Scheduler._admit (cached
    tokens 16, 3 scores)."""
    e = make_engine(block_size=16)
    prompt = list(range(3, 3 + 20))
    first = e.submit(GenerationRequest(prompt, SamplingParams(temperature=0), max_tokens=2)).result(60)
    again = e.submit(GenerationRequest(prompt, SamplingParams(temperature=0), max_tokens=2)).result(60)
    assert first.cached_tokens == 0 and again.cached_tokens == 16  # the cache is on
    res = _score(e, prompt)
    assert res.cached_tokens == 0 and len(res.prompt_logprobs) == len(prompt) - 1


def test_prompt_logprobs_range_is_checked():
    for bad in (-1, 21, True, 1.5):
        with pytest.raises(RequestError) as exc:
            GenerationRequest([1, 2], prompt_logprobs=bad).validate(100)
        assert exc.value.param == "prompt_logprobs"


# ---- over HTTP: the shape evaluation clients read ----------------------------------------------------
def test_echo_with_logprobs_scores_the_prompt_then_the_output(tiny_base):
    """lm-evaluation-harness's loglikelihood body (token ids, echo, logprobs=1, max_tokens=1,
    temperature 0): the prompt's tokens come first, the first with null logprob and top, each later
    with its score and its top 1 plus itself (OpenAI's logprobs + 1, as vLLM's prompt logprobs give it:
    seen red with the top 1 alone, the prompt token left out); then the generated token. Before
    session 17 this body was a 400."""
    ids = PROMPT
    body = {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0, "seed": 1234}
    r = httpx.post(tiny_base + COMP, json=body, timeout=60)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    n = len(ids) + 1
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp["token_logprobs"][1:])
    assert all(1 <= len(t) <= 2 for t in lp["top_logprobs"][1:])
    pairs = zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True)
    assert all(top[t] == v for t, v, top in pairs) and any(len(t) == 2 for t in lp["top_logprobs"][1:])
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0


def test_echo_with_max_tokens_0_returns_the_scored_prompt_alone(tiny_base):
    """The openai SDK, unmodified: `completions.create(echo=True, logprobs=..., max_tokens=0)` gives
    the prompt as text, its scores, no output token, and usage with 0 completion tokens; the scores
    are the ones the same request with max_tokens=1 gets; each top holds the prompt token (seen red with
    the top 2 alone: 'l' is not among them). Streamed, it is a 400 naming the field."""
    from openai import OpenAI

    client = OpenAI(base_url=tiny_base + "/v1", api_key="x")
    got = client.completions.create(
        model="tiny", prompt="hello there friend", echo=True, logprobs=2, max_tokens=0
    )
    c = got.choices[0]
    assert c.text == "hello there friend" and c.finish_reason == "length"
    assert got.usage.completion_tokens == 0 and got.usage.prompt_tokens == len(c.logprobs.tokens)
    assert c.logprobs.token_logprobs[0] is None and 2 <= len(c.logprobs.top_logprobs[1]) <= 3
    assert c.logprobs.top_logprobs[1][c.logprobs.tokens[1]] == c.logprobs.token_logprobs[1]  # the prompt's
    one = client.completions.create(
        model="tiny", prompt="hello there friend", echo=True, logprobs=2, max_tokens=1, temperature=0
    )
    assert one.choices[0].logprobs.token_logprobs[: len(c.logprobs.tokens)] == c.logprobs.token_logprobs
    r = httpx.post(
        tiny_base + COMP, json={"prompt": "hi", "echo": True, "logprobs": 1, "stream": True}, timeout=60
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def test_every_choice_carries_its_prompts_scores(tiny_base):
    """n=2 over two prompts: each choice's prompt entries are its own prompt's, the same for both of
    its choices (the second choice shares the first's prompt positions, whose scores the first
    holds). Seen red with each choice reading scores[i] instead of its prompt's scores[i // n] (a 500:
    four choices, two prompts' scores)."""
    prompts = [PROMPT, PROMPT[::-1]]
    body = {"prompt": prompts, "n": 2, "echo": True, "logprobs": 0, "max_tokens": 2, "temperature": 1.0}
    r = httpx.post(tiny_base + COMP, json=body, timeout=60)
    assert r.status_code == 200, r.text
    got = [c["logprobs"]["token_logprobs"][: len(PROMPT)] for c in r.json()["choices"]]
    assert len(got) == 4 and got[0] == got[1] and got[2] == got[3] and got[0] != got[2]
    assert all(v is not None for g in got for v in g[1:])


def test_a_scoring_failure_fails_the_request_instead_of_leaving_gaps(make_engine, monkeypatch):
    """A scored chunk whose scoring raises fails its row with the reason; it is not sampled (a token
    would have finished the row first and dropped the error, leaving a 200 with missing scores: seen
    red that way, finish_reason 'length')."""
    import kvgate.core.runner as runner_mod

    def broken(*_a, **_k):
        raise RuntimeError("scoring broke")

    e = make_engine()
    monkeypatch.setattr(runner_mod, "prompt_logprobs", broken)
    res = _score(e, PROMPT)
    assert res.finish_reason == "error" and "scoring broke" in res.error
    ok = e.submit(GenerationRequest(PROMPT, SamplingParams(temperature=0), max_tokens=3)).result(60)
    assert ok.finish_reason == "length"  # the engine goes on


def test_offsets_index_the_echoed_text_then_the_output(tiny_base):
    """text_offset indexes the choice's text: the prompt tokens where their text starts in the prompt
    as sent (a byte inside a split character at that character's start), then the output's from the
    prompt's length on, never decreasing nor past the text's end. Seen red on the tree before this fix,
    whose offsets ran over the tokens' names (`bytes:\\xNN` is 9 long: 13 where 3 belongs)."""
    prompt = "caf\u00e9 \u2713 na\u00efve"  # characters split across byte-level tokens
    body = {"prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 3, "temperature": 0}
    c = httpx.post(tiny_base + COMP, json={**body, "ignore_eos": True}, timeout=60).json()["choices"][0]
    offs, toks = c["logprobs"]["text_offset"], c["logprobs"]["tokens"]
    n = len(toks) - 3  # the prompt's tokens
    raw = [bytes.fromhex(t[6:].replace("\\x", "")) if t.startswith("bytes:") else t.encode() for t in toks]
    assert offs[:n] == [len(b"".join(raw[:i]).decode("utf-8", "ignore")) for i in range(n)]
    assert offs[3:6] == [3, 3, 4] and offs[n] == len(prompt)
    assert offs == sorted(offs) and offs[-1] <= len(c["text"]) and c["text"].startswith(prompt)


def test_a_context_long_prompt_with_max_tokens_0_is_a_400_with_the_numbers(tiny_base):
    """max_tokens=0 runs as 1 reserved position: a prompt of the whole context cannot take it. The 400
    names the prompt and the numbers (seen red without the check: the engine's context refusal came
    back instead, about the max_tokens the client had set to 0)."""
    L = httpx.post(tiny_base + "/v1/tokenize", json={"prompt": "x"}, timeout=60).json()["max_model_len"]
    body = {"prompt": [5] * L, "echo": True, "logprobs": 1, "max_tokens": 0}
    r = httpx.post(tiny_base + COMP, json=body, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt" and f"is {L} tokens" in err["message"], r.text


def test_the_openapi_document_allows_max_tokens_0_only_with_echo(tiny_base):
    """/openapi.json says what the server does: a completions body with `max_tokens: 0` validates with
    `echo: true` (the prompt echoed and scored alone) and not without it, and the server answers the
    second with a 400 on max_tokens. Seen red with the minimum left at 1 (the echo body failed)."""
    import jsonschema
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    doc = httpx.get(tiny_base + "/openapi.json", timeout=30).json()
    registry = Registry().with_resource("urn:kvgate", Resource.from_contents(doc, DRAFT202012))
    schema = {"$ref": "urn:kvgate#/components/schemas/CompletionRequest"}
    check = jsonschema.Draft202012Validator(schema, registry=registry)
    echoed = {"model": "tiny", "prompt": "hi", "echo": True, "logprobs": 1, "max_tokens": 0}
    assert check.is_valid(echoed)
    bare = {"model": "tiny", "prompt": "hi", "max_tokens": 0}
    assert not check.is_valid(bare) and not check.is_valid({**bare, "max_tokens": -1})
    r = httpx.post(tiny_base + COMP, json=bare, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    streamed = {"model": "tiny", "prompt": "hi", "echo": True, "max_tokens": 0, "stream": True}
    assert not check.is_valid(streamed)  # answered whole only: a 400 (seen valid before the stream rule)
    assert httpx.post(tiny_base + COMP, json=streamed, timeout=60).status_code == 400
    assert httpx.post(tiny_base + COMP, json=echoed, timeout=60).status_code == 200
