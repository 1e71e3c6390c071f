"""The engine core on its own: `EngineCore.tick()` driven directly with a fake forward, no worker thread.

The fake forward returns logits whose argmax depends only on the position of the token being sampled,
so every request's exact output is known in advance (`expected(P, n)`) and a row that received
another row's logits shows up as a wrong token. Everything here is deterministic: FIFO order, exact
admission, counters. The last test drives the real engine from several threads (hypothesis) and checks
the same invariants under random submit/cancel interleavings.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvgate.config import SchedulerConfig
from kvgate.core.gate import AdmissionGate
from kvgate.core.inbox import Cancel, Inbox
from kvgate.core.kv_cache import blocks_for
from kvgate.core.runner import ModelRunner
from kvgate.core.stepper import EngineCore
from kvgate.core.testing import set_step_hook
from kvgate.models.hf_loader import TokenizerInfo
from kvgate.request import (
    Admitted,
    BudgetCap,
    Finished,
    GenerationRequest,
    Refusal,
    Refused,
    RequestHandle,
    Token,
)
from kvgate.sampling import SamplingParams
from kvgate.tokenizer import TextTokenizer
from tests.server_util import wait_until
from tests.tiny_model import TINY_KV_BYTES_PER_TOKEN, build_tokenizer

TOK = TextTokenizer(TokenizerInfo(build_tokenizer().to_str(), None, None, 2, [0, 2], False))


ONE_HOT = torch.eye(TOK.vocab_size)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [3 + (i * 7 + salt * 13) % 250 for i in range(n)]


def expected(P: int, n: int) -> list[int]:
    """What the fake forward makes a request with a P-token prompt generate, n tokens long."""
    return [3 + (P + i) % 250 for i in range(n)]


class Harness:
    """An EngineCore and its admission gate over a fake forward; records batches and admission order."""

    def __init__(
        self,
        *,
        blocks=16,
        block_size=4,
        max_seqs=4,
        max_queue=8,
        max_queue_wait=30.0,
        prefill_chunk=8,
        min_cap_tokens=4,
        max_model_len=64,
        prefix_cache=False,
    ):
        """`prefix_cache` is off by default: these tests reuse prompts, and count blocks without it
        (tests/test_prefix_cache.py covers it)."""
        self.batches = []
        cfg = SchedulerConfig(
            block_size=block_size,
            total_blocks=blocks,
            max_seqs=max_seqs,
            max_queue=max_queue,
            max_queue_wait=max_queue_wait,
            prefill_chunk=prefill_chunk,
            min_cap_tokens=min_cap_tokens,
            max_model_len=max_model_len,
            kv_bytes_per_token=512,
            prefix_cache=prefix_cache,
        )
        self.inbox = Inbox()
        runner = ModelRunner(
            self.forward, block_size=block_size, attn_token_cap=4096, device=torch.device("cpu")
        )
        self.core = EngineCore(cfg, TOK, runner, self.inbox)
        self.gate = AdmissionGate(cfg, self.inbox, lambda: self.core.snapshot)
        self.state = self.core.state
        self.kv = self.state.kv
        self.order: list[int] = []
        self.skipped: list[tuple[int, int]] = []  # (admitted, earlier still waiting): strict FIFO broken
        sched = self.core.scheduler
        start_row = sched._start_row

        def recording_start_row(row):
            self.order.append(row.id)
            self.skipped += [(row.id, w.id) for w in self.state.waiting if w.id < row.id]
            start_row(row)

        sched._start_row = recording_start_row

    def forward(self, batch):
        self.batches.append(batch)
        pos = batch.positions[batch.logits_index]
        return ONE_HOT[3 + (pos + 1) % 250]

    def submit(self, P: int, max_tokens: int | None = None, salt: int = 0) -> RequestHandle:
        req = GenerationRequest(prompt(P, salt), SamplingParams(temperature=0.0), max_tokens, ignore_eos=True)
        h = RequestHandle(req, lambda rid: self.inbox.put(Cancel(rid)))
        self.gate.submit(h)
        return h

    def tick(self) -> None:
        self.core.tick(self.inbox.take(0))

    def run(self, max_ticks: int = 5000) -> None:
        for _ in range(max_ticks):
            self.tick()
            if not self.state.has_work():
                return
        raise AssertionError("the scheduler did not go idle")

    @property
    def counters(self):
        return self.core.snapshot.with_gate(self.gate.counters()).counters

    def waiting_ids(self) -> list[int]:
        return [w.id for w in self.state.waiting]

    def held(self) -> int:
        return self.kv.referenced_blocks


def drain(h: RequestHandle) -> list:
    out = []
    while True:
        try:
            out.append(h.events.get(0))
        except TimeoutError:
            return out


def final(h: RequestHandle):
    evs = drain(h)
    assert evs and isinstance(evs[-1], Finished | Refused), evs
    return evs


# ---- FIFO and exact admission -------------------------------------------------------------------


def test_head_that_does_not_fit_blocks_the_line():
    """Strict FIFO: a small request behind a blocked head waits even though it would fit.

    Seen to fail when `_admit` skips past a head that does not fit to admit the next one that does.
    """
    hx = Harness(blocks=8, block_size=4)
    a = hx.submit(4, 24)  # 7 blocks
    b = hx.submit(4, 12)  # 4 blocks: waits for a
    c = hx.submit(2, 2)  # 1 block: would fit in the one free block, but b is ahead
    hx.tick()
    assert hx.order == [a.id]
    assert hx.waiting_ids() == [b.id, c.id]
    for _ in range(5):
        hx.tick()
        assert hx.order == [a.id], "c jumped the queue past the blocked head b"
    hx.run()
    assert hx.order == [a.id, b.id, c.id]
    for h, P, n in ((a, 4, 24), (b, 4, 12), (c, 2, 2)):
        assert final(h)[-1].result.token_ids == expected(P, n)


def test_exact_fit_is_admitted_now_and_one_block_more_waits():
    """blocks needed == blocks free is admitted at once; one more waits.

    Seen to fail when the allocator's fit check is `n < free` instead of `n <= free`.
    """
    hx = Harness(blocks=8, block_size=4)
    a = hx.submit(4, 12)  # 4 blocks
    hx.tick()
    b = hx.submit(4, 12)  # exactly the 4 free blocks
    hx.tick()
    assert hx.order == [a.id, b.id] and hx.kv.available_blocks == 0
    hx.run()
    hx2 = Harness(blocks=8, block_size=4)
    hx2.submit(4, 12)
    hx2.tick()
    c = hx2.submit(4, 13)  # 5 blocks: one too many
    hx2.tick()
    assert c.id not in hx2.order and hx2.waiting_ids() == [c.id]
    hx2.run()
    assert c.id in hx2.order


def test_whole_pool_exactly_is_admitted_and_one_position_more_is_refused():
    """prompt + max_tokens == KV positions is admitted (and runs to the end); + 1 is refused.

    Seen to fail when the never-fits check is `>=` instead of `>`.
    """
    hx = Harness(blocks=8, block_size=4, max_model_len=64)
    h = hx.submit(10, 22)  # 32 positions = the whole pool
    hx.run()
    res = final(h)[-1].result
    assert res.finish_reason == "length" and res.token_ids == expected(10, 22)
    assert hx.counters.kv_blocks_peak == 8
    with pytest.raises(Refusal) as ei:
        hx.submit(10, 23)
    r = ei.value
    assert (r.code, r.status, r.positions, r.positions_limit) == ("kv_budget_exceeded", 400, 33, 32)
    assert r.estimated_bytes == 9 * 4 * 512 and r.limit_bytes == 32 * 512
    assert hx.counters.rejected_kv_budget == 1
    assert hx.kv.available_blocks == hx.kv.total


def test_free_now_cap_and_kv_budget_cap_report_what_was_asked():
    """An unset max_tokens capped by the pool and then by the free blocks reports the context ceiling
    as requested, not the intermediate cap.

    Seen to fail (requested 24, not 56) before WaitEntry.requested was taken before the kv_budget cap.
    """
    hx = Harness(blocks=8, block_size=4, max_model_len=64, min_cap_tokens=4)
    hog = hx.submit(4, 12)  # 4 blocks
    hx.tick()
    h = hx.submit(8)  # ceiling 56 -> kv_budget cap 24 -> only 4 blocks free now -> 8
    hx.tick()
    adm = drain(h)[0]
    assert isinstance(adm, Admitted)
    assert adm.budget_cap == BudgetCap(56, 8, "kv_free_now") and adm.max_tokens == 8
    hx.run()
    assert final(h)[-1].result.budget_cap == BudgetCap(56, 8, "kv_free_now")
    assert final(hog)[-1].result.budget_cap is None
    assert hx.counters.budget_caps == 1


def test_free_now_cap_never_admits_zero_tokens():
    """With min_cap_tokens=0 a head whose prompt exactly fills the free blocks must wait, not be admitted
    with max_tokens=0 (it would still generate one token).

    Seen to fail before the free-now cap required at least one token to fit.
    """
    hx = Harness(blocks=8, block_size=4, max_model_len=64, min_cap_tokens=0)
    hx.submit(4, 12)  # 4 blocks
    hx.tick()
    h = hx.submit(16)  # 16 prompt positions = exactly the 4 free blocks, no room for a token
    hx.tick()
    assert h.id not in hx.order
    hx.run()
    res = final(h)[-1].result
    assert res.budget_cap is not None and res.budget_cap.admitted_max_tokens >= 1
    assert len(res.token_ids) == res.budget_cap.admitted_max_tokens


def test_max_queue_wait_zero_refuses_what_does_not_fit_now():
    """With no waiting allowed, a request that does not fit at the tick after submission gets a 429.

    Seen to fail when a zero max_queue_wait is treated as no deadline at all.
    """
    hx = Harness(blocks=8, block_size=4, max_queue_wait=0.0)
    a = hx.submit(4, 20)
    b = hx.submit(4, 20)
    hx.tick()
    assert isinstance(drain(a)[0], Admitted)
    evs = drain(b)
    assert len(evs) == 1 and isinstance(evs[0], Refused)
    r = evs[0].refusal
    assert (r.code, r.status) == ("kv_memory_unavailable", 429) and 1 <= r.retry_after <= 60
    assert hx.counters.rejected_kv_timeout == 1
    hx.run()


def test_counters_match_the_work_done():
    """Counters are exact: chunks and tokens of prefill, decode steps, peak blocks, refusals, aborts.

    Seen to fail when prefill_chunks counts steps instead of chunks, when a kv_budget refusal is counted
    twice, when kv_blocks_peak is not updated on admission, when the queue gate is `>` instead of `>=`,
    and when the budget check runs before the context check.
    """
    hx = Harness(blocks=16, block_size=4, prefill_chunk=4, max_queue=3, max_model_len=40)
    a = hx.submit(10, 3)  # 4 blocks
    b = hx.submit(6, 5)  # 3 blocks
    hx.run()
    c = hx.counters
    assert final(a)[-1].result.token_ids == expected(10, 3)
    assert final(b)[-1].result.token_ids == expected(6, 5)
    # chunks (budget 4 per step, round-robin): a[0:4] | b[0:4] | a[4:8] | b[4:6] + a[8:10]
    assert (c.prefill_chunks, c.prefill_tokens) == (5, 16)
    assert (c.decode_steps, c.decode_tokens, c.generated_tokens) == (4, 6, 8)
    assert (c.steps, c.admitted, c.finished, c.kv_blocks_peak, c.kv_blocks_held) == (8, 2, 2, 7, 0)
    # refusals, each counted once
    with pytest.raises(Refusal, match="context"):
        hx.submit(30, 20)
    with pytest.raises(Refusal) as ei:
        hx.submit(10, 60)  # both context and budget: context first
    assert ei.value.code == "context_length_exceeded"
    hx2 = Harness(blocks=4, block_size=4, max_queue=1, max_seqs=1, max_model_len=40)
    with pytest.raises(Refusal) as ei:
        hx2.submit(10, 10)  # 20 positions > 16: never fits
    assert ei.value.code == "kv_budget_exceeded"
    capped = hx2.submit(4)  # unset: ceiling 36 -> capped to 12 by the pool
    queued = hx2.submit(4, 4)
    with pytest.raises(Refusal) as ei:
        hx2.submit(4, 4)
    assert (ei.value.code, ei.value.status) == ("queue_full", 503) and ei.value.retry_after >= 1
    queued.cancel()
    hx2.run()
    c2 = hx2.counters
    assert (c2.rejected_kv_budget, c2.queue_rejected, c2.budget_caps, c2.aborted) == (1, 1, 1, 1)
    assert (c2.rejected_context_length, c2.rejected_kv_timeout, c2.admitted) == (0, 0, 1)
    assert final(capped)[-1].result.budget_cap == BudgetCap(36, 12, "kv_budget")
    assert final(queued)[-1].result.finish_reason == "cancelled"
    c = hx.counters  # a snapshot: read again after the refusals
    assert (c.rejected_context_length, c.rejected_kv_budget, c.queue_rejected) == (2, 0, 0)


# ---- property: random operations, one thread ------------------------------------------------------

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(1, 24), st.integers(1, 16)),
        st.tuples(st.just("submit"), st.integers(1, 24), st.integers(1, 16)),
        st.tuples(st.just("submit"), st.integers(1, 24), st.none()),  # unset: may be capped
        st.tuples(st.just("submit"), st.integers(1, 40), st.integers(1, 40)),  # may never fit
        st.tuples(st.just("cancel"), st.integers(0, 40), st.just(0)),
        st.tuples(st.just("tick"), st.integers(1, 6), st.just(0)),
        st.tuples(st.just("tick"), st.integers(1, 6), st.just(0)),
    ),
    min_size=12,
    max_size=40,
)


@settings(max_examples=100, deadline=None)
@given(
    ops=OPS, wait=st.sampled_from([0.0, 30.0]), max_seqs=st.integers(2, 4), chunk=st.sampled_from([2, 5, 64])
)
def test_random_operations_keep_the_invariants(ops, wait, max_seqs, chunk):
    """Blocks held == sum of rows' blocks <= total, no block in two rows, FIFO admission, exact outputs,
    one terminal event per accepted request, and the whole pool back when idle.

    Seen to fail with FIFO skip-ahead, with a cancelled row's blocks not released, with a cancelled
    waiter left without a terminal event, with an explicit max_tokens given a free-now cap, and with
    the worker's trim to --max-queue left out (session 29).
    """
    hx = Harness(
        blocks=12,
        block_size=4,
        max_seqs=max_seqs,
        max_queue=5,
        max_queue_wait=wait,
        prefill_chunk=chunk,
        min_cap_tokens=8,
        max_model_len=40,
    )
    s = hx.state
    handles: list[RequestHandle] = []
    refused: list[str] = []

    def check():
        rows = list(s.running.values())
        ids = [b for r in rows for b in hx.kv.table(r.id)]
        assert len(ids) == len(set(ids)), "a block is held by two rows"
        assert hx.held() == len(ids) == hx.counters.kv_blocks_held <= hx.kv.total
        hx.kv.check()
        for r in rows:
            assert hx.kv.held_by(r.id) == blocks_for(len(r.prompt) + r.max_tokens, 4)
            if r.handle.request.max_tokens is not None:
                assert r.max_tokens == r.handle.request.max_tokens, "an explicit max_tokens was capped"
        assert hx.order == sorted(hx.order) and not hx.skipped, "admission is not FIFO"
        assert sum(w.choices for w in s.waiting) <= 5, "more wait than --max-queue"

    for op, x, y in ops:
        if op == "submit":
            try:
                handles.append(hx.submit(x, y, salt=len(handles)))
            except Refusal as r:
                refused.append(r.code)
                P, mt = x, y
                if r.code == "context_length_exceeded":
                    assert P + (mt or 1) > 40
                elif r.code == "kv_budget_exceeded":
                    assert P + (mt or 1) <= 40 and blocks_for(P + (mt or 1), 4) > 12
                else:
                    assert r.code == "queue_full" and hx.inbox.queued >= 5  # 5 places + free rows
        elif op == "cancel" and handles:
            handles[x % len(handles)].cancel()
        else:
            for _ in range(x):
                hx.tick()
                check()
    hx.run()
    check()
    assert hx.kv.available_blocks == hx.kv.total and hx.counters.kv_blocks_held == 0
    assert hx.counters.kv_blocks_peak <= hx.kv.total
    admitted = trimmed = 0
    for h in handles:
        evs = drain(h)
        terminal = [e for e in evs if isinstance(e, Finished | Refused)]
        assert len(terminal) == 1 and evs[-1] is terminal[0], evs
        P = len(h.request.prompt_ids)
        if isinstance(evs[0], Admitted):
            admitted += 1
            res = evs[-1].result
            assert res.token_ids == expected(P, len(res.token_ids)), "a row got another row's tokens"
            assert [e.token_id for e in evs if isinstance(e, Token)] == res.token_ids
            if res.finish_reason == "length":
                assert len(res.token_ids) == evs[0].max_tokens
            else:
                assert res.finish_reason == "cancelled" and h.cancelled
        elif isinstance(evs[0], Finished):
            assert len(evs) == 1 and evs[0].result.finish_reason == "cancelled" and h.cancelled
        else:  # waited too long, or could not start at once with the queue full
            assert len(evs) == 1 and evs[0].refusal.code in (
                "kv_memory_unavailable",
                "batch_rows_unavailable",
                "queue_full",
            )
            trimmed += evs[0].refusal.code == "queue_full"
    c = hx.counters
    assert c.admitted == admitted == c.finished
    assert c.queue_rejected == refused.count("queue_full") + trimmed
    assert c.rejected_context_length == refused.count("context_length_exceeded")
    assert c.rejected_kv_budget == refused.count("kv_budget_exceeded")


# ---- property: the real engine under racing threads ---------------------------------------------


class RecordingDeque(deque):
    """The worker's waiting queue, recording the order requests entered it (only the worker appends)."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def append(self, w):
        self.log.append(w.id)
        super().append(w)


