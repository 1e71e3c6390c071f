"""`kvgate tokenizer --out DIR`: the served model's tokenizer as a Hugging Face tokenizer directory.

Benchmark and evaluation clients (guidellm, genai-bench, evalscope's perf, lm-eval's huggingface
tokenizer backend) count and template prompts with an HF tokenizer named by a hub id or a directory.
Offline, or for a GGUF file, there is no hub id to give them (QA pass 14: each failed on a hub download;
the helper built a directory by hand from `GET /tokenizer_info`). This writes the one kvgate serves
with: `tokenizer.json` (the model's own, or the one built from the GGUF's vocabulary), a
`tokenizer_config.json` with the chat template, the special tokens and `add_bos_token` kvgate renders
and encodes with, and the model's `config.json` when it has one. `AutoTokenizer.from_pretrained(DIR)`
then encodes as the server does, and templates plain chats (system, user, assistant turns, string
content) as it does (tests/test_tokenizer_export.py). Not what the server does beyond the model's own
template: its tool prompt for a template that reads no `tools`, the `developer` role as `system`, and
content given as text parts; a client templating such chats itself gets the model's template's output
(QA pass 15: 165 against 31 tokens with tools).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from kvgate.tokenizer import FALLBACK_TEMPLATE


def export_tokenizer(model: str, out: str) -> list[Path]:
    """Write `model`'s tokenizer into the directory `out` (made if missing); the files written."""
    from kvgate.models import load_model, resolve_model_path
    from kvgate.models.gguf_loader import convert_to_cache

    loaded = load_model(model)  # a GGUF is converted once into kvgate's cache; weights stay unread
    info = loaded.tokenizer
    spec = json.loads(info.tokenizer_json)
    vocab = {t["id"]: t["content"] for t in spec.get("added_tokens", [])}
    model_vocab = spec.get("model", {}).get("vocab", {})
    by_id = {i: t for t, i in model_vocab.items()} if isinstance(model_vocab, dict) else {}

    def text(i: int | None) -> str | None:
        return None if i is None else vocab.get(i, by_id.get(i))

    target = Path(out).expanduser()
    if target.exists() and not target.is_dir():
        raise ValueError(f"--out {target} is a file, not a directory: give a directory to write into")
    target.mkdir(parents=True, exist_ok=True)
    written = [target / "tokenizer.json", target / "tokenizer_config.json"]
    written[0].write_text(info.tokenizer_json)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": info.chat_template or FALLBACK_TEMPLATE,  # the one chat requests render with
        "bos_token": text(info.bos_token_id),
        "eos_token": text(info.eos_token_id),
        "add_bos_token": info.add_bos_token,
        "model_max_length": loaded.spec.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }
    written[1].write_text(json.dumps(config, indent=1, ensure_ascii=False) + "\n")
    source = resolve_model_path(model)
    folder = source if source.is_dir() else convert_to_cache(source)
    if (folder / "config.json").is_file():
        written.append(Path(shutil.copyfile(folder / "config.json", target / "config.json")))
    return written
