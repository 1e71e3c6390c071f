"""Prefill attention (`kvgate.models.llama.prefill_attention`): it computes causal attention with grouped
heads over the chunk's paged context, whole prompts and chunks after a prefix alike, and what it
allocates stays within the step workspace's `prefill_attention` term on CPU.

Seen red: with `is_causal` for every chunk (a chunk after a prefix then attends only to the context's
first positions: test_chunk_after_a_prefix and tests/test_prefix_cache.py fail), and with the CPU term
charging 0 bytes (test_allocations_within_the_planned_term)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kvgate.models.llama import PrefillSpan, prefill_attention

H, KVH, D, BS = 6, 2, 8, 4


def reference(q, k, v, q_pos):
    """float64 softmax attention, K/V repeated per query head: q [n, H, D], k/v [ctx, KVH, D]."""
    g = H // KVH
    kr = k.double().repeat_interleave(g, 1)  # [ctx, H, D]
    vr = v.double().repeat_interleave(g, 1)
    scores = torch.einsum("nhd,thd->hnt", q.double(), kr) * D**-0.5
    allowed = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]  # [n, ctx]
    p = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hnt,thd->nhd", p, vr).reshape(q.shape[0], H * D)


def run(n: int, ctx: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    nblk = -(-ctx // BS)
    k_pool = torch.randn(nblk + 5, BS, KVH, D, generator=gen)
    v_pool = torch.randn(nblk + 5, BS, KVH, D, generator=gen)
    table = torch.randperm(nblk + 5, generator=gen)[:nblk]
    q = torch.randn(n + 3, H, D, generator=gen)  # 3 other tokens of the step come first
    q_pos = torch.arange(ctx - n, ctx)
    mask = torch.arange(ctx)[None, :] <= q_pos[:, None]
    out = prefill_attention(q, k_pool, v_pool, PrefillSpan(3, n, ctx, table, mask))
    k = k_pool[table].flatten(0, 1)[:ctx]
    v = v_pool[table].flatten(0, 1)[:ctx]
    return out, reference(q[3:], k, v, q_pos)


@pytest.mark.parametrize("n", [1, 5, 37])
def test_whole_prompt(n):
    out, ref = run(n, n)
    assert out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n, ctx", [(1, 9), (7, 30), (16, 41)])
def test_chunk_after_a_prefix(n, ctx):
    out, ref = run(n, ctx, seed=1)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


PROBE = r"""
import json, sys, torch
from kvgate.models.llama import PrefillSpan, prefill_attention
n, ctx, dt, kv = int(sys.argv[1]), int(sys.argv[2]), getattr(torch, sys.argv[3]), getattr(torch, sys.argv[4])
H, KVH, D, BS = 9, 3, 64, 16  # SmolLM2's heads
nblk = -(-ctx // BS)
k_pool = torch.randn(nblk, BS, KVH, D).to(kv)
v_pool = torch.randn(nblk, BS, KVH, D).to(kv)
q = torch.randn(n, H, D).to(dt)
mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
span = PrefillSpan(0, n, ctx, torch.arange(nblk), mask)

def hwm():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))

with torch.inference_mode():
    prefill_attention(q, k_pool, v_pool, span)  # warm up: kernels, thread pool
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # restart the high-water mark at the current RSS
    before = hwm()
    out = prefill_attention(q, k_pool, v_pool, span)
    print(json.dumps({"rise": hwm() - before, "out": out.numel() * out.element_size()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (Linux)")
@pytest.mark.parametrize(
    "n, ctx, dtype, kv",
    [
        (256, 4096, "float32", "float32"),
        (256, 256, "float32", "float32"),
        (512, 8192, "bfloat16", "bfloat16"),
        (256, 4096, "float32", "float16"),  # --kv-dtype float16: the gathers widened to float32
    ],
)
def test_allocations_within_the_planned_term(n, ctx, dtype, kv):
    """The chunk's peak RSS rise (the gathered K/V included, which the plan counts among the layer's
    activations, in the pool's dtype and widened) is at most the CPU term plus those gathers and 1 MiB
    of page and allocator rounding."""
    from kvgate.memory.workspace import _prefill_attention

    args = [sys.executable, "-c", PROBE, str(n), str(ctx), dtype, kv]
    out = subprocess.run(args, capture_output=True, text=True)
    if out.returncode != 0 and "clear_refs" in out.stderr:
        pytest.skip("/proc/self/clear_refs is not writable here: the high-water mark cannot be reset")
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    b = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    kvb = torch.tensor([], dtype=getattr(torch, kv)).element_size()
    lp = -(-ctx // 16) * 16
    kv_tok = 3 * 64 * (kvb + (b if kvb != b else 0))  # as step_workspace counts it
    gathers = 2 * lp * kv_tok
    term = _prefill_attention(n, lp, 9, 3, 64, b, kv_tok, flash=True)
    assert r["rise"] <= term + gathers + (1 << 20), (r, term, gathers)
