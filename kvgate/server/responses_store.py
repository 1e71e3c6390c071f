"""The responses kept for `previous_response_id` and `GET` / `DELETE /v1/responses/{id}`.

OpenAI's Responses API keeps a response unless the request says `store: false`, and a client continues
a conversation by naming the last response (`previous_response_id`) instead of sending it again. The
store holds each response with the whole conversation that led to it, as compact JSON bytes: what it
counts is what it holds. It is bounded by `--responses-store` bytes (0: off), the least recently used
response going first, and says in `/v1/resources` how full it is and how many it has let go. Each kept
item (input or output) is also found by its own id (`item`), for the `item_reference` input items
clients send in place of an earlier turn's items (the AI SDK's OpenAI provider does by default). It lives
in the server process's memory, and on a CPU its bound is a term of the engine's memory plan (`kept
responses`, ledger role `responses`): `kvgate serve` sets the store's limit to the plan's term.
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict

from kvgate.units import fmt_bytes

DEFAULT_BYTES = 64 << 20


class ResponseStore:
    def __init__(self, limit_bytes: int = DEFAULT_BYTES):
        self.limit = limit_bytes
        # id -> (response, conversation, the ids of the items in both)
        self._items: OrderedDict[str, tuple[bytes, bytes, tuple[str, ...]]] = OrderedDict()
        self._holders: dict[str, list[str]] = {}  # item id -> the kept responses holding it, oldest first
        self.bytes = 0
        self.evicted = 0

    @property
    def on(self) -> bool:
        return self.limit > 0

    def put(self, response: dict, conversation: list) -> bool:
        """Keep `response` and the input items that led to it (earlier turns included); False when it
        is larger than the whole store (it is then not kept)."""
        rid = response["id"]
        conversation = with_ids(conversation)
        ids = tuple(i["id"] for i in conversation + _output(response) if isinstance(i, dict) and i.get("id"))
        record = (_dump(response), _dump(conversation), ids)
        size = _size(record)
        if size > self.limit:
            return False
        self.delete(rid)
        while self.bytes + size > self.limit:
            self._drop(next(iter(self._items)))
            self.evicted += 1
        self._items[rid] = record
        for item_id in ids:
            self._holders.setdefault(item_id, []).append(rid)
        self.bytes += size
        return True

    def item(self, item_id: str) -> dict | None:
        """The kept item (an input item or an output item of a kept response) with this id, or None."""
        return self.items({item_id}).get(item_id)

    def items(self, item_ids: set[str]) -> dict[str, dict]:
        """The kept items with these ids, by id (those not kept left out): each holding response's
        record decoded once, however many of the ids it holds (a turn names every earlier one)."""
        by_holder: dict[str, set[str]] = {}
        for item_id in item_ids:
            holders = self._holders.get(item_id)
            if holders:
                by_holder.setdefault(holders[-1], set()).add(item_id)
        found: dict[str, dict] = {}
        for rid, wanted in by_holder.items():
            response, conversation = self.get(rid)
            found.update((i["id"], i) for i in conversation + _output(response) if i.get("id") in wanted)
        return found

    def get(self, rid: str) -> tuple[dict, list] | None:
        """(the response, the conversation that led to it), or None; a read counts as a use."""
        record = self._items.get(rid)
        if record is None:
            return None
        self._items.move_to_end(rid)
        return json.loads(record[0]), json.loads(record[1])

    def response(self, rid: str) -> dict | None:
        """The response alone (its conversation left undecoded), or None; a read counts as a use."""
        record = self._items.get(rid)
        if record is None:
            return None
        self._items.move_to_end(rid)
        return json.loads(record[0])

    def delete(self, rid: str) -> bool:
        if rid not in self._items:
            return False
        self._drop(rid)
        return True

    def _drop(self, rid: str) -> None:
        record = self._items.pop(rid)
        self.bytes -= _size(record)
        for item_id in record[2]:  # an item another kept response holds stays found there
            holders = self._holders[item_id]
            holders.remove(rid)
            if not holders:
                del self._holders[item_id]

    def __contains__(self, rid: str) -> bool:
        return rid in self._items

    def summary(self) -> dict:
        return {
            "limit_bytes": self.limit,
            "bytes": self.bytes,
            "responses": len(self._items),
            "evicted": self.evicted,
        }

    def missing(self, rid: str, chaining: bool = False) -> str:
        """Why `rid` is not here, for a 404 (or, `chaining`, the 400 of a previous_response_id, which
        also says what to send instead)."""
        then = " Send the whole conversation in input instead." if chaining else ""
        if not self.on:
            return f"response {shown(rid)} is not stored: this server keeps no responses (--responses-store 0).{then}"
        return (
            f"response {shown(rid)} is not stored here: it was made with store: false, was larger than the "
            f"whole {fmt_bytes(self.limit)} --responses-store, was deleted or evicted ({self.evicted} evicted "
            f"so far), or was made by another server (a restart keeps none).{then}"
        )


def _output(response: dict) -> list:
    out = response.get("output")
    return out if isinstance(out, list) else []


def shown(rid: str, most: int = 64) -> str:
    """An id as an error message quotes it: at most `most` characters (a 100 KB id made a 100 KB error)."""
    return repr(rid) if len(rid) <= most else repr(rid[:most]) + f"... ({len(rid)} characters)"


PREFIX = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_"}


def with_ids(items: list) -> list:
    """The items, each with an `id` (the ones given keep theirs): `input_items` pages by them, and a
    later turn replays them."""
    out = []
    for item in items:
        if isinstance(item, dict) and not item.get("id"):
            item = {**item, "id": PREFIX.get(item.get("type") or "message", "item_") + uuid.uuid4().hex[:24]}
        out.append(item)
    return out


def listed(item: dict) -> dict:
    """An input item as OpenAI's `input_items` lists it: typed, with a status, text as parts."""
    item = {**item, "type": item.get("type") or "message"}
    if item["type"] == "message":
        kind = "output_text" if item.get("role") == "assistant" else "input_text"
        if isinstance(item.get("content"), str):
            item["content"] = [{"type": kind, "text": item["content"]}]
        item.setdefault("status", "completed")
    elif item["type"] in ("function_call", "function_call_output"):
        item.setdefault("status", "completed")
    return item


def page(items: list, after: str | None, limit: int, order: str) -> dict | None:
    """OpenAI's list object over `items` (`order` asc: oldest first), from after the item `after`;
    None when `after` is not one of them."""
    items = [listed(i) for i in (items if order == "asc" else items[::-1])]
    start = 0
    if after is not None:
        ids = [i.get("id") for i in items]
        if after not in ids:
            return None
        start = ids.index(after) + 1
    data = items[start : start + limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + limit < len(items),
    }


ENTRY_BYTES = 300  # an entry's own cost beside its JSON: the key, the tuple, two bytes objects, the dict slot
# an item id's cost in the index: its string (the tuple's and the key), the dict slot and its holders' list
ITEM_BYTES = 300


def _size(record: tuple[bytes, bytes, tuple[str, ...]]) -> int:
    return len(record[0]) + len(record[1]) + ENTRY_BYTES + sum(ITEM_BYTES + 2 * len(i) for i in record[2])


def _dump(value) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
