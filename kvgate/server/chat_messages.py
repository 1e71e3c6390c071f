"""A chat request's messages as the template sees them, checked first as OpenAI checks them.

`chat_messages` turns the request's messages into plain dicts (text parts joined by a newline, `developer` as
`system`, a replayed response's own fields dropped when empty, an assistant turn's reasoning as
`reasoning_content`, sent as that or as vLLM's `reasoning`, for the templates that read it) and refuses, each with a 400 naming
the message, what OpenAI's API refuses: an unknown role or message field, a non-text part, a user,
system or tool message without `content`, and a tool message that answers no call (it must follow an
assistant message with `tool_calls`, or another tool message after one, and name its `tool_call_id`).
"""

from __future__ import annotations

from kvgate.server.errors import invalid, unsupported
from kvgate.server.protocol import ROLES, SDK_CALL_FIELDS, ChatCompletionRequest, ChatMessage


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    if not req.messages:
        raise invalid("messages must contain at least one message", param="messages")
    out = []
    for i, m in enumerate(req.messages):
        extra = sorted(m.model_extra or {})
        if extra:
            raise unsupported(f"messages.{i}.{extra[0]}", "unknown message field; remove it")
        _check_replayed(m, i)
        if m.role not in ROLES:
            raise invalid(
                f"messages[{i}].role {m.role!r} is not one of {', '.join(sorted(ROLES))}",
                param=f"messages.{i}.role",
            )
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text":
                    raise unsupported(
                        f"messages.{i}.content", f"content part type {part.type!r}: only 'text'"
                    )
                if part.text is None:
                    raise invalid(
                        f"messages[{i}].content[{j}] is a text part without its 'text' field: send "
                        '{"type": "text", "text": "..."}',
                        param=f"messages.{i}.content.{j}.text",
                    )
                texts.append(part.text)
            content = "\n".join(texts)  # vLLM's and llama.cpp's rule for a template that takes text
        elif m.content is None and m.role != "assistant":  # an assistant's may be null (a call turn)
            raise invalid(
                f"messages[{i}] ({m.role}) has no content: a {m.role} message needs its 'content' (an "
                "empty string is fine)",
                param=f"messages.{i}.content",
            )
        else:
            content = m.content or ""
        if m.role == "tool":
            _check_answers_a_call(req.messages, i)
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.name is not None:  # the template decides what a name means (most ignore it)
            msg["name"] = m.name
        if m.tool_calls:  # rendered by kvgate.server.tools
            msg["tool_calls"] = [c.model_dump(exclude=SDK_CALL_FIELDS) for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        thought = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if m.role == "assistant" and thought:  # for templates that read it (Qwen3's, in a tool loop)
            msg["reasoning_content"] = thought
        out.append(msg)
    return out


def _check_replayed(m: ChatMessage, i: int) -> None:
    """A replayed response's own fields: null (annotations also empty) is accepted, as not given."""
    if m.function_call is not None:
        raise unsupported(
            f"messages.{i}.function_call",
            "the deprecated form of tool_calls: send the call as tool_calls "
            '[{"id": "...", "type": "function", "function": {"name": "...", "arguments": "..."}}]',
        )
    if m.audio is not None:
        raise unsupported(
            f"messages.{i}.audio",
            "an earlier audio answer cannot be replayed (kvgate has no audio): send its transcript as "
            "content, and audio null or left out",
        )
    if m.annotations:
        raise unsupported(
            f"messages.{i}.annotations",
            "kvgate takes no message annotations: send [] or null, or leave it out",
        )


# what may stand between a call turn and its answers besides assistant text (a Messages system turn)
SKIPPED = ("tool", "system", "developer")


def _check_answers_a_call(messages: list[ChatMessage], i: int) -> None:
    """A tool message names the call it answers and follows the assistant message that made it, as
    OpenAI requires; other answers, system notes and assistant text without calls may come between (a
    Responses conversation replays a message after its calls; a Messages one a system turn: review of
    session 45). QA of session 45: an answer to no call was rendered as if one had been made."""
    if messages[i].tool_call_id is None:
        raise invalid(
            f"messages[{i}] is a tool message without 'tool_call_id': name the call it answers (the id "
            "of one of the preceding assistant message's tool_calls)",
            param=f"messages.{i}.tool_call_id",
        )
    j = i - 1  # back over other answers, notes and the caller's text after its calls, to the call turn
    while j >= 0 and (
        messages[j].role in SKIPPED or (messages[j].role == "assistant" and not messages[j].tool_calls)
    ):
        j -= 1
    if j < 0 or messages[j].role != "assistant":
        raise invalid(
            f"messages[{i}] is a tool message, but no assistant message with 'tool_calls' comes before "
            "it: a tool message answers one of those calls. Send the assistant's call turn before it, or "
            "send the result as a user message",
            param=f"messages.{i}",
        )
