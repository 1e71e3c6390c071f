"""The C++ kernels' scalar fallback (the build for a CPU without AVX2, e.g. an ARM laptop) computes what
the AVX2 build computes. Every machine CI runs on has AVX2, so without this test the fallback would
only ever be compiled by its users.

A subprocess builds the kernels as for a CPU without AVX2/FMA/F16C (kvgate.models.native's flags
from an empty flag set; a separate cache entry, about two minutes once) and runs them on fixed
inputs; this process compares with its own build. On a CPU with AVX-512 a second subprocess builds
them as for an AVX2-only CPU, so that the zmm paths this process runs are held to the AVX2 bits."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvgate.models import native
from tests.test_q4_1 import ggml_q4_1
from tests.test_q4_1_dot8 import ggml_q8_0

pytestmark = pytest.mark.skipif(
    native.extension() is None, reason=f"kvgate's C++ kernels did not build: {native.unavailable()}"
)

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    import kvgate.models.native as native
    flags = set(sys.argv[2].split(",")) - {""}
    native.cpu_flags = lambda: flags  # build as for a CPU that lists only these flags
    assert native.compile_flags() == ["-O3", "-fopenmp"] + sys.argv[3].split(), native.compile_flags()
    ext = native.extension()
    assert ext is not None, native.unavailable()
    from tests.test_scalar_fallback import outputs
    torch.save(outputs(ext), sys.argv[1])
    """
)


BLOCK_FORMATS = ("q4f", "q5f", "q8d", "q8s")  # block_matmul's tiles (Q8_0's: q8_matmul above)


def build_as(tmp_path, flags: set[str], expect: str) -> dict:
    """`outputs()` from a subprocess that builds the kernels as for a CPU listing only `flags` (its own
    cache entry: about two minutes once); `expect` is the ISA part of the compile flags it must get."""
    out = tmp_path / "other.pt"
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(out), ",".join(sorted(flags)), expect],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=Path(__file__).parents[1],
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(out)


def inputs() -> dict:
    g = torch.Generator().manual_seed(11)
    from kvgate.models.q4_1 import q4_1_blocks, q4_1_pack16
    from kvgate.models.q4_1_dot8 import q4_1_pack8
    from kvgate.models.q8_head import q8_blocks, q8_pack8, q8_pack16

    w4 = ggml_q4_1(torch.randn(203, 96, generator=g) * 0.05)
    w8 = ggml_q8_0(torch.randn(203, 96, generator=g) * 0.05)
    x = torch.randn(9, 96, generator=g)
    x[4, 7] = float("nan")
    wide = torch.randn(21, 96, generator=g)  # more rows: the AVX-512 paths' 8- and 12-row groups
    codes, d, m = q4_1_blocks(w4)
    c8, s8 = q8_blocks(w8)
    from kvgate.models.block_formats import block_pack16, file_codes
    from tests.test_block_formats import blocks

    tiles = {}  # GGUF block formats (block_matmul): 37 outputs, a partial tile
    for fmt in BLOCK_FORMATS:
        got = file_codes(*blocks(fmt, 37, 256, seed=3))
        tiles[fmt] = block_pack16(got[0], *got[1:])
    return {
        "block_x": torch.randn(21, 256, generator=g),
        "block": tiles,
        "x": x,
        "wide": wide,
        "q4": (q4_1_pack16(codes, d, m), 203),
        "tiles4": q4_1_pack8(codes, d, m),
        "q8": (q8_pack16(c8, s8), 203),
        "tiles8": q8_pack8(c8, s8),
    }


def outputs(ext) -> dict:
    """Each kernel's result on `inputs()`: the int-dot ones, the float block matmuls, the layer ops.
    Prompt rows of q4_1_matmul take the float32 loop, which every build has (an AMX build's own bf16
    tiles give other bits by design: tests/test_amx_q4_1.py holds them to the numbers)."""
    was = ext.prefill_isa()
    ext.set_prefill_isa("float32")
    try:
        return _outputs(ext)
    finally:
        ext.set_prefill_isa("auto" if was == "amx-bf16" else "float32")


