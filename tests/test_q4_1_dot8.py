"""`--weights gguf-q8act`: Q4_1 weights times activations rounded to 8-bit blocks (kvgate/models/q4_1_dot8.py,
kvgate/models/csrc/int8_dot.cpp). The rounding is exactly the stated one, the kernel is the exact
integer sum of those values, a row's output never depends on the rows beside it, the plan charges
the tiles exactly, and on the default model the tokens stay within the stated tolerance of full's."""

from __future__ import annotations

import pytest
import torch

from kvgate.models import native
from kvgate.models.q4_1 import q4_1_blocks
from kvgate.models.q4_1_dot8 import Q41Dot8Linear, q4_1_dot8_bytes, q4_1_pack8
from kvgate.models.q8_head import Q8DotTable, Q8Table, q8_blocks, q8_dot_bytes
from tests.test_q4_1 import engine, ggml_q4_1, q4_tiny_dir  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(
    native.extension() is None, reason=f"kvgate's C++ kernels did not build: {native.unavailable()}"
)


def reference_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stated rounding, in PyTorch: per 32 values d = max|x| / 127, code = round-half-even(x * 127 /
    max|x|), s = d * sum(codes)."""
    m, k = x.shape
    b = x.view(m, k // 32, 32)
    amax = b.abs().amax(-1)
    d = amax / 127
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    codes = torch.round(b * inv.unsqueeze(-1)).clamp(-127, 127)
    return codes.to(torch.int8).view(m, k), d, d * codes.sum(-1)


def exact_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_b d_w d_x (sum_k q_w q_x) + m_w s_x, in float64 from the integer sums (the value the kernel
    computes up to float32 rounding)."""
    n, k = w.shape
    codes, wd, wm = q4_1_blocks(w)
    vals = torch.cat([codes.view(n, k // 32, 16) & 15, codes.view(n, k // 32, 16) >> 4], -1).long()
    q, d, s = reference_rows(x)
    isum = torch.einsum("rbk,nbk->rnb", q.view(len(x), k // 32, 32).long(), vals).double()
    return (isum * wd[None].double() * d[:, None].double() + wm[None].double() * s[:, None].double()).sum(-1)


def test_activations_are_rounded_exactly_as_stated():
    """The kernel's 8-bit blocks equal the PyTorch statement of them bit for bit, including a block of
    zeros, ties (x * 127 / max = k + 0.5 rounds to even) and a row of one large value. Seen red:
    rounding by truncation in the kernel."""
    torch.manual_seed(3)
    x = torch.randn(9, 96) * 3
    x[2, 32:64] = 0
    x[4, :32] = torch.arange(32) - 15.5  # max 16.5: many x * 127 / 16.5 near halves
    x[5, :] = 0
    x[5, 70] = 1e4
    x[6, :32] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5] + [0.0] * 26)  # exact ties
    got = native.extension().q8_rows(x)
    for g, r, name in zip(got, reference_rows(x), ("codes", "d", "s"), strict=True):
        assert torch.equal(g, r), name


def test_the_kernel_is_the_exact_integer_product_and_row_invariant():
    """Against the float64 value of the integer sums (relative 1e-6), for 203 outputs (a padded last
    tile) and 1..13 rows; each row alone equals it among all 13, and any slice of rows gives the same
    bits; within 2% of the float matmul. Seen red: swapping the k of the high and low nibbles in the
    AVX2 loop; rounding activations by truncation."""
    torch.manual_seed(4)
    w = ggml_q4_1(torch.randn(203, 160) * 0.05)
    bias = torch.randn(203)
    lin = Q41Dot8Linear(w, bias)
    assert lin.nbytes == q4_1_dot8_bytes(203, 160) + 203 * 4 == 26 * 5 * 160 + 203 * 4
    x = torch.randn(13, 160)
    full = lin(x)
    ref = exact_product(x, w) + bias.double()
    assert ((full.double() - ref).abs().max() / ref.abs().max()).item() < 1e-6
    assert ((full - (x @ w.T + bias)).norm() / full.norm()).item() < 0.02
    for rows in range(1, 14):
        assert torch.equal(lin(x[:rows]), full[:rows]), rows
    for start, end in [(3, 4), (5, 13), (1, 8), (12, 13)]:
        assert torch.equal(lin(x[start:end], decode_rows=1), full[start:end]), (start, end)


def test_a_nan_or_inf_activation_gives_nan_outputs_for_its_row_only():
    """A NaN or an inf in a row's activations makes that row's outputs NaN, as a float matmul's would
    be (the sampler then falls back for that row), and leaves the other rows' bits alone; a block of
    values too small for 127 / max to be finite counts as zeros. Seen red before the fix: a NaN was
    dropped by max() and cast to int (undefined; -127 on x86), giving finite outputs."""
    torch.manual_seed(7)
    w = ggml_q4_1(torch.randn(16, 64) * 0.05)
    lin = Q41Dot8Linear(w, None)
    x = torch.randn(4, 64)
    clean = lin(x)
    bad = x.clone()
    bad[1, 3] = float("nan")
    bad[2, 40] = float("inf")
    bad[3, :32] = 1e-38
    y = lin(bad)
    assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all()
    assert torch.equal(y[0], clean[0])
    tiny = bad[3:4].clone()
    tiny[0, :32] = 0
    assert torch.equal(y[3], lin(tiny)[0])
    q, d, s = native.extension().q8_rows(bad)
    assert torch.isnan(d[1, 0]) and torch.isnan(s[2, 1]) and d[3, 0] == 0 and not q[3, :32].any()


def test_the_tiles_hold_the_files_values():
    """Unpacking the tiles gives back every code, d and m of q4_1_blocks, with padding rows zero.
    Seen red: packing the scales by block instead of by row (d of row n at block b went to row b)."""
    torch.manual_seed(5)
    w = ggml_q4_1(torch.randn(21, 64) * 0.05)
    codes, d, m = q4_1_blocks(w)
    packed = q4_1_pack8(codes, d, m)
    assert packed.shape == (3, 2, 160)
    nib = packed[..., :128].view(3, 2, 4, 8, 4)  # [tile, block, g, n, j]
    lo, hi = nib & 15, nib >> 4
    vals = torch.stack([lo, hi], dim=3).permute(0, 4, 1, 2, 3, 5).reshape(24, 64)  # [row, k]
    want = torch.cat([codes.view(21, 2, 16) & 15, codes.view(21, 2, 16) >> 4], -1).view(21, 64)
    assert torch.equal(vals[:21], want) and not vals[21:].any()
    scales = packed[..., 128:].contiguous().view(torch.float16).float().view(3, 2, 2, 8)  # [t, b, d|m, n]
    for i, s in enumerate((d, m)):
        got = scales[:, :, i].permute(0, 2, 1).reshape(24, 2)
        assert torch.equal(got[:21], s) and not got[21:].any()


def ggml_q8_0(x: torch.Tensor) -> torch.Tensor:
    """What a GGUF Q8_0 tensor dequantizes to: per 32 values an fp16 scale max|x| / 127, codes rounded."""
    n, k = x.shape
    b = x.view(n, k // 32, 32)
    s = (b.abs().amax(-1) / 127).half().float()
    return (torch.round(b / s[..., None]).clamp(-127, 127) * s[..., None]).view(n, k)


def test_the_q8_head_in_tiles_is_the_exact_integer_product_and_looks_up_the_same_rows():
    """`Q8DotTable` (the LM head under gguf-q8act): against the float64 value of the integer sums
    (relative 1e-6) for 203 rows (a padded last tile) and 1..13 input rows, each row's output the same
    bits alone and among all; its lookup gives `Q8Table`'s floats for every row and refuses ids
    outside the table (padding rows included). Seen red: dropping w's sign from x in the AVX2 loop
    (exactness); gathering the scales of the wrong lane (lookup)."""
    torch.manual_seed(6)
    codes, scales = q8_blocks(ggml_q8_0(torch.randn(203, 96) * 0.05))
    plain, tiled = Q8Table(codes, scales), Q8DotTable(codes, scales)
    assert tiled.nbytes == q8_dot_bytes(203, 96) == 26 * 3 * 288
    ids = torch.arange(203)
    assert torch.equal(tiled.embed(ids, torch.float32), plain.embed(ids, torch.float32))
    for wrong in (203, 207, -1):  # a padding row, past it, negative: refused as index_select refuses
        with pytest.raises(IndexError):
            tiled.embed(torch.tensor([5, wrong]), torch.float32)
    x = torch.randn(13, 96)
    y = tiled(x)
    q, d, _ = reference_rows(x)
    isum = torch.einsum("rbk,nbk->rnb", q.view(13, 3, 32).double(), codes.view(203, 3, 32).double())
    ref = (isum * d[:, None].double() * scales[None].double()).sum(-1)
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-6
    for rows in range(1, 14):
        assert torch.equal(tiled(x[:rows]), y[:rows]), rows
    assert torch.equal(tiled(x[7:9]), y[7:9])


def test_an_engine_with_q8act_is_batch_invariant_and_charged_exactly(q4_tiny_dir):  # noqa: F811
    """The tiny Q4_1 model under gguf-q8act: every prompt's greedy tokens alone equal those batched
    with the others, with a 4-token prefill chunk and with --speculate 3 (drafts verified as rows of
    the same kernel, and some kept); the plan charges exactly what the model holds
    (plus the packed head copy the tiny shape keeps plain, as tests/test_q4_1.py states for gguf),
    as much as gguf's tiles (both fp16 scales). Seen red: charging the tiles with float32 scales (plan
    above the model)."""
    from kvgate.request import GenerationRequest
    from kvgate.sampling import SamplingParams

    prompts = [[5, 6, 7, 8, 9], [40, 41] * 6, list(range(60, 90)), [3]]
    reqs = [GenerationRequest(p, SamplingParams(temperature=0), 20, ignore_eos=True) for p in prompts]
    e = engine(q4_tiny_dir, weights="gguf-q8act", q8_head="off")
    try:
        assert e.plan.weights_bytes - e.model.weight_bytes == 264 * 64 * 4  # the head copy, as for gguf
        assert {type(lin).__name__ for layer in e.model.layers for lin in layer[1:3] + layer[4:]} == {
            "Q41Dot8Linear"
        }
        batched = [h.result(60).token_ids for h in [e.submit(r) for r in reqs]]
        alone = [e.submit(r).result(60).token_ids for r in reqs]
        q8_bytes = e.plan.weights_bytes
    finally:
        e.shutdown()
    e = engine(q4_tiny_dir, weights="gguf-q8act", q8_head="off", prefill_chunk=4)
    try:
        chunked = [h.result(60).token_ids for h in [e.submit(r) for r in reqs]]
    finally:
        e.shutdown()
    e = engine(q4_tiny_dir, weights="gguf-q8act", q8_head="off", speculate=3)
    try:
        drafted = [h.result(60).token_ids for h in [e.submit(r) for r in reqs]]
        assert e.core.state.counters.spec_accepted_tokens > 0  # drafts were verified and kept
    finally:
        e.shutdown()
    assert batched == alone == chunked == drafted
    e = engine(q4_tiny_dir, weights="gguf", q8_head="off")
    try:
        assert q8_bytes == e.plan.weights_bytes  # both 0.625 B a weight (no padding at the tiny shapes)
    finally:
        e.shutdown()


@pytest.mark.slow
def test_q8act_decodes_smollm2_as_the_full_model_does_within_the_stated_tolerance():
    """Tolerance, measured on the default Q4_1 GGUF and stated here: with --weights gguf-q8act (layers and
    LM head on 8-bit activations), at least 2 of the 8 prompts give the full model's first 24 greedy
    tokens (measured: 3 of 8; the others parted at tokens 3, 4, 5, 8 and 21 on near-ties; with the
    head in float, 4 of 8), and while the tokens agree, the chosen token's log-probability differs by
    at most 0.5 (measured 0.21). Seen red: swapping the k of the high and low nibbles in the kernel
    (0 of 8 prompts agreed)."""
    from tests.test_quant import greedy_agreement

    steps = 24
    same, worst = greedy_agreement("gguf-q8act", steps)
    print(
        f"\ngguf-q8act vs full: {same}/8 prompts identical for {steps} tokens; max logprob error {worst:.4f}"
    )
    assert same >= 2 and worst <= 0.5, (same, worst)
