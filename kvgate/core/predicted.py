"""Predicted outputs (OpenAI's `prediction`): draft tokens read off a text the client expects back.

A client that edits a file sends the file as its prediction: most of the answer repeats it. With
`--speculate K`, a row that has a prediction drafts from it first, and from its own history
(`kvgate.core.speculate.NgramIndex`) only when the prediction has nothing to offer. Drafts are
verified like any others, so a prediction changes how many steps a request takes, never its tokens.

How drafts are read (`PredictionDrafts.propose`): a cursor marks where in the prediction the output
is. While the output keeps matching the prediction from the cursor, the next K prediction tokens
are the drafts. When the output departs from it (an edit), the cursor re-syncs on the output's last
1..NGRAM_MAX tokens: at their first occurrence at or after the cursor (edits move forward through a
file), else at their first one from the start; the longest suffix that occurs wins. Nothing found: no
drafts from the prediction this step.

What a response reports (`usage.completion_tokens_details`): `accepted_prediction_tokens`, drafts
from the prediction that the model's own choice confirmed, and `rejected_prediction_tokens`, those
it verified and discarded. OpenAI counts the second as prediction tokens absent from the answer;
here it is the verification work spent on them. Both are 0 where the row does not speculate
(`--speculate 0`, or penalties, grammar or logprobs, as `speculate.eligible` says).
"""

from __future__ import annotations

from kvgate.core.speculate import NGRAM_MAX

# the candidate positions one re-sync may try, per suffix length: a bound on the step's Python work
# (a common last token, like a newline, occurs all over a long prediction)
RESYNC_CHECKS = 256


class PredictionDrafts:
    """Keeps no index, only the prediction's token list (shared with the request): a re-sync scans
    it with `list.index`, at most RESYNC_CHECKS candidates per suffix length, so its memory is the
    list's (`kvgate.memory.workspace.PREDICTION_BYTES_PER_POSITION`) and its time is bounded."""

    __slots__ = ("accepted", "at", "cursor", "pending", "tokens", "rejected")

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.cursor = 0  # the prediction token the output's next token is expected to match
        self.at = 0  # the output tokens accounted for by the cursor
        self.pending = 0  # drafts of the row's current verify span that came from here
        self.accepted = 0
        self.rejected = 0

    def propose(self, output: list[int], k: int) -> list[int]:
        """Up to `k` drafts for the row whose generated tokens are `output`; [] when the prediction
        offers none. Its drafts are `pending` until the verify's `observe`."""
        self.pending = 0
        if k <= 0:
            return []
        toks = self.tokens
        while self.at < len(output) and self.cursor < len(toks) and output[self.at] == toks[self.cursor]:
            self.at += 1
            self.cursor += 1
        if self.at < len(output):  # departed from the prediction: find where the output is now
            self.at = len(output)
            found = self._resync(output)
            self.cursor = len(toks) if found is None else found
        drafts = toks[self.cursor : self.cursor + k]
        self.pending = len(drafts)
        return drafts

    def _resync(self, output: list[int]) -> int | None:
        """The position after the longest output suffix (NGRAM_MAX tokens down to 1) found in the
        prediction: its first occurrence at or after the cursor, else its first from the start."""
        for n in range(min(NGRAM_MAX, len(output)), 0, -1):
            gram = output[-n:]
            hit = self._find(gram, max(self.cursor, n), len(self.tokens))
            if hit is None:
                hit = self._find(gram, n, min(self.cursor, len(self.tokens)))
            if hit is not None:
                return hit
        return None

    def _find(self, gram: list[int], lo: int, hi: int) -> int | None:
        """The smallest `end` in [lo, hi] with tokens[end - len(gram) : end] == gram, or None."""
        toks, n, last = self.tokens, len(gram), gram[-1]
        j = lo - 2  # the index of the gram's last token is end - 1
        for _ in range(RESYNC_CHECKS):
            try:
                j = toks.index(last, j + 1, hi)
            except ValueError:
                return None
            if toks[j - n + 1 : j + 1] == gram:
                return j + 1
        return None

    def observe(self, kept: int) -> None:
        """The current verify span kept `kept` drafts; those it had from here are counted."""
        if self.pending:
            good = min(kept, self.pending)
            self.accepted += good
            self.rejected += self.pending - good
            self.pending = 0
