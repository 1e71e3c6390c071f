"""Keep the engine's worker the only thread holding an OpenMP thread pool while it steps.

libgomp (PyTorch's OpenMP runtime on Linux) gives every thread that starts a parallel region a pool
of its own, and counts the threads of all pools together. Once that count exceeds the CPUs the
process may use, every pool's threads stop spinning at a barrier after ~100 spins and sleep on a
futex instead, so each of the ~200 parallel regions of a decode step pays a wake-up per thread. An
engine is built on one thread (loading, packing and the load-time probes run parallel regions there)
and stepped on another, its worker, so on a 2-CPU machine a built-then-started engine had two pools
and ran a one-row SmolLM2 step in ~15 ms instead of ~5.5 ms (`kvgate generate`, session 22).

`release_calling_thread_pool()` frees the calling thread's pool (OpenMP 5.0's
`omp_pause_resource_all`, soft: libgomp frees only the caller's pool, and a later parallel region on
that thread builds a new one). `Engine.start()` calls it before starting the worker, so the thread
that starts the engine (in practice the one that built it) leaves no pool behind. It changes no
number, only how threads wait.
"""

from __future__ import annotations

import ctypes
import functools
import os

OMP_PAUSE_SOFT = 1
# The runtime PyTorch loaded, found by the soname it was loaded under (RTLD_NOLOAD: never load one).
RUNTIMES = ("libgomp.so.1", "libomp.so", "libiomp5.so")


@functools.cache
def _pause_fn():
    """(omp_pause_resource_all of the runtime PyTorch loaded, '') or (None, why not); looked up once."""
    import torch  # noqa: F401  (loads the runtime PyTorch uses before we look for it)

    if not hasattr(os, "RTLD_NOLOAD"):
        return None, "this platform's dlopen has no RTLD_NOLOAD to find the loaded OpenMP runtime"
    tried = []
    for name in RUNTIMES:
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)
        except OSError:
            tried.append(name)
            continue
        fn = getattr(lib, "omp_pause_resource_all", None)
        if fn is None:
            tried.append(f"{name} (no omp_pause_resource_all)")
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn, ""
    return None, "no loaded OpenMP runtime with omp_pause_resource_all: " + ", ".join(tried)


def release_calling_thread_pool() -> str:
    """Free the calling thread's OpenMP pool, if it has one. '' when done, else why not (never raises:
    the engine runs either way, only slower where two pools make libgomp throttle its spinning)."""
    fn, why_not = _pause_fn()
    if fn is None:
        return why_not
    rc = fn(OMP_PAUSE_SOFT)
    return "" if rc == 0 else f"omp_pause_resource_all returned {rc} (called inside a parallel region?)"
