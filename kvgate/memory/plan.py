"""The startup memory plan: limit -> weights + step workspace + runtime overhead (+ logprobs, kept
responses) + KV pool.

All arithmetic a user must be able to check lives here, and the engine executes exactly what the plan
says: the step limits it derives (prefill chunk, max rows, attention token cap) are the limits the
scheduler and step builder obey, through the same `step_workspace` helper.

KV bytes per token = 2 x layers x kv_heads x head_dim x bytes(dtype); SmolLM2-135M in bf16:
2 x 30 x 3 x 64 x 2 = 23,040 B.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvgate.config import ModelSpec
from kvgate.memory.describe import no_fit
from kvgate.memory.graphs import graph_bytes, graph_shapes
from kvgate.memory.limit import PlanError, device_memory, resolve_limit  # noqa: F401 (re-exported)
from kvgate.memory.overhead import overhead_drift, runtime_overhead_bytes
from kvgate.memory.workspace import (
    StepLimits,
    attn_cap,
    padded_len,
    step_workspace,
    workspace_bytes,
    workspace_total,
)
from kvgate.models.q8_head import q8_bytes, q8_dot_bytes
from kvgate.models.quant import quantizable, quantized_matrix_bytes
from kvgate.structured.compiler import AUTO_SLOTS, GRAMMAR_BYTES
from kvgate.units import fmt_bytes

AUTO_LOGPROBS = 32 << 20  # --logprobs-memory auto: a 16th of the limit, at most this
AUTO_RESPONSES = 64 << 20  # --responses-store auto: a 32nd of the limit, at most this
MIN_KV_POSITIONS = 512  # a model is refused at load unless one request of this many positions fits


def weight_bytes(
    spec: ModelSpec,
    dtype_bytes: int,
    lm_head_copy: bool = False,
    params: int | None = None,
    weight_format: str = "full",
    scale_bytes: int = 2,
    q8_head: bool = False,
    matrix_bytes: list[int] | None = None,
    head_bytes: int | None = None,
    rope_positions: int | None = None,
) -> int:
    """Bytes of the model's weights and RoPE tables (for `rope_positions`, the engine's context; None:
    the model's whole context). `params`: the number of values in the checkpoint
    the model is built from (every tensor counted: biases, norms, an untied head); without it they are
    computed from the geometry of a bias-free Llama. `lm_head_copy`: the weights are prepacked
    (`kvgate.models.linear`), so tied embeddings are held twice (plain for the lookup, packed for the
    head). `weight_format` int8 / int4: every matrix `kvgate.models.quant` can quantize is held as its
    codes and scales (`quantized_matrix_bytes`) instead of `dtype_bytes` per value; the LM head stays
    in the model dtype (`kvgate.models.llama`). `q8_head`: the tied embedding table (lookup and head)
    is held once, as Q8_0 codes and scales (`kvgate.models.q8_head.q8_bytes`, in tiles of 16 rows; in
    tiles of 8 rows under gguf-q8act, `q8_dot_bytes`). `matrix_bytes`: each layer matrix's bytes as
    held, in `matrices` order (gguf: each in its own block format, `kvgate.models.block_formats`).
    `head_bytes`: the LM head held as the file's blocks (`kvgate.models.head_blocks`): those bytes instead
    of the float head, and of a tied float table (its lookup reads the tiles: `head_blocks.BlockTable`)."""
    h = spec.hidden_size
    if params is None:
        per_layer = (
            h * (spec.q_size + 2 * spec.kv_size)  # fused qkv
            + spec.q_size * h  # o_proj
            + 3 * h * spec.intermediate_size  # gate, up, down
            + 2 * h  # two norms
        )
        params = spec.vocab_size * h + spec.num_layers * per_layer + h
        if not spec.tie_word_embeddings:
            params += spec.vocab_size * h
    rope = 2 * (rope_positions or spec.max_position_embeddings) * spec.head_dim * spec.rope_sets
    qbytes = 0
    if weight_format != "full":  # the layer matrices; the head stays in the model dtype
        mats = [m for m in matrices(spec) if quantizable(weight_format, *m)]
        params -= sum(n * k for n, k in mats)
        held = matrix_bytes or [quantized_matrix_bytes(weight_format, n, k, scale_bytes) for n, k in mats]
        qbytes = sum(held)
    if q8_head:
        params -= spec.vocab_size * h
        qbytes += (q8_dot_bytes if weight_format == "gguf-q8act" else q8_bytes)(spec.vocab_size, h)
    elif head_bytes is not None:  # tied: the lookup reads the tiles too (head_blocks.BlockTable)
        params -= spec.vocab_size * h
        qbytes += head_bytes
    elif spec.tie_word_embeddings and lm_head_copy:
        params += spec.vocab_size * h
    return (params + rope) * dtype_bytes + qbytes


def matrices(spec: ModelSpec) -> list[tuple[int, int]]:
    """(out, in) features of each layer matrix as `kvgate.models.llama` fuses them: qkv, o, gate/up, down."""
    h, q, kv, i = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size
    return [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)] * spec.num_layers


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
    # CUDA decode graphs (kvgate.memory.graphs): their pool, static buffers and pad block; 0 = none
    graph_bytes: int = 0
    graph_breakdown: dict | None = None
    graph_shapes: int = 0
    prefix_cache: bool = True  # --prefix-cache (set by kvgate.core.placement); only the text says it
    # the process's resident peak when the plan was made: the model read and checked, nothing built yet
    # (set by kvgate.core.placement; `kvgate plan` and serve report this one number)
    load_peak_bytes: int | None = None
    logprobs_bytes: int = 0  # --logprobs-memory (kvgate.core.logprob_budget); charged on a CPU only
    responses_bytes: int = 0  # --responses-store (kvgate.server.responses_store); charged on a CPU only

    @property
    def kv_positions(self) -> int:
        return self.kv_blocks * self.block_size

    def max_concurrent(self, tokens_each: int) -> int:
        """Requests of `tokens_each` positions (at most the model's context) the pool holds at once, at
        most --max-seqs (the plan's rows)."""
        tokens = min(tokens_each, self.limits.max_model_len)
        return min(self.limits.max_seqs, self.kv_blocks // max(1, -(-tokens // self.block_size)))

    def to_dict(self, context: int | None = None) -> dict:
        d = asdict(self)
        d.pop("load_peak_bytes")  # a measurement of the process, not the plan (`kvgate plan` adds its own)
        d["kv_positions"] = self.kv_positions
        d["kv_blocks_at_start"] = {"free": self.kv_blocks, "cached": 0, "referenced": 0}
        d["max_step_tokens"] = self.limits.max_step_tokens
        ctx = context or self.limits.max_model_len
        d["context_tokens"] = ctx
        d["max_concurrent_requests_at_context"] = self.max_concurrent(ctx)
        return d

    def describe(self, context: int | None = None) -> str:
        from kvgate.memory.describe import describe_plan

        return describe_plan(self, context)


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
    packed_weights: bool = False,
    weight_params: int | None = None,
    weight_format: str = "full",
    matrix_bytes: list[int] | None = None,
    quant_act_bytes: int = 2,
    speculate: int = 0,
    q8_head: bool = False,
    head_bytes: int | None = None,
    kv_dtype_bytes: int | None = None,
    kv_scale_bytes: int = 0,
    amx_prefill: bool = False,
    cuda_graphs: bool = False,
    step_pieces: bool = False,
    logprobs_bytes: int | None = None,
    grammars: int | None = None,
    responses_bytes: int | None = 0,
) -> MemoryPlan:
    """`weight_params`: values in the checkpoint (see `weight_bytes`); None = from the geometry.
    `weight_format`: full, or int8 / int4 weight-only quantized matrices (`kvgate.models.quant`) whose
    kernels run in `quant_act_bytes`-wide activations; `matrix_bytes`: see `weight_bytes`. `cuda_graphs`: charge the decode graphs
    (`kvgate.memory.graphs.graph_bytes`) before the KV pool; `step_pieces`: with the pieces of steps that
    carry prompt chunks (`--cuda-graphs full`)."""
    limit, source = resolve_limit(limit_spec, device)
    weights = weight_bytes(
        spec,
        dtype_bytes,
        lm_head_copy=packed_weights,
        params=weight_params,
        weight_format=weight_format,
        scale_bytes=quant_act_bytes,
        q8_head=q8_head,
        matrix_bytes=matrix_bytes,
        head_bytes=head_bytes,
        rope_positions=max_model_len,
    )
    overhead = runtime_overhead_bytes(device) if overhead_bytes is None else overhead_bytes
    # --kv-dtype: the pool's own bytes (int8: and a scale per position and KV head)
    per_token = spec.kv_bytes_per_token(kv_dtype_bytes or dtype_bytes, kv_scale_bytes)
    block_bytes = per_token * block_size
    min_kv = -(-min(MIN_KV_POSITIONS, max_model_len) // block_size) * block_bytes
    notes: list[str] = []
    if packed_weights and spec.tie_word_embeddings and not q8_head and head_bytes is None:
        notes.append(
            f"weights include a packed copy of the tied embeddings for the LM head "
            f"({fmt_bytes(spec.vocab_size * spec.hidden_size * dtype_bytes)}; --pack-weights off saves it, "
            f"and makes batched steps about 2.5x slower on CPU)"
        )
    bs = block_size
    min_ctx = min(MIN_KV_POSITIONS, max_model_len)
    pw = packed_weights
    wk = {
        "packed_weights": pw,
        "padded_rows": not device.startswith("cuda"),
        "weight_format": weight_format,
        "quant_act_bytes": quant_act_bytes,
        "speculate": speculate,
        "q8_head": q8_head,
        "block_lookup": head_bytes is not None and spec.tie_word_embeddings,
        "flash_prefill": not device.startswith("cuda"),
        "kv_bytes": kv_dtype_bytes or dtype_bytes,
        "kv_scale_bytes": kv_scale_bytes,
        "amx_prefill": amx_prefill,
        "grammars": AUTO_SLOTS if grammars is None else grammars,  # --max-grammars
    }
    requested = StepLimits(
        prefill_chunk, max_seqs, attn_cap(max_seqs, max_model_len, bs), max_model_len, **wk
    )
    charged = device.startswith("cpu")  # logprobs and kept responses are host memory: not a GPU's limit's
    lp = min(AUTO_LOGPROBS, limit // 16) if logprobs_bytes is None else logprobs_bytes
    rs = min(AUTO_RESPONSES, limit // 32) if responses_bytes is None else responses_bytes
    fixed = weights + overhead + (lp + rs) * charged

    def sized(lim: StepLimits, ctx: int) -> StepLimits:
        """`lim` with its attention sized for rows of at most `ctx` positions."""
        ctx = min(ctx, max_model_len)
        return StepLimits(
            lim.prefill_chunk,
            lim.max_seqs,
            attn_cap(lim.max_seqs, ctx, bs),
            max_model_len,
            None if ctx >= max_model_len else ctx,
            **wk,
        )

    def graphs(lim: StepLimits) -> dict[str, int]:
        if not cuda_graphs:
            return {"pool": 0, "buffers": 0, "pad_block": 0}
        return graph_bytes(spec, dtype_bytes, lim, bs, block_bytes, pieces=step_pieces)

    def room(lim: StepLimits) -> int:
        return limit - fixed - workspace_bytes(spec, dtype_bytes, lim, bs) - sum(graphs(lim).values())

    least = sized(StepLimits(min(16, prefill_chunk), 1, 0, max_model_len, **wk), min_ctx)
    smallest = workspace_bytes(spec, dtype_bytes, least, bs) + sum(graphs(least).values())
    spare = limit - weights - overhead - min_kv - smallest  # for the host terms, on a CPU
    if responses_bytes is None and charged and rs + lp > spare:  # an auto term gives way, this one first
        rs = max(0, spare - lp)
        notes.append(f"kept responses {fmt_bytes(rs)}: what the limit leaves (--responses-store auto)")
    if logprobs_bytes is None and charged and rs + lp > spare:
        lp = max(0, spare - rs)
        notes.append(f"logprobs memory {fmt_bytes(lp)}: what the limit leaves (--logprobs-memory auto)")
    fixed = weights + overhead + (lp + rs) * charged
    if fixed + min_kv + smallest > limit:
        cuda = " (with the CUDA decode graphs; --cuda-graphs off drops them)" if cuda_graphs else ""
        terms = [("weights", weights), ("runtime overhead", overhead), ("logprobs memory", lp * charged)]
        terms += [("kept responses", rs * charged)]
        g = step_workspace(spec, dtype_bytes, least, bs)["grammar"]  # --max-grammars 0 frees it
        terms += [(f"smallest step workspace{cuda}", smallest - g), ("structured-output grammars", g)]
        terms += [(f"KV for one {min_ctx}-token request", min_kv)]
        raise PlanError(no_fit(terms, limit, source, overhead_drift(device), pw and spec.tie_word_embeddings))
    # Shrink the step until its workspace leaves room for at least one min_ctx-token request: each time
    # halve whichever of the prefill chunk and the rows frees more (the larger consumer). Halving the
    # chunk first, always, took it to 16 tokens (slow prefill) where the rows' logits were the bulk:
    # with --speculate K each row brings 1 + K logits rows (session 30's QA: 850MiB, chunk 256 -> 16).
    limits = requested
    while room(sized(limits, min_ctx)) < min_kv:
        options = []
        if limits.prefill_chunk > 16:
            options.append(StepLimits(limits.prefill_chunk // 2, limits.max_seqs, 0, max_model_len, **wk))
        if limits.max_seqs > 1:
            options.append(StepLimits(limits.prefill_chunk, limits.max_seqs // 2, 0, max_model_len, **wk))
        if not options:  # unreachable after the check above; never loop forever
            raise PlanError(f"the smallest step does not fit in the limit {fmt_bytes(limit)} ({source})")
        limits = max(options, key=lambda o: room(sized(o, min_ctx)))  # ties: the chunk (listed first)
    pairs = (
        ("prefill chunk", requested.prefill_chunk, limits.prefill_chunk),
        ("max rows", max_seqs, limits.max_seqs),
    )
    if shrunk := [f"{what} {a} -> {b}" for what, a, b in pairs if a != b]:
        g = wk["grammars"]  # a term the shrink cannot cut: name the flag when it is above its default
        hint = f" (--max-grammars {g} plans {fmt_bytes((g + 1) * GRAMMAR_BYTES)})" if g > AUTO_SLOTS else ""
        notes.append("step limits shrunk to fit the limit: " + ", ".join(shrunk) + hint)
    # Size attention for full context when the pool can hold a full-context row; otherwise for the
    # smallest context that is at least what the pool (planned around it) can hold.
    if (
        kv_cache_bytes is None
        and room(sized(limits, max_model_len)) < padded_len(max_model_len, bs) * per_token
    ):
        # The longest row, in blocks, whose attention still leaves a pool that holds it (room(lo) does);
        # the pool is then cut to it below, so the context and the pool are the same number of positions.
        lo, hi = -(-min_ctx // bs), -(-max_model_len // bs) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if room(sized(limits, mid * bs)) // block_bytes >= mid else (lo, mid - 1)
        limits = sized(limits, lo * bs)
        notes.append(
            f"the KV pool holds fewer than {max_model_len} positions, so attention is planned for rows of "
            f"at most {limits.context} positions, the pool's size (a longer row's attention would shrink the "
            "pool below it)"
        )
    else:
        limits = sized(limits, max_model_len)
    breakdown = step_workspace(spec, dtype_bytes, limits, bs)
    workspace = workspace_total(breakdown)
    graph_parts = graphs(limits)
    room_left = limit - fixed - workspace - sum(graph_parts.values())
    if kv_cache_bytes is not None:
        if kv_cache_bytes > room_left:
            raise PlanError(
                f"--kv-cache-bytes {fmt_bytes(kv_cache_bytes)} does not fit: the limit {fmt_bytes(limit)} "
                f"leaves {fmt_bytes(room_left)} after weights, overhead and workspace"
                + (
                    f" and the CUDA graphs ({fmt_bytes(sum(graph_parts.values()))}; --cuda-graphs off drops them)"
                    if cuda_graphs
                    else ""
                )
                + ". Lower it or raise --memory-limit."
            )
        room_left = kv_cache_bytes
    blocks = room_left // block_bytes
    if limits.attn_context is not None:  # attention sized for shorter rows than the room would hold
        blocks = min(blocks, limits.attn_context // bs)
    if blocks < 1:
        raise PlanError(
            f"no room for a single KV block ({fmt_bytes(block_bytes)}): --kv-cache-bytes / the room left "
            f"is {fmt_bytes(room_left)}. Raise --kv-cache-bytes or --memory-limit."
        )
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
        graph_bytes=sum(graph_parts.values()),
        graph_breakdown=graph_parts if cuda_graphs else None,
        graph_shapes=len(graph_shapes(limits, bs)) if cuda_graphs else 0,
        logprobs_bytes=lp,
        responses_bytes=rs,
    )
