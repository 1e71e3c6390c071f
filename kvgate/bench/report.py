"""Showing a finished benchmark: the text table on stdout and the PNG plots.

`print_report` prints one line per run (throughput, TTFT/TPOT/ITL/E2E percentiles, status counts)
plus notes on Retry-After, goodput, incomplete streams and short outputs. `write_plots` writes
throughput and TTFT against concurrency (when a sweep has more than one) and latency CDFs; it needs
matplotlib and skips the plots with a note on stderr without it. Both read only the result dict that
the JSON report holds.
"""

from __future__ import annotations

import os
import sys


def _fmt(x, nd=1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def print_report(result: dict, out=None) -> None:
    out = out or sys.stdout
    meta = result["meta"]
    print(
        f"target {meta['base_url']} model {meta['model']} endpoint {meta['endpoint']} "
        f"(output length control: {meta['eos_mode']})",
        file=out,
    )
    hdr = (
        f"{'conc':>5} {'rate':>6} {'done':>5} {'req/s':>6} {'out tok/s':>9} {'tot tok/s':>9} "
        f"{'TTFT p50/p90/p99 ms':>22} {'TPOT p50/p99 ms':>16} {'ITL p50/p99':>12} {'E2E p50/p99 s':>14} "
        f"{'200/400/429/503/oth':>20}"
    )
    print(hdr, file=out)
    for run in result["runs"]:
        s = run["summary"]
        c = s["status_counts"]
        t, tp, itl, e = s["ttft_ms"], s["tpot_ms"], s["itl_ms"], s["e2e_ms"]
        conc = "inf" if run["concurrency"] is None else f"{run['concurrency']:g}"
        rate = "inf" if run["request_rate"] is None else f"{run['request_rate']:g}"
        print(
            f"{conc:>5} {rate:>6} {s['completed']:>5} {s['request_throughput']:>6.2f} {s['output_throughput']:>9.1f} "
            f"{s['total_throughput']:>9.1f} {_fmt(t['p50'], 0) + '/' + _fmt(t['p90'], 0) + '/' + _fmt(t['p99'], 0):>22} "
            f"{_fmt(tp['p50']) + '/' + _fmt(tp['p99']):>16} {_fmt(itl['p50'], 0) + '/' + _fmt(itl['p99'], 0):>12} "
            f"{_fmt(e['p50'] and e['p50'] / 1000) + '/' + _fmt(e['p99'] and e['p99'] / 1000):>14} "
            f"{c['200']}/{c['400']}/{c['429']}/{c['503']}/{c['other']:>1}",
            file=out,
        )
        ra = s["retry_after"]
        if c["429"] or c["503"]:
            print(
                f"      Retry-After present: 429 {ra['429']['with']}/{c['429']}, 503 {ra['503']['with']}/{c['503']}",
                file=out,
            )
        if s["goodput"] is not None:
            print(
                f"      goodput {s['goodput']:.3f} req/s ({s['goodput_requests']}/{s['requests']} met {s['slo_ms']} ms)",
                file=out,
            )
        if s["stream_errors"]:
            print(f"      {s['stream_errors']} admitted request(s) did not complete", file=out)
        if s["short_outputs"]:
            print(f"      {s['short_outputs']} request(s) produced fewer tokens than requested", file=out)


def write_plots(result: dict, outdir: str, title: str = "") -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "kvgate bench: matplotlib is not installed; skipping plots (pip install matplotlib)",
            file=sys.stderr,
        )
        return []
    os.makedirs(outdir, exist_ok=True)
    runs = result["runs"]
    paths = []
    concs = [r for r in runs if r["concurrency"] is not None]
    if len({r["concurrency"] for r in concs}) > 1:
        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        xs = [r["concurrency"] for r in concs]
        ax[0].plot(xs, [r["summary"]["output_throughput"] for r in concs], "o-")
        ax[0].set(
            xscale="log", xlabel="concurrency", ylabel="output tok/s", title="throughput vs concurrency"
        )
        ax[1].plot(xs, [(r["summary"]["ttft_ms"]["p50"] or 0) / 1000 for r in concs], "o-", label="TTFT p50")
        ax[1].plot(xs, [(r["summary"]["ttft_ms"]["p99"] or 0) / 1000 for r in concs], "o--", label="TTFT p99")
        ax[1].set(xscale="log", xlabel="concurrency", ylabel="seconds", title="TTFT vs concurrency")
        ax[1].legend()
        for a in ax:
            a.set_xticks(xs, [f"{x:g}" for x in xs])
            a.grid(alpha=0.3)
        fig.suptitle(title)
        fig.tight_layout()
        p = os.path.join(outdir, "throughput_vs_concurrency.png")
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)
    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    for run in runs:
        ok = [r for r in run["records"] if r["ok"]]
        label = run["label"]
        for a, key, unit in ((ax[0], "ttft_ms", "TTFT (s)"), (ax[1], "e2e_ms", "E2E (s)")):
            xs = sorted(r[key] / 1000 for r in ok if r[key] is not None)
            if xs:
                a.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
            a.set(xlabel=unit, ylabel="fraction of requests")
        itl = sorted(x for r in ok for x in r["itl_ms"])
        if itl:
            ax[2].plot(itl, [(i + 1) / len(itl) for i in range(len(itl))], label=label)
        ax[2].set(xlabel="ITL (ms)", ylabel="fraction of gaps", xscale="log")
    for a, t in zip(ax, ("TTFT CDF", "E2E CDF", "inter-token latency CDF"), strict=True):
        a.set_title(t)
        a.grid(alpha=0.3)
    ax[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    p = os.path.join(outdir, "latency_cdf.png")
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)
    return paths
