"""vLLM's request fields that clients built for vLLM send (kvgate.server.chat_template, and
`skip_special_tokens`), on the tiny model, whose template is ChatML:
`<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, then `<|im_start|>assistant\\n` when
`add_generation_prompt` is set. Session 30's QA found all four refused as unknown fields; each test
says how it was seen red."""

from __future__ import annotations

import httpx

CHAT = "/v1/chat/completions"
TURNS = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": '{"name":'}]


def prompt_text(base: str, body: dict) -> str:
    r = httpx.post(base + "/v1/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return httpx.post(base + "/v1/detokenize", json={"tokens": r.json()["tokens"]}, timeout=30).json()[
        "prompt"
    ]


def error(base: str, path: str, body: dict) -> tuple[int, str | None]:
    r = httpx.post(base + path, json=body, timeout=30)
    return r.status_code, r.json()["error"].get("param") if r.status_code != 200 else None


def test_continue_final_message_leaves_the_assistant_turn_open(tiny_base):
    """The prompt ends right after the final message's content (no `<|im_end|>`, no new header), and
    the chat's usage counts that very prompt. Red with the cut taken out of `chat_ids` (the turn was
    closed) and with `continue_final` not passed on (a 200 with a closed turn)."""
    opened = prompt_text(tiny_base, {"messages": TURNS, "continue_final_message": True})
    assert opened.endswith('<|im_start|>assistant\n{"name":'), opened
    plain = prompt_text(tiny_base, {"messages": TURNS})
    assert plain.endswith('{"name":<|im_end|>\n<|im_start|>assistant\n'), plain
    assert prompt_text(tiny_base, {"messages": TURNS, "add_generation_prompt": False}).endswith(
        "<|im_end|>\n"
    )
    body = {"messages": TURNS, "continue_final_message": True, "max_tokens": 1}
    chat = httpx.post(tiny_base + CHAT, json=body, timeout=30).json()
    count = httpx.post(
        tiny_base + "/v1/tokenize", json={"messages": TURNS, "continue_final_message": True}
    ).json()
    assert chat["usage"]["prompt_tokens"] == count["count"]


def test_the_template_fields_refuse_what_cannot_be_honoured(tiny_base):
    """Both continue and a generation prompt; continuing a user turn; a template variable that is the
    request's own field: each a 400 naming the field. Red with the checks taken out of
    `template_options` (a 200)."""
    both = {"messages": TURNS, "continue_final_message": True, "add_generation_prompt": True, "max_tokens": 1}
    assert error(tiny_base, CHAT, both) == (400, "add_generation_prompt")
    user_last = {"messages": TURNS[:1], "continue_final_message": True, "max_tokens": 1}
    assert error(tiny_base, CHAT, user_last) == (400, "continue_final_message")
    clash = {"messages": TURNS[:1], "chat_template_kwargs": {"messages": []}, "max_tokens": 1}
    assert error(tiny_base, CHAT, clash) == (400, "chat_template_kwargs.messages")


def test_chat_template_kwargs_reach_the_template(tiny_base, tiny_dir):
    """A variable the template does not read changes nothing (vLLM's `enable_thinking` on a template
    without thinking), over HTTP; one it reads is rendered (the tokenizer's template swapped for one
    that reads it). Red with the field dropped from the model (a 400 unknown field) and with
    `variables` not passed to the template (the swapped one rendered an empty greeting)."""
    from kvgate.models import load_model
    from kvgate.tokenizer import TextTokenizer

    base = prompt_text(tiny_base, {"messages": TURNS[:1]})
    kw = prompt_text(tiny_base, {"messages": TURNS[:1], "chat_template_kwargs": {"enable_thinking": False}})
    assert kw == base
    r = httpx.post(
        tiny_base + CHAT,
        json={"messages": TURNS[:1], "chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 2},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    tok = TextTokenizer(load_model(str(tiny_dir)).tokenizer)
    tok._template = tok._template.environment.from_string("{{ greeting }} {{ messages[0]['content'] }}")
    assert tok.render_chat(TURNS[:1], variables={"greeting": "hey"}) == "hey Hi"


def test_skip_special_tokens_false_keeps_the_special_tokens_in_the_text(tiny_base):
    """The model is made to write `<|im_start|>` (a logit bias of 100): by default the text leaves it
    out, as vLLM's; with `skip_special_tokens: false` it is there, once per token, streamed and whole.
    Red with the flag not passed to the row's detokenizer (the text empty)."""
    tid = httpx.post(
        tiny_base + "/v1/tokenize", json={"prompt": "<|im_start|>", "add_special_tokens": False}
    ).json()
    (special,) = tid["tokens"]
    body = {"messages": TURNS[:1], "max_tokens": 3, "logit_bias": {str(special): 100}, "ignore_eos": True}
    skipped = httpx.post(tiny_base + CHAT, json=body, timeout=30).json()["choices"][0]["message"]["content"]
    kept = httpx.post(tiny_base + CHAT, json={**body, "skip_special_tokens": False}, timeout=30).json()
    assert skipped == "" and kept["choices"][0]["message"]["content"] == "<|im_start|>" * 3
    with httpx.stream(
        "POST", tiny_base + CHAT, json={**body, "skip_special_tokens": False, "stream": True}
    ) as r:
        import json

        deltas = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    assert (
        "".join(d["choices"][0]["delta"].get("content") or "" for d in deltas if d["choices"])
        == "<|im_start|>" * 3
    )
