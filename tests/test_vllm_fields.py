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


def test_min_tokens_holds_off_stop_tokens_and_strings(tiny_base):
    """vLLM's `min_tokens`, which benchmark clients send to force an output length (evalscope's perf
    stopped at its connection test: QA pass 14): no stop token is drawn and no stop string counts before
    that many tokens are out; past them both apply again. The greedy answer's own first token, made a
    stop token, ends a plain request at once and cannot end one with min_tokens 5 before its 5th token;
    the answer's first text, made a stop string, likewise. Red with `suppress` not called (stopped at
    0 tokens) and with the stop strings matched from the first token."""
    base = {
        "messages": [{"role": "user", "content": "Hi"}],
        "temperature": 0,
        "max_tokens": 8,
        "ignore_eos": True,
    }
    free = httpx.post(tiny_base + CHAT, json={**base, "logprobs": True}, timeout=30).json()["choices"][0]
    first = free["logprobs"]["content"][0]
    first_id = httpx.post(
        tiny_base + "/v1/tokenize", json={"prompt": first["token"], "add_special_tokens": False}
    ).json()["tokens"][0]
    plain = {**base, "ignore_eos": False, "stop_token_ids": [first_id]}
    done = httpx.post(tiny_base + CHAT, json=plain, timeout=30).json()
    assert done["usage"]["completion_tokens"] == 1 and done["choices"][0]["finish_reason"] == "stop"
    held = httpx.post(tiny_base + CHAT, json={**plain, "min_tokens": 5, "logprobs": True}, timeout=30).json()
    ids = [t["token"] for t in held["choices"][0]["logprobs"]["content"]]
    assert held["usage"]["completion_tokens"] >= 5, held
    assert first["token"] not in ids[:5]  # the stop token was not drawn before the 5th
    stop_text = first["token"]
    by_string = httpx.post(
        tiny_base + CHAT, json={**base, "stop": [stop_text], "min_tokens": 3}, timeout=30
    ).json()
    assert by_string["usage"]["completion_tokens"] >= 3, by_string
    assert (
        httpx.post(tiny_base + CHAT, json={**base, "stop": [stop_text]}, timeout=30).json()["usage"][
            "completion_tokens"
        ]
        == 1
    )


def test_min_tokens_refusals(tiny_base):
    """More than max_tokens, negative, or with a grammar (one that allows only its end could go nowhere):
    a 400 naming min_tokens. Red with the checks removed (200s)."""
    msg = [{"role": "user", "content": "Hi"}]
    assert error(tiny_base, CHAT, {"messages": msg, "max_tokens": 4, "min_tokens": 5}) == (400, "min_tokens")
    assert error(tiny_base, CHAT, {"messages": msg, "min_tokens": -1}) == (400, "min_tokens")
    fmt = {"type": "json_object"}
    assert error(tiny_base, CHAT, {"messages": msg, "min_tokens": 2, "response_format": fmt}) == (
        400,
        "min_tokens",
    )
    assert error(tiny_base, "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "min_tokens": 4}) == (
        200,
        None,
    )


def test_min_tokens_past_what_can_be_generated_and_with_echos_prompt_alone(tiny_base):
    """QA pass 15: with max_tokens unset, min_tokens past what the prompt leaves in the context was a 200
    silently short (vLLM: a 400); with echo and max_tokens 0 (no generated tokens) it was accepted, or
    told "max_tokens=1", a value the client never sent; on /v1/responses the 400 named max_tokens, not
    max_output_tokens. Red with `check_min_tokens` not called, the echo check removed, and the
    Responses rename removed."""
    msg = [{"role": "user", "content": "Hi"}]
    r = httpx.post(tiny_base + CHAT, json={"messages": msg, "min_tokens": 100_000}, timeout=30)
    err = r.json()["error"]
    assert (r.status_code, err["param"]) == (400, "min_tokens") and "context" in err["message"], err
    # with its numbers, as every context 400 (session 45: this one had none; red without them)
    assert err["positions"] > 100_000 > err["positions_limit"] and err["estimated_bytes"] > err["limit_bytes"]
    body = {"prompt": "Hi there", "echo": True, "logprobs": 1, "max_tokens": 0, "min_tokens": 1}
    assert error(tiny_base, "/v1/completions", body) == (400, "min_tokens")
    r = httpx.post(
        tiny_base + "/v1/responses", json={"input": "Hi", "max_output_tokens": 3, "min_tokens": 5}, timeout=30
    )
    err = r.json()["error"]
    assert (
        r.status_code == 400
        and "max_output_tokens=3" in err["message"]
        and "max_tokens" not in err["message"].replace("max_output_tokens", "")
    )
