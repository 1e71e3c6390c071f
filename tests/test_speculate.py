"""Prompt-lookup speculative decoding (`--speculate K`, `kvgate.core.speculate`): the drafts, the
acceptance rule, and the promise that matters: a request's tokens are what they are without
speculation, alone or batched, with its limits, stops and KV blocks intact (as exact as batching
is: a tie made exact on purpose can flip, see kvgate.core.speculate)."""

from __future__ import annotations

import pytest

from kvgate.core.speculate import NgramIndex, accept
from kvgate.request import GenerationRequest
from kvgate.sampling import SamplingParams

LOOPY = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]  # drafts from the prompt itself
PROMPTS = [LOOPY, [20, 21, 22, 23, 24, 25], list(range(30, 60)) * 2, [9] * 12]


def test_drafts_follow_the_most_recent_earlier_occurrence_of_the_longest_suffix():
    """Broken by (seen red): looking the suffix up including its own occurrence (no drafts ever, or
    drafts from the future); preferring the oldest occurrence; trying short suffixes first."""
    idx = NgramIndex()
    assert idx.propose([1, 2, 3, 1, 2], 3) == [3, 1, 2]  # "1 2" occurred at 0..1, then came 3 1 2
    # the 3-gram "7 8 9" occurred once, followed by 4; the 1-gram "9" more recently, followed by 5
    toks = [7, 8, 9, 4, 0, 9, 5, 7, 8, 9]
    assert NgramIndex().propose(toks, 2) == [4, 0]
    assert NgramIndex().propose([1, 2, 1, 3, 1, 4, 1], 1) == [4]  # the most recent "1" is at 4
    assert NgramIndex().propose([1, 2, 3], 4) == []  # nothing occurred before
    assert NgramIndex().propose([1, 2, 1], 0) == []
    idx = NgramIndex()  # incremental: the same answers as a fresh index after the list grows
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6]
    for n in range(2, len(seq) + 1):
        assert idx.propose(seq[:n], 3) == NgramIndex().propose(seq[:n], 3), n


