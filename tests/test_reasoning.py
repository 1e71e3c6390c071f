"""Reasoning output of thinking models (`--reasoning-parser`, kvgate/server/reasoning.py).

Unit tests read the splitter alone; the end-to-end tests run a live server on a tiny random model
whose tokenizer has `<think>` and `</think>` as added tokens (built here: tests/tiny_model.py's model,
two tokens more) and whose template opens the think block as the R1 distills' does. A random model
writes no reasoning, so `scripted` makes the sampler follow a script: each step the script's next token
gets +1000 on its logit before the real sampler (and any grammar mask) runs, so a grammar that forbids
a scripted token still wins, and a test shows it.

Each test says in its docstring what was broken on purpose to see it red (then restored).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import httpx
import openai
import pytest
from safetensors.torch import save_file
from tokenizers import AddedToken

from kvgate.cli import build_parser
from kvgate.server import reasoning as R
from tests.server_util import running_server
from tests.tiny_model import build_tokenizer, config_dict, random_weights

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "What is the capital of France?"}]
# the R1 distills' shape: earlier answers lose their reasoning, and the answer starts inside <think>
R1_TEMPLATE = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'].split('</think>')[-1] + "
    "'<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n<think>\n'}}{% endif %}"
)
# Qwen3's shape: the model opens <think> itself; enable_thinking=false closes an empty block in the prompt
QWEN3_TEMPLATE = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% if enable_thinking is defined and "
    "enable_thinking is false %}{{'<think>\n\n</think>\n\n'}}{% endif %}{% endif %}"
)
EOS = 2  # <|im_end|>


def make_thinking_dir(path: Path, template: str, tags: bool = True) -> Path:
    """tests/tiny_model.py's model with `<think>` and `</think>` added to its vocabulary (not special,
    as in R1's and Qwen3's tokenizers) and `template` as its chat template."""
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    if tags:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (R.OPEN, R.CLOSE)])
    vocab = tok.get_vocab_size()
    tok.save(str(path / "tokenizer.json"))
    (path / "config.json").write_text(json.dumps(config_dict(vocab, g={"max_pos": 2048})))  # room for tools
    cfg = {
        "chat_template": template,
        "eos_token": "<|im_end|>",
        "bos_token": "<|im_start|>",
        "add_bos_token": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    save_file(random_weights(vocab), str(path / "model.safetensors"))
    return path


def start_engine(path: Path):
    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine

    cfg = EngineConfig(kv_cache_bytes=16 << 20, memory_limit="2GiB", dtype="float32", device="cpu")
    return Engine.from_model(str(path), cfg, overhead_bytes=0).start()


SPELL = build_tokenizer()  # the byte-level ids, the same in the thinking vocabulary (its two tags come after)


def spell(*parts) -> list[int]:
    """Token ids: a string in byte-level tokens (a tag in it split over several), an int as itself."""
    return [i for p in parts for i in ([p] if isinstance(p, int) else SPELL.encode(p).ids)]


class Script:
    ids: list[int] = []


@pytest.fixture(scope="module")
def scripted():
    """The sampler follows `Script.ids` (then the end token), through the real sampler and masks."""
    from kvgate.core import runner

    real = runner.sample_batch

    def sample_batch(samplers, logits, rows=None):
        rows = list(range(len(samplers))) if rows is None else rows
        logits = logits.clone()
        for s, r in zip(samplers, rows, strict=True):
            logits[r, Script.ids[s.generated] if s.generated < len(Script.ids) else EOS] += 1000.0
        return real(samplers, logits, rows)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "sample_batch", sample_batch)
        yield Script


@pytest.fixture(scope="module")
def r1(tmp_path_factory, scripted):
    """A server (default settings: `--reasoning-parser auto`) on a model with R1's template."""
    e = start_engine(make_thinking_dir(tmp_path_factory.mktemp("r1"), R1_TEMPLATE))
    with running_server(e) as (base, app):
        yield base, e
    e.shutdown()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, scripted):
    e = start_engine(make_thinking_dir(tmp_path_factory.mktemp("qwen3"), QWEN3_TEMPLATE))
    with running_server(e) as (base, app):
        yield base, e
    e.shutdown()


