"""What every route shares: the server's settings, and the rules for "can this engine take work".

The app keeps its state on `app.state`: `settings`, `engine` (None while loading), `status`
(`loading` | `ready` | `shutting_down`), `load_error`, `metrics` and `live` (the console's window).
`ready_engine` is the one place that decides whether a request may reach the engine; `refused` is the
one place a refusal is counted (each exactly once, in the metrics and in the console's window).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvgate.core.admission import shutting_down_refusal
from kvgate.server.auth import REQUEST_ID
from kvgate.server.errors import APIError, from_refusal

log = logging.getLogger("kvgate.server")


@dataclass
class ServerSettings:
    model_name: str = "kvgate-model"
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    default_temperature: float = 1.0
    cors_origins: list[str] | None = None  # browser origins allowed (kvgate.server.cors); None = no CORS
    responses_store_bytes: int = (
        64 << 20
    )  # kept responses for previous_response_id (responses_store); 0 = none
    # X-Request-Id on every response (kvgate.server.auth); off behind Ray Serve, whose proxy sets it
    # itself (the client's id when it sent one): both made every cluster response carry it twice
    request_id_header: bool = True
    # --reasoning-parser: a thinking model's <think> block as reasoning_content (kvgate.server.reasoning)
    reasoning_parser: str = "auto"
    # --generation-config: auto gives left-out sampling fields the model's own (generation_defaults)
    generation_config: str = "auto"
    # --log-requests / --max-log-len: bodies and outcomes in the log (kvgate.server.request_log)
    log_requests: bool = False
    max_log_len: int | None = None


def refused(state, code: str, retry_after: int | None = None) -> None:
    log.info(
        "request %s refused: %s%s",
        REQUEST_ID.get(),
        code,
        "" if retry_after is None else f", retry after {retry_after} s",
    )
    state.metrics.rejections.labels(code).inc()
    state.live.record_refusal(code, retry_after)


def ready_engine(state):
    """The engine, or the 503 that says why it cannot serve (counted as a refusal)."""
    eng = state.engine
    err = None
    if state.status == "shutting_down":
        err = from_refusal(shutting_down_refusal())  # the same body as a queued request's at shutdown
    elif eng is None and state.load_error is not None:  # the process is on its way out
        err = APIError(
            503, f"the model failed to load: {state.load_error}", "engine_unavailable", retry_after=60
        )
    elif eng is None:
        err = APIError(503, "the model is still loading; retry shortly", "not_ready", retry_after=5)
    elif not eng.alive:
        err = APIError(
            503,
            "the engine is not running (see /health); requests cannot be served",
            "engine_unavailable",
            retry_after=5,
        )
    elif (stall := eng.stalled()) is not None:
        err = APIError(503, f"the engine is not answering: {stall}", "engine_unavailable", retry_after=5)
    if err is not None:
        refused(state, err.code, err.retry_after)
        raise err
    return eng


def check_model(settings: ServerSettings, name: str | None) -> None:
    if name not in (None, "", settings.model_name, "default"):
        raise APIError(
            404,
            f"model {name!r} is not served here; this server serves {settings.model_name!r} (see /v1/models)",
            "model_not_found",
            param="model",
        )
