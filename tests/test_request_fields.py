"""Request fields as OpenAI's clients send them (black-box QA with the official openai SDK): null means
"not given", a replayed `ChatCompletionMessage.model_dump()` is accepted, OpenAI's fields kvgate does
not do are accepted when null and refused by name otherwise, `stream_options` needs `stream: true`,
union-typed fields fail with a message that names the real problem, and the OpenAPI document says the
same as the server.

Fast: the validation functions (`protocol.parse`, `check_common`, `chat_messages`) and the OpenAPI
document of an app without an engine; one test goes over HTTP through the openai SDK to the tiny model.
Each test's docstring says how it was seen red (the code broken on purpose, then restored).
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from openai.types.chat import ChatCompletionMessage

from kvgate.core.admission import too_many_choices
from kvgate.server import chat_messages as CM
from kvgate.server import protocol as P
from kvgate.server.app import ServerSettings, create_app
from kvgate.server.errors import APIError, from_refusal
from tests.server_util import running_server

ROOT = Path(__file__).resolve().parents[1]
BODIES = sorted((ROOT / "tests" / "fixtures" / "client_bodies").glob("*.json")) + sorted(
    (ROOT.parent / "shared" / "fixtures" / "client_bodies").glob("*.json")
)
MSG = [{"role": "user", "content": "Hi"}]
CHAT, COMP = P.ChatCompletionRequest, P.CompletionRequest
MINIMAL = {CHAT: {"messages": MSG}, COMP: {"prompt": "Hi"}}


def check(cls, body: dict):
    """What prepare checks before it looks at the model: the schema, the fields, the messages."""
    req = P.parse(cls, body)
    P.check_common(req)
    if cls is CHAT:
        CM.chat_messages(req)
    else:
        P.check_completion(req)
    return req


def refused(cls, body: dict) -> dict:
    with pytest.raises(APIError) as ei:
        check(cls, body)
    assert ei.value.status == 400
    return ei.value.body()["error"]


def sdk_replay() -> dict:
    """An assistant turn as chat UIs and LiteLLM-style proxies store it: the SDK's own dump."""
    return ChatCompletionMessage(role="assistant", content="Hello!").model_dump()


@pytest.mark.parametrize("cls", [CHAT, COMP], ids=["chat", "completions"])
def test_null_means_not_given_for_every_optional_field(cls):
    """Every optional field of both bodies (stream, ignore_eos, ... and those accepted only as null)
    sent as null is accepted, and a field with a default gets it. Seen red with `_Body._null_is_unset`
    removed: "invalid field 'stream': Input should be a valid boolean" (and ignore_eos the same)."""
    for name, f in cls.model_fields.items():
        if f.is_required():
            continue
        req = check(cls, {**MINIMAL[cls], name: None})
        assert getattr(req, name) == f.default, name
    req = check(cls, {**MINIMAL[cls], "stream": None, "ignore_eos": None, "stream_options": None})
    assert req.stream is False and req.ignore_eos is False


def test_null_means_not_given_inside_objects_too():
    """stream_options' booleans, a tool call's type and tokenize's add_special_tokens. Seen red with
    `_Body._null_is_unset` removed (each a 400 "Input should be a valid boolean" / "'function'")."""
    req = check(CHAT, {**MINIMAL[CHAT], "stream": True, "stream_options": {"include_usage": None}})
    assert req.stream_options.include_usage is False
    call = {"id": "c1", "type": None, "function": {"name": "f", "arguments": "{}"}}
    req = check(CHAT, {"messages": [*MSG, {"role": "assistant", "content": None, "tool_calls": [call]}]})
    assert req.messages[1].tool_calls[0].type == "function"
    tok = P.parse(P.TokenizeRequest, {"prompt": "x", "add_special_tokens": None})
    assert tok.add_special_tokens is True  # null is the default, not false (no BOS would be a change)


