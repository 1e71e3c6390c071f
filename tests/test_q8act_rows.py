"""gguf-q8act's calls of 1-4 rows take the AVX2 tiles or the VNNI pairs by a load-time probe
(kvgate.models.q8act_rows); the switch changes speed only.

The bits of the two kernels at 1-4 rows are tests/test_int8_vnni.py's (its VNNI runs take the pairs at
every row count) and tests/test_decode_stack.py's (the thread team under either mask). Seen red:
`faster` keeping the slower kernel (the decision test), the engine's call to `choose` removed (the engine
test), the env setting's mask inverted (the env test), `use_pairs` ignoring the mask (the switch test).
"""

from __future__ import annotations

import pytest

from kvgate.models import native, q8act_rows
from tests.test_q4_1 import engine, q4_tiny_dir  # noqa: F401 - the fixture

ext = native.extension()
vnni = pytest.mark.skipif(
    ext is None or ext.set_int8_isa("auto") != "avx512-vnni",
    reason="this build has no AVX-512 VNNI kernels (the CPU does not list avx512_vnni): no choice to make",
)


@pytest.fixture()
def restore():
    before = ext.int8_small_rows()
    yield
    ext.set_int8_small_rows(before)


def test_the_probe_keeps_the_faster_kernel_per_row_count():
    # an AMX Xeon (session 43), ms: the pairs ahead at every row count but 2, where a slow run does not count
    times = {
        1: {"tiles": [12.1, 12.5, 12.9], "pairs": [10.7, 11.0, 30.0]},
        2: {"tiles": [15.0, 15.2, 15.1], "pairs": [15.3, 15.9, 15.4]},
        3: {"tiles": [20.0], "pairs": [20.0]},  # a tie keeps the tiles
        4: {"tiles": [23.4, 24.5, 24.0], "pairs": [18.0, 18.1, 18.5]},
    }
    assert q8act_rows.faster(times) == [1, 4]
    assert q8act_rows.mask([1, 4]) == 0b10010


@vnni
def test_the_switch_takes_bits_1_to_4_only_and_calls_follow_it(restore):
    assert ext.set_int8_small_rows(0b11110) == 0b11110
    assert all(ext.int8_uses_pairs(r) for r in range(1, 20))
    assert ext.set_int8_small_rows(0b00100) == 0b00100
    assert [ext.int8_uses_pairs(r) for r in range(1, 7)] == [False, True, False, False, True, True]
    assert ext.set_int8_small_rows(0) == 0
    assert not any(ext.int8_uses_pairs(r) for r in range(1, 5)) and ext.int8_uses_pairs(5)
    for bad in (1, 0b100000, -1):
        with pytest.raises(RuntimeError, match="bit R says whether calls of R rows take the VNNI pairs"):
            ext.set_int8_small_rows(bad)


@vnni
def test_the_engine_runs_the_probe_under_gguf_q8act_and_an_env_setting_skips_it(
    q4_tiny_dir,  # noqa: F811
    monkeypatch,
    restore,
):
    monkeypatch.delenv(q8act_rows.ENV, raising=False)
    e = engine(q4_tiny_dir, weights="gguf-q8act")
    try:
        note = e.prefetch_note
        assert note and "gguf-q8act calls of 1-4 rows (probe over the model's " in note
        chosen = ext.int8_small_rows()
        for r in q8act_rows.ROWS:
            assert f"{r} {'pairs' if chosen >> r & 1 else 'tiles'} (" in note, (r, chosen, note)
        assert note not in e.plan.notes  # speed only: `kvgate plan` must still equal the engine's plan
    finally:
        e.shutdown()
    for setting, mask in (("pairs", 0b11110), ("tiles", 0)):
        monkeypatch.setenv(q8act_rows.ENV, setting)
        e = engine(q4_tiny_dir, weights="gguf-q8act")
        try:
            assert ext.int8_small_rows() == mask
            assert f"{q8act_rows.ENV}={setting}" in e.prefetch_note
        finally:
            e.shutdown()
    e = engine(q4_tiny_dir, weights="gguf")
    try:  # no q8act matrices: nothing to choose
        assert "gguf-q8act" not in (e.prefetch_note or "")
    finally:
        e.shutdown()
