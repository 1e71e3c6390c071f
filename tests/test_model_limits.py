"""Model features kvgate does not implement are refused or bounded, never silently computed wrong."""

from __future__ import annotations

import json

import pytest
import torch

from kvgate.models import ModelLoadError, load_model
from kvgate.sampling import Sampler, SamplingParams
from tests.tiny_model import make_tiny_hf_dir


def _with_config(tmp_path, **changes):
    d = make_tiny_hf_dir(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_rope_scaling_without_its_parameters_is_refused_by_name(tmp_path):
    """Seen to fail (the model loaded) before hf_loader checked rope_scaling. Since session 47 llama3
    scaling is computed (tests/test_model_families.py); one without its parameters is still refused."""
    d = _with_config(tmp_path, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ModelLoadError, match="rope_scaling .*lacks low_freq_factor, high_freq_factor"):
        load_model(str(d))


def test_rope_parameters_give_the_base_and_a_scaled_kind_is_refused(tmp_path):
    """transformers 5 writes RoPE's base inside `rope_parameters` (no top-level rope_theta): it is read
    from there, and a scaled kind written there without what it needs (yarn with no original context)
    is refused as rope_scaling is. Seen red: the base read as 10000 and the yarn model loaded (QA pass 7:
    a 1e6-base Qwen2's tokens went wrong). Yarn with its parameters is computed since session 47."""
    d = _with_config(tmp_path / "a", rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("rope_theta")
    (d / "config.json").write_text(json.dumps(cfg))
    assert load_model(str(d)).spec.rope_theta == 1e6
    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}
    with pytest.raises(ModelLoadError, match="rope_parameters .*yarn.* not implemented"):
        load_model(str(_with_config(tmp_path / "b", rope_parameters=yarn)))
    # the older key `type`, and a partial rotary factor, are not the default kind either (review)
    for i, rope in enumerate(
        ({"type": "yarn", "rope_theta": 1e6}, {"rope_theta": 1e6, "partial_rotary_factor": 0.5})
    ):
        with pytest.raises(ModelLoadError, match="rope_parameters .* not implemented"):
            load_model(str(_with_config(tmp_path / f"c{i}", rope_parameters=rope)))


def test_a_checkpoint_missing_a_layer_tensor_is_refused_at_load_naming_it(tmp_path):
    """A layer's up_proj left out of the file: the load names it and says to download again, instead of
    `plan` accepting it and `generate` dying on a KeyError (QA pass 7). Seen red without the check."""
    from safetensors.torch import load_file, save_file

    d = make_tiny_hf_dir(tmp_path / "m")
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(
        ModelLoadError,
        match=r"1 of the 20 tensors a 2-layer model needs are missing, e\.g\. "
        r"model\.layers\.1\.mlp\.up_proj\.weight; the file is incomplete",
    ):
        load_model(str(d))


def test_sliding_window_caps_the_context_instead_of_attending_past_it(tmp_path):
    """Full attention equals sliding-window attention only inside the window, so the context is capped.
    Seen to fail when the window was ignored (max_position_embeddings stayed 512)."""
    d = _with_config(tmp_path, sliding_window=128)
    assert load_model(str(d)).spec.max_position_embeddings == 128


def test_top_p_stops_at_the_token_that_reaches_it():
    """probs 0.5, 0.3, 0.2 with top_p=0.8: the first two reach 0.8 exactly, so the third is dropped.
    Seen to fail with the strict '>' comparison, which kept the third token."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.8, seed=0), [], 3)
    drawn = {s.sample(logits) for _ in range(300)}
    assert drawn == {0, 1}


def test_completion_echo_suffix_and_unknown_message_keys_are_refused_by_name(make_engine):
    """Seen to fail when echo/suffix were accepted and ignored, and message extras dropped silently.
    Since issue 13, `echo` alone and `tool_calls` messages are supported; since session 17 echo with
    logprobs (the prompt's log-probabilities) too, answered whole: streamed, it is refused by name."""
    import httpx

    from tests.server_util import running_server

    with running_server(make_engine()) as (base, _):
        for body, param in (
            ({"prompt": "hi", "echo": True, "logprobs": 1, "stream": True}, "echo"),
            ({"prompt": "hi", "suffix": "end"}, "suffix"),
        ):
            r = httpx.post(base + "/v1/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param
        msg = {"role": "assistant", "content": "x", "frobnicate": []}
        r = httpx.post(base + "/v1/chat/completions", json={"messages": [msg]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.frobnicate"
        before = httpx.get(base + "/metrics").text.count('reason="shutting_down"')
        assert before == 0


def test_a_model_without_a_chat_template_is_said_to_get_chatml(tmp_path, caplog):
    """No chat template in the checkpoint: the fallback is ChatML, and the log says so once, at load,
    instead of formatting chats silently in a format the model may not know (QA pass 7). Seen red
    without the warning."""
    import dataclasses
    import logging

    from kvgate.tokenizer import TextTokenizer

    info = load_model(str(make_tiny_hf_dir(tmp_path / "m"))).tokenizer
    with caplog.at_level(logging.WARNING, logger="kvgate.tokenizer"):
        TextTokenizer(info)
        assert not caplog.records  # the tiny model has its template
        tok = TextTokenizer(dataclasses.replace(info, chat_template=None))
    assert any("no chat template" in r.getMessage() and "ChatML" in r.getMessage() for r in caplog.records)
    assert "<|im_start|>user\nhi<|im_end|>" in tok.render_chat([{"role": "user", "content": "hi"}])


def test_a_failed_kernel_build_quotes_the_compiler_and_advises_by_what_is_missing(monkeypatch):
    """The warning quotes the compiler's error lines and asks to install only what is missing; with
    g++ and ninja present it says the compiler refused the sources (QA pass 7: the last 300 characters
    of a ninja command line, and advice to install tools already installed). Red with the advice
    given whatever is installed."""
    import shutil

    from kvgate.models import native

    exc = RuntimeError(
        "Error building extension: [1/2] c++ -O3 ... -c tile_matmul.cpp\n"
        "tile_matmul.cpp:329:30: error: no matching function for call to 'd16'\nninja: build stopped"
    )
    monkeypatch.setattr(shutil, "which", lambda tool: f"/usr/bin/{tool}")
    why = native.build_failure(exc)
    assert "tile_matmul.cpp:329:30: error: no matching function" in why and "compiler refused" in why
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "ninja" else "/usr/bin/g++")
    assert "Install ninja (" in native.build_failure(exc)
