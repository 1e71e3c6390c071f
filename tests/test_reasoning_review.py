"""Review fixes to reasoning output (session 47): the Responses API's reasoning item cut by
max_output_tokens, the message's logprobs less the reasoning's, a repeated `<think>` under a grammar,
and the Messages API's thinking blocks and `thinking` config.

The servers are tests/test_reasoning.py's (a tiny model with `<think>` and `</think>` as added tokens,
its sampler following `Script.ids`). Each test says in its docstring what was undone to see it red.
"""

from __future__ import annotations

import json

import httpx
import pytest

from kvgate.server import reasoning as R
from kvgate.server.messages_input import to_chat
from tests.test_reasoning import CHAT, MSG, THOUGHT, Script, ids_of, qwen3, r1, scripted, spell  # noqa: F401 (fixtures)

RESPONSES = "/v1/responses"


def responses_stream(base: str, body: dict) -> list[dict]:
    with httpx.stream("POST", base + RESPONSES, json={**body, "stream": True}, timeout=60) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def statuses(output: list[dict]) -> list[tuple[str, str]]:
    return [(item["type"], item["status"]) for item in output]


@pytest.mark.parametrize(
    "script,want",
    [
        (lambda e: spell(THOUGHT), [("reasoning", "incomplete"), ("message", "incomplete")]),
        (
            lambda e: spell("Hm.", ids_of(e, R.CLOSE), THOUGHT),
            [("reasoning", "completed"), ("message", "incomplete")],
        ),
    ],
)
def test_a_reasoning_item_cut_by_max_output_tokens_is_incomplete_whole_and_streamed(r1, script, want):  # noqa: F811
    """max_output_tokens spent inside the think block: the reasoning item is `incomplete` (and the
    empty message after it) in the whole response, the stream's final response and its
    output_item.done events alike; cut in the answer, the reasoning is `completed`. Seen red with
    `response_body` marking the reasoning item `completed` always (as before: WHOLE
    [reasoning completed, message incomplete], STREAM [reasoning incomplete, message incomplete])."""
    base, e = r1
    Script.ids = script(e)
    body = {"model": "tiny", "input": "Capital?", "max_output_tokens": 6}
    whole = httpx.post(base + RESPONSES, json=body, timeout=60).json()
    events = responses_stream(base, body)
    final = events[-1]["response"]
    done = [ev["item"] for ev in events if ev["type"] == "response.output_item.done"]
    assert whole["status"] == final["status"] == "incomplete"
    assert statuses(whole["output"]) == statuses(final["output"]) == statuses(done) == want


@pytest.mark.parametrize("tag", ["token", "text"])
def test_the_message_logprobs_leave_out_the_reasoning_tokens(r1, tag):  # noqa: F811
    """`include: ["message.output_text.logprobs"]` on a thinking model's answer: the output_text
    part's logprobs are its own tokens' (the chat choice's less the first `reasoning_tokens`: the
    think block and its tag, here `</think>` as its own token and spelled over several), whole and
    streamed (the deltas' and the done part's); the chat completion keeps every token's, as vLLM's
    does. Seen red with `message_logprobs` returning the choice's whole list (whole: 15 entries where
    the message's are 8), and with `ResponseEvents.chunk` no longer dropping a reasoning chunk's logprobs
    (the first delta carried the reasoning's too); with the stream shaper's reasoning chunk for a
    token that added no reasoning text left out, the tag's tokens rode on the first delta (red too)."""
    base, e = r1
    close = ids_of(e, R.CLOSE) if tag == "token" else R.CLOSE
    Script.ids = spell("Short.", close, "\n\nParis.")
    chat = httpx.post(base + CHAT, json={"messages": MSG, "max_tokens": 40, "logprobs": True}).json()
    every = chat["choices"][0]["logprobs"]["content"]
    spent = chat["usage"]["completion_tokens_details"]["reasoning_tokens"]
    assert len(every) == chat["usage"]["completion_tokens"] - 1  # every token's but the end token's
    assert "".join(t["token"] for t in every[spent:]) == "\n\nParis."
    body = {"model": "tiny", "input": "Capital?", "max_output_tokens": 40}
    body["include"] = ["message.output_text.logprobs"]
    whole = httpx.post(base + RESPONSES, json=body, timeout=60).json()
    part = whole["output"][-1]["content"][0]
    assert (whole["output"][0]["type"], part["text"]) == ("reasoning", "Paris.")
    assert [t["token"] for t in part["logprobs"]] == [t["token"] for t in every[spent:]]
    events = responses_stream(base, body)
    deltas = [t for ev in events if ev["type"] == "response.output_text.delta" for t in ev["logprobs"]]
    (done,) = [ev for ev in events if ev["type"] == "response.output_text.done"]
    assert (
        [t["token"] for t in deltas]
        == [t["token"] for t in done["logprobs"]]
        == [t["token"] for t in part["logprobs"]]
    )
    chunks = [
        json.loads(x[6:]) for x in _chat_lines(base, {"messages": MSG, "max_tokens": 40, "logprobs": True})
    ]
    streamed = [
        t for c in chunks for ch in c["choices"] for t in (ch.get("logprobs") or {}).get("content") or []
    ]
    assert [t["token"] for t in streamed] == [t["token"] for t in every]  # the chat stream: every token's


