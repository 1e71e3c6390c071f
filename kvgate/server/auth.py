"""API-key check, request ids and request counting, as a pure ASGI middleware.

Pure ASGI, not Starlette's BaseHTTPMiddleware, which would interfere with streaming and disconnects.
`/v1/*` needs `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) when a key is set (a
constant-time compare); `/`, `/health` and `/metrics` stay open. Every response is counted in
`kvgate_requests_total{endpoint,status}`, with a client that left before any status counted as 499.
Every response carries `X-Request-Id`: the client's own (up to 128 printable ASCII characters; a
proxy's or tracer's id comes back unchanged), else a fresh one, so a client can quote it against the
server's log and a proxy can correlate. The log lines a request causes (its refusal, its failure, its
client leaving) name it (`REQUEST_ID`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from contextvars import ContextVar

from starlette.requests import ClientDisconnect

from kvgate.server.errors import APIError

log = logging.getLogger("kvgate.server")
# after a shutdown's drain, what clients still reading get to take their last events (`kvgate serve`
# passes it to uvicorn, which then cancels what is left)
FLUSH_SECONDS = 5
INTERNAL_ERROR = "internal server error; the details are in the server log under this response's X-Request-Id"
REQUEST_ID: ContextVar[str] = ContextVar("kvgate_request_id", default="-")  # this request's, for log lines

ROOT_API = ("/tokenize", "/detokenize", "/tokenizer_info")  # API routes outside /v1/ (routes.ROOT_ALIASES)
GENERATE = "/inference/v1/generate"  # vLLM's token-in, token-out route (kvgate.server.generate_route)
ENDPOINTS = {
    "/",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/models",
    "/v1/tokenize",
    "/v1/detokenize",
    "/v1/resources",
    "/health",
    "/metrics",
    GENERATE,
    *ROOT_API,
}


def api_path(path: str) -> bool:
    """The API's paths: a drain waits for them."""
    return path.startswith("/v1/") or path in ROOT_API or path == GENERATE


def keyed_path(path: str) -> bool:
    """The paths `--api-key` guards: /v1/, as vLLM's server. vLLM's root aliases of the tokenizer
    routes answer without it there, and lm-eval probes them so (it sends the key only to /v1/): behind
    the key it fell back to downloading a tokenizer from the hub and failed on that (QA pass 14). Their
    /v1/ forms take the key. vLLM's generate route takes it too: it generates, and the clients that call
    it (the openai client's `post`) send the key."""
    return path.startswith("/v1/") or path == GENERATE


def endpoint_of(path: str) -> str:
    """The `endpoint` label: a route's own path, kept responses' routes as one template (an id in a
    label would grow the series without bound), anything else "other"."""
    if path in ENDPOINTS:
        return path
    if path.startswith("/v1/responses/"):
        return "/v1/responses/{id}"
    return "other"


class AuthAndCount:
    def __init__(self, app, settings, metrics):
        self.app, self.settings, self.metrics = app, settings, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = endpoint_of(path)
        headers = dict(scope["headers"])
        rid = request_id(headers.get(b"x-request-id", b""))
        REQUEST_ID.set(rid.decode())  # the log lines of this request name it (QA pass 7's F4)
        if self.settings.request_id_header:
            send = with_request_id(send, rid)
        key = self.settings.api_key
        if key and keyed_path(path):
            given = headers.get(b"authorization", b"")
            token = given[7:] if given[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
            if not hmac.compare_digest(token, key.encode()):
                self.metrics.requests.labels(endpoint, "401").inc()
                err = APIError(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>', "
                    "as the anthropic SDKs do)",
                    "invalid_api_key",
                )
                return await err.response_for(path)(scope, receive, send)
        status = {"code": 499}
        counted = api_path(path) and "app" in scope  # the API requests in flight (a drain waits)
        if counted:
            state = scope["app"].state
            state.in_flight = getattr(state, "in_flight", 0) + 1

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except asyncio.CancelledError:
            if getattr(getattr(scope.get("app"), "state", None), "status", None) != "shutting_down":
                raise
            # uvicorn cancels what is left after the shutdown's flush (FLUSH_SECONDS) and would log each
            # as "Exception in ASGI application": one line says what happened instead
            log.warning(
                "request %s %s: cut off at shutdown, after the %gs flush", rid.decode(), path, FLUSH_SECONDS
            )
        except Exception as exc:  # here, not in the app's handler outside this middleware: so the 500 is
            if status["code"] != 499 or isinstance(exc, ClientDisconnect):  # counted 500 and carries the id
                raise  # (a response under way cannot be replaced; a client gone is its 499)
            log.exception("request %s: unhandled error on %s", rid.decode(), path)
            status["code"] = 500
            await APIError(500, INTERNAL_ERROR, "internal_error").response()(scope, receive, send)
        finally:
            if counted:
                state.in_flight -= 1
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()
            if status["code"] == 499:
                log.info("request %s %s: the client left before the answer (499)", rid.decode(), path)


def request_id(given: bytes) -> bytes:
    """The request's id: the client's X-Request-Id when it is a usable one, else a fresh one."""
    ok = 0 < len(given) <= 128 and all(33 <= c <= 126 for c in given)
    return given if ok else uuid.uuid4().hex.encode()


def with_request_id(send, rid: bytes):
    """`send` with `X-Request-Id: rid` added to the response's headers."""

    async def send_with_id(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid)]}
        await send(message)

    return send_with_id
