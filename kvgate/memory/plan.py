"""The startup memory plan: limit -> weights + step workspace + runtime overhead + KV pool.

All arithmetic a user must be able to check lives here, and the engine executes exactly what the plan
says: the step limits it derives (prefill chunk, max rows, attention token cap) are the limits the
scheduler and step builder obey, through the same `step_workspace` helper.

KV bytes per token = 2 x layers x kv_heads x head_dim x bytes(dtype); SmolLM2-135M in bf16:
2 x 30 x 3 x 64 x 2 = 23,040 B.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass

from kvgate.config import ModelSpec
from kvgate.memory.ledger import fmt_bytes

AUTO_CPU_SHARE = 0.25  # "auto" on CPU: a quarter of MemAvailable at startup (the pool is zero-filled, so real)
AUTO_CUDA_SHARE = 0.9  # "auto" on CUDA: 90% of the free device memory at startup
OVERHEAD_SLACK = 192 << 20  # allocator arenas, thread stacks, HTTP buffers beyond the measured baseline
MIN_KV_POSITIONS = 512  # a model is refused at load unless one request of this many positions fits

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "t": 10**12, "tb": 10**12})


class PlanError(ValueError):
    pass


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise PlanError(f"cannot read {text!r} as a size: use bytes like 4GiB, 512MiB or 2000000000")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def device_memory(device: str) -> tuple[int, int]:
    """(total, available) bytes of the device's memory."""
    if device.startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        return total, free
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    return info["MemTotal"], info.get("MemAvailable", info["MemFree"])


def resolve_limit(spec: str, device: str) -> tuple[int, str]:
    """`--memory-limit` -> (bytes, how it was derived)."""
    total, available = device_memory(device)
    if spec == "auto":
        share = AUTO_CUDA_SHARE if device.startswith("cuda") else AUTO_CPU_SHARE
        what = "free device memory" if device.startswith("cuda") else "available RAM"
        return int(available * share), f"auto: {share:.0%} of {what} ({fmt_bytes(available)})"
    if re.fullmatch(r"\s*(0?\.[0-9]+|1(\.0*)?)\s*", spec):
        share = float(spec)
        if share <= 0:
            raise PlanError(f"--memory-limit {spec}: a fraction must be in (0, 1]")
        return int(total * share), f"{share:.0%} of {fmt_bytes(total)} device memory"
    return parse_bytes(spec), "explicit"


def runtime_overhead_bytes(device: str) -> int:
    """What the process holds besides the ledger's tensors: measured baseline RSS plus a fixed slack.

    On CUDA the ledger covers device memory only, and the CUDA context is outside torch's allocator.
    """
    if device.startswith("cuda"):
        return 512 << 20
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return rss + OVERHEAD_SLACK


def weight_bytes(spec: ModelSpec, dtype_bytes: int) -> int:
    h, layers = spec.hidden_size, spec.num_layers
    per_layer = (
        h * (spec.q_size + 2 * spec.kv_size)  # fused qkv
        + spec.q_size * h  # o_proj
        + 3 * h * spec.intermediate_size  # gate, up, down
        + 2 * h  # two norms
    )
    params = spec.vocab_size * h + layers * per_layer + h
    if not spec.tie_word_embeddings:
        params += spec.vocab_size * h
    rope = 2 * spec.max_position_embeddings * spec.head_dim
    return (params + rope) * dtype_bytes


@dataclass
class StepLimits:
    prefill_chunk: int
    max_seqs: int
    attn_token_cap: int  # padded decode-attention tokens per group (rows x longest context)
    max_model_len: int

    @property
    def max_step_tokens(self) -> int:
        return self.prefill_chunk + self.max_seqs


