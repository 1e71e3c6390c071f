"""Log-probabilities (issue 13): what they are computed from, for whom, and OpenAI's two shapes.

They are the log-softmax of the logits the sampler drew from: after logit bias, penalties and the
grammar mask, before temperature and top-k/top-p/min-p (kvgate.sampling's module doc).
"""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

from kvgate.sampling import Sampler, SamplingParams, sample_batch
from tests.server_util import running_server

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "Say something."}]


# ---- the sampler ---------------------------------------------------------------------------------
def test_logprobs_come_from_the_processed_logits_before_temperature():
    """Penalties and logit bias are in, temperature is not; rows that did not ask get none.
    Seen red with the logprobs taken from logits / temperature (-2.419 against -2.300)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 40, generator=gen) * 2
    prompt = [3, 5]
    p = SamplingParams(temperature=0.5, seed=1, repetition_penalty=1.3, logit_bias={7: 5.0}, logprobs=4)
    asking = Sampler(p, prompt, 40)
    silent = Sampler(SamplingParams(temperature=0.5, seed=2), prompt, 40)
    ref = Sampler(p, prompt, 40)  # the same processing, applied by hand below
    tokens = sample_batch([asking, silent], logits)
    processed = ref.process(logits[0])
    want = torch.log_softmax(processed, -1)
    lp = asking.last_logprobs
    assert silent.last_logprobs is None and lp.token_id == tokens[0]
    assert math.isclose(lp.logprob, float(want[tokens[0]]), abs_tol=1e-5)
    top = torch.topk(want, 4)
    assert [i for i, _ in lp.top] == top.indices.tolist()
    assert all(
        math.isclose(v, w, abs_tol=1e-5) for (_, v), w in zip(lp.top, top.values.tolist(), strict=True)
    )
    assert processed[7] > logits[0][7]  # the bias is in what was compared


# ---- over HTTP, tiny model -----------------------------------------------------------------------
def test_chat_logprobs_have_openais_shape_with_bytes(tiny_base):
    """One entry per generated token, `top_logprobs` of the asked length, bytes that join to the
    text (bytes exactness itself: test_token_bytes_are_exact_for_a_split_character)."""
    body = {
        "messages": MSG,
        "max_tokens": 12,
        "logprobs": True,
        "top_logprobs": 3,
        "temperature": 0,
        "ignore_eos": True,
    }
    c = httpx.post(tiny_base + CHAT, json=body, timeout=60).json()["choices"][0]
    content = c["logprobs"]["content"]
    assert len(content) == 12 and c["logprobs"]["refusal"] is None
    for e in content:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"} and len(e["top_logprobs"]) == 3
        assert e["logprob"] <= 0 and e["top_logprobs"][0]["logprob"] == e["logprob"]  # greedy: the top one
    assert bytes(b for e in content for b in e["bytes"]).decode("utf-8", "replace") == c["message"]["content"]
    none = httpx.post(
        tiny_base + CHAT, json={**body, "logprobs": False, "top_logprobs": None}, timeout=60
    ).json()
    assert none["choices"][0]["logprobs"] is None


def test_token_bytes_are_exact_for_a_split_character(tiny_dir):
    """A character split across byte-level tokens: each token's bytes are its own byte, and they join
    to the character. Seen red with bytes from a one-token text decode (U+FFFD's three bytes)."""
    from kvgate.models import load_model
    from kvgate.tokenizer import TextTokenizer

    tok = TextTokenizer(load_model(str(tiny_dir)).tokenizer)
    ids = tok.encode("é€")
    assert len(ids) == 5 and [tok.token_bytes(i) for i in ids] == [bytes([b]) for b in "é€".encode()]
    assert tok.token_bytes(tok.tok.token_to_id("<|im_end|>")) == b"<|im_end|>"


def test_stream_logprobs_match_the_whole_response(tiny_base):
    body = {
        "messages": MSG,
        "max_tokens": 8,
        "logprobs": True,
        "top_logprobs": 2,
        "seed": 4,
        "ignore_eos": True,
    }
    whole = httpx.post(tiny_base + CHAT, json=body, timeout=60).json()["choices"][0]["logprobs"]["content"]
    got = []
    with httpx.stream("POST", tiny_base + CHAT, json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    if ch.get("logprobs"):
                        got += ch["logprobs"]["content"]
    assert got == whole


def test_completions_logprobs_integer_and_echo(tiny_base):
    """Legacy shape (tokens, token_logprobs, top_logprobs as dicts, text_offset); echo puts the prompt
    first, and with logprobs too its scored tokens (tests/test_prompt_logprobs.py). (The pre-issue-13
    tree refused logprobs and echo by name.)"""
    body = {"prompt": "Hello", "max_tokens": 5, "logprobs": 2, "temperature": 0, "ignore_eos": True}
    c = httpx.post(tiny_base + COMP, json=body, timeout=60).json()["choices"][0]
    lp = c["logprobs"]
    assert (
        len(lp["tokens"])
        == len(lp["token_logprobs"])
        == len(lp["top_logprobs"])
        == len(lp["text_offset"])
        == 5
    )
    assert all(len(t) == 2 for t in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    echoed = httpx.post(tiny_base + COMP, json={**body, "logprobs": None, "echo": True}, timeout=60).json()
    assert echoed["choices"][0]["text"] == "Hello" + c["text"]
    both = httpx.post(tiny_base + COMP, json={**body, "echo": True}, timeout=60).json()["choices"][0][
        "logprobs"
    ]
    assert both["tokens"][-5:] == lp["tokens"] and both["token_logprobs"][0] is None  # the prompt first


def test_logprob_ranges_are_400s_naming_the_field(tiny_base):
    for path, extra, param in [
        (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (CHAT, {"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"messages": MSG, "logprobs": 3}, "logprobs"),
        (COMP, {"prompt": "x", "logprobs": 6}, "logprobs"),
        (CHAT, {"messages": MSG, "logit_bias": {"99999": 1}}, "logit_bias"),
        (CHAT, {"messages": MSG, "logit_bias": {"5": 101}}, "logit_bias"),
    ]:
        r = httpx.post(tiny_base + path, json=extra, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


def test_logit_bias_steers_the_output(tiny_base):
    """A +100 bias on one token makes a greedy answer that token; -100 on the greedy token removes it.
    Seen red with the sampler's bias dropped ('B}\ufffd4' instead of 'zzzz')."""
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(tiny_base + "/v1/tokenize", json={"prompt": "z"}).json()["tokens"][0]
    forced = httpx.post(tiny_base + COMP, json={**body, "logit_bias": {str(plain): 100}}, timeout=60).json()
    assert forced["choices"][0]["text"] == "zzzz"
    first = httpx.post(tiny_base + COMP, json={**body, "max_tokens": 1, "logprobs": 0}, timeout=60).json()
    greedy = first["choices"][0]["text"]
    gid = httpx.post(tiny_base + "/v1/tokenize", json={"prompt": greedy}).json()["tokens"][0]
    banned = httpx.post(
        tiny_base + COMP, json={**body, "max_tokens": 1, "logit_bias": {str(gid): -100}}, timeout=60
    )
    assert banned.json()["choices"][0]["text"] != greedy


# ---- the real model, against transformers on the same weights --------------------------------------
@pytest.mark.slow
def test_openai_client_logprobs_equal_an_independent_log_softmax():
    """`logprobs=True, top_logprobs=5` through the official client: the shape, and each chosen token's
    logprob (and the top 5) equal log-softmax of the logits that transformers' LlamaForCausalLM
    computes on the same weights (the converted GGUF), within float32 noise.
    Sabotage by hand not run on this slow test; the same fault (logprobs after temperature) is seen
    red by test_logprobs_come_from_the_processed_logits_before_temperature."""
    import openai
    from transformers import LlamaForCausalLM

    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine
    from kvgate.models import resolve_model_path
    from kvgate.models.gguf_loader import convert_to_cache

    engine = Engine.from_model(
        "default",  # float32 noise needs the float32 cache: auto's float16 one moves logprobs ~1e-3
        EngineConfig(memory_limit="2GiB", max_model_len=2048, dtype="float32", kv_dtype="float32"),
    ).start()
    try:
        with running_server(engine, model_name="SmolLM2-135M-Instruct") as (b, _app):
            client = openai.OpenAI(base_url=b + "/v1", api_key="unused")
            msgs = [{"role": "user", "content": "Name a fruit."}]
            out = client.chat.completions.create(
                model="SmolLM2-135M-Instruct",
                messages=msgs,
                max_tokens=10,
                logprobs=True,
                top_logprobs=5,
                temperature=0.7,
                seed=3,
            )
            prompt = httpx.post(b + "/v1/tokenize", json={"messages": msgs}).json()["tokens"]
    finally:
        engine.shutdown()
    entries = out.choices[0].logprobs.content
    assert entries and all(len(e.top_logprobs) == 5 for e in entries)
    ids = [engine.tokenizer.tok.token_to_id(_piece(engine, e.bytes)) for e in entries]
    hf = LlamaForCausalLM.from_pretrained(
        str(convert_to_cache(resolve_model_path("default"))), torch_dtype=torch.float32
    )
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + ids])).logits[0]
    want = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), -1)
    for k, (e, t) in enumerate(zip(entries, ids, strict=True)):
        assert abs(e.logprob - float(want[k, t])) < 2e-3, (k, e.logprob, float(want[k, t]))
        top = torch.topk(want[k], 5).values.tolist()
        assert all(abs(a.logprob - w) < 2e-3 for a, w in zip(e.top_logprobs, top, strict=True))


def _piece(engine, raw: list[int]) -> str:
    """The vocabulary entry whose bytes are `raw` (byte-level BPE: GPT-2's printable stand-ins)."""
    from kvgate.tokenizer import _gpt2_byte_decoder

    enc = {b: c for c, b in _gpt2_byte_decoder().items()}
    return "".join(enc[b] for b in raw)
