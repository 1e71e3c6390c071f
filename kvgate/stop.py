"""Two-layer stop matching, one implementation for every row.

Layer 1 matches token ids (the model's end-of-generation set and any stop_token_ids) before the token
is detokenized. Layer 2 matches stop strings on text: it holds back only the longest tail of the
output that is still a proper prefix of some stop string, so text that can no longer become a stop
is released at once, and the held tail is released when generation ends for another reason.
"""

from __future__ import annotations

THINK_CLOSE = "</think>"  # the end of a thinking model's reasoning (kvgate.server.reasoning's CLOSE)
THINK_CLOSES = (THINK_CLOSE, "[/THINK]")  # with Mistral's (reasoning.MISTRAL_TAGS), written out for it


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
        `{"name": ...}`, kvgate.server.tools). Such a region, and one given as (opening, closing,
        "start") (Mistral's calls beside an answer format, whose JSON strings may hold the mark), opens
        only where the answer starts, as the grammar and the tool parser allow those calls only there
        (review of session 47: prose with an unbalanced `{"name": ` turned stop strings off for the
        rest of the output): at the output's first character, or, after a think block, at the first
        character that is not whitespace after the first `</think>` or `[/THINK]` (the stop matcher sees
        the reasoning too; `wrap_grammar` lets the answer follow it; a prose closing where no
        reasoning is split is taken for its end as well).
        `include`: the text is cut after the stop string, not before it (vLLM's
        `include_stop_str_in_output`)."""
        self.include = include
        self.stop_ids = frozenset(stop_ids)
        self.stops = [s for s in stop_strings if s]
        self.held = ""
        self.exempt = (exempt,) if exempt is not None and isinstance(exempt[0], str) else exempt
        self.inside: tuple | None = None  # the pair of the region the text is in
        self._scan = [0, False, False]  # a JSON region's depth, in a string, after a backslash
        self.matched: str | None = None  # the stop string that completed (the earliest, then first listed)
        self.pushed = 0  # the characters pushed so far (where the next push's text starts in the output)
        self.answer_at: int | None = None  # where the answer starts after `</think>`, once that is known
        self._think = ""  # the scan for the first `</think>`: the tail that may begin it; None once found
        self._bare_spent = False  # a bare region opened (one call, the whole answer: no second one)

    def is_stop_token(self, token_id: int) -> bool:
        return token_id in self.stop_ids

    def push(self, text: str, final: bool = False, match: bool = True) -> tuple[str, bool]:
        """Feed new text; return (text safe to emit now, whether a stop string completed). `final`: no
        more text will come (a stop held back as maybe part of an exempt region's opening counts now).
        `match` false (before a request's min_tokens): no stop string counts, but one that begins here
        and completes after does, as vLLM's (QA pass 15: it was missed, and the row ran to max_tokens)."""
        if not self.stops:
            return text, False
        if self.exempt is not None:
            return self._push_regions(text, final, match)
        if not match:  # hold a tail that may begin a stop completed later
            pending = self.held + text
            keep = self._longest_partial(pending)
            self.held = pending[len(pending) - keep :] if keep else ""
            return pending[: len(pending) - keep], False
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

    def _push_regions(self, text: str, final: bool, match: bool = True) -> tuple[str, bool]:
        """`push` with the exempt regions: a stop string counts where it starts outside them. One that
        starts in what may still become an opening (`<` of `<tool_call>`, the rest not yet written) waits
        for the next text: a stop `<` cut calls whose opening came in several tokens. `match` false: the
        regions are followed but no stop string counts (min_tokens; before, regions skipped it)."""
        base = self.pushed - len(self.held)  # where `pending` starts in the output
        self.pushed += len(text)
        self._scan_think(text)
        pending, self.held, out = self.held + text, "", []
        while pending:
            if self.inside is not None:
                end, keep = self._region_end(pending)
                if end < 0:  # all of it is the region's, but a closing's start that may go on
                    out.append(pending[: len(pending) - keep])
                    self.held = pending[len(pending) - keep :]
                    break
                out.append(pending[:end])
                pending, self.inside, base = pending[end:], None, base + end
                continue
            hits = [(i, pair) for pair in self.exempt if (i := self._find_opening(pending, pair, base)) >= 0]
            at, pair = min(hits, key=lambda h: h[0]) if hits else (-1, None)
            if at < 0:  # where an opening may be starting (the end, when none can)
                at = len(pending) - (0 if final else self._partial_opening(pending, base))
            cut = self._first_stop(pending, at) if match else -1
            if cut >= 0:
                out.append(pending[: self._end(cut)])
                return "".join(out), True
            if pair is None:
                keep = max(self._longest_partial(pending), self._partial_opening(pending, base))
                out.append(pending[: len(pending) - keep])
                self.held = pending[len(pending) - keep :]
                break
            self.inside = pair
            if pair[1] is None:  # the opening is the JSON object's start: scanned with the rest
                self._scan, self._bare_spent = [0, False, False], True
            else:
                at += len(pair[0])
            out.append(pending[:at])
            pending, base = pending[at:], base + at
        return "".join(out), False

    def _bare_starts(self, base: int, size: int) -> list[int]:
        """Where in text of `size` characters that starts at output offset `base` a bare call may open:
        the answer's start (the output's, or the first non-space after `</think>`), if it lies there."""
        if self._bare_spent:
            return []
        starts = {0, self.answer_at} if self.answer_at is not None else {0}
        return sorted(s - base for s in starts if base <= s < base + size)

    def _find_opening(self, text: str, pair: tuple, base: int) -> int:
        if not _at_start(pair):
            return text.find(pair[0])
        return next((i for i in self._bare_starts(base, len(text)) if text.startswith(pair[0], i)), -1)

    def _partial_opening(self, text: str, base: int) -> int:
        """The longest end of `text` that may still become an opening (a bare one, or one marked "start",
        only at the answer's start)."""
        keep = [_partial(text, pair[0]) for pair in self.exempt if not _at_start(pair)]
        for pair in self.exempt:
            if _at_start(pair):
                keep += [
                    len(text) - i for i in self._bare_starts(base, len(text)) if pair[0].startswith(text[i:])
                ]
        return max(keep, default=0)

    def _scan_think(self, text: str) -> None:
        """Follow the pushed text to the first `</think>` and the whitespace after it: `answer_at` is
        then where the answer starts (reasoning ends at the first `</think>`: kvgate.server.reasoning)."""
        if self._think is not None:  # the tag not yet found
            tail = self._think + text
            found = [(at, tag) for tag in THINK_CLOSES if (at := tail.find(tag)) >= 0]
            if not found:
                self._think = tail[len(tail) - max(_partial(tail, tag) for tag in THINK_CLOSES) :]
                return
            at, tag = min(found)
            self._think, self.answer_at = None, self.pushed - len(tail) + at + len(tag)
            text = tail[at + len(tag) :]
        elif self.answer_at is None or self.answer_at < self.pushed - len(text):
            return  # the answer's start already passed
        start = self.pushed - len(text)  # where `text` starts; answer_at lies at or after it
        rest = text[self.answer_at - start :]
        self.answer_at += len(rest) - len(rest.lstrip())

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


def _at_start(pair: tuple) -> bool:
    """Whether a region opens only at the answer's start: a bare call's (closing None), or one whose
    third element is "start" (Mistral's calls beside an answer format, whose JSON may hold the mark)."""
    return pair[1] is None or pair[2:] == ("start",)


def _partial(text: str, word: str) -> int:
    """The longest end of `text` that is a proper prefix of `word`."""
    for n in range(min(len(word) - 1, len(text)), 0, -1):
        if text.endswith(word[:n]):
            return n
    return 0
