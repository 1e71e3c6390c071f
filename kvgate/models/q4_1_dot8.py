"""`--weights gguf-q8act`: the file's own Q4_1 blocks times activations rounded to 8-bit blocks, with
integer dot products, as llama.cpp computes on CPUs.

`--weights gguf` multiplies the exact weights by float32 activations (full's numbers). This format
also rounds each block of 32 activations of a row to `d * code` (code an int8, d = max|x| / 127) before
every layer matmul, so a block's products are exact integers: one AVX2 `maddubs` does 32 of them
where a float FMA does 8 (csrc/int8_dot.cpp). The price is that rounding: the logits move by about
1e-2 relative and greedy tokens can part from full's after some steps (tests/test_q4_1_dot8.py
states how far on the default model). With the Q8_0 table (`--q8-head`), the LM head rounds its input
the same way (`kvgate.models.q8_head.Q8DotTable`); everything between the matmuls stays as `gguf`
computes it.

What is kept: a row's activations are rounded from that row alone and every output sums its blocks
in one fixed order, so batching, chunking and drafts never change a row's numbers, and the weights
are the file's own values in fewer bytes than `gguf`'s: the repacked tiles hold the same nibbles and
d and m as fp16, as the GGUF does (0.625 bytes per value against 0.75; a matrix whose rows are not
a multiple of 8 gets up to 7 zero rows, which the plan charges).
"""

from __future__ import annotations

import torch

from kvgate.models.q4_1 import QBLOCK, exact_blocks, fp16_scale_bytes, kernels, tile_rows

TILE = 8  # output rows per packed tile


TILE_BLOCK = TILE * QBLOCK // 2 + 2 * TILE * 2  # a tile's bytes per block: nibbles, then fp16 d and m


def q4_1_dot8_bytes(out_features: int, in_features: int) -> int:
    """Bytes `Q41Dot8Linear` holds for an [out, in] matrix (no bias): half a byte per value and an fp16
    d and m per 32, over the rows padded to a multiple of 8."""
    return -(-out_features // TILE) * (in_features // QBLOCK) * TILE_BLOCK


def q4_1_pack8(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """`q4_1_blocks`'s (codes [N, K/2], d, m [N, K/32]) as the kernel's tiles: uint8 [T, K/32, 160]
    with T = ceil(N / 8). In tile t, block b, byte 32 g + 4 n + j holds row 8t + n's code for k = 8g + j
    in its low nibble and k = 8g + 4 + j in its high nibble; bytes 128.. hold the 8 rows' d, then their
    m, as fp16 (exact: q4_1_blocks's d and m are fp16 values). Padding rows are zero codes and scales."""
    values, d, m, t = tile_rows(codes, d, m, TILE)
    nb = values.shape[1]
    v = values.view(t, TILE, nb, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)  # [T, nb, g, half, n, j]
    nibbles = (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).reshape(t, nb, 4 * TILE * 4)
    return torch.cat(
        [nibbles, fp16_scale_bytes(d, t, TILE), fp16_scale_bytes(m, t, TILE)], dim=-1
    ).contiguous()


class Q41Dot8Linear:
    """`y = x @ W.T + bias` with W held as Q4_1 tiles and x rounded to 8-bit blocks inside the kernel;
    float32 inside, `x`'s dtype out. Every row is computed one way, whatever its kind, so
    `decode_rows` is accepted and ignored."""

    __slots__ = ("packed", "out_features", "bias", "nbytes", "_ext")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.packed = q4_1_pack8(*exact_blocks(weight))
        self.out_features = weight.shape[0]
        self.bias = bias
        self.nbytes = q4_1_dot8_bytes(*weight.shape) + (
            0 if bias is None else bias.numel() * bias.element_size()
        )
        self._ext = kernels()

    def __call__(self, x: torch.Tensor, decode_rows: int | None = None) -> torch.Tensor:
        y = self._ext.q4_1_dot8(x.float(), self.packed, self.out_features)
        y = y if y.dtype == x.dtype else y.to(x.dtype)
        return y if self.bias is None else y + self.bias
