"""The prefix cache on the real SmolLM2: greedy output with a cache hit is token-identical to the same
request cold, in float32 and in bfloat16, for a shared prefix that ends on a block boundary, one that
ends mid-block, and the whole prompt; and a 10-turn chat through the openai client reports
`cached_tokens` that grow turn by turn.

Seen red (both dtypes) with the cache hits given fresh blocks in the table (stale K/V read as the
prefix), and the chat test with `commit` never registering blocks (cached_tokens stayed 0).
"""

from __future__ import annotations

import openai
import pytest

from kvgate.config import EngineConfig
from kvgate.core.engine import Engine
from kvgate.request import GenerationRequest
from kvgate.sampling import SamplingParams
from tests.server_util import running_server

pytestmark = pytest.mark.slow

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based inks and a wooden press adapted from wine making. Within decades "
    "printing shops spread across Europe, books became cheaper, and literacy rose. Summarize this in one line:"
)


def engine(dtype: str, prefix: str, kv_dtype: str = "auto") -> Engine:
    cfg = EngineConfig(
        dtype=dtype,
        memory_limit="3GiB",
        max_model_len=512,
        kv_cache_bytes=64 << 20,
        prefix_cache=prefix,
        kv_dtype=kv_dtype,
    )
    return Engine.from_model("default", cfg, overhead_bytes=0).start()


def greedy(e: Engine, ids: list[int]):
    return e.generate(GenerationRequest(ids, SamplingParams(temperature=0), 12, ignore_eos=True), timeout=120)


@pytest.mark.parametrize(  # auto under float32: the default float16 cache on a CPU
    "dtype, kv", [("float32", "auto"), ("float32", "float32"), ("bfloat16", "auto")]
)
def test_a_cache_hit_gives_the_cold_tokens(dtype, kv):
    cold, warm = engine(dtype, "off", kv), engine(dtype, "on", kv)
    try:
        x = warm.tokenizer.encode(TEXT)
        assert len(x) > 48
        cases = {
            "boundary": x[:32] + warm.tokenizer.encode(" Why did it matter?"),  # shares 2 whole blocks
            "mid-block": x[:40] + warm.tokenizer.encode(" What came next?"),  # shares 2.5 blocks
            "whole prompt": list(x),
        }
        first = greedy(warm, x)
        assert first.cached_tokens == 0
        assert first.token_ids == greedy(cold, x).token_ids
        for name, ids in cases.items():
            hit, want = greedy(warm, ids), greedy(cold, ids)
            expect_cached = 32 if name != "whole prompt" else (len(ids) - 1) // 16 * 16
            assert hit.cached_tokens == expect_cached, (name, hit.cached_tokens)
            assert hit.token_ids == want.token_ids, f"{dtype}/{kv} {name}: the cache hit changed the output"
    finally:
        cold.shutdown()
        warm.shutdown()


def test_a_ten_turn_chat_reports_cached_tokens_growing_turn_by_turn():
    e = engine("float32", "on")
    try:
        with running_server(e, model_name="SmolLM2-135M-Instruct") as (base, _):
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
            messages = [
                {"role": "system", "content": "You are a concise assistant who answers in a few words."}
            ]
            cached = []
            for turn in range(10):
                messages.append({"role": "user", "content": f"Name one fact about the number {turn + 2}."})
                out = client.chat.completions.create(
                    model="SmolLM2-135M-Instruct", messages=messages, max_tokens=8, temperature=0
                )
                cached.append(out.usage.prompt_tokens_details.cached_tokens)
                messages.append({"role": "assistant", "content": out.choices[0].message.content})
    finally:
        e.shutdown()
    assert cached[0] == 0
    assert all(b > a for a, b in zip(cached[1:], cached[2:])), cached
    assert cached[1] > 0, cached
