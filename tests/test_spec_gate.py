"""The per-row draft gate of `--speculate` (`kvgate.core.speculate.DraftGate`): a row whose drafts
keep being rejected stops drafting, probes again after a doubling pause and drafts every step once
its drafts are kept again; and the gate changes nothing that is promised: greedy tokens equal plain
decoding, a seeded sampled row repeats itself and ignores its neighbours."""

from __future__ import annotations

from kvgate.core import speculate
from kvgate.core.speculate import DraftGate
from kvgate.request import GenerationRequest
from kvgate.sampling import SamplingParams


def test_the_gate_pauses_doubles_and_resumes_from_the_rows_own_verifies():
    """Pure: 5 rejected spans take the rate from 1.0 below KEEP_MIN; each failed probe doubles the
    pause (PAUSE_MIN, twice that ... up to PAUSE_MAX); a probe that keeps a quarter of its drafts (above KEEP_MIN) reopens
    the gate, and the next pause starts again at PAUSE_MIN. Seen red: `open` always True; the pause
    not doubled; the probe judged from the rate it paused at (a 1-of-4 probe does not resume); the
    pause length not reset when drafting resumes (the next pause is PAUSE_MAX)."""
    g, n = DraftGate(), 100
    for _ in range(4):
        g.observe(4, 0, n)
        assert g.open(n)
    g.observe(4, 0, n)
    p = speculate.PAUSE_MIN
    assert not g.open(n + p - 1) and g.open(n + p)
    g.observe(4, 0, n + p)
    assert not g.open(n + 3 * p - 1) and g.open(n + 3 * p)
    for _ in range(10):
        g.observe(4, 0, n)
    assert g.pause == speculate.PAUSE_MAX and not g.open(n + speculate.PAUSE_MAX - 1)
    n += speculate.PAUSE_MAX
    g.observe(4, 1, n)  # the probe keeps 1 of 4: drafting resumes at once
    assert g.open(n + 1) and g.pause == 0
    g.observe(4, 0, n + 1)  # one more rejection: a short pause again
    assert not g.open(n + 1) and g.open(n + 1 + speculate.PAUSE_MIN)
    g.observe(0, 0, n + 50)  # no drafts (nothing to learn)
    assert g.open(n + 50)


def _record(e, force):
    """Wrap the runner: `force(relative position, drafts, verified) -> verified` rewrites each verify
    span's result; returns the log of (position relative to the first decode, verified?) per step."""
    real, log, first = e.core.runner.execute, [], []

    def execute(so):
        mo = real(so)
        for d in so.decodes:
            first[:] = first or [d.position]
            log.append((d.position - first[0], False))
        for v in so.verifies:
            first[:] = first or [v.start]
            rel = v.start - first[0]
            log.append((rel, True))
            mo.verified[v.request_id] = force(rel, v.tokens[1:], mo.verified[v.request_id])
        return mo

    e.core.runner.execute = execute
    return log


def test_a_row_whose_drafts_are_rejected_stops_drafting_and_resumes_after_the_pause(make_engine):
    """The prompt holds every token id, so a lookup always finds drafts: without the gate every step
    would verify. Every span is forced to keep nothing (its first token is the model's own) until
    position 60, then to keep all its drafts. With PAUSE_MIN 4, verify steps: positions 0-4 (the
    rate falls below KEEP_MIN), the probes at 9 (after 4 tokens), 18 (after 8) and 35 (after 16),
    then 68 (after 32), which keeps its drafts: from there every step verifies again. Seen red:
    `DraftGate.open` always True (every step verified); the pause not doubled (probes at 9, 14,
    19 ...); a paused row decoded one position late; the updater reporting every span as keeping
    nothing (`observe(drafted, 0, ...)`: no verify after the probe that keeps its drafts)."""
    assert speculate.PAUSE_MIN == 4  # the positions below
    e = make_engine(speculate=4)
    vocab = e.tokenizer.vocab_size
    log = _record(e, lambda rel, drafts, got: got[:1] if rel < 60 else [*drafts, drafts[-1]])
    req = GenerationRequest(list(range(vocab)), SamplingParams(temperature=0), 120, ignore_eos=True)
    r = e.submit(req).result(60)
    assert len(r.token_ids) == 120
    verified = [rel for rel, v in log if v]
    assert verified[:9] == [0, 1, 2, 3, 4, 9, 18, 35, 68], verified
    after = [v for rel, v in log if rel >= 68]
    assert all(after[:-1]), log  # drafting every step (the last may have no room left for drafts)
    assert not any(v for rel, v in log if 4 < rel < 68 and rel not in (9, 18, 35))


def _paused(e):
    """Wrap the runner to note whether any row's gate was closed at some step."""
    real, seen = e.core.runner.execute, []

    def execute(so):
        seen.extend(
            rid
            for rid, row in e.core.state.running.items()
            if row.gate is not None and not row.gate.open(len(row.tokens))
        )
        return real(so)

    e.core.runner.execute = execute
    return seen


def _run(make_engine, reqs):
    e = make_engine(speculate=4)
    seen = _paused(e)
    return e, seen, [h.result(60) for h in [e.submit(r) for r in reqs]]


def sampled(prompt, n=60, seed=7):
    return GenerationRequest(
        list(prompt), SamplingParams(temperature=0.8, top_p=0.95, seed=seed), n, ignore_eos=True
    )


def test_a_seeded_sampled_row_with_the_gate_repeats_itself_and_ignores_its_neighbours(make_engine):
    """On the tiny random model most sampled drafts are rejected, so the gate pauses the row (checked);
    it still gives the same tokens in two runs and next to a greedy row, other sampled rows with their
    own gates and a long prefill. Seen red: one DraftGate shared by every row of the scheduler (the
    row's pauses then follow its neighbours' verifies: the batched tokens differ)."""
    loopy = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7] * 2
    e, seen, alone = _run(make_engine, [sampled(loopy)])
    assert seen, "the gate never paused: the test would not exercise it"
    _, _, again = _run(make_engine, [sampled(loopy)])
    greedy = GenerationRequest(list(loopy), SamplingParams(temperature=0), 40, ignore_eos=True)
    others = [sampled([9] * 12, seed=s) for s in (1, 2)] + [sampled(list(range(200)), seed=3)]
    e, _, mixed = _run(
        make_engine, [greedy, *others, sampled(loopy), sampled([t % 250 for t in range(100, 400)], 6)]
    )
    assert alone[0].token_ids == again[0].token_ids == mixed[4].token_ids
    assert e.core.state.kv.referenced_blocks == 0


def test_greedy_tokens_with_the_gate_are_those_of_decoding_without_speculation(make_engine):
    """Greedy rows on prompts whose drafts the tiny model mostly rejects (the gate pauses them,
    checked) and on a loop (kept drafts): the tokens equal K=0's, alone and batched. Seen red: a
    paused row sent as a decode one position late (`position=len(tokens)`)."""
    prompts = [list(range(200)), [20, 21, 22, 23, 24, 25] * 3, [5, 6, 7, 8] * 3, list(range(30, 60)) * 2]

    def reqs():
        return [
            GenerationRequest(list(p), SamplingParams(temperature=0), 80, ignore_eos=True) for p in prompts
        ]

    e0 = make_engine(speculate=0)
    plain = [h.result(60) for h in [e0.submit(r) for r in reqs()]]
    e, seen, spec = _run(make_engine, reqs())
    assert seen, "the gate never paused: the test would not exercise it"
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    c = e.core.state.counters
    assert c.spec_draft_tokens > 0 and c.spec_accepted_tokens > 0
    assert e.core.state.kv.referenced_blocks == 0
