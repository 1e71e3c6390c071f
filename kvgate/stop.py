"""Two-layer stop matching, one implementation for every row.

Layer 1 matches token ids (the model's end-of-generation set and any stop_token_ids) before the token
is detokenized. Layer 2 matches stop strings on text: it holds back only the longest tail of the
output that is still a proper prefix of some stop string, so text that can no longer become a stop
is released at once, and the held tail is released when generation ends for another reason.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(
        self,
        stop_ids: frozenset[int] | set[int],
        stop_strings: list[str],
        exempt: tuple | None = None,
        include: bool = False,
    ):
        """`exempt`: (opening, closing) of regions where stop strings do not apply, or a tuple of such
        pairs: a tool call's `<tool_call>` ... `</tool_call>`, whose arguments a grammar writes (a stop
        string there cut a call's JSON in two, and agents ran the broken call: QA pass 6). A closing of
        None: the region ends where the JSON object that its opening begins with `{` ends (a bare call,
        `{"name": ...}`, kvgate.server.tools). `include`: the text is cut after the stop string, not
        before it (vLLM's `include_stop_str_in_output`)."""
        self.include = include
        self.stop_ids = frozenset(stop_ids)
        self.stops = [s for s in stop_strings if s]
        self.held = ""
        self.exempt = (exempt,) if exempt is not None and isinstance(exempt[0], str) else exempt
        self.inside: tuple | None = None  # the pair of the region the text is in
        self._scan = [0, False, False]  # a JSON region's depth, in a string, after a backslash
        self.matched: str | None = None  # the stop string that completed (the earliest, then first listed)

    def is_stop_token(self, token_id: int) -> bool:
        return token_id in self.stop_ids

    def push(self, text: str, final: bool = False, match: bool = True) -> tuple[str, bool]:
        """Feed new text; return (text safe to emit now, whether a stop string completed). `final`: no
        more text will come (a stop held back as maybe part of an exempt region's opening counts now).
        `match` false (before a request's min_tokens): no stop string counts, but one that begins here
        and completes after does, as vLLM's (QA pass 15: it was missed, and the row ran to max_tokens)."""
        if not self.stops:
            return text, False
        if not match and self.exempt is None:  # hold a tail that may begin a stop completed later
            pending = self.held + text
            keep = self._longest_partial(pending)
            self.held = pending[len(pending) - keep :] if keep else ""
            return pending[: len(pending) - keep], False
        if self.exempt is not None:
            return self._push_regions(text, final)
        pending = self.held + text
        cut = self._first_stop(pending, len(pending))
        if cut >= 0:
            self.held = ""
            return pending[: self._end(cut)], True
        keep = self._longest_partial(pending)
        self.held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out

    def _first_stop(self, text: str, before: int) -> int:
        """Where the earliest stop string in `text` starts (below `before`), noting it in `matched`;
        -1 when none does."""
        hits = [(i, s) for s in self.stops if 0 <= (i := text.find(s)) < before]
        if not hits:
            return -1
        cut, self.matched = min(hits, key=lambda h: h[0])
        return cut

    def _end(self, cut: int) -> int:
        """Where the output ends when the matched stop string starts at `cut`."""
        return cut + len(self.matched) if self.include else cut

    def _longest_partial(self, text: str) -> int:
        return max((_partial(text, s) for s in self.stops), default=0)

    def _push_regions(self, text: str, final: bool) -> tuple[str, bool]:
        """`push` with the exempt regions: a stop string counts where it starts outside them. One that
        starts in what may still become an opening (`<` of `<tool_call>`, the rest not yet written) waits
        for the next text: a stop `<` cut calls whose opening came in several tokens."""
        pending, self.held, out = self.held + text, "", []
        while pending:
            if self.inside is not None:
                end, keep = self._region_end(pending)
                if end < 0:  # all of it is the region's, but a closing's start that may go on
                    out.append(pending[: len(pending) - keep])
                    self.held = pending[len(pending) - keep :]
                    break
                out.append(pending[:end])
                pending, self.inside = pending[end:], None
                continue
            hits = [(i, pair) for pair in self.exempt if (i := pending.find(pair[0])) >= 0]
            at, pair = min(hits, key=lambda h: h[0]) if hits else (-1, None)
            if at < 0:  # where an opening may be starting (the end, when none can)
                at = len(pending) - (0 if final else self._partial_opening(pending))
            cut = self._first_stop(pending, at)
            if cut >= 0:
                out.append(pending[: self._end(cut)])
                return "".join(out), True
            if pair is None:
                keep = max(self._longest_partial(pending), self._partial_opening(pending))
                out.append(pending[: len(pending) - keep])
                self.held = pending[len(pending) - keep :]
                break
            self.inside = pair
            if pair[1] is None:  # the opening is the JSON object's start: scanned with the rest
                self._scan = [0, False, False]
            else:
                at += len(pair[0])
            out.append(pending[:at])
            pending = pending[at:]
        return "".join(out), False

    def _partial_opening(self, text: str) -> int:
        return max(_partial(text, opening) for opening, _ in self.exempt)

    def _region_end(self, text: str) -> tuple[int, int]:
        """(where the region the text is in ends in `text`, or -1; how much of its end to hold back)."""
        closing = self.inside[1]
        if closing is not None:
            end = text.find(closing)
            return (end + len(closing), 0) if end >= 0 else (-1, _partial(text, closing))
        depth, in_string, escaped = self._scan
        for n, ch in enumerate(text):
            if in_string:
                escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
            elif ch == '"':
                in_string = True
            elif ch in "{[]}":
                depth += 1 if ch in "{[" else -1
                if depth == 0:
                    return n + 1, 0
        self._scan = [depth, in_string, escaped]
        return -1, 0


def _partial(text: str, word: str) -> int:
    """The longest end of `text` that is a proper prefix of `word`."""
    for n in range(min(len(word) - 1, len(text)), 0, -1):
        if text.endswith(word[:n]):
            return n
    return 0
