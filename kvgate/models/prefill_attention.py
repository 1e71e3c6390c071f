"""Prompt-chunk attention that reads the paged K/V pool in place: a C++ CPU kernel, its probe, the choice.

`run(ext, out, q, k_pool, v_pool, span, scale)` computes one prompt chunk's causal attention
(csrc/prefill_attention.cpp) into `out` (the chunk's rows of the step's attention output), with no
gathered copy of the context and no mask tensor. The SDPA path it replaces (`sdpa` below, which
`llama` also names `prefill_attention`) gathers the chunk's blocks and runs PyTorch's CPU flash
kernel, which with a causal mask still scores
every key of its 256-key split and repeats K/V for each query head of a group: one SmolLM2 layer at
256 prompt tokens took 1.1 ms there, 0.27 ms here (Zen 5 EPYC, 2 threads).

A query's output depends on its context only (fixed key blocks from position 0, lane-wise math), so
chunking a prompt or serving part of it from the prefix cache never changes a position's bits.

`resolve(setting, ...)` applies `--prefill-attention auto | kernel | sdpa`: auto takes the kernel where
it is built for the model's geometry and a short startup probe measures it faster; kernel insists;
sdpa keeps the gather + SDPA path. CUDA, 16-bit models and head sizes that are not a multiple of the
build's vector lanes keep SDPA.
"""

from __future__ import annotations

import functools
import logging
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from kvgate.models import kv_int8, native
from kvgate.models.paged_attention import gathered, race

log = logging.getLogger("kvgate.models")

CHOICES = ("auto", "kernel", "sdpa")
PROBE_TOKENS = 128  # the probe's prompt chunk (one chunk, causal from position 0)


def unsupported(device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the kernel cannot run this model here, or None where it can."""
    if torch.device(device).type != "cpu":
        return f"the prefill kernel is CPU only; this is {device}"
    if dtype != torch.float32:
        return (
            f"the prefill kernel computes in float32; the model runs in {str(dtype).removeprefix('torch.')}"
        )
    ext = native.extension()
    if ext is None:
        return "kvgate's C++ kernels could not be built (the log line above says why)"
    lanes = ext.prefill_attention_lanes()
    if lanes == 0:
        return "this build has no vector prefill attention (it needs AVX2, FMA and F16C)"
    if head_dim % lanes:  # lanes is 8 or 16
        return f"head_dim {head_dim} is not a multiple of this build's {lanes} vector lanes"
    return None


def run(ext, out, q, k_pool, v_pool, span, scale: float, k_scale=None, v_scale=None, window: int = 0):
    """Span `span` (a `PrefillSpan`) of the step's `q [T, H, D]`, written into `out [q_len, H * D]`
    (an int8 pool with its scales, `kvgate.models.kv_int8`; `window` > 0: each query sees only the last
    `window` positions up to its own, Gemma's sliding layers)."""
    ext.prefill_attention_(
        out,
        q,
        k_pool,
        v_pool,
        span.block_table,
        span.start,
        span.q_len,
        span.ctx_len,
        scale,
        k_scale,
        v_scale,
        window,
    )


def sdpa(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    pf,
    k_scale=None,
    v_scale=None,
    window: int = 0,
):
    """The gather + SDPA path: one prompt chunk's (`pf`, a `PrefillSpan`) attention, `[q_len, heads *
    head_dim]`, from the step's `q [T, heads, D]`:
    SDPA over the chunk's gathered context with grouped heads (`enable_gqa`), causal for a prompt's first
    chunk, masked after a cached prefix or an earlier chunk. On CPU this takes SDPA's fused kernel,
    which makes no score matrix (`kvgate.memory.workspace._prefill_attention` charges what it does make).
    `window`: each query sees only the last `window` positions up to its own (Gemma's sliding layers)."""
    n = pf.q_len
    qp = q[pf.start : pf.start + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]

    def context(pool, scales):  # [1, KVH, ctx, D] in q's dtype (a narrower or int8 cache widened)
        return (
            gathered(pool, scales, pf.block_table, q.dtype).flatten(0, 1)[: pf.ctx_len].transpose(0, 1)[None]
        )

    kp, vp = context(k_pool, k_scale), context(v_pool, v_scale)
    whole = pf.ctx_len == n  # a prompt's first chunk: plain causal, no mask to read
    mask = None if whole else pf.mask
    if window and pf.ctx_len > window:  # the window, within the causal mask
        keys = torch.arange(pf.ctx_len, device=q.device)
        first = torch.arange(pf.ctx_len - n, pf.ctx_len, device=q.device)[:, None] - window
        mask, whole = (keys <= first + window) & (keys > first), False
    op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, is_causal=whole, enable_gqa=True)
    return op[0].transpose(0, 1).reshape(n, -1)


@functools.cache
def probe(
    heads: int, kv_heads: int, head_dim: int, block_size: int, kv_dtype: torch.dtype = torch.float32
) -> tuple[float, float]:
    """Fastest CPU seconds per call of the kernel and of gather + SDPA on one `PROBE_TOKENS` chunk shaped
    like the model's, the pool in the KV cache's dtype, timed alternately on one thread (`race`)."""
    ext = native.extension()
    gen = torch.Generator().manual_seed(0)
    n = PROBE_TOKENS
    nblk = -(-n // block_size)
    k, ks = kv_int8.random_pool((nblk, block_size, kv_heads, head_dim), gen, kv_dtype)
    v, vs = kv_int8.random_pool((nblk, block_size, kv_heads, head_dim), gen, kv_dtype)
    q = torch.randn(n, heads, head_dim, generator=gen)
    table = torch.randperm(nblk, generator=gen)
    out = torch.empty(n, heads * head_dim)
    scale = head_dim**-0.5
    span = SimpleNamespace(start=0, q_len=n, ctx_len=n, block_table=table, mask=None)  # a whole prompt

    def kernel():
        ext.prefill_attention_(out, q, k, v, table, 0, n, n, scale, ks, vs)

    def gather():
        sdpa(q, k, v, span, ks, vs)

    with torch.inference_mode():
        return race(kernel, (), gather, (), 7)


def resolve(
    setting: str, device, dtype, heads: int, kv_heads: int, head_dim: int, block_size: int, kv_dtype=None
):
    """Apply `--prefill-attention`. Returns (use the kernel?, a line saying what and why)."""
    if setting not in CHOICES:
        raise ValueError(f"--prefill-attention {setting!r} is not one of {', '.join(CHOICES)}")
    if setting == "sdpa":
        return False, "gather + SDPA (--prefill-attention sdpa)"
    why = unsupported(device, dtype, head_dim)
    if setting == "kernel":
        if why is not None:
            raise ValueError(f"--prefill-attention kernel cannot run: {why}. Use auto or sdpa.")
        return True, "paged kernel (--prefill-attention kernel)"
    if why is not None:
        return False, f"gather + SDPA ({why})"
    tk, ts = probe(heads, kv_heads, head_dim, block_size, kv_dtype or dtype)
    log.info(
        "prefill attention probe, one %d-token chunk per layer: kernel %.3f ms, gather + SDPA %.3f ms",
        PROBE_TOKENS,
        tk * 1e3,
        ts * 1e3,
    )
    if tk < ts:  # the plan's note stays the same from run to run: no timings in it
        return True, "paged kernel (auto: the startup probe measured it the faster; the log has the times)"
    return False, "gather + SDPA (auto: the startup probe measured it the faster; the log has the times)"
