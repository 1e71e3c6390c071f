"""The conversation rules Anthropic's Messages API enforces, enforced here the same way (400s naming
the turn or block), so a client that works here works there and the reverse.

- Every turn has content: a non-empty string or non-empty blocks, each text block non-empty; only a
  final assistant turn may be empty (it then asks for no prefill).
- A final assistant turn (a prefill) does not end in whitespace.
- A user turn's `tool_result` blocks come before its text, and each answers a `tool_use` of the
  assistant turn just before it; every `tool_use` of an assistant turn is answered by the next turn
  (system turns between them aside).
- A tool's name matches `^[a-zA-Z0-9_-]{1,128}$` and its `input_schema` is an object schema.

Consecutive user turns, or assistant turns, are one turn (`merged`, Anthropic's rule), and the rules
hold for the merged turn (a 400 names its first turn).
"""

from __future__ import annotations

import re

from kvgate.server.errors import invalid
from kvgate.server.messages_protocol import TextBlock, ToolResultBlock, ToolUseBlock

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")


def check_conversation(turns: list, tools: list | None, where: list[int] | None = None) -> None:
    """`where`: each turn's index in the request (turns of one role in a row come merged, `merged`)."""
    for i, tool in enumerate(tools or []):
        if not TOOL_NAME.match(tool.name):
            raise invalid(
                f"tools.{i}.name {tool.name!r} must match ^[a-zA-Z0-9_-]{{1,128}}$ (letters, digits, _ and -)",
                param=f"tools.{i}.name",
            )
        if tool.input_schema.get("type") != "object":
            raise invalid(
                f'tools.{i}.input_schema must be an object schema: {{"type": "object", "properties": ...}}',
                param=f"tools.{i}.input_schema.type",
            )
    pending: tuple[int, set[str]] | None = None  # the last assistant turn's unanswered tool_use ids
    for k, turn in enumerate(turns):
        final, i = k == len(turns) - 1, where[k] if where else k
        _check_content(turn, i, final)
        if turn.role == "system":
            continue
        if pending is not None:
            answered = _results(turn, i, pending[1])
            missing = sorted(pending[1] - answered)
            if missing:
                raise invalid(
                    f"messages.{i}: tool_use ids were found without tool_result blocks immediately after: "
                    f"{', '.join(missing)}. Each tool_use block of messages.{pending[0]} needs a tool_result "
                    "block in the next turn",
                    param=f"messages.{i}",
                )
        else:
            _results(turn, i, set())
        ids = (
            {b.id for b in turn.content if isinstance(b, ToolUseBlock)}
            if isinstance(turn.content, list)
            else set()
        )
        pending = (i, ids) if turn.role == "assistant" and ids else None


def merged(turns: list) -> tuple[list, list[int]]:
    """The turns with each run of user turns, or of assistant turns, as one (their blocks in order; a
    string as a text block), and where each starts in the request."""
    out: list = []
    where: list[int] = []
    for i, turn in enumerate(turns):
        if out and turn.role == out[-1].role and turn.role in ("user", "assistant"):
            out[-1] = out[-1].model_copy(update={"content": _blocks(out[-1]) + _blocks(turn)})
            continue
        out.append(turn)
        where.append(i)
    return out, where


def _blocks(turn) -> list:
    return (
        [TextBlock(type="text", text=turn.content)] if isinstance(turn.content, str) else list(turn.content)
    )


def _check_content(turn, i: int, final: bool) -> None:
    empty = turn.content == "" or turn.content == []
    if empty and not (final and turn.role == "assistant"):
        raise invalid(
            f"messages.{i}: all messages must have non-empty content except for the optional final "
            "assistant message",
            param=f"messages.{i}.content",
        )
    for j, b in enumerate(turn.content if isinstance(turn.content, list) else []):
        if isinstance(b, TextBlock) and not b.text:
            raise invalid(
                f"messages.{i}.content.{j}: text content blocks must be non-empty",
                param=f"messages.{i}.content.{j}.text",
            )
    if final and turn.role == "assistant" and not empty:
        last = turn.content if isinstance(turn.content, str) else turn.content[-1]
        text = last if isinstance(last, str) else getattr(last, "text", None)
        if text is not None and text != text.rstrip():
            raise invalid(
                f"messages.{i}: final assistant content cannot end with trailing whitespace",
                param=f"messages.{i}.content",
            )


def _results(turn, i: int, calls: set[str]) -> set[str]:
    """The tool_use ids a user turn's `tool_result` blocks answer; a 400 for one that answers none of
    `calls` (the assistant turn before), or that comes after the turn's text."""
    if turn.role != "user" or isinstance(turn.content, str):
        return set()
    seen_text = False
    answered = set()
    for j, b in enumerate(turn.content):
        if isinstance(b, TextBlock):
            seen_text = True
        elif isinstance(b, ToolResultBlock):
            where = f"messages.{i}.content.{j}"
            if seen_text:
                raise invalid(
                    f"{where}: tool_result blocks must come first in a user turn, before any text",
                    param=where,
                )
            if b.tool_use_id not in calls:
                raise invalid(
                    f"{where}: a tool_result for tool_use_id {b.tool_use_id!r}, which the assistant turn "
                    "before it did not call: each tool_result answers a tool_use block of the previous "
                    "assistant turn",
                    param=where,
                )
            answered.add(b.tool_use_id)
    return answered
