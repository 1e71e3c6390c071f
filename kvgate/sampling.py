"""Per-request sampling: validated parameters and a sampler that owns its random generator.

A request's tokens depend only on its own logits and its own `torch.Generator`, never on which other
requests share the step: that is half of "batching does not change output" (the model's row-wise
math is the other half).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

GREEDY_BELOW = 1e-5


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
    "seed": "an integer 0 <= seed < 2**63",
}


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
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63
        ):
            raise SamplingError("seed", self.seed, _RANGES["seed"])
        return self


class Sampler:
    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int):
        self.p = params
        # Below 1e-5 a temperature only overflows logits / T to inf (NaN after softmax); it means greedy.
        self.greedy = params.temperature < GREEDY_BELOW
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.penalized = (
            params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        )
        self._prompt_ids = list(prompt_ids) if self.penalized else []
        self.seen: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None

    def _init_penalty_state(self, n: int) -> None:
        # Sized by the logits, not the tokenizer: a model may have more rows than tokens (padding).
        self.seen = torch.zeros(n, dtype=torch.bool)
        ids = [t for t in self._prompt_ids if 0 <= t < n]
        if ids:
            self.seen[torch.tensor(ids)] = True
        self.counts = torch.zeros(n, dtype=torch.float32)

    def sample(self, logits: torch.Tensor) -> int:
        """`logits`: float32 `[vocab]` (may be a view into the batch's logits; it is not modified)."""
        p = self.p
        if self.penalized:
            if self.seen is None:
                self._init_penalty_state(logits.shape[-1])
            logits = logits.clone()
            if p.repetition_penalty != 1.0:
                sel = logits[self.seen]
                logits[self.seen] = torch.where(sel > 0, sel / p.repetition_penalty, sel * p.repetition_penalty)
            if p.frequency_penalty or p.presence_penalty:
                logits -= self.counts * p.frequency_penalty + (self.counts > 0).float() * p.presence_penalty
        if self.greedy:
            token = int(torch.argmax(logits))
        else:
            token = self._draw(logits / p.temperature)
        if self.penalized:
            self.seen[token] = True
            self.counts[token] += 1
        return token

    def _draw(self, logits: torch.Tensor) -> int:
        p = self.p
        if p.top_k > 0 and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, -math.inf)
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_p, dim=-1)
            drop = (cum - sorted_p) >= p.top_p  # keep the smallest prefix reaching top_p (>= 1 token)
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p.masked_fill(drop, 0.0))
        if p.min_p > 0.0:  # relative to the most likely token, after top-p (multinomial renormalizes)
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
            return int(torch.argmax(torch.nan_to_num(logits, nan=-math.inf)))  # degenerate row: fall back
        return int(torch.multinomial(probs, 1, generator=self.gen))
