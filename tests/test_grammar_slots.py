"""Grammar memory is planned per distinct grammar: `--max-grammars` slots, taken at admission.

Before session 38 the plan charged every row a grammar of its own plus a cache of max(4, rows / 4):
186 MiB of a 1 GiB plan at 16 rows, more than its KV pool. Rows of one schema share a grammar's lexer
states, so a slot is held per distinct grammar, running or cached. Each test names what breaks it; each
was seen red by making that break.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from kvgate.core.testing import set_step_hook
from kvgate.request import Admitted, GenerationRequest, Refusal
from kvgate.sampling_params import SamplingParams
from kvgate.server.tools import JSON_STYLE
from kvgate.structured import compiler as C
from tests.test_plan import smollm2_plan


def _grammar(engine, key: str, min_length: int = 400):
    """A schema whose answer cannot end within a few hundred tokens (a long required string)."""
    schema = {"type": "object", "properties": {key: {"type": "string", "minLength": min_length}}}
    schema |= {"required": [key], "x-guidance": JSON_STYLE}
    comp = C.compiler_for(engine.tokenizer, engine.spec.vocab_size, engine.plan.limits.grammars)
    return comp.check("start: %json " + json.dumps(schema))


def _request(grammar=None, max_tokens=200, prompt=(5, 6, 7, 8)) -> GenerationRequest:
    sp = SamplingParams(temperature=0.0, grammar=grammar)
    return GenerationRequest(list(prompt), sp, max_tokens, ignore_eos=True)


def _compiler(engine, slots: int) -> C.GrammarCompiler:
    info = engine.tokenizer.info
    return C.GrammarCompiler(info.tokenizer_json, list(info.eog_token_ids), engine.spec.vocab_size, slots)


def _one_slot_running(make_engine, **cfg):
    """An engine with one grammar slot and slow steps (20 ms), the slot held by a row of a first
    schema that runs to the end of the context: (engine, first grammar, second grammar, its handle)."""
    e = make_engine(max_grammars=1, **{"max_queue_wait": 30.0, **cfg})
    set_step_hook(e, lambda so: time.sleep(0.02))
    g1, g2 = _grammar(e, "first"), _grammar(e, "second")
    a = e.submit(_request(g1, max_tokens=e.max_model_len - 8))
    assert isinstance(a.wait_admitted(10), Admitted)
    return e, g1, g2, a


# ---- the plan ------------------------------------------------------------------------------------------
def test_the_plan_charges_a_slot_per_kept_grammar_not_per_row():
    """The grammar term is the trie, (slots + 1 compile in hand) grammars and a mask per row: 4 slots
    by default whatever the rows, none at all with --max-grammars 0. Red with the old term (cache +
    one per row: 20 grammars at 16 rows)."""
    g = C.GRAMMAR_BYTES
    plans = {rows: smollm2_plan("4GiB", 2, max_seqs=rows) for rows in (4, 32)}
    for rows, plan in plans.items():
        assert plan.limits.grammars == C.AUTO_SLOTS
        term = plan.workspace_breakdown["grammar"]
        assert (C.AUTO_SLOTS + 1) * g < term < (C.AUTO_SLOTS + 1) * g + (30 << 20) + rows * (80 << 10)
    assert plans[32].workspace_breakdown["grammar"] - plans[4].workspace_breakdown["grammar"] < 3 << 20
    off = smollm2_plan("4GiB", 2, grammars=0)
    assert off.workspace_breakdown["grammar"] == 0 and "off, --max-grammars 0" in off.describe()
    one = smollm2_plan("4GiB", 2, max_seqs=4, grammars=1)
    assert plans[4].workspace_breakdown["grammar"] - one.workspace_breakdown["grammar"] == 3 * g
    assert "1 grammar kept at once" in one.describe()


def test_a_limit_too_small_names_the_grammars_and_the_flag_that_frees_them():
    """The no-fit error lists the grammars apart from the rest of the smallest workspace and names
    --max-grammars, and the plan fits with --max-grammars 0; rows shrunk for many grammars say so.
    Red with the grammars left inside the workspace term (the advice did not name the flag), and with
    the shrink note's hint taken out."""
    from kvgate.memory.plan import PlanError

    with pytest.raises(PlanError) as err:
        smollm2_plan("600MiB", 2)
    said = str(err.value)
    assert (
        "structured-output grammars 64.3 MiB" in said and "--max-grammars (0: no structured output)" in said
    )
    assert smollm2_plan("600MiB", 2, grammars=0).kv_blocks > 0
    many = smollm2_plan("1GiB", 2, grammars=44)  # the rows shrink for grammars: the note names the flag
    assert "max rows 32 -> 8 (--max-grammars 44 plans 361.4 MiB)" in " ".join(many.notes)


