"""Continuous batching with exact KV admission: commands in, one `SchedulerOutput` per tick out.

Runs only on the engine's worker thread, over `EngineState`. Each tick, in this order:
`apply(commands)` (submits join the FIFO, cancels end their request wherever it is, a drain refuses
the whole queue) -> `schedule(now)`: admit from the FIFO head while rows and KV blocks allow ->
refuse waiters past their deadline -> pick the step: every decoding row plus prompt chunks
(round-robin, at most `prefill_chunk` prompt tokens).

Why these choices:
- Rows are a dict keyed by request id, never a positional list: a row leaving the batch cannot hand
  its sampler, stop matcher or reply channel to a neighbour.
- Strict FIFO: a head that does not fit blocks the line. Skipping ahead would let a stream of small
  requests starve a large one; there is no measured reason to allow it.
- A request holds `ceil((prompt + max_tokens) / block_size)` blocks from admission to its end, so a
  running row can never run out of KV and no preemption exists.
- A failure while admitting one request (building its sampler, detokenizer...) ends that request
  with a 500 and gives its blocks back; the worker and every other request go on.
"""

from __future__ import annotations

import logging
import time

from kvgate.config import SchedulerConfig
from kvgate.core import admission
from kvgate.core.inbox import Cancel, CancelAll, Command, Drain, Submit
from kvgate.core.outputs import SchedulerOutput
from kvgate.core.rows import Row, WaitEntry
from kvgate.core.state import EngineState
from kvgate.core.step_inputs import DecodeInput, PrefillInput
from kvgate.request import Admitted, BudgetCap, Refused
from kvgate.sampling import Sampler
from kvgate.stop import StopMatcher
from kvgate.tokenizer import IncrementalDetokenizer, TextTokenizer

log = logging.getLogger("kvgate.engine")


