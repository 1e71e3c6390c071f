"""Continuous batching with exact KV admission: commands in, one `SchedulerOutput` per tick out.

Runs only on the engine's worker thread, over `EngineState`. Each tick, in this order:
`apply(commands)` (submits join the FIFO, cancels end their request wherever it is, a drain refuses
the whole queue) -> `schedule(now)`: admit from the FIFO head while rows and KV blocks allow ->
refuse waiters past their deadline -> refuse the newest waiters past `--max-queue` -> pick the step:
every decoding row plus prompt chunks (round-robin, at most `prefill_chunk` prompt tokens).

Why these choices:
- Rows are a dict keyed by request id, never a positional list: a row leaving the batch cannot hand
  its sampler, stop matcher or reply channel to a neighbour.
- Strict FIFO: a head that does not fit blocks the line. Skipping ahead would let a stream of small
  requests starve a large one; there is no measured reason to allow it. One exception: a head that
  has its rows and KV but waits for logprobs memory or a grammar slot (`kvgate.core.side_waits`) lets
  requests that need neither go first (behind heads waiting only for slots, logprobs requests too, from
  what their logprobs will not need). Logprobs come back only when responses are sent, and a prompt
  list's later prompts (which need none: the first reserved them) may be what that response waits
  for; a plain request, or one whose schema already runs, should not wait for other schemas to end.
- A request holds `ceil((prompt + max_tokens) / block_size)` blocks from admission to its end, so a
  running row can never run out of KV and no preemption exists.
- A failure while admitting one request (building its sampler, detokenizer...) ends that request
  with a 500 and gives its blocks back; the worker and every other request go on.
"""

from __future__ import annotations

import logging
import time

