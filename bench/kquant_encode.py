"""Q4_K, Q5_K and Q6_K encoders in numpy, for writing k-quant GGUF files where no llama.cpp is at hand.

`gguf.quants` decodes every k-quant but encodes none, and this machine cannot download a Q4_K_M model,
so the tests and `bench/kquant_model.py` write their own. These are the plain min/max encoders (no
importance weighting, no search over scales, unlike llama.cpp's `quantize`): the files they write are
valid k-quant blocks that `gguf.quants.dequantize` reads, with somewhat larger rounding error than
llama.cpp's. Layouts are gguf's (`gguf.quants.Q4_K` / `Q6_K`, whose decoders these invert).
"""

from __future__ import annotations

import numpy as np

QK = 256


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _min_scale_blocks(x: np.ndarray, top: int):
    """Q4_K's and Q5_K's shared part: per 256 values (d, dmin fp16, 12 bytes of 6-bit scales and mins)
    and the codes q [n, 8, 32] in 0..top, with values d * sc * q - dmin * m per 32."""
    b = x.astype(np.float32).reshape(-1, 8, 32)
    lo = np.minimum(b.min(-1), 0.0)
    hi = b.max(-1)
    scale = (hi - lo) / top
    d = _fp16(scale.max(-1) / 63.0)
    dmin = _fp16((-lo).max(-1) / 63.0)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(scale / np.where(df > 0, df, 1)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / np.where(dminf > 0, dminf, 1)), 0, 63).astype(np.uint8)
    step = (df * sc)[..., None]
    q = np.round((b + (dminf * mn)[..., None]) / np.where(step > 0, step, 1))
    q = np.clip(q, 0, top).astype(np.uint8)
    scales = np.zeros((b.shape[0], 12), dtype=np.uint8)
    for i in range(4):
        scales[:, i] = sc[:, i] | ((sc[:, 4 + i] >> 4) << 6)
        scales[:, 4 + i] = mn[:, i] | ((mn[:, 4 + i] >> 4) << 6)
        scales[:, 8 + i] = (sc[:, 4 + i] & 15) | ((mn[:, 4 + i] & 15) << 4)
    head = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales], 1)
    return head, q


def encode_q4_k(x: np.ndarray) -> np.ndarray:
    """float [rows, cols] (cols a multiple of 256) -> uint8 [rows, cols / 256 * 144] of Q4_K blocks:
    per 32 values d * sc * q - dmin * m, q 0..15, sc and m 6-bit, d and dmin fp16 per 256."""
    rows, cols = x.shape
    head, q = _min_scale_blocks(x, 15)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # pairs of sub-blocks: low, high nibbles
    return np.concatenate([head, qs], 1).reshape(rows, cols // QK * 144)


def encode_q5_k(x: np.ndarray) -> np.ndarray:
    """float [rows, cols] -> uint8 [rows, cols / 256 * 176] of Q5_K blocks: Q4_K's with q 0..31, the
    fifth bits in 32 bytes (byte l, bit s: sub-block s's value l) before the low nibbles."""
    rows, cols = x.shape
    head, q = _min_scale_blocks(x, 31)
    qs = ((q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)).reshape(-1, 128)
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8)  # [n, 32]
    return np.concatenate([head, qh, qs], 1).reshape(rows, cols // QK * 176)


def encode_q6_k(x: np.ndarray) -> np.ndarray:
    """float [rows, cols] -> uint8 [rows, cols / 256 * 210] of Q6_K blocks: per 16 values
    d * sc * (q - 32), q 0..63, sc int8, d fp16 per 256."""
    rows, cols = x.shape
    b = x.astype(np.float32).reshape(-1, 16, 16)
    scale = np.abs(b).max(-1) / 31.0
    d = _fp16(scale.max(-1) / 127.0)
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(scale / np.where(df > 0, df, 1)), -128, 127).astype(np.int8)
    step = (df * sc)[..., None]
    q = np.clip(np.round(b / np.where(step != 0, step, 1)), -32, 31).astype(np.int16) + 32
    q = q.reshape(-1, 2, 128).astype(np.uint8)  # two halves of 128 values
    ql = (q[:, :, :64] & 15) | ((q[:, :, 64:] & 15) << 4)  # [n, 2, 64]
    hi = (q >> 4) & 3
    qh = hi[:, :, 0:32] | (hi[:, :, 32:64] << 2) | (hi[:, :, 64:96] << 4) | (hi[:, :, 96:128] << 6)
    out = np.concatenate(
        [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], 1
    )
    return out.reshape(rows, cols // QK * 210)


ENCODERS = {"Q4_K": encode_q4_k, "Q5_K": encode_q5_k, "Q6_K": encode_q6_k}
