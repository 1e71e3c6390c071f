"""--weights gguf's decode rows as exact integer products on 24-bit activation blocks
(kvgate/models/csrc/q4_1_int24.cpp): the numbers the float loop they replaced gave, to float32
rounding; a row's bits never depend on the rows beside it; NaN, inf, zero and tiny blocks.

The scalar and AVX2 builds are held to this build's bits by tests/test_scalar_fallback.py (its
q4_1_matmul outputs run these decode rows)."""

from __future__ import annotations

import pytest
import torch

from kvgate.models import native
from kvgate.models.q4_1 import q4_1_blocks, q4_1_pack16
from tests.test_q4_1 import ggml_q4_1

pytestmark = pytest.mark.skipif(
    native.extension() is None, reason=f"kvgate's C++ kernels did not build: {native.unavailable()}"
)


@pytest.fixture
def ext():
    ext = native.extension()
    assert ext.q4_1_decode().startswith("int24"), ext.q4_1_decode()  # the default
    yield ext
    ext.set_q4_1_decode("int24")


def matrix(n: int, k: int, seed: int):
    torch.manual_seed(seed)
    w = ggml_q4_1(torch.randn(n, k) * 0.05)
    return w, q4_1_pack16(*q4_1_blocks(w))


def hard_rows(rows: int, k: int) -> torch.Tensor:
    """Random rows with what a block's fixed point finds hardest: an outlier 300x the rest, a block
    whose largest value has a mantissa just under 2 (the scale steps down a power of two there), and
    wide magnitudes."""
    x = torch.randn(rows, k)
    x[0, 5] = 300.0
    x[1 % rows, 40 % k] = 1.9999999
    x[-1] *= torch.logspace(-3, 3, k)
    return x


@pytest.mark.parametrize("n,k", [(203, 96), (576, 576), (64, 1536)])
def test_decode_rows_are_the_exact_weights_product_to_float32_rounding(ext, n, k):
    """Against float64 products of the very weights, int24 decode rows are within 2e-6 of the largest
    output, as the float loop is (both measured ~3-10e-7 on SmolLM2's shapes), for 1..21 rows; each
    row's bits are what it gets alone. Seen red: the scale kept at 2^(22 - e) for a mantissa over 1.992
    (the digits of that block's largest value overflowed: error 1.2e-3), and the high nibbles' lowest
    digit read from the low nibbles' dword (error 1.3-1.5e-4)."""
    w, packed = matrix(n, k, seed=n + k)
    x = hard_rows(21, k)
    ref = x.double() @ w.double().T
    scale = ref.abs().amax(dim=1, keepdim=True)
    ext.set_q4_1_decode("float")
    loop = ext.q4_1_matmul(x, packed, n, -1)
    ext.set_q4_1_decode("int24")
    alone = torch.cat([ext.q4_1_matmul(x[i : i + 1], packed, n, -1) for i in range(len(x))])
    int24_err = ((alone.double() - ref).abs() / scale).max().item()
    loop_err = ((loop.double() - ref).abs() / scale).max().item()
    assert int24_err < 2e-6 and loop_err < 2e-6, (int24_err, loop_err)
    for rows in (2, 3, 4, 5, 8, 9, 16, 21):
        assert torch.equal(ext.q4_1_matmul(x[:rows], packed, n, -1), alone[:rows]), rows


def test_identity_rows_give_back_each_weight_bit_for_bit(ext):
    """A one-hot row's block has the scale 2^-22 exactly, so the product is the widened weight itself:
    the codes, d and m reach the output unrounded. Seen red: a scale of max / M (not a power of two):
    weights came back off in their last bits."""
    w, packed = matrix(203, 96, seed=3)
    assert torch.equal(ext.q4_1_matmul(torch.eye(96), packed, 203, -1).T, w)


def test_nan_inf_zero_and_tiny_blocks(ext):
    """A row with a NaN or an inf gets NaN outputs, as a float matmul would, and leaves the other rows'
    bits alone; a zero row gives zeros; a block below 2^-104 counts as zeros in the codes' products
    (only the m * sum(x) term is left), where the float loop keeps products of ~1e-33. Seen red:
    the non-finite check dropped (the inf row came out finite)."""
    w, packed = matrix(64, 96, seed=4)
    x = torch.randn(6, 96)
    x[1, 3] = float("nan")
    x[2, 70] = float("inf")
    x[3] = 0.0
    x[4, :32] = 1e-33
    y = ext.q4_1_matmul(x, packed, 64, -1)
    assert y[1].isnan().all() and y[2].isnan().all()
    assert torch.equal(y[3], torch.zeros(64))
    for i in (0, 3, 4, 5):
        assert torch.equal(y[i], ext.q4_1_matmul(x[i : i + 1], packed, 64, -1)[0]), i
    ref = x[4:5].double() @ w.double().T
    torch.testing.assert_close(y[4:5].double(), ref, atol=1e-5, rtol=1e-5)