from kvgate.config import SchedulerConfig
from kvgate.core import admission, forecast, logprob_budget, side_waits
from kvgate.core.inbox import Cancel, CancelAll, Command, Drain, Release, Submit
from kvgate.core.kv_cache import cacheable_blocks
from kvgate.core.outputs import SchedulerOutput
from kvgate.core.predicted import PredictionDrafts
from kvgate.core.rows import Row, WaitEntry
from kvgate.core.speculate import DraftGate, NgramIndex, eligible
from kvgate.core.state import EngineState
from kvgate.core.step_inputs import DecodeInput, PrefillInput, VerifyInput
from kvgate.request import Admitted, BudgetCap, Refused, RequestHandle
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
        # (the queue's head, "logprobs" | "grammar", its logprobs bytes) when `_admit` found it waiting
        # for that alone this tick, with its rows and KV (capped, for an unset max_tokens): `_expire`
        # tells it so (review of session 38: it was judged again uncapped, and told the KV 429)
        self.side_wait: tuple[WaitEntry, str, int] | None = None

    # ---- commands -------------------------------------------------------------------------------
    def apply(self, commands: list[Command]) -> None:
        s = self.state
        for cmd in commands:
            if isinstance(cmd, Submit):
                s.absorbed = max(s.absorbed, cmd.seq)
                if self.draining:
                    s.counters.rejected_unavailable += cmd.entry.choices
                    s.leave_queue(cmd.entry, Refused(admission.shutting_down_refusal()))
                else:
                    s.waiting.append(cmd.entry)
            elif isinstance(cmd, Cancel):
                self.cancel(cmd.request_id)
            elif isinstance(cmd, Release):
                s.logprobs.give_back(cmd.request_id)
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
            if w.id == request_id:  # the request, and with it every choice still queued
                s.waiting.remove(w)
                s.cancelled_in_queue(w)
                return
            for f in w.followers:
                if f.id == request_id:  # one choice of an n > 1 request
                    w.followers.remove(f)
                    s.cancelled_in_queue(w, [f])
                    return

    def drain(self) -> None:
        """Refuse every queued request now (503 with Retry-After); running rows go on to their end."""
        self.draining = True
        s = self.state
        while s.waiting:
            w = s.waiting.popleft()
            s.counters.rejected_unavailable += w.choices
            s.leave_queue(w, Refused(admission.shutting_down_refusal()))

    def fail_all(self, reason: str) -> None:
        """The worker is going away: every waiter and row gets its terminal event."""
        s = self.state
        while s.waiting:
            w = s.waiting.popleft()
            s.counters.rejected_unavailable += w.choices
            s.leave_queue(w, Refused(admission.unavailable_refusal(reason, 1)))
        for row in list(s.running.values()):
            s.finish(row, "error", error=reason, flush=False)

    # ---- one tick -------------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        self._admit(out)
        self._expire(now)
        self._trim()
        self._pick_step(out)
        return out

    def next_deadline(self) -> float | None:
        return min((w.deadline for w in self.state.waiting), default=None)

    def _admit(self, out: SchedulerOutput) -> None:
        s, cfg, kv = self.state, self.cfg, self.state.kv
        bs = cfg.block_size
        i = 0  # waiters before i wait for logprobs memory or a grammar slot: those needing neither go first
        lp_waits = False  # a waiter before i waits for logprobs memory: those behind that need some wait too
        lp_kept = 0  # logprobs bytes the waiters before i that wait for a slot will take once they have one
        lists: set[int | None] = set()  # held prompt lists with a prompt waiting before i (logprobs_list)
        self.side_wait = None
        while i < len(s.waiting) and len(s.running) + s.waiting[i].choices <= cfg.max_seqs:
            head = s.waiting[i]
            P, n = head.prompt_len, head.choices
            scores = head.handle.request.prompt_logprobs is not None  # every position computed: no hits
            hits = [] if scores else kv.lookup(head.hashes[: cacheable_blocks(P, bs)])
            mt, cap = head.max_tokens, head.cap
            room = kv.available_with(hits)
            if admission.group_blocks(cfg, P, mt, n, len(hits)) > room:
                fits = admission.max_choice_positions(cfg, P, n, room, len(hits)) - P
                if head.explicit or fits < max(1, cfg.min_cap_tokens):
                    return  # the head blocks the line (strict FIFO)
                cap = BudgetCap(head.requested, fits, "kv_free_now")
                mt = fits
            handles = [head.handle, *head.followers]
            logprobs = [logprob_budget.reserved_bytes(h.request, mt) for h in handles]  # bytes each
            key = head.handle.request.logprobs_list
            if key is not None and key in lists:  # its list's first prompt reserves its logprobs, and waits
                i += 1
                continue
            if sum(logprobs) and (lp_waits or sum(logprobs) > s.logprobs.free - lp_kept):
                lp_waits = True  # waits for logprobs memory, in FIFO order with the others that do
                if not i:
                    self.side_wait = (head, "logprobs", sum(logprobs))
                lists.add(key)
                i += 1
                continue
            g = side_waits.grammar_of(head)  # a slot for its grammar, unless one keeps it already
            if g is not None and not g.compiler.acquire(g.text, n, new_slot=not i):
                if not i:  # the head: the running grammar that ends soonest takes no new rows now
                    g.compiler.hold_for_head(side_waits.grammar_steps_left(s))
                    self.side_wait = (head, "grammar", sum(logprobs))
                lp_kept += sum(logprobs)  # what it will take once it has its slot stays free for it
                lists.add(key)
                i += 1
                continue
            del s.waiting[i]
            try:
                rows = self._allocate_rows(head, mt, cap, hits)
                for row in rows:
                    row.grammar_pin = g
            except Exception:
                log.exception("admitting request %d failed", head.id)
                if g is not None:
                    g.compiler.release(g.text, n)
                for h in [head.handle, *head.followers]:
                    kv.free(h.id)
                s.counters.kv_blocks_held = kv.referenced_blocks
                s.counters.failed += n
                s.leave_queue(head, Refused(admission.engine_error_refusal()))
                continue
            for h, nbytes in zip(handles, logprobs, strict=True):
                s.logprobs.take(h, nbytes)
            c = s.counters
            c.prefix_cache_queries_tokens += P if kv.prefix_cache and not scores else 0
            c.prefix_cache_hits_tokens += len(hits) * bs
            s.inbox.left_queue(n)
            for row in rows:
                self._start_row(row)
                out.admitted.append(row.id)

    def _allocate_rows(
        self, head: WaitEntry, max_tokens: int, cap: BudgetCap | None, hits: list[int]
    ) -> list[Row]:
        """The blocks and rows of an admitted request: the leader takes the cache hits and its own
        blocks; each other choice shares the leader's cacheable prompt blocks (waiting for the leader
        to compute them) and holds its own tail and output blocks."""
        kv, bs = self.state.kv, self.cfg.block_size
        P = head.prompt_len
        if not kv.allocate_for(head.id, P + max_tokens, hits, head.hashes):
            raise AssertionError("blocks that were available a moment ago are not")
        leader = self._make_row(head.handle, max_tokens, cap)
        leader.computed = leader.cached_tokens = len(hits) * bs
        rows = [leader]
        shared = cacheable_blocks(P, bs)
        for f in head.followers:
            if not kv.allocate_for(f.id, P + max_tokens, kv.table(head.id)[:shared]):
                raise AssertionError("blocks that were available a moment ago are not")
            row = self._make_row(f, max_tokens, cap)
            row.computed = row.shared_positions = shared * bs
            row.cached_tokens = len(hits) * bs
            row.leader = leader.id
            leader.followers.append(row.id)
            rows.append(row)
        return rows

    def _make_row(self, handle: RequestHandle, max_tokens: int, cap: BudgetCap | None) -> Row:
        req = handle.request
        stop_ids = set(req.stop_token_ids)
        if not req.ignore_eos:
            stop_ids |= self.tok.eog_ids
        sampler = Sampler(req.sampling, req.prompt_ids, self.tok.vocab_size)
        sampler.suppress(stop_ids, req.min_tokens)
        speculates = bool(self.cfg.speculate) and eligible(sampler)
        return Row(
            handle=handle,
            prompt=list(req.prompt_ids),
            max_tokens=max_tokens,
            sampler=sampler,
            ngrams=NgramIndex() if speculates else None,
            gate=DraftGate() if speculates else None,
            prediction=self._prediction(req) if speculates and req.prediction_ids else None,
            stop=StopMatcher(stop_ids, req.stop, req.stop_exempt, req.include_stop_str),
            detok=IncrementalDetokenizer(
                self.tok, req.prompt_ids, skip_special=req.skip_special_tokens, keep=req.keep_special
            ),
            budget_cap=cap,
            admitted_at=time.monotonic(),
            tokens=list(req.prompt_ids),
            prompt_logprobs=None if req.prompt_logprobs is None else [],
        )

    def _prediction(self, req) -> PredictionDrafts:
        """The row's prediction drafts; a prediction longer than the room for output cannot all be
        used, and is cut to it."""
        room = self.cfg.max_model_len - len(req.prompt_ids)
        ids = req.prediction_ids
        return PredictionDrafts(ids if len(ids) <= room else ids[:room])

    def _start_row(self, row: Row) -> None:
        s = self.state
        s.running[row.id] = row
        s.prefill_rr.append(row.id)
        c = s.counters
        c.admitted += 1
        if row.leader is None:  # n choices share one prompt: counted once, as the usage counts it
            c.prompt_tokens += len(row.prompt)
        if row.budget_cap is not None:
            c.budget_caps += 1
        c.kv_blocks_held = s.kv.referenced_blocks
        c.kv_blocks_peak = max(c.kv_blocks_peak, c.kv_blocks_held)
        s.emit(row.handle, Admitted(row.max_tokens, row.budget_cap, len(row.prompt), row.cached_tokens))

    def _expire(self, now: float) -> None:
        s = self.state
        # with one --max-queue-wait for all, whoever waited ahead of a late waiter is late too: count
        # them before any leaves, so a waiter that fits but stood behind them is told so
        late = [(ahead, w) for ahead, w in enumerate(s.waiting) if w.deadline <= now]
        if not late:
            return
        # a held prompt list leaves together: its later prompts reserve no logprobs of their own, and
        # would run unreserved after their first left (the review of session 38)
        if keys := {w.handle.request.logprobs_list for _, w in late} - {None}:
            late += [
                (a, w)
                for a, w in enumerate(s.waiting)
                if w.deadline > now and w.handle.request.logprobs_list in keys
            ]
        snap = s.snapshot()
        retry = forecast.retry_after(snap)
        free, rows = s.kv.available_blocks, len(s.running)
        side = self.side_wait  # what holds the line up besides KV and rows, as `_admit` found it
        head_waits = side[1] if side is not None and side[0] is s.waiting[0] else None
        held = side_waits.held_grammar(s.waiting[0]) if head_waits == "grammar" else None
        steps = side_waits.grammar_steps_left(s).get(held)  # until the held grammar's slot frees
        # a retry waits in the queue again: it is in time if it comes a queue wait before the slot frees
        slot_retry = retry if steps is None else forecast.retry_after_steps(snap, steps, self.cfg.queue_wait)
        waited = self.cfg.queue_wait
        for told, (ahead, w) in enumerate(late):  # the burst's earlier ones take the sooner row ends
            s.waiting.remove(w)
            s.counters.rejected_kv_timeout += w.choices
            spread = forecast.retry_after(snap, told=told) if told else retry
            refusal = admission.kv_timeout_refusal(self.cfg, w, free, rows, spread, ahead, head_waits)
            if not ahead and head_waits == "logprobs":
                lp = s.logprobs  # in time if it comes a queue wait before enough is back (as slot_retry)
                lp_retry = forecast.retry_after_steps(
                    snap, forecast.logprobs_steps(snap, side[2], lp.limit), self.cfg.queue_wait
                )
                refusal = logprob_budget.timeout_refusal(
                    side[2], lp.free, lp.limit, waited, lp_retry, self.cfg.queue_wait_flag
                )
            elif head_waits == "grammar" and side_waits.waits_for_slot(w, head=not ahead):
                g = side_waits.grammar_of(w)
                refusal = side_waits.grammar_timeout_refusal(
                    g, waited, slot_retry, len(s.waiting), self.cfg.queue_wait_flag
                )
            s.leave_queue(w, Refused(refusal))

    def _trim(self) -> None:
        """`--max-queue` bounds the choices that wait: the gate let through as many as the free rows
        could take at once, so those that could not start now leave, newest first, with a 503."""
        s = self.state
        waiting = sum(w.choices for w in s.waiting)
        if waiting <= self.cfg.max_queue:
            return
        retry = forecast.retry_after(s.snapshot())
        refused = []
        while waiting > self.cfg.max_queue:
            refused.append(s.waiting.pop())
            waiting -= refused[-1].choices
        for w in refused:  # each told the places the requests kept before it take, not a running count
            s.counters.queue_rejected += w.choices
            s.leave_queue(w, Refused(admission.queue_trim_refusal(self.cfg, w, waiting, retry)))

    def _pick_step(self, out: SchedulerOutput) -> None:
        s, kv = self.state, self.state.kv
        for r in s.running.values():
            if r.prefilling:
                continue
            out.samplers[r.id] = r.sampler
            drafts = self._drafts(r)
            if drafts:
                out.verifies.append(
                    VerifyInput(r.id, [r.tokens[-1], *drafts], len(r.tokens) - 1, kv.table(r.id))
                )
            else:
                out.decodes.append(DecodeInput(r.id, r.tokens[-1], len(r.tokens) - 1, kv.table(r.id)))
        budget = self.cfg.prefill_chunk
        # logits rows left in the step: the plan sizes the logits for max_seqs x (1 + speculate) rows; a
        # decode or verify position takes one, and so may every prefilling row (its last chunk); a chunk
        # that scores its prompt takes one a token, so it is cut to what is left
        rr = s.prefill_rr
        logit_room = self.cfg.max_seqs * (1 + self.cfg.speculate) - len(out.decodes)
        logit_room -= sum(len(v.tokens) for v in out.verifies)
        logit_room -= sum(1 for rid in rr if (r := s.running.get(rid)) is not None and r.prefilling)
        for rid in list(rr):  # each prefilling row at most once, in round-robin order
            if budget <= 0:
                break
            row = s.running.get(rid)
            if row is None or not row.prefilling:
                rr.remove(rid)
                continue
            if row.leader is not None and self._leader_behind(row):
                continue  # its shared prompt blocks are not computed yet
            top = row.handle.request.prompt_logprobs
            n = min(budget, len(row.prompt) - row.computed)
            if top is not None:
                n = max(1, min(n, logit_room + 1))  # its own row (counted above), and what is left
                logit_room -= n - 1
            ends = row.computed + n == len(row.prompt)
            at = row.computed
            chunk = row.prompt[at : at + n]
            score = None if top is None else row.prompt[at + 1 : at + n + 1]
            out.prefills.append(PrefillInput(rid, chunk, at, kv.table(rid), ends, score, top or 0))
            budget -= n
            rr.remove(rid)
            if ends:
                out.samplers[rid] = row.sampler
            else:
                rr.append(rid)

    def _drafts(self, row: Row) -> list[int]:
        """Draft tokens for a row that may speculate: at most `speculate`, and at most one fewer than
        the tokens it may still produce (so every position written stays inside its reserved KV
        blocks and the context); none while its gate pauses it (its recent drafts were rejected)."""
        if row.ngrams is None or not row.gate.open(len(row.tokens)):
            return []
        made = len(row.tokens) - len(row.prompt)
        room = min(row.max_tokens - made, self.cfg.max_model_len - len(row.tokens)) - 1
        k = min(self.cfg.speculate, room)
        if row.prediction is not None:  # the client's prediction first, the row's history after it
            drafts = row.prediction.propose(row.tokens[len(row.prompt) :], k)
            if drafts:
                return drafts
        return row.ngrams.propose(row.tokens, k)

    def _leader_behind(self, row: Row) -> bool:
        leader = self.state.running.get(row.leader)
        return leader is not None and leader.computed < row.shared_positions
