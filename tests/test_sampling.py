"""Sampling (`kvgate.sampling`): parameter validation with messages a client can act on, seeded
determinism, and each logits processor doing what it says."""

from __future__ import annotations

import math

import pytest
import torch

from kvgate.sampling import Sampler, SamplingError, SamplingParams

VOCAB = 64


@pytest.fixture(autouse=True, params=["native", "torch"])
def draw_path(request, monkeypatch):
    """Every test here runs on both draws: kvgate's C++ kernel (the CPU's) and the PyTorch path (off
    the CPU, or where the kernels did not build)."""
    import kvgate.sampling as sampling
    from kvgate.models import native

    native.extension()  # built here if no model load built it yet (the sampler never builds it)
    if request.param == "native" and sampling.draw_kernel(torch.zeros(1, 2)) is None:
        pytest.skip("kvgate's C++ kernels did not build")
    monkeypatch.setattr(sampling, "NATIVE_DRAW", request.param == "native")
    return request.param


def torch_path_only(draw_path: str) -> None:
    if draw_path == "native":
        pytest.skip("a test of the PyTorch draw's own stages (the kernel's: tests/test_draw_kernel.py)")


def draws(params: SamplingParams, logits: torch.Tensor, n: int, prompt: list[int] | None = None) -> list[int]:
    s = Sampler(params, prompt or [], logits.shape[-1])
    return [s.sample(logits) for _ in range(n)]


def random_logits(seed: int, n: int = VOCAB, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale


# ---- validation ----------------------------------------------------------------------------------

BAD = [
    ("temperature", -1.0, "0 <= temperature <= 2"),
    ("temperature", math.nan, "0 <= temperature <= 2"),
    ("temperature", math.inf, "0 <= temperature <= 2"),
    ("temperature", 3, "0 <= temperature <= 2"),
    ("top_p", 0.0, "0 < top_p <= 1"),
    ("top_p", 1.5, "0 < top_p <= 1"),
    ("top_k", -2, "0 / -1 for no limit"),
    ("top_k", 2.5, "an integer"),
    ("min_p", 2.0, "0 <= min_p <= 1"),
    ("min_p", -0.1, "0 <= min_p <= 1"),
    ("repetition_penalty", 0.0, "0 < repetition_penalty <= 2"),
    ("repetition_penalty", 2.5, "0 < repetition_penalty <= 2"),
    ("presence_penalty", -2.5, "-2 <= presence_penalty <= 2"),
    ("presence_penalty", 3.0, "-2 <= presence_penalty <= 2"),
    ("frequency_penalty", 2.1, "-2 <= frequency_penalty <= 2"),
    ("frequency_penalty", -math.inf, "-2 <= frequency_penalty <= 2"),
    ("seed", -(2**63) - 1, "-2**63 <= seed < 2**64"),
    ("seed", 2**64, "-2**63 <= seed < 2**64"),
    ("seed", 1.5, "-2**63 <= seed < 2**64"),
    ("logprobs", 21, "0 <= top logprobs <= 20"),
    ("logprobs", -1, "0 <= top logprobs <= 20"),
    ("logit_bias", {5: 101.0}, "-100 <= bias <= 100"),
]


@pytest.mark.parametrize("param,value,allowed", BAD, ids=[f"{p}={v}" for p, v, _ in BAD])
def test_out_of_range_values_raise_an_error_naming_parameter_value_and_allowed_range(param, value, allowed):
    """Seen to fail when a range check is loosened (e.g. top_p allows 0) and, for nan/inf, when the
    message only said "a finite number" without the range."""
    with pytest.raises(SamplingError) as err:
        SamplingParams(**{param: value}).validate()
    msg = str(err.value)
    assert err.value.param == param
    assert msg.startswith(f"{param}={value!r}")
    assert allowed in msg


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=0),
        dict(temperature=2, top_p=1, top_k=-1, min_p=1),
        dict(top_k=0, repetition_penalty=2, presence_penalty=-2, frequency_penalty=2),
        dict(seed=0),
        dict(seed=2**63 - 1),
        dict(seed=-1),  # any 64-bit seed: issue 13 (clients send -1)
        dict(seed=-(2**63)),
        dict(seed=2**64 - 1),
        dict(logprobs=0, logit_bias={3: -100, 4: 100.0}),
        dict(logprobs=20),
    ],
)
def test_values_at_the_edges_of_each_range_are_accepted(kw):
    """Seen to fail when an inclusive bound is made exclusive (e.g. temperature 2 refused)."""
    assert SamplingParams(**kw).validate() is not None


