"""Sliding-window attention in kvgate's paged CPU kernels (Gemma 3's local layers, `window` > 0): the
decode kernel and the prompt-chunk kernel compute what gather + SDPA with the window in the mask computes,
and a row's (or a query's) output keeps its own bits whatever shares the call, as without a window.

Seen red (one build, 23 of 24 failed): the decode kernel's row start left at position 0 (the window
ignored) together with the prompt kernel's lower mask left out. Not red: the prompt kernel's running max
started at -inf instead of the lowest finite float; a block with no key for a lane then computes
exp(-inf - -inf), which the vector exp's clamp (its max with the lowest argument drops a NaN) happens to
make ~0 with nothing yet summed, so the same bits: the finite start is kept so as not to rest on that.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvgate.models import native
from kvgate.models.paged_attention import gather_attention, window_mask
from kvgate.models.prefill_attention import run as run_prefill
from kvgate.models.prefill_attention import sdpa, unsupported

BS = 4


def pools(n_blocks: int, kv_heads: int, dim: int, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n_blocks, BS, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(n_blocks, BS, kv_heads, dim, generator=gen).to(dtype)
    return k, v, gen


@pytest.mark.parametrize("window", [5, 16, 130, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_rows_attend_over_their_window_only(op, window, dtype):
    """Rows of 1 to 600 positions (some inside the window, some past it, one past two 128-position
    chunks of a window), against gather + SDPA with the window in the mask."""
    heads, kv_heads, dim = 8, 2, 32
    k, v, gen = pools(200, kv_heads, dim, dtype)
    lens = torch.tensor([1, 4, 17, 37, 129, 300, 301, 599])
    width = -(-int(lens.max()) // BS)
    tables = torch.stack([torch.randperm(200, generator=gen)[:width] for _ in lens])
    q = torch.randn(len(lens), heads, dim, generator=gen)
    want = gather_attention(q, k.float(), v.float(), tables, window_mask(lens, width * BS, window))
    got = op(q, k, v, tables, lens, dim**-0.5, None, None, window)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    alone = [
        op(q[i : i + 1], k, v, tables[i : i + 1], lens[i : i + 1], dim**-0.5, None, None, window)
        for i in range(8)
    ]
    assert torch.equal(torch.cat(alone), got), "a row's bits moved with the rows beside it"


def prefill_case(ctx: int, n: int, heads: int, kv_heads: int, dim: int, seed: int = 0):
    k, v, gen = pools(-(-ctx // BS) + 3, kv_heads, dim, seed=seed)
    table = torch.randperm(k.shape[0], generator=gen)[: -(-ctx // BS)]
    q = torch.randn(n, heads, dim, generator=gen)
    q_pos = torch.arange(ctx - n, ctx).unsqueeze(1)
    span = SimpleNamespace(
        start=0, q_len=n, ctx_len=ctx, block_table=table, mask=torch.arange(ctx)[None] <= q_pos
    )
    return q, k, v, span


@pytest.mark.parametrize("window", [7, 16, 40, 100])
@pytest.mark.parametrize("ctx,n", [(150, 150), (150, 64), (90, 1), (300, 37)])
def test_a_prompt_chunk_attends_over_each_querys_window_only(window, ctx, n):
    """Whole prompts and later chunks over a cached context, windows shorter and longer than a key block
    (32) and a query tile (8 or 16 lanes), against SDPA with the window in the mask; and each query's
    output the same bits as when it is computed alone (its tile-mates bring other key blocks)."""
    why = unsupported("cpu", torch.float32, 32)
    if why is not None:
        pytest.skip(why)
    ext = native.extension()
    heads, kv_heads, dim = 6, 2, 32
    q, k, v, span = prefill_case(ctx, n, heads, kv_heads, dim)
    want = sdpa(q, k, v, span, window=window)
    got = torch.empty(n, heads * dim)
    run_prefill(ext, got, q, k, v, span, dim**-0.5, window=window)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    for i in (0, n // 2, n - 1):  # query i alone: a chunk of one at its position
        one = SimpleNamespace(
            start=i, q_len=1, ctx_len=ctx - n + i + 1, block_table=span.block_table, mask=None
        )
        alone = torch.empty(1, heads * dim)
        run_prefill(ext, alone, q, k, v, one, dim**-0.5, window=window)
        assert torch.equal(alone[0], got[i]), f"query {i}'s bits moved with its chunk"
