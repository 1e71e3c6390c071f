"""kvgate's C++ draw (kvgate/models/csrc/draw.cpp), the sampler on the CPU: it keeps the tokens the
PyTorch path keeps, with their probabilities; equal probabilities go to the lower token id; a row's
token depends on its own logits, parameters and uniform only; greedy rows get torch.argmax; draws
follow the kept distribution. (tests/test_sampling.py runs every sampler behaviour on both paths.)"""

from __future__ import annotations

import math

import pytest
import torch

from kvgate.models import native
from kvgate.sampling import Sampler, SamplingParams

pytestmark = pytest.mark.skipif(
    native.extension() is None, reason=f"kvgate's C++ kernels did not build: {native.unavailable()}"
)

MIXES = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=1.0, top_p=0.95, min_p=0.05),
    dict(temperature=1.5, top_p=0.99),
    dict(temperature=0.8, top_k=40),
    dict(temperature=0.9, top_p=0.5, top_k=300, min_p=0.02),
    dict(temperature=1.2, min_p=0.05),
]


def ext():
    return native.extension()


def args(mixes: list[dict], vocab: int) -> tuple[torch.Tensor, ...]:
    """draw_tokens' per-row parameters for SamplingParams(**mix) of each row."""
    from kvgate.sampling import draw_params

    return draw_params([Sampler(SamplingParams(**m), [], vocab) for m in mixes], vocab)


