"""Per-request sampling: validated parameters and a sampler that owns its random generator.

A request's tokens depend only on its own logits and its own `torch.Generator`, never on which other
requests share the step: that is half of "batching does not change output" (the model's row-wise
math is the other half).

The logits a row samples from are, in order: the model's, plus its `logit_bias`, with its repetition /
presence / frequency penalties, -inf outside vLLM's `allowed_token_ids` and on the tokens its
`bad_words` ban at this step, with its grammar's mask (-inf on the tokens the grammar forbids; the
masks of all grammar rows are computed in one batched call, and a row without a grammar pays
nothing). Log-probabilities, for the rows that ask, are the log-softmax of exactly those logits:
after bias, penalties and mask, before temperature, top-k, top-p and min-p (vLLM's "processed"
logprobs less its temperature), so they describe the distribution the sampler truncated and scaled.
"""

from __future__ import annotations

import functools
import math
import os
from array import array
from collections import deque

import torch

from kvgate.draw_torch import SAMPLE_ROWS, draw_torch
from kvgate.sampling_params import (  # noqa: F401 (re-exported: kvgate.sampling is where callers look)
    GREEDY_BELOW,
    LOGIT_BIAS_LIMIT,
    MAX_TOP_LOGPROBS,
    SamplingError,
    SamplingParams,
    TokenLogprobs,
)
from kvgate.structured import masks


class NoTokenLeft(ValueError):
    """A row's own constraints (allowed_token_ids, bad_words, with its grammar or min_tokens' held stop
    tokens) leave no token to draw: the request's fault, answered as a 400 (`vllm_extras`), never as the
    draw's argmax fallback, which would be a ruled-out token."""

    def __init__(self, generated: int):
        super().__init__(
            f"after {generated} generated tokens, allowed_token_ids and bad_words together with the rest of "
            "the request (its response_format, tools or structured output, or min_tokens' held stop tokens) "
            "leave no token that may come next. Allow more tokens, ban fewer words, or drop one of the "
            "constraints"
        )