def step_workspace(spec: ModelSpec, dtype_bytes: int, limits: StepLimits) -> dict[str, int]:
    """Peak bytes of one engine step, by component, from the step limits the engine enforces."""
    b = dtype_bytes
    T = limits.max_step_tokens
    H, KVH, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    g = H // KVH
    ctx = limits.max_model_len
    chunk = limits.prefill_chunk
    return {
        # x, residual sum, normed h, attention output, projection output
        "hidden_states": 5 * T * spec.hidden_size * b,
        # fused qkv, rotated q/k and its rotate-half temporary, gathered cos/sin
        "qkv_rope": T * (spec.q_size + 2 * spec.kv_size) * b + 2 * T * (H + KVH) * D * b + 2 * T * D * b,
        # gate/up output, SiLU, product, down output
        "mlp": T * (4 * spec.intermediate_size + spec.hidden_size) * b,
        # decode groups: gathered K and V, fp32 scores, mask
        "decode_attention": 2 * limits.attn_token_cap * KVH * D * b + limits.attn_token_cap * (g * 4 + 1),
        # one prefill chunk at full context: gathered K and V, materialized scores (fp32), mask
        "prefill_attention": 2 * ctx * KVH * D * b + chunk * H * ctx * 4 + chunk * g * ctx,
        # logits of every sampled row in the model dtype and as float32
        "logits": limits.max_seqs * spec.vocab_size * (b + 4),
        # one row's sampling at a time: clone, softmax, sorted values, int64 indices, cumsum
        "sampling": spec.vocab_size * (4 * 4 + 8),
        # per-step index tensors (ids, positions, slots, block tables, masks)
        "step_inputs": 3 * T * 8 + limits.attn_token_cap * 9,
    }


