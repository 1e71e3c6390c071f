"""The printed memory plan (`kvgate plan`, and `kvgate serve` at startup): `MemoryPlan.describe`'s text.

The arithmetic lives in `kvgate.memory.plan`; this only lays it out.
"""

from __future__ import annotations

from kvgate.units import fmt_bytes


def describe_plan(plan, context: int | None = None) -> str:
    """`plan` (a `kvgate.memory.plan.MemoryPlan`) as text; "max concurrent" at `context` tokens each."""
    ctx = context or plan.limits.max_model_len
    L = plan.limits
    lines = [
        f"memory plan ({plan.device}, {plan.dtype})",
        f"  limit            {fmt_bytes(plan.limit_bytes):>12}  ({plan.limit_source})",
        f"  weights          {fmt_bytes(plan.weights_bytes):>12}"
        + (
            f"  (matrices {plan.limits.weight_format}, weight-only)"
            if plan.limits.weight_format != "full"
            else ""
        ),
        f"  runtime overhead {fmt_bytes(plan.overhead_bytes):>12}  (measured baseline + slack)",
        f"  step workspace   {fmt_bytes(plan.workspace_bytes):>12}  (prefill chunk {L.prefill_chunk}, "
        f"max rows {L.max_seqs}, attention cap {L.attn_token_cap} tokens, context {L.context}"
        + (f", {L.speculate} draft tokens per row" if L.speculate else "")
        + ")",
        f"    of which grammar {fmt_bytes(plan.workspace_breakdown.get('grammar', 0)):>10}  (structured output: "
        + (
            f"token trie, {L.grammars} grammar{'s' if L.grammars != 1 else ''} kept at once (--max-grammars; "
            "requests with one schema share one) and one being compiled, row masks)"
            if L.grammars
            else "off, --max-grammars 0)"
        ),
    ]
    if plan.logprobs_bytes:
        lines.append(
            f"  logprobs         {fmt_bytes(plan.logprobs_bytes):>12}  (--logprobs-memory: reserved per request "
            "at admission, ~0.7 KB a token at top_logprobs 20)"
        )
    if plan.responses_bytes:
        lines.append(
            f"  kept responses   {fmt_bytes(plan.responses_bytes):>12}  (--responses-store: responses kept for "
            "previous_response_id, least recently used out first"
            + (")" if plan.device.startswith("cpu") else "; host memory, outside this device's limit)")
        )
    if plan.graph_bytes:
        g = plan.graph_breakdown
        lines.append(
            f"  CUDA graphs      {fmt_bytes(plan.graph_bytes):>12}  ({plan.graph_shapes} decode shapes: pool "
            f"{fmt_bytes(g['pool'])}, static inputs and logits {fmt_bytes(g['buffers'])}, padding rows' KV "
            f"block {fmt_bytes(g['pad_block'])})"
        )
        if "pieces_pool" in g:
            lines.append(
                f"    with step pieces {fmt_bytes(g['pieces_pool'] + g['pieces_buffers']):>9}  (--cuda-graphs full: "
                f"pool {fmt_bytes(g['pieces_pool'])}, static buffers {fmt_bytes(g['pieces_buffers'])}, included above)"
            )
    lines += [
        f"  KV pool          {fmt_bytes(plan.kv_pool_bytes):>12}  = {plan.kv_blocks} blocks x "
        f"{plan.block_size} tokens x {plan.kv_bytes_per_token:,} B/token",
        f"  KV capacity      {plan.kv_positions:>12,} tokens",
        f"  KV blocks        {plan.kv_blocks:>12,} free at start (0 cached, 0 referenced); "
        + (
            "the prefix cache keeps its blocks inside this pool, at no extra memory: they are evicted, "
            "oldest first, when admission needs room"
            if plan.prefix_cache
            else "prefix cache off (--prefix-cache off): no block outlives the requests that hold it"
        ),
        f"  max concurrent requests at {min(ctx, plan.limits.max_model_len)} tokens each: "
        f"{plan.max_concurrent(ctx)}"
        + (
            f" (--max-seqs {plan.limits.max_seqs})"
            if plan.max_concurrent(ctx) == plan.limits.max_seqs
            else ""
        )
        + (
            f" (the model's context is {plan.limits.max_model_len})"
            if ctx > plan.limits.max_model_len
            else ""
        ),
    ]
    lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)


def no_fit(terms: list[tuple[str, int]], limit: int, source: str, drift: int, packed_head: bool) -> str:
    """The error of a model that does not fit its limit: the plan's fixed terms (a zero one left out)
    summed against it, and the least limit that fits (`drift`: what a measured overhead may move)."""
    need = sum(n for _, n in terms)
    said = " + ".join(f"{name} {fmt_bytes(n)}" for name, n in terms if n)
    return (
        f"the model does not fit in the memory limit: {said} = {fmt_bytes(need)} > limit {fmt_bytes(limit)} "
        f"({source}). Raise --memory-limit to at least {-(-(need + drift) // (1 << 20))}MiB, pick a smaller "
        "--dtype, or lower --max-model-len"
        + (" or --logprobs-memory" if dict(terms).get("logprobs memory") else "")
        + (" or --responses-store" if dict(terms).get("kept responses") else "")
        + (
            " or --max-grammars (0: no structured output)"
            if dict(terms).get("structured-output grammars")
            else ""
        )
        + (" (or --pack-weights off, which drops the packed LM head copy)." if packed_head else ".")
    )
