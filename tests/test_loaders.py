"""Loaders: a GGUF written the way llama.cpp writes one and the HF directory of the same weights load
to the same model; quantized tensors dequantize close to their originals; every load failure says what
went wrong and what to do; converted GGUFs are cached and the cache follows the file.

Every test here uses the tiny random Llama (`tests.tiny_model`, `tests.tiny_gguf`), written fresh.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from kvgate.models import ModelLoadError, gguf_loader, load_model
from kvgate.tokenizer import TextTokenizer
from tests.tiny_gguf import BOS_ID, EOS_ID, hf_weights, prompt_logits, write_tiny_gguf
from tests.tiny_model import CHAT_TEMPLATE, make_tiny_hf_dir

GEOMETRY_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "rope_theta",
    "max_position_embeddings",
    "tie_word_embeddings",
)
TEXTS = [
    "the theme in the thin air",
    "<|im_start|>user\nHé, ça va? 你好 🙂 12345<|im_end|>\n",
    "don't  stop\n\n  tabs\tand 'quotes'",
]


@pytest.fixture(scope="module")
def ids(tiny_dir):
    tok = TextTokenizer(load_model(str(tiny_dir)).tokenizer)
    return tok.encode(
        "<|im_start|>user\nthe cat sat in the hat, ça va? 🙂<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="module")
def tiny_gguf(gguf_dir):
    return write_tiny_gguf(gguf_dir / "tiny-f32.gguf")


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """A cache folder of this test's own, and a count of the GGUF conversions it performs."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(cache))
    calls = []
    real = gguf_loader._convert

    def counting(path, out):
        calls.append(path)
        return real(path, out)

    monkeypatch.setattr(gguf_loader, "_convert", counting)
    return cache, calls


# ---- the same model from two formats ---------------------------------------------------------------


def test_gguf_and_hf_directory_of_the_same_weights_load_to_identical_logits(tiny_gguf, tiny_dir, ids):
    """llama.cpp's q/k row permutation is undone, names map to HF names, geometry is read from metadata.

    Seen to fail when `_unpermute` is the identity, when attn_k is unpermuted with the query head
    count, and when `_hf_name` maps ffn_gate/ffn_up to each other.
    """
    g, h = load_model(str(tiny_gguf)), load_model(str(tiny_dir))
    for field in GEOMETRY_FIELDS:
        assert getattr(g.spec, field) == getattr(h.spec, field), field
    assert g.spec.rms_norm_eps == pytest.approx(h.spec.rms_norm_eps)
    assert sorted(g.weights) == sorted(h.weights)
    for name, w in h.weights.items():
        assert torch.equal(g.weights[name], w), name
    lg, lh = prompt_logits(g, ids), prompt_logits(h, ids)
    assert lg.shape == (len(ids), h.spec.vocab_size)
    assert torch.equal(lg, lh)