class Sampler:
    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int):
        self.p = params
        # Below 1e-5 a temperature only overflows logits / T to inf (NaN after softmax); it means greedy.
        self.greedy = params.temperature < GREEDY_BELOW
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.gen = torch.Generator().manual_seed(seed % 2**64)
        self.vocab_size = vocab_size
        self.penalized = (
            params.repetition_penalty != 1.0
            or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
        )
        self.bias = _bias_tensors(params.logit_bias)
        # vLLM's allowed_token_ids (a bitmask; each draw unpacks the mask of the others) and bad_words,
        # with the drawn tokens a sequence's rest could end with (kvgate.memory.workspace's
        # `penalty_state` charges both)
        params.pack()
        self.allowed: bytes | None = params.allowed_token_ids
        self.bad_words = params.bad_words or None
        rest = max((len(w) - 1 for w in self.bad_words or ()), default=0)
        self.out: deque[int] = deque(maxlen=rest)
        # the row's own grammar state (a copy of the shared compiled grammar), advanced only here
        self.matcher = params.grammar.matcher() if params.grammar is not None else None
        self.grammar_error: str | None = None
        self.last_logprobs: TokenLogprobs | None = None
        self._prompt_ids = list(prompt_ids) if self.penalized else []
        self.seen: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        self.generated = 0  # tokens drawn so far
        self.suppressed: torch.Tensor | None = None  # token ids forbidden while generated < min_tokens
        self.min_tokens = 0

    def suppress(self, token_ids, min_tokens: int) -> None:
        """vLLM's `min_tokens`: `token_ids` (the row's stop tokens) may not be drawn before
        `min_tokens` tokens have been."""
        self.min_tokens = min_tokens
        self.suppressed = torch.tensor(sorted(token_ids), dtype=torch.long)

    def _init_penalty_state(self, n: int) -> None:
        # Sized by the logits, not the tokenizer: a model may have more rows than tokens (padding).
        self.seen = torch.zeros(n, dtype=torch.bool)
        ids = [t for t in self._prompt_ids if 0 <= t < n]
        if ids:
            self.seen[torch.tensor(ids)] = True
        self.counts = torch.zeros(n, dtype=torch.float32)

    def penalize(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` with this request's repetition/presence/frequency penalties applied (a copy)."""
        p = self.p
        if self.seen is None:
            self._init_penalty_state(logits.shape[-1])
        logits = logits.clone()
        if p.repetition_penalty != 1.0:
            sel = logits[self.seen]
            logits[self.seen] = torch.where(sel > 0, sel / p.repetition_penalty, sel * p.repetition_penalty)
        if p.frequency_penalty or p.presence_penalty:
            logits -= self.counts * p.frequency_penalty + (self.counts > 0).float() * p.presence_penalty
        return logits

    @property
    def processed(self) -> bool:
        """Whether this row's logits change before sampling (bias, penalties, min_tokens, allowed_token_ids,
        bad_words; a grammar's mask aside)."""
        return (
            self.penalized
            or self.bias is not None
            or self.generated < self.min_tokens
            or self.allowed is not None
            or self.bad_words is not None
        )

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of `logits` with the bias and penalties applied, the stop tokens forbidden before
        min_tokens, and the tokens allowed_token_ids and bad_words rule out forbidden. Called for the rows
        that are `processed`."""
        copied = self.penalized
        if self.penalized:
            logits = self.penalize(logits)
        if self.bias is not None:
            ids, values = self.bias
            ok = ids < logits.shape[-1]
            logits = logits if copied else logits.clone()
            copied = True
            logits[ids[ok]] += values[ok]
        if self.generated < self.min_tokens and len(self.suppressed):
            logits = logits if copied else logits.clone()
            copied = True
            logits[self.suppressed[self.suppressed < logits.shape[-1]]] = float("-inf")
        banned = self.banned()
        if self.allowed is not None or banned:
            logits = logits if copied else logits.clone()
            copied = True
            if self.allowed is not None:
                logits.masked_fill_(self._outside_mask(logits.shape[-1]), float("-inf"))  # transient
            if banned:
                logits[[t for t in banned if t < logits.shape[-1]]] = float("-inf")
        # always a copy: the caller masks it in place (a grammar), and a row whose bad words ban nothing
        # this step must not hand back the batch's own logits (QA of session 46: the grammar's mask was
        # written into them, a 500 under inference mode and its neighbours' logits otherwise)
        return logits if copied else logits.clone()

    def _outside_mask(self, n: int) -> torch.Tensor:
        """True for the `n` token ids allowed_token_ids leaves out (made per draw, not kept: a row
        keeps only the bitmask)."""
        packed = torch.frombuffer(bytearray(self.allowed), dtype=torch.uint8)
        bits = (packed.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)).bitwise_and_(1).flatten()
        outside = torch.ones(n, dtype=torch.bool)
        k = min(n, bits.shape[0])
        outside[:k] = bits[:k] == 0
        return outside

    def banned(self) -> list[int]:
        """vLLM's bad_words now: each sequence's last token where the output ends with the rest of it."""
        out, tail = [], array("i", self.out)
        for seq in self.bad_words or ():
            k = len(seq) - 1
            if k == 0 or (len(tail) >= k and tail[-k:] == array("i", seq[:-1])):
                out.append(seq[-1])
        return out

    @property
    def constrained(self) -> bool:
        """Whether the request's own allowed_token_ids or bad_words rule tokens out."""
        return self.allowed is not None or self.bad_words is not None

    def forbids(self, token: int) -> bool:
        """Whether allowed_token_ids or bad_words rule `token` out now (a row whose every token was
        ruled out falls back to its argmax, which these must not let through)."""
        a = self.allowed
        if a is not None and not (token >> 3 < len(a) and a[token >> 3] >> (token & 7) & 1):
            return True
        if (
            self.generated < self.min_tokens
            and self.suppressed is not None
            and bool((self.suppressed == token).any())
        ):
            return True  # min_tokens' held stop tokens, which the argmax fallback can also land on
        return token in self.banned()

    @property
    def grammar_done(self) -> bool:
        """The grammar accepted its end: nothing more may be generated."""
        m = self.matcher
        return m is not None and self.grammar_error is None and not m.is_error() and m.is_stopped()

    def record(self, token: int) -> None:
        """Remember a generated token for the penalties and advance the grammar (never raises: a token
        the grammar refuses marks the row, whose next draw then fails)."""
        self.generated += 1
        if self.bad_words is not None:
            self.out.append(token)
        if self.penalized:
            self.seen[token] = True
            self.counts[token] += 1
        if self.matcher is not None and self.grammar_error is None and not self.matcher.consume_token(token):
            self.grammar_error = self.matcher.get_error() or f"token {token} is not allowed by the grammar"

    def sample(self, logits: torch.Tensor) -> int:
        """`logits`: float32 `[vocab]` (may be a view into the batch's logits; it is not modified)."""
        return sample_batch([self], logits.unsqueeze(0))[0]


# kvgate's C++ draw (kvgate/models/csrc/draw.cpp) for float32 CPU logits; False: kvgate.draw_torch
NATIVE_DRAW = True


def sample_batch(samplers: list[Sampler], logits: torch.Tensor, rows: list[int] | None = None) -> list[int]:
    """One token per sampler; sampler i reads float32 `logits[rows[i]]` (`rows` default: 0, 1, ...).

    Each row's result depends only on its own logits, parameters and generator, never on the rows
    beside it. A sampled row draws one uniform number from its own generator and takes the inverse
    CDF of its distribution there: temperature, then top-k (exactly k tokens) or top-p (the smallest
    set of the likeliest tokens whose probability reaches p, at least one), then min-p (drop tokens
    below min_p x the top probability). A row with non-finite or all-zero probabilities falls back to
    its argmax. `logits` is never modified.

    The draw is kvgate's C++ kernel (`_draw_native`; kvgate/models/csrc/draw.cpp), which finds a
    nucleus without sorting the vocabulary; logits off the CPU are copied to it first (the runner does).
    Where the kernels did not build, or with `NATIVE_DRAW` off, PyTorch ops draw (`kvgate.draw_torch`):
    the same distribution, though for the same uniform a row may pick another token.
    """
    rows = list(range(len(samplers))) if rows is None else rows
    vocab = logits.shape[-1]
    bitmasks = _grammar_masks(samplers)

    def row_logits(i: int) -> torch.Tensor:
        s = samplers[i]
        x = s.process(logits[rows[i]]) if s.processed else logits[rows[i]]
        m = bitmasks.get(i)
        if m is not None:
            x = x.clone() if not s.processed else x
            masks.apply_bitmask(x.unsqueeze(0), m.unsqueeze(0))
        return x

    ext = draw_kernel(logits)
    if ext is not None:
        tokens = _draw_native(ext, samplers, logits, rows, set(bitmasks), row_logits)
    else:
        tokens = draw_torch(samplers, vocab, row_logits)
    for i, m in bitmasks.items():  # checked before any row's state moves: a failure redoes the batch
        if not masks.allows(m, tokens[i]):
            if samplers[i].constrained:
                raise NoTokenLeft(samplers[i].generated)
            raise ValueError(f"the grammar allows no token here (drew {tokens[i]}); the output cannot go on")
    for i, s in enumerate(samplers):
        if s.constrained and s.forbids(tokens[i]):
            raise NoTokenLeft(s.generated)
    for i, s in enumerate(samplers):
        k = s.p.logprobs
        s.last_logprobs = None if k is None else token_logprobs(row_logits(i), tokens[i], k)
    for s, t in zip(samplers, tokens, strict=True):
        s.record(t)
    return tokens


def draw_kernel(logits: torch.Tensor):
    """kvgate's C++ kernels when they draw these logits (`NATIVE_DRAW`, float32 on the CPU, already
    built), else None."""
    if not NATIVE_DRAW or logits.device.type != "cpu" or logits.dtype != torch.float32:
        return None
    from kvgate.models import native

    return native.ready()  # built by the engine's start (`host_draw_kernels` off the CPU); never in a step


def host_draw_kernels() -> str:
    """For an engine off the CPU, at its start: each step copies its logits to the host and draws them
    there, so build (or load) kvgate's C++ kernels now, once per machine as a CPU server does, for the
    C++ draw (0.64 against PyTorch's 7.3 ms for 16 top-p rows on a Zen 4 core pair). Says which draw
    runs."""
    from kvgate.models import native

    if not NATIVE_DRAW:
        return "sampling: PyTorch ops draw on the host (NATIVE_DRAW is off)"
    if native.extension() is None:
        return f"sampling: PyTorch ops draw on the host ({native.unavailable()})"
    return "sampling: kvgate's C++ draw on the host"


def draw_params(samplers: list[Sampler], vocab: int) -> tuple[torch.Tensor, ...]:
    """The C++ draw's per-row parameters: temperature (0: greedy), top-k (0: none), top-p, min-p."""
    temps = torch.tensor([0.0 if s.greedy else s.p.temperature for s in samplers], dtype=torch.float32)
    top_k = torch.tensor([s.p.top_k if 0 < s.p.top_k < vocab else 0 for s in samplers], dtype=torch.int64)
    top_p = torch.tensor([s.p.top_p for s in samplers], dtype=torch.float32)
    min_p = torch.tensor([s.p.min_p for s in samplers], dtype=torch.float32)
    return temps, top_k, top_p, min_p


@functools.lru_cache(maxsize=64)
def _greedy_params(n: int) -> tuple[torch.Tensor, ...]:
    """The draw's parameters and uniforms for n greedy rows, built once per n (the draw only reads them):
    temperature 0, which alone decides a greedy row's token (the others are neutral values, not the
    samplers' own). Five tensors less to build a step, which a one-row step paid ~0.05 ms for."""
    zeros = torch.zeros(n, dtype=torch.float32)
    return zeros, torch.zeros(n, dtype=torch.int64), torch.ones(n, dtype=torch.float32), zeros, zeros


def _draw_native(
    ext, samplers: list[Sampler], logits: torch.Tensor, rows: list[int], masked: set[int], row_logits
):
    """Every row's token in C++ (kvgate/models/csrc/draw.cpp, its opening lines say how): the rows
    whose logits do not change before the draw in one call, each other row in a call of its own on
    its processed copy (so no more than one such copy is alive)."""
    vocab = logits.shape[-1]
    if all(s.greedy for s in samplers):  # the common serving case: constant parameters, no draws
        *params, u = _greedy_params(len(samplers))
    else:  # each sampled row's one uniform from its own generator; greedy rows draw none
        u = torch.tensor([0.0 if s.greedy else float(torch.rand(1, generator=s.gen)) for s in samplers])
        params = draw_params(samplers, vocab)
    tokens = [0] * len(samplers)
    plain = [i for i, s in enumerate(samplers) if not s.processed and i not in masked]
    if plain:
        at = torch.tensor([rows[i] for i in plain], dtype=torch.int64)
        these, u_these = params, u
        if len(plain) < len(samplers):
            sel = torch.tensor(plain, dtype=torch.int64)
            these, u_these = [t[sel] for t in params], u[sel]
        got = ext.draw_tokens(logits.contiguous(), at, *these, u_these, SAMPLE_ROWS)
        for i, t in zip(plain, got.tolist(), strict=True):
            tokens[i] = t
    for i in sorted(set(range(len(samplers))) - set(plain)):  # each processed row on its own copy
        one = slice(i, i + 1)
        x = row_logits(i).unsqueeze(0).contiguous()
        tokens[i] = int(
            ext.draw_tokens(x, torch.zeros(1, dtype=torch.int64), *(t[one] for t in params), u[one], 1)
        )
    return tokens


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """The chosen token's log-probability under `logits` and the `k` most likely tokens': always k, as
    OpenAI and vLLM give them, so tokens a grammar forbids fill the list at -inf (-9999.0 in JSON) when
    fewer than k are allowed (QA pass 6: clients that index top_logprobs[k] broke on shorter lists)."""
    lp = torch.log_softmax(logits.float(), -1)
    if not k:
        return TokenLogprobs.packed(token, float(lp[token]), [], [])
    vals, ids = torch.topk(lp, min(k, lp.shape[-1]))
    return TokenLogprobs.packed(token, float(lp[token]), ids.tolist(), vals.tolist())


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    """Row i's `targets[i]` log-probability and top `k` (finite ones) under `logits[i]`: a scored
    prompt's rows, one log-softmax for the group."""
    lp = torch.log_softmax(logits.float(), -1)
    got = lp.gather(1, torch.tensor(targets, dtype=torch.long).unsqueeze(1)).squeeze(1).tolist()
    if not k:
        return [TokenLogprobs.packed(t, g, [], []) for t, g in zip(targets, got, strict=True)]
    vals, ids = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
    return [
        TokenLogprobs(t, g, [(i, v) for i, v in zip(ri, rv, strict=True) if math.isfinite(v)])
        for t, g, ri, rv in zip(targets, got, ids.tolist(), vals.tolist(), strict=True)
    ]


_executor = None


def _grammar_masks(samplers: list[Sampler]) -> dict[int, torch.Tensor]:
    """The packed masks of the grammar rows, by sampler index: one batched fill per compiler."""
    global _executor
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(samplers):
        if s.matcher is not None:
            if s.grammar_error is not None:
                raise ValueError(f"grammar: {s.grammar_error}")
            groups.setdefault(id(s.p.grammar.compiler), []).append(i)
    out: dict[int, torch.Tensor] = {}
    for members in groups.values():
        if _executor is None:
            _executor = masks.new_executor()
        vocab = samplers[members[0]].p.grammar.compiler.vocab
        filled = masks.fill_bitmasks([samplers[i].matcher for i in members], vocab, _executor)
        for j, i in enumerate(members):
            if samplers[i].matcher.is_error():
                raise ValueError(f"grammar: {samplers[i].matcher.get_error()}")
            out[i] = filled[j]
    return out


def _bias_tensors(bias: dict[int, float] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    if not bias:
        return None
    ids = torch.tensor(list(bias), dtype=torch.long)
    return ids, torch.tensor(list(bias.values()), dtype=torch.float32)
