"""The decode-only layer stack in one C++ call (kvgate/models/decode_stack.py, csrc/decode_stack.cpp):
for `--weights gguf` and `gguf-q8act` a decode-only step's logits and K/V writes are bit for bit the
Python loop's, the stack runs exactly for decode-only steps, and models it cannot run (float weights,
the gather attention path) keep the loop. Skipped, saying why, only where the C++ kernels cannot be built."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvgate.models import kv_int8, native

pytestmark = pytest.mark.skipif(
    native.extension() is None, reason=f"kvgate's C++ kernels did not build: {native.unavailable()}"
)
BS = 4


@pytest.fixture(scope="module")
def q4_smol_dir(tmp_path_factory):
    """A tiny model with SmolLM2's head geometry (9 heads over 3 KV heads of 64) whose layer matrices
    are exact Q4_1 blocks, as a Q4_1 GGUF holds them."""
    from tests.test_q4_1 import ggml_q4_1
    from tests.tiny_model import make_tiny_hf_dir

    geometry = dict(hidden=576, heads=9, kv_heads=3, inter=256)
    path = make_tiny_hf_dir(tmp_path_factory.mktemp("q4-smol"), tie=True, geometry=geometry)
    w = load_file(str(path / "model.safetensors"))
    for name in [n for n in w if n.endswith("proj.weight")]:
        w[name] = ggml_q4_1(w[name]).contiguous()
    save_file(w, str(path / "model.safetensors"))
    return path


def model_and_pool(path, fmt: str, kv_dtype=torch.float32):
    from kvgate.core.kv_cache import KVPool
    from kvgate.models import load_model
    from kvgate.models.llama import LlamaModel

    loaded = load_model(str(path))
    model = LlamaModel(
        loaded.spec, loaded.weights, torch.float32, "cpu", weights_format=fmt, paged_attention=True,
        block_scales=loaded.block_scales,
    )  # fmt: skip
    kv = KVPool(loaded.spec, 300, BS, kv_dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for pool, scales in ((kv.k, kv.k_scale), (kv.v, kv.v_scale)):
        if scales is None:
            pool.copy_(torch.randn(pool.shape, generator=gen))
        else:  # --kv-dtype int8: codes and their scales
            codes, s = kv_int8.quantize(torch.randn(pool.shape, generator=gen))
            pool.copy_(codes), scales.copy_(s)
    return model, kv


def assert_stack_is_loop(model, kv) -> None:
    """1 and 7 decode rows at contexts 3-40 (several blocks, partial last blocks): the stack's logits
    and the K/V it writes equal the Python loop's exactly."""
    from kvgate.core.step_inputs import DecodeInput

    stack = model.decode_stack
    rows = [DecodeInput(i, 7 + 5 * i, 3 + 6 * i, list(range(i * 12, i * 12 + 12))) for i in range(7)]
    for decodes in ([rows[4]], rows):
        with_stack = step(model, kv, decodes)
        model.decode_stack = None
        loop = step(model, kv, decodes)
        model.decode_stack = stack
        assert torch.equal(with_stack[0], loop[0])
        assert all(torch.equal(a, b) for a, b in zip(with_stack[1], loop[1], strict=True))


def assert_team_is_ops_and_loop(model, kv, decodes) -> None:
    """One decode-only step ran on the stack's thread team, and its logits and K/V writes equal the
    op-by-op stack's and the Python loop's exactly."""
    stack = model.decode_stack
    ran = stack.team_steps()
    team = step(model, kv, decodes)
    assert stack.team_steps() == ran + 1, "the step did not run on the team"
    stack.set_team(False)
    ops = step(model, kv, decodes)
    stack.set_team(True)
    model.decode_stack = None
    loop = step(model, kv, decodes)
    model.decode_stack = stack
    for other in (ops, loop):
        assert torch.equal(team[0], other[0])
        assert all(torch.equal(a, b) for a, b in zip(team[1], other[1], strict=True))


def step(model, kv, decodes, prefills=()):
    """One forward; the logits and the pools as it left them (the pools are restored afterwards)."""
    from kvgate.core.step_inputs import build_step

    pools = [t for t in (kv.k, kv.v, kv.k_scale, kv.v_scale) if t is not None]
    before = [t.clone() for t in pools]
    batch, _, _, _ = build_step(list(decodes), list(prefills), BS, 4096, torch.device("cpu"))
    logits = model.forward(batch, kv)
    after = tuple(t.clone() for t in pools)
    for t, t0 in zip(pools, before, strict=True):
        t.copy_(t0)
    return logits, after


