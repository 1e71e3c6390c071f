"""Anthropic's Messages API (`POST /v1/messages`) read as the chat completion it asks for.

What the anthropic SDKs, Claude Code-style agents and llama.cpp's and vLLM's own `/v1/messages` users
send: `system` beside the turns, content as blocks, `tool_use` and `tool_result` blocks instead of
`tool_calls` and tool messages, a required `max_tokens`. `to_chat` turns the body into a chat completion
body, which then takes the chat path whole (template, tools, grammar, admission, refusals), so the two
endpoints cannot drift apart (the Responses API is served the same way).

Turns become messages in order: `system` (a string, or text blocks joined by a newline) is a system
message; a user turn's `tool_result` blocks become tool messages (an `is_error` result's text begins
"Error: ") and its text blocks one user message after them; an assistant turn's text blocks are its
content, its `tool_use` blocks its `tool_calls` and its `thinking` blocks (a thinking model's earlier
reasoning, replayed) its `reasoning_content`, which templates that read it show (Qwen3's, in a tool
loop; the chat path's rule); a turn of thinking alone (cut while thinking) has empty content. A
`system` turn between them (the beta API's, which Claude Code sends) is a system message where it
stands, left out once a later user turn exists when its `clear_at` is `next_user_message`. A
conversation that ends on an assistant turn with text is a prefill: the answer continues that turn's
text (the chat path's `continue_final_message`); one with thinking alone is left out.

`tool_choice`: auto, any (the chat path's `required`), tool (one named tool), none;
`disable_parallel_tool_use` is `parallel_tool_calls: false`. `output_config.format` (a JSON schema) is
the chat path's strict `response_format`. `thinking: {type: disabled}` is `chat_template_kwargs:
{enable_thinking: false}` (templates that read it close the think block unwritten); `enabled` (its
`budget_tokens` not enforced) and `adaptive` leave the model to think as its template has it; whether
a think block comes back as a `thinking` block is the server's `--reasoning-parser`. Refused by name
(400): image, document and other non-text blocks, thinking blocks outside assistant turns, `thinking`
`between_tools`, Anthropic's own tool types (`bash_...`,
`web_search_...`: only client tools with an `input_schema`), `defer_loading` tools and `container`, and
`thread` (server-held conversations) with Anthropic's `thread_unsupported_request` details, on which
the SDK's tool runner goes on without a thread.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvgate.server import protocol as P
from kvgate.server.errors import APIError, invalid, translated_param, unsupported
from kvgate.server.messages_protocol import (
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from kvgate.server.messages_rules import check_conversation, merged

BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use"), "system": ("text",)}
CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def to_chat(body: Any, count: bool = False) -> tuple[dict, list[str]]:
    """The chat completion body a Messages body asks for, and where each of its messages came from
    (`system` or `messages.i`, for `messages_param`). `count`: a count_tokens body (no sampling)."""
    _refuse_what_is_not_done(body)
    req = P.parse(CountTokensRequest if count else MessagesRequest, body)
    turns, where = merged(req.messages)
    check_conversation(turns, req.tools, where)
    thinking = req.thinking.type if req.thinking is not None else None
    if not count and thinking == "between_tools":
        raise unsupported(
            "thinking",
            "between_tools: this server does not steer when a model thinks; send thinking {type: enabled}, "
            "{type: adaptive} or {type: disabled}, or leave it out",
        )
    messages: list[dict] = []
    origin: list[str] = []
    if req.system is not None:
        text = req.system if isinstance(req.system, str) else "\n".join(b.text for b in req.system)
        messages.append({"role": "system", "content": text})
        origin.append("system")
    last_user = max((k for k, t in enumerate(turns) if t.role == "user"), default=-1)
    prefill = bool(turns) and turns[-1].role == "assistant"
    for k, turn in enumerate(turns):
        i = where[k]
        if turn.role != "system" and (turn.clear_at is not None or turn.output_config is not None):
            raise invalid(
                f"messages.{i}: clear_at and output_config go on system turns only", param=f"messages.{i}"
            )
        if turn.role == "system" and turn.clear_at == "next_user_message" and k < last_user:
            continue  # a later user turn exists: no longer shown (Anthropic's rule)
        if turn.role == "assistant" and k == len(turns) - 1 and _no_answer(turn.content):
            prefill = False  # an empty final assistant turn (or one of thinking alone) asks for none
            break
        made = _turn(turn, i)
        messages += made
        origin += [f"messages.{i}"] * len(made)
    chat: dict = {"model": req.model, "messages": messages}
    if thinking == "disabled":  # for templates that read it (Qwen3's closes an empty think block)
        chat["chat_template_kwargs"] = {"enable_thinking": False}
    if prefill:  # the conversation ends on an assistant turn: the answer continues it
        if messages[-1].get("tool_calls"):
            raise invalid(
                f"messages.{len(req.messages) - 1}: the conversation ends on an assistant turn that calls "
                "tools; send their tool_result blocks in a user turn after it",
                param=f"messages.{len(req.messages) - 1}",
            )
        chat["continue_final_message"] = True
    if req.tools is not None:
        chat["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "parameters": t.input_schema,
                    **({"description": t.description} if t.description is not None else {}),
                },
            }
            for t in req.tools
        ]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if choice.name is None:
                raise invalid(
                    'tool_choice {"type": "tool"} needs the tool\'s "name"', param="tool_choice.name"
                )
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            chat["tool_choice"] = CHOICES[choice.type]
        if choice.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    if count:
        return chat, origin
    # 0 (a cache warm-up, as Anthropic's): one token, which the answer leaves out
    chat["max_tokens"] = 1 if req.max_tokens == 0 else req.max_tokens
    if req.temperature is not None and not 0 <= req.temperature <= 1:
        raise invalid(
            f"temperature={req.temperature:g} is out of range: 0 <= temperature <= 1", "temperature"
        )
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            chat[name] = getattr(req, name)
    if req.stop_sequences:
        chat["stop"] = req.stop_sequences
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": fmt.schema_, "strict": True},
        }
    if req.stream:
        chat["stream"] = True  # usage on every chunk: message_start carries the input tokens
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return chat, origin


def _turn(turn, i: int) -> list[dict]:
    """One Messages turn as chat messages (a user turn with tool results: a tool message each, then
    its text as a user message)."""
    if isinstance(turn.content, str):
        return [{"role": turn.role, "content": turn.content}]
    texts = [{"type": "text", "text": b.text} for b in turn.content if isinstance(b, TextBlock)]
    if turn.role == "system":
        return [{"role": "system", "content": texts}]
    if turn.role == "assistant":
        calls = [
            {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
            for b in turn.content
            if isinstance(b, ToolUseBlock)
        ]
        message: dict = {"role": "assistant", "content": texts or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        thought = "\n".join(b.thinking for b in turn.content if isinstance(b, ThinkingBlock) and b.thinking)
        if thought:  # for templates that read it (Qwen3's, in a tool loop), as the chat path passes it
            message["reasoning_content"] = thought
        return [message]
    out = [
        {"role": "tool", "tool_call_id": b.tool_use_id, "content": _result_text(b)}
        for b in turn.content
        if isinstance(b, ToolResultBlock)
    ]
    if texts or not out:
        out.append({"role": "user", "content": texts})
    return out


def _result_text(block: ToolResultBlock) -> str:
    content = block.content or ""
    text = content if isinstance(content, str) else "\n".join(b.text for b in content)
    return "Error: " + text if block.is_error else text


def _refuse_what_is_not_done(body: Any) -> None:
    """The block and tool kinds kvgate does not read, each refused with why, before the schema's
    generic 400 would list the shapes a block may take."""
    if not isinstance(body, dict):
        return  # P.parse says so
    turns = body.get("messages")
    for i, turn in enumerate(turns if isinstance(turns, list) else []):
        role = turn.get("role") if isinstance(turn, dict) else None
        blocks = turn.get("content") if isinstance(turn, dict) else None
        for j, block in enumerate(blocks if isinstance(blocks, list) else []):
            kind = block.get("type") if isinstance(block, dict) else None
            if (
                isinstance(kind, str)
                and isinstance(role, str)
                and role in BLOCKS
                and kind not in BLOCKS[role]
                and not (role == "assistant" and kind in THOUGHTS)
            ):
                raise unsupported(f"messages.{i}.content.{j}", _why_not(kind, role))
            if kind == "tool_result" and isinstance(block.get("content"), list):
                for k, part in enumerate(block["content"]):
                    inner = part.get("type") if isinstance(part, dict) else None
                    if isinstance(inner, str) and inner != "text":
                        raise unsupported(
                            f"messages.{i}.content.{j}.content.{k}",
                            f"{inner!r} blocks in a tool result: only text",
                        )
    if body.get("container") is not None:
        raise unsupported("container", "kvgate runs no code execution containers")
    if body.get("thread") is not None:  # the SDK's tool runner then sends the whole history, unthreaded
        raise APIError(
            400,
            "'thread' is not supported by kvgate: it holds no conversation state; send the whole conversation "
            "in messages (its prefix cache keeps the earlier turns' work)",
            "unsupported_parameter",
            param="thread",
            details={"error_code": "thread_unsupported_request", "unsupported": ["thread"]},
        )
    tools = body.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        if isinstance(tool, dict) and tool.get("defer_loading") is True:
            raise unsupported(
                f"tools.{i}.defer_loading",
                "tool search is not served here: send the tools the model may call",
            )
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in (None, "custom"):
            raise unsupported(
                f"tools.{i}",
                f"{kind!r}: Anthropic's own tool types are not served here; send it as a client tool with a "
                "name, a description and an input_schema",
            )


THOUGHTS = ("thinking", "redacted_thinking")


def _no_answer(content) -> bool:
    """No text and no tool call: empty, or thinking blocks alone (a turn cut while thinking)."""
    return content == "" or (
        isinstance(content, list) and all(getattr(b, "type", None) in THOUGHTS for b in content)
    )


def _why_not(kind: str, role: str) -> str:
    if kind in THOUGHTS:
        return f"{kind!r} blocks: only an assistant turn holds them (a thinking model's earlier answer)"
    if kind in ("image", "document"):
        return f"{kind!r} blocks: this server's model reads text only"
    allowed = " and ".join(BLOCKS[role])
    return f"{kind!r} blocks in a {role} turn: only {allowed} blocks"


def messages_param(param: str | None, origin: list[str]) -> str | None:
    """A chat error's `param` in the Messages body's names (`origin`: from `to_chat`)."""
    if param is not None and param.startswith("tools."):
        return re.sub(r"\.function\.parameters\b", ".input_schema", param)
    return translated_param(param, origin, "system", "messages", RENAMED, bare=BARE)


RENAMED = {
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
    "response_format": "output_config.format",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
}
BARE = ("stop", "parallel_tool_calls")


_CHAT_NAMES = [
    (re.compile(r"\bmax_completion_tokens\b"), "max_tokens"),
    (re.compile(r"\bparallel_tool_calls\b"), "tool_choice.disable_parallel_tool_use"),
    (re.compile(r"'stop'|\bstop strings\b|^stop\b"), "stop_sequences"),
]


def messages_message(message: str) -> str:
    """A chat error's message in the Messages body's names."""
    for pattern, name in _CHAT_NAMES:
        message = pattern.sub(name, message)
    return message