# ---- determinism ---------------------------------------------------------------------------------


def test_the_same_seed_gives_the_same_tokens_and_another_seed_different_ones():
    """Seen to fail when the sampler draws from the global RNG instead of its own generator."""
    logits = random_logits(0, scale=0.5)  # flat-ish: many tokens are likely
    a = draws(SamplingParams(seed=1234), logits, 40)
    torch.manual_seed(99)  # the global RNG must not matter
    b = draws(SamplingParams(seed=1234), logits, 40)
    c = draws(SamplingParams(seed=4321), logits, 40)
    assert a == b
    assert a != c
    assert len(set(a)) > 5  # really sampling, not collapsing to one token


def test_temperature_zero_is_argmax_whatever_the_seed_and_filters():
    """Seen to fail when temperature 0 samples (the greedy branch removed)."""
    for seed in range(20):
        logits = random_logits(seed, scale=0.3)
        p = SamplingParams(temperature=0, seed=seed, top_k=50, top_p=0.9, min_p=0.05)
        assert draws(p, logits, 3) == [int(logits.argmax())] * 3


def test_top_k_one_is_greedy():
    """Seen to fail when top-k masks with `<=` the k-th value (everything masked) or is skipped."""
    for seed in range(20):
        logits = random_logits(seed, scale=0.3)
        assert draws(SamplingParams(top_k=1, seed=seed), logits, 5) == [int(logits.argmax())] * 5


def test_a_tiny_top_p_is_greedy():
    """Seen to fail when top-p keeps tokens whose own cumulative mass (not the mass before them) is
    within top_p (nothing would be kept) or when it is skipped."""
    for seed in range(20):
        logits = random_logits(seed, scale=0.3)
        assert draws(SamplingParams(top_p=1e-6, seed=seed), logits, 5) == [int(logits.argmax())] * 5


PROBS = torch.tensor([0.45, 0.3, 0.15, 0.07, 0.03])


def test_top_k_keeps_only_the_k_most_likely_tokens():
    """Seen to fail when top-k is skipped."""
    got = set(draws(SamplingParams(top_k=2, seed=3), PROBS.log(), 400))
    assert got == {0, 1}
    assert set(draws(SamplingParams(seed=3), PROBS.log(), 400)) == {0, 1, 2, 3, 4}


def test_top_p_keeps_the_smallest_set_reaching_p():
    """0.45 + 0.3 = 0.75 reaches 0.7: tokens 2..4 are never drawn. Seen to fail when top-p is skipped."""
    assert set(draws(SamplingParams(top_p=0.7, seed=5), PROBS.log(), 400)) == {0, 1}


def test_min_p_drops_tokens_less_likely_than_min_p_times_the_top_probability():
    """min_p 0.2 of 0.45 = 0.09: tokens at 0.07 and 0.03 go, 0.15 stays.

    Seen to fail when min_p is compared with the absolute probability (0.15 < 0.2 would be dropped)
    and when it is skipped.
    """
    assert set(draws(SamplingParams(min_p=0.2, seed=7), PROBS.log(), 400)) == {0, 1, 2}


def test_temperature_sharpens_and_flattens_the_distribution():
    """Seen to fail when logits are multiplied by the temperature instead of divided."""
    low = draws(SamplingParams(temperature=0.2, seed=11), PROBS.log(), 400)
    high = draws(SamplingParams(temperature=2.0, seed=11), PROBS.log(), 400)
    assert low.count(0) > 300  # (0.45/0.3) ** 5 = 7.6: token 0 about 88% of the time
    assert high.count(0) < 200  # flatter than the original 45%
    assert len(set(high)) == 5


# ---- penalties -------------------------------------------------------------------------------------


def greedy(logits: list[float], n: int, prompt: list[int] | None = None, **kw) -> list[int]:
    return draws(SamplingParams(temperature=0, **kw), torch.tensor(logits), n, prompt)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    """Seen tokens (prompt or output) get less likely either way round the sign.

    Seen to fail when positive and negative logits are both divided (a negative logit would rise).
    """
    assert greedy([2.0, 1.8, 0.0], 1, prompt=[0], repetition_penalty=1.2) == [1]  # 2.0 / 1.2 < 1.8
    assert greedy([-1.0, -1.1, -5.0], 1, prompt=[0], repetition_penalty=1.2) == [1]  # -1.0 * 1.2 < -1.1
    assert greedy([2.0, 1.8, 0.0], 1, prompt=[0]) == [0]  # no penalty: token 0
    # A penalty below 1 favours repetition.
    assert greedy([1.8, 2.0, 0.0], 1, prompt=[0], repetition_penalty=0.8) == [0]
    # Generated tokens count as seen too.
    assert greedy([2.0, 1.8, 0.0], 3, repetition_penalty=1.2) == [0, 1, 0]  # 2.0/1.2 > 1.8/1.2


