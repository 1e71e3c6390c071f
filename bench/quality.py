"""What each weight and KV format does to the model's numbers, measured through a live server.

    python -m bench.quality                      # every variant below (~5 minutes on 2 cores)
    python -m bench.quality --variants gguf,gguf-q8act --tokens 1024

For each variant it starts `kvgate serve` with those flags, scores the same token windows of a fixed
English text with OpenAI's completions `echo` + `logprobs` + `max_tokens=0` (the body evaluation
clients send for a text's log-likelihood), and reports, against `full` (the GGUF's own weights widened
to float32, computed densely in float32):

- perplexity, exp(-mean log-probability of each token after a window's first);
- the mean and largest |difference| of those log-probabilities from full's, position by position;
- how often the most likely next token (top-1) is full's: llama-perplexity's "same top p".

The text is Debian's GPL-3 (/usr/share/common-licenses/GPL-3, plain English prose shipped on every
Debian machine) or, where that is missing, this repository's docs/DESIGN.md; `--text` names another.
Scoring is not a speed benchmark: a scored chunk computes logits at every position and is cut to the
plan's logits rows (`--max-seqs`, 32) a step.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import httpx

from bench.compare import kvgate_server
from bench.cpu import cpu_line, machine_info
from bench.servers import ROOT, free_port, log

OUT = ROOT / "bench" / "out" / "quality.json"
TEXTS = (Path("/usr/share/common-licenses/GPL-3"), ROOT / "docs" / "DESIGN.md")
F32KV = ["--kv-dtype", "float32"]  # a weight format alone: the cache as wide as its float32 model
VARIANTS = {
    "full": ["--weights", "full", "--dtype", "float32", *F32KV],
    "full-auto": ["--weights", "full"],  # the dtype kvgate picks for full weights (bf16 where fast)
    "gguf": ["--weights", "gguf", *F32KV],
    "gguf-q8act": ["--weights", "gguf-q8act", *F32KV],
    "int8": ["--weights", "int8"],
    "int4": ["--weights", "int4"],
    "default": [],  # what `kvgate serve` runs: the file's blocks (gguf) and a float16 KV cache (CPU)
    "kv-int8": ["--kv-dtype", "int8"],  # the default weights over an int8 KV cache (kvgate.models.kv_int8)
}


def windows(base: str, text: str, tokens: int, window: int) -> list[list[int]]:
    r = httpx.post(base + "/v1/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=120)
    r.raise_for_status()
    ids = r.json()["tokens"][:tokens]
    return [ids[i : i + window] for i in range(0, len(ids) - 1, window) if len(ids[i : i + window]) > 1]


def score(base: str, ids: list[int]) -> tuple[list[float], list[str]]:
    """The window's token log-probabilities after the first, and the top-1 token at each position."""
    body = {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
    r = httpx.post(base + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    lp = r.json()["choices"][0]["logprobs"]
    tops = [max(t, key=t.get) if t else "" for t in lp["top_logprobs"][1:]]
    return [float(v) for v in lp["token_logprobs"][1:]], tops


def measure(flags: list[str], wins: list[list[int]] | None, text: str, a) -> dict:
    port = free_port()
    with kvgate_server(port, flags, key="quality"):
        base = f"http://127.0.0.1:{port}"
        wins = wins or windows(base, text, a.tokens, a.window)
        t0 = time.monotonic()
        got = [score(base, w) for w in wins]
        seconds = time.monotonic() - t0
    lps = [v for g, _ in got for v in g]
    tops = [t for _, ts in got for t in ts]
    return {"flags": flags, "windows": wins, "logprobs": lps, "tops": tops, "seconds": seconds}


def summarize(name: str, r: dict, ref: dict) -> dict:
    lps, base = r["logprobs"], ref["logprobs"]
    d = [abs(x - y) for x, y in zip(lps, base, strict=True)]
    same = sum(a == b for a, b in zip(r["tops"], ref["tops"], strict=True))
    return {
        "variant": name,
        "flags": " ".join(r["flags"]) or "(the defaults)",
        "tokens": len(lps),
        "ppl": math.exp(-sum(lps) / len(lps)),
        "mean_abs_dlogprob": sum(d) / len(d),
        "max_abs_dlogprob": max(d),
        "same_top1": same / len(lps),
        "scored_tok_s": (len(lps) + len(r["windows"])) / r["seconds"],
    }


def table(rows: list[dict]) -> str:
    out = [
        "| variant | flags | tokens | perplexity | mean abs d logprob vs full | max abs d | same top-1 as full "
        "| scored tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in rows:
        out.append(
            f"| {s['variant']} | `{s['flags']}` | {s['tokens']} | {s['ppl']:.3f} | {s['mean_abs_dlogprob']:.3g} "
            f"| {s['max_abs_dlogprob']:.3g} | {100 * s['same_top1']:.1f}% | {s['scored_tok_s']:.0f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of the text scored (default 2048)")
    ap.add_argument("--window", type=int, default=512, help="tokens per scored window (default 512)")
    ap.add_argument("--text", type=Path, default=None)
    a = ap.parse_args(argv)
    path = a.text or next(p for p in TEXTS if p.exists())
    text = path.read_text(encoding="utf-8", errors="replace")
    names = [v.strip() for v in a.variants.split(",") if v.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    names = ["full"] + [n for n in names if n != "full"]  # the reference first
    runs: dict[str, dict] = {}
    for n in names:
        runs[n] = measure(VARIANTS[n], runs["full"]["windows"] if runs else None, text, a)
        log(f"{n}: {len(runs[n]['logprobs'])} tokens scored in {runs[n]['seconds']:.1f} s", "quality")
    rows = [summarize(n, runs[n], runs["full"]) for n in names]
    cpu = cpu_line(machine_info())
    print(f"Text: {path} ({sum(len(w) for w in runs['full']['windows'])} tokens in windows of {a.window})")
    print(f"{cpu}\n")
    print(table(rows))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"text": str(path), "window": a.window, "cpu": cpu, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
