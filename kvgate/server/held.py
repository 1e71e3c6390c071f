"""Requests whose output a response keeps until it is sent: their handles close when the exchange ends.

A request that asks for logprobs reserves their memory at admission (`kvgate.core.logprob_budget`), and
the server keeps them after the request's row ends: a whole body is written from them as it is sent
(`kvgate.server.logprob_body`), a stream sends them as the client reads. So the server's requests say
`held` and their reservation lasts until `RequestHandle.close`. This pure ASGI middleware gives every
HTTP exchange a list; `hold` puts a handler's handles in it, and each is closed once the app has
answered (its body sent, or the client gone), whatever path the handler took: an error, a refusal,
a stream, a cancel. Outside an exchange (a replica's engine, fed by the cluster's ingress) the
caller closes its handles itself.
"""

from __future__ import annotations

from contextvars import ContextVar

HELD: ContextVar[list | None] = ContextVar("kvgate_held_handles", default=None)


def hold(handles) -> None:
    """Close `handles` when the current HTTP exchange ends (nothing outside one)."""
    held = HELD.get()
    if held is not None:
        held.extend(handles)


class CloseHeld:
    """Pure ASGI (no `BaseHTTPMiddleware`, which would buffer streams and hide disconnects)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        held: list = []
        token = HELD.set(held)
        try:
            await self.app(scope, receive, send)
        finally:
            HELD.reset(token)
            for h in held:
                h.close()
