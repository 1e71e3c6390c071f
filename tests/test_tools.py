"""Tool calling (issue 13): rendering, the call grammar, tool_calls in responses and stream deltas.

The tiny model (random weights, a 4096-position context for the tools preamble) shows that whatever
the model wants, a call comes out well-formed with arguments that validate; the `slow` tests use
SmolLM2 through the official openai client and LangChain's own client.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from kvgate.server import chat_messages as CM
from kvgate.server import protocol as P
from kvgate.server import tool_parser as TP
from kvgate.server import tools as T
from tests.server_util import running_server
from tests.tiny_model import make_tiny_hf_dir

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time"}},  # no parameters: its arguments are {}
]
SCHEMAS = {
    "get_weather": WEATHER,
    "get_time": {"type": "object", "properties": {}, "additionalProperties": False},
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine

    d = make_tiny_hf_dir(tmp_path_factory.mktemp("tiny4k"), geometry={"max_pos": 4096})
    cfg = EngineConfig(kv_cache_bytes=32 << 20, memory_limit="2GiB", dtype="float32", device="cpu")
    e = Engine.from_model(str(d), cfg, overhead_bytes=0).start()
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def base(engine):
    with running_server(engine) as (b, _app):
        yield b


def check_calls(calls: list[dict]) -> None:
    for c in calls:
        assert c["id"].startswith("call_") and c["type"] == "function"
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[c["function"]["name"]])


# ---- the parser ----------------------------------------------------------------------------------
OUTPUT = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 2}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def test_the_parser_gives_the_same_calls_whatever_the_pieces():
    """Fed one character at a time, or in one piece, or split at every position: the same calls and
    arguments. Seen red when the held-back end marker (`}\\n</tool_call>`) was released as arguments."""
    content, calls = TP.parse_output(OUTPUT)
    assert content is None and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "unit": "celsius", "days": 2}
    for cut in range(len(OUTPUT)):
        p = TP.ToolCallParser()
        events = p.push(OUTPUT[:cut]) + p.push(OUTPUT[cut:]) + p.end()
        args = ["".join(e[2] for e in events if e[0] == "args" and e[1] == i) for i in range(2)]
        assert args == [c.arguments for c in calls], cut
    p = TP.ToolCallParser()
    events = [e for ch in OUTPUT for e in p.push(ch)] + p.end()
    assert [e[1].name for e in events if e[0] == "call"] == ["get_weather", "get_time"]
    assert TP.parse_output("Hello <b>there</b>") == ("Hello <b>there</b>", [])


def test_the_grammar_commits_to_a_call_only_on_the_whole_opening(engine):
    """QA pass 6's two HIGH findings, both one character that the model also writes in text
    committing it to a call: under `auto` an answer starting with "<" (HTML, or the `<tool_response>`
    SmolLM2 echoes after a tool's answer) could only go on as `<tool_call>`, so a call was made up;
    and after a call, the newline SmolLM2 writes before a remark (p 0.55-0.65, against 0.3 for the
    end) could only go on as another call, which it copied from the first: single-intent prompts
    came back with two identical calls (send_email twice). Here each text is fed to the grammar as
    whole outputs: seen red with the old `answer` regex (/[^<][\\s\\S]*/) and the old separator
    (`call ("\\n" call)*`)."""
    from kvgate.structured.compiler import compiler_for

    comp = compiler_for(engine.tokenizer, engine.spec.vocab_size, engine.plan.limits.grammars)
    functions = [P.FunctionDef.model_validate(t["function"]) for t in TOOLS]
    call = T._block("get_time", "{}")

    def whole(text: str, mode: str = "auto", parallel: bool = True) -> bool:
        m = comp.matcher(T.grammar(T.ToolPlan(mode, functions, parallel), None))
        ids = engine.tokenizer.encode(text)
        return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()

    for text in ("<h1>Hi</h1>", "<tool_response>\nsunny\n</tool_response>", "<", "<tool", "Sunny."):
        assert whole(text), text
    assert not whole("<tool_call>Sunny")  # the whole opening is a call's
    for text in (call, call + "\n", call + "\n" + call, call + "\n\n" + call, call + "\n\nThe function"):
        assert whole(text) and whole(text, "required"), text
    assert not whole(call + "\nThe function returns a json object")  # a remark ends within 16 chars
    assert not whole(call + "\n<p>")  # after a call, "<" on a new line opens another call
    assert whole(call + "\nThe", "required", parallel=False)
    assert not whole(call + "\n" + call, "required", parallel=False) and whole(call, "named", False)
    # the remark is dropped, and a proper prefix of the opening ended by the model is an answer
    assert TP.parse_output(call + "\n\nThe function", cut=False)[0] is None
    assert TP.parse_output("<tool", cut=False) == ("<tool", []) and TP.parse_output("<tool") == ("", [])


def test_calls_after_text_are_calls_held_to_their_schemas(engine):
    """QA pass 9's HIGH: under `auto`, text and then a `<tool_call>` in the same turn (as Hermes models
    write "Let me check." before a call, and as kvgate renders a replayed turn with both) came back as
    content, markup and all, with finish_reason `stop` and arguments under no schema; LlamaIndex's
    `chat_with_tools` found no call. Now the text is the content and the block a call, whole or
    streamed, and the grammar holds such a call to its schema like any other; an answer may still hold
    a proper prefix of the opening, never the whole of it. What `render` writes for a turn with both
    parses back to them. Seen red with the old answer regex (any text not starting with the opening:
    the unknown function and the bad arguments after text were accepted) and with the old parser
    (the call came back as content)."""
    from kvgate.structured.compiler import compiler_for

    comp = compiler_for(engine.tokenizer, engine.spec.vocab_size, engine.plan.limits.grammars)
    functions = [P.FunctionDef.model_validate(t["function"]) for t in TOOLS]
    call = T._block("get_time", "{}")
    weather = T._block("get_weather", '{"city": "Paris", "unit": "celsius", "days": 2}')

    def whole(text: str, mode: str = "auto", parallel: bool = True) -> bool:
        m = comp.matcher(T.grammar(T.ToolPlan(mode, functions, parallel), None))
        ids = engine.tokenizer.encode(text)
        return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()

    for text in ("Let me check.\n" + call, "Sure <b>now</b>\n\n" + call + "\n" + weather, "a <tool_cal b"):
        assert whole(text), text
    assert whole("I will call.\n" + call, parallel=False)
    assert not whole("Let me check.\n" + T._block("rm_rf", "{}"))  # not one of the functions
    assert not whole("Let me check.\n" + T._block("get_weather", '{"town": 1}'))  # not its schema
    assert not whole("Hi <tool_call>\nSunny") and not whole("text\n" + call, "required")
    content, calls = TP.parse_output("Let me check.\n\n" + call + "\n" + weather, cut=False)
    assert content == "Let me check." and [c.name for c in calls] == ["get_time", "get_weather"]
    # whitespace alone beside calls is no content (the review: " " came back beside them)
    assert TP.parse_output(" \n" + call, cut=False)[0] is None
    assert TP.parse_output("Sure. \n" + call, cut=False)[0] == "Sure."
    p = TP.ToolCallParser()
    events = [e for ch in "Let me check.\n" + call for e in p.push(ch)] + p.end(cut=False)
    assert "".join(e[1] for e in events if e[0] == "content") == "Let me check."
    assert [e[1].name for e in events if e[0] == "call"] == ["get_time"]
    turn = {
        "role": "assistant",
        "content": "One moment.",
        "tool_calls": [{"function": {"name": "get_time", "arguments": "{}"}}],
    }
    rendered = T.render([turn], None, native=False)[0][0]["content"]
    content, calls = TP.parse_output(rendered, cut=False)
    assert content == "One moment." and [(c.name, c.arguments) for c in calls] == [("get_time", "{}")]


def test_only_the_models_own_end_makes_a_held_opening_an_answer():
    """A held-back proper prefix of `<tool_call>` is an answer only when the model ended the output
    (its end token, or the grammar complete); a stop string, max_tokens or a shutdown may have cut a
    call's opening, and the stream and the whole response must agree (review of session 33: a stop
    string "tool" gave content "<"). Red with the cut judged from finish_reason == "length" alone."""
    from types import SimpleNamespace as NS

    assert TP.model_ended(NS(finish_reason="stop", stop_reason="token:2"))
    assert TP.model_ended(NS(finish_reason="stop", stop_reason="grammar"))
    for r in (
        NS(finish_reason="stop", stop_reason="string"),
        NS(finish_reason="cancelled", stop_reason=None),
    ):
        assert not TP.model_ended(r)
        choice = {"message": {"role": "assistant", "content": "<"}, "finish_reason": r.finish_reason}
        TP.read_calls(choice, TP.model_ended(r))
        assert choice["message"]["content"] == ""


def test_max_tokens_inside_the_dropped_remark_still_finishes_with_tool_calls():
    """The remark after the calls is dropped, so max_tokens cutting it cut nothing returned: the choice
    finishes with `tool_calls` (the Responses API then marks the call completed). A cut between two
    calls, where another call may have been starting, keeps `length`. Review of session 33; seen red
    with `in_remark` ignored."""
    call = T._block
    text = call("get_time", "{}") + "\n\nThe func"
    choice = {"message": {"role": "assistant", "content": text}, "finish_reason": "length"}
    TP.read_calls(choice)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    choice = {
        "message": {"role": "assistant", "content": call("get_time", "{}") + "\n"},
        "finish_reason": "length",
    }
    TP.read_calls(choice)
    assert choice["finish_reason"] == "length"


def test_max_tokens_in_the_forced_end_of_the_only_call_finishes_with_tool_calls():
    """QA pass 17 (instructor, pydantic-ai): with parallel_tool_calls false (or a named function) all
    that may follow a call's closed arguments is the wrapper's forced end, `}\n</tool_call>` in several
    tokens; a max_tokens there gave a whole, valid call finish_reason `length`, which instructor
    refuses (`IncompleteOutputException`). Now `tool_calls`, for Hermes blocks, Llama's bare call and
    both Mistral forms; with parallel calls the cut keeps `length` (another call may have been coming),
    and a cut inside the arguments keeps it always. Seen red with the single-call rule left out of
    `ToolCallParser.end` and of `MistralCallParser.end`, and (the review's two cases) with "between"
    left out of Mistral's rule and with a single call's `_between` opening a second call's head."""
    from kvgate.server.mistral_tools import MistralFormat, parser_for

    fns = [P.FunctionDef(name="get_time")]
    block = T._block("get_time", "{}")
    cases = [  # (plan, output cut in the forced end, output cut in the arguments)
        (T.ToolPlan("auto", fns, False), block[: -len(T.END) + 3], block[: block.index("{}") + 1]),
        (T.ToolPlan("auto", fns, False), block + "\n", block[: block.index("{}") + 1]),
        # the remark may start like a call; with one call allowed it is the remark (review of session 49)
        (T.ToolPlan("auto", fns, False), block + '\n<tool_call>\n{"na', block[: block.index("{}") + 1]),
        (
            T.ToolPlan("auto", fns, False, bare=True),
            '{"name": "get_time", "parameters": {}',
            '{"name": "get_time", "parameters": {',
        ),
        (
            T.ToolPlan("auto", fns, False, mistral=MistralFormat(5)),
            '[TOOL_CALLS][{"name": "get_time", "arguments": {}',
            '[TOOL_CALLS][{"name": "get_time", "arguments": {',
        ),
        (  # after the call's `}`, before the list's `]` (review of session 49)
            T.ToolPlan("auto", fns, False, mistral=MistralFormat(5)),
            '[TOOL_CALLS][{"name": "get_time", "arguments": {}}',
            '[TOOL_CALLS][{"name": "get_time", "arguments": {',
        ),
        (
            T.ToolPlan("auto", fns, False, mistral=MistralFormat(5, 6)),
            "[TOOL_CALLS]get_time[ARGS]{}",
            "[TOOL_CALLS]get_time[ARGS]{",
        ),
    ]
    for plan, forced, inside in cases:
        for text, parallel, want in (
            (forced, False, "tool_calls"),
            (forced, True, "length"),
            (inside, False, "length"),
        ):
            plan.parallel = parallel
            choice = {"message": {"role": "assistant", "content": text}, "finish_reason": "length"}
            TP.read_calls(choice, parser=parser_for(plan))
            got = choice["message"].get("tool_calls")
            assert got and got[0]["function"]["name"] == "get_time", (text, choice)
            if not plan.bare:  # a bare call is one call whatever the flag says
                assert choice["finish_reason"] == want, (text, parallel, choice)
            elif text == forced:
                assert choice["finish_reason"] == "tool_calls", (text, choice)


def cut_expectation(cut: int) -> list[tuple[str, str]]:
    """The calls an OUTPUT cut after `cut` characters must give: each call whose name is whole, with
    its argument text up to the cut (never past the end of the arguments)."""
    want, at = [], 0
    for name, args in (
        ("get_weather", '{"city": "Paris", "unit": "celsius", "days": 2}'),
        ("get_time", "{}"),
    ):
        named = OUTPUT.index(json.dumps(name), at) + len(json.dumps(name))
        start = OUTPUT.index(T.ARGS_AT, named) + len(T.ARGS_AT)
        if cut >= named:
            want.append((name, args[: max(0, min(cut - start, len(args)))]))
        at = start
    return want


def test_an_output_cut_anywhere_gives_the_calls_so_far_and_never_markup():
    """max_tokens can end the output at any character. Whole or streamed (in any two pieces), the
    result is the same: each call whose name is whole, its arguments exactly the argument text so far
    (none of the wrapper's `}`, newline, `</tool_call>`), no content but an empty one, no markup.
    Seen red when end() released the held-back `}\n</tool` as arguments and the half head as
    content, and with the whole-response side keeping the raw text unless every call was done."""
    for cut in range(len(OUTPUT) + 1):
        content, calls = TP.parse_output(OUTPUT[:cut])
        want = cut_expectation(cut)
        assert [(c.name, c.arguments) for c in calls] == want, cut
        assert content == ("" if not want else None), (cut, content)
        for split in range(cut + 1):
            p = TP.ToolCallParser()
            events = p.push(OUTPUT[:split]) + p.push(OUTPUT[split:cut]) + p.end()
            assert not [e for e in events if e[0] == "content"], (cut, split, events)
            named = [e[1].name for e in events if e[0] == "call"]
            args = ["".join(e[2] for e in events if e[0] == "args" and e[1] == i) for i in range(len(named))]
            assert list(zip(named, args, strict=True)) == want, (cut, split)
    choice = {"message": {"role": "assistant", "content": OUTPUT[:-20]}, "finish_reason": "length"}
    TP.read_calls(choice)
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
    assert got == cut_expectation(len(OUTPUT) - 20)


def test_arguments_that_hold_braces_and_the_end_marker_in_strings_are_read_exactly():
    """The arguments' JSON is followed: a `}` or `]` inside a string, an escaped quote before one,
    nested objects closing together (`}}` like the wrapper's end) all stay arguments, whole and cut
    anywhere. Seen red with the scanner's string state ignored (the `}` in "x}" ended the arguments)
    and with its escapes ignored (`\\"}` ended the string, then the arguments)."""
    args = '{"a": "x}\\n</tool_call>\\"}", "b": [1, {"c": {}}], "d": {"e": "]"}}'
    assert json.loads(args)["a"] == 'x}\n</tool_call>"}'
    text = T._block("f", args) + T.SEP + T._block("g", "{}")
    content, calls = TP.parse_output(text)
    assert content is None and [(c.name, c.arguments, c.done) for c in calls] == [
        ("f", args, True),
        ("g", "{}", True),
    ]
    for cut in range(len(text)):
        for c in TP.parse_output(text[:cut])[1]:
            assert args.startswith(c.arguments) or "{}".startswith(c.arguments), (cut, c)


def test_a_finished_choice_reads_its_calls_and_answers():
    """The whole response's side (`read_calls`, before logprobs): calls finish with `tool_calls`, a
    cut before the name leaves an empty content, text stays text. Seen red with read_calls not
    called in serving (the e2e test below) and with its finish_reason rewrite removed."""
    done = {"message": {"role": "assistant", "content": OUTPUT}, "finish_reason": "stop"}
    TP.read_calls(done)
    assert done["finish_reason"] == "tool_calls" and len(done["message"]["tool_calls"]) == 2
    early = {
        "message": {"role": "assistant", "content": '<tool_call>\n{"name": "get_w'},
        "finish_reason": "length",
    }
    TP.read_calls(early)
    assert early == {"message": {"role": "assistant", "content": ""}, "finish_reason": "length"}
    # a stop string that ends the output inside the arguments: the call so far, and `stop` (not
    # `tool_calls`, which would promise whole arguments). Red with `all(c.done ...)` taken out.
    cut = {"message": {"role": "assistant", "content": OUTPUT[: OUTPUT.index("}")]}, "finish_reason": "stop"}
    TP.read_calls(cut)
    assert cut["finish_reason"] == "stop" and len(cut["message"]["tool_calls"]) == 1
    text = {"message": {"role": "assistant", "content": "Sunny."}, "finish_reason": "stop"}
    TP.read_calls(text)
    assert text == {"message": {"role": "assistant", "content": "Sunny."}, "finish_reason": "stop"}


def test_tool_turns_render_with_the_generic_preamble_for_a_template_without_tools():
    """A template that does not read `tools` gets the documented preamble in the system message,
    assistant calls as <tool_call> blocks and tool answers as <tool_response> user turns.
    Seen red with the native rendering used for every template (roles and tools passed as they are)."""
    req = P.ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_time", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
            ],
            "tools": TOOLS,
        }
    )
    msgs, tools = T.render(CM.chat_messages(req), T.plan_tools(req), native=False)
    assert tools is None and [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert (
        msgs[0]["content"].startswith("Be brief.\n\n# Tools")
        and '"name": "get_weather"' in msgs[0]["content"]
    )
    assert msgs[2]["content"] == '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert msgs[3]["content"] == "<tool_response>\n12:00\n</tool_response>"
    native, tools = T.render(CM.chat_messages(req), T.plan_tools(req), native=True)
    assert tools[0]["function"]["name"] == "get_weather" and native[3]["role"] == "tool"
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {}
    # a call kvgate returned cut before its arguments (`length`) replays as {} (QA pass 6: the model was
    # shown `"arguments": }`); red with the arguments pasted as they are
    req.messages[2].tool_calls[0].function.arguments = ""
    msgs, _ = T.render(CM.chat_messages(req), T.plan_tools(req), native=False)
    assert msgs[2]["content"] == '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


# ---- over HTTP, tiny model -----------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_required_tool_calls_always_parse_and_validate(base, seed):
    """tool_choice=required on a random model: the answer is a tool call with an id, arguments that
    validate against its function's schema, and finish_reason tool_calls. (parallel_tool_calls=false:
    with parallel calls allowed a random model may go on calling until max_tokens.)
    Seen red with the grammar dropped in prepare (features_of returning no grammar): no call at all."""
    body = {"messages": MSG, "tools": TOOLS, "tool_choice": "required", "max_tokens": 300, "seed": seed}
    body["parallel_tool_calls"] = False
    r = httpx.post(base + CHAT, json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None and choice["message"]["tool_calls"]
    check_calls(choice["message"]["tool_calls"])


def test_a_named_tool_choice_and_parallel_false_give_exactly_that_one_call(base):
    """Seen red with the grammar dropped in prepare (no tool_calls in the answer)."""
    for choice, parallel in (
        ({"type": "function", "function": {"name": "get_weather"}}, None),
        ("required", False),
    ):
        body = {"messages": MSG, "tools": TOOLS, "tool_choice": choice, "max_tokens": 300, "seed": 5}
        if parallel is not None:
            body["parallel_tool_calls"] = parallel
        calls = httpx.post(base + CHAT, json=body, timeout=60).json()["choices"][0]["message"]["tool_calls"]
        assert len(calls) == 1
        if isinstance(choice, dict):
            assert calls[0]["function"]["name"] == "get_weather"
        check_calls(calls)


def stream_calls(base, body) -> tuple[dict, str, list[dict]]:
    """Assemble OpenAI delta.tool_calls the way clients do: by index, concatenating arguments."""
    calls: dict[int, dict] = {}
    content, finish = "", None
    with httpx.stream("POST", base + CHAT, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                d = c["delta"]
                content += d.get("content") or ""
                for tc in d.get("tool_calls") or []:
                    slot = calls.setdefault(tc["index"], {"function": {"arguments": ""}})
                    if "id" in tc:
                        slot.update(id=tc["id"], type=tc["type"])
                        slot["function"]["name"] = tc["function"]["name"]
                    slot["function"]["arguments"] += tc["function"].get("arguments", "")
                finish = c["finish_reason"] or finish
    return calls, content, finish


def test_streamed_tool_calls_assemble_to_the_whole_answer(base):
    """The stream's delta.tool_calls, assembled by index, equal the non-streamed calls (ids aside).
    Seen red with the grammar dropped in prepare (finish_reason length, no calls)."""
    body = {"messages": MSG, "tools": TOOLS, "tool_choice": "required", "max_tokens": 400, "seed": 11}
    body["parallel_tool_calls"] = False
    whole = httpx.post(base + CHAT, json=body, timeout=60).json()["choices"][0]
    calls, content, finish = stream_calls(base, body)
    assert finish == "tool_calls" and content == ""
    got = [(c["function"]["name"], c["function"]["arguments"]) for _, c in sorted(calls.items())]
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]]
    assert got == want
    check_calls([calls[i] for i in sorted(calls)])


def test_the_sdks_stream_helper_assembles_the_same_message_as_the_whole_answer(base):
    """The openai SDK's `chat.completions.stream` accumulates the deltas into the final message: a
    tool-call answer has `content` None, as the whole answer's, not "" (session 30's QA: the role
    chunk carried `content: ""`, so the assembled message differed). Red with the role chunk's
    empty content back."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    ask = dict(model=client.models.list().data[0].id, messages=MSG, tools=TOOLS, tool_choice="required")
    ask.update(max_tokens=400, seed=11, parallel_tool_calls=False)
    whole = client.chat.completions.create(**ask).choices[0].message
    with client.chat.completions.stream(**ask) as s:
        final = s.get_final_completion().choices[0].message
    assert whole.content is None and final.content is None
    assert [c.function.arguments for c in final.tool_calls] == [
        c.function.arguments for c in whole.tool_calls
    ]


def test_a_call_cut_by_max_tokens_streams_and_answers_the_same_arguments_without_markup(base):
    """max_tokens ending the output before the call's name, inside its arguments, and inside the
    wrapper's end: streamed and whole agree, finish_reason length, the arguments are the whole
    call's cut short (all of them once the cut is past them), never markup. Seen red before the fix
    (content '<tool_call>\\n{"name": ...' whole, arguments ending '}\\n</tool' streamed), and with
    serving's read_calls removed (the raw text as content)."""
    body = {"messages": MSG, "tools": TOOLS, "tool_choice": "required", "max_tokens": 300, "seed": 3}
    body["parallel_tool_calls"] = False
    whole = httpx.post(base + CHAT, json=body, timeout=60).json()
    n, full = whole["usage"]["completion_tokens"], whole["choices"][0]["message"]["tool_calls"][0]["function"]
    for cut, named in ((8, False), (n // 2, True), (n - 2, True)):
        c = httpx.post(base + CHAT, json={**body, "max_tokens": cut}, timeout=60).json()["choices"][0]
        calls, content, finish = stream_calls(base, {**body, "max_tokens": cut})
        # n - 2 may land in the dropped remark after the call: nothing returned was cut then
        ends = ("length", "tool_calls") if cut == n - 2 else ("length",)
        assert c["finish_reason"] == finish and finish in ends and not content, (cut, c)
        got = [
            (x["function"]["name"], x["function"]["arguments"]) for x in c["message"].get("tool_calls", [])
        ]
        assert got == [(x["function"]["name"], x["function"]["arguments"]) for x in calls.values()], cut
        assert bool(got) == named and not c["message"]["content"], (cut, c)
        if named:
            assert got[0][0] == full["name"] and full["arguments"].startswith(got[0][1]), (cut, got)
    assert got[0][1] == full["arguments"]  # n - 2: the cut came inside the wrapper's end or after it


def test_auto_lets_the_model_answer_in_text_and_none_renders_no_tools(base):
    """Seen red with `auto` planned as `required` (no answer branch in the grammar)."""
    texts = 0
    for seed in range(6):
        body = {"messages": MSG, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 40, "seed": seed}
        c = httpx.post(base + CHAT, json=body, timeout=60).json()["choices"][0]
        if c["message"].get("tool_calls"):
            check_calls(c["message"]["tool_calls"])
        else:
            texts += 1
            assert not c["message"]["content"].startswith("<")
    assert texts >= 1
    plain = httpx.post(base + CHAT, json={"messages": MSG, "max_tokens": 1}, timeout=60).json()
    none = httpx.post(
        base + CHAT,
        json={"messages": MSG, "tools": TOOLS, "tool_choice": "none", "max_tokens": 1},
        timeout=60,
    ).json()
    assert none["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]


def test_a_replayed_tool_conversation_is_accepted(base):
    """The pre-issue-13 tree refused `messages.1.tool_calls` by name (a 400; not re-run)."""
    msgs = [
        *MSG,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_9",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_9", "content": "sunny"},
    ]
    r = httpx.post(base + CHAT, json={"messages": msgs, "tools": TOOLS, "max_tokens": 5}, timeout=60)
    assert r.status_code == 200, r.text
    # /v1/tokenize counts the prompt the chat request ran, tool turns and tools included (a client
    # trims its history by it); session 30's QA found 57 counted where the chat ran 99 (245 with
    # tools): the tokenizer path skipped the tool rendering, and refused `tools`. Red with the old
    # path (P.chat_messages straight to the template).
    for extra in ({}, {"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "required"}):
        chat = httpx.post(base + CHAT, json={"messages": msgs, "max_tokens": 1, **extra}, timeout=60)
        count = httpx.post(base + "/v1/tokenize", json={"messages": msgs, **extra}, timeout=60)
        assert count.status_code == 200, count.text
        assert count.json()["count"] == chat.json()["usage"]["prompt_tokens"], extra
    r = httpx.post(base + "/v1/tokenize", json={"prompt": "hi", "tools": TOOLS}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_bad_tool_requests_are_400s_naming_the_field(base):
    bad = [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, "tool_choice"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}]},
            "tools.0.function.parameters",
        ),
        # QA pass 6's F12: arguments that are not an object crashed every client's fn(**args)
        (
            {
                "tools": [
                    TOOLS[0],
                    {"type": "function", "function": {"name": "g", "parameters": {"type": "array"}}},
                ]
            },
            "tools.1.function.parameters",
        ),
        ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools.0.type"),
    ]
    for extra, param in bad:
        r = httpx.post(base + CHAT, json={"messages": MSG, **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


def test_a_refused_schema_names_the_tool_the_path_and_the_way_out(base):
    """QA pass 6: agents send 10-30 tools, and `a tool's parameters cannot be enforced: Unimplemented
    keys: ["uniqueItems"]` named neither the tool nor the property; pydantic writes uniqueItems for
    every set[...] field. Seen red with the old message (no tool name, no path, no hint), and with the
    grammar's quoted source lines kept (QA pass 9)."""
    ok = {"type": "function", "function": {"name": "ok1", "parameters": {"type": "object"}}}
    tags = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    bad = {"type": "function", "function": {"name": "bad_one", "parameters": tags}}
    r = httpx.post(base + CHAT, json={"messages": MSG, "tools": [ok, bad]}, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "tools.1.function.parameters"
    assert "tool 'bad_one'" in err["message"] and "properties.tags.uniqueItems" in err["message"]
    assert "use list[...]" in err["message"]
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": tags}}
    err = httpx.post(base + CHAT, json={"messages": MSG, "response_format": rf}, timeout=60).json()["error"]
    assert err["param"] == "response_format" and "properties.tags.uniqueItems" in err["message"]
    # QA pass 9: the grammar's own text (kvgate's Lark, cut mid-schema) is no part of the message
    assert "start:" not in err["message"] and " | " not in err["message"], err["message"]


def test_a_format_the_engine_does_not_know_is_an_annotation_and_known_ones_hold(base):
    """In JSON Schema `format` is an annotation unless a validator asserts it; pydantic writes
    `binary` for bytes and `password` for SecretStr, and those schemas were 400s (QA pass 6). Unknown
    formats now leave a plain string; `email` is still enforced. A property named "format" is a name,
    not a keyword. Seen red without `engine_schema` (400 "Unknown format: binary")."""
    from kvgate.structured.schema_prep import engine_schema

    schema = {
        "type": "object",
        "properties": {
            "blob": {"type": "string", "format": "binary"},
            "mail": {"type": "string", "format": "email"},
            "format": {"type": "string"},
        },
        "required": ["blob", "mail", "format"],
        "additionalProperties": False,
    }
    kept = engine_schema(schema)["properties"]
    assert "format" not in kept["blob"] and kept["mail"]["format"] == "email" and "format" in kept
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    body = {"messages": MSG, "response_format": rf, "max_tokens": 200, "temperature": 0, "seed": 3}
    r = httpx.post(base + CHAT, json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        got = json.loads(choice["message"]["content"])
        assert "@" in got["mail"]  # the tiny model writes noise, but the email format held


def json_holds(tiny_dir):
    """`holds(schema, value)`: whether the grammar of `schema` (as `engine_schema` makes it for the
    engine) accepts `value`'s JSON whole, on the tiny model's tokenizer."""
    import llguidance
    from tokenizers import Tokenizer

    from kvgate.structured.schema_prep import engine_schema

    text = (tiny_dir / "tokenizer.json").read_text()
    tk = Tokenizer.from_str(text)
    lt = llguidance.LLTokenizer(text, n_vocab=tk.get_vocab_size(True), eos_token=None)

    def holds(schema: dict, value) -> bool:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(engine_schema(schema))
        m = llguidance.LLMatcher(lt, grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        ids = tk.encode(json.dumps(value), add_special_tokens=False).ids
        if m.validate_tokens(ids) != len(ids):
            return False
        m.consume_tokens(ids)
        return m.is_accepting() and not m.is_error()

    return holds


def test_date_formats_hold_only_calendar_days(tiny_dir):
    """QA pass 8's L2: the grammar engine's `date` allowed February 29 of every year (2015-02-29 came
    back under strict json_schema, and jsonschema and pydantic refuse it). The patterns that replace it
    are checked here against Python's calendar for every day of years 0000-9999 (year 0000 and second 60
    left out: Python's date and datetime refuse them), and the engine holds them. Seen red with
    `engine_schema` passing date formats through (2015-02-29 accepted). A schema's own `pattern` holds
    beside the calendar's (seen red when the calendar gave way to it: 2015-02-29 accepted again)."""
    import datetime
    import re

    from kvgate.structured.schema_prep import FORMAT_PATTERNS

    day = re.compile(FORMAT_PATTERNS["date"])
    for y in range(10000):
        for m in range(1, 13):
            for d in range(1, 32):
                try:
                    real = bool(datetime.date(y, m, d))
                except ValueError:
                    real = False
                assert bool(day.match(f"{y:04d}-{m:02d}-{d:02d}")) == real, (y, m, d)
    schema_holds = json_holds(tiny_dir)

    def holds(fmt: str, value: str, **more) -> bool:
        return schema_holds({"type": "string", "format": fmt, **more}, value)

    assert holds("date", "2016-02-29") and holds("date", "2000-02-29")
    assert (
        not holds("date", "2015-02-29")
        and not holds("date", "1900-02-29")
        and not holds("date", "0000-01-20")
    )
    assert holds("date-time", "2016-02-29T23:59:59.5+05:30") and not holds(
        "date-time", "2015-02-29T01:02:03Z"
    )
    assert not holds("date-time", "2016-02-28T01:02:60Z")
    assert holds("date", "2016-02-29", pattern="^20") and not holds("date", "1999-01-01", pattern="^20")
    assert not holds("date", "2015-02-29", pattern="^20")


def test_zod_record_forms_compile_and_hold_what_they_mean(tiny_dir):
    """QA pass 9's HIGH: zod 4 writes `z.record(z.string(), V)` as `propertyNames: {"type": "string"}`
    (always true), which the engine refused, so every AI SDK or LangChain.js schema with a record field
    was a 400, and so was every request offering a tool with one. Each zod form now compiles to what it
    means: any keys; exactly the enum's keys; keys matching a pattern; a `z.never()` property absent.
    jsonschema agrees with the grammar on every sample. Seen red with `_record_keys` taken out."""
    import jsonschema

    holds = json_holds(tiny_dir)
    num = {"type": "number"}
    cases = [
        (
            {"type": "object", "propertyNames": {"type": "string"}, "additionalProperties": num},
            [{"k": 1}, {}],
            [{"k": "s"}],
        ),
        (
            {
                "type": "object",
                "propertyNames": {"type": "string", "enum": ["a", "b"]},
                "additionalProperties": num,
                "required": ["a", "b"],
            },
            [{"a": 1, "b": 2}],
            [{"a": 1}, {"a": 1, "c": 2}],
        ),
        (
            {"type": "object", "propertyNames": {"pattern": "^x"}, "additionalProperties": num},
            [{"xy": 1}],
            [{"y": 1}],
        ),
        (
            {
                "type": "object",
                "properties": {"n": {"not": {}}, "m": {"type": "string"}},
                "additionalProperties": False,
            },
            [{"m": "s"}, {}],
            [{"n": 1}],
        ),
    ]
    for schema, good, bad in cases:
        for value in good + bad:
            valid = jsonschema.Draft202012Validator(schema).is_valid(value)
            assert valid == (value in good) and holds(schema, value) == valid, (schema, value)


def test_a_format_the_engine_enforces_stands_for_a_pattern_it_cannot_take(tiny_dir):
    """zod 4 writes `z.iso.duration()` as `format: duration` plus a pattern with look-aheads, which the
    engine cannot compile: every schema with one was a 400. The pattern is dropped where the format
    says it; a pattern without a known format still refuses (emoji). Seen red without the drop."""
    from kvgate.structured.schema_prep import compiles, engine_schema

    zod = r"^P(?:(\d+W)|(?!.*W)(?=\d|T\d)(\d+Y)?(\d+M)?(\d+D)?(T(?=\d)(\d+H)?(\d+M)?(\d+([.,]\d+)?S)?)?)$"
    duration = {"type": "string", "format": "duration", "pattern": zod}
    assert compiles(engine_schema(duration))
    schema_holds = json_holds(tiny_dir)

    def holds(value: str) -> bool:
        return schema_holds(duration, value)

    assert holds("P3D") and holds("PT1H30M") and not holds("3D")
    # a date-time whose own pattern is dropped still takes the calendar's days (the reread: the drop
    # came before the calendar in one chain, so the engine's Feb 29 of every year was back; seen red)
    lookahead = {"type": "string", "format": "date-time", "pattern": r"^(?=\d)[\s\S]*$"}
    assert schema_holds(lookahead, "2016-02-29T01:02:03Z") and not schema_holds(
        lookahead, "2015-02-29T01:02:03Z"
    )
    emoji = {
        "type": "string",
        "format": "emoji",
        "pattern": r"^(?=[\s\S]*\p{Extended_Pictographic})\p{Extended_Pictographic}+$",
    }
    assert not compiles(engine_schema(emoji))


def test_descriptions_do_not_count_against_the_grammars_bound(base):
    """QA pass 6: the 32 KiB bound on a grammar's text counted the schema's descriptions and examples,
    so a simple schema with verbose docs (10 string properties, 56 KB of JSON) was a 400 blaming "the
    grammar". Annotations never change what is generated and stay out of the grammar's copy (the
    tools' descriptions still reach the prompt). Seen red without ANNOTATIONS dropped."""
    props = {
        f"p{i}": {"type": "string", "description": "word " * 1000, "examples": ["e" * 50]} for i in range(10)
    }
    schema = {"type": "object", "description": "x" * 5000, "properties": props, "required": ["p0"]}
    assert len(json.dumps(schema)) > 40_000
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    r = httpx.post(base + CHAT, json={"messages": MSG, "response_format": rf, "max_tokens": 5}, timeout=60)
    assert r.status_code == 200, r.text


def test_a_stop_string_does_not_cut_a_call(base):
    """QA pass 6's F10: `stop: ["}"]` (or a quote, or a word of the arguments) cut a call's JSON in
    two and finished with `stop`; every agent framework ran the call and failed on its arguments.
    Stop strings now apply outside the calls only (OpenAI does not stop inside a call's arguments).
    Seen red without `stop_exempt` (finish_reason stop, arguments that do not parse)."""
    for stop in (["}"], ['"'], ["city"]):
        body = {"messages": MSG, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
        body.update(stop=stop, max_tokens=200, temperature=0)
        choice = httpx.post(base + CHAT, json=body, timeout=60).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", (stop, choice)
        check_calls(choice["message"]["tool_calls"])


# ---- the real model ------------------------------------------------------------------------------


@pytest.mark.slow
def test_openai_client_tool_call_streaming_and_not(real_base):
    """The official client: tool_calls whose arguments validate, streaming and not."""
    import openai

    client = openai.OpenAI(base_url=real_base + "/v1", api_key="unused")
    args = dict(
        model="SmolLM2-135M-Instruct",
        messages=MSG,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
    )
    out = client.chat.completions.create(**args)
    calls = [c.model_dump() for c in out.choices[0].message.tool_calls]
    assert out.choices[0].finish_reason == "tool_calls"
    check_calls(calls)
    pieces: dict[int, str] = {}
    names: dict[int, str] = {}
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                pieces[tc.index] = pieces.get(tc.index, "") + (tc.function.arguments or "")
                if tc.function.name:
                    names[tc.index] = tc.function.name
    assert [(names[i], pieces[i]) for i in sorted(pieces)] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls
    ]


@pytest.mark.slow
def test_langchain_runs_a_tool_loop_and_a_structured_output_call(real_base):
    """LangChain's own OpenAI client (langchain-openai) against kvgate: bind_tools -> tool call ->
    ToolMessage -> answer, and with_structured_output(PydanticModel). Seen red before issue 13 (400s
    on tools, tool messages and response_format)."""
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from pydantic import BaseModel

    from tests.server_util import langchain_weather

    llm, get_weather = langchain_weather(real_base)
    with_tools = llm.bind_tools([get_weather], tool_choice="required")
    msgs = [HumanMessage("What is the weather in Paris?")]
    ai = with_tools.invoke(msgs)
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather"
    assert isinstance(ai.tool_calls[0]["args"].get("city"), str)
    msgs += [
        ai,
        ToolMessage(get_weather.invoke(ai.tool_calls[0]["args"]), tool_call_id=ai.tool_calls[0]["id"]),
    ]
    final = llm.bind_tools([get_weather]).invoke(msgs)
    assert isinstance(final.content, str)

    class Answer(BaseModel):
        city: str
        sunny: bool

    got = llm.with_structured_output(Answer).invoke("Is it sunny in Paris? Answer as JSON.")
    assert isinstance(got, Answer)


@pytest.mark.slow
def test_smollm2_makes_one_call_for_one_intent_and_answers_html_as_text(real_base):
    """QA pass 6's HIGH findings on the real model, greedy: with parallel calls allowed (the default),
    "send the email" and "the weather in Paris" each gave two identical calls (an agent would send the
    email twice), and under `auto` an HTML answer came back as a made-up get_weather call. Seen red
    with the old grammar (two calls; a tool call instead of the HTML)."""
    email = {
        "type": "function",
        "function": {
            "name": "send_email",
            "description": "Send an email.",
            "parameters": {
                "type": "object",
                "properties": {"to": {"type": "string"}, "body": {"type": "string", "maxLength": 40}},
                "required": ["to", "body"],
                "additionalProperties": False,
            },
        },
    }
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    for tool, ask in (
        (email, "Send one email to bob@example.com saying hi."),
        (weather, "What's the weather in Paris?"),
    ):
        body = {"messages": [{"role": "user", "content": ask}], "tools": [tool], "tool_choice": "required"}
        body.update(temperature=0, max_tokens=150)
        choice = httpx.post(real_base + CHAT, json=body, timeout=120).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == 1, choice
    ask = "Write an HTML paragraph tag containing the word hi. Output only the HTML."
    bare = {**weather, "function": {k: v for k, v in weather["function"].items() if k != "description"}}
    body = {
        "messages": [{"role": "user", "content": ask}],
        "tools": [bare],
        "temperature": 0,
        "max_tokens": 40,
    }
    choice = httpx.post(real_base + CHAT, json=body, timeout=120).json()["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["message"]["content"].startswith("<"), choice


@pytest.mark.slow
def test_smollm2_answers_in_json_beside_tools_under_auto(real_base):
    """Review of session 47, finding 1 (HIGH), on the real model, greedy: tools under `auto` with a
    `response_format` answered with a made-up get_weather call, because the grammar's bare-call branch
    (`{"name": ...`) took every JSON answer after `{"`. SmolLM2's template asks for no bare calls, so
    its grammar is the Hermes one (as at ac10242) and it answers. Seen red with `asks_bare` true for
    every template and the bare branch kept beside the answer format (f8458f5's grammar): a tool
    call, content None."""
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    time = {
        "type": "function",
        "function": {**weather["function"], "name": "get_time", "description": "Time"},
    }
    body = {
        "messages": [{"role": "user", "content": "Describe a person as JSON with keys name and age."}],
        "tools": [weather, time],
        "tool_choice": "auto",
        "response_format": {"type": "json_object"},
        "temperature": 0,
        "max_tokens": 60,
    }
    choice = httpx.post(real_base + CHAT, json=body, timeout=120).json()["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop", choice
    assert json.loads(choice["message"]["content"]) == {"name": "John", "age": 30}


def test_logprobs_come_with_tool_calls_whole_and_streamed(base):
    """QA pass 16: `logprobs` with `tools` was a 400, so LangChain's `ChatOpenAI({logprobs: true})` lost
    every tool call. Every generated token's logprobs come with the calls, as vLLM gives them: the whole
    body lists one per completion token, and the stream's chunks carry the same tokens in order (a token
    the parser holds back gets a chunk of its own). Red with the refusal back in `features_of`."""
    body = {"messages": MSG, "tools": TOOLS, "tool_choice": "required", "max_tokens": 60, "seed": 3}
    body.update(logprobs=True, top_logprobs=2, temperature=1.0)
    r = httpx.post(base + CHAT, json=body, timeout=60)
    assert r.status_code == 200, r.text
    whole = r.json()
    choice = whole["choices"][0]
    assert choice["message"]["tool_calls"] and choice["finish_reason"] in ("tool_calls", "length")
    tokens = [t["token"] for t in choice["logprobs"]["content"]]
    assert len(tokens) == whole["usage"]["completion_tokens"]
    streamed = []
    with httpx.stream("POST", base + CHAT, json={**body, "stream": True}, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed += [t["token"] for t in (c.get("logprobs") or {}).get("content") or []]
    assert streamed == tokens
