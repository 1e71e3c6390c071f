"""Admission arithmetic: what a request reserves, and every typed refusal.

Everything here is a pure function of the `SchedulerConfig` and a request (Retry-After and the TTFT
forecast, from a snapshot, are `kvgate.core.forecast`): the admission gate calls it on the caller's
thread and the scheduler on the worker, and neither reads the other's live state.

Refusals, in the order a request meets them:
- `context_length_exceeded` (400): prompt + max_tokens past the model's context. Checked first, since
  the client can always fix it.
- `kv_budget_exceeded` (400): it can never fit the whole KV pool (an explicit max_tokens is never
  capped; an unset one is capped to the pool and the cap reported).
- `engine_unavailable` / `shutting_down` (503), `queue_full` (503), `ttft_budget_exceeded` (429; 400
  when the prompt's own prefill alone is over the budget): the gate, at arrival. `queue_full` also
  from the worker, for a newcomer that could not start at once while the queue was full.
- `kv_memory_unavailable` (429): waited `--max-queue-wait` (or a shorter `--max-ttft`) seconds in the
  FIFO and KV blocks did not free up for it (or the requests before it); `batch_rows_unavailable`
  (429) when they were free but all `--max-seqs` rows stayed busy: operators can tell memory from rows.
"""

from __future__ import annotations

from dataclasses import replace

from kvgate.config import SchedulerConfig
from kvgate.core import logprob_budget, side_waits
from kvgate.core.kv_cache import blocks_for, cacheable_blocks, choice_blocks, prompt_block_hashes
from kvgate.core.rows import WaitEntry
from kvgate.request import LIST_KEYS, BudgetCap, GenerationRequest, Refusal, RequestHandle


def group_blocks(cfg: SchedulerConfig, P: int, max_tokens: int, n: int = 1, hits: int = 0) -> int:
    """New blocks a request of `n` choices needs: every choice holds `ceil((P + max_tokens) / bs)`
    blocks, the choices share the prompt's cacheable blocks (referenced once), and `hits` of those
    come from the prefix cache already."""
    return choice_blocks(P, max_tokens, n, cfg.block_size) - hits


def max_choice_positions(cfg: SchedulerConfig, P: int, n: int, blocks: int, hits: int = 0) -> int:
    """The most positions each of `n` choices can have when `blocks` new blocks are available."""
    shared = cacheable_blocks(P, cfg.block_size) if n > 1 else 0
    return (blocks + hits + (n - 1) * shared) // n * cfg.block_size


def plan_entry(cfg: SchedulerConfig, handle: RequestHandle, followers: list[RequestHandle] = ()) -> WaitEntry:
    """The queue entry for a request (and the other choices of an n > 1 request), or the 400 that says
    it can never fit (context first). The prompt-block hashes are computed here, on the caller's
    thread, once."""
    req = handle.request
    P = len(req.prompt_ids)
    n = 1 + len(followers)
    explicit = req.max_tokens is not None
    ceiling = req.max_tokens if explicit else cfg.max_model_len - P
    if P == 0 or P + (ceiling if explicit else 1) > cfg.max_model_len:
        raise context_refusal(cfg, P, req.max_tokens, n)
    if n > cfg.max_seqs:
        raise too_many_choices(n, cfg.max_seqs)
    cap = None
    requested = ceiling  # before any cap: what the caller asked for, or the context ceiling
    pool = cfg.total_blocks if explicit or req.kv_share is None else min(cfg.total_blocks, req.kv_share)
    if group_blocks(cfg, P, ceiling, n) > pool:
        best = max_choice_positions(cfg, P, n, pool) - P
        if explicit or best < 1:
            raise budget_refusal(cfg, P, ceiling if explicit else 1, n, given=explicit)
        cap = BudgetCap(ceiling, best, "kv_budget")
        ceiling = best
    share = cfg.logprobs_memory if explicit or req.logprobs_share is None else req.logprobs_share
    lp = logprob_budget.never_fits(req, ceiling, explicit, n, min(cfg.logprobs_memory, share))
    if isinstance(lp, Refusal):
        raise lp
    if lp is not None:
        cap = BudgetCap(requested, lp.admitted_max_tokens, lp.reason)
        ceiling = lp.admitted_max_tokens
    hashes = (
        prompt_block_hashes(req.prompt_ids, cfg.block_size, cfg.cache_root, req.cache_salt)
        if cfg.prefix_cache or n > 1
        else []
    )
    deadline = handle.submitted_at + cfg.queue_wait
    return WaitEntry(handle, ceiling, explicit, requested, cap, deadline, hashes, list(followers))


