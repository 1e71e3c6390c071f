"""Plain values that cross module boundaries: the model's geometry, the engine's knobs and their flags.

Nothing here allocates or decides; loaders fill `ModelSpec`, the CLI and server fill `EngineConfig`
(from `ENGINE_FLAGS`, each also a `KVGATE_*` environment variable), the memory planner
(`kvgate.memory.plan`) turns both into a byte plan, and the engine hands the scheduler and the
admission gate one `SchedulerConfig`. Every entry point (`kvgate serve | generate | plan`) reads its
engine flags through `add_engine_flags` / `engine_config` here, so no entry point imports another.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from kvgate.flag_types import at_least, auto_or, byte_size, more_than
from kvgate.units import parse_bytes


@dataclass(slots=True, frozen=True)
class ModelSpec:
    """Geometry of a Llama-family decoder, as read from a GGUF file or an HF `config.json`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    name: str = "model"
    # RoPE scaling as sorted (key, value) pairs with "rope_type" (kvgate.models.rope.SCALINGS); () = none
    rope_scaling: tuple = ()
    qk_norm: bool = False  # RMSNorm of each q and k head before RoPE (Qwen3, Gemma 3)
    # Gemma 3 (kvgate.models.gemma): the layers that attend over only the last `sliding_window` positions,
    # their own RoPE base (no scaling), 1/sqrt(query_scale) for the attention scores (0: 1/sqrt(head_dim)),
    # and what every norm weight is offset by (an HF checkpoint stores w for (1 + w); a GGUF stores 1 + w)
    sliding_window: int = 0
    window_layers: tuple = ()
    rope_local_theta: float = 0.0
    query_scale: float = 0.0
    norm_offset: float = 0.0

    @property
    def rope_sets(self) -> int:
        """RoPE tables the model holds: Gemma 3's sliding layers have their own (kvgate.models.gemma)."""
        return 2 if self.architecture == "gemma3" else 1

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int, scale_bytes: int = 0) -> int:
        """K and V, every layer: 2 x layers x kv_heads x (head_dim x bytes + a head's scale bytes: an int8
        pool's float32 step and offset per position and KV head, `kvgate.models.kv_int8`)."""
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * dtype_bytes + scale_bytes)


@dataclass(slots=True)
class EngineConfig:
    """Every knob of the engine; the CLI exposes each as a flag and a KVGATE_* environment variable."""

    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    memory_limit: str = "auto"  # bytes ("4GiB"), fraction of device memory ("0.5"), or "auto"
    kv_cache_bytes: int | None = None  # explicit KV pool size; None = whatever the limit leaves
    block_size: int = 16
    max_seqs: int = 32  # running rows, prompts still prefilling included
    max_queue: int = 256
    max_queue_wait: float = 30.0  # seconds a request may wait for KV before a 429; 0 = refuse at once
    max_ttft: float | None = None  # refuse (429) at arrival when the predicted time to first token exceeds it
    prefill_chunk: int = 256
    min_cap_tokens: int = 256
    max_model_len: int | None = None  # None = the model's own context length
    seed: int | None = None  # default seed for requests that give none (None = fresh entropy)
    threads: int | None = None  # torch intra-op threads; None = torch's default
    adaptive_threads: str = "auto"  # auto | on | off: fewer threads while other processes use the cores
    pack_weights: str = "auto"  # auto | on | off: oneDNN-prepacked weight matrices (CPU float32)
    weights: str = "auto"  # auto | full | int8 | int4 | gguf | gguf-q8act (auto: gguf where exact Q4_1 blocks, else full)
    q8_head: str = "auto"  # auto | on | off: the tied embeddings as their exact Q8_0 blocks (models.q8_head)
    decode_attention: str = "auto"  # auto | paged | gather (kvgate.models.paged_attention)
    prefill_attention: str = "auto"  # auto | kernel | sdpa (kvgate.models.prefill_attention)
    kv_dtype: str = "auto"  # auto | float32 | float16 | bfloat16 | int8 (kvgate.core.kv_dtype)
    speculate: int = (
        0  # draft tokens per greedy row and step, by prompt lookup (kvgate.core.speculate); 0 = off
    )
    # a step running longer than this turns /health to 503 and fails new requests fast;
    # None = auto: max(STEP_TIMEOUT_FLOOR, STEP_TIMEOUT_FACTOR x the slowest step measured so far)
    step_timeout: float | None = None
    prefix_cache: str = "on"  # on | off: share the KV of prompt prefixes already computed
    cuda_graphs: str = "auto"  # auto | on | full | off: steps replayed from captured CUDA graphs (CUDA only)
    logprobs_memory: int | None = None  # bytes requests' logprobs may hold (core.logprob_budget); None = auto
    max_grammars: int | None = None  # distinct grammars kept at once (structured.compiler); None = auto
    # bytes of responses the server keeps for previous_response_id (kvgate.server.responses_store), a
    # term of the plan on CPU; 0 (a library engine, `generate`): none; None = auto
    responses_store: int | None = 0
    extra: dict = field(default_factory=dict)