def _outputs(ext) -> dict:
    i = inputs()
    x = i["x"]
    clean = torch.cat([x[:4], x[5:]])
    return {
        "q8_rows": ext.q8_rows(x),
        "q4_1_dot8": ext.q4_1_dot8(x, i["tiles4"], 203),
        "q8_dot8": ext.q8_dot8(x, i["tiles8"], 203),
        "q4_1_matmul": ext.q4_1_matmul(clean, *i["q4"], 3),
        "q8_matmul": ext.q8_matmul(clean, *i["q8"]),
        "rms_norm": ext.rms_norm(clean, torch.linspace(0.5, 1.5, 96), 1e-5),
        "q4_1_dot8_wide": ext.q4_1_dot8(i["wide"], i["tiles4"], 203),
        "q8_dot8_wide": ext.q8_dot8(i["wide"], i["tiles8"], 203),
        "q4_1_matmul_wide": ext.q4_1_matmul(i["wide"], *i["q4"], 9),  # 9 decode rows, 12 prompt rows
        "q8_matmul_wide": ext.q8_matmul(i["wide"], *i["q8"]),
        "paged_attention": attention(),
        **{f"block_{f}": ext.block_matmul(i["block_x"], t, 37, 9) for f, t in i["block"].items()},
        "draw": draw(ext),
        **(
            {"prefill_attention": prefill(ext)} if ext.prefill_attention_lanes() else {}
        ),  # not built: no AVX2
    }


