"""Weight-only quantized linear layers (`--weights int8 | int4`), on PyTorch's own CPU kernels.

Fewer bytes per step is the only road past the memory-bandwidth bound of batch-1 decode: every
weight is read once per step. Measured on a 2-vCPU AVX2 EPYC (no avx512_bf16), the 30 layers of
SmolLM2-135M plus its LM head at one row, weights cold in cache (bench note in docs/DESIGN_NOTES.md):
float32 prepacked 37.7 ms, int8 19.5 ms, int4 13.4 ms; at 16 rows 56, 90 and 76 ms. So the quantized
formats win at few rows and lose at many: they are a choice (`--weights`), not a default.

- int8: one symmetric scale per output channel, `aten._weight_int8pack_mm`.
- int4: groups of 32 input values, each with its own scale and minimum (asymmetric), packed for
  `aten._weight_int4pack_mm_for_cpu`, whose dequantization is `(q - 8) * scale + zero`. A GGUF Q4_1
  block is exactly 32 values `q * d + m` with q in 0..15 and both extremes used, so re-quantizing the
  dequantized file by each group's min and max gives back the file's own levels: int4 on a Q4_1
  checkpoint adds only the rounding of `d` and `m` to bfloat16.

Both kernels are fast only with bfloat16 activations on the CPUs measured (float32 input fell back to
a scalar loop, 5-10x slower), so `Quantized` casts its input to the activation dtype the startup probe
picked (`probe_activation_dtype`) and its output back. The plan charges these bytes exactly
(`quantized_matrix_bytes`), and the step workspace charges the cast copies.
"""

from __future__ import annotations

import time

import torch

from kvgate.models import native
from kvgate.models.q4_1 import q4_1_bytes
from kvgate.models.q4_1_dot8 import q4_1_dot8_bytes

# gguf: the file's own Q4_1 blocks (kvgate.models.q4_1); gguf-q8act: the same times 8-bit activations
# (kvgate.models.q4_1_dot8)
FORMATS = ("full", "int8", "int4", "gguf", "gguf-q8act")
GGUF_FORMATS = ("gguf", "gguf-q8act")
INT4_GROUP = 32


def supported(fmt: str, device: torch.device) -> str | None:
    """None if `fmt` runs on `device`, else why not (the user's error names it)."""
    if fmt == "full":
        return None
    if fmt in GGUF_FORMATS:
        if torch.device(device).type != "cpu":
            return f"--weights {fmt} runs kvgate's CPU kernel; use --weights full on {device}"
        return None if native.extension() is not None else f"--weights {fmt}: {native.unavailable()}"
    if torch.device(device).type != "cpu":
        return f"--weights {fmt} is implemented for CPU only (PyTorch's int8/int4 CPU kernels); use --weights full on {device}"
    need = "_weight_int8pack_mm" if fmt == "int8" else "_weight_int4pack_mm_for_cpu"
    if not hasattr(torch.ops.aten, need):
        return f"--weights {fmt} needs aten.{need}, which torch {torch.__version__} lacks; use --weights full"
    return None


def quantized_matrix_bytes(fmt: str, out_features: int, in_features: int, scale_bytes: int = 2) -> int:
    """Bytes `Quantized` holds for one [out, in] matrix in `fmt` (codes plus scales, no bias)."""
    n, k = out_features, in_features
    if fmt == "int8":
        return n * k + n * scale_bytes
    if fmt == "int4":
        return n * k // 2 + (k // INT4_GROUP) * n * 2 * scale_bytes
    if fmt == "gguf":
        return q4_1_bytes(n, k)
    if fmt == "gguf-q8act":
        return q4_1_dot8_bytes(n, k)
    raise ValueError(fmt)


INT4_ROWS = 16  # the int4 packing takes output sizes in multiples of this (torch raises otherwise)


def quantizable(fmt: str, out_features: int, in_features: int) -> bool:
    """Whether `Quantized` can hold an [out, in] matrix in `fmt`; other matrices stay full."""
    if fmt == "int4":
        return in_features % INT4_GROUP == 0 and out_features % INT4_ROWS == 0
    if fmt in GGUF_FORMATS:  # whether the values are Q4_1 blocks is the checkpoint's business (placement)
        return in_features % INT4_GROUP == 0
    return fmt == "int8"


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 codes [N, K], float32 scales [N]): w ~ codes * scale, per output row."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    codes = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (codes int32 [N, K] in 0..15, scale [K/32, N], zero [K/32, N]), float32, with
    w ~ (codes - 8) * scale + zero: each group of 32 spans its own min..max in 15 steps."""
    n, k = w.shape
    g = w.float().reshape(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale = ((hi - lo) / 15.0).clamp_min(1e-12)
    codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.int32)
    zero = lo + 8.0 * scale
    return codes.reshape(n, k), scale.t().contiguous(), zero.t().contiguous()


class Quantized:
    """`y = x @ W.T + bias` with W held as int8 or int4 codes (see the module doc)."""

    __slots__ = ("fmt", "codes", "scales", "bias", "act", "nbytes", "out_features", "in_features")

    def __init__(self, fmt: str, weight: torch.Tensor, bias: torch.Tensor | None, act: torch.dtype):
        self.fmt, self.bias, self.act = fmt, bias, act
        self.out_features, self.in_features = weight.shape
        if fmt == "int8":
            codes, scale = quantize_int8(weight)
            self.codes, self.scales = codes, scale.to(act)
        elif fmt == "int4":
            codes, scale, zero = quantize_int4(weight)
            self.codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            self.scales = torch.stack([scale, zero], dim=-1).to(act).contiguous()
        else:
            raise ValueError(f"unknown weight format {fmt!r}")
        self.nbytes = self.codes.numel() * self.codes.element_size()
        self.nbytes += self.scales.numel() * self.scales.element_size()
        if bias is not None:
            self.nbytes += bias.numel() * bias.element_size()

    def __call__(self, x: torch.Tensor, decode_rows: int | None = None) -> torch.Tensor:
        """`decode_rows` is accepted for the common call shape (`Q41Linear` uses it); every row here
        is computed one way, whatever its kind."""
        xa = x if x.dtype == self.act else x.to(self.act)
        if self.fmt == "int8":
            y = torch.ops.aten._weight_int8pack_mm(xa, self.codes, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xa, self.codes, INT4_GROUP, self.scales)
        y = y if y.dtype == x.dtype else y.to(x.dtype)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> torch.Tensor:
        """The float32 [N, K] matrix this layer multiplies by, as the kernel sees it (for tests)."""
        y = self(torch.eye(self.in_features)).float()
        if self.bias is not None:
            y = y - self.bias.float()
        return y.t().contiguous()


def probe_activation_dtype(fmt: str, reps: int = 8) -> torch.dtype:
    """The activation dtype the `fmt` kernel runs fastest with on this CPU: float32 and bfloat16 each
    time one SmolLM2-sized matmul (1536 x 576, one row); a few milliseconds in all."""
    w = torch.randn(1536, 576)
    x = torch.randn(1, 576)
    best, best_t = torch.float32, float("inf")
    for act in (torch.bfloat16, torch.float32):
        lin = Quantized(fmt, w, None, act)
        xa = x.to(act)
        lin(xa)
        t0 = time.perf_counter()
        for _ in range(reps):
            lin(xa)
        t = time.perf_counter() - t0
        if t < best_t:
            best, best_t = act, t
    return best
