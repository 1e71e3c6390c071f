"""`kvgate cluster` on SIGTERM and its log, without Ray: the ingress's drain over scripted replicas, one
replica's engine draining in this process, and the ingress's and replicas' loggers in a fresh process
(as a Ray worker starts). The real cluster's SIGTERM path is tests/test_cluster.py's drain test. Each
test's docstring says how it was seen red.
"""

from __future__ import annotations

import asyncio
import contextvars
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest

from kvgate.cluster.routing import Demand
from kvgate.request import Finished, Refusal
from tests.cluster_util import ENGINE, FakeCall, view
from tests.test_cluster_units import dispatcher, replica_request, run

# stands for Serve's request context: the drain's own calls must not inherit it (Serve's router keys its
# pending calls by the context's request id, and two drains sent at once were matched to one replica)
CALLER: contextvars.ContextVar = contextvars.ContextVar("caller", default=None)


class DrainingReplicas:
    """Serve's handle to the replicas, for `drain.remote(grace, route=...)` only: each replica drains
    for the grace, then its rows end (`ended` is called: the ingress's streams finish)."""

    def __init__(self, ended):
        self.ended = ended
        self.asked: list[tuple[str, float]] = []

    @property
    def drain(self):
        return self

    def remote(self, grace, route=None):
        assert CALLER.get() is None, "sent inside the caller's request context"
        self.asked.append((route["target"], grace))

        async def answer():
            await asyncio.sleep(grace)
            self.ended(route["target"])
            return {"replica": route["target"], "running": 0}

        return answer()


def test_past_the_grace_the_ingress_has_every_replica_end_its_rows_and_none_is_left():
    """SIGTERM with a request running past --shutdown-grace: the ingress refuses new requests and asks
    every replica Serve lists, by name, to drain its engine for the grace; their rows end (as
    `length`, with usage: the replica's test below) and the ingress reports none left, so `kvgate
    cluster` deletes the application with no stream open. Red with the ingress's old drain, which only
    waited out the grace: {'left': 2} and no replica asked (the delete then cut the streams with
    engine_error, the QA finding), and with the calls sent inside the drain's own request context (on a
    real cluster, one of two replicas never got its drain: Serve's router keys calls by that id)."""
    from kvgate.cluster.facade import ClusterEngine
    from kvgate.cluster.ingress import KvgateIngress

    published = {"a": view("a"), "b": view("b")}
    state = SimpleNamespace(status="ready", in_flight=2)  # one stream on each replica

    def ended(_tag):
        state.in_flight -= 1

    replicas = DrainingReplicas(ended)
    ingress = SimpleNamespace(
        kvgate_app=SimpleNamespace(state=state), cluster=ClusterEngine(replicas, lambda: published)
    )
    t0 = time.monotonic()

    async def drained():
        CALLER.set("drain-call")  # as Serve sets the context of the ingress's `drain` call
        return await KvgateIngress.drain(ingress, 0.3)

    assert run(drained()) == {"left": 0}
    assert time.monotonic() - t0 < 2
    assert state.status == "shutting_down"
    assert sorted(replicas.asked) == [("a", 0.3), ("b", 0.3)]


def test_a_request_waiting_at_the_ingress_gets_503_shutting_down_when_the_drain_starts():
    """As the engine's `Drain` refuses its queue under `kvgate serve`: the ingress's FIFO is refused
    at once, not left to its --max-queue-wait (the replicas refuse it too once draining). Red with
    the `closed` checks taken out of `Dispatcher.dispatch` and `_queued` (a 429 after the 5 s wait)."""
    views = [view("a", free=0, max_queue_wait=5.0), view("b", free=0, max_queue_wait=5.0)]
    d = dispatcher(views, lambda t, w: pytest.fail("no replica has room"))

    async def scenario():
        task = asyncio.ensure_future(d.dispatch(FakeCall(blocks=4)))
        await asyncio.sleep(0.1)
        assert not task.done() and len(d.waiting) == 1
        t0 = time.monotonic()
        d.close()
        with pytest.raises(Refusal) as e:
            await asyncio.wait_for(task, 3)
        assert time.monotonic() - t0 < 0.5
        with pytest.raises(Refusal) as later:  # and a submission after it, at once
            await asyncio.wait_for(d.dispatch(FakeCall(blocks=4)), 1)
        return e.value, later.value

    for r in run(scenario()):
        assert (r.status, r.code, r.retry_after) == (503, "shutting_down", 5)
    assert d.waiting == []


