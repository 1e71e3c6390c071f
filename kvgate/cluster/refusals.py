"""The cluster's 429s: what a replica says when its engine did not admit an attempt in time, and the one
429 the ingress gives when no replica took a request. Each names what the request waited for, with the
code, numbers and Retry-After `kvgate serve` gives for the same wait (docs/DEPLOY.md, section 4).

A replica's attempt (`wait=False`) has its admission bound (`routing.admit_bound`) where a single
server's request has `--max-queue-wait`: past it `attempt_refusal` reads why the engine did not admit it,
in the scheduler's order: logprobs memory (`--logprobs-memory`), a grammar slot (`--max-grammars`),
then batch rows or KV (before, every such attempt was told `kv_memory_unavailable`).

The ingress (`cluster_refusal`) keeps the last refusal each replica gave a request while it waited.
When every ready replica's last refusal was for the same side budget (a grammar slot or logprobs
memory), that refusal is the answer: blocks and rows were not what it waited for (QA: a request
waiting for a grammar slot was told `batch_rows_unavailable`, "raise --max-seqs"). Otherwise the
answer is built from the views of the replicas that did not refuse it for a side budget: rows where
one of them had the KV blocks, else KV, with the numbers a single server's 429 carries.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from kvgate.cluster import routing
from kvgate.cluster.views import ReplicaView
from kvgate.core import admission, forecast, logprob_budget, side_waits
from kvgate.request import Refusal

log = logging.getLogger("kvgate.cluster")

SIDE = ("logprobs_memory_unavailable", "grammar_memory_unavailable")  # budgets besides blocks and rows
ATTEMPT_BOUND = (
    "this replica's admission bound; the cluster's ingress tries the replicas again until --max-queue-wait"
)


def _rows(n: int) -> str:
    return f"{n} batch row{'s' if n != 1 else ''}"


def _blocks(n: int) -> str:
    return f"{n} KV block{'s' if n != 1 else ''}"


def kv_numbers(demand: routing.Demand, views: list[ReplicaView]) -> dict:
    """What a single server's KV or rows 429 carries: the request's positions and KV bytes, against
    one replica's pool (the largest, where they differ)."""
    if not views:
        return {}
    v = max(views, key=lambda v: v.blocks_total)
    bs, bpt = v.block_size, v.kv_bytes_per_token
    out = {
        "positions": demand.positions or demand.blocks * bs,
        "positions_limit": v.blocks_total * bs,
    }
    if bpt:
        out.update(estimated_bytes=demand.blocks * bs * bpt, limit_bytes=v.blocks_total * bs * bpt)
    return out


def logprobs_need(cfg, handles) -> int:
    """The logprobs bytes admitting `handles` reserves (the scheduler's `reserved_bytes`, at each
    choice's max_tokens as its queue entry has it)."""
    need = 0
    for h in handles:
        req = h.request
        if req.sampling.logprobs is None and req.prompt_logprobs is None and req.logprobs_bytes is None:
            continue
        mt = req.max_tokens if req.max_tokens is not None else admission.plan_entry(cfg, h).max_tokens
        need += logprob_budget.reserved_bytes(req, mt)
    return need


def attempt_refusal(cfg, handles, demand: routing.Demand, view: ReplicaView, waited: float) -> Refusal:
    """The 429 of a `wait=False` attempt the engine (`cfg`: its scheduler's config) did not admit
    within `waited` seconds; `view` is the replica's fresh view. Reads only what other threads may
    read: the published snapshot and the grammar compiler (locked)."""
    retry = view.retry_after
    free_blocks, busy = max(0, view.blocks_available), view.running
    side = None
    # the scheduler's order (`Scheduler._admit`): a waiter is looked at only while a batch row is free,
    # then its KV; logprobs memory and a grammar slot only after both
    if view.max_seqs - busy >= demand.rows and free_blocks >= demand.blocks:
        try:
            side = _side_refusal(cfg, handles, view, waited)
        except Exception:  # never worse than the rows/KV answer: a failure here would lose the replica
            log.exception("kvgate replica %s: reading what an attempt waited for failed", view.replica)
    if side is not None:
        return side
    if free_blocks >= demand.blocks and view.max_seqs - busy < demand.rows:
        code = "batch_rows_unavailable"
        why = f"the {_blocks(demand.blocks)} it needs are free ({free_blocks} of {view.blocks_total}) but it needs "
        why += f"{_rows(demand.rows)} and {busy} of {view.max_seqs} are busy (--max-seqs)"
        fix = "Retry after the Retry-After interval."
    else:
        code = "kv_memory_unavailable"
        why = f"it needs {demand.blocks} KV blocks and {free_blocks} of {view.blocks_total} are free "
        why += f"({busy} of {view.max_seqs} rows busy)"
        fix = "Retry after the Retry-After interval, or lower max_tokens."
    return Refusal(
        code,
        f"no room for this request right now: {why}. {fix}",
        429,
        retry_after=retry,
        **kv_numbers(demand, [view]),
    )


