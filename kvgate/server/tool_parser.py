"""Reading tool calls back out of generated text (the format and grammar are `kvgate.server.tools`').

`ToolCallParser` reads the output incrementally, the same code for streams and whole responses (the
tools module's doc says what it releases and when); `read_calls` turns a finished choice's text into
its message, and `finish_reason` gives the reason the stream and the whole answer share.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from kvgate.server.tools import ARGS_AT, BARE, BARE_KEYS, END, OPEN, SEP
from kvgate.stop import _partial


@dataclass
class ParsedCall:
    index: int
    id: str
    name: str
    arguments: str = ""
    done: bool = False


@dataclass
class ArgsScan:
    """Where a call's arguments (one JSON value) end: at the `}` (or whitespace) that comes at depth 0
    outside a string. No `}` of the arguments is ever taken for the wrapper's, nor the other way."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    started: bool = False
    ended: bool = False

    def length(self, text: str) -> int:
        """How much of `text` is still arguments; `ended` once their end is in it."""
        for n, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    self.ended = self.depth == 0
            elif self.depth == 0 and (ch in "}]" or ch.isspace() and self.started):
                self.ended = True  # the wrapper's `}`, or a space after a top-level number or literal
                return n
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                self.ended = self.depth == 0
            elif ch == '"':
                self.in_string = True
            elif not ch.isspace():
                self.started = True
            if self.ended:
                return n + 1
        return len(text)


def head_name(text: str) -> tuple[str, int] | None:
    """The name of a call's head, `{"name": "..."`, and where it ends, once it is whole."""
    if not text.startswith(BARE):
        return None
    try:
        return json.JSONDecoder().raw_decode(text, len(BARE))
    except json.JSONDecodeError:
        return None


class CallReader:
    """What the two call parsers (this module's and `mistral_tools.MistralCallParser`) share: `push` runs
    the state's method (`_<state>`) until the text is spent or the state waits for more; a call opens
    with a new id; arguments are released as they come, up to their JSON's end. Each parser holds
    `buf`, `state`, `calls` and `scan`."""

    def push(self, text: str) -> list[tuple]:
        self.buf += text
        events: list[tuple] = []
        while self.buf:
            before = (self.state, len(self.buf))
            getattr(self, "_" + self.state)(events)
            if (self.state, len(self.buf)) == before:
                break  # waiting for more text
        return events

    def _new_id(self) -> str:
        return "call_" + uuid.uuid4().hex[:24]

    def _open_call(self, events, name: str) -> None:
        call = ParsedCall(len(self.calls), self._new_id(), name)
        self.calls.append(call)
        self.scan = ArgsScan()
        events.append(("call", call))

    def _text_until(self, events, opening: str) -> bool:
        """Release text up to `opening` (whether it came; then the text after it is left), less the
        whitespace before it; the end of the text that could still become that whitespace and opening
        is held back."""
        at = self.buf.find(opening)
        if at >= 0:
            text, self.buf = self.buf[:at].rstrip(), self.buf[at + len(opening) :]
        else:
            cut = len(self.buf[: len(self.buf) - _partial(self.buf, opening)].rstrip())
            text, self.buf = self.buf[:cut], self.buf[cut:]
        if text:
            self.content.append(text)
            events.append(("content", text))
        return at >= 0

    def _open_cut_head(self, events) -> None:
        """The output was cut in a `{"name": ..., "arguments": ` head: the call, its arguments empty,
        once its name is whole."""
        name = head_name(self.buf)
        if name is not None and ARGS_AT.startswith(self.buf[name[1] :]):
            self._open_call(events, name[0])

    def _read_args(self, events) -> bool:
        """Release what of the text is the last call's arguments; whether they ended."""
        n = self.scan.length(self.buf)
        if n:
            self.calls[-1].arguments += self.buf[:n]
            events.append(("args", self.calls[-1].index, self.buf[:n]))
            self.buf = self.buf[n:]
        return self.scan.ended


