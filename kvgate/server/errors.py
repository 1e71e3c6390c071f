"""One stable public error shape: `{"error": {"message", "type", "code", "param", ...numbers}}`.

Bodies carry what the client can act on (cause, numbers, next step) and never internal ids, file
paths or stack traces; those go to the server log.
"""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from kvgate.request import Refusal

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "resource_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(
        self, status: int, message: str, code: str, *, param: str | None = None, retry_after=None, **extra
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.retry_after = retry_after
        self.extra = extra

    def body(self) -> dict:
        err = {
            "message": self.message,
            "type": _TYPES.get(self.status, "invalid_request_error"),
            "code": self.code,
            "param": self.param,  # null when no one field is at fault, as OpenAI's always has it
        }
        err.update(self.extra)
        return {"error": err}

    def response(self, headers: dict | None = None) -> JSONResponse:
        h = dict(headers or {})
        if self.retry_after is not None:
            h["Retry-After"] = str(int(self.retry_after))
        if self.extra.get("retry_after_ms") is not None:  # read before Retry-After by the openai SDKs
            h["retry-after-ms"] = str(int(self.extra["retry_after_ms"]))
        return JSONResponse(self.body(), status_code=self.status, headers=h)

    def response_for(self, path: str, headers: dict | None = None) -> JSONResponse:
        """`response()`, in Anthropic's error body on its Messages API's paths (a 401, 404, 405 or
        500 there is read by the anthropic SDKs)."""
        out = self.response(headers)
        if path.startswith("/v1/messages"):
            from kvgate.server.messages_output import error_body

            kept = {k: v for k, v in out.headers.items() if k not in ("content-length", "content-type")}
            out = JSONResponse(error_body(self.status, self.body()["error"]), self.status, kept)
        return out


RETRY_WORDS = re.compile(r"the Retry-After (interval|seconds)")


def from_refusal(r: Refusal, field_names: dict[str, str] | None = None) -> APIError:
    """`field_names` maps the engine's name for the field a refusal is about ("prompt", "max_tokens",
    "n") to the one the client sent ("messages", "max_completion_tokens", "best_of", ...)."""
    extra = r.details()
    if r.retry_after is not None:
        extra["retry_after_seconds"] = r.retry_after
    param = (field_names or {}).get(r.param, r.param) if r.param else None
    sent = (field_names or {}).get("max_tokens", "max_tokens")  # the advice names the field as sent
    message = re.sub(r"\bmax_tokens\b", sent, r.message) if sent != "max_tokens" else r.message
    if r.retry_after is not None:  # the number in the text too: a proxy (LiteLLM's) drops the header
        message = RETRY_WORDS.sub(f"{int(r.retry_after)} s (the Retry-After header)", message)
    return APIError(r.status, message, r.code, param=param, retry_after=r.retry_after, **extra)


def translated_param(
    param: str | None, origin: list[str], whole: str, fallback: str, renamed: dict[str, str], bare: tuple = ()
) -> str | None:
    """A chat error's `param` in the names of an API served as a chat request (Responses, Messages):
    `messages.i.rest` as the field message i came from (`origin[i]`, its `rest` kept unless it came
    from the `whole` field, such as `instructions`), else `fallback`; another field by `renamed`, its
    rest dropped for the `bare` ones."""
    if param is None:
        return None
    head, _, rest = param.partition(".")
    if head == "messages":
        index, _, tail = rest.partition(".")
        if index.isdigit() and int(index) < len(origin):
            where = origin[int(index)]
            return where + (f".{tail}" if tail and where != whole else "")
        return fallback
    return renamed.get(head, head) + (f".{rest}" if rest and head not in bare else "")


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code, param=param)


def unsupported(field: str, detail: str) -> APIError:
    return APIError(
        400, f"'{field}' is not supported by kvgate yet: {detail}", "unsupported_parameter", param=field
    )
