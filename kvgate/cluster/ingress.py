"""The ingress deployment: `kvgate serve`'s HTTP app in front of N replicas, plus what a cluster adds.

The app is `kvgate.server.app.create_app` itself, given a `ClusterEngine` instead of an engine, so
every route, error body, SSE stream and metric means what it means under `kvgate serve`. A cluster
changes three things:
- `GET /health` says how many replicas are ready: 200 `{"status": "ok", "replicas_ready": k,
  "replicas": n}` while k >= 1, else 503 with the reason and `Retry-After`.
- `GET /v1/resources` adds `"replicas"`: each one's blocks, rows, queue and Retry-After.
- Every generation response carries `X-KVGate-Replica: <tag>`, the Serve replica that served it,
  and `/metrics` adds `kvgate_cluster_*` series (replicas ready, requests waiting at the ingress,
  per-replica blocks and queue, route attempts by outcome). The `kvgate_*` engine series are the sums
  over ready replicas; under kvgate's router their `kvgate_requests_waiting` stays 0, since requests
  wait at the ingress (`kvgate_cluster_requests_waiting`), not inside a replica.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from ray import serve

from kvgate.cluster.facade import ClusterEngine
from kvgate.cluster.logs import configure as configure_logging
from kvgate.cluster.remote import SERVED_BY
from kvgate.cluster.views import published
from kvgate.server import request_log, routes
from kvgate.server.app import create_app
from kvgate.server.auth import FLUSH_SECONDS
from kvgate.server.context import ServerSettings


class ServedBy:
    """Pure ASGI middleware: adds `X-KVGate-Replica` once a request's replica is known."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        holder: dict = {}
        token = SERVED_BY.set(holder)

        async def send_tagged(message):
            if message["type"] == "http.response.start" and holder.get("replica"):
                headers = [*message.get("headers", []), (b"x-kvgate-replica", holder["replica"].encode())]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_tagged)
        finally:
            SERVED_BY.reset(token)


async def cluster_health(request: Request):
    state = request.app.state
    if state.status == "shutting_down":
        return JSONResponse({"status": "shutting_down"}, status_code=503, headers={"Retry-After": "5"})
    cluster: ClusterEngine = state.engine
    ready, listed = cluster.readiness()
    target = max(listed, getattr(cluster, "target", 0))  # --replicas, or what Serve lists past it
    status = "unavailable" if not ready else "degraded" if ready < target else "ok"  # degraded still serves
    body = {"status": status, "replicas_ready": ready, "replicas": target}
    if not ready:
        body["reason"] = cluster.stalled()
        return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})
    return body


async def cluster_resources(request: Request):
    """The single server's body with the cluster's totals (KV, rows, ledger: every ready replica
    added up) and each replica's own figures under `replicas`. `plan` is the plan every replica runs,
    said so in `plan.scope`; the scheduler's `max_seqs` is the cluster's rows (a console showed
    "running 0 / 4" for 8 rows on two replicas, session 30's QA), with one replica's beside it."""
    body = await routes.resources(request)
    ready = request.app.state.engine.dispatcher.ready_views()
    sched = body["scheduler"]
    sched["max_seqs_per_replica"] = sched["max_seqs"]
    sched["max_seqs"] = sum(v.max_seqs for v in ready)
    body["plan"]["scope"] = f"each replica ({len(ready)} ready) runs this plan; kv and ledger are their sums"
    body["replicas"] = [
        {
            "replica": v.replica,
            "healthy": v.healthy,
            "kv_blocks_total": v.blocks_total,
            "kv_blocks_available": v.blocks_available,
            "running": v.running,
            "waiting": v.waiting,
            "retry_after": v.retry_after,
            "step_seconds_ema": v.step_time,
        }
        for v in request.app.state.engine.dispatcher.known_views()
    ]
    return body


