"""`POST /v1/responses`, OpenAI's Responses API, through the official openai client: text whole and
streamed, input items replayed as an agent framework sends them, function calls (the SDK's own stream
helper assembling them), structured output, and the 400s for what kvgate does not do. The tiny model
(random weights, a 4096-position context for the tools preamble) for the shapes; the real SmolLM2 for
the openai-agents SDK and LangChain's Responses mode (slow). Each test's docstring says how it was
seen red.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.server_util import running_server
from tests.tiny_model import make_tiny_hf_dir

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather",
    "parameters": CITY,
    "strict": True,
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine

    d = make_tiny_hf_dir(tmp_path_factory.mktemp("tiny4k-responses"), geometry={"max_pos": 4096})
    cfg = EngineConfig(kv_cache_bytes=32 << 20, memory_limit="2GiB", dtype="float32", device="cpu")
    e = Engine.from_model(str(d), cfg, overhead_bytes=0).start()
    with running_server(e) as (b, _app):
        yield b
    e.shutdown()


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def test_text_whole_and_streamed_agree_and_say_where_the_limit_cut_them(base):
    """Greedy, 6 output tokens: the whole response and the stream give the same text; both end
    `incomplete` for max_output_tokens (the cut item says so too); the stream's events come in the
    documented order with sequence numbers 0, 1, 2, ... and its deltas add up to the text. Seen red
    with `finish` ignoring a length finish (status completed), with the text item closed after
    the final event, and with the cut item's `output_item.done` saying "completed"."""
    args = dict(model="tiny", input="hello there", max_output_tokens=6, temperature=0)
    whole = client(base).responses.create(**args)
    assert (whole.status, whole.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert whole.output[0].status == "incomplete" and whole.usage.output_tokens == 6
    assert whole.id.startswith("resp_") and whole.store is True  # kept: --responses-store is on by default
    events = list(client(base).responses.create(**args, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == events[-4].text == final.output_text == whole.output_text
    assert final.usage.output_tokens == 6 and final.status == "incomplete"
    assert events[-2].item.status == "incomplete" == final.output[0].status  # QA pass 6's F2


def test_input_items_and_instructions_render_as_the_chat_messages_they_stand_for(base):
    """An agent's replayed turn (instructions; a user message of input_text parts; the assistant's
    text and its function call, with the ids and statuses the earlier response gave them; the call's
    output) prompts exactly as the chat messages it stands for: the same input_tokens. Seen red with
    the function call kept as a second assistant message instead of joining the text before it."""
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {
            "type": "message",
            "id": "msg_1",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Let me look.", "annotations": [], "logprobs": []}],
        },
        {"type": "function_call", "id": "fc_1", "status": "completed", "call_id": "call_9",
         "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_9", "output": "Sunny."},
    ]  # fmt: skip
    got = client(base).responses.create(
        model="tiny", instructions="Be brief.", input=items, tools=[TOOL], max_output_tokens=1
    )
    call = {
        "id": "call_9",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_9", "content": "Sunny."},
    ]
    tool = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
    chat = client(base).chat.completions.create(model="tiny", messages=messages, tools=[tool], max_tokens=1)
    assert got.usage.input_tokens == chat.usage.prompt_tokens


def test_a_required_function_call_through_the_sdks_stream_helper(base):
    """tool_choice required, one call: the SDK's `responses.stream` helper (which checks the event
    flow and assembles the items) ends `completed` with one function_call whose arguments validate,
    the same as the whole response's; the events are the call's added, argument deltas, done. Seen red
    with the call item's `output_item.done` left out (the helper alone did not notice: its final
    response is the one `response.completed` carries)."""
    args = dict(
        model="tiny",
        input="What is the weather in Paris?",
        tools=[TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=300,
        temperature=0,
    )
    whole = client(base).responses.create(**args)
    with client(base).responses.stream(**args) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    (call,) = final.output
    assert final.status == "completed" and call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), CITY)
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert [(o.type, o.name, o.arguments) for o in whole.output] == [(call.type, call.name, call.arguments)]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}


