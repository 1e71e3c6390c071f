"""The Ray Serve application: N `KvgateReplica`s and one `KvgateIngress`, from one set of options.

`build(ClusterOptions)` returns the bound application for `serve.run` (what `kvgate cluster` does);
`build_app(args)` is the same as a Serve *application builder*, so a Serve config file (for
`serve run` / `serve deploy`, or KubeRay's RayService `serveConfigV2`) can name it:

    applications:
      - name: kvgate
        route_prefix: /
        import_path: kvgate.cluster.app:build_app
        args: {model: default, replicas: 2, replica_cpus: 2, engine: {memory_limit: 4GiB}}

Resources: each replica reserves `replica_cpus` CPUs and `replica_gpus` GPUs as Ray resources, and,
when the memory limit is a byte size, that much Ray `memory` too, so Ray never places more replicas on
a node than their declared limits fit. The engine's torch threads default to the replica's CPUs.

Serve settings kvgate relies on:
- `max_ongoing_requests` of a replica = its rows + its queue (+ slack): Serve's default of 5 would
  park requests in Serve's own invisible queue instead of kvgate's bounded, truthful one.
- the replicas' request router is `KvgateRouter` (`router="kvgate"`) or Serve's default
  power-of-two-choices (`router="pow2"`, for comparison), with routing stats every `stats_period` s.
- `health_check_period_s` = `health_period`: a replica whose engine died or stalled fails its check
  and Serve replaces it; the ingress also skips a replica for one period after a call finds it gone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvgate.cluster.logs import level_of
from kvgate.config import EngineConfig
from kvgate.units import parse_bytes

ROUTERS = ("kvgate", "pow2")
APP_NAME = "kvgate"


@dataclass
class ClusterOptions:
    model: str = "default"
    replicas: int = 2
    engine: dict = field(default_factory=dict)  # EngineConfig fields, e.g. {"memory_limit": "4GiB"}
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    ingress_cpus: float = 0.5
    router: str = "kvgate"  # kvgate | pow2 (Serve's default, for comparison)
    stats_period: float = 0.5  # seconds between Serve's polls of each replica's routing stats
    health_period: float = 2.0  # seconds between Serve's health checks of each replica
    served_model_name: str | None = None
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    # the ingress's kept responses (the Responses API's store: in the ingress, outside every replica's
    # plan, since the ingress has none) and the browser origins it allows (`--cors-origins`)
    responses_store: int = 64 << 20
    cors_origins: list[str] | None = None
    reasoning_parser: str = "auto"  # the ingress's --reasoning-parser (kvgate.server.reasoning)
    generation_config: str = "auto"  # the ingress's --generation-config (kvgate.server.generation_defaults)
    log_requests: bool = False  # the ingress's --log-requests and --max-log-len (kvgate.server.request_log)
    max_log_len: int | None = None
    step_delay: float = 0.0  # test-only: sleep before every forward pass of every replica
    log_level: str = "info"  # the ingress's and the replicas' kvgate loggers (`kvgate.cluster.logs`)

    def __post_init__(self):
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, not {self.router!r}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, not {self.replicas}")
        level_of(self.log_level)  # a bad level is an error here, not in every Ray worker
        unknown = set(self.engine) - {f.name for f in dataclasses.fields(EngineConfig)}
        if unknown:
            raise ValueError(f"unknown engine option(s) {sorted(unknown)}; see `kvgate serve --help`")
        if self.engine.get("responses_store"):  # a replica would plan memory it never uses
            raise ValueError("responses_store is the ingress's option (next to engine), not a replica's")

    def engine_config(self) -> EngineConfig:
        cfg = EngineConfig(**self.engine)
        if cfg.threads is None:
            cfg.threads = max(1, int(self.replica_cpus))
        return cfg

    def server_settings(self) -> dict:
        """The ingress's `ServerSettings` fields (the model name is the replicas' when not given)."""
        from kvgate.server.run import served_name

        return {
            "model_name": served_name(self.model, self.served_model_name),
            "api_key": self.api_key,
            "max_body_bytes": self.max_body_bytes,
            "responses_store_bytes": self.responses_store,
            "cors_origins": self.cors_origins,
            "reasoning_parser": self.reasoning_parser,
            "generation_config": self.generation_config,
            "log_requests": self.log_requests,
            "max_log_len": self.max_log_len,
        }

    def actor_options(self) -> dict:
        opts = {"num_cpus": self.replica_cpus, "num_gpus": self.replica_gpus}
        limit = str(self.engine.get("memory_limit", "auto"))
        if limit != "auto" and not _is_fraction(limit):
            opts["memory"] = parse_bytes(limit)
        return opts


def _is_fraction(text: str) -> bool:
    try:
        return 0 < float(text) <= 1
    except ValueError:
        return False


def build(opts: ClusterOptions):
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from kvgate.cluster.ingress import KvgateIngress
    from kvgate.cluster.replica import KvgateReplica
    from kvgate.cluster.router import DefaultRouter, KvgateRouter

    cfg = opts.engine_config()
    router = KvgateRouter if opts.router == "kvgate" else DefaultRouter
    replica = serve.deployment(KvgateReplica, name="KvgateReplica").options(
        num_replicas=opts.replicas,
        ray_actor_options=opts.actor_options(),
        max_ongoing_requests=cfg.max_seqs + cfg.max_queue + 16,
        health_check_period_s=opts.health_period,
        health_check_timeout_s=max(10.0, 5 * opts.health_period),
        graceful_shutdown_timeout_s=5,
        logging_config={"log_level": opts.log_level.upper()},
        request_router_config=RequestRouterConfig(
            request_router_class=router,
            request_routing_stats_period_s=opts.stats_period,
            request_routing_stats_timeout_s=max(5.0, 10 * opts.stats_period),
        ),
    )
    settings = opts.server_settings()
    ingress = serve.deployment(KvgateIngress, name="KvgateIngress").options(
        num_replicas=1,
        max_ongoing_requests=4096,
        ray_actor_options={"num_cpus": opts.ingress_cpus},
        logging_config={"log_level": opts.log_level.upper()},
    )
    engine = dataclasses.asdict(cfg)
    replicas = replica.bind(opts.model, engine, opts.step_delay, opts.log_level)
    return ingress.bind(replicas, settings, opts.router, opts.health_period, opts.replicas, opts.log_level)


def build_app(args: dict):
    """Serve's application-builder entry point (`import_path: kvgate.cluster.app:build_app`)."""
    return build(ClusterOptions(**args))
