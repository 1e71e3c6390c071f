"""A full-weights matmul gives a row the same bits whatever the rows beside it (`kvgate.models.linear`).

QA pass 8 found `--weights full` batch-dependent on CPU: oneDNN (packed float32) and the bfloat16
matmul run a one-row call on a kernel of their own whose sums over k go in another order once k passes
~1024 (SmolLM2's down_proj, k = 1536), and MKL's plain float32 sgemm gives a row other bits at 1-3, 5-7
and 9-11 rows. A decoding row's logprobs then moved (by up to 2e-3 at temperature 0) when a second
request joined its step. `Linear` now pads its rows to buckets that all agree (from 2 rows, or 4 for a
plain float32 weight). Seen red: the kernel test with the smallest bucket 1 (a 1-row call 5e-6 apart
at k = 1536), and the engine test with the old `Linear` (logprobs apart from the second token on).
"""

from __future__ import annotations

import pytest
import torch

from kvgate.models.linear import PROBE_ROWS_MAX, Linear, packs_weights, row_buckets, rows_invariant

SHAPES = [(960, 576), (576, 1536), (1024, 2048), (2048, 4096)]  # SmolLM2's qkv and down; larger k


@pytest.mark.parametrize(
    "dtype,pack", [(torch.float32, True), (torch.float32, False), (torch.bfloat16, False)]
)
def test_every_row_count_gives_a_row_the_same_bits(dtype, pack):
    if pack and not packs_weights("cpu", dtype):
        pytest.skip("this torch has no oneDNN packing")
    probe = tuple(b for b in row_buckets(48, 4 if dtype == torch.float32 else 2) if b <= PROBE_ROWS_MAX)
    if not pack and not all(rows_invariant(dtype, n, k, probe) for n, k in SHAPES):
        # session 40's Emerald Rapids: MKL's sgemm gave a row other bits below 57 rows of 64 (576x1536);
        # no bucket ladder absorbs that, so the engine says so at startup (the test below)
        pytest.skip("this CPU's plain matmul is row-count dependent past what the buckets absorb")
    g = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        lin = Linear((torch.randn(n, k, generator=g) * 0.05).to(dtype), None, pack)
        lin.bucket_rows(48)
        x = torch.randn(48, k, generator=g).to(dtype)
        whole = lin(x)
        for m in range(1, 48):
            assert torch.equal(lin(x[:m]), whole[:m]), (n, k, m, dtype, pack)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_full_weights_decode_the_same_alone_and_batched(tmp_path, dtype):
    """A tiny model with SmolLM2's 1536-wide MLP: greedy logprobs of a prompt alone equal those in a
    batch of four, in float32 (packed) and bfloat16, both `--weights full` defaults."""
    import threading

    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine
    from kvgate.models.linear import native_bf16
    from kvgate.request import GenerationRequest, Token
    from kvgate.sampling import SamplingParams
    from tests.tiny_model import GEOMETRY, make_tiny_hf_dir

    if dtype == "bfloat16" and not native_bf16():  # emulated: the engine warns (the test below)
        pytest.skip("bfloat16 is emulated on this CPU (no avx512_bf16 or amx_bf16 listed)")
    d = make_tiny_hf_dir(tmp_path / "wide", geometry={**GEOMETRY, "inter": 1536})
    cfg = EngineConfig(kv_cache_bytes=8 << 20, memory_limit="2GiB", dtype=dtype, device="cpu", weights="full")
    e = Engine.from_model(str(d), cfg, overhead_bytes=0).start()
    prompts = [[5, 6, 7, 8, 9], [40, 41] * 6, list(range(60, 90)), [3, 4]]

    def run(p, out):
        r = GenerationRequest(p, SamplingParams(temperature=0, logprobs=2), 12, ignore_eos=True)
        out.extend((ev.token_id, repr(ev.logprobs)) for ev in e.submit(r) if isinstance(ev, Token))

    try:
        alone = [[] for _ in prompts]
        for p, out in zip(prompts, alone):
            run(p, out)
        together = [[] for _ in prompts]
        threads = [threading.Thread(target=run, args=(p, o)) for p, o in zip(prompts, together)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        e.shutdown()
    assert together == alone


def test_a_batch_dependent_path_is_named_at_startup(monkeypatch, caplog):
    """Session 40's Emerald Rapids (no avx512_bf16 listed): MKL's plain float32 gave a row other bits at
    row counts no bucket ladder absorbs, and an emulated bfloat16 model decoded a prompt apart alone and
    in a batch. Where the probe (or the flags) says so, `bucket_rows` warns once; prepacked float32 says
    nothing. Red with the check taken out of `bucket_rows`."""
    import logging

    from kvgate.models import linear as L

    caplog.set_level(logging.WARNING, logger="kvgate.models")
    monkeypatch.setattr(L, "_WARNED", set())
    monkeypatch.setattr(L, "rows_invariant", lambda *a: True)
    monkeypatch.setattr(L, "native_bf16", lambda: True)
    w = torch.randn(96, 64) * 0.05
    Linear(w, None, False).bucket_rows(48)
    Linear(w.bfloat16(), None, False).bucket_rows(48)
    assert "batching can change" not in caplog.text
    monkeypatch.setattr(L, "native_bf16", lambda: False)
    Linear(w.bfloat16(), None, False).bucket_rows(48)
    assert caplog.text.count("batching can change") == 1 and "96x64 bfloat16" in caplog.text
    monkeypatch.setattr(L, "rows_invariant", lambda *a: False)
    Linear(w, None, False).bucket_rows(48)
    Linear(w, None, False).bucket_rows(48)  # once per dtype
    assert caplog.text.count("batching can change") == 2 and "96x64 float32" in caplog.text


def test_the_bfloat16_probe_says_whether_any_row_moves_with_the_batch():
    """`bf16_batch_invariant` (what `--dtype auto` asks for full weights) says yes exactly where, on every
    probed shape, every row of a call at each bucket has the bits of the same row at the largest
    bucket. Session 41's probe compared row 0 alone and said yes on an AMX Xeon whose bfloat16 matmul
    moved row 1 at 2 rows against 48. Seen red there with row 0 alone compared in `rows_invariant`."""
    from kvgate.models.linear import BF16_PROBE_SHAPES, bf16_batch_invariant, native_bf16

    if not native_bf16():
        pytest.skip("bfloat16 is emulated here: --dtype auto never picks it")
    buckets = tuple(b for b in row_buckets(PROBE_ROWS_MAX, 2) if b <= PROBE_ROWS_MAX)
    steady = []
    for n, k in BF16_PROBE_SHAPES:  # the probe's own data (seed 0, w then x), every row compared
        g = torch.Generator().manual_seed(0)
        w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
        x = torch.randn(max(buckets), k, generator=g).to(torch.bfloat16)
        whole = torch.nn.functional.linear(x, w)
        steady.append(all(torch.equal(torch.nn.functional.linear(x[:b], w), whole[:b]) for b in buckets))
        assert rows_invariant(torch.bfloat16, n, k, buckets) == steady[-1], (n, k)
    assert bf16_batch_invariant() == all(steady)
