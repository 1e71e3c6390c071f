"""Candidate fusions of a layer's work outside attention (issue 14), measured and not used by the engine.

`pre`: RMSNorm -> QKV matmul -> RoPE -> (q, k, v). `post`: output projection + residual -> RMSNorm ->
gate/up matmul -> SiLU * up -> down projection + residual. Attention would run between them.

Promises (tests/test_fused.py):
- Eager, they compute bit for bit what `kvgate.models.llama.LlamaModel.forward`'s layer code does,
  with fewer ops: RoPE as one flip and a sign-folded sine (`-b * s == b * -s` exactly) instead of
  slice/neg/cat, residual adds in place, and a quantized matmul's bfloat16 output left to type
  promotion (`x + y.float()` and `x + y` give the same float32 sum) instead of a cast of its own.
- Every matrix goes in as raw tensors (`MatArgs`), so one `torch.compile` graph serves every layer
  (two per piece: row count 1 and any other). The prepacked oneDNN matmul is the custom op `kvgate::packed_linear`, an extern
  call to the compiler (inductor cannot lower oneDNN's packed layout), keeping its row buckets.
Neither the eager fusion nor the compiled one measured faster on a 2-vCPU AVX2 EPYC
(bench/fuse_layers.py, bench/step_time.py; docs/DESIGN_NOTES.md), so the engine does not use them.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvgate.models.linear import Linear
from kvgate.models.quant import INT4_GROUP, Quantized


def _packed_rows(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, buckets) -> torch.Tensor:
    """oneDNN on a prepacked weight, rows rounded up to `buckets` (see `kvgate.models.linear`)."""
    rows = x.shape[0]
    i = bisect_left(buckets, rows)
    if i == len(buckets) or buckets[i] == rows:
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    padded = x.new_zeros((buckets[i], x.shape[1]))
    padded[:rows] = x
    return torch.ops.mkldnn._linear_pointwise(padded, w, bias, "none", [], "")[:rows]


@torch.library.custom_op("kvgate::packed_linear", mutates_args=())
def packed_linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, n: int, buckets: list[int]
) -> torch.Tensor:
    y = _packed_rows(x, w, bias, buckets)
    return y if y._base is None else y.clone()  # a custom op's output may not be a view


@packed_linear.register_fake
def _(x, w, bias, n, buckets):
    return x.new_empty((x.shape[0], n))


class MatArgs(NamedTuple):
    """One matrix as plain values: kind (packed | plain | int8 | int4), weight or codes, bias, scales,
    out features, row buckets (packed) and activation dtype (quantized)."""

    kind: str
    w: torch.Tensor
    bias: torch.Tensor | None
    scales: torch.Tensor | None
    n: int
    buckets: tuple[int, ...]
    act: torch.dtype | None


def mat_args(lin: Linear | Quantized) -> MatArgs:
    if isinstance(lin, Quantized):
        return MatArgs(lin.fmt, lin.codes, lin.bias, lin.scales, lin.out_features, (), lin.act)
    n = lin.weight.shape[0]
    if lin.packed:
        return MatArgs("packed", lin.weight, lin.bias, None, n, tuple(lin.buckets), None)
    return MatArgs("plain", lin.weight, lin.bias, None, n, (), None)


def matmul(x: torch.Tensor, m: MatArgs) -> torch.Tensor:
    """`x @ W.T + bias`. A quantized matrix answers in its activation dtype (bfloat16); the caller's
    next op promotes it, exactly as a cast would."""
    if m.kind == "packed":
        if torch.compiler.is_compiling():  # an extern call to the compiler (it cannot lower oneDNN's layout)
            return torch.ops.kvgate.packed_linear(x, m.w, m.bias, m.n, list(m.buckets))
        return _packed_rows(x, m.w, m.bias, m.buckets)
    if m.kind == "plain":
        return F.linear(x, m.w, m.bias)
    xa = x if x.dtype == m.act else x.to(m.act)
    if m.kind == "int4":
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xa, m.w, INT4_GROUP, m.scales)
    else:
        y = torch.ops.aten._weight_int8pack_mm(xa, m.w, m.scales)
    if y.dtype != x.dtype and torch.promote_types(y.dtype, x.dtype) != x.dtype:
        y = y.to(x.dtype)  # promotion would keep the wider act dtype: round to x's as the layer did
    return y if m.bias is None else y + m.bias  # bias in the model dtype: the sum is in it too


def sign_folded_sin(sin: torch.Tensor) -> torch.Tensor:
    """[..., D] sine table with its first half negated, for `rope`."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rope(qk: torch.Tensor, cos: torch.Tensor, sin_folded: torch.Tensor) -> torch.Tensor:
    """`qk * cos + rotate_half(qk) * sin` on [T, heads, D], rotate_half(a, b) = (-b, a)."""
    T, n, D = qk.shape
    rot = qk.view(T, n, 2, D // 2).flip(2).view(T, n, D)
    out = qk * cos  # float32 even when qk is a quantized matmul's bfloat16 output (promotion)
    return out.add_(rot * sin_folded)


def pre(
    x: torch.Tensor,
    ln: torch.Tensor,
    qkv: MatArgs,
    cos: torch.Tensor,
    sin_folded: torch.Tensor,
    eps: float,
    heads: int,
    kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, hidden] -> q [T, heads, D], k and v [T, kv_heads, D] (float32; k rotated)."""
    T = x.shape[0]
    D = cos.shape[-1]
    h = F.rms_norm(x, (x.shape[-1],), ln, eps)
    y = matmul(h, qkv)
    qk = rope(y[:, : (heads + kv_heads) * D].view(T, heads + kv_heads, D), cos, sin_folded)
    v = y[:, (heads + kv_heads) * D :].view(T, kv_heads, D)
    return qk[:, :heads], qk[:, heads:], v if v.dtype == x.dtype else v.to(x.dtype)


def post(
    x: torch.Tensor,
    attn: torch.Tensor,
    o: MatArgs,
    ln: torch.Tensor,
    gate_up: MatArgs,
    down: MatArgs,
    eps: float,
) -> torch.Tensor:
    """The residual stream after the layer: x + o(attn), then + down(silu(gate) * up). Updates `x`."""
    x = x.add_(matmul(attn, o))
    h = F.rms_norm(x, (x.shape[-1],), ln, eps)
    gu = matmul(h, gate_up)
    inter = gu.shape[-1] // 2
    gate = gu[:, :inter]
    act = F.silu(gate if gate.dtype == x.dtype else gate.to(x.dtype)) * gu[:, inter:]
    return x.add_(matmul(act, down))
