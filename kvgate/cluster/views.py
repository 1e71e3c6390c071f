"""What one replica tells the ingress about itself: a `ReplicaView` of plain values, and how to add them up.

A replica builds its view from the engine's published `EngineSnapshot` (never from live state) each
time Serve polls it (`record_routing_stats`) and on every admission, refusal and finish it streams
back, so the ingress sees a fresh view without asking. The view carries what routing needs (free and
evictable blocks, rows, queue depth, step time, Retry-After), the admitted counter and the tokens
of the attempts admitted lately (`acked`), which let the ingress drop its optimistic holds exactly
when the replica's own numbers include them (even before that attempt's own answer arrives), and the
snapshot itself (minus the prefix-cache hash set) for the ingress's aggregated `/metrics`.

`aggregate` folds the ready replicas' snapshots into one `EngineSnapshot` with the same fields, so
the single-process server's metrics collector and `/v1/resources` read a cluster exactly as they read
one engine: counts and blocks are sums, step times the mean, the slowest step the maximum.

`PUBLISHED` is where the request router of a process (`kvgate.cluster.router`) leaves the views
Serve delivered to it, for the ingress in the same process to read (`published`).

No Ray import here: these are values that cross the wire, testable alone.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from kvgate.core.forecast import retry_after, typical_step
from kvgate.core.snapshot import Counters, EngineSnapshot


@dataclass(frozen=True)
class ReplicaView:
    replica: str  # Serve's replica tag (its unique id); shown in X-KVGate-Replica, never an engine id
    version: int  # the engine snapshot's version: views of one replica are ordered by it
    admitted: int  # requests this engine has admitted so far (releases the ingress's holds)
    healthy: bool
    reason: str | None  # why not healthy
    blocks_total: int
    blocks_available: int  # free plus evictable prefix-cache blocks: what admission can hand out
    block_size: int
    running: int
    waiting: int
    max_seqs: int
    max_queue: int
    max_queue_wait: float
    step_time: float | None  # the step-time EMA: how long the step in flight may take (admit bound)
    retry_after: int  # seconds until this replica likely has room (the engine's own estimate)
    ledger_limit: int
    ledger: list  # the engine ledger's reservations: [{"role", "lifetime", "bytes", "holder"}]
    pid: int
    snapshot: EngineSnapshot | None = None
    # the typical decode tick (kvgate.core.forecast): for walks of many steps
    decode_step: float | None = None
    acked: tuple = ()  # the ingress's attempt tokens this replica admitted lately (releases holds early)
    kv_bytes_per_token: int = 0  # what a position of KV costs (the bytes a 429 names)


# (app name, deployment name) -> {replica tag: ReplicaView | None (no stats received yet)}; each
# value is replaced whole by the router, never mutated
PUBLISHED: dict[tuple[str, str], dict[str, ReplicaView | None]] = {}


def published(app: str, deployment: str) -> dict[str, ReplicaView | None] | None:
    """The replicas the router of this process lists, or None before its first update."""
    return PUBLISHED.get((app, deployment))


def _light(snap: EngineSnapshot) -> EngineSnapshot:
    """The snapshot without the prefix cache's hash set (it can hold a hash per block)."""
    if getattr(snap, "cached_hashes", None):
        return dataclasses.replace(snap, cached_hashes=frozenset())
    return snap


def view_of(engine, replica: str, acked: tuple = ()) -> ReplicaView:
    """The engine's latest published state as a `ReplicaView` (cheap: one snapshot read). `acked`:
    the tokens of the attempts admitted lately, recorded before this snapshot was read."""
    snap = engine.snapshot()
    cfg = engine.sched_cfg
    why = None
    if not engine.alive:
        why = engine.dead or "the engine worker is not running"
    else:
        why = engine.stalled()
    available = getattr(snap, "kv_blocks_available", snap.kv_blocks_free)
    return ReplicaView(
        replica=replica,
        version=snap.version,
        admitted=snap.counters.admitted,
        healthy=why is None,
        reason=why,
        blocks_total=snap.kv_blocks_total,
        blocks_available=available,
        block_size=cfg.block_size,
        running=snap.running,
        waiting=snap.waiting,
        max_seqs=cfg.max_seqs,
        max_queue=cfg.max_queue,
        max_queue_wait=cfg.queue_wait,
        step_time=snap.step_time_ema,
        decode_step=typical_step(snap),
        retry_after=retry_after(snap),
        ledger_limit=engine.ledger.limit,
        ledger=engine.ledger.snapshot(),
        pid=os.getpid(),
        snapshot=_light(snap),
        acked=acked,
        kv_bytes_per_token=cfg.kv_bytes_per_token,
    )


def newer(old: ReplicaView | None, new: ReplicaView) -> ReplicaView:
    """Keep whichever view of the same replica is more recent (views arrive by two paths)."""
    if old is None or old.replica != new.replica or new.version >= old.version:
        return new
    return old


_MAX = {"version", "absorbed", "published_at", "slowest_step"}


def aggregate(snaps: list[EngineSnapshot]) -> EngineSnapshot | None:
    """One snapshot for several engines: ints summed, tuples joined, step times averaged."""
    if not snaps:
        return None
    out = {}
    for f in dataclasses.fields(EngineSnapshot):
        values = [getattr(s, f.name) for s in snaps]
        first = values[0]
        if f.name in _MAX:
            out[f.name] = max(values)
        elif isinstance(first, Counters):
            total = Counters()
            for c in values:
                total = total.plus(c)
            # the peak is per engine: the sum of peaks is an upper bound, the max a lower one
            total.kv_blocks_peak = max(c.kv_blocks_peak for c in values)
            out[f.name] = total
        elif f.name == "prefill_line":  # a mean line over the replicas that have timed a prefill
            lines = [v for v in values if v is not None]
            out[f.name] = tuple(sum(c) / len(lines) for c in zip(*lines)) if lines else None
        elif isinstance(first, tuple):
            out[f.name] = tuple(x for v in values for x in v)
        elif isinstance(first, frozenset):
            out[f.name] = frozenset().union(*values)
        elif isinstance(first, bool):
            out[f.name] = all(values)
        elif isinstance(first, int):
            out[f.name] = sum(values)
        else:  # float | None: a mean of what was measured (absent is not zero)
            measured = [v for v in values if v is not None]
            out[f.name] = sum(measured) / len(measured) if measured else None
    return EngineSnapshot(**out)


class KeptCounters:
    """The cluster's monotone counters: every replica ever seen at its last view, so a replica that dies
    or is replaced (a new one has a new tag) keeps its share. Summing only the live replicas made every
    `_total` series drop when Serve replaced one, which Prometheus reads as a counter reset: a false
    spike in every rate panel (QA pass 7's F2). The blocks held and their peak stay the live ones."""

    def __init__(self):
        self.last: dict[str, Counters] = {}

    def fold(self, views: list[ReplicaView], live: Counters) -> Counters:
        for v in views:
            if v.snapshot is not None:
                self.last[v.replica] = v.snapshot.counters
        total = Counters()
        for c in self.last.values():
            total = total.plus(c)
        total.kv_blocks_held, total.kv_blocks_peak = live.kv_blocks_held, live.kv_blocks_peak
        return total
