"""The worker's loop body: take commands, run one step in three typed phases, publish.

    apply(commands)
    schedule()              -> SchedulerOutput   (kvgate.core.scheduler)
    publish                                       admissions and refusals go out before the forward
    ModelRunner.execute()   -> ModelOutput        (kvgate.core.runner)
    update(ModelOutput)                           (kvgate.core.update)
    publish

`EngineCore` needs no thread and no model: tests drive `tick()` directly with a fake forward, and
the engine's worker thread calls the same `tick()` in its loop. Publishing swaps in a fresh
`EngineSnapshot`, then delivers the events the step produced, so a caller that has seen an event can
trust the snapshot to reflect it.
"""

from __future__ import annotations

import logging
import time

from kvgate.config import SchedulerConfig
from kvgate.core.inbox import Command, Inbox
from kvgate.core.kv_cache import KVCacheManager
from kvgate.core.runner import ModelRunner
from kvgate.core.scheduler import Scheduler
from kvgate.core.snapshot import EngineSnapshot
from kvgate.core.state import EngineState
from kvgate.core.update import Updater
from kvgate.tokenizer import TextTokenizer

log = logging.getLogger("kvgate.engine")

IDLE_WAIT = 0.5  # seconds the idle worker sleeps between looks at its inbox


class EngineCore:
    def __init__(self, cfg: SchedulerConfig, tokenizer: TextTokenizer, runner: ModelRunner, inbox: Inbox):
        self.cfg = cfg
        self.inbox = inbox
        self.runner = runner
        kv = KVCacheManager(cfg.total_blocks, cfg.block_size, prefix_cache=cfg.prefix_cache)
        self.state = EngineState(kv, inbox, cfg.prefill_chunk, cfg.logprobs_memory, tokenizer)
        self.state.times.position_seconds = cfg.decode_position_seconds
        self.state.times.prior = cfg.decode_step_prior
        self.scheduler = Scheduler(self.state, cfg, tokenizer)
        self.updater = Updater(self.state, cfg.max_model_len, cfg.prefill_chunk)
        self.snapshot: EngineSnapshot = self.state.snapshot()
        self.step_started: float | None = None  # when the forward in flight began (the watchdog reads it)
        # when the last decode-only step began, while rows kept running after it (no idle wait since):
        # the next step's start then closes one whole tick period, scheduling and publishing included
        self._decode_began: float | None = None
        self._decode_rows = 0  # the rows that tick decoded
        self._worked = False  # the last tick scheduled something (a waiter left then is worth a look at once)

    def wait_time(self) -> float:
        """How long the worker may block on its inbox: not at all with rows running, nor with requests
        waiting after a tick that did work (the rows that just ended freed room for them: a wave of
        queued requests waited IDLE_WAIT, 0.5 s, each time every running row had ended in the same
        tick, QA pass 5's F1); else until the nearest queue deadline (at most `IDLE_WAIT`)."""
        if self.state.running or (self.state.waiting and self._worked):
            return 0.0
        nd = self.scheduler.next_deadline()
        return IDLE_WAIT if nd is None else max(0.0, min(IDLE_WAIT, nd - time.monotonic()))

    def tick(self, commands: list[Command]) -> None:
        self.scheduler.apply(commands)
        out = self.scheduler.schedule(time.monotonic())
        self.publish()
        self._worked = not out.empty
        if out.empty:
            return
        self.step_started = began = time.monotonic()
        if self._decode_began is not None:
            self.state.times.observe_period(began - self._decode_began, self._decode_rows)
        try:
            result = self.runner.execute(out)
        finally:
            self.step_started = None
        try:
            self.updater.update(out, result)
        except Exception as exc:  # a bug in the update phase: fail this step's rows, keep serving
            log.exception("updating a step failed")
            s = self.state
            for rid in out.request_ids:
                row = s.running.get(rid)
                if row is not None:
                    s.counters.failed += 1
                    s.finish(row, "error", error=f"{type(exc).__name__}: {exc}", flush=False)
        decode_only = not out.prefills and result.step_error is None
        self._decode_began = began if decode_only and self.state.running else None
        self._decode_rows = len(out.decodes) + len(out.verifies)
        self.publish()

    def fail_all(self, reason: str) -> None:
        try:
            self.scheduler.fail_all(reason)
        finally:
            self.publish()

    def publish(self) -> None:
        state = self.state
        self.snapshot = state.snapshot()
        outbox, state.outbox = state.outbox, []
        for handle, event in outbox:
            handle.events.put(event)