@pytest.mark.parametrize("arch,hf_arch", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM")])
def test_q_and_k_rows_and_biases_are_unpermuted_only_where_llama_cpp_permuted_them(
    gguf_dir, tmp_path, ids, arch, hf_arch
):
    """llama.cpp permutes q/k weights and biases for `llama`; its Qwen2 files keep HF row order.

    Seen to fail (qwen2) when every architecture's q/k rows are unpermuted, which is how the
    converter first behaved, and (llama) when the q/k biases are left permuted.
    """
    path = write_tiny_gguf(gguf_dir / f"tiny-{arch}-bias.gguf", arch=arch, biases=True)
    d = make_tiny_hf_dir(tmp_path / arch)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": [hf_arch]}))
    save_file(hf_weights(biases=True), str(d / "model.safetensors"))
    g, h = load_model(str(path)), load_model(str(d))
    assert g.spec.architecture == h.spec.architecture == arch
    assert sorted(g.weights) == sorted(h.weights)
    for name, w in h.weights.items():
        assert torch.equal(g.weights[name], w), name
    assert torch.equal(prompt_logits(g, ids), prompt_logits(h, ids))


def test_gguf_tokenizer_metadata_gives_the_same_tokens_template_and_special_ids_as_hf(tiny_gguf, tiny_dir):
    """Control tokens (type 3) are whole special tokens; merges apply; the chat template is kept.

    Seen to fail when control tokens are not registered as special (<|im_start|> splits into bytes),
    when merges are dropped, and when the GGUF chat template is not carried over.
    """
    g, h = load_model(str(tiny_gguf)).tokenizer, load_model(str(tiny_dir)).tokenizer
    tg, th = TextTokenizer(g), TextTokenizer(h)
    for text in TEXTS:
        assert tg.encode(text) == th.encode(text), text
        assert tg.decode(tg.encode(text), skip_special_tokens=False) == text
    assert tg.encode(" the") == th.encode(" the") and len(tg.encode(" the")) == 1  # merges applied
    assert tg.encode("<|im_end|>") == [EOS_ID]
    assert (g.bos_token_id, g.eos_token_id, g.add_bos_token) == (BOS_ID, EOS_ID, False)
    assert (g.bos_token_id, g.eos_token_id) == (h.bos_token_id, h.eos_token_id)
    assert EOS_ID in g.eog_token_ids and set(g.eog_token_ids) == set(h.eog_token_ids)
    assert g.chat_template == CHAT_TEMPLATE  # not the ChatML fallback, which renders alike here
    messages = [{"role": "user", "content": "hi"}]
    assert tg.render_chat(messages) == th.render_chat(messages)
    assert tg.chat_ids(messages) == th.chat_ids(messages)


def test_f16_tensors_load_close_to_the_float32_originals(gguf_dir, tiny_gguf, ids):
    """Seen to fail when F16 is missing from the supported types, and when the q/k unpermute is
    applied to F32 tensors only."""
    path = write_tiny_gguf(gguf_dir / "tiny-f16.gguf", weight_type="F16")
    loaded = load_model(str(path))
    for name, w in hf_weights().items():
        got = loaded.weights[name]
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, w, rtol=1e-3, atol=1e-4, msg=name)
    ref = prompt_logits(load_model(str(tiny_gguf)), ids)
    torch.testing.assert_close(prompt_logits(loaded, ids), ref, rtol=0, atol=0.02)


def test_q8_0_tensors_dequantize_within_one_quantization_step(gguf_dir, tiny_gguf, ids):
    """Q8_0 keeps 8 bits per weight with one scale per 32: every weight is within max|w| / 127.

    Seen to fail when Q8_0 tensors skip the q/k unpermute, and when Q8_0 is missing from the
    supported types.
    """
    path = write_tiny_gguf(gguf_dir / "tiny-q8.gguf", weight_type="Q8_0")
    loaded = load_model(str(path))
    for name, w in hf_weights().items():
        got = loaded.weights[name]
        step = float(w.abs().max()) / 127
        assert float((got - w).abs().max()) <= step, name
        if w.ndim == 2:
            assert not torch.equal(got, w), f"{name} was not actually quantized"
    ref = prompt_logits(load_model(str(tiny_gguf)), ids)
    q8 = prompt_logits(loaded, ids)
    torch.testing.assert_close(q8, ref, rtol=0, atol=0.25)  # logits span about +-15
    assert torch.equal(q8.argmax(-1), ref.argmax(-1))


def test_tied_gguf_without_output_tensor_uses_the_token_embeddings_as_lm_head(gguf_dir, tmp_path, ids):
    """Seen to fail when the converter always writes tie_word_embeddings=false (the load is refused)."""
    path = write_tiny_gguf(gguf_dir / "tiny-tied.gguf", tie=True)
    g = load_model(str(path))
    assert g.spec.tie_word_embeddings
    assert "lm_head.weight" not in g.weights
    h = load_model(str(make_tiny_hf_dir(tmp_path / "tied", tie=True)))
    assert torch.equal(prompt_logits(g, ids), prompt_logits(h, ids))


