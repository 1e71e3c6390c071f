"""The startup memory plan: `--memory-limit` parsing, the arithmetic a user can check by hand, refusal
of a model that cannot fit, shrunk step limits the engine then obeys, and `kvgate plan` agreeing with
the engine's own plan.

The SmolLM2-135M arithmetic is written out by hand from its geometry (30 layers, 9 query heads, 3 KV
heads, head_dim 64, hidden 576, intermediate 1536, vocab 49152, context 8192, tied embeddings), so a
change to any formula shows up as a number that no longer matches.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvgate.config import EngineConfig, ModelSpec
from kvgate.memory import limit as LIM
from kvgate.memory import plan as P
from kvgate.memory import workspace as W
from kvgate.memory.overhead import OVERHEAD_DRIFT, OVERHEAD_SLACK
from kvgate.memory.plan import PlanError, make_plan, resolve_limit
from kvgate.models.linear import packs_weights
from kvgate.units import parse_bytes

ROOT = Path(__file__).resolve().parents[1]
CLI = "import sys; from kvgate.cli import main; sys.exit(main(sys.argv[1:]))"
MiB, GiB = 1 << 20, 1 << 30

SMOLLM2 = ModelSpec(
    architecture="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    name="SmolLM2-135M",
)
# By hand: embed 49152x576 = 28,311,552; per layer qkv 576x960 = 552,960, o 576x576 = 331,776,
# gate/up/down 3x576x1536 = 2,654,208, two norms 1,152 -> 3,540,096 x 30 = 106,202,880; final norm 576:
# 134,515,008 parameters; rope tables 2 x 8192 x 64 = 1,048,576 values.
SMOLLM2_VALUES = 134_515_008 + 1_048_576


def smollm2_plan(limit="4GiB", dtype_bytes=2, overhead=300 * MiB, **kw):
    args = dict(block_size=16, prefill_chunk=256, max_seqs=32, max_model_len=8192)
    args.update(kw)
    return make_plan(
        SMOLLM2,
        device="cpu",
        dtype_name={2: "bfloat16", 4: "float32"}[dtype_bytes],
        dtype_bytes=dtype_bytes,
        limit_spec=limit,
        overhead_bytes=overhead,
        **args,
    )


# ---- --memory-limit ------------------------------------------------------------------------------
@pytest.fixture
def fixed_memory(monkeypatch):
    """16 GiB total, 10 GiB available: resolve_limit's arithmetic without reading this host."""
    monkeypatch.setattr(LIM, "device_memory", lambda device: (16 * GiB, 10 * GiB))


