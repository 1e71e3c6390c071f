"""The OpenAPI document's part for `POST /v1/responses` (`kvgate.server.responses_route`): its request
ranges, its `response` object, and its event stream, whose entries are named events
(`event: response.created`, ...), unlike the chat stream's unnamed `data:` lines.

Split from `openapi.py`, which applies `RESPONSES_RANGES` and merges `SCHEMAS`.
"""

from __future__ import annotations

from kvgate.sampling import MAX_TOP_LOGPROBS

_NULL = {"type": "null"}
_INT = {"type": "integer"}
_STR = {"type": "string"}

# the Responses fields' own ranges, beside the sampling ranges it shares with the chat body (openapi.py's
# _RANGES): the request becomes a chat request (kvgate.server.responses_input), which enforces both
RESPONSES_RANGES = {
    "max_output_tokens": {"minimum": 1},
    "top_logprobs": {"minimum": 0, "maximum": MAX_TOP_LOGPROBS},
    "cache_salt": {"minLength": 1, "maxLength": 1024},  # vllm_extras.MAX_SALT_CHARS
}


_ITEM = {
    "type": "object",
    "required": ["type", "id", "status"],
    "properties": {
        "type": {"enum": ["message", "function_call"]},
        "id": _STR,
        "status": {"enum": ["completed", "incomplete"]},
    },
}

SCHEMAS = {
    "Response": {
        "type": "object",
        "required": ["id", "object", "created_at", "status", "model", "output", "usage"],
        "properties": {
            "id": {"type": "string", "pattern": "^resp_"},
            "object": {"const": "response"},
            "created_at": _INT,
            "status": {"enum": ["completed", "incomplete"]},
            "incomplete_details": {
                "anyOf": [_NULL, {"type": "object", "properties": {"reason": {"const": "max_output_tokens"}}}]
            },
            "model": _STR,
            "output": {"type": "array", "items": _ITEM},
            "usage": {
                "type": "object",
                "required": ["input_tokens", "output_tokens", "total_tokens"],
                "properties": {"input_tokens": _INT, "output_tokens": _INT, "total_tokens": _INT},
            },
            "store": {"type": "boolean"},
            "previous_response_id": {"anyOf": [_NULL, _STR]},
        },
    },
    "ResponseDeleted": {
        "type": "object",
        "required": ["id", "object", "deleted"],
        "properties": {"id": _STR, "object": {"const": "response"}, "deleted": {"const": True}},
    },
    "ResponseStreamEvent": {
        "type": "object",
        "required": ["event", "data"],
        "properties": {
            "event": {"type": "string", "pattern": "^(response\\.[a-z_.]+|error)$"},
            "data": {"type": "string", "minLength": 1, "description": "the event as JSON, with its type"},
        },
    },
}


def responses_route_docs(error) -> dict:
    """The statuses `POST /v1/responses` answers (`error(status)`: the shared error response)."""
    ok = {
        "description": "The response (JSON), or with stream=true its events (server-sent, named)",
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/Response"}},
            "text/event-stream": {"schema": {"$ref": "#/components/schemas/ResponseStreamEvent"}},
        },
        "headers": {
            "X-KVGate-Budget-Cap": {
                "required": False,
                "schema": _STR,
                "description": "present when max_output_tokens was capped by the budget",
            }
        },
    }
    return {"200": ok, **{str(s): error(s) for s in (400, 401, 404, 413, 429, 500, 503)}}


def stored_route_docs(error, path: str) -> dict:
    """`GET` (the response) and `DELETE` (its deletion) of `/v1/responses/{response_id}`; its
    `input_items` (a list object) and `cancel` (never a 200: kvgate runs no background response)."""
    if path.endswith("/input_items"):
        listing = {
            "type": "object",
            "required": ["object", "data", "has_more"],
            "properties": {
                "object": {"const": "list"},
                "data": {"type": "array"},
                "has_more": {"type": "boolean"},
            },
        }
        ok = {
            "description": "The input items, in pages",
            "content": {"application/json": {"schema": listing}},
        }
        return {"200": ok, "400": error(400), "401": error(401), "404": error(404)}
    if path.endswith("/cancel"):
        return {"400": error(400), "401": error(401), "404": error(404)}
    ref = {
        "anyOf": [{"$ref": "#/components/schemas/Response"}, {"$ref": "#/components/schemas/ResponseDeleted"}]
    }
    ok = {"description": "The stored response (GET), or that it was deleted (DELETE)"}
    ok["content"] = {"application/json": {"schema": ref}}
    return {"200": ok, "400": error(400), "401": error(401), "404": error(404)}
