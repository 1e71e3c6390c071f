"""`make bench`: kvgate alone, a concurrency sweep with plots, plus the memory-bandwidth bound.

Starts `kvgate serve` on a free loopback port (its own PID, stopped at the end), measures bandwidth,
then runs `kvgate bench` over it. Outputs under bench/out/ (git-ignored).

    .venv/bin/python -m bench.run_all [--concurrency 1,4,16] [--input-len 256] [--output-len 128]
                                      [--num-requests N] [--serve-args "--dtype float32"]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from bench.compare import OUT, ROOT, free_port, kvgate_server, log

BENCH_OUT = ROOT / "bench" / "out"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run_all", description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument(
        "--num-requests", type=int, default=None, help="per run (default: 2 x concurrency, min 4)"
    )
    ap.add_argument("--endpoint", choices=("chat", "completions"), default="completions")
    ap.add_argument(
        "--slo", default="ttft=5s,tpot=200ms", help="goodput SLOs (docs/PEERS.md section 6: CPU-sized)"
    )
    ap.add_argument("--serve-args", default="", help="extra flags for `kvgate serve`")
    ap.add_argument("--skip-bandwidth", action="store_true")
    a = ap.parse_args(argv)

    from kvgate import bench

    BENCH_OUT.mkdir(parents=True, exist_ok=True)
    if not a.skip_bandwidth:
        from bench import bandwidth

        bandwidth.main(["--json", str(BENCH_OUT / "bandwidth.json")])
    port = free_port()
    srv = kvgate_server(port, shlex.split(a.serve_args))
    srv.log_path = OUT.parent / "logs" / "kvgate-run_all.log"
    rc = 0
    with srv:
        for c in a.concurrency.split(","):
            n = a.num_requests or max(4, 2 * int(c))
            args = [
                "--base-url",
                f"http://127.0.0.1:{port}",
                "--endpoint",
                a.endpoint,
                "--concurrency",
                c,
                "--num-requests",
                str(n),
                "--input-len",
                str(a.input_len),
                "--output-len",
                str(a.output_len),
                "--slo",
                a.slo,
                "--json",
                str(BENCH_OUT / f"kvgate_c{c}.json"),
                "--seed",
                c,
            ]
            log("kvgate bench " + shlex.join(args))
            rc = bench.main(args) or rc
    runs = []
    for c in a.concurrency.split(","):
        p = BENCH_OUT / f"kvgate_c{c}.json"
        if p.exists():
            runs += json.loads(p.read_text())["runs"]
    if runs:
        merged = {"meta": {"label": "kvgate"}, "runs": runs}
        (BENCH_OUT / "kvgate_sweep.json").write_text(json.dumps(merged, indent=1))
        for p in bench.write_plots(merged, str(BENCH_OUT / "plots"), "kvgate (default settings)"):
            log(f"wrote {p}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
