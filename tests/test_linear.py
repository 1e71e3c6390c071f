"""Prepacked linear layers (`kvgate.models.linear`): the same numbers as `F.linear`, a row's result
independent of how many rows share the matmul (bucket padding included), and exact weight bytes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvgate.models.linear import Linear, packs_weights, row_buckets, warm_kernels

pytestmark = pytest.mark.skipif(not packs_weights("cpu", torch.float32), reason="torch built without oneDNN")


def test_row_buckets_are_powers_of_two_then_the_step_maximum():
    """Broken by: a last bucket above the planned step size (the plan sizes activations for it). One row
    pads to two (a one-row call runs another kernel: tests/test_linear_rows.py), four for plain float32."""
    assert row_buckets(1) == [1]
    assert row_buckets(16) == [2, 4, 8, 16]
    assert row_buckets(288) == [2, 4, 8, 16, 32, 64, 128, 256, 288]
    assert row_buckets(16, 4) == [4, 8, 16] and row_buckets(3, 4) == [3]


@pytest.mark.parametrize("bias", [False, True])
def test_packed_matches_f_linear_and_rows_do_not_depend_on_their_neighbours(bias):
    """Every row count from 1 to 40, with the buckets a 40-row step uses: the packed result is within
    float32 rounding of F.linear, and each row is bit-identical to the same row in the full batch.
    Broken by (seen red): packing for a one-row hint (oneDNN then blocks differently per row count,
    rows differ by ~1e-5); returning the padded rows (shape mismatch)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(192, 128, generator=g)
    b = torch.randn(192, generator=g) if bias else None
    x = torch.randn(40, 128, generator=g)
    lin = Linear(w.clone(), b, pack=True)
    assert lin.packed
    lin.buckets = row_buckets(40)
    full = lin(x)
    torch.testing.assert_close(full, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    for rows in range(1, 41):
        got = lin(x[:rows])
        assert got.shape == (rows, 192)
        assert torch.equal(got, full[:rows]), rows
        assert torch.equal(lin(x[rows - 1 : rows]), full[rows - 1 : rows]), rows


def test_unpacked_linear_is_plain_f_linear_and_bytes_count_weight_and_bias():
    w, b = torch.randn(8, 4), torch.randn(8)
    lin = Linear(w, b, pack=False)
    x = torch.randn(3, 4)
    assert not lin.packed and torch.equal(lin(x), F.linear(x, w, b))
    assert lin.nbytes == (8 * 4 + 8) * 4
    assert Linear(w.clone(), b, pack=True).nbytes == lin.nbytes  # packing never adds bytes


def test_warm_kernels_runs_every_bucket_once(monkeypatch):
    """Every (out, in) shape runs once at each of its row buckets, in order, on the packed path: the
    kernels serving will use all exist before the overhead is measured. Seen red with the warm-up
    running only the largest bucket, and with it skipping the first."""
    import kvgate.models.linear as L

    ran = []
    real = L._run_packed

    def spy(x, packed, bias):
        ran.append((x.shape[0], x.shape[1]))
        return real(x, packed, bias)

    monkeypatch.setattr(L, "_run_packed", spy)
    warm_kernels([(16, 8, 5), (32, 12, 2), (24, 8, 1)], torch.float32)
    assert ran == [(2, 8), (4, 8), (5, 8), (2, 12), (1, 8)]
    assert [r for r, _ in ran[:3]] == L.row_buckets(5)
