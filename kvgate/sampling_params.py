"""A request's sampling parameters, validated: the ranges, the error that names a bad value, and the
per-position log-probabilities a request can ask for (`kvgate.sampling` draws with them)."""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass

GREEDY_BELOW = 1e-5
MAX_TOP_LOGPROBS = 20
LOGIT_BIAS_LIMIT = 100.0


class SamplingError(ValueError):
    """An out-of-range sampling value; the message names the parameter, the value and the range."""

    def __init__(self, param: str, value, allowed: str):
        super().__init__(f"{param}={value!r} is out of range: allowed {allowed}")
        self.param = param


_RANGES = {
    "temperature": "0 <= temperature <= 2 (0 = greedy)",
    "top_p": "0 < top_p <= 1",
    "top_k": "an integer >= 1, or 0 / -1 for no limit",
    "min_p": "0 <= min_p <= 1",
    "repetition_penalty": "0 < repetition_penalty <= 2",
    "presence_penalty": "-2 <= presence_penalty <= 2",
    "frequency_penalty": "-2 <= frequency_penalty <= 2",
    "seed": "a 64-bit integer, -2**63 <= seed < 2**64 (a negative seed is used as its two's complement)",
    "logprobs": f"an integer 0 <= top logprobs <= {MAX_TOP_LOGPROBS}",
    "logit_bias": f"token ids in the vocabulary with biases -{LOGIT_BIAS_LIMIT:g} <= bias <= {LOGIT_BIAS_LIMIT:g}",
}


class TokenLogprobs:
    """One position's log-probabilities: the chosen token's and the `top` most likely (id, logprob).

    The top k are held as two packed arrays (ids as 32-bit ints, logprobs as doubles: exact for the
    float32 values the sampler gives), ~0.5 KB a position at k = 20 where a list of (id, logprob)
    tuples took ~2.5 KB (tracemalloc). A whole answer's positions are held until its body is sent, and
    `position_bytes` reserves them at admission (`kvgate.core.logprob_budget`)."""

    __slots__ = ("token_id", "logprob", "_ids", "_lps")

    def __init__(self, token_id: int, logprob: float, top=()):
        self.token_id, self.logprob = token_id, logprob
        self._ids = array("i", (i for i, _ in top))
        self._lps = array("d", (v for _, v in top))

    @classmethod
    def packed(cls, token_id: int, logprob: float, ids: list[int], lps: list[float]) -> TokenLogprobs:
        out = cls.__new__(cls)
        out.token_id, out.logprob, out._ids, out._lps = token_id, logprob, array("i", ids), array("d", lps)
        return out

    @property
    def top(self) -> list[tuple[int, float]]:
        return list(zip(self._ids, self._lps, strict=True))

    def __eq__(self, other) -> bool:
        if not isinstance(other, TokenLogprobs):
            return NotImplemented
        return (self.token_id, self.logprob, self._ids, self._lps) == (
            other.token_id,
            other.logprob,
            other._ids,
            other._lps,
        )

    def __repr__(self) -> str:
        return f"TokenLogprobs(token_id={self.token_id}, logprob={self.logprob}, top={self.top})"


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    logprobs: int | None = None  # None: none; k: the chosen token's logprob and the k most likely
    grammar: object | None = None  # kvgate.structured.compiler.Grammar: every token must keep it valid
    # vLLM's: only these may be drawn (`pack`, run by `validate`, makes them a bitmask)
    allowed_token_ids: list[int] | bytes | None = None
    # vLLM's `bad_words` as token sequences: a sequence's last token may not follow the rest of it
    bad_words: list[list[int]] | tuple[array, ...] | None = None

    def validate(self) -> SamplingParams:
        def finite(name, v):
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise SamplingError(name, v, f"a finite number, {_RANGES[name]}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty"):
            finite(name, getattr(self, name))
        finite("frequency_penalty", self.frequency_penalty)
        if not 0.0 <= self.temperature <= 2.0:
            raise SamplingError("temperature", self.temperature, _RANGES["temperature"])
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError("top_p", self.top_p, _RANGES["top_p"])
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise SamplingError("top_k", self.top_k, _RANGES["top_k"])
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingError("min_p", self.min_p, _RANGES["min_p"])
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise SamplingError("repetition_penalty", self.repetition_penalty, _RANGES["repetition_penalty"])
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise SamplingError(name, getattr(self, name), _RANGES[name])
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64
        ):
            raise SamplingError("seed", self.seed, _RANGES["seed"])
        lp = self.logprobs
        if lp is not None and (
            isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_TOP_LOGPROBS
        ):
            raise SamplingError("logprobs", lp, _RANGES["logprobs"])
        for t, b in (self.logit_bias or {}).items():
            if (
                isinstance(b, bool)
                or not isinstance(b, int | float)
                or not -LOGIT_BIAS_LIMIT <= b <= LOGIT_BIAS_LIMIT
            ):
                raise SamplingError("logit_bias", {t: b}, _RANGES["logit_bias"])
        self.pack()
        return self

    def pack(self) -> None:
        """What a row keeps of allowed_token_ids and bad_words, made small: the allowed ids as a bitmask
        (bit t of byte t // 8, little-endian: at most a bit per vocabulary entry, however many ids were
        sent) and each bad word as packed 32-bit ids (kvgate.memory.workspace's `penalty_state`)."""
        ids = self.allowed_token_ids
        if isinstance(ids, list):
            ok = all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in ids)
            if not ids or not ok:
                raise SamplingError("allowed_token_ids", ids[:3], "at least one token id, 0 <= id < 2**31")
            bits = bytearray(max(ids) // 8 + 1)
            for t in ids:
                bits[t >> 3] |= 1 << (t & 7)
            self.allowed_token_ids = bytes(bits)
        if self.bad_words and isinstance(self.bad_words, list):
            self.bad_words = tuple(array("i", w) for w in self.bad_words)

    def check_vocab(self, vocab_size: int) -> None:
        """logit_bias keys and allowed_token_ids must be token ids of this model."""
        for t in self.logit_bias or {}:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise SamplingError("logit_bias", t, f"token ids 0 <= id < {vocab_size}")
        if isinstance(self.allowed_token_ids, list) and not self.allowed_token_ids:
            raise SamplingError("allowed_token_ids", [], "at least one token id")
        for t in self.allowed_token_ids if isinstance(self.allowed_token_ids, list) else ():
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise SamplingError("allowed_token_ids", t, f"token ids 0 <= id < {vocab_size}")
