"""Admission arithmetic: what a request reserves, every typed refusal, Retry-After, the TTFT forecast.

Everything here is a pure function of the `SchedulerConfig`, a request, and (for the estimates) an
`EngineSnapshot`: the admission gate calls it on the caller's thread and the scheduler on the worker,
and neither reads the other's live state.

Refusals, in the order a request meets them:
- `context_length_exceeded` (400): prompt + max_tokens past the model's context. Checked first, since
  the client can always fix it.
- `kv_budget_exceeded` (400): it can never fit the whole KV pool (an explicit max_tokens is never
  capped; an unset one is capped to the pool and the cap reported).
- `engine_unavailable` / `shutting_down` (503), `queue_full` (503), `ttft_budget_exceeded` (429; 400
  when the prompt's own prefill alone is over the budget): the gate, at arrival. `queue_full` also
  from the worker, for a newcomer that could not start at once while the queue was full.
- `kv_memory_unavailable` (429): waited `--max-queue-wait` seconds in the FIFO and KV blocks did not
  free up for it (or for the requests before it); `batch_rows_unavailable` (429) when the blocks were
  free but all `--max-seqs` rows stayed busy, so an operator reading the rejection counts can tell
  memory from rows.
"""

from __future__ import annotations

from kvgate.config import SchedulerConfig
from kvgate.core.kv_cache import cacheable_blocks, choice_blocks, prompt_block_hashes
from kvgate.core.rows import WaitEntry
from kvgate.core.snapshot import EngineSnapshot, WaiterView
from kvgate.request import BudgetCap, Refusal, RequestHandle

DEFAULT_STEP_SECONDS = 0.05  # Retry-After's step time before any step was measured


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
        raise context_refusal(cfg, P, req.max_tokens)
    if n > cfg.max_seqs:
        raise too_many_choices(n, cfg.max_seqs)
    cap = None
    requested = ceiling  # before any cap: what the caller asked for, or the context ceiling
    if group_blocks(cfg, P, ceiling, n) > cfg.total_blocks:
        best = max_choice_positions(cfg, P, n, cfg.total_blocks) - P
        if explicit or best < 1:
            raise budget_refusal(cfg, P, ceiling if explicit else 1, n, given=explicit)
        cap = BudgetCap(ceiling, best, "kv_budget")
        ceiling = best
    hashes = (
        prompt_block_hashes(req.prompt_ids, cfg.block_size, cfg.cache_root)
        if cfg.prefix_cache or n > 1
        else []
    )
    deadline = handle.submitted_at + cfg.max_queue_wait
    return WaitEntry(handle, ceiling, explicit, requested, cap, deadline, hashes, list(followers))


def too_many_choices(n: int, max_seqs: int) -> Refusal:
    return Refusal(
        "too_many_choices",
        f"n={n} choices run as {n} batch rows at once, and this server runs at most {max_seqs} "
        f"(--max-seqs). Ask for at most n={max_seqs}, or send several requests.",
        400,
        param="n",
    )


