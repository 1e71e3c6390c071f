"""The float decode loops' prefetch switches change speed only, and the load-time probe picks by its numbers
(kvgate.models.decode_prefetch).

Seen red: with keep_prefetch's comparison inverted, the decision test fails; with the probe's cap left
out, the cap test; with the engine's call to `choose` removed, the engine test. The bit test guards
that nothing but the prefetch hangs on the switches (the kernel computes the same blocks in the same
order either way; it was not seen red, since breaking it means breaking the C++ loop itself).
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
    for one in (True, False):
        for more in (True, False):
            assert ext.set_decode_prefetch(one, more) == (one, more)
            seen[one, more] = [lin(x[:m]) for m in (1, 3, 8, 16)] + [head(x[:m]) for m in (1, 3, 8, 16)]
    ref = seen[True, True]
    for outs in seen.values():
        assert all(torch.equal(a, b) for a, b in zip(ref, outs, strict=True))


def test_the_prefetch_goes_off_only_when_clearly_slower():
    assert decode_prefetch.keep_prefetch([1.0, 1.0, 1.0], [0.99, 0.98, 0.985])  # within 3%: kept
    assert not decode_prefetch.keep_prefetch([4.3, 4.4, 4.2], [3.7, 3.8, 3.9])  # Zen 4, one row
    assert decode_prefetch.keep_prefetch([18.5, 18.4, 18.6], [19.8, 19.7, 19.9])  # Zen 4, 8+ rows
    assert decode_prefetch.keep_prefetch([1.0, 1.6, 1.5], [0.99, 0.99, 0.99])  # slowed runs: the best counts


def test_the_engine_runs_the_probe_under_gguf_and_an_env_setting_skips_it(q4_tiny_dir, ext, monkeypatch):  # noqa: F811
    e = engine(q4_tiny_dir, weights="gguf")
    try:
        note = e.prefetch_note
        assert note and note.startswith("decode prefetch: one row ") and "best ms with / without" in note
        one, more = ext.decode_prefetch()
        assert f"one row {'on' if one else 'off'}, 8+ rows {'on' if more else 'off'}" in note
        assert note not in e.plan.notes  # speed only: `kvgate plan` must still equal the engine's plan
    finally:
        e.shutdown()
    monkeypatch.setenv(decode_prefetch.ENV, "off")
    e = engine(q4_tiny_dir, weights="gguf")
    try:
        assert ext.decode_prefetch() == (False, False)
        assert "KVGATE_DECODE_PREFETCH=off" in e.prefetch_note
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
