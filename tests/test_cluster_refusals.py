"""What the cluster's 429 says a request waited for (QA: a request waiting for a grammar slot or
logprobs memory was told `batch_rows_unavailable`, "raise --max-seqs"), and the numbers its own 429s
carry. Without Ray: the ingress's dispatcher with scripted replicas, and one replica's engine in this
process (as tests/test_cluster_units.py). Each docstring says how the test was seen red.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from kvgate.cluster.dispatch import Dispatcher
from kvgate.cluster.routing import Demand
from kvgate.core import logprob_budget as B
from kvgate.request import GenerationRequest, Refusal
from kvgate.sampling_params import SamplingParams
from tests.cluster_util import BLOCK, FakeCall, FakeHandle, refused, view

GRAMMAR = {
    "code": "grammar_memory_unavailable",
    "message": "waited 0.25s (this replica's admission bound) for a grammar slot: ... --max-grammars.",
    "status": 429,
    "estimated_bytes": 41 << 20,
    "limit_bytes": 41 << 20,
}
LOGPROBS = {
    "code": "logprobs_memory_unavailable",
    "message": "waited 0.25s (this replica's admission bound) for 150 KiB of logprobs memory; ...",
    "status": 429,
    "estimated_bytes": 150 << 10,
    "limit_bytes": 2 << 20,
}


def run(coro):
    return asyncio.run(coro)


def dispatcher(views, answer):
    published = {v.replica: v for v in views}
    return Dispatcher(FakeHandle(answer), lambda: published)


def side_refusal(tag: str, body: dict, retry: int, **kw):
    """A replica's refusal for a side budget; its view has the blocks and rows (the attempt was sent),
    and one grammar running in its one slot."""
    v = view(tag, version=2, **kw)
    v = dataclasses.replace(v, snapshot=_grammars(v.snapshot, 1))
    return [("refused", {"refusal": {**body, "retry_after": retry}, "view": v})]


# ---- the ingress's answer after --max-queue-wait ------------------------------------------------------
@pytest.mark.parametrize("body", [GRAMMAR, LOGPROBS], ids=["grammar", "logprobs"])
def test_a_request_every_replica_refused_for_a_side_budget_gets_that_429_after_its_wait(body):
    """Both replicas have the KV and rows but refuse the request for a grammar slot (or logprobs
    memory) at every try; past --max-queue-wait the client gets that code, with the replica's numbers
    and the soonest Retry-After it gave (3; the views say 1, about KV). Red with `_queued` answering
    from the views alone (`_everyone_refused(call, [], ...)`): batch_rows_unavailable, "has no 1
    batch rows free" with 0/8 rows busy."""
    views = [view("a", free=20, max_queue_wait=0.3), view("b", free=20, max_queue_wait=0.3)]
    d = dispatcher(views, lambda t, w: side_refusal(t, body, 5 if t == "a" else 3, max_queue_wait=0.3))
    with pytest.raises(Refusal) as e:
        run(asyncio.wait_for(d.dispatch(FakeCall(blocks=4)), 5))
    r = e.value
    assert (r.status, r.code, r.retry_after) == (429, body["code"], 3)
    assert (r.estimated_bytes, r.limit_bytes) == (body["estimated_bytes"], body["limit_bytes"])
    assert "within 0.3s (--max-queue-wait)" in r.message and body["message"] in r.message
    assert "batch row" not in r.message


def test_a_replica_that_refused_for_a_side_budget_is_not_asked_again_until_that_budget_changes():
    """QA counted 114 refused attempts for one 30 s wait: the ingress re-sent the request to each
    replica at every view and poll though nothing that frees a grammar slot had happened there. Now
    each is asked once; a view showing a running grammar ended gets it asked again (and admitted).
    Red without `parked` in `_now` (about 40 attempts within the first second)."""
    views = [view("a", free=20, max_queue_wait=5.0), view("b", free=20, max_queue_wait=5.0)]
    freed = {"a": False}

    def answer(t, w):
        if t == "a" and freed["a"]:
            from tests.cluster_util import admitted

            return admitted(t, max_queue_wait=5.0)
        return side_refusal(t, GRAMMAR, 5, max_queue_wait=5.0)

    d = dispatcher(views, answer)

    async def scenario():
        task = asyncio.ensure_future(d.dispatch(FakeCall(blocks=4)))
        await asyncio.sleep(1.0)
        assert not task.done() and sorted(d.handle.calls) == [("a", False), ("b", False)]
        assert d.counts.refused == 2
        freed["a"] = True  # a's schema-A rows ended: its view shows one grammar fewer running
        d.observe(view("a", version=3, free=20, max_queue_wait=5.0))  # grammars_running 0
        return await asyncio.wait_for(task, 2)

    assert run(scenario())[2] == "a" and len(d.handle.calls) == 3


