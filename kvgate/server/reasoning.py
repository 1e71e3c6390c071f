"""Reasoning output of thinking models: the `<think> ... </think>` a model writes before its answer,
returned beside the answer instead of inside it (vLLM's `--reasoning-parser`, llama.cpp's
`--reasoning-format`).

Promises:
- `--reasoning-parser` (`ServerSettings.reasoning_parser`, `resolve`): `none` leaves the text as the
  model wrote it; `deepseek_r1` and `qwen3` split it; `auto` (the default) is on when the chat template
  or the vocabulary has both `<think>` and `</think>`: `deepseek_r1` when the template writes them and
  does not read `enable_thinking` (the R1 distills'), else `qwen3`; `mistral` (tags `[THINK]` and
  `[/THINK]`, control tokens the detokenizer writes for it: `Reasoning.kept`) where the template and the
  vocabulary both have them (Magistral, Ministral 3 Reasoning), checked first. Chat answers only (and the
  Responses and Messages APIs, which are chat answers); `/v1/completions` text is never split.
- Where an answer starts (`start_state`, from the end of the rendered prompt, as llama.cpp's
  "thinking forced open"): a prompt ending in `<think>` (R1 distills' and Qwen3.5's templates open it)
  starts in reasoning; one ending in `</think>` (Qwen3's template under `enable_thinking: false`) in
  content; otherwise the output may open `<think>` itself (whitespace before it dropped). Output that
  does not open it is reasoning under `deepseek_r1` (R1 may leave the opening out: vLLM's rule) and
  content under `qwen3`, under `qwen3` with `enable_thinking: false`, and under a grammar.
- Reasoning ends at the first `</think>`; the rest is content, in which a later `<think>` is text.
  Output cut before `</think>` (max_tokens) is all reasoning and its content "" (as OpenAI's own
  reasoning models answer when the limit is spent thinking). Neither tag ever appears in either field,
  and whitespace beside the tags is dropped (the answer does not begin with "\\n\\n"). An answer with no
  reasoning has `reasoning_content: null`.
- `ReasoningSplitter` is the one reader for streams and whole answers: it holds back only what could
  still be part of a tag (and whitespace that may precede one), so a tag split over several tokens is
  found, and text pushed in any pieces comes out as the whole text does (tests/test_reasoning.py).
- Tool calls and structured output read the content alone: `wrap_grammar` leaves the reasoning free
  and holds what follows `</think>` to the request's grammar, as vLLM applies a grammar once the
  reasoning has ended.
- The text goes in both `reasoning_content` (what DeepSeek's API, llama.cpp, vLLM up to 0.10, LiteLLM,
  Qwen-Agent and open-webui use) and `reasoning` (vLLM's name since 0.11; its newest versions emit only
  it): `FIELDS`. `include_reasoning: false` (vLLM's request field) leaves both out.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass

from kvgate.flag_types import one_of
from kvgate.stop import _partial

log = logging.getLogger("kvgate.server")

OPEN, CLOSE = "<think>", "</think>"
MISTRAL_TAGS = ("[THINK]", "[/THINK]")  # Magistral's and Ministral 3 Reasoning's control tokens
PARSERS = ("auto", "none", "deepseek_r1", "qwen3", "mistral")
FIELDS = ("reasoning_content", "reasoning")  # a message's and a delta's fields, the same text in each
TAIL_TOKENS = 16  # the prompt's last tokens read for an opened or closed think block


def add_reasoning_flag(parser) -> None:
    parser.add_argument(
        "--reasoning-parser",
        type=one_of(*PARSERS),
        default=os.environ.get("KVGATE_REASONING_PARSER", "auto"),
        help="a thinking model's <think> block as the message's reasoning_content: auto (on when the chat "
        "template or vocabulary has <think> and </think>, or both have [THINK] and [/THINK]), none, "
        "deepseek_r1, qwen3, mistral",
    )


def resolve(name: str, tok) -> str | None:
    """The parser `--reasoning-parser name` means for this model's tokenizer (None: off)."""
    if name == "none":
        return None
    if name != "auto":
        return name
    info = getattr(tok, "info", None)
    template = (getattr(info, "chat_template", None) or "") if info is not None else ""
    vocab = getattr(tok, "tok", None)
    if vocab is not None and all(t in template and vocab.token_to_id(t) is not None for t in MISTRAL_TAGS):
        return "mistral"  # its control tokens, in the vocabulary and written by the template
    in_template = OPEN in template and CLOSE in template
    in_vocab = vocab is not None and all(vocab.token_to_id(t) is not None for t in (OPEN, CLOSE))
    if not (in_template or in_vocab):
        return None
    return "deepseek_r1" if in_template and "enable_thinking" not in template else "qwen3"


