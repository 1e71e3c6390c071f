"""Row-wise pieces of a draw, shared by the sampler (`kvgate.sampling`) and the speculative sampler
(`kvgate.core.spec_sample`): each row's result is the same bits whatever other rows share the call."""

from __future__ import annotations

import math

import torch

LSE_CHUNK = 1024  # see row_logsumexp


def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """`torch.logsumexp(x, -1, keepdim=True)` with each row's bits independent of the other rows.
    torch splits a single long row's reduction across threads but gives each of several rows one
    thread, so a row alone and the same row among others differed in the last bit (2 rows in 64 at
    2 threads, SmolLM2's 49,152 vocabulary). Reducing chunks of 1,024 first (never split: below
    torch's grain), then the chunks' results, sums every row in one fixed order. For float32 rows (the
    sampler's): a 16-bit dtype would round the chunks' results before the outer reduction."""
    n, width = x.shape
    pad = -width % LSE_CHUNK
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=-math.inf)
    chunks = torch.logsumexp(x.reshape(n, (width + pad) // LSE_CHUNK, LSE_CHUNK), -1)
    return torch.logsumexp(chunks, -1, keepdim=True)


def keep_nucleus(sorted_probs: torch.Tensor, cum: torch.Tensor, top_p) -> torch.Tensor:
    """Zero all but the smallest prefix of descending probabilities that reaches top_p (>= 1 token)."""
    return sorted_probs.masked_fill((cum - sorted_probs) >= top_p, 0.0)


def keep_min_p(probs: torch.Tensor, min_p) -> torch.Tensor:
    """Zero tokens less likely than min_p x the row's most likely token."""
    return probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)


def pick_rows(probs: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's inverse-CDF index for its uniform `u`, and whether the row's mass is usable."""
    cum = torch.cumsum(probs, dim=-1)
    total = cum[:, -1:]
    pick = torch.searchsorted(cum, u * total, right=True).squeeze(1)
    # u * total can round up to total: take the last token with probability > 0 instead
    last = probs.shape[1] - 1 - torch.argmax(torch.flip(probs > 0, [1]).to(torch.uint8), dim=1)
    return torch.minimum(pick, last), (torch.isfinite(total) & (total > 0)).squeeze(1)


def inverse_cdf(
    probs: torch.Tensor, ids: torch.Tensor | None, scaled: torch.Tensor, u: torch.Tensor
) -> list[int]:
    pick, ok = pick_rows(probs, u)
    if ids is not None:
        pick = ids.gather(1, pick.unsqueeze(1)).squeeze(1)
    out = pick.tolist()
    for i, good in enumerate(ok.tolist()):
        if not good:  # degenerate row (NaN/inf logits): fall back to its argmax
            out[i] = int(torch.argmax(torch.nan_to_num(scaled[i], nan=-math.inf)))
    return out
