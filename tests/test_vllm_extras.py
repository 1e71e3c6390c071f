"""vLLM's per-request extras (kvgate/server/vllm_extras.py), sent through the openai SDK's `extra_body`
as RL and evaluation clients send them, against a live server on the tiny model:
`return_token_ids`, `return_tokens_as_token_ids`, `include_stop_str_in_output`,
`truncate_prompt_tokens`, `allowed_token_ids`, `bad_words`, `cache_salt`; and their refusals.

Each was seen red with its code broken on purpose (then restored):
- `add_token_ids` not called: KeyError on `token_ids`; the stream's finish chunk given no ids: the
  stop token missing from the streamed ids;
- `token_name` giving the text: the `token_id:` assertions;
- `StopMatcher._end` returning `cut`: the included stop string missing;
- `truncated` keeping the first tokens: prompt ids and usage wrong;
- the allowed mask not applied: ids outside the set drawn;
- `banned` checking the sequence's first token instead of its last: the greedy token kept;
- the salt left out of `prompt_block_hashes`: cached tokens across salts.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from openai import OpenAI

CHAT = [{"role": "user", "content": "Tell me a story about a cat"}]
GREEDY = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def client(tiny_base):
    return OpenAI(base_url=tiny_base + "/v1", api_key="unused", max_retries=0)


def chat_ids(base: str, messages) -> list[int]:
    return httpx.post(base + "/v1/tokenize", json={"messages": messages}).json()["tokens"]


def text_ids(base: str, text: str) -> list[int]:
    return httpx.post(base + "/v1/tokenize", json={"prompt": text}).json()["tokens"]


def stream_chunks(base: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=60) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_return_token_ids_chat_whole_and_streamed(client, tiny_base):
    extra = {"return_token_ids": True, "ignore_eos": True, "skip_special_tokens": False}  # text = all ids
    r = client.chat.completions.create(model="tiny", messages=CHAT, **GREEDY, extra_body=extra)
    prompt = chat_ids(tiny_base, CHAT)
    assert r.model_extra["prompt_token_ids"] == prompt
    ids = r.choices[0].model_extra["token_ids"]
    assert len(ids) == r.usage.completion_tokens == 12
    back = httpx.post(tiny_base + "/v1/detokenize", json={"tokens": ids}).json()["prompt"]
    assert back == r.choices[0].message.content
    chunks = stream_chunks(tiny_base, "/v1/chat/completions", {"messages": CHAT, **GREEDY, **extra})
    assert chunks[0]["prompt_token_ids"] == prompt  # on the choice's first chunk, and only there
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == ids
    plain = client.chat.completions.create(model="tiny", messages=CHAT, **GREEDY)
    assert "token_ids" not in plain.choices[0].model_extra and "prompt_token_ids" not in plain.model_extra


def test_return_token_ids_completions_give_each_choice_its_prompt(client, tiny_base):
    prompts = ["The sky is", "Once upon a time there"]
    r = client.completions.create(
        model="tiny", prompt=prompts, n=2, **GREEDY, extra_body={"return_token_ids": True, "ignore_eos": True}
    )
    assert len(r.choices) == 4
    for c in r.choices:
        assert c.model_extra["prompt_token_ids"] == text_ids(tiny_base, prompts[c.index // 2])
        assert len(c.model_extra["token_ids"]) == 12
    body = {"prompt": prompts[1], **GREEDY, "return_token_ids": True, "ignore_eos": True}
    chunks = stream_chunks(tiny_base, "/v1/completions", body)
    assert chunks[0]["choices"][0]["prompt_token_ids"] == text_ids(tiny_base, prompts[1])
    streamed = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert streamed == r.choices[2].model_extra["token_ids"]


def test_a_stop_token_is_in_the_ids_and_its_text_only_when_asked(client, tiny_base):
    free = client.chat.completions.create(
        model="tiny", messages=CHAT, **GREEDY, extra_body={"return_token_ids": True, "ignore_eos": True}
    )
    ids = free.choices[0].model_extra["token_ids"]
    stop = next(t for t in ids[2:] if t not in ids[:2])  # its first occurrence ends the answer
    cut = ids[: ids.index(stop) + 1]
    body = {
        "return_token_ids": True,
        "ignore_eos": True,
        "stop_token_ids": [stop],
        "skip_special_tokens": False,
    }
    for include in (False, True):
        extra = {**body, "include_stop_str_in_output": include}
        r = client.chat.completions.create(model="tiny", messages=CHAT, **GREEDY, extra_body=extra)
        c = r.choices[0]
        assert (c.finish_reason, c.model_extra["stop_reason"], c.model_extra["token_ids"]) == (
            "stop",
            stop,
            cut,
        )
        shown = cut if include else cut[:-1]
        text = httpx.post(tiny_base + "/v1/detokenize", json={"tokens": shown}).json()["prompt"]
        assert c.message.content == text
        chunks = stream_chunks(tiny_base, "/v1/chat/completions", {"messages": CHAT, **GREEDY, **extra})
        assert [t for ch in chunks for t in ch["choices"][0]["token_ids"]] == cut
        assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks) == text


def test_include_stop_str_in_output_keeps_the_stop_string(client, tiny_base):
    free = client.completions.create(
        model="tiny", prompt="The sky is", **GREEDY, extra_body={"ignore_eos": True}
    )
    text = free.choices[0].text
    word = next(
        text[i : i + 2]
        for i in range(3, len(text) - 1)
        if text[i : i + 2].strip() and "\ufffd" not in text[i : i + 2]
    )
    at = text.index(word)
    for include, want in ((False, text[:at]), (True, text[: at + len(word)])):
        extra = {"ignore_eos": True, "include_stop_str_in_output": include}
        r = client.completions.create(
            model="tiny", prompt="The sky is", stop=[word], **GREEDY, extra_body=extra
        )
        assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
        body = {"prompt": "The sky is", "stop": [word], **GREEDY, **extra}
        chunks = stream_chunks(tiny_base, "/v1/completions", body)
        assert "".join(c["choices"][0]["text"] for c in chunks) == want


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(client, tiny_base):
    base = {"logprobs": True, "top_logprobs": 3, "extra_body": {"return_token_ids": True, "ignore_eos": True}}
    named = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        **GREEDY,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True, "ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    plain = client.chat.completions.create(model="tiny", messages=CHAT, **GREEDY, **base)
    ids = named.choices[0].model_extra["token_ids"]
    got, ref = named.choices[0].logprobs.content, plain.choices[0].logprobs.content
    assert [e.token for e in got] == [f"token_id:{t}" for t in ids]
    for e, p in zip(got, ref, strict=True):
        assert (e.bytes, e.logprob) == (p.bytes, p.logprob)  # the token's own bytes, the same numbers
        assert [t.token for t in e.top_logprobs][0].startswith("token_id:")
        assert [t.bytes for t in e.top_logprobs] == [t.bytes for t in p.top_logprobs]
    r = client.completions.create(
        model="tiny",
        prompt="The sky is",
        **GREEDY,
        logprobs=2,
        extra_body={"return_token_ids": True, "ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    lp = r.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in r.choices[0].model_extra["token_ids"]]
    assert all(k.startswith("token_id:") for top in lp.top_logprobs for k in top)


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, tiny_base):
    text = "one two three four five six seven eight nine ten"
    ids = text_ids(tiny_base, text)
    extra = {"return_token_ids": True, "ignore_eos": True, "truncate_prompt_tokens": 5}
    r = client.completions.create(model="tiny", prompt=text, **GREEDY, extra_body=extra)
    assert r.usage.prompt_tokens == 5
    assert r.choices[0].model_extra["prompt_token_ids"] == ids[-5:]
    same = client.completions.create(model="tiny", prompt=ids[-5:], **GREEDY, extra_body={"ignore_eos": True})
    assert r.choices[0].text == same.choices[0].text
    echoed = client.completions.create(model="tiny", prompt=text, echo=True, **GREEDY, extra_body=extra)
    kept = httpx.post(tiny_base + "/v1/detokenize", json={"tokens": ids[-5:]}).json()["prompt"]
    assert echoed.choices[0].text == kept + r.choices[0].text  # echo shows the part kept
    whole = chat_ids(tiny_base, CHAT)
    c = client.chat.completions.create(
        model="tiny", messages=CHAT, **GREEDY, extra_body={**extra, "truncate_prompt_tokens": 4}
    )
    assert c.model_extra["prompt_token_ids"] == whole[-4:]
    fits = client.completions.create(
        model="tiny", prompt=text, **GREEDY, extra_body={**extra, "truncate_prompt_tokens": -1}
    )
    assert fits.usage.prompt_tokens == len(ids)  # -1: as much as fits, here all of it


def test_allowed_token_ids_are_the_only_ones_drawn(client):
    allowed = [40, 41, 42, 43, 97, 98]
    extra = {"allowed_token_ids": allowed, "return_token_ids": True, "ignore_eos": True}
    r = client.chat.completions.create(
        model="tiny", messages=CHAT, temperature=1.0, seed=7, max_tokens=24, extra_body=extra
    )
    ids = r.choices[0].model_extra["token_ids"]
    assert len(ids) == 24 and set(ids) <= set(allowed)
    assert len(set(ids)) > 1  # sampled, not stuck on one


def test_bad_words_ban_a_sequence_after_the_rest_of_it(client, tiny_base):
    extra = {"return_token_ids": True, "ignore_eos": True}
    free = client.completions.create(model="tiny", prompt="The sky is", **GREEDY, extra_body=extra)
    ids = free.choices[0].model_extra["token_ids"]
    vocab = {
        t: httpx.post(tiny_base + "/v1/detokenize", json={"tokens": [t]}).json()["prompt"] for t in set(ids)
    }
    # a word that tokenizes back to a greedy token (printable, no leading space)
    pick = next(
        (
            i
            for i, t in enumerate(ids)
            if vocab[t].isprintable()
            and vocab[t].strip() == vocab[t]
            and vocab[t]
            and httpx.post(
                tiny_base + "/v1/tokenize", json={"prompt": vocab[t], "add_special_tokens": False}
            ).json()["tokens"]
            == [t]
        ),
        None,
    )
    if pick is None:
        pytest.skip("no greedy token of this random model reads back as itself")
    word = vocab[ids[pick]]
    r = client.completions.create(
        model="tiny", prompt="The sky is", **GREEDY, extra_body={**extra, "bad_words": [word]}
    )
    got = r.choices[0].model_extra["token_ids"]
    assert ids[pick] not in got
    assert got[:pick] == ids[:pick]  # the same until the banned token would come


@pytest.mark.parametrize("field", ["chat", "completions"])
def test_cache_salt_keeps_prefixes_apart(client, field):
    long = " ".join(f"word{i}" for i in range(30)) + f" {field}"

    def cached(salt):
        extra = {"ignore_eos": True, **({"cache_salt": salt} if salt else {})}
        if field == "chat":
            r = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": long}], max_tokens=1, extra_body=extra
            )
        else:
            r = client.completions.create(model="tiny", prompt=long, max_tokens=1, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0  # the same salt shares
    assert cached("tenant-b") == 0  # another salt does not
    assert cached(None) == 0  # nor does no salt
    assert cached(None) > 0


@pytest.mark.parametrize(
    "body, param",
    [
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 100000, "max_tokens": 5}, "truncate_prompt_tokens"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
        ({"bad_words": ["  "]}, "bad_words"),
        ({"bad_words": ["x"] * 65}, "bad_words"),
        ({"bad_words": [f"{i}" + "xy" * 100 for i in range(8)]}, "bad_words"),  # past 1,024 tokens
        ({"cache_salt": ""}, "cache_salt"),
        ({"cache_salt": "s" * 1025}, "cache_salt"),
    ],
)
def test_bad_extras_are_400s_naming_the_field(tiny_base, body, param):
    r = httpx.post(tiny_base + "/v1/completions", json={"prompt": "hi", **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_bad_words_ban_a_sequences_last_token_only_after_the_rest():
    """The sampler alone: [7, 9] bans 9 right after 7 and nowhere else; [5] bans 5 always. Red with
    the first token banned instead of the last, and with the tail compared to the whole sequence."""
    from kvgate.sampling import Sampler, SamplingParams

    logits = torch.zeros(16)
    logits[9], logits[5], logits[4] = 3.0, 5.0, 1.0  # greedy order: 5, 9, 4
    s = Sampler(SamplingParams(temperature=0, bad_words=[[5], [7, 9]]), [1, 2], 16)
    assert s.sample(logits) == 9  # 5 is banned; 9 follows nothing banned
    s.record(7)
    assert s.sample(logits) == 4  # after 7, 9 is banned too
    assert s.sample(logits) == 9  # after 4 it is not


def test_a_row_with_no_token_left_fails_rather_than_draw_a_banned_one():
    """allowed_token_ids [3] with bad_words banning 3 leave nothing: the draw fails with a message
    naming both, instead of the argmax fallback's banned token. Red without `forbids`' check."""
    from kvgate.sampling import Sampler, SamplingParams

    s = Sampler(SamplingParams(temperature=0, allowed_token_ids=[3], bad_words=[[3]]), [1], 16)
    with pytest.raises(ValueError, match="allowed_token_ids and bad_words"):
        s.sample(torch.randn(16))
    free = Sampler(SamplingParams(temperature=0, allowed_token_ids=[3, 11]), [1], 16)
    assert free.sample(torch.arange(16, dtype=torch.float32)) == 11


def test_a_row_with_bad_words_does_not_speculate():
    """Its ban depends on the tokens before, which a draft's verification would not move between
    positions. Red with bad_words left out of `eligible`."""
    from kvgate.core.speculate import eligible
    from kvgate.sampling import Sampler, SamplingParams

    assert eligible(Sampler(SamplingParams(allowed_token_ids=[1, 2]), [1], 16))
    assert not eligible(Sampler(SamplingParams(bad_words=[[1, 2]]), [1], 16))


def test_salted_block_hashes_differ_from_unsalted_and_other_salts():
    from kvgate.core.kv_cache import prompt_block_hashes

    ids = list(range(64))
    plain = prompt_block_hashes(ids, 16, b"model")
    a, b = (prompt_block_hashes(ids, 16, b"model", s) for s in ("a", "b"))
    assert a == prompt_block_hashes(ids, 16, b"model", "a")
    assert not set(plain) & set(a) and not set(a) & set(b)


@pytest.mark.slow
def test_bad_words_on_smollm2_take_paris_out_of_the_answer(real_base):
    """The real model, unmodified openai SDK: greedy, "the capital of France" is " Paris"; with
    `bad_words: ["Paris"]` neither of its spellings (`Paris`, ` Paris`: one token each) is drawn, and
    the answer goes on without it. Red with the ban not applied (the answer keeps Paris)."""
    c = OpenAI(base_url=real_base + "/v1", api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    kw = {"model": "SmolLM2-135M-Instruct", "messages": ask, "max_tokens": 40, "temperature": 0}
    free = c.chat.completions.create(**kw)
    assert "Paris" in free.choices[0].message.content
    banned = [
        httpx.post(real_base + "/v1/tokenize", json={"prompt": w, "add_special_tokens": False}).json()[
            "tokens"
        ]
        for w in ("Paris", " Paris")
    ]
    r = c.chat.completions.create(**kw, extra_body={"bad_words": ["Paris"], "return_token_ids": True})
    ids = r.choices[0].model_extra["token_ids"]
    assert all(len(b) == 1 and b[0] not in ids for b in banned), (banned, ids)
    assert "Paris" not in r.choices[0].message.content and r.choices[0].message.content


def test_bad_words_with_a_grammar_mask_their_own_copy(tiny_base):
    """QA of session 46 (HIGH): a row with bad words that banned nothing at a step handed the batch's
    own logits to the grammar's in-place mask (a 500 under inference mode; its neighbours' logits
    otherwise). Now `process` always copies: the answer is JSON and no bad word's sequence is in it.
    Red with `process` returning its input uncopied."""
    body = {
        "messages": [{"role": "user", "content": "Give a JSON object."}],
        "max_tokens": 24,
        "temperature": 0,
        "response_format": {"type": "json_object"},
        "bad_words": ["banana split", "abc"],
        "return_token_ids": True,
    }
    r = httpx.post(tiny_base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_constraints_that_leave_no_token_are_a_400_not_a_500(tiny_base):
    """allowed_token_ids a JSON grammar can never use: the row cannot go on. That is the request's own
    conflict, answered as a 400 `no_token_left` naming allowed_token_ids (streamed: that error event),
    not the engine's 500. Red with `NoTokenLeft` raised as a plain ValueError."""
    ids = httpx.post(tiny_base + "/v1/tokenize", json={"prompt": "zz", "add_special_tokens": False}).json()
    body = {
        "prompt": "Give a JSON object.",
        "max_tokens": 8,
        "temperature": 0,
        "response_format": {"type": "json_object"},
        "allowed_token_ids": ids["tokens"][:1],
    }
    r = httpx.post(tiny_base + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("no_token_left", "allowed_token_ids")
    assert "leave no token" in err["message"]
    events = stream_chunks_and_errors(tiny_base, "/v1/completions", body)
    assert events[-1]["error"]["code"] == "no_token_left"


def stream_chunks_and_errors(base: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=60) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_any_salt_of_a_sane_length_is_taken(tiny_base):
    """A base64 salt holds '/' about half the time (vLLM's docs suggest one): served (red: a 400 under
    vLLM's newer character rule, which kvgate had copied). A lone surrogate is the body parser's 400,
    as in any other string field."""
    for salt, status in (('"ab/cd+ef=="', 200), ('"\\ud800x"', 400)):
        raw = '{"prompt": "hi", "max_tokens": 1, "cache_salt": ' + salt + "}"
        r = httpx.post(
            tiny_base + "/v1/completions", content=raw, headers={"content-type": "application/json"}
        )
        assert r.status_code == status, r.text


def test_review_findings_on_constraints_truncation_and_echo(tiny_base):
    """The session's review:
    - allowed_token_ids of only the end token with min_tokens 2: every token is ruled out at the first
      step, and the draw's argmax fallback was the held end token: a 200 ending after one token. Now a
      400 `no_token_left` (red without `forbids`' min_tokens check);
    - truncate_prompt_tokens -1 with max_tokens filling the context: a 400 about max_tokens, not "0
      keeps no prompt" for a -1 the client sent (red without the room check);
    - a list of prompts of which one is cut echoes the other as sent. One flag for the list decoded
      every prompt, which differs from the text only where the tokenizer adds a BOS: this one adds
      none, so that break stays green here; the check is kept for the echo of a cut list."""
    info = httpx.get(tiny_base + "/tokenizer_info").json()
    eos = httpx.post(
        tiny_base + "/v1/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}
    )
    # token 0 is an end token of this tokenizer too, and the all -inf draw's argmax fallback
    allowed = [0, *eos.json()["tokens"]]
    body = {"prompt": "hi", "max_tokens": 5, "min_tokens": 2, "allowed_token_ids": allowed}
    r = httpx.post(tiny_base + "/v1/completions", json=body, timeout=60)
    assert (r.status_code, r.json()["error"]["code"]) == (400, "no_token_left"), r.text
    L = info["model_max_length"]
    r = httpx.post(
        tiny_base + "/v1/completions", json={"prompt": "hi", "max_tokens": L, "truncate_prompt_tokens": -1}
    )
    assert (r.status_code, r.json()["error"]["param"]) == (400, "max_tokens"), r.text
    prompts = ["ab", "one two three four five six"]
    r = httpx.post(
        tiny_base + "/v1/completions",
        json={"prompt": prompts, "max_tokens": 1, "echo": True, "truncate_prompt_tokens": 4},
    ).json()
    assert r["choices"][0]["text"].startswith("ab") and len(text_ids(tiny_base, "ab")) <= 4
    assert not r["choices"][1]["text"].startswith("one")


def test_an_included_stop_token_carries_its_logprobs(client):
    """With include_stop_str_in_output the stop token's text is output, and its logprobs come with it:
    the logprobs line up with token_ids (red with the include path's Token dropping them)."""
    extra = {"ignore_eos": True, "return_token_ids": True, "skip_special_tokens": False}
    free = client.completions.create(model="tiny", prompt="The sky is", **GREEDY, extra_body=extra)
    ids = free.choices[0].model_extra["token_ids"]
    stop = next(t for t in ids[2:] if t not in ids[:2])
    extra.update(stop_token_ids=[stop], include_stop_str_in_output=True)
    r = client.completions.create(model="tiny", prompt="The sky is", **GREEDY, logprobs=1, extra_body=extra)
    c = r.choices[0]
    assert c.model_extra["token_ids"][-1] == stop
    assert len(c.logprobs.tokens) == len(c.model_extra["token_ids"])


def test_token_id_clients_get_the_stop_tokens_logprobs_too(client, tiny_base):
    """RL clients pair `token_ids` (or the `token_id:` names of logprobs, as verifiers parses them) with
    logprobs, and train on what ended the answer too: with return_token_ids or
    return_tokens_as_token_ids the stop token has its logprobs entry, as vLLM lists it, and no text.
    Without them the answer is OpenAI's, whose logprobs leave the end out. Red with `report_stop_token`
    unset."""
    base = {"ignore_eos": True, "return_token_ids": True}
    free = client.chat.completions.create(model="tiny", messages=CHAT, **GREEDY, extra_body=base)
    ids = free.choices[0].model_extra["token_ids"]
    stop = next(t for t in ids[2:] if t not in ids[:2])
    cut = ids[: ids.index(stop) + 1]
    for extra, named in (({"return_token_ids": True}, False), ({"return_tokens_as_token_ids": True}, True)):
        body = {"ignore_eos": True, "stop_token_ids": [stop], **extra}
        r = client.chat.completions.create(
            model="tiny", messages=CHAT, **GREEDY, logprobs=True, extra_body=body
        )
        entries = r.choices[0].logprobs.content
        assert len(entries) == len(cut)
        if named:
            assert [e.token for e in entries] == [f"token_id:{t}" for t in cut]
        chunks = stream_chunks(
            tiny_base, "/v1/chat/completions", {"messages": CHAT, **GREEDY, "logprobs": True, **body}
        )
        streamed = [
            e
            for c in chunks
            if c["choices"] and c["choices"][0].get("logprobs")
            for e in c["choices"][0]["logprobs"]["content"]
        ]
        assert len(streamed) == len(cut)
    plain = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        **GREEDY,
        logprobs=True,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop]},
    )
    assert len(plain.choices[0].logprobs.content) == len(cut) - 1