class ClusterCollector:
    """`kvgate_cluster_*`: what one engine cannot report, read from the ingress's views at scrape."""

    def __init__(self, cluster: ClusterEngine):
        self.cluster = cluster

    def collect(self):
        d = self.cluster.dispatcher
        views = d.known_views()
        g = GaugeMetricFamily("kvgate_cluster_replicas_ready", "Replicas that can take requests")
        g.add_metric([], sum(1 for v in views if v.healthy))
        yield g
        q = GaugeMetricFamily(
            "kvgate_cluster_requests_waiting", "Requests waiting at the ingress for a replica with room"
        )
        q.add_metric([], len(d.waiting))
        yield q
        per = {
            "kv_blocks_available": ("Blocks the replica can hand out now", lambda v: v.blocks_available),
            "requests_running": ("Rows running on the replica", lambda v: v.running),
            "requests_waiting": ("Requests in the replica's FIFO", lambda v: v.waiting),
            "retry_after_seconds": ("The replica's current Retry-After estimate", lambda v: v.retry_after),
        }
        for name, (doc, value) in per.items():
            m = GaugeMetricFamily(f"kvgate_cluster_replica_{name}", doc, labels=["replica"])
            for v in views:
                m.add_metric([v.replica], value(v))
            yield m
        c = CounterMetricFamily(
            "kvgate_cluster_route_attempts",
            "Replica attempts by outcome, and cluster-wide answers",
            labels=["outcome"],
        )
        for outcome, n in vars(d.counts).items():
            c.add_metric([outcome], n)
        yield c


def _replace_route(app: FastAPI, path: str, endpoint) -> None:
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) != path]
    app.add_api_route(path, endpoint, methods=["GET"])


def build_ingress_app(cluster: ClusterEngine, settings: ServerSettings) -> FastAPI:
    app = create_app(settings, cluster)
    _replace_route(app, "/health", cluster_health)
    _replace_route(app, "/v1/resources", cluster_resources)
    app.state.metrics.registry.register(ClusterCollector(cluster))
    app.add_middleware(ServedBy)
    return app


@serve.ingress()
class KvgateIngress:
    """Serve deployment: one (or more) per cluster; each routes over every replica."""

    def __init__(
        self,
        replicas,
        settings: dict,
        policy: str = "kvgate",
        health_period: float = 2.0,
        target: int = 0,
        log_level: str = "info",
    ):
        configure_logging(log_level)  # refusals and failures logged at INFO, as under `kvgate serve`
        request_log.enable(bool(settings.get("log_requests")))  # --log-requests: whatever the level
        self.settings = dict(settings)
        key = (replicas.app_name, replicas.deployment_name)
        self.cluster = ClusterEngine(replicas, lambda: published(*key), policy, health_period)
        self.cluster.target = target  # --replicas: /health says when fewer are ready

    async def __serve_build_asgi_app__(self) -> FastAPI:
        await self.cluster.connect()
        s = dict(self.settings)
        s["model_name"] = s.get("model_name") or self.cluster.model_name
        s["request_id_header"] = False  # Serve's proxy sets X-Request-Id (QA pass 7: it came twice)
        self.kvgate_app = build_ingress_app(self.cluster, ServerSettings(**s))
        return self.kvgate_app

    async def drain(self, grace: float) -> dict:
        """SIGTERM under `kvgate cluster`, before it deletes the application, as `kvgate serve` does on
        a signal: new requests get 503 shutting_down with Retry-After (/health too), and so do those
        waiting at the ingress; each replica's running rows get `grace` seconds, then end as `length`
        with their partial output and usage (`ClusterEngine.drain`); their last events then get up to
        FLUSH_SECONDS to reach the clients. Returns how many API requests were still in flight."""
        state = self.kvgate_app.state
        state.status = "shutting_down"
        await self.cluster.drain(grace)
        deadline = time.monotonic() + FLUSH_SECONDS
        while getattr(state, "in_flight", 0) > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return {"left": getattr(state, "in_flight", 0)}
