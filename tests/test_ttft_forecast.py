"""The TTFT forecast behind `--max-ttft`'s 429: the decode step it multiplies, the prefill cost by
position, and the Retry-After it gives. Session 30's QA found the forecast saying 7.9-13 s for a row
free in ~1.2 s (the step-time EMA, pulled up by prefill steps, times hundreds of decode steps), and
short prompts refused on a near-idle server after one long prompt had set the per-token rate."""

from __future__ import annotations

import dataclasses
import time

import pytest

from kvgate.core import forecast, ttft_refusals
from kvgate.core.prefill_rate import PrefillFit, prefill_seconds
from kvgate.core.snapshot import RowView, WaiterView
from kvgate.core.state import StepTimes
from kvgate.core.testing import set_step_hook
from tests.cluster_util import snapshot
from tests.test_admission import req


def cfg_for(make_engine, **kw):
    return make_engine(block_size=4, **kw).sched_cfg


def test_the_forecast_multiplies_remaining_steps_by_the_typical_decode_step(make_engine):
    """One busy row, 30 steps left, decode steps of 40 ms, and an EMA of ~0.4 s left by a burst of
    prompt chunks: the admission wait is 31 x 40 ms and a 2 s budget admits. Red with the EMA back as
    the step (12.5 s forecast, a 429)."""
    cfg = cfg_for(make_engine, max_seqs=1, max_ttft=2.0)
    snap = snapshot(
        rows=(RowView(1, 30, 4, 10, 0, 5, 35),),
        kv_blocks_total=64,
        kv_blocks_free=60,
        step_time_ema=0.4,
        recent_steps=(0.9,) * 20 + (0.04,) * 5,
        recent_decode_steps=(0.04,) * 5,
    )
    admit, prefill, ahead = forecast.predicted_ttft(cfg, snap, [], 8, 4)
    assert admit == pytest.approx(31 * 0.04) and (prefill, ahead) == (0.0, 8)
    assert ttft_refusals.ttft_refusal(cfg, (admit, prefill, ahead), timed=False) is None


def test_the_ttft_retry_after_rounds_the_excess_up_and_the_message_shows_hundredths(make_engine):
    """A forecast 1.3 s over the budget says retry in 2 s, not 1 (when the client would be refused
    again); a forecast of 1.04 s against a 1 s budget reads 1.04s, not "1.0s ... more than 1s". Red
    with `round` back (1) and with one decimal in the message."""
    cfg = cfg_for(make_engine, max_ttft=1.0)
    r = ttft_refusals.ttft_refusal(cfg, (2.0, 0.3, 40), timed=True)
    assert (r.status, r.retry_after) == (429, 2)
    assert "about 2.30s for its first token" in r.message and "about 0.30s at the measured" in r.message
    r = ttft_refusals.ttft_refusal(cfg, (1.04, 0.0, 4), timed=False)
    assert "about 1.04s" in r.message and r.retry_after == 1


def test_the_prefill_fit_recovers_a_line_and_falls_back_to_the_mean_without_spread():
    """Chunks at positions 256..5888 costing 1 ms + 1 us x position per token give that line back; all
    chunks at one position give their mean and no slope; cost falling with position (noise) gives the
    mean too. Red with the spread guard out (a slope of 0/0) or the negative-slope guard out."""
    fit = PrefillFit()
    for i in range(12):
        x = 256 + 512 * i
        fit.add(x, 1e-3 + 1e-6 * x)
    base, slope = fit.line()
    assert base == pytest.approx(1e-3) and slope == pytest.approx(1e-6)
    assert prefill_seconds((base, slope), 0, 64) == pytest.approx(64 * 1e-3 + 1e-6 * 64 * 64 / 2)
    flat = PrefillFit()
    for y in (1e-3, 3e-3):
        flat.add(100, y)
    assert flat.line() == pytest.approx(((0.8 * 1e-3 + 3e-3) / 1.8, 0))
    falling = PrefillFit()
    for x, y in ((0, 3e-3), (1000, 1e-3)):
        falling.add(x, y)
    assert falling.line()[1] == 0.0 and falling.line()[0] == pytest.approx((0.8 * 3e-3 + 1e-3) / 1.8)
    assert prefill_seconds(None, 0, 100) == 0.0


