"""The only way into the engine from another thread: commands, and the admission gate that guards them.

Callers never touch the worker's queue, rows or blocks. They put commands here (`Submit`, `Cancel`,
`Release`, `Drain`, `CancelAll`, `Stop`) and the worker takes them all at the top of each tick. The inbox owns
exactly three things of its own, all under its one lock (which the admission gate also holds while
it decides):
- `queued`: choices accepted and not yet out of the queue (the worker calls `left_queue` when a
  waiter is admitted, refused or cancelled): the gate's count for `--max-queue` under racing
  submitters (the worker trims what is left waiting past it, `Scheduler._trim`);
- `closed_reason`: set when the engine stops admitting (shutdown, death);
- the submissions the latest snapshot does not show yet (`pending`), which the TTFT forecast counts
  as ahead of a newcomer.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from kvgate.core.rows import WaitEntry
from kvgate.core.snapshot import WaiterView


@dataclass(slots=True)
class Submit:
    entry: WaitEntry
    seq: int


@dataclass(slots=True)
class Cancel:
    request_id: int


@dataclass(slots=True)
class Release:
    """A caller closed its handle: the request's logprobs reservation comes back (`RequestHandle.close`)."""

    request_id: int


@dataclass(slots=True)
class Drain:
    """Stop admitting: refuse every queued request now (503); running rows go on."""


@dataclass(slots=True)
class CancelAll:
    """Cancel every running row and every waiter (the end of a shutdown's grace)."""


@dataclass(slots=True)
class Stop:
    """Leave the worker loop."""


Command = Submit | Cancel | Release | Drain | CancelAll | Stop


class Inbox:
    def __init__(self) -> None:
        self.lock = threading.Condition(threading.Lock())
        self._commands: deque[Command] = deque()
        self.queued = 0
        self.closed_reason: str | None = None
        self._seq = 0
        self._pending: deque[tuple[int, WaiterView]] = deque()

    # ---- caller threads (hold `lock` around a check-then-accept) --------------------------------
    def accept(self, entry: WaitEntry, blocks: int) -> None:
        """Queue a submission the gate has approved. Call with `lock` held."""
        self._seq += 1
        self.queued += entry.choices
        self._pending.append((self._seq, entry.view(blocks)))
        self._commands.append(Submit(entry, self._seq))
        self.lock.notify_all()

    def pending(self, absorbed: int) -> list[WaiterView]:
        """Accepted submissions newer than the snapshot's `absorbed`. Call with `lock` held."""
        while self._pending and self._pending[0][0] <= absorbed:
            self._pending.popleft()
        return [v for _, v in self._pending]

    def put(self, command: Command) -> None:
        with self.lock:
            self._commands.append(command)
            self.lock.notify_all()

    def close(self, reason: str) -> None:
        with self.lock:
            if self.closed_reason is None:
                self.closed_reason = reason

    # ---- the worker -----------------------------------------------------------------------------
    def take(self, timeout: float) -> list[Command]:
        """Every command waiting, in order; waits up to `timeout` seconds for the first one."""
        with self.lock:
            if not self._commands and timeout > 0:
                self.lock.wait(timeout)
            out = list(self._commands)
            self._commands.clear()
            return out

    def left_queue(self, n: int = 1) -> None:
        with self.lock:
            self.queued -= n
