"""The LM head held as the file's own blocks (kvgate/models/head_blocks.py): a Q4_K_M-like file's Q6_K head
(tied or untied) is held as q8d tiles under `--weights auto` (-> gguf), the plan charges exactly what the
model holds (the tiles instead of a float head and its packed copy), and greedy tokens and logits are the
float head's.
"""

from __future__ import annotations

import pytest
import torch

from kvgate.models import native
from tests.test_block_formats import KQ_GEOMETRY
from tests.test_q4_1 import PROMPTS, engine, greedy

pytestmark = pytest.mark.skipif(native.extension() is None, reason="kvgate's C++ kernels did not build here")

TIED = {"token_embd.weight": "Q6_K"}  # llama.cpp's Q4_K_M recipe for a tied table (Llama 3.2 1B, Qwen3-0.6B)
UNTIED = {"token_embd.weight": "Q4_K", "output.weight": "Q6_K"}


def write_gguf(path, types: dict[str, str], tie: bool = True):
    from tests.tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(path, tie=tie, weight_type="Q4_K", overrides=types, geometry=KQ_GEOMETRY)


def head_logits(e, ids: list[int]) -> torch.Tensor:
    from tests.tiny_gguf import prompt_logits

    return prompt_logits(e.model, ids)


@pytest.mark.parametrize(
    "types,tie,dtype",
    [(TIED, True, "float32"), (UNTIED, False, "float32"), (TIED, True, "bfloat16")],
    ids=["tied", "untied", "tied-bf16"],
)
def test_a_q6_k_head_is_held_as_its_blocks_with_the_float_heads_tokens(
    tmp_path, monkeypatch, types, tie, dtype
):
    """Held as q8d, said in the plan, charged exactly (plan == model), fewer bytes than the float head;
    greedy tokens (4 prompts, batched and alone) equal the float head's (KVGATE_HEAD_BLOCKS=0), logits
    within float32 rounding. Seen red: the plan charging the float head (plan and model disagreed), and
    the slices' tiles joined in the wrong order (tokens differ); under bfloat16 (review) the build failed,
    the tiles recovered from the bf16-rounded table instead of the checkpoint's float32 values."""
    from kvgate.models import head_blocks
    from kvgate.models.block_formats import BlockLinear
    from kvgate.models.head_blocks import BlockTable

    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(head_blocks, "CHUNK", 64)  # the 264-row table recovered in 5 slices, as a real one is
    path = write_gguf(tmp_path / "head.gguf", types, tie=tie)
    out, logits, weights = {}, {}, {}
    for mode in ("float", "blocks"):
        monkeypatch.setenv("KVGATE_HEAD_BLOCKS", "0" if mode == "float" else "1")
        e = engine(path, dtype=dtype)
        try:
            assert e.weights_format == "gguf"
            head = e.model.lm_head
            inner = head.head if isinstance(head, BlockTable) else head
            held = isinstance(inner, BlockLinear)
            assert held == (mode == "blocks")
            if held:
                assert inner.fmt == "q8d"
                # tied: no float table stays, the lookup reads the tiles
                assert isinstance(head, BlockTable) == tie and (e.model.embed is head) == tie
                assert any(n.startswith("LM head as the file's blocks: q8d tiles") for n in e.plan.notes), (
                    e.plan.notes
                )
            # the float head: the tiny 264-row table does not pack smaller, so no packed copy is made though
            # the plan charges one (an over-charge, never an under-charge; real vocabularies pack)
            assert (
                (e.plan.weights_bytes == e.model.weight_bytes)
                if held
                else e.plan.weights_bytes >= e.model.weight_bytes
            )
            weights[mode] = e.plan.weights_bytes
            out[mode] = greedy(e, 12)
            logits[mode] = head_logits(e, PROMPTS[2])
        finally:
            e.shutdown()
    assert out["blocks"] == out["float"]
    assert out["blocks"][0] == out["blocks"][1]  # batched == alone
    # bfloat16: the float head holds the table rounded to bf16 (logits in bf16 steps, 1/64 near 4), the
    # blocks the file's values: they differ by a few steps (seen 0.125), the tokens not at all
    assert (logits["blocks"] - logits["float"]).abs().max().item() < (1e-4 if dtype == "float32" else 0.5)
    assert weights["blocks"] < weights["float"]


