"""The sampler's draw with PyTorch ops (`draw_torch`): the path for logits off the CPU and where
kvgate's C++ kernels did not build (on the CPU, kvgate/models/csrc/draw.cpp draws; `kvgate.sampling`
chooses). The same distribution as the kernel's; for the same uniform a row may pick another token
(this path walks a nucleus in sorted order, the kernel in vocabulary order).

Rows with the same candidate count are drawn together, `SAMPLE_ROWS` at a time; every op is row-wise
and a row's candidate count comes from its own parameters, so a row's token never depends on the
rows beside it. Top-p first looks only at the `TOP_P_FIRST`, then the `TOP_P_CANDIDATES` most likely
tokens, which hold the nucleus whenever their probability sums to p or more; otherwise that row is
sorted in full (same result, slower). A group of top-p rows without top-k first sorts only each row's
tokens above a probability threshold (`_draw_nucleus`, `_wide_token`), which yields the very numbers
of those sorts; a row it cannot settle for certain (ties, a nucleus past the threshold) takes them.
"""

from __future__ import annotations

import math

import torch

from kvgate.draw_ops import inverse_cdf, keep_min_p, keep_nucleus, pick_rows, row_logsumexp
from kvgate.sampling_params import SamplingParams

TOP_P_CANDIDATES = 1024  # top-p looks at the most likely 1024 tokens first; a full sort only if needed
TOP_P_FIRST = 64  # ... and before those at the most likely 64 (topk(64) costs a quarter of topk(1024))
SAMPLE_ROWS = 4  # rows drawn together: bounds the vocab-sized temporaries (the plan's `logits` term)
NUCLEUS_LEVEL = 1e-4  # top-p without top-k: sort only the tokens at least this likely (0: never)
NUCLEUS_MAX = 4096  # ... and at most this many of them; a row that needs more takes the sorted path
WIDE_LEVELS = (1e-5, 1e-6)  # a nucleus wider than TOP_P_CANDIDATES: sort the tokens this likely first


def draw_torch(samplers, vocab: int, row_logits) -> list[int]:
    """Every row's token with PyTorch ops (where the C++ kernels are not built, or off the CPU)."""
    tokens = [0] * len(samplers)
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(samplers):
        if s.greedy:
            tokens[i] = int(torch.argmax(row_logits(i)))
        else:
            groups.setdefault(candidates(s.p, vocab), []).append(i)
    for k, members in groups.items():
        for at in range(0, len(members), SAMPLE_ROWS):
            chunk = members[at : at + SAMPLE_ROWS]
            x = torch.stack([row_logits(i) for i in chunk])
            for i, t in zip(chunk, _draw_rows([samplers[i] for i in chunk], x, k), strict=True):
                tokens[i] = t
    return tokens


def candidates(p: SamplingParams, vocab: int) -> int:
    """How many of the most likely tokens a row draws from, sorted (0: all of them, unsorted)."""
    if 0 < p.top_k < vocab:
        return p.top_k
    if p.top_p < 1.0:
        return min(vocab, TOP_P_CANDIDATES)
    return 0


def _draw_rows(samplers, logits: torch.Tensor, k: int) -> list[int]:
    """Draw one token per row of `logits` (owned: scaled in place)."""
    n, vocab = logits.shape
    temps = torch.tensor([s.p.temperature for s in samplers], dtype=logits.dtype).unsqueeze(1)
    scaled = logits.div_(temps)
    # each row's one uniform from its own generator, in row order, whichever path then uses it
    u = torch.cat([torch.rand(1, generator=s.gen) for s in samplers]).unsqueeze(1)
    if not (k and NUCLEUS_LEVEL) or not all(s.p.top_p < 1.0 and not 0 < s.p.top_k < vocab for s in samplers):
        return _draw_sorted(samplers, scaled, u, k)
    out, norm = _draw_nucleus(samplers, scaled, u, k)
    redo = [i for i, t in enumerate(out) if t is None]
    if redo:  # the rows the threshold could not settle: the sorted path, with the norm of this group
        at = torch.tensor(redo)
        got = _draw_sorted([samplers[i] for i in redo], scaled[at], u[at], k, norm[at])
        for i, t in zip(redo, got, strict=True):
            out[i] = t
    return out


