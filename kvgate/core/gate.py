"""The admission gate: what a request meets on the caller's thread, before the worker ever sees it.

In order: the never-fits 400s (pure arithmetic, `admission.plan_entry`), then under the inbox's lock:
closed (shutting down, dead or stalled engine: 503), queue full (503, exact: the inbox's own count),
and the TTFT budget (429, forecast from the latest snapshot plus the submissions it does not show
yet). A request that passes is queued in the inbox as a `Submit` command. The gate counts what it
refuses in its own `Counters`, under the same lock; the engine adds them to every snapshot it hands
out. It never reads or writes the worker's state.
"""

from __future__ import annotations

from collections.abc import Callable

from kvgate.config import SchedulerConfig
from kvgate.core import admission
from kvgate.core.inbox import Inbox
from kvgate.core.kv_cache import blocks_for
from kvgate.core.snapshot import Counters, EngineSnapshot
from kvgate.request import Refusal, RequestHandle

SHUTTING_DOWN = "shutting down"


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

    def submit(self, handle: RequestHandle) -> None:
        cfg, inbox, c = self.cfg, self.inbox, self.counts
        try:
            entry = admission.plan_entry(cfg, handle)
        except Refusal as r:
            with inbox.lock:
                if r.code == "context_length_exceeded":
                    c.rejected_context_length += 1
                else:
                    c.rejected_kv_budget += 1
            raise
        snap = self._snapshot()
        with inbox.lock:
            closed = inbox.closed_reason
            if closed == SHUTTING_DOWN:
                c.rejected_unavailable += 1
                raise admission.shutting_down_refusal()
            why = closed or self._unavailable()
            if why is not None:
                c.rejected_unavailable += 1
                raise admission.unavailable_refusal(why, 5)
            if inbox.queued >= cfg.max_queue:
                c.queue_rejected += 1
                retry = admission.retry_after(snap, inbox.queued)
                raise admission.queue_full_refusal(cfg, inbox.queued, retry)
            if cfg.max_ttft is not None:
                ahead = inbox.pending(snap.absorbed)
                est = admission.predicted_ttft(cfg, snap, ahead, entry.prompt_len, entry.max_tokens)
                refusal = (
                    None if est is None else admission.ttft_refusal(cfg, est, snap.prefill_token_time_ema)
                )
                if refusal is not None:
                    c.rejected_ttft_budget += 1
                    raise refusal
            inbox.accept(entry, blocks_for(entry.prompt_len + entry.max_tokens, cfg.block_size))

    def counters(self) -> Counters:
        with self.inbox.lock:
            return Counters(*(getattr(self.counts, f) for f in Counters.__slots__))
