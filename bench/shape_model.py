"""A stand-in for a real model where its weights cannot travel: its own config and tokenizer files,
with seeded random weights of exactly its shapes. Step timings and memory match the real model's
(same matrices, same KV geometry); the text it writes is noise, so drive it with `ignore_eos`.

    python -m bench.shape_model export OUT   # here: the default model's config + tokenizer (~1.6 MB)
    python -m bench.shape_model fill OUT     # there: writes OUT/model.safetensors (bf16, seeded)

`bench/cuda_check.sh` uses it on a GPU machine, which has no network and takes at most 64 MiB of
files from us: the SmolLM2 GGUF (94 MiB) does not fit, its config and tokenizer do.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

FILES = ("config.json", "tokenizer.json", "kvgate_tokenizer.json", "tokenizer_config.json")


def export(out: Path, model: str = "default") -> Path:
    """Copy the config and tokenizer of `model` (a GGUF or HF directory; default: SmolLM2)."""
    from kvgate.models import resolve_model_path
    from kvgate.models.gguf_loader import convert_to_cache

    src = resolve_model_path(model)
    if src.suffix == ".gguf":
        src = convert_to_cache(src)
    out.mkdir(parents=True, exist_ok=True)
    copied = [f for f in FILES if (src / f).exists() and shutil.copy(src / f, out / f)]
    print(f"exported {', '.join(copied)} from {src} to {out}")
    return out


def shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama checkpoint with this config holds, by its Hugging Face name."""
    h, inter, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // nh
    out = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(L):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out[p + "self_attn.q_proj.weight"] = (nh * hd, h)
        out[p + "self_attn.k_proj.weight"] = (nkv * hd, h)
        out[p + "self_attn.v_proj.weight"] = (nkv * hd, h)
        out[p + "self_attn.o_proj.weight"] = (h, nh * hd)
        out[p + "mlp.gate_proj.weight"] = (inter, h)
        out[p + "mlp.up_proj.weight"] = (inter, h)
        out[p + "mlp.down_proj.weight"] = (h, inter)
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (cfg["vocab_size"], h)
    return out


# The embedding's scale: the head's logits are a unit-RMS row times this table (tied, or lm_head at the
# same scale), so their spread is sqrt(hidden) x EMBED_STD, ~3 for SmolLM2 as a real model's. At 0.02
# they were 0.48 and top-p 0.9 kept most of the vocabulary: the C++ draw took 6.0 ms for 16 rows
# (1.1 on a real spread) and PyTorch's 74 ms, which is no real model's sampling cost.
EMBED_STD = 0.125


def fill(out: Path, seed: int = 0) -> Path:
    """Write seeded N(0, 0.02) matrices, an N(0, EMBED_STD) embedding (and head) and unit norms of the
    config's shapes as bf16 safetensors."""
    from safetensors.torch import save_file

    cfg = json.loads((out / "config.json").read_text())
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in shapes(cfg).items():
        if len(shape) == 1:
            weights[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            std = EMBED_STD if name in ("model.embed_tokens.weight", "lm_head.weight") else 0.02
            weights[name] = (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)
    save_file(weights, str(out / "model.safetensors"))
    n = sum(w.numel() for w in weights.values())
    print(f"wrote {len(weights)} tensors, {n / 1e6:.1f}M parameters, to {out / 'model.safetensors'}")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["export", "fill"])
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="default", help="export: which model's files (default SmolLM2)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    export(a.out, a.model) if a.action == "export" else fill(a.out, a.seed)


if __name__ == "__main__":
    main()
