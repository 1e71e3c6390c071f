"""Hugging Face directories (and converted GGUF caches) -> `LoadedModel`.

A directory holds `config.json`, one or more `*.safetensors`, `tokenizer.json`, and optionally
`tokenizer_config.json` (chat template, special tokens), `generation_config.json` (eos ids) and
`kvgate_tokenizer.json` (what our GGUF converter writes). Weights keep their HF names; the model
fuses q/k/v and gate/up itself.
"""

from __future__ import annotations

import json
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvgate.config import ModelSpec
from kvgate.models import gemma_config
from kvgate.models.errors import SUPPORTED_ARCHITECTURES, ModelLoadError
from kvgate.models.gguf_scales import SCALES_FILE
from kvgate.models.lazy_weights import LazyWeights, index_safetensors
from kvgate.models.rope import SCALINGS

_HF_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}


@dataclass
class TokenizerInfo:
    tokenizer_json: str
    chat_template: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    eog_token_ids: list[int]
    add_bos_token: bool
    # the model's sampling defaults (kvgate.server.generation_defaults): generation_config.json's, or a
    # GGUF's general.sampling.* as the converter wrote them
    sampling_defaults: dict = field(default_factory=dict)


@dataclass
class LoadedModel:
    spec: ModelSpec
    weights: MutableMapping[str, torch.Tensor]  # a dict, or `LazyWeights` read on demand (directories)
    tokenizer: TokenizerInfo
    source: str
    # a converted GGUF's block scales per layer matrix ("<name>.d", "<name>.m"; kvgate.models.gguf_scales)
    block_scales: MutableMapping[str, torch.Tensor] | None = None


def read_spec(config: dict, path: Path) -> ModelSpec:
    archs = config.get("architectures") or [config.get("model_type", "?")]
    arch = _HF_ARCHS.get(archs[0]) or (archs[0] if archs[0] in SUPPORTED_ARCHITECTURES else None)
    if arch is None:
        raise ModelLoadError(
            f"{path}: architecture '{archs[0]}' is not supported. Supported: "
            f"{', '.join(_HF_ARCHS)} (Llama-family decoders and Gemma 3)."
        )
    arch = config.get("kvgate_source_architecture", arch)
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    gemma = gemma_config.spec_fields(config, path) if arch == "gemma3" else {}
    rope_theta, rope_scaling = _rope(gemma.pop("rope_config", config), path)
    max_pos = int(config.get("max_position_embeddings", 2048))
    window = config.get("sliding_window")
    if window and not gemma and config.get("use_sliding_window", True) and int(window) < max_pos:
        # Within the window, full attention is exact; beyond it we would differ. Cap the context.
        max_pos = int(window)
    return ModelSpec(
        architecture=arch,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        rope_theta=rope_theta,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        name=str(config.get("name") or path.name),
        rope_scaling=rope_scaling,
        qk_norm=arch in ("qwen3", "gemma3"),
        **gemma,
    )


def load_hf_dir(path: Path, source: str | None = None) -> LoadedModel:

    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(
            f"{path} has no config.json: a Hugging Face model directory needs config.json, *.safetensors "
            "and tokenizer.json."
        )
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{cfg_path} is not valid JSON ({exc}); re-download the model.") from exc
    spec = read_spec(config, path)
    files = [f for f in sorted(path.glob("*.safetensors")) if f.name != SCALES_FILE]
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weights; kvgate does not read .bin checkpoints.")
    index = {}
    for f in files:
        try:
            index.update(index_safetensors(f))
        except Exception as exc:
            raise ModelLoadError(
                f"{f} could not be read ({exc}); the file is truncated or corrupt. Download it again."
            ) from exc
    weights = LazyWeights(index)  # read tensor by tensor as the engine builds its model
    if "lm_head.weight" not in weights and not spec.tie_word_embeddings:
        raise ModelLoadError(f"{path}: no lm_head.weight and tie_word_embeddings is false.")
    required = required_tensors(spec)
    missing = [n for n in required if n not in weights]
    if missing:
        raise ModelLoadError(
            f"{source or path}: {len(missing)} of the {len(required)} tensors a "
            f"{spec.num_layers}-layer model needs are missing, e.g. {', '.join(missing[:3])}; the file is "
            "incomplete or corrupt. Download it again and compare its size and checksum with the source."
        )
    scales = path / SCALES_FILE
    block_scales = LazyWeights(index_safetensors(scales)) if scales.is_file() else None
    return LoadedModel(spec, weights, _read_tokenizer(path), source or str(path), block_scales)


