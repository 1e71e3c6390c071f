"""What a prompt token costs to prefill, as a function of where in the context it sits.

A prefill chunk's step time per token grows with its position: its matmuls cost the same at any
position, but its attention reads every earlier position. On SmolLM2 at 6,000 positions the attention
of a token costs more than its matmuls. One rate for every prompt token is therefore wrong both ways:
after a long prompt the rate measured deep in its context (325 tokens/s in session 30's QA) made the
forecast refuse short prompts on a near-idle server, and after short prompts a long one was forecast
too fast.

`PrefillFit` keeps an exponentially weighted least-squares line, seconds per token = base + slope x
position, over the prefill steps the worker times (x: the step's token-weighted mean position). Its
memory is a few steps, like the step-time EMA, so a changed load shows within a handful of chunks.
`prefill_seconds` integrates that line over a span of positions: what the TTFT forecast charges for
the prompt tokens ahead of a newcomer, and for its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAY = 0.8  # each older step weighs this much less (the step-time EMA's memory)
# positions must spread at least this much (their weighted standard deviation) before a slope is fitted:
# with every chunk at about one position, a slope is noise and the line is the mean rate
MIN_SPREAD = 64.0


@dataclass
class PrefillFit:
    w: float = 0.0  # weighted sums of 1, x, y, x^2, x*y
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, position: float, seconds_per_token: float) -> None:
        x, y, d = position, seconds_per_token, DECAY
        self.w, self.sx, self.sy = d * self.w + 1, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y

    def line(self) -> tuple[float, float] | None:
        """(base, slope) with both >= 0, or None before any step was timed."""
        if self.w == 0:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        vx = self.sxx / self.w - mx * mx
        if vx < MIN_SPREAD**2:
            return my, 0.0
        slope = (self.sxy / self.w - mx * my) / vx
        if slope <= 0:  # cost does not fall with position: the spread is noise
            return my, 0.0
        base = my - slope * mx
        if base < 0:  # a line through the origin, the least-squares fit with base held at 0
            return 0.0, self.sxy / self.sxx
        return base, slope


def prefill_seconds(line: tuple[float, float] | None, start: int, end: int) -> float:
    """Seconds to prefill positions [start, end) on the fitted line; 0 with none fitted yet."""
    if line is None or end <= start:
        return 0.0
    base, slope = line
    return base * (end - start) + slope * (end * end - start * start) / 2


def tokens_within(line: tuple[float, float], seconds: float) -> int:
    """The longest prompt the fitted line prefills in `seconds` (from position 0)."""
    base, slope = line
    if slope <= 0:
        return int(seconds / base) if base > 0 else 10**9
    return int((-base + math.sqrt(base * base + 2 * slope * seconds)) / slope)
