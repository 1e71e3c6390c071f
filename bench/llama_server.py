"""llama.cpp's own C++ `llama-server` as a benchmark peer: built once from the llama.cpp vendored in the
llama-cpp-python sdist that bench/compare.py pins, cached under bench/.peers, started with continuous
batching and as many slots as the benchmark has clients.

    python -m bench.llama_server build [--force]   # what `make bench-compare` runs first (cached)
    python -m bench.llama_server flags             # the CPU flags seen and the cmake flags they give
    python -m bench.llama_server smoke [--slots 16] [--requests 16]

The build: `pip download --no-deps --no-binary :all: llama-cpp-python==VERSION` into bench/.peers/sdist,
its vendor/llama.cpp extracted to bench/.peers/llama.cpp, then cmake with `-DLLAMA_BUILD_SERVER=ON
-DGGML_NATIVE=OFF` and the instruction-set options this CPU lists in /proc/cpuinfo (AVX/AVX2/FMA/F16C/
BMI2, the AVX-512 variants), the AMX tile kernels always off: on CPUs that list AMX, a `-march=native`
build can die with SIGILL in them. Only the `llama-server` target is built, with every core (about 5
minutes on 2 idle cores). The log goes to bench/.peers/llama-server.build.log and to stderr; a stamp
(bench/.peers/llama.cpp/build/kvgate-build.json) records the flags, the duration and the versions, and a
build whose stamp matches the flags this CPU asks for is reused.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections import deque
from pathlib import Path

from bench.cpu import cpu_class, cpu_flags, machine_info
from bench.servers import ROOT, Server, free_port, rel
from bench.servers import log as _log

LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # bench/compare.py pins llama-cpp-python[server] to this too
PEERS = ROOT / "bench" / ".peers"
SDIST_DIR = PEERS / "sdist"
SRC = PEERS / "llama.cpp"
SOURCE_STAMP = SRC / ".kvgate-source.json"
BUILD = SRC / "build"
BINARY = BUILD / "bin" / "llama-server"
STAMP = BUILD / "kvgate-build.json"
BUILD_LOG = PEERS / "llama-server.build.log"
LOGS = ROOT / "bench" / "out" / "compare" / "logs"
LABEL = "llama.cpp llama-server (Q4_1, -np = conc, -cb)"
ALIAS = "smollm2-q4_1"
CTX_PER_SLOT = 2048  # the llama-cpp-python peer's n_ctx, per request

AVX512_BASE = ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")  # what GGML_AVX512 compiles for
# ggml option -> the /proc/cpuinfo flags it needs, all of them
ISA_OPTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    ("GGML_AVX512", AVX512_BASE),
    ("GGML_AVX512_VBMI", (*AVX512_BASE, "avx512vbmi")),
    ("GGML_AVX512_VNNI", (*AVX512_BASE, "avx512_vnni")),
    ("GGML_AVX512_BF16", (*AVX512_BASE, "avx512_bf16")),
)
AMX_OPTIONS = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")
AMX_FLAGS = ("amx_tile", "amx_int8", "amx_bf16")
RELEVANT_FLAGS = tuple(dict.fromkeys(f for _, fs in ISA_OPTIONS for f in fs)) + AMX_FLAGS
FIXED_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",  # no npm
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # no download of web-UI assets at build time
    "-DLLAMA_OPENSSL=OFF",
    "-DGGML_CCACHE=OFF",
    "-DGGML_NATIVE=OFF",
)


class BuildError(RuntimeError):
    pass


def log(msg: str) -> None:
    _log(msg, "llama-server")


# ---- what to build --------------------------------------------------------------------------------


def isa_options(flags: set[str]) -> dict[str, bool]:
    """ggml's x86 instruction-set options for a CPU with these /proc/cpuinfo flags; AMX always off."""
    opts = {name: all(f in flags for f in need) for name, need in ISA_OPTIONS}
    opts.update(dict.fromkeys(AMX_OPTIONS, False))
    return opts


