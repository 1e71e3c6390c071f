"""The AVX-512 VNNI tile kernels of `--weights gguf-q8act` (kvgate/models/csrc/int8_vnni.cpp) give the
AVX2 kernels' bits, in one build: the same exact integer sums, then the same float ops per output lane.

Runs only where the build has them (a CPU listing avx512f, avx512bw, avx512vl and avx512_vnni: Zen 4/5,
Ice Lake and later Xeons); an AVX2-only machine skips it, and tests/test_q4_1_dot8.py still checks the
AVX2 kernels against the exact integer product there. The VNNI runs take the pairs at every row count
(from 5 rows always; at 1-4 rows where kvgate.models.q8act_rows's probe finds them faster); the cases
cover groups of 8 rows with every remainder
(1-7 rows, with their 4-, 2- and 1-row chain splits), an odd tile count (the lone last tile runs as a
pair with itself), a partial last tile, a NaN row, and SmolLM2's own matrix shapes.

Seen red (each restored): one row's 4 integer chains summed without the last; the Q4_1 kernel's m term added before the d term (a last-bit difference in
most outputs); the store mask one lane short; every pair stored 16 wide (the partial last pair wrote
into the next row: the process crashed); the Q8_0 kernel without the masked negate (|w| times x).
Not caught, and not a result: pairing a lone last tile with the memory after it instead of itself
(its lanes are masked off; the guard is there so nothing reads past the tensor).
"""

from __future__ import annotations

import pytest
import torch

from kvgate.models import native
from kvgate.models.q4_1 import q4_1_blocks
from kvgate.models.q4_1_dot8 import q4_1_pack8
from kvgate.models.q8_head import q8_blocks, q8_pack8
from tests.test_q4_1 import ggml_q4_1
from tests.test_q4_1_dot8 import ggml_q8_0

ext = native.extension()
pytestmark = pytest.mark.skipif(
    ext is None or ext.set_int8_isa("auto") != "avx512-vnni",
    reason="this build has no AVX-512 VNNI kernels (the CPU does not list avx512_vnni)",
)

SHAPES = [(203, 96), (17, 64), (8, 32), (24, 64), (576, 576), (192, 576), (1536, 576), (576, 1536)]


def both(fn, *args) -> tuple[torch.Tensor, torch.Tensor]:
    """`fn(*args)` with the AVX2 kernels, then with the VNNI ones (auto is left on afterwards)."""
    small = ext.int8_small_rows()
    try:
        assert ext.set_int8_isa("avx2") == "avx2"
        plain = fn(*args)
        assert ext.set_int8_isa("avx512-vnni") == "avx512-vnni"
        ext.set_int8_small_rows(0b11110)  # calls of 1-4 rows take the pairs too (kvgate.models.q8act_rows)
        return plain, fn(*args)
    finally:
        ext.set_int8_isa("auto")
        ext.set_int8_small_rows(small)


@pytest.mark.parametrize("n,k", SHAPES)
def test_vnni_tiles_give_the_avx2_bits(n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w4 = q4_1_pack8(*q4_1_blocks(ggml_q4_1(torch.randn(n, k, generator=g) * 0.05)))
    w8 = q8_pack8(*q8_blocks(ggml_q8_0(torch.randn(n, k, generator=g) * 0.05)))
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 19):
        x = torch.randn(rows, k, generator=g) * 2
        if rows > 4:
            x[4, 3] = float("nan")
        for name, fn, w in (("q4_1_dot8", ext.q4_1_dot8, w4), ("q8_dot8", ext.q8_dot8, w8)):
            plain, vnni = both(fn, x, w, n)
            assert vnni.shape == (rows, n)
            assert torch.equal(plain.isnan(), vnni.isnan()), (name, rows)
            assert torch.equal(plain.nan_to_num(), vnni.nan_to_num()), (name, rows)
            if rows > 4:
                assert vnni[4].isnan().all() and not vnni[[0, 1, 2, 3]].isnan().any(), (name, rows)


def test_set_int8_isa_refuses_names_it_does_not_know():
    with pytest.raises(RuntimeError, match="'auto', 'avx2' or 'avx512-vnni'"):
        ext.set_int8_isa("amx")
    assert ext.int8_isa() == "avx512-vnni"
