"""Real models' chat templates and tool-call formats (session 47).

The templates of Llama 3.1/3.2/3.3, Qwen2.5, Qwen3, QwQ, DeepSeek-R1-Distill, Mistral Nemo and Small
3.2 were rendered through kvgate's server path and through transformers' `render_jinja_template`
(docs/DESIGN_NOTES.md, session 47, has the table). Their text is not committed here: each test uses a
small template of its own with the Jinja feature that failed. Every test was seen red with its fix
undone (each docstring says how), and green with it.
"""

from __future__ import annotations

import itertools

import pytest
from tokenizers import AddedToken

from kvgate.models.hf_loader import TokenizerInfo
from kvgate.server import protocol as P
from kvgate.server import tool_parser as TP
from kvgate.server import tools as T
from kvgate.server.features import render_chat
from kvgate.server.prepare import chat_ids
from kvgate.tokenizer import ChatTemplateError, TextTokenizer
from tests.tiny_model import build_tokenizer

BOS, EOS = "<|begin_of_text|>", "<|eot_id|>"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather <now> & 'here' in a café",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
ASK = {"role": "user", "content": "Weather in Paris?"}


def tokenizer(template: str) -> TextTokenizer:
    tok = build_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (BOS, EOS)])
    v = tok.get_vocab()
    return TextTokenizer(TokenizerInfo(tok.to_str(), template, v[BOS], v[EOS], [v[EOS]], False))


class _Engine:  # what the server's rendering reads of an engine
    def __init__(self, tok):
        self.tokenizer = tok


def served(template: str, messages: list[dict], **body) -> str:
    """The prompt text exactly as the chat endpoint builds it: the request checked and turned into the
    template's messages (`features.render_chat`), rendered by the request's template fields."""
    tok = tokenizer(template)
    req = P.parse(P.ChatCompletionRequest, {"messages": messages, **body})
    eng = _Engine(tok)
    return tok.decode(
        chat_ids(eng, *render_chat(eng, req, T.plan_tools(req)), req), skip_special_tokens=False
    )


def call(args: str, id_: str = "call_0123456789abcdef01234567") -> dict:
    fn = {"name": "get_weather", "arguments": args}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": id_, "type": "function", "function": fn}],
    }


def answer(id_: str = "call_0123456789abcdef01234567") -> dict:
    return {"role": "tool", "tool_call_id": id_, "content": "21 C"}


# ---- rendering ------------------------------------------------------------------------------------
# Llama 3.x writes each tool with `tojson(indent=4)` and a replayed call's arguments with `tojson`;
# Qwen2.5/3 and Mistral with `tojson`. This one does both.
TOJSON = (
    "{{ bos_token }}{% for t in tools %}{{ t | tojson(indent=2) }}\n{% endfor %}"
    "{% for m in messages %}{% if m.tool_calls %}"
    '{{ \'{"name": "\' + m.tool_calls[0].function.name + \'", "parameters": \' }}'
    "{{ m.tool_calls[0].function.arguments | tojson }}}{% else %}{{ m.content }}{% endif %}|{% endfor %}"
)


def test_tojson_keeps_key_order_and_writes_text_as_it_is_as_transformers_does():
    """Jinja's own `tojson` sorts keys and writes `<`, `>`, `&`, `'` and non-ASCII as \\u escapes: Llama
    3.x, Qwen and Mistral templates showed the model its tools and its own calls spelled as it was
    never trained. Seen red with `env.filters["tojson"] = tojson` left out of `chat_env.template_env`
    ("function" before "type", `\\u003cnow\\u003e`, `caf\\u00e9`)."""
    text = served(TOJSON, [ASK, call('{"city": "Pä <b>", "unit": "c"}'), answer()], tools=[WEATHER])
    assert text.startswith(BOS + '{\n  "type": "function",\n  "function": {\n    "name": "get_weather",')
    assert '"description": "Weather <now> & \'here\' in a café"' in text
    assert '{"name": "get_weather", "parameters": {"city": "Pä <b>", "unit": "c"}}|' in text