@dataclass
class ToolCallParser(CallReader):
    """Incremental reader of generated text: `push(text)` -> events, `end()` -> the last events.

    Events: ("content", text), ("call", ParsedCall) when a call's name is known, ("args", index, text).
    Calls may follow content (text, then `<tool_call>`), or, where `bare_names` is set (the request's
    `ToolPlan.bare_names`: Llama 3.x's template asked for it), be one bare call, the whole output,
    whose name is one of them (`tools`' doc); without it `{"name": ` is text as any other. Arguments are
    released as they come, exactly their JSON text: the wrapper's end (`}`, a newline, `</tool_call>`)
    never is. Output cut short (max_tokens) in a call gives that call with the arguments so far, `done`
    False, once its name is whole, and nothing before: no markup ever comes out as content. A bare
    head is released as content as soon as it can no longer become a declared function's (JSON that
    only begins like a call), and when the output ends inside it.
    """

    bare_names: frozenset[str] = frozenset()  # a bare call's possible names; empty: no bare calls
    single: bool = False  # no call may follow another (parallel_tool_calls false, a named function)
    buf: str = ""
    state: str = "start"  # start | content | head | args | close | between | tail
    calls: list[ParsedCall] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    scan: ArgsScan = field(default_factory=ArgsScan)
    in_bare: bool = False  # the output is a bare call (`{"name": ...` at its start)

    @property
    def after_calls(self) -> bool:
        """The output is in the remark after the calls, which is dropped (max_tokens there cut nothing)."""
        return self.state == "tail"

    def end(self, cut: bool = True) -> list[tuple]:
        """The output ended (`cut`: by max_tokens, maybe inside a call): a call whose name is whole but
        whose arguments never began comes out with empty arguments. Held-back text that could still
        have become a call's opening (`<tool`, at the start or after text) is an answer when the model
        ended it (an answer may end in a proper prefix of `<tool_call>`: see `grammar`) and is dropped
        when the output was cut; any other held-back text is a call's markup and is dropped."""
        events: list[tuple] = []
        if self.state == "head" and self.in_bare:
            name = next((n for n in self.bare_names if self.buf.startswith(BARE + _json(n))), None)
            if name is not None:  # its name whole: the call, cut before its arguments
                self._open_call(events, name)
            else:  # text that began like a call, or a call cut in its name: the text as it came
                self.content.append(self.buf)
                events.append(("content", self.buf))
        elif self.state == "head":
            self._open_cut_head(events)
        elif self.state in ("start", "content") and self.buf:
            # cut: a held opening may have been a call's, the whitespace before it was text
            text = self.buf if not cut else self.buf[: len(self.buf) - len(self.buf.lstrip())]
            if text and (not cut or self.state == "content"):
                self.content.append(text)
                events.append(("content", text))
        elif self.state in ("close", "between") and (self.single or self.in_bare) and self.scan.ended:
            # the arguments closed, and all that could follow was the wrapper's forced end (QA pass 17:
            # a max_tokens there gave `length` to a whole call, which instructor refused)
            self.calls[-1].done, self.state = True, "tail"
        self.buf = ""
        return events

    def _start(self, events) -> None:
        if self.buf.startswith(OPEN):
            self.buf = self.buf[len(OPEN) :]
            self.state = "head"
        elif self.bare_names and self.buf.startswith(BARE):  # the head reads the name from `{"name": ` on
            self.state, self.in_bare = "head", True
        elif not OPEN.startswith(self.buf) and not (self.bare_names and BARE.startswith(self.buf)):
            self.state = "content"  # else: could still become a call

    def _content(self, events) -> None:
        """Text, up to a `<tool_call>` opening that follows it (its calls come next; the whitespace
        between, `render`'s newline among it, is no content); the end of the text that could still
        become that whitespace and opening is held back."""
        if self._text_until(events, OPEN):
            self.state = "head"

    def _head(self, events) -> None:
        if self.in_bare:
            self._bare_head(events)
            return
        name = head_name(self.buf)
        if name is not None and isinstance(name[0], str) and self.buf.startswith(ARGS_AT, name[1]):
            self._open_call(events, name[0])
            self.buf = self.buf[name[1] + len(ARGS_AT) :]
            self.state = "args"

    def _bare_head(self, events) -> None:
        """A bare call's head is `BARE`, a declared name and a key (`BARE_KEYS`), as the grammar writes
        it; text that can no longer become one is content (JSON that only began like a call)."""
        heads = [(BARE + _json(n) + k, n) for n in self.bare_names for k in BARE_KEYS]
        whole = next(((h, n) for h, n in heads if self.buf.startswith(h)), None)
        if whole is not None:
            self._open_call(events, whole[1])
            self.buf = self.buf[len(whole[0]) :]
            self.state = "args"
        elif not any(h.startswith(self.buf) for h, _ in heads):
            self.state, self.in_bare = "content", False

    def _args(self, events) -> None:
        if self._read_args(events):
            self.state = "close"

    def _close(self, events) -> None:
        rest = self.buf.lstrip()
        if self.in_bare and rest:  # one bare call is the whole output: whatever follows it is dropped
            if rest.startswith("}"):
                self.calls[-1].done = True
                self.buf, self.state = rest[1:], "tail"
            else:
                self.state = "content"  # not the wrapper's end (the grammar never does this)
            return
        tail = rest[1:].lstrip() if rest.startswith("}") else None
        if tail is not None and tail.startswith(END):
            self.calls[-1].done = True
            self.buf = tail[len(END) :]
            self.state = "between"
        elif rest and (tail is None or not END.startswith(tail)):
            self.state = "content"  # not the wrapper's end: kept as content (the grammar never does this)

    def _between(self, events) -> None:
        rest = self.buf.lstrip(SEP)
        if self.single and self.buf:  # no second call may come: what follows is the remark (review of
            self.state = "tail"  # session 49: a remark "\n<tool_call>..." cut short gave `length`)
        elif rest != self.buf and rest.startswith(OPEN):  # newlines, then the next call
            self.buf = rest[len(OPEN) :]
            self.state = "head"
        elif self.buf and (rest == self.buf or not OPEN.startswith(rest)):
            self.state = "tail"  # not a call: the remark that ends the output (`grammar`)

    def _tail(self, events) -> None:
        self.buf = ""  # dropped: the calls are the answer


