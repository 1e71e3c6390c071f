"""The decode loops' prefetch modes change speed only, and the load-time probe picks by its numbers
(kvgate.models.decode_prefetch).

Seen red: with `fastest` taking the slowest mode, the decision test fails; with the probe's cap left
out, the cap test; with the engine's call to `choose` removed, the engine test. The bit test guards
that nothing but the prefetch hangs on the modes (the kernel computes the same blocks in the same
order in each; it was not seen red, since breaking it means breaking the C++ loop itself).
"""

from __future__ import annotations

import pytest
import torch

from kvgate.models import decode_prefetch, native
from kvgate.models.q4_1 import Q41Linear, q4_1_blocks
from kvgate.models.q8_head import Q8Table, q8_blocks
from tests.test_q4_1 import engine, ggml_q4_1, q4_tiny_dir  # noqa: F401 - the fixture
from tests.test_q8_head import ggml_q8_0

pytestmark = pytest.mark.skipif(
    native.extension() is None, reason=f"kvgate's C++ kernels did not build: {native.unavailable()}"
)


@pytest.fixture
def ext():
    ext = native.extension()
    before = ext.decode_prefetch()
    yield ext
    ext.set_decode_prefetch(*before)


def test_every_switch_setting_gives_the_same_bits(ext):
    torch.manual_seed(3)
    w = ggml_q4_1(torch.randn(200, 320))
    assert q4_1_blocks(w) is not None
    lin = Q41Linear(w, None)
    head = Q8Table(*q8_blocks(ggml_q8_0(torch.randn(300, 320))))
    x = torch.randn(16, 320)
    seen = {}
    for one in range(4):
        for more in range(4):
            assert ext.set_decode_prefetch(one, more) == (one, more)
            seen[one, more] = [lin(x[:m]) for m in (1, 3, 8, 16)] + [head(x[:m]) for m in (1, 3, 8, 16)]
    ref = seen[0, 0]
    for outs in seen.values():
        assert all(torch.equal(a, b) for a, b in zip(ref, outs, strict=True))
    with pytest.raises(RuntimeError, match="each mode is 0"):
        ext.set_decode_prefetch(4, 0)


def test_the_probe_keeps_the_mode_with_the_best_run():
    # Zen 4 (session 21), one row of SmolLM2's layers, ms: "next" alone is the fastest
    one_row = {
        "off": [3.4, 3.5, 3.6],
        "near": [4.3, 4.2, 4.4],
        "next": [2.6, 2.7, 3.5],
        "both": [3.5, 3.6, 3.4],
    }
    assert decode_prefetch.fastest(one_row) == "next"
    slowed = {"off": [1.0, 1.0, 1.0], "near": [1.6, 0.9, 1.5], "next": [1.0, 1.0, 1.0], "both": [1.2] * 3}
    assert decode_prefetch.fastest(slowed) == "near"  # slowed runs do not count: the best does
    assert decode_prefetch.fastest({m: [1.0] for m in decode_prefetch.MODES}) == "off"  # a tie: the first


def test_the_engine_runs_the_probe_under_gguf_and_an_env_setting_skips_it(q4_tiny_dir, ext, monkeypatch):  # noqa: F811
    e = engine(q4_tiny_dir, weights="gguf")
    try:
        note = e.prefetch_note
        assert note and note.startswith("decode prefetch: one row ") and "best ms: 1 row off " in note
        one, more = ext.decode_prefetch()
        modes = decode_prefetch.MODES
        assert f"one row {modes[one]}, 8+ rows {modes[more]} " in note
        assert note not in e.plan.notes  # speed only: `kvgate plan` must still equal the engine's plan
    finally:
        e.shutdown()
    for setting, mode in (("off", 0), ("next", 2), ("on", 3)):
        monkeypatch.setenv(decode_prefetch.ENV, setting)
        e = engine(q4_tiny_dir, weights="gguf")
        try:
            assert ext.decode_prefetch() == (mode, mode)
            assert f"KVGATE_DECODE_PREFETCH={setting}" in e.prefetch_note
        finally:
            e.shutdown()
    monkeypatch.delenv(decode_prefetch.ENV)
    e = engine(q4_tiny_dir, weights="full")
    try:
        assert e.prefetch_note is None or "matrices" in e.prefetch_note  # only a Q8 head, if any
    finally:
        e.shutdown()


def test_a_big_models_probe_takes_the_head_and_the_first_layers_up_to_the_cap(monkeypatch):
    torch.manual_seed(4)
    lin = Q41Linear(ggml_q4_1(torch.randn(64, 64)), None)
    head = Q8Table(*q8_blocks(ggml_q8_0(torch.randn(64, 64))))
    model = type("M", (), {"layers": [(lin, lin)] * 10, "lm_head": head})()
    assert len(decode_prefetch._calls(model)) == 21
    monkeypatch.setattr(decode_prefetch, "PROBE_BYTES", head.tiles.numel() + 2 * lin.packed.numel())
    calls = decode_prefetch._calls(model)
    assert [m for m, _ in calls] == [head, lin, lin] and [k for _, k in calls] == [64, 64, 64]
