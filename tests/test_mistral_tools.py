"""Mistral's tool calls (`[TOOL_CALLS]`), both forms (kvgate/server/mistral_tools.py, session 49).

Mistral 7B v0.3 and Nemo write `[TOOL_CALLS][{"name": ..., "arguments": ...}]`; Small 3.1+, Devstral
and Ministral 3 write `[TOOL_CALLS]name[ARGS]{...}` once per call. The templates below are small ones
in the style of the real ones (Nemo 2407's, Small 3.2's, Devstral's: their text is not committed; the
session 49 notes say how the real ones were checked). The vocabulary is the tiny byte-level one with
the control tokens added as special tokens, as Mistral's are.
"""

from __future__ import annotations

import json
from types import SimpleNamespace as NS

import pytest
from tokenizers import AddedToken

from kvgate.models.hf_loader import TokenizerInfo
from kvgate.server import mistral_tools as MT
from kvgate.server import protocol as P
from kvgate.server import tools as T
from kvgate.server.features import features_of, render_chat
from kvgate.server.prepare import chat_ids
from kvgate.stop import StopMatcher
from kvgate.tokenizer import IncrementalDetokenizer, TextTokenizer
from tests.tiny_model import build_tokenizer

BOS, EOS = "<s>", "</s>"
CONTROL = [
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
]
CONTROL += ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"]
_TURNS = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}"
    "{% if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST]{{ m.content }}[/INST]{% elif m.tool_calls %}CALLS{{ eos_token }}"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.tool_call_id }}: {{ m.content }}[/TOOL_RESULTS]"
    "{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"
)
_CHECK = "{% if c.id | length != 9 %}{{ raise_exception('Tool call IDs should be of length 9!') }}{% endif %}"
# Nemo 2407's way: the function as JSON, its last brace cut, the id added
NEMO_LIKE = _TURNS.replace(
    "CALLS",
    "[TOOL_CALLS][{% for c in m.tool_calls %}" + _CHECK + "{% set out = c.function | tojson %}{{ out[:-1] }}"
    ', "id": "{{ c.id }}"}{% if not loop.last %}, {% endif %}{% endfor %}]',
)
# Small 3.2's: a token per call, with its id
SMALL_LIKE = _TURNS.replace(
    "CALLS",
    "{% for c in m.tool_calls %}" + _CHECK + "[TOOL_CALLS]{{ c.function.name }}[CALL_ID]{{ c.id }}"
    "[ARGS]{{ c.function.arguments | tojson }}{% endfor %}",
)
# Devstral's and Ministral 3's: a token per call, no id
DEVSTRAL_LIKE = _TURNS.replace(
    "CALLS",
    "{% for c in m.tool_calls %}[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments | tojson }}"
    "{% endfor %}",
)
TEMPLATES = {"nemo": NEMO_LIKE, "small": SMALL_LIKE, "devstral": DEVSTRAL_LIKE}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
ASK = {"role": "user", "content": "Weather in Paris?"}


def mistral_tokenizer(template: str) -> TextTokenizer:
    tok = build_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in [BOS, EOS, *CONTROL]])
    v = tok.get_vocab()
    return TextTokenizer(TokenizerInfo(tok.to_str(), template, v[BOS], v[EOS], [v[EOS]], False))


def engine_of(tok):
    return NS(
        tokenizer=tok, max_model_len=4096, plan=NS(limits=NS(grammars=4)), spec=NS(vocab_size=tok.vocab_size)
    )


def features(template: str, **body):
    tok = mistral_tokenizer(template)
    req = P.parse(P.ChatCompletionRequest, {"messages": [ASK], "tools": [WEATHER, TIME], **body})
    return tok, features_of(engine_of(tok), req)


def takes(tok, grammar, text: str) -> bool:
    """Whether the grammar takes `text` as the tokenizer spells it (control tokens as their ids)."""
    m = grammar.matcher()
    ids = tok.encode(text, add_bos=False)
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


def test_the_format_is_known_from_the_template_and_the_vocabulary():
    """Seen red with `[ARGS]` looked for in the vocabulary alone (Nemo-like: the token-per-call form,
    whose grammar then refused Nemo's list) and with the vocabulary not asked (a template that writes
    `[TOOL_CALLS]` over a vocabulary without it got a grammar naming no token)."""
    nemo = MT.mistral_format(mistral_tokenizer(NEMO_LIKE))
    small = MT.mistral_format(mistral_tokenizer(SMALL_LIKE))
    dev = MT.mistral_format(mistral_tokenizer(DEVSTRAL_LIKE))
    assert nemo.args is None and nemo.call_id is None and len(nemo.kept) == 1
    assert small.args is not None and small.call_id is not None and len(small.kept) == 3
    assert dev.args is not None and dev.call_id is None
    plain = build_tokenizer()  # no control tokens: Hermes, as before
    info = TokenizerInfo(plain.to_str(), NEMO_LIKE, None, 2, [2], False)
    assert MT.mistral_format(TextTokenizer(info)) is None
    assert MT.mistral_format(mistral_tokenizer("{{ tools }}{{ messages }}")) is None


