"""Measure what the serving engine really holds against what its memory plan declares.

Run as a script in a fresh process (tests/test_memory.py does), so the numbers are this process's and
nothing else's:

    python tests/memory_probe.py --memory-limit 1GiB --max-model-len 1024 --dtype float32

It prints one JSON object (the last line of stdout) with the plan and the measurements. Every memory
figure is resident set size (RSS) read from /proc/self/status:

- VmRSS is what the process holds now; VmHWM is its high-water mark (what ru_maxrss reports too,
  except that ru_maxrss also carries the parent's RSS across fork+exec, so it is not used). RSS is the right measure on CPU: it is what the kernel
  charges the process and what an OOM killer or a cgroup limit sees. It counts every tensor page that
  was touched, heap that glibc or MKL freed but kept, the interpreter and library code pages, and the
  file-backed pages of memory-mapped weights. It does not count pages never touched (the KV pool is
  zero-filled at startup, so it counts in full).
- Writing "5" to /proc/self/clear_refs resets VmHWM to the current RSS (Linux >= 4.0). The probe
  reads the load peak (VmHWM after the engine is built), then resets, so the serving peak is
  measured apart from the load's transient. Before every engine step it reads VmHWM (the high-water
  mark since the last reset) and resets again: the serving peak is the largest of all readings, and
  each step's rise above the RSS it started from is recorded.
- A cold GGUF -> safetensors conversion cache is filled first in a child process (its peak,
  getrusage(RUSAGE_CHILDREN).ru_maxrss, is reported as conversion_peak), so the conversion's freed
  heap does not inflate this process's baseline.
- After the build the probe touches every weight page (weights that are memory-mapped are otherwise
  paged in by the first step and would look like step workspace) and runs one short warm-up request
  (the first matmul and attention calls allocate library buffers and thread pools once: runtime
  overhead, reported as warmup_rise). `weights_resident` is what the weights really occupy: the RSS
  of the mapped safetensors files plus the model tensors that live outside them.
- `--exact` re-runs the probe with glibc's mmap threshold pinned to 64 KiB (so every tensor above it
  is its own mapping, returned to the kernel when freed) and MKL's buffer cache off: RSS then tracks
  the bytes a step really allocates, with nothing reused from an earlier step's freed heap. That is
  the mode that can check `step_workspace` term by term; the default mode is what production runs.

Workload: one prompt near the context limit (prefill chunks that attend over the whole context),
more rows with prompts of a full prefill chunk, then every row decoding together (the batch's logits),
with seeded top-p sampling and repetition/frequency penalties on every row (penalty state per row).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

EXACT_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536", "MKL_DISABLE_FAST_MM": "1"}


def status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def rss() -> int:
    return status()["VmRSS"]


def hwm() -> int:
    return status()["VmHWM"]


def reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def warm_conversion_cache(model: str) -> int | None:
    """Convert the GGUF in a child process if the cache is cold; return the child's peak RSS (bytes)."""
    from kvgate.models import resolve_model_path

    path = resolve_model_path(model)
    if path.is_dir() or path.suffix.lower() != ".gguf":
        return None
    from kvgate.models.gguf_loader import cache_key, cache_root

    if (cache_root() / f"gguf-{cache_key(path)}" / "model.safetensors").is_file():
        return None
    code = (
        "import sys; from pathlib import Path; from kvgate.models.gguf_loader import convert_to_cache; "
        "convert_to_cache(Path(sys.argv[1]))"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(path)], check=True, cwd=Path(__file__).resolve().parents[1]
    )
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def weights_resident(model) -> tuple[int, int, int]:
    """(RSS of mapped *.safetensors files, bytes of model tensors inside them, bytes outside them)."""
    maps = []
    file_rss = 0
    current = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                current = head[-1].endswith(".safetensors") if len(head) >= 6 else False
                if current:
                    maps.append((lo, hi))
            elif head[0] == "Rss:" and current:
                file_rss += int(head[1]) * 1024
    import torch

    anon = mapped = 0
    seen = set()
    for t in model_tensors(model):
        if t.is_mkldnn:  # a prepacked weight (kvgate.models.llama.Linear): opaque, always owned
            p, nbytes = torch.ops.mkldnn.data_ptr(t), torch.ops.mkldnn._nbytes(t)
        else:
            p, nbytes = t.data_ptr(), t.untyped_storage().nbytes()
        if p in seen:
            continue
        seen.add(p)
        if any(lo <= p < hi for lo, hi in maps):
            mapped += t.numel() * t.element_size()
        else:
            anon += nbytes
    return file_rss, mapped, anon