def peaked_to_flat(seed: int, n: int, vocab: int) -> torch.Tensor:
    """Rows from peaked to flat: nuclei of one token to most of the vocabulary (no ties)."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.tensor([9.0, 5.0, 3.5, 2.5, 1.5, 0.6, 0.2])[torch.arange(n) % 7].unsqueeze(1)
    return torch.randn(n, vocab, generator=g) * scales


@pytest.mark.parametrize("mix", MIXES, ids=[str(sorted(m.items())) for m in MIXES])
def test_the_kernel_keeps_the_tokens_and_probabilities_of_the_pytorch_path(monkeypatch, mix):
    """14 rows from peaked to flat at vocab 16,384 (nuclei of 1 to ~16,000 tokens): draw_probs keeps
    exactly the tokens the PyTorch path's distribution keeps (kvgate.core.spec_sample.distributions
    with the kernel off), with probabilities within 1e-6. (The reference sums in float32, so on other
    rows it can move a nucleus boundary by one token; the kernel sums in double. These rows have none.) Seen red, each alone: the bucket search not
    subtracting the mass above the bucket it descends into (`target -= cum`); the top-p levels
    stopping at the first (1e-4) whether or not its tokens hold p; top-p over the top-k's mass taken
    over the whole vocabulary."""
    import kvgate.sampling as sampling
    from kvgate.core.spec_sample import distributions

    vocab = 16384
    x = peaked_to_flat(3, 14, vocab)
    got = ext().draw_probs(x, torch.arange(14), *args([mix] * 14, vocab), 4)
    monkeypatch.setattr(sampling, "NATIVE_DRAW", False)
    want = distributions(Sampler(SamplingParams(**mix), [], vocab), x, list(range(14)))
    assert torch.equal(got > 0, want > 0), [
        (int((got[i] > 0).sum()), int((want[i] > 0).sum())) for i in range(14)
    ]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    if "top_p" in mix and "top_k" not in mix:  # the rows really span small and wide nuclei
        sizes = (got > 0).sum(1)
        assert int(sizes.min()) < 100 and int(sizes.max()) > 1000, sizes


def test_equal_probabilities_go_to_the_lower_token_id():
    """Where the cut falls among equal probabilities, the lower ids are kept: 8 equal logits with
    top_p 0.5 keep tokens 0-3 and with top_k 3 tokens 0-2; 19,990 equal small logits after 10 large
    ones at the end of a 20,000 vocabulary (the bucket search down to one value) keep the 10 and the
    lowest ids of the small ones, as many as reach p. Seen red with ties ordered by the higher id."""
    flat = torch.zeros(1, 8)
    keep = ext().draw_probs(
        flat, torch.zeros(1, dtype=torch.int64), *args([dict(temperature=1.0, top_p=0.5)], 8), 1
    )
    assert (keep[0] > 0).nonzero().squeeze(1).tolist() == [0, 1, 2, 3]
    keep = ext().draw_probs(
        flat, torch.zeros(1, dtype=torch.int64), *args([dict(temperature=1.0, top_k=3)], 8), 1
    )
    assert (keep[0] > 0).nonzero().squeeze(1).tolist() == [0, 1, 2]
    vocab = 20000
    x = torch.zeros(1, vocab)
    x[0, -10:] = math.log(100.0)  # w = 1 for the large ones, ~0.01 for the small
    p = dict(temperature=1.0, top_p=0.5)
    kept = (
        (ext().draw_probs(x, torch.zeros(1, dtype=torch.int64), *args([p], vocab), 1)[0] > 0)
        .nonzero()
        .squeeze(1)
    )
    small = kept[kept < vocab - 10]
    assert kept[-10:].tolist() == list(range(vocab - 10, vocab))
    assert small.tolist() == list(range(len(small)))  # a prefix of the tied ids
    # 10 + n x 0.01 reaches half of 10 + 19,990 x 0.01
    assert abs(len(small) - (0.5 * (10 + 19990 * 0.01) - 10) / 0.01) <= 2


def test_a_rows_token_is_the_same_alone_in_any_batch_and_on_one_thread():
    """14 rows of mixed parameters (greedy among them) at SmolLM2's vocabulary: each row's token is
    the same drawn alone, in the batch, in the batch reversed, at 1, 2 and 4 rows a thread, and on one
    torch thread. Seen red with every row reading the first row's uniform."""
    vocab = 49152
    mixes = (MIXES * 2)[:13] + [dict(temperature=0.0)]
    x = peaked_to_flat(9, 14, vocab)
    u = torch.rand(14, generator=torch.Generator().manual_seed(2))
    p = args(mixes, vocab)
    alone = [
        int(
            ext().draw_tokens(
                x[i : i + 1], torch.zeros(1, dtype=torch.int64), *(t[i : i + 1] for t in p), u[i : i + 1], 1
            )
        )
        for i in range(14)
    ]
    for threads in (1, 2, 4):
        assert ext().draw_tokens(x, torch.arange(14), *p, u, threads).tolist() == alone
    rev = torch.arange(13, -1, -1)
    assert ext().draw_tokens(x, rev, *(t[rev] for t in p), u[rev], 4).tolist() == alone[::-1]
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert ext().draw_tokens(x, torch.arange(14), *p, u, 4).tolist() == alone
    finally:
        torch.set_num_threads(n)
    assert len(set(alone)) > 7


def test_greedy_rows_get_torch_argmax_and_degenerate_rows_their_finite_argmax():
    """Temperature 0: torch.argmax of the row (the first of equal values; a NaN wins, as in torch).
    A sampled row with NaN, +inf or only -inf: the argmax with NaN read as -inf, as the PyTorch path
    falls back. Seen red with the greedy loop skipping NaN."""
    x = torch.tensor(
        [
            [0.0, 3.0, 3.0, 1.0],
            [0.0, math.nan, 5.0, 1.0],
            [-math.inf, -math.inf, -math.inf, -math.inf],
            [0.0, math.inf, 2.0, math.inf],
        ]
    )
    rows = torch.arange(4)
    greedy = ext().draw_tokens(x, rows, *args([dict(temperature=0.0)] * 4, 4), torch.zeros(4), 2).tolist()
    assert greedy == [int(torch.argmax(r)) for r in x]
    bad = x[1:]  # row 0 is an ordinary row: sampled, it draws token 1 or 2
    p = args([dict(temperature=1.0, top_p=0.9)] * 3, 4)
    sampled = ext().draw_tokens(bad, rows[:3], *p, torch.rand(3), 2)
    assert sampled.tolist() == [int(torch.argmax(torch.nan_to_num(r, nan=-math.inf))) for r in bad]


