"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API over the chat path.

The body is read as a chat completion (`messages_input.to_chat`), served by `serving.generate` exactly
as a chat request (admission before any header, the same refusals with their numbers), and the answer
rewritten (`messages_output`). Every error, the chat path's and this route's own, is answered in
Anthropic's error body, its `param` in the Messages body's names.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvgate.server import protocol as P
from kvgate.server.bodies import parse_json, read_body
from kvgate.server.context import check_model, ready_engine
from kvgate.server.errors import APIError
from kvgate.server.messages_input import messages_message, messages_param, to_chat
from kvgate.server.messages_output import MessageEvents, error_body, message_body, new_id, skeleton
from kvgate.server.prepare import chat_ids, plan_tools, render_chat
from kvgate.server.serving import generate
from kvgate.server.sse import HandledStream, chat_chunks

_KEPT_HEADERS = ("retry-after", "retry-after-ms", "x-kvgate-budget-cap")


async def messages(request: Request) -> Response:
    origin: list[str] | None = None  # until the body is read as a chat body, a param is the body's own
    try:
        settings = request.app.state.settings
        raw = await read_body(request, settings.max_body_bytes)
        body = parse_json(raw)
        chat, origin = to_chat(body)
        warm = body.get("max_tokens") == 0  # a cache warm-up: the prompt computed, nothing answered
        answer = await generate(request, P.ChatCompletionRequest, raw=json.dumps(chat).encode(), whole=True)
    except APIError as e:
        return _error(e.status, e.body()["error"], origin, e.response().headers)
    headers = {k: v for k, v in answer.headers.items() if k.lower() in _KEPT_HEADERS}
    if answer.status_code != 200:  # a refusal's body (or 499, none)
        if not answer.body:
            return answer
        return _error(answer.status_code, json.loads(answer.body)["error"], origin, headers)
    skel = skeleton(new_id(), settings.model_name)
    if isinstance(answer, StreamingResponse):
        headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        events = _events(answer.body_iterator, MessageEvents(skel, warm))
        return HandledStream(
            events, answer.handles, answer.on_result, began=lambda: answer.began, headers=headers
        )
    return JSONResponse(message_body(json.loads(answer.body), skel, warm), headers=headers)


async def count_tokens(request: Request) -> Response:
    """The prompt a Messages request with this conversation (system, turns, tools) would have:
    `{"input_tokens": N}`, counted by the same template and tokenizer as the request itself."""
    origin: list[str] | None = None
    try:
        state = request.app.state
        eng = ready_engine(state)
        raw = await read_body(request, state.settings.max_body_bytes)
        chat, origin = to_chat(parse_json(raw), count=True)
        check_model(state.settings, chat["model"])
        req = P.parse(P.ChatCompletionRequest, chat)
        ids = await asyncio.to_thread(lambda: chat_ids(eng, *render_chat(eng, req, plan_tools(req)), req))
    except APIError as e:
        return _error(e.status, e.body()["error"], origin, e.response().headers)
    return JSONResponse({"input_tokens": len(ids)})


def _error(status: int, err: dict, origin: list[str] | None, headers) -> JSONResponse:
    err = dict(err)
    if err.get("param") is not None and origin is not None:
        err["param"] = messages_param(err["param"], origin)
    if isinstance(err.get("message"), str):
        err["message"] = messages_message(err["message"])
    kept = {k: v for k, v in dict(headers).items() if k.lower() in _KEPT_HEADERS}
    return JSONResponse(error_body(status, err), status_code=status, headers=kept)


async def _events(chat_stream, shaper: MessageEvents):
    """The chat stream's SSE lines in, Anthropic's events out; closing it closes the chat stream (a
    client that leaves cancels the generation, as on the chat endpoint)."""
    try:
        async for chunk in chat_chunks(chat_stream):
            for e in shaper.chunk(chunk):
                yield e
        for e in shaper.end():
            yield e
    finally:
        await chat_stream.aclose()
