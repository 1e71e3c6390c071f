"""The model's own sampling defaults, for requests that leave a field out (vLLM's `--generation-config
auto`, llama-server's `general.sampling.*`).

Qwen3's files ask for temperature 0.6, top_p 0.95, top_k 20 (greedy decoding repeats itself); Llama 3.x's
for temperature 0.6, top_p 0.9. vLLM reads them from `generation_config.json` and llama-server from a
GGUF's `general.sampling.*` keys; either way a request that does not set a field gets the model's value,
and one that does keeps its own. kvgate reads both at load (`kvgate.models.hf_loader`,
`kvgate.models.gguf_tokenizer`) into the tokenizer info's `sampling_defaults`, and `--generation-config
vllm` (vLLM's name for "ignore them") keeps kvgate's own defaults: temperature 1, no top_p/top_k/min_p,
no repetition penalty. Only these five fields are taken, as vLLM takes them; `max_new_tokens` is not.
"""

from __future__ import annotations

import os

from kvgate.flag_types import one_of

CHOICES = ("auto", "vllm")


def of(engine, settings) -> dict:
    """The defaults a request's left-out fields take: the model's under auto, none under vllm."""
    if getattr(settings, "generation_config", "auto") != "auto":
        return {}
    return dict(getattr(engine.tokenizer.info, "sampling_defaults", None) or {})


def announce(engine, settings) -> str | None:
    """The start-up line naming the model's defaults in force (vLLM logs the same), or None."""
    found = dict(getattr(engine.tokenizer.info, "sampling_defaults", None) or {})
    if not found:
        return None
    if settings.generation_config != "auto":
        return f"the model's sampling defaults {found} are not used (--generation-config {settings.generation_config})"
    return f"requests that leave them out get the model's sampling defaults {found} (--generation-config vllm: not)"


def add_generation_config_flag(parser) -> None:
    parser.add_argument(
        "--generation-config",
        type=one_of(*CHOICES),
        default=os.environ.get("KVGATE_GENERATION_CONFIG", "auto"),
        help="auto: a request that leaves temperature, top_p, top_k, min_p or repetition_penalty out gets "
        "the model's own (generation_config.json, a GGUF's general.sampling.*), as vLLM and llama-server "
        "do; vllm: kvgate's defaults (temperature 1, none of the others) [KVGATE_GENERATION_CONFIG]",
    )
