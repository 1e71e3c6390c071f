"""Model families beyond the Llama 2 geometry: Qwen3 (a per-head RMSNorm on q and k, head_dim apart from
hidden / heads) and RoPE scaling (Llama 3.1's llama3, linear, YaRN), against transformers' own forward.

Each case is a tiny random model made by transformers itself (its config class, its seeded weights),
saved as a Hugging Face directory and also written as a GGUF file the way llama.cpp's converter writes
that family (`rope_freqs` for llama3, `rope.scaling.*` keys for linear and yarn, `attn_q_norm` /
`attn_k_norm` for Qwen3). Prompts run past the original context the scaling is set for, so a wrong
frequency changes the logits. Seen red (max logit error, against 5e-7 when right): with the q/k norm
left out (0.4), with the scaling read and ignored (llama3 4e-3, linear 6e-3, yarn 0.27), with yarn's
attention factor dropped (0.14), and with `rope_freqs` multiplied instead of divided (8e-3).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGUFWriter, RopeScalingType

from kvgate.models import load_model
from kvgate.models.errors import ModelLoadError
from tests.tiny_gguf import (
    _add_tensor,
    gguf_name,
    llama_cpp_permute,
    prompt_logits,
    served_greedy,
    write_hf_header,
)
from tests.tiny_model import SPECIALS, build_tokenizer, byte_level_vocab, save_hf_dir

transformers = pytest.importorskip("transformers")

ATOL = 2e-5  # float32 on both sides; seen up to 5e-7 (the red cases below are 4e-3 and more)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
CASES = {
    "qwen3": ("qwen3", {"rope_type": "default"}),
    "qwen3-yarn": ("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
    "llama3": ("llama", LLAMA3),
    "linear": ("llama", {"rope_type": "linear", "factor": 4.0}),
}


def hf_model(arch: str, rope: dict, seed: int = 0):
    vocab = build_tokenizer().get_vocab_size()
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    if arch == "qwen3":  # head_dim 32: q is 128 wide over a 64-wide hidden state, as in Qwen3 (untied: tied
        # tiny random embeddings make greedy decoding repeat one token, whatever the layers do)
        cfg = transformers.Qwen3Config(
            **common, head_dim=32, tie_word_embeddings=False, rope_parameters={"rope_theta": 1e6, **rope}
        )
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(
            **common, tie_word_embeddings=False, rope_parameters={"rope_theta": 10000.0, **rope}
        )
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # spread as tests.tiny_model's (transformers' 0.02 repeats one token greedily)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # away from 1, so a norm read in the wrong place shows
                p.add_(torch.randn_like(p) * 0.2)
            else:
                p.normal_(0, 0.5 if "embed" in name else 0.08)
    return model.eval()


def llama3_factors(rope: dict, theta: float, dim: int) -> list[float]:
    """llama.cpp's converter: Llama 3.1's scaling as one divisor per frequency (its rope_freqs tensor)."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)):
        wavelen = 2 * np.pi / float(freq)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def write_gguf(model, arch: str, rope: dict, path, matrix_type: str = "F32"):
    """The model as llama.cpp's converter writes its family; 2-D tensors as `matrix_type`."""
    c = model.config
    theta = c.rope_parameters["rope_theta"]
    hd = c.head_dim
    w = GGUFWriter(str(path), arch)
    write_hf_header(w, c, theta)
    w.add_rope_dimension_count(rope.get("rotated", hd))
    if rope["rope_type"] in ("linear", "yarn", "longrope"):
        w.add_rope_scaling_type(RopeScalingType(rope["rope_type"]))
        w.add_rope_scaling_factor(rope["factor"])
    if rope["rope_type"] == "yarn":
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if rope["rope_type"] == "llama3":
        w.add_tensor("rope_freqs.weight", np.array(llama3_factors(rope, theta, hd), dtype=np.float32))
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        arr = t.float().numpy()
        g = gguf_name(name) if "_norm.weight" not in name.split("self_attn.")[-1] else None
        if g is None:  # Qwen3's q_norm / k_norm
            layer = name.split(".")[2]
            g = f"blk.{layer}.attn_{name.split('.')[-2][0]}_norm.weight"
        if arch == "llama" and g.endswith("attn_q.weight"):
            arr = llama_cpp_permute(arr, c.num_attention_heads, c.num_attention_heads)
        elif arch == "llama" and g.endswith("attn_k.weight"):
            arr = llama_cpp_permute(arr, c.num_attention_heads, c.num_key_value_heads)
        _add_tensor(w, g, np.ascontiguousarray(arr), matrix_type if arr.ndim == 2 else "F32")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


IDS = [int(i) for i in torch.randint(3, 250, (200,), generator=torch.Generator().manual_seed(7))]


@pytest.fixture(params=list(CASES), scope="module")
def case(request, tmp_path_factory):
    arch, rope = CASES[request.param]
    model = hf_model(arch, rope)
    with torch.no_grad():
        want = model(torch.tensor([IDS])).logits[0].float()
    root = tmp_path_factory.mktemp(request.param)
    d = save_hf_dir(model, root / "hf")
    g = write_gguf(model, arch, rope, root / "model.gguf")
    return request.param, d, g, want


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path / "cache"))


