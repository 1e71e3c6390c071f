"""RoPE's cos and sin tables, built once at load: the same bits on every load, whatever the threads do.

`tables(theta, head_dim, positions)` gives [positions, head_dim] float32 cos and sin of position x
inv_freq (each frequency twice, rotate-half order). The arguments are float32 products as Hugging Face's
LlamaRotaryEmbedding makes them. Each value is the float64 cos or sin of its argument, rounded once
(numpy, one thread).

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

import numpy as np
import torch


def tables(theta: float, head_dim: int, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), float32 [positions, head_dim]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # 32 values
    freqs = np.outer(np.arange(positions, dtype=np.float32), inv_freq.numpy())  # float32 products
    emb = np.concatenate([freqs, freqs], axis=-1).astype(np.float64)
    return torch.from_numpy(np.cos(emb).astype(np.float32)), torch.from_numpy(np.sin(emb).astype(np.float32))