def test_tokenize_takes_vllms_return_token_strs(tiny_base):
    """Clients of vLLM's /tokenize send `return_token_strs` (often false, explicitly): it was an unknown
    field's 400. True adds the vocabulary strings, one per id, as vLLM's `convert_ids_to_tokens`."""
    plain = httpx.post(tiny_base + "/tokenize", json={"prompt": "hello there", "return_token_strs": False})
    assert plain.status_code == 200 and "token_strs" not in plain.json()
    got = httpx.post(tiny_base + "/v1/tokenize", json={"messages": CHAT, "return_token_strs": True}).json()
    assert len(got["token_strs"]) == got["count"] and all(isinstance(t, str) for t in got["token_strs"])
    back = httpx.post(tiny_base + "/v1/detokenize", json={"tokens": got["tokens"][:1]}).json()["prompt"]
    assert got["token_strs"][0] == back  # a special token's string is its text


def test_the_responses_api_takes_cache_salt(client):
    """vLLM's Responses request carries `cache_salt` too: kvgate's was a 400 (QA of session 46). The
    same salt shares the prompt's blocks, another does not. Red with it left out of responses_input's
    PASSED fields (the salt dropped: the second salt's request cached)."""
    text = " ".join(f"resp{i}" for i in range(30))

    def cached(salt):
        r = client.responses.create(
            model="tiny", input=text, max_output_tokens=1, extra_body={"cache_salt": salt}
        )
        return r.usage.input_tokens_details.cached_tokens

    assert cached("r1") == 0 and cached("r1") > 0 and cached("r2") == 0


