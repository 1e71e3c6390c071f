"""The responses kept for `previous_response_id` and `GET` / `DELETE /v1/responses/{id}`.

OpenAI's Responses API keeps a response unless the request says `store: false`, and a client continues
a conversation by naming the last response (`previous_response_id`) instead of sending it again. The
store holds each response with the whole conversation that led to it, as compact JSON bytes: what it
counts is what it holds. It is bounded by `--responses-store` bytes (0: off), the least recently used
response going first, and says in `/v1/resources` how full it is and how many it has let go. It lives
in the server process's memory, outside the engine's ledger (which plans the model, the step workspace
and the KV pool): size it with that in mind.
"""

from __future__ import annotations

import json
from collections import OrderedDict

DEFAULT_BYTES = 64 << 20


class ResponseStore:
    def __init__(self, limit_bytes: int = DEFAULT_BYTES):
        self.limit = limit_bytes
        self._items: OrderedDict[str, tuple[bytes, bytes]] = OrderedDict()  # id -> (response, conversation)
        self.bytes = 0
        self.evicted = 0

    @property
    def on(self) -> bool:
        return self.limit > 0

    def put(self, response: dict, conversation: list) -> bool:
        """Keep `response` and the input items that led to it (earlier turns included); False when it
        is larger than the whole store (it is then not kept)."""
        rid = response["id"]
        record = (_dump(response), _dump(conversation))
        size = len(record[0]) + len(record[1])
        if size > self.limit:
            return False
        self.delete(rid)
        while self.bytes + size > self.limit:
            _, (a, b) = self._items.popitem(last=False)
            self.bytes -= len(a) + len(b)
            self.evicted += 1
        self._items[rid] = record
        self.bytes += size
        return True

    def get(self, rid: str) -> tuple[dict, list] | None:
        """(the response, the conversation that led to it), or None; a read counts as a use."""
        record = self._items.get(rid)
        if record is None:
            return None
        self._items.move_to_end(rid)
        return json.loads(record[0]), json.loads(record[1])

    def delete(self, rid: str) -> bool:
        record = self._items.pop(rid, None)
        if record is None:
            return False
        self.bytes -= len(record[0]) + len(record[1])
        return True

    def summary(self) -> dict:
        return {
            "limit_bytes": self.limit,
            "bytes": self.bytes,
            "responses": len(self._items),
            "evicted": self.evicted,
        }

    def missing(self, rid: str) -> str:
        """Why `rid` is not here, and what to do, for a 404 or 400."""
        if not self.on:
            return (
                f"response {rid!r} is not stored: this server keeps no responses (--responses-store 0). "
                "Send the whole conversation in input instead of previous_response_id."
            )
        return (
            f"response {rid!r} is not stored here: it was made with store: false, deleted, evicted from the "
            f"{self.limit / (1 << 20):g} MiB --responses-store ({self.evicted} evicted so far), or made by "
            "another server (a restart keeps none). Send the whole conversation in input instead."
        )


def _dump(value) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