@pytest.mark.parametrize(
    "fmt,kv_dtype",
    [
        ("gguf", torch.float32),
        ("gguf-q8act", torch.float32),
        ("gguf-q8act", torch.float16),
        ("gguf", torch.int8),
    ],
)
def test_a_decode_only_step_is_the_python_loop_bit_for_bit(q4_smol_dir, fmt, kv_dtype):
    """1 and 7 decode rows at contexts 3-40 (several blocks, partial last blocks): the stack's logits
    and the K/V it writes (an int8 cache's scales too) equal the Python loop's exactly. Seen red: the
    stack returning x without the last layer's down projection added; the team writing an int8 cache
    with the scales of the layer before (`ksl` one layer behind)."""
    model, kv = model_and_pool(q4_smol_dir, fmt, kv_dtype)
    stack = model.decode_stack
    assert stack is not None and stack.layers() == len(model.layers)
    assert_stack_is_loop(model, kv)


class Refuses:
    """A stand-in stack that fails the test if the forward calls it."""

    def run(self, *args):
        raise AssertionError("the stack ran for a step with a prompt chunk")


def test_steps_with_a_prompt_chunk_keep_the_loop(q4_smol_dir):
    """A step holding a prompt chunk (alone, or beside decode rows) never goes to the stack; a
    decode-only step does. Seen red: the forward's condition as `n_dec > 0` instead of `n_dec == T`."""
    from kvgate.core.step_inputs import DecodeInput, PrefillInput

    model, kv = model_and_pool(q4_smol_dir, "gguf-q8act")
    stack, calls = model.decode_stack, []

    class Counting:
        def run(self, *args):
            calls.append(len(args[0]))
            return stack.run(*args)

    row = DecodeInput(0, 9, 10, [0, 1, 2])
    prompt = PrefillInput(1, list(range(20, 29)), 0, [3, 4, 5], True)
    model.decode_stack = Refuses()
    step(model, kv, [row], [prompt])
    step(model, kv, [], [prompt])
    model.decode_stack = Counting()
    step(model, kv, [row, DecodeInput(2, 9, 7, [6, 7])])
    assert calls == [2]


def test_models_the_stack_cannot_run_keep_the_loop(q4_smol_dir, tiny_dir, monkeypatch):
    """Float weights (`full`), the gather attention path and the environment switch each leave
    `decode_stack` None. Seen red: `build` without its paged-attention check."""
    from kvgate.models import decode_stack, load_model
    from kvgate.models.llama import LlamaModel

    loaded = load_model(str(tiny_dir))
    full = LlamaModel(loaded.spec, loaded.weights, torch.float32, "cpu", paged_attention=True)
    assert full.decode_stack is None
    model, _ = model_and_pool(q4_smol_dir, "gguf")
    model.paged_attention = False
    assert decode_stack.build(model) is None
    model.paged_attention = True
    assert decode_stack.build(model) is not None
    monkeypatch.setenv(decode_stack.ENV, "0")
    assert decode_stack.build(model) is None


