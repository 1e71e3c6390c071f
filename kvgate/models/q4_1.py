"""Layer matrices held as the checkpoint's own Q4_1 blocks (`--weights gguf`): the float model's values
at a fifth of its bytes.

A GGUF Q4_1 block is 32 values `d * q + m`, q in 0..15, with fp16 `d` and `m`; the float table kvgate
loads from such a file holds exactly those values. `q4_1_blocks` recovers the codes and both scales
(m is the block's minimum, d its span / 15 rounded to fp16) and accepts them only if they give back
every value bit for bit, so a matrix that was never Q4_1 is never quantized. `q4_1_pack16` lays them
out as the C++ kernel's tiles of 16 rows (kvgate/models/csrc/tile_matmul.cpp), which multiplies in
float32 in a fixed order per output, so a row's result never depends on the rows beside it:
- prompt rows use the exact weights, `fma(d, q, m)` (d * q is exact in float32: one rounding, as gguf's
  own `d * q + m`), one running sum over k per output;
- decode rows compute each block as `d * sum(q x) + m * sum(x)` (llama.cpp's factoring of a Q4_1 dot;
  no per-weight scaling), with `sum(q x)` as exact integer products of the codes and the block's
  activations in 24-bit fixed point (kvgate/models/csrc/q4_1_int24.cpp: the block's largest value to
  23-24 bits, float32 holds 24), which differs from the exact weights' sum at float32 rounding only.
So `--weights gguf` computes with the values `--weights full` holds, and nothing is approximated
beyond float32 rounding (unlike `--weights int4`, whose kernel needs bfloat16 activations and re-rounds
d and m); the summation order differs from oneDNN's.

Bytes: half a byte per value plus an fp16 d and m per 32 values (the file's own), 0.625 B per value
against 4, over the rows padded to a multiple of 16.
"""

from __future__ import annotations

import torch

from kvgate.models import native

QBLOCK = 32
TILE = 16  # output rows per tile
TILE_BLOCK = TILE * QBLOCK // 2 + 2 * TILE * 2  # bytes per tile and block: 256 of codes, fp16 d and m


