"""kvgate's own C++ CPU kernels (kvgate/models/csrc), compiled once per machine and cached.

`extension()` builds them with torch's cpp_extension (g++ and ninja; about 2 minutes on 2 cores, once)
into `$KVGATE_EXT_DIR` (default `~/.cache/kvgate/ext`)`/<key>`, where the key covers the sources, the
torch version and the CPU's vector flags: a cache carried to another CPU class is rebuilt, never run.
Flags come from /proc/cpuinfo (AVX2, FMA and F16C when listed; AVX-512 F, BW and VL, and VNNI, when
listed, for the zmm paths; -DKVGATE_AMX where amx_tile, amx_bf16 and avx512_bf16 are listed, for
amx_q4_1.cpp's own target attributes, and -DKVGATE_AMX_INT8 where amx_int8 and avx512vbmi are listed
too, for amx_i24.cpp's), never `-march=native`: an AMX machine is one of the CPU classes these
kernels must run on. The kernels need nothing beyond AVX2; the AVX-512 paths give the AVX2 build's
bits (tests/test_scalar_fallback.py builds both on an AVX-512 CPU and compares every kernel bit for
bit, and the scalar build too: bit for bit but for RMSNorm and paged attention, within 1e-5).

When the build is impossible (no compiler, no ninja, a failed compile) `extension()` returns None and
`unavailable()` says why and what to install; every caller then keeps its plain PyTorch path. A compile
that the compiler refused is remembered in the cache directory (`build-failed.txt`), so later starts
skip a build of minutes that would fail the same way; another compiler, other sources or deleting the
file retries it. A compiler killed for memory or a full disk is not remembered.
`python -m kvgate.models.native` builds (as `make setup` does) and prints the outcome.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import time
from pathlib import Path

import torch

log = logging.getLogger("kvgate.native")

CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    "amx_i24.cpp",
    "amx_q4_1.cpp",
    "bindings.cpp",
    "decode_stack.cpp",
    "draw.cpp",
    "int8_dot.cpp",
    "int8_vnni.cpp",
    "layer_ops.cpp",
    "paged_attention.cpp",
    "prefill_attention.cpp",
    "q4_1_int24.cpp",
    "q8_embed.cpp",
    "tile_matmul.cpp",
)  # one module
HEADERS = (
    "amx_i24.h",
    "int8_layout.h",
    "kv_scales.h",
    "layer_rows.h",
    "q4_1_int24.h",
    "vec_exp.h",
)  # included by the sources: part of the cache key
_state: dict = {}


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    m = re.search(r"^flags\s*:(.*)$", text, re.M)
    return set(m.group(1).split()) if m else set()


def compile_flags() -> list[str]:
    flags = cpu_flags()
    isa = ["-mavx2", "-mfma", "-mf16c"] if {"avx2", "fma", "f16c"} <= flags else []
    isa += ["-mavx512f"] if "avx512f" in flags else []
    if isa and {"avx512f", "avx512bw", "avx512vl"} <= flags:  # 32 ymm registers (paged attention)
        isa += ["-mavx512bw", "-mavx512vl"]
        isa += ["-mavx512vnni"] if "avx512_vnni" in flags else []  # int8_vnni.cpp's kernels
        isa += ["-mavx512vbmi"] if "avx512vbmi" in flags else []  # q4_1_int24.cpp's byte permute
        if {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags:  # amx_q4_1.cpp (its own target attributes)
            isa += ["-DKVGATE_AMX"]
            if {"amx_int8", "avx512vbmi"} <= flags:  # amx_i24.cpp (the same; amx_q4_1.cpp asks for the tiles)
                isa += ["-DKVGATE_AMX_INT8"]
    return ["-O3", "-fopenmp", *isa]


def cache_dir() -> Path:
    base = Path(os.environ.get("KVGATE_EXT_DIR") or Path.home() / ".cache" / "kvgate" / "ext")
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update((CSRC / name).read_bytes())
    h.update(f"{torch.__version__} {' '.join(compile_flags())}".encode())
    return base / f"kvgate_native_{h.hexdigest()[:16]}"


@contextlib.contextmanager
def _build_lock(out: Path):
    """One build of a cache directory at a time, by a lock the kernel drops when its holder dies.

    torch's cpp_extension marks a build with a `lock` file and waits, without end, for that file to go.
    A build that was killed (Ctrl-C during a first `make serve`, a test's server killed mid-start)
    leaves the file behind, and every later start of kvgate then hung on it. Every kvgate build holds
    this flock first, so a `lock` file seen while holding it is a dead build's: it is removed.
    """
    with open(out / "kvgate-build.flock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another process's build of kvgate's C++ kernels in %s", out)
            fcntl.flock(fh, fcntl.LOCK_EX)
        stale = out / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build of kvgate's C++ kernels that did not finish", stale)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def extension():
    """The compiled module (built on first use, then loaded from the cache), or None."""
    if "module" in _state:
        return _state["module"]
    module, why, out = None, None, None
    try:
        _pip_ninja_on_path()
        out = cache_dir()  # hashes every source: once
        module = _cached(out)
        if module is not None:
            _apply_env_choices(module)
            _state["module"], _state["why"] = module, None
            return module
        why = _failed_before(out)
        if why is not None:
            log.warning(why)
            _state["module"], _state["why"] = None, why
            return None
        from torch.utils.cpp_extension import load

        out.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with _build_lock(out):
            module = load(
                name=out.name,
                sources=[str(CSRC / n) for n in SOURCES],
                extra_cflags=compile_flags(),
                extra_ldflags=["-fopenmp"],
                build_directory=str(out),
                verbose=False,
            )
        took = time.monotonic() - t0
        if took > 5:
            log.info("built kvgate's C++ kernels in %.0f s (cached in %s)", took, out)
    except Exception as exc:  # no compiler, no ninja, a failed build: the plain paths stay
        why = build_failure(exc)
        log.warning(why)
        if out is not None:
            _remember_failure(out, exc, why)
    if module is not None:
        _apply_env_choices(module)
    _state["module"], _state["why"] = module, why
    return module


def build_failure(exc: BaseException) -> str:
    """What a failed build tells the operator: the compiler's own error lines (not the last 300
    characters of a ninja command line), and what to do, which depends on what is missing: advising
    to install g++ and ninja where both were there misled (QA pass 7)."""
    import shutil

    text = str(exc)
    errors = [line.strip() for line in text.splitlines() if "error:" in line or "Error:" in line][:3]
    detail = " | ".join(errors) if errors else text.strip()[-300:]
    missing = [tool for tool in ("g++", "ninja") if shutil.which(tool) is None]
    fix = (
        f"Install {' and '.join(missing)} (`apt-get install g++ ninja-build`, or `pip install ninja`) and restart"
        if missing
        else f"g++ and ninja are here, so the compiler refused the sources: report this error; deleting "
        f"{cache_dir()} and restarting retries the build"
    )
    return (
        f"kvgate's C++ kernels could not be built ({type(exc).__name__}: {detail}); the LM head, --weights "
        f"gguf, decode attention and the layer ops keep their plain PyTorch paths. {fix}."
    )


def _pip_ninja_on_path() -> None:
    """The pip package's ninja, when the venv's bin is not on PATH."""
    try:
        import ninja
    except ImportError:
        return
    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"


FAILED = "build-failed.txt"
# failures that installing or freeing something, or simply waiting, may cure: never remembered (a build
# stopped with Ctrl-C, a header such as Python.h not installed yet, memory, disk)
TRANSIENT = (
    "Killed signal",
    "No space left",
    "Cannot allocate memory",
    "KeyboardInterrupt",
    "interrupted",
    "No such file or directory",
)


def _compiler_id() -> str | None:
    """The compiler and ninja a build would use (their paths and modification times), or None when
    either is missing: a remembered failure holds only for the very tools that failed."""
    import shutil

    tools = [shutil.which(t) for t in ("g++", "ninja")]
    if None in tools:
        return None
    found = " ".join(f"{os.path.realpath(t)}@{os.stat(t).st_mtime_ns}" for t in tools)
    return f"{found} CXX={os.environ.get('CXX', '')}"  # torch's cpp_extension builds with $CXX when set


def _remember_failure(out: Path, exc: BaseException, why: str) -> None:
    tools = _compiler_id()
    text = f"{type(exc).__name__}: {exc}"
    if tools is None or any(t in text for t in TRANSIENT):  # missing tools fail at once; the rest may pass
        return
    with contextlib.suppress(OSError):
        out.mkdir(parents=True, exist_ok=True)
        (out / FAILED).write_text(f"{tools}\n{time.strftime('%Y-%m-%d %H:%M:%S')}\n{why}\n")


def _failed_before(out: Path) -> str | None:
    """What a remembered failed build of these sources with these tools said, or None."""
    try:
        tools, when, why = (out / FAILED).read_text().split("\n", 2)
    except (OSError, ValueError):
        return None
    if tools != _compiler_id():
        return None
    return (
        f"not building kvgate's C++ kernels: the build of these sources failed here at {when} with the "
        f"same g++ and ninja. Delete {out / FAILED} to try again. That build said: {why.strip()}"
    )


def ready():
    """The compiled module when this process has it or the cache holds this build, else None; never
    compiles (for callers inside a step, such as the sampler: a first build takes minutes, which a
    step must not wait for; the CPU model's load builds it before any step)."""
    if "module" in _state:
        return _state["module"]
    if not _state.get("probed"):
        _state["probed"] = True
        out = cache_dir()
        if (out / f"{out.name}.so").exists():
            return extension()
    return None


def _apply_env_choices(module) -> None:
    _apply_int8_isa(module)
    _apply_prefill_isa(module)
    _apply_q4_1_decode(module)


def _apply_q4_1_decode(module) -> None:
    """`KVGATE_Q4_1_DECODE=float` keeps --weights gguf's decode rows on the float loop instead of the exact
    integer products on 24-bit activation digits (q4_1_int24.cpp: the same numbers to float32 rounding,
    other bits; the float loop is slower at most row counts, level or faster at exactly 8 and 16, where
    it has dedicated tiles: `python -m bench.q4_1_decode_ab`): for served A/B runs; unset or `int24`
    takes the integer loop."""
    how = os.environ.get("KVGATE_Q4_1_DECODE", "int24")
    try:
        module.set_q4_1_decode(how)
    except RuntimeError as exc:
        log.warning("KVGATE_Q4_1_DECODE=%s ignored: %s", how, exc)


def _apply_prefill_isa(module) -> None:
    """`KVGATE_PREFILL_ISA=float32` keeps --weights gguf's prompt rows on the float32 loop in a build that
    also has the AMX bf16 one (amx_q4_1.cpp: the same numbers to float32 rounding, other bits; about 1.5x
    slower for a 256-token prompt: A/B runs); unset or `auto` takes AMX where the kernel grants it."""
    isa = os.environ.get("KVGATE_PREFILL_ISA", "auto")
    try:
        module.set_prefill_isa(isa)
    except RuntimeError as exc:
        log.warning("KVGATE_PREFILL_ISA=%s ignored: %s", isa, exc)


def _apply_int8_isa(module) -> None:
    """`KVGATE_INT8_ISA=avx2` keeps gguf-q8act on its AVX2 tile kernels in a build that also has the
    AVX-512 VNNI ones (the same bits, about 2x slower at 16 rows and more: for A/B runs and to rule
    them out); unset or `auto` takes the fastest built. A name the build cannot take is logged."""
    isa = os.environ.get("KVGATE_INT8_ISA", "auto")
    try:
        module.set_int8_isa(isa)
    except RuntimeError as exc:
        log.warning("KVGATE_INT8_ISA=%s ignored: %s", isa, exc)


def _cached(out: Path):
    """The module already built in `out` (this source, torch and CPU flags), loaded without a compiler
    or ninja; None when there is none (or it does not load: it is rebuilt)."""
    import importlib.util

    so = out / f"{out.name}.so"
    if not so.exists():
        return None
    try:
        spec = importlib.util.spec_from_file_location(out.name, so)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except (ImportError, OSError) as exc:
        log.warning("the cached build %s did not load (%s); rebuilding it", so, exc)
        return None


def unavailable() -> str | None:
    """Why `extension()` returned None (None when it built, or was never asked)."""
    return _state.get("why")


if __name__ == "__main__":
    t = time.monotonic()
    ext = extension()
    ok = ext is not None
    print(
        f"kvgate C++ kernels: {'ready' if ok else unavailable()} ({time.monotonic() - t:.1f} s, {cache_dir()})"
        + (f"; gguf-q8act tiles: {ext.int8_isa()}; gguf prompt rows: {ext.prefill_isa()}" if ok else "")
        + (f"; gguf decode rows: {ext.q4_1_decode()}" if ok else "")
        + ("" if not ok or not ext.q4_1_amx_built() or ext.amx_unavailable() else " and AMX int8 tiles")
    )
    raise SystemExit(0 if ok else 1)
