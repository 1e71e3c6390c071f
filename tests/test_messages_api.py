"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) driven by the official anthropic
SDK against a live server on the tiny model. Each answer is held to the chat completion the same
conversation gets (`messages_input.to_chat`): same text, same tokens, same usage.

Seen red: with the system prompt left out of the chat body (texts differ), with `any` mapped to
`auto` (no tool_use block), with the stop string's name dropped (stop_sequence None), with
message_start's usage taken before the first chunk (input_tokens 0), with `cache_read_input_tokens`
counted inside `input_tokens`, with the assistant prefill sent as a new turn, and with `x-api-key`
not read (401)."""

from __future__ import annotations

import json

import httpx
import pytest

from kvgate.server.messages_output import error_body, stop_fields
from tests.tiny_model import make_tiny_hf_dir

anthropic = pytest.importorskip("anthropic")

SYSTEM = "You are brief."
TURN = [{"role": "user", "content": "What is the weather like?"}]
TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},  # a random model's stays short
            "required": ["city"],
        },
    }
]
CHAT = "/v1/chat/completions"
GREEDY = {"temperature": 0}  # no longer among the SDK's own arguments; the server still reads it


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A server on the tiny model with a 4k context (a tool's rendered description alone is ~500 of its
    tokens)."""
    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine
    from tests.server_util import running_server

    d = make_tiny_hf_dir(tmp_path_factory.mktemp("tiny4k"), geometry={"max_pos": 4096})
    cfg = EngineConfig(kv_cache_bytes=32 << 20, memory_limit="2GiB", dtype="float32", device="cpu")
    e = Engine.from_model(str(d), cfg, overhead_bytes=0).start()
    with running_server(e, model_name="tiny") as (b, _app):
        yield b
    e.shutdown()


def client(base: str, **kw):
    return anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, **kw)


def chat(base: str, **body) -> dict:
    r = httpx.post(base + CHAT, json={"temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_message_is_the_chat_answer_to_the_same_conversation(base):
    c = client(base)
    ref = chat(base, messages=[{"role": "system", "content": SYSTEM}, *TURN], max_tokens=12)
    m = c.messages.create(model="tiny", max_tokens=12, system=SYSTEM, messages=TURN, extra_body=GREEDY)
    choice = ref["choices"][0]
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == choice["message"]["content"]
    assert m.stop_reason == stop_fields(choice["finish_reason"], None)["stop_reason"]
    total = m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert (
        total == ref["usage"]["prompt_tokens"] and m.usage.output_tokens == ref["usage"]["completion_tokens"]
    )
    assert m.usage.cache_read_input_tokens > 0  # the chat request before it left the prompt's blocks cached
    assert m.id.startswith("msg_") and m.role == "assistant" and m.model == "tiny"
    counted = c.messages.count_tokens(model="tiny", system=SYSTEM, messages=TURN)
    assert counted.input_tokens == total


def test_the_stream_gives_the_same_message(base):
    c = client(base)
    ask = dict(model="tiny", max_tokens=12, system=SYSTEM, messages=TURN, extra_body=GREEDY)
    whole = c.messages.create(**ask)
    with c.messages.stream(**ask) as s:
        texts = list(s.text_stream)
        final = s.get_final_message()
    assert "".join(texts) == whole.content[0].text == final.content[0].text and len(texts) > 1
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    raw = {**{k: v for k, v in ask.items() if k != "extra_body"}, **GREEDY, "stream": True}
    with httpx.stream("POST", base + "/v1/messages", json=raw, timeout=60) as r:
        kinds = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    with httpx.stream("POST", base + "/v1/messages", json=raw, timeout=60) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    assert '"input_tokens": 0,' not in first  # message_start counts the prompt


def test_a_stop_sequence_is_named(base):
    c = client(base)
    free = c.messages.create(model="tiny", max_tokens=12, messages=TURN, extra_body=GREEDY).content[0].text
    word = next(w for w in free[2:].split() if w not in free[:2])
    ask = dict(
        model="tiny", max_tokens=12, messages=TURN, extra_body=GREEDY, stop_sequences=["\u2603\u2603", word]
    )
    m = c.messages.create(**ask)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", word) and word not in m.content[0].text
    with c.messages.stream(**ask) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", word)


def test_tool_use_and_its_result_round_trip(base):
    c = client(base)
    ask = dict(model="tiny", max_tokens=200, messages=TURN, tools=TOOLS, extra_body=GREEDY)
    m = c.messages.create(**ask, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    calls = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(calls) == 1, m
    assert calls[0].name == "get_weather" and isinstance(calls[0].input.get("city"), str)
    assert calls[0].id.startswith("toolu_")  # Anthropic's form of an id (red: call_...)
    hot = httpx.post(
        base + "/v1/messages", json={"model": "tiny", "max_tokens": 2, "messages": TURN, "temperature": 1.5}
    )
    assert (hot.status_code, hot.json()["error"]["param"]) == (400, "temperature")  # Anthropic's range, 0-1
    with c.messages.stream(**ask, tool_choice={"type": "tool", "name": "get_weather"}) as s:
        final = s.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and streamed and streamed[0].name == "get_weather"
    turns = [
        *TURN,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "Sunny"}],
        },
    ]
    answer = c.messages.create(model="tiny", max_tokens=8, messages=turns, extra_body=GREEDY)
    call = {"id": calls[0].id, "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": json.dumps(calls[0].input)}
    ref = chat(
        base,
        max_tokens=8,
        messages=[
            *TURN,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": calls[0].id, "content": "Sunny"},
        ],
    )
    got = "".join(b.text for b in answer.content if b.type == "text")
    assert got == (ref["choices"][0]["message"]["content"] or "")
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == ref["usage"]["prompt_tokens"]


