"""The official `openai` client, sync and async, streaming and not, against the real default model."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.server_util import running_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real_server():
    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine

    engine = Engine.from_model("default", EngineConfig(memory_limit="2GiB", max_model_len=2048)).start()
    with running_server(engine, model_name="SmolLM2-135M-Instruct") as (base, app):
        yield base, engine
    engine.shutdown()


def test_sync_chat_answers_coherently(real_server):
    base, _ = real_server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=20,
        temperature=0,
    )
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens > 0


def test_sync_stream_equals_non_stream(real_server):
    """Seen to fail when held-back stop text was dropped at the end of a stream."""
    base, _ = real_server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    args = dict(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Name three colors."}],
        max_tokens=24,
        temperature=0,
    )
    whole = client.chat.completions.create(**args).choices[0].message.content
    parts = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**args, stream=True)
        if c.choices
    ]
    assert "".join(parts) == whole


def test_completions_greedy_once_upon_a_time(real_server):
    base, _ = real_server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    out = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="Once upon a time", max_tokens=12, temperature=0
    )
    assert out.choices[0].text.startswith(", the city of Nova Haven was a thriving metropolis")


def test_async_client_concurrent_streams(real_server):
    base, engine = real_server

    async def main():
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused")

        async def one(i):
            stream = await client.chat.completions.create(
                model="SmolLM2-135M-Instruct",
                messages=[{"role": "user", "content": f"Count to {i + 3}."}],
                max_tokens=16,
                temperature=0.7,
                seed=i,
                stream=True,
            )
            text = ""
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
            return text

        return await asyncio.gather(*(one(i) for i in range(4)))

    texts = asyncio.run(main())
    assert all(texts)
    assert engine.snapshot().kv_blocks_free == engine.snapshot().kv_blocks_total


def test_openai_client_surfaces_400_and_429(real_server):
    base, engine = real_server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "hi"}], max_tokens=100_000
        )
    assert e.value.code == "context_length_exceeded"
    r = httpx.get(base + "/v1/models").json()
    assert r["data"][0]["id"] == "SmolLM2-135M-Instruct"