def test_a_replayed_sdk_message_is_accepted():
    """`ChatCompletionMessage.model_dump()` carries annotations, audio and function_call as None. Seen
    red before the fields were declared: 400 "'messages.1.annotations' is not supported by kvgate
    yet: unknown message field"."""
    dump = sdk_replay()
    assert {"annotations", "audio", "function_call"} <= {k for k, v in dump.items() if v is None}
    msgs = check(CHAT, {"messages": [*MSG, dump, *MSG]}).messages
    assert CM.chat_messages(CHAT(messages=msgs))[1] == {"role": "assistant", "content": "Hello!"}
    check(CHAT, {"messages": [*MSG, {**dump, "annotations": []}, *MSG]})


def test_a_message_from_the_sdks_parse_and_stream_helpers_is_accepted():
    """QA pass 6's F1: `chat.completions.parse()` returns a `ParsedChatCompletionMessage` whose dump adds
    `parsed` and each call's `function.parsed_arguments`, and the `.stream()` helper's calls keep their
    delta `index`. Seen red before the three were declared: 400 "invalid field
    'messages.1.tool_calls.0.function.parsed_arguments': Extra inputs are not permitted (and 1 more
    problem(s))". What the model is shown is the same as for the plain message."""
    from openai.types.chat import ParsedChatCompletionMessage, ParsedFunctionToolCall
    from openai.types.chat.parsed_function_tool_call import ParsedFunction

    fn = ParsedFunction(name="f", arguments='{"a": 1}', parsed_arguments={"a": 1})
    call = ParsedFunctionToolCall(id="c1", type="function", function=fn)
    dump = ParsedChatCompletionMessage(role="assistant", content=None, parsed={"x": 1}, tool_calls=[call])
    dump = dump.model_dump()
    dump["tool_calls"][0]["index"] = 0
    tool = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    shown = CM.chat_messages(check(CHAT, {"messages": [*MSG, dump, tool]}))
    plain = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert shown[1] == {"role": "assistant", "content": "", "tool_calls": [plain]}


def test_a_400_names_every_problem_not_just_the_first():
    """The QA report's "(and 1 more problem(s))" left a client author to fix one field per round trip.
    Seen red with the old tail: the second field's name was not in the message."""
    err = refused(CHAT, {"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": 1}]}], "n": "2"})
    assert "; also " in err["message"] and "'n'" in err["message"]
    # one entry per field: a union field (stop) fails once per member (red without the grouping)
    err = refused(CHAT, {"messages": MSG, "max_tokens": "x", "stop": 7})
    assert err["message"].count("'stop'") == 1, err["message"]


@pytest.mark.parametrize(
    "field,value,says",
    [
        ("function_call", {"name": "f", "arguments": "{}"}, "tool_calls"),
        ("audio", {"id": "audio_1"}, "transcript"),
        ("annotations", [{"type": "url_citation"}], "[] or null"),
    ],
)
def test_a_replayed_message_field_that_is_set_is_refused_by_name(field, value, says):
    """Seen red with `_check_replayed`'s checks removed (200: silently dropped)."""
    err = refused(CHAT, {"messages": [*MSG, {**sdk_replay(), field: value}, *MSG]})
    assert err["param"] == f"messages.1.{field}" and err["code"] == "unsupported_parameter"
    assert says in err["message"]


def test_openai_fields_at_null_or_default_are_accepted():
    """Seen red before they were declared: 400 "'audio' is not supported by kvgate yet: unknown field"."""
    nulls = {k: None for k in ("audio", "functions", "function_call", "prediction", "web_search_options")}
    check(CHAT, {**MINIMAL[CHAT], **nulls, "modalities": ["text"]})


@pytest.mark.parametrize(
    "field,value,says",
    [
        ("functions", [{"name": "f"}], "send tools"),
        ("function_call", "auto", "send tool_choice"),
        ("audio", {"voice": "alloy", "format": "wav"}, "audio output"),
        ("web_search_options", {}, "web search"),
        ("modalities", ["text", "audio"], "'audio'"),
        ("modalities", [], '["text"]'),
    ],
)
def test_openai_fields_kvgate_does_not_do_are_refused_by_name_when_set(field, value, says):
    """Seen red with the NULL_ONLY loop removed from check_common (200: silently dropped), and for
    modalities with its check removed."""
    err = refused(CHAT, {**MINIMAL[CHAT], field: value})
    assert err["param"] == field and err["code"] == "unsupported_parameter" and says in err["message"]