def test_arguments_reach_the_template_as_an_object_and_broken_ones_as_empty():
    """vLLM parses each replayed call's arguments to the object (`_postprocess_messages`), which
    templates iterate (`| items`) or write with `| tojson`; arguments that are not JSON (a call cut by
    max_tokens) become `{}` there. Seen red with the string passed on when it does not parse (the old
    `_native_turn`): `"{\\"city\\": \\"Par"` rendered, a broken call shown to the model."""
    t = "{% for m in messages %}{% for c in m.tool_calls or [] %}{% for k, v in c.function.arguments | items %}"
    t += "{{ k }}={{ v }};{% endfor %}{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}{{ tools|length }}"
    assert (
        served(t, [ASK, call('{"city": "Paris"}'), answer()], tools=[WEATHER])
        == 'city=Paris;{"city": "Paris"}1'
    )
    assert served(t, [ASK, call('{"city": "Par'), answer()], tools=[WEATHER]) == "{}1"


def test_loop_controls_and_the_generation_tag_compile():
    """transformers' environment has the loopcontrols extension and its `{% generation %}` tag (training
    templates mark the assistant's tokens with it). Seen red (TemplateSyntaxError when the model loads)
    with `extensions=[...]` left out of `chat_env.template_env`."""
    t = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% generation %}{{ m.role }}:{{ m.content }};{% endgeneration %}{% endfor %}"
    )
    msgs = [{"role": "system", "content": "S"}, ASK, {"role": "assistant", "content": "A"}]
    assert served(t, msgs) == "user:Weather in Paris?;"


def test_tools_and_documents_are_defined_as_none_when_absent():
    """transformers passes `tools=None` (and `documents=None`) when there are none, so a template's
    `tools is not none` is false. Seen red with `tools` left undefined (the old `render_chat`): an
    undefined value is "not none", and the tools header was written for a chat without tools."""
    t = "{% if tools is not none %}TOOLS {% endif %}{% if documents is defined %}D {% endif %}{{ messages[0].content }}"
    assert served(t, [ASK]) == "D Weather in Paris?"
    assert served(t, [ASK], tools=[WEATHER]) == "TOOLS D Weather in Paris?"


def test_a_tools_fields_reach_the_template_as_vllm_passes_them():
    """vLLM gives a template each tool's `description` and `parameters`, None when the request left them
    out (`FunctionDefinition.model_dump()`), and `strict` only when sent. Command R7B's and Cohere2's
    templates write `description | tojson`, Hermes 2 Pro's and 3's tool_use ones read `parameters`: on
    a tool without them kvgate answered a 400 where vLLM renders (13 of llama.cpp's 70 templates
    fail either way, 23 did in kvgate: session 49). Seen red with `tool_list`'s `exclude_none` dump
    given to native templates (Undefined is not JSON serializable: a 400)."""
    t = "{% for t in tools %}{{ t.function | tojson }};{% endfor %}{{ messages[0].content }}"
    strict = {"type": "function", "function": {**TIME["function"], "name": "now", "strict": True}}
    got = served(t, [ASK], tools=[{"type": "function", "function": {"name": "get_time"}}, strict])
    assert got == (
        '{"name": "get_time", "description": null, "parameters": null};'
        '{"name": "now", "description": "The time now", "parameters": null, "strict": true};Weather in Paris?'
    )
    assert served("{{ tools[0].function.description | tojson }}", [ASK], tools=[TIME]) == '"The time now"'


def test_text_parts_are_joined_by_a_newline_as_vllm_and_llama_cpp_join_them():
    """A message's text parts reach the template as one text, the parts joined by "\n" (vLLM's
    `_parse_chat_message_content_parts`, llama.cpp's `to_json_oaicompat`): joined with nothing,
    ["Hello", "world"] was "Helloworld". The Responses API's input_text parts and the Messages API's
    text blocks (which become such parts) take the same rule. Seen red with "".join in
    `chat_messages` and in `responses_input._text`."""
    from kvgate.server.responses_input import to_chat

    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    assert served("{{ messages[0].content }}", [{"role": "user", "content": parts}]) == "Hello\nworld"
    item = {"role": "user", "content": [{"type": "input_text", "text": t} for t in ("Hello", "world")]}
    assert to_chat({"model": "m", "input": [item]})[0]["messages"][0]["content"] == "Hello\nworld"


