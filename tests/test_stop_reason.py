"""vLLM's `stop_reason` on chat and text completion choices: the stop string that ended the choice, or
the id of the request's `stop_token_ids` token that did; null when it ended otherwise (the model's own
end, max_tokens). Streams carry it on each choice's finish chunk. Anthropic's `stop_sequence`
(/v1/messages) is read from it.

Red: with `stop_reason` left out of the bodies (KeyError), and with the string stop named "string"."""

from __future__ import annotations

import json

import httpx

CHAT = "/v1/chat/completions"
BASE = {
    "messages": [{"role": "user", "content": "Hi"}],
    "temperature": 0,
    "max_tokens": 12,
    "ignore_eos": True,
}


def streamed_finish(base: str, path: str, body: dict) -> dict:
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return next(c["choices"][0] for c in chunks if c["choices"] and c["choices"][0].get("finish_reason"))


def test_stop_reason_names_the_stop_string_or_token_that_ended_a_choice(tiny_base):
    free = httpx.post(tiny_base + CHAT, json={**BASE, "logprobs": True}, timeout=30).json()["choices"][0]
    assert (free["finish_reason"], free["stop_reason"]) == ("length", None)
    tokens = [t["token"] for t in free["logprobs"]["content"]]
    word = next(t for t in tokens[2:] if t.strip() and t not in "".join(tokens[:2]))  # not in the first two
    by_string = {**BASE, "stop": ["never-in-this-output-\u2603", word]}
    got = httpx.post(tiny_base + CHAT, json=by_string, timeout=30).json()["choices"][0]
    assert (got["finish_reason"], got["stop_reason"]) == ("stop", word), got
    assert streamed_finish(tiny_base, CHAT, by_string)["stop_reason"] == word
    first_id = httpx.post(
        tiny_base + "/v1/tokenize", json={"prompt": tokens[0], "add_special_tokens": False}
    ).json()["tokens"][0]
    by_token = {**BASE, "ignore_eos": False, "stop_token_ids": [first_id]}
    got = httpx.post(tiny_base + CHAT, json=by_token, timeout=30).json()["choices"][0]
    assert (got["finish_reason"], got["stop_reason"]) == ("stop", first_id), got
    assert streamed_finish(tiny_base, CHAT, by_token)["stop_reason"] == first_id
    text = {"prompt": "Hello", "temperature": 0, "max_tokens": 12, "ignore_eos": True}
    plain = httpx.post(tiny_base + "/v1/completions", json=text, timeout=30).json()["choices"][0]
    word = next(w for w in plain["text"][3:].split() if w and w not in plain["text"][:3])
    got = httpx.post(tiny_base + "/v1/completions", json={**text, "stop": [word]}, timeout=30).json()
    assert got["choices"][0]["stop_reason"] == word, got
    assert streamed_finish(tiny_base, "/v1/completions", {**text, "stop": [word]})["stop_reason"] == word


def test_the_models_own_end_is_named_by_no_stop_reason(tiny_base):
    """vLLM checks the model's end token before stop_token_ids: an answer it ended has stop_reason null
    even when the request also listed that token; with ignore_eos the listed token is what stopped it,
    and is named. Red with the end token named (review of session 45)."""
    eos = httpx.get(tiny_base + "/tokenizer_info", timeout=30).json()["eos_token"]
    eos_id = httpx.post(
        tiny_base + "/v1/tokenize", json={"prompt": eos, "add_special_tokens": False}, timeout=30
    ).json()["tokens"][0]
    forced = {**BASE, "logit_bias": {str(eos_id): 100}, "stop_token_ids": [eos_id]}
    for ignore_eos, named in ((False, None), (True, eos_id)):
        got = httpx.post(tiny_base + CHAT, json={**forced, "ignore_eos": ignore_eos}, timeout=30).json()
        choice = got["choices"][0]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", named), got
        assert streamed_finish(tiny_base, CHAT, {**forced, "ignore_eos": ignore_eos})["stop_reason"] == named