# ---- the compiler's slots --------------------------------------------------------------------------------
def test_slots_hold_running_grammars_and_evict_idle_ones(make_engine):
    """Two slots: a check keeps a grammar only in a free slot (it never evicts); a pin evicts the least
    recently used idle grammar; two running grammars fill the slots and a third cannot pin; a grammar
    already running pins at no cost; a check while every slot runs compiles without keeping; once one
    ends, the third takes its slot. Red with `release` not unpinning (the third never pins), with
    `_room` evicting a pinned grammar (kept() says 3 or the pinned one is gone), with `acquire`
    ignoring `new_slot`, and with a check evicting (review of session 38: c cached, a gone)."""
    e = make_engine()
    comp = _compiler(e, 2)
    a, b, c = ('start: "a"\n', 'start: "b"\n', 'start: "c"\n')
    for t in (a, b, c):
        comp.check(t)
    assert comp.kept() == (2, 0) and c not in comp._cache  # a and b kept; c validated, not kept
    assert comp.acquire(c, 1)  # evicts a (the least recently used idle one)
    comp.matcher(c)  # the row's matcher: compiled now, and kept (pinned)
    assert a not in comp._cache and c in comp._cache
    assert comp.acquire(b, 2)
    assert comp.kept() == (2, 2) and not comp.can_pin(a) and not comp.acquire(a, 1)
    assert comp.acquire(b, 1, new_slot=False)  # kept already: no slot needed
    before = comp.compiles
    comp.check(a)  # validated, not kept: every slot runs another grammar
    assert comp.compiles == before + 1 and comp.kept() == (2, 2) and not comp.can_pin(a)
    comp.release(c)
    assert comp.kept() == (2, 1) and comp.can_pin(a)
    assert not comp.acquire(a, 1, new_slot=False)
    assert comp.acquire(a, 1)  # evicts c (idle), a pinned; compiled when a row asks for its matcher
    assert comp.kept() == (2, 2)
    comp.matcher(a)
    assert comp.kept() == (2, 2) and a in comp._cache and c not in comp._cache
    comp.release(b, 3)
    comp.release(a)
    assert comp.kept() == (2, 0)


