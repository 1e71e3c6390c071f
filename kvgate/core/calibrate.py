"""Time a prompt's prefill before the server takes requests, so `--max-ttft` works from the first one.

The TTFT budget forecasts from timed prefill steps. A server that has just started has timed none: its
400 ("this prompt alone is over the budget") stayed silent and its 429 counted prefill as 0 s, so the
first long prompt after a restart ran 13.6 s under `--max-ttft 1` (session 30's QA). `calibrate_prefill`
sends one synthetic prompt of two whole chunks through the engine's own path (admission, prefill,
DECODE_TICKS tokens) and waits for it. Its chunks run alone, so they give the 400's lower bound; at two
positions, they give the forecast's line a slope. Its decode ticks, at one row and then at up to
WIDE_ROWS (the same prompt, cached, as that many choices), give the walks of running rows their step and
the cost of a row: without them a fresh server priced a decode tick at a prompt chunk's 0.43 s, and its first burst
of 12 requests behind 2 rows was told to retry in 60 s, 129 s forecast for rows free in 3 (session 32).
Its requests are counted like any others (one, then up to WIDE_ROWS choices), and their blocks stay in the prefix
cache as evictable.
"""

from __future__ import annotations

import time

from kvgate.core.state import MIN_TIMED_PREFILL
from kvgate.request import GenerationRequest, Refusal
from kvgate.sampling_params import SamplingParams

DECODE_TICKS = 16  # tokens generated after the prompt: their ticks are the decode step's first measure
WIDE_ROWS = 8  # then that many rows at once (at most --max-seqs): what a row adds to a tick


def calibrate_prefill(engine, timeout: float = 120.0) -> str:
    """Run the calibration prompt; return a line for the start-up log saying what was measured."""
    cfg = engine.sched_cfg
    room = min(cfg.max_model_len, cfg.total_blocks * cfg.block_size) - DECODE_TICKS
    n = min(2 * cfg.prefill_chunk, room)
    if n < MIN_TIMED_PREFILL:
        return f"TTFT calibration skipped: room for {n} prompt tokens, fewer than {MIN_TIMED_PREFILL}"
    vocab = engine.tokenizer.vocab_size
    # spread over the vocabulary, never one repeated token (a real prompt's embedding reads vary)
    ids = [(7 + 7919 * i) % vocab for i in range(n)]
    t0 = time.monotonic()
    request = GenerationRequest(ids, SamplingParams(temperature=0.0), DECODE_TICKS, ignore_eos=True)
    engine.generate(request, timeout)
    wide = min(cfg.max_seqs, WIDE_ROWS)
    if wide > 1:  # the same prompt again (cached) as `wide` choices: ticks at that many rows
        sampled = GenerationRequest(
            ids, SamplingParams(temperature=1.0, seed=0), DECODE_TICKS, ignore_eos=True
        )
        try:
            for h in engine.submit_choices(sampled, wide):
                h.result(timeout)
        except (Refusal, TimeoutError) as r:  # too small a pool, too slow a host: learnt from live ticks
            why = f"{type(r).__name__}: {r}"[:200]
            return f"TTFT calibration: {n} prompt tokens timed; {wide} rows not ({why})"
    seconds = time.monotonic() - t0
    snap = engine.snapshot()
    best = snap.prefill_token_time_best
    fastest = f"{1 / best:,.0f} tokens/s at best" if best else "no whole chunk timed alone"
    rows = dict(zip(snap.recent_decode_rows, snap.recent_decode_periods))  # the last tick at each count
    tick = "; decode ticks " + ", ".join(f"{1e3 * t:.1f} ms at {r} rows" for r, t in sorted(rows.items()))
    return f"TTFT calibration: a {n}-token prompt prefilled and {DECODE_TICKS} tokens in {seconds:.2f}s ({fastest}{tick})"
