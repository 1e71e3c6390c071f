"""The Responses API request body (`POST /v1/responses`), as strict pydantic models.

Strict, with unknown fields refused, like the chat models (`kvgate.server.protocol`): a body the
OpenAPI document calls invalid gets a 400 naming the field, and the document (`openapi.py`) is
generated from these models. Input items carry the fields clients replay from earlier responses
(`id`, `status`, an output text part's `annotations` and `logprobs`), since agent frameworks send the
output items back as the next turn's input.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from kvgate.server.protocol import (
    CacheRetention,
    Effort,
    JSONSchemaFormat,
    Metadata,
    ServiceTier,
    Verbosity,
    _Body,
)

_STRICT = ConfigDict(extra="forbid", strict=True)


class InputText(_Body):
    model_config = _STRICT
    type: Literal["input_text"]
    text: str


class OutputText(_Body):
    model_config = _STRICT
    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None
    parsed: Any = None  # the openai SDK's `responses.parse()` adds the parsed value; unused


TextPart = InputText | OutputText


class _Replayed(_Body):
    """An input item as an earlier response gave it back: its `id` and `status` ride along, unused."""

    model_config = _STRICT
    id: str | None = None
    status: str | None = None


class MessageItem(_Replayed):
    type: Literal["message"] | None = None
    role: str  # checked by name (responses_input.ROLES): a union's schema error names only `input`
    content: str | list[TextPart]
    phase: str | None = None  # an output message's phase, as the openai SDK's models dump it; unused


class FunctionCallItem(_Replayed):
    # the openai SDK's `model_dump()` of a call also carries these (None for a plain function call)
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    async_: bool | None = Field(None, alias="async")
    caller: Any = None
    namespace: str | None = None
    parsed_arguments: Any = None  # `responses.parse()` adds the parsed arguments; unused


class FunctionCallOutputItem(_Replayed):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]


class ItemReference(_Body):
    """A kept item named by its id, in place of the item itself (`responses_route.referenced` puts the
    item there before the body is read)."""

    model_config = _STRICT
    type: Literal["item_reference"]
    id: str


class ReasoningItem(_Replayed):
    """A thinking model's reasoning from an earlier turn (kvgate's own `reasoning` output items): given to
    the chat template as the next assistant turn's `reasoning_content`, for the templates that read it."""

    type: Literal["reasoning"]
    summary: list[Any] = Field(default_factory=list)
    content: list[dict] | None = None
    encrypted_content: str | None = None

    def text(self) -> str:
        return "".join(str(p.get("text") or "") for p in self.content or [])


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ItemReference | ReasoningItem


class FunctionTool(_Body):
    model_config = _STRICT
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Body):
    model_config = _STRICT
    type: Literal["function"]
    name: str


class TextFormat(JSONSchemaFormat):
    type: Literal["text", "json_object", "json_schema"]


class TextOptions(_Body):
    model_config = _STRICT
    format: TextFormat | None = None
    verbosity: Verbosity | None = None  # accepted: a 135M model has one verbosity


class ResponsesStreamOptions(_Body):
    model_config = _STRICT
    include_obfuscation: bool = False


class Reasoning(_Body):
    """Accepted and given back, as chat's `reasoning_effort`: they steer a reasoning model's hidden
    reasoning, and this model has none (so there is no summary to give either)."""

    model_config = _STRICT
    effort: Effort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # summary's older name


class ResponsesRequest(_Body):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, description="default: up to the remaining context")
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's sampling extras, as on the chat endpoint
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    # vLLM's: what benchmark clients send to force exactly max_output_tokens (guidellm: stop null and
    # ignore_eos true; QA pass 14 found every such request a 400)
    ignore_eos: bool | None = None
    stop: str | list[str] | None = None
    min_tokens: int | None = None
    cache_salt: str | None = None  # vLLM's: as on the chat endpoint (kvgate.server.vllm_extras)
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    # reasoning.encrypted_content asks for the reasoning items' encrypted content: this model writes no
    # reasoning items, so there is none to include (inspect_ai asks it of any model it does not know)
    include: list[Literal["message.output_text.logprobs", "reasoning.encrypted_content"]] | None = None
    top_logprobs: int | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: Reasoning | None = None
    # accepted and given back: they change nothing that is generated
    metadata: Metadata | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: CacheRetention | None = None
    service_tier: ServiceTier | None = None
    store: bool | None = None  # false: not kept for previous_response_id / GET (the default keeps it)
    # refused unless null or false (`responses_input.NOT_DONE` says why)
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    max_tool_calls: int | None = None
