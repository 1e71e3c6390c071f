"""The worker's per-request state: a queued request (`WaitEntry`) and a running one (`Row`).

Both live only on the engine's worker thread. A `Row` owns everything that makes its output its own:
its sampler (and generator), stop matcher, detokenizer and reply channel; rows are keyed by request id,
never by batch position, so a row leaving the batch cannot hand any of these to a neighbour.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.core.predicted import PredictionDrafts
from kvgate.core.snapshot import WaiterView
from kvgate.core.speculate import DraftGate, NgramIndex
from kvgate.request import BudgetCap, RequestHandle
from kvgate.sampling import Sampler
from kvgate.stop import StopMatcher
from kvgate.structured.compiler import Grammar
from kvgate.tokenizer import IncrementalDetokenizer


@dataclass
class WaitEntry:
    handle: RequestHandle
    max_tokens: int
    explicit: bool  # max_tokens given by the caller: never capped
    requested: int  # what the caller asked for, or the context ceiling when unset
    cap: BudgetCap | None
    deadline: float
    hashes: list[bytes] = field(default_factory=list)  # full prompt-block hashes (prefix cache)
    followers: list[RequestHandle] = field(default_factory=list)  # the other choices of an n > 1 request

    @property
    def id(self) -> int:
        return self.handle.id

    @property
    def choices(self) -> int:
        return 1 + len(self.followers)

    @property
    def prompt_len(self) -> int:
        return len(self.handle.request.prompt_ids)

    def view(self, blocks: int) -> WaiterView:
        """This request as the forecasts see a waiter, holding `blocks` when admitted."""
        may_stop = not self.handle.request.ignore_eos
        return WaiterView(
            self.prompt_len, blocks, self.id, self.max_tokens, self.choices, may_stop, self.explicit
        )


@dataclass
class Row:
    handle: RequestHandle
    prompt: list[int]
    max_tokens: int
    sampler: Sampler
    stop: StopMatcher
    detok: IncrementalDetokenizer
    budget_cap: BudgetCap | None
    admitted_at: float
    tokens: list[int] = field(default_factory=list)  # prompt, then generated tokens
    text: list[str] = field(default_factory=list)
    computed: int = 0  # positions whose K/V are in the cache
    token_times: list[float] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    # a choice of an n > 1 request shares the first `shared_positions` of its leader's prompt: it may
    # not prefill until the leader has computed them
    leader: int | None = None
    shared_positions: int = 0
    followers: list[int] = field(default_factory=list)
    ngrams: NgramIndex | None = None  # speculative decoding's draft source, when the row may speculate
    gate: DraftGate | None = None  # whether it drafts now, from its own acceptance (with ngrams)
    prediction: PredictionDrafts | None = None  # drafts from the client's `prediction` (with ngrams)
    # a scored prompt's log-probabilities so far (`GenerationRequest.prompt_logprobs`), else None
    prompt_logprobs: list | None = None
    # the grammar whose slot this row pins (kvgate.core.side_waits), given back when the row ends
    grammar_pin: Grammar | None = None

    @property
    def id(self) -> int:
        return self.handle.id

    @property
    def prediction_tokens(self) -> tuple[int, int] | None:
        """(accepted, rejected) prediction drafts; (0, 0) for a prediction this row never read (it does
        not speculate); None without a prediction."""
        if self.handle.request.prediction_ids is None:
            return None
        p = self.prediction
        return (0, 0) if p is None else (p.accepted, p.rejected)

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

    def steps_left(self, prefill_chunk: int) -> int:
        """Steps until the row ends at the latest: its prefill chunks, then its remaining tokens."""
        return self.max_tokens - len(self.out_ids) + -(-self.prompt_left // prefill_chunk)
