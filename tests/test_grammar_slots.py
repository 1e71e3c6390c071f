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
    --max-grammars, and the plan fits with --max-grammars 0. Red with the grammars left inside the
    workspace term (the advice did not name the flag)."""
    from kvgate.memory.plan import PlanError

    with pytest.raises(PlanError) as err:
        smollm2_plan("600MiB", 2)
    said = str(err.value)
    assert (
        "structured-output grammars 64.3 MiB" in said and "--max-grammars (0: no structured output)" in said
    )
    assert smollm2_plan("600MiB", 2, grammars=0).kv_blocks > 0


# ---- the compiler's slots --------------------------------------------------------------------------------
def test_slots_hold_running_grammars_and_evict_idle_ones(make_engine):
    """Two slots: two running grammars fill them and a third cannot pin; a grammar already running
    pins at no cost; once one ends, the third takes its slot and the idle one is evicted; a check
    while every slot runs compiles without keeping. Red with `release` not unpinning (the third never
    pins), with `_room` evicting a pinned grammar (kept() says 3 or the pinned one is gone), and with
    `acquire` ignoring `new_slot`."""
    e = make_engine()
    comp = _compiler(e, 2)
    a, b, c = ('start: "a"\n', 'start: "b"\n', 'start: "c"\n')
    for t in (a, b, c):
        comp.check(t)
    assert comp.kept() == (2, 0)  # b and c cached, a evicted (the oldest, idle)
    assert comp.acquire(b, 2) and comp.acquire(c, 1)
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
    """--max-grammars 1: a request with a second schema waits while the first runs; a plain request
    and one with the running schema pass it; it starts when the first ends. Red with the pin check
    taken out of `_admit` (b admitted at once)."""
    e = make_engine(max_grammars=1, max_queue_wait=30.0)
    set_step_hook(e, lambda so: time.sleep(0.02))  # a's 400 characters take seconds
    g1, g2, g3 = (_grammar(e, k) for k in ("first", "second", "third"))
    a = e.submit(_request(g1, max_tokens=2000 if e.max_model_len > 2100 else e.max_model_len - 8))
    assert isinstance(a.wait_admitted(10), Admitted)
    b = e.submit(_request(g2))
    d = e.submit(_request(g3))
    plain = e.submit(_request(None, max_tokens=4))
    same = e.submit(_request(g1, max_tokens=4))
    assert plain.result(30).finish_reason == "length"
    assert same.result(30).finish_reason == "length"
    with pytest.raises(TimeoutError):
        b.wait_admitted(0.3)
    with pytest.raises(TimeoutError):
        d.wait_admitted(0.01)
    a.cancel()
    assert isinstance(b.wait_admitted(10), Admitted)
    with pytest.raises(TimeoutError):
        d.wait_admitted(0.3)  # b holds the one slot now
    b.cancel()
    assert isinstance(d.wait_admitted(10), Admitted)
    d.cancel()


def test_a_new_grammar_does_not_pass_a_head_waiting_for_logprobs_memory(make_engine):
    """Behind a head that waits for logprobs memory only requests needing neither budget pass: one
    whose schema is no longer kept (checked, then evicted by a newer check) waits its turn although
    the slot could be had. Red with `new_slot=not i` made True (c started before b)."""
    from kvgate.core import logprob_budget as B
    from tests.test_logprob_budget import lp_request

    per = 16 * B.position_bytes(20)
    e = make_engine(logprobs_memory=per + per // 2, max_grammars=1, max_queue_wait=30.0)
    a = e.submit(lp_request(16))  # its reservation is held until a.close()
    a.result(30)
    b = e.submit(lp_request(16))
    g = _grammar(e, "c", min_length=1)
    _grammar(e, "newer")  # takes the one slot: g is evicted (idle)
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


def test_a_head_that_waits_for_a_slot_too_long_gets_a_429_that_says_so(make_engine):
    """Past --max-queue-wait the head waiting for a grammar slot is a 429 grammar_memory_unavailable
    naming --max-grammars and the slots; a new-schema request behind it is told what held the line.
    Red with the `head_waits` "grammar" branch taken out of `_head_waits` (the KV message, with the
    pool free)."""
    e = make_engine(max_grammars=1, max_queue_wait=0.4)
    set_step_hook(e, lambda so: time.sleep(0.02))
    g1, g2, g3 = (_grammar(e, k) for k in ("first", "second", "third"))
    a = e.submit(_request(g1, max_tokens=e.max_model_len - 8))
    assert isinstance(a.wait_admitted(10), Admitted)
    b = e.submit(_request(g2))
    c = e.submit(_request(g3))
    with pytest.raises(Refusal) as err:
        b.wait_admitted(10)
    assert (err.value.status, err.value.code) == (429, "grammar_memory_unavailable")
    assert "--max-grammars" in err.value.message and "keeps 1 structured-output grammar " in err.value.message
    assert err.value.retry_after >= 1
    with pytest.raises(Refusal) as behind:
        c.wait_admitted(10)
    assert (behind.value.status, behind.value.code) == (429, "grammar_memory_unavailable")
    assert "waited behind 1 earlier request" in behind.value.message
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
    taken out of `server.features` (the compiler refused it later, as an unenforceable schema)."""
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
    from kvgate.structured.compiler import _compilers

    assert e.tokenizer not in _compilers


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
