"""Each GGUF block's scale and offset per 16 values, read from the file's own bytes.

`kvgate.models.block_formats` holds a layer matrix as its blocks: integer codes times a scale `d` plus an
offset `m`. The converter writes these per 16 values of each quantized matrix beside the float values
(`block_scales.safetensors`), as float32: for every type below, `d * code` and the file's value are exact
in float32 (see block_formats), so the codes follow from the values. Layouts and formulas are gguf's own
(`gguf.quants`), which the values were decoded with; a block type not listed has no entry, and a matrix
whose codes do not give back its values bit for bit is simply not held as blocks.
"""

from __future__ import annotations

import numpy as np

QK = 256  # values per k-quant super-block
SCALES_FILE = "block_scales.safetensors"  # in a converted GGUF's cache directory: "<matrix>.d", "<matrix>.m"


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    return raw[:, at : at + 2].copy().view(np.float16).astype(np.float32)[:, 0]


def _per16(d: np.ndarray, m: np.ndarray, per_block: int) -> tuple[np.ndarray, np.ndarray]:
    """[blocks, subblocks] scales with `per_block` values each, as one entry per 16 values."""
    rep = per_block // 16
    return np.repeat(d, rep, axis=1), np.repeat(m, rep, axis=1)


def _legacy(raw: np.ndarray, has_min: bool, offset: float) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0 / Q5_0 / Q8_0 (d * (q - offset)) and Q4_1 / Q5_1 (d * q + m), 32 values a block."""
    d = _f16(raw, 0)
    m = _f16(raw, 2) if has_min else -offset * d  # exact: offset is 0, 8 or 16
    return _per16(d[:, None], m[:, None], 32)


def _q4_k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins, 8 of each (gguf's `Q4_K.get_scale_min`)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_min(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: d * sc * q - dmin * m per 32."""
    d, dmin = _f16(raw, 0), _f16(raw, 2)
    sc, mn = _q4_k_scales(raw[:, 4:16])
    return _per16(d[:, None] * sc, -(dmin[:, None] * mn), 32)


def _q6_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K: d * sc * (q - 32) per 16, sc int8 (the codes here are q - 32)."""
    sc = raw[:, 192:208].copy().view(np.int8).astype(np.float32)
    d = _f16(raw, 208)[:, None] * sc
    return d, np.zeros_like(d)


def _q3_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q3_K: d * (sc - 32) * q per 16, sc 6 bits packed in 12 bytes (gguf's `Q3_K`)."""
    scales = raw[:, 96:108]
    n = raw.shape[0]
    lo = (scales[:, :8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(n, 16)
    hi = (scales[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(
        n, 16
    )
    sc = ((lo & 0x0F) | ((hi & 0x03) << 4)).astype(np.int8) - np.int8(32)
    d = _f16(raw, 108)[:, None] * sc.astype(np.float32)
    return d, np.zeros_like(d)


def _q2_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q2_K: d * sc * q - dmin * m per 16, sc and m 4 bits each in 16 bytes."""
    scales = raw[:, :16]
    d, dmin = _f16(raw, 80), _f16(raw, 82)
    return d[:, None] * (scales & 0x0F).astype(np.float32), -(
        dmin[:, None] * (scales >> 4).astype(np.float32)
    )


# type -> (bytes a block, values a block, reader of (d, m) per 16 from the blocks' bytes)
LAYOUTS = {
    "Q4_0": (18, 32, lambda r: _legacy(r, False, 8.0)),
    "Q4_1": (20, 32, lambda r: _legacy(r, True, 0.0)),
    "Q5_0": (22, 32, lambda r: _legacy(r, False, 16.0)),
    "Q5_1": (24, 32, lambda r: _legacy(r, True, 0.0)),
    "Q8_0": (34, 32, lambda r: _legacy(r, False, 0.0)),
    "Q2_K": (84, QK, _q2_k),
    "Q3_K": (110, QK, _q3_k),
    "Q4_K": (144, QK, _k_min),
    "Q5_K": (176, QK, _k_min),
    "Q6_K": (210, QK, _q6_k),
}


def block_scales(qtype: str, data: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(d, m) float32 [rows, cols / 16] of a quantized [rows, cols] matrix in the file's row order, or
    None for a type with no block scales (F32, F16, ...)."""
    layout = LAYOUTS.get(qtype)
    if layout is None:
        return None
    nbytes, per, read = layout
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1, nbytes)
    if raw.shape[0] * per != rows * cols:
        return None
    d, m = read(raw)
    return d.reshape(rows, cols // 16).astype(np.float32), m.reshape(rows, cols // 16).astype(np.float32)