# ---- failures name the cause and the fix -----------------------------------------------------------


def test_missing_file_error_names_the_path_and_what_to_pass_instead(tmp_path):
    """Seen to fail when both existence checks (load_model's and convert_to_cache's) are removed: a bare
    FileNotFoundError escapes from cache_key."""
    missing = tmp_path / "no-such-model.gguf"
    with pytest.raises(ModelLoadError) as err:
        load_model(str(missing))
    msg = str(err.value)
    assert str(missing) in msg and "not found" in msg
    assert "--model default" in msg and ".gguf" in msg


def test_directory_without_config_json_is_refused_with_what_a_model_directory_needs(tmp_path):
    """Seen to fail when the config.json check is removed (a bare FileNotFoundError escapes)."""
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path))
    msg = str(err.value)
    assert str(tmp_path) in msg and "config.json" in msg and "safetensors" in msg


def test_unknown_gguf_architecture_is_named_and_the_supported_ones_listed(tmp_path, own_cache):
    """Seen to fail when the architecture check is removed (the file converts as if it were a Llama)."""
    path = write_tiny_gguf(tmp_path / "mamba.gguf", arch="mamba")
    with pytest.raises(ModelLoadError) as err:
        load_model(str(path))
    msg = str(err.value)
    assert "'mamba'" in msg and "not supported" in msg
    for arch in ("llama", "mistral", "qwen2"):
        assert arch in msg
    cache, _ = own_cache
    assert not any(cache.glob("gguf-*")), "a failed conversion left a cache entry behind"


def test_unknown_hf_architecture_is_named_and_the_supported_ones_listed(tmp_path):
    """Seen to fail when read_spec falls back to llama for unknown architectures."""
    d = make_tiny_hf_dir(tmp_path / "gpt2")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as err:
        load_model(str(d))
    msg = str(err.value)
    assert "'GPT2LMHeadModel'" in msg and "not supported" in msg and "LlamaForCausalLM" in msg


def test_unsupported_quantization_type_is_named_with_the_tensor_and_a_fix(tmp_path, own_cache):
    """Seen to fail when the supported-type check is removed (IQ4_NL bytes are decoded as if valid)."""
    path = write_tiny_gguf(tmp_path / "iq.gguf", overrides={"blk.1.ffn_up.weight": "IQ4_NL"})
    with pytest.raises(ModelLoadError) as err:
        load_model(str(path))
    msg = str(err.value)
    assert "IQ4_NL" in msg and "blk.1.ffn_up.weight" in msg
    assert "Q8_0" in msg and "Re-quantize" in msg
    cache, _ = own_cache
    assert not any(cache.glob("gguf-*")) and not any(cache.glob(".convert-*"))


@pytest.mark.parametrize("keep", [0, 3, 0.01, 0.5, 0.9999], ids=lambda k: f"keep={k}")
def test_truncated_gguf_is_reported_as_truncated_or_corrupt(tiny_gguf, tmp_path, own_cache, keep):
    """Cut inside the magic, the metadata, and the tensor data: always a ModelLoadError, never a raw
    ValueError/IndexError. Seen to fail when `_open_reader` stops wrapping the reader's exceptions."""
    data = tiny_gguf.read_bytes()
    n = keep if isinstance(keep, int) else int(len(data) * keep)
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:n])
    with pytest.raises(ModelLoadError) as err:
        load_model(str(path))
    msg = str(err.value)
    assert str(path) in msg and "truncated or corrupt" in msg and "download it again" in msg
    cache, _ = own_cache
    assert not any(cache.glob("gguf-*"))


def test_file_that_is_neither_gguf_nor_a_directory_is_refused_by_its_magic(tmp_path):
    """Seen to fail when the magic check is skipped for non-.gguf names (the GGUF reader's error)."""
    path = tmp_path / "model.bin"
    path.write_bytes(b"PK\x03\x04 not a gguf file" * 10)
    with pytest.raises(ModelLoadError, match="no GGUF magic"):
        load_model(str(path))