def test_after_a_long_prompt_a_short_one_is_forecast_at_the_cost_of_its_own_positions(make_engine):
    """A 6,000-token prompt timed chunk by chunk (per-token cost rising with position), then one short
    row decoding: a 64-token newcomer is forecast at the cost of positions 0-63, well inside a 0.5 s
    budget. One rate for every token (the last chunks' EMA, 8 ms a token) forecast 0.5 s: a 429 on a
    near-idle server. Red with `PrefillFit.line` returning the mean rate and no slope."""
    cfg = cfg_for(make_engine, max_seqs=4, max_ttft=0.5)
    times = StepTimes()
    for i in range(12):
        start = 512 * i
        x = start + 256
        times.observe(512 * (1e-4 + 1.3e-6 * x), 512, 512, alone=True, position=x)
    line = times.prefill.line()
    snap = snapshot(
        rows=(RowView(1, 20, 4, 10, 0, 5, 25),),
        kv_blocks_total=64,
        kv_blocks_free=60,
        step_time_ema=0.01,
        recent_decode_steps=(0.01,) * 8,
        prefill_line=line,
    )
    est = forecast.predicted_ttft(cfg, snap, [], 64, 16)
    assert est[1] == pytest.approx(64 * 1e-4 + 1.3e-6 * 64 * 64 / 2, rel=0.01)
    assert ttft_refusals.ttft_refusal(cfg, est, timed=True) is None
    # the same newcomer behind a waiter that has the whole 6,000-token prompt to prefill: refused
    est = forecast.predicted_ttft(cfg, snap, [WaiterView(6000, 10)], 64, 16)
    assert est[1] > 0.5 and ttft_refusals.ttft_refusal(cfg, est, timed=True).status == 429


def test_the_worker_times_each_prefill_chunk_at_its_position(make_engine):
    """A 448-token prompt prefilled in 64-token chunks whose steps get slower with position (the hook sleeps in
    proportion to the chunk's start): the fitted line has a slope, and the forecast for a chunk deep
    in a prompt costs more than one at its start. Red with the update passing no position (every
    chunk at 0: no spread, no slope)."""
    e = make_engine(block_size=4, prefill_chunk=64)
    set_step_hook(e, lambda so: time.sleep(sum(p.start for p in so.prefills) * 5e-4))
    e.generate(req(448, 1), timeout=60)
    set_step_hook(e, None)
    base, slope = e.snapshot().prefill_line
    assert slope > 0
    assert prefill_seconds((base, slope), 384, 448) > 2 * prefill_seconds((base, slope), 0, 64)


def test_the_400_advises_a_prompt_length_that_fits_on_the_fitted_line(make_engine):
    """The 400 stands on the fastest rate (a lower bound: 1 ms a token, 1,000 tokens in a 1 s budget),
    but its advice takes the fitted line, which grows with position (732 tokens), less 5% (695).
    Session 30's QA cut a prompt to the lower bound's length and it still took ~25% over the budget;
    session 31's, to the line's, 1-3% over. Red with the line left out of the advice (950), and with
    no margin (732)."""
    cfg = cfg_for(make_engine, max_ttft=1.0)
    r = ttft_refusals.ttft_never_refusal(cfg, 3000, 1e-3, (1e-3, 1e-6))
    assert r.status == 400 and "Shorten the prompt to about 695 tokens" in r.message
    assert ttft_refusals.tokens_within((1e-3, 0.0), 1.0) == 1000


