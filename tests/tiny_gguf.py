"""The tiny random Llama of `tests.tiny_model`, written as a GGUF file the way llama.cpp writes one.

Same vocabulary, merges, chat template and (seeded) weights as `make_tiny_hf_dir`, so a GGUF and an HF
directory built from the same seed must load to the same model. The layout follows llama.cpp's
`convert_hf_to_gguf.py` for `LlamaForCausalLM`:

- tensor names `token_embd`, `blk.N.attn_norm/attn_q/attn_k/attn_v/attn_output/ffn_norm/ffn_gate/
  ffn_up/ffn_down`, `output_norm`, `output` (absent when the embeddings are tied);
- attn_q / attn_k rows (weights and biases) permuted by llama.cpp's `permute` (rotary pairs made
  adjacent, GPT-J style) for `llama`; left in HF order for `qwen2`, as llama.cpp's Qwen2 converter does;
- metadata `llama.*`, and `tokenizer.ggml.*` with model `gpt2`, tokens, token types (3 = control),
  merges, bos / eos ids, add_bos_token and the chat template.

1-D tensors (norms) stay F32, as llama.cpp keeps them; 2-D tensors use `weight_type` (F32, F16, Q8_0)
unless `overrides` names another type for a tensor. A type `gguf` cannot quantize (e.g. IQ4_NL) is
written as zero bytes of the right size: enough for a loader that must refuse it by type.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize

from bench.kquant_encode import ENCODERS
from tests.tiny_model import CHAT_TEMPLATE, GEOMETRY, SPECIALS, byte_level_vocab, random_weights

# token ids in the tiny vocabulary (SPECIALS come first)
BOS_ID = SPECIALS.index("<|im_start|>")
EOS_ID = SPECIALS.index("<|im_end|>")

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
}
# llama.cpp's converter permutes q/k only for these (Qwen2 runs NeoX RoPE on HF-ordered rows).
PERMUTING_ARCHS = ("llama",)


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, idx, rest = hf_name.split(".", 3)
    return f"blk.{idx}.{_LAYER[rest]}"


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`, verbatim (numpy instead of torch)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_tiny_gguf(
    path: Path,
    *,
    seed: int = 0,
    tie: bool = False,
    weight_type: str = "F32",
    arch: str = "llama",
    overrides: dict[str, str] | None = None,
    pre: str = "default",
    biases: bool = False,
    geometry: dict | None = None,
    extra: dict | None = None,
) -> Path:
    """Write the tiny model to `path` (a .gguf file) and return the path. `geometry`: `GEOMETRY`'s
    entries to change (k-quants need rows of a multiple of 256 values). `extra`: more metadata keys
    (float values as float32, int values as int32)."""
    tokens, merges = byte_level_vocab()
    vocab = len(tokens)
    g = {**GEOMETRY, **(geometry or {})}
    head_dim = g["hidden"] // g["heads"]
    weights = hf_weights(seed, tie, biases, geometry)
    overrides = overrides or {}

    w = GGUFWriter(str(path), arch)
    w.add_name("tiny-llama")
    w.add_context_length(g["max_pos"])
    w.add_embedding_length(g["hidden"])
    w.add_block_count(g["layers"])
    w.add_feed_forward_length(g["inter"])
    w.add_head_count(g["heads"])
    w.add_head_count_kv(g["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(vocab)
    w.add_file_type(0)

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for key, value in (extra or {}).items():
        (w.add_int32 if isinstance(value, int) else w.add_float32)(key, value)

    for hf_name, t in weights.items():
        name = gguf_name(hf_name)
        arr = t.numpy().astype(np.float32)
        if arch in PERMUTING_ARCHS and name.endswith(("attn_q.weight", "attn_q.bias")):
            arr = llama_cpp_permute(arr, g["heads"], g["heads"])
        elif arch in PERMUTING_ARCHS and name.endswith(("attn_k.weight", "attn_k.bias")):
            arr = llama_cpp_permute(arr, g["heads"], g["kv_heads"])
        qtype = overrides.get(name, weight_type if arr.ndim == 2 else "F32")
        _add_tensor(w, name, np.ascontiguousarray(arr), qtype)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def write_hf_header(w: GGUFWriter, c, theta: float) -> None:
    """A transformers config's geometry as llama.cpp's converter writes it (head_dim from the config, RoPE
    base `theta`), and the tiny byte-level vocabulary with its chat template (tests.tiny_model)."""
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    tokens, merges = byte_level_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)


def _add_tensor(w: GGUFWriter, name: str, arr: np.ndarray, qtype: str) -> None:
    if qtype == "F32":
        w.add_tensor(name, arr)
    elif qtype == "F16":
        w.add_tensor(name, arr.astype(np.float16))
    elif qtype in ENCODERS:  # k-quants: gguf decodes them but cannot encode them
        w.add_tensor(name, ENCODERS[qtype](arr), raw_dtype=GGMLQuantizationType[qtype])
    else:
        t = GGMLQuantizationType[qtype]
        try:
            data = quantize(arr, t)
        except NotImplementedError:  # IQ types: the bytes are never decoded by a loader that refuses them
            block, type_size = GGML_QUANT_SIZES[t]
            data = np.zeros((*arr.shape[:-1], arr.shape[-1] // block * type_size), dtype=np.uint8)
        w.add_tensor(name, data, raw_dtype=t)


def hf_weights(
    seed: int = 0, tie: bool = False, biases: bool = False, geometry: dict | None = None
) -> dict[str, torch.Tensor]:
    """The HF-named float32 weights the GGUF is written from (for direct comparisons); with `biases`,
    also q/k/v projection biases (Qwen2 has them), drawn from their own seeded generator."""
    tokens, _ = byte_level_vocab()
    w = random_weights(len(tokens), seed, tie, geometry)
    if biases:
        g = {**GEOMETRY, **(geometry or {})}
        gen = torch.Generator().manual_seed(seed + 1000)
        hd = g["hidden"] // g["heads"]
        sizes = {"q": g["heads"] * hd, "k": g["kv_heads"] * hd, "v": g["kv_heads"] * hd}
        for i in range(g["layers"]):
            for n, size in sizes.items():
                w[f"model.layers.{i}.self_attn.{n}_proj.bias"] = torch.randn(size, generator=gen) * 0.5
    return w


def prompt_logits(loaded, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """float32 next-token logits at every position of `ids` ([len(ids), vocab]), via the real model.

    `loaded`: a `LoadedModel` (a float32 `LlamaModel` is built from it) or a `LlamaModel`. Runs the
    model over a fresh paged KV pool with one prefill built by `kvgate.core.step_inputs.build_step`, asking for
    logits at every position instead of only the last.
    """
    from kvgate.core.kv_cache import KVPool
    from kvgate.core.step_inputs import PrefillInput, build_step
    from kvgate.models import model_class
    from kvgate.models.llama import LlamaModel

    if isinstance(loaded, LlamaModel):
        model = loaded
    else:
        model = model_class(loaded.spec)(loaded.spec, dict(loaded.weights), torch.float32, "cpu")
    spec = model.spec
    nblk = -(-len(ids) // block_size)
    kv = KVPool(spec, nblk, block_size, model.dtype, model.device)
    batch, _, _, _ = build_step(
        [],
        [PrefillInput(0, list(ids), 0, list(range(nblk)), True)],
        block_size,
        1 << 20,
        model.device,
    )
    batch.logits_index = torch.arange(len(ids), device=model.device)
    return model.forward(batch, kv)


def served_greedy(path, prompt: list[int], **knobs) -> list[int]:
    """24 greedy tokens after `prompt` from an engine on `path` (float32, float32 KV, 16 MiB of KV), with
    `knobs` set on its EngineConfig (e.g. weights="gguf", decode_attention="gather")."""
    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine
    from kvgate.request import GenerationRequest
    from kvgate.sampling import SamplingParams

    cfg = EngineConfig(dtype="float32", kv_dtype="float32", memory_limit="2GiB", kv_cache_bytes=16 << 20)
    for k, v in knobs.items():
        setattr(cfg, k, v)
    e = Engine.from_model(str(path), cfg, overhead_bytes=0).start()
    try:
        req = GenerationRequest(prompt, SamplingParams(temperature=0), max_tokens=24, ignore_eos=True)
        return list(e.generate(req, timeout=120).token_ids)
    finally:
        e.shutdown()
