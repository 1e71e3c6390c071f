"""The engine state the worker thread owns, and the two exits every request leaves through.

`EngineState` holds the FIFO queue, the running rows (keyed by request id), the KV cache manager, the
counters, the step timings and the outbox of events for this step. Only the worker touches it; other
threads see it through `EngineSnapshot` (see `kvgate.core.snapshot`).

Exits:
- `leave_queue(entry, event)`: a waiter leaves without being admitted (refused, cancelled, drained).
- `finish(row, reason)`: the single exit of every admitted request. Its blocks go back first and
  exactly once, then the held-back text is flushed (a stop string completed in that tail makes the
  reason `stop`); an error while flushing loses the tail, never the blocks or the final event.
"""

from __future__ import annotations

import logging
import operator
import time
from collections import deque
from dataclasses import dataclass, field

from kvgate.core.inbox import Inbox
from kvgate.core.kv_cache import KVCacheManager, choice_blocks
from kvgate.core.logprob_budget import LogprobBudget
from kvgate.core.prefill_rate import PrefillFit
from kvgate.core.rows import Row, WaitEntry
from kvgate.core.side_waits import grammar_steps_left
from kvgate.core.snapshot import Counters, EngineSnapshot, RowView
from kvgate.request import Finished, RequestHandle, Result
from kvgate.structured.compiler import held_for, kept_for

_COUNTER_FIELDS = operator.attrgetter(*Counters.__slots__)  # a snapshot's copy of the counts, one C call

log = logging.getLogger("kvgate.engine")

RECENT_STEPS = 32
ROW_SAMPLES = 9  # ticks kept per row count for the cost of a row (their median)
MIN_ROW_TICKS = 3  # ticks a row count needs before it enters the cost of a row (a median of 3)
MIN_TIMED_PREFILL = 32  # prompt tokens a step must prefill to be timed: tiny tail chunks overstate the rate


@dataclass
class StepTimes:
    ema: float | None = None  # smoothed seconds per step
    prefill: PrefillFit = field(default_factory=PrefillFit)  # seconds per prompt token, by position
    # the fastest step that prefilled a whole chunk and nothing else: on an idle server a prompt of any
    # length takes at least its length times this (a shorter chunk pays the step's fixed cost over
    # fewer tokens), so the TTFT budget's 400 stands on a lower bound
    prefill_token_best: float | None = None
    slowest: float = 0.0
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    recent_decode: deque = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))  # no prompt chunk
    position_seconds: float = 0.0  # a decode step's growth per row context position (the probe's)
    prior: float = 0.05  # a decode tick before any was timed (SchedulerConfig.decode_step_prior)
    # start-to-start seconds of decode-only ticks: the forward plus the worker's own scheduling, update
    # and publishing, and whatever the event loop takes from it (session 31: the forward alone was
    # 15-20% short, and a forecast of 1.5 s became a 1.94 s wait)
    recent_decode_periods: deque = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    recent_decode_rows: deque = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))  # theirs
    # rows -> the last tick periods at that many rows: the cost of a row, kept while the load sits at
    # one count (the recent periods then say nothing of it)
    by_rows: dict = field(default_factory=dict)
    row_cost: float = 0.0  # row_slope(by_rows), kept up to date by observe_period (once a tick)
    stop_lengths: deque = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))  # tokens out, by stop

    def observe_period(self, seconds: float, rows: int = 1) -> None:
        self.recent_decode_periods.append(seconds)
        self.recent_decode_rows.append(rows)
        self.by_rows.setdefault(rows, deque(maxlen=ROW_SAMPLES)).append(seconds)
        self.row_cost = row_slope(self.by_rows)

    def observe(
        self, seconds: float, prefilled: int, prefill_chunk: int, alone: bool = False, position: float = 0.0
    ) -> None:
        """`alone`: the step ran prompt chunks and no decode rows (what an idle server's prefill is);
        `position`: the prefilled tokens' mean position in their prompts."""
        self.ema = seconds if self.ema is None else 0.8 * self.ema + 0.2 * seconds
        self.slowest = max(self.slowest, seconds)
        self.recent.append(seconds)
        if not prefilled:
            self.recent_decode.append(seconds)
        if prefilled >= min(MIN_TIMED_PREFILL, prefill_chunk):
            self.prefill.add(position, seconds / prefilled)
        if alone and prefilled >= prefill_chunk:  # a whole chunk: its fixed cost spread as thin as can be
            t = seconds / prefilled
            best = self.prefill_token_best
            self.prefill_token_best = t if best is None else min(best, t)


