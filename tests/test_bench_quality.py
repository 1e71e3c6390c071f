"""bench.quality's arithmetic (the servers it starts are exercised by running it; see DESIGN_NOTES)."""

from __future__ import annotations

import math

import pytest

from bench.quality import summarize, table


def _run(lps, tops, windows=1, seconds=1.0):
    return {
        "flags": ["--weights", "x"],
        "windows": [[0]] * windows,
        "logprobs": lps,
        "tops": tops,
        "seconds": seconds,
    }


def test_summary_against_the_reference():
    """Perplexity from the mean logprob, differences position by position, top-1 agreement; seen red
    with the perplexity taken over the reference's logprobs and with the agreement counted on logprobs."""
    ref = _run([-1.0, -2.0, -3.0, -0.5], ["a", "b", "c", "d"])
    got = _run([-1.5, -2.0, -2.0, -0.5], ["a", "x", "c", "d"], windows=2, seconds=2.0)
    s = summarize("v", got, ref)
    assert s["ppl"] == pytest.approx(math.exp(6.0 / 4))
    assert s["mean_abs_dlogprob"] == pytest.approx(1.5 / 4) and s["max_abs_dlogprob"] == pytest.approx(1.0)
    assert s["same_top1"] == pytest.approx(0.75) and s["scored_tok_s"] == pytest.approx(3.0)
    assert "| v | `--weights x` | 4 | 4.482 | 0.375 | 1 | 75.0% | 3 |" in table([s])


def test_a_run_of_other_positions_is_refused():
    with pytest.raises(ValueError):
        summarize("v", _run([-1.0], ["a"]), _run([-1.0, -2.0], ["a", "b"]))