def test_an_assistant_turn_at_the_end_is_continued(base):
    c = client(base)
    turns = [*TURN, {"role": "assistant", "content": "It is"}]
    m = c.messages.create(model="tiny", max_tokens=6, messages=turns, extra_body=GREEDY)
    ref = chat(base, messages=turns, max_tokens=6, continue_final_message=True, add_generation_prompt=False)
    assert m.content[0].text == ref["choices"][0]["message"]["content"]


def test_errors_come_in_anthropics_body_with_the_numbers(base):
    c = client(base)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="tiny", max_tokens=10**6, messages=TURN, stream=True)
    err = e.value.body["error"]
    assert e.value.body["type"] == "error" and err["type"] == "invalid_request_error"
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert err["positions"] > err["positions_limit"] and "max_tokens" in err["message"]
    r = httpx.post(base + "/v1/messages", json={"model": "tiny", "messages": TURN}, timeout=30)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "max_tokens")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [image]}]}
    r = httpx.post(base + "/v1/messages", json=body, timeout=30)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "messages.0.content.0"), r.text
    with pytest.raises(anthropic.NotFoundError):
        c.messages.create(model="claude-sonnet", max_tokens=4, messages=TURN)
    body = {"model": "tiny", "max_tokens": 4, "messages": TURN, "stop_sequences": ["a"] * 9}
    r = httpx.post(base + "/v1/messages", json=body, timeout=30)
    assert r.json()["error"]["param"] == "stop_sequences" and r.json()["error"]["message"].startswith(
        "stop_sequences"
    )


def test_overload_types_and_the_api_key_header(make_engine):
    from tests.server_util import running_server

    assert error_body(429, {"message": "m", "code": "c"})["error"]["type"] == "rate_limit_error"
    assert error_body(503, {"message": "m", "code": "queue_full"})["error"] == {
        "type": "overloaded_error",
        "message": "m",
        "code": "queue_full",
    }
    with running_server(make_engine(), api_key="sekret") as (base, _app):
        with pytest.raises(anthropic.AuthenticationError):
            client(base).messages.create(model="tiny", max_tokens=2, messages=TURN)
        keyed = anthropic.Anthropic(base_url=base, api_key="sekret", max_retries=0)  # sends a Bearer header
        assert keyed.messages.create(model="tiny", max_tokens=2, messages=TURN).usage.output_tokens >= 1
        body = {"model": "tiny", "max_tokens": 2, "messages": TURN}  # earlier SDKs and curl: x-api-key
        for key, status in (("sekret", 200), ("wrong", 401)):
            r = httpx.post(base + "/v1/messages", json=body, headers={"x-api-key": key}, timeout=30)
            assert r.status_code == status, r.text
        assert r.json()["error"]["type"] == "authentication_error"  # Anthropic's body on its paths


