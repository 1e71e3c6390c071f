"""--weights gguf's prompt rows on AMX bf16 tiles (kvgate/models/csrc/amx_q4_1.cpp), on CPUs that list
amx_bf16: float32's numbers (each activation split exactly into three bf16 parts), a prompt row's bits
whatever the chunk or the rows beside it, decode rows untouched, the ISA switch, and the plan charging
the kernel's buffers. Skipped where the build has no AMX kernels or the kernel refuses the tile state."""

from __future__ import annotations

import pytest
import torch

from kvgate.memory.workspace import StepLimits, amx_prefill_bytes, step_workspace
from kvgate.models import native
from tests.test_q4_1 import ggml_q4_1

ext = native.extension()
pytestmark = pytest.mark.skipif(
    ext is None or ext.amx_unavailable() != "",
    reason=f"no AMX prompt kernel here: {native.unavailable() or (ext and ext.amx_unavailable())}",
)


@pytest.fixture()
def isa():
    """Switches the prompt rows' ISA for one test and restores `auto` after it."""
    yield ext.set_prefill_isa
    ext.set_prefill_isa("auto")


def packed(n: int, k: int, seed: int = 0):
    from kvgate.models.q4_1 import q4_1_blocks, q4_1_pack16

    g = torch.Generator().manual_seed(seed)
    w = ggml_q4_1(torch.randn(n, k, generator=g) * 0.05)
    return w, q4_1_pack16(*q4_1_blocks(w))


@pytest.mark.parametrize("n,k,rows", [(576, 576, 256), (203, 96, 17), (1536, 1536, 40), (48, 64, 1)])
def test_prompt_rows_on_amx_are_float32_numbers(isa, n, k, rows):
    """Against a float64 product of the exact weights, AMX prompt rows stay within 2e-6 of the largest
    output, as the float32 loop does (measured: AMX 1-4e-7, the float32 loop 3-17e-7); a two-part split
    (x3 dropped) would be ~1e-5. Seen red: the third part's TDPBF16PS removed (all four shapes failed)."""
    w, p = packed(n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)) * 3
    ref = x.double() @ w.double().T
    isa("auto")
    assert ext.prefill_isa() == "amx-bf16"
    y = ext.q4_1_matmul(x, p, n, 0)
    isa("float32")
    yf = ext.q4_1_matmul(x, p, n, 0)
    scale = ref.abs().max()
    assert ((y.double() - ref).abs().max() / scale) < 2e-6
    assert ((yf.double() - ref).abs().max() / scale) < 2e-6
    assert not torch.equal(y, yf)  # two summations: the switch does change the path


def test_a_prompt_rows_bits_do_not_depend_on_its_chunk_or_neighbours(isa):
    """A prompt row gives the same bits alone, in any chunk of prompt rows, behind any number of decode
    rows, and at any position inside a 16-row tile (the tiles pad with zero rows), and decode rows in the
    same call are computed as they are alone. Seen red: prompt rows sent to AMX only from 16 rows on (a
    row-count switch, the plausible "fix" for AMX being slower on short chunks)."""
    isa("auto")
    w, p = packed(203, 192, seed=3)
    x = torch.randn(37, 192, generator=torch.Generator().manual_seed(4))
    whole = ext.q4_1_matmul(x, p, 203, 0)
    for lo, hi in [(0, 1), (5, 6), (3, 20), (16, 37), (0, 17), (30, 37)]:
        assert torch.equal(ext.q4_1_matmul(x[lo:hi].contiguous(), p, 203, 0), whole[lo:hi])
    for decode in (1, 4, 9):
        mixed = ext.q4_1_matmul(x, p, 203, decode)
        assert torch.equal(mixed[decode:], whole[decode:])
        alone = ext.q4_1_matmul(x[:decode].contiguous(), p, 203, -1)
        assert torch.equal(mixed[:decode], alone)


def test_non_finite_rows_stay_in_their_row(isa):
    """A NaN or inf in one prompt row reaches that row's outputs only (the three-part split of inf is
    NaN in its own row). A guard: no plausible break was found that only this test sees."""
    isa("auto")
    w, p = packed(64, 64, seed=5)
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(6))
    clean = ext.q4_1_matmul(x, p, 64, 0)
    x[7, 3], x[12, 0] = float("nan"), float("inf")
    y = ext.q4_1_matmul(x, p, 64, 0)
    keep = [r for r in range(20) if r not in (7, 12)]
    assert torch.equal(y[keep], clean[keep])
    assert not torch.isfinite(y[7]).any() and not torch.isfinite(y[12]).all()


def test_the_isa_switch_names_what_it_takes(isa):
    """`set_prefill_isa` takes auto, amx-bf16 and float32 and refuses anything else by name."""
    assert isa("float32") == "float32" and ext.prefill_isa() == "float32"
    assert isa("amx-bf16") == "amx-bf16"
    with pytest.raises(RuntimeError, match="want 'auto', 'amx-bf16' or 'float32'"):
        isa("avx2")


def test_the_plan_charges_the_amx_buffers():
    """With amx_prefill the gguf matmul scratch (`kernel_scratch`) grows by exactly the largest layer
    matrix's AMX buffers: the three bf16 parts and block sums of the step's rows (padded to 16) and the
    codes as bf16; nothing else moves. Seen red: the term left out of `_gemm_scratch` (equal breakdowns)."""
    from tests.test_plan import SMOLLM2 as spec

    base = dict(prefill_chunk=256, max_seqs=8, attn_token_cap=8 * 512, max_model_len=2048)
    gguf = dict(weight_format="gguf", quant_act_bytes=4)
    off = step_workspace(spec, 4, StepLimits(**base, **gguf))
    on = step_workspace(spec, 4, StepLimits(**base, **gguf, amx_prefill=True))
    assert {k for k in on if on[k] != off[k]} == {"kernel_scratch"}
    h, i, kv = spec.hidden_size, spec.intermediate_size, spec.num_kv_heads * spec.head_dim
    T = 256 + 8
    plain = {(k, n): T * (k + n) * 4 for k, n in [(h, h + 2 * kv), (h, h), (h, 2 * i), (i, h)]}
    want = max(v + amx_prefill_bytes(T, k, n) for (k, n), v in plain.items()) - max(plain.values())
    assert on["kernel_scratch"] - off["kernel_scratch"] == want
