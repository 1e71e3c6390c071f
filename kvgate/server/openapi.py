"""The OpenAPI document, with the request bodies our handlers parse themselves and every response.

Handlers read and validate bodies by hand (to answer 413/400 in our own error shape instead of
FastAPI's 422), so FastAPI cannot see their schemas; this adds them, for clients and for fuzzing.

The document is meant to be exact, and tests/test_fuzz.py holds it to that with schemathesis:
- request schemas carry the ranges the server enforces (protocol.py and sampling.py) and forbid the
  fields it refuses, so a body that violates the document is refused and one the server refuses
  for its shape violates the document;
- every status a route can answer is declared, with the one error body shape (`errors.py`), its
  `Retry-After` header where the server always sends one, and SSE as `text/event-stream`.
What no schema can express (a prompt too long for the context, an unknown model name, a token id past
the vocabulary before the model is loaded) is a documented 400/404.
"""

from __future__ import annotations

import copy

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from kvgate.server.openapi_fields import VLLM_CHOICE, tighten_features, tighten_message
from kvgate.server.openapi_responses import RESPONSES_RANGES, SCHEMAS, responses_route_docs, stored_route_docs

_BODIES = {
    "/v1/chat/completions": "ChatCompletionRequest",
    "/v1/completions": "CompletionRequest",
    "/v1/tokenize": "TokenizeRequest",
    "/v1/detokenize": "DetokenizeRequest",
    "/v1/responses": "ResponsesRequest",
}

_NULL = {"type": "null"}
_INT = {"type": "integer"}
_STR = {"type": "string"}

# Ranges as enforced by kvgate.sampling.SamplingParams.validate and protocol.check_common.
_RANGES = {
    "max_tokens": {"minimum": 1},
    "max_completion_tokens": {"minimum": 1},
    "temperature": {"minimum": 0, "maximum": 2},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": -1},
    "min_p": {"minimum": 0, "maximum": 1},
    "repetition_penalty": {"exclusiveMinimum": 0, "maximum": 2},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "seed": {"minimum": -(2**63), "maximum": 2**64 - 1},
}

_ERROR_TYPES = sorted(
    {
        "invalid_request_error",
        "authentication_error",
        "not_found_error",
        "resource_limit_error",
        "server_error",
        "service_unavailable_error",
    }
)

_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": _INT,
        "completion_tokens": _INT,
        "total_tokens": _INT,
        "budget_cap": {
            "anyOf": [
                _NULL,
                {
                    "type": "object",
                    "required": ["requested_max_tokens", "admitted_max_tokens", "reason"],
                    "properties": {"requested_max_tokens": _INT, "admitted_max_tokens": _INT, "reason": _STR},
                },
            ]
        },
    },
}
_FINISH = {"enum": ["stop", "length", "tool_calls"]}
_LOGPROBS = {"anyOf": [_NULL, {"type": "object"}]}  # OpenAI's chat or completions shape (logprobs.py)
_ENDING = {"finish_reason": _FINISH, "logprobs": _LOGPROBS, **VLLM_CHOICE}  # openapi_fields.VLLM_CHOICE


def _completion_schema(obj: str, payload: dict) -> dict:
    """A non-streaming response: chat and text completions differ only in `object` and the choice payload."""
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": _STR,
            "object": {"const": obj},
            "created": _INT,
            "model": _STR,
            "choices": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["index", *payload, "finish_reason"],
                    "properties": {"index": _INT, **payload, **_ENDING},
                },
            },
            "usage": _USAGE,
            "prompt_token_ids": VLLM_CHOICE["prompt_token_ids"],  # chat's, with return_token_ids
        },
    }