def start_state(tok, prompt_ids: list[int], parser: str, thinking: bool = True) -> str:
    """ "reasoning", "content" or "start" (the output may open `<think>`): see the module doc."""
    if parser == "qwen3" and not thinking:
        return "content"
    opening, closing = tags_of(parser)
    tail = tok.decode(list(prompt_ids[-TAIL_TOKENS:]), skip_special_tokens=False).rstrip()
    if tail.endswith(opening):
        return "reasoning"
    if tail.endswith(closing):
        return "content"
    return "start"


@dataclass
class Reasoning:
    """One chat request's reasoning plan (`Prepared.reasoning`)."""

    parser: str
    include: bool = True  # vLLM's include_reasoning: false splits the reasoning off and drops it
    thinking: bool = True  # chat_template_kwargs.enable_thinking
    state: str = "start"
    grammar: bool = False  # a grammar shapes the answer: output that opens no think block is content
    open_id: int | None = None  # the tags' own tokens, where the vocabulary has them (`wrap_grammar`)
    close_id: int | None = None

    @property
    def tags(self) -> tuple[str, str]:
        return tags_of(self.parser)

    @property
    def kept(self) -> frozenset[int]:
        """Tags the detokenizer must write though they are control tokens (Mistral's): the splitter reads
        them in the text. `<think>` is text in every vocabulary that has it."""
        if self.parser != "mistral":
            return frozenset()
        return frozenset(i for i in (self.open_id, self.close_id) if i is not None)

    @property
    def missing(self) -> str:
        """Where output that opens no think block goes."""
        return "reasoning" if self.parser == "deepseek_r1" and not self.grammar else "content"

    def splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(self.state, self.missing, self.tags)

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole output: (reasoning or None, content)."""
        s = self.splitter()
        pieces = s.push(text) + s.end()
        reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
        return reasoning or None, "".join(t for kind, t in pieces if kind == "content")

    def take(self, choice: dict) -> str | None:
        """A whole chat choice's reasoning, moved out of its message's content."""
        reasoning, content = self.split(choice["message"]["content"] or "")
        choice["message"]["content"] = content
        return reasoning

    def put(self, choice: dict, reasoning: str | None) -> None:
        if self.include:
            choice["message"].update(dict.fromkeys(FIELDS, reasoning))

    def delta(self, text: str) -> dict:
        return dict.fromkeys(FIELDS, text) if self.include else {}


def plan(name: str, engine, req, prompt_ids: list[int]) -> Reasoning | None:
    """The plan for a chat request under `--reasoning-parser name`, or None when it is off."""
    parser = resolve(name, engine.tokenizer)
    if parser is None:
        return None
    kwargs = req.chat_template_kwargs or {}
    r = Reasoning(parser, req.include_reasoning, kwargs.get("enable_thinking") is not False)
    r.state = start_state(engine.tokenizer, prompt_ids, parser, r.thinking)
    vocab = getattr(engine.tokenizer, "tok", None)
    if vocab is not None:
        r.open_id, r.close_id = (vocab.token_to_id(t) for t in r.tags)
    return r


def tags_of(parser: str) -> tuple[str, str]:
    """The opening and closing of a parser's think block."""
    return MISTRAL_TAGS if parser == "mistral" else (OPEN, CLOSE)


