"""The engine: model, KV pool, memory ledger and scheduler, driven by one worker thread.

`Engine.submit(request) -> RequestHandle`. Never-fits and queue-full refusals raise `Refusal` at once
in the caller's thread; everything else arrives on the handle's event channel.

NOTE: the worker is a thread, not a process. Every heavy op (matmul, attention) releases the GIL, so
the HTTP event loop keeps running on the other core, and a thread needs no IPC or token copies between
the scheduler and the server. On 2 cores a separate process would add a serialization hop per token
and a second Python heap for no parallelism we do not already get.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass

import torch

from kvgate.config import EngineConfig
from kvgate.kv import BlockAllocator, KVPool
from kvgate.memory.ledger import MemoryLedger
from kvgate.memory.plan import MemoryPlan, make_plan, runtime_overhead_bytes
from kvgate.models import LoadedModel, load_model
from kvgate.models.linear import packs_weights, warm_kernels
from kvgate.models.llama import LlamaModel, matmul_shapes
from kvgate.request import GenerationRequest, RequestHandle
from kvgate.scheduler import Scheduler
from kvgate.tokenizer import TextTokenizer

log = logging.getLogger("kvgate.engine")

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class DeviceError(RuntimeError):
    pass


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise DeviceError(
                f"--device {name} was asked for but this PyTorch build sees no CUDA device "
                f"(torch {torch.__version__}). Use --device cpu or --device auto."
            )
        dev = torch.device(name)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) exist.")
        return dev
    if name == "cpu":
        return torch.device("cpu")
    raise DeviceError(f"--device {name!r} is not one of auto, cpu, cuda, cuda:N")


def cpu_has_fast_bf16() -> bool:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", flags))


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on CUDA with bf16 support and on CPUs with native bf16 matmul, else float32.

    Measured on an AVX2-only EPYC (no avx512_bf16): a bf16 256x3072x576 matmul runs at 10 GFLOP/s
    against 57 GFLOP/s in float32, so bf16 there would make prefill and batched decode ~5x slower.
    """
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    if name not in _DTYPES:
        raise DeviceError(f"--dtype {name!r} is not one of auto, bfloat16, float16, float32")
    return _DTYPES[name]


def resolve_packing(name: str, device: torch.device, dtype: torch.dtype) -> bool:
    """auto: prepack weight matrices for oneDNN wherever that works (CPU float32); on: insist."""
    if name not in ("auto", "on", "off"):
        raise DeviceError(f"--pack-weights {name!r} is not one of auto, on, off")
    possible = packs_weights(device, dtype)
    if name == "on" and not possible:
        raise DeviceError(
            f"--pack-weights on needs a CPU device, float32 and a torch with oneDNN; this is "
            f"{device} {str(dtype).removeprefix('torch.')}. Use --pack-weights auto or off."
        )
    return possible and name != "off"


@dataclass
class EngineInfo:
    model_name: str
    source: str
    device: str
    dtype: str
    load_seconds: float


def checkpoint_bytes(loaded: LoadedModel) -> int:
    """Bytes of the loaded checkpoint tensors (they become the weights the plan charges)."""
    return sum(t.numel() * t.element_size() for t in loaded.weights.values())