def context_refusal(cfg: SchedulerConfig, P: int, max_tokens: int | None) -> Refusal:
    want = P + (max_tokens or 1)
    if P == 0:
        msg = "the prompt is empty: send at least one token of prompt."
    elif P >= cfg.max_model_len:
        msg = (
            f"the prompt alone is {P} tokens and the model's context is {cfg.max_model_len} positions, "
            f"which must also hold at least one generated token. Shorten the prompt by at least "
            f"{P - cfg.max_model_len + 1} token{'s' if P >= cfg.max_model_len + 1 else ''}."
        )
    else:
        msg = (
            f"this request needs {want} positions (prompt {P} + max_tokens {max_tokens or 1}) but the "
            f"model's context is {cfg.max_model_len}. Shorten the prompt or lower max_tokens to at most "
            f"{max(0, cfg.max_model_len - P)}."
        )
    return Refusal(
        "context_length_exceeded",
        msg,
        400,
        estimated_bytes=want * cfg.kv_bytes_per_token,
        limit_bytes=cfg.max_model_len * cfg.kv_bytes_per_token,
        positions=want,
        positions_limit=cfg.max_model_len,
        param="prompt" if P == 0 or P >= cfg.max_model_len else "max_tokens",
    )


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
    cfg: SchedulerConfig, w: WaitEntry, free_blocks: int, rows: int, retry: int, ahead: int = 0
) -> Refusal:
    """`free_blocks`: what admission could hand out (free plus evictable cached blocks); `ahead`:
    requests still waiting in front of `w` (strict FIFO: the head blocks everyone behind it)."""
    P = w.prompt_len
    need = group_blocks(cfg, P, w.max_tokens, w.choices)
    fits_alone = need <= free_blocks and rows + w.choices <= cfg.max_seqs
    fix = "Retry after the Retry-After interval."
    code = "kv_memory_unavailable"
    if ahead and fits_alone:
        earlier = "1 earlier request" if ahead == 1 else f"{ahead} earlier requests"
        why = (
            f"it would fit now ({need} of {free_blocks} free KV blocks) but waited behind {earlier}, "
            "served first come first served, and the first of them still does not fit"
        )
    elif need <= free_blocks and rows + w.choices > cfg.max_seqs:
        why = f"all {cfg.max_seqs} batch rows (--max-seqs) stayed busy"
        code = "batch_rows_unavailable"  # KV was free: not a request the server had no memory for
    else:
        blocks = f"{need} block{'s' if need != 1 else ''}"
        why = f"it needs {blocks} of KV (prompt {P} + max_tokens {w.max_tokens}) and {free_blocks} of "
        why += f"{cfg.total_blocks} are free"
        fix = "Retry after the Retry-After interval, or lower max_tokens."
    bpt = cfg.kv_bytes_per_token
    return Refusal(
        code,
        f"no room for this request right now: {why} after waiting {cfg.max_queue_wait:g}s. {fix}",
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


def retry_after(snap: EngineSnapshot) -> int:
    """Seconds until room is likely: the soonest-finishing row's remaining steps x the step time;
    clamped to [1, 60]. That is when a row, and so a queue place, frees up (the queue's head takes the
    row): a retry needs a place, not the head of the line. The step time is the median of the recent
    decode steps (all steps before one ran): the estimate multiplies it by hundreds of steps, and
    the EMA (five steps' memory), or a median over a burst's prompt chunks, turned 2.6 s into 36-60 s,
    which the openai SDK sleeps in full (session 30's QA; a queue factor stretched it further)."""
    if not snap.rows:
        return 1
    recent = sorted(snap.recent_decode_steps or snap.recent_steps)
    step = recent[len(recent) // 2] if recent else snap.step_time_ema or DEFAULT_STEP_SECONDS
    soonest = min(r.steps_left for r in snap.rows)
    return int(min(60, max(1, round(soonest * step))))


def predicted_ttft(
    cfg: SchedulerConfig,
    snap: EngineSnapshot,
    pending: list[WaiterView],
    P: int,
    max_tokens: int,
    cached: int = 0,
    n: int = 1,
) -> tuple[float, float, int] | None:
    """(seconds until admission, seconds of prefill, prompt tokens to prefill) for a request arriving
    now, or None before any step was timed. `pending`: requests the gate accepted that the snapshot
    does not show yet (they are ahead of this one).

    Admission: the running rows are assumed to run to their max_tokens; walking them by remaining
    steps, the request is admitted once enough rows and blocks are free for every waiter ahead of it
    and itself, at the tick after that step (with rows running, never before the step in flight
    ends). Prefill: every prompt token still to prefill ahead of it plus its own, at the measured
    seconds per prefill token -- exact with one prompt prefilling, an upper bound when chunks are
    shared round-robin. `cached`: the newcomer's prompt tokens the prefix cache holds (not
    prefilled, not allocated); `n`: its choices. Before any prompt chunk large enough to time was
    prefilled, the prefill counts as 0 s: the forecast is then a lower bound (the admission wait alone),
    never switched off while steps are timed."""
    per_token, step = snap.prefill_token_time_ema, snap.step_time_ema
    if step is None:
        return None
    waiters = list(snap.waiters) + list(pending)
    ahead = sum(r.prompt_left for r in snap.rows) + sum(w.prompt_len for w in waiters) + P - cached
    slots = len(waiters) + n - (cfg.max_seqs - len(snap.rows))
    need = group_blocks(cfg, P, max_tokens, n, cached // cfg.block_size)
    blocks = need - snap.kv_blocks_available + sum(w.blocks for w in waiters)
    admit = step if snap.rows else 0.0  # admitted at the worker's next tick: after the step in flight
    if slots > 0 or blocks > 0:
        admit = float("inf")
        for steps, nblocks in sorted((r.steps_left, r.blocks) for r in snap.rows):
            slots, blocks = slots - 1, blocks - nblocks
            if slots <= 0 and blocks <= 0:
                admit = (steps + 1) * step
                break
    return admit, ahead * (per_token or 0.0), ahead


def ttft_never_refusal(cfg: SchedulerConfig, own_tokens: int, per_token: float | None) -> Refusal | None:
    """The 400 for a prompt whose own prefill, on an idle server, is forecast over `--max-ttft`: no
    retry of the same request can pass, so no Retry-After."""
    if cfg.max_ttft is None or per_token is None or own_tokens * per_token <= cfg.max_ttft:
        return None
    most = int(cfg.max_ttft / per_token)
    return Refusal(
        "ttft_budget_exceeded",
        f"this request's {own_tokens} prompt tokens to prefill would take about "
        f"{own_tokens * per_token:.1f}s at the fastest rate this server has measured ({1 / per_token:.0f} "
        f"tokens/s), even on an idle server, more than this server's --max-ttft {cfg.max_ttft:g}s. "
        f"Shorten the prompt to about {most} tokens (not counting a prefix the server has cached), or "
        "send it to a server with a larger --max-ttft.",
        400,
        param="prompt",
    )


def ttft_refusal(
    cfg: SchedulerConfig, estimate: tuple[float, float, int], per_token: float | None
) -> Refusal | None:
    """The 429 for a forecast over `--max-ttft`, or None when it is within the budget."""
    admit, prefill, ahead = estimate
    if cfg.max_ttft is None or admit + prefill <= cfg.max_ttft:
        return None
    wait = "no room is in sight" if admit == float("inf") else f"{admit:.1f}s until rows and KV free up"
    rate = "not timed yet, counted as 0s" if per_token is None else f"at {1 / per_token:.0f} tokens/s"
    return Refusal(
        "ttft_budget_exceeded",
        f"this request would wait about {admit + prefill:.1f}s for its first token ({wait}, then {ahead} "
        f"prompt tokens to prefill, {rate}), more than this server's --max-ttft "
        f"{cfg.max_ttft:g}s. Retry after the Retry-After interval.",
        429,
        retry_after=int(min(60, max(1, round(min(admit + prefill, 3600) - cfg.max_ttft)))),
    )