STEP_TIMEOUT_FLOOR = 30.0  # seconds: a cold first step (a full prefill chunk) stays far below this
STEP_TIMEOUT_FACTOR = 20.0


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    """The limits the scheduler and the admission gate enforce, fixed when the engine starts."""

    block_size: int
    total_blocks: int
    max_seqs: int
    max_queue: int
    max_queue_wait: float
    prefill_chunk: int
    min_cap_tokens: int
    max_model_len: int
    kv_bytes_per_token: int
    max_ttft: float | None = None
    prefix_cache: bool = True
    speculate: int = 0  # draft tokens a greedy row may verify per step (kvgate.core.speculate)
    decode_position_seconds: float = 0.0  # a decode step's growth per row context position (measured)
    decode_step_prior: float = 0.05  # a decode tick's seconds before any was timed (forecast.typical_step)
    cache_root: bytes = b""  # the model's identity: the root of every prompt-block hash
    logprobs_memory: int = 32 << 20  # the logprobs budget (kvgate.core.logprob_budget)

    @property
    def kv_positions(self) -> int:
        return self.total_blocks * self.block_size

    @property
    def queue_wait(self) -> float:
        """How long a request may wait for room: --max-queue-wait, or --max-ttft where that is shorter (a
        request let in on the TTFT forecast that has waited the whole budget can no longer meet it: it
        is refused then, not 30 s later; session 41)."""
        return self.max_queue_wait if self.max_ttft is None else min(self.max_queue_wait, self.max_ttft)

    @property
    def queue_wait_flag(self) -> str:
        """The flag that set `queue_wait`."""
        return "--max-ttft" if self.queue_wait < self.max_queue_wait else "--max-queue-wait"


