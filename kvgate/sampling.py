"""Per-request sampling: validated parameters and a sampler that owns its random generator.

A request's tokens depend only on its own logits and its own `torch.Generator`, never on which other
requests share the step: that is half of "batching does not change output" (the model's row-wise
math is the other half).

The logits a row samples from are, in order: the model's, plus its `logit_bias`, with its repetition /
presence / frequency penalties, with its grammar's mask (-inf on the tokens the grammar forbids; the
masks of all grammar rows are computed in one batched call, and a row without a grammar pays
nothing). Log-probabilities, for the rows that ask, are the log-softmax of exactly those logits:
after bias, penalties and mask, before temperature, top-k, top-p and min-p (vLLM's "processed"
logprobs less its temperature), so they describe the distribution the sampler truncated and scaled.
"""

from __future__ import annotations

import math
import os

import torch

from kvgate.draw_ops import inverse_cdf, keep_min_p, keep_nucleus, pick_rows, row_logsumexp
from kvgate.sampling_params import (  # noqa: F401 (re-exported: kvgate.sampling is where callers look)
    GREEDY_BELOW,
    LOGIT_BIAS_LIMIT,
    MAX_TOP_LOGPROBS,
    SamplingError,
    SamplingParams,
    TokenLogprobs,
)
from kvgate.structured import masks


