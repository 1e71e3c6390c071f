"""RoPE's tables (kvgate/models/rope.py) are the correctly rounded cos and sin of Hugging Face's float32
arguments, built without torch's threads, and the model uses them.

Seen red: `tables` with torch's float32 cos (27,252 of SmolLM2's 524,288 cos entries one ulp away from
the rounded float64 ones), and LlamaModel building its own tables again. The load-time race this guards
against (one thread's half of the table off by up to 1e-4 in 9 of 20 loads, session 44) could not be
made to happen in a test; docs/DESIGN_NOTES.md has the server-level reproduction."""

from __future__ import annotations

import numpy as np
import torch

from kvgate.models import rope


def hf_arguments(theta: float, head_dim: int, positions: int) -> torch.Tensor:
    """position x inv_freq in float32, each frequency twice: Hugging Face's LlamaRotaryEmbedding."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    return torch.cat([freqs, freqs], dim=-1)


def test_the_tables_are_the_rounded_float64_cos_and_sin_of_hfs_arguments():
    cos, sin = rope.tables(100000.0, 64, 8192)  # SmolLM2's
    emb = hf_arguments(100000.0, 64, 8192).double().numpy()
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == sin.shape == (8192, 64)
    assert torch.equal(cos, torch.from_numpy(np.cos(emb).astype(np.float32)))
    assert torch.equal(sin, torch.from_numpy(np.sin(emb).astype(np.float32)))
    assert abs(cos[4096, 0].item() - 0.8039906) < 1e-7  # where a wrong load's table read 0.80407


def test_the_model_takes_its_tables_from_rope(tiny_dir):
    from kvgate.models import load_model
    from kvgate.models.llama import LlamaModel

    loaded = load_model(str(tiny_dir))
    spec = loaded.spec
    model = LlamaModel(spec, loaded.weights, torch.float32, "cpu")
    cos, sin = rope.tables(spec.rope_theta, spec.head_dim, spec.max_position_embeddings)
    assert torch.equal(model.cos, cos) and torch.equal(model.sin, sin)