def _chat_lines(base: str, body: dict) -> list[str]:
    with httpx.stream("POST", base + CHAT, json={**body, "stream": True}, timeout=60) as r:
        return [line for line in r.iter_lines() if line.startswith("data: {")]


def test_a_grammar_takes_the_output_opening_the_block_again(r1):  # noqa: F811
    """R1's template opens `<think>` in the prompt, and an R1 model may open it again as its own token:
    under response_format the grammar allows that repeat (the splitter drops it), so the reasoning and
    the answer are the script's. Seen red with `wrap_grammar`'s optional opening taken out: the
    forbidden `<think>` token lost to another (a newline here, which the splitter then dropped, so
    only the generated ids showed it)."""
    base, e = r1
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {**schema, "additionalProperties": False}},
    }
    Script.ids = spell(ids_of(e, R.OPEN), "\nPlan: 7.", ids_of(e, R.CLOSE), "\n\n", '{"a": 7}')
    body = {"messages": MSG, "max_tokens": 60, "response_format": fmt, "return_token_ids": True}
    choice = httpx.post(base + CHAT, json=body).json()["choices"][0]
    assert choice["token_ids"][: len(Script.ids)] == Script.ids  # each scripted token was allowed
    msg = choice["message"]
    assert (msg["reasoning_content"], json.loads(msg["content"])) == ("Plan: 7.", {"a": 7})


THINKING_ONLY = [
    *MSG,
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "Cut while", "signature": ""}]},
    {"role": "user", "content": "Go on."},
]


def test_a_replayed_thinking_block_is_the_turns_reasoning_content(r1):  # noqa: F811
    """Messages: an assistant turn's thinking blocks go to the template as the chat message's
    `reasoning_content` (as the chat and Responses paths pass it), and a turn of thinking alone (cut
    while thinking) is an assistant turn with empty content, not a 400; a final such turn asks for no
    prefill. Seen red with the thinking blocks dropped before the schema read them (as before: the
    turn's reasoning lost, and `messages.1: all messages must have non-empty content`)."""
    base, _ = r1
    chat, _ = to_chat({"model": "tiny", "max_tokens": 9, "messages": THINKING_ONLY})
    assert chat["messages"][1] == {"role": "assistant", "content": "", "reasoning_content": "Cut while"}
    both = [
        *MSG,
        {"role": "assistant", "content": [THINKING_ONLY[1]["content"][0], {"type": "text", "text": "Hi"}]},
    ]
    chat, _ = to_chat({"model": "tiny", "max_tokens": 9, "messages": [*both, MSG[0]]})
    assert chat["messages"][1]["reasoning_content"] == "Cut while"
    chat, _ = to_chat({"model": "tiny", "max_tokens": 9, "messages": THINKING_ONLY[:2]})
    assert len(chat["messages"]) == 1 and "continue_final_message" not in chat
    Script.ids = spell("Hm.</think>Paris.")
    r = httpx.post(base + "/v1/messages", json={"model": "tiny", "max_tokens": 30, "messages": THINKING_ONLY})
    assert r.status_code == 200, r.text
    assert r.json()["content"][-1] == {"type": "text", "text": "Paris."}


def test_messages_thinking_disabled_and_enabled(qwen3):  # noqa: F811
    """`thinking: {type: disabled}` is `enable_thinking: false` (Qwen3's template closes the block in
    the prompt, so a `<think>` the model writes anyway is text); `enabled` with `budget_tokens` is
    served (the budget not enforced). Seen red with the mapping taken out (a thinking block "a" and
    text "b") and with `enabled` refused again (400)."""
    base, _ = qwen3
    Script.ids = spell("<think>a</think>b")
    body = {"model": "tiny", "max_tokens": 30, "messages": MSG}
    off = httpx.post(base + "/v1/messages", json={**body, "thinking": {"type": "disabled"}}).json()
    assert off["content"] == [{"type": "text", "text": "<think>a</think>b"}]
    on = httpx.post(
        base + "/v1/messages", json={**body, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    )
    assert on.status_code == 200, on.text
    assert [b["type"] for b in on.json()["content"]] == ["thinking", "text"]