def test_a_template_that_fails_on_the_messages_is_a_400_not_a_500():
    """DeepSeek-R1-Distill's template joins `'...' + arguments`, a TypeError when they are an object;
    any template can index past a list. vLLM answers those with a 400; kvgate raised them past
    `ChatTemplateError` (a 500). Seen red with `except jinja2.TemplateError` back in `render_chat`."""
    t = "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ 'x' + c.function.arguments }}{% endfor %}"
    t += "{% endfor %}{{ tools | length }}"  # a template that reads `tools` gets the calls as they are
    with pytest.raises(Exception) as err:
        served(t, [ASK, call('{"city": "Paris"}'), answer()], tools=[WEATHER])
    assert getattr(err.value, "status", None) == 400 and "chat template rejected" in str(err.value)
    with pytest.raises(ChatTemplateError):
        tokenizer("{{ messages[5].content }}").render_chat([ASK])


def test_a_namespace_refuses_underscore_names_and_dict_builds_a_dict():
    """transformers' `namespace` refuses attributes starting with `_` and its `dict` is only a
    constructor. Seen red with Jinja's own `namespace` (the `_x` attribute was stored)."""
    ok = "{% set ns = namespace(n=dict(a=1)) %}{% set ns.n = dict.fromkeys(['b'], 2) %}{{ ns.n | tojson }}"
    assert tokenizer(ok).render_chat([ASK]) == '{"b": 2}'
    with pytest.raises(ChatTemplateError, match="may not start with '_'"):
        tokenizer("{% set ns = namespace() %}{% set ns._x = 1 %}").render_chat([ASK])


# Mistral Nemo and Small 3.x refuse ids that are not 9 characters long (it reads `tools`, so it gets
# the turns as they are: kvgate.server.tools)
NINE = (
    "{% if tools %}{% endif %}{% for m in messages %}{% for c in m.tool_calls or [] %}{% if c.id|length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "[CALL {{ c.id }}]{% endfor %}{% if m.role == 'tool' %}[RESULT {{ m.tool_call_id }}]{% endif %}{% endfor %}"
)


def test_mistral_templates_get_nine_character_ids_alike_in_the_call_and_its_answer():
    """kvgate's own call ids (`call_` + 24 hex digits) and OpenAI's were a 400 with Mistral's templates.
    Each id is rewritten alike in the call and its answer: its last 9 characters when they are letters
    and digits (vLLM's rule for Mistral tokenizers), else a hash's; 9-character ids stay. Seen red
    with `nine_char_ids` not applied in `render_chat` (the template's exception, a 400)."""
    assert served(NINE, [ASK, call("{}"), answer()], tools=[WEATHER]) == "[CALL f01234567][RESULT f01234567]"
    text = served(NINE, [ASK, call("{}", "call_ab-c"), answer("call_ab-c")], tools=[WEATHER])
    short = text[len("[CALL ") : len("[CALL ") + 9]
    assert len(short) == 9 and text == f"[CALL {short}][RESULT {short}]"
    assert (
        served(NINE, [ASK, call("{}", "abcDEF123"), answer("abcDEF123")])
        == "[CALL abcDEF123][RESULT abcDEF123]"
    )


LOOPS = (
    "{% for t in tools + tools %}{% if loop.index > 1 %}{% break %}{% endif %}{% generation %}"
    "{{ t.function | tojson(indent=1) }}{% endgeneration %}{% endfor %}{{ messages[1].tool_calls[0].id }}"
)


@pytest.mark.parametrize("template", [TOJSON, LOOPS], ids=["tojson", "loops"])
def test_kvgate_renders_what_transformers_renders_from_the_same_inputs(template):
    """The same template inputs (what the server passes) through transformers' reference renderer give
    the same text: the environment is transformers'. Seen red with Jinja's `tojson` (both), and
    without loopcontrols (the second: it did not compile)."""
    hf = pytest.importorskip("transformers.utils.chat_template_utils")
    tok = tokenizer(template)
    req = P.parse(
        P.ChatCompletionRequest, {"messages": [ASK, call('{"city": "Pä <b>"}'), answer()], "tools": [WEATHER]}
    )
    msgs, tools = render_chat(_Engine(tok), req, T.plan_tools(req))
    ref = hf.render_jinja_template(
        [msgs], tools=tools, chat_template=template, add_generation_prompt=True, bos_token=BOS, eos_token=EOS
    )[0][0]
    assert tok.render_chat(msgs, True, tools) == ref


