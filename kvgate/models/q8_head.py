"""The token embedding and LM head held as the checkpoint's own Q8_0 blocks (int8 codes, a scale per 32).

GGUF files keep SmolLM2's tied embedding table as Q8_0, so the float table kvgate loads is exactly
`scale x code` for every block of 32. Holding the codes and scales instead (1.125 bytes per value
instead of 4) loses nothing in the lookup: a looked-up embedding row is widened to the very same
floats. The LM head (the C++ kernel in csrc/tile_matmul.cpp, over tiles of 16 rows, `q8_pack16`)
computes each block as `scale * sum(code x)`, the factoring llama.cpp's block dots use, which differs
from the float table's dot product at float32 rounding (~1e-7 of the output), the same for every row
whatever the rows beside it. (`Q8DotTable`, at the end, is `--weights gguf-q8act`'s: it also rounds
the head's input to 8-bit blocks, which changes the logits more, as that format states.)

What it buys, measured on a 2-vCPU AVX2 EPYC (SmolLM2, 49,152 x 576, one thread, with the row layout
the tiles replaced): the head at 1 row 3.4 ms instead of 7.8 ms for oneDNN on the packed float32 copy,
7.7 against 11.8 ms at 8 rows, 15.1 against 17.3 at 16 (even at 32), and 194 MiB of weights (the float
table plus the packed head copy, 226 MiB, become 32 MiB).

Used only where it is exact: `q8_blocks` returns None unless every block round-trips bit for bit,
so a checkpoint with a genuinely float head (safetensors, a random test model) is never quantized.
"""

from __future__ import annotations

import torch

from kvgate.models import native

QBLOCK = 32


CHECK_ROWS = 2048  # table rows `q8_blocks` checks at a time (SmolLM2: 4.7 MB of float32 a piece)


def q8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(codes int8 [N, K], scales float32 [N, K / 32]) such that `scales * codes` is `weight` bit for
    bit in float32, or None when no such blocks exist (the weight was not Q8_0 to begin with)."""
    n, k = weight.shape
    if k % QBLOCK or weight.dtype != torch.float32:
        return None
    codes = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, k // QBLOCK, dtype=torch.float32)
    # rows a piece at a time: the float temporaries of a whole table (three of SmolLM2's 113 MB) were
    # most of the load's transient peak over --memory-limit (QA pass 6)
    for at in range(0, n, CHECK_ROWS):
        blocks = weight[at : at + CHECK_ROWS].reshape(-1, k // QBLOCK, QBLOCK)
        s = blocks.abs().amax(-1) / 127.0
        safe = torch.where(s > 0, s, torch.ones_like(s))
        q = torch.round(blocks / safe.unsqueeze(-1))
        if q.abs().amax() > 127:
            return None
        q = q.to(torch.int8)
        if not torch.equal(s.unsqueeze(-1) * q.float(), blocks):
            return None
        codes[at : at + CHECK_ROWS] = q.view(-1, k)
        scales[at : at + CHECK_ROWS] = s
    return codes, scales


ROWS16 = 16  # table rows per tile of `Q8Table`
ROWS16_BLOCK = ROWS16 * QBLOCK + ROWS16 * 4  # a tile's bytes per block: int8 codes, then float32 scales


def _pad_rows(codes: torch.Tensor, scales: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """codes and scales with zero rows appended up to T = ceil(N / rows) tiles of `rows`; and T."""
    n, nb = scales.shape
    t = -(-n // rows)
    if t * rows > n:
        codes = torch.cat([codes, codes.new_zeros(t * rows - n, codes.shape[1])])
        scales = torch.cat([scales, scales.new_zeros(t * rows - n, nb)])
    return codes, scales, t


def q8_bytes(vocab: int, hidden: int) -> int:
    """Bytes of a Q8 table: one byte per value plus a float32 scale per 32 values, over the rows padded
    to a multiple of 16 (`q8_pack16`)."""
    return -(-vocab // ROWS16) * (hidden // QBLOCK) * ROWS16_BLOCK


def q8_pack16(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`q8_blocks`'s (codes int8 [N, K], scales [N, K/32]) as uint8 tiles [ceil(N/16), K/32, 576]: in tile
    t, block b, byte 16 k + j is row 16 t + j's code for k, and bytes 512.. are the 16 rows' scales as
    float32. Padding rows are zero codes and scales."""
    nb = codes.shape[1] // QBLOCK
    if codes.shape[0] == 0:
        return torch.empty(0, nb, ROWS16_BLOCK, dtype=torch.uint8, device=codes.device)
    codes, scales, t = _pad_rows(codes, scales, ROWS16)
    c = codes.view(t, ROWS16, nb, QBLOCK).permute(0, 2, 3, 1).reshape(t, nb, ROWS16 * QBLOCK)
    s = scales.view(t, ROWS16, nb).transpose(1, 2).contiguous().view(torch.uint8)
    return torch.cat([c.view(torch.uint8), s], dim=-1).contiguous()


