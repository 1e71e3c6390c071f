"""CUDA decode graphs, as the plan sees them: which step shapes are captured, and the bytes they hold.

A captured graph fixes every shape, so a decode-only step is padded to a bucket: its rows to the next of
`row_buckets` (1, 2, 4, 8, 16, then by half again in multiples of 8: 24, 32, 48, 72, ...), its
longest row's KV blocks to the next of `block_buckets` (powers of two from `MIN_BLOCKS`, and the longest a row can reach). A pair is
captured only where its padded attention, rows x blocks x block_size positions, stays within the
attention cap the eager step obeys (`StepLimits.attn_token_cap`); a step beyond every captured pair
runs eagerly. Padding rows write their K/V to one extra block that no request is ever given.

What the plan charges for them, before anything is captured (`graph_bytes`):
- `pool`: the graphs' private memory pool. They share one, captured largest first and replayed one at a
  time, so it holds the intermediates of the largest step: the step workspace's device terms for a
  decode-only step of the most rows (`decode_terms`), plus the CUDA caching allocator's rounding
  (`POOL_SLACK`) and the cuBLAS workspace of the stream they are captured on (`CUBLAS_WORKSPACE`).
  The engine measures the pool after capture and runs eagerly, saying why, should it ever hold more.
- `buffers`: the static inputs every replay reads (token ids, positions, slots, context lengths and block
  tables, int64) and the float32 logits it writes;
- `pad_block`: the extra KV block.
With `--cuda-graphs full`, steps that carry prompt chunks replay per-layer pieces
(`kvgate.models.step_pieces`): their own pool (`piece_terms` + `POOL_SLACK`) and static buffers.
"""

from __future__ import annotations

from dataclasses import replace

from kvgate.config import ModelSpec
from kvgate.memory.workspace import KERNEL_SLACK, TRANSIENT_TERMS, StepLimits, padded_len, step_workspace

MIN_BLOCKS = 8  # the narrowest captured width: 128 positions at the default block size
MIN_TOKENS = 16  # the step pieces' smallest token bucket
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


def doubling(first: int, last: int) -> list[int]:
    """first, 2 x first, 4 x first, ... below `last`, then `last`."""
    out, n = [], first
    while n < last:
        out.append(n)
        n *= 2
    return out + [last]


def block_buckets(max_blocks: int) -> list[int]:
    """Powers of two from MIN_BLOCKS, ending at `max_blocks` (the most blocks a row's context spans)."""
    return doubling(MIN_BLOCKS, max_blocks)


def token_buckets(max_tokens: int) -> list[int]:
    """The step pieces' token counts: powers of two from MIN_TOKENS, ending at a step's most tokens."""
    return doubling(MIN_TOKENS, max_tokens)


def graph_shapes(limits: StepLimits, block_size: int) -> list[tuple[int, int]]:
    """Every (rows, blocks) bucket pair whose padded attention fits the attention cap, largest first."""
    max_blocks = padded_len(limits.context, block_size) // block_size
    shapes = [
        (r, b)
        for r in row_buckets(limits.max_logit_rows)
        for b in block_buckets(max_blocks)
        if r * b * block_size <= limits.attn_token_cap
    ]
    return largest_first(shapes)


def largest_first(shapes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(rows, blocks) pairs by padded attention, largest first (more rows first among equals)."""
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
    return terms["layer_activations"] + terms["gemma"] + KERNEL_SLACK + max(terms[k] for k in TRANSIENT_TERMS)


def piece_terms(spec: ModelSpec, dtype_bytes: int, limits: StepLimits, block_size: int) -> int:
    """Peak device bytes of one step piece (`kvgate.models.step_pieces`: a layer's glue, no attention)
    at the step's most tokens: the workspace's per-layer activations and its largest non-attention
    transient. Attention and the LM head run eagerly, inside the step workspace."""
    terms = step_workspace(spec, dtype_bytes, limits, block_size)
    glue = ("embedding", "rms_norm", "residual", "rope", "mlp")
    return terms["layer_activations"] + terms["gemma"] + KERNEL_SLACK + max(terms[k] for k in glue)


def graph_bytes(
    spec: ModelSpec,
    dtype_bytes: int,
    limits: StepLimits,
    block_size: int,
    kv_block_bytes: int,
    pieces: bool = False,
) -> dict[str, int]:
    """What the decode graphs hold, by part (see the module's opening): pool, buffers, pad_block; with
    `pieces` (`--cuda-graphs full`) also the step pieces' pool and their static buffers (token ids,
    positions and slots; hidden states, q and the attention output, at the step's most tokens)."""
    shapes = graph_shapes(limits, block_size)
    out = {"pool": 0, "buffers": 0, "pad_block": 0}
    if shapes:
        rows = max(r for r, _ in shapes)
        out = {
            "pool": decode_terms(spec, dtype_bytes, limits, block_size) + POOL_SLACK + CUBLAS_WORKSPACE,
            "buffers": max(input_values(r, b) for r, b in shapes) * 8 + rows * 8 + rows * spec.vocab_size * 4,
            "pad_block": kv_block_bytes,
        }
    if pieces:
        T = limits.max_step_tokens
        out["pieces_pool"] = piece_terms(spec, dtype_bytes, limits, block_size) + POOL_SLACK
        out["pieces_buffers"] = T * 3 * 8 + T * (spec.hidden_size + 2 * spec.q_size) * dtype_bytes
        out["pad_block"] = kv_block_bytes
    return out
