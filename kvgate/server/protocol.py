"""OpenAI request bodies: schemas, strict validation, and refusal of unimplemented fields by name.

Every field is supported, accepted-and-ignored, or refused by name (the README's field table is the
list). A field is accepted and ignored only when honouring it could not change this model's output:
`reasoning_effort` and `verbosity` steer reasoning models (this one has no reasoning), `prompt_cache_key`
is a routing hint (kvgate's prefix cache needs no key), `store`, `metadata`, `service_tier`, `user` and
`safety_identifier` are bookkeeping, a replayed assistant message's `refusal` and `reasoning_content`
are not part of what the model is shown. Unknown fields and fields that would change the output if
dropped are refused: a client must learn that kvgate did not honour them instead of silently getting a
different answer. Types are strict for the same reason: "5" is not an integer, "yes" is not a boolean.
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
    continuous_usage_stats: bool = False  # vLLM's: usage so far on every chunk


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


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
    logprobs: bool | int | None = None  # chat: a boolean; completions: how many top logprobs
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    best_of: int | None = None
    # accepted and ignored: they cannot change this model's output (see the module doc)
    reasoning_effort: str | None = None
    verbosity: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool's answer to that call
    # accepted and ignored on a replayed assistant turn: not part of what the model is shown
    refusal: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


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
    if req.suffix:
        raise unsupported("suffix", "fill-in-the-middle is not implemented")


def check_common(req: _Common) -> None:
    extra = set(req.model_extra or {})
    if extra:
        name = sorted(extra)[0]
        raise unsupported(name, "unknown field; remove it (kvgate refuses fields it would otherwise ignore)")
    if req.n is not None and req.n < 1:
        raise invalid(f"n={req.n} must be at least 1", param="n")
    if req.best_of is not None:
        if req.best_of < (req.n or 1):
            raise invalid(f"best_of={req.best_of} must be at least n={req.n or 1}", param="best_of")
        if req.best_of > (req.n or 1) and req.stream:
            raise invalid(
                f"best_of={req.best_of} > n={req.n or 1} cannot be streamed: candidates are ranked once they "
                "finish. Send stream=false, or drop best_of.",
                param="best_of",
            )
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
            raise unsupported(f"messages.{i}.{extra[0]}", "unknown message field")
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
        if m.tool_calls:  # rendered by kvgate.server.tools
            msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
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
