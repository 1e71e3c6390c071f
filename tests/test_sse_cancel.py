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