def test_presence_penalty_subtracts_once_for_any_token_already_generated():
    """A: 1.0, B: 0.8, presence 0.5 -> A, then B (A is 0.5), then A twice (0.5 > 0.3): A's second
    use costs nothing more.

    Seen to fail when the presence penalty scales with the count (it is the frequency penalty's job).
    """
    assert greedy([1.0, 0.8, -3.0], 4, presence_penalty=0.5) == [0, 1, 0, 0]
    assert greedy([1.0, 0.8, -3.0], 4) == [0, 0, 0, 0]


def test_frequency_penalty_grows_with_how_often_a_token_was_generated():
    """A: 1.0, B: 0.3, frequency 0.4 -> A (1.0), A (0.6), then B (A is down to 0.2).

    Seen to fail when the frequency penalty is applied once per token regardless of count.
    """
    assert greedy([1.0, 0.3, -3.0], 3, frequency_penalty=0.4) == [0, 0, 1]


def test_negative_presence_penalty_makes_generated_tokens_more_likely():
    """Seen to fail when the penalty's sign is flipped (added instead of subtracted)."""
    logits = torch.tensor([1.0, 0.9, -3.0])
    s = Sampler(SamplingParams(temperature=0, presence_penalty=-2.0), [], 3)
    first = s.sample(logits)
    later = s.sample(torch.tensor([0.9, 1.0, -3.0]))  # the other token now leads by 0.1
    assert (first, later) == (0, 0)
    assert torch.equal(logits, torch.tensor([1.0, 0.9, -3.0]))


def test_penalties_never_modify_the_callers_logits():
    """The logits handed in may be a view into the whole batch's logits.

    Seen to fail when the penalized sampler works in place (no clone).
    """
    batch = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    before = batch.clone()
    s = Sampler(
        SamplingParams(repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=1.0, seed=1),
        list(range(10)),
        VOCAB,
    )
    for _ in range(5):
        s.sample(batch[1])
    assert torch.equal(batch, before)


def test_penalties_work_when_the_model_has_more_logits_than_the_tokenizer_has_tokens():
    """Models often pad the embedding past the tokenizer's vocabulary (Qwen2: 151,936 vs 151,665).

    Seen to fail (IndexError, which kills the engine worker) when the seen-token mask is sized by
    the tokenizer's vocabulary instead of the logits it is applied to.
    """
    logits = torch.tensor([2.0, 1.8, 0.0, -1.0, -1.0, -1.0])
    s = Sampler(SamplingParams(temperature=0, repetition_penalty=1.2), [0], vocab_size=4)
    assert s.sample(logits) == 1
    s = Sampler(SamplingParams(seed=1, frequency_penalty=0.5), [], vocab_size=4)
    assert all(0 <= s.sample(logits) < 6 for _ in range(20))


# ---- batched sampling (one call for every row of a step) -------------------------------------------

MIXED = [
    dict(temperature=0),
    dict(temperature=0.8, top_p=0.9),
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.2, min_p=0.05),
    dict(temperature=0.9, top_p=0.5, top_k=20, min_p=0.02),
    dict(temperature=0.8, top_p=0.9, repetition_penalty=1.3, frequency_penalty=0.5),
    dict(temperature=0, presence_penalty=1.0),
    dict(temperature=1.0, top_p=0.9),
]


def test_a_row_draws_the_same_tokens_alone_or_in_any_batch():
    """sample_batch over rows with mixed parameters gives each row exactly the tokens it draws when
    sampled alone with the same seed, step after step, whatever its neighbours and position. Broken
    by (each seen red): drawing every row's uniform from the first row's generator; one candidate
    count for the whole batch (max over rows); top-p renormalized over the candidates."""
    from kvgate.sampling import sample_batch

    vocab, steps = 3000, 6
    logits = [
        torch.stack([random_logits(100 * t + i, vocab) for i in range(len(MIXED))]) for t in range(steps)
    ]

    def run(order: list[int]) -> dict[int, list[int]]:
        samplers = {i: Sampler(SamplingParams(seed=i, **MIXED[i]), [1, 2, 3], vocab) for i in order}
        out = {i: [] for i in order}
        for t in range(steps):
            rows = [i for i in order]
            got = sample_batch([samplers[i] for i in rows], logits[t], rows)
            for i, tok in zip(rows, got, strict=True):
                out[i].append(tok)
        return out

    alone = {i: run([i])[i] for i in range(len(MIXED))}
    assert run(list(range(len(MIXED)))) == alone
    assert run(list(reversed(range(len(MIXED))))) == alone
    assert len({tuple(v) for v in alone.values()}) > 3  # the rows really differ


