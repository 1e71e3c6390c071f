"""Fault injection over HTTP: a failed step fails only the requests in it, a failed row fails alone,
and a dead worker makes the server say so (503) instead of hanging anyone.

A step hook (`kvgate.core.testing.set_step_hook`) runs before every forward on the worker thread;
here it sleeps (so requests stay in flight long enough to aim at) and raises when a test arms it. It
sees the step's rows as the snapshot published just before the forward shows them.

Seen to fail (each break made in a copy of the tree, then restored):
- the step's except failing the whole engine (`fail_all`) instead of the rows in the step (the
  queued request got a 503): test_one_failed_step_fails_only_its_requests;
- the sampling loop outside a per-row try, as it was before this test (the sampler error killed the
  worker and the other row lost its stream): test_a_row_whose_sampler_raises_fails_alone;
- Engine._run without `fail_all` in its except (the running and waiting requests hung):
  test_a_dead_worker_answers_everyone_and_health_turns_503;
- sse_stream without the `[DONE]` after the error event: test_one_failed_step_fails_only_its_requests.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from kvgate.core.testing import set_step_hook
from tests.server_util import running_server
from tests.server_util import wait_until as shared_wait_until

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hello there"}]
TIMEOUT = httpx.Timeout(30.0)
ENGINE_ERROR = {
    "message": "generation failed inside the engine; the details are in the server log",
    "type": "server_error",
    "code": "engine_error",
    "param": None,  # always present, null here (OpenAI's body)
}
SECRET = "injected fault at /work/kvgate/secret_module.py:42 handle 0xdeadbeefcafe"


class Fault:
    """A step hook: every step sleeps `delay`; once armed, the next step whose rows satisfy `when`
    raises (once)."""

    def __init__(self, engine, delay=0.01):
        self.engine = engine
        self.delay = delay
        self.when = None
        self.fired = threading.Event()
        self.rows_failed: list[int] = []
        set_step_hook(engine, self)

    def arm(self, when):
        self.when = when

    def __call__(self, so):
        time.sleep(self.delay)
        rows = step_rows(self.engine, so)
        if self.when is not None and not self.fired.is_set() and self.when(rows):
            self.fired.set()
            self.rows_failed = [r.max_tokens for r in rows]
            raise RuntimeError(SECRET)


def step_rows(engine, so) -> list:
    """The rows of this step, as the snapshot published just before its forward shows them."""
    ids = set(so.request_ids)
    return [r for r in engine.snapshot().rows if r.request_id in ids]


def wait_until(pred, timeout=15.0):
    return shared_wait_until(pred, timeout)


def kv_all_free(engine) -> bool:
    snap = engine.snapshot()
    return snap.kv_blocks_available == snap.kv_blocks_total


class Call(threading.Thread):
    """One HTTP request on its own thread: non-streaming keeps the response, streaming keeps the lines."""

    def __init__(self, base, body, path=CHAT):
        super().__init__(daemon=True)
        self.base, self.body, self.path = base, body, path
        self.status = None
        self.json = None
        self.lines: list[str] = []
        self.error = None
        self.headers = {}

    def run(self):
        try:
            with httpx.Client(base_url=self.base, timeout=TIMEOUT) as c:
                if self.body.get("stream"):
                    with c.stream("POST", self.path, json=self.body) as r:
                        self.status, self.headers = r.status_code, dict(r.headers)
                        for ln in r.iter_lines():  # raises if the chunked body does not end cleanly
                            if ln:
                                self.lines.append(ln)
                else:
                    r = c.post(self.path, json=self.body)
                    self.status, self.headers, self.json = r.status_code, dict(r.headers), r.json()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def start(base, body, path=CHAT) -> Call:
    c = Call(base, body, path)
    c.start()
    return c


def finish(*calls: Call, timeout=40.0):
    for c in calls:
        c.join(timeout)
        assert not c.is_alive(), "a request hung"
        assert c.error is None, repr(c.error)


def events(call: Call) -> list:
    assert call.lines[-1] == "data: [DONE]", call.lines[-3:]
    return [json.loads(ln[6:]) for ln in call.lines[:-1]]


def test_one_failed_step_fails_only_its_requests(make_engine):
    """Two decoding requests (one non-streaming, one streaming) share the failing step; a third waits
    in the queue (max_seqs=2). The first two fail — HTTP 500 with the stable body, and an SSE error
    event then [DONE] — the third then runs to completion, blocks all come back, and the engine keeps
    serving."""
    engine = make_engine(max_seqs=2, block_size=16)
    fault = Fault(engine, 0.01)
    with running_server(engine) as (base, _):
        x = start(base, {"messages": MSG, "max_tokens": 101, "ignore_eos": True})
        y = start(base, {"messages": MSG, "max_tokens": 102, "ignore_eos": True, "stream": True})
        assert wait_until(lambda: engine.snapshot().running == 2)
        z = start(
            base,
            {
                "messages": MSG,
                "max_tokens": 20,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        assert wait_until(lambda: engine.snapshot().waiting == 1)
        fault.arm(lambda rows: len(rows) == 2 and all(r.generated >= 3 for r in rows))
        finish(x, y, z)
        assert fault.fired.is_set() and sorted(fault.rows_failed) == [101, 102]

        assert x.status == 500 and x.json == {"error": ENGINE_ERROR}
        assert y.status == 200
        ev = events(y)
        assert ev[-1] == {"error": ENGINE_ERROR}, ev[-1]
        assert not any(c.get("choices") and c["choices"][0].get("finish_reason") for c in ev[:-1])
        assert "injected" not in "".join(y.lines) and "Traceback" not in "".join(y.lines)

        assert z.status == 200
        ez = events(z)
        assert (
            ez[-2]["choices"][0]["finish_reason"] == "length" and ez[-1]["usage"]["completion_tokens"] == 20
        )

        assert wait_until(lambda: kv_all_free(engine))
        c = engine.snapshot().counters
        assert c.failed == 2 and c.aborted == 0
        assert c.kv_blocks_held == 0
        with httpx.Client(base_url=base, timeout=TIMEOUT) as cl:
            assert cl.get("/health").json() == {"status": "ok"}
            r = cl.post(CHAT, json={"messages": MSG, "max_tokens": 5, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
            assert "kvgate_failed_rows_total 2.0" in cl.get("/metrics").text


def test_a_fault_during_prefill_fails_that_request_and_frees_its_blocks(make_engine):
    """A long prompt in small prefill chunks: the fault lands while it is still prefilling."""
    engine = make_engine(prefill_chunk=16, block_size=16)
    fault = Fault(engine, 0.01)
    with running_server(engine) as (base, _):
        fault.arm(
            lambda rows: (
                len(rows) == 1 and rows[0].prefilling and rows[0].prompt_len - rows[0].prompt_left >= 32
            )
        )
        x = start(
            base,
            {"prompt": "lorem ipsum dolor " * 20, "max_tokens": 10, "ignore_eos": True},
            path="/v1/completions",
        )
        s = start(
            base,
            {"prompt": "lorem ipsum dolor " * 20, "max_tokens": 10, "ignore_eos": True, "stream": True},
            path="/v1/completions",
        )
        finish(x, s)
        assert fault.fired.is_set()
        failed = [c for c in (x, s) if c.status == 500 or (c.lines and "engine_error" in c.lines[-2])]
        assert len(failed) == 1
        ok = x if s in failed else s
        done = ok.json if ok is x else events(ok)[-1]
        assert (done["usage"]["completion_tokens"] if ok is x else done["choices"][0]["finish_reason"]) in (
            10,
            "length",
        )
        assert wait_until(lambda: kv_all_free(engine))
        assert engine.snapshot().counters.failed == 1


def test_a_row_whose_sampler_raises_fails_alone(make_engine):
    """Errors after the forward pass (sampling, stop matching) fail only their row; the worker lives."""
    engine = make_engine(block_size=16)
    state = {"done": False}

    def hook(so):
        time.sleep(0.01)
        for r in step_rows(engine, so):
            if r.max_tokens == 77 and r.generated >= 2 and not state["done"]:
                state["done"] = True

                def boom(token):
                    raise RuntimeError(SECRET)

                so.samplers[r.request_id].record = boom  # called for every sampled row, batched or alone

    set_step_hook(engine, hook)
    with running_server(engine) as (base, _):
        bad = start(base, {"messages": MSG, "max_tokens": 77, "ignore_eos": True})
        good = start(
            base,
            {
                "messages": MSG,
                "max_tokens": 60,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        finish(bad, good)
        assert bad.status == 500 and bad.json == {"error": ENGINE_ERROR}
        ev = events(good)
        assert ev[-1]["usage"]["completion_tokens"] == 60, ev[-1]
        assert engine.alive
        assert engine.snapshot().counters.failed == 1
        assert wait_until(lambda: kv_all_free(engine))


class WorkerDeath(BaseException):
    """Outside `except Exception`: what a KeyboardInterrupt/SystemExit-like error would be."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_worker_answers_everyone_and_health_turns_503(make_engine):
    """Running requests end (500 / SSE error + [DONE]), the waiting one gets a 503 with Retry-After,
    /health says dead, and a new request fails fast with 503 instead of hanging."""
    engine = make_engine(max_seqs=2, block_size=16, max_queue_wait=60)
    Fault(engine, 0.01)
    with running_server(engine) as (base, _):
        x = start(base, {"messages": MSG, "max_tokens": 200, "ignore_eos": True})
        y = start(base, {"messages": MSG, "max_tokens": 200, "ignore_eos": True, "stream": True})
        assert wait_until(lambda: engine.snapshot().running == 2)
        w = start(base, {"messages": MSG, "max_tokens": 10})
        assert wait_until(lambda: engine.snapshot().waiting == 1)

        def die():
            raise WorkerDeath("simulated fatal error in the worker loop")

        engine.core.tick = lambda commands: die()
        finish(x, y, w, timeout=20)
        assert not engine.alive
        assert x.status == 500 and x.json == {"error": ENGINE_ERROR}
        assert events(y)[-1] == {"error": ENGINE_ERROR}
        assert w.status == 503 and int(w.headers["retry-after"]) >= 1
        assert w.json["error"]["code"] == "engine_unavailable"
        assert kv_all_free(engine)

        with httpx.Client(base_url=base, timeout=TIMEOUT) as cl:
            h = cl.get("/health")
            assert h.status_code == 503 and h.json()["status"] == "dead"
            for body in (
                {"messages": MSG, "max_tokens": 5},
                {"messages": MSG, "max_tokens": 5, "stream": True},
            ):
                t0 = time.monotonic()
                r = cl.post(CHAT, json=body)
                assert time.monotonic() - t0 < 2.0, "a request to a dead engine was not refused at once"
                assert r.status_code == 503 and "retry-after" in r.headers
                assert r.json()["error"]["code"] == "engine_unavailable"
                assert not r.text.startswith("data:")
            assert cl.get("/metrics").status_code == 200
            # The waiter plus the two requests refused by the dead engine: every refusal counted once.
            assert 'kvgate_rejections_total{reason="engine_unavailable"} 3.0' in cl.get("/metrics").text