# ---- the conversion cache --------------------------------------------------------------------------


def test_second_load_of_a_gguf_reuses_the_cache_without_converting_again(tiny_gguf, own_cache):
    """Seen to fail when convert_to_cache ignores an existing entry (two conversions)."""
    cache, calls = own_cache
    first = load_model(str(tiny_gguf))
    second = load_model(str(tiny_gguf))
    assert len(calls) == 1
    assert len(list(cache.glob("gguf-*"))) == 1
    assert second.source == str(tiny_gguf)
    for name, w in first.weights.items():
        assert torch.equal(second.weights[name], w)


def test_touching_a_gguf_gives_a_new_cache_key_and_a_fresh_conversion(gguf_dir, own_cache):
    """Seen to fail when the cache key leaves out the modification time."""
    _, calls = own_cache
    path = write_tiny_gguf(gguf_dir / "touched.gguf")
    key = gguf_loader.cache_key(path)
    load_model(str(path))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    assert gguf_loader.cache_key(path) != key
    load_model(str(path))
    assert len(calls) == 2


def test_rewriting_a_gguf_in_place_never_serves_the_old_weights(gguf_dir, own_cache):
    """Same path, same size, same mtime, new weights: the content is part of the key.

    Seen to fail when the cache key hashes only path, size and mtime.
    """
    _, calls = own_cache
    path = write_tiny_gguf(gguf_dir / "rewritten.gguf", seed=0)
    st = path.stat()
    key = gguf_loader.cache_key(path)
    assert torch.equal(load_model(str(path)).weights["model.norm.weight"], hf_weights(0)["model.norm.weight"])
    write_tiny_gguf(path, seed=1)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size
    assert gguf_loader.cache_key(path) != key
    reloaded = load_model(str(path))
    assert len(calls) == 2
    assert torch.equal(reloaded.weights["model.norm.weight"], hf_weights(1)["model.norm.weight"])


@pytest.mark.parametrize("packed", ["off", "on"])
def test_a_qwen2_gguf_with_attention_biases_loads_and_serves_within_its_plan(gguf_dir, packed):
    """A Qwen2-family GGUF with q/k/v biases builds an engine whose planned weight bytes cover every
    tensor (the biases included) and generates.

    Before the fix (a87aed9) the engine refused it at load with a bare `AssertionError: weights 497920 B
    exceed the planned 496896 B`: the plan's formula left the biases out. Seen red here with the plan
    computed from the geometry (`weight_params=None` in `plan_for`) again, now as a clear PlanError.
    """
    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine
    from kvgate.request import GenerationRequest
    from kvgate.sampling import SamplingParams

    path = write_tiny_gguf(gguf_dir / "tiny-qwen2-bias-engine.gguf", arch="qwen2", biases=True)
    cfg = EngineConfig(
        device="cpu", dtype="float32", memory_limit="2GiB", kv_cache_bytes=1 << 20, pack_weights=packed
    )
    e = Engine.from_model(str(path), cfg, overhead_bytes=0).start()
    try:
        assert e.spec.architecture == "qwen2"
        assert e.model.weight_bytes <= e.plan.weights_bytes
        assert e.plan.weights_bytes - e.model.weight_bytes < 1024  # exact up to packing's own rounding
        res = e.generate(GenerationRequest([5, 6, 7], SamplingParams(temperature=0), 4, ignore_eos=True), 10)
        assert res.finish_reason == "length" and len(res.token_ids) == 4
    finally:
        e.shutdown()


