"""Prometheus metrics, names prefixed `kvgate_`, one registry per app.

Request-level counters and latency histograms are observed by the HTTP layer; engine state (rows,
queue, KV blocks, ledger) is read from the engine at scrape time, so it can never drift from the
source. Nothing unmeasured is reported as 0: before the engine has loaded, engine metrics are absent.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# `*_created` series (a timestamp per counter and histogram) only add noise to every scrape.
disable_created_metrics()

_LAT = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_ITL = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)


class Metrics:
    def __init__(self, get_engine):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvgate_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.rejections = Counter(
            "kvgate_rejections", "Refused requests by reason (each counted once)", ["reason"], registry=r
        )
        self.ttft = Histogram(
            "kvgate_time_to_first_token_seconds", "Submit to first token", buckets=_LAT, registry=r
        )
        self.itl = Histogram(
            "kvgate_inter_token_latency_seconds", "Gap between tokens", buckets=_ITL, registry=r
        )
        self.e2e = Histogram(
            "kvgate_e2e_request_latency_seconds", "Submit to finish", buckets=_LAT, registry=r
        )
        self.queue = Histogram("kvgate_queue_time_seconds", "Submit to admission", buckets=_LAT, registry=r)
        # how admitted requests ended: a stream that fails after its 200 header (a step error, a cluster
        # replica lost mid-stream) is counted 200 in kvgate_requests, and here as `error`
        self.finished = Counter(
            "kvgate_request_finished",
            "Admitted requests (each choice) by how they ended: stop, length, cancelled, error",
            ["finish_reason"],
            registry=r,
        )
        r.register(_EngineCollector(get_engine))

    def observe_result(self, result) -> None:
        self.finished.labels(result.finish_reason).inc()
        if result.admitted_at is not None:
            self.queue.observe(result.admitted_at - result.submitted_at)
        if result.first_token_at is not None:
            self.ttft.observe(result.first_token_at - result.submitted_at)
        t = result.token_times
        for a, b in zip(t, t[1:]):
            self.itl.observe(b - a)
        self.e2e.observe(result.finished_at - result.submitted_at)


class _EngineCollector:
    def __init__(self, get_engine):
        self.get_engine = get_engine

    def collect(self):
        engine = self.get_engine()
        if engine is None:
            return
        snap = engine.snapshot()
        c = snap.counters
        plan = engine.plan

        def gauge(name, doc, value):
            g = GaugeMetricFamily(f"kvgate_{name}", doc)
            g.add_metric([], value)
            return g

        def counter(name, doc, value):
            m = CounterMetricFamily(f"kvgate_{name}", doc)
            m.add_metric([], value)
            return m

        yield gauge("requests_running", "Rows holding KV blocks (prefilling or decoding)", snap.running)
        yield gauge("requests_waiting", "Requests in the FIFO queue", snap.waiting)
        yield gauge("kv_blocks_total", "KV blocks in the pool", snap.kv_blocks_total)
        yield gauge("kv_blocks_free", "KV blocks neither referenced nor cached", snap.kv_blocks_free)
        yield gauge(
            "kv_blocks_referenced",
            "KV blocks held by running requests (a shared one counted once)",
            snap.kv_blocks_held,
        )
        yield gauge(
            "kv_blocks_cached",
            "KV blocks kept by the prefix cache, referenced by none, evictable",
            snap.kv_blocks_cached,
        )
        yield gauge(
            "kv_blocks_peak", "Most KV blocks ever held at once (counted from rows)", c.kv_blocks_peak
        )
        yield gauge("kv_block_size", "Tokens per KV block", plan.block_size)
        yield gauge(
            "kv_usage_ratio", "Reserved KV blocks / total", snap.kv_blocks_held / snap.kv_blocks_total
        )
        yield gauge("kv_bytes_per_token", "KV bytes per token position", plan.kv_bytes_per_token)
        yield gauge("memory_limit_bytes", "The ledger's memory limit", engine.ledger.limit)
        # a cluster's ingress: every ready replica's budget (their held bytes are summed too)
        budget = getattr(engine, "logprobs_memory", None) or getattr(
            engine.sched_cfg, "logprobs_memory", None
        )
        if budget is not None:
            yield gauge(
                "logprobs_memory_bytes", "Bytes requests' logprobs may hold (--logprobs-memory)", budget
            )
        yield gauge(
            "logprobs_memory_held_bytes",
            "Bytes reserved for requests' logprobs, from admission until the response is sent",
            snap.logprobs_bytes_held,
        )
        yield gauge(
            "logprobs_memory_peak_bytes",
            "Most logprobs bytes ever reserved at once",
            snap.logprobs_bytes_peak,
        )
        slots = getattr(engine, "grammar_slots", None)  # a cluster's ingress: every ready replica's
        yield gauge(
            "grammar_slots",
            "Distinct structured-output grammars kept at once (--max-grammars)",
            plan.limits.grammars if slots is None else slots,
        )
        yield gauge(
            "grammars_kept", "Grammars kept now, running or cached (slots in use)", snap.grammars_kept
        )
        yield gauge("grammars_running", "Grammars pinned by running requests", snap.grammars_running)
        reserved = GaugeMetricFamily(
            "kvgate_memory_reserved_bytes", "Ledger reservations by role", labels=["role"]
        )
        for role, n in engine.ledger.by_role().items():
            reserved.add_metric([role], n)
        yield reserved
        yield counter("budget_caps", "Requests admitted with a capped max_tokens", c.budget_caps)
        yield counter("prompt_tokens", "Prompt tokens admitted", c.prompt_tokens)
        yield counter(
            "prefix_cache_queries_tokens",
            "Prompt tokens looked up in the prefix cache",
            c.prefix_cache_queries_tokens,
        )
        yield counter(
            "prefix_cache_hits_tokens",
            "Prompt tokens whose KV came from the prefix cache",
            c.prefix_cache_hits_tokens,
        )
        yield counter("generation_tokens", "Tokens generated", c.generated_tokens)
        yield counter("aborted", "Requests cancelled (client disconnect or shutdown)", c.aborted)
        yield counter("prefill_chunks", "Prompt chunks run", c.prefill_chunks)
        yield counter("decode_steps", "Steps that decoded at least one row", c.decode_steps)
        yield counter("spec_decode_draft_tokens", "Draft tokens verified (--speculate)", c.spec_draft_tokens)
        yield counter(
            "spec_decode_accepted_tokens",
            "Draft tokens the model confirmed (--speculate)",
            c.spec_accepted_tokens,
        )
        yield counter("failed_rows", "Rows failed by an error in their step", c.failed)
        graphs = getattr(getattr(engine, "runner", None), "graphs", None)  # a cluster facade has none
        if graphs is not None:
            yield counter(
                "cuda_graph_replays",
                "Decode steps replayed from a captured CUDA graph (--cuda-graphs)",
                graphs.replays,
            )
            yield gauge(
                "cuda_graph_pool_bytes",
                "The CUDA decode graphs' pool, measured after capture",
                graphs.pool_bytes,
            )
        governor = getattr(engine, "governor", None)  # --adaptive-threads on a CPU
        if governor is not None:
            yield gauge(
                "cpu_threads", "Threads the engine steps on now (--adaptive-threads)", governor.threads
            )
            yield gauge(
                "cpu_others_cores",
                "Other processes' use of the engine's CPUs at the last look, in cores",
                governor.others,
            )
        if snap.step_time_ema is not None:
            yield gauge("step_seconds_ema", "Smoothed engine step time", snap.step_time_ema)