def test_top_p_wider_than_the_candidate_prefilter_still_draws_from_the_whole_nucleus():
    """With nearly flat logits the top-0.99 nucleus holds far more than TOP_P_CANDIDATES tokens: the
    sampler must fall back to a full sort, so tokens ranked past the prefilter get drawn. Broken by:
    skipping the fallback (only the top 1024 can ever be drawn)."""
    from kvgate.draw_torch import TOP_P_CANDIDATES

    vocab = 4 * TOP_P_CANDIDATES
    logits = random_logits(7, vocab, scale=0.05)
    rank = torch.empty(vocab, dtype=torch.long)
    rank[torch.argsort(logits, descending=True)] = torch.arange(vocab)
    got = draws(SamplingParams(temperature=1.0, top_p=0.99, seed=3), logits, 200)
    assert max(int(rank[t]) for t in got) >= TOP_P_CANDIDATES


def test_top_p_draws_the_same_tokens_whichever_candidates_first_hold_the_nucleus(draw_path, monkeypatch):
    """Top-p looks at the TOP_P_FIRST most likely tokens, then at TOP_P_CANDIDATES, then sorts in
    full. Three rows whose nuclei need each stage (5, 391 and 6862 tokens of 8192), drawn together and
    alone with 20 seeds, give the very tokens of a sampler that starts at TOP_P_CANDIDATES (the one
    before the first stage existed). Seen red: the widened rows drawn without their nucleus cut
    (`kept` replaced by the raw probabilities)."""
    torch_path_only(draw_path)
    import kvgate.draw_torch as draw_torch
    import kvgate.sampling as sampling

    vocab = 8192
    gen = torch.Generator().manual_seed(5)
    rows = torch.stack([torch.randn(vocab, generator=gen) * s for s in (9.0, 3.0, 0.3)])
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=seed) for seed in range(20)]

    def tokens(first: int) -> tuple[list[list[int]], list[list[int]]]:
        monkeypatch.setattr(draw_torch, "TOP_P_FIRST", first)
        together, alone = [], []
        for p in params:
            together.append(sampling.sample_batch([Sampler(p, [], vocab) for _ in range(3)], rows))
            alone.append(
                [sampling.sample_batch([Sampler(p, [], vocab)], rows[i : i + 1])[0] for i in range(3)]
            )
        return together, alone

    staged, staged_alone = tokens(64)
    assert staged == staged_alone
    old, _ = tokens(draw_torch.TOP_P_CANDIDATES)
    assert staged == old
    assert tokens(8)[0] == old  # a tiny first stage: every row widens
    assert len({t[0] for t in staged}) > 1 and len({t[2] for t in staged}) > 10  # the rows really sample


def test_a_nan_row_falls_back_to_argmax_without_touching_its_neighbours():
    """A row whose logits hold NaN gets its argmax (NaN ignored); the finite rows beside it draw
    what they draw alone. Broken by: letting NaN reach the inverse CDF (an out-of-range index)."""
    from kvgate.sampling import sample_batch

    good = random_logits(1, VOCAB)
    bad = random_logits(2, VOCAB)
    bad[5] = math.nan
    batch = torch.stack([good, bad, good])
    p = dict(temperature=1.0, top_p=0.9)
    got = sample_batch([Sampler(SamplingParams(seed=s, **p), [], VOCAB) for s in (1, 2, 3)], batch)
    assert got[1] == int(torch.argmax(torch.nan_to_num(bad, nan=-math.inf)))
    assert got[0] == draws(SamplingParams(seed=1, **p), good, 1)[0]
    assert got[2] == draws(SamplingParams(seed=3, **p), good, 1)[0]