# ---- tool-call formats ----------------------------------------------------------------------------
NAMES = frozenset({"get_weather", "get_time"})  # a Llama template's declared functions (bare mode)


def parsed(text: str, step: int, names=NAMES) -> tuple[str | None, list[tuple[str, str, bool]], str]:
    p = TP.ToolCallParser(names)
    for i in range(0, len(text), step):
        p.push(text[i : i + step])
    p.end(cut=False)
    return "".join(p.content) or None, [(c.name, c.arguments, c.done) for c in p.calls], p.state


LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "note": "a } and a \\" inside"}}'


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_a_llama_bare_call_is_read_as_a_call_in_any_pieces(step):
    """Llama 3.x's templates ask for `{"name": ..., "parameters": {...}}` as the whole answer (vLLM's
    `llama3_json` parser; `"arguments"` is read too). Seen red with the bare opening taken out of
    `ToolCallParser._start` (the call came back as content)."""
    args = '{"city": "Paris", "note": "a } and a \\" inside"}'
    assert parsed(LLAMA_CALL, step) == (None, [("get_weather", args, True)], "tail")
    assert parsed(LLAMA_CALL.replace("parameters", "arguments") + "\n\nDone.", step)[1] == [
        ("get_weather", args, True)
    ]
    # JSON that only begins like a call is an answer
    for text in ('{"name": "Bob", "age": 3}', '{"name": 7}', '{ "name": "x", "parameters": {}}'):
        assert parsed(text, step) == (text, [], "content")


def test_hermes_calls_of_qwen_are_read_with_the_text_before_them():
    """Qwen2.5/Qwen3 (Hermes's format): text, then one or more `<tool_call>` blocks, read as before the
    bare form came. Seen red with `ToolCallParser._keys` giving Llama's key to a Hermes block."""
    out = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    )
    out += '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    content, calls = TP.parse_output(out, cut=False)
    assert content == "Let me check." and [(c.name, c.arguments, c.done) for c in calls] == [
        ("get_weather", '{"city": "Paris"}', True),
        ("get_time", "{}", True),
    ]


def test_a_bare_call_finishes_with_tool_calls_and_a_cut_one_keeps_length():
    """A whole bare call finishes `tool_calls` with content None; one cut by max_tokens keeps `length`
    and the arguments so far. Seen red with the bare call's `done` not set in `_close` (`stop`)."""
    choice = {"message": {"content": LLAMA_CALL}, "finish_reason": "stop"}
    TP.read_calls(choice, ended=True, bare_names=NAMES)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    at = LLAMA_CALL.index("{", 1) + 4  # cut 4 characters into the arguments
    cut = {"message": {"content": LLAMA_CALL[:at]}, "finish_reason": "length"}
    TP.read_calls(cut, bare_names=NAMES)
    assert (
        cut["finish_reason"] == "length"
        and cut["message"]["tool_calls"][0]["function"]["arguments"] == '{"ci'
    )


def test_the_grammar_takes_a_bare_call_and_no_answer_that_opens_like_one():
    """With bare calls offered (a Llama template's plan), the grammar takes the Hermes blocks and one
    bare call, so a Llama model under `auto` writes its own format and it is a call. Seen red with the `bare` alternative taken out
    of `tools.grammar` (the call was refused) and with the answer's `& ~/\\{"name": .../` taken out (a
    bare call was also an answer: the parser and the grammar disagreed)."""
    from kvgate.structured.compiler import GrammarCompiler

    tok = build_tokenizer()
    comp = GrammarCompiler(tok.to_str(), [2], tok.get_vocab_size(), 4)
    fns = [P.FunctionDef.model_validate(WEATHER["function"]), P.FunctionDef(name="get_time")]

    def takes(text: str, mode: str, as_answer: bool = False) -> bool:
        g = T.grammar(T.ToolPlan(mode, fns, True, bare=True), None)
        if as_answer:  # the free-text answer alone
            g = g.replace("start: answer | calls | lead | bare", "start: answer")
        m = comp.matcher(g)
        ids = tok.encode(text, add_special_tokens=False).ids
        return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()

    bare = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    for mode, text in itertools.product(
        ("auto", "required"), (bare, bare.replace("parameters", "arguments"))
    ):
        assert takes(text, mode), (mode, text)
    assert not takes(bare, "auto", as_answer=True) and takes('{ "name": 1}', "auto", as_answer=True)
    assert not takes('{"name": "get_weather", "parameters": {}}', "auto")  # held to the schema
    assert not takes(bare + bare, "auto")  # one bare call


