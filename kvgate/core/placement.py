"""Where and how a model runs: device, dtype, weight packing and format, and the memory plan built from them.

`plan_for(loaded, cfg)` is the one place a plan is made from a loaded checkpoint: `kvgate plan` and
the engine both call it, so what the CLI prints is what the engine executes. The plan's weight bytes
count every tensor of the checkpoint (biases included), never a formula's guess at them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvgate.config import EngineConfig
from kvgate.core.device_error import DeviceError
from kvgate.core.kv_dtype import kv_note, resolve_kv_dtype
from kvgate.core.speculate import MAX_SPECULATE
from kvgate.memory.overhead import overhead_drift, process_peak_rss_bytes, runtime_overhead_bytes
from kvgate.memory.plan import MemoryPlan, make_plan, matrices
from kvgate.models import LoadedModel, head_blocks, native
from kvgate.models.block_formats import BLOCK_FORMATS, block_bytes, format_counts, layer_matrix_formats
from kvgate.models.kv_int8 import element_bytes
from kvgate.models.lazy_weights import LazyWeights
from kvgate.models.linear import bf16_batch_invariant, native_bf16, packs_weights, warm_kernels
from kvgate.models.llama import matmul_shapes
from kvgate.models.paged_attention import position_seconds
from kvgate.models.paged_attention import resolve as resolve_decode_attention
from kvgate.models.prefill_attention import resolve as resolve_prefill_attention
from kvgate.models.q8_head import probe as probe_q8_head
from kvgate.models.q8_head import q8_blocks
from kvgate.models.quant import FORMATS, GGUF_FORMATS, probe_activation_dtype, supported

log = logging.getLogger("kvgate.engine")

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise DeviceError(
                f"--device {name} was asked for but this PyTorch build sees no CUDA device "
                f"(torch {torch.__version__}). Use --device cpu or --device auto."
            )
        dev = torch.device(name)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) exist.")
        return dev
    if name == "cpu":
        return torch.device("cpu")
    raise DeviceError(f"--device {name!r} is not one of auto, cpu, cuda, cuda:N")


def cpu_has_fast_bf16() -> bool:
    """The CPU lists bfloat16 arithmetic (`linear.native_bf16`: one reading of the flags for both)."""
    return native_bf16()


def resolve_dtype(name: str, device: torch.device, weights_format: str = "full") -> torch.dtype:
    """auto: float32 for the GGUF formats on CPU; else bf16 on CUDA with bf16 support and on CPUs with
    native bf16 matmul (full weights: if batch-invariant, `bf16_batch_invariant`), else float32.

    Measured on an AVX2-only EPYC (no avx512_bf16): a bf16 256x3072x576 matmul runs at 10 GFLOP/s
    against 57 GFLOP/s in float32, so bf16 there would make prefill and batched decode ~5x slower.
    The GGUF formats' kernels compute in float32 whatever the model dtype, so bf16 activations only add
    a rounding and a conversion around every matmul and leave the float32-only fast paths (the decode
    stack, the C++ layer ops). On a Zen 5 EPYC with avx512_bf16, served SmolLM2 at c=1 (TPOT p50, one
    bench.compare run): `gguf` 11.1 ms per token in bf16 (what auto chose before) against 6.9 in
    float32 (72 -> 109 tok/s), `gguf-q8act` 6.9 -> 5.3 ms; at c=16 both dtypes gave the same tok/s.
    """
    if name == "auto":
        if device.type == "cpu" and weights_format in GGUF_FORMATS:
            return torch.float32
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        fast = cpu_has_fast_bf16() and (weights_format != "full" or bf16_batch_invariant())
        return torch.bfloat16 if fast else torch.float32
    if name not in _DTYPES:
        raise DeviceError(f"--dtype {name!r} is not one of auto, bfloat16, float16, float32")
    return _DTYPES[name]


def resolve_packing(name: str, device: torch.device, dtype: torch.dtype) -> bool:
    """auto: prepack weight matrices for oneDNN wherever that works (CPU float32); on: insist."""
    if name not in ("auto", "on", "off"):
        raise DeviceError(f"--pack-weights {name!r} is not one of auto, on, off")
    possible = packs_weights(device, dtype)
    if name == "on" and not possible:
        raise DeviceError(
            f"--pack-weights on needs a CPU device, float32 and a torch with oneDNN; this is "
            f"{device} {str(dtype).removeprefix('torch.')}. Use --pack-weights auto or off."
        )
    return possible and name != "off"


def checkpoint_params(loaded: LoadedModel) -> int:
    """Values in the loaded checkpoint: every tensor the model will be built from."""
    w = loaded.weights
    return w.numel() if isinstance(w, LazyWeights) else sum(t.numel() for t in w.values())


def checkpoint_bytes(loaded: LoadedModel) -> int:
    """Bytes of the loaded checkpoint tensors, as they sit in memory now (none, read on demand)."""
    w = loaded.weights
    return (
        w.held_bytes if isinstance(w, LazyWeights) else sum(t.numel() * t.element_size() for t in w.values())
    )


def resolve_weights(name: str, device: torch.device) -> tuple[str, torch.dtype | None]:
    """(format, activation dtype of its kernels): the dtype is chosen by a measured probe
    (`probe_activation_dtype`, a few ms), never by a guess; None for full weights."""
    if name not in FORMATS:
        raise DeviceError(f"--weights {name!r} is not one of auto, {', '.join(FORMATS)}")
    why = supported(name, device)
    if why is not None:
        raise DeviceError(why)
    return name, (None if name == "full" or name in GGUF_FORMATS else probe_activation_dtype(name))


def auto_weights(loaded: LoadedModel, device: torch.device) -> tuple[str, str, list | None]:
    """--weights auto: gguf where every layer matrix is a GGUF file's blocks of a type kvgate's CPU
    kernels hold (the same numbers as full in a fifth to a third of the bytes: Q4_1 2.5x full's decode
    at one row), else full. Also returns `layer_matrix_formats` where it looked."""
    if device.type != "cpu":
        return "full", f"full (auto: the GGUF block kernels are CPU only, this is {device})", None
    if native.extension() is None:
        return "full", "full (auto: kvgate's C++ kernels are unavailable, see the log)", None
    formats = layer_matrix_formats(loaded)
    bad = [what for fmt, what in formats if fmt is None]
    if bad:
        return (
            "full",
            f"full (auto: {len(bad)} of {len(formats)} layer matrices are not a GGUF file's blocks, e.g. {bad[0]})",
            formats,
        )
    held = format_counts(formats)
    return (
        "gguf",
        f"gguf (auto: every layer matrix held as the file's own blocks, {held}: full's numbers)",
        formats,
    )


def check_gguf_blocks(loaded: LoadedModel, fmt: str = "gguf", formats: list | None = None) -> list:
    """--weights gguf holds every layer matrix as the file's own blocks, gguf-q8act as Q4_1 blocks: each
    must be that. Returns `layer_matrix_formats` (`formats`: already looked at)."""
    formats = layer_matrix_formats(loaded) if formats is None else formats
    want = ("q4_1",) if fmt == "gguf-q8act" else BLOCK_FORMATS
    bad = [(got, what) for got, what in formats if got not in want]
    if bad:
        got, what = bad[0]
        kind = "exact Q4_1 blocks" if fmt == "gguf-q8act" else "a GGUF file's blocks of a type kvgate holds"
        found = "float values" if got is None else f"{got} blocks"
        raise DeviceError(
            f"--weights {fmt}: {len(bad)} of {len(formats)} layer matrices are not {kind}, e.g. {what} "
            f"({found}); --weights {fmt} holds every layer matrix as the file's own "
            + (
                "Q4_1 blocks (a Q4_1 GGUF such as the default model's). Use --weights gguf for other block "
                "types, "
                if fmt == "gguf-q8act"
                else "blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K-Q6_K). Use "
            )
            + "--weights full (the same numbers, in float) or --weights int4."
        )
    return formats


@dataclass
class Placement:
    device: torch.device
    dtype: torch.dtype
    packed: bool
    max_model_len: int
    plan: MemoryPlan
    weights: str = "full"  # full | int8 | int4
    quant_act: torch.dtype | None = None  # the quantized kernels' activation dtype
    q8_head: bool = False  # tied embeddings held as their exact Q8_0 blocks (kvgate.models.q8_head)
    q8_head_reason: str = ""  # why it is on or off, with the probe's numbers when it ran
    paged_attention: bool = False  # decode attention by the paged CPU kernel (else gather + SDPA)
    kv_dtype: torch.dtype | None = None  # the KV pool's dtype (None: the model's)
    prefill_kernel: bool = False  # prompt-chunk attention by the paged CPU kernel (else gather + SDPA)
    cuda_graphs: bool = False  # decode steps replayed from captured CUDA graphs (kvgate.models.decode_graphs)
    step_pieces: bool = False  # steps with prompt chunks replayed piecewise (kvgate.models.step_pieces)
    # seconds a decode step grows per context position of one of its rows, all layers (the attention
    # probe's; 0 where none ran): the forecasts' steps grow as the running rows' contexts do
    decode_position_seconds: float = 0.0
    head_blocks: str | None = None  # the LM head held as the file's blocks in this tile format (head_blocks)


def resolve_cuda_graphs(name: str, device: torch.device) -> tuple[bool, bool]:
    """(decode graphs?, step pieces?). auto: decode graphs on a CUDA device (a decode step is thousands
    of small kernel launches there), none on a CPU; on: insist (an error off CUDA); full: also the
    pieces of steps that carry prompt chunks (not yet run on a GPU); off: eager steps."""
    if name not in ("auto", "on", "full", "off"):
        raise DeviceError(f"--cuda-graphs {name!r} is not one of auto, on, full, off")
    if name in ("on", "full") and device.type != "cuda":
        raise DeviceError(f"--cuda-graphs {name} needs a CUDA device; this is {device}. Use auto or off.")
    graphs = name != "off" and device.type == "cuda"
    return graphs, graphs and name == "full"


def resolve_q8_head(
    name: str, loaded: LoadedModel, device: torch.device, dtype: torch.dtype, packed: bool, fmt: str = "gguf"
) -> tuple[bool, str]:
    """auto: on where the tied embeddings are exact Q8_0 blocks, the device is a CPU, the C++ kernel
    builds, and a short probe measures it at least as fast as the plain head (the kernel `fmt` would
    run: gguf-q8act's integer one, else the float one); on: insist (an error naming what is missing);
    off: never."""
    if name not in ("auto", "on", "off"):
        raise DeviceError(f"--q8-head {name!r} is not one of auto, on, off")
    if name == "off":
        return False, "off (--q8-head off)"
    table = loaded.weights.get("model.embed_tokens.weight")
    why = None
    if device.type != "cpu":
        why = f"the Q8 head kernel runs on CPU only, this is {device}"
    elif table is None or "lm_head.weight" in loaded.weights:
        why = "the model's LM head is not tied to its embeddings"
    elif (blocks := q8_blocks(table.to(torch.float32))) is None:
        why = "the embedding table is not exact Q8_0 blocks (only GGUF Q8_0 tables are held that way)"
    elif native.extension() is None:
        why = native.unavailable()
    if why is not None:
        if name == "on":
            raise DeviceError(f"--q8-head on: {why}. Use --q8-head auto or off.")
        return False, f"off: {why}"
    if name == "on":
        return True, "on (--q8-head on)"
    p = probe_q8_head(*blocks, dtype, packed, dot8=fmt == "gguf-q8act")  # the kernel that would run
    log.info(
        "Q8 head probe: %s ms Q8 vs %s ms plain head (1 + 8 rows, one thread)", p["q8_ms"], p["plain_ms"]
    )
    if p["keep"]:
        return True, "on (a startup probe measured it at least as fast as the plain head, or within 50%)"
    return False, "off: a startup probe measured the plain head over 1.5x faster (--q8-head on insists)"


def plan_for(
    loaded: LoadedModel, cfg: EngineConfig, overhead_bytes: int | None = None, drift: bool = False
) -> Placement:
    """Resolve device, dtype and packing, warm the packed kernels and choose the decode attention path
    (by a measured probe under auto, `kvgate.models.paged_attention`; their memory belongs in the
    measured overhead), measure that overhead, and make the plan (its notes say which attention).
    `drift`: add `OVERHEAD_DRIFT` to a measured CPU overhead (`kvgate plan`, for another process)."""
    device = resolve_device(cfg.device)
    weights_note = formats = None
    if cfg.weights == "auto":
        name, weights_note, formats = auto_weights(loaded, device)
    else:
        name = cfg.weights
    fmt, act = resolve_weights(name, device)
    dtype = resolve_dtype(cfg.dtype, device, fmt)
    kv_dtype = resolve_kv_dtype(cfg.kv_dtype, dtype, device, auto_dtype=cfg.dtype == "auto")
    graphs, pieces = resolve_cuda_graphs(cfg.cuda_graphs, device)
    if not 0 <= cfg.speculate <= MAX_SPECULATE:
        raise DeviceError(
            f"--speculate {cfg.speculate} is out of range: draft tokens per step are 0 (off) to {MAX_SPECULATE}"
        )
    packed = resolve_packing(cfg.pack_weights, device, dtype)  # quantized: the head (and any unquantizable)
    q8_head, q8_reason = resolve_q8_head(cfg.q8_head, loaded, device, dtype, packed, fmt)
    head_fmt, head_reason = head_blocks.resolve(loaded, device, dtype, packed, fmt, q8_head)
    matrix_bytes = None
    if fmt in GGUF_FORMATS:
        formats = check_gguf_blocks(loaded, fmt, formats)
        if fmt == "gguf":  # each matrix's tiles in its own format (the plan charges exactly those)
            matrix_bytes = [block_bytes(f, n, k) for (f, _), (n, k) in zip(formats, matrices(loaded.spec))]
    spec = loaded.spec
    max_len = min(cfg.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)
    if packed:
        rows = cfg.max_seqs * (1 + cfg.speculate)  # each decoding row and its drafts
        shapes = matmul_shapes(spec, cfg.prefill_chunk + rows, rows)
        warm_kernels(shapes[:-1] if q8_head or head_fmt else shapes, dtype)  # the last is the LM head
    geometry = (device, dtype, spec.num_heads, spec.num_kv_heads, spec.head_dim, cfg.block_size)
    try:
        # the probes time the pools in the cache's own dtype (float16 by default on a CPU)
        paged, why = resolve_decode_attention(cfg.decode_attention, *geometry, kv_dtype=kv_dtype)
        prefill_kernel, prefill_why = resolve_prefill_attention(
            cfg.prefill_attention, *geometry, kv_dtype=kv_dtype
        )
    except ValueError as exc:
        raise DeviceError(str(exc)) from None
    log.info("decode attention: %s", why)
    log.info("prefill attention: %s", prefill_why)
    if overhead_bytes is None:
        overhead_bytes = runtime_overhead_bytes(str(device), checkpoint_bytes(loaded))
        if drift:
            overhead_bytes += overhead_drift(str(device))
    ext = native.extension() if fmt == "gguf" and device.type == "cpu" else None  # gguf's kernels
    amx = ext is not None and ext.prefill_isa() == "amx-bf16"
    kv_value_bytes, kv_scale_bytes = element_bytes(kv_dtype)
    plan = make_plan(
        spec,
        device=str(device),
        dtype_name=str(dtype).removeprefix("torch."),
        dtype_bytes=torch.finfo(dtype).bits // 8,
        limit_spec=cfg.memory_limit,
        block_size=cfg.block_size,
        prefill_chunk=cfg.prefill_chunk,
        max_seqs=cfg.max_seqs,
        max_model_len=max_len,
        kv_cache_bytes=cfg.kv_cache_bytes,
        overhead_bytes=overhead_bytes,
        packed_weights=packed,
        weight_params=checkpoint_params(loaded),
        weight_format=fmt,
        matrix_bytes=matrix_bytes,
        quant_act_bytes=torch.finfo(act).bits // 8 if act is not None else (4 if fmt in GGUF_FORMATS else 2),
        speculate=cfg.speculate,
        q8_head=q8_head,
        head_bytes=None
        if head_fmt is None
        else head_blocks.head_bytes(head_fmt, spec.vocab_size, spec.hidden_size),
        kv_dtype_bytes=kv_value_bytes,
        kv_scale_bytes=kv_scale_bytes,
        amx_prefill=amx,
        cuda_graphs=graphs,
        step_pieces=pieces,
        logprobs_bytes=cfg.logprobs_memory,
        grammars=cfg.max_grammars,
        responses_bytes=cfg.responses_store,
    )
    plan.prefix_cache = cfg.prefix_cache != "off"  # the printed plan says where cached blocks live
    plan.load_peak_bytes = process_peak_rss_bytes()  # read and checked, nothing built: plan's and serve's
    if amx:
        plan.notes.append(
            "prompt rows of the Q4_1 layers on AMX bf16 tiles (float32's numbers: each activation as three "
            "bf16 parts; KVGATE_PREFILL_ISA=float32 keeps the float32 loop)"
        )
    if q8_head or cfg.q8_head != "auto" or "probe" in q8_reason:  # a choice worth stating
        plan.notes.append(f"LM head and embeddings as Q8_0 blocks: {q8_reason}")
    if head_reason:
        plan.notes.append(f"LM head as the file's blocks: {head_reason}")
    plan.notes.append(f"decode attention: {why}")
    plan.notes.append(f"prefill attention: {prefill_why}")
    if weights_note is not None:
        plan.notes.append(f"weights: {weights_note}")
    if (cfg.max_model_len or 0) > spec.max_position_embeddings:
        plan.notes.append(
            f"--max-model-len {cfg.max_model_len} is above the model's context, {spec.max_position_embeddings} "
            "positions (its config): capped to that"
        )
    if act is not None and fmt not in GGUF_FORMATS:  # int4 / int8: the probe's pick moves the numbers
        plan.notes.append(
            f"{fmt} matmuls on {str(act).removeprefix('torch.')} activations (a startup probe timed bfloat16 "
            "and float32 and kept the faster; the two round differently, so this choice is part of the numbers)"
        )
    if kv_dtype != dtype:
        plan.notes.append(kv_note(kv_dtype, cfg.kv_dtype, plan.dtype))
    return Placement(
        device,
        dtype,
        packed,
        max_len,
        plan,
        fmt,
        act,
        q8_head,
        q8_reason,
        paged,
        kv_dtype,
        prefill_kernel,
        graphs,
        pieces,
        spec.num_layers * position_seconds(*geometry, kv_dtype, paged),
        head_fmt,
    )
