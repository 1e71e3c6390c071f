"""How long until a request could start, from one published snapshot: Retry-After and the TTFT forecast.

Both walk the running rows by their remaining steps. What one step takes:
- `typical_step`: the clipped mean of the recent decode-only tick periods (start to start: the forward,
  the worker's scheduling and publishing, and what the event loop takes from it). Not the step-time EMA:
  five steps' memory with prompt chunks in it turned 2.6 s into 36-60 s of Retry-After and a 1.2 s
  wait for a row into a 7.9-13 s forecast (session 30's QA). Not the forward alone: 15-20% short.
- `decode_seconds`: that step grows as the rows' contexts do (each decode row's attention reads one
  more position a step) and shrinks as rows end, by the attention probe's seconds per position
  (`EngineSnapshot.decode_position_seconds`). With a fixed step, a live SmolLM2 server forecast
  2.49 s where 3.29 s passed, with two rows 500-1,100 positions deep (session 31).

Prefill is priced by position (`kvgate.core.prefill_rate`). Every forecast is as good as each row's
likely end: its max_tokens, or where it may stop at EOS, a typical answer here (`likely_decode`). It is
a forecast, not a bound: with only decode running it came within +-0.2 s on 18 of 24 probes (12 to 3 s
ahead); with prompt chunks mixing in and a load generator on the same two cores, 5 of 12 admitted
requests missed a 2 s budget by up to 0.57 s (session 31's QA).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import deque

from kvgate.config import SchedulerConfig
from kvgate.core.admission import group_blocks
from kvgate.core.prefill_rate import prefill_seconds
from kvgate.core.snapshot import EngineSnapshot, WaiterView

DEFAULT_STEP_SECONDS = 0.05  # Retry-After's step time before any step was measured
LIKELY_TOKENS = 256  # an unset max_tokens' likely answer before MIN_STOPS rows stopped (likely_steps_left)
MIN_STOPS = 4
OUTLIER = 3.0  # a tick period over this many times the median counts as this many


PRIOR_READ_BYTES_PER_S = {"cpu": 10e9, "cuda": 500e9}  # slow for each: a prior errs late
PRIOR_FLOOR_S = 0.002


def step_prior(weights_bytes: int, device_type: str) -> float:
    """A decode tick's seconds before any was timed: its weights read at a rate slower than any machine
    these run on gives (QA pass 16: a fresh server priced its first burst's ticks at a flat 50 ms, and
    told rows free in 1.4-2.1 s to retry in 10 s; then at its first prompt chunk, 15 s for 0.8 s)."""
    rate = PRIOR_READ_BYTES_PER_S.get(device_type, PRIOR_READ_BYTES_PER_S["cpu"])
    return max(PRIOR_FLOOR_S, weights_bytes / rate)


def typical_step(snap: EngineSnapshot) -> float | None:
    """Seconds per decode tick now, for walks of many ticks: the mean of the recent decode-only tick
    periods (else of the forwards without a prompt chunk), each clipped at OUTLIER x their median;
    before any decode tick, the shortest step timed (a prompt chunk does at least a decode tick's
    work: the clipped mean of prompt chunks made a fresh server's first burst wait 129 s for rows
    free in 3, session 32); the EMA before any; None before any step. A mean, since a walk adds
    ticks up: the event loop's hiccups (one tick in a few, twice as long) belong in the sum, and the
    median left them out (QA pass 4: 5 of 12 admitted requests late under a mixed load). Clipped,
    so that one rare stall (a first 2-row step warming its kernels took 0.33 s) does not stretch a
    walk of hundreds of ticks."""
    recent = sorted(snap.recent_decode_periods or snap.recent_decode_steps)
    if not recent:  # a prompt chunk is at least a tick's work; the prior, a tick's weights read slowly
        first = [t for t in (snap.step_prior, min(snap.recent_steps, default=None)) if t is not None]
        return min(first) if first else snap.step_time_ema
    cap = OUTLIER * recent[len(recent) // 2]
    return sum(min(t, cap) for t in recent) / len(recent)


def measured_rows(snap: EngineSnapshot) -> float:
    """The rows the typical step was measured at: the recent decode ticks' mean (1 before any)."""
    rows = snap.recent_decode_rows
    return sum(rows) / len(rows) if rows else 1.0


def row_cost(snap: EngineSnapshot, step: float) -> float:
    """The cost of a row (`decode_row_seconds`), at most the step's share per row it was measured at: a
    batched tick never costs more a row than a tick of its rows, each alone."""
    return min(snap.decode_row_seconds, step / max(measured_rows(snap), 1.0))


def step_at(snap: EngineSnapshot, step: float, rows: float) -> float:
    """The typical step moved to `rows` rows by the cost of a row (`row_cost`), at least half of it:
    measured at 1 row (the startup calibration), a burst's 2-row ticks came out 15-25% longer, and
    16-row ones several times (session 32, QA pass 5's F1)."""
    return max(step + row_cost(snap, step) * (rows - measured_rows(snap)), step / 2)


