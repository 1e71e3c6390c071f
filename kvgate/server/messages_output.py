"""What `/v1/messages` sends back: the chat path's answer rewritten as Anthropic's `message`, its stream
as Anthropic's events, its errors in Anthropic's error body.

- *A message.* Content blocks in order: a thinking model's reasoning as a `thinking` block (its
  `signature` empty: kvgate signs nothing; `kvgate.server.reasoning`), the answer's text (when there is any), then a `tool_use` block
  per call with its arguments parsed. `stop_reason`: `tool_use` (the answer called tools), `max_tokens`
  (cut at the limit), `stop_sequence` (one of the request's `stop_sequences`, named in
  `stop_sequence`), else `end_turn`. `usage` as Anthropic counts it: `input_tokens` are the prompt
  tokens computed, `cache_read_input_tokens` those the prefix cache held.
- *A stream.* `message_start` (with the input tokens), then per block `content_block_start`, its
  `text_delta` or `input_json_delta` deltas and `content_block_stop`, then `message_delta` with the
  stop reason and usage, and `message_stop` (reasoning through `thinking_delta`s). A failure mid-stream is an `error` event.
- *An error.* `{"type": "error", "error": {"type", "message", ...}}`: Anthropic's type for the status
  (`invalid_request_error`, `rate_limit_error` for a 429, `overloaded_error` for a 503, ...), with
  kvgate's own fields (`code`, `param`, the numbers) beside it. Status and `Retry-After` stay
  kvgate's, which the anthropic SDKs retry by.
"""

from __future__ import annotations

import json
import uuid

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def new_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def tool_id(call_id: str) -> str:
    """A chat call id (`call_...`) in Anthropic's form (`toolu_...`); ids only go back to this server."""
    return "toolu_" + call_id.removeprefix("call_")


def error_body(status: int, chat_error: dict) -> dict:
    """kvgate's error object (its `error` member) as Anthropic's error body."""
    err = {"type": _ERROR_TYPES.get(status, "api_error"), "message": chat_error.get("message", "")}
    err.update({k: v for k, v in chat_error.items() if k not in ("type", "message")})
    return {"type": "error", "error": err}


def skeleton(mid: str, model: str) -> dict:
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0},
    }


def usage(chat_usage: dict | None, warm: bool = False) -> dict:
    if not chat_usage:
        return {"input_tokens": 0, "output_tokens": 0}
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": chat_usage["prompt_tokens"] - cached,
        "output_tokens": 0 if warm else chat_usage.get("completion_tokens", 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def stop_fields(finish_reason: str | None, stop_reason) -> dict:
    if finish_reason == "tool_calls":
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if isinstance(stop_reason, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_reason}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def message_body(chat: dict, skel: dict, warm: bool = False) -> dict:
    """A whole chat completion as a Messages `message`. `warm`: max_tokens 0 (the prompt computed and
    cached, nothing answered): the one token generated is left out."""
    choice = chat["choices"][0]
    msg = {} if warm else choice["message"]
    content: list[dict] = []
    if msg.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or []:
        try:
            args = json.loads(call["function"]["arguments"] or "{}")
        except json.JSONDecodeError:  # cut by max_tokens, which stop_reason says: {} as a stream gives it
            args = {}
        content.append(
            {"type": "tool_use", "id": tool_id(call["id"]), "name": call["function"]["name"], "input": args}
        )
    return {
        **skel,
        "content": content,
        **stop_fields("length" if warm else choice["finish_reason"], choice.get("stop_reason")),
        "usage": usage(chat.get("usage"), warm),
    }


class MessageEvents:
    """The chat stream's chunks in, Anthropic's stream events out."""

    def __init__(self, skel: dict, warm: bool = False):
        self.message = skel
        self.warm = warm  # max_tokens 0: no block, no output tokens (`message_body`)
        self.started = False
        self.index = -1  # the open block's index
        self.open: str | None = None  # "thinking", "text" or "tool_use"
        self.calls: set[int] = set()  # chat tool call indices given a block
        self.finish: tuple[str | None, object] = (None, None)
        self.usage: dict | None = None
        self.failed = False

    @staticmethod
    def event(kind: str, **fields) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"

    def chunk(self, c: dict) -> list[str]:
        if "error" in c:
            self.failed = True
            return self._start() + [self.event("error", error=error_body(500, c["error"])["error"])]
        if c.get("usage"):
            self.usage = c["usage"]
        out = self._start()
        for choice in [] if self.warm else c.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if self.open != "thinking":
                    out += self._open({"type": "thinking", "thinking": "", "signature": ""}, "thinking")
                out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
            if delta.get("content"):
                if self.open != "text":
                    out += self._open({"type": "text", "text": ""}, "text")
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or []:
                index, fn = call.get("index", 0), call.get("function") or {}
                if index not in self.calls:
                    self.calls.add(index)
                    block = {
                        "type": "tool_use",
                        "id": tool_id(call.get("id") or ""),
                        "name": fn.get("name"),
                        "input": {},
                    }
                    out += self._open(block, "tool_use")
                if fn.get("arguments"):
                    out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
            if choice.get("finish_reason"):
                self.finish = (choice["finish_reason"], choice.get("stop_reason"))
        return out

    def end(self) -> list[str]:
        if self.failed:
            return []
        out = self._start() + self._close()
        delta = stop_fields(*(("length", None) if self.warm else self.finish))
        out.append(self.event("message_delta", delta=delta, usage=usage(self.usage, self.warm)))
        return out + [self.event("message_stop")]

    def _start(self) -> list[str]:
        if self.started:
            return []
        self.started = True  # the first chunk carries the usage so far: the prompt's tokens
        return [self.event("message_start", message={**self.message, "usage": usage(self.usage, self.warm)})]

    def _open(self, block: dict, kind: str) -> list[str]:
        out = self._close()
        self.index += 1
        self.open = kind
        return out + [self.event("content_block_start", index=self.index, content_block=block)]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [self.event("content_block_stop", index=self.index)]

    def _delta(self, delta: dict) -> str:
        return self.event("content_block_delta", index=self.index, delta=delta)