@pytest.mark.parametrize("fmt", ["q4f", "q5f", "q8d", "q8s", "q8_0"])
def test_a_tied_tables_rows_read_out_of_the_tiles_are_the_files_values_bit_for_bit(fmt):
    """`tile_rows` (the tied table's lookup) gives every asked row's float values exactly, rows of a
    partial last tile and repeats included. Seen red: q5f's fifth bit read from another row
    group than j // 8, and q8s's m added after a rounded product instead of `addcmul`."""
    from kvgate.models.head_blocks import head_format, head_tiles, tile_rows
    from tests.test_block_formats import blocks

    w, d, m = blocks(fmt, 37, 256)
    assert head_format(w, (d, m)) == fmt
    tiles = head_tiles(w, (d, m), fmt)
    ids = torch.tensor([0, 5, 15, 16, 17, 36, 20, 20, 8])
    assert torch.equal(tile_rows(fmt, tiles, ids, 37), w[ids])
    for outside in (37, 47, 48):  # the padding rows of the last tile are no rows (review)
        with pytest.raises(IndexError):
            tile_rows(fmt, tiles, torch.tensor([outside]), 37)


@pytest.mark.parametrize(
    "first,second,common", [("q8d", "q8_0", "q8d"), ("q4f", "q5f", "q5f"), ("q5f", "q8d", "q8s")]
)
def test_slices_of_different_formats_share_the_narrowest_common_one(monkeypatch, first, second, common):
    """A head whose slices need different formats is held in one that holds them all, every row exact.
    Seen red (review): placement looked at the first slice only and the build then failed on the second."""
    from kvgate.models import head_blocks
    from kvgate.models.head_blocks import head_format, head_tiles, tile_rows
    from tests.test_block_formats import blocks

    monkeypatch.setattr(head_blocks, "CHUNK", 32)
    parts = [blocks(first, 32, 256, seed=1), blocks(second, 20, 256, seed=2)]
    w, d, m = (torch.cat([p[i] for p in parts]) for i in range(3))
    assert head_format(w, (d, m)) == common
    tiles = head_tiles(w, (d, m), common)
    ids = torch.arange(52)
    assert torch.equal(tile_rows(common, tiles, ids, 52), w)


def test_an_exact_q8_0_tied_table_is_left_to_the_q8_head_setting(tmp_path, monkeypatch):
    """SmolLM2's case: a Q8_0 tied table is the Q8 head's under auto, and with --q8-head off it stays the
    float head, not Q8_0 tiles by the back door. Seen red (review): off gave both notes and q8_0 tiles."""
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "q8.gguf", {"token_embd.weight": "Q8_0"})
    for setting, q8 in (("auto", True), ("off", False)):
        e = engine(path, q8_head=setting)
        try:
            assert not any(n.startswith("LM head as the file's blocks") for n in e.plan.notes), e.plan.notes
            assert (type(e.model.lm_head).__name__ == "Q8Table") == q8, type(e.model.lm_head)
        finally:
            e.shutdown()


def test_a_float_head_stays_float_and_says_nothing(tmp_path, monkeypatch):
    """A file whose head is F32 (no block scales): the float head, no note (and the tiny table's
    over-charged packed copy, as above)."""
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "f32head.gguf", {"token_embd.weight": "F32"})
    e = engine(path)
    try:
        assert e.weights_format == "gguf"
        assert not any(n.startswith("LM head as the file's blocks") for n in e.plan.notes)
        assert not hasattr(e.model.lm_head, "fmt")
        assert e.plan.weights_bytes >= e.model.weight_bytes
    finally:
        e.shutdown()
