"""Weight-only quantized matrices (`--weights int8 | int4`, `kvgate.models.quant`): what they multiply
by, that a row's result does not depend on its neighbours, that the plan charges exactly what the
model holds, and (real SmolLM2) how close greedy decoding stays to the full-precision model."""

from __future__ import annotations

import pytest
import torch

from kvgate.core.placement import DeviceError, resolve_weights
from kvgate.memory.plan import matrices
from kvgate.models.quant import INT4_GROUP, Quantized, quantizable, supported

pytestmark = pytest.mark.skipif(
    supported("int4", "cpu") is not None, reason="torch lacks the int4 CPU kernel"
)
ACTS = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("act", ACTS)
def test_a_quantized_layer_multiplies_by_a_matrix_within_half_a_step_of_the_weights(fmt, act):
    """Each value is the nearest level of its row (int8) or its 32-value group (int4), and the kernel
    multiplies by exactly that matrix (up to the activation dtype's rounding). Broken by (seen red):
    int4 zero points without the kernel's `- 8` offset (every weight off by 8 steps); int8 scales of
    max/255 (values clipped to half their range)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=g) * 0.05
    b = torch.randn(96, generator=g)
    q = Quantized(fmt, w, b, act)
    d = q.dequantized()
    if fmt == "int8":
        step = w.abs().amax(dim=1, keepdim=True) / 127
    else:
        grp = w.reshape(96, -1, INT4_GROUP)
        step = ((grp.amax(2) - grp.amin(2)) / 15).repeat_interleave(INT4_GROUP, dim=1)
    rounding = 0.01 * w.abs().amax() if act == torch.bfloat16 else 1e-6
    assert ((d - w).abs() <= step / 2 + rounding).all(), (d - w).abs().max()
    x = torch.randn(5, 128, generator=g)
    ref = x @ d.t() + b
    torch.testing.assert_close(q(x), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_int4_gives_back_the_levels_of_a_q4_1_checkpoint():
    """A GGUF Q4_1 block is 32 values `q * d + m` with q in 0..15 (both ends used): re-quantized by its
    group's min and max it comes back to the same levels, up to bfloat16 rounding of d and m, far
    below the error on weights that are not on such a grid. Broken by (seen red): one range for the
    whole row instead of per 32-value group; symmetric int4 (zero point fixed at the middle)."""
    g = torch.Generator().manual_seed(1)
    d = torch.rand(64, 4, 1, generator=g) * 0.01 + 0.002
    m = torch.randn(64, 4, 1, generator=g) * 0.05
    codes = torch.randint(0, 16, (64, 4, INT4_GROUP), generator=g)
    codes[..., 0], codes[..., 1] = 0, 15
    q41 = (codes * d + m).reshape(64, 128)
    err = (Quantized("int4", q41, None, torch.float32).dequantized() - q41).abs().max()
    off_grid = q41 + torch.rand(64, 128, generator=g) * d.repeat_interleave(INT4_GROUP, 2).reshape(64, 128)
    err_off = (Quantized("int4", off_grid, None, torch.float32).dequantized() - off_grid).abs().max()
    assert err < 1e-6 and err_off > 1e-3, (err, err_off)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(fmt):
    """Batching never changes what a request generates: every row of a 1..40-row call is bit-identical
    to the same row computed alone (checked here; the kernels have no row blocking that mixes rows)."""
    g = torch.Generator().manual_seed(2)
    q = Quantized(fmt, torch.randn(192, 128, generator=g), None, torch.bfloat16)
    x = torch.randn(40, 128, generator=g)
    full = q(x)
    for rows in range(1, 41):
        assert torch.equal(q(x[:rows]), full[:rows]), rows
        assert torch.equal(q(x[rows - 1 : rows]), full[rows - 1 : rows]), rows


@pytest.fixture(scope="module")
def odd_dir(tmp_path_factory):
    """A tiny model whose hidden size (48) int4 cannot group by 32: only its down projection (in 96)
    is quantized, the rest stays full."""
    from tests.tiny_model import make_tiny_hf_dir

    geometry = dict(hidden=48, layers=2, heads=4, kv_heads=2, inter=96, max_pos=256)
    return make_tiny_hf_dir(tmp_path_factory.mktemp("odd"), geometry=geometry)


@pytest.fixture(scope="module")
def rows_dir(tmp_path_factory):
    """A tiny model whose fused gate/up matrix has 200 rows, which int4's packing refuses (it takes
    multiples of 16): that matrix stays full (its down projection too: 100 inputs)."""
    from tests.tiny_model import make_tiny_hf_dir

    geometry = dict(hidden=64, layers=2, heads=4, kv_heads=2, inter=100, max_pos=256)
    return make_tiny_hf_dir(tmp_path_factory.mktemp("rows"), geometry=geometry)


@pytest.mark.parametrize("model", ["tiny", "odd", "rows"])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("pack", ["auto", "off"])
def test_the_plan_charges_exactly_what_the_quantized_model_holds(
    model, fmt, pack, tiny_dir, odd_dir, rows_dir, make_engine
):
    """The engine refuses to start when the model holds more than the plan charged; here the two must
    be equal, and smaller than the full model. Broken by (seen red): charging the head as quantized
    (the plan came out under the model: PlanError); forgetting the scales; quantizing a matrix whose
    input size int4 cannot group (the `odd` model); asking int4 to pack 200 output rows (`rows`:
    torch raised at startup after the plan had charged them as int4). The plan names the activation
    dtype the layers use (seen red with the note naming the other dtype)."""
    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine

    path = str({"tiny": tiny_dir, "odd": odd_dir, "rows": rows_dir}[model])
    cfg = dict(kv_cache_bytes=4 << 20, memory_limit="2GiB", dtype="float32", pack_weights=pack)
    e = Engine.from_model(path, EngineConfig(weights=fmt, **cfg), overhead_bytes=0)
    full = Engine.from_model(path, EngineConfig(**cfg), overhead_bytes=0)
    try:
        assert e.model.weight_bytes == e.plan.weights_bytes
        assert e.plan.weights_bytes < full.plan.weights_bytes
        for layer in e.model.layers:
            for lin, shape in zip(layer[1:3] + layer[4:], matrices(e.spec), strict=False):
                assert type(lin).__name__ == ("Quantized" if quantizable(fmt, *shape) else "Linear"), shape
        assert type(e.model.lm_head).__name__ == "Linear"
        kinds = {type(lin).__name__ for layer in e.model.layers for lin in layer[1:3] + layer[4:]}
        assert kinds == ({"Quantized"} if model == "tiny" or fmt == "int8" else {"Quantized", "Linear"})
        # the probe's activation dtype moves the numbers, so the plan names the one the layers use
        qs = [
            lin
            for layer in e.model.layers
            for lin in layer[1:3] + layer[4:]
            if type(lin).__name__ == "Quantized"
        ]
        act = qs[0].act
        named = [n for n in e.plan.notes if n.startswith(f"{fmt} matmuls on ")]
        assert named and named[0].startswith(f"{fmt} matmuls on {str(act).removeprefix('torch.')} "), (
            e.plan.notes
        )
    finally:
        e.shutdown(), full.shutdown()


def test_a_format_that_cannot_run_is_refused_with_what_to_do():
    """A typo names the formats; a device the kernels do not serve says which flag works there."""
    with pytest.raises(DeviceError, match="full, int8, int4"):
        resolve_weights("int3", torch.device("cpu"))
    why = supported("int4", torch.device("cuda"))
    assert "CPU only" in why and "--weights full" in why
    assert resolve_weights("full", torch.device("cpu")) == ("full", None)
    assert resolve_weights("int4", torch.device("cpu"))[1] in ACTS  # measured, not assumed


# ---- the real model ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_int4_decodes_smollm2_as_the_full_model_does_within_the_stated_tolerance():
    """Tolerance, measured on the Q4_1 GGUF (layers Q4_1, embeddings Q8_0) and stated here: with
    --weights int4 (layers re-quantized to their own Q4_1 levels, activations in the probe's dtype,
    the head in float32), at least 6 of the 8 prompts give the full model's first 24 greedy tokens
    (measured: 6 of 8 for 48 tokens; one diverged at token 3 on a near-tie, one at 43), and while the
    tokens agree, the chosen token's log-probability differs by at most 0.5 (measured max printed).
    Where the startup probe picks bfloat16 activations, which round every layer's input to 8 bits of
    mantissa, at least 5 of 8 (measured on a Zen 5 EPYC, whose probe picked bfloat16: 5 of 8, max
    logprob error 0.08; and on session 40's Emerald Rapids, whose CPU lists no bf16 but whose probe
    timed it faster: 5 of 8, 0.078).
    Broken by (seen red): quantizing the LM head too (all 8 prompts diverged within 13 tokens)."""
    steps = 24
    info: dict = {}
    same, worst = greedy_agreement("int4", steps, info=info)
    # what the probe chose, not the CPU's flags: session 40's Emerald Rapids (no avx512_bf16 listed)
    # timed bfloat16 faster too, and gave 5 of 8 (max logprob error 0.078)
    need = 5 if "int4 matmuls on bfloat16 activations" in info["plan"] else 6
    print(f"\nint4 vs full: {same}/8 prompts identical for {steps} tokens; max logprob error {worst:.4f}")
    assert same >= need and worst <= 0.5, (same, need, worst)


def greedy_agreement(fmt: str, steps: int, info: dict | None = None, **extra) -> tuple[int, float]:
    """SmolLM2 under `--weights fmt` (and any other `EngineConfig` fields in `extra`) against
    `--weights full` on the 8 real prompts, greedy: how many prompts give full's first `steps` tokens,
    and the largest difference of the chosen token's log-probability while the tokens agree."""
    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine
    from kvgate.request import GenerationRequest, Token
    from kvgate.sampling import SamplingParams
    from tests.test_real_batching import PROMPTS

    runs = {}
    ref = {"weights": "full", "kv_dtype": "float32"}  # the float32 cache: what each format is held to
    for name, more in (("ref", ref), ("got", {"weights": fmt, "kv_dtype": "float32", **extra})):
        # overhead 0: a tolerance test, not a memory one; the overhead measured inside a long pytest process
        # is that process's RSS (1.5 GiB in session 47's clean-clone run, after the model-family tests),
        # which put the plan over its 2 GiB limit
        cfg = EngineConfig(memory_limit="2GiB", dtype="float32", **more)
        e = Engine.from_model("default", cfg, overhead_bytes=0)
        e.start()
        try:
            out = []
            for p in PROMPTS:
                sp = SamplingParams(temperature=0, logprobs=0)
                h = e.submit(GenerationRequest(e.tokenizer.encode(p), sp, steps, ignore_eos=True))
                out.append([(ev.token_id, ev.logprobs.logprob) for ev in h if isinstance(ev, Token)])
            runs[name] = out
            if info is not None and name == "got":  # the plan's notes say what its probes chose
                info["plan"] = e.plan.describe(None)
        finally:
            e.shutdown()
    same, worst = 0, 0.0
    for ref, got in zip(runs["ref"], runs["got"], strict=True):
        assert len(ref) == len(got) == steps
        agree = next((i for i, (a, b) in enumerate(zip(ref, got)) if a[0] != b[0]), steps)
        same += agree == steps
        worst = max([worst] + [abs(a[1] - b[1]) for a, b in zip(ref[:agree], got[:agree])])
    return same, worst
