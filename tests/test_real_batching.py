"""On the real SmolLM2: 8 different prompts batched together give the same greedy tokens as each prompt
alone, in float32 and in bfloat16 (invariant 7 of the design, on real weights rather than the tiny
random model). Seen red with decode rows given their logits in reverse order (`build_step`'s
`decode_logit_row` reversed), in both dtypes.
"""

from __future__ import annotations

import threading

import pytest

from kvgate.config import EngineConfig
from kvgate.core.engine import Engine
from kvgate.core.testing import set_step_hook
from kvgate.request import GenerationRequest
from kvgate.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "In 1969, the first person to walk on the moon was",
    "A haiku about autumn:",
    "The best way to learn a new language is",
]
N = 12


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eight_real_prompts_batched_give_their_solo_greedy_tokens(dtype):
    e = Engine.from_model(
        "default", EngineConfig(dtype=dtype, memory_limit="3GiB", max_model_len=512)
    ).start()
    try:
        reqs = [
            GenerationRequest(e.tokenizer.encode(p), SamplingParams(temperature=0), N, ignore_eos=True)
            for p in PROMPTS
        ]
        solo = [e.generate(r, timeout=120).token_ids for r in reqs]
        opened, widest = threading.Event(), [0]

        def gate(so):  # hold the first step until all 8 are queued, so they are admitted together
            assert opened.wait(30)
            widest[0] = max(widest[0], len(so.request_ids))

        set_step_hook(e, gate)
        handles = [e.submit(r) for r in reqs]
        opened.set()
        batched = [h.result(120).token_ids for h in handles]
        assert widest[0] == 8, "the prompts did not share steps"
        for p, s, b in zip(PROMPTS, solo, batched, strict=True):
            assert b == s, f"{dtype}: {p!r} changed when batched"
    finally:
        e.shutdown()
