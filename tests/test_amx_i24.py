"""--weights gguf's decode rows on AMX's int8 tiles (kvgate/models/csrc/amx_i24.cpp) give the VNNI loop's
bits (csrc/q4_1_int24.cpp) for every row count, so the probe that picks the kernel by row count
(kvgate.models.amx_rows) changes speed only.

The AMX tests run where the build has the tiles and Linux grants them (a CPU listing amx_tile, amx_int8,
amx_bf16, avx512_bf16 and AVX-512 VBMI); the probe's decision rule and the refusal elsewhere run everywhere. The thread team's
bits under the switch are tests/test_decode_stack.py's. Seen red, each with the code broken on purpose:
the high digit pair weighted 4095 instead of 4096 (every row's bits moved), the B operand's second half
not multiplied by 16 (errors ~1e-2), the pair of tiles writing the second tile's outputs into the first's
(n = 203), `fewest` keeping the tiles where the loop won at a larger row count, the engine's call to
`choose` removed, `choose` ignoring KVGATE_Q4_1_DECODE=float, the prefetch probe timing with the tiles
on.
"""

from __future__ import annotations

import pytest
import torch

from kvgate.models import amx_rows, native
from tests.test_q4_1 import engine, q4_tiny_dir  # noqa: F401 - the fixture
from tests.test_q4_1_int24 import hard_rows, matrix

ext = native.extension()
amx = pytest.mark.skipif(
    ext is None or not ext.q4_1_amx_built() or ext.amx_unavailable() != "",
    reason="no AMX int8 tiles here (kvgate.models.native's KVGATE_AMX_INT8, and Linux's grant of the tiles)",
)


@pytest.fixture()
def switch():
    before = ext.q4_1_amx_rows()
    yield
    ext.set_q4_1_amx_rows(before)