@pytest.mark.parametrize(
    "text, expected",
    [
        ("4GiB", 4 * GiB),
        ("512MiB", 512 * MiB),
        ("1.5GiB", 3 * GiB // 2),
        ("2000000000", 2_000_000_000),
        ("4GB", 4 * 10**9),
    ],
)
def test_memory_limit_sizes(fixed_memory, text, expected):
    """Broken by: a wrong unit table entry (e.g. GiB = 10**9) or a size read as a fraction."""
    assert parse_bytes(text) == expected
    assert resolve_limit(text, "cpu") == (expected, "explicit")


def test_memory_limit_fraction_and_auto(fixed_memory):
    """A fraction is of the device's total memory; `auto` on CPU is AUTO_CPU_SHARE (documented: a
    quarter) of MemAvailable at startup, and says so. Broken by: a fraction of available memory, or
    auto taking total memory / another share."""
    assert LIM.AUTO_CPU_SHARE == 0.25
    assert resolve_limit("0.5", "cpu") == (8 * GiB, "50% of 16.0 GiB device memory")
    assert resolve_limit("1", "cpu")[0] == 16 * GiB
    limit, source = resolve_limit("auto", "cpu")
    assert limit == int(10 * GiB * 0.25)
    assert "25%" in source and "available RAM" in source and "10.0 GiB" in source


@pytest.mark.parametrize("text", ["lots", "4 gigs", "-1", "", "0", "0.0", "1.5", "2."])
def test_memory_limit_garbage_says_what_to_write(fixed_memory, text):
    """Broken by: `1.5` read as 1 byte, `0` accepted (the ledger would then fail with a bare
    ValueError), or a message that does not show a valid spelling."""
    with pytest.raises(PlanError) as ei:
        resolve_limit(text, "cpu")
    msg = str(ei.value)
    assert "--memory-limit" in msg and "4GiB" in msg and "0.5" in msg and "auto" in msg


# ---- the arithmetic, by hand ------------------------------------------------------------------------
def test_kv_bytes_per_token_smollm2():
    """2 x 30 layers x 3 KV heads x 64 x bytes. Broken by: forgetting the 2 (K and V) or using q heads."""
    assert SMOLLM2.kv_bytes_per_token(2) == 23_040
    assert SMOLLM2.kv_bytes_per_token(4) == 46_080


def test_weights_smollm2_by_hand():
    """Broken by: counting the tied lm_head twice, or dropping the rope tables."""
    assert P.weight_bytes(SMOLLM2, 2) == SMOLLM2_VALUES * 2 == 271_127_168
    assert P.weight_bytes(SMOLLM2, 4) == SMOLLM2_VALUES * 4


@pytest.mark.parametrize("dtype_bytes, per_token", [(2, 23_040), (4, 46_080)])
def test_blocks_and_concurrency_by_hand(dtype_bytes, per_token):
    """blocks = floor((limit - weights - workspace - overhead - logprobs) / (bytes_per_token x block_size)), and
    "max concurrent requests at N tokens each" = blocks // ceil(N / block_size).
    Broken by: rounding the block count up (the pool would exceed the limit), a pool that is not
    blocks x block bytes, or concurrency counted in tokens rather than whole blocks. The count is at most
    --max-seqs (32 here), which 8192-token requests stay under."""
    plan = smollm2_plan("4GiB", dtype_bytes)
    assert plan.logprobs_bytes == 32 * MiB  # --logprobs-memory auto: a 16th of the limit, at most 32 MiB
    room = 4 * GiB - SMOLLM2_VALUES * dtype_bytes - 300 * MiB - 32 * MiB - plan.workspace_bytes
    assert plan.kv_bytes_per_token == per_token
    assert plan.kv_blocks == room // (per_token * 16)
    assert plan.kv_pool_bytes == plan.kv_blocks * per_token * 16 <= room
    assert plan.kv_positions == plan.kv_blocks * 16
    for n in (1, 16, 17, 1024, 8192):
        assert plan.max_concurrent(n) == min(32, plan.kv_blocks // math.ceil(n / 16))
    assert plan.max_concurrent(8192) == plan.kv_blocks // 512 < 32
    d = plan.to_dict(8192)
    assert d["max_concurrent_requests_at_context"] == plan.kv_blocks // 512
    text = plan.describe(8192)
    assert f"max concurrent requests at 8192 tokens each: {plan.kv_blocks // 512}" in text
    assert f"{per_token:,} B/token" in text


def test_workspace_terms_cover_the_tensors_they_name():
    """Each term is at least the tensors a step really makes (float32 logits of every row, float32
    attention mask and output of a prefill chunk at full context (its scores off CPU), gathered K and V of a decode group, the
    per-layer activations), and the total is the standing terms plus the largest transient.
    Broken by: under-counting a term (e.g. logits x 0) or summing a wrong set."""
    plan = smollm2_plan("4GiB", 4, max_model_len=1024)
    L, bd = plan.limits, plan.workspace_breakdown
    T, S, C = L.prefill_chunk + L.max_seqs, L.max_seqs, L.prefill_chunk
    assert bd["logits"] >= S * 49152 * 4
    # on CPU SDPA's fused kernel makes no scores: the float mask it makes of the bool one, the output
    assert L.flash_prefill and bd["prefill_attention"] >= C * 1024 * 4 + C * 9 * 64 * 4
    # elsewhere (CUDA, a masked chunk with grouped heads) the math path's scores and softmax, float32
    assert W._prefill_attention(C, 1024, 9, 3, 64, 4, 3 * 64 * 4, flash=False) >= 2 * 9 * C * 1024 * 4
    assert bd["layer_activations"] >= 2 * L.attn_token_cap * 3 * 64 * 4 + T * (2 * 576 + 960 + 2 * 1536) * 4
    assert bd["mlp"] >= 2 * T * 1536 * 4
    # penalties' seen-mask and counts, allowed_token_ids' bitmask, bad_words' ids and tail
    assert bd["penalty_state"] == S * (49152 * 5 + 49152 // 8 + 1 + W.BAD_WORDS_BYTES)
    standing = sum(bd[k] for k in W.STANDING_TERMS)
    assert plan.workspace_bytes == standing + max(bd[k] for k in W.TRANSIENT_TERMS)
    assert set(bd) == set(W.STANDING_TERMS) | set(W.TRANSIENT_TERMS)


def test_attention_cap_never_below_one_padded_row():
    """A decode group is padded to whole blocks: with a context that is not a block multiple the cap
    must still hold one full row. Broken by: cap = max_model_len (1000 < 1008 gathered)."""
    assert W.attn_cap(1, 1000, 16) == 1008
    assert W.attn_cap(4, 64, 16) == 4 * 64  # never more than every row at full context
    assert W.attn_cap(32, 8192, 16) == 32 * 512


# ---- refusal and shrinking ----------------------------------------------------------------------------
def test_model_that_cannot_fit_is_refused_with_the_numbers():
    """Weights 517.1 MiB (fp32) + 100 MiB overhead cannot fit in 600 MiB. Broken by: dropping the
    check (the plan would go on with a negative room) or a message without the numbers and the fix."""
    with pytest.raises(PlanError) as ei:
        smollm2_plan("600MiB", 4, overhead=100 * MiB)
    msg = str(ei.value)
    assert "weights 517.1 MiB" in msg and "overhead 100.0 MiB" in msg and "limit 600.0 MiB" in msg
    assert "Raise --memory-limit to at least" in msg and "--dtype" in msg


def test_the_advised_limit_fits_a_server_whose_overhead_measures_a_little_more():
    """QA pass 6: `kvgate plan` advised "at least 663MiB" and a server started with it measured 0.5 MiB
    more overhead and refused to load ("663.5 MiB > limit 663.0 MiB"). The advice now adds
    OVERHEAD_DRIFT, what the measurement moves between processes. Seen red with the advice at the
    exact need: the limit it named did not fit an overhead 1 MiB higher."""
    with pytest.raises(PlanError) as ei:
        smollm2_plan("600MiB", 4, overhead=100 * MiB, max_seqs=2)
    advised = re.search(r"at least (\d+)MiB", str(ei.value)).group(1)
    smollm2_plan(f"{advised}MiB", 4, overhead=100 * MiB + OVERHEAD_DRIFT - MiB, max_seqs=2)


def test_a_load_peak_over_the_limit_is_said_with_the_numbers():
    """QA pass 6 (HIGH, the memory contract): loading SmolLM2 under --memory-limit 720MiB peaked at
    1,074 MiB resident before the ledger existed, and nothing said so. The peak is now measured and
    an operator told when it is over the limit, with what to give a container. Seen red with the
    comparison reversed (no warning over the limit)."""
    from kvgate.memory.overhead import load_peak_warning, process_peak_rss_bytes

    peak = process_peak_rss_bytes()
    assert peak is not None and peak > 0  # this test process has a resident peak
    said = load_peak_warning(900 * MiB, 720 * MiB, "cpu")
    assert "900 MiB" in said and "--memory-limit 720 MiB" in said and "at least 900 MiB" in said
    assert load_peak_warning(700 * MiB, 720 * MiB, "cpu") is None
    assert load_peak_warning(900 * MiB, 720 * MiB, "cuda:0") is None  # the ledger counts device memory there


def test_tight_limit_shrinks_the_step_and_says_so():
    """A limit that fits the weights but not the requested step workspace halves the prefill chunk
    (then the rows) until one minimum request fits, and notes it. Broken by: removing the shrink loop
    (PlanError or a negative KV room) or shrinking silently."""
    full = smollm2_plan("4GiB", 4, max_model_len=1024)
    fixed = full.weights_bytes + full.overhead_bytes
    min_kv = P.MIN_KV_POSITIONS * full.kv_bytes_per_token
    limit = fixed + min_kv + full.workspace_bytes * 3 // 4  # // 2 before the grammar slots (session 38)
    plan = smollm2_plan(str(limit), 4, max_model_len=1024)
    assert plan.limits.prefill_chunk < 256 or plan.limits.max_seqs < 32
    assert any("step limits shrunk" in n for n in plan.notes)
    assert fixed + plan.workspace_bytes + plan.kv_pool_bytes <= limit
    assert plan.kv_positions >= P.MIN_KV_POSITIONS


def test_the_shrink_halves_the_larger_consumer_first():
    """With --speculate 4 every row brings 5 logits rows, so at 800 MiB the rows' logits are the bulk
    of the step: the rows are halved and the prefill chunk keeps its 256 tokens, and the note names
    only what changed. Session 30's QA saw chunk 256 -> 16 (prefill 16x slower) with rows 32 -> 16
    anyway, as the loop always halved the chunk first. Red with that order back (session 38: chunk 16)."""
    # at 700 MiB since session 38's grammar slots (4 kept, not one per row: 800 MiB no longer shrinks)
    plan = smollm2_plan("700MiB", 2, max_model_len=8192, speculate=4)  # bf16, 300 MiB overhead
    assert (plan.limits.prefill_chunk, plan.limits.max_seqs) == (256, 4)
    assert any(n == "step limits shrunk to fit the limit: max rows 32 -> 4" for n in plan.notes), plan.notes


def test_small_pool_plans_attention_for_the_pool_not_the_context():
    """When the pool holds fewer positions than the context, attention is planned for the pool (no
    row can outgrow it) and the plan says so; the planned context is never below what the pool holds.
    Broken by: planning for a context shorter than the pool (under-count)."""
    # 436 before issue 13's grammar term (~40 MiB), 400 before the logprobs memory (32 MiB at 1 GiB)
    plan = smollm2_plan("1GiB", 4, overhead=368 * MiB)
    assert plan.limits.attn_context is not None
    assert plan.kv_positions <= plan.limits.context < 8192
    assert any("attention is planned for rows of at most" in n for n in plan.notes)


@pytest.fixture(scope="module")
def default_model_cache():
    """The default GGUF converted once, in a child process (its freed heap stays out of ours)."""
    from tests.memory_probe import warm_conversion_cache

    warm_conversion_cache("default")


@pytest.fixture(scope="module")
def tiny_spec(tiny_dir):
    from kvgate.models import load_model

    return load_model(str(tiny_dir)).spec


def test_engine_refuses_a_model_that_cannot_fit_before_loading_it(tiny_dir):
    """Engine construction raises PlanError (not an OOM, not a half-built engine) when the weights
    alone exceed the limit. Broken by: materializing the model before planning."""
    from kvgate.core.engine import Engine

    with pytest.raises(PlanError) as ei:
        Engine.from_model(
            str(tiny_dir), EngineConfig(memory_limit="64KiB", dtype="float32", device="cpu"), overhead_bytes=0
        )
    assert "weights" in str(ei.value) and "limit 64.0 KiB" in str(ei.value)


def test_engine_obeys_shrunk_step_limits(tiny_dir, tiny_spec, make_engine):
    """The scheduler runs with the plan's shrunk prefill chunk and rows, not the configured ones: a
    prompt of 40 tokens takes ceil(40 / chunk) prefill steps. Broken by: Engine passing
    cfg.prefill_chunk / cfg.max_seqs to the scheduler."""
    kw = dict(block_size=16, prefill_chunk=64, max_seqs=8, max_model_len=512)
    kw["packed_weights"] = packs_weights("cpu", torch.float32)  # as the engine decides (float32 on CPU)
    full = make_plan(
        tiny_spec,
        device="cpu",
        dtype_name="float32",
        dtype_bytes=4,
        limit_spec="1GiB",
        overhead_bytes=0,
        **kw,
    )
    min_kv = P.MIN_KV_POSITIONS * full.kv_bytes_per_token
    small = W.StepLimits(
        16,
        1,
        W.attn_cap(1, 512),
        512,
        packed_weights=kw["packed_weights"],
        padded_rows=True,
        flash_prefill=True,
    )
    lo = full.weights_bytes + min_kv + W.workspace_bytes(tiny_spec, 4, small)
    limit = lo + (full.weights_bytes + min_kv + full.workspace_bytes - lo) // 3
    plan = make_plan(
        tiny_spec,
        device="cpu",
        dtype_name="float32",
        dtype_bytes=4,
        limit_spec=str(limit),
        overhead_bytes=0,
        **kw,
    )
    assert (plan.limits.prefill_chunk, plan.limits.max_seqs) < (64, 8) and plan.notes
    engine = make_engine(  # a float32 KV cache, as the plans above (auto would be float16 on a CPU)
        memory_limit=str(limit),
        block_size=16,
        prefill_chunk=64,
        max_seqs=8,
        max_model_len=512,
        kv_dtype="float32",
    )
    assert engine.plan.limits == plan.limits
    assert engine.sched_cfg.prefill_chunk == plan.limits.prefill_chunk
    assert engine.sched_cfg.max_seqs == plan.limits.max_seqs
    assert engine.runner.attn_token_cap == plan.limits.attn_token_cap
    from kvgate.request import GenerationRequest
    from kvgate.sampling import SamplingParams

    r = engine.generate(
        GenerationRequest(list(range(10, 50)), SamplingParams(temperature=0), max_tokens=1), timeout=60
    )
    assert r.finish_reason == "length"
    assert engine.snapshot().counters.prefill_chunks == math.ceil(40 / plan.limits.prefill_chunk)
    assert engine.ledger.by_role()["workspace"] == plan.workspace_bytes
    assert engine.ledger.reserved <= plan.limit_bytes


# ---- `kvgate plan` agrees with the engine -------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("cache", ["warm", "cold"])
def test_loading_the_default_model_stays_under_a_tight_limit(default_model_cache, tmp_path, cache):
    """QA pass 6 (HIGH for the memory contract): under --memory-limit 720MiB, loading SmolLM2 peaked at
    1,046-1,074 MiB resident before the ledger existed (the float checkpoint held while it was packed,
    and the Q8 table checked whole), and a first start (the GGUF converted, a cold cache) 1,065 MiB.
    `kvgate plan` loads and places the model as serve does and reports its peak. Seen red with the
    eager checkpoint (836 MiB), the whole-table check (1,046 MiB) and the one-piece conversion (cold:
    1,065 MiB).

    The limit was 720 MiB until session 46, when the plan itself stopped fitting there in one launch
    mode: run as `python -c` with no bytecode cache (PYTHONDONTWRITEBYTECODE, as on these machines),
    the measured runtime overhead came out 542-547 MiB instead of 526 (the load thread took a malloc
    arena of its own while the main thread compiled the server's modules; with MALLOC_ARENA_MAX=1 or
    the bytecode cached, 522-528), and 720 MiB had left 10.8 MiB over the plan. 740 MiB keeps this test
    about the load peak: every peak it was red with is above it. Session 49: 760 MiB. The cold case's
    overhead measured 548-553 MiB alone at both session 48's and 49's commits (a 6 MiB margin under 740),
    and 564.8 MiB in a clean-clone run beside other builds on the 2 cores: the plan, not the peak,
    failed. The red peaks are still all above 760."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if cache == "cold":
        env["KVGATE_CACHE_DIR"] = str(tmp_path / "cache")
    out = subprocess.run(
        [sys.executable, "-c", CLI, "plan", "--model", "default", "--memory-limit", "760MiB", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    cli = json.loads(out.stdout)
    peak, limit = cli["load_peak_rss_bytes"], cli["limit_bytes"]
    assert peak < limit, (peak >> 20, limit >> 20)


@pytest.mark.slow
def test_cli_plan_json_equals_engine_plan(default_model_cache):
    """`kvgate plan --model default --memory-limit 1280MiB --context 1024 --json` (a subprocess) prints the
    numbers the engine plans for the same flags. The runtime overhead is measured (process RSS), so the
    engine is given the CLI's measured overhead and everything else must match exactly. Broken by: the
    CLI computing max_model_len, dtype or limits differently from Engine.__init__."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            CLI,
            "plan",
            "--model",
            "default",
            "--memory-limit",
            "1280MiB",
            "--context",
            "1024",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    cli = json.loads(out.stdout)
    assert cli.pop("planned_for") == "serve"  # what the CLI adds: the process its overhead was measured for
    # and the margin it adds to its measurement for that other process (a server's pool is at least its)
    assert cli.pop("overhead_drift_bytes") == OVERHEAD_DRIFT
    # the resident peak it reached while loading (QA pass 6: ~1 GiB under a 720 MiB limit before the
    # Q8 table was checked in pieces), measured, outside the plan
    assert cli.pop("load_peak_rss_bytes") > cli["weights_bytes"]
    assert cli["limit_bytes"] == 1280 * MiB and cli["context_tokens"] == 1024
    assert OVERHEAD_SLACK + (64 << 20) < cli["overhead_bytes"] < OVERHEAD_SLACK + (1 << 30)

    from kvgate.core.engine import Engine

    engine = Engine.from_model(
        "default",  # the store a server keeps is the serve plan's (auto: 40 MiB of 1280)
        EngineConfig(memory_limit="1280MiB", responses_store=None),
        overhead_bytes=cli["overhead_bytes"],
    )
    assert cli["responses_bytes"] == 40 * MiB
    assert engine.plan.to_dict(1024) == cli
    assert engine.max_model_len == cli["limits"]["max_model_len"]
    assert engine.ledger.reserved <= cli["limit_bytes"]


def test_max_concurrent_is_bounded_by_max_seqs_and_the_models_context():
    """ "max concurrent requests at N tokens" counts what can run at once: no more than --max-seqs, and
    a request no longer than the model's context (QA pass 7: 116 with --max-seqs 4; 1806 requests of
    1024 tokens on a 512-token model). Seen red with the pool-only count."""
    plan = smollm2_plan("4GiB", 2, max_seqs=4)
    assert plan.kv_blocks // (1024 // 16) > 4
    assert plan.max_concurrent(1024) == 4
    assert "max concurrent requests at 1024 tokens each: 4 (--max-seqs 4)" in plan.describe(1024)
    short = smollm2_plan("4GiB", 2, max_seqs=1000, max_model_len=512)
    assert short.max_concurrent(1024) == min(1000, short.kv_blocks // (512 // 16))
    assert "at 512 tokens each" in short.describe(1024) and "the model's context is 512" in short.describe(
        1024
    )


def test_the_logprobs_memory_is_a_term_that_auto_gives_way_and_an_explicit_one_is_named():
    """--logprobs-memory auto (a 16th of the limit, at most 32 MiB) comes out of the pool; where the limit
    leaves less, auto shrinks to what is left, and says so; an explicit size that does not fit is named
    in the error with its advice. Red with auto's shrink removed
    (the tight plan refused), and with the term left out of `fixed` (the pool as large as without it)."""
    roomy, without = smollm2_plan("2GiB"), smollm2_plan("2GiB", logprobs_bytes=0)
    assert roomy.logprobs_bytes == 32 * MiB
    assert without.kv_pool_bytes - roomy.kv_pool_bytes >= 32 * MiB - roomy.kv_bytes_per_token * 16
    tight_limit = SMOLLM2_VALUES * 2 + 300 * MiB + 118 * MiB  # (RoPE tables for the 1,024 positions only)
    tight = smollm2_plan(str(tight_limit), max_model_len=1024)
    assert 0 <= tight.logprobs_bytes < tight_limit // 16
    assert any("what the limit leaves (--logprobs-memory auto)" in n for n in tight.notes)
    with pytest.raises(P.PlanError, match=r"logprobs memory 1\.5 GiB .* or --logprobs-memory"):
        smollm2_plan("2GiB", logprobs_bytes=3 << 29, max_model_len=1024)


def test_kept_responses_are_a_term_on_a_cpu_that_auto_gives_way_first(monkeypatch):
    """--responses-store (the Responses API's kept responses, server memory) is a term of the plan on a
    CPU, where the limit is the process's: auto is a 32nd of the limit, at most 64 MiB, and comes out
    of the pool; under a tight limit it gives way before the logprobs memory; an explicit size that does
    not fit is named with its flag; on a GPU it is host memory, outside the device's limit, and only
    said. Red with the term left out of `fixed` (the pools equal), with the logprobs giving way first,
    and with it charged on CUDA."""
    roomy, without = smollm2_plan("4GiB", responses_bytes=None), smollm2_plan("4GiB")
    assert roomy.responses_bytes == 64 * MiB and without.responses_bytes == 0
    assert without.kv_pool_bytes - roomy.kv_pool_bytes >= 64 * MiB - roomy.kv_bytes_per_token * 16
    assert re.search(r"kept responses +64\.0 MiB  \(--responses-store", roomy.describe())
    assert smollm2_plan("1GiB", responses_bytes=None).responses_bytes == 32 * MiB
    # tight limits, 4 MiB apart: the store gives way first, the logprobs only once it has none left
    plans = []
    for mib in range(500, 1100, 4):
        try:
            plans.append(smollm2_plan(f"{mib}MiB", max_model_len=1024, responses_bytes=None))
        except P.PlanError:
            pass
    shrunk = [p for p in plans if any("what the limit leaves (--responses-store auto)" in n for n in p.notes)]
    assert any(p.responses_bytes > 0 for p in shrunk) and any(p.responses_bytes == 0 for p in shrunk)
    for p in shrunk:
        lp_auto = min(32 * MiB, p.limit_bytes // 16)
        assert p.responses_bytes < min(64 * MiB, p.limit_bytes // 32)
        assert p.logprobs_bytes == lp_auto or p.responses_bytes == 0, (p.limit_bytes, p.logprobs_bytes)
    with pytest.raises(P.PlanError, match=r"kept responses 1\.5 GiB .* or --responses-store"):
        smollm2_plan("2GiB", responses_bytes=3 << 29, max_model_len=1024)
    monkeypatch.setattr(LIM, "device_memory", lambda device: (80 * GiB, 79 * GiB))
    args = dict(block_size=16, prefill_chunk=256, max_seqs=32, max_model_len=8192, overhead_bytes=300 * MiB)
    common = dict(device="cuda:0", dtype_name="bfloat16", dtype_bytes=2, limit_spec="4GiB", **args)
    on_gpu, gpu_without = make_plan(SMOLLM2, responses_bytes=None, **common), make_plan(SMOLLM2, **common)
    assert on_gpu.responses_bytes == 64 * MiB and on_gpu.kv_blocks == gpu_without.kv_blocks
    assert "host memory, outside this device's limit" in on_gpu.describe()


def test_qwen3s_head_norms_off_the_cpp_path_are_a_transient_term():
    """A Qwen3 (qk_norm) plans F.rms_norm's q/k output and its float32 inside for 16-bit dtypes; other
    models plan nothing for it. Red with the term left at 0."""
    import dataclasses

    qwen = dataclasses.replace(SMOLLM2, qk_norm=True)
    args = dict(
        device="cpu", dtype_name="bfloat16", dtype_bytes=2, limit_spec="4GiB", overhead_bytes=300 * MiB
    )
    args.update(block_size=16, prefill_chunk=256, max_seqs=32, max_model_len=8192)
    plan = make_plan(qwen, **args)
    T = plan.limits.prefill_chunk + plan.limits.max_seqs
    assert plan.workspace_breakdown["qk_norm"] >= T * (9 + 3) * 64 * (4 + 2)
    assert smollm2_plan().workspace_breakdown["qk_norm"] == 0


def test_rope_tables_are_planned_and_built_for_the_engines_context_only(make_engine):
    """The cos and sin tables cover --max-model-len's positions, not the model's whole context (Llama
    3.x: 131,072 positions, 64 MiB in float32; Gemma 3 270M's two sets at 32,768: 128 MiB). Red with
    the plan charging the model's context (the gap below is 0) and with the model building it."""
    short, whole = smollm2_plan(max_model_len=1024), smollm2_plan(max_model_len=8192)
    assert whole.weights_bytes - short.weights_bytes == 2 * (8192 - 1024) * SMOLLM2.head_dim * 2
    engine = make_engine(max_model_len=64)
    assert engine.model.cos.shape[0] == 64 and engine.model.weight_bytes <= engine.plan.weights_bytes
