"""OpenAI's Responses API (`POST /v1/responses`) read as the chat completion it asks for.

The Responses API is what newer clients send (the openai SDK's `client.responses`, the openai-agents
SDK, Codex-style tools): `input` items instead of `messages`, `instructions`, flat function tools,
`text.format` for structured output, `max_output_tokens`. kvgate serves it statelessly, as vLLM does
with `store` off: `to_chat` turns the body into a chat completion body, which then takes the chat
path whole (template, tools, grammar, admission), so the two endpoints can never drift apart.

Input items, in order, become messages: a string is one user message; `{"role", "content"}` items
(type `message` or none) keep their role, their `input_text` / `output_text` parts joined by a newline;
`function_call` items become the assistant's `tool_calls` (consecutive ones, and one after the
assistant's text, in one message, as the chat templates expect them); `function_call_output` items
become `tool` messages. `instructions` is a system message before them all.

`previous_response_id` and `item_reference` items are resolved before this (`responses_route.continued`:
the stored conversation goes before `input`; `responses_route.referenced`: a kept item in place of its
reference). Not done, refused by name (400 `unsupported_parameter`): `conversation` (the
Conversations API: send the whole conversation, or chain responses), `background`, hosted tools (web search,
file search, ...) and non-text input parts. A `reasoning` item (a thinking model's, as kvgate gives them
back) is the next assistant turn's `reasoning_content`, which templates that read it show.
"""

from __future__ import annotations

import re
from typing import Any

from kvgate.sampling_params import MAX_TOP_LOGPROBS
from kvgate.server import protocol as P
from kvgate.server.errors import APIError, invalid, translated_param, unsupported
from kvgate.server.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    ItemReference,
    ReasoningItem,
    ResponsesRequest,
)

NOT_DONE = {
    "conversation": "kvgate stores no conversations; send the whole conversation in input",
    "background": "background responses are not implemented; send the request and wait for it",
    "prompt": "stored prompt templates are not implemented; send instructions and input",
    "max_tool_calls": "a limit on hosted tool calls does not apply: kvgate runs no tools itself",
}
# sampling fields the chat endpoint takes under the same names
PASSED = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "ignore_eos",
    "stop",
    "min_tokens",
    "cache_salt",
    "parallel_tool_calls",
)
ITEM_TYPES = ("message", "function_call", "function_call_output", "item_reference", "reasoning")
# what `tool_choice` takes here (the chat endpoint's 400 names the chat shape: QA pass 9)
TOOL_CHOICE = (
    '"none", "auto", "required", or {"type": "function", "name": "..."} (the Responses shape: '
    '{"type": "function", "function": {"name": "..."}} is the chat endpoint\'s)'
)
ROLES = ("user", "assistant", "system", "developer")


