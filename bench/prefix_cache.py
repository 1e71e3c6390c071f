"""The shared-prefix workload (issue 12): a 1,024-token common system prompt plus 32 unique tokens,
64 tokens out, at concurrency 1 and 16; TTFT p50 and output tok/s with kvgate's prefix cache on and off,
and against llama.cpp's own server with its prompt cache on when one is given (`--llama-server PATH`,
e.g. the binary bench/compare.py builds under bench/.peers).

    python -m bench.prefix_cache [--llama-server bench/.peers/llama.cpp/build/bin/llama-server]

Every server gets the same text prompts (each server tokenizes them itself) through /v1/completions,
streamed, temperature 0, ignore_eos / n_predict fixed, so output lengths are equal. Results go to
bench/out/prefix_cache.json and a table (with the CPU model and flags) that docs/BENCHMARKS.md quotes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx

from bench.compare import OUT, Server, free_port, kvgate_server, log, machine_info
from bench.cpu import cpu_line

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november".split()


def system_prompt(base_url: str, target: int = 1024) -> str:
    """Text that kvgate's tokenizer makes `target` tokens long (the same text goes to every peer)."""
    text, n = "", 0
    i = 0
    while n < target:
        text += f"Rule {i}: always answer {WORDS[i % len(WORDS)]} when asked about {WORDS[(i * 7) % len(WORDS)]}. "
        i += 1
        if i % 8 == 0:
            n = httpx.post(base_url + "/v1/tokenize", json={"prompt": text}).json()["count"]
    return text


def unique_suffix(i: int) -> str:
    """About 32 tokens, different for every request."""
    return " ".join(f"{WORDS[(i * 3 + k) % len(WORDS)]}{i}" for k in range(12)) + f" Question {i}:"


async def one(client: httpx.AsyncClient, url: str, prompt: str, out_len: int, peer: str) -> dict:
    body = {"prompt": prompt, "max_tokens": out_len, "temperature": 0, "stream": True}
    body.update({"ignore_eos": True} if peer == "kvgate" else {"n_predict": out_len, "ignore_eos": True})
    t0 = time.monotonic()
    first, tokens = None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                first = first or time.monotonic()
                tokens += 1
    return {"ttft": (first or time.monotonic()) - t0, "chunks": tokens, "e2e": time.monotonic() - t0}


async def run_load(url: str, system: str, start: int, n: int, conc: int, out_len: int, peer: str) -> dict:
    sem = asyncio.Semaphore(conc)
    # no keep-alive: llama-server closes a streamed response's connection, and a pooled one then fails
    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def guarded(i):
            async with sem:
                return await one(client, url, system + unique_suffix(start + i), out_len, peer)

        t0 = time.monotonic()
        rows = await asyncio.gather(*(guarded(i) for i in range(n)))
        wall = time.monotonic() - t0
    ttfts = sorted(r["ttft"] for r in rows)
    return {
        "requests": n,
        "concurrency": conc,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
        "output_tok_s": n * out_len / wall,
        "wall_s": wall,
    }


def measure(name: str, url: str, system: str, peer: str, out_len: int, plan: list[tuple[int, int]]) -> dict:
    # Warm-up before each level puts the system prompt in the cache (and warms the server): the
    # workload is the steady state of a server that has seen this system prompt before. `conc` of them
    # at once, so that llama-server, whose prompt cache is per slot, has it in every slot it will use.
    res = {}
    start = 0
    for conc, n in plan:
        asyncio.run(run_load(url, system, 10_000 + 100 * conc, conc, conc, 4, peer))
        log(f"{name}: {n} requests at concurrency {conc}")
        res[str(conc)] = asyncio.run(run_load(url, system, start, n, conc, out_len, peer))
        start += n
        log(f"{name} c={conc}: {res[str(conc)]}")
    return res