CHI2_CRITICAL_P001 = {3: 16.27, 4: 18.47, 5: 20.52}  # chi-square critical values at p = 0.001 for these df


@pytest.mark.parametrize("mix", [dict(top_p=0.7), dict(top_p=0.95, min_p=0.2), dict(top_k=5, top_p=0.9)])
def test_draws_follow_the_kept_distribution_chi_square(mix):
    """20,000 draws with uniforms from one generator: the counts match the nucleus of
    [0.3, 0.2, 0.15, 0.11, 0.09, 0.08, 0.05, 0.02] (top-p 0.7: the first 4; top-p 0.95 and min-p 0.2:
    7 by top-p, then 6, as 0.05 < 0.2 x 0.3 <= 0.08; top-k 5 and then top-p 0.9 of its 0.85: the first 5),
    renormalized, under the p = 0.001 chi-square critical value. Seen red with the walk's target
    u ** 1.1 x sum instead of u x sum."""
    probs = torch.tensor([0.3, 0.2, 0.15, 0.11, 0.09, 0.08, 0.05, 0.02])
    n = 20000
    x = probs.log().unsqueeze(0)
    p = args([dict(temperature=1.0, **mix)], 8)
    u = torch.rand(n, generator=torch.Generator().manual_seed(4))
    got = ext().draw_tokens(x, torch.zeros(n, dtype=torch.int64), *(t.expand(n) for t in p), u, 2)
    kept = {0.7: 4, 0.95: 6, 0.9: 5}[mix["top_p"]]
    counts = torch.bincount(got, minlength=8).tolist()
    assert sum(counts[kept:]) == 0, counts
    target = probs[:kept] / probs[:kept].sum()
    stat = sum((c - n * float(q)) ** 2 / (n * float(q)) for c, q in zip(counts[:kept], target, strict=True))
    assert stat < CHI2_CRITICAL_P001[kept - 1], (stat, counts)


def test_the_sampler_never_builds_the_kernels_inside_a_step(monkeypatch, tmp_path):
    """With no build in this process and none in the cache (a CUDA server whose model never needed
    the CPU kernels), sample_batch draws with PyTorch instead of compiling for minutes inside a step;
    with a build in the cache it loads and uses it. Seen red with draw_kernel calling
    native.extension() (it compiled)."""
    import kvgate.sampling as sampling

    built = native.extension()
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("KVGATE_EXT_DIR", str(tmp_path))

    def no_build():
        raise AssertionError("the sampler started a build")

    monkeypatch.setattr(native, "extension", no_build)
    assert sampling.draw_kernel(torch.zeros(1, 4)) is None
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.9, seed=1), [], 4)
    assert 0 <= s.sample(torch.tensor([0.1, 0.2, 0.3, 0.4])) < 4
    monkeypatch.setattr(native, "_state", {"module": built})  # loaded in this process: used
    assert sampling.draw_kernel(torch.zeros(1, 4)) is built


def test_a_top_p_that_rounds_to_zero_keeps_the_one_likeliest_token():
    """top_p = 1e-46 passes validation (0 < top_p) but is 0 in float32: the nucleus is the likeliest
    token alone, as on the PyTorch path, even when the row's values are so close that the top bucket
    of the search is empty. Found by review; seen red before the kernel handled a target of 0 (all 100
    tokens kept)."""
    x = -0.001 * torch.rand(1, 100, generator=torch.Generator().manual_seed(0))
    kept = ext().draw_probs(
        x, torch.zeros(1, dtype=torch.int64), *args([dict(temperature=1.0, top_p=1e-46)], 100), 1
    )
    assert (kept[0] > 0).nonzero().squeeze(1).tolist() == [int(torch.argmax(x[0]))]
