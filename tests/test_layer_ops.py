"""kvgate's C++ layer ops (kvgate/models/csrc/layer_ops.cpp), used by the float32 CPU forward: RoPE and
the K/V write are bit for bit the PyTorch expressions they replace, RMSNorm is within an ulp of
`F.rms_norm` and never depends on the other rows, and a whole model step with them gives the logits
of the plain PyTorch forward (to summation order) and a row the same bits alone or batched. Skipped,
saying why, only where the extension cannot be built."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvgate.models import native


@pytest.fixture(scope="module")
def ext():
    e = native.extension()
    if e is None:
        pytest.skip(f"kvgate's C++ kernels did not build: {native.unavailable()}")
    return e


def plain_rope(qkv, heads, kv_heads, cos, sin):
    """`LlamaModel.forward`'s PyTorch RoPE: rotate-half on the q and k heads of the fused QKV rows."""
    T, D = cos.shape
    half = D // 2
    qk = qkv[:, : (heads + kv_heads) * D].view(T, heads + kv_heads, D)
    rot = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    return qk * cos.unsqueeze(1) + rot * sin.unsqueeze(1)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 2, 16), (3, 3, 8), (3, 1, 40)])
def test_rope_and_the_kv_write_are_the_pytorch_expressions_bit_for_bit(ext, heads, kv_heads, dim):
    """The rotated q and k heads equal `qk * cos + rotate_half(qk) * sin` exactly, and the pools hold
    the rotated k and the plain v at each token's slot (every other slot untouched). Seen red: building
    layer_ops.cpp without its `fp-contract=off` pragma (GCC fused x * cos + x' * sin into one FMA:
    a rounding fewer, 2.4e-7 away), and v copied from the k columns; the AVX2 loop (8 pairs at a time)
    with an FMA for its second product. 70 tokens: the op splits them over its threads; a head of 40:
    the vector loop and the scalar tail."""
    gen = torch.Generator().manual_seed(heads)
    T, bs, blocks = 70, 4, 20
    qkv = torch.randn(T, (heads + 2 * kv_heads) * dim, generator=gen)
    cos, sin = torch.randn(T, dim, generator=gen), torch.randn(T, dim, generator=gen)
    slots = torch.randperm(blocks * bs, generator=gen)[:T]
    k_pool = torch.randn(blocks, bs, kv_heads, dim, generator=gen)
    v_pool = torch.randn(blocks, bs, kv_heads, dim, generator=gen)
    want_qk = plain_rope(qkv, heads, kv_heads, cos, sin)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    want_k.view(-1, kv_heads, dim).index_copy_(0, slots, want_qk[:, heads:])
    v_new = qkv[:, (heads + kv_heads) * dim :].view(T, kv_heads, dim)
    want_v.view(-1, kv_heads, dim).index_copy_(0, slots, v_new)
    got = qkv.clone()
    ext.rope_write_kv_(got, heads, kv_heads, cos, sin, slots, k_pool, v_pool)
    assert torch.equal(got[:, : (heads + kv_heads) * dim].view(T, heads + kv_heads, dim), want_qk)
    assert torch.equal(got[:, (heads + kv_heads) * dim :], qkv[:, (heads + kv_heads) * dim :])
    assert torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.int8])
def test_tokens_that_share_a_slot_leave_the_last_ones_write(ext, pool_dtype):
    """Steps never repeat a slot, but the decode stack's run_ops promises row order when they do (the last
    row's write stays): with a repeated slot the op writes on one thread. Seen red: tokens 34 and 35
    (the two threads' halves of 70) sharing a slot, written in parallel (the slot kept token 34's k in
    some of 50 runs)."""
    from kvgate.models import kv_int8

    gen = torch.Generator().manual_seed(1)
    T, H, KVH, D, bs, blocks = 70, 3, 1, 16, 4, 20
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=gen)
    ang = torch.rand(T, D, generator=gen) * 6.28
    cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
    slots = torch.arange(T)
    slots[35] = slots[34]
    want_k = plain_rope(qkv, H, KVH, cos, sin)[35, H:]
    for _ in range(50):
        k_pool = torch.zeros(blocks, bs, KVH, D, dtype=pool_dtype)
        v_pool = torch.zeros_like(k_pool)
        scales = (
            (torch.zeros(blocks, bs, KVH, 2), torch.zeros(blocks, bs, KVH, 2))
            if pool_dtype == torch.int8
            else ()
        )
        ext.rope_write_kv_(qkv.clone(), H, KVH, cos, sin, slots, k_pool, v_pool, *scales)
        got = k_pool.view(-1, KVH, D)[34]
        if pool_dtype == torch.int8:
            codes, steps = kv_int8.quantize(want_k)
            assert torch.equal(got, codes) and torch.equal(scales[0].view(-1, KVH, 2)[34], steps)
        else:
            assert torch.equal(got, want_k)


def test_rms_norm_is_f_rms_norm_to_an_ulp_and_row_invariant(ext):
    """Against `F.rms_norm` within 2 ulp-sized steps (rtol 3e-7 of the row's scale), every row alone the
    same bits as among 37, hidden sizes that are and are not multiples of 8; add_rms_norm_ adds in
    place exactly first. Seen red: the sum of squares without the values past the last multiple of 8
    (the 100- and 7-wide rows)."""
    gen = torch.Generator().manual_seed(0)
    for hidden in (576, 100, 7):
        x = torch.randn(37, hidden, generator=gen) * 3
        w = torch.randn(hidden, generator=gen)
        got = ext.rms_norm(x, w, 1e-5)
        torch.testing.assert_close(got, F.rms_norm(x, (hidden,), w, 1e-5), atol=1e-6, rtol=3e-7)
        for i in range(37):
            assert torch.equal(ext.rms_norm(x[i : i + 1].clone(), w, 1e-5)[0], got[i]), (hidden, i)
        y = torch.randn(37, hidden, generator=gen)
        acc = x.clone()
        h = ext.add_rms_norm_(acc, y, w, 1e-5)
        assert torch.equal(acc, x + y)
        assert torch.equal(h, ext.rms_norm(x + y, w, 1e-5))


