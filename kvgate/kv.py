"""The paged KV cache: one preallocated pool of blocks and the integer ledger that hands them out.

`KVPool` owns the physical tensors, `[layers, num_blocks, block_size, kv_heads, head_dim]` for K and
for V, allocated once at startup from the KV byte budget: a block handed out is real memory, not an
estimate. `BlockAllocator` is the per-request ledger over those blocks. A request takes every block it
can ever need at admission (`ceil((prompt + max_tokens) / block_size)`) and gives them back exactly
once when it leaves; integer blocks need no watermark or pressure heuristics to stay exact.
"""

from __future__ import annotations

import threading

import torch

from kvgate.config import ModelSpec


def blocks_for(positions: int, block_size: int) -> int:
    return max(1, -(-positions // block_size))


class KVPool:
    def __init__(
        self, spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        shape = (spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class BlockAllocator:
    """Free list of block ids. Thread-safe reads of the counters; mutation happens on the worker."""

    def __init__(self, num_blocks: int):
        self.total = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._lock = threading.Lock()

    @property
    def free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """All `n` blocks or none: a refused allocation leaves the free list untouched."""
        with self._lock:
            if n > len(self._free):
                return None
            taken = self._free[-n:] if n else []
            del self._free[len(self._free) - n :]
            return taken[::-1]

    def release(self, blocks: list[int]) -> None:
        with self._lock:
            if len(self._free) + len(blocks) > self.total:
                raise AssertionError("released more KV blocks than exist: a double release")
            self._free.extend(reversed(blocks))
