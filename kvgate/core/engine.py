"""The engine: model, KV pool, memory ledger and scheduler, owned by one worker thread.

Contract between threads:
- The worker thread alone reads and writes engine state: the queue, the rows, the blocks, the
  counters, the step timings (`kvgate.core.state`).
- Other threads talk to it through the `Inbox` (submit, cancel, drain, stop) and read the
  `EngineSnapshot` it publishes after each phase (`snapshot()`). Events reach a request's handle only
  after the snapshot that reflects them is published.
- `submit()` runs on the caller's thread: validation and the never-fits 400s are pure; the queue
  gate (closed, full, TTFT budget) is decided under the inbox's lock from the inbox's own count and
  the latest snapshot. Those refusals raise `Refusal` at once; everything else arrives on the handle.

One step is three typed phases (nano-vllm's and vLLM v1's shape):
    schedule() -> SchedulerOutput;  ModelRunner.execute() -> ModelOutput;  update(ModelOutput)

A watchdog needs no thread of its own: the worker records when a step starts, and `stalled()` (read
by /health, `submit`) reports a step past the step timeout.

NOTE: the worker is a thread, not a process. Every heavy op (matmul, attention) releases the GIL, so the
HTTP event loop keeps running on the other core, with no IPC or token copies. On 2 cores a process would
add a serialization hop per token and a second Python heap for no parallelism we do not already get.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace

import torch

from kvgate.config import STEP_TIMEOUT_FACTOR, STEP_TIMEOUT_FLOOR, EngineConfig, SchedulerConfig
from kvgate.core import admission, forecast
from kvgate.core.core_share import governor_for
from kvgate.core.gate import SHUTTING_DOWN, AdmissionGate
from kvgate.core.inbox import Cancel, CancelAll, Drain, Inbox, Release, Stop
from kvgate.core.kv_cache import KVPool
from kvgate.core.omp_pool import release_calling_thread_pool
from kvgate.core.placement import plan_for
from kvgate.core.runner import ModelRunner
from kvgate.core.snapshot import EngineSnapshot
from kvgate.core.stepper import EngineCore
from kvgate.memory.graphs import graph_shapes
from kvgate.memory.ledger import MemoryLedger
from kvgate.memory.plan import PlanError
from kvgate.models import LoadedModel, amx_rows, decode_prefetch, load_model, model_class, q8act_rows
from kvgate.models.decode_graphs import DecodeGraphs, GraphStep
from kvgate.models.llama import StepBatch
from kvgate.models.step_pieces import StepPieces
from kvgate.request import GenerationRequest, RequestHandle
from kvgate.sampling import host_draw_kernels
from kvgate.tokenizer import TextTokenizer

log = logging.getLogger("kvgate.engine")


@dataclass
class EngineInfo:
    model_name: str
    source: str
    device: str
    dtype: str
    load_seconds: float


def prefix_cache_flag(value: str) -> bool:
    if value not in ("on", "off"):
        raise PlanError(f"--prefix-cache {value!r} is not one of on, off")
    return value == "on"


class Engine:
    def __init__(self, loaded: LoadedModel, cfg: EngineConfig, *, overhead_bytes: int | None = None):
        t0 = time.monotonic()
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        place = plan_for(loaded, cfg, overhead_bytes)
        self.device, self.dtype, self.packed_weights = place.device, place.dtype, place.packed
        spec = self.spec = loaded.spec
        p = self.plan = place.plan
        self.ledger = MemoryLedger(p.limit_bytes, str(self.device))
        self.ledger.reserve("overhead", p.overhead_bytes, "runtime")
        # Weights are charged before they are materialized (a model that cannot fit never allocates);
        self.ledger.reserve("weights", p.weights_bytes, spec.name)  # the model pops each tensor it uses
        self.weights_format = place.weights
        self.model = model_class(spec)(
            spec,
            loaded.weights,
            self.dtype,
            self.device,
            pack=self.packed_weights,
            weights_format=place.weights,
            act=place.quant_act or torch.bfloat16,
            q8_head=place.q8_head,
            head_blocks=place.head_blocks,
            paged_attention=place.paged_attention,
            prefill_kernel=place.prefill_kernel,
            block_scales=loaded.block_scales,
            rope_positions=place.max_model_len,
        )
        # A step shrunk by the plan below what was warmed: one unwarmed bucket (MiB, in the overhead's slack)
        self.model.set_row_buckets(p.limits.max_step_tokens, p.limits.max_logit_rows)
        loaded.weights.clear()
        # kernels per CPU, speed only (not plan notes: `kvgate plan` builds no model and runs no probe)
        notes = [pick(self.model) for pick in (decode_prefetch.choose, q8act_rows.choose, amx_rows.choose)]
        self.prefetch_note = "; ".join(n for n in notes if n) or None
        if self.device.type != "cpu":  # its logits are drawn on the host: the C++ draw, built once
            log.info(host_draw_kernels())
        if self.model.weight_bytes > p.weights_bytes:
            raise PlanError(
                f"the loaded weights take {self.model.weight_bytes:,} bytes but the plan charged "
                f"{p.weights_bytes:,}: the plan missed a tensor of this {spec.architecture} checkpoint. "
                "This is a kvgate bug; please report it with the model file's name."
            )
        self.ledger.reserve("workspace", p.workspace_bytes, "step workspace", lifetime="step")
        self.graph_reservation = None
        if p.graph_bytes:
            self.graph_reservation = self.ledger.reserve("cuda_graphs", p.graph_bytes, "CUDA decode graphs")
        self.ledger.reserve("kv_cache", p.kv_pool_bytes, "KV pool")
        host = self.device.type == "cpu"  # logprobs and kept responses are host memory: not a GPU's ledger
        self.ledger.reserve("logprobs", p.logprobs_bytes * host, "requests' logprobs", lifetime="session")
        self.ledger.reserve("responses", p.responses_bytes * host, "kept responses", lifetime="session")
        self.kv_dtype = place.kv_dtype or self.dtype
        # with graphs, one block past the plan's: where padding rows write (charged with the graphs)
        pad = 1 if place.cuda_graphs else 0  # step pieces come only with the decode graphs
        self.kv = KVPool(spec, p.kv_blocks + pad, p.block_size, self.kv_dtype, self.device)
        self.tokenizer = TextTokenizer(loaded.tokenizer)
        self.sched_cfg = SchedulerConfig(
            block_size=p.block_size,
            total_blocks=p.kv_blocks,
            max_seqs=p.limits.max_seqs,
            max_queue=cfg.max_queue,
            max_queue_wait=cfg.max_queue_wait,
            prefill_chunk=p.limits.prefill_chunk,
            min_cap_tokens=cfg.min_cap_tokens,
            max_model_len=place.max_model_len,
            kv_bytes_per_token=p.kv_bytes_per_token,
            max_ttft=cfg.max_ttft,
            prefix_cache=prefix_cache_flag(cfg.prefix_cache),
            speculate=p.limits.speculate,
            decode_position_seconds=place.decode_position_seconds,
            decode_step_prior=forecast.step_prior(p.weights_bytes, self.device.type),
            cache_root=f"{spec.architecture}|{spec.name}|{p.dtype}|{self.kv_dtype}|{loaded.source}".encode(),
            logprobs_memory=p.logprobs_bytes,
        )
        self.inbox = Inbox()
        self.runner = ModelRunner(
            self._forward,
            block_size=p.block_size,
            attn_token_cap=p.limits.attn_token_cap,
            device=self.device,
        )
        self.graphs_note = "off"
        self.pieces: StepPieces | None = None  # steps with prompt chunks, piecewise (--cuda-graphs full)
        if place.cuda_graphs:
            self._capture_graphs(cfg.cuda_graphs)
        if place.step_pieces:
            self._capture_pieces()
        self.core = EngineCore(self.sched_cfg, self.tokenizer, self.runner, self.inbox)
        self.gate = AdmissionGate(self.sched_cfg, self.inbox, lambda: self.core.snapshot, self._unavailable)
        self.governor = governor_for(cfg.adaptive_threads, self.device, place.weights, place.paged_attention)
        self.info = EngineInfo(spec.name, loaded.source, str(self.device), p.dtype, time.monotonic() - t0)
        self._thread: threading.Thread | None = None
        self.dead: str | None = None

    def _forward(self, batch: StepBatch | GraphStep) -> torch.Tensor:
        if isinstance(batch, GraphStep):
            return self.runner.graphs.run(batch)
        if self.pieces is not None:  # its token buckets end at the plan's most tokens a step
            return self.pieces.run(batch)
        return self.model.forward(batch, self.kv)

    def _capture_pieces(self) -> None:
        """Capture the pieces of steps that carry prompt chunks (`--cuda-graphs full`) and check their
        measured pool against its charge; an error either way (the setting insists)."""
        p, charged = self.plan, self.plan.graph_breakdown["pieces_pool"]
        pieces = None
        try:
            pieces = StepPieces(self.model, self.kv, p.limits.max_step_tokens, p.kv_blocks)
            line = pieces.capture_all()
            if pieces.pool_bytes > charged:
                raise PlanError(
                    f"their pool holds {pieces.pool_bytes:,} bytes but the plan charged {charged:,}"
                )
        except Exception as exc:  # the decode graphs go too: the engine is not built
            if pieces is not None:
                pieces.release()
            if self.runner.graphs is not None:
                self.runner.graphs.release()
            raise PlanError(
                f"--cuda-graphs full: capturing the step pieces failed ({type(exc).__name__}: {exc}). This is "
                "a kvgate bug; please report it. --cuda-graphs on leaves steps with prompt chunks eager."
            ) from exc
        self.pieces = pieces
        self.graphs_note += f"; {line} (charged {charged / (1 << 20):.1f} MiB)"
        log.info(line)

    def _capture_graphs(self, setting: str) -> None:
        """Capture the decode graphs the plan charged (`kvgate.memory.graphs`), and check their measured
        pool against the charge. Under `--cuda-graphs auto` a capture that fails, or a pool over its
        charge, leaves the engine eager, says why, and gives the charge back to the ledger but for the
        pad block (the KV pool keeps its planned size); under `on` and `full` it is an error."""
        p = self.plan
        charged = p.graph_breakdown["pool"]
        graphs = None
        try:
            graphs = DecodeGraphs(self.model, self.kv, graph_shapes(p.limits, p.block_size), p.kv_blocks)
            line = graphs.capture_all()
            if graphs.pool_bytes > charged:
                raise PlanError(
                    f"the CUDA decode graphs' pool holds {graphs.pool_bytes:,} bytes but the plan charged "
                    f"{charged:,}. This is a kvgate bug; please report it."
                )
        except Exception as exc:
            if graphs is not None:
                graphs.release()
            why = f"{type(exc).__name__}: {exc}"
            if setting != "auto":
                raise PlanError(
                    f"--cuda-graphs {setting}: capturing the decode graphs failed ({why}). "
                    "--cuda-graphs auto runs eager steps instead, and off never captures."
                ) from exc
            r = self.graph_reservation  # the ledger keeps only the pad block of the graphs' charge
            r.release()
            pad = p.graph_breakdown["pad_block"]
            self.graph_reservation = self.ledger.reserve("cuda_graphs", pad, "the KV pool's pad block")
            self.graphs_note = f"off: capture failed ({why}); decode steps run eagerly"
            log.warning("decode graphs %s", self.graphs_note)
            return
        self.runner.graphs = graphs
        self.graphs_note = f"{line} (charged {charged / (1 << 20):.1f} MiB)"
        log.info(self.graphs_note)

    @classmethod
    def from_model(cls, model: str, cfg: EngineConfig | None = None, **kw) -> Engine:
        t0 = time.monotonic()
        engine = cls(load_model(model), cfg or EngineConfig(), **kw)
        engine.info.load_seconds = time.monotonic() - t0
        return engine

    @property
    def max_model_len(self) -> int:
        return self.sched_cfg.max_model_len

    # ---- what other threads may read ----------------------------------------------------------
    def snapshot(self) -> EngineSnapshot:
        """The latest published state, with the admission gate's refusal counts added in."""
        return self.core.snapshot.with_gate(self.gate.counters())

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    def step_timeout(self) -> float:
        if self.cfg.step_timeout is not None:
            return self.cfg.step_timeout
        return max(STEP_TIMEOUT_FLOOR, STEP_TIMEOUT_FACTOR * self.core.snapshot.slowest_step)

    def stalled(self) -> str | None:
        """Why the engine counts as hung (a step running past the step timeout), or None."""
        started = self.core.step_started
        running = 0.0 if started is None else time.monotonic() - started
        limit = self.step_timeout()
        if running <= limit:
            return None
        return (
            f"an engine step has been running for {running:.1f}s, past the step timeout of {limit:.1f}s "
            "(--step-timeout); the forward pass may be hung"
        )

    # ---- requests (any thread) ----------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Refusals that need no waiting (never fits, closed, queue full, TTFT budget) raise `Refusal`
        here; invalid fields raise `RequestError` / `SamplingError`."""
        request = request.validate(self.tokenizer.vocab_size).as_kept(self.sched_cfg.speculate)
        handle = RequestHandle(request, self._send_cancel, self._send_release)
        self.gate.submit(handle)
        return handle

    def submit_choices(self, request: GenerationRequest, n: int) -> list[RequestHandle]:
        """`n` answers to one prompt, admitted together or not at all: they share the prompt's blocks
        (computed once) and each holds its own output blocks. With a seed, choice i samples with
        seed + i, so the same request gives the same n answers (choice 0 = the request alone)."""
        if n == 1:
            return [self.submit(request)]
        if n > self.sched_cfg.max_seqs:  # before n handles are built: n (or best_of) may be any integer
            raise admission.too_many_choices(n, self.sched_cfg.max_seqs, self.cfg.max_seqs)
        request = request.validate(self.tokenizer.vocab_size).as_kept(self.sched_cfg.speculate)
        handles = [RequestHandle(request, self._send_cancel, self._send_release)]
        for i in range(1, n):
            seed = request.sampling.seed
            sampling = replace(request.sampling, seed=None if seed is None else (seed + i) % (1 << 63))
            # the first choice scores the prompt (its positions are shared, its scores reported with every
            # choice) and carries what its list reserves: the others neither score nor reserve it again
            lp = request.logprobs_bytes and 0
            other = replace(request, sampling=sampling, prompt_logprobs=None, logprobs_bytes=lp)
            handles.append(RequestHandle(other, self._send_cancel, self._send_release))
        self.gate.submit(handles[0], handles[1:])
        return handles

    def submit_many(self, requests: list[GenerationRequest], n: int = 1) -> list[RequestHandle]:
        """Several requests as one (`n` choices each, see `submit_choices`), validated and fitted together
        (`admission.fit_group`) first; a refusal of one cancels and closes those submitted before it."""
        for r in requests:
            r.validate(self.tokenizer.vocab_size)
        requests = admission.fit_group(self.sched_cfg, requests, n)
        handles: list[RequestHandle] = []
        try:
            for r in requests:
                handles.extend(self.submit_choices(r, n))
        except BaseException:
            for h in handles:
                h.cancel()
                h.close()  # nobody will: the caller never gets these handles
            raise
        return handles

    def _unavailable(self) -> str | None:
        return "the engine is not running; see /health" if self.dead is not None else self.stalled()

    def _send_cancel(self, request_id: int) -> None:
        self.inbox.put(Cancel(request_id))

    def _send_release(self, request_id: int) -> None:
        self.inbox.put(Release(request_id))

    def generate(self, request: GenerationRequest, timeout: float | None = None):
        return self.submit(request).result(timeout)

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> Engine:
        if self._thread is None:
            # the building thread's OpenMP pool would make libgomp throttle the worker's (omp_pool)
            why_not = release_calling_thread_pool()
            if why_not:
                log.info("the building thread's OpenMP pool stays: %s", why_not)
            self._thread = threading.Thread(target=self._run, name="kvgate-engine", daemon=True)
            self._thread.start()
        return self

    def stop_admitting(self, reason: str) -> None:
        self.inbox.close(reason)

    def drain(self, grace: float = 0.0) -> None:
        """Stop admitting and refuse the queue at once (503), let running rows finish for `grace`
        seconds, cancel the rest (they keep their partial output). The worker runs on until `shutdown`:
        a cluster replica's last events and views still go out (`KvgateReplica.drain`)."""
        self.stop_admitting(SHUTTING_DOWN)
        self.inbox.put(Drain())
        self._wait(lambda s: s.running == 0, time.monotonic() + grace)
        self.inbox.put(CancelAll())
        self._wait(lambda s: s.idle, time.monotonic() + 5)

    def shutdown(self, grace: float = 0.0) -> None:
        """`drain(grace)`, then stop the worker and give the memory back."""
        self.drain(grace)
        self.inbox.put(Stop())
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._thread is None or not self._thread.is_alive():
            self._release_memory()

    def _wait(self, done, deadline: float) -> None:
        while self.alive and time.monotonic() < deadline and not done(self.core.snapshot):
            time.sleep(0.01)

    def _release_memory(self) -> None:
        """Give the pool and weights back (a stopped engine object may outlive its use)."""
        if getattr(self, "_released", False):
            return
        self._released = True
        for captured in (self.runner.graphs, self.pieces):
            if captured is not None:
                captured.release()
        self.runner.graphs = self.pieces = None
        self.kv = self.model = None
        for r in self.ledger._live[:]:
            r.release()

    # ---- the worker ---------------------------------------------------------------------------
    def _run(self) -> None:
        core = self.core
        try:
            while True:
                if self.governor is not None:
                    self.governor.poll()
                commands = self.inbox.take(core.wait_time())
                if any(isinstance(c, Stop) for c in commands):
                    core.scheduler.apply([c for c in commands if not isinstance(c, Stop)])
                    core.publish()
                    return
                core.tick(commands)
        except BaseException as exc:  # the worker is gone for good: fail everything, loudly
            self.dead = f"engine worker died: {type(exc).__name__}: {exc}"
            log.exception("engine worker died")
            self.inbox.close("the engine worker stopped after an internal error")
            core.fail_all("the engine worker stopped after an internal error")
            raise
