"""`POST /v1/responses`: the Responses API over the chat path (see `responses_input`).

The body is read as a chat completion (`to_chat`), served by `serving.generate` exactly as a chat
request (admission before any header, the same 400/429/503 bodies), and the answer rewritten:
a JSON chat completion becomes a `response` object, a chat stream becomes the Responses event
stream. Errors keep kvgate's error body; their `param` is given in the Responses body's own names
(`input.2.content`, `max_output_tokens`, `text.format`).

`truncation: "auto"`: the oldest items are dropped until the conversation fits the context
(`responses_truncation`). A response is kept (`responses_store`) unless the request says `store: false`: `previous_response_id`
puts the kept conversation (its input items and output) before the new input, and `GET` / `DELETE
/v1/responses/{id}` read and drop it. A param in an earlier turn's items is named
`previous_response_id`; the client's own items keep their own indices.
"""

from __future__ import annotations

import json
import re
import time
from typing import Literal

from fastapi import Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvgate.server import protocol as P
from kvgate.server.bodies import parse_json, read_body
from kvgate.server.errors import APIError, invalid
from kvgate.server.responses_input import responses_message, responses_param, to_chat
from kvgate.server.responses_output import ResponseEvents, new_id, response_body, skeleton
from kvgate.server.responses_store import ResponseStore, page, shown
from kvgate.server.responses_truncation import fit
from kvgate.server.serving import generate
from kvgate.server.sse import HandledStream, chat_chunks
from kvgate.units import fmt_bytes

_KEPT_HEADERS = ("retry-after", "retry-after-ms", "x-kvgate-budget-cap")
_INDEX = re.compile(r"input[\[.](\d+)\]?")


async def responses(request: Request) -> Response:
    settings, store = request.app.state.settings, request.app.state.responses
    raw = await read_body(request, settings.max_body_bytes)
    body = parse_json(raw)
    body = referenced(body, store)
    body, conversation, earlier = continued(body, store)
    try:
        chat, origin = to_chat(body)
    except APIError as e:  # named by the merged input's indices: give the client's own
        if earlier and e.param:
            e.param = _own_index(e.param, earlier)
            e.message = _INDEX.sub(lambda m: _own_text(m, earlier), e.message)
        raise
    origin = [_own_index(o, earlier) for o in origin]
    if isinstance(body, dict) and body.get("truncation") == "auto":
        chat["messages"], origin = await fit(request, chat, origin)
    try:
        answer = await generate(request, P.ChatCompletionRequest, raw=json.dumps(chat).encode(), whole=True)
    except APIError as e:
        e.param, e.message = responses_param(e.param, origin), responses_message(e.message)
        raise
    headers = {k: v for k, v in answer.headers.items() if k.lower() in _KEPT_HEADERS}
    if answer.status_code != 200:  # an error body (or 499, no body): its param in Responses names
        if not answer.body:
            return answer
        err = json.loads(answer.body)
        if "param" in err.get("error", {}):
            err["error"]["param"] = responses_param(err["error"]["param"], origin)
        if isinstance(err.get("error", {}).get("message"), str):
            err["error"]["message"] = responses_message(err["error"]["message"])
        return JSONResponse(err, status_code=answer.status_code, headers=headers)
    keep = store.on and body.get("store") is not False
    skel = skeleton(body, new_id("resp_"), int(time.time()), settings.model_name)
    skel["store"], skel["previous_response_id"] = keep, body.get("previous_response_id")

    def kept(response: dict) -> None:  # a response larger than the whole store says store: false
        if keep and response["status"] in ("completed", "incomplete", "cancelled"):
            response["store"] = store.put(response, conversation)

    if isinstance(answer, StreamingResponse):
        headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        events = _events(answer.body_iterator, ResponseEvents(skel, kept))
        # the chat stream (answer) begins only after response.created and .in_progress
        return HandledStream(
            events, answer.handles, answer.on_result, began=lambda: answer.began, headers=headers
        )
    response = response_body(json.loads(answer.body), skel)
    kept(response)
    return JSONResponse(response, headers=headers)


def referenced(body, store: ResponseStore):
    """The body with each `item_reference` input item replaced by the kept item it names (an input or
    output item of a kept response); a 400 naming the reference when no such item is kept."""
    items = body.get("input") if isinstance(body, dict) else None
    if not isinstance(items, list):
        return body
    refs = {
        i: item.get("id")
        for i, item in enumerate(items)
        if isinstance(item, dict) and item.get("type") == "item_reference"
    }
    if not refs:
        return body
    kept = store.items({r for r in refs.values() if isinstance(r, str)})  # each holder decoded once
    for i, item_id in refs.items():
        if not isinstance(item_id, str) or item_id not in kept:  # an id of any other type names nothing
            raise APIError(400, _unreferenced(item_id, store), "item_not_found", param=f"input.{i}.id")
    return {**body, "input": [kept[refs[i]] if i in refs else item for i, item in enumerate(items)]}


