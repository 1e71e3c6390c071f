"""The TTFT budget's refusals (`--max-ttft`): the 400 for a prompt whose own prefill is over the budget
on an idle server, and the 429 with Retry-After for one forecast over it now. Pure functions of the
`SchedulerConfig` and a forecast (`kvgate.core.forecast`); the admission gate calls them at arrival."""

from __future__ import annotations

import math

from kvgate.config import SchedulerConfig
from kvgate.core.prefill_rate import tokens_within
from kvgate.request import Refusal

ADVICE_MARGIN = 0.95


def ttft_never_refusal(
    cfg: SchedulerConfig, own_tokens: int, per_token: float | None, line: tuple[float, float] | None = None
) -> Refusal | None:
    """The 400 for a prompt whose own prefill, on an idle server, is forecast over `--max-ttft` at the
    fastest rate measured (`per_token`, a lower bound): no retry of the same request can pass, so no
    Retry-After. The prompt length it advises comes from the fitted line where there is one (a prompt
    cut to the lower bound's length still ran about 25% over the budget, session 30's QA)."""
    if cfg.max_ttft is None or per_token is None or own_tokens * per_token <= cfg.max_ttft:
        return None
    most = int(cfg.max_ttft / per_token)
    if line is not None:
        most = min(most, tokens_within(line, cfg.max_ttft))
    # 5% under: a prompt of exactly the fitted length ran 1.01-1.03 s under a 1 s budget (session 31's QA)
    most = int(most * ADVICE_MARGIN)
    return Refusal(
        "ttft_budget_exceeded",
        f"this request's {own_tokens} prompt tokens to prefill would take at least "
        f"{own_tokens * per_token:.1f}s at the fastest rate this server has measured ({1 / per_token:.0f} "
        f"tokens/s), even on an idle server, more than this server's --max-ttft {cfg.max_ttft:g}s. "
        f"Shorten the prompt to about {most} tokens (not counting a prefix the server has cached), or "
        "send it to a server with a larger --max-ttft.",
        400,
        param="prompt",
    )


# of the budget, added to a TTFT 429's wait: a retry due exactly at the budget is a coin toss
RETRY_MARGIN = 0.1
MIN_RETRY_MS = 100


def ttft_refusal(
    cfg: SchedulerConfig,
    estimate: tuple[float, float, int],
    timed: bool,
    later: tuple[float, float, int] | None = None,
    told: int = 0,
) -> Refusal | None:
    """The 429 for a forecast over `--max-ttft`, or None when it is within the budget. `timed`: a
    prefill was timed (else the prefill counted 0 s). `later`: the forecast with the `told` requests
    refused before this one, and told to come back sooner, counted ahead of it (the gate's promises):
    the wait it is given comes from that one, so a herd refused together does not come back together
    (session 31's QA: 4 of 35 first retries admitted). The wait is the excess over the budget plus
    RETRY_MARGIN of the budget: Retry-After in whole seconds rounded up (to the nearest, a forecast
    0.4 s over said "retry in 0 s"), retry-after-ms to the millisecond."""
    admit, prefill, ahead = estimate
    if cfg.max_ttft is None or admit + prefill <= cfg.max_ttft:
        return None
    back_admit, back_prefill, _ = later or estimate
    wait_s = min(back_admit + back_prefill, 3600) - cfg.max_ttft + RETRY_MARGIN * cfg.max_ttft
    wait = "no room is in sight" if admit == float("inf") else f"{admit:.2f}s until rows and KV free up"
    rate = f"about {prefill:.2f}s at the measured prefill rate" if timed else "not timed yet, counted as 0s"
    them = (
        "1 request refused before this one was"
        if told == 1
        else f"{told} requests refused before this one were"
    )
    herd = (
        f" {them} told to come back sooner; its wait counts them ahead of it ({wait_s:.2f}s)." if told else ""
    )
    return Refusal(
        "ttft_budget_exceeded",
        f"this request would wait about {admit + prefill:.2f}s for its first token ({wait}, then {ahead} "
        f"prompt tokens to prefill, {rate}), more than this server's --max-ttft "
        f"{cfg.max_ttft:g}s.{herd} Retry after the Retry-After interval.",
        429,
        retry_after=int(min(60, max(1, math.ceil(wait_s)))),
        retry_after_ms=int(min(60_000, max(MIN_RETRY_MS, math.ceil(wait_s * 1000)))),
    )