def test_a_hugging_face_directory_gives_transformers_logits_at_every_position(case):
    name, d, _, want = case
    got = prompt_logits(load_model(str(d)), IDS)
    err = (got - want).abs().max().item()
    assert err < ATOL, f"{name}: max logit error {err:.2e}"


def test_the_same_model_as_a_gguf_file_gives_the_same_logits(case):
    name, _, g, want = case
    loaded = load_model(str(g))
    assert loaded.spec.qk_norm == name.startswith("qwen3")
    got = prompt_logits(loaded, IDS)
    err = (got - want).abs().max().item()
    assert err < ATOL, f"{name}: max logit error {err:.2e}"


@pytest.mark.parametrize(
    "rope,words",
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "'dynamic'"),
        ({"rope_type": "longrope", "factor": 2.0}, "'longrope'"),
        ({"rope_type": "llama3", "factor": 8.0}, "low_freq_factor"),
        ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ],
)
def test_a_rope_kvgate_does_not_compute_is_refused_by_name(tmp_path, rope, words):
    """Red with the kind check removed: 'dynamic' loaded as if unscaled."""
    model = hf_model("llama", {"rope_type": "default"})
    d = save_hf_dir(model, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_theta": 10000.0, **rope}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as err:
        load_model(str(d))
    assert words in str(err.value) and "refused" in str(err.value)


@pytest.mark.parametrize(
    "rope,words",
    [
        ({"rope_type": "longrope", "factor": 2.0}, "'longrope' is not implemented"),
        ({"rope_type": "default", "rotated": 8}, "rotates 8 of each head's 16 dimensions"),
    ],
)
def test_a_gguf_whose_rope_kvgate_does_not_compute_is_refused_by_name(tmp_path, rope, words):
    """Refused at conversion, with the file's own words. Red with the rotated-dimension check removed (the
    partial-rotary file loaded, rotating every dimension)."""
    g = write_gguf(hf_model("llama", {"rope_type": "default"}), "llama", rope, tmp_path / "m.gguf")
    with pytest.raises(ModelLoadError) as err:
        load_model(str(g))
    assert words in str(err.value) and "refused" in str(err.value)


def test_an_older_config_with_rope_scaling_beside_rope_theta_reads_the_same(tmp_path):
    """transformers 4's config.json: `rope_theta` at the top, `rope_scaling` with `type`. Red when the
    old key is ignored (loaded unscaled)."""
    model = hf_model("llama", LLAMA3)
    d = save_hf_dir(model, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = {"type": params.pop("rope_type"), **params}
    (d / "config.json").write_text(json.dumps(cfg))
    spec = load_model(str(d)).spec
    assert dict(spec.rope_scaling) == {**{k: v for k, v in LLAMA3.items()}}


PROMPT = IDS[:150]  # past every case's original context, then 24 tokens more


def test_served_greedy_tokens_match_transformers_generate(case):
    """Through the engine (scheduler, prompt kernel, paged decode): greedy tokens equal transformers'
    `generate`. Red with the q/k norm left out of the decode path."""
    name, _, g, _ = case
    model = hf_model(*CASES[name])
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, min_new_tokens=24)
    assert served_greedy(g, PROMPT) == out[0, len(PROMPT) :].tolist(), name


def test_a_q8_0_file_held_as_its_blocks_gives_the_tokens_of_its_float_weights(case, tmp_path):
    """`--weights gguf` (the file's Q8_0 blocks, kvgate's block kernels) against `--weights full` (the
    same values widened to float32): the same greedy tokens, as for the Llama 2 geometry."""
    name = case[0]
    arch, rope = CASES[name]
    g = write_gguf(hf_model(arch, rope), arch, rope, tmp_path / "q8.gguf", matrix_type="Q8_0")
    assert served_greedy(g, PROMPT, weights="gguf") == served_greedy(g, PROMPT, weights="full"), name


@pytest.mark.parametrize("pre,pieces", [("llama-bpe", 1), ("qwen2", 4)])
def test_a_llama3_vocabulary_takes_a_whole_word_entry_before_merging(pre, pieces):
    """Llama 3's tokenizer (and llama.cpp for its pre-tokenizer) takes a pre-token that is itself a
    vocabulary entry as one token, whatever the merges: " Việt" is one token in Llama 3. Qwen2's merges
    build words. Red with `ignore_merges` off: " xyz" was 4 byte tokens under llama-bpe too."""
    from kvgate.tokenizer_build import build_bpe_tokenizer

    tokens, _ = byte_level_vocab()
    tokens = [*tokens, "Ġxyz"]  # no merge makes it
    tok = build_bpe_tokenizer(tokens, [], [3 if t in SPECIALS else 1 for t in tokens], pre)
    assert len(tok.encode(" xyz", add_special_tokens=False).ids) == pieces