def matrix_tensors(lin) -> list:
    """A `Linear`'s weight and bias; a `Quantized` layer's codes, scales and bias; a `Q41Linear`'s or
    `Q41Dot8Linear`'s tiles and bias; a `Q8Table`'s or `Q8DotTable`'s tiles."""
    import torch

    if isinstance(getattr(lin, "packed", None), torch.Tensor):  # (a `Linear`'s `packed` is a flag)
        names = ("packed", "bias")
    elif hasattr(lin, "tiles"):
        names = ("tiles",)
    else:
        names = ("codes", "scales", "d", "m", "bias") if hasattr(lin, "codes") else ("weight", "bias")
    return [t for t in (getattr(lin, n, None) for n in names) if t is not None]


def model_tensors(m) -> list:
    embed = [m.embed] if m.q8 is None else []  # a Q8 table is the LM head too: counted there
    out = [*embed, m.norm, m.cos, m.sin] + matrix_tensors(m.lm_head)
    for ln1, qkv, o, ln2, gu, down in m.layers:
        out += [ln1, ln2] + [t for lin in (qkv, o, gu, down) for t in matrix_tensors(lin)]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--memory-limit", default="1GiB")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--weights", default="full", help="full | int8 | int4 | gguf | gguf-q8act")
    ap.add_argument("--kv-dtype", default="auto", help="auto | float32 | float16 | bfloat16 | int8")
    ap.add_argument("--speculate", type=int, default=0, help="draft tokens per greedy row and step")
    ap.add_argument("--decode-attention", default="auto", help="auto | paged | gather")
    ap.add_argument("--prefill-attention", default="auto", help="auto | kernel | sdpa")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-seqs", type=int, default=8)
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument(
        "--long-prompt", type=int, default=None, help="default: the context (or pool) - --long-decode"
    )
    ap.add_argument("--long-decode", type=int, default=8)
    ap.add_argument(
        "--rows", type=int, default=None, help="rows besides the long one (default: max rows - 1)"
    )
    ap.add_argument("--row-prompt", type=int, default=None, help="default: the prefill chunk")
    ap.add_argument("--decode", type=int, default=8, help="max_tokens of every other row")
    ap.add_argument(
        "--top-p-rows", type=int, default=2, help="rows that sample with top-p (the rest: greedy)"
    )
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--grammar-rows", type=int, default=0, help="rows that generate under a JSON schema, each its own"
    )
    ap.add_argument("--max-grammars", type=int, default=None, help="--max-grammars (default: auto)")
    ap.add_argument(
        "--score-rows", type=int, default=0, help="rows that also score their prompt (prompt_logprobs=5)"
    )
    ap.add_argument("--exact", action="store_true", help="pin the allocators so RSS tracks live bytes")
    ap.add_argument(
        "--fill-cache",
        action="store_true",
        help="first fill the KV pool with prefix-cached blocks (distinct prompts), so the workload evicts",
    )
    a = ap.parse_args(argv)
    if a.exact and any(os.environ.get(k) != v for k, v in EXACT_ENV.items()):
        # glibc and MKL read these once at startup: run this script again with them set.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **EXACT_ENV})

    start_rss = rss()
    cpu = {"start": time.process_time()}
    conversion_peak = warm_conversion_cache(a.model)

    import torch

    from kvgate.config import EngineConfig
    from kvgate.core.engine import Engine
    from kvgate.request import GenerationRequest
    from kvgate.sampling import SamplingParams

    imports_rss = rss()
    cpu["imports"] = time.process_time()
    cfg = EngineConfig(
        device="cpu",
        dtype=a.dtype,
        memory_limit=a.memory_limit,
        max_model_len=a.max_model_len,
        max_seqs=a.max_seqs,
        prefill_chunk=a.prefill_chunk,
        max_queue_wait=600.0,
        threads=a.threads,
        weights=a.weights,
        kv_dtype=a.kv_dtype,
        speculate=a.speculate,
        max_grammars=a.max_grammars,
        decode_attention=a.decode_attention,
        prefill_attention=a.prefill_attention,
    )
    t0 = time.monotonic()
    engine = Engine.from_model(a.model, cfg)
    load_s = time.monotonic() - t0
    cpu["load"] = time.process_time()
    # VmHWM, not ru_maxrss: on Linux ru_maxrss survives fork+exec (exec folds the forked copy of the
    # parent's memory into it), so under a large pytest parent it reported the parent's RSS (seen:
    # 1764 MiB "load peak" in the full suite, 1.1 GiB in isolation). VmHWM belongs to this process's
    # own address space, which exec created fresh.
    load_peak = hwm()
    plan = engine.plan
    loaded_rss = rss()
    m = engine.model
    for t in model_tensors(m):
        (t.to_dense() if t.is_mkldnn else t).sum()  # touch every page (a packed weight is owned anyway)
    touched_rss = rss()
    file_rss, mapped_weights, anon_weights = weights_resident(m)

    rng = random.Random(0)
    vocab = engine.tokenizer.vocab_size

    def prompt(n: int) -> list[int]:
        if a.speculate:  # a repeated phrase: prompt lookup finds drafts, as in an input-grounded task
            phrase = [rng.randrange(300, vocab) for _ in range(8)]
            return (phrase * (n // 8 + 1))[:n]
        return [rng.randrange(300, vocab) for _ in range(n)]

    def sampling(i: int) -> SamplingParams:
        # Every row carries penalty state (a vocab-sized mask and counts); a few also sample with
        # top-p (the largest per-row sampling temporaries), the rest are greedy (cheap).
        t, p = (0.8, 0.9) if i < a.top_p_rows else (0.0, 1.0)
        g = grammars[i] if i < len(grammars) else None
        if a.speculate and t == 0.0:  # plain greedy rows, the ones that speculate
            return SamplingParams(temperature=0.0, seed=i, grammar=g)
        return SamplingParams(
            temperature=t, top_p=p, repetition_penalty=1.1, frequency_penalty=0.1, seed=i, grammar=g
        )

    grammars = []
    if a.grammar_rows:  # compiled here, as the server's prepare would (the plan's `grammar` term)
        import json as _json

        from kvgate.structured.compiler import compiler_for

        comp = compiler_for(engine.tokenizer, engine.spec.vocab_size, engine.plan.limits.grammars)
        for i in range(a.grammar_rows):  # distinct schemas that cannot end within a few tokens
            schema = {"type": "object", "properties": {f"k{i}": {"type": "string", "minLength": 64}}}
            schema["required"] = [f"k{i}"]
            grammars.append(comp.check("start: %json " + _json.dumps(schema)))

    L = engine.max_model_len
    engine.start()
    engine.generate(
        GenerationRequest(prompt(min(20, L - 2)), sampling(10**6), max_tokens=2, ignore_eos=True), timeout=300
    )
    warm_rss = rss()
    cpu["warm_up"] = time.process_time()
    can_reset = reset_hwm() and hwm() <= warm_rss + (1 << 20)

    import kvgate.memory.workspace as plan_mod

    runner = engine.runner
    dtype_bytes = (
        torch.finfo(engine.dtype).bits // 8
    )  # the model's: the KV pool's may be narrower (--kv-dtype)
    readings = [warm_rss]
    steps: list[dict] = []
    rows_seen = [0]
    real_execute, real_forward = runner.execute, runner.model_forward

    plain_fp32 = not plan.limits.packed_weights and engine.dtype == torch.float32

    def bucket(n: int, most: int) -> int:
        from bisect import bisect_left

        from kvgate.models.linear import row_buckets

        b = row_buckets(most, 4 if plain_fp32 else 2)  # as Linear.bucket_rows
        return b[min(bisect_left(b, n), len(b) - 1)]

    def step_bound(shape: dict) -> dict:
        """The planner's own formula at this step's composition: what this step may allocate."""
        ctx = min(L, plan_mod.padded_len(max(shape["context"], 1), plan.block_size))
        rows = max(shape["rows"], shape["logits_rows"])
        if plan.limits.padded_rows:  # CPU matmuls pad their rows up to a bucket (models.linear)
            rows = max(rows, bucket(shape["logits_rows"], plan.limits.max_logit_rows))
            shape = {
                **shape,
                "prefill_tokens": shape["prefill_tokens"]
                + bucket(shape["tokens"], plan.limits.max_step_tokens)
                - shape["tokens"],
            }
        lim = plan_mod.StepLimits(
            shape["prefill_tokens"],
            rows,
            shape["group_tokens"],
            L,
            ctx if ctx < L else None,
            plan.limits.packed_weights,
            plan.limits.padded_rows,
            plan.limits.weight_format,
            plan.limits.quant_act_bytes,
            q8_head=plan.limits.q8_head,
            flash_prefill=plan.limits.flash_prefill,
            kv_bytes=plan.limits.kv_bytes,
            amx_prefill=plan.limits.amx_prefill,
        )  # draft positions (--speculate) are decode rows here: counted in rows and logits rows
        return plan_mod.step_workspace(engine.spec, dtype_bytes, lim, plan.block_size)

    def recording_forward(batch):
        groups, spans = batch.decode_groups, batch.prefills
        steps[-1]["shape"] = {
            "tokens": batch.input_ids.numel(),
            "prefill_tokens": sum(pf.q_len for pf in spans),
            "rows": sum(gr.end - gr.start for gr in groups) + len(spans),
            "logits_rows": batch.logits_index.numel(),
            "group_tokens": max([0] + [gr.mask.shape[0] * gr.mask.shape[-1] for gr in groups]),
            "context": max([0] + [pf.ctx_len for pf in spans] + [gr.mask.shape[-1] for gr in groups]),
        }
        return real_forward(batch)

    def measured_step(so):
        rows_seen[0] = max(rows_seen[0], engine.snapshot().running)
        steps.append({})
        before = rss()
        readings.append(hwm())  # the high-water mark since the last reset (between steps)
        reset_hwm()
        out = real_execute(so)
        after = hwm()
        readings.append(after)
        steps[-1]["rise"] = after - before
        return out

    runner.execute = measured_step  # the step's tensors, forward and sampling
    runner.model_forward = recording_forward

    lim = plan.limits
    long_prompt = a.long_prompt if a.long_prompt is not None else min(L, plan.kv_positions) - a.long_decode
    rows = a.rows if a.rows is not None else lim.max_seqs - 1
    row_prompt = a.row_prompt if a.row_prompt is not None else lim.prefill_chunk
    cached_before = 0
    if a.fill_cache:  # distinct full-context prompts, one token each, until the pool is cached
        while engine.snapshot().kv_blocks_cached < 0.8 * plan.kv_blocks:
            req = GenerationRequest(prompt(min(L, plan.kv_positions) - 1), sampling(0), max_tokens=1)
            engine.submit(req).result(timeout=600)
        cached_before = engine.snapshot().kv_blocks_cached
    t1 = time.monotonic()
    handles = []
    if long_prompt > 0:
        req = GenerationRequest(prompt(long_prompt), sampling(0), max_tokens=a.long_decode, ignore_eos=True)
        handles.append(engine.submit(req))
    for i in range(rows):
        req = GenerationRequest(prompt(row_prompt), sampling(i + 1), max_tokens=a.decode, ignore_eos=True)
        req.prompt_logprobs = 5 if i < a.score_rows else None  # each chunk's logits at every position
        handles.append(engine.submit(req))
    results = [h.result(timeout=600) for h in handles]
    serve_s = time.monotonic() - t1
    cpu["serve"] = time.process_time()
    readings.append(hwm())
    engine.shutdown()

    c = engine.snapshot().counters
    serving_peak = max(readings)
    # Each step's rise above the RSS it started from is what it allocated; the rows' standing state
    # was already resident before it, so the bound leaves those two terms out.
    checked = []
    for st in steps:
        if "shape" not in st:
            continue
        bd = step_bound(st["shape"])
        bound = plan_mod.workspace_total(bd) - bd["row_state"] - bd["penalty_state"] - bd["grammar"]
        top, second = sorted(plan_mod.TRANSIENT_TERMS, key=lambda k: -bd[k])[:2]
        checked.append(
            {
                **st["shape"],
                "rise": st["rise"],
                "bound": bound,
                "largest_transient": top,
                "logits_term": bd["logits"],
                "second_transient": bd[second],
            }
        )
    worst = min(checked, key=lambda x: x["bound"] - x["rise"], default=None)
    out = {
        "plan": plan.to_dict(),
        "plan_total": plan.weights_bytes + plan.kv_pool_bytes + plan.workspace_bytes + plan.overhead_bytes,
        "exact": a.exact,
        "can_reset_hwm": can_reset,
        "start_rss": start_rss,
        "imports_rss": imports_rss,
        "conversion_peak": conversion_peak,
        "load_peak": load_peak,
        "loaded_rss": loaded_rss,
        "touched_rss": touched_rss,
        "weights_file_rss": file_rss,
        "weights_mapped": mapped_weights,
        # file pages resident in the weights' mapping that no model tensor uses (copied out by the load)
        "weights_dead_rss": max(0, file_rss - mapped_weights),
        "weights_anon": anon_weights,
        "weights_resident": file_rss + anon_weights,
        "model_weight_bytes": m.weight_bytes,
        "warm_rss": warm_rss,
        "warmup_rise": warm_rss - touched_rss,
        "serving_peak": serving_peak,
        "serving_rise": serving_peak - warm_rss,
        "step_checks": checked,
        "worst_step": worst,
        "max_step_rise": max((st["rise"] for st in steps if "rise" in st), default=0),
        "steps": len(steps),
        "decode_steps": c.decode_steps,
        "spec_draft_tokens": c.spec_draft_tokens,
        "spec_accepted_tokens": c.spec_accepted_tokens,
        "prefill_chunks": c.prefill_chunks,
        "max_rows_seen": rows_seen[0],
        "requests": len(results),
        "kv_blocks_total": plan.kv_blocks,
        "kv_blocks_cached_before_workload": cached_before,
        "kv_blocks_cached_after": engine.snapshot().kv_blocks_cached,
        "finish": sorted({r.finish_reason for r in results}),
        "scored_tokens": sum(len(r.prompt_logprobs or ()) for r in results),
        "max_logits_rows": max([0] + [st["shape"]["logits_rows"] for st in steps if "shape" in st]),
        "generated": sum(r.completion_tokens for r in results),
        "load_s": round(load_s, 2),
        "serve_s": round(serve_s, 2),
        "torch_threads": torch.get_num_threads(),
        "cpu_s": {k: round(cpu[k] - cpu[j], 2) for j, k in zip(list(cpu), list(cpu)[1:], strict=False)},
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
