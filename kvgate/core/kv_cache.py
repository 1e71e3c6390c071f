"""The paged KV cache: one preallocated pool of blocks, and the manager that alone hands them out.

`KVPool` owns the physical tensors, `[layers, num_blocks, block_size, kv_heads, head_dim]` for K and
for V, allocated once at startup from the KV byte budget: a block handed out is real memory, not an
estimate.

`KVCacheManager` owns every block id: the free pool, the prefix cache and each request's block table.
Nothing outside this module picks, stores or frees a block id: the scheduler asks
`allocate_for(request_id, ...)`, reads `table(request_id)` into its step output, reports prefill
progress with `commit(request_id, computed)`, and calls `free(request_id)` on the request's single exit.

The prefix cache. Every *full* prompt block has a hash chained on its parent's (`prompt_block_hashes`:
blake2b over the parent hash and the block's token ids, rooted in the model's identity). Once a
request has computed such a block, the block is registered under its hash; a later request whose
prompt starts with the same blocks references them instead of computing them again. Blocks are
refcounted. A block no request references stays cached, *evictable*, in least-recently-released
order, until its space is needed. A request's table starts with its shared blocks; only its last,
partial prompt block and its output blocks are its own, so nothing shared is ever written again and
no copy-on-write exists. A prompt's last token is always computed (its logits are needed), so at most
`(prompt - 1) // block_size` leading blocks are taken from the cache.

Invariants, checked by `check()` in the tests after every step:
- `free + evictable + referenced == total`, a referenced block counted once however many tables hold it;
- a block's refcount is the number of tables holding it; never negative; a free block has none and no
  hash; an evictable block has a hash and refcount 0;
- admission may evict only evictable blocks, oldest first: a block an admitted request references is
  never evicted, so an admitted request always completes.

Only the engine's worker thread calls the mutating methods; other threads read counts from the
engine's published snapshot, never from here.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from kvgate.models import kv_int8

if TYPE_CHECKING:
    from kvgate.config import ModelSpec


def blocks_for(positions: int, block_size: int) -> int:
    return max(1, -(-positions // block_size))


def cacheable_blocks(prompt_len: int, block_size: int) -> int:
    """Leading prompt blocks that may come from the cache: full, and before the last prompt token."""
    return max(0, (prompt_len - 1) // block_size)


def choice_blocks(prompt_len: int, max_tokens: int, n: int, block_size: int) -> int:
    """Blocks `n` choices of one prompt hold together: each `ceil((prompt + max_tokens) / bs)`, the
    prompt's cacheable blocks shared (referenced once) when there are several."""
    per = blocks_for(prompt_len + max_tokens, block_size)
    shared = cacheable_blocks(prompt_len, block_size) if n > 1 else 0
    return per + (n - 1) * (per - shared)


