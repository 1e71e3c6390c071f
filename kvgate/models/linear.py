"""Linear layers whose weights are prepacked once for oneDNN (CPU float32), and their warm-up.

Measured on a 2-vCPU AVX2 machine with SmolLM2-135M shapes: oneDNN on a prepacked weight is 2.5-3x
faster than `F.linear` (MKL sgemm) at 4-32 rows, ~1.7x at one row for the wide matrices, and a row's
result is bit-identical whatever the number of rows beside it from 2 rows up (one row runs another
kernel: `row_buckets` pads it to two).

The catch, also measured: oneDNN keeps a kernel ("primitive") per distinct (weight shape, row count)
it has run, ~0.5 MiB plus up to twice the output's size each, for the life of the process. Serving
steps of every row count from 1 to 288 grew RSS by ~400 MiB. So a `Linear` rounds its row count up to
one of a few buckets (powers of two, and the step's maximum), padding with zero rows, and
`warm_kernels` runs every bucket once on throwaway weights before the engine measures its runtime
overhead: the kernels' memory is then part of the measured baseline, and serving adds none.
"""

from __future__ import annotations

import functools
import logging
from bisect import bisect_left

import torch
import torch.nn.functional as F

log = logging.getLogger("kvgate.models")
PROBE_ROWS_MAX = 64  # the row-invariance probe's buckets stop here (a few ms a shape)
PROBE_OUT_MAX = 1024  # and its weight's output rows (the kernel is chosen by rows and k)

PACK_ROWS_HINT = 16  # oneDNN picks its blocking for this many rows; 16 measured best from 1 to 256


def packs_weights(device: torch.device | str, dtype: torch.dtype) -> bool:
    """True where `Linear` can prepack weights: CPU, float32, and a torch built with oneDNN."""
    return (
        torch.device(device).type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def row_buckets(max_rows: int, smallest: int = 2) -> list[int]:
    """Powers of two from 2 below `max_rows`, then `max_rows` itself: a step never pads past its planned
    size. One row is padded to two: oneDNN runs a one-row call on a kernel of its own whose sums over k
    go in another order once k passes ~1024 (SmolLM2's down_proj, k = 1536: 5e-6 apart), so a decoding
    row's numbers changed when a second row joined its step (QA pass 8); from 2 rows to 288 every row's
    bits are the same, on every shape measured (tests/test_linear_rows.py). `smallest`: 4 for a plain
    float32 weight (MKL's sgemm gives a row other bits at 1-3, 5-7 and 9-11 rows than at 4, 8 and 12+)."""
    out, b = [], smallest
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
        is computed one way, whatever its kind. Rows are padded to the next of `buckets` (set on CPU:
        `bucket_rows`), so a row's bits never depend on how many rows share the call."""
        rows = x.shape[0]
        i = bisect_left(self.buckets, rows)
        if i < len(self.buckets) and self.buckets[i] != rows:
            padded = x.new_zeros((self.buckets[i], x.shape[1]))
            padded[:rows] = x
            return self._run(padded)[:rows]
        return self._run(x)  # exact (or past the last bucket, or no buckets: CUDA)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        return _run_packed(x, self.weight, self.bias) if self.packed else F.linear(x, self.weight, self.bias)

    def bucket_rows(self, max_rows: int) -> None:
        """The row buckets of a CPU matmul of up to `max_rows` rows (none on CUDA)."""
        if self.weight.device.type != "cpu":
            self.buckets = []
            return
        plain_fp32 = not self.packed and self.weight.dtype == torch.float32
        self.buckets = row_buckets(max_rows, 4 if plain_fp32 else 2)
        if not self.packed:
            n, k = self.weight.shape
            probe = tuple(b for b in self.buckets if b <= PROBE_ROWS_MAX)
            emulated = self.weight.dtype == torch.bfloat16 and not native_bf16()
            if emulated or (probe and not rows_invariant(self.weight.dtype, min(n, PROBE_OUT_MAX), k, probe)):
                _warn_batch_dependent(self.weight.dtype, n, k)


@functools.cache
def rows_invariant(dtype: torch.dtype, n: int, k: int, buckets: tuple[int, ...]) -> bool:
    """Whether the plain matmul (MKL's sgemm, or the bfloat16 path) of an (n, k) weight gives a row the
    same bits at every one of `buckets` rows, measured here on random data once per shape. It differs
    by CPU: on a Zen 4 the buckets (from 4 rows) absorbed it; on an Emerald Rapids shown without
    avx512_bf16 a 576x1536 weight's row had other bits below 57 rows than at 64 (session 40). Every row
    of each call is held to the same row of the largest, not the first alone: on an AMX Xeon the
    bfloat16 matmul of a 960x576 weight gave row 0 the same bits at 2 rows as at 48 and row 1 others
    (session 41, where the first-row probe said invariant and the engine kept quiet)."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    x = torch.randn(max(buckets), k, generator=g).to(dtype)
    with torch.inference_mode():
        whole = F.linear(x, w)
        return all(torch.equal(F.linear(x[:b], w), whole[:b]) for b in buckets)


BF16_PROBE_SHAPES = ((960, 576), (576, 1536), (1024, 2048), (1024, 4096))  # SmolLM2's, and wider k


@functools.cache
def bf16_batch_invariant() -> bool:
    """Whether this CPU's bfloat16 matmul gives a row the same bits at every row bucket (`rows_invariant`
    on a few weight shapes). `--dtype auto` keeps float32 for --weights full where it does not, since
    batching must never change a request's numbers, and prepacked float32 keeps them (session 41: on an
    AMX Xeon the bfloat16 rows moved at 2 rows against 48, and oneDNN's packed bfloat16 at 2-35 rows)."""
    buckets = tuple(row_buckets(PROBE_ROWS_MAX, 2))  # every one at most PROBE_ROWS_MAX
    ok = all(rows_invariant(torch.bfloat16, n, k, buckets) for n, k in BF16_PROBE_SHAPES)
    if not ok:
        log.info(
            "bfloat16 matmul rows depend on the batch on this CPU: --dtype auto keeps float32 for --weights "
            "full (batching never changes a request's numbers); --dtype bfloat16 is faster but batch-dependent"
        )
    return ok


@functools.cache
def native_bf16() -> bool:
    """The CPU lists bfloat16 arithmetic (avx512_bf16 or amx_bf16). Without it PyTorch emulates bfloat16,
    and a --weights full bfloat16 model decoded a prompt with other logprobs alone than in a batch of
    four on an Emerald Rapids that hid both flags, though each matmul's rows agreed (session 40)."""
    from kvgate.models.native import cpu_flags

    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


_WARNED: set = set()


def _warn_batch_dependent(dtype: torch.dtype, n: int, k: int) -> None:
    """Once per dtype: batching can move a request's numbers with such a weight on this CPU."""
    if dtype in _WARNED:
        return
    _WARNED.add(dtype)
    log.warning(
        "batching can change a request's numbers here: a %dx%d %s weight (and maybe others) runs on this "
        "CPU's plain matmul, whose rows depend on the row count (measured at startup; bfloat16 is emulated "
        "without avx512_bf16), so a request decoded beside others can get logprobs ~1e-6 apart from alone, "
        "and rarely another token. Prepacked float32 (--dtype float32 --pack-weights on) and the GGUF "
        "block formats keep a request's numbers whatever runs beside it.",
        n,
        k,
        str(dtype).removeprefix("torch."),
    )


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