def test_silu_mul_is_f_silu_times_up_to_a_few_ulp_and_row_invariant(ext):
    """SiLU(gate) * up from the fused gate_up rows: within 1e-6 relative of `F.silu(g) * u`, finite at
    g = +-100 and +-1e4 (the stable form never overflows exp), each row alone the same bits as among
    37, intermediate sizes that are and are not multiples of 8 (the scalar tail). Seen red: SiLU as
    g / (1 + exp(-g)) through the vector exp, whose range ends at 0 (g = -100 and -1e4 came out
    wrong), and the tail columns left out."""
    gen = torch.Generator().manual_seed(1)
    for inter in (1536, 100, 7):
        gu = torch.randn(37, 2 * inter, generator=gen) * 4
        gu[0, : min(6, inter)] = torch.tensor([-100.0, 100.0, -1e4, 1e4, 0.0, -0.0])[: min(6, inter)]
        want = F.silu(gu[:, :inter]) * gu[:, inter:]
        got = ext.silu_mul(gu)
        assert torch.isfinite(got).all(), inter
        torch.testing.assert_close(got, want, atol=1e-30, rtol=1e-6)
        for i in range(37):
            assert torch.equal(ext.silu_mul(gu[i : i + 1].clone())[0], got[i]), (inter, i)
    with pytest.raises(RuntimeError, match=r"silu_mul: gu must be a contiguous float32 CPU"):
        ext.silu_mul(torch.randn(3, 7))


def test_wrong_inputs_are_refused_with_what_was_expected(ext):
    """A float64 or non-contiguous x, a mismatched weight and a slot past the pool each raise an error
    naming the expectation, never write out of bounds."""
    w = torch.ones(8)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ext.rms_norm(torch.ones(2, 8, dtype=torch.float64), w, 1e-5)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ext.rms_norm(torch.ones(8, 2).t(), w, 1e-5)
    with pytest.raises(RuntimeError, match=r"norm weight must be float32 \[8\]"):
        ext.rms_norm(torch.ones(2, 8), torch.ones(4), 1e-5)
    pool = torch.zeros(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="outside the pool's 8 slots"):
        ext.rope_write_kv_(
            torch.ones(1, 24), 1, 1, torch.ones(1, 8), torch.ones(1, 8), torch.tensor([8]), pool, pool.clone()
        )


def test_a_model_step_with_the_ops_gives_the_plain_forwards_logits(ext, tmp_path):
    """A tiny model (SmolLM2's head geometry, packed weights, paged attention) run over one prefill of
    9 tokens beside 5 decode rows: with the C++ ops and with the plain PyTorch forward the final hidden
    states agree to 1e-4 (RMSNorm's summation order is the only difference), and with the ops a decode
    row's is the same bits alone and beside the others and the prompt. Seen red: the ops path dropping the attention
    branch's residual add (normalizing x instead of x + o)."""
    from kvgate.core.kv_cache import KVPool
    from kvgate.core.step_inputs import DecodeInput, PrefillInput, build_step
    from kvgate.models import load_model
    from kvgate.models.llama import LlamaModel
    from tests.tiny_model import make_tiny_hf_dir

    loaded = load_model(
        str(make_tiny_hf_dir(tmp_path, geometry=dict(hidden=576, heads=9, kv_heads=3, inter=256)))
    )
    model = LlamaModel(loaded.spec, loaded.weights, torch.float32, "cpu", pack=True, paged_attention=True)
    assert model.layer_ops is ext
    model.set_row_buckets(64, 64)
    model.lm_head = lambda h: h  # the tiny vocabulary's head stays unpacked (F.linear): compare hidden states
    bs = 4
    kv = KVPool(loaded.spec, 200, bs, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    kv.k.copy_(torch.randn(kv.k.shape, generator=gen))
    kv.v.copy_(torch.randn(kv.v.shape, generator=gen))
    rows = [DecodeInput(i, 50 + i, 6 + 2 * i, list(range(i * 10, i * 10 + 10))) for i in range(5)]
    prompt = PrefillInput(9, list(range(60, 69)), 0, list(range(60, 64)), True)

    def step(decodes, prefills):
        k0, v0 = kv.k.clone(), kv.v.clone()  # each run writes its tokens' K/V into the same pool
        batch, d_rows, p_rows, _ = build_step(decodes, prefills, bs, 4096, torch.device("cpu"))
        logits = model.forward(batch, kv)
        kv.k.copy_(k0), kv.v.copy_(v0)
        return logits, d_rows, p_rows

    with_ops, d_rows, p_rows = step(rows, [prompt])
    model.layer_ops = None
    plain, _, _ = step(rows, [prompt])
    model.layer_ops = ext
    torch.testing.assert_close(with_ops, plain, atol=1e-4, rtol=1e-4)
    alone, a_rows, _ = step([rows[2]], [])
    assert torch.equal(alone[a_rows[0]], with_ops[d_rows[2]])