def test_a_json_schema_text_format_constrains_the_output(base):
    """text.format json_schema becomes the chat path's response_format: the random model's output
    parses and validates. Seen red with text.format dropped (free random text)."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    out = client(base).responses.create(
        model="tiny",
        input="Is it ok?",
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
        max_output_tokens=200,
        temperature=0,
    )
    jsonschema.validate(json.loads(out.output_text), schema)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools.0"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input.0.type"),  # reasoning items: taken
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0",
        ),
        ({"input": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]}, "input.1.role"),
        ({"max_output_tokens": 10**9}, "max_output_tokens"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
            "text.format",
        ),
        ({"frequency_penalty": 1}, "frequency_penalty"),
    ],
)
def test_what_kvgate_does_not_do_is_a_400_naming_the_responses_field(base, extra, param):
    """Seen red with `responses_param` not applied (max_completion_tokens, response_format)."""
    r = httpx.post(base + "/v1/responses", json={"model": "tiny", "input": "hi", **extra}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_reasoning_settings_are_accepted_and_given_back_as_chats_reasoning_effort_is(base):
    """QA pass 6's F6: openai-agents' `ModelSettings(reasoning=Reasoning(effort="low"))`, LangChain's
    `reasoning_effort` in Responses mode and pydantic-ai send `reasoning` here, where chat's
    `reasoning_effort` was already accepted. Seen red with the old `Reasoning` model: 400 "invalid
    field 'reasoning.effort': Input should be None". An unknown effort is still a 400 naming it."""
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 3}
    r = httpx.post(base + "/v1/responses", json={**body, "reasoning": {"effort": "low", "summary": "auto"}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["reasoning"] == {"effort": "low", "summary": "auto"}
    assert [item["type"] for item in out["output"]] == ["message"]  # no reasoning item: none was done
    r = httpx.post(base + "/v1/responses", json={**body, "reasoning": {"effort": "extreme"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.effort"


def test_what_eval_and_benchmark_clients_send_is_served(base):
    """QA pass 14: guidellm's Responses benchmark sends vLLM's `ignore_eos: true` and `stop: null` (every
    request was a 400), inspect_ai's openai provider sends `include: ["reasoning.encrypted_content"]` for
    a model it does not know (every sample a 400); an unknown field is refused as the chat endpoint
    refuses it, `unsupported_parameter` naming it (was pydantic's "Extra inputs are not permitted" under
    `invalid_schema`). Red with each of the three changes undone."""
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 6}
    r = httpx.post(base + "/v1/responses", json={**body, "ignore_eos": True, "stop": None}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["output_tokens"] == 6 and r.json()["status"] == "incomplete"
    r = httpx.post(
        base + "/v1/responses", json={**body, "include": ["reasoning.encrypted_content"]}, timeout=30
    )
    assert r.status_code == 200, r.text
    assert [i["type"] for i in r.json()["output"]] == ["message"]
    assert (
        "logprobs" not in r.json()["output"][0]["content"][0]
        or not r.json()["output"][0]["content"][0]["logprobs"]
    )
    r = httpx.post(base + "/v1/responses", json={**body, "foo_bar": 1}, timeout=30)
    err = r.json()["error"]
    assert (r.status_code, err["code"], err["param"]) == (400, "unsupported_parameter", "foo_bar"), err
    assert "unknown field; remove it" in err["message"]


def test_truncation_auto_drops_the_oldest_items_until_the_conversation_fits(base):
    """QA pass 8's M2: `truncation: "auto"` was accepted and ignored (a 400 context_length_exceeded, as
    with "disabled"). Now the oldest items go, with the tool result their call leaves behind, until the
    conversation fits; `instructions` stay. Seen red with the retry loop taken out (400)."""
    turns = []
    for i in range(6):  # ~1,000 byte tokens a turn: 6,000 against a 4,096-position context
        turns.append({"role": "user", "content": f"turn {i} " + "word " * 200})
        turns.append({"role": "assistant", "content": "ok"})
    body = {"model": "tiny", "instructions": "be brief", "input": [*turns, {"role": "user", "content": "hi"}]}
    body["max_output_tokens"] = 4
    r = httpx.post(base + "/v1/responses", json={**body, "truncation": "disabled"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    refused = _context_refusals(base)
    r = httpx.post(base + "/v1/responses", json={**body, "truncation": "auto"}, timeout=60)
    assert r.status_code == 200, r.text
    assert _context_refusals(base) == refused  # the cut is counted, not tried (the review: 1 a drop)
    out = r.json()
    assert out["truncation"] == "auto" and out["usage"]["input_tokens"] + 4 <= 4096
    assert out["usage"]["input_tokens"] > 3000  # only as much as it had to
    # only the newest item left and still too long: the refusal, with the numbers
    r = httpx.post(
        base + "/v1/responses", json={**body, "input": "x " * 5000, "truncation": "auto"}, timeout=60
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


def test_truncation_auto_also_fits_the_kv_pool(tmp_path):
    """A conversation inside the context but larger than the whole KV pool got the 400
    kv_budget_exceeded under `truncation: "auto"` (session 35's open end): the pool is a ceiling of the
    same kind, so the oldest items go until it fits. Seen red with the pool check taken out of `fits`
    (400 kv_budget_exceeded)."""
    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine

    d = make_tiny_hf_dir(tmp_path, geometry={"max_pos": 4096})
    cfg = EngineConfig(kv_cache_bytes=1 << 19, memory_limit="2GiB", dtype="float32", device="cpu")
    e = Engine.from_model(str(d), cfg, overhead_bytes=0).start()
    try:
        pool = e.sched_cfg.kv_positions
        assert pool < 3000, pool  # the pool, not the 4,096-position context, is what binds here
        with running_server(e) as (b, _app):
            turns = []
            for i in range(3):  # ~1,000 tokens a turn: 3,100 in all, inside the context
                turns += [
                    {"role": "user", "content": f"turn {i} " + "word " * 200},
                    {"role": "assistant", "content": "ok"},
                ]
            body = {
                "model": "tiny",
                "input": [*turns, {"role": "user", "content": "hi"}],
                "max_output_tokens": 4,
            }
            r = httpx.post(b + "/v1/responses", json=body, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["code"] == "kv_budget_exceeded", r.text
            r = httpx.post(b + "/v1/responses", json={**body, "truncation": "auto"}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["input_tokens"] + 4 <= pool
    finally:
        e.shutdown()


def _context_refusals(base: str) -> float:
    text = httpx.get(base + "/metrics").text
    return sum(
        float(x.split()[-1])
        for x in text.splitlines()
        if x.startswith("kvgate_rejections_total") and "context" in x
    )


def test_truncation_keeps_instructions_system_items_and_no_orphan_tool_result():
    """The review of QA pass 8's fix: a tool result whose call was dropped was sent alone (the usual
    agent turn: user, call with long arguments, its result), and a system item went first."""
    from kvgate.server.responses_truncation import without_oldest

    msgs = [{"role": "system"}, {"role": "assistant", "tool_calls": [{}]}, {"role": "tool"}, {"role": "user"}]
    origin = ["instructions", "input.0", "input.1", "input.2"]
    assert without_oldest(msgs, origin, 1) == ([msgs[0], msgs[3]], ["instructions", "input.2"])
    assert without_oldest(msgs, origin, 2) == without_oldest(msgs, origin, 1)  # the result went with its call
    assert without_oldest(msgs, origin, 3) is None  # the newest item stays
    turn = [{"role": "user"}, {"role": "assistant", "tool_calls": [{}]}, {"role": "tool"}]
    assert without_oldest(turn, ["input.0", "input.1", "input.2"], 2) is None  # never a result alone
    dev = [{"role": "developer"}, {"role": "user"}, {"role": "user", "content": "new"}]
    assert without_oldest(dev, ["input.0", "input.1", "input.2"], 1)[0] == [dev[0], dev[2]]


def test_responses_traffic_has_its_own_endpoint_label(base):
    """QA pass 6 (6B's F3): `/v1/responses` was counted as endpoint="other" in kvgate_requests_total,
    beside `/`, probes and typos. Seen red without "/v1/responses" in auth.ENDPOINTS. A kept response's
    routes share one template label, so ids never become series."""
    r = httpx.post(base + "/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 2})
    assert r.status_code == 200
    httpx.get(base + "/v1/responses/" + r.json()["id"])
    text = httpx.get(base + "/metrics").text
    assert 'kvgate_requests_total{endpoint="/v1/responses",status="200"}' in text
    assert 'kvgate_requests_total{endpoint="/v1/responses/{id}",status="200"}' in text
    assert r.json()["id"] not in text


def test_a_refusal_names_the_responses_fields_in_its_message_too(base):
    """QA pass 6's F9: the param was the Responses field, but the message named chat's
    ("max_completion_tokens=0 must be ...", "'logprobs' is not supported ... with tools"). Seen red
    without `responses_message`."""
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 0}
    err = httpx.post(base + "/v1/responses", json=body).json()["error"]
    assert err["param"] == "max_output_tokens" and "max_output_tokens" in err["message"]
    assert "max_completion_tokens" not in err["message"]
    # its second case, logprobs with tools, is served since session 40
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    body = {"model": "tiny", "input": "hi", "tools": [tool], "include": ["message.output_text.logprobs"]}
    body["max_output_tokens"] = 8
    assert httpx.post(base + "/v1/responses", json=body, timeout=60).status_code == 200


# ---- real clients on the real model --------------------------------------------------------------


@pytest.mark.slow
def test_the_openai_agents_sdk_runs_a_tool_agent_and_streams(real_base):
    """The openai-agents SDK, unmodified, on its Responses model: an agent that must call a tool gets
    the tool's answer; a plain agent answers, also streamed. Before /v1/responses every call was a 404."""
    pytest.importorskip("agents")
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # its traces would go to OpenAI

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"It is sunny in {city}."

    def agent(**settings) -> Agent:
        m = OpenAIResponsesModel(
            model="SmolLM2-135M-Instruct",
            openai_client=openai.AsyncOpenAI(base_url=real_base + "/v1", api_key="x"),
        )
        return Agent(
            name="weather",
            instructions="You answer weather questions using the tool.",
            tools=[get_weather],
            model=m,
            model_settings=ModelSettings(temperature=0, max_tokens=80, **settings),
            tool_use_behavior="stop_on_first_tool",
        )

    got = Runner.run_sync(agent(tool_choice="required"), "What is the weather in Paris?")
    assert got.final_output == "It is sunny in Paris."

    async def streamed():
        run = Runner.run_streamed(agent(tool_choice="none"), "Say hello.")
        events = [e async for e in run.stream_events()]
        return events, run.final_output

    events, text = asyncio.run(streamed())
    assert events and isinstance(text, str) and text.strip()


@pytest.mark.slow
def test_langchain_in_responses_mode_calls_a_tool_and_gives_structured_output(real_base):
    """LangChain's ChatOpenAI(use_responses_api=True): a required tool call, then structured output
    (its json_schema text format). Before /v1/responses both were 404s."""
    pytest.importorskip("langchain_openai")
    from pydantic import BaseModel

    from tests.server_util import langchain_weather

    llm, get_weather = langchain_weather(real_base, use_responses_api=True)
    ai = llm.bind_tools([get_weather], tool_choice="required").invoke("What is the weather in Paris?")
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather"

    class Answer(BaseModel):
        city: str
        sunny: bool

    assert isinstance(
        llm.with_structured_output(Answer).invoke("Is it sunny in Paris? Answer as JSON."), Answer
    )


def test_output_text_logprobs_come_whole_and_with_each_delta(base):
    """include message.output_text.logprobs with top_logprobs 2: one entry per output token, each with
    two alternatives, whole and streamed alike. Seen red with include not turned into the chat
    request's logprobs (empty lists), and with the logprobs of a chunk without text dropped (a token
    whose partial character is held back: 3 entries streamed against 4, shifted)."""
    args = dict(
        model="tiny",
        input="hi",
        max_output_tokens=4,
        temperature=0,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    whole = client(base).responses.create(**args)
    lps = whole.output[0].content[0].logprobs
    assert len(lps) == 4 and all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in lps)
    events = list(client(base).responses.create(**args, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [(lp.token, lp.logprob) for lp in streamed] == [(lp.token, lp.logprob) for lp in lps]
    # top_logprobs without include asks for nothing, as OpenAI's (QA pass 8's L3; red: 4 entries)
    del args["include"]
    assert not client(base).responses.create(**args).output[0].content[0].logprobs


def test_a_step_that_fails_mid_stream_ends_in_an_error_event_and_response_failed(make_engine):
    """The chat stream's error event becomes the Responses `error` event, then `response.failed` with
    the error's code: the client learns the answer is broken, not cut. Seen red with the chat error
    chunk read as an ordinary chunk (the stream ended `response.incomplete`)."""
    import threading

    from kvgate.core.testing import set_step_hook

    e = make_engine()
    fired = threading.Event()

    def fail_a_decode(so):
        if so.decodes and not fired.is_set():
            fired.set()
            raise RuntimeError("step failed on purpose")

    with running_server(e) as (b, _):
        set_step_hook(e, fail_a_decode)
        events = list(client(b).responses.create(model="tiny", input="hi", max_output_tokens=20, stream=True))
        set_step_hook(e, None)
    assert fired.is_set() and [ev.type for ev in events[-2:]] == ["error", "response.failed"]
    assert events[-2].code == "engine_error" and events[-1].response.error.code == "engine_error"
    assert events[-1].response.status == "failed"


def test_a_wrong_tool_choice_is_told_the_responses_shape_and_allowed_tools_is_refused_by_name(base):
    """QA pass 9 (LOW): a wrong `tool_choice` here was told to send the chat shape, which this endpoint
    then refused, and `allowed_tools` (in the SDK's types, mapped by LangChain) got the same message.
    Also `text.verbosity` is given back as sent. Seen red with the chat endpoint's message, without the
    allowed_tools refusal, and without verbosity in the response."""
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, "tools": tools}
    chat_shape = {"type": "function", "function": {"name": "f"}}
    err = httpx.post(base + "/v1/responses", json={**body, "tool_choice": chat_shape}, timeout=60).json()[
        "error"
    ]
    assert (
        err["param"] == "tool_choice"
        and '{"type": "function", "name": "..."}' in err["message"].split("(")[0]
    )
    allowed = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "f"}]}
    r = httpx.post(base + "/v1/responses", json={**body, "tool_choice": allowed}, timeout=60)
    assert r.status_code == 400 and "allowed_tools" in r.json()["error"]["message"], r.text
    r = httpx.post(base + "/v1/responses", json={**body, "text": {"verbosity": "low"}}, timeout=60)
    assert r.status_code == 200 and r.json()["text"]["verbosity"] == "low", r.text


def test_a_stream_the_client_stopped_is_kept_under_the_ids_it_was_sent(base):
    """QA pass 16 (AI SDK, openai-node): a client that stops a streamed response holds its response and
    message ids, and the AI SDK sends the message id back as an item_reference next turn; kvgate kept
    nothing, so that turn and every later one was a 400, and GET was a 404. What was sent is kept,
    status cancelled, the message incomplete. Red without `ResponseEvents.abandon` in the stream's end."""
    import time

    body = {"model": "tiny", "input": "hello", "max_output_tokens": 3000, "ignore_eos": True, "stream": True}
    rid = mid = None
    with httpx.stream("POST", base + "/v1/responses", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                ev = json.loads(line[6:])
                rid = rid or ev.get("response", {}).get("id")
                if ev["type"] == "response.output_text.delta":
                    mid = ev["item_id"]
                    break  # the client stops: the connection closes with the block
    assert rid and mid
    deadline, got = time.monotonic() + 10, None
    while time.monotonic() < deadline:
        got = httpx.get(base + f"/v1/responses/{rid}")
        if got.status_code == 200:
            break
        time.sleep(0.05)
    assert got.status_code == 200, got.text
    kept = got.json()
    assert kept["status"] == "cancelled" and kept["output"][0]["id"] == mid
    assert kept["output"][0]["status"] == "incomplete"
    turn = {"model": "tiny", "max_output_tokens": 4}
    turn["input"] = [{"type": "item_reference", "id": mid}, {"role": "user", "content": "go on"}]
    assert httpx.post(base + "/v1/responses", json=turn, timeout=60).status_code == 200
    chained = {"model": "tiny", "max_output_tokens": 4, "input": "more", "previous_response_id": rid}
    assert httpx.post(base + "/v1/responses", json=chained, timeout=60).status_code == 200
