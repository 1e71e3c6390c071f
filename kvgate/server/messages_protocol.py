"""Anthropic's Messages API request bodies (`POST /v1/messages`, `/v1/messages/count_tokens`), as strict
pydantic models.

Strict, with unknown fields refused, as the chat and Responses models are. The block types kvgate
does not read (images, documents, server tools; thinking outside assistant turns) are refused by name before these models see
them (`messages_input`), so their 400 says why instead of listing the shapes a block may take.
`cache_control` is accepted on the request, every block and every tool and changes nothing: kvgate's prefix cache keeps
what any earlier request computed, marked or not, and reports it as `cache_read_input_tokens`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from kvgate.server.protocol import _Body

_STRICT = ConfigDict(extra="forbid", strict=True)


class TextBlock(_Body):
    model_config = _STRICT
    type: Literal["text"]
    text: str
    cache_control: Any = None
    citations: list[Any] | None = None  # an earlier answer's, replayed: not shown to the model


class ToolUseBlock(_Body):
    """An earlier assistant turn's tool call, replayed."""

    model_config = _STRICT
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: Any = None
    caller: Any = None  # the SDK's dump of an answer's block carries these: unused
    toolset_name: str | None = None


class ToolResultBlock(_Body):
    """A user turn's answer to a tool call."""

    model_config = _STRICT
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: Any = None
    toolset_name: str | None = None


class ThinkingBlock(_Body):
    """An earlier assistant turn's reasoning, replayed (`kvgate.server.reasoning`): the chat message's
    `reasoning_content`, for templates that read it. Its `signature` is not checked (kvgate signs none)."""

    model_config = _STRICT
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    cache_control: Any = None


class RedactedThinkingBlock(_Body):
    """Another server's encrypted reasoning, replayed: nothing a template can show."""

    model_config = _STRICT
    type: Literal["redacted_thinking"]
    data: str
    cache_control: Any = None


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(_Body):
    """A turn. `system` turns (the beta API's, which Claude Code sends between the others) carry text
    only; `clear_at: next_user_message` shows one only until a later user turn exists."""

    model_config = _STRICT
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]
    clear_at: Literal["next_user_message", "never"] | None = None
    output_config: dict[str, Any] | None = None  # a system turn's per-turn effort: unused


class Tool(_Body):
    """A client tool: a name and a JSON Schema for its input (Anthropic's own tool types, such as
    `bash_20250124` or `web_search_20250305`, are refused by name)."""

    model_config = _STRICT
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: Any = None
    strict: bool | None = None  # kvgate holds every call to its schema (a grammar) either way
    # accepted and unused: how a call's input streams, examples, who may call it (this model calls
    # them directly); `defer_loading: true` (tool search) is refused by `messages_input`
    eager_input_streaming: bool | None = None
    input_examples: list[dict[str, Any]] | None = None
    allowed_callers: list[str] | None = None
    defer_loading: bool | None = None


class ToolChoice(_Body):
    model_config = _STRICT
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Body):
    """`disabled` is the chat template's `enable_thinking: false` (Qwen3's answers without a think
    block); `enabled` and `adaptive` leave the model to think as its template has it (`budget_tokens`
    is not enforced); `between_tools` is refused by `messages_input`."""

    model_config = _STRICT
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None


class JSONOutputFormat(_Body):
    model_config = _STRICT
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    """`format`: structured output, held to the schema by the grammar engine, as the chat path's
    `response_format`; `effort`: accepted and unused (this model does not reason at a chosen effort)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    format: JSONOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class _Conversation(_Body):
    model_config = _STRICT
    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(_Conversation):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    output_config: OutputConfig | None = None
    # sampling: no longer in the anthropic SDK's own arguments (send them in extra_body), still read
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    # accepted and unused: the client's own records, one tier and one speed and one place here, caching
    # that is automatic (the prefix cache), and cache diagnostics this server does not report
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = None
    cache_control: Any = None
    context_management: Any = None  # edits of thinking or tool results: this server makes none
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


class CountTokensRequest(_Conversation):
    """`POST /v1/messages/count_tokens`: the prompt a Messages request with this conversation would have
    (the fields the SDK documents for it besides the conversation are accepted and count nothing)."""

    output_config: OutputConfig | None = None
    cache_control: Any = None
    context_management: Any = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