ENGINE_FLAGS = [
    # flag, type, default, help
    ("--device", str, "auto", "auto | cpu | cuda | cuda:N (a missing device is an error, never a fallback)"),
    (
        "--dtype",
        str,
        "auto",
        "auto | bfloat16 | float16 | float32 (auto: float32 under the gguf formats on CPU, else bf16 only where it is fast)",
    ),
    ("--memory-limit", str, "auto", "bytes (4GiB), fraction of device memory (0.5), or auto"),
    ("--kv-cache-bytes", str, None, "explicit KV pool size (default: what the memory limit leaves)"),
    ("--block-size", at_least(int, 1), 16, "KV block size in tokens"),
    ("--max-seqs", at_least(int, 1), 32, "running rows, prompts still prefilling included"),
    (
        "--max-queue",
        at_least(int, 0),
        256,
        "requests that may wait for rows/KV before 503 queue_full (0 = none wait)",
    ),
    (
        "--max-queue-wait",
        at_least(float, 0),
        30.0,
        "seconds a request waits for KV before 429 (0 = refuse at once)",
    ),
    (
        "--max-ttft",
        more_than(float, 0),
        None,
        "refuse (429) at arrival if the predicted time to first token exceeds this (s)",
    ),
    ("--prefill-chunk", at_least(int, 1), 256, "prompt tokens per step"),
    (
        "--min-cap-tokens",
        at_least(int, 0),
        256,
        "admit an unset-max_tokens request early if this many tokens fit",
    ),
    ("--max-model-len", at_least(int, 2), None, "context length (default: the model's)"),
    ("--threads", at_least(int, 1), None, "torch intra-op threads (default: torch's choice)"),
    (
        "--adaptive-threads",
        str,
        "auto",
        "auto | on | off: step on fewer threads while other processes use this engine's CPUs, and on all "
        "again after (auto: on a CPU with --weights gguf or gguf-q8act, whose numbers are the same at any "
        "thread count; on: also other formats, whose last bits may then move)",
    ),
    ("--pack-weights", str, "auto", "auto | on | off: prepack weights for oneDNN (auto: CPU float32)"),
    (
        "--q8-head",
        str,
        "auto",
        "auto | on | off: hold tied embeddings that are exact Q8_0 blocks (GGUF files) as those blocks, "
        "for the lookup and the LM head (auto: on CPU where a startup probe measures the head faster)",
    ),
    (
        "--speculate",
        at_least(int, 0, 8),
        0,
        "prompt-lookup speculative decoding: up to K draft tokens per row and step (requests without "
        "penalties, grammar, logprobs or min_tokens), verified in one pass; greedy output unchanged (exactly "
        "on the default CPU path), sampled rows keep the distribution by the rejection rule (a seeded "
        "request's tokens differ from a server without it); 0 = off, at most 8",
    ),
    (
        "--weights",
        str,
        "auto",
        "auto | full | int8 | int4 | gguf | gguf-q8act: gguf holds a GGUF file's own blocks of any type (Q4_1 "
        "0.625 B per weight, Q4_K/Q4_0 0.75, Q8_0 1.125, Q5_x/Q6_K/others 1.5), full's numbers to float32 "
        "rounding; gguf-q8act (Q4_1 files) also rounds activations to 8-bit blocks for integer dot products "
        "as llama.cpp does (faster; logits move ~1e-2); int8 / int4 re-quantize (CPU; faster at few rows, "
        "slower at many); auto: gguf where every layer matrix is a GGUF file's blocks on CPU, else full",
    ),
    (
        "--decode-attention",
        str,
        "auto",
        "auto | paged | gather: decode attention by the paged CPU kernel or by gather + SDPA "
        "(auto: a startup probe measures both)",
    ),
    (
        "--prefill-attention",
        str,
        "auto",
        "auto | kernel | sdpa: prompt-chunk attention by the paged CPU kernel or by gather + SDPA "
        "(auto: the kernel where it builds for the model and a startup probe measures it faster)",
    ),
    (
        "--kv-dtype",
        str,
        "auto",
        "auto | float32 | float16 | bfloat16 | int8: the KV cache's dtype (auto: float16 under a float32 model "
        "on a CPU, as llama.cpp's default f16 cache, else the model's). float16 halves a float32 cache's bytes "
        "per token: twice the tokens in the same memory and half the reads per decode step; logprobs move "
        "~1e-3. int8 (CPU, float32 model): 8-bit codes with a step and offset per position and KV head "
        "(llama.cpp's q8_0 cache is a scale per 32 values): 1.78x a float16 cache's tokens in the same memory; "
        "logprobs move ~0.025. float32 keeps a float32 model's numbers to float32 rounding",
    ),
    (
        "--step-timeout",
        more_than(float, 0),
        None,
        f"seconds one engine step may run before /health turns 503 (default: max({STEP_TIMEOUT_FLOOR:g}, "
        f"{STEP_TIMEOUT_FACTOR:g} x the slowest step measured))",
    ),
    (
        "--prefix-cache",
        str,
        "on",
        "on | off: reuse the KV of prompt prefixes already computed (inside the pool)",
    ),
    (
        "--cuda-graphs",
        str,
        "auto",
        "auto | on | full | off: run decode steps as CUDA graphs captured at startup, one per (rows, context) "
        "bucket; full: also steps with prompt chunks, each layer's glue replayed and attention eager between "
        "(not yet run on a GPU); their memory is in the plan (auto: on for a CUDA device, off on a CPU)",
    ),
    (
        "--logprobs-memory",
        auto_or(byte_size),
        "auto",
        "memory the requests' log-probabilities may hold at once, reserved at admission (a plan term on CPU), "
        "~0.7 KB a token at top_logprobs 20; a request that can never fit is a 400, one that cannot fit now "
        "waits (auto: 1/16 of the memory limit, at most 32MiB)",
    ),
    (
        "--max-grammars",
        auto_or(at_least(int, 0)),
        "auto",
        "structured-output grammars (distinct JSON schemas or tool lists) kept at once, running or cached, "
        "each planned at 8 MiB: requests with the same schema share one; a new one waits while every "
        "grammar runs another; 0 turns structured output off and frees the memory (auto: 4)",
    ),
]


