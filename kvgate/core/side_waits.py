"""What a queue head may wait for besides KV blocks and batch rows, and what it is told after waiting.

Two budgets are taken at admission next to KV: logprobs memory (`kvgate.core.logprob_budget`) and
grammar slots (`kvgate.structured.compiler.GrammarCompiler.acquire`: a request whose JSON schema or
tool list is not kept now needs a free slot, one already running or cached needs none). A head that
has its rows and KV but waits for either lets requests that need neither go first
(`kvgate.core.scheduler`); past `--max-queue-wait` it gets a 429 naming the budget, and the requests
behind it are told what held the line.
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


def grammar_timeout_refusal(g: Grammar, waited: float, retry_after: int) -> Refusal:
    kept, running = g.compiler.kept()
    slots = g.compiler.slots
    return Refusal(
        "grammar_memory_unavailable",
        f"waited {waited:.0f}s (--max-queue-wait) for a grammar slot: this server keeps {slots} structured-"
        f"output grammar{'s' if slots != 1 else ''} at once (--max-grammars, {fmt_bytes(GRAMMAR_BYTES)} each), "
        f"and {running} of the {kept} kept ran requests with other JSON schemas or tool lists the whole time. "
        "Retry after the Retry-After seconds, or send the schema or tools those requests use (requests "
        "with one schema share a slot); an operator can raise --max-grammars.",
        429,
        retry_after=retry_after,
        estimated_bytes=GRAMMAR_BYTES,
        limit_bytes=slots * GRAMMAR_BYTES,
    )
