"""`POST /v1/responses`: the Responses API over the chat path (see `responses_input`).

The body is read as a chat completion (`to_chat`), served by `serving.generate` exactly as a chat
request (admission before any header, the same 400/429/503 bodies), and the answer rewritten:
a JSON chat completion becomes a `response` object, a chat stream becomes the Responses event
stream. Errors keep kvgate's error body; their `param` is given in the Responses body's own names
(`input.2.content`, `max_output_tokens`, `text.format`).
"""

from __future__ import annotations

import json
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvgate.server import protocol as P
from kvgate.server.bodies import parse_json, read_body
from kvgate.server.errors import APIError
from kvgate.server.responses_input import responses_param, to_chat
from kvgate.server.responses_output import ResponseEvents, new_id, response_body, skeleton
from kvgate.server.serving import generate

_KEPT_HEADERS = ("retry-after", "x-kvgate-budget-cap")


async def responses(request: Request) -> Response:
    settings = request.app.state.settings
    raw = await read_body(request, settings.max_body_bytes)
    body = parse_json(raw)
    chat, origin = to_chat(body)
    try:
        answer = await generate(request, P.ChatCompletionRequest, raw=json.dumps(chat).encode())
    except APIError as e:
        e.param = responses_param(e.param, origin)
        raise
    headers = {k: v for k, v in answer.headers.items() if k.lower() in _KEPT_HEADERS}
    if answer.status_code != 200:  # an error body (or 499, no body): its param in Responses names
        if not answer.body:
            return answer
        err = json.loads(answer.body)
        if "param" in err.get("error", {}):
            err["error"]["param"] = responses_param(err["error"]["param"], origin)
        return JSONResponse(err, status_code=answer.status_code, headers=headers)
    skel = skeleton(body, new_id("resp_"), int(time.time()), settings.model_name)
    if isinstance(answer, StreamingResponse):
        headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        events = _events(answer.body_iterator, ResponseEvents(skel))
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    return JSONResponse(response_body(json.loads(answer.body), skel), headers=headers)


async def _events(chat_stream, shaper: ResponseEvents):
    """The chat stream's SSE lines in, the Responses events out; closing it closes the chat stream
    (a client that leaves cancels the generation, as on the chat endpoint)."""
    try:
        for e in shaper.start():
            yield e
        async for piece in chat_stream:
            text = piece.decode() if isinstance(piece, bytes) else piece
            for line in text.splitlines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for e in shaper.chunk(json.loads(line[6:])):
                    yield e
        for e in shaper.end():
            yield e
    finally:
        await chat_stream.aclose()
