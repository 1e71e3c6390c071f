"""The Responses API's answers, made from the chat completion that served the request.

`response_body` turns a whole chat completion into a `response` object: the assistant's text as one
`message` output item (omitted when the answer is only tool calls; an answer of no text and no calls
is one empty message, as a client reading `output[0]` expects), each tool call as a
`function_call` item, usage as `input_tokens` / `output_tokens`, and a `length` finish as status
`incomplete` with `incomplete_details.reason = "max_output_tokens"` (on the last item too, and on a
reasoning item with nothing after it: the limit was spent thinking). The message's `output_text`
logprobs are its own tokens' (`message_logprobs`: the reasoning's are left out), streamed or not.

`ResponseEvents` turns the chat stream's chunks into the typed events a Responses stream carries,
each with its `sequence_number`: `response.created`, `response.in_progress`, per item
`response.output_item.added` ... `.done` (text through `response.content_part.*` and
`response.output_text.delta` / `.done`; calls through `response.function_call_arguments.delta` /
`.done`; a thinking model's reasoning, `kvgate.server.reasoning`, as a `reasoning` item before the message,
its text a `reasoning_text` content part through `response.reasoning_text.delta` / `.done`, its summary
empty, as vLLM gives it), and last `response.completed` or `response.incomplete` with the whole response. A failure
mid-stream is an `error` event and `response.failed`. kvgate's own `usage.budget_cap` rides along.
"""

from __future__ import annotations

import json
import uuid

PART = {"reasoning": "reasoning_text", "message": "output_text"}  # an item's content part type


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def skeleton(body: dict, rid: str, created: int, model: str) -> dict:
    """A response object's fields as the request set them, status in_progress, no output yet."""
    text = body.get("text") if isinstance(body.get("text"), dict) else {}
    fmt = text.get("format")
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": model,
        "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None, **(body.get("reasoning") or {})},
        "store": False,  # the route sets whether it keeps this one (--responses-store)
        "temperature": body.get("temperature"),
        "text": {
            "format": fmt or {"type": "text"},
            **({"verbosity": text["verbosity"]} if text.get("verbosity") else {}),
        },
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
        "truncation": body.get("truncation") or "disabled",
        "usage": None,
        "metadata": body.get("metadata") or {},
        "user": body.get("user"),
    }


