"""What the process holds besides the ledger's tensors (the plan's runtime overhead), measured.

`runtime_overhead_bytes` reads the process's resident memory after the checkpoint is loaded and adds a
fixed slack; on CUDA, where the ledger covers device memory, it is a fixed allowance.
"""

from __future__ import annotations

import ctypes
import gc
import os

OVERHEAD_SLACK = 192 << 20  # allocator arenas, thread stacks, HTTP buffers beyond the measured baseline
# What the measured baseline moves between two processes with the same flags: `kvgate plan` against
# `kvgate serve` came out 0.5 MiB apart in session 33 (serve higher) and 5 MiB in session 29 (plan
# higher), and 3.8 MiB over plan's 2 MiB margin in QA pass 7 (serve higher, twice, session 34). `kvgate
# plan` adds it to its measurement, so a server never gets a smaller pool than the plan promised, and a
# "raise --memory-limit to at least" advice adds it, so the next start fits too.
OVERHEAD_DRIFT = 8 << 20


def overhead_drift(device: str) -> int:
    """`OVERHEAD_DRIFT` where the overhead is measured (a CPU); 0 where it is a fixed allowance (CUDA)."""
    return OVERHEAD_DRIFT if str(device).startswith("cpu") else 0


def release_free_heap() -> None:
    """Collect garbage and hand freed heap back to the OS (glibc `malloc_trim`), so a baseline read
    right after a load counts what the process holds, not what a finished conversion left behind."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def process_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def process_peak_rss_bytes() -> int | None:
    """The process's resident peak so far (VmHWM), or None where /proc does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def load_peak_warning(peak: int | None, limit: int, device: str) -> str | None:
    """What to tell an operator whose process peaked above --memory-limit while loading (CPU: the
    ledger's limit is host memory), or None."""
    if peak is None or not device.startswith("cpu") or peak <= limit:
        return None
    mib = 1 << 20
    return (
        f"loading peaked at {peak / mib:,.0f} MiB resident, above --memory-limit {limit / mib:,.0f} MiB: "
        "the checkpoint is read and checked before the ledger's plan applies (a first start also converts "
        "a GGUF; measured when the plan is made, before the model is built). "
        f"From here on the process stays within the plan; give a container at least {-(-peak // mib)} MiB."
    )


def runtime_overhead_bytes(device: str, held_tensor_bytes: int = 0) -> int:
    """What the process holds besides the ledger's tensors: measured baseline RSS plus a fixed slack.

    Measured after the checkpoint is read: the loader copies every tensor out of the file (a memory
    map would stay resident behind views), so `held_tensor_bytes` -- the loaded checkpoint, which
    becomes the planned weights -- is subtracted. What remains is the interpreter, torch, the
    tokenizer and the server's modules. A cold GGUF conversion in the same process leaves ~400 MiB of
    freed heap behind (measured on SmolLM2-135M), which `release_free_heap` gives back first.

    `kvgate plan` measures it in a process brought to the state `kvgate serve` measures it in
    (`kvgate.cli.as_served`), so the two give the same overhead and pool.

    On CUDA the ledger covers device memory only, and the CUDA context is outside torch's allocator.
    """
    if device.startswith("cuda"):
        return 512 << 20
    release_free_heap()
    return max(0, process_rss_bytes() - held_tensor_bytes) + OVERHEAD_SLACK