def draw(ext) -> list[torch.Tensor]:
    """The sampler's draw (draw.cpp): 12 rows of 5,003 logits (a vocabulary the lanes do not divide),
    peaked to flat, under plain, top-k, top-p and min-p parameters, one row with a NaN and one greedy:
    the tokens for fixed uniforms and the kept distributions."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(12, 5003, generator=g) * torch.tensor([8.0, 4.0, 2.0, 1.0, 0.5, 0.2] * 2).unsqueeze(1)
    x[3, 17] = float("nan")
    temps = torch.tensor([1.0, 0.7, 1.0, 1.0, 1.5, 0.9, 1.2, 0.8, 1.0, 0.6, 0.0, 1.0])
    top_k = torch.tensor([0, 0, 40, 0, 0, 300, 0, 5, 0, 0, 0, 0])
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.9, 0.99, 0.5, 1.0, 0.9, 0.95, 0.3, 1.0, 0.9])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.02, 0.05, 0.0, 0.05, 0.0, 0.0, 0.0])
    u = torch.rand(12, generator=g)
    rows = torch.arange(12)
    return [
        ext.draw_tokens(x, rows, temps, top_k, top_p, min_p, u, 2),
        ext.draw_probs(x, rows, temps, top_k, top_p, min_p, 2),
    ]


def pools(shape, g, dt):
    """K and V pools and their scales (None but for int8: `kvgate.models.kv_int8`)."""
    from kvgate.models.kv_int8 import quantize

    out = []
    for _ in range(2):
        x = torch.randn(*shape, generator=g)
        out.append(quantize(x) if dt is torch.int8 else (x.to(dt), None))
    (k, ks), (v, vs) = out
    return k, v, ks, vs


def prefill(ext) -> list[torch.Tensor]:
    """Prompt-chunk attention over float32, float16, bfloat16 and int8 pools (SmolLM2's heads): a whole
    prompt of 45 tokens and a chunk of 21 after a prefix of 80 (lanes left spare in both)."""
    g = torch.Generator().manual_seed(6)
    out = []
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.int8):
        k, v, ks, vs = pools((12, 16, 3, 64), g, dt)
        table = torch.randperm(12, generator=g)[:7].contiguous()
        q = torch.randn(50, 9, 64, generator=g)
        for start, n, ctx in ((2, 45, 45), (0, 21, 101)):
            o = torch.empty(n, 9 * 64)
            ext.prefill_attention_(o, q, k, v, table, start, n, ctx, 0.125, ks, vs)
            out.append(o)
    return out


def attention() -> list[torch.Tensor]:
    """Paged decode attention over float32, float16, bfloat16 and int8 pools (SmolLM2's heads), 7 rows of
    1-128 positions (one chunk each) and, alone, a row of 300 (three chunks, merged)."""
    g = torch.Generator().manual_seed(5)
    out = []
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.int8):
        k, v, ks, vs = pools((64, 16, 3, 64), g, dt)
        tables = torch.randperm(64, generator=g)[:56].view(7, 8).contiguous()
        lens = torch.tensor([1, 7, 8, 9, 33, 100, 128])
        q = torch.randn(7, 9, 64, generator=g)
        out.append(torch.ops.kvgate.paged_decode_attention(q, k, v, tables, lens, 0.125, ks, vs))
        long = torch.randperm(64, generator=g)[:19].view(1, 19).contiguous()
        q1 = torch.randn(1, 9, 64, generator=g) * 4
        out.append(
            torch.ops.kvgate.paged_decode_attention(q1, k, v, long, torch.tensor([300]), 0.125, ks, vs)
        )
    return out


@pytest.mark.slow
def test_the_scalar_build_computes_what_the_avx2_build_computes(tmp_path):
    """The integer-dot kernels (and the activation rounding) give the same bits in both builds: exact
    integer sums, then the same float ops in the same order (NaN rows included); so do the Q4_1 and
    Q8_0 float matmuls (their tiles' decode and prompt rows do each lane's FMAs in the same order in
    every build), and so does the sampler's draw (its scalar exp is exp8's lanes one at a time). RMSNorm and paged attention (its plain loops, chunked contexts included) sum in
    another order without AVX2: within 1e-5. Seen red: the scalar Q4_1 int-dot adding m_w * d_x
    instead of m_w * s_x; the plain attention loop's last positions scored 1% high; the scalar Q4_1
    decode loop adding m * xs before d * s; the scalar Q8_0 loop summing a block in one chain
    instead of its even and odd k apart (each in the scalar build, restored)."""
    if not {"avx2", "fma", "f16c"} <= native.cpu_flags():
        pytest.skip("this CPU builds the scalar path already: nothing to compare")
    scalar, avx2 = build_as(tmp_path, set(), ""), outputs(native.extension())
    for a, b in zip(scalar["q8_rows"], avx2["q8_rows"], strict=True):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
    blocks = tuple(f"block_{f}" for f in BLOCK_FORMATS)
    for name in (
        "q4_1_dot8",
        "q8_dot8",
        "q4_1_matmul",
        "q4_1_matmul_wide",
        "q8_matmul",
        "q8_matmul_wide",
        *blocks,
    ):
        a, b = scalar[name], avx2[name]
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), name
    for name in ("rms_norm",):
        torch.testing.assert_close(scalar[name], avx2[name], atol=1e-5, rtol=1e-5, msg=name)
    for a, b in zip(scalar["draw"], avx2["draw"], strict=True):  # exp8's lanes one at a time: the same w
        assert torch.equal(a, b), "draw"
    for a, b in zip(scalar["paged_attention"], avx2["paged_attention"], strict=True):  # plain loops, chunks
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg="paged_attention")


AVX2 = {"avx2", "fma", "f16c"}


@pytest.mark.slow
def test_the_avx512_paths_compute_what_the_avx2_build_computes(tmp_path):
    """On a CPU with AVX-512 (F, BW, VL; VNNI where listed) this process runs the zmm paths: the VNNI
    int8 tiles, the 12-row prefill tile of the float block matmuls, the one-pass scores and 64-column
    V sums of paged attention, the 16-lane prefill attention (its 8-lane build does each lane's
    operations in the same order). Each keeps the AVX2 loops' per-output operations in the same order, so
    a build for an AVX2-only CPU must give the same bits, every kernel, NaN rows included, the Q4_1
    and Q8_0 tiles' 8-row decode groups and the vpermps lookup of the Q4_1 codes included. Seen red:
    the V pass's last 16 columns not stored; the 16-lane prefill attention dividing by `rcp14` instead
    of `div`; the Q4_1 tiles adding m * sum(x) before d * sum(c x) (each in the AVX-512 build,
    restored). The GGUF block formats' tiles (q4f, q5f, q8d, q8s) are compared too (the review of
    session 35: no test compared them across builds)."""
    if not {"avx512f", "avx512bw", "avx512vl"} <= native.cpu_flags():
        pytest.skip("this CPU lists no AVX-512 F/BW/VL: the AVX2 build is this process's own")
    avx2, wide = build_as(tmp_path, AVX2, "-mavx2 -mfma -mf16c"), outputs(native.extension())
    assert avx2.keys() == wide.keys()
    for name, a in avx2.items():
        b = wide[name]
        for x, y in zip(
            a if isinstance(a, (tuple, list)) else [a], b if isinstance(b, (tuple, list)) else [b]
        ):
            assert torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num()), name
