"""Speculation for sampled rows: the standard rejection rule, with a draft that is one proposed token.

Prompt lookup proposes tokens, it does not sample them, so the draft distribution at each position
is a point mass on the proposed token `d`. The rule of speculative sampling (Leviathan et al. 2023,
Chen et al. 2023) then reads: keep `d` with probability `p(d)`, where `p` is the distribution the row
would sample from at that position without speculation (`distributions`: its logit bias,
temperature, top-k, top-p and min-p, exactly as `kvgate.sampling.sample_batch` truncates them); on
the first rejection draw a token from `p` with `d` removed and end the span; when every draft is
kept, draw one more token from the distribution after the last. Each emitted token is therefore
distributed exactly as plain sampling would have it given the tokens before it.

The draws come from the row's own generator, so a seeded request repeats itself and batching does
not change it; they are not the draws a non-speculating run makes (the same distribution, other
tokens), as with vLLM's speculative decoding.
"""

from __future__ import annotations

import math

import torch

from kvgate.draw_ops import keep_min_p, keep_nucleus, row_logsumexp
from kvgate.draw_torch import candidates
from kvgate.sampling import Sampler, draw_kernel, draw_params


def distributions(sampler: Sampler, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The probabilities `sampler` draws its token from at each of `logits[rows]`: float32
    `[len(rows), vocab]`, each row summing to 1 (a row with non-finite logits: its argmax, as the
    sampler's fallback). For rows without penalties, grammar or logprobs (`speculate.eligible`)."""
    p = sampler.p
    x = torch.stack([sampler.process(logits[r]) if sampler.processed else logits[r] for r in rows])
    ext = draw_kernel(x)
    if ext is not None:  # the C++ draw's own kept set and weights: the very distribution it draws from
        n, vocab = x.shape
        params = draw_params([sampler] * n, vocab)
        return ext.draw_probs(x.contiguous(), torch.arange(n), *params, 1)  # one thread's scratch
    scaled = x.float() / p.temperature
    n, vocab = scaled.shape
    k = candidates(p, vocab)
    top_k = 0 < p.top_k < vocab
    if k:
        vals, ids = torch.topk(scaled, k, dim=-1)
        norm = row_logsumexp(vals if top_k else scaled)
        probs = torch.exp(vals - norm)
        if p.top_p < 1.0:
            cum = torch.cumsum(probs, dim=-1)
            short = (cum[:, -1] < p.top_p).tolist() if not top_k else [False] * n
            probs = keep_nucleus(probs, cum, p.top_p)
        else:
            short = [False] * n
        dense = torch.zeros_like(scaled).scatter_(1, ids, probs)
        for i in (i for i, s in enumerate(short) if s):  # the nucleus is wider than the candidates
            sorted_p, order = torch.sort(torch.softmax(scaled[i], -1), descending=True)
            kept = keep_nucleus(sorted_p, torch.cumsum(sorted_p, -1), p.top_p)
            dense[i] = torch.zeros(vocab).scatter_(0, order, kept)
    else:
        dense = torch.softmax(scaled, dim=-1)
    dense = keep_min_p(dense, p.min_p)
    total = dense.sum(-1, keepdim=True)
    for i, good in enumerate((torch.isfinite(total) & (total > 0)).squeeze(1).tolist()):
        if not good:
            dense[i] = 0.0
            dense[i, int(torch.argmax(torch.nan_to_num(scaled[i], nan=-math.inf)))] = 1.0
            total[i] = 1.0
    return dense / total


def accept_sampled(drafts: list[int], probs: torch.Tensor, gen: torch.Generator) -> list[int]:
    """The tokens a verify pass yields for a sampled row: `probs[i]` is the row's distribution after
    its last token and `drafts[:i]` (`len(drafts) + 1` rows). 1 to len(drafts) + 1 tokens."""
    out: list[int] = []
    for i, d in enumerate(drafts):
        p = probs[i]
        if float(torch.rand(1, generator=gen)) < float(p[d]):
            out.append(d)
            continue
        residual = p.clone()
        residual[d] = 0.0
        # a draft of probability 1 that rounding left just below it: nothing else is possible
        out.append(_draw(residual, gen) if float(residual.sum()) > 0 else d)
        return out
    out.append(_draw(probs[len(drafts)], gen))
    return out


def _draw(p: torch.Tensor, gen: torch.Generator) -> int:
    """One token from the unnormalized probabilities `p` by inverse CDF (never one of mass 0)."""
    cum = torch.cumsum(p, 0)
    u = torch.rand(1, generator=gen) * cum[-1]
    pick = int(torch.searchsorted(cum, u, right=True))
    last = int(torch.nonzero(p > 0)[-1])  # u * total can round up to the total
    return min(pick, last)
