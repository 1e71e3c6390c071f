"""Opt-in CORS for browser clients: `--cors-origins` (or KVGATE_CORS_ORIGINS), off by default.

A browser page on another origin may call the API only when its origin is listed (comma-separated,
or `*` for any). Preflight (`OPTIONS`) is answered before the API-key check, as browsers send it
without credentials; the real request still needs the key. `Retry-After`, `Retry-After-Ms` and
`X-KVGate-Budget-Cap` are exposed so a page can read the refusal's wait and the budget cap.
"""

from __future__ import annotations

import os

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

EXPOSED = ["Retry-After", "Retry-After-Ms", "X-KVGate-Budget-Cap", "X-Request-Id"]


def add_cors_flag(parser) -> None:
    parser.add_argument(
        "--cors-origins",
        default=os.environ.get("KVGATE_CORS_ORIGINS"),
        help="comma-separated origins allowed to call the API from a browser, or '*' (default: none)",
    )


def parse_origins(value: str | None) -> list[str] | None:
    if not value:
        return None
    origins = [o.strip().rstrip("/") for o in value.split(",") if o.strip()]
    return origins or None


def cors_origins(args) -> list[str] | None:
    return parse_origins(getattr(args, "cors_origins", None))


def install_cors(app: FastAPI, origins: list[str] | None) -> None:
    """Outermost middleware (add it last): preflights never reach the key check."""
    if not origins:
        return
    app.add_middleware(
        CORSMiddleware,
        allow_origins=origins,
        allow_methods=["GET", "POST", "DELETE", "OPTIONS"],  # DELETE: a kept response
        allow_headers=["*"],
        expose_headers=EXPOSED,
        max_age=600,
    )
