"""Request bodies: read on the event loop (bounded), parsed off it.

`read_body` streams the body in, refusing past the byte limit (413) before it is all read. `parse_json`
turns the bytes into JSON and is meant to run on a worker thread (`asyncio.to_thread`): a 4 MiB body
takes milliseconds to decode and scan, which would stall every open SSE stream if it ran on the loop.
Everything refused here is a 400 naming what is wrong: not UTF-8, not JSON (with line and column),
NaN/Infinity, nested too deeply, or a lone UTF-16 surrogate that the tokenizer could not encode.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from kvgate.server import request_log
from kvgate.server.auth import REQUEST_ID
from kvgate.server.errors import APIError, invalid


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(
            413, f"request body is {int(declared)} bytes; the limit is {limit} bytes", "body_too_large"
        )
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes", "body_too_large")
    raw = bytes(body)
    settings = getattr(request.app.state, "settings", None)
    request_log.body(settings, REQUEST_ID.get(), request.method, request.url.path, raw)  # when asked
    return raw


def parse_json(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(
            f"request body is not valid UTF-8 (byte {exc.start})", code="invalid_encoding"
        ) from None
    try:
        data = json.loads(text, parse_constant=_no_constants)
    except json.JSONDecodeError as exc:
        raise invalid(
            f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
            code="invalid_json",
        ) from None
    except RecursionError:  # e.g. 100k nested '[': the decoder's recursion limit, not a server fault
        raise invalid("request body is nested too deeply to be a request", code="invalid_json") from None
    except ValueError as exc:
        raise invalid(str(exc), code="invalid_json") from None
    where = _unpaired_surrogate(data)
    if where is not None:  # "\ud800" is valid JSON but not Unicode: the tokenizer would raise on it
        raise invalid(
            f"the string at '{where or 'body'}' contains an unpaired UTF-16 surrogate escape, which is not "
            "valid Unicode",
            param=where or None,
            code="invalid_encoding",
        )
    return data


def _no_constants(name: str):
    raise ValueError(f"request body contains {name}, which is not valid JSON")


def _unpaired_surrogate(data) -> str | None:
    """The dotted path of the first string (value or key) holding a lone surrogate, or None."""
    stack = [("", data)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if not v.isascii() and not _encodable(v):
                return path
        elif isinstance(v, dict):
            for k, x in v.items():
                p = f"{path}.{k}" if path else str(k)
                if not k.isascii() and not _encodable(k):
                    return p
                stack.append((p, x))
        elif isinstance(v, list):
            stack.extend((f"{path}.{i}" if path else str(i), x) for i, x in enumerate(v))
    return None


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
