"""CUDA decode graphs, as the plan sees them: which step shapes are captured, and the bytes they hold.

A captured graph fixes every shape, so a decode-only step is padded to a bucket: its rows to the next of
`row_buckets` (1, 2, 4, 8, 16, 24, 32, 48, 64, ... growing by half), its longest row's KV blocks to the
next of `block_buckets` (powers of two from `MIN_BLOCKS`, and the longest a row can reach). A pair is
captured only where its padded attention, rows x blocks x block_size positions, stays within the
attention cap the eager step obeys (`StepLimits.attn_token_cap`); a step beyond every captured pair
runs eagerly. Padding rows write their K/V to one extra block that no request is ever given.

What the plan charges for them, before anything is captured (`graph_bytes`):
- `pool`: the graphs' private memory pool. They share one, captured largest first and replayed one at a
  time, so it holds the intermediates of the largest step: the step workspace's device terms for a
  decode-only step of the most rows (`decode_terms`), plus the CUDA caching allocator's rounding
  (`POOL_SLACK`) and the cuBLAS workspace of the stream they are captured on (`CUBLAS_WORKSPACE`). The engine measures the pool after capture and runs eagerly, saying why, should it
  ever hold more than this.
- `buffers`: the static inputs every replay reads (token ids, positions, slots, context lengths and block
  tables, int64) and the float32 logits it writes;
- `pad_block`: the extra KV block.
"""

from __future__ import annotations

from dataclasses import replace

from kvgate.config import ModelSpec
from kvgate.memory.workspace import KERNEL_SLACK, TRANSIENT_TERMS, StepLimits, padded_len, step_workspace

MIN_BLOCKS = 8  # the narrowest captured width: 128 positions at the default block size
# the CUDA caching allocator rounds a private pool's segments: 2 MiB for requests up to 1 MiB, 20 MiB
# for those up to 10 MiB, whole 2 MiB pages above; a decode step's few tens of distinct tensors fit in
# this (the engine checks the measured pool against the charge)
POOL_SLACK = 64 << 20
# the cuBLAS workspace PyTorch keeps for the stream the graphs are captured on (a map from handle and
# stream to a caching-allocator block): 32 MiB on Hopper, the size NVIDIA recommends there, 4 MiB before
CUBLAS_WORKSPACE = 32 << 20
INPUT_FIELDS = 4  # ids, positions, slots, context lengths: one int64 each per row, then the tables


def row_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, 48, 72, ... (from 16 each adds half, in multiples of 8), ending at `max_rows`."""
    out, r = [], 1
    while r < max_rows:
        out.append(r)
        r = r * 2 if r < 16 else r + r // 2 // 8 * 8
    return out + [max_rows]


def block_buckets(max_blocks: int) -> list[int]:
    """Powers of two from MIN_BLOCKS, ending at `max_blocks` (the most blocks a row's context spans)."""
    out, b = [], MIN_BLOCKS
    while b < max_blocks:
        out.append(b)
        b *= 2
    return out + [max_blocks]


def graph_shapes(limits: StepLimits, block_size: int) -> list[tuple[int, int]]:
    """Every (rows, blocks) bucket pair whose padded attention fits the attention cap, largest first."""
    max_blocks = padded_len(limits.context, block_size) // block_size
    shapes = [
        (r, b)
        for r in row_buckets(limits.max_logit_rows)
        for b in block_buckets(max_blocks)
        if r * b * block_size <= limits.attn_token_cap
    ]
    return sorted(shapes, key=lambda s: (-s[0] * s[1], -s[0]))


def input_values(rows: int, blocks: int) -> int:
    """int64 values one replay of a (rows, blocks) graph reads: four per row, then its block table."""
    return rows * (INPUT_FIELDS + blocks)


def decode_terms(spec: ModelSpec, dtype_bytes: int, limits: StepLimits, block_size: int) -> int:
    """Peak device bytes of one decode-only step of the most rows: the workspace's standing device term
    (the per-layer activations) and its largest transient, at prefill chunk 0. The step inputs are the
    static buffers (charged apart); the rows' host objects, penalties and grammars are not on the device."""
    rows = limits.max_logit_rows
    decode = replace(limits, prefill_chunk=0, max_seqs=rows, speculate=0)
    terms = step_workspace(spec, dtype_bytes, decode, block_size)
    return terms["layer_activations"] + KERNEL_SLACK + max(terms[k] for k in TRANSIENT_TERMS)


def graph_bytes(
    spec: ModelSpec, dtype_bytes: int, limits: StepLimits, block_size: int, kv_block_bytes: int
) -> dict[str, int]:
    """What the decode graphs hold, by part (see the module's opening): pool, buffers, pad_block."""
    shapes = graph_shapes(limits, block_size)
    if not shapes:
        return {"pool": 0, "buffers": 0, "pad_block": 0}
    rows = max(r for r, _ in shapes)
    return {
        "pool": decode_terms(spec, dtype_bytes, limits, block_size) + POOL_SLACK + CUBLAS_WORKSPACE,
        "buffers": max(input_values(r, b) for r, b in shapes) * 8 + rows * 8 + rows * spec.vocab_size * 4,
        "pad_block": kv_block_bytes,
    }