def _side_refusal(cfg, handles, view: ReplicaView, waited: float) -> Refusal | None:
    """The logprobs-memory or grammar-slot 429, when admitting `handles` needs one the replica lacks
    now. An estimate from outside the worker: a logprobs request that waited behind another one
    waiting for logprobs memory (the scheduler keeps those in FIFO order), with enough free for
    itself, is told rows or KV."""
    snap, retry = view.snapshot, view.retry_after
    need = logprobs_need(cfg, handles)
    free = cfg.logprobs_memory - (snap.logprobs_bytes_held if snap is not None else 0)
    if need and need > free:  # when enough comes back, as serve's logprobs 429 (`forecast.logprobs_steps`)
        steps = forecast.logprobs_steps(snap, need, cfg.logprobs_memory) if snap is not None else None
        lp_retry = retry if steps is None else forecast.retry_after_steps(snap, steps, view.max_queue_wait)
        return logprob_budget.timeout_refusal(
            need, max(0, free), cfg.logprobs_memory, waited, lp_retry, ATTEMPT_BOUND
        )
    steps = getattr(snap, "grammar_slot_steps", 0) if snap is not None else 0
    # as serve's `slot_retry`: when the held grammar's slot frees, not when the soonest row of any kind ends
    slot_retry = forecast.retry_after_steps(snap, steps, view.max_queue_wait) if steps else retry
    for h in handles:
        g = h.request.sampling.grammar
        if g is not None and g.compiler is not None and not g.compiler.can_pin(g.text):
            return side_waits.grammar_timeout_refusal(g, waited, slot_retry, view.waiting, ATTEMPT_BOUND)
    return None


def _soonest(prefix: str, refusals: Iterable[Refusal], view_retry: int | None) -> Refusal:
    """The refusal with the smallest Retry-After (a 429 before a 503: "later" beats "unavailable"),
    its message after `prefix`; `view_retry`: a sooner Retry-After the views say, if they say one."""
    refusals = list(refusals)
    pool = [r for r in refusals if r.status == 429] or refusals
    best = min(pool, key=lambda r: r.retry_after if r.retry_after is not None else 1 << 30)
    retry = best.retry_after
    if view_retry is not None:
        retry = min(view_retry, retry) if retry is not None else view_retry
    details = best.details()
    if retry != best.retry_after:  # another replica's view says sooner: its milliseconds no longer hold
        details.pop("retry_after_ms", None)
    return Refusal(
        best.code, prefix + best.message, best.status, retry_after=retry, param=best.param, **details
    )


def cluster_refusal(
    demand: routing.Demand, refusals: dict[str, Refusal], views: list[ReplicaView], waited: float = 0
) -> Refusal:
    """One 429 for the whole cluster. `refusals`: the last refusal each replica gave (by tag);
    `waited`: the ingress's --max-queue-wait, 0 when the request did not wait (then the refusal with
    the smallest Retry-After is the answer, or, when no replica was asked, one built from the views)."""
    if refusals and not waited:
        n = len(refusals)
        head = f"every kvgate replica refused this request ({n} asked); the soonest: "
        return _soonest(head, refusals.values(), routing.min_retry_after(views))
    ready = {v.replica for v in views}
    side = {t: r for t, r in refusals.items() if t in ready and r.code in SIDE}
    others = [v for v in views if v.replica not in side]
    codes = " or ".join(sorted({r.code for r in side.values()}))
    if side and not others:  # what it waited for on every replica: not blocks or rows
        head = (
            f"no kvgate replica admitted this request within {waited:g}s (--max-queue-wait): each of the "
            f"{len(side)} refused it ({codes}); the soonest: "
        )
        return _soonest(head, side.values(), None)
    return _from_views(demand, others, waited, f"; {len(side)} more refused it ({codes})" if side else "")


def _from_views(d: routing.Demand, views: list[ReplicaView], waited: float, also: str) -> Refusal:
    # what each replica lacks: KV, or batch rows (--max-seqs) with KV to spare. Rows only: lowering
    # max_tokens cannot help, and the code says so (as an engine's own kv_timeout does)
    kv_short = [v for v in views if v.blocks_available < d.blocks]
    rows_only = bool(views) and len(kv_short) < len(views)
    per = ", ".join(
        f"{max(0, v.blocks_available)}/{v.blocks_total} blocks free, {v.running}/{v.max_seqs} rows busy"
        for v in views
    )
    busy = sum(1 for v in views if v.waiting > 0)
    when = f"within {waited:g}s (--max-queue-wait)" if waited else "now"
    if rows_only:
        rows = "no batch row" if d.rows == 1 else f"fewer than {_rows(d.rows)}"
        lack = f"every replica that has the {_blocks(d.blocks)} it needs free has {rows} free"
        fix = "Retry after the Retry-After interval."
    else:
        lack = f"it needs {d.blocks} KV blocks and {_rows(d.rows)} on one replica"
        fix = "Retry after the Retry-After interval, or lower max_tokens."
    return Refusal(
        "batch_rows_unavailable" if rows_only else "kv_memory_unavailable",
        f"no kvgate replica had room for this request {when}: {lack}; per replica: {per}"
        + (f"; {busy} replicas have requests already waiting" if busy else "")
        + also
        + f". {fix}",
        429,
        retry_after=routing.min_retry_after(views),
        **kv_numbers(d, views),
    )