def test_a_directorys_tensors_are_read_when_the_engine_asks_one_at_a_time(tmp_path):
    """QA pass 6 (HIGH for the memory contract): the whole float checkpoint was held while it was
    packed, so loading SmolLM2 under --memory-limit 720MiB peaked at ~1 GiB resident. A directory's
    tensors are now read on demand (`LazyWeights`): each read gives the file's values, `pop` reads
    and forgets, the sizes come from the headers without a read, and a file cut short is still
    refused at load. Seen red with the eager dict back (checkpoint_bytes = the whole table)."""
    from safetensors.torch import load_file

    from kvgate.core.placement import checkpoint_bytes, checkpoint_params
    from kvgate.models.lazy_weights import LazyWeights

    d = make_tiny_hf_dir(tmp_path / "tiny")
    loaded = load_model(str(d))
    assert isinstance(loaded.weights, LazyWeights) and checkpoint_bytes(loaded) == 0
    ref = {}
    for f in sorted(d.glob("*.safetensors")):
        ref.update(load_file(f))
    assert sorted(loaded.weights) == sorted(ref)
    assert checkpoint_params(loaded) == sum(t.numel() for t in ref.values())
    name = "model.norm.weight"
    assert torch.equal(loaded.weights[name], ref[name]) and name in loaded.weights
    assert torch.equal(loaded.weights.pop(name), ref[name]) and name not in loaded.weights
    f = sorted(d.glob("*.safetensors"))[0]
    f.write_bytes(f.read_bytes()[:-7])
    with pytest.raises(ModelLoadError) as err:
        load_model(str(d))
    assert "truncated or corrupt" in str(err.value)


def test_a_new_version_of_a_gguf_replaces_its_cache_entry_and_the_log_names_it(gguf_dir, own_cache, caplog):
    """Touching a GGUF converts it again (a new key) and removes the entry the earlier version left,
    logging the entry's path and size; another file's entry stays. Seen red: every version kept its
    515 MiB copy with nothing said (QA pass 7)."""
    import logging

    cache, calls = own_cache
    other = write_tiny_gguf(gguf_dir / "other.gguf", seed=2)
    load_model(str(other))
    path = write_tiny_gguf(gguf_dir / "versions.gguf")
    with caplog.at_level(logging.INFO, logger="kvgate.models"):
        load_model(str(path))
    first = cache / f"gguf-{gguf_loader.cache_key(path)}"
    assert any(str(first) in r.getMessage() and "MiB" in r.getMessage() for r in caplog.records)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    load_model(str(path))
    assert len(calls) == 3 and not first.exists()
    assert sorted(cache.glob("gguf-*")) == sorted(
        [cache / f"gguf-{gguf_loader.cache_key(path)}", cache / f"gguf-{gguf_loader.cache_key(other)}"]
    )


def test_a_gguf_without_a_tokenizer_says_so_instead_of_naming_type_none(tmp_path):
    """QA pass 7: "tokenizer type 'None' is not supported" for a file with no tokenizer at all. Red with
    the old message."""
    from types import SimpleNamespace

    from kvgate.models import ModelLoadError
    from kvgate.models.gguf_tokenizer import tokenizer_from_metadata

    with pytest.raises(ModelLoadError, match=r"x\.gguf: carries no tokenizer \(no tokenizer\.ggml\.model\)"):
        tokenizer_from_metadata(SimpleNamespace(fields={}), tmp_path / "x.gguf")


def test_settling_an_older_versions_entry_never_removes_a_newer_ones(tmp_path):
    """Two conversions of one path race and the older version's finishes last: the newer version's entry
    stays, and a still older one goes (the review). Red with entries removed whatever their version."""
    import json

    from kvgate.models.gguf_cache import settle

    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    mtime = src.stat().st_mtime_ns
    newer, older, ours = (tmp_path / "cache" / f"gguf-{k}" for k in ("newer", "older", "ours"))
    for entry, t in ((newer, mtime + 10**9), (older, mtime - 10**9)):
        entry.mkdir(parents=True)
        (entry / "source.json").write_text(json.dumps({"path": str(src.resolve()), "mtime_ns": t}))
    ours.mkdir()
    assert settle(ours, src) == [older]
    assert newer.exists() and ours.exists() and not older.exists()
