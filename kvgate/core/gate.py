"""The admission gate: what a request meets on the caller's thread, before the worker ever sees it.

In order: the never-fits 400s (pure arithmetic, `admission.plan_entry`), then under the inbox's lock:
- closed (shutting down, dead or stalled engine): 503;
- a prompt whose own prefill is over the TTFT budget: 400;
- queue full: 503, when more choices are not yet admitted (the inbox's own count) than `--max-queue`
  plus the batch rows the latest snapshot shows free. The worker then refuses, newest first, whatever
  is still waiting past `--max-queue` once it has admitted what fits (`Scheduler._trim`), so the
  bound on waiting requests is exact;
- the TTFT budget: 429, forecast from the latest snapshot plus the submissions it does not show yet.
  Its wait counts, ahead of the request, the requests refused before it whose Retry-After has not
  come yet (`_promised`): a herd refused together is told to come back spread out, each when the
  ones before it should have been admitted. They only lengthen waits; admission never counts them.

A request that passes is queued in the inbox as a `Submit` command. The gate counts what it refuses in
its own `Counters`, under the same lock; the engine adds them to every snapshot it hands out. It never
reads or writes the worker's state.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvgate.config import SchedulerConfig
from kvgate.core import admission, forecast, ttft_refusals
from kvgate.core.inbox import Inbox
from kvgate.core.kv_cache import cacheable_blocks
from kvgate.core.snapshot import Counters, EngineSnapshot, WaiterView
from kvgate.request import Refusal, RequestHandle

SHUTTING_DOWN = "shutting down"
MAX_PROMISES = 512  # refused requests whose return a wait counts (each is a waiter in the walk)


class AdmissionGate:
    def __init__(
        self,
        cfg: SchedulerConfig,
        inbox: Inbox,
        snapshot: Callable[[], EngineSnapshot],
        unavailable: Callable[[], str | None] = lambda: None,
    ):
        """`snapshot()`: the latest published snapshot; `unavailable()`: why the engine cannot take
        work right now (dead, stalled), or None."""
        self.cfg = cfg
        self.inbox = inbox
        self._snapshot = snapshot
        self._unavailable = unavailable
        self.counts = Counters()  # guarded by inbox.lock
        # TTFT-refused requests not yet due back, in refusal order: (due, as a waiter); inbox.lock
        self._promised: list[tuple[float, WaiterView]] = []
        self._full_due: list[float] = []  # when the requests told queue_full lately come back

    def submit(self, handle: RequestHandle, followers: list[RequestHandle] = ()) -> None:
        """Queue `handle` (with the other choices of an n > 1 request, admitted together), or raise."""
        cfg, inbox, c = self.cfg, self.inbox, self.counts
        n = 1 + len(followers)
        try:
            check_min_tokens(cfg, handle.request)
            entry = admission.plan_entry(cfg, handle, list(followers))
        except Refusal as r:
            with inbox.lock:
                if r.code == "context_length_exceeded":
                    c.rejected_context_length += n
                elif r.code == "kv_budget_exceeded":
                    c.rejected_kv_budget += n
            raise
        snap = self._snapshot()
        with inbox.lock:
            closed = inbox.closed_reason
            if closed == SHUTTING_DOWN:
                c.rejected_unavailable += n
                raise admission.shutting_down_refusal()
            why = closed or self._unavailable()
            if why is not None:
                c.rejected_unavailable += n
                raise admission.unavailable_refusal(why, 5)
            ttft = cfg.max_ttft is not None
            if ttft:  # the prefix cache's hits are only an estimate for the forecast: skipped without one
                cached = cached_prefix(entry.hashes, snap.cached_hashes, entry.prompt_len, cfg.block_size)
                # a prompt whose own prefill is over the budget can never pass: a 400 before any 503,
                # which would only send it back to fail again (rate: the fastest prompt-only step)
                never = ttft_refusals.ttft_never_refusal(
                    cfg, entry.prompt_len - cached, snap.prefill_token_time_best, snap.prefill_line
                )
                if never is not None:
                    c.rejected_ttft_budget += n
                    raise never
            free_rows = max(0, cfg.max_seqs - snap.running)
            if inbox.queued + n > cfg.max_queue + free_rows:
                c.queue_rejected += n
                now = time.monotonic()  # a burst refused together is told the row ends one by one
                self._full_due = [d for d in self._full_due if d > now]
                retry = forecast.retry_after(snap, inbox.pending(snap.absorbed), told=len(self._full_due))
                if len(self._full_due) < MAX_PROMISES:
                    self._full_due.append(now + retry)
                raise admission.queue_full_refusal(cfg, inbox.queued, retry, free_rows)
            ahead = inbox.pending(snap.absorbed) if ttft else []
            # the 429 says "wait for the load to drop": with none (no row, no waiter) nothing a retry
            # waits for would change, so an idle server leaves the prompt to the 400 above
            if ttft and not (snap.idle and not ahead):
                est = forecast.predicted_ttft(cfg, snap, ahead, entry.prompt_len, entry.max_tokens, cached, n)
                timed = snap.prefill_line is not None
                refusal = None if est is None else ttft_refusals.ttft_refusal(cfg, est, timed)
                if refusal is not None:
                    c.rejected_ttft_budget += n
                    raise self._spread(refusal, est, snap, ahead, entry, cached, n, timed)
            inbox.accept(entry, admission.group_blocks(cfg, entry.prompt_len, entry.max_tokens, n))

    def _spread(self, refusal, est, snap, ahead, entry, cached: int, n: int, timed: bool):
        """`refusal` with its wait counting the requests told to come back before it; this one's
        return is then promised too. Call with inbox.lock held. Without it, 12 clients behind 2 rows
        came back together, and 16 of 88 first retries were admitted (session 32's retry-herd bench)."""
        cfg, now = self.cfg, time.monotonic()
        self._promised = [(due, v) for due, v in self._promised if due > now]
        told = len(self._promised)
        if told:
            back = ahead + [v for _, v in self._promised]
            later = forecast.predicted_ttft(cfg, snap, back, entry.prompt_len, entry.max_tokens, cached, n)
            refusal = ttft_refusals.ttft_refusal(cfg, est, timed, later, told) or refusal
        if told < MAX_PROMISES:
            blocks = admission.group_blocks(cfg, entry.prompt_len, entry.max_tokens, n)
            view = entry.view(blocks)
            # due when the openai SDK comes back (retry-after-ms): counted past that, a client back on
            # time would be ahead of itself
            self._promised.append((now + refusal.retry_after_ms / 1000, view))
        return refusal

    def counters(self) -> Counters:
        with self.inbox.lock:
            return Counters(*(getattr(self.counts, f) for f in Counters.__slots__))


def cached_prefix(hashes: list[bytes], cached: frozenset, prompt_len: int, block_size: int) -> int:
    """Prompt tokens the prefix cache held when the snapshot was taken (an estimate for the forecast)."""
    hits = 0
    for h in hashes[: cacheable_blocks(prompt_len, block_size)]:
        if h not in cached:
            break
        hits += 1
    return hits * block_size


def check_min_tokens(cfg: SchedulerConfig, req) -> None:
    """vLLM's `min_tokens` with max_tokens unset: at most what the prompt leaves in the context (an
    explicit max_tokens bounds it in `GenerationRequest.validate`). QA pass 15: a 200, silently short."""
    P, L = len(req.prompt_ids), cfg.max_model_len
    if req.max_tokens is None and 0 < L - P < req.min_tokens:  # a prompt past the context: plan_entry's 400
        raise Refusal(
            "context_length_exceeded",
            f"This model's maximum context length is {L} tokens. However, min_tokens={req.min_tokens} is "
            f"more than the {max(0, L - P)} this {P}-token prompt leaves: lower min_tokens or shorten the "
            "prompt.",
            400,
            **admission.context_bytes(cfg, P + req.min_tokens),
            positions=P + req.min_tokens,
            positions_limit=L,
            param="min_tokens",
        )