def to_chat(body: Any) -> tuple[dict, list[str]]:
    """The chat completion body a Responses body asks for, and where each of its messages came from
    (`instructions` or `input.i`, for `responses_param`); a 400 naming the Responses field where it
    asks for something kvgate does not do."""
    _refuse_what_is_not_done(body)
    try:
        req = P.parse(ResponsesRequest, body)
    except APIError as e:
        if e.param == "tool_choice":
            e.message = f"invalid field 'tool_choice': must be {TOOL_CHOICE}"
        raise
    messages, origin = [], []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
        origin.append("instructions")
    items, where = input_messages(req.input)
    chat: dict = {k: getattr(req, k) for k in PASSED if getattr(req, k) is not None}
    chat["messages"] = messages + items
    origin += where
    if req.max_output_tokens is not None:
        chat["max_completion_tokens"] = req.max_output_tokens
    if req.stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}  # the last event carries the usage
        if req.stream_options is not None and req.stream_options.include_obfuscation:
            chat["stream_options"]["include_obfuscation"] = True
    elif req.stream_options is not None:
        raise invalid("stream_options is only allowed when stream is true", param="stream_options")
    if req.tools is not None:
        chat["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in req.tools
        ]
    if isinstance(req.tool_choice, str):
        chat["tool_choice"] = req.tool_choice
    elif req.tool_choice is not None:
        chat["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        spec = fmt.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)
        chat["response_format"] = {
            "type": fmt.type,
            **({"json_schema": spec} if fmt.type == "json_schema" else {}),
        }
    if "message.output_text.logprobs" in (req.include or ()):  # top_logprobs alone asks for nothing
        chat["logprobs"] = True
        chat["top_logprobs"] = req.top_logprobs or 0
    elif req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise invalid(
            f"top_logprobs={req.top_logprobs} must be between 0 and {MAX_TOP_LOGPROBS}", "top_logprobs"
        )
    return chat, origin


def _refuse_what_is_not_done(body: Any) -> None:
    """The fields and kinds kvgate does not do, each refused with why, before the schema's generic
    400 would name them."""
    if not isinstance(body, dict):
        return  # P.parse says so
    unknown = sorted(set(body) - set(ResponsesRequest.model_fields))
    if unknown:  # as the chat endpoint says it (QA pass 14: pydantic's "Extra inputs are not permitted")
        raise unsupported(
            unknown[0], "unknown field; remove it (kvgate refuses fields it would otherwise ignore)"
        )
    for name, why in NOT_DONE.items():
        if body.get(name) not in (None, False):
            raise unsupported(name, why)
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        raise unsupported(
            "tool_choice",
            "allowed_tools: kvgate offers the model every tool sent; send only the allowed ones",
        )
    tools = body.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind is not None and kind != "function":
            raise unsupported(
                f"tools.{i}", f"{kind!r} tools: kvgate runs no hosted tools, only function tools"
            )
    items = body.get("input")
    for i, item in enumerate(items if isinstance(items, list) else []):
        kind = item.get("type") if isinstance(item, dict) else None
        if kind is not None and kind not in ITEM_TYPES:
            raise unsupported(f"input.{i}.type", f"{kind!r} items: only {', '.join(ITEM_TYPES)}")
        content = item.get("content") if isinstance(item, dict) and kind != "reasoning" else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in (None, "input_text", "output_text"):
                raise unsupported(
                    f"input.{i}.content.{j}", f"{kind!r} parts: only input_text and output_text"
                )


def input_messages(items) -> tuple[list[dict], list[str]]:
    """The messages, and the input item each one starts at."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}], ["input"]
    out: list[dict] = []
    origin: list[str] = []
    thought = None  # a reasoning item's text, for the assistant turn that follows it
    for i, item in enumerate(items):
        start = len(out)
        if isinstance(item, ReasoningItem):
            thought = item.text() or None
            continue
        if isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function"}
            call["function"] = {"name": item.name, "arguments": item.arguments}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # its text, or the calls before it
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        elif isinstance(item, ItemReference):  # the route puts kept items in their place first
            raise invalid(f"input[{i}] is an item_reference that was not resolved", f"input.{i}.id")
        else:
            if item.role not in ROLES:
                raise invalid(
                    f"input[{i}].role {item.role!r} is not one of {', '.join(ROLES)}", f"input.{i}.role"
                )
            out.append({"role": item.role, "content": _text(item.content)})
        if thought is not None and len(out) > start and out[-1]["role"] == "assistant":
            out[-1]["reasoning_content"], thought = thought, None
        origin += [f"input.{i}"] * (len(out) - start)
    return out, origin


def _text(content) -> str:
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


def responses_param(param: str | None, origin: list[str]) -> str | None:
    """A chat error's `param` in the Responses body's names (`origin`: from `to_chat`)."""
    return translated_param(param, origin, "instructions", "input", RENAMED, bare=("response_format",))


RENAMED = {
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "logprobs": "include",
}


_CHAT_NAMES = [
    (re.compile(r"\bmax_completion_tokens\b"), "max_output_tokens"),
    (re.compile(r"\bmax_tokens\b"), "max_output_tokens"),
    (re.compile(r"\bresponse_format\b"), "text.format"),
    (re.compile(r"'logprobs'"), "'include' (message.output_text.logprobs)"),
]


def responses_message(message: str) -> str:
    """A chat error's message in the Responses body's names (QA pass 6: "max_completion_tokens=0 must
    be ..." answered a request that sent max_output_tokens)."""
    for pattern, name in _CHAT_NAMES:
        message = pattern.sub(name, message)
    return message