def decode_seconds(snap: EngineSnapshot, step: float, steps: int) -> float:
    """Seconds for the next `steps` ticks of the running rows, each row running its `steps_left`: the
    typical `step` now, moved by the cost of a row to the rows still running (`step_at`), plus the
    probe's seconds per position (at most the step over the positions it reads now) for every position
    they have grown by, less those of the rows that have ended (a stretch of ticks averaging at least
    half the step)."""
    c, b, r0 = snap.decode_position_seconds, row_cost(snap, step), measured_rows(snap)
    if steps <= 0:
        return 0.0
    if (c <= 0 and b <= 0) or not snap.rows:
        return steps * step
    rows = sorted((r.steps_left, r.prompt_len + r.generated) for r in snap.rows)
    now = sum(ctx for _, ctx in rows)  # the positions today's step reads
    # the positions today's step reads cost at most the step itself: a probe timed on a busy host (one
    # thread waiting to be scheduled) once read 700x the kernel's cost, and a 60 s Retry-After answered
    # a wait of 8 s (QA pass 9)
    c = min(c, step / max(now, 1))
    total, k, running, contexts = 0.0, 0, len(rows), now
    for left, ctx in rows + [(math.inf, 0)]:
        end = min(left, steps)
        if end > k:  # ticks k..end-1 with `running` rows, each at its context + tick
            n = end - k
            grown = running * (k + end - 1) * n / 2 + n * contexts
            total += n * max(step + b * (running - r0) + c * (grown / n - now), step / 2)
            k = end
        if k >= steps:
            break
        running, contexts = running - 1, contexts - ctx
    return total