def ids_of(engine, tag: str) -> int:
    return engine.tokenizer.tok.token_to_id(tag)


# ---- the splitter alone -------------------------------------------------------------------------


def streamed(r: R.Reasoning, pieces: list[str]) -> tuple[str | None, str]:
    s = r.splitter()
    out = [p for piece in pieces for p in s.push(piece)] + s.end()
    reasoning = "".join(t for k, t in out if k == "reasoning")
    return reasoning or None, "".join(t for k, t in out if k == "content")


CASES = [  # (parser, state, output) -> (reasoning, content)
    ("deepseek_r1", "reasoning", "Let me see.\n</think>\n\nParis.", ("Let me see.", "Paris.")),
    ("qwen3", "reasoning", "Let me see.</think>Paris.", ("Let me see.", "Paris.")),
    (
        "qwen3",
        "start",
        " <think>\nHmm </thin k.\n</think>\n\nParis. <think>x",
        ("Hmm </thin k.", "Paris. <think>x"),
    ),
    ("deepseek_r1", "start", "No opening here</think>Paris.", ("No opening here", "Paris.")),
    ("qwen3", "start", "No opening here</think>Paris.", (None, "No opening here</think>Paris.")),
    ("deepseek_r1", "start", "Cut before the end", ("Cut before the end", "")),
    ("qwen3", "start", "An answer with no tags", (None, "An answer with no tags")),
    ("qwen3", "reasoning", "Cut while thinking <", ("Cut while thinking <", "")),
    ("qwen3", "reasoning", "<think>\nopened twice</think>\n", ("opened twice", "")),
    ("deepseek_r1", "content", "<think>a</think>b", (None, "<think>a</think>b")),
    ("qwen3", "start", "<thi", (None, "<thi")),
]


@pytest.mark.parametrize("parser,state,text,want", CASES)
def test_a_tag_split_anywhere_is_found_and_never_sent(parser, state, text, want):
    """Every way of cutting the output in three pieces gives the whole output's split, and neither field
    holds a delimiting tag. Seen red with the splitter holding nothing back (`_partial` -> 0): a
    `</think>` cut after `</thi` went out as reasoning text."""
    r = R.Reasoning(parser, state=state)
    assert r.split(text) == want
    for a, b in itertools.combinations(range(len(text) + 1), 2):
        assert streamed(r, [text[:a], text[a:b], text[b:]]) == want, (a, b)


def test_missing_opening_and_closing_tags_follow_each_parser():
    """vLLM's rules, with the prompt read first: R1 may leave `<think>` out (all before `</think>` is
    reasoning, and output with no `</think>` all reasoning); Qwen3 marks its reasoning (unmarked
    output is the answer); a prompt that opened the block makes both read reasoning first. Under a
    grammar unmarked output is the answer for both. Seen red with `missing` always "content"."""
    assert R.Reasoning("deepseek_r1").split("thinking</think>answer") == ("thinking", "answer")
    assert R.Reasoning("deepseek_r1").split("never closed") == ("never closed", "")
    assert R.Reasoning("qwen3").split("never opened") == (None, "never opened")
    assert R.Reasoning("qwen3", state="reasoning").split("never closed") == ("never closed", "")
    assert R.Reasoning("deepseek_r1", grammar=True).split('{"a": 1}') == (None, '{"a": 1}')


def test_reasoning_tokens_count_to_the_closing_tag():
    """usage's reasoning_tokens: the tokens pushed while the block was open, the one that completes
    `</think>` included, an opening split over tokens counted whole. Seen red counting only the tokens
    that sent reasoning text (2 here, not 6)."""
    s = R.Reasoning("qwen3").splitter()
    for t in ["<th", "ink>", "Hm", "m.", "</", "think>", "\n\nPar", "is"]:
        s.push_token(t)
    assert s.tokens == 6