def _grammars(snap, running: int):
    return dataclasses.replace(snap, grammars_running=running, grammars_kept=running)


def test_a_mix_of_side_refusals_and_full_replicas_is_answered_by_what_the_full_ones_lack():
    """a refuses for a grammar slot, b has no KV for it: the rows/KV answer comes from b's numbers alone
    and says a refused it for a grammar slot. Red with `_everyone_refused` counting a's free KV (it
    said batch_rows_unavailable, with no row busy anywhere)."""
    views = [view("a", free=20, max_queue_wait=0.3), view("b", free=2, max_queue_wait=0.3)]
    d = dispatcher(views, lambda t, w: side_refusal(t, GRAMMAR, 4, max_queue_wait=0.3))
    with pytest.raises(Refusal) as e:
        run(asyncio.wait_for(d.dispatch(FakeCall(blocks=4)), 5))
    r = e.value
    assert (r.code, d.handle.calls) == ("kv_memory_unavailable", [("a", False)])
    assert "per replica: 2/28 blocks free, 0/8 rows busy; 1 more refused it (grammar_memory_unavailable)" in (
        r.message
    )


def test_without_a_wait_the_replicas_own_side_refusal_passes_through():
    """--max-queue-wait 0: the replica's engine refuses at once with its own code; unchanged (green
    before and after: the QA pass saw this path right)."""
    views = [view("a", free=20), view("b", free=20)]
    d = dispatcher(views, lambda t, w: side_refusal(t, GRAMMAR, 2))
    with pytest.raises(Refusal) as e:
        run(d.dispatch(FakeCall(blocks=4)))
    assert (e.value.code, e.value.retry_after) == ("grammar_memory_unavailable", 1)


# ---- the cluster's own rows and KV 429s carry serve's numbers ----------------------------------------
@pytest.mark.parametrize("running, code", [(8, "batch_rows_unavailable"), (0, "kv_memory_unavailable")])
def test_the_clusters_own_429_carries_the_numbers_serve_gives(running, code):
    """The console's refusal panel reads estimated_bytes, limit_bytes, positions and positions_limit;
    serve's kv_timeout 429 has them. Red without `kv_numbers` in the cluster's 429 (all None), and,
    for the rows, with the message's "has no 1 batch rows free"."""
    free = 20 if running else 2
    views = [view(t, free=free, running=running, kv_bytes_per_token=1000) for t in ("a", "b")]
    d = dispatcher(views, lambda t, w: pytest.fail("no replica has room"))
    call = FakeCall(blocks=6)
    call.demand = Demand(6, 1, (), 90)
    with pytest.raises(Refusal) as e:
        run(d.dispatch(call))
    r = e.value
    assert r.code == code
    assert (r.positions, r.positions_limit) == (90, 28 * BLOCK)
    assert (r.estimated_bytes, r.limit_bytes) == (6 * BLOCK * 1000, 28 * BLOCK * 1000)
    if running:
        assert "has no batch row free" in r.message and "1 batch rows" not in r.message


def test_a_replicas_own_refusal_keeps_its_numbers_through_the_ingress():
    """Seen green before and after (the numbers crossed the wire already): a guard for the above."""
    body = refused("a", 2)[0][1]["refusal"] | {"positions": 90, "positions_limit": 448}
    d = dispatcher([view("a", free=20)], lambda t, w: [("refused", {"refusal": body, "view": view("a")})])
    with pytest.raises(Refusal) as e:
        run(d.dispatch(FakeCall()))
    assert (e.value.positions, e.value.positions_limit) == (90, 448)


# ---- one replica: what its engine did not admit within the bound waited for -------------------------
def _lp(max_tokens: int, prompt=(5, 6, 7, 8)) -> GenerationRequest:
    sp = SamplingParams(temperature=0.0, logprobs=20)
    return GenerationRequest(list(prompt), sp, max_tokens, ignore_eos=True, held=0)