def required_tensors(spec: ModelSpec) -> list[str]:
    """Every tensor the model is built from (biases and an untied head aside)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{n}_proj.weight" for n in "qkvo"]
        names += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        if spec.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        if spec.architecture == "gemma3":
            names += [p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"]
    return names


def _rope(config: dict, path: Path) -> tuple[float, tuple]:
    """RoPE's base and scaling, from `rope_parameters` (transformers 5 writes the base there, with the
    scaling kind) or the top-level `rope_theta` and `rope_scaling` (earlier configs). Kinds kvgate
    computes (`kvgate.models.rope.SCALINGS`) keep their parameters; any other kind, a partial rotary
    dimension or a per-layer-type RoPE is refused by name: its output would be silently wrong. Reading
    only the top level ran a 1e6-base Qwen2 at 10000 (QA pass 7)."""
    factors = config.get("kvgate_rope_freq_factors")  # a GGUF's rope_freqs tensor (kvgate.models.gguf_loader)
    if factors:
        kept = (("factors", tuple(float(f) for f in factors)), ("rope_type", "freq_factors"))
        return float(config.get("rope_theta", 10000.0)), kept
    rope = config.get("rope_parameters")
    params = rope if rope is not None else (config.get("rope_scaling") or {})
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0)) if isinstance(params, dict) else None
    kind = (params.get("rope_type") or params.get("type") or "default") if isinstance(params, dict) else None
    given = {
        k: v for k, v in (params.items() if kind else ()) if k not in ("rope_type", "type", "rope_theta")
    }
    partial = given.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))

    def refuse(why: str) -> ModelLoadError:
        where = "rope_parameters" if rope is not None else "rope_scaling"
        return ModelLoadError(
            f"{path}: {where} {params} {why}. kvgate computes the default RoPE and the scalings "
            f"{', '.join(k for k in SCALINGS if k != 'freq_factors')}; anything else is not implemented and "
            "its output would be silently wrong, so the model is refused."
        )

    if theta is None or kind is None or (rope is not None and "rope_theta" not in rope):
        raise refuse("is not one RoPE with a base (per-layer-type RoPE?)")
    if partial not in (None, 1, 1.0):
        raise refuse(f"rotates part of each head (partial_rotary_factor {partial})")
    if kind == "default":
        if any(v not in (None, 1, 1.0) for v in given.values()):
            raise refuse("gives scaling parameters to the default kind")
        return float(theta), ()
    if kind not in SCALINGS or kind == "freq_factors":
        raise refuse(f"asks for the {kind!r} scaling")
    if kind == "yarn" and given.get("factor") is None and given.get("original_max_position_embeddings"):
        given["factor"] = config["max_position_embeddings"] / given["original_max_position_embeddings"]
    missing = [k for k in SCALINGS[kind] if given.get(k) is None]
    if missing:
        raise refuse(f"lacks {', '.join(missing)} for its {kind!r} scaling")
    kept = {k: v for k, v in given.items() if v is not None and k in _ROPE_KEYS}
    return float(theta), tuple(sorted({"rope_type": kind, **kept}.items()))


_ROPE_KEYS = (
    "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
    "attention_factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow", "truncate", "factors",
)  # fmt: skip


def _read_tokenizer(path: Path) -> TokenizerInfo:
    tj = path / "tokenizer.json"
    if not tj.is_file():
        raise ModelLoadError(f"{path} has no tokenizer.json; kvgate needs a fast-tokenizer file.")
    extra_path = path / "kvgate_tokenizer.json"
    if extra_path.is_file():
        extra = json.loads(extra_path.read_text())
        return TokenizerInfo(
            tj.read_text(),
            extra.get("chat_template"),
            extra.get("bos_token_id"),
            extra.get("eos_token_id"),
            list(extra.get("eog_token_ids") or []),
            bool(extra.get("add_bos_token")),
            dict(extra.get("sampling_defaults") or {}),
        )
    text = tj.read_text()
    vocab = _added_token_ids(json.loads(text))
    tc = _json(path / "tokenizer_config.json")
    gc = _json(path / "generation_config.json")
    template = tc.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()

    def tid(name: str) -> int | None:
        tok = tc.get(name)
        if isinstance(tok, dict):
            tok = tok.get("content")
        return vocab.get(tok) if isinstance(tok, str) else None

    eos = gc.get("eos_token_id", tid("eos_token"))
    eos_list = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    bos = gc.get("bos_token_id", tid("bos_token"))
    from kvgate.models.gguf_tokenizer import EOG_TEXTS

    eog = set(int(e) for e in eos_list) | {vocab[t] for t in EOG_TEXTS if t in vocab}
    return TokenizerInfo(
        text,
        template,
        None if bos is None else int(bos),
        int(eos_list[0]) if eos_list else None,
        sorted(eog),
        bool(tc.get("add_bos_token", False)),
        sampling_defaults(gc),
    )


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # what vLLM takes


def sampling_defaults(config: dict) -> dict:
    """The sampling defaults a generation_config.json sets (numbers only; kvgate.server.generation_defaults)."""
    return {
        k: config[k]
        for k in SAMPLING_KEYS
        if isinstance(config.get(k), (int, float)) and not isinstance(config.get(k), bool)
    }


def _added_token_ids(tok_json: dict) -> dict[str, int]:
    return {t["content"]: int(t["id"]) for t in tok_json.get("added_tokens", [])}


def _json(p: Path) -> dict:
    return json.loads(p.read_text()) if p.is_file() else {}
