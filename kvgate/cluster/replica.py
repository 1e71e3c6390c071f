"""One kvgate replica under Ray Serve: its own engine and memory limit, answering "admit now or refuse".

Serve runs N copies of `KvgateReplica`, each reserving its CPUs or GPU through Ray resources
(`ray_actor_options`, set in `kvgate.cluster.app`). Each builds an `Engine` in its constructor, so a
replica counts as ready (Serve routes to it) only once its model is loaded and its KV pool reserved.

What the ingress calls, through Serve's handle:
- `generate(requests, n, wait, demand, route)`: a streaming call. Its first message is the admission
  decision, `("admitted", ...)` or `("refused", ...)`; `route["token"]` names the ingress's attempt, and
  every view read after its admission lists it (`acked`), so the ingress drops its hold on the first
  such view whichever path brings it; then `("events", [(choice, Token|Finished)...])`
  until every choice has finished. With `wait=False` (the second phase of cluster admission) the
  engine must admit the request at its next tick (the step in flight plus one, `_admit_bound`), or
  the replica withdraws it and answers 429 with its Retry-After, naming what it waited for as a
  single server would (`kvgate.cluster.refusals.attempt_refusal`), and the ingress tries another
  replica (or keeps the request in its own queue). The engine decides, not an estimate: it alone
  knows how many of the prompt's blocks its prefix cache already holds. With `wait=True` (only the
  comparison baseline behind Serve's default router sends it) the request joins the engine's FIFO as
  under `kvgate serve`, up to `--max-queue-wait`. The admission message, and each batch holding a
  `Finished`, carry a fresh `ReplicaView`: the ingress learns of freed blocks without waiting for
  Serve's next stats poll.
- `record_routing_stats()`: Serve polls it every stats period and hands the view to the ingress's
  router (`kvgate.cluster.router`).
- `check_health()`: Serve's health check; raises when the engine worker died or a step is stalled,
  so Serve replaces the replica.
- `drain(grace)`: SIGTERM under `kvgate cluster` (the ingress calls each replica): the engine
  drains as under `kvgate serve`, and at the grace's end its running rows end as `length`.
- `describe()`: what the ingress needs to prepare requests without loading weights (the tokenizer,
  the scheduler limits, the memory plan).

Cancelling the stream (the client left, or the ingress gave up) cancels the engine requests at the
next step boundary. `step_delay` is a test-only knob: it sleeps before every forward pass (through
`kvgate.core.testing.set_step_hook`) so tests can keep requests in flight on a tiny model.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from kvgate.cluster.logs import configure as configure_logging
from kvgate.cluster.refusals import attempt_refusal
from kvgate.cluster.routing import Demand, admit_bound
from kvgate.cluster.views import view_of
from kvgate.request import Finished, Refusal, RequestError
from kvgate.sampling import SamplingError
from kvgate.server.serving import admit_all, submitted
from kvgate.structured.compiler import bound

log = logging.getLogger("kvgate.cluster")

ACKED = 256  # admitted attempts' tokens a view carries: more than can be in flight to one replica


def refusal_dict(r: Refusal) -> dict:
    """A `Refusal` as plain values (exceptions with keyword-only fields do not survive pickling)."""
    return {
        "code": r.code,
        "message": r.message,
        "status": r.status,
        "retry_after": r.retry_after,
        "param": r.param,
        **r.details(),
    }


def refusal_from(d: dict) -> Refusal:
    d = dict(d)
    return Refusal(d.pop("code"), d.pop("message"), d.pop("status"), **d)


def _replica_tag() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (unit tests): any stable name will do
        return f"local-{id(object()):x}"


class KvgateReplica:
    def __init__(self, model: str, engine: dict, step_delay: float = 0.0, log_level: str = "info"):
        from kvgate.config import EngineConfig
        from kvgate.core.engine import Engine

        configure_logging(log_level)  # `kvgate cluster --log-level`, as `kvgate serve`'s own
        self.tag = _replica_tag()
        self._acked: deque = deque(maxlen=ACKED)  # tokens of the attempts admitted lately
        self.engine = Engine.from_model(model, EngineConfig(**engine)).start()
        if step_delay > 0:  # test-only: keep requests in flight on a tiny model
            from kvgate.core.testing import set_step_hook

            set_step_hook(self.engine, lambda _so: time.sleep(step_delay))
        if self.engine.sched_cfg.max_ttft is not None:  # as `kvgate serve`: rates before the first request
            from kvgate.core.calibrate import calibrate_prefill

            log.info("kvgate replica %s: %s", self.tag, calibrate_prefill(self.engine))
        log.info("kvgate replica %s ready: %s", self.tag, self.engine.plan.describe(None).splitlines()[0])

    def _view(self):
        return view_of(self.engine, self.tag, tuple(self._acked))

    # ---- what Serve and the ingress read ------------------------------------------------------
    def describe(self) -> dict:
        eng = self.engine
        return {
            "replica": self.tag,
            "model_name": eng.info.model_name,
            "spec": eng.spec,
            "tokenizer": eng.tokenizer.info,
            "sched_cfg": eng.sched_cfg,
            "plan": eng.plan,
            "kv_dtype": eng.kv_dtype,  # /v1/resources names it (kv.dtype)
            "view": self._view(),
        }

    def record_routing_stats(self) -> dict:
        return {"kvgate": self._view()}

    def check_health(self) -> None:
        view = self._view()
        if not view.healthy:
            raise RuntimeError(f"kvgate replica {self.tag} is unhealthy: {view.reason}")

    async def drain(self, grace: float, route: dict | None = None) -> dict:
        """`kvgate cluster`'s SIGTERM, sent by the ingress to each replica (`route["target"]` names this
        one): `Engine.drain(grace)`, as `kvgate serve` does on a signal. Its queue is refused (503
        shutting_down), running rows get `grace` seconds, then end cancelled with their partial output
        (the client's finish_reason `length` and usage), and their streams close as any other. The
        worker runs on, so those last events and views still go out; Serve's delete stops it."""
        await asyncio.to_thread(self.engine.drain, grace)
        return {"replica": self.tag, "running": self.engine.snapshot().running}

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(0.0)

    # ---- one submission -------------------------------------------------------------------------
    def _admit_bound(self, view) -> float:
        """How long a `wait=False` request may take to be admitted (`routing.admit_bound`). Longer
        means there was no room after all, and it is refused."""
        return admit_bound(view)

    async def generate(self, requests: list, n: int, wait: bool, demand: Demand, route: dict | None = None):
        """See the module doc. `demand` and `route` are read by the ingress and its router: this
        replica's engine decides for itself (it alone knows the blocks a prompt shares with its
        prefix cache)."""
        eng = self.engine
        view = self._view()
        try:
            if not view.healthy:
                raise Refusal(
                    "engine_unavailable",
                    f"this replica is not healthy ({view.reason}); retry against another replica",
                    503,
                    retry_after=5,
                )
            handles = await submitted(eng, requests, n, submit=_submit_many)
        except Refusal as r:
            yield ("refused", {"refusal": refusal_dict(r), "view": self._view()})
            return
        except (RequestError, SamplingError) as exc:
            yield ("invalid", {"message": str(exc), "param": exc.param})
            return
        finished = set()
        try:
            try:
                admission = admit_all(handles)
                if not wait:
                    admission = asyncio.wait_for(admission, self._admit_bound(view))
                admitted = await admission
                token = (route or {}).get("token")
                if token is not None:  # before the view is read: every later view includes it
                    self._acked.append(token)
            except TimeoutError:
                v = self._view()  # what it waited for, as the engine would have said (cluster.refusals)
                refusal = attempt_refusal(eng.sched_cfg, handles, demand, v, self._admit_bound(view))
                yield ("refused", {"refusal": refusal_dict(refusal), "view": v})
                return
            except Refusal as r:
                yield ("refused", {"refusal": refusal_dict(r), "view": self._view()})
                return
            view = self._view()
            yield ("admitted", {"admitted": admitted, "seq": view.admitted, "view": view})
            async for batch in _batches(handles):
                done = [i for i, ev in batch if isinstance(ev, Finished)]
                finished.update(done)
                yield ("events", batch, self._view() if done else None)
        finally:
            if len(finished) < len(handles):  # the caller left (or this replica is stopping)
                for h in handles:
                    h.cancel()
            for h in handles:  # every event is sent: their logprobs are the ingress's now
                h.close()


async def _batches(handles):
    """Lists of (choice, event), in order, until every handle has finished. One handle's events
    that are already there go out together: a Serve stream item costs far more than a token."""
    if len(handles) == 1:
        h = handles[0]
        while True:
            batch = [(0, await h.events.aget())]
            while not isinstance(batch[-1][1], Finished):
                try:
                    batch.append((0, h.events.get(timeout=0)))
                except TimeoutError:
                    break
            yield batch
            if isinstance(batch[-1][1], Finished):
                return
    from kvgate.server.sse import merged_events

    async for i, ev in merged_events(handles):
        yield [(i, ev)]


def _submit_many(eng, requests: list, n: int) -> list:
    """`Engine.submit_many` as is: the replica reports an invalid field itself (a 400 at the ingress).
    A grammar comes as its text and is compiled here, by this replica's compiler (cached)."""
    return eng.submit_many([bound(eng, r) for r in requests], n)