def env_name(flag: str) -> str:
    return "KVGATE_" + flag.lstrip("-").upper().replace("-", "_")


# the settings with a fixed set of values, refused by argparse before anything loads (each resolver in
# kvgate.core.placement / kvgate.models owns its list; tests/test_flags.py holds these to them)
CHOICES = {
    "--dtype": ("auto", "bfloat16", "float16", "float32"),
    "--kv-dtype": ("auto", "bfloat16", "float16", "float32", "int8"),
    "--pack-weights": ("auto", "on", "off"),
    "--q8-head": ("auto", "on", "off"),
    "--weights": ("auto", "full", "int8", "int4", "gguf", "gguf-q8act"),
    "--decode-attention": ("auto", "paged", "gather"),
    "--prefill-attention": ("auto", "kernel", "sdpa"),
    "--prefix-cache": ("on", "off"),
    "--cuda-graphs": ("auto", "on", "full", "off"),
    "--adaptive-threads": ("auto", "on", "off"),
}


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=os.environ.get("KVGATE_MODEL", "default"), help="default | PATH")
    for flag, typ, default, help_ in ENGINE_FLAGS:
        env = os.environ.get(env_name(flag))
        p.add_argument(
            flag,
            type=typ,
            # argparse converts a string default with `type`: a bad KVGATE_* value is refused as the
            # flag's would be
            default=env if env is not None else default,
            choices=CHOICES.get(flag),
            help=f"{help_} [{env_name(flag)}]",
        )


def engine_config(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        device=a.device,
        dtype=a.dtype,
        memory_limit=a.memory_limit,
        kv_cache_bytes=parse_bytes(a.kv_cache_bytes) if a.kv_cache_bytes else None,
        block_size=a.block_size,
        max_seqs=a.max_seqs,
        max_queue=a.max_queue,
        max_queue_wait=a.max_queue_wait,
        max_ttft=a.max_ttft,
        prefill_chunk=a.prefill_chunk,
        min_cap_tokens=a.min_cap_tokens,
        max_model_len=a.max_model_len,
        threads=a.threads,
        adaptive_threads=a.adaptive_threads,
        pack_weights=a.pack_weights,
        q8_head=a.q8_head,
        weights=a.weights,
        decode_attention=a.decode_attention,
        prefill_attention=a.prefill_attention,
        kv_dtype=a.kv_dtype,
        speculate=a.speculate,
        step_timeout=a.step_timeout,
        prefix_cache=a.prefix_cache,
        cuda_graphs=a.cuda_graphs,
        logprobs_memory=a.logprobs_memory,
        max_grammars=a.max_grammars,
        # serve's flag (and plan's, for serve); the one-shot CLI and `plan --for generate` keep none
        responses_store=getattr(a, "responses_store", 0) if getattr(a, "plan_for", "serve") == "serve" else 0,
    )


def add_responses_store_flag(p: argparse.ArgumentParser) -> None:
    env = os.environ.get("KVGATE_RESPONSES_STORE")
    p.add_argument(
        "--responses-store",
        type=auto_or(byte_size),
        default=env if env is not None else "auto",
        help="memory for responses kept for previous_response_id and GET /v1/responses/{id}, least recently "
        "used out first, a term of the memory plan on CPU (0: keep none; auto: 1/32 of the memory limit, at "
        "most 64MiB) [KVGATE_RESPONSES_STORE]",
    )
