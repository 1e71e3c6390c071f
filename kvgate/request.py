"""What crosses between callers and the engine worker: requests, refusals, events, results, handles.

A `RequestHandle` is the caller's side of one request. Its event channel yields, in order: exactly one
`Admitted` or `Refused` (or, for a request cancelled while queued, one `Finished`); then `Token`s; then
exactly one `Finished` (after `Admitted`). The channel can be read from plain threads (`events.get`)
and from asyncio (`events.aget`) without polling.

`GenerationRequest.validate` is the one owner of the per-request rules (token ids inside the
vocabulary, max_tokens of at least 1, sampling ranges); the server calls it and turns a
`RequestError` into a 400 naming the field.

`Result.finish_reason` is one of `stop`, `length`, `cancelled`, `error`. The last two are kvgate's own
and never reach an OpenAI client as such: the server answers `error` with the stable error body, and
reports `cancelled` (cut short by a shutdown) as `length`, the OpenAI reason for "truncated output".
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace

from kvgate.sampling import MAX_TOP_LOGPROBS, SamplingParams, TokenLogprobs

_ids = itertools.count(1)
LIST_KEYS = itertools.count(1)  # GenerationRequest.logprobs_list


class RequestError(ValueError):
    """A request field is invalid; `param` names the field (for the 400's `param`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_token_ids(ids, vocab_size: int, param: str) -> None:
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise RequestError(
                f"token id {t!r} in '{param}' is outside the vocabulary [0, {vocab_size})", param
            )


def check_max_tokens(value, param: str = "max_tokens") -> None:
    """At least 1, or unset. Below 1 a request's KV reservation would be smaller than its prompt: its
    prefill would write past its blocks and fail every row sharing that step."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise RequestError(f"{param}={value!r} must be an integer of at least 1 (or unset)", param)


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None  # None = up to the remaining context (may be capped, and reported)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # vLLM's: the stop tokens (EOS, stop_token_ids) are not drawn, and stop strings not matched, before
    # this many tokens are out (benchmark clients send it to force their output length)
    min_tokens: int = 0
    # score the prompt (OpenAI's completions `echo` with `logprobs`): the log-probability of each prompt
    # token after the first under the model's raw logits, with this many top alternatives; None: off.
    # Such a request takes no prefix-cache hits (every prompt position is computed).
    prompt_logprobs: int | None = None
    # the tokens of OpenAI's `prediction`, the text the client expects back: with --speculate, the
    # row's first draft source (kvgate.core.predicted); it changes how fast, never what, is generated
    prediction_ids: list[int] | None = None
    skip_special_tokens: bool = True  # false: special tokens the model writes stay in the text
    # special tokens written out all the same: the markers a tool format is read by (Mistral's [TOOL_CALLS])
    keep_special: frozenset[int] = frozenset()
    # vLLM's: the stop string (or stop token's text) that ended the output stays in its text
    include_stop_str: bool = False
    # the stop token (EOS, stop_token_ids) is a Token event too, with its logprobs, as vLLM lists it: set
    # by return_token_ids / return_tokens_as_token_ids, whose clients pair the ids with the logprobs
    report_stop_token: bool = False
    # vLLM's `cache_salt`: roots this prompt's block hashes, so only prompts of the same salt share blocks
    cache_salt: str | None = None
    # (opening, closing) of output regions the stop strings do not apply in, or a tuple of such pairs:
    # tool calls (kvgate.stop)
    stop_exempt: tuple | None = None
    # a prompt of a list, its max_tokens unset: the KV blocks it may take at most (its share of the pool,
    # since a list is admitted together: `admission.fit_group`); None: the whole pool
    kv_share: int | None = None
    logprobs_share: int | None = None  # the same for its logprobs' bytes (kvgate.core.logprob_budget)
    # the logprobs bytes to reserve at admission in place of what its own tokens need: a held prompt
    # list's first prompt carries the whole list's, the others none (`admission.fit_group`); None: its own
    logprobs_bytes: int | None = None
    # the held prompt list this prompt belongs to (`admission.fit_group`), when its first prompt reserves
    # the list's logprobs: the others, which reserve none, may not be admitted before that one
    logprobs_list: int | None = None  # from LIST_KEYS
    # who keeps the logprobs after the row ends (kvgate.core.logprob_budget): None, the engine's events
    # only (their reservation ends with the row); an int, the caller, until it closes the handle, with
    # this many bytes a position of its own on top (the server: 0, or the dicts a Responses body builds)
    held: int | None = None

    def validate(self, vocab_size: int) -> GenerationRequest:
        """Raise `RequestError` / `SamplingError` (both ValueErrors naming the field) or return self."""
        self.sampling.validate()
        check_token_ids(self.prompt_ids, vocab_size, "prompt")
        check_token_ids(self.stop_token_ids, vocab_size, "stop_token_ids")
        if self.prediction_ids is not None:
            check_token_ids(self.prediction_ids, vocab_size, "prediction")
        check_max_tokens(self.max_tokens)
        m = self.min_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise RequestError(f"min_tokens={m!r} must be an integer of at least 0", "min_tokens")
        if self.max_tokens is not None and m > self.max_tokens:
            raise RequestError(
                f"min_tokens={m} is more than max_tokens={self.max_tokens}: it may be at most that",
                "min_tokens",
            )
        k = self.prompt_logprobs
        if k is not None and (
            isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS
        ):
            raise RequestError(
                f"prompt_logprobs={k!r} must be an integer between 0 and {MAX_TOP_LOGPROBS} (or unset)",
                "prompt_logprobs",
            )
        return self

    def as_kept(self, speculate: int) -> GenerationRequest:
        """What the engine holds while the request lives: without `--speculate` its prediction is never
        read, so only the fact that one was sent is kept (usage reports 0 accepted), not its tokens;
        the plan charges a prediction's memory only where rows speculate."""
        if self.prediction_ids and not speculate:
            return replace(self, prediction_ids=[])
        return self


@dataclass
class BudgetCap:
    requested_max_tokens: int
    admitted_max_tokens: int
    reason: str  # "kv_budget": the whole pool can't hold more; "kv_free_now": admitted early with less

    def header(self) -> str:
        return f"requested={self.requested_max_tokens}; admitted={self.admitted_max_tokens}; reason={self.reason}"


class Refusal(Exception):
    """A typed refusal; `status` is the HTTP status the server answers with."""

    def __init__(
        self,
        code: str,
        message: str,
        status: int,
        *,
        retry_after: int | None = None,
        retry_after_ms: int | None = None,
        estimated_bytes: int | None = None,
        limit_bytes: int | None = None,
        positions: int | None = None,
        positions_limit: int | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status
        self.retry_after = retry_after
        # the same wait to the millisecond, where the forecast has one (the openai SDK's `retry-after-ms`)
        self.retry_after_ms = retry_after_ms
        self.estimated_bytes = estimated_bytes
        self.limit_bytes = limit_bytes
        self.positions = positions
        self.positions_limit = positions_limit
        # the request field the fix is in, by its engine name: "prompt", "max_tokens" or "n"; the
        # server names it as the client sent it ("messages" for chat, "max_completion_tokens", ...)
        self.param = param

    def details(self) -> dict:
        keys = ("retry_after_ms", "estimated_bytes", "limit_bytes", "positions", "positions_limit")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


@dataclass
class Admitted:
    max_tokens: int
    budget_cap: BudgetCap | None
    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens whose K/V it shares instead of computing


@dataclass
class Refused:
    refusal: Refusal


@dataclass
class Token:
    token_id: int
    text: str  # text released by this token (may be "" while held back by detokenizer or stop matcher)
    t: float
    logprobs: TokenLogprobs | None = None  # when the request asked for log-probabilities
    # a reported stop token (`report_stop_token`) whose own text is not output: `text` is only the tail
    # held back before it, so its place in the text is after that tail
    after_text: bool = False


@dataclass
class Result:
    token_ids: list[int]
    text: str
    finish_reason: str  # stop | length | cancelled | error
    prompt_tokens: int
    completion_tokens: int
    budget_cap: BudgetCap | None
    submitted_at: float
    admitted_at: float | None
    first_token_at: float | None
    finished_at: float
    token_times: list[float]
    error: str | None = None
    # how a "stop" ended: "string", "token:<id>" (an end or stop_token_ids token) or "grammar"
    stop_reason: str | None = None
    stop_string: str | None = None  # with "string": which of the request's stop strings it was
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (or a sibling choice)
    # with `prompt_logprobs`: prompt tokens 1..P-1 scored in order (a choice of n > 1 other than the
    # first shares its leader's prompt positions, so only the first choice's list is whole)
    prompt_logprobs: list[TokenLogprobs] | None = None
    # with a `prediction`: (accepted, rejected) prediction drafts (kvgate.core.predicted); else None
    prediction_tokens: tuple[int, int] | None = None


@dataclass
class Finished:
    result: Result
    tail: str  # text released at the end (held-back text), already included in result.text


class Channel:
    """A FIFO usable from worker threads (put) and from both sync and async consumers."""

    def __init__(self) -> None:
        self._items: deque = deque()
        self._cv = threading.Condition(threading.Lock())
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    def put(self, item) -> None:
        with self._cv:
            self._items.append(item)
            self._cv.notify_all()
            waiters, self._async_waiters = self._async_waiters, []
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_wake, fut)
            except RuntimeError:  # that consumer's loop has closed
                pass

    def get(self, timeout: float | None = None):
        with self._cv:
            if not self._cv.wait_for(lambda: self._items, timeout):
                raise TimeoutError("no event within the timeout")
            return self._items.popleft()

    async def aget(self):
        loop = asyncio.get_running_loop()
        while True:
            with self._cv:
                if self._items:
                    return self._items.popleft()
                fut = loop.create_future()
                self._async_waiters.append((loop, fut))
            await fut


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class RequestHandle:
    def __init__(self, request: GenerationRequest, send_cancel, send_release=None):
        """`send_cancel(request_id)` delivers a cancel command to the engine's worker; `send_release`
        (request_id) gives its logprobs reservation back (`close`)."""
        self.id = next(_ids)
        self.request = request
        self.events = Channel()
        self.submitted_at = time.monotonic()
        self.cancelled = False
        self.closed = False
        self._send_cancel = send_cancel
        self._send_release = send_release
        self.admission: Admitted | Refusal | None = None
        self.final: Result | None = None

    def cancel(self) -> None:
        """Honoured at the next step boundary wherever the request is; safe to call any time, twice."""
        if not self.cancelled:
            self.cancelled = True
            self._send_cancel(self.id)

    def close(self) -> None:
        """The caller is done with this request's output: a request that reserved its logprobs until
        then (`GenerationRequest.held`) gives them back. Safe to call any time, twice."""
        if not self.closed:
            self.closed = True
            r = self.request
            asked = r.sampling.logprobs is not None or r.prompt_logprobs is not None
            if asked and r.held is not None and self._send_release is not None:
                self._send_release(self.id)

    # Synchronous consumers -------------------------------------------------------------------
    def wait_admitted(self, timeout: float | None = None) -> Admitted:
        ev = self.events.get(timeout)
        return self._on_admission(ev)

    def __iter__(self):
        while True:
            ev = self.events.get()
            if isinstance(ev, Finished):
                yield ev
                return
            yield ev

    def result(self, timeout: float | None = None) -> Result:
        """Wait for the final result. On a timeout the request is cancelled (its blocks go back at the
        next step) before `TimeoutError` is raised: nobody is left to read it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            if self.admission is None:
                try:
                    self.wait_admitted(timeout)
                except Refusal:
                    if self.final is not None:
                        return self.final
                    raise
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                ev = self.events.get(left)
                if isinstance(ev, Finished):
                    return ev.result
        except TimeoutError:
            self.cancel()
            raise

    # Asyncio consumers -----------------------------------------------------------------------
    async def await_admitted(self) -> Admitted:
        return self._on_admission(await self.events.aget())

    async def aevents(self):
        while True:
            ev = await self.events.aget()
            yield ev
            if isinstance(ev, Finished):
                return

    def _on_admission(self, ev) -> Admitted:
        if isinstance(ev, Finished):  # cancelled (or failed) while still queued
            self.final = ev.result
            self.admission = Refusal(ev.result.finish_reason, "the request ended before it was admitted", 499)
            raise self.admission
        if isinstance(ev, Refused):
            self.admission = ev.refusal
            raise ev.refusal
        assert isinstance(ev, Admitted), f"first event must be an admission decision, got {ev!r}"
        self.admission = ev
        return ev