def llama_server_proc(binary: str, gguf: str, port: int, slots: int) -> Server:
    cmd = [binary, "-m", gguf, "--port", str(port), "--host", "127.0.0.1", "-np", str(slots), "-cb"]
    cmd += ["-c", str(slots * 1200), "-t", "2", "--cache-reuse", "256"]
    return Server(
        "llama-server", cmd, f"http://127.0.0.1:{port}/health", OUT / "logs" / "llama-server-prefix.log"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", default=None, help="path to llama.cpp's llama-server binary")
    ap.add_argument("--out-len", type=int, default=64)
    ap.add_argument("--c1", type=int, default=8, help="requests at concurrency 1")
    ap.add_argument("--c16", type=int, default=32, help="requests at concurrency 16")
    ap.add_argument("--only-llama", action="store_true", help="rerun llama-server only, into the saved json")
    ap.add_argument("--doc-only", action="store_true", help="rewrite the doc from the saved json")
    a = ap.parse_args(argv)
    plan = [(1, a.c1), (16, a.c16)]
    path = Path(OUT) / "prefix_cache.json"
    if a.doc_only:
        write_doc(json.loads(path.read_text()))
        return 0
    results: dict = {"machine": machine_info(), "workload": {"system_tokens": 1024, "unique_tokens": 32}}
    results["workload"]["out_len"] = a.out_len
    system = None
    if a.only_llama:
        results = json.loads(path.read_text())
        system = results["workload"]["system_text"]
    for label, flag in () if a.only_llama else (("kvgate cache on", "on"), ("kvgate cache off", "off")):
        port = free_port()
        with kvgate_server(port, ["--prefix-cache", flag, "--max-seqs", "16"]):
            url = f"http://127.0.0.1:{port}"
            system = system or system_prompt(url)
            results["workload"]["system_text"] = system
            if "kvgate" not in results["workload"]:  # the same plan with the cache on or off
                results["workload"]["kvgate"] = served_numbers(url)
            results[label] = measure(label, url, system, "kvgate", a.out_len, plan)
    if a.llama_server:
        from kvgate.models import resolve_model_path

        port = free_port()
        with llama_server_proc(a.llama_server, str(resolve_model_path("default")), port, 16):
            results["llama-server prompt cache"] = measure(
                "llama-server", f"http://127.0.0.1:{port}", system, "llama", a.out_len, plan
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    print(table(results))
    write_doc(results)
    return 0


DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "prefix_cache.md"


def served_numbers(url: str) -> str:
    """What the server's plan computes in: its weight format, dtype and KV cache (/v1/resources)."""
    plan = httpx.get(url + "/v1/resources", timeout=30).json()["plan"]
    narrow = plan["dtype"] == "float32" and plan["limits"]["kv_bytes"] == 2  # auto's only narrowing
    kv = "float16" if narrow else plan["dtype"]
    return f"{plan['limits']['weight_format']} weights, {plan['dtype']}, {kv} KV cache"


def write_doc(results: dict) -> None:
    w = results["workload"]
    DOC.write_text(
        "# Shared-prefix workload: the prefix cache on and off, and llama.cpp's server\n\n"
        "<!-- Generated by `python -m bench.prefix_cache`; edit the generator, not this file. -->\n\n"
        f"A {w['system_tokens']}-token common system prompt plus {w['unique_tokens']} unique tokens, "
        f"{w['out_len']} tokens out, streamed, greedy; 8 requests at concurrency 1 and 32 at 16, after a "
        "warm-up that puts the system prompt in every server's cache (for llama-server: in each slot it "
        f"will use). kvgate: defaults, `--max-seqs 16` ({w.get('kvgate', 'float32')}); "
        "llama-server: the Q4_1 file itself, `-np 16 "
        "-cb -t 2 --cache-reuse 256`. Same text to every server; each tokenizes it itself.\n\n"
        + table(results)
        + "\n\nTargets (issue 12): TTFT p50 at c=1 with the cache on at most 1/5 of cache off; output tok/s "
        "at c=16 at least 2x cache off; kvgate ahead of llama-server on both.\n"
    )


def table(results: dict) -> str:
    m = results["machine"]
    lines = [
        cpu_line(m),
        "",
        "| server | TTFT p50 c=1 | output tok/s c=1 | TTFT p50 c=16 | output tok/s c=16 |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if name in ("machine", "workload"):
            continue
        c1, c16 = r["1"], r["16"]
        lines.append(
            f"| {name} | {c1['ttft_p50_s']:.2f} s | {c1['output_tok_s']:.1f} | {c16['ttft_p50_s']:.2f} s | "
            f"{c16['output_tok_s']:.1f} |"
        )
    on, off = results.get("kvgate cache on"), results.get("kvgate cache off")
    if on and off:
        lines.append("")
        lines.append(
            f"cache on / off: TTFT p50 at c=1 x{on['1']['ttft_p50_s'] / off['1']['ttft_p50_s']:.2f} "
            f"(target <= 0.2), output tok/s at c=16 x{on['16']['output_tok_s'] / off['16']['output_tok_s']:.2f} "
            "(target >= 2)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
