"""`kvgate bench`: drive any OpenAI-compatible endpoint and report latency and throughput.

In the spirit of `vllm bench serve`: fixed-length synthetic prompts (counted with the server's own
tokenizer when it exposes one) or a JSONL dataset, a fixed client concurrency or Poisson arrivals,
streaming over httpx, and per-request TTFT / TPOT / ITL / E2E. Refusals are first-class results: the
report counts 200/400/429/503/other and whether each 429/503 carried Retry-After.

Definitions (the same as vLLM's):
- TTFT: request sent -> first non-empty streamed text chunk.
- ITL: gaps between consecutive non-empty text chunks.
- TPOT: (E2E - TTFT) / (output tokens - 1), per request.
- E2E: request sent -> stream closed.
- throughput: tokens of completed requests / wall time of the run (first send -> last completion).
- goodput: completed requests that meet every SLO given with --slo, per second.

The parts: `records` (a request to send, what was measured), `workload` (synthetic prompts, JSONL
datasets), `client` (the server: token counting, negotiation, one streamed request), `runner` (one
run at a concurrency / arrival rate), `summary` (percentiles, throughput, goodput, status counts),
`report` (text table, plots) and `cli` (flags, the sweep, `main`). Everything is re-exported here, so
`from kvgate.bench import main, summarize, ...` keeps working.
"""

from __future__ import annotations

from kvgate.bench.cli import build_parser, main, parse_list, run_bench
from kvgate.bench.client import Target, root_url
from kvgate.bench.records import Prompt, RequestRecord, record_json
from kvgate.bench.report import print_report, write_plots
from kvgate.bench.runner import Progress, RunConfig, run_once
from kvgate.bench.summary import SLO_KEYS, parse_duration_ms, parse_slo, percentile, stats, summarize
from kvgate.bench.workload import WORDS, build_prompts, load_dataset

__all__ = [
    "SLO_KEYS",
    "WORDS",
    "Progress",
    "Prompt",
    "RequestRecord",
    "RunConfig",
    "Target",
    "build_parser",
    "build_prompts",
    "load_dataset",
    "main",
    "parse_duration_ms",
    "parse_list",
    "parse_slo",
    "percentile",
    "print_report",
    "record_json",
    "root_url",
    "run_bench",
    "run_once",
    "stats",
    "summarize",
    "write_plots",
]
