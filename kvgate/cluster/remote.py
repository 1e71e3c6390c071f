"""The ingress's side of one submission: handles that behave like the engine's `RequestHandle`.

The single-process server drives a request through `await_admitted()`, `aevents()` and `cancel()`
(`kvgate.server.serving`, `kvgate.server.sse`). `RemoteHandle` offers exactly those, so the ingress
runs the server's own code unchanged: same admission-before-headers rule, same SSE framing, same
error bodies. Behind the handles of one submission is one `RemoteCall`: routing and the replica
attempts (`kvgate.cluster.dispatch`) decide its admission, then a pump task reads the replica's
stream and hands each choice its events.

Timestamps: a replica's `Result` times are on the replica's clock and exclude the routing in front
of it. The ingress rewrites them on its own clock: submitted = when the ingress took the request,
admitted / tokens / finished = when those reached the ingress. So the ingress's TTFT and latency
metrics measure what the client sees, retries included.

A replica that dies mid-stream ends each unfinished choice with a `Finished` whose reason is
`error`: the server turns that into its stable 500 body, or one SSE error event and `[DONE]`.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import itertools
import logging
import time

from kvgate.request import Admitted, Finished, Result, Token

log = logging.getLogger("kvgate.cluster")

_ids = itertools.count(1)

# Set per HTTP request by the ingress middleware: a dict the admission fills with the replica's tag.
SERVED_BY: contextvars.ContextVar[dict | None] = contextvars.ContextVar("kvgate_served_by", default=None)

REPLICA_LOST = "the replica serving this request stopped"


class RemoteHandle:
    """One prompt-choice of a `RemoteCall`, shaped like `kvgate.request.RequestHandle`."""

    def __init__(self, call: RemoteCall, index: int, request):
        self.id = next(_ids)
        self.call = call
        self.index = index
        self.request = request
        self.events: asyncio.Queue = asyncio.Queue()
        self.admission: Admitted | None = None
        self.token_times: list[float] = []

    async def await_admitted(self) -> Admitted:
        holder = SERVED_BY.get()
        admitted = await self.call.admission()
        if holder is not None:
            holder["replica"] = self.call.replica
        self.admission = admitted[self.index]
        return self.admission

    async def aevents(self):
        while True:
            ev = await self.events.get()
            yield ev
            if isinstance(ev, Finished):
                return

    def cancel(self) -> None:
        self.call.cancel()

    def close(self) -> None:
        """Nothing here: the replica closes its own handle once its stream has ended (its ledger holds the
        logprobs; the ingress's copies are in the ingress's process, outside every replica's plan)."""


class RemoteCall:
    """One submission (every prompt and choice of one HTTP request), served by one replica."""

    def __init__(self, dispatcher, requests: list, n: int, demand):
        self.dispatcher = dispatcher
        self.requests = requests
        self.n = n
        self.demand = demand
        self.submitted_at = time.monotonic()
        self.admitted_at: float | None = None
        self.replica: str | None = None
        self.stream = None  # the replica's response stream once admitted
        choices = [r for r in requests for _ in range(n)]
        self.handles = [RemoteHandle(self, i, r) for i, r in enumerate(choices)]
        self._finished: set[int] = set()
        self._admission: asyncio.Future | None = None
        self._task: asyncio.Task | None = None
        self.cancelled = False

    # ---- admission ------------------------------------------------------------------------------
    async def admission(self) -> list[Admitted]:
        if self._task is None:
            self._admission = asyncio.get_running_loop().create_future()
            self._task = asyncio.ensure_future(self._run())
        return await asyncio.shield(self._admission)

    async def _run(self) -> None:
        try:
            stream, admitted, replica = await self.dispatcher.dispatch(self)
        except BaseException as exc:
            if not self._admission.done():
                if isinstance(exc, asyncio.CancelledError):
                    self._admission.cancel()
                else:
                    self._admission.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        self.stream, self.replica, self.admitted_at = stream, replica, time.monotonic()
        self._admission.set_result(admitted)
        await self._pump(stream)

    # ---- after admission: the replica's events --------------------------------------------------
    async def _pump(self, stream) -> None:
        try:
            async for msg in stream:
                if msg[0] != "events":
                    continue
                _, batch, view = msg
                now = time.monotonic()
                for i, ev in batch:
                    self.handles[i].events.put_nowait(self._local(i, ev, now))
                if view is not None:
                    self.dispatcher.observe(view)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the replica died or the call failed: end every open choice
            if self.cancelled:  # our own cancel ended the stream: nothing failed
                return
            log.error("replica %s failed mid-request: %s: %s", self.replica, type(exc).__name__, exc)
            self.dispatcher.counts.lost_mid_stream += 1
            self.dispatcher.replica_failed(self.replica)
            for h in self.handles:
                if h.index not in self._finished:
                    h.events.put_nowait(self._ended(h, "error", f"{REPLICA_LOST}: {type(exc).__name__}"))

    def _local(self, i: int, ev, now: float):
        h = self.handles[i]
        if isinstance(ev, Token):
            h.token_times.append(now)
            return Token(ev.token_id, ev.text, now, ev.logprobs)  # its logprobs too (they were dropped)
        self._finished.add(i)
        res = ev.result
        times = h.token_times if len(h.token_times) == len(res.token_times) else [now] * len(res.token_times)
        local = dataclasses.replace(
            res,
            submitted_at=self.submitted_at,
            admitted_at=self.admitted_at,
            first_token_at=times[0] if times else None,
            finished_at=now,
            token_times=list(times),
        )
        return Finished(local, ev.tail)

    def _ended(self, h: RemoteHandle, reason: str, why: str | None) -> Finished:
        """The `Finished` of a choice whose replica stream ended without one (lost or cancelled)."""
        self._finished.add(h.index)
        a = h.admission
        now = time.monotonic()
        res = Result(
            token_ids=[],
            text="",
            finish_reason=reason,
            prompt_tokens=a.prompt_tokens if a else len(h.request.prompt_ids),
            completion_tokens=len(h.token_times),
            budget_cap=a.budget_cap if a else None,
            submitted_at=self.submitted_at,
            admitted_at=self.admitted_at,
            first_token_at=h.token_times[0] if h.token_times else None,
            finished_at=now,
            token_times=list(h.token_times),
            error=why,
        )
        return Finished(res, "")

    # ---- cancel ---------------------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop everywhere: the routing if still deciding, the replica's requests if admitted."""
        if self.cancelled:
            return
        self.cancelled = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self.stream is not None:
            self.stream.cancel()
            for h in self.handles:  # like the engine: a cancelled request still ends with Finished
                if h.index not in self._finished:
                    h.events.put_nowait(self._ended(h, "cancelled", None))
