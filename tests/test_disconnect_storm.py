"""Disconnect storm: many clients drop at random points — while queued (streaming and not), while their
long prompt is still prefilling in small chunks, and mid-decode — next to clients that stay.

Afterwards no row runs, no request waits, every KV block is free, kvgate_aborted counts exactly the
clients that left, the clients that stayed got their whole output, and no generation went on for a
client that had left: each client's request carries a unique max_tokens, so the test can see, once
the aborts are counted, that none of the leavers' requests is still queued or running, and that
decode steps stop when the stayers are done.

Where each leaver was when it left (queued / prefilling / decoding) is read from the scheduler at the
moment of the drop and printed with `-s`.

Seen to fail (each break made in a copy of the tree, then restored):
- sse_stream without the `finally` that cancels its handles (prefill and decode leavers kept
  generating: aborted reached 16 of 22);
- until_disconnect not cancelling the handles (queued leavers stayed queued and ran: aborted 6 of 22);
- the scheduler's tick not aborting cancelled running rows (leavers' rows ran to their max_tokens).
Not caught here: a tick that admits cancelled waiters before aborting them (they are still counted
once, one step later); the scheduler's own tests own that.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter

import httpx

from kvgate.core.testing import set_step_hook
from tests.server_util import running_server
from tests.server_util import wait_until as shared_wait_until
from tests.tiny_model import TINY_KV_BYTES_PER_TOKEN

CHAT = "/v1/chat/completions"
LONG = "the quick brown fox jumps over the lazy dog " * 7  # ~300 tokens: many 8-token prefill chunks
SHORT = "hello there"
STEP_DELAY = 0.01
MAX_SEQS = 8


def where(engine, max_tokens: int) -> str:
    """Where the request with this (unique) max_tokens is right now, read from the engine's snapshot."""
    snap = engine.snapshot()
    if any(w.max_tokens == max_tokens for w in snap.waiters):
        return "queued"
    for r in snap.rows:
        if r.max_tokens == max_tokens:
            return "prefilling" if r.prefilling else "decoding"
    return "gone"


async def open_raw(port: int, body: dict):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    ).encode()
    writer.write(head + data)
    await writer.drain()
    return reader, writer


def drop(writer, hard: bool) -> None:
    if hard:
        writer.transport.abort()  # RST, as a crashed client
    else:
        writer.close()  # FIN, as a client that gave up


async def read_until(reader, buf: bytearray, pred, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not pred(buf):
        left = end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"waited {timeout}s; got {bytes(buf[-200:])!r}")
        piece = await asyncio.wait_for(reader.read(65536), left)
        if not piece:
            raise ConnectionError(f"server closed the connection early; got {bytes(buf[-200:])!r}")
        buf += piece


def content_events(buf: bytes) -> int:
    return buf.count(b'"content": "') - buf.count(b'"content": ""')


async def stayer(client: httpx.AsyncClient, body: dict) -> dict:
    async with client.stream("POST", CHAT, json=body) as r:
        assert r.status_code == 200, await r.aread()
        lines = [ln async for ln in r.aiter_lines() if ln]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    return {
        "finish": chunks[-2]["choices"][0]["finish_reason"],
        "tokens": chunks[-1]["usage"]["completion_tokens"],
    }


