"""`kvgate serve`: bind safely, answer /health while the model loads, shut down gracefully.

On SIGTERM or Ctrl-C: stop admitting (new requests get 503 + Retry-After), let running requests
finish for up to `--shutdown-grace` seconds, cancel what is left (clients get their partial output),
then exit 0.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import sys
import threading
import time

import uvicorn

from kvgate.memory.overhead import load_peak_warning
from kvgate.server import request_log
from kvgate.server.app import ServerSettings, create_app
from kvgate.server.auth import FLUSH_SECONDS
from kvgate.server.cors import cors_origins
from kvgate.server.slow_clients import guarded_http_protocol

log = logging.getLogger("kvgate.serve")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
        except OSError:
            return False


def served_name(model: str, override: str | None) -> str:
    if override:
        return override
    if model == "default":
        return "SmolLM2-135M-Instruct"
    from pathlib import Path

    p = Path(model)
    return p.stem if p.suffix else p.name


def port_taken(host: str, port: int) -> str | None:
    """Why `host:port` cannot be bound now, or None. Checked before the model loads: a second server on
    a busy port printed "serving on" and then died on uvicorn's raw bind error (QA pass 7)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind((host, port))
        except OSError as exc:
            return (
                f"cannot listen on {host}:{port} ({exc.strerror or exc}): another process holds the port "
                f"(`ss -ltnp 'sport = :{port}'` names it). Stop it, or pass another --port."
            )
    return None


class GracefulServer(uvicorn.Server):
    def __init__(self, config, app, grace: float):
        super().__init__(config)
        self.kv_app = app
        self.grace = grace
        self._draining = False

    def handle_exit(self, sig, frame) -> None:
        if self._draining:  # a second signal: stop now
            return super().handle_exit(sig, frame)
        self._draining = True
        self.kv_app.state.status = "shutting_down"
        threading.Thread(target=self._drain, name="kvgate-drain", daemon=True).start()

    def _drain(self) -> None:
        engine = self.kv_app.state.engine
        log.info("shutting down: no new requests; waiting up to %.0fs for running ones", self.grace)
        if engine is not None:
            engine.shutdown(self.grace)
        time.sleep(0.2)  # let the final SSE events and responses flush
        self.should_exit = True


def serve(args) -> int:
    from kvgate.config import engine_config
    from kvgate.core.calibrate import calibrate_prefill
    from kvgate.core.engine import Engine
    from kvgate.server import generation_defaults

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    request_log.enable(args.log_requests)
    if not is_loopback(args.host) and not args.api_key and not args.allow_unauthenticated:
        print(
            f"kvgate: error: refusing to bind {args.host} (not a loopback address) without --api-key. Set "
            "--api-key KEY (or KVGATE_API_KEY), or pass --allow-unauthenticated if this network is trusted.",
            file=sys.stderr,
        )
        return 2
    busy = port_taken(args.host, args.port)
    if busy:
        print(f"kvgate: error: {busy}", file=sys.stderr)
        return 2
    cfg = engine_config(args)
    settings = ServerSettings(
        model_name=served_name(args.model, args.served_model_name),
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        cors_origins=cors_origins(args),
        reasoning_parser=args.reasoning_parser,
        generation_config=args.generation_config,
        log_requests=args.log_requests,
        max_log_len=args.max_log_len,
        responses_store_bytes=0,  # the plan's (--responses-store), once the engine has one
    )
    app = create_app(settings)
    servers: list = []  # the uvicorn server, once made (a failed load stops it)
    stop_when_up = threading.Event()

    def load():
        try:
            engine = Engine.from_model(args.model, cfg)
            app.state.load_peak_bytes = engine.plan.load_peak_bytes  # where `kvgate plan` reads its own
            print(engine.plan.describe(1024), file=sys.stderr, flush=True)
            warn = load_peak_warning(app.state.load_peak_bytes, engine.plan.limit_bytes, str(engine.device))
            if warn:
                log.warning(warn)
            for note in (engine.prefetch_note, generation_defaults.announce(engine, settings)):
                if note:
                    print(f"  {note}", file=sys.stderr, flush=True)
            engine.start()
            if cfg.max_ttft is not None:  # the TTFT budget's rates, before the first request
                print(f"  {calibrate_prefill(engine)}", file=sys.stderr, flush=True)
            app.state.responses.limit = engine.plan.responses_bytes  # a term of the plan on CPU
            app.state.engine = engine
            app.state.status = "ready"
            host = f"[{args.host}]" if ":" in args.host else args.host
            print(
                f"kvgate: ready: {settings.model_name} on {engine.info.device} ({engine.info.dtype}), loaded in "
                f"{engine.info.load_seconds:.1f}s; console http://{host}:{args.port}/ , API "
                f"http://{host}:{args.port}/v1",
                file=sys.stderr,
                flush=True,
            )
        except Exception as exc:  # said on /health and in the log, then the process exits 1
            app.state.load_error = str(exc)
            log.error("model failed to load: %s", exc)
            print(f"kvgate: error: the model failed to load: {exc}", file=sys.stderr, flush=True)
            # as vLLM and llama-server do: a server that can never serve must not look alive to a
            # supervisor (session 31's QA found ten bad settings each leaving a process up for good)
            stop_when_up.set()
            if servers:
                servers[0].should_exit = True

    # `kvgate plan` (kvgate.cli.as_served) repeats this start-up (app, loading thread, uvicorn's loop) to
    # measure the runtime overhead this process will have: change the two together
    threading.Thread(target=load, name="kvgate-load", daemon=True).start()
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_keep_alive=30,
        # a request head must arrive within 30 s and a body not stall 30 s (408): uvicorn's own
        # timeout is only between requests, so a slowloris held every connection it opened
        http=guarded_http_protocol(),
        # after the drain, connections get this long to take their last bytes: a client that stopped
        # reading a stream (its socket buffers full) held the exit forever (QA pass 9)
        timeout_graceful_shutdown=FLUSH_SECONDS,
    )
    server = GracefulServer(config, app, args.shutdown_grace)
    servers.append(server)
    if stop_when_up.is_set():  # the load failed before the server existed
        server.should_exit = True
    else:  # not "serving on": a load that fails next printed that line before its error (QA, session 43)
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(
            f"kvgate: starting on http://{host}:{args.port}/v1 while the model loads (/health says when it "
            "is ready)",
            file=sys.stderr,
            flush=True,
        )
    server.run()
    return 0 if app.state.load_error is None else 1
