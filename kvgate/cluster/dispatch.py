"""Two-phase admission across replicas: choose from the views, then let the chosen replica decide.

Phase 1, at the ingress: rank the ready replicas that fit the request now (`routing.rank_now`,
net of the ingress's own holds) and hold its blocks on the first one. Phase 2, at the replica: its
engine admits it at its next tick, or the replica withdraws it and refuses (`wait=False`). No header
has been sent to the client yet, so a refusal there (another ingress got there first, or the views
were stale) costs only a retry: the ingress releases the hold and tries the next replica.

When no replica can admit now, the request waits in the ingress's own FIFO for up to the engines'
`--max-queue-wait` (503 `queue_full` past their `--max-queue`, summed), and tries again each time a
replica's view arrives, so it starts on whichever replica frees room first. The head of the line
reserves the replica it will fit first (its rows walked by steps left, as the engine's TTFT forecast
does): nothing else starts there until the head does, so a big request cannot starve behind a stream
of small ones, and the other replicas keep working meanwhile.
(A request queued inside one replica's engine could only wait for that replica while another had
room: that is the default router's behaviour.) With `--max-queue-wait 0`, or when the wait runs
out, the client gets one 429 whose Retry-After is the smallest any replica gave, naming what the
request waited for (`kvgate.cluster.refusals`): the side budget every replica refused it for (a
grammar slot, logprobs memory), else rows or KV by the views. A replica that refused a waiting
request for a side budget is not asked again until its view shows that budget changed (or its
Retry-After passed): asked at every view and poll, it refused several attempts a second (QA pass:
114 in one 30 s wait). A replica that fails a call (its actor died) is skipped for one health
interval and the next one is tried; before admission that is invisible to the client.

`policy="pow2"` is the comparison baseline: one call, no target, Serve's default router chooses, and
whatever that replica answers is the answer (its FIFO, its 429).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from kvgate.cluster import routing
from kvgate.cluster.refusals import SIDE, cluster_refusal
from kvgate.cluster.replica import refusal_dict, refusal_from
from kvgate.cluster.views import ReplicaView, newer
from kvgate.core.admission import shutting_down_refusal
from kvgate.request import Refusal
from kvgate.server.errors import invalid

log = logging.getLogger("kvgate.cluster")

ATTEMPT_SLACK_S = 30.0  # a replica's first answer comes within its own bound plus this, or it is lost
QUEUE_POLL_S = 0.05  # the head of the ingress's FIFO looks at the router's views at least this often


@dataclass
class RouteCounts:
    admitted: int = 0  # attempts a replica admitted
    refused: int = 0  # attempts a replica refused (a race: its view said it had room)
    failed: int = 0  # attempts that found the replica gone
    queued: int = 0  # submissions that waited in the ingress's FIFO (nobody had room)
    refused_everywhere: int = 0  # submissions answered with the cluster's single 429
    queue_full: int = 0  # submissions refused because the ingress's FIFO was full (503)
    lost_mid_stream: int = 0  # admitted attempts whose replica died or failed before they finished


class Dispatcher:
    def __init__(self, handle, published, policy: str = "kvgate", health_period: float = 2.0):
        """`handle`: Serve's handle to the replicas; `published()`: the router's {tag: view | None}."""
        self.handle = handle
        self.published = published
        self.policy = policy
        self.health_period = health_period
        self.views: dict[str, ReplicaView] = {}
        self.holds = routing.Holds()
        self.affinity = routing.Affinity()
        self.failed: dict[str, float] = {}  # tag -> when a call found it gone
        self.counts = RouteCounts()
        self.waiting: list = []  # the ingress's FIFO of calls no replica could admit yet
        self.reserved: str | None = None  # the replica the head of `waiting` is waiting for
        self._changed = asyncio.Event()  # set (and replaced) whenever a replica's view arrives
        self.closed = False  # the cluster is draining (`close`)

    # ---- what the ingress knows ------------------------------------------------------------------
    def observe(self, view: ReplicaView) -> None:
        old = self.views.get(view.replica)
        kept = self.views[view.replica] = newer(old, view)
        if old is None or kept.version != old.version:  # news: let the waiting requests look again
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def close(self) -> None:
        """The cluster drains (SIGTERM): the requests waiting in the ingress's FIFO, and any submitted
        later, get 503 shutting_down now, as the engine's `Drain` refuses its queue under `kvgate serve`
        (the replicas refuse them too: left waiting, they would get a 429 at their wait's end)."""
        self.closed = True
        self._notify()

    def replica_failed(self, tag: str | None) -> None:
        if tag is not None:
            self.failed[tag] = time.monotonic()

    def _live(self) -> list[str]:
        now = time.monotonic()
        tags = list(self.published() or {})
        return [t for t in tags if now - self.failed.get(t, -1e9) > self.health_period]

    def known_views(self) -> list[ReplicaView]:
        """The freshest view of every replica Serve lists and no call found gone."""
        live = self.published() or {}
        for v in live.values():
            if v is not None:
                self.observe(v)
        for tag in [t for t in self.views if t not in live]:
            del self.views[tag]
        self.holds.forget_except(live)
        ok = set(self._live())
        return [v for t, v in self.views.items() if t in ok]

    def ready_views(self) -> list[ReplicaView]:
        return [v for v in self.known_views() if v.healthy]

    def unseen(self) -> list[str]:
        """Replicas Serve lists (so their constructor finished: ready) whose stats have not arrived."""
        return [t for t in self._live() if t not in self.views]

    # ---- one submission ---------------------------------------------------------------------------
    async def dispatch(self, call):
        """(stream, admitted list, replica tag) for `call`, or raise the refusal the client gets."""
        if self.closed:
            raise shutting_down_refusal()
        if self.policy == "pow2":
            outcome = await self._attempt(call, None, wait=True)
            if isinstance(outcome, Refusal):
                raise outcome
            if outcome is None:
                raise self._unavailable("the replica Serve chose failed before answering")
            return outcome
        refusals: dict[str, Refusal] = {}  # the last refusal each replica gave it
        parked: dict[str, tuple] = {}  # replicas that refused it for a side budget, not asked again yet
        outcome = await self._now(call, refusals, self.reserved, parked)
        if outcome is not None:
            return outcome
        views = self.ready_views()
        if not views and not refusals and not self.unseen():
            listed = len(self.published() or {})
            raise self._unavailable(f"no kvgate replica is ready ({listed} listed by Ray Serve, 0 ready)")
        wait_s = max((v.max_queue_wait for v in views), default=0.0)
        if wait_s <= 0:
            self.counts.refused_everywhere += 1
            raise cluster_refusal(call.demand, refusals, views)
        limit = sum(v.max_queue for v in views)
        if len(self.waiting) >= limit:
            self.counts.queue_full += 1
            raise Refusal(
                "queue_full",
                f"the cluster is at capacity: {len(self.waiting)} requests are already waiting at its "
                f"ingress (limit {limit}, the replicas' --max-queue summed); retry after the Retry-After "
                "interval.",
                503,
                retry_after=routing.min_retry_after(views),
            )
        self.counts.queued += 1
        return await self._queued(call, time.monotonic() + wait_s, wait_s, refusals, parked)

    async def _now(self, call, refusals: dict, avoid: str | None = None, parked: dict | None = None):
        """Phase 1 and 2 over every replica that fits now (but `avoid` and those `parked` holds),
        best first, then over those that will fit within their admission bound (`routing.rank_soon`);
        the outcome or None. `refusals` keeps each replica's last refusal; `parked`, where given, the
        replicas that refused for a side budget: (their side state then, until when)."""
        tried: set[str] = {avoid} if avoid is not None else set()
        if parked:
            self.known_views()  # the side states compared below are the freshest views'
            now = time.monotonic()
            for t, (state, until, _at) in list(parked.items()):
                if state != self._side(t):  # that budget changed: its refusal no longer says what it lacks
                    del parked[t]
                    refusals.pop(t, None)
                elif now < until:
                    tried.add(t)
        while True:
            views = self.ready_views()
            ranked = routing.rank_now(views, call.demand, self.holds, self.affinity) + self.unseen()
            order = [t for t in ranked if t not in tried]
            if not order:  # nobody fits now: whoever will at its next steps, its engine deciding
                soon = routing.rank_soon(views, call.demand, self.holds, self.affinity)
                order = [t for t in soon if t not in tried]
            if not order:
                return None
            tag = order[0]
            tried.add(tag)
            outcome = await self._attempt(call, tag, wait=False)
            if outcome is None:
                continue
            if not isinstance(outcome, Refusal):
                self.affinity.record(call.demand.prefix, tag)
                return outcome
            if outcome.status not in (429, 503):
                raise outcome  # the request itself was refused (a 400): no other replica changes that
            refusals[tag] = outcome
            if parked is not None and outcome.code in SIDE:
                now = time.monotonic()
                parked[tag] = (self._side(tag), now + max(2, outcome.retry_after or 0), now)
            elif parked is not None:
                parked.pop(tag, None)

    def _side(self, tag: str):
        """What frees a grammar slot or logprobs memory on a replica shows here first: its view's
        running grammars, kept grammars and logprobs bytes held (None when unknown)."""
        v = self.views.get(tag)
        s = v.snapshot if v is not None else None
        return None if s is None else (s.grammars_running, s.grammars_kept, s.logprobs_bytes_held)

    async def _queued(self, call, deadline: float, wait_s: float, refusals: dict, parked: dict):
        """Wait in the ingress's FIFO until a replica has room, trying again whenever a view arrives
        (and every poll interval). The head of the line reserves the replica it will fit first
        (`_reservation`): nobody else is started there, so its room only grows until the head fits.
        The others may start anywhere else meanwhile, so one big request at the head does not idle
        the whole cluster, and no request starves behind smaller ones. Past the deadline: the
        cluster's 429, naming what it waited for (`refusals.cluster_refusal`, from each replica's last
        refusal and the views)."""
        self.waiting.append(call)
        try:
            while True:
                if self.closed:
                    raise shutting_down_refusal()
                changed = self._changed
                head = self.waiting[0] is call
                if head:
                    self.reserved = self._reservation(call)
                outcome = await self._now(call, refusals, None if head else self.reserved, parked)
                if outcome is not None:
                    return outcome
                left = deadline - time.monotonic()
                if left <= 0:
                    self.counts.refused_everywhere += 1
                    raise cluster_refusal(
                        call.demand, _aged(refusals, parked), self.ready_views(), waited=wait_s
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), min(left, QUEUE_POLL_S))
        finally:
            if self.waiting[0] is call:
                self.reserved = None
            self.waiting.remove(call)
            self._notify()  # the next in line may be the head now: let everyone look again

    def _reservation(self, call) -> str | None:
        """The replica the head keeps for itself: the one it fits soonest if nothing else starts
        there (kept while no other is sooner). Reserved even when that is later than the head's
        deadline: a replica left to drain is how a big request ever gets in under steady load."""
        views = self.ready_views()
        soonest = {v.replica: routing.time_to_fit(v, call.demand, self.holds) for v in views}
        if not soonest:
            return None
        best = min(soonest.values())
        if self.reserved in soonest and soonest[self.reserved] <= best:
            return self.reserved
        return min(soonest, key=lambda t: (soonest[t], t))

    async def _attempt(self, call, tag: str | None, wait: bool):
        """One replica's answer: (stream, admitted, tag), a `Refusal`, or None if the replica is gone."""
        shared = self.affinity.match(call.demand.prefix, tag) if tag is not None else 0
        hold = self.holds.add(tag, call.demand, shared) if tag is not None else None
        route = {"target": tag, "token": hold.token} if tag is not None else None
        stream = self.handle.options(stream=True).generate.remote(
            call.requests, call.n, wait, call.demand, route=route
        )
        bound = ATTEMPT_SLACK_S + (
            max((v.max_queue_wait for v in self.views.values()), default=0) if wait else 0
        )
        try:
            kind, body = await asyncio.wait_for(stream.__anext__(), bound)
        except asyncio.CancelledError:
            stream.cancel()
            if hold is not None:
                self.holds.release(hold)
            raise
        except Exception as exc:  # the replica died, or never answered within the bound
            stream.cancel()
            if hold is not None:
                self.holds.release(hold)
            self.counts.failed += 1
            self.replica_failed(tag)
            log.warning(
                "replica %s failed a request before admitting it: %s: %s", tag, type(exc).__name__, exc
            )
            return None
        if "view" in body:
            self.observe(body["view"])
        if kind == "admitted":
            self.counts.admitted += 1
            served = body["view"].replica
            if hold is not None and served == tag:
                hold.seq = body["seq"]
            elif hold is not None:
                self.holds.release(hold)
            return stream, body["admitted"], served
        if hold is not None:
            self.holds.release(hold)
        if kind == "invalid":
            raise invalid(body["message"], param=body.get("param"))
        self.counts.refused += 1
        return refusal_from(body["refusal"])

    # ---- the refusals the cluster gives ------------------------------------------------------------
    @staticmethod
    def _unavailable(why: str) -> Refusal:
        return Refusal(
            "engine_unavailable",
            f"{why}; Ray Serve is starting or replacing replicas. Retry after the Retry-After interval.",
            503,
            retry_after=5,
        )


def _aged(refusals: dict, parked: dict) -> dict:
    """The side refusals of the parked replicas with their Retry-After counted from now: the wait since
    each was given is part of it (a 429 after --max-queue-wait repeated a Retry-After given then)."""
    now, out = time.monotonic(), dict(refusals)
    for tag, (_state, _until, at) in parked.items():
        r = out.get(tag)
        if r is not None and r.code in SIDE and r.retry_after is not None:
            d = refusal_dict(r)
            d["retry_after"] = max(1, round(r.retry_after - (now - at)))
            d.pop("retry_after_ms", None)
            out[tag] = refusal_from(d)
    return out