@pytest.mark.parametrize("cls", [CHAT, COMP], ids=["chat", "completions"])
def test_stream_options_needs_stream_true(cls):
    """As OpenAI and vLLM: a 400 saying what to do; null stream_options without stream is fine. Seen
    red with the check removed from check_common (accepted silently)."""
    opts = {"include_usage": True}
    for stream in ({}, {"stream": False}, {"stream": None}):
        err = refused(cls, {**MINIMAL[cls], **stream, "stream_options": opts})
        assert err["param"] == "stream_options" and "stream=true" in err["message"]
    check(cls, {**MINIMAL[cls], "stream_options": None})
    check(cls, {**MINIMAL[cls], "stream": True, "stream_options": opts})


@pytest.mark.parametrize("path", BODIES, ids=lambda p: p.stem)
def test_every_recorded_client_body_passes_validation(path):
    """The fast half of tests/test_compat.py's replay (which runs them through a live server). Seen
    red for none (every recorded client that sends stream_options also sends stream: true); this
    pins that the stream_options rule did not break one."""
    rec = json.loads(path.read_text())
    check(CHAT if rec["path"].endswith("chat/completions") else COMP, rec["body"])


def test_a_responses_api_tool_choice_names_the_missing_function():
    """Seen red with the old schema_error (first union member's error only): "Input should be 'none',
    'auto' or 'required' (and 2 more problem(s))"."""
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    bad = {"type": "function", "name": "get_weather"}
    err = refused(CHAT, {**MINIMAL[CHAT], "tools": tools, "tool_choice": bad})
    assert err["param"] == "tool_choice" and err["code"] == "invalid_schema"
    msg = err["message"]
    assert "'tool_choice.function' is missing" in msg and "'tool_choice.name' is not a field" in msg
    assert '{"type": "function", "function": {"name": "..."}}' in msg and "; also" not in msg
    err = refused(CHAT, {**MINIMAL[CHAT], "tools": tools, "tool_choice": "any"})
    assert '"none", "auto", "required", or {"type": "function"' in err["message"]


def test_a_mixed_batch_prompt_says_it_mixes_kinds():
    """Seen red with the old schema_error: "invalid field 'prompt': Input should be a valid string (and
    4 more problem(s))"."""
    err = refused(COMP, {"prompt": ["a", [1, 2]]})
    assert err["param"] == "prompt" and "; also" not in err["message"]
    assert "mixes lists and strings" in err["message"]
    assert "all strings or all token-id lists" in err["message"]
    err = refused(COMP, {"prompt": [[1, 2], [3, "x"]]})  # the member the client meant, by its path
    assert err["param"] == "prompt" and "'prompt.1.1': Input should be a valid integer" in err["message"]
    err = refused(CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]})
    assert err["param"] == "messages.0.content" and "'messages.0.content.0.text'" in err["message"]


def test_too_many_choices_names_n():
    """Seen red with `_PARAMS` emptied in errors.py (no param in the body). QA pass 6: a server whose
    memory plan shrank --max-seqs 2 to 1 blamed --max-seqs, and a best_of request was told "n=2";
    the message now names what shrank the rows and both fields (red with the old message)."""
    err = from_refusal(too_many_choices(100, 4)).body()["error"]
    assert err["code"] == "too_many_choices" and err["param"] == "n"
    err = from_refusal(too_many_choices(2, 1, 2), {"n": "best_of"}).body()["error"]
    assert err["param"] == "best_of" and "n, or best_of" in err["message"]
    assert "--max-seqs 2, which the memory plan shrank to 1" in err["message"]


def _doc_validator(name: str):
    doc = create_app(ServerSettings(model_name="tiny")).openapi()
    schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    return jsonschema.Draft202012Validator(schema)


