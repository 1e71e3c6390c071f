"""Mistral's tool calls: `[TOOL_CALLS]`, a control token, opens them; the grammar and parser for it.

Mistral's templates show the model one of two formats, and the model writes the one it was shown:

- a JSON list after the token (Mistral 7B v0.3, Nemo 2407):
  `[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]`
  (v0.3 writes a space before the `[`; the 9-character id is optional here, the template replays one);
- one token per call, the name as text, `[ARGS]`, then the arguments (Mistral Small 3.1+, Devstral,
  Ministral 3, Magistral: the tokenizers vLLM calls v11 and later):
  `[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}`
  (Small 3.2's template writes `[CALL_ID]` and an id between the name and `[ARGS]`; allowed, not needed).

`mistral_format(tok)` knows the format from the chat template (which writes it) and the vocabulary
(which must have the tokens): `[ARGS]` in both means the token-per-call form, as llama.cpp's
and vLLM's parsers tell them apart. The grammar (`grammar`) names the tokens by id (`<[id]>`):
llguidance never takes a control token for text, and a model writes them as their tokens. The
detokenizer, which leaves control tokens out, writes these ones (`MistralFormat.kept`), so the
parser reads them in the text, where an answer can never hold `[TOOL_CALLS]` as characters (the
grammar's answer excludes it). Calls may follow some text (`content[TOOL_CALLS]...`, vLLM's reading),
never precede it; the output ends with the calls. Call ids are 9 letters and digits, the ids Mistral's
templates require of a replayed call (vLLM's rule for Mistral).

`MistralCallParser` gives the same events as `tool_parser.ToolCallParser` (content, a call once its
name is whole, its arguments as they come), so the stream shaper and the whole answer use either
through `parser_for(plan)`.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass, field

from kvgate.server import tools as T
from kvgate.server.errors import invalid
from kvgate.server.tool_parser import (
    ARGS_AT,
    BARE,
    ArgsScan,
    CallReader,
    ParsedCall,
    ToolCallParser,
    head_name,
)

MARK, ARGS, CALL_ID = T.MISTRAL_MARK, "[ARGS]", "[CALL_ID]"
ID_KEY = ', "id": "'  # the JSON list form's optional id, after the arguments (Nemo's template writes it)
ID_CHARS = string.ascii_letters + string.digits


@dataclass(frozen=True)
class MistralFormat:
    calls: int  # the id of `[TOOL_CALLS]`
    args: int | None = None  # the id of `[ARGS]`: one token per call; None: the JSON list form
    call_id: int | None = None  # the id of `[CALL_ID]`, where the template writes it before `[ARGS]`

    @property
    def kept(self) -> frozenset[int]:
        """The control tokens the detokenizer writes out for the parser."""
        return frozenset(i for i in (self.calls, self.args, self.call_id) if i is not None)


def mistral_format(tok) -> MistralFormat | None:
    """The model's Mistral tool format, or None: its template renders tools and writes `[TOOL_CALLS]`,
    and its vocabulary has that token (a template alone proves nothing of the model's tokens)."""
    template = getattr(getattr(tok, "info", None), "chat_template", None) or ""
    vocab = getattr(tok, "tok", None)
    if not getattr(tok, "supports_tools", False) or MARK not in template or vocab is None:
        return None

    def token(text: str) -> int | None:
        return vocab.token_to_id(text) if text in template else None

    calls = token(MARK)
    if calls is None:
        return None
    args = token(ARGS)
    return MistralFormat(calls, args, token(CALL_ID) if args is not None else None)


def grammar(plan: T.ToolPlan, answer_rule: str | None, reach: int | None = None) -> str:
    """llguidance Lark text for a Mistral plan (`plan.mistral`): `answer_rule` (None: free text without
    `[TOOL_CALLS]` in it, or such text followed by calls) or the calls, as `tools.grammar` for Hermes."""
    fmt = plan.mistral
    lines = []
    if plan.mode == "auto" and answer_rule:
        lines += ["start: answer | calls", f"answer: {answer_rule}"]
    elif plan.mode == "auto":
        lines += ["start: answer | calls | TEXT calls", "answer: TEXT", f"TEXT: /{T.not_containing(MARK)}/"]
    else:
        lines.append("start: calls")
    alts = " | ".join(f"fn_{i}" for i in range(len(plan.functions)))
    if fmt.args is None:  # one JSON list: `[TOOL_CALLS][{...}, {...}]`
        more = ' ("," " "? item)*' if plan.parallel else ""
        lines.append(f'calls: <[{fmt.calls}]> " "? "[" item{more} "]"')
        lines.append(f'item: ({alts}) CALL_ID? "}}"')
        lines.append(f'CALL_ID: /{ID_KEY}[a-zA-Z0-9]{{9}}"/')
    else:  # a token per call: `[TOOL_CALLS]name[ARGS]{...}`, again for each further call
        lines.append("calls: call" + ("+" if plan.parallel else ""))
        lines.append(f"call: <[{fmt.calls}]> ({alts})")
        if fmt.call_id is not None:
            lines.append(f"call_id: <[{fmt.call_id}]> /[a-zA-Z0-9]{{9}}/")
    for i, f in enumerate(plan.functions):
        name = json.dumps(f.name, ensure_ascii=False)
        args = f"%json {json.dumps(T.args_schema(f, reach))}"
        if fmt.args is None:
            lines.append(f"fn_{i}: {json.dumps(BARE + name + ARGS_AT)} {args}")
        else:
            call_id = " call_id?" if fmt.call_id is not None else ""
            lines.append(f"fn_{i}: {name}{call_id} <[{fmt.args}]> {args}")
    return "\n".join(lines) + "\n"


def check_names(plan: T.ToolPlan) -> None:
    """Mistral's markup around a name is made of brackets: a function name holding `[`, `]` or a NUL
    could read as markup (`a[ARGS]b`). OpenAI allows only letters, digits, `_` and `-` in one."""
    for i, f in enumerate(plan.functions):
        if any(c in f.name for c in "[]\x00"):
            raise invalid(
                f"tool {f.name!r}: this model marks its calls with bracketed tokens ([TOOL_CALLS], [ARGS]), "
                "so a function name may not hold '[', ']' or NUL; use letters, digits, '_' and '-' "
                "(OpenAI's rule for names)",
                param=f"tools.{i}.function.name",
            )


@dataclass
class MistralCallParser(CallReader):
    """Incremental reader of a Mistral output: `push(text)` -> events, `end(cut)` -> the last events,
    the events of `ToolCallParser`. `listed`: the JSON list form, else a token per call. `lead`: calls
    may follow text; false beside an answer format, where they can only open the output (the grammar's
    `answer | calls`) and a JSON answer's strings may hold the mark's characters (review of session 49).

    States: start (`lead` false: the output's first characters), text (an answer: all content), content, open (after the list's `[TOOL_CALLS]`, before its `[`), head (a listed call's
    `{"name": ..., "arguments": `), name (a token-per-call name, up to `[ARGS]` or `[CALL_ID]`), call_id,
    args, close (a listed call's optional id and `}`), between (`, ` and the next listed call, or `]`),
    after (a token-per-call call's end: the next `[TOOL_CALLS]`), done (the calls ended)."""

    listed: bool
    lead: bool = True
    single: bool = False  # no call may follow another (parallel_tool_calls false, a named function)
    buf: str = ""
    state: str = ""
    calls: list[ParsedCall] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    scan: ArgsScan = field(default_factory=ArgsScan)

    def __post_init__(self) -> None:
        self.state = self.state or ("content" if self.lead else "start")

    @property
    def after_calls(self) -> bool:
        """The output went past the calls' end (max_tokens there cut nothing returned)."""
        return self.state == "done"

    def end(self, cut: bool = True) -> list[tuple]:
        """As `ToolCallParser.end`, but held-back text is always an answer: `[TOOL_CALLS]` is one token,
        whose text comes whole, so a held part of it (`See [TOOL_C`) was the model's text, cut or not
        (review of session 49: it was dropped on a cut). A listed call cut after its whole name comes
        out with empty arguments, as a Hermes call does."""
        events: list[tuple] = []
        if self.state in ("content", "start", "text") and self.buf:
            self.content.append(self.buf)
            events.append(("content", self.buf))
        elif self.state == "head":
            self._open_cut_head(events)
        elif self.single and self.calls and self.scan.ended and self.state in ("close", "between", "after"):
            self.calls[-1].done, self.state = True, "done"  # all that could follow was forced markup
        self.buf = ""
        return events

    def _start(self, events) -> None:
        if self.buf.startswith(MARK):
            self.buf = self.buf[len(MARK) :]
            self.state = "open" if self.listed else "name"
        elif not MARK.startswith(self.buf):
            self.state = "text"

    def _text(self, events) -> None:
        self.content.append(self.buf)
        events.append(("content", self.buf))
        self.buf = ""

    def _content(self, events) -> None:
        if self._text_until(events, MARK):  # (a part of the mark is held for a stream split inside it)
            self.state = "open" if self.listed else "name"

    def _open(self, events) -> None:
        rest = self.buf.lstrip()
        if rest.startswith("["):
            self.buf, self.state = rest[1:], "head"
        elif rest:
            self.state = "done"  # not the list (the grammar never does this)
        else:
            self.buf = rest

    def _head(self, events) -> None:
        self.buf = self.buf.lstrip()
        name = head_name(self.buf)
        if name is not None and isinstance(name[0], str) and self.buf.startswith(ARGS_AT, name[1]):
            self._open_call(events, name[0])
            self.buf, self.state = self.buf[name[1] + len(ARGS_AT) :], "args"
        elif self.buf and not BARE.startswith(self.buf[: len(BARE)]):
            self.state = "done"  # not a call's head (the grammar never does this)

    def _name(self, events) -> None:
        ends = [(at, tag) for tag in (ARGS, CALL_ID) if (at := self.buf.find(tag)) >= 0]
        if ends:
            at, tag = min(ends)
            self._open_call(events, self.buf[:at])
            self.buf = self.buf[at + len(tag) :]
            self.state = "args" if tag == ARGS else "call_id"

    def _call_id(self, events) -> None:
        at = self.buf.find(ARGS)
        if at >= 0:
            self.buf, self.state = self.buf[at + len(ARGS) :], "args"

    def _args(self, events) -> None:
        if self._read_args(events):
            if self.listed:
                self.state = "close"
            else:
                self.calls[-1].done, self.state = True, "after"

    def _close(self, events) -> None:
        if self.buf.startswith("}"):
            self.calls[-1].done = True
            self.buf, self.state = self.buf[1:], "between"
        elif self.buf.startswith(ID_KEY):  # the model's own id: ours is already out (streams send it first)
            end = self.buf.find('"', len(ID_KEY))
            if end >= 0:
                self.buf = self.buf[end + 1 :]
        elif not ID_KEY.startswith(self.buf):
            self.state = "done"  # not the call's end (the grammar never does this)

    def _between(self, events) -> None:
        rest = self.buf.lstrip()
        if rest.startswith(","):
            self.buf, self.state = rest[1:], "head"
        elif rest:
            self.state = "done"  # `]`, the list's end
        else:
            self.buf = rest

    def _after(self, events) -> None:
        if self.buf.startswith(MARK):
            self.buf, self.state = self.buf[len(MARK) :], "name"
        elif not MARK.startswith(self.buf):
            self.state = "done"

    def _done(self, events) -> None:
        self.buf = ""  # the grammar ends the output with the calls

    def _new_id(self) -> str:
        return "".join(random.choices(ID_CHARS, k=9))


def parser_for(plan: T.ToolPlan):
    """The output reader for a request's tool plan: Mistral's where the model writes Mistral's format."""
    if plan.mistral is not None:
        return MistralCallParser(plan.mistral.args is None, not plan.formatted, not plan.parallel)
    return ToolCallParser(plan.bare_names, not plan.parallel)
