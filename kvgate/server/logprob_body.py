"""A whole (non-streamed) answer with logprobs, written while it is sent.

The body's logprobs are made into JSON from the engine's packed `TokenLogprobs` a slice of tokens at a
time, so what the response holds is those (reserved at admission, `kvgate.core.logprob_budget`) and one
slice's text. Before session 37 the whole body was built as dicts, then as text, then as bytes: ~8 KB
of dicts and ~3.5 KB of text and bytes a token at top_logprobs 20 (tracemalloc), none of it planned.

The bytes are exactly what `JSONResponse` gives for the same body (tests/test_logprob_budget.py
compares them): the body is laid out with a unique marker where each choice's logprobs go, and each
marker is replaced, as it is reached, by that choice's logprobs written in `kvgate.server.logprobs`'
two shapes. Sent chunked (no Content-Length), as any streamed body; the work runs in Starlette's
thread pool, one slice per step, off the event loop.
"""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import Callable, Iterable, Iterator

from fastapi.responses import StreamingResponse

from kvgate.server import logprobs as L

SLICE = 64  # tokens written per step
# a Responses body is built from the chat body's dicts (json.loads of its text, then its own dicts and
# text; a stream's events keep theirs for the final event): per position, 405 + 386 B a top entry for
# one copy of the chat entry's dicts (tracemalloc, SmolLM2's vocabulary), rounded up; held at most
# 3 times over (the review measured 16.5 KB a position whole and 24.9 KB streamed at top 20, where
# one copy is 8.4 KB), reserved as 4
DICT_BYTES, DICT_TOP_BYTES, DICT_COPIES = 448, 400, 4


def dict_hold_bytes(k: int | None) -> int:
    """What a caller that builds dicts from a position's logprobs holds a position (`held`)."""
    return 0 if k is None else DICT_COPIES * (DICT_BYTES + DICT_TOP_BYTES * k)


def dumps(value) -> str:
    """As Starlette's `JSONResponse.render` writes JSON (its bytes are this text's UTF-8)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


def _array(items: Iterable, write: Callable[[object], str], lead: list = ()) -> Iterator[str]:
    """A JSON array of `lead` (values) then `items` (each written by `write`), a slice at a time."""
    yield "["
    sep = ""
    if lead:
        yield ",".join(dumps(v) for v in lead)
        sep = ","
    it = iter(items)
    while piece := list(itertools.islice(it, SLICE)):
        yield sep + ",".join(write(x) for x in piece)
        sep = ","
    yield "]"


def chat_json(tok, lps: list) -> Iterator[str]:
    """`logprobs.chat_logprobs` as text."""
    yield '{"content":'
    yield from _array(lps, lambda lp: dumps(L.chat_entry(tok, lp)))
    yield ',"refusal":null}'


def completion_json(
    tok, lps: Callable[[], Iterable], offsets: Callable[[], list[int]], first: int | None = None
) -> Iterator[str]:
    """`logprobs.completion_logprobs` (or, with an echoed prompt's `first` token, `echoed_logprobs`) as
    text; `lps()` gives the positions again for each column, `offsets()` their text offsets."""
    lead = {}
    if first is not None:  # the echoed prompt's first token: no log-probability (null)
        lead = {
            "tokens": [L.token_name(tok, first)],
            "token_logprobs": [None],
            "top_logprobs": [None],
        }
    columns = {
        "tokens": lambda lp: dumps(L.token_name(tok, lp.token_id)),
        "token_logprobs": lambda lp: dumps(L.json_logprob(lp.logprob)),
        "top_logprobs": lambda lp: dumps(L.completion_top(tok, lp)),
    }
    sep = "{"
    for name, write in columns.items():
        yield f'{sep}"{name}":'
        yield from _array(lps(), write, lead.get(name, []))
        sep = ","
    yield ',"text_offset":' + dumps(offsets()) + "}"


def choice_writer(prepared, tok, i: int, choice: dict, lps: list, scores: list | None, prefix: str):
    """The writer of choice `i`'s logprobs (as `logprobs.decorate_body` builds them): a function that
    gives the text pieces."""
    if prepared.kind == "chat":
        return lambda: chat_json(tok, lps)
    ids = prepared.generations[i // prepared.n].prompt_ids
    end = len(choice["text"])
    if scores is not None:
        scored = scores[i // prepared.n]

        def offsets():
            after = L.text_offsets(tok, [lp.token_id for lp in lps], len(prefix), ids, end)
            return L.prompt_offsets(tok, ids, prefix) + after

        return lambda: completion_json(tok, lambda: itertools.chain(scored, lps), offsets, first=ids[0])
    return lambda: completion_json(
        tok, lambda: lps, lambda: L.text_offsets(tok, [lp.token_id for lp in lps], 0, ids, end)
    )


def logprob_response(
    body: dict, writers: dict[int, Callable[[], Iterator[str]]], headers: dict
) -> StreamingResponse:
    """`body` sent with choice i's `logprobs` written by `writers[i]()` as the body reaches it."""
    mark = f"\x00kvgate-logprobs-{uuid.uuid4().hex}-"
    for i, choice in enumerate(body["choices"]):
        if i in writers:
            choice["logprobs"] = f"{mark}{i}"
    text = dumps(body)

    def parts() -> Iterator[bytes]:
        rest = text
        for i in sorted(writers):  # the choices in the order the body lists them
            head, rest = rest.split(dumps(f"{mark}{i}"), 1)
            yield head.encode()
            for piece in writers[i]():
                yield piece.encode()
        yield rest.encode()

    return StreamingResponse(parts(), media_type="application/json", headers=headers)
