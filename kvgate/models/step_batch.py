"""One engine step's inputs as the model's forward takes them: the flat token list, each decode group's
and prompt chunk's place in it, and the rows whose logits are needed; and the matmul shapes a step runs."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvgate.config import ModelSpec
from kvgate.models.paged_attention import length_mask


@dataclass
class DecodeGroup:
    """Decode rows `[start, end)` of the flat token list, padded to a common number of blocks."""

    start: int
    end: int
    block_tables: torch.Tensor  # [rows, max_blocks] long
    lens: torch.Tensor  # [rows] long, each row's context length
    width: int  # positions the padded tables cover: max_blocks * block_size

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """[rows, 1, 1, width] bool, True = attend. Built on first use: only the gather path reads it,
        and building it for every step cost a one-row step of the paged kernel ~0.04 ms."""
        return length_mask(self.lens, self.width)


@dataclass
class PrefillSpan:
    """One prompt chunk: tokens `[start, start + q_len)` at positions `[ctx_len - q_len, ctx_len)`."""

    start: int
    q_len: int
    ctx_len: int
    block_table: torch.Tensor  # [blocks covering ctx_len] long
    mask: torch.Tensor  # [q_len, ctx_len] bool, True = attend (shared by the query heads)


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slots: torch.Tensor  # [T] long, flat slot index (block * block_size + offset) for each new K/V
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSpan]
    logits_index: torch.Tensor  # [S] long, the tokens whose next-token logits are needed
    # the decode rows (tokens [0, R) of the step), for the paged kernel: each row's block table padded
    # with block 0 to the longest row's, and its context length (position + 1)
    decode_tables: torch.Tensor | None = None  # [R, max_blocks] long
    decode_lens: torch.Tensor | None = None  # [R] long


def matmul_shapes(spec: ModelSpec, step_tokens: int, logit_rows: int) -> list[tuple[int, int, int]]:
    """(out_features, in_features, max rows) of each distinct matmul the forward runs."""
    h, q, kv = spec.hidden_size, spec.q_size, spec.kv_size
    per_layer = [(q + 2 * kv, h), (h, q), (2 * spec.intermediate_size, h), (h, spec.intermediate_size)]
    return [(n, k, step_tokens) for n, k in per_layer] + [(spec.vocab_size, h, logit_rows)]
