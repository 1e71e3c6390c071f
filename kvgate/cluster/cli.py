"""`kvgate cluster`: start N replicas and the ingress on Ray Serve, on a local Ray or an existing cluster.

    kvgate cluster --replicas 2 --model default --memory-limit 2GiB --replica-cpus 1
    kvgate cluster --address ray://head:10001 --replicas 8 --replica-gpus 1 --memory-limit 0.9

Without `--address`, a local Ray instance is started for this command (no dashboard, no usage
stats, `--num-cpus` logical CPUs) and stopped when it ends. The OpenAI API is served by Serve's HTTP
proxy at `--host:--port`. Binding a non-loopback address needs `--api-key` (or
`--allow-unauthenticated`), exactly as `kvgate serve`. Ctrl-C or SIGTERM drains as `kvgate serve` does
(new requests 503, those running get `--shutdown-grace` seconds, then end as finish_reason length with
their usage), deletes the application and exits 0. `--log-level` is the ingress's and replicas' log.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
import sys
import threading
import time

from kvgate.cluster.app import APP_NAME, ROUTERS, ClusterOptions
from kvgate.config import add_engine_flags, engine_config
from kvgate.flag_types import PORT, at_least, byte_size, more_than
from kvgate.server.cors import add_cors_flag, cors_origins
from kvgate.server.generation_defaults import add_generation_config_flag
from kvgate.server.reasoning import add_reasoning_flag
from kvgate.server.request_log import add_request_log_flags


def add_cluster_parser(subparsers) -> argparse.ArgumentParser:
    c = subparsers.add_parser("cluster", help="serve the OpenAI API from N replicas on Ray Serve")
    add_engine_flags(c)
    c.add_argument("--replicas", type=at_least(int, 1), default=os.environ.get("KVGATE_REPLICAS", "2"))
    c.add_argument("--address", default=os.environ.get("RAY_ADDRESS"), help="an existing Ray cluster")
    c.add_argument(
        "--num-cpus",
        type=at_least(int, 1),
        default=None,
        help="CPUs of the local Ray instance (default: all)",
    )
    c.add_argument(
        "--replica-cpus", type=at_least(float, 0), default=1.0, help="Ray CPUs each replica reserves"
    )
    c.add_argument(
        "--replica-gpus", type=at_least(float, 0), default=0.0, help="Ray GPUs each replica reserves"
    )
    c.add_argument("--router", choices=ROUTERS, default="kvgate", help="pow2 = Serve's default router")
    c.add_argument(
        "--stats-period", type=more_than(float, 0), default=0.5, help="seconds between replica stats polls"
    )
    c.add_argument(
        "--health-period", type=more_than(float, 0), default=2.0, help="seconds between replica health checks"
    )
    c.add_argument("--host", default=os.environ.get("KVGATE_HOST", "127.0.0.1"))
    c.add_argument("--port", type=PORT, default=os.environ.get("KVGATE_PORT", "8000"))
    c.add_argument("--api-key", default=os.environ.get("KVGATE_API_KEY"))
    c.add_argument("--allow-unauthenticated", action="store_true")
    c.add_argument("--served-model-name", default=None)
    c.add_argument("--max-body-bytes", type=at_least(int, 1), default=4 << 20)
    c.add_argument(
        "--shutdown-grace",
        type=at_least(float, 0),
        default=30.0,
        help="on SIGTERM/SIGINT: seconds the requests in flight get to finish (new ones get 503); then "
        "those still running end as finish_reason length and the cluster stops",
    )
    c.add_argument(
        "--log-level",
        type=str.lower,
        choices=("critical", "error", "warning", "info", "debug"),
        default="info",
        help="the ingress's and the replicas' kvgate log (info: a line per refusal, by X-Request-Id)",
    )
    c.add_argument(
        "--responses-store",
        type=byte_size,
        default=os.environ.get("KVGATE_RESPONSES_STORE", "64MiB"),
        help="memory for responses kept for previous_response_id, in the ingress (outside every replica's "
        "memory plan), least recently used out first (0: keep none) [KVGATE_RESPONSES_STORE]",
    )
    add_cors_flag(c)
    add_reasoning_flag(c)
    add_generation_config_flag(c)
    add_request_log_flags(c)
    return c


def options_from(args) -> ClusterOptions:
    cfg = engine_config(args)
    return ClusterOptions(
        model=args.model,
        replicas=args.replicas,
        # the replicas keep no responses (the ingress does, `responses_store`): none in their plans
        engine={k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("extra", "responses_store")},
        replica_cpus=args.replica_cpus,
        replica_gpus=args.replica_gpus,
        router=args.router,
        stats_period=args.stats_period,
        health_period=args.health_period,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        responses_store=args.responses_store,
        cors_origins=cors_origins(args),
        reasoning_parser=args.reasoning_parser,
        generation_config=args.generation_config,
        log_requests=args.log_requests,
        max_log_len=args.max_log_len,
        log_level=args.log_level,
    )


def bind_error(args) -> str | None:
    """Why these flags must not start a cluster (the same rule as `kvgate serve`), or None."""
    from kvgate.server.run import is_loopback

    if not is_loopback(args.host) and not args.api_key and not args.allow_unauthenticated:
        return (
            f"refusing to bind {args.host} (not a loopback address) without --api-key. Set --api-key KEY "
            "(or KVGATE_API_KEY), or pass --allow-unauthenticated if this network is trusted."
        )
    return None


def run_cluster(args) -> int:
    why = bind_error(args)
    if why is not None:
        print(f"kvgate: error: {why}", file=sys.stderr)
        return 2
    if args.memory_limit == "auto" and args.replica_gpus == 0 and args.replicas > 1 and not args.address:
        print(
            f"kvgate: warning: --memory-limit auto gives each of the {args.replicas} replicas a quarter of this "
            "machine's RAM; set --memory-limit so their sum fits.",
            file=sys.stderr,
        )
    try:
        import ray  # noqa: F401
    except ImportError:
        print("kvgate: error: `kvgate cluster` needs Ray Serve: pip install 'kvgate[ray]'", file=sys.stderr)
        return 2
    opts = options_from(args)
    try:
        seconds = launch(opts, args.host, args.port, address=args.address, num_cpus=args.num_cpus)
    except Exception as exc:  # Serve's "Deploying application kvgate failed": say the replica's reason
        why = replica_error(exc)
        shutdown(local=not args.address)
        print(
            f"kvgate: error: the cluster did not start: {why}", file=sys.stderr, flush=True
        )  # the last line
        return 1
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(
        f"kvgate: cluster ready in {seconds:.1f}s: {opts.replicas} replicas, router {opts.router}, API "
        f"http://{host}:{args.port}/v1 (health: /health)",
        file=sys.stderr,
        flush=True,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    print(
        f"kvgate: draining: new requests get 503 shutting_down; up to {args.shutdown_grace:g}s for those in flight",
        file=sys.stderr,
        flush=True,
    )
    left = drain(args.shutdown_grace)
    print(
        f"kvgate: stopping the cluster application ({left} requests still in flight)",
        file=sys.stderr,
        flush=True,
    )
    shutdown(local=not args.address)
    return 0


def drain(grace: float):
    """Have the ingress drain the cluster as `kvgate serve` drains on a signal (`KvgateIngress.drain`):
    new requests get 503, those in flight get up to `grace` seconds, then the replicas end the ones
    still running as finish_reason length with their usage (QA pass 7's F7: the cluster cut its streams
    with engine_error and answered Serve's plain-text 404; a later QA: past the grace, the application's
    delete still cut them so). Returns how many were left, or "?" when the ingress could not be asked."""
    from ray import serve

    try:
        return serve.get_app_handle(APP_NAME).drain.remote(grace).result(timeout_s=grace + 30)["left"]
    except Exception as exc:  # Serve already going down: stop anyway
        print(f"kvgate: warning: the ingress did not drain ({type(exc).__name__}: {exc})", file=sys.stderr)
        return "?"


KVGATE_ERRORS = r"(?:PlanError|DeviceError|ModelLoadError|ConfigError): ([^\n]+)"


def replica_error(exc: BaseException) -> str:
    """The reason a replica gave for not starting (kvgate's own error, found in Serve's deployment
    messages), else the exception's first line. Serve reported a too-small --memory-limit as a bare
    "Deploying application kvgate failed" traceback, the replica's PlanError buried in its controller's
    log (QA pass 7's F6)."""
    texts = [str(exc)]
    try:
        from ray import serve

        for app in serve.status().applications.values():
            texts += [app.message or ""] + [d.message or "" for d in app.deployments.values()]
    except Exception:  # Serve already gone: the exception's own text is all there is
        pass
    for text in texts:
        found = re.search(KVGATE_ERRORS, text)
        if found:
            return found.group(1).strip()
    first = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {first[0] if first else ''} (the replicas' log above says more)"


def launch(
    opts: ClusterOptions,
    host: str,
    port: int,
    address: str | None = None,
    num_cpus: int | None = None,
    quiet: bool = False,
) -> float:
    """Connect to (or start) Ray, start Serve's proxy on host:port, deploy the application and wait
    until every replica is ready. Returns the seconds it took. `quiet`: keep the workers' logs in
    Ray's log directory instead of this terminal."""
    import ray
    from ray import serve

    from kvgate.cluster.app import build

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    t0 = time.monotonic()
    if address:
        ray.init(address=address)
    else:
        ray.init(
            num_cpus=num_cpus, include_dashboard=False, log_to_driver=not quiet, configure_logging=not quiet
        )
    serve.start(http_options={"host": host, "port": port})
    serve.run(build(opts), name=APP_NAME, route_prefix="/", blocking=False)
    return time.monotonic() - t0


def shutdown(local: bool = True) -> None:
    """Delete the application; with `local`, stop Serve and the Ray instance `launch` started too."""
    import ray
    from ray import serve

    serve.delete(APP_NAME)
    if local:
        serve.shutdown()
        ray.shutdown()
