"""What a queue head may wait for besides KV blocks and batch rows, and what it is told after waiting.

Two budgets are taken at admission next to KV: logprobs memory (`kvgate.core.logprob_budget`) and
grammar slots (`kvgate.structured.compiler.GrammarCompiler.acquire`: a request whose JSON schema or
tool list is not kept now needs a free slot, one already running or cached needs none). A head that
has its rows and KV but waits for either lets requests that need neither go first
(`kvgate.core.scheduler`); a head waiting for a slot holds the running grammar whose rows end soonest,
which takes no new rows until they have (`GrammarCompiler.hold_for_head`). Past `--max-queue-wait` it
gets a 429 naming the budget, and the requests behind it are told what held the line.
"""

from __future__ import annotations

from kvgate.request import Refusal
from kvgate.structured.compiler import GRAMMAR_BYTES, Grammar
from kvgate.units import fmt_bytes

HEAD_WAITS = {
    "logprobs": "waits for logprobs memory (--logprobs-memory)",
    "grammar": "waits for a grammar slot (--max-grammars: every one runs another schema or tool list)",
}


def grammar_of(entry) -> Grammar | None:
    """The grammar all the choices of a queue entry share, or None."""
    g = entry.handle.request.sampling.grammar
    return g if g is not None and g.compiler is not None else None


def grammar_waits(entry) -> bool:
    """Admitting `entry` now would need a grammar slot and none can be had."""
    g = grammar_of(entry)
    return g is not None and not g.compiler.can_pin(g.text)


def held_grammar(head) -> str | None:
    """The running grammar held for `head`, a head that waits for a slot (`hold_for_head`), or None."""
    return grammar_of(head).compiler.held


def waits_for_slot(entry, head: bool) -> bool:
    """`entry` (the head, or one behind a head that waits for a slot) waits for a slot itself: its
    grammar needs a new one, or it is the grammar held for the head. A waiter behind it with none, or
    with another running grammar, waits for something else (KV, rows, logprobs): its refusal says that."""
    return head or grammar_waits(entry)


def grammar_steps_left(state) -> dict[str, int]:
    """For each running grammar, the steps until its last row ends at the latest (rows run to their
    max_tokens): when its slot frees. Which grammar to hold for a head, and the Retry-After."""
    out: dict[str, int] = {}
    for r in state.running.values():
        if r.grammar_pin is not None:
            t = r.grammar_pin.text
            out[t] = max(out.get(t, 0), r.steps_left(state.prefill_chunk))
    return out


def grammar_timeout_refusal(
    g: Grammar, waited: float, retry_after: int, queued: int, bound: str = "--max-queue-wait"
) -> Refusal:
    """`queued`: the requests still waiting behind it; `bound`: what limited the wait (a cluster
    replica's attempt is bounded by its admission bound, `kvgate.cluster.refusals`)."""
    running, slots = g.compiler.kept()[1], g.compiler.slots
    whose = (
        "requests, this one's schema among them, held to free its slot for a request that came earlier"
        if g.text == g.compiler.held
        else "requests with other schemas"
    )
    return Refusal(
        "grammar_memory_unavailable",
        f"waited {waited:g}s ({bound}) for a grammar slot: this server keeps {slots} structured-"
        f"output grammar{'s' if slots != 1 else ''} (distinct JSON schemas or tool lists) at once "
        f"(--max-grammars, {fmt_bytes(GRAMMAR_BYTES)} each), and when this request gave up {running} of them "
        f"ran {whose} ({queued} request{'s' if queued != 1 else ''} still queued). Retry "
        "after the Retry-After seconds; requests with a schema that is running share its slot and do not "
        "wait. If this is frequent, ask the operator to raise --max-grammars.",
        429,
        retry_after=retry_after,
        estimated_bytes=GRAMMAR_BYTES,
        limit_bytes=slots * GRAMMAR_BYTES,
    )
