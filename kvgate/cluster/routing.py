"""Admission-aware routing, as pure functions of the replicas' views: which replica can take a request now.

The ingress knows, for every ready replica, the blocks it can hand out, its rows, its queue and its
Retry-After (`ReplicaView`, at most one stats period old, refreshed by every message a replica
streams back). It also knows what it sent since a replica's view was taken: `Holds` are optimistic
reservations, subtracted from a replica's numbers from the moment a request is sent to it until that
replica reports an `admitted` counter that includes it (or refuses it). Without holds, every request
arriving within one stats period would go to the same "emptiest" replica.

A request *fits now* on a replica that is healthy, has a free row and enough blocks for prompt +
max_tokens, where the prompt blocks the ingress recently
sent to that replica count as there already (`Affinity`: its prefix cache likely holds them; the
replica's engine has the last word). `rank_now` orders those by that shared prefix, then by the most
blocks left, then by the fewest rows. (A replica's own queue is not a reason to skip it: under this
router it only ever holds requests for the tick between their arrival and their admission, and the
engine keeps their order.) A replica that does not fit is never in that list: the ingress does not send
a request where it would queue while another replica has room. When none fits now, `rank_soon`
lists those it will fit within their own admission bound (a row ending at the next steps): the
request reaches the engine later than the view was taken, and the engine decides. `time_to_fit`
says which replica a waiting request will fit first, and `min_retry_after` is what the single 429 says when nothing is
possible.

Why not Serve's default power-of-two-choices: it samples two replicas and picks the one with fewer
requests in flight. A request count says nothing about blocks: a replica running two long requests
can be full while one running ten short ones has room, and P2C then queues the request behind the
full one (or the replica answers 429) while the other could have started it at once.
"""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvgate.cluster.views import ReplicaView
from kvgate.core.forecast import decode_seconds


@dataclass(frozen=True)
class Demand:
    """What one submission needs on a single replica: KV blocks for prompt + max_tokens of every
    prompt and choice, batch rows, the prompt's block chain (for prefix affinity), and its positions
    (prompt + max_tokens of each prompt: what a 429 names, as `kvgate serve`'s does)."""

    blocks: int
    rows: int
    prefix: tuple[int, ...] = ()
    positions: int = 0


