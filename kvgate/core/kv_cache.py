"""The paged KV cache: one preallocated pool of blocks, and the manager that alone hands them out.

`KVPool` owns the physical tensors, `[layers, num_blocks, block_size, kv_heads, head_dim]` for K and
for V, allocated once at startup from the KV byte budget: a block handed out is real memory, not an
estimate.

`KVCacheManager` owns every block id: the free pool and each request's block table. A request takes
every block it can ever need at admission (`ceil((prompt + max_tokens) / block_size)`) and gives them
back exactly once when it leaves; integer blocks need no watermark or pressure heuristics to stay
exact. Nothing outside this module picks, stores or frees a block id: the scheduler asks
`allocate_for(request_id, n)`, reads `table(request_id)` into its step output, and calls
`free(request_id)` on the request's single exit.

Invariant (checked by `check()` in the tests): `free + held == total`, where `held` is the sum of the
live tables' lengths and no block is both free and in a table, or in two tables.

Only the engine's worker thread calls the mutating methods (`allocate_for`, `free`); other threads
read counts from the engine's published snapshot, never from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
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


class DoubleRelease(AssertionError):
    """A block was given back that is already free: two owners thought they held it."""


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.total = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest ids are handed out first
        self._is_free = bytearray(b"\x01") * num_blocks  # identity, not a count, detects double release
        self._tables: dict[int, list[int]] = {}

    # ---- counts -------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def held_blocks(self) -> int:
        return self.total - len(self._free)

    def blocks_needed(self, positions: int) -> int:
        return blocks_for(positions, self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    # ---- a request's blocks ---------------------------------------------------------------------
    def allocate_for(self, request_id: int, n: int) -> bool:
        """Give `request_id` a table of `n` blocks, all or none. False (nothing changed) if they are not
        free now. A request holds one table for its whole life."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id} already holds {len(self._tables[request_id])} blocks")
        if n < 1:
            raise ValueError(f"a request needs at least one block, asked for {n}")
        if n > len(self._free):
            return False
        taken = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        for b in taken:
            self._is_free[b] = 0
        self._tables[request_id] = taken
        return True

    def holds(self, request_id: int) -> bool:
        return request_id in self._tables

    def table(self, request_id: int) -> list[int]:
        """The request's block ids in position order (block i holds positions [i*bs, (i+1)*bs))."""
        return self._tables[request_id]

    def held_by(self, request_id: int) -> int:
        t = self._tables.get(request_id)
        return 0 if t is None else len(t)

    def free(self, request_id: int) -> int:
        """Return the request's blocks to the pool; the number returned (0 if it held none). A block
        already free raises `DoubleRelease` and nothing is returned."""
        table = self._tables.pop(request_id, None)
        if table is None:
            return 0
        dup = [b for b in table if self._is_free[b]]
        if dup or len(set(table)) != len(table):
            self._tables[request_id] = table
            raise DoubleRelease(
                f"request {request_id} released block(s) {dup or table} that are already free"
            )
        for b in reversed(table):
            self._is_free[b] = 1
            self._free.append(b)
        return len(table)

    def check(self) -> None:
        """Assert the invariant: every block is free or in exactly one table, never both."""
        in_tables = [b for t in self._tables.values() for b in t]
        assert len(in_tables) == len(set(in_tables)), "a block is in two tables"
        assert not any(self._is_free[b] for b in in_tables), "a block is both free and held"
        assert len(self._free) == sum(self._is_free), "free list and free marks disagree"
        assert len(self._free) + len(in_tables) == self.total, "blocks leaked or invented"
