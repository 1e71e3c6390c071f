"""`truncation: "auto"` on the Responses API: the oldest conversation items dropped until it fits.

OpenAI's rule: when the input would overflow the model's context, items are dropped from the beginning
of the conversation. kvgate's whole KV pool is a ceiling of the same kind (a request it can never hold
is a 400 `kv_budget_exceeded`), so the conversation is cut to fit both. Here the `instructions` and any
system or developer message stay, a tool result whose call was dropped goes with it (a result without
its call is not a conversation a template can render), and at least one item must be left; otherwise the request goes on whole and gets the usual
`context_length_exceeded` 400 with its numbers.

The cut is found by a binary search over how many of the oldest items go, each candidate counted by
the chat template and tokenizer `/v1/tokenize` uses (off the event loop), so a conversation of n items
costs about log2(n) countings and one request, never a refused request per dropped item (QA pass 8's
review: one item at a time was quadratic, and counted every try as a refusal).
"""

from __future__ import annotations

import asyncio
import json

from kvgate.core.admission import group_blocks
from kvgate.server.context import ready_engine
from kvgate.server.errors import APIError
from kvgate.server.prepare import prepare_tokenize

KEPT_ROLES = ("system", "developer")


def droppable(messages: list[dict], origin: list[str]) -> list[int]:
    """The indices of the items `truncation: "auto"` may drop, oldest first."""
    return [
        i
        for i, (m, o) in enumerate(zip(messages, origin))
        if o != "instructions" and m.get("role") not in KEPT_ROLES
    ]


def without_oldest(messages: list[dict], origin: list[str], k: int) -> tuple[list[dict], list[str]] | None:
    """The conversation without its `k` oldest droppable items and the tool results that then lead
    it; None when nothing droppable would be left."""
    drop = droppable(messages, origin)
    cut = set(drop[:k])
    j = k
    while j < len(drop) and messages[drop[j]].get("role") == "tool":  # its call was dropped
        cut.add(drop[j])
        j += 1
    if j >= len(drop):
        return None
    keep = [i for i in range(len(messages)) if i not in cut]
    return [messages[i] for i in keep], [origin[i] for i in keep]


async def fit(request, chat: dict, origin: list[str]) -> tuple[list[dict], list[str]]:
    """`chat`'s messages (and their origins) cut to the fewest dropped items that fit the context and
    the KV pool with the output it asks for; unchanged when they fit, or when nothing droppable makes
    them fit."""
    state = request.app.state
    engine = ready_engine(state)
    cfg = engine.sched_cfg
    need = chat.get("max_completion_tokens") or 1  # unset: capped to what is left, at least one token

    async def fits(k: int) -> bool | None:
        got = without_oldest(chat["messages"], origin, k)
        if got is None:
            return None
        body = {"messages": got[0], "tools": chat.get("tools"), "tool_choice": chat.get("tool_choice")}
        raw = json.dumps({key: v for key, v in body.items() if v is not None}).encode()
        try:
            count = (await asyncio.to_thread(prepare_tokenize, raw, engine, state.settings))["count"]
        except APIError:  # the request's own error: the whole request reports it
            return None
        return count + need <= cfg.max_model_len and group_blocks(cfg, count, need) <= cfg.total_blocks

    if await fits(0) is not False:
        return chat["messages"], origin
    n = len(droppable(chat["messages"], origin))
    lo, hi = 1, n
    while lo < hi:  # the fewest k that fits, in [1, hi); hi: none does
        mid = (lo + hi) // 2
        if await fits(mid):
            hi = mid
        else:
            lo = mid + 1
    got = without_oldest(chat["messages"], origin, lo) if lo < n else None  # lo < n: lo fit
    return got if got is not None else (chat["messages"], origin)
