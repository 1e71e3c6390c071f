"""API-key check and request counting, as a pure ASGI middleware.

Pure ASGI, not Starlette's BaseHTTPMiddleware, which would interfere with streaming and disconnects.
`/v1/*` needs `Authorization: Bearer <key>` when a key is set (a constant-time compare); `/`, `/health`
and `/metrics` stay open. Every response is counted in `kvgate_requests_total{endpoint,status}`, with a
client that left before any status counted as 499.
"""

from __future__ import annotations

import hmac

from kvgate.server.errors import APIError

ENDPOINTS = {
    "/",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/v1/tokenize",
    "/v1/detokenize",
    "/v1/resources",
    "/health",
    "/metrics",
}


class AuthAndCount:
    def __init__(self, app, settings, metrics):
        self.app, self.settings, self.metrics = app, settings, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "other"
        key = self.settings.api_key
        if key and path.startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, key.encode()):
                self.metrics.requests.labels(endpoint, "401").inc()
                err = APIError(
                    401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "invalid_api_key"
                )
                return await err.response()(scope, receive, send)
        status = {"code": 499}

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()
