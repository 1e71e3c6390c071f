"""Token masks: one batched fill for every grammar row of a step, then -inf on the tokens it forbids.

A mask is packed: bit t of word t // 32 says whether token t may come next. `fill_bitmasks` computes
the masks of all the step's grammar rows in one call into llguidance's thread pool (the GIL is
released); rows without a grammar are not in it and pay nothing. `apply_bitmask` unpacks a mask with
numpy (little-endian bit order, so byte t // 8, bit t % 8) and fills the forbidden logits with -inf.
Logits wider than the mask (a model padded past its tokenizer) are forbidden past the mask's end.

Memory: the packed masks (rows x vocab / 8 bytes) and one unpacked row at a time (vocab bytes, twice)
are part of the plan's `grammar` term (kvgate.memory.workspace).
"""

from __future__ import annotations

import os

import llguidance
import llguidance.numpy  # not llguidance.torch: that one imports torch.compile (~1.1 s, ~120 MiB RSS)
import numpy as np
import torch


def words(vocab: int) -> int:
    return (vocab + 31) // 32


def fill_bitmasks(matchers: list[llguidance.LLMatcher], vocab: int, executor) -> torch.Tensor:
    """`[len(matchers), words(vocab)]` int32 masks, computed together."""
    bitmask = torch.zeros((len(matchers), words(vocab)), dtype=torch.int32)
    view = bitmask.numpy()  # shares the tensor's memory: llguidance writes the masks in place
    if len(matchers) == 1:
        llguidance.numpy.fill_next_token_bitmask(matchers[0], view, 0)
    else:
        pairs = [(m, i) for i, m in enumerate(matchers)]
        llguidance.numpy.fill_next_token_bitmask_par(executor, pairs, view)
    return bitmask


def new_executor() -> llguidance.LLExecutor:
    # One thread per core: the worker waits for the masks, so they use the cores it would.
    return llguidance.LLExecutor(num_threads=max(1, min(len(os.sched_getaffinity(0)), 32)))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set `logits[i, t]` to -inf where bit t of `bitmask[i]` is 0 (in place). `logits`: [n, V]."""
    n, vocab = logits.shape
    for i in range(n):
        row = logits[i]
        bits = np.unpackbits(bitmask[i].numpy().view(np.uint8), bitorder="little")
        covered = min(vocab, bits.shape[0])
        forbid = torch.from_numpy(bits[:covered].view(np.bool_)).logical_not_()
        row[:covered].masked_fill_(forbid, float("-inf"))
        if covered < vocab:
            row[covered:] = float("-inf")


def allows(bitmask_row: torch.Tensor, token: int) -> bool:
    word = token // 32
    if not 0 <= word < bitmask_row.shape[0]:
        return False
    return bool((int(bitmask_row[word]) >> (token % 32)) & 1)