_RESPONSES = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "additionalProperties": False,
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "code", "param"],
                "additionalProperties": False,  # nothing beyond these: no ids, paths or traces
                "properties": {
                    "message": {"type": "string", "minLength": 1},
                    "type": {"enum": _ERROR_TYPES},
                    "code": {"type": "string", "minLength": 1},
                    "param": {"anyOf": [_STR, _NULL]},
                    "estimated_bytes": _INT,
                    "limit_bytes": _INT,
                    "positions": _INT,
                    "positions_limit": _INT,
                    "retry_after_seconds": _INT,
                    "retry_after_ms": _INT,
                },
            }
        },
    },
    "ChatCompletion": _completion_schema(
        "chat.completion",
        {
            "message": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"const": "assistant"},
                    "content": {"anyOf": [_STR, _NULL]},  # null when the answer is tool calls
                    "tool_calls": {"type": "array", "items": {"type": "object"}},
                    **dict.fromkeys(("reasoning_content", "reasoning"), {"anyOf": [_STR, _NULL]}),  # thinking
                },
            }
        },
    ),
    "Completion": _completion_schema("text_completion", {"text": _STR}),
    "ModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["id", "object", "owned_by"],
                    "properties": {
                        "id": _STR,
                        "object": {"const": "model"},
                        "owned_by": _STR,
                        "created": _INT,
                        "max_model_len": _INT,
                    },
                },
            },
        },
    },
    "Model": {
        "type": "object",
        "required": ["id", "object", "owned_by"],
        "properties": {"id": _STR, "object": {"const": "model"}, "owned_by": _STR, "created": _INT},
    },
    "TokenizeResponse": {
        "type": "object",
        "required": ["tokens", "count", "max_model_len"],
        "properties": {"tokens": {"type": "array", "items": _INT}, "count": _INT, "max_model_len": _INT},
    },
    "DetokenizeResponse": {"type": "object", "required": ["prompt"], "properties": {"prompt": _STR}},
    "Health": {
        "type": "object",
        "required": ["status"],
        "properties": {
            "status": {"enum": ["ok", "loading", "failed", "dead", "shutting_down"]},
            "reason": {"anyOf": [_STR, _NULL]},
        },
    },
    "StreamEvent": {  # Open API 3.1: the schema of a text/event-stream entry describes one event
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "type": "string",
                "minLength": 1,
                "description": "a JSON chunk, a final JSON error object, or the literal [DONE]",
            },
            "event": {"const": "message"},
        },
    },
    "Resources": {
        "type": "object",
        "required": ["plan", "ledger", "kv", "scheduler"],
        "properties": {
            "plan": {"type": "object"},
            "ledger": {"type": "object"},
            "kv": {"type": "object"},
            "scheduler": {"type": "object"},
            "process": {
                "type": "object",
                "description": "measured resident bytes: now, peak, peak while loading",
            },
        },
    },
}

_RETRY_AFTER = {
    "Retry-After": {"required": True, "schema": {"type": "string", "pattern": "^[0-9]+$"}},
    "retry-after-ms": {  # the TTFT forecast's wait to the millisecond; the openai SDKs read it first
        "required": False,
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    },
}
_WHY = {
    400: "Invalid request (names the field in error.param), or a request that can never fit (names both sides)",
    401: "Missing or wrong API key (only when the server has one)",
    404: "Unknown model",
    413: "Request body over the limit",
    429: "Not enough free KV memory within the bounded queue wait: retry after Retry-After",
    500: "A generation step failed inside the engine (the details are in the server log)",
    503: "Queue full, loading, shutting down, or the engine stopped: retry after Retry-After",
}


def _error(status: int) -> dict:
    r = {
        "description": _WHY[status],
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }
    if status in (429, 503):
        r["headers"] = copy.deepcopy(_RETRY_AFTER)
    return r


def _ok(name: str, description: str = "OK") -> dict:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
    }


def _route_responses(path: str) -> dict:
    if path == "/health":
        return {
            "200": _ok("Health", "Ready"),
            "503": _ok("Health", "Loading, failed to load, shutting down or dead"),
        }
    if path == "/metrics":
        return {"200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": _STR}}}}
    if path == "/v1/models":
        return {"200": _ok("ModelList"), "401": _error(401)}
    if path.startswith("/v1/models/"):
        return {"200": _ok("Model"), "401": _error(401), "404": _error(404)}
    if path == "/v1/resources":
        return {"200": _ok("Resources"), "401": _error(401), "503": _error(503)}
    if path in ("/v1/tokenize", "/v1/detokenize"):
        name = "TokenizeResponse" if path == "/v1/tokenize" else "DetokenizeResponse"
        return {"200": _ok(name), **{str(s): _error(s) for s in (400, 401, 404, 413, 503)}}
    if path == "/v1/responses":
        return responses_route_docs(_error)
    if path.startswith("/v1/responses/"):
        return stored_route_docs(_error, path)
    if path in ("/v1/chat/completions", "/v1/completions"):
        name = "ChatCompletion" if path == "/v1/chat/completions" else "Completion"
        ok = _ok(name, "The completion (JSON), or with stream=true a server-sent event stream")
        ok["content"]["text/event-stream"] = {"schema": {"$ref": "#/components/schemas/StreamEvent"}}
        ok["headers"] = {
            "X-KVGate-Budget-Cap": {
                "required": False,
                "schema": _STR,
                "description": "present when max_tokens was capped by the budget",
            }
        }
        return {"200": ok, **{str(s): _error(s) for s in (400, 401, 404, 413, 429, 500, 503)}}
    return {}


