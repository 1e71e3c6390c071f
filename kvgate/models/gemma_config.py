"""Gemma 3's configuration, from an HF `config.json` or a GGUF's metadata, as `ModelSpec` fields.

`spec_fields(config, path)` reads what `kvgate.models.gemma` needs beyond a Llama's: which layers slide
and over how many positions, the sliding layers' RoPE base, the query scale and the norm offset. It
returns them with `rope_config`, the config `hf_loader._rope` reads the full layers' RoPE from.
`gguf_config(reader, path, cfg)` writes a GGUF's into the converted directory's config.json as an HF
config says them (with the norm offset 0: llama.cpp's converter stores Gemma's norms as 1 + w).

Refused by name, since kvgate does not compute them and the output would be silently wrong: logit
soft-capping (Gemma 2), bidirectional attention, an activation other than GELU-tanh, and a sliding layer
RoPE with scaling.
"""

from __future__ import annotations

from pathlib import Path

from kvgate.models.errors import ModelLoadError

PATTERN = 6  # Gemma 3: every sixth layer attends over the whole context, the rest slide
LOCAL_THETA = 10000.0  # the sliding layers' RoPE base (transformers' and llama.cpp's default)


def _refuse(path, what: str) -> ModelLoadError:
    return ModelLoadError(
        f"{path}: {what}, which kvgate's Gemma 3 forward does not compute; the output would be silently "
        "wrong, so the model is refused."
    )


def window_layers(layers: int, pattern: int = PATTERN) -> list[int]:
    return [i for i in range(layers) if (i + 1) % pattern]


def spec_fields(config: dict, path: Path) -> dict:
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(key) not in (None, 0, 0.0):
            raise _refuse(path, f"{key} is {config[key]}")
    if config.get("use_bidirectional_attention"):
        raise _refuse(path, "use_bidirectional_attention is set")
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise _refuse(path, f"the MLP's activation is {act}")
    layers = int(config["num_hidden_layers"])
    kinds = config.get("layer_types")
    if kinds:
        slide = [i for i, k in enumerate(kinds) if k == "sliding_attention"]
    else:
        slide = window_layers(layers, int(config.get("sliding_window_pattern") or PATTERN))
    rope = config.get("rope_parameters")
    rope_config, local = config, float(config.get("rope_local_base_freq", LOCAL_THETA))
    if isinstance(rope, dict) and "full_attention" in rope:  # transformers 5: a RoPE per layer type
        rope_config = {**config, "rope_parameters": rope["full_attention"]}
        mine = rope.get("sliding_attention") or {}
        if (mine.get("rope_type") or "default") != "default":
            raise _refuse(path, f"the sliding layers' RoPE is {mine}")
        local = float(mine.get("rope_theta", local))
    window = int(config.get("sliding_window") or 0)
    return {
        "rope_config": rope_config,
        "sliding_window": window if slide and window else 0,
        "window_layers": tuple(slide) if window else (),
        "rope_local_theta": local,
        "query_scale": float(config.get("query_pre_attn_scalar") or 0),
        "norm_offset": float(config.get("kvgate_norm_offset", 1.0)),
    }


def gguf_config(reader, path: Path, cfg: dict) -> None:
    from kvgate.models.gguf_tokenizer import field

    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if field(reader, f"gemma3.{key}") not in (None, 0, 0.0):
            raise _refuse(path.name, f"gemma3.{key} is set")
    layers = cfg["num_hidden_layers"]
    # llama.cpp's rule: 27B (62 layers) scales by hidden / heads, the rest by head_dim
    heads_width = cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg["query_pre_attn_scalar"] = heads_width if layers == 62 else cfg["head_dim"]
    cfg["layer_types"] = [
        "sliding_attention" if i in window_layers(layers) else "full_attention" for i in range(layers)
    ]
    cfg["rope_local_base_freq"] = float(field(reader, "gemma3.rope.freq_base_swa", LOCAL_THETA))
    cfg["kvgate_norm_offset"] = 0.0
