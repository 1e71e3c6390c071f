"""`kvgate serve | generate | plan | bench | cluster`. Every engine knob is a flag and a KVGATE_* variable."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from kvgate.config import add_engine_flags, add_responses_store_flag, engine_config
from kvgate.flag_types import PORT, at_least
from kvgate.server.cors import add_cors_flag
from kvgate.server.generation_defaults import add_generation_config_flag
from kvgate.server.reasoning import add_reasoning_flag
from kvgate.server.request_log import add_request_log_flags


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-tokens", type=at_least(int, 1), default=None, help="default: up to the remaining context"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the CLI's default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvgate", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt with timing stats")
    add_engine_flags(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt with the model's chat template")
    g.add_argument("--system", default=None, help="system message (implies --chat)")
    g.add_argument("--stream", action="store_true", help="print text as it is generated")
    g.add_argument("--stats-json", default=None, help="write stats as JSON to PATH or - (stdout)")
    g.add_argument("--no-stats", action="store_true")
    add_sampling_flags(g)

    pl = sub.add_parser("plan", help="print the memory plan for a model and a limit")
    add_engine_flags(pl)
    add_responses_store_flag(pl)
    pl.add_argument(
        "--context", type=at_least(int, 1), default=None, help="tokens per request for 'max concurrent'"
    )
    pl.add_argument("--json", action="store_true")
    pl.add_argument(
        "--for",
        dest="plan_for",
        choices=("serve", "generate"),
        default="serve",
        help="the process whose runtime overhead is measured: serve (default: the HTTP server's modules, "
        "app and event loop loaded, as `kvgate serve` measures it) or generate (the one-shot CLI, smaller)",
    )

    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_flags(s)
    s.add_argument("--host", default=os.environ.get("KVGATE_HOST", "127.0.0.1"))
    s.add_argument("--port", type=PORT, default=os.environ.get("KVGATE_PORT", "8000"))
    s.add_argument("--api-key", default=os.environ.get("KVGATE_API_KEY"))
    s.add_argument(
        "--allow-unauthenticated", action="store_true", help="allow a non-loopback bind without a key"
    )
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--max-body-bytes", type=at_least(int, 1), default=4 << 20)
    s.add_argument("--shutdown-grace", type=at_least(float, 0), default=30.0)
    add_responses_store_flag(s)
    add_cors_flag(s)
    add_reasoning_flag(s)
    add_generation_config_flag(s)
    add_request_log_flags(s)
    s.add_argument("--log-level", default="info")

    t = sub.add_parser(
        "tokenizer", help="write the model's tokenizer as a Hugging Face directory (for benchmark clients)"
    )
    t.add_argument("--model", default=os.environ.get("KVGATE_MODEL", "default"), help="default | PATH")
    t.add_argument("--out", required=True, help="the directory to write (made if missing)")

    b = sub.add_parser("bench", help="drive an OpenAI-compatible endpoint and report latency/throughput")
    b.add_argument("bench_args", nargs=argparse.REMAINDER)

    from kvgate.cluster.cli import add_cluster_parser  # needs no Ray until `kvgate cluster` runs

    add_cluster_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # its own parser: argparse's REMAINDER would not take leading --flags
        from kvgate.bench import main as bench_main

        rest = argv[1:]
        return bench_main(rest[1:] if rest[:1] == ["--"] else rest)
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "generate":
            return cmd_generate(args)
        if args.cmd == "plan":
            return cmd_plan(args)
        if args.cmd == "serve":
            from kvgate.server.run import serve

            return serve(args)
        if args.cmd == "tokenizer":
            from kvgate.tokenizer_export import export_tokenizer

            for path in export_tokenizer(args.model, args.out):
                print(path)
            return 0
        if args.cmd == "cluster":
            from kvgate.cluster.cli import run_cluster

            return run_cluster(args)
        if args.cmd == "bench":
            from kvgate.bench import main as bench_main

            return bench_main(args.bench_args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        from kvgate.core.placement import DeviceError
        from kvgate.memory.plan import PlanError
        from kvgate.models import ModelLoadError
        from kvgate.request import Refusal, RequestError
        from kvgate.sampling import SamplingError

        if isinstance(
            exc,
            ModelLoadError | PlanError | DeviceError | SamplingError | RequestError | Refusal | ValueError,
        ):
            print(f"kvgate: error: {exc}", file=sys.stderr)
            return 2
        raise
    return 0


def cmd_plan(a) -> int:
    from kvgate.core.engine import Engine  # noqa: F401 -- serve and generate import it before they measure
    from kvgate.memory.overhead import load_peak_warning, overhead_drift
    from kvgate.units import fmt_bytes

    cfg, loaded = engine_config(a), {}

    def work():  # as Engine.from_model up to its plan, in its order: the heap's layout moves the overhead
        from kvgate.core.placement import plan_for
        from kvgate.models import load_model

        loaded["model"] = load_model(a.model)
        if cfg.threads:  # as Engine.__init__: the thread pool is part of the overhead
            import torch

            torch.set_num_threads(cfg.threads)
        loaded["plan"] = plan_for(loaded["model"], cfg, drift=True).plan

    as_served(work) if a.plan_for == "serve" else work()
    plan = loaded["plan"]
    peak = plan.load_peak_bytes  # read when the plan was made, as serve's
    if a.json:
        print(
            json.dumps(
                {
                    **plan.to_dict(a.context),
                    "planned_for": a.plan_for,
                    "overhead_drift_bytes": overhead_drift(plan.device),
                    "load_peak_rss_bytes": peak,
                },
                indent=1,
            )
        )
        return 0
    spec = loaded["model"].spec
    print(f"model {spec.name}: {spec.num_layers} layers, {spec.num_kv_heads} KV heads x {spec.head_dim}")
    print(plan.describe(a.context))
    print(
        "  planned for: `kvgate serve` (its runtime overhead measured with the HTTP server's modules, app and "
        "event loop loaded, as serve measures it; --for generate plans the one-shot CLI's, smaller)"
        if a.plan_for == "serve"
        else "  planned for: `kvgate generate` (no HTTP server; `kvgate serve` holds more, see --for serve)"
    )
    if peak is not None:
        print(
            f"  load peak       {fmt_bytes(peak):>12}  (resident, measured here while loading and placing the "
            "model, before any request; a server's is about the same)"
        )
        warn = load_peak_warning(peak, plan.limit_bytes, plan.device)
        if warn:
            print(f"  warning: {warn}")
    if overhead_drift(plan.device):
        print(
            f"  note: the runtime overhead above includes {fmt_bytes(overhead_drift(plan.device))} over this process's "
            "measurement: a server measures its own at startup, and it moves by a few MiB between processes, "
            "so a server with these flags should get at least this pool"
        )
    return 0


def as_served(work) -> None:
    """Run `work` (load the model and plan it) in this process brought to the state `kvgate serve`
    (`kvgate.server.run.serve`) measures its runtime overhead in: the server's modules imported, its app
    made, `work` on a loading thread while the main thread runs uvicorn's event loop and the app's
    lifespan -- the same modules, threads and order, only no socket is bound. Without them the plan's
    overhead came out ~18 MiB under serve's (fastapi, pydantic, uvicorn, uvloop, the second thread's heap),
    and `plan` promised ~35 more KV blocks than a server with the same flags got."""
    import asyncio
    import threading

    import uvicorn

    from kvgate.server.app import ServerSettings, create_app
    from kvgate.server.slow_clients import guarded_http_protocol

    app = create_app(ServerSettings())
    failed: list[BaseException] = []

    def load() -> None:
        try:
            work()
        except BaseException as exc:  # raised again on the main thread, for main()'s error handling
            failed.append(exc)

    loading = threading.Thread(target=load, name="kvgate-load", daemon=True)
    loading.start()  # as serve: the load starts before uvicorn's config and loop
    config = uvicorn.Config(app, log_level="warning", timeout_keep_alive=30, http=guarded_http_protocol())

    async def run() -> None:
        config.load()
        lifespan = config.lifespan_class(config)
        await lifespan.startup()
        while loading.is_alive():
            await asyncio.sleep(0.05)
        await lifespan.shutdown()

    with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
        runner.run(run())
    if failed:
        raise failed[0]


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _short(n: int) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else str(n)


def cmd_generate(a) -> int:
    from kvgate.core.engine import Engine
    from kvgate.request import Finished, GenerationRequest, Token
    from kvgate.sampling import SamplingParams

    engine = Engine.from_model(a.model, engine_config(a)).start()
    tok = engine.tokenizer
    if a.chat or a.system:
        msgs = ([{"role": "system", "content": a.system}] if a.system else []) + [
            {"role": "user", "content": a.prompt}
        ]
        ids = tok.chat_ids(msgs)
    else:
        ids = tok.encode(a.prompt)
    params = SamplingParams(
        a.temperature,
        a.top_p,
        a.top_k,
        a.min_p,
        a.repetition_penalty,
        a.presence_penalty,
        a.frequency_penalty,
        a.seed,
    )
    req = GenerationRequest(ids, params, a.max_tokens, a.stop, ignore_eos=a.ignore_eos)
    handle = engine.submit(req)
    handle.wait_admitted()
    result = None
    for ev in handle:
        if isinstance(ev, Token) and a.stream and ev.text:
            sys.stdout.write(ev.text)
            sys.stdout.flush()
        elif isinstance(ev, Finished):
            result = ev.result
            if a.stream and ev.tail:
                sys.stdout.write(ev.tail)
    engine.shutdown()
    if not a.stream:
        sys.stdout.write(result.text)
    sys.stdout.write("\n")
    stats = generation_stats(result, engine)
    if not a.no_stats:
        cap = stats["budget_cap"]
        cap_s = (
            f" · cap {_short(cap['requested_max_tokens'])}->{_short(cap['admitted_max_tokens'])}"
            if cap
            else ""
        )
        print(
            f"[ {stats['prompt_tokens']} in · {stats['completion_tokens']} out · "
            f"{stats['decode_tokens_per_second'] or 0:.1f} tok/s · ttft {stats['ttft_ms']:.0f} ms · "
            f"finish {stats['finish_reason']}{cap_s} ]",
            file=sys.stderr,
        )
    if a.stats_json:
        text = json.dumps(stats, indent=1)
        if a.stats_json == "-":
            print(text)
        else:
            with open(a.stats_json, "w") as f:
                f.write(text + "\n")
    if result.finish_reason == "error":
        print(f"kvgate: generation failed: {result.error}", file=sys.stderr)
        return 1
    return 0


def generation_stats(result, engine) -> dict:
    t = result.token_times
    ttft = (t[0] - result.submitted_at) * 1000 if t else None
    gaps = [(b - a) * 1000 for a, b in zip(t, t[1:])]
    decode_tps = (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else None
    e2e = result.finished_at - result.submitted_at
    cap = result.budget_cap
    p = engine.plan
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "ttft_ms": ttft,
        "decode_tokens_per_second": decode_tps,
        "e2e_tokens_per_second": result.completion_tokens / e2e if e2e > 0 else None,
        "inter_token_latency_ms": {
            "mean": sum(gaps) / len(gaps) if gaps else None,
            "p50": _pct(gaps, 0.5) if gaps else None,
            "p90": _pct(gaps, 0.9) if gaps else None,
            "p99": _pct(gaps, 0.99) if gaps else None,
            "max": max(gaps) if gaps else None,
        },
        "finish_reason": result.finish_reason,
        "budget_cap": None
        if cap is None
        else {
            "requested_max_tokens": cap.requested_max_tokens,
            "admitted_max_tokens": cap.admitted_max_tokens,
            "reason": cap.reason,
        },
        "kv_bytes_per_token": p.kv_bytes_per_token,
        "kv_budget_bytes": p.kv_pool_bytes,
        "weights_bytes": p.weights_bytes,
        "dtype": p.dtype,
        "device": p.device,
        "load_seconds": engine.info.load_seconds,
        "wall_seconds": time.monotonic() - result.submitted_at,
    }


if __name__ == "__main__":
    sys.exit(main())
