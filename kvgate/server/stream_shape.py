"""The chunks of one stream, per event: text, logprobs, tool-call deltas, echo, and running usage.

`StreamShaper` turns a choice's engine events into OpenAI chunk objects (`kvgate.server.sse` frames
and orders them). Without features it gives exactly the plain stream: a role chunk per chat choice, a
chunk per token that released text, the held-back tail, a finish chunk. With features:
- logprobs: a chunk for every token (text or not), carrying that token's logprobs;
- reasoning (a thinking model's chat answer, `kvgate.server.reasoning`): each choice's text goes through
  a `ReasoningSplitter`; the think block is sent as `delta.reasoning_content` (and `delta.reasoning`), the
  rest as content, the tags in neither; a token's logprobs and ids ride as with tools, except that a
  token the reasoning took (usage's `reasoning_tokens`) has them on a reasoning delta (an empty one
  where it added no reasoning text: a tag's token), so a reader can tell the answer's apart;
- tools: each choice's text (its content, with reasoning) goes through a `ToolCallParser` (a token's logprobs ride on the first chunk
  its text makes, or on one of their own while the parser holds the text); content is sent as content,
  a call as `delta.tool_calls` (first its index, id, type and name with empty arguments, then argument pieces),
  and a choice that called tools finishes with `tool_calls`; cut short by max_tokens, with `length`
  after the argument text so far: the same calls and arguments as the whole response's;
- echo (completions): the prompt's text is the first chunk of each choice;
- `stream_options.continuous_usage_stats`: every chunk carries the usage so far (vLLM's extension);
- `stream_options.include_obfuscation` (OpenAI's, off unless asked for, as in vLLM's streams): every
  chunk carries an `obfuscation` string of random characters that pads its JSON to a multiple of
  `OBFUSCATION_BLOCK` bytes, so a TLS observer who sees only record sizes cannot read token lengths.
"""

from __future__ import annotations

import json
import secrets
import string

from kvgate.request import Result, Token
from kvgate.server import logprobs as L
from kvgate.server import tool_parser as TP
from kvgate.server.mistral_tools import parser_for
from kvgate.server.responses import ChunkMaker, finish_reason, named_stop_ids, stop_reason
from kvgate.server.vllm_extras import prompt_ids_on

OBFUSCATION_BLOCK = 64  # bytes: a chunk's JSON is padded to a multiple of this
_PAD_CHARS = string.ascii_letters + string.digits


