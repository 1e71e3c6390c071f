"""`ClusterEngine`: N remote replicas presented to the server modules as one engine.

`kvgate.server.create_app(settings, engine)` serves whatever has an engine's reading surface. The
ingress hands it a `ClusterEngine`, so routes, body parsing, validation, templating, SSE, error
bodies, auth and metrics are the single-process server's own code, not a copy:
- `spec`, `tokenizer`, `max_model_len`, `sched_cfg`, `plan` come from one replica's `describe()` (replicas of
  one deployment share the model and the engine flags); the ingress loads no weights. Their pools do
  not: each measures its own overhead (526 and 590 blocks for two alike, QA pass 13), so `sched_cfg`
  carries the largest ready replica's pool, and a request one replica can hold is never a 400.
- `submit_many` validates like the engine and gives the never-fits 400s from the same arithmetic
  (`kvgate.core.admission.plan_entry`), so a request that fits no replica is refused before any
  replica sees it, with the numbers; then it returns `RemoteHandle`s whose admission is the
  two-phase dispatch (`kvgate.cluster.dispatch`).
- `alive` / `stalled()`: the cluster can serve while at least one replica is ready; with none,
  `stalled()` says so and the server answers 503 `engine_unavailable`.
- `snapshot()` and `ledger` add up the ready replicas (`views.aggregate`), so `/metrics` and
  `/v1/resources` report the cluster's totals under the same names.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging

from kvgate.cluster.dispatch import Dispatcher
from kvgate.cluster.remote import RemoteCall
from kvgate.cluster.routing import Demand, blocks_for, prefix_chain
from kvgate.cluster.views import KeptCounters, ReplicaView, aggregate
from kvgate.core.admission import fit_group, plan_entry, too_many_choices
from kvgate.core.gate import check_min_tokens
from kvgate.request import RequestHandle
from kvgate.tokenizer import TextTokenizer

log = logging.getLogger("kvgate.cluster")

DRAIN_SLACK_S = 15.0  # a replica's drain answers within the grace plus this (its engine's own 5 s)


class ClusterLedger:
    """The ready replicas' memory ledgers, added up (each entry names its replica)."""

    def __init__(self, views: list[ReplicaView]):
        self._views = views
        self.limit = sum(v.ledger_limit for v in views)
        self.reserved = sum(e["bytes"] for v in views for e in v.ledger)

    def by_role(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for v in self._views:
            for e in v.ledger:
                out[e["role"]] = out.get(e["role"], 0) + e["bytes"]
        return out

    def snapshot(self) -> list[dict]:
        return [
            {**e, "holder": f"{e['holder']} (replica {v.replica})"} for v in self._views for e in v.ledger
        ]


def _ignore_cancel(_request_id: int) -> None:
    """A RequestHandle built only to run the admission arithmetic is never submitted."""


class ClusterEngine:
    def __init__(self, handle, published, policy: str = "kvgate", health_period: float = 2.0):
        self.handle = handle
        self.dispatcher = Dispatcher(handle, published, policy, health_period)
        self.dead = None
        self.tokenizer: TextTokenizer | None = None
        self._last = None  # the last aggregate snapshot (metrics never go absent between views)
        self._kept = KeptCounters()  # counters never drop when a replica goes

    async def connect(self) -> dict:
        """Learn the model and limits from one replica; Serve holds the call until one is ready."""
        d = await self.handle.describe.remote()
        self.spec = d["spec"]
        self.tokenizer = TextTokenizer(d["tokenizer"])
        self._sched_cfg = d["sched_cfg"]
        self.plan = d["plan"]
        self.kv_dtype = d["kv_dtype"]  # every replica runs the describing one's flags
        self.model_name = d["model_name"]
        self.dispatcher.observe(d["view"])
        self._last = d["view"].snapshot
        return d

    # ---- what the server reads ------------------------------------------------------------------
    @property
    def sched_cfg(self):
        """The describing replica's limits, with the pool of the largest ready replica: the ceiling of
        the never-fits 400s (routing sends such a request to a replica that holds it). Before, the
        describing replica's pool, kept after it was gone: a 400 quoting a pool no replica had."""
        pools = [v.blocks_total for v in self.dispatcher.ready_views()]
        cfg = self._sched_cfg
        return dataclasses.replace(cfg, total_blocks=max(pools)) if pools else cfg

    @property
    def max_model_len(self) -> int:
        return self.sched_cfg.max_model_len

    @property
    def alive(self) -> bool:
        return True  # the ingress itself; whether a replica can serve is `stalled()`

    def readiness(self) -> tuple[int, int]:
        """(replicas ready, replicas Serve lists)."""
        d = self.dispatcher
        ready = sum(1 for v in d.known_views() if v.healthy) + len(d.unseen())
        return ready, len(d.published() or {})

    def stalled(self) -> str | None:
        ready, listed = self.readiness()
        if ready:
            return None
        return (
            f"no kvgate replica is ready ({listed} listed by Ray Serve, 0 ready); Serve is starting or "
            "replacing them"
        )

    def snapshot(self):
        views = self.dispatcher.ready_views()
        agg = aggregate([v.snapshot for v in views if v.snapshot is not None])
        if agg is not None:
            self._last = dataclasses.replace(agg, counters=self._kept.fold(views, agg.counters))
        return self._last

    @property
    def logprobs_memory(self) -> int:
        """The replicas' logprobs budgets together (each its own --logprobs-memory), as their held bytes
        are summed (`aggregate`)."""
        return self.sched_cfg.logprobs_memory * len(self.dispatcher.ready_views())

    @property
    def grammar_slots(self) -> int:
        """The replicas' grammar slots together (each its own --max-grammars), as their kept grammars
        are summed."""
        return self.plan.limits.grammars * len(self.dispatcher.ready_views())

    @property
    def ledger(self) -> ClusterLedger:
        return ClusterLedger(self.dispatcher.ready_views())

    # ---- requests -------------------------------------------------------------------------------
    def submit_many(self, requests: list, n: int = 1) -> list:
        """Validate, refuse what fits no replica (400 with the numbers), and return one handle per
        prompt and choice; admission happens when the server awaits them."""
        vocab = self.tokenizer.vocab_size
        for r in requests:
            r.validate(vocab)
        cfg = self.sched_cfg
        if n > cfg.max_seqs:  # never on one replica: a 400, as the engine says it
            raise too_many_choices(n, cfg.max_seqs)
        requests = fit_group(cfg, requests, n)  # admitted together on one replica: they must fit its pool
        blocks = positions = 0
        for r in requests:
            # raises the 400s, for all n choices together (alone, n choices past the pool got a 429)
            handles = [RequestHandle(r, _ignore_cancel) for _ in range(n)]
            check_min_tokens(cfg, r)
            entry = plan_entry(cfg, handles[0], handles[1:])
            P = len(r.prompt_ids)
            least = entry.max_tokens if entry.explicit else min(entry.max_tokens, max(1, cfg.min_cap_tokens))
            blocks += n * blocks_for(P + least, cfg.block_size)
            positions += P + least
        one = requests[0]
        prefix = prefix_chain(one.prompt_ids, cfg.block_size, one.cache_salt) if len(requests) == 1 else ()
        demand = Demand(blocks, n * len(requests), prefix, positions)
        call = RemoteCall(self.dispatcher, requests, n, demand)
        return call.handles

    # ---- SIGTERM --------------------------------------------------------------------------------------
    async def drain(self, grace: float) -> list:
        """`Engine.drain(grace)` across the cluster: the ingress's FIFO is refused now (503
        shutting_down) and every replica Serve lists drains its own engine (`KvgateReplica.drain`,
        called on each by name): its queue refused, its running rows given `grace` seconds, then ended
        as `length` with their partial output and usage, their streams closed cleanly. Returns each
        replica's answer, or the exception of one that did not answer (logged; the stop goes on)."""
        self.dispatcher.close()
        tags = list(self.dispatcher.published() or {})
        return list(await asyncio.gather(*(self._drain_one(t, grace) for t in tags)))

    async def _drain_one(self, tag: str, grace: float):
        try:
            # each call outside this drain's own Serve request context: calls made inside one request
            # share its internal request id, and Serve's router matched one call's replica to the other
            # (of two drains sent at once, one never reached its replica)
            call = contextvars.Context().run(self.handle.drain.remote, grace, route={"target": tag})
            return await asyncio.wait_for(_awaited(call), grace + DRAIN_SLACK_S)
        except Exception as exc:  # gone, or past the bound: Serve's delete stops it anyway
            log.warning("replica %s did not drain: %s: %s", tag, type(exc).__name__, exc)
            return exc


async def _awaited(response):
    return await response