def test_output_config_format_holds_the_answer_to_the_schema(base):
    """Structured output through `output_config.format`, as the chat path's strict json_schema (a random
    model's answer parses and validates only under the grammar). Red with the format dropped."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 8}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"],
        "additionalProperties": False,
    }
    m = client(base).messages.create(
        model="tiny",
        max_tokens=80,
        messages=TURN,
        output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"},
        extra_body=GREEDY,
    )
    assert m.stop_reason == "end_turn", m
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_claude_codes_body_fields_are_read(base):
    """What Claude Code (2.1, recorded session 45) sends beside the turns: system turns between them
    (the beta API's), thinking adaptive, output_config.effort, context_management, metadata and
    cache_control blocks. A system turn with clear_at next_user_message is shown only until a later user
    turn exists. Red with role system refused (Claude Code's first request was a 400) and with clear_at
    ignored (the prompt counts the cleared turn)."""
    note = {"role": "system", "content": "Agents: none.", "clear_at": "next_user_message"}
    later = [*TURN, {"role": "assistant", "content": "Rain."}, {"role": "user", "content": "And tomorrow?"}]
    body = {
        "model": "tiny",
        "max_tokens": 4,
        "messages": [*TURN, note],
        "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        "metadata": {"user_id": "{}"},
        "thinking": {"type": "adaptive"},
        "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    }
    r = httpx.post(base + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 200, r.text

    def counted(turns: list[dict]) -> int:
        body = {"model": "tiny", "messages": turns}
        return httpx.post(base + "/v1/messages/count_tokens", json=body, timeout=30).json()["input_tokens"]

    assert counted([*TURN, note]) > counted(TURN)  # no user turn after it: shown
    cleared = [*later[:1], note, *later[1:]]
    assert counted(cleared) == counted(later)  # a user turn after it: not shown
    kept = [*later[:1], {**note, "clear_at": "never"}, *later[1:]]
    assert counted(kept) > counted(later)


def test_a_tool_result_must_answer_the_previous_turns_call(base):
    """Anthropic's rule: each tool_result answers a tool_use block of the assistant turn just before
    it; else a 400 naming the block. Red with `_check_results` not called (the chat path's 400 then
    named a tool message, a word this API does not use)."""
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "x"}
    use = {"type": "tool_use", "id": "t2", "name": "get_weather", "input": {}}
    for turns in (
        [{"role": "user", "content": [result]}],
        [*TURN, {"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}],
    ):
        body = {"model": "tiny", "max_tokens": 2, "messages": turns}
        r = httpx.post(base + "/v1/messages", json=body, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == f"messages.{len(turns) - 1}.content.0", r.text
        assert "tool_result" in err["message"] and "'t1'" in err["message"]


def test_a_thread_is_refused_so_the_sdks_tool_runner_goes_on_without_one(base):
    """kvgate holds no conversation state: `thread` is a 400 with Anthropic's thread_unsupported_request
    details, on which the SDK's tool runner re-sends the turn unthreaded (the real model's test below
    runs it). Red with the details left out (the runner raised the 400)."""
    body = {"model": "tiny", "max_tokens": 2, "messages": TURN, "thread": {"type": "create"}}
    r = httpx.post(base + "/v1/messages", json=body, timeout=30)
    err = r.json()["error"]
    assert (r.status_code, err["param"]) == (400, "thread"), r.text
    assert err["details"] == {"error_code": "thread_unsupported_request", "unsupported": ["thread"]}


@pytest.mark.slow
def test_the_sdks_tool_runner_runs_on_smollm2(real_base):
    """The anthropic SDK's own agent loop, unmodified (`client.beta.messages.tool_runner` with a
    `@beta_tool` function): its first request asks for a thread, the 400 says none is held, and it goes
    on unthreaded; SmolLM2 calls the tool with a city, gets its answer back, and the loop runs its turns.
    Red with `thread` refused without Anthropic's details (the runner raised)."""
    called: list[str] = []

    @anthropic.beta_tool
    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: the city's name
        """
        called.append(city)
        return f"It is sunny in {city}."

    c = anthropic.Anthropic(base_url=real_base, api_key="unused", max_retries=0)
    runner = c.beta.messages.tool_runner(
        model="SmolLM2-135M-Instruct",
        max_tokens=60,
        tools=[get_weather],
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        extra_body=GREEDY,
        max_iterations=2,
    )
    replies = list(runner)
    assert len(replies) == 2 and all(m.stop_reason == "tool_use" for m in replies), replies
    assert len(called) == 2 and all(isinstance(city, str) and city for city in called), called


def test_anthropics_conversation_rules_and_error_body_everywhere_on_its_paths(base):
    """Session 45's review: a non-string role was a 500 (in OpenAI's body); Anthropic's conversation
    rules were not held (a tool_use left unanswered, a tool_result after text, empty content, a prefill
    ending in whitespace, a bad tool name or schema); count_tokens refused fields the SDK documents for
    it; a call cut by max_tokens was dropped whole but streamed; 401/404/405 on these paths came in
    OpenAI's body; max_tokens 0 (a cache warm-up) was a 400. Red with each fix undone in turn."""

    def post(body: dict, path: str = "/v1/messages", **kw) -> httpx.Response:
        return httpx.post(base + path, json={"model": "tiny", "max_tokens": 4, **body}, timeout=30, **kw)

    use = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "x"}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}
    cases = [
        ([{"role": [], "content": [{"type": "text", "text": "hi"}]}], "messages.0.role"),
        ([*TURN, {"role": "assistant", "content": [use]}, {"role": "user", "content": "next"}], "messages.2"),
        (
            [
                *TURN,
                {"role": "assistant", "content": [use]},
                {"role": "user", "content": [{"type": "text", "text": "a"}, result]},
            ],
            "messages.2.content.1",
        ),
        ([{"role": "user", "content": ""}], "messages.0.content"),
        ([{"role": "user", "content": [{"type": "text", "text": ""}]}], "messages.0.content.0.text"),
        ([*TURN, {"role": "assistant", "content": "It is "}], "messages.1.content"),
    ]
    for turns, param in cases:
        r = post({"messages": turns})
        body = r.json()
        assert (r.status_code, body["type"], body["error"]["param"]) == (400, "error", param), (turns, r.text)
    bad_tools = [
        ({**TOOLS[0], "name": "f\u00e9"}, "tools.0.name"),
        ({**TOOLS[0], "input_schema": {}}, "tools.0.input_schema.type"),
    ]
    for tool, param in bad_tools:
        assert post({"messages": TURN, "tools": [tool]}).json()["error"]["param"] == param
    fields = {"output_config": {"effort": "low"}, "cache_control": {"type": "ephemeral"}, "speed": "standard"}
    counted = httpx.post(
        base + "/v1/messages/count_tokens", json={"model": "tiny", "messages": TURN, **fields}, timeout=30
    )
    assert counted.status_code == 200, counted.text
    for method, path, status in (("GET", "/v1/messages", 405), ("POST", "/v1/messages/batches", 404)):
        r = httpx.request(method, base + path, timeout=30)
        assert (r.status_code, r.json()["type"]) == (status, "error"), r.text
    warm = post({"messages": TURN, "max_tokens": 0, "temperature": 0})
    assert (
        warm.status_code == 200
        and warm.json()["content"] == []
        and warm.json()["usage"]["output_tokens"] == 0
    )
    c = client(base)
    for limit in range(30, 66, 4):  # cut at every stage of a call (a character-level model): name, arguments
        cut = dict(model="tiny", max_tokens=limit, messages=TURN, tools=TOOLS, tool_choice={"type": "any"})
        whole = c.messages.create(**cut, extra_body=GREEDY)
        with c.messages.stream(**cut, extra_body=GREEDY) as s:
            streamed = s.get_final_message()
        assert whole.stop_reason == streamed.stop_reason
        got = [(b.type, b.input) for b in whole.content]
        assert got == [(b.type, b.input) for b in streamed.content], (limit, whole, streamed)


