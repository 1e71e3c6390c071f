"""`--max-queue` bounds the requests that wait, not those that start at once; the TTFT budget works before
any long prompt was timed and answers 400 when the prompt alone is over it; refusal texts name what
really blocked a request.

Found by a black-box QA run (session 29): `--max-queue 0` refused every request on an idle server, a
burst larger than `--max-queue` was refused while batch rows and KV were free, `n` above `--max-queue`
could never pass, and `--max-ttft` did nothing until a prompt chunk of 32+ tokens had been timed.
Each test below was seen red with the fix it names taken out.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from kvgate.core import admission, forecast
from kvgate.core.prefill_rate import prefill_seconds
from kvgate.core.testing import set_step_hook
from kvgate.request import Admitted, Refusal, Refused
from tests.server_util import wait_until
from tests.test_admission import BPT, hog, req


def first_event(h, timeout: float = 10):
    return h.events.get(timeout)


def test_max_queue_zero_admits_what_fits_and_refuses_what_would_wait(make_engine):
    """`--max-queue 0` means no waiting line: an idle server serves, and a request that cannot start at
    once gets 503 queue_full from the worker (pre-header: its first event). Red with the gate's free-row
    room taken out (every request refused) and with the worker's trim taken out (the second request
    waited)."""
    e = make_engine(kv_cache_bytes=32 * 4 * BPT, block_size=4, max_queue=0, max_seqs=4)
    assert e.generate(req(4, 4), timeout=20).finish_reason == "length"
    h0 = hog(e, 4, 124)  # the whole pool; 3 rows stay free
    ev = first_event(e.submit(req(4, 8, salt=1)))
    assert isinstance(ev, Refused), ev
    r = ev.refusal
    assert (r.code, r.status) == ("queue_full", 503) and 1 <= r.retry_after <= 60
    assert "could not start at once" in r.message and "no waiting line (--max-queue 0)" in r.message
    assert e.snapshot().counters.queue_rejected == 1 and e.inbox.queued == 0
    h0.cancel()


def test_a_burst_over_max_queue_is_taken_by_free_rows(make_engine):
    """An idle server with 8 rows and a queue of 2 takes a burst of 6 (every one starts at once). Red with
    the gate back at `queued + n > max_queue` (the third was refused with 503)."""
    e = make_engine(block_size=4, max_queue=2, max_seqs=8)
    set_step_hook(e, lambda so: time.sleep(0.01))  # the burst lands before they finish
    handles = [e.submit(req(6, 6, salt=i)) for i in range(6)]
    for h in handles:
        assert h.result(20).finish_reason == "length"
    assert e.snapshot().counters.queue_rejected == 0


def test_n_choices_above_max_queue_start_on_an_idle_server(make_engine):
    """n=5 with `--max-queue 4` and 8 rows: all five start together. Red with the gate back at
    `queued + n > max_queue` (a 503 no retry could clear)."""
    e = make_engine(block_size=4, max_queue=4, max_seqs=8)
    hs = e.submit_choices(req(6, 4, seed=3), 5)
    assert all(h.result(20).finish_reason == "length" for h in hs)


def test_ttft_budget_forecasts_the_wait_before_any_prompt_was_timed(make_engine):
    """Only short prompts so far (no prefill per-token time): the admission wait alone is still forecast,
    so a request behind a long row is refused at arrival. Red with the forecast returning None without
    the prefill time (the request was queued)."""
    e = make_engine(kv_cache_bytes=32 * 4 * BPT, block_size=4, max_seqs=1, max_ttft=0.5, max_queue_wait=30)
    e.generate(req(4, 4), timeout=20)
    h0 = hog(e, 4, 120)  # one row busy for ~120 slow steps
    assert wait_until(lambda: forecast.typical_step(e.snapshot()) > 0.015)  # it has seen the slow steps
    assert e.snapshot().prefill_line is None and e.snapshot().step_time_ema is not None
    with pytest.raises(Refusal) as ei:
        e.submit(req(4, 4, salt=1))
    r = ei.value
    assert (r.status, r.code) == (429, "ttft_budget_exceeded")
    assert "not timed yet, counted as 0s" in r.message and r.retry_after >= 1
    h0.cancel()


def test_a_prompt_whose_own_prefill_is_over_the_ttft_budget_gets_a_400(make_engine):
    """On an idle server, a prompt that alone would take longer than --max-ttft to prefill (at the fastest
    rate measured) can never pass: 400, no Retry-After, the prompt length to aim for. A short prompt still
    passes. Red with the never-fits check taken out (429 with Retry-After 1)."""
    e = make_engine(block_size=4, max_ttft=0.3, prefill_chunk=64)
    set_step_hook(e, lambda so: time.sleep(0.2))  # ~3 ms a prompt token in a 64 chunk
    e.generate(req(64, 1), timeout=20)
    best = e.snapshot().prefill_token_time_best
    assert best is not None and best * 64 >= 0.2
    long = int(0.3 / best) + 32
    with pytest.raises(Refusal) as ei:
        e.submit(req(long, 1, salt=1))
    r = ei.value
    assert (r.status, r.code, r.retry_after) == (400, "ttft_budget_exceeded", None)
    assert f"this request's {long} prompt tokens" in r.message and "Shorten the prompt to about" in r.message
    assert e.generate(req(32, 1, salt=2), timeout=20).finish_reason == "length"
    set_step_hook(e, None)


def test_refusal_texts_name_what_blocked(make_engine):
    """A waiter that would fit alone but stood behind the FIFO head says so; busy rows are not told to
    lower max_tokens (it would not help); a prompt that alone fills
    the context says to shorten it, never "max_tokens at most 0"; so does a prompt too big for the pool.
    Red with each branch taken out (the old texts came back)."""
    e = make_engine(kv_cache_bytes=32 * 4 * BPT, block_size=4, max_model_len=64)
    cfg = e.sched_cfg
    h = e.submit(req(4, 4))
    assert isinstance(first_event(h), Admitted)
    entry = admission.plan_entry(cfg, h)
    behind = admission.kv_timeout_refusal(cfg, entry, 20, 0, 5, ahead=2)
    assert "waited behind 2 earlier requests" in behind.message and "it needs" not in behind.message
    one = admission.kv_timeout_refusal(cfg, entry, 20, 0, 5, ahead=1)
    assert "waited behind 1 earlier request," in one.message
    alone = admission.kv_timeout_refusal(cfg, entry, 0, 0, 5)
    assert "it needs 2 blocks of KV" in alone.message and "lower max_tokens" in alone.message
    rows = admission.kv_timeout_refusal(cfg, entry, 20, cfg.max_seqs, 5)
    assert "batch rows (--max-seqs) stayed busy" in rows.message and "max_tokens" not in rows.message
    # rows, not memory: its own code, so the rejection counts tell the two apart
    assert (rows.code, alone.code, behind.code) == (
        "batch_rows_unavailable",
        "kv_memory_unavailable",
        "kv_memory_unavailable",
    )
    ctx = admission.context_refusal(cfg, 64, None)
    assert "Shorten the prompt by at least 1 token." in ctx.message and "at most 0" not in ctx.message
    assert ctx.param == "prompt" and admission.context_refusal(cfg, 60, 8).param == "max_tokens"
    big = dataclasses.replace(cfg, max_model_len=10_000)
    pool = admission.budget_refusal(big, 32 * 4 + 4, 1)
    assert "Even max_tokens 1 does not fit" in pool.message and "at most 0" not in pool.message
    assert pool.param == "prompt" and admission.budget_refusal(big, 8, 1000).param == "max_tokens"
    unset = admission.budget_refusal(big, 32 * 4 + 4, 1, given=False)
    assert "+ at least 1 generated token =" in unset.message and "max_tokens 1 =" not in unset.message
    assert wait_until(lambda: e.snapshot().running == 0)


def test_a_waiter_that_fits_but_stood_behind_the_head_is_told_so():
    """The scheduler's own refusal, not just the text function: a 1-block request behind a 5-block head
    (2 of 8 blocks free) waits out --max-queue-wait and is told it waited behind 1 earlier request, not
    that it needs 1 block of 2 free. Red when the positions were counted after the earlier late waiter had
    left (always 0 ahead: the old, contradictory text)."""
    from tests.test_scheduler import Harness, drain

    hx = Harness(blocks=8, block_size=4, max_queue_wait=0.05)
    a = hx.submit(4, 20)  # 6 blocks, running
    hx.tick()
    head = hx.submit(4, 16, salt=1)  # 5 blocks: does not fit
    small = hx.submit(2, 2, salt=2)  # 1 block: fits, behind the head
    hx.tick()
    time.sleep(0.1)
    hx.tick()
    (ev,) = drain(small)
    assert isinstance(ev, Refused) and ev.refusal.code == "kv_memory_unavailable"
    assert "waited behind 1 earlier request," in ev.refusal.message, ev.refusal.message
    (hev,) = drain(head)
    assert "it needs 5 blocks of KV" in hev.refusal.message
    a.cancel()
    hx.run()


def test_the_ttft_400_stands_on_whole_prompt_only_chunks():
    """The rate behind the 400 comes only from steps that prefilled a whole chunk and nothing else: a
    short chunk spreads the step's fixed cost over few tokens and a decode row adds its own time, and
    either would overstate an idle prefill (a 128-token prompt was refused as taking 0.4 s when one
    0.2 s step does it). Red with the `alone` or the whole-chunk condition taken out."""
    from kvgate.core.state import StepTimes

    t = StepTimes()
    t.observe(0.2, 64, 512, alone=True)  # a short chunk
    t.observe(0.2, 512, 512, alone=False)  # a whole chunk beside decode rows
    assert t.prefill_token_best is None and t.prefill.line() is not None
    t.observe(0.2, 512, 512, alone=True)
    assert t.prefill_token_best == 0.2 / 512


def test_an_idle_server_never_answers_the_ttft_429(make_engine):
    """Nothing is running or waiting: a 429 ("wait for the load to drop") could never clear, since a
    retry waits for nothing. The forecast's rate (an EMA pulled up by one slow chunk) said 0.4 s for a
    64-token prompt against a 0.3 s budget; the lower bound behind the 400 did not, so it is served.
    Found by session 29's live recheck (a 1,201-token prompt got 429 three times on an idle server,
    then ran in 1.94 s of a 2 s budget). Red with the idle exception taken out of the gate."""
    e = make_engine(block_size=4, max_ttft=0.3, prefill_chunk=64)
    e.generate(req(64, 1), timeout=20)  # a whole chunk alone, fast: the lower bound's rate
    set_step_hook(e, lambda so: time.sleep(1.5))
    e.generate(req(40, 1, salt=1), timeout=20)  # one slow 40-token chunk pulls the EMA up
    set_step_hook(e, None)
    snap = e.snapshot()
    assert snap.idle and prefill_seconds(snap.prefill_line, 0, 64) > 0.3 > 64 * snap.prefill_token_time_best
    assert e.generate(req(64, 1, salt=2), timeout=20).finish_reason == "length"


def test_a_400_points_at_the_field_the_client_sent(make_engine):
    """`param` names the field to change, as the client spelled it: the prompt is `messages` in chat
    and `prompt` in completions; an output limit sent as `max_completion_tokens` is named so; `best_of`
    when it, not `n`, asked for too many rows. The session 29 QA pass found these 400s without any
    `param`. Red with `field_names` not passed to `from_refusal` (the engine's names came back), and
    with the refusal builders' `param` taken out (none at all)."""
    import httpx

    from tests.server_util import running_server

    e = make_engine(max_model_len=64, max_seqs=4)
    long = "hello " * 200

    def param(path: str, body: dict) -> tuple[int, str, str | None]:
        r = httpx.post(base + path, json=body, timeout=30)
        err = r.json()["error"]
        return r.status_code, err["code"], err.get("param")

    chat = "/v1/chat/completions"
    with running_server(e) as (base, _):
        short = [{"role": "user", "content": "hi"}]
        assert param(chat, {"messages": [{"role": "user", "content": long}]}) == (
            400,
            "context_length_exceeded",
            "messages",
        )
        assert param("/v1/completions", {"prompt": long}) == (400, "context_length_exceeded", "prompt")
        assert param(chat, {"messages": short, "max_tokens": 200}) == (
            400,
            "context_length_exceeded",
            "max_tokens",
        )
        assert param(chat, {"messages": short, "max_completion_tokens": 200}) == (
            400,
            "context_length_exceeded",
            "max_completion_tokens",
        )
        assert param("/v1/completions", {"prompt": "hi", "n": 1, "best_of": 6, "max_tokens": 2}) == (
            400,
            "too_many_choices",
            "best_of",
        )
        assert param("/v1/completions", {"prompt": "hi", "n": 6, "max_tokens": 2}) == (
            400,
            "too_many_choices",
            "n",
        )


def test_retry_after_stands_on_the_typical_decode_step():
    """The soonest row has 200 steps left at ~40 ms a decode step: about 9 s (the slow step clipped to
    3 x the median in the mean, kvgate.core.forecast.typical_step), whatever one slow step
    (a preempted thread) did to the smoothed step time, and however many prompt chunks a burst just
    ran (0.5 s each), and with no stretch for the requests queued. Session 30's QA saw Retry-After
    36-60 for a server clear 2.6 s later (the openai SDK sleeps it in full). Red with the EMA back as
    the step time (26 s), and with the median over all steps (the chunks: 100 s, capped to 60)."""
    from kvgate.core.snapshot import Counters, EngineSnapshot, RowView

    decode = (0.04,) * 20 + (0.9,) + (0.04,) * 3  # the slow step four steps ago
    ema = 0.04
    for s in decode:
        ema = 0.8 * ema + 0.2 * s
    rows = (RowView(1, 200, 4, 10, 0, 50, 250), RowView(2, 250, 4, 10, 0, 0, 250))
    snap = EngineSnapshot(
        1,
        0.0,
        Counters(),
        rows,
        (),
        0,
        64,
        32,
        0,
        ema,
        None,
        0.9,
        recent_steps=(0.5,) * 30 + decode[-2:],
        recent_decode_steps=decode,
    )
    assert 200 * ema > 20  # what the EMA would have said
    # the clipped mean: the 0.9 s step counts as 3 x the 0.04 s median, 200 x 43.3 ms = 8.7 s
    assert forecast.retry_after(snap) == 9


def test_the_requests_just_let_in_count_as_rows_in_the_503s_retry_after():
    """QA pass 16: in one burst the gate let 2 requests of 400 tokens into the free rows, and the 503s
    sent right after said Retry-After 1 (the snapshot showed no rows yet): the retries came back 3 s
    early and failed again. The gate's pending requests count as rows at their max_tokens. Red with
    them left out (1); red with the forced (ignore_eos) one at LIKELY_TOKENS (3, session 41)."""
    from kvgate.core.snapshot import WaiterView
    from tests.cluster_util import snapshot

    snap = snapshot(kv_blocks_total=64, kv_blocks_free=64, recent_decode_periods=(0.01,) * 8)
    pending = [WaiterView(40, 4, 1, 200), WaiterView(40, 4, 2, 200)]
    assert forecast.retry_after(snap) == 1  # nothing running, nothing let in: room now
    assert forecast.retry_after(snap, pending) == 2  # 200 ticks of 10 ms
    # max_tokens unset (the rest of the context): a typical answer, not 8,150 ticks (QA pass 16 on the
    # first version: Retry-After 28-60 for rows free in 0.2 s); LIKELY_TOKENS before any row stopped
    unset = [WaiterView(40, 4, 3, 8150, may_stop=True, explicit=False)]
    assert forecast.retry_after(snap, unset) == 3  # 256 ticks
    # one forced to its max_tokens (ignore_eos) is priced there, as a running row is
    forced = [WaiterView(40, 4, 3, 500, may_stop=False, explicit=True)]
    assert forecast.retry_after(snap, forced) == 5  # 500 ticks, not 256
    warm = snapshot(recent_decode_periods=(0.01,) * 8, stop_lengths=(8, 12, 10, 9, 11))
    assert forecast.retry_after(warm, unset) == 1


def test_the_trim_tells_each_refused_request_the_places_the_kept_ones_take(make_engine):
    """Three newcomers could not start while 2 choices (--max-queue 2) already waited: each 503 says
    the earlier requests take 2 of the 2 places, not a running count (session 30's QA saw "take 5 of
    its 4 places"). Red with the count taken inside the popping loop."""
    e = make_engine(kv_cache_bytes=32 * 4 * BPT, block_size=4, max_queue=2, max_seqs=8)
    h0 = hog(e, 4, 124)  # the whole pool; 7 rows stay free, so the gate lets 2 + 7 through
    handles = [e.submit(req(4, 8, salt=i)) for i in range(1, 6)]
    refusals = [first_event(h).refusal for h in handles[2:]]  # the newest leave; the first 2 wait
    assert all(r.code == "queue_full" for r in refusals) and e.snapshot().waiting == 2
    assert all("take 2 of its 2 places" in r.message for r in refusals), [r.message for r in refusals]
    h0.cancel()


def test_n_choices_count_their_prompt_once_in_the_prompt_tokens_counter(make_engine):
    """`kvgate_prompt_tokens_total` counts a prompt once however many choices share it, as the usage
    does (session 30's QA: n=3 raised it by 93 for a 31-token prompt). Red with the leader check taken
    out (3 x 6)."""
    e = make_engine(block_size=4)
    hs = e.submit_choices(req(6, 3, seed=1), 3)
    assert all(h.result(20).finish_reason == "length" for h in hs)
    assert e.snapshot().counters.prompt_tokens == 6


def test_a_refusals_text_says_its_retry_after_in_seconds():
    """QA pass 16: behind LiteLLM's proxy the Retry-After header and the body's fields are gone, and the
    message said only "Retry after the Retry-After interval". The seconds are in the text too. Red
    without the substitution in `from_refusal`."""
    from kvgate.request import Refusal
    from kvgate.server.errors import from_refusal

    r = Refusal(
        "queue_full", "the server is at capacity; retry after the Retry-After interval.", 503, retry_after=7
    )
    err = from_refusal(r).body()["error"]
    assert "retry after 7 s (the Retry-After header)." in err["message"], err["message"]
    assert err["retry_after_seconds"] == 7


def test_a_row_that_may_stop_is_priced_at_how_long_answers_run_here():
    """QA pass 16: rows with max_tokens unset (openai-node's, the AI SDK's and LangChain's default) were
    priced at the rest of the context, 8,150 steps: Retry-After 60 for rows that stopped in ~1 s, and
    openai-node slept it in full against an idle server. A row that may stop at EOS is priced at what 9
    in 10 of the recent rows that stopped wrote (256 tokens for an unset max_tokens before any stopped).
    Red with `steps_left` in `retry_after` (60 for each)."""
    from kvgate.core.snapshot import RowView
    from tests.cluster_util import snapshot

    unset = RowView(1, 8150, 4, 40, 0, 50, 8200, may_stop=True, explicit=False)
    periods = {"recent_decode_periods": (0.01,) * 8}
    fresh = snapshot(rows=(unset,), **periods)
    assert forecast.retry_after(fresh) == 2  # 206 steps of 10 ms: 256 tokens, 50 out
    warm = snapshot(rows=(unset,), stop_lengths=(60, 80, 100, 90, 70, 120, 110, 95), **periods)
    assert forecast.retry_after(warm) == 1  # 9 in 10 stopped by 110 tokens: 60 more steps
    # a row forced to its max_tokens (ignore_eos), or one whose max_tokens was given, before any stop data
    forced = RowView(2, 8150, 4, 40, 0, 50, 8200, may_stop=False, explicit=False)
    given = RowView(3, 2000, 4, 40, 0, 0, 2000, may_stop=True, explicit=True)
    assert forecast.retry_after(snapshot(rows=(forced,), **periods)) == 60
    assert forecast.retry_after(snapshot(rows=(given,), **periods)) == 20


def test_the_engine_keeps_how_long_stopped_answers_ran(make_engine):
    """`EngineSnapshot.stop_lengths`: a row that ends at a stop token counts its tokens; one that ran to
    max_tokens does not. Red without the append in `EngineState.finish`."""
    from kvgate.request import GenerationRequest
    from kvgate.sampling_params import SamplingParams

    e = make_engine()
    sp = SamplingParams(temperature=0.0, logit_bias={7: 100.0})  # token 7, then it is a stop token
    e.submit(GenerationRequest([5, 6], sp, 8, stop_token_ids=[7])).result(30)
    e.submit(GenerationRequest([5, 6], SamplingParams(temperature=0.0), 3, ignore_eos=True)).result(30)
    assert e.snapshot().stop_lengths == (1,)


def test_a_fresh_server_prices_its_first_ticks_at_its_weights_read(make_engine):
    """QA pass 16: before any decode tick was timed a server priced ticks at a flat 50 ms (Retry-After 10
    for rows free in 1.4-2.1 s), or, after its first prompt chunk, at that chunk (15 s for 0.8 s). The
    prior is its weights read at a slow rate (10 GB/s on a CPU): SmolLM2's 103 MB, ~10 ms. Red with the
    old fallbacks (0.05 s; the 0.4 s chunk)."""
    from kvgate.core.snapshot import RowView
    from tests.cluster_util import snapshot

    prior = forecast.step_prior(103_000_000, "cpu")
    assert prior == pytest.approx(0.0103)
    row = RowView(1, 200, 4, 40, 0, 0, 200)
    assert forecast.typical_step(snapshot(rows=(row,), step_prior=prior)) == prior
    chunked = snapshot(rows=(row,), step_prior=prior, recent_steps=(0.4, 0.45))
    assert forecast.typical_step(chunked) == prior and forecast.retry_after(chunked) == 2
    assert make_engine().snapshot().step_prior == forecast.PRIOR_FLOOR_S  # the tiny model: the floor


def test_a_burst_refused_together_is_told_the_row_ends_one_by_one(make_engine):
    """QA pass 16: the 503s (and rows 429s) of one burst all said the soonest row's end, so openai-node's
    clients came back together and collided again (3 of 8 streams failed their retries against 2 rows).
    The k-th of a burst is told the k-th row end. Red with `told` ignored (each 1 s, then 1 s)."""
    from kvgate.core.snapshot import RowView
    from kvgate.core.testing import set_step_hook
    from kvgate.request import GenerationRequest, Refusal
    from kvgate.sampling_params import SamplingParams
    from tests.cluster_util import snapshot

    rows = tuple(RowView(i, steps, 4, 8, 0, 0, steps) for i, steps in ((1, 100), (2, 200), (3, 300)))
    snap = snapshot(rows=rows, recent_decode_periods=(0.01,) * 8)
    assert [forecast.retry_after(snap, told=k) for k in range(5)] == [1, 2, 3, 3, 3]

    e = make_engine(max_seqs=2, max_queue=0)
    set_step_hook(e, lambda _so: time.sleep(0.01))
    sp = SamplingParams(temperature=0.0)
    running = [e.submit(GenerationRequest([5, 6], sp, mt, ignore_eos=True)) for mt in (100, 400)]
    for h in running:
        h.wait_admitted(30)
    time.sleep(0.2)  # a few ticks: the step time is measured
    told = []
    for _ in range(2):
        with pytest.raises(Refusal) as err:
            e.submit(GenerationRequest([5, 6], sp, 8, ignore_eos=True))
        told.append(err.value.retry_after)
    assert told[0] < told[1], told
    set_step_hook(e, None)
    for h in running:
        h.cancel()


def test_a_request_let_in_on_the_ttft_forecast_waits_no_longer_than_the_budget(make_engine):
    """Session 41: a request the TTFT forecast let into the queue, whose rows then ran longer than
    forecast (a live SmolLM2 row ran away to 8,137 tokens), waited the whole --max-queue-wait (30 s)
    under a --max-ttft of 2 s. The queue deadline is now the shorter of the two, and the 429 says the
    budget set it. Here a forced row of 100 steps at ~20 ms is forecast to end in ~2 s, within a 3 s
    budget; the steps then slow to 60 ms. Red with the deadline at --max-queue-wait (admitted after
    ~4 s, no refusal)."""
    e = make_engine(max_seqs=1, max_ttft=3.0, max_queue_wait=30)
    h0 = hog(e, 4, 100)
    wait_until(lambda: e.snapshot().counters.decode_steps >= 12)
    t0 = time.monotonic()
    h = e.submit(req(8, 4))
    set_step_hook(e, lambda so: time.sleep(0.06))
    with pytest.raises(Refusal) as ei:
        h.wait_admitted(20)
    waited, r = time.monotonic() - t0, ei.value
    assert (r.code, r.status) == ("batch_rows_unavailable", 429)
    assert "after waiting 3s (--max-ttft: no first token within 3s)" in r.message
    assert 2.8 <= waited < 5, waited
    assert e.sched_cfg.queue_wait == 3.0 and e.sched_cfg.queue_wait_flag == "--max-ttft"
    h0.cancel()