def usage(chat_usage: dict | None) -> dict | None:
    if chat_usage is None:
        return None
    out = {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {
            "reasoning_tokens": (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
        },
        "total_tokens": chat_usage["total_tokens"],
    }
    if chat_usage.get("budget_cap") is not None:
        out["budget_cap"] = chat_usage["budget_cap"]
    return out


def message_item(
    text: str, logprobs: list | None, status: str = "completed", item_id: str | None = None
) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {
        "type": "message",
        "id": item_id or new_id("msg_"),
        "status": status,
        "role": "assistant",
        "content": [part],
    }


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    content = [{"type": "reasoning_text", "text": text}]
    return {
        "type": "reasoning",
        "id": item_id or new_id("rs_"),
        "summary": [],
        "content": content,
        "status": status,
    }


def call_item(
    call_id: str, name: str, arguments: str, status: str = "completed", item_id: str | None = None
) -> dict:
    return {
        "type": "function_call",
        "id": item_id or new_id("fc_"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def finish(response: dict, finish_reason: str | None) -> dict:
    if finish_reason == "length":  # the last item was cut short: it says so too
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
        if response["output"]:
            response["output"][-1]["status"] = "incomplete"
    else:
        response["status"] = "completed"
    return response


def message_logprobs(chat: dict) -> list | None:
    """The logprobs of the message's text: the chat choice's, less those of the tokens its reasoning
    took (usage's `reasoning_tokens`: the think block and its tags, always the first ones). The
    chat answer reports every token's, as vLLM's does; a Responses `output_text` part reports its own
    text's, and a reasoning item has none (OpenAI's schema)."""
    lps = (chat["choices"][0].get("logprobs") or {}).get("content")
    details = (chat.get("usage") or {}).get("completion_tokens_details") or {}
    return lps[details.get("reasoning_tokens", 0) :] if lps else lps


def response_body(chat: dict, skel: dict) -> dict:
    choice = chat["choices"][0]
    msg = choice["message"]
    output = []
    if msg.get("reasoning_content"):  # cut inside it (nothing after it): incomplete, as the stream says
        cut = choice["finish_reason"] == "length" and not (msg.get("content") or msg.get("tool_calls"))
        output.append(reasoning_item(msg["reasoning_content"], "incomplete" if cut else "completed"))
    if msg.get("content") or not msg.get("tool_calls"):
        output.append(message_item(msg["content"], message_logprobs(chat)))
    for call in msg.get("tool_calls") or []:
        output.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    return finish({**skel, "output": output, "usage": usage(chat.get("usage"))}, choice["finish_reason"])


class ResponseEvents:
    """The chat stream's chunks in, the Responses stream's SSE events out."""

    def __init__(self, skel: dict, on_final=None):
        """`on_final(response)`: called with the finished response before its last event is written
        (it may still change it: whether the store kept it)."""
        self.response = skel
        self.on_final = on_final
        self.seq = 0
        self.output: list[dict] = []
        self.item: dict | None = None  # the reasoning or message item being written (`_piece`)
        self.parts: list[str] = []  # its text so far
        self.logprobs: list = []  # the message's
        self.pending: list = []  # logprobs of tokens whose text has not come yet
        self.calls: dict[int, dict] = {}  # chat tool call index -> its open function_call item
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.error: dict | None = None
        self.done = False  # the last event is written (end), or the client left (abandon)

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        return [
            self.event("response.created", response=self.response),
            self.event("response.in_progress", response=self.response),
        ]

    def chunk(self, c: dict) -> list[str]:
        if "error" in c:
            self.error = c["error"]
            err = c["error"]
            return [
                self.event("error", code=err.get("code"), message=err.get("message"), param=err.get("param"))
            ]
        out: list[str] = []
        if c.get("usage"):
            self.usage = c["usage"]
        for choice in c.get("choices") or []:
            delta = choice.get("delta") or {}
            # a token whose text is held back (a partial character) brings its logprobs on a chunk
            # with no text: they ride on the next text delta. A token the reasoning took comes on a
            # reasoning delta (`StreamShaper.token`, "" when it added no text): its logprobs, and those
            # held before it, are not the message's (the whole answer's: `message_logprobs`)
            self.pending += (choice.get("logprobs") or {}).get("content") or []
            if "reasoning_content" in delta:
                self.pending = []
                if delta["reasoning_content"]:
                    out += self._piece("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                out += self._piece("message", delta["content"], self.pending)
                self.pending = []
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def abandon(self) -> None:
        """The client left mid-stream: what it was sent is kept as the response, status `cancelled`, the
        item being written `incomplete`, so the ids it holds stay good (QA pass 16: the AI SDK sends a
        stopped answer's message id back as an item_reference, and each later turn was a 400)."""
        if self.done:
            return
        self.done = True
        self._cut_open_items()
        self.response = {
            **self.response,
            "output": self.output,
            "status": "cancelled",
            "usage": usage(self.usage),
        }
        if self.on_final is not None:
            self.on_final(self.response)

    def end(self) -> list[str]:
        self.done = True
        if self.error is not None:  # no item is done: what was written stays, marked incomplete
            self._cut_open_items()
            err = {"code": self.error.get("code"), "message": self.error.get("message")}
            self.response = {**self.response, "output": self.output, "status": "failed", "error": err}
            return [self.event("response.failed", response=self.response)]
        # the item being written when max_output_tokens cut the answer is done as "incomplete" (`_close`)
        answered = any(item["type"] != "reasoning" for item in self.output)
        out = [] if answered else self._open("message")  # no text and no call: one empty message
        out += self._close()
        last = self.output[-1] if self.finish_reason == "length" else None
        for index in sorted(self.calls):
            out += self._close_call(index, "incomplete" if self.calls[index] is last else "completed")
        self.response = {**self.response, "output": self.output, "usage": usage(self.usage)}
        finish(self.response, self.finish_reason)
        if self.on_final is not None:
            self.on_final(self.response)
        kind = "response.incomplete" if self.response["status"] == "incomplete" else "response.completed"
        return out + [self.event(kind, response=self.response)]

    # ---- items -------------------------------------------------------------------------------------
    # A reasoning item and a message item are written alike (one content part, its deltas, its done
    # events), one at a time, the reasoning first: `self.item` is the one being written, `self.parts`
    # its text so far.
    def _cut_open_items(self) -> None:
        """The items still being written end as written so far, `incomplete` (an error, a client gone)."""
        if self.item is not None:
            self.output[self.output.index(self.item)] = self._made("incomplete")
        for item in self.calls.values():
            item["status"] = "incomplete"

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.output.index(item)}

    def _made(self, status: str) -> dict:
        """The item being written, as written so far."""
        text, item_id = "".join(self.parts), self.item["id"]
        if self.item["type"] == "reasoning":
            return reasoning_item(text, status, item_id)
        return message_item(text, self.logprobs, status, item_id)

    def _piece(self, kind: str, piece: str, logprobs: list | None = None) -> list[str]:
        """A piece of the reasoning (`kind` "reasoning") or of the message ("message", with its tokens'
        logprobs), its item opened first when it is not the one being written."""
        out = [] if self.item is not None and self.item["type"] == kind else self._open(kind)
        self.parts.append(piece)
        extra = {}
        if kind == "message":
            self.logprobs += logprobs or []
            extra["logprobs"] = logprobs or []
        where = self._where(self.item)
        out.append(self.event(f"response.{PART[kind]}.delta", content_index=0, delta=piece, **extra, **where))
        return out

    def _open(self, kind: str) -> list[str]:
        out = self._close()
        if kind == "reasoning":
            self.item = reasoning_item("", "in_progress")
        else:
            self.item = message_item("", None, "in_progress")
        part = self.item["content"].pop()  # the item is added with no part; the part comes next
        self.output.append(self.item)
        self.parts, self.logprobs = [], []
        return out + [
            self.event("response.output_item.added", output_index=len(self.output) - 1, item=self.item),
            self.event("response.content_part.added", content_index=0, part=part, **self._where(self.item)),
        ]

    def _close(self) -> list[str]:
        """The item being written is done: `incomplete` when max_output_tokens cut the answer in it (it
        is the last item), as the final response says (`finish`), so a client that builds its output from
        these events agrees; else `completed`."""
        item = self.item
        if item is None:
            return []
        if item["type"] == "message":  # logprobs of tokens whose text never came (held to the end)
            self.logprobs += self.pending
            self.pending = []
        cut = self.finish_reason == "length" and self.output[-1] is item
        done = self._made("incomplete" if cut else "completed")
        where = self._where(item)
        self.output[where["output_index"]], self.item = done, None
        part = done["content"][0]
        extra = {"logprobs": part["logprobs"]} if item["type"] == "message" else {}
        return [
            self.event(
                f"response.{PART[item['type']]}.done", content_index=0, text=part["text"], **extra, **where
            ),
            self.event("response.content_part.done", content_index=0, part=part, **where),
            self.event("response.output_item.done", output_index=where["output_index"], item=done),
        ]

    def _call(self, delta: dict) -> list[str]:
        index = delta.get("index", 0)
        fn = delta.get("function") or {}
        out = []
        if index not in self.calls:
            out += self._close()
            for open_index in sorted(self.calls):  # calls come one after another: the last is done
                out += self._close_call(open_index)
            item = call_item(
                delta.get("id") or new_id("call_"), fn.get("name") or "", "", status="in_progress"
            )
            self.calls[index] = item
            self.output.append(item)
            out.append(self.event("response.output_item.added", output_index=len(self.output) - 1, item=item))
        item = self.calls[index]
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            out.append(
                self.event(
                    "response.function_call_arguments.delta", delta=fn["arguments"], **self._where(item)
                )
            )
        return out

    def _close_call(self, index: int, status: str = "completed") -> list[str]:
        item = self.calls.pop(index)
        where = self._where(item)
        item["status"] = status
        return [
            self.event(
                "response.function_call_arguments.done",
                name=item["name"],
                arguments=item["arguments"],
                **where,
            ),
            self.event("response.output_item.done", output_index=where["output_index"], item=item),
        ]