def _json(name: str) -> str:
    return json.dumps(name, ensure_ascii=False)  # as the grammar writes a name


def parse_output(
    text: str, cut: bool = True, bare_names: frozenset[str] = frozenset()
) -> tuple[str | None, list[ParsedCall]]:
    """A whole output: (content or None, the calls); `cut`: see `ToolCallParser.end`."""
    p = _parsed(text, cut, bare_names)
    return _content(p), p.calls


def _parsed(text: str, cut: bool, bare_names: frozenset[str] = frozenset(), parser=None):
    """`text` read whole by `parser` (a new one), or by a Hermes parser with `bare_names`."""
    p = parser if parser is not None else ToolCallParser(bare_names)
    p.push(text)
    p.end(cut)
    return p


def _content(p) -> str | None:
    """The answer's text; None when there is none beside the calls (OpenAI's content of a call turn)."""
    content = "".join(p.content)
    return content if content or not p.calls else None


def model_ended(result) -> bool:
    """Whether the model ended the output itself (its end token): only then is a held-back proper
    prefix of `<tool_call>` an answer; a stop string, max_tokens or a shutdown may have cut a call's
    opening (review of session 33: a stop string "tool" returned "<" as content)."""
    why = result.stop_reason or ""
    return result.finish_reason == "stop" and (why.startswith("token:") or why == "grammar")


def read_calls(
    choice: dict, ended: bool = False, bare_names: frozenset[str] = frozenset(), parser=None
) -> None:
    """Turn a finished chat choice's text into its message: content, or tool calls (the choice then
    finishes with `tool_calls` when every call is whole; cut short, it keeps `length` or `stop` with the
    calls so far, as a stream gives). `bare_names`: `ToolPlan.bare_names`; `parser`: a new reader of the
    request's format (`mistral_tools.parser_for`) in place of a Hermes one with those names."""
    p = _parsed(choice["message"]["content"], not ended, bare_names, parser)
    choice["message"] = {"role": "assistant", "content": _content(p)}
    if p.calls:
        choice["message"]["tool_calls"] = call_dicts(p.calls)
    choice["finish_reason"] = finish_reason(choice["finish_reason"], p.calls, p.after_calls)


def finish_reason(reason: str, calls: list[ParsedCall], in_remark: bool = False) -> str:
    """A choice that stopped after whole calls finishes with `tool_calls`; one cut short (max_tokens
    inside a call) keeps its own reason. `in_remark`: the output was in the remark after the calls
    (the parser's `tail`), which is dropped, so max_tokens there cut nothing returned. The stream and
    the whole answer share it."""
    whole = calls and all(c.done for c in calls)
    return "tool_calls" if whole and (reason == "stop" or (reason == "length" and in_remark)) else reason


def call_dicts(calls: list[ParsedCall]) -> list[dict]:
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]
