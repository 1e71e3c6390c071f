"""The LM head held as a GGUF file's own blocks (Q6_K, Q4_K, Q5_K, Q8_0 ...), not widened to float32.

llama.cpp's Q4_K_M and Q5_K_M files keep the output matrix (with tied embeddings: the token table) as
Q6_K. Widened to float32, Llama 3.2 1B's 128,256 x 2,048 head is 1.05 GB that every decode step reads,
more than its layers' blocks, and a prepacked copy for the matmul doubles the memory (the lookup keeps
the plain table). Held as its blocks in the tile formats of `kvgate.models.block_formats` (Q6_K: q8d,
1.25 B a value) the step reads 328 MB of it, and a tied table is held only as those tiles (`BlockTable`:
the lookup reads rows out of them).

As the layer matrices: the codes are recovered from the float values with the file's scales (the
converter writes the head's d and m too) and accepted only where they give back every value bit for
bit, so the head computes the file's numbers to float32 rounding (`block_matmul`'s per-block factoring,
~1e-7 of a logit), every row alike whatever the rows beside it (all rows take the decode loop). The
table is recovered a slice of rows at a time (the whole table's float temporaries would be the load's
peak), each slice into the one format all of them fit (`head_format`, `WIDER`). Exact Q8_0 tied tables
are left to `kvgate.models.q8_head` and its --q8-head setting (its lookup reads the blocks too).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch

from kvgate.models import native
from kvgate.models.block_formats import TILE, BlockLinear, block_bytes, block_pack16, file_codes
from kvgate.models.q8_head import one_thread_ms, q8_pack16

if TYPE_CHECKING:
    from kvgate.models.hf_loader import LoadedModel

log = logging.getLogger("kvgate.models")

CHUNK = 4096  # table rows recovered at a time (a multiple of the tiles' 16 rows)
HEAD_FORMATS = ("q4f", "q5f", "q8_0", "q8d", "q8s")


def head_name(weights) -> str:
    """The checkpoint tensor the LM head multiplies by: `lm_head.weight`, or the tied token table."""
    return "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"


def head_scales(block_scales, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The file's d and m per 16 values of the head (`kvgate.models.gguf_scales`), or None (float file)."""
    if not block_scales or name + ".d" not in block_scales or name + ".m" not in block_scales:
        return None
    return block_scales[name + ".d"], block_scales[name + ".m"]


# what a slice's narrowest format widens to when another slice needs more: the 4- and 5-bit codes with
# scales per 32 (q4f -> q5f), the int8 codes with a d per 32 or 16 (q8_0 -> q8d), and q8s (int8 codes,
# d and m per 16) over all of them
WIDER = {"q4f": ("q5f", "q8s"), "q5f": ("q8s",), "q8_0": ("q8d", "q8s"), "q8d": ("q8s",), "q8s": ()}


def _slices(weight: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor]):
    """Each slice of CHUNK rows as `file_codes` recovers it (None where a slice is not blocks)."""
    d16, m16 = scales
    for at in range(0, weight.shape[0], CHUNK):
        yield at, file_codes(weight[at : at + CHUNK].float(), d16[at : at + CHUNK], m16[at : at + CHUNK])


def head_format(weight: torch.Tensor, scales) -> str | None:
    """The one tile format every slice of the head fits (its slices' narrowest formats widened to a
    common one, `WIDER`), or None where some slice is not the file's blocks."""
    if scales is None:
        return None
    fmt = None
    for _, got in _slices(weight, scales):
        if got is None or got[0] not in WIDER:
            return None
        fmt = got[0] if fmt is None else _common(fmt, got[0])
    return fmt


def _common(a: str, b: str) -> str:
    """The narrower format that holds what both hold (q5f beside q8d, say: q8s)."""
    return a if a == b or a in WIDER[b] else b if b in WIDER[a] else "q8s"