@dataclass
class MemoryPlan:
    device: str
    dtype: str
    limit_bytes: int
    limit_source: str
    weights_bytes: int
    overhead_bytes: int
    workspace_bytes: int
    workspace_breakdown: dict
    kv_bytes_per_token: int
    block_size: int
    kv_blocks: int
    kv_pool_bytes: int
    limits: StepLimits
    notes: list

    @property
    def kv_positions(self) -> int:
        return self.kv_blocks * self.block_size

    def max_concurrent(self, tokens_each: int) -> int:
        return self.kv_blocks // max(1, -(-tokens_each // self.block_size))

    def to_dict(self, context: int | None = None) -> dict:
        d = asdict(self)
        d["kv_positions"] = self.kv_positions
        d["max_step_tokens"] = self.limits.max_step_tokens
        ctx = context or self.limits.max_model_len
        d["context_tokens"] = ctx
        d["max_concurrent_requests_at_context"] = self.max_concurrent(ctx)
        return d

    def describe(self, context: int | None = None) -> str:
        ctx = context or self.limits.max_model_len
        L = self.limits
        lines = [
            f"memory plan ({self.device}, {self.dtype})",
            f"  limit            {fmt_bytes(self.limit_bytes):>12}  ({self.limit_source})",
            f"  weights          {fmt_bytes(self.weights_bytes):>12}",
            f"  runtime overhead {fmt_bytes(self.overhead_bytes):>12}  (measured baseline + slack)",
            f"  step workspace   {fmt_bytes(self.workspace_bytes):>12}  (prefill chunk {L.prefill_chunk}, "
            f"max rows {L.max_seqs}, attention cap {L.attn_token_cap} tokens, context {L.max_model_len})",
            f"  KV pool          {fmt_bytes(self.kv_pool_bytes):>12}  = {self.kv_blocks} blocks x "
            f"{self.block_size} tokens x {self.kv_bytes_per_token:,} B/token",
            f"  KV capacity      {self.kv_positions:>12,} tokens",
            f"  max concurrent requests at {ctx} tokens each: {self.max_concurrent(ctx)}",
        ]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def make_plan(
    spec: ModelSpec,
    *,
    device: str,
    dtype_name: str,
    dtype_bytes: int,
    limit_spec: str,
    block_size: int,
    prefill_chunk: int,
    max_seqs: int,
    max_model_len: int,
    kv_cache_bytes: int | None = None,
    overhead_bytes: int | None = None,
) -> MemoryPlan:
    limit, source = resolve_limit(limit_spec, device)
    weights = weight_bytes(spec, dtype_bytes)
    overhead = runtime_overhead_bytes(device) if overhead_bytes is None else overhead_bytes
    per_token = spec.kv_bytes_per_token(dtype_bytes)
    block_bytes = per_token * block_size
    min_kv = -(-min(MIN_KV_POSITIONS, max_model_len) // block_size) * block_bytes
    notes: list[str] = []
    requested = StepLimits(prefill_chunk, max_seqs, _attn_cap(max_seqs, max_model_len), max_model_len)
    limits = requested
    fixed = weights + overhead
    if fixed + min_kv + _ws(spec, dtype_bytes, _smallest(limits)) > limit:
        raise PlanError(
            f"the model does not fit in the memory limit: weights {fmt_bytes(weights)} + runtime overhead "
            f"{fmt_bytes(overhead)} + smallest step workspace "
            f"{fmt_bytes(_ws(spec, dtype_bytes, _smallest(limits)))} + KV for one {min(MIN_KV_POSITIONS, max_model_len)}"
            f"-token request {fmt_bytes(min_kv)} > limit {fmt_bytes(limit)} ({source}). Raise "
            "--memory-limit, pick a smaller --dtype, or lower --max-model-len."
        )
    # Shrink the step until the workspace leaves room for at least the minimum KV pool.
    while fixed + min_kv + _ws(spec, dtype_bytes, limits) > limit:
        if limits.prefill_chunk > 16:
            limits = StepLimits(limits.prefill_chunk // 2, limits.max_seqs, limits.attn_token_cap, max_model_len)
        elif limits.max_seqs > 1:
            seqs = limits.max_seqs // 2
            limits = StepLimits(limits.prefill_chunk, seqs, _attn_cap(seqs, max_model_len), max_model_len)
        else:
            break
    if limits != requested:
        notes.append(
            f"step limits shrunk to fit the limit: prefill chunk {requested.prefill_chunk} -> "
            f"{limits.prefill_chunk}, max rows {requested.max_seqs} -> {limits.max_seqs}"
        )
    breakdown = step_workspace(spec, dtype_bytes, limits)
    workspace = sum(breakdown.values())
    room = limit - fixed - workspace
    if kv_cache_bytes is not None:
        if kv_cache_bytes > room:
            raise PlanError(
                f"--kv-cache-bytes {fmt_bytes(kv_cache_bytes)} does not fit: the limit {fmt_bytes(limit)} "
                f"leaves {fmt_bytes(room)} after weights, overhead and workspace. Lower it or raise "
                "--memory-limit."
            )
        room = kv_cache_bytes
    blocks = room // block_bytes
    if blocks < 1:
        raise PlanError(f"no room for a single KV block ({fmt_bytes(block_bytes)}) in {fmt_bytes(room)}")
    return MemoryPlan(
        device=device,
        dtype=dtype_name,
        limit_bytes=limit,
        limit_source=source,
        weights_bytes=weights,
        overhead_bytes=overhead,
        workspace_bytes=workspace,
        workspace_breakdown=breakdown,
        kv_bytes_per_token=per_token,
        block_size=block_size,
        kv_blocks=int(blocks),
        kv_pool_bytes=int(blocks) * block_bytes,
        limits=limits,
        notes=notes,
    )


def _attn_cap(max_seqs: int, max_model_len: int) -> int:
    # Room for every row at 512 tokens, and never less than one row at full context.
    return max(max_model_len, max_seqs * 512)


def _smallest(limits: StepLimits) -> StepLimits:
    return StepLimits(min(16, limits.prefill_chunk), 1, limits.max_model_len, limits.max_model_len)


def _ws(spec: ModelSpec, dtype_bytes: int, limits: StepLimits) -> int:
    return sum(step_workspace(spec, dtype_bytes, limits).values())
