"""Turn the scheduler's choice for one step into the tensors the model reads (`StepBatch`).

Decode rows come first in the flat token list, sorted by context length (longest first). Each has its
block table (padded with block 0 to the longest row's) and context length, for the paged kernel that
runs them all in one call (`kvgate.models.paged_attention`); they are also split into groups whose
padded attention (`rows x longest context`) stays within `attn_token_cap` tokens, for the gather path:
that cap is what bounds the attention workspace the memory planner reserves. Prefill chunks follow.

A decode-only step on an engine with CUDA graphs is built as a graph's inputs instead
(`build_graph_step`): the same rows in the same order, padded to a captured bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgate.models.decode_graphs import DecodeGraphs, GraphStep
from kvgate.models.llama import DecodeGroup, PrefillSpan, StepBatch


@dataclass(slots=True)
class DecodeInput:
    request_id: int
    token: int
    position: int  # position of `token`; context after the step is position + 1
    blocks: list[int]  # the request's block table (read, never changed, here)


@dataclass(slots=True)
class PrefillInput:
    request_id: int
    tokens: list[int]
    start: int  # position of tokens[0]
    blocks: list[int]
    wants_logits: bool  # True when this chunk ends the prompt
    # scoring the prompt (`GenerationRequest.prompt_logprobs`): the prompt tokens that follow each of
    # this chunk's positions (one fewer than the chunk when it ends the prompt), whose log-probabilities
    # its logits rows give, and how many top alternatives each carries; None: not scored
    score: list[int] | None = None
    score_top: int = 0


@dataclass(slots=True)
class VerifyInput:
    """A decoding row's last token and its draft tokens, verified in one pass (logits at each)."""

    request_id: int
    tokens: list[int]  # the row's last token, then the drafts
    start: int  # position of tokens[0]
    blocks: list[int]


def build_step(
    decodes: list[DecodeInput],
    prefills: list[PrefillInput],
    block_size: int,
    attn_token_cap: int,
    device: torch.device,
    verifies: list[VerifyInput] = (),
) -> tuple[StepBatch, list[int], list[int], list[list[int]]]:
    """Return the batch plus, for decodes and prefills, where each input's logits row is (-1: none;
    a scored prefill's is its last position's, its chunk's rows the `len(tokens)` ending there, whether
    or not it ends the prompt), and for each verify span the logits rows of all its positions. Each
    position of a verify span runs as a decode row of its own (its token at its position, attending
    over its context): the step writes every token's K/V before any attention reads, so a draft sees
    the ones before it, and a verified token gets the decode path's computation (see
    `kvgate.core.speculate` for how exact)."""
    n_plain = len(decodes)
    decodes, order, decode_logit_row = decode_rows(decodes, verifies)
    ids: list[int] = [decodes[j].token for j in order]
    pos: list[int] = [decodes[j].position for j in order]
    slots: list[int] = []
    rows: list[list[int]] = []  # each decode row's blocks, padded with block 0 to the longest row's
    width = -(-(pos[0] + 1) // block_size) if order else 0
    for j in order:
        d = decodes[j]
        used = d.position // block_size + 1
        rows.append(d.blocks[:used] + [0] * (width - used))
        slots.append(d.blocks[d.position // block_size] * block_size + d.position % block_size)
    decode_tables = torch.tensor(rows, dtype=torch.long).view(len(order), width).to(device)
    decode_lens = torch.tensor(pos, dtype=torch.long).add_(1).to(device)
    logits_index: list[int] = list(range(len(order)))
    groups: list[DecodeGroup] = []
    i = 0
    while i < len(order):
        per_row = -(-(pos[i] + 1) // block_size) * block_size
        take = max(1, min(len(order) - i, attn_token_cap // per_row))
        nblk = per_row // block_size
        table = decode_tables[i : i + take, :nblk]
        table = table if nblk == width else table.contiguous()
        groups.append(DecodeGroup(i, i + take, table, decode_lens[i : i + take], per_row))
        i += take
    spans: list[PrefillSpan] = []
    prefill_logit_row = [-1] * len(prefills)
    for k, p in enumerate(prefills):
        n = len(p.tokens)
        ctx = p.start + n
        start = len(ids)
        ids.extend(p.tokens)
        positions = list(range(p.start, ctx))
        pos.extend(positions)
        slots.extend(p.blocks[q // block_size] * block_size + q % block_size for q in positions)
        nblk = -(-ctx // block_size)
        q_pos = torch.arange(p.start, ctx).unsqueeze(1)
        causal = torch.arange(ctx).unsqueeze(0) <= q_pos
        spans.append(
            PrefillSpan(
                start,
                n,
                ctx,
                torch.tensor(p.blocks[:nblk], dtype=torch.long, device=device),
                causal.to(device),
            )
        )
        if p.score is not None:  # logits at every position: rows [last - n + 1, last]
            logits_index.extend(range(start, start + n))
            prefill_logit_row[k] = len(logits_index) - 1
        elif p.wants_logits:
            prefill_logit_row[k] = len(logits_index)
            logits_index.append(start + n - 1)
    batch = StepBatch(
        torch.tensor(ids, dtype=torch.long, device=device),
        torch.tensor(pos, dtype=torch.long, device=device),
        torch.tensor(slots, dtype=torch.long, device=device),
        groups,
        spans,
        torch.tensor(logits_index, dtype=torch.long, device=device),
        decode_tables,
        decode_lens,
    )
    return (
        batch,
        decode_logit_row[:n_plain],
        prefill_logit_row,
        verify_rows(decode_logit_row, n_plain, verifies),
    )


def decode_rows(
    decodes: list[DecodeInput], verifies: list[VerifyInput]
) -> tuple[list[DecodeInput], list[int], list[int]]:
    """Every decode row of a step, each verify span's positions as rows of their own after the plain
    decodes; the order they run in (longest context first); and where each row's logits land (the
    inverse of that order)."""
    rows = list(decodes) + [
        DecodeInput(v.request_id, t, v.start + i, v.blocks) for v in verifies for i, t in enumerate(v.tokens)
    ]
    order = sorted(range(len(rows)), key=lambda i: -rows[i].position)
    logit_row = [0] * len(rows)
    for r, j in enumerate(order):
        logit_row[j] = r
    return rows, order, logit_row


def verify_rows(logit_row: list[int], n_plain: int, verifies: list[VerifyInput]) -> list[list[int]]:
    """Each verify span's logits rows, from the logits row of every decode row (plain decodes first)."""
    out, at = [], n_plain
    for v in verifies:
        out.append(logit_row[at : at + len(v.tokens)])
        at += len(v.tokens)
    return out


def build_graph_step(
    decodes: list[DecodeInput], verifies: list[VerifyInput], graphs: DecodeGraphs
) -> tuple[GraphStep | None, list[int], list[list[int]]]:
    """A decode-only step as the inputs of a captured graph (`kvgate.models.decode_graphs`), in
    `build_step`'s row order, with the decodes' and verify spans' logits rows; (None, [], []) where no
    captured bucket holds it (the step then runs eagerly)."""
    rows, order, logit_row = decode_rows(decodes, verifies)
    step = graphs.step(
        [rows[j].token for j in order], [rows[j].position for j in order], [rows[j].blocks for j in order]
    )
    if step is None:
        return None, [], []
    return step, logit_row[: len(decodes)], verify_rows(logit_row, len(decodes), verifies)
