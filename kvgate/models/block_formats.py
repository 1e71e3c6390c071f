"""Layer matrices held as a GGUF file's own blocks of any type (`--weights gguf`), not only Q4_1.

Every GGUF block type kvgate reads stores a block of values as `d * c + m`, with integer codes `c` and a
scale `d` and offset `m` per 32 values (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K) or per 16 (Q6_K, Q3_K,
Q2_K). In float32, `d * c` is exact for every one of them (the largest, Q6_K: an fp16 times an int8
scale, 18 bits, times a 6-bit code, 24 bits), so the float value the file decodes to is one rounding of
`d * c + m`, and holding (c, d, m) holds those values exactly. The converter records each quantized
matrix's d and m per 16 values (`kvgate.models.gguf_loader`, `block_scales.safetensors`); here the codes
are recovered from the float values and accepted only if `fma(d, c, m)` gives back every value bit for
bit. Five tile formats of 16 output rows hold them (kvgate/models/csrc/tile_matmul.cpp):
- q4f: 4-bit codes with float32 d and m per 32 (Q4_K, Q4_0; 0.75 B a value): Q4_1's tiles with scales
  that are not fp16 values;
- q5f: q4f's low 4 bits plus a plane of fifth bits (Q5_0, Q5_1, Q5_K; 0.875 B);
- q8_0: int8 codes with a float32 d per 32 (Q8_0; 1.125 B), the LM head's tiles (`q8_head`);
- q8d: int8 codes with a float32 d per 16 and no m (Q6_K, Q3_K; 1.25 B);
- q8s: int8 codes with float32 d and m per 16 (Q2_K, and a fused matrix whose parts differ, such as
  Q4_K_M's qkv with a Q6_K v; 1.5 B).
A Q4_1 matrix whose scales are fp16 values stays `Q41Linear` (0.625 B, the fastest decode loop).
The kernel computes them as `Q41Linear` does: decode rows per block as d * sum(c x) + m * sum(x), prompt
rows on the exact widened weights, so a row's result never depends on the rows beside it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from kvgate.models.q4_1 import Q41Linear, kernels, q4_1_blocks, q4_1_bytes, run_tiles
from kvgate.models.q8_head import q8_blocks, q8_pack16

if TYPE_CHECKING:
    from kvgate.models.hf_loader import LoadedModel

QBLOCK = 32
HALF = 16
TILE = 16
TILE_BYTES = {"q4f": 384, "q5f": 448, "q8_0": 576, "q8d": 640, "q8s": 768}  # a tile's bytes per block of 32 k
BLOCK_FORMATS = ("q4_1", *TILE_BYTES)  # every format a layer matrix can be held in


def block_bytes(fmt: str, out_features: int, in_features: int) -> int:
    """Bytes a layer matrix holds in `fmt` (q4_1, q4f, q5f, q8_0, q8d, q8s): its tiles, rows padded to 16."""
    if fmt == "q4_1":
        return q4_1_bytes(out_features, in_features)
    return -(-out_features // TILE) * (in_features // QBLOCK) * TILE_BYTES[fmt]


def file_codes(
    weight: torch.Tensor, d16: torch.Tensor, m16: torch.Tensor
) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(format, codes [N, K] int16, d [N, K/16], m [N, K/16]) with `fma(d, c, m)` equal to `weight` bit for
    bit for every value, the format the narrowest tile that holds them; None when they do not."""
    n, k = weight.shape
    if k % QBLOCK or weight.dtype != torch.float32 or d16.shape != (n, k // HALF) or m16.shape != d16.shape:
        return None
    w = weight.view(n, k // HALF, HALF)
    safe = torch.where(d16 != 0, d16, torch.ones_like(d16)).unsqueeze(-1)
    q = torch.round((w - m16.unsqueeze(-1)) / safe)
    if not torch.isfinite(q).all() or q.abs().amax() > 255:
        return None
    if not torch.equal(torch.addcmul(m16.unsqueeze(-1), d16.unsqueeze(-1), q), w):  # d * q is exact
        return None
    lo, hi = int(q.amin()), int(q.amax())
    pairs_equal = torch.equal(d16[:, 0::2], d16[:, 1::2]) and torch.equal(m16[:, 0::2], m16[:, 1::2])
    if pairs_equal and lo >= 0 and hi <= 15:
        fmt = "q4f"
    elif pairs_equal and lo >= 0 and hi <= 31:
        fmt = "q5f"
    elif pairs_equal and lo >= -128 and hi <= 127 and not m16.any():
        fmt = "q8_0"
    elif lo >= -128 and hi <= 127 and not m16.any():
        fmt = "q8d"
    elif lo >= -128 and hi <= 127:
        fmt = "q8s"
    else:
        return None
    return fmt, q.view(n, k).to(torch.int16), d16, m16


def _tiles(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Rows padded with zeros to a multiple of 16."""
    pad = -t.shape[0] % rows
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def _scale_bytes(s: torch.Tensor, t: int, nb: int, per: int) -> torch.Tensor:
    """Per-row float32 scales [16 t, nb * per] as each tile's [t, nb, per * 16] values, as bytes."""
    return s.view(t, TILE, nb, per).permute(0, 2, 3, 1).contiguous().view(torch.uint8).reshape(t, nb, -1)


def block_pack16(fmt: str, codes: torch.Tensor, d16: torch.Tensor, m16: torch.Tensor) -> torch.Tensor:
    """`file_codes`'s result as the kernel's tiles uint8 [ceil(N/16), K/32, TILE_BYTES[fmt]] (layouts in
    tile_matmul.cpp's opening); padding rows are zero codes and scales."""
    n, k = codes.shape
    nb = k // QBLOCK
    if fmt == "q8_0":
        return q8_pack16(codes.to(torch.int8), d16[:, 0::2].contiguous())
    codes, d16, m16 = _tiles(codes, TILE), _tiles(d16, TILE), _tiles(m16, TILE)
    t = codes.shape[0] // TILE
    if fmt in ("q4f", "q5f"):
        c = codes.to(torch.uint8)
        v = (c & 15).view(t, TILE, nb, QBLOCK // 2, 2).permute(0, 2, 3, 1, 4)
        parts = [(v[..., 0] | (v[..., 1] << 4)).reshape(t, nb, TILE * QBLOCK // 2)]
        if fmt == "q5f":  # per k, a 16-bit mask of the outputs whose code has its fifth bit
            fifth = (c >> 4).view(t, TILE, nb, QBLOCK).permute(0, 2, 3, 1).reshape(t, nb, QBLOCK, 2, 8)
            mask = (fifth << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)  # little-endian
            parts.append(mask.reshape(t, nb, 2 * QBLOCK))
        d, m = d16[:, 0::2].contiguous(), m16[:, 0::2].contiguous()
        parts += [_scale_bytes(d, t, nb, 1), _scale_bytes(m, t, nb, 1)]
    elif fmt in ("q8d", "q8s"):  # int8 codes, d per half block (q8s: and m)
        c = codes.to(torch.int8).view(t, TILE, nb, QBLOCK).permute(0, 2, 3, 1).reshape(t, nb, TILE * QBLOCK)
        parts = [c.view(torch.uint8), _scale_bytes(d16, t, nb, 2)]
        if fmt == "q8s":
            parts.append(_scale_bytes(m16, t, nb, 2))
    else:
        raise ValueError(f"unknown block format {fmt!r}")
    return torch.cat(parts, dim=-1).contiguous()


def fused_scales(
    block_scales: Mapping[str, torch.Tensor] | None, names: tuple[str, ...]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The block scales (d, m) of the matrix the model fuses from `names`, when every part has them."""
    parts = [(block_scales.get(n + ".d"), block_scales.get(n + ".m")) for n in names] if block_scales else []
    if not parts or any(d is None or m is None for d, m in parts):
        return None
    return torch.cat([d for d, _ in parts]), torch.cat([m for _, m in parts])


def fused_names(layer: int) -> list[tuple[str, ...]]:
    """The checkpoint names of each layer matrix the model multiplies by, as it fuses them: qkv, o,
    gate_up, down (`kvgate.memory.plan.matrices` order)."""
    p = f"model.layers.{layer}."
    return [
        tuple(p + f"self_attn.{n}_proj.weight" for n in "qkv"),
        (p + "self_attn.o_proj.weight",),
        (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
        (p + "mlp.down_proj.weight",),
    ]


def recover(weight: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None):
    """(format, what packing it needs) for a layer matrix that is a GGUF file's blocks, in the narrowest
    format that holds it exactly: Q4_1 with fp16 scales (`q4_1_blocks`), else the codes `file_codes`
    recovers with the file's scales, else Q8_0 from the values alone (`q8_blocks`); None if none."""
    w = weight.float()
    if (q4 := q4_1_blocks(w)) is not None:
        return "q4_1", q4
    if scales is not None and (got := file_codes(w, *scales)) is not None:
        fmt, codes, d16, m16 = got  # q8_0 as the head's packer takes it: int8 codes, a d per 32
        return fmt, (codes.to(torch.int8), d16[:, 0::2].contiguous()) if fmt == "q8_0" else (codes, d16, m16)
    if w.shape[1] % QBLOCK == 0 and (q8 := q8_blocks(w)) is not None:
        return "q8_0", q8
    return None


def matrix_format(weight: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None) -> str | None:
    """The format `held` keeps a layer matrix in (q4_1, q4f, q5f, q8_0, q8d, q8s), or None (not a file's blocks)."""
    got = recover(weight, scales)
    return None if got is None else got[0]


def layer_matrix_formats(loaded: LoadedModel) -> list[tuple[str | None, str]]:
    """(block format or None, name and shape) of every layer matrix as the model fuses them, in
    `kvgate.memory.plan.matrices` order: the format `--weights gguf` would hold it in
    (`kvgate.models.block_formats`), None where it is not a GGUF file's blocks."""
    out = []
    for i in range(loaded.spec.num_layers):
        for names in fused_names(i):
            w = torch.cat([loaded.weights[n].float() for n in names])
            fmt = matrix_format(w, fused_scales(loaded.block_scales, names))
            out.append((fmt, f"{'+'.join(n.split('.')[-2] for n in names)} of layer {i} {tuple(w.shape)}"))
    return out


def format_counts(formats: list[tuple[str | None, str]]) -> str:
    """'120 q4_1' or '60 q4f, 60 q8s': how many layer matrices each format holds."""
    counts: dict[str, int] = {}
    for fmt, _ in formats:
        counts[str(fmt)] = counts.get(str(fmt), 0) + 1
    return ", ".join(f"{n} {fmt}" for fmt, n in sorted(counts.items()))


class BlockLinear:
    """`y = x @ W.T + bias` with W held as a GGUF file's blocks in one of `TILE_BYTES`'s formats; float32
    inside, `x`'s dtype out. `decode_rows` as `Q41Linear`'s."""

    __slots__ = ("fmt", "packed", "out_features", "bias", "nbytes", "_ext")

    def __init__(self, fmt: str, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None):
        self.fmt, self.packed, self.out_features, self.bias = fmt, packed, out_features, bias
        self.nbytes = packed.numel() + (0 if bias is None else bias.numel() * bias.element_size())
        self._ext = kernels()

    def __call__(self, x: torch.Tensor, decode_rows: int | None = None) -> torch.Tensor:
        return run_tiles(self._ext.block_matmul, self, x, decode_rows)


def held(
    weight: torch.Tensor, bias: torch.Tensor | None, scales: tuple[torch.Tensor, torch.Tensor] | None
) -> Q41Linear | BlockLinear:
    """A layer matrix as the file's own blocks, in the narrowest format that holds them exactly (the
    placement has checked that one does: `matrix_format`)."""
    got = recover(weight, scales)
    if got is None:
        raise ValueError(f"a {tuple(weight.shape)} matrix is not a GGUF file's blocks (see matrix_format)")
    fmt, parts = got
    if fmt == "q4_1":
        return Q41Linear(weight, bias, blocks=parts)
    packed = q8_pack16(*parts) if fmt == "q8_0" else block_pack16(fmt, *parts)
    return BlockLinear(fmt, packed, weight.shape[0], bias)
