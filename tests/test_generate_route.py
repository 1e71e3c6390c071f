"""vLLM's token-in, token-out route, `POST /inference/v1/generate` (kvgate/server/generate_route.py),
against a live server: the ids and logprobs of an answer, streamed and whole, the same as the text
completion of the same ids; errors named by the generate body's fields; the API key; and PrimeIntellect's
`renderers` client (what prime-rl and verifiers call) unmodified, on the tiny model and on SmolLM2.

Seen red: with the route's logprob entries named only `token_id` (renderers raises
MalformedGenerateResponseError), with the stop token left out of the logprobs (the same, counts
differ), with `generate_param` returning its input (the params below), and with the route off the
keyed paths (the 401 below)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

GEN = "/inference/v1/generate"
IDS = [80, 70, 71, 72, 73]


def chunks_of(base: str, body: dict) -> list[dict]:
    with httpx.stream("POST", base + GEN, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [x for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(x[6:]) for x in lines[:-1]]


def test_an_answer_is_the_completion_of_the_same_ids(tiny_base):
    params = {"max_tokens": 8, "temperature": 0, "logprobs": 1, "ignore_eos": True}
    r = httpx.post(
        tiny_base + GEN, json={"token_ids": IDS, "sampling_params": params, "return_token_ids": True}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    c = body["choices"][0]
    ref = httpx.post(
        tiny_base + "/v1/completions",
        json={"prompt": IDS, "return_token_ids": True, **params},
    ).json()["choices"][0]
    assert c["token_ids"] == ref["token_ids"] and len(c["token_ids"]) == 8
    assert body["prompt_token_ids"] == IDS and body["request_id"].startswith("generate-tokens-")
    entries = c["logprobs"]["content"]
    assert [e["token_id"] for e in entries] == c["token_ids"]
    assert [e["token"] for e in entries] == [f"token_id:{t}" for t in c["token_ids"]]  # vLLM before 0.32
    assert [e["logprob"] for e in entries] == ref["logprobs"]["token_logprobs"]
    assert all(1 <= len(e["top_logprobs"]) <= 2 for e in entries)
    assert (c["finish_reason"], body["usage"]["prompt_tokens"]) == ("length", len(IDS))
    streamed = chunks_of(tiny_base, {"token_ids": IDS, "sampling_params": params, "return_token_ids": True})
    assert streamed[0]["prompt_token_ids"] == IDS
    assert [t for ch in streamed for t in ch["choices"][0]["token_ids"]] == c["token_ids"]
    assert streamed[-1]["choices"][0]["finish_reason"] == "length"


def test_a_stop_token_ends_the_ids_with_its_logprob(tiny_base):
    free = httpx.post(
        tiny_base + GEN, json={"token_ids": IDS, "sampling_params": {"max_tokens": 8, "temperature": 0}}
    ).json()["choices"][0]["token_ids"]
    stop = next(t for t in free[2:] if t not in free[:2])
    params = {"max_tokens": 8, "temperature": 0, "logprobs": 0, "stop_token_ids": [stop]}
    c = httpx.post(tiny_base + GEN, json={"token_ids": IDS, "sampling_params": params}).json()["choices"][0]
    assert c["token_ids"] == free[: free.index(stop) + 1]
    assert (c["finish_reason"], c["stop_reason"]) == ("stop", stop)
    assert len(c["logprobs"]["content"]) == len(c["token_ids"])


@pytest.mark.parametrize(
    "body, param",
    [
        ({"token_ids": [], "sampling_params": {}}, "token_ids"),
        ({"token_ids": [1], "sampling_params": {"temperature": 9}}, "sampling_params.temperature"),
        (
            {"token_ids": [1], "sampling_params": {"thinking_token_budget": 4}},
            "sampling_params.thinking_token_budget",
        ),
        ({"token_ids": [1], "sampling_params": {"logprobs": -1}}, "sampling_params.logprobs"),
        ({"token_ids": [10**7], "sampling_params": {}}, "token_ids"),
        ({"token_ids": [1] * 600, "sampling_params": {}}, "token_ids"),  # past the context
        ({"token_ids": [1], "sampling_params": {}, "output_mode": "text"}, "output_mode"),
        ({"token_ids": [1], "sampling_params": {}, "priority": 3}, "priority"),
        ({"token_ids": [1], "sampling_params": {}, "features": {"mm_hashes": {}}}, "features"),
        ({"token_ids": [1], "sampling_params": {}, "wat": 1}, "wat"),
        ({"token_ids": [1]}, "sampling_params"),
    ],
)
def test_errors_name_the_generate_bodys_fields(tiny_base, body, param):
    r = httpx.post(tiny_base + GEN, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert "'prompt'" not in err["message"]


def test_the_route_takes_the_api_key(make_engine):
    from tests.server_util import running_server

    with running_server(make_engine(), api_key="k") as (base, _app):
        body = {"token_ids": IDS, "sampling_params": {"max_tokens": 2}}
        assert httpx.post(base + GEN, json=body).status_code == 401
        ok = httpx.post(base + GEN, json=body, headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200, ok.text


def test_prime_rls_renderers_client_runs_unmodified(tiny_base):
    """`renderers.client.generate` (what verifiers' train client and prime-rl call) with prebuilt prompt
    ids: it posts to the route, checks every logprob entry's name against the ids, and parses the answer."""
    client_mod = pytest.importorskip("renderers.client")
    from openai import AsyncOpenAI

    class Ids:  # the renderer methods generate() calls when handed prompt ids
        supports_tools = True

        def get_stop_token_ids(self):
            return []

        def parse_response(self, completion_ids, prompt_ids=None, tools=None):
            from renderers.base import ParsedResponse

            return ParsedResponse(content="", reasoning_content=None, tool_calls=[])

    async def run():
        client = AsyncOpenAI(base_url=tiny_base + "/v1", api_key="unused", max_retries=0)
        return await client_mod.generate(
            client=client,
            renderer=Ids(),
            messages=[],
            model="tiny",
            prompt_ids=IDS,
            sampling_params={"max_tokens": 6, "temperature": 1.0, "seed": 5, "ignore_eos": True},
            cache_salt="t",
        )

    out = asyncio.run(run())
    assert out["prompt_ids"] == IDS and len(out["completion_ids"]) == 6
    assert len(out["completion_logprobs"]) == 6 and all(x <= 0 for x in out["completion_logprobs"])


@pytest.mark.slow
def test_renderers_renders_and_generates_on_smollm2(real_base, tmp_path):
    """The whole path a prime-rl rollout takes, on the real model: `renderers` renders the chat with
    the model's own template (from `kvgate tokenizer`), posts the ids, and parses the answer; the ids
    it rendered are the ones /v1/tokenize gives, and the answer ends at the end token it declared."""
    pytest.importorskip("renderers")
    import subprocess
    import sys

    from openai import AsyncOpenAI
    from renderers.base import create_renderer, load_tokenizer
    from renderers.client import generate

    subprocess.run(
        [sys.executable, "-m", "kvgate.cli", "tokenizer", "--model", "default", "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    renderer = create_renderer(load_tokenizer(str(tmp_path)))
    msgs = [{"role": "user", "content": "What is the capital of France?"}]

    async def run():
        client = AsyncOpenAI(base_url=real_base + "/v1", api_key="unused", max_retries=0)
        return await generate(
            client=client,
            renderer=renderer,
            messages=msgs,
            model="SmolLM2-135M-Instruct",
            sampling_params={"max_tokens": 40, "temperature": 0},
        )

    out = asyncio.run(run())
    want = httpx.post(real_base + "/v1/tokenize", json={"messages": msgs}).json()["tokens"]
    assert out["prompt_ids"] == want
    assert out["finish_reason"] == "stop" and out["completion_ids"][-1] in renderer.get_stop_token_ids()
    assert "Paris" in out["content"]
    assert len(out["completion_logprobs"]) == len(out["completion_ids"])


@pytest.mark.parametrize(
    "body, param",
    [
        ({"token_ids": ["hello", "x"], "sampling_params": {}}, "token_ids"),
        ({"token_ids": [[1, 2], [3]], "sampling_params": {}}, "token_ids"),
        ({"token_ids": [1], "sampling_params": {}, "request_id": 5}, "request_id"),
        ({"token_ids": [1], "sampling_params": {}, "request_id": "r" * 129}, "request_id"),
        ({"token_ids": [1], "sampling_params": {}, "return_token_ids": "yes"}, "return_token_ids"),
        (
            {
                "token_ids": [1],
                "sampling_params": {},
                "stream": True,
                "stream_options": {"include_obfuscation": True},
            },
            "stream_options.include_obfuscation",
        ),
    ],
)
def test_the_reviews_bodies_are_400s(tiny_base, body, param):
    """The session's review: text or nested prompts were served as completions' prompt lists (200, the
    second prompt's ids lost), a bad request_id or return_token_ids was silently replaced, and
    obfuscation padding asked for was dropped. Red with the old `to_completion` checks."""
    r = httpx.post(tiny_base + GEN, json=body, timeout=30)
    assert (r.status_code, r.json()["error"]["param"]) == (400, param), r.text


def test_a_stream_reserves_no_whole_body_and_messages_use_the_bodys_names(make_engine):
    """A stream's chunks are rewritten one at a time, so it holds no whole body's logprobs: with 1 MiB of
    logprobs memory, 200 tokens at logprobs 5 stream (they were refused, the whole body's 10 KB a
    position reserved for them), while the whole answer is refused with numbers in the body's names.
    Red with `whole=True` for streams."""
    from tests.server_util import running_server

    with running_server(make_engine(logprobs_memory=1 << 20)) as (base, _app):
        params = {"max_tokens": 200, "logprobs": 5, "ignore_eos": True, "temperature": 0}
        chunks = chunks_of(base, {"token_ids": IDS, "sampling_params": params})
        assert sum(len(c["choices"][0]["token_ids"]) for c in chunks if c["choices"]) == 200
        r = httpx.post(base + GEN, json={"token_ids": IDS, "sampling_params": params}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "sampling_params.max_tokens" and "sampling_params.logprobs=5" in err["message"]


def test_only_the_asked_prompt_ids_travel(tiny_base):
    """return_token_ids is forced on inside the route for the answer's ids; the prompt's ids come once,
    and only when the client asked (n=3 used to carry three copies through the completion's JSON)."""
    body = {"token_ids": IDS, "sampling_params": {"max_tokens": 2, "n": 3, "temperature": 1.0, "seed": 1}}
    plain = httpx.post(tiny_base + GEN, json=body).json()
    assert "prompt_token_ids" not in plain and len(plain["choices"]) == 3
    asked = httpx.post(tiny_base + GEN, json={**body, "return_token_ids": True}).json()
    assert asked["prompt_token_ids"] == IDS
    chunks = chunks_of(tiny_base, {**body, "return_token_ids": True})
    assert sum("prompt_token_ids" in c for c in chunks) == 1


def test_prompt_logprobs_score_the_prompt_as_an_echoed_completion(tiny_base):
    """vLLM's `prompt_logprobs` (a reference model's scoring of a whole sequence): None for the first
    token, then each prompt token's logprob under the tokens before it, keyed by its id, the same numbers
    as /v1/completions' echo with logprobs. The answer's own logprobs only when asked. Red with the
    prompt positions left in the answer's logprobs (counts differ) or with the scores misaligned."""
    params = {"max_tokens": 3, "temperature": 0, "ignore_eos": True, "prompt_logprobs": 1}
    body = httpx.post(tiny_base + GEN, json={"token_ids": IDS, "sampling_params": params}).json()
    scores = body["prompt_logprobs"]
    ref = httpx.post(
        tiny_base + "/v1/completions",
        json={
            "prompt": IDS,
            "max_tokens": 3,
            "temperature": 0,
            "ignore_eos": True,
            "echo": True,
            "logprobs": 1,
        },
    ).json()["choices"][0]["logprobs"]["token_logprobs"]
    assert len(scores) == len(IDS) and scores[0] is None
    assert [scores[i][str(IDS[i])]["logprob"] for i in range(1, len(IDS))] == ref[1 : len(IDS)]
    assert body["choices"][0]["logprobs"] is None and len(body["choices"][0]["token_ids"]) == 3
    both = httpx.post(
        tiny_base + GEN, json={"token_ids": IDS, "sampling_params": {**params, "logprobs": 1}}
    ).json()["choices"][0]
    assert [e["logprob"] for e in both["logprobs"]["content"]] == ref[len(IDS) :]
    mismatch = {**params, "logprobs": 2}
    r = httpx.post(tiny_base + GEN, json={"token_ids": IDS, "sampling_params": mismatch})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "sampling_params.prompt_logprobs")
