"""The candidate layer fusions outside attention (`bench.fused`, measured for issue 14 and not used by
the engine): bit for bit what the engine's layer code computes, for every weight format; a row's numbers do not depend on the rows beside it; the packed
custom op keeps its row buckets; and (slow) a compiled graph serves every layer without recompiling.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bench import fused
from kvgate.models.linear import Linear, packs_weights
from kvgate.models.quant import Quantized, supported

H, KVH, D, HID, INTER, EPS = 4, 2, 16, 64, 128, 1e-5
CASES = [  # (weights, model dtype, quantized activation dtype)
    ("packed", torch.float32, None),
    ("plain", torch.float32, None),
    ("int8", torch.float32, torch.bfloat16),
    ("int4", torch.float32, torch.bfloat16),
    ("int4", torch.float32, torch.float32),
    ("int8", torch.bfloat16, torch.float32),  # a wider act than the model: must round as the layer did
    ("plain", torch.bfloat16, None),
]
needs_int4 = pytest.mark.skipif(
    supported("int4", "cpu") is not None, reason="torch lacks the int4 CPU kernel"
)


def layer(kind: str, dtype: torch.dtype, act: torch.dtype | None, seed: int = 0, bias: bool = False):
    """(ln1, qkv, o, ln2, gate_up, down) as the model holds them: Linear or Quantized objects."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.1):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    def lin(n, k, b=False):
        w, bv = r(n, k), (r(n) if b else None)
        if kind in ("int8", "int4"):
            return Quantized(kind, w, bv, act)
        return Linear(w, bv, pack=kind == "packed")

    return (
        1 + r(HID),
        lin((H + 2 * KVH) * D, HID, bias),
        lin(HID, H * D),
        1 + r(HID),
        lin(2 * INTER, HID),
        lin(HID, INTER),
    )


def rope_tables(T: int, dtype: torch.dtype, offset: int = 100):
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    freqs = torch.outer(torch.arange(offset, offset + T, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)


def reference(x, attn, L, cos, sin):
    """The layer code of `LlamaModel.forward` (kvgate.models.llama, 2026-11-30), verbatim."""
    ln1, qkv_proj, o_proj, ln2, gate_up_proj, down_proj = L
    T, half = x.shape[0], D // 2
    h = F.rms_norm(x, (HID,), ln1, EPS)
    qkv = qkv_proj(h)
    qk = qkv[:, : (H + KVH) * D].view(T, H + KVH, D)
    rot = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    qk = qk * cos + rot * sin
    q, k, v = qk[:, :H], qk[:, H:], qkv[:, (H + KVH) * D :].view(T, KVH, D)
    x = x + o_proj(attn)
    h = F.rms_norm(x, (HID,), ln2, EPS)
    gu = gate_up_proj(h)
    inter = gu.shape[-1] // 2
    return q, k, v, x + down_proj(F.silu(gu[:, :inter]) * gu[:, inter:])


def run_fused(x, attn, L, cos, sin_folded, pre=fused.pre, post=fused.post):
    ln1, qkv, o, ln2, gu, down = L
    q, k, v = pre(x, ln1, fused.mat_args(qkv), cos, sin_folded, EPS, H, KVH)
    return (
        q,
        k,
        v,
        post(x.clone(), attn, fused.mat_args(o), ln2, fused.mat_args(gu), fused.mat_args(down), EPS),
    )


def skip_unsupported(kind, dtype):
    if kind == "packed" and not packs_weights("cpu", dtype):
        pytest.skip("this torch cannot prepack weights")
    if kind in ("int8", "int4") and supported(kind, "cpu") is not None:
        pytest.skip(f"torch lacks the {kind} CPU kernel")


@pytest.mark.parametrize("kind,dtype,act", CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_the_fused_layer_computes_the_plain_layers_numbers_bit_for_bit(kind, dtype, act, bias):
    """q, k, v and the new residual stream equal the plain code's exactly (torch.equal), so turning the
    fusions on would change no token anywhere. Seen red: `flip` on the wrong axis (dim 3) in `rope`;
    `rot.mul_(sin)` in place on a bfloat16 `qk` (int4: off by bfloat16 rounding); no cast back of a
    wider float32 act output for a bfloat16 model (int8/bfloat16 case: double rounding in `add_`)."""
    skip_unsupported(kind, dtype)
    L = layer(kind, dtype, act, bias=bias)
    g = torch.Generator().manual_seed(1)
    T = 7
    x = torch.randn(T, HID, generator=g).to(dtype)
    attn = torch.randn(T, H * D, generator=g).to(dtype)
    cos, sin = rope_tables(T, dtype)
    want = reference(x, attn, L, cos, sin)
    got = run_fused(x, attn, L, cos, fused.sign_folded_sin(sin))
    for name, a, b in zip("qkvx", want, got):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), (name, (a.float() - b.float()).abs().max().item())


@pytest.mark.parametrize("kind", ["packed", "int4"])
def test_a_rows_numbers_do_not_depend_on_the_rows_beside_it(kind):
    """Batching never changes what a request generates: each of 16 rows through pre and post equals the
    same row run alone, and the first n rows run as n (bucket-padded for packed weights). Seen red:
    RMSNorm in `post` normalizing over the whole step (`F.rms_norm(x, x.shape, ln.expand(x.shape))`)."""
    skip_unsupported(kind, torch.float32)
    L = layer(kind, torch.float32, torch.bfloat16)
    for lin in L[1:3] + L[4:]:
        if kind == "packed":
            lin.buckets = [1, 2, 4, 8, 16]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, HID, generator=g)
    attn = torch.randn(16, H * D, generator=g)
    cos, sin = rope_tables(16, torch.float32)
    sin = fused.sign_folded_sin(sin)
    all16 = run_fused(x, attn, L, cos, sin)
    for i in range(16):
        one = run_fused(x[i : i + 1], attn[i : i + 1], L, cos[i : i + 1], sin[i : i + 1])
        for a, b in zip(one, all16):
            assert torch.equal(a, b[i : i + 1]), i
    for n in (3, 5, 11):
        part = run_fused(x[:n], attn[:n], L, cos[:n], sin[:n])
        for a, b in zip(part, all16):
            assert torch.equal(a, b[:n]), n