def _draw_nucleus(samplers, scaled: torch.Tensor, u: torch.Tensor, k: int):
    """Top-p rows (no top-k) without a top-k over the vocabulary: sort only the tokens at least
    `NUCLEUS_LEVEL` x as likely as the whole row, then cut and draw them as `_draw_sorted` does. The
    probabilities, their cumulative sums and the pick are the very numbers computed there, since
    every op is row-wise and a sorted row's prefix does not depend on how far the sort went. A row's
    token is kept only when that is certain: a finite norm, a nucleus that ends inside the candidates
    and within `k` (else the sorted path sorts the row in full), and a picked value no other token
    shares (the order of equal values is each sort's own). Returns the tokens (None: not settled) and
    the group's log-normalizer."""
    m = scaled.shape[0]
    norm = row_logsumexp(scaled)  # as _draw_sorted computes it: the same bits
    top_p = torch.tensor([s.p.top_p for s in samplers], dtype=scaled.dtype).unsqueeze(1)
    min_p = torch.tensor([s.p.min_p for s in samplers], dtype=scaled.dtype).unsqueeze(1)
    r, c = (scaled >= norm + math.log(NUCLEUS_LEVEL)).nonzero(as_tuple=True)  # row-major: r ascending
    counts = torch.bincount(r, minlength=m)
    if int(counts.max()) > NUCLEUS_MAX:  # too many to sort cheaply (an all -inf row): left unsettled
        keep = counts[r] <= NUCLEUS_MAX
        r, c, counts = r[keep], c[keep], counts.masked_fill(counts > NUCLEUS_MAX, 0)
    width = max(64, -(-int(counts.max()) // 64) * 64)
    pos = torch.arange(r.numel()) - (torch.cumsum(counts, 0) - counts)[r]
    vals = scaled.new_full((m, width), -math.inf)
    vals[r, pos] = scaled[r, c]
    ids = torch.zeros((m, width), dtype=torch.long)
    ids[r, pos] = c
    vals, order = torch.sort(vals, dim=-1, descending=True)
    ids = ids.gather(1, order)
    probs = torch.exp(vals - norm)
    cum = torch.cumsum(probs, dim=-1)
    kept = ((cum - probs) < top_p).sum(-1)
    pick, ok = pick_rows(keep_min_p(keep_nucleus(probs, cum, top_p), min_p), u)
    at = vals.gather(1, pick.unsqueeze(1)).squeeze(1)
    after = vals.gather(1, (pick + 1).clamp(max=width - 1).unsqueeze(1)).squeeze(1)
    before = vals.gather(1, (pick - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    sure = ok & torch.isfinite(norm).squeeze(1) & (kept < counts) & (kept < k)
    sure &= (at != after) & ((pick == 0) | (at != before))
    tokens = ids.gather(1, pick.unsqueeze(1)).squeeze(1)
    return [t if s else None for t, s in zip(tokens.tolist(), sure.tolist(), strict=True)], norm


def _draw_wide(x: torch.Tensor, s, u: torch.Tensor) -> int:
    """The token of a row whose nucleus is wider than the candidates: the nucleus of its sorted
    softmax (`_wide_token` when it settles the row, else a sort of the whole vocabulary)."""
    probs = torch.softmax(x, -1)
    token = _wide_token(probs, s, u)
    if token is not None:
        return token
    sorted_p, order = torch.sort(probs, descending=True)
    row = keep_nucleus(sorted_p, torch.cumsum(sorted_p, -1), s.p.top_p)
    return inverse_cdf(keep_min_p(row.unsqueeze(0), s.p.min_p), order.unsqueeze(0), x.unsqueeze(0), u)[0]


def _wide_token(probs: torch.Tensor, s, u: torch.Tensor) -> int | None:
    """`_draw_wide`'s token from only the probabilities at least `WIDE_LEVELS[i]`, in turn, when
    that is certain (as in `_draw_nucleus`: the nucleus ends inside them, the picked probability is
    unshared); None when not, or when that is over half the vocabulary."""
    for level in WIDE_LEVELS:
        idx = (probs >= level).nonzero().squeeze(1)
        if idx.numel() > probs.numel() // 2:
            return None
        vals, order = torch.sort(probs[idx], descending=True)
        cum = torch.cumsum(vals, -1)
        if int(((cum - vals) < s.p.top_p).sum()) >= idx.numel():
            continue  # the nucleus may run past these: a lower level
        pick, ok = pick_rows(keep_min_p(keep_nucleus(vals, cum, s.p.top_p).unsqueeze(0), s.p.min_p), u)
        j = int(pick)
        if bool(ok) and vals[j + 1] != vals[j] and (j == 0 or vals[j - 1] != vals[j]):
            return int(idx[order[j]])
        return None
    return None


def _draw_sorted(samplers, scaled: torch.Tensor, u: torch.Tensor, k: int, full=None) -> list[int]:
    """Draw from the `k` most likely tokens of each row of `scaled` (all of them when k is 0), top-k
    via torch.topk; `full`: the rows' log-normalizer when already computed on this group."""
    n, vocab = scaled.shape
    top_k = torch.tensor([0 < s.p.top_k < vocab for s in samplers]).unsqueeze(1)
    if k:
        # top-p rows look at the TOP_P_FIRST most likely tokens first: the nucleus is a prefix of the
        # sorted probabilities, so it is the same whichever candidates hold it (_redraw_wide widens)
        first = TOP_P_FIRST if k > TOP_P_FIRST and not bool(top_k.any()) else k
        vals, ids = torch.topk(scaled, first, dim=-1)
        full = row_logsumexp(scaled) if full is None else full
        # top-k rows renormalize over their k tokens; top-p rows keep the full softmax's mass
        norm = torch.where(top_k, row_logsumexp(vals), full)
        probs = torch.exp(vals - norm)
    else:
        ids = None
        probs = torch.softmax(scaled, dim=-1)
    top_p = torch.tensor([s.p.top_p for s in samplers], dtype=probs.dtype).unsqueeze(1)
    if ids is not None and bool((top_p < 1.0).any()):
        cum = torch.cumsum(probs, dim=-1)
        short = ((cum[:, -1:] < top_p) & ~top_k).squeeze(1)
        probs = keep_nucleus(probs, cum, top_p)
        if bool(short.any()):  # the nucleus is wider than the candidates: widen those rows
            return _redraw_wide(samplers, scaled, short, probs, ids, norm, top_p, k, u)
    min_p = torch.tensor([s.p.min_p for s in samplers], dtype=probs.dtype).unsqueeze(1)
    return inverse_cdf(keep_min_p(probs, min_p), ids, scaled, u)


def _redraw_wide(samplers, scaled, short, probs, ids, norm, top_p, k, u) -> list[int]:
    """Rows whose nucleus exceeds the first candidates: their `k` most likely tokens next, then a full
    sort for a row whose nucleus is wider still; the other rows as drawn. Each row's path depends only
    on its own probabilities, so a row's token never depends on the rows beside it."""
    wide: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    rows = short.nonzero().squeeze(1)
    if k > probs.shape[1]:
        vals, order = torch.topk(scaled[rows], k, dim=-1)
        p = torch.exp(vals - norm[rows])
        cum = torch.cumsum(p, dim=-1)
        held = (cum[:, -1:] >= top_p[rows]).squeeze(1).tolist()
        kept = keep_nucleus(p, cum, top_p[rows])
        wide = {int(i): (kept[j], order[j]) for j, i in enumerate(rows.tolist()) if held[j]}
    out = []
    for i, s in enumerate(samplers):
        if i in wide:
            row, order = wide[i]
        elif bool(short[i]):
            out.append(_draw_wide(scaled[i], s, u[i : i + 1]))
            continue
        else:
            row, order = probs[i], ids[i]
        row = keep_min_p(row.unsqueeze(0), s.p.min_p)
        out += inverse_cdf(row, order.unsqueeze(0), scaled[i : i + 1], u[i : i + 1])
    return out
