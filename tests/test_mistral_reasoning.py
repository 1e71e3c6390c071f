"""Mistral's reasoning: `[THINK] ... [/THINK]` as control tokens (Magistral, Ministral 3 Reasoning).

The model is tests/tiny_model.py's with Mistral's control tokens added as special tokens and a template
in the style of Ministral 3 Reasoning's (its default system prompt shows the think block; the real one
was checked too, session 49's notes). `scripted` (tests/test_reasoning.py) makes the sampler follow a
script of token ids. Each test says what was broken on purpose to see it red.
"""

from __future__ import annotations

import json

import httpx
import pytest
from safetensors.torch import save_file
from tokenizers import AddedToken

from kvgate.models.hf_loader import TokenizerInfo
from kvgate.server import reasoning as R
from kvgate.tokenizer import TextTokenizer
from tests.server_util import running_server
from tests.test_reasoning import Script, scripted, spell, start_engine  # noqa: F401 (a fixture)
from tests.tiny_model import build_tokenizer, config_dict, random_weights

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "What is the capital of France?"}]
CONTROL = [
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
]
CONTROL += ["[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[ARGS]", "[THINK]", "[/THINK]"]
MINISTRAL_LIKE = (
    "[SYSTEM_PROMPT]Think first, this way:[THINK]scratch work[/THINK]then answer.[/SYSTEM_PROMPT]"
    "{% for m in messages %}{% if m.role == 'user' %}"
    "{% if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST]{{ m.content }}[/INST]{% elif m.tool_calls %}{% for c in m.tool_calls %}[TOOL_CALLS]"
    "{{ c.function.name }}[ARGS]{{ c.function.arguments | tojson }}{% endfor %}<|im_end|>"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{% else %}{{ m.content }}<|im_end|>{% endif %}{% endfor %}"
)


def mistral_vocab():
    tok = build_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL])
    return tok


def test_auto_picks_mistral_where_the_template_and_the_vocabulary_have_the_tokens():
    """Seen red with the Mistral check left out of `resolve` (None: no reasoning split at all)."""
    tok = mistral_vocab()
    info = TokenizerInfo(tok.to_str(), MINISTRAL_LIKE, None, 2, [2], False)
    assert R.resolve("auto", TextTokenizer(info)) == "mistral"
    plain = build_tokenizer()  # the template alone: its [THINK] is text the model never writes as tokens
    assert (
        R.resolve("auto", TextTokenizer(TokenizerInfo(plain.to_str(), MINISTRAL_LIKE, None, 2, [2], False)))
        is None
    )
    assert R.tags_of("mistral") == ("[THINK]", "[/THINK]") and R.tags_of("qwen3") == (R.OPEN, R.CLOSE)


@pytest.mark.parametrize("step", [1, 2, 5, 100])
def test_the_splitter_reads_mistrals_tags_in_any_pieces(step):
    """Seen red with the splitter's tags fixed to `<think>` (all of it content)."""
    text = "[THINK]Hmm, France. [/THINK]\n\nParis."
    r = R.Reasoning("mistral")
    s = r.splitter()
    out = [p for i in range(0, len(text), step) for p in s.push(text[i : i + step])] + s.end()
    assert "".join(t for k, t in out if k == "reasoning") == "Hmm, France."
    assert "".join(t for k, t in out if k == "content") == "Paris."
    assert r.split("Paris.") == (None, "Paris.")  # no block opened: content, as vLLM's Mistral parser


@pytest.fixture(scope="module")
def ministral(tmp_path_factory, scripted):  # noqa: F811
    d = tmp_path_factory.mktemp("ministral")
    tok = mistral_vocab()
    tok.save(str(d / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    (d / "config.json").write_text(json.dumps(config_dict(vocab, g={"max_pos": 2048})))
    cfg = {"chat_template": MINISTRAL_LIKE, "eos_token": "<|im_end|>", "add_bos_token": False}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    save_file(random_weights(vocab), str(d / "model.safetensors"))
    e = start_engine(d)
    with running_server(e) as (base, _app):
        yield base, e
    e.shutdown()


def tag(engine, text: str) -> int:
    return engine.tokenizer.tok.token_to_id(text)


def test_a_think_block_of_control_tokens_is_split_off_whole_and_streamed(ministral):
    """The tags are control tokens, which the detokenizer leaves out: it writes these two for the
    splitter. Seen red with `Reasoning.kept` empty (the reasoning came back inside the content, the
    tags dropped: "Hmm, France.Paris.")."""
    base, e = ministral
    Script.ids = spell(tag(e, "[THINK]"), "Hmm, France.", tag(e, "[/THINK]"), "Paris.")
    body = {"messages": MSG, "max_tokens": 40, "temperature": 0}
    msg = httpx.post(base + CHAT, json=body, timeout=60).json()["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("Hmm, France.", "Paris.")
    said, content = [], []
    with httpx.stream("POST", base + CHAT, json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    said.append(c["delta"].get("reasoning_content") or "")
                    content.append(c["delta"].get("content") or "")
    assert ("".join(said), "".join(content)) == ("Hmm, France.", "Paris.")


def test_reasoning_then_a_mistral_tool_call(ministral):
    """Reasoning and then Mistral's per-call format under `required`: the grammar lets the think block
    (its tags as their tokens) come first and holds what follows to the call. Seen red with the tags'
    ids looked up as `<think>`'s in `reasoning.plan` (the grammar refused the `[THINK]` token: a call
    with no reasoning). Not red with only the tags' text in `wrap_grammar` fixed to `<think>`: a model
    writes control tokens as their tokens, which the grammar takes by id either way."""
    base, e = ministral
    Script.ids = spell(
        tag(e, "[THINK]"), "Need the time.", tag(e, "[/THINK]"), tag(e, "[TOOL_CALLS]"), "get_time"
    )
    Script.ids += spell(tag(e, "[ARGS]"), "{}")
    body = {
        "messages": MSG,
        "max_tokens": 60,
        "temperature": 0,
        "tools": [{"type": "function", "function": {"name": "get_time"}}],
        "tool_choice": "required",
    }
    choice = httpx.post(base + CHAT, json=body, timeout=60).json()["choices"][0]
    assert choice["message"]["reasoning_content"] == "Need the time.", choice
    (call,) = choice["message"]["tool_calls"]
    assert (call["function"]["name"], call["function"]["arguments"]) == ("get_time", "{}")
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