class Sampler:
    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int):
        self.p = params
        # Below 1e-5 a temperature only overflows logits / T to inf (NaN after softmax); it means greedy.
        self.greedy = params.temperature < GREEDY_BELOW
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.gen = torch.Generator().manual_seed(seed % 2**64)
        self.vocab_size = vocab_size
        self.penalized = (
            params.repetition_penalty != 1.0
            or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
        )
        self.bias = _bias_tensors(params.logit_bias)
        # the row's own grammar state (a copy of the shared compiled grammar), advanced only here
        self.matcher = params.grammar.matcher() if params.grammar is not None else None
        self.grammar_error: str | None = None
        self.last_logprobs: TokenLogprobs | None = None
        self._prompt_ids = list(prompt_ids) if self.penalized else []
        self.seen: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None

    def _init_penalty_state(self, n: int) -> None:
        # Sized by the logits, not the tokenizer: a model may have more rows than tokens (padding).
        self.seen = torch.zeros(n, dtype=torch.bool)
        ids = [t for t in self._prompt_ids if 0 <= t < n]
        if ids:
            self.seen[torch.tensor(ids)] = True
        self.counts = torch.zeros(n, dtype=torch.float32)

    def penalize(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` with this request's repetition/presence/frequency penalties applied (a copy)."""
        p = self.p
        if self.seen is None:
            self._init_penalty_state(logits.shape[-1])
        logits = logits.clone()
        if p.repetition_penalty != 1.0:
            sel = logits[self.seen]
            logits[self.seen] = torch.where(sel > 0, sel / p.repetition_penalty, sel * p.repetition_penalty)
        if p.frequency_penalty or p.presence_penalty:
            logits -= self.counts * p.frequency_penalty + (self.counts > 0).float() * p.presence_penalty
        return logits

    @property
    def processed(self) -> bool:
        """Whether this row's logits change before sampling (bias or penalties; masks aside)."""
        return self.penalized or self.bias is not None

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` with the bias and penalties applied (a copy), or `logits` itself."""
        if self.penalized:
            logits = self.penalize(logits)
        if self.bias is not None:
            ids, values = self.bias
            ok = ids < logits.shape[-1]
            logits = logits.clone() if not self.penalized else logits
            logits[ids[ok]] += values[ok]
        return logits

    @property
    def grammar_done(self) -> bool:
        """The grammar accepted its end: nothing more may be generated."""
        m = self.matcher
        return m is not None and self.grammar_error is None and not m.is_error() and m.is_stopped()

    def record(self, token: int) -> None:
        """Remember a generated token for the penalties and advance the grammar (never raises: a token
        the grammar refuses marks the row, whose next draw then fails)."""
        if self.penalized:
            self.seen[token] = True
            self.counts[token] += 1
        if self.matcher is not None and self.grammar_error is None and not self.matcher.consume_token(token):
            self.grammar_error = self.matcher.get_error() or f"token {token} is not allowed by the grammar"

    def sample(self, logits: torch.Tensor) -> int:
        """`logits`: float32 `[vocab]` (may be a view into the batch's logits; it is not modified)."""
        return sample_batch([self], logits.unsqueeze(0))[0]


TOP_P_CANDIDATES = 1024  # top-p looks at the most likely 1024 tokens first; a full sort only if needed
TOP_P_FIRST = 64  # ... and before those at the most likely 64 (topk(64) costs a quarter of topk(1024))
SAMPLE_ROWS = 4  # rows drawn together: bounds the vocab-sized temporaries (the plan's `logits` term)
NUCLEUS_LEVEL = 1e-4  # top-p without top-k: sort only the tokens at least this likely (0: never)
NUCLEUS_MAX = 4096  # ... and at most this many of them; a row that needs more takes the sorted path
WIDE_LEVELS = (1e-5, 1e-6)  # a nucleus wider than TOP_P_CANDIDATES: sort the tokens this likely first


def sample_batch(samplers: list[Sampler], logits: torch.Tensor, rows: list[int] | None = None) -> list[int]:
    """One token per sampler; sampler i reads float32 `logits[rows[i]]` (`rows` default: 0, 1, ...).

    Rows with the same candidate count are drawn together, `SAMPLE_ROWS` at a time, but each row's
    result depends only on its own logits, parameters and generator: every operation is row-wise,
    and a row's candidate count comes from its own parameters. The draw is an inverse-CDF lookup of
    one uniform number from the row's own generator. A row with non-finite or all-zero
    probabilities falls back to its argmax. `logits` is never modified.

    Top-p keeps the smallest prefix of the sorted probabilities that reaches p (at least one token),
    then min-p drops tokens below min_p x the top probability. Top-k keeps exactly k tokens. Top-p
    first looks only at the `TOP_P_FIRST`, then the `TOP_P_CANDIDATES` most likely tokens, which hold
    the nucleus whenever their probability sums to p or more; otherwise that row is sorted in full
    (same result, slower). A group of top-p rows without top-k first sorts only each row's tokens
    above a probability threshold (`_draw_nucleus`, `_wide_token`), which yields the very numbers of
    those sorts; a row it cannot settle for certain (ties, a nucleus past the threshold) takes them.
    """
    rows = list(range(len(samplers))) if rows is None else rows
    vocab = logits.shape[-1]
    bitmasks = _grammar_masks(samplers)

    def row_logits(i: int) -> torch.Tensor:
        s = samplers[i]
        x = s.process(logits[rows[i]]) if s.processed else logits[rows[i]]
        m = bitmasks.get(i)
        if m is not None:
            x = x.clone() if not s.processed else x
            masks.apply_bitmask(x.unsqueeze(0), m.unsqueeze(0))
        return x

    tokens = [0] * len(samplers)
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(samplers):
        if s.greedy:
            tokens[i] = int(torch.argmax(row_logits(i)))
        else:
            groups.setdefault(_candidates(s.p, vocab), []).append(i)
    for k, members in groups.items():
        for at in range(0, len(members), SAMPLE_ROWS):
            chunk = members[at : at + SAMPLE_ROWS]
            x = torch.stack([row_logits(i) for i in chunk])
            for i, t in zip(chunk, _draw_rows([samplers[i] for i in chunk], x, k), strict=True):
                tokens[i] = t
    for i, m in bitmasks.items():  # checked before any row's state moves: a failure redoes the batch
        if not masks.allows(m, tokens[i]):
            raise ValueError(f"the grammar allows no token here (drew {tokens[i]}); the output cannot go on")
    for i, s in enumerate(samplers):
        k = s.p.logprobs
        s.last_logprobs = None if k is None else token_logprobs(row_logits(i), tokens[i], k)
    for s, t in zip(samplers, tokens, strict=True):
        s.record(t)
    return tokens


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """The chosen token's log-probability under `logits` and the `k` most likely tokens' (finite ones)."""
    lp = torch.log_softmax(logits.float(), -1)
    top: list[tuple[int, float]] = []
    if k:
        vals, ids = torch.topk(lp, min(k, lp.shape[-1]))
        top = [(i, v) for i, v in zip(ids.tolist(), vals.tolist(), strict=True) if math.isfinite(v)]
    return TokenLogprobs(token, float(lp[token]), top)


_executor = None


def _grammar_masks(samplers: list[Sampler]) -> dict[int, torch.Tensor]:
    """The packed masks of the grammar rows, by sampler index: one batched fill per compiler."""
    global _executor
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(samplers):
        if s.matcher is not None:
            if s.grammar_error is not None:
                raise ValueError(f"grammar: {s.grammar_error}")
            groups.setdefault(id(s.p.grammar.compiler), []).append(i)
    out: dict[int, torch.Tensor] = {}
    for members in groups.values():
        if _executor is None:
            _executor = masks.new_executor()
        vocab = samplers[members[0]].p.grammar.compiler.vocab
        filled = masks.fill_bitmasks([samplers[i].matcher for i in members], vocab, _executor)
        for j, i in enumerate(members):
            if samplers[i].matcher.is_error():
                raise ValueError(f"grammar: {samplers[i].matcher.get_error()}")
            out[i] = filled[j]
    return out


def _bias_tensors(bias: dict[int, float] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    if not bias:
        return None
    ids = torch.tensor(list(bias), dtype=torch.long)
    return ids, torch.tensor(list(bias.values()), dtype=torch.float32)


def _candidates(p: SamplingParams, vocab: int) -> int:
    """How many of the most likely tokens a row draws from, sorted (0: all of them, unsorted)."""
    if 0 < p.top_k < vocab:
        return p.top_k
    if p.top_p < 1.0:
        return min(vocab, TOP_P_CANDIDATES)
    return 0


def _draw_rows(samplers: list[Sampler], logits: torch.Tensor, k: int) -> list[int]:
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


def _draw_wide(x: torch.Tensor, s: Sampler, u: torch.Tensor) -> int:
    """The token of a row whose nucleus is wider than the candidates: the nucleus of its sorted
    softmax (`_wide_token` when it settles the row, else a sort of the whole vocabulary)."""
    probs = torch.softmax(x, -1)
    token = _wide_token(probs, s, u)
    if token is not None:
        return token
    sorted_p, order = torch.sort(probs, descending=True)
    row = keep_nucleus(sorted_p, torch.cumsum(sorted_p, -1), s.p.top_p)
    return inverse_cdf(keep_min_p(row.unsqueeze(0), s.p.min_p), order.unsqueeze(0), x.unsqueeze(0), u)[0]


def _wide_token(probs: torch.Tensor, s: Sampler, u: torch.Tensor) -> int | None:
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