def head_tiles(
    weight: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor], fmt: str
) -> torch.Tensor | None:
    """The head's tiles in `fmt` (`head_format`'s), filled slice by slice into one buffer (a cat of the
    parts would hold them twice); None where a slice does not fit `fmt`."""
    out = None
    for at, got in _slices(weight, scales):
        if got is None or (got[0] != fmt and fmt not in WIDER[got[0]]):
            return None
        _, codes, d, m = got
        part = (
            q8_pack16(codes.to(torch.int8), d[:, 0::2].contiguous())
            if fmt == "q8_0"
            else block_pack16(fmt, codes, d, m)
        )
        if out is None:
            out = torch.empty((-(-weight.shape[0] // TILE), *part.shape[1:]), dtype=part.dtype)
        out[at // TILE : at // TILE + part.shape[0]] = part
    return out


def build(weight: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor], fmt: str) -> BlockLinear:
    """The head held as `fmt` tiles (placement chose `fmt` with `head_format` over the same values)."""
    tiles = head_tiles(weight, scales, fmt)
    if tiles is None:
        raise ValueError(f"the LM head's values are not the file's blocks in {fmt} tiles (see head_format)")
    return BlockLinear(fmt, tiles, weight.shape[0], None)


def head_bytes(fmt: str, vocab: int, hidden: int) -> int:
    """The held head's bytes (its tiles, rows padded to 16): what the plan charges."""
    return block_bytes(fmt, vocab, hidden)


def probe(weight: torch.Tensor, scales, dtype: torch.dtype, packed: bool, reps: int = 5) -> dict:
    """The block head against the float head it would replace, on a slice of 8,192 rows at 1 and 8 rows:
    {"blocks_ms", "plain_ms", "keep"}, each the least thread CPU time of `reps` calls on one thread (as
    `kvgate.models.q8_head.probe`). Kept unless the float head measures over 1.5x faster."""
    from kvgate.models.linear import Linear

    n = min(8192, weight.shape[0])
    fmt = head_format(weight[:n], (scales[0][:n], scales[1][:n]))
    if fmt is None:
        return {"blocks_ms": None, "plain_ms": None, "keep": False}
    blocks = build(weight[:n], (scales[0][:n], scales[1][:n]), fmt)
    plain = Linear(weight[:n].float().to(dtype), None, packed)

    blocks_ms, plain_ms = one_thread_ms((blocks, plain), weight.shape[1], dtype, reps)
    return {
        "blocks_ms": round(blocks_ms, 3),
        "plain_ms": round(plain_ms, 3),
        "keep": blocks_ms <= 1.5 * plain_ms,
    }


def resolve(
    loaded: LoadedModel, device: torch.device, dtype: torch.dtype, packed: bool, fmt: str, q8_head: bool
) -> tuple[str | None, str]:
    """The block format to hold the LM head in (`kvgate.models.head_blocks`) and why, or (None, why not):
    under --weights gguf on a CPU, where the head (or the tied table) is a file's blocks, the Q8 head does
    not hold it already, and a short probe does not measure the float head over 1.5x faster.
    KVGATE_HEAD_BLOCKS=0 keeps the float head (A/B runs)."""
    if fmt != "gguf" or q8_head:  # another format, or held already (the scales are not read)
        return None, ""
    name = head_name(loaded.weights)
    scales = head_scales(loaded.block_scales, name)
    if scales is None:  # a float head
        return None, ""
    if os.environ.get("KVGATE_HEAD_BLOCKS", "1") == "0":
        return None, "off (KVGATE_HEAD_BLOCKS=0)"
    if device.type != "cpu" or native.extension() is None:
        return None, f"off: the block kernels run on CPU with kvgate's C++ kernels ({device})"
    weight = loaded.weights[name]
    held = head_format(weight, scales)
    if held == "q8_0" and name == "model.embed_tokens.weight":  # the Q8 head's to hold, or not (--q8-head)
        return None, ""
    if held is None:
        return None, "off: the head's values are not the file's blocks in a tile format"
    p = probe(weight, scales, dtype, packed)
    log.info("head blocks probe: %s ms %s blocks vs %s ms float head", p["blocks_ms"], held, p["plain_ms"])
    if not p["keep"]:
        return (
            None,
            f"off: a startup probe measured the float head over 1.5x faster ({p['plain_ms']} ms vs {p['blocks_ms']} ms)",
        )
    return (
        held,
        f"{held} tiles (a startup probe: {p['blocks_ms']} ms vs {p['plain_ms']} ms for the float head)",
    )


class BlockTable:
    """A tied token table held only as the head's tiles: `embed(ids)` reads each row's codes and scales out
    of its tile (the layouts of `block_formats.block_pack16` and `q8_head.q8_pack16`) and widens them as
    the file's values, `m + d * c` (the float table's own bits), so the float
    table need not stay beside the tiles for the lookup (as `file_codes` checked them: `addcmul`). `__call__`
    is the head."""

    __slots__ = ("head", "nbytes")

    def __init__(self, head: BlockLinear):
        self.head, self.nbytes = head, head.nbytes

    def __call__(self, x: torch.Tensor, decode_rows: int | None = None) -> torch.Tensor:
        return self.head(x, decode_rows)

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows = tile_rows(self.head.fmt, self.head.packed, ids, self.head.out_features)
        return rows if dtype == torch.float32 else rows.to(dtype)


def _floats(sel: torch.Tensor, lo: int, hi: int, per: int) -> torch.Tensor:
    """Bytes [lo, hi) of each gathered tile-block as float32 [rows, nb, per, 16]."""
    return sel[:, :, lo:hi].contiguous().view(torch.float32).view(sel.shape[0], sel.shape[1], per, TILE)


def tile_rows(fmt: str, tiles: torch.Tensor, ids: torch.Tensor, rows: int) -> torch.Tensor:
    """float32 [len(ids), K]: rows `ids` (of `rows`) of a matrix held as `fmt` tiles, the file's values."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):
        raise IndexError(f"token ids must be in [0, {rows}); got {int(ids.min())}..{int(ids.max())}")
    sel, j = tiles[ids // TILE], ids % TILE  # [R, nb, bytes] and each row's place in its tile
    R, nb = sel.shape[0], sel.shape[1]
    at = torch.arange(R)
    if fmt == "q8_0":  # 16 rows' codes k-major, then their 16 scales
        c = sel[:, :, :512].view(torch.int8).view(R, nb, 32, TILE)[at, :, :, j].float()
        d = _floats(sel, 512, 576, 1)[at, :, 0, j]
        return (c * d.unsqueeze(-1)).view(R, nb * 32)
    if fmt in ("q8d", "q8s"):  # codes k-major, then d per 16 values (q8s: and m)
        c = sel[:, :, :512].view(torch.int8).view(R, nb, 32, TILE)[at, :, :, j].float().view(R, nb, 2, 16)
        d = _floats(sel, 512, 640, 2)[at, :, :, j].unsqueeze(-1)
        if fmt == "q8d":
            return (c * d).view(R, nb * 32)
        m = _floats(sel, 640, 768, 2)[at, :, :, j].unsqueeze(-1)
        return torch.addcmul(m, c, d).view(R, nb * 32)  # as `file_codes` checked the values
    if fmt in ("q4f", "q5f"):  # two codes a byte per (pair, row); q5f: a fifth-bit plane; then d and m per 32
        b = sel[:, :, :256].view(R, nb, 16, TILE)[at, :, :, j]
        c = torch.stack((b & 15, b >> 4), dim=-1).view(R, nb, 32).to(torch.int32)
        at_d = 256
        if fmt == "q5f":
            mask = sel[:, :, 256:320].view(R, nb, 32, 2)[at, :, :, j // 8].to(torch.int32)
            c = c + (((mask >> (j % 8).view(R, 1, 1)) & 1) << 4)
            at_d = 320
        d = _floats(sel, at_d, at_d + 64, 1)[at, :, 0, j]
        m = _floats(sel, at_d + 64, at_d + 128, 1)[at, :, 0, j]
        return torch.addcmul(m.unsqueeze(-1), c.float(), d.unsqueeze(-1)).view(R, nb * 32)
    raise ValueError(f"no row lookup for tile format {fmt!r}")