def test_top_p_counts_the_mass_of_the_whole_vocabulary_not_just_the_candidates():
    """Three tokens hold 90% of the probability and 4997 share the rest; top_p=0.95 must keep tail
    tokens (the three reach only 0.90 of the full softmax), so ~5% of draws come from the tail.
    Broken by (seen red): renormalizing top-p over the prefiltered candidates, which makes the three
    look like 98% and keeps only them; the threshold path settling a row whose nucleus runs past its
    candidates (`kept < counts` dropped from `_nucleus_tokens`: only the three above 1e-4 drawn). The
    three differ (0.35, 0.3, 0.25): tied, they would send the row to the sorted path anyway."""
    vocab = 5000
    logits = torch.zeros(vocab)
    tail_logit = math.log(0.1 / (vocab - 3))
    logits[:] = tail_logit
    logits[:3] = torch.tensor([0.35, 0.3, 0.25]).log()
    got = draws(SamplingParams(temperature=1.0, top_p=0.95, seed=11), logits, 300)
    assert sum(t >= 3 for t in got) >= 3


# ---- drawn frequencies match the target distribution ------------------------------------------------

CHI2_CRITICAL_P001 = {7: 24.32, 3: 16.27}  # chi-square critical values at p = 0.001 for these df


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True))


@pytest.mark.parametrize("top_k", [0, 4])
def test_drawn_frequencies_match_the_target_distribution_chi_square(top_k):
    """20,000 draws (16 rows with their own seeds, batched) from softmax(logits), plain and top-k=4
    (renormalized over the 4 most likely): the chi-square statistic stays under the p = 0.001 critical
    value (24.3 for 7 degrees of freedom, 16.3 for 3). At these fixed seeds the statistics are 13.4
    (plain) and 2.1 (top-k). Seen red (171.8 and 148.4) with a biased inverse CDF, `u ** 1.1` in place
    of `u` in `_inverse_cdf`."""
    from kvgate.sampling import sample_batch

    probs = torch.tensor([0.3, 0.2, 0.15, 0.11, 0.09, 0.08, 0.05, 0.02])
    logits = probs.log().unsqueeze(0).repeat(16, 1)
    samplers = [Sampler(SamplingParams(temperature=1.0, top_k=top_k, seed=100 + i), [], 8) for i in range(16)]
    counts = [0] * 8
    for _ in range(1250):
        for t in sample_batch(samplers, logits):
            counts[t] += 1
    target = probs.tolist()
    if top_k:
        assert sum(counts[top_k:]) == 0, "top-k drew a token outside the k most likely"
        kept = sum(target[:top_k])
        counts, target = counts[:top_k], [p / kept for p in target[:top_k]]
    stat = chi_square(counts, target)
    assert stat < CHI2_CRITICAL_P001[len(target) - 1], (stat, counts)


# ---- top-p by threshold (_draw_nucleus, _wide_token) draws what the sorted path draws ----------------

TOP_P_MIXES = [
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=1.0, top_p=0.95, min_p=0.05),
    dict(temperature=0.3, top_p=0.5),
    dict(temperature=1.5, top_p=0.99),
]


