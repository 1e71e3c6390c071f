"""Linear layers whose weights are prepacked once for oneDNN (CPU float32), and their warm-up.

Measured on a 2-vCPU AVX2 machine with SmolLM2-135M shapes: oneDNN on a prepacked weight is 2.5-3x
faster than `F.linear` (MKL sgemm) at 4-32 rows, ~1.7x at one row for the wide matrices, and a row's
result is bit-identical whatever the number of rows beside it (checked for 1..64 rows).

The catch, also measured: oneDNN keeps a kernel ("primitive") per distinct (weight shape, row count)
it has run, ~0.5 MiB plus up to twice the output's size each, for the life of the process. Serving
steps of every row count from 1 to 288 grew RSS by ~400 MiB. So a `Linear` rounds its row count up to
one of a few buckets (powers of two, and the step's maximum), padding with zero rows, and
`warm_kernels` runs every bucket once on throwaway weights before the engine measures its runtime
overhead: the kernels' memory is then part of the measured baseline, and serving adds none.
"""

from __future__ import annotations

from bisect import bisect_left

import torch
import torch.nn.functional as F

PACK_ROWS_HINT = 16  # oneDNN picks its blocking for this many rows; 16 measured best from 1 to 256


def packs_weights(device: torch.device | str, dtype: torch.dtype) -> bool:
    """True where `Linear` can prepack weights: CPU, float32, and a torch built with oneDNN."""
    return (
        torch.device(device).type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def row_buckets(max_rows: int) -> list[int]:
    """Powers of two below `max_rows`, then `max_rows` itself: a step never pads past its planned size."""
    out, b = [], 1
    while b < max_rows:
        out.append(b)
        b *= 2
    return out + [max(1, max_rows)]


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)


def _run_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear:
    """`y = x @ weight.T + bias`, with the weight prepacked for oneDNN when `pack` is true.

    A weight whose packed form would be larger than its plain bytes (padding for shapes that are not
    multiples of oneDNN's blocking) stays plain, so the plan's weight bytes stay exact.
    """

    __slots__ = ("weight", "bias", "packed", "nbytes", "buckets")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool):
        self.bias = bias
        self.packed = False
        self.weight = weight
        self.buckets: list[int] = []
        self.nbytes = weight.numel() * weight.element_size()
        if pack:
            packed = _pack(weight)
            if torch.ops.mkldnn._nbytes(packed) <= self.nbytes:
                self.weight, self.packed = packed, True
        if bias is not None:
            self.nbytes += bias.numel() * bias.element_size()

    def __call__(self, x: torch.Tensor, decode_rows: int | None = None) -> torch.Tensor:
        """`decode_rows` is accepted for the common call shape (`Q41Linear` uses it); every row here
        is computed one way, whatever its kind."""
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        rows = x.shape[0]
        i = bisect_left(self.buckets, rows)
        if i == len(self.buckets) or self.buckets[i] == rows:  # exact (or past the last bucket)
            return _run_packed(x, self.weight, self.bias)
        padded = x.new_zeros((self.buckets[i], x.shape[1]))
        padded[:rows] = x
        return _run_packed(padded, self.weight, self.bias)[:rows]


def warm_kernels(shapes: list[tuple[int, int, int]], dtype: torch.dtype) -> None:
    """Run every (out_features, in_features, max_rows) shape at each of its row buckets once, on
    throwaway packed weights (contents do not matter: oneDNN keys its kernels on shapes)."""
    with torch.inference_mode():
        for n, k, max_rows in shapes:
            packed = _pack(torch.empty((n, k), dtype=dtype))
            x = torch.zeros((max(row_buckets(max_rows)), k), dtype=dtype)
            for rows in row_buckets(max_rows):
                _run_packed(x[:rows], packed, None)
            del packed, x
