"""The weights a decode step streams, moved onto transparent huge pages (kvgate/models/huge_pages.py):
the same bytes, each tensor a storage of exactly its own bytes (the memory probe counts storages), the
mapping 2 MiB aligned; a gguf model moves its Q4_1 tiles and Q8 table there; KVGATE_HUGE_PAGES=0 or a
kernel without THP leaves everything where it was."""

from __future__ import annotations

import pytest
import torch

from kvgate.models import huge_pages


class Owner:
    def __init__(self, t):
        self.t = t


@pytest.mark.skipif(bool(huge_pages.why_not()), reason=huge_pages.why_not() or "available")
def test_moved_tensors_keep_their_bytes_in_storages_of_their_own():
    """Seen red with the copy left out (the views held zeros). The storage-size check is there because a
    first version gave every view the whole mapping as its storage, and tests/test_memory's weights
    count (storage bytes per tensor) came out 2 MiB over the plan."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(3, 5, 320), (1000,), (7, 64), (2, 48, 320)]
    owners = [Owner(torch.randint(0, 256, s, generator=gen, dtype=torch.uint8)) for s in shapes]
    owners.append(Owner(torch.randn(33, 17, generator=gen)))
    before = [o.t.clone() for o in owners]
    moved = huge_pages.move([(o, "t") for o in owners])
    assert moved >= sum(b.numel() * b.element_size() for b in before)
    for o, b in zip(owners, before, strict=True):
        assert torch.equal(o.t, b) and o.t.dtype == b.dtype and o.t.is_contiguous()
        assert o.t.untyped_storage().nbytes() == b.numel() * b.element_size()
        assert o.t.data_ptr() % huge_pages.ALIGN == 0
    assert owners[0].t.data_ptr() % huge_pages.HUGE_PAGE == 0
    owners[1].t[0] = 7  # writable, and the others untouched
    assert torch.equal(owners[0].t, before[0])


def test_the_switch_leaves_tensors_where_they_were(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV, "0")
    o = Owner(torch.arange(10, dtype=torch.uint8))
    t = o.t
    assert huge_pages.why_not() == f"{huge_pages.ENV}=0"
    assert huge_pages.move([(o, "t")]) == 0 and o.t is t


@pytest.mark.skipif(bool(huge_pages.why_not()), reason=huge_pages.why_not() or "available")
def test_a_gguf_model_streams_its_tiles_from_huge_pages(tmp_path):
    """Every Q4_1 layer tile tensor (and a Q8 table, where the model has one) of a `--weights gguf` model
    lives in the mapping."""
    from safetensors.torch import load_file, save_file

    from kvgate.models import native
    from kvgate.models.q4_1 import Q41Linear
    from tests.test_decode_stack import model_and_pool
    from tests.test_q4_1 import ggml_q4_1
    from tests.tiny_model import make_tiny_hf_dir

    if native.extension() is None:
        pytest.skip(f"kvgate's C++ kernels did not build: {native.unavailable()}")
    path = make_tiny_hf_dir(tmp_path, tie=True, geometry=dict(hidden=576, heads=9, kv_heads=3, inter=256))
    w = load_file(str(path / "model.safetensors"))
    for name in [n for n in w if n.endswith("proj.weight")]:
        w[name] = ggml_q4_1(w[name]).contiguous()
    save_file(w, str(path / "model.safetensors"))
    model, _ = model_and_pool(path, "gguf")
    tiles = [lin.packed for layer in model.layers for lin in layer if isinstance(lin, Q41Linear)]
    assert tiles
    table = [] if model.q8 is None else [model.q8.tiles]
    expected = sum(-(-t.numel() // huge_pages.ALIGN) * huge_pages.ALIGN for t in tiles + table)
    assert model.huge_page_bytes == expected
    assert tiles[0].data_ptr() % huge_pages.HUGE_PAGE == 0