def replayed(template: str, calls: list[tuple[str, dict]]) -> tuple[TextTokenizer, str]:
    """The text the template writes for an assistant turn of these calls, through the server's path."""
    tok = mistral_tokenizer(template)
    turn = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"call_{n}abcdefgh",
                "type": "function",
                "function": {"name": f, "arguments": json.dumps(a)},
            }
            for n, (f, a) in enumerate(calls)
        ],
    }
    req = P.parse(P.ChatCompletionRequest, {"messages": [ASK, turn], "tools": [WEATHER, TIME]})
    eng = engine_of(tok)
    text = tok.decode(
        chat_ids(eng, *render_chat(eng, req, T.plan_tools(req)), req), skip_special_tokens=False
    )
    return tok, text[text.index("[/INST]") + len("[/INST]") : text.rindex(EOS)]


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_what_the_template_shows_the_model_the_grammar_takes_and_the_parser_reads_back(name):
    """The round trip: a replayed turn of two calls, as the template writes it (ids and all), is taken
    by the request's grammar under `auto` and `required`, and the parser gives the same calls back,
    with 9-character ids. Seen red with the Hermes grammar kept for Mistral templates (`features_of`),
    with the list's id not allowed (Nemo-like), and with `[CALL_ID]` not allowed (Small-like)."""
    calls = [("get_weather", {"city": "Paris"}), ("get_time", {})]
    tok, text = replayed(TEMPLATES[name], calls)
    assert text.startswith("[TOOL_CALLS]") and "Paris" in text, text
    for mode in ("auto", "required"):
        _, f = features(TEMPLATES[name], tool_choice=mode)
        assert f.tools.mistral is not None and f.tools.bare is False
        assert takes(tok, f.grammar, text), (mode, text)
        assert takes(tok, f.grammar, "Let me check. " + text) is (mode == "auto")
    p = MT.parser_for(f.tools)
    p.push(text)
    p.end(cut=False)
    got = [(c.name, json.loads(c.arguments), c.done) for c in p.calls]
    assert got == [(n, a, True) for n, a in calls] and not p.content
    assert all(len(c.id) == 9 and c.id.isalnum() for c in p.calls)


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_an_answer_is_free_text_without_the_mark_and_calls_keep_their_schema(name):
    """Under `auto` an answer is text, which may not hold `[TOOL_CALLS]` as characters (the parser
    would read a call there); one call only without parallel_tool_calls; arguments follow the schema.
    Seen red with the answer's exclusion dropped (the literal mark was taken)."""
    tok, f = features(TEMPLATES[name], tool_choice="auto")
    assert takes(tok, f.grammar, "It is 21 C in [Paris] today.")
    ids = build_tokenizer().encode("say [TOOL_CALLS] now", add_special_tokens=False).ids  # as characters
    assert f.grammar.matcher().validate_tokens(ids) < len(ids)
    one = replayed(TEMPLATES[name], [("get_weather", {"city": "Paris"})])[1]
    two = replayed(TEMPLATES[name], [("get_weather", {"city": "Paris"}), ("get_time", {})])[1]
    _, single = features(TEMPLATES[name], tool_choice="auto", parallel_tool_calls=False)
    assert takes(tok, single.grammar, one) and not takes(tok, single.grammar, two)
    assert not takes(tok, f.grammar, one.replace('"Paris"', "7"))  # city must be a string


def _read(p, text: str, step: int, cut: bool = False):
    events = []
    for i in range(0, len(text), step):
        events += p.push(text[i : i + step])
    events += p.end(cut=cut)
    return events