def _schema_request(key: str, max_tokens: int) -> GenerationRequest:
    from kvgate.server.tools import JSON_STYLE
    from kvgate.structured.compiler import Grammar

    schema = {"type": "object", "properties": {key: {"type": "string", "minLength": 400}}}
    schema |= {"required": [key], "x-guidance": JSON_STYLE}
    g = Grammar("start: %json " + json.dumps(schema), None)  # as it comes from the ingress: its text
    return GenerationRequest(
        [5, 6, 7, 8], SamplingParams(temperature=0.0, grammar=g), max_tokens, ignore_eos=True
    )


def test_a_replica_says_what_an_attempt_waited_for_logprobs_memory_then_a_grammar_slot(tiny_dir):
    """A replica whose logprobs memory (then its one grammar slot) is held by a running request gets a
    `wait=False` attempt that needs some: its 429 names that budget with serve's numbers, and a plain
    request that finds no row is told batch_rows_unavailable. Red with `generate`'s TimeoutError
    branch building kv_memory_unavailable for all three ("needs 1 KV blocks and 20 of 28 are free")."""
    from kvgate.cluster.replica import KvgateReplica
    from tests.cluster_util import ENGINE

    pb = B.position_bytes(20)
    limit = 100 * pb + 8 * pb
    cfg = {**ENGINE, "max_queue_wait": 30.0, "logprobs_memory": limit, "max_grammars": 1, "max_seqs": 2}
    rep = KvgateReplica(str(tiny_dir), cfg, step_delay=0.02)

    async def first(gen):
        return await asyncio.wait_for(gen.__anext__(), 10)

    async def scenario():
        out = {}
        hog = rep.generate([_lp(100)], 1, False, Demand(7, 1))
        assert (await first(hog))[0] == "admitted"
        out["logprobs"] = await first(rep.generate([_lp(16)], 1, False, Demand(2, 1)))
        long = rep.generate([replica_plain(300)], 1, False, Demand(19, 1))
        assert (await first(long))[0] == "admitted"  # both rows (--max-seqs 2) are busy now
        out["rows"] = await first(rep.generate([replica_plain(4)], 1, False, Demand(1, 1)))
        for g in (hog, long):
            await g.aclose()
        hog = rep.generate([_schema_request("a", 200)], 1, False, Demand(13, 1))
        assert (await first(hog))[0] == "admitted"
        out["grammar"] = await first(rep.generate([_schema_request("b", 20)], 1, False, Demand(2, 1)))
        await hog.aclose()
        return out

    try:
        out = run(scenario())
    finally:
        rep.engine.shutdown()
    kinds = {k: m[0] for k, m in out.items()}
    assert kinds == {"logprobs": "refused", "grammar": "refused", "rows": "refused"}
    lp, gr, rows = (out[k][1]["refusal"] for k in ("logprobs", "grammar", "rows"))
    codes = [lp["code"], gr["code"], rows["code"]]
    assert codes == ["logprobs_memory_unavailable", "grammar_memory_unavailable", "batch_rows_unavailable"]
    assert (lp["code"], lp["estimated_bytes"], lp["limit_bytes"]) == (
        "logprobs_memory_unavailable",
        16 * pb,
        limit,
    )
    assert "admission bound" in lp["message"] and "--logprobs-memory" in lp["message"]
    assert gr["code"] == "grammar_memory_unavailable" and "--max-grammars" in gr["message"]
    assert gr["estimated_bytes"] and gr["limit_bytes"] == gr["estimated_bytes"]
    assert rows["code"] == "batch_rows_unavailable" and "2 of 2 are busy" in rows["message"]
    assert (rows["positions"], rows["positions_limit"]) == (BLOCK, 28 * BLOCK)
    assert rows["estimated_bytes"] and rows["limit_bytes"] == 28 * rows["estimated_bytes"]


def replica_plain(max_tokens: int) -> GenerationRequest:
    return GenerationRequest([5, 6, 7, 8], SamplingParams(temperature=0.0), max_tokens, ignore_eos=True)


def test_views_say_what_a_position_of_kv_costs(tiny_dir):
    """The ingress's numbers need it. Red without `kv_bytes_per_token` in `view_of` (0)."""
    from kvgate.cluster.replica import KvgateReplica
    from tests.cluster_util import ENGINE
    from tests.tiny_model import TINY_KV_BYTES_PER_TOKEN

    rep = KvgateReplica(str(tiny_dir), dict(ENGINE))
    try:
        assert rep._view().kv_bytes_per_token == TINY_KV_BYTES_PER_TOKEN
    finally:
        rep.engine.shutdown()
