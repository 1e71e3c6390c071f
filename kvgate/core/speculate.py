"""Speculative decoding by prompt lookup (n-gram): draft tokens from the row's own history.

No draft model: the last 1-3 tokens of a row (prompt and output so far) are looked up among its
earlier tokens, and the tokens that followed their most recent earlier occurrence are proposed. The
scheduler sends the row's last token plus the drafts as one span, each position of which runs as a
decode row of its own; the model verifies them in one pass, and the updater keeps the drafts the
model itself would have chosen plus one more token (the model's own choice at the first mismatch, or
after the last draft); a sampled row, by the rejection rule. Only the number of steps changes.

How exact: as exact as batching. A verified position gets the decode path's computation, but in a
call with more rows: the CPU attention (with 2 threads and 3-4 KV heads) and `F.linear` (weights
that are not prepacked: bf16/fp16, an unpacked head) round a row's result differently, by ~1e-6,
with the number of rows beside it, exactly as when requests are batched. Every request measured
gave the plain tokens (bench/speculate.py in fp32 and int4, the tests); a logit tie made exact on
purpose (a tuned `logit_bias`) was shown to flip.
Where decode attention runs the paged kernel (`--decode-attention`, kvgate.models.paged_attention)
and every matmul is row-invariant (prepacked float32, `--weights gguf`, the Q8 head), a verified
position gets the very bits of a plain decode step: there, speculation and batching are exact.

Which rows: those without penalties, grammar or logprobs (`eligible`), whose next token depends
only on the logits at its position, so several positions can be verified at once. Greedy rows keep
the drafts the model itself would choose (`accept`), so their output is the plain greedy output.
Sampled rows follow the standard rejection rule (`kvgate.core.spec_sample`): their tokens have the
distribution of plain sampling, drawn from the row's own generator (a seeded request repeats
itself, but not the tokens of a run without `--speculate`). How many drafts a row gets depends
only on its own tokens and limits (never on its neighbours: the step's token budget reserves
`speculate` extra tokens for every row, in the plan), so batching does not change what a request
generates. Drafts never reach past the row's reserved KV: a row with `m` tokens still allowed gets
at most `m - 1` drafts.

When a row drafts (`DraftGate`): a verify span that keeps nothing costs more than the step it
replaces, so a row whose recent drafts are mostly rejected stops drafting for a while, the pause
doubling while its probes keep failing. The gate sees only the row's own verifies and its own
token count, so whether a row drafts, like how many drafts it gets, never depends on its neighbours
or on timing; it only chooses whether to draft, which never changes a greedy row's tokens.
"""

from __future__ import annotations

from kvgate.sampling import Sampler

NGRAM_MAX = 3  # the longest suffix looked up; shorter ones are tried when it has no earlier occurrence
MAX_SPECULATE = 8  # --speculate's ceiling: a verify span must stay shorter than the smallest prefill chunk
# DraftGate (bench/speculate.py measured them; docs/DESIGN_NOTES.md): a row pauses drafting when the
# moving average of its kept/drafted ratio falls below KEEP_MIN (a 4-draft span costs ~1.8 decode
# steps here, so it pays from ~0.8 kept drafts, i.e. ~20% of 4), for PAUSE_MIN tokens, doubled on
# every probe that fails again, up to PAUSE_MAX. PAUSE_MIN 4, not 8: a rewrite's preamble rejects
# drafts before the copying starts, and a first pause of 8 cost greedy input-grounded text 13% more
# steps (103 against 91; 4: 95).
KEEP_MIN = 0.2
KEEP_WEIGHT = 0.3  # the weight of the latest verify in the moving average
PAUSE_MIN = 4
PAUSE_MAX = 128


def eligible(sampler: Sampler) -> bool:
    """Rows whose token depends only on their logits: no penalties, grammar, logprobs, min_tokens or
    bad_words (whose ban depends on the tokens before)."""
    s = sampler
    return (
        not s.penalized
        and s.matcher is None
        and s.p.logprobs is None
        and not s.min_tokens
        and s.bad_words is None
    )


class NgramIndex:
    """The most recent end position of every 1..NGRAM_MAX-gram in a growing token list, kept up to
    date incrementally (a row's history is indexed once, then one position per generated token)."""

    __slots__ = ("last", "upto")

    def __init__(self) -> None:
        self.last: dict[tuple[int, ...], int] = {}
        self.upto = 0  # grams ending before this position are indexed

    def _sync(self, tokens: list[int]) -> None:
        # index grams ending at every position but the last: a lookup of the current suffix must
        # find an *earlier* occurrence
        for end in range(self.upto, len(tokens) - 1):
            for n in range(1, min(NGRAM_MAX, end + 1) + 1):
                self.last[tuple(tokens[end - n + 1 : end + 1])] = end
        self.upto = max(self.upto, len(tokens) - 1)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix
        (NGRAM_MAX tokens down to 1) that occurred before; [] when none did."""
        if k <= 0 or len(tokens) < 2:
            return []
        self._sync(tokens)
        for n in range(min(NGRAM_MAX, len(tokens) - 1), 0, -1):
            end = self.last.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end + 1 : end + 1 + k]
        return []


class DraftGate:
    """Whether a row drafts at its next step, from its own verifies only (deterministic per row).

    `rate` is an exponentially weighted average of kept/drafted over the row's verify spans, starting
    optimistic (1.0). When it falls below KEEP_MIN the row stops drafting for `pause` tokens
    (PAUSE_MIN, doubling on each consecutive pause up to PAUSE_MAX); the first span after a pause is a
    probe judged from a neutral rate (KEEP_MIN): one that keeps enough resumes drafting and resets the
    pause, one that does not pauses again, twice as long."""

    __slots__ = ("pause", "rate", "resume_at")

    def __init__(self) -> None:
        self.rate = 1.0
        self.pause = 0  # the length of the last pause; 0 once drafts are kept again
        self.resume_at = 0  # the row drafts again once it holds this many tokens

    def open(self, n_tokens: int) -> bool:
        return n_tokens >= self.resume_at

    def observe(self, drafted: int, kept: int, n_tokens: int) -> None:
        """A verify span of the row kept `kept` of its `drafted` drafts; it now holds `n_tokens`."""
        if drafted <= 0:
            return
        if self.pause and self.rate < KEEP_MIN:  # the probe after a pause starts from neutral
            self.rate = KEEP_MIN
        self.rate += KEEP_WEIGHT * (kept / drafted - self.rate)
        if self.rate >= KEEP_MIN:
            self.pause = self.resume_at = 0
            return
        self.pause = min(PAUSE_MAX, 2 * self.pause) if self.pause else PAUSE_MIN
        self.resume_at = n_tokens + self.pause


def accept(drafts: list[int], chosen: list[int]) -> list[int]:
    """The tokens a verify pass yields: `chosen[i]` is the model's token after the row's last token
    and `drafts[:i]`. Drafts are kept while they equal the model's choice; then the model's own
    choice at the first mismatch (or after the last draft) is added: 1 to len(drafts) + 1 tokens."""
    out: list[int] = []
    for i, token in enumerate(chosen):
        out.append(token)
        if i == len(drafts) or token != drafts[i]:
            break
    return out