PLAN = st.lists(
    st.tuples(
        st.integers(1, 24),  # prompt length
        st.one_of(st.none(), st.integers(1, 24)),  # max_tokens
        st.sampled_from(["keep", "keep", "cancel_now", "cancel_soon"]),
        st.integers(0, 3),  # ms before submitting
    ),
    min_size=1,
    max_size=12,
)


@settings(
    max_examples=20,
    deadline=None,
    # no shrinking: a failing example would be rerun many times, each waiting out its bounded waits
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(plan=PLAN, nthreads=st.integers(1, 4))
def test_threads_random_submit_cancel_keep_invariants(make_engine, plan, nthreads):
    """Under racing submitters and cancels: every block is free or in exactly one table (checked
    inside every step, on the worker), each request gets exactly one terminal event, admission follows
    queue order, and an idle engine owns its whole pool again.

    Seen to fail with FIFO skip-ahead, with a cancelled row's blocks leaked (in ~2 s: blocks held while
    no row runs; before that check it hung until pytest's 600 s timeout, hypothesis shrinking example
    after example), and with a dropped waiter given no terminal event.
    """
    e = make_engine(
        kv_cache_bytes=12 * 4 * TINY_KV_BYTES_PER_TOKEN,
        block_size=4,
        max_seqs=3,
        max_queue=64,
        max_queue_wait=30,
        max_model_len=40,
        min_cap_tokens=8,
        prefill_chunk=5,
    )
    state = e.core.state
    queue_order: list[int] = []
    admit_order: list[int] = []
    violations: list[str] = []
    state.waiting = RecordingDeque(queue_order)
    sched = e.core.scheduler
    start_row = sched._start_row

    def recording_start_row(row):
        admit_order.append(row.id)
        mine = queue_order.index(row.id)
        if any(queue_order.index(x.id) < mine for x in state.waiting):
            violations.append(f"{row.id} admitted past an earlier waiter")
        start_row(row)

    sched._start_row = recording_start_row

    def probe(so):  # runs on the worker, between admissions and the forward
        try:
            state.kv.check()
        except AssertionError as exc:
            violations.append(str(exc))

    set_step_hook(e, probe)
    handles: list[RequestHandle] = []
    later: list[RequestHandle] = []
    refused: list[tuple[str, int, int | None]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    parts = [plan[i::nthreads] for i in range(nthreads)]
    barrier = threading.Barrier(nthreads)

    def submitter(items, salt):
        try:
            submit_all(items, salt)
        except BaseException as exc:
            errors.append(exc)

    def submit_all(items, salt):
        barrier.wait(5)
        for k, (P, mt, what, ms) in enumerate(items):
            time.sleep(ms / 1000)
            req = GenerationRequest(
                prompt(P, salt * 31 + k), SamplingParams(temperature=0.7, seed=k), mt, ignore_eos=True
            )
            try:
                h = e.submit(req)
            except Refusal as r:
                with lock:
                    refused.append((r.code, P, mt))
                continue
            with lock:
                handles.append(h)
                if what == "cancel_soon":
                    later.append(h)
            if what == "cancel_now":
                h.cancel()

    threads = [threading.Thread(target=submitter, args=(p, i)) for i, p in enumerate(parts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors, errors
    for code, P, mt in refused:  # the only refusal these sizes can meet: the context
        assert code == "context_length_exceeded" and P + (mt or 1) > 40
    assert e.snapshot().counters.rejected_context_length == len(refused)
    time.sleep(0.002)
    for h in later:
        h.cancel()

    def leaked() -> bool:  # no row runs, yet blocks are held: nothing will ever give them back
        snap = e.snapshot()
        return snap.running == 0 and snap.kv_blocks_held > 0

    end = time.monotonic() + 10  # for all of them together: a lost terminal event fails in 10 s
    for h in handles:
        evs = []
        while not evs or not isinstance(evs[-1], Finished | Refused):
            try:
                evs.append(h.events.get(0.1))
            except TimeoutError:
                assert not leaked(), "KV blocks leaked: a waiter starves"
                assert time.monotonic() < end, "a request never got its terminal event"
        h.seen = evs
    assert wait_until(lambda: e.snapshot().idle, 5)
    assert not violations, violations
    snap = e.snapshot()
    assert snap.kv_blocks_available == snap.kv_blocks_total and snap.counters.kv_blocks_held == 0
    assert snap.counters.kv_blocks_peak <= snap.kv_blocks_total
    for h in handles:
        assert not drain(h), "an event after the terminal one"
        terminal = [ev for ev in h.seen if isinstance(ev, Finished | Refused)]
        assert len(terminal) == 1
        assert not isinstance(terminal[0], Refused), terminal[0].refusal.message
        if not h.cancelled:
            assert terminal[0].result.finish_reason == "length"
    pos = {hid: i for i, hid in enumerate(queue_order)}
    assert [pos[h] for h in admit_order] == sorted(pos[h] for h in admit_order), "admission is not FIFO"
    assert snap.counters.admitted == len(admit_order)
    e.shutdown()
