"""Server-sent events for one generation: OpenAI's chunk stream over one or more engine handles.

Order: a role chunk per choice (chat), sent with the first engine event (after the prompt's prefill, as
vLLM sends it: benchmark clients such as `vllm bench serve` time TTFT from the first chunk with
`choices`, and a role chunk at admission read as a TTFT of ~0, QA pass 8), then text chunks as tokens release text, a finish chunk per
choice, an optional usage chunk, then `data: [DONE]` (what each chunk holds: `stream_shape.py`). A choice that fails inside the engine ends the
stream with one error event (the stable 500 body) and `[DONE]`, and cancels the other choices. When the
stream ends early for any reason (the client left), every handle still running is cancelled, and its
final result is still counted when it comes (`observe_after_cancel`).
"""

from __future__ import annotations

import asyncio
import json
import logging

from starlette.responses import StreamingResponse

from kvgate.request import Finished, Token
from kvgate.server.auth import REQUEST_ID
from kvgate.server.errors import APIError
from kvgate.server.responses import ChunkMaker
from kvgate.server.stream_shape import StreamShaper

log = logging.getLogger("kvgate.server")

DONE = "data: [DONE]\n\n"
ENGINE_ERROR = "generation failed inside the engine; the details are in the server log"
NO_TOKEN_LEFT = "NoTokenLeft: "  # kvgate.sampling.NoTokenLeft, as a failed row's error names it


def failure_error(result, request) -> APIError:
    """What a failed choice is answered with: a conflict of the request's own constraints
    (`NoTokenLeft`: allowed_token_ids or bad_words against its grammar or min_tokens) is a 400 that
    says so; anything else is the engine's 500, whose details stay in the log."""
    err = result.error or ""
    if err.startswith(NO_TOKEN_LEFT):
        param = "allowed_token_ids" if request.sampling.allowed_token_ids is not None else "bad_words"
        return APIError(400, err[len(NO_TOKEN_LEFT) :], "no_token_left", param=param)
    return APIError(500, ENGINE_ERROR, "engine_error")


async def chat_chunks(chat_stream):
    """The chunk objects of a chat stream's SSE body (`[DONE]` left out): what the Responses and
    Messages APIs rewrite into their own events."""
    async for piece in chat_stream:
        text = piece.decode() if isinstance(piece, bytes) else piece
        for line in text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def event(obj: dict) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


async def sse_stream(chunks: ChunkMaker, handles, include_usage: bool, on_result, shaper=None):
    """`on_result(result)` is called once per finished choice (metrics). `shaper` turns events into
    chunks (`StreamShaper`: logprobs, tool calls, echo, running usage); the default is plain text."""
    finished: dict[int, object] = {}
    shape = shaper or StreamShaper(chunks)
    started = False
    try:
        async for i, ev in merged_events(handles):
            if not started:
                started = True
                for c in shape.start(len(handles)):
                    yield event(c)
            if isinstance(ev, Token):
                for c in shape.token(i, ev):
                    yield event(c)
                continue
            if not isinstance(ev, Finished):
                continue
            finished[i] = ev.result
            on_result(ev.result)
            if ev.tail:
                for c in shape.tail(i, ev.tail):
                    yield event(c)
            if ev.result.finish_reason == "error":
                log.error("request %s: generation failed mid-stream: %s", REQUEST_ID.get(), ev.result.error)
                yield event(failure_error(ev.result, handles[i].request).body())
                for h in handles:
                    h.cancel()
                yield DONE
                return
            for c in shape.finish(i, ev.result):
                yield event(c)
        if include_usage:
            yield event(shape.usage([finished[i] for i in sorted(finished)]))
        yield DONE
    finally:
        if len(finished) < len(handles):  # the client left (or the stream broke): stop the work
            for h in handles:
                h.cancel()
            observe_after_cancel([h for i, h in enumerate(handles) if i not in finished], on_result)


class HandledStream(StreamingResponse):
    """A stream response that stops its requests when it ends before its body began: a client gone
    between admission and the first byte makes Starlette cancel the body before the generator's first
    step, so `sse_stream`'s own cleanup never ran, and the requests generated to max_tokens for nobody,
    holding their rows and blocks (QA pass 9: 4 of 16 timed tries)."""

    def __init__(self, content, handles, on_result, began=None, **kw):
        """`began`: whether the stream that cleans the handles up has begun, where that is another
        (the Responses stream wraps the chat one, and writes two events before it starts it)."""
        self.handles, self.on_result, self.began = handles, on_result, False
        self._began = began or (lambda: self.began)

        async def body():
            self.began = True
            async for piece in content:
                yield piece

        super().__init__(body(), media_type="text/event-stream", **kw)

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._began():
                for h in self.handles:
                    h.cancel()
                observe_after_cancel(self.handles, self.on_result)


_observers: set[asyncio.Task] = set()  # kept referenced until done
CANCEL_OBSERVE_S = 60.0  # a cancelled choice ends at the worker's next tick; this bounds a lost event


def observe_after_cancel(handles, on_result) -> None:
    """The client left: its cancelled choices still end with a result whose tokens were generated. Count
    them (`on_result`: metrics and the console) when they arrive, off the request's path, so the
    console's tokens/s agrees with `kvgate_generation_tokens_total`."""
    if not handles:
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # no loop (a generator closed outside one): nothing to wait on
        return

    async def collect(h):
        async for ev in h.aevents():
            if isinstance(ev, Finished):
                on_result(ev.result)

    async def observe():
        for h in handles:
            try:
                await asyncio.wait_for(collect(h), CANCEL_OBSERVE_S)
            except Exception:  # a lost or late final event: that one is not counted
                log.debug("a cancelled choice's result was not observed", exc_info=True)

    task = loop.create_task(observe())
    _observers.add(task)
    task.add_done_callback(_observers.discard)


async def merged_events(handles):
    """(choice index, event) from every handle, in arrival order, until each has finished."""
    if len(handles) == 1:
        async for ev in handles[0].aevents():
            yield 0, ev
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, h):
        async for ev in h.aevents():
            await q.put((i, ev))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        done = 0
        while done < len(handles):
            i, ev = await q.get()
            yield i, ev
            if isinstance(ev, Finished):
                done += 1
    finally:
        for t in tasks:
            t.cancel()