def test_auto_finds_the_tags_in_the_template_or_the_vocabulary(tmp_path):
    """`auto`: deepseek_r1 for an R1 template, qwen3 for a template that reads enable_thinking or a
    vocabulary alone, off for tests/tiny_model.py's model. Seen red with the vocabulary not read."""
    from kvgate.models.hf_loader import TokenizerInfo
    from kvgate.tokenizer import TextTokenizer

    def tok(template, tags):
        d = make_thinking_dir(tmp_path / f"t{tags}{len(template)}", template, tags)
        spec = json.loads((d / "tokenizer_config.json").read_text())
        info = TokenizerInfo((d / "tokenizer.json").read_text(), spec["chat_template"], None, 2, [2], False)
        return TextTokenizer(info)

    plain = "{% for m in messages %}{{m['content']}}{% endfor %}"
    assert R.resolve("auto", tok(R1_TEMPLATE, True)) == "deepseek_r1"
    assert R.resolve("auto", tok(QWEN3_TEMPLATE, False)) == "qwen3"
    assert R.resolve("auto", tok(plain, True)) == "qwen3"
    assert R.resolve("auto", tok(plain, False)) is None
    assert R.resolve("none", tok(R1_TEMPLATE, True)) is None
    t = tok(QWEN3_TEMPLATE, True)
    prompt = t.chat_ids(MSG)
    off = t.chat_ids(MSG, variables={"enable_thinking": False})
    assert R.start_state(t, prompt, "qwen3") == "start"
    assert R.start_state(t, off, "qwen3") == "content"
    assert R.start_state(t, tok(R1_TEMPLATE, True).chat_ids(MSG), "deepseek_r1") == "reasoning"


def test_the_flag_takes_the_parsers_and_refuses_others(monkeypatch):
    """`--reasoning-parser` on serve and cluster, default auto or KVGATE_REASONING_PARSER. Seen red
    with the flag left off `kvgate cluster`."""
    assert build_parser().parse_args(["serve"]).reasoning_parser == "auto"
    args = build_parser().parse_args(["cluster", "--reasoning-parser", "deepseek_r1"])
    assert args.reasoning_parser == "deepseek_r1"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "r1"])
    monkeypatch.setenv("KVGATE_REASONING_PARSER", "none")
    assert build_parser().parse_args(["serve"]).reasoning_parser == "none"


# ---- through a live server ----------------------------------------------------------------------

THOUGHT = "Let me think. It is <b>Paris</b>."


def test_openai_client_whole_and_streamed(r1):
    """The official client, whole and streamed: the reasoning in `reasoning_content` and `reasoning`,
    the answer in `content`, the tag (spelled over 4 tokens here) in neither, and usage's
    reasoning_tokens. Seen red with `take` not called (the whole answer's content held the
    reasoning and the tag) and with the stream shaper's splitter bypassed (no reasoning deltas)."""
    base, _ = r1
    Script.ids = spell(THOUGHT + "\n</think>\n\nParis.")
    thinking = len(spell(THOUGHT + "\n</think>"))
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    out = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=60, temperature=0)
    msg = out.choices[0].message
    assert (msg.content, msg.reasoning_content, msg.reasoning) == ("Paris.", THOUGHT, THOUGHT)
    assert out.usage.completion_tokens_details.reasoning_tokens == thinking
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=MSG,
            max_tokens=60,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    said = [d.model_extra.get("reasoning_content") or "" for d in deltas]
    assert "".join(said) == THOUGHT and "".join(d.content or "" for d in deltas) == "Paris."
    assert [d.model_extra.get("reasoning") or "" for d in deltas] == said
    assert not any("think>" in (d.content or "") + s for d, s in zip(deltas, said, strict=True))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == thinking