LISTED = (
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "a } ] \\" [ARGS]"}, "id": "a1B2c3D4e"}, '
)
LISTED += '{"name": "get_time", "arguments": {}}]'
PER_CALL = (
    '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "a } ] \\" [ARGS]"}[TOOL_CALLS]get_time[ARGS]{}'
)


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("listed", [True, False], ids=["listed", "per_call"])
def test_calls_are_read_in_any_pieces_with_the_text_before_them(listed, step):
    """Content before the mark is the message's content (trailing space dropped, as for Hermes); each
    call's arguments come out exactly as written, whatever `}`, `]`, quotes or `[ARGS]` they hold; the
    model's own id (list form) never reaches the arguments. Seen red with the list's id left in the
    arguments, and with the arguments ended at their first `}` (both forms)."""
    text = "Let me check. \n" + (LISTED if listed else PER_CALL)
    p = MT.MistralCallParser(listed)
    events = _read(p, text, step)
    assert "".join(e[1] for e in events if e[0] == "content") == "Let me check."
    args = {c.index: "" for c in p.calls}
    for e in events:
        if e[0] == "args":
            args[e[1]] += e[2]
    assert [(c.name, c.arguments, c.done) for c in p.calls] == [
        ("get_weather", '{"city": "a } ] \\" [ARGS]"}', True),
        ("get_time", "{}", True),
    ]
    assert args == {0: p.calls[0].arguments, 1: "{}"} and p.after_calls is listed


@pytest.mark.parametrize("listed", [True, False], ids=["listed", "per_call"])
def test_a_cut_output_gives_the_calls_so_far_and_no_markup_as_content(listed):
    """Cut by max_tokens anywhere past the opening token (the mark is one token: its text comes whole):
    no markup ever comes out as content; a call whose name is whole comes out with the arguments so far
    (done only when they closed); an answer that ends in a part of the mark's characters keeps them,
    whether the model ended it or it was cut (the text is split in 3s, so the part is held back first).
    Seen red with the held part dropped on a cut, Hermes's rule (session 49's review: "See [TOOL_C"
    came back as "See ")."""
    text = LISTED if listed else PER_CALL
    for cut in [0, *range(len(MT.MARK), len(text))]:
        p = MT.MistralCallParser(listed)
        _read(p, text[:cut], 5, cut=True)
        assert "".join(p.content) == "", (cut, p.content)
        for c in p.calls:
            assert c.name in ("get_weather", "get_time") and (c.arguments or "{").startswith("{")
    ended = MT.MistralCallParser(listed)
    _read(ended, "See [TOOL_CA", 3, cut=False)
    assert "".join(ended.content) == "See [TOOL_CA" and not ended.calls
    cut = MT.MistralCallParser(listed)
    _read(cut, "See [TOOL_CA", 3, cut=True)
    assert "".join(cut.content) == "See [TOOL_CA"


def test_the_detokenizer_writes_the_kept_control_tokens_and_no_others():
    """The parser reads `[TOOL_CALLS]` in the text, which the detokenizer would leave out as any control
    token; it writes the format's tokens and still leaves out the others (`</s>`, `[INST]`). Seen red
    with `keep` ignored in `IncrementalDetokenizer._decode`."""
    tok = mistral_tokenizer(DEVSTRAL_LIKE)
    fmt = MT.mistral_format(tok)
    v = tok.tok.get_vocab()
    ids = [
        v["[TOOL_CALLS]"],
        *tok.encode("get_time", add_bos=False),
        v["[ARGS]"],
        *tok.encode("{}", add_bos=False),
    ]
    ids += [v["[INST]"], v[EOS]]
    d = IncrementalDetokenizer(tok, tok.encode("Hi", add_bos=False), keep=fmt.kept)
    assert "".join(d.push(i) for i in ids) + d.flush() == "[TOOL_CALLS]get_time[ARGS]{}"
    plain = IncrementalDetokenizer(tok, [])
    assert "".join(plain.push(i) for i in ids) + plain.flush() == "get_time{}"


def test_stop_strings_do_not_cut_the_calls():
    """A stop string that occurs in the arguments does not end the output inside the calls; it does in
    the text before them. Seen red with `stop_regions` giving Hermes's regions to a Mistral plan."""
    _, f = features(DEVSTRAL_LIKE, tool_choice="auto")
    regions = T.stop_regions(f.tools)
    m = StopMatcher(set(), ["Paris"], regions)
    out, hit = m.push('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', final=True)
    assert not hit and out.endswith('"Paris"}')
    m = StopMatcher(set(), ["Paris"], regions)
    assert m.push("In Paris now", final=True) == ("In ", True)