def test_a_cluster_snapshot_averages_the_replicas_prefill_lines():
    """Red with the prefill line joined like the other tuples (a 4-tuple the forecast cannot read)."""
    from kvgate.cluster.views import aggregate

    lines = [(1e-3, 2e-6), None, (3e-3, 4e-6)]
    total = aggregate([snapshot(prefill_line=x, kv_blocks_total=8) for x in lines])
    assert total.prefill_line == pytest.approx((2e-3, 3e-6))


def test_a_calibrated_engine_refuses_an_over_budget_prompt_from_the_first_request(make_engine):
    """Right after start nothing was timed, so a prompt whose prefill alone is far over --max-ttft was
    admitted (session 30's QA: 13.6 s under a 1 s budget). `calibrate_prefill`, which `kvgate serve` and
    each cluster replica run when --max-ttft is set, times two whole prompt-only chunks: the first real
    request gets the 400. Red with the calibration's prompt cut to one token (nothing timed: admitted)."""
    from kvgate.core.calibrate import calibrate_prefill
    from kvgate.request import Refusal

    e = make_engine(block_size=4, prefill_chunk=64, max_ttft=0.2)
    assert e.snapshot().prefill_line is None
    # ~1.6 ms a prompt token; a decode tick 2 ms a row
    set_step_hook(e, lambda so: time.sleep(0.1 if so.prefills else 0.002 * len(so.decodes)))
    note = calibrate_prefill(e)
    assert "a 128-token prompt prefilled and 16 tokens in" in note and "tokens/s at best" in note
    snap = e.snapshot()
    assert snap.prefill_line is not None and snap.prefill_token_time_best >= 0.1 / 64
    # its decode ticks are the walks' step, not its 0.1 s prompt chunks (session 32: a fresh server's
    # first burst was told to retry in 60 s for rows free in 3). Red with max_tokens 1 back.
    assert "decode ticks" in note and forecast.typical_step(snap) < 0.05
    # and then at 8 rows (the same prompt as 8 choices): what a row adds to a tick. Red with the wide
    # part out (no slope: a burst's 2-row ticks were forecast at the 1-row price, QA pass 5's F1)
    assert "at 1 rows" in note and "at 8 rows" in note, note
    assert 0.001 < snap.decode_row_seconds < 0.004, snap.decode_row_seconds
    with pytest.raises(Refusal) as ei:
        e.submit(req(400, 1, salt=3))
    assert (ei.value.status, ei.value.code) == (400, "ttft_budget_exceeded")
    set_step_hook(e, None)


