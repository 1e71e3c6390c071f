"""OpenAI request bodies: schemas, strict validation, and refusal of unimplemented fields by name.

Every field is supported, accepted-and-ignored, or refused by name (the README's field table is the
list). A field is accepted and ignored only when honouring it could not change this model's output:
reasoning hints (`reasoning_effort`: no template is given it), caching hints (the prefix cache needs no key), bookkeeping (`store`,
`metadata`, `service_tier`, `user`; values checked in `ignored_values`), a replayed assistant message's
`refusal`, and what the openai SDK's `.parse()`/`.stream()` helpers add. Unknown
fields and fields that would change the output if dropped are refused: a client must learn that kvgate
did not honour them (vLLM's `include_reasoning` is supported: `kvgate.server.reasoning`). Types are strict for the same reason: "5" is not an integer.

Null means "not given", as in OpenAI's schema (clients that serialize unset fields send null): a null
for a field with a non-null default is that default (`"stream": null` is false), and OpenAI's fields
kvgate does not do (`functions`, `audio`, a replayed message's `function_call`, ...) are
accepted when null (`modalities` also as its default `["text"]`, `annotations` also empty) and refused
by name, saying what to send instead, otherwise. `stream_options` needs `stream: true`, as OpenAI's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvgate.server.chat_template import TemplateFields
from kvgate.server.errors import APIError, invalid, unsupported
from kvgate.server.guided import GuidedFields
from kvgate.server.ignored_values import CacheRetention, Effort, Metadata, ServiceTier, Verbosity
from kvgate.server.schema_errors import describe
from kvgate.server.vllm_extras import VllmExtras, check_extras

MAX_STOP = 8
MAX_STOP_LEN = 256


def _null_in_schema(schema: dict, cls) -> None:
    """The JSON schema says what `_Body` accepts: null for every field with a non-null default."""
    for name, f in cls.model_fields.items():
        prop = schema.get("properties", {}).get(f.alias or name)
        if prop is not None and not f.is_required() and f.default is not None:
            keep = {k: prop.pop(k) for k in ("title", "default", "description") if k in prop}
            schema["properties"][f.alias or name] = {"anyOf": [prop, {"type": "null"}], **keep}


class _Body(BaseModel):
    """Every request model: a null for a field whose default is not null means "not given"."""

    model_config = ConfigDict(json_schema_extra=_null_in_schema)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields

        def unset(k, v) -> bool:
            f = fields.get(k)
            return v is None and f is not None and not f.is_required() and f.default is not None

        return {k: v for k, v in data.items() if not unset(k, v)}


class StreamOptions(_Body):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far on every chunk
    include_obfuscation: bool = False  # OpenAI's: pad every chunk (kvgate.server.stream_shape)


class JSONSchemaFormat(_Body):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class FunctionDef(_Body):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Body):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedToolChoice(_Body):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(_Body):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str
    parsed_arguments: Any = None  # the openai SDK's parse of `arguments` (`.parse()`), replayed: ignored


class ToolCall(_Body):
    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction
    index: int | None = None  # a replayed stream's delta position (the SDK's `.stream()` helper): ignored


class _Common(_Body, GuidedFields, VllmExtras):
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
    min_tokens: int | None = None  # vLLM's: no stop token or string before this many tokens
    skip_special_tokens: bool = True  # vLLM's: false keeps special tokens in the text
    user: str | None = None
    n: int | None = None
    logprobs: bool | int | None = None  # chat: a boolean; completions: how many top logprobs
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    best_of: int | None = None
    # accepted and ignored: they cannot change this model's output (see the module doc)
    reasoning_effort: Effort | None = None
    verbosity: Verbosity | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: CacheRetention | None = None
    safety_identifier: str | None = None
    store: bool | None = None
    metadata: Metadata | None = None
    service_tier: ServiceTier | None = None


class ContentPart(_Body):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool's answer to that call
    # accepted and ignored on a replayed assistant turn: not part of what the model is shown
    refusal: str | None = None
    # a replayed turn's reasoning, given to templates that read `reasoning_content` (kvgate.server.chat_messages)
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's newer name for it
    # a replayed response's own fields (`ChatCompletionMessage.model_dump()`): null, or annotations [],
    # is accepted; anything else is refused by `chat_messages`
    annotations: list | None = None
    audio: Any = None
    function_call: Any = None
    # the openai SDK's `.parse()` / `.stream()` messages' own parse of the content: ignored (not shown)
    parsed: Any = None


class Prediction(_Body):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["content"]
    content: str | list[ContentPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise invalid(
                    f'prediction.content[{j}] must be a text part: {{"type": "text", "text": "..."}}',
                    param=f"prediction.content.{j}",
                )
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common, TemplateFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None  # ["text"] (the default) or null; anything else is refused
    # OpenAI's, not done here: null is accepted, anything else refused by name (`NULL_ONLY`)
    audio: Any = None
    functions: Any = None
    function_call: Any = None
    web_search_options: Any = None
    # OpenAI's predicted outputs: the text the client expects back, a draft source for --speculate
    prediction: Prediction | None = None
    include_reasoning: bool = True  # vLLM's: false leaves a thinking model's reasoning out of the answer


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None


class TokenizeRequest(_Body, TemplateFields):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False  # vLLM's: the tokens' vocabulary strings too (`token_strs`)
    # with `messages`, as a chat request renders them: the tools' prompt block counts too
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None


class DetokenizeRequest(_Body):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]


ROLES = {"system", "user", "assistant", "tool", "developer"}

# OpenAI chat fields kvgate does not do: each changes the answer, so only null (not given) is accepted
NULL_ONLY = {
    "functions": "the deprecated form of tools: send tools",
    "function_call": "the deprecated form of tool_choice: send tool_choice (with tools)",
    "audio": "audio output is not implemented; this model answers in text",
    "web_search_options": "web search is not implemented",
}

SDK_CALL_FIELDS = {"index": True, "function": {"parsed_arguments"}}  # accepted, never shown to the model


def parse(model_cls, data: Any):
    if not isinstance(data, dict):
        raise invalid("the request body must be a JSON object", code="invalid_json")
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        raise schema_error(exc) from None


def schema_error(exc: ValidationError) -> APIError:
    """One 400 naming the field that failed and why (kvgate.server.schema_errors: a union-typed field
    is reported by the member the client meant, with the shapes it takes)."""
    msg, loc = describe(exc.errors(include_url=False), _model_names())  # inputs read, never echoed
    return invalid(msg, param=loc, code="invalid_schema")


def _model_names() -> frozenset[str]:
    """The request models' class names: pydantic tags a union member that is a model with its name."""
    return frozenset(c.__name__ for c in _subclasses(_Body))