def too_many_choices(n: int, max_seqs: int, asked_rows: int | None = None) -> Refusal:
    """`asked_rows`: the --max-seqs the server was started with, when the memory plan shrank it."""
    if asked_rows is not None and asked_rows > max_seqs:
        why = (
            f"(--max-seqs {asked_rows}, which the memory plan shrank to {max_seqs} to fit --memory-limit: "
            "a larger limit keeps more)"
        )
    else:
        why = "(--max-seqs)"
    return Refusal(
        "too_many_choices",
        f"this request's {n} choices (n, or best_of when larger) run as {n} batch rows at once, and this "
        f"server runs at most {max_seqs} {why}. Ask for at most {max_seqs}, or send several requests.",
        400,
        param="n",
    )


def context_refusal(cfg: SchedulerConfig, P: int, max_tokens: int | None, n: int = 1) -> Refusal:
    """`n`: the request's choices, which share the pool (the advice must fit all of them)."""
    want = P + (max_tokens or 1)
    if P == 0:
        msg = "the prompt is empty: send at least one token of prompt."
    elif P >= cfg.max_model_len:  # the sentence OpenAI and vLLM begin with: clients match it (LiteLLM, aider)
        msg = (
            f"This model's maximum context length is {cfg.max_model_len} tokens. However, the prompt alone is "
            f"{P} tokens, and the context must also hold at least one generated token. Shorten the prompt by "
            f"at least {P - cfg.max_model_len + 1} token{'s' if P >= cfg.max_model_len + 1 else ''}."
        )
    else:
        by_context = max(0, cfg.max_model_len - P)
        by_pool = max(0, max_choice_positions(cfg, P, n, cfg.total_blocks) - P)
        if by_pool < by_context:  # the advice must fit the pool too, or it earns a second 400
            most = (
                f"{by_pool} (the context allows {by_context}, but this server's whole KV pool holds "
                f"{cfg.kv_positions} positions)"
                if by_pool
                else f"1 and shorten the prompt: this server's whole KV pool holds {cfg.kv_positions} "
                "positions"
            )
        else:
            most = str(by_context)
        msg = (
            f"This model's maximum context length is {cfg.max_model_len} tokens. However, this request "
            f"needs {want} (prompt {P} + max_tokens {max_tokens or 1}). Shorten the prompt or lower "
            f"max_tokens to at most {most}."
        )
    return Refusal(
        "context_length_exceeded",
        msg,
        400,
        **context_bytes(cfg, want),
        positions=want,
        positions_limit=cfg.max_model_len,
        param="prompt" if P == 0 or P >= cfg.max_model_len else "max_tokens",
    )


def context_bytes(cfg: SchedulerConfig, want: int) -> dict[str, int]:
    """A context 400's bytes: `want` positions rounded up to whole blocks (as the pool 400 counts them),
    and the most one sequence can hold, the context's positions or the whole pool, whichever is less
    (session 45; before, the context's bytes even past a small server's whole pool). The context is
    not rounded up, so the estimate always exceeds it (the review: both rounded could be equal)."""
    bs, bpt = cfg.block_size, cfg.kv_bytes_per_token
    ceiling = min(cfg.max_model_len, cfg.total_blocks * bs)
    return {"estimated_bytes": blocks_for(want, bs) * bs * bpt, "limit_bytes": ceiling * bpt}