def blocks_for(positions: int, block_size: int) -> int:
    return -(-positions // block_size)


def prefix_chain(ids: list[int], block_size: int, salt: str | None = None) -> tuple[int, ...]:
    """A chained hash per full prompt block: equal leading entries mean an equal prefix. A `cache_salt`
    starts the chain, as it does the replicas' block hashes: prompts of other salts share no blocks, so
    they are no reason to route together."""
    out, h = [], 0 if salt is None else hash(("salt", salt))
    for i in range(0, len(ids) - block_size + 1, block_size):
        h = hash((h, tuple(ids[i : i + block_size])))
        out.append(h)
    return tuple(out)


@dataclass
class Hold:
    replica: str
    blocks: int
    rows: int
    seq: int | None = None  # the replica's admitted counter once it has admitted this request
    token: int | None = None  # names this attempt to the replica, whose views list it once admitted


_tokens = itertools.count(random.getrandbits(40) << 20)  # unique across ingresses, small to pickle


@dataclass
class Holds:
    """Blocks and rows sent to a replica that its last view does not show yet."""

    by_replica: dict[str, list[Hold]] = field(default_factory=dict)

    def add(self, replica: str, demand: Demand, shared: int = 0) -> Hold:
        """Hold what `fits_now` counted: `shared` prompt blocks are likely in the replica's prefix
        cache, referenced by its running requests, so they are not taken again (the engine checks)."""
        h = Hold(replica, max(0, demand.blocks - shared), demand.rows, token=next(_tokens))
        self.by_replica.setdefault(replica, []).append(h)
        return h

    def release(self, hold: Hold) -> None:
        holds = self.by_replica.get(hold.replica, [])
        if hold in holds:
            holds.remove(hold)

    def held(self, view: ReplicaView) -> tuple[int, int]:
        """(blocks, rows) still to subtract from `view`; holds the view already includes are dropped:
        by the admitted counter once the attempt's answer came, or by its token before that (a view
        that another request's message brought can include an admission whose own answer is still on
        its way: counting both was counting one row twice)."""
        acked = set(view.acked)
        live = [
            h
            for h in self.by_replica.get(view.replica, [])
            if (h.seq is None or h.seq > view.admitted) and h.token not in acked
        ]
        self.by_replica[view.replica] = live
        return sum(h.blocks for h in live), sum(h.rows for h in live)

    def forget_except(self, replicas: Iterable[str]) -> None:
        keep = set(replicas)
        for r in [r for r in self.by_replica if r not in keep]:
            del self.by_replica[r]


class Affinity:
    """Which replicas each prompt-block chain was sent to lately: a bounded map, oldest out first. A
    replica it went to likely still holds those blocks in its prefix cache (its engine confirms)."""

    def __init__(self, capacity: int = 65536):
        self.capacity = capacity
        self._where: OrderedDict[int, set[str]] = OrderedDict()

    def record(self, prefix: tuple[int, ...], replica: str) -> None:
        for h in prefix:
            self._where.setdefault(h, set()).add(replica)
            self._where.move_to_end(h)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def match(self, prefix: tuple[int, ...], replica: str) -> int:
        """How many leading blocks of `prefix` were sent to `replica`."""
        n = 0
        for h in prefix:
            if replica not in self._where.get(h, ()):
                break
            n += 1
        return n


def room(view: ReplicaView, holds: Holds) -> tuple[int, int]:
    """(blocks, rows) the replica can still hand out, net of what the ingress sent it since."""
    blocks, rows = holds.held(view)
    return view.blocks_available - blocks, view.max_seqs - view.running - rows


def fits_now(view: ReplicaView, demand: Demand, holds: Holds, shared: int = 0) -> bool:
    """`shared`: prompt blocks the replica's prefix cache likely holds (they need no new block)."""
    if not view.healthy:
        return False
    blocks, rows = room(view, holds)
    return blocks >= demand.blocks - shared and rows >= demand.rows


def rank_now(
    views: Iterable[ReplicaView], demand: Demand, holds: Holds, affinity: Affinity | None = None
) -> list[str]:
    """Replicas that can admit `demand` now, best first (longest shared prefix, most blocks left).
    A prefix last sent to a replica counts as cached there: an estimate the replica's engine checks."""
    scored = []
    for v in views:
        shared = affinity.match(demand.prefix, v.replica) if affinity is not None else 0
        if fits_now(v, demand, holds, shared):
            blocks, rows = room(v, holds)
            scored.append((-shared, -(blocks - demand.blocks + shared), -rows, v.replica))
    return [s[-1] for s in sorted(scored)]


def admit_bound(view: ReplicaView) -> float:
    """How long a replica gives a `wait=False` request to be admitted: the step in flight and the
    next tick, with margin (`KvgateReplica.generate` refuses it past that)."""
    return max(0.25, 3 * (view.step_time or 0.05))


def rank_soon(
    views: Iterable[ReplicaView], demand: Demand, holds: Holds, affinity: Affinity | None = None
) -> list[str]:
    """Replicas that cannot admit `demand` now but will within their own admission bound (a row or
    the blocks it needs free at their next steps), soonest first. Only asked when no replica fits
    now: the view is older than the moment the request reaches the engine, and the replica's
    engine, not this estimate, decides (it admits at its next tick or refuses)."""
    scored = []
    for v in views:
        shared = affinity.match(demand.prefix, v.replica) if affinity is not None else 0
        t = time_to_fit(v, demand, holds, shared)
        if t <= admit_bound(v):
            scored.append((t, v.replica))
    return [tag for _, tag in sorted(scored)]


def time_to_fit(view: ReplicaView, demand: Demand, holds: Holds, shared: int = 0) -> float:
    """Seconds until `demand` fits this replica if nothing else is started there: its running rows
    are walked by steps left (each frees its blocks and row when it ends), as the engine's own TTFT
    forecast does, at its typical decode tick growing with the rows' contexts (not the step-time EMA,
    which prompt chunks pull up). 0 when it fits now; infinite when even an empty replica would not
    hold it."""
    if not view.healthy or view.blocks_total < demand.blocks or view.max_seqs < demand.rows:
        return float("inf")
    need = demand.blocks - shared
    blocks, rows = room(view, holds)
    if blocks >= need and rows >= demand.rows:
        return 0.0
    step = view.decode_step or view.step_time or 0.05
    ending = sorted((r.steps_left, r.blocks) for r in (view.snapshot.rows if view.snapshot else ()))
    for steps, freed in ending:
        blocks, rows = blocks + freed, rows + 1
        if blocks >= need and rows >= demand.rows:
            return decode_seconds(view.snapshot, step, steps + 1)
    return float("inf")


def min_retry_after(views: Iterable[ReplicaView], default: int = 1) -> int:
    values = [v.retry_after for v in views if v.healthy]
    return min(values) if values else default
