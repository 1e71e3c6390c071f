"""RoPE's cos and sin tables, built once at load: the same bits on every load, whatever the threads do.

`tables(theta, head_dim, positions, scaling)` gives [positions, head_dim] float32 cos and sin of
position x inv_freq (each frequency twice, rotate-half order). The inverse frequencies are float32
values as Hugging Face's rotary embeddings make them, after the model's RoPE scaling (`SCALINGS`):
- `linear`: every frequency divided by `factor` (positions interpolated);
- `llama3` (Llama 3.1-3.3): long wavelengths divided by `factor`, short ones kept, a smooth blend between;
- `yarn` (Qwen2.5/Qwen3 long context): interpolated and extrapolated frequencies blended over a ramp of
  dimensions, and cos and sin multiplied by the attention factor (0.1 ln(factor) + 1 unless given);
- `freq_factors`: each frequency divided by its own factor, as a GGUF's `rope_freqs` tensor holds them
  (llama.cpp's converter writes Llama 3.1's scaling that way).
Each cos/sin value is the float64 cos or sin of its float32 argument, rounded once (numpy, one thread).

Why not torch's float32 cos: on an AMX Xeon VM with 2 threads (session 44) the model's table came back
wrong in 9 of 20 engine loads:
- one thread's half of the table (rows from 4096, or below it) was off by up to 1e-4 (cos(4096) as 0.80407
  against 0.8039906);
- a second call right after gave the right table; it was the first parallel op after the decode
  attention probe (without the probe, 0 of 20);
- prompts' logits then differed between server starts (docs/DESIGN_NOTES.md, session 44).
The cause inside torch's threads is not known; these tables no longer pass through them. Against torch's
cos of the same arguments, 5% of the entries move by one ulp (these are the correctly rounded ones).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

# each kind's keys that must be given (others are optional)
SCALINGS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "freq_factors": ("factors",),
}


def tables(
    theta: float, head_dim: int, positions: int, scaling: Mapping | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), float32 [positions, head_dim]; `scaling`: a `SCALINGS` kind's parameters with `rope_type`."""
    inv_freq, attention = inverse_frequencies(theta, head_dim, scaling or {})
    freqs = np.outer(np.arange(positions, dtype=np.float32), inv_freq.numpy())  # float32 products
    emb = np.concatenate([freqs, freqs], axis=-1).astype(np.float64)
    cos, sin = np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)
    if attention != 1.0:  # yarn: float32 products, as HF multiplies its float32 tables
        cos, sin = cos * np.float32(attention), sin * np.float32(attention)
    return torch.from_numpy(cos), torch.from_numpy(sin)


def inverse_frequencies(theta: float, head_dim: int, scaling: Mapping) -> tuple[torch.Tensor, float]:
    """(float32 [head_dim / 2] inverse frequencies, the factor cos and sin are multiplied by)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(theta, head_dim, scaling)
    raise ValueError(f"RoPE scaling {kind!r} is not implemented (kvgate has {', '.join(SCALINGS)})")


def _llama3(inv_freq: torch.Tensor, s: Mapping) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)
    return torch.where(medium, blended, scaled)


def _yarn(theta: float, dim: int, s: Mapping) -> tuple[torch.Tensor, float]:
    factor = float(s["factor"])
    attention = s.get("attention_factor")
    if attention is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = (
            _mscale(factor, mscale) / _mscale(factor, mscale_all)
            if mscale and mscale_all
            else _mscale(factor)
        )
    fast, slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)
    old = float(s["original_max_position_embeddings"])

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over `old` positions
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the share of each frequency left unscaled (extrapolated)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # HF's own expressions
    return 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep, float(attention)


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