class Scheduler:
    def __init__(self, state: EngineState, cfg: SchedulerConfig, tokenizer: TextTokenizer):
        self.state = state
        self.cfg = cfg
        self.tok = tokenizer
        self.draining = False

    # ---- commands -------------------------------------------------------------------------------
    def apply(self, commands: list[Command]) -> None:
        s = self.state
        for cmd in commands:
            if isinstance(cmd, Submit):
                s.absorbed = max(s.absorbed, cmd.seq)
                if self.draining:
                    s.counters.rejected_unavailable += 1
                    s.leave_queue(cmd.entry, Refused(admission.shutting_down_refusal()))
                else:
                    s.waiting.append(cmd.entry)
            elif isinstance(cmd, Cancel):
                self.cancel(cmd.request_id)
            elif isinstance(cmd, Drain):
                self.drain()
            elif isinstance(cmd, CancelAll):
                for rid in [w.id for w in s.waiting] + list(s.running):
                    self.cancel(rid)

    def cancel(self, request_id: int) -> None:
        """End the request wherever it is, keeping its partial output; unknown ids are already done."""
        s = self.state
        row = s.running.get(request_id)
        if row is not None:
            s.finish(row, "cancelled")
            return
        for w in s.waiting:
            if w.id == request_id:
                s.waiting.remove(w)
                s.cancelled_in_queue(w)
                return

    def drain(self) -> None:
        """Refuse every queued request now (503 with Retry-After); running rows go on to their end."""
        self.draining = True
        s = self.state
        while s.waiting:
            w = s.waiting.popleft()
            s.counters.rejected_unavailable += 1
            s.leave_queue(w, Refused(admission.shutting_down_refusal()))

    def fail_all(self, reason: str) -> None:
        """The worker is going away: every waiter and row gets its terminal event."""
        s = self.state
        while s.waiting:
            w = s.waiting.popleft()
            s.counters.rejected_unavailable += 1
            s.leave_queue(w, Refused(admission.unavailable_refusal(reason, 1)))
        for row in list(s.running.values()):
            s.finish(row, "error", error=reason, flush=False)

    # ---- one tick -------------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        self._admit(out)
        self._expire(now)
        self._pick_step(out)
        return out

    def next_deadline(self) -> float | None:
        return min((w.deadline for w in self.state.waiting), default=None)

    def _admit(self, out: SchedulerOutput) -> None:
        s, cfg, kv = self.state, self.cfg, self.state.kv
        while s.waiting and len(s.running) < cfg.max_seqs:
            head = s.waiting[0]
            P = head.prompt_len
            mt, cap = head.max_tokens, head.cap
            need = kv.blocks_needed(P + mt)
            if not kv.can_allocate(need):
                fits = kv.free_blocks * cfg.block_size - P
                if head.explicit or fits < max(1, cfg.min_cap_tokens):
                    return  # the head blocks the line (strict FIFO)
                cap = BudgetCap(head.requested, fits, "kv_free_now")
                mt = fits
                need = kv.blocks_needed(P + mt)
            s.waiting.popleft()
            try:
                if not kv.allocate_for(head.id, need):
                    raise AssertionError(f"{need} blocks were free a moment ago and are not now")
                row = self._make_row(head, mt, cap)
            except Exception:
                log.exception("admitting request %d failed", head.id)
                s.counters.kv_blocks_held -= kv.free(head.id)
                s.counters.failed += 1
                s.leave_queue(head, Refused(admission.engine_error_refusal()))
                continue
            self._start_row(row, need)
            out.admitted.append(row.id)

    def _make_row(self, w: WaitEntry, max_tokens: int, cap: BudgetCap | None) -> Row:
        req = w.handle.request
        stop_ids = set(req.stop_token_ids)
        if not req.ignore_eos:
            stop_ids |= self.tok.eog_ids
        return Row(
            handle=w.handle,
            prompt=list(req.prompt_ids),
            max_tokens=max_tokens,
            sampler=Sampler(req.sampling, req.prompt_ids, self.tok.vocab_size),
            stop=StopMatcher(stop_ids, req.stop),
            detok=IncrementalDetokenizer(self.tok, req.prompt_ids),
            budget_cap=cap,
            admitted_at=time.monotonic(),
            tokens=list(req.prompt_ids),
        )

    def _start_row(self, row: Row, blocks: int) -> None:
        s = self.state
        s.running[row.id] = row
        s.prefill_rr.append(row.id)
        c = s.counters
        c.admitted += 1
        c.prompt_tokens += len(row.prompt)
        if row.budget_cap is not None:
            c.budget_caps += 1
        c.kv_blocks_held += blocks
        c.kv_blocks_peak = max(c.kv_blocks_peak, c.kv_blocks_held)
        s.inbox.left_queue()
        s.emit(row.handle, Admitted(row.max_tokens, row.budget_cap, len(row.prompt)))

    def _expire(self, now: float) -> None:
        s = self.state
        late = [w for w in s.waiting if w.deadline <= now]
        if not late:
            return
        retry = admission.retry_after(s.snapshot())
        for w in late:
            s.waiting.remove(w)
            s.counters.rejected_kv_timeout += 1
            refusal = admission.kv_timeout_refusal(self.cfg, w, s.kv.free_blocks, len(s.running), retry)
            s.leave_queue(w, Refused(refusal))

    def _pick_step(self, out: SchedulerOutput) -> None:
        s, kv = self.state, self.state.kv
        for r in s.running.values():
            if not r.prefilling:
                out.decodes.append(DecodeInput(r.id, r.tokens[-1], len(r.tokens) - 1, kv.table(r.id)))
                out.samplers[r.id] = r.sampler
        budget = self.cfg.prefill_chunk
        served: set[int] = set()
        rr = s.prefill_rr
        while budget > 0 and rr:
            rid = rr[0]
            row = s.running.get(rid)
            if row is None or not row.prefilling:
                rr.popleft()
                continue
            if rid in served:
                break
            served.add(rid)
            n = min(budget, len(row.prompt) - row.computed)
            ends = row.computed + n == len(row.prompt)
            chunk = row.prompt[row.computed : row.computed + n]
            out.prefills.append(PrefillInput(rid, chunk, row.computed, kv.table(rid), ends))
            if ends:
                out.samplers[rid] = row.sampler
            budget -= n
            rr.rotate(-1)
            if ends:
                rr.remove(rid)