def row_slope(by_rows: dict) -> float:
    """Seconds a decode tick gains per row: the least-squares slope over the row counts seen (each
    count once, at the median of its last ROW_SAMPLES ticks: a 0.33 s warm-up tick among sixteen of
    17.9 ms made one smoothed mean 5x the cost of a row), at least 0; 0 before two counts were seen.
    A count enters with MIN_ROW_TICKS ticks: a first 4-row tick warming its kernels, alone, made the
    cost of a row ~0.1 s on a fresh server, and a Retry-After of 60 s for rows free in 2.6 (QA pass 7)."""
    counts = {
        n: sorted(v)[len(v) // 2] if isinstance(v, deque) else v
        for n, v in by_rows.items()
        if not isinstance(v, deque) or len(v) >= MIN_ROW_TICKS
    }
    if len(counts) < 2:
        return 0.0
    xs, ys = list(counts), list(counts.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    vx = sum((x - mx) ** 2 for x in xs)
    return max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / vx)


class EngineState:
    def __init__(
        self,
        kv: KVCacheManager,
        inbox: Inbox,
        prefill_chunk: int,
        logprobs_memory: int = 32 << 20,
        tokenizer=None,
    ):
        self.kv = kv
        self.logprobs = LogprobBudget(logprobs_memory)  # bytes the rows' logprobs hold (logprob_budget)
        self.tokenizer = tokenizer  # whose grammar compiler's slots go into the snapshot
        self.inbox = inbox
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[WaitEntry] = deque()
        self.running: dict[int, Row] = {}
        self.prefill_rr: deque[int] = deque()  # rows still prefilling, in round-robin order
        self.counters = Counters()
        self.times = StepTimes()
        self.outbox: list[tuple[RequestHandle, object]] = []
        self.absorbed = 0  # highest submission sequence taken into `waiting`
        self._version = 0
        self._hashes_version = -1
        self._hashes: frozenset = frozenset()

    def emit(self, handle: RequestHandle, event) -> None:
        """Queue an event; the engine delivers the outbox after publishing the snapshot."""
        self.outbox.append((handle, event))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- exits ----------------------------------------------------------------------------------
    def leave_queue(self, entry: WaitEntry, event) -> None:
        """`entry` (already removed from `waiting`) ends without admission: `event` is the last event
        of each of its choices."""
        self.inbox.left_queue(entry.choices)
        for h in [entry.handle, *entry.followers]:
            self.emit(h, event)

    def cancelled_in_queue(self, entry: WaitEntry, handles: list[RequestHandle] | None = None) -> None:
        """`handles` (default: every choice of `entry`, already out of `waiting`) were cancelled while
        queued: each gets a final, empty, `cancelled` result."""
        handles = [entry.handle, *entry.followers] if handles is None else handles
        now = time.monotonic()
        self.inbox.left_queue(len(handles))
        for h in handles:
            self.counters.aborted += 1
            result = Result(
                [], "", "cancelled", entry.prompt_len, 0, None, h.submitted_at, None, None, now, []
            )
            self.emit(h, Finished(result, ""))

    def finish(
        self, row: Row, reason: str, *, error: str | None = None, stop_reason=None, flush=True
    ) -> None:
        """The single exit of an admitted request (see the module doc)."""
        if self.running.pop(row.id, None) is None:
            return  # already finished: its blocks went back then
        self.kv.free(row.id)
        if reason == "stop":  # how long answers that end by themselves run here (forecast.likely_steps_left)
            self.times.stop_lengths.append(len(row.out_ids))
        if row.grammar_pin is not None:
            row.grammar_pin.compiler.release(row.grammar_pin.text)
            row.grammar_pin = None
        if row.handle.request.held is None:  # nobody keeps its logprobs past its last event
            self.logprobs.give_back(row.id)
        self.counters.kv_blocks_held = self.kv.referenced_blocks
        if row.id in self.prefill_rr:
            self.prefill_rr.remove(row.id)
        for fid in row.followers:  # choices still waiting for prompt blocks this row never computed
            f = self.running.get(fid)
            if f is not None and row.computed < f.shared_positions:
                self.finish(f, "cancelled" if reason == "cancelled" else "error", error=error, flush=False)
        tail = ""
        if flush:
            try:
                emit, hit = row.stop.push(row.detok.flush(), final=True)
                if hit:  # the stop string completed in the held-back tail: it ended the output
                    tail, reason, stop_reason = emit, "stop", "string"
                else:
                    tail = emit + row.stop.flush()
            except Exception:  # the tail is lost; the blocks and the final event are not
                log.exception("flushing the held-back text of a finishing request failed")
        if tail:
            row.text.append(tail)
        c = self.counters
        c.finished += 1
        if reason == "cancelled":
            c.aborted += 1
        out = row.out_ids
        times = row.token_times
        result = Result(
            token_ids=list(out),
            text="".join(row.text),
            finish_reason=reason,
            prompt_tokens=len(row.prompt),
            completion_tokens=len(out),
            budget_cap=row.budget_cap,
            submitted_at=row.handle.submitted_at,
            admitted_at=row.admitted_at,
            first_token_at=times[0] if times else None,
            finished_at=time.monotonic(),
            token_times=list(times),
            error=error,
            stop_reason=stop_reason,
            stop_string=row.stop.matched if stop_reason == "string" else None,
            cached_tokens=row.cached_tokens,
            prompt_logprobs=row.prompt_logprobs,
            prediction_tokens=row.prediction_tokens,
        )
        self.emit(row.handle, Finished(result, tail))

    # ---- publishing -----------------------------------------------------------------------------
    def _cached_hashes(self) -> frozenset:
        """The registered prompt-block hashes, rebuilt only when they changed."""
        if self._hashes_version != self.kv.version:
            self._hashes_version = self.kv.version
            self._hashes = self.kv.registered_hashes()
        return self._hashes

    def _grammar_slot_steps(self) -> int:
        """`EngineSnapshot.grammar_slot_steps` (the worker's own state: read here, on the worker)."""
        steps = grammar_steps_left(self)
        if not steps:
            return 0
        held = held_for(self.tokenizer)
        return steps[held] if held in steps else min(steps.values())

    def snapshot(self) -> EngineSnapshot:
        self._version += 1
        kv = self.kv
        chunk = self.prefill_chunk
        t = self.times
        kept = kept_for(self.tokenizer)
        return EngineSnapshot(
            version=self._version,
            published_at=time.monotonic(),
            counters=Counters(*_COUNTER_FIELDS(self.counters)),
            rows=tuple(
                RowView(
                    r.id,
                    r.steps_left(chunk),
                    kv.held_by(r.id),
                    len(r.prompt),
                    r.prompt_left,
                    len(r.out_ids),
                    r.max_tokens,
                    self.logprobs.held_by(r.id),
                    not r.handle.request.ignore_eos,
                    r.handle.request.max_tokens is not None,
                )
                for r in self.running.values()
            ),
            waiters=tuple(
                w.view(choice_blocks(w.prompt_len, w.max_tokens, w.choices, kv.block_size))
                for w in self.waiting
            ),
            absorbed=self.absorbed,
            kv_blocks_total=kv.total,
            kv_blocks_free=kv.free_blocks,
            kv_blocks_cached=kv.cached_blocks,
            cached_hashes=self._cached_hashes(),
            step_time_ema=t.ema,
            prefill_line=t.prefill.line(),
            prefill_token_time_best=t.prefill_token_best,
            slowest_step=t.slowest,
            recent_steps=tuple(t.recent),
            logprobs_bytes_held=self.logprobs.held,
            logprobs_bytes_peak=self.logprobs.peak,
            grammars_kept=kept[0],
            grammars_running=kept[1],
            grammar_slot_steps=self._grammar_slot_steps() if kept[1] else 0,  # no row walk without grammars
            stop_lengths=tuple(t.stop_lengths),
            step_prior=t.prior,
            recent_decode_steps=tuple(t.recent_decode),
            recent_decode_periods=tuple(t.recent_decode_periods),
            recent_decode_rows=tuple(t.recent_decode_rows),
            decode_row_seconds=t.row_cost,
            decode_position_seconds=t.position_seconds,
        )