def typical_answer(snap: EngineSnapshot) -> int | None:
    """The tokens 9 in 10 of the recent rows that stopped by themselves here wrote (None before
    MIN_STOPS did)."""
    lengths = sorted(snap.stop_lengths)
    return lengths[(9 * (len(lengths) - 1)) // 10] if len(lengths) >= MIN_STOPS else None


def likely_decode(snap: EngineSnapshot, r, generated: int = 0) -> int:
    """The tokens a row (RowView) or waiter (WaiterView) that has written `generated` likely writes yet:
    up to its max_tokens, or, where it may stop at EOS, until it has written a typical answer here
    (`typical_answer`; LIKELY_TOKENS for an unset max_tokens before there is one), at least a quarter
    of that more. An explicit max_tokens stands until there is a typical answer. Not the latest end: an
    unset max_tokens is the rest of the context, and rows that stopped in ~1 s were priced at 8,150
    steps, Retry-After 60 (QA pass 16: openai-node slept it in full against an idle server)."""
    decode = r.max_tokens - generated
    typical = typical_answer(snap)
    if not r.may_stop or (typical is None and r.explicit):
        return decode
    typical = LIKELY_TOKENS if typical is None else typical
    return min(decode, max(typical - generated, typical // 4, 1))


def likely_steps_left(snap: EngineSnapshot, r) -> int:
    """A row's steps left, likely: its prompt chunks, then `likely_decode`."""
    return r.steps_left - (r.max_tokens - r.generated) + likely_decode(snap, r, r.generated)


def likely_pending_steps(snap: EngineSnapshot, w: WaiterView) -> int:
    """A request the gate let in, as a row: `likely_decode`, at least 1. Priced at its max_tokens, an
    unset one (the whole context) told a burst onto an idle server to retry in 28-60 s for rows free in
    0.2 s (QA pass 16, on the first version of this)."""
    return max(likely_decode(snap, w), 1)


def likely_rows(snap: EngineSnapshot) -> EngineSnapshot:
    """`snap` with each row's steps_left its likely one (`likely_steps_left`), for the TTFT walk."""
    if not snap.rows:
        return snap
    rows = tuple(dataclasses.replace(r, steps_left=likely_steps_left(snap, r)) for r in snap.rows)
    return dataclasses.replace(snap, rows=rows)


def retry_after(snap: EngineSnapshot, pending: list[WaiterView] | tuple = (), told: int = 0) -> int:
    """Seconds until room is likely: until the soonest-finishing row ends; clamped to [1, 60]. That is
    when a row, and so a queue place, frees up (the queue's head takes the row): a retry needs a
    place, not the head of the line (a queue factor stretched it, and the openai SDK sleeps a
    Retry-After in full). `pending`: requests the gate let in that the snapshot does not show yet; they
    take the free rows first, so they count as rows (`likely_pending_steps`; QA pass 16: in one burst,
    503s said 1 s while the rows just let in ran 4 s more, and the retries came back to fail again).
    `told`: requests of the same burst refused just before this one; each takes the next row's end, so
    they come back spread as places free, not together (QA pass 16: 3 of 8 openai-node streams failed
    their retries against 2 rows, all told 1 s)."""
    steps = [likely_steps_left(snap, r) for r in snap.rows] + [likely_pending_steps(snap, w) for w in pending]
    if not steps:
        return 1
    return retry_after_steps(snap, sorted(steps)[min(told, len(steps) - 1)])


def logprobs_steps(snap: EngineSnapshot, need: int, limit: int) -> int:
    """Steps until `need` bytes of logprobs memory (`limit` in all) are free, at the soonest: each running
    row gives its reservation back when it ends (at its max_tokens at the latest), and what responses
    hold past their rows (being written or sent) comes back at once. Not the soonest row of any kind:
    a row without logprobs frees none (QA pass 15: a 1 s Retry-After for an 11 s wait, 60 s for 3.7 s)."""
    free = limit - sum(r.logprobs_bytes for r in snap.rows)  # free now, and back as soon as sent
    if free >= need:
        return 0
    steps = 0
    for r in sorted((r for r in snap.rows if r.logprobs_bytes), key=lambda r: r.steps_left):
        free, steps = free + r.logprobs_bytes, r.steps_left
        if free >= need:
            break
    return steps


def retry_after_steps(snap: EngineSnapshot, steps: int, queue_wait: float = 0.0) -> int:
    """Seconds `steps` decode steps take from now, less `queue_wait` (a retry that waits in the queue
    that long is in time), clamped to [1, 60] (a Retry-After)."""
    step = typical_step(snap) or DEFAULT_STEP_SECONDS
    return int(min(60, max(1, round(decode_seconds(snap, step, steps) - queue_wait))))


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

    Admission: the running rows and the waiters ahead are walked by their likely ends
    (`likely_rows`, `likely_pending_steps`), as Retry-After is: walked to an unset max_tokens (the rest
    of the context), every request behind a full batch of openai-node's rows was refused a --max-ttft
    of seconds, told to retry in 60 s, for rows that ended in 1 s (session 41). Walking them, the
    request is admitted once enough rows and blocks are free for every waiter ahead of it and itself,
    at the tick after that step (with rows running, never before the step in flight ends). Prefill:
    every prompt token still to prefill ahead of it plus its own, each at the fitted cost of its
    position -- exact with one prompt prefilling, an upper bound when chunks are shared round-robin.
    `cached`: the newcomer's prompt tokens the prefix cache holds (not prefilled, not allocated); `n`:
    its choices. Before any prompt chunk large enough to time was prefilled, the prefill counts as 0 s:
    the forecast is then a lower bound (the admission wait alone), never switched off while steps are
    timed."""
    line, step = snap.prefill_line, typical_step(snap)
    if step is None:
        return None
    snap = likely_rows(snap)
    waiters = list(snap.waiters) + list(pending)
    spans = [(r.prompt_len - r.prompt_left, r.prompt_len) for r in snap.rows if r.prompt_left > 0]
    spans += [(0, w.prompt_len) for w in waiters] + [(cached, P)]
    ahead = sum(end - start for start, end in spans)
    prefill = sum(prefill_seconds(line, start, end) for start, end in spans)
    need = group_blocks(cfg, P, max_tokens, n, cached // cfg.block_size)
    ticks = admission_tick(cfg, snap, waiters, need, n)
    if ticks is None:
        admit = float("inf")
    elif ticks == 0:
        admit = step if snap.rows else 0.0  # admitted at the worker's next tick: after the step in flight
    else:
        # the running rows' last tick: past it only simulated waiters run, each tick at `step`
        horizon = max((r.steps_left for r in snap.rows), default=0)
        later = step_at(snap, step, max(1, min(cfg.max_seqs, len(waiters))))  # the waiters' own ticks
        admit = decode_seconds(snap, step, min(ticks + 1, horizon)) + max(0, ticks + 1 - horizon) * later
    return admit, prefill, ahead


def admission_tick(cfg: SchedulerConfig, snap: EngineSnapshot, waiters: list[WaiterView], need: int, n: int):
    """The tick (0: now) at which a newcomer needing `n` rows and `need` blocks is admitted, or None
    if never. The running rows end by their remaining steps; the waiters ahead take the rows and
    blocks that free up first, in FIFO order, and each then runs its prompt chunks and its likely
    answer (`likely_pending_steps`) before it ends in turn. Without that second part, a fifth request
    behind two rows and two waiters found no room in sight and was told to retry in 60 s, where about
    3 s was true (the retry-herd bench, session 32)."""
    chunk = max(1, cfg.prefill_chunk)
    ends = [(r.steps_left, r.blocks) for r in snap.rows]
    heapq.heapify(ends)
    rows, blocks = cfg.max_seqs - len(snap.rows), snap.kv_blocks_available
    queue = deque(waiters)
    tick = 0
    while True:
        while queue and rows >= queue[0].choices and blocks >= queue[0].blocks:
            w = queue.popleft()
            rows, blocks = rows - w.choices, blocks - w.blocks
            end = tick + 1 + -(-w.prompt_len // chunk) + likely_pending_steps(snap, w)
            for k in range(w.choices):  # each choice's row frees then; the blocks go with the first
                heapq.heappush(ends, (end, w.blocks if k == 0 else 0))
        if not queue and rows >= n and blocks >= need:
            return tick
        if not ends:
            return None
        tick, freed = heapq.heappop(ends)
        rows, blocks = rows + 1, blocks + freed
