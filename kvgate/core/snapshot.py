"""What other threads may know about the engine: counters and an immutable snapshot of its state.

The worker thread is the only writer of engine state (queue, rows, blocks, counters). After each
phase that changes it, the worker builds an `EngineSnapshot` and publishes it by swapping one
reference; readers (metrics, `/v1/resources`, health, Retry-After, the TTFT prediction) take that
reference and read plain values that never change under them. No reader touches a live structure,
so correctness does not lean on the GIL, and a request arriving while a row finishes sees the row
either fully there or fully gone.

The engine flushes a step's events to the request handles only after publishing the snapshot that
includes them: a caller that has seen an event can trust the snapshot to reflect it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(slots=True)
class Counters:
    """Monotone counts (except `kv_blocks_held`). The worker writes these; the admission gate counts
    its own refusals separately (`GateCounters`) and the snapshot adds them up."""

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
    spec_draft_tokens: int = 0  # draft tokens proposed by prompt lookup and verified (--speculate)
    spec_accepted_tokens: int = 0  # of those, the ones the model's own choice confirmed
    prefix_cache_queries_tokens: int = 0  # prompt tokens looked up in the prefix cache at admission
    prefix_cache_hits_tokens: int = 0  # of those, tokens whose K/V came from the cache

    def plus(self, other: Counters) -> Counters:
        return Counters(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


@dataclass(frozen=True, slots=True)
class RowView:
    """A running row as the TTFT prediction, Retry-After and observers need it."""

    request_id: int
    steps_left: int
    blocks: int
    prompt_len: int
    prompt_left: int  # prompt tokens still to prefill
    generated: int
    max_tokens: int
    logprobs_bytes: int = 0  # the logprobs memory its request reserved (back when it ends and is sent)
    may_stop: bool = False  # it can end at EOS before max_tokens (not ignore_eos)
    explicit: bool = True  # its max_tokens was given (unset: the rest of the context)

    @property
    def prefilling(self) -> bool:
        return self.prompt_left > 0


@dataclass(frozen=True, slots=True)
class WaiterView:
    prompt_len: int
    blocks: int
    request_id: int = 0
    max_tokens: int = 0
    choices: int = 1  # rows it takes when admitted (n > 1 choices are admitted together)
    may_stop: bool = False  # it can end at EOS before max_tokens (not ignore_eos), as RowView's
    explicit: bool = True  # its max_tokens was given (unset: the rest of the context)


@dataclass(frozen=True)
class EngineSnapshot:
    version: int  # increases with every publish
    published_at: float
    counters: Counters  # a copy; never mutated after publishing
    rows: tuple[RowView, ...]
    waiters: tuple[WaiterView, ...]
    absorbed: int  # the highest submission sequence number the worker has taken into its queue
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_cached: int  # evictable: in the prefix cache, referenced by no request
    step_time_ema: float | None
    # (base, slope): seconds per prompt token = base + slope x its position, fitted over recent prefill
    # steps (kvgate.core.prefill_rate); None before any prompt chunk was timed
    prefill_line: tuple[float, float] | None
    slowest_step: float  # seconds; 0 before the first step
    prefill_token_time_best: float | None = None  # the fastest prefill step's seconds per prompt token
    recent_steps: tuple[float, ...] = field(default=())
    recent_decode_steps: tuple[float, ...] = field(default=())  # of those, the steps without a prompt chunk
    recent_decode_periods: tuple[float, ...] = field(default=())  # start to start, decode-only ticks
    recent_decode_rows: tuple[int, ...] = field(default=())  # the rows of each of those ticks
    decode_row_seconds: float = 0.0  # what a decode tick gains per row (kvgate.core.state.row_slope)
    decode_position_seconds: float = 0.0  # a decode step's growth per row context position (measured)
    cached_hashes: frozenset = frozenset()  # prompt-block hashes the prefix cache holds
    logprobs_bytes_held: int = 0  # reserved for requests' log-probabilities (kvgate.core.logprob_budget)
    logprobs_bytes_peak: int = 0
    grammars_kept: int = 0  # distinct grammars the compiler keeps (--max-grammars slots in use)
    grammars_running: int = 0  # of those, pinned by running rows (kvgate.structured.compiler)
    # steps until a grammar slot frees: the held grammar's last row (`hold_for_head`), else the running
    # grammar that ends soonest; 0 when none runs (a cluster replica's grammar 429 Retry-After)
    grammar_slot_steps: int = 0
    stop_lengths: tuple[int, ...] = ()  # tokens out of the recent rows that ended at EOS or a stop
    step_prior: float | None = None  # a decode tick before any was timed: its weights read at a slow rate

    @property
    def running(self) -> int:
        return len(self.rows)

    @property
    def waiting(self) -> int:
        return len(self.waiters)

    @property
    def kv_blocks_held(self) -> int:
        """Referenced by at least one running request (each counted once)."""
        return self.kv_blocks_total - self.kv_blocks_free - self.kv_blocks_cached

    @property
    def kv_blocks_available(self) -> int:
        """What admission can hand out now: free plus evictable cached blocks."""
        return self.kv_blocks_free + self.kv_blocks_cached

    @property
    def idle(self) -> bool:
        return not self.rows and not self.waiters

    def with_gate(self, gate: Counters) -> EngineSnapshot:
        """This snapshot with the admission gate's refusal counts added in."""
        return dataclasses.replace(self, counters=self.counters.plus(gate))
