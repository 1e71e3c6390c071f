"""Serve request routers for kvgate replicas: Serve dispatches, kvgate's admission facts decide where.

Serve gives every deployment handle a request router: it keeps the set of running replicas (removing
one the moment a call finds its actor dead), delivers each replica's `record_routing_stats()` to it
(polled by Serve's controller every `request_routing_stats_period_s`), and sends the call. kvgate
plugs into that, not around it:

- `KvgateRouter` honours the ingress's decision. The ingress ranks replicas from their views
  (`kvgate.cluster.routing`) and passes the one it chose as `route={"target": tag}`; the router
  returns that replica (the ingress's drain at SIGTERM names each replica in turn, under either
  router). A call with no target (the ingress's `describe()` at startup) or whose target
  is gone goes to the replica with the most blocks available, so no call is ever parked in Serve's
  retry loop waiting for a replica that left.
- `DefaultRouter` is Serve's own `PowerOfTwoChoicesRequestRouter`, unchanged in how it chooses (two
  random replicas, the one with fewer requests in flight). It exists so the benchmark can compare
  the two with everything else equal.

Both publish, after every membership or stats update, an immutable map of tag -> `ReplicaView`
into `views.PUBLISHED`, keyed by (app, deployment), where the ingress in the same process reads it.
The router runs on Serve's router event loop, the ingress on its own: a published map is replaced,
never mutated, so a reader holds a consistent picture without a lock.

NOTE: Serve pickles a router's module *by value* into every process that routes, so a global defined
here would be a private copy per unpickling; the registry lives in `views` (pickled by reference)
and is reached as `views.PUBLISHED`, never imported by name.
"""

from __future__ import annotations

import logging

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from kvgate.cluster import views

log = logging.getLogger("kvgate.cluster")


class _Publishing:
    """Publishes the router's replica set with each replica's latest kvgate view."""

    def _key(self) -> tuple[str, str]:
        return (self.app_name, self._deployment_id.name)

    def _publish(self, replicas: list[RunningReplica]) -> None:
        views.PUBLISHED[self._key()] = {r.replica_id.unique_id: _view(r) for r in replicas}

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._publish(replicas)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self._publish(list(self.curr_replicas.values()))


def _view(replica: RunningReplica) -> views.ReplicaView | None:
    stats = replica.routing_stats or {}
    view = stats.get("kvgate")
    return view if isinstance(view, views.ReplicaView) else None


def _targeted(candidates: list[RunningReplica], pending: PendingRequest | None) -> list | None:
    """[[the replica]] when the call names one (`route={"target": tag}`) that is a candidate, else None."""
    route = (pending.kwargs.get("route") if pending is not None else None) or {}
    target = route.get("target")
    for r in candidates if target is not None else ():
        if r.replica_id.unique_id == target:
            return [[r]]
    return None


class KvgateRouter(_Publishing, RequestRouter):
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        chosen = _targeted(candidate_replicas, pending_request)
        if chosen is not None:
            return chosen

        # no target, or it left: most blocks first (unknown stats last), one replica per rank so
        # Serve tries them in this order rather than by its own queue lengths
        def room(r: RunningReplica) -> int:
            v = _view(r)
            return -1 if v is None else v.blocks_available

        return [[r] for r in sorted(candidate_replicas, key=room, reverse=True)]


class DefaultRouter(_Publishing, PowerOfTwoChoicesRequestRouter):
    """Serve's default power-of-two-choices router, which also publishes the replicas' views. A call
    that names its replica goes there: only the ingress's drain does (`ClusterEngine.drain`, once per
    replica at SIGTERM); no generation call names one under this router."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        chosen = _targeted(candidate_replicas, pending_request)
        if chosen is not None:
            return chosen
        return await super().choose_replicas(candidate_replicas, pending_request)
