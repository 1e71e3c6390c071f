"""vLLM's chat-template fields: how a chat's messages become its prompt, as clients built for vLLM send them.

- `add_generation_prompt` (default true): the prompt ends with the assistant's header, so the answer is
  a new assistant turn.
- `continue_final_message`: the final message, an assistant's, is left open and the answer continues
  it (a "prefill": `{"role": "assistant", "content": "{\\"name\\":"}` makes the answer go on from
  there). The template renders the conversation without a generation prompt and the text is cut right
  after that message's content, vLLM's rule; it implies `add_generation_prompt: false` (sending both
  true is a 400, as vLLM's).
- `chat_template_kwargs`: extra variables for the model's Jinja template (`{"enable_thinking": false}`
  for templates that read it); a template that does not read a variable ignores it, as in vLLM. The
  names the server itself passes (`messages`, `tools`, ...) are refused: they are the request's own
  fields.

The chat endpoint and `/v1/tokenize` read them alike, so a count is the chat's prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from kvgate.server.errors import invalid

RESERVED = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


class TemplateFields(BaseModel):
    """The fields, for the request models that take messages."""

    add_generation_prompt: bool | None = None  # None: true, or false with continue_final_message
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


@dataclass
class TemplateOptions:
    add_generation_prompt: bool = True
    continue_final: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)


def template_options(req: TemplateFields, messages: list) -> TemplateOptions:
    """The request's template options, or a 400 naming the field that cannot be honoured."""
    cont = req.continue_final_message
    if cont and req.add_generation_prompt:
        raise invalid(
            "continue_final_message continues the final message instead of starting a new turn, so it "
            "cannot go with add_generation_prompt: true; send add_generation_prompt: false (or leave it out)",
            param="add_generation_prompt",
        )
    if cont:
        last = messages[-1] if messages else None
        if last is None or last.role != "assistant" or not last.content:
            raise invalid(
                "continue_final_message needs the final message to be an assistant message with content "
                "to continue; add it, or send continue_final_message: false",
                param="continue_final_message",
            )
    kwargs = dict(req.chat_template_kwargs or {})
    taken = [k for k in RESERVED if k in kwargs]
    if taken:
        raise invalid(
            f"chat_template_kwargs may not set {taken[0]!r}: the server passes it from the request's own "
            f"fields ({', '.join(RESERVED)}); send it as that field",
            param=f"chat_template_kwargs.{taken[0]}",
        )
    gen = not cont if req.add_generation_prompt is None else req.add_generation_prompt
    return TemplateOptions(gen, cont, kwargs)