class ReasoningSplitter:
    """Incremental: `push(text)` -> [("reasoning" | "content", text), ...], `end()` -> the rest.

    `push_token` also counts the tokens generated while reasoning was open (usage's `reasoning_tokens`:
    the opening's tokens, the reasoning's, and the one that completes `</think>`)."""

    def __init__(self, state: str = "start", missing: str = "content", tags: tuple[str, str] = (OPEN, CLOSE)):
        self.state = state  # start | reasoning | content
        self.missing = missing
        self.open, self.close = tags
        self.buf = ""
        self.lead = True  # nothing of the current field sent yet: its leading whitespace is dropped
        self.final = False
        self.tokens = 0
        self._waiting = 0  # tokens pushed while it was not yet known whether a think block opens
        self._touched = False

    def push(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        while True:
            before = (self.state, len(self.buf))
            getattr(self, "_" + self.state)(out)
            if (self.state, len(self.buf)) == before:
                return out

    def push_token(self, text: str) -> list[tuple[str, str]]:
        self._touched = self.state == "reasoning"
        was_start = self.state == "start"
        out = self.push(text)
        if self.state == "start":
            self._waiting += 1
        elif self._touched or self.state == "reasoning":
            self.tokens += 1 + (self._waiting if was_start else 0)
        return out

    def end(self) -> list[tuple[str, str]]:
        """The output ended: what was held back, less whitespace after the last text."""
        self.final = True
        out = self.push("")
        self.buf = ""
        return out

    def _enter(self, state: str) -> None:
        self.state, self.lead = state, True
        if state == "reasoning":
            self._touched = True

    def _send(self, out: list, kind: str, text: str) -> None:
        if text:
            out.append((kind, text))
            self.lead = False

    def _start(self, out) -> None:
        body = self.buf.lstrip()
        if body.startswith(self.open):
            self.buf = body[len(self.open) :]
            self._enter("reasoning")
        elif self.final or not self.open.startswith(body):  # it can no longer become the opening
            self._enter(self.missing)

    def _reasoning(self, out) -> None:
        if self.lead:  # opened by the prompt, and by the output again: the second opening is dropped
            self.buf = self.buf.lstrip()
            if self.buf.startswith(self.open):
                self.buf = self.buf[len(self.open) :]
                return
            if self.buf and self.open.startswith(self.buf) and not self.final:
                return
        at = self.buf.find(self.close)
        if at >= 0:
            self._send(out, "reasoning", self.buf[:at].rstrip())
            self.buf = self.buf[at + len(self.close) :]
            self._enter("content")
            return
        keep = 0 if self.final else _partial(self.buf, self.close)
        text = self.buf[: len(self.buf) - keep]
        sent = text.rstrip()  # whitespace is held: `</think>` may come right after it
        self._send(out, "reasoning", sent)
        self.buf = self.buf[len(sent) :]

    def _content(self, out) -> None:
        if self.lead:
            self.buf = self.buf.lstrip()
        self._send(out, "content", self.buf)
        self.buf = ""


_START = re.compile(r"^(\??)start(\s*:)", re.M)


def wrap_grammar(text: str, r: Reasoning | None) -> str:
    """The request's grammar (Lark text) behind a free think block: its `start` renamed, and a new
    `start` that is the block (reasoning text up to `</think>`, and the whitespace after it) and then
    the old start. The tags may come as text or, where the vocabulary has them, as their own tokens
    (llguidance keeps an added token apart from its text: `<[id]>`). A prompt that opened the block
    needs it (and lets the output open it again first, which `ReasoningSplitter` drops); one that did
    not lets the output open it or skip it; one that closed it (or no reasoning) leaves the grammar as
    it is."""
    if r is None or r.state == "content" or not _START.search(text):
        return text
    from kvgate.server.tools import not_containing  # here: `kvgate` (cli) imports this module for its flag

    opening_text, closing_text = r.tags
    free = f"({not_containing(closing_text)})".replace("/", "\\/")
    closing = re.escape(closing_text).replace("/", "\\/")
    lines = [f"KVGATE_THINK: /{free}?{closing}[ \\t\\r\\n]*/"]
    think = "KVGATE_THINK"
    if r.close_id is not None:
        think = f"(KVGATE_THINK | KVGATE_TEXT? <[{r.close_id}]> KVGATE_WS?)"
        lines.append(f"KVGATE_TEXT: /{free}/")
    if r.close_id is not None or (r.state == "reasoning" and r.open_id is not None):
        lines.append("KVGATE_WS: /[ \\t\\r\\n]+/")
    if r.state == "reasoning":  # opened by the prompt, and maybe again by the output (R1 models do):
        # as text the free block takes it, as its own token it is allowed here; the splitter drops it
        again = "" if r.open_id is None else f"(KVGATE_WS? <[{r.open_id}]>)? "
        head = f"start: {again}{think} kvgate_answer"
    else:
        quoted = json.dumps(opening_text)
        opening = quoted if r.open_id is None else f"({quoted} | <[{r.open_id}]>)"
        head = f"start: kvgate_answer | {opening} {think} kvgate_answer"
    return "\n".join([head, *lines, _START.sub(r"\1kvgate_answer\2", text)])