def lm_like_rows(seed: int, n: int, vocab: int) -> torch.Tensor:
    """Rows from peaked to flat (nuclei of a few to thousands of tokens); every third row on a coarse
    grid, so many tokens share a logit (ties, which the threshold paths must leave to the sorts)."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.tensor([9.0, 5.0, 3.5, 2.5, 1.5, 0.6])[torch.arange(n) % 6].unsqueeze(1)
    x = torch.randn(n, vocab, generator=g) * scales
    x[::3] = (x[::3] * 2).round() / 2
    return x


def top_p_tokens(monkeypatch, fast: bool, mix: dict, logits: list[torch.Tensor], order: list[int]) -> dict:
    """Each row's tokens over the steps of `logits`, batched in `order`; `fast=False`: the code before
    the threshold paths (a top-k over the vocabulary, a full sort for a wide nucleus)."""
    import kvgate.draw_torch as draw_torch
    import kvgate.sampling as sampling

    monkeypatch.setattr(draw_torch, "NUCLEUS_LEVEL", 1e-4 if fast else 0.0)
    monkeypatch.setattr(draw_torch, "WIDE_LEVELS", (1e-5, 1e-6) if fast else ())
    vocab = logits[0].shape[-1]
    samplers = {i: Sampler(SamplingParams(seed=1000 + i, **mix), [], vocab) for i in order}
    out = {i: [] for i in order}
    for x in logits:
        for i, t in zip(order, sampling.sample_batch([samplers[i] for i in order], x, order), strict=True):
            out[i].append(t)
    return out


@pytest.mark.parametrize("mix", TOP_P_MIXES, ids=[str(sorted(m.items())) for m in TOP_P_MIXES])
def test_top_p_by_threshold_draws_the_very_tokens_of_the_sorted_path(draw_path, monkeypatch, mix):
    """Top-p rows without top-k sort only their likeliest tokens (`_draw_nucleus`; `_wide_token` for a
    nucleus past TOP_P_CANDIDATES); rows these cannot settle for certain go to the sorts. 16 rows x 3
    steps at vocab 16384, peaked to flat and with ties, draw exactly the tokens of the code before
    (`fast=False`), and each path really drew rows. Seen red, each alone: the tie checks removed
    (`at != after` in `_draw_nucleus`, `vals[j + 1] != vals[j]` in `_wide_token`: a coarse row draws
    the other token of a tied pair); `_wide_token` drawing without the nucleus cut; `_draw_rows`
    handing the unsettled rows the first rows' uniforms (`u[: len(redo)]` for `u[at]`)."""
    torch_path_only(draw_path)
    import kvgate.draw_torch as draw_torch

    logits = [lm_like_rows(10 * step + 1, 16, 16384) for step in range(3)]
    order = list(range(16))
    before = top_p_tokens(monkeypatch, False, mix, logits, order)
    seen: dict[str, list[bool]] = {"nucleus": [], "wide": []}
    nucleus, wide = draw_torch._draw_nucleus, draw_torch._wide_token

    def spy_nucleus(*a):
        out, norm = nucleus(*a)
        seen["nucleus"] += [t is not None for t in out]
        return out, norm

    def spy_wide(*a):
        t = wide(*a)
        seen["wide"].append(t is not None)
        return t

    monkeypatch.setattr(draw_torch, "_draw_nucleus", spy_nucleus)
    monkeypatch.setattr(draw_torch, "_wide_token", spy_wide)
    assert top_p_tokens(monkeypatch, True, mix, logits, order) == before
    assert 0 < sum(seen["nucleus"]) < len(seen["nucleus"]), seen
    if mix["temperature"] >= 0.7 and mix["top_p"] < 0.99:  # nuclei past 1024 tokens, not most of all
        assert any(seen["wide"]), seen


def test_top_p_by_threshold_gives_a_row_the_same_tokens_alone_or_batched(draw_path, monkeypatch):
    """Each of 12 top-p rows draws the same tokens alone, batched in order and batched reversed (the
    batch is drawn `SAMPLE_ROWS` at a time, so rows meet other neighbours and other sorted rows).
    Seen red: `_draw_rows` handing the unsettled rows the first rows' uniforms (`u[: len(redo)]`
    for `u[at]`)."""
    torch_path_only(draw_path)
    logits = [lm_like_rows(50 + step, 12, 16384) for step in range(3)]
    mix = dict(temperature=1.0, top_p=0.9)
    alone = {i: top_p_tokens(monkeypatch, True, mix, logits, [i])[i] for i in range(12)}
    assert top_p_tokens(monkeypatch, True, mix, logits, list(range(12))) == alone
    assert top_p_tokens(monkeypatch, True, mix, logits, list(reversed(range(12)))) == alone
    assert len({tuple(v) for v in alone.values()}) > 6


def test_a_rows_log_normalizer_has_the_same_bits_alone_and_among_other_rows():
    """The sampler's log-normalizer of a 49,152-wide row (SmolLM2's vocabulary) and of an odd width is
    the same bits for the row alone, among 2, 3, 4 or 64 rows, and on one thread; and within 1e-5 of
    torch.logsumexp. Found by measuring: torch.logsumexp splits one row across threads but not
    several, and differed for 2-4 rows in 64 at 2 threads. Seen red with torch.logsumexp in place of
    row_logsumexp."""
    from kvgate.draw_ops import row_logsumexp

    threads = torch.get_num_threads()
    for width in (49152, 50001):  # seed 1: torch.logsumexp differs alone vs grouped on 4 of these rows
        x = torch.randn(64, width, generator=torch.Generator().manual_seed(1)) * 3
        alone = torch.cat([row_logsumexp(x[i : i + 1]) for i in range(64)])
        for group in (2, 3, 4, 64):
            got = torch.cat([row_logsumexp(x[i : i + group]) for i in range(0, 64, group)])
            assert torch.equal(got, alone), (width, group)
        torch.set_num_threads(1)
        try:
            assert torch.equal(row_logsumexp(x), alone), width
        finally:
            torch.set_num_threads(threads)
        torch.testing.assert_close(alone, torch.logsumexp(x, -1, keepdim=True), atol=1e-5, rtol=0)