class StreamShaper:
    def __init__(self, chunks: ChunkMaker, prepared=None, tok=None, handles=()):
        self.chunks = chunks
        self.p = prepared
        self.f = prepared.features if prepared is not None else None
        self.tok = tok
        self.handles = list(handles)
        opts = prepared.request.stream_options if prepared is not None else None
        self.continuous = bool(opts and opts.continuous_usage_stats)
        self.obfuscate = bool(opts and opts.include_obfuscation)
        self.generated = 0
        self.parsers: dict[int, TP.ToolCallParser] = {}
        self.think = prepared.reasoning if prepared is not None else None  # kvgate.server.reasoning
        self.splitters: dict = {}  # per choice, its ReasoningSplitter
        self.offsets: dict[int, int] = {}  # characters sent so far per choice (completion text_offset)
        self.held: dict[int, list[int]] = {}  # per choice, the ids since text was last sent
        # vLLM's return_token_ids: each chunk carries its new ids, a choice's first its prompt's too
        self.want_ids = bool(prepared is not None and getattr(prepared.request, "return_token_ids", False))
        self.ids_sent: dict[int, int] = {}
        self.prompt_sent: set[int] = set()

    # ---- events -> chunks -----------------------------------------------------------------------
    def start(self, n: int) -> list[dict]:
        out = []
        for i in range(n):
            if self.chunks.kind == "chat":  # with tools no empty content: a call's message has none
                tools = self.f is not None and self.f.tools is not None
                out.append(self.chunks.choice(i, None if tools else "", role=True))
            elif self.f is not None and self.f.echo:
                text = L.echo_text(self.p, self.tok, i)
                self.offsets[i] = len(text)
                out.append(self.chunks.choice(i, text))
        return [self._dress(c) for c in out]

    def token(self, i: int, ev: Token) -> list[dict]:
        self.generated += 1
        lp = ev.logprobs if self.f is not None and self.f.logprobs is not None else None
        if self.think is not None or (self.f is not None and self.f.tools is not None):
            spent = self._reasoning_tokens(i)
            out = self._split(i, ev.text, token=True)
            took = self._reasoning_tokens(i) > spent and self.think.include
            if lp is not None and took and not self._is_reasoning(out[:1]):
                # a token the reasoning took (a tag's, or one that ends it and starts the answer): its
                # logprobs on a reasoning delta, "" if it added none, so they are not read as the
                # answer's (the Responses API's output_text: `ResponseEvents.chunk`)
                out.insert(0, self.chunks.choice(i, None))
                out[0]["choices"][0]["delta"].update(self.think.delta(""))
            if lp is not None or self.want_ids:  # on the token's first chunk, or one of its own
                out = out or [self.chunks.choice(i, None)]
            if lp is not None:
                out[0]["choices"][0]["logprobs"] = self._logprobs(i, lp)
            self._new_ids(i, out, [ev.token_id])
            return [self._dress(c) for c in out]
        if not ev.text and lp is None and not self.want_ids:
            return []
        chunk = self.chunks.choice(i, ev.text)
        self._new_ids(i, [chunk], [ev.token_id])
        held = self.held.setdefault(i, [])
        held.append(ev.token_id)
        if lp is not None:
            chunk["choices"][0]["logprobs"] = self._logprobs(i, lp, ev.text, ev.after_text)
        if ev.text:
            held.clear()
        self.offsets[i] = self.offsets.get(i, 0) + len(ev.text)
        return [self._dress(chunk)]

    def tail(self, i: int, text: str) -> list[dict]:
        if self.think is not None or (self.f is not None and self.f.tools is not None):
            return [self._dress(c) for c in self._split(i, text)]
        return [self._dress(self.chunks.choice(i, text))] if text else []

    def finish(self, i: int, result: Result) -> list[dict]:
        out = [self._dress(c) for c in self._split(i, "", end=True)] if self.think is not None else []
        reason = result.finish_reason
        if self.f is not None and self.f.tools is not None:
            parser = self._parser(i)
            out += self._tool_events(i, parser.end(cut=not TP.model_ended(result)))
            reason = TP.finish_reason(reason, parser.calls, parser.after_calls)
        stop_ids = named_stop_ids(self.p.request, self.tok) if self.p is not None else ()
        end = self.chunks.finish(i, reason, stop_reason(result, stop_ids))
        self._new_ids(i, [end], result.token_ids[self.ids_sent.get(i, 0) :])  # a stop token not yet sent
        return out + [self._dress(end)]

    def usage(self, results: list[Result]) -> dict:
        """The closing usage chunk: with reasoning, its tokens (`completion_tokens_details`)."""
        spent = sum(s.tokens for s in self.splitters.values()) if self.think is not None else None
        return self.chunks.usage(results, spent)

    # ---- helpers --------------------------------------------------------------------------------
    def _split(self, i: int, text: str, token: bool = False, end: bool = False) -> list[dict]:
        """A choice's new text as chunks: reasoning deltas (`kvgate.server.reasoning`), then the content,
        through the tool-call parser when the request has tools."""
        pieces = [("content", text)]
        if self.think is not None:
            s = self.splitters.setdefault(i, self.think.splitter())
            pieces = s.end() if end else s.push_token(text) if token else s.push(text)
        out = []
        for kind, piece in pieces:
            if kind == "reasoning":
                if self.think.include:
                    out.append(self.chunks.choice(i, None))
                    out[-1]["choices"][0]["delta"].update(self.think.delta(piece))
            elif self.f is not None and self.f.tools is not None:
                out += self._tool_chunks(i, self._parser(i).push(piece))
            elif piece:
                out.append(self.chunks.choice(i, piece))
        return out

    def _reasoning_tokens(self, i: int) -> int:
        s = self.splitters.get(i) if self.think is not None else None
        return s.tokens if s is not None else 0

    @staticmethod
    def _is_reasoning(chunks: list[dict]) -> bool:
        return bool(chunks) and "reasoning_content" in chunks[0]["choices"][0]["delta"]

    def _parser(self, i: int):
        return self.parsers.setdefault(i, parser_for(self.f.tools))

    def _tool_events(self, i: int, events) -> list[dict]:
        return [self._dress(c) for c in self._tool_chunks(i, events)]

    def _tool_chunks(self, i: int, events) -> list[dict]:
        out = []
        for ev in events:
            if ev[0] == "content":
                out.append(self.chunks.choice(i, ev[1]))
                continue
            if ev[0] == "call":
                c = ev[1]
                call = {
                    "index": c.index,
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": ""},
                }
            else:
                call = {"index": ev[1], "function": {"arguments": ev[2]}}
            chunk = self.chunks.choice(i, None)
            chunk["choices"][0]["delta"]["tool_calls"] = [call]
            out.append(chunk)
        return out

    def _logprobs(self, i: int, lp, text: str = "", after_text: bool = False) -> dict:
        """`after_text`: a reported stop token, placed after the tail its event carries (at the text's
        end, as the whole answer places it), not inside it."""
        if self.chunks.kind == "chat":
            return L.chat_logprobs(self.tok, [lp])
        at = self.offsets.get(i, 0) + len(text) if after_text else None
        if at is None:
            at = L.streamed_offset(self.tok, self.held[i], self.offsets.get(i, 0), text)
        return L.completion_logprobs(self.tok, [lp], at)

    def _new_ids(self, i: int, chunks: list[dict], ids: list[int]) -> None:
        """`return_token_ids`: the first of `chunks` carries `ids`, the choice's ids not yet sent."""
        if self.want_ids and chunks:
            chunks[0]["choices"][0]["token_ids"] = list(ids)
            self.ids_sent[i] = self.ids_sent.get(i, 0) + len(ids)

    def _dress(self, chunk: dict) -> dict:
        """The per-chunk extras the client asked for: token ids (`return_token_ids`), running usage,
        then the obfuscation padding."""
        if self.want_ids and chunk["choices"]:
            c = chunk["choices"][0]
            c.setdefault("token_ids", [])
            i = c["index"]
            if i not in self.prompt_sent:  # a choice's first chunk: its prompt's ids
                self.prompt_sent.add(i)
                ids = list(self.p.generations[i // self.p.n].prompt_ids)
                if self.chunks.kind == "chat":
                    chunk["prompt_token_ids"] = ids
                elif prompt_ids_on(self.p, i):
                    c["prompt_token_ids"] = ids
        if self.continuous:
            n = max(1, self.chunks.n if hasattr(self.chunks, "n") else 1)
            prompt = sum(getattr(h.admission, "prompt_tokens", 0) for h in self.handles[::n])
            cached = sum(getattr(h.admission, "cached_tokens", 0) for h in self.handles[::n])
            chunk["usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": self.generated,
                "total_tokens": prompt + self.generated,
                "prompt_tokens_details": {"cached_tokens": cached},  # as the final usage chunk has it
            }
        if self.obfuscate:
            chunk["obfuscation"] = obfuscation(chunk)
        return chunk


def obfuscation(chunk: dict) -> str:
    """Random characters that bring `chunk`'s JSON (as `kvgate.server.sse.event` writes it, with this
    field added) to the next multiple of OBFUSCATION_BLOCK bytes: at least one character."""
    size = len(json.dumps(chunk, ensure_ascii=False).encode()) + len(', "obfuscation": ""')
    k = (-size) % OBFUSCATION_BLOCK or OBFUSCATION_BLOCK
    return "".join(secrets.choice(_PAD_CHARS) for _ in range(k))


__all__ = ["StreamShaper", "finish_reason"]
