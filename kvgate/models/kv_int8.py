"""`--kv-dtype int8`: the KV cache as int8 codes with a float32 step and offset per (position, KV head).

A head's D values x at one position, from lo = min x to hi = max x, become 256 levels: the step
`s = (hi - lo) / 255`, the offset `z = lo + 128 s`, and codes `round((x - z) / s)` (to nearest even,
within [-128, 127]); code c stands for the value `c * s + z`. A head whose values are all equal gets
s = 0, codes 0 and z = lo (exact); one with a NaN or infinite value gets codes 0 and a NaN or infinite
step, so the NaN spreads as a float pool would spread it. The C++ write (`kvgate_rows::quantize_head`,
csrc/layer_ops.cpp) computes the same expressions in the same float32 operations, so both writers give
the same bits (tests/test_kv_dtype.py holds them to it).

What it costs and buys: D + 8 bytes a head and position instead of 2 D for float16 (72 against 128 for
SmolLM2's head_dim 64), so the same memory holds 1.78x the positions, and the paged decode kernel, which
is bound by its K/V reads at 16 rows, reads 44% fewer bytes. Each value is within about s / 2 =
(hi - lo) / 510 of what was written (the float32 roundings of z and of c * s + z aside). The offset is
what the bytes buy: on SmolLM2's K/V over 1,000 positions of English text, the relative error of a head was 0.0105 (K) and 0.0069 (V) with a symmetric scale (max|x| / 127)
per head, 0.0082 / 0.0060 with one per 32 values (llama.cpp's q8_0 cache), and 0.0075 / 0.0058 with
this step and offset per head. The stated tolerance against the float32 cache is in
tests/test_kv_dtype.py.

The readers: the paged decode kernel reads the codes as float32 integers and applies step and offset to
its scores (s q.c + z sum(q)) and weighted sums (sum p s c + sum p z); the prefill kernel and the
PyTorch paths (`dequantize`) widen codes to `c * s + z`.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 8  # a float32 step and offset per (position, KV head): the scale tensors' last dimension, 2


def is_int8(kv_dtype) -> bool:
    return kv_dtype is torch.int8


def element_bytes(kv_dtype: torch.dtype) -> tuple[int, int]:
    """(bytes a value, bytes of scale a position and KV head) in a pool of `kv_dtype`."""
    if is_int8(kv_dtype):
        return 1, SCALE_BYTES
    return torch.finfo(kv_dtype).bits // 8, 0


def head_bytes(kv_dtype: torch.dtype, head_dim: int) -> int:
    """Bytes one KV head's K (or V) takes at one position in a pool of `kv_dtype`."""
    value, scale = element_bytes(kv_dtype)
    return head_dim * value + scale


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 `x [..., D]` -> (codes int8 `[..., D]`, scales float32 `[..., 2]`: step and offset)."""
    lo, hi = x.amin(-1), x.amax(-1)
    s = (hi - lo) / 255
    z = lo + 128 * s
    step, off = s.unsqueeze(-1), z.unsqueeze(-1)
    coded = (step > 0) & torch.isfinite(step)  # else codes 0: all values equal, or a NaN or infinite one
    codes = torch.where(coded, torch.round((x - off) / step), 0.0).clamp_(-128, 127).to(torch.int8)
    return codes, torch.stack((s, z), -1)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values `codes [..., D]` stand for under `scales [..., 2]`: code * step + offset in float32
    (two roundings), then `dtype`."""
    out = codes.to(torch.float32)
    out.mul_(scales[..., 0:1]).add_(scales[..., 1:2])
    return out if dtype == torch.float32 else out.to(dtype)


def write(codes_pool, scale_pool, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Quantize `x [T, KVH, D]` into a layer's pool `[N, bs, KVH, D]` and scales `[N, bs, KVH, 2]` at `slots`."""
    codes, s = quantize(x.float())
    kvh, d = x.shape[-2:]
    codes_pool.view(-1, kvh, d).index_copy_(0, slots, codes)
    scale_pool.view(-1, kvh, 2).index_copy_(0, slots, s)


def random_pool(shape, gen: torch.Generator, kv_dtype: torch.dtype):
    """A random K (or V) pool `shape = [N, bs, KVH, D]` in `kv_dtype`, for the startup probes and the
    benchmarks: (pool, scales), scales None for a float pool."""
    x = torch.randn(*shape, generator=gen)
    if is_int8(kv_dtype):
        return quantize(x)
    return x.to(kv_dtype), None
