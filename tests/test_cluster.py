"""kvgate on Ray Serve (issue 16), end to end: a local Ray Serve cluster of two tiny-model replicas,
started once (about 35 s on 2 cores) and driven over HTTP: which replica serves, the single 429, the
400 with the numbers, the OpenAI client, and a replica killed mid-stream. The routing logic alone is
tested, without Ray, in tests/test_cluster_units.py. Each test's docstring says how it was seen red.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.cluster_util import Stream, body
from tests.server_util import wait_until
from tests.tiny_model import TINY_KV_BYTES_PER_TOKEN

ray = pytest.importorskip("ray", reason="the cluster tests need the ray extra: pip install -e '.[ray]'")


@pytest.fixture(scope="module")
def cluster(tiny_dir):
    from tests.cluster_util import local_cluster

    with local_cluster(tiny_dir) as base:
        yield base


@pytest.mark.timeout(120)
def test_the_openai_client_works_unchanged_against_the_ingress(cluster):
    """Seen red with the ingress's `ServedBy` middleware not adding its header (KeyError below)."""
    from openai import OpenAI

    client = OpenAI(base_url=cluster + "/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
    )
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.prompt_tokens > 0
    pieces = list(
        client.completions.create(model="tiny", prompt="hello", max_tokens=6, stream=True, temperature=0)
    )
    assert pieces[-1].choices[0].finish_reason in ("stop", "length")
    raw = httpx.post(cluster + "/v1/completions", json=body(4, stream=False), timeout=30)
    assert raw.status_code == 200 and raw.headers["x-kvgate-replica"]
    # one X-Request-Id, the client's own when sent (QA pass 7: the app's and Serve's came both). Red with
    # the ingress keeping the app's header
    traced = httpx.post(
        cluster + "/v1/completions", json=body(2, stream=False), headers={"x-request-id": "t-7"}
    )
    assert traced.headers.get_list("x-request-id") == ["t-7"]
    assert len(raw.headers.get_list("x-request-id")) == 1
    assert raw.json()["usage"]["completion_tokens"] == 4
    metrics = httpx.get(cluster + "/metrics", timeout=10).text
    assert (
        "kvgate_cluster_replicas_ready 2.0" in metrics
        and 'kvgate_requests_total{endpoint="/v1/completions"' in metrics
    )
    assert httpx.get(cluster + "/health", timeout=10).json() == {
        "status": "ok",
        "replicas_ready": 2,
        "replicas": 2,
    }