def test_the_switch_says_what_runs_and_refuses_anything_else(ext):
    """`set_q4_1_decode` is for A/B runs and these tests; the name says the build's instruction set."""
    assert ext.set_q4_1_decode("float") == "float"
    assert ext.set_q4_1_decode("int24") in ("int24-avx512-vnni", "int24-avx2", "int24-scalar")
    with pytest.raises(RuntimeError, match="'int24' or 'float'"):
        ext.set_q4_1_decode("int8")


def test_the_environment_picks_the_loop_for_served_ab_runs(ext, monkeypatch, caplog):
    """`KVGATE_Q4_1_DECODE=float` (how `bench.compare --kvgate-variant "float=KVGATE_Q4_1_DECODE=float"`
    serves the old loop) sets the switch when the module loads; unset keeps the integer loop; a name the
    kernel refuses is logged and changes nothing. Seen red with _apply_q4_1_decode reading another name."""
    monkeypatch.setenv("KVGATE_Q4_1_DECODE", "float")
    native._apply_env_choices(ext)
    assert ext.q4_1_decode() == "float"
    monkeypatch.delenv("KVGATE_Q4_1_DECODE")
    native._apply_env_choices(ext)
    assert ext.q4_1_decode().startswith("int24")
    monkeypatch.setenv("KVGATE_Q4_1_DECODE", "int8")
    with caplog.at_level("WARNING", logger="kvgate.native"):
        native._apply_env_choices(ext)
    assert ext.q4_1_decode().startswith("int24")
    assert "KVGATE_Q4_1_DECODE=int8 ignored" in caplog.text


def test_the_paired_ab_bench_times_both_loops_and_leaves_int24_on(ext):
    """bench.q4_1_decode_ab switches the loop every round; even when a call fails mid-round (on the
    float loop), the process is back on the integer loop afterwards, so a server or test sharing the
    process keeps the default. Seen red with the bench's `finally` dropped."""
    from types import SimpleNamespace

    from bench.q4_1_decode_ab import paired

    mats = []
    for n, k in ((48, 64), (32, 128)):
        _, packed = matrix(n, k, n + k)
        mats.append((SimpleNamespace(packed=packed, out_features=n), k))
    r = paired(ext, mats, rows=3, rounds=2)
    assert r["rows"] == 3 and r["float_ms"] > 0 and r["int24_ms"] > 0 and r["ratio"] > 0
    assert ext.q4_1_decode().startswith("int24")
    with pytest.raises(RuntimeError):  # a matrix given the wrong width: the float round's call refuses it
        paired(ext, [(mats[0][0], 96)], rows=1, rounds=1)
    assert ext.q4_1_decode().startswith("int24")


@pytest.mark.parametrize("n,k", [(37, 256), (576, 1536)])
def test_q4f_decode_rows_take_the_integer_products_too(ext, n, k):
    """Q4F tiles (a GGUF's Q4_K and Q4_0 layers: Q4_1's codes with float32 d and m) run their decode
    rows on the same 24-bit integer products: within 2e-6 of the float64 product of the exact weights
    as the float loop is, other bits than the float loop's (so the integer loop is what ran), and each
    row's bits the same alone as among 20 others. Seen red with block_matmul's Q4F decode rows left on
    the float loop (equal to it), and with the d and m read at Q4_1's fp16 offsets (error ~1)."""
    from kvgate.models.block_formats import block_pack16, file_codes
    from tests.test_block_formats import blocks

    w, d, m = blocks("q4f", n, k, seed=k)
    got = file_codes(w, d, m)
    assert got is not None and got[0] == "q4f"
    packed = block_pack16("q4f", *got[1:])
    x = hard_rows(21, k)
    ref = x.double() @ w.double().T
    scale = ref.abs().amax(dim=1, keepdim=True)
    ext.set_q4_1_decode("float")
    loop = ext.block_matmul(x, packed, n, -1)
    ext.set_q4_1_decode("int24")
    alone = torch.cat([ext.block_matmul(x[i : i + 1], packed, n, -1) for i in range(len(x))])
    int24_err = ((alone.double() - ref).abs() / scale).max().item()
    loop_err = ((loop.double() - ref).abs() / scale).max().item()
    assert int24_err < 2e-6 and loop_err < 2e-6, (int24_err, loop_err)
    assert not torch.equal(alone, loop), "Q4F's decode rows did not take the integer products"
    for rows in (2, 3, 5, 8, 16, 21):
        assert torch.equal(ext.block_matmul(x[:rows], packed, n, -1), alone[:rows]), rows
    prompt = ext.block_matmul(x, packed, n, 0)  # prompt rows keep the float panels in either mode
    ext.set_q4_1_decode("float")
    assert torch.equal(ext.block_matmul(x, packed, n, 0), prompt)