def test_the_openapi_document_says_what_the_server_accepts():
    """Bodies the server now accepts are valid in the document, those it refuses are not (the rule
    tests/test_fuzz.py holds the live server to). Seen red with `tighten_message` and the
    stream_options rule removed from openapi_fields.py (a replayed audio and stream_options without
    stream were valid in the document), and with `_null_in_schema` removed ("stream": null invalid)."""
    chat = _doc_validator("ChatCompletionRequest")
    comp = _doc_validator("CompletionRequest")
    nulls = {k: None for k in ("audio", "functions", "function_call", "prediction", "web_search_options")}
    good = [
        (chat, {**MINIMAL[CHAT], "stream": None, "ignore_eos": None, "modalities": ["text"], **nulls}),
        (chat, {"messages": [*MSG, sdk_replay(), *MSG]}),
        (chat, {**MINIMAL[CHAT], "stream": True, "stream_options": {"include_usage": None}}),
        (comp, {**MINIMAL[COMP], "stream": None, "stream_options": None}),
    ]
    bad = [
        (chat, {**MINIMAL[CHAT], "stream_options": {"include_usage": True}}),
        (comp, {**MINIMAL[COMP], "stream": False, "stream_options": {}}),
        (chat, {"messages": [*MSG, {**sdk_replay(), "audio": {"id": "a"}}]}),
        (chat, {"messages": [*MSG, {**sdk_replay(), "annotations": [{"type": "url_citation"}]}]}),
        (chat, {**MINIMAL[CHAT], "modalities": ["audio"]}),
        (chat, {**MINIMAL[CHAT], "functions": [{"name": "f"}]}),
    ]
    for v, body in good:
        assert not list(v.iter_errors(body)), body
        check(CHAT if v is chat else COMP, body)
    for v, body in bad:
        assert list(v.iter_errors(body)), body
        refused(CHAT if v is chat else COMP, body)


def test_the_openai_sdk_replays_a_response_with_stream_null(make_engine):
    """The QA report's two requests, through the official client to a live server: an assistant turn
    replayed from the SDK's own response object, and stream=None sent as null. Seen red before this
    change: 400 "unknown message field" and "invalid field 'stream': Input should be a valid
    boolean"."""
    import httpx
    import openai

    sent = []
    hooks = {"request": [lambda r: sent.append(json.loads(r.content))]}
    with running_server(make_engine()) as (base, _), httpx.Client(event_hooks=hooks) as http:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, http_client=http)
        first = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=3)
        again = [*MSG, first.choices[0].message.model_dump(), *MSG]
        out = client.chat.completions.create(
            model="tiny", messages=again, max_tokens=3, stream=None, extra_body={"ignore_eos": None}
        )
        assert out.choices[0].message.role == "assistant"
        text = client.completions.create(model="tiny", prompt="Hi", max_tokens=2, stream=None)
        assert text.choices[0].text is not None
    assert sent[1]["stream"] is None and sent[1]["messages"][1]["audio"] is None  # what the QA saw
    assert sent[2]["stream"] is None


def test_messages_openai_refuses_are_refused_naming_the_message():
    """Session 45's QA: a user message without content, and a tool message that answers no call, were
    rendered as if valid (OpenAI: 400 for each). An assistant call turn may have null content, and tool
    messages may follow one another after the call turn. Red with each check removed."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    turn = {"role": "assistant", "content": None, "tool_calls": [call]}
    answer = {"role": "tool", "tool_call_id": "c1", "content": "ok"}
    ok = [*MSG, turn, answer, {**answer, "content": "again"}, {"role": "user", "content": ""}]
    assert [m["role"] for m in CM.chat_messages(check(CHAT, {"messages": ok}))][-3:] == [
        "tool",
        "tool",
        "user",
    ]
    # text or a system note between the call turn and its answers (a replayed Responses message after
    # its calls, a Messages system turn: the review found both refused)
    for between in ({"role": "assistant", "content": "calling"}, {"role": "system", "content": "note"}):
        CM.chat_messages(check(CHAT, {"messages": [*MSG, turn, between, answer]}))
    cases = [
        ([{"role": "user"}], "messages.0.content"),
        ([*MSG, {"role": "system", "content": None}], "messages.1.content"),
        ([*MSG, answer], "messages.1"),
        ([*MSG, {"role": "assistant", "content": "no call"}, answer], "messages.2"),
        ([*MSG, turn, {"role": "tool", "content": "ok"}], "messages.2.tool_call_id"),
    ]
    for messages, param in cases:
        err = refused(CHAT, {"messages": messages})
        assert err["param"] == param and "messages[" in err["message"], (messages, err)