@pytest.mark.timeout(120)
def test_logprobs_through_the_cluster_are_reserved_and_given_back(cluster):
    """A whole and a streamed chat answer with top_logprobs 5 through the ingress: the replicas reserve
    their logprobs and give them back once each stream has ended (the replica closes its handles; the
    ingress sums the replicas' held bytes). Seen red without the close in `KvgateReplica.generate`
    (the held bytes stayed up); and it found that a whole answer through the cluster had no logprobs at
    all (`RemoteCall._local` rebuilt each Token without them; red before that fix: content [])."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    chat.update(logprobs=True, top_logprobs=5, temperature=0, ignore_eos=True)
    whole = httpx.post(cluster + "/v1/chat/completions", json=chat, timeout=60)
    assert whole.status_code == 200 and len(whole.json()["choices"][0]["logprobs"]["content"]) == 8
    with httpx.stream(
        "POST", cluster + "/v1/chat/completions", json={**chat, "stream": True}, timeout=60
    ) as s:
        assert s.status_code == 200 and sum(1 for line in s.iter_lines() if '"top_logprobs"' in line) >= 8

    def held() -> float:
        for line in httpx.get(cluster + "/metrics", timeout=10).text.splitlines():
            if line.startswith("kvgate_logprobs_memory_held_bytes "):
                return float(line.split()[1])
        return -1.0

    assert wait_until(lambda: held() == 0.0, 15), held()
    # the budget is both replicas' (each 1/16 of its limit, at most 32 MiB), as the held bytes are summed
    budget = [
        ln
        for ln in httpx.get(cluster + "/metrics").text.splitlines()
        if ln.startswith("kvgate_logprobs_memory_bytes ")
    ]
    resources = httpx.get(cluster + "/v1/resources", timeout=10).json()
    assert budget and float(budget[0].split()[1]) == 2 * min(
        32 << 20, resources["ledger"]["limit_bytes"] // 2 // 16
    ), (
        budget,
        resources["ledger"]["limit_bytes"],
    )
    peak = [
        ln
        for ln in httpx.get(cluster + "/metrics").text.splitlines()
        if ln.startswith("kvgate_logprobs_memory_peak")
    ]
    assert peak and float(peak[0].split()[1]) >= 8 * (384 + 16 * 5), peak


@pytest.mark.timeout(120)
def test_structured_output_runs_through_the_cluster(cluster):
    """A json_schema answer through the ingress: the request reaches a replica with its grammar as text
    and the replica compiles it. Seen red before `compiler.bound` (a 500: "cannot pickle
    'builtins.LLTokenizer' object", the grammar sent with its compiler)."""
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 40,
        "temperature": 0,
    }
    chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    r = httpx.post(cluster + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"])["a"], bool)
    else:  # the tiny model may run out of tokens inside the object: what it wrote still follows the schema
        assert choice["message"]["content"].lstrip().startswith("{")


@pytest.mark.timeout(120)
def test_vllm_extras_run_through_the_cluster(cluster):
    """vLLM's request extras through the ingress (kvgate/server/vllm_extras.py): the token ids of a
    whole answer equal the streamed ones, an included stop token ends the text and the ids with its
    logprobs entry, and a salted prompt's second send is cached (the affinity, chained on the salt, sends
    it back to the replica that holds it) where an unsalted one of the same text is not. Red with the
    salt left out of the replicas' block hashes (`prompt_block_hashes`)."""
    base = {"prompt": "hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    base["return_token_ids"] = True
    whole = httpx.post(cluster + "/v1/completions", json=base, timeout=60).json()["choices"][0]
    with httpx.stream("POST", cluster + "/v1/completions", json={**base, "stream": True}, timeout=60) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert [t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"]] == whole["token_ids"]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == whole["prompt_token_ids"]
    stop = whole["token_ids"][3]
    cut = whole["token_ids"][: whole["token_ids"].index(stop) + 1]
    ask = {**base, "stop_token_ids": [stop], "include_stop_str_in_output": True, "logprobs": 0}
    got = httpx.post(cluster + "/v1/completions", json=ask, timeout=60).json()["choices"][0]
    assert got["token_ids"] == cut and len(got["logprobs"]["tokens"]) == len(cut)
    long = {"prompt": " ".join(f"w{i}" for i in range(40)), "max_tokens": 1, "temperature": 0}

    def cached(**extra):
        r = httpx.post(cluster + "/v1/completions", json={**long, **extra}, timeout=60).json()
        return r["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="t1") == 0
    assert cached(cache_salt="t1") > 0
    assert cached() == 0 and cached(cache_salt="t2") == 0


@pytest.mark.timeout(60)
def test_the_ingress_resources_add_up_the_replicas_and_say_the_plan_is_each_ones(cluster):
    """Two replicas of 8 rows: the cluster has 16 rows and twice one plan's KV blocks; the plan is
    labelled as each replica's; the KV cache's dtype is the replicas'. Red with `cluster_resources`
    passing the single server's scheduler through (max_seqs 8: a console read "running 0 / 8" of a
    16-row cluster), and with the ingress's engine lacking `kv_dtype` (every /v1/resources a 500)."""
    from tests.cluster_util import settle

    settle(cluster)
    r = httpx.get(cluster + "/v1/resources", timeout=10).json()
    per = r["plan"]["kv_blocks"]
    assert (r["scheduler"]["max_seqs"], r["scheduler"]["max_seqs_per_replica"]) == (16, 8)
    assert r["kv"]["blocks_total"] == 2 * per and "each replica (2 ready)" in r["plan"]["scope"]
    assert sum(v["kv_blocks_total"] for v in r["replicas"]) == r["kv"]["blocks_total"]
    assert r["kv"]["dtype"] == "float16"  # --kv-dtype auto on a CPU


@pytest.mark.timeout(120)
def test_a_request_that_fits_no_replica_gets_the_400_with_the_numbers(cluster):
    """Seen red with `ClusterEngine.submit_many` skipping `plan_entry`: the client got a 429 (no
    replica had room for 30 blocks) instead of the 400 that says it never will."""
    r = httpx.post(cluster + "/v1/completions", json=body(470, stream=False), timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "kv_budget_exceeded"
    assert (
        err["positions_limit"] == 448
        and err["limit_bytes"] == 448 * TINY_KV_BYTES_PER_TOKEN
        and "x-kvgate-replica" not in r.headers
    )


@pytest.mark.timeout(60)
def test_n_choices_that_fit_no_replica_get_the_400_with_the_numbers(cluster):
    """n past --max-seqs (8 here), and n choices that together never fit a replica's pool though one
    would: the single server's 400s, not a 429 to retry for ever (QA of session 37). Seen red with
    `ClusterEngine.submit_many` judging one choice: n=8 x 60 tokens, 429 kv_memory_unavailable)."""
    for n, max_tokens, code in ((9, 8, "too_many_choices"), (8, 60, "kv_budget_exceeded")):
        r = httpx.post(
            cluster + "/v1/completions", json={**body(max_tokens, stream=False), "n": n}, timeout=30
        )
        err = r.json()["error"]
        assert (r.status_code, err["code"]) == (400, code), err
        assert err["param"] == ("n" if code == "too_many_choices" else "max_tokens"), err
    assert f"{n} choices" in err["message"] and err["positions_limit"] == 448


@pytest.mark.timeout(120)
def test_a_full_replica_sends_the_next_request_to_the_other_with_no_429(cluster):
    """A holds one long request (all 28 blocks, 1 row); B two shorter ones (2 rows). Serve's
    power-of-two choice would send the next request to A (fewer in flight), where it gets a 429. Here
    it goes to B at the first try: not even a refusal inside the cluster. Seen red with `fits_now`
    always True and `rank_now` sorting by rows running (A was asked first and refused)."""
    from tests.cluster_util import route_attempts, settle

    settle(cluster)
    long = Stream(cluster, body(440))  # 4 prompt tokens + 440 = 28 blocks: the whole pool
    shorts = [Stream(cluster, body(100)) for _ in range(2)]
    try:
        assert long.status == 200 and all(s.status == 200 for s in shorts)
        assert {s.replica for s in shorts} != {long.replica}
        before = route_attempts(cluster)
        probe = httpx.post(cluster + "/v1/completions", json=body(8, stream=False), timeout=30)
        assert probe.status_code == 200, probe.text
        assert probe.headers["x-kvgate-replica"] != long.replica
        after = route_attempts(cluster)
        assert after["refused"] == before["refused"] and after["admitted"] == before["admitted"] + 1
    finally:
        for s in [long, *shorts]:
            s.close()


@pytest.mark.timeout(120)
def test_when_both_replicas_are_full_the_client_gets_one_429_with_the_smaller_retry_after(cluster):
    """A runs 440 steps, B 40 more steps: Retry-After ~10 s against ~1 s. Seen red with the cluster's
    429 taking the largest Retry-After (`max` for `min` in `routing.min_retry_after`: 22 s)."""
    from tests.cluster_util import replica_views, settle

    settle(cluster)
    a = Stream(cluster, body(440))  # 4 + 440 positions: 28 blocks, 440 steps
    b = Stream(cluster, body(40, prompt="a" + " a" * 399))  # 400 + 40 positions: 28 blocks, 40 steps
    try:
        assert a.status == 200 and b.status == 200 and a.replica != b.replica
        assert wait_until(
            lambda: all(v["kv_blocks_available"] == 0 for v in replica_views(cluster).values()), 10
        )
        views = replica_views(cluster)
        r = httpx.post(cluster + "/v1/completions", json=body(8, stream=False), timeout=30)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "kv_memory_unavailable"
        retry = int(r.headers["retry-after"])
        soon, late = views[b.replica]["retry_after"], views[a.replica]["retry_after"]
        assert late > soon + 3, views  # the two replicas' estimates are far apart...
        assert retry <= soon + 1, (
            retry,
            views,
        )  # ...and the 429 carries the smaller (+1: B's step time moves)
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(60)
def test_a_whole_answer_the_client_gave_up_on_is_counted_cancelled(cluster):
    """A non-streaming request admitted, then the client leaves: the ingress counts its choice as
    `cancelled`, as a single server does (QA pass 7's F5: the cluster counted it nowhere)."""
    import re

    from tests.cluster_util import settle

    def cancelled() -> float:
        text = httpx.get(cluster + "/metrics", timeout=10).text
        m = re.search(r'kvgate_request_finished_total\{finish_reason="cancelled"\} ([0-9.]+)', text)
        return float(m.group(1)) if m else 0.0

    settle(cluster)
    before = cancelled()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(cluster + "/v1/completions", json=body(400, stream=False), timeout=1.5)
    assert wait_until(lambda: cancelled() == before + 1, 15), cancelled()


@pytest.mark.timeout(150)
def test_a_killed_replica_ends_its_streams_with_the_stable_error_and_traffic_moves_then_returns(cluster):
    """Seen red with `RemoteCall._pump` letting the replica's failure escape: no choice got its
    `Finished`, so the stream never ended; and with the lost stream not counted in the metrics."""
    from tests.cluster_util import health, kill_replica, replica_views, settle

    settle(cluster)
    victim = Stream(cluster, body(440))
    survivor = Stream(cluster, body(200))
    assert victim.replica != survivor.replica
    time.sleep(0.5)
    kill_replica(victim.replica)
    assert wait_until(victim.done, 15), "the killed replica's stream did not end"
    events = [json.loads(x[6:]) for x in victim.lines if x.startswith("data: {")]
    assert victim.lines[-1] == "data: [DONE]" and events[-1]["error"]["code"] == "engine_error"
    # counted 200 (its header went out), so the metrics say it another way (red with neither counted)
    text = httpx.get(cluster + "/metrics", timeout=10).text
    assert 'kvgate_cluster_route_attempts_total{outcome="lost_mid_stream"} 1.0' in text
    assert 'kvgate_request_finished_total{finish_reason="error"} 1.0' in text
    after = [
        httpx.post(cluster + "/v1/completions", json=body(4, stream=False), timeout=30) for _ in range(3)
    ]
    assert all(r.status_code == 200 and r.headers["x-kvgate-replica"] == survivor.replica for r in after)
    assert not survivor.done() or survivor.lines[-1] == "data: [DONE]"
    survivor.close()

    def replaced():
        tags = set(replica_views(cluster))
        return len(tags) == 2 and victim.replica not in tags and health(cluster).get("replicas_ready") == 2

    assert wait_until(replaced, 60, 0.5), health(cluster)
    settle(cluster)
    pair = [Stream(cluster, body(300)) for _ in range(2)]  # the second goes where the first is not
    try:
        served = {s.replica for s in pair}
        assert len(served) == 2 and victim.replica not in served and all(s.status == 200 for s in pair)
    finally:
        for s in pair:
            s.close()


@pytest.mark.timeout(120)
def test_sigterm_drains_and_ends_the_streams_past_the_grace_as_length_with_usage(cluster):
    """What `kvgate cluster` does on SIGTERM (`cli.drain(grace)`, then `cli.shutdown`), as `kvgate serve`
    does: a new request and /health get 503 `shutting_down` with Retry-After, and the ingress logs the
    refusal by the client's X-Request-Id; a stream that ends inside the grace ends as usual; one still
    running at the grace's end ends then, with finish_reason length, its partial output, its usage
    and [DONE]; the drain reports none left, so the application's delete cuts nothing. Last in the
    module: the application is gone after it. Red with the ingress's old drain, which only waited: 1
    left at the grace, and the stream ran on past it into the delete's own wait (here to its 300
    tokens; QA's longer one was cut there with an SSE engine_error, no finish_reason, no usage),
    and, for the log line, without the ingress's logging configuration (0 refusal lines, as QA
    found). Before that, QA pass 7's F7: streams were cut with engine_error and new requests got
    Serve's plain-text 404."""
    from kvgate.cluster.cli import drain, shutdown
    from tests.cluster_util import settle

    grace = 2.0
    settle(cluster)
    usage = {"stream_options": {"include_usage": True}}
    long, short = Stream(cluster, {**body(300), **usage}), Stream(cluster, {**body(12), **usage})
    assert wait_until(lambda: sum('"text"' in x for x in long.lines) >= 2, 20)
    t0 = time.monotonic()
    left: list = []
    drainer = threading.Thread(target=lambda: left.append(drain(grace)), daemon=True)
    drainer.start()
    assert wait_until(lambda: httpx.get(cluster + "/health", timeout=5).status_code == 503, 10)
    late = httpx.post(
        cluster + "/v1/completions", json=body(4, stream=False), headers={"x-request-id": "drain-late-7"}
    )
    assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
    assert late.headers["retry-after"]
    drainer.join(grace + 40)
    shutdown(local=False)  # the CLI's next step: delete the application (nothing should be left to cut)
    assert wait_until(long.done, 15) and short.done()
    ended = time.monotonic() - t0
    for s, tokens in ((short, 12), (long, None)):
        events = [json.loads(x[6:]) for x in s.lines if x.startswith("data: {")]
        assert s.lines[-1] == "data: [DONE]" and not any("error" in e for e in events), s.lines[-3:]
        reasons = [c["finish_reason"] for e in events for c in e.get("choices", []) if c["finish_reason"]]
        assert reasons == ["length"], s.lines[-3:]
        n = events[-1]["usage"]["completion_tokens"]  # the usage chunk, last
        assert n == (tokens or n) and 0 < n < 300, n
    assert left == [0] and ended < grace + 8, (left, ended)
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    line = "request drain-late-7 refused: shutting_down, retry after 5 s"
    assert wait_until(lambda: any(line in f.read_text(errors="replace") for f in logs.rglob("*.err")), 10)