def budget_refusal(cfg: SchedulerConfig, P: int, max_tokens: int, n: int = 1, given: bool = True) -> Refusal:
    """`given`: the client sent `max_tokens`; when it did not, the request is judged with one token."""
    want = P + max_tokens
    limit_pos = cfg.kv_positions
    need = group_blocks(cfg, P, max_tokens, n)
    bpt, bs = cfg.kv_bytes_per_token, cfg.block_size
    what = f"{need} KV blocks" if n == 1 else f"{need} KV blocks for {n} choices sharing the prompt's blocks"
    most = max(0, max_choice_positions(cfg, P, n, cfg.total_blocks) - P)
    if most >= 1:
        fix = f"Lower max_tokens to at most {most}" + (", or ask for fewer choices (n)" if n > 1 else "")
        fix += ", shorten the prompt, or start the server with a larger --memory-limit."
    else:  # the prompt alone (with one token for each choice) is already too big
        fix = "Even max_tokens 1 does not fit: shorten the prompt" + (
            ", ask for fewer choices (n)" if n > 1 else ""
        )
        fix += ", or start the server with a larger --memory-limit."
    asked = f"max_tokens {max_tokens}" if given else "at least 1 generated token"
    return Refusal(
        "kv_budget_exceeded",
        f"this request can never fit: prompt {P} + {asked} = {want} positions need {what} "
        f"({need * bs * bpt:,} bytes) but the whole KV pool is {cfg.total_blocks} blocks ({limit_pos} "
        f"positions, {limit_pos * bpt:,} bytes). " + fix,
        400,
        estimated_bytes=need * bs * bpt,
        limit_bytes=limit_pos * bpt,
        positions=want,
        positions_limit=limit_pos,
        param="max_tokens" if most >= 1 else "prompt",
    )


def fit_group(cfg: SchedulerConfig, requests: list[GenerationRequest], n: int) -> list[GenerationRequest]:
    """Several prompts as one request (admitted together, answered together): the 400 when their KV
    blocks together can never fit the pool, each at the least it runs with (an explicit max_tokens; an
    unset one at `min_cap_tokens`, as admission takes it); else the requests, each unset one given its
    share of the pool (`kv_share`: its least and an equal part of what is left), so the first cannot
    take the room the others wait for. Each prompt alone is judged by `plan_entry`. Before, a list past
    the pool waited for blocks its own first prompts held: 429 on every try (QA pass 9; review 36)."""
    if len(requests) < 2:
        return requests

    def least_tokens(r: GenerationRequest) -> int:
        return r.max_tokens or max(1, min(cfg.min_cap_tokens, cfg.max_model_len - len(r.prompt_ids)))

    leasts = [group_blocks(cfg, len(r.prompt_ids), least_tokens(r), n) for r in requests]
    need, unset = sum(leasts), sum(1 for r in requests if not r.max_tokens)
    if need > cfg.total_blocks:
        bpt, bs = cfg.kv_bytes_per_token, cfg.block_size
        counted = " (an unset max_tokens counted at its least, --min-cap-tokens)" if unset else ""
        raise Refusal(
            "kv_budget_exceeded",
            f"this request's {len(requests)} prompts are admitted together and together need {need} KV blocks "
            f"({need * bs * bpt:,} bytes) for their prompts and max_tokens{counted}, but the whole KV pool is "
            f"{cfg.total_blocks} blocks ({cfg.kv_positions} positions, {cfg.kv_positions * bpt:,} bytes). Send "
            "fewer prompts a request, lower max_tokens, or give the server more KV memory.",
            400,
            estimated_bytes=need * bs * bpt,
            limit_bytes=cfg.kv_positions * bpt,
            param="prompt",
        )
    lp = [logprob_budget.group_bytes(r, least_tokens(r), n) for r in requests]
    if sum(lp) > cfg.logprobs_memory:
        raise logprob_budget.group_refusal(sum(lp), cfg.logprobs_memory, len(requests), unset > 0)
    extra = (cfg.total_blocks - need) // max(1, unset)
    lp_extra = (cfg.logprobs_memory - sum(lp)) // max(1, unset)
    out = [
        r if r.max_tokens else replace(r, kv_share=b + extra, logprobs_share=m + lp_extra)
        for r, b, m in zip(requests, leasts, lp, strict=True)
    ]
    # Prompts held until the whole answer is sent hold each other's logprobs: the first reserves all of
    # them (each at its most), so two lists queued in turns (x1 y1 x2 y2) cannot wait on each other
    whole = sum(m + (0 if r.max_tokens else lp_extra) for r, m in zip(requests, lp, strict=True))
    if whole and any(r.held is not None for r in requests):
        key = next(LIST_KEYS)  # its later prompts wait while the first does (scheduler._admit)
        out = [replace(r, logprobs_bytes=0 if i else whole, logprobs_list=key) for i, r in enumerate(out)]
    return out


def unavailable_refusal(reason: str, retry_after: int) -> Refusal:
    return Refusal(
        "engine_unavailable",
        f"the server is not accepting requests: {reason}. Retry against another replica or later.",
        503,
        retry_after=retry_after,
    )