class Engine:
    def __init__(self, loaded: LoadedModel, cfg: EngineConfig, *, overhead_bytes: int | None = None):
        t0 = time.monotonic()
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.packed_weights = resolve_packing(cfg.pack_weights, self.device, self.dtype)
        spec = loaded.spec
        self.spec = spec
        max_len = min(cfg.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)
        dtype_bytes = torch.finfo(self.dtype).bits // 8
        if self.packed_weights:  # before the overhead is measured, so it includes the kernels' memory
            warm_kernels(matmul_shapes(spec, cfg.prefill_chunk + cfg.max_seqs, cfg.max_seqs), self.dtype)
        if overhead_bytes is None:
            overhead_bytes = runtime_overhead_bytes(str(self.device), checkpoint_bytes(loaded))
        self.plan: MemoryPlan = make_plan(
            spec,
            device=str(self.device),
            dtype_name=str(self.dtype).removeprefix("torch."),
            dtype_bytes=dtype_bytes,
            limit_spec=cfg.memory_limit,
            block_size=cfg.block_size,
            prefill_chunk=cfg.prefill_chunk,
            max_seqs=cfg.max_seqs,
            max_model_len=max_len,
            kv_cache_bytes=cfg.kv_cache_bytes,
            overhead_bytes=overhead_bytes,
            packed_weights=self.packed_weights,
        )
        p = self.plan
        self.ledger = MemoryLedger(p.limit_bytes, str(self.device))
        self.ledger.reserve("overhead", p.overhead_bytes, "runtime")
        # Weights are charged before they are materialized: a model that cannot fit never allocates.
        self._weights_res = self.ledger.reserve("weights", p.weights_bytes, spec.name)
        # The model pops each source tensor as it consumes it, so a loader that hands over owned
        # tensors frees each one as soon as its copy exists (a copy of the dict would hold them all).
        self.model = LlamaModel(spec, loaded.weights, self.dtype, self.device, pack=self.packed_weights)
        # The plan may have shrunk the step below what was warmed: its new maximum is then one bucket
        # that was not (a few MiB of oneDNN kernels at most, inside the overhead's slack).
        self.model.set_row_buckets(p.limits.max_step_tokens, p.limits.max_seqs)
        loaded.weights.clear()
        actual = self.model.weight_bytes
        assert actual <= p.weights_bytes, f"weights {actual} B exceed the planned {p.weights_bytes} B"
        self.ledger.reserve("workspace", p.workspace_bytes, "step workspace", lifetime="step")
        self.ledger.reserve("kv_cache", p.kv_pool_bytes, "KV pool")
        self.kv = KVPool(spec, p.kv_blocks, p.block_size, self.dtype, self.device)
        self.tokenizer = TextTokenizer(loaded.tokenizer)
        self.allocator = BlockAllocator(p.kv_blocks)
        self.scheduler = Scheduler(
            forward=lambda batch: self.model.forward(batch, self.kv),
            tokenizer=self.tokenizer,
            allocator=self.allocator,
            block_size=p.block_size,
            max_seqs=p.limits.max_seqs,
            max_queue=cfg.max_queue,
            max_queue_wait=cfg.max_queue_wait,
            max_ttft=cfg.max_ttft,
            prefill_chunk=p.limits.prefill_chunk,
            min_cap_tokens=cfg.min_cap_tokens,
            max_model_len=max_len,
            attn_token_cap=p.limits.attn_token_cap,
            group_size=spec.num_heads // spec.num_kv_heads,
            kv_bytes_per_token=p.kv_bytes_per_token,
            device=self.device,
        )
        self.info = EngineInfo(spec.name, loaded.source, str(self.device), p.dtype, time.monotonic() - t0)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead: str | None = None

    @classmethod
    def from_model(cls, model: str, cfg: EngineConfig | None = None, **kw) -> Engine:
        t0 = time.monotonic()
        engine = cls(load_model(model), cfg or EngineConfig(), **kw)
        engine.info.load_seconds = time.monotonic() - t0
        return engine

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> Engine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvgate-engine", daemon=True)
            self._thread.start()
        return self

    def stop_admitting(self, reason: str) -> None:
        with self.scheduler.lock:
            self.scheduler.closed_reason = reason

    def shutdown(self, grace: float = 0.0) -> None:
        """Stop admitting, let running rows finish for `grace` seconds, cancel the rest, stop."""
        self.stop_admitting("shutting down")
        deadline = time.monotonic() + grace
        while self.scheduler.running and time.monotonic() < deadline:
            time.sleep(0.02)
        for row in list(self.scheduler.running.values()):
            row.handle.cancel()
        with self.scheduler.lock:
            waiting = list(self.scheduler.waiting)
        for w in waiting:
            w.handle.cancel()
        end = time.monotonic() + 5
        while self.scheduler.has_work() and time.monotonic() < end and self.alive:
            time.sleep(0.01)
        self._stopping = True
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._thread is None or not self._thread.is_alive():
            self._release_memory()

    def _release_memory(self) -> None:
        """Give the pool and weights back (a stopped engine object may outlive its use)."""
        if getattr(self, "_released", False):
            return
        self._released = True
        self.kv = None
        self.model = None
        for r in self.ledger._live[:]:
            r.release()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    def _wake(self) -> None:
        with self.scheduler.lock:
            self.scheduler.lock.notify_all()

    def _run(self) -> None:
        sched = self.scheduler
        try:
            while not self._stopping:
                with sched.lock:
                    if not sched.has_work():
                        sched.lock.wait(timeout=0.5)
                        continue
                sched.tick()
                if sched.waiting and not sched.running:
                    # Every waiter is blocked and nothing runs: sleep until the nearest deadline.
                    nd = sched.next_deadline()
                    with sched.lock:
                        sched.lock.wait(
                            timeout=0.05 if nd is None else max(0.0, min(0.05, nd - time.monotonic()))
                        )
        except BaseException as exc:  # the worker is gone for good: fail everything, loudly
            self.dead = f"engine worker died: {type(exc).__name__}: {exc}"
            log.exception("engine worker died")
            sched.fail_all("the engine worker stopped after an internal error")
            raise

    # ---- requests -----------------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Refusals that need no waiting (never fits, queue full, not running) raise `Refusal` here."""
        request.sampling.validate()
        vocab = self.tokenizer.vocab_size
        bad = [t for t in request.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        mt = request.max_tokens
        if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 1):
            # Below 1 the KV reservation would be smaller than the prompt: its prefill would write
            # past its blocks and fail every row sharing that step.
            raise ValueError(f"max_tokens={mt!r} must be an integer of at least 1 (or unset)")
        handle = RequestHandle(request, self._wake)
        if self.dead is not None:
            from kvgate.request import Refusal

            raise Refusal("engine_unavailable", "the engine is not running; see /health", 503, retry_after=5)
        self.scheduler.submit(handle)
        return handle

    def generate(self, request: GenerationRequest, timeout: float | None = None):
        return self.submit(request).result(timeout)