def test_the_packed_custom_op_pads_to_its_bucket_and_answers_the_rows_asked():
    """`kvgate::packed_linear` (what a compiled graph calls) gives the eager packed Linear's rows for
    exact and padded row counts, with no view of a padded buffer. Seen red: returning the padded
    buffer's full height (`[:rows]` dropped)."""
    if not packs_weights("cpu", torch.float32):
        pytest.skip("this torch cannot prepack weights")
    g = torch.Generator().manual_seed(4)
    lin = Linear(torch.randn(128, 64, generator=g), torch.randn(128, generator=g), pack=True)
    assert lin.packed  # (a shape oneDNN would pad, such as 96 x 64, stays plain)
    lin.buckets = [1, 2, 4, 8]
    x = torch.randn(8, 64, generator=g)
    for rows in range(1, 9):
        y = torch.ops.kvgate.packed_linear(x[:rows], lin.weight, lin.bias, 128, lin.buckets)
        assert y.shape == (rows, 128) and y._base is None
        assert torch.equal(y, lin(x[:rows])), rows


@pytest.mark.slow
@needs_int4
@pytest.mark.parametrize("kind", ["packed", "int4"])
def test_one_compiled_graph_serves_every_layer_and_every_row_count(kind):
    """torch.compile (inductor) of `pre`/`post` with raw tensors: three layers and row counts 1..16
    compile at most two graphs per piece (row count 1, and any other), none after warm-up; each layer
    within 1e-4 of eager (inductor's RMSNorm rounds differently; over 30 int4 layers bfloat16 rounding
    grows that to ~0.2, which is one reason the engine does not compile: docs/DESIGN_NOTES.md).
    ~15-30 s of compilation, hence slow; in a subprocess, so inductor's memory does not count in the
    runtime overhead later tests measure in this process (it made test_parity's plans refuse). Seen
    red: `dynamic=False` with automatic dynamic shapes off (12 graphs: one per row count). Passing
    the Quantized object instead of its tensors did NOT go red: dynamo guards the attributes read."""
    skip_unsupported(kind, torch.float32)
    root = Path(__file__).resolve().parents[1]
    code = f"from tests.test_fused import compile_check; compile_check({kind!r})"
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]


def compile_check(kind: str) -> None:
    """The body of the test above, run in a fresh interpreter."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    layers = [layer(kind, torch.float32, torch.bfloat16, seed=s) for s in range(3)]
    pre, post = torch.compile(fused.pre, dynamic=True), torch.compile(fused.post, dynamic=True)
    g = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for rows in [1, 2, 3, 16, 1, 5, 9]:
            if rows == 5:
                warm = dict(counters["stats"])
            x = torch.randn(rows, HID, generator=g)
            attn = torch.randn(rows, H * D, generator=g)
            cos, sin = rope_tables(rows, torch.float32)
            sin = fused.sign_folded_sin(sin)
            for L in layers:
                want = run_fused(x, attn, L, cos, sin)
                got = run_fused(x, attn, L, cos, sin, pre, post)
                for a, b in zip(want, got):
                    assert (a.float() - b.float()).abs().max() < 1e-4
    assert counters["stats"]["unique_graphs"] <= 4, dict(counters["stats"])
    assert dict(counters["stats"]) == warm, "recompiled after warm-up"