class Q8Table:
    """A [vocab, hidden] table as Q8 blocks in tiles of 16 rows (`q8_pack16`): `embed(ids)` looks rows
    up, `__call__(x)` is the LM head `x @ table.T` in float32 (the kernel from `kvgate.models.native`)."""

    __slots__ = ("tiles", "rows", "nbytes", "_ext")

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor):
        self.tiles, self.rows = q8_pack16(codes, scales), codes.shape[0]
        self.nbytes = self.tiles.numel()
        self._ext = native.extension()
        if self._ext is None:
            raise RuntimeError(native.unavailable() or "kvgate's C++ kernels are unavailable")

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` as `dtype`: each row's codes and scales gathered from its tile, widened as the float
        table holds them (csrc/q8_embed.cpp; ids outside the table raise IndexError, as index_select)."""
        rows = self._ext.q8_embed(self.tiles, ids, self.rows, ROWS16)
        return rows if dtype == torch.float32 else rows.to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._ext.q8_matmul(x.float(), self.tiles, self.rows)


# auto keeps the Q8 head unless the plain one measures clearly faster. The probe's slice is cache-hot
# (19 MB), which flatters the float head: in serving the whole 49,152-row head streams from memory
# (3.4 against 7.8 ms at one row, one thread). And two probes a few percent apart must not flip the
# choice between `kvgate plan` and the engine. On the 2-vCPU EPYC: Q8 1.64 ms against 1.88-2.66 ms
# for the plain head, 12 probes.
KEEP_WITHIN = 1.5  # what it must catch: a CPU where the kernel is several times slower (no AVX2)


def keep_q8(q8_ms: float, plain_ms: float) -> bool:
    """The probe's verdict: keep the Q8 head unless it is more than KEEP_WITHIN times the plain head's
    time (it also holds the table in a quarter of the bytes and drops the packed copy)."""
    return q8_ms <= plain_ms * KEEP_WITHIN


def probe(
    codes: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype,
    packed: bool,
    reps: int = 7,
    dot8: bool = False,
) -> dict:
    """Time the Q8 head against the plain one it would replace on an 8,192-row slice, at 1 and 8 rows:
    {"q8_ms", "plain_ms", "keep": bool (`keep_q8`)}. Each is the least CPU time of `reps` calls on one thread
    (the calling thread's own clock), so other work on a busy machine does not decide it; both kernels
    split their output features over threads alike. `dot8`: time `Q8DotTable` (gguf-q8act's head)."""
    from kvgate.models.linear import Linear

    n = min(8192, codes.shape[0])
    q8 = (Q8DotTable if dot8 else Q8Table)(codes[:n].contiguous(), scales[:n].contiguous())
    plain = Linear(
        (scales[:n].unsqueeze(-1) * codes[:n].float().view(n, -1, QBLOCK)).view(n, -1).to(dtype), None, packed
    )
    q8_ms, plain_ms = one_thread_ms((q8, plain), codes.shape[1], dtype, reps)
    return {"q8_ms": round(q8_ms, 3), "plain_ms": round(plain_ms, 3), "keep": keep_q8(q8_ms, plain_ms)}


def one_thread_ms(kernels, k: int, dtype: torch.dtype, reps: int) -> list[float]:
    """Each kernel's least thread CPU time (ms) over `reps` calls, summed over inputs of 1 and 8 rows of `k`
    values, on one torch thread (the calling thread's own clock: other work on a busy machine does not
    decide it). The head probes' measure (this one's and `kvgate.models.head_blocks.probe`)."""
    import time

    def ms(fn, x) -> float:
        fn(x)
        best = float("inf")
        for _ in range(reps):
            t0 = time.thread_time()
            fn(x)
            best = min(best, time.thread_time() - t0)
        return best * 1e3

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            xs = [torch.randn(rows, k).to(dtype) for rows in (1, 8)]
            return [sum(ms(fn, x) for x in xs) for fn in kernels]
    finally:
        torch.set_num_threads(threads)


TILE = 8  # table rows per tile of `Q8DotTable`
TILE_BLOCK = TILE * QBLOCK + TILE * 4  # a tile's bytes per block: int8 codes, then float32 scales


def q8_dot_bytes(vocab: int, hidden: int) -> int:
    """Bytes of a `Q8DotTable`: `q8_bytes` over the rows padded to a multiple of 8."""
    return -(-vocab // TILE) * (hidden // QBLOCK) * TILE_BLOCK


def q8_pack8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`q8_blocks`'s (codes int8 [N, K], scales [N, K/32]) as uint8 tiles [ceil(N/8), K/32, 288]: in tile
    t, block b, byte 32 g + 4 n + j is row 8t + n's code for k = 4g + j, and bytes 256.. are the 8 rows'
    scales as float32. Padding rows are zero codes and scales."""
    nb = codes.shape[1] // QBLOCK
    codes, scales, t = _pad_rows(codes, scales, TILE)
    c = codes.view(t, TILE, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(t, nb, TILE * QBLOCK)
    s = scales.view(t, TILE, nb).transpose(1, 2).contiguous().view(torch.uint8)
    return torch.cat([c.view(torch.uint8), s], dim=-1).contiguous()


class Q8DotTable(Q8Table):
    """A Q8 table for `--weights gguf-q8act`: held in tiles of 8 rows (`q8_pack8`), the LM head rounds
    its input rows to 8-bit blocks and sums integer products (csrc/int8_dot.cpp), as the layers do.
    The lookup gathers a row's codes and scales from the tiles: the same floats as `Q8Table.embed`."""

    __slots__ = ("packed",)

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor):
        super().__init__(codes[:0], scales[:0])  # the tiles below hold the table
        self.packed, self.rows = q8_pack8(codes, scales), codes.shape[0]
        self.nbytes = self.packed.numel()

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows = self._ext.q8_embed(self.packed, ids, self.rows, TILE)
        return rows if dtype == torch.float32 else rows.to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._ext.q8_dot8(x.float(), self.packed, self.rows)