@pytest.mark.parametrize(
    "fmt,kv_dtype,threads",
    [
        ("gguf", torch.float32, 1),
        ("gguf", torch.float16, 2),
        ("gguf", torch.bfloat16, 3),
        ("gguf", torch.float32, 3),
        ("gguf-q8act", torch.float16, 2),
        ("gguf-q8act", torch.bfloat16, 1),
        ("gguf-q8act", torch.float32, 3),
        ("gguf", torch.int8, 2),
        ("gguf-q8act", torch.int8, 3),
    ],
)
def test_the_thread_team_is_the_op_by_op_stack_bit_for_bit(q4_smol_dir, fmt, kv_dtype, threads):
    """`--weights gguf` and `gguf-q8act` run decode-only steps on the stack's thread team (one parallel
    region for all layers); its logits and K/V writes equal the op-by-op stack's and the Python loop's
    exactly, with fewer rows than threads (every thread does every row on its own copy) and more (rows
    split, shared buffers), on 1-3 threads, over float32, float16, bfloat16 and int8 pools, with contexts of
    one attention chunk and of several (up to 290 positions). gguf-q8act runs with the AVX-512 VNNI
    kernels where the build has them (pairs of tiles from 5 rows, and at 1-4 rows under either setting
    of the few-row switch, kvgate.models.q8act_rows) and again with the AVX2 tiles only. gguf runs, where
    AMX's int8 tiles are built and granted, with them at no row count, every one and from 3 rows
    (kvgate.models.amx_rows). `team_steps` confirms each step ran on the team.
    Seen red (with the other gguf case above): the team's post-attention norm taken before the
    o-projection's output was added to the residual; for gguf-q8act, the team's rounding writing each
    block's scale where its code sum belongs and the sum where the scale does."""
    from kvgate.core.step_inputs import DecodeInput

    ext = native.extension()
    model, kv = model_and_pool(q4_smol_dir, fmt, kv_dtype)
    stack = model.decode_stack
    assert stack.team(), f"a {fmt} stack should run on its thread team"
    rows = [DecodeInput(i, 7 + 5 * i, 3 + 6 * i, list(range(i * 12, i * 12 + 12))) for i in range(7)]
    rows += [DecodeInput(7, 11, 290, list(range(100, 173))), DecodeInput(8, 12, 140, list(range(180, 216)))]
    many = [DecodeInput(i, 3 + i, 3 + 2 * i, list(range(i * 14, i * 14 + 14))) for i in range(20)]  # 16 + 4
    isas = ["avx2", "auto"] if fmt == "gguf-q8act" and ext.int8_isa() != "scalar" else [None]
    was, was_isa, was_small = torch.get_num_threads(), ext.int8_isa(), ext.int8_small_rows()
    was_amx = ext.q4_1_amx_rows()
    tiles = fmt == "gguf" and ext.q4_1_amx_built() and ext.amx_unavailable() == ""
    torch.set_num_threads(threads)
    try:
        for isa in isas:
            if isa is not None:
                ext.set_int8_isa(isa)
            vnni = isa == "auto" and ext.int8_isa() == "avx512-vnni"
            for small in (0, 0b11110) if vnni else (was_small,):
                ext.set_int8_small_rows(small)
                for amx in (0, 1, 3) if tiles else (was_amx,):  # AMX int8 tiles: never, always, from 3 rows
                    ext.set_q4_1_amx_rows(amx)
                    for decodes in ([rows[4]], [rows[7]], rows[:2], rows[6:9], rows) + (
                        (many,) if amx else ()
                    ):
                        assert_team_is_ops_and_loop(model, kv, decodes)
    finally:
        torch.set_num_threads(was)
        ext.set_int8_small_rows(was_small)
        ext.set_q4_1_amx_rows(was_amx)
        if was_isa != "scalar":
            ext.set_int8_isa(was_isa)


def test_what_the_team_does_not_take_runs_op_by_op(q4_smol_dir, monkeypatch):
    """The float decode loop (`set_q4_1_decode("float")`) is not the team's: its steps run op by op,
    still the loop's bits; KVGATE_DECODE_TEAM=0 turns the team off. Seen red: `run` sending
    float-decode steps to the team (its tiles are the int24 kernel's)."""
    from kvgate.core.step_inputs import DecodeInput
    from kvgate.models import decode_stack

    ext = native.extension()
    model, kv = model_and_pool(q4_smol_dir, "gguf")
    rows = [DecodeInput(i, 7 + 5 * i, 3 + 6 * i, list(range(i * 12, i * 12 + 12))) for i in range(3)]
    was = ext.q4_1_decode()
    ext.set_q4_1_decode("float")
    try:
        with_stack = step(model, kv, rows)
        stack, model.decode_stack = model.decode_stack, None
        loop = step(model, kv, rows)
        model.decode_stack = stack
    finally:
        ext.set_q4_1_decode("int24" if was.startswith("int24") else "float")
    assert torch.equal(with_stack[0], loop[0])
    monkeypatch.setenv(decode_stack.TEAM_ENV, "0")
    assert not decode_stack.build(model).team()


