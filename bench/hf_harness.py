"""transformers `generate` as a benchmark peer: static batches, closed loop, no HTTP.

For concurrency c, the requests run in batches of c (the next batch starts when the previous one ends,
as c clients that each send their next request on completion would see with a server that batches
statically). A StoppingCriteria that never stops timestamps every decode step, so TTFT (batch start
-> first token), ITL and E2E per request come out in the same record format as `kvgate bench`, and
`kvgate.bench.summarize` aggregates them.

    .venv/bin/python -m bench.hf_harness --dtype float32 --dataset P.jsonl --concurrency 4 \
        --output-len 128 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def model_dir() -> str:
    """The HF-style directory kvgate converts the default GGUF into (float32 safetensors)."""
    from kvgate.models import resolve_model_path
    from kvgate.models.gguf_loader import convert_to_cache

    return str(convert_to_cache(resolve_model_path("default")))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hf_harness")
    ap.add_argument(
        "--model-dir", default=None, help="HF directory (default: kvgate's conversion of the default model)"
    )
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument(
        "--dataset",
        action="append",
        required=True,
        help="JSONL from `kvgate bench --save-prompts`; one per run",
    )
    ap.add_argument("--concurrency", action="append", type=int, required=True, help="one per --dataset")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    if len(a.dataset) != len(a.concurrency):
        ap.error("give one --concurrency per --dataset")

    import torch
    import transformers
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM, StoppingCriteria, StoppingCriteriaList

    from kvgate.bench import RequestRecord, load_dataset, record_json, summarize

    if a.threads:
        torch.set_num_threads(a.threads)
    path = a.model_dir or model_dir()
    dtype = getattr(torch, a.dtype)
    t = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(path, dtype=dtype).eval()
    load_s = time.perf_counter() - t
    tok = Tokenizer.from_file(f"{path}/tokenizer.json")
    pad = 2

    class Stamp(StoppingCriteria):
        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def generate(batch_ids: list[list[int]], n_out: int) -> tuple[float, list[float]]:
        width = max(len(x) for x in batch_ids)
        ids = torch.tensor([[pad] * (width - len(x)) + x for x in batch_ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch_ids])
        stamp = Stamp()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n_out,
                min_new_tokens=n_out,
                do_sample=False,
                pad_token_id=pad,
                stopping_criteria=StoppingCriteriaList([stamp]),
            )
        return t0, stamp.times

    generate([[1, 2, 3, 4]], 4)  # warm-up
    runs = []
    for path_ds, c in zip(a.dataset, a.concurrency, strict=True):
        prompts = load_dataset(path_ds)
        ids = [p.prompt_ids or tok.encode(p.text, add_special_tokens=False).ids for p in prompts]
        records = []
        t_run = time.perf_counter()
        when = {"start": time.strftime("%H:%M:%S"), "loadavg_1m_before": os.getloadavg()[0]}
        for start in range(0, len(ids), c):
            batch = ids[start : start + c]
            t0, times = generate(batch, a.output_len)
            for j, x in enumerate(batch):
                r = RequestRecord(
                    index=start + j, sent_at=t0 - t_run, status=200, ok=True, prompt_tokens=len(x)
                )
                r.ttft_ms = (times[0] - t0) * 1000
                r.itl_ms = [(b - q) * 1000 for q, b in zip(times, times[1:], strict=False)]
                r.e2e_ms = (times[-1] - t0) * 1000
                r.output_tokens = len(times)
                r.requested_output = a.output_len
                r.finish_reason = "length"
                records.append(r)
            print(f"[hf {a.dtype} c={c}] {len(records)}/{len(ids)} done", file=sys.stderr, flush=True)
        when.update(seconds=time.perf_counter() - t_run, loadavg_1m_after=os.getloadavg()[0])
        duration = max(r.sent_at + r.e2e_ms / 1000 for r in records)
        runs.append(
            {
                "label": f"transformers {a.dtype} c={c}",
                "concurrency": c,
                "request_rate": None,
                "num_requests": len(ids),
                "output_len": a.output_len,
                "summary": summarize(records, duration),
                "when": when,
                "records": [record_json(r) for r in records],
            }
        )
    meta = {
        "tool": "bench.hf_harness (transformers generate, static batches, no HTTP)",
        "model": path,
        "dtype": a.dtype,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_seconds": load_s,
        "argv": list(sys.argv[1:] if argv is None else argv),
    }
    with open(a.json, "w") as f:
        json.dump({"meta": meta, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
