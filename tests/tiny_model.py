"""A tiny random Llama written as a Hugging Face directory, for fast tests through the real loaders.

Vocabulary: the 256 byte-level symbols, a few merges, and ChatML special tokens (<|endoftext|>,
<|im_start|>, <|im_end|>), so chat templates, stop ids and multibyte text all behave like a real
model's. Weights are seeded random values scaled so logits are well spread (few near-ties).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# KV bytes a position under the default cache (--kv-dtype auto: float16 on a CPU): 2 (K, V) x 2 layers
# x 2 KV heads x 16 dims x 2 bytes. Tests that size a pool in positions multiply by this.
TINY_KV_BYTES_PER_TOKEN = 256
GEOMETRY = dict(hidden=64, layers=2, heads=4, kv_heads=2, inter=128, max_pos=512)


def byte_level_vocab() -> tuple[list[str], list[str]]:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    symbols = sorted(alphabet, key=lambda c: (len(c.encode()), c))
    tokens = list(SPECIALS) + symbols + ["".join(m) for m in MERGES]
    return tokens, [f"{a} {b}" for a, b in MERGES]


def build_tokenizer() -> Tokenizer:
    tokens, merges = byte_level_vocab()
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tok


def random_weights(
    vocab: int, seed: int = 0, tie: bool = True, g: dict | None = None
) -> dict[str, torch.Tensor]:
    g = {**GEOMETRY, **(g or {})}
    gen = torch.Generator().manual_seed(seed)
    h, inter, L = g["hidden"], g["inter"], g["layers"]
    hd = h // g["heads"]

    def r(*shape, scale=0.08):
        return (torch.randn(*shape, generator=gen) * scale).float()

    w = {"model.embed_tokens.weight": r(vocab, h, scale=0.5), "model.norm.weight": 1 + r(h, scale=0.1)}
    for i in range(L):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + r(h, scale=0.1)
        w[p + "post_attention_layernorm.weight"] = 1 + r(h, scale=0.1)
        w[p + "self_attn.q_proj.weight"] = r(g["heads"] * hd, h)
        w[p + "self_attn.k_proj.weight"] = r(g["kv_heads"] * hd, h)
        w[p + "self_attn.v_proj.weight"] = r(g["kv_heads"] * hd, h)
        w[p + "self_attn.o_proj.weight"] = r(h, g["heads"] * hd)
        w[p + "mlp.gate_proj.weight"] = r(inter, h)
        w[p + "mlp.up_proj.weight"] = r(inter, h)
        w[p + "mlp.down_proj.weight"] = r(h, inter)
    if not tie:
        w["lm_head.weight"] = r(vocab, h, scale=0.5)
    return w


def config_dict(vocab: int, tie: bool = True, g: dict | None = None) -> dict:
    g = {**GEOMETRY, **(g or {})}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": g["hidden"],
        "intermediate_size": g["inter"],
        "num_hidden_layers": g["layers"],
        "num_attention_heads": g["heads"],
        "num_key_value_heads": g["kv_heads"],
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": g["max_pos"],
        "tie_word_embeddings": tie,
        "bos_token_id": 0,
        "eos_token_id": 2,
    }


def make_tiny_hf_dir(path: Path, seed: int = 0, tie: bool = False, geometry: dict | None = None) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    vocab = tok.get_vocab_size()
    tok.save(str(path / "tokenizer.json"))
    (path / "config.json").write_text(json.dumps(config_dict(vocab, tie, geometry), indent=1))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": CHAT_TEMPLATE,
                "eos_token": "<|im_end|>",
                "bos_token": "<|im_start|>",
                "add_bos_token": False,
            }
        )
    )
    save_file(random_weights(vocab, seed, tie, geometry), str(path / "model.safetensors"))
    return path


def save_hf_dir(model, path: Path) -> Path:
    """A transformers model saved as an HF directory with the tiny tokenizer and its chat template."""
    model.save_pretrained(path)
    build_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "add_bos_token": False})
    )
    return path