def shutting_down_refusal(retry_after: int = 5) -> Refusal:
    return Refusal(
        "shutting_down",
        "the server is shutting down and did not admit this request; retry against another replica",
        503,
        retry_after=retry_after,
    )


def queue_full_refusal(cfg: SchedulerConfig, queued: int, retry_after: int, free_rows: int = 0) -> Refusal:
    """The gate's 503: `queued` choices are already in or on their way to the queue, more than the
    `free_rows` batch rows the latest snapshot showed free plus `--max-queue` places can take."""
    rows = f"{free_rows} free batch rows and " if free_rows else ""
    return Refusal(
        "queue_full",
        f"server is at capacity: {queued} requests are already queued or arriving for {rows}"
        f"{cfg.max_queue} queue places (--max-queue; a request with n choices counts n). Retry after the "
        "Retry-After interval.",
        503,
        retry_after=retry_after,
    )


def queue_trim_refusal(cfg: SchedulerConfig, w: WaitEntry, waiting: int, retry_after: int) -> Refusal:
    """The worker's 503 for a newcomer it could not admit at once (rows or KV busy, or requests ahead
    of it) while `waiting` choices already fill the `--max-queue` places before it."""
    n = w.choices
    this = "this request" if n == 1 else f"this request's {n} choices"
    if cfg.max_queue == 0:
        room = "this server keeps no waiting line (--max-queue 0)"
    else:
        room = (
            f"the queue has no room: earlier requests take {waiting} of its {cfg.max_queue} places "
            f"(--max-queue), and {this} would take {n}"
        )
    return Refusal(
        "queue_full",
        f"server is at capacity: {this} could not start at once (batch rows or KV blocks are busy, or "
        f"earlier requests wait for them) and {room}. Retry after the Retry-After interval.",
        503,
        retry_after=retry_after,
    )


def kv_timeout_refusal(
    cfg: SchedulerConfig,
    w: WaitEntry,
    free_blocks: int,
    rows: int,
    retry: int,
    ahead: int = 0,
    head_waits: str | None = None,
) -> Refusal:
    """`free_blocks`: what admission could hand out (free plus evictable cached blocks); `ahead`:
    requests still waiting in front of `w` (strict FIFO: the head blocks everyone behind it);
    `head_waits`: what the queue's head waits for instead of KV, "logprobs" or "grammar" memory."""
    P = w.prompt_len
    need = group_blocks(cfg, P, w.max_tokens, w.choices)
    fits_alone = need <= free_blocks and rows + w.choices <= cfg.max_seqs
    fix = "Retry after the Retry-After interval."
    code = "kv_memory_unavailable"
    if ahead and fits_alone:
        earlier = "1 earlier request" if ahead == 1 else f"{ahead} earlier requests"
        short = side_waits.HEAD_WAITS.get(head_waits, "still does not fit")
        why = (
            f"it would fit now ({need} of {free_blocks} free KV blocks) but waited behind {earlier}, "
            f"served first come first served, and the first of them {short}"
        )
        code = f"{head_waits}_memory_unavailable" if head_waits else code
    elif need <= free_blocks and rows + w.choices > cfg.max_seqs:
        why = f"all {cfg.max_seqs} batch rows (--max-seqs) stayed busy"
        code = "batch_rows_unavailable"  # KV was free: not a request the server had no memory for
    else:
        blocks = f"{need} block{'s' if need != 1 else ''}"
        why = f"it needs {blocks} of KV (prompt {P} + max_tokens {w.max_tokens}) and {free_blocks} of "
        why += f"{cfg.total_blocks} are free"
        fix = "Retry after the Retry-After interval, or lower max_tokens."
    bpt, ttft = cfg.kv_bytes_per_token, cfg.queue_wait_flag == "--max-ttft"  # its wait spent the budget
    ttft = f" (--max-ttft: no first token within {cfg.max_ttft:g}s)" if ttft else ""
    return Refusal(
        code,
        f"no room for this request right now: {why} after waiting {cfg.queue_wait:g}s{ttft}. {fix}",
        429,
        retry_after=retry,
        estimated_bytes=need * cfg.block_size * bpt,
        limit_bytes=cfg.kv_positions * bpt,
        positions=P + w.max_tokens,
        positions_limit=cfg.kv_positions,
    )


def engine_error_refusal() -> Refusal:
    return Refusal(
        "engine_error",
        "the engine failed while admitting this request; the details are in the server log",
        500,
    )