def test_the_typical_step_is_the_decode_tick_period_not_the_forward_alone(make_engine):
    """A decode tick is the forward plus the worker's scheduling, update and publishing: on a live
    SmolLM2 server the forwards alone made a 1.5 s forecast that became a 1.94 s wait. The worker
    times decode-only ticks start to start, the forecast prefers those, and each is at least its
    forward. Red with the period not observed (empty: the forwards again)."""
    e = make_engine(block_size=4)
    e.generate(req(8, 24), timeout=20)
    snap = e.snapshot()
    periods, forwards = sorted(snap.recent_decode_periods), sorted(snap.recent_decode_steps)
    assert len(periods) >= 16 and periods[len(periods) // 2] >= forwards[len(forwards) // 2]
    cap = forecast.OUTLIER * periods[len(periods) // 2]
    assert forecast.typical_step(snap) == pytest.approx(sum(min(t, cap) for t in periods) / len(periods))
    # an idle gap is never a period: the next request's first decode step is not timed from the last
    time.sleep(0.3)
    e.generate(req(8, 4, salt=1), timeout=20)
    assert max(e.snapshot().recent_decode_periods) < 0.3


def test_the_decode_walk_grows_each_step_with_the_rows_contexts_and_drops_ended_rows():
    """Two rows (3 steps left at 100 positions, 5 at 200), 50 ms a step now, 0.1 ms a position:
    ticks 0-2 read 300, 302, 304 positions (150.6 ms); ticks 3-4 only the second row's 203-204, 96.5
    fewer than now (2 x 40.35 ms). With no position cost the walk is steps x step. On a live SmolLM2
    server a fixed step forecast 2.49 s where 3.29 s passed, two rows 500-1,100 positions deep. Red
    with the growth term taken out (250 ms), or the ended row kept."""
    rows = (RowView(1, 3, 4, 90, 0, 10, 13), RowView(2, 5, 4, 150, 0, 50, 55))
    snap = snapshot(rows=rows, decode_position_seconds=1e-4)
    assert forecast.decode_seconds(snap, 0.05, 3) == pytest.approx(0.1506)
    assert forecast.decode_seconds(snap, 0.05, 5) == pytest.approx(0.2313)
    flat = snapshot(rows=rows)
    assert forecast.decode_seconds(flat, 0.05, 5) == pytest.approx(0.25)
    assert (
        forecast.retry_after(
            snapshot(
                rows=(RowView(1, 400, 4, 500, 0, 100, 500),),
                recent_decode_periods=(0.006,),
                decode_position_seconds=2e-6,
            )
        )
        == 3
    )  # 2.4 s + 0.16 s of growth


def test_the_engine_carries_the_attention_probes_cost_per_position_into_its_snapshots(make_engine):
    """Red with `position_seconds` returning 0 (the forecasts' steps would never grow)."""
    from kvgate.models.paged_attention import kernel

    if kernel() is None:
        pytest.skip("no paged attention kernel here: nothing was probed, the cost per position is 0")
    e = make_engine(block_size=4)
    c = e.sched_cfg.decode_position_seconds
    assert 0 < c < 1e-3 and e.snapshot().decode_position_seconds == c


def test_the_typical_step_is_the_clipped_mean_of_the_recent_ticks():
    """30 ticks of 10 ms, one of 20 ms (a hiccup: counted whole) and one of 1 s (a stall: counted as
    3 x the median): 10.94 ms. A walk adds ticks up, so the median (10 ms) left the hiccups out (QA
    pass 4: 5 of 12 admitted requests late under a mixed load), and the plain mean (41 ms) would let
    one stall stretch a walk of hundreds of ticks. Red with the median, and with no clipping."""
    snap = snapshot(recent_decode_periods=(0.01,) * 30 + (0.02, 1.0))
    assert forecast.typical_step(snap) == pytest.approx((30 * 0.01 + 0.02 + 0.03) / 32)


def test_before_any_decode_tick_the_step_is_the_shortest_step_timed_not_the_prompt_chunks_mean():
    """A server that has prefilled only prompt chunks (0.4 s each, and one 0.05 s chunk) has no decode
    tick to walk rows by: the shortest step (0.05 s) is the step, since every chunk does at least a
    decode tick's work. Red with the chunks' clipped mean back (0.36 s: 129 s forecast where rows were
    free in 3 s, session 32's retry-herd bench)."""
    snap = snapshot(recent_steps=(0.4,) * 9 + (0.05,), step_time_ema=0.3)
    assert forecast.typical_step(snap) == 0.05
    assert forecast.typical_step(snapshot(step_time_ema=0.3)) == 0.3


def test_waiters_ahead_take_the_freed_rows_and_then_end_themselves(make_engine):
    """Two rows (10 and 30 steps left) and two waiters ahead (prompts of one chunk, 20 and 50 tokens to
    generate) on a 2-row server: the waiters take the rows at ticks 10 and 30, and the newcomer the row
    the first of them frees, at tick 10 + 1 + 1 + 20 = 32. Red with the walk stopping at the running
    rows (no room in sight: an infinite forecast and a Retry-After of 60 s, the bench's first finding)."""
    cfg = cfg_for(make_engine, max_seqs=2, max_ttft=1.0)
    rows = (RowView(1, 10, 4, 8, 0, 5, 15), RowView(2, 30, 4, 8, 0, 5, 35))
    waiters = (WaiterView(8, 4, 3, 20), WaiterView(8, 4, 4, 50))
    snap = snapshot(
        rows=rows, waiters=waiters, kv_blocks_total=64, kv_blocks_free=56, recent_decode_periods=(0.01,) * 8
    )
    assert forecast.admission_tick(cfg, snap, list(waiters), 4, 1) == 32
    admit, _, _ = forecast.predicted_ttft(cfg, snap, [], 8, 4)
    # 30 ticks walked with the running rows, then 3 plain steps of simulated waiters
    assert admit == pytest.approx(0.33)
    assert ttft_refusals.ttft_refusal(cfg, (admit, 0.0, 8), timed=False) is None
    # blocks bind too: the whole pool (64) only after both waiters end (tick 82); more never fits
    assert forecast.admission_tick(cfg, snap, list(waiters), 64, 1) == 82
    assert forecast.admission_tick(cfg, snap, list(waiters), 65, 1) is None


def test_rows_and_waiters_that_may_stop_are_walked_to_their_likely_ends_as_retry_after_prices_them(
    make_engine,
):
    """Session 41: the TTFT walk took every row to its max_tokens, so behind a full batch of rows with
    max_tokens unset (openai-node's, the AI SDK's and LangChain's default: the rest of the context)
    every request was refused a --max-ttft of seconds, its Retry-After 60, while Retry-After's own walk
    (session 40) priced the same rows at a typical answer. Both now walk the likely ends. Two rows, 8,100
    steps to their ceilings, 9 in 10 answers here of 40 tokens: one may stop (20 written, 20 to go),
    one is forced (ignore_eos); a waiter ahead that may stop takes the first row at tick 20 and ends at
    20 + 1 + 1 + 40 = 62, when the newcomer gets its row. Red with `predicted_ttft` walking `steps_left`
    (~81 s, a 429 with Retry-After 60) and with the waiter walked to its max_tokens (tick 8,100)."""
    cfg = cfg_for(make_engine, max_seqs=2, max_ttft=2.0)
    unset = dict(may_stop=True, explicit=False)
    rows = (
        RowView(1, 8100, 4, 50, 0, 20, 8120, **unset),
        RowView(2, 8100, 4, 60, 0, 20, 8120, explicit=False),
    )
    waiter = WaiterView(8, 4, 3, 8150, **unset)
    snap = snapshot(
        rows=rows,
        waiters=(waiter,),
        kv_blocks_total=4096,
        kv_blocks_free=4000,
        recent_decode_periods=(0.01,) * 8,
        stop_lengths=(30, 35, 40, 38, 33, 36, 31, 39, 34, 40),
    )
    assert forecast.admission_tick(cfg, forecast.likely_rows(snap), [waiter], 4, 1) == 62
    admit, _, _ = forecast.predicted_ttft(cfg, snap, [], 8, 16)
    assert admit == pytest.approx(0.63)
    assert ttft_refusals.ttft_refusal(cfg, (admit, 0.0, 8), timed=False) is None
    # with the first row forced as well, the same request is refused: both rows run to their ceilings
    forced = tuple(dataclasses.replace(r, may_stop=False) for r in rows)
    late = forecast.predicted_ttft(cfg, dataclasses.replace(snap, rows=forced), [], 8, 16)
    refusal = ttft_refusals.ttft_refusal(cfg, late, timed=False)
    assert late[0] > 60 and refusal is not None and refusal.retry_after == 60
    # Retry-After and the TTFT walk agree on when the first row frees: 20 steps of 10 ms
    assert forecast.retry_after(snap) == 1


def test_a_herd_refused_together_is_told_to_come_back_spread_out(make_engine):
    """One row busy for ~4 s, --max-ttft 0.5: four requests of 100 tokens arrive together and are all
    refused. Each one's wait counts those refused before it as waiters ahead, so the k-th is told to
    come back about k x 100 steps later than the first, and says so. Red with the gate raising the
    plain refusal (all four told the same ~4 s: session 32's retry-herd bench admitted 16 of 88 first
    retries that way)."""
    from kvgate.request import Refusal
    from tests.test_admission import hog, wait_until

    e = make_engine(block_size=4, max_seqs=1, max_ttft=0.5)
    e.generate(req(40, 2), timeout=20)  # times a prefill
    h = hog(e, 8, 400, step_sleep=0.01)
    assert wait_until(lambda: forecast.typical_step(e.snapshot()) >= 0.005)
    refusals, times = [], []
    for k in range(4):
        with pytest.raises(Refusal) as ei:
            e.submit(req(8, 100, salt=10 + k))
        refusals.append(ei.value)
        times.append(time.monotonic())
    # each is due back when retry-after-ms says (the openai SDK's wait), not at the whole second after
    # it: counted past that, a client back on time was ahead of itself (red with retry_after as due)
    dues = [due for due, _ in e.gate._promised]
    assert all(abs(d - (t + r.retry_after_ms / 1000)) < 0.1 for d, t, r in zip(dues, times, refusals)), dues
    assert all((r.status, r.code) == (429, "ttft_budget_exceeded") for r in refusals)
    waits = [r.retry_after_ms for r in refusals]
    step = forecast.typical_step(e.snapshot())
    assert all(b - a >= 0.8 * 100 * step * 1000 for a, b in zip(waits, waits[1:])), waits
    assert "told to come back" not in refusals[0].message
    assert "1 request refused before this one was told" in refusals[1].message
    assert "3 requests refused before this one were told" in refusals[3].message
    assert [r.retry_after for r in refusals] == [min(60, -(-w // 1000)) for w in waits]
    h.cancel()
    set_step_hook(e, None)


def test_a_refusal_with_a_wait_in_milliseconds_sends_the_header_the_openai_sdk_reads_first():
    """`retry-after-ms` beside Retry-After (the openai SDKs prefer it), and in the body. Red with the
    header line out of APIError.response."""
    from kvgate.request import Refusal
    from kvgate.server.errors import from_refusal

    r = Refusal("ttft_budget_exceeded", "later", 429, retry_after=2, retry_after_ms=1450)
    resp = from_refusal(r).response()
    assert (resp.headers["retry-after"], resp.headers["retry-after-ms"]) == ("2", "1450")
    assert b'"retry_after_ms":1450' in resp.body
    assert "retry-after-ms" not in from_refusal(Refusal("x", "y", 503, retry_after=5)).response().headers


def test_a_walk_prices_each_stretch_of_ticks_at_its_row_count():
    """Ticks measured at 1 row (4 ms), a row costing 2 ms more: two rows with 10 and 30 steps left
    walk 10 ticks at 6 ms, then 20 at 4 ms. Red with the row cost left out of decode_seconds (0.12 s)."""
    from kvgate.core.state import row_slope

    assert row_slope({1: 0.004, 8: 0.018}) == pytest.approx(0.002)
    assert row_slope({4: 0.01}) == 0.0 and row_slope({1: 0.01, 4: 0.008}) == 0.0  # noise: no negative cost
    rows = (RowView(1, 10, 4, 8, 0, 5, 15), RowView(2, 30, 4, 8, 0, 5, 35))
    snap = snapshot(
        rows=rows, recent_decode_periods=(0.004,) * 8, recent_decode_rows=(1,) * 8, decode_row_seconds=0.002
    )
    assert forecast.decode_seconds(snap, 0.004, 30) == pytest.approx(10 * 0.006 + 20 * 0.004)
    assert forecast.step_at(snap, 0.004, 8) == pytest.approx(0.018)


def test_the_cost_of_a_row_takes_the_median_of_each_counts_ticks():
    """A 0.33 s warm-up tick among eight 8-row ticks of 18 ms: the cost of a row stays ~2 ms (a
    smoothed mean from that first tick made it 11 ms: a 100-tick walk 5 s long, the session's review).
    Red with the mean of each count's ticks."""
    st = StepTimes()
    for t in (0.004,) * 9:
        st.observe_period(t, 1)
    for t in (0.33,) + (0.018,) * 8:
        st.observe_period(t, 8)
    from kvgate.core.state import row_slope

    assert row_slope(st.by_rows) == pytest.approx(0.002)


def test_a_waiter_with_n_choices_takes_n_rows_in_the_walk(make_engine):
    """Four rows, two of them free; a waiter ahead asking for 3 choices is admitted only when a third
    row frees (tick 10), and holds three rows until it ends: the newcomer waits for it (tick 10 + 1 +
    1 + 20 = 32). Red with a waiter counted as one row (the newcomer admitted at once)."""
    cfg = cfg_for(make_engine, max_seqs=4, max_ttft=1.0)
    rows = (RowView(1, 10, 4, 8, 0, 5, 15), RowView(2, 40, 4, 8, 0, 5, 45))
    waiters = [WaiterView(8, 6, 3, 20, 3)]
    snap = snapshot(rows=rows, kv_blocks_total=64, kv_blocks_free=56, recent_decode_periods=(0.01,) * 8)
    assert forecast.admission_tick(cfg, snap, waiters, 4, 1) == 32


def test_a_few_slow_warm_up_ticks_do_not_set_a_minute_long_retry_after():
    """QA pass 7's F1: a fresh server on a busy machine told 429'd clients to come back in 40-60 s
    where rows freed in 2.4-4.6 s, an estimated step of 0.2-0.3 s against ticks of 0.02: the cost of a
    row, moved to the running rows, is what can blow up from a few samples. Two guards, each seen red
    on its own:
    - a row count enters the cost of a row with 3 ticks (one 0.33 s warm-up tick at 4 rows made it
      0.1 s; red with MIN_ROW_TICKS 1);
    - the cost of a row is at most the measured step's share per row (red without `row_cost`'s bound:
      a 4-row tick forecast at 0.31 s, and this Retry-After 60 s instead of 10).
    (A third, Retry-After's step bounded by twice the recent ticks' lower quartile, was dropped in
    review: with ticks of several row counts it could say 6x too short, and the openai SDK retries
    only twice before a hard RateLimitError.)"""
    from collections import deque

    from kvgate.core.state import row_slope

    assert row_slope({1: deque([0.013] * 9), 4: deque([0.33])}) == 0.0
    assert row_slope({1: deque([0.013] * 9), 4: deque([0.33, 0.02, 0.02])}) == pytest.approx(0.007 / 3)
    warm = snapshot(recent_decode_periods=(0.013,) * 8, recent_decode_rows=(1,) * 8, decode_row_seconds=0.1)
    assert forecast.step_at(warm, 0.013, 4) == pytest.approx(4 * 0.013)
    rows = tuple(RowView(i, 200, 4, 100, 0, 10, 210) for i in range(4))
    busy = snapshot(
        rows=rows, recent_decode_periods=(0.013,) * 8, recent_decode_rows=(1,) * 8, decode_row_seconds=0.1
    )
    assert forecast.retry_after(busy) == 10  # 200 ticks at 4 rows, each at most 4 x 13 ms


def test_a_cost_per_position_past_the_whole_step_is_held_to_the_step():
    """QA pass 9's MEDIUM: the attention probe, timed on a busy host, read 700x the kernel's cost per
    position, and a request was told to wait 156 s (Retry-After 60) for a row that ended in 8 s. The
    positions a step reads now cost at most the step itself. Seen red without the bound (60 s)."""
    row = RowView(1, 400, 4, 500, 0, 100, 600)
    sane = snapshot(rows=(row,), recent_decode_periods=(0.012,), decode_position_seconds=2e-6)
    wild = snapshot(rows=(row,), recent_decode_periods=(0.012,), decode_position_seconds=1.4e-3)
    assert forecast.retry_after(sane) == 5  # 400 ticks of 12 ms, growing by ~0.4 ms
    assert forecast.retry_after(wild) <= 2 * forecast.retry_after(sane)
