"""A stream the client left still counts its generated tokens once the cancelled choice ends.

Found by a black-box QA run (session 29): the console's tokens/s showed <= 13 while two cancelled
streams generated ~2,400 tokens, which `kvgate_generation_tokens_total` (the engine's counter) did
count. Seen red with the `observe_after_cancel` call taken out of `sse_stream`'s cleanup.
"""

from __future__ import annotations

import asyncio
import time

from kvgate.request import Finished, GenerationRequest, RequestHandle, Result, Token
from kvgate.sampling import SamplingParams
from kvgate.server.responses import ChunkMaker
from kvgate.server.sse import sse_stream


def result(n: int, reason: str) -> Result:
    now = time.monotonic()
    return Result(list(range(n)), "x" * n, reason, 3, n, None, now, now, now, now, [now] * n)


def test_a_stream_closed_by_the_client_still_reports_its_cancelled_result():
    async def scenario():
        h = RequestHandle(GenerationRequest([1, 2, 3], SamplingParams(), 8), lambda rid: None)
        seen = []
        stream = sse_stream(ChunkMaker("chat", "id", 0, "m"), [h], False, seen.append)
        h.events.put(Token(5, "x", time.monotonic()))
        first = [await stream.__anext__() for _ in range(2)]  # the role chunk, then the token's
        assert '"x"' in first[1]
        await stream.aclose()  # the client left: the handle is cancelled
        assert h.cancelled and seen == []
        h.events.put(Finished(result(1, "cancelled"), ""))  # the worker ends the row at its next tick
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)
        return seen

    (res,) = asyncio.run(scenario())
    assert res.finish_reason == "cancelled" and res.completion_tokens == 1


def test_the_role_chunk_waits_for_the_first_engine_event():
    """The chat stream's first chunk (the role) is sent with the first token, after the prompt's
    prefill, as vLLM sends it: `vllm bench serve` times TTFT from the first chunk with `choices`, and a
    role chunk at admission read as TTFT ~0 (QA pass 8). Seen red with the role chunks sent before the
    event loop, as they were."""

    async def scenario():
        h = RequestHandle(GenerationRequest([1, 2, 3], SamplingParams(), 8), lambda rid: None)
        stream = sse_stream(ChunkMaker("chat", "id", 0, "m"), [h], False, lambda r: None)
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)
        assert not first.done()  # nothing yet: the prompt is still being prefilled
        h.events.put(Token(5, "x", time.monotonic()))
        role = await asyncio.wait_for(first, 5)
        assert '"role": "assistant"' in role
        assert '"x"' in await stream.__anext__()
        await stream.aclose()

    asyncio.run(scenario())
