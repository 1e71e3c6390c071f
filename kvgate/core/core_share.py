"""Step on fewer threads while other processes use this engine's cores, and on all of them again after.

A CPU decode step is ~200 short OpenMP regions, and each waits at its barrier for its slowest thread.
When another process takes one of the cores, every region waits for the thread that lost its core:
4 streams x 50 tokens took 0.42 s idle, 1.2-1.7 s beside a one-thread busy loop, and 0.69 s there at
`--threads 1` (session 31, 2 vCPUs). A row's numbers do not depend on the thread count (session 32:
SmolLM2's logprobs bit-equal at 1 and 2 threads, 1 and 3 rows, a 700-token prompt), so the count can
follow the load without changing what a request generates.

`CoreShare` reads the busy and stolen time of the CPUs this process may run on (/proc/stat) and the
process's own CPU time (/proc/self/stat); the difference is other processes' (and the hypervisor's),
in cores. `ThreadGovernor` runs on the worker between steps: once a PERIOD it gives up a thread for
each core other processes use past SHED, and takes one back only when their use falls under RESTORE
(at least 1 thread, at most `base`), after two periods in a row agree,
through `torch.set_num_threads` on the worker thread (the kernels read the count at every call).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger("kvgate.engine")

PERIOD = 1.0  # seconds between looks at the CPUs
# other processes' use, in cores past a whole number, that takes one of this engine's threads, and under
# which it is given back. Half a core of background load (a test runner) made one thread slower than
# two (QA pass 5: 0.76-0.85 s against 0.56-0.63 s), and one threshold for both flapped every 2 s
SHED = 0.8
RESTORE = 0.4


class CoreShare:
    """What else used this process's CPUs, in cores, between two calls of `others`: other processes,
    and this process's Python threads but the engine's worker (`worker`, a native thread id: the
    HTTP event loop and its helper threads). The worker's OpenMP team is native threads, not Python
    ones, so what is left of the process is the engine's. Streaming 12 clients on 2 cores took
    enough of them that two-row ticks ran 3x slower (QA pass 5's F1)."""

    def __init__(
        self, stat: str = "/proc/stat", own: str = "/proc/self/stat", tasks: str = "/proc/self/task"
    ):
        self.stat, self.own, self.tasks = stat, own, tasks
        self.cpus = {f"cpu{c}" for c in os.sched_getaffinity(0)}
        self.tick = os.sysconf("SC_CLK_TCK")
        self.worker: int | None = None
        self._side: dict[int, int] = {}  # Python thread id -> its CPU ticks at the last look
        self._side_total = 0  # ticks the side threads used, summed over the looks
        self._last = self._sample()

    def _side_ticks(self) -> int:
        """CPU ticks the Python threads but the worker used since the last look (a thread first
        seen counts from then)."""
        used, seen = 0, {}
        for t in threading.enumerate():
            tid = t.native_id
            if tid is None or tid == self.worker:
                continue
            try:
                with open(f"{self.tasks}/{tid}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:  # ended, or no such file here
                continue
            seen[tid] = int(fields[11]) + int(fields[12])
            used += seen[tid] - self._side.get(tid, seen[tid])
        self._side = seen
        return used

    def _sample(self) -> tuple[float, int, int]:
        busy = 0
        with open(self.stat) as f:
            for line in f:
                name, _, rest = line.partition(" ")
                if name in self.cpus:
                    v = [int(x) for x in rest.split()]
                    # user nice system idle iowait irq softirq steal: all but idle and iowait
                    busy += v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)
        with open(self.own) as f:
            fields = f.read().rpartition(")")[2].split()
        self._side_total += self._side_ticks()
        # utime + stime of the process, less what its side threads have used: the engine's own
        return time.monotonic(), busy, int(fields[11]) + int(fields[12]) - self._side_total

    def others(self) -> float:
        now = self._sample()
        (t0, busy0, own0), (t1, busy1, own1) = self._last, now
        self._last = now
        if t1 <= t0:
            return 0.0
        return max(0.0, (busy1 - busy0 - (own1 - own0)) / self.tick / (t1 - t0))


class ThreadGovernor:
    def __init__(
        self,
        base: int,
        share: CoreShare,
        set_threads: Callable[[int], None],
        cpus: int | None = None,
        period: float = PERIOD,
    ):
        self.base, self.share, self.set_threads, self.period = base, share, set_threads, period
        # a --threads above the CPUs is the user's choice: it is not shed for want of CPUs alone
        self.cpus = max(cpus or len(os.sched_getaffinity(0)), base)
        self.threads = base
        self.others = 0.0  # the last reading, in cores
        self._want: int | None = None
        self._next = time.monotonic() + period

    def wanted(self, others: float) -> int:
        down = self.cpus - math.floor(others + 1 - SHED)  # at most this many with others this busy
        up = self.cpus - math.floor(others + 1 - RESTORE)  # at least this many (RESTORE < SHED: up <= down)
        return max(1, min(self.base, max(up, min(down, self.threads))))

    def poll(self, now: float | None = None) -> None:
        """On the worker thread, between steps: look once a period, switch after two agreeing looks."""
        now = time.monotonic() if now is None else now
        if now < self._next:
            return
        self._next = now + self.period
        if getattr(self.share, "worker", 0) is None:  # the first look runs on the worker: it is the engine
            self.share.worker = threading.get_native_id()
        try:
            self.others = self.share.others()
        except Exception as exc:  # /proc unreadable (out of file descriptors...): never the worker's end
            log.warning(
                "--adaptive-threads stops at %d threads: reading the CPUs failed: %s", self.threads, exc
            )
            self._next = float("inf")
            return
        want = self.wanted(self.others)
        if want == self.threads or want != self._want:
            self._want = None if want == self.threads else want
            return
        log.info(
            "other processes used %.1f of this engine's %d CPUs at the last of two looks %.0fs apart: stepping "
            "on %d threads (was %d; --adaptive-threads off keeps %d)",
            self.others,
            self.cpus,
            self.period,
            want,
            self.threads,
            self.base,
        )
        self.set_threads(want)
        self.threads, self._want = want, None


CHOICES = ("auto", "on", "off")
INVARIANT_FORMATS = ("gguf", "gguf-q8act")  # kernels whose rows split by output, never by the sum


def governor_for(setting: str, device, weights_format: str, paged_attention: bool) -> ThreadGovernor | None:
    """The worker's governor, or None: `--adaptive-threads` auto is on for a CPU engine whose weights
    and decode attention run in kvgate's own kernels (their numbers measured the same at any thread
    count; the gather + SDPA decode path's are not: QA pass 6 saw a request's logprobs and seeded text
    change when the count dropped); `on` also adapts torch's ops, whose sums may split by thread (a
    row's last bits may then move)."""
    import torch

    from kvgate.memory.plan import PlanError

    if setting not in CHOICES:
        raise PlanError(f"--adaptive-threads {setting!r} is not one of {', '.join(CHOICES)}")
    on = setting == "on" or (setting == "auto" and weights_format in INVARIANT_FORMATS and paged_attention)
    if not on or getattr(device, "type", str(device)) != "cpu" or not os.path.exists("/proc/self/stat"):
        return None
    return ThreadGovernor(torch.get_num_threads(), CoreShare(), torch.set_num_threads)