def test_best_of_picks_the_same_winner_with_or_without_token_ids(tiny_base):
    """The review of session 46: reporting the stop token (return_token_ids) put its logprob into the
    best_of score, so for seeds 9 and 10 of 40 the winner changed (a stopped answer lost to a longer
    one). The score now leaves a reported stop token out (`serving.scored`). Red without it."""
    for seed in (8, 9, 10, 11):
        body = {"prompt": [80, 70], "max_tokens": 60, "temperature": 1, "best_of": 4, "n": 1, "seed": seed}
        a = httpx.post(tiny_base + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        with_ids = {**body, "return_token_ids": True}
        b = httpx.post(tiny_base + "/v1/completions", json=with_ids, timeout=60).json()["choices"][0]["text"]
        assert a == b, seed


def test_a_reported_stop_token_streams_the_offset_the_whole_answer_gives(tiny_base):
    """The review of session 46: a stop string's first character held back, then a stop token: the
    stop token's event carries that tail, and its streamed `text_offset` was where the tail starts,
    while the whole answer places it at the end of the text. Red without `StreamShaper`'s end rule."""
    url = tiny_base + "/v1/completions"
    base = {"prompt": [80, 70], "max_tokens": 30, "temperature": 0, "logprobs": 0, "return_token_ids": True}
    free = httpx.post(url, json={**base, "ignore_eos": True}).json()["choices"][0]
    ids, toks = free["token_ids"], free["logprobs"]["tokens"]
    k = next(
        (
            i
            for i in range(2, 30)
            if len(toks[i - 1]) == 1 and toks[i - 1].isprintable() and ids[i] not in ids[:i]
        ),
        None,
    )
    if k is None:
        pytest.skip("no printable one-character token before a fresh one in this model's answer")
    body = {**base, "stop_token_ids": [ids[k]], "stop": [toks[k - 1] + "\u2603"]}  # holds toks[k-1] back
    whole = httpx.post(url, json=body).json()["choices"][0]
    chunks = stream_chunks(tiny_base, "/v1/completions", body)
    streamed = [
        o
        for c in chunks
        if c["choices"] and c["choices"][0].get("logprobs")
        for o in c["choices"][0]["logprobs"]["text_offset"]
    ]
    assert whole["token_ids"][-1] == ids[k]
    assert streamed == whole["logprobs"]["text_offset"]