def _subclasses(cls) -> list[type]:
    return [s for c in cls.__subclasses__() for s in (c, *_subclasses(c))]


def check_completion(req: CompletionRequest) -> None:
    if req.suffix:
        raise unsupported("suffix", "fill-in-the-middle is not implemented; send the prompt without a suffix")


def check_common(req: _Common) -> None:
    extra = set(req.model_extra or {})
    if extra:
        name = sorted(extra)[0]
        raise unsupported(name, "unknown field; remove it (kvgate refuses fields it would otherwise ignore)")
    for name, what in NULL_ONLY.items():
        if getattr(req, name, None) is not None:
            raise unsupported(name, what + " (null, or leaving it out, is accepted)")
    mods = getattr(req, "modalities", None)
    if mods is not None and set(mods) != {"text"}:
        other = [m for m in mods if m != "text"]
        why = f"{other[0]!r} output is not implemented" if other else "[] asks for no output at all"
        raise unsupported("modalities", f'{why}; send ["text"] (the default) or leave it out')
    if req.stream_options is not None and not req.stream:
        raise invalid(
            "stream_options is only allowed when stream is true: send stream=true, or drop stream_options",
            param="stream_options",
        )
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
    check_extras(req)


def stop_list(req: _Common) -> list[str]:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


def max_tokens_of(req: _Common) -> tuple[int | None, str]:
    """The output limit and the field it came from (`max_completion_tokens` wins over `max_tokens`);
    its range is checked by `kvgate.request.check_max_tokens`, the rule's one owner."""
    mct = getattr(req, "max_completion_tokens", None)
    if mct is not None:
        return mct, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


def request_kind(req) -> Literal["chat", "completion"]:
    return "chat" if isinstance(req, ChatCompletionRequest) else "completion"