# ---- admission -------------------------------------------------------------------------------------------
def test_a_new_grammar_waits_for_a_slot_while_others_pass(make_engine):
    """--max-grammars 2, both slots running: a request with a third schema waits; a plain request and
    one with a running schema pass it, except the running grammar held for it (the one whose rows end
    soonest), which takes no one new; it starts when that one ends. Red with the pin check taken out of
    `_admit` (b admitted at once), and with `hold_for_head` not called (same1 passed too)."""
    e = make_engine(max_grammars=2, max_queue_wait=30.0)
    set_step_hook(e, lambda so: time.sleep(0.02))  # the 400 characters take seconds
    g0, g1, g2, g3 = (_grammar(e, k) for k in ("zeroth", "first", "second", "third"))
    long = 2000 if e.max_model_len > 2100 else e.max_model_len - 8
    f = e.submit_choices(_request(g0, max_tokens=long), 2)  # g0: 2 rows
    a = e.submit(_request(g1, max_tokens=long // 2))  # g1: 1 row, which ends sooner
    for h in [*f, a]:
        assert isinstance(h.wait_admitted(10), Admitted)
    b = e.submit(_request(g2))
    d = e.submit(_request(g3))
    plain = e.submit(_request(None, max_tokens=4))
    same0 = e.submit(_request(g0, max_tokens=4))
    same1 = e.submit(_request(g1, max_tokens=4))
    assert plain.result(30).finish_reason == "length"
    assert same0.result(30).finish_reason == "length"
    with pytest.raises(TimeoutError):
        same1.wait_admitted(0.3)  # g1 is held for b: it drains
    with pytest.raises(TimeoutError):
        b.wait_admitted(0.01)
    a.cancel()
    assert isinstance(b.wait_admitted(10), Admitted)
    with pytest.raises(TimeoutError):
        d.wait_admitted(0.3)  # g0 and b's g2 hold the slots now
    for h in [*f, b]:
        h.cancel()
    assert isinstance(d.wait_admitted(10), Admitted)
    assert same1.result(30).finish_reason == "length"
    d.cancel()


def test_a_steady_stream_of_one_schema_does_not_starve_a_new_one(make_engine):
    """--max-grammars 1 and one schema's requests overlapping without end: a new schema waiting at
    the head still gets the slot, since the running grammar takes no new rows once it waits (review
    of session 38: 14 later requests passed it, then a 429). Red with `hold_for_head` not called."""
    e = make_engine(max_grammars=1, max_queue_wait=3.0)
    set_step_hook(e, lambda so: time.sleep(0.01))
    ga, gb = _grammar(e, "aa", min_length=1), _grammar(e, "bb", min_length=1)
    cur = e.submit(_request(ga, max_tokens=60))
    assert isinstance(cur.wait_admitted(10), Admitted)
    b = e.submit(_request(gb, max_tokens=4))
    handles, outcome, end = [cur], None, time.monotonic() + 6
    while outcome is None and time.monotonic() < end:
        handles.append(e.submit(_request(ga, max_tokens=60)))  # would pass b, and overlap cur
        time.sleep(0.1)
        handles[-2].cancel()
        try:
            outcome = b.wait_admitted(0.2)
        except TimeoutError:
            continue
        except Refusal as r:
            outcome = r
    for h in handles:
        h.cancel()
    assert isinstance(outcome, Admitted), outcome


def test_a_logprobs_request_passes_a_head_waiting_for_a_slot(make_engine):
    """A request with logprobs behind a head that waits for a grammar slot (not for logprobs memory)
    goes first when the memory left covers the head's need too (QA pass 11: it waited for the slot
    with the head, 2.26 -> 8.7 s to its first token). Red with the old rule (any logprobs request
    behind a waiting head waits)."""
    from tests.test_logprob_budget import lp_request

    e, g1, g2, a = _one_slot_running(make_engine)
    b = e.submit(_request(g2))
    c = e.submit(lp_request(4, held=None))
    assert c.result(30).finish_reason == "length"
    with pytest.raises(TimeoutError):
        b.wait_admitted(0.01)
    a.cancel()
    assert isinstance(b.wait_admitted(10), Admitted)
    b.cancel()


def test_a_logprobs_request_does_not_take_what_a_slot_waiting_head_will_need(make_engine):
    """The head waits for a slot and will need logprobs memory once it has one: a logprobs request
    behind it may use only what is left beyond that. Red with `lp_kept` left out (c took the memory,
    and b would then wait for it too)."""
    from kvgate.core import logprob_budget as B
    from tests.test_logprob_budget import lp_request

    per = 16 * B.position_bytes(20)
    e, g1, g2, a = _one_slot_running(make_engine, logprobs_memory=per + per // 2)
    sp = SamplingParams(temperature=0.0, logprobs=20, grammar=g2)
    b = e.submit(GenerationRequest([5, 6, 7, 8], sp, 16, ignore_eos=True))  # a slot, then per bytes
    c = e.submit(lp_request(16, held=None))
    with pytest.raises(TimeoutError):
        c.wait_admitted(0.3)
    a.cancel()
    assert isinstance(b.wait_admitted(10), Admitted)
    b.result(30)
    assert c.result(30).finish_reason == "length"


def test_a_new_grammar_does_not_pass_a_head_waiting_for_logprobs_memory(make_engine):
    """Behind a head that waits for logprobs memory only requests needing neither budget pass: one
    whose schema is not kept (checked while the slot held another) waits its turn although the slot
    could be had by evicting the idle one. Red with `new_slot=not i` made True (c started before b)."""
    from kvgate.core import logprob_budget as B
    from tests.test_logprob_budget import lp_request

    per = 16 * B.position_bytes(20)
    e = make_engine(logprobs_memory=per + per // 2, max_grammars=1, max_queue_wait=30.0)
    a = e.submit(lp_request(16))  # its reservation is held until a.close()
    a.result(30)
    b = e.submit(lp_request(16))
    _grammar(e, "newer")  # takes the one slot
    g = _grammar(e, "c", min_length=1)  # validated, not kept
    assert g.compiler.kept() == (1, 0) and g.text not in g.compiler._cache
    c = e.submit(_request(g, max_tokens=4))
    plain = e.submit(_request(None, max_tokens=4))
    assert plain.result(30).finish_reason == "length"
    with pytest.raises(TimeoutError):
        c.wait_admitted(0.3)
    a.close()
    assert isinstance(b.wait_admitted(10), Admitted) and isinstance(c.wait_admitted(10), Admitted)
    b.result(30)
    b.close()


def test_a_lists_later_prompt_is_not_held_up_by_another_clients_check(make_engine):
    """A held prompt list [x1, x2] with one schema and logprobs: x1 reserved the list's logprobs,
    which come back when x is answered, after x2. y1 waits for them; x2 needs none and passes it, as
    long as its grammar stays kept. Another client's request checked meanwhile must not evict it
    (review of session 38: x2 then needed a new slot, could not pass y1, and all three waited until
    --max-queue-wait). Red with a check evicting idle grammars."""
    from kvgate.core import admission
    from kvgate.core import logprob_budget as B

    def lp(g, prompt):
        sp = SamplingParams(temperature=0.0, logprobs=20, grammar=g)
        return GenerationRequest(list(prompt), sp, 16, ignore_eos=True, held=0)

    per = 16 * B.position_bytes(20)
    e = make_engine(logprobs_memory=2 * per + per // 2, max_grammars=1, max_queue_wait=5.0)
    ga = _grammar(e, "xa", min_length=1)
    x = admission.fit_group(e.sched_cfg, [lp(ga, (5, 6, 7, 8)), lp(ga, (9, 10))], 1)
    x1 = e.submit(x[0])
    x1.result(10)
    y1 = e.submit(GenerationRequest([5, 6], SamplingParams(temperature=0.0, logprobs=20), 16, held=0))
    _grammar(e, "another_client")
    t0 = time.monotonic()
    x2 = e.submit(x[1])
    x2.result(10)
    took = time.monotonic() - t0
    x1.close()
    assert y1.result(10).finish_reason in ("length", "stop") and took < 2.0, took
    for h in (x2, y1):
        h.close()


def test_a_head_that_waits_for_a_slot_too_long_gets_a_429_that_says_so(make_engine):
    """Past --max-queue-wait the head waiting for a grammar slot is a 429 grammar_memory_unavailable
    naming --max-grammars and the slots; a new-schema request behind it, which waits for a slot too,
    is told the same (QA pass 11: it got the KV message, "it would fit now", under the grammar code).
    Red with the "grammar" side wait not recorded by `_admit` (`Scheduler.side_wait`: the KV message,
    with the pool free), and with `waits_for_slot` false behind the head."""
    e, g1, g2, a = _one_slot_running(make_engine, max_queue_wait=0.4)
    g3 = _grammar(e, "third")
    b = e.submit(_request(g2))
    c = e.submit(_request(g3))
    with pytest.raises(Refusal) as err:
        b.wait_admitted(10)
    assert (err.value.status, err.value.code) == (429, "grammar_memory_unavailable")
    said = err.value.message
    assert "--max-grammars" in said and "keeps 1 structured-output grammar " in said
    assert (
        "waited 0.4s" in said and "1 of them ran requests with other schemas (1 request still queued)" in said
    )
    assert err.value.retry_after >= 1
    with pytest.raises(Refusal) as behind:
        c.wait_admitted(10)
    assert (behind.value.status, behind.value.code) == (429, "grammar_memory_unavailable")
    assert (
        "for a grammar slot" in behind.value.message and "(0 requests still queued)" in behind.value.message
    )
    a.cancel()


def test_every_row_gives_its_pin_back(make_engine):
    """n choices pin their grammar n times and each row's end unpins once, whether it finished or was
    cancelled, and the snapshot says so. Red with the release taken out of `EngineState.finish`, and
    with the snapshot's counts left at 0."""
    e = make_engine(max_grammars=2)
    g = _grammar(e, "k", min_length=1)
    for h in e.submit_choices(_request(g, max_tokens=6), 3):
        h.result(30)
    assert _running(g.compiler) == 0
    other = e.submit(_request(_grammar(e, "other"), max_tokens=e.max_model_len - 8))
    assert isinstance(other.wait_admitted(10), Admitted)
    assert g.compiler.kept() == (2, 1)
    snap = e.snapshot()  # published by the worker each tick: the metrics' kvgate_grammars_*
    assert (snap.grammars_kept, snap.grammars_running) == (2, 1)
    other.cancel()
    assert _running(g.compiler) == 0


def _running(comp, seconds=5.0) -> int:
    """The running grammars once the worker has ended the rows (a cancel reaches it on its next tick)."""
    end = time.monotonic() + seconds
    while comp.kept()[1] and time.monotonic() < end:
        time.sleep(0.02)
    return comp.kept()[1]


# ---- the server -------------------------------------------------------------------------------------------
def test_max_grammars_0_is_a_400_that_says_structured_output_is_off(make_engine):
    """A server started with --max-grammars 0 answers a JSON-schema request and a tools request with a
    400 naming the flag, before any compiler (and its 24 MiB token trie) is built. Red with the check
    taken out of `server.features` (the compiler refused it later, as an unenforceable schema), and
    with the check in `compiler_for` taken out (the trie was built)."""
    from tests.server_util import running_server

    e = make_engine(max_grammars=0)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    bodies = {
        "response_format": {
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        },
        "tools": {"tools": [tool]},
    }
    with running_server(e) as (base, _app):
        for param, extra in bodies.items():
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                **extra,
            }
            r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "structured_output_off" and err["param"] == param
            assert "--max-grammars 0" in err["message"]
        ok = httpx.post(f"{base}/v1/chat/completions", json={**body, "tools": None}, timeout=30)
        assert ok.status_code == 200, ok.text
        assert "kvgate_grammar_slots 0.0" in httpx.get(f"{base}/metrics", timeout=30).text
    with pytest.raises(C.GrammarError, match="--max-grammars 0"):  # a replica's `bound`, a library user
        C.compiler_for(e.tokenizer, e.spec.vocab_size, e.plan.limits.grammars)
    assert e.tokenizer not in C._compilers


def test_the_snapshots_count_never_waits_for_a_compiler_being_built(make_engine):
    """The worker reads the slots' counts each tick; `compiler_for` holds its lock ~0.5 s while it
    builds a compiler (the first structured-output request). Red with `kept_for` taking that lock (the
    count waited for it)."""
    import threading

    e = make_engine()
    _grammar(e, "k", min_length=1)
    got = []
    with C._compilers_lock:
        t = threading.Thread(target=lambda: got.append(C.kept_for(e.tokenizer)), daemon=True)
        t.start()
        t.join(2.0)
    assert got == [(1, 0)]


def test_a_cached_grammar_never_waits_for_a_compile(make_engine):
    """The worker copies a cached template for every admitted row; a server thread may be compiling
    another schema then (held as `_compiling`). The copy does not wait for it. Red with the
    compile done under the cache's lock (as before session 38), taken here as `_compiling` held
    around the whole lookup."""
    import threading

    comp = _compiler(make_engine(), 2)
    comp.check('start: "a"\n')
    got = []
    with comp._compiling:  # a compile in progress elsewhere
        t = threading.Thread(target=lambda: got.append(comp.matcher('start: "a"\n')), daemon=True)
        t.start()
        t.join(2.0)
    assert len(got) == 1


def test_a_hold_outlasts_the_head_and_ends_with_the_held_grammars_rows(make_engine):
    """A head that waited for a slot is cancelled (its client gave up, to retry): the grammar held for
    it still takes no new rows, not even as the head, so the slot it frees is there for the retry (QA
    pass 12: the running schema refilled at each 429, seven times); once its rows end the hold ends
    and its requests run again. Red with the held grammar pinned by a head (z admitted at once), and
    with the release not ending the hold (z never admitted)."""
    e, g1, g2, a = _one_slot_running(make_engine)
    b = e.submit(_request(g2))
    time.sleep(0.2)  # b waits at the head: g1 is held for it
    assert g1.compiler.held == g1.text
    b.cancel()
    z = e.submit(_request(g1, max_tokens=4))
    with pytest.raises(TimeoutError):
        z.wait_admitted(0.4)
    a.cancel()
    assert z.result(30).finish_reason == "length" and g1.compiler.held is None


def test_the_grammar_held_is_the_one_whose_rows_end_soonest(make_engine):
    """Two slots: one long row of g1 against three short rows of g2; a head with a third schema holds
    g2, whose slot frees first, not g1 with the fewest rows (QA pass 12: a 36 s row was held while the
    other slot ran 140 short requests). Red with the fewest rows chosen."""
    e = make_engine(max_grammars=2, max_queue_wait=30.0)
    set_step_hook(e, lambda so: time.sleep(0.02))
    g1, g2, g3 = _grammar(e, "long"), _grammar(e, "short"), _grammar(e, "third")
    hs = [e.submit(_request(g1, max_tokens=e.max_model_len - 8))]
    hs += e.submit_choices(_request(g2, max_tokens=60), 3)
    for h in hs:
        assert isinstance(h.wait_admitted(10), Admitted)
    c = e.submit(_request(g3, max_tokens=4))
    time.sleep(0.2)
    assert g1.compiler.held == g2.text
    assert c.result(30).finish_reason == "length"  # g2's rows end within 60 steps: c has its slot
    for h in hs:
        h.cancel()


def test_a_slot_waits_retry_after_counts_the_queue_wait_of_the_retry(make_engine):
    """A client told to retry waits in the queue again, up to --max-queue-wait: the Retry-After for a
    slot is the time until the held grammar's rows end, less that wait (QA pass 12: 60 s for a slot
    free 4 s later). Red with the queue wait not taken off."""
    import dataclasses

    from kvgate.core import forecast

    snap = dataclasses.replace(make_engine().snapshot(), step_prior=0.05)
    steps = 600  # 30 s at a step prior of 50 ms, before any step is timed
    assert forecast.retry_after_steps(snap, steps) - forecast.retry_after_steps(snap, steps, 10.0) == 10
    assert forecast.retry_after_steps(snap, steps, 120.0) == 1


def test_a_request_of_the_held_grammar_that_times_out_is_told_it_waited_for_a_slot(make_engine):
    """The held grammar takes no new rows, its head included (the hold outlasts the head it was for):
    such a head that waits out --max-queue-wait gets the grammar 429, not the KV one ("it needs N
    blocks ... and M are free", with the pool free). Seen red before `can_pin` refused the held
    grammar as `acquire` does (code kv_memory_unavailable)."""
    e, g1, g2, a = _one_slot_running(make_engine, max_queue_wait=0.6)
    b = e.submit(_request(g2))
    time.sleep(0.2)  # b waits at the head: g1 is held for it
    b.cancel()
    z = e.submit(_request(g1, max_tokens=4))
    with pytest.raises(Refusal) as err:
        z.wait_admitted(10)
    assert (err.value.status, err.value.code) == (429, "grammar_memory_unavailable")
    assert "this one's schema among them, held to free its slot" in err.value.message
    a.cancel()