def test_acceptance_keeps_agreeing_drafts_and_adds_the_models_own_next_token():
    assert accept([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all agree: the bonus token too
    assert accept([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # the model's own token at the first mismatch
    assert accept([4, 5, 6], [1, 5, 6, 7]) == [1]  # nothing kept: one token, as without drafts


def generate(make_engine, k: int, requests: list[GenerationRequest]):
    e = make_engine(speculate=k)
    handles = [e.submit(r) for r in requests]
    results = [h.result(60) for h in handles]
    return e, results


def greedy(prompt, n=40, **kw):
    return GenerationRequest(list(prompt), SamplingParams(temperature=0), n, ignore_eos=True, **kw)


def test_greedy_tokens_are_those_of_decoding_without_speculation(make_engine):
    """The tiny model's greedy outputs with 4 drafts per step equal those without, drafts were
    proposed and some accepted (so fewer steps ran), and every KV block came back. Broken by (seen
    red): keeping the draft at the first mismatch instead of the model's token; writing the drafts'
    K/V one position late (the verify span started at the last token's position + 1)."""
    reqs = [greedy(p) for p in PROMPTS]
    _, plain = generate(make_engine, 0, reqs)
    e, spec = generate(make_engine, 4, [greedy(p) for p in PROMPTS])
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    c = e.core.state.counters
    assert c.spec_draft_tokens > 0 and 0 < c.spec_accepted_tokens <= c.spec_draft_tokens
    assert c.generated_tokens == sum(len(r.token_ids) for r in spec)
    kv = e.core.state.kv
    assert kv.referenced_blocks == 0


def test_a_batched_row_speculates_as_it_does_alone(make_engine):
    """Batching never changes what a request generates: a speculating greedy row next to sampled rows
    and a long prompt still prefilling gives its tokens alone; the sampled rows (which speculate by
    the rejection rule, tests/test_spec_sample.py) keep their seeded draws."""
    sampled = [
        GenerationRequest(list(p), SamplingParams(temperature=0.9, seed=7), 30, ignore_eos=True)
        for p in PROMPTS
    ]
    _, alone = generate(make_engine, 4, [greedy(LOOPY)])
    _, sampled_alone = generate(make_engine, 4, sampled)
    e, mixed = generate(
        make_engine, 4, [greedy(LOOPY), *sampled, greedy([t % 250 for t in range(100, 400)], 8)]
    )
    assert mixed[0].token_ids == alone[0].token_ids
    assert [r.token_ids for r in mixed[1:5]] == [r.token_ids for r in sampled_alone]


def test_limits_and_stops_end_a_row_inside_its_accepted_drafts(make_engine):
    """max_tokens is exact with drafts (1, 2, 5 and 23 tokens all equal the plain answer's prefixes),
    the counters agree, and every block comes back. Drafts stop one short of the row's limit, so the
    model's own token ends it and no verified token is wasted; the K/V a span writes stays inside
    the row's reserved positions either way (the last draft sits at most at prompt + max_tokens - 1)."""
    _, plain = generate(make_engine, 0, [greedy(LOOPY, 23)])
    ref = plain[0].token_ids
    e, spec = generate(make_engine, 4, [greedy(LOOPY, n) for n in (1, 2, 5, 23)])
    assert [r.token_ids for r in spec] == [ref[:1], ref[:2], ref[:5], ref]
    c = e.core.state.counters
    assert c.spec_accepted_tokens > 0 and c.generated_tokens == 1 + 2 + 5 + 23


def test_a_stop_inside_an_accepted_span_ends_the_row_there(make_engine):
    """The rest of a verified span after a stop token is dropped: not appended, counted or sent.
    The span is forced (the runner's answer for the row is replaced by [7, STOP, 8]) so the stop
    lands mid-span whatever the random model does. Broken by (seen red): appending the rest of the
    span after the row finished (token 8 counted after the stop); counting the dropped 8 as an
    accepted draft (`kvgate_spec_decode_accepted_tokens_total` one too high)."""
    e = make_engine(speculate=4)
    real = e.core.runner.execute
    forced = []

    def execute(so):
        mo = real(so)
        for rid in list(mo.verified)[:1]:
            if not forced:
                mo.verified[rid] = [7, 250, 8]
                forced.append(rid)
        return mo

    e.core.runner.execute = execute
    r = e.submit(greedy(LOOPY, 30, stop_token_ids=[250])).result(60)
    assert forced and r.finish_reason == "stop" and r.token_ids[-2:] == [7, 250]
    c = e.core.state.counters
    assert c.generated_tokens == len(r.token_ids)
    # one token of the step's own per step (the prompt's last chunk gave the first), the rest drafts
    assert c.generated_tokens == 1 + c.decode_steps + c.spec_accepted_tokens
    assert e.core.state.kv.referenced_blocks == 0


def test_the_plan_reserves_the_verification_width(tiny_dir):
    """Every decoding row may bring K drafts: the step's tokens and logits rows, and with them the
    workspace, grow; a K past the ceiling is refused with the range."""
    from kvgate.config import EngineConfig
    from kvgate.core.placement import DeviceError, plan_for
    from kvgate.models import load_model

    loaded = load_model(str(tiny_dir))
    cfg = dict(kv_cache_bytes=4 << 20, memory_limit="2GiB", dtype="float32", max_seqs=8, prefill_chunk=64)
    p0 = plan_for(loaded, EngineConfig(**cfg), overhead_bytes=0).plan
    p4 = plan_for(loaded, EngineConfig(speculate=4, **cfg), overhead_bytes=0).plan
    assert p0.limits.max_step_tokens == 64 + 8 and p4.limits.max_step_tokens == 64 + 8 * 5
    assert p4.limits.max_logit_rows == 40 and p4.workspace_bytes > p0.workspace_bytes
    # each row's n-gram index: ~300 B per position of its history, held while it runs
    assert p4.workspace_breakdown["row_state"] > p0.workspace_breakdown["row_state"]
    with pytest.raises(DeviceError, match="0 \\(off\\) to 8"):
        plan_for(loaded, EngineConfig(speculate=9, **cfg), overhead_bytes=0)


@pytest.mark.slow
def test_smollm2_rewriting_a_paragraph_speculates_and_keeps_its_greedy_tokens():
    """The real model on an input-grounded request (repeat a paragraph): the answer copies the prompt,
    so most drafts are accepted, and the tokens are those of plain greedy decoding."""
    from bench.speculate import PARAGRAPH
    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine

    outs = {}
    for k in (0, 4):
        e = Engine.from_model(
            "default", EngineConfig(speculate=k, memory_limit="3GiB", max_model_len=1024)
        ).start()
        try:
            msg = [{"role": "user", "content": f"Repeat this paragraph exactly:\n\n{PARAGRAPH}"}]
            ids = e.tokenizer.encode(e.tokenizer.render_chat(msg))
            outs[k] = e.generate(
                GenerationRequest(ids, SamplingParams(temperature=0), 64), timeout=300
            ).token_ids
            c = e.core.state.counters
            if k:
                print(f"\ndrafts accepted {c.spec_accepted_tokens}/{c.spec_draft_tokens}")
                assert c.spec_accepted_tokens >= 0.5 * c.spec_draft_tokens > 0
        finally:
            e.shutdown()
    assert outs[4] == outs[0]


def test_the_openai_client_streams_the_same_text_from_a_speculating_server(make_engine):
    """A real client, unmodified: greedy chat completions (streamed and not) from a server with
    --speculate 4 are the text of a server without it, and its /metrics count the drafts."""
    import httpx
    import openai

    from tests.server_util import running_server

    texts = {}
    for k in (0, 4):
        e = make_engine(speculate=k)
        with running_server(e) as (base, _):
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
            msg = [{"role": "user", "content": "abc abc abc abc abc abc"}]
            whole = client.chat.completions.create(model="tiny", messages=msg, temperature=0, max_tokens=40)
            chunks = client.chat.completions.create(
                model="tiny", messages=msg, temperature=0, max_tokens=40, stream=True
            )
            streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            texts[k] = (whole.choices[0].message.content, streamed)
            metrics = httpx.get(base + "/metrics").text
        if k:
            drafted = [
                ln for ln in metrics.splitlines() if ln.startswith("kvgate_spec_decode_draft_tokens_total")
            ]
            assert drafted and float(drafted[0].split()[-1]) > 0, drafted
    assert texts[4] == texts[0] and texts[0][0] == texts[0][1]