# ---- over HTTP: a Llama-like template on the tiny model --------------------------------------------
LLAMA_LIKE = (
    "{% if tools %}<|im_start|>system\nCall a function as "
    '{"name": function name, "parameters": its arguments}:\n{% for t in tools %}{{ t | tojson }}\n'
    "{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% set c = m.tool_calls[0].function %}"
    '{{ \'{"name": "\' + c.name + \'", "parameters": \' + c.arguments | tojson + "}" }}'
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def serving(d):
    """A live server on the model directory `d` (float32, 16 MiB of KV): yields (base URL, engine)."""
    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine
    from tests.server_util import running_server

    ecfg = EngineConfig(kv_cache_bytes=16 << 20, memory_limit="2GiB", dtype="float32", device="cpu")
    engine = Engine.from_model(str(d), ecfg, overhead_bytes=0).start()
    try:
        with running_server(engine) as (base, _app):
            yield base, engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def llama_like(tmp_path_factory):
    import json

    from tests.tiny_model import make_tiny_hf_dir

    d = make_tiny_hf_dir(tmp_path_factory.mktemp("llama_like"), geometry={"max_pos": 2048})
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": LLAMA_LIKE}))
    yield from serving(d)


def test_a_model_that_writes_the_bare_form_gets_tool_calls_whole_and_streamed(llama_like):
    """A model whose template asks for Llama's bare form (the tiny model pushed to it by a bias on
    `{`, with `required` and a function without parameters: under `auto` the bias wrote `{{{{` as an
    answer): its output is a call, the same whole and streamed, finishing `tool_calls`; the replayed
    call renders through the template as `"parameters": {}`. Seen red with the bare opening taken out
    of `ToolCallParser._start` (no call, finish_reason `stop`)."""
    import json

    import httpx

    base, engine = llama_like
    brace = engine.tokenizer.encode("{", add_bos=False)[0]
    body = {
        "messages": [ASK],
        "tools": [TIME],
        "tool_choice": "required",
        "max_tokens": 60,
        "temperature": 0,
        "logit_bias": {str(brace): 100},
    }
    whole = httpx.post(base + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None, whole
    (got,) = whole["message"]["tool_calls"]
    assert got["function"]["name"] == "get_time" and got["function"]["arguments"] == "{}"
    args, finish = "", None
    with httpx.stream("POST", base + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    for tc in c["delta"].get("tool_calls") or []:
                        args += tc["function"].get("arguments", "")
                    finish = c["finish_reason"] or finish
    assert (args, finish) == (got["function"]["arguments"], "tool_calls")
    replay = [ASK, {"role": "assistant", "content": None, "tool_calls": [got]}, answer(got["id"])]
    r = httpx.post(base + "/v1/tokenize", json={"messages": replay, "tools": [TIME]}, timeout=60).json()
    text = engine.tokenizer.decode(r["tokens"], skip_special_tokens=False)
    assert '<|im_start|>assistant\n{"name": "get_time", "parameters": {}}<|im_end|>' in text


# ---- review of session 47: bare calls only where the template asks, Qwen's tags as tokens ---------
# Each test was seen red with its fix undone (the docstrings say how).
WEATHER_ENUM = {  # arguments a grammar writes whole however random the model: "city" is in them
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
QWEN_LIKE = (  # Qwen2.5/3's shape: reads `tools`, asks for Hermes blocks
    "{% if tools %}<|im_start|>system\nCall a function inside <tool_call></tool_call> tags:\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HERMES_LIKE = QWEN_LIKE.replace("tags:", 'tags, as {"name": ..., "parameters": ...}:')  # Hermes 2 Pro/3
CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
JSON_ANSWER = '{"name": "John", "age": 30}'


def features(template: str, **body):
    """`features.features_of` for a chat request to a model with `template` (the tiny vocabulary)."""
    from types import SimpleNamespace as NS

    from kvgate.server.features import features_of

    tok = tokenizer(template)
    eng = NS(
        tokenizer=tok, max_model_len=4096, plan=NS(limits=NS(grammars=4)), spec=NS(vocab_size=tok.vocab_size)
    )
    req = P.parse(P.ChatCompletionRequest, {"messages": [ASK], "tools": [WEATHER, TIME], **body})
    return tok, features_of(eng, req)


def grammar_takes(tok, grammar, text: str) -> bool:
    m = grammar.matcher()
    ids = tok.encode(text, add_bos=False)
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


def test_only_a_template_that_asks_for_bare_calls_gets_them():
    """Llama 3.x's templates (read `tools`, show `"parameters"`, no `<tool_call>`) get bare calls; a
    template without tools (SmolLM2's ChatML), Qwen's and Hermes 2 Pro/3's (which write `"parameters"`
    in their tool list, and `<tool_call>`) do not, and their grammar is the Hermes one alone, as before
    session 47. Seen red with `asks_bare` true for every template (f8458f5's rule) and with its
    `<tool_call>` check dropped (Hermes-like got bare calls)."""
    bare = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    for template, asks in ((LLAMA_LIKE, True), (CHATML, False), (QWEN_LIKE, False), (HERMES_LIKE, False)):
        tok, f = features(template, tool_choice="required")  # (under auto that text is an answer)
        assert f.tools.bare is asks and T.asks_bare(tok) is asks, template
        assert ("bare" in f.grammar.text) is asks and grammar_takes(tok, f.grammar, bare) is asks, template
        assert f.tools.bare_names == (frozenset({"get_weather", "get_time"}) if asks else frozenset())


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "json_object"},
        {
            "type": "json_schema",
            "json_schema": {
                "name": "person",
                "schema": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                    "required": ["name", "age"],
                },
            },
        },
    ],
    ids=["json_object", "json_schema"],
)
def test_tools_beside_an_answer_format_let_the_model_answer(fmt):
    """Review finding 1 (HIGH): tools under `auto` with a `response_format` (the Responses API's
    text.format, the Messages API's output_config.format) could not answer: `answer | calls | bare`
    let llguidance commit to the bare call after `{"`, so `{"name": "John", ...}` was refused (real
    SmolLM2 greedy: a get_weather call where it answered that JSON). Now no bare branch beside an
    answer format, even for a Llama template, and the parser is told so. Seen red with the `bare`
    alternative kept beside `answer_rule` in `tools.grammar`, and with `features_of` setting
    `bare` without looking at the answer format."""
    from kvgate.structured.compiler import compiler_for

    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    for template in (LLAMA_LIKE, CHATML):
        tok, f = features(template, tool_choice="auto", response_format=fmt)
        assert grammar_takes(tok, f.grammar, JSON_ANSWER) and grammar_takes(tok, f.grammar, call), template
        assert f.tools.bare is False and f.tools.bare_names == frozenset()
        # the grammar alone, asked for both (a plan that offers bare calls): the answer still wins
        both = T.grammar(T.ToolPlan("auto", f.tools.functions, True, bare=True), "%json {}")
        assert grammar_takes(tok, compiler_for(tok, tok.vocab_size, 4).check(both), JSON_ANSWER)


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_bare_head_is_a_call_only_of_a_declared_function_and_else_text(step):
    """Review finding 3: the bare mode misread JSON answers. A name no tool has is text (released as
    soon as it can no longer be a declared one's), extra keys after the arguments cannot make a call,
    a cut in the head gives the text back (not nothing), and with no bare calls offered (`bare_names`
    empty: Hermes and ChatML templates) a bare call is text. Seen red with `_bare_head` taking any
    name (f8458f5's rule: exp1 and Bob became calls), with `end` dropping a held bare head (the cut
    text lost), and with the parser in bare mode whatever `bare_names` (the last case a call)."""
    for text in ('{"name": "exp1", "parameters": {"a": 1}, "score": 3}', '{"name": "Bob", "age": 3}'):
        assert parsed(text, step) == (text, [], "content")
    p = TP.ToolCallParser(NAMES)
    assert p.push('{"name": "B') == [("content", '{"name": "B')]
    for cut in ('{"name": "A long person na', '{"name": "get_wea', '{"name": '):
        assert TP.parse_output(cut, bare_names=NAMES) == (cut, []), cut
    content, calls = TP.parse_output('{"name": "get_weather", "para', bare_names=NAMES)
    assert content is None and [(c.name, c.arguments, c.done) for c in calls] == [("get_weather", "", False)]
    assert parsed(LLAMA_CALL, step, names=frozenset()) == (LLAMA_CALL, [], "content")


def test_stop_strings_do_not_apply_inside_a_bare_call_and_do_after_it():
    """Review finding 2: only Hermes blocks were exempt from stop strings, so `stop: ["city"]` cut a
    bare call to arguments `{"` (finish `stop`). A bare call is exempt from its `{"name": ` to the end
    of its JSON object (braces and quotes inside strings do not end it); a stop after it, or in a text
    answer, applies; a Hermes-only plan keeps exactly `CALL_REGION`. Seen red with `stop_regions`
    giving `CALL_REGION` alone for a bare plan."""
    from kvgate.stop import StopMatcher

    fns = [P.FunctionDef(name="f")]
    assert T.stop_regions(T.ToolPlan("auto", fns, True)) is T.CALL_REGION
    call = '{"name": "f", "parameters": {"city": "a } \\" city {", "n": [1, {"x": "city"}]}}'
    for size in (1, 3, 7):
        m = StopMatcher(set(), ["city", "}", '"'], T.stop_regions(T.ToolPlan("auto", fns, True, bare=True)))
        pieces = [call[i : i + size] for i in range(0, len(call), size)] + ["\nObs city"]
        out, stopped = zip(*(m.push(x) for x in pieces))
        assert ("".join(out), any(stopped)) == (call + "\nObs ", True), size
    m = StopMatcher(set(), ["city"], T.stop_regions(T.ToolPlan("auto", fns, True, bare=True)))
    assert m.push("The city is") == ("The ", True)


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_leaves_a_bare_call_whole_over_http(llama_like, stream):
    """Finding 2 through the server (`prepare` passes `stop_regions` to the engine's StopMatcher): the
    tiny model pushed to the bare form by a bias on `{`, `stop: ["city"]`, arguments that hold "city".
    Seen red with `stop_regions` giving `CALL_REGION` alone (arguments `{"`, finish_reason `stop`)."""
    import json

    import httpx

    base, engine = llama_like
    brace = engine.tokenizer.encode("{", add_bos=False)[0]
    body = {
        "messages": [ASK],
        "tools": [WEATHER_ENUM],
        "tool_choice": "required",
        "max_tokens": 60,
        "temperature": 0,
        "stop": ["city"],
        "logit_bias": {str(brace): 100},
    }
    url = base + "/v1/chat/completions"
    if not stream:
        choice = httpx.post(url, json=body, timeout=60).json()["choices"][0]
        args, finish = choice["message"]["tool_calls"][0]["function"]["arguments"], choice["finish_reason"]
    else:
        args, finish = "", None
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        for tc in c["delta"].get("tool_calls") or []:
                            args += tc["function"].get("arguments", "")
                        finish = c["finish_reason"] or finish
    assert finish == "tool_calls" and json.loads(args)["city"] in ("Paris", "Rome"), (args, finish)


TAGS = ("<tool_call>", "</tool_call>")
_BYTES = build_tokenizer()  # the vocabulary without the tags: the same ids for everything else


def pieces(text: str) -> list[int]:
    return _BYTES.encode(text, add_special_tokens=False).ids


def qwen_tokenizer(special: bool = False) -> TextTokenizer:
    """The tiny vocabulary with `<tool_call>` and `</tool_call>` added, not special, as Qwen2.5/3's."""
    tok = build_tokenizer()
    tok.add_tokens([AddedToken(t, special=special, normalized=False) for t in TAGS])
    return TextTokenizer(TokenizerInfo(tok.to_str(), QWEN_LIKE, None, 2, [2], False))


def test_qwens_added_tool_call_tokens_are_taken_under_auto_and_required():
    """Review finding 4: Qwen2.5/3 have `<tool_call>` and `</tool_call>` as added tokens, which
    llguidance never matches against the grammar's literal text: under `auto` the model's own
    `<tool_call>` token was forbidden (it could not call), under `required` the tag was forced as byte
    pieces. The grammar now takes each as its token or its text (`<[id]>`, as reasoning's
    `wrap_grammar` does for `<think>`), and the detokenizer writes the (not special) tokens as text,
    so the parser reads the call. Seen red with `tag_ids` ignored in `features_of` (0 tokens taken)."""
    from types import SimpleNamespace as NS

    from kvgate.server.features import features_of

    tok = qwen_tokenizer()
    o, e = T.tag_ids(tok)
    assert (o, e) == tuple(tok.tok.token_to_id(t) for t in TAGS) and None not in (o, e)
    assert T.tag_ids(qwen_tokenizer(special=True)) == (None, None)  # the detokenizer would drop them

    def spell(*parts):  # strings in the byte-level tokens (a tag as its pieces), ids as they are
        return [
            i for p in parts for i in ([p] if isinstance(p, int) else p if isinstance(p, list) else pieces(p))
        ]

    body = '{"name": "get_time", "arguments": {}}\n'
    own = spell(o, "\n" + body, e)
    eng = NS(
        tokenizer=tok, max_model_len=4096, plan=NS(limits=NS(grammars=4)), spec=NS(vocab_size=tok.vocab_size)
    )
    for mode in ("auto", "required"):
        req = P.parse(P.ChatCompletionRequest, {"messages": [ASK], "tools": [TIME], "tool_choice": mode})
        g = features_of(eng, req).grammar
        for ids in (own, spell("<tool_call>\n" + body + "</tool_call>"), spell(own, "\n\n", own)):
            m = g.matcher()
            assert m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting(), mode
        if mode == "auto":
            ids = spell("Let me check.\n", own)
            assert g.matcher().validate_tokens(ids) == len(ids)
    text = tok.decode(own)
    assert text == "<tool_call>\n" + body + "</tool_call>"
    assert [(c.name, c.arguments, c.done) for c in TP.parse_output(text, cut=False)[1]] == [
        ("get_time", "{}", True)
    ]


@pytest.fixture(scope="module")
def qwen_like(tmp_path_factory):
    """A server on the tiny model with Qwen's tags added to its vocabulary and a Qwen-like template."""
    import json

    from safetensors.torch import save_file

    from tests.tiny_model import config_dict, random_weights

    d = tmp_path_factory.mktemp("qwen_like")
    tok = build_tokenizer()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    tok.save(str(d / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    (d / "config.json").write_text(json.dumps(config_dict(vocab, g={"max_pos": 2048})))
    cfg = {
        "chat_template": QWEN_LIKE,
        "eos_token": "<|im_end|>",
        "bos_token": "<|im_start|>",
        "add_bos_token": False,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    save_file(random_weights(vocab), str(d / "model.safetensors"))
    yield from serving(d)


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_a_qwen_like_model_calls_with_its_own_tag_tokens_over_http(qwen_like, mode):
    """Finding 4 through the server: a model that wants its own `<tool_call>` / `</tool_call>` tokens
    (a bias on both) writes them, and its call comes back whole (the detokenizer keeps the tags' text
    for the parser). Seen red with `tag_ids` ignored in `features_of`: under `auto` no call at all
    (the token was forbidden: newlines as content), under `required` a failed generation (a 500:
    llguidance's mask let the token through where the grammar forced the tag's text, as the
    tokenizer spells that text, and its matcher then refused it)."""
    import httpx

    base, engine = qwen_like
    o, e = T.tag_ids(engine.tokenizer)
    body = {
        "messages": [ASK],
        "tools": [TIME],
        "tool_choice": mode,
        "parallel_tool_calls": False,
        "max_tokens": 60,
        "temperature": 0,
        "logit_bias": {str(o): 100, str(e): 100},
        "return_token_ids": True,
    }
    choice = httpx.post(base + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    (got,) = choice["message"]["tool_calls"]
    assert (got["function"]["name"], got["function"]["arguments"]) == ("get_time", "{}")
    assert choice["token_ids"][0] == o and e in choice["token_ids"], choice["token_ids"]