def test_tag_tokens_include_reasoning_and_a_cut(r1):
    """`</think>` as its own token, `include_reasoning: false` (vLLM's: the block is still split off,
    and dropped), and max_tokens spent thinking (all reasoning, content "", finish length). Seen red
    with `include` ignored in `Reasoning.put`."""
    base, e = r1
    Script.ids = spell("Short.", ids_of(e, R.CLOSE), "Paris.")
    body = {"messages": MSG, "max_tokens": 30, "temperature": 0}
    whole = httpx.post(base + CHAT, json=body).json()["choices"][0]["message"]
    assert (whole["reasoning_content"], whole["content"]) == ("Short.", "Paris.")
    quiet = httpx.post(base + CHAT, json={**body, "include_reasoning": False}).json()["choices"][0]
    assert quiet["message"] == {"role": "assistant", "content": "Paris."}
    Script.ids = spell(THOUGHT)
    cut = httpx.post(base + CHAT, json={**body, "max_tokens": 5}).json()
    assert cut["choices"][0]["finish_reason"] == "length"
    msg = cut["choices"][0]["message"]
    assert msg["content"] == "" and THOUGHT.startswith(msg["reasoning_content"])
    assert cut["usage"]["completion_tokens_details"]["reasoning_tokens"] == 5


def test_parser_none_leaves_the_text_as_written(tmp_path, scripted):
    """`--reasoning-parser none`: the text as the model wrote it, and no reasoning fields or counts.
    Seen red with `none` resolved like auto."""
    e = start_engine(make_thinking_dir(tmp_path / "none", R1_TEMPLATE))
    try:
        with running_server(e, reasoning_parser="none") as (base, _):
            Script.ids = spell("Short.</think>Paris.")
            out = httpx.post(base + CHAT, json={"messages": MSG, "max_tokens": 30}).json()
    finally:
        e.shutdown()
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "Short.</think>Paris."}
    assert "completion_tokens_details" not in out["usage"]


TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_time"}}]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_are_read_from_the_answer_after_the_reasoning(r1, stream):
    """tool_choice required: the grammar leaves the reasoning free and holds the text after `</think>`
    to a call; the call is parsed from the content alone. Seen red with `wrap_grammar` returning the
    grammar unwrapped (the call was forced from the first token, inside the open think block, so it
    was read as reasoning: finish_reason stop, no call), whole with the tool parser run before the
    split (content "" where a call turn's is null), and streamed with the splitter skipped when the
    request has tools."""
    base, e = r1
    Script.ids = spell("I need the time.", ids_of(e, R.CLOSE), "\n\n" + TIME_CALL)
    body = {"messages": MSG, "max_tokens": 120, "tools": TOOLS, "tool_choice": "required", "stream": stream}
    if not stream:
        choice = httpx.post(base + CHAT, json=body).json()["choices"][0]
        msg = choice["message"]
        assert choice["finish_reason"] == "tool_calls"
        assert (msg["reasoning_content"], msg["content"]) == ("I need the time.", None)
        assert [c["function"] for c in msg["tool_calls"]] == [{"name": "get_time", "arguments": "{}"}]
        return
    deltas = [c["choices"][0] for c in sse(base, body) if c.get("choices")]
    assert "".join(d["delta"].get("reasoning_content") or "" for d in deltas) == "I need the time."
    calls = [t for d in deltas for t in d["delta"].get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_time" and not any(d["delta"].get("content") for d in deltas)
    assert deltas[-1]["finish_reason"] == "tool_calls"


def test_structured_output_holds_only_the_answer(r1):
    """response_format json_schema behind the think block: the reasoning is free, the answer is the
    schema's (a scripted token the schema forbids loses to one it allows). Seen red with the grammar
    unwrapped: the JSON was forced from the first token, inside the open think block, and came back
    as reasoning with content "" (JSONDecodeError)."""
    base, e = r1
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    Script.ids = spell("Plan: a is 7.\n</think>\n", '{"a": 7}')
    body = {"messages": MSG, "max_tokens": 60, "response_format": fmt}
    msg = httpx.post(base + CHAT, json=body).json()["choices"][0]["message"]
    assert (msg["reasoning_content"], json.loads(msg["content"])) == ("Plan: a is 7.", {"a": 7})
    Script.ids = spell("Plan.", ids_of(e, R.CLOSE), 'not json {"a": 7}')  # the schema wins over the script
    msg = httpx.post(base + CHAT, json=body).json()["choices"][0]["message"]
    assert msg["reasoning_content"] == "Plan." and isinstance(json.loads(msg["content"])["a"], int)


def test_qwen3_template_and_enable_thinking(qwen3):
    """A template where the model opens `<think>` itself: opened, it is split; not opened, the text is
    the answer; `enable_thinking: false` closes the block in the prompt, and a `<think>` the model writes
    anyway is then answer text. Seen red with `start_state` not reading the prompt (the
    enable_thinking=false answer lost its `<think>` and `</think>`)."""
    base, e = qwen3
    body = {"messages": MSG, "max_tokens": 40}
    Script.ids = spell(ids_of(e, R.OPEN), "\nHmm.\n", ids_of(e, R.CLOSE), "\n\nParis.")
    msg = httpx.post(base + CHAT, json=body).json()["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("Hmm.", "Paris.")
    Script.ids = spell("Paris.")
    msg = httpx.post(base + CHAT, json=body).json()["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == (None, "Paris.")
    Script.ids = spell("<think>a</think>b")
    off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    msg = httpx.post(base + CHAT, json=off).json()["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == (None, "<think>a</think>b")


def test_responses_api_gives_a_reasoning_item(r1):
    """/v1/responses through the openai client: a `reasoning` item (its text a reasoning_text part, no
    summary) before the message, whole and streamed, and it is taken back as input. Seen red with the
    stream's reasoning deltas not read (no reasoning item, as before this session)."""
    base, _ = r1
    Script.ids = spell(THOUGHT + "</think>Paris.")
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    out = client.responses.create(model="tiny", input="Capital of France?", max_output_tokens=60)
    assert [i.type for i in out.output] == ["reasoning", "message"]
    assert out.output[0].content[0].text == THOUGHT and out.output_text == "Paris."
    assert out.usage.output_tokens_details.reasoning_tokens == len(spell(THOUGHT + "</think>"))
    with client.responses.stream(model="tiny", input="Capital of France?", max_output_tokens=60) as s:
        events = list(s)
        final = s.get_final_response()
    said = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert said == THOUGHT and final.output[0].content[0].text == THOUGHT and final.output_text == "Paris."
    again = [*out.output, {"role": "user", "content": "And Spain?"}]
    assert client.responses.create(model="tiny", input=again, max_output_tokens=60).output_text == "Paris."


def test_messages_api_gives_a_thinking_block(r1):
    """/v1/messages through the anthropic client: a `thinking` block before the text, whole and
    streamed, and the block replayed in an assistant turn is accepted. Seen red with the thinking
    block not written (`message_body`)."""
    anthropic = pytest.importorskip("anthropic")
    base, _ = r1
    Script.ids = spell(THOUGHT + "</think>Paris.")
    client = anthropic.Anthropic(base_url=base, api_key="unused")
    out = client.messages.create(model="tiny", max_tokens=60, messages=MSG)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in out.content] == [
        ("thinking", THOUGHT),
        ("text", "Paris."),
    ]
    with client.messages.stream(model="tiny", max_tokens=60, messages=MSG) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == THOUGHT
    turns = [*MSG, {"role": "assistant", "content": [b.model_dump() for b in out.content]}]
    turns.append({"role": "user", "content": "And Spain?"})
    assert client.messages.create(model="tiny", max_tokens=60, messages=turns).content[-1].text == "Paris."


def sse(base: str, body: dict) -> list[dict]:
    with httpx.stream("POST", base + CHAT, json=body, timeout=60) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
