"""The OpenAPI document, with the request bodies our handlers parse themselves.

Handlers read and validate bodies by hand (to answer 413/400 in our own error shape instead of
FastAPI's 422), so FastAPI cannot see their schemas; this adds them, for clients and for fuzzing.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

_BODIES = {
    "/v1/chat/completions": "ChatCompletionRequest",
    "/v1/completions": "CompletionRequest",
    "/v1/tokenize": "TokenizeRequest",
    "/v1/detokenize": "DetokenizeRequest",
}


def install_openapi(app: FastAPI) -> None:
    from kvgate.server import protocol

    def openapi():
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for path, name in _BODIES.items():
            model = getattr(protocol, name)
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(js.pop("$defs", {}))
            schemas[name] = js
            op = doc["paths"][path]["post"]
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
            }
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
