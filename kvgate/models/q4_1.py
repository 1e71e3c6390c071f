"""Layer matrices held as the checkpoint's own Q4_1 blocks (`--weights gguf`): the float model's values
at a fifth of its bytes.

A GGUF Q4_1 block is 32 values `d * q + m`, q in 0..15, with fp16 `d` and `m`; the float table kvgate
loads from such a file holds exactly those values. `q4_1_blocks` recovers the codes and both scales
(m is the block's minimum, d its span / 15 rounded to fp16) and accepts them only if they give back
every value bit for bit, so a matrix that was never Q4_1 is never quantized. The C++ kernel
(kvgate/models/csrc/block_matmul.cpp) widens each weight as `fma(d, q, m)` (d * q is exact in float32,
so that is one rounding, as gguf's own `d * q + m`) and multiplies in float32 in a fixed order per
output: `--weights gguf` computes with the very weights `--weights full` holds, and a row's result
never depends on the rows beside it. Unlike `--weights int4`, whose kernel needs bfloat16 activations
and re-rounds d and m, nothing here is approximated; only the summation order differs from oneDNN's.

Bytes: half a byte per value plus a float32 d and m per 32 values, 0.75 B per value against 4.
"""

from __future__ import annotations

import torch

from kvgate.models import native

QBLOCK = 32


def q4_1_bytes(out_features: int, in_features: int) -> int:
    """Bytes `Q41Linear` holds for an [out, in] matrix (no bias): nibbles plus float32 d and m."""
    n, k = out_features, in_features
    return n * k // 2 + 2 * (n * k // QBLOCK) * 4


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
    (the loop that is fastest for a few rows), prefill rows with a GEMM-shaped loop 1.2-1.3x faster
    at prompt sizes. Both multiply by the same widened weights; their sums differ in order only."""

    __slots__ = ("codes", "d", "m", "bias", "nbytes", "_ext")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.codes, self.d, self.m = exact_blocks(weight)
        self.bias = bias
        self.nbytes = q4_1_bytes(*weight.shape) + (0 if bias is None else bias.numel() * bias.element_size())
        self._ext = kernels()

    def __call__(self, x: torch.Tensor, decode_rows: int | None = None) -> torch.Tensor:
        y = self._ext.q4_1_matmul(
            x.float(), self.codes, self.d, self.m, -1 if decode_rows is None else decode_rows
        )
        y = y if y.dtype == x.dtype else y.to(x.dtype)
        return y if self.bias is None else y + self.bias