def test_a_system_turn_between_a_call_and_its_result_is_served(base):
    """The review of session 45: messages_rules allowed it, the chat path's check then refused it."""
    use = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "x"}}
    turns = [
        *TURN,
        {"role": "assistant", "content": [use]},
        {"role": "system", "content": "reminder"},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
    ]
    r = httpx.post(
        base + "/v1/messages", json={"model": "tiny", "max_tokens": 2, "messages": turns}, timeout=30
    )
    assert r.status_code == 200, r.text


def test_turns_of_one_role_in_a_row_are_one_turn(base):
    """Anthropic combines consecutive user (or assistant) turns into one; so does this server: two user
    turns in a row count as one turn holding both texts. Red without `merged` (two turns: more tokens)."""

    def counted(turns: list[dict]) -> int:
        body = {"model": "tiny", "messages": turns}
        return httpx.post(base + "/v1/messages/count_tokens", json=body, timeout=30).json()["input_tokens"]

    a, b = {"type": "text", "text": "What is"}, {"type": "text", "text": " the weather?"}
    one = counted([{"role": "user", "content": [a, b]}])
    assert counted([{"role": "user", "content": [a]}, {"role": "user", "content": [b]}]) == one
    assert counted([{"role": "user", "content": "What is"}, {"role": "user", "content": [b]}]) == one