@pytest.mark.parametrize(
    "extra",
    [
        {"temperature": 1e-40},
        {"repetition_penalty": 1e-40, "temperature": 1.0},
        {"top_p": 5e-324, "temperature": 1.0},
    ],
    ids=["temperature-1e-40", "repetition-penalty-1e-40", "top-p-5e-324"],
)
def test_tiny_sampling_values_are_served_not_failed(make_engine, extra):
    """Valid but extreme sampling values, found by tests/test_fuzz.py's boundary phase: they must sample,
    not fail the row. Seen to fail before kvgate/sampling.py handled them (logits / T overflowed to inf,
    a tiny repetition_penalty likewise, and top_p=5e-324 compared as 0.0 in float32 and dropped every
    token): a 500 engine_error for a valid request."""
    engine = make_engine()
    with running_server(engine) as (base, _):
        with httpx.Client(base_url=base, timeout=TIMEOUT) as cl:
            r = cl.post(CHAT, json={"messages": MSG, "max_tokens": 4, "seed": 1, **extra})
            assert r.status_code == 200, (extra, r.text)
            assert engine.snapshot().counters.failed == 0


def test_a_failed_step_on_the_messages_api_is_anthropics_error(make_engine):
    """/v1/messages: the same failure is a 500 in Anthropic's body (`api_error`), or, streamed, an
    `error` event with no message_delta or message_stop after it; nothing of the fault leaks. Red with
    the stream's error chunk not read (message_delta and message_stop followed) (session 45's review read this path only)."""
    engine = make_engine(max_seqs=2, block_size=16)
    fault = Fault(engine, 0.01)
    body = {"model": "tiny", "messages": MSG, "max_tokens": 101, "temperature": 0}
    with running_server(engine) as (base, _):
        x = start(base, body, "/v1/messages")
        y = start(base, {**body, "max_tokens": 102, "stream": True}, "/v1/messages")
        assert wait_until(lambda: engine.snapshot().running == 2)
        fault.arm(lambda rows: len(rows) == 2 and all(r.generated >= 3 for r in rows))
        finish(x, y)
        assert x.status == 500 and x.json["type"] == "error" and x.json["error"]["type"] == "api_error"
        assert x.json["error"]["code"] == "engine_error"
        kinds = [ln[7:] for ln in y.lines if ln.startswith("event: ")]
        assert y.status == 200 and kinds[0] == "message_start" and kinds[-1] == "error", kinds
        assert "message_delta" not in kinds and "message_stop" not in kinds
        last = json.loads(y.lines[-1][6:])
        assert last["type"] == "error" and last["error"]["type"] == "api_error", last
        assert SECRET not in "".join(y.lines) + json.dumps(x.json)
