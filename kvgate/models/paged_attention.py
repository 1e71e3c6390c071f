"""Decode attention that reads the paged K/V pool in place: a small C++ CPU kernel, its build, its probe.

`kernel()` returns `torch.ops.kvgate.paged_decode_attention` (csrc/paged_attention.cpp), built with
kvgate's other C++ kernels by `kvgate.models.native` (once per machine, cached by source, torch version
and CPU flags; a cached build loads without a compiler). Where they cannot be built (no compiler, no
ninja), native logs why and what to install, and `kernel()` returns None: the model then keeps the
gather + SDPA path.

The kernel runs all decode rows of a step in one call per layer, with no gathered copy of K/V and no
mask. Each (row, KV head) is computed by a fixed loop order whichever task runs it, so a row's output
is bit-identical whatever other rows share the step (the CPU SDPA path's results moved by ~1e-6 with
the batch).

`choose(...)` decides between it and the gather path by a short measured probe (both at 1 and 16
rows, the model's own head geometry and dtype), never by a guess; `resolve` applies the
`--decode-attention auto | paged | gather` setting. CUDA keeps the gather path: the kernel is CPU only.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time

import torch
import torch.nn.functional as F

from kvgate.models import kv_int8, native

log = logging.getLogger("kvgate.models")

CHOICES = ("auto", "paged", "gather")
PROBE_ROWS = (1, 16)
PROBE_CONTEXT = 300  # positions per probe row (the profile's decode context)
WALL_RUNS = 5  # the forecast's wall time: the median of this many runs of the one-row call (`_spaced_wall`)
SPACE_S = 0.02  # between them


@functools.cache
def kernel():
    """The compiled op (built with kvgate's other kernels by `kvgate.models.native`), or None where they
    could not be built (native logs why and what to install)."""
    if native.extension() is None:
        return None
    return torch.ops.kvgate.paged_decode_attention


def gathered(pool, scales, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`pool`'s blocks `[len(blocks), bs, KVH, D]` in `dtype`: a narrower pool widened, an int8 one's codes
    under their step and offset (`kvgate.models.kv_int8`). index_select: ~1.8x faster than pool[blocks]."""
    if scales is not None:
        return kv_int8.dequantize(pool.index_select(0, blocks), scales.index_select(0, blocks), dtype)
    return pool.index_select(0, blocks).to(dtype)


def gather_attention(q, k_pool, v_pool, tables, mask, k_scale=None, v_scale=None):
    """The gather path for decode rows sharing one padded block table: `q [R, H, D]`, `tables [R, blocks]`,
    `mask [R, 1, 1, blocks * block_size]` (True = attend). Copies each row's blocks, then runs SDPA."""
    R, H, D = q.shape
    KVH = k_pool.shape[2]
    qg = q.reshape(R, KVH, H // KVH, D)
    flat = tables.view(-1)
    kg = gathered(k_pool, k_scale, flat, q.dtype).view(R, -1, KVH, D).transpose(1, 2)  # --kv-dtype: widened
    vg = gathered(v_pool, v_scale, flat, q.dtype).view(R, -1, KVH, D).transpose(1, 2)
    return F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask).reshape(R, H, D)


def length_mask(lens: torch.Tensor, width: int) -> torch.Tensor:
    """[R, 1, 1, width] bool: position t of row r is attended when t < lens[r]."""
    return (torch.arange(width, device=lens.device) < lens[:, None]).view(-1, 1, 1, width)


def window_mask(lens: torch.Tensor, width: int, window: int) -> torch.Tensor:
    """[R, 1, 1, width] bool: as `length_mask`, and only the last `window` positions (Gemma's sliding
    layers: the row's query at position lens - 1 sees keys t with lens - 1 - t < window)."""
    t = torch.arange(width, device=lens.device)
    return ((t < lens[:, None]) & (t >= lens[:, None] - window)).view(-1, 1, 1, width)


def race(a, a_args: tuple, b, b_args: tuple, reps: int) -> tuple[float, float]:
    """Fastest CPU seconds per call of `a` and of `b` on one thread, timed alternately. The calling
    thread's own clock on one thread, as the Q8 head's probe: with wall time on all threads, other
    processes on the machine decided the race (two starts with the same flags took different prefill
    paths, whose logprobs differ by up to 0.003: QA pass 6). The fastest, not the mean: a call that
    was preempted says nothing about the kernel."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a(*a_args), b(*b_args)
        ta, tb = float("inf"), float("inf")
        for _ in range(reps):
            t0 = time.thread_time()
            a(*a_args)
            t1 = time.thread_time()
            b(*b_args)
            t2 = time.thread_time()
            ta, tb = min(ta, t1 - t0), min(tb, t2 - t1)
    finally:
        torch.set_num_threads(threads)
    return ta, tb


@functools.cache
def probe(
    heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, kv_dtype: torch.dtype
) -> dict:
    """Seconds per call of the kernel and of the gather path at each of `PROBE_ROWS` rows, on random
    data shaped like the model's, the pools in the KV cache's dtype (a few tens of ms in all)."""
    op = kernel()
    gen = torch.Generator().manual_seed(0)
    nblk = -(-PROBE_CONTEXT // block_size)
    out = {}
    for rows in PROBE_ROWS:
        pool = rows * nblk
        k, ks = kv_int8.random_pool((pool, block_size, kv_heads, head_dim), gen, kv_dtype)
        v, vs = kv_int8.random_pool((pool, block_size, kv_heads, head_dim), gen, kv_dtype)
        q = torch.randn(rows, heads, head_dim, generator=gen).to(dtype)
        tables = torch.randperm(pool, generator=gen).view(rows, nblk)
        lens = torch.full((rows,), PROBE_CONTEXT, dtype=torch.long)
        mask = length_mask(lens, nblk * block_size)
        reps = 31 if rows == 1 else 11
        a = (op, (q, k, v, tables, lens, head_dim**-0.5, ks, vs))
        b = (gather_attention, (q, k, v, tables, mask, ks, vs))
        with torch.inference_mode():
            out[rows] = race(*a, *b, reps)
            if rows == 1:  # the forecast's cost per position: wall time on the engine's threads, as served
                out["wall"] = tuple(_spaced_wall(*fn, reps) for fn in (a, b))
    return out


def _spaced_wall(fn, args: tuple, reps: int) -> float:
    """The median of WALL_RUNS runs' fastest call, SPACE_S apart. One run's best is not enough on a busy
    host: a neighbour can hold one of the engine's threads through a whole run, every call then waits at
    the team's barrier, and the reading kept for the process's life said 1000x (QA pass 16: 1 run in 8
    on a shared 2-core host; Retry-After 60 s for rows free in 11 s, for the server's whole life)."""
    runs = []
    for i in range(WALL_RUNS):
        if i:
            time.sleep(SPACE_S)
        runs.append(_fastest_wall(fn, args, max(3, reps // WALL_RUNS)))
    return statistics.median(runs)


def _fastest_wall(fn, args: tuple, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best


def choose(
    device, dtype, heads: int, kv_heads: int, head_dim: int, block_size: int, kv_dtype=None
) -> tuple[bool, str]:
    """(use the kernel?, why): the kernel where it builds and the probe measures it faster in total
    over `PROBE_ROWS`; the gather path on CUDA or where it cannot be built."""
    if torch.device(device).type != "cpu":
        return False, f"gather + SDPA (the paged kernel is CPU only; this is {device})"
    if kernel() is None:
        return False, "gather + SDPA (the paged kernel could not be built; see the log line above)"
    t = probe(heads, kv_heads, head_dim, block_size, dtype, kv_dtype or dtype)
    timings = ", ".join(f"{r} rows {t[r][0] * 1e3:.3f} ms vs {t[r][1] * 1e3:.3f} ms" for r in PROBE_ROWS)
    paged = sum(t[r][0] for r in PROBE_ROWS) < sum(t[r][1] for r in PROBE_ROWS)
    name = "paged kernel" if paged else "gather + SDPA"
    log.info("decode attention probe per layer at %d positions, kernel vs gather: %s", PROBE_CONTEXT, timings)
    # the plan's note stays the same from run to run (`kvgate plan` equals the engine's plan): no timings
    rows = " and ".join(str(r) for r in PROBE_ROWS)
    return (
        paged,
        f"{name} (auto: the startup probe measured it the faster over {rows} rows; the log has the times)",
    )


def resolve(
    setting: str, device, dtype, heads: int, kv_heads: int, head_dim: int, block_size: int, kv_dtype=None
):
    """Apply `--decode-attention`: auto = `choose`; paged = insist (an error where it cannot run);
    gather = the index_select + SDPA path. Returns (use the kernel?, a line saying what and why)."""
    if setting not in CHOICES:
        raise ValueError(f"--decode-attention {setting!r} is not one of {', '.join(CHOICES)}")
    if setting == "gather":
        return False, "gather + SDPA (--decode-attention gather)"
    if setting == "paged":
        if torch.device(device).type != "cpu":
            raise ValueError(
                f"--decode-attention paged is a CPU kernel; this is {device}. Use auto or gather."
            )
        if kernel() is None:
            raise ValueError(
                "--decode-attention paged: the kernel could not be built (the log line above says why); "
                "install what it names, or use auto or gather"
            )
        return True, "paged kernel (--decode-attention paged)"
    return choose(device, dtype, heads, kv_heads, head_dim, block_size, kv_dtype)


def position_seconds(
    device, dtype, heads: int, kv_heads: int, head_dim: int, block_size: int, kv_dtype, paged: bool
) -> float:
    """Seconds one decode row's attention adds to a layer's step per context position, from the probe's
    one-row wall time on the engine's threads on the path that serves (cached: no new timing; the race
    that picks the path counts one thread's CPU time, which a forecast must not take for a step's);
    the TTFT forecast and Retry-After use it for the steps growing as the rows' contexts grow. One row's cost per position is the largest
    (more rows share the threads better): a forecast that errs, errs late. 0 where nothing was probed
    (CUDA, or no kernel to race)."""
    if torch.device(device).type != "cpu" or kernel() is None:
        return 0.0
    t = probe(heads, kv_heads, head_dim, block_size, dtype, kv_dtype or dtype)
    return t["wall"][0 if paged else 1] / PROBE_CONTEXT
