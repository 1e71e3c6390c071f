"""Logprobs memory: what a request's log-probabilities hold, reserved at admission from a planned budget.

A position with logprobs holds a `TokenLogprobs` (the chosen token's and its top k, packed) from the
step that makes it until nobody needs it: the end of its row, or, where the caller keeps them after
(`GenerationRequest.held`: the server builds a whole body from them), until the caller closes the
handle (`RequestHandle.close`: after the response is sent). That is memory no plan term covered: ~20
KB a token at top_logprobs 20 before session 37 (an n = 8 answer of 2,440 tokens went 129 MiB over a
1.2 GiB limit). Now `--logprobs-memory` is a term of the plan (on CPU, where the ledger is host
memory), and a request asking for logprobs reserves, per choice,

    max_tokens x position_bytes(logprobs) + scored prompt positions x position_bytes(prompt_logprobs)

(plus `held` bytes a position where its caller builds more from them) before it is admitted, as its KV
blocks are: a request that can never fit is a 400 naming the numbers (an unset max_tokens is capped
and the cap reported), one that cannot fit now waits in the FIFO and gets a 429 after --max-queue-wait.
Requests that need no logprobs memory may pass a head that waits for it alone, and a held prompt
list's first prompt reserves the whole list (`logprobs_bytes`): a list's later prompts are what its
response waits for (`kvgate.core.scheduler`). Only the worker thread touches `LogprobBudget`; a close
reaches it as a command.
"""

from __future__ import annotations

from kvgate.request import BudgetCap, GenerationRequest, Refusal
from kvgate.units import fmt_bytes

# A position's `TokenLogprobs` and its slot in a list: measured 288 B at k = 0 and 300 B at k = 1
# (tracemalloc, tests/test_logprob_budget.py checks the constants against a measurement)
POSITION_BYTES = 384
TOP_BYTES = 16  # each of the top k: a 4-byte id and an 8-byte logprob in the packed arrays, ~12 B measured


def position_bytes(k: int | None, held: int | None = None) -> int:
    """Bytes one position's logprobs hold with `k` top entries (None: no logprobs, 0 bytes)."""
    if k is None:
        return 0
    return POSITION_BYTES + TOP_BYTES * k + (held or 0)


def request_bytes(req: GenerationRequest, max_tokens: int) -> int:
    """One choice's reservation: its output positions' logprobs and its scored prompt positions'."""
    out = max_tokens * position_bytes(req.sampling.logprobs, req.held)
    if req.prompt_logprobs is not None:
        out += max(0, len(req.prompt_ids) - 1) * position_bytes(req.prompt_logprobs, req.held)
    return out


def reserved_bytes(req: GenerationRequest, max_tokens: int) -> int:
    """What admitting this choice reserves: its own need, or what its list arranged (`logprobs_bytes`)."""
    return request_bytes(req, max_tokens) if req.logprobs_bytes is None else req.logprobs_bytes


def group_bytes(req: GenerationRequest, max_tokens: int, n: int = 1) -> int:
    """`n` choices of `req`: the first scores the prompt (if asked), each holds its output's logprobs."""
    return request_bytes(req, max_tokens) + (n - 1) * max_tokens * position_bytes(
        req.sampling.logprobs, req.held
    )


def best_tokens(req: GenerationRequest, budget: int, n: int) -> int:
    """The most output tokens each of `n` choices can have within `budget` bytes (may be < 1)."""
    per, room = n * position_bytes(req.sampling.logprobs, req.held), budget - request_bytes(req, 0)
    if not per:  # only the prompt is scored: any number of tokens, or none when the prompt is too much
        return 1 << 62 if room >= 0 else 0
    return room // per


def never_fits(
    req: GenerationRequest, max_tokens: int, explicit: bool, n: int, budget: int
) -> BudgetCap | Refusal | None:
    """None when `n` choices of `max_tokens` fit `budget` (the whole logprobs memory, or an unset
    max_tokens' share of it in a list of prompts); else an unset max_tokens capped to what fits, or the
    400 that says the request can never fit."""
    need = group_bytes(req, max_tokens, n)
    if need <= budget:
        return None
    best = best_tokens(req, budget, n)
    if not explicit and best >= 1:
        return BudgetCap(max_tokens, best, "logprobs_budget")
    k = req.sampling.logprobs if req.sampling.logprobs is not None else req.prompt_logprobs
    scored = (
        f" and {len(req.prompt_ids) - 1} scored prompt positions" if req.prompt_logprobs is not None else ""
    )
    fix = (
        f"Lower max_tokens to at most {best}" if best >= 1 else "Shorten the prompt or do not score it (echo)"
    )
    return Refusal(
        "logprobs_budget_exceeded",
        f"this request's log-probabilities need {fmt_bytes(need)} ({n} choice(s) x {max_tokens} tokens{scored}, "
        f"{position_bytes(k, req.held)} B a position at top_logprobs={k}), more than the "
        f"{fmt_bytes(budget)} of logprobs memory it may hold (--logprobs-memory). {fix}, ask for fewer "
        "top_logprobs or choices, or start the server with a larger --logprobs-memory.",
        400,
        estimated_bytes=need,
        limit_bytes=budget,
        param="max_tokens" if best >= 1 else "logprobs",
    )


def group_refusal(need: int, budget: int, prompts: int, unset: bool) -> Refusal:
    counted = " (an unset max_tokens counted at its least, --min-cap-tokens)" if unset else ""
    return Refusal(
        "logprobs_budget_exceeded",
        f"this request's {prompts} prompts are admitted together and their log-probabilities together need "
        f"{fmt_bytes(need)}{counted}, more than the server's logprobs memory of {fmt_bytes(budget)} "
        "(--logprobs-memory). Send fewer prompts a request, lower max_tokens or top_logprobs, or start the "
        "server with a larger --logprobs-memory.",
        400,
        estimated_bytes=need,
        limit_bytes=budget,
        param="prompt",
    )


def timeout_refusal(
    need: int, free: int, budget: int, waited: float, retry_after: int, bound: str = "--max-queue-wait"
) -> Refusal:
    return Refusal(
        "logprobs_memory_unavailable",
        f"waited {waited:g}s ({bound}) for {fmt_bytes(need)} of logprobs memory; "
        f"{fmt_bytes(free)} of {fmt_bytes(budget)} (--logprobs-memory) was free, the rest held by responses "
        "with logprobs still running or being sent. Retry after the Retry-After seconds, or ask for fewer "
        "tokens or top_logprobs.",
        429,
        retry_after=retry_after,
        estimated_bytes=need,
        limit_bytes=budget,
    )


class LogprobBudget:
    """The bytes held for logprobs, by request id, against the planned limit (the worker's own)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0
        self.peak = 0
        self._by_id: dict[int, int] = {}

    @property
    def free(self) -> int:
        return self.limit - self.held

    def take(self, handle, nbytes: int) -> None:
        """Hold `nbytes` for `handle` (the caller checked `free`); none for a handle already closed:
        nobody will keep its logprobs (its cancel is on the way)."""
        if nbytes <= 0 or handle.closed:
            return
        self._by_id[handle.id] = self._by_id.get(handle.id, 0) + nbytes
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def held_by(self, request_id: int) -> int:
        return self._by_id.get(request_id, 0)

    def give_back(self, request_id: int) -> None:
        """Idempotent: a request's bytes come back once, at its row's end or its handle's close."""
        self.held -= self._by_id.pop(request_id, 0)
