"""Two-layer stop matching, one implementation for every row.

Layer 1 matches token ids (the model's end-of-generation set and any stop_token_ids) before the token
is detokenized. Layer 2 matches stop strings on text: it holds back only the longest tail of the
output that is still a proper prefix of some stop string, so text that can no longer become a stop
is released at once, and the held tail is released when generation ends for another reason.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stop_ids: frozenset[int] | set[int], stop_strings: list[str]):
        self.stop_ids = frozenset(stop_ids)
        self.stops = [s for s in stop_strings if s]
        self.held = ""

    def is_stop_token(self, token_id: int) -> bool:
        return token_id in self.stop_ids

    def push(self, text: str) -> tuple[str, bool]:
        """Feed new text; return (text safe to emit now, whether a stop string completed)."""
        if not self.stops:
            return text, False
        pending = self.held + text
        cut = min((i for i in (pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.held = ""
            return pending[:cut], True
        keep = self._longest_partial(pending)
        self.held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out

    def _longest_partial(self, text: str) -> int:
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