def _unreferenced(item_id, store: ResponseStore) -> str:
    named = shown(item_id) if isinstance(item_id, str) else "(no id)"
    if not store.on:
        return (
            f"item_reference {named} cannot be resolved: this server keeps no responses "
            "(--responses-store 0). Send the item itself instead."
        )
    return (
        f"item_reference {named} names no item this server keeps: items are kept with their response "
        f"(unless it said store: false) while it stays in the {fmt_bytes(store.limit)} --responses-store "
        f"({store.evicted} evicted so far; a restart keeps none). Send the item itself instead (the AI "
        "SDK's openai provider sends references while it stores responses: pass providerOptions.openai.store "
        "false, or use openai.chat())."
    )


def continued(body, store: ResponseStore) -> tuple:
    """(the body with `previous_response_id`'s conversation put before its input, the whole
    conversation as input items, how many of them came from earlier turns). A 400 naming the field
    when that response is not stored. `instructions` are not carried over (OpenAI's rule)."""
    if not isinstance(body, dict):
        return body, [], 0
    mine = body.get("input")
    mine = [{"type": "message", "role": "user", "content": mine}] if isinstance(mine, str) else mine
    prev = body.get("previous_response_id")
    if prev is None:
        return body, mine if isinstance(mine, list) else [], 0
    if mine is None:  # optional when continuing (OpenAI's schema): the new turn adds no items
        mine = []
    if not isinstance(prev, str):
        raise invalid("previous_response_id must be a string: a response id", param="previous_response_id")
    stored = store.get(prev)
    if stored is None:
        raise APIError(
            400,
            store.missing(prev, chaining=True),
            "previous_response_not_found",
            param="previous_response_id",
        )
    response, before = stored
    earlier = before + response["output"]
    conversation = earlier + (mine if isinstance(mine, list) else [])
    return {**body, "input": conversation if isinstance(mine, list) else mine}, conversation, len(earlier)


def _own_index(where: str, earlier: int) -> str:
    """`input.N` of the merged input as the client's own index; the earlier turns' items as
    `previous_response_id`."""
    if not earlier or not where.startswith("input."):
        return where
    head, _, rest = where[6:].partition(".")
    n = _own_number(head, earlier)
    return "previous_response_id" if n is None else f"input.{n}" + (f".{rest}" if rest else "")


def _own_text(m: re.Match, earlier: int) -> str:
    """`_INDEX`'s match in a message (`input[N]` or `input.N`) with the client's own N."""
    n = _own_number(m.group(1), earlier)
    return "previous_response_id's conversation" if n is None else m.group(0).replace(m.group(1), str(n))


def _own_number(index: str, earlier: int) -> int | None:
    """A merged input index as the client's own, or None for an earlier turn's item."""
    n = int(index) - earlier
    return None if n < 0 else n


def _not_kept(store: ResponseStore, rid: str) -> APIError:
    return APIError(404, store.missing(rid), "response_not_found")


async def stored_response(request: Request, response_id: str) -> Response:
    """GET: the kept response; DELETE: drop it. One route for both methods, so a 405 on the path
    lists both in its Allow header."""
    store = request.app.state.responses
    if request.query_params.get("stream", "false").lower() not in ("false", "0"):
        raise invalid(
            "stream: replaying a kept response as events is not supported; GET it without stream",
            param="stream",
        )
    if request.method == "DELETE":
        if not store.delete(response_id):
            raise _not_kept(store, response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})
    response = store.response(response_id)
    if response is None:
        raise _not_kept(store, response_id)
    return JSONResponse(response)


async def input_items(
    request: Request,
    response_id: str,
    after: str | None = None,
    limit: int = Query(20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
    include: list[str] | None = Query(None),  # accepted: the items carry all they have
) -> Response:
    """The kept response's input items (earlier turns' included), newest first by default, in pages."""
    store = request.app.state.responses
    stored = store.get(response_id)
    if stored is None:
        raise _not_kept(store, response_id)
    listing = page(stored[1], after, limit, order)
    if listing is None:
        raise invalid(
            f"after {shown(after)} is not an input item of response {shown(response_id)}", param="after"
        )
    return JSONResponse(listing)


async def cancel_response(request: Request, response_id: str) -> Response:
    """OpenAI cancels background responses only; kvgate runs none (`background` is refused)."""
    store = request.app.state.responses
    if response_id not in store:
        raise _not_kept(store, response_id)
    raise invalid(
        f"response {shown(response_id)} is not a background response: only those can be cancelled, and kvgate "
        "runs none (a client cancels a running response by closing its connection)"
    )


async def _events(chat_stream, shaper: ResponseEvents):
    """The chat stream's SSE lines in, the Responses events out; closing it closes the chat stream
    (a client that leaves cancels the generation, as on the chat endpoint)."""
    try:
        for e in shaper.start():
            yield e
        async for chunk in chat_chunks(chat_stream):
            for e in shaper.chunk(chunk):
                yield e
        for e in shaper.end():
            yield e
    finally:
        shaper.abandon()  # nothing when it ended; a client that left keeps what it was sent
        await chat_stream.aclose()