def cmake_args(flags: set[str], commit: str | None = None) -> list[str]:
    args = list(FIXED_ARGS)
    args += [f"-D{k}={'ON' if v else 'OFF'}" for k, v in isa_options(flags).items()]
    if commit:  # else llama.cpp's build-info would ask git, which would answer with kvgate's commit
        args += [f"-DLLAMA_BUILD_COMMIT={commit[:8]}", "-DLLAMA_BUILD_NUMBER=0"]
    return args


def amx_note(flags: set[str]) -> str | None:
    listed = [f for f in AMX_FLAGS if f in flags]
    if not listed:
        return None
    return (
        f"this CPU lists {', '.join(listed)}: llama-server is built with -DGGML_NATIVE=OFF and the AMX "
        "tile kernels off (a -march=native build can die with SIGILL in them; the other way out is "
        "llama-server --no-repack)"
    )


# ---- getting the source ---------------------------------------------------------------------------


def sdist_path(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return SDIST_DIR / f"llama_cpp_python-{version}.tar.gz"


def download_sdist(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    path = sdist_path(version)
    if path.exists():
        return path
    SDIST_DIR.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps"]
    cmd += ["--no-binary", ":all:", f"llama-cpp-python=={version}", "-d", str(SDIST_DIR)]
    log(f"downloading the llama-cpp-python {version} sdist: {shlex.join(cmd)}")
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or not path.exists():
        raise BuildError(f"pip download failed ({r.returncode}):\n{(r.stdout + r.stderr)[-2000:]}")
    log(f"downloaded {rel(path)} ({path.stat().st_size / 2**20:.0f} MiB) in {time.monotonic() - t0:.0f} s")
    return path


def extract_source(version: str = LLAMA_CPP_PYTHON_VERSION) -> dict:
    """bench/.peers/llama.cpp = the sdist's vendor/llama.cpp; returns {version, commit}."""
    if SOURCE_STAMP.exists():
        info = json.loads(SOURCE_STAMP.read_text())
        if info.get("version") == version:
            return info
    tar_path = download_sdist(version)
    top = f"llama_cpp_python-{version}"
    prefix = f"{top}/vendor/llama.cpp/"
    if SRC.exists():
        shutil.rmtree(SRC)
    SRC.mkdir(parents=True)
    log(f"extracting {prefix} from {rel(tar_path)} into {rel(SRC)}")
    commit = None
    with tarfile.open(tar_path) as tar:
        members = []
        for m in tar:
            if m.name == f"{top}/.git/modules/vendor/llama.cpp/HEAD":
                commit = tar.extractfile(m).read().decode().strip()
            elif m.name.startswith(prefix) and m.name != prefix + ".git":  # .git: a dangling gitdir link
                m.name = m.name[len(prefix) :]
                members.append(m)
        if not members:
            raise BuildError(f"{rel(tar_path)} has no {prefix}")
        tar.extractall(SRC, members=members, filter="data")
    info = {"version": version, "commit": commit, "sdist": rel(tar_path)}
    SOURCE_STAMP.write_text(json.dumps(info, indent=1))
    return info


# ---- building -------------------------------------------------------------------------------------


def check_tools() -> dict:
    found = {
        "cmake": shutil.which("cmake"),
        "C compiler": os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"),
        "C++ compiler": os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++"),
    }
    missing = [k for k, v in found.items() if not v]
    if missing:
        raise BuildError(
            f"building llama-server needs cmake and a C/C++ compiler; missing: {', '.join(missing)} "
            "(Debian: apt-get install cmake g++)"
        )
    found["ninja"] = shutil.which("ninja")
    return found


def tool_version(cmd: list[str]) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    out = (r.stdout or r.stderr).strip().splitlines()
    return out[0] if out else None


def server_version(binary: Path = BINARY) -> str | None:
    """`llama-server --version` prints e.g. 'version: 0 (0c1e5709)' and the compiler, on stderr."""
    try:
        r = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [x for x in (r.stdout + r.stderr).splitlines() if x.startswith(("version", "built with"))]
    return "; ".join(lines) or None


def run_logged(cmd: list[str], logf, env: dict, what: str) -> float:
    """Run cmd, its output to logf and to stderr; raise BuildError with the tail on failure."""
    logf.write(f"$ {shlex.join(cmd)}\n")
    logf.flush()
    log(f"{what}: {shlex.join(cmd)}")
    tail: deque[str] = deque(maxlen=40)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    for line in proc.stdout:
        logf.write(line)
        tail.append(line)
        print(f"  {line}", end="", file=sys.stderr, flush=True)
    rc = proc.wait()
    dt = time.monotonic() - t0
    logf.write(f"# {what}: exit {rc} after {dt:.1f} s\n")
    logf.flush()
    if rc != 0:
        raise BuildError(
            f"{what} failed (exit {rc}) after {dt:.0f} s; full log {rel(BUILD_LOG)}; last lines:\n"
            + "".join(tail)
        )
    return dt


def read_stamp() -> dict | None:
    try:
        return json.loads(STAMP.read_text())
    except (OSError, ValueError):
        return None


def ensure(force: bool = False) -> dict:
    """The llama-server binary for this CPU, built if missing or built with other flags; its stamp."""
    flags = cpu_flags()
    stamp = read_stamp()
    try:
        commit = json.loads(SOURCE_STAMP.read_text()).get("commit")
    except (OSError, ValueError):
        commit = None
    if (
        not force
        and stamp
        and BINARY.exists()
        and stamp.get("version") == LLAMA_CPP_PYTHON_VERSION
        and stamp.get("cmake_args") == cmake_args(flags, commit)
    ):
        log(f"cached: {rel(BINARY)} (built {stamp.get('built_at')} in {stamp.get('build_seconds', 0):.0f} s)")
        return stamp
    if stamp and BINARY.exists() and not force:
        log("the cached llama-server was built for other CPU flags: rebuilding")
    tools = check_tools()
    src = extract_source()
    args = cmake_args(flags, src.get("commit"))
    jobs = os.cpu_count() or 2
    configure = [
        "cmake",
        "-S",
        str(SRC),
        "-B",
        str(BUILD),
        *(["-G", "Ninja"] if tools["ninja"] else []),
        *args,
    ]
    build = ["cmake", "--build", str(BUILD), "--target", "llama-server", "-j", str(jobs)]
    note = amx_note(flags)
    if note:
        log(note)
    # build-info.cmake asks git for the commit: stop it from finding kvgate's repository above .peers
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(PEERS))
    PEERS.mkdir(parents=True, exist_ok=True)
    log(f"building llama-server with {jobs} jobs (about 5 min on 2 idle cores); log: {rel(BUILD_LOG)}")
    load0 = os.getloadavg()
    t0 = time.monotonic()
    with open(BUILD_LOG, "w") as logf:
        logf.write(f"# llama-server build, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, load {load0}\n")
        t_conf = run_logged(configure, logf, env, "configure")
        t_build = run_logged(build, logf, env, "build")
    total = time.monotonic() - t0
    if not BINARY.exists():
        raise BuildError(f"the build finished but {rel(BINARY)} is missing; see {rel(BUILD_LOG)}")
    m = machine_info()
    stamp = {
        "version": LLAMA_CPP_PYTHON_VERSION,
        "llama_cpp_commit": src.get("commit"),
        "sdist": src.get("sdist"),
        "binary": rel(BINARY),
        "configure_command": shlex.join(["cmake", "-S", rel(SRC), "-B", rel(BUILD), *configure[5:]]),
        "build_command": shlex.join(["cmake", "--build", rel(BUILD), *build[3:]]),
        "cmake_args": args,
        "isa_options": isa_options(flags),
        "cpu_flags_detected": [f for f in RELEVANT_FLAGS if f in flags],
        "cpu_model": m["model_name"],
        "cpu_class": cpu_class(flags, m.get("vendor_id")),
        "amx_listed": bool(note),
        "amx_kernels": False,
        "amx_note": note,
        "compiler": tool_version([tools["C++ compiler"], "--version"]),
        "cmake": tool_version(["cmake", "--version"]),
        "jobs": jobs,
        "configure_seconds": round(t_conf, 1),
        "build_seconds": round(total, 1),
        "compile_seconds": round(t_build, 1),
        "loadavg_before": load0,
        "loadavg_after": os.getloadavg(),
        "built_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "log": rel(BUILD_LOG),
        "server_version": server_version(),
    }
    STAMP.write_text(json.dumps(stamp, indent=1))
    log(
        f"built {rel(BINARY)} in {total:.0f} s (configure {t_conf:.0f} s, compile {t_build:.0f} s, "
        f"load {load0[0]:.1f} -> {stamp['loadavg_after'][0]:.1f}); stamp {rel(STAMP)}"
    )
    return stamp


# ---- running it -----------------------------------------------------------------------------------


def command(
    gguf: str, port: int, slots: int, threads: int | None = None, ctx_per_slot: int = CTX_PER_SLOT
) -> list[str]:
    """llama-server with continuous batching and `slots` parallel sequences of ctx_per_slot tokens each
    (-c is the total, split over the slots); threads default to every CPU, as for llama-cpp-python."""
    t = str(threads or os.cpu_count() or 2)
    return [
        str(BINARY),
        "-m",
        gguf,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(slots),
        "-cb",
        "-c",
        str(slots * ctx_per_slot),
        "-t",
        t,
        "-tb",
        t,
        "-a",
        ALIAS,
    ]


def server(
    port: int, gguf: str, slots: int, threads: int | None = None, log_name: str | None = None
) -> Server:
    log_path = LOGS / (log_name or f"llama-server_np{slots}.log")
    return Server(
        "llama-server", command(gguf, port, slots, threads), f"http://127.0.0.1:{port}/health", log_path
    )


def explain_exit(srv: Server) -> str | None:
    """Why the server process is gone, if it is, in words (SIGILL: the instruction-set story)."""
    if srv.proc is None or srv.proc.poll() is None:
        return None
    rc = srv.proc.returncode
    if rc == -signal.SIGILL:
        note = amx_note(cpu_flags()) or "this CPU lists no AMX"
        return (
            f"llama-server died with SIGILL (an instruction this CPU or its hypervisor refuses); {note}. "
            f"Rebuild with `python -m bench.llama_server build --force` (stamp {rel(STAMP)}), or add --no-repack"
        )
    return f"llama-server exited with {rc}; see {rel(srv.log_path)}"


def run_peer(
    gguf: str,
    concs: list[int],
    datasets: dict,
    n_of: dict,
    out_len: int,
    threads: int | None,
    bench_run,
) -> dict:
    """bench/compare.py's llama-server entry: a fresh server per concurrency c with -np c, each measured
    by bench_run(name, base_url, dataset, c, n, out_len) on the same prompts as the other peers."""
    entry: dict = {"label": LABEL, "runs": {}}
    try:
        entry["build"] = ensure()
    except BuildError as exc:
        entry["error"] = f"build: {exc}".splitlines()[0]
        log(str(exc))
        return entry
    errors = []
    for c in concs:
        port = free_port()
        srv = server(port, gguf, c, threads)
        cmd = shlex.join(srv.cmd)
        entry.setdefault("server_command", cmd)
        try:
            with srv:
                run = bench_run(
                    f"llama-server_c{c}", f"http://127.0.0.1:{port}", datasets[f"c{c}"], c, n_of[c], out_len
                )
                why = explain_exit(srv)
                if why:
                    raise RuntimeError(why)
            run["server_command"] = cmd
            entry["runs"][str(c)] = run
        except Exception as exc:  # keep the other concurrencies' numbers
            why = explain_exit(srv) or f"{type(exc).__name__}: {exc}"
            errors.append(f"c={c}: {why}")
            log(f"c={c} failed: {why}")
    if errors:
        entry["error"] = "; ".join(errors)
    return entry


def build_md(stamp: dict | None) -> str | None:
    """One line for docs/BENCHMARKS.md's machine section."""
    if not stamp:
        return None
    line = (
        f"llama-server: llama.cpp `{(stamp.get('llama_cpp_commit') or '?')[:8]}` vendored in llama-cpp-python "
        f"{stamp['version']}, built here for {stamp.get('cpu_class')} with `{stamp['configure_command']}` and "
        f"`{stamp['build_command']}` in {stamp['build_seconds']:.0f} s "
        f"(load {stamp['loadavg_before'][0]:.1f} at the start); "
        f"{stamp.get('compiler') or 'compiler ?'}."
    )
    if stamp.get("amx_note"):
        line += f" Note: {stamp['amx_note']}."
    return line


# ---- smoke test -----------------------------------------------------------------------------------


def smoke(slots: int, requests: int, max_tokens: int, threads: int | None) -> dict:
    """One streamed /v1/completions request, then `requests` at once, on the default model's GGUF."""
    import asyncio

    import httpx

    from kvgate.models import resolve_model_path

    gguf = str(resolve_model_path("default"))
    ensure()

    async def one(client: httpx.AsyncClient, url: str, i: int) -> dict:
        body = {
            "prompt": f"Story {i}: once upon a time, in a small village by the sea,",
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        t0 = time.monotonic()
        first, chunks, usage, text = None, 0, None, ""
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                d = json.loads(line[6:])
                if d.get("usage"):
                    usage = d["usage"]
                if d.get("choices") and d["choices"][0].get("text"):
                    first = first or time.monotonic()
                    chunks += 1
                    text += d["choices"][0]["text"]
        end = time.monotonic()
        tokens = (usage or {}).get("completion_tokens") or chunks
        return {
            "tokens": tokens,
            "chunks": chunks,
            "ttft_s": (first or end) - t0,
            "e2e_s": end - t0,
            "decode_tok_s": (tokens - 1) / (end - first) if first and tokens > 1 and end > first else None,
            "text_head": text[:60],
        }

    async def load(url: str, n: int) -> dict:
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            t0 = time.monotonic()
            rows = await asyncio.gather(*(one(client, url, i) for i in range(n)))
            wall = time.monotonic() - t0
        toks = sum(r["tokens"] for r in rows)
        return {
            "requests": n,
            "output_tokens": toks,
            "wall_s": round(wall, 2),
            "output_tok_s": round(toks / wall, 1),
            "ttft_s_max": round(max(r["ttft_s"] for r in rows), 2),
            "first": rows[0],
        }

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    srv = server(port, gguf, slots, threads, log_name="llama-server_smoke.log")
    res: dict = {"command": shlex.join(srv.cmd), "loadavg_before": os.getloadavg()}
    try:
        with srv:
            res["c1"] = asyncio.run(load(url, 1))
            log(f"1 streamed request: {res['c1']}")
            res[f"c{requests}"] = asyncio.run(load(url, requests))
            log(f"{requests} concurrent: {res[f'c{requests}']}")
            if explain_exit(srv):
                raise RuntimeError(explain_exit(srv))
    except Exception as exc:
        raise SystemExit(explain_exit(srv) or f"smoke failed: {type(exc).__name__}: {exc}") from exc
    res["loadavg_after"] = os.getloadavg()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.llama_server", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build llama-server if missing or built for other CPU flags")
    b.add_argument("--force", action="store_true", help="reconfigure and rebuild even if the stamp matches")
    sub.add_parser("flags", help="print the CPU flags detected and the cmake flags chosen; builds nothing")
    s = sub.add_parser("smoke", help="start it on the default model; 1 streamed request, then N at once")
    s.add_argument("--slots", type=int, default=16, help="-np")
    s.add_argument("--requests", type=int, default=16)
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--threads", type=int, default=None, help="-t/-tb (default: every CPU)")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "flags":
            flags = cpu_flags()
            print(json.dumps({"cpu_flags_detected": [f for f in RELEVANT_FLAGS if f in flags]}))
            print(shlex.join(cmake_args(flags)))
            if amx_note(flags):
                print(amx_note(flags))
        elif a.cmd == "build":
            stamp = ensure(force=a.force)
            print(
                json.dumps({k: stamp[k] for k in ("binary", "build_seconds", "configure_command")}, indent=1)
            )
        else:
            print(json.dumps(smoke(a.slots, a.requests, a.max_tokens, a.threads), indent=1))
    except BuildError as exc:
        print(f"llama-server build failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
