"""The model's own sampling defaults (kvgate/server/generation_defaults.py): a request that leaves a field
out gets the value of the model's generation_config.json (HF directories) or general.sampling.* (GGUF
files), as vLLM's --generation-config auto and llama-server do; one that sets it keeps its own; and
--generation-config vllm keeps kvgate's defaults.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server_util import running_server
from tests.tiny_model import make_tiny_hf_dir

MSG = [{"role": "user", "content": "tell me something"}]


@pytest.fixture(scope="module")
def greedy_dir(tmp_path_factory):
    """The tiny model whose generation_config.json asks for greedy decoding (temperature 0)."""
    d = make_tiny_hf_dir(tmp_path_factory.mktemp("gen-config"))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "temperature": 0.0, "top_k": 1}))
    return d


def texts(base: str, n: int, **body) -> set[str]:
    out = set()
    for seed in range(n):
        r = httpx.post(
            base + "/v1/chat/completions",
            json={"model": "tiny", "messages": MSG, "max_tokens": 12, "seed": seed, **body},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        out.add(r.json()["choices"][0]["message"]["content"])
    return out


def engine_of(path):
    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine

    cfg = EngineConfig(dtype="float32", kv_cache_bytes=16 << 20, memory_limit="2GiB")
    return Engine.from_model(str(path), cfg, overhead_bytes=0).start()


def test_left_out_fields_take_the_models_defaults_and_set_ones_keep_their_own(greedy_dir):
    """Without temperature, 4 seeds give one text (the model's temperature 0); with temperature 1 they
    differ; with --generation-config vllm, left-out fields are kvgate's (temperature 1) again. Seen red
    with the model's defaults not read (4 texts), and with them taken over a request's own (1 text)."""
    e = engine_of(greedy_dir)
    try:
        assert e.tokenizer.info.sampling_defaults == {"temperature": 0.0, "top_k": 1}
        with running_server(e) as (base, _):
            assert len(texts(base, 4)) == 1
            assert len(texts(base, 4, temperature=1.0, top_k=0)) > 1
        with running_server(e, generation_config="vllm") as (base, _):
            assert len(texts(base, 4)) > 1
    finally:
        e.shutdown()


def test_a_gguf_files_general_sampling_keys_are_read(tmp_path, monkeypatch):
    """llama.cpp's converter writes generation_config.json's sampling as general.sampling.*: they are
    read with generation_config's names. Red with the converter's extra left out (an empty dict)."""
    from kvgate.models import load_model
    from tests.tiny_gguf import write_tiny_gguf

    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path / "cache"))
    extra = {"general.sampling.temp": 0.6, "general.sampling.top_p": 0.95, "general.sampling.top_k": 20}
    path = write_tiny_gguf(tmp_path / "s.gguf", extra=extra)
    got = load_model(str(path)).tokenizer.sampling_defaults
    assert got == {"temperature": pytest.approx(0.6), "top_p": pytest.approx(0.95), "top_k": 20}


def test_the_flag_takes_auto_and_vllm_only():
    import argparse

    from kvgate.server.generation_defaults import add_generation_config_flag

    p = argparse.ArgumentParser()
    add_generation_config_flag(p)
    assert p.parse_args([]).generation_config == "auto"
    assert p.parse_args(["--generation-config", "vllm"]).generation_config == "vllm"
    with pytest.raises(SystemExit):
        p.parse_args(["--generation-config", "off"])
