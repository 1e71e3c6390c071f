"""An answer of no text and no tool calls is still one `message` output item (with its tokens'
logprobs), whole and streamed, so a client reading `output[0].content[0].text` gets "" rather than an
IndexError. Seen red with the old rule (a message item only when the text was non-empty): both tests
failed on an empty `output`."""

from __future__ import annotations

import json

from kvgate.server.responses_output import ResponseEvents, response_body, skeleton

SKEL = skeleton({"input": "hi"}, "resp_x", 0, "m")
LOGPROB = {"token": "\u00e2", "logprob": -0.5, "bytes": [226], "top_logprobs": []}
USAGE = {
    "prompt_tokens": 3,
    "completion_tokens": 2,
    "total_tokens": 5,
    "prompt_tokens_details": {"cached_tokens": 0},
}


def _events(lines: list[str]) -> list[dict]:
    return [json.loads(line.split("data: ", 1)[1]) for line in lines]


def test_an_empty_answer_is_one_empty_message_item_whole():
    chat = {
        "choices": [
            {
                "message": {"role": "assistant", "content": ""},
                "finish_reason": "stop",
                "logprobs": {"content": [LOGPROB]},
            }
        ],
        "usage": USAGE,
    }
    out = response_body(chat, dict(SKEL))
    assert [item["type"] for item in out["output"]] == ["message"]
    assert out["output"][0]["content"][0]["text"] == ""
    assert out["output"][0]["content"][0]["logprobs"] == [LOGPROB]
    calls_only = {
        "choices": [
            {
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": USAGE,
    }
    assert [item["type"] for item in response_body(calls_only, dict(SKEL))["output"]] == ["function_call"]


def test_an_empty_answer_streams_one_empty_message_item_with_its_logprobs():
    events = ResponseEvents(dict(SKEL))
    lines = events.start()
    lines += events.chunk({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    # a token whose bytes make no text yet, then the end: its logprobs come on a chunk with no text
    lines += events.chunk({"choices": [{"index": 0, "delta": {}, "logprobs": {"content": [LOGPROB]}}]})
    lines += events.chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
    lines += events.chunk({"choices": [], "usage": USAGE})
    lines += events.end()
    kinds = [e["type"] for e in _events(lines)]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    final = _events(lines)[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["message"]
    assert final["output"][0]["status"] == "incomplete"
    assert final["output"][0]["content"][0] == {
        "type": "output_text",
        "text": "",
        "annotations": [],
        "logprobs": [LOGPROB],
    }
    assert [e["sequence_number"] for e in _events(lines)] == list(range(len(lines)))
