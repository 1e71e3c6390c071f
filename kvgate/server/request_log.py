"""`--log-requests`: each API request's body and each answer's outcome in the log, for debugging clients.

Off by default (bodies hold users' text). On, a request logs one line when its body is read (`body`:
its method, path and the body as sent, its first `--max-log-len` characters when that is set), and a
generation logs one line per choice when it ends (`outcome`: the finish reason, what ended it, the
token counts, the prefix-cache hit, the wait, time to first token and total time), each under the
request's id, as vLLM's `--enable-log-requests` (with `--max-log-len`) logs prompts and their ends.
uvicorn's access log, on at `--log-level info`, already gives every request's status.
"""

from __future__ import annotations

import logging
import os

from kvgate.flag_types import at_least

log = logging.getLogger("kvgate.requests")


def add_request_log_flags(parser) -> None:
    parser.add_argument(
        "--log-requests",
        action="store_true",
        default=os.environ.get("KVGATE_LOG_REQUESTS", "") not in ("", "0", "false"),
        help="log each API request's body and each answer's finish reason, tokens and times (off: bodies "
        "hold users' text) [KVGATE_LOG_REQUESTS]",
    )
    parser.add_argument(
        "--max-log-len",
        type=at_least(int, 1),
        default=os.environ.get("KVGATE_MAX_LOG_LEN"),
        help="with --log-requests: the body's first N characters only (default: all of it) [KVGATE_MAX_LOG_LEN]",
    )


def enable(on: bool) -> None:
    """`--log-requests` asks for these lines: they show at INFO whatever `--log-level` says."""
    if on:
        log.setLevel(logging.INFO)


def body(settings, rid: str, method: str, path: str, raw: bytes) -> None:
    if not getattr(settings, "log_requests", False):
        return
    limit = settings.max_log_len
    text = raw.decode("utf-8", "replace") if limit is None else raw[: 4 * limit].decode("utf-8", "replace")
    more = f" ... ({len(raw)} bytes in all)" if limit is not None and len(text) > limit else ""
    log.info("request %s %s %s: body %s%s", rid, method, path, text[:limit] if more else text, more)


def outcome(settings, rid: str, res) -> None:
    if not getattr(settings, "log_requests", False):
        return
    why = f" ({res.stop_reason})" if res.stop_reason else ""
    wait = (res.admitted_at - res.submitted_at) if res.admitted_at is not None else None
    ttft = (res.first_token_at - res.submitted_at) if res.first_token_at is not None else None
    log.info(
        "request %s: finished %s%s, %d prompt tokens (%d cached) + %d generated, waited %s, first token %s, "
        "total %.3f s%s",
        rid,
        res.finish_reason,
        why,
        res.prompt_tokens,
        res.cached_tokens,
        res.completion_tokens,
        "-" if wait is None else f"{wait:.3f} s",
        "-" if ttft is None else f"{ttft:.3f} s",
        res.finished_at - res.submitted_at,
        f": {res.error}" if res.error else "",
    )