def _non_null(prop: dict) -> list[dict]:
    """The schema branches of a pydantic `X | None` property, excluding the null branch."""
    return [b for b in prop.get("anyOf", [prop]) if b.get("type") != "null"]


def _apply_ranges(js: dict, ranges: dict) -> None:
    props = js["properties"]
    for name, rng in ranges.items():
        if name in props:
            for b in _non_null(props[name]):
                b.update(rng)


def _tighten_common(js: dict, vocab: int | None, chat: bool) -> None:
    from kvgate.server.protocol import MAX_STOP, MAX_STOP_LEN

    _apply_ranges(js, _RANGES)
    props = js["properties"]
    stop_str = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LEN}
    props["stop"] = {"anyOf": [stop_str, {"type": "array", "maxItems": MAX_STOP, "items": stop_str}, _NULL]}
    token = {"type": "integer", "minimum": 0, **({"maximum": vocab - 1} if vocab else {})}
    props["stop_token_ids"] = {"anyOf": [{"type": "array", "items": token}, _NULL]}
    count = {"anyOf": [{"type": "integer", "minimum": 1}, _NULL]}  # past --max-seqs: a 400 too_many_choices
    props["n"] = count
    props["best_of"] = count
    js["additionalProperties"] = False
    tighten_features(js, vocab, chat)
    if "prompt" in props:
        ids = {"type": "array", "minItems": 1, "items": token}
        nonempty = {"type": "string", "minLength": 1}
        props["prompt"] = {
            "anyOf": [
                nonempty,
                {"type": "array", "minItems": 1, "items": nonempty},
                ids,
                {"type": "array", "minItems": 1, "items": ids},
            ]
        }


def _tighten_messages(schemas: dict) -> None:
    from kvgate.server.protocol import ROLES

    schemas["ChatMessage"]["properties"]["role"] = {"enum": sorted(ROLES)}
    tighten_message(schemas["ChatMessage"])
    part = schemas["ContentPart"]
    part["properties"]["type"] = {"const": "text"}
    part["properties"]["text"] = _STR
    part["required"] = ["type", "text"]


def install_openapi(app: FastAPI) -> None:
    from kvgate.server import protocol, responses_protocol

    def openapi():
        if app.openapi_schema:
            return app.openapi_schema
        engine = app.state.engine
        vocab = engine.tokenizer.vocab_size if engine is not None else None
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for path, name in _BODIES.items():
            model = getattr(protocol, name, None) or getattr(responses_protocol, name)
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(js.pop("$defs", {}))
            schemas[name] = js
            op = doc["paths"][path]["post"]
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
            }
        _tighten_messages(schemas)
        for name in ("ChatCompletionRequest", "CompletionRequest"):
            _tighten_common(schemas[name], vocab, name.startswith("Chat"))
        schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] = 1
        tok = schemas["TokenizeRequest"]
        tok["properties"]["messages"] = {
            "anyOf": [
                {"type": "array", "minItems": 1, "items": {"$ref": "#/components/schemas/ChatMessage"}},
                _NULL,
            ]
        }
        tok["oneOf"] = [  # exactly one of prompt / messages
            {"required": ["prompt"], "properties": {"prompt": _STR}},
            {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
        ]
        for op in doc["paths"].get("/v1/models/{model_id}", {}).values():
            for prm in op.get("parameters", []):  # the one model served (an unknown id is a 404)
                prm["schema"] = {"enum": [app.state.settings.model_name, "default"]}
        token = {"type": "integer", "minimum": 0, **({"maximum": vocab - 1} if vocab else {})}
        schemas["DetokenizeRequest"]["properties"]["tokens"] = {"type": "array", "items": token}
        schemas.update(copy.deepcopy(_RESPONSES))
        schemas.update(copy.deepcopy(SCHEMAS))
        _apply_ranges(schemas["ResponsesRequest"], {**_RANGES, **RESPONSES_RANGES})
        for path, ops in doc["paths"].items():
            for op in ops.values():
                op["responses"] = _route_responses(path) or op.get("responses", {})
        key = getattr(app.state.settings, "api_key", None)
        if key:
            doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            for path, ops in doc["paths"].items():
                if path.startswith("/v1/"):
                    for op in ops.values():
                        op["security"] = [{"bearer": []}]
        if engine is not None:  # cache once the vocabulary (token id maximum) is known
            app.openapi_schema = doc
        return doc

    app.openapi = openapi
