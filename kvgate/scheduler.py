"""Continuous batching with exact KV admission. Runs only on the engine's worker thread.

Each tick, in this order: drop cancelled waiters -> abort cancelled rows -> admit from the FIFO head
while rows and KV blocks allow -> refuse waiters past their deadline -> one forward step holding every
decoding row plus prompt chunks (round-robin, at most `prefill_chunk` prompt tokens) -> sample, stop,
and finish rows through the single exit `_finish`, which is the only place blocks are released.

Why these choices:
- Rows are a dict keyed by request id, never a positional list: a row leaving the batch cannot hand
  its sampler, stop matcher or reply channel to a neighbour.
- Strict FIFO: a head that does not fit blocks the line. Skipping ahead would let a stream of small
  requests starve a large one; there is no measured reason to allow it.
- A request holds `ceil((prompt + max_tokens) / block_size)` blocks from admission to its end, so a
  running row can never run out of KV and no preemption exists.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from kvgate.kv import BlockAllocator, blocks_for
from kvgate.request import (
    Admitted,
    BudgetCap,
    Finished,
    Refusal,
    Refused,
    RequestHandle,
    Result,
    Token,
)
from kvgate.sampling import Sampler, sample_batch
from kvgate.step import DecodeInput, PrefillInput, build_step
from kvgate.stop import StopMatcher
from kvgate.tokenizer import IncrementalDetokenizer, TextTokenizer


@dataclass
class Counters:
    """Cheap to read from any thread (plain ints, written only by the worker and submitters)."""

    prefill_chunks: int = 0
    prefill_tokens: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    steps: int = 0
    queue_rejected: int = 0
    rejected_context_length: int = 0
    rejected_kv_budget: int = 0
    rejected_kv_timeout: int = 0
    rejected_ttft_budget: int = 0
    rejected_unavailable: int = 0
    budget_caps: int = 0
    aborted: int = 0
    failed: int = 0
    admitted: int = 0
    finished: int = 0
    kv_blocks_peak: int = 0
    kv_blocks_held: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0


@dataclass
class Row:
    handle: RequestHandle
    prompt: list[int]
    max_tokens: int
    blocks: list[int] | None
    sampler: Sampler
    stop: StopMatcher
    detok: IncrementalDetokenizer
    budget_cap: BudgetCap | None
    admitted_at: float
    tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    computed: int = 0
    token_times: list[float] = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt)

    @property
    def prompt_left(self) -> int:
        """Prompt tokens still to prefill (`computed` counts generated tokens too once decoding)."""
        return max(0, len(self.prompt) - self.computed)

    @property
    def out_ids(self) -> list[int]:
        return self.tokens[len(self.prompt) :]


@dataclass
class WaitEntry:
    handle: RequestHandle
    max_tokens: int
    explicit: bool  # max_tokens given by the caller: never capped
    requested: int  # what the caller asked for, or the context ceiling when unset
    cap: BudgetCap | None
    deadline: float


class Scheduler:
    def __init__(
        self,
        *,
        forward,
        tokenizer: TextTokenizer,
        allocator: BlockAllocator,
        block_size: int,
        max_seqs: int,
        max_queue: int,
        max_queue_wait: float,
        prefill_chunk: int,
        min_cap_tokens: int,
        max_model_len: int,
        attn_token_cap: int,
        group_size: int,
        kv_bytes_per_token: int,
        device: torch.device,
        max_ttft: float | None = None,
    ):
        self.forward = forward
        self.tok = tokenizer
        self.alloc = allocator
        self.block_size = block_size
        self.max_seqs = max_seqs
        self.max_queue = max_queue
        self.max_queue_wait = max_queue_wait
        self.prefill_chunk = prefill_chunk
        self.min_cap_tokens = min_cap_tokens
        self.max_model_len = max_model_len
        self.attn_token_cap = attn_token_cap
        self.group_size = group_size
        self.kv_bytes_per_token = kv_bytes_per_token
        self.device = device
        self.counters = Counters()
        self.lock = threading.Condition(threading.Lock())
        self.waiting: deque[WaitEntry] = deque()
        self.running: dict[int, Row] = {}
        self._prefill_rr: deque[int] = deque()
        self.step_time_ema: float | None = None
        # Seconds per prompt token in steps that prefill (decode rows beside them included): what the
        # TTFT budget (`max_ttft`) predicts with. None until a step has prefilled.
        self.max_ttft = max_ttft
        self.prefill_token_time_ema: float | None = None
        self.fault_hook = None  # tests: called before each forward; may raise
        self.closed_reason: str | None = None  # set when no new requests are accepted

    # ---- submission (any thread) ------------------------------------------------------------
    def submit(self, handle: RequestHandle) -> None:
        req = handle.request
        P = len(req.prompt_ids)
        c = self.counters
        explicit = req.max_tokens is not None
        ceiling = req.max_tokens if explicit else self.max_model_len - P
        limit_pos = self.alloc.total * self.block_size
        if P + (ceiling if explicit else 1) > self.max_model_len or P == 0:
            c.rejected_context_length += 1
            raise self._context_refusal(P, req.max_tokens)
        cap = None
        requested = ceiling  # before any cap: what the caller asked for, or the context ceiling
        if blocks_for(P + ceiling, self.block_size) > self.alloc.total:
            if explicit or P + 1 > limit_pos:
                c.rejected_kv_budget += 1
                raise self._budget_refusal(P, ceiling if explicit else 1)
            cap = BudgetCap(ceiling, limit_pos - P, "kv_budget")
            ceiling = limit_pos - P
        with self.lock:
            if self.closed_reason is not None:
                c.rejected_unavailable += 1
                raise Refusal(
                    "engine_unavailable",
                    f"the server is not accepting requests: {self.closed_reason}. Retry against another replica or later.",
                    503,
                    retry_after=self.retry_after(),
                )
            if len(self.waiting) >= self.max_queue:
                c.queue_rejected += 1
                raise Refusal(
                    "queue_full",
                    f"server is at capacity: {len(self.waiting)} requests are already queued (limit "
                    f"{self.max_queue}); retry after the Retry-After interval.",
                    503,
                    retry_after=self.retry_after(queued=len(self.waiting)),
                )
            if self.max_ttft is not None:
                self._check_ttft_budget(P, ceiling)
            deadline = handle.submitted_at + self.max_queue_wait
            self.waiting.append(WaitEntry(handle, ceiling, explicit, requested, cap, deadline))
            self.lock.notify_all()

    def _context_refusal(self, P: int, max_tokens: int | None) -> Refusal:
        want = P + (max_tokens or 1)
        if P == 0:
            msg = "the prompt is empty: send at least one token of prompt."
        else:
            msg = (
                f"this request needs {want} positions (prompt {P} + max_tokens {max_tokens or 1}) but the "
                f"model's context is {self.max_model_len}. Shorten the prompt or lower max_tokens to at most "
                f"{max(0, self.max_model_len - P)}."
            )
        return Refusal(
            "context_length_exceeded",
            msg,
            400,
            estimated_bytes=want * self.kv_bytes_per_token,
            limit_bytes=self.max_model_len * self.kv_bytes_per_token,
            positions=want,
            positions_limit=self.max_model_len,
        )

    def _budget_refusal(self, P: int, max_tokens: int) -> Refusal:
        want = P + max_tokens
        limit_pos = self.alloc.total * self.block_size
        need = blocks_for(want, self.block_size)
        return Refusal(
            "kv_budget_exceeded",
            f"this request can never fit: prompt {P} + max_tokens {max_tokens} = {want} positions need "
            f"{need} KV blocks ({need * self.block_size * self.kv_bytes_per_token:,} bytes) but the whole KV "
            f"pool is {self.alloc.total} blocks ({limit_pos} positions, "
            f"{limit_pos * self.kv_bytes_per_token:,} bytes). Lower max_tokens to at most "
            f"{max(0, limit_pos - P)}, shorten the prompt, or start the server with a larger --memory-limit.",
            400,
            estimated_bytes=need * self.block_size * self.kv_bytes_per_token,
            limit_bytes=limit_pos * self.kv_bytes_per_token,
            positions=want,
            positions_limit=limit_pos,
        )

    def predicted_ttft(self, P: int, max_tokens: int) -> tuple[float, float, int] | None:
        """(seconds until admission, seconds of prefill, prompt tokens to prefill) for a request
        arriving now, or None before any prefill was timed. Called with `self.lock` held.

        Admission: the running rows are assumed to run to their max_tokens; walking them by remaining
        steps, the request is admitted once enough rows and blocks are free for every waiter ahead
        of it and itself, at the tick after that step (with rows running, never before the step in
        flight ends). Prefill: every prompt token still to prefill ahead of it (running rows and
        waiters) plus its own, at the measured seconds per prefill token -- exact with one prompt
        prefilling, an upper bound when chunks are shared round-robin."""
        per_token, step = self.prefill_token_time_ema, self.step_time_ema
        if per_token is None or step is None:
            return None
        rows = list(self.running.values())
        waiting = list(self.waiting)
        ahead = sum(r.prompt_left for r in rows)
        ahead += sum(len(w.handle.request.prompt_ids) for w in waiting) + P
        slots = len(waiting) + 1 - (self.max_seqs - len(rows))
        blocks = blocks_for(P + max_tokens, self.block_size) - self.alloc.free
        blocks += sum(
            blocks_for(len(w.handle.request.prompt_ids) + w.max_tokens, self.block_size) for w in waiting
        )
        # admitted at the worker's next tick: after the step in flight, if rows are running
        admit = step if rows else 0.0
        if slots > 0 or blocks > 0:
            admit = float("inf")
            done = sorted((self._steps_left(r), len(r.blocks)) for r in rows)
            for steps, nblocks in done:
                slots, blocks = slots - 1, blocks - nblocks
                if slots <= 0 and blocks <= 0:
                    admit = (steps + 1) * step
                    break
        return admit, ahead * per_token, ahead

    def _check_ttft_budget(self, P: int, max_tokens: int) -> None:
        est = self.predicted_ttft(P, max_tokens)
        if est is None:
            return
        admit, prefill, ahead = est
        if admit + prefill <= self.max_ttft:
            return
        self.counters.rejected_ttft_budget += 1
        wait = "no room is in sight" if admit == float("inf") else f"{admit:.1f}s until rows and KV free up"
        raise Refusal(
            "ttft_budget_exceeded",
            f"this request would wait about {admit + prefill:.1f}s for its first token ({wait}, then "
            f"{ahead} prompt tokens to prefill at {1 / self.prefill_token_time_ema:.0f} tokens/s), more than "
            f"this server's --max-ttft {self.max_ttft:g}s. Retry after the Retry-After interval.",
            429,
            retry_after=int(min(60, max(1, round(min(admit + prefill, 3600) - self.max_ttft)))),
        )

    def _steps_left(self, r: Row) -> int:
        """Steps until a row ends at the latest: its prefill chunks, then its remaining tokens."""
        return r.max_tokens - len(r.out_ids) + -(-r.prompt_left // self.prefill_chunk)

    def retry_after(self, queued: int = 0) -> int:
        """Seconds until room is likely: the soonest-finishing row's remaining steps x step time."""
        step = self.step_time_ema or 0.05
        rows = list(self.running.values())
        if not rows:
            return 1
        remaining = sorted(self._steps_left(r) for r in rows)
        est = remaining[0] * step * (1 + queued / max(1, len(rows)))
        return int(min(60, max(1, round(est))))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one tick (worker thread) -----------------------------------------------------------
    def tick(self) -> None:
        now = time.monotonic()
        self._drop_cancelled_waiters()
        for row in [r for r in self.running.values() if r.handle.cancelled]:
            self._finish(row, "cancelled")
        self._admit()
        self._expire(now)
        if self.running:
            self._step()

    def next_deadline(self) -> float | None:
        with self.lock:
            return min((w.deadline for w in self.waiting), default=None)

    def _drop_cancelled_waiters(self) -> None:
        with self.lock:
            gone = [w for w in self.waiting if w.handle.cancelled]
            for w in gone:
                self.waiting.remove(w)
        for w in gone:
            self.counters.aborted += 1
            self._send_final_unadmitted(w.handle, "cancelled")

    def _send_final_unadmitted(self, handle: RequestHandle, reason: str, error: str | None = None) -> None:
        now = time.monotonic()
        result = Result(
            [],
            "",
            reason,
            len(handle.request.prompt_ids),
            0,
            None,
            handle.submitted_at,
            None,
            None,
            now,
            [],
            error,
        )
        handle.events.put(Finished(result, ""))

    def _admit(self) -> None:
        while True:
            with self.lock:
                if not self.waiting:
                    return
                head = self.waiting[0]
            if len(self.running) >= self.max_seqs:
                return
            P = len(head.handle.request.prompt_ids)
            mt, cap = head.max_tokens, head.cap
            need = blocks_for(P + mt, self.block_size)
            if not self.alloc.can_allocate(need):
                fits = self.alloc.free * self.block_size - P
                if head.explicit or fits < max(1, self.min_cap_tokens):
                    return  # the head blocks the line (strict FIFO)
                cap = BudgetCap(head.requested, fits, "kv_free_now")
                mt = fits
                need = blocks_for(P + mt, self.block_size)
            blocks = self.alloc.allocate(need)
            assert blocks is not None
            with self.lock:
                self.waiting.popleft()
            self._start_row(head, blocks, mt, cap)

    def _start_row(self, w: WaitEntry, blocks: list[int], max_tokens: int, cap: BudgetCap | None) -> None:
        h = w.handle
        req = h.request
        stop_ids = set(req.stop_token_ids)
        if not req.ignore_eos:
            stop_ids |= self.tok.eog_ids
        row = Row(
            handle=h,
            prompt=list(req.prompt_ids),
            max_tokens=max_tokens,
            blocks=blocks,
            sampler=Sampler(req.sampling, req.prompt_ids, self.tok.vocab_size),
            stop=StopMatcher(stop_ids, req.stop),
            detok=IncrementalDetokenizer(self.tok, req.prompt_ids),
            budget_cap=cap,
            admitted_at=time.monotonic(),
        )
        row.tokens = list(req.prompt_ids)
        self.running[h.id] = row
        self._prefill_rr.append(h.id)
        c = self.counters
        c.admitted += 1
        c.prompt_tokens += len(row.prompt)
        if cap is not None:
            c.budget_caps += 1
        c.kv_blocks_held += len(blocks)
        c.kv_blocks_peak = max(c.kv_blocks_peak, c.kv_blocks_held)
        h.events.put(Admitted(max_tokens, cap, len(row.prompt)))

    def _expire(self, now: float) -> None:
        with self.lock:
            late = [w for w in self.waiting if w.deadline <= now]
            for w in late:
                self.waiting.remove(w)
        for w in late:
            self.counters.rejected_kv_timeout += 1
            P = len(w.handle.request.prompt_ids)
            need = blocks_for(P + w.max_tokens, self.block_size)
            if self.alloc.can_allocate(need) and len(self.running) >= self.max_seqs:
                why = f"all {self.max_seqs} batch rows (--max-seqs) stayed busy"
            else:
                why = (
                    f"it needs {need} blocks of KV (prompt {P} + max_tokens {w.max_tokens}) and "
                    f"{self.alloc.free} of {self.alloc.total} are free"
                )
            w.handle.events.put(
                Refused(
                    Refusal(
                        "kv_memory_unavailable",
                        f"no room for this request right now: {why} after waiting {self.max_queue_wait:g}s. "
                        "Retry after the Retry-After interval, or lower max_tokens.",
                        429,
                        retry_after=self.retry_after(),
                        estimated_bytes=need * self.block_size * self.kv_bytes_per_token,
                        limit_bytes=self.alloc.total * self.block_size * self.kv_bytes_per_token,
                        positions=P + w.max_tokens,
                        positions_limit=self.alloc.total * self.block_size,
                    )
                )
            )

    def _step(self) -> None:
        decode_rows = [r for r in self.running.values() if not r.prefilling]
        decodes = [DecodeInput(r.tokens[-1], len(r.tokens) - 1, r.blocks) for r in decode_rows]
        budget = self.prefill_chunk
        prefill_rows: list[Row] = []
        prefills: list[PrefillInput] = []
        served: set[int] = set()
        while budget > 0 and self._prefill_rr:
            rid = self._prefill_rr[0]
            row = self.running.get(rid)
            if row is None or not row.prefilling:
                self._prefill_rr.popleft()
                continue
            if rid in served:
                break
            served.add(rid)
            n = min(budget, len(row.prompt) - row.computed)
            chunk = row.prompt[row.computed : row.computed + n]
            ends = row.computed + n == len(row.prompt)
            prefills.append(PrefillInput(chunk, row.computed, row.blocks, ends))
            prefill_rows.append(row)
            budget -= n
            self._prefill_rr.rotate(-1)
            if ends:
                self._prefill_rr.remove(rid)
        stepped = decode_rows + prefill_rows
        t0 = time.monotonic()
        try:
            batch, d_rows, p_rows = build_step(
                decodes, prefills, self.block_size, self.group_size, self.attn_token_cap, self.device
            )
            if self.fault_hook is not None:
                self.fault_hook(stepped)
            logits = self.forward(batch).cpu()
        except Exception as exc:  # a failed step fails only the rows in it
            self.counters.failed += len(stepped)
            for row in stepped:
                self._finish(row, "error", error=f"{type(exc).__name__}: {exc}")
            return
        dt = time.monotonic() - t0
        self.step_time_ema = dt if self.step_time_ema is None else 0.8 * self.step_time_ema + 0.2 * dt
        c = self.counters
        c.steps += 1
        if decodes:
            c.decode_steps += 1
            c.decode_tokens += len(decodes)
        c.prefill_chunks += len(prefills)
        prefilled = sum(len(p.tokens) for p in prefills)
        c.prefill_tokens += prefilled
        if prefilled >= min(32, self.prefill_chunk):  # tiny tail chunks would overstate the per-token time
            t = dt / prefilled
            ema = self.prefill_token_time_ema
            self.prefill_token_time_ema = t if ema is None else 0.8 * ema + 0.2 * t
        now = time.monotonic()
        sampled = list(zip(decode_rows, d_rows, strict=True))
        for row, p, li in zip(prefill_rows, prefills, p_rows, strict=True):
            row.computed += len(p.tokens)
            if li >= 0:
                sampled.append((row, li))
        if not sampled:
            return
        states = [r.sampler.gen.get_state() for r, _ in sampled]
        try:
            tokens = sample_batch([r.sampler for r, _ in sampled], logits, [li for _, li in sampled])
        except Exception:  # find the row that failed: sample each alone (same draws), so it fails alone
            for (r, _), st in zip(sampled, states, strict=True):
                r.sampler.gen.set_state(st)
            tokens = [None] * len(sampled)
        for (row, li), token in zip(sampled, tokens, strict=True):
            self._sample_append(row, logits[li], now, token)

    def _sample_append(self, row: Row, logits: torch.Tensor, now: float, token: int | None = None) -> None:
        """Append the row's token (sampled here when `token` is None). An error here (e.g. a sampler
        that meets bad penalties state) fails this row alone; outside a try it would kill the worker
        and every row."""
        try:
            self._append(row, row.sampler.sample(logits) if token is None else token, now)
        except Exception as exc:
            if row.handle.id in self.running:
                self.counters.failed += 1
                self._finish(row, "error", error=f"{type(exc).__name__}: {exc}", flush=False)

    def _append(self, row: Row, token: int, now: float) -> None:
        row.computed = len(row.tokens)
        row.tokens.append(token)
        row.token_times.append(now)
        self.counters.generated_tokens += 1
        if row.stop.is_stop_token(token):
            self._finish(row, "stop", stop_reason=f"token:{token}")
            return
        emit, hit = row.stop.push(row.detok.push(token))
        if emit:
            row.text.append(emit)
        row.handle.events.put(Token(token, emit, now))
        if hit:
            self._finish(row, "stop", stop_reason="string", flush=False)
        elif len(row.out_ids) >= row.max_tokens or len(row.tokens) >= self.max_model_len:
            self._finish(row, "length")

    def _finish(
        self, row: Row, reason: str, *, error: str | None = None, stop_reason: str | None = None, flush=True
    ) -> None:
        """The single exit of every admitted request: blocks go back here and only here."""
        tail = ""
        if flush:
            emit, hit = row.stop.push(row.detok.flush())
            tail = emit if hit else emit + row.stop.flush()
        if tail:
            row.text.append(tail)
        if row.blocks is not None:
            self.alloc.release(row.blocks)
            self.counters.kv_blocks_held -= len(row.blocks)
            row.blocks = None
        self.running.pop(row.handle.id, None)
        if row.handle.id in self._prefill_rr:
            self._prefill_rr.remove(row.handle.id)
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
        )
        row.handle.events.put(Finished(result, tail))

    def fail_all(self, reason: str) -> None:
        """The worker is going away: every waiter and row gets a terminal event."""
        with self.lock:
            self.closed_reason = reason
            waiters = list(self.waiting)
            self.waiting.clear()
        for w in waiters:
            self.counters.rejected_unavailable += 1
            w.handle.events.put(
                Refused(
                    Refusal(
                        "engine_unavailable",
                        f"the server stopped before admitting this request: {reason}",
                        503,
                        retry_after=1,
                    )
                )
            )
        for row in list(self.running.values()):
            try:
                self._finish(row, "error", error=reason)
            except Exception:  # keep going: every other row still needs its terminal event
                self.running.pop(row.handle.id, None)
                row.handle.events.put(
                    Finished(
                        Result(
                            list(row.out_ids),
                            "".join(row.text),
                            "error",
                            len(row.prompt),
                            len(row.out_ids),
                            row.budget_cap,
                            row.handle.submitted_at,
                            row.admitted_at,
                            None,
                            time.monotonic(),
                            [],
                            reason,
                        ),
                        "",
                    )
                )
