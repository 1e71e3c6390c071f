"""OpenAI request bodies: schemas, strict validation, and refusal of unimplemented fields by name.

Unknown fields are refused, not dropped: a client that sends `logprobs: true` or `tools` must learn
that kvgate did not honour them instead of silently getting a different answer. Types are strict for
the same reason: "5" is not an integer, "yes" is not a boolean, true is not a max_tokens.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvgate.server.errors import APIError, invalid, unsupported

MAX_STOP = 8
MAX_STOP_LEN = 256


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    max_tokens: int | None = Field(default=None, description="default: up to the remaining context")
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    n: int | None = None
    logprobs: Any = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    best_of: int | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]


_KNOWN_EXTRA = {"metadata", "store", "service_tier"}  # accepted and ignored: they change no output
ROLES = {"system", "user", "assistant", "tool", "developer"}


def parse(model_cls, data: Any):
    if not isinstance(data, dict):
        raise invalid("the request body must be a JSON object", code="invalid_json")
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        raise schema_error(exc) from None


def schema_error(exc: ValidationError) -> APIError:
    errs = exc.errors(include_url=False, include_input=False)
    first = errs[0]
    # Drop pydantic's union-member tags ("str", "list[int]", ...) so the path names only fields.
    loc = ".".join(str(p) for p in first["loc"] if not _is_type_tag(p)) or "body"
    more = f" (and {len(errs) - 1} more problem(s))" if len(errs) > 1 else ""
    return invalid(f"invalid field '{loc}': {first['msg']}{more}", param=loc, code="invalid_schema")


def _is_type_tag(part) -> bool:
    return isinstance(part, str) and (part in {"str", "int", "float", "bool", "list", "dict"} or "[" in part)


def check_completion(req: CompletionRequest) -> None:
    if req.echo:
        raise unsupported("echo", "the prompt is not echoed back; send echo=false")
    if req.suffix:
        raise unsupported("suffix", "fill-in-the-middle is not implemented")


def check_common(req: _Common) -> None:
    extra = set(req.model_extra or {}) - _KNOWN_EXTRA
    if extra:
        name = sorted(extra)[0]
        raise unsupported(name, "unknown field; remove it (kvgate refuses fields it would otherwise ignore)")
    if req.n not in (None, 1):
        raise unsupported("n", f"n={req.n}: only one choice per request (n=1)")
    if req.best_of not in (None, 1):
        raise unsupported("best_of", f"best_of={req.best_of}: only 1")
    if req.logprobs not in (None, False, 0):
        raise unsupported("logprobs", "log-probabilities are not returned")
    if req.top_logprobs:
        raise unsupported("top_logprobs", "log-probabilities are not returned")
    if req.logit_bias:
        raise unsupported("logit_bias", "logit biasing is not implemented")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise unsupported("response_format", f"type {req.response_format.get('type')!r}: only 'text'")
    if req.tools:
        raise unsupported("tools", "tool calling is not implemented")
    if req.tool_choice not in (None, "none"):
        raise unsupported("tool_choice", "tool calling is not implemented")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > MAX_STOP:
        raise invalid(f"stop has {len(stops)} entries; at most {MAX_STOP} are allowed", param="stop")
    for s in stops:
        if not s:
            raise invalid("stop strings must not be empty", param="stop")
        if len(s) > MAX_STOP_LEN:
            raise invalid(f"a stop string is {len(s)} characters; at most {MAX_STOP_LEN}", param="stop")


def stop_list(req: _Common) -> list[str]:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    if not req.messages:
        raise invalid("messages must contain at least one message", param="messages")
    out = []
    for i, m in enumerate(req.messages):
        extra = sorted(m.model_extra or {})
        if extra:
            raise unsupported(
                f"messages.{i}.{extra[0]}", "unknown message field (tool calls are not implemented)"
            )
        if m.role not in ROLES:
            raise invalid(
                f"messages[{i}].role {m.role!r} is not one of {', '.join(sorted(ROLES))}",
                param=f"messages.{i}.role",
            )
        if isinstance(m.content, list):
            texts = []
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise unsupported(
                        f"messages.{i}.content", f"content part type {part.type!r}: only 'text'"
                    )
                texts.append(part.text)
            content = "".join(texts)
        else:
            content = m.content or ""
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.name is not None:  # the template decides what a name means (most ignore it)
            msg["name"] = m.name
        out.append(msg)
    return out


def max_tokens_of(req: _Common) -> tuple[int | None, str]:
    """The output limit and the field it came from (`max_completion_tokens` wins over `max_tokens`);
    its range is checked by `kvgate.request.check_max_tokens`, the rule's one owner."""
    mct = getattr(req, "max_completion_tokens", None)
    if mct is not None:
        return mct, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


def request_kind(req) -> Literal["chat", "completion"]:
    return "chat" if isinstance(req, ChatCompletionRequest) else "completion"