def q4_1_bytes(out_features: int, in_features: int) -> int:
    """Bytes `Q41Linear` holds for an [out, in] matrix (no bias): `q4_1_pack16`'s tiles."""
    return -(-out_features // TILE) * (in_features // QBLOCK) * TILE_BLOCK


def q4_1_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(codes uint8 [N, K/2], d float32 [N, K/32], m float32 [N, K/32]) with `fma(d, q, m)` equal to
    `weight` bit for bit (byte j of a block: value j in the low nibble, j + 16 in the high), or None."""
    n, k = weight.shape
    if k % QBLOCK or weight.dtype != torch.float32:
        return None
    b = weight.reshape(n, k // QBLOCK, QBLOCK)
    m = b.amin(-1)
    d = ((b.amax(-1) - m) / 15.0).half().float()
    if not (torch.isfinite(d).all() and torch.equal(m.half().float(), m)):
        return None
    q = torch.round((b - m.unsqueeze(-1)) / torch.where(d > 0, d, 1.0).unsqueeze(-1))
    if q.amin() < 0 or q.amax() > 15:
        return None
    if not torch.equal(torch.addcmul(m.unsqueeze(-1), d.unsqueeze(-1), q), b):
        return None
    q = q.to(torch.uint8)
    codes = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, k // 2)
    return codes.contiguous(), d.contiguous(), m.contiguous()


def exact_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`q4_1_blocks` of a matrix that must be exact Q4_1 blocks (placement has checked the checkpoint)."""
    blocks = q4_1_blocks(weight.float())
    if blocks is None:
        raise ValueError(f"a {tuple(weight.shape)} matrix is not exact Q4_1 blocks (see q4_1_blocks)")
    return blocks


def tile_rows(
    codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """`q4_1_blocks`'s (codes, d, m) as values in k order [T * rows, K/32, 32] and d, m [T * rows, K/32],
    the rows padded with zero codes and scales to T = ceil(N / rows) tiles of `rows`; and T."""
    n, half = codes.shape
    nb = half * 2 // QBLOCK
    t = -(-n // rows)
    pad = t * rows - n
    blocks = codes.view(n, nb, QBLOCK // 2)
    values = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1)  # [N, nb, 32] in k order
    if pad:
        values = torch.cat([values, values.new_zeros(pad, nb, QBLOCK)])
        d = torch.cat([d, d.new_zeros(pad, nb)])
        m = torch.cat([m, m.new_zeros(pad, nb)])
    return values, d, m, t


def fp16_scale_bytes(s: torch.Tensor, t: int, rows: int) -> torch.Tensor:
    """Per-row scales [t * rows, nb] as each tile's fp16 values, [t, nb, rows] viewed as bytes; they must
    be fp16 values already (q4_1_blocks's d and m are: checked)."""
    f = s.view(t, rows, -1).transpose(1, 2)
    h = f.half()
    if not torch.equal(h.float(), f):
        raise ValueError("Q4_1 scales must be fp16 values (q4_1_blocks checks this)")
    return h.contiguous().view(torch.uint8)


def q4_1_pack16(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """`q4_1_blocks`'s (codes [N, K/2], d, m [N, K/32]) as the kernel's tiles: uint8 [T, K/32, 320] with
    T = ceil(N / 16). In tile t, block b, byte 16 p + j holds row 16 t + j's code for k = 2p in its low
    nibble and k = 2p + 1 in its high; bytes 256.. hold the 16 rows' d, then their m, as fp16 (exact:
    q4_1_blocks's d and m are fp16 values, checked). Padding rows are zero codes and scales."""
    values, d, m, t = tile_rows(codes, d, m, TILE)
    nb = values.shape[1]
    v = values.view(t, TILE, nb, QBLOCK // 2, 2).permute(0, 2, 3, 1, 4)  # [T, nb, p, row, pair]
    nibbles = (v[..., 0] | (v[..., 1] << 4)).reshape(t, nb, TILE * QBLOCK // 2)
    return torch.cat(
        [nibbles, fp16_scale_bytes(d, t, TILE), fp16_scale_bytes(m, t, TILE)], dim=-1
    ).contiguous()


def kernels():
    """kvgate's C++ kernels, or the error that says why they did not build."""
    ext = native.extension()
    if ext is None:
        raise RuntimeError(native.unavailable() or "kvgate's C++ kernels are unavailable")
    return ext


class Q41Linear:
    """`y = x @ W.T + bias` with W held as Q4_1 blocks; float32 inside, `x`'s dtype out.

    `decode_rows`: the first that many rows of x are decode rows, the rest prefill rows (None: all
    decode rows). The kernel computes each kind one fixed way: decode rows as they would be alone
    (tiles of codes times broadcast activations, factored per block), prefill rows with a GEMM over the
    exact widened weights. The two differ at float32 rounding only (see the module doc)."""

    __slots__ = ("packed", "out_features", "bias", "nbytes", "_ext")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, blocks: tuple | None = None):
        """`blocks`: `q4_1_blocks(weight)` where the caller has recovered them already."""
        self.packed = q4_1_pack16(*(blocks if blocks is not None else exact_blocks(weight)))
        self.out_features = weight.shape[0]
        self.bias = bias
        self.nbytes = q4_1_bytes(*weight.shape) + (0 if bias is None else bias.numel() * bias.element_size())
        self._ext = kernels()

    def __call__(self, x: torch.Tensor, decode_rows: int | None = None) -> torch.Tensor:
        return run_tiles(self._ext.q4_1_matmul, self, x, decode_rows)


def run_tiles(kernel, lin, x: torch.Tensor, decode_rows: int | None) -> torch.Tensor:
    """`kernel(x, tiles, N, decode_rows)` for a tiled matrix `lin` (packed, out_features, bias): float32
    in, `x`'s dtype out, the bias added (Q41Linear's and block_formats.BlockLinear's call)."""
    y = kernel(x.float(), lin.packed, lin.out_features, -1 if decode_rows is None else decode_rows)
    y = y if y.dtype == x.dtype else y.to(x.dtype)
    return y if lin.bias is None else y + lin.bias