# ---- through the server -------------------------------------------------------------------------
def mistral_dir(d, template: str):
    from safetensors.torch import save_file

    from tests.tiny_model import config_dict, random_weights

    tok = build_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in [BOS, EOS, *CONTROL]])
    tok.save(str(d / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    (d / "config.json").write_text(json.dumps(config_dict(vocab, g={"max_pos": 2048})))
    cfg = {"chat_template": template, "eos_token": EOS, "bos_token": BOS, "add_bos_token": False}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    save_file(random_weights(vocab), str(d / "model.safetensors"))
    return d


@pytest.fixture(scope="module", params=["nemo", "devstral"])
def mistral_like(request, tmp_path_factory):
    from tests.test_real_templates import serving

    d = mistral_dir(tmp_path_factory.mktemp("mistral_" + request.param), TEMPLATES[request.param])
    for base, engine in serving(d):
        yield base, engine, request.param


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_a_mistral_like_model_calls_with_its_own_token_whole_and_streamed(mistral_like, mode):
    """A model with Mistral's tokens and template (pushed to `[TOOL_CALLS]` by a bias under `auto`)
    gets its call back as a tool call, with a 9-character id, the same whole and streamed, finishing
    `tool_calls`, and the call replays through its template. Seen red with the control token left
    out of the text (no call: finish_reason `stop`, empty content), and with the Hermes parser kept."""
    import httpx

    base, engine, name = mistral_like
    mark = engine.tokenizer.tok.token_to_id("[TOOL_CALLS]")
    body = {
        "messages": [ASK],
        "tools": [TIME],
        "tool_choice": mode,
        "parallel_tool_calls": False,
        "max_tokens": 100,
        "temperature": 0,
        "logit_bias": {str(mark): 100},
        "return_token_ids": True,
    }
    choice = httpx.post(base + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    (got,) = choice["message"]["tool_calls"]
    assert (got["function"]["name"], got["function"]["arguments"]) == ("get_time", "{}")
    assert len(got["id"]) == 9 and got["id"].isalnum() and choice["token_ids"][0] == mark
    chunks = []
    with httpx.stream("POST", base + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    calls = [d["delta"]["tool_calls"][0] for d in deltas if d["delta"].get("tool_calls")]
    assert calls[0]["function"]["name"] == "get_time" and len(calls[0]["id"]) == 9
    assert "".join(c["function"].get("arguments", "") for c in calls) == "{}"
    assert not any(d["delta"].get("content") for d in deltas) and deltas[-1]["finish_reason"] == "tool_calls"
    again = {"messages": [ASK, {"role": "assistant", "content": None, "tool_calls": [got]}], "max_tokens": 1}
    again["messages"].append({"role": "tool", "tool_call_id": got["id"], "content": "noon"})
    r = httpx.post(base + "/v1/chat/completions", json={**again, "tools": [TIME]}, timeout=60)
    assert r.status_code == 200, r.text


JSON_FORMAT = {"type": "json_object"}


@pytest.mark.parametrize("name", ["nemo", "devstral"])
def test_beside_an_answer_format_the_mark_counts_only_at_the_start(name):
    """Review finding (MEDIUM): with a response_format the grammar is `answer | calls`, and a JSON
    answer may hold "[TOOL_CALLS]" as characters in a string: the parser cut the answer there
    (content `{"text": "use`) and the stop strings stopped applying. Now the mark counts only where
    the output starts, for the parser and the stop regions, and calls there still parse. Seen red with
    `lead` left true in `parser_for` and with `MISTRAL_REGION` for a formatted plan."""
    tok, f = features(TEMPLATES[name], tool_choice="auto", response_format=JSON_FORMAT)
    answer = '{"text": "use [TOOL_CALLS] tag"}'
    chars = build_tokenizer().encode(answer, add_special_tokens=False).ids  # the mark as characters
    m = f.grammar.matcher()
    assert f.tools.formatted and m.consume_tokens(chars) and m.is_accepting()
    p = MT.parser_for(f.tools)
    _read(p, answer, 4, cut=False)
    assert "".join(p.content) == answer and not p.calls
    m = StopMatcher(set(), ["tag"], T.stop_regions(f.tools))
    assert m.push(answer, final=True) == ('{"text": "use [TOOL_CALLS] ', True)
    call = replayed(TEMPLATES[name], [("get_time", {})])[1]
    assert takes(tok, f.grammar, call)
    p = MT.parser_for(f.tools)
    _read(p, call, 3, cut=False)
    assert [(c.name, c.arguments, c.done) for c in p.calls] == [("get_time", "{}", True)] and not p.content
    m = StopMatcher(set(), ["time"], T.stop_regions(f.tools))
    assert m.push(call, final=True) == (call, False)


def test_a_name_that_could_read_as_markup_is_refused_for_a_mistral_model():
    """Review finding (LOW): `a[ARGS]b` was taken by the grammar and read back as `a` with arguments
    `b[ARGS]`. Seen red with `check_names` not called (no error)."""
    from kvgate.server.errors import APIError

    odd = {"type": "function", "function": {"name": "a[ARGS]b"}}
    with pytest.raises(APIError) as err:
        features(DEVSTRAL_LIKE, tools=[odd], tool_choice="required")
    assert err.value.param == "tools.0.function.name" and "'['" in err.value.message
    features(CHATML := "{{ tools }}{{ messages }}", tools=[odd], tool_choice="required")  # Hermes: fine
    assert CHATML
