"""GGUF tensor names -> the HF names kvgate builds its model from, and the q/k row order llama.cpp writes.

llama.cpp's converter permutes attn_q/attn_k rows so rotary pairs are adjacent (GPT-J style) for
Llama-style architectures; `_unpermute` restores HF's rotate-half order (`kvgate.models.gguf_loader`).
"""

from __future__ import annotations

import numpy as np

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}


# Gemma 3's four norms a layer (llama.cpp's names; its ffn_norm is the norm before the MLP, as Llama's)
_GEMMA_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


def _hf_name(name: str, arch: str = "llama") -> str | None:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        names = _GEMMA_NAMES if arch == "gemma3" else _LAYER_NAMES
        if rest in names:
            return f"model.layers.{idx}.{names[rest]}"
    return None  # e.g. rope_freqs: read into the config (`_rope_config`)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: rows (head, pair, 2) back to (head, 2, pair)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