def test_a_replica_drain_ends_its_running_row_at_the_grace_with_its_partial_output(tiny_dir):
    """What `Engine.shutdown(grace)` does under `kvgate serve`, on a replica: a row running past the
    grace ends `cancelled` (the client's finish_reason `length`) with the tokens it had and its usage,
    the stream ends cleanly, a new request is refused 503 shutting_down, and the replica still
    passes its health check (Serve must not replace it in the seconds before the delete). Red with
    no `KvgateReplica.drain` (AttributeError), and with `Engine.drain` not cancelling the rows at the
    grace (the row ran on: its 300 tokens, past the bound below)."""
    from kvgate.cluster.replica import KvgateReplica

    rep = KvgateReplica(str(tiny_dir), dict(ENGINE), step_delay=0.02)

    async def scenario():
        gen = rep.generate([replica_request(4, 300)], 1, False, Demand(20, 1))
        assert (await gen.__anext__())[0] == "admitted"
        msgs: list = []

        async def read():
            async for m in gen:
                msgs.append(m)

        reader = asyncio.ensure_future(read())
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        answer = await rep.drain(0.5)
        await asyncio.wait_for(reader, 5)
        late = [m async for m in rep.generate([replica_request(4, 2)], 1, False, Demand(1, 1))]
        return msgs, answer, time.monotonic() - t0, late

    try:
        msgs, answer, took, late = run(scenario())
        final = [ev for m in msgs for _, ev in m[1] if isinstance(ev, Finished)]
        assert len(final) == 1 and msgs[-1][2] is not None  # the last batch carries a fresh view
        res = final[0].result
        assert res.finish_reason == "cancelled" and 0 < res.completion_tokens < 300
        assert len(res.token_ids) == res.completion_tokens and res.text  # the partial output is kept
        assert 0.5 <= took < 3.0, took
        assert answer["running"] == 0
        rep.check_health()  # the worker runs on until Serve's delete
        assert late[0][0] == "refused" and late[0][1]["refusal"]["code"] == "shutting_down"
        assert late[0][1]["refusal"]["status"] == 503
    finally:
        rep.engine.shutdown()


# ---- the log ------------------------------------------------------------------------------------------
WORKER = textwrap.dedent(
    """
    import sys, types
    from kvgate.cluster.ingress import KvgateIngress
    from kvgate.cluster.replica import KvgateReplica
    from kvgate.server.auth import REQUEST_ID
    from kvgate.server.context import refused
    from tests.cluster_util import ENGINE

    level = sys.argv[2:] and {"log_level": sys.argv[2]} or {}
    user = KvgateIngress.__bases__[0]  # the class under Serve's ASGI wrapper, built as Serve builds it
    handle = types.SimpleNamespace(app_name="kvgate", deployment_name="KvgateReplica")
    user.__init__(user.__new__(user), handle, {}, **level)
    REQUEST_ID.set("req-7")
    count = types.SimpleNamespace(labels=lambda *a: count, inc=lambda: None)
    state = types.SimpleNamespace(
        metrics=types.SimpleNamespace(rejections=count),
        live=types.SimpleNamespace(record_refusal=lambda *a: None),
    )
    refused(state, "shutting_down", 5)
    KvgateReplica(sys.argv[1], dict(ENGINE), **level).engine.shutdown()
    """
)


def worker_log(tiny_dir, *level: str) -> str:
    """stderr of a fresh process (nothing configured logging, as in a Ray worker) that builds the
    ingress and a replica as Serve does, and has the ingress refuse request req-7."""
    out = subprocess.run(
        [sys.executable, "-c", WORKER, str(tiny_dir), *level],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stderr


def test_the_ingress_and_replicas_log_refusals_and_readiness_at_info_by_default(tiny_dir):
    """The cluster's ingress logs every refusal by its X-Request-Id at INFO, as `kvgate serve` does,
    and each replica its ready line. Red without `configure_logging` in their constructors: neither
    line (a Ray worker never configured the `kvgate` logger: 0 refusal lines on the cluster)."""
    err = worker_log(tiny_dir)
    assert "INFO kvgate.server: request req-7 refused: shutting_down, retry after 5 s" in err, err
    assert "INFO kvgate.cluster: kvgate replica" in err and " ready: " in err, err


def test_log_level_warning_quiets_them(tiny_dir):
    """--log-level reaches both. Red with the ingress and replica ignoring their log_level (the
    INFO lines stayed)."""
    err = worker_log(tiny_dir, "warning")
    assert "refused" not in err and " ready: " not in err, err


def test_kvgate_cluster_log_level_flag_reaches_the_options_and_both_deployments():
    """`kvgate cluster --log-level` (default info, as serve) is threaded to the ingress's and the
    replicas' constructors and to Serve's own logging config of each; a bad level is refused by the
    parser and by ClusterOptions (a Serve config file). Red without the flag (argparse exit 2)."""
    import argparse

    from kvgate.cluster.app import ClusterOptions, build
    from kvgate.cluster.cli import add_cluster_parser, options_from

    sub = argparse.ArgumentParser().add_subparsers(dest="cmd")
    add_cluster_parser(sub)
    parse = sub.choices["cluster"].parse_args
    assert options_from(parse(["--memory-limit", "1GiB"])).log_level == "info"
    opts = options_from(parse(["--memory-limit", "1GiB", "--log-level", "DEBUG"]))
    assert opts.log_level == "debug"
    ingress = build(opts)._bound_deployment
    replica = ingress.init_args[0]._bound_deployment
    assert ingress.init_args[-1] == replica.init_args[-1] == "debug"
    for d in (ingress, replica):
        assert d._deployment_config.logging_config["log_level"] == "DEBUG"
    with pytest.raises(SystemExit):
        parse(["--log-level", "loud"])
    with pytest.raises(ValueError, match="log level"):
        ClusterOptions(log_level="loud")