def test_disconnect_storm_cancels_every_leaver_and_leaks_nothing(make_engine):
    engine = make_engine(
        max_seqs=MAX_SEQS,
        prefill_chunk=8,
        block_size=16,
        kv_cache_bytes=256 * 16 * TINY_KV_BYTES_PER_TOKEN,
        max_queue=64,
        max_queue_wait=60,
    )
    set_step_hook(engine, lambda so: time.sleep(STEP_DELAY))
    rng = random.Random(7)
    aborted0 = engine.snapshot().counters.aborted
    places: Counter = Counter()
    dropped_mt: list[int] = []

    with running_server(engine) as (base, _):
        port = int(base.rsplit(":", 1)[1])

        async def main():
            go = asyncio.Event()
            mt = iter(range(100, 1000))  # unique max_tokens per client: its identity in the scheduler

            async def prefill_leaver():
                m = next(mt)
                reader, writer = await open_raw(
                    port,
                    {
                        "messages": [{"role": "user", "content": LONG}],
                        "max_tokens": m,
                        "ignore_eos": True,
                        "stream": True,
                    },
                )
                buf = bytearray()
                # the 200's headers: admitted (the role chunk waits for the first token since QA pass 8)
                await read_until(reader, buf, lambda b: b"\r\n\r\n" in b, 30)
                await go.wait()
                await asyncio.sleep(rng.uniform(0.0, 0.3))
                assert content_events(bytes(buf)) == 0
                places[where(engine, m)] += 1
                dropped_mt.append(m)
                drop(writer, hard=rng.random() < 0.5)

            async def decode_leaver():
                m = next(mt)
                reader, writer = await open_raw(
                    port,
                    {
                        "messages": [{"role": "user", "content": SHORT}],
                        "max_tokens": m,
                        "ignore_eos": True,
                        "stream": True,
                    },
                )
                buf = bytearray()
                k = rng.randint(2, 8)
                await go.wait()
                await read_until(reader, buf, lambda b: content_events(bytes(b)) >= k, 30)
                places[where(engine, m)] += 1
                dropped_mt.append(m)
                drop(writer, hard=rng.random() < 0.5)

            async def queued_leaver(stream: bool):
                m = next(mt)
                body = {"messages": [{"role": "user", "content": SHORT}], "max_tokens": m, "ignore_eos": True}
                if stream:
                    body["stream"] = True
                reader, writer = await open_raw(port, body)
                await go.wait()
                await asyncio.sleep(rng.uniform(0.0, 0.25))
                places[where(engine, m)] += 1
                dropped_mt.append(m)
                drop(writer, hard=rng.random() < 0.5)

            async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(60.0)) as client:
                # Phase A: fill all rows. 3 will leave mid-prefill, 3 mid-decode, 2 stay to the end.
                stay_a = [
                    {
                        "messages": [{"role": "user", "content": SHORT}],
                        "max_tokens": next(mt),
                        "ignore_eos": True,
                        "stream": True,
                        "stream_options": {"include_usage": True},
                    }
                    for _ in range(2)
                ]
                tasks = [asyncio.ensure_future(prefill_leaver()) for _ in range(3)]
                tasks += [asyncio.ensure_future(decode_leaver()) for _ in range(3)]
                stayers = [asyncio.ensure_future(stayer(client, b)) for b in stay_a]
                end = time.monotonic() + 20
                while engine.snapshot().running < MAX_SEQS and time.monotonic() < end:
                    await asyncio.sleep(0.01)
                assert engine.snapshot().running == MAX_SEQS
                # Phase B: 4 stayers first in the FIFO, then 16 leavers that wait behind them.
                stay_b = [
                    {
                        "messages": [{"role": "user", "content": SHORT}],
                        "max_tokens": next(mt),
                        "ignore_eos": True,
                        "stream": True,
                        "stream_options": {"include_usage": True},
                    }
                    for _ in range(4)
                ]
                for b in stay_b:
                    stayers.append(asyncio.ensure_future(stayer(client, b)))
                    await asyncio.sleep(0.02)  # keep their FIFO order
                tasks += [asyncio.ensure_future(queued_leaver(stream=i % 4 != 0)) for i in range(16)]
                while engine.snapshot().waiting < 20 and time.monotonic() < end:
                    await asyncio.sleep(0.01)
                assert engine.snapshot().waiting == 20
                go.set()
                await asyncio.wait_for(asyncio.gather(*tasks), 30)
                results = await asyncio.wait_for(asyncio.gather(*stayers), 60)
            return stay_a + stay_b, results

        t0 = time.monotonic()
        stay_bodies, results = asyncio.run(main())
        n_left = len(dropped_mt)
        assert n_left == 22
        assert wait_until(lambda: engine.snapshot().counters.aborted - aborted0 == n_left, 10), (
            engine.snapshot().counters.aborted,
            n_left,
        )

        # No leaver's request is queued or running once its abort is counted.
        left = set(dropped_mt)
        snap = engine.snapshot()
        assert not [w for w in snap.waiters if w.max_tokens in left]
        assert not [r for r in snap.rows if r.max_tokens in left]
        # The stayers got their whole output.
        for body, res in zip(stay_bodies, results, strict=True):
            assert res == {"finish": "length", "tokens": body["max_tokens"]}, (body["max_tokens"], res)
        wall = time.monotonic() - t0

        assert wait_until(lambda: engine.snapshot().idle, 10)
        c = engine.snapshot().counters
        snap = engine.snapshot()
        assert snap.kv_blocks_available == snap.kv_blocks_total
        assert c.kv_blocks_held == 0
        assert c.aborted - aborted0 == n_left, "an abort was counted twice or missed"
        steps, gen = c.decode_steps, c.generated_tokens
        time.sleep(0.3)
        c = engine.snapshot().counters
        assert (c.decode_steps, c.generated_tokens) == (steps, gen), (
            "generation went on after every client was gone or done"
        )
        with httpx.Client(base_url=base, timeout=20) as cl:
            assert f"kvgate_aborted_total {float(n_left)}" in cl.get("/metrics").text
            assert (
                cl.post(
                    CHAT, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
                ).status_code
                == 200
            )

    # Each kind of leaver was really exercised.
    assert places["queued"] >= 8 and places["prefilling"] >= 1 and places["decoding"] >= 1, places
    print(
        f"\nDISCONNECT STORM: {n_left} leavers by place at the drop {dict(places)}, {len(results)} stayers "
        f"complete, aborted +{n_left}, blocks free {snap.kv_blocks_free}/{snap.kv_blocks_total}, {wall:.1f}s"
    )


def wait_until(pred, timeout=10.0):
    return shared_wait_until(pred, timeout)