def prompt_block_hashes(
    tokens: list[int], block_size: int, root: bytes, salt: str | None = None
) -> list[bytes]:
    """The chained hash of every full block of `tokens`: block i's hash covers blocks 0..i. A `salt`
    (vLLM's `cache_salt`) joins the root, so no salted block hash equals an unsalted one or one of
    another salt: such prompts never share blocks (the length prefix keeps `a` + `bc` from `ab` + `c`)."""
    out: list[bytes] = []
    parent = root
    if salt is not None:
        raw = salt.encode("utf-8", "surrogatepass")  # JSON may carry a lone surrogate
        parent = root + b"\x00salt" + len(raw).to_bytes(4, "little") + raw
    for i in range(len(tokens) // block_size):
        ids = array("q", tokens[i * block_size : (i + 1) * block_size]).tobytes()
        parent = hashlib.blake2b(parent + ids, digest_size=16).digest()
        out.append(parent)
    return out


class KVPool:
    """K and V for every layer; an int8 pool (`--kv-dtype int8`, `kvgate.models.kv_int8`) also holds a
    float32 step and offset per (layer, block, position, KV head) in `k_scale` / `v_scale`
    `[layers, blocks, block_size, kv_heads, 2]` (None otherwise)."""

    def __init__(
        self, spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        shape = (spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.k_scale = self.v_scale = None
        if kv_int8.is_int8(dtype):
            self.k_scale = torch.zeros((*shape[:-1], 2), dtype=torch.float32, device=device)
            self.v_scale = torch.zeros((*shape[:-1], 2), dtype=torch.float32, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size

    def scales(self, layer: int):
        """Layer `layer`'s (k_scale, v_scale) `[blocks, block_size, kv_heads, 2]`, or (None, None)."""
        if self.k_scale is None:
            return None, None
        return self.k_scale[layer], self.v_scale[layer]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The PyTorch glue's K/V write (the C++ layer ops write their own): tokens' `k, v [T, kv_heads,
        head_dim]` into layer `layer` at `slots`, rounded to the pool's dtype, or as int8 codes with
        their steps and offsets (`kv_int8.write`: the C++ write's bits)."""
        if self.k_scale is not None:
            kv_int8.write(self.k[layer], self.k_scale[layer], slots, k)
            kv_int8.write(self.v[layer], self.v_scale[layer], slots, v)
            return
        kvh, d = k.shape[-2:]
        self.k[layer].view(-1, kvh, d).index_copy_(0, slots, k.to(self.k.dtype))
        self.v[layer].view(-1, kvh, d).index_copy_(0, slots, v.to(self.v.dtype))

    @property
    def nbytes(self) -> int:
        tensors = [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


class DoubleRelease(AssertionError):
    """A block was given back that is already free: two owners thought they held it."""


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.total = num_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest ids are handed out first
        self._is_free = bytearray(b"\x01") * num_blocks  # identity, not a count, detects double release
        self._ref = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refcount 0, hashed; oldest first
        self._tables: dict[int, list[int]] = {}
        self._hashes: dict[int, list[bytes]] = {}  # a request's full prompt-block hashes, to register
        self._registered: dict[int, int] = {}  # leading blocks of a request already looked at
        self.version = 0  # bumped whenever the set of registered hashes changes

    # ---- counts -------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def cached_blocks(self) -> int:
        """Evictable: cached, referenced by no request."""
        return len(self._evictable)

    @property
    def referenced_blocks(self) -> int:
        return self.total - len(self._free) - len(self._evictable)

    @property
    def available_blocks(self) -> int:
        """What admission can hand out now: free blocks plus evictable ones."""
        return len(self._free) + len(self._evictable)

    def blocks_needed(self, positions: int) -> int:
        return blocks_for(positions, self.block_size)

    def registered_hashes(self) -> frozenset[bytes]:
        return frozenset(self._by_hash)

    # ---- the prefix cache -----------------------------------------------------------------------
    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` that is registered (empty when off)."""
        hits: list[int] = []
        if self.prefix_cache:
            for h in hashes:
                b = self._by_hash.get(h)
                if b is None:
                    break
                hits.append(b)
        return hits

    def available_with(self, shared: list[int]) -> int:
        """Blocks admission could hand out beside `shared` (evictable ones among them stop being so)."""
        return self.available_blocks - sum(1 for b in shared if self._ref[b] == 0)

    # ---- a request's blocks ---------------------------------------------------------------------
    def allocate_for(
        self, request_id: int, positions: int, shared: list[int] = (), hashes: list[bytes] = ()
    ) -> bool:
        """Give `request_id` a table for `positions`: the `shared` blocks (cache hits, or a group
        leader's prompt blocks) referenced first, then new blocks. All or nothing: False, and nothing
        changed, if the new blocks are not available now. `hashes`: the request's full prompt-block
        hashes, registered as `commit` reports them computed."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id} already holds {len(self._tables[request_id])} blocks")
        shared = list(shared)
        need = blocks_for(positions, self.block_size) - len(shared)
        if need < 0:
            raise ValueError(f"{len(shared)} shared blocks are more than {positions} positions need")
        if need > self.available_with(shared):
            return False
        for b in shared:
            if self._ref[b] == 0:
                self._evictable.pop(b)
            self._ref[b] += 1
        table = shared + [self._take_new() for _ in range(need)]
        self._tables[request_id] = table
        if self.prefix_cache and hashes:
            self._hashes[request_id] = list(hashes)
            self._registered[request_id] = len(shared)
        return True

    def _take_new(self) -> int:
        if self._free:
            b = self._free.pop()
            self._is_free[b] = 0
        else:  # evict the least recently released cached block
            b, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash_of[b]]
            self._hash_of[b] = None
            self.version += 1
        self._ref[b] = 1
        return b

    def commit(self, request_id: int, computed: int) -> None:
        """`computed` positions of the request now hold their K/V: register its full prompt blocks
        among them, so later requests can share them."""
        hashes = self._hashes.get(request_id)
        if not hashes:
            return
        done = min(len(hashes), computed // self.block_size)
        start = self._registered[request_id]
        table = self._tables[request_id]
        for i in range(start, done):
            h, b = hashes[i], table[i]
            if h not in self._by_hash and self._hash_of[b] is None:
                self._by_hash[h] = b
                self._hash_of[b] = h
                self.version += 1
        self._registered[request_id] = max(start, done)
        if done == len(hashes):
            del self._hashes[request_id], self._registered[request_id]

    def holds(self, request_id: int) -> bool:
        return request_id in self._tables

    def table(self, request_id: int) -> list[int]:
        """The request's block ids in position order (block i holds positions [i*bs, (i+1)*bs))."""
        return self._tables[request_id]

    def held_by(self, request_id: int) -> int:
        t = self._tables.get(request_id)
        return 0 if t is None else len(t)

    def free(self, request_id: int) -> int:
        """Release the request's references; the number of blocks its table held (0 if none). A block
        whose last reference goes stays cached (evictable) if it is registered, else it is free. A
        reference to a block that holds none raises `DoubleRelease` and changes nothing."""
        table = self._tables.get(request_id)
        if table is None:
            return 0
        counts: dict[int, int] = {}
        for b in table:
            counts[b] = counts.get(b, 0) + 1
        bad = [b for b, n in counts.items() if self._ref[b] < n or self._is_free[b]]
        if bad:
            raise DoubleRelease(f"request {request_id} released block(s) {bad} that hold no reference of its")
        del self._tables[request_id]
        self._hashes.pop(request_id, None)
        self._registered.pop(request_id, None)
        for b in reversed(table):  # the tail first: it is the least likely to be shared again
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._hash_of[b] is not None:
                    self._evictable[b] = None
                else:
                    self._is_free[b] = 1
                    self._free.append(b)
        return len(table)

    def check(self) -> None:
        """Assert the module's invariants (see the module doc)."""
        refs = [0] * self.total
        for t in self._tables.values():
            for b in t:
                refs[b] += 1
        assert refs == self._ref, "a refcount differs from the tables holding the block"
        assert all(r >= 0 for r in self._ref), "a negative refcount"
        referenced = sum(1 for r in refs if r > 0)
        assert len(self._free) + len(self._evictable) + referenced == self.total, (
            "free + evictable + referenced != total"
        )
        assert len(self._free) == sum(self._is_free), "free list and free marks disagree"
        for b in self._free:
            assert self._ref[b] == 0 and self._hash_of[b] is None, f"free block {b} is held or hashed"
        for b in self._evictable:
            assert self._ref[b] == 0 and self._hash_of[b] is not None, (
                f"evictable block {b} is held or unhashed"
            )
        assert all(self._hash_of[b] == h for h, b in self._by_hash.items()), (
            "hash map and block hashes disagree"
        )