def both(fn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fn(x) on the VNNI loop (switch off) and on the tiles (every row count)."""
    ext.set_q4_1_amx_rows(0)
    loop = fn(x)
    ext.set_q4_1_amx_rows(1)
    return loop, fn(x)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@amx
@pytest.mark.parametrize("n,k", [(203, 96), (576, 576), (64, 1536), (48, 576), (40, 32), (33, 64)])
def test_the_tiles_give_the_loops_bits_at_every_row_count(switch, n, k):
    """1-40 rows (one group of 16, several, a partial last group), odd and even tile counts (203
    outputs: 13 tiles, the last one partial), one and two blocks (fewer than the codes' three ahead),
    with hard rows (an outlier 300x the rest, a largest value
    just under a power of two, magnitudes over six decades)."""
    _, packed = matrix(n, k, seed=n + k)
    x = hard_rows(40, k)
    for rows in (1, 2, 5, 15, 16, 17, 31, 33, 40):
        loop, tiles = both(lambda v: ext.q4_1_matmul(v, packed, n, -1), x[:rows])
        assert same_bits(loop, tiles), (n, k, rows, (loop - tiles).abs().max().item())


@amx
def test_nan_inf_zero_and_tiny_blocks_keep_the_loops_bits(switch):
    """A NaN or inf makes its row NaN on both kernels; zero and tiny (< 2^-104) blocks count as zeros."""
    _, packed = matrix(64, 96, seed=4)
    x = torch.randn(18, 96)
    x[1, 3] = float("nan")
    x[2, 70] = float("inf")
    x[3] = 0.0
    x[4, :32] = 1e-33
    loop, tiles = both(lambda v: ext.q4_1_matmul(v, packed, 64, -1), x)
    assert tiles[1].isnan().all() and tiles[2].isnan().all()
    assert torch.equal(loop.isnan(), tiles.isnan())
    assert torch.equal(loop.nan_to_num(), tiles.nan_to_num())


@amx
def test_a_step_of_decode_and_prompt_rows_keeps_its_decode_rows_bits(switch):
    """q4_1_matmul with 17 decode rows and 23 prompt rows: the decode rows as on the loop, the prompt
    rows untouched by the switch."""
    _, packed = matrix(576, 576, seed=9)
    x = hard_rows(40, 576)
    loop, tiles = both(lambda v: ext.q4_1_matmul(v, packed, 576, 17), x)
    assert same_bits(loop, tiles)


@amx
@pytest.mark.parametrize("n,k", [(37, 256), (576, 1536)])
def test_q4f_tiles_take_the_same_route(switch, n, k):
    """A GGUF's Q4_K and Q4_0 layers (Q4F tiles: float32 d and m) through block_matmul."""
    from kvgate.models.block_formats import block_pack16, file_codes
    from tests.test_block_formats import blocks

    w, d, m = blocks("q4f", n, k, seed=k)
    packed = block_pack16("q4f", *file_codes(w, d, m)[1:])
    x = hard_rows(21, k)
    for rows in (3, 16, 21):
        loop, tiles = both(lambda v: ext.block_matmul(v, packed, n, -1), x[:rows])
        assert same_bits(loop, tiles), rows


@amx
def test_the_switch_counts_rows_and_refuses_a_negative_count(switch):
    assert ext.set_q4_1_amx_rows(8) == 8 and ext.q4_1_amx_rows() == 8
    assert ext.set_q4_1_amx_rows(0) == 0
    with pytest.raises(RuntimeError, match="a row count >= 1, or 0 for never"):
        ext.set_q4_1_amx_rows(-1)


@pytest.mark.skipif(ext is None, reason="kvgate's C++ kernels did not build")
def test_without_the_tiles_the_switch_refuses_and_the_probe_says_nothing():
    if ext.q4_1_amx_built() and ext.amx_unavailable() == "":
        pytest.skip("this machine has the tiles")
    with pytest.raises(RuntimeError, match="no AMX int8 tiles"):
        ext.set_q4_1_amx_rows(8)
    assert ext.set_q4_1_amx_rows(0) == 0


def test_the_probe_picks_the_fewest_rows_from_which_the_tiles_win_throughout():
    # ms, best of each: the loop ahead up to 6 rows; at 8 the tiles, and from there on
    times = {
        4: {"loop": [2.7, 2.8], "tiles": [2.9, 3.0]},
        6: {"loop": [4.1], "tiles": [4.1]},  # a tie keeps the loop
        8: {"loop": [5.4, 5.5], "tiles": [3.5, 9.0]},  # a slow run does not count
        16: {"loop": [10.6], "tiles": [5.7]},
    }
    assert amx_rows.fewest(times) == 8
    times[16]["tiles"] = [11.0]  # the loop wins at the largest count: never
    assert amx_rows.fewest(times) == 0
    times[16]["tiles"] = [5.0]
    times[4]["tiles"] = [2.0]  # a win below a tie does not count
    assert amx_rows.fewest(times) == 8


@amx
def test_the_engine_runs_the_probe_under_gguf_and_an_env_setting_skips_it(
    q4_tiny_dir,  # noqa: F811
    monkeypatch,
    switch,
):
    monkeypatch.delenv(amx_rows.ENV, raising=False)
    e = engine(q4_tiny_dir, weights="gguf")
    try:
        note = e.prefetch_note
        assert (
            note and "gguf decode calls on AMX int8 tiles from " in note and "(probe over the model's" in note
        )
        chosen = ext.q4_1_amx_rows()
        assert f"from {chosen or 'no'} rows" in note
        assert note not in e.plan.notes  # speed only: `kvgate plan` must still equal the engine's plan
    finally:
        e.shutdown()
    for setting, rows in (("off", 0), ("12", 12)):
        monkeypatch.setenv(amx_rows.ENV, setting)
        e = engine(q4_tiny_dir, weights="gguf")
        try:
            assert ext.q4_1_amx_rows() == rows
            assert f"{amx_rows.ENV}={setting}" in e.prefetch_note
        finally:
            e.shutdown()


@amx
def test_a_setting_that_cannot_apply_is_logged_and_the_float_loop_keeps_the_tiles_off(
    q4_tiny_dir,  # noqa: F811
    monkeypatch,
    caplog,
    switch,
):
    """Under KVGATE_Q4_1_DECODE=float the decode rows are not integer products: no tiles, whatever the
    setting says (and the log says why); a row count too large is logged and the probe runs instead."""
    monkeypatch.delenv(amx_rows.ENV, raising=False)
    e = engine(q4_tiny_dir, weights="gguf")
    try:
        ext.set_q4_1_amx_rows(0)
        ext.set_q4_1_decode("float")
        monkeypatch.setenv(amx_rows.ENV, "12")
        with caplog.at_level("WARNING", logger="kvgate.models"):
            assert amx_rows.choose(e.model) is None
        assert "KVGATE_Q4_1_DECODE=float keeps the decode rows off the tiles" in caplog.text
        assert ext.q4_1_amx_rows() == 0
        ext.set_q4_1_decode("int24")
        monkeypatch.setenv(amx_rows.ENV, "99999999999999999999")
        with caplog.at_level("WARNING", logger="kvgate.models"):
            note = amx_rows.choose(e.model)
        assert f"{amx_rows.ENV}=99999999999999999999 ignored" in caplog.text
        assert note and "(probe over the model's" in note
    finally:
        ext.set_q4_1_decode("int24")
        e.shutdown()


@amx
def test_the_prefetch_probe_times_the_loop_and_puts_the_switch_back(q4_tiny_dir, monkeypatch, switch):  # noqa: F811
    """decode_prefetch's probe times the VNNI loop's prefetch modes at 8 rows; calls on the tiles ignore
    the prefetch, so it turns the tiles off while it times and restores the switch after. Seen red with
    the switch left on during the probe."""
    from kvgate.models import decode_prefetch

    e = engine(q4_tiny_dir, weights="gguf")
    try:
        seen = []
        timer = decode_prefetch.pass_timer

        def watched(calls, rows):
            run = timer(calls, rows)
            return lambda r: (seen.append(ext.q4_1_amx_rows()), run(r))[1]

        monkeypatch.setattr(decode_prefetch, "pass_timer", watched)
        ext.set_q4_1_amx_rows(7)
        assert decode_prefetch.choose(e.model)
        assert seen and set(seen) == {0}
        assert ext.q4_1_amx_rows() == 7
    finally:
        e.shutdown()
