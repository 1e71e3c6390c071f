"""Speculation for sampled rows (`kvgate.core.spec_sample`): the rejection rule keeps the distribution
of plain sampling, the distribution it uses is the sampler's own, and in the engine a seeded sampled
row speculates, repeats itself and is not changed by its neighbours."""

from __future__ import annotations

import torch

from kvgate.core.spec_sample import accept_sampled, distributions
from kvgate.request import GenerationRequest
from kvgate.sampling import Sampler, SamplingParams, sample_batch

CHI2_DF5_999 = 20.52  # chi-square critical value, 5 degrees of freedom, p = 0.001


def chi2(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True) if p > 0)


def test_the_rejection_rule_keeps_the_distribution_of_plain_sampling():
    """Each emitted token, given the ones before it, has the row's own distribution at its
    position: the first token ~ p0 whatever the draft, the second (after the first draft was kept)
    ~ p1, the bonus token after both drafts ~ p2. 12,000 trials, chi-square at p = 0.001.
    Seen red: drawing the correction from p0 without removing the draft (a span then ended on its
    rejected draft); keeping every draft; drawing the bonus from p0 instead of p2."""
    p = torch.tensor(
        [
            [0.05, 0.6, 0.1, 0.1, 0.05, 0.1],
            [0.2, 0.1, 0.3, 0.25, 0.05, 0.1],
            [0.1, 0.1, 0.1, 0.2, 0.4, 0.1],
        ]
    )
    drafts = [1, 3]
    gen = torch.Generator().manual_seed(1234)
    first, second, third = [0] * 6, [0] * 6, [0] * 6
    for _ in range(12000):
        out = accept_sampled(drafts, p, gen)
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second[out[1]] += 1
            if out[1] == drafts[1]:
                third[out[2]] += 1
        assert 1 <= len(out) <= 3 and out[: len(out) - 1] == drafts[: len(out) - 1]
    for counts, row in ((first, p[0]), (second, p[1]), (third, p[2])):
        assert chi2(counts, row.tolist()) < CHI2_DF5_999, (counts, row.tolist())
    assert sum(third) > 1500  # the bonus branch was exercised (0.6 * 0.25 of 12,000: ~1,800)


def reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Plainly written: softmax at the temperature, top-k (renormalized) or the smallest top-p prefix
    of the full softmax, then min-p, normalized."""
    probs = torch.softmax(logits / p.temperature, -1)
    if 0 < p.top_k < logits.shape[-1]:
        keep = torch.zeros_like(probs, dtype=torch.bool)
        keep[torch.topk(probs, p.top_k).indices] = True
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum()
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_p, 0) - sorted_p
        drop = order[before >= p.top_p]
        probs = probs.clone()
        probs[drop] = 0.0
    probs = torch.where(probs < p.min_p * probs.max(), 0.0, probs)
    return probs / probs.sum()


def test_the_distribution_is_the_one_the_sampler_draws_from():
    """`distributions` equals a plainly written reference for top-k, top-p (a nucleus inside the
    sampler's 1,024 candidates and one wider than them), min-p and a logit bias, and the sampler's own
    draws follow it (chi-square over 6,000 draws). Seen red: normalizing top-p rows over the kept
    candidates before the nucleus is cut (a wider nucleus than the sampler's); ignoring the logit bias."""
    torch.manual_seed(0)
    small = torch.randn(3, 40) * 2.0
    flat = torch.randn(2, 3000) * 0.1  # top_p 0.9 keeps more than 1,024 of these tokens
    cases = [
        (small, SamplingParams(temperature=0.7, top_p=0.8)),
        (small, SamplingParams(temperature=1.3, top_k=6, min_p=0.05)),
        (small, SamplingParams(temperature=1.0, top_p=0.9, min_p=0.1, logit_bias={3: 5.0})),
        (flat, SamplingParams(temperature=1.0, top_p=0.9)),
    ]
    for logits, params in cases:
        s = Sampler(params.validate(), [], logits.shape[-1])
        got = distributions(s, logits, list(range(logits.shape[0])))
        for r in range(logits.shape[0]):
            x = logits[r].clone()
            for t, b in (params.logit_bias or {}).items():
                x[t] += b
            assert torch.allclose(got[r], reference(x, params), atol=1e-6), params
    s = Sampler(SamplingParams(temperature=0.8, top_k=6, seed=3).validate(), [], 40)
    probs = distributions(s, small, [0])[0]
    support = torch.nonzero(probs).squeeze(1).tolist()
    counts = dict.fromkeys(support, 0)
    for _ in range(6000):
        counts[sample_batch([s], small, [0])[0]] += 1
    assert chi2(list(counts.values()), probs[support].tolist()) < CHI2_DF5_999


def sampled(prompt, n=30, seed=7):
    return GenerationRequest(
        list(prompt), SamplingParams(temperature=0.8, top_p=0.95, seed=seed), n, ignore_eos=True
    )


def run(make_engine, k, reqs):
    e = make_engine(speculate=k)
    return e, [h.result(60) for h in [e.submit(r) for r in reqs]]


def test_a_seeded_sampled_row_speculates_repeats_itself_and_ignores_its_neighbours(make_engine):
    """Sampled rows now speculate: drafts are proposed and some kept, a seeded request gives the same
    tokens in two runs and alone or next to a greedy row, other sampled rows and a long prefill, and
    every block comes back. Seen red: drawing the acceptance test from the global RNG instead of the
    row's generator (two runs differ)."""
    loopy = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7] * 2
    e, alone = run(make_engine, 4, [sampled(loopy)])
    c = e.core.state.counters
    assert c.spec_draft_tokens > 0 and 0 < c.spec_accepted_tokens <= c.spec_draft_tokens
    _, again = run(make_engine, 4, [sampled(loopy)])
    greedy = GenerationRequest(list(loopy), SamplingParams(temperature=0), 20, ignore_eos=True)
    others = [sampled([9] * 12, seed=s) for s in (1, 2)]
    e, mixed = run(
        make_engine, 4, [greedy, *others, sampled(loopy), sampled([t % 250 for t in range(100, 400)], 6)]
    )
    assert alone[0].token_ids == again[0].token_ids == mixed[3].token_ids
    assert e.core.state.kv.referenced_blocks == 0
