"""The one memory authority: every standing claim on a device's memory is a reservation here.

A reservation has a role (weights, kv_cache, workspace, overhead, cuda_graphs, logprobs, responses) and a
lifetime (model, session, step). Live reservations never exceed the limit; a refused reservation leaves the others untouched;
each reservation is released exactly once (a second release is a bug and raises).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kvgate.units import fmt_bytes

ROLES = ("weights", "kv_cache", "workspace", "overhead", "cuda_graphs", "logprobs", "responses")
LIFETIMES = ("model", "session", "step")


class LedgerRefusal(Exception):
    def __init__(self, role: str, nbytes: int, reserved: int, limit: int, holder: str):
        self.role, self.nbytes, self.reserved, self.limit = role, nbytes, reserved, limit
        super().__init__(
            f"cannot reserve {fmt_bytes(nbytes)} for {role} ({holder}): {fmt_bytes(reserved)} of the "
            f"{fmt_bytes(limit)} limit is already reserved, {fmt_bytes(max(0, limit - reserved))} free. "
            "Raise --memory-limit, pick a smaller --dtype, or lower --max-seqs / --prefill-chunk."
        )


@dataclass(eq=False)
class Reservation:
    ledger: MemoryLedger
    role: str
    lifetime: str
    nbytes: int
    holder: str
    released: bool = field(default=False)

    def release(self) -> None:
        self.ledger._release(self)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class MemoryLedger:
    def __init__(self, limit_bytes: int, device: str = "cpu"):
        if limit_bytes <= 0:
            raise ValueError(f"memory limit must be positive, got {limit_bytes}")
        self.limit = int(limit_bytes)
        self.device = device
        self._lock = threading.Lock()
        self._live: list[Reservation] = []
        self.reserved = 0
        self.peak = 0

    def reserve(self, role: str, nbytes: int, holder: str, lifetime: str = "model") -> Reservation:
        if role not in ROLES or lifetime not in LIFETIMES:
            raise ValueError(f"unknown role {role!r} or lifetime {lifetime!r}")
        if nbytes < 0:
            raise ValueError(f"a reservation cannot be negative ({nbytes})")
        with self._lock:
            if self.reserved + nbytes > self.limit:
                raise LedgerRefusal(role, nbytes, self.reserved, self.limit, holder)
            r = Reservation(self, role, lifetime, int(nbytes), holder)
            self._live.append(r)
            self.reserved += r.nbytes
            self.peak = max(self.peak, self.reserved)
            return r

    def _release(self, r: Reservation) -> None:
        with self._lock:
            if r.released:
                raise AssertionError(f"reservation {r.holder} ({r.role}) released twice")
            r.released = True
            self._live.remove(r)
            self.reserved -= r.nbytes

    @property
    def free(self) -> int:
        return self.limit - self.reserved

    def by_role(self) -> dict[str, int]:
        with self._lock:
            out = dict.fromkeys(ROLES, 0)
            for r in self._live:
                out[r.role] += r.nbytes
            return out

    def snapshot(self) -> list[dict]:
        with self._lock:
            return [
                {"role": r.role, "lifetime": r.lifetime, "bytes": r.nbytes, "holder": r.holder}
                for r in self._live
            ]