@pytest.mark.parametrize(
    "types,weight_type,threads",
    [
        ("q4_k_m", "Q4_K", 1),
        ("q4_k_m", "Q4_K", 2),
        ("q4_k_m", "Q5_K", 3),
        ("q8_0", "Q8_0", 2),
        ("q4_k_m", "Q4_1", 2),
    ],
)
def test_a_k_quant_models_stack_runs_its_block_tiles_on_the_team_as_the_loop(
    tmp_path, monkeypatch, types, weight_type, threads
):
    """A Q4_K_M-like GGUF (q4f, q8d and q8s tiles, `BlockLinear`), its Q5_K_M form (q5f), a Q8_0 file,
    and Q4_1 layers beside the recipe's Q6_K ones (Q4_1 tiles and block tiles in one stack): the stack
    takes their matrices on its thread team (Q4F on the 24-bit integer decode rows, the other formats on their float loop, one
    parallel region for a mix), and its logits and K/V writes equal the op-by-op stack's and the Python
    loop's bit for bit, with fewer rows than threads and more (where AMX's int8 tiles are built, with Q4F's
    decode rows on them and off). Seen red with `_parts` refusing
    BlockLinear (no stack: the loop), and with the team's float formats given Q4F's block sums (one a
    block, where Q8S takes one a half block and Q5F its own: 4 of 5 cases red)."""
    from kvgate.core.step_inputs import DecodeInput
    from kvgate.models.block_formats import BlockLinear
    from tests.test_block_formats import Q4_K_M, write_gguf

    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path / "cache"))
    overrides = Q4_K_M if types == "q4_k_m" else {"token_embd.weight": "Q8_0"}
    model, kv = model_and_pool(write_gguf(tmp_path / "kq.gguf", overrides, weight_type), "gguf")
    assert any(isinstance(lin, BlockLinear) for layer in model.layers for lin in layer)
    stack = model.decode_stack
    assert stack is not None and stack.team(), "a block-format stack should run on its thread team"
    rows = [DecodeInput(i, 7 + 5 * i, 3 + 6 * i, list(range(i * 12, i * 12 + 12))) for i in range(7)]
    was, was_amx = torch.get_num_threads(), native.extension().q4_1_amx_rows()
    tiles = native.extension().q4_1_amx_built() and native.extension().amx_unavailable() == ""
    torch.set_num_threads(threads)
    try:
        for amx in (0, 1) if tiles else (was_amx,):  # Q4F decode rows on AMX's int8 tiles too (amx_rows)
            native.extension().set_q4_1_amx_rows(amx)
            for decodes in ([rows[4]], rows[:2], rows):
                assert_team_is_ops_and_loop(model, kv, decodes)
    finally:
        torch.set_num_threads(was)
        native.extension().set_q4_1_amx_rows(was_amx)


@pytest.fixture(scope="module")
def q4_qwen3_dir(tmp_path_factory):
    """A tiny Qwen3 (per-head q/k RMSNorm, head_dim 32 over a 64-wide hidden state) whose layer matrices
    are exact Q4_1 blocks."""
    from tests.test_model_families import hf_model
    from tests.test_q4_1 import ggml_q4_1
    from tests.tiny_model import save_hf_dir

    path = save_hf_dir(hf_model("qwen3", {"rope_type": "default"}), tmp_path_factory.mktemp("q4-qwen3"))
    w = load_file(str(path / "model.safetensors"))
    for name in [n for n in w if n.endswith("proj.weight")]:
        w[name] = ggml_q4_1(w[name]).contiguous()
    save_file(w, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("fmt", ["gguf", "gguf-q8act"])
def test_a_qwen3_decode_step_on_the_stack_and_its_team_is_the_loop_bit_for_bit(q4_qwen3_dir, fmt):
    """The stack runs Qwen3's q/k head norms (`set_qk_norms`) with the loop's row function: logits and
    K/V writes equal the Python loop's exactly, op by op and on the team. Seen red: the team's norm
    left out (logits differ), and the loop's norm as F.rms_norm instead of `qk_norm_` (an ulp apart)."""
    from kvgate.core.step_inputs import DecodeInput

    model, kv = model_and_pool(q4_qwen3_dir, fmt)
    assert model.decode_stack is not None and model.qk_norms is not None
    assert_stack_is_loop(model, kv)
    rows = [DecodeInput(i, 7 + 5 * i, 3 + 6 * i, list(range(i * 12, i * 12 + 12))) for i in range(3)]
    assert_team_is_ops_and_loop(model, kv, rows)
