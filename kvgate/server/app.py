"""The OpenAI-compatible HTTP API: `create_app(settings, engine=None)` wires the pieces together.

`routes.py` holds the routes, `serving.py` one generating request (admission before headers),
`prepare.py` request building off the event loop, `bodies.py` body reading and JSON, `sse.py` and
`responses.py` what goes back, `auth.py` the key check and request counts, `context.py` the shared
readiness rules. Errors of every kind leave as the one stable body of `errors.py`.
"""

from __future__ import annotations

import logging
import time

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvgate.server.auth import INTERNAL_ERROR, REQUEST_ID, AuthAndCount
from kvgate.server.console import LiveStats, install_console
from kvgate.server.context import ServerSettings
from kvgate.server.cors import install_cors
from kvgate.server.errors import APIError
from kvgate.server.held import CloseHeld
from kvgate.server.metrics import Metrics
from kvgate.server.openapi import install_openapi
from kvgate.server.responses_store import ResponseStore
from kvgate.server.routes import install_routes

__all__ = ["ServerSettings", "create_app"]

log = logging.getLogger("kvgate.server")


def create_app(settings: ServerSettings, engine=None) -> FastAPI:
    app = FastAPI(title="kvgate", version="0.1.0", docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.status = "ready" if engine is not None else "loading"
    app.state.load_error = None
    app.state.settings = settings
    app.state.metrics = metrics = Metrics(lambda: app.state.engine)
    app.state.live = LiveStats()
    app.state.responses = ResponseStore(settings.responses_store_bytes)
    app.state.started_at = int(time.time())  # the model card's `created`
    install_openapi(app)
    install_console(app)
    install_routes(app)
    app.router.redirect_slashes = False  # "/v1/responses/" is a JSON 404, not a bare 307
    app.add_middleware(CloseHeld)  # inside the key check: closes what a handler submitted (server.held)
    app.add_middleware(AuthAndCount, settings=settings, metrics=metrics)
    install_cors(app, settings.cors_origins)  # after: the outermost, so a preflight needs no key

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response_for(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _query_error(request: Request, exc: RequestValidationError):  # a query parameter's type
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return APIError(
            400, f"{where}: {first.get('msg', 'invalid')}", "invalid_value", param=where
        ).response_for(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            path = request.url.path
            hint = f"; did you mean {path.rstrip('/')}?" if path.endswith("/") and len(path) > 1 else ""
            return APIError(404, f"no route {request.method} {path}{hint}", "not_found").response_for(path)
        if exc.status_code == 405:  # keep Starlette's Allow header (RFC 9110 requires it on a 405)
            err = APIError(
                405, f"method {request.method} is not allowed on {request.url.path}", "method_not_allowed"
            )
            return err.response_for(request.url.path, headers=exc.headers)
        return APIError(exc.status_code, str(exc.detail), "http_error").response_for(request.url.path)

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: ClientDisconnect):  # left while its body came in:
        return Response(status_code=499)  # counted and logged as any 499 (auth), no traceback

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("request %s: unhandled error on %s", REQUEST_ID.get(), request.url.path)
        return APIError(500, INTERNAL_ERROR, "internal_error").response_for(request.url.path)

    return app
